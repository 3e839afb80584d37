"""FP8 quantization (CONTRACT.md section 3): bit-identical across frameworks, round trip, bug cases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
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


#: (rows, groups, group_size) of the round-trip property: a fixed set, so that JAX compiles each shape once (a new
#: shape per example cost ~1.3 s of XLA compile, 25 examples ~33 s of CI); the values stay random (seed, decades).
#: The edges of the former ranges (rows 1..6, groups 1..4, group_size 1 / 8 / 128): T = 1, one group, one element
#: per group, the 128-wide groups, odd row and group counts.
ROUND_TRIP_SHAPES = [(1, 1, 128), (1, 4, 1), (6, 1, 8), (5, 3, 128), (6, 4, 1), (3, 2, 8)]


@given(
    shape=st.sampled_from(ROUND_TRIP_SHAPES),
    seed=st.integers(0, 2**31 - 1),
    decades=st.floats(0.0, 20.0),
)
def test_property_fp8_round_trip_within_half_a_step(shape, seed, decades):
    """|q - x/scale| <= half an FP8 step (in code units) for every element, both frameworks, same bits."""
    rows, groups, group_size = shape
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


# --- XLA's GPU compiler, emulated on the CPU ---------------------------------------------------------


def _run_as_xla_gpu(fn, *args, div_ulps: int):
    """``fn(*args)`` evaluated equation by equation as XLA's GPU compiler would leave it, on any device:

    - a chain of float -> float converts ``A -> B -> C`` becomes ``A -> C`` (``A`` itself when ``C`` is
      ``A``'s dtype): ``SimplifyFPConversions``, which the GPU pipeline runs under
      ``--xla_allow_excess_precision`` (on by default), so an FP8 code's ``q.astype(float32)`` is the
      float32 value it was made from;
    - float division is off by ``div_ulps`` ulps (``div.full.f32``, openxla/xla#37181).

    Handles ``jit`` (nested jaxprs, followed through their inputs and outputs); other primitives are
    bound as they are."""
    closed = jax.make_jaxpr(fn)(*args)
    outs, _ = _eval_as_xla_gpu(closed.jaxpr, closed.consts, args, [None] * len(args), div_ulps)
    return outs


def _eval_as_xla_gpu(jaxpr, consts, args, arg_origins, div_ulps):
    from jax.extend.core import Literal

    env, origin = {}, {}  # origin[v]: the start A of the float convert chain whose last convert made v

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    for v, a, o in zip(jaxpr.invars, args, arg_origins):
        env[v] = a
        if o is not None:
            origin[v] = o
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name, params = eqn.primitive.name, eqn.params
        out_origins = [None] * len(eqn.outvars)
        if name in ("jit", "pjit") and "jaxpr" in params:
            sub = params["jaxpr"]
            in_origins = [None if isinstance(v, Literal) else origin.get(v) for v in eqn.invars]
            outs, out_origins = _eval_as_xla_gpu(sub.jaxpr, sub.consts, ins, in_origins, div_ulps)
        elif name == "convert_element_type" and jnp.issubdtype(params["new_dtype"], jnp.floating):
            chained = None if isinstance(eqn.invars[0], Literal) else origin.get(eqn.invars[0])
            base = ins[0] if chained is None else chained
            outs = [jnp.asarray(base).astype(params["new_dtype"])]  # the chain's start, converted once
            out_origins = [base]
        elif name == "div" and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
            exact = eqn.primitive.bind(*ins, **params)
            bits = jax.lax.bitcast_convert_type(jnp.abs(exact), jnp.int32) + div_ulps  # one step of |y|
            outs = [jnp.copysign(jax.lax.bitcast_convert_type(jnp.maximum(bits, 0), jnp.float32), exact)]
        else:
            outs = eqn.primitive.bind(*ins, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for v, val, o in zip(eqn.outvars, outs, out_origins):
            env[v] = val
            if o is not None:
                origin[v] = o
    return [read(v) for v in jaxpr.outvars], [None if isinstance(v, Literal) else origin.get(v) for v in jaxpr.outvars]


def _near_midpoint_bf16(groups: np.ndarray, axes: tuple[int, ...], seed: int) -> np.ndarray:
    """``groups`` (one scale group = the elements along ``axes``) made bf16 values whose groups each
    hold their amax once and ``+-amax * 2^-16`` at a quarter of the places: quotients a hair from the
    FP8 midpoint ``3.5 * 2^-9``, where the H200 got 6 of 540000 block codes wrong
    (``x = 0.0024719238 = 162 * 2^-16``: torch ``3 * 2^-9``, jnp ``4 * 2^-9``)."""
    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16
    amax_shape = tuple(1 if i in axes else n for i, n in enumerate(groups.shape))
    amax = np.exp(rng.uniform(-6, 6, amax_shape)).astype(bf16).astype(np.float32)
    g = groups.astype(bf16).astype(np.float32)
    g = (g * amax / np.abs(g).max(axis=axes, keepdims=True) / 2).astype(bf16).astype(np.float32)  # all below amax,
    first = tuple(slice(0, 1) if i in axes else slice(None) for i in range(g.ndim))
    g[first] = amax  # which one element per group holds
    pick = rng.random(g.shape) < 0.25
    g[pick] = (np.broadcast_to(amax, g.shape) * 2.0**-16 * rng.choice([-1, 1], g.shape))[pick]
    return g.astype(bf16)


@pytest.mark.parametrize("div_ulps", [-1, 1])
def test_jnp_fp8_codes_survive_xla_gpu_convert_folding(div_ulps):
    """Regression (H200, jax 0.11): under ``jit`` on the GPU, XLA replaced ``q.astype(float32)`` in
    ``fp8_round_quotient`` by the float32 quotient ``q`` was made from (``SimplifyFPConversions``), which
    switched the repair off: the codes were those of the approximate quotient (block-scaled bf16 weights:
    6 of 540000 codes one step off from torch's and from the CPU's). Emulated here on the CPU with a
    1-ulp-off division: the jnp reference, the chunked weight quantization's chunk step and the
    per-token-group quantization still give the correctly rounded quotient's codes."""
    from moe_pallas.ops.quant import reference as jref

    rng = np.random.default_rng(12)
    w = _near_midpoint_bf16(rng.standard_normal((2, 128, 2, 128)) * np.exp(rng.uniform(-3, 3, (2, 128, 1, 1))), (1, 3), 1)
    w = w.reshape(2, 128, 256)  # [E, N, K]: 4 blocks of 128 x 128
    wj = jnp.asarray(w)
    tq, ts = moe_torch.quantize_weight_fp8(torch.from_numpy(w.astype(np.float32)).to(torch.bfloat16), "block")
    # the inputs reach the case: the approximate quotient's own code is wrong somewhere
    y = np.abs(w.astype(np.float32)).reshape(2, 128, 2, 128) / to_numpy(ts).reshape(2, 1, 2, 1)
    naive = np.clip((y.view(np.int32) + div_ulps).view(np.float32), 0, 448).astype(FP8).reshape(w.shape)
    assert (naive.view(np.uint8) != (to_numpy(tq).view(np.uint8) & 0x7F)).any()
    q, s = _run_as_xla_gpu(lambda a: jref.quantize_weight_fp8_reference(a, "block"), wj, div_ulps=div_ulps)
    assert_exact(s, ts, "scales")
    assert_exact(q, tq, f"reference codes, division {div_ulps:+d} ulp")
    q, _ = _run_as_xla_gpu(lambda a: jref._quantize_weight_chunk(a, "block", 128), wj, div_ulps=div_ulps)
    assert_exact(q, tq, f"chunk codes, division {div_ulps:+d} ulp")
    x = _near_midpoint_bf16(rng.standard_normal((64, 2, 128)), (2,), 2).reshape(64, 256).astype(np.float32)  # T x 2 groups
    q, _ = _run_as_xla_gpu(lambda a: jref.per_token_group_quant_fp8_reference(a, 128), jnp.asarray(x), div_ulps=div_ulps)
    tq, _ = moe_torch.per_token_group_quant_fp8(torch.from_numpy(x), 128)
    assert_exact(q, tq, f"per-token-group codes, division {div_ulps:+d} ulp")
