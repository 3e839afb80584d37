"""The expert-parallel summary (:func:`run_ep_check`, stages ``"ep"`` and ``"ep_bwd"``): every rank's layer
end to end, summed over ranks (or, for weight gradients, sliced), against the single device."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from interop.crosscheck.convert import to_numpy
from interop.crosscheck.judge import Comparison, CrossCheckResult, compare_float
from interop.crosscheck.run import (
    COTANGENT,
    LayerWeights,
    _check_names,
    _devices,
    _one_line,
    cast_experts,
    check_modelled,
    expert_biases,
    make_cotangent,
    make_inputs,
)
from interop.crosscheck.stages import (
    DEFAULT_IMPLEMENTATIONS,
    EP_BACKWARD_STAGE,
    EP_STAGE,
    PALLAS_VS_TRITON,
    Impl,
    layer_vjp,
    pairs,
)
from moe_contract.config import FP8_QUANTS, MoEConfig
from moe_contract.tolerances import BF16_REL_FRO, F32_REL_FRO, FP8_REL_FRO, GRAD_BF16_REL_FRO, GRAD_F32_REL_FRO

EP_DTYPES = ("float32", "bfloat16")
EP_MODES = ("replicated", "all_to_all")
#: The Comparison.output of each EP row.
EP_SUM_VS_SINGLE = "ep_sum vs single-device"
EP_SUM = "ep_sum"
#: The gradients of the EP backward rows (stage ``"ep_bwd"``): the output is ``f"{grad}: {EP_SUM_VS_SINGLE}"``
#: for ``d_x`` / ``d_router_logits`` (summed over ranks) and ``f"{grad}: {EP_SLICES_VS_SINGLE}"`` for the
#: weight gradients (each rank's, against its slice of the single device's).
EP_SUMMED_GRADS = ("d_x", "d_router_logits")
#: Summed like ``EP_SUMMED_GRADS``, where the layer has the input: Qwen3-Next's shared-expert gate (section 8's EP
#: line: the sum over ranks; only the last rank, which owns the fused shared experts, gives it nonzero).
EP_GATE_GRADS = ("d_shared_expert_gate_logits",)
_SUMMED = EP_SUMMED_GRADS + EP_GATE_GRADS
EP_SLICED_GRADS = ("d_w13", "d_w2")
#: Sliced like ``EP_SLICED_GRADS``, where the layer has them: gpt-oss's expert biases (``config.expert_bias``).
EP_BIAS_GRADS = ("d_w13_bias", "d_w2_bias")
EP_SLICES_VS_SINGLE = "rank slices vs single-device"


def ep_real_output(mode: str) -> str:
    return f"ep_moe_forward[{mode}] vs single-device"


def ep_grad_output(grad: str, against_single: bool = True) -> str:
    """The ``Comparison.output`` of an EP backward row: ``grad`` against the single device (or, with
    ``against_single=False``, the implementations' summed / sliced gradient against each other)."""
    if not against_single:
        return f"{grad}: {EP_SUM}" if grad in _SUMMED else f"{grad}: rank slices"
    return f"{grad}: {EP_SUM_VS_SINGLE if grad in _SUMMED else EP_SLICES_VS_SINGLE}"


def _matmul_precision(impl: Impl, dtype: str):
    """float32 inputs: XLA's float32 dots in full float32 (no TF32 on a GPU), as the contract's references."""
    if impl.framework == "jax" and dtype == "float32":
        import jax

        return jax.default_matmul_precision("float32")
    return contextlib.nullcontext()


def run_ep_check(
    config: MoEConfig,
    num_tokens: int = 16,
    *,
    seed: int = 0,
    routing: str = "uniform",
    implementations: Sequence[str] = DEFAULT_IMPLEMENTATIONS,
    weights: LayerWeights | None = None,
    dtype: str = "float32",
    real_ep: bool = True,
    progress: Callable[[str], None] | None = None,
    x: np.ndarray | None = None,
    router_logits: np.ndarray | None = None,
    backward: bool = False,
    weights_dtype: str = "float32",
) -> CrossCheckResult:
    """The expert-parallel summary (package docstring, stage ``"ep"``): for each implementation, the sum over
    the ``config.ep_size`` ranks of its per-rank layer against its single-device layer, and the
    implementations' sums against each other; the real JAX multi-device path where there are devices.

    Args:
      config: the layer with ``ep_size = N >= 1`` (``ep_rank`` is ignored: every rank runs).
      num_tokens, seed, routing, weights: the inputs, as :func:`run_crosscheck` draws them.
      implementations: names from :data:`IMPLEMENTATIONS`.
      dtype: ``"float32"`` (x and the float weights in float32: the rank sum must equal the single
        device to float32 rounding, ``F32_REL_FRO``) or ``"bfloat16"`` (each rank's partial is rounded
        to bf16 by its ``moe_forward``: judged by the layer's bf16 / FP8 rule). The float weights are
        rounded to bf16 first either way (a model's weights); FP8 codes come from each framework's own
        ``quantize_layer_weights`` of them (or the checkpoint's, as given).
      real_ep: also run ``moe_pallas.ep_moe_forward`` (both modes) for the JAX implementations when
        ``jax.device_count() >= N``.
      backward: also the gradients (stage ``"ep_bwd"``, CONTRACT.md section 8's EP rule) for the
        cotangent :func:`make_cotangent`: every rank's ``d_x`` and ``d_router_logits`` summed in float32
        against the single device's (``GRAD_F32_REL_FRO`` with float32 inputs, ``GRAD_BF16_REL_FRO``
        with bf16), each rank's ``d_w13`` / ``d_w2`` against its slice of the single device's (float
        weights; FP8 codes get none), and the implementations' against each other (``GRAD_BF16_REL_FRO``).
        The real multi-device path's gradients are not run (a note says so).
      weights_dtype: ``"bfloat16"`` draws the random weights straight into bf16 (:func:`make_inputs`): the same
        values (they are rounded to bf16 first either way), without the float32 layer on the host; with
        ``dtype="bfloat16"`` they are used as drawn (no copy). Random weights only.

    Returns: :class:`CrossCheckResult` with stage ``"ep"`` (and ``"ep_bwd"``) comparisons; ``meta["ep"]``
    holds notes (what was skipped and why). A backend raising ``NotImplementedError`` is skipped,
    anything else is an error (a violation).
    """
    progress = progress or (lambda msg: None)
    check_modelled("run_ep_check", config)
    names = _check_names("run_ep_check", implementations)
    if dtype not in EP_DTYPES:
        raise ValueError(f"run_ep_check: dtype must be one of {EP_DTYPES}; got {dtype!r}")
    N = config.ep_size
    single_cfg = config.replace(ep_size=1, ep_rank=0)
    skipped: dict[str, str] = {}
    errors: dict[str, str] = {}
    comparisons: list[Comparison] = []
    notes: list[str] = []
    t_start = time.perf_counter()

    progress("ep: inputs")
    inputs_given = x is not None
    inputs, given_s13, given_s2 = make_inputs(config, num_tokens, seed, routing, weights, x, router_logits,
                                              weights_dtype)
    fp8 = config.quant in FP8_QUANTS  # the FP8 rows of section 7 (4-bit weights: the bf16 rows, section 9)
    quantized = config.quant != "none"  # weight codes (FP8 or 4-bit): frozen, no weight gradient
    act_dt = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    x = inputs.x.astype(act_dt)
    logits = inputs.router_logits.astype(np.float32)
    bias = inputs.e_score_correction_bias.astype(np.float32) if config.routing == "biased_grouped_topk" else None
    shared = inputs.shared_expert_gate_logits  # [T, S] float32 (shared_expert_gate layers), else None
    d_out = make_cotangent(num_tokens, config.hidden_size, seed, act_dt) if backward else None
    biases = expert_biases(config, seed, weights)  # bf16 [E+S, ...] (a model's values), or None
    biases = None if biases is None else tuple(b.astype(act_dt) for b in biases)
    if quantized and given_s13 is not None:  # FP8 / 4-bit codes and scales as given
        w13_g, w2_g = inputs.w13, inputs.w2
    elif weights is None and inputs.w13.dtype == act_dt == ml_dtypes.bfloat16:  # drawn in bf16: as they are
        w13_g, w2_g = inputs.w13, inputs.w2
    else:  # float weights: a model's bf16 values, held in the compute dtype
        w13_g = cast_experts(cast_experts(inputs.w13, ml_dtypes.bfloat16), act_dt)
        w2_g = cast_experts(cast_experts(inputs.w2, ml_dtypes.bfloat16), act_dt)

    single: dict[str, np.ndarray] = {}
    ep_sum: dict[str, np.ndarray] = {}
    real: dict[tuple[str, str], np.ndarray] = {}
    single_grads: dict[str, dict[str, np.ndarray]] = {}
    rank_grads: dict[str, dict[str, Any]] = {}  # d_x / d_router_logits: float32 sums; d_w13 / d_w2: [per rank]
    timings: dict[str, float] = {}

    def global_weights(impl: Impl):
        """(w13, w13_scale, w2, w2_scale, w13_bias, w2_bias) of every expert, native to ``impl`` (biases None
        without ``config.expert_bias``)."""
        b13, b2 = (None, None) if biases is None else (impl.native(b) for b in biases)
        if quantized and given_s13 is not None:  # FP8 multipliers float32; 4-bit (MXFP4 e8m0 uint8) scales as stored
            sd = np.float32 if fp8 else given_s13.dtype
            return (impl.native(w13_g), impl.native(np.asarray(given_s13, sd)), impl.native(w2_g),
                    impl.native(np.asarray(given_s2, sd)), b13, b2)
        w13, s13, w2, s2 = impl.mod.quantize_layer_weights(impl.native(w13_g), impl.native(w2_g), single_cfg)
        return w13, s13, w2, s2, b13, b2

    def forward(impl: Impl, cfg: MoEConfig, w):
        """This rank's output (float32 numpy), and with ``backward`` its gradients (numpy)."""
        if not backward:
            out = impl.mod.moe_forward(impl.native(x), impl.native(logits), w[0], w[2], cfg, w13_scale=w[1],
                                       w2_scale=w[3], w13_bias=w[4], w2_bias=w[5],
                                       e_score_correction_bias=impl.native(bias),
                                       shared_expert_gate_logits=impl.native(shared), implementation=impl.impl)
            return to_numpy(out).astype(np.float32), None
        out, grads = layer_vjp(impl, cfg, impl.native(x), impl.native(logits), w[:4], impl.native(bias),
                               impl.native(d_out), impl.native(shared), None if w[4] is None else w[4:])
        return to_numpy(out).astype(np.float32), {k: to_numpy(v) for k, v in grads.items() if v is not None}

    for n in names:
        impl = Impl(n)
        t0 = time.perf_counter()
        try:
            with _matmul_precision(impl, dtype):
                progress(f"ep: {n} weights")
                w_all = global_weights(impl)
                progress(f"ep: {n} single device")
                single[n], g_single = forward(impl, single_cfg, w_all)
                total = np.zeros_like(single[n], dtype=np.float32)
                g_ranks: dict[str, Any] = {}
                for r in range(N):
                    progress(f"ep: {n} rank {r}/{N}")
                    cfg_r = config.for_rank(r)
                    w_r = tuple(None if w is None else impl.mod.local_weights(w, cfg_r) for w in w_all)
                    out_r, g_r = forward(impl, cfg_r, w_r)
                    total += out_r  # float32 sum over ranks (section 6)
                    for k, v in (g_r or {}).items():
                        if k in _SUMMED:  # the transpose of the forward's sum: summed in float32
                            g_ranks[k] = g_ranks.get(k, 0) + v.astype(np.float32)
                        else:
                            g_ranks.setdefault(k, []).append((cfg_r.local_expert_range(), v))
                ep_sum[n] = total
                if backward:
                    single_grads[n], rank_grads[n] = g_single, g_ranks
        except NotImplementedError as exc:
            skipped[n] = f"{EP_STAGE}: {' '.join(str(exc).split())}"
            single.pop(n, None)
            continue
        except Exception as exc:
            errors[f"{EP_STAGE}/{n}"] = f"{type(exc).__name__}: {_one_line(exc)}"
            single.pop(n, None)
            continue
        timings[n] = round(time.perf_counter() - t0, 3)

        # the real multi-device path (JAX), where there are N devices
        if not (real_ep and impl.framework == "jax" and N > 1):
            continue
        import jax

        if jax.device_count() < N:
            note = (f"jax ep_moe_forward: skipped: needs {N} devices, have {jax.device_count()} "
                    f"(XLA_FLAGS=--xla_force_host_platform_device_count={N})")
            if note not in notes:
                notes.append(note)
            continue
        import moe_pallas

        mesh = moe_pallas.make_ep_mesh(N)
        fwd = jax.jit(moe_pallas.ep_moe_forward, static_argnames=("config", "mesh", "mode", "implementation"))
        for mode in EP_MODES:
            progress(f"ep: {n} ep_moe_forward[{mode}] on {N} devices")
            try:
                with _matmul_precision(impl, dtype):
                    out = fwd(impl.native(x), impl.native(logits), w_all[0], w_all[2], config, mesh=mesh, mode=mode,
                              w13_scale=w_all[1], w2_scale=w_all[3], w13_bias=w_all[4], w2_bias=w_all[5],
                              e_score_correction_bias=impl.native(bias),
                              shared_expert_gate_logits=impl.native(shared), implementation=impl.impl)
                real[(n, mode)] = to_numpy(out).astype(np.float32)
            except NotImplementedError as exc:
                notes.append(f"{n} ep_moe_forward[{mode}]: skipped ({_one_line(exc, 200)})")
            except Exception as exc:
                errors[f"{EP_STAGE}/{n} ep_moe_forward[{mode}]"] = f"{type(exc).__name__}: {_one_line(exc)}"
    if N > 1:
        notes.append("torch ep_moe_forward: not run here (needs torch.distributed processes; tests/test_ep_torch.py)")
    if backward and N > 1:
        notes.append("backward: each rank's moe_forward gradients (summed / sliced); the gradients of the "
                     "multi-device ep_moe_forward are not run here")
        if quantized:
            notes.append(f"backward: {'FP8' if fp8 else '4-bit'} layer: the weight codes are frozen, no weight "
                         f"gradient (CONTRACT.md section {8 if fp8 else 9})")

    # ---- compare
    same_limit = F32_REL_FRO if dtype == "float32" else (FP8_REL_FRO if fp8 else BF16_REL_FRO)
    same_rule = (f"rel <= {same_limit:.0e} ({'float32 inputs: float32 rounding' if dtype == 'float32' else 'bf16 inputs'})")
    for n in names:
        if n in ep_sum:
            m = compare_float(ep_sum[n], single[n])
            comparisons.append(Comparison(EP_STAGE, EP_SUM_VS_SINGLE, n, n, "float",
                                          "error" not in m and m["rel_fro"] <= same_limit, m, same_rule))
        for mode in EP_MODES:
            if (n, mode) in real:
                m = compare_float(real[(n, mode)], single[n])
                comparisons.append(Comparison(EP_STAGE, ep_real_output(mode), n, n, "float",
                                              "error" not in m and m["rel_fro"] <= same_limit, m, same_rule))
    for a_name, b_name in pairs(names):
        if a_name in ep_sum and b_name in ep_sum:
            limit = FP8_REL_FRO if fp8 and (a_name, b_name) not in PALLAS_VS_TRITON else BF16_REL_FRO
            m = compare_float(ep_sum[a_name], ep_sum[b_name])
            comparisons.append(Comparison(EP_STAGE, EP_SUM, a_name, b_name, "float",
                                          "error" not in m and m["rel_fro"] <= limit, m, f"rel <= {limit:.0e}"))
    if backward:
        comparisons += _ep_backward_comparisons(names, single_grads, rank_grads, dtype)

    meta = {
        "config": dataclasses.asdict(config), "num_tokens": num_tokens, "seed": seed, "routing_skew": routing, "M": None,
        "implementations": names, "weights": "given" if weights is not None else "random (make_layer_inputs)",
        "inputs": "given" if inputs_given else "random",
        "timings_s": {EP_STAGE: timings}, "runtime_s": round(time.perf_counter() - t_start, 2), "devices": _devices(),
        "ep": {"ep_size": N, "dtype": dtype, "notes": notes, "backward": backward},
    }
    if weights_dtype != "float32":
        meta["weights"] += f", drawn in {weights_dtype}"
    if backward:
        meta["ep"]["cotangent"] = COTANGENT
    return CrossCheckResult(meta=meta, comparisons=comparisons, skipped=skipped, errors=errors)


def _ep_backward_comparisons(names, single_grads, rank_grads, dtype: str) -> list[Comparison]:
    """CONTRACT.md section 8's EP rule per implementation (summed ``d_x`` / ``d_router_logits``, sliced
    weight gradients, against the single device), and the implementations against each other."""
    limit = GRAD_F32_REL_FRO if dtype == "float32" else GRAD_BF16_REL_FRO
    rule = f"rel <= {limit:.0e} ({'float32 inputs' if dtype == 'float32' else 'bf16 inputs'})"
    out: list[Comparison] = []
    whole: dict[str, dict[str, np.ndarray]] = {}  # per implementation: summed grads, and the ranks' slices joined
    for n in names:
        if n not in rank_grads:
            continue
        whole[n] = {}
        for grad in _SUMMED + EP_SLICED_GRADS + EP_BIAS_GRADS:
            if grad not in rank_grads[n]:
                continue
            ref = single_grads[n][grad]
            if grad in _SUMMED:  # the ranks' float32 sum against the single device's (exact in float32)
                got, ref = rank_grads[n][grad], ref.astype(np.float32)
                m = compare_float(got, ref)
                ok = "error" not in m and m["rel_fro"] <= limit
            else:  # each rank's [E_local, ...] against rows [start, start + E_local) of the single device's
                per_rank = [compare_float(v, ref[s:s + e]) for (s, e), v in rank_grads[n][grad]]
                got = np.concatenate([v for _, v in rank_grads[n][grad]])
                m = compare_float(got, ref)
                if "error" not in m:
                    worst = max(range(len(per_rank)), key=lambda r: per_rank[r].get("rel_fro", float("inf")))
                    m["worst_rank"], m["worst_rank_rel_fro"] = worst, per_rank[worst].get("rel_fro", float("inf"))
                ok = "error" not in m and all("error" not in p and p["rel_fro"] <= limit for p in per_rank)
            whole[n][grad] = got
            out.append(Comparison(EP_BACKWARD_STAGE, ep_grad_output(grad), n, n, "float", ok, m, rule))
    for a_name, b_name in pairs(names):
        if a_name in whole and b_name in whole:
            for grad, vb in whole[b_name].items():
                va = whole[a_name].get(grad)
                m = compare_float(va, vb) if va is not None else {"error": f"{a_name} gave no {grad}"}
                out.append(Comparison(EP_BACKWARD_STAGE, ep_grad_output(grad, against_single=False), a_name, b_name,
                                      "float", "error" not in m and m["rel_fro"] <= GRAD_BF16_REL_FRO, m,
                                      f"rel <= {GRAD_BF16_REL_FRO:.0e} (layer gradients)"))
    return out
