"""Grouped GEMM reference in jnp: CONTRACT.md section 4, on ``jax.lax.ragged_dot``.

``y[m, :] = x[m, :] @ w[e(m)].T`` with float32 accumulation; for FP8 inputs the product of
the *dequantized* operands, which equals the contract's ``(q_x @ q_w.T) * scale_x * scale_w``
(with block scales applied per K block) up to float32 rounding. Rows ``>= M`` are zero.

Mirror: ``moe_torch/ops/grouped_gemm/reference.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_pallas.ops.quant.reference import dequantize_fp8_reference, dequantize_weight_fp8_reference

#: Dequantized float32 weights are built this many bytes at a time (K chunks of whole
#: 128-blocks), so the reference runs at DeepSeek-V3 size without a 30 GB temporary.
_CHUNK_BYTES = 1 << 30


def _ragged(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``x [M, K] @ w[e].T`` per group, ``w [E, N, K]``, float32 result."""
    return jax.lax.ragged_dot(
        x,
        jnp.swapaxes(w, 1, 2),
        group_sizes,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def grouped_gemm_reference(
    x: jax.Array,
    w: jax.Array,
    expert_offsets: jax.Array,
    x_scale: jax.Array | None,
    w_scale: jax.Array | None,
    out_dtype,
) -> jax.Array:
    """``x [M_cap, K]``, ``w [E_local, N, K]``, ``expert_offsets [E_local + 1]`` -> ``y [M_cap, N]``."""
    group_sizes = jnp.diff(expert_offsets).astype(jnp.int32)
    if x_scale is None:  # bf16 / float: products are exact in float32
        return _ragged(x, w, group_sizes).astype(out_dtype)
    xf = dequantize_fp8_reference(x, x_scale)
    E, N, K = w.shape
    chunk = max(1, _CHUNK_BYTES // (E * N * 128 * 4)) * 128
    y = None
    for k0 in range(0, K, chunk):
        k1 = min(K, k0 + chunk)
        w_part = w[:, :, k0:k1]
        if w_scale.ndim == 3:  # block scales: slice the K blocks of this chunk
            s_part = w_scale[:, :, k0 // 128 : -(-k1 // 128)]
        else:
            s_part = w_scale
        part = _ragged(xf[:, k0:k1], dequantize_weight_fp8_reference(w_part, s_part), group_sizes)
        y = part if y is None else y + part
    return y.astype(out_dtype)
