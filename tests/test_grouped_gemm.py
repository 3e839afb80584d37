"""Grouped GEMM (CONTRACT.md section 4): both references against a float64 numpy loop, every FP8 scale layout."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import moe_pallas
import moe_torch
from common import DEVICE, both
from tolerances import BF16_REL_FRO, F32_REL_FRO, FP8_REL_FRO, assert_rel_fro, rel_fro, to_numpy


def numpy_grouped_gemm(x: np.ndarray, w: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """float64 ``y[m] = x[m] @ w[e(m)].T``; rows past ``offsets[-1]`` zero. Independent of both references."""
    y = np.zeros((x.shape[0], w.shape[1]))
    for e in range(w.shape[0]):
        s, t = offsets[e], offsets[e + 1]
        y[s:t] = x[s:t].astype(np.float64) @ w[e].astype(np.float64).T
    return y


def problem(seed: int, counts: list[int], m_cap: int, K: int, N: int):
    """Random x [m_cap, K], w [E, N, K] ~ 1/sqrt(K), offsets from ``counts`` (sum <= m_cap)."""
    rng = np.random.default_rng(seed)
    E = len(counts)
    x = rng.standard_normal((m_cap, K)).astype(np.float32)
    w = (rng.standard_normal((E, N, K)) / np.sqrt(K)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    assert offsets[-1] <= m_cap
    return x, w, offsets


# counts per expert, M_cap, K, N; the comment says which edge.
SHAPES = {
    "one-row": ([1], 1, 64, 32),  # T=1
    "odd-K-N": ([3, 0, 5], 8, 33, 17),  # odd sizes, an empty expert
    "prime-E-with-empties": ([0, 4, 0, 0, 9, 1, 0], 16, 64, 48),  # prime E, empty experts, unused capacity
    "all-on-one": ([0, 0, 12, 0], 12, 128, 64),  # every row on one expert
    "unused-capacity": ([2, 3], 32, 32, 16),  # rows >= M must stay zero
}


@pytest.mark.parametrize("dtype,limit", [("float32", F32_REL_FRO), ("bfloat16", BF16_REL_FRO)])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_grouped_gemm_float(shape, dtype, limit):
    counts, m_cap, K, N = SHAPES[shape]
    x, w, offsets = problem(len(shape), counts, m_cap, K, N)
    # the float64 reference sees the values the GEMM sees (rounded to bf16 if so)
    xr, wr = (to_numpy(both(a, dtype)[0]).astype(np.float64) for a in (x, w))
    ref = numpy_grouped_gemm(xr, wr, offsets)
    for mod, idx in ((moe_pallas, 0), (moe_torch, 1)):
        y = mod.grouped_gemm(both(x, dtype)[idx], both(w, dtype)[idx], both(offsets)[idx])
        assert to_numpy(y).dtype.name == dtype and to_numpy(y).shape == (m_cap, N)
        assert_rel_fro(y, ref, limit, f"{mod.__name__} {dtype}")
        assert not to_numpy(y).astype(np.float32)[offsets[-1]:].any(), "rows >= M are zero"


ACT_SCALES = ["per_tensor", "per_token", "per_token_group"]
WEIGHT_LAYOUTS = ["per_expert", "per_channel", "block"]


def quantize_activation(mod, x, how):
    if how == "per_tensor":
        scale = np.array(np.abs(to_numpy(x)).max() / 448.0, np.float32)
        s = both(scale)[0 if mod is moe_pallas else 1]
        return mod.static_quant_fp8(x, s), s
    if how == "per_token":
        return mod.per_token_quant_fp8(x)
    return mod.per_token_group_quant_fp8(x, 128)


@pytest.mark.parametrize("act,layout", list(itertools.product(ACT_SCALES, WEIGHT_LAYOUTS)))
def test_grouped_gemm_fp8_every_scale_layout(act, layout):
    """FP8 GEMM vs float64 on the dequantized inputs (<= 2e-2), and jnp vs torch (the tighter row: 1e-2)."""
    counts, m_cap, K, N = [5, 0, 11, 3], 24, 256, 160  # N not a multiple of 128: partial weight blocks
    x, w, offsets = problem(11, counts, m_cap, K, N)
    outs = []
    for mod, idx in ((moe_pallas, 0), (moe_torch, 1)):
        xq, xs = quantize_activation(mod, both(x)[idx], act)
        wq, ws = mod.quantize_weight_fp8(both(w)[idx], layout)
        ref = numpy_grouped_gemm(to_numpy(mod.dequantize_fp8(xq, xs)), to_numpy(mod.dequantize_weight_fp8(wq, ws)), offsets)
        y = mod.grouped_gemm(xq, wq, both(offsets)[idx], x_scale=xs, w_scale=ws)
        assert to_numpy(y).dtype.name == "bfloat16"
        assert_rel_fro(y, ref, FP8_REL_FRO, f"{mod.__name__} fp8 {act} x {layout}")
        assert_rel_fro(y, numpy_grouped_gemm(x, w, offsets), 0.1, "fp8 result near the unquantized product")
        outs.append(y)
    assert_rel_fro(outs[0], outs[1], BF16_REL_FRO, "jnp vs torch")


def test_grouped_gemm_fp8_block_scales_applied_per_k_block():
    """With block scales the partial sum of each 128-wide K block gets its own scale: make the
    two K blocks' scales differ by 2^10 and check against the blockwise formula exactly."""
    rng = np.random.default_rng(0)
    N = 128
    x = np.concatenate([rng.standard_normal((4, 128)), 1e-3 * rng.standard_normal((4, 128))], 1).astype(np.float32)
    w = np.concatenate([rng.standard_normal((1, N, 128)), 1e3 * rng.standard_normal((1, N, 128))], 2).astype(np.float32)
    offsets = np.array([0, 4], np.int32)
    for mod, idx in ((moe_pallas, 0), (moe_torch, 1)):
        xq, xs = mod.per_token_group_quant_fp8(both(x)[idx], 128)
        wq, ws = mod.quantize_weight_fp8(both(w)[idx], "block")
        qx, qw = to_numpy(xq).astype(np.float64), to_numpy(wq).astype(np.float64)[0]
        sx, sw = to_numpy(xs), to_numpy(ws)[0]
        blockwise = sum((qx[:, b * 128:(b + 1) * 128] @ qw[:, b * 128:(b + 1) * 128].T) * sx[:, b:b + 1] * sw[0, b]
                        for b in range(2))
        # A misapplied block scale (the activations' K-block 0 scale for both blocks) is an O(1) error:
        # the bound below must stay far under it, or the test could not fail.
        misapplied = sum((qx[:, b * 128:(b + 1) * 128] @ qw[:, b * 128:(b + 1) * 128].T) * sx[:, :1] * sw[0, b]
                         for b in range(2))
        assert rel_fro(misapplied, blockwise) > 0.5
        out_dtype = np.float32 if idx == 0 else torch.float32
        y = mod.grouped_gemm(xq, wq, both(offsets)[idx], x_scale=xs, w_scale=ws, out_dtype=out_dtype)
        # The CPU computes each block's partial sum in float32: F32_REL_FRO. Hopper's FP8 tensor cores
        # accumulate inside a 128-wide K block with about 14 bits (DeepSeek-V3 report, 3.3.2; README
        # "Numerics notes"); the Mosaic GEMM gave 1.23e-4 here on the H200. CONTRACT.md section 7 bounds
        # an FP8 GEMM against the dequantized inputs by FP8_REL_FRO (2e-2), so that is the GPU's bound.
        assert_rel_fro(y, blockwise, F32_REL_FRO if DEVICE == "cpu" else FP8_REL_FRO, mod.__name__)


def test_grouped_gemm_zero_rows():
    """M_cap = 0: an empty result, not an error."""
    w = np.ones((2, 8, 4), np.float32)
    for mod, idx in ((moe_pallas, 0), (moe_torch, 1)):
        y = mod.grouped_gemm(both(np.zeros((0, 4), np.float32))[idx], both(w)[idx], both(np.zeros(3, np.int32))[idx])
        assert tuple(y.shape) == (0, 8)


@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_gemm_jnp_chunked_rows_match_single_chunk(monkeypatch, fp8):
    """The jnp reference gathers weights in chunks of rows at real sizes; force tiny chunks here."""
    from moe_pallas.ops.grouped_gemm import reference as jref

    x, w, offsets = problem(4, [3, 0, 6, 2], 13, 128, 24)
    jx, jw = both(x)[0], both(w)[0]
    kw = {}
    if fp8:
        (jx, xs), (jw, ws) = moe_pallas.per_token_quant_fp8(jx), moe_pallas.quantize_weight_fp8(jw, "block")
        kw = dict(x_scale=xs, w_scale=ws)
    whole = moe_pallas.grouped_gemm(jx, jw, both(offsets)[0], **kw)
    monkeypatch.setattr(jref, "_CHUNK_BYTES", 24 * 128 * 4 * 4)  # 4 rows per chunk, 4 chunks (last padded)
    chunked = moe_pallas.grouped_gemm(jx, jw, both(offsets)[0], **kw)
    assert_rel_fro(chunked, whole, 1e-6, "chunked vs whole")
    assert not to_numpy(chunked).astype(np.float32)[11:].any()


#: Offsets the references refuse (CONTRACT.md section 4: non-decreasing within [0, M_cap]), M_cap = 8, E_local = 3,
#: with the part of the message that names what came.
BAD_OFFSETS = [([0, 5, 3, 8], r"offsets\[2\] = 3 < offsets\[1\] = 5"), ([-2, 1, 4, 8], r"offsets\[0\] = -2 outside"),
               ([0, 2, 4, 9], r"offsets\[3\] = 9 outside \[0, 8\]")]


def _reference_ops(mod, x, w, d_y, bias):
    """``{op name: call(offsets)}`` for the four grouped GEMM ops on their reference implementation."""
    ref = {"implementation": "reference"}
    return {
        "grouped_gemm": lambda off: mod.grouped_gemm(x, w, off, bias=bias, **ref),
        "grouped_gemm_dgrad": lambda off: mod.grouped_gemm_dgrad(d_y, w, off, **ref),
        "grouped_gemm_wgrad": lambda off: mod.grouped_gemm_wgrad(x, d_y, off, **ref),
        "grouped_gemm_dbias": lambda off: mod.grouped_gemm_dbias(d_y, off, **ref),
    }


def _bad_offsets_case():
    rng = np.random.default_rng(3)
    return (rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((3, 5, 4)).astype(np.float32),
            rng.standard_normal((8, 5)).astype(np.float32), rng.standard_normal((3, 5)).astype(np.float32))


def test_reference_bad_offsets_raise_torch():
    """Decreasing, negative or past-M_cap offsets: each reference op raises ValueError naming the op, the argument
    and the offsets (they used to drop or truncate rows silently: zeros where a decreasing expert's rows were)."""
    x, w, d_y, bias = (torch.from_numpy(a).to(DEVICE) for a in _bad_offsets_case())
    for op, call in _reference_ops(moe_torch, x, w, d_y, bias).items():
        call(torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=DEVICE))  # well-formed: served
        for off, came in BAD_OFFSETS:
            with pytest.raises(ValueError, match=rf"^{op}: expert_offsets must be non-decreasing and within "
                                                 rf"\[0, M_cap\] = \[0, 8\].*got \[.*\] \({came}"):
                call(torch.tensor(off, dtype=torch.int32, device=DEVICE))


def test_reference_bad_offsets_raise_jax():
    """As the torch test, for concrete offsets (and through jax.grad of the forward, whose reference sees them
    concrete); under jit the offsets are tracers and the reference cannot check them (documented)."""
    import jax
    import jax.numpy as jnp

    x, w, d_y, bias = (jnp.asarray(a) for a in _bad_offsets_case())
    for op, call in _reference_ops(moe_pallas, x, w, d_y, bias).items():
        call(jnp.asarray([0, 3, 3, 8], jnp.int32))  # well-formed: served
        for off, came in BAD_OFFSETS:
            with pytest.raises(ValueError, match=rf"^{op}: expert_offsets must be non-decreasing and within "
                                                 rf"\[0, M_cap\] = \[0, 8\].*got \[.*\] \({came}"):
                call(jnp.asarray(off, jnp.int32))
    bad = jnp.asarray(BAD_OFFSETS[0][0], jnp.int32)
    loss = lambda x, w: moe_pallas.grouped_gemm(x, w, bad, implementation="reference").sum()  # noqa: E731
    with pytest.raises(ValueError, match="grouped_gemm: expert_offsets must be non-decreasing"):
        jax.grad(loss, argnums=(0, 1))(x, w)
    jax.jit(loss)(x, w)  # tracers: unchecked, no error
