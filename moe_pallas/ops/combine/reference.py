"""Combine (un-permute) reference in jnp, and its backward: CONTRACT.md sections 5 and 8.

Mirror: ``moe_torch/ops/combine/reference.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_pallas.ops.common import cast_rounded


def _compute_dtype(x: jax.Array):
    """float32 (the contract's arithmetic), or float64 for float64 input (the tests' autodiff check)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def combine_reference(
    y: jax.Array, src2dst: jax.Array, topk_weights: jax.Array, routed_scaling_factor: float, out_dtype
) -> jax.Array:
    """``out[t] = rsf * sum_j w[t, j] * y[src2dst[t, j]]`` over local slots, float32, cast once."""
    cdt = _compute_dtype(y)
    valid = src2dst >= 0
    rows = y[jnp.where(valid, src2dst, 0)].astype(cdt)  # [T, topk, H]
    rows = jnp.where(valid[:, :, None], rows, 0.0)  # a non-local slot adds nothing, even if y holds NaN
    weights = jnp.where(valid, topk_weights.astype(cdt), 0.0)
    out = (weights[:, :, None] * rows).sum(axis=1)
    if routed_scaling_factor != 1.0:
        out = out * jnp.float32(routed_scaling_factor)
    return cast_rounded(out, out_dtype)


def combine_backward_reference(
    d_out: jax.Array, y: jax.Array, src2dst: jax.Array, topk_weights: jax.Array, routed_scaling_factor: float
) -> tuple[jax.Array, jax.Array]:
    """``(d_y [M_cap, H] y.dtype, d_topk_weights [T, topk] float32)``, with ``c = float32(rsf)``:
    ``d_y[src2dst[t, j]] = c * w[t, j] * d_out[t]`` (rows no slot names: 0) and
    ``d_topk_weights[t, j] = c * <y[src2dst[t, j]], d_out[t]>`` (0 for non-local slots), in float32.
    Only rows named by ``src2dst`` are read from ``y``; each row is named by at most one slot."""
    cdt = _compute_dtype(y)
    T, topk = src2dst.shape
    M_cap = y.shape[0]
    valid = src2dst >= 0
    c = jnp.float32(routed_scaling_factor)
    do = d_out.astype(cdt)
    rows = jnp.where(valid[:, :, None], y[jnp.where(valid, src2dst, 0)].astype(cdt), 0.0)  # [T, topk, H]
    d_w = jnp.where(valid, (rows * do[:, None, :]).sum(axis=2) * c, 0.0)
    coef = jnp.where(valid, topk_weights.astype(cdt) * c, 0.0)  # [T, topk]
    vals = cast_rounded(coef[:, :, None] * do[:, None, :], y.dtype).reshape(T * topk, y.shape[1])
    # Non-local slots point past the end and are dropped: rows no slot names stay 0.
    d_y = jnp.zeros(y.shape, y.dtype).at[jnp.where(valid, src2dst, M_cap).reshape(-1)].set(vals, mode="drop")
    return d_y, d_w.astype(jnp.promote_types(topk_weights.dtype, cdt))
