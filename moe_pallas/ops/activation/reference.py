"""``silu_and_mul`` / ``gelu_tanh_and_mul`` reference in jnp: CONTRACT.md section 4.

Mirror: ``moe_torch/ops/activation/reference.py``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moe_pallas.ops.common import cast_rounded
from moe_pallas.ops.quant.reference import per_token_group_quant_fp8_reference, per_token_quant_fp8_reference

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _silu(g: jax.Array) -> jax.Array:
    return g * jax.nn.sigmoid(g)


def _gelu_tanh(g: jax.Array) -> jax.Array:
    return 0.5 * g * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)))


ACTIVATIONS = {"silu": _silu, "gelu_tanh": _gelu_tanh}


def act_and_mul_reference(
    h: jax.Array, activation: str, quant: str | None, group_size: int, out_dtype
) -> tuple[jax.Array, jax.Array | None]:
    """``h [M, 2*I]`` -> ``act(h[:, :I]) * h[:, I:]`` in float32, then cast or quantize."""
    inter = h.shape[1] // 2
    hf = h.astype(jnp.float32)
    out = ACTIVATIONS[activation](hf[:, :inter]) * hf[:, inter:]
    if quant is None:
        return cast_rounded(out, out_dtype), None
    if quant == "fp8_per_token":
        return per_token_quant_fp8_reference(out)
    return per_token_group_quant_fp8_reference(out, group_size)
