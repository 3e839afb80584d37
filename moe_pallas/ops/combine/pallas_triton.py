"""Combine (un-permute and sum) as a Pallas kernel with the Triton lowering (CONTRACT.md section 5).

Dataflow: per program a ``block_t x block_h`` tile of ``out [T, H]``; for each slot ``j`` of
``topk`` (unrolled at trace time) it reads ``src2dst[t, j]`` and ``w[t, j]`` of its tokens,
gathers the rows ``y[src2dst[t, j], h-block]`` of the local slots (a masked load: a slot with
``src2dst < 0`` reads no memory at all, so a NaN in an unused row of ``y`` never reaches
``out``), and accumulates ``w * y`` in float32. At the end ``acc * rsf`` (if ``rsf != 1``) is
cast once to the output dtype. Tokens with no local slot keep ``acc = 0``.

Row gather with array indices and masks learned from
jax-ml/jax@jax-v0.11.2:jax/experimental/pallas/ops/gpu/rms_norm.py.

**Backward** (CONTRACT.md section 8), ``combine_backward_pallas_triton``, grid ``(cdiv(T, block_t),)``:
a program owns ``block_t`` tokens and walks the hidden dim in ``block_h`` chunks (a ``fori_loop``);
per chunk it loads ``d_out`` once and, per slot (unrolled), stores ``d_y[src2dst[t, j]] = c * w * d_out``
(a plain scatter: every row of ``d_y`` is named by at most one slot; no atomics) and adds
``sum(y[src2dst[t, j]] * d_out)`` to the slot's float32 dot; at the end ``d_topk_weights = c * dot``.
``d_y`` starts as zeros (an aliased zero input, ``input_output_aliases``), so rows no slot names stay 0;
masked lanes of the scatter point past the last row (interpret mode drops them: no lost updates).

Mirror: ``moe_torch/ops/combine/triton.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax import lax

from moe_pallas.ops.combine.config import CombineBackwardConfig, CombineConfig, combine_backward_config, combine_config


def _kernel(y_ref, s_ref, w_ref, out_ref, *, T: int, H: int, topk: int, rsf: float, block_t: int, block_h: int):
    """Grid ``(cdiv(T, block_t), cdiv(H, block_h))``; program ``(i, k)`` writes
    ``out[i*block_t : (i+1)*block_t, k*block_h : (k+1)*block_h]``.

    Refs (whole arrays): ``y_ref [M_cap, H]`` float, ``s_ref [T, topk]`` int32 (src2dst),
    ``w_ref [T, topk]`` float32, ``out_ref [T, H]``.
    """
    i, k = pl.program_id(0), pl.program_id(1)
    t0, h0 = i * block_t, k * block_h
    tok_ok = t0 + jnp.arange(block_t) < T  # [block_t]
    col = h0 + jnp.arange(block_h)  # [block_h]
    col_ok = col < H
    toks, cols = pl.ds(t0, block_t), pl.ds(h0, block_h)
    acc = jnp.zeros((block_t, block_h), jnp.float32)
    for j in range(topk):
        # Slots by index (a traced int32: interpret mode wants no python int next to a slice).
        dst = plgpu.load(s_ref.at[toks, jnp.int32(j)], mask=tok_ok, other=-1)  # [block_t] int32
        w = plgpu.load(w_ref.at[toks, jnp.int32(j)], mask=tok_ok, other=0.0)  # [block_t] float32
        local = dst >= 0
        row = jnp.where(local, dst, 0)  # a safe address; masked off below, never read
        rows = plgpu.load(y_ref.at[row[:, None], col[None, :]], mask=local[:, None] & col_ok[None, :], other=0.0)
        acc += jnp.where(local, w, 0.0)[:, None] * rows.astype(jnp.float32)  # a non-local slot adds exactly 0
    if rsf != 1.0:
        acc = acc * jnp.float32(rsf)
    plgpu.store(out_ref.at[toks, cols], acc.astype(out_ref.dtype), mask=tok_ok[:, None] & col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("routed_scaling_factor", "out_dtype", "config", "interpret"))
def combine_pallas_triton(
    y: jax.Array,
    src2dst: jax.Array,
    topk_weights: jax.Array,
    *,
    routed_scaling_factor: float = 1.0,
    out_dtype=None,
    config: CombineConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``out[t] = rsf * sum_j topk_weights[t, j] * y[src2dst[t, j]]`` over slots with ``src2dst >= 0``.

    Args (validated by ``moe_pallas.ops.combine.api.combine``):
      y: ``[M_cap, H]`` float32 / bf16 / float16, the second GEMM's output in permuted order;
        rows never named by ``src2dst`` are never read.
      src2dst: ``[T, topk]`` int32, ``-1`` for non-local slots.
      topk_weights: ``[T, topk]`` float32.
      routed_scaling_factor: ``rsf`` (a python float, static), applied once to the float32 sum.
      out_dtype: default ``y.dtype``.
      config: launch config (default: :func:`combine_config` of the shapes).
      interpret: run in Pallas interpret mode (default: when ``jax.default_backend() == "cpu"``).

    Grid: ``(cdiv(T, block_t), cdiv(H, block_h))``, static.

    Returns: ``out [T, H]``, accumulated in float32 and cast once; tokens with no local slot get 0.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    T, topk = src2dst.shape
    H = y.shape[1]
    out_dtype = y.dtype if out_dtype is None else jnp.dtype(out_dtype)
    if T == 0 or H == 0 or topk == 0:  # nothing to launch: an empty output or a sum of no slots
        return jnp.zeros((T, H), out_dtype)
    cfg = combine_config(T, H, topk) if config is None else config
    kernel = functools.partial(_kernel, T=T, H=H, topk=topk, rsf=float(routed_scaling_factor),
                               block_t=cfg.block_t, block_h=cfg.block_h)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((T, H), out_dtype),
        grid=(pl.cdiv(T, cfg.block_t), pl.cdiv(H, cfg.block_h)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="combine",
    )(y, src2dst, topk_weights)


# --------------------------------------------------------------------------------------
# backward


def _backward_kernel(do_ref, y_ref, s_ref, w_ref, _zeros_ref, dy_ref, dw_ref, *, T: int, H: int, M_cap: int,
                     topk: int, rsf: float, block_t: int, block_h: int, w_pad: int):
    """Grid ``(cdiv(T, block_t),)``; program ``i`` writes ``d_w[i*block_t : (i+1)*block_t, :]`` and the
    rows ``d_y[src2dst[t, j]]`` of its tokens.

    Refs (whole arrays): ``do_ref [T, H]`` float, ``y_ref [M_cap, H]`` float, ``s_ref [T, topk]`` int32
    (src2dst), ``w_ref [T, topk]`` float32, ``_zeros_ref`` (the zeros aliased to ``dy_ref``; unused) in;
    ``dy_ref [M_cap, H]`` y.dtype and ``dw_ref [T, topk]`` float32 out.
    """
    t0 = pl.program_id(0) * block_t
    tok_ok = t0 + jnp.arange(block_t) < T  # [block_t]
    toks = pl.ds(t0, block_t)
    wcol = jnp.arange(w_pad, dtype=jnp.int32)[None, :]
    dsts, coefs = [], []
    for j in range(topk):  # slots by index (a traced int32: interpret mode wants no python int next to a slice)
        dst = plgpu.load(s_ref.at[toks, jnp.int32(j)], mask=tok_ok, other=-1)  # [block_t] int32
        w = plgpu.load(w_ref.at[toks, jnp.int32(j)], mask=tok_ok, other=0.0)  # [block_t] float32
        dsts.append(dst)
        coefs.append(w * jnp.float32(rsf) if rsf != 1.0 else w)

    def chunk(c, dots):
        h0 = c * block_h
        col = h0 + jnp.arange(block_h)
        col_ok = col < H
        do = plgpu.load(do_ref.at[toks, pl.ds(h0, block_h)], mask=tok_ok[:, None] & col_ok[None, :],
                        other=0.0).astype(jnp.float32)
        for j in range(topk):
            local = dsts[j] >= 0
            mask = local[:, None] & col_ok[None, :]
            ys = plgpu.load(y_ref.at[jnp.where(local, dsts[j], 0)[:, None], col[None, :]], mask=mask, other=0.0)
            dot = jnp.sum(ys.astype(jnp.float32) * do, axis=1)  # 0 for a non-local slot (nothing loaded)
            dots = dots + jnp.where(wcol == j, dot[:, None], 0.0)
            row = jnp.where(mask, dsts[j][:, None], M_cap)  # masked lanes point past the end
            plgpu.store(dy_ref.at[row, col[None, :]], (coefs[j][:, None] * do).astype(dy_ref.dtype), mask=mask)
        return dots

    dots = lax.fori_loop(0, pl.cdiv(H, block_h), chunk, jnp.zeros((block_t, w_pad), jnp.float32))
    if rsf != 1.0:
        dots = dots * jnp.float32(rsf)
    plgpu.store(dw_ref.at[toks, pl.ds(jnp.int32(0), w_pad)], dots, mask=tok_ok[:, None] & (wcol < topk))


@functools.partial(jax.jit, static_argnames=("routed_scaling_factor", "config", "interpret"))
def combine_backward_pallas_triton(
    d_out: jax.Array,
    y: jax.Array,
    src2dst: jax.Array,
    topk_weights: jax.Array,
    *,
    routed_scaling_factor: float = 1.0,
    config: CombineBackwardConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(d_y [M_cap, H] y.dtype, d_topk_weights [T, topk] float32)`` as one Pallas-Triton kernel, ``c = rsf``:
    ``d_y[src2dst[t, j]] = c * w[t, j] * d_out[t]``, ``d_topk_weights[t, j] = c * <y[src2dst[t, j]], d_out[t]>``.

    Args (validated by ``moe_pallas.ops.combine.api.combine_backward``):
      d_out: ``[T, H]`` float32 / bf16 / float16.
      y: ``[M_cap, H]`` float, the forward's input; only rows named by ``src2dst`` are read.
      src2dst: ``[T, topk]`` int32, ``-1`` for non-local slots; a row is named by at most one slot.
      topk_weights: ``[T, topk]`` float32.
      routed_scaling_factor: ``c`` (a python float, static).
      config: launch config (default: :func:`combine_backward_config` of the shapes).
      interpret: run in Pallas interpret mode (default: when ``jax.default_backend() == "cpu"``).

    Grid: ``(cdiv(T, block_t),)``, static.

    Returns: ``(d_y, d_topk_weights)``; rows of ``d_y`` no local slot names are 0, non-local slots get 0.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    T, topk = src2dst.shape
    M_cap, H = y.shape
    if T == 0 or H == 0 or topk == 0:  # nothing to launch
        return jnp.zeros((M_cap, H), y.dtype), jnp.zeros((T, topk), jnp.float32)
    cfg = combine_backward_config(T, H, topk) if config is None else config
    kernel = functools.partial(_backward_kernel, T=T, H=H, M_cap=M_cap, topk=topk, rsf=float(routed_scaling_factor),
                               block_t=cfg.block_t, block_h=cfg.block_h, w_pad=pl.next_power_of_2(topk))
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((M_cap, H), y.dtype), jax.ShapeDtypeStruct((T, topk), jnp.float32)),
        grid=(pl.cdiv(T, cfg.block_t),),
        input_output_aliases={4: 0},  # d_y starts as the zeros: rows no slot names stay 0
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="combine_backward",
    )(d_out, y, src2dst, topk_weights, jnp.zeros((M_cap, H), y.dtype))
