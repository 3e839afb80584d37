"""Routing metadata and the permute (row gather, optionally fused FP8 quantization) as
Pallas kernels with the Triton lowering (CONTRACT.md sections 2-3).

Routing metadata, deterministic (no atomics), for ``topk_ids [T, topk]`` viewed as the
assignments ``a = t*topk + j`` (``M_cap = T*topk``), in ``B = cdiv(M_cap, block_a)`` blocks:

1. ``_count_kernel``, grid ``(B,)``: program ``b`` builds the one-hot ``[block_a, E_pad]`` of
   its assignments' local experts and writes the column sums ``counts[b, :] [E_local]``.
2. XLA (jnp, ``O(B * E_local)``): ``expert_offsets`` is the exclusive cumsum of the per-expert
   totals, and ``base[b, e] = expert_offsets[e] + sum_{b' < b} counts[b', e]`` is the first row
   of block ``b``'s assignments to expert ``e``.
3. ``_scatter_kernel``, grid ``(B,)``: the rank of an assignment within its block and expert is
   the exclusive cumsum of the one-hot along the assignments, so its row is
   ``base[b, e] + rank``: increasing in ``a`` within an expert (the STABLE order), the same
   ints as the reference's stable argsort. The program writes ``src2dst`` for its
   assignments, scatters ``dst2src[row] = a`` for the local ones (distinct rows: no races),
   and writes ``-1`` into the rows ``>= M`` of its own index range ``[b*block_a, (b+1)*block_a)``
   (rows no scatter ever touches).

Permute, grid ``(cdiv(M_cap, block_m), n_col_blocks)``: program ``(i, k)`` reads ``dst2src``
of rows ``[i*block_m, (i+1)*block_m)``, gathers ``x[dst2src // topk]`` for columns
``[k*block_h, (k+1)*block_h)`` with a masked load (rows with ``dst2src < 0`` read no memory and
are zero) and stores the rows, or their FP8 codes and scales exactly as
``moe_pallas/ops/activation/pallas_triton.py`` does (same modes, same exact rounding
``fp8_round_quotient`` that survives the GPU's approximate ``/``). Zero rows get the zero-row
scale ``1e-10 / 448`` because their amax is 0.

Masked gathers with array indices learned from
jax-ml/jax@jax-v0.11.2:jax/experimental/pallas/ops/gpu/rms_norm.py (as ``combine``).

Permute backward (CONTRACT.md section 8), grid ``(cdiv(T, block_t), cdiv(H, block_h))``: program
``(i, k)`` gathers, for each slot ``j`` (unrolled), the rows ``d_xp[src2dst[t, j]]`` of its tokens
(masked by ``src2dst >= 0``: a non-local slot reads nothing) and sums them in float32 into
``d_x[t, k-block]``; no atomics, and rows no slot names are never read.

Mirror: ``moe_torch/ops/permute/triton.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_pallas.ops.permute.config import (
    MAX_TILE_ELEMENTS,
    PermuteBackwardConfig,
    PermuteConfig,
    RoutingMetadataConfig,
    permute_backward_config,
    permute_config,
    routing_metadata_config,
)
from moe_pallas.ops.quant.pallas_triton import kernel_div_rn, quantize_div_fp8_kernel
from moe_pallas.ops.quant.reference import FP8_DTYPE, scale_from_amax


# --------------------------------------------------------------------------------------
# Routing metadata


def _one_hot(ids_ref, *, M_cap: int, expert_start: int, E_local: int, block_a: int, e_pad: int):
    """The program's assignments: ``(a0, a [block_a] int32, local [block_a] bool, onehot [block_a, e_pad] int32)``.

    Lanes past ``M_cap`` and non-local ids (outside ``[expert_start, expert_start + E_local)``,
    compared in the ids' own dtype: no wrap-around) have an all-zero one-hot row.
    """
    a0 = pl.program_id(0) * block_a
    a = a0 + jnp.arange(block_a, dtype=jnp.int32)
    in_range = a < M_cap
    ids = plgpu.load(ids_ref.at[pl.ds(a0, block_a)], mask=in_range, other=-1)  # [block_a]
    local = in_range & (ids >= expert_start) & (ids < expert_start + E_local)
    e = jnp.where(local, ids - expert_start, -1).astype(jnp.int32)
    onehot = (e[:, None] == jnp.arange(e_pad, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    return a0, a, local, onehot


def _count_kernel(ids_ref, counts_ref, *, M_cap: int, expert_start: int, E_local: int, block_a: int, e_pad: int):
    """Grid ``(B,)``. Refs: ``ids_ref [M_cap]`` int (flat ``topk_ids``) in;
    ``counts_ref [B, E_local]`` int32 out: row ``b`` counts block ``b``'s assignments per local expert."""
    b = pl.program_id(0)
    _, _, _, onehot = _one_hot(ids_ref, M_cap=M_cap, expert_start=expert_start, E_local=E_local, block_a=block_a,
                            e_pad=e_pad)
    cols = jnp.arange(e_pad)
    plgpu.store(counts_ref.at[b, pl.ds(jnp.int32(0), e_pad)], jnp.sum(onehot, axis=0), mask=cols < E_local)


def _scatter_kernel(ids_ref, base_ref, m_ref, s2d_ref, d2s_ref, *, M_cap: int, expert_start: int, E_local: int,
                    block_a: int, e_pad: int):
    """Grid ``(B,)``. Refs: ``ids_ref [M_cap]`` int, ``base_ref [B, E_local]`` int32 (first row of
    block ``b``'s assignments to each expert), ``m_ref [1]`` int32 (``M``) in; ``s2d_ref [M_cap]``
    int32 (flat ``src2dst``) and ``d2s_ref [M_cap]`` int32 (``dst2src``) out."""
    b = pl.program_id(0)
    a0, a, local, onehot = _one_hot(ids_ref, M_cap=M_cap, expert_start=expert_start, E_local=E_local, block_a=block_a,
                                e_pad=e_pad)
    cols = jnp.arange(e_pad)
    base = plgpu.load(base_ref.at[b, pl.ds(jnp.int32(0), e_pad)], mask=cols < E_local, other=0)  # [e_pad]
    rank = jnp.cumsum(onehot, axis=0) - onehot  # earlier assignments of the block on the same expert
    dst = jnp.sum(onehot * (rank + base[None, :]), axis=1)  # [block_a]; 0 where not local
    in_range = a < M_cap
    plgpu.store(s2d_ref.at[pl.ds(a0, block_a)], jnp.where(local, dst, -1), mask=in_range)
    # Masked-off lanes point past the end: the GPU does not touch them, and interpret mode (a
    # read-modify-write scatter, where duplicate addresses would lose updates) drops them.
    plgpu.store(d2s_ref.at[jnp.where(local, dst, M_cap)], a, mask=local)
    M = plgpu.load(m_ref.at[pl.ds(jnp.int32(0), 1)])  # [1]
    plgpu.store(d2s_ref.at[pl.ds(a0, block_a)], jnp.full((block_a,), -1, jnp.int32), mask=in_range & (a >= M))


@functools.partial(jax.jit, static_argnames=("expert_start", "num_local_experts", "config", "interpret"))
def routing_metadata_pallas_triton(
    topk_ids: jax.Array,
    *,
    expert_start: int,
    num_local_experts: int,
    config: RoutingMetadataConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Stable sort of the assignments by local expert, as two Pallas-Triton kernels and a jnp scan.

    Args (validated by ``moe_pallas.ops.permute.api.routing_metadata``):
      topk_ids: ``[T, topk]`` int32 / int64; ids outside ``[expert_start, expert_start + E_local)`` are non-local.
      expert_start, num_local_experts: this rank's experts (``E_local = num_local_experts``), static.
      config: launch config (default: :func:`routing_metadata_config` of the shapes).
      interpret: run in Pallas interpret mode (default: when ``jax.default_backend() == "cpu"``).

    Grid: ``(cdiv(M_cap, block_a),)`` for both kernels, static.

    Returns: ``(expert_offsets [E_local+1], src2dst [T, topk], dst2src [M_cap])``, int32, equal to
    ``routing_metadata_reference``.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    T, topk = topk_ids.shape
    M_cap, E_local = T * topk, num_local_experts
    if M_cap == 0:
        return (jnp.zeros((E_local + 1,), jnp.int32), jnp.zeros((T, topk), jnp.int32), jnp.zeros((0,), jnp.int32))
    cfg = routing_metadata_config(M_cap, E_local) if config is None else config
    e_pad = pl.next_power_of_2(E_local)
    if cfg.block_a * e_pad > MAX_TILE_ELEMENTS:
        raise NotImplementedError(
            f"routing_metadata[pallas_triton]: a one-hot tile of block_a * E_pad = {cfg.block_a} * {e_pad} elements "
            f"is over Triton's {MAX_TILE_ELEMENTS}")
    B = pl.cdiv(M_cap, cfg.block_a)
    ids = topk_ids.reshape(M_cap)
    static = dict(M_cap=M_cap, expert_start=expert_start, E_local=E_local, block_a=cfg.block_a, e_pad=e_pad)
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    counts = pl.pallas_call(
        functools.partial(_count_kernel, **static),
        out_shape=jax.ShapeDtypeStruct((B, E_local), jnp.int32),
        grid=(B,), compiler_params=params, interpret=interpret, name="routing_metadata_count",
    )(ids)
    totals = jnp.sum(counts, axis=0, dtype=jnp.int32)
    expert_offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(totals, dtype=jnp.int32)])
    base = expert_offsets[None, :-1] + jnp.cumsum(counts, axis=0, dtype=jnp.int32) - counts  # [B, E_local]
    src2dst, dst2src = pl.pallas_call(
        functools.partial(_scatter_kernel, **static),
        out_shape=(jax.ShapeDtypeStruct((M_cap,), jnp.int32), jax.ShapeDtypeStruct((M_cap,), jnp.int32)),
        grid=(B,), compiler_params=params, interpret=interpret, name="routing_metadata_scatter",
    )(ids, base, expert_offsets[-1:])
    return expert_offsets, src2dst.reshape(T, topk), dst2src


# --------------------------------------------------------------------------------------
# Permute


def _permute_kernel(x_ref, d_ref, *refs, mode: str, M_cap: int, H: int, topk: int, block_m: int, block_h: int,
                    div_rn: bool = False):
    """Grid ``(cdiv(M_cap, block_m), n_col_blocks)``; program ``(i, k)`` owns rows
    ``[i*block_m, (i+1)*block_m)`` and columns ``[k*block_h, (k+1)*block_h)`` of ``x_permuted``.

    Refs (whole arrays): ``x_ref [T, H]`` float, ``d_ref [M_cap]`` int32 (``dst2src``) in; then by ``mode``:

    - ``"cast"``: ``out_ref [M_cap, H]`` in ``x.dtype`` out.
    - ``"quant"``: ``q_ref [M_cap, H]`` fp8 and ``scale_ref [M_cap, n_col_blocks]`` f32 out (a
      column block is one scale group).
    - ``"amax"``: ``amax_ref [M_cap, n_col_blocks]`` f32 out (first pass of two-pass per-token).
    - ``"quant_rows"``: ``scale_ref [M_cap, 1]`` f32 in, ``q_ref [M_cap, H]`` fp8 out (second pass).
    - ``"quant_static"``: ``scale_ref [1]`` f32 in (per-tensor), ``q_ref [M_cap, H]`` fp8 out.

    ``div_rn``: the FP8 division's form (:func:`~moe_pallas.ops.quant.pallas_triton.quantize_div_fp8_kernel`).
    """
    i, k = pl.program_id(0), pl.program_id(1)
    row0, col0 = i * block_m, k * block_h
    row_ok = row0 + jnp.arange(block_m) < M_cap
    col = col0 + jnp.arange(block_h)
    col_ok = col < H
    mask = row_ok[:, None] & col_ok[None, :]
    rows, cols = pl.ds(row0, block_m), pl.ds(col0, block_h)
    src = plgpu.load(d_ref.at[rows], mask=row_ok, other=-1)  # [block_m]
    valid = src >= 0
    token = jnp.where(valid, src // topk, 0)  # a safe address; masked off below, never read
    x = plgpu.load(x_ref.at[token[:, None], col[None, :]], mask=valid[:, None] & col_ok[None, :], other=0.0)
    if mode == "cast":
        (out_ref,) = refs
        plgpu.store(out_ref.at[rows, cols], x.astype(out_ref.dtype), mask=mask)
        return
    a = x.astype(jnp.float32)
    if mode == "quant_rows":
        scale_ref, q_ref = refs
        scale = plgpu.load(scale_ref.at[rows, jnp.int32(0)], mask=row_ok, other=1.0)
        plgpu.store(q_ref.at[rows, cols], quantize_div_fp8_kernel(a, scale[:, None], div_rn=div_rn), mask=mask)
        return
    if mode == "quant_static":
        scale_ref, q_ref = refs
        scale = plgpu.load(scale_ref.at[pl.ds(jnp.int32(0), 1)])  # [1]
        plgpu.store(q_ref.at[rows, cols], quantize_div_fp8_kernel(a, scale[:, None], div_rn=div_rn), mask=mask)
        return
    amax = jnp.max(jnp.abs(a), axis=1)  # [block_m]; masked lanes are 0
    if mode == "amax":
        (amax_ref,) = refs
        plgpu.store(amax_ref.at[rows, k], amax, mask=row_ok)
        return
    q_ref, scale_ref = refs
    scale = scale_from_amax(amax)
    plgpu.store(q_ref.at[rows, cols], quantize_div_fp8_kernel(a, scale[:, None], div_rn=div_rn), mask=mask)
    plgpu.store(scale_ref.at[rows, k], scale, mask=row_ok)


def _call(x, dst2src, mode, out_shape, extra_inputs, topk: int, cfg: PermuteConfig, n_col_blocks: int,
          interpret: bool):
    M_cap = dst2src.shape[0]
    kernel = functools.partial(_permute_kernel, mode=mode, M_cap=M_cap, H=x.shape[1], topk=topk,
                               block_m=cfg.block_m, block_h=cfg.block_h, div_rn=kernel_div_rn(interpret))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(M_cap, cfg.block_m), n_col_blocks),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"permute_{mode}",
    )(x, dst2src, *extra_inputs)


def check_supported(H: int, quant: str | None, group_size: int, cfg: PermuteConfig) -> None:
    """Raise ``NotImplementedError`` for a valid request this backend cannot serve."""
    if cfg.block_m * cfg.block_h > MAX_TILE_ELEMENTS:
        raise NotImplementedError(
            f"permute[pallas_triton]: a tile of block_m * block_h = {cfg.block_m} * {cfg.block_h} elements is over "
            f"Triton's {MAX_TILE_ELEMENTS}")
    if quant == "fp8_per_token_group" and cfg.block_h != group_size:
        raise NotImplementedError(
            f"permute[pallas_triton]: per-token-group quantization needs block_h == group_size; "
            f"got group_size={group_size}, block_h={cfg.block_h}")
    if quant == "fp8_per_token" and not cfg.two_pass and cfg.block_h < H:
        raise NotImplementedError(
            f"permute[pallas_triton]: one-pass per-token quantization needs block_h >= H (={H}); "
            f"got block_h={cfg.block_h} (set two_pass=True)")


@functools.partial(jax.jit, static_argnames=("topk", "quant", "group_size", "config", "interpret"))
def permute_pallas_triton(
    x: jax.Array,
    dst2src: jax.Array,
    *,
    topk: int,
    quant: str | None = None,
    group_size: int = 128,
    scale: jax.Array | None = None,
    config: PermuteConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """``x_permuted[r] = x[dst2src[r] // topk]`` (zero where ``dst2src < 0``), cast or quantized to FP8.

    Args (validated by ``moe_pallas.ops.permute.api.permute``):
      x: ``[T, H]`` float32 / bf16 / float16.
      dst2src: ``[M_cap = T*topk]`` int32, ``-1`` for rows ``>= M``.
      topk: slots per token, static.
      quant: ``None`` (rows in ``x.dtype``), ``"fp8_per_token"`` (scale ``[M_cap, 1]``),
        ``"fp8_per_token_group"`` (scale ``[M_cap, H // group_size]``) or ``"fp8_per_tensor"``
        (the given ``scale []`` float32, returned as is).
      config: launch config (default: :func:`permute_config` of the shapes).
      interpret: run in Pallas interpret mode (default: when ``jax.default_backend() == "cpu"``).

    Grid: ``(cdiv(M_cap, block_m), n_col_blocks)``, ``n_col_blocks = cdiv(H, block_h)``
    (``H // group_size`` for per-token-group, 1 for one-pass per-token); static.

    Returns: ``(x_permuted [M_cap, H], None)`` or ``(q [M_cap, H] float8_e4m3fn, scale)``, bit-identical
    to ``permute_reference``.

    Raises: NotImplementedError (group_size not a power of two, or a config that does not fit the quantization).
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    T, H = x.shape
    M_cap = dst2src.shape[0]
    if quant == "fp8_per_token_group" and group_size & (group_size - 1):
        raise NotImplementedError(
            f"permute[pallas_triton]: group_size must be a power of two (a Triton block is); got group_size={group_size}")
    cfg = permute_config(M_cap, H, quant, group_size) if config is None else config
    check_supported(H, quant, group_size, cfg)
    n_groups = {None: 0, "fp8_per_token": 1, "fp8_per_tensor": 0,
                "fp8_per_token_group": H // group_size}[quant]
    if M_cap == 0 or H == 0:  # nothing to launch; the contract's values for empty rows
        if quant is None:
            return jnp.zeros((M_cap, H), x.dtype), None
        if quant == "fp8_per_tensor":
            return jnp.zeros((M_cap, H), FP8_DTYPE), scale
        return jnp.zeros((M_cap, H), FP8_DTYPE), jnp.full((M_cap, n_groups), scale_from_amax(jnp.float32(0.0)))
    n_blocks = pl.cdiv(H, cfg.block_h)
    run = functools.partial(_call, x, dst2src, topk=topk, cfg=cfg, interpret=interpret)
    q_shape = jax.ShapeDtypeStruct((M_cap, H), FP8_DTYPE)
    if quant is None:
        return run(mode="cast", out_shape=jax.ShapeDtypeStruct((M_cap, H), x.dtype), extra_inputs=(),
                   n_col_blocks=n_blocks), None
    if quant == "fp8_per_tensor":
        s = scale.astype(jnp.float32).reshape(1)
        return run(mode="quant_static", out_shape=q_shape, extra_inputs=(s,), n_col_blocks=n_blocks), scale
    if quant == "fp8_per_token" and cfg.two_pass:
        amax = run(mode="amax", out_shape=jax.ShapeDtypeStruct((M_cap, n_blocks), jnp.float32), extra_inputs=(),
                   n_col_blocks=n_blocks)
        s = scale_from_amax(amax.max(axis=1, keepdims=True))  # [M_cap, 1]: max is exact in any order
        return run(mode="quant_rows", out_shape=q_shape, extra_inputs=(s,), n_col_blocks=n_blocks), s
    return run(mode="quant", out_shape=(q_shape, jax.ShapeDtypeStruct((M_cap, n_groups), jnp.float32)),
               extra_inputs=(), n_col_blocks=n_groups)


# --------------------------------------------------------------------------------------
# Permute backward


def _backward_kernel(dxp_ref, s_ref, dx_ref, *, T: int, H: int, topk: int, block_t: int, block_h: int):
    """Grid ``(cdiv(T, block_t), cdiv(H, block_h))``; program ``(i, k)`` writes
    ``d_x[i*block_t : (i+1)*block_t, k*block_h : (k+1)*block_h]``.

    Refs (whole arrays): ``dxp_ref [M_cap, H]`` float, ``s_ref [T, topk]`` int32 (src2dst) in;
    ``dx_ref [T, H]`` out.
    """
    i, k = pl.program_id(0), pl.program_id(1)
    t0, h0 = i * block_t, k * block_h
    tok_ok = t0 + jnp.arange(block_t) < T
    col = h0 + jnp.arange(block_h)
    col_ok = col < H
    toks = pl.ds(t0, block_t)
    acc = jnp.zeros((block_t, block_h), jnp.float32)
    for j in range(topk):  # slots by index (a traced int32: interpret mode wants no python int next to a slice)
        dst = plgpu.load(s_ref.at[toks, jnp.int32(j)], mask=tok_ok, other=-1)  # [block_t] int32
        local = dst >= 0
        rows = plgpu.load(dxp_ref.at[jnp.where(local, dst, 0)[:, None], col[None, :]],
                          mask=local[:, None] & col_ok[None, :], other=0.0)
        acc += rows.astype(jnp.float32)  # a non-local slot adds exactly 0
    plgpu.store(dx_ref.at[toks, pl.ds(h0, block_h)], acc.astype(dx_ref.dtype), mask=tok_ok[:, None] & col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def permute_backward_pallas_triton(
    d_xp: jax.Array,
    src2dst: jax.Array,
    *,
    out_dtype=None,
    config: PermuteBackwardConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``d_x[t] = sum_j d_xp[src2dst[t, j]]`` over local slots, float32, cast once, as one Pallas-Triton kernel.

    Args (validated by ``moe_pallas.ops.permute.api.permute_backward``):
      d_xp: ``[M_cap, H]`` float32 / bf16 / float16; only rows named by ``src2dst`` are read.
      src2dst: ``[T, topk]`` int32, ``-1`` for non-local slots.
      out_dtype: default ``d_xp.dtype``.
      config: launch config (default: :func:`permute_backward_config` of the shapes).
      interpret: run in Pallas interpret mode (default: when ``jax.default_backend() == "cpu"``).

    Grid: ``(cdiv(T, block_t), cdiv(H, block_h))``, static.

    Returns: ``d_x [T, H]`` in ``out_dtype``; a token with no local slot gets 0.

    Raises: NotImplementedError (a tile over Triton's element limit).
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    T, topk = src2dst.shape
    H = d_xp.shape[1]
    out_dtype = d_xp.dtype if out_dtype is None else jnp.dtype(out_dtype)
    if T == 0 or H == 0 or topk == 0:  # nothing to launch: an empty result or a sum of no slots
        return jnp.zeros((T, H), out_dtype)
    cfg = permute_backward_config(T, H) if config is None else config
    if cfg.block_t * cfg.block_h > MAX_TILE_ELEMENTS:
        raise NotImplementedError(
            f"permute_backward[pallas_triton]: a tile of block_t * block_h = {cfg.block_t} * {cfg.block_h} elements "
            f"is over Triton's {MAX_TILE_ELEMENTS}")
    kernel = functools.partial(_backward_kernel, T=T, H=H, topk=topk, block_t=cfg.block_t, block_h=cfg.block_h)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((T, H), out_dtype),
        grid=(pl.cdiv(T, cfg.block_t), pl.cdiv(H, cfg.block_h)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="permute_backward",
    )(d_xp, src2dst)
