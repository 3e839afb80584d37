"""Grouped GEMM with 4-bit weights in JAX (CONTRACT.md section 9): ``moe_pallas.grouped_gemm(...,
w_format="mxfp4" | "int4")``, its jnp reference and the Pallas-Triton kernel (interpreted here, and
lowered for CUDA on an abstract H200).

The judge is a float64 numpy loop on the float32 dequantized weights (the contract's row: bf16 1e-2,
float32 1e-5). Interpret mode fills the output with NaN before the kernel runs and the unused rows of
``x`` are NaN, so a row the kernel forgets, or a read of a row it does not own, fails the finiteness
checks. Shapes are tiny (interpret mode is slow): every case says which edge it exercises.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

import moe_pallas
from moe_pallas.ops.grouped_gemm.config import GroupedGemmConfig
from moe_pallas.ops.grouped_gemm.pallas_triton import grouped_gemm_pallas_triton
from moe_pallas.ops.grouped_gemm.reference import grouped_gemm_reference
from common import spec_of_kind
from tolerances import BF16_REL_FRO, F32_REL_FRO, assert_exact, assert_rel_fro, to_numpy

FORMATS = ("mxfp4", "int4")
TOL = {"float32": F32_REL_FRO, "bfloat16": BF16_REL_FRO}


def quantize(w, fmt):
    return getattr(moe_pallas, f"quantize_weight_{fmt}")(w)


def dequantize(w_q, w_scale, fmt, out_dtype=jnp.float32):
    return getattr(moe_pallas, f"dequantize_weight_{fmt}")(w_q, w_scale, out_dtype=out_dtype)


def problem(seed: int, counts, m_cap: int, K: int, N: int, fmt: str, dtype="float32"):
    """``x [m_cap, K] ~ N(0, 1)`` (rows ``>= sum(counts)`` NaN: never to be read), 4-bit ``w`` from
    ``N(0, 1/K)`` weights (outputs O(1)), offsets from ``counts``; and the float32 dequantized weights."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m_cap, K)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    x[offsets[-1]:] = np.nan
    w_q, w_scale = quantize(jnp.asarray(rng.standard_normal((len(counts), N, K)) / np.sqrt(K), jnp.float32), fmt)
    return jnp.asarray(x).astype(dtype), w_q, w_scale, jnp.asarray(offsets), dequantize(w_q, w_scale, fmt)


def f64_loop(x, wd, offsets) -> np.ndarray:
    """float64 ``y[m] = x[m] @ wd[e(m)].T`` expert by expert; rows past ``offsets[-1]`` zero."""
    x, wd, offsets = (to_numpy(a).astype(np.float64) if i < 2 else to_numpy(a) for i, a in enumerate((x, wd, offsets)))
    y = np.zeros((x.shape[0], wd.shape[1]))
    for e in range(wd.shape[0]):
        y[offsets[e]:offsets[e + 1]] = x[offsets[e]:offsets[e + 1]] @ wd[e].T
    return y


def check_rows(y, offsets, what: str) -> None:
    y32 = to_numpy(y).astype(np.float32)
    M = int(to_numpy(offsets)[-1])
    assert np.isfinite(y32).all(), f"{what}: {y32.size - np.isfinite(y32).sum()} non-finite values"
    assert not y32[M:].any(), f"{what}: rows >= M must be zero"


#: Small tiles: several row and column tiles and K steps on tiny shapes.
SMALL = GroupedGemmConfig(block_m=8, block_n=16, block_k=64)

# (counts, m_cap, K, N, w_format): the comment on each says which edge it exercises (the float32 test
# below runs both formats).
CASES = {
    "ragged-with-empties": ([5, 0, 11, 0], 20, 64, 24, "mxfp4"),  # empty experts, a tile straddling two experts, unused rows
    "all-rows-one-expert": ([0, 13, 0], 16, 64, 16, "int4"),  # every row on expert 1, experts 0 and 2 empty
    "M=1": ([0, 1], 1, 32, 16, "mxfp4"),  # one row; K = one group, under one K step of 64 (a masked group)
    "K-tail-96": ([3, 4], 9, 96, 16, "int4"),  # K = 96: the second K step of 64 holds one real group, one masked
    "K-tail-160": ([6, 2], 8, 160, 32, "mxfp4"),  # K = 160: five groups, the third K step half masked
}


# --- The reference --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_matches_float64_on_the_dequantized_weights(fmt, dtype):
    x, w_q, w_scale, offsets, wd = problem(0, [5, 0, 11, 3], 22, 96, 40, fmt, dtype)
    # the reference explicitly: on a GPU the default is a kernel, whose float32 sum order differs (not bit-exact)
    y = jax.jit(lambda x, q, s, o: moe_pallas.grouped_gemm(x, q, o, w_scale=s, w_format=fmt, implementation="reference"))(
        x, w_q, w_scale, offsets)
    assert y.dtype == jnp.dtype(dtype) and y.shape == (22, 40)
    check_rows(y, offsets, f"reference {fmt} {dtype}")
    assert_rel_fro(y, f64_loop(x, wd, offsets), TOL[dtype], f"reference {fmt} {dtype} vs float64")
    # weights rounded to x's dtype before the product (CONTRACT.md section 9): the float path on them is the same
    y_float = grouped_gemm_reference(x, dequantize(w_q, w_scale, fmt, dtype), offsets, None, None, jnp.dtype(dtype))
    what = f"reference {fmt} {dtype} vs the float reference on wd in {dtype}"
    if jax.default_backend() == "cpu":
        assert_exact(y, y_float, what)
    else:  # XLA's GPU dots of two compilations may sum in other orders (seen: 4 float32 ulps on the H200)
        assert_rel_fro(y, y_float, 1e-6, what)


# --- The Pallas-Triton kernel, interpreted --------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_pallas_triton_bf16_matches_reference_and_float64(case):
    counts, m_cap, K, N, fmt = CASES[case]
    x, w_q, w_scale, offsets, wd = problem(len(case), counts, m_cap, K, N, fmt, "bfloat16")
    y = grouped_gemm_pallas_triton(x, w_q, offsets, w_scale=w_scale, w_format=fmt, config=SMALL, interpret=True)
    check_rows(y, offsets, f"{case} {fmt}")
    ref = grouped_gemm_reference(x, w_q, offsets, None, w_scale, jnp.bfloat16, w_format=fmt)
    assert_rel_fro(y, ref, BF16_REL_FRO, f"{case} {fmt}: pallas_triton vs reference")
    assert_rel_fro(y, f64_loop(x, wd, offsets), BF16_REL_FRO, f"{case} {fmt}: pallas_triton vs float64")


@pytest.mark.parametrize("fmt", FORMATS)
def test_pallas_triton_float32_under_jit_through_the_api(fmt):
    # float32 x: IEEE dots (HIGHEST); the api under jax.jit; block_k 32 (one group a K step); 2 column tiles.
    x, w_q, w_scale, offsets, wd = problem(7, [4, 0, 6], 12, 64, 32, fmt)
    f = jax.jit(lambda x, q, s, o: moe_pallas.grouped_gemm(x, q, o, w_scale=s, w_format=fmt, implementation="pallas_triton"))
    y = f(x, w_q, w_scale, offsets)
    check_rows(y, offsets, f"float32 {fmt}")
    assert_rel_fro(y, f64_loop(x, wd, offsets), F32_REL_FRO, f"pallas_triton float32 {fmt} vs float64")
    y2 = grouped_gemm_pallas_triton(x, w_q, offsets, w_scale=w_scale, w_format=fmt, interpret=True,
                                    config=GroupedGemmConfig(block_m=16, block_n=16, block_k=32))
    assert_rel_fro(y2, f64_loop(x, wd, offsets), F32_REL_FRO, f"pallas_triton float32 {fmt}, block_k 32")


def test_pallas_triton_nan_scale_reaches_only_its_expert_rows():
    # An e8m0 scale of 255 (NaN) in expert 1, row n = 3, group 1: rows of expert 1 get NaN in column 3 only.
    x, w_q, w_scale, offsets, _ = problem(9, [3, 4], 8, 64, 16, "mxfp4", "bfloat16")
    w_scale = w_scale.at[1, 3, 1].set(255)
    y = to_numpy(grouped_gemm_pallas_triton(x, w_q, offsets, w_scale=w_scale, w_format="mxfp4", config=SMALL,
                                            interpret=True)).astype(np.float32)
    nan = np.isnan(y)
    assert nan[3:7, 3].all() and nan.sum() == 4, np.argwhere(nan).tolist()


# --- Differentiation: x only, straight-through ----------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grad_wrt_x_is_straight_through(fmt, dtype):
    x, w_q, w_scale, offsets, wd = problem(12, [3, 0, 5], 10, 64, 24, fmt, dtype)
    x = jnp.where(jnp.isnan(x), 0.0, x).astype(dtype)  # a finite loss: rows >= M are zero in y anyway
    d_y = jnp.asarray(np.random.default_rng(1).standard_normal((10, 24)), dtype)

    def loss(x):
        return jnp.sum(moe_pallas.grouped_gemm(x, w_q, offsets, w_scale=w_scale, w_format=fmt).astype(jnp.float32)
                       * d_y.astype(jnp.float32))

    d_x = jax.jit(jax.grad(loss))(x)
    assert d_x.dtype == jnp.dtype(dtype)
    # d_x[m] = d_y[m] @ wd[e(m)], wd rounded to d_y's dtype: the float op's gradient on those weights
    wd_x = dequantize(w_q, w_scale, fmt, dtype)
    expected = moe_pallas.grouped_gemm_dgrad(d_y, wd_x, offsets, out_dtype=dtype)
    assert_exact(d_x, expected, f"d_x {fmt} {dtype}")
    ref = np.zeros((10, 64))
    o = to_numpy(offsets)
    for e in range(3):
        ref[o[e]:o[e + 1]] = to_numpy(d_y).astype(np.float64)[o[e]:o[e + 1]] @ to_numpy(wd)[e].astype(np.float64)
    assert_rel_fro(d_x, ref, TOL[dtype], f"d_x {fmt} {dtype} vs float64")


def test_no_gradient_through_the_int4_scale():
    x, w_q, w_scale, offsets, _ = problem(13, [2, 2], 4, 32, 16, "int4")

    def f(s):
        return moe_pallas.grouped_gemm(x, w_q, offsets, w_scale=s, w_format="int4").sum()

    with pytest.raises(TypeError, match="grouped_gemm: w_scale gets no gradient: 4-bit scales are frozen"):
        jax.grad(f)(w_scale)
    # a stopped scale is no request: the gradient w.r.t. x goes through
    g = jax.grad(lambda x: moe_pallas.grouped_gemm(x, w_q, offsets, w_scale=jax.lax.stop_gradient(w_scale),
                                                   w_format="int4").sum())(jnp.nan_to_num(x))
    assert np.isfinite(to_numpy(g)).all()


def test_backward_rule_takes_a_symbolic_zero_cotangent():
    # custom_vjp with symbolic_zeros=True may hand the backward rule a SymbolicZero for y's cotangent: d_x is 0.
    from jax.custom_derivatives import SymbolicZero

    from moe_pallas.ops.grouped_gemm import api

    _, w_q, w_scale, offsets, _ = problem(17, [2, 3], 6, 64, 16, "int4", "bfloat16")
    residuals = (w_q, w_scale, offsets, jnp.zeros((0,), jnp.bfloat16), None)  # last: no bias (its dtype carrier)
    zero = SymbolicZero(jax.core.ShapedArray((6, 16), jnp.bfloat16))
    d_x, *rest = api._grouped_gemm_4bit_bwd(jnp.dtype(jnp.bfloat16), "int4", "reference", residuals, zero)
    assert d_x.shape == (6, 64) and d_x.dtype == jnp.bfloat16 and not to_numpy(d_x).astype(np.float32).any()
    assert rest == [None, None, None, None]


# --- Dispatch and errors --------------------------------------------------------------------------------


def test_mosaic_gpu_has_no_4bit_path():
    x, w_q, w_scale, offsets, _ = problem(14, [2, 2], 4, 32, 16, "mxfp4", "bfloat16")
    with pytest.raises(NotImplementedError, match=r"grouped_gemm\[pallas_mosaic_gpu\]: no 4-bit weights"):
        moe_pallas.grouped_gemm(x, w_q, offsets, w_scale=w_scale, w_format="mxfp4", implementation="pallas_mosaic_gpu")


def test_block_k_must_hold_whole_groups():
    x, w_q, w_scale, offsets, _ = problem(15, [2, 2], 4, 64, 16, "int4", "bfloat16")
    with pytest.raises(NotImplementedError, match="4-bit weights need block_k to be a multiple of 32"):
        grouped_gemm_pallas_triton(x, w_q, offsets, w_scale=w_scale, w_format="int4", interpret=True,
                                   config=GroupedGemmConfig(block_m=8, block_n=16, block_k=16))


def test_bad_inputs():
    x, w_q, w_scale, offsets, wd = problem(16, [2, 2], 4, 64, 16, "int4", "bfloat16")
    gg = moe_pallas.grouped_gemm
    with pytest.raises(ValueError, match="grouped_gemm: w_format must be one of .* for uint8 w"):
        gg(x, w_q, offsets, w_scale=w_scale)
    with pytest.raises(ValueError, match="grouped_gemm: w_format must be None unless w holds 4-bit packed codes"):
        gg(x, wd.astype(jnp.bfloat16), offsets, w_format="int4")
    with pytest.raises(ValueError, match="grouped_gemm: w_format must be one of"):
        gg(x, w_q, offsets, w_scale=w_scale, w_format="nf4")
    with pytest.raises(TypeError, match="grouped_gemm: w_scale must have dtype bfloat16 for int4"):
        gg(x, w_q, offsets, w_scale=w_scale.astype(jnp.float32), w_format="int4")
    with pytest.raises(TypeError, match="grouped_gemm: w_scale must have dtype uint8 for mxfp4"):
        gg(x, w_q, offsets, w_scale=w_scale, w_format="mxfp4")
    with pytest.raises(ValueError, match="grouped_gemm: w_scale must be given for int4"):
        gg(x, w_q, offsets, w_format="int4")
    with pytest.raises(ValueError, match="grouped_gemm: w must be .*K // 2"):
        gg(x, jnp.zeros((2, 16, 64), jnp.uint8), offsets, w_scale=w_scale, w_format="int4")
    with pytest.raises(ValueError, match="grouped_gemm: K .* multiple of 32"):
        gg(x[:, :48], jnp.zeros((2, 16, 24), jnp.uint8), offsets, w_scale=w_scale[..., :1], w_format="int4")
    with pytest.raises(ValueError, match="grouped_gemm: x_scale must be None for int4 w"):
        gg(x, w_q, offsets, x_scale=jnp.ones(()), w_scale=w_scale, w_format="int4")
    with pytest.raises(TypeError, match="grouped_gemm: x must have dtype"):
        gg(x.astype(jnp.float8_e4m3fn), w_q, offsets, w_scale=w_scale, w_format="int4")


@pytest.mark.parametrize("fmt", FORMATS)
def test_int32_packed_codes_are_a_type_error_naming_the_uint8_view(fmt):
    """compressed-tensors' ``weight_packed`` is int32 ``[N, K // 8]``; given as ``w`` it is a TypeError saying to view it
    as uint8 (it was a ValueError telling the user to drop ``w_format``). The uint8 view is the quantizer's codes:
    same GEMM bit for bit."""
    x, w_q, w_scale, offsets, _ = problem(11, [3, 2], 6, 64, 8, fmt, "bfloat16")
    E, N, half_k = w_q.shape
    packed = jax.lax.bitcast_convert_type(w_q.reshape(E, N, half_k // 4, 4), jnp.int32)  # [E, N, K // 8], little-endian
    with pytest.raises(TypeError, match=rf"grouped_gemm: w must have dtype uint8 for w_format='{fmt}' .*view it as "
                                        r"uint8.*got w.dtype=int32"):
        moe_pallas.grouped_gemm(x, packed, offsets, w_scale=w_scale, w_format=fmt)
    with pytest.raises(TypeError, match=r"grouped_gemm: w must have dtype uint8 .*got w.dtype=int8"):
        moe_pallas.grouped_gemm(x, w_q.astype(jnp.int8), offsets, w_scale=w_scale, w_format=fmt)
    unpacked = jax.lax.bitcast_convert_type(packed, jnp.uint8).reshape(E, N, half_k)
    np.testing.assert_array_equal(np.asarray(moe_pallas.grouped_gemm(x, unpacked, offsets, w_scale=w_scale, w_format=fmt)),
                                  np.asarray(moe_pallas.grouped_gemm(x, w_q, offsets, w_scale=w_scale, w_format=fmt)))


# --- The CUDA lowering (abstract H200) ------------------------------------------------------------------

H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "cuda"))
S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_lowers_for_cuda(fmt, dtype):
    M, K, N, E = 200, 2880, 5760 + 64, 32  # gpt-oss-like K, N with a partial column tile
    s_dtype = jnp.uint8 if fmt == "mxfp4" else jnp.bfloat16
    f = functools.partial(grouped_gemm_pallas_triton, interpret=False, w_format=fmt)

    def g(x, w, o, s):
        return f(x, w, o, w_scale=s)

    with use_abstract_mesh(H200):
        text = jax.jit(g).trace(S((M, K), dtype), S((E, N, K // 2), jnp.uint8), S((E + 1,), jnp.int32),
                                S((E, N, K // 32), s_dtype)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1, text[:2000]
    # bf16 x decodes by the packed PTX (moe_contract/w4_packed_asm.py), the other dtypes by the float32 decode
    packed = "fma.rn.bf16x2" in text and ("0x81C081C0" if fmt == "mxfp4" else "0x43004300") in text
    assert packed == (dtype == jnp.bfloat16)


@pytest.mark.parametrize("fmt", [None, *FORMATS])
def test_bug_reference_with_no_local_experts_returns_zeros(fmt):
    """``E_local = 0`` (``expert_offsets = [0]``) with rows: every row is past ``offsets[-1]``, so ``y`` is zero,
    as the Pallas-Triton kernel returns. The reference gathered ``w[e(m)]`` from an empty ``w`` and failed
    with XLA's "Slice size at index 0 in gather op is out of range" (the float path too)."""
    x = jnp.ones((3, 64), jnp.bfloat16)
    if fmt is None:
        w, kw = jnp.ones((0, 4, 64), jnp.bfloat16), {}
    else:
        w_q, w_scale = quantize(jnp.ones((0, 4, 64)), fmt)
        w, kw = w_q, {"w_scale": w_scale, "w_format": fmt}
    for impl in ("reference", "pallas_triton"):
        y = moe_pallas.grouped_gemm(x, w, jnp.zeros((1,), jnp.int32), implementation=impl, **kw)
        assert y.shape == (3, 4) and y.dtype == jnp.bfloat16 and not to_numpy(y).astype(np.float32).any()


def test_heuristic_k_step_of_4bit_weights():
    """bf16 / float16 x with INT4 weights: 128-wide K steps, never wider than K needs (measured faster at every
    decode T; MXFP4 only at T=1, so it keeps 64: BENCHMARKS.md); float32 x keeps its 32; the untuned
    default of ``grouped_gemm_pallas_triton`` asks for it (``w_format``)."""
    from moe_pallas.ops.grouped_gemm.config import grouped_gemm_config, heuristic_grouped_gemm_config

    assert heuristic_grouped_gemm_config(256, 5760, 2880, 128, 2, w_format="int4").block_k == 128
    assert heuristic_grouped_gemm_config(256, 5760, 2880, 128, 2, w_format="mxfp4").block_k == 64
    h200 = spec_of_kind("NVIDIA H200")
    assert grouped_gemm_config(256, 5760, 2880, 128, 2, device=h200, w_format="int4").block_k == 128
    for fmt in ("mxfp4", "int4"):
        assert heuristic_grouped_gemm_config(256, 5760, 2880, 128, 4, w_format=fmt).block_k == 32
        assert heuristic_grouped_gemm_config(8, 64, 64, 4, 2, w_format=fmt).block_k == 64
    assert heuristic_grouped_gemm_config(256, 5760, 2880, 128, 2).block_k == 64  # bf16 weights: 128-byte rows
