"""Gate (CONTRACT.md section 1): jnp and torch references agree, and the bug cases hold."""

from __future__ import annotations

import numpy as np
import pytest

import moe_pallas
import moe_torch
from common import both
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


def _run_both(logits: np.ndarray, dtype: str, bias: np.ndarray | None, **kw):
    jl, tl = both(logits, dtype)
    jb, tb = both(bias) if bias is not None else (None, None)
    jw, ji = moe_pallas.select_experts(jl, e_score_correction_bias=jb, **kw)
    tw, ti = moe_torch.select_experts(tl, e_score_correction_bias=tb, **kw)
    return (jw, ji), (tw, ti)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_gate_jnp_matches_torch(case, dtype):
    kw = dict(CASES[case])
    T, E = kw.pop("T"), kw.pop("E")
    rng = np.random.default_rng(hash(case) % 2**32)
    logits = rng.standard_normal((T, E)).astype(np.float32) * 2
    bias = (rng.standard_normal(E) * 0.3).astype(np.float32) if kw.get("routing") == "biased_grouped_topk" else None
    (jw, ji), (tw, ti) = _run_both(logits, dtype, bias, **kw)
    assert_exact(ji, ti, "topk_ids")
    assert_gate_weights(jw, tw)
    ids, w = to_numpy(ji), to_numpy(jw)
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


def test_gate_selects_the_largest_scores_in_order():
    """softmax top-k picks exactly the k largest probabilities, in descending order (numpy float64 check)."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((50, 10)).astype(np.float32)
    for w, ids in (moe_pallas.select_experts(both(logits)[0], topk=3, renormalize=False),
                   moe_torch.select_experts(both(logits)[1], topk=3, renormalize=False)):
        p = np.exp(logits.astype(np.float64))
        p /= p.sum(1, keepdims=True)
        np.testing.assert_array_equal(to_numpy(ids), np.argsort(-p, axis=1, kind="stable")[:, :3])
        np.testing.assert_allclose(to_numpy(w), np.take_along_axis(p, to_numpy(ids), 1), rtol=1e-6)


@pytest.mark.parametrize("framework", ["jnp", "torch"])
def test_bug_rsf_without_renormalize(framework):
    """Bug case 2: softmax over [2, 1, 0, -1], top-2, renormalize=False, rsf=2.5 -> [1.6098, 0.5922]."""
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
    mod = moe_pallas if framework == "jnp" else moe_torch
    arr = both(logits)[0 if framework == "jnp" else 1]
    w, ids = mod.select_experts(arr, topk=2, renormalize=False, routed_scaling_factor=2.5,
                                apply_routed_scaling_factor_on_output=True)
    np.testing.assert_array_equal(to_numpy(ids), [[0, 1]])
    np.testing.assert_allclose(to_numpy(w), [[1.6098, 0.5922]], atol=5e-5)
    # Placed in the combine instead, the gate leaves the weights unscaled (rsf applied once, later).
    w_unscaled, _ = mod.select_experts(arr, topk=2, renormalize=False, routed_scaling_factor=2.5)
    np.testing.assert_allclose(to_numpy(w_unscaled), [[1.6098 / 2.5, 0.5922 / 2.5]], atol=5e-5)


@pytest.mark.parametrize("framework", ["jnp", "torch"])
def test_bug_dropped_groups_masked_with_minus_inf(framework):
    """Bug case 3: 4 experts in 2 groups, topk_group=1, top-2, sigmoid, logits 0,
    bias [-0.6, -0.7, -0.9, -0.95] -> ids [0, 1], weights [0.5, 0.5].

    Selection scores are 0.5 + bias = [-0.1, -0.2, -0.4, -0.45]: group 0 wins; masking group 1
    with 0.0 (as transformers does) would make its experts beat group 0's negative scores.
    """
    logits = np.zeros((1, 4), np.float32)
    bias = np.array([-0.6, -0.7, -0.9, -0.95], np.float32)
    (jw, ji), (tw, ti) = _run_both(logits, "float32", bias, topk=2, routing="biased_grouped_topk",
                                   num_expert_group=2, topk_group=1)
    w, ids = (jw, ji) if framework == "jnp" else (tw, ti)
    np.testing.assert_array_equal(to_numpy(ids), [[0, 1]])
    np.testing.assert_array_equal(to_numpy(w), np.array([[0.5, 0.5]], np.float32))


@pytest.mark.parametrize("framework", ["jnp", "torch"])
def test_bug_ties_lower_index_wins(framework):
    """Bug case 4: scores [0.9, 0.5, 0.5, 0.1, 0, 0, 0, 0], top-2 -> ids [0, 1], every run."""
    scores = np.array([0.9, 0.5, 0.5, 0.1, 0.0, 0.0, 0.0, 0.0], np.float32)
    with np.errstate(divide="ignore"):
        logits = np.log(scores)  # softmax(log s) = s / sum(s): the 0.5 tie survives exactly
    batch = np.repeat(logits[None], 64, axis=0)  # many identical rows in one call
    mod, idx = (moe_pallas, 0) if framework == "jnp" else (moe_torch, 1)
    for _ in range(5):
        _, ids = mod.select_experts(both(batch)[idx], topk=2)
        np.testing.assert_array_equal(to_numpy(ids), np.tile([0, 1], (64, 1)))
    # ...and the zeros tie at the tail: top-6 takes experts 4 and 5 of the four zeros.
    _, ids = mod.select_experts(both(logits[None])[idx], topk=6)
    np.testing.assert_array_equal(to_numpy(ids), [[0, 1, 2, 3, 4, 5]])


@pytest.mark.parametrize("framework", ["jnp", "torch"])
def test_group_ties_lower_group_wins(framework):
    """All scores equal: groups 0..topk_group-1 are kept, and their lowest experts chosen."""
    idx = 0 if framework == "jnp" else 1
    mod = moe_pallas if framework == "jnp" else moe_torch
    logits = np.zeros((3, 16), np.float32)
    bias = np.zeros(16, np.float32)
    _, ids = mod.select_experts(both(logits)[idx], topk=4, routing="biased_grouped_topk", num_expert_group=4,
                                topk_group=2, e_score_correction_bias=both(bias)[idx])
    np.testing.assert_array_equal(to_numpy(ids), np.tile([0, 1, 2, 3], (3, 1)))


@pytest.mark.parametrize("routing", ["softmax_topk", "biased_grouped_topk"])
def test_nan_logits_rank_last_ids_stay_valid(routing):
    """NaN scores rank below every finite score; ids stay distinct and in [0, E)."""
    rng = np.random.default_rng(3)
    T, E = 6, 8
    logits = rng.standard_normal((T, E)).astype(np.float32)
    logits[0, 3] = np.nan  # one NaN expert
    logits[1, :] = np.nan  # a whole row
    kw = dict(topk=3, routing=routing)
    bias = None
    if routing == "biased_grouped_topk":
        kw.update(num_expert_group=2, topk_group=2)
        bias = np.zeros(E, np.float32)
    (jw, ji), (tw, ti) = _run_both(logits, "float32", bias, **kw)
    assert_exact(ji, ti, "topk_ids")
    ids = to_numpy(ji)
    assert ((ids >= 0) & (ids < E)).all() and all(len(set(r)) == 3 for r in ids.tolist())
    if routing == "biased_grouped_topk":  # sigmoid keeps row 0 finite elsewhere: expert 3 never chosen
        assert 3 not in ids[0]
    np.testing.assert_array_equal(ids[1], [0, 1, 2])  # all-NaN row: ties -> lowest indices
    finite = np.isfinite(to_numpy(jw)).all(axis=1)
    np.testing.assert_array_equal(finite, np.isfinite(to_numpy(tw)).all(axis=1))
