"""``silu_and_mul`` / ``gelu_tanh_and_mul`` / ``swiglu_oai_and_mul`` reference in jnp, and its backward:
CONTRACT.md sections 4 and 8, with gate and up read from (and their gradients written to) either gate/up
layout of ``h`` (``"concatenated"``: ``[g | u]``; ``"interleaved"``: ``g0 u0 g1 u1 ...``).

``swiglu_oai`` is transformers' ``GptOssExperts._apply_gate`` (transformers 5.24,
``models/gpt_oss/modeling_gpt_oss.py``): ``gc = min(g, 7)``, ``uc = clamp(u, -7, 7)``,
``out = (uc + 1) * (gc * sigmoid(1.702 * gc))``; the clamps are selects, so a NaN stays NaN, and their
gradient passes at the bounds and is 0 beyond (and for NaN), as torch's ``clamp`` backward. The
elementwise functions here (:func:`gated`, :func:`gated_backward`) are also the Pallas kernels' arithmetic.

Mirror: ``moe_torch/ops/activation/reference.py``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moe_contract.config import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
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


def _clamp_gate(g: jax.Array) -> jax.Array:
    """``min(g, limit)`` as a select: NaN stays NaN."""
    return jnp.where(g > SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT, g)


def _clamp_up(u: jax.Array) -> jax.Array:
    """``clamp(u, -limit, limit)`` as selects: NaN stays NaN."""
    return jnp.where(u > SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT, jnp.where(u < -SWIGLU_OAI_LIMIT, -SWIGLU_OAI_LIMIT, u))


def _swiglu_oai(g: jax.Array) -> jax.Array:
    """gpt-oss's gate activation ``gc * sigmoid(alpha * gc)``, ``gc = min(g, limit)``."""
    gc = _clamp_gate(g)
    return gc * jax.nn.sigmoid(SWIGLU_OAI_ALPHA * gc)


def _swiglu_oai_grad(g: jax.Array) -> jax.Array:
    """``d/dg`` of :func:`_swiglu_oai` where ``g <= limit`` (0 above, and for NaN), ``s = sigmoid(alpha gc)``:
    ``s (1 + alpha gc (1 - s))``."""
    gc = _clamp_gate(g)
    s = jax.nn.sigmoid(SWIGLU_OAI_ALPHA * gc)
    return jnp.where(g <= SWIGLU_OAI_LIMIT, s * (1.0 + SWIGLU_OAI_ALPHA * gc * (1.0 - s)), 0.0)


ACTIVATIONS = {"silu": _silu, "gelu_tanh": _gelu_tanh, "swiglu_oai": _swiglu_oai}
#: ``activation`` -> its derivative ``d act(g) / dg``.
ACTIVATION_GRADS = {"silu": _silu_grad, "gelu_tanh": _gelu_tanh_grad, "swiglu_oai": _swiglu_oai_grad}


def gated(activation: str, g: jax.Array, u: jax.Array) -> jax.Array:
    """``act(g) * u`` (silu, gelu_tanh); swiglu_oai: ``(clamp(u) + 1) * act(g)`` (CONTRACT.md section 4)."""
    if activation == "swiglu_oai":
        return (_clamp_up(u) + 1.0) * _swiglu_oai(g)
    return ACTIVATIONS[activation](g) * u


def gated_backward(activation: str, g: jax.Array, u: jax.Array, da: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(d_g, d_u)`` of :func:`gated` for the cotangent ``da`` (CONTRACT.md section 8). swiglu_oai's clamps
    select the whole product (as torch's ``clamp`` backward): ``d_g = d_a (uc + 1) act'(gc)`` where
    ``g <= limit``, ``d_u = d_a act(gc)`` where ``-limit <= u <= limit``, else (and for NaN) 0."""
    if activation == "swiglu_oai":
        gc = _clamp_gate(g)
        s = jax.nn.sigmoid(SWIGLU_OAI_ALPHA * gc)
        act_grad = s * (1.0 + SWIGLU_OAI_ALPHA * gc * (1.0 - s))
        d_g = jnp.where(g <= SWIGLU_OAI_LIMIT, da * (_clamp_up(u) + 1.0) * act_grad, 0.0)
        d_u = jnp.where((u >= -SWIGLU_OAI_LIMIT) & (u <= SWIGLU_OAI_LIMIT), da * (gc * s), 0.0)
        return d_g, d_u
    return da * u * ACTIVATION_GRADS[activation](g), da * ACTIVATIONS[activation](g)


def split_gate_up(h: jax.Array, layout: str) -> tuple[jax.Array, jax.Array]:
    """``h [M, 2*I]`` -> ``(g, u)`` ``[M, I]`` each, as ``layout`` places them (CONTRACT.md section 4)."""
    if layout == "interleaved":
        return h[:, 0::2], h[:, 1::2]
    inter = h.shape[1] // 2
    return h[:, :inter], h[:, inter:]


def join_gate_up(g: jax.Array, u: jax.Array, layout: str) -> jax.Array:
    """The inverse of :func:`split_gate_up`: ``[M, I]`` twice -> ``[M, 2*I]`` in ``layout``."""
    if layout == "interleaved":
        return jnp.stack([g, u], axis=2).reshape(g.shape[0], 2 * g.shape[1])
    return jnp.concatenate([g, u], axis=1)


def _compute(x: jax.Array) -> jax.Array:
    """``x`` in float32 (the contract's arithmetic), or float64 for float64 input (the tests' autodiff check)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def act_and_mul_reference(
    h: jax.Array, activation: str, quant: str | None, group_size: int, out_dtype, layout: str = "concatenated"
) -> tuple[jax.Array, jax.Array | None]:
    """``h [M, 2*I]`` -> ``act(g) * u`` (:func:`gated`) in float32, then cast or quantize; ``g``, ``u`` as
    ``layout`` places them."""
    out = gated(activation, *split_gate_up(_compute(h), layout))
    if quant is None:
        return cast_rounded(out, out_dtype), None
    if quant == "fp8_per_token":
        return per_token_quant_fp8_reference(out)
    return per_token_group_quant_fp8_reference(out, group_size)


def act_and_mul_backward_reference(
    h: jax.Array, d_a: jax.Array, activation: str, out_dtype, layout: str = "concatenated"
) -> jax.Array:
    """``h [M, 2*I]``, ``d_a [M, I]`` -> ``d_h [M, 2*I]`` (``d_g``, ``d_u`` where ``layout`` has ``g``, ``u``) in
    float32, cast once: ``d_u = d_a * act(g)``, ``d_g = d_a * u * act'(g)`` (silu: ``act'(g) = s (1 + g (1 - s))``;
    swiglu_oai: :func:`gated_backward`)."""
    hf = _compute(h)
    g, u = split_gate_up(hf, layout)
    d_g, d_u = gated_backward(activation, g, u, _compute(d_a).astype(hf.dtype))
    return cast_rounded(join_gate_up(d_g, d_u, layout), out_dtype)
