"""FP8 (float8_e4m3fn) quantization reference in jnp: CONTRACT.md section 3.

Every scale is a *dequantization multiplier*: ``x ~= q * scale``.
Mirror: ``moe_torch/ops/quant/reference.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0
#: float32(1/448): scales are ``amax * INV_FP8_MAX`` (a multiplication, exact everywhere).
INV_FP8_MAX = np.float32(1.0 / 448.0)
#: Floor of ``amax`` so that an all-zero row or block gets a finite, positive scale.
AMAX_FLOOR = np.float32(1e-10)


def _cast_fp8(xs: jax.Array) -> jax.Array:
    """Clamp to +-448, then cast with round-to-nearest-even (the clamp removes the stacks' NaN/saturation differences)."""
    return jnp.clip(xs, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def scale_from_amax(amax: jax.Array) -> jax.Array:
    """``max(amax, 1e-10) * float32(1/448)`` in float32."""
    return jnp.maximum(amax.astype(jnp.float32), AMAX_FLOOR) * INV_FP8_MAX


def per_token_group_quant_fp8_reference(x: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    """``x [R, K]`` -> ``(q [R, K] fp8, scale [R, K // group_size] f32)``."""
    R, K = x.shape
    xg = x.astype(jnp.float32).reshape(R, K // group_size, group_size)
    scale = scale_from_amax(jnp.abs(xg).max(axis=-1))
    q = _cast_fp8(xg / scale[..., None])  # IEEE division (correctly rounded)
    return q.reshape(R, K), scale


def static_quant_fp8_reference(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x [..]`` with a given per-tensor ``scale []`` f32 -> ``q [..]`` fp8."""
    return _cast_fp8(x.astype(jnp.float32) / scale.astype(jnp.float32))


def dequantize_fp8_reference(q: jax.Array, scale: jax.Array) -> jax.Array:
    """``q [R, K]`` fp8 with ``scale [R, K // G]`` (per-token: ``G = K``) or ``[]`` -> float32 ``[R, K]``."""
    qf = q.astype(jnp.float32)
    if scale.ndim == 0:
        return qf * scale.astype(jnp.float32)
    R, K = q.shape
    groups = scale.shape[-1]
    return (qf.reshape(R, groups, K // groups) * scale.astype(jnp.float32)[..., None]).reshape(R, K)


def _block_view(w: jax.Array, block: int) -> tuple[jax.Array, tuple[int, int, int]]:
    """``w [E, N, K]`` zero-padded to multiples of ``block`` and viewed as ``[E, nb, block, kb, block]``."""
    E, N, K = w.shape
    nb, kb = -(-N // block), -(-K // block)
    padded = jnp.pad(w, ((0, 0), (0, nb * block - N), (0, kb * block - K)))
    return padded.reshape(E, nb, block, kb, block), (E, N, K)


def quantize_weight_fp8_reference(w: jax.Array, layout: str, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """``w [E, N, K]`` -> ``(q [E, N, K] fp8, scale)`` with scale ``[E]`` (``"per_expert"``),
    ``[E, N]`` (``"per_channel"``) or ``[E, ceil(N/128), ceil(K/128)]`` (``"block"``)."""
    wf = w.astype(jnp.float32)
    if layout == "per_expert":
        scale = scale_from_amax(jnp.abs(wf).max(axis=(1, 2)))
        return _cast_fp8(wf / scale[:, None, None]), scale
    if layout == "per_channel":
        scale = scale_from_amax(jnp.abs(wf).max(axis=2))
        return _cast_fp8(wf / scale[:, :, None]), scale
    view, (E, N, K) = _block_view(wf, block)
    scale = scale_from_amax(jnp.abs(view).max(axis=(2, 4)))  # [E, nb, kb]
    q = _cast_fp8(view / scale[:, :, None, :, None])
    return q.reshape(E, scale.shape[1] * block, scale.shape[2] * block)[:, :N, :K], scale


def expand_weight_scale(w_scale: jax.Array, shape: tuple[int, int, int], block: int = 128) -> jax.Array:
    """Broadcast a weight scale (``[E]``, ``[E, N]`` or block ``[E, nb, kb]``) to ``[E, N, K]`` float32."""
    E, N, K = shape
    s = w_scale.astype(jnp.float32)
    if s.ndim == 1:
        return jnp.broadcast_to(s[:, None, None], shape)
    if s.ndim == 2:
        return jnp.broadcast_to(s[:, :, None], shape)
    return jnp.repeat(jnp.repeat(s, block, axis=1)[:, :N], block, axis=2)[:, :, :K]


def dequantize_weight_fp8_reference(q: jax.Array, w_scale: jax.Array, block: int = 128) -> jax.Array:
    """``q [E, N, K]`` fp8 with any weight-scale layout -> float32 ``[E, N, K]``."""
    return q.astype(jnp.float32) * expand_weight_scale(w_scale, q.shape, block)
