"""4-bit expert weights in JAX (CONTRACT.md section 9): ``quantize_weight_mxfp4`` / ``quantize_weight_int4``
and their dequantizations in ``moe_pallas``.

Named cases with their expected codes and values (every e2m1 tie, saturation, zero groups, the e8m0 NaN
code and the subnormal scale, subnormal weights, the INT4 extremes and ties, the nibble order of a
hand-built byte), random weights against independent numpy implementations (float64 for MXFP4; numpy's
IEEE float32 division and ``rint`` for INT4), and the errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import moe_pallas
from moe_pallas.ops.quant import reference as ref
from tolerances import assert_exact

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def codes(w_q) -> np.ndarray:
    """Unpacked codes ``[..., K]`` of ``w_q [..., K // 2]``, element ``2i`` from the low nibble (numpy)."""
    b = np.asarray(w_q).astype(np.int64)
    return np.stack([b & 15, b >> 4], -1).reshape(*b.shape[:-1], -1)


def group(values, fill: float = 0.0) -> np.ndarray:
    """One row of 32 float32 values: ``values`` first, then ``fill``."""
    g = np.full(32, fill, np.float32)
    g[: len(values)] = values
    return g.reshape(1, 32)


def f32_bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def np_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Independent MXFP4 quantizer (float64 numpy, no flushing): ``(codes [..., K], s [..., K // 32])``."""
    g = w.astype(np.float32).reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(g).max(-1).astype(np.float64)
    with np.errstate(divide="ignore"):
        fl = np.where(amax > 0, np.floor(np.log2(amax)), -1000)
    s = np.clip(fl - 2 + 127, 0, 254).astype(np.int64)
    v = (g.astype(np.float64) / 2.0 ** (s[..., None] - 127)).astype(np.float32)  # fl32 of the quotient
    a = np.abs(v).astype(np.float64)
    d = np.abs(a[..., None] - E2M1[:8])
    tie = (d == d.min(-1, keepdims=True)).sum(-1) > 1
    even = np.argmax((d == d.min(-1, keepdims=True)) & (np.arange(8) % 2 == 0), -1)
    mag = np.where(tie, even, np.argmin(d, -1))
    return (mag | ((v < 0) << 3)).reshape(w.shape), s


def np_int4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Independent INT4 quantizer (numpy float32 IEEE division, ``rint``): ``(codes, scale bf16)``."""
    g = w.astype(np.float32).reshape(*w.shape[:-1], -1, 32)
    scale = (np.maximum(np.abs(g).max(-1), np.float32(1e-10)) * np.float32(2 / 15)).astype(ml_dtypes.bfloat16)
    q = np.clip(np.rint(g / scale.astype(np.float32)[..., None]), -8, 7)
    return (q + 8).astype(np.int64).reshape(w.shape), scale


# --- MXFP4: named cases -------------------------------------------------------------------------------


def test_mxfp4_every_e2m1_tie_goes_to_the_even_code():
    # amax = 6 -> s = floor(log2 6) - 2 + 127 = 127: scale 1, v = w. Ties (CONTRACT.md section 9):
    # 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4, and their negatives.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    w = group([6.0, *ties, *(-t for t in ties), 0.2500001, 0.7499999, 5.0000005])
    q, s = moe_pallas.quantize_weight_mxfp4(jnp.asarray(w))
    assert int(np.asarray(s)[0, 0]) == 127
    expected = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 1, 1, 7]  # -0.25 -> code 8 (-0): v < 0
    assert codes(q)[0, :18].tolist() == expected
    assert codes(q)[0, 18:].tolist() == [0] * 14


def test_mxfp4_saturates_above_6():
    # amax = 7.9 -> s = 127 (floor(log2 7.9) = 2): |v| = 7.9 rounds to the largest value, 6 (code 7).
    w = group([7.9, -7.9, 5.5, -6.5])
    q, s = moe_pallas.quantize_weight_mxfp4(jnp.asarray(w))
    assert int(np.asarray(s)[0, 0]) == 127
    assert codes(q)[0, :4].tolist() == [7, 15, 7, 15]
    assert np.asarray(moe_pallas.dequantize_weight_mxfp4(q, s))[0, :4].tolist() == [6.0, -6.0, 6.0, -6.0]


def test_mxfp4_zero_group_has_scale_code_0_and_zero_codes():
    # amax = 0 -> s = 0; -0.0 divides to -0.0, which is not < 0: code 0, not 8.
    w = np.zeros((1, 64), np.float32)
    w[0, 3] = -0.0
    w[0, 40] = 1.0  # the second group is ordinary: amax 1 -> s = 125
    q, s = moe_pallas.quantize_weight_mxfp4(jnp.asarray(w))
    assert np.asarray(s).tolist() == [[0, 125]]
    assert codes(q)[0, :32].tolist() == [0] * 32


def test_mxfp4_scale_255_dequantizes_its_group_to_nan():
    w_q = np.full((1, 32), 0x21, np.uint8)  # codes 1, 2 (0.5, 1.0) everywhere, code 0 nowhere
    w_q[0, 16] = 0  # a zero code in the NaN group: NaN too (OCP: the whole group)
    w_s = np.array([[127, 255]], np.uint8)
    wd = np.asarray(moe_pallas.dequantize_weight_mxfp4(jnp.asarray(w_q), jnp.asarray(w_s)))
    assert wd[0, :4].tolist() == [0.5, 1.0, 0.5, 1.0]
    assert np.isnan(wd[0, 32:]).all() and np.isfinite(wd[0, :32]).all()


def test_bug_mxfp4_scale_code_0_is_the_subnormal_2_to_the_minus_127():
    """``s = 0`` means ``2^-127``, a subnormal float32: code 1 (0.5) dequantizes to ``2^-128`` (bits 0x00200000)
    and code 7 (6) to ``1.5 * 2^-125``. XLA's CPU runtime flushes subnormal results of float multiplications
    to zero (the first version gave 0 here, while torch gives ``2^-128``); the dequantizer builds them on the bits."""
    w_q = np.array([[0x71, 0x9F] + [0] * 14], np.uint8)  # codes 1, 7, 15, 9
    wd = moe_pallas.dequantize_weight_mxfp4(jnp.asarray(w_q), jnp.asarray([[0]], jnp.uint8))
    assert f32_bits(wd)[0, :4].tolist() == f32_bits([2.0**-128, 1.5 * 2.0**-125, -1.5 * 2.0**-125, -(2.0**-128)]).tolist()
    wd2 = moe_pallas.dequantize_weight_mxfp4(jnp.asarray(w_q), jnp.asarray([[2]], jnp.uint8))  # 2^-125
    assert f32_bits(wd2)[0, :2].tolist() == f32_bits([2.0**-126, 1.5 * 2.0**-123]).tolist()


def test_bug_mxfp4_subnormal_weights_get_their_codes():
    """A group of subnormal weights: ``amax < 2^-126`` -> ``s = 0``, ``v = w * 2^127`` is an ordinary number.
    ``2^-127 -> v = 1`` (code 2), ``1.5 * 2^-127 -> 1.5`` (code 3), ``2^-129 -> 0.25`` (tie: code 0),
    ``-2^-128 -> -0.5`` (code 9). The first version multiplied in float32 and XLA's CPU runtime flushed
    the subnormal inputs: every code was 0."""
    w = group([2.0**-127, 1.5 * 2.0**-127, 2.0**-129, -(2.0**-128)])
    q, s = moe_pallas.quantize_weight_mxfp4(jnp.asarray(w))
    assert int(np.asarray(s)[0, 0]) == 0
    assert codes(q)[0, :5].tolist() == [2, 3, 0, 9, 0]


def test_mxfp4_sign_bit_only_where_the_quotient_is_nonzero():
    # amax = 2^100 -> s = 225: v = w * 2^-98. -2^-30 -> v = -2^-128 (subnormal, nonzero): code 8 (-0);
    # -2^-149 -> v underflows to -0.0, which is not < 0: code 0. (CONTRACT.md: "the sign bit is set when v < 0".)
    w = group([2.0**100, -(2.0**-30), -(2.0**-149)])
    q, s = moe_pallas.quantize_weight_mxfp4(jnp.asarray(w))
    assert int(np.asarray(s)[0, 0]) == 225
    assert codes(q)[0, :3].tolist() == [6, 8, 0]


def test_mxfp4_largest_scale_overflows_to_inf():
    # s = 254: 6 * 2^127 is above float32's range -> inf (IEEE); 1.5 * 2^127 is finite.
    w_q = np.array([[0x37] + [0] * 15], np.uint8)  # codes 7 (6), 3 (1.5)
    wd = np.asarray(moe_pallas.dequantize_weight_mxfp4(jnp.asarray(w_q), jnp.asarray([[254]], jnp.uint8)))
    assert wd[0, 0] == np.inf and wd[0, 1] == np.float32(1.5 * 2.0**127)


# --- INT4: named cases --------------------------------------------------------------------------------


def test_int4_extremes_and_ties():
    # amax = 7.5 -> scale = bf16(7.5 * float32(2/15)) = 1.0, q = rne(w): ties to even, clamp to [-8, 7].
    w = group([7.5, -7.5, 6.5, 5.5, -0.5, 0.5, 1.5, -2.5, 0.4999999, -7.0])
    q, s = moe_pallas.quantize_weight_int4(jnp.asarray(w))
    assert np.asarray(s.astype(jnp.float32)).tolist() == [[1.0]]
    assert (codes(q)[0, :10] - 8).tolist() == [7, -8, 6, 6, 0, 0, 2, -2, 0, -7]
    assert (codes(q)[0, 10:] - 8).tolist() == [0] * 22
    wd = np.asarray(moe_pallas.dequantize_weight_int4(q, s))
    assert wd[0, :2].tolist() == [7.0, -8.0]


def test_int4_zero_group_scale_is_the_floor():
    q, s = moe_pallas.quantize_weight_int4(jnp.zeros((1, 32), jnp.float32))
    expected = (np.float32(1e-10) * np.float32(2 / 15)).astype(ml_dtypes.bfloat16)
    assert_exact(s, np.array([[expected]]), "int4 scale of an all-zero group")
    assert codes(q).tolist() == [[8] * 32]


def test_int4_near_ties_follow_the_ieee_quotient():
    # w = (k + 0.5) * scale, moved by -2..2 ulp: the float32 quotient decides (numpy's IEEE division + rint).
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 8, 64)).astype(np.float32)
    _, scale = np_int4(w)
    k = rng.integers(-8, 8, size=w.shape) + 0.5
    w = (k * np.repeat(scale.astype(np.float32), 32, -1)).astype(np.float32)
    w = (w.view(np.int32) + rng.integers(-2, 3, size=w.shape).astype(np.int32)).view(np.float32)
    q, s = moe_pallas.quantize_weight_int4(jnp.asarray(w))
    c, sc = np_int4(w)
    assert_exact(s, sc, "int4 scales")
    assert_exact(codes(q), c, "int4 codes near ties")


# --- Layout ---------------------------------------------------------------------------------------------


def test_nibble_order_of_a_hand_built_byte():
    # byte 0x9F: element 0 = low nibble 0xF, element 1 = high nibble 0x9.
    w_q = np.array([[0x9F] + [0x88] * 15], np.uint8)
    mx = np.asarray(moe_pallas.dequantize_weight_mxfp4(jnp.asarray(w_q), jnp.asarray([[127]], jnp.uint8)))
    assert mx[0, :2].tolist() == [-6.0, -0.5]  # e2m1 15 = -6, 9 = -0.5
    i4 = np.asarray(moe_pallas.dequantize_weight_int4(jnp.asarray(w_q), jnp.asarray([[0.5]], jnp.bfloat16)))
    assert i4[0, :3].tolist() == [3.5, 0.5, 0.0]  # (15 - 8) * 0.5, (9 - 8) * 0.5, (8 - 8) * 0.5
    # and the quantizer writes it: element 0 -> low nibble
    q, _ = moe_pallas.quantize_weight_mxfp4(jnp.asarray(group([-6.0, -0.5])))
    assert int(np.asarray(q)[0, 0]) == 0x9F


def test_int4_codes_are_compressed_tensors_weight_packed_as_little_endian_int32():
    # compressed-tensors pack-quantized: eight codes an int32, element i at bits 4i.
    rng = np.random.default_rng(5)
    w = rng.standard_normal((3, 64)).astype(np.float32)
    q, _ = moe_pallas.quantize_weight_int4(jnp.asarray(w))
    packed = np.asarray(q).view("<i4")  # [3, 64 // 8]
    c = codes(q)
    expected = sum(c[:, i::8].astype(np.int64) << (4 * i) for i in range(8)).astype(np.uint32).view(np.int32)
    assert_exact(packed, expected, "weight_packed")


# --- Random weights against numpy ---------------------------------------------------------------------


@pytest.mark.parametrize("magnitude", [1.0, 1e-3, 1e30, 1e-38, 1e-42])  # normal .. all-subnormal groups
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_random_weights_match_numpy(magnitude, dtype):
    if dtype == "float16" and not 1e-3 <= magnitude <= 1.0:
        pytest.skip("float16 cannot hold these magnitudes")
    rng = np.random.default_rng(11)
    w = jnp.asarray((rng.standard_normal((2, 6, 96)) * magnitude).astype(np.float32)).astype(dtype)
    w32 = np.asarray(w.astype(jnp.float32))
    q, s = moe_pallas.quantize_weight_mxfp4(w)
    c, sc = np_mxfp4(w32)
    assert q.shape == (2, 6, 48) and q.dtype == jnp.uint8 and s.shape == (2, 6, 3) and s.dtype == jnp.uint8
    assert_exact(np.asarray(s).astype(np.int64), sc, "mxfp4 scales")
    assert_exact(codes(q), c, "mxfp4 codes")
    wd = np.asarray(moe_pallas.dequantize_weight_mxfp4(q, s))
    expected = (E2M1[c].reshape(2, 6, 3, 32) * 2.0 ** (sc.astype(np.float64) - 127)[..., None]).astype(np.float32)
    assert_exact(wd, expected.reshape(wd.shape), "mxfp4 dequantized")
    q, s = moe_pallas.quantize_weight_int4(w)
    c, sc = np_int4(w32)
    assert s.dtype == jnp.bfloat16
    assert_exact(s, sc, "int4 scales")
    assert_exact(codes(q), c, "int4 codes")
    wd = np.asarray(moe_pallas.dequantize_weight_int4(q, s))
    expected = (c - 8).astype(np.float32).reshape(2, 6, 3, 32) * sc.astype(np.float32)[..., None]
    assert_exact(wd, expected.reshape(wd.shape), "int4 dequantized")


def test_random_scales_dequantize_exactly():
    # every byte and every e8m0 code (0: subnormal, 255: NaN); bf16 scales of any bits (subnormal, negative,
    # inf, NaN): the IEEE float32 products, as numpy computes them (no flushing).
    rng = np.random.default_rng(2)
    w_q = rng.integers(0, 256, size=(2, 4, 1024), dtype=np.uint8)
    s = rng.integers(0, 256, size=(2, 4, 64), dtype=np.uint8)
    c = codes(w_q)
    with np.errstate(over="ignore"):
        expected = (E2M1[c].reshape(2, 4, 64, 32) * np.where(s == 255, np.nan, 2.0 ** (s - 127.0))[..., None]).astype(np.float32)
    wd = np.asarray(moe_pallas.dequantize_weight_mxfp4(jnp.asarray(w_q), jnp.asarray(s)))
    nan = np.isnan(expected.reshape(wd.shape))
    assert (np.isnan(wd) == nan).all()
    assert_exact(np.where(nan, 0, wd), np.where(nan, 0, expected.reshape(wd.shape)), "mxfp4 any codes")
    sb = rng.integers(0, 1 << 16, size=(2, 4, 64), dtype=np.uint16)
    sb[0, 0, :8] = [0x0001, 0x007F, 0x8001, 0x0080, 0x7F80, 0xFF80, 0x7FC0, 0x8000]
    scale = sb.view(ml_dtypes.bfloat16)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = ((c - 8).astype(np.float32).reshape(2, 4, 64, 32) * scale.astype(np.float32)[..., None]).reshape(wd.shape)
    wd = np.asarray(moe_pallas.dequantize_weight_int4(jnp.asarray(w_q), jnp.asarray(scale)))
    nan = np.isnan(expected)
    assert (np.isnan(wd) == nan).all()
    assert_exact(np.where(nan, 0, wd), np.where(nan, 0, expected), "int4 any scales")


def test_bug_float16_output_keeps_its_subnormals():
    """``out_dtype=float16`` of a value below float16's smallest normal (``2^-14``): ``2^-17`` is a float16
    subnormal and ``3 * 2^-26`` rounds to ``2^-24`` (the grid's nearest even). The rounding helper
    ``moe_pallas.ops.common.cast_rounded`` used ``lax.reduce_precision``, which flushes them to 0 (torch and
    numpy keep them): the first version returned 0 for both."""
    w_q = np.array([[0x99] + [0x88] * 15], np.uint8)  # codes 9, 9: q = 1
    for scale, expected in ((2.0**-17, 2.0**-17), (3 * 2.0**-26, 2.0**-24)):
        wd = moe_pallas.dequantize_weight_int4(jnp.asarray(w_q), jnp.asarray([[scale]], jnp.bfloat16), out_dtype="float16")
        assert np.asarray(wd)[0, :2].astype(np.float64).tolist() == [expected, expected]


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_out_dtype_rounds_to_nearest_even_and_jit_is_the_same(fmt):
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.standard_normal((2, 3, 64)).astype(np.float32))
    q, s = getattr(moe_pallas, f"quantize_weight_{fmt}")(w)
    dequant = getattr(moe_pallas, f"dequantize_weight_{fmt}")
    wd = np.asarray(dequant(q, s))
    for dt in ("bfloat16", "float16"):
        assert_exact(dequant(q, s, out_dtype=dt), wd.astype(getattr(ml_dtypes, dt, np.float16)), f"{fmt} -> {dt}")
    assert_exact(jax.jit(dequant)(q, s), wd, f"{fmt} under jit")
    # 2-D (one expert), and the quantizer's chunks (one row a chunk here) give the same bits
    q2, s2 = getattr(moe_pallas, f"quantize_weight_{fmt}")(w[1])
    assert_exact(q2, q[1], "2-D codes")
    assert_exact(s2, s[1], "2-D scales")
    q3, s3 = getattr(moe_pallas, f"quantize_weight_{fmt}")(w, chunk_bytes=1)
    assert_exact(q3, q, "chunked codes")
    assert_exact(s3, s, "chunked scales")


# --- Errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_a_value_error(fmt, bad):
    w = np.ones((2, 3, 64), np.float32)
    w[1, 2, 40] = bad
    with pytest.raises(ValueError, match=rf"quantize_weight_{fmt}: w must be finite .* w\[1, 2, 40\] = {bad}"):
        getattr(moe_pallas, f"quantize_weight_{fmt}")(jnp.asarray(w))


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_traced_weights_are_a_type_error(fmt):
    with pytest.raises(TypeError, match=f"quantize_weight_{fmt}: w must be a concrete array"):
        jax.jit(getattr(moe_pallas, f"quantize_weight_{fmt}"))(jnp.ones((2, 64)))


def test_the_reference_under_jit_gives_non_finite_groups_a_nan_scale():
    w = np.ones((1, 64), np.float32)
    w[0, 5] = np.nan
    _, s = jax.jit(ref.quantize_weight_mxfp4_reference)(jnp.asarray(w))
    assert np.asarray(s).tolist() == [[255, 125]]
    _, s = jax.jit(ref.quantize_weight_int4_reference)(jnp.asarray(w))
    assert np.isnan(np.asarray(s.astype(jnp.float32))[0, 0]) and np.isfinite(np.asarray(s.astype(jnp.float32))[0, 1])


def test_shape_and_dtype_errors():
    with pytest.raises(ValueError, match="quantize_weight_mxfp4: K .* multiple of 32"):
        moe_pallas.quantize_weight_mxfp4(jnp.ones((2, 3, 48)))
    with pytest.raises(TypeError, match="quantize_weight_int4: w"):
        moe_pallas.quantize_weight_int4(jnp.ones((2, 64), jnp.int32))
    with pytest.raises(TypeError, match="dequantize_weight_int4: w_scale must have dtype bfloat16"):
        moe_pallas.dequantize_weight_int4(jnp.zeros((2, 16), jnp.uint8), jnp.zeros((2, 1), jnp.uint8))
    with pytest.raises(ValueError, match="dequantize_weight_mxfp4: w_scale"):
        moe_pallas.dequantize_weight_mxfp4(jnp.zeros((2, 16), jnp.uint8), jnp.zeros((2, 2), jnp.uint8))
    with pytest.raises(TypeError, match="quantize_weight_mxfp4: w must be a jax array"):
        import torch

        moe_pallas.quantize_weight_mxfp4(torch.ones(2, 64))
