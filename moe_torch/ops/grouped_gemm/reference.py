"""Grouped GEMM reference in torch: CONTRACT.md section 4, one plain matmul per expert.

``y[m, :] = x[m, :] @ w[e(m)].T`` with float32 accumulation; for FP8 inputs the product of
the *dequantized* operands, which equals the contract's ``(q_x @ q_w.T) * scale_x * scale_w``
(with block scales applied per K block) up to float32 rounding. Rows ``>= M`` are zero.
Reads ``expert_offsets`` on the host (a sync): this is a reference, not a kernel.

Mirror: ``moe_pallas/ops/grouped_gemm/reference.py``.
"""

from __future__ import annotations

import torch

from moe_torch.ops.common import cast_rounded
from moe_torch.ops.quant.reference import dequantize_fp8_reference, dequantize_weight_fp8_reference


def grouped_gemm_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    x_scale: torch.Tensor | None,
    w_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``x [M_cap, K]``, ``w [E_local, N, K]``, ``expert_offsets [E_local + 1]`` -> ``y [M_cap, N]``."""
    M_cap, K = x.shape
    E, N, _ = w.shape
    xf = x.float() if x_scale is None else dequantize_fp8_reference(x, x_scale)
    y = torch.zeros((M_cap, N), dtype=torch.float32, device=x.device)
    offsets = expert_offsets.tolist()
    for e in range(E):
        start, end = offsets[e], offsets[e + 1]
        if end <= start:
            continue  # an expert with no rows
        if w_scale is None:
            w_e = w[e].float()
        else:
            w_e = dequantize_weight_fp8_reference(w[e : e + 1], w_scale[e : e + 1])[0]
        y[start:end] = xf[start:end] @ w_e.T
    return cast_rounded(y, out_dtype)
