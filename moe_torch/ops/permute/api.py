"""Routing metadata and the permute (row gather) for one EP rank (CONTRACT.md section 2).

Mirror: ``moe_pallas/ops/permute/api.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moe_contract.validation import (
    FLOAT_DTYPES,
    INT_ID_DTYPES,
    check_choice,
    check_dtype,
    check_ids_in_range,
    check_per_tensor_scale,
    check_positive_int,
    check_rank,
    check_shape,
)
from moe_torch.ops.permute.reference import permute_reference, routing_metadata_reference

IMPLEMENTATIONS = ("reference",)
PERMUTE_QUANTS = (None, "fp8_per_token", "fp8_per_token_group", "fp8_per_tensor")


class RoutingMetadata(NamedTuple):
    """Where each (token, slot) assignment goes on this rank. All int32; ``M_cap = T * topk``.

    expert_offsets: ``[E_local + 1]``, exclusive cumsum of rows per local expert; ``[-1] == M``.
    src2dst: ``[T, topk]``, permuted row of each assignment, ``-1`` if non-local.
    dst2src: ``[M_cap]``, assignment index ``t * topk + j`` of each permuted row, ``-1`` for rows ``>= M``.
    """

    expert_offsets: torch.Tensor
    src2dst: torch.Tensor
    dst2src: torch.Tensor


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

    Returns: :class:`RoutingMetadata`.

    Raises: ValueError (shapes, ranges, out-of-range ids in checked mode), TypeError (dtype).
    """
    op = "routing_metadata"
    check_rank(op, "topk_ids", topk_ids, 2, "[T, topk]")
    check_dtype(op, "topk_ids", topk_ids, INT_ID_DTYPES)
    check_positive_int(op, "num_experts", num_experts)
    start_ok = not isinstance(expert_start, bool) and isinstance(expert_start, int) and 0 <= expert_start < num_experts
    if start_ok and num_local_experts is None:
        num_local_experts = num_experts - expert_start
    if start_ok:
        check_positive_int(op, "num_local_experts", num_local_experts)
    if not start_ok or expert_start + num_local_experts > num_experts:
        raise ValueError(
            f"{op}: expert_start must be an int with 0 <= expert_start and expert_start + num_local_experts "
            f"<= num_experts (={num_experts}); got expert_start={expert_start!r}, num_local_experts={num_local_experts}"
        )
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
    return RoutingMetadata(*routing_metadata_reference(topk_ids, expert_start, num_local_experts))


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

    Returns:
      ``(x_permuted [M_cap, H], scale or None)``; rows ``>= M`` are zeros (scale of a zero row).

    Raises: ValueError (shapes, ``H % group_size``), TypeError (dtypes).
    """
    op = "permute"
    check_rank(op, "x", x, 2, "[T, H]")
    check_dtype(op, "x", x, FLOAT_DTYPES)
    check_positive_int(op, "topk", topk)
    T, H = x.shape
    check_shape(op, "dst2src", dst2src, (T * topk,), f"[T * topk] = ({T * topk},)")
    check_dtype(op, "dst2src", dst2src, ("int32",))
    check_choice(op, "quant", quant, PERMUTE_QUANTS)
    if quant == "fp8_per_token_group":
        check_positive_int(op, "group_size", group_size)
        if H % group_size:
            raise ValueError(f"{op}: H (=x.shape[1]) must be divisible by group_size={group_size}; got H={H}")
    if quant == "fp8_per_tensor":
        check_per_tensor_scale(op, "scale", scale)
        scale = scale.reshape(())
    elif scale is not None:
        raise ValueError(f"{op}: scale must be None unless quant='fp8_per_tensor' (quant={quant!r}); got an array")
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    return permute_reference(x, dst2src, topk, quant, group_size, scale)
