"""Grouped GEMM ``y[m] = x[m] @ w[e(m)].T`` as a Pallas kernel with the Triton lowering (CONTRACT.md section 4).

Dataflow: ``x [M_cap, K]`` rows are grouped by expert (``expert_offsets [E + 1]``), ``w [E, N, K]``
is K-major (PyTorch/HF layout). Outside the kernel, plain jnp turns ``expert_offsets`` into
per-grid-step metadata (:func:`tile_metadata`: which expert and which rows each step owns). A
program ``(s, j)`` reads its three int32 scalars, loops over ``K`` in ``block_k`` steps
(``x`` tile ``[block_m, block_k]`` times the weight tile ``[block_n, block_k]``, contracted on
their K dims with ``lax.dot_general``, no transpose materialized; float32 accumulation), applies
the FP8 scales, and stores the rows it owns (a masked store) of ``y[:, j*block_n : (j+1)*block_n]``.

Grid: ``(cdiv(M_cap, block_m) + E, cdiv(N, block_n))``, static (an upper bound; steps beyond the
real tile count own no rows and do nothing); with ``group_m > 1`` the same programs on a 1-D grid in
the grouped launch order (:func:`_launch_order`). The metadata is computed on the device, so there is
no host sync and the op jits; it is passed as ordinary int32 inputs, not through
``PrefetchScalarGridSpec`` (which does not lower for the Triton backend).

Dtypes: ``x``/``w`` float32 / bf16 / float16 (float32 dots at IEEE precision, not TF32), or
float8_e4m3fn codes with float32 dequantization multipliers: ``x_scale`` per-tensor ``[]``,
per-token ``[M_cap, 1]`` or per-token-group ``[M_cap, K // G]`` (always indexed by row), times
``w_scale`` per-expert ``[E]``, per-output-channel ``[E, N]`` or ``128 x 128`` blocks
``[E, ceil(N/128), ceil(K/128)]``. Scales that vary along K (per-token-group, block) multiply each
K step's partial sum before it is accumulated; the others multiply the finished accumulator.
4-bit weights (CONTRACT.md section 9): ``w [E, N, K // 2]`` uint8 packed codes (``w_format`` ``"mxfp4"``
or ``"int4"``) with ``w_scale [E, N, K // 32]`` (uint8 e8m0 / bf16), ``x`` float: each K step decodes
its weight bytes in the kernel (:func:`_w4_step_part`: bf16 ``x`` compiled on packed registers, else in float32)
and feeds the weights, in ``x.dtype``, to the dots. An optional per-expert ``bias [E, N]``
(CONTRACT.md section 4; passed to the kernel in float32) is added to the finished accumulator, after the
scales, before the one rounding to the output dtype.

Learned from: the tile-to-group metadata and the static grid bound ``m_tiles + num_groups - 1`` of
jax-ml/jax@jax-v0.11.2:jax/experimental/pallas/ops/tpu/megablox/gmm.py (``make_group_metadata``),
here with explicit row ranges instead of a per-row group-id mask, and with one extra group for the
unused rows; masked loads/stores as in jax-ml/jax@jax-v0.11.2:jax/experimental/pallas/ops/gpu/rms_norm.py.
Pointer offsets are the Pallas-Triton lowering's: 64-bit when an array is over 4 GiB
(``_compute_offsets_from_indices`` in jax/_src/pallas/triton/lowering.py), and, through
``moe_pallas.ops.common.patch_pallas_triton_offsets``, also for 1-byte arrays of 2**31 to 2**32
elements (a DeepSeek-V3 FP8 ``w2``), which that lowering left at signed 32 bits.

Mirror: ``moe_torch/ops/grouped_gemm/triton.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_contract.w4_packed_asm import (BF16_E8M0_ZERO_BITS, BF16_NAN_BITS, PACKED_ASM_HALF_CONSTRAINTS,
                                      PACKED_HALF_ASM)
from moe_pallas.ops import common as _common  # its import applies patch_pallas_triton_offsets
from moe_pallas.ops.grouped_gemm.config import (SCALE_BLOCK, GroupedGemmConfig, gpu_device_spec,
                                                 grouped_gemm_config, triton_config_problem)
from moe_pallas.ops.grouped_gemm.reference import grouped_gemm_reference
from moe_pallas.ops.quant.reference import (E8M0_NAN, W4_GROUP, e2m1_to_float32, e8m0_to_float32,
                                            int4_to_float32, mma_codes_for_kernel)

FP8_DTYPE = jnp.float8_e4m3fn


def tile_metadata(expert_offsets: jax.Array, M_cap: int, E: int, block_m: int,
                  row_align: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per grid step ``s``: ``(step_expert, step_lo, step_hi)``, each ``[cdiv(M_cap, block_m) + E]`` int32
    (``[cdiv(M_cap + (row_align - 1) * (E + 1), block_m) + E]`` with ``row_align``).

    ``row_align`` (the warp-specialized Mosaic GPU kernel: 8, its TMA row granule): tiles start at each group's own
    first row rounded down to a multiple of ``row_align`` instead of the global grid ``t * block_m``: group ``g``
    takes ``cdiv(ends[g] - base[g], block_m)`` tiles ``[base[g] + j * block_m, ...)``, ``base[g] = starts[g] //
    row_align * row_align``, so that no tile is spent on a few rows at a group's start (a DeepSeek-V3 layer's ~128
    rows an expert on 64-row tiles took ~3 tiles an expert on the global grid, ~2.6 aligned). A step's tile starts at
    ``step_lo // row_align * row_align``. Bound: a sum of ``E + 1`` ceilings exceeds the ceiling of the sum by at most
    ``E``, and the groups' extents sum to at most ``M_cap + (row_align - 1) * (E + 1)``.

    Step ``s`` owns rows ``[step_lo[s], step_hi[s])``, all inside the row tile that starts at
    ``(step_lo[s] // block_m) * block_m``, and multiplies them by ``w[step_expert[s]]``;
    ``step_expert == E`` means "write zeros" (the unused rows ``>= M``). A step with
    ``lo == hi`` owns nothing. Plain jnp, jittable, no host sync. Step by step:

    1. Groups. Group ``g < E`` is expert ``g``: rows ``[starts[g], ends[g])`` with
       ``ends[g] = offsets[g+1]`` and ``starts[g] = ends[g-1]`` (``starts[0] = 0``, as the
       reference assigns rows before ``offsets[1]`` to expert 0). One more group ``E`` holds the
       unused capacity ``[offsets[E], M_cap)``, which must come out zero. The ``E + 1`` groups
       tile ``[0, M_cap)`` exactly. Offsets are clipped to ``[0, M_cap]`` and made non-decreasing
       first, so that even a malformed ``expert_offsets`` never makes a step address outside ``x``.
    2. Tiles per group. A non-empty group touches row tiles ``starts // block_m`` through
       ``(ends - 1) // block_m``; an empty group touches none (it gets no step: costs nothing).
    3. Static bound. Consecutive non-empty groups share a tile only at their boundary, so the
       tile count is at most ``m_tiles + (non-empty groups - 1) <= m_tiles + E`` with
       ``m_tiles = cdiv(M_cap, block_m)`` (megablox's ``m_tiles + num_groups - 1`` with
       ``E + 1`` groups). That is the grid's first dimension.
    4. Step -> group. ``step_end = cumsum(tiles)``; step ``s`` belongs to the first group with
       ``step_end[g] > s`` (``searchsorted(..., side="right")``); empty groups have
       ``tiles == 0`` and are never chosen. Steps past ``step_end[-1]`` are padding.
    5. Step -> rows. The step's tile is ``first_tile[g] + (s - step_start[g])``; it owns the
       intersection of that tile with the group: ``lo = max(starts[g], tile * block_m)``,
       ``hi = min(ends[g], (tile + 1) * block_m)``. Different steps own disjoint rows, so two
       programs never write the same row (no race), even when a tile straddles two experts.
    """
    off = jnp.clip(expert_offsets.astype(jnp.int32), 0, M_cap)
    off = jax.lax.cummax(off)
    ends = jnp.concatenate([off[1:], jnp.full((1,), M_cap, jnp.int32)])  # [E + 1]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])  # [E + 1]
    nonempty = ends > starts
    # each group's first tile starts at its first row rounded down to row_align (the global grid: to block_m)
    base = starts // (row_align or block_m) * (row_align or block_m)
    tiles = jnp.where(nonempty, (ends - base + block_m - 1) // block_m, 0)
    n_steps = pl.cdiv(M_cap + (row_align - 1) * (E + 1) if row_align else M_cap, block_m) + E
    step_end = jnp.cumsum(tiles)
    step_start = step_end - tiles
    s = jnp.arange(n_steps, dtype=jnp.int32)
    # E + 1 for padding steps. compare_all: one fused [n_steps, E + 1] comparison; the default binary search lowers
    # to a while loop of log2(E + 1) iterations, a few kernel launches each on the GPU (same result)
    g = jnp.searchsorted(step_end, s, side="right", method="compare_all").astype(jnp.int32)
    used = g <= E
    g = jnp.minimum(g, E)
    row0 = base[g] + (s - step_start[g]) * block_m
    lo = jnp.maximum(starts[g], row0)
    hi = jnp.minimum(ends[g], row0 + block_m)
    step_expert = jnp.where(used, g, E).astype(jnp.int32)
    step_lo = jnp.where(used, lo, 0).astype(jnp.int32)
    step_hi = jnp.where(used, hi, 0).astype(jnp.int32)
    return step_expert, step_lo, step_hi


def _w4_step_part(x_ref, w_ref, ws_ref, e, rows_ds, row_ok, cols_ds, col_ok, k0, K: int, w_format: str,
                  block_m: int, block_n: int, block_k: int, precision, packed_decode: bool):
    """``x[rows, k0 : k0 + block_k] @ wd[e, cols, k0 : k0 + block_k].T`` (float32 ``[block_m, block_n]``) for one K
    step of 4-bit weights: ``x``'s tile loaded once and split into its
    even / odd columns in registers (reshape + split), the step's packed bytes and its ``block_k // 32`` scales per
    row (broadcast over their 16 bytes), decoded into the low / high nibbles' values (``packed_decode``: bf16 ``x``,
    compiled: by ``PACKED_HALF_ASM``, one call a nibble; else in float32, rounded to ``x.dtype``), and two dots. Masked: rows outside ``[lo, hi)``, columns ``>= N`` and K past ``K`` read zeros (code 0 with scale 0 is 0)."""
    half, groups = block_k // 2, block_k // W4_GROUP
    k_ok = k0 + jnp.arange(block_k) < K
    xt = plgpu.load(x_ref.at[rows_ds, pl.ds(k0, block_k)], mask=row_ok[:, None] & k_ok[None, :],
                    other=jnp.zeros((), x_ref.dtype))  # [block_m, block_k]
    x_even, x_odd = (p.reshape(block_m, half) for p in jnp.split(xt.reshape(block_m, half, 2), 2, axis=2))
    kp_ok = k0 // 2 + jnp.arange(half) < K // 2
    packed_u8 = plgpu.load(w_ref.at[e, cols_ds, pl.ds(k0 // 2, half)], mask=col_ok[:, None] & kp_ok[None, :],
                           other=jnp.zeros((), w_ref.dtype))  # [block_n, half]
    kg_ok = k0 // W4_GROUP + jnp.arange(groups) < K // W4_GROUP
    s = plgpu.load(ws_ref.at[e, cols_ds, pl.ds(k0 // W4_GROUP, groups)], mask=col_ok[:, None] & kg_ok[None, :],
                   other=jnp.zeros((), ws_ref.dtype))  # [block_n, groups]
    def per_byte(v):  # [block_n, groups] -> [block_n, half]: each group's value over its 16 bytes
        return jnp.broadcast_to(v[:, :, None], (block_n, groups, W4_GROUP // 2)).reshape(block_n, half)

    if packed_decode:
        if w_format == "mxfp4":
            b = s.astype(jnp.int32)
            bits = jnp.where(b == 0, BF16_E8M0_ZERO_BITS, jnp.where(b == E8M0_NAN, BF16_NAN_BITS, b << 7))
            sb = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)
        else:
            sb = s.astype(jnp.bfloat16)
        w_lo, w_hi = (plgpu.elementwise_inline_asm(
            PACKED_HALF_ASM[w_format, which], args=[packed_u8, per_byte(sb)], constraints=PACKED_ASM_HALF_CONSTRAINTS,
            pack=4, result_shape_dtypes=[jax.ShapeDtypeStruct(packed_u8.shape, jnp.bfloat16)])[0]
            for which in ("low", "high"))
    else:  # interpret mode, float16 / float32 x: the float32 decode, rounded to x's dtype
        scale, decode = (e8m0_to_float32(s), e2m1_to_float32) if w_format == "mxfp4" else \
            (s.astype(jnp.float32), int4_to_float32)
        scale = per_byte(scale)
        packed = packed_u8.astype(jnp.int32)
        w_lo = (decode(packed & 15) * scale).astype(x_ref.dtype)
        w_hi = (decode(packed >> 4) * scale).astype(x_ref.dtype)
    dims = (((1,), (1,)), ((), ()))
    part = jax.lax.dot_general(x_even, w_lo, dims, precision=precision, preferred_element_type=jnp.float32)
    return part + jax.lax.dot_general(x_odd, w_hi, dims, precision=precision, preferred_element_type=jnp.float32)


def _launch_order(t, n_steps: int, n_cols: int, group_m: int):
    """Program ``t`` of the 1-D grid ``[n_steps * n_cols]`` -> ``(step s, column tile j)``, a bijection: the
    steps in groups of ``group_m`` consecutive ones (the last may be smaller), each group sweeping all column
    tiles before the next, step fastest inside it (moe_torch's ``_launch_order``; triton-lang/triton
    ``python/tutorials/03-matrix-multiplication.py``, "L2 Cache Optimizations")."""
    per_group = group_m * n_cols
    first = (t // per_group) * group_m
    size = jnp.minimum(n_steps - first, group_m)
    local = t % per_group
    return first + local % size, local // size


def _kernel(expert_ref, lo_ref, hi_ref, x_ref, w_ref, *refs, E: int, N: int, K: int, x_scale_kind: str | None,
            w_scale_kind: str | None, group_size: int, block_m: int, block_n: int, block_k: int, precision,
            w_format: str | None = None, has_bias: bool = False, packed_decode: bool = False, group_m: int = 1,
            n_steps: int = 0):
    """One ``block_m x block_n`` tile of ``y`` for the rows of one expert.

    Grid ``(cdiv(M_cap, block_m) + E, cdiv(N, block_n))`` (``group_m > 1``: the same ``n_steps * n_cols``
    programs on one axis, :func:`_launch_order`); program ``(s, j)`` owns rows
    ``[lo_ref[s], hi_ref[s])`` (inside one row tile) and columns ``[j*block_n, (j+1)*block_n)``.

    Refs (whole arrays): ``expert_ref, lo_ref, hi_ref [n_steps]`` int32 (:func:`tile_metadata`);
    ``x_ref [M_cap, K]``; ``w_ref [E, N, K]``; then, for FP8, ``xs_ref`` (``[1]`` per-tensor,
    ``[M_cap]`` per-token, ``[M_cap, K // G]`` per-token-group) and ``ws_ref`` (``[E]``,
    ``[E, N]`` or ``[E, ceil(N/128), ceil(K/128)]``) float32; for 4-bit ``w_format``, ``w_ref [E, N, K // 2]``
    uint8 and ``ws_ref [E, N, K // 32]`` (uint8 / bf16) instead; with ``has_bias``, ``b_ref [E, N]`` float32;
    last ``y_ref [M_cap, N]``.
    """
    *refs, y_ref = refs
    b_ref = refs.pop() if has_bias else None
    if w_format is not None:
        (ws_ref,) = refs
        xs_ref = None
    elif x_scale_kind is None:
        xs_ref = ws_ref = None
    else:
        xs_ref, ws_ref = refs
    if group_m == 1:
        s, j = pl.program_id(0), pl.program_id(1)
    else:
        s, j = _launch_order(pl.program_id(0), n_steps, pl.cdiv(N, block_n), group_m)
    e, lo, hi = expert_ref[s], lo_ref[s], hi_ref[s]

    row0 = (lo // block_m) * block_m
    n0 = j * block_n
    rows = row0 + jnp.arange(block_m)
    row_ok = (rows >= lo) & (rows < hi)  # [block_m]: rows of other experts are masked off
    col_ok = n0 + jnp.arange(block_n) < N  # [block_n]
    rows_ds, cols_ds = pl.ds(row0, block_m), pl.ds(n0, block_n)
    store_mask = row_ok[:, None] & col_ok[None, :]

    # Padding steps (lo == hi) own no rows and do nothing. e == E is the group of unused rows:
    # it reads nothing and stores zeros. The K loop has a static trip count (a dynamic one made
    # jaxlib's Triton reject the scf.for on the H200: bounds of different integer types).
    @pl.when((lo < hi) & (e < E))
    def _():
        # Masked lanes read a zero of the operand's own dtype (an int 0 does not cast to fp8 in the lowering).
        zero_x, zero_w = jnp.zeros((), x_ref.dtype), jnp.zeros((), w_ref.dtype)

        def k_step(kk, acc):
            k0 = kk * block_k
            if w_format is not None:  # the whole K step at once (as moe_torch's kernel)
                return acc + _w4_step_part(x_ref, w_ref, ws_ref, e, rows_ds, row_ok, cols_ds, col_ok, k0, K, w_format,
                                           block_m, block_n, block_k, precision, packed_decode)
            k_ok = k0 + jnp.arange(block_k) < K
            ks = pl.ds(k0, block_k)
            xt = plgpu.load(x_ref.at[rows_ds, ks], mask=row_ok[:, None] & k_ok[None, :], other=zero_x)  # [block_m, block_k]
            wt = plgpu.load(w_ref.at[e, cols_ds, ks], mask=col_ok[:, None] & k_ok[None, :], other=zero_w)  # [block_n, block_k]
            part = jax.lax.dot_general(xt, wt, (((1,), (1,)), ((), ())), precision=precision,
                                       preferred_element_type=jnp.float32)  # [block_m, block_n]
            # The step's scales multiply each row once, then one FFMA an element promotes the partial sum (was
            # two FMULs and an add an element; moe_torch's kernel: SASS a step 290 -> 212 at 64x128x128).
            scale = None
            if x_scale_kind == "per_token_group":  # block_k divides G: this K step lies in group k0 // G
                scale = plgpu.load(xs_ref.at[rows_ds, k0 // group_size], mask=row_ok, other=0.0)  # [block_m]
            if w_scale_kind == "block":  # block_n and block_k divide 128: one scale for the whole tile
                sw = ws_ref[e, n0 // SCALE_BLOCK, k0 // SCALE_BLOCK]
                scale = sw if scale is None else scale * sw
            if scale is None:
                return acc + part
            return acc + part * (scale[:, None] if jnp.ndim(scale) else scale)

        acc = jax.lax.fori_loop(0, pl.cdiv(K, block_k), k_step, jnp.zeros((block_m, block_n), jnp.float32))
        if x_scale_kind == "per_tensor":
            acc = acc * xs_ref[0]
        elif x_scale_kind == "per_token":
            acc = acc * plgpu.load(xs_ref.at[rows_ds], mask=row_ok, other=0.0)[:, None]
        if w_scale_kind == "per_expert":
            acc = acc * ws_ref[e]
        elif w_scale_kind == "per_channel":
            acc = acc * plgpu.load(ws_ref.at[e, cols_ds], mask=col_ok, other=0.0)[None, :]
        if has_bias:  # CONTRACT.md section 4: float32, after the scales, before the one rounding
            acc = acc + plgpu.load(b_ref.at[e, cols_ds], mask=col_ok, other=0.0)[None, :]
        plgpu.store(y_ref.at[rows_ds, cols_ds], acc.astype(y_ref.dtype), mask=store_mask)

    @pl.when((lo < hi) & (e >= E))
    def _():
        plgpu.store(y_ref.at[rows_ds, cols_ds], jnp.zeros((block_m, block_n), y_ref.dtype), mask=store_mask)


def scale_kinds(x_scale: jax.Array | None, w_scale: jax.Array | None, K: int) -> tuple[str | None, str | None, int]:
    """``(x_scale_kind, w_scale_kind, G)`` from the (validated) scale shapes; ``G`` is the
    per-token-group size ``K // x_scale.shape[1]`` (0 for the other kinds)."""
    if x_scale is None:
        return None, None, 0
    w_kind = {1: "per_expert", 2: "per_channel", 3: "block"}[w_scale.ndim]
    if x_scale.ndim == 0:
        return "per_tensor", w_kind, 0
    if x_scale.shape[1] == 1:  # one group per row is per-token, whatever G is called
        return "per_token", w_kind, 0
    return "per_token_group", w_kind, K // x_scale.shape[1]


def check_supported(x_kind: str | None, w_kind: str | None, group_size: int, cfg: GroupedGemmConfig,
                    interpret: bool, w_format: str | None = None) -> None:
    """Raise ``NotImplementedError`` for a valid request this backend (with ``cfg``) cannot serve
    (the rules: :func:`~moe_pallas.ops.grouped_gemm.config.triton_config_problem`)."""
    problem = triton_config_problem(cfg, group_size if x_kind == "per_token_group" else None, w_kind == "block",
                                    interpret=interpret, w_4bit=w_format is not None)
    if problem:
        raise NotImplementedError(problem)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret", "w_format"))
def grouped_gemm_pallas_triton(
    x: jax.Array,
    w: jax.Array,
    expert_offsets: jax.Array,
    *,
    x_scale: jax.Array | None = None,
    w_scale: jax.Array | None = None,
    out_dtype=None,
    config: GroupedGemmConfig | None = None,
    interpret: bool | None = None,
    w_format: str | None = None,
    bias: jax.Array | None = None,
) -> jax.Array:
    """``y[m] = x[m] @ w[e(m)].T`` (FP8: ``(q_x @ q_w.T) * x_scale[m] * w_scale[e(m), ...]``), float32 accumulation.

    Args (validated by ``moe_pallas.ops.grouped_gemm.api.grouped_gemm``):
      x: ``[M_cap, K]`` float32 / bf16 / float16, or float8_e4m3fn codes.
      w: ``[E, N, K]`` (out, in), ``x``'s dtype (float8_e4m3fn when ``x`` is); or with ``w_format``
        4-bit packed codes ``[E, N, K // 2]`` uint8 (element ``2i`` in the low nibble), ``x`` float.
      expert_offsets: ``[E + 1]`` int32; rows ``[offsets[e], offsets[e+1])`` use ``w[e]``; rows
        ``>= offsets[-1]`` are not computed and come out zero (they are never read: a NaN there
        stays out of ``y``).
      x_scale: FP8 only, float32 dequantization multiplier (``x ~= q * scale``): ``[]``,
        ``[M_cap, 1]`` or ``[M_cap, K // G]``.
      w_scale: FP8: float32 multiplier ``[E]``, ``[E, N]`` or ``[E, ceil(N/128), ceil(K/128)]``. 4-bit:
        ``[E, N, K // 32]``, uint8 e8m0 codes (``"mxfp4"``) or bf16 multipliers (``"int4"``).
      out_dtype: default ``x.dtype`` (bf16 for FP8 inputs).
      config: launch config (default: :func:`grouped_gemm_config` of the shapes: the tuned config of this
        GPU if one is stored and fits, else the heuristic; never a tuned one in interpret mode).
      interpret: run in Pallas interpret mode (default: when ``jax.default_backend() == "cpu"``).
      w_format: ``None``, or ``"mxfp4"`` / ``"int4"`` for 4-bit ``w`` (CONTRACT.md section 9): each K step
        decodes its weight tile to ``x.dtype`` before the dots (:func:`_w4_step_part`). Untuned: the heuristic
        config.
      bias: optional ``[E, N]`` float32 / bf16 / float16 (CONTRACT.md section 4): ``bias[e]`` in float32 is
        added to the accumulator of each owned row (after the scales) before the rounding.

    Grid: ``(cdiv(M_cap, block_m) + E, cdiv(N, block_n))``, static (one axis of that size with ``config.group_m >
    1``); see :func:`tile_metadata`.

    Returns: ``y [M_cap, N]`` in ``out_dtype``.

    Raises: NotImplementedError (per-token-group scales whose group size has no power-of-two
      divisor >= 16, a config whose blocks do not fit the scale layout (4-bit: ``block_k`` not a
      multiple of 32), blocks < 16 outside
      interpret mode, or an FP8 array of >= 2**31 elements when this jax's lowering could not be
      patched to 64-bit offsets).
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if w_format == "mxfp4_mma":  # this kernel's decode reads the checkpoint layout
        w, w_scale = mma_codes_for_kernel("grouped_gemm", w, w_scale)
        w_format = "mxfp4"
    M_cap, K = x.shape
    E, N, _ = w.shape
    fp8 = x.dtype == FP8_DTYPE
    out_dtype = (jnp.bfloat16 if fp8 else x.dtype) if out_dtype is None else jnp.dtype(out_dtype)
    x_kind, w_kind, G = scale_kinds(x_scale, w_scale, K) if fp8 else (None, None, 0)
    if config is None:  # tuned for this GPU (device kind read on the host at trace time) or the heuristic
        # (4-bit: the heuristic only, whose block_k, a power of two >= 32 for K >= 32, holds whole groups)
        cfg = grouped_gemm_config(M_cap, N, K, E, x.dtype.itemsize, G or None, w_block=w_kind == "block",
                                  device=None if interpret or w_format else gpu_device_spec(),
                                  w_format=w_format)
    else:
        cfg = config
    check_supported(x_kind, w_kind, G, cfg, interpret, w_format)
    if not interpret:  # 64-bit offsets where jax's lowering would not give them (common.patch_pallas_triton_offsets)
        _common.pallas_triton_offsets_ok("grouped_gemm_pallas_triton", x=x, w=w)
    if M_cap == 0 or N == 0 or E == 0:  # nothing to launch: empty, or no expert
        return jnp.zeros((M_cap, N), out_dtype)
    if K == 0:  # a sum of no terms: each used row is its expert's bias (or 0); nothing to launch
        return grouped_gemm_reference(x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format=w_format, bias=bias)
    step_expert, step_lo, step_hi = tile_metadata(expert_offsets, M_cap, E, cfg.block_m)
    inputs = [step_expert, step_lo, step_hi, x, w]
    if fp8:
        xs = x_scale.astype(jnp.float32)
        if x_kind == "per_tensor":  # a 1-element ref: a scalar load at index 0
            xs = xs.reshape(1)
        elif x_kind == "per_token":  # [M_cap, 1] -> [M_cap]: a row-vector load
            xs = xs.reshape(M_cap)
        inputs += [xs, w_scale.astype(jnp.float32)]
    elif w_format is not None:
        inputs.append(w_scale)
    # the packed PTX decode: bf16 x, compiled (interpret mode has no inline asm)
    packed_decode = w_format is not None and not interpret and x.dtype == jnp.bfloat16
    if bias is not None:
        inputs.append(bias.astype(jnp.float32))  # exact widening; [E, N] is small next to w
    # float32 inputs: IEEE products (the Triton default for DEFAULT precision is TF32, 10-bit mantissas).
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    n_steps, n_cols = pl.cdiv(M_cap, cfg.block_m) + E, pl.cdiv(N, cfg.block_n)
    kernel = functools.partial(_kernel, E=E, N=N, K=K, x_scale_kind=x_kind, w_scale_kind=w_kind, group_size=G,
                               block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k, precision=precision,
                               w_format=w_format, has_bias=bias is not None, packed_decode=packed_decode,
                               group_m=cfg.group_m, n_steps=n_steps)
    grid = (n_steps, n_cols) if cfg.group_m == 1 else (n_steps * n_cols,)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M_cap, N), out_dtype),
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="grouped_gemm",
    )(*inputs)
