"""Triton kernels for the grouped GEMM backward (CONTRACT.md section 8, GEMM 1 and GEMM 2).

Given the forward ``y[m] = x[m] @ w[e(m)].T`` (``x [M_cap, K]``, ``w [E, N, K]``, ``y [M_cap, N]``,
``expert_offsets [E + 1]`` int32) and ``d_y [M_cap, N]``:

* **dgrad** ``d_x[m] = d_y[m] @ w[e(m)]`` -> ``[M_cap, K]``: the forward's row-grouped GEMM with the
  roles of N and K swapped. Same tile-to-expert mapping and launch orders as the forward (module
  docstring of ``moe_torch/ops/grouped_gemm/triton.py``, steps 1-5 and "Launch order"; the helpers
  ``_expert_row_tiles``, ``_work_item`` and ``_launch_order`` are the forward's), reading ``w [E, N, K]``
  as it is: the B operand of a step is ``w[e, n0:n0+BLOCK_K, cols]``, ``BLOCK_K`` rows of N
  (the reduction) by ``BLOCK_N`` contiguous columns of K (no transposed copy of the weights)::

      acc [BLOCK_M, BLOCK_N] float32 = 0
      for n0 in range(0, N, BLOCK_K):
          a = d_y[rows, n0:n0+BLOCK_K]                 rows not owned by this expert masked to 0
          b = w[e, n0:n0+BLOCK_K, cols]                [BLOCK_K, BLOCK_N]
          FP8 w: b = cast_rne(float32(b) * w_scale, d_y.dtype)    (straight-through, section 8)
          acc = tl.dot(a, b, acc)                      float32 accumulation (IEEE for float32)
      d_x[rows owned, cols < K] = cast_rne(acc)

  FP8 weights are dequantized in the kernel, each step, with the scale of every element: per-expert
  ``w_scale[e]``, per-output-channel ``w_scale[e, n]`` (here along the reduction, which is why it is
  applied before the dot and not after it as in the forward), 128x128 blocks
  ``w_scale[e, n // 128, k // 128]`` (``BLOCK_K`` divides 128, so a step lies in one block along N).
  The product is float32 and rounded to ``d_y``'s dtype: the weights the reference uses, bit for bit.

  **TMA variant** (``GroupedGemmConfig(tma=True)``; 16-bit ``d_y`` and ``w`` only: ``check_config(...,
  forward=False)`` refuses float32 and FP8 weights, which keep the pointer loads because they are dequantized per
  element), after the forward's (``triton.py``, "TMA variant": the same work items, grids and launch orders,
  host-side ``triton.tools.tensor_descriptor.TensorDescriptor`` arguments, zero padding). ``d_y [M_cap, N]`` comes
  in ``[BLOCK_M, BLOCK_K]`` boxes at ``[m0, n0]``: the whole row tile (rows of other experts, and of none, are
  loaded and computed but never stored: a row of ``d_x`` depends on its row of ``d_y`` only, so a NaN in an
  unused capacity row stays in that row; rows past ``M_cap`` are zero-filled). ``w`` is viewed as ``[E * N, K]``
  (no copy) in ``[BLOCK_K, BLOCK_N]`` boxes at ``[e * N + n0, pid_n * BLOCK_N]``: rows along the contraction,
  columns along ``d_x``'s K (past K zero-filled), ``tl.dot(a, b)`` without a transpose. The N loop is
  ``tl.range(0, N, BLOCK_K, warp_specialize=cfg.warp_specialize)``; the store is the pointer path's masked store.
  ``N % BLOCK_K == 0`` is required (a last partial step would read the next expert's weight rows; their ``d_y``
  columns are zero-filled, but ``0 * inf`` is NaN): ``_dgrad_tma_descriptors`` refuses it with
  ``NotImplementedError`` naming ``block_k``, as it refuses what TMA cannot address (a base address or row stride
  of ``d_y`` / ``w`` off 16 bytes, ``w.stride(0) != N * w.stride(1)``, ``M_cap`` or ``E * N`` of 2**31 or more:
  int32 coordinates). Those refusals are for a caller's config; the default (``config.py:
  grouped_gemm_dgrad_config``: the heuristic's tiles with ``tma=True`` for 16-bit ``d_y`` and ``w`` on sm_90 at
  ``M_cap >= 4096`` with wgmma row tiles, unless ``EPMOE_TRITON_TMA_DGRAD=0``) falls back to the pointer kernel with the same tiles and launch
  order. On by default because it beat the pointer loads on both of the layer's dgrads, most with the tuned entries
  (``tuned/sm90.json``, ``epmoe tune --ops dgrad``), level with or ahead of ``torch._grouped_mm``
  (BENCHMARKS.md).

* **wgrad** ``d_w[e] = d_y[rows(e)].T @ x[rows(e)]`` -> ``[E, N, K]``: a K-grouped GEMM (the
  contraction runs over each expert's rows, after jax's
  ``jax/experimental/pallas/ops/gpu/transposed_ragged_dot_mgpu.py`` and tokamax's ``drhs_ragged_dot``).
  Grid ``(cdiv(N, BLOCK_N) * cdiv(K, BLOCK_K), E)``: program ``(t, e)`` owns the tile
  ``d_w[e, pid_n * BLOCK_N :, pid_k * BLOCK_K :]`` (``pid_n = t // cdiv(K, BLOCK_K)``, ``pid_k`` the
  rest: the tiles of one expert are launched together, so they share its rows of ``x`` and ``d_y``
  in L2) and walks the expert's rows ``[s_e, t_e)`` ``BLOCK_M`` at a time::

      acc [BLOCK_N, BLOCK_K] float32 = 0
      for m0 in range(s_e, t_e, BLOCK_M):
          a = d_y[m0:m0+BLOCK_M, n tile]               rows >= t_e masked to 0
          b = x[m0:m0+BLOCK_M, k tile]
          acc = tl.dot(a.T, b, acc)
      d_w[e, n tile, k tile] = cast_rne(acc)           every element of d_w is written

  An expert with no rows runs no step and writes zeros (exactly 0); rows outside ``[s_e, t_e)`` are
  never read, so rows ``>= M = offsets[-1]`` of ``x`` and ``d_y`` are never read. The work of an
  expert is serial in its rows: under skewed routing one expert's programs take longest (a split
  over rows with a second reduction pass is the known remedy; not done yet).

* **dbias** ``d_bias[e] = sum of d_y[rows(e)]`` -> ``[E, N]`` (the gradient of the optional per-expert
  bias, CONTRACT.md section 8): a segment sum. Grid ``(cdiv(N, BLOCK_N), E)``: program ``(j, e)`` walks
  the expert's rows ``BLOCK_M`` at a time into a float32 ``[BLOCK_M, BLOCK_N]`` partial-sum tile (rows
  ``>= t_e`` masked to 0: never read) and reduces it over its rows once at the end; every element of
  ``d_bias`` is written, an empty expert's as exactly 0.

Offsets ``row * stride``, ``n * stride`` and ``e * N * K`` are int64 (``M_cap * K`` passes 2**31 at 300k
rows of H=7168, ``E * N * K`` at E=256, N=7168, K=2048). Precondition (not checked: a host sync):
``expert_offsets`` non-decreasing within ``[0, M_cap]``; other values are clamped, never dereferenced.

Must match ``moe_torch/ops/grouped_gemm/reference.py`` (``grouped_gemm_dgrad_reference``,
``grouped_gemm_wgrad_reference``, ``grouped_gemm_dbias_reference``) within CONTRACT.md section 8.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from moe_torch.ops.grouped_gemm.config import (
    W_SCALE_BLOCK,
    GroupedGemmConfig,
    GroupedGemmDbiasConfig,
    GroupedGemmWgradConfig,
    check_config,
    check_dbias_config,
    check_wgrad_config,
    grouped_gemm_dgrad_config,
    grouped_gemm_wgrad_config,
    heuristic_grouped_gemm_dbias_config,
)
from moe_torch.ops.grouped_gemm.triton import (
    TMA_ALIGN_BYTES,
    _MAX_TMA_ROWS,
    tile_meta,
    zero_unowned_rows,
    _MAX_EXPERTS,
    _WS_BLOCK,
    _WS_CHANNEL,
    _WS_EXPERT,
    _WS_NONE,
    W_SCALE_CODES,
    _expert_row_tiles,
    _launch_order,
    _work_item,
    launch_grid,
)
from moe_torch.ops.device import device_spec
from moe_torch.ops.quant.reference import FP8_DTYPE
from moe_torch.ops.triton_common import (MAX_GRID_AXIS_1, aligned_tiles_enabled, check_triton_device,
                                         gluon_dgrad_enabled, tma_dgrad_enabled)

#: Default configs looked up once per problem (host path of every backward step): the tuned entry of the device
#: (``config.tuned_tables``, ``"op": "dgrad"`` / ``"wgrad"``) where one fits, else the heuristic.
_dgrad_config = functools.cache(grouped_gemm_dgrad_config)
_wgrad_config = functools.cache(grouped_gemm_wgrad_config)
_dbias_config = functools.cache(heuristic_grouped_gemm_dbias_config)


@triton.jit
def _dgrad_tile(
    p,  # int32: this tile's work item (row tile, expert), 0 <= p < total
    pid_n,  # int32: this tile's column tile of d_x, columns [pid_n * BLOCK_N, +BLOCK_N) of K
    e_ids,  # [BLOCK_E] expert ids (``_expert_row_tiles``)
    starts,  # [BLOCK_E] s_e
    ends,  # [BLOCK_E] t_e
    first_row,  # [BLOCK_E] the first row of expert e's first tile (_expert_row_tiles)
    n_tiles,  # [BLOCK_E] n_e
    incl,  # [BLOCK_E] P_e + n_e
    dy_ptr,  # [M_cap, N] float32 / bf16 / fp16; unit column stride
    w_ptr,  # [E, N, K] d_y's dtype, or float8_e4m3fn codes; unit stride along K
    w_scale_ptr,  # FP8: float32 [E] / [E, N] / [E, cdiv(N, 128), cdiv(K, 128)] (unused otherwise)
    out_ptr,  # [M_cap, K] out dtype; unit column stride
    N,  # int: reduction size (columns of d_y)
    K,  # int: columns of d_x
    stride_dym,  # int: d_y.stride(0)
    stride_we,  # int: w.stride(0)
    stride_wn,  # int: w.stride(1)
    stride_om,  # int: out.stride(0)
    stride_wse,  # int: w_scale.stride(0)
    stride_wsn,  # int: w_scale.stride(1) (per-channel, block)
    stride_wsk,  # int: w_scale.stride(2) (block)
    W_SCALE: tl.constexpr,  # 0 none, 1 per-expert, 2 per-output-channel, 3 128x128 blocks
    W_BLOCK: tl.constexpr,  # weight-scale block width (128) (W_SCALE == 3), else 1
    IEEE_F32: tl.constexpr,  # bool: float32 operands, multiplied in full float32 (no TF32)
    BLOCK_M: tl.constexpr,  # rows per tile (power of 2)
    BLOCK_N: tl.constexpr,  # d_x columns (K) per tile (power of 2)
    BLOCK_K: tl.constexpr,  # reduction step along N (power of 2; divides W_BLOCK for block scales)
    TMA: tl.constexpr,  # bool: the TMA variant (16-bit d_y and w; N % BLOCK_K == 0: checked on the host)
    WARP_SPECIALIZE: tl.constexpr,  # bool: tl.range(..., warp_specialize=True) on the TMA variant's N loop
    dy_desc,  # TMA: tensor descriptor over d_y [M_cap, N], block [BLOCK_M, BLOCK_K], zero padding (else None)
    w_desc,  # TMA: tensor descriptor over w viewed as [E * N, K], block [BLOCK_K, BLOCK_N], zero padding (else None)
):
    """``d_x[owned rows, cols]`` of work item ``p`` and column tile ``pid_n`` over the whole N loop."""
    e, row_start, row_end, m0 = _work_item(p, e_ids, starts, ends, first_row, n_tiles, incl, BLOCK_M)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = (rows >= row_start) & (rows < row_end)
    rows64 = rows.to(tl.int64)  # int64: row * stride passes 2**31 for large M_cap * N
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < K
    cols64 = cols.to(tl.int64)
    e64 = e.to(tl.int64)  # int64: e * N * K passes 2**31 (E=256, N=7168, K=2048)
    offs_r = tl.arange(0, BLOCK_K)

    dy_rows = dy_ptr + rows64[:, None] * stride_dym  # [BLOCK_M, 1]
    w_cols = w_ptr + e64 * stride_we + cols64[None, :]  # [1, BLOCK_N], unit stride along K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TMA:
        # The whole [BLOCK_M, BLOCK_K] row tile of d_y at [m0, n0] (rows of other experts, or of none, are loaded and
        # computed but never stored: a row of d_x depends on its own row of d_y only; rows past M_cap are
        # zero-filled) and w's [BLOCK_K, BLOCK_N] tile at [e * N + n0, pid_n * BLOCK_N] of its [E * N, K] view: rows
        # along the contraction, all of them this expert's (N % BLOCK_K == 0, checked on the host), columns past K
        # zero-filled. int32 coordinates: M_cap and E * N are < 2**31 (checked on the host).
        w_row0 = e * N
        c0 = pid_n * BLOCK_N
        for n0 in tl.range(0, N, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
            acc = tl.dot(dy_desc.load([m0, n0]), w_desc.load([w_row0 + n0, c0]), acc)  # float32 accumulation
    else:  # pointer loads (every dtype; FP8 weights dequantized per element)
        if W_SCALE == _WS_EXPERT:
            s_e = tl.load(w_scale_ptr + e64 * stride_wse)
        for n0 in range(0, N, BLOCK_K):
            ns = n0 + offs_r
            n_mask = ns < N
            ns64 = ns.to(tl.int64)
            a = tl.load(dy_rows + ns[None, :], mask=row_mask[:, None] & n_mask[None, :], other=0.0)
            b = tl.load(w_cols + ns64[:, None] * stride_wn, mask=n_mask[:, None] & col_mask[None, :], other=0.0)
            if W_SCALE != _WS_NONE:
                # Straight-through FP8: q * scale in float32, rounded to d_y's dtype (the reference's weights).
                bf = b.to(tl.float32)
                if W_SCALE == _WS_EXPERT:
                    bf = bf * s_e
                if W_SCALE == _WS_CHANNEL:  # the output channel n is this GEMM's reduction index
                    bf = bf * tl.load(w_scale_ptr + e64 * stride_wse + ns64 * stride_wsn, mask=n_mask,
                                      other=0.0)[:, None]
                if W_SCALE == _WS_BLOCK:  # one block along N per step (BLOCK_K divides W_BLOCK)
                    bf = bf * tl.load(w_scale_ptr + e64 * stride_wse + (n0 // W_BLOCK) * stride_wsn
                                      + (cols64 // W_BLOCK) * stride_wsk, mask=col_mask, other=0.0)[None, :]
                b = bf.to(dy_ptr.dtype.element_ty)
            if IEEE_F32:
                acc = tl.dot(a, b, acc, input_precision="ieee")  # TF32 would miss float32 accuracy
            else:
                acc = tl.dot(a, b, acc)  # bf16 / fp16 tensor cores, float32 accumulation

    out_ptrs = out_ptr + rows64[:, None] * stride_om + cols64[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_gemm_dgrad_kernel(
    dy_ptr,  # [M_cap, N] float32 / bf16 / fp16; unit column stride
    w_ptr,  # [E, N, K] d_y's dtype, or float8_e4m3fn codes; unit stride along K
    offsets_ptr,  # [E + 1] int32 expert_offsets, non-decreasing
    w_scale_ptr,  # FP8: float32 [E] / [E, N] / [E, cdiv(N, 128), cdiv(K, 128)] (unused otherwise)
    out_ptr,  # [M_cap, K] out dtype; unit column stride
    M_cap,  # int: rows of d_y and d_x
    N,  # int: reduction size
    K,  # int: columns of d_x
    E,  # int: experts (E_local)
    stride_dym,  # int: d_y.stride(0)
    stride_we,  # int: w.stride(0)
    stride_wn,  # int: w.stride(1)
    stride_om,  # int: out.stride(0)
    stride_wse,  # int: w_scale.stride(0)
    stride_wsn,  # int: w_scale.stride(1) (per-channel, block)
    stride_wsk,  # int: w_scale.stride(2) (block)
    W_SCALE: tl.constexpr,  # 0 none, 1 per-expert, 2 per-output-channel, 3 128x128 blocks
    W_BLOCK: tl.constexpr,  # weight-scale block width (128) (W_SCALE == 3), else 1
    IEEE_F32: tl.constexpr,  # bool: float32 operands, multiplied in full float32 (no TF32)
    BLOCK_E: tl.constexpr,  # next_power_of_2(E + 1): the offsets search vector
    BLOCK_M: tl.constexpr,  # rows per tile (power of 2)
    BLOCK_N: tl.constexpr,  # d_x columns (K) per tile (power of 2)
    BLOCK_K: tl.constexpr,  # reduction step along N (power of 2)
    GROUP_M: tl.constexpr,  # launch-order swizzle (GroupedGemmConfig.group_m); 1: grid axis 0 = work item
    PERSISTENT: tl.constexpr,  # bool: each program loops over tiles with a stride of the grid size
    ALIGNED: tl.constexpr = False,  # bool: expert-aligned row tiles (aligned_tiles_enabled)
    TMA: tl.constexpr = False,  # bool: GroupedGemmConfig.tma (dy_desc / w_desc given)
    WARP_SPECIALIZE: tl.constexpr = False,  # bool: GroupedGemmConfig.warp_specialize
    dy_desc=None,  # TMA: tensor descriptor over d_y [M_cap, N], block [BLOCK_M, BLOCK_K] (_dgrad_tma_descriptors)
    w_desc=None,  # TMA: tensor descriptor over w viewed as [E * N, K], block [BLOCK_K, BLOCK_N]
):
    """The forward kernel's grids and launch orders (``_grouped_gemm_kernel``'s docstring), with
    ``cdiv(K, BLOCK_N)`` column tiles: each tile writes only the rows of its row tile that its expert owns."""
    pid = tl.program_id(0)
    if not PERSISTENT and GROUP_M == 1:  # (constexpr) the default 2-D grid
        pid_n = tl.program_id(1)
    e_ids, starts, ends, first_row, n_tiles, incl, total = _expert_row_tiles(offsets_ptr, M_cap, E, BLOCK_E, BLOCK_M,
                                                                             ALIGNED)
    n_cols = tl.cdiv(K, BLOCK_N)
    if PERSISTENT:
        for t in tl.range(pid, total * n_cols, tl.num_programs(0)):
            p, pid_n = _launch_order(t, total, n_cols, GROUP_M)
            _dgrad_tile(p, pid_n, e_ids, starts, ends, first_row, n_tiles, incl, dy_ptr, w_ptr, w_scale_ptr, out_ptr,
                        N, K, stride_dym, stride_we, stride_wn, stride_om, stride_wse, stride_wsn, stride_wsk, W_SCALE,
                        W_BLOCK, IEEE_F32, BLOCK_M, BLOCK_N, BLOCK_K, TMA, WARP_SPECIALIZE, dy_desc, w_desc)
    elif GROUP_M == 1:
        if pid < total:  # programs past the last work item do nothing
            _dgrad_tile(pid, pid_n, e_ids, starts, ends, first_row, n_tiles, incl, dy_ptr, w_ptr, w_scale_ptr,
                        out_ptr, N, K, stride_dym, stride_we, stride_wn, stride_om, stride_wse, stride_wsn, stride_wsk,
                        W_SCALE, W_BLOCK, IEEE_F32, BLOCK_M, BLOCK_N, BLOCK_K, TMA, WARP_SPECIALIZE, dy_desc, w_desc)
    else:
        if pid < total * n_cols:
            p, pid_n = _launch_order(pid, total, n_cols, GROUP_M)
            _dgrad_tile(p, pid_n, e_ids, starts, ends, first_row, n_tiles, incl, dy_ptr, w_ptr, w_scale_ptr, out_ptr,
                        N, K, stride_dym, stride_we, stride_wn, stride_om, stride_wse, stride_wsn, stride_wsk, W_SCALE,
                        W_BLOCK, IEEE_F32, BLOCK_M, BLOCK_N, BLOCK_K, TMA, WARP_SPECIALIZE, dy_desc, w_desc)


@triton.jit
def _grouped_gemm_wgrad_kernel(
    x_ptr,  # [M_cap, K] float32 / bf16 / fp16; unit column stride
    dy_ptr,  # [M_cap, N] x's dtype; unit column stride
    offsets_ptr,  # [E + 1] int32 expert_offsets, non-decreasing
    out_ptr,  # [E, N, K] out dtype; unit stride along K
    M_cap,  # int: rows of x and d_y
    N,  # int: rows of each d_w[e]
    K,  # int: columns of each d_w[e]
    stride_xm,  # int: x.stride(0)
    stride_dym,  # int: d_y.stride(0)
    stride_oe,  # int: out.stride(0)
    stride_on,  # int: out.stride(1)
    IEEE_F32: tl.constexpr,  # bool: float32 operands, multiplied in full float32 (no TF32)
    BLOCK_N: tl.constexpr,  # d_w tile rows (N) (power of 2)
    BLOCK_K: tl.constexpr,  # d_w tile columns (K) (power of 2)
    BLOCK_M: tl.constexpr,  # rows of x / d_y per step: the tl.dot reduction (power of 2, >= 16)
):
    """Grid ``(cdiv(N, BLOCK_N) * cdiv(K, BLOCK_K), E)``: program ``(t, e)`` writes the tile
    ``(t // cdiv(K, BLOCK_K), t % cdiv(K, BLOCK_K))`` of ``d_w[e]``, summed over the expert's rows."""
    t = tl.program_id(0)
    e = tl.program_id(1)
    k_tiles = tl.cdiv(K, BLOCK_K)
    pid_n = t // k_tiles
    pid_k = t % k_tiles
    start = tl.minimum(tl.maximum(tl.load(offsets_ptr + e), 0), M_cap)  # clamped: never outside x, d_y
    end = tl.minimum(tl.maximum(tl.load(offsets_ptr + e + 1), 0), M_cap)

    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = ns < N
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = ks < K
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):  # no step for an expert with no rows: its tile stays 0
        rows = m0 + offs_m
        row_mask = rows < end
        rows64 = rows.to(tl.int64)  # int64: row * stride passes 2**31 for large M_cap * K
        a = tl.load(dy_ptr + rows64[:, None] * stride_dym + ns[None, :], mask=row_mask[:, None] & n_mask[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_N]
        b = tl.load(x_ptr + rows64[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        if IEEE_F32:
            acc = tl.dot(tl.trans(a), b, acc, input_precision="ieee")  # TF32 would miss float32 accuracy
        else:
            acc = tl.dot(tl.trans(a), b, acc)  # bf16 / fp16 tensor cores, float32 accumulation

    e64 = e.to(tl.int64)  # int64: e * N * K passes 2**31 (E=256, N=7168, K=2048)
    out_ptrs = out_ptr + e64 * stride_oe + ns.to(tl.int64)[:, None] * stride_on + ks[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


def _w_scale_layout(w_scale: torch.Tensor | None) -> str | None:
    return None if w_scale is None else {1: "per_expert", 2: "per_channel", 3: "block"}[w_scale.ndim]


def grouped_gemm_dgrad_triton(
    d_y: torch.Tensor,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: GroupedGemmConfig | None = None,
) -> torch.Tensor:
    """``d_y [M_cap, N]``, ``w [E, N, K]`` (float8_e4m3fn with ``w_scale``), ``expert_offsets [E + 1]``
    int32 -> ``d_x [M_cap, K]`` ``out_dtype``; arguments as :func:`moe_torch.ops.grouped_gemm.api.grouped_gemm_dgrad`
    (already validated there). ``config``: a :class:`GroupedGemmConfig` with ``block_n`` over K and
    ``block_k`` over N (default :func:`~moe_torch.ops.grouped_gemm.config.grouped_gemm_dgrad_config`: this GPU's tuned
    ``"op": "dgrad"`` entry, ``benchmarks/tune_triton_gemm.py --ops dgrad``, where one fits (a TMA one unless
    ``EPMOE_TRITON_TMA_DGRAD=0``); else the heuristic, on sm_90 through the TMA variant for 16-bit ``d_y`` and ``w`` at
    ``M_cap >= 4096`` unless ``EPMOE_TRITON_TMA_DGRAD=0``). An explicit ``config`` wins. Without one,
    ``EPMOE_TRITON_GLUON_DGRAD=1`` (off by default: level with the tuned TMA dgrad) sends what
    :func:`gluon_dgrad_eligible` accepts to ``gluon_bf16.py: grouped_gemm_gluon_dgrad`` (its own zeroing of the unowned rows) with its
    ``DGRAD_DISPATCH_OPTIONS``.

    ``d_x`` is allocated here (``torch.empty``); the rows no expert owns (outside ``[offsets[0], offsets[-1])``)
    are zeroed after the kernel (:func:`~moe_torch.ops.grouped_gemm.triton.zero_unowned_rows`). No host sync.

    Raises: NotImplementedError (no CUDA and no interpreter; ``expert_offsets`` on another device;
      more than 4095 experts; too many column tiles; with ``config.tma``: float32 ``d_y``, FP8 weights,
      ``N % block_k != 0`` and what TMA cannot address, module docstring "TMA variant"), ValueError (a ``config``
      breaking the rules).
    """
    if config is None and gluon_dgrad_eligible(d_y, w, expert_offsets, w_scale, out_dtype):
        from moe_torch.ops.grouped_gemm.gluon_bf16 import DGRAD_DISPATCH_OPTIONS, grouped_gemm_gluon_dgrad

        return grouped_gemm_gluon_dgrad(d_y, w, expert_offsets, **DGRAD_DISPATCH_OPTIONS)
    out = torch.empty((d_y.shape[0], w.shape[2]), dtype=out_dtype, device=d_y.device)
    out = _launch_dgrad("grouped_gemm_dgrad", d_y, w, expert_offsets, w_scale, out, config)
    return zero_unowned_rows(out, expert_offsets)


def default_dgrad_config(d_y, w, w_scale, out_dtype) -> GroupedGemmConfig:
    """The config :func:`_launch_dgrad` runs ``d_y @ w`` with when none is given (the device's tuned dgrad entry, else
    the heuristic, the TMA switch applied). Host-side, cached per problem."""
    M_cap, N = d_y.shape
    E, _, K = w.shape
    return _dgrad_config(M_cap, N, K, E, d_y.element_size() * 8, _w_scale_layout(w_scale) == "block",
                         w_fp8=w.dtype == FP8_DTYPE, sm90=d_y.is_cuda and _is_sm90(d_y.device),
                         tma=tma_dgrad_enabled(), device=device_spec(d_y.device) if d_y.is_cuda else None,
                         out_bits=torch.finfo(out_dtype).bits)


def gluon_dgrad_eligible(d_y, w, expert_offsets, w_scale, out_dtype) -> bool:
    """Whether :func:`grouped_gemm_dgrad_triton` (no explicit config) runs this request on the 16-bit Gluon kernel
    (``gluon_bf16.py: grouped_gemm_gluon_dgrad``): :data:`triton_common.GLUON_DGRAD_ENV` on (off by default), then
    ``gluon_bf16.py: dgrad_eligible`` (bf16 / fp16 ``d_y``, ``w`` and out of one dtype, no ``w_scale``, sm_90,
    contiguous, ``N % 64 == 0``, ``K % 8 == 0``, ``M_cap >= 4096`` and ``>= 32 * E``). Host-side only (no sync)."""
    if not gluon_dgrad_enabled() or not d_y.is_cuda or w_scale is not None:
        return False
    try:
        from moe_torch.ops.grouped_gemm.gluon_bf16 import dgrad_eligible
    except ImportError:  # triton without gluon
        return False
    return dgrad_eligible(d_y, w, expert_offsets, w_scale, out_dtype)


def _launch_dgrad(op, d_y, w, expert_offsets, w_scale, out, config):
    """Run the dgrad kernel into ``out [M_cap, K]`` (unit column stride); writes only owned rows and
    ``cols < K``. Separate from :func:`grouped_gemm_dgrad_triton` so that tests can hand a poisoned view."""
    check_triton_device(op, d_y.device, _grouped_gemm_dgrad_kernel, needs_fp8=w.dtype == FP8_DTYPE)
    M_cap, N = d_y.shape
    E, _, K = w.shape
    if expert_offsets.device != d_y.device:  # the kernel reads the offsets itself (no host sync)
        raise NotImplementedError(f"{op}: the Triton kernel needs expert_offsets on d_y's device ({d_y.device}); "
                                  f"got {expert_offsets.device}")
    if E > _MAX_EXPERTS:
        raise NotImplementedError(f"{op}: the Triton kernel's expert search serves at most {_MAX_EXPERTS} experts; got E={E}")
    # Unit stride along the contiguous dims the kernel indexes; copies leave the caller's tensors alone.
    d_y = d_y if d_y.stride(1) == 1 else d_y.contiguous()
    w = w if w.stride(2) == 1 else w.contiguous()
    expert_offsets = expert_offsets.contiguous()
    layout = _w_scale_layout(w_scale)
    bits = d_y.element_size() * 8
    w_block = layout == "block"
    w_fp8 = w.dtype == FP8_DTYPE
    # the default: the device's tuned entry or the heuristic's tiles, through the TMA variant where
    # grouped_gemm_dgrad_config says (the switch is read at every launch; the device spec is
    # cached: no sync)
    cfg = config or _dgrad_config(M_cap, N, K, E, bits, w_block, w_fp8=w_fp8, sm90=_is_sm90(d_y.device),
                                  tma=tma_dgrad_enabled(), device=device_spec(d_y.device) if d_y.is_cuda else None,
                                  out_bits=out.element_size() * 8)
    check_config(op, cfg, bits, None, w_block, forward=False, w_fp8=w_fp8)  # TMA: 16-bit d_y and w only
    grid = launch_grid(op, cfg, M_cap, K, E, d_y.device)  # the forward's grid with K output columns
    if M_cap == 0 or K == 0 or E == 0:
        return out  # nothing to compute: every row stays 0
    dy_desc = w_desc = None
    if cfg.tma:
        try:
            dy_desc, w_desc = _dgrad_tma_descriptors(op, d_y, w, cfg)
        except NotImplementedError:
            if config is not None:
                raise  # asked for by the caller: say why it cannot be served
            # a default this d_y / w cannot take (N % block_k, alignment, strides): the pointer kernel, same tiles
            cfg = dataclasses.replace(cfg, tma=False, warp_specialize=False)
    ws = w_scale if w_scale is not None else out  # never read without FP8
    ws_strides = (*ws.stride(), 0, 0)[:3] if w_scale is not None else (0, 0, 0)
    _grouped_gemm_dgrad_kernel[grid](
        d_y, w, expert_offsets, ws, out, M_cap, N, K, E, d_y.stride(0), w.stride(0), w.stride(1), out.stride(0),
        *ws_strides,
        W_SCALE=W_SCALE_CODES[layout],
        W_BLOCK=W_SCALE_BLOCK if w_block else 1,
        IEEE_F32=d_y.dtype == torch.float32,
        BLOCK_E=triton.next_power_of_2(E + 1),
        ALIGNED=aligned_tiles_enabled(),
        TMA=cfg.tma,
        WARP_SPECIALIZE=cfg.warp_specialize,
        dy_desc=dy_desc,
        w_desc=w_desc,
        **tile_meta(cfg),
    )
    return out


@functools.cache
def _is_sm90(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 (Hopper), where the dgrad's TMA default applies."""
    return device.type == "cuda" and device_spec(device).is_hopper


def _dgrad_tma_descriptors(op: str, d_y: torch.Tensor, w: torch.Tensor, cfg: GroupedGemmConfig):
    """Host-side tensor descriptors ``(dy_desc, w_desc)`` of the dgrad's TMA variant (module docstring, "TMA
    variant"): ``d_y [M_cap, N]`` in ``[block_m, block_k]`` boxes, ``w [E, N, K]`` viewed as ``[E * N, K]`` in
    ``[block_k, block_n]`` boxes (rows along the contraction, columns along ``d_x``'s K), both zero-padded outside
    their bounds (``triton.tools.tensor_descriptor.TensorDescriptor``, as the forward's
    ``triton.py: _tma_descriptors``).

    Raises: NotImplementedError (``N % block_k != 0``: a last step would read the next expert's weight rows;
      what TMA cannot address: a base address or the row stride of ``d_y`` or ``w`` not a multiple of 16 bytes
      (contiguous inputs: ``N * itemsize`` or ``K * itemsize`` not one); ``w.stride(0) != N * w.stride(1)`` (no
      ``[E * N, K]`` view); ``N == 0`` (a TMA dimension must be positive); ``M_cap`` or ``E * N`` of 2**31 or more
      (int32 TMA coordinates))."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    M_cap, N = d_y.shape
    E, _, K = w.shape
    if N == 0 or N % cfg.block_k:
        raise NotImplementedError(f"{op}: config tma=True needs N > 0 and N % block_k == 0 (a step past an expert's "
                                  f"N weight rows would read the next expert's); got N={N}, block_k={cfg.block_k}")
    size = d_y.element_size()
    need = f"{TMA_ALIGN_BYTES}-byte aligned base addresses and row strides (TMA)"
    for name, t, stride in (("d_y", d_y, d_y.stride(0)), ("w", w, w.stride(1))):
        if t.data_ptr() % TMA_ALIGN_BYTES or (stride * size) % TMA_ALIGN_BYTES:
            raise NotImplementedError(f"{op}: config tma=True needs {need}; got {name} at address offset "
                                      f"{t.data_ptr() % TMA_ALIGN_BYTES} with a row stride of {stride * size} bytes")
    if E > 1 and w.stride(0) != N * w.stride(1):
        raise NotImplementedError(f"{op}: config tma=True views w [E, N, K] as [E * N, K], so it needs "
                                  f"w.stride(0) == N * w.stride(1) (={N * w.stride(1)}); got w.stride()={w.stride()}")
    if max(M_cap, E * N) > _MAX_TMA_ROWS:
        raise NotImplementedError(f"{op}: config tma=True addresses rows by int32 TMA coordinates, so M_cap and "
                                  f"E * N must be below 2**31; got M_cap={M_cap}, E * N={E * N}")
    dy_desc = TensorDescriptor(d_y, [M_cap, N], [d_y.stride(0), 1], [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor(w, [E * N, K], [w.stride(1), 1], [cfg.block_k, cfg.block_n])
    return dy_desc, w_desc


def grouped_gemm_wgrad_triton(
    x: torch.Tensor,
    d_y: torch.Tensor,
    expert_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    config: GroupedGemmWgradConfig | None = None,
) -> torch.Tensor:
    """``x [M_cap, K]``, ``d_y [M_cap, N]`` (same float dtype), ``expert_offsets [E + 1]`` int32 ->
    ``d_w [E, N, K]`` ``out_dtype``; arguments as :func:`moe_torch.ops.grouped_gemm.api.grouped_gemm_wgrad`
    (already validated there). ``config`` default: :func:`~moe_torch.ops.grouped_gemm.config.grouped_gemm_wgrad_config`
    (this GPU's tuned ``"op": "wgrad"`` Triton config, ``benchmarks/tune_triton_gemm.py --ops wgrad``, where one fits;
    else :func:`~moe_torch.ops.grouped_gemm.config.heuristic_grouped_gemm_wgrad_config`). An explicit ``config`` wins.

    The kernel writes every element of ``d_w`` (``torch.empty`` here): experts with no rows get exactly 0.
    No host sync.

    Raises: NotImplementedError (no CUDA and no interpreter; ``expert_offsets`` on another device;
      more experts or tiles than CUDA's grid allows), ValueError (a ``config`` breaking the rules).
    """
    out = torch.empty((expert_offsets.shape[0] - 1, d_y.shape[1], x.shape[1]), dtype=out_dtype, device=x.device)
    return _launch_wgrad("grouped_gemm_wgrad", x, d_y, expert_offsets, out, config)


def _launch_wgrad(op, x, d_y, expert_offsets, out, config):
    """Run the wgrad kernel into ``out [E, N, K]`` (unit stride along K); writes every element.
    Separate from :func:`grouped_gemm_wgrad_triton` so that tests can hand a poisoned buffer."""
    check_triton_device(op, x.device, _grouped_gemm_wgrad_kernel)
    M_cap, K = x.shape
    N = d_y.shape[1]
    E = out.shape[0]
    if expert_offsets.device != x.device:
        raise NotImplementedError(f"{op}: the Triton kernel needs expert_offsets on x's device ({x.device}); "
                                  f"got {expert_offsets.device}")
    x = x if x.stride(1) == 1 else x.contiguous()
    d_y = d_y if d_y.stride(1) == 1 else d_y.contiguous()
    expert_offsets = expert_offsets.contiguous()
    bits = x.element_size() * 8
    cfg = config or _wgrad_config(M_cap, N, K, E, bits, out_bits=out.element_size() * 8,
                                  device=device_spec(x.device) if x.is_cuda else None)
    check_wgrad_config(op, cfg, bits)
    if E > MAX_GRID_AXIS_1:
        raise NotImplementedError(f"{op}: {E} experts exceed CUDA's grid axis 1 limit {MAX_GRID_AXIS_1}")
    tiles = triton.cdiv(N, cfg.block_n) * triton.cdiv(K, cfg.block_k)
    if tiles >= 2**31:
        raise NotImplementedError(f"{op}: {tiles} tiles per expert exceed CUDA's grid axis 0 limit 2**31 - 1")
    if E == 0 or N == 0 or K == 0:
        return out  # an empty d_w
    _grouped_gemm_wgrad_kernel[(tiles, E)](
        x, d_y, expert_offsets, out, M_cap, N, K, x.stride(0), d_y.stride(0), out.stride(0), out.stride(1),
        IEEE_F32=x.dtype == torch.float32,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        BLOCK_M=cfg.block_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


@triton.jit
def _grouped_gemm_dbias_kernel(
    dy_ptr,  # [M_cap, N] float32 / bf16 / fp16; unit column stride
    offsets_ptr,  # [E + 1] int32 expert_offsets, non-decreasing
    out_ptr,  # [E, N] out dtype; unit column stride
    M_cap,  # int: rows of d_y
    N,  # int: columns of d_y and d_bias
    stride_dym,  # int: d_y.stride(0)
    stride_oe,  # int: out.stride(0)
    BLOCK_M: tl.constexpr,  # rows of d_y per step (power of 2)
    BLOCK_N: tl.constexpr,  # columns per program (power of 2)
):
    """Grid ``(cdiv(N, BLOCK_N), E)``: program ``(j, e)`` writes ``d_bias[e, j * BLOCK_N : (j + 1) * BLOCK_N]``,
    the float32 sum of ``d_y`` over the expert's rows (its partial-sum tile reduced once at the end)."""
    pid_n = tl.program_id(0)
    e = tl.program_id(1)
    start = tl.minimum(tl.maximum(tl.load(offsets_ptr + e), 0), M_cap)  # clamped: never outside d_y
    end = tl.minimum(tl.maximum(tl.load(offsets_ptr + e + 1), 0), M_cap)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):  # no step for an expert with no rows: its sum stays exactly 0
        rows = m0 + offs_m
        rows64 = rows.to(tl.int64)  # int64: row * stride passes 2**31 for large M_cap * N
        tile = tl.load(dy_ptr + rows64[:, None] * stride_dym + cols[None, :],
                       mask=(rows < end)[:, None] & col_mask[None, :], other=0.0)  # rows >= end are never read
        acc += tile.to(tl.float32)  # upcast right after the load: float32 accumulation
    d_b = tl.sum(acc, axis=0)
    tl.store(out_ptr + e.to(tl.int64) * stride_oe + cols, d_b.to(out_ptr.dtype.element_ty), mask=col_mask)


def grouped_gemm_dbias_triton(
    d_y: torch.Tensor,
    expert_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    config: GroupedGemmDbiasConfig | None = None,
) -> torch.Tensor:
    """``d_y [M_cap, N]`` float, ``expert_offsets [E + 1]`` int32 -> ``d_bias [E, N]`` ``out_dtype``; arguments
    as :func:`moe_torch.ops.grouped_gemm.api.grouped_gemm_dbias` (already validated there). ``config``
    default: :func:`heuristic_grouped_gemm_dbias_config`.

    The kernel writes every element of ``d_bias`` (``torch.empty`` here): experts with no rows get exactly 0;
    rows of ``d_y`` outside ``[offsets[0], offsets[-1])`` are never read. No host sync.

    Raises: NotImplementedError (no CUDA and no interpreter; ``expert_offsets`` on another device; more
      experts or column tiles than CUDA's grid allows), ValueError (a ``config`` breaking the rules).
    """
    op = "grouped_gemm_dbias"
    out = torch.empty((expert_offsets.shape[0] - 1, d_y.shape[1]), dtype=out_dtype, device=d_y.device)
    check_triton_device(op, d_y.device, _grouped_gemm_dbias_kernel)
    M_cap, N = d_y.shape
    E = out.shape[0]
    if expert_offsets.device != d_y.device:
        raise NotImplementedError(f"{op}: the Triton kernel needs expert_offsets on d_y's device ({d_y.device}); "
                                  f"got {expert_offsets.device}")
    d_y = d_y if d_y.stride(1) == 1 else d_y.contiguous()
    expert_offsets = expert_offsets.contiguous()
    cfg = config or _dbias_config(M_cap, N, E)
    check_dbias_config(op, cfg)
    if E > MAX_GRID_AXIS_1:
        raise NotImplementedError(f"{op}: {E} experts exceed CUDA's grid axis 1 limit {MAX_GRID_AXIS_1}")
    if E == 0 or N == 0:
        return out  # an empty d_bias
    _grouped_gemm_dbias_kernel[(triton.cdiv(N, cfg.block_n), E)](
        d_y, expert_offsets, out, M_cap, N, d_y.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
