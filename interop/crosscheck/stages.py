"""The stage table: the implementations, and what each stage runs in each framework on the upstream values.

Each :class:`Stage` is one step of ``moe_*/layer.py`` (forward) or of its backward (CONTRACT.md
section 8, the stage-level ops of ``moe_*/ops/*/api.py``): a function ``run(impl, up)`` that calls the
stage's public op(s) in ``impl``'s framework on :class:`Upstream` values - the inputs and the jnp
reference's outputs of the stages before it - and returns the stage's outputs by name. The driver
(``run.py``) runs every implementation of a stage, the judge (``judge.py``) compares them.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from interop.crosscheck.convert import from_numpy, to_numpy
from moe_contract.config import ACTIVATION_QUANT, FP8_QUANTS, W4_QUANTS, WEIGHT_LAYOUT, MoEConfig
from moe_contract.validation import stage_implementation

#: name -> (framework, implementation argument of the stage ops, implementation for stages without it)
IMPLEMENTATIONS = {
    "jnp-reference": ("jax", "reference", "reference"),
    "torch-reference": ("torch", "reference", "reference"),
    "pallas_triton": ("jax", "pallas_triton", "pallas_triton"),
    "triton": ("torch", "triton", "triton"),
    "pallas_mosaic_gpu": ("jax", "pallas_mosaic_gpu", "pallas_triton"),  # GEMMs only; GPU only
}
REFERENCE = {"jax": "jnp-reference", "torch": "torch-reference"}
DEFAULT_IMPLEMENTATIONS = ("jnp-reference", "torch-reference", "pallas_triton", "triton")
#: The implementation whose outputs feed the next stage (and the judge of the JAX kernels).
UPSTREAM = "jnp-reference"
#: The (a, b) pairs of Triton against a Pallas backend: judged by the tighter rule where the rules differ.
PALLAS_VS_TRITON = frozenset({("triton", "pallas_triton"), ("triton", "pallas_mosaic_gpu")})


def pairs(names: Sequence[str]) -> list[tuple[str, str]]:
    """(a, b) pairs, ``b`` the one judged against: kernel vs own reference, torch ref vs jnp ref, Triton vs Pallas."""
    out = []
    for n in names:
        fw = IMPLEMENTATIONS[n][0]
        if n != REFERENCE[fw] and REFERENCE[fw] in names:
            out.append((n, REFERENCE[fw]))
    if "torch-reference" in names and "jnp-reference" in names:
        out.append(("torch-reference", "jnp-reference"))
    for p in ("pallas_triton", "pallas_mosaic_gpu"):
        if "triton" in names and p in names:
            out.append(("triton", p))
    return out


def _modules(framework: str):
    if framework == "jax":
        import moe_pallas

        return moe_pallas
    import moe_torch

    return moe_torch


def op_api(framework: str, stage: str):
    """``moe_pallas.ops.<stage>.api`` or ``moe_torch.ops.<stage>.api``."""
    pkg = "moe_pallas" if framework == "jax" else "moe_torch"
    return importlib.import_module(f"{pkg}.ops.{stage}.api")


class Impl:
    """One implementation: its framework's package (``mod``), and the backend each op gets."""

    def __init__(self, name: str):
        self.name = name
        self.framework, self.impl, self.other_impl = IMPLEMENTATIONS[name]
        self.mod = _modules(self.framework)

    def stage_impl(self, op_module, only: tuple[str, ...] | None = None) -> str:
        """The backend for a stage op: ``self.impl`` if the stage (or, with ``only``, the op: the JAX
        GEMM backward ops serve fewer backends than the forward) has it, else ``self.other_impl``."""
        if only is not None:
            op_module = types.SimpleNamespace(IMPLEMENTATIONS=only)
        return stage_implementation(self.impl, op_module, fallback=self.other_impl)

    def op_impl(self, stage: str, only_attr: str | None = None) -> str:
        """:meth:`stage_impl` of ``ops/<stage>/api.py`` (``only_attr``: that module's list for the op)."""
        api = self.api(stage)
        return self.stage_impl(api, getattr(api, only_attr, None) if only_attr else None)

    def api(self, stage: str):
        """The stage's ``ops/<stage>/api.py`` of this framework: the home of its (backward) ops."""
        return op_api(self.framework, stage)

    @property
    def layer(self):
        """``moe_pallas.layer`` or ``moe_torch.layer`` (the layer's own helpers, e.g. ``dgrad_weight``)."""
        return importlib.import_module(f"{'moe_pallas' if self.framework == 'jax' else 'moe_torch'}.layer")

    @property
    def slots(self):
        """``moe_pallas.slot_weights`` or ``moe_torch.slot_weights``: the 2026 families' slot weights and scaled
        rows (plain framework ops, no kernel: every backend's layer runs them)."""
        return importlib.import_module(f"{'moe_pallas' if self.framework == 'jax' else 'moe_torch'}.slot_weights")

    def native(self, a):
        return from_numpy(a, self.framework)

    @property
    def f32(self):
        if self.framework == "jax":
            import jax.numpy as jnp

            return jnp.float32
        import torch

        return torch.float32

    @property
    def bf16(self):
        if self.framework == "jax":
            import jax.numpy as jnp

            return jnp.bfloat16
        import torch

        return torch.bfloat16

    def vjp(self, fn: Callable, primals: Sequence, cotangent) -> tuple[Any, tuple]:
        """``(fn(*primals), gradients of <fn(*primals), cotangent> w.r.t. primals)``: ``jax.vjp`` or
        torch autograd (eager either way: a jit here would cache across calls and hide a patched stage)."""
        if self.framework == "jax":
            import jax

            out, pullback = jax.vjp(fn, *primals)
            return out, pullback(cotangent)
        import torch

        leaves = [p.detach().requires_grad_(True) for p in primals]  # new leaves; the caller's tensors untouched
        with torch.enable_grad():
            out = fn(*leaves)
            grads = torch.autograd.grad(out, leaves, grad_outputs=cotangent, allow_unused=True)
        return out.detach(), grads


def layer_vjp(impl: Impl, config: MoEConfig, x, logits, weights: tuple, bias, d_out,
              shared_logits=None, expert_biases: tuple | None = None) -> tuple[Any, dict[str, Any]]:
    """``moe_forward`` of ``impl`` (native arrays; ``weights = (w13, w13_scale, w2, w2_scale)``;
    ``shared_logits``: ``shared_expert_gate_logits [T, S]`` of a ``config.shared_expert_gate`` layer, else None;
    ``expert_biases``: ``(w13_bias, w2_bias)`` of a ``config.expert_bias`` layer, else None) and its gradients for
    ``d_out``: ``d_x``, ``d_router_logits``, ``d_shared_expert_gate_logits`` (with ``shared_logits``), ``d_w13_bias``,
    ``d_w2_bias`` (with ``expert_biases``) and, for float weights, ``d_w13``, ``d_w2`` (FP8 and 4-bit codes are
    frozen: no weight gradient, CONTRACT.md sections 8, 9)."""
    w13, s13, w2, s2 = weights
    frozen = config.quant != "none"
    named = {"d_x": x, "d_router_logits": logits}
    if shared_logits is not None:
        named["d_shared_expert_gate_logits"] = shared_logits
    if expert_biases is not None:
        named["d_w13_bias"], named["d_w2_bias"] = expert_biases
    if not frozen:
        named["d_w13"], named["d_w2"] = w13, w2
    names = tuple(named)

    def forward(*primals):
        p = dict(zip(names, primals))
        return impl.mod.moe_forward(
            p["d_x"], p["d_router_logits"], p.get("d_w13", w13), p.get("d_w2", w2), config, w13_scale=s13,
            w2_scale=s2, w13_bias=p.get("d_w13_bias"), w2_bias=p.get("d_w2_bias"), e_score_correction_bias=bias,
            shared_expert_gate_logits=p.get("d_shared_expert_gate_logits"), implementation=impl.impl)

    out, grads = impl.vjp(forward, tuple(named.values()), d_out)
    return out, dict(zip(names, grads))


# --------------------------------------------------------------------------------------
# What every implementation of a stage is fed


@dataclasses.dataclass
class Upstream:
    """The inputs of this rank (numpy; bf16 / FP8 as ml_dtypes) and the jnp reference's outputs so far.

    ``x [T, H]`` bf16, ``logits [T, E]`` float32, ``bias [E]`` float32 (``biased_grouped_topk``) or None;
    ``w13 [E_local, 2I, H]``, ``w2 [E_local, H, I]``: bf16, or FP8 / 4-bit codes with ``s13`` / ``s2``;
    ``b13 [E_local, 2I]``, ``b2 [E_local, H]`` bf16: the expert biases of a ``config.expert_bias`` layer, else None;
    ``d_out [T, H]`` bf16: the cotangent of the layer's output (backward stages; None forward only);
    ``shared_logits [T, S]`` float32: ``shared_expert_gate_logits`` of a ``config.shared_expert_gate`` layer, else None;
    ``w13_float`` / ``w2_float``: this rank's float (bf16) weights, quantized by the ``weights`` stage
    in the FP8 and 4-bit modes (unless a checkpoint gave codes and scales);
    ``ref[stage][output]``: the jnp reference's outputs of the stages run so far.
    """

    config: MoEConfig
    x: np.ndarray
    logits: np.ndarray
    bias: np.ndarray | None
    d_out: np.ndarray | None = None
    shared_logits: np.ndarray | None = None
    w13: np.ndarray | None = None
    s13: np.ndarray | None = None
    w2: np.ndarray | None = None
    s2: np.ndarray | None = None
    w13_float: np.ndarray | None = None
    w2_float: np.ndarray | None = None
    b13: np.ndarray | None = None
    b2: np.ndarray | None = None
    ref: dict[str, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)

    @property
    def quant(self) -> str | None:
        """The activation quantization of the layer's quant mode (None for float layers)."""
        return ACTIVATION_QUANT[self.config.quant]

    @property
    def fp8(self) -> bool:
        """FP8 codes (weights and activations; section 3), judged by the FP8 rows of section 7."""
        return self.config.quant in FP8_QUANTS

    @property
    def quantized(self) -> bool:
        """Weight codes (FP8 or 4-bit): the ``weights`` stage makes them, and they are frozen (no weight gradient)."""
        return self.config.quant != "none"

    @property
    def w_format(self) -> str | None:
        """The grouped GEMM's ``w_format``: ``"mxfp4"`` / ``"int4"`` (``"mxfp4_mma"``) for 4-bit weights (section 9),
        else None."""
        return self.config.w_format

    @property
    def expert_biases(self) -> tuple | None:
        return None if self.b13 is None else (self.b13, self.b2)

    @property
    def M(self) -> int:
        """Rows this rank computes (``expert_offsets[-1]`` of the reference's routing)."""
        return int(self.ref["routing"]["expert_offsets"][-1])

    @property
    def weights(self) -> tuple:
        return self.w13, self.s13, self.w2, self.s2

    @property
    def combine_weights(self) -> np.ndarray:
        """The combine's weights: the ``slot_weights`` stage's (the 2026 families), else the gate's."""
        return self.ref.get("slot_weights", self.ref["gate"]).get("combine_weights", self.ref["gate"]["topk_weights"])

    @property
    def input_scale(self) -> np.ndarray | None:
        """The expert inputs' scale ``[T, k']`` float32 (``apply_router_weight_on_input``), else None."""
        return self.ref.get("slot_weights", {}).get("input_scale")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage: ``run(impl, up) -> {output: array}`` in ``impl``'s framework on ``up``'s values.

    ``rows``: outputs indexed by permuted row (``[M_cap, ...]``): compared on rows ``< M`` (rows ``>= M``
    are never read, section 2). ``weight_grads``: ``[E_local, N, K]`` weight gradients and ``[E_local, N]`` bias
    gradients (an expert with no rows must get exactly 0, section 8). ``skip(up)``: why the stage does not run on these inputs
    (None: it runs; a note says why not). ``applies(config)``: whether the layer has the stage at all (the
    2026 families' slot-weight stages; no note where it has not). ``backward``: judged by section 8 (else 7).
    """

    name: str
    what: str
    run: Callable[[Impl, Upstream], dict[str, Any]]
    rows: tuple[str, ...] = ()
    weight_grads: tuple[str, ...] = ()
    skip: Callable[[Upstream], str | None] = lambda up: None
    backward: bool = False
    references_only: bool = False
    applies: Callable[[MoEConfig], bool] = lambda config: True


# ---- forward (moe_*/layer.py, in order) ----

def _weights(impl: Impl, up: Upstream):
    """``quantize_weight_fp8`` of this rank's float weights, a few experts at a time (<= 1 GiB of float32
    temporaries on the device: a DeepSeek-V3 w13 whole would need 30 GB beside the other framework's
    memory), back to the host; the 4-bit modes: ``quantize_layer_weights`` (``quantize_weight_mxfp4`` /
    ``quantize_weight_int4``, chunked inside)."""
    if up.w_format is not None:
        q13, s13, q2, s2 = (to_numpy(t) for t in impl.mod.quantize_layer_weights(
            impl.native(up.w13_float), impl.native(up.w2_float), up.config))
        return {"w13": q13, "w13_scale": s13, "w2": q2, "w2_scale": s2}
    layout = WEIGHT_LAYOUT[up.config.quant]

    def chunks(w: np.ndarray):
        step = max(1, (1 << 28) // max(1, w[0].size))
        parts = [tuple(to_numpy(t) for t in impl.mod.quantize_weight_fp8(impl.native(w[i:i + step]), layout))
                 for i in range(0, w.shape[0], step)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    q13, s13 = chunks(up.w13_float)
    q2, s2 = chunks(up.w2_float)
    return {"w13": q13, "w13_scale": s13, "w2": q2, "w2_scale": s2}


def _gate(impl: Impl, up: Upstream):
    w, ids = impl.mod.select_experts(
        impl.native(up.logits), **up.config.gate_kwargs(), e_score_correction_bias=impl.native(up.bias),
        implementation=impl.op_impl("gate"))
    return {"topk_weights": w, "topk_ids": ids}


def _slot_weights(impl: Impl, up: Upstream):
    """CONTRACT.md section 1 (``shared_expert_gate``, ``apply_router_weight_on_input``): the gate's weights ->
    the combine's weights and the expert inputs' scale (``moe_*/slot_weights.py``, the layer's own op)."""
    combine_weights, input_scale = impl.slots.slot_weights(
        impl.native(up.ref["gate"]["topk_weights"]), impl.native(up.shared_logits), up.config)
    out = {"combine_weights": combine_weights}
    if input_scale is not None:
        out["input_scale"] = input_scale
    return out


def _scaled_slot_rows(impl: Impl, up: Upstream):
    """Section 2: row ``t*k' + j`` is ``round(float32(x[t]) * input_scale[t, j])`` (one rounding)."""
    return {"scaled_rows": impl.slots.scaled_slot_rows(impl.native(up.x), impl.native(up.input_scale))}


def _routing(impl: Impl, up: Upstream):
    start, e_local = up.config.local_expert_range()
    meta = impl.mod.routing_metadata(
        impl.native(up.ref["gate"]["topk_ids"]), up.config.num_total_experts, expert_start=start,
        num_local_experts=e_local, implementation=impl.op_impl("permute"))
    return {"expert_offsets": meta.expert_offsets, "src2dst": meta.src2dst, "dst2src": meta.dst2src}


def _permute(impl: Impl, up: Upstream):
    # apply_router_weight_on_input: the permute gathers the reference's scaled slot rows, one per assignment
    # (topk=1), as the layer does (moe_*/layer.py: _expert_rows)
    rows, k = ((up.x, up.config.num_slots) if up.input_scale is None
               else (up.ref["scaled_slot_rows"]["scaled_rows"], 1))
    xq, xs = impl.mod.permute(impl.native(rows), impl.native(up.ref["routing"]["dst2src"]),
                              topk=k, quant=up.quant, implementation=impl.op_impl("permute"))
    return {"x_permuted": xq, "x_scale": xs} if xs is not None else {"x_permuted": xq}


def _gemm(impl: Impl, up: Upstream, name: str, x_rows, x_scale, w, w_scale, bias):
    return {name: impl.mod.grouped_gemm(
        impl.native(x_rows), impl.native(w), impl.native(up.ref["routing"]["expert_offsets"]),
        x_scale=impl.native(x_scale), w_scale=impl.native(w_scale), out_dtype=impl.bf16,
        w_format=up.w_format, bias=impl.native(bias), implementation=impl.op_impl("grouped_gemm"))}


def _gemm1(impl: Impl, up: Upstream):
    p = up.ref["permute"]
    return _gemm(impl, up, "h", p["x_permuted"], p.get("x_scale"), up.w13, up.s13, up.b13)


def _act(impl: Impl, up: Upstream):
    which = impl.op_impl("activation")
    h = impl.native(up.ref["gemm1"]["h"])
    activation, layout = up.config.activation, up.config.gate_up_layout
    a, s = impl.mod.act_and_mul(h, activation=activation, layout=layout, quant=up.quant, implementation=which)
    if s is None:
        return {"a": a}
    # the same implementation's float32 activation, and the framework reference's quantization of
    # it: the fused codes and scales must be exactly that (CONTRACT.md section 3)
    a32, _ = impl.mod.act_and_mul(h, activation=activation, layout=layout, out_dtype=impl.f32, implementation=which)
    if up.quant == "fp8_per_token":
        rq, rs = impl.mod.per_token_quant_fp8(a32, implementation="reference")
    else:
        rq, rs = impl.mod.per_token_group_quant_fp8(a32, implementation="reference")
    return {"a": a, "a_scale": s, "a_f32": a32, "a_requant": rq, "a_requant_scale": rs}


def _gemm2(impl: Impl, up: Upstream):
    a = up.ref["act"]
    return _gemm(impl, up, "y", a["a"], a.get("a_scale"), up.w2, up.s2, up.b2)


def _combine(impl: Impl, up: Upstream):
    out = impl.mod.combine(impl.native(up.ref["gemm2"]["y"]), impl.native(up.ref["routing"]["src2dst"]),
                           impl.native(up.combine_weights),
                           routed_scaling_factor=up.config.combine_routed_scaling_factor, out_dtype=impl.bf16,
                           implementation=impl.op_impl("combine"))
    return {"out": out}


def _layer(impl: Impl, up: Upstream):
    # eager: the kernels are jitted inside; a jit here would cache across calls and hide a patched stage
    out = impl.mod.moe_forward(
        impl.native(up.x), impl.native(up.logits), impl.native(up.w13), impl.native(up.w2), up.config,
        w13_scale=impl.native(up.s13), w2_scale=impl.native(up.s2), e_score_correction_bias=impl.native(up.bias),
        shared_expert_gate_logits=impl.native(up.shared_logits), w13_bias=impl.native(up.b13),
        w2_bias=impl.native(up.b2), implementation=impl.impl)
    return {"out": out}


# ---- backward (CONTRACT.md section 8, the stage-level backward ops, in the order the gradient flows) ----

def _combine_bwd(impl: Impl, up: Upstream):
    d_y, d_w = impl.api("combine").combine_backward(
        impl.native(up.d_out), impl.native(up.ref["gemm2"]["y"]), impl.native(up.ref["routing"]["src2dst"]),
        impl.native(up.combine_weights), routed_scaling_factor=up.config.combine_routed_scaling_factor,
        implementation=impl.op_impl("combine"))
    # the 2026 families: the gradient of the combine's weights, which slot_weights_bwd turns into the gate's
    return {"d_y": d_y, "d_combine_weights" if _slot_weighted(up.config) else "d_topk_weights": d_w}


def _dgrad(impl: Impl, up: Upstream, name: str, d_y, w, w_scale):
    backend = impl.op_impl("grouped_gemm", "DGRAD_IMPLEMENTATIONS")
    if w_scale is not None and backend == "pallas_mosaic_gpu":  # no FP8 weights in the Mosaic dgrad
        backend = impl.other_impl
    w, w_scale = impl.native(w), impl.native(w_scale)
    if up.w_format is not None:  # 4-bit: straight-through on the decoded weights in d_y's dtype, as the layer does
        w, w_scale = impl.layer.dgrad_weight(w, w_scale, up.config, impl.bf16)
    return {name: impl.api("grouped_gemm").grouped_gemm_dgrad(
        impl.native(d_y), w, impl.native(up.ref["routing"]["expert_offsets"]),
        w_scale=w_scale, implementation=backend)}


def _dbias(impl: Impl, up: Upstream, name: str, d_y):
    """Section 8's ``d_bias[e] = sum_p d_y[p]`` over the rows of ``e`` (float32)."""
    return {name: impl.api("grouped_gemm").grouped_gemm_dbias(
        impl.native(d_y), impl.native(up.ref["routing"]["expert_offsets"]),
        implementation=impl.op_impl("grouped_gemm", "DBIAS_IMPLEMENTATIONS"))}


def _gemm2_dbias(impl: Impl, up: Upstream):
    return _dbias(impl, up, "d_w2_bias", up.ref["combine_bwd"]["d_y"])


def _gemm1_dbias(impl: Impl, up: Upstream):
    return _dbias(impl, up, "d_w13_bias", up.ref["act_bwd"]["d_h"])


def _wgrad(impl: Impl, up: Upstream, name: str, x_rows, d_y):
    return {name: impl.api("grouped_gemm").grouped_gemm_wgrad(
        impl.native(x_rows), impl.native(d_y), impl.native(up.ref["routing"]["expert_offsets"]),
        implementation=impl.op_impl("grouped_gemm", "WGRAD_IMPLEMENTATIONS"))}


def _gemm2_dgrad(impl: Impl, up: Upstream):
    return _dgrad(impl, up, "d_a", up.ref["combine_bwd"]["d_y"], up.w2, up.s2)


def _gemm2_wgrad(impl: Impl, up: Upstream):
    return _wgrad(impl, up, "d_w2", up.ref["act"]["a"], up.ref["combine_bwd"]["d_y"])


def _act_bwd(impl: Impl, up: Upstream):
    d_h = impl.api("activation").act_and_mul_backward(
        impl.native(up.ref["gemm1"]["h"]), impl.native(up.ref["gemm2_dgrad"]["d_a"]), activation=up.config.activation,
        layout=up.config.gate_up_layout, implementation=impl.op_impl("activation"))
    return {"d_h": d_h}


def _gemm1_dgrad(impl: Impl, up: Upstream):
    return _dgrad(impl, up, "d_xp", up.ref["act_bwd"]["d_h"], up.w13, up.s13)


def _gemm1_wgrad(impl: Impl, up: Upstream):
    return _wgrad(impl, up, "d_w13", up.ref["permute"]["x_permuted"], up.ref["act_bwd"]["d_h"])


def _permute_bwd(impl: Impl, up: Upstream):
    src2dst = up.ref["routing"]["src2dst"]
    if up.input_scale is not None:  # the scaled slot rows: one gradient row per assignment, float32 (layer.py)
        d_rows = impl.api("permute").permute_backward(
            impl.native(up.ref["gemm1_dgrad"]["d_xp"]), impl.native(src2dst.reshape(-1, 1)), num_tokens=src2dst.size,
            out_dtype=impl.f32, implementation=impl.op_impl("permute"))
        return {"d_rows": d_rows}
    d_x = impl.api("permute").permute_backward(
        impl.native(up.ref["gemm1_dgrad"]["d_xp"]), impl.native(src2dst),
        num_tokens=up.x.shape[0], implementation=impl.op_impl("permute"))
    return {"d_x": d_x}


def _scaled_slot_rows_bwd(impl: Impl, up: Upstream):
    """Section 8, weight on the input: ``d_x[t] = sum_j w[t, j] * d_rows[t*k' + j]``, ``d_input_scale[t, j] =
    <x[t], d_rows[t*k' + j]>`` (float32)."""
    d_x, d_scale = impl.slots.scaled_slot_rows_backward(
        impl.native(up.x), impl.native(up.input_scale), impl.native(up.ref["permute_bwd"]["d_rows"]))
    return {"d_x": d_x, "d_input_scale": d_scale}


def _slot_weights_bwd(impl: Impl, up: Upstream):
    """Section 8: the combine's weight gradient (and the input scale's) -> the gate's ``d_topk_weights`` and the
    shared gate's ``d_logit = d_w * w_gate * g * (1 - g)``."""
    d_scale = up.ref.get("scaled_slot_rows_bwd", {}).get("d_input_scale")
    d_w, d_shared = impl.slots.slot_weights_backward(
        impl.native(up.ref["gate"]["topk_weights"]), impl.native(up.shared_logits),
        impl.native(up.ref["combine_bwd"]["d_combine_weights"]), impl.native(d_scale), up.config)
    out = {"d_topk_weights": d_w}
    if d_shared is not None:
        out["d_shared_expert_gate_logits"] = d_shared
    return out


def _gate_bwd(impl: Impl, up: Upstream):
    d_w = up.ref.get("slot_weights_bwd", up.ref["combine_bwd"])["d_topk_weights"]
    d = impl.api("gate").select_experts_backward(
        impl.native(up.logits), impl.native(up.ref["gate"]["topk_ids"]),
        impl.native(d_w), **up.config.gate_kwargs(),
        e_score_correction_bias=impl.native(up.bias), implementation=impl.op_impl("gate"))
    return {"d_router_logits": d}


def _layer_bwd(impl: Impl, up: Upstream):
    biases = None if up.expert_biases is None else tuple(impl.native(b) for b in up.expert_biases)
    _, grads = layer_vjp(impl, up.config, impl.native(up.x), impl.native(up.logits),
                         tuple(impl.native(w) for w in up.weights), impl.native(up.bias), impl.native(up.d_out),
                         impl.native(up.shared_logits), biases)
    return grads


# ---- which layers have a stage (Stage.applies) ----

def _slot_weighted(config: MoEConfig) -> bool:
    """The layer moves or changes the gate's weights (``moe_*/slot_weights.py``): Llama 4 / Qwen3-Next."""
    return config.apply_router_weight_on_input or config.shared_expert_gate


def _input_scaled(config: MoEConfig) -> bool:
    return config.apply_router_weight_on_input


def _biased(config: MoEConfig) -> bool:
    return bool(getattr(config, "expert_bias", False))


def _no_fp8_wgrad(up: Upstream) -> str | None:
    if not up.quantized:
        return None
    return (f"{'FP8' if up.fp8 else '4-bit'} layer: the weight codes are frozen, no weight gradient is formed "
            f"(CONTRACT.md section {8 if up.fp8 else 9})")


#: The FP8 and 4-bit modes' weight quantization (references only: there is no kernel; not run when a checkpoint
#: gives FP8 codes and scales, nor for float layers).
WEIGHTS_STAGE = Stage("weights", "float w13, w2 --quantize_weight_fp8 (4-bit: _mxfp4 / _int4)--> codes + scales "
                      "(FP8 and 4-bit modes; references only)", _weights, references_only=True)

#: The forward stages after ``weights``, in the order of ``moe_*/layer.py``.
FORWARD_STAGES = (
    Stage("gate", "router_logits --select_experts--> topk_weights, topk_ids", _gate),
    Stage("slot_weights", "topk_weights, shared_expert_gate_logits --slot_weights--> combine_weights, input_scale "
          "(shared_expert_gate / apply_router_weight_on_input layers; a framework op on every backend)",
          _slot_weights, applies=_slot_weighted),
    Stage("routing", "topk_ids --routing_metadata--> expert_offsets, src2dst, dst2src", _routing, rows=("dst2src",)),
    Stage("scaled_slot_rows", "x, input_scale --scaled_slot_rows--> scaled_rows [T*k', H] (apply_router_weight_on_input "
          "layers; a framework op on every backend)", _scaled_slot_rows, applies=_input_scaled),
    Stage("permute", "x (or scaled_rows), dst2src --permute (+FP8 quant)--> x_permuted, x_scale", _permute,
          rows=("x_permuted", "x_scale")),
    Stage("gemm1", "x_permuted, w13 (+ w13_bias) --grouped_gemm--> h", _gemm1, rows=("h",)),
    Stage("act", "h --act_and_mul (+FP8 quant)--> a, a_scale", _act, rows=("a", "a_scale", "a_f32")),
    Stage("gemm2", "a, w2 (+ w2_bias) --grouped_gemm--> y", _gemm2, rows=("y",)),
    Stage("combine", "y, src2dst, topk_weights (or combine_weights) --combine--> out", _combine),
    Stage("layer", "x, router_logits, weights --moe_forward--> out (end to end, nothing shared)", _layer),
)

#: The backward stages (``--backward``), in the order the gradient flows; ``d_out [T, H]`` a seeded random cotangent.
BACKWARD_STAGES = (
    Stage("combine_bwd", "d_out, y, src2dst, topk_weights (or combine_weights) --combine_backward--> d_y, "
          "d_topk_weights (or d_combine_weights)", _combine_bwd, rows=("d_y",), backward=True),
    Stage("gemm2_dgrad", "d_y, w2 --grouped_gemm_dgrad--> d_a", _gemm2_dgrad, rows=("d_a",), backward=True),
    Stage("gemm2_wgrad", "a, d_y --grouped_gemm_wgrad--> d_w2 (float weights only)", _gemm2_wgrad,
          weight_grads=("d_w2",), skip=_no_fp8_wgrad, backward=True),
    Stage("gemm2_dbias", "d_y --grouped_gemm_dbias--> d_w2_bias (expert_bias layers)", _gemm2_dbias,
          weight_grads=("d_w2_bias",), backward=True, applies=_biased),
    Stage("act_bwd", "h, d_a --act_and_mul_backward--> d_h", _act_bwd, rows=("d_h",), backward=True),
    Stage("gemm1_dgrad", "d_h, w13 --grouped_gemm_dgrad--> d_xp", _gemm1_dgrad, rows=("d_xp",), backward=True),
    Stage("gemm1_wgrad", "x_permuted, d_h --grouped_gemm_wgrad--> d_w13 (float weights only)", _gemm1_wgrad,
          weight_grads=("d_w13",), skip=_no_fp8_wgrad, backward=True),
    Stage("gemm1_dbias", "d_h --grouped_gemm_dbias--> d_w13_bias (expert_bias layers)", _gemm1_dbias,
          weight_grads=("d_w13_bias",), backward=True, applies=_biased),
    Stage("permute_bwd", "d_xp, src2dst --permute_backward--> d_x (or d_rows [T*k', H] float32, the scaled slot "
          "rows')", _permute_bwd, backward=True),
    Stage("scaled_slot_rows_bwd", "x, input_scale, d_rows --scaled_slot_rows_backward--> d_x, d_input_scale "
          "(apply_router_weight_on_input layers)", _scaled_slot_rows_bwd, backward=True, applies=_input_scaled),
    Stage("slot_weights_bwd", "topk_weights, shared_expert_gate_logits, d_combine_weights, d_input_scale "
          "--slot_weights_backward--> d_topk_weights, d_shared_expert_gate_logits", _slot_weights_bwd,
          backward=True, applies=_slot_weighted),
    Stage("gate_bwd", "router_logits, topk_ids, d_topk_weights --select_experts_backward--> d_router_logits",
          _gate_bwd, backward=True),
    Stage("layer_bwd", "d_out --vjp of moe_forward--> d_x, d_router_logits, (d_shared_expert_gate_logits, "
          "d_w13_bias, d_w2_bias,) d_w13, d_w2 (end to end)", _layer_bwd,
          weight_grads=("d_w13", "d_w2", "d_w13_bias", "d_w2_bias"), backward=True),
)

STAGE_TABLE = {s.name: s for s in (WEIGHTS_STAGE,) + FORWARD_STAGES + BACKWARD_STAGES}
#: Forward stage names in order (``weights``: the FP8 modes' weight quantization, references only).
STAGES = ("weights",) + tuple(s.name for s in FORWARD_STAGES)
BACKWARD_STAGE_NAMES = tuple(s.name for s in BACKWARD_STAGES)
#: The stages only a layer that moves or changes the gate's weights has (``Stage.applies``; CONTRACT.md sections
#: 1, 2, 5, 8): ``slot_weights`` and its backward (``shared_expert_gate`` or ``apply_router_weight_on_input``),
#: ``scaled_slot_rows`` and its backward (``apply_router_weight_on_input``).
SLOT_WEIGHT_STAGES = tuple(s.name for s in FORWARD_STAGES + BACKWARD_STAGES if s.applies in (_slot_weighted, _input_scaled))
#: The stages only a layer with expert biases has (``config.expert_bias``, gpt-oss; sections 4, 8): the bias gradients.
BIAS_STAGES = tuple(s.name for s in BACKWARD_STAGES if s.applies is _biased)
#: Every stage a layer may lack (``Stage.applies``).
OPTIONAL_STAGES = SLOT_WEIGHT_STAGES + BIAS_STAGES
#: The stage names of the expert-parallel summary (``run_ep_check``): every rank end to end, summed.
EP_STAGE = "ep"
EP_BACKWARD_STAGE = "ep_bwd"
ALL_STAGES = STAGES + BACKWARD_STAGE_NAMES + (EP_STAGE, EP_BACKWARD_STAGE)
