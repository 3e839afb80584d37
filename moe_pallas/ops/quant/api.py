"""FP8 quantization ops (CONTRACT.md section 3): per-token, per-token-group, static per-tensor,
weights per-expert / per-channel / 128x128 block, and the dequantizations; 4-bit expert weights
(section 9): MXFP4 and INT4 group 32, and their dequantizations.

Mirror: ``moe_torch/ops/quant/api.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_contract.op_checks import (
    check_activation_input,
    check_dequantize_weight_4bit,
    check_fp8_activation,
    check_fp8_weight,
    check_group_size,
    check_quantize_weight_4bit,
    check_weight,
)
from moe_contract.validation import check_choice, check_per_tensor_scale, check_positive_int
from moe_contract.w4_layout import check_mma_layout_input
from moe_pallas.ops.quant import reference as ref
from moe_pallas.ops.common import cast_rounded, resolve_dtype, takes_jax_arrays

IMPLEMENTATIONS = ("reference",)

#: Default ``chunk_bytes`` of :func:`quantize_weight_fp8`: 1 GiB of float32 per chunk of experts
#: (9 experts of DeepSeek-V3's ``w13 [257, 4096, 7168]``, whose whole float32 copy is 30 GB).
QUANT_CHUNK_BYTES = 1 << 30

#: The chunked weight quantization as one executable: an eager call runs the chunk loop on the
#: device (one compile per shape, layout and chunk size).
_quantize_weight_fp8_chunked = jax.jit(ref.quantize_weight_fp8_chunked, static_argnames=("layout", "block", "chunk_experts"))


def weight_quant_chunk_experts(shape: tuple[int, int, int], layout: str, block: int = 128,
                               chunk_bytes: int = QUANT_CHUNK_BYTES) -> int:
    """Experts per chunk of :func:`quantize_weight_fp8` for ``w [E, N, K]``: the most whose float32
    copy, ``4 * n * N * K`` bytes (``N``, ``K`` rounded up to multiples of ``block`` for
    ``"block"``), fits ``chunk_bytes``; at least 1 and at most ``E`` (``E`` for empty experts)."""
    E, N, K = shape
    if layout == "block":
        N, K = -(-N // block) * block, -(-K // block) * block
    per_expert = 4 * N * K
    return max(1, min(E, chunk_bytes // per_expert if per_expert else E))


@takes_jax_arrays
def per_token_group_quant_fp8(
    x: jax.Array, group_size: int = 128, *, implementation: str | None = None
) -> tuple[jax.Array, jax.Array]:
    """Dynamic FP8 quantization per ``1 x group_size`` group along the last dim.

    Args:
      x: ``[rows, K]`` float32 / bf16 / float16, ``K % group_size == 0``.
      group_size: ``G`` (128 in DeepSeek-V3).

    Returns:
      ``(q [rows, K] float8_e4m3fn, scale [rows, K // G] float32)``, where
      ``scale = max(amax, 1e-10) * float32(1/448)`` multiplies ``q`` back to ``x``.

    Raises:
      ValueError: ``x`` not 2-D, ``K % G != 0``; TypeError: ``x`` not float.
    """
    op = "per_token_group_quant_fp8"
    check_activation_input(op, x)
    check_group_size(op, x, group_size)
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    return ref.per_token_group_quant_fp8_reference(x, group_size)


@takes_jax_arrays
def per_token_quant_fp8(x: jax.Array, *, implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Dynamic FP8 quantization, one scale per row: ``x [rows, K]`` -> ``(q [rows, K] fp8, scale [rows, 1] f32)``.

    Raises: ValueError (``x`` not 2-D), TypeError (``x`` not float).
    """
    op = "per_token_quant_fp8"
    check_activation_input(op, x)
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    return ref.per_token_quant_fp8_reference(x)


@takes_jax_arrays
def static_quant_fp8(x: jax.Array, scale: jax.Array, *, implementation: str | None = None) -> jax.Array:
    """Static per-tensor FP8 quantization: ``q = cast_rne(clamp(x / scale, -448, 448))``.

    Args:
      x: ``[rows, K]`` float. scale: ``[]`` or ``[1]`` float32, the dequantization multiplier.

    Raises: ValueError (shapes), TypeError (dtypes).
    """
    op = "static_quant_fp8"
    check_activation_input(op, x)
    check_per_tensor_scale(op, "scale", scale)
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    return ref.static_quant_fp8_reference(x, scale.reshape(()))


@takes_jax_arrays
def dequantize_fp8(q: jax.Array, scale: jax.Array) -> jax.Array:
    """``q [rows, K]`` fp8 times its scale -> float32 ``[rows, K]``.

    ``scale``: ``[rows, K // G]`` (per-token-group; per-token is ``G = K``, ``[rows, 1]``)
    or ``[]`` (per-tensor), float32.

    Raises: ValueError (shapes), TypeError (dtypes).
    """
    op = "dequantize_fp8"
    check_fp8_activation(op, q, scale)
    return ref.dequantize_fp8_reference(q, scale)


@takes_jax_arrays
def quantize_weight_fp8(
    w: jax.Array, layout: str = "per_channel", *, block: int = 128, chunk_bytes: int = QUANT_CHUNK_BYTES
) -> tuple[jax.Array, jax.Array]:
    """Quantize expert weights ``w [E, N, K]`` to FP8.

    Args:
      w: ``[E, N, K]`` float32 / bf16 / float16; not modified.
      layout: ``"per_expert"`` (scale ``[E]``), ``"per_channel"`` (``[E, N]``, one per output
        row) or ``"block"`` (``[E, ceil(N/128), ceil(K/128)]``, DeepSeek-V3's ``weight_scale_inv``).
      block: the block edge of ``"block"`` (128).
      chunk_bytes: bytes of float32 one chunk of experts may take (default
        :data:`QUANT_CHUNK_BYTES`, 1 GiB).

    Memory: the experts are quantized a chunk at a time, ``n`` =
    :func:`weight_quant_chunk_experts` of them: the most whose float32 copy, ``4 * n * N * K``
    bytes (``N``, ``K`` rounded up to multiples of ``block`` for ``"block"``), fits
    ``chunk_bytes``, and at least one. Beyond ``w`` and the result, the peak memory is at most one
    chunk's float32 copy plus a few temporaries of the size of the chunk's scales. The result is
    bit-identical for every ``chunk_bytes`` (each scale layout is per expert). Measured on the CPU
    by ``tests/test_quant_memory.py``.

    In JAX the chunks are a ``lax.fori_loop`` inside one jitted function (the eager call runs that
    one executable; its temporaries are XLA's ``memory_analysis().temp_size_in_bytes``, which the
    test bounds). Under an outer ``jax.jit`` the same loop is traced into the caller's program: the
    iterations stay sequential and no value of the program but the result exceeds one chunk's float32
    copy, but buffer assignment (and any loop unrolling) is then XLA's, so the bound is XLA's to keep.

    Returns: ``(q [E, N, K] float8_e4m3fn, scale float32)``; ``w ~= q * scale`` (broadcast).

    Raises: ValueError (shape, layout, ``chunk_bytes`` not an int >= 1), TypeError (dtype).
    """
    op = "quantize_weight_fp8"
    check_weight(op, w, layout, block)
    check_positive_int(op, "chunk_bytes", chunk_bytes)
    n = weight_quant_chunk_experts(tuple(w.shape), layout, block, chunk_bytes)
    return _quantize_weight_fp8_chunked(w, layout=layout, block=block, chunk_experts=n)


@takes_jax_arrays
def dequantize_weight_fp8(q: jax.Array, w_scale: jax.Array, *, block: int = 128) -> jax.Array:
    """``q [E, N, K]`` fp8 times its weight scale (any layout) -> float32 ``[E, N, K]``."""
    op = "dequantize_weight_fp8"
    check_fp8_weight(op, q, w_scale, block)
    return ref.dequantize_weight_fp8_reference(q, w_scale, block)


# --- 4-bit expert weights (CONTRACT.md section 9) ----------------------------------------------------

_W4_QUANTIZERS = {"mxfp4": jax.jit(ref.quantize_weight_mxfp4_reference),
                  "int4": jax.jit(ref.quantize_weight_int4_reference)}
_W4_SCALE_DTYPES = {"mxfp4": jnp.uint8, "int4": jnp.bfloat16}


@functools.partial(jax.jit, static_argnames=("w_format", "out_dtype"))
def _dequantize_weight_4bit(w_q, w_scale, w_format, out_dtype):
    return cast_rounded(ref.dequantize_weight_4bit_reference(w_q, w_scale, w_format), out_dtype)


def _w4_chunk_rows(K: int, chunk_bytes: int) -> int:
    """Rows of ``w`` viewed as ``[rows, K]`` per chunk of the 4-bit quantizers: the most whose float32
    copy (``4 * K`` bytes a row) fits ``chunk_bytes``, at least 1."""
    return max(1, chunk_bytes // max(4 * K, 1))


def _check_finite(op: str, chunk: jax.Array, row0: int, shape: tuple[int, ...]) -> None:
    """``ValueError`` naming the first non-finite element of ``chunk`` (rows ``row0..`` of ``w`` viewed as
    ``[rows, K]``) by its index in ``w``'s ``shape``: a device reduction and a host sync."""
    bad = ~jnp.isfinite(chunk)
    n_bad = int(bad.sum())
    if n_bad:
        K = chunk.shape[-1]
        first = int(jnp.argmax(bad.reshape(-1)))
        index = tuple(int(i) for i in np.unravel_index(first + row0 * K, shape))
        value = float(chunk.reshape(-1)[first])
        raise ValueError(f"{op}: w must be finite (CONTRACT.md section 9: NaN and inf have no 4-bit code); got "
                         f"w[{', '.join(map(str, index))}] = {value} (the first of {n_bad} non-finite values "
                         f"in rows {row0}..{row0 + chunk.shape[0] - 1} of w viewed as [rows, K])")


def _quantize_weight_4bit(op: str, w: jax.Array, w_format: str, chunk_bytes: int) -> tuple[jax.Array, jax.Array]:
    """Validate, then quantize ``w [..., K]`` a chunk of rows at a time, each chunk checked for non-finite
    values on the host first (so nothing is returned for a weight that holds one)."""
    check_quantize_weight_4bit(op, w, w_format)
    check_positive_int(op, "chunk_bytes", chunk_bytes)
    if isinstance(w, jax.core.Tracer):
        raise TypeError(f"{op}: w must be a concrete array, not a tracer (under jax.jit / vmap / grad): the check "
                        f"for non-finite values runs on the host. Quantize outside the traced function (an offline "
                        f"step), or trace moe_pallas.ops.quant.reference.quantize_weight_{w_format}_reference "
                        f"(no check: a group holding NaN / inf gets a NaN scale); got {type(w).__name__}")
    shape, K = tuple(w.shape), int(w.shape[-1])
    quantize, scale_dtype = _W4_QUANTIZERS[w_format], _W4_SCALE_DTYPES[w_format]
    if w.size == 0:  # no rows or K == 0: nothing to quantize
        return (jnp.zeros((*shape[:-1], K // 2), jnp.uint8),
                jnp.zeros((*shape[:-1], K // ref.W4_GROUP), scale_dtype))
    rows = jnp.asarray(w).reshape(-1, K)
    step = _w4_chunk_rows(K, chunk_bytes)
    parts_q, parts_s = [], []
    for start in range(0, rows.shape[0], step):
        chunk = rows[start:start + step]
        _check_finite(op, chunk, start, shape)
        q, s = quantize(chunk)
        parts_q.append(q)
        parts_s.append(s)
    w_q = parts_q[0] if len(parts_q) == 1 else jnp.concatenate(parts_q)
    w_scale = parts_s[0] if len(parts_s) == 1 else jnp.concatenate(parts_s)
    return w_q.reshape(*shape[:-1], K // 2), w_scale.reshape(*shape[:-1], K // ref.W4_GROUP)


@takes_jax_arrays
def quantize_weight_mxfp4(w: jax.Array, *, chunk_bytes: int = QUANT_CHUNK_BYTES) -> tuple[jax.Array, jax.Array]:
    """Quantize expert weights to MXFP4 (CONTRACT.md section 9): e2m1 codes, one e8m0 scale per group of
    32 along ``K``.

    Args:
      w: ``[E, N, K]`` (or one expert's ``[N, K]``) float32 / bf16 / float16, finite, ``K % 32 == 0``; not
        modified. A concrete array: not under ``jax.jit`` (the finiteness check runs on the host).
      chunk_bytes: bytes of float32 one chunk of rows may take (default :data:`QUANT_CHUNK_BYTES`, 1 GiB).

    Per group of 32 (float32 arithmetic on the exact value of ``w``): ``amax = max |w|``;
    ``s = clamp(floor(log2(amax)) - 2 + 127, 0, 254)`` (0 for ``amax == 0``); ``v = w / 2^(s - 127)``;
    the code is ``v`` rounded to the nearest e2m1 value ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, ties to the even
    code, magnitudes above 6 saturating to 6, sign bit 3 set where ``v < 0``. Computed on the bits of
    ``w`` with exact integer and float operations (``quantize_weight_mxfp4_reference``), so bit-identical
    to ``moe_torch``'s, subnormal weights included (XLA's CPU runtime flushes subnormal floats; the bits
    do not): tested on the CPU (``tests/test_4bit_interop.py``); on the GPU by construction (no division,
    no rounding that XLA may drop).

    Memory: ``w`` is quantized a chunk of rows (``w`` viewed as ``[rows, K]``) at a time, the most rows
    whose float32 copy fits ``chunk_bytes``, at least one; each chunk is one jitted call. Every group lies
    in one row, so the result is bit-identical for every ``chunk_bytes``. Non-finite values are found on
    the host (a sync per chunk): an offline step.

    Returns: ``(w_q [E, N, K // 2] uint8, w_scale [E, N, K // 32] uint8)`` (``[N, ..]`` for a 2-D ``w``):
      two codes a byte, element ``2i`` in the low nibble; ``w_scale`` holds e8m0 codes ``s`` meaning the
      multiplier ``2^(s - 127)``: ``w ~= e2m1(code) * 2^(s - 127)``. The bytes of gpt-oss's
      ``*_blocks [E, N, K // 32, 16]`` are ``w_q``, its ``*_scales`` are ``w_scale``.

    Raises: ValueError (``w`` not 2-D / 3-D, ``K % 32 != 0``, a non-finite value, ``chunk_bytes`` not an
      int >= 1), TypeError (dtype; ``w`` a tracer).

    Source: OCP Microscaling Formats (MX) Specification v1.0 (e2m1, e8m0, the scale exponent
    ``floor(log2(amax)) - emax_elem``).
    """
    return _quantize_weight_4bit("quantize_weight_mxfp4", w, "mxfp4", chunk_bytes)


@takes_jax_arrays
def dequantize_weight_mxfp4(w_q: jax.Array, w_scale: jax.Array, *, out_dtype=jnp.float32) -> jax.Array:
    """MXFP4 weights back to floats: ``wd = e2m1(code) * 2^(s - 127)``, exact in float32 (subnormal results
    included), then rounded to ``out_dtype`` (nearest even). A group whose scale is 255 (NaN in OCP MX) is
    NaN throughout. Jittable.

    Args:
      w_q: ``[E, N, K // 2]`` (or ``[N, K // 2]``) uint8 packed e2m1 codes, element ``2i`` in the low nibble.
      w_scale: ``[E, N, K // 32]`` (or ``[N, K // 32]``) uint8 e8m0 codes.
      out_dtype: float32 (default; bit-identical across the four implementations), bf16 or float16.

    Returns: ``wd [E, N, K]`` (or ``[N, K]``) ``out_dtype``.

    Raises: ValueError (shapes, ``K = 2 * w_q.shape[-1]`` not a multiple of 32), TypeError (dtypes).

    Source: OCP Microscaling Formats (MX) Specification v1.0.
    """
    op = "dequantize_weight_mxfp4"
    out_dtype = resolve_dtype(check_dequantize_weight_4bit(op, w_q, w_scale, "mxfp4", out_dtype))
    return _dequantize_weight_4bit(w_q, w_scale, "mxfp4", out_dtype)


@takes_jax_arrays
def quantize_weight_int4(w: jax.Array, *, chunk_bytes: int = QUANT_CHUNK_BYTES) -> tuple[jax.Array, jax.Array]:
    """Quantize expert weights to symmetric INT4, one bf16 scale per group of 32 along ``K``
    (CONTRACT.md section 9; compressed-tensors ``pack-quantized``, as Kimi K2-Thinking ships).

    Args:
      w: ``[E, N, K]`` (or one expert's ``[N, K]``) float32 / bf16 / float16, finite, ``K % 32 == 0``; not
        modified. A concrete array: not under ``jax.jit`` (the finiteness check runs on the host).
      chunk_bytes: bytes of float32 one chunk of rows may take (default :data:`QUANT_CHUNK_BYTES`, 1 GiB).

    Per group of 32: ``amax = max |w|`` in float32; ``scale = bf16_rne(max(amax, 1e-10) * float32(2/15))``
    (``amax / 7.5`` as an exact multiplication); ``q = clamp(rne(w / float32(scale)), -8, 7)`` (the IEEE
    quotient, round half to even); the stored code is offset binary, ``q + 8``. No division is computed
    (XLA's GPU division is approximate): exact comparisons decide each rounding
    (``quantize_weight_int4_reference``), bit-identical to ``moe_torch``'s (tested on the CPU; on the GPU
    by construction).

    Memory, chunks and the host check: as :func:`quantize_weight_mxfp4`.

    Returns: ``(w_q [E, N, K // 2] uint8, w_scale [E, N, K // 32] bf16)`` (``[N, ..]`` for a 2-D ``w``):
      two codes a byte, element ``2i`` in the low nibble; ``w_scale`` multiplies:
      ``w ~= (code - 8) * scale``. compressed-tensors' ``weight_packed [N, K // 8]`` int32 (element ``i``
      at bits ``4i``) is ``w_q`` viewed as little-endian int32; its ``weight_scale`` is ``w_scale``.

    Raises: ValueError (``w`` not 2-D / 3-D, ``K % 32 != 0``, a non-finite value, ``chunk_bytes`` not an
      int >= 1), TypeError (dtype; ``w`` a tracer).

    Source: compressed-tensors (neuralmagic/compressed-tensors) ``pack-quantized`` format: symmetric group
    quantization, offset-binary 4-bit codes packed eight to an int32.
    """
    return _quantize_weight_4bit("quantize_weight_int4", w, "int4", chunk_bytes)


@takes_jax_arrays
def dequantize_weight_int4(w_q: jax.Array, w_scale: jax.Array, *, out_dtype=jnp.float32) -> jax.Array:
    """INT4 weights back to floats: ``wd = float32(code - 8) * float32(scale)`` (exact), then rounded to
    ``out_dtype`` (nearest even). Jittable.

    Args:
      w_q: ``[E, N, K // 2]`` (or ``[N, K // 2]``) uint8 packed offset-binary codes, element ``2i`` in the
        low nibble.
      w_scale: ``[E, N, K // 32]`` (or ``[N, K // 32]``) bf16 multipliers.
      out_dtype: float32 (default; bit-identical across the four implementations), bf16 or float16.

    Returns: ``wd [E, N, K]`` (or ``[N, K]``) ``out_dtype``.

    Raises: ValueError (shapes, ``K = 2 * w_q.shape[-1]`` not a multiple of 32), TypeError (dtypes).

    Source: compressed-tensors ``pack-quantized`` format.
    """
    op = "dequantize_weight_int4"
    out_dtype = resolve_dtype(check_dequantize_weight_4bit(op, w_q, w_scale, "int4", out_dtype))
    return _dequantize_weight_4bit(w_q, w_scale, "int4", out_dtype)


def _mma_permute(op: str, w_q: jax.Array, to_mma: bool) -> jax.Array:
    check_mma_layout_input(op, str(jnp.dtype(w_q.dtype)), tuple(w_q.shape))
    return ref.mma_permute(w_q, to_mma)


@takes_jax_arrays
def mxfp4_to_mma_layout(w_q: jax.Array) -> jax.Array:
    """MXFP4 packed codes re-laid out for the packed bf16 decode (CONTRACT.md section 9, MMA layout): a permutation
    of the 32 bits of each little-endian 4-byte group of a row (``moe_contract/w4_layout.py``), kept beside ``w_q``.
    Jittable.

    Args:
      w_q: ``[..., K // 2]`` uint8 packed codes (checkpoint layout), ``K // 2`` a multiple of 4.

    Returns: the same shape and dtype. :func:`mxfp4_from_mma_layout` inverts it bit for bit.

    Raises: ValueError (dtype, a last axis not a multiple of 4), TypeError (not a JAX array).
    """
    return _mma_permute("mxfp4_to_mma_layout", w_q, True)


@takes_jax_arrays
def mxfp4_from_mma_layout(w_q: jax.Array) -> jax.Array:
    """The inverse of :func:`mxfp4_to_mma_layout` (the checkpoint layout back, bit for bit); arguments and errors
    as there."""
    return _mma_permute("mxfp4_from_mma_layout", w_q, False)
