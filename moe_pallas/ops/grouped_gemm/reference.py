"""Grouped GEMM reference in jnp: CONTRACT.md section 4, row by row.

``y[m, :] = x[m, :] @ w[e(m)].T`` with float32 accumulation; for FP8 inputs the product of
the *dequantized* operands, which equals the contract's ``(q_x @ q_w.T) * scale_x * scale_w``
(with block scales applied per K block) up to float32 rounding. An optional per-expert ``bias [E_local, N]``
is added to the float32 accumulator before the one rounding (CONTRACT.md section 4). Rows ``>= M`` are zero.

Each row gathers its own expert's weights (in chunks of rows, so temporaries stay near
1 GiB). That is the contract read literally, and its cost is ``M_cap`` reads of one expert's
weights. ``jax.lax.ragged_dot`` would be shorter, but XLA's GPU lowering computes every
group for every row (``E`` times the work), which at DeepSeek-V3 size (E=257) in float32
takes minutes.

The backward (CONTRACT.md section 8), :func:`grouped_gemm_dgrad_reference` and
:func:`grouped_gemm_wgrad_reference`, is written out expert by expert (see the note above them);
:func:`grouped_gemm_dbias_reference` is a masked segment sum.

Concrete ``expert_offsets`` (not a tracer) are checked on the host by each reference: offsets that decrease or
leave ``[0, M_cap]`` raise ``ValueError`` naming the op. Under ``jax.jit`` (or any transformation that makes them
tracers) the values are unknown when the reference is traced and the check cannot run; the result is then
undefined, as the kernels'.

Mirror: ``moe_torch/ops/grouped_gemm/reference.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_contract.validation import check_offsets_values
from moe_pallas.ops.common import cast_rounded
from moe_pallas.ops.quant.reference import (dequantize_fp8_reference, dequantize_weight_4bit_reference,
                                            dequantize_weight_fp8_reference)

#: Bytes of gathered float32 weights per chunk of rows.
_CHUNK_BYTES = 1 << 30


def _check_offsets(op: str, expert_offsets: jax.Array, M_cap: int) -> None:
    """``ValueError`` (``check_offsets_values``) for concrete offsets that decrease or leave ``[0, M_cap]``; a
    tracer (under ``jit``) passes unchecked: its values do not exist yet."""
    if not isinstance(expert_offsets, jax.core.Tracer):
        check_offsets_values(op, np.asarray(expert_offsets).tolist(), M_cap)


def grouped_gemm_reference(
    x: jax.Array,
    w: jax.Array,
    expert_offsets: jax.Array,
    x_scale: jax.Array | None,
    w_scale: jax.Array | None,
    out_dtype,
    w_format: str | None = None,
    bias: jax.Array | None = None,
) -> jax.Array:
    """``x [M_cap, K]``, ``w [E_local, N, K]``, ``expert_offsets [E_local + 1]`` -> ``y [M_cap, N]``.

    4-bit ``w`` (``w_format`` ``"mxfp4"`` / ``"int4"``, CONTRACT.md section 9): packed codes
    ``[E_local, N, K // 2]`` uint8 with ``w_scale [E_local, N, K // 32]``; each row's expert weights are
    dequantized in float32 and rounded to ``x.dtype``, then multiplied as float weights. ``bias``
    ``[E_local, N]`` (optional): each row's ``bias[e(m)]`` in float32 is added (after the FP8 scales) before
    the rounding to ``out_dtype``.

    Raises: ValueError (concrete ``expert_offsets`` not non-decreasing within ``[0, M_cap]``; not checked under
    ``jit``)."""
    M_cap, K = x.shape
    E, N, _ = w.shape
    _check_offsets("grouped_gemm", expert_offsets, M_cap)
    if E == 0 or N == 0:  # no expert (every row is past offsets[-1] = 0) or no column: nothing to gather
        return jnp.zeros((M_cap, N), out_dtype)
    rows = jnp.arange(M_cap, dtype=jnp.int32)
    expert = jnp.searchsorted(expert_offsets[1:], rows, side="right").astype(jnp.int32)  # e(m); E past M
    valid = expert < E
    expert = jnp.minimum(expert, E - 1)
    xf = x.astype(jnp.float32) if x_scale is None else dequantize_fp8_reference(x, x_scale)

    def rows_times_their_experts(x_rows: jax.Array, e_rows: jax.Array) -> jax.Array:
        if w_format is not None:  # 4-bit: float32 dequantization rounded to x's dtype (section 9)
            wd = dequantize_weight_4bit_reference(w[e_rows], w_scale[e_rows], w_format)
            w_rows = cast_rounded(wd, x.dtype).astype(jnp.float32)
        elif w_scale is None:
            w_rows = w[e_rows].astype(jnp.float32)  # [R, N, K]
        else:
            w_rows = dequantize_weight_fp8_reference(w[e_rows], w_scale[e_rows])
        y_rows = jnp.einsum("rk,rnk->rn", x_rows, w_rows, precision=jax.lax.Precision.HIGHEST)
        if bias is not None:  # in float32, before the one rounding (CONTRACT.md section 4)
            y_rows = y_rows + bias[e_rows].astype(jnp.float32)
        return y_rows

    # 4-bit: the int32 codes and float32 values of the decode are live too (about 4x the float32 weights)
    chunk = max(1, min(M_cap, _CHUNK_BYTES // max(1, N * K * (16 if w_format is not None else 4))))
    n_chunks = -(-M_cap // chunk)
    if n_chunks == 1:
        y = rows_times_their_experts(xf, expert)
    else:
        pad = n_chunks * chunk - M_cap
        xs = jnp.pad(xf, ((0, pad), (0, 0))).reshape(n_chunks, chunk, K)
        es = jnp.pad(expert, (0, pad)).reshape(n_chunks, chunk)
        y = jax.lax.map(lambda args: rows_times_their_experts(*args), (xs, es)).reshape(-1, N)[:M_cap]
    return cast_rounded(jnp.where(valid[:, None], y, 0.0), out_dtype)


# --- Backward (CONTRACT.md section 8) ------------------------------------------------------------
#
# Written out, not autodiff: ``jax.vjp`` of a ``lax.ragged_dot`` (or of the gathering forward above)
# asked XLA for 1.75 TiB at DeepSeek-V3-like size, because the transposes materialize
# per-group (or per-row) products. Here the rows of each expert are contiguous, so both backward GEMMs
# go expert by expert, ``R`` rows at a time (:func:`_window_rows`): plain float32 matmuls of one
# ``[R, N]`` / ``[R, K]`` window against one expert's ``[N, K]`` weights, and nothing larger than the
# result is ever live. The windows are dynamic slices of a static size ``R``, masked with ``where``
# (never by a multiplication: a NaN in a row ``>= M`` must not leak), so the loops jit without a host
# sync; an expert's window count ``cdiv(rows, R)`` is data (a ``while`` loop), 0 for an empty expert.


def expert_row_ranges(expert_offsets: jax.Array, M_cap: int) -> tuple[jax.Array, jax.Array]:
    """``(starts, ends)``, each ``[E]`` int32: expert ``e`` owns rows ``[starts[e], ends[e])``.

    The forward's assignment (``e(m)`` = the first ``e`` with ``m < offsets[e+1]``, so rows before
    ``offsets[1]`` belong to expert 0): ``ends = offsets[1:]`` and ``starts = [0, ends[:-1]]``, after
    clipping the offsets to ``[0, M_cap]`` and making them non-decreasing as the kernels do
    (``pallas_triton.tile_metadata``), so malformed offsets never address outside the arrays."""
    off = jax.lax.cummax(jnp.clip(expert_offsets.astype(jnp.int32), 0, M_cap))
    ends = off[1:]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def _window_rows(M_cap: int, E: int) -> int:
    """Rows per window: the average rows per expert rounded up to a power of two, in ``[8, 256]``, at
    most ``M_cap``. A window past an expert's last row is wasted work, at most ``E x R`` rows in all."""
    per_expert = -(-M_cap // max(E, 1))
    return min(M_cap, max(8, min(256, 1 << (per_expert - 1).bit_length())))


def _window(a: jax.Array, lo: jax.Array, hi: jax.Array, R: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rows ``[lo, min(hi, lo + R))`` of ``a [M_cap, ...]`` as a static ``R``-row window: ``(start,
    rows_ok [R], window float32 [R, ...])``, the window starting at ``start = min(lo, M_cap - R)`` (so it
    stays inside ``a``) and zero on the rows outside ``[lo, hi)``."""
    start = jnp.minimum(lo, a.shape[0] - R)
    rows = start + jnp.arange(R, dtype=jnp.int32)
    ok = (rows >= lo) & (rows < hi)
    win = jax.lax.dynamic_slice_in_dim(a, start, R).astype(jnp.float32)
    return start, ok, jnp.where(ok.reshape(R, *([1] * (a.ndim - 1))), win, 0.0)


def _zeros_varying_like(shape: tuple[int, ...], *arrays: jax.Array | None) -> jax.Array:
    """float32 zeros of ``shape``, a loop's initial carry, typed to vary over every ``shard_map`` mesh axis
    that one of ``arrays`` varies over (``zeros_like`` keeps its argument's; the sum takes the union),
    so that it matches what the loop body makes of them. Outside ``shard_map``: plain zeros."""
    out = jnp.zeros(shape, jnp.float32)
    for a in arrays:
        if a is not None:
            out = out + jnp.zeros_like(a, dtype=jnp.float32, shape=shape)
    return out


def backward_weights_reference(w: jax.Array, w_scale: jax.Array | None, e: jax.Array, dtype) -> jax.Array:
    """``w[e] [N, K]`` as the backward GEMM uses it, float32: float weights as they are; FP8 codes
    straight-through (CONTRACT.md section 8): ``q_w * scale_w`` (float32 product) rounded to ``dtype``
    (``d_y``'s), then widened back to float32 (exactly)."""
    w_e = jax.lax.dynamic_index_in_dim(w, e, keepdims=True)
    if w_scale is None:
        return w_e[0].astype(jnp.float32)
    s_e = jax.lax.dynamic_index_in_dim(w_scale, e, keepdims=True)
    return cast_rounded(dequantize_weight_fp8_reference(w_e, s_e)[0], dtype).astype(jnp.float32)


def grouped_gemm_dgrad_reference(
    d_y: jax.Array,
    w: jax.Array,
    expert_offsets: jax.Array,
    w_scale: jax.Array | None,
    out_dtype,
) -> jax.Array:
    """``d_y [M_cap, N]``, ``w [E, N, K]`` -> ``d_x [M_cap, K]``, ``d_x[m] = d_y[m] @ w[e(m)]``.

    float32 accumulation (``Precision.HIGHEST``); FP8 ``w`` through :func:`backward_weights_reference`.
    Rows ``>= M`` are zero, and their ``d_y`` never reaches the result (a window may load such rows;
    ``where`` drops them). Expert by expert, ``R`` rows at a time (see above).

    Raises: ValueError (concrete ``expert_offsets`` not non-decreasing within ``[0, M_cap]``; not checked under
    ``jit``)."""
    M_cap, N = d_y.shape
    _check_offsets("grouped_gemm_dgrad", expert_offsets, M_cap)
    E, _, K = w.shape
    if M_cap == 0 or E == 0:
        return jnp.zeros((M_cap, K), out_dtype)
    d_x = _zeros_varying_like((M_cap, K), d_y, w, expert_offsets, w_scale)
    starts, ends = expert_row_ranges(expert_offsets, M_cap)
    R = _window_rows(M_cap, E)

    def expert(e, d_x):
        w_e = backward_weights_reference(w, w_scale, e, d_y.dtype)  # [N, K]

        def window(t, d_x):
            start, ok, dy = _window(d_y, starts[e] + t * R, ends[e], R)
            part = jnp.dot(dy, w_e, precision=jax.lax.Precision.HIGHEST)  # [R, K]
            old = jax.lax.dynamic_slice_in_dim(d_x, start, R)
            return jax.lax.dynamic_update_slice_in_dim(d_x, jnp.where(ok[:, None], part, old), start, 0)

        return jax.lax.fori_loop(0, (ends[e] - starts[e] + R - 1) // R, window, d_x)

    return cast_rounded(jax.lax.fori_loop(0, E, expert, d_x), out_dtype)


def grouped_gemm_wgrad_reference(
    x: jax.Array,
    d_y: jax.Array,
    expert_offsets: jax.Array,
    out_dtype,
) -> jax.Array:
    """``x [M_cap, K]``, ``d_y [M_cap, N]`` -> ``d_w [E, N, K]``, ``d_w[e] = d_y[rows(e)].T @ x[rows(e)]``.

    ``E = expert_offsets.shape[0] - 1``; float32 accumulation (``Precision.HIGHEST``); an expert with
    no rows gets exactly 0; rows ``>= M`` never reach it (a window may load them; ``where`` drops
    them). Expert by expert, ``R`` rows at a time.

    Raises: ValueError (concrete ``expert_offsets`` not non-decreasing within ``[0, M_cap]``; not checked under
    ``jit``)."""
    M_cap, K = x.shape
    _check_offsets("grouped_gemm_wgrad", expert_offsets, M_cap)
    N = d_y.shape[1]
    E = expert_offsets.shape[0] - 1
    if M_cap == 0 or E == 0:
        return jnp.zeros((E, N, K), out_dtype)
    starts, ends = expert_row_ranges(expert_offsets, M_cap)
    R = _window_rows(M_cap, E)

    def expert(lo_hi):
        lo, hi = lo_hi

        def window(t, acc):
            _, _, dy = _window(d_y, lo + t * R, hi, R)
            _, _, xw = _window(x, lo + t * R, hi, R)
            return acc + jax.lax.dot_general(dy, xw, (((0,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST)

        acc = _zeros_varying_like((N, K), x, d_y, expert_offsets)
        return jax.lax.fori_loop(0, (hi - lo + R - 1) // R, window, acc)

    return cast_rounded(jax.lax.map(expert, (starts, ends)), out_dtype)


def grouped_gemm_dbias_reference(
    d_y: jax.Array,
    expert_offsets: jax.Array,
    out_dtype,
) -> jax.Array:
    """``d_y [M_cap, N]``, ``expert_offsets [E + 1]`` -> ``d_bias [E, N]``, ``d_bias[e] = sum of d_y[rows(e)]``.

    float32 accumulation (a ``segment_sum`` over the rows' experts, :func:`expert_row_ranges`' assignment),
    rounded once to ``out_dtype``; an expert with no rows gets exactly 0; rows ``>= M`` are dropped by
    ``where`` before the sum (never by a multiplication: a NaN there must not leak).

    Raises: ValueError (concrete ``expert_offsets`` not non-decreasing within ``[0, M_cap]``; not checked under
    ``jit``)."""
    M_cap, N = d_y.shape
    _check_offsets("grouped_gemm_dbias", expert_offsets, M_cap)
    E = expert_offsets.shape[0] - 1
    if M_cap == 0 or E == 0:
        return jnp.zeros((E, N), out_dtype)
    _, ends = expert_row_ranges(expert_offsets, M_cap)
    rows = jnp.arange(M_cap, dtype=jnp.int32)
    expert = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)  # e(m); E for rows >= M
    valid = expert < E
    dy = jnp.where(valid[:, None], d_y.astype(jnp.float32), 0.0)
    d_b = jax.ops.segment_sum(dy, jnp.minimum(expert, E - 1), num_segments=E)
    return cast_rounded(d_b, out_dtype)
