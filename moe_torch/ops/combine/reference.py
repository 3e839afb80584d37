"""Combine (un-permute) reference in torch: CONTRACT.md section 5.

Mirror: ``moe_pallas/ops/combine/reference.py``.
"""

from __future__ import annotations

import torch

from moe_torch.ops.common import cast_rounded


def combine_reference(
    y: torch.Tensor, src2dst: torch.Tensor, topk_weights: torch.Tensor, routed_scaling_factor: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """``out[t] = rsf * sum_j w[t, j] * y[src2dst[t, j]]`` over local slots, float32, cast once."""
    valid = src2dst >= 0
    rows = y[torch.where(valid, src2dst, 0).long()].float()  # [T, topk, H]
    rows = torch.where(valid[:, :, None], rows, 0.0)  # a non-local slot adds nothing, even if y holds NaN
    weights = torch.where(valid, topk_weights.float(), 0.0)
    out = (weights[:, :, None] * rows).sum(dim=1)
    if routed_scaling_factor != 1.0:
        out = out * torch.tensor(routed_scaling_factor, dtype=torch.float32)
    return cast_rounded(out, out_dtype)
