"""Triton kernels for ``routing_metadata`` and ``permute`` (CONTRACT.md sections 2-3).

**routing_metadata**, three launches, no host synchronisation (static capacity ``M_cap = T*topk``,
so the whole op is CUDA-graph capturable), deterministic (no atomics)::

    assignments a = t*topk + j, in blocks of BLOCK_A (program b owns a in [b*BLOCK_A, +BLOCK_A))
    key[a] = topk_ids[a] - expert_start if local else E_local          (non-local / out of range)
    1. _routing_count_kernel,   grid (n_blocks,):  counts[b, e] = sum_a onehot(key[a] == e)
    2. _routing_scan_kernel,    grid (1,):         prefix[b, e] = sum_{b' < b} counts[b', e]
                                                   expert_offsets = exclusive cumsum of totals
    3. _routing_scatter_kernel, grid (n_blocks,):  rank[a] = #{a' < a in block b: key[a'] == key[a]}
                                                   dst = expert_offsets[e] + prefix[b, e] + rank[a]
                                                   src2dst[a] = dst (or -1), dst2src[dst] = a,
                                                   dst2src[r] = -1 for r >= M in the block's range

Rows of one expert are thus ordered by block, then by position inside the block: by ``a``,
i.e. the reference's stable sort, bit for bit.

**permute**, one program per ``[BLOCK_M permuted rows] x [one column span]``::

    src = dst2src[r]; valid = src >= 0; token = src // topk
    x_row = x[token, cols] if valid else 0                  (int64 row offsets)
    no quant:      out [M_cap, H] = x_row                    (x.dtype, bit copy)
    per-tensor:    out = cast_rne(clamp(div_rn(float32(x_row), scale), -448, 448))
    per-token(-group): scale = max(amax over the span, 1e-10) * float32(1/448)   [M_cap, H // span]
                   out = cast_rne(clamp(div_rn(float32(x_row), scale), -448, 448))  float8_e4m3fn

**permute backward** (CONTRACT.md section 8), one program per ``[BLOCK_T tokens] x [BLOCK_H columns]``,
a gather by ``src2dst`` (no atomics)::

    d_x[t, cols] = cast(sum_j d_xp[src2dst[t, j], cols])     float32 sum over the local slots
                                                            (src2dst >= 0); none: 0

Must match ``moe_torch/ops/permute/reference.py`` exactly (metadata, rows, FP8 codes and scales;
the backward to float32 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_torch.ops.permute.config import (
    PermuteBackwardConfig,
    PermuteConfig,
    RoutingConfig,
    permute_backward_config,
    permute_config,
    routing_config,
)
from moe_torch.ops.quant.reference import FP8_DTYPE
from moe_torch.ops.triton_common import MAX_GRID_AXIS_1, check_triton_device, fp8_scale, quantize_fp8_tile


#: ``quant`` name -> the permute kernel's ``QUANT`` constexpr.
QUANT_CODES = {None: 0, "fp8_per_tensor": 1, "fp8_per_token": 2, "fp8_per_token_group": 3}


# --------------------------------------------------------------------------------------
# routing_metadata


@triton.jit
def _routing_onehot(
    ids_ptr,  # [M_cap] int32 / int64: topk_ids flattened (a = t*topk + j)
    pid,  # int: block index b
    M_cap,  # int: T * topk
    expert_start,  # int: first local expert id
    E_local,  # int: local experts
    BLOCK_A: tl.constexpr,  # assignments per block
    BLOCK_E: tl.constexpr,  # power of 2 >= E_local
):
    """``(a [BLOCK_A] int64, local [BLOCK_A] bool, key [BLOCK_A] int32, onehot [BLOCK_A, BLOCK_E] int32)``
    of block ``pid``; ``onehot`` is all zero on a non-local or masked assignment's row."""
    a = pid.to(tl.int64) * BLOCK_A + tl.arange(0, BLOCK_A)
    in_range = a < M_cap
    ids = tl.load(ids_ptr + a, mask=in_range, other=-1).to(tl.int64)
    rel = ids - expert_start  # int64: no wrap-around for any id of either dtype
    local = in_range & (rel >= 0) & (rel < E_local)
    key = tl.where(local, rel, E_local).to(tl.int32)  # E_local: never equal to an expert column < E_local
    experts = tl.arange(0, BLOCK_E)
    onehot = ((key[:, None] == experts[None, :]) & (experts < E_local)[None, :]).to(tl.int32)
    return a, local, key, onehot


@triton.jit
def _routing_count_kernel(
    ids_ptr,  # [M_cap] int32 / int64: topk_ids flattened
    counts_ptr,  # [n_blocks, BLOCK_E] int32 out: local assignments per (block, expert)
    M_cap,  # int: T * topk
    expert_start,  # int
    E_local,  # int
    BLOCK_A: tl.constexpr,  # assignments per program
    BLOCK_E: tl.constexpr,  # power of 2 >= E_local (row stride of counts)
):
    """Grid ``(n_blocks = cdiv(M_cap, BLOCK_A),)``: program ``b`` writes ``counts[b, :]``
    (zero in the padding columns ``e >= E_local``)."""
    pid = tl.program_id(0)
    _, _, _, onehot = _routing_onehot(ids_ptr, pid, M_cap, expert_start, E_local, BLOCK_A, BLOCK_E)
    tl.store(counts_ptr + pid.to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E), tl.sum(onehot, axis=0))


@triton.jit
def _routing_scan_kernel(
    counts_ptr,  # [n_blocks, BLOCK_E] int32 in: per-(block, expert) counts
    prefix_ptr,  # [n_blocks, BLOCK_E] int32 out: rows of expert e in blocks before b
    offsets_ptr,  # [E_local + 1] int32 out: expert_offsets
    n_blocks,  # int
    E_local,  # int
    BLOCK_B: tl.constexpr,  # blocks per step of the walk
    BLOCK_E: tl.constexpr,  # power of 2 >= E_local
):
    """Grid ``(1,)``: the exclusive scan over (expert, block). One program walks the blocks in
    order, ``BLOCK_B`` at a time, carrying the per-expert running totals (a deterministic scan;
    its input is ``M_cap / BLOCK_A`` rows, small next to the assignments themselves)."""
    experts = tl.arange(0, BLOCK_E)
    carry = tl.zeros([BLOCK_E], dtype=tl.int32)
    for b0 in range(0, n_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        ptrs = blocks.to(tl.int64)[:, None] * BLOCK_E + experts[None, :]
        mask = (blocks < n_blocks)[:, None]
        c = tl.load(counts_ptr + ptrs, mask=mask, other=0)
        incl = tl.cumsum(c, axis=0)
        tl.store(prefix_ptr + ptrs, carry[None, :] + incl - c, mask=mask)
        carry += tl.sum(c, axis=0)
    excl = tl.cumsum(carry, axis=0) - carry  # padding experts have zero totals
    tl.store(offsets_ptr + experts, excl, mask=experts < E_local)
    tl.store(offsets_ptr + E_local, tl.sum(carry, axis=0))  # M


@triton.jit
def _routing_scatter_kernel(
    ids_ptr,  # [M_cap] int32 / int64: topk_ids flattened
    prefix_ptr,  # [n_blocks, BLOCK_E] int32: from the scan
    offsets_ptr,  # [E_local + 1] int32: expert_offsets
    src2dst_ptr,  # [M_cap] int32 out: src2dst flattened
    dst2src_ptr,  # [M_cap] int32 out
    M_cap,  # int
    expert_start,  # int
    E_local,  # int
    BLOCK_A: tl.constexpr,  # assignments per program (as in the count kernel)
    BLOCK_E: tl.constexpr,  # power of 2 >= E_local
):
    """Grid ``(n_blocks,)``: program ``b`` writes ``src2dst[a]`` for its assignments, ``dst2src``
    at their rows, and ``-1`` at the rows ``r >= M`` among ``[b*BLOCK_A, +BLOCK_A)``: every row of
    ``dst2src`` is written exactly once over the grid (rows ``< M`` by their assignment)."""
    pid = tl.program_id(0)
    a, local, key, onehot = _routing_onehot(ids_ptr, pid, M_cap, expert_start, E_local, BLOCK_A, BLOCK_E)
    experts = tl.arange(0, BLOCK_E)
    # rank among the block's assignments to the same expert, in order of a (stable)
    rank = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - onehot), axis=1)
    base = tl.load(prefix_ptr + pid.to(tl.int64) * BLOCK_E + experts)
    base += tl.load(offsets_ptr + experts, mask=experts < E_local, other=0)
    dst = tl.sum(onehot * base[None, :], axis=1) + rank  # int32: rows < M_cap <= 2**31 - 1
    in_range = a < M_cap
    tl.store(src2dst_ptr + a, tl.where(local, dst, -1), mask=in_range)
    tl.store(dst2src_ptr + dst.to(tl.int64), a.to(tl.int32), mask=local)
    M = tl.load(offsets_ptr + E_local)
    tl.store(dst2src_ptr + a, tl.full([BLOCK_A], -1, tl.int32), mask=in_range & (a >= M))


def routing_metadata_triton(
    topk_ids: torch.Tensor, expert_start: int, num_local_experts: int, config: RoutingConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_ids [T, topk]`` int32 / int64 (``T >= 1``) -> ``(expert_offsets [E_local+1],
    src2dst [T, topk], dst2src [M_cap])`` int32, equal to
    :func:`moe_torch.ops.permute.reference.routing_metadata_reference`; arguments already
    validated by :func:`moe_torch.ops.permute.api.routing_metadata`. No host synchronisation.

    Raises: NotImplementedError (no CUDA and no interpreter; ``M_cap >= 2**31``), ValueError (a
      given ``config`` whose ``block_e`` does not cover ``num_local_experts``).
    """
    op = "routing_metadata"
    check_triton_device(op, topk_ids.device, _routing_scatter_kernel)
    T, topk = topk_ids.shape
    m_cap = T * topk
    if m_cap >= 2**31:
        raise NotImplementedError(f"{op}: M_cap = T*topk = {m_cap} does not fit the int32 outputs")
    cfg = config or routing_config(m_cap, num_local_experts)
    pow2 = all(v & (v - 1) == 0 for v in (cfg.block_a, cfg.block_e, cfg.block_b))
    if not pow2 or cfg.block_e < num_local_experts:
        raise ValueError(f"{op}: config must have power-of-2 blocks and block_e >= num_local_experts "
                         f"(={num_local_experts}); got {cfg}")
    device = topk_ids.device
    ids = topk_ids.reshape(m_cap)
    ids = ids if ids.is_contiguous() else ids.contiguous()  # a copy: the caller's tensor is untouched
    n_blocks = triton.cdiv(m_cap, cfg.block_a)
    counts = torch.empty((n_blocks, cfg.block_e), dtype=torch.int32, device=device)
    prefix = torch.empty_like(counts)
    offsets = torch.empty((num_local_experts + 1,), dtype=torch.int32, device=device)
    src2dst = torch.empty((T, topk), dtype=torch.int32, device=device)
    dst2src = torch.empty((m_cap,), dtype=torch.int32, device=device)
    consts = dict(BLOCK_E=cfg.block_e, num_warps=cfg.num_warps, num_stages=1)
    _routing_count_kernel[(n_blocks,)](ids, counts, m_cap, expert_start, num_local_experts,
                                       BLOCK_A=cfg.block_a, **consts)
    _routing_scan_kernel[(1,)](counts, prefix, offsets, n_blocks, num_local_experts, BLOCK_B=cfg.block_b, **consts)
    _routing_scatter_kernel[(n_blocks,)](ids, prefix, offsets, src2dst, dst2src, m_cap, expert_start,
                                         num_local_experts, BLOCK_A=cfg.block_a, **consts)
    return offsets, src2dst, dst2src


# --------------------------------------------------------------------------------------
# permute


@triton.jit
def _gather_tile(
    x_ptr,  # [T, H] float32 / bf16 / fp16
    x_row,  # [BLOCK_M] int64: token * stride_x (0 for invalid rows)
    valid,  # [BLOCK_M] bool: dst2src >= 0 (and row < M_cap)
    cols,  # [BLOCK_N] int32 column indices
    col_end,  # int: end of the span's columns
):
    """``x[token, cols]`` for one ``[BLOCK_M, BLOCK_N]`` tile, in ``x``'s dtype; 0 where masked."""
    mask = valid[:, None] & (cols < col_end)[None, :]
    return tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=mask, other=0.0)



@triton.jit
def _permute_kernel(
    x_ptr,  # [T, H] float32 / bf16 / fp16
    dst2src_ptr,  # [M_cap] int32: assignment of each permuted row, -1 for rows >= M
    out_ptr,  # [M_cap, H] x.dtype (QUANT == 0) or float8_e4m3fn
    scale_ptr,  # QUANT 1: [] float32 given scale (read); 2/3: [M_cap, H // SPAN] float32 (written)
    M_cap,  # int: T * topk
    H,  # int: hidden size
    topk,  # int: slots per token
    stride_x,  # int: x.stride(0)
    stride_out,  # int: out.stride(0)
    stride_scale,  # int: scale.stride(0) (QUANT 2/3)
    QUANT: tl.constexpr,  # 0 none, 1 static per-tensor, 2 per-token, 3 per-token-group
    SPAN: tl.constexpr,  # columns per program: BLOCK_N (QUANT 0/1), H (2), G (3)
    SINGLE_CHUNK: tl.constexpr,  # bool: SPAN <= BLOCK_N (the span is loaded once)
    BLOCK_M: tl.constexpr,  # permuted rows per program
    BLOCK_N: tl.constexpr,  # columns per chunk (power of 2)
):
    """Grid ``(cdiv(M_cap, BLOCK_M), cdiv(H, SPAN))`` (one column program per row for per-token).

    Program ``(pid_m, pid_n)`` writes ``out[pid_m*BLOCK_M : +BLOCK_M, pid_n*SPAN : +SPAN]`` and,
    for QUANT 2/3, ``scale[rows, pid_n]``. Rows with ``dst2src < 0`` read nothing: they are zero
    (with the zero-row scale ``1e-10 / 448`` when quantized dynamically).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M_cap
    rows64 = rows.to(tl.int64)  # int64: row * stride passes 2**31 for M_cap * H > 2**31 elements
    src = tl.load(dst2src_ptr + rows64, mask=row_mask, other=-1)
    valid = src >= 0
    x_row = (tl.where(valid, src, 0) // topk).to(tl.int64) * stride_x
    out_row = rows64 * stride_out
    col_start = pid_n * SPAN
    col_end = tl.minimum(col_start + SPAN, H)
    offs = tl.arange(0, BLOCK_N)

    if SINGLE_CHUNK:
        cols = col_start + offs
        out_mask = row_mask[:, None] & (cols < col_end)[None, :]
        xs = _gather_tile(x_ptr, x_row, valid, cols, col_end)
        if QUANT == 0:
            tl.store(out_ptr + out_row[:, None] + cols[None, :], xs, mask=out_mask)  # a bit copy
        elif QUANT == 1:
            s = tl.load(scale_ptr) + tl.zeros([BLOCK_M], dtype=tl.float32)
            tl.store(out_ptr + out_row[:, None] + cols[None, :], quantize_fp8_tile(xs.to(tl.float32), s), mask=out_mask)
        else:
            xf = xs.to(tl.float32)
            scale = fp8_scale(tl.max(tl.abs(xf), axis=1))
            tl.store(out_ptr + out_row[:, None] + cols[None, :], quantize_fp8_tile(xf, scale), mask=out_mask)
            tl.store(scale_ptr + rows64 * stride_scale + pid_n, scale, mask=row_mask)
    else:  # dynamic quant over a span wider than one chunk: amax pass, then quantize pass
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in range(0, SPAN, BLOCK_N):
            xs = _gather_tile(x_ptr, x_row, valid, col_start + c + offs, col_end)
            amax = tl.maximum(amax, tl.max(tl.abs(xs.to(tl.float32)), axis=1))
        scale = fp8_scale(amax)
        for c in range(0, SPAN, BLOCK_N):
            cols = col_start + c + offs
            out_mask = row_mask[:, None] & (cols < col_end)[None, :]
            xf = _gather_tile(x_ptr, x_row, valid, cols, col_end).to(tl.float32)
            tl.store(out_ptr + out_row[:, None] + cols[None, :], quantize_fp8_tile(xf, scale), mask=out_mask)
        tl.store(scale_ptr + rows64 * stride_scale + pid_n, scale, mask=row_mask)


def permute_triton(
    x: torch.Tensor,
    dst2src: torch.Tensor,
    topk: int,
    quant: str | None,
    group_size: int,
    scale: torch.Tensor | None,
    config: PermuteConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x [T, H]``, ``dst2src [M_cap]`` int32 -> ``(x_perm [M_cap, H], scale or None)``, equal to
    :func:`moe_torch.ops.permute.reference.permute_reference`; arguments as
    :func:`moe_torch.ops.permute.api.permute` (already validated there, ``T >= 1``; a per-tensor
    ``scale`` is ``[]`` float32 and is returned as given).

    ``x_perm`` is ``x.dtype`` without quant, else float8_e4m3fn with ``scale`` ``[M_cap, 1]``
    (``"fp8_per_token"``) / ``[M_cap, H // group_size]`` (``"fp8_per_token_group"``) float32
    dequant multipliers, allocated here. The inputs are only read.

    Raises: NotImplementedError (no CUDA and no interpreter; FP8 before sm_89; too many column
      programs), ValueError (a given ``config`` that cannot cover the quantization span).
    """
    op = "permute"
    check_triton_device(op, x.device, _permute_kernel, quantizes_fp8=quant is not None)
    T, H = x.shape
    m_cap = dst2src.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()  # a copy: the caller's tensor is untouched
    dst2src = dst2src if dst2src.is_contiguous() else dst2src.contiguous()
    cfg = config or permute_config(m_cap, H, quant, group_size)
    dynamic = quant in ("fp8_per_token", "fp8_per_token_group")
    out = torch.empty((m_cap, H), dtype=x.dtype if quant is None else FP8_DTYPE, device=x.device)
    if dynamic:
        span = H if quant == "fp8_per_token" else group_size
        n_spans = 1 if quant == "fp8_per_token" else H // group_size
        out_scale = torch.empty((m_cap, n_spans), dtype=torch.float32, device=x.device)
        scale_arg = out_scale
    else:
        span, n_spans = cfg.block_n, triton.cdiv(H, cfg.block_n)
        out_scale = scale  # None, or the given per-tensor scale (returned as the reference does)
        scale_arg = out if scale is None else scale.to(torch.float32).reshape(())  # never read without quant
    if cfg.block_n & (cfg.block_n - 1) or (cfg.single_chunk and span > cfg.block_n) or (not dynamic and not cfg.single_chunk):
        raise ValueError(f"{op}: config must have a power-of-2 block_n, single_chunk without dynamic quant, and "
                         f"block_n >= the quantization span (={span}) if single_chunk; got {cfg}")
    if n_spans > MAX_GRID_AXIS_1:
        raise NotImplementedError(f"{op}: {n_spans} column programs exceed CUDA's grid axis 1 limit {MAX_GRID_AXIS_1}")
    grid = (triton.cdiv(m_cap, cfg.block_m), n_spans)
    if grid[0] == 0 or grid[1] == 0:
        return out, out_scale  # nothing to compute (H = 0 without a per-token scale)
    _permute_kernel[grid](
        x,
        dst2src,
        out,
        scale_arg,
        m_cap,
        H,
        topk,
        x.stride(0),
        out.stride(0),
        out_scale.stride(0) if dynamic else 0,
        QUANT=QUANT_CODES[quant],
        SPAN=span,
        SINGLE_CHUNK=cfg.single_chunk,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, out_scale


# --------------------------------------------------------------------------------------
# permute backward


@triton.jit
def _permute_backward_kernel(
    d_xp_ptr,  # [M_cap, H] float32 / bf16 / fp16: gradient of the permuted rows
    src2dst_ptr,  # [T, topk] int32: permuted row of each (token, slot), -1 if non-local
    d_x_ptr,  # [T, H] out dtype: gradient of x
    T,  # int: tokens
    H,  # int: hidden size
    stride_dxp,  # int: d_xp.stride(0)
    stride_s,  # int: src2dst.stride(0)
    stride_dx,  # int: d_x.stride(0)
    TOPK: tl.constexpr,  # slots per token (the slot loop is unrolled)
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # hidden columns per program (power of 2)
):
    """Grid ``(cdiv(T, BLOCK_T), cdiv(H, BLOCK_H))``; program ``(pid_t, pid_h)`` writes
    ``d_x[pid_t*BLOCK_T : +BLOCK_T, pid_h*BLOCK_H : +BLOCK_H]``."""
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
        local = dst >= 0
        row = tl.where(local, dst, 0).to(tl.int64) * stride_dxp  # int64: row * H passes 2**31
        acc += tl.load(d_xp_ptr + row[:, None] + cols[None, :], mask=local[:, None] & col_mask[None, :],
                       other=0.0).to(tl.float32)  # a non-local slot reads nothing and adds 0
    tl.store(d_x_ptr + toks64[:, None] * stride_dx + cols[None, :], acc.to(d_x_ptr.dtype.element_ty),
             mask=tok_mask[:, None] & col_mask[None, :])


def permute_backward_triton(
    d_xp: torch.Tensor,
    src2dst: torch.Tensor,
    out_dtype: torch.dtype,
    config: PermuteBackwardConfig | None = None,
) -> torch.Tensor:
    """``d_xp [M_cap, H]``, ``src2dst [T, topk]`` int32 -> ``d_x [T, H]`` ``out_dtype``; arguments as
    :func:`moe_torch.ops.permute.api.permute_backward` (already validated there). ``d_x`` is allocated
    here; the inputs are only read.

    Raises: NotImplementedError (no CUDA and no interpreter; too many hidden-dim programs),
      ValueError (a given ``config`` with a non-power-of-2 block).
    """
    op = "permute_backward"
    check_triton_device(op, d_xp.device, _permute_backward_kernel)
    T, topk = src2dst.shape
    H = d_xp.shape[1]
    d_xp = d_xp if d_xp.stride(1) == 1 else d_xp.contiguous()  # copies: the caller's tensors are untouched
    src2dst = src2dst if src2dst.stride(1) == 1 else src2dst.contiguous()
    cfg = config or permute_backward_config(T, H)
    if cfg.block_t & (cfg.block_t - 1) or cfg.block_h & (cfg.block_h - 1):
        raise ValueError(f"{op}: config must have power-of-2 blocks; got {cfg}")
    d_x = torch.empty((T, H), dtype=out_dtype, device=d_xp.device)
    grid = (triton.cdiv(T, cfg.block_t), triton.cdiv(H, cfg.block_h))
    if grid[1] > MAX_GRID_AXIS_1:
        raise NotImplementedError(
            f"{op}: {grid[1]} hidden-dim programs exceed CUDA's grid axis 1 limit {MAX_GRID_AXIS_1}")
    if grid[0] == 0 or grid[1] == 0 or topk == 0:
        return d_x.zero_()  # no token, no column or no slot: nothing to gather
    _permute_backward_kernel[grid](
        d_xp, src2dst, d_x, T, H, d_xp.stride(0), src2dst.stride(0), d_x.stride(0),
        TOPK=topk, BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return d_x
