"""Hopper grouped GEMM ``y[m] = x[m] @ w[e(m)].T`` in Pallas Mosaic GPU (CONTRACT.md section 4).

Dataflow: ``x [M_cap, K]`` rows grouped by expert (``expert_offsets [E + 1]``), ``w [E, N, K]``
K-major (PyTorch/HF layout, which is also what Hopper's FP8 ``wgmma`` needs: both operands
K-major). Outside the kernel, plain jnp turns the offsets into per-step metadata (the same
:func:`~moe_pallas.ops.grouped_gemm.pallas_triton.tile_metadata` as the Pallas-Triton kernel:
step ``s`` owns rows ``[lo_s, hi_s)`` of one ``block_m`` row tile, for expert ``e_s``, or for
the "zero group" ``e_s == E`` of unused rows ``>= offsets[-1]``).

One persistent kernel: ``grid = (number of SMs,)``; each CTA (one warpgroup; with ``config.warp_specialized``
a producer and two consumer warpgroups on a CTA tile of two consumer tiles, ``block_m x 2*block_n`` or with
``split_m`` ``2*block_m x block_n``, whose row count is then the steps' tile: ``pallas_mosaic_gpu_ws.py``) walks the
work items ``(step, column tile)`` of a ``plgpu.nd_loop`` (a planar snake over ``(steps, N / block_n)`` for
L2 reuse of one expert's weight tiles) and for each one (the one-warpgroup kernel)

1. reads ``e, lo, hi`` (three int32 scalars from GMEM); a step with ``lo == hi`` (padding) does
   nothing;
2. for a real expert, streams ``x[row0:row0+block_m, k-tile]`` and ``w[e, n-tile, k-tile]`` through
   shared memory with TMA (``plgpu.emit_pipeline``, ``max_concurrent_steps`` deep) into ``wgmma``
   with a float32 accumulator. Rows of the tile that belong to other experts are computed too
   (a tile is the MMA unit) but never stored; rows past ``M_cap`` are zero-filled by TMA;
3. FP8: each K step (128 values) accumulates in a fresh tensor-core accumulator that is added to
   a float32 register accumulator (Hopper's FP8 MMA keeps only ~14 bits of a running sum; this
   "promotion" is DeepSeek-V3's, arXiv:2412.19437 section 3.3.2; ``config.fast_accum=True`` skips
   it). Per-step scales (per-token-group activations ``[M_cap, K // 128]`` and 128x128 weight
   blocks ``[E, N / 128, K / 128]``) multiply each K step's partial product before it is added
   (the same paper's fine-grained scaling); the other
   layouts (per-tensor ``[]``, per-token ``[M_cap, 1]``; per-expert ``[E]``, per-channel ``[E, N]``)
   multiply the finished accumulator in the epilogue, the activation scale indexed by ROW; an optional
   per-expert ``bias [E, N]`` (float32 by then) is added after them, before the one rounding
   (CONTRACT.md section 4), loaded as the per-channel weight scale is (``WGMMA.reduce(0)`` layout);
4. stores exactly the rows ``[lo, hi)``: the tile goes to shared memory, then a "ladder" of TMA
   stores of ``2^i`` rows each (one per set bit of ``hi - lo``), since a TMA box has a static shape.
   The zero group stores zeros the same way, so every row of ``y`` is written exactly once.

Learned from jax-ml/jax@jax-v0.11.2:jax/experimental/pallas/ops/gpu/ragged_dot_mgpu.py (persistent
``nd_loop`` + ``planar_snake`` + ``emit_pipeline`` + ``wgmma``, the power-of-two TMA store ladder)
and hopper_matmul_mgpu.py; the tile-to-group metadata is megablox's (see ``pallas_triton.py``).
Ours takes ``expert_offsets`` with unused capacity, FP8 with every scale layout of the contract, and
writes zeros where no expert owns a row.

Limits (``NotImplementedError``, so that dispatch falls back to the Pallas-Triton kernel):
16-bit float or FP8 inputs only (no float32: ``wgmma`` would be TF32); ``N % block_n == 0``;
``K % block_k == 0``; per-token-group scales need ``G == 128``; block weight scales need
``block_n == 128``. The warp-specialized schedule (``pallas_mosaic_gpu_ws.py``) also needs ``N % (2 * block_n) == 0``
(``N % block_n`` with ``split_m``), at least 2 stages,
``block_k`` 128 or 256 with per-step accumulation and ``block_m * block_n <= 64 * 128`` then
(``config.mosaic_config_problem``, the one home of these rules).

Mirror: none (a Hopper-only backend of ``moe_pallas``; ``moe_torch``'s Triton kernel is its peer).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_pallas.ops.grouped_gemm.config import (SCALE_BLOCK, MosaicGroupedGemmConfig, accumulates_per_step,
                                                 gpu_device_spec, mosaic_config_problem, mosaic_grouped_gemm_config,
                                                 ws_cta_tile)
from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu_ws import run_row_kernel_ws, scale_epilogue, step_scale
from moe_pallas.ops.grouped_gemm.pallas_triton import scale_kinds, tile_metadata
from moe_pallas.ops.grouped_gemm.reference import grouped_gemm_reference

FP8_DTYPE = jnp.float8_e4m3fn
#: SMs to plan the persistent grid for where no device spec is known (the CPU, abstract lowering): an H100 / H200
#: SXM's, the GPUs these kernels target.
DEFAULT_NUM_SMS = 132


def num_sms() -> int:
    """The SM count of JAX's GPU from its device spec (``moe_pallas.ops.device``), the persistent grid's size;
    :data:`DEFAULT_NUM_SMS` where there is no spec (no GPU backend) or it reports none."""
    spec = gpu_device_spec()
    return spec.sm_count if spec is not None and spec.sm_count > 0 else DEFAULT_NUM_SMS


def _store_rows(tile, o_gmem, row0, lo, hi, n0, block_m: int, block_n: int, o_smem) -> None:
    """Write rows ``[lo, hi)`` (all inside ``[row0, row0 + block_m)``) of ``tile [block_m, block_n]``
    to ``o_gmem[:, n0:n0+block_n]``: the tile through shared memory, then one TMA store of ``2^i``
    rows per set bit ``i`` of ``hi - lo``, largest first, so no row outside ``[lo, hi)`` is touched."""
    o_smem[...] = tile
    plgpu.commit_smem()
    start = lo - row0  # first row to store, inside the tile
    count = hi - lo
    for bit in reversed(range(int(math.log2(block_m)) + 1)):
        rows = 1 << bit

        @pl.when((count & rows) != 0)
        def _():
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, rows)], o_gmem.at[pl.ds(row0 + start, rows), pl.ds(n0, block_n)])

        start = start + (count & rows)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kernel(step_e, step_lo, step_hi, x_gmem, w_gmem, *refs, E: int, N: int, K: int, x_kind, w_kind,
            cfg: MosaicGroupedGemmConfig, out_dtype, dgrad: bool = False, has_bias: bool = False):
    """The forward (``w [E, N, K]``: a weight tile ``[block_n, block_k]`` is transposed into ``wgmma``'s
    ``[contraction, out]`` operand) or, with ``dgrad=True``, the dgrad ``d_x = d_y @ w[e]``: then ``x`` is
    ``d_y``, ``N`` is the output width (``w``'s K) and ``K`` the contraction (``w``'s N), and ``w[e]``
    is already ``[contraction, out]``: its tile ``[block_k, block_n]`` feeds ``wgmma`` as it is (an
    MN-major B operand, which 16-bit ``wgmma`` takes). With ``has_bias`` (forward only) a float32
    ``b_gmem [E, N]`` comes after the scales."""
    *refs, o_gmem = refs
    b_gmem = refs.pop() if has_bias else None
    if x_kind is None:
        xs_gmem = ws_gmem = None
    else:
        xs_gmem, ws_gmem = refs
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    n_steps = step_e.shape[0]
    grid_n = N // bn
    k_steps = K // bk
    # FP8 accumulates step by step into float32 registers unless fast_accum (see the config);
    # per-step scales need it anyway.
    per_step = accumulates_per_step(x_gmem.dtype.itemsize, x_kind == "per_token_group" or w_kind == "block", cfg)

    @plgpu.nd_loop((n_steps * grid_n,), collective_axes="sm")
    def _work(info: plgpu.NDLoopInfo):
        si, ni = plgpu.planar_snake(info.index[0], (n_steps, grid_n), 1, cfg.grid_block_n)
        e, lo, hi = step_e[si], step_lo[si], step_hi[si]
        tile_idx = lax.div(lo, jnp.int32(bm))
        row0 = tile_idx * bm
        n0 = ni * bn
        e_w = jnp.minimum(e, E - 1)  # a valid expert for addressing only (the zero group reads nothing)
        where = dict(x_kind=x_kind, w_kind=w_kind, xs_gmem=xs_gmem, ws_gmem=ws_gmem, row0=row0, n0=n0, e_w=e_w,
                     block_m=bm, block_n=bn)
        in_specs = [
            plgpu.BlockSpec((bm, bk), lambda k: (tile_idx, k), delay_release=1),
            plgpu.BlockSpec((bk, bn), lambda k: (k, ni), delay_release=1) if dgrad
            else plgpu.BlockSpec((bn, bk), lambda k: (ni, k), delay_release=1),
        ]

        def w_operand(w_smem):  # wgmma's B operand, [block_k (contraction), block_n (out)]
            return w_smem if dgrad else w_smem.transpose((1, 0))

        def matmul() -> jax.Array:
            if not per_step:
                def acc_scope(acc_ref):
                    plgpu.emit_pipeline(
                        lambda _, x_smem, w_smem: plgpu.wgmma(acc_ref, x_smem, w_operand(w_smem)),
                        grid=(k_steps,), in_specs=in_specs, max_concurrent_steps=cfg.max_concurrent_steps,
                    )(x_gmem, w_gmem.at[e_w])
                    return acc_ref[...]

                return pl.run_scoped(acc_scope, plgpu.ACC((bm, bn), jnp.float32))

            def step(idx, x_smem, w_smem, acc):
                (k,) = idx
                scale = step_scale(k, **where)  # global loads issued before the wgmma, used after it

                def part_scope(part_ref):
                    plgpu.wgmma(part_ref, x_smem, w_operand(w_smem))
                    return part_ref[...]

                part = pl.run_scoped(part_scope, plgpu.ACC((bm, bn), jnp.float32))
                return acc + (part if scale is None else part * scale)

            zero = plgpu.layout_cast(jnp.full((bm, bn), 0, jnp.float32), plgpu.Layout.WGMMA)
            return plgpu.emit_pipeline(
                step, grid=(k_steps,), in_specs=in_specs, max_concurrent_steps=cfg.max_concurrent_steps,
                init_carry=zero,
            )(x_gmem, w_gmem.at[e_w])

        def epilogue(acc: jax.Array) -> jax.Array:
            return scale_epilogue(acc, b_gmem=b_gmem, **where).astype(out_dtype)

        @pl.when((lo < hi) & (e < E))
        def _():
            tile = epilogue(matmul())
            pl.run_scoped(functools.partial(_store_rows, tile, o_gmem, row0, lo, hi, n0, bm, bn),
                          plgpu.SMEM((bm, bn), out_dtype))

        @pl.when((lo < hi) & (e >= E))
        def _():
            tile = plgpu.layout_cast(jnp.full((bm, bn), 0, out_dtype), plgpu.Layout.WGMMA)
            pl.run_scoped(functools.partial(_store_rows, tile, o_gmem, row0, lo, hi, n0, bm, bn),
                          plgpu.SMEM((bm, bn), out_dtype))


def check_supported(x: jax.Array, w: jax.Array, x_kind, w_kind, G: int, out_dtype, cfg: MosaicGroupedGemmConfig) -> None:
    """``NotImplementedError`` for a valid request this backend cannot serve (dispatch then falls back); the shared
    memory limit is this GPU's (its device spec, read on the host at trace time)."""
    op = "grouped_gemm[pallas_mosaic_gpu]"
    M_cap, K = x.shape
    N = w.shape[1]
    if x.dtype not in (jnp.bfloat16, jnp.float16, FP8_DTYPE):
        raise NotImplementedError(f"{op}: x must be bf16, float16 or float8_e4m3fn (wgmma); got {x.dtype}")
    if jnp.dtype(out_dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise NotImplementedError(f"{op}: out_dtype must be bf16, float16 or float32; got {out_dtype}")
    if x_kind == "per_token_group" and G != SCALE_BLOCK:
        raise NotImplementedError(f"{op}: per-token-group activation scales need G == {SCALE_BLOCK}; got G={G}")
    problem = mosaic_config_problem(cfg, N, K, x.dtype.itemsize, x_kind == "per_token_group" or w_kind == "block",
                                    out_itemsize=jnp.dtype(out_dtype).itemsize, device=gpu_device_spec())
    if problem:
        raise NotImplementedError(problem)
    if (K * x.dtype.itemsize) % 16:
        raise NotImplementedError(f"{op}: TMA needs 16-byte aligned rows; got K={K} x {x.dtype.itemsize} bytes")


@functools.partial(jax.jit, static_argnames=("out_dtype", "config"))
def grouped_gemm_pallas_mosaic_gpu(
    x: jax.Array,
    w: jax.Array,
    expert_offsets: jax.Array,
    *,
    x_scale: jax.Array | None = None,
    w_scale: jax.Array | None = None,
    out_dtype=None,
    config: MosaicGroupedGemmConfig | None = None,
    bias: jax.Array | None = None,
) -> jax.Array:
    """``y[m] = x[m] @ w[e(m)].T`` (FP8: ``(q_x @ q_w.T) * x_scale[m, ...] * w_scale[e(m), ...]``) on Hopper.
    With ``bias [E, N]`` (float32 / bf16 / float16): ``+ bias[e(m)]`` in float32 before the rounding.

    Args (validated by ``moe_pallas.ops.grouped_gemm.api.grouped_gemm``):
      x: ``[M_cap, K]`` bf16 / float16, or float8_e4m3fn codes.
      w: ``[E, N, K]`` (out, in), ``x``'s dtype.
      expert_offsets: ``[E + 1]`` int32; rows ``[offsets[e], offsets[e+1])`` use ``w[e]``; rows
        ``>= offsets[-1]`` come out zero and are never read.
      x_scale: FP8 only, float32 multiplier: ``[]``, ``[M_cap, 1]`` or ``[M_cap, K // 128]``.
      w_scale: FP8 only, float32 multiplier: ``[E]``, ``[E, N]`` or ``[E, N // 128, K // 128]``.
      out_dtype: default ``x.dtype`` (bf16 for FP8 inputs).
      config: launch config (default: :func:`mosaic_grouped_gemm_config`: the tuned config of this GPU
        if one is stored and fits, else the heuristic).

    Returns: ``y [M_cap, N]`` in ``out_dtype``; every row written exactly once.

    Raises: NotImplementedError (see the module docstring's limits), before tracing the kernel.
    """
    M_cap, K = x.shape
    E, N, _ = w.shape
    fp8 = x.dtype == FP8_DTYPE
    out_dtype = (jnp.bfloat16 if fp8 else x.dtype) if out_dtype is None else jnp.dtype(out_dtype)
    x_kind, w_kind, G = scale_kinds(x_scale, w_scale, K) if fp8 else (None, None, 0)
    per_step_scales = x_kind == "per_token_group" or w_kind == "block"
    if config is None:  # tuned for this GPU (device kind read on the host at trace time) or the heuristic
        cfg = mosaic_grouped_gemm_config(M_cap, N, K, E, x.dtype.itemsize, per_step_scales=per_step_scales,
                                         device=gpu_device_spec(), out_itemsize=jnp.dtype(out_dtype).itemsize,
                                         w_block=w_kind == "block")
    else:
        cfg = config
    check_supported(x, w, x_kind, w_kind, G, out_dtype, cfg)
    if M_cap == 0 or N == 0 or E == 0:
        return jnp.zeros((M_cap, N), out_dtype)
    if K == 0:  # a sum of no terms: each used row is its expert's bias (or 0); nothing to launch
        return grouped_gemm_reference(x, w, expert_offsets, x_scale, w_scale, out_dtype, bias=bias)
    tile_m = ws_cta_tile(cfg)[0] if cfg.warp_specialized else cfg.block_m
    # scale vectors are loaded a whole (CTA) tile at a time; the warp-specialized kernel's tiles start at any row
    # that is a multiple of 8 (expert-aligned tiles), so one more tile past M_cap
    m_pad = pl.cdiv(M_cap, tile_m) * tile_m + (tile_m if cfg.warp_specialized else 0)
    scale_inputs = []
    if fp8:
        xs = x_scale.astype(jnp.float32)
        if x_kind == "per_tensor":
            xs = xs.reshape(1)
        elif x_kind == "per_token":
            xs = jnp.pad(xs.reshape(M_cap), (0, m_pad - M_cap))
        else:  # per-token-group: [K // 128, m_pad], one contiguous row vector per K step
            xs = jnp.pad(xs.T, ((0, 0), (0, m_pad - M_cap)))
        scale_inputs = [xs, w_scale.astype(jnp.float32)]
    if bias is not None:  # exact widening; [E, N] float32, read a block_n slice at a time (N % block_n == 0)
        scale_inputs = [*scale_inputs, bias.astype(jnp.float32)]
    return run_row_kernel(x, w, expert_offsets, scale_inputs, N_out=N, K_contract=K, x_kind=x_kind, w_kind=w_kind,
                          cfg=cfg, out_dtype=out_dtype, has_bias=bias is not None)


def run_row_kernel(x, w, expert_offsets, scale_inputs, *, N_out: int, K_contract: int, x_kind, w_kind,
                   cfg: MosaicGroupedGemmConfig, out_dtype, dgrad: bool = False, has_bias: bool = False) -> jax.Array:
    """Launch :func:`_kernel` (the forward, or with ``dgrad`` the dgrad) over the row tiles of
    ``expert_offsets``: ``[M_cap, N_out]`` in ``out_dtype``. Shared by this module and
    ``pallas_mosaic_gpu_backward.py``. ``cfg.warp_specialized``: the kernel of ``pallas_mosaic_gpu_ws.py``
    instead (the same inputs: 16-bit or FP8 with its scales, a bias; the dgrad 16-bit)."""
    if cfg.warp_specialized:
        return run_row_kernel_ws(x, w, expert_offsets, scale_inputs, N_out=N_out, K_contract=K_contract, cfg=cfg,
                                 out_dtype=out_dtype, dgrad=dgrad, num_sms=num_sms(), x_kind=x_kind, w_kind=w_kind,
                                 has_bias=has_bias)
    M_cap = x.shape[0]
    E = w.shape[0]
    step_e, step_lo, step_hi = tile_metadata(expert_offsets, M_cap, E, cfg.block_m)
    # TMA boxes tile rows by 8: an M_cap that is not a multiple of 8 runs on a padded copy of x
    # (the pad rows belong to no step, are never stored, and are sliced off).
    m_rows = -(-M_cap // 8) * 8
    if m_rows != M_cap:
        x = jnp.pad(x, ((0, m_rows - M_cap), (0, 0)))
    kernel = functools.partial(_kernel, E=E, N=N_out, K=K_contract, x_kind=x_kind, w_kind=w_kind, cfg=cfg,
                               out_dtype=out_dtype, dgrad=dgrad, has_bias=has_bias)
    y = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m_rows, N_out), out_dtype),
        grid=(num_sms(),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(step_e, step_lo, step_hi, x, w, *scale_inputs)
    return y if m_rows == M_cap else y[:M_cap]
