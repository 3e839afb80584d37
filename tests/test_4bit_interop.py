"""4-bit expert weights across the two frameworks (CONTRACT.md section 9).

- The quantizers (``quantize_weight_mxfp4`` / ``quantize_weight_int4``) of ``moe_pallas`` and ``moe_torch``
  give bit-identical codes and scales on random weights with the edge groups planted in them (e2m1 and
  INT4 ties, saturation, zero groups, subnormal weights, a quotient that underflows, huge magnitudes),
  and the dequantizations bit-identical float32 values, also on codes and scales of every bit pattern.
- The codes and scales cross the DLPack bridge (``interop/dlpack.py``) unchanged, both ways, and a
  ``moe_pallas`` op runs on ``moe_torch``'s tensors through ``call_jax``.
- The two 4-bit grouped GEMM references agree within the contract's bf16 row, and each is within it of
  the float64 product with the float32 dequantized weights.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from common import TORCH_DEVICE

import moe_pallas
import moe_torch
from interop.dlpack import call_jax, to_jax, to_torch
from tolerances import BF16_REL_FRO, assert_exact, assert_rel_fro, to_numpy

FORMATS = ("mxfp4", "int4")
DTYPES = {"float32": (jnp.float32, torch.float32), "bfloat16": (jnp.bfloat16, torch.bfloat16),
          "float16": (jnp.float16, torch.float16)}


def planted_weights(seed: int, dtype: str) -> np.ndarray:
    """``w [3, 8, 128]`` float32 of ``N(0, 1)`` groups at several magnitudes, with edge groups planted
    (each row of 32 is one scale group): e2m1 ties at scale 1, INT4 ties at scale 1, saturation, an
    all-zero group (with -0.0), subnormal weights, a quotient that underflows, huge magnitudes."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((3, 8, 128)).astype(np.float32)
    w *= np.float32(10.0) ** rng.integers(-6, 6, size=(3, 8, 4, 1)).repeat(32, -1).reshape(3, 8, 128)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    w[0, 0, :32] = [6.0, *ties, *(-t for t in ties), *([0.0] * 17)]  # MXFP4 ties (s = 127)
    w[0, 0, 32:64] = [7.5, -7.5, 6.5, 5.5, -0.5, 0.5, 1.5, -2.5, *([3.0] * 24)]  # INT4 ties (scale 1)
    w[0, 0, 64:96] = [7.9, -7.9, *([1.0] * 30)]  # MXFP4 saturation
    w[0, 0, 96:] = 0.0
    w[0, 0, 100] = -0.0  # an all-zero group
    w[0, 1, :32] = np.array([2.0**-127, 1.5 * 2.0**-127, 2.0**-129, -(2.0**-128), *([1e-40] * 28)], np.float32)
    w[0, 1, 32:64] = np.array([2.0**100, -(2.0**-30), -(2.0**-149), *([1.0] * 29)], np.float32)  # v underflows
    w[0, 1, 64:96] = rng.standard_normal(32).astype(np.float32) * np.float32(1e37)  # near float32's top
    if dtype == "float16":  # float16 holds none of the extreme groups: scale every group into its range
        w[0, 1] = rng.standard_normal(128).astype(np.float32)
        w = np.clip(w, -6e4, 6e4)
    return w


def codes_bits(a) -> np.ndarray:
    """Raw bytes of a codes / scale array of either framework (bf16 as its 16 bits)."""
    x = to_numpy(a)
    return x.view(np.uint16) if x.dtype == ml_dtypes.bfloat16 else x


def assert_exact_nan_as_nan(a, b, what: str) -> None:
    """Bit-identical, except that any NaN equals any NaN: the NaN of a product with a NaN scale is the
    hardware's (x86 keeps the NaN operand's bits, CUDA gives its canonical 0x7FFFFFFF), not the contract's."""
    x, y = to_numpy(a), to_numpy(b)
    nan = np.isnan(x)
    assert (nan == np.isnan(y)).all(), f"{what}: NaN positions differ"
    assert_exact(np.where(nan, 0, x), np.where(nan, 0, y), what)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_quantizers_bit_identical(fmt, dtype):
    w = planted_weights(1, dtype)
    jdt, tdt = DTYPES[dtype]
    w_j = jnp.asarray(w).astype(jdt)
    w_t = torch.from_numpy(w).to(TORCH_DEVICE).to(tdt)
    assert_exact(to_numpy(w_j.astype(jnp.float32)), to_numpy(w_t.float()), "the same input in both frameworks")
    q_j, s_j = getattr(moe_pallas, f"quantize_weight_{fmt}")(w_j)
    q_t, s_t = getattr(moe_torch, f"quantize_weight_{fmt}")(w_t)
    assert_exact(codes_bits(q_j), codes_bits(q_t), f"{fmt} {dtype} codes")
    assert_exact(codes_bits(s_j), codes_bits(s_t), f"{fmt} {dtype} scales")
    wd_j = getattr(moe_pallas, f"dequantize_weight_{fmt}")(q_j, s_j)
    wd_t = getattr(moe_torch, f"dequantize_weight_{fmt}")(q_t, s_t)
    assert_exact(wd_j, wd_t, f"{fmt} {dtype} dequantized")
    for out in ("bfloat16", "float16"):
        assert_exact(getattr(moe_pallas, f"dequantize_weight_{fmt}")(q_j, s_j, out_dtype=out),
                     getattr(moe_torch, f"dequantize_weight_{fmt}")(q_t, s_t, out_dtype=DTYPES[out][1]),
                     f"{fmt} {dtype} dequantized to {out}")


def test_dequantizers_bit_identical_on_every_bit_pattern():
    # every byte, every e8m0 code (0: the subnormal 2^-127, 254: overflow to inf, 255: NaN), bf16 scales of
    # any bits (subnormal, negative, inf, NaN): both give the IEEE float32 products (signed zeros included).
    rng = np.random.default_rng(7)
    w_q = rng.integers(0, 256, size=(2, 4, 1024), dtype=np.uint8)
    s = rng.integers(0, 256, size=(2, 4, 64), dtype=np.uint8)
    s[0, 0, :4] = [0, 1, 254, 255]
    sb = rng.integers(0, 1 << 16, size=(2, 4, 64), dtype=np.uint16)
    sb[0, 0, :8] = [0x0001, 0x007F, 0x8001, 0x0080, 0x7F80, 0xFF80, 0x7FC0, 0x8000]
    q_t = torch.from_numpy(w_q).to(TORCH_DEVICE)
    mx_t = moe_torch.dequantize_weight_mxfp4(q_t, torch.from_numpy(s).to(TORCH_DEVICE))
    mx_j = moe_pallas.dequantize_weight_mxfp4(jnp.asarray(w_q), jnp.asarray(s))
    assert_exact_nan_as_nan(mx_j, mx_t, "mxfp4 dequantized, any codes")
    i4_t = moe_torch.dequantize_weight_int4(q_t, torch.from_numpy(sb.view(np.int16)).to(TORCH_DEVICE).view(torch.bfloat16))
    i4_j = moe_pallas.dequantize_weight_int4(jnp.asarray(w_q), jnp.asarray(sb.view(ml_dtypes.bfloat16)))
    assert_exact_nan_as_nan(i4_j, i4_t, "int4 dequantized, any scales")


@pytest.mark.parametrize("fmt", FORMATS)
def test_codes_and_scales_cross_dlpack_unchanged(fmt):
    w = planted_weights(2, "float32")
    q_t, s_t = getattr(moe_torch, f"quantize_weight_{fmt}")(torch.from_numpy(w).to(TORCH_DEVICE))
    q_j, s_j = to_jax(q_t), to_jax(s_t)
    assert q_j.dtype == jnp.uint8 and s_j.dtype == (jnp.uint8 if fmt == "mxfp4" else jnp.bfloat16)
    assert_exact(codes_bits(q_j), codes_bits(q_t), f"{fmt} codes torch -> jax")
    assert_exact(codes_bits(s_j), codes_bits(s_t), f"{fmt} scales torch -> jax")
    q_jj, s_jj = getattr(moe_pallas, f"quantize_weight_{fmt}")(jnp.asarray(w))
    q_back, s_back = to_torch(q_jj), to_torch(s_jj)
    assert q_back.dtype == torch.uint8 and s_back.dtype == s_t.dtype
    assert_exact(codes_bits(q_back), codes_bits(q_t), f"{fmt} codes jax -> torch")
    assert_exact(codes_bits(s_back), codes_bits(s_t), f"{fmt} scales jax -> torch")
    # a moe_pallas op on moe_torch's tensors, through the bridge
    wd = call_jax(getattr(moe_pallas, f"dequantize_weight_{fmt}"), q_t, s_t)
    assert isinstance(wd, torch.Tensor)
    assert_exact(wd, getattr(moe_torch, f"dequantize_weight_{fmt}")(q_t, s_t), f"{fmt} call_jax dequantize")


@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_gemm_references_agree_within_the_bf16_row(fmt):
    rng = np.random.default_rng(3)
    counts, m_cap, K, N = [4, 0, 7], 13, 96, 40  # an empty expert, unused rows (NaN: never read), K = 3 groups
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    x = rng.standard_normal((m_cap, K)).astype(np.float32)
    x[offsets[-1]:] = np.nan
    w = (rng.standard_normal((len(counts), N, K)) / np.sqrt(K)).astype(np.float32)
    q_t, s_t = getattr(moe_torch, f"quantize_weight_{fmt}")(torch.from_numpy(w).to(TORCH_DEVICE))
    x_t = torch.from_numpy(x).to(TORCH_DEVICE).to(torch.bfloat16)
    o_t = torch.from_numpy(offsets).to(TORCH_DEVICE)
    y_t = moe_torch.grouped_gemm(x_t, q_t, o_t, w_scale=s_t, w_format=fmt, implementation="reference")
    y_j = moe_pallas.grouped_gemm(to_jax(x_t), to_jax(q_t), to_jax(o_t), w_scale=to_jax(s_t), w_format=fmt,
                                  implementation="reference")
    assert y_j.dtype == jnp.bfloat16 and y_t.dtype == torch.bfloat16
    assert np.isfinite(to_numpy(y_j).astype(np.float32)).all() and torch.isfinite(y_t.float()).all()
    assert_rel_fro(y_j, y_t, BF16_REL_FRO, f"{fmt}: moe_pallas vs moe_torch reference")
    wd = to_numpy(getattr(moe_torch, f"dequantize_weight_{fmt}")(q_t, s_t)).astype(np.float64)
    xs = to_numpy(x_t.float()).astype(np.float64)
    y64 = np.zeros((m_cap, N))
    for e in range(len(counts)):
        y64[offsets[e]:offsets[e + 1]] = xs[offsets[e]:offsets[e + 1]] @ wd[e].T
    assert_rel_fro(y_j, y64, BF16_REL_FRO, f"{fmt}: moe_pallas vs float64")
    assert_rel_fro(y_t, y64, BF16_REL_FRO, f"{fmt}: moe_torch vs float64")


def test_mxfp4_mma_layout_same_bits_in_both_frameworks():
    """``mxfp4_to_mma_layout`` / ``mxfp4_from_mma_layout`` (CONTRACT.md section 9, MMA layout): torch (on the test
    device) and JAX give numpy's bit permutation (``moe_contract/w4_layout.py``) bit for bit, on random codes of a
    layer-like shape and on every byte value; the inverse restores the checkpoint codes; a last axis that is not
    whole 4-byte groups is refused by each, by name."""
    from moe_contract import w4_layout

    rng = np.random.default_rng(11)
    for codes in (rng.integers(0, 256, (3, 5, 24), dtype=np.uint8), np.arange(256, dtype=np.uint8).reshape(2, 128)):
        want = w4_layout.mxfp4_to_mma_layout(codes)
        t = moe_torch.mxfp4_to_mma_layout(torch.from_numpy(codes).to(TORCH_DEVICE))
        j = moe_pallas.mxfp4_to_mma_layout(jnp.asarray(codes))
        assert t.dtype == torch.uint8 and j.dtype == jnp.uint8
        assert_exact(t, want, "torch MMA layout")
        assert_exact(j, want, "jax MMA layout")
        assert_exact(moe_torch.mxfp4_from_mma_layout(t), codes, "torch round trip")
        assert_exact(moe_pallas.mxfp4_from_mma_layout(j), codes, "jax round trip")
    bad = np.zeros((2, 6), np.uint8)
    with pytest.raises(ValueError, match="mxfp4_to_mma_layout: packed codes must be uint8"):
        moe_torch.mxfp4_to_mma_layout(torch.from_numpy(bad))
    with pytest.raises(ValueError, match="mxfp4_from_mma_layout: packed codes must be uint8"):
        moe_pallas.mxfp4_from_mma_layout(jnp.asarray(bad))
