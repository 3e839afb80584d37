"""Gluon (``triton.experimental.gluon``, Triton 3.6) grouped GEMM for FP8 with DeepSeek-V3 block scales on Hopper.

Contract (the FP8-block forward of CONTRACT.md section 4; names as in ``moe_torch/ops/grouped_gemm/triton.py``)::

    y[m, :] = sum_kb (x_q[m, kb*128:(kb+1)*128] @ w_q[e(m), :, kb*128:(kb+1)*128].T)
                     * x_scale[m, kb] * w_scale[e(m), n // 128, kb]              (float32 accumulation)

* ``x_q [M_cap, K]`` float8_e4m3fn, row-major contiguous; ``x_scale [M_cap, K // 128]`` float32, contiguous (one
  scale per token and 128-wide K group, ``per_token_group_quant_fp8(x, 128)``);
* ``w_q [E, N, K]`` float8_e4m3fn, contiguous (K-major: output row ``n`` of expert ``e`` is K contiguous bytes);
  ``w_scale [E, ceil(N / 128), K // 128]`` float32, contiguous (``quantize_weight_fp8(w, "block")``);
* ``expert_offsets [E + 1]`` int32, non-decreasing (not checked: that needs a host sync); expert ``e`` owns rows
  ``[offsets[e], offsets[e+1])`` clamped to ``[0, M_cap]``; ``offsets[0]`` may be > 0. Offsets that do decrease
  are made non-decreasing by a running max, as the Triton kernels do (``_expert_rows_of``): experts never overlap
  and the rows between the first and the last owned row are all written;
* result ``y [M_cap, N]`` ``out_dtype`` (bfloat16 only). Rows no expert owns are zero: ``y`` is allocated with
  ``torch.empty`` and the kernel itself zeroes rows ``[0, offsets[0])`` and ``[offsets[E], M_cap)`` (after its tiles,
  in 64 x 128 blocks over all programs; no host sync): a ``torch.zeros`` output would cost a memset of the whole
  ``y`` (BENCHMARKS.md).

Refused on the host before any launch (messages name ``grouped_gemm_gluon_fp8_block``, the argument, the
expectation and what came): ``TypeError`` for a wrong dtype (``x_q`` / ``w_q`` not float8_e4m3fn, scales not
float32, offsets not int32, ``out_dtype`` not bfloat16); ``ValueError`` for shapes (ranks, ``K`` of ``x_q`` vs
``w_q``, ``K % 128 != 0``, scale shapes, ``expert_offsets`` length ``E + 1``), non-contiguous tensors, tensors on
different devices; ``NotImplementedError`` for tensors not on a CUDA device of compute capability exactly (9, 0)
(sm_90a: ``wgmma`` and ``setmaxnreg``), for ``M_cap`` or ``E * N`` of 2**31 or more (int32 TMA coordinates).
TMA's 16-byte rules hold by construction: row strides ``K`` bytes with ``K % 128 == 0``; torch's allocations are
256-byte aligned (a base that is not 16-byte aligned, e.g. a view at an odd offset, raises ``ValueError``).

Design (DeepGEMM-style promotion, deepseek-ai/DeepGEMM ``deep_gemm/include/deep_gemm/fp8_gemm.cuh``: each 128-wide
K block's FP8 product lands in a fresh accumulator and is scaled and added in float32 by the CUDA cores while the
tensor cores run the next block):

* CTA tile 128 x 128 (``BLOCK_M`` x ``BLOCK_N``), ``BLOCK_K`` = 128. Three warp-specialized partitions
  (``gl.warp_specialize``): two consumer warpgroups (the default partition and a 4-warp worker; the same function
  with ``WG`` = 0 / 1), each computing 64 rows x 128 columns with ``hopper.warpgroup_mma``, and a 4-warp producer
  that issues the TMA loads (``x`` as two [64, 128] boxes, one per consumer, and ``w`` as one [128, 128] box, 32 KiB
  a stage) into a ring of ``NUM_STAGES`` shared-memory stages, with ``ready`` (TMA transaction count) and ``empty``
  (count 2: one arrival per consumer warpgroup, after its ``wgmma`` reading the stage has completed) mbarriers.
  The two consumers are separate partitions (not one 8-warp partition) so that each arrives on ``empty`` by itself
  after its own ``warpgroup_mma_wait``: no barrier between the warpgroups, which run out of phase.
* Promotion: two K blocks a loop step. Both blocks' ``warpgroup_mma(a, b, zeros, use_acc=False, is_async=True)`` are
  issued, the first awaited with ``warpgroup_mma_wait(num_outstanding=1)`` (the second still running) and promoted,
  ``acc += part * (x_scale[rows, kb] * w_scale[e, nb, kb])``, then the second. A loop-carried in-flight accumulator
  makes ptxas serialize the ``wgmma`` (C7514; ``tests/gluon_promotion_probe.py``); two blocks a step do not.
  An odd last block is done alone. The step's scales are loaded (global, L2) before its ``ready`` wait, so their
  latency hides behind the wait and the MMAs.
* Work: "expert-aligned" row tiles: expert ``e``'s tiles start at ``s_e = offsets[e]`` and step by 128 (the
  ``x`` TMA box may start at any row; rows past ``M_cap`` are zero-filled; rows of the next expert are computed but
  never stored). Work items are numbered expert by expert (a prefix sum of ``cdiv(t_e - s_e, 128)`` computed in
  every partition from the ``E + 1`` offsets: ``gl.associative_scan`` over a power-of-two vector). Static
  persistent grid: ``min(#SMs, (cdiv(M_cap, 128) + E) * cdiv(N, 128))`` programs, each looping over tile indices
  ``pid, pid + nprog, ...`` below the real total (computed on the device: no host sync, CUDA-graph capturable).
  Tile index -> (work item, column tile) by the grouped order of triton's matmul tutorial (``GROUP_M`` consecutive
  work items, mostly one expert's, sweep the column tiles together: L2 reuse of ``x`` and ``w``).
* Split-N work items (``block_m=64``): tiles of 64 x 256, both consumers on the tile's 64 rows (one
  ``x`` box a stage, read by both) and 128 columns each (two ``w`` boxes a stage, 40 KiB); expert ``e``'s items step
  by 64 rows from ``s_e``. Fewer items where experts hold a few hundred rows or less (an expert of 130-192 rows: 3
  items of 64 rows instead of 4 halves of 128), at 25% more loads an output. The dispatch takes them up to 192 rows an
  expert on average (``triton.py: gluon_fp8_block_options``), where they measured faster (BENCHMARKS.md).
  The same ``wgmma`` shape per 64 x 128 share and the same K order: outputs bit-identical to the 128-row items.
* ``w`` is read through a descriptor of ``w_q`` viewed as ``[E * N, K]``: in an N tail the box reads the next
  expert's rows (zero past the end): computed, never stored.
* Epilogue (``epilogue``, :data:`EPILOGUES`; :func:`_store_tile`): each consumer converts its 64 x 128 float32
  accumulator to bf16 and stores the rows of its expert (``[max(m0, s_e), t_e)``, columns ``< N``). ``"pointer"``:
  masked pointer stores straight from the ``wgmma`` register layout (the consumer's next ``wgmma`` wait behind them).
  ``"tma"``: a share whose 64 rows are all its expert's (or end at ``M_cap``) is written to a 16 KiB
  shared-memory buffer of its consumer (``stmatrix``), fenced (``fence.proxy.async``) and stored by an asynchronous
  TMA store through a ``[M_cap, N]`` descriptor of ``y`` (the N tail and rows past ``M_cap`` clipped by its bounds);
  the consumer goes straight on to its next tile and waits for the store (``tma.store_wait(0)``) only before it
  writes the buffer again, a tile later. A share straddling its expert's last row (a box would overwrite the next
  expert's rows, written by another program) takes the pointer stores. The idea is CUTLASS's and DeepGEMM's TMA
  store epilogue (NVIDIA/cutlass@2ceb95b
  ``include/cutlass/epilogue/collective/sm90_epilogue_tma_warpspecialized.hpp``) and this repo's Gluon wgrad (``gluon_backward.py``), where it decided the kernel's speed; the ragged-row fallback is
  ours (DeepGEMM pads each expert's rows to the tile instead).

Sources read (layouts and API of triton 3.6.0 confirmed in the installed package): triton-lang/triton
``python/tutorials/gluon/08-warp-specialization.py`` (``gl.warp_specialize([(fn, args), ...], warps, regs)``,
mbarrier ring phases), ``04-tma.py`` / ``05-wgmma.py`` (``tma.async_copy_global_to_shared``, ``warpgroup_mma``),
and this repo's ``tests/gluon_promotion_probe.py``. Compile-only test for sm_90a: ``tests/test_gluon_gemm.py``.

Why it is the default for FP8 blocks: faster than the Triton kernel on gate_up and level or faster on down, and
faster on the FP8-block layers (BENCHMARKS.md). Down's short K loop (16
blocks a tile) exposes the per-tile epilogue (pointer stores from the ``wgmma`` layout while no MMA of this CTA
runs), which is why the TMA-store epilogue is the default (:data:`DEFAULT_EPILOGUE`). Register budgets: the producer partition has 4
warps (one elected thread issues the TMA) so that its expert table fits 40 registers a thread (E = 256: 8 bytes of
spill, ``ptxas -v``).

Rowwise variant (per-token x per-channel FP8; :func:`grouped_gemm_gluon_fp8_rowwise`; the default for these requests,
``EPMOE_TRITON_GLUON_FP8_ROWWISE=0`` keeps the Triton kernel)::

    y[m, n] = (sum_k x_q[m, k] * w_q[e(m), n, k]) * x_scale[m, 0] * w_scale[e(m), n]      (float32 accumulation)

``x_scale [M_cap, 1]``, ``w_scale [E, N]`` float32; ``K % 16 == 0`` (the last K box is zero-filled by TMA past ``K``);
same rows, running max and zeroing as above. The same producer and schedule; each consumer chains the ``wgmma`` of
``promote`` K blocks into a partial accumulator with one ``wgmma`` in flight (wait(1) after issuing block ``kb``, then
release block ``kb - 1``'s stage), then adds it to its float32 accumulator (``promote = 0``: one chain over the whole K,
no promotion, as ``torch._scaled_mm(..., use_fast_accum=True)``); the scales are applied once, in the epilogue. The
producer pads K to whole groups with boxes past ``K``, which TMA zero-fills (exact zeros). Why promote at all:
without it the E=32 FP8 per-token layer's error exceeds the bench's 1e-2 (measured errors per promotion group:
BENCHMARKS.md). The dispatch takes ``promote = 2`` with 128 x 128 tiles (``triton.py: GLUON_ROWWISE_*``). ``block_n`` 128 or 256 (256 only without promotion: a partial and an accumulator of
64 x 256 float32 each would need 256 registers a thread). Compile facts (triton 3.6.0, ``ptxas -v``, 4 stages, 168
registers, setmaxnreg 232 / 232 / 40 as above): bytes of spill at E = 32 / 256: 0 / 16 for block_n 128 and 256 and for
promote 2 (``tests/test_gluon_gemm.py``). The w scales of the epilogue are loaded compactly and spread with
``gl.convert_layout`` (scratch shared memory) after the last wait: loaded straight into the ``wgmma`` column layout,
ptxas hoisted them over the last ``wgmma`` and spilled 336 / 484 bytes at block_n 256.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moe_torch.ops.device import device_spec

OP = "grouped_gemm_gluon_fp8_block"
BLOCK_M = gl.constexpr(128)
BLOCK_N = gl.constexpr(128)
BLOCK_K = gl.constexpr(128)
HALF_M = gl.constexpr(64)  # rows of one consumer warpgroup
GROUP_M = gl.constexpr(8)
#: Registers a thread of each partition: the worker consumer, the producer (warpgroup-granular ``setmaxnreg``); the
#: default consumer gets what is left of ``MAXNREG`` x 12 warps (4 + 4 + 4).
CONSUMER_REGS = gl.constexpr(232)
PRODUCER_REGS = gl.constexpr(40)
MAXNREG = 168
_MAX_EXPERTS = 4095
# the same tile sizes as host-side ints
_BM, _BN, _BK, _HM = 128, 128, 128, 64


def _x_layout() -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _max(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _expert_table(off_ptr, E, M_cap, BLOCK_E: gl.constexpr, layout: gl.constexpr, TM: gl.constexpr = 128):
    """Inclusive prefix sum ``incl [BLOCK_E]`` of the per-expert tile counts ``cdiv(t_e - s_e, TM)`` (rows
    ``[s_e, t_e)`` as :func:`_expert_rows_of` assigns them; lanes ``e >= E`` count 0; ``TM``: the rows of a work
    item, 128, or 64 for the split-N tiles) and the total number of work items. Only ``incl`` stays live over the
    tile loop (registers: the producer has 40 a thread)."""
    idx = gl.arange(0, BLOCK_E, layout=layout)
    valid = idx < E
    lo = gl.minimum(gl.maximum(gl.load(off_ptr + idx, mask=valid, other=0), 0), M_cap)
    hi = gl.minimum(gl.maximum(gl.load(off_ptr + idx + 1, mask=valid, other=0), 0), M_cap)
    s = gl.associative_scan(lo, 0, _max)  # max(offsets[0..e])
    t = gl.maximum(gl.associative_scan(hi, 0, _max), s)  # max(offsets[0..e+1])
    n = gl.where(valid, (t - s + (TM - 1)) // TM, 0)
    incl = gl.associative_scan(n, 0, _add)
    total = gl.sum(n, axis=0)
    return incl, total


@gluon.jit
def _expert_rows_of(off_ptr, e, E, M_cap, BLOCK_E: gl.constexpr, layout: gl.constexpr):
    """Rows ``[s_e, t_e)`` of expert ``e``: the offsets clamped to ``[0, M_cap]`` and made non-decreasing by a
    running max, ``s_e = max(offsets[0..e])``, ``t_e = max(offsets[0..e+1])``, exactly as the Triton kernels assign
    rows (``triton.py: _expert_rows``), so experts never overlap and the rows between ``s_0`` and ``t_(E-1)`` are
    all owned, whatever the offsets. Masked maxima over a fresh load of the offsets (from L1 / L2), so no vector
    stays live over the tile loop."""
    idx = gl.arange(0, BLOCK_E, layout=layout)  # offsets[0..E-1] in lanes; offsets[E] as a scalar (BLOCK_E >= E)
    v = gl.minimum(gl.maximum(gl.load(off_ptr + idx, mask=idx < E, other=0), 0), M_cap)
    last = gl.minimum(gl.maximum(gl.load(off_ptr + E), 0), M_cap)
    s_e = gl.max(gl.where(idx <= e, v, 0), axis=0)
    t_e = gl.maximum(gl.max(gl.where(idx <= e + 1, v, 0), axis=0), gl.where(e + 1 >= E, last, 0))
    return s_e, t_e


@gluon.jit
def _tile_coords(tile, n_cols, total, incl, off_ptr, E, M_cap, BLOCK_E: gl.constexpr, layout: gl.constexpr,
                 TM: gl.constexpr = 128):
    """Tile index -> (expert, first row m0, expert rows [s_e, t_e), column tile); work items of ``TM`` rows."""
    num_in_group = GROUP_M * n_cols
    group = tile // num_in_group
    first = group * GROUP_M
    gsz = gl.minimum(total - first, GROUP_M)
    within = tile % num_in_group
    item = first + within % gsz
    pid_n = within // gsz
    before = incl <= item  # the experts wholly before this item's (incl is non-decreasing)
    e = gl.sum(gl.where(before, 1, 0), axis=0)
    p_e = gl.max(gl.where(before, incl, 0), axis=0)  # = incl[e - 1], 0 for e = 0: the expert's first item
    s_e, t_e = _expert_rows_of(off_ptr, e, E, M_cap, BLOCK_E, layout)
    m0 = s_e + (item - p_e) * TM
    return e, m0, s_e, t_e, pid_n


@gluon.jit
def _producer(x_desc, w_desc, off_ptr, a_bufs, b_bufs, ready, empty, E, M_cap, N, K,
              BLOCK_E: gl.constexpr, NUM_STAGES: gl.constexpr, BN: gl.constexpr = BLOCK_N,
              K_TAIL: gl.constexpr = False, G: gl.constexpr = 0, TM: gl.constexpr = 128):
    """The TMA partition of both kernels: ``x`` as two [64, 128] boxes (one per consumer) and ``w`` as one
    [BN, 128] box a stage (``TM = 64``, the FP8-block kernel's split-N tiles: ``x`` as one [64, 128] box, both
    consumers', and ``w`` as two [BN, 128] boxes, one per consumer: a 64 x 2BN tile), ``K // 128`` stages a tile, ``cdiv(K, 128)`` with ``K_TAIL`` (the rowwise kernel: a K
    tail is zero-filled by TMA in ``x`` and ``w``; the FP8-block kernel keeps ``K // 128``, its PTX unchanged),
    rounded up to a multiple of ``G`` with ``G > 0`` (the promoted rowwise kernel: its consumers take ``G`` blocks a
    group; the boxes past ``K`` are zero-filled, so the padding blocks add exact zeros)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # this partition has 4 warps (one issues the TMA)
    SPLIT_N: gl.constexpr = TM == HALF_M
    CN: gl.constexpr = 2 * BN if SPLIT_N else BN  # the columns of a tile
    incl, total = _expert_table(off_ptr, E, M_cap, BLOCK_E, layout, TM)
    n_cols = gl.cdiv(N, CN)
    if K_TAIL:
        KB = gl.cdiv(K, BLOCK_K)
    else:
        KB = K // BLOCK_K
    if G > 0:
        KB = gl.cdiv(KB, G) * G
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    it = 0
    for tile in range(pid, total * n_cols, nprog):
        e, m0, s_e, t_e, pid_n = _tile_coords(tile, n_cols, total, incl, off_ptr, E, M_cap, BLOCK_E, layout, TM)
        w_row = e * N + pid_n * CN
        for kb in range(KB):
            st = it % NUM_STAGES
            ph = (it // NUM_STAGES) & 1
            # mbarriers start in phase 0: waiting for parity 1 passes at once, so the ring starts empty.
            mbarrier.wait(empty.index(st), ph ^ 1)
            bar = ready.index(st)
            if SPLIT_N:
                # the second w box may start past N (an N tail): read (the next expert's rows, or zeros past E * N),
                # never used (its consumer only releases the stage)
                mbarrier.expect(bar, x_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [m0, kb * BLOCK_K], bar, a_bufs.index(st))
                tma.async_copy_global_to_shared(w_desc, [w_row, kb * BLOCK_K], bar, b_bufs.index(2 * st))
                tma.async_copy_global_to_shared(w_desc, [w_row + BN, kb * BLOCK_K], bar, b_bufs.index(2 * st + 1))
            else:
                mbarrier.expect(bar, 2 * x_desc.block_type.nbytes + w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [m0, kb * BLOCK_K], bar, a_bufs.index(2 * st))
                tma.async_copy_global_to_shared(x_desc, [m0 + HALF_M, kb * BLOCK_K], bar, a_bufs.index(2 * st + 1))
                tma.async_copy_global_to_shared(w_desc, [w_row, kb * BLOCK_K], bar, b_bufs.index(st))
            it += 1


@gluon.jit
def _store_tile(out, rows, cols, r0, n0, m0, s_e, t_e, y_ptr, y_desc, c_buf, M_cap, N, TMA_OUT: gl.constexpr):
    """Store a consumer's ``[64, BN]`` bf16 share ``out`` of a tile (rows ``rows = r0 + [0, 64)``, columns ``cols =
    n0 + [0, BN)``): the rows of this expert in ``[max(m0, s_e), t_e)``, columns ``< N``.

    ``TMA_OUT``: where the whole share is the expert's (its 64 rows below ``t_e``, or ``t_e = M_cap`` so that the
    descriptor's bounds clip the rest) it goes through shared memory and an asynchronous TMA store (the consumer goes
    on to its next tile's ``wgmma`` while the store drains; ``tma.store_wait(0)`` before the buffer is written again,
    so one store a consumer is in flight); the N tail is clipped by the descriptor (``[M_cap, N]``). A share that
    straddles the expert's last row (a TMA box would write the next expert's rows) takes the masked pointer store
    from registers, as ``TMA_OUT = False`` does for every share."""
    lo = gl.maximum(m0, s_e)
    if TMA_OUT:
        whole = (r0 >= lo) & ((r0 + HALF_M <= t_e) | (t_e >= M_cap))
        if whole:
            tma.store_wait(0)  # this consumer's previous store has read the buffer
            gl.thread_barrier()
            c_buf.store(out)
            hopper.fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(y_desc, [r0, n0], c_buf)
        else:
            mask = ((rows >= lo) & (rows < t_e))[:, None] & (cols < N)[None, :]
            gl.store(y_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :], out, mask=mask)
    else:
        mask = ((rows >= lo) & (rows < t_e))[:, None] & (cols < N)[None, :]
        gl.store(y_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :], out, mask=mask)


@gluon.jit
def _release_stages(ready, empty, it, n, NUM_STAGES: gl.constexpr):
    """A consumer with nothing to compute on a tile: the tile's ``n`` stages, each after its ``ready`` wait (an arrival
    before the stage is filled would count toward its previous use and free it under the other consumer's MMAs),
    released on ``empty``. Returns the stage counter ``it + n``."""
    for _ in range(n):
        mbarrier.wait(ready.index(it % NUM_STAGES), (it // NUM_STAGES) & 1)
        mbarrier.arrive(empty.index(it % NUM_STAGES))
        it += 1
    return it


@gluon.jit
def _consumer(y_ptr, y_desc, c_buf, xs_ptr, ws_ptr, off_ptr, a_bufs, b_bufs, ready, empty, E, M_cap, N, K,
              BLOCK_E: gl.constexpr, NUM_STAGES: gl.constexpr, WG: gl.constexpr, TMA_OUT: gl.constexpr,
              SKIP_EMPTY: gl.constexpr = True, TM: gl.constexpr = 128):
    """One consumer warpgroup (4 warps): rows ``[m0 + WG * 64, m0 + WG * 64 + 64)`` x the 128 columns of every
    128 x 128 tile, or with ``TM = 64`` (split-N tiles of 64 x 256) the tile's 64 rows x columns ``[n0 + WG * 128,
    n0 + WG * 128 + 128)``. ``SKIP_EMPTY``: a half with no row of the tile's expert (rows from ``t_e`` on: the short
    last tile of an expert, e.g. 2 rows of 130) runs no ``wgmma`` (:func:`_release_stages`); the other consumer's
    then have the tensor cores alone. A split-N half whose columns start at ``N`` or past it (an N tail) likewise
    (always: its ``w`` scales would be the next expert's, or past the end)."""
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    SPLIT_N: gl.constexpr = TM == HALF_M
    # stage st's buffers of this consumer: x box a_bufs[st * A_MUL + A_ADD], w box b_bufs[st * B_MUL + B_ADD]
    A_MUL: gl.constexpr = 1 if SPLIT_N else 2
    A_ADD: gl.constexpr = 0 if SPLIT_N else WG
    B_MUL: gl.constexpr = 2 if SPLIT_N else 1
    B_ADD: gl.constexpr = WG if SPLIT_N else 0
    incl, total = _expert_table(off_ptr, E, M_cap, BLOCK_E, vec, TM)
    NB = gl.cdiv(N, BLOCK_N)
    if SPLIT_N:
        n_cols = gl.cdiv(N, 2 * BLOCK_N)
    else:
        n_cols = NB
    KB = K // BLOCK_K
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    r = gl.arange(0, HALF_M, layout=row_l)
    c = gl.arange(0, BLOCK_N, layout=col_l)
    zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=mma)
    it = 0
    for tile in range(pid, total * n_cols, nprog):
        e, m0, s_e, t_e, pid_n = _tile_coords(tile, n_cols, total, incl, off_ptr, E, M_cap, BLOCK_E, vec, TM)
        if SPLIT_N:
            r0 = m0
            nb = 2 * pid_n + WG  # this consumer's 128-column block
        else:
            r0 = m0 + WG * HALF_M
            nb = pid_n
        n0 = nb * BLOCK_N
        rows = r0 + r
        idle = n0 >= N
        if SKIP_EMPTY:
            idle = idle | (r0 >= t_e)
        if idle:
            # no row of this half is the expert's (the short last tile of an expert), or no column (a split-N
            # tail): no MMA, no store; the stages are released in step (after their ready wait) so that the other
            # consumer's MMAs run alone
            it = _release_stages(ready, empty, it, KB, NUM_STAGES)
        else:
            xs_rows = xs_ptr + rows.to(gl.int64) * KB
            xs_mask = rows < M_cap
            ws_base = ws_ptr + (e * NB + nb).to(gl.int64) * KB
            acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=mma)
            for kk in range(KB // 2):
                kb = 2 * kk
                # the step's scales first: their latency hides behind the ready waits and the MMAs
                sc0 = gl.load(xs_rows + kb, mask=xs_mask, other=0.0) * gl.load(ws_base + kb)
                sc1 = gl.load(xs_rows + kb + 1, mask=xs_mask, other=0.0) * gl.load(ws_base + kb + 1)
                st0 = it % NUM_STAGES
                mbarrier.wait(ready.index(st0), (it // NUM_STAGES) & 1)
                t0 = hopper.warpgroup_mma(a_bufs.index(st0 * A_MUL + A_ADD),
                                          b_bufs.index(st0 * B_MUL + B_ADD).permute((1, 0)), zero,
                                          use_acc=False, is_async=True)
                st1 = (it + 1) % NUM_STAGES
                mbarrier.wait(ready.index(st1), ((it + 1) // NUM_STAGES) & 1)
                t1 = hopper.warpgroup_mma(a_bufs.index(st1 * A_MUL + A_ADD),
                                          b_bufs.index(st1 * B_MUL + B_ADD).permute((1, 0)), zero,
                                          use_acc=False, is_async=True)
                p0 = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[t0])  # block kb done, kb + 1 still running
                mbarrier.arrive(empty.index(st0))
                acc = acc + p0 * sc0[:, None]
                p1 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[t1])
                mbarrier.arrive(empty.index(st1))
                acc = acc + p1 * sc1[:, None]
                it += 2
            if KB % 2 == 1:
                kb = KB - 1
                sc = gl.load(xs_rows + kb, mask=xs_mask, other=0.0) * gl.load(ws_base + kb)
                st = it % NUM_STAGES
                mbarrier.wait(ready.index(st), (it // NUM_STAGES) & 1)
                tl0 = hopper.warpgroup_mma(a_bufs.index(st * A_MUL + A_ADD),
                                           b_bufs.index(st * B_MUL + B_ADD).permute((1, 0)), zero,
                                           use_acc=False, is_async=True)
                pl = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[tl0])
                mbarrier.arrive(empty.index(st))
                acc = acc + pl * sc[:, None]
                it += 1
            # epilogue: the rows of this expert in this warpgroup's half, columns < N
            _store_tile(acc.to(gl.bfloat16), rows, n0 + c, r0, n0, m0, s_e, t_e, y_ptr, y_desc, c_buf, M_cap, N,
                        TMA_OUT)
    _zero_unowned(y_ptr, off_ptr, E, M_cap, N, BLOCK_E, BLOCK_N, WG, vec, mma)
    if TMA_OUT:
        tma.store_wait(0)


@gluon.jit
def _zero_unowned(y_ptr, off_ptr, E, M_cap, N, BLOCK_E: gl.constexpr, BN: gl.constexpr, WG: gl.constexpr,
                  vec: gl.constexpr, mma: gl.constexpr):
    """After a consumer's tiles: rows no expert owns, ``[0, lo)`` and ``[hi, M_cap)``, are zeroed (``y`` is allocated
    empty) in 64 x ``BN`` blocks shared out over both warpgroups of every program; nothing to do when the experts
    own every row."""
    r = gl.arange(0, HALF_M, layout=gl.SliceLayout(1, mma))
    c = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_cols = gl.cdiv(N, BN)
    lo_all, _ = _expert_rows_of(off_ptr, 0, E, M_cap, BLOCK_E, vec)
    _, hi_all = _expert_rows_of(off_ptr, E - 1, E, M_cap, BLOCK_E, vec)
    n_head = gl.cdiv(lo_all, HALF_M)
    n_tail = gl.cdiv(M_cap - hi_all, HALF_M)
    zero_bf16 = gl.zeros([HALF_M, BN], gl.bfloat16, layout=mma)
    for u in range(2 * pid + WG, (n_head + n_tail) * n_cols, 2 * nprog):
        blk = u // n_cols
        cols = (u % n_cols) * BN + c
        in_head = blk < n_head
        first = gl.where(in_head, blk * HALF_M, hi_all + (blk - n_head) * HALF_M)
        end = gl.where(in_head, lo_all, M_cap)
        zrows = first + r
        mask = (zrows < end)[:, None] & (cols < N)[None, :]
        gl.store(y_ptr + zrows.to(gl.int64)[:, None] * N + cols[None, :], zero_bf16, mask=mask)


@gluon.jit
def _stage_ring(x_desc, w_desc, NUM_STAGES: gl.constexpr, BN: gl.constexpr, SPLIT_N: gl.constexpr = False):
    """The shared-memory ring of both kernels: ``x`` as two [64, 128] FP8 boxes and ``w`` as one [BN, 128] box a
    stage (``SPLIT_N``: one ``x`` box and two ``w`` boxes), with a ``ready`` (producer's expect + TMA bytes) and an
    ``empty`` (one arrival per consumer warpgroup) mbarrier each."""
    XB: gl.constexpr = 1 if SPLIT_N else 2  # x boxes a stage
    WB: gl.constexpr = 2 if SPLIT_N else 1  # w boxes a stage
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [XB * NUM_STAGES, HALF_M, BLOCK_K], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [WB * NUM_STAGES, BN, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)  # the producer's expect + the TMA transaction bytes
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    return a_bufs, b_bufs, ready, empty


@gluon.jit
def _out_bufs(y_desc, BN: gl.constexpr, TMA_OUT: gl.constexpr):
    """The TMA epilogue's two ``[64, BN]`` bf16 buffers (one a consumer; 32 KiB at BN = 128), a dummy without it."""
    if TMA_OUT:
        c_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, HALF_M, BN], y_desc.layout)
    else:
        c_bufs = gl.allocate_shared_memory(gl.int8, [2, 8, 16], gl.NVMMASharedLayout(0, 8, 2))  # unused
    return c_bufs


@gluon.jit
def _grouped_gemm_fp8_block_kernel(x_desc, w_desc, y_ptr, y_desc, xs_ptr, ws_ptr, off_ptr, E, M_cap, N, K,
                                   BLOCK_E: gl.constexpr, NUM_STAGES: gl.constexpr, TMA_OUT: gl.constexpr = False,
                                   SKIP_EMPTY: gl.constexpr = True, TM: gl.constexpr = 128):
    a_bufs, b_bufs, ready, empty = _stage_ring(x_desc, w_desc, NUM_STAGES, BLOCK_N, TM == HALF_M)
    c_bufs = _out_bufs(y_desc, BLOCK_N, TMA_OUT)
    gl.warp_specialize([
        (_consumer, (y_ptr, y_desc, c_bufs.index(0), xs_ptr, ws_ptr, off_ptr, a_bufs, b_bufs, ready, empty, E, M_cap,
                     N, K, BLOCK_E, NUM_STAGES, 0, TMA_OUT, SKIP_EMPTY, TM)),
        (_consumer, (y_ptr, y_desc, c_bufs.index(1), xs_ptr, ws_ptr, off_ptr, a_bufs, b_bufs, ready, empty, E, M_cap,
                     N, K, BLOCK_E, NUM_STAGES, 1, TMA_OUT, SKIP_EMPTY, TM)),
        (_producer, (x_desc, w_desc, off_ptr, a_bufs, b_bufs, ready, empty, E, M_cap, N, K, BLOCK_E, NUM_STAGES,
                     BLOCK_N, False, 0, TM)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------ per-token x per-channel FP8 ("rowwise")

@gluon.jit
def _consumer_rowwise(y_ptr, y_desc, c_buf, xs_ptr, ws_ptr, off_ptr, a_bufs, b_bufs, ready, empty, E, M_cap, N, K,
                      BLOCK_E: gl.constexpr, NUM_STAGES: gl.constexpr, BN: gl.constexpr, WG: gl.constexpr,
                      G: gl.constexpr = 0, TMA_OUT: gl.constexpr = False):
    """One consumer warpgroup of the rowwise kernel: rows ``[m0 + WG * 64, m0 + WG * 64 + 64)`` x ``BN`` columns of
    every tile; the scales are applied once, in the epilogue.

    ``G = 0``: the K blocks' ``wgmma`` chain into one float32 accumulator with one ``wgmma`` in flight: the whole K
    sum stays in the tensor cores' limited-precision FP8 accumulation. ``G > 0``: the blocks chain ``G`` at a time
    into a partial accumulator, which the CUDA cores then add to the float32 accumulator ("promotion", as DeepGEMM
    and the Triton kernel's ``max_num_imprecise_acc``); the other warpgroup's ``wgmma`` run meanwhile."""
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    incl, total = _expert_table(off_ptr, E, M_cap, BLOCK_E, vec)
    n_cols = gl.cdiv(N, BN)
    KB = gl.cdiv(K, BLOCK_K)  # >= 1 (K >= 16 on the host); a K tail is zero in x and w (TMA fill)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    r = gl.arange(0, HALF_M, layout=row_l)
    c = gl.arange(0, BN, layout=col_l)
    zero = gl.zeros([HALF_M, BN], gl.float32, layout=mma)  # ignored where use_acc=False
    it = 0  # stages consumed so far (the producer's ``it``, in the same order)
    for tile in range(pid, total * n_cols, nprog):
        e, m0, s_e, t_e, pid_n = _tile_coords(tile, n_cols, total, incl, off_ptr, E, M_cap, BLOCK_E, vec)
        if G == 0:
            # K block 0: a fresh accumulator (use_acc=False). The wait converts the async token into the
            # loop-carried tensor and waits for nothing (it allows this one wgmma to stay in flight).
            st = it % NUM_STAGES
            mbarrier.wait(ready.index(st), (it // NUM_STAGES) & 1)
            tok = hopper.warpgroup_mma(a_bufs.index(2 * st + WG), b_bufs.index(st).permute((1, 0)), zero,
                                       use_acc=False, is_async=True)
            acc = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[tok])
            for kb in range(1, KB):
                nxt = it + 1
                sn = nxt % NUM_STAGES
                mbarrier.wait(ready.index(sn), (nxt // NUM_STAGES) & 1)
                acc = hopper.warpgroup_mma(a_bufs.index(2 * sn + WG), b_bufs.index(sn).permute((1, 0)), acc,
                                           use_acc=True, is_async=True)
                # every wgmma but the one just issued has completed: block kb - 1's stage (``it``) is read
                acc = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[acc])
                mbarrier.arrive(empty.index(it % NUM_STAGES))
                it = nxt
            acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            mbarrier.arrive(empty.index(it % NUM_STAGES))  # the last block's stage
            it += 1
        else:
            acc = zero
            for grp in range(gl.cdiv(KB, G)):  # the producer pads K to whole groups with zero-filled boxes
                st = it % NUM_STAGES
                mbarrier.wait(ready.index(st), (it // NUM_STAGES) & 1)
                tok = hopper.warpgroup_mma(a_bufs.index(2 * st + WG), b_bufs.index(st).permute((1, 0)), zero,
                                           use_acc=False, is_async=True)
                part = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[tok])
                it += 1
                for j in gl.static_range(1, G):
                    st = it % NUM_STAGES
                    mbarrier.wait(ready.index(st), (it // NUM_STAGES) & 1)
                    part = hopper.warpgroup_mma(a_bufs.index(2 * st + WG), b_bufs.index(st).permute((1, 0)), part,
                                                use_acc=True, is_async=True)
                    part = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[part])
                    mbarrier.arrive(empty.index((it - 1) % NUM_STAGES))  # the previous block's wgmma is done
                    it += 1
                part = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[part])
                mbarrier.arrive(empty.index((it - 1) % NUM_STAGES))
                acc = acc + part
        rows = m0 + WG * HALF_M + r
        cols = pid_n * BN + c
        # the w scales are loaded compactly (BN / 128 a thread) and spread to the wgmma column layout (loaded
        # straight into it, 64 a thread at BN = 256, ptxas spilled them over the last wgmma)
        wcols = pid_n * BN + gl.arange(0, BN, layout=vec)
        ws_c = gl.load(ws_ptr + e.to(gl.int64) * N + wcols, mask=wcols < N, other=0.0)
        xs = gl.load(xs_ptr + rows, mask=rows < M_cap, other=0.0)
        ws = gl.convert_layout(ws_c, col_l)  # through scratch shared memory of this partition
        out = acc * xs[:, None] * ws[None, :]
        _store_tile(out.to(gl.bfloat16), rows, cols, m0 + WG * HALF_M, pid_n * BN, m0, s_e, t_e, y_ptr, y_desc, c_buf,
                    M_cap, N, TMA_OUT)
    # zeroing in 64 x 128 blocks whatever BN, as the block kernel (half the registers of 64 x 256 blocks)
    zl: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    _zero_unowned(y_ptr, off_ptr, E, M_cap, N, BLOCK_E, BLOCK_N, WG, vec, zl)
    if TMA_OUT:
        tma.store_wait(0)


@gluon.jit
def _grouped_gemm_fp8_rowwise_kernel(x_desc, w_desc, y_ptr, y_desc, xs_ptr, ws_ptr, off_ptr, E, M_cap, N, K,
                                     BLOCK_E: gl.constexpr, NUM_STAGES: gl.constexpr, BN: gl.constexpr,
                                     G: gl.constexpr = 0, TMA_OUT: gl.constexpr = False):
    a_bufs, b_bufs, ready, empty = _stage_ring(x_desc, w_desc, NUM_STAGES, BN)
    c_bufs = _out_bufs(y_desc, BN, TMA_OUT)
    gl.warp_specialize([
        (_consumer_rowwise, (y_ptr, y_desc, c_bufs.index(0), xs_ptr, ws_ptr, off_ptr, a_bufs, b_bufs, ready, empty,
                             E, M_cap, N, K, BLOCK_E, NUM_STAGES, BN, 0, G, TMA_OUT)),
        (_consumer_rowwise, (y_ptr, y_desc, c_bufs.index(1), xs_ptr, ws_ptr, off_ptr, a_bufs, b_bufs, ready, empty,
                             E, M_cap, N, K, BLOCK_E, NUM_STAGES, BN, 1, G, TMA_OUT)),
        (_producer, (x_desc, w_desc, off_ptr, a_bufs, b_bufs, ready, empty, E, M_cap, N, K, BLOCK_E, NUM_STAGES,
                     BN, True, G)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def block_e(E: int) -> int:
    """Vector width of the per-expert table: a power of two >= E, at least 32 (one warp): 256 lanes at E = 256."""
    return max(32, triton.next_power_of_2(E))


def _fail(exc, arg: str, expected: str, got, op: str = OP) -> None:
    raise exc(f"{op}: {arg} must be {expected}, got {got}")


def _check_placement(op: str, tensors: dict, M_cap: int, E: int, N: int, *, tma: tuple[str, str] = ("x_q", "w_q"),
                     en_rows: str = "w_q") -> None:
    """The refusals every Gluon launcher shares, after the dtypes and shapes: contiguity, one device, a CUDA device
    of compute capability (9, 0), int32 TMA coordinates (``M_cap`` rows of ``tma[0]``, ``E * N`` rows of
    ``en_rows``), 16-byte aligned ``tma`` tensors. ``tensors``: name -> tensor, every input (the device message
    lists them in this order)."""
    for name, tns in tensors.items():
        if not tns.is_contiguous():
            _fail(ValueError, name, "contiguous", f"strides {tuple(tns.stride())}", op)
    devices = {tns.device for tns in tensors.values()}
    if len(devices) != 1:
        _fail(ValueError, ", ".join(tensors), "on one device", sorted(map(str, devices)), op)
    first = tma[0]
    dev = tensors[first].device
    if dev.type != "cuda":
        raise NotImplementedError(f"{op}: {first} (and every input) must be on a CUDA device of compute capability "
                                  f"(9, 0) (sm_90a: wgmma, TMA, setmaxnreg), got device {dev}")
    cap = device_spec(dev).capability  # cached per device: a launch's host time matters at small shapes
    if tuple(cap) != (9, 0):
        raise NotImplementedError(f"{op}: {first} must be on a CUDA device of compute capability (9, 0) (sm_90a), "
                                  f"got {tuple(cap)} ({torch.cuda.get_device_name(dev)})")
    if M_cap >= 2**31 or E * N >= 2**31:
        raise NotImplementedError(f"{op}: {first} rows (M_cap = {M_cap}) and {en_rows} rows (E * N = {E * N}) must "
                                  "be below 2**31 (int32 TMA coordinates)")
    for name in tma:
        if tensors[name].data_ptr() % 16 != 0:
            _fail(ValueError, name, "16-byte aligned (TMA)", f"address {tensors[name].data_ptr():#x}", op)


def _check_common(op: str, x_q, w_q, expert_offsets, x_scale, w_scale, out_dtype, *, w_scale_rank: int,
                  k_multiple: int, k_why: str) -> tuple[dict, int, int, int, int]:
    """The refusals both launchers share, up to their scale shapes: types, dtypes, ``out_dtype``, ranks, ``K`` of
    ``x_q`` vs ``w_q`` and a positive multiple of ``k_multiple``, ``E``, ``N``, ``expert_offsets [E + 1]``.
    Returns ``(tensors by name, M_cap, K, E, N)``."""
    fp8 = torch.float8_e4m3fn
    tensors = {"x_q": x_q, "w_q": w_q, "expert_offsets": expert_offsets, "x_scale": x_scale, "w_scale": w_scale}
    for name, tns in tensors.items():
        if not isinstance(tns, torch.Tensor):
            _fail(TypeError, name, "a torch.Tensor", type(tns).__name__, op)
    for name, tns, dt in (("x_q", x_q, fp8), ("w_q", w_q, fp8), ("x_scale", x_scale, torch.float32),
                          ("w_scale", w_scale, torch.float32), ("expert_offsets", expert_offsets, torch.int32)):
        if tns.dtype != dt:
            _fail(TypeError, name, f"of dtype {dt}", tns.dtype, op)
    if out_dtype != torch.bfloat16:
        _fail(TypeError, "out_dtype", "torch.bfloat16", out_dtype, op)
    for name, tns, rank in (("x_q", x_q, 2), ("w_q", w_q, 3), ("expert_offsets", expert_offsets, 1),
                            ("x_scale", x_scale, 2), ("w_scale", w_scale, w_scale_rank)):
        if tns.dim() != rank:
            _fail(ValueError, name, f"{rank}-D", f"shape {tuple(tns.shape)}", op)
    M_cap, K = x_q.shape
    E, N, Kw = w_q.shape
    if Kw != K:
        _fail(ValueError, "w_q", f"[E, N, K] with K = x_q.shape[1] = {K}", f"shape {tuple(w_q.shape)}", op)
    if K % k_multiple != 0 or K == 0:
        _fail(ValueError, "x_q", f"of K = shape[1] a positive multiple of {k_multiple} ({k_why})", f"K = {K}", op)
    if E < 1 or N < 1:
        _fail(ValueError, "w_q", "of E >= 1 and N >= 1", f"shape {tuple(w_q.shape)}", op)
    if E > _MAX_EXPERTS:
        _fail(ValueError, "w_q", f"of at most {_MAX_EXPERTS} experts", f"E = {E}", op)
    if tuple(expert_offsets.shape) != (E + 1,):
        _fail(ValueError, "expert_offsets", f"of shape [E + 1] = [{E + 1}]", f"shape {tuple(expert_offsets.shape)}",
              op)
    return tensors, M_cap, K, E, N


def check_inputs(x_q, w_q, expert_offsets, x_scale, w_scale, out_dtype) -> None:
    """Every host-side refusal, before any launch (see the module docstring)."""
    tensors, M_cap, K, E, N = _check_common(OP, x_q, w_q, expert_offsets, x_scale, w_scale, out_dtype,
                                            w_scale_rank=3, k_multiple=_BK, k_why="the FP8 block size")
    if tuple(x_scale.shape) != (M_cap, K // _BK):
        _fail(ValueError, "x_scale", f"of shape [M_cap, K // 128] = [{M_cap}, {K // _BK}]",
              f"shape {tuple(x_scale.shape)}")
    nb = triton.cdiv(N, 128)
    if tuple(w_scale.shape) != (E, nb, K // _BK):
        _fail(ValueError, "w_scale", f"of shape [E, ceil(N / 128), K // 128] = [{E}, {nb}, {K // _BK}]",
              f"shape {tuple(w_scale.shape)}")
    _check_placement(OP, tensors, M_cap, E, N)


def _y_layout() -> gl.NVMMASharedLayout:
    """128-byte swizzle for the TMA epilogue's [64, BN] bf16 boxes (rows of 256 / 512 bytes)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


#: The epilogues of both kernels: ``"tma"`` (shared memory + an asynchronous TMA store for every 64-row share wholly
#: inside its expert, :func:`_store_tile`) and ``"pointer"`` (masked stores from the ``wgmma`` registers).
EPILOGUES = ("tma", "pointer")
#: The launchers' default epilogue where ``N % 8 == 0`` (TMA: 16-byte row strides of ``y``); ``"pointer"`` otherwise.
#: TMA because it made the FP8 down GEMMs and the FP8 torch layers faster and left gate_up level, with bit-identical
#: outputs (BENCHMARKS.md).
DEFAULT_EPILOGUE = "tma"


def resolve_epilogue(op: str, epilogue: str | None, N: int) -> str:
    """``epilogue`` checked (``ValueError`` naming ``op`` for anything but ``"tma"`` / ``"pointer"`` / None, and for
    ``"tma"`` with ``N % 8 != 0``: a TMA descriptor needs 16-byte row strides), or the default for ``N``."""
    if epilogue is None:
        return DEFAULT_EPILOGUE if N % 8 == 0 else "pointer"
    if epilogue not in EPILOGUES:
        _fail(ValueError, "epilogue", "'tma' or 'pointer'", repr(epilogue), op)
    if epilogue == "tma" and N % 8 != 0:
        _fail(ValueError, "epilogue", "'pointer' for N % 8 != 0 (a TMA store needs y's rows at 16-byte strides)",
              f"'tma' with N = {N}", op)
    return epilogue


def _launch(kernel, x_q, w_q, expert_offsets, x_scale, w_scale, out_dtype, block_n: int, num_stages: int,
            num_sms: int | None, epilogue: str, tile_m: int = _BM, tile_n: int | None = None,
            **constexprs) -> torch.Tensor:
    """Allocate ``y [M_cap, N]`` (empty: the kernels write the owned rows and zero the rest), build the TMA descriptors
    (``x`` in [64, 128] boxes, ``w`` viewed as ``[E * N, K]`` in [block_n, 128] boxes, ``y`` in [64, block_n] boxes
    for the TMA epilogue) and launch ``kernel`` on the persistent grid ``min(num_sms, (cdiv(M_cap, tile_m) + E) *
    cdiv(N, tile_n))`` (a CTA tile of ``tile_m`` x ``tile_n``, ``tile_n`` default ``block_n``). Inputs already
    checked."""
    M_cap, K = x_q.shape
    E, N, _ = w_q.shape
    y = torch.empty((M_cap, N), dtype=out_dtype, device=x_q.device)
    if M_cap == 0:
        return y
    if num_sms is None:
        num_sms = device_spec(x_q.device).sm_count
    layout = _x_layout()
    x_desc = TensorDescriptor.from_tensor(x_q, [_HM, _BK], layout)
    w_desc = TensorDescriptor.from_tensor(w_q.view(E * N, K), [block_n, _BK], layout)
    tma_out = epilogue == "tma"
    # without the TMA epilogue the kernel never reads y_desc: a descriptor of the same type over a small dummy
    y_target = y if tma_out else torch.empty((_HM, block_n), dtype=out_dtype, device=x_q.device)
    y_desc = TensorDescriptor.from_tensor(y_target, [_HM, block_n], _y_layout())
    bound = (triton.cdiv(M_cap, tile_m) + E) * triton.cdiv(N, tile_n or block_n)
    grid = (max(1, min(int(num_sms), bound)),)
    kernel[grid](x_desc, w_desc, y, y_desc, x_scale, w_scale, expert_offsets, E, M_cap, N, K, BLOCK_E=block_e(E),
                 NUM_STAGES=num_stages, TMA_OUT=tma_out, num_warps=4, maxnreg=MAXNREG, **constexprs)
    return y


#: The deepest rings by ``block_m`` and epilogue: 227 KiB of shared memory a block on Hopper (a stage: 32 KiB at
#: ``block_m = 128``, 40 KiB at 64), less the TMA epilogue's buffers (32 KiB).
_BLOCK_MAX_STAGES = {128: {"pointer": 6, "tma": 5}, 64: {"pointer": 5, "tma": 4}}
#: The work-item rows of the FP8-block kernel: 128 (two consumers on 64 rows each of a 128 x 128 tile) or 64 (split-N:
#: both consumers on the same 64 rows, 128 columns each of a 64 x 256 tile).
BLOCK_MS = (128, 64)


def grouped_gemm_gluon_fp8_block(x_q: torch.Tensor, w_q: torch.Tensor, expert_offsets: torch.Tensor,
                                 x_scale: torch.Tensor, w_scale: torch.Tensor, out_dtype=torch.bfloat16, *,
                                 num_stages: int = 4, num_sms: int | None = None,
                                 epilogue: str | None = None, skip_empty: bool = True,
                                 block_m: int = 128) -> torch.Tensor:
    """``y [M_cap, N]`` bf16 of the FP8 block-scaled grouped GEMM (module docstring: shapes, refusals, design).

    ``block_m`` (:data:`BLOCK_MS`; ``ValueError`` otherwise): the rows of a work item. 128: tiles of 128 x 128, the
    two consumer warpgroups on 64 rows each. 64 ("split N"): tiles of 64 x 256, both consumers on the same 64 rows
    (one ``x`` box a stage) with 128 columns (one ``w`` box) each: an expert of ~130 rows takes 3 items of 64 rows
    (68% full) instead of 2 of 128 (51%), at 25% more loads per output than the 128 x 128 tile (``(64 + 256) /
    (64 * 256)`` vs ``256 / 128**2``). Which wins depends on the rows an expert gets (``triton.py:
    gluon_fp8_block_m``). ``num_stages``: shared-memory ring depth (32 KiB a stage at ``block_m = 128``: 2..6, 2..5
    with the TMA epilogue; 40 KiB at 64: 2..5, 2..4). ``num_sms``:
    persistent programs (default: the device's SM count, 132 on an H200). ``epilogue``: ``"tma"`` or ``"pointer"``
    (:data:`EPILOGUES`; default :data:`DEFAULT_EPILOGUE` where ``N % 8 == 0``); ``ValueError`` for another value, for
    ``"tma"`` with ``N % 8 != 0``, or for ``num_stages`` out of its range. ``skip_empty`` (a bool; ``TypeError``
    otherwise): a consumer whose 64-row half of a tile holds no row of the tile's expert runs no ``wgmma`` there
    (:func:`_consumer`; the same output: those rows are never stored); False computes them."""
    check_inputs(x_q, w_q, expert_offsets, x_scale, w_scale, out_dtype)
    epilogue = resolve_epilogue(OP, epilogue, w_q.shape[1])
    if type(block_m) is not int or block_m not in BLOCK_MS:
        _fail(ValueError, "block_m", "128 or 64 (the rows of a work item)", f"{block_m!r}")
    max_st = _BLOCK_MAX_STAGES[block_m][epilogue]
    if not isinstance(num_stages, int) or not 2 <= num_stages <= max_st:
        _fail(ValueError, "num_stages", f"an int in [2, {max_st}] ({32 if block_m == 128 else 40} KiB of shared "
              f"memory a stage at block_m = {block_m}, epilogue {epilogue!r})", num_stages)
    if type(skip_empty) is not bool:
        _fail(TypeError, "skip_empty", "a bool", f"{skip_empty!r} ({type(skip_empty).__name__})")
    return _launch(_grouped_gemm_fp8_block_kernel, x_q, w_q, expert_offsets, x_scale, w_scale, out_dtype, _BN,
                   num_stages, num_sms, epilogue, tile_m=block_m, tile_n=_BN * (_BM // block_m),
                   SKIP_EMPTY=skip_empty, TM=block_m)


def _compile_sm90(kernel, block_n: int, constexprs: dict):
    """``triton.compile`` of ``kernel`` (a ``GluonASTSource``) for ``GPUTarget("cuda", 90, 32)`` with ``w`` boxes of
    ``block_n`` rows and the given constexprs (``BLOCK_E`` and ``NUM_STAGES`` first)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    lay = _x_layout()
    sig = {"x_desc": f"tensordesc<fp8e4nv[{_HM}, {_BK}],{lay!r}>",
           "w_desc": f"tensordesc<fp8e4nv[{block_n}, {_BK}],{lay!r}>",
           "y_ptr": "*bf16", "y_desc": f"tensordesc<bf16[{_HM}, {block_n}],{_y_layout()!r}>", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "off_ptr": "*i32", "E": "i32", "M_cap": "i32",
           "N": "i32", "K": "i32", **{name: "constexpr" for name in constexprs}}
    src = GluonASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": MAXNREG})


def compile_sm90(num_stages: int = 4, E: int = 32, epilogue: str = "pointer", block_m: int = 128):
    """Compile the kernel for sm_90a without a GPU (``triton.compile`` of a ``GluonASTSource`` for
    ``GPUTarget("cuda", 90, 32)``); returns triton's ``CompiledKernel`` (``.asm["ptx"]``, ``["cubin"]``...). Tests and
    probes only; needs ``TRITON_INTERPRET`` unset when triton is imported."""
    return _compile_sm90(_grouped_gemm_fp8_block_kernel, _BN, {"BLOCK_E": block_e(E), "NUM_STAGES": num_stages,
                                                                "TMA_OUT": epilogue == "tma", "TM": block_m})


def compile_sm90_rowwise(num_stages: int = 4, E: int = 32, block_n: int = 128, promote: int = 0,
                         epilogue: str = "pointer"):
    """:func:`compile_sm90` for the rowwise kernel (``block_n`` 128 or 256; ``promote``: K blocks a promotion)."""
    return _compile_sm90(_grouped_gemm_fp8_rowwise_kernel, block_n,
                         {"BLOCK_E": block_e(E), "NUM_STAGES": num_stages, "BN": block_n, "G": promote,
                          "TMA_OUT": epilogue == "tma"})


OP_ROWWISE = "grouped_gemm_gluon_fp8_rowwise"


def check_inputs_rowwise(x_q, w_q, expert_offsets, x_scale, w_scale, out_dtype) -> None:
    """Every host-side refusal of :func:`grouped_gemm_gluon_fp8_rowwise`, before any launch (messages name
    ``grouped_gemm_gluon_fp8_rowwise``, the argument, the expectation and what came): ``TypeError`` for a wrong type
    or dtype (``x_q`` / ``w_q`` not float8_e4m3fn, scales not float32, offsets not int32, ``out_dtype`` not
    bfloat16); ``ValueError`` for shapes (ranks, ``K`` of ``x_q`` vs ``w_q``, ``K`` not a positive multiple of 16 (TMA
    row strides of ``K`` bytes), ``x_scale`` not ``[M_cap, 1]``, ``w_scale`` not ``[E, N]``, ``expert_offsets`` not
    ``[E + 1]``, more than 4095 experts), non-contiguous tensors, tensors on different devices, a base address not
    16-byte aligned; ``NotImplementedError`` off a CUDA device of compute capability (9, 0), and for ``M_cap`` or
    ``E * N`` of 2**31 or more."""
    op = OP_ROWWISE
    tensors, M_cap, K, E, N = _check_common(op, x_q, w_q, expert_offsets, x_scale, w_scale, out_dtype,
                                            w_scale_rank=2, k_multiple=16,
                                            k_why="TMA: rows of K bytes, 16-byte strides")
    if tuple(x_scale.shape) != (M_cap, 1):
        _fail(ValueError, "x_scale", f"of shape [M_cap, 1] = [{M_cap}, 1] (one scale per token)",
              f"shape {tuple(x_scale.shape)}", op)
    if tuple(w_scale.shape) != (E, N):
        _fail(ValueError, "w_scale", f"of shape [E, N] = [{E}, {N}] (one scale per output channel)",
              f"shape {tuple(w_scale.shape)}", op)
    _check_placement(op, tensors, M_cap, E, N)


#: The largest promotion group of the rowwise kernel, in 128-wide K blocks.
_MAX_PROMOTE = 16
#: Shared memory a stage of the rowwise kernel: x (128 x 128 FP8) + w (BN x 128 FP8), by ``block_n``; the ring's
#: depth is bounded by Hopper's 227 KiB a block.
_ROWWISE_MAX_STAGES = {128: 6, 256: 4}
#: ... with the TMA epilogue's buffers (32 / 64 KiB).
_ROWWISE_MAX_STAGES_TMA = {128: 5, 256: 3}


def grouped_gemm_gluon_fp8_rowwise(x_q: torch.Tensor, w_q: torch.Tensor, expert_offsets: torch.Tensor,
                                   x_scale: torch.Tensor, w_scale: torch.Tensor, out_dtype=torch.bfloat16, *,
                                   num_stages: int | None = None, block_n: int = 128, promote: int = 2,
                                   num_sms: int | None = None, epilogue: str | None = None) -> torch.Tensor:
    """``y [M_cap, N]`` bf16 of the per-token x per-channel FP8 grouped GEMM ("rowwise"; ``grouped_gemm(...,
    implementation="triton")`` dispatches here what ``triton.py: gluon_fp8_rowwise_eligible`` accepts: sm_90, bf16
    out, no bias, contiguous, ``M_cap >= 4096`` and ``>= 32 * E``, ``EPMOE_TRITON_GLUON_FP8_ROWWISE`` not 0)::

        y[m, n] = (sum_k x_q[m, k] * w_q[e(m), n, k]) * x_scale[m, 0] * w_scale[e(m), n]   (float32 accumulation)

    ``x_q [M_cap, K]`` float8_e4m3fn, ``x_scale [M_cap, 1]`` float32 (``per_token_quant_fp8``); ``w_q [E, N, K]``
    float8_e4m3fn, ``w_scale [E, N]`` float32 (``quantize_weight_fp8(w, "per_channel")``); ``expert_offsets
    [E + 1]`` int32 with the row ownership, running-max and zeroing of the FP8-block kernel (module docstring). ``K``
    a multiple of 16 (not of 128: the last K box is zero-filled by TMA past ``K`` in ``x`` and ``w``, so the product
    is exact). Refusals: :func:`check_inputs_rowwise`; ``ValueError`` for ``block_n`` not 128 / 256,
    ``num_stages`` outside ``[2, 6]`` (``[2, 4]`` at ``block_n = 256``: 48 KiB a stage; one stage less each with the
    TMA epilogue; default 4, 3 at ``block_n = 256`` with the TMA epilogue), ``promote`` not an int in
    ``[0, 16]``, or ``promote > 0`` with ``block_n = 256`` (registers).

    ``promote``: K blocks (of 128) chained in the tensor cores before each float32 add (default 2, as the dispatch;
    layer error 7.1e-3); 0 chains the whole K (the accumulation of ``use_fast_accum=True``: on the E=32 FP8 per-token
    layer an error of 1.96e-2, over the bench's 1e-2: module docstring) and is the only setting at ``block_n = 256``.

    Design: the FP8-block kernel's producer (TMA) partition, expert-aligned tiles, grouped persistent schedule and
    zeroing; 128 x ``block_n`` tiles, two 64-row consumer warpgroups. Each consumer chains the ``warpgroup_mma`` of
    ``promote`` K blocks (all of them with ``promote = 0``) into a partial accumulator (``use_acc=False`` for the
    first, then True) with one ``wgmma`` in flight (``warpgroup_mma_wait(num_outstanding=1)`` after issuing block
    ``kb`` completes block ``kb - 1``, whose stage is then released on ``empty``), waits for the last
    (``warpgroup_mma_wait(0)``), releases its stage and adds the partial to the float32 accumulator. Epilogue:
    ``acc * x_scale[rows][:, None] * w_scale[e, cols][None, :]`` to bf16, masked pointer stores as the block kernel.
    Compared with block_n 256 without promotion, the Triton kernel and ``torch._scaled_grouped_mm``: BENCHMARKS.md."""
    check_inputs_rowwise(x_q, w_q, expert_offsets, x_scale, w_scale, out_dtype)
    if block_n not in _ROWWISE_MAX_STAGES:
        _fail(ValueError, "block_n", "128 or 256", block_n, OP_ROWWISE)
    epilogue = resolve_epilogue(OP_ROWWISE, epilogue, w_q.shape[1])
    max_st = _ROWWISE_MAX_STAGES[block_n] if epilogue == "pointer" else _ROWWISE_MAX_STAGES_TMA[block_n]
    if num_stages is None:
        num_stages = min(4, max_st)  # 3 at block_n 256 with the TMA epilogue
    if not isinstance(num_stages, int) or not 2 <= num_stages <= max_st:
        _fail(ValueError, "num_stages", f"an int in [2, {max_st}] ({(16 + block_n // 8)} KiB of shared memory a "
              f"stage at block_n = {block_n}, epilogue {epilogue!r})", num_stages, OP_ROWWISE)
    if type(promote) is not int or not 0 <= promote <= _MAX_PROMOTE:
        _fail(ValueError, "promote", f"an int in [0, {_MAX_PROMOTE}] (K blocks a promotion; 0: none)",
              f"{promote!r} ({type(promote).__name__})", OP_ROWWISE)
    if promote and block_n != 128:
        _fail(ValueError, "block_n", f"128 with promote = {promote} > 0 (a partial and a float32 accumulator of 64 x "
              "block_n each: 256 registers a thread at block_n = 256; pass promote=0 for 128 x 256 tiles)", block_n,
              OP_ROWWISE)
    return _launch(_grouped_gemm_fp8_rowwise_kernel, x_q, w_q, expert_offsets, x_scale, w_scale, out_dtype, block_n,
                   num_stages, num_sms, epilogue, BN=block_n, G=promote)

