"""FP8 quantization (CONTRACT.md section 3): bit-identical across frameworks, round trip, bug cases."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import moe_pallas
import moe_torch
from common import both
from tolerances import assert_exact, to_numpy

FP8 = ml_dtypes.float8_e4m3fn


def wide_range(rng, shape, decades=6.0):
    """Random values spanning many binades (rows of very different magnitude), never all zero."""
    return (rng.standard_normal(shape) * np.exp(rng.uniform(-decades, decades, shape[:-1] + (1,)))).astype(np.float32)


def fp8_half_step(y: np.ndarray) -> np.ndarray:
    """Half the spacing of e4m3fn around ``|y| <= 448``: 3 mantissa bits, subnormal step 2^-9."""
    a = np.abs(y.astype(np.float64))
    exp = np.floor(np.log2(np.maximum(a, 2.0**-6)))
    return 0.5 * 2.0 ** (exp - 3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("op,shape,kw", [
    ("per_token_quant_fp8", (1, 33), {}),  # T=1, odd K
    ("per_token_quant_fp8", (17, 256), {}),
    ("per_token_group_quant_fp8", (9, 256), {"group_size": 128}),
    ("per_token_group_quant_fp8", (5, 192), {"group_size": 64}),
    ("per_token_group_quant_fp8", (3, 7), {"group_size": 7}),  # K == G, odd
])
def test_dynamic_quant_bit_identical(op, shape, kw, dtype):
    x = wide_range(np.random.default_rng(sum(shape)), shape, decades=4 if dtype == "float16" else 6)
    jx, tx = both(x, dtype)
    jq, js = getattr(moe_pallas, op)(jx, **kw)
    tq, ts = getattr(moe_torch, op)(tx, **kw)
    assert_exact(jq, tq, "fp8 codes")
    assert_exact(js, ts, "scales")
    groups = shape[1] // kw.get("group_size", shape[1])
    assert to_numpy(js).shape == (shape[0], groups) and to_numpy(js).dtype == np.float32
    # every group reaches full range: the largest |code| is 448 (the scale is amax / 448)
    q = to_numpy(jq).astype(np.float32).reshape(shape[0], groups, -1)
    np.testing.assert_array_equal(np.abs(q).max(-1), 448.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_static_quant_bit_identical(dtype):
    x = wide_range(np.random.default_rng(5), (6, 100), decades=3)
    scale = np.array(0.01, np.float32)
    jq = moe_pallas.static_quant_fp8(*(a for a in (both(x, dtype)[0], both(scale)[0])))
    tq = moe_torch.static_quant_fp8(both(x, dtype)[1], both(scale)[1])
    assert_exact(jq, tq, "fp8 codes")


@pytest.mark.parametrize("framework", ["jnp", "torch"])
def test_bug_zero_rows_get_finite_scales(framework):
    """Bug case 5: per-token-group FP8 of a [2, 256] input whose row 0 is zeros -> codes 0, scales finite > 0, no NaN."""
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    x[0] = 0.0
    mod, idx = (moe_pallas, 0) if framework == "jnp" else (moe_torch, 1)
    q, s = mod.per_token_group_quant_fp8(both(x)[idx], 128)
    q, s = to_numpy(q).astype(np.float32), to_numpy(s)
    np.testing.assert_array_equal(q[0], 0.0)
    assert np.isfinite(s).all() and (s > 0).all()
    assert not np.isnan(q).any()
    deq = to_numpy(mod.dequantize_fp8(mod.per_token_group_quant_fp8(both(x)[idx], 128)[0], both(s)[idx]))
    np.testing.assert_array_equal(deq[0], 0.0)


@pytest.mark.parametrize("framework", ["jnp", "torch"])
def test_bug_saturation(framework):
    """Bug case 6: static scale 1.0, x = [500, -1000, 1e30, +inf, 1.0] -> dequantized [448, -448, 448, 448, 1]."""
    x = np.array([[500.0, -1000.0, 1e30, np.inf, 1.0]], np.float32)
    one = np.array(1.0, np.float32)
    mod, idx = (moe_pallas, 0) if framework == "jnp" else (moe_torch, 1)
    q = mod.static_quant_fp8(both(x)[idx], both(one)[idx])
    deq = to_numpy(mod.dequantize_fp8(q, both(one)[idx]))
    np.testing.assert_array_equal(deq, [[448.0, -448.0, 448.0, 448.0, 1.0]])


@given(
    rows=st.integers(1, 6),
    groups=st.integers(1, 4),
    group_size=st.sampled_from([1, 8, 128]),
    seed=st.integers(0, 2**31 - 1),
    decades=st.floats(0.0, 20.0),
)
def test_property_fp8_round_trip_within_half_a_step(rows, groups, group_size, seed, decades):
    """|q - x/scale| <= half an FP8 step (in code units) for every element, both frameworks, same bits."""
    rng = np.random.default_rng(seed)
    x = wide_range(rng, (rows, groups * group_size), decades=decades)
    jq, js = moe_pallas.per_token_group_quant_fp8(both(x)[0], group_size)
    tq, ts = moe_torch.per_token_group_quant_fp8(both(x)[1], group_size)
    assert_exact(jq, tq)
    assert_exact(js, ts)
    q = to_numpy(jq).astype(np.float64).reshape(rows, groups, group_size)
    s = to_numpy(js)
    y = (x.reshape(rows, groups, group_size) / s[..., None]).astype(np.float32)  # the float32 quotient
    assert np.all(np.abs(q - y) <= fp8_half_step(y))
    deq = to_numpy(moe_pallas.dequantize_fp8(jq, js)).reshape(rows, groups, group_size)
    assert np.all(np.abs(deq - x.reshape(rows, groups, group_size)) <= fp8_half_step(y) * s[..., None] * (1 + 1e-6))


@pytest.mark.parametrize("layout,shape", [
    ("per_expert", (3, 40, 24)),
    ("per_channel", (2, 17, 33)),  # odd N, K
    ("block", (2, 256, 384)),
    ("block", (3, 200, 130)),  # partial blocks on both dims
])
def test_weight_quant_bit_identical_and_close(layout, shape):
    w = wide_range(np.random.default_rng(7), shape, decades=2)
    jq, js = moe_pallas.quantize_weight_fp8(both(w)[0], layout)
    tq, ts = moe_torch.quantize_weight_fp8(both(w)[1], layout)
    assert_exact(jq, tq, "fp8 codes")
    assert_exact(js, ts, "scales")
    E, N, K = shape
    expected = {"per_expert": (E,), "per_channel": (E, N), "block": (E, -(-N // 128), -(-K // 128))}[layout]
    assert to_numpy(js).shape == expected
    jd = to_numpy(moe_pallas.dequantize_weight_fp8(jq, js))
    td = to_numpy(moe_torch.dequantize_weight_fp8(tq, ts))
    assert_exact(jd, td, "dequantized")
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for values in the normal range of their block
    err = np.abs(jd - w)
    assert np.all(err <= np.abs(w) * 2.0**-4 + to_numpy(ts).max() * 2.0**-9)


def test_jnp_fp8_rounding_exact_even_when_division_is_not():
    """XLA on the GPU divides with div.full.f32 (<= 1 ulp off): feed the jnp rounding step a quotient
    1 ulp too high or too low and it must still give the code of the correctly rounded quotient.
    Inputs sit on and next to FP8 midpoints (times the scale), where a 1-ulp error changes the code,
    including quotients that round to a midpoint in float32 (double rounding, as the contract says)."""
    import jax.numpy as jnp
    from moe_pallas.ops.quant.reference import fp8_round_quotient

    rng = np.random.default_rng(0)
    codes = np.arange(0, 0x7E, dtype=np.uint8)  # every non-negative finite code below 448
    lo = codes.view(FP8).astype(np.float64)
    hi = (codes + 1).view(FP8).astype(np.float64)
    mids = np.concatenate([(lo + hi) / 2, lo, rng.uniform(0, 448, 200)])
    scale = np.float32(np.exp(rng.uniform(-8, 3, mids.size)))
    # x on and within a few ulps of midpoint * scale, both signs
    x = (mids * scale.astype(np.float64)).astype(np.float32)
    x = np.concatenate([np.nextafter(x, -np.inf), x, np.nextafter(x, np.inf), -x])
    s = np.tile(scale, 4)
    expected = np.clip(x / s, -448, 448).astype(FP8)  # the contract: IEEE float32 quotient, then RNE to FP8
    y = np.abs(x) / s
    for bad_y in (np.nextafter(y, np.inf), y, np.nextafter(y, -np.inf)):
        got = np.asarray(fp8_round_quotient(jnp.asarray(x), jnp.asarray(bad_y), jnp.asarray(s)))
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))
