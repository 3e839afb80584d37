"""Triton kernel for the grouped GEMM ``y[m] = x[m] @ w[e(m)].T`` (CONTRACT.md section 4).

Shapes (contract names): ``x [M_cap, K]``, ``w [E, N, K]`` (out, in; K-major),
``expert_offsets [E + 1]`` int32 -> ``y [M_cap, N]``. Rows ``[offsets[e], offsets[e+1])`` use
``w[e]``; rows ``>= offsets[-1]`` (and ``< offsets[0]``) are never read nor written by the GEMM kernel,
and are zero in the result: the launcher allocates ``y`` empty and :func:`zero_unowned_rows` zeroes exactly the rows
no expert owns (as the reference's zeros; no memset of the whole result).

Dataflow of one tile (one row tile of one expert x one ``BLOCK_N`` column tile)::

    acc [BLOCK_M, BLOCK_N] float32 = 0
    for k0 in range(0, K, BLOCK_K):
        a = x[rows, k0:k0+BLOCK_K]       rows not owned by this expert masked to 0
        b = w[e, cols, k0:k0+BLOCK_K].T  [BLOCK_K, BLOCK_N] (K-major in memory)
            4-bit w (CONTRACT.md section 9): the packed bytes w_q[e, cols, k0/2 : (k0+BLOCK_K)/2] and
            their groups' scales w_scale[e, cols, k0/32 : (k0+BLOCK_K)/32], decoded (_w4_tiles) to x's
            dtype: bf16 x on a GPU on packed registers, two codes a PTX instruction (moe_contract/
            w4_packed_asm.py), else in float32 then rounded; the same values. The low nibbles (even K) and
            the high nibbles (odd K) are dotted with x's even / odd columns (two 16/32-bit dots)
        16/32-bit: acc = tl.dot(a, b, acc)                        (float32 accumulation)
        FP8 with per-step scales (per-token-group x, 128x128 blocks of w):
                   acc += tl.dot(a, b) * x_scale[rows, k0 // G] * w_scale[e, cols // 128, k0 // 128]
    FP8: acc *= x_scale (per-tensor [] or per-row [M_cap, 1], indexed BY ROW) * w_scale (per-expert
         [E] or per-output-channel [E, N], of this program's expert)
    bias (optional, [E, N] float32 / bf16 / fp16): acc += float32(bias[e, cols])   (after the scales)
    y[rows owned, cols < N] = cast_rne(acc)

The activation scale is always indexed by the permuted *row* ``m``, never by the expert id
(SGLang's EP-MoE once indexed a per-token scale by expert; that bug is why this project exists).

Tile-to-expert mapping (static grid, no host sync, CUDA-graph capturable), after megablox's
group metadata (jax@jax/experimental/pallas/ops/tpu/megablox/gmm.py: ``make_group_metadata``,
grid bound ``m_tiles + num_groups - 1``), computed inside every program instead of beforehand:

1. Expert ``e`` owns rows ``[s_e, t_e)`` (offsets clamped to ``[0, M_cap]`` and made non-decreasing, so experts
   never overlap: :func:`_expert_rows`). By default its row tiles are its own, ``[s_e + j*BLOCK_M, ...)`` for
   ``j < n_e = cdiv(t_e - s_e, BLOCK_M)`` (expert-aligned: no tile spent on the few rows it shares with a neighbour;
   the default because the layers measured faster with it, BENCHMARKS.md). ``EPMOE_TRITON_ALIGNED_TILES=0``
   (``moe_torch/ops/triton_common.py``) puts them on the global grid ``[t*BLOCK_M, (t+1)*BLOCK_M)``, tiles
   ``s_e // BLOCK_M .. (t_e - 1) // BLOCK_M``. ``n_e = 0`` for an empty expert; a tile's first row is ``first_row_e +
   j*BLOCK_M``.
2. A *work item* is a pair (row tile, expert) with a non-empty intersection. Work items are
   numbered expert by expert: expert ``e`` has items ``[P_e, P_e + n_e)``, ``P_e = sum_{e' < e} n_e'``
   (a ``tl.cumsum`` over the ``E + 1`` offsets, loaded as one small vector by every program).
3. The number of work items is at most ``cdiv(M_cap, BLOCK_M) + E - 1``: each tile is counted
   once, plus once more for every expert boundary inside it. That is the static size of grid
   axis 0 (default launch order, below); program ``p >= sum_e n_e`` has no work and does nothing.
4. Program ``p`` finds its expert by a vectorised search: ``e = #{e : P_e + n_e <= p}`` (the
   inclusive prefix sums are non-decreasing, so this counts exactly the experts before ``p``'s).
   Its tile's first row is ``m0 = first_row_e + (p - P_e) * BLOCK_M``.
5. It computes the whole tile with ``w[e]`` but loads and stores only the rows ``r`` of the tile
   with ``s_e <= r < t_e``. A tile straddling two experts is therefore computed by two programs,
   each writing only its own rows with its own expert's weights. Empty experts get no work item
   (they cost one vector lane of the search); rows ``>= offsets[-1]`` belong to no expert.

Launch order (``GroupedGemmConfig.group_m`` and ``.persistent``; correctness never depends on it:
every tile (work item, column tile) is computed exactly once, whatever the order):

* default (``group_m=1``, not persistent): grid ``(cdiv(M_cap, BLOCK_M) + E - 1, cdiv(N, BLOCK_N))``;
  axis 0 (work items) is the fastest varying in launch order, so the programs resident together
  share one ``BLOCK_N`` slice of one expert's weights (L2 reuse), but all of ``x`` is read again
  for every column tile.
* ``group_m=G > 1``: a 1-D grid of the same size; tile index ``t`` -> (work item, column tile) by
  triton's matmul tutorial swizzle (``GROUP_SIZE_M``, triton-lang/triton
  ``python/tutorials/03-matrix-multiplication.py``): ``G`` consecutive work items sweep all
  column tiles together, so their ``x`` tiles stay in L2 while one expert's weight tiles are
  reused ``G`` times. Near an expert boundary a group holds items of two experts (fine: each
  item uses its own expert's weights). Indices ``t >= total * n_cols`` do nothing.
* ``persistent``: ``min(#SMs, grid size)`` programs, each looping over tile indices ``t = pid,
  pid + #programs, ...`` below ``total * n_cols`` in the same order (``group_m`` applies): no
  idle programs launched, and steps 1-2 (offsets load, prefix sums) once per program, not per tile.

TMA variant (``GroupedGemmConfig(tma=True)``: ``_grouped_gemm_kernel`` with ``TMA``; the heuristic never selects it,
the H200's tuned bf16 entries at M=16384 do). 16-bit (bf16 / fp16) and FP8 forwards (every scale layout: the
scales load through pointers as in the pointer kernel) without bias only; the same work items, grids and launch
orders.
``x`` and ``w`` tiles come through host-side tensor descriptors (``triton.tools.tensor_descriptor.
TensorDescriptor``, zero padding): ``x [M_cap, K]`` in ``[BLOCK_M, BLOCK_K]`` boxes loaded at ``[tile *
BLOCK_M, k0]`` (the whole row tile: rows of other experts, and of no expert, are computed but never stored;
rows past ``M_cap`` and the K tail are zero-filled by the descriptor's bounds), ``w`` viewed as ``[E * N, K]``
in ``[BLOCK_N, BLOCK_K]`` boxes at ``[e * N + pid_n * BLOCK_N, k0]`` (the N tail reads the next expert's rows:
computed, never stored). The store stays the masked pointer store. The K loop is ``tl.range(0, K, BLOCK_K,
warp_specialize=cfg.warp_specialize)``. Refused on the host before launch: by ``check_config``
(``NotImplementedError`` naming ``tma=True``) float32, 4-bit weights, a bias (the dgrad kernel has a TMA variant of
its own for 16-bit ``d_y`` and ``w``: ``triton_backward.py``), and
``warp_specialize`` below 8 warps; (``ValueError``) blocks over 256 (a TMA box side), ``warp_specialize``
without ``tma``; by ``_tma_descriptors`` (``NotImplementedError``) a base address or row stride of ``x`` or
``w`` not a multiple of 16 bytes (contiguous inputs: ``K * itemsize % 16 != 0``, e.g. odd K), ``w.stride(0)
!= N * w.stride(1)``, ``K == 0``, and ``M_cap`` or ``E * N`` of 2**31 or more (int32 TMA coordinates). Those
refusals are for a caller's config: a tuned default (``config=None``) that such inputs cannot take runs the pointer
kernel with the same tiles and launch order instead.

Hopper: what Triton 3.6 offers (read in the installed triton 3.6.0 and compiled for sm_90 on a
CPU, ``tests/test_triton_gemm_tma.py``; timings in BENCHMARKS.md):

* TMA: device-side ``tl.make_tensor_descriptor`` (needs ``triton.set_allocator`` for the descriptor's global
  scratch) and host-side ``TensorDescriptor`` kernel arguments (the launcher encodes the ``CUtensorMap``,
  ``backends/nvidia/driver.py: make_tensordesc_arg``; no allocator). The interpreter implements both
  (``runtime/interpreter.py``: descriptor loads become masked loads, with TMA's alignment asserts). This
  kernel uses host-side descriptors: simplest, and they run in the interpreter. On sm_90 they lower to
  ``cp.async.bulk.tensor`` + mbarriers feeding ``wgmma`` (64x128 / 4 warps, 128x256 / 8 warps, persistent too).
* ``tl.range(..., warp_specialize=True)``: documented "only supported on Blackwell", but the sm_90 pipeline
  (``backends/nvidia/compiler.py: make_ttgir``, capability 9) runs ``nvidia.passes.hopper.add_hopper_warpspec``.
  On this kernel it fails to compile with 4 warps (``NVGPUWarpSpecialization``: refused by ``check_config``)
  and with 8 warps yields PTX identical to ``warp_specialize=False`` (no producer partition, no
  ``setmaxnreg``): a no-op here. Hand-written warp specialization on Hopper needs Gluon or Mosaic GPU.
* Persistent kernels: plain ``tl.range(pid, tiles, num_programs)`` loops (``persistent=True`` above); ``tl.range``
  also has ``flatten=`` (nested-loop fusion, run on sm_90 by ``add_fuse_nested_loops``), not used here.
* Why the tuned tables pick it (``benchmarks/tune_triton_gemm.py --tma``; the timings are in BENCHMARKS.md): for
  bf16 at M=16384, 128x256 / 8 warps, persistent, ``group_m`` 4 beats every pointer config (``warp_specialize``
  on or off is run-to-run noise: identical PTX). For FP8 per token x per channel, a 128 x 128 tile over 4 warps
  (one warpgroup, two ``m64`` wgmmas a step), 3 stages, ``group_m`` 4 wins too, level with
  ``torch._scaled_grouped_mm``. For FP8 blocks it stays over the target: the promotion below.
* The FP8-block limit: ``tl.dot`` is asynchronous only when its result is the next dot's accumulator, so "scale
  and add the finished K block while the next ``wgmma`` runs" (DeepGEMM's promotion; ``moe_pallas``'s
  warp-specialized Mosaic GPU kernel does it) cannot be written with it. Triton 3.6's Gluon dialect
  (``triton.experimental.gluon``) has the parts: ``nvidia.hopper.warpgroup_mma(a, b, acc, use_acc=False,
  is_async=True)`` (a fresh accumulator, asynchronous), ``warpgroup_mma_wait(num_outstanding=1, deps=[...])``,
  ``gl.warp_specialize(..., worker_num_warps, worker_num_regs)`` (producer / consumer partitions with their register
  budgets), ``nvidia.hopper.tma`` and ``mbarrier``. Compiled for sm_90 on a CPU (``tests/
  gluon_promotion_probe.py``, not run on a GPU): two K blocks a loop step, the first awaited with the second in
  flight, keep ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` in the SASS; promoting a block issued in the previous iteration
  (an in-flight accumulator carried by the loop) is serialized by ``ptxas`` (C7514: the wait becomes ``0x0``). A
  Gluon kernel is the way to the schedule in the torch framework, a backend of its own (Gluon has no interpreter).
  ``moe_torch/ops/grouped_gemm/gluon.py`` is that kernel (a TMA producer warp group and two consumer warpgroups
  in ``gl.warp_specialize``, two K blocks a step so that one is promoted while the next ``wgmma`` runs).
  :func:`grouped_gemm_triton` sends FP8-block requests it can serve there by default (:func:`gluon_fp8_block_eligible`;
  ``EPMOE_TRITON_GLUON_FP8_BLOCK=0`` keeps this kernel), because it is faster on the GEMMs and the layers
  (BENCHMARKS.md).

Offsets ``row * stride`` and ``e * N * K`` are int64 (both pass
2**31: ``M_cap * K`` at 300k rows of H=7168, ``E * N * K`` at E=256, N=7168, K=2048).

Precondition (not checked: that would need a host sync): ``expert_offsets`` non-decreasing, as
``routing_metadata`` makes them; values outside ``[0, M_cap]`` are clamped, never dereferenced.

Must match ``moe_torch/ops/grouped_gemm/reference.py`` within CONTRACT.md section 7.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch
import triton
import triton.language as tl

from moe_contract.selection import DeviceSpec
from moe_contract.w4_layout import MXFP4_MMA_MAX_SCALE_CODE, e8m0_bf16_bits_mma
from moe_contract.w4_packed_asm import (BF16_E8M0_ZERO_BITS, BF16_NAN_BITS, INT4_PACKED_ASM, MXFP4_MMA_PACKED_ASM,
                                      MXFP4_PACKED_ASM, PACKED_ASM_CONSTRAINTS, e8m0_bf16_bits)
from moe_torch.ops.grouped_gemm.config import (GLUON_MIN_ROWS, GLUON_MIN_ROWS_PER_EXPERT, TMA_MAX_BLOCK, W_SCALE_BLOCK, GroupedGemmConfig, check_config, grouped_gemm_config,
                                               hopper_wide_config, tuned_forward_kernel)
from moe_torch.ops.device import device_spec
from moe_torch.ops.quant.reference import FP8_DTYPE, mxfp4_mma_as_checkpoint
from moe_torch.ops import triton_interpret
from moe_torch.ops.triton_common import (MAX_GRID_AXIS_1, aligned_tiles_enabled, check_triton_device,
                                         gluon_bf16_switch, gluon_fp8_block_enabled, gluon_fp8_rowwise_enabled)
from moe_torch.ops.dispatch import passed_over, warn_once

#: ``x_scale`` layout -> the kernel's ``X_SCALE`` constexpr.
X_SCALE_CODES = {None: 0, "per_tensor": 1, "per_token": 2, "per_token_group": 3}
#: ``w_scale`` layout -> the kernel's ``W_SCALE`` constexpr; ``"mxfp4"`` and ``"int4"`` are 4-bit
#: packed weights with one scale per group of 32 along K (CONTRACT.md section 9).
W_SCALE_CODES = {None: 0, "per_expert": 1, "per_channel": 2, "block": 3, "mxfp4": 4, "int4": 5, "mxfp4_mma": 6}
# The same codes as constexprs, for the kernel's comparisons (triton only reads constexpr globals).
_XS_NONE, _XS_TENSOR, _XS_ROW, _XS_GROUP = (tl.constexpr(c) for c in X_SCALE_CODES.values())
_WS_NONE, _WS_EXPERT, _WS_CHANNEL, _WS_BLOCK, _WS_MXFP4, _WS_INT4, _WS_MXFP4_MMA = (
    tl.constexpr(c) for c in W_SCALE_CODES.values())
#: float32 bit patterns of the 4-bit decode (CONTRACT.md section 9): e2m1 0.5 (exponent field 126, the
#: value of code 1), the e8m0 scale 2^-127 of ``s = 0`` (a subnormal: mantissa bit 22), a quiet NaN
#: (the e8m0 scale 255).
_F32_HALF_BITS = tl.constexpr(0x3F000000)
_F32_2_POW_M127_BITS = tl.constexpr(1 << 22)
_F32_NAN_BITS = tl.constexpr(0x7FC00000)
_F32_2_POW_23_BITS = tl.constexpr(0x4B000000)  # 2^23: its float32 mantissa bits hold an integer 0 .. 2^23 - 1 exactly
#: bf16 bit patterns of the e8m0 scales 2^-127 (``s = 0``, a subnormal: mantissa bit 6) and 255 (a quiet NaN).
_BF16_2_POW_M127_BITS = tl.constexpr(BF16_E8M0_ZERO_BITS)
_BF16_NAN_BITS = tl.constexpr(BF16_NAN_BITS)
_PACKED_CONSTRAINTS = tl.constexpr(PACKED_ASM_CONSTRAINTS)

# The packed decode of 4-bit codes to bf16 on 32-bit registers (``_w4_tiles`` with bf16 ``x`` on a GPU; the
# interpreter cannot run inline PTX and takes the float32 decode): the PTX of ``moe_contract/w4_packed_asm.py``,
# shared with the Pallas-Triton kernel.
_MXFP4_PACKED_ASM = tl.constexpr(MXFP4_PACKED_ASM)
_INT4_PACKED_ASM = tl.constexpr(INT4_PACKED_ASM)
# MXFP4 codes in the MMA layout (``moe_contract/w4_layout.py``): one mask per pair, the scale table 2^(s - 1).
_MXFP4_MMA_PACKED_ASM = tl.constexpr(MXFP4_MMA_PACKED_ASM)
_MMA_MAX_SCALE_CODE = tl.constexpr(MXFP4_MMA_MAX_SCALE_CODE)
#: Whether ``_w4_tiles`` decodes bf16 tiles with the packed asm above: everywhere but the interpreter (which has
#: no inline PTX; it runs the float32 decode, whose values are the same, CONTRACT.md section 9).
_W4_PACKED = tl.constexpr(not triton.knobs.runtime.interpret)
#: Vector width of the offsets search: ``E + 1`` offsets in one ``tl.arange``. 4096 experts is
#: far beyond any model (DeepSeek-V3: 256); more would make every program's search costly.
_MAX_EXPERTS = 4095
#: Bound on ``work items x column tiles``: the 1-D launch orders index tiles in int32, and the
#: persistent loop adds the grid size to an index below this without overflow. Real problems are
#: far below (300k rows of 16-row tiles x 7168 / 16 columns: 8.4M).
_MAX_TILES = 2**30
#: Programs of a persistent launch in the interpreter (no SM count; small, so that every program
#: loops over several tiles in the tests).
INTERPRETER_PROGRAMS = 4


def _num_sms(device: torch.device) -> int:
    """Programs of a persistent launch: the SM count of a CUDA device (torch caches the device
    properties: no sync), :data:`INTERPRETER_PROGRAMS` in the interpreter."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return device_spec(device).sm_count


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


triton_interpret.register_scan(_max2, np.maximum)  # interpreted running max: numpy, not a Python loop


@triton.jit
def _expert_rows(offsets_ptr, M_cap, E, BLOCK_E: tl.constexpr):
    """``(e_ids, e_valid, starts s_e, ends t_e)`` over ``BLOCK_E`` lanes: expert ``e`` owns rows ``[s_e, t_e)``, the
    offsets clamped to ``[0, M_cap]`` and made non-decreasing (a running max, as JAX's ``tile_metadata``), so that the
    experts' rows never overlap, whatever the offsets: the static grid then covers every owned row (without it,
    ``[0, 48, 0, 64]`` made two ranges overlap and rows 48-63 were never written), and the rows the kernels do not
    write are exactly those :func:`_zero_unowned_rows_kernel` zeroes."""
    e_ids = tl.arange(0, BLOCK_E)
    e_valid = e_ids < E
    starts = tl.minimum(tl.maximum(tl.load(offsets_ptr + e_ids, mask=e_valid, other=0), 0), M_cap)
    ends = tl.minimum(tl.maximum(tl.load(offsets_ptr + e_ids + 1, mask=e_valid, other=0), 0), M_cap)
    starts = tl.associative_scan(starts, 0, _max2)  # max(offsets[0..e])
    ends = tl.maximum(tl.associative_scan(ends, 0, _max2), starts)  # max(offsets[0..e+1])
    return e_ids, e_valid, starts, ends


@triton.jit
def _expert_row_tiles(
    offsets_ptr,  # [E + 1] int32 expert_offsets, non-decreasing
    M_cap,  # int: rows of the row-grouped operand
    E,  # int: experts (E_local)
    BLOCK_E: tl.constexpr,  # next_power_of_2(E + 1): the offsets search vector
    BLOCK_M: tl.constexpr,  # rows per tile
    ALIGNED: tl.constexpr = False,  # bool: expert-aligned tiles (EPMOE_TRITON_ALIGNED_TILES)
):
    """Steps 1-2 of the module docstring: per expert (vectors over ``BLOCK_E`` lanes, 0 past ``E``)
    ``(e_ids, starts s_e, ends t_e, first_row, n_tiles n_e, incl P_e + n_e)`` and the number of work items
    ``total``, from :func:`_expert_rows`. ``first_row``: the first row of expert ``e``'s first tile, ``(s_e //
    BLOCK_M) * BLOCK_M`` on the global grid, or with ``ALIGNED`` ``s_e`` itself (the expert's own tiles
    ``[s_e + j * BLOCK_M, ...)``, ``n_e = cdiv(t_e - s_e, BLOCK_M)``: no tile spent on the few rows an expert shares
    with a neighbour; the grid bound of step 3 holds: a sum of ceilings exceeds the ceiling of the sum by less than
    the number of non-empty experts). Shared with the backward's dgrad kernel (``triton_backward.py``)."""
    e_ids, e_valid, starts, ends = _expert_rows(offsets_ptr, M_cap, E, BLOCK_E)
    nonempty = (ends > starts) & e_valid
    if ALIGNED:
        first_row = starts
    else:
        first_row = starts // BLOCK_M * BLOCK_M
    n_tiles = tl.where(nonempty, (ends - first_row + BLOCK_M - 1) // BLOCK_M, 0)
    incl = tl.cumsum(n_tiles, axis=0)  # P_e + n_e
    total = tl.sum(n_tiles, axis=0)
    return e_ids, starts, ends, first_row, n_tiles, incl, total


@triton.jit
def _zero_unowned_rows_kernel(
    out_ptr,  # [M_cap, N], unit column stride
    offsets_ptr,  # [E + 1] int32 expert_offsets
    M_cap,
    N,
    E,
    stride_om,
    BLOCK_E: tl.constexpr,  # next_power_of_2(E + 1)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Rows ``[pid*BLOCK_M, (pid+1)*BLOCK_M)`` of ``out`` that no expert owns (no ``e`` with ``s_e <= r < t_e`` from
    :func:`_expert_rows`, as the GEMM kernels assign rows, so exactly the rows they never write, whatever the offsets)
    set to 0 in every column ``< N``; owned rows are not touched. A block whose rows are all owned stores nothing."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    _, e_valid, starts, ends = _expert_rows(offsets_ptr, M_cap, E, BLOCK_E)
    inside = (rows[:, None] >= starts[None, :]) & (rows[:, None] < ends[None, :]) & e_valid[None, :]
    owned = tl.sum(inside.to(tl.int32), axis=1) > 0
    unowned = (rows < M_cap) & (owned == 0)
    if tl.sum(unowned.to(tl.int32), axis=0) > 0:
        rows64 = rows.to(tl.int64)
        zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            tl.store(out_ptr + rows64[:, None] * stride_om + cols[None, :], zero,
                     mask=unowned[:, None] & (cols < N)[None, :])


def zero_unowned_rows(out: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """Zero the rows of ``out [M_cap, N]`` (unit column stride) that no expert of ``expert_offsets [E + 1]`` owns
    (:func:`_zero_unowned_rows_kernel`), in place, on ``out``'s device; returns ``out``. The GEMM launchers allocate
    their result with ``torch.empty`` and call this after the kernel: the contract's zero rows (``>= offsets[-1]``,
    ``< offsets[0]``) without a memset of the whole result (a T=4096 layer forward's two GEMM outputs are 738 MB).
    No host sync (the offsets are read by the kernel); a launch whose rows are all owned stores nothing."""
    M_cap, N = out.shape
    if M_cap == 0 or N == 0:
        return out
    E = expert_offsets.shape[0] - 1
    block_e = triton.next_power_of_2(E + 1)
    block_m = max(2, min(64, 8192 // block_e))  # the [BLOCK_M, BLOCK_E] ownership test stays ~8K lanes
    _zero_unowned_rows_kernel[(triton.cdiv(M_cap, block_m),)](
        out, expert_offsets.contiguous(), M_cap, N, E, out.stride(0), BLOCK_E=block_e, BLOCK_M=block_m,
        BLOCK_N=min(256, triton.next_power_of_2(N)))
    return out


@triton.jit
def _work_item(p, e_ids, starts, ends, first_row, n_tiles, incl, BLOCK_M: tl.constexpr):
    """Step 4 of the module docstring: work item ``p`` -> ``(expert e, its rows [row_start, row_end),
    the first row m0 of its tile)``, scalars pulled out of :func:`_expert_row_tiles`' vectors by a masked sum."""
    e = tl.sum((incl <= p).to(tl.int32), axis=0)
    this = e_ids == e
    row_start = tl.sum(tl.where(this, starts, 0), axis=0)
    row_end = tl.sum(tl.where(this, ends, 0), axis=0)
    m0 = tl.sum(tl.where(this, first_row + (n_tiles - incl) * BLOCK_M, 0), axis=0) + p * BLOCK_M  # + (p - P_e) tiles
    return e, row_start, row_end, m0


@triton.jit
def _w4_tiles(
    w_rows,  # [BLOCK_N, 1] pointers to w_q[e, cols, 0] (uint8 [E, N, K // 2], unit stride along K // 2)
    ws_rows,  # [BLOCK_N, 1] pointers to w_scale[e, cols, 0] (uint8 e8m0 / bf16 [E, N, K // 32])
    stride_wsk,  # int: w_scale.stride(2)
    k0,  # int: first K element of this step (a multiple of BLOCK_K)
    K,  # int: reduction size (a multiple of 32)
    col_mask,  # [BLOCK_N] bool: cols < N
    W4: tl.constexpr,  # _WS_MXFP4, _WS_INT4 or _WS_MXFP4_MMA (bf16 DTYPE on a GPU only: the launchers' check)
    BLOCK_N: tl.constexpr,  # columns per tile
    BLOCK_K: tl.constexpr,  # K step: a power of 2 >= 32 (whole scale groups)
    DTYPE: tl.constexpr,  # x's dtype: the decoded weights are rounded to it
    e8m0_lut=None,  # None, or bf16 [256]: 2^(s - 127) by e8m0 code (MXFP4, packed decode); 2^(s - 1) for MXFP4_MMA
):
    """``(w_even, w_odd)``: the weights ``wd[e, cols, k0 + 2i]`` and ``wd[e, cols, k0 + 2i + 1]`` (``[BLOCK_N,
    BLOCK_K // 2]`` each, in ``DTYPE``; zero outside ``cols < N``, ``k < K``: masked bytes and scales load as 0, and
    ``e2m1(0) * 2^-127`` and ``(0 - 8) * 0`` are 0) of 4-bit packed codes, exactly as ``dequantize_weight_mxfp4`` /
    ``dequantize_weight_int4`` (CONTRACT.md section 9): byte ``i`` of a row holds element ``2i`` in its low nibble
    and ``2i + 1`` in its high nibble, so the two halves are the low and the high nibbles of one loaded tile and
    the caller pairs them with ``x``'s even and odd columns (no interleave: its join / reshape costs a layout
    conversion). Each group of 32 elements (16 bytes) has one scale: ``[BLOCK_N, BLOCK_K // 32]`` are loaded and
    decoded once, then broadcast over their 16 bytes.

    MXFP4: code ``c`` -> magnitude ``q = c & 7`` as float32 bits, ``0`` / ``0.5`` for ``q = 0 / 1`` and
    ``(q << 22) + bits(0.5)`` above (exponent ``(q >> 1) + 126``, mantissa bit ``q & 1``: 1, 1.5, 2, 3, 4, 6), sign
    bit 3 -> bit 31 (code 8 is -0.0); the e8m0 scale ``s`` -> ``2^(s - 127)`` as ``s << 23``, the subnormal ``2^-127``
    for ``s = 0``, NaN for ``s = 255``; their product is exact. INT4: ``c - 8`` as ``float32(2^23 + c) - (2^23 + 8)``
    (exact; no int-to-float conversion), times ``float32(scale)``, rounded once to ``DTYPE``.

    bf16 ``DTYPE`` outside the interpreter: the same values from the packed PTX of ``moe_contract/w4_packed_asm.py``
    (4 bytes a call; MXFP4 scales as bf16 from ``e8m0_lut`` when given, else from their bits). ``_WS_MXFP4_MMA``:
    the codes in the MMA layout (CONTRACT.md section 9), decoded by ``MXFP4_MMA_PACKED_ASM`` into the same two
    halves, with the folded scales ``2^(s - 1)`` (``e8m0_bf16_bits_mma``; NaN for 129..254 and 255): the 4 bytes of
    a call must be one aligned word of the row, as the load's layout gives them (16-byte vectors along K)."""
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 32
    if W4 == _WS_MXFP4_MMA:
        # whole 16-byte groups known to the compiler (k0 // 2 and (K // 32) * 16 = K // 2 are multiples of 16), so
        # that a thread's bytes come in 16-byte vectors: the asm's 4 bytes must be one word of the row
        kp = tl.multiple_of(k0 // 2, 16) + tl.arange(0, HALF)
        packed_u8 = tl.load(w_rows + kp[None, :], mask=col_mask[:, None] & (kp < (K // 32) * 16)[None, :], other=0)
    else:
        kp = k0 // 2 + tl.arange(0, HALF)  # packed byte columns
        packed_u8 = tl.load(w_rows + kp[None, :], mask=col_mask[:, None] & (kp < K // 2)[None, :], other=0)
    kg = k0 // 32 + tl.arange(0, GROUPS)  # scale groups of this step
    scale = tl.load(ws_rows + kg[None, :] * stride_wsk, mask=col_mask[:, None] & (kg < K // 32)[None, :], other=0)
    if _W4_PACKED and DTYPE == tl.bfloat16:  # the packed asm decode (above), with the scales as bf16
        if W4 == _WS_MXFP4_MMA and e8m0_lut is not None:
            sb = tl.load(e8m0_lut + scale.to(tl.int32))
        elif W4 == _WS_MXFP4_MMA:  # (s + 126) << 7 = 2^(s - 1) up to code 128, else NaN
            s = scale.to(tl.int32)
            s_bits = tl.where(s <= _MMA_MAX_SCALE_CODE, (s + 126) << 7, _BF16_NAN_BITS)
            sb = s_bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        elif W4 == _WS_MXFP4 and e8m0_lut is not None:
            # a gather from the 512-byte table, on the compact [BLOCK_N, GROUPS] tile (the arithmetic below is
            # redone per element after the broadcast, which the compiler moves to the bytes: 410 -> 363 SASS a step)
            sb = tl.load(e8m0_lut + scale.to(tl.int32))
        elif W4 == _WS_MXFP4:
            s = scale.to(tl.int32)
            s_bits = tl.where(s == 0, _BF16_2_POW_M127_BITS, tl.where(s == 255, _BF16_NAN_BITS, s << 7))
            sb = s_bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            sb = scale.to(tl.bfloat16)
        sb = tl.reshape(tl.broadcast_to(sb[:, :, None], (BLOCK_N, GROUPS, 16)), (BLOCK_N, HALF))
        if W4 == _WS_MXFP4_MMA:
            lo, hi = tl.inline_asm_elementwise(_MXFP4_MMA_PACKED_ASM, _PACKED_CONSTRAINTS, [packed_u8, sb],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        elif W4 == _WS_MXFP4:
            lo, hi = tl.inline_asm_elementwise(_MXFP4_PACKED_ASM, _PACKED_CONSTRAINTS, [packed_u8, sb],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(_INT4_PACKED_ASM, _PACKED_CONSTRAINTS, [packed_u8, sb],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return lo, hi
    else:  # (visited only without the packed decode: the code after a constexpr branch's return is compiled too)
        tl.static_assert(W4 != _WS_MXFP4_MMA, "MMA-layout codes are decoded by the packed asm only (bf16, a GPU)")
    if W4 == _WS_MXFP4:
        s = scale.to(tl.int32)
        s_bits = tl.where(s == 0, _F32_2_POW_M127_BITS, s << 23)
        sv = tl.where(s == 255, _F32_NAN_BITS, s_bits).to(tl.float32, bitcast=True)
    else:
        sv = scale.to(tl.float32)
    sv = tl.reshape(tl.broadcast_to(sv[:, :, None], (BLOCK_N, GROUPS, 16)), (BLOCK_N, HALF))  # each byte's group
    packed = packed_u8.to(tl.int32)
    lo = _w4_decode(packed & 0xF, W4) * sv
    hi = _w4_decode((packed >> 4) & 0xF, W4) * sv
    return lo.to(DTYPE), hi.to(DTYPE)


@triton.jit
def _w4_decode(c, W4: tl.constexpr):
    """float32 value of 4-bit codes ``c`` (int32, 0..15) before the scale (:func:`_w4_tiles`)."""
    if W4 == _WS_MXFP4:
        q = c & 7
        mag = tl.where(q < 2, q * _F32_HALF_BITS, (q << 22) + _F32_HALF_BITS)
        return (mag | ((c & 8) << 28)).to(tl.float32, bitcast=True)
    else:
        return (c | _F32_2_POW_23_BITS).to(tl.float32, bitcast=True) - 8388616.0  # 2^23 + c - (2^23 + 8)


@triton.jit
def _promote_step(acc, part, k0, rows64, row_mask, cols, col_mask, e64, pid_n, x_scale_ptr, w_scale_ptr, stride_xsm,
                  stride_xsk, stride_wse, stride_wsn, stride_wsk, X_SCALE: tl.constexpr, W_SCALE: tl.constexpr,
                  X_GROUP: tl.constexpr, W_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    """``acc + part * scales`` for the FP8 K step at ``k0`` whose scales vary along K (per-token-group ``x``
    scales ``[M_cap, K // X_GROUP]`` and / or 128 x 128 weight blocks ``[E, cdiv(N, W_BLOCK), cdiv(K, W_BLOCK)]``;
    the step lies in one group and one block). Where the tile's columns lie in one weight block (``BLOCK_N <=
    W_BLOCK``, powers of 2) its weight scale is one scalar, folded into the row scales, so the promotion is one
    FFMA an element (was FMUL + FFMA and a per-column scale gather: SASS a step 290 -> 212 at 64x128x128 over 4
    warps, 306 -> 184 at 128x128x128 over 8; ``benchmarks/sass_gemm.py --format fp8_block``)."""
    if W_SCALE == _WS_BLOCK and BLOCK_N <= W_BLOCK:
        sw = tl.load(w_scale_ptr + e64 * stride_wse + ((pid_n * BLOCK_N) // W_BLOCK) * stride_wsn
                     + (k0 // W_BLOCK) * stride_wsk)
        if X_SCALE == _XS_GROUP:
            sx = tl.load(x_scale_ptr + rows64 * stride_xsm + (k0 // X_GROUP) * stride_xsk, mask=row_mask, other=0.0)
            acc += part * (sx * sw)[:, None]
        else:
            acc += part * sw
    else:
        if X_SCALE == _XS_GROUP:
            sx = tl.load(x_scale_ptr + rows64 * stride_xsm + (k0 // X_GROUP) * stride_xsk, mask=row_mask, other=0.0)
            part = part * sx[:, None]
        if W_SCALE == _WS_BLOCK:
            sw = tl.load(w_scale_ptr + e64 * stride_wse + (cols // W_BLOCK) * stride_wsn + (k0 // W_BLOCK) * stride_wsk,
                         mask=col_mask, other=0.0)
            part = part * sw[None, :]
        acc += part
    return acc


@triton.jit
def _grouped_gemm_tile(
    p,  # int32: this tile's work item (row tile, expert), 0 <= p < total (see the module docstring)
    pid_n,  # int32: this tile's column tile, columns [pid_n * BLOCK_N, +BLOCK_N)
    e_ids,  # [BLOCK_E] expert ids 0..BLOCK_E-1
    starts,  # [BLOCK_E] s_e, clamped (0 past E)
    ends,  # [BLOCK_E] t_e, clamped (0 past E)
    first_row,  # [BLOCK_E] the first row of expert e's first tile (_expert_row_tiles)
    n_tiles,  # [BLOCK_E] n_e
    incl,  # [BLOCK_E] P_e + n_e
    x_ptr,  # [M_cap, K] float32 / bf16 / fp16, or float8_e4m3fn codes; unit column stride
    w_ptr,  # [E, N, K] same dtype as x (fp8 codes with fp8 x), or 4-bit codes uint8 [E, N, K // 2]; unit stride along K
    x_scale_ptr,  # FP8: float32 [] / [M_cap, 1] / [M_cap, K // G] dequant multipliers (unused otherwise)
    w_scale_ptr,  # FP8: float32 [E] / [E, N] / [E, cdiv(N, 128), cdiv(K, 128)]; 4-bit: [E, N, K // 32] (uint8 e8m0 / bf16)
    bias_ptr,  # HAS_BIAS: [E, N] float32 / bf16 / fp16, unit column stride (unused otherwise)
    out_ptr,  # [M_cap, N] out dtype (float32 / bf16 / fp16); unit column stride
    x_desc,  # TMA: tensor descriptor over x [M_cap, K], block [BLOCK_M, BLOCK_K], zero padding (else None)
    w_desc,  # TMA: tensor descriptor over w viewed as [E * N, K], block [BLOCK_N, BLOCK_K] (else None)
    M_cap,  # int: rows of x and y
    N,  # int: output columns
    K,  # int: reduction size
    stride_xm,  # int: x.stride(0)
    stride_we,  # int: w.stride(0)
    stride_wn,  # int: w.stride(1)
    stride_om,  # int: out.stride(0)
    stride_xsm,  # int: x_scale.stride(0) (2-D scales)
    stride_xsk,  # int: x_scale.stride(1) (per-token-group)
    stride_wse,  # int: w_scale.stride(0)
    stride_wsn,  # int: w_scale.stride(1) (per-channel, block, 4-bit)
    stride_wsk,  # int: w_scale.stride(2) (block, 4-bit)
    stride_be,  # int: bias.stride(0) (HAS_BIAS)
    X_SCALE: tl.constexpr,  # 0 none, 1 per-tensor, 2 per-row, 3 per-token-group
    W_SCALE: tl.constexpr,  # 0 none, 1 per-expert, 2 per-output-channel, 3 128x128 blocks, 4 mxfp4, 5 int4
    X_GROUP: tl.constexpr,  # per-token-group width G (X_SCALE == 3), else 1
    W_BLOCK: tl.constexpr,  # weight-scale block width (128) (W_SCALE == 3), else 1
    IEEE_F32: tl.constexpr,  # bool: float32 operands, multiplied in full float32 (no TF32)
    HAS_BIAS: tl.constexpr,  # bool: add bias[e] to the float32 accumulator before the rounding
    BLOCK_M: tl.constexpr,  # rows per tile (power of 2)
    BLOCK_N: tl.constexpr,  # columns per tile (power of 2)
    BLOCK_K: tl.constexpr,  # K step (power of 2; divides X_GROUP's and W_BLOCK's powers of 2)
    TMA: tl.constexpr,  # bool: the TMA variant (16-bit or FP8, no bias, no 4-bit: check_config)
    WARP_SPECIALIZE: tl.constexpr,  # bool: tl.range(..., warp_specialize=True) on the TMA variant's K loop
    e8m0_lut,  # None, or bf16 [256] 2^(s - 127) by e8m0 code (the packed MXFP4 decode's scales)
):
    """Steps 4-5 of the module docstring for one (work item ``p``, column tile ``pid_n``): the
    expert and row tile of ``p``, then ``y[owned rows, cols]`` over the whole K loop."""
    e, row_start, row_end, m0 = _work_item(p, e_ids, starts, ends, first_row, n_tiles, incl, BLOCK_M)  # step 4

    # Step 5: the tile's rows, of which this expert owns [row_start, row_end).
    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = (rows >= row_start) & (rows < row_end)
    rows64 = rows.to(tl.int64)  # int64: row * stride_xm passes 2**31 for large M_cap * K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    cols64 = cols.to(tl.int64)
    e64 = e.to(tl.int64)  # int64: e * N * K passes 2**31 (E=256, N=7168, K=2048)
    offs_k = tl.arange(0, BLOCK_K)

    x_rows = x_ptr + rows64[:, None] * stride_xm  # [BLOCK_M, 1]
    w_cols = w_ptr + e64 * stride_we + cols64[None, :] * stride_wn  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TMA:
        # The whole [BLOCK_M, BLOCK_K] row tile of x at [m0, k0] (rows of other experts, or of none,
        # are loaded and computed but never stored; rows past M_cap and the K tail are zero-filled by the
        # descriptor's bounds) and the weight tile at [e * N + pid_n * BLOCK_N, k0] of w's [E * N, K] view (columns
        # past N read the next expert's rows, or zeros past E * N: computed, never stored). int32 coordinates:
        # M_cap and E * N are < 2**31 (checked on the host).
        n0 = e * N + pid_n * BLOCK_N
        for k0 in tl.range(0, K, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
            if X_SCALE == _XS_GROUP or W_SCALE == _WS_BLOCK:  # FP8, scales along K: promoted every step, as below
                part = tl.dot(x_desc.load([m0, k0]), w_desc.load([n0, k0]).T, max_num_imprecise_acc=BLOCK_K)
                acc = _promote_step(acc, part, k0, rows64, row_mask, cols, col_mask, e64, pid_n, x_scale_ptr,
                                    w_scale_ptr, stride_xsm, stride_xsk, stride_wse, stride_wsn, stride_wsk,
                                    X_SCALE, W_SCALE, X_GROUP, W_BLOCK, BLOCK_N)
            elif X_SCALE != _XS_NONE:  # FP8, scales after the loop
                acc = tl.dot(x_desc.load([m0, k0]), w_desc.load([n0, k0]).T, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(x_desc.load([m0, k0]), w_desc.load([n0, k0]).T, acc)  # float32 accumulation
    else:
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < K
            if W_SCALE == _WS_MXFP4 or W_SCALE == _WS_INT4 or W_SCALE == _WS_MXFP4_MMA:
                # 4-bit: decoded to x's dtype (CONTRACT.md section 9; _w4_tiles); x's even columns meet the low
                # nibbles, its odd columns the high ones, in two float dots.
                w_even, w_odd = _w4_tiles(w_ptr + e64 * stride_we + cols64[:, None] * stride_wn,
                                          w_scale_ptr + e64 * stride_wse + cols64[:, None] * stride_wsn, stride_wsk, k0, K,
                                          col_mask, W_SCALE, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty, e8m0_lut)
                # x's even and odd columns of this step: one contiguous load, split in registers (two stride-2 loads
                # cost 8 2-byte loads a thread and register moves before every mma: 363 -> 314 SASS a step)
                a = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))
                if IEEE_F32:  # float32 x: full float32 products (no TF32)
                    acc = tl.dot(a_even, tl.trans(w_even), acc, input_precision="ieee")
                    acc = tl.dot(a_odd, tl.trans(w_odd), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a_even, tl.trans(w_even), acc)
                    acc = tl.dot(a_odd, tl.trans(w_odd), acc)
            else:
                a = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(w_cols + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                if X_SCALE == _XS_GROUP or W_SCALE == _WS_BLOCK:
                    # Each K step lies in one scale group: scale its partial sum before accumulating.
                    # max_num_imprecise_acc=BLOCK_K: the fp8 tensor-core sum is promoted to float32
                    # every step (DeepSeek-V3 report, sec. 3.3.2, "increasing accumulation precision").
                    part = tl.dot(a, b, max_num_imprecise_acc=BLOCK_K)
                    acc = _promote_step(acc, part, k0, rows64, row_mask, cols, col_mask, e64, pid_n, x_scale_ptr,
                                        w_scale_ptr, stride_xsm, stride_xsk, stride_wse, stride_wsn, stride_wsk,
                                        X_SCALE, W_SCALE, X_GROUP, W_BLOCK, BLOCK_N)
                elif IEEE_F32:
                    acc = tl.dot(a, b, acc, input_precision="ieee")  # TF32 would miss float32 accuracy
                elif X_SCALE != _XS_NONE:
                    acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)  # FP8: promoted every step, as above
                else:
                    acc = tl.dot(a, b, acc)  # bf16 / fp16 tensor cores, float32 accumulation

    # Scales constant over K, applied once.
    if X_SCALE == _XS_TENSOR:
        acc = acc * tl.load(x_scale_ptr)
    if X_SCALE == _XS_ROW:
        acc = acc * tl.load(x_scale_ptr + rows64 * stride_xsm, mask=row_mask, other=0.0)[:, None]  # BY ROW
    if W_SCALE == _WS_EXPERT:
        acc = acc * tl.load(w_scale_ptr + e64 * stride_wse)
    if W_SCALE == _WS_CHANNEL:
        acc = acc * tl.load(w_scale_ptr + e64 * stride_wse + cols64 * stride_wsn, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:  # CONTRACT.md section 4: widened to float32, added after the scales, before the one rounding
        acc = acc + tl.load(bias_ptr + e64 * stride_be + cols64, mask=col_mask, other=0.0).to(tl.float32)[None, :]

    out_ptrs = out_ptr + rows64[:, None] * stride_om + cols64[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _launch_order(t, n_items, n_cols, GROUP_M: tl.constexpr):
    """Tile index ``t`` in ``[0, n_items * n_cols)`` -> ``(work item p, column tile pid_n)``, a bijection.

    ``GROUP_M == 1``: ``p = t % n_items`` (work item fastest, as the 2-D grid's axis 0). ``GROUP_M >
    1``: triton-lang/triton ``python/tutorials/03-matrix-multiplication.py`` ("L2 Cache
    Optimizations", ``GROUP_SIZE_M``): the work items in groups of ``GROUP_M`` consecutive ones (the
    last group may be smaller), each group sweeping all column tiles before the next, work item
    fastest inside it. Any ``GROUP_M >= 1`` is valid (3 too: plain integer division).
    """
    if GROUP_M == 1:
        p = t % n_items
        pid_n = t // n_items
    else:
        per_group = GROUP_M * n_cols
        first = (t // per_group) * GROUP_M
        size = tl.minimum(n_items - first, GROUP_M)  # the last group may be smaller
        local = t % per_group
        p = first + local % size
        pid_n = local // size
    return p, pid_n


@triton.jit
def _grouped_gemm_kernel(
    x_ptr,  # [M_cap, K] float32 / bf16 / fp16, or float8_e4m3fn codes; unit column stride
    w_ptr,  # [E, N, K] same dtype as x (fp8 codes with fp8 x), or 4-bit codes uint8 [E, N, K // 2]; unit stride along K
    offsets_ptr,  # [E + 1] int32 expert_offsets, non-decreasing
    x_scale_ptr,  # FP8: float32 [] / [M_cap, 1] / [M_cap, K // G] dequant multipliers (unused otherwise)
    w_scale_ptr,  # FP8: float32 [E] / [E, N] / [E, cdiv(N, 128), cdiv(K, 128)]; 4-bit: [E, N, K // 32] (uint8 e8m0 / bf16)
    bias_ptr,  # HAS_BIAS: [E, N] float32 / bf16 / fp16, unit column stride (unused otherwise)
    out_ptr,  # [M_cap, N] out dtype (float32 / bf16 / fp16); unit column stride
    M_cap,  # int: rows of x and y
    N,  # int: output columns
    K,  # int: reduction size
    E,  # int: experts (E_local)
    stride_xm,  # int: x.stride(0)
    stride_we,  # int: w.stride(0)
    stride_wn,  # int: w.stride(1)
    stride_om,  # int: out.stride(0)
    stride_xsm,  # int: x_scale.stride(0) (2-D scales)
    stride_xsk,  # int: x_scale.stride(1) (per-token-group)
    stride_wse,  # int: w_scale.stride(0)
    stride_wsn,  # int: w_scale.stride(1) (per-channel, block, 4-bit)
    stride_wsk,  # int: w_scale.stride(2) (block, 4-bit)
    stride_be,  # int: bias.stride(0) (HAS_BIAS)
    X_SCALE: tl.constexpr,  # 0 none, 1 per-tensor, 2 per-row, 3 per-token-group
    W_SCALE: tl.constexpr,  # 0 none, 1 per-expert, 2 per-output-channel, 3 128x128 blocks, 4 mxfp4, 5 int4
    X_GROUP: tl.constexpr,  # per-token-group width G (X_SCALE == 3), else 1
    W_BLOCK: tl.constexpr,  # weight-scale block width (128) (W_SCALE == 3), else 1
    IEEE_F32: tl.constexpr,  # bool: float32 operands, multiplied in full float32 (no TF32)
    HAS_BIAS: tl.constexpr,  # bool: add bias[e] (per output column) before the rounding (CONTRACT.md section 4)
    BLOCK_E: tl.constexpr,  # next_power_of_2(E + 1): the offsets search vector
    BLOCK_M: tl.constexpr,  # rows per tile (power of 2)
    BLOCK_N: tl.constexpr,  # columns per tile (power of 2)
    BLOCK_K: tl.constexpr,  # K step (power of 2; divides X_GROUP's and W_BLOCK's powers of 2)
    GROUP_M: tl.constexpr,  # launch-order swizzle (GroupedGemmConfig.group_m); 1: grid axis 0 = work item
    PERSISTENT: tl.constexpr,  # bool: each program loops over tiles with a stride of the grid size
    TMA: tl.constexpr = False,  # bool: GroupedGemmConfig.tma (x_desc / w_desc given)
    WARP_SPECIALIZE: tl.constexpr = False,  # bool: GroupedGemmConfig.warp_specialize
    ALIGNED: tl.constexpr = False,  # bool: expert-aligned row tiles (aligned_tiles_enabled)
    x_desc=None,  # TMA: tensor descriptor over x [M_cap, K], block [BLOCK_M, BLOCK_K] (_tma_descriptors)
    w_desc=None,  # TMA: tensor descriptor over w viewed as [E * N, K], block [BLOCK_N, BLOCK_K]
    e8m0_lut=None,  # MXFP4 with bf16 x on a GPU: bf16 [256], the value 2^(s - 127) of each e8m0 code (e8m0_bf16_table)
):
    """Computes the tiles (work item ``p``, column tile ``pid_n``) of its launch order (module
    docstring, "Launch order"); each writes only the rows of its row tile that its expert owns.

    * ``GROUP_M == 1``, not ``PERSISTENT``: grid ``(cdiv(M_cap, BLOCK_M) + E - 1, cdiv(N, BLOCK_N))``,
      program ``(p, pid_n)``; programs with ``p >= total`` do nothing.
    * ``GROUP_M > 1``, not ``PERSISTENT``: 1-D grid of that many programs; program ``t <
      total * n_cols`` computes ``_launch_order(t)``, the others do nothing.
    * ``PERSISTENT``: 1-D grid of any size; program ``i`` computes ``_launch_order(t)`` for ``t = i,
      i + num_programs, ...`` below ``total * n_cols``.
    """
    pid = tl.program_id(0)
    if not PERSISTENT and GROUP_M == 1:  # (constexpr) read first, as the default grid always has
        pid_n = tl.program_id(1)
    # Steps 1-2: tiles per expert and their prefix sums, from the offsets (clamped to [0, M_cap]).
    e_ids, starts, ends, first_row, n_tiles, incl, total = _expert_row_tiles(offsets_ptr, M_cap, E, BLOCK_E, BLOCK_M,
                                                                             ALIGNED)

    n_cols = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        for t in tl.range(pid, total * n_cols, tl.num_programs(0)):
            p, pid_n = _launch_order(t, total, n_cols, GROUP_M)
            _grouped_gemm_tile(
                p, pid_n, e_ids, starts, ends, first_row, n_tiles, incl, x_ptr, w_ptr, x_scale_ptr, w_scale_ptr,
                bias_ptr, out_ptr, x_desc, w_desc, M_cap, N, K, stride_xm, stride_we, stride_wn, stride_om, stride_xsm,
                stride_xsk, stride_wse, stride_wsn, stride_wsk, stride_be, X_SCALE, W_SCALE, X_GROUP, W_BLOCK, IEEE_F32,
                HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, TMA, WARP_SPECIALIZE, e8m0_lut)
    elif GROUP_M == 1:
        if pid < total:  # step 3: programs past the last work item do nothing
            _grouped_gemm_tile(
                pid, pid_n, e_ids, starts, ends, first_row, n_tiles, incl, x_ptr, w_ptr, x_scale_ptr, w_scale_ptr,
                bias_ptr, out_ptr, x_desc, w_desc, M_cap, N, K, stride_xm, stride_we, stride_wn, stride_om, stride_xsm,
                stride_xsk, stride_wse, stride_wsn, stride_wsk, stride_be, X_SCALE, W_SCALE, X_GROUP, W_BLOCK, IEEE_F32,
                HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, TMA, WARP_SPECIALIZE, e8m0_lut)
    else:
        if pid < total * n_cols:  # step 3, on the 1-D grid
            p, pid_n = _launch_order(pid, total, n_cols, GROUP_M)
            _grouped_gemm_tile(
                p, pid_n, e_ids, starts, ends, first_row, n_tiles, incl, x_ptr, w_ptr, x_scale_ptr, w_scale_ptr,
                bias_ptr, out_ptr, x_desc, w_desc, M_cap, N, K, stride_xm, stride_we, stride_wn, stride_om, stride_xsm,
                stride_xsk, stride_wse, stride_wsn, stride_wsk, stride_be, X_SCALE, W_SCALE, X_GROUP, W_BLOCK, IEEE_F32,
                HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, TMA, WARP_SPECIALIZE, e8m0_lut)


#: TMA's alignment rule (CUDA driver API ``cuTensorMapEncodeTiled``; triton ``tools/tensor_descriptor.py``
#: asserts the same): the global base address and every stride but the innermost are multiples of 16 bytes.
TMA_ALIGN_BYTES = 16
#: TMA coordinates are int32: ``M_cap`` and the weight view's ``E * N`` rows must stay below this.
_MAX_TMA_ROWS = 2**31 - 1


def _tma_descriptors(op: str, x: torch.Tensor, w: torch.Tensor, cfg: GroupedGemmConfig):
    """Host-side tensor descriptors ``(x_desc, w_desc)`` of the TMA variant: ``x [M_cap, K]`` in
    ``[block_m, block_k]`` boxes, ``w [E, N, K]`` viewed as ``[E * N, K]`` in ``[block_n, block_k]`` boxes, both
    zero-padded outside their bounds. Host-side (``triton.tools.tensor_descriptor.TensorDescriptor``): the
    launcher encodes the ``CUtensorMap`` (no ``triton.set_allocator``, which device-side
    ``tl.make_tensor_descriptor`` would need for its global scratch), and the interpreter turns it into masked
    loads.

    Raises: NotImplementedError (what TMA cannot address: a base address or the row stride of ``x`` or ``w``
      not a multiple of 16 bytes, i.e. ``K * itemsize`` not one for contiguous inputs; ``w`` whose experts are
      not ``N`` rows apart (``w.stride(0) != N * w.stride(1)``: no ``[E * N, K]`` view); ``K == 0`` (a TMA
      dimension must be positive); ``M_cap`` or ``E * N`` of 2**31 or more (int32 coordinates))."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    M_cap, K = x.shape
    E, N, _ = w.shape
    size = x.element_size()
    need = f"{TMA_ALIGN_BYTES}-byte aligned base addresses and row strides (TMA)"
    for name, t, stride in (("x", x, x.stride(0)), ("w", w, w.stride(1))):
        if t.data_ptr() % TMA_ALIGN_BYTES or (stride * size) % TMA_ALIGN_BYTES:
            raise NotImplementedError(f"{op}: config tma=True needs {need}; got {name} at address offset "
                                      f"{t.data_ptr() % TMA_ALIGN_BYTES} with a row stride of {stride * size} bytes")
    if E > 1 and w.stride(0) != N * w.stride(1):
        raise NotImplementedError(f"{op}: config tma=True views w [E, N, K] as [E * N, K], so it needs "
                                  f"w.stride(0) == N * w.stride(1) (={N * w.stride(1)}); got w.stride()={w.stride()}")
    if K == 0:
        raise NotImplementedError(f"{op}: config tma=True needs K > 0 (a TMA dimension must be positive); got K=0")
    if max(M_cap, E * N) > _MAX_TMA_ROWS:
        raise NotImplementedError(f"{op}: config tma=True addresses rows by int32 TMA coordinates, so M_cap and "
                                  f"E * N must be below 2**31; got M_cap={M_cap}, E * N={E * N}")
    x_desc = TensorDescriptor(x, [M_cap, K], [x.stride(0), 1], [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor(w, [E * N, K], [w.stride(1), 1], [cfg.block_n, cfg.block_k])
    return x_desc, w_desc


def scale_layouts(x: torch.Tensor, x_scale, w_scale) -> tuple[str | None, str | None, int | None]:
    """Names of validated FP8 scale layouts: ``(x layout, w layout, G)``, ``G`` the per-token-group
    width (``None`` otherwise). A ``[M_cap, 1]`` scale is per-token (one group of K columns)."""
    if x_scale is None:
        return None, None, None
    if x_scale.ndim == 0:
        x_layout, group = "per_tensor", None
    elif x_scale.shape[1] == 1:
        x_layout, group = "per_token", None
    else:
        x_layout, group = "per_token_group", x.shape[1] // x_scale.shape[1]
    return x_layout, {1: "per_expert", 2: "per_channel", 3: "block"}[w_scale.ndim], group


#: The default config of a problem, looked up once (the tuned table search runs on every launch
#: otherwise: twice per layer, on the host path of a decode step).
_default_config = functools.cache(grouped_gemm_config)


def launch_grid(op: str, cfg: GroupedGemmConfig, M_cap: int, N: int, E: int, device: torch.device) -> tuple[int, ...]:
    """The kernel's grid for ``cfg``'s launch order (module docstring, "Launch order"): sized by
    ``M_cap``, ``N`` and ``E`` only (no host sync).

    Raises: NotImplementedError (default order: more column tiles than CUDA's grid axis 1 allows;
      other orders: more tiles than :data:`_MAX_TILES`).
    """
    n_items, n_cols = triton.cdiv(M_cap, cfg.block_m) + E - 1, triton.cdiv(N, cfg.block_n)  # work-item bound
    if cfg.group_m == 1 and not cfg.persistent:  # the default: 2-D grid, work item fastest
        if n_cols > MAX_GRID_AXIS_1:
            raise NotImplementedError(f"{op}: {n_cols} column tiles exceed CUDA's grid axis 1 limit {MAX_GRID_AXIS_1}")
        return (n_items, n_cols)
    if n_items * n_cols > _MAX_TILES:  # 1-D orders index the tiles in int32
        raise NotImplementedError(f"{op}: {n_items} x {n_cols} tiles exceed the 1-D tile index limit {_MAX_TILES}")
    if cfg.persistent:  # one program per SM at most (host-side query, cached by torch: no sync)
        return (min(_num_sms(device), n_items * n_cols),)
    return (n_items * n_cols,)



def tile_meta(cfg) -> dict:
    """A :class:`GroupedGemmConfig`'s launch arguments (tile constexprs, launch order, warps, stages): one
    place for the forward and the dgrad kernel (``triton_backward.py``), which tile alike."""
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                PERSISTENT=cfg.persistent, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

def grouped_gemm_triton(
    x: torch.Tensor,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    x_scale: torch.Tensor | None,
    w_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: GroupedGemmConfig | None = None,
    w_format: str | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [M_cap, K]``, ``w [E, N, K]``, ``expert_offsets [E + 1]`` int32 -> ``y [M_cap, N]`` ``out_dtype``;
    arguments as :func:`moe_torch.ops.grouped_gemm.api.grouped_gemm` (already validated there). 4-bit
    weights (``w_format`` ``"mxfp4"`` / ``"int4"``): ``w [E, N, K // 2]`` uint8 packed codes, ``w_scale
    [E, N, K // 32]``, decoded tile by tile in the kernel (:func:`_w4_tiles`) and rounded to ``x.dtype``.
    ``bias [E, N]`` (optional; float32 / bf16 / fp16): widened to float32 and added to each owned row's
    accumulator (after the FP8 scales) before the rounding (CONTRACT.md section 4).

    Without ``config``, an FP8 request with 1 x 128 activation groups and 128 x 128 weight blocks that
    :func:`gluon_fp8_block_eligible` accepts (sm_90, bf16 out, no bias, contiguous, ``M_cap >=`` :data:`GLUON_MIN_ROWS`
    and ``>= GLUON_MIN_ROWS_PER_EXPERT * E``)
    runs the warp-specialized Gluon kernel instead (``moe_torch/ops/grouped_gemm/gluon.py``; same contract, same
    rows, its own zeroing of the unowned rows); ``EPMOE_TRITON_GLUON_FP8_BLOCK=0`` keeps this module's kernel. Likewise
    FP8 per-token x per-channel requests that :func:`gluon_fp8_rowwise_eligible` accepts run ``gluon.py:
    grouped_gemm_gluon_fp8_rowwise`` (promotion every :data:`GLUON_ROWWISE_PROMOTE` K blocks);
    ``EPMOE_TRITON_GLUON_FP8_ROWWISE=0`` keeps this module's kernel. 16-bit requests (bf16 / fp16 ``x``, ``w`` and
    out, no scales, no bias; sm_90, enough rows: ``gluon_bf16.py: forward_eligible``) run ``gluon_bf16.py:
    grouped_gemm_gluon_bf16`` where :func:`gluon_bf16_options` says so: ``EPMOE_TRITON_GLUON_BF16`` unset and the
    device's tuned forward entry measured the Gluon kernel faster (``config.py: tuned_forward_kernel``: ``"kernel":
    "gluon"``, with its ``"gluon_config"``), or ``EPMOE_TRITON_GLUON_BF16=1`` (forced); ``=0`` keeps this module's
    kernel. The choice is per shape: the tuner (``benchmarks/tune_triton_gemm.py``) times both kernels.

    ``y`` is allocated here (``torch.empty``): the kernel writes the owned rows, then :func:`zero_unowned_rows`
    zeroes the rows no expert owns (outside ``[offsets[0], offsets[-1])``), no memset of the whole result. The
    inputs are only read. No host sync: the grid is sized by
    ``M_cap`` and ``E``, and ``expert_offsets`` is read by the kernel.

    Raises: NotImplementedError (no CUDA and no interpreter; FP8 before sm_89; per-token-group
      scales too narrow for ``tl.dot``; ``expert_offsets`` or ``bias`` on another device; more than 4095
      experts; too many column tiles),
      ValueError (a given ``config`` that breaks the rules of :class:`GroupedGemmConfig`; without ``config``, an
      ``EPMOE_TRITON_*`` switch of another value than unset / empty, 0/false/off/no, 1/true/on/yes);
      with ``config.tma`` also NotImplementedError for what the TMA variant does not serve (module
      docstring, "TMA variant": FP8, float32, 4-bit, bias; unaligned base or row strides of ``x`` / ``w``).
    """
    if config is None and gluon_fp8_block_eligible(x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format, bias):
        from moe_torch.ops.grouped_gemm.gluon import grouped_gemm_gluon_fp8_block

        return grouped_gemm_gluon_fp8_block(x, w, expert_offsets, x_scale, w_scale, out_dtype,
                                            **gluon_fp8_block_options(x.shape[0], w.shape[0]))
    if config is None and gluon_fp8_rowwise_eligible(x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format,
                                                     bias):
        from moe_torch.ops.grouped_gemm.gluon import grouped_gemm_gluon_fp8_rowwise

        return grouped_gemm_gluon_fp8_rowwise(x, w, expert_offsets, x_scale, w_scale, out_dtype,
                                              num_stages=GLUON_ROWWISE_STAGES, block_n=GLUON_ROWWISE_BLOCK_N,
                                              promote=GLUON_ROWWISE_PROMOTE)
    gluon_options = None if config is not None else gluon_bf16_options(x, w, expert_offsets, x_scale, w_scale,
                                                                        out_dtype, w_format, bias)
    if gluon_options is not None:  # (gluon_bf16_options ran forward_eligible: the tensors are checked)
        from moe_torch.ops.grouped_gemm.gluon_bf16 import forward_eligible_launch

        return forward_eligible_launch(x, w, expert_offsets, **gluon_options)
    out = torch.empty((x.shape[0], w.shape[1]), dtype=out_dtype, device=x.device)
    out = _launch("grouped_gemm", x, w, expert_offsets, x_scale, w_scale, out, config, w_format, bias)
    return zero_unowned_rows(out, expert_offsets)


def default_triton_config(x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format=None, bias=None
                          ) -> GroupedGemmConfig:
    """The config this module's kernel runs ``x @ w`` with when none is given (:func:`_launch`'s default: the
    device's tuned entry, else the heuristic). Host-side, cached per problem."""
    M_cap, K = x.shape
    E, N = w.shape[:2]
    _, w_layout, group = scale_layouts(x, x_scale, w_scale)
    device = device_spec(x.device) if x.is_cuda else None
    return _default_config(M_cap, N, K, E, x.element_size() * 8, group, w_layout == "block", device,
                           w_format=_tile_format(w_format), bias=bias is not None)


def _tile_format(w_format: str | None) -> str | None:
    """The format whose tiles a 4-bit launch takes: MMA-layout codes tile as their checkpoint format (only the
    decode differs)."""
    return "mxfp4" if w_format == "mxfp4_mma" else w_format


def as_tma(cfg: GroupedGemmConfig) -> GroupedGemmConfig:
    """``cfg`` on the TMA variant (``implementation="triton_tma"``): the same tiles and launch order, each block at most
    :data:`TMA_MAX_BLOCK`; a TMA entry as it is."""
    if cfg.tma:
        return cfg
    clip = {k: min(getattr(cfg, k), TMA_MAX_BLOCK) for k in ("block_m", "block_n", "block_k")}
    return dataclasses.replace(cfg, tma=True, **clip)


def tuned_bf16_options(x, w) -> dict:
    """The 16-bit Gluon kernel's tuned options for this problem (the forward entry's ``"gluon_config"``), ``{}``
    without one (``gluon_bf16.py: dispatch_options`` then takes its defaults)."""
    tuned = _tuned_forward(device_spec(x.device), x.shape[0], w.shape[1], x.shape[1]) if x.is_cuda else None
    return {} if tuned is None else dict(tuned[1])


#: Its shared-memory ring depth: 5 stages were best or level at every measured shape (BENCHMARKS.md).
GLUON_STAGES = 5
#: The FP8-block Gluon kernel takes split-N work items of 64 rows (``block_m=64``: 64 x 256 tiles, 4 stages) where
#: the experts average at most this many rows (``M_cap <= GLUON_SPLIT_N_MAX_ROWS_PER_EXPERT * E``), 128-row items
#: (128 x 128 tiles, :data:`GLUON_STAGES`) above. An expert of r rows takes ``ceil(r / 64)`` items of 64 rows instead
#: of ``2 * ceil(r / 128)`` halves of 128: fewer where ``r % 128`` is in (0, 64], e.g. 3 instead of 4 at 130-192
#: rows, DeepSeek-V3's ~128 rows an expert at T=4096 (``gluon.py: grouped_gemm_gluon_fp8_block``). 192 because the
#: 64-row items measured faster at 128-192 rows an expert and slower from 256, bit-identical outputs (BENCHMARKS.md).
GLUON_SPLIT_N_MAX_ROWS_PER_EXPERT = 192
#: The split-N items' ring depth (40 KiB a stage; 4 is the deepest with the TMA epilogue).
GLUON_SPLIT_N_STAGES = 4


def gluon_fp8_block_options(M_cap: int, E: int) -> dict:
    """The FP8-block Gluon kernel's ``block_m`` and ``num_stages`` for ``M_cap`` rows over ``E`` local experts (host
    ints, no sync): ``{"block_m": 64, "num_stages": GLUON_SPLIT_N_STAGES}`` where ``M_cap <=``
    :data:`GLUON_SPLIT_N_MAX_ROWS_PER_EXPERT` ``* E``, else ``{"block_m": 128, "num_stages": GLUON_STAGES}``."""
    if M_cap <= GLUON_SPLIT_N_MAX_ROWS_PER_EXPERT * E:
        return {"block_m": 64, "num_stages": GLUON_SPLIT_N_STAGES}
    return {"block_m": 128, "num_stages": GLUON_STAGES}

#: The rowwise FP8 Gluon kernel's tile width, ring depth and promotion group (128-wide K blocks chained in the
#: tensor cores before a float32 add; 0: none, the whole K in the tensor cores' limited-precision accumulation).
#: Promote 2: the fastest group whose error stays well inside the contract's 1e-2 (8 and none exceed it); 5 stages
#: with the TMA epilogue: level or faster than 4 at every measured shape (BENCHMARKS.md).
GLUON_ROWWISE_BLOCK_N = 128
GLUON_ROWWISE_STAGES = 5
GLUON_ROWWISE_PROMOTE = 2


@functools.cache
def _gluon_available() -> bool:
    try:
        import moe_torch.ops.grouped_gemm.gluon  # noqa: F401
    except ImportError:
        return False
    return True


def _gluon_eligible(x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format, bias, kernel: str) -> bool:
    """What both FP8 Gluon kernels need (host-side only, no sync), for a request of their scale layout (the caller's
    check): FP8 ``x`` and ``w`` on a CUDA device of compute capability (9, 0), ``M_cap >=`` :data:`GLUON_MIN_ROWS` and
    ``>=`` :data:`GLUON_MIN_ROWS_PER_EXPERT` ``* E`` (the measured rule: below it the Triton kernel is faster), then
    bf16 out, no bias, no 4-bit weights, then float32 scales, every tensor contiguous on ``x``'s device, int32 offsets,
    at most 4095 experts, ``K % 16 == 0`` (TMA row strides), triton's Gluon importable. A request the rule gives
    ``kernel`` but which fails one of the latter runs the Triton kernel with a logged reason (``dispatch.py:
    passed_over``)."""
    if not x.is_cuda or x.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE:
        return False
    M_cap, K = x.shape
    if M_cap < GLUON_MIN_ROWS or M_cap < GLUON_MIN_ROWS_PER_EXPERT * w.shape[0] or not device_spec(x.device).is_hopper:
        return False
    if w_format is not None or bias is not None or out_dtype != torch.bfloat16:
        return False  # another kind of request than the measured choice was about: not reported
    why = None
    if K % 16 != 0 or w.shape[0] > _MAX_EXPERTS:
        why = f"needs K % 16 == 0 and at most {_MAX_EXPERTS} experts; got K={K}, E={w.shape[0]}"
    elif any(not t.is_contiguous() or t.device != x.device for t in (x, w, expert_offsets, x_scale, w_scale)):
        why = "needs contiguous tensors on one device"
    elif x_scale.dtype != torch.float32 or w_scale.dtype != torch.float32 or expert_offsets.dtype != torch.int32:
        why = "needs float32 scales and int32 expert_offsets"
    elif not _gluon_available():
        why = "triton's Gluon is not importable"
    if why is not None:
        passed_over("grouped_gemm", kernel, why, "the Triton kernel")
        return False
    return True


def gluon_fp8_block_eligible(x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format=None, bias=None) -> bool:
    """Whether :func:`grouped_gemm_triton` (no explicit config) runs this request on the Gluon kernel
    (``moe_torch/ops/grouped_gemm/gluon.py``): :data:`triton_common.GLUON_FP8_BLOCK_ENV` on (the default); FP8 ``x``
    with 1 x 128 group scales ``[M_cap, K / 128]`` and ``w [E, N, K]`` with 128 x 128 block scales; and what
    :func:`_gluon_eligible` asks (bf16 out, no bias, sm_90, contiguous, ``M_cap >=`` :data:`GLUON_MIN_ROWS` and
    ``>= GLUON_MIN_ROWS_PER_EXPERT * E``).
    Anything else runs the Triton kernel. Host-side only (no sync)."""
    K = x.shape[1]  # the scale layout first: a request of another layout costs no more than this
    if (x_scale is None or w_scale is None or K % W_SCALE_BLOCK != 0 or x_scale.ndim != 2 or w_scale.ndim != 3
            or x_scale.shape[1] != K // W_SCALE_BLOCK):
        return False  # 1 x 128 groups and 128 x 128 blocks only
    return gluon_fp8_block_enabled() and _gluon_eligible(x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format,
                                                         bias, "gluon_fp8_block")


def gluon_fp8_rowwise_eligible(x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format=None, bias=None) -> bool:
    """Whether :func:`grouped_gemm_triton` (no explicit config) runs this request on the Gluon rowwise kernel
    (``gluon.py: grouped_gemm_gluon_fp8_rowwise``): :data:`triton_common.GLUON_FP8_ROWWISE_ENV` on (the default); FP8 ``x`` with per-token scales
    ``[M_cap, 1]`` and ``w [E, N, K]`` with per-channel scales ``[E, N]``; and what :func:`_gluon_eligible` asks.
    Host-side only (no sync)."""
    if (x_scale is None or w_scale is None or tuple(x_scale.shape) != (x.shape[0], 1)
            or tuple(w_scale.shape) != tuple(w.shape[:2])):
        return False  # per token x per channel only (checked first: cheap)
    return gluon_fp8_rowwise_enabled() and _gluon_eligible(x, w, expert_offsets, x_scale, w_scale, out_dtype,
                                                           w_format, bias, "gluon_fp8_rowwise")


def gluon_bf16_choice(switch: bool | None, tuned: tuple[str, dict] | None, wide: bool = False) -> dict | None:
    """The 16-bit forward's kernel from ``EPMOE_TRITON_GLUON_BF16`` (``switch``: :func:`triton_common.gluon_bf16_switch`,
    ``None`` when unset) and the device's tuned entry (``tuned``: ``config.py: tuned_forward_kernel``, ``(kernel,
    options)`` or ``None``), before the eligibility: ``None`` runs this module's Triton kernel; a dict runs the Gluon
    kernel with those options (the entry's ``"gluon_config"``; ``{}``: none tuned, ``gluon_bf16.py: dispatch_options``
    then passes ``DISPATCH_OPTIONS``). ``False`` -> ``None``; ``None`` -> the options where the entry's kernel is
    ``"gluon"``, else ``None`` (a Triton entry, or one tuned before the choice); with no entry, ``{}`` where ``wide``
    (a large problem on sm_90: ``config.py: hopper_wide_config`` applies; the Gluon kernel with its defaults is level
    with the tuned kernel on the benchmark's 16-bit shapes, the wide Triton tiles slower: BENCHMARKS.md),
    else ``None``; ``True`` -> the entry's options whatever its kernel, ``{}`` without one. Pure: no device, no
    environment."""
    if switch is False:
        return None
    if switch is None and tuned is None:
        return {} if wide else None
    if switch is None and tuned[0] != "gluon":
        return None
    return {} if tuned is None else dict(tuned[1])


#: The tuned Gluon-or-Triton choice of a problem, looked up once (as :data:`_default_config`); ``(kernel, options as
#: sorted items)`` or ``None``.
@functools.cache
def _tuned_forward(device: DeviceSpec, M_cap: int, N: int, K: int) -> tuple[str, tuple] | None:
    choice = tuned_forward_kernel(device, M_cap, N, K, 16)
    return None if choice is None else (choice[0], tuple(sorted(choice[1].items())))


def gluon_bf16_options(x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format=None, bias=None) -> dict | None:
    """The options with which :func:`grouped_gemm_triton` (no explicit config) runs this request on the 16-bit Gluon
    kernel (``gluon_bf16.py: grouped_gemm_gluon_bf16``), or ``None`` for this module's kernel: :func:`gluon_bf16_choice`
    of :data:`triton_common.GLUON_BF16_ENV` (``0``: never, asked first; unset: where the device's tuned forward entry
    says ``"gluon"``, or with no entry where the problem is a wide sm_90 one; ``1``: wherever it serves) and ``x``'s GPU's tuned entry (``config.py: tuned_forward_kernel``:
    nearest ``M_cap``, same ``N``, ``K``, the bf16 entries), then ``gluon_bf16.py: forward_eligible`` (bf16 / fp16
    ``x``, ``w`` and out of one dtype, no scales, no bias, no 4-bit weights, sm_90, contiguous, ``K % 8 == 0``,
    ``M_cap >=`` :data:`GLUON_MIN_ROWS` and ``>= GLUON_MIN_ROWS_PER_EXPERT * E``); the options are
    ``gluon_bf16.py: dispatch_options`` (the entry's ``"gluon_config"`` where valid for ``N``, else
    ``DISPATCH_OPTIONS``). CPU tensors, scales, triton without Gluon: ``None``, the Gluon module not imported.
    Host-side only (no sync; the lookup cached per problem). Raises ValueError for a malformed switch value."""
    switch = gluon_bf16_switch()
    if switch is False or not x.is_cuda or x_scale is not None or w_scale is not None:
        return None
    tuned, wide = None, False
    if x.dtype in (torch.bfloat16, torch.float16) and w_format is None and x.dim() == 2 and w.dim() == 3:
        spec = device_spec(x.device)
        tuned = _tuned_forward(spec, x.shape[0], w.shape[1], x.shape[1])
        wide = (tuned is None and spec is not None and spec.is_hopper
                and hopper_wide_config(x.shape[0], w.shape[1], x.shape[1], w.shape[0], 16) is not None)
    options = gluon_bf16_choice(switch, None if tuned is None else (tuned[0], dict(tuned[1])), wide)
    if options is None:
        return None
    try:
        from moe_torch.ops.grouped_gemm.gluon_bf16 import NOT_REPORTED, dispatch_options, forward_refusal
    except ImportError as exc:  # triton without gluon
        passed_over("grouped_gemm", "gluon_bf16", f"triton's Gluon is not importable: {exc}", "the Triton kernel")
        return None
    why = forward_refusal(x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format, bias)
    if why is not None:
        if why not in NOT_REPORTED:
            passed_over("grouped_gemm", "gluon_bf16", why, "the Triton kernel")
        return None
    return dispatch_options(options, w.shape[1])


def gluon_bf16_eligible(x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format=None, bias=None) -> bool:
    """Whether :func:`grouped_gemm_triton` (no explicit config) runs this request on the 16-bit Gluon kernel: whether
    :func:`gluon_bf16_options` gives options (the switch, the tuned entry, ``gluon_bf16.py: forward_eligible``).
    Host-side only (no sync)."""
    return gluon_bf16_options(x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format, bias) is not None


_E8M0_TABLES: dict[tuple[torch.device, bool], torch.Tensor] = {}


def e8m0_bf16_table(device: torch.device, mma: bool = False) -> torch.Tensor | None:
    """bf16 ``[256]``: the value ``2^(s - 127)`` of each e8m0 code ``s`` (``s = 0`` the subnormal ``2^-127``, ``s = 255``
    NaN; CONTRACT.md section 9), built once per device from ``moe_contract/w4_packed_asm.py: e8m0_bf16_bits``;
    ``mma``: the MMA layout's folded scales ``2^(s - 1)`` (``moe_contract/w4_layout.py: e8m0_bf16_bits_mma``).

    ``None`` while a CUDA graph is being captured on ``device`` and no table was built before: the copy to the
    device cannot be captured, so such a launch decodes the scales from their bits (the same values) and the graph
    keeps doing so on replay."""
    table = _E8M0_TABLES.get((device, mma))
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        bits = e8m0_bf16_bits_mma() if mma else e8m0_bf16_bits()
        table = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(device)
        _E8M0_TABLES[(device, mma)] = table
    return table


def w4_kernel_weights(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, w_format: str | None):
    """``(w, w_scale, w_format, e8m0_lut)`` as a 4-bit kernel launch takes them. The packed decode (bf16 ``x`` on a
    GPU) reads ``"mxfp4_mma"`` codes as they are; every other launch (the interpreter, float16 / float32 ``x``)
    decodes in float32 from the checkpoint layout, so those codes go back to it first (``mxfp4_mma_as_checkpoint``:
    the same values, a copy of the codes a call; no host sync); MMA-layout rows not 16-byte aligned are copied
    (a view of a row's tail: its words would be read across). ``e8m0_lut``: the packed decode's scale table."""
    packed = x.is_cuda and x.dtype == torch.bfloat16 and not triton.knobs.runtime.interpret
    if w_format == "mxfp4_mma" and not packed:
        if x.is_cuda:  # a copy of the codes every call on a GPU: worth saying (the interpreter is for tests)
            warn_once("MMA-layout MXFP4 codes with %s activations: the packed decode that reads the layout takes "
                      "bf16 only, so the codes are taken back to the checkpoint layout at each call (a copy); "
                      "w4_layout='checkpoint' is faster here", x.dtype)
        w, w_scale = mxfp4_mma_as_checkpoint(w, w_scale)
        w_format = "mxfp4"
    elif w_format == "mxfp4_mma" and (w.data_ptr() % 16 or w.stride(0) % 16 or w.stride(1) % 16):
        # the kernels see 16-byte aligned rows (specialized by the launch) only then, and so load whole words
        w = w.clone(memory_format=torch.contiguous_format)
    lut = None
    if packed and w_format in ("mxfp4", "mxfp4_mma"):
        lut = e8m0_bf16_table(x.device, mma=w_format == "mxfp4_mma")
    return w, w_scale, w_format, lut


def _launch(op, x, w, expert_offsets, x_scale, w_scale, out, config, w_format=None, bias=None):
    """Run the kernel into ``out [M_cap, N]`` (unit column stride); writes only owned rows and ``cols < N``.

    Separate from :func:`grouped_gemm_triton` so that tests can hand a poisoned, over-allocated
    view and see exactly which elements the kernel writes."""
    fp8 = x.dtype == FP8_DTYPE
    check_triton_device(op, x.device, _grouped_gemm_kernel, needs_fp8=fp8)
    M_cap, K = x.shape
    E, N, _ = w.shape
    if expert_offsets.device != x.device:  # the kernel reads the offsets itself (no host sync)
        raise NotImplementedError(f"{op}: the Triton kernel needs expert_offsets on x's device ({x.device}); "
                                  f"got {expert_offsets.device}")
    if bias is not None and bias.device != x.device:  # read by the kernel, as the offsets
        raise NotImplementedError(f"{op}: the Triton kernel needs bias on x's device ({x.device}); got {bias.device}")
    if E > _MAX_EXPERTS:
        raise NotImplementedError(f"{op}: the Triton kernel's expert search serves at most {_MAX_EXPERTS} experts; got E={E}")
    # Unit stride along K is what the kernel indexes; copies leave the caller's tensors alone.
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(2) == 1 else w.contiguous()
    if bias is not None and bias.stride(1) != 1:  # unit stride along N, as the kernel indexes it
        bias = bias.contiguous()
    expert_offsets = expert_offsets.contiguous()
    x_layout, w_layout, group = scale_layouts(x, x_scale, w_scale)
    # the packed MXFP4 decode reads its scales' bf16 values from a table (the interpreter decodes in float32)
    w, w_scale, w_format, lut = w4_kernel_weights(x, w, w_scale, w_format)
    if w_format is not None:  # 4-bit weights: their scales are the format's groups of 32 along K
        w_layout = w_format
    bits = x.element_size() * 8
    w_block = w_layout == "block"
    device = device_spec(x.device) if x.is_cuda else None  # host-side, cached: no sync
    tile_format = _tile_format(w_format)
    cfg = config or _default_config(M_cap, N, K, E, bits, group, w_block, device, w_format=tile_format,
                                    bias=bias is not None)
    check_config(op, cfg, bits, group, w_block, tile_format, bias=bias is not None)
    grid = launch_grid(op, cfg, M_cap, N, E, x.device)
    if M_cap == 0 or N == 0 or E == 0:
        return out  # nothing to compute: every row stays 0
    # the TMA variant (16-bit or FP8, no bias, no 4-bit: check_config) loads x and w through descriptors
    x_desc = w_desc = None
    if cfg.tma:
        try:
            x_desc, w_desc = _tma_descriptors(op, x, w, cfg)
        except NotImplementedError:
            if config is not None:
                raise  # asked for by the caller: say why it cannot be served
            # a tuned default this x / w cannot take (alignment, strides): the pointer kernel, same tiles and order
            cfg = dataclasses.replace(cfg, tma=False, warp_specialize=False)
    xs = x_scale if x_scale is not None else out  # never read without FP8
    ws = w_scale if w_scale is not None else out
    xs_strides = (*xs.stride(), 0, 0)[:2] if x_scale is not None else (0, 0)  # () for a per-tensor scale
    ws_strides = (*ws.stride(), 0, 0)[:3] if w_scale is not None else (0, 0, 0)
    _grouped_gemm_kernel[grid](
        x,
        w,
        expert_offsets,
        xs,
        ws,
        bias if bias is not None else out,  # never read without a bias
        out,
        M_cap,
        N,
        K,
        E,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        xs_strides[0],
        xs_strides[1],
        *ws_strides,
        bias.stride(0) if bias is not None else 0,
        X_SCALE=X_SCALE_CODES[x_layout],
        W_SCALE=W_SCALE_CODES[w_layout],
        X_GROUP=group or 1,
        W_BLOCK=W_SCALE_BLOCK if w_block else 1,
        IEEE_F32=x.dtype == torch.float32,
        HAS_BIAS=bias is not None,
        BLOCK_E=triton.next_power_of_2(E + 1),
        TMA=cfg.tma,
        WARP_SPECIALIZE=cfg.warp_specialize,
        ALIGNED=aligned_tiles_enabled(),
        x_desc=x_desc,
        w_desc=w_desc,
        e8m0_lut=lut,
        **tile_meta(cfg),
    )
    return out
