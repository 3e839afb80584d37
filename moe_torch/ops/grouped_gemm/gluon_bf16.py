"""Gluon (``triton.experimental.gluon``, Triton 3.6) grouped GEMM for 16-bit inputs (bf16 / fp16) on Hopper: the
torch forward and the dgrad, one kernel.

Contract (CONTRACT.md section 4, the forward, and section 8, the dgrad; names as ``triton.py`` /
``triton_backward.py``)::

    forward  y  [M_cap, N] = x   [M_cap, K] @ w[e].T     (w [E, N, K]; contraction over K)
    dgrad    d_x[M_cap, K] = d_y [M_cap, N] @ w[e]       (w [E, N, K]; contraction over N)

for the rows of expert ``e``, float32 accumulation, one rounding to the input dtype (the output dtype is the input
dtype: bf16 in, bf16 out; fp16 in, fp16 out).

* ``x`` / ``d_y`` and ``w`` bfloat16 or float16 (one dtype), row-major contiguous; ``w [E, N, K]`` as the forward
  stores it (no transposed copy for the dgrad);
* ``expert_offsets [E + 1]`` int32, non-decreasing (not checked: that needs a host sync); expert ``e`` owns rows
  ``[s_e, t_e)``, the offsets clamped to ``[0, M_cap]`` and made non-decreasing by a running max
  (``gluon.py: _expert_rows_of``, as the Triton kernels), so experts never overlap;
* the result is allocated with ``torch.empty``; rows no expert owns (``[0, s_0)`` and ``[t_(E-1), M_cap)``) are zeroed by
  the kernel itself after its tiles (``gluon.py: _zero_unowned``), every owned row is written once.

Refused on the host before any launch (messages name ``grouped_gemm_gluon_bf16`` / ``grouped_gemm_gluon_dgrad``, the
argument, the expectation and what came): ``TypeError`` for a wrong type or dtype (the activation not bf16 / fp16,
``w`` not its dtype, offsets not int32); ``ValueError`` for shapes (ranks, the contraction of the activation vs
``w``, ``expert_offsets`` not ``[E + 1]``, ``E`` outside ``[1, 4095]``, an output or contraction dimension of 0),
``K % 8 != 0`` (TMA: rows of ``w`` and of ``x`` / ``d_x`` at 16-byte strides), ``block_n`` / ``num_stages`` /
``epilogue`` out of range, non-contiguous tensors, tensors on different devices, a base address not 16-byte aligned;
``NotImplementedError`` for the dgrad's ``N % 64 != 0`` (its contraction steps of 64 rows of ``w`` would read the next
expert's rows into the sum), for tensors off a CUDA device of compute capability exactly (9, 0) (sm_90a: ``wgmma``,
``setmaxnreg``), and for ``M_cap`` or ``E * N`` of 2**31 or more (int32 TMA coordinates).

Design (``gluon.py``'s rowwise FP8 kernel with ``G = 0``, for 16-bit operands; its schedule and helpers imported):

* CTA tile 128 x ``BN`` (``block_n`` 128 or 256) x ``BLOCK_K = 64`` (a 64-element row of 16-bit values is one
  128-byte swizzle row). Three warp-specialized partitions (``gl.warp_specialize``): two consumer warpgroups of 64
  rows each (``WG`` = 0 / 1) and a 4-warp TMA producer (40 registers a thread) that loads, per stage, two ``[64, 64]``
  boxes of the activation (one per consumer) and one box of ``w`` into a ring of ``NUM_STAGES`` stages with ``ready``
  (transaction bytes) and ``empty`` (count 2) mbarriers.
* The weight layout is a constexpr (``DGRAD``). Forward: ``w`` viewed as ``[E * N, K]`` in ``[BN, 64]`` boxes at row
  ``e * N + n0`` (K contiguous: the ``wgmma`` B operand is the box ``permute((1, 0))``, K-major, as ``gluon.py``).
  Dgrad: the same ``[E * N, K]`` view in ``[64, BN]`` boxes at row ``e * N + kb * 64``, column ``k0`` (``d_x``'s
  columns contiguous: an MN-major B operand, which 16-bit ``wgmma`` reads directly, as this repo's Gluon wgrad reads
  its ``x`` boxes). Hence the dgrad's ``N % 64 == 0``. Tails: the forward's K tail is zero in both boxes (TMA fills past
  ``K``), exact; the forward's N tail reads the next expert's weight rows (computed, never stored); the dgrad's K tail
  (columns past ``K``) is zero-filled and never stored.
* Each consumer chains the ``wgmma`` of all K steps into one float32 accumulator (64 x ``BN``: 64 / 128 registers a
  thread), one ``wgmma`` in flight: after issuing step ``kb`` it waits with ``warpgroup_mma_wait(1)`` (step ``kb - 1``
  done) and releases step ``kb - 1``'s stage; no promotion (16-bit products are exact in float32). The epilogue
  converts ``acc + 0.0``, not ``acc``: with the conversion reading the accumulator registers directly ptxas serialized
  the ``wgmma`` (C7514 on every configuration); the only visible effect is that a -0.0 result is stored as +0.0.
* Work: ``gluon.py``'s expert-aligned row tiles and grouped persistent order (``_expert_table``, ``_tile_coords``):
  grid ``min(#SMs, (cdiv(M_cap, 128) + E) * cdiv(n_out, BN))``, no host sync (CUDA-graph capturable).
* Epilogue (``epilogue``, ``gluon.py: EPILOGUES``; :func:`gluon._store_tile`): ``"tma"``: each consumer's share whose
  64 rows are all its expert's goes through its own ``[64, BN]`` shared buffer and an asynchronous TMA store (waited
  for a tile later), a share straddling its expert's last row through masked pointer stores; ``"pointer"``: masked
  pointer stores from the ``wgmma`` registers for every share.

Shared memory a stage: 16 KiB of activation + ``BN * 128`` bytes of ``w`` (32 KiB at ``BN = 128``, 48 KiB at 256);
the TMA epilogue's two buffers take ``BN * 256`` bytes; Hopper allows 227 KiB a block: rings of at most 7 / 6 stages
(pointer / tma) at ``BN = 128``, 4 / 3 at 256 (:data:`MAX_STAGES`). Compile facts (triton 3.6.0, ``ptxas -v``;
``tests/test_gluon_bf16.py`` prints them), the same for both layouts and for fp16: 168 registers (``MAXNREG``;
setmaxnreg 232 / 232 / 40 as ``gluon.py``), no C7514; spills 0 bytes at E = 32, 16 at E = 256 (the producer's
256-lane expert table); shared memory 229632 / 229640 bytes (BN 128: 7 stages pointer / 6 stages TMA), 196808 /
213216 (BN 256: 4 / 3). A ``[64, 256]`` box with 128-byte swizzle is split by triton into four ``[64, 64]`` TMA
messages (its ``block_size`` metadata), one per producer warp.

Dispatch (``triton_common.py``): the forward runs here where the device's tuned forward entry says ``"kernel":
"gluon"`` (``config.py: tuned_forward_kernel``, written by ``benchmarks/tune_triton_gemm.py``, with the entry's
``"gluon_config"``: :func:`dispatch_options`) and ``EPMOE_TRITON_GLUON_BF16`` is unset, wherever it serves with
``EPMOE_TRITON_GLUON_BF16=1``, never with ``=0``; the dgrad only with ``EPMOE_TRITON_GLUON_DGRAD=1`` (off by default).
Its timings against the Triton kernel: BENCHMARKS.md.

Sources read (no code copied): this repo's ``moe_torch/ops/grouped_gemm/gluon.py`` (the partitions, ring, schedule,
zeroing and TMA-store epilogue, reused by import) and ``gluon_backward.py`` (MN-major 16-bit ``wgmma`` operands from
TMA boxes, the ``[E * N, K]`` view of ``w``), both at e5683fbd4d8ac93e84b7c4f03f143cc58f0432e7, and the installed
triton 3.6.0 package (``triton/experimental/gluon``: ``warpgroup_mma`` operand rules, ``TensorDescriptor``).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moe_torch.ops.device import device_spec
from moe_torch.ops.grouped_gemm.config import GLUON_MIN_ROWS, GLUON_MIN_ROWS_PER_EXPERT
from moe_torch.ops.grouped_gemm.gluon import (
    BLOCK_N,
    CONSUMER_REGS,
    EPILOGUES,
    HALF_M,
    MAXNREG,
    PRODUCER_REGS,
    _MAX_EXPERTS,
    _check_placement,
    _expert_table,
    _fail,
    _store_tile,
    _tile_coords,
    _zero_unowned,
    block_e,
    resolve_epilogue,
)

OP = "grouped_gemm_gluon_bf16"
OP_DGRAD = "grouped_gemm_gluon_dgrad"
BK16 = gl.constexpr(64)  # contraction step: 64 16-bit values, one 128-byte swizzle row
_BM, _HM, _BK = 128, 64, 64
_DTYPES = (torch.bfloat16, torch.float16)
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
#: The deepest ring by (block_n, epilogue): 227 KiB of shared memory a block on Hopper; a stage takes 16 KiB of the
#: activation + block_n * 128 bytes of w, the TMA epilogue's two [64, block_n] buffers block_n * 256 bytes.
MAX_STAGES = {(128, "pointer"): 7, (128, "tma"): 6, (256, "pointer"): 4, (256, "tma"): 3}
BLOCK_NS = (128, 256)
#: What the dispatch passes (``triton.py: grouped_gemm_triton`` / ``triton_backward.py: grouped_gemm_dgrad_triton``
#: with ``EPMOE_TRITON_GLUON_BF16=1`` / ``EPMOE_TRITON_GLUON_DGRAD=1``) where no tuned ``"gluon_config"`` serves
#: (:func:`dispatch_options`; the pointer epilogue where ``N % 8 != 0``): 128 x 256 tiles with the TMA-store epilogue
#: and its deepest ring, the fastest of the kernel's configs on 6 of the 8 rows measured
#: (128 x 128 / 4 stages on the Zipf gate_up forward and dgrad; BENCHMARKS.md).
DISPATCH_OPTIONS = {"block_n": 256, "num_stages": 3, "epilogue": "tma"}
DGRAD_DISPATCH_OPTIONS = {"block_n": 256, "num_stages": 3, "epilogue": "tma"}


@functools.cache  # one immutable layout object, not a new one each launch
def _smem_layout() -> gl.NVMMASharedLayout:
    """128-byte swizzle for every 16-bit box: the activation's [64, 64], ``w``'s [BN, 64] / [64, BN], ``y``'s [64, BN]."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


@gluon.jit
def _b_operand(buf, DGRAD: gl.constexpr):
    """The ``wgmma`` B operand ``[64, BN]`` of a ``w`` stage: the dgrad's box as it is (MN-major), the forward's
    ``[BN, 64]`` box transposed (K-major)."""
    if DGRAD:
        b = buf
    else:
        b = buf.permute((1, 0))
    return b


@gluon.jit
def _producer16(x_desc, w_desc, off_ptr, a_bufs, b_bufs, ready, empty, E, M_cap, NO, KC, NW,
                BLOCK_E: gl.constexpr, NUM_STAGES: gl.constexpr, BN: gl.constexpr, DGRAD: gl.constexpr):
    """The TMA partition: per contraction step of 64, two [64, 64] activation boxes (one per consumer) and one ``w``
    box (forward ``[BN, 64]`` at ``[e * NW + n0, k0]``; dgrad ``[64, BN]`` at ``[e * NW + k0, n0]``), ``cdiv(KC, 64)``
    steps a tile. ``NO``: output columns; ``KC``: contraction length; ``NW``: rows of ``w`` an expert (``N``)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    incl, total = _expert_table(off_ptr, E, M_cap, BLOCK_E, layout)
    n_cols = gl.cdiv(NO, BN)
    KB = gl.cdiv(KC, BK16)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    it = 0
    for tile in range(pid, total * n_cols, nprog):
        e, m0, s_e, t_e, pid_n = _tile_coords(tile, n_cols, total, incl, off_ptr, E, M_cap, BLOCK_E, layout)
        n0 = pid_n * BN
        w_row = e * NW
        for kb in range(KB):
            st = it % NUM_STAGES
            # mbarriers start in phase 0: waiting for parity 1 passes at once, so the ring starts empty.
            mbarrier.wait(empty.index(st), ((it // NUM_STAGES) & 1) ^ 1)
            bar = ready.index(st)
            mbarrier.expect(bar, 2 * x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            k0 = kb * BK16
            tma.async_copy_global_to_shared(x_desc, [m0, k0], bar, a_bufs.index(2 * st))
            tma.async_copy_global_to_shared(x_desc, [m0 + HALF_M, k0], bar, a_bufs.index(2 * st + 1))
            if DGRAD:
                tma.async_copy_global_to_shared(w_desc, [w_row + k0, n0], bar, b_bufs.index(st))
            else:
                tma.async_copy_global_to_shared(w_desc, [w_row + n0, k0], bar, b_bufs.index(st))
            it += 1


@gluon.jit
def _consumer16(y_ptr, y_desc, c_buf, off_ptr, a_bufs, b_bufs, ready, empty, E, M_cap, NO, KC,
                BLOCK_E: gl.constexpr, NUM_STAGES: gl.constexpr, BN: gl.constexpr, DGRAD: gl.constexpr,
                WG: gl.constexpr, TMA_OUT: gl.constexpr):
    """One consumer warpgroup: rows ``[m0 + WG * 64, m0 + WG * 64 + 64)`` x ``BN`` columns of every tile, one
    float32 accumulator chained over the whole contraction, one ``wgmma`` in flight."""
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    incl, total = _expert_table(off_ptr, E, M_cap, BLOCK_E, vec)
    n_cols = gl.cdiv(NO, BN)
    KB = gl.cdiv(KC, BK16)  # >= 1 (the host refuses a contraction of 0)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    r = gl.arange(0, HALF_M, layout=gl.SliceLayout(1, mma))
    c = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    zero = gl.zeros([HALF_M, BN], gl.float32, layout=mma)  # ignored where use_acc=False
    it = 0  # stages consumed so far (the producer's ``it``, in the same order)
    for tile in range(pid, total * n_cols, nprog):
        e, m0, s_e, t_e, pid_n = _tile_coords(tile, n_cols, total, incl, off_ptr, E, M_cap, BLOCK_E, vec)
        # step 0: a fresh accumulator; the wait turns the token into the loop-carried tensor, leaving it in flight
        st = it % NUM_STAGES
        mbarrier.wait(ready.index(st), (it // NUM_STAGES) & 1)
        tok = hopper.warpgroup_mma(a_bufs.index(2 * st + WG), _b_operand(b_bufs.index(st), DGRAD), zero,
                                   use_acc=False, is_async=True)
        acc = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[tok])
        for kb in range(1, KB):
            nxt = it + 1
            sn = nxt % NUM_STAGES
            mbarrier.wait(ready.index(sn), (nxt // NUM_STAGES) & 1)
            acc = hopper.warpgroup_mma(a_bufs.index(2 * sn + WG), _b_operand(b_bufs.index(sn), DGRAD), acc,
                                       use_acc=True, is_async=True)
            # every wgmma but the one just issued has completed: step kb - 1's stage (``it``) is read
            acc = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            mbarrier.arrive(empty.index(it % NUM_STAGES))
            it = nxt
        acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(empty.index(it % NUM_STAGES))  # the last step's stage
        it += 1
        rows = m0 + WG * HALF_M + r
        # ``+ 0.0`` (kept: MLIR / LLVM fold ``x - 0.0`` and ``x * 1.0``, not ``x + 0.0``): converted straight from the
        # accumulator registers, ptxas serialized every wgmma of the kernel (C7514, triton 3.6.0); a -0.0 sum
        # becomes +0.0
        out = (acc + 0.0).to(y_ptr.dtype.element_ty)
        _store_tile(out, rows, pid_n * BN + c, m0 + WG * HALF_M, pid_n * BN, m0, s_e, t_e, y_ptr, y_desc, c_buf, M_cap,
                    NO, TMA_OUT)
    # the unowned rows in 64 x 128 blocks whatever BN (half the registers of 64 x 256 blocks), as gluon.py
    zl: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    _zero_unowned(y_ptr, off_ptr, E, M_cap, NO, BLOCK_E, BLOCK_N, WG, vec, zl)
    if TMA_OUT:
        tma.store_wait(0)


@gluon.jit
def _grouped_gemm_16bit_kernel(x_desc, w_desc, y_ptr, y_desc, off_ptr, E, M_cap, NO, KC, NW,
                               BLOCK_E: gl.constexpr, NUM_STAGES: gl.constexpr, BN: gl.constexpr,
                               DGRAD: gl.constexpr, TMA_OUT: gl.constexpr):
    """``y [M_cap, NO] = x [M_cap, KC] @ B_e`` over the rows of each expert (module docstring); ``DGRAD`` picks the
    layout of ``B_e`` in ``w`` viewed as ``[E * NW, *]``."""
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [2 * NUM_STAGES, HALF_M, BK16], x_desc.layout)
    if DGRAD:
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BK16, BN], w_desc.layout)
    else:
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BN, BK16], w_desc.layout)
    if TMA_OUT:
        c_bufs = gl.allocate_shared_memory(y_desc.dtype, [2, HALF_M, BN], y_desc.layout)
    else:
        c_bufs = gl.allocate_shared_memory(gl.int8, [2, 8, 16], gl.NVMMASharedLayout(0, 8, 2))  # unused
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)  # the producer's expect + the TMA transaction bytes
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    gl.warp_specialize([
        (_consumer16, (y_ptr, y_desc, c_bufs.index(0), off_ptr, a_bufs, b_bufs, ready, empty, E, M_cap, NO, KC,
                       BLOCK_E, NUM_STAGES, BN, DGRAD, 0, TMA_OUT)),
        (_consumer16, (y_ptr, y_desc, c_bufs.index(1), off_ptr, a_bufs, b_bufs, ready, empty, E, M_cap, NO, KC,
                       BLOCK_E, NUM_STAGES, BN, DGRAD, 1, TMA_OUT)),
        (_producer16, (x_desc, w_desc, off_ptr, a_bufs, b_bufs, ready, empty, E, M_cap, NO, KC, NW, BLOCK_E,
                       NUM_STAGES, BN, DGRAD)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------------------------------------------ host side

def _check_shapes(op: str, a, w, expert_offsets, a_name: str, dgrad: bool) -> tuple[int, int, int, int]:
    """Types, dtypes, ranks and shapes (no device needed). ``a`` is ``x [M_cap, K]`` (forward) or ``d_y [M_cap, N]``
    (dgrad). Returns ``(M_cap, E, N, K)``."""
    tensors = {a_name: a, "w": w, "expert_offsets": expert_offsets}
    for name, tns in tensors.items():
        if not isinstance(tns, torch.Tensor):
            _fail(TypeError, name, "a torch.Tensor", type(tns).__name__, op)
    if a.dtype not in _DTYPES:
        _fail(TypeError, a_name, "of dtype torch.bfloat16 or torch.float16", a.dtype, op)
    if w.dtype != a.dtype:
        _fail(TypeError, "w", f"of {a_name}'s dtype {a.dtype}", w.dtype, op)
    if expert_offsets.dtype != torch.int32:
        _fail(TypeError, "expert_offsets", "of dtype torch.int32", expert_offsets.dtype, op)
    for name, tns, rank in ((a_name, a, 2), ("w", w, 3), ("expert_offsets", expert_offsets, 1)):
        if tns.dim() != rank:
            _fail(ValueError, name, f"{rank}-D", f"shape {tuple(tns.shape)}", op)
    M_cap, C = a.shape
    E, N, K = w.shape
    if dgrad and N != C:
        _fail(ValueError, "w", f"[E, N, K] with N = d_y.shape[1] = {C}", f"shape {tuple(w.shape)}", op)
    if not dgrad and K != C:
        _fail(ValueError, "w", f"[E, N, K] with K = x.shape[1] = {C}", f"shape {tuple(w.shape)}", op)
    if E < 1 or N < 1:
        _fail(ValueError, "w", "of E >= 1 and N >= 1", f"shape {tuple(w.shape)}", op)
    if E > _MAX_EXPERTS:
        _fail(ValueError, "w", f"of at most {_MAX_EXPERTS} experts (the per-expert table)", f"E = {E}", op)
    if K % 8 != 0 or K == 0:
        _fail(ValueError, "w", "of K = shape[2] a positive multiple of 8 (TMA: rows of K 16-bit values at 16-byte "
              "strides)", f"K = {K}", op)
    if tuple(expert_offsets.shape) != (E + 1,):
        _fail(ValueError, "expert_offsets", f"of shape [E + 1] = [{E + 1}]", f"shape {tuple(expert_offsets.shape)}",
              op)
    if dgrad and N % _BK != 0:
        raise NotImplementedError(f"{op}: d_y must have N = shape[1] a multiple of {_BK} (the kernel's contraction "
                                  f"steps of {_BK} rows of w[e]: a partial step would read the next expert's rows), "
                                  f"got N = {N}")
    return M_cap, E, N, K


def _options(op: str, block_n, num_stages, epilogue, n_out: int) -> tuple[int, int, str]:
    """``block_n`` / ``num_stages`` / ``epilogue`` checked (``ValueError`` naming ``op``); ``None`` takes the
    default: ``block_n`` 128, the epilogue of ``gluon.resolve_epilogue``, the deepest ring of the pair."""
    if block_n is None:
        block_n = 128
    if type(block_n) is not int or block_n not in BLOCK_NS:
        _fail(ValueError, "block_n", "128 or 256", repr(block_n), op)
    epilogue = resolve_epilogue(op, epilogue, n_out)
    max_st = MAX_STAGES[(block_n, epilogue)]
    if num_stages is None:
        num_stages = max_st
    if type(num_stages) is not int or not 2 <= num_stages <= max_st:
        _fail(ValueError, "num_stages", f"an int in [2, {max_st}] at block_n = {block_n} with epilogue {epilogue!r} "
              f"({16 + block_n // 8} KiB of shared memory a stage)", repr(num_stages), op)
    return block_n, num_stages, epilogue


def check_inputs(x, w, expert_offsets) -> None:
    """Every host-side refusal of :func:`grouped_gemm_gluon_bf16` about its tensors (module docstring)."""
    M_cap, E, N, K = _check_shapes(OP, x, w, expert_offsets, "x", dgrad=False)
    _check_placement(OP, {"x": x, "w": w, "expert_offsets": expert_offsets}, M_cap, E, N, tma=("x", "w"),
                     en_rows="w")


def check_inputs_dgrad(d_y, w, expert_offsets) -> None:
    """Every host-side refusal of :func:`grouped_gemm_gluon_dgrad` about its tensors (module docstring)."""
    M_cap, E, N, K = _check_shapes(OP_DGRAD, d_y, w, expert_offsets, "d_y", dgrad=True)
    _check_placement(OP_DGRAD, {"d_y": d_y, "w": w, "expert_offsets": expert_offsets}, M_cap, E, N,
                     tma=("d_y", "w"), en_rows="w")


def _launch(a, w, expert_offsets, dgrad: bool, block_n: int, num_stages: int, epilogue: str,
            num_sms: int | None) -> torch.Tensor:
    """Allocate the result (empty: the kernel writes the owned rows and zeroes the rest), build the descriptors (the
    activation in [64, 64] boxes, ``w`` viewed as ``[E * N, K]`` in [block_n, 64] (forward) / [64, block_n] (dgrad)
    boxes, the result in [64, block_n] boxes for the TMA epilogue) and launch on the persistent grid. Inputs checked."""
    M_cap, C = a.shape
    E, N, K = w.shape
    n_out = K if dgrad else N
    y = torch.empty((M_cap, n_out), dtype=a.dtype, device=a.device)
    if M_cap == 0:
        return y
    if num_sms is None:
        num_sms = device_spec(a.device).sm_count
    lay = _smem_layout()
    x_desc = TensorDescriptor.from_tensor(a, [_HM, _BK], lay)
    w_box = [_BK, block_n] if dgrad else [block_n, _BK]
    w_desc = TensorDescriptor.from_tensor(w.view(E * N, K), w_box, lay)
    tma_out = epilogue == "tma"
    # without the TMA epilogue the kernel never reads y_desc: a descriptor of the same type over a small dummy
    y_target = y if tma_out else torch.empty((_HM, block_n), dtype=a.dtype, device=a.device)
    y_desc = TensorDescriptor.from_tensor(y_target, [_HM, block_n], lay)
    bound = (triton.cdiv(M_cap, _BM) + E) * triton.cdiv(n_out, block_n)
    grid = (max(1, min(int(num_sms), bound)),)
    _grouped_gemm_16bit_kernel[grid](x_desc, w_desc, y, y_desc, expert_offsets, E, M_cap, n_out, C, N,
                                     BLOCK_E=block_e(E), NUM_STAGES=num_stages, BN=block_n, DGRAD=dgrad,
                                     TMA_OUT=tma_out, num_warps=4, maxnreg=MAXNREG)
    return y


def grouped_gemm_gluon_bf16(x: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor, *,
                            num_stages: int | None = None, block_n: int = 128, epilogue: str | None = None,
                            num_sms: int | None = None) -> torch.Tensor:
    """``y [M_cap, N]`` (``x``'s dtype) with ``y[m] = x[m] @ w[e(m)].T`` for the rows of each expert, float32
    accumulation; unowned rows 0 (module docstring: contract, refusals, design).

    ``x [M_cap, K]``, ``w [E, N, K]``: bfloat16 or float16 (one dtype), contiguous, ``K % 8 == 0``;
    ``expert_offsets [E + 1]`` int32. ``block_n``: 128 or 256 (output columns a tile). ``num_stages``: ring depth
    (``2..MAX_STAGES[(block_n, epilogue)]``; default the deepest). ``epilogue``: ``"tma"`` or ``"pointer"``
    (default ``gluon.DEFAULT_EPILOGUE`` where ``N % 8 == 0``, else pointer; ``"tma"`` needs ``N % 8 == 0``).
    ``num_sms``: persistent programs (default the device's SM count). ``grouped_gemm(..., implementation="triton")``
    runs it where :func:`forward_eligible` accepts and either the device's tuned forward entry says ``"kernel":
    "gluon"`` (``EPMOE_TRITON_GLUON_BF16`` unset) or ``EPMOE_TRITON_GLUON_BF16=1``, with :func:`dispatch_options`
    (``triton.py: gluon_bf16_options``).
    Refusals (before any launch): :func:`check_inputs` (``TypeError`` / ``ValueError`` / ``NotImplementedError``),
    ``ValueError`` for ``block_n`` / ``num_stages`` / ``epilogue``."""
    _check_shapes(OP, x, w, expert_offsets, "x", dgrad=False)
    block_n, num_stages, epilogue = _options(OP, block_n, num_stages, epilogue, w.shape[1])
    check_inputs(x, w, expert_offsets)
    return _launch(x, w, expert_offsets, False, block_n, num_stages, epilogue, num_sms)


def forward_eligible_launch(x: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor, *,
                            num_stages: int | None = None, block_n: int = 128, epilogue: str | None = None,
                            num_sms: int | None = None) -> torch.Tensor:
    """:func:`grouped_gemm_gluon_bf16` for the dispatch (``triton.py: gluon_bf16_options``), whose
    :func:`forward_eligible` already ran every tensor check: only the options are checked again (the checks twice
    more cost host time a launch at small shapes)."""
    block_n, num_stages, epilogue = _options(OP, block_n, num_stages, epilogue, w.shape[1])
    return _launch(x, w, expert_offsets, False, block_n, num_stages, epilogue, num_sms)


def grouped_gemm_gluon_dgrad(d_y: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor, *,
                             num_stages: int | None = None, block_n: int = 128, epilogue: str | None = None,
                             num_sms: int | None = None) -> torch.Tensor:
    """``d_x [M_cap, K]`` (``d_y``'s dtype) with ``d_x[m] = d_y[m] @ w[e(m)]`` for the rows of each expert (CONTRACT.md
    section 8), float32 accumulation; unowned rows 0 (module docstring).

    ``d_y [M_cap, N]``, ``w [E, N, K]`` (the forward's weights, read in place as ``[N, K]`` per expert): bfloat16 or
    float16 (one dtype), contiguous, ``N % 64 == 0`` (else ``NotImplementedError``), ``K % 8 == 0``; ``expert_offsets
    [E + 1]`` int32. ``block_n``: 128 or 256 (columns of ``d_x``, i.e. of K, a tile); ``num_stages``, ``epilogue``,
    ``num_sms`` as :func:`grouped_gemm_gluon_bf16` (``"tma"`` always allowed: ``K % 8 == 0``).
    ``grouped_gemm_dgrad(..., implementation="triton")`` runs it with :data:`DGRAD_DISPATCH_OPTIONS` where
    ``EPMOE_TRITON_GLUON_DGRAD=1`` and :func:`dgrad_eligible` accept. Refusals (before any launch):
    :func:`check_inputs_dgrad`, ``ValueError`` for ``block_n`` / ``num_stages`` / ``epilogue``."""
    _check_shapes(OP_DGRAD, d_y, w, expert_offsets, "d_y", dgrad=True)
    block_n, num_stages, epilogue = _options(OP_DGRAD, block_n, num_stages, epilogue, w.shape[2])
    check_inputs_dgrad(d_y, w, expert_offsets)
    return _launch(d_y, w, expert_offsets, True, block_n, num_stages, epilogue, num_sms)


# ------------------------------------------------------------------------------------------------------- dispatch

def _rows_enough(M_cap: int, E: int) -> bool:
    """``M_cap >= GLUON_MIN_ROWS`` (4096) and ``>= GLUON_MIN_ROWS_PER_EXPERT * E`` (32 a local expert): the FP8 Gluon
    kernels' thresholds (``triton.py``), taken as they are (not measured for 16 bits)."""
    return M_cap >= GLUON_MIN_ROWS and M_cap >= GLUON_MIN_ROWS_PER_EXPERT * E


def forward_eligible(x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format=None, bias=None) -> bool:
    """Whether this kernel can serve a forward request of ``grouped_gemm_triton`` (the switch and the tuned choice are
    the caller's: ``triton.py: gluon_bf16_options``; the tuner asks it too): :func:`forward_refusal` is ``None``.
    Host-side only (no sync)."""
    return forward_refusal(x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format, bias) is None


#: :func:`forward_refusal`'s reasons the dispatch does not report: a problem below the rows at which the kernel is used
#: (a measured rule, not a limit of the kernel) and another kind of request than a tuned choice is about.
FEW_ROWS = "fewer rows than the kernel is used for"
OTHER_REQUEST = "serves bf16 / fp16 x, w and out of one dtype, without scales, bias or 4-bit weights"
NOT_REPORTED = (FEW_ROWS, OTHER_REQUEST)


def forward_refusal(x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format=None, bias=None) -> str | None:
    """Why this kernel does not serve a forward request (``None``: it does): bf16 / fp16 ``x`` and ``w`` of one dtype,
    ``out_dtype`` that dtype, no scales, no bias, no 4-bit weights (else :data:`OTHER_REQUEST`), enough rows
    (:func:`_rows_enough`; else :data:`FEW_ROWS`), and nothing :func:`check_inputs` refuses (contiguous, one sm_90
    CUDA device, ``K % 8 == 0``, 16-byte aligned, ``E <= 4095``). Host-side only (no sync)."""
    if (x_scale is not None or w_scale is not None or w_format is not None or bias is not None
            or not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES or out_dtype != x.dtype):
        return OTHER_REQUEST
    if x.dim() != 2 or expert_offsets.dim() != 1:
        return "needs x [M_cap, K] and expert_offsets [E + 1]"
    if not _rows_enough(x.shape[0], expert_offsets.shape[0] - 1):
        return FEW_ROWS
    try:
        check_inputs(x, w, expert_offsets)
    except (TypeError, ValueError, NotImplementedError) as exc:
        return str(exc)
    return None


def forward_options_problem(options, N: int) -> str | None:
    """Why ``options`` (a tuned entry's ``"gluon_config"``: ``block_n`` / ``num_stages`` / ``epilogue``, each optional,
    ``None`` or missing meaning :func:`grouped_gemm_gluon_bf16`'s default) cannot serve a forward of ``N`` output
    columns: not a dict, another key, or what that launcher raises ``ValueError`` for (``block_n`` not 128 / 256, a ring
    deeper than :data:`MAX_STAGES`, ``"tma"`` with ``N % 8 != 0``); ``None`` where they can."""
    if not isinstance(options, dict):
        return f"options must be a dict; got {type(options).__name__}"
    if unknown := sorted(set(options) - {"block_n", "num_stages", "epilogue"}):
        return f"options may hold block_n, num_stages and epilogue only; got {unknown}"
    try:
        _options(OP, options.get("block_n"), options.get("num_stages"), options.get("epilogue"), N)
    except ValueError as exc:
        return str(exc)
    return None


def dispatch_options(options: dict | None, N: int) -> dict:
    """The keyword options the forward dispatch (``triton.py: gluon_bf16_options``) passes to
    :func:`grouped_gemm_gluon_bf16` for ``N`` output columns: ``options`` (the tuned entry's ``"gluon_config"``) where
    they are non-empty and keep :func:`forward_options_problem`; else :data:`DISPATCH_OPTIONS`, with the pointer
    epilogue where ``N % 8 != 0`` (a TMA store needs ``y``'s rows at 16-byte strides; 3 stages fit both epilogues at
    ``block_n`` 256). A new dict each call."""
    if options and forward_options_problem(options, N) is None:
        return dict(options)
    chosen = dict(DISPATCH_OPTIONS)
    if N % 8 != 0:
        chosen["epilogue"] = "pointer"
    return chosen


def dgrad_eligible(d_y, w, expert_offsets, w_scale, out_dtype) -> bool:
    """Whether this kernel can serve a dgrad request of ``grouped_gemm_dgrad_triton`` (the switch is the caller's:
    ``triton_backward.py: gluon_dgrad_eligible``): bf16 / fp16 ``d_y`` and ``w`` of one dtype (no FP8 weights, no
    ``w_scale``), ``out_dtype`` that dtype, enough rows (:func:`_rows_enough`), ``N % 64 == 0``, ``K % 8 == 0`` and
    nothing else :func:`check_inputs_dgrad` refuses. Host-side only (no sync)."""
    if (w_scale is not None or not isinstance(d_y, torch.Tensor) or d_y.dtype not in _DTYPES or out_dtype != d_y.dtype
            or d_y.dim() != 2 or expert_offsets.dim() != 1
            or not _rows_enough(d_y.shape[0], expert_offsets.shape[0] - 1)):
        return False
    try:
        check_inputs_dgrad(d_y, w, expert_offsets)
    except (TypeError, ValueError, NotImplementedError):
        return False
    return True


# ------------------------------------------------------------------------------------------ compile-only (tests)

def _compile_sm90(dgrad: bool, block_n: int, num_stages: int, E: int, epilogue: str, dtype: torch.dtype):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    t = _TRITON_TYPES[dtype]
    lay = _smem_layout()
    w_box = [_BK, block_n] if dgrad else [block_n, _BK]
    constexprs = {"BLOCK_E": block_e(E), "NUM_STAGES": num_stages, "BN": block_n, "DGRAD": dgrad,
                  "TMA_OUT": epilogue == "tma"}
    sig = {"x_desc": f"tensordesc<{t}[{_HM}, {_BK}],{lay!r}>", "w_desc": f"tensordesc<{t}[{w_box[0]}, {w_box[1]}],{lay!r}>",
           "y_ptr": f"*{t}", "y_desc": f"tensordesc<{t}[{_HM}, {block_n}],{lay!r}>", "off_ptr": "*i32", "E": "i32",
           "M_cap": "i32", "NO": "i32", "KC": "i32", "NW": "i32", **{name: "constexpr" for name in constexprs}}
    src = GluonASTSource(fn=_grouped_gemm_16bit_kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": MAXNREG})


def compile_sm90_bf16(block_n: int = 128, num_stages: int | None = None, E: int = 32, epilogue: str = "pointer",
                      dtype: torch.dtype = torch.bfloat16):
    """Compile the forward kernel (``w`` K-major) for sm_90a without a GPU (``triton.compile`` of a
    ``GluonASTSource`` for ``GPUTarget("cuda", 90, 32)``, as ``gluon.py: compile_sm90``); returns triton's
    ``CompiledKernel`` (``.asm["ptx"]``, ``["cubin"]``, ``.metadata.shared``). ``num_stages`` default: the deepest
    ring of (block_n, epilogue). Tests and probes only; needs ``TRITON_INTERPRET`` unset when triton is imported."""
    st = MAX_STAGES[(block_n, epilogue)] if num_stages is None else num_stages
    return _compile_sm90(False, block_n, st, E, epilogue, dtype)


def compile_sm90_dgrad(block_n: int = 128, num_stages: int | None = None, E: int = 32, epilogue: str = "pointer",
                       dtype: torch.dtype = torch.bfloat16):
    """:func:`compile_sm90_bf16` for the dgrad layout (``w`` MN-major boxes)."""
    st = MAX_STAGES[(block_n, epilogue)] if num_stages is None else num_stages
    return _compile_sm90(True, block_n, st, E, epilogue, dtype)
