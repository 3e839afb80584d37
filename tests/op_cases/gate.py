"""The cases of ``select_experts`` (the gate, CONTRACT.md sections 1, 7) that every backend passes.

Subclassed by ``tests/test_gate.py`` (the torch op against the jnp op, through the public APIs with the default
implementation: the references on the CPU), ``tests/test_pallas_gate.py`` (the Pallas-Triton kernel against the
jnp reference) and ``tests/test_triton_gate.py`` (the Triton kernel against the torch reference). A subclass mixes
in the arrays of its framework (``op_cases.TorchArrays`` / ``JaxArrays``) and implements the hooks its bases name.

Ids must equal the judge's exactly, weights within ``GATE_WEIGHT_RTOL`` (rel. 1e-6). The checks against known
values (the bug cases, numpy's float64 order, the structure of a selection) are made on the judge's result too,
so that no tolerance is chained through the judge.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from op_cases import ClassParams
from tolerances import assert_exact, assert_gate_weights, to_numpy

# Each case: T, E, topk and routing kwargs; the comment says which edge it exercises.
CASES = {
    "softmax-T1": dict(T=1, E=8, topk=2),  # T=1
    "softmax-primeE-topk1-norenorm": dict(T=37, E=7, topk=1, renormalize=False),  # prime E, topk=1
    "softmax-topkE": dict(T=16, E=5, topk=5),  # topk == E
    "grouped": dict(T=33, E=16, topk=4, routing="grouped_topk", num_expert_group=4, topk_group=2),
    "grouped-one-group-kept": dict(T=9, E=12, topk=3, routing="grouped_topk", num_expert_group=3, topk_group=1),
    "biased-shared-rsf-on-output": dict(
        T=21, E=16, topk=4, routing="biased_grouped_topk", num_expert_group=4, topk_group=2,
        routed_scaling_factor=2.5, apply_routed_scaling_factor_on_output=True, num_fused_shared_experts=1),
    "biased-rsf-in-combine": dict(
        T=21, E=16, topk=4, routing="biased_grouped_topk", num_expert_group=4, topk_group=2,
        routed_scaling_factor=2.5, num_fused_shared_experts=2),
    "biased-deepseek-v3-size": dict(
        T=64, E=256, topk=8, routing="biased_grouped_topk", num_expert_group=8, topk_group=4,
        routed_scaling_factor=2.5, num_fused_shared_experts=1),
    "biased-no-renorm": dict(
        T=5, E=8, topk=2, routing="biased_grouped_topk", num_expert_group=2, topk_group=1, renormalize=False),
}

#: ``select_experts``'s keyword defaults (the kernels' entry points take them all).
GATE_DEFAULTS = dict(routing="softmax_topk", renormalize=True, num_expert_group=None, topk_group=None,
                     routed_scaling_factor=1.0, apply_routed_scaling_factor_on_output=False, num_fused_shared_experts=0)


def case_problem(case: str):
    """``(kwargs, logits [T, E] float32, bias [E] float32 or None)`` of a :data:`CASES` entry (a seed of its
    own, the same in every process)."""
    kw = dict(CASES[case])
    T, E = kw.pop("T"), kw.pop("E")
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    logits = rng.standard_normal((T, E)).astype(np.float32) * 2
    bias = (rng.standard_normal(E) * 0.3).astype(np.float32) if kw.get("routing") == "biased_grouped_topk" else None
    return kw, logits, bias


def check_selection(w, ids, E: int, kw: dict) -> None:
    """The structure of a selection with routing ``kw`` over ``E`` experts: shapes and dtypes; routed ids in
    ``[0, E)`` and distinct per token; the shared experts ``E..E+S-1`` with weight 1 (rsf on the output) or
    ``1/rsf``; renormalized weights sum to 1 (or rsf on the output); grouped routings pick from at most
    ``topk_group`` groups."""
    ids, w = to_numpy(ids), to_numpy(w)
    T = ids.shape[0]
    S = kw.get("num_fused_shared_experts", 0)
    assert ids.shape == w.shape == (T, kw["topk"] + S) and ids.dtype == np.int32 and w.dtype == np.float32
    routed = ids[:, : kw["topk"]]
    assert ((routed >= 0) & (routed < E)).all()
    assert all(len(set(r)) == len(r) for r in routed.tolist()), "ids distinct per token"
    if S:
        np.testing.assert_array_equal(ids[:, kw["topk"]:], np.broadcast_to(np.arange(E, E + S), (T, S)))
        rsf = kw["routed_scaling_factor"]
        expected_shared = 1.0 if kw.get("apply_routed_scaling_factor_on_output") else np.float32(1.0 / rsf)
        np.testing.assert_array_equal(w[:, kw["topk"]:], np.float32(expected_shared))
    if kw.get("renormalize", True):
        scale = kw.get("routed_scaling_factor", 1.0) if kw.get("apply_routed_scaling_factor_on_output") else 1.0
        np.testing.assert_allclose(w[:, : kw["topk"]].sum(1), scale, rtol=1e-5)
    if kw.get("routing", "softmax_topk") != "softmax_topk":  # every chosen expert lies in a kept group
        per = E // kw["num_expert_group"]
        assert (np.array([len(set(r)) for r in (routed // per).tolist()]) <= kw["topk_group"]).all()


class GateCases(ClassParams):
    """``select_experts``'s cases, for any implementation.

    Hooks: ``array`` / ``strided`` (the framework mixin), :meth:`select_experts` (the backend under test) and
    :meth:`reference_select_experts` (its judge); :attr:`CASE_DTYPES`, :meth:`case_config`.
    """

    #: test id -> (a key of :data:`CASES`, logits dtype): every case in float32 and bf16 unless a backend
    #: runs fewer.
    CASE_DTYPES: dict[str, tuple[str, str]] = {f"{c}-{d}": (c, d) for d in ("float32", "bfloat16") for c in CASES}
    CLASS_PARAMS = {"case_dtype": "CASE_DTYPES"}

    def select_experts(self, logits, bias, config=None, **kw):
        """The backend under test: ``(topk_weights, topk_ids)``. ``config=None``: the public op (``kw`` its
        routing keywords); else the kernel with that launch config."""
        raise NotImplementedError

    def reference_select_experts(self, logits_np: np.ndarray, dtype: str, bias_np: np.ndarray | None, **kw):
        """The judge's ``(topk_weights, topk_ids)`` for numpy inputs (``logits_np`` cast to ``dtype``)."""
        raise NotImplementedError

    def case_config(self, dtype: str):
        """The launch config of :meth:`test_cases` for ``dtype`` logits (None: the backend's, through the public
        op)."""
        return None

    def check(self, logits_np: np.ndarray, bias_np: np.ndarray | None = None, dtype: str = "float32", config=None,
              logits=None, what: str = "", **kw):
        """The backend on ``logits`` (default: ``logits_np`` as the framework's array of ``dtype``) against the
        judge on ``logits_np``: int32 ids exactly the judge's, float32 weights within ``GATE_WEIGHT_RTOL``.
        Returns ``(got, want)``, each ``(topk_weights, topk_ids)``."""
        logits = self.array(logits_np, dtype) if logits is None else logits
        bias = None if bias_np is None else self.array(bias_np)
        got = self.select_experts(logits, bias, config, **kw)
        want = self.reference_select_experts(logits_np, dtype, bias_np, **kw)
        w, ids = (to_numpy(a) for a in got)
        assert ids.dtype == np.int32 and w.dtype == np.float32, f"{what}: {ids.dtype} ids, {w.dtype} weights"
        assert_exact(got[1], want[1], f"{what}: topk_ids")
        assert_gate_weights(got[0], want[0], f"{what}: topk_weights")
        return got, want

    def test_cases(self, case_dtype):
        """Every case of :data:`CASES` (T=1, prime E, topk=1, topk=E, both grouped modes, DeepSeek-V3 size with a
        shared expert, both rsf placements): the judge's ids and weights, and the structure of a selection
        (:func:`check_selection`)."""
        case, dtype = case_dtype
        kw, logits, bias = case_problem(case)
        for w, ids in self.check(logits, bias, dtype, config=self.case_config(dtype), what=f"{case}/{dtype}", **kw):
            check_selection(w, ids, logits.shape[1], kw)

    def test_selects_the_largest_scores_in_order(self):
        """softmax top-k picks exactly the k largest probabilities, in descending order (numpy float64 check)."""
        logits = np.random.default_rng(1).standard_normal((50, 10)).astype(np.float32)
        p = np.exp(logits.astype(np.float64))
        p /= p.sum(1, keepdims=True)
        for w, ids in self.check(logits, topk=3, renormalize=False):
            np.testing.assert_array_equal(to_numpy(ids), np.argsort(-p, axis=1, kind="stable")[:, :3])
            np.testing.assert_allclose(to_numpy(w), np.take_along_axis(p, to_numpy(ids), 1), rtol=1e-6)

    def test_bug_rsf_without_renormalize(self):
        """Bug case 2: softmax over [2, 1, 0, -1], top-2, renormalize=False, rsf=2.5 on the output ->
        [1.6098, 0.5922]: rsf applies also without renormalization."""
        logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
        for w, ids in self.check(logits, topk=2, renormalize=False, routed_scaling_factor=2.5,
                                 apply_routed_scaling_factor_on_output=True):
            np.testing.assert_array_equal(to_numpy(ids), [[0, 1]])
            np.testing.assert_allclose(to_numpy(w), [[1.6098, 0.5922]], atol=5e-5)
        # Placed in the combine instead, the gate leaves the weights unscaled (rsf applied once, later).
        for w, _ in self.check(logits, topk=2, renormalize=False, routed_scaling_factor=2.5):
            np.testing.assert_allclose(to_numpy(w), [[1.6098 / 2.5, 0.5922 / 2.5]], atol=5e-5)

    def test_bug_dropped_groups_masked_with_minus_inf(self):
        """Bug case 3: 4 experts in 2 groups, topk_group=1, top-2, sigmoid, logits 0,
        bias [-0.6, -0.7, -0.9, -0.95] -> ids [0, 1], weights [0.5, 0.5].

        Selection scores are 0.5 + bias = [-0.1, -0.2, -0.4, -0.45]: group 0 wins; masking group 1
        with 0.0 (as transformers does) would make its experts beat group 0's negative scores.
        """
        bias = np.array([-0.6, -0.7, -0.9, -0.95], np.float32)
        for w, ids in self.check(np.zeros((1, 4), np.float32), bias, topk=2, routing="biased_grouped_topk",
                                 num_expert_group=2, topk_group=1):
            np.testing.assert_array_equal(to_numpy(ids), [[0, 1]])
            np.testing.assert_array_equal(to_numpy(w), np.array([[0.5, 0.5]], np.float32))

    def test_bug_ties_lower_index_wins(self):
        """Bug case 4: scores [0.9, 0.5, 0.5, 0.1, 0, 0, 0, 0], top-2 -> ids [0, 1], every run (64 identical
        rows, 5 runs); the zeros (-inf logits) tie at the tail: top-6 takes experts 4 and 5 of the four, top-8
        (topk = E) the whole tail in index order."""
        scores = np.array([0.9, 0.5, 0.5, 0.1, 0.0, 0.0, 0.0, 0.0], np.float32)
        with np.errstate(divide="ignore"):
            logits = np.log(scores)  # softmax(log s) = s / sum(s): the 0.5 tie survives exactly
        batch = np.repeat(logits[None], 64, axis=0)  # many identical rows in one call
        for _ in range(5):
            for _, ids in self.check(batch, topk=2, what="top-2"):
                np.testing.assert_array_equal(to_numpy(ids), np.tile([0, 1], (64, 1)))
        for _, ids in self.check(logits[None], topk=6, what="top-6"):
            np.testing.assert_array_equal(to_numpy(ids), [[0, 1, 2, 3, 4, 5]])
        for _, ids in self.check(logits[None], topk=8, what="top-8"):
            np.testing.assert_array_equal(to_numpy(ids), [list(range(8))])

    @pytest.mark.parametrize("routing", ["biased_grouped_topk", "grouped_topk"])
    def test_group_ties_lower_group_wins(self, routing):
        """All scores equal: groups 0..topk_group-1 are kept, and their lowest experts chosen; with topk above
        the experts of one group the second kept group (group 1) supplies the rest, in index order."""
        bias = np.zeros(16, np.float32) if routing == "biased_grouped_topk" else None
        kw = dict(routing=routing, num_expert_group=4, topk_group=2)
        for _, ids in self.check(np.zeros((3, 16), np.float32), bias, topk=4, **kw):
            np.testing.assert_array_equal(to_numpy(ids), np.tile([0, 1, 2, 3], (3, 1)))
        for _, ids in self.check(np.zeros((2, 16), np.float32), bias, topk=6, **kw):
            np.testing.assert_array_equal(to_numpy(ids), np.tile([0, 1, 2, 3, 4, 5], (2, 1)))

    def test_biased_all_kept_experts_minus_inf_still_picked(self):
        """topk reaches past the finite selection scores of the kept groups: the NaN (-inf) experts of
        kept groups come next in index order, never a dropped group's expert."""
        logits = np.zeros((1, 8), np.float32)
        logits[0, [1, 2]] = np.nan
        bias = np.array([0.0, 0.0, 0.0, 0.0, -1.0, -1.0, -1.0, -1.0], np.float32)
        for _, ids in self.check(logits, bias, topk=4, routing="biased_grouped_topk", num_expert_group=2,
                                 topk_group=1, renormalize=False):
            np.testing.assert_array_equal(to_numpy(ids), [[0, 3, 1, 2]])

    @pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # the Triton interpreter's np.max
    @pytest.mark.parametrize("routing,topk_group", [
        ("softmax_topk", None), ("grouped_topk", 1), ("grouped_topk", 2), ("biased_grouped_topk", 2)])
    def test_nan_and_inf_logits(self, routing, topk_group):
        """NaN scores rank below every finite score: a NaN expert, a whole NaN row (ties -> lowest ids), an all
        -inf row (its softmax is NaN), +inf and -inf experts. The judge's ids; ids stay distinct and in [0, E);
        the same rows have finite weights; the biased routing (sigmoid keeps the rest of row 0 finite) never
        picks the NaN expert."""
        rng = np.random.default_rng(3)
        T, E = 7, 8
        logits = rng.standard_normal((T, E)).astype(np.float32)
        logits[0, 3] = np.nan  # one NaN expert
        logits[1, :] = np.nan  # a whole row
        logits[2, :] = -np.inf  # softmax of an all -inf row is NaN
        logits[3, 5] = np.inf
        logits[4, 2] = -np.inf
        kw = dict(topk=3, routing=routing)
        if routing != "softmax_topk":
            kw.update(num_expert_group=2, topk_group=topk_group)
        bias = np.zeros(E, np.float32) if routing == "biased_grouped_topk" else None
        got, want = self.check(logits, bias, what=f"nan/{routing}", **kw)
        np.testing.assert_array_equal(np.isfinite(to_numpy(got[0])).all(axis=1),
                                      np.isfinite(to_numpy(want[0])).all(axis=1))
        for _, ids in (got, want):
            ids = to_numpy(ids)
            assert ((ids >= 0) & (ids < E)).all() and all(len(set(r)) == 3 for r in ids.tolist())
            np.testing.assert_array_equal(ids[1], [0, 1, 2])  # all-NaN row: ties -> lowest indices
            if routing == "biased_grouped_topk":
                assert 3 not in ids[0]

    def test_edge_inputs(self):
        """Strided logits where the framework has them (a view of every other column); ``T = 0`` (weights and
        ids ``[0, topk + S]``)."""
        logits = np.random.default_rng(5).standard_normal((7, 16)).astype(np.float32)
        strided = self.strided(self.array(logits))
        if strided is not None:
            self.check(logits, logits=strided, topk=3, what="strided")
        for E, kw in ((8, dict(topk=2, num_fused_shared_experts=1)), (32, dict(topk=3))):
            w, ids = self.select_experts(self.array(np.zeros((0, E), np.float32)), None, **kw)
            assert to_numpy(w).shape == to_numpy(ids).shape == (0, 3)
            assert to_numpy(ids).dtype == np.int32 and to_numpy(w).dtype == np.float32


#: name -> (routing, E, num_expert_group, topk_group, topk, S, forced blocks (block_t, block_e, block_k)): E up
#: to 512, 16 groups, one expert per group, padded axes, several programs (the last partial).
FORCED_GATE_CASES = {
    "softmax-E512": ("softmax_topk", 512, None, None, 8, 0, (2, 512, 8)),
    "biased-E384-16-groups": ("biased_grouped_topk", 384, 16, 3, 7, 2, (4, 512, 16)),
    "grouped-E60-5-groups": ("grouped_topk", 60, 5, 2, 6, 1, (8, 64, 8)),
    "grouped-one-per-group": ("grouped_topk", 8, 8, 5, 5, 0, (4, 8, 8)),
}


class GateKernelCases(GateCases):
    """:class:`GateCases` plus forced launch configs. Hook: :meth:`forced_gate_config`; :attr:`FORCED_CASES`."""

    #: The keys of :data:`FORCED_GATE_CASES` this backend runs.
    FORCED_CASES: tuple[str, ...] = tuple(FORCED_GATE_CASES)
    CLASS_PARAMS = {**GateCases.CLASS_PARAMS, "forced_case": "FORCED_CASES"}

    def forced_gate_config(self, block_t: int, block_e: int, block_k: int):
        """A launch config of ``block_t`` tokens per program (and, where the kernel has them, ``block_e``
        padded experts and ``block_k`` output columns)."""
        raise NotImplementedError

    def test_forced_configs_and_limits(self, forced_case):
        """E up to 512, 16 groups, one expert per group, padded axes, several programs (last partial),
        forced and heuristic configs; with heavy ties (logits rounded to a coarse grid)."""
        routing, E, G, kg, topk, S, blocks = FORCED_GATE_CASES[forced_case]
        rng = np.random.default_rng(E + topk)
        x = np.round(rng.standard_normal((11, E)) * 2, 1).astype(np.float32)  # many exact ties
        kw = dict(topk=topk, routing=routing, num_fused_shared_experts=S, routed_scaling_factor=2.5,
                  apply_routed_scaling_factor_on_output=S > 1)
        if routing != "softmax_topk":
            kw.update(num_expert_group=G, topk_group=kg)
        bias = np.round(rng.standard_normal(E) * 0.3, 1).astype(np.float32) if routing.startswith("biased") else None
        self.check(x, bias, config=self.forced_gate_config(*blocks), what=f"{routing} forced", **kw)
        self.check(x, bias, what=f"{routing} heuristic", **kw)
