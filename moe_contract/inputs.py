"""Deterministic random layer inputs, in numpy, so both frameworks start from the same bits.

Scaled so that every stage's output is O(1) (STYLE.md): weights ~ N(0, 1/K) for a
``[.., N, K]`` matrix, activations ~ N(0, 1), router logits ~ N(0, 1) plus a skew.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from moe_contract.config import MoEConfig

ROUTING_SKEWS = ("uniform", "zipf", "one-expert")


@dataclasses.dataclass(frozen=True)
class LayerInputs:
    """Global (all-rank) float32 inputs of one layer.

    x: [T, H]; router_logits: [T, E]; w13: [E + S, 2*I, H]; w2: [E + S, H, I];
    e_score_correction_bias: [E] (used by biased_grouped_topk only).
    """

    x: np.ndarray
    router_logits: np.ndarray
    w13: np.ndarray
    w2: np.ndarray
    e_score_correction_bias: np.ndarray


def make_layer_inputs(config: MoEConfig, num_tokens: int, seed: int = 0, routing: str = "uniform") -> LayerInputs:
    """Random float32 inputs for ``config`` with ``T = num_tokens``.

    ``routing`` skews the router logits: ``"uniform"`` (none), ``"zipf"`` (expert ``e``
    gets a logit bonus of ``-1.2 * log(e + 1)``, so a few experts take most rows) or
    ``"one-expert"`` (expert 0 gets +30, so every token picks it first).
    """
    if routing not in ROUTING_SKEWS:
        raise ValueError(f"make_layer_inputs: routing must be one of {ROUTING_SKEWS}; got routing={routing!r}")
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
    w13 = rng.standard_normal((E_all, 2 * I, H), dtype=f32)
    w13 *= f32(1.0 / np.sqrt(H))  # in place: no second full-size temporary
    w2 = rng.standard_normal((E_all, H, I), dtype=f32)
    w2 *= f32(1.0 / np.sqrt(I))
    bias = (rng.standard_normal((E,), dtype=f32) * f32(0.1)).astype(f32)
    return LayerInputs(x=x, router_logits=logits.astype(f32), w13=w13, w2=w2, e_score_correction_bias=bias)


def draw_preset_weights(config: MoEConfig, seed: int) -> Iterator[tuple[str, int, np.ndarray]]:
    """This rank's slice of ``make_layer_inputs(config, num_tokens=0, seed)``, one expert at a time.

    Yields ``("w13", e_local, [2*I, H])``, then ``("w2", e_local, [H, I])``, then
    ``("bias", -1, [E])``, numpy float32, bit-identical to that function's arrays (the same numpy
    stream, drawn expert by expert so that no float32 copy of a full-size layer is ever held;
    experts of other ranks are drawn and dropped). Framework-free, so both modules (``EPMoE.from_preset``,
    ``MoELayer.from_preset``) draw the same bits.
    """
    rng = np.random.default_rng(seed)
    f32 = np.float32
    H, I = config.hidden_size, config.intermediate_size
    start, e_local = config.local_expert_range()
    # make_layer_inputs draws x [T, H] and router_logits [T, E] first: nothing at T = 0.
    for name, shape, k in (("w13", (2 * I, H), H), ("w2", (H, I), I)):
        for e in range(config.num_total_experts):
            w = rng.standard_normal(shape, dtype=f32)
            if start <= e < start + e_local:
                w *= f32(1.0 / np.sqrt(k))
                yield name, e - start, w
    yield "bias", -1, (rng.standard_normal((config.num_experts,), dtype=f32) * f32(0.1)).astype(f32)
