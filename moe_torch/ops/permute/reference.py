"""Permutation (dispatch) reference in torch, and the permute's backward: CONTRACT.md sections 2 and 8.

Mirror: ``moe_pallas/ops/permute/reference.py``.
"""

from __future__ import annotations

import torch

from moe_torch.ops.common import cast_rounded
from moe_torch.ops.quant.reference import (
    per_token_group_quant_fp8_reference,
    per_token_quant_fp8_reference,
    static_quant_fp8_reference,
)


def routing_metadata_reference(
    topk_ids: torch.Tensor, expert_start: int, num_local_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_ids [T, topk]`` -> ``(expert_offsets [E_local+1], src2dst [T, topk], dst2src [T*topk])``, int32.

    A stable sort of the assignments ``a = t*topk + j`` by local expert id puts each
    expert's rows together, in order of ``a``; non-local assignments sort last and are cut.
    """
    T, topk = topk_ids.shape
    m_cap = T * topk
    device = topk_ids.device
    local = topk_ids.reshape(m_cap) - expert_start  # in the ids' own dtype: no wrap-around
    is_local = (local >= 0) & (local < num_local_experts)
    key = torch.where(is_local, local, num_local_experts).to(torch.int32)  # non-local -> one bucket past the end
    order = torch.argsort(key, stable=True).to(torch.int32)  # [M_cap]: row -> assignment
    counts = torch.bincount(key.long(), minlength=num_local_experts + 1)[:num_local_experts]
    expert_offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)
    rows = torch.arange(m_cap, dtype=torch.int32, device=device)
    dst2src = torch.where(rows < expert_offsets[-1], order, -1)
    position = torch.empty(m_cap, dtype=torch.int32, device=device)
    position[order.long()] = rows  # assignment -> row (order is a permutation: every entry written)
    src2dst = torch.where(is_local, position, -1).reshape(T, topk)
    return expert_offsets, src2dst, dst2src


def permute_reference(
    x: torch.Tensor, dst2src: torch.Tensor, topk: int, quant: str | None, group_size: int, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gather ``x [T, H]`` rows into expert order: row ``r`` is ``x[dst2src[r] // topk]``.

    Rows with ``dst2src < 0`` (``>= M``) are zero. With ``quant`` the rows are quantized
    (CONTRACT.md section 3) and the scale rows travel with them.
    """
    valid = dst2src >= 0
    token = torch.where(valid, dst2src // topk, 0).long()
    rows = torch.where(valid[:, None], x[token], torch.zeros((), dtype=x.dtype, device=x.device))
    if quant is None:
        return rows, None
    if quant == "fp8_per_tensor":
        return static_quant_fp8_reference(rows, scale), scale
    if quant == "fp8_per_token":
        return per_token_quant_fp8_reference(rows)
    return per_token_group_quant_fp8_reference(rows, group_size)


def src2dst_from_dst2src(dst2src: torch.Tensor, num_tokens: int, topk: int) -> torch.Tensor:
    """The inverse map of :func:`permute`'s ``dst2src [M_cap]``: ``src2dst [T, topk]`` int32 with
    ``src2dst[a // topk, a % topk] = r`` for ``dst2src[r] = a >= 0`` and ``-1`` elsewhere, as
    :func:`routing_metadata_reference` returns it (one scatter of distinct rows; no host sync)."""
    m_cap = num_tokens * topk
    valid = dst2src >= 0
    src2dst = torch.full((m_cap + 1,), -1, dtype=torch.int32, device=dst2src.device)
    rows = torch.arange(dst2src.shape[0], dtype=torch.int32, device=dst2src.device)
    src2dst[torch.where(valid, dst2src, m_cap).long()] = rows  # rows >= M go to the dump slot past the end
    return src2dst[:m_cap].reshape(num_tokens, topk)


def permute_backward_reference(d_xp: torch.Tensor, src2dst: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``d_x[t] = sum_j d_xp[src2dst[t, j]]`` over local slots (``src2dst >= 0``), float32, cast once:
    ``[T, H]``; a token with no local slot gets 0, and rows no slot names are never read."""
    cdt = torch.promote_types(d_xp.dtype, torch.float32)  # float64 only for the tests' autodiff check
    valid = src2dst >= 0
    rows = d_xp[torch.where(valid, src2dst, 0).long()].to(cdt)  # [T, topk, H]
    return cast_rounded(torch.where(valid[:, :, None], rows, 0.0).sum(dim=1), out_dtype)
