"""Combine: un-permute the expert outputs and sum them per token (CONTRACT.md section 5), and its
backward (section 8): ``combine_backward``, and ``combine`` differentiable in ``y`` and ``topk_weights``
(a ``jax.custom_vjp`` whose backward is ``combine_backward`` with the same implementation).

Mirror: ``moe_torch/ops/combine/api.py``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from moe_contract.op_checks import check_combine, check_combine_backward
from moe_contract.validation import check_choice
from moe_pallas.ops.combine.pallas_triton import combine_backward_pallas_triton, combine_pallas_triton
from moe_pallas.ops.combine.reference import combine_backward_reference, combine_reference
from moe_pallas.ops.common import first_order_only, resolve_dtype, takes_jax_arrays
from moe_pallas.ops.dispatch import dispatch

IMPLEMENTATIONS = ("pallas_triton", "reference")


class _Static(NamedTuple):
    """The validated, hashable (static) arguments of one ``combine`` call."""

    rsf: float
    out_dtype: Any
    implementation: str | None


def _combine(y, src2dst, topk_weights, st: _Static) -> jax.Array:
    if src2dst.shape[0] == 0:
        return jnp.zeros((0, y.shape[1]), st.out_dtype)
    return dispatch("combine", st.implementation, {
        "pallas_triton": lambda: combine_pallas_triton(
            y, src2dst, topk_weights, routed_scaling_factor=st.rsf, out_dtype=st.out_dtype),
        "reference": lambda: combine_reference(y, src2dst, topk_weights, st.rsf, st.out_dtype),
    })


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combine_vjp(y, src2dst, topk_weights, st: _Static) -> jax.Array:
    return _combine(y, src2dst, topk_weights, st)


def _combine_fwd(y, src2dst, topk_weights, st):
    return _combine(y, src2dst, topk_weights, st), (y, src2dst, topk_weights)


def _combine_bwd(st, residuals, d_out):
    y, src2dst, topk_weights = residuals
    d_y, d_w = combine_backward(d_out, y, src2dst, topk_weights, routed_scaling_factor=st.rsf,
                                implementation=st.implementation)
    return d_y, None, d_w  # src2dst: integer, no cotangent


_combine_vjp.defvjp(_combine_fwd, _combine_bwd)


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

    Differentiable in ``y`` and ``topk_weights`` (``jax.custom_vjp``): the backward is
    :func:`combine_backward` with the same ``implementation``.

    Raises: ValueError (shapes, rsf), TypeError (dtypes).
    """
    op = "combine"
    out_dtype = resolve_dtype(check_combine(op, y, src2dst, topk_weights, routed_scaling_factor, out_dtype))
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    y, topk_weights = first_order_only(op, y, topk_weights)  # a derivative of the gradient raises, naming the op
    return _combine_vjp(y, src2dst, topk_weights, _Static(float(routed_scaling_factor), out_dtype, implementation))


@takes_jax_arrays
def combine_backward(
    d_out: jax.Array,
    y: jax.Array,
    src2dst: jax.Array,
    topk_weights: jax.Array,
    *,
    routed_scaling_factor: float = 1.0,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The backward of :func:`combine` (CONTRACT.md section 8), float32 math, ``c = routed_scaling_factor``:
    ``d_y[src2dst[t, j]] = c * w[t, j] * d_out[t]`` and ``d_topk_weights[t, j] = c * <y[src2dst[t, j]], d_out[t]>``.

    Args:
      d_out: ``[T, H]`` float32 / bf16 / float16, the gradient of combine's output.
      y: ``[M_cap, H]`` float, the second GEMM's output the forward combined (``M_cap = T * topk``);
        only rows named by ``src2dst`` are read.
      src2dst: ``[T, topk]`` int32, ``-1`` for non-local slots; every row is named by at most one
        slot (as :func:`routing_metadata` makes it).
      topk_weights: ``[T, topk]`` float32.
      routed_scaling_factor: the ``rsf`` the forward was given (1.0 if the gate applied it).
      implementation: ``"pallas_triton"`` (one kernel, a program per token block: plain stores into
        ``d_y``, no atomics; interpreted on the CPU), ``"reference"``, or ``None`` (the device's default
        order, ``moe_pallas.ops.dispatch``; the reference on the CPU).

    Returns: ``(d_y [M_cap, H] y.dtype, d_topk_weights [T, topk] float32)``; rows of ``d_y`` that no
    local slot names (rows ``>= M``) are 0, non-local slots get ``d_topk_weights = 0``.

    Raises: ValueError (shapes, rsf), TypeError (dtypes).
    """
    op = "combine_backward"
    check_combine_backward(op, d_out, y, src2dst, topk_weights, routed_scaling_factor)
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    rsf = float(routed_scaling_factor)
    return dispatch(op, implementation, {
        "pallas_triton": lambda: combine_backward_pallas_triton(
            d_out, y, src2dst, topk_weights, routed_scaling_factor=rsf),
        "reference": lambda: combine_backward_reference(d_out, y, src2dst, topk_weights, rsf),
    })
