"""Triton kernel for ``combine`` (un-permute and weighted sum; CONTRACT.md section 5).

Dataflow, one program per ``[BLOCK_T tokens] x [BLOCK_H hidden columns]``::

    for each slot j < topk (unrolled):
        dst = src2dst[t, j]                      int32, -1 for a non-local slot
        acc[t, :] += w[t, j] * y[dst, :]          float32; the load is masked by dst >= 0,
                                                  so a non-local slot reads no row of y
    out[t, :] = cast_rne(acc * rsf)              rsf only if != 1 (applied once, here)

Only rows named by a ``src2dst >= 0`` entry are read: rows ``>= M`` of the static-capacity
``y [M_cap, H]`` (garbage, possibly NaN) never reach the output, and a token with no local slot
gets exactly 0. Row offsets are int64 (``M_cap * H`` passes 2**31 at, e.g., T = 64k, topk = 8,
H = 7168).

Must match ``moe_torch/ops/combine/reference.py`` to float32 rounding (summation order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_torch.ops.combine.config import CombineConfig, combine_config
from moe_torch.ops.triton_common import MAX_GRID_AXIS_1, check_triton_device


@triton.jit
def _combine_kernel(
    y_ptr,  # [M_cap, H] float32 / bf16 / fp16: expert outputs in permuted order
    src2dst_ptr,  # [T, topk] int32: permuted row of each (token, slot), -1 if non-local
    w_ptr,  # [T, topk] float32: topk_weights
    out_ptr,  # [T, H] out dtype (float32 / bf16 / fp16)
    T,  # int: tokens
    H,  # int: hidden size
    rsf,  # float32: routed scaling factor (used only if APPLY_RSF)
    stride_y,  # int: y.stride(0)
    stride_s,  # int: src2dst.stride(0)
    stride_w,  # int: topk_weights.stride(0)
    stride_out,  # int: out.stride(0)
    TOPK: tl.constexpr,  # slots per token (the slot loop is unrolled)
    APPLY_RSF: tl.constexpr,  # bool: rsf != 1
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # hidden columns per program (power of 2)
):
    """Grid ``(cdiv(T, BLOCK_T), cdiv(H, BLOCK_H))``; program ``(pid_t, pid_h)`` writes
    ``out[pid_t*BLOCK_T : +BLOCK_T, pid_h*BLOCK_H : +BLOCK_H]``."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = toks < T
    toks64 = toks.to(tl.int64)  # int64: token * stride passes 2**31 for large T * H
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        dst = tl.load(src2dst_ptr + toks64 * stride_s + j, mask=tok_mask, other=-1)
        wt = tl.load(w_ptr + toks64 * stride_w + j, mask=tok_mask, other=0.0)
        local = dst >= 0
        y_row = tl.where(local, dst, 0).to(tl.int64) * stride_y  # int64: row * H passes 2**31
        ys = tl.load(y_ptr + y_row[:, None] + cols[None, :], mask=local[:, None] & col_mask[None, :], other=0.0)
        acc += tl.where(local, wt, 0.0)[:, None] * ys.to(tl.float32)  # a non-local slot adds exactly 0
    if APPLY_RSF:
        acc = acc * rsf
    out_mask = tok_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + toks64[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def combine_triton(
    y: torch.Tensor,
    src2dst: torch.Tensor,
    topk_weights: torch.Tensor,
    routed_scaling_factor: float,
    out_dtype: torch.dtype,
    config: CombineConfig | None = None,
) -> torch.Tensor:
    """``y [M_cap, H]``, ``src2dst [T, topk]`` int32, ``topk_weights [T, topk]`` float32 ->
    ``out [T, H]`` ``out_dtype``; arguments as :func:`moe_torch.ops.combine.api.combine`
    (already validated there). ``out`` is allocated here; the inputs are only read.

    Raises: NotImplementedError (no CUDA and no interpreter; too many hidden-dim blocks).
    """
    op = "combine"
    check_triton_device(op, y.device, _combine_kernel)
    T, topk = src2dst.shape
    H = y.shape[1]
    # Unit stride along the last dim is what the kernel indexes; copies leave the caller's tensors alone.
    y = y if y.stride(1) == 1 else y.contiguous()
    src2dst = src2dst if src2dst.stride(1) == 1 else src2dst.contiguous()
    topk_weights = topk_weights if topk_weights.stride(1) == 1 else topk_weights.contiguous()
    cfg = config or combine_config(T, H, topk)
    out = torch.empty((T, H), dtype=out_dtype, device=y.device)
    grid = (triton.cdiv(T, cfg.block_t), triton.cdiv(H, cfg.block_h))
    if grid[1] > MAX_GRID_AXIS_1:
        raise NotImplementedError(f"{op}: {grid[1]} hidden-dim programs exceed CUDA's grid axis 1 limit {MAX_GRID_AXIS_1}")
    if grid[0] == 0 or grid[1] == 0 or topk == 0:
        return out.zero_() if T and H else out  # no slot at all: every token gets 0
    _combine_kernel[grid](
        y,
        src2dst,
        topk_weights,
        out,
        T,
        H,
        float(routed_scaling_factor),
        y.stride(0),
        src2dst.stride(0),
        topk_weights.stride(0),
        out.stride(0),
        TOPK=topk,
        APPLY_RSF=float(routed_scaling_factor) != 1.0,
        BLOCK_T=cfg.block_t,
        BLOCK_H=cfg.block_h,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
