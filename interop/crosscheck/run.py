"""Running: the inputs and the stage-by-stage driver (:func:`run_crosscheck`); what each stage calls is
the stage table's (``stages.py``), the verdicts are the judge's (``judge.py``); the expert-parallel
summary is ``ep.py``."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from interop.crosscheck.convert import to_numpy
from interop.crosscheck.judge import Comparison, CrossCheckResult, judge_stage
from interop.crosscheck.stages import (
    BACKWARD_STAGES,
    DEFAULT_IMPLEMENTATIONS,
    EP_STAGE,
    FORWARD_STAGES,
    IMPLEMENTATIONS,
    REFERENCE,
    UPSTREAM,
    WEIGHTS_STAGE,
    Impl,
    Stage,
    Upstream,
)
from moe_contract.config import MoEConfig
from moe_contract.inputs import LayerInputs, for_each_expert, make_layer_inputs, shared_expert_gate_logits

# --------------------------------------------------------------------------------------
# Inputs


@dataclasses.dataclass
class LayerWeights:
    """Global float (or FP8) weights of one layer: ``w13 [E+S, 2I, H]``, ``w2 [E+S, H, I]``, numpy.

    ``w13_scale`` / ``w2_scale``: given with FP8 codes (e.g. a DeepSeek-V3 FP8 checkpoint; float32 multipliers) or
    4-bit codes (gpt-oss's MXFP4 checkpoint: uint8 ``[E+S, N, K/2]`` codes, uint8 e8m0 ``[E+S, N, K/32]`` scales),
    else None.
    ``router_weight [E, H]``: the gate's linear layer; when given, ``router_logits = x @ router_weight.T``
    (``+ router_bias``).
    ``router_bias [E]`` float32: the router's bias (gpt-oss's ``GptOssTopKRouter.bias``), added to the logits
    computed from ``router_weight`` (one set of logits, given to both frameworks' implementations alike); None:
    no bias. Refused without ``router_weight`` (ValueError in :func:`make_inputs`).
    ``shared_expert_gate [1, H]`` or ``[S, H]``: Qwen3-Next's shared-expert gate weight; when given,
    ``shared_expert_gate_logits = x @ shared_expert_gate.T`` (else the seeded one of
    :func:`moe_contract.inputs.shared_expert_gate_logits`).
    ``w13_bias [E+S, 2I]``, ``w2_bias [E+S, H]``: gpt-oss's expert biases (``config.expert_bias``; required then).
    """

    w13: np.ndarray
    w2: np.ndarray
    w13_scale: np.ndarray | None = None
    w2_scale: np.ndarray | None = None
    router_weight: np.ndarray | None = None
    e_score_correction_bias: np.ndarray | None = None
    shared_expert_gate: np.ndarray | None = None
    w13_bias: np.ndarray | None = None
    w2_bias: np.ndarray | None = None
    router_bias: np.ndarray | None = None


def cast_experts(w: np.ndarray, dtype) -> np.ndarray:
    """``w [E, ...].astype(dtype)`` as a new C-contiguous array, one expert per task on all cores
    (:func:`moe_contract.inputs.for_each_expert`; a DeepSeek-V3 layer is 11G values)."""
    out = np.empty(w.shape, dtype)
    for_each_expert(lambda e: out.__setitem__(e, w[e]), w.shape[0])
    return out


def make_inputs(config: MoEConfig, num_tokens: int, seed: int, routing: str, weights: LayerWeights | None,
                x: np.ndarray | None = None, router_logits: np.ndarray | None = None, weights_dtype: str = "float32"):
    """The float32 layer inputs (``LayerInputs``) plus the FP8 weights given, if any.

    ``weights_dtype="bfloat16"``: random weights held as their bf16 rounding (``make_layer_inputs``'s
    ``weights_dtype``: the values every stage takes, without the float32 layer on the host); random weights only.

    ``x [T, H]`` and ``router_logits [T, E]`` (float, e.g. :func:`interop.checkpoints.load_inputs`) replace
    the random ones; without ``router_logits`` they are ``bf16(x) @ router_weight.T (+ router_bias)`` in float32
    (``weights`` must have the router then). A ``config.shared_expert_gate`` layer's ``shared_expert_gate_logits
    [T, S]`` are ``x`` times the seeded gate weight (:func:`moe_contract.inputs.shared_expert_gate_logits`), given ``x`` or not, or with
    ``weights.shared_expert_gate`` ``bf16(x) @ shared_expert_gate.T`` (as the router logits).
    Raises ValueError on shapes other than ``[num_tokens, H]`` / ``[num_tokens, E]``, on a ``weights.router_bias``
    not ``[E]`` or without ``weights.router_weight``, on ``weights_dtype`` other than ``"float32"`` with given
    ``weights`` (they come as they are); TypeError on a ``router_bias`` not float32.
    """
    T, H, E = num_tokens, config.hidden_size, config.num_experts
    if weights is not None and weights_dtype != "float32":
        raise ValueError(f"make_inputs: weights_dtype={weights_dtype!r} draws random weights; the given weights are "
                         f"used as they are (weights_dtype='float32')")
    rb = None if weights is None else weights.router_bias
    if rb is not None:  # gpt-oss's router bias: checked on the host, never dropped
        if weights.router_weight is None:
            raise ValueError("make_inputs: weights.router_bias needs weights.router_weight (the logits are "
                             "x @ router_weight.T + router_bias); got a bias without the router weight")
        if np.ndim(rb) != 1 or np.shape(rb) != (E,):
            raise ValueError(f"make_inputs: weights.router_bias must be [E] = ({E},) (the router's bias); got shape "
                             f"{np.shape(rb)}")
        if np.asarray(rb).dtype != np.float32:
            raise TypeError(f"make_inputs: weights.router_bias must have dtype float32; got {np.asarray(rb).dtype}")
    if x is not None and (x.ndim != 2 or x.shape != (T, H)):
        raise ValueError(f"make_inputs: x must be [T={T}, H={H}]; got shape {x.shape}")
    if router_logits is not None and (x is None or router_logits.shape != (T, E)):
        raise ValueError(f"make_inputs: router_logits must come with x and be [T={T}, E={E}]; got shape "
                         f"{router_logits.shape}{'' if x is not None else ' without x'}")
    if x is not None and router_logits is None and (weights is None or weights.router_weight is None):
        raise ValueError("make_inputs: x without router_logits needs the router weight (weights.router_weight) "
                         "to compute them; random weights have none")
    if weights is None:
        inputs = make_layer_inputs(config, num_tokens, seed=seed, routing=routing, weights_dtype=weights_dtype)
        if x is not None:
            x = np.asarray(x, np.float32)
            inputs = dataclasses.replace(inputs, x=x, router_logits=np.asarray(router_logits, np.float32),
                                         shared_expert_gate_logits=shared_expert_gate_logits(config, x, seed))
        return inputs, None, None
    rng = np.random.default_rng(seed)
    if x is None:
        x = rng.standard_normal((num_tokens, config.hidden_size), dtype=np.float32)
    x = np.asarray(x, np.float32)
    if router_logits is not None:
        logits = np.asarray(router_logits, np.float32)
    elif weights.router_weight is not None:
        xb = x.astype(ml_dtypes.bfloat16).astype(np.float32)
        logits = (xb @ weights.router_weight.astype(np.float32).T).astype(np.float32)
        if weights.router_bias is not None:  # gpt-oss: GptOssTopKRouter's logits x @ W.T + b
            logits = logits + np.asarray(weights.router_bias, np.float32)
    else:
        logits = rng.standard_normal((num_tokens, config.num_experts), dtype=np.float32)
    bias = weights.e_score_correction_bias
    if bias is None:
        bias = np.zeros((config.num_experts,), np.float32)
    shared = shared_expert_gate_logits(config, x, seed)
    if shared is not None and weights.shared_expert_gate is not None:  # the layer's own gate weight, [1, H] or [S, H]
        gate = np.asarray(weights.shared_expert_gate).astype(np.float32)
        xb = x.astype(ml_dtypes.bfloat16).astype(np.float32)
        shared = np.ascontiguousarray(np.broadcast_to(xb @ gate.T, shared.shape), np.float32)
    inputs = LayerInputs(x=x, router_logits=logits, w13=weights.w13, w2=weights.w2,
                         e_score_correction_bias=bias.astype(np.float32), shared_expert_gate_logits=shared)
    return inputs, weights.w13_scale, weights.w2_scale


#: How the backward's cotangent is drawn (for the docs and the JSON's meta).
COTANGENT = "d_out [T, H] ~ N(0, 1) from numpy default_rng((seed, 8)), in the activation dtype"


def expert_biases(config: MoEConfig, seed: int, weights: LayerWeights | None) -> tuple[np.ndarray, np.ndarray] | None:
    """A ``config.expert_bias`` layer's ``(w13_bias [E+S, 2I], w2_bias [E+S, H])`` of every expert, bf16 (a model's
    values, as the weights): the given ``weights``' or, for random weights, :func:`moe_contract.inputs.draw_expert_biases`;
    None without ``config.expert_bias``. Raises ValueError for given weights without their biases (never dropped)."""
    if not getattr(config, "expert_bias", False):
        return None
    if weights is not None:
        if weights.w13_bias is None or weights.w2_bias is None:
            raise ValueError("make_inputs: config.expert_bias=True needs the layer's biases (LayerWeights.w13_bias "
                             "[E+S, 2I], w2_bias [E+S, H]); the given weights have none")
        b13, b2 = weights.w13_bias, weights.w2_bias
    else:
        from moe_contract.inputs import draw_expert_biases

        b13, b2 = draw_expert_biases(config, seed)
    return tuple(np.asarray(b).astype(np.float32).astype(ml_dtypes.bfloat16) for b in (b13, b2))


def shared_logits_source(weights: LayerWeights | None) -> str:
    """Where :func:`make_inputs` took a ``shared_expert_gate`` layer's ``shared_expert_gate_logits`` from (the meta)."""
    if weights is not None and weights.shared_expert_gate is not None:
        return "bf16(x) @ the given shared_expert_gate.T"
    return "x @ the seeded gate weight (moe_contract.inputs.shared_expert_gate_logits)"


def make_cotangent(num_tokens: int, hidden_size: int, seed: int, dtype=ml_dtypes.bfloat16) -> np.ndarray:
    """The backward's seeded random cotangent ``d_out [T, H]`` (:data:`COTANGENT`): O(1), never zeros,
    independent of the forward inputs' draw (its own generator)."""
    rng = np.random.default_rng((seed, 8))
    return rng.standard_normal((num_tokens, hidden_size), dtype=np.float32).astype(dtype)


# --------------------------------------------------------------------------------------
# Running


def _check_names(op: str, implementations: Sequence[str]) -> list[str]:
    unknown = [n for n in implementations if n not in IMPLEMENTATIONS]
    if unknown:
        raise ValueError(f"{op}: implementations must be among {tuple(IMPLEMENTATIONS)}; got {unknown}")
    return list(dict.fromkeys(implementations))


#: MoEConfig fields the stage table does not model yet: a config with any of them set is refused, not checked as
#: another layer (e.g. per-expert biases dropped). Modelled: ``apply_router_weight_on_input`` and
#: ``shared_expert_gate`` (the ``slot_weights`` / ``scaled_slot_rows`` stages and their backward), ``expert_bias``
#: (the GEMMs' ``bias=``, the ``gemm*_dbias`` stages), the 4-bit quant modes (``w_format=``, section 9).
UNMODELLED_FIELDS: tuple[str, ...] = ()
#: Quant modes the stage table does not model yet.
UNMODELLED_QUANTS: tuple[str, ...] = ()


def check_modelled(op: str, config: MoEConfig) -> None:
    """``NotImplementedError`` naming a :data:`UNMODELLED_FIELDS` field that ``config`` sets, or a
    :data:`UNMODELLED_QUANTS` quant mode: the stage table would check another layer than the one asked for."""
    on = [name for name in UNMODELLED_FIELDS if getattr(config, name, False)]
    if on:
        raise NotImplementedError(f"{op}: the stage-by-stage cross-check does not model {', '.join(on)} yet (it "
                                  f"would drop them and check another layer); got config with "
                                  f"{', '.join(f'{n}={getattr(config, n)!r}' for n in on)}")
    if config.quant in UNMODELLED_QUANTS:
        raise NotImplementedError(f"{op}: the stage-by-stage cross-check does not model the 4-bit weight modes "
                                  f"{UNMODELLED_QUANTS} yet; got quant={config.quant!r}")


def _one_line(exc: Exception, limit: int = 400) -> str:
    return " ".join(str(exc).split())[:limit]


class _Runner:
    """Runs one implementation of one stage, records its outputs (numpy) and time, and turns a
    ``NotImplementedError`` into a skip of that implementation (every later stage too) and any other
    exception into an error of that stage (a violation)."""

    def __init__(self, progress: Callable[[str], None]):
        self.progress = progress
        self.skipped: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.outputs: dict[str, dict[str, dict[str, np.ndarray]]] = {}
        self.timings: dict[str, dict[str, float]] = {}

    def __call__(self, stage: str, impl: Impl, fn: Callable[[Impl], dict[str, Any]]) -> dict[str, np.ndarray] | None:
        if impl.name in self.skipped:
            return None
        self.progress(f"{stage}: {impl.name}")
        t0 = time.perf_counter()
        try:
            out = {k: to_numpy(v) for k, v in fn(impl).items()}
        except NotImplementedError as exc:
            self.skipped[impl.name] = f"{stage}: {' '.join(str(exc).split())}"
            return None
        except Exception as exc:  # a crash at a stage is that stage's violation
            self.errors[f"{stage}/{impl.name}"] = f"{type(exc).__name__}: {_one_line(exc)}"
            return None
        self.timings.setdefault(stage, {})[impl.name] = round(time.perf_counter() - t0, 3)
        self.outputs.setdefault(stage, {})[impl.name] = out
        return out


def run_crosscheck(
    config: MoEConfig,
    num_tokens: int = 16,
    *,
    seed: int = 0,
    routing: str = "uniform",
    implementations: Sequence[str] = DEFAULT_IMPLEMENTATIONS,
    weights: LayerWeights | None = None,
    progress: Callable[[str], None] | None = None,
    x: np.ndarray | None = None,
    router_logits: np.ndarray | None = None,
    backward: bool = False,
    weights_dtype: str = "float32",
) -> CrossCheckResult:
    """Run one set of inputs through ``implementations`` stage by stage and compare (package docstring).

    Args:
      config: the layer, with ``quant`` and the EP placement (``ep_size``, ``ep_rank``); this rank's
        experts are sliced from the global weights (``local_weights``).
      num_tokens: ``T``.
      seed, routing: the random inputs (``make_layer_inputs``; ``routing`` skews the logits); ``seed``
        also draws the backward's cotangent (:func:`make_cotangent`).
      implementations: names from :data:`IMPLEMENTATIONS`; the references are what the kernels are
        judged against, so keep the one of each framework you run kernels of.
      weights: the layer's own weights (e.g. :func:`interop.checkpoints.load_moe_layer`) instead of
        random ones; FP8 codes with scales are used as they are (``config.quant`` must match).
      progress: called with a short message before each unit of work.
      x, router_logits: given inputs ``[T, H]`` / ``[T, E]`` instead of random ones (:func:`make_inputs`).
      backward: also the backward stages (``BACKWARD_STAGES``) and the layer's gradients, judged by
        CONTRACT.md section 8; ``meta["backward"]`` says what was drawn and which stages did not run.
      weights_dtype: ``"bfloat16"`` draws the random weights straight into bf16 (:func:`make_inputs`): the
        same bf16 values every stage takes from the float32 draw (the stages never see the float32 weights),
        with 2 bytes a weight on the host instead of 4 + 2; the quant modes quantize these. Random weights only.

    Returns: :class:`CrossCheckResult`. A backend that raises ``NotImplementedError`` at a stage is
    recorded in ``skipped`` (not a violation); any other exception is an error (a violation).
    """
    progress = progress or (lambda msg: None)
    check_modelled("run_crosscheck", config)
    names = _check_names("run_crosscheck", implementations)
    impls = {n: Impl(n) for n in names}
    ref = impls.get(UPSTREAM) or Impl(UPSTREAM)  # the upstream values always come from the jnp reference
    runner = _Runner(progress)
    t_start = time.perf_counter()

    progress("inputs")
    inputs_given = x is not None
    inputs, given_s13, given_s2 = make_inputs(config, num_tokens, seed, routing, weights, x, router_logits,
                                              weights_dtype)
    bf16 = ml_dtypes.bfloat16
    start, e_local = config.local_expert_range()
    up = Upstream(
        config, x=inputs.x.astype(bf16), logits=inputs.router_logits.astype(np.float32),
        bias=inputs.e_score_correction_bias.astype(np.float32) if config.routing == "biased_grouped_topk" else None,
        d_out=make_cotangent(num_tokens, config.hidden_size, seed) if backward else None,
        shared_logits=inputs.shared_expert_gate_logits)
    fp8 = up.fp8  # FP8 codes: the FP8 rows of section 7 (4-bit weights are judged by the bf16 rows, section 9)
    biases = expert_biases(config, seed, weights)
    if biases is not None:  # this rank's rows
        up.b13, up.b2 = (np.ascontiguousarray(b[start:start + e_local]) for b in biases)

    def each(stage: Stage):
        """Run ``stage`` for the jnp reference first (its output feeds the next stage), then the rest (the
        other reference only, for a ``references_only`` stage)."""
        rest = [n for n in names if n != UPSTREAM and (not stage.references_only or n in REFERENCE.values())]
        for n in [UPSTREAM] + rest:
            out = runner(stage.name, impls.get(n) or ref, lambda impl: stage.run(impl, up))
            if n == UPSTREAM and out is None and UPSTREAM in runner.skipped:  # the reference cannot serve the layer
                raise NotImplementedError(f"run_crosscheck: the jnp reference cannot run stage {stage.name} (it feeds "
                                          f"every other implementation): {runner.skipped[UPSTREAM]}")
            if n == UPSTREAM and out is None:
                raise RuntimeError(f"run_crosscheck: the jnp reference failed at stage {stage.name}: "
                                   f"{runner.errors or runner.skipped}")
        up.ref[stage.name] = runner.outputs[stage.name][UPSTREAM]

    # ---- weights: this rank's float weights, or their FP8 quantization (references: there is no kernel)
    if up.quantized and given_s13 is not None:
        up.w13 = np.ascontiguousarray(inputs.w13[start:start + e_local])
        up.w2 = np.ascontiguousarray(inputs.w2[start:start + e_local])
        # FP8 multipliers as float32; 4-bit scales (MXFP4 uint8 e8m0) as stored: a cast would change their meaning
        scale_dtype = np.float32 if fp8 else given_s13.dtype
        up.s13 = np.ascontiguousarray(given_s13[start:start + e_local]).astype(scale_dtype)
        up.s2 = np.ascontiguousarray(given_s2[start:start + e_local]).astype(scale_dtype)
    else:
        if weights is None and inputs.w13.dtype == bf16:  # drawn in bf16: this rank's experts as they are (no copy)
            up.w13_float = np.ascontiguousarray(inputs.w13[start:start + e_local])
            up.w2_float = np.ascontiguousarray(inputs.w2[start:start + e_local])
        else:
            up.w13_float = cast_experts(inputs.w13[start:start + e_local], bf16)
            up.w2_float = cast_experts(inputs.w2[start:start + e_local], bf16)
        if up.quantized:
            each(WEIGHTS_STAGE)
            wq = up.ref[WEIGHTS_STAGE.name]
            up.w13, up.s13, up.w2, up.s2 = wq["w13"], wq["w13_scale"], wq["w2"], wq["w2_scale"]
            up.w13_float = up.w2_float = None
        else:
            up.w13, up.w2 = up.w13_float, up.w2_float

    # ---- the stages, forward then (backward=True) backward
    notes: list[str] = []
    run_stages = [WEIGHTS_STAGE] if WEIGHTS_STAGE.name in up.ref else []
    for stage in FORWARD_STAGES + (BACKWARD_STAGES if backward else ()):
        if not stage.applies(config):  # a stage of the 2026 families' slot weights, which this layer has not
            continue
        why = stage.skip(up)
        if why:
            notes.append(f"{stage.name}: not run: {why}")
            continue
        each(stage)
        run_stages.append(stage)

    # ---- compare
    M = up.M
    comparisons: list[Comparison] = []
    offsets = up.ref["routing"]["expert_offsets"]
    for stage in run_stages:
        comparisons += judge_stage(stage, runner.outputs.get(stage.name, {}), names, M, fp8, offsets)

    meta = {
        "config": dataclasses.asdict(config), "num_tokens": num_tokens, "seed": seed, "routing_skew": routing,
        "M": M, "implementations": names, "weights": "given" if weights is not None else "random (make_layer_inputs)",
        "inputs": "given" if inputs_given else "random",
        "timings_s": runner.timings, "runtime_s": round(time.perf_counter() - t_start, 2), "devices": _devices(),
    }
    if weights_dtype != "float32":
        meta["weights"] += f", drawn in {weights_dtype}"
    if config.shared_expert_gate:
        meta["shared_expert_gate_logits"] = shared_logits_source(weights)
    if biases is not None:
        meta["expert_biases"] = ("given" if weights is not None else
                                 "seeded (moe_contract.inputs.draw_expert_biases)") + ", rounded to bf16"
    if backward:
        meta["backward"] = {"cotangent": COTANGENT, "stages": [s.name for s in run_stages if s.backward],
                            "notes": notes}
    return CrossCheckResult(meta=meta, comparisons=comparisons, skipped=runner.skipped, errors=runner.errors)


def merge_results(stages: CrossCheckResult | None, ep: CrossCheckResult | None) -> CrossCheckResult:
    """One result of a per-rank stage-by-stage check and an EP summary (either may be None)."""
    if stages is None or ep is None:
        return stages or ep
    meta = {**stages.meta, "ep": ep.meta["ep"], "runtime_s": round(stages.meta["runtime_s"] + ep.meta["runtime_s"], 2),
            "timings_s": {**stages.meta["timings_s"], **ep.meta["timings_s"]}}
    skipped = {**stages.skipped, **{f"{k} ({EP_STAGE})" if k in stages.skipped else k: v for k, v in ep.skipped.items()}}
    return CrossCheckResult(meta=meta, comparisons=stages.comparisons + ep.comparisons, skipped=skipped,
                            errors={**stages.errors, **ep.errors})


def _devices() -> dict:
    out = {}
    try:
        import jax

        out["jax"] = jax.default_backend()
    except Exception:  # pragma: no cover - informational only
        pass
    try:
        import torch

        out["torch"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # pragma: no cover
        pass
    out["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return out
