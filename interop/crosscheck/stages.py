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
from moe_contract.config import ACTIVATION_QUANT, WEIGHT_LAYOUT, MoEConfig
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


def layer_vjp(impl: Impl, config: MoEConfig, x, logits, weights: tuple, bias, d_out) -> tuple[Any, dict[str, Any]]:
    """``moe_forward`` of ``impl`` (native arrays; ``weights = (w13, w13_scale, w2, w2_scale)``) and its
    gradients for ``d_out``: ``d_x``, ``d_router_logits`` and, for float weights, ``d_w13``, ``d_w2``
    (FP8 codes are frozen: no weight gradient, CONTRACT.md section 8)."""
    w13, s13, w2, s2 = weights
    fp8 = config.quant != "none"

    def forward(x, logits, *w):
        w13_, w2_ = (w13, w2) if fp8 else w
        return impl.mod.moe_forward(x, logits, w13_, w2_, config, w13_scale=s13, w2_scale=s2,
                                    e_score_correction_bias=bias, implementation=impl.impl)

    primals = (x, logits) if fp8 else (x, logits, w13, w2)
    out, grads = impl.vjp(forward, primals, d_out)
    return out, dict(zip(("d_x", "d_router_logits", "d_w13", "d_w2"), grads))


# --------------------------------------------------------------------------------------
# What every implementation of a stage is fed


@dataclasses.dataclass
class Upstream:
    """The inputs of this rank (numpy; bf16 / FP8 as ml_dtypes) and the jnp reference's outputs so far.

    ``x [T, H]`` bf16, ``logits [T, E]`` float32, ``bias [E]`` float32 (``biased_grouped_topk``) or None;
    ``w13 [E_local, 2I, H]``, ``w2 [E_local, H, I]``: bf16, or FP8 codes with ``s13`` / ``s2``;
    ``d_out [T, H]`` bf16: the cotangent of the layer's output (backward stages; None forward only);
    ``w13_float`` / ``w2_float``: this rank's float (bf16) weights, quantized by the ``weights`` stage
    in the FP8 modes (unless a checkpoint gave codes and scales);
    ``ref[stage][output]``: the jnp reference's outputs of the stages run so far.
    """

    config: MoEConfig
    x: np.ndarray
    logits: np.ndarray
    bias: np.ndarray | None
    d_out: np.ndarray | None = None
    w13: np.ndarray | None = None
    s13: np.ndarray | None = None
    w2: np.ndarray | None = None
    s2: np.ndarray | None = None
    w13_float: np.ndarray | None = None
    w2_float: np.ndarray | None = None
    ref: dict[str, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)

    @property
    def quant(self) -> str | None:
        """The activation quantization of the layer's quant mode (None for float layers)."""
        return ACTIVATION_QUANT[self.config.quant]

    @property
    def fp8(self) -> bool:
        return self.config.quant != "none"

    @property
    def M(self) -> int:
        """Rows this rank computes (``expert_offsets[-1]`` of the reference's routing)."""
        return int(self.ref["routing"]["expert_offsets"][-1])

    @property
    def weights(self) -> tuple:
        return self.w13, self.s13, self.w2, self.s2


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage: ``run(impl, up) -> {output: array}`` in ``impl``'s framework on ``up``'s values.

    ``rows``: outputs indexed by permuted row (``[M_cap, ...]``): compared on rows ``< M`` (rows ``>= M``
    are never read, section 2). ``weight_grads``: ``[E_local, N, K]`` weight gradients (an expert with
    no rows must get exactly 0, section 8). ``skip(up)``: why the stage does not run on these inputs
    (None: it runs). ``backward``: judged by section 8 (else section 7).
    """

    name: str
    what: str
    run: Callable[[Impl, Upstream], dict[str, Any]]
    rows: tuple[str, ...] = ()
    weight_grads: tuple[str, ...] = ()
    skip: Callable[[Upstream], str | None] = lambda up: None
    backward: bool = False
    references_only: bool = False


# ---- forward (moe_*/layer.py, in order) ----

def _weights(impl: Impl, up: Upstream):
    """``quantize_weight_fp8`` of this rank's float weights, a few experts at a time (<= 1 GiB of float32
    temporaries on the device: a DeepSeek-V3 w13 whole would need 30 GB beside the other framework's
    memory), back to the host."""
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


def _routing(impl: Impl, up: Upstream):
    start, e_local = up.config.local_expert_range()
    meta = impl.mod.routing_metadata(
        impl.native(up.ref["gate"]["topk_ids"]), up.config.num_total_experts, expert_start=start,
        num_local_experts=e_local, implementation=impl.op_impl("permute"))
    return {"expert_offsets": meta.expert_offsets, "src2dst": meta.src2dst, "dst2src": meta.dst2src}


def _permute(impl: Impl, up: Upstream):
    xq, xs = impl.mod.permute(impl.native(up.x), impl.native(up.ref["routing"]["dst2src"]),
                              topk=up.config.num_slots, quant=up.quant, implementation=impl.op_impl("permute"))
    return {"x_permuted": xq, "x_scale": xs} if xs is not None else {"x_permuted": xq}


def _gemm(impl: Impl, up: Upstream, name: str, x_rows, x_scale, w, w_scale):
    return {name: impl.mod.grouped_gemm(
        impl.native(x_rows), impl.native(w), impl.native(up.ref["routing"]["expert_offsets"]),
        x_scale=impl.native(x_scale), w_scale=impl.native(w_scale), out_dtype=impl.bf16,
        implementation=impl.op_impl("grouped_gemm"))}


def _gemm1(impl: Impl, up: Upstream):
    p = up.ref["permute"]
    return _gemm(impl, up, "h", p["x_permuted"], p.get("x_scale"), up.w13, up.s13)


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
    return _gemm(impl, up, "y", a["a"], a.get("a_scale"), up.w2, up.s2)


def _combine(impl: Impl, up: Upstream):
    out = impl.mod.combine(impl.native(up.ref["gemm2"]["y"]), impl.native(up.ref["routing"]["src2dst"]),
                           impl.native(up.ref["gate"]["topk_weights"]),
                           routed_scaling_factor=up.config.combine_routed_scaling_factor, out_dtype=impl.bf16,
                           implementation=impl.op_impl("combine"))
    return {"out": out}


def _layer(impl: Impl, up: Upstream):
    # eager: the kernels are jitted inside; a jit here would cache across calls and hide a patched stage
    out = impl.mod.moe_forward(
        impl.native(up.x), impl.native(up.logits), impl.native(up.w13), impl.native(up.w2), up.config,
        w13_scale=impl.native(up.s13), w2_scale=impl.native(up.s2), e_score_correction_bias=impl.native(up.bias),
        implementation=impl.impl)
    return {"out": out}


# ---- backward (CONTRACT.md section 8, the stage-level backward ops, in the order the gradient flows) ----

def _combine_bwd(impl: Impl, up: Upstream):
    d_y, d_w = impl.api("combine").combine_backward(
        impl.native(up.d_out), impl.native(up.ref["gemm2"]["y"]), impl.native(up.ref["routing"]["src2dst"]),
        impl.native(up.ref["gate"]["topk_weights"]), routed_scaling_factor=up.config.combine_routed_scaling_factor,
        implementation=impl.op_impl("combine"))
    return {"d_y": d_y, "d_topk_weights": d_w}


def _dgrad(impl: Impl, up: Upstream, name: str, d_y, w, w_scale):
    backend = impl.op_impl("grouped_gemm", "DGRAD_IMPLEMENTATIONS")
    if w_scale is not None and backend == "pallas_mosaic_gpu":  # no FP8 weights in the Mosaic dgrad
        backend = impl.other_impl
    return {name: impl.api("grouped_gemm").grouped_gemm_dgrad(
        impl.native(d_y), impl.native(w), impl.native(up.ref["routing"]["expert_offsets"]),
        w_scale=impl.native(w_scale), implementation=backend)}


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
    d_x = impl.api("permute").permute_backward(
        impl.native(up.ref["gemm1_dgrad"]["d_xp"]), impl.native(up.ref["routing"]["src2dst"]),
        num_tokens=up.x.shape[0], implementation=impl.op_impl("permute"))
    return {"d_x": d_x}


def _gate_bwd(impl: Impl, up: Upstream):
    d = impl.api("gate").select_experts_backward(
        impl.native(up.logits), impl.native(up.ref["gate"]["topk_ids"]),
        impl.native(up.ref["combine_bwd"]["d_topk_weights"]), **up.config.gate_kwargs(),
        e_score_correction_bias=impl.native(up.bias), implementation=impl.op_impl("gate"))
    return {"d_router_logits": d}


def _layer_bwd(impl: Impl, up: Upstream):
    _, grads = layer_vjp(impl, up.config, impl.native(up.x), impl.native(up.logits),
                         tuple(impl.native(w) for w in up.weights), impl.native(up.bias), impl.native(up.d_out))
    return grads


def _no_fp8_wgrad(up: Upstream) -> str | None:
    return ("FP8 layer: the weight codes are frozen, no weight gradient is formed (CONTRACT.md section 8)"
            if up.fp8 else None)


#: The FP8 modes' weight quantization (references only: there is no kernel; not run when a checkpoint
#: gives FP8 codes and scales, nor for float layers).
WEIGHTS_STAGE = Stage("weights", "float w13, w2 --quantize_weight_fp8--> codes + scales (FP8 modes; references only)",
                      _weights, references_only=True)

#: The forward stages after ``weights``, in the order of ``moe_*/layer.py``.
FORWARD_STAGES = (
    Stage("gate", "router_logits --select_experts--> topk_weights, topk_ids", _gate),
    Stage("routing", "topk_ids --routing_metadata--> expert_offsets, src2dst, dst2src", _routing, rows=("dst2src",)),
    Stage("permute", "x, dst2src --permute (+FP8 quant)--> x_permuted, x_scale", _permute,
          rows=("x_permuted", "x_scale")),
    Stage("gemm1", "x_permuted, w13 --grouped_gemm--> h", _gemm1, rows=("h",)),
    Stage("act", "h --act_and_mul (+FP8 quant)--> a, a_scale", _act, rows=("a", "a_scale", "a_f32")),
    Stage("gemm2", "a, w2 --grouped_gemm--> y", _gemm2, rows=("y",)),
    Stage("combine", "y, src2dst, topk_weights --combine--> out", _combine),
    Stage("layer", "x, router_logits, weights --moe_forward--> out (end to end, nothing shared)", _layer),
)

#: The backward stages (``--backward``), in the order the gradient flows; ``d_out [T, H]`` a seeded random cotangent.
BACKWARD_STAGES = (
    Stage("combine_bwd", "d_out, y, src2dst, topk_weights --combine_backward--> d_y, d_topk_weights", _combine_bwd,
          rows=("d_y",), backward=True),
    Stage("gemm2_dgrad", "d_y, w2 --grouped_gemm_dgrad--> d_a", _gemm2_dgrad, rows=("d_a",), backward=True),
    Stage("gemm2_wgrad", "a, d_y --grouped_gemm_wgrad--> d_w2 (float weights only)", _gemm2_wgrad,
          weight_grads=("d_w2",), skip=_no_fp8_wgrad, backward=True),
    Stage("act_bwd", "h, d_a --act_and_mul_backward--> d_h", _act_bwd, rows=("d_h",), backward=True),
    Stage("gemm1_dgrad", "d_h, w13 --grouped_gemm_dgrad--> d_xp", _gemm1_dgrad, rows=("d_xp",), backward=True),
    Stage("gemm1_wgrad", "x_permuted, d_h --grouped_gemm_wgrad--> d_w13 (float weights only)", _gemm1_wgrad,
          weight_grads=("d_w13",), skip=_no_fp8_wgrad, backward=True),
    Stage("permute_bwd", "d_xp, src2dst --permute_backward--> d_x", _permute_bwd, backward=True),
    Stage("gate_bwd", "router_logits, topk_ids, d_topk_weights --select_experts_backward--> d_router_logits",
          _gate_bwd, backward=True),
    Stage("layer_bwd", "d_out --vjp of moe_forward--> d_x, d_router_logits, d_w13, d_w2 (end to end)", _layer_bwd,
          weight_grads=("d_w13", "d_w2"), backward=True),
)

STAGE_TABLE = {s.name: s for s in (WEIGHTS_STAGE,) + FORWARD_STAGES + BACKWARD_STAGES}
#: Forward stage names in order (``weights``: the FP8 modes' weight quantization, references only).
STAGES = ("weights",) + tuple(s.name for s in FORWARD_STAGES)
BACKWARD_STAGE_NAMES = tuple(s.name for s in BACKWARD_STAGES)
#: The stage names of the expert-parallel summary (``run_ep_check``): every rank end to end, summed.
EP_STAGE = "ep"
EP_BACKWARD_STAGE = "ep_bwd"
ALL_STAGES = STAGES + BACKWARD_STAGE_NAMES + (EP_STAGE, EP_BACKWARD_STAGE)
