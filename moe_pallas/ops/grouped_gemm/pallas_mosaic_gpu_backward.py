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

Limits (``NotImplementedError``: the dispatch's default order then falls back to the Pallas-Triton
kernels): 16-bit float inputs only (no float32: ``wgmma`` would round to TF32; no FP8 weights in the
dgrad: Hopper's FP8 ``wgmma`` needs K-major operands and the straight-through dgrad dequantizes);
whole tiles (the dgrad: ``K % block_n``, ``N % block_k``; the wgrad: ``N % block_m``, ``K % block_n``).

Learned from jax-ml/jax@jax-v0.11.2:jax/experimental/pallas/ops/gpu/ragged_dot_mgpu.py (the
non-transposed B operand) and transposed_ragged_dot_mgpu.py (the wgrad's group loop and the masking
of the first and last block in shared memory; ours masks both operands by select, takes
``expert_offsets`` with unused capacity, and addresses blocks through the index map instead of an
out-of-bounds slice).

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

from moe_pallas.ops.grouped_gemm.config import (MosaicGroupedGemmConfig, heuristic_mosaic_grouped_gemm_config,
                                                 heuristic_mosaic_wgrad_config, mosaic_config_problem,
                                                 mosaic_wgrad_config_problem)
from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu import num_sms, run_row_kernel
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
        per step; default :func:`heuristic_mosaic_grouped_gemm_config` of the swapped problem.

    Returns: ``d_x [M_cap, K]``, every row written exactly once.

    Raises: NotImplementedError (float32 or FP8 inputs; ``K % block_n`` or ``N % block_k``).
    """
    op = "grouped_gemm_dgrad[pallas_mosaic_gpu]"
    _check_16bit(op, d_y=d_y, w=w)
    M_cap, N = d_y.shape
    E, _, K = w.shape
    out_dtype = d_y.dtype if out_dtype is None else jnp.dtype(out_dtype)
    cfg = config or heuristic_mosaic_grouped_gemm_config(M_cap, K, N, E, d_y.dtype.itemsize,
                                                         out_itemsize=jnp.dtype(out_dtype).itemsize)
    problem = mosaic_config_problem(cfg, K, N, d_y.dtype.itemsize, False, op=op, out_itemsize=jnp.dtype(out_dtype).itemsize)
    if problem:
        raise NotImplementedError(problem)
    if M_cap == 0 or K == 0:
        return jnp.zeros((M_cap, K), out_dtype)
    if N == 0 or E == 0:  # a sum of no terms / no expert owns a row
        return jnp.zeros((M_cap, K), out_dtype)
    return run_row_kernel(d_y, w, expert_offsets, [], N_out=K, K_contract=N, x_kind=None, w_kind=None, cfg=cfg,
                          out_dtype=out_dtype, dgrad=True)


def _wgrad_kernel(starts, ends, x_gmem, dy_gmem, o_gmem, *, E: int, N: int, K: int, cfg: MosaicGroupedGemmConfig):
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    grid_m, grid_n = N // bm, K // bn
    dtype = x_gmem.dtype
    dy_tf, x_tf = _transforms(bm, dtype), _transforms(bn, dtype)
    release = 1 if cfg.max_concurrent_steps > 1 else 0

    @plgpu.nd_loop((E, grid_m * grid_n), collective_axes="sm")
    def _work(info: plgpu.NDLoopInfo):
        e = info.index[0]
        mi, ni = plgpu.planar_snake(info.index[1], (grid_m, grid_n), 1, cfg.grid_block_n)
        start, end = starts[e], ends[e]
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
      config: ``block_m`` x ``block_n`` tile of ``d_w[e]`` (along N, K), ``block_k`` rows per step;
        default :func:`heuristic_mosaic_wgrad_config`.

    Returns: ``d_w [E, N, K]`` in ``out_dtype``.

    Raises: NotImplementedError (float32 inputs; ``N % block_m`` or ``K % block_n``).
    """
    op = "grouped_gemm_wgrad[pallas_mosaic_gpu]"
    _check_16bit(op, x=x, d_y=d_y)
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise NotImplementedError(f"{op}: out_dtype must be bf16, float16 or float32; got {out_dtype}")
    M_cap, K = x.shape
    N = d_y.shape[1]
    E = expert_offsets.shape[0] - 1
    cfg = config or heuristic_mosaic_wgrad_config(M_cap, N, K, E, x.dtype.itemsize, out_dtype.itemsize)
    problem = mosaic_wgrad_config_problem(cfg, N, K)
    if problem:
        raise NotImplementedError(problem)
    if M_cap == 0 or N == 0 or K == 0 or E == 0:
        return jnp.zeros((E, N, K), out_dtype)
    starts, ends = expert_row_ranges(expert_offsets, M_cap)
    # TMA boxes tile rows by 8: pad the row count (the pad rows belong to no expert and are masked).
    m_rows = -(-M_cap // 8) * 8
    if m_rows != M_cap:
        x = jnp.pad(x, ((0, m_rows - M_cap), (0, 0)))
        d_y = jnp.pad(d_y, ((0, m_rows - M_cap), (0, 0)))
    kernel = functools.partial(_wgrad_kernel, E=E, N=N, K=K, cfg=cfg)
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((E, N, K), out_dtype),
        grid=(num_sms(),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(starts.astype(jnp.int32), ends.astype(jnp.int32), x, d_y)
