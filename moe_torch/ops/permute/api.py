"""Routing metadata and the permute (row gather) for one EP rank (CONTRACT.md section 2).

Mirror: ``moe_pallas/ops/permute/api.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moe_contract.op_checks import check_permute, check_routing_metadata
from moe_contract.validation import check_choice, check_ids_in_range
from moe_torch.ops.permute.reference import permute_reference, routing_metadata_reference
from moe_torch.ops.common import takes_torch_tensors
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

    Raises: ValueError (shapes, ``H % group_size``), TypeError (dtypes), NotImplementedError
      (``implementation="triton"`` where the kernel cannot run).
    """
    op = "permute"
    check_permute(op, x, dst2src, topk, quant, group_size, scale)
    if quant == "fp8_per_tensor":
        scale = scale.reshape(())
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    args = (x, dst2src, topk, quant, group_size, scale)
    backends = {"triton": lambda: _triton_permute(*args), "reference": lambda: permute_reference(*args)}
    return dispatch(op, implementation, backends, x.device)
