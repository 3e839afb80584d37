"""Small numerics helpers shared by the jnp references, and a fix to the Pallas-Triton lowering
(``patch_pallas_triton_offsets``, applied on import) that every Pallas-Triton kernel relies on.

Mirror: ``moe_torch/ops/common.py``.
"""

from __future__ import annotations

import dataclasses
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


# --- Pallas-Triton lowering: 64-bit pointer offsets for arrays of >= 2**31 elements ----------------

#: Elements an int32 pointer offset can address (Triton's ``tt.addptr`` offsets count elements, signed).
INT32_ELEMENTS = 2**31


def _needs_wide_offsets(shape, dtype) -> bool:
    """True where jax 0.11's Pallas-Triton lowering keeps 32-bit offsets but must not: at least 2**31
    elements and at most 2**32 bytes (it switches on ``bytes > 2**32``, so only 1-byte dtypes, e.g. a
    DeepSeek-V3 FP8 ``w2 [257, 7168, 2048]`` of 3.8G elements, fall in between)."""
    n = int(np.prod(shape, dtype=np.int64))
    return n >= INT32_ELEMENTS and n * jnp.dtype(dtype).itemsize <= 2**32


def patch_pallas_triton_offsets() -> bool:
    """Make jax's Pallas-Triton lowering use 64-bit pointer offsets for every array of >= 2**31 elements.

    jax-ml/jax@jax-v0.11.2:jax/_src/pallas/triton/lowering.py ``_compute_offsets_from_indices`` picks
    64-bit offsets only when the array is over 2**32 *bytes*, but the offsets count *elements* and are
    signed: a 1-byte (FP8) array of 2**31..2**32 elements overflows and the kernel reads outside the
    buffer (seen on the H200: ``CUDA_ERROR_ILLEGAL_ADDRESS`` in the DeepSeek-V3 FP8 down projection).
    The wrapper hands the lowering a 4-byte stand-in dtype for such arrays (the dtype is used there only
    for that size test), so it takes its own 64-bit path. Idempotent; returns False (and changes
    nothing) if this jax has no such function, in which case :func:`pallas_triton_offsets_ok` says so.
    """
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:  # no Triton lowering in this jax
        return False
    original = getattr(lowering, "_compute_offsets_from_indices", None)
    if original is None or not hasattr(lowering, "BlockInfo"):
        return False
    if getattr(original, "_epmoe_wide_offsets", False):
        return True

    @functools.wraps(original)
    def compute_offsets(block_info, nd_indexer):
        aval = block_info.full_shape_dtype
        if _needs_wide_offsets(aval.shape, aval.dtype):
            block_info = dataclasses.replace(block_info, full_shape_dtype=aval.update(dtype=jnp.dtype(jnp.float32)))
        return original(block_info, nd_indexer)

    compute_offsets._epmoe_wide_offsets = True
    lowering._compute_offsets_from_indices = compute_offsets
    return True


def pallas_triton_offsets_ok(op: str, **arrays) -> None:
    """Raise ``NotImplementedError`` (so dispatch tries the next backend) if an array needs 64-bit
    offsets that this jax's Pallas-Triton lowering would not give it (the patch above could not apply)."""
    if _OFFSETS_PATCHED:
        return
    for name, a in arrays.items():
        if a is not None and _needs_wide_offsets(a.shape, a.dtype):
            raise NotImplementedError(
                f"{op}: {name} {tuple(a.shape)} {a.dtype} has >= 2**31 elements in <= 4 GiB, which this jax's "
                f"Pallas-Triton lowering addresses with 32-bit offsets (patch_pallas_triton_offsets could not apply)")


_OFFSETS_PATCHED = patch_pallas_triton_offsets()
