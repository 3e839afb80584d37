"""Small numerics helpers shared by the jnp references.

Mirror: ``moe_torch/ops/common.py``.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from moe_contract.validation import dtype_name

#: What the ops of this package take as arrays (numpy ones are converted by jnp as usual).
ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


def takes_jax_arrays(fn):
    """Decorator: an argument that is an array of another framework (a torch tensor) is a
    ``TypeError`` naming the op and the argument, raised before anything runs."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        check_jax_arrays(fn.__name__, signature.bind_partial(*args, **kwargs).arguments)
        return fn(*args, **kwargs)

    return wrapper


def check_jax_arrays(op: str, named: dict, *, required: bool = False) -> None:
    """``TypeError`` naming ``op`` and the argument for a value of ``named`` that is an array of
    another framework (a torch tensor); with ``required``, for any value that is neither ``None``
    nor an array of :data:`ARRAY_TYPES` (a list, a number...)."""
    for name, value in named.items():
        if value is None or isinstance(value, ARRAY_TYPES):
            continue
        is_array = not isinstance(value, type) and hasattr(value, "shape") and hasattr(value, "dtype")
        if is_array or required:
            kind = f"{type(value).__module__}.{type(value).__name__}"
            raise TypeError(f"{op}: {name} must be a jax array (moe_pallas is the JAX backend); got {kind}")


def resolve_dtype(dtype) -> jnp.dtype:
    """A numpy/jax dtype from any dtype spelling (``jnp.bfloat16``, ``"bfloat16"``, ``torch.bfloat16``)."""
    return jnp.dtype(dtype_name(dtype))


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
