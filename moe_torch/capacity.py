"""Expert capacity (CONTRACT.md section 2, "Capacity"): the routed slots an expert drops, as ids the permutation skips.

With ``config.capacity_factor = c`` each routed expert takes at most ``C = ceil(c * T * topk / E)`` slots
(:meth:`MoEConfig.expert_capacity`), first come first served in token order (lower token first, then slot
order). A dropped slot's id becomes ``-1``, which the routing metadata treats as non-local (CONTRACT.md section 2):
it never enters a permuted buffer, so every backend of every stage skips it, forward and backward, with no kernel
of its own::

    topk_ids [R, k] --routing_metadata(expert_start=0, E_local=E)--> src2dst, expert_offsets  (stable sort, on device)
    position[r, j] = src2dst[r, j] - expert_offsets[topk_ids[r, j]]     (0-based, in token order, per expert)
    dispatch_ids   = topk_ids where position < C (or not a routed expert), else -1

The sort is the permutation's own (no host synchronisation with ``implementation="triton"``; ``O(R * k)``
memory, where a one-hot cumsum would hold ``[R * k, E]``).

Mirror: ``moe_pallas/capacity.py``.
"""

from __future__ import annotations

import torch

from moe_contract.config import MoEConfig
from moe_contract.validation import INT_ID_DTYPES, check_config, check_dtype, check_nonnegative_int, check_rank
from moe_torch.ops.common import takes_torch_tensors
from moe_torch.ops.permute.api import routing_metadata


@takes_torch_tensors
def drop_over_capacity(topk_ids: torch.Tensor, config: MoEConfig, *, num_tokens: int | None = None,
                       implementation: str | None = None) -> torch.Tensor:
    """The ids the experts see: ``topk_ids`` with every routed slot beyond its expert's capacity set to ``-1``.

    Args:
      topk_ids: ``[R, k]`` int32 / int64 global expert ids (routed ``[0, E)``, fused shared ``[E, E + S)``; a
        negative id is no expert), the rows in token order: a gate's ``[T, topk + S]``, or the EP owner's received
        rows ``[R, 1]`` in global token order. Only routed ids count towards, and can be dropped by, a capacity.
      config: the layer; ``config.capacity_factor`` ``None`` (dropless) returns ``topk_ids`` itself.
      num_tokens: the ``T`` of ``C = ceil(c * T * topk / E)`` (default ``R``, the rows: right for a gate's ids;
        the EP all_to_all owner passes the layer call's token count over every rank).
      implementation: the backend of the stable sort (:func:`moe_torch.routing_metadata`'s).

    Returns: ``[R, k]`` of ``topk_ids``' dtype: each slot's id, or ``-1`` where it is dropped (CONTRACT.md
    section 2, "Capacity"). Computed on device, no host synchronisation beyond the sort backend's own.

    Raises: ValueError / TypeError (``topk_ids`` not ``[R, k]`` of an int dtype, ``num_tokens`` not an int >= 0,
      ``config`` not a :class:`MoEConfig`).
    """
    op = "drop_over_capacity"
    check_config(op, config)
    check_rank(op, "topk_ids", topk_ids, 2, "[R, k]")
    check_dtype(op, "topk_ids", topk_ids, INT_ID_DTYPES)
    num_tokens = topk_ids.shape[0] if num_tokens is None else num_tokens
    check_nonnegative_int(op, "num_tokens", num_tokens)
    capacity = config.expert_capacity(num_tokens)
    if capacity is None:
        return topk_ids
    E = config.num_experts
    # Routed experts as the "local" range of one rank: shared and negative ids sort last (src2dst -1): never dropped.
    meta = routing_metadata(topk_ids, config.num_total_experts, expert_start=0, num_local_experts=E,
                            implementation=implementation)
    expert = topk_ids.long().clamp(0, E - 1)
    position = meta.src2dst.long() - meta.expert_offsets.long()[expert]
    keep = (meta.src2dst < 0) | (position < capacity)
    return torch.where(keep, topk_ids, torch.full_like(topk_ids, -1))
