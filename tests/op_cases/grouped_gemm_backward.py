"""The cases of the grouped GEMM backward (CONTRACT.md section 8, GEMM 1 / GEMM 2) that every backend passes:
``grouped_gemm_dgrad`` (``d_x[m] = d_y[m] @ w[e(m)]``) and ``grouped_gemm_wgrad`` (``d_w[e] = d_y[rows(e)].T @
x[rows(e)]``) against float64 over ragged and empty experts, every row on one expert, M = 1, one local expert, odd
K and N, several row tiles, unused capacity; no rows at all and no experts; the gradient of ``grouped_gemm``
through the framework's autodiff; the FP8 dgrad of every weight-scale layout (straight-through: the float dgrad of
the dequantized weights); and the host-side argument checks, with the same messages in both frameworks.

Subclassed by ``tests/test_grouped_gemm_backward_torch.py`` (the torch references and Triton kernels, interpreted
on the CPU) and ``tests/test_grouped_gemm_backward_jax.py`` (the jnp references and the Pallas-Triton kernels in
interpret mode). A subclass mixes in the arrays of its framework (``op_cases.TorchArrays`` / ``JaxArrays``), names
its framework's public module (:attr:`GroupedGemmBackwardCases.OPS`) and implements :meth:`grads`.

The judge is a float64 numpy loop on the values the op sees (bf16-rounded for bf16): gradients in the input dtype
within ``GRAD_F32_REL_FRO`` / ``GRAD_BF16_REL_FRO``, float32 outputs within ``GRAD_F32_REL_FRO`` whatever the input
dtype, an empty expert's weight gradient exactly 0. Rows ``>= M`` of x and d_y are NaN: they must never be read.
"""

from __future__ import annotations

import numpy as np
import pytest

from common import DEVICE
from op_cases import ClassParams
from op_cases.grouped_gemm import check_rows
from tolerances import GRAD_BF16_REL_FRO, GRAD_F32_REL_FRO, assert_exact, assert_rel_fro, to_numpy

GRAD_LIMITS = {"float32": GRAD_F32_REL_FRO, "bfloat16": GRAD_BF16_REL_FRO}

#: name -> (rows per expert, M_cap, K, N); the comment says which edge. A backend runs those its
#: :attr:`GroupedGemmBackwardCases.SHAPES` name (JAX compiles a program per shape).
BWD_SHAPES = {
    "one-row": ([1], 1, 32, 16),  # M = 1, E_local = 1
    "M=1": ([0, 1], 1, 16, 24),  # one row (T=1, topk=1), an empty expert before it
    "odd-K-N": ([3, 0, 5], 12, 33, 17),  # odd K and N (masked tails), an empty expert, unused (NaN) capacity
    "prime-E-empties": ([0, 4, 0, 0, 9, 1, 0], 16, 32, 24),  # prime E = 7, empty first / middle / last experts
    "all-on-one": ([0, 0, 12, 0], 12, 40, 48),  # every row on one expert: the others' d_w exactly 0
    "all-rows-on-one": ([0, 0, 13, 0], 16, 32, 16),  # every row on one expert, unused capacity
    "many-tiles": ([20, 1, 0, 17], 44, 48, 40),  # several row tiles per expert, several row steps in wgrad
    "several-tiles": ([20, 3, 0, 41], 70, 40, 24),  # experts over several row tiles, tiles straddling experts
    "E_local=1": ([7], 9, 24, 20),  # one local expert, unused capacity
}


def backward_problem(seed: int, counts, m_cap: int, K: int, N: int):
    """``(x [m_cap, K], w [E, N, K], d_y [m_cap, N], offsets [E + 1])`` float32 / int32 in numpy: x ~ N(0, 1),
    w ~ N(0, 1/K), d_y ~ N(0, 1) (O(1) gradients), offsets from ``counts``; rows ``>= sum(counts)`` of x and d_y
    NaN (unused capacity: never read)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m_cap, K)).astype(np.float32)
    w = (rng.standard_normal((len(counts), N, K)) / np.sqrt(K)).astype(np.float32)
    d_y = rng.standard_normal((m_cap, N)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    assert offsets[-1] <= m_cap
    x[offsets[-1]:], d_y[offsets[-1]:] = np.nan, np.nan
    return x, w, d_y, offsets


def numpy_backward(x, w, d_y, offsets) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``(d_x, d_w)`` of ``y[m] = x[m] @ w[e(m)].T`` for the cotangent ``d_y``, expert by expert; rows of
    d_x ``>= M`` zero (the NaN there reaches nothing). Independent of every implementation."""
    x, w, d_y = (to_numpy(a).astype(np.float64) for a in (x, w, d_y))
    off = to_numpy(offsets).tolist()
    d_x, d_w = np.zeros(x.shape), np.zeros(w.shape)
    for e in range(w.shape[0]):
        s, t = off[e], off[e + 1]
        d_x[s:t] = d_y[s:t] @ w[e]
        d_w[e] = d_y[s:t].T @ x[s:t]
    return d_x, d_w


def check_d_w(d_w, shape: tuple, dtype: str, want, limit: float, counts, what: str) -> None:
    """``d_w`` of ``shape`` and ``dtype``, every value finite (no NaN read from rows >= M), within ``limit`` of
    ``want``, an empty expert's exactly 0 (CONTRACT section 8)."""
    dw = to_numpy(d_w)
    assert dw.shape == shape and dw.dtype.name == dtype, f"{what}: {dw.dtype} {dw.shape}, want {dtype} {shape}"
    assert np.isfinite(dw.astype(np.float32)).all(), f"{what}: NaN leaked from rows >= M"
    assert_rel_fro(d_w, want, limit, what)
    for e, c in enumerate(counts):
        if c == 0:
            assert not dw[e].astype(np.float32).any(), f"{what}: d_w[{e}] of an empty expert is exactly 0"


class GroupedGemmBackwardCases(ClassParams):
    """The grouped GEMM backward's cases, for any implementation.

    A backend's subclass provides ``array`` (its framework's mixin), :attr:`OPS` (the public module:
    ``grouped_gemm_dgrad``, ``grouped_gemm_wgrad``, dtypes by name), :attr:`IMPLS` (the implementations under test,
    the reference first) and the hook :meth:`grads`; it picks its cases with :attr:`SHAPES`, :attr:`GRAD_CASE` and
    :attr:`GRAD_DTYPES`.
    """

    #: The framework's public module (``moe_torch`` / ``moe_pallas``).
    OPS = None
    #: ``implementation=`` values under test.
    IMPLS: tuple = ("reference",)
    #: Keys of :data:`BWD_SHAPES`: the cases of :meth:`test_backward_ops_vs_float64`.
    SHAPES: tuple = tuple(BWD_SHAPES)
    #: The problem of :meth:`test_grad_through_grouped_gemm`: (rows per expert, M_cap, K, N, seed).
    GRAD_CASE = ([3, 0, 5], 12, 33, 17, 21)
    #: The input dtypes of :meth:`test_grad_through_grouped_gemm`.
    GRAD_DTYPES: tuple = ("float32", "bfloat16")
    #: ``implementation=`` names of the other framework (and a misspelt one): refused by this one's ops.
    FOREIGN_IMPLS: tuple = ("pallas_mosaic",)
    CLASS_PARAMS = {"impl": "IMPLS", "shape": "SHAPES", "grad_dtype": "GRAD_DTYPES"}

    def grads(self, x, w, offsets, d_y, implementation):
        """``(d_x, d_w)`` of ``grouped_gemm(x, w, offsets, implementation=...)`` for the cotangent ``d_y``, by the
        framework's autodiff."""
        raise NotImplementedError

    def problem(self, seed: int, counts, m_cap: int, K: int, N: int, dtype: str = "float32"):
        """:func:`backward_problem` in the framework: ``(x, w, d_y in dtype, offsets)``."""
        x, w, d_y, offsets = backward_problem(seed, counts, m_cap, K, N)
        return self.array(x, dtype), self.array(w, dtype), self.array(d_y, dtype), self.array(offsets)

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_backward_ops_vs_float64(self, shape, dtype, impl):
        """dgrad and wgrad (default out dtypes: d_y's and float32) within the contract's tolerance of float64 on the
        values the op sees; rows >= M of x and d_y are NaN and never read (nothing non-finite comes out), d_x rows
        >= M and empty experts' d_w exactly 0; a float32 d_x of bf16 inputs within the float32 row (only float32
        rounding of the float32 sums), d_w in bf16 within the bf16 row; the inputs are not modified."""
        counts, m_cap, K, N = BWD_SHAPES[shape]
        x, w, d_y, offsets = self.problem(len(shape) + K, counts, m_cap, K, N, dtype)
        before = [to_numpy(a).copy() for a in (x, w, d_y, offsets)]
        want_dx, want_dw = numpy_backward(x, w, d_y, offsets)
        M, what = sum(counts), f"{impl} {shape} {dtype}"
        d_x = self.OPS.grouped_gemm_dgrad(d_y, w, offsets, implementation=impl)
        check_rows(d_x, (m_cap, K), dtype, M, f"dgrad {what}")
        assert_rel_fro(d_x, want_dx, GRAD_LIMITS[dtype], f"dgrad {what} vs float64")
        d_w = self.OPS.grouped_gemm_wgrad(x, d_y, offsets, implementation=impl)
        check_d_w(d_w, (len(counts), N, K), "float32", want_dw, GRAD_F32_REL_FRO, counts, f"wgrad {what}")
        if dtype != "float32":
            d_x32 = self.OPS.grouped_gemm_dgrad(d_y, w, offsets, out_dtype="float32", implementation=impl)
            assert_rel_fro(d_x32, want_dx, GRAD_F32_REL_FRO, f"dgrad {what}, float32 output, vs float64")
            d_w_low = self.OPS.grouped_gemm_wgrad(x, d_y, offsets, out_dtype=dtype, implementation=impl)
            check_d_w(d_w_low, (len(counts), N, K), dtype, want_dw, GRAD_LIMITS[dtype], counts, f"wgrad {what} in {dtype}")
        for a, b in zip((x, w, d_y, offsets), before):
            assert_exact(a, b, "input unchanged")

    def test_no_rows_and_no_experts(self, impl):
        """All experts empty (capacity of NaN rows): d_x all 0, d_w exactly 0 (a kernel writes its zeros);
        M_cap = 0, with offsets that are or are not 0: empty d_x and a zero d_w of the right shape and dtype; E = 0
        (wgrad of no expert): an empty d_w."""
        dgrad, wgrad = self.OPS.grouped_gemm_dgrad, self.OPS.grouped_gemm_wgrad
        x, w, d_y, offsets = self.problem(2, [0, 0, 0], 8, 32, 16, "bfloat16")
        assert not to_numpy(dgrad(d_y, w, offsets, implementation=impl)).astype(np.float32).any()
        assert_exact(wgrad(x, d_y, offsets, implementation=impl), np.zeros((3, 16, 32), np.float32),
                     f"{impl} d_w, every expert empty")
        assert tuple(dgrad(d_y[:0], w, offsets, implementation=impl).shape) == (0, 32)
        d_w0 = to_numpy(wgrad(x[:0], d_y[:0], offsets, out_dtype="bfloat16", implementation=impl))
        assert d_w0.shape == (3, 16, 32) and d_w0.dtype.name == "bfloat16" and not d_w0.astype(np.float32).any()
        x, w, d_y, offsets = self.problem(1, [2, 3], 6, 16, 16)
        assert tuple(dgrad(d_y[:0], w, offsets, implementation=impl).shape) == (0, 16)
        assert_exact(wgrad(x[:0], d_y[:0], offsets, implementation=impl), np.zeros((2, 16, 16), np.float32),
                     f"{impl} d_w with no rows")
        no_experts = self.array(np.zeros((1,), np.int32))
        assert tuple(wgrad(x, d_y, no_experts, implementation=impl).shape) == (0, 16, 16)

    def test_grad_through_grouped_gemm(self, grad_dtype, impl):
        """The framework's autodiff through ``grouped_gemm`` (:meth:`grads`, the cotangent's rows >= M NaN):
        gradients in the inputs' dtype, within the dtype's row of float64, d_x rows >= M and empty experts' d_w
        exactly 0, nothing non-finite; bit-equal to the stage ops with the same implementation (the glue is
        thin)."""
        counts, m_cap, K, N, seed = self.GRAD_CASE
        dtype = grad_dtype
        x, w, d_y, offsets = self.problem(seed, counts, m_cap, K, N, dtype)
        d_x, d_w = self.grads(x, w, offsets, d_y, impl)
        want_dx, want_dw = numpy_backward(x, w, d_y, offsets)
        what = f"{impl} autodiff {dtype}"
        check_rows(d_x, (m_cap, K), dtype, sum(counts), f"{what} d_x")
        assert_rel_fro(d_x, want_dx, GRAD_LIMITS[dtype], f"{what} d_x")
        check_d_w(d_w, (len(counts), N, K), dtype, want_dw, GRAD_LIMITS[dtype], counts, f"{what} d_w")
        assert_exact(d_x, self.OPS.grouped_gemm_dgrad(d_y, w, offsets, out_dtype=dtype, implementation=impl), "d_x = dgrad")
        assert_exact(d_w, self.OPS.grouped_gemm_wgrad(x, d_y, offsets, out_dtype=dtype, implementation=impl), "d_w = wgrad")

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    @pytest.mark.parametrize("layout", ["per_expert", "per_channel", "block"])
    def test_fp8_dgrad_every_scale_layout(self, layout, dtype, impl):
        """dgrad with FP8 codes + each weight-scale layout equals float64 on the straight-through weights (CONTRACT.md
        section 8: ``q_w * scale_w`` in float32, rounded to d_y's dtype): the float32 output within GRAD_F32 (the
        weights match bit for bit, only the sums' rounding differs), the default output (d_y's dtype) within its
        dtype's row, finite, rows >= M zero, an empty expert in between. N = 160 and K = 144 cross a 128 block edge on
        both axes (a partial scale block along K and along N, the contraction), and the scales differ by powers of two
        from block to block, so a per-channel scale indexed along K or a transposed block index fails. And the float
        dgrad of the straight-through weights (the same products): bit-identical where both sum in the same order (the
        references, and the kernels interpreted on the CPU); compiled for a GPU the FP8 specialization (codes
        dequantized in registers) and the float one (weights straight from memory) are different kernels whose
        tensor-core dots may sum each K step in another order (GPU run 2: ~1/3 of d_x one float32 ulp apart), so there
        it is the float32 rule."""
        counts, m_cap, K, N = [5, 0, 11, 3], 24, 144, 160
        _, w, d_y, offsets = self.problem(11 + len(layout), counts, m_cap, K, N, dtype)
        wq, ws = self.OPS.quantize_weight_fp8(self.array(to_numpy(w).astype(np.float32)), layout)
        ws_np = to_numpy(ws)
        ws = self.array((ws_np * np.exp2(np.arange(ws_np.size) % 3).reshape(ws_np.shape)).astype(np.float32))
        w_st = self.array(to_numpy(self.OPS.dequantize_weight_fp8(wq, ws)).astype(np.float32), dtype)
        want, _ = numpy_backward(np.zeros((m_cap, K), np.float32), w_st, d_y, offsets)
        what = f"{impl} fp8 {layout} {dtype}"
        d_x32 = self.OPS.grouped_gemm_dgrad(d_y, wq, offsets, w_scale=ws, out_dtype="float32", implementation=impl)
        assert_rel_fro(d_x32, want, GRAD_F32_REL_FRO, f"{what}: float32 d_x")
        d_x = self.OPS.grouped_gemm_dgrad(d_y, wq, offsets, w_scale=ws, implementation=impl)
        check_rows(d_x, (m_cap, K), dtype, sum(counts), what)
        assert_rel_fro(d_x, want, GRAD_LIMITS[dtype], what)
        d_x_float = self.OPS.grouped_gemm_dgrad(d_y, w_st, offsets, out_dtype="float32", implementation=impl)
        if impl != "reference" and DEVICE == "gpu":
            assert_rel_fro(d_x_float, d_x32, GRAD_F32_REL_FRO, f"{what} vs the float dgrad on the straight-through weights")
        else:
            assert_exact(d_x_float, d_x32, f"{what} == the float dgrad on the straight-through weights")

    def test_errors(self):
        """Host-side checks (before anything runs) name the op, the argument, the expectation and what came, in the
        same words in both frameworks."""
        dgrad, wgrad = self.OPS.grouped_gemm_dgrad, self.OPS.grouped_gemm_wgrad
        x_np, w_np, d_y_np, off_np = backward_problem(1, [2, 3], 6, 16, 8)
        x, w, d_y, offsets = (self.array(a) for a in (x_np, w_np, d_y_np, off_np))
        with pytest.raises(ValueError, match=r"grouped_gemm_dgrad: w must be \[E, N, K\] with N == d_y.shape\[1\] \(=8\)"):
            dgrad(d_y, w[:, :4], offsets)
        with pytest.raises(TypeError, match="grouped_gemm_dgrad: w must have dtype float32 or float8_e4m3fn; got w.dtype=bfloat16"):
            dgrad(d_y, self.array(w_np, "bfloat16"), offsets)
        with pytest.raises(TypeError, match="grouped_gemm_dgrad: w must have dtype bfloat16 or float8_e4m3fn; got w.dtype=float32"):
            dgrad(self.array(d_y_np, "bfloat16"), w, offsets)
        with pytest.raises(ValueError, match="grouped_gemm_dgrad: w_scale must be given for float8_e4m3fn w"):
            dgrad(d_y, self.array(w_np, "float8_e4m3fn"), offsets)
        with pytest.raises(ValueError, match="grouped_gemm_dgrad: w_scale must be None for float32 w"):
            dgrad(d_y, w, offsets, w_scale=self.array(np.ones((2,), np.float32)))
        with pytest.raises(ValueError, match=r"grouped_gemm_dgrad: expert_offsets must be \[E \+ 1\] = \(3,\)"):
            dgrad(d_y, w, offsets[:2])
        with pytest.raises(ValueError, match=r"grouped_gemm_wgrad: d_y must be \[M_cap, N\] with M_cap == x.shape\[0\] \(=6\)"):
            wgrad(x, d_y[:5], offsets)
        with pytest.raises(TypeError, match="grouped_gemm_wgrad: d_y must have dtype float32; got d_y.dtype=bfloat16"):
            wgrad(x, self.array(d_y_np, "bfloat16"), offsets)
        with pytest.raises(TypeError, match="grouped_gemm_wgrad: x must have dtype"):
            wgrad(self.array(x_np, "float8_e4m3fn"), d_y, offsets)
        with pytest.raises(TypeError, match="grouped_gemm_wgrad: expert_offsets must have dtype int32"):
            wgrad(x, d_y, self.array(off_np.astype(np.float32)))
        with pytest.raises(TypeError, match="grouped_gemm_wgrad: out_dtype must have dtype float32 or bfloat16 or float16"):
            wgrad(x, d_y, offsets, out_dtype="int32")
        for name in self.FOREIGN_IMPLS:
            with pytest.raises(ValueError, match=f"grouped_gemm_dgrad: implementation must be one of .*; got implementation='{name}'"):
                dgrad(d_y, w, offsets, implementation=name)
            with pytest.raises(ValueError, match=f"grouped_gemm_wgrad: implementation must be one of .*; got implementation='{name}'"):
                wgrad(x, d_y, offsets, implementation=name)
