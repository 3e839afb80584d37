"""Grouped GEMM reference in jnp: CONTRACT.md section 4, row by row.

``y[m, :] = x[m, :] @ w[e(m)].T`` with float32 accumulation; for FP8 inputs the product of
the *dequantized* operands, which equals the contract's ``(q_x @ q_w.T) * scale_x * scale_w``
(with block scales applied per K block) up to float32 rounding. Rows ``>= M`` are zero.

Each row gathers its own expert's weights (in chunks of rows, so temporaries stay near
1 GiB). That is the contract read literally, and its cost is ``M_cap`` reads of one expert's
weights. ``jax.lax.ragged_dot`` would be shorter, but XLA's GPU lowering computes every
group for every row (``E`` times the work), which at DeepSeek-V3 size (E=257) in float32
takes minutes.

Mirror: ``moe_torch/ops/grouped_gemm/reference.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_pallas.ops.common import cast_rounded
from moe_pallas.ops.quant.reference import dequantize_fp8_reference, dequantize_weight_fp8_reference

#: Bytes of gathered float32 weights per chunk of rows.
_CHUNK_BYTES = 1 << 30


def grouped_gemm_reference(
    x: jax.Array,
    w: jax.Array,
    expert_offsets: jax.Array,
    x_scale: jax.Array | None,
    w_scale: jax.Array | None,
    out_dtype,
) -> jax.Array:
    """``x [M_cap, K]``, ``w [E_local, N, K]``, ``expert_offsets [E_local + 1]`` -> ``y [M_cap, N]``."""
    M_cap, K = x.shape
    E, N, _ = w.shape
    rows = jnp.arange(M_cap, dtype=jnp.int32)
    expert = jnp.searchsorted(expert_offsets[1:], rows, side="right").astype(jnp.int32)  # e(m); E past M
    valid = expert < E
    expert = jnp.minimum(expert, E - 1)
    xf = x.astype(jnp.float32) if x_scale is None else dequantize_fp8_reference(x, x_scale)

    def rows_times_their_experts(x_rows: jax.Array, e_rows: jax.Array) -> jax.Array:
        if w_scale is None:
            w_rows = w[e_rows].astype(jnp.float32)  # [R, N, K]
        else:
            w_rows = dequantize_weight_fp8_reference(w[e_rows], w_scale[e_rows])
        return jnp.einsum("rk,rnk->rn", x_rows, w_rows, precision=jax.lax.Precision.HIGHEST)

    chunk = max(1, min(M_cap, _CHUNK_BYTES // (N * K * 4)))
    n_chunks = -(-M_cap // chunk)
    if n_chunks == 1:
        y = rows_times_their_experts(xf, expert)
    else:
        pad = n_chunks * chunk - M_cap
        xs = jnp.pad(xf, ((0, pad), (0, 0))).reshape(n_chunks, chunk, K)
        es = jnp.pad(expert, (0, pad)).reshape(n_chunks, chunk)
        y = jax.lax.map(lambda args: rows_times_their_experts(*args), (xs, es)).reshape(-1, N)[:M_cap]
    return cast_rounded(jnp.where(valid[:, None], y, 0.0), out_dtype)
