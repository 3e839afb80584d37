"""The backward kernels of the non-GEMM stages (CONTRACT.md section 8) against their framework's reference.

Kernels: Triton (``moe_torch/ops/{activation,combine,permute,gate}/triton.py``, ``implementation="triton"``)
and Pallas-Triton (``moe_pallas/ops/*/pallas_triton.py``, ``implementation="pallas_triton"``), called
through the public backward ops (so the dispatch path is exercised too) and directly with forced
configs (several programs, padded rows / columns / tokens, several hidden-dim chunks).

On the CPU they run interpreted: Triton under ``TRITON_INTERPRET=1`` (``conftest.py``; ``moe_torch``
makes the interpreter's casts exact itself), Pallas with ``interpret=True``, which fills every output
with NaN before the kernel runs, so an element a kernel forgets to write fails the comparisons. The
Triton kernels are also compiled to sm_90 cubin and the Pallas kernels lowered for CUDA, without a GPU.

Tolerances: float32 results within ``GRAD_F32_REL_FRO`` of the reference (both float32 math, different
summation order / transcendental ulps); bf16 results at most one bf16 rounding apart (``2**-8``);
Triton and Pallas within the float32 row of each other.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

import moe_pallas
import moe_torch
from common import to_jax, to_torch
from moe_pallas.ops.activation import api as j_act_api
from moe_pallas.ops.activation.config import ActAndMulBackwardConfig as JActConfig
from moe_pallas.ops.activation.pallas_triton import act_and_mul_backward_pallas_triton
from moe_pallas.ops.combine import api as j_comb_api
from moe_pallas.ops.combine.config import CombineBackwardConfig as JCombConfig
from moe_pallas.ops.combine.pallas_triton import combine_backward_pallas_triton
from moe_pallas.ops.gate import api as j_gate_api
from moe_pallas.ops.gate.config import GateConfig as JGateConfig
from moe_pallas.ops.gate.pallas_triton import select_experts_backward_pallas_triton
from moe_pallas.ops.permute import api as j_perm_api
from moe_pallas.ops.permute.config import PermuteBackwardConfig as JPermConfig
from moe_pallas.ops.permute.pallas_triton import permute_backward_pallas_triton
from moe_torch.ops.activation import api as t_act_api
from moe_torch.ops.activation.config import ActAndMulBackwardConfig as TActConfig
from moe_torch.ops.combine import api as t_comb_api
from moe_torch.ops.combine.config import CombineBackwardConfig as TCombConfig
from moe_torch.ops.gate import api as t_gate_api
from moe_torch.ops.gate.config import GateConfig as TGateConfig
from moe_torch.ops.permute import api as t_perm_api
from moe_torch.ops.permute.config import PermuteBackwardConfig as TPermConfig
from sm90 import compile_sm90
from test_backward_stages import GATE_CASES, _gate_case, _gate_kwargs, _h, _routing
from tolerances import GRAD_F32_REL_FRO, assert_exact, assert_rel_fro, to_numpy

#: bf16 results of the kernel and the reference round the same float32 math: at most one bf16 ulp apart.
BF16_ONE_ROUNDING = 2.0**-8
LIMIT = {"float32": GRAD_F32_REL_FRO, "bfloat16": BF16_ONE_ROUNDING}

#: The interpreter evaluates tl.sigmoid(g) = 1 / (1 + exp(-g)) in numpy: exp overflows to inf for very
#: negative g and numpy warns, but 1 / (1 + inf) = 0 is the right value (the GPU's ex2 saturates silently).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _finite(a, what: str) -> None:
    x = to_numpy(a).astype(np.float32)
    assert np.isfinite(x).all(), f"{what}: {x.size - np.isfinite(x).sum()} non-finite values (unwritten or leaked)"


# --------------------------------------------------------------------------------------
# Triton (moe_torch), interpreted


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("M,I,config", [
    (1, 8, None),  # M = 1
    (7, 33, None),  # odd I: the up half starts mid-block, masked columns
    (7, 33, TActConfig(block_m=2, block_n=16, num_warps=4, num_stages=1)),  # 4 x 3 programs, ragged both ways
])
def test_triton_act_and_mul_backward(dtype, activation, M, I, config):
    rng = np.random.default_rng(M + I)
    h, da = _h(rng, M, I)
    hh, dd = to_torch(h, dtype), to_torch(da, dtype)
    want = moe_torch.act_and_mul_backward(hh, dd, activation=activation, implementation="reference")
    if config is None:
        got = moe_torch.act_and_mul_backward(hh, dd, activation=activation, implementation="triton")
    else:
        from moe_torch.ops.activation.triton import act_and_mul_backward_triton

        got = act_and_mul_backward_triton(hh, dd, activation, hh.dtype, config=config)
    assert got.dtype == hh.dtype
    _finite(got, "d_h")
    assert_rel_fro(got, want, LIMIT[dtype], f"{activation} {dtype}")


_TCOMB_SMALL = TCombConfig(block_t=2, block_h=16, block_k=4, num_warps=4, num_stages=1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("routing,config", [
    ("T1", None),
    ("ep-nonlocal-empty", None),
    ("ep-nonlocal-empty", _TCOMB_SMALL),  # 5 token programs (one half padding) x 3 hidden chunks (the last ragged)
    ("one-expert", _TCOMB_SMALL),
    ("ep-no-local-token", None),
])
def test_triton_combine_backward(dtype, routing, config):
    """Rows ``>= M`` of y poisoned with NaN: never read; d_y is 0 there (the launcher's zero fill)."""
    T, topk, M, src2dst, _ = _routing(routing)
    rng = np.random.default_rng(T * topk)
    H, rsf = 40, 2.5
    y = rng.standard_normal((T * topk, H)).astype(np.float32)
    y[M:] = np.nan
    w = rng.random((T, topk)).astype(np.float32)
    d_out = to_torch(rng.standard_normal((T, H)).astype(np.float32), dtype)
    yy, s2d, ww = to_torch(y, dtype), to_torch(src2dst), to_torch(w)
    want_y, want_w = moe_torch.combine_backward(d_out, yy, s2d, ww, routed_scaling_factor=rsf, implementation="reference")
    if config is None:
        got_y, got_w = moe_torch.combine_backward(d_out, yy, s2d, ww, routed_scaling_factor=rsf, implementation="triton")
    else:
        from moe_torch.ops.combine.triton import combine_backward_triton

        got_y, got_w = combine_backward_triton(d_out, yy, s2d, ww, rsf, config=config)
    assert got_y.dtype == yy.dtype and got_w.dtype == torch.float32
    _finite(got_y, "d_y")
    _finite(got_w, "d_topk_weights")
    assert (to_numpy(got_y)[M:] == 0).all()
    assert_exact(got_y, want_y, "d_y: one product per row, the same rounding")
    assert_rel_fro(got_w, want_w, GRAD_F32_REL_FRO, "d_topk_weights")


def test_triton_combine_backward_rsf_one_and_strided():
    """rsf = 1 (APPLY_RSF off) and a non-contiguous d_out (an expanded gradient, stride 0)."""
    T, topk, M, src2dst, _ = _routing("ep-nonlocal-empty")
    rng = np.random.default_rng(3)
    y = to_torch(rng.standard_normal((T * topk, 24)).astype(np.float32))
    w = to_torch(rng.random((T, topk)).astype(np.float32))
    d_out = to_torch(rng.standard_normal((1, 24)).astype(np.float32)).expand(T, 24)
    want = moe_torch.combine_backward(d_out, y, to_torch(src2dst), w, implementation="reference")
    got = moe_torch.combine_backward(d_out, y, to_torch(src2dst), w, implementation="triton")
    assert_exact(got[0], want[0], "d_y")
    assert_rel_fro(got[1], want[1], GRAD_F32_REL_FRO, "d_topk_weights")


@pytest.mark.parametrize("g_dtype,a_dtype,out_dtype,M,N", [
    ("float32", "bfloat16", "bfloat16", 1, 7),  # the layer's d_a0 [M, I] with a: one row, a ragged chunk
    ("bfloat16", None, "bfloat16", 9, 1030),  # the layer's d_y0 [M, H]: 3 row programs (one ragged), 2 chunks
    ("float32", "float32", "float32", 6, 33),
])
def test_triton_scale_rows(g_dtype, a_dtype, out_dtype, M, N, monkeypatch):
    """The layer backward's row weights (``combine.api.scale_rows``): ``out`` bit-identical to torch's mixed-dtype
    multiply (float32 product, one rounding), the row dots within float32 reordering; zero weights (padding rows)
    give zero rows; ``scale_dot_with``: ``a`` weighted the same way (one rounding, bit-identical)."""
    from moe_torch.ops.combine import triton as comb_triton
    from moe_torch.ops.combine.api import scale_rows

    monkeypatch.setattr(comb_triton, "SCALE_ROWS_BLOCK_N", 512)  # several column chunks at test sizes
    rng = np.random.default_rng(M * N)
    g = to_torch(rng.standard_normal((M, N)).astype(np.float32), g_dtype)
    w = to_torch(rng.uniform(-2, 2, M).astype(np.float32))
    w[-1] = 0.0
    a = None if a_dtype is None else to_torch(rng.standard_normal((M, N)).astype(np.float32), a_dtype)
    out_dt = getattr(torch, out_dtype)
    want = scale_rows(g, w, out_dtype=out_dt, dot_with=a, scale_dot_with=a is not None, implementation="reference")
    got = scale_rows(g, w, out_dtype=out_dt, dot_with=a, scale_dot_with=a is not None, implementation="triton")
    assert got[0].dtype == out_dt and not got[0][-1].any()
    assert_exact(got[0], want[0], "out: one float32 product a row element, one rounding")
    if a is None:
        assert got[1] is None and want[1] is None and got[2] is None
        with pytest.raises(ValueError, match="scale_rows: scale_dot_with=True weights dot_with's rows"):
            scale_rows(g, w, out_dtype=out_dt, scale_dot_with=True)
    else:
        assert got[1].dtype == torch.float32
        assert_rel_fro(got[1], want[1], GRAD_F32_REL_FRO, "row dots")
        assert got[2].dtype == a.dtype and not got[2][-1].any()
        assert_exact(got[2], want[2], "a weighted: one float32 product, one rounding")
    with pytest.raises(ValueError, match=r"scale_rows: row_weights must be float32 \[%d\]" % M):
        scale_rows(g, w[:-1] if M > 1 else w.repeat(2), out_dtype=out_dt)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("routing,config", [
    ("T1", None),
    ("ep-nonlocal-empty", TPermConfig(block_t=4, block_h=16, num_warps=4, num_stages=1)),  # 3 x 3 programs, ragged
    ("one-expert", None),
    ("ep-no-local-token", None),  # tokens with no local slot: exactly 0
])
def test_triton_permute_backward(dtype, routing, config):
    """Rows ``>= M`` of d_xp poisoned with NaN: never read."""
    T, topk, M, src2dst, _ = _routing(routing)
    rng = np.random.default_rng(T + topk)
    d_xp = rng.standard_normal((T * topk, 40)).astype(np.float32)
    d_xp[M:] = np.nan
    dd, s2d = to_torch(d_xp, dtype), to_torch(src2dst)
    want = moe_torch.permute_backward(dd, s2d, implementation="reference")
    if config is None:
        got = moe_torch.permute_backward(dd, s2d, implementation="triton")
    else:
        from moe_torch.ops.permute.triton import permute_backward_triton

        got = permute_backward_triton(dd, s2d, dd.dtype, config=config)
    assert got.dtype == dd.dtype
    _finite(got, "d_x")
    assert (to_numpy(got)[(src2dst < 0).all(axis=1)] == 0).all()
    assert_rel_fro(got, want, LIMIT[dtype], "d_x")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(GATE_CASES))
def test_triton_select_experts_backward(case, dtype):
    """Every gate case (all routing modes, both rsf placements, shared experts, T=1, topk=E, DeepSeek-V3
    size E=256), float32 and bf16 logits: d_logits (float32) vs the torch reference."""
    kw, logits, bias = _gate_case(case, seed=len(case) + 1)
    lg = to_torch(logits, dtype)
    kw32 = _gate_kwargs("torch", kw, bias, "float32")
    _, ids = moe_torch.select_experts(lg, **kw32)
    d_w = to_torch(np.random.default_rng(5).standard_normal(ids.shape).astype(np.float32))
    want = moe_torch.select_experts_backward(lg, ids, d_w, **kw32, implementation="reference")
    got = moe_torch.select_experts_backward(lg, ids, d_w, **kw32, implementation="triton")
    assert got.dtype == torch.float32
    _finite(got, "d_logits")
    assert_rel_fro(got, want, GRAD_F32_REL_FRO, case)


def test_triton_select_experts_backward_padded_tokens_and_int64_ids():
    """A forced config of 4 tokens a program over T = 21 (a padded last program) and int64 ids."""
    from moe_torch.ops.gate.triton import select_experts_backward_triton

    kw, logits, bias = _gate_case("biased-shared-rsf-on-output", seed=9)
    lg = to_torch(logits)
    kw32 = _gate_kwargs("torch", kw, bias, "float32")
    _, ids = moe_torch.select_experts(lg, **kw32)
    d_w = to_torch(np.random.default_rng(6).standard_normal(ids.shape).astype(np.float32))
    want = moe_torch.select_experts_backward(lg, ids, d_w, **kw32, implementation="reference")
    cfg = TGateConfig(block_t=4, block_e=16, block_k=4, num_warps=1)
    got = select_experts_backward_triton(lg, ids.long(), d_w, **kw32, config=cfg)
    assert_rel_fro(got, want, GRAD_F32_REL_FRO, "padded tokens, int64 ids")


# --------------------------------------------------------------------------------------
# Pallas-Triton (moe_pallas), interpret mode (each distinct shape compiles once: few cases)


@pytest.mark.parametrize("dtype,activation,M,I,config", [
    ("float32", "silu", 7, 33, None),
    ("bfloat16", "gelu_tanh", 7, 33, JActConfig(block_m=2, block_i=16)),  # 4 x 3 programs, ragged both ways
    ("float32", "gelu_tanh", 1, 8, None),  # M = 1
])
def test_pallas_act_and_mul_backward(dtype, activation, M, I, config):
    rng = np.random.default_rng(M + I)
    h, da = _h(rng, M, I)
    hh, dd = to_jax(h, dtype), to_jax(da, dtype)
    want = moe_pallas.act_and_mul_backward(hh, dd, activation=activation, implementation="reference")
    got = act_and_mul_backward_pallas_triton(hh, dd, activation=activation, config=config)
    assert got.dtype == hh.dtype
    _finite(got, "d_h")
    assert_rel_fro(got, want, LIMIT[dtype], f"{activation} {dtype}")
    if dtype == "float32" and M == 7:  # Triton and Pallas on the same inputs
        tri = moe_torch.act_and_mul_backward(to_torch(h), to_torch(da), activation=activation, implementation="triton")
        assert_rel_fro(got, tri, GRAD_F32_REL_FRO, "Pallas vs Triton")


@pytest.mark.parametrize("dtype,routing,config", [
    ("float32", "ep-nonlocal-empty", JCombConfig(block_t=2, block_h=16)),  # 5 programs x 3 chunks (fori_loop)
    ("bfloat16", "T1", None),
])
def test_pallas_combine_backward(dtype, routing, config):
    """Rows ``>= M`` of y poisoned with NaN: never read; d_y is 0 there (the aliased zeros: interpret mode
    would leave NaN in any row the kernel does not own)."""
    T, topk, M, src2dst, _ = _routing(routing)
    rng = np.random.default_rng(T * topk)
    H, rsf = 40, 2.5
    y = rng.standard_normal((T * topk, H)).astype(np.float32)
    y[M:] = np.nan
    w = rng.random((T, topk)).astype(np.float32)
    d_out = rng.standard_normal((T, H)).astype(np.float32)
    args = (to_jax(d_out, dtype), to_jax(y, dtype), to_jax(src2dst), to_jax(w))
    want_y, want_w = moe_pallas.combine_backward(*args, routed_scaling_factor=rsf, implementation="reference")
    got_y, got_w = combine_backward_pallas_triton(*args, routed_scaling_factor=rsf, config=config)
    assert got_y.dtype == args[1].dtype and got_w.dtype == jnp.float32
    _finite(got_y, "d_y")
    _finite(got_w, "d_topk_weights")
    assert (to_numpy(got_y)[M:] == 0).all()
    assert_exact(got_y, want_y, "d_y: one product per row, the same rounding")
    assert_rel_fro(got_w, want_w, GRAD_F32_REL_FRO, "d_topk_weights")
    if dtype == "float32":
        targs = (to_torch(d_out), to_torch(y), to_torch(src2dst), to_torch(w))
        tri_y, tri_w = moe_torch.combine_backward(*targs, routed_scaling_factor=rsf, implementation="triton")
        assert_exact(got_y, tri_y, "Pallas vs Triton d_y")
        assert_rel_fro(got_w, tri_w, GRAD_F32_REL_FRO, "Pallas vs Triton d_topk_weights")


@pytest.mark.parametrize("dtype,routing,config", [
    ("float32", "ep-nonlocal-empty", JPermConfig(block_t=4, block_h=16)),  # 3 x 3 programs, ragged
    ("bfloat16", "ep-no-local-token", None),  # tokens with no local slot: exactly 0
])
def test_pallas_permute_backward(dtype, routing, config):
    T, topk, M, src2dst, _ = _routing(routing)
    rng = np.random.default_rng(T + topk)
    d_xp = rng.standard_normal((T * topk, 40)).astype(np.float32)
    d_xp[M:] = np.nan  # rows >= M: never read
    dd, s2d = to_jax(d_xp, dtype), to_jax(src2dst)
    want = moe_pallas.permute_backward(dd, s2d, implementation="reference")
    got = permute_backward_pallas_triton(dd, s2d, config=config)
    assert got.dtype == dd.dtype
    _finite(got, "d_x")
    assert (to_numpy(got)[(src2dst < 0).all(axis=1)] == 0).all()
    assert_rel_fro(got, want, LIMIT[dtype], "d_x")
    if dtype == "float32":
        tri = moe_torch.permute_backward(to_torch(d_xp), to_torch(src2dst), implementation="triton")
        assert_rel_fro(got, tri, GRAD_F32_REL_FRO, "Pallas vs Triton")


@pytest.mark.parametrize("case,dtype,config", [
    ("softmax-T1", "float32", None),
    ("softmax-primeE-topk1-norenorm", "bfloat16", None),
    ("grouped", "float32", JGateConfig(block_t=4)),  # T = 33: 9 programs, the last padded
    ("biased-shared-rsf-on-output", "float32", None),
    ("biased-rsf-in-combine", "bfloat16", None),
])
def test_pallas_select_experts_backward(case, dtype, config):
    kw, logits, bias = _gate_case(case, seed=len(case) + 1)
    lg = to_jax(logits, dtype)
    kw32 = _gate_kwargs("jax", kw, bias, "float32")
    _, ids = moe_pallas.select_experts(lg, **kw32)
    d_w = to_jax(np.random.default_rng(5).standard_normal(ids.shape).astype(np.float32))
    want = moe_pallas.select_experts_backward(lg, ids, d_w, **kw32, implementation="reference")
    kern = {k: kw[k] for k in ("topk", "routing", "renormalize", "routed_scaling_factor",
                               "apply_routed_scaling_factor_on_output")}
    got = select_experts_backward_pallas_triton(lg, ids, d_w, **kern, config=config)
    assert got.dtype == jnp.float32
    _finite(got, "d_logits")
    assert_rel_fro(got, want, GRAD_F32_REL_FRO, case)
    if dtype == "float32":
        tkw = _gate_kwargs("torch", kw, bias, "float32")
        tri = moe_torch.select_experts_backward(to_torch(logits), to_torch(to_numpy(ids)), to_torch(to_numpy(d_w)), **tkw,
                                                implementation="triton")
        assert_rel_fro(got, tri, GRAD_F32_REL_FRO, "Pallas vs Triton")


def _gate_grad(fw: str, impl: str, logits: np.ndarray, d_w: np.ndarray, kw: dict):
    """``(topk_weights, topk_ids, d_router_logits)`` as numpy, through the framework's autodiff of
    ``select_experts(implementation=impl)`` (the loss is ``sum(topk_weights * d_w)``)."""
    if fw == "torch":
        lg = to_torch(logits).requires_grad_(True)
        w, ids = moe_torch.select_experts(lg, **kw, implementation=impl)
        (w * to_torch(d_w)).sum().backward()
        return to_numpy(w.detach()), to_numpy(ids), to_numpy(lg.grad)
    (w, ids), vjp = jax.vjp(lambda lg: moe_pallas.select_experts(lg, **kw, implementation=impl), to_jax(logits))
    (d_lg,) = vjp((to_jax(d_w), np.zeros(ids.shape, jax.dtypes.float0)))
    return to_numpy(w), to_numpy(ids), to_numpy(d_lg)


@pytest.mark.parametrize("fw,impl", [("torch", "reference"), ("torch", "triton"), ("jax", "reference"),
                                     ("jax", "pallas_triton")])
def test_sigmoid_gate_unchosen_nan_logit_gets_zero_gradient(fw, impl):
    """CONTRACT.md section 8: in the sigmoid routings ``d_logit`` is exactly 0 off the chosen experts, also where
    that logit is NaN (section 1 ranks it last; ``s * (1 - s)`` is NaN there, and NaN * 0 was NaN in all four
    implementations). The chosen experts' gradient is the one of the same logits with the NaN made a finite
    never-chosen value. softmax_topk: a NaN in a row makes every ``p`` of the row NaN, so the forward's weights
    are NaN and the chain rule gives NaN for that row (section 8 defines no 0 there); the other rows stay exact."""
    E = 8
    d_w = np.array([[0.7, -1.3], [0.4, 0.9]], np.float32)
    # sigmoid_topk, renormalized: the NaN (expert 0) and a -inf (expert 7) are never chosen.
    sig = np.array([[np.nan, 1, 2, -1, .5, 3, 0, -np.inf], [0.3, -2, 1.5, np.nan, 2.5, -1, 0, 1]], np.float32)
    # biased_grouped_topk, 4 groups of 2, one kept: the NaN sits in a dropped group.
    biased = np.array([[2, 3, np.nan, -1, -2, 0, 1, -3], [0, 1, 2, 1, np.nan, 0.5, 3, 2.5]], np.float32)
    bias = np.linspace(-0.2, 0.2, E).astype(np.float32)
    cases = [
        (sig, dict(topk=2, routing="sigmoid_topk", renormalize=True)),
        (sig, dict(topk=2, routing="sigmoid_topk", renormalize=False, routed_scaling_factor=2.5,
                   apply_routed_scaling_factor_on_output=True)),
        (biased, dict(topk=2, routing="biased_grouped_topk", renormalize=True, num_expert_group=4, topk_group=1,
                      e_score_correction_bias=to_torch(bias) if fw == "torch" else to_jax(bias))),
    ]
    for logits, kw in cases:
        what = f"{kw['routing']} renormalize={kw['renormalize']}"
        nan = np.isnan(logits)
        w, ids, got = _gate_grad(fw, impl, logits, d_w, kw)
        assert np.isfinite(w).all() and not nan[np.arange(2)[:, None], ids].any(), what
        assert (got[nan] == 0).all(), f"{what}: d_logits at the unchosen NaN logits = {got[nan]}"
        assert np.isfinite(got).all(), f"{what}: {got}"
        clean = np.where(nan, np.float32(-30.0), logits)  # as low: chosen neither
        w2, ids2, want = _gate_grad(fw, impl, clean, d_w, kw)
        assert (ids2 == ids).all(), what
        assert_rel_fro(got, want, GRAD_F32_REL_FRO, what)

    logits = sig.copy()
    logits[1, 3] = 0.0  # row 0 keeps its NaN, row 1 is finite
    w, ids, got = _gate_grad(fw, impl, logits, d_w, dict(topk=2, routing="softmax_topk", renormalize=True))
    assert np.isnan(w[0]).all() and np.isnan(got[0]).all(), "softmax_topk: a NaN row's weights and gradient"
    assert np.isfinite(w[1]).all() and np.isfinite(got[1]).all(), "softmax_topk: the NaN must not leave its row"


# --------------------------------------------------------------------------------------
# dispatch and the differentiable ops' glue: the backward runs with the forward's implementation


def _spy(monkeypatch, module, name: str) -> list:
    """Replace ``module.name`` by a wrapper that records its calls; returns the record."""
    calls, original = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_torch_glue_uses_the_forward_implementation(monkeypatch):
    """autograd through each stage with implementation="triton" runs the Triton backward (once); with None
    on the CPU the reference (and the Triton backward is never called), on CUDA the Triton backward again."""
    rng = np.random.default_rng(31)
    T, topk, M, src2dst, dst2src = _routing("ep-nonlocal-empty")
    kw, logits, bias = _gate_case("grouped")
    kw32 = _gate_kwargs("torch", kw, bias, "float32")
    spies = {name: _spy(monkeypatch, mod, fn) for name, mod, fn in [
        ("act", t_act_api, "_triton_backward"), ("combine", t_comb_api, "_triton_backward"),
        ("permute", t_perm_api, "_triton_permute_backward"), ("gate", t_gate_api, "_triton_select_experts_backward")]}
    for impl in ("triton", None):
        h = to_torch(_h(rng, 4, 8)[0]).requires_grad_()
        x = to_torch(rng.standard_normal((T, 8)).astype(np.float32)).requires_grad_()
        y = to_torch(rng.standard_normal((T * topk, 8)).astype(np.float32)).requires_grad_()
        w = to_torch(rng.random((T, topk)).astype(np.float32)).requires_grad_()
        lg = to_torch(logits).requires_grad_()
        loss = (moe_torch.act_and_mul(h, implementation=impl)[0].sum()
                + moe_torch.permute(x, to_torch(dst2src), topk=topk, implementation=impl)[0].sum()
                + moe_torch.combine(y, to_torch(src2dst), w, implementation=impl).sum()
                + (moe_torch.select_experts(lg, **kw32, implementation=impl)[0]
                   * torch.arange(4.0, device=lg.device)).sum())
        loss.backward()
        for t in (h, x, y, w, lg):
            _finite(t.grad, "grad")
        # "triton": one Triton backward per stage; then None adds none on the CPU (the reference), one on CUDA
        # (None means the kernel there: moe_torch.ops.dispatch.GPU_ORDER)
        calls = 1 if impl == "triton" or not lg.is_cuda else 2
        assert {k: len(v) for k, v in spies.items()} == {k: calls for k in spies}, impl


def test_jax_glue_uses_the_forward_implementation(monkeypatch):
    """jax.grad through each stage with implementation="pallas_triton" traces the Pallas backward (once);
    with None on the CPU the reference, on a GPU the Pallas backward again."""
    rng = np.random.default_rng(32)
    T, topk, M, src2dst, dst2src = _routing("ep-nonlocal-empty")
    kw, logits, bias = _gate_case("grouped")
    kw32 = _gate_kwargs("jax", kw, bias, "float32")
    spies = {name: _spy(monkeypatch, mod, fn) for name, mod, fn in [
        ("act", j_act_api, "act_and_mul_backward_pallas_triton"), ("combine", j_comb_api, "combine_backward_pallas_triton"),
        ("permute", j_perm_api, "permute_backward_pallas_triton"),
        ("gate", j_gate_api, "select_experts_backward_pallas_triton")]}
    h = to_jax(_h(rng, 4, 8)[0])
    x = to_jax(rng.standard_normal((T, 8)).astype(np.float32))
    y = to_jax(rng.standard_normal((T * topk, 8)).astype(np.float32))
    w = to_jax(rng.random((T, topk)).astype(np.float32))
    lg = to_jax(logits)
    for impl in ("pallas_triton", None):
        def loss(h, x, y, w, lg):
            return (jnp.sum(moe_pallas.act_and_mul(h, implementation=impl)[0])
                    + jnp.sum(moe_pallas.permute(x, to_jax(dst2src), topk=topk, implementation=impl)[0])
                    + jnp.sum(moe_pallas.combine(y, to_jax(src2dst), w, implementation=impl))
                    + jnp.sum(moe_pallas.select_experts(lg, **kw32, implementation=impl)[0] * jnp.arange(4.0)))

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(h, x, y, w, lg)
        for g in grads:
            _finite(g, "grad")
        # None on a GPU means the kernel (moe_pallas.ops.dispatch.GPU_ORDER: these stages have no Mosaic GPU
        # backend, so Pallas Triton): traced a second time there; on the CPU the reference adds none.
        calls = 1 if impl == "pallas_triton" or jax.default_backend() != "gpu" else 2
        assert {k: len(v) for k, v in spies.items()} == {k: calls for k in spies}, impl


def test_backward_T0_returns_empty():
    """T = 0 (M_cap = 0): every backward op, every implementation of both frameworks, returns empty results
    of the right shapes (regression: the torch reference combine_backward failed reshaping 0 elements)."""
    frameworks = ((moe_torch, to_torch, ("reference", "triton")), (moe_pallas, to_jax, ("reference", "pallas_triton")))
    for mod, to, impls in frameworks:
        f32 = lambda *shape: to(np.zeros(shape, np.float32))  # noqa: E731
        s2d = to(np.zeros((0, 2), np.int32))
        for impl in impls:
            assert tuple(mod.act_and_mul_backward(f32(0, 8), f32(0, 4), implementation=impl).shape) == (0, 8)
            d_y, d_w = mod.combine_backward(f32(0, 8), f32(0, 8), s2d, f32(0, 2), implementation=impl)
            assert (tuple(d_y.shape), tuple(d_w.shape)) == ((0, 8), (0, 2))
            assert tuple(mod.permute_backward(f32(0, 8), s2d, implementation=impl).shape) == (0, 8)
            d_logits = mod.select_experts_backward(f32(0, 8), s2d, f32(0, 2), topk=2, implementation=impl)
            assert tuple(d_logits.shape) == (0, 8)


def test_default_on_cpu_is_the_reference():
    """implementation=None on CPU arrays: bit-identical to implementation="reference" (both frameworks)."""
    T, topk, M, src2dst, _ = _routing("T1")
    rng = np.random.default_rng(33)
    d_xp = rng.standard_normal((T * topk, 16)).astype(np.float32)
    assert_exact(moe_torch.permute_backward(to_torch(d_xp), to_torch(src2dst)),
                 moe_torch.permute_backward(to_torch(d_xp), to_torch(src2dst), implementation="reference"), "torch")
    assert_exact(moe_pallas.permute_backward(to_jax(d_xp), to_jax(src2dst)),
                 moe_pallas.permute_backward(to_jax(d_xp), to_jax(src2dst), implementation="reference"), "jax")


# --------------------------------------------------------------------------------------
# compiled for sm_90 (Triton, in a child process without the interpreter: tests/sm90.py) and lowered
# for CUDA (Pallas), on the CPU


def _job(module: str, kernel: str, signature: dict, constexprs: dict, num_warps: int = 4) -> dict:
    return {"module": module, "kernel": kernel, "signature": signature, "constexprs": constexprs,
            "options": {"num_warps": num_warps, "num_stages": 1}}


#: name -> job at production shapes (DeepSeek-V3: H = 7168, topk = 8, E = 256, I = 2048), bf16 activations.
SM90_JOBS = {
    "act_and_mul_backward": _job(
        "moe_torch.ops.activation.triton", "_act_and_mul_backward_kernel",
        {"h_ptr": "*bf16", "d_a_ptr": "*bf16", "d_h_ptr": "*bf16", "M": "i32", "I": "i32", "stride_h": "i32",
         "stride_da": "i32", "stride_dh": "i32"},
        {"ACTIVATION": 1, "BLOCK_M": 2, "BLOCK_N": 1024}),
    "combine_backward": _job(
        "moe_torch.ops.combine.triton", "_combine_backward_kernel",
        {"d_out_ptr": "*bf16", "y_ptr": "*bf16", "src2dst_ptr": "*i32", "w_ptr": "*fp32", "d_y_ptr": "*bf16",
         "d_w_ptr": "*fp32", "T": "i32", "H": "i32", "rsf": "fp32", "stride_do": "i32", "stride_y": "i32",
         "stride_s": "i32", "stride_w": "i32", "stride_dy": "i32", "stride_dw": "i32"},
        {"TOPK": 8, "APPLY_RSF": True, "H_CHUNKS": 7, "BLOCK_T": 2, "BLOCK_H": 1024, "BLOCK_K": 8}),
    "permute_backward": _job(
        "moe_torch.ops.permute.triton", "_permute_backward_kernel",
        {"d_xp_ptr": "*bf16", "src2dst_ptr": "*i32", "d_x_ptr": "*bf16", "T": "i32", "H": "i32", "stride_dxp": "i32",
         "stride_s": "i32", "stride_dx": "i32"},
        {"TOPK": 8, "BLOCK_T": 4, "BLOCK_H": 1024}),
    "select_experts_backward": _job(
        "moe_torch.ops.gate.triton", "_gate_backward_kernel",
        {"logits_ptr": "*bf16", "ids_ptr": "*i32", "d_w_ptr": "*fp32", "d_logits_ptr": "*fp32", "T": "i32",
         "stride_t": "i32", "stride_ids": "i32", "stride_dw": "i32", "stride_dl": "i32", "rsf": "fp32"},
        {"E": 256, "SIGMOID": True, "TOPK": 8, "RENORMALIZE": True, "APPLY_RSF": True, "BLOCK_T": 1, "BLOCK_E": 256},
        num_warps=1),
}


def test_triton_backward_kernels_compile_for_sm90():
    """Every backward kernel lowers to sm_90 cubin; none uses an atomic (the scatters are plain stores, the
    gathers sum in registers); the 64-bit row offsets are there (``mul.wide`` / s64 products)."""
    ptx = compile_sm90(SM90_JOBS)
    for name, text in ptx.items():
        assert ".target sm_90" in text, name
        assert not re.search(r"\b(atom|red)\.", text), f"{name}: an atomic"
    for name in ("combine_backward", "permute_backward"):
        assert "mul.wide.s32" in ptx[name] or "mul.lo.s64" in ptx[name], name


_H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "cuda"))


def test_pallas_backward_kernels_lower_for_cuda():
    """Each Pallas backward kernel lowers for CUDA (one Triton custom call each), at DeepSeek-V3 shapes."""
    S = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    T, topk, H = 13, 8, 7168
    jobs = [
        (functools.partial(act_and_mul_backward_pallas_triton, activation="gelu_tanh", interpret=False),
         (S((37, 2 * 384), bf16), S((37, 384), bf16))),
        (functools.partial(combine_backward_pallas_triton, routed_scaling_factor=2.5, interpret=False),
         (S((T, H), bf16), S((T * topk, H), bf16), S((T, topk), jnp.int32), S((T, topk), jnp.float32))),
        (functools.partial(permute_backward_pallas_triton, interpret=False),
         (S((T * topk, H), bf16), S((T, topk), jnp.int32))),
        (functools.partial(select_experts_backward_pallas_triton, topk=8, routing="biased_grouped_topk",
                           routed_scaling_factor=2.5, apply_routed_scaling_factor_on_output=True, interpret=False),
         (S((T, 256), bf16), S((T, 9), jnp.int32), S((T, 9), jnp.float32))),
    ]
    with use_abstract_mesh(_H200):
        for f, args in jobs:
            text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("__gpu$xla.gpu.triton") == 1, text[:2000]
