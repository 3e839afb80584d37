"""Combine: un-permute the expert outputs and sum them per token (CONTRACT.md section 5).

Mirror: ``moe_pallas/ops/combine/api.py``.
"""

from __future__ import annotations

import torch

from moe_contract.op_checks import check_combine
from moe_contract.validation import check_choice
from moe_torch.ops.combine.reference import combine_reference
from moe_torch.ops.common import resolve_dtype

IMPLEMENTATIONS = ("reference",)


def combine(
    y: torch.Tensor,
    src2dst: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    routed_scaling_factor: float = 1.0,
    out_dtype=None,
    implementation: str | None = None,
) -> torch.Tensor:
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
    out_dtype = resolve_dtype(check_combine(op, y, src2dst, topk_weights, routed_scaling_factor, out_dtype))
    T = src2dst.shape[0]
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    if T == 0:
        return torch.zeros((0, y.shape[1]), dtype=out_dtype, device=y.device)
    return combine_reference(y, src2dst, topk_weights, float(routed_scaling_factor), out_dtype)
