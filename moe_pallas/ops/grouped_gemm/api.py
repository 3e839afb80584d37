"""Grouped GEMM ``[M, K] x [E, N, K] -> [M, N]`` over rows grouped by expert (CONTRACT.md section 4).

Mirror: ``moe_torch/ops/grouped_gemm/api.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_contract.validation import (
    FLOAT_DTYPES,
    FP8_DTYPE,
    check_activation_scale,
    check_choice,
    check_dtype,
    check_rank,
    check_shape,
    check_weight_scale,
    dtype_name,
)
from moe_pallas.ops.grouped_gemm.reference import grouped_gemm_reference
from moe_pallas.ops.common import resolve_dtype

IMPLEMENTATIONS = ("reference",)


def grouped_gemm(
    x: jax.Array,
    w: jax.Array,
    expert_offsets: jax.Array,
    *,
    x_scale: jax.Array | None = None,
    w_scale: jax.Array | None = None,
    out_dtype=None,
    implementation: str | None = None,
) -> jax.Array:
    """``y[m] = x[m] @ w[e(m)].T``, expert ``e(m)`` given by ``expert_offsets``; float32 accumulation.

    Args:
      x: ``[M_cap, K]``, float32 / bf16 / float16, or float8_e4m3fn codes.
      w: ``[E_local, N, K]`` (out, in), the same float dtype as ``x``, or float8_e4m3fn when
        ``x`` is.
      expert_offsets: ``[E_local + 1]`` int32, rows ``[offsets[e], offsets[e+1])`` use ``w[e]``;
        rows ``>= offsets[-1]`` are not computed (zero in the result).
      x_scale: FP8 only, float32 dequantization multiplier: ``[]`` per-tensor, ``[M_cap, 1]``
        per-token, or ``[M_cap, K // G]`` per-token-group.
      w_scale: FP8 only, float32: ``[E_local]`` per-expert, ``[E_local, N]`` per-output-channel,
        or ``[E_local, ceil(N/128), ceil(K/128)]`` 128x128 blocks.
      out_dtype: result dtype; default ``x.dtype`` (bf16 for FP8 inputs).

    Returns: ``y [M_cap, N]``.

    Raises: ValueError (shapes, missing or unexpected scales), TypeError (dtypes).
    """
    op = "grouped_gemm"
    check_rank(op, "x", x, 2, "[M_cap, K]")
    check_dtype(op, "x", x, (*FLOAT_DTYPES, FP8_DTYPE))
    M_cap, K = x.shape
    check_rank(op, "w", w, 3, f"[E, N, K] with K == x.shape[1] (={K})")
    E, N, Kw = w.shape
    if Kw != K:
        check_shape(op, "w", w, (None, None, K), f"[E, N, K] with K == x.shape[1] (={K})")
    check_shape(op, "expert_offsets", expert_offsets, (E + 1,), f"[E + 1] = ({E + 1},) int32 for w with E={E}")
    check_dtype(op, "expert_offsets", expert_offsets, ("int32",))
    fp8 = dtype_name(x) == FP8_DTYPE
    if fp8:
        check_dtype(op, "w", w, (FP8_DTYPE,))
        for name, s in (("x_scale", x_scale), ("w_scale", w_scale)):
            if s is None:
                raise ValueError(f"{op}: {name} must be given for float8_e4m3fn inputs; got None")
        check_activation_scale(op, "x_scale", x_scale, (M_cap, K))
        check_weight_scale(op, "w_scale", w_scale, (E, N, K))
        out_dtype = jnp.bfloat16 if out_dtype is None else out_dtype
    else:
        check_dtype(op, "w", w, (dtype_name(x),))
        for name, s in (("x_scale", x_scale), ("w_scale", w_scale)):
            if s is not None:
                raise ValueError(f"{op}: {name} must be None for {dtype_name(x)} inputs (scales are for float8_e4m3fn); got an array")
        out_dtype = x.dtype if out_dtype is None else out_dtype
    check_dtype(op, "out_dtype", out_dtype, FLOAT_DTYPES)
    out_dtype = resolve_dtype(out_dtype)
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    if M_cap == 0:
        return jnp.zeros((0, N), out_dtype)
    return grouped_gemm_reference(x, w, expert_offsets, x_scale, w_scale, out_dtype)
