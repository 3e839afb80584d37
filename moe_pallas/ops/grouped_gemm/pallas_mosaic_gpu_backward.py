"""The grouped GEMM's backward in Pallas Mosaic GPU, for Hopper (CONTRACT.md section 8).

Forward (``pallas_mosaic_gpu.py``): ``y [M_cap, N] = x [M_cap, K] @ w[e(m)].T``, ``w [E, N, K]``.

- **dgrad** ``d_x[m] = d_y[m] @ w[e(m)]`` (``[M_cap, N] x [N, K] -> [M_cap, K]``) is the forward's
  kernel with the roles of N and K swapped: the same persistent grid over (row step, column tile),
  the same row metadata and store ladder (each row of ``d_x`` written exactly once, rows
  ``>= offsets[-1]`` as zeros, rows of ``d_y`` past them never read into a stored row). ``w[e]`` is
  read as it is: a TMA tile ``[block_k, block_n]`` of ``w[e]`` (``block_k`` rows along N, the
  contraction; ``block_n`` columns along K, the output) is already ``wgmma``'s ``[contraction, out]``
  B operand (MN-major, which 16-bit ``wgmma`` takes), so no transposed copy of the weights is made.
- **wgrad** ``d_w[e] = d_y[rows(e)].T @ x[rows(e)]`` (``-> [E, N, K]``), a K-grouped GEMM: one
  persistent kernel walks the work items ``(e, output tile)`` (``plgpu.nd_loop`` over ``E`` times a
  planar snake of ``N / block_m`` x ``K / block_n`` tiles, so the SMs running together share one
  expert's rows in L2). For each it streams the expert's rows in ``block_k``-row blocks
  ``[start_e // block_k, ceil(end_e / block_k))`` with TMA: a ``d_y`` tile ``[block_k, block_m]``
  (``wgmma``'s A operand, transposed in shared memory) and an ``x`` tile ``[block_k, block_n]`` (B,
  MN-major), float32 accumulator. In the first and last block, rows outside ``[start_e, end_e)``
  are replaced by zeros in shared memory in BOTH operands (a select, so a NaN in another expert's
  rows or in the unused capacity ``>= offsets[-1]`` never reaches the sum: ``0 * NaN`` would).
  An expert with no rows runs no block and stores its zero accumulator: exactly 0. Rows past
  ``M_cap`` are zero-filled by TMA.
- **warp-specialized wgrad** (``config.warp_specialized``, the heuristic's choice for 16-bit inputs where
  ``N % 128 == 0`` and ``K % 256 == 0``): the one-warpgroup wgrad is latency-bound (ncu profile in
  BENCHMARKS.md: each work item contracts only its expert's rows, a few pipeline steps, so the pipeline fill
  and the epilogue are exposed on every item). Here a **producer** warpgroup (``PRODUCER_REGISTERS``) walks the
  CTA's work items and their row blocks without a break and loads each step's ``d_y`` tile ``[block_k, block_m]``
  and two ``x`` tiles ``[block_k, block_n]`` into one of ``max_concurrent_steps`` slots; two **consumer**
  warpgroups own the two ``block_m x block_n`` halves of a ``block_m x 2*block_n`` tile of ``d_w[e]`` (the same
  ``d_y`` tile, their own ``x`` tile), keep one ``wgmma`` in flight, release a slot when the next step's ``wgmma``
  is issued, and store their half (TMA store from a per-consumer buffer) while the producer already loads the next
  item. A ragged step: each consumer masks its own ``x`` tile, consumer 0 the shared ``d_y`` tile, both fence and
  meet on a two-arrival barrier before either ``wgmma`` reads the slot (no two warpgroups write the same shared
  memory). Faster than the one-warpgroup kernel on both of the layer's shapes, near cuBLAS's grouped GEMM
  (BENCHMARKS.md).

Limits (``NotImplementedError``: the dispatch's default order then falls back to the Pallas-Triton
kernels; the warp-specialized wgrad's are in ``config.mosaic_wgrad_config_problem``): 16-bit float inputs only (no float32: ``wgmma`` would round to TF32; no FP8 weights in the
dgrad: Hopper's FP8 ``wgmma`` needs K-major operands and the straight-through dgrad dequantizes);
whole tiles (the dgrad: ``K % block_n``, ``N % block_k``; the wgrad: ``N % block_m``, ``K % block_n``).

Learned from jax-ml/jax@jax-v0.11.2:jax/experimental/pallas/ops/gpu/ragged_dot_mgpu.py (the
non-transposed B operand) and transposed_ragged_dot_mgpu.py (the wgrad's group loop and the masking
of the first and last block in shared memory; ours masks both operands by select, takes
``expert_offsets`` with unused capacity, and addresses blocks through the index map instead of an
out-of-bounds slice); the warp-specialized wgrad from hopper_matmul_mgpu.py's two compute warpgroups and this
project's ``pallas_mosaic_gpu_ws.py`` (a persistent producer running ahead across work items).

Mirror: none (a Hopper-only backend of ``moe_pallas``; ``moe_torch/ops/grouped_gemm/triton_backward.py``
is its peer).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_pallas.ops.grouped_gemm.config import (MosaicGroupedGemmConfig, gpu_device_spec, mosaic_config_problem,
                                                 mosaic_dgrad_config, mosaic_wgrad_config, mosaic_wgrad_config_problem)
from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu import num_sms, run_row_kernel
from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu_ws import CONSUMER_REGISTERS, CONSUMERS, PRODUCER_REGISTERS
from moe_pallas.ops.grouped_gemm.reference import expert_row_ranges

_FLOAT16 = (jnp.bfloat16, jnp.float16)


def _check_16bit(op: str, **arrays) -> None:
    for name, a in arrays.items():
        if a.dtype not in _FLOAT16:
            raise NotImplementedError(f"{op}: {name} must be bf16 or float16 (16-bit wgmma; float32 would run as "
                                      f"TF32, FP8 weights need the straight-through dequantization); got {a.dtype}")


def _transforms(minor: int, dtype) -> tuple:
    """Shared-memory tiling + swizzle for a tile whose last dim is ``minor`` elements of ``dtype``."""
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config"))
def grouped_gemm_dgrad_pallas_mosaic_gpu(
    d_y: jax.Array,
    w: jax.Array,
    expert_offsets: jax.Array,
    *,
    out_dtype=None,
    config: MosaicGroupedGemmConfig | None = None,
) -> jax.Array:
    """``d_x[m] = d_y[m] @ w[e(m)]`` on Hopper, float32 accumulation.

    Args (validated by ``moe_pallas.ops.grouped_gemm.api.grouped_gemm_dgrad``):
      d_y: ``[M_cap, N]`` bf16 / float16.
      w: ``[E, N, K]``, ``d_y``'s dtype, read as it is.
      expert_offsets: ``[E + 1]`` int32; rows ``>= offsets[-1]`` come out zero.
      out_dtype: default ``d_y.dtype``.
      config: ``block_m`` rows x ``block_n`` output columns (along K), ``block_k`` contraction (along N)
        per step; default :func:`~moe_pallas.ops.grouped_gemm.config.mosaic_dgrad_config`: this GPU's tuned
        ``"op": "dgrad"`` entry (``benchmarks/tune_jax_gemm.py --ops dgrad``; nearest ``M_cap``, same ``N``, ``K``,
        dtype, out dtype) where one is stored and keeps the kernel's rules, else
        :func:`heuristic_mosaic_grouped_gemm_config` of the swapped problem. An explicit ``config`` wins.

    Returns: ``d_x [M_cap, K]``, every row written exactly once.

    Raises: NotImplementedError (float32 or FP8 inputs; ``K % block_n`` or ``N % block_k``).
    """
    op = "grouped_gemm_dgrad[pallas_mosaic_gpu]"
    _check_16bit(op, d_y=d_y, w=w)
    M_cap, N = d_y.shape
    E, _, K = w.shape
    out_dtype = d_y.dtype if out_dtype is None else jnp.dtype(out_dtype)
    # the device kind is read on the host at trace time (None on the CPU: the heuristic)
    device = gpu_device_spec()
    cfg = config or mosaic_dgrad_config(M_cap, N, K, E, d_y.dtype.itemsize, out_itemsize=jnp.dtype(out_dtype).itemsize,
                                        device=device)
    problem = mosaic_config_problem(cfg, K, N, d_y.dtype.itemsize, False, op=op, out_itemsize=jnp.dtype(out_dtype).itemsize,
                                    dgrad=True, device=device)
    if problem:
        raise NotImplementedError(problem)
    if M_cap == 0 or K == 0:
        return jnp.zeros((M_cap, K), out_dtype)
    if N == 0 or E == 0:  # a sum of no terms / no expert owns a row
        return jnp.zeros((M_cap, K), out_dtype)
    return run_row_kernel(d_y, w, expert_offsets, [], N_out=K, K_contract=N, x_kind=None, w_kind=None, cfg=cfg,
                          out_dtype=out_dtype, dgrad=True)


def _wgrad_kernel(bounds, x_gmem, dy_gmem, o_gmem, *, E: int, N: int, K: int, cfg: MosaicGroupedGemmConfig):
    """The one-warpgroup wgrad; ``bounds [2, E]`` int32: expert ``e`` owns rows ``[bounds[0, e], bounds[1, e])``."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    grid_m, grid_n = N // bm, K // bn
    dtype = x_gmem.dtype
    dy_tf, x_tf = _transforms(bm, dtype), _transforms(bn, dtype)
    release = 1 if cfg.max_concurrent_steps > 1 else 0

    @plgpu.nd_loop((E, grid_m * grid_n), collective_axes="sm")
    def _work(info: plgpu.NDLoopInfo):
        e = info.index[0]
        mi, ni = plgpu.planar_snake(info.index[1], (grid_m, grid_n), 1, cfg.grid_block_n)
        start, end = bounds[0, e], bounds[1, e]
        first = lax.div(start, jnp.int32(bk))
        n_blocks = jnp.where(end > start, lax.div(end + (bk - 1), jnp.int32(bk)) - first, 0)

        def mask_rows(smem, row0, width: int) -> None:
            """Zero the rows of a ``[bk, width]`` tile outside ``[start, end)`` (a select: NaN-safe)."""
            tile = smem[...]
            rows = row0 + plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (bk, width), 0), plgpu.Layout.WGMMA)
            keep = (rows >= start) & (rows < end)
            smem[...] = jnp.where(keep, tile, jnp.zeros_like(tile))

        def acc_scope(acc_ref):
            def step(idx, dy_smem, x_smem):
                (r,) = idx
                row0 = (first + r) * bk

                @pl.when((row0 < start) | (row0 + bk > end))  # the expert's first or last block, when ragged
                def _():
                    mask_rows(dy_smem, row0, bm)
                    mask_rows(x_smem, row0, bn)
                    plgpu.commit_smem()

                plgpu.wgmma(acc_ref, dy_smem.transpose((1, 0)), x_smem)
                if release == 0:  # one buffer: the next TMA load must wait for this wgmma
                    plgpu.wgmma_wait(0)

            @pl.when(n_blocks > 0)
            def _():
                plgpu.emit_pipeline(
                    step,
                    grid=(n_blocks,),
                    in_specs=[
                        plgpu.BlockSpec((bk, bm), lambda r: (first + r, mi), delay_release=release, transforms=dy_tf),
                        plgpu.BlockSpec((bk, bn), lambda r: (first + r, ni), delay_release=release, transforms=x_tf),
                    ],
                    max_concurrent_steps=cfg.max_concurrent_steps,
                )(dy_gmem, x_gmem)

            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn), jnp.float32))

        def store(o_smem):
            o_smem[...] = acc.astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[e, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pl.run_scoped(store, plgpu.SMEM((bm, bn), o_gmem.dtype, transforms=_transforms(bn, o_gmem.dtype)))


def _wgrad_kernel_ws(bounds, x_gmem, dy_gmem, o_gmem, *, E: int, N: int, K: int, cfg: MosaicGroupedGemmConfig):
    """The warp-specialized wgrad: a producer warpgroup streams each work item's row blocks (one ``d_y`` tile
    ``[bk, bm]`` and two ``x`` tiles ``[bk, bn]`` a step) into ``stages`` shared-memory slots without a break between
    items; two consumer warpgroups each own ``bm x bn`` of the CTA's ``bm x 2*bn`` tile of ``d_w[e]`` (the same
    ``d_y`` tile, their own ``x`` tile) and store it while the producer already loads the next item."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    stages = cfg.max_concurrent_steps
    grid_m, grid_n = N // bm, K // (CONSUMERS * bn)
    tiles = grid_m * grid_n
    dtype = x_gmem.dtype

    def item(index):
        """Work item ``index`` (experts in order, a planar snake over one expert's tiles): the expert, its rows and
        first row block, its number of row blocks (0 for an empty expert), the tile's row / column indices."""
        e = lax.div(index, jnp.int32(tiles))
        mi, ni = plgpu.planar_snake(lax.rem(index, jnp.int32(tiles)), (grid_m, grid_n), 1, cfg.grid_block_n)
        start, end = bounds[0, e], bounds[1, e]
        first = lax.div(start, jnp.int32(bk))
        n_blocks = jnp.where(end > start, lax.div(end + (bk - 1), jnp.int32(bk)) - first, 0)
        return e, start, end, first, n_blocks, mi, ni

    def scoped(dy_smem, x_smem, o_smem, produced, consumed, masked):
        wg = lax.axis_index("wg")

        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            @plgpu.nd_loop((E * tiles,), collective_axes="sm", init_carry=jnp.int32(0))
            def _items(info: plgpu.NDLoopInfo, carry):
                e, start, end, first, n_blocks, mi, ni = item(info.index[0])

                @pl.loop(0, n_blocks)
                def _r(r):
                    count = carry + r
                    slot = lax.rem(count, stages)

                    @pl.when(count >= stages)  # the slot's previous step consumed by both consumers
                    def _():
                        plgpu.barrier_wait(consumed.at[slot])

                    rows = pl.ds((first + r) * bk, bk)  # past the padded rows: zero-filled by TMA, masked anyway
                    plgpu.copy_gmem_to_smem(dy_gmem.at[rows, pl.ds(mi * bm, bm)], dy_smem.at[slot], produced.at[slot])
                    for c in range(CONSUMERS):
                        plgpu.copy_gmem_to_smem(x_gmem.at[rows, pl.ds((ni * CONSUMERS + c) * bn, bn)],
                                                x_smem.at[slot, c], produced.at[slot])

                return carry + n_blocks

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")

            @plgpu.nd_loop((E * tiles,), collective_axes="sm", init_carry=jnp.int32(0))
            def _items(info: plgpu.NDLoopInfo, carry):
                e, start, end, first, n_blocks, mi, ni = item(info.index[0])

                def mask_rows(smem, row0, width: int) -> None:
                    """Zero the rows of a ``[bk, width]`` tile outside ``[start, end)`` (a select: NaN-safe)."""
                    tile = smem[...]
                    rows = row0 + plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (bk, width), 0), plgpu.Layout.WGMMA)
                    smem[...] = jnp.where((rows >= start) & (rows < end), tile, jnp.zeros_like(tile))

                def acc_scope(acc_ref):
                    @pl.loop(0, n_blocks)
                    def _r(r):
                        slot = lax.rem(carry + r, stages)
                        row0 = (first + r) * bk
                        plgpu.barrier_wait(produced.at[slot])

                        @pl.when((row0 < start) | (row0 + bk > end))  # the expert's first or last block, when ragged
                        def _():
                            # each consumer its own x tile; consumer 0 the shared d_y tile, then both meet on
                            # `masked` (fenced writes before the arrival) before either wgmma reads the slot
                            mask_rows(x_smem.at[slot, wg], row0, bn)

                            @pl.when(wg == 0)
                            def _():
                                mask_rows(dy_smem.at[slot], row0, bm)

                            plgpu.commit_smem()
                            plgpu.barrier_arrive(masked.at[0])
                            plgpu.barrier_wait(masked.at[0])

                        plgpu.wgmma(acc_ref, dy_smem.at[slot].transpose((1, 0)), x_smem.at[slot, wg])
                        plgpu.wgmma_wait(1)  # the previous step's wgmma done: its slot is free

                        @pl.when(r > 0)
                        def _():
                            plgpu.barrier_arrive(consumed.at[lax.rem(carry + r - 1, stages)])

                    @pl.when(n_blocks > 0)
                    def _():
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(consumed.at[lax.rem(carry + n_blocks - 1, stages)])

                    return acc_ref[...]

                acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn), jnp.float32))  # zeros for an empty expert
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this consumer's previous store has read o_smem
                o_smem.at[wg][...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[e, pl.ds(mi * bm, bm),
                                                                  pl.ds((ni * CONSUMERS + wg) * bn, bn)])
                return carry + n_blocks

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # every store out before the kernel ends

    pl.run_scoped(
        scoped,
        plgpu.SMEM((stages, bk, bm), dtype, transforms=_transforms(bm, dtype)),
        plgpu.SMEM((stages, CONSUMERS, bk, bn), dtype, transforms=_transforms(bn, dtype)),
        plgpu.SMEM((CONSUMERS, bm, bn), o_gmem.dtype, transforms=_transforms(bn, o_gmem.dtype)),
        plgpu.Barrier(num_arrivals=1 + CONSUMERS, num_barriers=stages),  # a step's d_y tile and x tiles landed
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # both consumers done with a step's slot
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=1),  # a ragged step's tiles masked by both consumers
        collective_axes="wg",
    )


@functools.partial(jax.jit, static_argnames=("out_dtype", "config"))
def grouped_gemm_wgrad_pallas_mosaic_gpu(
    x: jax.Array,
    d_y: jax.Array,
    expert_offsets: jax.Array,
    *,
    out_dtype=jnp.float32,
    config: MosaicGroupedGemmConfig | None = None,
) -> jax.Array:
    """``d_w[e] = d_y[rows(e)].T @ x[rows(e)]`` on Hopper, float32 accumulation; an expert with no rows gets 0.

    Args (validated by ``moe_pallas.ops.grouped_gemm.api.grouped_gemm_wgrad``):
      x: ``[M_cap, K]`` bf16 / float16 (the forward's input).
      d_y: ``[M_cap, N]``, ``x``'s dtype.
      expert_offsets: ``[E + 1]`` int32; rows ``>= offsets[-1]`` are never read into ``d_w``.
      out_dtype: default float32 (bf16 / float16 / float32).
      config: ``block_m`` x ``block_n`` tile of ``d_w[e]`` (along N, K), ``block_k`` rows per step
        (``warp_specialized``: two such tiles side by side a CTA); default
        :func:`~moe_pallas.ops.grouped_gemm.config.mosaic_wgrad_config`: this GPU's tuned ``"op": "wgrad"`` entry
        (``benchmarks/tune_jax_gemm.py --ops wgrad``; nearest ``M_cap``, same ``N``, ``K``, dtype, out dtype) where
        one is stored and keeps the kernel's rules, else :func:`heuristic_mosaic_wgrad_config`. An explicit
        ``config`` wins.

    Returns: ``d_w [E, N, K]`` in ``out_dtype``.

    Raises: NotImplementedError (float32 inputs; ``N % block_m`` or ``K % block_n``; warp-specialized:
    ``K % (2 * block_n)``, ``split_m``, fewer than 2 stages, over the shared memory of an sm_90 CTA).
    """
    op = "grouped_gemm_wgrad[pallas_mosaic_gpu]"
    _check_16bit(op, x=x, d_y=d_y)
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise NotImplementedError(f"{op}: out_dtype must be bf16, float16 or float32; got {out_dtype}")
    M_cap, K = x.shape
    N = d_y.shape[1]
    E = expert_offsets.shape[0] - 1
    device = gpu_device_spec()  # read on the host at trace time (None on the CPU: the heuristic, sm_90's limits)
    cfg = config or mosaic_wgrad_config(M_cap, N, K, E, x.dtype.itemsize, out_dtype.itemsize, device=device)
    problem = mosaic_wgrad_config_problem(cfg, N, K, x.dtype.itemsize, out_dtype.itemsize, device=device)
    if problem:
        raise NotImplementedError(problem)
    if M_cap == 0 or N == 0 or K == 0 or E == 0:
        return jnp.zeros((E, N, K), out_dtype)
    # One whole [2, E] buffer, never `ends` itself: expert_row_ranges' ends = offsets[1:] is a slice at a 4-byte
    # offset, which XLA may hand the custom call as a view into the offsets' buffer, and a Mosaic GPU kernel refuses
    # any operand that does not start 256-byte aligned. The stack is a concatenate: XLA allocates its own buffer.
    bounds = jnp.stack(expert_row_ranges(expert_offsets, M_cap)).astype(jnp.int32)
    # TMA boxes tile rows by 8: pad the row count (the pad rows belong to no expert and are masked).
    m_rows = -(-M_cap // 8) * 8
    if m_rows != M_cap:
        x = jnp.pad(x, ((0, m_rows - M_cap), (0, 0)))
        d_y = jnp.pad(d_y, ((0, m_rows - M_cap), (0, 0)))
    ws = cfg.warp_specialized
    kernel = functools.partial(_wgrad_kernel_ws if ws else _wgrad_kernel, E=E, N=N, K=K, cfg=cfg)
    threads = dict(num_threads=CONSUMERS + 1, thread_name="wg") if ws else {}
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((E, N, K), out_dtype),
        grid=(num_sms(),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **threads,
    )(bounds, x, d_y)
