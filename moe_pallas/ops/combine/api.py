"""Combine: un-permute the expert outputs and sum them per token (CONTRACT.md section 5).

Mirror: ``moe_torch/ops/combine/api.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_contract.validation import FLOAT_DTYPES, check_choice, check_dtype, check_rank, check_rsf, check_shape
from moe_pallas.ops.combine.reference import combine_reference
from moe_pallas.ops.common import resolve_dtype

IMPLEMENTATIONS = ("reference",)


def combine(
    y: jax.Array,
    src2dst: jax.Array,
    topk_weights: jax.Array,
    *,
    routed_scaling_factor: float = 1.0,
    out_dtype=None,
    implementation: str | None = None,
) -> jax.Array:
    """``out[t] = rsf * sum_j topk_weights[t, j] * y[src2dst[t, j]]`` over slots with ``src2dst >= 0``.

    Args:
      y: ``[M_cap, H]`` float, the second GEMM's output in permuted order.
      src2dst: ``[T, topk]`` int32, ``-1`` for non-local slots (they contribute nothing).
      topk_weights: ``[T, topk]`` float32.
      routed_scaling_factor: pass the model's ``rsf`` here unless the gate already applied it
        (then 1.0): it must be applied exactly once.
      out_dtype: default ``y.dtype``.

    Returns: ``out [T, H]``, accumulated in float32 and cast once. Tokens with no local slot get 0.

    Raises: ValueError (shapes, rsf), TypeError (dtypes).
    """
    op = "combine"
    check_rank(op, "y", y, 2, "[M_cap, H]")
    check_dtype(op, "y", y, FLOAT_DTYPES)
    check_rank(op, "src2dst", src2dst, 2, "[T, topk]")
    check_dtype(op, "src2dst", src2dst, ("int32",))
    T, topk = src2dst.shape
    if y.shape[0] != T * topk:
        raise ValueError(f"{op}: y must be [M_cap, H] with M_cap == T * topk (={T * topk}); got y.shape={tuple(y.shape)}")
    check_shape(op, "topk_weights", topk_weights, (T, topk), f"[T, topk] = ({T}, {topk})")
    check_dtype(op, "topk_weights", topk_weights, ("float32",))
    check_rsf(op, routed_scaling_factor)
    out_dtype = y.dtype if out_dtype is None else out_dtype
    check_dtype(op, "out_dtype", out_dtype, FLOAT_DTYPES)
    out_dtype = resolve_dtype(out_dtype)
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    if T == 0:
        return jnp.zeros((0, y.shape[1]), out_dtype)
    return combine_reference(y, src2dst, topk_weights, float(routed_scaling_factor), out_dtype)
