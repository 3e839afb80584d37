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

**Backward** (CONTRACT.md section 8), ``_combine_backward_kernel``, one program per ``BLOCK_T``
tokens, walking the hidden dim in ``BLOCK_H`` chunks (``H_CHUNKS`` of them)::

    for each chunk:  do = d_out[t, cols]                     (float32, loaded once per chunk)
        for each slot j (unrolled):  dst = src2dst[t, j]
            d_y[dst, cols] = cast(c * w[t, j] * do)           a plain store: every row of d_y is
                                                             named by at most one slot (no atomics)
            dot[t, j] += sum(y[dst, cols] * do)               float32
    d_topk_weights[t, j] = c * dot[t, j]                     (0 for a non-local slot)

``d_y`` is zero-filled by the launcher first: rows no slot names (``>= M``, or padding) stay 0.
Only rows named by a local slot are read from ``y``.

**Row weights** (the layer's backward, where the combine's backward is folded into GEMM 2's: the weights are those of
each permuted row, ``w_row[m] = c * topk_weights[slot of m]``), ``_scale_rows_kernel``, one program per ``BLOCK_M``
rows walking the columns in ``BLOCK_N`` chunks::

    out[m, cols] = cast(float32(g[m, cols]) * w[m])          one rounding
    dots[m]     += sum(float32(a[m, cols]) * float32(g[m, cols]))   (with a: the row dots of d_topk_weights)
    a_w[m, cols] = cast(float32(a[m, cols]) * w[m])                  (on request: GEMM 2's wgrad operand)

one pass over ``g`` where torch's mixed-dtype multiply, product and sum took three (and a float32 temporary).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_torch.ops.combine.config import (
    CombineBackwardConfig,
    CombineConfig,
    combine_backward_config,
    combine_config,
)
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


# --------------------------------------------------------------------------------------
# backward


@triton.jit
def _combine_backward_kernel(
    d_out_ptr,  # [T, H] float32 / bf16 / fp16: gradient of combine's output
    y_ptr,  # [M_cap, H] float32 / bf16 / fp16: the forward's y
    src2dst_ptr,  # [T, topk] int32: permuted row of each (token, slot), -1 if non-local
    w_ptr,  # [T, topk] float32: topk_weights
    d_y_ptr,  # [M_cap, H] y.dtype out (zero-filled by the launcher): gradient of y
    d_w_ptr,  # [T, topk] float32 out: gradient of topk_weights
    T,  # int: tokens
    H,  # int: hidden size
    rsf,  # float32: routed scaling factor c (used only if APPLY_RSF)
    stride_do,  # int: d_out.stride(0)
    stride_y,  # int: y.stride(0)
    stride_s,  # int: src2dst.stride(0)
    stride_w,  # int: topk_weights.stride(0)
    stride_dy,  # int: d_y.stride(0)
    stride_dw,  # int: d_w.stride(0)
    TOPK: tl.constexpr,  # slots per token (the slot loop is unrolled)
    APPLY_RSF: tl.constexpr,  # bool: rsf != 1
    H_CHUNKS: tl.constexpr,  # cdiv(H, BLOCK_H): static loop bound (the interpreter's range(runtime) trap)
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # hidden columns per chunk (power of 2)
    BLOCK_K: tl.constexpr,  # power of 2 >= TOPK: columns of the d_w tile
):
    """Grid ``(cdiv(T, BLOCK_T),)``; program ``pid`` writes ``d_w[toks, :]`` and the rows
    ``d_y[src2dst[toks, j]]`` of its tokens ``toks = pid*BLOCK_T + [0, BLOCK_T)``."""
    pid = tl.program_id(0)
    toks = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = toks < T
    toks64 = toks.to(tl.int64)  # int64: token * stride passes 2**31 for large T * H
    kcol = tl.arange(0, BLOCK_K)
    dots = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for c in range(H_CHUNKS):
        cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
        col_mask = cols < H
        do = tl.load(d_out_ptr + toks64[:, None] * stride_do + cols[None, :],
                     mask=tok_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        for j in tl.static_range(TOPK):
            dst = tl.load(src2dst_ptr + toks64 * stride_s + j, mask=tok_mask, other=-1)
            wt = tl.load(w_ptr + toks64 * stride_w + j, mask=tok_mask, other=0.0)
            local = dst >= 0
            row = tl.where(local, dst, 0).to(tl.int64)  # int64: row * H passes 2**31
            mask = local[:, None] & col_mask[None, :]
            ys = tl.load(y_ptr + row[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dot = tl.sum(ys * do, axis=1)  # [BLOCK_T]; 0 for a non-local slot (nothing loaded)
            dots += tl.where(kcol[None, :] == j, dot[:, None], 0.0)
            coef = wt
            if APPLY_RSF:
                coef = wt * rsf
            tl.store(d_y_ptr + row[:, None] * stride_dy + cols[None, :],
                     (coef[:, None] * do).to(d_y_ptr.dtype.element_ty), mask=mask)
    if APPLY_RSF:
        dots = dots * rsf
    tl.store(d_w_ptr + toks64[:, None] * stride_dw + kcol[None, :], dots,
             mask=tok_mask[:, None] & (kcol < TOPK)[None, :])


def combine_backward_triton(
    d_out: torch.Tensor,
    y: torch.Tensor,
    src2dst: torch.Tensor,
    topk_weights: torch.Tensor,
    routed_scaling_factor: float,
    config: CombineBackwardConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_y [M_cap, H] y.dtype, d_topk_weights [T, topk] float32)`` with one Triton kernel; arguments
    as :func:`moe_torch.ops.combine.api.combine_backward` (already validated there). Both results are
    allocated here (``d_y`` zero-filled); the inputs are only read.

    Raises: NotImplementedError (no CUDA and no interpreter), ValueError (a given ``config`` that does
      not cover ``topk`` or has a non-power-of-2 block).
    """
    op = "combine_backward"
    check_triton_device(op, y.device, _combine_backward_kernel)
    T, topk = src2dst.shape
    M_cap, H = y.shape
    # Unit stride along the last dim is what the kernel indexes; copies leave the caller's tensors alone.
    d_out = d_out if d_out.stride(1) == 1 else d_out.contiguous()
    y = y if y.stride(1) == 1 else y.contiguous()
    src2dst = src2dst if src2dst.stride(1) == 1 else src2dst.contiguous()
    topk_weights = topk_weights if topk_weights.stride(1) == 1 else topk_weights.contiguous()
    cfg = config or combine_backward_config(T, H, topk)
    pow2 = all(v & (v - 1) == 0 for v in (cfg.block_t, cfg.block_h, cfg.block_k))
    if not pow2 or cfg.block_k < topk:
        raise ValueError(f"{op}: config must have power-of-2 blocks and block_k >= topk (={topk}); got {cfg}")
    d_y = torch.zeros((M_cap, H), dtype=y.dtype, device=y.device)  # rows no slot names stay 0
    d_w = torch.zeros((T, topk), dtype=torch.float32, device=y.device)
    if T == 0 or topk == 0 or H == 0:
        return d_y, d_w
    rsf = float(routed_scaling_factor)
    _combine_backward_kernel[(triton.cdiv(T, cfg.block_t),)](
        d_out, y, src2dst, topk_weights, d_y, d_w, T, H, rsf,
        d_out.stride(0), y.stride(0), src2dst.stride(0), topk_weights.stride(0), d_y.stride(0), d_w.stride(0),
        TOPK=topk, APPLY_RSF=rsf != 1.0, H_CHUNKS=triton.cdiv(H, cfg.block_h),
        BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return d_y, d_w


# --------------------------------------------------------------------------------------
# row weights of the layer's backward


@triton.jit
def _scale_rows_kernel(
    g_ptr,  # [M, N] float32 / bf16 / fp16: the rows to weight
    w_ptr,  # [M] float32: one weight a row
    a_ptr,  # HAS_DOTS: [M, N] float32 / bf16 / fp16, the rows to dot with g (unused otherwise)
    out_ptr,  # [M, N] out dtype: g weighted, rounded once
    dots_ptr,  # HAS_DOTS: [M] float32 out (unused otherwise)
    as_ptr,  # SCALE_A: [M, N] a's dtype out, a weighted, rounded once (unused otherwise)
    M,  # int: rows
    N,  # int: columns
    stride_g,  # int: g.stride(0)
    stride_a,  # int: a.stride(0) (HAS_DOTS)
    stride_o,  # int: out.stride(0)
    HAS_DOTS: tl.constexpr,  # bool: also the row dots <a[m], g[m]>
    SCALE_A: tl.constexpr,  # bool: also a weighted (HAS_DOTS; same strides as a)
    N_CHUNKS: tl.constexpr,  # cdiv(N, BLOCK_N): static loop bound (the interpreter's range(runtime) trap)
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per chunk (power of 2)
):
    """Grid ``(cdiv(M, BLOCK_M),)``: program ``pid`` writes ``out`` (and ``dots``) of rows ``pid*BLOCK_M + [0,
    BLOCK_M)`` (module docstring, row weights)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)  # int64: row * N passes 2**31 (300k rows of H = 7168)
    w = tl.load(w_ptr + rows64, mask=row_mask, other=0.0)
    dots = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c in range(N_CHUNKS):
        cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        g = tl.load(g_ptr + rows64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], (g * w[:, None]).to(out_ptr.dtype.element_ty),
                 mask=mask)
        if HAS_DOTS:
            a = tl.load(a_ptr + rows64[:, None] * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dots += tl.sum(a * g, axis=1)
            if SCALE_A:
                tl.store(as_ptr + rows64[:, None] * stride_a + cols[None, :],
                         (a * w[:, None]).to(as_ptr.dtype.element_ty), mask=mask)
    if HAS_DOTS:
        tl.store(dots_ptr + rows64, dots, mask=row_mask)


#: Columns of a chunk: 1024 float32 values of g (and of a) over 4 warps are 8 a thread, 32-byte loads.
SCALE_ROWS_BLOCK_N = 1024
#: Rows a program: 4 rows of H = 7168 are 28 chunks of work, enough to hide a program's start.
SCALE_ROWS_BLOCK_M = 4


def scale_rows_triton(
    g: torch.Tensor, row_weights: torch.Tensor, out_dtype: torch.dtype, dot_with: torch.Tensor | None,
    scale_dot_with: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(out [M, N] out_dtype, dots [M] float32 or None, dot_with weighted or None)`` with one Triton kernel; arguments as
    :func:`moe_torch.ops.combine.api.scale_rows` (validated there). The inputs are only read.

    Raises: NotImplementedError (no CUDA and no interpreter; a float64 tensor).
    """
    op = "scale_rows"
    check_triton_device(op, g.device, _scale_rows_kernel)
    if torch.float64 in (g.dtype, row_weights.dtype, out_dtype, getattr(dot_with, "dtype", None)):
        raise NotImplementedError(f"{op}: the Triton kernel computes in float32; float64 goes to the reference")
    M, N = g.shape
    g = g if g.stride(1) == 1 else g.contiguous()
    a = None if dot_with is None else dot_with if dot_with.stride(1) == 1 else dot_with.contiguous()
    w = row_weights.contiguous()
    out = torch.empty((M, N), dtype=out_dtype, device=g.device)
    dots = torch.empty((M,), dtype=torch.float32, device=g.device) if a is not None else None
    a_w = torch.empty_like(a) if scale_dot_with else None
    if M == 0 or N == 0:
        return out, None if dots is None else dots.zero_(), a_w
    block_n = min(SCALE_ROWS_BLOCK_N, triton.next_power_of_2(N))
    _scale_rows_kernel[(triton.cdiv(M, SCALE_ROWS_BLOCK_M),)](
        g, w, a if a is not None else g, out, dots if dots is not None else w, a_w if a_w is not None else out, M, N,
        g.stride(0), a.stride(0) if a is not None else 0, out.stride(0),
        HAS_DOTS=a is not None, SCALE_A=a_w is not None, N_CHUNKS=triton.cdiv(N, block_n), BLOCK_M=SCALE_ROWS_BLOCK_M, BLOCK_N=block_n,
        num_warps=4, num_stages=2,
    )
    return out, dots, a_w
