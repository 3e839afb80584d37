"""Grouped GEMM reference in torch: CONTRACT.md section 4, one plain matmul per expert.

``y[m, :] = x[m, :] @ w[e(m)].T`` with float32 accumulation; for FP8 inputs the product of
the *dequantized* operands, which equals the contract's ``(q_x @ q_w.T) * scale_x * scale_w``
(with block scales applied per K block) up to float32 rounding; for 4-bit weights (MXFP4, INT4:
CONTRACT.md section 9) the product with each expert's weights dequantized in float32 and rounded to
``x.dtype``. An optional per-expert ``bias [E_local, N]`` is added to the float32 accumulator before the one
rounding (CONTRACT.md section 4). Rows ``>= M`` are zero.
Reads ``expert_offsets`` on the host (a sync): this is a reference, not a kernel. Having them there, each
reference checks them: offsets that decrease or leave ``[0, M_cap]`` raise ``ValueError`` naming the op (the
kernels' result is undefined for them; the references would otherwise drop or truncate rows silently).

The backward (CONTRACT.md section 8): ``grouped_gemm_dgrad_reference`` (``d_x[m] = d_y[m] @ w[e(m)]``)
and ``grouped_gemm_wgrad_reference`` (``d_w[e] = d_y[rows(e)].T @ x[rows(e)]``), one matmul per expert
as well, and ``grouped_gemm_dbias_reference`` (``d_bias[e] = sum of d_y[rows(e)]``), so that no
temporary is larger than one expert's weights (``[N, K]`` float32) or its rows.
float64 inputs (not accepted by the public ops; tests differentiate the references with
``torch.autograd`` / ``gradcheck`` in float64) are computed in float64, everything else in float32.

Mirror: ``moe_pallas/ops/grouped_gemm/reference.py``.
"""

from __future__ import annotations

import torch

from moe_contract.validation import check_offsets_values
from moe_torch.ops.common import cast_rounded
from moe_torch.ops.quant.reference import (
    dequantize_fp8_reference,
    dequantize_weight_4bit_reference,
    dequantize_weight_fp8_reference,
)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs (tests), float32 for everything else (the contract's accumulation)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def grouped_gemm_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    x_scale: torch.Tensor | None,
    w_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
    w_format: str | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [M_cap, K]``, ``w [E_local, N, K]``, ``expert_offsets [E_local + 1]`` -> ``y [M_cap, N]``.

    4-bit ``w`` (``w_format`` ``"mxfp4"`` / ``"int4"``, CONTRACT.md section 9): packed codes
    ``[E_local, N, K // 2]`` uint8 with ``w_scale [E_local, N, K // 32]``; each expert's weights are
    dequantized in float32 and rounded to ``x.dtype``, then multiplied as float weights. ``bias``
    ``[E_local, N]`` (optional): ``bias[e]`` widened to the accumulator's dtype is added to the rows of
    ``e`` (after the FP8 scales) before the rounding to ``out_dtype``.

    Raises: ValueError (``expert_offsets`` not non-decreasing within ``[0, M_cap]``)."""
    M_cap, K = x.shape
    E, N, _ = w.shape
    acc = _acc_dtype(x)
    xf = x.to(acc) if x_scale is None else dequantize_fp8_reference(x, x_scale)
    y = torch.zeros((M_cap, N), dtype=acc, device=x.device)
    offsets = expert_offsets.tolist()
    check_offsets_values("grouped_gemm", offsets, M_cap)
    for e in range(E):
        start, end = offsets[e], offsets[e + 1]
        if end <= start:
            continue  # an expert with no rows
        if w_format is not None:  # 4-bit: float32 dequantization rounded to x's dtype (section 9)
            w_e = dequantize_weight_4bit_reference(w[e], w_scale[e], w_format, x.dtype).to(acc)
        elif w_scale is None:
            w_e = w[e].to(acc)
        else:
            w_e = dequantize_weight_fp8_reference(w[e : e + 1], w_scale[e : e + 1])[0]
        part = xf[start:end] @ w_e.T
        if bias is not None:  # in the accumulator's dtype, before the one rounding (CONTRACT.md section 4)
            part = part + bias[e].to(acc)
        y[start:end] = part
    return cast_rounded(y, out_dtype)


def grouped_gemm_dgrad_reference(
    d_y: torch.Tensor,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``d_y [M_cap, N]``, ``w [E_local, N, K]`` (float8_e4m3fn codes with ``w_scale``) -> ``d_x [M_cap, K]``.

    ``d_x[m] = d_y[m] @ w[e(m)]`` with float32 accumulation; FP8 straight-through: ``w[e]`` dequantized
    (``q * scale`` in float32) and rounded to ``d_y.dtype`` first. Rows outside
    ``[offsets[0], offsets[-1])`` are zero and their ``d_y`` is never read.

    Raises: ValueError (``expert_offsets`` not non-decreasing within ``[0, M_cap]``)."""
    M_cap = d_y.shape[0]
    E, _, K = w.shape
    acc = _acc_dtype(d_y)
    d_x = torch.zeros((M_cap, K), dtype=out_dtype, device=d_y.device)
    offsets = expert_offsets.tolist()
    check_offsets_values("grouped_gemm_dgrad", offsets, M_cap)
    for e in range(E):
        start, end = offsets[e], offsets[e + 1]
        if end <= start:
            continue  # an expert with no rows
        if w_scale is None:
            w_e = w[e].to(acc)
        else:  # the float weights the backward uses: dequantized, rounded to d_y's dtype
            w_e = cast_rounded(dequantize_weight_fp8_reference(w[e : e + 1], w_scale[e : e + 1])[0], d_y.dtype).to(acc)
        d_x[start:end] = cast_rounded(d_y[start:end].to(acc) @ w_e, out_dtype)
    return d_x


def grouped_gemm_wgrad_reference(
    x: torch.Tensor,
    d_y: torch.Tensor,
    expert_offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``x [M_cap, K]``, ``d_y [M_cap, N]``, ``expert_offsets [E_local + 1]`` -> ``d_w [E_local, N, K]``.

    ``d_w[e] = d_y[rows(e)].T @ x[rows(e)]`` with float32 accumulation, rounded once to ``out_dtype``;
    an expert with no rows gets exactly 0; rows outside ``[offsets[0], offsets[-1])`` are never read.

    Raises: ValueError (``expert_offsets`` not non-decreasing within ``[0, M_cap]``)."""
    K, N = x.shape[1], d_y.shape[1]
    E = expert_offsets.shape[0] - 1
    acc = _acc_dtype(x)
    d_w = torch.zeros((E, N, K), dtype=out_dtype, device=x.device)
    offsets = expert_offsets.tolist()
    check_offsets_values("grouped_gemm_wgrad", offsets, x.shape[0])
    for e in range(E):
        start, end = offsets[e], offsets[e + 1]
        if end <= start:
            continue  # an expert with no rows: exactly 0
        d_w[e] = cast_rounded(d_y[start:end].to(acc).T @ x[start:end].to(acc), out_dtype)
    return d_w


def grouped_gemm_dbias_reference(
    d_y: torch.Tensor,
    expert_offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``d_y [M_cap, N]``, ``expert_offsets [E_local + 1]`` -> ``d_bias [E_local, N]``.

    ``d_bias[e] = sum of d_y[rows(e)]`` accumulated in float32 (float64 for float64 ``d_y``), rounded once
    to ``out_dtype``; an expert with no rows gets exactly 0; rows outside ``[offsets[0], offsets[-1])``
    are never read.

    Raises: ValueError (``expert_offsets`` not non-decreasing within ``[0, M_cap]``)."""
    N = d_y.shape[1]
    E = expert_offsets.shape[0] - 1
    acc = _acc_dtype(d_y)
    d_b = torch.zeros((E, N), dtype=out_dtype, device=d_y.device)
    offsets = expert_offsets.tolist()
    check_offsets_values("grouped_gemm_dbias", offsets, d_y.shape[0])
    for e in range(E):
        start, end = offsets[e], offsets[e + 1]
        if end <= start:
            continue  # an expert with no rows: exactly 0
        d_b[e] = cast_rounded(d_y[start:end].to(acc).sum(dim=0), out_dtype)
    return d_b
