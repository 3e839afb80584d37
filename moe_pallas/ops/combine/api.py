"""Combine: un-permute the expert outputs and sum them per token (CONTRACT.md section 5).

Mirror: ``moe_torch/ops/combine/api.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_contract.op_checks import check_combine
from moe_contract.validation import check_choice
from moe_pallas.ops.combine.pallas_triton import combine_pallas_triton
from moe_pallas.ops.combine.reference import combine_reference
from moe_pallas.ops.common import resolve_dtype, takes_jax_arrays
from moe_pallas.ops.dispatch import dispatch

IMPLEMENTATIONS = ("pallas_triton", "reference")


@takes_jax_arrays
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
      implementation: ``"pallas_triton"`` (interpreted on the CPU), ``"reference"``, or ``None``
        (the device's default order, ``moe_pallas.ops.dispatch``; the reference on the CPU).

    Returns: ``out [T, H]``, accumulated in float32 and cast once. Tokens with no local slot get 0.

    Raises: ValueError (shapes, rsf), TypeError (dtypes).
    """
    op = "combine"
    out_dtype = resolve_dtype(check_combine(op, y, src2dst, topk_weights, routed_scaling_factor, out_dtype))
    T = src2dst.shape[0]
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    if T == 0:
        return jnp.zeros((0, y.shape[1]), out_dtype)
    rsf = float(routed_scaling_factor)
    return dispatch(op, implementation, {
        "pallas_triton": lambda: combine_pallas_triton(
            y, src2dst, topk_weights, routed_scaling_factor=rsf, out_dtype=out_dtype),
        "reference": lambda: combine_reference(y, src2dst, topk_weights, rsf, out_dtype),
    })
