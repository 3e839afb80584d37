"""Routing metadata and the permute (row gather) for one EP rank (CONTRACT.md section 2), and the
permute's backward (section 8): ``permute_backward``, and ``permute`` (quant=None) differentiable in
``x`` (a ``torch.autograd.Function`` whose backward is ``permute_backward`` with the same implementation).

Mirror: ``moe_pallas/ops/permute/api.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moe_contract.op_checks import check_permute, check_permute_backward, check_routing_metadata
from moe_contract.validation import check_choice, check_ids_in_range
from moe_torch.ops.permute.reference import (
    permute_backward_reference,
    permute_reference,
    routing_metadata_reference,
    src2dst_from_dst2src,
)
from moe_torch.ops.common import first_order_backward, resolve_dtype, takes_torch_tensors
from moe_torch.ops.dispatch import dispatch

IMPLEMENTATIONS = ("triton", "reference")


def _triton_routing_metadata(*args):
    """The Triton backend of :func:`routing_metadata`, imported on first use (so that ``moe_torch``
    imports without triton)."""
    try:
        from moe_torch.ops.permute.triton import routing_metadata_triton
    except ImportError as exc:
        raise NotImplementedError(f"routing_metadata: triton is not importable ({exc})") from exc
    return routing_metadata_triton(*args)


def _triton_permute(*args):
    """The Triton backend of :func:`permute`, imported on first use."""
    try:
        from moe_torch.ops.permute.triton import permute_triton
    except ImportError as exc:
        raise NotImplementedError(f"permute: triton is not importable ({exc})") from exc
    return permute_triton(*args)


def _triton_permute_backward(*args):
    """The Triton backend of :func:`permute_backward`, imported on first use."""
    try:
        from moe_torch.ops.permute.triton import permute_backward_triton
    except ImportError as exc:
        raise NotImplementedError(f"permute_backward: triton is not importable ({exc})") from exc
    return permute_backward_triton(*args)


class _PermuteFunction(torch.autograd.Function):
    """``permute`` with a backward: ``d_x = permute_backward(d_xp, src2dst)``, ``src2dst`` the inverse of
    ``dst2src``. With FP8 quant the codes are not differentiable: the backward raises instead."""

    @staticmethod
    def forward(ctx, x, dst2src, run, topk, quant, implementation):
        ctx.save_for_backward(dst2src)
        ctx.num_tokens, ctx.x_dtype, ctx.topk = x.shape[0], x.dtype, topk
        ctx.quant, ctx.implementation = quant, implementation
        out, scale = run()
        if quant == "fp8_per_tensor":  # the caller's own static scale: an alias, marked constant (not a function of x)
            scale = scale.detach()
            ctx.mark_non_differentiable(scale)
        return out, scale

    @staticmethod
    @first_order_backward("permute")
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_xp, d_scale):
        if ctx.quant is not None:
            raise ValueError(
                f"permute: no gradient through quant={ctx.quant!r} (FP8 codes are not differentiable); call it with "
                f"quant=None for training, or permute_backward on the float gradient (straight-through); got a "
                f"gradient request for x")
        (dst2src,) = ctx.saved_tensors
        src2dst = src2dst_from_dst2src(dst2src, ctx.num_tokens, ctx.topk)
        d_x = permute_backward(d_xp, src2dst, num_tokens=ctx.num_tokens, out_dtype=ctx.x_dtype,
                               implementation=ctx.implementation)
        return d_x, None, None, None, None, None


class RoutingMetadata(NamedTuple):
    """Where each (token, slot) assignment goes on this rank. All int32; ``M_cap = T * topk``.

    expert_offsets: ``[E_local + 1]``, exclusive cumsum of rows per local expert; ``[-1] == M``.
    src2dst: ``[T, topk]``, permuted row of each assignment, ``-1`` if non-local.
    dst2src: ``[M_cap]``, assignment index ``t * topk + j`` of each permuted row, ``-1`` for rows ``>= M``.
    """

    expert_offsets: torch.Tensor
    src2dst: torch.Tensor
    dst2src: torch.Tensor


@takes_torch_tensors
def routing_metadata(
    topk_ids: torch.Tensor,
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
        ``[0, num_experts)`` (a host sync). Unchecked, an id
        outside the range is treated as non-local.
      implementation: ``None`` (CUDA tensors: ``"triton"``, falling back to ``"reference"`` with a
        logged warning; CPU tensors: ``"reference"``), ``"triton"`` (no host synchronisation:
        CUDA-graph capturable unless ``check_ids``) or ``"reference"``.

    Returns: :class:`RoutingMetadata`.

    Raises: ValueError (shapes, ranges, out-of-range ids in checked mode), TypeError (dtype),
      NotImplementedError (``implementation="triton"`` where the kernel cannot run).
    """
    op = "routing_metadata"
    num_local_experts = check_routing_metadata(op, topk_ids, num_experts, expert_start, num_local_experts)
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    if check_ids:
        check_ids_in_range(op, "topk_ids", topk_ids.cpu().numpy(), num_experts)  # a host sync, by design
    T, topk = topk_ids.shape
    if T == 0:
        return RoutingMetadata(
            torch.zeros((num_local_experts + 1,), dtype=torch.int32, device=topk_ids.device),
            torch.zeros((0, topk), dtype=torch.int32, device=topk_ids.device),
            torch.zeros((0,), dtype=torch.int32, device=topk_ids.device),
        )
    args = (topk_ids, expert_start, num_local_experts)
    backends = {"triton": lambda: _triton_routing_metadata(*args), "reference": lambda: routing_metadata_reference(*args)}
    return RoutingMetadata(*dispatch(op, implementation, backends, topk_ids.device))


@takes_torch_tensors
def permute(
    x: torch.Tensor,
    dst2src: torch.Tensor,
    *,
    topk: int,
    quant: str | None = None,
    group_size: int = 128,
    scale: torch.Tensor | None = None,
    implementation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gather token rows into expert order, optionally quantizing them to FP8 on the way.

    Args:
      x: ``[T, H]`` float32 / bf16 / float16.
      dst2src: ``[M_cap = T*topk]`` int32 from :func:`routing_metadata`; ``-1`` marks rows ``>= M``.
      topk: slots per token (``dst2src // topk`` is the token).
      quant: ``None`` (rows keep ``x.dtype``), ``"fp8_per_token"`` (scale ``[M_cap, 1]``),
        ``"fp8_per_token_group"`` (scale ``[M_cap, H // group_size]``) or ``"fp8_per_tensor"``
        (the given static ``scale []``).
      implementation: ``None`` (CUDA tensors: ``"triton"``, falling back to ``"reference"`` with a
        logged warning; CPU tensors: ``"reference"``), ``"triton"`` or ``"reference"``.

    Returns:
      ``(x_permuted [M_cap, H], scale or None)``; rows ``>= M`` are zeros (scale of a zero row).

    Differentiable in ``x`` (autograd, when ``x.requires_grad``): the backward is
    :func:`permute_backward` (through ``src2dst``, the inverse of ``dst2src``) with the same
    ``implementation``. With ``quant`` set the backward raises ValueError (FP8 codes have no gradient).

    Raises: ValueError (shapes, ``H % group_size``), TypeError (dtypes), NotImplementedError
      (``implementation="triton"`` where the kernel cannot run).
    """
    op = "permute"
    check_permute(op, x, dst2src, topk, quant, group_size, scale)
    if quant == "fp8_per_tensor":
        scale = scale.reshape(())
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    args = (x.detach(), dst2src, topk, quant, group_size, None if scale is None else scale.detach())
    backends = {"triton": lambda: _triton_permute(*args), "reference": lambda: permute_reference(*args)}
    run = lambda: dispatch(op, implementation, backends, x.device)  # noqa: E731
    if torch.is_grad_enabled() and x.requires_grad:
        return _PermuteFunction.apply(x, dst2src, run, topk, quant, implementation)
    return run()


@takes_torch_tensors
def permute_backward(
    d_xp: torch.Tensor,
    src2dst: torch.Tensor,
    *,
    num_tokens: int | None = None,
    out_dtype=None,
    implementation: str | None = None,
) -> torch.Tensor:
    """The backward of :func:`permute` (quant=None), CONTRACT.md section 8:
    ``d_x[t] = sum_j d_xp[src2dst[t, j]]`` over local slots, float32 accumulation.

    Args:
      d_xp: ``[M_cap, H]`` float32 / bf16 / float16, the gradient of the permuted rows
        (``M_cap = T * topk``); only rows named by ``src2dst`` are read (rows ``>= M`` never).
      src2dst: ``[T, topk]`` int32 from :func:`routing_metadata`, ``-1`` for non-local slots.
      num_tokens: ``T``, checked against ``src2dst.shape[0]`` (default: that).
      out_dtype: default ``d_xp.dtype``.
      implementation: ``None`` (CUDA tensors: ``"triton"``, falling back to ``"reference"`` with a
        logged warning; CPU tensors: ``"reference"``), ``"triton"`` (a gather by ``src2dst``, no
        atomics) or ``"reference"``.

    Returns: ``d_x [T, H]`` in ``out_dtype``; a token with no local slot gets 0.

    Raises: ValueError (shapes, num_tokens), TypeError (dtypes), NotImplementedError
      (``implementation="triton"`` where the kernel cannot run).
    """
    op = "permute_backward"
    out_dtype = resolve_dtype(check_permute_backward(op, d_xp, src2dst, num_tokens, out_dtype))
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    args = (d_xp.detach(), src2dst, out_dtype)
    backends = {"triton": lambda: _triton_permute_backward(*args),
                "reference": lambda: permute_backward_reference(*args)}
    return dispatch(op, implementation, backends, d_xp.device)
