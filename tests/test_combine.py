"""Combine (CONTRACT.md section 5): float32 accumulation, rsf once, non-local slots and rows >= M never read."""

from __future__ import annotations

import numpy as np
import pytest

import moe_pallas
import moe_torch
from common import both, random_ids
from tolerances import BF16_REL_FRO, F32_REL_FRO, assert_rel_fro, to_numpy


def numpy_combine(y, src2dst, w, rsf):
    out = np.zeros((src2dst.shape[0], y.shape[1]))
    for t, j in zip(*np.nonzero(src2dst >= 0)):
        out[t] += w[t, j] * y[src2dst[t, j]].astype(np.float64)
    return out * rsf


@pytest.mark.parametrize("dtype,limit", [("float32", F32_REL_FRO), ("bfloat16", BF16_REL_FRO)])
@pytest.mark.parametrize("T,topk,E,start,e_local,rsf", [
    (1, 1, 2, 0, 2, 1.0),  # T=1
    (13, 3, 8, 0, 8, 2.5),  # all local, rsf applied here
    (16, 4, 16, 8, 4, 1.0),  # EP rank: many non-local slots, some tokens with none
])
def test_combine_matches_float64(T, topk, E, start, e_local, rsf, dtype, limit):
    rng = np.random.default_rng(T)
    ids = random_ids(rng, T, topk, E)
    meta = moe_pallas.routing_metadata(both(ids)[0], E, expert_start=start, num_local_experts=e_local)
    src2dst, offsets = to_numpy(meta.src2dst), to_numpy(meta.expert_offsets)
    M, H = int(offsets[-1]), 48
    y = rng.standard_normal((T * topk, H)).astype(np.float32)
    y[M:] = np.nan  # rows >= M hold garbage: they must never reach the output
    w = rng.uniform(0.1, 1.0, (T, topk)).astype(np.float32)
    yr = to_numpy(both(y, dtype)[0]).astype(np.float64)
    ref = numpy_combine(yr, src2dst, w, rsf)
    for mod, idx in ((moe_pallas, 0), (moe_torch, 1)):
        out = mod.combine(both(y, dtype)[idx], both(src2dst)[idx], both(w)[idx], routed_scaling_factor=rsf)
        o = to_numpy(out).astype(np.float64)
        assert np.isfinite(o).all()
        assert_rel_fro(out, ref, limit, mod.__name__)
        no_local = (src2dst < 0).all(axis=1)
        assert not o[no_local].any(), "tokens with no local slot get exactly 0"
