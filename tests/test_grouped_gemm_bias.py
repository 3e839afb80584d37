"""The grouped GEMM's per-expert bias (gpt-oss's ``gate_up_proj_bias [E, 2I]`` / ``down_proj_bias [E, H]``):
CONTRACT.md section 4 (``y[m] = x[m] @ w[e(m)].T + bias[e(m)]``, added to the float32 accumulator before the
one rounding, FP8 after the scales, 4-bit too: section 9) and section 8 (``d_bias[e] = sum of d_y[rows(e)]``,
``grouped_gemm_dbias``; ``grouped_gemm`` differentiable in ``bias`` for float, FP8 and 4-bit weights).

Every backend that runs on the CPU, in both frameworks (the references, the Triton kernels in Triton's
interpreter, the Pallas-Triton kernels in interpret mode), against float64 loops on the values the op sees;
unused capacity (rows ``>= M``) of ``x`` and ``d_y`` is NaN, so a row that is read shows, and the outputs are
checked finite (Pallas' interpret mode fills outputs with NaN first: a forgotten element shows too). The
Mosaic GPU forward is traced here (its bias load and add are in the kernel's jaxpr) and run on the GPU only.
Shapes are tiny: the interpreters run every program in Python.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import moe_pallas
import moe_torch
from common import TRITON_INTERPRETER_BROKEN, needs_triton_interpreter, to_torch
from moe_pallas.ops.grouped_gemm import api as jax_api
from moe_pallas.ops.grouped_gemm.config import GroupedGemmDbiasConfig as JaxDbiasConfig
from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu import grouped_gemm_pallas_mosaic_gpu
from moe_pallas.ops.grouped_gemm.pallas_triton import grouped_gemm_pallas_triton
from moe_pallas.ops.grouped_gemm.pallas_triton_backward import grouped_gemm_dbias_pallas_triton
from moe_torch.ops.grouped_gemm import api as torch_api
from moe_torch.ops.grouped_gemm.config import GroupedGemmDbiasConfig as TorchDbiasConfig
from moe_torch.ops.grouped_gemm.reference import grouped_gemm_reference as torch_reference
from moe_torch.ops.grouped_gemm.triton_backward import grouped_gemm_dbias_triton
from tolerances import (BF16_REL_FRO, F32_REL_FRO, GRAD_BF16_REL_FRO, GRAD_F32_REL_FRO, assert_exact,
                        assert_rel_fro, to_numpy)

ON_GPU = jax.default_backend() == "gpu"
TORCH_IMPLS = ("reference", pytest.param("triton", marks=needs_triton_interpreter))
JAX_IMPLS = ("reference", "pallas_triton")
TOL = {"float32": F32_REL_FRO, "bfloat16": BF16_REL_FRO}
GRAD_TOL = {"float32": GRAD_F32_REL_FRO, "bfloat16": GRAD_BF16_REL_FRO}
TORCH_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
JAX_DT = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# counts per expert, M_cap, K, N; the comment says which edge each case exercises (K % 32 == 0 for 4-bit)
SHAPES = {
    "M=1": ([1], 1, 32, 16),  # one row (T=1, topk=1), one local expert
    "ragged-empties": ([3, 0, 5, 0], 12, 32, 17),  # empty experts (middle, last), odd N (masked columns), NaN capacity
    "all-on-one": ([0, 0, 9, 0], 12, 32, 16),  # every row on one expert: the others' d_bias exactly 0
    "several-tiles": ([20, 1, 0, 17], 44, 64, 40),  # experts over several row tiles, tiles straddling experts
}


# --------------------------------------------------------------------------------------
# Inputs and float64 judges (numpy)


def problem(seed: int, counts, m_cap: int, K: int, N: int):
    """numpy float32 ``x [m_cap, K]`` ~ N(0, 1), ``w [E, N, K]`` ~ N(0, 1/K), ``bias [E, N]`` ~ N(0, 1) (outputs
    O(1), the bias as large as the product), ``d_y [m_cap, N]`` ~ N(0, 1), int32 offsets from ``counts``; rows
    ``>= M`` of ``x`` and ``d_y`` are NaN (unused capacity: never read)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m_cap, K)).astype(np.float32)
    w = (rng.standard_normal((len(counts), N, K)) / np.sqrt(K)).astype(np.float32)
    bias = rng.standard_normal((len(counts), N)).astype(np.float32)
    d_y = rng.standard_normal((m_cap, N)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    M = int(offsets[-1])
    assert M <= m_cap
    x[M:], d_y[M:] = np.nan, np.nan
    return x, w, bias, d_y, offsets


BF16_NP = np.dtype(jnp.bfloat16)


def tt(a) -> torch.Tensor:
    """A numpy array (bf16 included: numpy's bf16 is ml_dtypes', which torch cannot read) as a torch tensor."""
    a = np.asarray(a)
    return to_torch(a.astype(np.float32)).to(torch.bfloat16) if a.dtype == BF16_NP else to_torch(a)


def f64(a) -> np.ndarray:
    return to_numpy(a).astype(np.float64)


def f64_forward(x, w, bias, offsets) -> np.ndarray:
    """float64 ``y[m] = x[m] @ w[e(m)].T + bias[e(m)]`` expert by expert (``bias`` may be None); rows ``>= M`` 0."""
    x, w, off = f64(x), f64(w), to_numpy(offsets).tolist()
    y = np.zeros((x.shape[0], w.shape[1]))
    for e in range(w.shape[0]):
        y[off[e]:off[e + 1]] = x[off[e]:off[e + 1]] @ w[e].T + (0.0 if bias is None else f64(bias)[e])
    return y


def f64_dbias(d_y, offsets) -> np.ndarray:
    """float64 segment sum ``d_bias[e] = sum of d_y[offsets[e]:offsets[e+1]]`` (an empty expert: 0)."""
    d_y, off = f64(d_y), to_numpy(offsets).tolist()
    return np.stack([d_y[off[e]:off[e + 1]].sum(axis=0) for e in range(len(off) - 1)])


def check_rows(y, offsets, what: str) -> None:
    """Every value finite (written, no NaN read), rows ``>= M`` exactly zero (no bias there)."""
    y32 = to_numpy(y).astype(np.float32)
    M = int(to_numpy(offsets)[-1])
    assert np.isfinite(y32).all(), f"{what}: {y32.size - np.isfinite(y32).sum()} non-finite values"
    assert not y32[M:].any(), f"{what}: rows >= M must be zero"


def check_empty_experts_zero(d_b, offsets, what: str) -> None:
    off = to_numpy(offsets).tolist()
    for e in range(len(off) - 1):
        if off[e + 1] <= off[e]:
            assert_exact(d_b[e], np.zeros(d_b.shape[1:], to_numpy(d_b).dtype), f"{what}: d_bias[{e}] of an empty expert")


def run_forward(framework: str, impl: str, x, w, offsets, **kw):
    """``grouped_gemm`` of ``framework`` on numpy inputs (``kw``: numpy arrays or dtype names)."""
    if framework == "torch":
        conv = {k: (tt(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
        return moe_torch.grouped_gemm(tt(x), tt(w), tt(offsets), implementation=impl, **conv)
    conv = {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    return moe_pallas.grouped_gemm(jnp.asarray(x), jnp.asarray(w), jnp.asarray(offsets), implementation=impl, **conv)


def as_dtype(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` rounded to ``dtype`` (round to nearest even) and back in a numpy array of that dtype."""
    return np.asarray(jnp.asarray(a).astype(JAX_DT[dtype]))


#: (framework, implementation): every backend that runs on the CPU.
FRAMEWORK_IMPLS = [
    pytest.param("torch", "reference", id="torch-reference"),
    pytest.param("torch", "triton", id="torch-triton", marks=needs_triton_interpreter),
    pytest.param("jax", "reference", id="jax-reference"),
    pytest.param("jax", "pallas_triton", id="jax-pallas_triton"),
]


# --------------------------------------------------------------------------------------
# Forward: float inputs


#: (shape, x dtype, bias dtype): every shape in float32; bf16 (gpt-oss's dtype) with a bf16 and a float32 bias.
FORWARD_CASES = [(shape, "float32", "float32") for shape in SHAPES] + [
    ("ragged-empties", "bfloat16", "bfloat16"), ("M=1", "bfloat16", "float32")]


@pytest.mark.parametrize("fw, impl", FRAMEWORK_IMPLS)
@pytest.mark.parametrize("shape, dtype, bias_dtype", FORWARD_CASES)
def test_forward_vs_float64(shape, dtype, bias_dtype, fw, impl):
    """``x @ w[e].T + bias[e]`` within the contract's tolerance of the float64 loop on the values the op sees
    (bf16 inputs rounded first); rows >= M (NaN in x) exactly zero and never read; the output in ``x``'s
    dtype, and (bf16, ragged) a float32 output within the float32 row (one rounding, at the end)."""
    counts, m_cap, K, N = SHAPES[shape]
    x, w, bias, _, offsets = problem(len(shape), counts, m_cap, K, N)
    x, w, bias = as_dtype(x, dtype), as_dtype(w, dtype), as_dtype(bias, bias_dtype)
    y = run_forward(fw, impl, x, w, offsets, bias=bias)
    assert tuple(y.shape) == (m_cap, N) and to_numpy(y).dtype == as_dtype(x[:0], dtype).dtype
    what = f"{fw} {impl} {shape} {dtype} x, {bias_dtype} bias"
    check_rows(y, offsets, what)
    want = f64_forward(x, w, bias, offsets)
    assert_rel_fro(y, want, TOL[dtype], what)
    if dtype != "float32" and shape == "ragged-empties":  # (once: each output dtype is another compile)
        y32 = run_forward(fw, impl, x, w, offsets, bias=bias, out_dtype="float32")
        assert_rel_fro(y32, want, F32_REL_FRO, f"{what}, float32 output")


@pytest.mark.parametrize("fw, impl", FRAMEWORK_IMPLS)
def test_bias_added_before_the_one_rounding(fw, impl):
    """Named case: ``x[m] @ w[e].T = 1 + 2^-8`` exactly (a bf16 tie, which rounds to 1) and ``bias = 2^-8``:
    added in float32 before the rounding, ``y = bf16(1 + 2^-7) = 1.0078125`` exactly; a bias added after
    rounding the product would give ``bf16(1 + 2^-8) = 1``. Row 1 is expert 1's, whose bias is 0 there:
    ``y = bf16(1 + 2^-8) = 1``; row 2 is past M (its x is NaN): 0."""
    x = np.zeros((3, 32), np.float32)
    x[:2, :2] = 1.0
    x[2] = np.nan
    w = np.zeros((2, 16, 32), np.float32)
    w[:, :, 0], w[:, :, 1] = 1.0, 2.0**-8
    bias = np.zeros((2, 16), np.float32)
    bias[0] = 2.0**-8
    offsets = np.array([0, 1, 2], np.int32)
    y = run_forward(fw, impl, as_dtype(x, "bfloat16"), as_dtype(w, "bfloat16"), offsets, bias=bias)
    expected = np.zeros((3, 16), np.float32)
    expected[0], expected[1] = 1.0078125, 1.0
    assert_exact(y, as_dtype(expected, "bfloat16"), f"{fw} {impl}: bias before the rounding")


@pytest.mark.parametrize("fw, impl", FRAMEWORK_IMPLS)
def test_float16_bias_with_float16_x(fw, impl):
    """``bias`` may be ``x``'s float dtype (float16 here), as well as float32 or bf16."""
    counts, m_cap, K, N = SHAPES["ragged-empties"]
    x, w, bias, _, offsets = problem(5, counts, m_cap, K, N)
    x, w, bias = as_dtype(x, "float16"), as_dtype(w, "float16"), as_dtype(bias, "float16")
    y = run_forward(fw, impl, x, w, offsets, bias=bias, out_dtype="float32")
    check_rows(y, offsets, f"{fw} {impl} float16")
    assert_rel_fro(y, f64_forward(x, w, bias, offsets), F32_REL_FRO, f"{fw} {impl} float16 x and bias")


# --------------------------------------------------------------------------------------
# Forward: FP8 and 4-bit weights


def fp8_inputs(fw: str, x, w, layout: str):
    """``(q_x, x_scale, q_w, w_scale)`` of float32 numpy ``x`` and ``w`` in ``fw`` (``layout``:
    ``"per_token-per_channel"`` or ``"per_token_group-block"``)."""
    mod, conv = (moe_torch, tt) if fw == "torch" else (moe_pallas, jnp.asarray)
    x_kind, w_kind = layout.split("-")
    xq, xs = mod.per_token_quant_fp8(conv(x)) if x_kind == "per_token" else mod.per_token_group_quant_fp8(conv(x), 128)
    wq, ws = mod.quantize_weight_fp8(conv(w), w_kind)
    return xq, xs, wq, ws


def dequantized(fw: str, xq, xs, wq, ws) -> tuple[np.ndarray, np.ndarray]:
    mod = moe_torch if fw == "torch" else moe_pallas
    return f64(mod.dequantize_fp8(xq, xs)), f64(mod.dequantize_weight_fp8(wq, ws))


@pytest.mark.parametrize("fw, impl", FRAMEWORK_IMPLS)
@pytest.mark.parametrize("layout", ["per_token-per_channel", "per_token_group-block"])
def test_fp8_with_bias(layout, fw, impl):
    """FP8 (scales applied, then the bias, then one rounding) against the float64 loop on the dequantized
    codes: a float32 output within the float32 row (the same products, reordered), bf16 within the bf16
    row. K = 128: one 128-wide scale group / block (the per-step path for group and block scales)."""
    counts, m_cap, K, N = [6, 0, 9], 16, 128, 24
    x, w, bias, _, offsets = problem(7, counts, m_cap, K, N)
    x = np.nan_to_num(x)  # quantized below; rows >= M stay unused (the offsets say so)
    xq, xs, wq, ws = fp8_inputs(fw, x, w, layout)
    xd, wd = dequantized(fw, xq, xs, wq, ws)
    want = f64_forward(xd, wd, bias, offsets)
    conv = tt if fw == "torch" else jnp.asarray
    mod = moe_torch if fw == "torch" else moe_pallas
    kw = dict(x_scale=xs, w_scale=ws, bias=conv(bias), implementation=impl)
    y32 = mod.grouped_gemm(xq, wq, conv(offsets), out_dtype="float32", **kw)
    check_rows(y32, offsets, f"{fw} {impl} fp8 {layout}")
    assert_rel_fro(y32, want, F32_REL_FRO, f"{fw} {impl} fp8 {layout}, float32 output")
    if layout == "per_token-per_channel":  # the default output, bf16 (once: each output dtype is a compile)
        y = mod.grouped_gemm(xq, wq, conv(offsets), **kw)
        assert to_numpy(y).dtype == BF16_NP
        assert_rel_fro(y, want, BF16_REL_FRO, f"{fw} {impl} fp8 {layout}")


def w4_inputs(fw: str, w, fmt: str):
    mod, conv = (moe_torch, tt) if fw == "torch" else (moe_pallas, jnp.asarray)
    w_q, w_scale = getattr(mod, f"quantize_weight_{fmt}")(conv(w))
    return w_q, w_scale, f64(getattr(mod, f"dequantize_weight_{fmt}")(w_q, w_scale))


@pytest.mark.parametrize("fw, impl", FRAMEWORK_IMPLS)
@pytest.mark.parametrize("fmt, shape", [("mxfp4", "ragged-empties"), ("int4", "M=1")])
def test_4bit_with_bias(fmt, shape, fw, impl):
    """4-bit weights (CONTRACT.md section 9) with a bf16 bias (gpt-oss's MXFP4 experts): bf16 ``x``, within the
    bf16 row of the float64 product with the float32 dequantized weights plus the bias; rows >= M zero."""
    counts, m_cap, K, N = SHAPES[shape]
    x, w, bias, _, offsets = problem(11, counts, m_cap, K, N)
    x, bias = as_dtype(x, "bfloat16"), as_dtype(bias, "bfloat16")
    w_q, w_scale, wd = w4_inputs(fw, w, fmt)
    conv = tt if fw == "torch" else jnp.asarray
    mod = moe_torch if fw == "torch" else moe_pallas
    y = mod.grouped_gemm(conv(x), w_q, conv(offsets), w_scale=w_scale, w_format=fmt, bias=conv(bias),
                         implementation=impl)
    check_rows(y, offsets, f"{fw} {impl} {fmt}")
    assert_rel_fro(y, f64_forward(x, wd, bias, offsets), BF16_REL_FRO, f"{fw} {impl} {fmt} {shape}")


# --------------------------------------------------------------------------------------
# The bias gradient op


@pytest.mark.parametrize("fw, impl", FRAMEWORK_IMPLS)
@pytest.mark.parametrize("shape, dtype", [(shape, "float32") for shape in SHAPES] + [("ragged-empties", "bfloat16")])
def test_dbias_vs_float64_segment_sum(shape, dtype, fw, impl):
    """``grouped_gemm_dbias`` (default float32 out) within the float32 row of the float64 segment sum of the
    values it sees; NaN rows >= M never read; an empty expert's ``d_bias`` exactly 0; ``out_dtype`` respected."""
    counts, m_cap, K, N = SHAPES[shape]
    _, _, _, d_y, offsets = problem(3, counts, m_cap, K, N)
    d_y = as_dtype(d_y, dtype)
    want = f64_dbias(d_y, offsets)
    mod, conv = (moe_torch, tt) if fw == "torch" else (moe_pallas, jnp.asarray)
    d_b = mod.grouped_gemm_dbias(conv(d_y), conv(offsets), implementation=impl)
    what = f"{fw} {impl} {shape} {dtype}"
    assert tuple(d_b.shape) == (len(counts), N) and to_numpy(d_b).dtype == np.float32, what
    assert np.isfinite(to_numpy(d_b)).all(), f"{what}: NaN from rows >= M leaked"
    assert_rel_fro(d_b, want, GRAD_F32_REL_FRO, what)
    check_empty_experts_zero(d_b, offsets, what)
    low = mod.grouped_gemm_dbias(conv(d_y), conv(offsets), out_dtype="bfloat16", implementation=impl)
    assert to_numpy(low).dtype == as_dtype(d_y[:0], "bfloat16").dtype
    assert_rel_fro(low, want, GRAD_BF16_REL_FRO, f"{what}, bf16 out")


def test_dbias_kernels_small_blocks():
    """Both kernels with blocks smaller than the problem (several column tiles, several row steps per expert,
    a partial last step) and the heuristic configs, against the float64 segment sum."""
    counts, m_cap, K, N = SHAPES["several-tiles"]
    _, _, _, d_y, offsets = problem(9, counts, m_cap, K, N)
    want = f64_dbias(d_y, offsets)
    small_t = TorchDbiasConfig(block_m=4, block_n=16)
    small_j = JaxDbiasConfig(block_m=4, block_n=16)
    outs = {"pallas": grouped_gemm_dbias_pallas_triton(jnp.asarray(d_y), jnp.asarray(offsets), config=small_j)}
    if not TRITON_INTERPRETER_BROKEN:
        outs["triton"] = grouped_gemm_dbias_triton(to_torch(d_y), to_torch(offsets), torch.float32, small_t)
    for name, d_b in outs.items():
        assert_rel_fro(d_b, want, GRAD_F32_REL_FRO, f"{name} small blocks")
        check_empty_experts_zero(d_b, offsets, name)


def test_dbias_no_rows_and_no_experts():
    """``M_cap = 0``: every expert's ``d_bias`` exactly 0 (``[E, N]``); ``E = 0``: an empty ``[0, N]``."""
    for mod, conv in ((moe_torch, to_torch), (moe_pallas, jnp.asarray)):
        d_b = mod.grouped_gemm_dbias(conv(np.zeros((0, 8), np.float32)), conv(np.zeros(3, np.int32)))
        assert tuple(d_b.shape) == (2, 8) and not to_numpy(d_b).any()
        d_b = mod.grouped_gemm_dbias(conv(np.ones((4, 8), np.float32)), conv(np.zeros(1, np.int32)))
        assert tuple(d_b.shape) == (0, 8)


# --------------------------------------------------------------------------------------
# Gradients through grouped_gemm


def test_torch_autograd_function_gradcheck_with_bias():
    """The autograd.Function (api.py's glue) with the reference backward ops, in float64, x, w and bias all
    requiring grad (and bias alone): torch's gradcheck against finite differences."""
    x, w, bias, _, offsets = problem(13, [2, 0, 3], 7, 5, 4)
    off = to_torch(offsets)
    x = torch.nan_to_num(to_torch(x).double(), nan=0.5).requires_grad_()  # gradcheck perturbs every input
    w, bias = to_torch(w).double().requires_grad_(), to_torch(bias).double().requires_grad_()
    fn = lambda a, b, c: torch_api._GroupedGemmFunction.apply(a, b, off, torch.float64, "reference", c)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, bias))
    assert torch.autograd.gradcheck(lambda c: fn(x.detach(), w.detach(), c), (bias,))


def torch_autodiff64(x, w, bias, d_y, offsets):
    """``(d_x, d_w, d_bias)``: ``torch.autograd`` of the float64 reference forward (with bias) at the values
    of ``x``, ``w``, ``bias``, contracted with ``d_y`` (its NaN rows >= M set to 0: y is constant there)."""
    args = [to_torch(f64(a)).requires_grad_() for a in (x, w, bias)]
    y = torch_reference(args[0], args[1], to_torch(offsets), None, None, torch.float64, bias=args[2])
    return torch.autograd.grad(y, args, to_torch(np.nan_to_num(f64(d_y))))


#: (shape, dtype) of the gradient tests: ragged rows with empty experts in both dtypes, all rows on one expert, M = 1.
GRAD_CASES = [("ragged-empties", "float32"), ("ragged-empties", "bfloat16"), ("all-on-one", "float32"),
              ("M=1", "bfloat16")]


@pytest.mark.parametrize("impl", TORCH_IMPLS)
@pytest.mark.parametrize("shape, dtype", GRAD_CASES)
def test_torch_gradients_vs_autodiff(shape, dtype, impl):
    """``.backward()`` through ``grouped_gemm`` with x, w and bias requiring grad: each gradient in its input's
    dtype within the contract's row of float64 autodiff of the reference; an empty expert's d_w and d_bias
    exactly 0; rows >= M of d_x zero (their NaN d_y never read)."""
    counts, m_cap, K, N = SHAPES[shape]
    x, w, bias, d_y, offsets = problem(17, counts, m_cap, K, N)
    x, w, bias, d_y = (as_dtype(a, dtype) for a in (x, w, bias, d_y))
    want = torch_autodiff64(x, w, bias, d_y, offsets)
    xt, wt, bt = (tt(a).requires_grad_() for a in (x, w, bias))
    y = moe_torch.grouped_gemm(xt, wt, to_torch(offsets), bias=bt, implementation=impl)
    y.backward(tt(d_y))
    what = f"torch {impl} {shape} {dtype}"
    for name, got, ref in zip(("d_x", "d_w", "d_bias"), (xt.grad, wt.grad, bt.grad), want):
        assert got.dtype == TORCH_DT[dtype] and torch.isfinite(got.float()).all(), f"{what}: {name}"
        assert_rel_fro(got, ref, GRAD_TOL[dtype], f"{what}: {name}")
    assert not xt.grad[int(offsets[-1]):].float().any()
    check_empty_experts_zero(bt.grad, offsets, what)
    check_empty_experts_zero(wt.grad, offsets, what)


def test_torch_bias_only_gradient_runs_only_dbias(monkeypatch):
    """Only bias requires grad: the backward runs the bias gradient only (no dgrad, no wgrad), in bias's
    dtype (bf16 here: the segment sum of the cotangent in float32, rounded once)."""
    x, w, bias, d_y, offsets = problem(19, [4, 0, 3], 9, 32, 16)
    calls = []
    for name in ("_dgrad", "_wgrad", "_dbias"):
        real = getattr(torch_api, name)
        monkeypatch.setattr(torch_api, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    bt = to_torch(bias).to(torch.bfloat16).requires_grad_()
    y = moe_torch.grouped_gemm(to_torch(x), to_torch(w), to_torch(offsets), bias=bt)
    (d_b,) = torch.autograd.grad(y, (bt,), to_torch(d_y))
    assert calls == ["_dbias"] and d_b.dtype == torch.bfloat16
    calls.clear()
    want = moe_torch.grouped_gemm_dbias(to_torch(d_y), to_torch(offsets), out_dtype=torch.bfloat16)
    assert_exact(d_b, want, "d_bias = grouped_gemm_dbias(d_y) in bias's dtype")
    assert_rel_fro(d_b, f64_dbias(d_y, offsets), GRAD_BF16_REL_FRO, "d_bias vs float64")


def f64_vjp(x, w, bias, d_y, offsets):
    """``(d_x, d_w, d_bias)`` by ``jax.vjp`` of a plain float64 per-expert loop with bias (rows >= M of ``y``
    are constant zeros, so the NaNs there reach nothing), as numpy float64."""
    off = to_numpy(offsets).tolist()
    m_cap, N = d_y.shape

    def forward(x, w, b):
        parts = [x[off[e]:off[e + 1]] @ w[e].T + b[e] for e in range(w.shape[0])]
        return jnp.concatenate(parts + [jnp.zeros((m_cap - off[-1], N), x.dtype)])

    with jax.enable_x64(True):
        _, vjp = jax.vjp(forward, *(jnp.asarray(f64(a)) for a in (x, w, bias)))
        return tuple(np.asarray(g) for g in vjp(jnp.asarray(np.nan_to_num(f64(d_y)))))


@pytest.mark.parametrize("impl", JAX_IMPLS)
@pytest.mark.parametrize("shape, dtype", [c for c in GRAD_CASES if c[0] != "all-on-one"])  # compiles are slow
def test_jax_gradients_vs_autodiff(shape, dtype, impl):
    """``jax.vjp`` (under ``jit``) through ``grouped_gemm`` in x, w and bias: each gradient in its input's dtype
    within the contract's row of float64 autodiff; an empty expert's d_w and d_bias exactly 0."""
    counts, m_cap, K, N = SHAPES[shape]
    x, w, bias, d_y, offsets = problem(23, counts, m_cap, K, N)
    x, w, bias, d_y = (as_dtype(a, dtype) for a in (x, w, bias, d_y))
    want = f64_vjp(x, w, bias, d_y, offsets)

    @jax.jit
    def grads(x, w, b, d_y):
        _, vjp = jax.vjp(lambda x, w, b: grouped_gemm_jax(x, w, b, offsets, impl), x, w, b)
        return vjp(d_y)

    got = grads(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), jnp.asarray(d_y))
    what = f"jax {impl} {shape} {dtype}"
    for name, g, ref in zip(("d_x", "d_w", "d_bias"), got, want):
        assert g.dtype == JAX_DT[dtype] and np.isfinite(to_numpy(g).astype(np.float32)).all(), f"{what}: {name}"
        assert_rel_fro(g, ref, GRAD_TOL[dtype], f"{what}: {name}")
    check_empty_experts_zero(got[2], offsets, what)
    check_empty_experts_zero(got[1], offsets, what)


def grouped_gemm_jax(x, w, b, offsets, impl, **kw):
    return moe_pallas.grouped_gemm(x, w, jnp.asarray(offsets), bias=b, implementation=impl, **kw)


def test_jax_bias_gradient_inside_shard_map():
    """The reference bias gradient under ``shard_map`` with the varying-axis types checked (the EP layer's
    local arrays vary over the mesh axis): the segment sum's types line up, the result is right."""
    from jax.sharding import Mesh, PartitionSpec as P

    x, w, bias, d_y, offsets = problem(29, [3, 0, 5], 9, 16, 16)
    d_y = np.nan_to_num(d_y)
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))

    def local(x, w, b, offsets, d_y):
        _, vjp = jax.vjp(lambda b: moe_pallas.grouped_gemm(x, w, offsets, bias=b, implementation="reference"), b)
        return vjp(d_y)[0]

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep"), P(), P("ep")),
                              out_specs=P("ep"), check_vma=True))
    d_b = f(*(jnp.asarray(a) for a in (np.nan_to_num(x), w, bias, offsets, d_y)))
    assert_rel_fro(d_b, f64_dbias(d_y, offsets), GRAD_F32_REL_FRO, "shard_map d_bias")


@pytest.mark.parametrize("fw, impl", FRAMEWORK_IMPLS)
def test_fp8_bias_gradient_and_refusals(fw, impl):
    """FP8 codes with a bias: the bias is differentiable (``d_bias`` = the segment sum of the cotangent, in
    bias's dtype), the FP8 codes and scales still are not (TypeError naming FP8, never a wrong gradient)."""
    counts, m_cap, K, N = [5, 0, 4], 12, 128, 16
    x, w, bias, d_y, offsets = problem(31, counts, m_cap, K, N)
    xq, xs, wq, ws = fp8_inputs(fw, np.nan_to_num(x), w, "per_token-per_channel")
    d_y = as_dtype(d_y, "bfloat16")  # the cotangent of a bf16 output
    want = f64_dbias(d_y, offsets)
    if fw == "torch":
        off, bt = to_torch(offsets), to_torch(bias).requires_grad_()
        y = moe_torch.grouped_gemm(xq, wq, off, x_scale=xs, w_scale=ws, bias=bt, implementation=impl)
        y.backward(tt(d_y))
        d_b = bt.grad
        xs_g = xs.clone().requires_grad_()
        y = moe_torch.grouped_gemm(xq, wq, off, x_scale=xs_g, w_scale=ws, bias=to_torch(bias).requires_grad_(),
                                   implementation=impl)
        with pytest.raises(TypeError, match="grouped_gemm: not differentiable for float8_e4m3fn .* through x_scale"):
            y.backward(tt(d_y))
    else:
        off = jnp.asarray(offsets)

        def loss(b, xs):
            y = moe_pallas.grouped_gemm(xq, wq, off, x_scale=xs, w_scale=ws, bias=b, implementation=impl)
            return jnp.sum(y.astype(jnp.float32) * jnp.asarray(np.nan_to_num(f64(d_y)), jnp.float32))

        d_b = jax.grad(loss)(jnp.asarray(bias), xs)
        with pytest.raises(TypeError, match="grouped_gemm: float8_e4m3fn inputs .* are not differentiable"):
            jax.grad(loss, argnums=(0, 1))(jnp.asarray(bias), xs)
    assert to_numpy(d_b).dtype == np.float32
    assert_rel_fro(d_b, want, GRAD_F32_REL_FRO, f"{fw} {impl} fp8 d_bias")
    check_empty_experts_zero(d_b, offsets, f"{fw} fp8")


@pytest.mark.parametrize("fw, impl", FRAMEWORK_IMPLS)
def test_4bit_gradients_of_x_and_bias(fw, impl):
    """4-bit (MXFP4) weights with a bf16 bias: ``d_x`` straight-through (``d_y @ wd``, ``wd`` rounded to bf16)
    and ``d_bias`` (the segment sum, bf16) within the bf16 gradient row of float64; the bias alone too."""
    counts, m_cap, K, N = SHAPES["ragged-empties"]
    x, w, bias, d_y, offsets = problem(37, counts, m_cap, K, N)
    x, bias, d_y = (as_dtype(a, "bfloat16") for a in (x, bias, d_y))
    w_q, w_scale, wd = w4_inputs(fw, w, "mxfp4")
    want_dx, _, want_db = f64_vjp(x, as_dtype(wd.astype(np.float32), "bfloat16"), bias, d_y, offsets)
    kw = dict(w_scale=w_scale, w_format="mxfp4", implementation=impl)
    if fw == "torch":
        xt, bt, off = tt(x).requires_grad_(), tt(bias).requires_grad_(), to_torch(offsets)
        moe_torch.grouped_gemm(xt, w_q, off, bias=bt, **kw).backward(tt(d_y))
        d_x, d_b = xt.grad, bt.grad
        b_only = tt(bias).requires_grad_()
        moe_torch.grouped_gemm(tt(x), w_q, off, bias=b_only, **kw).backward(tt(d_y))
        assert_exact(b_only.grad, d_b, "torch 4-bit: the bias alone")
    else:
        off = jnp.asarray(offsets)
        _, vjp = jax.vjp(lambda x, b: moe_pallas.grouped_gemm(x, w_q, off, bias=b, **kw), jnp.asarray(x),
                         jnp.asarray(bias))
        d_x, d_b = vjp(jnp.asarray(d_y))
    assert to_numpy(d_b).dtype == to_numpy(d_x).dtype == as_dtype(x[:0], "bfloat16").dtype
    assert_rel_fro(d_x, want_dx, GRAD_BF16_REL_FRO, f"{fw} {impl} 4-bit d_x")
    assert_rel_fro(d_b, want_db, GRAD_BF16_REL_FRO, f"{fw} {impl} 4-bit d_bias")
    check_empty_experts_zero(d_b, offsets, f"{fw} 4-bit")


# --------------------------------------------------------------------------------------
# Triton vs Pallas on the same inputs


@needs_triton_interpreter
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_vs_pallas(dtype):
    """The Triton and Pallas-Triton kernels on the same inputs: the forward with a bias, the bias gradient,
    and the three gradients through ``grouped_gemm``, within the tighter row of the contract."""
    counts, m_cap, K, N = SHAPES["several-tiles"]
    x, w, bias, d_y, offsets = problem(41, counts, m_cap, K, N)
    x, w, bias, d_y = (as_dtype(a, dtype) for a in (x, w, bias, d_y))
    tol = TOL[dtype]
    y_t = run_forward("torch", "triton", x, w, offsets, bias=bias)
    y_j = run_forward("jax", "pallas_triton", x, w, offsets, bias=bias)
    assert_rel_fro(y_t, y_j, tol, f"forward {dtype}")
    db_t = moe_torch.grouped_gemm_dbias(tt(d_y), to_torch(offsets), implementation="triton")
    db_j = moe_pallas.grouped_gemm_dbias(jnp.asarray(d_y), jnp.asarray(offsets), implementation="pallas_triton")
    assert_rel_fro(db_t, db_j, GRAD_F32_REL_FRO, f"dbias {dtype}")
    xt, wt, bt = (tt(a).requires_grad_() for a in (x, w, bias))
    moe_torch.grouped_gemm(xt, wt, to_torch(offsets), bias=bt, implementation="triton").backward(tt(d_y))
    _, vjp = jax.vjp(lambda x, w, b: grouped_gemm_jax(x, w, b, offsets, "pallas_triton"),
                     *(jnp.asarray(a) for a in (x, w, bias)))
    for name, t, j in zip(("d_x", "d_w", "d_bias"), (xt.grad, wt.grad, bt.grad), vjp(jnp.asarray(d_y))):
        assert_rel_fro(t, j, GRAD_TOL[dtype], f"{name} {dtype}")


# --------------------------------------------------------------------------------------
# Bad inputs (host-side, before anything runs; one message for both frameworks)


@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_bad_bias(fw):
    x, w, bias, d_y, offsets = problem(43, [2, 3], 6, 32, 8)
    mod, conv = (moe_torch, tt) if fw == "torch" else (moe_pallas, jnp.asarray)
    x, w, off = conv(np.nan_to_num(x)), conv(w), conv(offsets)
    cases = [
        (ValueError, r"grouped_gemm: bias must be \[E_local, N\] = \(2, 8\) .*got bias.shape=\(2, 9\)",
         np.zeros((2, 9), np.float32)),
        (ValueError, r"grouped_gemm: bias must be \[E_local, N\] = \(2, 8\) .*got bias.shape=\(3, 8\)",  # E mismatch
         np.zeros((3, 8), np.float32)),
        (ValueError, r"grouped_gemm: bias must be \[E_local, N\] = \(2, 8\) .*got bias.shape=\(8,\)",
         np.zeros((8,), np.float32)),
        (TypeError, "grouped_gemm: bias must have dtype float32 or bfloat16; got bias.dtype=float16",
         np.zeros((2, 8), np.float16)),
        (TypeError, "grouped_gemm: bias must have dtype float32 or bfloat16; got bias.dtype=int32",
         np.zeros((2, 8), np.int32)),
    ]
    for exc, message, b in cases:
        with pytest.raises(exc, match=message):
            mod.grouped_gemm(x, w, off, bias=conv(b))
    other = jnp.asarray(bias) if fw == "torch" else to_torch(bias)  # the other framework's array
    with pytest.raises(TypeError, match="grouped_gemm: bias must be a"):
        mod.grouped_gemm(x, w, off, bias=other)
    if fw == "jax":
        return  # below: the same shared check (moe_contract.op_checks) on the other weight kinds, once
    # 4-bit and FP8 weights check the bias too
    w_q, w_scale, _ = w4_inputs(fw, np.asarray(to_numpy(w)), "mxfp4")
    with pytest.raises(ValueError, match=r"grouped_gemm: bias must be \[E_local, N\] = \(2, 8\)"):
        mod.grouped_gemm(x, w_q, off, w_scale=w_scale, w_format="mxfp4", bias=conv(np.zeros((1, 8), np.float32)))
    xq, xs, wq, ws = fp8_inputs(fw, to_numpy(x), np.asarray(to_numpy(w)), "per_token-per_channel")
    with pytest.raises(TypeError, match="grouped_gemm: bias must have dtype float32 or bfloat16; got bias.dtype=float16"):
        mod.grouped_gemm(xq, wq, off, x_scale=xs, w_scale=ws, bias=conv(np.zeros((2, 8), np.float16)))


@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_bad_dbias_inputs(fw):
    _, _, _, d_y, offsets = problem(47, [2, 3], 6, 32, 8)
    mod, conv = (moe_torch, tt) if fw == "torch" else (moe_pallas, jnp.asarray)
    with pytest.raises(ValueError, match=r"grouped_gemm_dbias: d_y must be \[M_cap, N\]; got d_y.shape=\(6,\)"):
        mod.grouped_gemm_dbias(conv(d_y[:, 0]), conv(offsets))
    with pytest.raises(TypeError, match="grouped_gemm_dbias: d_y must have dtype float32 or bfloat16 or float16"):
        mod.grouped_gemm_dbias(conv(d_y.astype(np.int32)), conv(offsets))
    with pytest.raises(TypeError, match="grouped_gemm_dbias: expert_offsets must have dtype int32"):
        mod.grouped_gemm_dbias(conv(d_y), conv(offsets.astype(np.float32)))
    with pytest.raises(ValueError, match=r"grouped_gemm_dbias: expert_offsets must be \[E \+ 1\] int32 with E >= 0"):
        mod.grouped_gemm_dbias(conv(d_y), conv(offsets[:0]))
    with pytest.raises(TypeError, match="grouped_gemm_dbias: out_dtype must have dtype"):
        mod.grouped_gemm_dbias(conv(d_y), conv(offsets), out_dtype="int32")
    with pytest.raises(ValueError, match="grouped_gemm_dbias: implementation must be one of"):
        mod.grouped_gemm_dbias(conv(d_y), conv(offsets), implementation="pallas_mosaic_gpu")


# --------------------------------------------------------------------------------------
# GPU code paths, lowered / compiled / traced on the CPU


def _bias_triton_job(dtype: str, x_scale: int, w_scale: int, M_cap: int, N: int, K: int, E: int, bias: str) -> dict:
    from test_triton_grouped_gemm import _gemm_job

    job = _gemm_job(dtype, x_scale, w_scale, M_cap, N, K, E)
    job["signature"]["bias_ptr"] = f"*{bias}"
    job["constexprs"]["HAS_BIAS"] = True
    return job


def _dbias_job(dtype: str, M_cap: int, N: int, E: int) -> dict:
    from moe_torch.ops.grouped_gemm.config import heuristic_grouped_gemm_dbias_config

    cfg = heuristic_grouped_gemm_dbias_config(M_cap, N, E)
    return {
        "module": "moe_torch.ops.grouped_gemm.triton_backward", "kernel": "_grouped_gemm_dbias_kernel",
        "signature": {"dy_ptr": f"*{dtype}", "offsets_ptr": "*i32", "out_ptr": f"*{dtype}",
                      **{a: "i32" for a in ("M_cap", "N", "stride_dym", "stride_oe")}},
        "constexprs": {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n},
        "options": {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    }


def test_triton_kernels_compile_for_sm90():
    """The forward with a bias (gpt-oss-like gate_up: N = 2 * 2880 over K = 2880, E = 32; bf16 bias on bf16
    wgmma tiles, float32 bias on the FP8 per-token x per-channel path) and the dbias kernel (bf16 d_y)
    lower to sm_90 cubin (tests/sm90.py: a child process without the interpreter): the bias is read
    (widened from bf16 exactly) and added in float32 before the one rounding to bf16."""
    from sm90 import compile_sm90

    ptx = compile_sm90({
        "bf16-bias-64rows": _bias_triton_job("bf16", 0, 0, 16384, 5760, 2880, 32, "bf16"),
        "fp8-per_token-per_channel-f32-bias": _bias_triton_job("fp8e4nv", 2, 2, 16384, 5760, 2880, 32, "fp32"),
        "dbias-bf16": _dbias_job("bf16", 16384, 5760, 32),
    })
    for name, text in ptx.items():
        assert ".target sm_90" in text, name
    assert "wgmma.mma_async.sync.aligned" in ptx["bf16-bias-64rows"]
    assert "cvt.f32.bf16" in ptx["bf16-bias-64rows"]  # the bf16 bias widened to float32
    assert "cvt.rn.bf16" in ptx["bf16-bias-64rows"]  # the one rounding, after the add
    assert ".e4m3.e4m3" in ptx["fp8-per_token-per_channel-f32-bias"]
    assert "%ctaid.y" in ptx["dbias-bf16"] and "cvt.f32.bf16" in ptx["dbias-bf16"]


def test_pallas_triton_kernels_lower_for_cuda():
    """The Pallas-Triton forward with a bias and the dbias kernel lower to one Triton call each for an
    abstract H200 (no GPU needed)."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    S = jax.ShapeDtypeStruct
    M, K, N, E = 200, 2880, 5760, 32
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "cuda"))
    fwd = functools.partial(grouped_gemm_pallas_triton, interpret=False)
    dbias = functools.partial(grouped_gemm_dbias_pallas_triton, interpret=False)
    with use_abstract_mesh(mesh):
        texts = [
            jax.jit(lambda x, w, o, b: fwd(x, w, o, bias=b)).trace(
                S((M, K), jnp.bfloat16), S((E, N, K), jnp.bfloat16), S((E + 1,), jnp.int32),
                S((E, N), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text(),
            jax.jit(dbias).trace(S((M, N), jnp.bfloat16), S((E + 1,), jnp.int32)).lower(
                lowering_platforms=("cuda",)).as_text(),
        ]
    for text in texts:
        assert text.count("__gpu$xla.gpu.triton") == 1, text[:2000]


@pytest.mark.parametrize("case", ["bf16", "fp8-per_token-per_channel", "fp8-per_token_group-block"])
def test_mosaic_forward_with_bias_traces(case):
    """The Mosaic GPU kernel (which cannot run nor lower on a CPU) traces with a bias, for bf16 and FP8 with
    epilogue and per-step scales: its jaxpr has one more load (the bias slice) than without one."""
    S = jax.ShapeDtypeStruct
    M, K, N, E = 256, 256, 256, 4
    args = [S((E + 1,), jnp.int32)]
    if case == "bf16":
        x, w, kw = S((M, K), jnp.bfloat16), S((E, N, K), jnp.bfloat16), {}
    else:
        fp8 = jnp.float8_e4m3fn
        xs = S((M, 1), jnp.float32) if "per_token-" in case else S((M, K // 128), jnp.float32)
        ws = S((E, N), jnp.float32) if case.endswith("per_channel") else S((E, N // 128, K // 128), jnp.float32)
        x, w, kw = S((M, K), fp8), S((E, N, K), fp8), dict(x_scale=xs, w_scale=ws)
    f = jax.jit(grouped_gemm_pallas_mosaic_gpu)
    with_bias = f.trace(x, w, *args, bias=S((E, N), jnp.bfloat16), **kw)
    without = f.trace(x, w, *args, **kw)
    assert with_bias.out_info.shape == (M, N)
    assert str(with_bias.jaxpr).count(" load") == str(without.jaxpr).count(" load") + 1


def test_mosaic_warp_specialized_default_takes_a_bias():
    """Many rows per expert pick the warp-specialized schedule by default; it has the bias epilogue
    (it used to fall back to the plain kernel): with a bias the default stays warp-specialized, traces with one
    more load (the bias slice) and lowers through Mosaic GPU for CUDA on the CPU."""
    from moe_pallas.ops.grouped_gemm.config import mosaic_grouped_gemm_config

    S = jax.ShapeDtypeStruct
    M, K, N, E = 2048, 256, 256, 4
    cfg = mosaic_grouped_gemm_config(M, N, K, E, 2)
    assert cfg.warp_specialized  # the premise: the default for >= 256 rows per expert
    args = (S((M, K), jnp.bfloat16), S((E, N, K), jnp.bfloat16), S((E + 1,), jnp.int32))
    f = jax.jit(grouped_gemm_pallas_mosaic_gpu, static_argnames=("config",))
    with_bias = f.trace(*args, bias=S((E, N), jnp.float32), config=cfg)
    assert with_bias.out_info.shape == (M, N)
    assert str(with_bias.jaxpr).count(" load") == str(f.trace(*args, config=cfg).jaxpr).count(" load") + 1
    assert "mosaic_gpu" in with_bias.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernels run on a Hopper GPU only")
def test_mosaic_warp_specialized_bias_on_gpu():
    """On the GPU: the warp-specialized forward (bf16, N = 256 = one CTA tile of two consumers) with a bf16 bias
    within the bf16 row of float64, ragged rows with empty experts."""
    from moe_pallas.ops.grouped_gemm.config import MosaicGroupedGemmConfig

    counts, m_cap, _, _ = SHAPES["ragged-empties"]
    K, N = 128, 256
    x, w, bias, _, offsets = problem(54, counts, m_cap, K, N)
    x, w, bias = as_dtype(x, "bfloat16"), as_dtype(w, "bfloat16"), as_dtype(bias, "bfloat16")
    cfg = MosaicGroupedGemmConfig(block_m=128, block_n=128, block_k=64, max_concurrent_steps=3, warp_specialized=True)
    y = grouped_gemm_pallas_mosaic_gpu(jnp.asarray(x), jnp.asarray(w), jnp.asarray(offsets), bias=jnp.asarray(bias),
                                       config=cfg)
    check_rows(y, offsets, "mosaic ws bias")
    assert_rel_fro(y, f64_forward(x, w, bias, offsets), BF16_REL_FRO, "mosaic ws bias")


@pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernels run on a Hopper GPU only")
@pytest.mark.parametrize("shape", ["M=1", "ragged-empties", "several-tiles"])
def test_mosaic_forward_with_bias_on_gpu(shape):
    """On the GPU: the Mosaic forward with a bf16 bias within the bf16 row of float64 (N padded to whole
    tiles: Mosaic needs ``N % block_n == 0``), and FP8 per-token x per-channel with a float32 bias."""
    counts, m_cap, _, _ = SHAPES[shape]
    K, N = 128, 128
    x, w, bias, _, offsets = problem(53, counts, m_cap, K, N)
    x, w, bias = as_dtype(x, "bfloat16"), as_dtype(w, "bfloat16"), as_dtype(bias, "bfloat16")
    y = grouped_gemm_pallas_mosaic_gpu(jnp.asarray(x), jnp.asarray(w), jnp.asarray(offsets), bias=jnp.asarray(bias))
    check_rows(y, offsets, f"mosaic {shape}")
    assert_rel_fro(y, f64_forward(x, w, bias, offsets), BF16_REL_FRO, f"mosaic {shape}")
    xq, xs, wq, ws = fp8_inputs("jax", np.nan_to_num(x.astype(np.float32)), w.astype(np.float32),
                                "per_token-per_channel")
    xd, wd = dequantized("jax", xq, xs, wq, ws)
    y8 = grouped_gemm_pallas_mosaic_gpu(xq, wq, jnp.asarray(offsets), x_scale=xs, w_scale=ws,
                                        bias=jnp.asarray(bias.astype(np.float32)), out_dtype=jnp.float32)
    assert_rel_fro(y8, f64_forward(xd, wd, bias, offsets), 1e-3, f"mosaic fp8 {shape}")


def test_mosaic_backward_implementation_maps_dbias_to_the_default_order():
    """The bias gradient has no Mosaic GPU kernel: a Mosaic forward's backward takes dbias's default order."""
    assert jax_api.backward_implementation("pallas_mosaic_gpu", jax_api.DBIAS_IMPLEMENTATIONS) is None
    assert jax_api.backward_implementation("pallas_triton", jax_api.DBIAS_IMPLEMENTATIONS) == "pallas_triton"
