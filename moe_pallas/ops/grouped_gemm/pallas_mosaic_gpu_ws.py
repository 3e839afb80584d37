"""Warp-specialized Hopper grouped GEMM in Pallas Mosaic GPU: the forward (16-bit or FP8, every scale layout, bias)
and the 16-bit dgrad.

The schedule of ``pallas_mosaic_gpu.py`` (a persistent ``nd_loop`` over (row step, column tile) from
:func:`~moe_pallas.ops.grouped_gemm.pallas_triton.tile_metadata`, with expert-aligned tiles by default
(``row_align=8``: an expert's tiles start at its first row rounded down to 8, not on the global ``t * block_m``
grid, so no tile is spent on a few rows an expert shares with its neighbour; ``EPMOE_PALLAS_ALIGNED_TILES=0``: the
global grid), the
power-of-two TMA store ladder
that writes exactly the rows ``[lo, hi)`` of a step), with the work of a CTA split over three
warpgroups (``MosaicGroupedGemmConfig.warp_specialized``):

- a **producer** warpgroup (40 registers) walks the CTA's work items and their K steps without a break and issues
  the TMA loads of a step (the CTA's ``x`` tile and weight tile) into one of ``max_concurrent_steps`` shared-memory
  slots, after both consumers released the slot (a ``consumed`` mbarrier of two arrivals; the loads land on the
  slot's ``produced`` mbarrier). The loads of the next work item start while the consumers finish the current one
  (``plgpu.emit_pipeline_warp_specialized`` runs one pipeline a work item: drained and refilled);
- two **consumer** warpgroups (232 registers) walk the same items, keeping the same running step count (so both
  sides agree on a step's slot), each with a ``[block_m, block_n]`` float32 accumulator: one half of the CTA tile,
  run the ``wgmma`` s, release the slot, then the epilogue of their half. The CTA tile is ``block_m x 2*block_n``
  (the consumers split its columns: the same ``x`` tile, their own weight columns) or, with ``split_m``,
  ``2*block_m x block_n`` (they split its rows: the same weight tile): per K step ``(2*block_m + block_n) * block_k``
  values loaded instead of ``(block_m + 2*block_n) * block_k`` for as many outputs, 20% fewer at 64 x 128. The
  producer's loads are what the FP8 kernel waited on (ncu: consumers stalled on the ``produced`` barrier, L2-bound
  below the tensor pipes' rate; BENCHMARKS.md).

FP8 (``x``, ``w`` float8_e4m3fn codes, CONTRACT.md section 4): with per-step accumulation (the default; per-token-group
``x`` scales and 128 x 128 weight blocks need it) each consumer ``wgmma`` s every K block of 128 into a fresh
accumulator and adds it, times that block's scales (:func:`step_scale`), to its float32 register tile ("promotion",
DeepSeek-V3 arXiv:2412.19437 section 3.3.2). The wait for a consumer's own ``wgmma`` does not stall the tensor cores:
the other consumer's ``wgmma`` s run while it promotes (DeepGEMM's two math warpgroups on sm_90). With
``block_k = 256`` a pipeline step holds two K blocks: both ``wgmma`` s are issued at once, the first is awaited with the
second still in flight (``plgpu.wgmma_accumulator_load(wait_n=1)``), and its promotion overlaps the second's MMA.
Registers: the float32 tile and one partial a K block of a step, ``block_m * block_n <= 64 * 128`` (3 x 64 of the 232
a consumer thread gets). ``fast_accum=True`` (per-tensor / per-token ``x`` with per-expert / per-channel ``w``): one
accumulator over K. The scales applied once (per-tensor, per-token by ROW; per-expert, per-channel) and the float32
``bias [E, N]`` follow in :func:`scale_epilogue`, shared with the one-warpgroup kernel.

The forward reads a weight tile ``[cta_n, block_k]`` of ``w[e]`` (K-major, transposed in shared
memory into ``wgmma``'s B operand, which FP8 ``wgmma`` needs); the dgrad (``x`` is ``d_y``, ``w[e]`` read as
``[N, K]`` = ``[contraction, out]``) a tile ``[block_k, cta_n]`` used as it is (MN-major B; 16-bit only).
``N_out % cta_n == 0`` (:func:`~moe_pallas.ops.grouped_gemm.config.ws_cta_tile`). With one accumulator (16-bit,
``fast_accum``) a consumer keeps one step's ``wgmma`` in flight and releases the previous step's slot.

Learned from jax-ml/jax@jax-v0.11.2:jax/experimental/pallas/ops/gpu/hopper_matmul_mgpu.py (the
warp-specialized pipeline with a compute context, two compute warpgroups splitting N, per-warpgroup
epilogue buffers), jax/experimental/pallas/ops/gpu/attention_mgpu.py (a hand-written producer warpgroup with
per-slot TMA and consumed barriers, ``set_max_registers``) and deepseek-ai/DeepGEMM (sm90 FP8 GEMM: per-K-block
promotion in two math warpgroups, a persistent producer); the ragged rows, the zero group, the store ladder, the
two-K-block step and the row split over ragged experts are ours.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_pallas.ops.common import aligned_tiles_enabled
from moe_pallas.ops.grouped_gemm.config import (SCALE_BLOCK, MosaicGroupedGemmConfig, accumulates_per_step,
                                                ws_cta_tile)
from moe_pallas.ops.grouped_gemm.pallas_triton import tile_metadata

#: Registers of the producer warpgroup (hopper_matmul_mgpu.py's value for H100-class GPUs).
PRODUCER_REGISTERS = 40
#: With ``EPMOE_PALLAS_ALIGNED_TILES`` on (the default), tiles start at each expert's first row rounded down to this
#: (``tile_metadata(row_align=)``): TMA boxes tile rows by 8.
ROW_ALIGN = 8
#: Consumer warpgroups per CTA.
CONSUMERS = 2
#: Registers of a consumer thread: the rest of the 64K register file, a multiple of 8 (hopper_matmul_mgpu.py's split).
CONSUMER_REGISTERS = min(255, (65536 // 128 - PRODUCER_REGISTERS) // CONSUMERS) // 8 * 8


def _transforms(minor: int, dtype) -> tuple:
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def _store_rows(tile, o_gmem, row0, lo, hi, n0, block_m: int, block_n: int, o_smem) -> None:
    """Rows ``[lo, hi)`` of ``tile [block_m, block_n]`` to ``o_gmem[:, n0:n0+block_n]`` through ``o_smem``
    (the previous item's stores from it must have been read: waited by the caller), one TMA store of
    ``2^i`` rows per set bit of ``hi - lo``."""
    o_smem[...] = tile
    plgpu.commit_smem()
    start = lo - row0
    count = hi - lo
    for bit in reversed(range(block_m.bit_length())):
        rows = 1 << bit

        @pl.when((count & rows) != 0)
        def _():
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, rows)], o_gmem.at[pl.ds(row0 + start, rows), pl.ds(n0, block_n)])

        start = start + (count & rows)


def scale_epilogue(acc: jax.Array, *, x_kind, w_kind, xs_gmem, ws_gmem, b_gmem, row0, n0, e_w, block_m: int,
                   block_n: int) -> jax.Array:
    """The float32 epilogue of a ``[block_m, block_n]`` tile (rows from ``row0``, columns from ``n0``, expert
    ``e_w``) before the one rounding: the scales applied once per tile (per-tensor ``xs_gmem [1]`` or per-token
    ``[m_pad]`` by ROW; per-expert ``ws_gmem [E]`` or per-channel ``[E, N]``; the per-step kinds were applied in
    the K loop), then the per-expert bias ``b_gmem [E, N]`` (float32). Vectors are loaded in the ``wgmma``
    accumulator's row (``reduce(1)``) / column (``reduce(0)``) layout. Shared by both Mosaic GPU kernels."""
    if x_kind == "per_tensor":
        acc = acc * xs_gmem[0]
    elif x_kind == "per_token":  # by ROW (never by expert)
        sx = plgpu.load(xs_gmem.at[pl.ds(row0, block_m)], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
        acc = acc * lax.broadcast_in_dim(sx, (block_m, block_n), [0])
    if w_kind == "per_expert":
        acc = acc * ws_gmem[e_w]
    elif w_kind == "per_channel":
        sw = plgpu.load(ws_gmem.at[e_w, pl.ds(n0, block_n)], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
        acc = acc * lax.broadcast_in_dim(sw, (block_m, block_n), [1])
    if b_gmem is not None:  # after the scales, before the one rounding; loaded as the per-channel scale above
        b = plgpu.load(b_gmem.at[e_w, pl.ds(n0, block_n)], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
        acc = acc + lax.broadcast_in_dim(b, (block_m, block_n), [1])
    return acc


def load_step_scales(k, *, x_kind, w_kind, xs_gmem, ws_gmem, row0, n0, e_w, block_m: int, block_n: int):
    """The global loads of K block ``k``'s scales, ``(sx, sw)`` (each ``None`` when it does not change along K): the
    per-token-group activation scales ``xs_gmem [K // 128, m_pad]`` of the tile's rows (``[block_m]``, in the
    ``wgmma`` accumulator's row layout) and the 128 x 128 weight block's scale ``ws_gmem [E, N / 128, K / 128]``
    (one scalar: the tile's ``block_n`` columns lie in one weight block). :func:`step_scale` combines them."""
    sx = sw = None
    if x_kind == "per_token_group":  # row-contiguous per K group
        sx = plgpu.load(xs_gmem.at[k, pl.ds(row0, block_m)], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    if w_kind == "block":
        sw = ws_gmem[e_w, lax.div(n0, jnp.int32(SCALE_BLOCK)), k]
    return sx, sw


def step_scale(k, *, block_m: int, block_n: int, loaded=None, **where):
    """The multiplier of K step ``k``'s partial product (``None`` when no scale changes along K): ``sx * sw`` of
    :func:`load_step_scales` (``loaded``, or loaded here), the row scales broadcast to ``[block_m, block_n]``.
    Loaded before the step's ``wgmma`` so that the global loads run while it does (the warp-specialized kernel loads
    them one step ahead). Shared by both Mosaic GPU kernels."""
    sx, sw = loaded if loaded is not None else load_step_scales(k, block_m=block_m, block_n=block_n, **where)
    scale = sx if sw is None else (sw if sx is None else sx * sw)
    if scale is not None and scale.ndim == 1:
        scale = lax.broadcast_in_dim(scale, (block_m, block_n), [0])
    return scale


def _kernel(step_e, step_lo, step_hi, x_gmem, w_gmem, *refs, E: int, N: int, K: int, cfg: MosaicGroupedGemmConfig,
            dgrad: bool, x_kind=None, w_kind=None, has_bias: bool = False, row_align: int | None = None):
    *refs, o_gmem = refs
    b_gmem = refs.pop() if has_bias else None
    xs_gmem, ws_gmem = refs if x_kind is not None else (None, None)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    cta_m, cta_n = ws_cta_tile(cfg)
    stages = cfg.max_concurrent_steps
    n_steps = step_e.shape[0]
    grid_n = N // cta_n
    k_steps = K // bk
    dtype, out_dtype = x_gmem.dtype, o_gmem.dtype
    # FP8 accumulates K step by K step into float32 registers unless fast_accum; per-step scales need it anyway
    per_step = accumulates_per_step(dtype.itemsize, x_kind == "per_token_group" or w_kind == "block", cfg)
    halves = bk // SCALE_BLOCK if per_step else 1  # K blocks of 128 a pipeline step: 1, or 2 (block_k = 256)

    def item(index):
        """The work item ``index`` of the planar snake: (expert, rows [lo, hi), CTA row0, CTA n0, addressing expert),
        computed alike by the producer and the consumers (the same sequence of items a CTA)."""
        si, ni = plgpu.planar_snake(index, (n_steps, grid_n), 1, cfg.grid_block_n)
        e, lo, hi = step_e[si], step_lo[si], step_hi[si]
        tile_rows = row_align or cta_m  # expert-aligned tiles start at lo's multiple of row_align, else of cta_m
        return e, lo, hi, lax.div(lo, jnp.int32(tile_rows)) * tile_rows, ni * cta_n, jnp.minimum(e, E - 1)

    def scoped(x_smem, w_smem, o_smem, produced, consumed):
        wg = lax.axis_index("wg")

        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            @plgpu.nd_loop((n_steps * grid_n,), collective_axes="sm", init_carry=jnp.int32(0))
            def _items(info: plgpu.NDLoopInfo, carry):
                e, lo, hi, row0, n0, e_w = item(info.index[0])
                active = (lo < hi) & (e < E)

                @pl.when(active)
                def _():
                    @pl.loop(0, k_steps)
                    def _k(k):
                        count = carry + k
                        slot = lax.rem(count, stages)

                        @pl.when(count >= stages)  # the slot's previous step consumed by both consumers
                        def _():
                            plgpu.barrier_wait(consumed.at[slot])

                        ks = pl.ds(k * bk, bk)
                        plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(row0, cta_m), ks], x_smem.at[slot], produced.at[slot])
                        w_tile = (w_gmem.at[e_w, ks, pl.ds(n0, cta_n)] if dgrad
                                  else w_gmem.at[e_w, pl.ds(n0, cta_n), ks])
                        plgpu.copy_gmem_to_smem(w_tile, w_smem.at[slot], produced.at[slot])

                return carry + jnp.where(active, k_steps, 0)

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")

            @plgpu.nd_loop((n_steps * grid_n,), collective_axes="sm", init_carry=jnp.int32(0))
            def _items(info: plgpu.NDLoopInfo, carry):
                e, lo, hi, row0, n0, e_w = item(info.index[0])
                active = (lo < hi) & (e < E)
                if cfg.split_m:  # this consumer's rows of the CTA tile, all its columns
                    my_row0, my_n0 = row0 + wg * bm, n0
                    my_lo = jnp.clip(lo, my_row0, my_row0 + bm)
                    my_hi = jnp.clip(hi, my_row0, my_row0 + bm)
                else:  # all rows, this consumer's columns
                    my_row0, my_n0, my_lo, my_hi = row0, n0 + wg * bn, lo, hi
                where = dict(x_kind=x_kind, w_kind=w_kind, xs_gmem=xs_gmem, ws_gmem=ws_gmem, row0=my_row0, n0=my_n0,
                             e_w=e_w, block_m=bm, block_n=bn)

                def operands(slot, k_slice=slice(None)):  # wgmma's A [block_m, contraction], B [contraction, block_n]
                    rows = pl.ds(wg * bm, bm) if cfg.split_m else slice(None)
                    cols = slice(None) if cfg.split_m else pl.ds(wg * bn, bn)
                    w_slot = w_smem.at[slot]
                    b = w_slot.at[k_slice, cols] if dgrad else w_slot.at[cols, k_slice].transpose((1, 0))
                    return x_smem.at[slot].at[rows, k_slice], b

                def store(acc):
                    acc = scale_epilogue(acc, b_gmem=b_gmem, **where)
                    tile = acc.astype(out_dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this consumer's previous stores read
                    _store_rows(tile, o_gmem, my_row0, my_lo, my_hi, my_n0, bm, bn, o_smem.at[wg])

                # split_m: a consumer whose half of the CTA tile holds none of the item's rows (an expert's first or
                # last tile) runs no wgmma and stores nothing; it releases each step's slot once it landed
                mine = active & (my_lo < my_hi) if cfg.split_m else active

                if cfg.split_m:
                    @pl.when(active & (my_lo >= my_hi))
                    def _():
                        @pl.loop(0, k_steps)
                        def _k(k):
                            slot = lax.rem(carry + k, stages)
                            # waited first: both consumers' releases of the slot's previous step came before the
                            # producer refilled it, so this arrival counts toward this step's release only
                            plgpu.barrier_wait(produced.at[slot])
                            plgpu.barrier_arrive(consumed.at[slot])

                @pl.when(mine)
                def _():
                    if per_step:
                        def load_scales(k):  # K step k's scales, every K block of it (clamped past the last step)
                            k = jnp.minimum(k, k_steps - 1)
                            return [load_step_scales(k * halves + h, **where) for h in range(halves)]

                        def k_step(k, carry_k):
                            acc, loaded = carry_k
                            slot = lax.rem(carry + k, stages)
                            scales = [step_scale(k * halves + h, loaded=ld, **where) for h, ld in enumerate(loaded)]
                            # the next step's scales: global loads issued a whole step before their use (ncu: the
                            # promotion's FMUL waited on the scale loads; BENCHMARKS.md)
                            loaded_next = load_scales(k + 1)
                            plgpu.barrier_wait(produced.at[slot])

                            def parts_scope(*part_refs):
                                for h, part_ref in enumerate(part_refs):  # every K block's wgmma in flight at once
                                    ks = pl.ds(h * SCALE_BLOCK, SCALE_BLOCK) if halves > 1 else slice(None)
                                    plgpu.wgmma(part_ref, *operands(slot, ks))
                                out = acc
                                for h, (part_ref, scale) in enumerate(zip(part_refs, scales)):
                                    # K block h done (the later ones may still run: its promotion overlaps them;
                                    # the other consumer's wgmmas may run meanwhile too)
                                    part = plgpu.wgmma_accumulator_load(part_ref, wait_n=halves - 1 - h)
                                    if h == halves - 1:  # every wgmma of the step done: the slot is free
                                        plgpu.barrier_arrive(consumed.at[slot])
                                    out = out + (part if scale is None else part * scale)
                                return out

                            out = pl.run_scoped(parts_scope, *[plgpu.ACC((bm, bn), jnp.float32)] * halves)
                            return out, loaded_next

                        zero = plgpu.layout_cast(jnp.full((bm, bn), 0, jnp.float32), plgpu.Layout.WGMMA)
                        store(lax.fori_loop(0, k_steps, k_step, (zero, load_scales(0)))[0])
                    else:
                        def acc_scope(acc_ref):
                            @pl.loop(0, k_steps)
                            def _k(k):
                                slot = lax.rem(carry + k, stages)
                                plgpu.barrier_wait(produced.at[slot])
                                plgpu.wgmma(acc_ref, *operands(slot))
                                plgpu.wgmma_wait(1)  # the previous step's wgmma done: its slot is free

                                @pl.when(k > 0)
                                def _():
                                    plgpu.barrier_arrive(consumed.at[lax.rem(carry + k - 1, stages)])

                            plgpu.wgmma_wait(0)
                            plgpu.barrier_arrive(consumed.at[lax.rem(carry + k_steps - 1, stages)])
                            return acc_ref[...]

                        store(pl.run_scoped(acc_scope, plgpu.ACC((bm, bn), jnp.float32)))

                @pl.when((lo < hi) & (e >= E))  # unused rows: zeros, each consumer its part
                def _():
                    zero = plgpu.layout_cast(jnp.full((bm, bn), 0, out_dtype), plgpu.Layout.WGMMA)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    _store_rows(zero, o_gmem, my_row0, my_lo, my_hi, my_n0, bm, bn, o_smem.at[wg])

                return carry + jnp.where(active, k_steps, 0)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # every store out before the kernel ends

    w_shape = (stages, bk, cta_n) if dgrad else (stages, cta_n, bk)
    pl.run_scoped(
        scoped,
        plgpu.SMEM((stages, cta_m, bk), dtype, transforms=_transforms(bk, dtype)),
        plgpu.SMEM(w_shape, dtype, transforms=_transforms(cta_n if dgrad else bk, dtype)),
        plgpu.SMEM((CONSUMERS, bm, bn), out_dtype),  # untiled: the store ladder slices any row
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # the x and the weight tile of a step landed
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # both consumers done with a step's slot
        collective_axes="wg",
    )


def run_row_kernel_ws(x, w, expert_offsets, scale_inputs=(), *, N_out: int, K_contract: int,
                      cfg: MosaicGroupedGemmConfig, out_dtype, dgrad: bool = False, num_sms: int, x_kind=None,
                      w_kind=None, has_bias: bool = False) -> jax.Array:
    """``[M_cap, N_out]``: the forward (``x [M_cap, K]``, ``w [E, N, K]``; FP8 with its ``scale_inputs`` as
    ``pallas_mosaic_gpu.py`` prepares them, then the float32 ``bias [E, N]`` if ``has_bias``) or the 16-bit
    dgrad (``x`` = ``d_y``), warp-specialized. Inputs validated by the caller (``config.mosaic_config_problem``)."""
    M_cap = x.shape[0]
    E = w.shape[0]
    row_align = ROW_ALIGN if aligned_tiles_enabled() else None
    step_e, step_lo, step_hi = tile_metadata(expert_offsets, M_cap, E, ws_cta_tile(cfg)[0], row_align=row_align)
    m_rows = -(-M_cap // 8) * 8  # TMA boxes tile rows by 8 (the pad rows belong to no step)
    if m_rows != M_cap:
        x = jnp.pad(x, ((0, m_rows - M_cap), (0, 0)))
    kernel = functools.partial(_kernel, E=E, N=N_out, K=K_contract, cfg=cfg, dgrad=dgrad, x_kind=x_kind,
                               w_kind=w_kind, has_bias=has_bias, row_align=row_align)
    y = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m_rows, N_out), out_dtype),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(step_e, step_lo, step_hi, x, w, *scale_inputs)
    return y if m_rows == M_cap else y[:M_cap]
