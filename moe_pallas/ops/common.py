"""Small numerics helpers shared by the jnp references.

Mirror: ``moe_torch/ops/common.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def resolve_dtype(dtype) -> jnp.dtype:
    """A numpy/jax dtype from a dtype, a scalar type (``jnp.bfloat16``) or its name."""
    return jnp.dtype(dtype)


def cast_rounded(x: jax.Array, dtype) -> jax.Array:
    """``x.astype(dtype)``, with the rounding made explicit so that ``jit`` keeps it.

    XLA may skip a float32 -> bf16 -> float32 round trip under ``jit``
    (``--xla_allow_excess_precision``, on by default), so a bf16 intermediate such as the first
    GEMM's output would silently stay float32 on the GPU and the layer would no longer be the
    contract's (seen on an H200: 4.7e-3 relative difference from torch, against 2.4e-4 eagerly).
    ``lax.reduce_precision`` is an explicit rounding XLA does not remove.
    """
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        info = jnp.finfo(dtype)
        x = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return x.astype(dtype)
