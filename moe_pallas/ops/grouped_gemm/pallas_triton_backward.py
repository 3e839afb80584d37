"""The grouped GEMM's backward as Pallas kernels with the Triton lowering (CONTRACT.md section 8).

Forward (``pallas_triton.py``): ``y [M_cap, N] = x [M_cap, K] @ w[e(m)].T`` with ``w [E, N, K]``.
Its two backward GEMMs, both reading ``w`` and the activations as they are (no transposed copy):

- **dgrad** ``d_x[m] = d_y[m] @ w[e(m)]`` (``[M_cap, N] x [N, K] -> [M_cap, K]``): the forward's
  structure with N and K swapped. The same per-grid-step row metadata
  (:func:`~moe_pallas.ops.grouped_gemm.pallas_triton.tile_metadata`); program ``(s, j)`` owns the rows
  of step ``s`` and columns ``[j*block_k, (j+1)*block_k)`` of ``d_x``, loops over ``N`` in ``block_n``
  steps (a ``d_y`` tile ``[block_m, block_n]`` times the weight tile ``w[e, n-slice, k-slice]``
  ``[block_n, block_k]``, a plain ``[M, N] x [N, K]`` dot; float32 accumulation), and stores the rows it
  owns. FP8 weights (straight-through, section 8) are dequantized in the kernel: each loaded tile of
  codes times its float32 scale (per-expert ``[E]``, per-channel ``[E, N]`` along the contraction, or
  the tile's ``128 x 128`` block) is rounded to ``d_y``'s dtype, then dotted like float weights.
  Grid ``(cdiv(M_cap, block_m) + E, cdiv(K, block_k))``, static.
- **wgrad** ``d_w[e] = d_y[rows(e)].T @ x[rows(e)]`` (``-> [E, N, K]``): a K-grouped GEMM, the
  contraction runs over each expert's rows. Program ``(j, i, e)`` owns the tile ``[i*block_n, +block_n)
  x [j*block_k, +block_k)`` of ``d_w[e]`` and loops over the expert's rows ``[start_e, end_e)`` in
  ``block_m`` steps (masked loads of a ``d_y`` tile ``[block_m, block_n]`` and an ``x`` tile
  ``[block_m, block_k]``, contracted over their row dims; float32 accumulation); the loop's trip count
  ``cdiv(end_e - start_e, block_m)`` is data, 0 for an empty expert, whose tile is then stored as
  exact zeros. Rows ``>= M`` belong to no expert and are never read. Grid
  ``(cdiv(K, block_k), cdiv(N, block_n), E)``, static; the expert is the slowest grid dimension so
  that the programs running together share one expert's rows (in L2).
- **dbias** ``d_bias[e] = sum of d_y[rows(e)]`` (``-> [E, N]``, the gradient of the optional per-expert
  bias): a segment sum. Program ``(j, e)`` owns ``d_bias[e, j*block_n : (j+1)*block_n]`` and loops over
  the expert's rows in ``block_m`` steps (masked loads of ``d_y`` tiles added into a float32
  ``[block_m, block_n]`` partial-sum tile, reduced over its rows once at the end); the trip count is data,
  0 for an empty expert, whose columns are then stored as exact zeros. Grid ``(cdiv(N, block_n), E)``.

Learned from: the forward kernel beside this file; the wgrad's shape (a tile of one group's
output, a loop over that group's rows) from jax-ml/jax@jax-v0.11.2:
jax/experimental/pallas/ops/gpu/transposed_ragged_dot_mgpu.py (read, not copied: that kernel is Mosaic
GPU, with TMA and a per-group row loop) and tokamax's ``drhs_ragged_dot`` op of ``_src/ops/ragged_dot``.

Mirror: ``moe_torch/ops/grouped_gemm/triton_backward.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_pallas.ops import common as _common  # its import applies patch_pallas_triton_offsets
from moe_pallas.ops.grouped_gemm.config import (SCALE_BLOCK, GroupedGemmDbiasConfig, GroupedGemmDgradConfig,
                                                 GroupedGemmWgradConfig, heuristic_grouped_gemm_dbias_config,
                                                 heuristic_grouped_gemm_dgrad_config,
                                                 heuristic_grouped_gemm_wgrad_config, triton_backward_config_problem)
from moe_pallas.ops.grouped_gemm.pallas_triton import tile_metadata
from moe_pallas.ops.grouped_gemm.reference import expert_row_ranges

FP8_DTYPE = jnp.float8_e4m3fn
W_SCALE_KINDS = {1: "per_expert", 2: "per_channel", 3: "block"}


def _dgrad_kernel(expert_ref, lo_ref, hi_ref, dy_ref, w_ref, *refs, E: int, N: int, K: int,
                  w_scale_kind: str | None, block_m: int, block_n: int, block_k: int, precision):
    """One ``block_m x block_k`` tile of ``d_x`` for the rows of one expert.

    Grid ``(cdiv(M_cap, block_m) + E, cdiv(K, block_k))``; program ``(s, j)`` owns rows
    ``[lo_ref[s], hi_ref[s])`` (inside one row tile) and columns ``[j*block_k, (j+1)*block_k)``.

    Refs (whole arrays): ``expert_ref, lo_ref, hi_ref [n_steps]`` int32 (``tile_metadata``);
    ``dy_ref [M_cap, N]`` float; ``w_ref [E, N, K]`` ``d_y``'s dtype or float8_e4m3fn; for FP8,
    ``ws_ref`` float32 (``[E]``, ``[E, N]`` or ``[E, ceil(N/128), ceil(K/128)]``); last ``dx_ref [M_cap, K]``.
    """
    if w_scale_kind is None:
        (dx_ref,) = refs
        ws_ref = None
    else:
        ws_ref, dx_ref = refs
    s, j = pl.program_id(0), pl.program_id(1)
    e, lo, hi = expert_ref[s], lo_ref[s], hi_ref[s]

    row0 = (lo // block_m) * block_m
    k0 = j * block_k
    rows = row0 + jnp.arange(block_m)
    row_ok = (rows >= lo) & (rows < hi)  # [block_m]: rows of other experts are masked off
    col_ok = k0 + jnp.arange(block_k) < K  # [block_k]
    rows_ds, cols_ds = pl.ds(row0, block_m), pl.ds(k0, block_k)
    store_mask = row_ok[:, None] & col_ok[None, :]

    # As in the forward: padding steps (lo == hi) do nothing; e == E (rows >= M) stores zeros and
    # reads nothing; the N loop has a static trip count.
    @pl.when((lo < hi) & (e < E))
    def _():
        zero_dy, zero_w = jnp.zeros((), dy_ref.dtype), jnp.zeros((), w_ref.dtype)

        def n_step(nn, acc):
            n0 = nn * block_n
            n_ok = n0 + jnp.arange(block_n) < N
            ns = pl.ds(n0, block_n)
            dyt = plgpu.load(dy_ref.at[rows_ds, ns], mask=row_ok[:, None] & n_ok[None, :], other=zero_dy)  # [block_m, block_n]
            wt = plgpu.load(w_ref.at[e, ns, cols_ds], mask=n_ok[:, None] & col_ok[None, :], other=zero_w)  # [block_n, block_k]
            if w_scale_kind is not None:  # straight-through: q_w * scale_w in float32, rounded to d_y's dtype
                wt = wt.astype(jnp.float32)
                if w_scale_kind == "per_expert":
                    wt = wt * ws_ref[e]
                elif w_scale_kind == "per_channel":  # one scale per row n of w[e]: along the contraction
                    wt = wt * plgpu.load(ws_ref.at[e, ns], mask=n_ok, other=0.0)[:, None]
                else:  # block_n and block_k divide 128: one scale for the whole tile
                    wt = wt * ws_ref[e, n0 // SCALE_BLOCK, k0 // SCALE_BLOCK]
                wt = wt.astype(dy_ref.dtype)
            return acc + jax.lax.dot_general(dyt, wt, (((1,), (0,)), ((), ())), precision=precision,
                                             preferred_element_type=jnp.float32)  # [block_m, block_k]

        acc = jax.lax.fori_loop(0, pl.cdiv(N, block_n), n_step, jnp.zeros((block_m, block_k), jnp.float32))
        plgpu.store(dx_ref.at[rows_ds, cols_ds], acc.astype(dx_ref.dtype), mask=store_mask)

    @pl.when((lo < hi) & (e >= E))
    def _():
        plgpu.store(dx_ref.at[rows_ds, cols_ds], jnp.zeros((block_m, block_k), dx_ref.dtype), mask=store_mask)


def _wgrad_kernel(start_ref, end_ref, x_ref, dy_ref, dw_ref, *, N: int, K: int, block_m: int, block_n: int,
                  block_k: int, precision):
    """One ``block_n x block_k`` tile of ``d_w[e]``, summed over the rows of expert ``e``.

    Grid ``(cdiv(K, block_k), cdiv(N, block_n), E)``; program ``(j, i, e)`` owns
    ``d_w[e, i*block_n : (i+1)*block_n, j*block_k : (j+1)*block_k]``.

    Refs (whole arrays): ``start_ref, end_ref [E]`` int32 (expert ``e`` owns rows
    ``[start_ref[e], end_ref[e])``, ``reference.expert_row_ranges``); ``x_ref [M_cap, K]``,
    ``dy_ref [M_cap, N]`` float of one dtype; ``dw_ref [E, N, K]``.
    """
    j, i, e = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = start_ref[e], end_ref[e]
    n0, k0 = i * block_n, j * block_k
    n_ok = n0 + jnp.arange(block_n) < N  # [block_n]
    k_ok = k0 + jnp.arange(block_k) < K  # [block_k]
    ns, ks = pl.ds(n0, block_n), pl.ds(k0, block_k)
    zero = jnp.zeros((), x_ref.dtype)

    def m_step(t, acc):
        r0 = lo + t * block_m
        row_ok = r0 + jnp.arange(block_m) < hi  # [block_m]: the expert's rows only (never a row >= M)
        rs = pl.ds(r0, block_m)
        dyt = plgpu.load(dy_ref.at[rs, ns], mask=row_ok[:, None] & n_ok[None, :], other=zero)  # [block_m, block_n]
        xt = plgpu.load(x_ref.at[rs, ks], mask=row_ok[:, None] & k_ok[None, :], other=zero)  # [block_m, block_k]
        return acc + jax.lax.dot_general(dyt, xt, (((0,), (0,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32)  # [block_n, block_k]

    # The trip count is data (0 for an empty expert: its tile is stored as zeros). Both bounds are
    # int32 on purpose: the lowering turns this loop into an scf.for whose bounds must share a type.
    steps = ((hi - lo + block_m - 1) // block_m).astype(jnp.int32)
    acc = jax.lax.fori_loop(jnp.int32(0), steps, m_step, jnp.zeros((block_n, block_k), jnp.float32))
    plgpu.store(dw_ref.at[e, ns, ks], acc.astype(dw_ref.dtype), mask=n_ok[:, None] & k_ok[None, :])


def _precision(dtype):
    """float32 operands: IEEE products (the Triton default for DEFAULT precision is TF32, 10-bit mantissas)."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def grouped_gemm_dgrad_pallas_triton(
    d_y: jax.Array,
    w: jax.Array,
    expert_offsets: jax.Array,
    *,
    w_scale: jax.Array | None = None,
    out_dtype=None,
    config: GroupedGemmDgradConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``d_x[m] = d_y[m] @ w[e(m)]``, float32 accumulation.

    Args (validated by ``moe_pallas.ops.grouped_gemm.api.grouped_gemm_dgrad``):
      d_y: ``[M_cap, N]`` float32 / bf16 / float16.
      w: ``[E, N, K]`` (the forward's weights, read as they are), ``d_y``'s dtype or float8_e4m3fn codes.
      expert_offsets: ``[E + 1]`` int32; rows ``>= offsets[-1]`` come out zero and are never read.
      w_scale: FP8 only, float32 multiplier ``[E]``, ``[E, N]`` or ``[E, ceil(N/128), ceil(K/128)]``; the
        weights used are ``q_w * w_scale`` (float32) rounded to ``d_y.dtype``.
      out_dtype: default ``d_y.dtype``.
      config: launch config (default :func:`heuristic_grouped_gemm_dgrad_config`).
      interpret: Pallas interpret mode (default: when ``jax.default_backend() == "cpu"``).

    Grid: ``(cdiv(M_cap, block_m) + E, cdiv(K, block_k))``, static.

    Returns: ``d_x [M_cap, K]`` in ``out_dtype``.

    Raises: NotImplementedError (blocks < 16 outside interpret mode; with block weight scales a config
      whose ``block_n`` / ``block_k`` do not divide 128; an FP8 ``w`` of >= 2**31 elements when the
      lowering could not be patched to 64-bit offsets).
    """
    op = "grouped_gemm_dgrad[pallas_triton]"
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    M_cap, N = d_y.shape
    E, _, K = w.shape
    out_dtype = d_y.dtype if out_dtype is None else jnp.dtype(out_dtype)
    w_kind = W_SCALE_KINDS[w_scale.ndim] if w.dtype == FP8_DTYPE else None
    cfg = config or heuristic_grouped_gemm_dgrad_config(M_cap, N, K, E, d_y.dtype.itemsize, w_kind == "block")
    problem = triton_backward_config_problem(op, cfg, w_kind == "block", interpret=interpret)
    if problem:
        raise NotImplementedError(problem)
    if not interpret:  # 64-bit offsets where jax's lowering would not give them (common.patch_pallas_triton_offsets)
        _common.pallas_triton_offsets_ok(op, w=w)
    if M_cap == 0 or N == 0 or K == 0 or E == 0:  # nothing to launch: empty, or a sum of no terms / no expert
        return jnp.zeros((M_cap, K), out_dtype)
    step_expert, step_lo, step_hi = tile_metadata(expert_offsets, M_cap, E, cfg.block_m)
    inputs = [step_expert, step_lo, step_hi, d_y, w]
    if w_kind is not None:
        inputs.append(w_scale.astype(jnp.float32))
    kernel = functools.partial(_dgrad_kernel, E=E, N=N, K=K, w_scale_kind=w_kind, block_m=cfg.block_m,
                               block_n=cfg.block_n, block_k=cfg.block_k, precision=_precision(d_y.dtype))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M_cap, K), out_dtype),
        grid=(pl.cdiv(M_cap, cfg.block_m) + E, pl.cdiv(K, cfg.block_k)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="grouped_gemm_dgrad",
    )(*inputs)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def grouped_gemm_wgrad_pallas_triton(
    x: jax.Array,
    d_y: jax.Array,
    expert_offsets: jax.Array,
    *,
    out_dtype=jnp.float32,
    config: GroupedGemmWgradConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``d_w[e] = d_y[rows(e)].T @ x[rows(e)]``, float32 accumulation; an expert with no rows gets 0.

    Args (validated by ``moe_pallas.ops.grouped_gemm.api.grouped_gemm_wgrad``):
      x: ``[M_cap, K]`` float32 / bf16 / float16 (the forward's input).
      d_y: ``[M_cap, N]``, ``x``'s dtype.
      expert_offsets: ``[E + 1]`` int32; expert ``e`` owns rows ``[offsets[e], offsets[e+1])``; rows
        ``>= offsets[-1]`` are never read (a NaN there stays out of ``d_w``).
      out_dtype: default float32.
      config: launch config (default :func:`heuristic_grouped_gemm_wgrad_config`).
      interpret: Pallas interpret mode (default: when ``jax.default_backend() == "cpu"``).

    Grid: ``(cdiv(K, block_k), cdiv(N, block_n), E)``, static.

    Returns: ``d_w [E, N, K]`` in ``out_dtype``.

    Raises: NotImplementedError (blocks < 16 outside interpret mode).
    """
    op = "grouped_gemm_wgrad[pallas_triton]"
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    M_cap, K = x.shape
    N = d_y.shape[1]
    E = expert_offsets.shape[0] - 1
    out_dtype = jnp.dtype(out_dtype)
    cfg = config or heuristic_grouped_gemm_wgrad_config(M_cap, N, K, E, x.dtype.itemsize)
    problem = triton_backward_config_problem(op, cfg, interpret=interpret)
    if problem:
        raise NotImplementedError(problem)
    if M_cap == 0 or N == 0 or K == 0 or E == 0:  # nothing to launch: no rows (every expert empty) or an empty d_w
        return jnp.zeros((E, N, K), out_dtype)
    starts, ends = expert_row_ranges(expert_offsets, M_cap)
    kernel = functools.partial(_wgrad_kernel, N=N, K=K, block_m=cfg.block_m, block_n=cfg.block_n,
                               block_k=cfg.block_k, precision=_precision(x.dtype))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((E, N, K), out_dtype),
        grid=(pl.cdiv(K, cfg.block_k), pl.cdiv(N, cfg.block_n), E),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="grouped_gemm_wgrad",
    )(starts, ends, x, d_y)


def _dbias_kernel(start_ref, end_ref, dy_ref, db_ref, *, N: int, block_m: int, block_n: int):
    """``block_n`` columns of ``d_bias[e]``, the float32 sum of ``d_y`` over the rows of expert ``e``.

    Grid ``(cdiv(N, block_n), E)``; program ``(j, e)`` owns ``d_bias[e, j*block_n : (j+1)*block_n]``.

    Refs (whole arrays): ``start_ref, end_ref [E]`` int32 (expert ``e`` owns rows ``[start_ref[e],
    end_ref[e])``, ``reference.expert_row_ranges``); ``dy_ref [M_cap, N]`` float; ``db_ref [E, N]``.
    """
    j, e = pl.program_id(0), pl.program_id(1)
    lo, hi = start_ref[e], end_ref[e]
    n0 = j * block_n
    n_ok = n0 + jnp.arange(block_n) < N  # [block_n]
    ns = pl.ds(n0, block_n)
    zero = jnp.zeros((), dy_ref.dtype)

    def m_step(t, acc):
        r0 = lo + t * block_m
        row_ok = r0 + jnp.arange(block_m) < hi  # [block_m]: the expert's rows only (never a row >= M)
        tile = plgpu.load(dy_ref.at[pl.ds(r0, block_m), ns], mask=row_ok[:, None] & n_ok[None, :], other=zero)
        return acc + tile.astype(jnp.float32)  # [block_m, block_n] partial sums

    # The trip count is data (0 for an empty expert: its columns are stored as zeros); int32 bounds, as the wgrad's.
    steps = ((hi - lo + block_m - 1) // block_m).astype(jnp.int32)
    acc = jax.lax.fori_loop(jnp.int32(0), steps, m_step, jnp.zeros((block_m, block_n), jnp.float32))
    plgpu.store(db_ref.at[e, ns], jnp.sum(acc, axis=0).astype(db_ref.dtype), mask=n_ok)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def grouped_gemm_dbias_pallas_triton(
    d_y: jax.Array,
    expert_offsets: jax.Array,
    *,
    out_dtype=jnp.float32,
    config: GroupedGemmDbiasConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``d_bias[e] = sum of d_y[rows(e)]``, float32 accumulation; an expert with no rows gets exactly 0.

    Args (validated by ``moe_pallas.ops.grouped_gemm.api.grouped_gemm_dbias``):
      d_y: ``[M_cap, N]`` float32 / bf16 / float16.
      expert_offsets: ``[E + 1]`` int32; expert ``e`` owns rows ``[offsets[e], offsets[e+1])``; rows
        ``>= offsets[-1]`` are never read (a NaN there stays out of ``d_bias``).
      out_dtype: default float32.
      config: launch config (default :func:`heuristic_grouped_gemm_dbias_config`).
      interpret: Pallas interpret mode (default: when ``jax.default_backend() == "cpu"``).

    Grid: ``(cdiv(N, block_n), E)``, static.

    Returns: ``d_bias [E, N]`` in ``out_dtype``.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    M_cap, N = d_y.shape
    E = expert_offsets.shape[0] - 1
    out_dtype = jnp.dtype(out_dtype)
    cfg = config or heuristic_grouped_gemm_dbias_config(M_cap, N, E)
    if M_cap == 0 or N == 0 or E == 0:  # nothing to launch: no rows (every expert empty) or an empty d_bias
        return jnp.zeros((E, N), out_dtype)
    starts, ends = expert_row_ranges(expert_offsets, M_cap)
    kernel = functools.partial(_dbias_kernel, N=N, block_m=cfg.block_m, block_n=cfg.block_n)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((E, N), out_dtype),
        grid=(pl.cdiv(N, cfg.block_n), E),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="grouped_gemm_dbias",
    )(starts, ends, d_y)
