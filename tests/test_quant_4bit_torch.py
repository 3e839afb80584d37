"""4-bit expert weights in torch (CONTRACT.md section 9): MXFP4 (e2m1 codes, e8m0 scales) and INT4 group 32
(offset-binary codes, bf16 scales). Named cases with their expected codes and values, round-trip bounds,
the checkpoint layouts, bad inputs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import moe_torch
from tolerances import assert_exact

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def one_group_row(values, K: int = 32) -> torch.Tensor:
    """``values`` padded with zeros to one row of ``K`` float32 (a ``[1, K]`` weight)."""
    row = np.zeros(K, dtype=np.float32)
    row[: len(values)] = values
    return torch.from_numpy(row)[None, :]


def codes_of(w_q: torch.Tensor) -> np.ndarray:
    """Unpacked codes ``[..., K]`` of ``w_q [..., K // 2]`` (element ``2i`` is byte ``i``'s low nibble)."""
    b = w_q.numpy()
    return np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


# --------------------------------------------------------------------------------------
# MXFP4


# One group with amax 7.9: floor(log2(7.9)) = 2, s = 2 - 2 + 127 = 127, the multiplier 2^0 = 1, so v = w.
# (value, expected code): every e2m1 tie of section 9 goes to the even code; just off a tie goes to
# the nearer value; 7.9 saturates to 6; -0.1 rounds to -0 (code 8, the sign bit set because v < 0).
MXFP4_CASES = [
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),  # the ties
    (0.2500001, 1), (0.7499999, 1), (1.2500001, 3), (1.7499999, 3), (2.5000002, 5), (3.4999998, 5), (5.0000005, 7),
    (7.9, 7), (6.0, 7), (-0.1, 8), (0.0, 0), (-0.75, 10), (-5.0, 14), (-7.9, 15), (0.5, 1), (-0.25, 8), (4.0, 6),
]


def test_mxfp4_named_ties_saturation_and_sign():
    w = one_group_row([v for v, _ in MXFP4_CASES])
    w_q, w_scale = moe_torch.quantize_weight_mxfp4(w)
    assert w_q.dtype == torch.uint8 and w_q.shape == (1, 16)
    assert w_scale.dtype == torch.uint8 and w_scale.tolist() == [[127]]
    want = [c for _, c in MXFP4_CASES] + [0] * (32 - len(MXFP4_CASES))
    assert codes_of(w_q)[0].tolist() == want
    wd = moe_torch.dequantize_weight_mxfp4(w_q, w_scale)
    assert_exact(wd[0], torch.from_numpy(E2M1[want].astype(np.float32)), "e2m1 values times 2^0")
    assert torch.signbit(wd[0, 16]).item() and wd[0, 16].item() == 0.0, "-0.1 dequantizes to -0.0"


def test_mxfp4_nibble_order_on_a_hand_built_byte():
    """Byte 0x9F: element 0 = low nibble 0xF (-6), element 1 = high nibble 0x9 (-0.5); s = 128: times 2."""
    w_q = torch.zeros((1, 16), dtype=torch.uint8)
    w_q[0, 0] = 0x9F
    w_q[0, 1] = 0x71  # element 2 = code 1 (0.5), element 3 = code 7 (6)
    wd = moe_torch.dequantize_weight_mxfp4(w_q, torch.tensor([[128]], dtype=torch.uint8))
    assert wd[0, :4].tolist() == [-12.0, -1.0, 1.0, 12.0]
    assert (wd[0, 4:] == 0).all()
    # and the quantizer packs the same way
    q, s = moe_torch.quantize_weight_mxfp4(wd)
    assert s.tolist() == [[128]] and q[0, :2].tolist() == [0x9F, 0x71]


def test_mxfp4_amax_zero_gives_scale_0_and_code_0():
    w = torch.zeros((2, 64))
    w[0, 32:] = -0.0  # -0: v = -0 is not < 0, code 0 as well
    w[1, 32:] = torch.linspace(-1, 1, 32)  # a non-zero group beside it
    w_q, w_scale = moe_torch.quantize_weight_mxfp4(w)
    assert w_scale[:, 0].tolist() == [0, 0] and w_scale[0, 1].item() == 0
    assert (w_q[0] == 0).all() and (w_q[1, :16] == 0).all()
    assert w_scale[1, 1].item() == 125  # amax 1: floor(log2 1) = 0, s = 0 - 2 + 127
    assert (moe_torch.dequantize_weight_mxfp4(w_q, w_scale)[0] == 0).all()


def test_mxfp4_scale_exponent_is_floor_not_round():
    """amax just under 1 (0.99999994): floor(log2) = -1, s = 124, v = amax * 8 = 7.9999995 -> saturates to 6;
    amax = 2^-120: s = 5, v = 4 exactly (code 6)."""
    w_q, w_scale = moe_torch.quantize_weight_mxfp4(one_group_row([np.nextafter(np.float32(1), np.float32(0)), 0.3]))
    assert w_scale.tolist() == [[124]] and codes_of(w_q)[0, :2].tolist() == [7, 4]  # 0.3 * 8 = 2.4 -> 2 (code 4)
    w_q, w_scale = moe_torch.quantize_weight_mxfp4(one_group_row([2.0**-120, -(2.0**-121)]))
    assert w_scale.tolist() == [[5]] and codes_of(w_q)[0, :2].tolist() == [6, 12]


def test_mxfp4_subnormal_amax():
    """amax = 3 * 2^-128 is a float32 subnormal: floor(log2) = -127 clamps s to 0 (the multiplier 2^-127, itself
    subnormal); v = w * 2^127: 1.5 (code 3), 1 (code 2), -0.5 (code 9), 2^-22 (code 0). Dequantized exactly."""
    vals = [3 * 2.0**-128, 2.0**-127, -(2.0**-128), 2.0**-149]
    assert np.float32(vals[0]) < np.finfo(np.float32).tiny
    w_q, w_scale = moe_torch.quantize_weight_mxfp4(one_group_row(vals))
    assert w_scale.tolist() == [[0]]
    assert codes_of(w_q)[0, :4].tolist() == [3, 2, 9, 0]
    wd = moe_torch.dequantize_weight_mxfp4(w_q, w_scale)
    assert wd[0, :4].tolist() == [3 * 2.0**-128, 2.0**-127, -(2.0**-128), 0.0]


def test_mxfp4_e8m0_255_is_a_nan_group_and_0_is_2_pow_minus_127():
    rng = np.random.default_rng(0)
    w_q = torch.from_numpy(rng.integers(0, 256, (2, 3, 32), dtype=np.uint8))
    w_scale = torch.tensor([[[127, 255], [0, 254], [1, 130]], [[255, 255], [127, 128], [126, 3]]], dtype=torch.uint8)
    wd = moe_torch.dequantize_weight_mxfp4(w_q, w_scale)
    nan_groups = (w_scale == 255)[..., None].expand(2, 3, 2, 32).reshape(2, 3, 64)
    assert torch.equal(torch.isnan(wd), nan_groups), "exactly the groups with s = 255 are NaN, all of each"
    expected = E2M1[codes_of(w_q)] * np.exp2(w_scale.numpy().astype(np.float64) - 127).repeat(32, axis=-1)
    finite = ~nan_groups.numpy()
    with np.errstate(over="ignore"):  # s = 254: 2 * 2^127 and above overflow float32 (IEEE: inf)
        expected32 = expected.astype(np.float32)
    assert np.array_equal(wd.numpy()[finite], expected32[finite]), "exact products, subnormals too"
    assert wd[0, 1, :32].abs().max().item() <= 6 * 2.0**-127  # s = 0: the subnormal multiplier 2^-127
    big = wd[0, 1, 32:]  # s = 254: codes with |e2m1| >= 2 overflow to +-inf, the others are exact
    small = torch.from_numpy(np.abs(E2M1[codes_of(w_q)[0, 1, 32:]]) < 2)
    assert torch.isinf(big[~small]).all() and torch.isfinite(big[small]).all() and (~small).any()


def test_mxfp4_round_trip_is_the_nearest_e2m1_multiple():
    """Random weights over many binades: every element is rounded to a nearest e2m1 multiple of its group's
    2^(s - 127) (or 6 when |v| > 6), and the dequantized weights re-quantize to themselves."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((3, 5, 128)) * np.exp(rng.uniform(-20, 20, (3, 5, 4, 1))).repeat(32, -1).reshape(3, 5, 128))
    w = torch.from_numpy(w.astype(np.float32))
    w_q, w_scale = moe_torch.quantize_weight_mxfp4(w)
    wd = moe_torch.dequantize_weight_mxfp4(w_q, w_scale).numpy().astype(np.float64)
    mult = np.exp2(w_scale.numpy().astype(np.float64) - 127).repeat(32, axis=-1)
    v = w.numpy().astype(np.float64) / mult
    dist = np.abs(np.abs(v)[..., None] - np.abs(E2M1[:8]))
    got = np.abs(np.abs(v) - np.abs(wd) / mult)
    assert np.all((got == dist.min(-1)) | ((np.abs(v) > 6) & (np.abs(wd) / mult == 6)))
    assert np.all(np.abs(v).reshape(3, 5, 4, 32).max(-1) < 8) and np.all(np.abs(v).reshape(3, 5, 4, 32).max(-1) >= 4)
    assert np.all(np.sign(wd) * np.sign(v) >= 0), "signs kept"
    q2, s2 = moe_torch.quantize_weight_mxfp4(torch.from_numpy(wd.astype(np.float32)))
    # idempotent on its own grid (as values: a -0 re-quantizes to code 0, +0)
    assert np.array_equal(moe_torch.dequantize_weight_mxfp4(q2, s2).numpy(), wd.astype(np.float32))


# --------------------------------------------------------------------------------------
# INT4


def test_int4_named_codes_amax_and_ties():
    """amax = 7.5: scale = bf16(7.5 * float32(2/15)) = 1 exactly, so q = rne(w): 7.5 -> 8 clamps to 7 (code 15),
    -7.5 -> -8 (code 0), ties to even 2.5 -> 2, 3.5 -> 4, -2.5 -> -2, 0.5 -> 0, 1.5 -> 2; offset binary q + 8."""
    vals = [7.5, -7.5, 2.5, 3.5, -2.5, 0.5, 1.5, -0.49, 6.6]
    w_q, w_scale = moe_torch.quantize_weight_int4(one_group_row(vals))
    assert w_scale.dtype == torch.bfloat16 and w_scale.float().tolist() == [[1.0]]
    assert codes_of(w_q)[0, : len(vals)].tolist() == [15, 0, 10, 12, 6, 8, 10, 8, 15]
    assert (codes_of(w_q)[0, len(vals):] == 8).all(), "zeros are code 8"


def test_int4_amax_and_minus_amax_codes_with_a_rounded_scale():
    """amax = 1: float32(1 * 2/15) = 0.13333334 rounds to bf16 0.1337890625 (137/128 * 2^-3); 1 / that = 7.47 -> 7
    (code 15) and -1 -> -7 (code 1); dequantized: +-0.9365234375."""
    w_q, w_scale = moe_torch.quantize_weight_int4(one_group_row([1.0, -1.0, 0.2]))
    assert w_scale.float().item() == 0.1337890625
    assert float(ml_dtypes.bfloat16(np.float32(1.0) * np.float32(2 / 15))) == 0.1337890625
    assert codes_of(w_q)[0, :3].tolist() == [15, 1, 9]  # 0.2 / 0.1338 = 1.49 -> 1
    wd = moe_torch.dequantize_weight_int4(w_q, w_scale)
    assert wd[0, :3].tolist() == [7 * 0.1337890625, -7 * 0.1337890625, 0.1337890625]


def test_int4_amax_zero():
    """amax 0: the scale is bf16(1e-10 * 2/15) (finite, > 0), every code 8 (q = 0), dequantized exactly 0."""
    w_q, w_scale = moe_torch.quantize_weight_int4(torch.zeros((1, 32)))
    assert w_scale.float().item() == float(ml_dtypes.bfloat16(np.float32(1e-10) * np.float32(2 / 15))) > 0
    assert (w_q == 0x88).all()
    assert (moe_torch.dequantize_weight_int4(w_q, w_scale) == 0).all()


def test_int4_offset_binary_nibble_order_on_a_hand_built_byte():
    """Byte 0x9F: element 0 = low nibble 15 -> q = 7, element 1 = high nibble 9 -> q = 1; 0x08: q = 0, -8."""
    w_q = torch.full((1, 16), 0x88, dtype=torch.uint8)
    w_q[0, 0], w_q[0, 1] = 0x9F, 0x08
    wd = moe_torch.dequantize_weight_int4(w_q, torch.tensor([[0.5]], dtype=torch.bfloat16))
    assert wd[0, :4].tolist() == [3.5, 0.5, 0.0, -4.0]
    assert (wd[0, 4:] == 0).all()


def test_int4_round_trip_bound():
    """Each element within half a step of its group's scale, except above 7.5 steps (clamped to 7)."""
    rng = np.random.default_rng(2)
    w = torch.from_numpy((rng.standard_normal((2, 7, 96)) * np.exp(rng.uniform(-8, 8, (2, 7, 96)))).astype(np.float32))
    w_q, w_scale = moe_torch.quantize_weight_int4(w)
    q = codes_of(w_q).astype(np.float64) - 8
    scale = w_scale.float().numpy().astype(np.float64).repeat(32, axis=-1)
    r = w.numpy().astype(np.float64) / scale
    assert np.all((np.abs(r - q) <= 0.5) | ((q == 7) & (r > 7.5)))
    assert_exact(moe_torch.dequantize_weight_int4(w_q, w_scale), (q * scale).astype(np.float32), "q * scale")


def test_int4_compressed_tensors_int32_view():
    """compressed-tensors' weight_packed [N, K // 8] int32 holds element i at bits 4i: it is w_q viewed as
    little-endian int32, byte for byte."""
    rng = np.random.default_rng(3)
    w = torch.from_numpy(rng.standard_normal((4, 64)).astype(np.float32))
    w_q, _ = moe_torch.quantize_weight_int4(w)
    codes = codes_of(w_q).astype(np.int64).reshape(4, 8, 8)
    packed = (codes << (4 * np.arange(8))).sum(-1)
    packed = ((packed + 2**31) % 2**32 - 2**31).astype(np.int32)  # two's complement wrap, as an int32
    assert np.array_equal(w_q.view(torch.int32).numpy(), packed)


# --------------------------------------------------------------------------------------
# Both formats


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_2d_bf16_chunked_and_not_modified(fmt):
    """[N, K] equals the 3-D result's expert; a bf16 weight quantizes as its float32 value; every chunk size
    gives the same bits; the caller's weight is not modified."""
    quant = getattr(moe_torch, f"quantize_weight_{fmt}")
    rng = np.random.default_rng(4)
    w = torch.from_numpy(rng.standard_normal((3, 6, 64)).astype(np.float32)).to(torch.bfloat16)
    before = w.clone()
    q3, s3 = quant(w)
    assert torch.equal(w.view(torch.int16), before.view(torch.int16))
    q2, s2 = quant(w[1])
    assert torch.equal(q2, q3[1]) and torch.equal(s2.view(torch.uint8), s3[1].view(torch.uint8))
    qf, sf = quant(w.float())
    assert torch.equal(qf, q3)
    qc, sc = quant(w, chunk_bytes=1)  # one row a chunk
    assert torch.equal(qc, q3) and torch.equal(sc.view(torch.uint8), s3.view(torch.uint8))
    assert q3.shape == (3, 6, 32) and s3.shape == (3, 6, 2)
    out = getattr(moe_torch, f"dequantize_weight_{fmt}")(q3, s3, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert_exact(out, getattr(moe_torch, f"dequantize_weight_{fmt}")(q3, s3).to(torch.bfloat16), "rounded once")


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_a_value_error(fmt, bad):
    w = torch.ones((2, 3, 64))
    w[1, 2, 40] = bad
    with pytest.raises(ValueError, match=rf"quantize_weight_{fmt}: w must be finite .* got w\[1, 2, 40\] = {bad}"):
        getattr(moe_torch, f"quantize_weight_{fmt}")(w, chunk_bytes=64 * 4)  # the bad row in the last chunk


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_bad_inputs(fmt):
    quant = getattr(moe_torch, f"quantize_weight_{fmt}")
    dequant = getattr(moe_torch, f"dequantize_weight_{fmt}")
    scale_dtype = torch.uint8 if fmt == "mxfp4" else torch.bfloat16
    with pytest.raises(ValueError, match=rf"quantize_weight_{fmt}: K \(=w.shape\[-1\]\) must be a multiple of 32"):
        quant(torch.ones((2, 3, 48)))
    with pytest.raises(ValueError, match=rf"quantize_weight_{fmt}: w must be \[E, N, K\] or \[N, K\]"):
        quant(torch.ones((2, 2, 3, 32)))
    with pytest.raises(TypeError, match=rf"quantize_weight_{fmt}: w must have dtype"):
        quant(torch.ones((3, 32), dtype=torch.int32))
    with pytest.raises(TypeError, match=rf"quantize_weight_{fmt}: w must be a torch.Tensor"):
        quant(np.ones((3, 32), dtype=np.float32))
    with pytest.raises(ValueError, match=rf"quantize_weight_{fmt}: chunk_bytes must be an int >= 1"):
        quant(torch.ones((3, 32)), chunk_bytes=0)
    w_q, w_scale = torch.zeros((2, 3, 16), dtype=torch.uint8), torch.zeros((2, 3, 1), dtype=scale_dtype)
    with pytest.raises(ValueError, match=rf"dequantize_weight_{fmt}: w_q must be .* K % 32 == 0"):
        dequant(torch.zeros((2, 3, 24), dtype=torch.uint8), w_scale)
    with pytest.raises(TypeError, match=rf"dequantize_weight_{fmt}: w_q must have dtype uint8"):
        dequant(torch.zeros((2, 3, 16), dtype=torch.int8), w_scale)
    with pytest.raises(ValueError, match=rf"dequantize_weight_{fmt}: w_scale must be \[E, N, K // 32\] = \(2, 3, 1\)"):
        dequant(w_q, torch.zeros((2, 3, 2), dtype=scale_dtype))
    with pytest.raises(ValueError, match=rf"dequantize_weight_{fmt}: w_scale must be \[E, N, K // 32\] = \(2, 3, 1\)"):
        dequant(w_q, torch.zeros((3, 1), dtype=scale_dtype))
    other = torch.float32 if fmt == "mxfp4" else torch.uint8
    with pytest.raises(TypeError, match=rf"dequantize_weight_{fmt}: w_scale must have dtype {str(scale_dtype)[6:]} for {fmt}"):
        dequant(w_q, torch.zeros((2, 3, 1), dtype=other))
    with pytest.raises(TypeError, match=rf"dequantize_weight_{fmt}: out_dtype must have dtype"):
        dequant(w_q, w_scale, out_dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"dequantize_weight_{fmt}: w_scale must be given"):
        dequant(w_q, None)
