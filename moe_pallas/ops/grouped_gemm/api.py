"""Grouped GEMM ``[M, K] x [E, N, K] -> [M, N]`` over rows grouped by expert (CONTRACT.md section 4).

Mirror: ``moe_torch/ops/grouped_gemm/api.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_contract.op_checks import check_grouped_gemm
from moe_contract.validation import check_choice
from moe_pallas.ops.common import resolve_dtype, takes_jax_arrays
from moe_pallas.ops.dispatch import dispatch
from moe_pallas.ops.grouped_gemm.pallas_triton import grouped_gemm_pallas_triton
from moe_pallas.ops.grouped_gemm.reference import grouped_gemm_reference

IMPLEMENTATIONS = ("pallas_mosaic_gpu", "pallas_triton", "reference")


def _mosaic(x, w, expert_offsets, x_scale, w_scale, out_dtype):
    """The Hopper backend: GPU only (Mosaic GPU has no CPU interpret mode for this kernel)."""
    if jax.default_backend() != "gpu":
        raise NotImplementedError(f"grouped_gemm[pallas_mosaic_gpu]: needs a Hopper GPU; the default backend is {jax.default_backend()!r}")
    from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu import grouped_gemm_pallas_mosaic_gpu

    return grouped_gemm_pallas_mosaic_gpu(x, w, expert_offsets, x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype)


@takes_jax_arrays
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
        rows ``>= offsets[-1]`` are not computed (zero in the result). Only the shape and dtype
        are checked: the values would need a host sync. They must be non-decreasing within
        ``[0, M_cap]`` (as ``routing_metadata`` makes them); the kernels clamp other values and
        never address outside ``x`` or ``y``, but the result is then undefined.
      x_scale: FP8 only, float32 dequantization multiplier: ``[]`` per-tensor, ``[M_cap, 1]``
        per-token, or ``[M_cap, K // G]`` per-token-group.
      w_scale: FP8 only, float32: ``[E_local]`` per-expert, ``[E_local, N]`` per-output-channel,
        or ``[E_local, ceil(N/128), ceil(K/128)]`` 128x128 blocks.
      out_dtype: result dtype; default ``x.dtype`` (bf16 for FP8 inputs).
      implementation: ``"pallas_mosaic_gpu"`` (Hopper GPUs only), ``"pallas_triton"`` (interpreted
        on the CPU), ``"reference"``, or ``None``
        (the device's default order, ``moe_pallas.ops.dispatch``; the reference on the CPU).

    Returns: ``y [M_cap, N]``.

    Raises: ValueError (shapes, missing or unexpected scales), TypeError (dtypes),
      NotImplementedError (``implementation="pallas_triton"`` with per-token-group scales whose
      group size ``K // x_scale.shape[1]`` has no power-of-two divisor >= 16;
      ``implementation="pallas_mosaic_gpu"`` off a GPU or outside its limits, see
      ``moe_pallas/ops/grouped_gemm/pallas_mosaic_gpu.py``).
    """
    op = "grouped_gemm"
    out_dtype = resolve_dtype(check_grouped_gemm(op, x, w, expert_offsets, x_scale, w_scale, out_dtype))
    M_cap, N = x.shape[0], w.shape[1]
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    if M_cap == 0:
        return jnp.zeros((0, N), out_dtype)
    return dispatch(op, implementation, {
        "pallas_mosaic_gpu": lambda: _mosaic(x, w, expert_offsets, x_scale, w_scale, out_dtype),
        "pallas_triton": lambda: grouped_gemm_pallas_triton(
            x, w, expert_offsets, x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype),
        "reference": lambda: grouped_gemm_reference(x, w, expert_offsets, x_scale, w_scale, out_dtype),
    })
