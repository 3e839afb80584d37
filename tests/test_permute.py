"""Permutation (CONTRACT.md section 2): routing metadata and the permute, jnp vs torch, invariants, bug case."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import moe_pallas
import moe_torch
from common import both, random_ids, to_torch
from tolerances import assert_exact, to_numpy

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


@pytest.mark.parametrize("case", list(CASES))
def test_routing_metadata_jnp_matches_torch(case):
    T, topk, E, start, e_local, how = CASES[case]
    ids = _ids(np.random.default_rng(0), T, topk, E, how)
    jm = moe_pallas.routing_metadata(both(ids)[0], E, expert_start=start, num_local_experts=e_local)
    tm = moe_torch.routing_metadata(both(ids)[1], E, expert_start=start, num_local_experts=e_local)
    for name in ("expert_offsets", "src2dst", "dst2src"):
        assert_exact(getattr(jm, name), getattr(tm, name), name)
    check_invariants(ids, start, e_local, *jm)


def test_routing_metadata_torch_int64_ids_match_int32():
    ids = random_ids(np.random.default_rng(1), 11, 3, 8)
    a = moe_torch.routing_metadata(to_torch(ids, "int64"), 8, expert_start=2, num_local_experts=4)
    b = moe_torch.routing_metadata(to_torch(ids), 8, expert_start=2, num_local_experts=4)
    for x, y in zip(a, b):
        assert_exact(x, y)


@pytest.mark.parametrize("framework", ["jnp", "torch"])
def test_bug_one_expert_takes_all(framework):
    """Bug case 7: 4 tokens, top-1, 1 expert -> offsets [0, 4], src2dst [0, 1, 2, 3]."""
    ids = np.zeros((4, 1), np.int32)
    mod, idx = (moe_pallas, 0) if framework == "jnp" else (moe_torch, 1)
    meta = mod.routing_metadata(both(ids)[idx], 1)
    np.testing.assert_array_equal(to_numpy(meta.expert_offsets), [0, 4])
    np.testing.assert_array_equal(to_numpy(meta.src2dst).reshape(-1), [0, 1, 2, 3])
    np.testing.assert_array_equal(to_numpy(meta.dst2src), [0, 1, 2, 3])


@st.composite
def routing_problems(draw):
    E = draw(st.integers(1, 12))
    T = draw(st.integers(1, 20))
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


@given(routing_problems())
def test_property_permutation_invariants(problem):
    """Inverse maps, offsets = exclusive cumsum of counts, last offset = M, stable order; both frameworks."""
    ids, E, start, e_local = problem
    jm = moe_pallas.routing_metadata(both(ids)[0], E, expert_start=start, num_local_experts=e_local)
    tm = moe_torch.routing_metadata(both(ids)[1], E, expert_start=start, num_local_experts=e_local)
    check_invariants(ids, start, e_local, *jm)
    for a, b in zip(jm, tm):
        assert_exact(a, b)


PERMUTE_QUANTS = [None, "fp8_per_token", "fp8_per_token_group", "fp8_per_tensor"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant", PERMUTE_QUANTS)
@pytest.mark.parametrize("T,H,topk,E", [(1, 128, 1, 2), (7, 256, 3, 5), (12, 384, 2, 16)])
def test_permute_jnp_matches_torch(T, H, topk, E, quant, dtype):
    rng = np.random.default_rng(T * H)
    x = (rng.standard_normal((T, H)) * np.exp(rng.uniform(-4, 4, (T, 1)))).astype(np.float32)
    ids = random_ids(rng, T, topk, E)
    start, e_local = (1, max(1, E // 2))  # an EP rank: some rows are non-local
    jm = moe_pallas.routing_metadata(both(ids)[0], E, expert_start=start, num_local_experts=e_local)
    tm = moe_torch.routing_metadata(both(ids)[1], E, expert_start=start, num_local_experts=e_local)
    scale = np.array(0.05, np.float32)
    jx, tx = both(x, dtype)
    kw = dict(topk=topk, quant=quant, group_size=128)
    jq, js = moe_pallas.permute(jx, jm.dst2src, scale=both(scale)[0] if quant == "fp8_per_tensor" else None, **kw)
    tq, ts = moe_torch.permute(tx, tm.dst2src, scale=both(scale)[1] if quant == "fp8_per_tensor" else None, **kw)
    M = int(to_numpy(jm.expert_offsets)[-1])
    assert_exact(jq, tq, "permuted rows")  # a gather (and the quantization) is exact
    if quant is not None:
        assert_exact(js, ts, "scales")
    # rows < M are the right tokens; rows >= M are zero
    rows = to_numpy(jq).astype(np.float32)
    src = to_numpy(jm.dst2src)
    if quant is None:
        np.testing.assert_array_equal(rows[:M], to_numpy(jx).astype(np.float32)[src[:M] // topk])
    assert not rows[M:].any()
