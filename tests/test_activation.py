"""silu_and_mul / gelu_tanh_and_mul (CONTRACT.md section 4), optionally fused with FP8 quantization."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import moe_pallas
import moe_torch
from common import both
from tolerances import BF16_REL_FRO, F32_REL_FRO, assert_exact, assert_rel_fro, to_numpy


def numpy_act_and_mul(h: np.ndarray, activation: str) -> np.ndarray:
    h = h.astype(np.float64)
    g, u = np.split(h, 2, axis=1)
    if activation == "silu":
        a = g / (1.0 + np.exp(-g))
    else:
        a = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))
    return a * u


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype,limit", [("float32", F32_REL_FRO), ("bfloat16", BF16_REL_FRO)])
@pytest.mark.parametrize("M,I", [(1, 128), (9, 33), (16, 256)])  # M=1; odd I
def test_act_and_mul_matches_float64(M, I, dtype, limit, activation):
    h = (np.random.default_rng(M * I).standard_normal((M, 2 * I)) * 3).astype(np.float32)
    hr = to_numpy(both(h, dtype)[0]).astype(np.float64)
    ref = numpy_act_and_mul(hr, activation)
    fn = f"{activation}_and_mul"
    for mod, idx in ((moe_pallas, 0), (moe_torch, 1)):
        out, scale = getattr(mod, fn)(both(h, dtype)[idx])
        assert scale is None and to_numpy(out).dtype.name == dtype and to_numpy(out).shape == (M, I)
        assert_rel_fro(out, ref, limit, mod.__name__)


@pytest.mark.parametrize("quant,group", [("fp8_per_token", None), ("fp8_per_token_group", 128)])
def test_act_and_mul_fused_quant(quant, group):
    """Fused = quantize(float32 activation) bit for bit, per framework; jnp vs torch within the bf16 row."""
    h = (np.random.default_rng(2).standard_normal((12, 512)) * 2).astype(np.float32)
    deqs = []
    for mod, idx in ((moe_pallas, 0), (moe_torch, 1)):
        hx = both(h, "bfloat16")[idx]
        q, s = mod.silu_and_mul(hx, quant=quant, group_size=128)
        f32, _ = mod.silu_and_mul(hx, out_dtype=np.float32 if idx == 0 else torch.float32)
        q2, s2 = mod.per_token_quant_fp8(f32) if group is None else mod.per_token_group_quant_fp8(f32, group)
        assert_exact(q, q2, "codes")
        assert_exact(s, s2, "scales")
        deqs.append(mod.dequantize_fp8(q, s))
        ref = numpy_act_and_mul(to_numpy(hx).astype(np.float64), "silu")
        assert_rel_fro(deqs[-1], ref, 2**-4, "fp8 activation near float64")
    # silu's exp may differ by an ulp between XLA and torch, so codes may (rarely) differ by one step
    assert_rel_fro(deqs[0], deqs[1], BF16_REL_FRO, "jnp vs torch")
