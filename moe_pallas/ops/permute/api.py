"""Routing metadata and the permute (row gather) for one EP rank (CONTRACT.md section 2), and the
permute's backward (section 8): ``permute_backward``, and ``permute`` (quant=None) differentiable in
``x`` (a ``jax.custom_vjp`` whose backward is ``permute_backward`` with the same implementation).

Mirror: ``moe_torch/ops/permute/api.py``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_contract.op_checks import check_permute, check_permute_backward, check_routing_metadata
from moe_contract.validation import check_choice, check_ids_in_range
from moe_pallas.ops.common import first_order_only, resolve_dtype, takes_jax_arrays
from moe_pallas.ops.dispatch import dispatch
from moe_pallas.ops.permute.pallas_triton import (
    permute_backward_pallas_triton,
    permute_pallas_triton,
    routing_metadata_pallas_triton,
)
from moe_pallas.ops.permute.reference import (
    permute_backward_reference,
    permute_reference,
    routing_metadata_reference,
    src2dst_from_dst2src,
)

IMPLEMENTATIONS = ("pallas_triton", "reference")


class RoutingMetadata(NamedTuple):
    """Where each (token, slot) assignment goes on this rank. All int32; ``M_cap = T * topk``.

    expert_offsets: ``[E_local + 1]``, exclusive cumsum of rows per local expert; ``[-1] == M``.
    src2dst: ``[T, topk]``, permuted row of each assignment, ``-1`` if non-local.
    dst2src: ``[M_cap]``, assignment index ``t * topk + j`` of each permuted row, ``-1`` for rows ``>= M``.
    """

    expert_offsets: jax.Array
    src2dst: jax.Array
    dst2src: jax.Array


@takes_jax_arrays
def routing_metadata(
    topk_ids: jax.Array,
    num_experts: int,
    *,
    expert_start: int = 0,
    num_local_experts: int | None = None,
    check_ids: bool = False,
    implementation: str | None = None,
) -> RoutingMetadata:
    """Sort the assignments of ``topk_ids`` by local expert, stably, with static capacity ``T*topk``.

    Args:
      topk_ids: ``[T, topk]`` int32 / int64, ids in ``[0, num_experts)``.
      num_experts: the id space (``E``, or ``E + S`` with fused shared experts).
      expert_start, num_local_experts: this rank owns ``[expert_start, expert_start + E_local)``;
        default: all experts.
      check_ids: the checked mode: read the ids on the host and raise if any is outside
        ``[0, num_experts)`` (needs concrete arrays, not under ``jit``). Unchecked, an id
        outside the range is treated as non-local.
      implementation: ``"pallas_triton"`` (interpreted on the CPU), ``"reference"``, or ``None``
        (the device's default order, ``moe_pallas.ops.dispatch``; the reference on the CPU).

    Returns: :class:`RoutingMetadata`.

    Raises: ValueError (shapes, ranges, out-of-range ids in checked mode), TypeError (dtype).
    """
    op = "routing_metadata"
    num_local_experts = check_routing_metadata(op, topk_ids, num_experts, expert_start, num_local_experts)
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    if check_ids:
        if isinstance(topk_ids, jax.core.Tracer):
            raise ValueError(f"{op}: check_ids=True reads the ids on the host, so topk_ids must be concrete; got a tracer (call it outside jit)")
        check_ids_in_range(op, "topk_ids", np.asarray(topk_ids), num_experts)
    T, topk = topk_ids.shape
    if T == 0:
        return RoutingMetadata(
            jnp.zeros((num_local_experts + 1,), jnp.int32), jnp.zeros((0, topk), jnp.int32), jnp.zeros((0,), jnp.int32)
        )
    return RoutingMetadata(*dispatch(op, implementation, {
        "pallas_triton": lambda: routing_metadata_pallas_triton(
            topk_ids, expert_start=expert_start, num_local_experts=num_local_experts),
        "reference": lambda: routing_metadata_reference(topk_ids, expert_start, num_local_experts),
    }))


@takes_jax_arrays
def permute(
    x: jax.Array,
    dst2src: jax.Array,
    *,
    topk: int,
    quant: str | None = None,
    group_size: int = 128,
    scale: jax.Array | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Gather token rows into expert order, optionally quantizing them to FP8 on the way.

    Args:
      x: ``[T, H]`` float32 / bf16 / float16.
      dst2src: ``[M_cap = T*topk]`` int32 from :func:`routing_metadata`; ``-1`` marks rows ``>= M``.
      topk: slots per token (``dst2src // topk`` is the token).
      quant: ``None`` (rows keep ``x.dtype``), ``"fp8_per_token"`` (scale ``[M_cap, 1]``),
        ``"fp8_per_token_group"`` (scale ``[M_cap, H // group_size]``) or ``"fp8_per_tensor"``
        (the given static ``scale []``).
      implementation: ``"pallas_triton"`` (interpreted on the CPU), ``"reference"``, or ``None``
        (the device's default order; the reference on the CPU).

    Returns:
      ``(x_permuted [M_cap, H], scale or None)``; rows ``>= M`` are zeros (scale of a zero row).

    Differentiable in ``x`` (``jax.custom_vjp``): the backward is :func:`permute_backward` (through
    ``src2dst``, the inverse of ``dst2src``) with the same ``implementation``. With ``quant`` set the
    backward raises ValueError (FP8 codes have no gradient).

    Raises: ValueError (shapes, ``H % group_size``), TypeError (dtypes), NotImplementedError
      (``implementation="pallas_triton"`` with a group_size that is not a power of two).
    """
    op = "permute"
    check_permute(op, x, dst2src, topk, quant, group_size, scale)
    if quant == "fp8_per_tensor":
        scale = scale.reshape(())
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    st = _PermuteStatic(topk, quant, group_size, implementation, x.shape[0], jnp.dtype(x.dtype))
    x, scale = first_order_only(op, x, scale)  # a derivative of the gradient raises, naming the op
    return _permute_vjp(x, dst2src, scale, st)


class _PermuteStatic(NamedTuple):
    """The validated, hashable (static) arguments of one ``permute`` call."""

    topk: int
    quant: str | None
    group_size: int
    implementation: str | None
    num_tokens: int
    x_dtype: Any


def _permute(x, dst2src, scale, st: _PermuteStatic):
    return dispatch("permute", st.implementation, {
        "pallas_triton": lambda: permute_pallas_triton(
            x, dst2src, topk=st.topk, quant=st.quant, group_size=st.group_size, scale=scale),
        "reference": lambda: permute_reference(x, dst2src, st.topk, st.quant, st.group_size, scale),
    })


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _permute_vjp(x, dst2src, scale, st: _PermuteStatic):
    return _permute(x, dst2src, scale, st)


def _permute_fwd(x, dst2src, scale, st):
    return _permute(x, dst2src, scale, st), dst2src


def _permute_bwd(st, dst2src, cotangents):
    if st.quant is not None:
        raise ValueError(
            f"permute: no gradient through quant={st.quant!r} (FP8 codes are not differentiable); call it with "
            f"quant=None for training, or permute_backward on the float gradient (straight-through); got a "
            f"gradient request for x")
    d_xp, _ = cotangents
    src2dst = src2dst_from_dst2src(dst2src, st.num_tokens, st.topk)
    d_x = permute_backward(d_xp, src2dst, num_tokens=st.num_tokens, out_dtype=st.x_dtype,
                           implementation=st.implementation)
    return d_x, None, None  # dst2src: integer; a static per-tensor scale: a constant


_permute_vjp.defvjp(_permute_fwd, _permute_bwd)


@takes_jax_arrays
def permute_backward(
    d_xp: jax.Array,
    src2dst: jax.Array,
    *,
    num_tokens: int | None = None,
    out_dtype=None,
    implementation: str | None = None,
) -> jax.Array:
    """The backward of :func:`permute` (quant=None), CONTRACT.md section 8:
    ``d_x[t] = sum_j d_xp[src2dst[t, j]]`` over local slots, float32 accumulation.

    Args:
      d_xp: ``[M_cap, H]`` float32 / bf16 / float16, the gradient of the permuted rows
        (``M_cap = T * topk``); only rows named by ``src2dst`` are read (rows ``>= M`` never).
      src2dst: ``[T, topk]`` int32 from :func:`routing_metadata`, ``-1`` for non-local slots.
      num_tokens: ``T``, checked against ``src2dst.shape[0]`` (default: that).
      out_dtype: default ``d_xp.dtype``.
      implementation: ``"pallas_triton"`` (a gather by ``src2dst``, no atomics; interpreted on the
        CPU), ``"reference"``, or ``None`` (the device's default order; the reference on the CPU).

    Returns: ``d_x [T, H]`` in ``out_dtype``; a token with no local slot gets 0.

    Raises: ValueError (shapes, num_tokens), TypeError (dtypes).
    """
    op = "permute_backward"
    out_dtype = resolve_dtype(check_permute_backward(op, d_xp, src2dst, num_tokens, out_dtype))
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    return dispatch(op, implementation, {
        "pallas_triton": lambda: permute_backward_pallas_triton(d_xp, src2dst, out_dtype=out_dtype),
        "reference": lambda: permute_backward_reference(d_xp, src2dst, out_dtype),
    })
