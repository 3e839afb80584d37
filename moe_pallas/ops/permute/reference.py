"""Permutation (dispatch) reference in jnp, and the permute's backward: CONTRACT.md sections 2 and 8.

Mirror: ``moe_torch/ops/permute/reference.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_pallas.ops.common import cast_rounded
from moe_pallas.ops.quant.reference import (
    per_token_group_quant_fp8_reference,
    per_token_quant_fp8_reference,
    static_quant_fp8_reference,
)


def routing_metadata_reference(
    topk_ids: jax.Array, expert_start: int, num_local_experts: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``topk_ids [T, topk]`` -> ``(expert_offsets [E_local+1], src2dst [T, topk], dst2src [T*topk])``, int32.

    A stable sort of the assignments ``a = t*topk + j`` by local expert id puts each
    expert's rows together, in order of ``a``; non-local assignments sort last and are cut.
    """
    T, topk = topk_ids.shape
    m_cap = T * topk
    local = topk_ids.reshape(m_cap) - expert_start  # in the ids' own dtype: no wrap-around
    is_local = (local >= 0) & (local < num_local_experts)
    key = jnp.where(is_local, local, num_local_experts).astype(jnp.int32)  # non-local -> one bucket past the end
    order = jnp.argsort(key, stable=True).astype(jnp.int32)  # [M_cap]: row -> assignment
    counts = jnp.zeros((num_local_experts + 1,), jnp.int32).at[key].add(1)[:num_local_experts]
    expert_offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    rows = jnp.arange(m_cap, dtype=jnp.int32)
    dst2src = jnp.where(rows < expert_offsets[-1], order, -1)
    position = jnp.zeros((m_cap,), jnp.int32).at[order].set(rows)  # assignment -> row
    src2dst = jnp.where(is_local, position, -1).reshape(T, topk)
    return expert_offsets, src2dst, dst2src


def permute_reference(
    x: jax.Array, dst2src: jax.Array, topk: int, quant: str | None, group_size: int, scale: jax.Array | None
) -> tuple[jax.Array, jax.Array | None]:
    """Gather ``x [T, H]`` rows into expert order: row ``r`` is ``x[dst2src[r] // topk]``.

    Rows with ``dst2src < 0`` (``>= M``) are zero. With ``quant`` the rows are quantized
    (CONTRACT.md section 3) and the scale rows travel with them.
    """
    valid = dst2src >= 0
    token = jnp.where(valid, dst2src // topk, 0)
    rows = jnp.where(valid[:, None], x[token], jnp.zeros((), x.dtype))
    if quant is None:
        return rows, None
    if quant == "fp8_per_tensor":
        return static_quant_fp8_reference(rows, scale), scale
    if quant == "fp8_per_token":
        return per_token_quant_fp8_reference(rows)
    return per_token_group_quant_fp8_reference(rows, group_size)


def src2dst_from_dst2src(dst2src: jax.Array, num_tokens: int, topk: int) -> jax.Array:
    """The inverse map of :func:`permute`'s ``dst2src [M_cap]``: ``src2dst [T, topk]`` int32 with
    ``src2dst[a // topk, a % topk] = r`` for ``dst2src[r] = a >= 0`` and ``-1`` elsewhere, as
    :func:`routing_metadata_reference` returns it (one scatter of distinct rows)."""
    m_cap = num_tokens * topk
    rows = jnp.arange(dst2src.shape[0], dtype=jnp.int32)
    target = jnp.where(dst2src >= 0, dst2src, m_cap)  # rows >= M point past the end and are dropped
    return jnp.full((m_cap,), -1, jnp.int32).at[target].set(rows, mode="drop").reshape(num_tokens, topk)


def permute_backward_reference(d_xp: jax.Array, src2dst: jax.Array, out_dtype) -> jax.Array:
    """``d_x[t] = sum_j d_xp[src2dst[t, j]]`` over local slots (``src2dst >= 0``), float32, cast once:
    ``[T, H]``; a token with no local slot gets 0, and rows no slot names are never read."""
    cdt = jnp.promote_types(d_xp.dtype, jnp.float32)  # float64 only for the tests' autodiff check
    valid = src2dst >= 0
    rows = d_xp[jnp.where(valid, src2dst, 0)].astype(cdt)  # [T, topk, H]
    return cast_rounded(jnp.where(valid[:, :, None], rows, 0.0).sum(axis=1), out_dtype)
