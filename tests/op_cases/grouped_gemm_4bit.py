"""The cases of the grouped GEMM with 4-bit weights (CONTRACT.md section 9: ``grouped_gemm(..., w_format="mxfp4" |
"int4")``) that every backend passes: the reference against float64, the kernel against the reference over ragged
and empty experts, every row on one expert, M = 1, fewer rows than a tile and K tails, the e8m0 NaN and subnormal
scales, the straight-through gradient of ``x``, no local experts, int32-packed codes and the bad inputs.

Subclassed by ``tests/test_grouped_gemm_4bit_torch.py`` (the torch reference and the Triton kernel, interpreted on
the CPU) and ``tests/test_grouped_gemm_4bit_jax.py`` (the jnp reference and the Pallas-Triton kernel in interpret
mode). A subclass mixes in the arrays of its framework (``op_cases.TorchArrays`` / ``JaxArrays``), names its
framework's public module (:attr:`GroupedGemm4bitCases.OPS`) and implements the hooks.

The judge is a float64 numpy loop (``op_cases.grouped_gemm.numpy_grouped_gemm``) on the float32 dequantized
weights (the contract's row: bf16 1e-2, float32 1e-5); the kernel is also compared with the reference, and the
reference with the float op on the dequantized weights rounded to x's dtype (what section 9 says it computes).
The unused rows of ``x`` are NaN, so a kernel that reads a row it does not own fails the finiteness checks.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from common import DEVICE
from op_cases import ClassParams
from op_cases.grouped_gemm import check_rows, numpy_grouped_gemm
from op_cases.quant_4bit import E2M1, codes
from tolerances import BF16_REL_FRO, F32_REL_FRO, assert_exact, assert_rel_fro, to_numpy

FORMATS = ("mxfp4", "int4")
#: The contract's rows (CONTRACT.md sections 7 and 9) for an output of this dtype against float64.
LIMITS = {"float32": F32_REL_FRO, "bfloat16": BF16_REL_FRO}

#: name -> (rows per expert, M_cap, K, N); the comment says which edge. A backend runs those its
#: :attr:`GroupedGemm4bitCases.KERNEL_CASES` name.
W4_SHAPES = {
    "ragged-empty-experts": ([3, 0, 17, 0, 5], 32, 96, 24),  # empty experts between and at the end, a K tail
    "all-rows-one-expert": ([0, 0, 21, 0], 24, 96, 24),  # one expert owns every row, spare rows poisoned
    "decode-M1": ([0, 1, 0, 0], 1, 96, 24),  # one token: M = 1 (decode)
    "tail-rows": ([1, 1, 1], 7, 96, 24),  # fewer rows than a tile, rows >= M poisoned
    "ragged-with-empties": ([5, 0, 11, 0], 20, 64, 24),  # small tiles: one straddling two experts, unused rows
    "all-rows-one-of-three": ([0, 13, 0], 16, 64, 16),  # every row on expert 1, experts 0 and 2 empty
    "M1-one-group": ([0, 1], 1, 32, 16),  # one row; K = one group, under one K step of 64 (a masked group)
    "K-tail-96": ([3, 4], 9, 96, 16),  # K = 96: the second K step of 64 holds one real group, one masked
    "K-tail-160": ([6, 2], 8, 160, 32),  # K = 160: five groups, the third K step of 64 half masked
}


def kernel_cases(shapes, formats=FORMATS, dtypes=("float32", "bfloat16")) -> dict:
    """``{test id: (shape, w_format, dtype)}`` for every shape x format x dtype."""
    return {f"{s}-{f}-{d}": (s, f, d) for s in shapes for f in formats for d in dtypes}


def w4_problem(seed: int, counts, m_cap: int, K: int, N: int):
    """``(x [m_cap, K], w [E, N, K], offsets [E + 1])`` float32 / int32 in numpy: x ~ N(0, 1) with rows
    ``>= sum(counts)`` NaN (never to be read), w ~ N(0, 1/K) (outputs O(1)), offsets from ``counts``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m_cap, K)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    assert offsets[-1] <= m_cap
    x[offsets[-1]:] = np.nan
    w = (rng.standard_normal((len(counts), N, K)) / np.sqrt(K)).astype(np.float32)
    return x, w, offsets


class GroupedGemm4bitCases(ClassParams):
    """The 4-bit grouped GEMM's cases, for any implementation.

    A backend's subclass provides ``array`` (its framework's mixin), :attr:`OPS` (the public module:
    ``grouped_gemm``, ``grouped_gemm_dgrad``, ``quantize_weight_*``, ``dequantize_weight_*``, dtypes by name),
    :attr:`KERNEL` and the hooks :meth:`kernel_grouped_gemm` (the kernel under test), :meth:`reference_grouped_gemm`
    (its judge), :meth:`float_reference` and :meth:`x_gradient`; it picks its cases with :attr:`KERNEL_CASES`,
    :attr:`REFERENCE_CASE`, :attr:`GRAD_CASE` and :attr:`IMPLEMENTATIONS`. Where its kernel cannot run on this
    machine it overrides the ``kernel_runs`` fixture to skip.
    """

    #: The framework's public module (``moe_torch`` / ``moe_pallas``).
    OPS = None
    #: The name of the kernel under test (``implementation=``) in :meth:`test_no_local_experts_gives_zeros`.
    KERNEL = None
    #: ``{test id: (key of W4_SHAPES, w_format, dtype)}``: the cases of :meth:`test_kernel_matches_reference`.
    KERNEL_CASES: dict = kernel_cases(W4_SHAPES)
    #: The problem of :meth:`test_reference_matches_float64`: (rows per expert, M_cap, K, N).
    REFERENCE_CASE = ([3, 0, 17, 0, 5], 32, 96, 40)
    #: The problem of :meth:`test_gradient_of_x_is_straight_through`: (rows per expert, M_cap, K, N).
    GRAD_CASE = ([3, 0, 6], 12, 64, 32)
    #: ``{test id: implementation}`` of :meth:`test_gradient_of_x_is_straight_through` (the forward's; the
    #: backward follows it).
    IMPLEMENTATIONS: dict = {"default": None}
    CLASS_PARAMS = {"kernel_case": "KERNEL_CASES", "implementation": "IMPLEMENTATIONS"}

    @pytest.fixture
    def kernel_runs(self):
        """The precondition of the tests that launch the kernel: nothing here; a backend whose kernel cannot
        run on this machine overrides it to skip."""

    def kernel_grouped_gemm(self, x, w_q, offsets, w_scale, fmt: str, out_dtype: str | None = None):
        """The kernel under test (``out_dtype``: a dtype name; None: x's dtype)."""
        raise NotImplementedError

    def reference_grouped_gemm(self, x, w_q, offsets, w_scale, fmt: str, out_dtype: str | None = None):
        """The 4-bit reference of the framework (the judge)."""
        raise NotImplementedError

    def float_reference(self, x, w, offsets, out_dtype: str):
        """The framework's float reference ``grouped_gemm`` on float weights ``w``."""
        raise NotImplementedError

    def x_gradient(self, x, w_q, offsets, w_scale, fmt: str, d_y, implementation):
        """``d_x`` of the 4-bit ``grouped_gemm`` (``implementation``) for the cotangent ``d_y`` of its output."""
        raise NotImplementedError

    def quantize(self, w_np: np.ndarray, fmt: str):
        """``(w_q, w_scale)`` of the float32 weights ``w_np``, by the framework's quantizer."""
        return getattr(self.OPS, f"quantize_weight_{fmt}")(self.array(w_np))

    def dequantize(self, w_q, w_scale, fmt: str, out_dtype: str = "float32"):
        return getattr(self.OPS, f"dequantize_weight_{fmt}")(w_q, w_scale, out_dtype=out_dtype)

    def problem(self, seed: int, counts, m_cap: int, K: int, N: int, fmt: str, dtype: str = "float32"):
        """:func:`w4_problem` in the framework: ``(x in dtype, w_q, w_scale, offsets)``."""
        x, w, offsets = w4_problem(seed, counts, m_cap, K, N)
        return (self.array(x, dtype), *self.quantize(w, fmt), self.array(offsets))

    # --- The reference ------------------------------------------------------------------------------

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_reference_matches_float64(self, fmt, dtype):
        """:attr:`REFERENCE_CASE`: x's dtype and shape, every row finite and rows >= M zero (NaN there, never read);
        within the contract's row of the float64 product with the float32 dequantized weights (section 9's
        judge); exactly the float reference on the weights rounded to x's dtype (what it computes); for bf16 x
        its float32 output within F32_REL_FRO of float64 on those bf16 weights."""
        counts, m_cap, K, N = self.REFERENCE_CASE
        x, w_q, w_scale, offsets = self.problem(0, counts, m_cap, K, N, fmt, dtype)
        M = sum(counts)
        y = self.reference_grouped_gemm(x, w_q, offsets, w_scale, fmt)
        check_rows(y, (m_cap, N), dtype, M, f"reference {fmt} {dtype}")
        assert_rel_fro(y, numpy_grouped_gemm(x, self.dequantize(w_q, w_scale, fmt), offsets), LIMITS[dtype],
                       f"reference {fmt} {dtype} vs float64")
        wd_x = self.dequantize(w_q, w_scale, fmt, dtype)
        y_float = self.float_reference(x, wd_x, offsets, dtype)
        what = f"reference {fmt} {dtype} vs the float reference on wd in {dtype}"
        if DEVICE == "cpu":
            assert_exact(y, y_float, what)
        else:  # XLA's GPU dots of two compilations may sum in other orders (seen: 4 float32 ulps on the H200)
            assert_rel_fro(y, y_float, 1e-6, what)
        if dtype == "bfloat16":  # and what it computes: wd rounded to bf16, float32 accumulation (float32 out)
            y32 = self.reference_grouped_gemm(x, w_q, offsets, w_scale, fmt, "float32")
            assert_rel_fro(y32, numpy_grouped_gemm(x, wd_x, offsets), F32_REL_FRO, "bf16-rounded wd")

    # --- The kernel ---------------------------------------------------------------------------------

    @pytest.mark.usefixtures("kernel_runs")
    def test_kernel_matches_reference(self, kernel_case):
        """A case of :data:`W4_SHAPES`: every row finite and rows >= M zero (not read: NaN; not written), within the
        row of x's dtype of the reference and of float64 on the float32 dequantized weights; with bf16 x, a float32
        output within F32_REL_FRO of float64 on the bf16-rounded weights (the kernel rounds them before the dot,
        section 9)."""
        shape, fmt, dtype = kernel_case
        counts, m_cap, K, N = W4_SHAPES[shape]
        x, w_q, w_scale, offsets = self.problem(len(shape) + K, counts, m_cap, K, N, fmt, dtype)
        M, what = sum(counts), f"{shape} {fmt} {dtype}"
        y = self.kernel_grouped_gemm(x, w_q, offsets, w_scale, fmt)
        check_rows(y, (m_cap, N), dtype, M, what)
        ref = self.reference_grouped_gemm(x, w_q, offsets, w_scale, fmt)
        assert_rel_fro(y, ref, LIMITS[dtype], f"{what}: kernel vs reference")
        assert_rel_fro(y, numpy_grouped_gemm(x, self.dequantize(w_q, w_scale, fmt), offsets), LIMITS[dtype],
                       f"{what}: kernel vs float64")
        if dtype == "bfloat16":
            y32 = self.kernel_grouped_gemm(x, w_q, offsets, w_scale, fmt, "float32")
            check_rows(y32, (m_cap, N), "float32", M, f"{what} -> float32")
            wd16 = self.dequantize(w_q, w_scale, fmt, "bfloat16")
            assert_rel_fro(to_numpy(y32)[:M], numpy_grouped_gemm(x, wd16, offsets)[:M], F32_REL_FRO,
                           f"{what}: bf16-rounded wd, float32 sums")

    @pytest.mark.usefixtures("kernel_runs")
    def test_kernel_nan_scale_reaches_only_its_expert_rows(self):
        """An e8m0 scale of 255 (NaN) in expert 1, row n = 3, group 1, bf16 x: the rows of expert 1 get NaN in
        column 3 only."""
        x, w_q, w_scale, offsets = self.problem(9, [3, 4], 8, 64, 16, "mxfp4", "bfloat16")
        s = to_numpy(w_scale).copy()
        s[1, 3, 1] = 255
        nan = np.isnan(to_numpy(self.kernel_grouped_gemm(x, w_q, offsets, self.array(s), "mxfp4")).astype(np.float32))
        assert nan[3:7, 3].all() and nan.sum() == 4, np.argwhere(nan).tolist()

    def scale_edges_case(self):
        """The e8m0 edges of MXFP4: ``(x, w_q, offsets, w_scale)`` (3 experts, N = 16, K = 64, 12 rows, x ~ 2^120,
        random codes, scale codes s in {0, 1, 2} and one 255: expert 2, row 5, group 1) and the float64 product
        with the exactly dequantized weights (numpy, NaN in that group)."""
        rng = np.random.default_rng(3)
        E, N, K = 3, 16, 64
        q = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
        s = rng.integers(0, 3, (E, N, K // 32), dtype=np.uint8)  # s in {0, 1, 2}: 2^-127 (subnormal) .. 2^-125
        s[2, 5, 1] = 255
        offsets = np.array([0, 4, 9, 12], np.int32)
        x = (rng.standard_normal((12, K)) * 2.0**120).astype(np.float32)
        wd = E2M1[codes(q)] * np.where(s == 255, np.nan, 2.0 ** (s - 127.0)).repeat(32, axis=-1)
        truth = numpy_grouped_gemm(x, wd, offsets)
        return (self.array(x), self.array(q), self.array(offsets), self.array(s)), truth

    def check_scale_edges(self, y, truth, what: str) -> None:
        """NaN exactly in expert 2's column 5 (its rows 9..11); elsewhere within F32_REL_FRO of float64 (the
        products are normal float32 values ~2^-8 .. 2^-2: a flushed subnormal weight or multiplier gives 0)."""
        y = to_numpy(y).astype(np.float64)
        nan = np.isnan(truth)
        assert nan[9:12, 5].all() and nan.sum() == 3
        assert np.array_equal(np.isnan(y), nan), f"{what}: NaN at {np.argwhere(np.isnan(y)).tolist()}"
        assert np.abs(truth[~nan]).min() > 0 and np.abs(truth[~nan]).max() < 1e6
        assert_rel_fro(y[~nan], truth[~nan], F32_REL_FRO, f"{what}: subnormal e8m0 multipliers")

    def test_reference_mxfp4_scale_edges_nan_and_subnormal(self):
        """e8m0 255 makes its group's outputs NaN; s = 0 and s = 1 scale by 2^-127 (a subnormal multiplier) and
        2^-126, so many dequantized weights are subnormal: with x ~ 2^120 the products are normal float32 values
        the reference must reproduce (float64 on the exact weights)."""
        args, truth = self.scale_edges_case()
        self.check_scale_edges(self.reference_grouped_gemm(*args, "mxfp4"), truth, "reference")

    @pytest.mark.usefixtures("kernel_runs")
    def test_kernel_mxfp4_scale_edges_nan_and_subnormal(self):
        """As :meth:`test_reference_mxfp4_scale_edges_nan_and_subnormal`, for the kernel (float32 x), which also
        puts its NaN where the reference does."""
        args, truth = self.scale_edges_case()
        y = self.kernel_grouped_gemm(*args, "mxfp4")
        assert np.array_equal(np.isnan(to_numpy(y)), np.isnan(to_numpy(self.reference_grouped_gemm(*args, "mxfp4"))))
        self.check_scale_edges(y, truth, "kernel")

    # --- The gradient of x --------------------------------------------------------------------------

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_gradient_of_x_is_straight_through(self, fmt, dtype, implementation):
        """:attr:`GRAD_CASE`: ``d_x[m] = d_y[m] @ wd[e(m)]``, wd dequantized and rounded to x's dtype: x's dtype,
        rows >= M zero, exactly the float ``grouped_gemm_dgrad`` on those weights (same implementation), within
        the contract's row of float64 on them and on the float32 wd."""
        counts, m_cap, K, N = self.GRAD_CASE
        x_np, w, offsets_np = w4_problem(4, counts, m_cap, K, N)
        x, (w_q, w_scale), offsets = self.array(np.nan_to_num(x_np), dtype), self.quantize(w, fmt), self.array(offsets_np)
        d_y = self.array(np.random.default_rng(5).standard_normal((m_cap, N)).astype(np.float32), dtype)
        d_x = self.x_gradient(x, w_q, offsets, w_scale, fmt, d_y, implementation)
        assert to_numpy(d_x).dtype.name == dtype and not to_numpy(d_x).astype(np.float32)[sum(counts):].any()
        wd_x = self.dequantize(w_q, w_scale, fmt, dtype)
        expected = self.OPS.grouped_gemm_dgrad(d_y, wd_x, offsets, out_dtype=dtype, implementation=implementation)
        assert_exact(d_x, expected, f"d_x {fmt} {dtype}: the float dgrad on wd in {dtype}")
        # numpy_grouped_gemm(d_y, wd^T): d_y[m] @ wd[e(m)]
        for wd, what in ((wd_x, f"wd in {dtype}"), (self.dequantize(w_q, w_scale, fmt), "float32 wd")):
            wd_t = np.swapaxes(to_numpy(wd).astype(np.float64), 1, 2)
            assert_rel_fro(d_x, numpy_grouped_gemm(d_y, wd_t, offsets), LIMITS[dtype], f"d_x {fmt} {dtype} vs {what}")

    # --- Edges, packed codes, errors ----------------------------------------------------------------

    @pytest.mark.usefixtures("kernel_runs")
    @pytest.mark.parametrize("fmt", [None, *FORMATS])
    def test_no_local_experts_gives_zeros(self, fmt):
        """``E_local = 0`` (``expert_offsets = [0]``) with rows: every row is past ``offsets[-1]``, so ``y`` is zero,
        in the reference and the kernel (:attr:`KERNEL`). The jnp reference gathered ``w[e(m)]`` from an empty
        ``w`` and failed with XLA's "Slice size at index 0 in gather op is out of range" (the float path too)."""
        x = self.array(np.ones((3, 64), np.float32), "bfloat16")
        if fmt is None:
            w, kw = self.array(np.ones((0, 4, 64), np.float32), "bfloat16"), {}
        else:
            w_q, w_scale = self.quantize(np.ones((0, 4, 64), np.float32), fmt)
            w, kw = w_q, {"w_scale": w_scale, "w_format": fmt}
        for impl in ("reference", self.KERNEL):
            y = to_numpy(self.OPS.grouped_gemm(x, w, self.array(np.zeros(1, np.int32)), implementation=impl, **kw))
            assert y.shape == (3, 4) and y.dtype == ml_dtypes.bfloat16 and not y.astype(np.float32).any(), impl

    @pytest.mark.parametrize("fmt", FORMATS)
    def test_int32_packed_codes_are_a_type_error_naming_the_uint8_view(self, fmt):
        """compressed-tensors' ``weight_packed`` is int32 ``[N, K // 8]``; given as ``w`` it is a TypeError saying to
        view it as uint8 (it was a ValueError telling the user to drop ``w_format``); int8 codes too. The uint8 view
        is the quantizer's codes: same GEMM bit for bit."""
        x, w_q, w_scale, offsets = self.problem(11, [3, 2], 6, 64, 8, fmt, "bfloat16")
        codes = to_numpy(w_q)
        packed = self.array(codes.view("<i4"))  # [E, N, K // 8]: eight codes an int32, element i at bits 4i
        gg = self.OPS.grouped_gemm
        with pytest.raises(TypeError, match=rf"grouped_gemm: w must have dtype uint8 for w_format='{fmt}' .*view it as "
                                            r"uint8.*got w.dtype=int32"):
            gg(x, packed, offsets, w_scale=w_scale, w_format=fmt)
        with pytest.raises(TypeError, match=r"grouped_gemm: w must have dtype uint8 .*got w.dtype=int8"):
            gg(x, self.array(codes.view(np.int8)), offsets, w_scale=w_scale, w_format=fmt)
        unpacked = self.array(to_numpy(packed).view(np.uint8))
        assert_exact(gg(x, unpacked, offsets, w_scale=w_scale, w_format=fmt),
                     gg(x, w_q, offsets, w_scale=w_scale, w_format=fmt), "the uint8 view of weight_packed")

    def test_bad_inputs(self):
        """Each refusal names the op and what came; the valid call beside them serves."""
        bf16 = ml_dtypes.bfloat16
        # the shapes of test_int32_packed_codes_are_a_type_error_naming_the_uint8_view: JAX's eager reference has
        # compiled for them (a second or two for new ones)
        x = self.array(np.ones((6, 64), np.float32), "bfloat16")
        offsets = self.array(np.array([0, 2, 4], np.int32))
        w_q = self.array(np.zeros((2, 8, 32), np.uint8))
        s8, sbf = self.array(np.zeros((2, 8, 2), np.uint8)), self.array(np.zeros((2, 8, 2), bf16))
        gg = self.OPS.grouped_gemm
        with pytest.raises(ValueError, match=r"grouped_gemm: w_format must be one of \('mxfp4', 'int4'\) for uint8 w"):
            gg(x, w_q, offsets, w_scale=s8)
        for fmt in ("fp4", "nf4"):
            with pytest.raises(ValueError, match="grouped_gemm: w_format must be one of"):
                gg(x, w_q, offsets, w_scale=s8, w_format=fmt)
        with pytest.raises(ValueError, match="grouped_gemm: w_format must be None unless w holds 4-bit packed codes"):
            gg(x, self.array(np.ones((2, 8, 64), np.float32), "bfloat16"), offsets, w_format="int4")
        for fmt, s in (("mxfp4", s8), ("int4", sbf)):
            with pytest.raises(ValueError, match=r"grouped_gemm: K \(=x.shape\[1\]\) must be a multiple of 32"):
                gg(self.array(np.ones((6, 48), np.float32), "bfloat16"), self.array(np.zeros((2, 8, 24), np.uint8)),
                   offsets, w_scale=s[..., :1], w_format=fmt)
            with pytest.raises(ValueError, match=r"grouped_gemm: w must be \[E, N, K // 2\] uint8 .* \(=64\); got "
                                                 r"w.shape=\(2, 8, 64\)"):
                gg(x, self.array(np.zeros((2, 8, 64), np.uint8)), offsets, w_scale=s, w_format=fmt)
        with pytest.raises(ValueError, match=r"grouped_gemm: w_scale must be given for int4 w"):
            gg(x, w_q, offsets, w_format="int4")
        with pytest.raises(ValueError, match=r"grouped_gemm: w_scale must be \[E, N, K // 32\] = \(2, 8, 2\) bfloat16"):
            gg(x, w_q, offsets, w_scale=self.array(np.zeros((2, 8, 1), bf16)), w_format="int4")
        with pytest.raises(TypeError, match="grouped_gemm: w_scale must have dtype uint8 for mxfp4"):
            gg(x, w_q, offsets, w_scale=sbf, w_format="mxfp4")
        for s in (s8, self.array(np.zeros((2, 8, 2), np.float32))):
            with pytest.raises(TypeError, match="grouped_gemm: w_scale must have dtype bfloat16 for int4"):
                gg(x, w_q, offsets, w_scale=s, w_format="int4")
        x8 = self.array(np.ones((6, 64), np.float32), "float8_e4m3fn")
        for fmt, s in (("mxfp4", s8), ("int4", sbf)):
            with pytest.raises(TypeError, match=rf"grouped_gemm: x must have dtype float32 or bfloat16 or float16 with "
                                                rf"{fmt} w"):
                gg(x8, w_q, offsets, w_scale=s, w_format=fmt)
        with pytest.raises(ValueError, match="grouped_gemm: x_scale must be None for int4 w"):
            gg(x, w_q, offsets, x_scale=self.array(np.ones((), np.float32)), w_scale=sbf, w_format="int4")
        with pytest.raises(ValueError, match=r"grouped_gemm: expert_offsets must be \[E \+ 1\] = \(3,\)"):
            gg(x, w_q, offsets[:2], w_scale=sbf, w_format="int4")
        assert tuple(to_numpy(gg(x, w_q, offsets, w_scale=sbf, w_format="int4")).shape) == (6, 8)  # the valid call
