"""4-bit expert weights in JAX (CONTRACT.md section 9): ``moe_pallas.quantize_weight_mxfp4`` / ``quantize_weight_int4``
and their dequantizations, on the shared cases of ``op_cases/quant_4bit.py`` (named cases with their expected codes
and values, random weights and scales against independent numpy implementations, round-trip bounds, 2-D weights,
chunks, output dtypes, the errors); then what only JAX has: the dequantizers under ``jax.jit``, traced weights
refused, the jnp reference's NaN scale for a non-finite group under jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_pallas
from moe_pallas.ops.quant import reference as ref
from op_cases import JaxArrays
from op_cases.quant_4bit import FORMATS, SHAPE, Quant4bitCases
from tolerances import assert_exact


class TestQuant4bitJax(JaxArrays, Quant4bitCases):
    """The shared cases on ``moe_pallas``'s quantizers."""

    OPS = moe_pallas

    def not_an_array(self):
        import torch

        return torch.ones(2, 64), "w must be a jax array"


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_under_jit_is_the_same(fmt):
    # the weights of the shared test_2d_bf16_chunks_and_out_dtypes (compiled for them already)
    w = jnp.asarray(np.random.default_rng(4).standard_normal(SHAPE).astype(np.float32))
    q, s = getattr(moe_pallas, f"quantize_weight_{fmt}")(w)
    dequant = getattr(moe_pallas, f"dequantize_weight_{fmt}")
    assert_exact(jax.jit(dequant)(q, s), dequant(q, s), f"{fmt} under jit")


@pytest.mark.parametrize("fmt", FORMATS)
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
