"""Combine (un-permute) reference in jnp: CONTRACT.md section 5.

Mirror: ``moe_torch/ops/combine/reference.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_pallas.ops.common import cast_rounded


def combine_reference(
    y: jax.Array, src2dst: jax.Array, topk_weights: jax.Array, routed_scaling_factor: float, out_dtype
) -> jax.Array:
    """``out[t] = rsf * sum_j w[t, j] * y[src2dst[t, j]]`` over local slots, float32, cast once."""
    valid = src2dst >= 0
    rows = y[jnp.where(valid, src2dst, 0)].astype(jnp.float32)  # [T, topk, H]
    rows = jnp.where(valid[:, :, None], rows, 0.0)  # a non-local slot adds nothing, even if y holds NaN
    weights = jnp.where(valid, topk_weights.astype(jnp.float32), 0.0)
    out = (weights[:, :, None] * rows).sum(axis=1)
    if routed_scaling_factor != 1.0:
        out = out * jnp.float32(routed_scaling_factor)
    return cast_rounded(out, out_dtype)
