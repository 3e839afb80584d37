"""``silu_and_mul`` / ``gelu_tanh_and_mul`` reference in jnp, and its backward: CONTRACT.md sections 4 and 8.

Mirror: ``moe_torch/ops/activation/reference.py``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moe_pallas.ops.common import cast_rounded
from moe_pallas.ops.quant.reference import per_token_group_quant_fp8_reference, per_token_quant_fp8_reference

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715


def _silu(g: jax.Array) -> jax.Array:
    return g * jax.nn.sigmoid(g)


def _gelu_tanh(g: jax.Array) -> jax.Array:
    return 0.5 * g * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (g + _GELU_CUBIC * g * g * g)))


def _silu_grad(g: jax.Array) -> jax.Array:
    """``d silu / dg = s * (1 + g * (1 - s))``, ``s = sigmoid(g)``."""
    s = jax.nn.sigmoid(g)
    return s * (1.0 + g * (1.0 - s))


def _gelu_tanh_grad(g: jax.Array) -> jax.Array:
    """The derivative of ``0.5 g (1 + tanh(z))``, ``z = c (g + 0.044715 g^3)``, ``c = sqrt(2/pi)``:
    ``0.5 (1 + tanh z) + 0.5 g (1 - tanh^2 z) c (1 + 3 * 0.044715 g^2)``."""
    t = jnp.tanh(_SQRT_2_OVER_PI * (g + _GELU_CUBIC * g * g * g))
    return 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * g * g)


ACTIVATIONS = {"silu": _silu, "gelu_tanh": _gelu_tanh}
#: ``activation`` -> its derivative ``d act(g) / dg`` (also used inside the Pallas backward kernel).
ACTIVATION_GRADS = {"silu": _silu_grad, "gelu_tanh": _gelu_tanh_grad}


def _compute(x: jax.Array) -> jax.Array:
    """``x`` in float32 (the contract's arithmetic), or float64 for float64 input (the tests' autodiff check)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def act_and_mul_reference(
    h: jax.Array, activation: str, quant: str | None, group_size: int, out_dtype
) -> tuple[jax.Array, jax.Array | None]:
    """``h [M, 2*I]`` -> ``act(h[:, :I]) * h[:, I:]`` in float32, then cast or quantize."""
    inter = h.shape[1] // 2
    hf = _compute(h)
    out = ACTIVATIONS[activation](hf[:, :inter]) * hf[:, inter:]
    if quant is None:
        return cast_rounded(out, out_dtype), None
    if quant == "fp8_per_token":
        return per_token_quant_fp8_reference(out)
    return per_token_group_quant_fp8_reference(out, group_size)


def act_and_mul_backward_reference(h: jax.Array, d_a: jax.Array, activation: str, out_dtype) -> jax.Array:
    """``h [M, 2*I]``, ``d_a [M, I]`` -> ``d_h = [d_g | d_u] [M, 2*I]`` in float32, cast once:
    ``d_u = d_a * act(g)``, ``d_g = d_a * u * act'(g)`` (silu: ``act'(g) = s (1 + g (1 - s))``)."""
    inter = h.shape[1] // 2
    hf = _compute(h)
    g, u = hf[:, :inter], hf[:, inter:]
    da = _compute(d_a).astype(hf.dtype)
    d_u = da * ACTIVATIONS[activation](g)
    d_g = da * u * ACTIVATION_GRADS[activation](g)
    return cast_rounded(jnp.concatenate([d_g, d_u], axis=1), out_dtype)
