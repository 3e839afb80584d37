"""The cases of ``routing_metadata`` and ``permute`` (CONTRACT.md sections 2-3, 7) that every backend passes.

Subclassed by ``tests/test_permute.py`` (the torch ops against the jnp ops, through the public APIs with the
default implementation: the references on the CPU), ``tests/test_pallas_permute.py`` (the Pallas-Triton kernels
against the jnp references) and ``tests/test_triton_permute.py`` (the Triton kernels against the torch
references). A subclass mixes in the arrays of its framework (``op_cases.TorchArrays`` / ``JaxArrays``) and
implements the hooks its bases name.

Every result must equal its judge's exactly: metadata int for int, including the stable order within an expert,
and permuted rows, FP8 codes and scales bit for bit. The metadata is also checked against the contract's
invariants computed in numpy (:func:`check_invariants`), independently of any implementation.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import random_ids
from op_cases import ClassParams
from tolerances import assert_exact, to_numpy

# --------------------------------------------------------------------------------------
# routing_metadata

# T, topk, E, expert_start, E_local, how ids are drawn; the comment says which edge.
CASES = {
    "T1-topk1": (1, 1, 4, 0, 4, "random"),  # T=1, topk=1
    "primeE-odd": (13, 3, 7, 0, 7, "random"),  # prime E, odd T
    "topk-eq-E": (5, 6, 6, 0, 6, "random"),  # topk == E: every expert in every row
    "empty-experts": (6, 2, 16, 0, 16, "few"),  # most experts get no rows
    "all-on-one": (9, 1, 4, 0, 4, "one"),  # every row on expert 2
    "ep-rank-middle": (17, 4, 16, 4, 4, "random"),  # EP: non-local assignments on both sides
    "ep-rank-none-local": (8, 2, 16, 12, 4, "low"),  # EP: no assignment is local (M = 0)
    "ep-last-rank-shared": (10, 3, 9, 4, 5, "random"),  # last rank owning the fused shared expert
}


def _ids(rng, T, topk, E, how):
    if how == "random":
        return random_ids(rng, T, topk, E)
    if how == "few":
        return rng.choice([3, 11], size=(T, topk)).astype(np.int32) if topk == 1 else np.tile([3, 11], (T, 1)).astype(np.int32)
    if how == "one":
        return np.full((T, topk), 2, np.int32)
    return random_ids(rng, T, topk, 8)  # "low": ids in [0, 8)


def check_invariants(ids: np.ndarray, expert_start: int, e_local: int, offsets, src2dst, dst2src) -> None:
    """The contract's invariants, checked against numpy (independently of either reference)."""
    offsets, src2dst, dst2src = (to_numpy(a) for a in (offsets, src2dst, dst2src))
    T, topk = ids.shape
    flat = ids.reshape(-1).astype(np.int64)
    local = (flat >= expert_start) & (flat < expert_start + e_local)
    counts = np.bincount(flat[local] - expert_start, minlength=e_local)
    M = int(local.sum())
    assert offsets.dtype == src2dst.dtype == dst2src.dtype == np.int32
    np.testing.assert_array_equal(offsets, np.concatenate([[0], np.cumsum(counts)]))  # exclusive cumsum
    assert offsets[-1] == M
    assert dst2src.shape == (T * topk,) and src2dst.shape == (T, topk)
    np.testing.assert_array_equal(dst2src[M:], -1)
    rows = dst2src[:M]
    # stable sort: by local expert, then by assignment index
    np.testing.assert_array_equal(rows, np.flatnonzero(local)[np.argsort(flat[local], kind="stable")])
    s2d = src2dst.reshape(-1)
    np.testing.assert_array_equal(s2d[~local], -1)
    np.testing.assert_array_equal(s2d[rows], np.arange(M))  # inverse maps
    np.testing.assert_array_equal(dst2src[s2d[local]], np.flatnonzero(local))


@st.composite
def routing_problems(draw, max_T: int = 20):
    """``(ids [T, topk], E, expert_start, E_local)``: any EP rank; uniform ids, all on one expert, or ids
    repeating within a row (the metadata must not care)."""
    E = draw(st.integers(1, 12))
    T = draw(st.integers(1, max_T))
    topk = draw(st.integers(1, E))
    start = draw(st.integers(0, E - 1))
    e_local = draw(st.integers(1, E - start))
    seed = draw(st.integers(0, 2**31 - 1))
    skew = draw(st.sampled_from(["uniform", "one", "repeats"]))
    rng = np.random.default_rng(seed)
    if skew == "uniform":
        ids = random_ids(rng, T, topk, E)
    elif skew == "one":
        ids = np.full((T, topk), draw(st.integers(0, E - 1)), np.int32)
    else:  # ids may repeat within a row: the metadata must not care
        ids = random_ids(rng, T, topk, E, distinct=False)
    return ids, E, start, e_local


def fit_int32(ids: np.ndarray) -> np.ndarray:
    """``ids`` as int32 for a judge that takes no int64 (JAX without x64): an id beyond int32 becomes -1, as
    non-local as it was (no expert range reaches it)."""
    ids = np.asarray(ids)
    out_of_int32 = (ids < np.iinfo(np.int32).min) | (ids > np.iinfo(np.int32).max)
    return np.where(out_of_int32, -1, ids).astype(np.int32)


NAMES = ("expert_offsets", "src2dst", "dst2src")


def assert_metadata_equal(got, want, what: str = "") -> None:
    """``(expert_offsets, src2dst, dst2src)`` int32, exactly the judge's."""
    for name, g, w in zip(NAMES, got, want):
        assert to_numpy(g).dtype == np.int32, f"{what} {name}: dtype {to_numpy(g).dtype}"
        assert_exact(g, w, f"{what} {name}")


class RoutingMetadataCases(ClassParams):
    """``routing_metadata``'s cases, for any implementation.

    Hooks: ``array`` / ``strided`` (the framework mixin), :meth:`routing_metadata` (the backend under test) and
    :meth:`reference_routing_metadata` (its judge).
    """

    #: How the ids are handed over: ``"int32"``; ``"int64"`` (torch: JAX without x64 has no int64 ids) and
    #: ``"strided"`` (torch: a non-contiguous int32 view; a jax array has no strides).
    ID_VARIANTS: tuple[str, ...] = ("int32",)
    #: The config of the edge cases (``None``: the backend's own choice, through the public op).
    CASE_CONFIG = None
    #: The configs the property test draws from; the largest T it draws; its examples (None: the profile's).
    PROPERTY_CONFIGS: tuple = (None,)
    PROPERTY_MAX_T = 20
    PROPERTY_EXAMPLES: int | None = None
    CLASS_PARAMS = {"id_variant": "ID_VARIANTS"}

    def routing_metadata(self, ids, E: int, start: int, e_local: int, config=None, check_ids: bool = False):
        """The backend under test on ``ids`` (the framework's array): ``(expert_offsets, src2dst, dst2src)``.
        ``config=None``: the public op, with ``check_ids``; else the kernel with that launch config."""
        raise NotImplementedError

    def reference_routing_metadata(self, ids_np: np.ndarray, E: int, start: int, e_local: int):
        """The judge's ``(expert_offsets, src2dst, dst2src)`` for the numpy ``ids_np`` (int32 or int64)."""
        raise NotImplementedError

    def ids(self, ids_np: np.ndarray, variant: str = "int32"):
        """``ids_np`` as the backend takes it (one of :attr:`ID_VARIANTS`)."""
        if variant == "strided":
            return self.strided(self.array(ids_np))
        return self.array(ids_np, variant)

    def check(self, ids_np: np.ndarray, E: int, start: int, e_local: int, variant: str = "int32", config=None,
              what: str = ""):
        """The backend on ``ids_np`` (given as ``variant``): exactly the judge's, and the invariants; returns it."""
        got = self.routing_metadata(self.ids(ids_np, variant), E, start, e_local, config=config)
        want_ids = ids_np.astype(np.int64) if variant == "int64" else ids_np
        assert_metadata_equal(got, self.reference_routing_metadata(want_ids, E, start, e_local), what)
        check_invariants(ids_np, start, e_local, *got)
        return got

    @pytest.mark.parametrize("case", list(CASES))
    def test_cases(self, case, id_variant):
        """Every edge case of :data:`CASES`, with the ids as each of :attr:`ID_VARIANTS`: exactly the judge's,
        and the contract's invariants."""
        T, topk, E, start, e_local, how = CASES[case]
        ids = _ids(np.random.default_rng(0), T, topk, E, how)
        self.check(ids, E, start, e_local, id_variant, config=self.CASE_CONFIG, what=f"{case}/{id_variant}")

    def test_one_expert_takes_all(self):
        """Bug case 7: 4 tokens, top-1, 1 expert -> offsets [0, 4], src2dst [0, 1, 2, 3]."""
        meta = self.check(np.zeros((4, 1), np.int32), 1, 0, 1, what="bug case 7")
        np.testing.assert_array_equal(to_numpy(meta[0]), [0, 4])
        np.testing.assert_array_equal(to_numpy(meta[1]).reshape(-1), [0, 1, 2, 3])
        np.testing.assert_array_equal(to_numpy(meta[2]), [0, 1, 2, 3])

    def test_out_of_range_ids(self):
        """Unchecked mode: ids outside ``[0, num_experts)`` (negative, too large; with int64 ids also beyond
        int32) are non-local, as in the judge; the input is left untouched. Checked mode (``check_ids=True``, a
        host check) raises ValueError on them and gives the unchecked result on in-range ids."""
        problems = [(np.array([[-1, 3], [9, 2], [3, 100], [0, 2]], np.int32), 8, ((2, 2),))]
        if "int64" in self.ID_VARIANTS:
            problems.append((np.array([[1, -5], [9, 2], [2**40, 0], [-(2**40), 3], [2, 2]], np.int64), 4,
                             ((0, 4), (1, 2))))
        for ids_np, E, ranks in problems:
            ids = self.array(ids_np)
            before = to_numpy(ids).copy()
            for start, e_local in ranks:
                what = f"{ids_np.dtype} start={start}"
                got = self.routing_metadata(ids, E, start, e_local)
                assert_metadata_equal(got, self.reference_routing_metadata(ids_np, E, start, e_local), what)
                check_invariants(ids_np, start, e_local, *got)
            assert_exact(ids, before, "topk_ids unchanged")
            with pytest.raises(ValueError):
                self.routing_metadata(ids, E, 0, E, check_ids=True)
            in_range = np.where((ids_np >= 0) & (ids_np < E), ids_np, 0)
            start, e_local = ranks[-1]
            assert_metadata_equal(self.routing_metadata(self.array(in_range), E, start, e_local, check_ids=True),
                                  self.reference_routing_metadata(in_range, E, start, e_local), "checked mode")

    def test_empty(self):
        """``T = 0``: zero offsets ``[E_local + 1]``, ``src2dst [0, topk]``, ``dst2src [0]``, all int32."""
        for topk, E, start, e_local in ((3, 6, 0, 6), (2, 8, 0, 8)):
            meta = self.routing_metadata(self.array(np.zeros((0, topk), np.int32)), E, start, e_local)
            assert_exact(meta[0], np.zeros(e_local + 1, np.int32), "T=0 offsets")
            assert to_numpy(meta[1]).shape == (0, topk) and to_numpy(meta[2]).shape == (0,)
            assert to_numpy(meta[1]).dtype == to_numpy(meta[2]).dtype == np.int32

    def test_property(self):
        """Random (E, T, topk, EP rank, skew, repeated ids; a config of :attr:`PROPERTY_CONFIGS`): exactly the
        judge's, and the invariants (inverse maps, offsets = exclusive cumsum of counts, last offset = M,
        stable order)."""
        examples = {} if self.PROPERTY_EXAMPLES is None else {"max_examples": self.PROPERTY_EXAMPLES}

        @settings(**examples)
        @given(routing_problems(self.PROPERTY_MAX_T), st.sampled_from(self.PROPERTY_CONFIGS))
        def check(problem, config):
            ids, E, start, e_local = problem
            self.check(ids, E, start, e_local, config=config, what=f"property {config}")

        check()


class RoutingMetadataKernelCases(RoutingMetadataCases):
    """:class:`RoutingMetadataCases` plus the cases of a kernel with launch configs.

    Hook: :meth:`forced_routing_config`.
    """

    def forced_routing_config(self, block_a: int, block_b: int, e_local: int):
        """A launch config of about ``block_a`` assignments per program, the per-block counts scanned
        ``block_b`` blocks at a time (where the kernel has such a scan)."""
        raise NotImplementedError

    @pytest.mark.parametrize("T,topk,E,start,e_local,block_a,block_b", [
        (37, 3, 8, 0, 8, 4, 2),  # 28 blocks of 4 assignments, scanned 2 at a time (last block partial)
        (50, 2, 16, 4, 5, 8, 4),  # EP rank, E_local not a power of 2 (padded expert columns)
        (16, 1, 4, 0, 4, 1, 1),  # one assignment per block: the order comes from the scan alone
        (300, 8, 256, 0, 256, 16, 8),  # DeepSeek-V3-like E=256, topk=8: 150 blocks
    ])
    def test_many_blocks(self, T, topk, E, start, e_local, block_a, block_b):
        """Small forced blocks: one expert's rows span many blocks and many scan steps, and stay in
        assignment order (block-wise counts + exclusive scan + in-block one-hot cumsum); then the
        backend's own config through the public op."""
        rng = np.random.default_rng(T + E)
        ids = np.concatenate([random_ids(rng, T // 2, topk, E),  # distinct in a row
                              rng.integers(0, min(E, 3), (T - T // 2, topk)).astype(np.int32)])  # skewed, repeats
        self.check(ids, E, start, e_local, config=self.forced_routing_config(block_a, block_b, e_local),
                   what="forced config")
        self.check(ids, E, start, e_local, what="heuristic config")


# --------------------------------------------------------------------------------------
# permute

PERMUTE_QUANTS = [None, "fp8_per_token", "fp8_per_token_group", "fp8_per_tensor"]

#: name -> (T, H, topk, E, group_size); the comment says which edge. A backend runs those it lists in
#: ``SHAPES``.
PERMUTE_SHAPES = {
    "T1": (1, 128, 1, 2, 128),  # T=1
    "odd-T": (7, 256, 3, 5, 128),  # odd T, two groups
    "H384": (12, 384, 2, 16, 128),  # H not a power of 2, three groups
    "H384-G96": (12, 384, 2, 16, 96),  # G not a power of 2 (masked single chunk); H not a power of 2
    "wide-H": (3, 4352, 2, 4, 128),  # H > 4096: Triton's per-token takes the two-pass path; 34 groups
    "topk3-E8": (11, 256, 3, 8, 128),  # topk=3, an EP rank of 4 of 8 experts
}


def dst2src_of(ids: np.ndarray, expert_start: int, e_local: int) -> np.ndarray:
    """The contract's ``dst2src [T*topk]`` int32 of ``ids`` in numpy: the local assignments stably sorted by
    expert, then -1 (as :func:`check_invariants` checks it)."""
    flat = ids.reshape(-1).astype(np.int64)
    local = (flat >= expert_start) & (flat < expert_start + e_local)
    rows = np.flatnonzero(local)[np.argsort(flat[local], kind="stable")]
    return np.concatenate([rows, np.full(flat.size - rows.size, -1)]).astype(np.int32)


def metadata_of(ids: np.ndarray, expert_start: int, e_local: int):
    """The contract's ``(expert_offsets [E_local+1], src2dst [T, topk], dst2src [T*topk])`` int32 of ``ids`` in
    numpy (as :func:`check_invariants` checks them)."""
    dst2src = dst2src_of(ids, expert_start, e_local)
    flat = ids.reshape(-1).astype(np.int64)
    local = (flat >= expert_start) & (flat < expert_start + e_local)
    counts = np.bincount(flat[local] - expert_start, minlength=e_local)
    src2dst = np.full(flat.size, -1, np.int32)
    M = int(local.sum())
    src2dst[dst2src[:M]] = np.arange(M, dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return offsets, src2dst.reshape(ids.shape), dst2src


def permute_problem(T: int, H: int, topk: int, E: int, seed: int):
    """``(x [T, H] float32, dst2src [T*topk] int32, M)`` in numpy on an EP rank owning experts
    ``[1, 1 + max(1, E // 2))``: some rows are non-local, so rows ``>= M`` exist. Rows of widely different
    magnitudes (their scales differ); with T > 1 token 0 is all zero (the floor scale), with T > 2 token 1
    is zero in its first third."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((T, H)) * np.exp(rng.uniform(-4, 4, (T, 1)))).astype(np.float32)
    if T > 1:
        x[0] = 0
    if T > 2:
        x[1, : H // 3] = 0
    dst2src = dst2src_of(random_ids(rng, T, topk, E), 1, max(1, E // 2))
    return x, dst2src, int((dst2src >= 0).sum())


def assert_permute_equal(got, want, what: str) -> None:
    """``(rows or FP8 codes, scale or None)`` bit-identical to the judge's, of its dtypes and shapes."""
    (q, s), (q_ref, s_ref) = got, want
    qn, qn_ref = to_numpy(q), to_numpy(q_ref)
    assert qn.dtype == qn_ref.dtype and qn.shape == qn_ref.shape, f"{what}: {qn.dtype} {qn.shape} vs {qn_ref.dtype} {qn_ref.shape}"
    assert_exact(q, q_ref, f"{what}: rows / codes")
    assert (s is None) == (s_ref is None), what
    if s is not None:
        sn = to_numpy(s)
        assert sn.dtype == np.float32 and sn.shape == to_numpy(s_ref).shape, f"{what}: scale {sn.dtype} {sn.shape}"
        assert_exact(s, s_ref, f"{what}: scales")


class PermuteCases(ClassParams):
    """``permute``'s cases, for any implementation.

    Hooks: ``array`` / ``strided`` (the framework mixin), :meth:`permute` (the backend under test) and
    :meth:`reference_permute` (its judge); :attr:`SHAPES`.
    """

    #: The keys of :data:`PERMUTE_SHAPES` this backend runs.
    SHAPES: tuple[str, ...] = tuple(PERMUTE_SHAPES)
    CLASS_PARAMS = {"shape": "SHAPES"}

    def permute(self, x, dst2src, topk: int, quant, group_size: int, scale, config=None):
        """The backend under test: ``(rows or codes, scale or None)``. ``config=None``: the public op; else the
        kernel with that launch config."""
        raise NotImplementedError

    def reference_permute(self, x_np: np.ndarray, dtype: str, dst2src_np: np.ndarray, topk: int, quant,
                          group_size: int, scale_np: np.ndarray | None):
        """The judge's ``(rows or codes, scale or None)`` for numpy inputs (``x_np`` cast to ``dtype``)."""
        raise NotImplementedError

    def check(self, x_np: np.ndarray, dtype: str, dst2src_np: np.ndarray, topk: int, quant, group_size: int,
              scale_np: np.ndarray | None = None, config=None, x=None, what: str = ""):
        """The backend on ``x`` (default: ``x_np`` as the framework's array of ``dtype``): bit-identical to the
        judge's on ``x_np``; the inputs untouched. Returns the backend's result."""
        x = self.array(x_np, dtype) if x is None else x
        dst2src = self.array(dst2src_np)
        scale = None if scale_np is None else self.array(scale_np)
        before = (to_numpy(x).copy(), to_numpy(dst2src).copy())
        got = self.permute(x, dst2src, topk, quant, group_size, scale, config)
        want = self.reference_permute(x_np, dtype, dst2src_np, topk, quant, group_size,
                                      None if scale_np is None else scale_np.reshape(()))
        assert_permute_equal(got, want, f"{what} {quant} {dtype}")
        assert_exact(x, before[0], "x unchanged")
        assert_exact(dst2src, before[1], "dst2src unchanged")
        return got

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    @pytest.mark.parametrize("quant", PERMUTE_QUANTS)
    def test_permute(self, shape, quant, dtype):
        """Rows, FP8 codes and scales bit-identical to the judge's for each quant mode; rows < M are the
        right tokens, rows >= M are zero (with the zero-row scale); the inputs are untouched."""
        T, H, topk, E, G = PERMUTE_SHAPES[shape]
        x_np, dst2src, M = permute_problem(T, H, topk, E, seed=T * H + G)
        if T > 1:
            assert M < T * topk, "the case has rows >= M"
        scale = np.array(0.05, np.float32) if quant == "fp8_per_tensor" else None
        q, _ = self.check(x_np, dtype, dst2src, topk, quant, G, scale, what=shape)
        rows = to_numpy(q).astype(np.float32)
        if quant is None:
            x = to_numpy(self.array(x_np, dtype)).astype(np.float32)
            np.testing.assert_array_equal(rows[:M], x[dst2src[:M] // topk])
        assert not rows[M:].any(), "rows >= M are zero"

    def test_edge_inputs(self):
        """On the last of :attr:`SHAPES`: a strided ``x`` view where the framework has them (copied, not
        misread); a per-tensor scale of shape ``(1,)``. And ``T = 0`` (rows ``[0, H]``, scales ``[0, n_spans]``)."""
        T, H, topk, E, G = PERMUTE_SHAPES[self.SHAPES[-1]]  # compiled already, where compiles cost
        x_np, dst2src, _ = permute_problem(T, H, topk, E, seed=2)
        xs = self.strided(self.array(x_np, "float32"))
        if xs is not None:
            self.check(x_np, "float32", dst2src, topk, None, G, x=xs, what="strided x")
        self.check(x_np, "float32", dst2src, topk, "fp8_per_tensor", G, np.array([0.25], np.float32),
                   what="scale (1,)")
        x0, d0 = np.zeros((0, 128), np.float32), np.zeros((0,), np.int32)
        for quant in ("fp8_per_token", "fp8_per_token_group", None):
            q, s = self.check(x0, "float32", d0, 2, quant, 128, what="T=0")
            assert to_numpy(q).shape == (0, 128)
            assert s is None if quant is None else to_numpy(s).shape == (0, 1)


class PermuteKernelCases(PermuteCases):
    """:class:`PermuteCases` plus forced launch configs: :attr:`FORCED_CONFIGS`."""

    #: name -> (T, H, topk, E, quant, group_size, config): small blocks, so that multi-block spans, the
    #: two-pass quantization and many column programs run on small inputs (``config=None``: the backend's).
    FORCED_CONFIGS: dict[str, tuple] = {}
    CLASS_PARAMS = {**PermuteCases.CLASS_PARAMS, "forced": "FORCED_CONFIGS"}

    def test_forced_configs(self, forced):
        """Multi-chunk spans (amax pass, then quantize pass) and many column programs, bf16 rows: still
        bit-identical."""
        T, H, topk, E, quant, G, config = forced
        x_np, dst2src, _ = permute_problem(T, H, topk, E, seed=T * H + G)
        scale = np.array(0.125, np.float32) if quant == "fp8_per_tensor" else None
        self.check(x_np, "bfloat16", dst2src, topk, quant, G, scale, config=config, what=f"forced {config}")
