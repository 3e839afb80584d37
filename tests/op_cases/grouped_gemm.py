"""The cases of the grouped GEMM forward (CONTRACT.md sections 4, 7) that every backend passes: ragged and empty
experts, every row on one expert, M = 1, odd K and N (K and column tails), unused capacity (rows >= M, NaN in x:
never read, zero in y), M_cap = 0, the float dtypes and every FP8 scale layout, block scales per K block; and, for
the kernels (:class:`GroupedGemmKernelCases`), block scales per column tile, the named tile-edge bugs with exact
answers (N not a multiple of the tile, a row tile straddling two experts, unused capacity poisoned), every
empty-expert pattern, the grouped launch order, the tuned table's FP8 block entries, and the dispatch.

Subclassed by ``tests/test_grouped_gemm.py`` (the torch op against the jnp op, through the public APIs with the
default implementation: the references on the CPU), ``tests/test_pallas_grouped_gemm.py`` (the Pallas-Triton
kernel against the jnp reference) and ``tests/test_triton_grouped_gemm.py`` (the Triton kernel against the torch
reference). A subclass mixes in the arrays of its framework (``op_cases.TorchArrays`` / ``JaxArrays``), names its
framework's public module (:attr:`GroupedGemmCases.OPS`: the FP8 quantizers) and implements the hooks.

Outputs are compared with a float64 numpy loop on the values the GEMM sees (the dequantized inputs for FP8) and
with the judge's (tolerances of ``tests/tolerances.py``); the checks against numpy run on the judge's result too.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from common import DEVICE
from fp8_block_case import blockwise_expected, column_block_case
from op_cases import ClassParams
from tolerances import BF16_REL_FRO, F32_REL_FRO, FP8_REL_FRO, assert_exact, assert_rel_fro, rel_fro, to_numpy

#: The float dtypes' rows of CONTRACT.md section 7: float32 output within F32_REL_FRO, 16-bit within BF16_REL_FRO.
LIMITS = {"float32": F32_REL_FRO, "bfloat16": BF16_REL_FRO, "float16": BF16_REL_FRO}

#: name -> (rows per expert, M_cap, K, N); the comment says which edge. A backend runs those it lists in
#: ``SHAPES``.
GEMM_SHAPES = {
    "one-row": ([1], 1, 64, 32),  # M = 1 (decode), one expert
    "odd-K-N": ([3, 0, 5], 8, 33, 17),  # odd K and N (masked K tail and column tail), an empty expert
    "prime-E-empties": ([0, 4, 0, 0, 9, 1, 0], 16, 64, 48),  # prime E = 7, empty experts, unused capacity
    "all-on-one": ([0, 0, 12, 0], 12, 128, 64),  # every row on one expert, K over two 64-wide K steps
    "unused-capacity": ([2, 3], 32, 32, 16),  # rows >= M (NaN in x) stay zero
    "several-tiles": ([20, 3, 0, 41], 70, 96, 160),  # experts over several row tiles, two column tiles, straddling
    "many-tiles": ([30, 1, 0, 40], 80, 48, 144),  # several row tiles per expert, N over two column tiles
}

ACT_SCALES = ["per_tensor", "per_token", "per_token_group"]
WEIGHT_LAYOUTS = ["per_expert", "per_channel", "block"]


def numpy_grouped_gemm(x: np.ndarray, w: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """float64 ``y[m] = x[m] @ w[e(m)].T`` expert by expert; rows outside ``[offsets[0], offsets[-1])`` zero (never
    read: NaN there stays out). Independent of every implementation."""
    x, w, offsets = (to_numpy(a) for a in (x, w, offsets))
    y = np.zeros((x.shape[0], w.shape[1]))
    for e in range(w.shape[0]):
        s, t = offsets[e], offsets[e + 1]
        y[s:t] = x[s:t].astype(np.float64) @ w[e].astype(np.float64).T
    return y


def gemm_problem(seed: int, counts, m_cap: int, K: int, N: int, poison: bool = True):
    """``(x [m_cap, K], w [E, N, K], offsets [E + 1])`` float32 / int32 in numpy: x ~ N(0, 1), w ~ N(0, 1/K)
    (outputs O(1)), offsets from ``counts``. Unused rows of x (``>= sum(counts)``) are NaN when ``poison``: they
    must never be read."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m_cap, K)).astype(np.float32)
    w = (rng.standard_normal((len(counts), N, K)) / np.sqrt(K)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    assert offsets[-1] <= m_cap
    if poison:
        x[offsets[-1]:] = np.nan
    return x, w, offsets


def empty_expert_patterns(sizes) -> dict[str, list[int]]:
    """Every pattern of empty / non-empty experts: its id (``"0101"``) -> the rows per expert (``sizes[e]`` where the
    pattern has a 1, else 0)."""
    return {"".join(map(str, p)): [bit * s for bit, s in zip(p, sizes)]
            for p in itertools.product([0, 1], repeat=len(sizes))}


def check_rows(y, shape: tuple, dtype: str, M: int, what: str) -> None:
    """``y`` of ``shape`` and ``dtype``, every row finite (written, no NaN leaked), rows ``>= M`` exactly zero."""
    yn = to_numpy(y)
    assert yn.shape == shape and yn.dtype.name == dtype, f"{what}: {yn.dtype} {yn.shape}, want {dtype} {shape}"
    y32 = yn.astype(np.float32)
    assert np.isfinite(y32).all(), f"{what}: {y32.size - np.isfinite(y32).sum()} non-finite values"
    assert not y32[M:].any(), f"{what}: rows >= M must be zero"


class GroupedGemmCases(ClassParams):
    """The grouped GEMM forward's cases, for any implementation.

    Hooks: ``array`` (the framework mixin), :attr:`OPS` (the framework's quantizers), :meth:`grouped_gemm` (the
    backend under test) and :meth:`reference_grouped_gemm` (its judge); :attr:`SHAPES`, :attr:`FLOAT_DTYPES`,
    :attr:`FP8_CASE`; the ``launch_order`` fixture (a backend with launch orders runs the cases that take it under
    each of them).
    """

    #: The framework's public module (``moe_torch`` / ``moe_pallas``): its FP8 quantizers make the FP8 inputs.
    OPS = None
    #: The keys of :data:`GEMM_SHAPES` this backend runs.
    SHAPES: tuple[str, ...] = ("one-row", "odd-K-N", "prime-E-empties", "all-on-one", "unused-capacity")
    #: The input dtypes of :meth:`test_float`.
    FLOAT_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
    #: The FP8 problem: (rows per expert, M_cap, K, N, the activations' group size).
    FP8_CASE = ([5, 0, 11, 3], 24, 256, 160, 128)  # N not a multiple of 128: a partial weight block
    #: The bound of :meth:`test_fp8_block_scales_applied_per_k_block` for the backend's float32 output.
    BLOCKWISE_LIMIT = F32_REL_FRO
    CLASS_PARAMS = {"shape": "SHAPES", "dtype": "FLOAT_DTYPES"}

    @pytest.fixture
    def launch_order(self):
        """The launch order the cases that take this fixture run under: a backend with several overrides it with
        a parametrized fixture that applies each to its default config (here: the backend's only one)."""
        return None

    def grouped_gemm(self, x, w, offsets, x_scale=None, w_scale=None, out_dtype: str | None = None, config=None):
        """The backend under test (``out_dtype`` a key of ``common.TORCH_DTYPES`` / ``JNP_DTYPES``; None: the
        op's default). ``config=None``: the public op with the backend's own config; else the kernel with that
        launch config."""
        raise NotImplementedError

    def reference_grouped_gemm(self, x, w, offsets, x_scale, w_scale, out_dtype: str):
        """The judge's output for the backend's arrays."""
        raise NotImplementedError

    def quantize_x(self, x_np: np.ndarray, how: str, group_size: int, M: int):
        """``x_np`` as FP8 codes and their scale (``[]`` per-tensor, from the used rows; ``[M_cap, 1]``
        per-token; ``[M_cap, K // group_size]``), with the framework's quantizers; the scales of rows ``>= M``
        NaN (unused capacity: garbage, never read)."""
        ops, x = self.OPS, self.array(x_np)
        if how == "per_tensor":
            s = self.array(np.array(np.abs(x_np[:M]).max() / 448.0, np.float32))
            return ops.static_quant_fp8(x, s), s
        xq, xs = ops.per_token_quant_fp8(x) if how == "per_token" else ops.per_token_group_quant_fp8(x, group_size)
        xs_np = to_numpy(xs).copy()
        xs_np[M:] = np.nan
        return xq, self.array(xs_np)

    @pytest.mark.usefixtures("launch_order")
    def test_float(self, shape, dtype):
        """Float inputs, the default output (x's dtype) and a float32 one: each of the right dtype and shape, every
        row finite, rows >= M exactly zero though x is NaN there; each within its dtype's row of CONTRACT.md
        section 7 (F32_REL_FRO for float32) of a float64 loop on the same (rounded) values and of the judge's
        float32 output, which must pass the float32 checks too; the inputs untouched."""
        counts, m_cap, K, N = GEMM_SHAPES[shape]
        x_np, w_np, off_np = gemm_problem(len(shape) * 7 + K, counts, m_cap, K, N)
        x, w, offsets = self.array(x_np, dtype), self.array(w_np, dtype), self.array(off_np)
        before = [to_numpy(a).copy() for a in (x, w, offsets)]
        M = int(off_np[-1])
        ref64 = numpy_grouped_gemm(to_numpy(x).astype(np.float64), to_numpy(w).astype(np.float64), off_np)
        want = self.reference_grouped_gemm(x, w, offsets, None, None, "float32")
        check_rows(want, (m_cap, N), "float32", M, f"judge {shape} {dtype}")
        assert_rel_fro(want, ref64, F32_REL_FRO, f"judge {shape} {dtype} vs float64")
        for out_dtype in (None, "float32"):  # None: the op's default, x's dtype
            got_dtype = out_dtype or dtype
            limit, what = LIMITS[got_dtype], f"{shape} {dtype} -> {got_dtype}"
            y = self.grouped_gemm(x, w, offsets, out_dtype=out_dtype)
            check_rows(y, (m_cap, N), got_dtype, M, what)
            assert_rel_fro(y, ref64, limit, f"{what} vs float64")
            assert_rel_fro(y, want, limit, f"{what} vs the judge's float32 output")
        for a, b in zip((x, w, offsets), before):
            assert_exact(a, b, "input unchanged")  # bit patterns: the NaN rows compare equal

    @pytest.mark.usefixtures("launch_order")
    @pytest.mark.parametrize("act,layout", list(itertools.product(ACT_SCALES, WEIGHT_LAYOUTS)))
    def test_fp8_every_scale_layout(self, act, layout):
        """FP8 codes x scales (:attr:`FP8_CASE`: an empty expert, a partial weight-scale block; NaN codes and
        scales in rows >= M): the default bf16 output finite, rows >= M zero, within FP8_REL_FRO of float64 on the
        dequantized inputs, within 0.1 of the unquantized product and within BF16_REL_FRO of the judge's float32
        output; the float32 output within F32_REL_FRO of the judge's (the product of the dequantized inputs:
        only float32 rounding differs, block scales per K block included); the judge within FP8_REL_FRO of
        float64 on the dequantized inputs."""
        counts, m_cap, K, N, group = self.FP8_CASE
        x_np, w_np, off_np = gemm_problem(11, counts, m_cap, K, N)
        M = int(off_np[-1])
        xq, xs = self.quantize_x(x_np, act, group, M)
        wq, ws = self.OPS.quantize_weight_fp8(self.array(w_np), layout)
        offsets = self.array(off_np)
        deq64 = numpy_grouped_gemm(to_numpy(self.OPS.dequantize_fp8(xq, xs)).astype(np.float64),
                                   to_numpy(self.OPS.dequantize_weight_fp8(wq, ws)).astype(np.float64), off_np)
        what = f"fp8 {act} x {layout}"
        y = self.grouped_gemm(xq, wq, offsets, xs, ws)
        check_rows(y, (m_cap, N), "bfloat16", M, what)
        assert_rel_fro(y, deq64, FP8_REL_FRO, f"{what}: bf16 vs float64 on the dequantized inputs")
        assert_rel_fro(y, numpy_grouped_gemm(x_np, w_np, off_np), 0.1, f"{what}: near the unquantized product")
        want32 = to_numpy(self.reference_grouped_gemm(xq, wq, offsets, xs, ws, "float32"))[:M]
        assert_rel_fro(want32, deq64[:M], FP8_REL_FRO, f"judge {what} vs float64 on the dequantized inputs")
        assert_rel_fro(to_numpy(y)[:M], want32, BF16_REL_FRO, f"{what}: bf16 vs the judge")
        y32 = self.grouped_gemm(xq, wq, offsets, xs, ws, out_dtype="float32")
        check_rows(y32, (m_cap, N), "float32", M, f"{what} float32")
        assert_rel_fro(to_numpy(y32)[:M], want32, F32_REL_FRO, f"{what}: float32 vs the judge")

    def test_fp8_block_scales_applied_per_k_block(self):
        """With block scales the partial sum of each 128-wide K block gets its own scale: the two K blocks'
        scales differ by ~2^20, checked against the blockwise formula in float64 (a kernel applying one scale to
        the whole sum is off by orders of magnitude), for the backend (within :attr:`BLOCKWISE_LIMIT`) and the
        judge. The CPU computes each block's partial sum in float32: F32_REL_FRO; on the GPU the judge's
        default implementation may run on Hopper's FP8 tensor cores, which accumulate inside a 128-wide K block
        with about 14 bits (DeepSeek-V3 report, 3.3.2; README "Numerics notes": the Mosaic GEMM gave 1.23e-4
        here on the H200), bounded by CONTRACT.md section 7's FP8_REL_FRO."""
        rng = np.random.default_rng(0)
        N = 128
        x = np.concatenate([rng.standard_normal((4, 128)), 1e-3 * rng.standard_normal((4, 128))], 1).astype(np.float32)
        w = np.concatenate([rng.standard_normal((1, N, 128)), 1e3 * rng.standard_normal((1, N, 128))], 2).astype(np.float32)
        xq, xs = self.OPS.per_token_group_quant_fp8(self.array(x), 128)
        wq, ws = self.OPS.quantize_weight_fp8(self.array(w), "block")
        qx, qw = to_numpy(xq).astype(np.float64), to_numpy(wq).astype(np.float64)[0]
        sx, sw = to_numpy(xs).astype(np.float64), to_numpy(ws).astype(np.float64)[0]
        blockwise = sum((qx[:, b * 128:(b + 1) * 128] @ qw[:, b * 128:(b + 1) * 128].T) * sx[:, b:b + 1] * sw[0, b]
                        for b in range(2))
        # A misapplied block scale (the activations' K-block 0 scale for both blocks) is an O(1) error: the
        # bounds below must stay far under it, or the test could not fail.
        misapplied = sum((qx[:, b * 128:(b + 1) * 128] @ qw[:, b * 128:(b + 1) * 128].T) * sx[:, :1] * sw[0, b]
                         for b in range(2))
        assert rel_fro(misapplied, blockwise) > 0.5
        offsets = self.array(np.array([0, 4], np.int32))
        y = self.grouped_gemm(xq, wq, offsets, xs, ws, out_dtype="float32")
        assert_rel_fro(y, blockwise, self.BLOCKWISE_LIMIT, "block scales per K block")
        want = self.reference_grouped_gemm(xq, wq, offsets, xs, ws, "float32")
        assert_rel_fro(want, blockwise, F32_REL_FRO if DEVICE == "cpu" else FP8_REL_FRO, "judge: block scales")

    def test_no_rows_at_all(self):
        """Every expert empty (offsets all 0), x all NaN: every row is zero, nothing is read; the judge's too."""
        x_np, w_np, off_np = gemm_problem(1, [0, 0, 0], 8, 32, 16)
        x, w, offsets = self.array(x_np, "bfloat16"), self.array(w_np, "bfloat16"), self.array(off_np)
        check_rows(self.grouped_gemm(x, w, offsets), (8, 16), "bfloat16", 0, "no rows")
        check_rows(self.reference_grouped_gemm(x, w, offsets, None, None, "bfloat16"), (8, 16), "bfloat16", 0,
                   "judge: no rows")

    def test_zero_capacity(self):
        """M_cap = 0: an empty ``[0, N]`` result, not an error; the judge's too."""
        x, w = self.array(np.zeros((0, 16), np.float32)), self.array(np.ones((2, 8, 16), np.float32))
        offsets = self.array(np.zeros(3, np.int32))
        assert tuple(to_numpy(self.grouped_gemm(x, w, offsets)).shape) == (0, 8)
        assert tuple(to_numpy(self.reference_grouped_gemm(x, w, offsets, None, None, "float32")).shape) == (0, 8)


class GroupedGemmKernelCases(GroupedGemmCases):
    """:class:`GroupedGemmCases` plus the kernel's own edges: forced launch configs, the kernel's output alone
    (:meth:`launch`), the named tile-edge bugs with exact answers, every empty-expert pattern, the grouped launch
    order, the tuned table's FP8 block entries and the dispatch to the kernel.

    Hooks: :meth:`forced_config`, :meth:`tile_config`, :meth:`launch`, :meth:`launch_order_table`,
    :meth:`refuse_kernel`, :meth:`tuned_lookup`; :attr:`KERNEL`, :attr:`CONFIG`, :attr:`KERNEL_ZEROES_UNUSED_ROWS`;
    the attributes below name each case's parameters (a backend runs the ones it lists).
    """

    #: The column tiles of :meth:`test_fp8_block_scale_of_each_column_tile`.
    BLOCK_NS: tuple[int, ...] = (128,)
    #: The public op's ``implementation=`` that runs the kernel under test.
    KERNEL: str = ""
    #: The backend's launch config class (``GroupedGemmConfig``).
    CONFIG = None
    #: Whether the kernel itself writes zeros to rows ``>= M``; False: it never writes them (a pass after it zeroes
    #: them), and :meth:`launch` shows them NaN.
    KERNEL_ZEROES_UNUSED_ROWS = True
    #: The input kinds of :meth:`test_bug_n_not_multiple_of_tile` (:meth:`exact_inputs`).
    N_TAIL_KINDS: tuple[str, ...] = ("float32", "bfloat16")
    #: The configs (None: the kernel's default) :meth:`test_bug_n_not_multiple_of_tile` launches the kernel alone with.
    N_TAIL_LAUNCHES: tuple = (None,)
    #: The input kinds and ``block_m`` (None: the op's default config) of
    #: :meth:`test_bug_row_tile_straddles_two_experts`.
    STRADDLE_KINDS: tuple[str, ...] = ("float32",)
    STRADDLE_BLOCK_MS: tuple = (4,)
    #: :meth:`test_bug_unused_capacity_poisoned`'s cases: id -> (input kind, FP8 activation scale, weight scale).
    UNUSED_CASES: dict = {"bfloat16": ("bfloat16", None, None)}
    #: Its output dtype (None: the op's default, x's dtype) and the configs it launches the kernel alone with.
    UNUSED_OUT_DTYPE: str | None = "float32"
    UNUSED_LAUNCHES: tuple = (None,)
    #: :meth:`test_every_empty_expert_pattern`'s patterns (:func:`empty_expert_patterns`), ``(M_cap, K, N)`` and tiles
    #: (``(block_m, block_n, block_k)``; None: the kernel's default config).
    EMPTY_PATTERNS: dict = empty_expert_patterns((5, 19, 1, 12))
    EMPTY_PATTERN_SHAPE = (40, 32, 16)
    EMPTY_PATTERN_TILES: tuple | None = None
    #: :meth:`test_launch_order_is_a_bijection`'s cases: id -> (work items, column tiles, group_m).
    LAUNCH_ORDER_CASES: dict = {"9x3-g2": (9, 3, 2)}
    #: How many times ``implementation=None`` calls the kernel on a GPU in :meth:`test_dispatch` (None: not checked).
    DEFAULT_KERNEL_CALLS_ON_GPU: int | None = None
    CLASS_PARAMS = {**GroupedGemmCases.CLASS_PARAMS, "block_n": "BLOCK_NS", "tail_kind": "N_TAIL_KINDS",
                    "straddle_kind": "STRADDLE_KINDS", "straddle_block_m": "STRADDLE_BLOCK_MS",
                    "unused_case": "UNUSED_CASES", "pattern": "EMPTY_PATTERNS", "order_case": "LAUNCH_ORDER_CASES"}

    def forced_config(self, block_m: int, block_n: int, block_k: int):
        """A launch config of ``block_m x block_n`` tiles over ``block_k``-wide K steps."""
        raise NotImplementedError

    def tile_config(self, block_m: int, block_n: int, block_k: int, launch_order):
        """A launch config of small tiles (the tile-edge cases) under ``launch_order`` (the fixture's value)."""
        raise NotImplementedError

    def launch(self, x, w, offsets, x_scale, w_scale, out_dtype: str | None, config):
        """The kernel alone (``config=None``: its default config; ``out_dtype=None``: x's dtype, bf16 for FP8), nothing
        after it: what it does not write is NaN (:attr:`KERNEL_ZEROES_UNUSED_ROWS`), and where the backend can see
        writes outside ``[M_cap, N]`` (guard rows and columns around the output) they fail here."""
        raise NotImplementedError

    def launch_order_table(self, n_items: int, n_cols: int, group_m: int) -> np.ndarray:
        """``[n_items, n_cols]``: the program the grouped launch order assigns each (work item, column tile); -1
        where none."""
        raise NotImplementedError

    #: ``(module, attribute)``: what the public op calls to run the kernel (:meth:`refuse_kernel` replaces it).
    KERNEL_ENTRY: tuple = ()

    def refuse_kernel(self, monkeypatch) -> list:
        """Make the public op's call of the kernel (:attr:`KERNEL_ENTRY`) raise ``NotImplementedError("test: kernel
        refused")``; the list its calls are appended to."""
        calls = []

        def refuse(*args, **kwargs):
            calls.append(args)
            raise NotImplementedError("test: kernel refused")

        monkeypatch.setattr(*self.KERNEL_ENTRY, refuse)
        return calls

    def tuned_lookup(self, tmp_path, monkeypatch, entries, requests) -> list:
        """Store ``entries`` (``(N, K, M_cap, dtype, config dict)`` each, E = 32) as the tuned table of
        ``common.TEST_SPEC``'s device and look up each FP8 request ``(M_cap, N, K, x_group, w_block)`` (E = 32) for
        that device: the configs found (the cache of tables cleared after)."""
        raise NotImplementedError

    def exact_inputs(self, kind: str, x: np.ndarray, w: np.ndarray):
        """``(x, w, x_scale, w_scale)`` of small integers / powers of two, exact in every kind (``"fp8"``: the codes
        with a per-tensor scale 1 and per-expert scales 1)."""
        if kind == "fp8":
            return (self.array(x, "float8_e4m3fn"), self.array(w, "float8_e4m3fn"),
                    self.array(np.array(1.0, np.float32)), self.array(np.ones(w.shape[0], np.float32)))
        return self.array(x, kind), self.array(w, kind), None, None

    def check_launch(self, y, M: int, what: str) -> None:
        """The kernel's own output (:meth:`launch`): rows ``< M`` finite, rows ``>= M`` zero or, for a kernel that
        leaves them to a later pass, never written (NaN)."""
        yn = to_numpy(y).astype(np.float32)
        assert np.isfinite(yn[:M]).all(), f"{what}: {M * yn.shape[1] - np.isfinite(yn[:M]).sum()} non-finite values"
        if self.KERNEL_ZEROES_UNUSED_ROWS:
            assert not yn[M:].any(), f"{what}: rows >= M must be zero"
        else:
            assert np.isnan(yn[M:]).all(), f"{what}: rows >= M never written"

    def test_fp8_block_scale_of_each_column_tile(self, block_n):
        """Each column tile reads its own 128 x 128 weight block's scale per K step (tiles no wider than a block:
        one scale a tile, folded into the row scales; wider ones a scale per column): every block of w gets its
        own scale (2^-12 .. 2^12, so a tile reading its neighbour's is off by >= 4x), over 3 column blocks (the
        last one partial) x 2 K blocks and 2 experts, against the blockwise formula in float64."""
        x, w, off = column_block_case()
        xq, xs = self.OPS.per_token_group_quant_fp8(self.array(x), 128)
        wq, ws = self.OPS.quantize_weight_fp8(self.array(w), "block")
        expected = blockwise_expected(*(to_numpy(a) for a in (xq, wq, xs, ws)), off)
        y = self.grouped_gemm(xq, wq, self.array(off), xs, ws, out_dtype="float32",
                              config=self.forced_config(16, block_n, 128))
        assert_rel_fro(y, expected, F32_REL_FRO, f"block_n={block_n}")

    # ----------------------------------------------------------------------------------------- named bug cases

    def test_bug_n_not_multiple_of_tile(self, tail_kind):
        """(1) N = 33 is not a multiple of the column tile: 4 rows over 2 experts, row i of x is 2^i, weights all
        ones, K = 64 -> y[i, :] = 64 * 2^i exactly, in the op's default output dtype, from the op (its default config:
        one column tile with masked columns) and from the kernel alone with each config of :attr:`N_TAIL_LAUNCHES`
        (16-wide tiles: three, the last partial), which writes nothing past column 32 nor past the last row where the
        backend can see it (:meth:`launch`)."""
        M, K, N = 4, 64, 33
        x = np.repeat(np.exp2(np.arange(M, dtype=np.float32))[:, None], K, axis=1)
        xt, wt, xs, ws = self.exact_inputs(tail_kind, x, np.ones((2, N, K), np.float32))
        offsets = self.array(np.array([0, 2, 4], np.int32))
        want = np.repeat(64 * np.exp2(np.arange(M, dtype=np.float32))[:, None], N, axis=1)
        y = to_numpy(self.grouped_gemm(xt, wt, offsets, xs, ws))
        assert y.shape == (M, N), y.shape
        assert_exact(y, want.astype(y.dtype), f"{tail_kind}: y[i, :] = 64 * 2^i")
        for config in self.N_TAIL_LAUNCHES:
            y = to_numpy(self.launch(xt, wt, offsets, xs, ws, None, config))
            assert_exact(y, want.astype(y.dtype), f"{tail_kind}, the kernel alone, config {config}: y[i, :] = 64 * 2^i")

    def test_bug_row_tile_straddles_two_experts(self, straddle_kind, straddle_block_m, launch_order):
        """(2) 2 experts x 3 rows (M = 6), K = N = 16, w[g] = (g + 1) * identity, row i of x constant i + 1 ->
        y[i, :] = (i + 1) * (g(i) + 1) in float32: with ``block_m = 4`` the first row tile holds rows 0-2 (expert 0)
        and row 3 (expert 1), so y[3, :] = 8 only if row 3 uses expert 1's weights (``block_m`` None: the op's
        default config)."""
        M, K, N = 6, 16, 16
        x = np.repeat(np.arange(1, M + 1, dtype=np.float32)[:, None], K, axis=1)
        w = np.stack([(g + 1) * np.eye(N, K, dtype=np.float32) for g in range(2)])
        xt, wt, xs, ws = self.exact_inputs(straddle_kind, x, w)
        offsets = self.array(np.array([0, 3, 6], np.int32))
        config = None
        if straddle_block_m is not None:
            config = self.tile_config(straddle_block_m, 16, 32 if straddle_kind == "fp8" else 16, launch_order)
        y = to_numpy(self.grouped_gemm(xt, wt, offsets, xs, ws, out_dtype="float32", config=config))
        expert = np.array([0, 0, 0, 1, 1, 1])
        want = np.repeat(((np.arange(M) + 1) * (expert + 1)).astype(np.float32)[:, None], N, axis=1)
        assert float(y[3, 0]) == 8.0, f"row 3 must use expert 1's weights; got {float(y[3, 0])}"
        assert_exact(y, want, "y[i, :] = (i + 1) * (g(i) + 1)")

    @pytest.mark.usefixtures("launch_order")
    def test_bug_unused_capacity_poisoned(self, unused_case):
        """(3) capacity 32 with 16 valid rows over 3 experts (one empty), the unused rows of x (codes and scales for
        FP8) NaN: the op's rows < 16 finite, within the output dtype's row of the judge's (and, float inputs, of
        float64 on the same values), rows >= 16 zero; the kernel alone with each config of :attr:`UNUSED_LAUNCHES`
        the same (its default config: the op's valid rows bit for bit), its rows >= 16 zero or never written
        (:meth:`check_launch`). FP8: scales applied once after the K loop (per-token x per-channel) or inside it
        (per-token-group x block)."""
        kind, x_layout, w_layout = unused_case
        m_cap, M, K, N = 32, 16, 128, 48
        x_np, w_np, off_np = gemm_problem(5, [6, 0, 10], m_cap, K, N)
        assert np.isnan(x_np[M:]).all() and off_np[-1] == M
        offsets = self.array(off_np)
        if kind == "fp8":
            xq, xs = self.quantize_x(np.nan_to_num(x_np), x_layout, 128, M)  # the scales of rows >= M NaN
            codes = to_numpy(xq).copy()
            codes.view(np.uint8)[M:] = 0x7F  # e4m3fn NaN codes
            xq = self.array(codes)
            wq, ws = self.OPS.quantize_weight_fp8(self.array(w_np), w_layout)
            ref64 = None
        else:
            xq, xs, wq, ws = self.array(x_np, kind), None, self.array(w_np, kind), None
            ref64 = numpy_grouped_gemm(to_numpy(xq).astype(np.float64), to_numpy(wq).astype(np.float64), off_np)
        out = self.UNUSED_OUT_DTYPE
        got_dtype = out or ("bfloat16" if kind == "fp8" else kind)
        limit, what = LIMITS[got_dtype], f"{kind} {x_layout} x {w_layout} -> {got_dtype}"
        want = to_numpy(self.reference_grouped_gemm(xq, wq, offsets, xs, ws, got_dtype))
        y = self.grouped_gemm(xq, wq, offsets, xs, ws, out_dtype=out)
        check_rows(y, (m_cap, N), got_dtype, M, what)
        assert_rel_fro(to_numpy(y)[:M], want[:M], limit, f"{what}: valid rows vs the judge")
        if ref64 is not None:
            assert_rel_fro(y, ref64, limit, f"{what} vs float64")
        for config in self.UNUSED_LAUNCHES:
            v = self.launch(xq, wq, offsets, xs, ws, out, config)
            self.check_launch(v, M, f"{what}, the kernel alone, config {config}")
            if config is None:  # the op's own config: the same sums
                assert_exact(to_numpy(v)[:M], to_numpy(y)[:M], f"{what}: the kernel alone, valid rows")
            else:
                assert_rel_fro(to_numpy(v)[:M], want[:M], limit, f"{what}, config {config}: valid rows vs the judge")
                if ref64 is not None:
                    assert_rel_fro(to_numpy(v)[:M], ref64[:M], limit, f"{what}, config {config} vs float64")

    # ------------------------------------------------------------------------------- the tile-to-expert mapping

    def test_every_empty_expert_pattern(self, pattern, launch_order):
        """Every pattern of empty / non-empty experts (tokamax's idea; :attr:`EMPTY_PATTERNS`), sizes straddling the
        row tiles, the capacity left over NaN-poisoned: the kernel alone (:meth:`launch`) writes every valid row with
        its expert's weights (within F32_REL_FRO of float64) and leaves the rows >= M zero or never written."""
        m_cap, K, N = self.EMPTY_PATTERN_SHAPE
        x_np, w_np, off_np = gemm_problem(sum(pattern), pattern, m_cap, K, N)
        tiles = self.EMPTY_PATTERN_TILES
        config = None if tiles is None else self.tile_config(*tiles, launch_order)
        y = self.launch(self.array(x_np), self.array(w_np), self.array(off_np), None, None, "float32", config)
        M = int(off_np[-1])
        self.check_launch(y, M, f"counts {pattern}")
        assert_rel_fro(to_numpy(y)[:M], numpy_grouped_gemm(x_np, w_np, off_np)[:M], F32_REL_FRO, f"counts {pattern}")

    def test_launch_order_is_a_bijection(self, order_case):
        """The grouped launch order maps programs ``[0, n_items * n_cols)`` one-to-one onto (work item, column
        tile): group_m = G > 1 is the tutorial's order (program ``t`` belongs to group ``t // (G * n_cols)`` of work
        items ``[G * group, +G)``, work item fastest inside, the last group smaller when G does not divide n_items);
        group_m = 1, where a backend launches through it, the default 2-D grid's order (work item fastest)."""
        n_items, n_cols, group_m = order_case
        order = self.launch_order_table(n_items, n_cols, group_m)
        assert sorted(order.ravel().tolist()) == list(range(n_items * n_cols)), "a permutation: every tile once"
        p, pid_n = np.meshgrid(np.arange(n_items), np.arange(n_cols), indexing="ij")
        if group_m == 1:
            np.testing.assert_array_equal(order, pid_n * n_items + p)
        else:
            g = p // group_m
            size = np.minimum(n_items - g * group_m, group_m)
            np.testing.assert_array_equal(order, g * group_m * n_cols + pid_n * size + p % group_m)

    # ------------------------------------------------------------------------------- tuned configs and dispatch

    def test_tuned_fp8_block_entries_first_then_fp8(self, tmp_path, monkeypatch):
        """FP8 with 128 x 128 weight blocks takes the nearest M_cap (in log2) among its own tuned entries
        (``"fp8_block"``) and the per-token ``"fp8"`` ones, its own at equal distance (an ``fp8_block`` entry tuned at
        M=16384 alone must not replace the ``fp8`` one of M=256 there), and the ``fp8`` ones where it has none for the
        N and K; per-token(-group) requests never take ``fp8_block`` entries."""
        per_token = dict(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4)
        small = dict(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=3)
        block = dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)
        entries = [(4096, 7168, 16384, "fp8", per_token), (4096, 7168, 256, "fp8", small),
                   (4096, 7168, 16384, "fp8_block", block), (7168, 2048, 16384, "fp8", per_token)]
        cases = [((16384, 4096, 7168, 128, True), block, "block weights: its own entry"),
                 ((16384, 4096, 7168, None, False), per_token, "per-token: never the fp8_block entry"),
                 ((16384, 4096, 7168, 128, False), per_token, "per-token-group: never the fp8_block entry"),
                 ((16384, 7168, 2048, 128, True), per_token, "block weights without an entry of their own: fp8's"),
                 ((256, 4096, 7168, 128, True), small, "M=256: the fp8 entry of 256 is nearer than fp8_block's 16384"),
                 ((4096, 4096, 7168, 128, True), block, "log2 4096 = 12: nearer 16384 (14) than 256 (8)")]
        got = self.tuned_lookup(tmp_path, monkeypatch, entries, [c[0] for c in cases])
        for cfg, (request, want, what) in zip(got, cases):
            assert cfg == self.CONFIG(**want), f"{request}: {what}; got {cfg}"

    def test_dispatch(self, monkeypatch):
        """``implementation=`` the kernel's (:attr:`KERNEL`) runs the kernel: its NotImplementedError reaches the
        caller; ``None`` on CPU arrays runs the reference (bit for bit) and never touches the kernel (on a GPU:
        :attr:`DEFAULT_KERNEL_CALLS_ON_GPU` calls, where a backend says)."""
        x_np, w_np, off_np = gemm_problem(2, [3, 0, 4], 9, 32, 24)
        calls = self.refuse_kernel(monkeypatch)
        for dtype in ("float32", "bfloat16"):
            x, w, offsets = self.array(x_np, dtype), self.array(w_np, dtype), self.array(off_np)
            with pytest.raises(NotImplementedError, match="test: kernel refused"):
                self.OPS.grouped_gemm(x, w, offsets, implementation=self.KERNEL)
            calls.clear()
            assert_exact(self.OPS.grouped_gemm(x, w, offsets), self.reference_grouped_gemm(x, w, offsets, None, None, dtype),
                         f"{dtype}: implementation=None")
            if DEVICE == "cpu":
                assert not calls, f"{dtype}: implementation=None on the CPU called the kernel"
            elif self.DEFAULT_KERNEL_CALLS_ON_GPU is not None:
                assert len(calls) == self.DEFAULT_KERNEL_CALLS_ON_GPU, calls
