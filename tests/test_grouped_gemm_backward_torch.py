"""The grouped GEMM backward in torch (CONTRACT.md section 8, GEMM 1 / GEMM 2):
``grouped_gemm_dgrad`` (``d_x[m] = d_y[m] @ w[e(m)]``), ``grouped_gemm_wgrad`` (``d_w[e] = d_y[rows(e)].T
@ x[rows(e)]``), their torch references and Triton kernels (``moe_torch/ops/grouped_gemm/triton_backward.py``),
and ``grouped_gemm`` differentiable through ``torch.autograd``. The cases every backend passes (dgrad and wgrad
against float64 over the shapes' edges, no rows and no experts, the gradient through ``grouped_gemm``, the FP8
dgrad of every weight-scale layout, the argument checks) are the shared ones of
``op_cases/grouped_gemm_backward.py`` (``TestGroupedGemmBackwardTorch``); below them the torch-only cases.

The judge is ``torch.autograd`` of the reference *forward* in float64 (its formula checked by
``gradcheck``), at the same (rounded) inputs: float32 gradients within ``GRAD_F32_REL_FRO``, bf16 within
``GRAD_BF16_REL_FRO``, an empty expert's weight gradient exactly 0. On the CPU the Triton kernels run
in Triton's interpreter, made exact by ``moe_torch`` itself; shapes are tiny (the interpreter runs every
program in Python) and the kernels are also lowered to sm_90 cubin (in a child process).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moe_torch
from common import TORCH_DEVICE, to_torch
from moe_torch.ops.grouped_gemm import api as gemm_api
from moe_torch.ops.grouped_gemm import triton as gemm_triton
from moe_torch.ops.grouped_gemm import triton_backward as gemm_bwd
from moe_torch.ops.grouped_gemm.api import grouped_gemm, grouped_gemm_dgrad, grouped_gemm_wgrad
from moe_torch.ops.grouped_gemm.config import (
    GroupedGemmConfig,
    GroupedGemmWgradConfig,
    check_config,
    check_wgrad_config,
    heuristic_grouped_gemm_config,
    heuristic_grouped_gemm_dgrad_config,
    heuristic_grouped_gemm_wgrad_config,
)
from moe_torch.ops.grouped_gemm.reference import (
    grouped_gemm_dgrad_reference,
    grouped_gemm_reference,
    grouped_gemm_wgrad_reference,
)
from sm90 import compile_sm90
from op_cases import TorchArrays
from op_cases.grouped_gemm_backward import BWD_SHAPES, GroupedGemmBackwardCases
from tolerances import GRAD_BF16_REL_FRO, GRAD_F32_REL_FRO, assert_exact, assert_rel_fro

IMPLS = ["reference", "triton"]
NAN = float("nan")


# --------------------------------------------------------------------------------------
# Helpers


def make_problem(seed: int, counts: list[int], m_cap: int, K: int, N: int, dtype=torch.float32):
    """x [m_cap, K] ~ N(0, 1), w [E, N, K] ~ N(0, 1/K), d_y [m_cap, N] ~ N(0, 1) (O(1) gradients),
    offsets from ``counts``; rows of x and d_y past ``M = sum(counts)`` are NaN (unused capacity: never
    read). Returns ``(x, w, d_y, offsets, M)`` as torch tensors in ``dtype``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m_cap, K)).astype(np.float32)
    w = (rng.standard_normal((len(counts), N, K)) / np.sqrt(K)).astype(np.float32)
    d_y = rng.standard_normal((m_cap, N)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    M = int(offsets[-1])
    assert M <= m_cap
    x[M:], d_y[M:] = NAN, NAN
    t = lambda a: to_torch(a).to(dtype)  # noqa: E731
    return t(x), t(w), t(d_y), to_torch(offsets), M


def autodiff64(x, w, d_y, offsets):
    """``(d_x, d_w)``: ``torch.autograd`` of the float64 reference forward at ``x``, ``w`` (their
    values, upcast exactly), contracted with ``d_y``: the contract's gradients."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y = grouped_gemm_reference(x64, w64, offsets, None, None, torch.float64)
    return torch.autograd.grad(y, (x64, w64), d_y.detach().double())


def empty_experts(offsets) -> list[int]:
    o = offsets.tolist()
    return [e for e in range(len(o) - 1) if o[e + 1] <= o[e]]


def check_gradients(d_x, d_w, ref_dx, ref_dw, offsets, M, tol, what):
    """Within ``tol`` of float64 autodiff; rows >= M of d_x exactly 0; empty experts' d_w exactly 0."""
    assert torch.isfinite(d_x.float()).all() and torch.isfinite(d_w.float()).all(), f"{what}: NaN leaked"
    assert_rel_fro(d_x, ref_dx, tol, f"{what}: d_x")
    assert_rel_fro(d_w, ref_dw, tol, f"{what}: d_w")
    assert not d_x[M:].float().any(), f"{what}: rows >= M of d_x are zero"
    for e in empty_experts(offsets):
        assert not d_w[e].float().any(), f"{what}: d_w of empty expert {e} is exactly 0"


#: The shared shapes (op_cases/grouped_gemm_backward.py) the torch tests run.
SHAPES = {k: BWD_SHAPES[k] for k in ("one-row", "odd-K-N", "prime-E-empties", "all-on-one", "many-tiles")}


# --------------------------------------------------------------------------------------
# The formula: gradcheck in float64


def test_reference_forward_gradcheck():
    """The reference forward (the judge of everything below) differentiates as written: torch's
    gradcheck in float64, with an empty expert and unused capacity."""
    x, w, _, offsets, _ = make_problem(0, [2, 0, 3], 7, 5, 4, torch.float64)
    x = torch.nan_to_num(x, nan=0.5).requires_grad_()  # gradcheck perturbs every input: no NaN here
    w = w.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: grouped_gemm_reference(a, b, offsets, None, None, torch.float64),
                                    (x, w))


def test_autograd_function_gradcheck():
    """The autograd.Function (api.py's glue) with the backward references, in float64: gradcheck
    against finite differences (the public op accepts no float64, the Function does)."""
    x, w, _, offsets, _ = make_problem(1, [3, 0, 2, 1], 8, 6, 5, torch.float64)
    x = torch.nan_to_num(x, nan=-0.25).requires_grad_()
    w = w.requires_grad_()
    fn = lambda a, b: gemm_api._GroupedGemmFunction.apply(a, b, offsets, torch.float64, "reference")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w))


# --------------------------------------------------------------------------------------
# The backward ops vs float64 autodiff


class TestGroupedGemmBackwardTorch(TorchArrays, GroupedGemmBackwardCases):
    """``moe_torch.grouped_gemm_dgrad`` / ``grouped_gemm_wgrad`` with the references and the Triton kernels
    (their heuristic configs), and ``torch.autograd.grad`` through ``moe_torch.grouped_gemm``."""

    OPS = moe_torch
    IMPLS = tuple(IMPLS)
    SHAPES = tuple(SHAPES)
    FOREIGN_IMPLS = ("pallas_mosaic", "pallas_triton")

    def grads(self, x, w, offsets, d_y, implementation):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = moe_torch.grouped_gemm(xr, wr, offsets, implementation=implementation)
        assert y.requires_grad
        return torch.autograd.grad(y, (xr, wr), d_y)


def test_strided_inputs():
    """A column-strided d_y / x (a view, stride(1) = 2) gives the same result as its contiguous copy."""
    x, w, d_y, offsets, _ = make_problem(3, [4, 3], 8, 16, 16)
    wide_dy = torch.repeat_interleave(d_y, 2, dim=1)[:, ::2]
    wide_x = torch.repeat_interleave(x, 2, dim=1)[:, ::2]
    assert wide_dy.stride(1) == 2
    assert_exact(grouped_gemm_dgrad(wide_dy, w, offsets, implementation="triton"),
                 grouped_gemm_dgrad(d_y, w, offsets, implementation="triton"), "strided d_y")
    assert_exact(grouped_gemm_wgrad(wide_x, wide_dy, offsets, implementation="triton"),
                 grouped_gemm_wgrad(x, d_y, offsets, implementation="triton"), "strided x, d_y")


# --------------------------------------------------------------------------------------
# Triton kernels: what they write, small blocks, launch orders

SMALL_DGRAD = GroupedGemmConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
SMALL_WGRAD = GroupedGemmWgradConfig(block_n=16, block_k=16, block_m=16, num_warps=4, num_stages=1)


def dgrad_into_poison(d_y, w, offsets, w_scale, out_dtype, config):
    """The dgrad kernel into a NaN buffer one row and 15 columns larger than ``d_x [M_cap, K]``: what
    it does not write stays NaN (guard row and columns, and rows it must not touch)."""
    M_cap, K = d_y.shape[0], w.shape[2]
    buf = torch.full((M_cap + 1, K + 15), NAN, dtype=out_dtype, device=d_y.device)
    gemm_bwd._launch_dgrad("grouped_gemm_dgrad", d_y, w, offsets, w_scale, buf[:M_cap, :K], config)
    return buf


def wgrad_into_poison(x, d_y, offsets, out_dtype, config):
    """The wgrad kernel into a NaN buffer with one extra expert, row and 15 columns around ``d_w``."""
    E, N, K = offsets.shape[0] - 1, d_y.shape[1], x.shape[1]
    buf = torch.full((E + 1, N + 1, K + 15), NAN, dtype=out_dtype, device=x.device)
    gemm_bwd._launch_wgrad("grouped_gemm_wgrad", x, d_y, offsets, buf[:E, :N, :K], config)
    return buf


@pytest.mark.parametrize("shape", ["odd-K-N", "prime-E-empties", "many-tiles"])
def test_kernels_write_exactly_their_elements(shape):
    """Small blocks (several row tiles, column tiles and wgrad row steps): dgrad writes the rows
    [0, M) and columns < K only (rows >= M stay NaN, guards untouched); wgrad writes every element of
    d_w (empty experts exactly 0) and nothing outside it; both equal float64 autodiff within F32."""
    counts, m_cap, K, N = SHAPES[shape]
    x, w, d_y, offsets, M = make_problem(5, counts, m_cap, K, N)
    ref_dx, ref_dw = autodiff64(x, w, d_y, offsets)
    buf = dgrad_into_poison(d_y, w, offsets, None, torch.float32, SMALL_DGRAD)
    assert torch.isnan(buf[M:]).all() and torch.isnan(buf[:, K:]).all(), "dgrad: rows >= M / guards never written"
    assert_rel_fro(buf[:M, :K], ref_dx[:M], GRAD_F32_REL_FRO, "dgrad, small blocks")
    E = len(counts)
    buf = wgrad_into_poison(x, d_y, offsets, torch.float32, SMALL_WGRAD)
    assert torch.isnan(buf[E]).all() and torch.isnan(buf[:, N]).all() and torch.isnan(buf[:, :, K:]).all(), "guards"
    d_w = buf[:E, :N, :K]
    assert torch.isfinite(d_w).all(), "wgrad writes every element of d_w"
    assert_rel_fro(d_w, ref_dw, GRAD_F32_REL_FRO, "wgrad, small blocks")
    for e in empty_experts(offsets):
        assert not d_w[e].any()


#: Launch orders of the dgrad kernel (the forward's: GroupedGemmConfig.group_m, .persistent).
ORDERS = {"g1": dict(group_m=1, persistent=False), "g3": dict(group_m=3, persistent=False),
          "g1-persistent": dict(group_m=1, persistent=True), "g4-persistent": dict(group_m=4, persistent=True)}


@pytest.mark.parametrize("order", list(ORDERS))
def test_dgrad_launch_orders(order):
    """Every launch order computes every (work item, column tile) once: small blocks, two experts
    per row tile, three column tiles; rows >= M never written."""
    counts, m_cap, K, N = SHAPES["many-tiles"]
    x, w, d_y, offsets, M = make_problem(6, counts, m_cap, K, N, torch.bfloat16)
    ref_dx, _ = autodiff64(x, w, d_y, offsets)
    buf = dgrad_into_poison(d_y, w, offsets, None, torch.float32, dataclasses.replace(SMALL_DGRAD, **ORDERS[order]))
    assert torch.isnan(buf[M:]).all() and torch.isnan(buf[:, K:]).all()
    assert_rel_fro(buf[:M, :K], ref_dx[:M], GRAD_F32_REL_FRO, order)


@pytest.mark.parametrize("aligned", ["1", "0"])
@pytest.mark.parametrize("order", ["g1", "g4-persistent"])
def test_dgrad_aligned_tiles(monkeypatch, order, aligned):
    """The dgrad on each expert's own row tiles (the default, ``EPMOE_TRITON_ALIGNED_TILES=1``) and on the global
    grid (``=0``): within F32 of float64 autodiff, rows >= M and columns >= K never written."""
    counts, m_cap, K, N = SHAPES["many-tiles"]
    x, w, d_y, offsets, M = make_problem(6, counts, m_cap, K, N, torch.bfloat16)
    ref_dx, _ = autodiff64(x, w, d_y, offsets)
    monkeypatch.setenv("EPMOE_TRITON_ALIGNED_TILES", aligned)
    buf = dgrad_into_poison(d_y, w, offsets, None, torch.float32, dataclasses.replace(SMALL_DGRAD, **ORDERS[order]))
    assert torch.isnan(buf[M:]).all() and torch.isnan(buf[:, K:]).all()
    assert_rel_fro(buf[:M, :K], ref_dx[:M], GRAD_F32_REL_FRO, f"aligned={aligned} {order}")


@settings(max_examples=10)
@given(counts=st.lists(st.integers(0, 20), min_size=1, max_size=5), spare=st.integers(0, 4),
       dims=st.sampled_from([(16, 16), (24, 40), (40, 8)]), group_m=st.sampled_from([1, 2, 3]),
       persistent=st.booleans())
def test_random_group_sizes(counts, spare, dims, group_m, persistent):
    """Hypothesis over group sizes (empty experts happen on their own) with small blocks and a random
    dgrad launch order: both kernels within F32 of float64 autodiff, rows >= M of d_x never written,
    every element of d_w written."""
    m_cap = sum(counts) + spare
    if m_cap == 0:
        return
    K, N = dims
    x, w, d_y, offsets, M = make_problem(m_cap + K, counts, m_cap, K, N)
    ref_dx, ref_dw = autodiff64(x, w, d_y, offsets)
    cfg = dataclasses.replace(SMALL_DGRAD, group_m=group_m, persistent=persistent)
    buf = dgrad_into_poison(d_y, w, offsets, None, torch.float32, cfg)
    assert torch.isnan(buf[M:]).all(), "rows >= M never written"
    assert_rel_fro(buf[:M, :K], ref_dx[:M], GRAD_F32_REL_FRO, f"dgrad {counts}")
    E = len(counts)
    d_w = wgrad_into_poison(x, d_y, offsets, torch.float32, SMALL_WGRAD)[:E, :N, :K]
    assert torch.isfinite(d_w).all()
    assert_rel_fro(d_w, ref_dw, GRAD_F32_REL_FRO, f"wgrad {counts}")


# --------------------------------------------------------------------------------------
# grouped_gemm through torch.autograd


def test_autograd_only_what_is_asked(monkeypatch):
    """Only w requires grad: the backward runs wgrad only (dgrad is never called), and vice versa;
    nothing requiring grad (or torch.no_grad): no graph at all."""
    x, w, d_y, offsets, M = make_problem(22, [3, 2], 6, 16, 8)
    calls = []
    for name in ("_dgrad", "_wgrad"):
        real = getattr(gemm_api, name)
        monkeypatch.setattr(gemm_api, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    wr = w.clone().requires_grad_()
    (d_w,) = torch.autograd.grad(grouped_gemm(x, wr, offsets), (wr,), d_y)
    assert calls == ["_wgrad"] and d_w.shape == w.shape
    calls.clear()
    xr = x.clone().requires_grad_()
    (d_x,) = torch.autograd.grad(grouped_gemm(xr, w, offsets), (xr,), d_y)
    assert calls == ["_dgrad"] and not d_x[M:].any()
    assert grouped_gemm(x, w, offsets).grad_fn is None
    with torch.no_grad():
        assert grouped_gemm(xr, wr, offsets).grad_fn is None


def test_autograd_wider_out_dtype():
    """bf16 x and w with ``out_dtype=float32``: d_y arrives in float32 and is rounded to bf16 before
    the GEMMs (as torch's own cast backward, and the JAX mirror: no float32 copy of the weights);
    gradients come back in bf16, within the bf16 row of float64 autodiff of the float32 d_y."""
    x, w, d_y, offsets, M = make_problem(23, [4, 0, 5], 10, 24, 16, torch.bfloat16)
    d_y32 = d_y.float() + 1e-3 * torch.rand_like(d_y.float())  # not representable in bf16
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_gemm(xr, wr, offsets, out_dtype=torch.float32)
    d_x, d_w = torch.autograd.grad(y, (xr, wr), d_y32)
    assert d_x.dtype == d_w.dtype == torch.bfloat16
    d_y16 = d_y32.bfloat16()
    assert_exact(d_x, grouped_gemm_dgrad(d_y16, w, offsets, out_dtype=torch.bfloat16), "d_x: d_y rounded to bf16")
    assert_exact(d_w, grouped_gemm_wgrad(x, d_y16, offsets, out_dtype=torch.bfloat16), "d_w: d_y rounded to bf16")
    ref_dx, ref_dw = autodiff64(x, w, d_y32, offsets)
    check_gradients(d_x, d_w, ref_dx, ref_dw, offsets, M, GRAD_BF16_REL_FRO, "out_dtype=float32")


def test_autograd_zero_capacity():
    """M_cap = 0 in a graph: empty d_x, a zero d_w (not a missing gradient)."""
    x, w, d_y, offsets, _ = make_problem(24, [0, 0], 4, 16, 8)
    xr, wr = x[:0].clone().requires_grad_(), w.clone().requires_grad_()
    d_x, d_w = torch.autograd.grad(grouped_gemm(xr, wr, offsets), (xr, wr), d_y[:0])
    assert d_x.shape == (0, 16) and d_w.shape == w.shape and not d_w.any()


@pytest.mark.parametrize("which", ["x", "w", "w_scale"])
def test_fp8_gradient_raises(which):
    """FP8 codes and scales are not differentiable at the stage level (torch lets a float8 tensor
    require grad): the forward runs, a backward through it raises TypeError naming the input,
    never a wrong or silently missing gradient."""
    x, w, _, offsets, _ = make_problem(25, [3, 3], 6, 32, 16)
    xq, xs = moe_torch.per_token_quant_fp8(x)
    wq, ws = moe_torch.quantize_weight_fp8(w, "per_channel")
    inputs = dict(x=xq, w=wq, w_scale=ws)
    inputs[which] = inputs[which].clone().requires_grad_()
    y = grouped_gemm(inputs["x"], inputs["w"], offsets, x_scale=xs, w_scale=inputs["w_scale"])
    assert_exact(y.detach(), grouped_gemm(xq, wq, offsets, x_scale=xs, w_scale=ws), "forward unchanged")
    with pytest.raises(TypeError, match=f"grouped_gemm: not differentiable for float8_e4m3fn .* through {which}"):
        y.float().sum().backward()


# --------------------------------------------------------------------------------------
# Validation and dispatch


def test_errors_torch_only():
    """Host-side checks of the torch ops alone (the others: the shared ``test_errors``): an input that is not a
    tensor is named as such."""
    x, w, d_y, offsets, _ = make_problem(30, [2, 2], 4, 16, 8)
    with pytest.raises(TypeError, match="grouped_gemm_wgrad: x must be a torch.Tensor"):
        grouped_gemm_wgrad(x.cpu().numpy(), d_y, offsets)


def test_dispatch(monkeypatch):
    """``implementation="triton"`` runs the kernels (their NotImplementedError reaches the caller);
    ``None`` on CPU tensors runs the references and never touches Triton."""
    x, w, d_y, offsets, _ = make_problem(31, [2, 2], 4, 16, 8)

    def refuse(*args):
        raise NotImplementedError("test: triton refused")

    monkeypatch.setattr(gemm_api, "_triton_dgrad", refuse)
    monkeypatch.setattr(gemm_api, "_triton_wgrad", refuse)
    with pytest.raises(NotImplementedError, match="test: triton refused"):
        grouped_gemm_dgrad(d_y, w, offsets, implementation="triton")
    with pytest.raises(NotImplementedError, match="test: triton refused"):
        grouped_gemm_wgrad(x, d_y, offsets, implementation="triton")
    if TORCH_DEVICE == "cpu":
        assert_exact(grouped_gemm_dgrad(d_y, w, offsets), grouped_gemm_dgrad_reference(d_y, w, offsets, None, torch.float32),
                     "dgrad, implementation=None")
        assert_exact(grouped_gemm_wgrad(x, d_y, offsets), grouped_gemm_wgrad_reference(x, d_y, offsets, torch.float32),
                     "wgrad, implementation=None")


# --------------------------------------------------------------------------------------
# Configs


@pytest.mark.parametrize("M_cap,N,K,E", [(1, 4096, 7168, 32), (16384, 7168, 2048, 256), (12, 17, 33, 3)])
@pytest.mark.parametrize("bits", [16, 32])
def test_configs(M_cap, N, K, E, bits):
    """dgrad's heuristic is the forward's with N and K swapped (and obeys the forward's rules, with
    128x128 weight blocks too); wgrad's is frozen, keyword-only, obeys its rules, and keeps its tile
    within one warpgroup's accumulator (64 x 128) and its row step at 128 bytes per row."""
    from moe_torch.ops.grouped_gemm.config import DGRAD_WIDE_CONFIG, DGRAD_WIDE_MIN_ROWS

    wide = bits == 16 and M_cap >= DGRAD_WIDE_MIN_ROWS  # the H200-measured wide tiles (config.py)
    want = DGRAD_WIDE_CONFIG if wide else heuristic_grouped_gemm_config(M_cap, K, N, E, bits)
    assert heuristic_grouped_gemm_dgrad_config(M_cap, N, K, E, bits) == want
    check_config("grouped_gemm_dgrad", heuristic_grouped_gemm_dgrad_config(M_cap, N, K, E, bits, True), bits, None, True)
    c = heuristic_grouped_gemm_wgrad_config(M_cap, N, K, E, bits)
    check_wgrad_config("grouped_gemm_wgrad", c, bits)
    from moe_torch.ops.grouped_gemm.config import WGRAD_WIDE_CONFIG

    if bits == 16 and M_cap >= 8192 and M_cap >= 64 * E:  # the H200-measured wide tiles (config.py)
        assert c == WGRAD_WIDE_CONFIG
    else:
        assert 16 <= c.block_n <= 64 and 16 <= c.block_k <= 128 and 16 <= c.block_m <= 1024 // bits
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_m = 1
    with pytest.raises(TypeError):
        GroupedGemmWgradConfig(16, 16, 16, 4, 1)  # kw_only


def test_config_rules():
    """Configs breaking the rules are refused before launch (ValueError)."""
    for bad in (dict(block_m=8), dict(block_n=24), dict(block_k=0)):
        with pytest.raises(ValueError, match="grouped_gemm_wgrad: config must have power-of-2 blocks"):
            check_wgrad_config("grouped_gemm_wgrad", dataclasses.replace(SMALL_WGRAD, **bad), 16)
    x, w, d_y, offsets, _ = make_problem(32, [2, 2], 4, 16, 8)
    with pytest.raises(ValueError, match="grouped_gemm_wgrad: config"):
        gemm_bwd.grouped_gemm_wgrad_triton(x, d_y, offsets, torch.float32, dataclasses.replace(SMALL_WGRAD, block_m=8))
    with pytest.raises(ValueError, match="grouped_gemm_dgrad: config"):
        gemm_bwd.grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.float32,
                                           dataclasses.replace(SMALL_DGRAD, block_k=8))


# --------------------------------------------------------------------------------------
# sm_90 compilation on the CPU (child process without the interpreter; see tests/sm90.py)

_DGRAD_INTS = ("M_cap", "N", "K", "E", "stride_dym", "stride_we", "stride_wn", "stride_om", "stride_wse", "stride_wsn",
               "stride_wsk")
_WGRAD_INTS = ("M_cap", "N", "K", "stride_xm", "stride_dym", "stride_oe", "stride_on")


def _dgrad_job(dtype: str, w_dtype: str, w_scale: int, M_cap: int, N: int, K: int, E: int, **order):
    bits = {"bf16": 16, "fp32": 32}[dtype]
    cfg = dataclasses.replace(heuristic_grouped_gemm_dgrad_config(M_cap, N, K, E, bits, w_scale == 3), **order)
    return {
        "module": "moe_torch.ops.grouped_gemm.triton_backward", "kernel": "_grouped_gemm_dgrad_kernel",
        "signature": {"dy_ptr": f"*{dtype}", "w_ptr": f"*{w_dtype}", "offsets_ptr": "*i32", "w_scale_ptr": "*fp32",
                      "out_ptr": f"*{dtype}", **{a: "i32" for a in _DGRAD_INTS}},
        "constexprs": {"W_SCALE": w_scale, "W_BLOCK": 128 if w_scale == 3 else 1, "IEEE_F32": dtype == "fp32",
                       "BLOCK_E": 1 << E.bit_length(), "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                       "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m, "PERSISTENT": cfg.persistent},
        "options": {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    }


def _wgrad_job(dtype: str, M_cap: int, N: int, K: int, E: int):
    cfg = heuristic_grouped_gemm_wgrad_config(M_cap, N, K, E, {"bf16": 16, "fp32": 32}[dtype])
    return {
        "module": "moe_torch.ops.grouped_gemm.triton_backward", "kernel": "_grouped_gemm_wgrad_kernel",
        "signature": {"x_ptr": f"*{dtype}", "dy_ptr": f"*{dtype}", "offsets_ptr": "*i32", "out_ptr": "*fp32",
                      **{a: "i32" for a in _WGRAD_INTS}},
        "constexprs": {"IEEE_F32": dtype == "fp32", "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                       "BLOCK_M": cfg.block_m},
        "options": {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    }


#: name -> job, DeepSeek-V3-like shapes (GEMM 1's dgrad: d_h [M, 2I=4096] x w13 [E, 4096, 7168]).
SM90_JOBS = {
    "dgrad-bf16-wide-128x256": _dgrad_job("bf16", "bf16", 0, 16384, 4096, 7168, 32),
    "dgrad-bf16-16rows-group8-persistent": _dgrad_job("bf16", "bf16", 0, 256, 4096, 7168, 32, group_m=8,
                                                      persistent=True),
    "dgrad-fp32-ieee": _dgrad_job("fp32", "fp32", 0, 256, 4096, 7168, 32),
    "dgrad-bf16-fp8w-block-wide": _dgrad_job("bf16", "fp8e4nv", 3, 16384, 4096, 7168, 256),
    "dgrad-bf16-fp8w-per_channel-wide": _dgrad_job("bf16", "fp8e4nv", 2, 16384, 7168, 2048, 256),
    "dgrad-bf16-fp8w-per_expert-16rows": _dgrad_job("bf16", "fp8e4nv", 1, 256, 4096, 7168, 32),
    "wgrad-bf16-wide-128x256": _wgrad_job("bf16", 16384, 4096, 7168, 32),
    "wgrad-bf16-decode": _wgrad_job("bf16", 256, 4096, 7168, 32),
    "wgrad-fp32-ieee": _wgrad_job("fp32", 16384, 4096, 7168, 32),
}


@pytest.fixture(scope="module")
def sm90_ptx() -> dict[str, str]:
    return compile_sm90(SM90_JOBS)


@pytest.mark.parametrize("name", list(SM90_JOBS))
def test_compiles_for_sm90(sm90_ptx, name):
    """The backward kernels lower to sm_90 cubin: bf16 on tensor cores (wgmma for dgrad's wide 128 x 256
    tiles and for wgrad's 64 x 128 tiles, FP8 weights dequantized to bf16 first: no e4m3 MMA), float32 on
    neither (IEEE: no TF32); 64-bit address products."""
    ptx = sm90_ptx[name]
    assert ".target sm_90" in ptx
    if "fp32" in name:
        assert "wgmma" not in ptx and "mma.sync" not in ptx and ".tf32" not in ptx
    elif "wide" in name or name.startswith("wgrad"):
        assert "wgmma.mma_async.sync.aligned" in ptx and ".bf16.bf16" in ptx
        assert not re.search(r"(wgmma|mma)[^\n]*e4m3", ptx), "FP8 weights are dequantized before the MMA"
    else:
        assert "mma.sync.aligned" in ptx
    assert "mul.wide.s32" in ptx or "mul.lo.s64" in ptx
