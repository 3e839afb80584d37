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

from moe_contract.env import env_switch
from moe_contract.validation import dtype_name

#: What the ops of this package take as arrays (numpy ones are converted by jnp as usual).
ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


def takes_jax_arrays(fn):
    """Decorator: an argument that is an array of another framework (a torch tensor) is a
    ``TypeError`` naming the op and the argument, raised before anything runs."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            bound = signature.bind_partial(*args, **kwargs)
        except TypeError as exc:  # a misspelled keyword or too many arguments: name the op, as Python would
            raise TypeError(f"{fn.__name__}: {exc}") from None
        check_jax_arrays(fn.__name__, bound.arguments)
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


SECOND_ORDER_MESSAGE = ("{op}: second-order gradients (jax.grad of jax.grad, jax.jacfwd / jax.jvp of a gradient, "
                        "jax.hessian) are not supported: its custom_vjp backward is not itself differentiable; got a "
                        "derivative of its gradient")


def first_order_only(op: str, *arrays):
    """``arrays`` (jax arrays or ``None``) unchanged, each marked so that a derivative of a derivative through it
    raises ``NotImplementedError`` naming ``op`` (:data:`SECOND_ORDER_MESSAGE`). Put on a ``custom_vjp``'s
    differentiable inputs: its backward (while loops, Pallas kernels) is not differentiable, and JAX would
    otherwise fail inside its own internals (or, for ``jacfwd``, without naming the op).

    How: an identity ``custom_jvp`` whose JVP rule returns the tangent as it is (first order: nothing changes)
    and the primal through a second identity whose JVP rule raises, reached only when the primal is itself
    being differentiated (an outer ``grad`` / ``jacfwd``). One leaf at a time, so that an input that is not
    differentiated stays unperturbed (the FP8 rules' ``perturbed`` flags)."""
    out = tuple(None if a is None else _first_order_identity(op, a) for a in arrays)
    return out[0] if len(out) == 1 else out


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _first_order_identity(op, a):
    return a


@_first_order_identity.defjvp
def _first_order_identity_jvp(op, primals, tangents):
    return _refuse_derivative(op, primals[0]), tangents[0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _refuse_derivative(op, a):
    return a


@_refuse_derivative.defjvp
def _refuse_derivative_jvp(op, primals, tangents):
    raise NotImplementedError(SECOND_ORDER_MESSAGE.format(op=op))


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

    It flushes the values below the target's smallest normal to zero when the target has fewer exponent
    bits than ``x`` (measured: float32 -> float16 of ``7.6e-6`` gave 0; numpy, torch and ``astype`` give
    the float16 subnormal ``2^-17``), so those values are rounded here on the target's subnormal grid
    instead: ``round_half_even(x / step) * step`` with ``step`` its smallest subnormal (both scalings by a
    power of two, exact).
    """
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        info = jnp.finfo(dtype)
        rounded = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
        if jnp.issubdtype(x.dtype, jnp.floating) and info.nexp < jnp.finfo(x.dtype).nexp:
            step = float(info.smallest_subnormal)
            subnormal = jnp.round(x * (1.0 / step)) * step
            rounded = jnp.where(jnp.abs(x) < float(info.smallest_normal), subnormal, rounded)
        x = rounded
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


# --- Pallas-Triton lowering: FP8 dots on Hopper's FP8 tensor cores ----------------------------------

#: Environment switch, read when a kernel is lowered (:func:`fp8_wgmma_enabled`): 0/false/off/no leaves
#: FP8 x FP8 dots of Pallas-Triton kernels as jax lowers them (f16 conversions, exact sums, no FP8
#: tensor cores); unset or 1/true/on/yes (the default) gives them ``max_num_imprecise_acc = min(K, 128)``
#: (see :func:`patch_pallas_triton_fp8_dots`); other values raise ValueError.
#: On by default: much faster at large M, with the same error as Mosaic's and torch._scaled_grouped_mm's
#: (BENCHMARKS.md).
FP8_WGMMA_ENV = "EPMOE_PALLAS_FP8_WGMMA"
#: K elements a wgmma chain sums in FP8 precision before promoting to float32 (DeepSeek-V3's 128).
FP8_PROMOTE_EVERY = 128


def fp8_wgmma_enabled() -> bool:
    """:data:`FP8_WGMMA_ENV` read now (kernels read it when they are lowered; jit caches them, so set it
    before the first compile): unset or 1/true/on/yes -> True, 0/false/off/no -> False (any case,
    spaces ignored). Raises ValueError for any other value, naming the variable."""
    return env_switch(FP8_WGMMA_ENV, True, "FP8 dots as jax lowers them", "FP8 wgmma, the default")


#: Environment switch, read when a Pallas-Triton kernel that quantizes to FP8 is lowered (:func:`div_rn_enabled`):
#: unset or 1/true/on/yes divides with PTX ``div.rn.f32`` (moe_pallas/ops/quant/pallas_triton.py; the default
#: because its codes match the reference's bit for bit on the GPU), 0/false/off/no with the reference's repaired division
#: (same codes, ~3x the instructions); other values raise ValueError.
DIV_RN_ENV = "EPMOE_PALLAS_DIV_RN"


def div_rn_enabled() -> bool:
    """:data:`DIV_RN_ENV` read now (jit caches lowered kernels: set it before the first compile): unset, empty or
    1/true/on/yes -> True; 0/false/off/no -> False (any case, spaces ignored). Raises ValueError for any other value,
    naming the variable."""
    return env_switch(DIV_RN_ENV, True, "the repaired division", "PTX div.rn.f32, the default")


#: Environment switch, read when the warp-specialized Mosaic GPU grouped GEMM is traced (:func:`aligned_tiles_enabled`):
#: unset or 1/true/on/yes gives each expert its own row tiles, starting at its first row rounded down to 8
#: (``tile_metadata(row_align=8)``: no tile spent on a few rows shared with a neighbour; the default because
#: DeepSeek-V3's FP8-block layer measured faster with it, BENCHMARKS.md); 0/false/off/no keeps the global
#: ``t * block_m`` grid; other values raise ValueError.
ALIGNED_TILES_ENV = "EPMOE_PALLAS_ALIGNED_TILES"


def aligned_tiles_enabled() -> bool:
    """:data:`ALIGNED_TILES_ENV` read now (jit caches traced kernels: set it before the first compile): unset, empty or
    1/true/on/yes -> True; 0/false/off/no -> False (any case, spaces ignored). Raises ValueError for any other value,
    naming the variable."""
    return env_switch(ALIGNED_TILES_ENV, True, "row tiles on the global grid", "expert-aligned row tiles, the default")


def _is_fp8(value) -> bool:
    from jax._src.lib.mlir import ir

    return str(ir.RankedTensorType(value.type).element_type).startswith("f8")


class _Fp8DotDialect:
    """The Triton dialect module of jax's Pallas-Triton lowering, with ``dot`` giving FP8 x FP8 dots
    ``max_num_imprecise_acc = min(K, 128)`` unless :func:`fp8_wgmma_enabled` says no (everything else
    passes through)."""

    def __init__(self, dialect):
        self._dialect = dialect

    def __getattr__(self, name):
        return getattr(self._dialect, name)

    def dot(self, a, b, c, **kwargs):
        if kwargs.get("max_num_imprecise_acc") is None and _is_fp8(a) and _is_fp8(b) and fp8_wgmma_enabled():
            from jax._src.lib.mlir import ir

            k = int(ir.RankedTensorType(a.type).shape[1])
            kwargs["max_num_imprecise_acc"] = min(k, FP8_PROMOTE_EVERY)
        return self._dialect.dot(a, b, c, **kwargs)


def patch_pallas_triton_fp8_dots() -> bool:
    """Let Pallas-Triton FP8 dots use Hopper's FP8 wgmma (on unless :data:`FP8_WGMMA_ENV` is 0/false/off/no).

    jax-ml/jax@jax-v0.11.2:jax/_src/pallas/triton/lowering.py ``_dot_general_lowering`` emits
    ``tt.dot`` without ``maxNumImpreciseAcc`` (0). For FP8 operands Triton then converts both to f16 and
    uses ``mma.sync`` (no wgmma): exact float32 sums, but no FP8 tensor-core speed (seen compiling that
    IR with triton 3.6 for sm_90a). Patched, each FP8 dot gets ``max_num_imprecise_acc = min(K, 128)``:
    FP8 wgmma chains promoted to float32 every 128 K (DeepSeek-V3's per-128 promotion, as in the Triton
    backend): much faster FP8 GEMMs at large M, with the error of the other FP8 GEMMs (BENCHMARKS.md). Set the variable before the first compile (jit caches compiled
    kernels). Idempotent; False if this jax has no such lowering.
    """
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:
        return False
    dialect = getattr(lowering, "tt_dialect", None)
    if dialect is None or not hasattr(dialect, "dot"):
        return False
    if not isinstance(dialect, _Fp8DotDialect):
        lowering.tt_dialect = _Fp8DotDialect(dialect)
    return True


_FP8_DOTS_PATCHED = patch_pallas_triton_fp8_dots()
