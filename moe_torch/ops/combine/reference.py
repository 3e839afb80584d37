"""Combine (un-permute) reference in torch, and its backward: CONTRACT.md sections 5 and 8.

Mirror: ``moe_pallas/ops/combine/reference.py``.
"""

from __future__ import annotations

import torch

from moe_torch.ops.common import cast_rounded


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 (the contract's arithmetic), or float64 for float64 input (the tests' autodiff check)."""
    return torch.promote_types(x.dtype, torch.float32)


def combine_reference(
    y: torch.Tensor, src2dst: torch.Tensor, topk_weights: torch.Tensor, routed_scaling_factor: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """``out[t] = rsf * sum_j w[t, j] * y[src2dst[t, j]]`` over local slots, float32, cast once."""
    cdt = _compute_dtype(y)
    valid = src2dst >= 0
    rows = y[torch.where(valid, src2dst, 0).long()].to(cdt)  # [T, topk, H]
    rows = torch.where(valid[:, :, None], rows, 0.0)  # a non-local slot adds nothing, even if y holds NaN
    weights = torch.where(valid, topk_weights.to(cdt), 0.0)
    out = (weights[:, :, None] * rows).sum(dim=1)
    if routed_scaling_factor != 1.0:
        out = out * torch.tensor(routed_scaling_factor, dtype=torch.float32)
    return cast_rounded(out, out_dtype)


def combine_backward_reference(
    d_out: torch.Tensor,
    y: torch.Tensor,
    src2dst: torch.Tensor,
    topk_weights: torch.Tensor,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_y [M_cap, H] y.dtype, d_topk_weights [T, topk] float32)``, with ``c = float32(rsf)``:
    ``d_y[src2dst[t, j]] = c * w[t, j] * d_out[t]`` (rows no slot names: 0) and
    ``d_topk_weights[t, j] = c * <y[src2dst[t, j]], d_out[t]>`` (0 for non-local slots), in float32.
    Only rows named by ``src2dst`` are read from ``y``; each row is named by at most one slot."""
    cdt = _compute_dtype(y)
    T, topk = src2dst.shape
    valid = src2dst >= 0
    dst = torch.where(valid, src2dst, 0).long()
    c = torch.tensor(routed_scaling_factor, dtype=torch.float32)
    do = d_out.to(cdt)
    rows = torch.where(valid[:, :, None], y[dst].to(cdt), 0.0)  # [T, topk, H]; a non-local slot reads nothing
    d_w = torch.where(valid, (rows * do[:, None, :]).sum(dim=2) * c, 0.0)
    coef = torch.where(valid, topk_weights.to(cdt) * c, 0.0)  # [T, topk]
    # Non-local slots write into one dump row past the end (cut below): no host sync for a mask.
    M_cap = y.shape[0]
    d_y = torch.zeros((M_cap + 1, y.shape[1]), dtype=y.dtype, device=y.device)
    vals = cast_rounded(coef[:, :, None] * do[:, None, :], y.dtype).reshape(T * topk, y.shape[1])
    d_y[torch.where(valid, src2dst, M_cap).long().reshape(-1)] = vals
    return d_y[:M_cap], d_w.to(torch.promote_types(topk_weights.dtype, cdt))


def scale_rows_reference(
    g: torch.Tensor, row_weights: torch.Tensor, out_dtype: torch.dtype, dot_with: torch.Tensor | None,
    scale_dot_with: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(out, dots, dot_with_w)``: ``out[m] = cast(g[m] * row_weights[m])`` (the product in ``g``'s and the weights'
    promoted dtype, rounded once to ``out_dtype``) and, with ``dot_with``, ``dots[m] = sum_n dot_with[m, n] * g[m, n]``
    (the products promoted, summed in that dtype); else ``dots = None``; with ``scale_dot_with``, ``dot_with_w[m] =
    cast(dot_with[m] * row_weights[m])`` in ``dot_with``'s dtype (rounded once), else ``None``."""
    out = torch.mul(g, row_weights[:, None], out=g.new_empty(g.shape, dtype=out_dtype))
    dots = torch.mul(dot_with, g).sum(dim=1) if dot_with is not None else None
    a_w = torch.mul(dot_with, row_weights[:, None], out=torch.empty_like(dot_with)) if scale_dot_with else None
    return out, dots, a_w
