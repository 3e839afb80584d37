"""Deterministic random layer inputs, in numpy, so both frameworks start from the same bits.

Scaled so that every stage's output is O(1): weights ~ N(0, 1/K) for a
``[.., N, K]`` matrix, activations ~ N(0, 1), router logits ~ N(0, 1) plus a skew.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from moe_contract.config import MoEConfig

ROUTING_SKEWS = ("uniform", "zipf", "one-expert")
#: The dtypes :func:`make_layer_inputs` holds ``w13`` / ``w2`` in: ``"float32"`` (the draw), or ``"bfloat16"`` (each
#: expert drawn in float32 as for ``"float32"`` and rounded to bf16, round-to-nearest-even, into a bf16 array: the
#: same values as ``w.astype(ml_dtypes.bfloat16)`` of the float32 draw, at 2 bytes a weight on the host).
WEIGHT_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class LayerInputs:
    """Global (all-rank) float32 inputs of one layer.

    x: [T, H]; router_logits: [T, E]; w13: [E + S, 2*I, H]; w2: [E + S, H, I] (float32, or ml_dtypes bfloat16
    when drawn with ``weights_dtype="bfloat16"``, :func:`make_layer_inputs`);
    e_score_correction_bias: [E] (used by biased_grouped_topk only);
    shared_expert_gate_logits: [T, S] (``config.shared_expert_gate`` only, else None:
    :func:`shared_expert_gate_logits`).
    """

    x: np.ndarray
    router_logits: np.ndarray
    w13: np.ndarray
    w2: np.ndarray
    e_score_correction_bias: np.ndarray
    shared_expert_gate_logits: np.ndarray | None = None


def _expert_generators(seed: int, num_total_experts: int) -> list[np.random.Generator]:
    """One generator per expert (global index ``e``), spawned from ``seed``: expert ``e``'s ``w13`` and then
    its ``w2`` come from generator ``e`` alone, so experts can be drawn in any order, in parallel, or
    only this rank's (numpy's documented way to draw in parallel: ``SeedSequence.spawn``)."""
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(num_total_experts)]


def _draw_expert(gen: np.random.Generator, w13_e: np.ndarray, w2_e: np.ndarray) -> None:
    """Fill ``w13_e [2I, H]`` then ``w2_e [H, I]`` (float32, C-contiguous) from ``gen``, scaled by 1/sqrt(K)."""
    f32 = np.float32
    for w in (w13_e, w2_e):
        gen.standard_normal(dtype=f32, out=w)
        w *= f32(1.0 / np.sqrt(w.shape[1]))


def for_each_expert(fn, num_experts: int) -> None:
    """``fn(e)`` for ``e`` in ``range(num_experts)`` on all cores (threads: numpy's generators and casts
    release the GIL, so per-expert work on big layers runs in parallel)."""
    with ThreadPoolExecutor(max(1, min(32, os.cpu_count() or 1))) as pool:
        list(pool.map(fn, range(num_experts)))


def _draw_bias(rng: np.random.Generator, E: int) -> np.ndarray:
    """``e_score_correction_bias [E]`` ~ N(0, 0.01), float32."""
    return (rng.standard_normal((E,), dtype=np.float32) * np.float32(0.1)).astype(np.float32)


def make_layer_inputs(config: MoEConfig, num_tokens: int, seed: int = 0, routing: str = "uniform",
                      weights_dtype: str = "float32") -> LayerInputs:
    """Random float32 inputs for ``config`` with ``T = num_tokens``.

    ``x``, ``router_logits`` and the bias come from ``default_rng(seed)``; expert ``e``'s weights from its
    own generator (``SeedSequence(seed).spawn``), drawn on all cores (numpy's generators release the
    GIL), so a DeepSeek-V3-size layer (11G float32 values) is drawn in seconds, not minutes. A
    ``config.shared_expert_gate`` layer also gets ``shared_expert_gate_logits [T, S]``
    (:func:`shared_expert_gate_logits`; its own generator, so the other draws are unchanged).
    ``routing`` skews the router logits: ``"uniform"`` (none), ``"zipf"`` (expert ``e``
    gets a logit bonus of ``-1.2 * log(e + 1)``, so a few experts take most rows) or
    ``"one-expert"`` (expert 0 gets +30, so every token picks it first).
    ``weights_dtype`` (:data:`WEIGHT_DTYPES`): ``"bfloat16"`` holds ``w13`` / ``w2`` as ml_dtypes bfloat16, each
    expert drawn in float32 by its generator (as ``"float32"`` draws it) and rounded to bf16 into a preallocated
    array: exactly ``w.astype(ml_dtypes.bfloat16)`` of the float32 draw, without the float32 layer on the host
    (2 bytes a weight, plus one float32 expert per thread); every other input is unchanged.

    Raises: ValueError for an unknown ``routing`` or ``weights_dtype``, or ``num_tokens`` / ``seed`` not an int >= 0.
    """
    if routing not in ROUTING_SKEWS:
        raise ValueError(f"make_layer_inputs: routing must be one of {ROUTING_SKEWS}; got routing={routing!r}")
    if weights_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"make_layer_inputs: weights_dtype must be one of {WEIGHT_DTYPES}; got "
                         f"weights_dtype={weights_dtype!r}")
    for name, v in (("num_tokens", num_tokens), ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"make_layer_inputs: {name} must be an int >= 0; got {name}={v!r}")
    rng = np.random.default_rng(seed)
    T, H, I, E = num_tokens, config.hidden_size, config.intermediate_size, config.num_experts
    E_all = config.num_total_experts
    f32 = np.float32
    x = rng.standard_normal((T, H), dtype=f32)
    logits = rng.standard_normal((T, E), dtype=f32)
    if routing == "zipf":
        logits += (-1.2 * np.log(np.arange(1, E + 1, dtype=f32)))[None, :]
    elif routing == "one-expert":
        logits[:, 0] += 30.0
    bias = _draw_bias(rng, E)
    gens = _expert_generators(seed, E_all)
    if weights_dtype == "float32":
        w13 = np.empty((E_all, 2 * I, H), f32)
        w2 = np.empty((E_all, H, I), f32)
        for_each_expert(lambda e: _draw_expert(gens[e], w13[e], w2[e]), E_all)
    else:
        import ml_dtypes

        w13 = np.empty((E_all, 2 * I, H), ml_dtypes.bfloat16)
        w2 = np.empty((E_all, H, I), ml_dtypes.bfloat16)

        def draw_bf16(e: int) -> None:  # expert e in float32 (its generator), rounded into the bf16 arrays
            w13_e, w2_e = np.empty((2 * I, H), f32), np.empty((H, I), f32)
            _draw_expert(gens[e], w13_e, w2_e)
            w13[e], w2[e] = w13_e, w2_e

        for_each_expert(draw_bf16, E_all)
    return LayerInputs(x=x, router_logits=logits.astype(f32), w13=w13, w2=w2, e_score_correction_bias=bias,
                       shared_expert_gate_logits=shared_expert_gate_logits(config, x, seed))


def check_seed(op: str, seed) -> None:
    """``seed`` of the seeded draws here (``from_preset``'s): an int >= 0, numpy's own ints included; else a
    ``ValueError`` naming ``op`` and the argument (numpy's own message names neither)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"{op}: seed must be an int >= 0 (the numpy seed of the random weights); got seed={seed!r}")


def draw_preset_weights(config: MoEConfig, seed: int) -> Iterator[tuple[str, int, np.ndarray]]:
    """This rank's slice of ``make_layer_inputs(config, num_tokens=0, seed)``, one expert at a time.

    Yields ``("w13", e_local, [2*I, H])`` and ``("w2", e_local, [H, I])`` for each local expert in
    turn, then ``("bias", -1, [E])``, numpy float32, bit-identical to that function's arrays (each
    expert has its own generator, so no float32 copy of a full-size layer is ever held and other
    ranks' experts are never drawn). Framework-free, so both modules (``EPMoE.from_preset``,
    ``MoELayer.from_preset``) draw the same bits.
    """
    f32 = np.float32
    H, I = config.hidden_size, config.intermediate_size
    start, e_local = config.local_expert_range()
    gens = _expert_generators(seed, config.num_total_experts)
    for e in range(e_local):
        w13_e, w2_e = np.empty((2 * I, H), f32), np.empty((H, I), f32)
        _draw_expert(gens[start + e], w13_e, w2_e)
        yield "w13", e, w13_e
        yield "w2", e, w2_e
    # make_layer_inputs draws x [T, H] and router_logits [T, E] before the bias: nothing at T = 0.
    yield "bias", -1, _draw_bias(np.random.default_rng(seed), config.num_experts)


def draw_shared_expert_gate(config: MoEConfig, seed: int) -> np.ndarray | None:
    """The shared-expert gate weight of a ``config.shared_expert_gate`` layer (Qwen3-Next's
    ``shared_expert_gate.weight``): ``[1, H]`` float32 ~ N(0, 1/H) from ``default_rng((seed, 15))`` (its own
    generator: the other draws are unchanged), so that ``sigmoid(x @ w.T)`` is O(1) and spread; ``None``
    without ``config.shared_expert_gate``. Both modules' ``from_preset`` draw it here (the same bits)."""
    if not config.shared_expert_gate:
        return None
    H = config.hidden_size
    w = np.random.default_rng((seed, 15)).standard_normal((1, H), dtype=np.float32)
    return (w * np.float32(1.0 / np.sqrt(H))).astype(np.float32)


def shared_expert_gate_logits(config: MoEConfig, x: np.ndarray, seed: int) -> np.ndarray | None:
    """The layer input ``shared_expert_gate_logits [T, S]`` float32 of a ``config.shared_expert_gate`` layer
    (``None`` without): ``x [T, H] @ draw_shared_expert_gate(config, seed).T`` in float32, the gate's one logit
    per token given to every fused shared slot, as the modules compute them from their ``[1, H]`` gate weight
    (``EPMoE.shared_expert_gate_logits``); O(1) and spread (the weight is ~ N(0, 1/H))."""
    gate = draw_shared_expert_gate(config, seed)
    if gate is None:
        return None
    logits = np.asarray(x, np.float32) @ gate.T  # [T, 1]
    return np.ascontiguousarray(np.broadcast_to(logits, (x.shape[0], config.num_fused_shared_experts)), np.float32)


def draw_expert_biases(config: MoEConfig, seed: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The per-expert biases of a ``config.expert_bias`` layer (gpt-oss's ``gate_up_proj_bias`` /
    ``down_proj_bias``): ``(w13_bias [E + S, 2*I], w2_bias [E + S, H])`` float32 ~ N(0, 1/4) from
    ``default_rng((seed, 16))`` (their own generator: the other draws are unchanged), every expert of the layer
    (a rank takes its slice, ``local_weights``); ``None`` without ``config.expert_bias``. Both modules'
    ``from_preset`` draw them here (the same bits)."""
    if not config.expert_bias:
        return None
    E_all, H, I = config.num_total_experts, config.hidden_size, config.intermediate_size
    rng = np.random.default_rng((seed, 16))
    half = np.float32(0.5)
    b13 = rng.standard_normal((E_all, 2 * I), dtype=np.float32) * half
    b2 = rng.standard_normal((E_all, H), dtype=np.float32) * half
    return b13.astype(np.float32), b2.astype(np.float32)


def draw_router(config: MoEConfig, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The router of a block of ``config`` (transformers' ``gate.weight``, gpt-oss's ``router.weight`` and
    ``router.bias``): ``(weight [E, H] float32 ~ N(0, 1/H), bias [E] float32 ~ N(0, 1/4) or None)`` from
    ``default_rng((seed, 17))`` (its own generator: the layer's draws are unchanged). The bias is drawn for a
    ``config.expert_bias`` layer only (gpt-oss's ``GptOssTopKRouter`` is the one router with a bias). With
    ``x ~ N(0, 1)`` the logits are O(1) and spread, so the top-k is not a near tie. Both packages'
    ``MoEBlock.from_preset`` draw it here (the same bits)."""
    E, H = config.num_experts, config.hidden_size
    rng = np.random.default_rng((seed, 17))
    weight = (rng.standard_normal((E, H), dtype=np.float32) * np.float32(1.0 / np.sqrt(H))).astype(np.float32)
    bias = None
    if config.expert_bias:
        bias = (rng.standard_normal((E,), dtype=np.float32) * np.float32(0.5)).astype(np.float32)
    return weight, bias
