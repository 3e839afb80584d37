"""Gluon (``triton.experimental.gluon``, Triton 3.6) weight gradient of the bf16 / fp16 grouped GEMM on Hopper.

Contract (the wgrad of CONTRACT.md section 8, as ``triton_backward.py: grouped_gemm_wgrad_triton``)::

    d_w[e] = d_y[rows(e)].T @ x[rows(e)]        -> [E, N, K] out_dtype, float32 accumulation

* ``x [M_cap, K]`` and ``d_y [M_cap, N]`` bfloat16 or float16 (the same dtype), row-major contiguous;
* ``expert_offsets [E + 1]`` int32: expert ``e`` owns rows ``[s_e, t_e)`` with ``s_e = clamp(offsets[e], 0, M_cap)``
  and ``t_e = max(clamp(offsets[e + 1], 0, M_cap), s_e)``: the rows the Triton kernel gives it (decreasing offsets,
  a precondition violation not checked because that needs a host sync, give an expert no rows, as there). Rows
  outside ``[s_e, t_e)`` - unused capacity past ``offsets[E]``, rows before ``offsets[0]``, the other experts' rows -
  never reach ``d_w[e]``, whatever they hold (NaN included: they are removed with a select, never a multiply);
* ``out_dtype`` float32, bfloat16 or float16; ``d_w`` is allocated with ``torch.empty`` and every element is written
  exactly once; an expert with no rows gets exactly 0.

Refused on the host before any launch (messages name ``grouped_gemm_gluon_wgrad``, the argument, the expectation and
what came): ``TypeError`` for a wrong type or dtype (``x`` not bf16 / fp16, ``d_y`` not ``x``'s dtype, offsets not
int32, ``out_dtype`` not float32 / bf16 / fp16); ``ValueError`` for shapes (ranks, ``d_y`` rows vs ``x`` rows,
``expert_offsets`` not ``[E + 1]`` with ``E >= 1``), non-contiguous tensors, tensors on different devices, a base
address not 16-byte aligned (TMA), ``num_stages`` / ``epilogue`` out of range; ``NotImplementedError`` for what the
kernel's tiles do not serve (``N % 128 != 0``, ``K % 256 != 0``), for tensors off a CUDA device of compute
capability exactly (9, 0) (sm_90a: ``wgmma``, ``setmaxnreg``), and for ``M_cap`` or ``E * N`` of 2**31 or more (int32
TMA coordinates). ``moe_torch.grouped_gemm_wgrad(..., implementation="triton")`` runs this kernel only where
:func:`gluon_wgrad_eligible` says so (``EPMOE_TRITON_GLUON_WGRAD`` on: its default), else the Triton kernel; where
this GPU has a tuned ``"op": "wgrad"`` entry (``benchmarks/tune_triton_gemm.py --ops wgrad``) the dispatch runs the
kernel it measured faster, this one with the entry's ``epilogue`` / ``num_stages`` (:func:`tuned_wgrad_options`).

Design (a K-grouped GEMM: the contraction runs over each expert's rows; the forward's warp-specialized structure of
``gluon.py``, the roles of its operands changed):

* Work items: (expert ``e``, ``d_w`` tile of 128 rows of N x 256 columns of K), numbered expert by expert, the
  tiles of one expert adjacent (``pid_n`` major, ``pid_k`` minor): the ~132 concurrent programs mostly share one
  expert's rows of ``x`` and ``d_y`` (11.5 MB at the gate_up shape, E = 32, M = 16384) in L2. Static persistent grid
  ``min(#SMs, E * (N / 128) * (K / 256))``; every program walks items ``pid, pid + nprog, ...``. No host sync and
  no expert table (each item reads its two offsets): CUDA-graph capturable, no limit on ``E`` but ``E * N < 2**31``.
* Three partitions (``gl.warp_specialize``, as ``gluon.py``): a 4-warp producer (40 registers a thread) and two
  consumer warpgroups (232). Per contraction step of ``BLOCK_R = 64`` rows the producer TMA-loads one ``d_y`` box
  ``[64, 128]`` (rows x N columns; shared by both consumers) and two ``x`` boxes ``[64, 128]`` (rows x K columns;
  one per consumer) into a ring of ``NUM_STAGES`` stages (48 KiB each) with ``ready`` (TMA transaction bytes) and
  ``empty`` (count 2: one arrival per consumer) mbarriers. The steps of an expert start exactly at ``s_e`` (a TMA box
  may start at any row; rows past ``M_cap`` are zero-filled by TMA), so only the expert's last step can be ragged.
* Each consumer keeps a float32 accumulator 128 x 128 (N x its half of the K columns; 128 registers a thread) and
  issues ``wgmma`` with A = the ``d_y`` stage viewed transposed (``permute((1, 0))``: ``[128, 64]``, MN-major in
  shared memory, which 16-bit ``wgmma`` reads directly) and B = its ``x`` box ``[64, 128]`` (MN-major too), one
  ``wgmma`` group in flight: ``warpgroup_mma_wait(1)`` after issuing step ``j`` completes step ``j - 1``, whose
  stage is then released. No transposed copies in memory.
* The ragged last step (rows ``r >= t_e - m0`` of the box belong to another expert or to unused capacity): those rows
  are set to 0 in BOTH operands with ``gl.where`` (a NaN there must not reach the sum: 0 * NaN = NaN). Each consumer
  masks its OWN ``x`` box in shared memory (load, select, store, ``fence_async_shared``, partition barrier); the
  SHARED ``d_y`` box is never written: each consumer loads it into registers in the ``wgmma`` A-operand layout
  (``DotOperandLayout``), masks it there and runs that step's ``wgmma`` with A from registers. No two partitions
  write the same shared memory, and no extra barrier between the consumers is needed.
* Epilogue, ``epilogue="tma"`` (16-bit ``out_dtype``): each consumer casts its tile, writes it to its own 32 KiB
  shared buffer and issues a TMA store (``d_w`` viewed as ``[E * N, K]``), which runs while the consumer starts the
  next item's steps (``tma.store_wait(0)`` only before the buffer is written again). The two buffers (64 KiB) leave
  room for 3 stages. ``epilogue="pointer"`` (any ``out_dtype``, float32 included, 4 stages): masked-free pointer
  stores straight from the ``wgmma`` register layout, as ``gluon.py``'s epilogue. The ``e * N * K`` offsets of the
  pointer epilogue are int64 (2**31 is passed at E = 256, N = 7168, K = 2048).

Why this shape: the output is as large as the inputs here (gate_up: ``d_w`` 1.9 GB in bf16 against 0.37 GB of
``x`` and ``d_y``), and each tile contracts only ``M / E`` rows (512 at the benchmark shape: 8 steps), so the
epilogue is a large share of each item: the 128 x 256 CTA tile halves the ``d_y`` traffic into shared memory
against 128 x 128, and the TMA-store epilogue overlaps the stores with the next item's MMAs.

Sources read (no code copied): jax's ``jax/experimental/pallas/ops/gpu/transposed_ragged_dot_mgpu.py`` (the
K-grouped wgmma with the ragged first / last block masked in shared memory, there by a multiply and on one operand
only, which would let a NaN of a neighbouring row through: here a select on both), triton-lang/triton
``python/tutorials/gluon/08-warp-specialization.py`` (partitions, ring phases, TMA store epilogue with
``store_wait``), NVIDIA CUTLASS's Hopper warp-specialized persistent GEMMs (the producer / two consumer warpgroups
split, ``fence.proxy.async`` + barrier before a TMA store of shared memory written by threads), DeepGEMM
(``deep_gemm/include/deep_gemm/fp8_gemm.cuh``: TMA-store epilogue overlapped with the next tile), and this repo's
``gluon.py`` (whose partition budgets ``CONSUMER_REGS`` / ``PRODUCER_REGS`` / ``MAXNREG`` and ``_fail`` are reused).
CPU test (compile for sm_90a, refusals) and GPU tests: ``tests/test_gluon_wgrad.py``.

Why it is the default wgrad: faster than the Triton kernel and cuBLAS's grouped GEMM at the layer's shapes, and the
epilogue decides it (the TMA store with 3 stages against 2 stages or pointer stores); 168 registers (``MAXNREG``),
no spill, 208 KiB of shared memory with the TMA epilogue (3 stages). Timings: BENCHMARKS.md.
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

from moe_contract.selection import DeviceSpec
from moe_torch.ops.device import device_spec
from moe_torch.ops.grouped_gemm.config import tuned_wgrad_kernel
from moe_torch.ops.grouped_gemm.gluon import CONSUMER_REGS, MAXNREG, PRODUCER_REGS, _check_placement, _fail

OP = "grouped_gemm_gluon_wgrad"
TILE_N = gl.constexpr(128)  # d_w rows (N) of a work item
HALF_K = gl.constexpr(128)  # d_w columns (K) of one consumer; a work item has 2 * HALF_K
BLOCK_R = gl.constexpr(64)  # rows of x / d_y a contraction step
# the same sizes as host-side ints
_TN, _TK, _HK, _BR = 128, 256, 128, 64
_IN_DTYPES = (torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: ring depth bounds by epilogue: 48 KiB a stage; the TMA epilogue's two 128 x 128 16-bit buffers take 64 KiB
#: (Hopper: 227 KiB of shared memory a block)
_MAX_STAGES = {"tma": 3, "pointer": 4}
EPILOGUES = tuple(_MAX_STAGES)


def _smem_layout() -> gl.NVMMASharedLayout:
    """128-byte swizzle for the 16-bit [64, 128] input boxes and the [128, 128] output tile (rows of 256 bytes)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def _out_layout(out_dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=torch.finfo(out_dtype).bits, rank=2)


@gluon.jit
def _expert_rows(off_ptr, e, M_cap):
    """Rows ``[s_e, t_e)`` of expert ``e``: the offsets clamped to ``[0, M_cap]``, ``t_e >= s_e`` (as the Triton
    wgrad kernel: decreasing offsets give the expert no rows)."""
    s_e = gl.minimum(gl.maximum(gl.load(off_ptr + e), 0), M_cap)
    t_e = gl.maximum(gl.minimum(gl.maximum(gl.load(off_ptr + e + 1), 0), M_cap), s_e)
    return s_e, t_e


@gluon.jit
def _item_coords(item, per_e, n_k):
    """Work item -> (expert, first d_w row n0, first d_w column k0 of the CTA tile)."""
    e = item // per_e
    t = item % per_e
    return e, (t // n_k) * TILE_N, (t % n_k) * (2 * HALF_K)


@gluon.jit
def _wgrad_producer(dy_desc, x_desc, off_ptr, dy_bufs, x_bufs, ready, empty, E, M_cap, N, K,
                    NUM_STAGES: gl.constexpr):
    """The TMA partition: per step one ``d_y`` box and two ``x`` boxes (one per consumer) at rows ``m0``."""
    n_k = K // (2 * HALF_K)
    per_e = (N // TILE_N) * n_k
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    it = 0
    for item in range(pid, E * per_e, nprog):
        e, n0, k0 = _item_coords(item, per_e, n_k)
        s_e, t_e = _expert_rows(off_ptr, e, M_cap)
        for m0 in range(s_e, t_e, BLOCK_R):
            st = it % NUM_STAGES
            # mbarriers start in phase 0: waiting for parity 1 passes at once, so the ring starts empty.
            mbarrier.wait(empty.index(st), ((it // NUM_STAGES) & 1) ^ 1)
            bar = ready.index(st)
            mbarrier.expect(bar, dy_desc.block_type.nbytes + 2 * x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(dy_desc, [m0, n0], bar, dy_bufs.index(st))
            tma.async_copy_global_to_shared(x_desc, [m0, k0], bar, x_bufs.index(2 * st))
            tma.async_copy_global_to_shared(x_desc, [m0, k0 + HALF_K], bar, x_bufs.index(2 * st + 1))
            it += 1


@gluon.jit
def _wgrad_consumer(out_desc, out_ptr, off_ptr, dy_bufs, x_bufs, c_bufs, ready, empty, E, M_cap, N, K,
                    NUM_STAGES: gl.constexpr, TMA_OUT: gl.constexpr, WG: gl.constexpr):
    """One consumer warpgroup: columns ``[k0 + WG * 128, k0 + WG * 128 + 128)`` of every work item's tile."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_K, 16])
    a_reg: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    xblk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # a [64, 128] 16-bit box, 16 B a thread
    n_k = K // (2 * HALF_K)
    per_e = (N // TILE_N) * n_k
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    zero = gl.zeros([TILE_N, HALF_K], gl.float32, layout=mma)
    xr = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, xblk))  # box rows, for the x mask
    ar = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, a_reg))  # box rows as the A operand's K index
    r = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, mma))
    c = gl.arange(0, HALF_K, layout=gl.SliceLayout(0, mma))
    c_buf = c_bufs.index(WG)
    it = 0  # stages consumed so far (the producer's ``it``, in the same order)
    for item in range(pid, E * per_e, nprog):
        e, n0, k0 = _item_coords(item, per_e, n_k)
        s_e, t_e = _expert_rows(off_ptr, e, M_cap)
        n_rows = t_e - s_e
        n_full = n_rows // BLOCK_R
        acc = zero
        for j in range(n_full):
            st = it % NUM_STAGES
            mbarrier.wait(ready.index(st), (it // NUM_STAGES) & 1)
            acc = hopper.warpgroup_mma(dy_bufs.index(st).permute((1, 0)), x_bufs.index(2 * st + WG), acc,
                                       use_acc=True, is_async=True)
            # every wgmma but the one just issued has completed: step j - 1's stage is read
            acc = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            if j > 0:
                mbarrier.arrive(empty.index((it + NUM_STAGES - 1) % NUM_STAGES))
            it += 1
        acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        if n_full > 0:
            mbarrier.arrive(empty.index((it + NUM_STAGES - 1) % NUM_STAGES))
        rem = n_rows - n_full * BLOCK_R
        if rem > 0:
            # the ragged last step: rows >= rem of the box are another expert's or unused capacity (maybe NaN)
            st = it % NUM_STAGES
            mbarrier.wait(ready.index(st), (it // NUM_STAGES) & 1)
            xs = x_bufs.index(2 * st + WG)  # this consumer's own box: masked in place
            xv = xs.load(xblk)
            xs.store(gl.where((xr < rem)[:, None], xv, gl.zeros_like(xv)))
            hopper.fence_async_shared()
            gl.thread_barrier()
            a = dy_bufs.index(st).permute((1, 0)).load(a_reg)  # shared with the other consumer: masked in registers
            a = gl.where((ar < rem)[None, :], a, gl.zeros_like(a))
            acc = hopper.warpgroup_mma(a, xs, acc, use_acc=True, is_async=True)
            acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            mbarrier.arrive(empty.index(st))
            it += 1
        if TMA_OUT:
            tma.store_wait(0)  # the previous item's store has read this consumer's buffer
            gl.thread_barrier()
            c_buf.store(acc.to(out_desc.dtype))
            hopper.fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(out_desc, [e * N + n0, k0 + WG * HALF_K], c_buf)
        else:
            base = out_ptr + e.to(gl.int64) * N * K
            ptrs = base + (n0 + r).to(gl.int64)[:, None] * K + (k0 + WG * HALF_K + c)[None, :]
            gl.store(ptrs, acc.to(out_ptr.dtype.element_ty))
    if TMA_OUT:
        tma.store_wait(0)


@gluon.jit
def _grouped_gemm_wgrad_kernel(dy_desc, x_desc, out_desc, out_ptr, off_ptr, E, M_cap, N, K,
                               NUM_STAGES: gl.constexpr, TMA_OUT: gl.constexpr):
    dy_bufs = gl.allocate_shared_memory(dy_desc.dtype, [NUM_STAGES, BLOCK_R, HALF_K], dy_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [2 * NUM_STAGES, BLOCK_R, HALF_K], x_desc.layout)
    if TMA_OUT:
        c_bufs = gl.allocate_shared_memory(out_desc.dtype, [2, TILE_N, HALF_K], out_desc.layout)
    else:
        c_bufs = gl.allocate_shared_memory(gl.int8, [2, 8, 16], gl.NVMMASharedLayout(0, 8, 2))  # unused
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)  # the producer's expect + the TMA transaction bytes
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    gl.warp_specialize([
        (_wgrad_consumer, (out_desc, out_ptr, off_ptr, dy_bufs, x_bufs, c_bufs, ready, empty, E, M_cap, N, K,
                           NUM_STAGES, TMA_OUT, 0)),
        (_wgrad_consumer, (out_desc, out_ptr, off_ptr, dy_bufs, x_bufs, c_bufs, ready, empty, E, M_cap, N, K,
                           NUM_STAGES, TMA_OUT, 1)),
        (_wgrad_producer, (dy_desc, x_desc, off_ptr, dy_bufs, x_bufs, ready, empty, E, M_cap, N, K, NUM_STAGES)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------------------------------------------ host side

def _check_shapes(x, d_y, expert_offsets, out_dtype) -> tuple[int, int, int, int]:
    """Types, dtypes, ranks and shapes (no device needed); returns ``(M_cap, N, K, E)``."""
    tensors = {"x": x, "d_y": d_y, "expert_offsets": expert_offsets}
    for name, tns in tensors.items():
        if not isinstance(tns, torch.Tensor):
            _fail(TypeError, name, "a torch.Tensor", type(tns).__name__, OP)
    if x.dtype not in _IN_DTYPES:
        _fail(TypeError, "x", "of dtype torch.bfloat16 or torch.float16", x.dtype, OP)
    if d_y.dtype != x.dtype:
        _fail(TypeError, "d_y", f"of x's dtype {x.dtype}", d_y.dtype, OP)
    if expert_offsets.dtype != torch.int32:
        _fail(TypeError, "expert_offsets", "of dtype torch.int32", expert_offsets.dtype, OP)
    if out_dtype not in _OUT_DTYPES:
        _fail(TypeError, "out_dtype", "torch.float32, torch.bfloat16 or torch.float16", out_dtype, OP)
    for name, tns, rank in (("x", x, 2), ("d_y", d_y, 2), ("expert_offsets", expert_offsets, 1)):
        if tns.dim() != rank:
            _fail(ValueError, name, f"{rank}-D", f"shape {tuple(tns.shape)}", OP)
    M_cap, K = x.shape
    if d_y.shape[0] != M_cap:
        _fail(ValueError, "d_y", f"[M_cap, N] with M_cap = x.shape[0] = {M_cap}", f"shape {tuple(d_y.shape)}", OP)
    N = d_y.shape[1]
    E = expert_offsets.shape[0] - 1
    if E < 1:
        _fail(ValueError, "expert_offsets", "of shape [E + 1] with E >= 1", f"shape {tuple(expert_offsets.shape)}",
              OP)
    if N % _TN != 0 or N == 0:
        raise NotImplementedError(f"{OP}: d_y must have N = shape[1] a positive multiple of {_TN} (the kernel's "
                                  f"128-row d_w tiles), got N = {N}")
    if K % _TK != 0 or K == 0:
        raise NotImplementedError(f"{OP}: x must have K = shape[1] a positive multiple of {_TK} (the kernel's "
                                  f"256-column d_w tiles), got K = {K}")
    return M_cap, N, K, E


def check_inputs(x, d_y, expert_offsets, out_dtype) -> None:
    """Every host-side refusal, before any launch (module docstring)."""
    M_cap, N, K, E = _check_shapes(x, d_y, expert_offsets, out_dtype)
    _check_placement(OP, {"x": x, "d_y": d_y, "expert_offsets": expert_offsets}, M_cap, E, N, tma=("x", "d_y"),
                     en_rows="d_w")


#: The dispatch takes the Gluon wgrad only with ``M_cap >= WGRAD_MIN_ROWS_PER_EXPERT * E``: with few rows an expert
#: the Triton kernel measured faster, with many the Gluon one (BENCHMARKS.md).
WGRAD_MIN_ROWS_PER_EXPERT = 32


def gluon_wgrad_eligible(x, d_y, expert_offsets, out_dtype) -> bool:
    """Whether ``grouped_gemm_wgrad(..., implementation="triton")`` runs this request on the Gluon kernel:
    ``EPMOE_TRITON_GLUON_WGRAD`` on (the default), ``M_cap >=`` :data:`WGRAD_MIN_ROWS_PER_EXPERT` ``* E``, bf16 / fp16
    ``x`` and ``d_y`` of one dtype, int32 offsets, float32 / bf16 / fp16 out, ``N % 128 == 0``, ``K % 256 == 0``,
    every tensor contiguous, 16-byte aligned, on one CUDA device of compute capability (9, 0), ``M_cap`` and
    ``E * N`` below 2**31. Host-side only (no sync)."""
    from moe_torch.ops.triton_common import gluon_wgrad_enabled

    if not gluon_wgrad_enabled():
        return False
    if x.dim() == 2 and expert_offsets.dim() == 1 and x.shape[0] < WGRAD_MIN_ROWS_PER_EXPERT * (expert_offsets.shape[0] - 1):
        return False  # few rows an expert: the Triton kernel is faster there
    try:
        check_inputs(x, d_y, expert_offsets, out_dtype)
    except (TypeError, ValueError, NotImplementedError):
        return False
    return True


def gluon_wgrad_options_problem(epilogue: str | None, num_stages: int | None, out_dtype: torch.dtype) -> str | None:
    """Why ``epilogue`` / ``num_stages`` cannot serve a wgrad into ``out_dtype`` (``None``: they can; ``None`` values
    are :func:`grouped_gemm_gluon_wgrad`'s defaults): the rules it raises ``ValueError`` for."""
    ep = epilogue if epilogue is not None else ("pointer" if out_dtype == torch.float32 else "tma")
    if ep not in _MAX_STAGES:
        return f"epilogue must be 'tma' or 'pointer'; got {epilogue!r}"
    if ep == "tma" and out_dtype == torch.float32:
        return "epilogue 'tma' needs a 16-bit out_dtype; got torch.float32"
    if num_stages is not None and (type(num_stages) is not int or not 2 <= num_stages <= _MAX_STAGES[ep]):
        return f"num_stages must be an int in [2, {_MAX_STAGES[ep]}] with epilogue {ep!r}; got {num_stages!r}"
    return None


@functools.cache
def _tuned_options(M_cap: int, N: int, K: int, bits: int, out_dtype: torch.dtype, device: DeviceSpec | None
                   ) -> tuple[tuple[str, object], ...] | None:
    choice = tuned_wgrad_kernel(M_cap, N, K, bits, torch.finfo(out_dtype).bits, device)
    if choice is None:
        return ()
    kernel, options = choice
    if kernel == "triton":
        return None
    if gluon_wgrad_options_problem(options.get("epilogue"), options.get("num_stages"), out_dtype):
        return ()  # options this request cannot take (another out dtype's): the defaults
    return tuple(sorted(options.items()))


def tuned_wgrad_options(x: torch.Tensor, d_y: torch.Tensor, expert_offsets: torch.Tensor,
                        out_dtype: torch.dtype) -> dict | None:
    """The options of this kernel for a request :func:`gluon_wgrad_eligible` accepted, from the tuned ``"op":
    "wgrad"`` entry of ``x``'s GPU (``config.tuned_wgrad_kernel``: nearest ``M_cap``, same ``N``, ``K``, dtype, out
    dtype; written by ``benchmarks/tune_triton_gemm.py --ops wgrad``): ``None`` where the entry's winner is the
    Triton kernel (the dispatch then runs it); the entry's ``epilogue`` / ``num_stages`` where they keep
    :func:`gluon_wgrad_options_problem`, else ``{}`` (the defaults); ``{}`` without an entry. Host-side (no sync;
    cached per problem)."""
    options = _tuned_options(x.shape[0], d_y.shape[1], x.shape[1], torch.finfo(x.dtype).bits, out_dtype,
                             device_spec(x.device))
    return None if options is None else dict(options)


def grouped_gemm_gluon_wgrad(x: torch.Tensor, d_y: torch.Tensor, expert_offsets: torch.Tensor,
                             out_dtype: torch.dtype = torch.float32, *, epilogue: str | None = None,
                             num_stages: int | None = None, num_sms: int | None = None) -> torch.Tensor:
    """``d_w [E, N, K]`` ``out_dtype`` with ``d_w[e] = d_y[rows(e)].T @ x[rows(e)]`` (module docstring: contract,
    refusals, design).

    ``epilogue``: ``"tma"`` (16-bit ``out_dtype`` only; the default there: shared memory + TMA stores overlapped with
    the next work item) or ``"pointer"`` (pointer stores from registers; the default, and the only one, for float32
    out). ``num_stages``: the shared-memory ring depth (48 KiB a stage): 2..3 with ``"tma"`` (default 3), 2..4 with
    ``"pointer"`` (default 4). ``num_sms``: persistent programs (default: the device's SM count)."""
    check_inputs(x, d_y, expert_offsets, out_dtype)
    if epilogue is None:
        epilogue = "pointer" if out_dtype == torch.float32 else "tma"
    if epilogue not in _MAX_STAGES:
        _fail(ValueError, "epilogue", "'tma' or 'pointer'", repr(epilogue), OP)
    if epilogue == "tma" and out_dtype == torch.float32:
        _fail(ValueError, "epilogue", "'pointer' for out_dtype torch.float32 (two 128 x 128 float32 buffers of the "
              "TMA epilogue leave no room for the ring)", repr(epilogue), OP)
    max_st = _MAX_STAGES[epilogue]
    if num_stages is None:
        num_stages = max_st
    if type(num_stages) is not int or not 2 <= num_stages <= max_st:
        _fail(ValueError, "num_stages", f"an int in [2, {max_st}] with epilogue {epilogue!r} (48 KiB of shared "
              "memory a stage)", repr(num_stages), OP)
    M_cap, K = x.shape
    N = d_y.shape[1]
    E = expert_offsets.shape[0] - 1
    out = torch.empty((E, N, K), dtype=out_dtype, device=x.device)
    if M_cap == 0:
        return out.zero_()  # no rows at all (a TMA descriptor needs a non-empty tensor)
    if num_sms is None:
        num_sms = device_spec(x.device).sm_count
    lay = _smem_layout()
    dy_desc = TensorDescriptor.from_tensor(d_y, [_BR, _HK], lay)
    x_desc = TensorDescriptor.from_tensor(x, [_BR, _HK], lay)
    out_desc = TensorDescriptor.from_tensor(out.view(E * N, K), [_TN, _HK], _out_layout(out_dtype))
    items = E * (N // _TN) * (K // _TK)
    grid = (max(1, min(int(num_sms), items)),)
    _grouped_gemm_wgrad_kernel[grid](dy_desc, x_desc, out_desc, out, expert_offsets, E, M_cap, N, K,
                                     NUM_STAGES=num_stages, TMA_OUT=epilogue == "tma", num_warps=4, maxnreg=MAXNREG)
    return out


_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def compile_sm90_wgrad(dtype: torch.dtype = torch.bfloat16, out_dtype: torch.dtype = torch.bfloat16,
                       epilogue: str = "tma", num_stages: int | None = None):
    """Compile the kernel for sm_90a without a GPU (``triton.compile`` of a ``GluonASTSource`` for
    ``GPUTarget("cuda", 90, 32)``, as ``gluon.py: compile_sm90``); returns triton's ``CompiledKernel`` (``.asm["ptx"]``,
    ``["cubin"]``, ``.metadata.shared``). The kernel has no expert table: its code does not depend on ``E``. Tests and
    probes only; needs ``TRITON_INTERPRET`` unset when triton is imported."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    num_stages = _MAX_STAGES[epilogue] if num_stages is None else num_stages
    t_in, t_out = _TRITON_TYPES[dtype], _TRITON_TYPES[out_dtype]
    lay, lay_out = _smem_layout(), _out_layout(out_dtype)
    constexprs = {"NUM_STAGES": num_stages, "TMA_OUT": epilogue == "tma"}
    box = f"tensordesc<{t_in}[{_BR}, {_HK}],{lay!r}>"
    sig = {"dy_desc": box, "x_desc": box,
           "out_desc": f"tensordesc<{t_out}[{_TN}, {_HK}],{lay_out!r}>", "out_ptr": f"*{t_out}", "off_ptr": "*i32",
           "E": "i32", "M_cap": "i32", "N": "i32", "K": "i32", **{name: "constexpr" for name in constexprs}}
    src = GluonASTSource(fn=_grouped_gemm_wgrad_kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": MAXNREG})
