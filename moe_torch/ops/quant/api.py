"""FP8 quantization ops (CONTRACT.md section 3): per-token, per-token-group, static per-tensor,
weights per-expert / per-channel / 128x128 block, and the dequantizations; 4-bit expert weights
(section 9): MXFP4 and INT4 group 32, and their dequantizations.

Mirror: ``moe_pallas/ops/quant/api.py``.
"""

from __future__ import annotations

import torch

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
from moe_torch.ops.quant import reference as ref
from moe_torch.ops.common import resolve_dtype, takes_torch_tensors

IMPLEMENTATIONS = ("reference",)

#: Default ``chunk_bytes`` of :func:`quantize_weight_fp8`: 1 GiB of float32 per chunk of experts
#: (9 experts of DeepSeek-V3's ``w13 [257, 4096, 7168]``, whose whole float32 copy is 30 GB).
QUANT_CHUNK_BYTES = 1 << 30


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


@takes_torch_tensors
def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int = 128, *, implementation: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
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


@takes_torch_tensors
def per_token_quant_fp8(x: torch.Tensor, *, implementation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization, one scale per row: ``x [rows, K]`` -> ``(q [rows, K] fp8, scale [rows, 1] f32)``.

    Raises: ValueError (``x`` not 2-D), TypeError (``x`` not float).
    """
    op = "per_token_quant_fp8"
    check_activation_input(op, x)
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    return ref.per_token_quant_fp8_reference(x)


@takes_torch_tensors
def static_quant_fp8(x: torch.Tensor, scale: torch.Tensor, *, implementation: str | None = None) -> torch.Tensor:
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


@takes_torch_tensors
def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q [rows, K]`` fp8 times its scale -> float32 ``[rows, K]``.

    ``scale``: ``[rows, K // G]`` (per-token-group; per-token is ``G = K``, ``[rows, 1]``)
    or ``[]`` (per-tensor), float32.

    Raises: ValueError (shapes), TypeError (dtypes).
    """
    op = "dequantize_fp8"
    check_fp8_activation(op, q, scale)
    return ref.dequantize_fp8_reference(q, scale)


@takes_torch_tensors
def quantize_weight_fp8(
    w: torch.Tensor, layout: str = "per_channel", *, block: int = 128, chunk_bytes: int = QUANT_CHUNK_BYTES
) -> tuple[torch.Tensor, torch.Tensor]:
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

    Returns: ``(q [E, N, K] float8_e4m3fn, scale float32)``; ``w ~= q * scale`` (broadcast).

    Raises: ValueError (shape, layout, ``chunk_bytes`` not an int >= 1), TypeError (dtype).
    """
    op = "quantize_weight_fp8"
    check_weight(op, w, layout, block)
    check_positive_int(op, "chunk_bytes", chunk_bytes)
    n = weight_quant_chunk_experts(tuple(w.shape), layout, block, chunk_bytes)
    return ref.quantize_weight_fp8_chunked(w, layout, block, n)


@takes_torch_tensors
def dequantize_weight_fp8(q: torch.Tensor, w_scale: torch.Tensor, *, block: int = 128) -> torch.Tensor:
    """``q [E, N, K]`` fp8 times its weight scale (any layout) -> float32 ``[E, N, K]``."""
    op = "dequantize_weight_fp8"
    check_fp8_weight(op, q, w_scale, block)
    return ref.dequantize_weight_fp8_reference(q, w_scale, block)


def _w4_chunk_rows(K: int, chunk_bytes: int) -> int:
    """Rows of ``w`` viewed as ``[rows, K]`` per chunk of the 4-bit quantizers: the most whose float32
    copy (``4 * K`` bytes a row) fits ``chunk_bytes``, at least 1."""
    return max(1, chunk_bytes // max(4 * K, 1))


@takes_torch_tensors
def quantize_weight_mxfp4(w: torch.Tensor, *, chunk_bytes: int = QUANT_CHUNK_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize expert weights to MXFP4 (CONTRACT.md section 9): e2m1 codes, one e8m0 scale per group
    of 32 along ``K``.

    Args:
      w: ``[E, N, K]`` (or one expert's ``[N, K]``) float32 / bf16 / float16, finite, ``K % 32 == 0``;
        not modified.
      chunk_bytes: bytes of float32 one chunk of rows may take (default :data:`QUANT_CHUNK_BYTES`, 1 GiB).

    Per group of 32 (float32 arithmetic on the exact value of ``w``): ``amax = max |w|``;
    ``s = clamp(floor(log2(amax)) - 2 + 127, 0, 254)`` (0 for ``amax == 0``); ``v = w / 2^(s - 127)``;
    the code is ``v`` rounded to the nearest e2m1 value ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, ties to the even
    code, magnitudes above 6 saturating to 6, sign bit 3 set where ``v < 0``.

    Memory: ``w`` is quantized a chunk of rows (``w`` viewed as ``[rows, K]``) at a time, the most
    rows whose float32 copy fits ``chunk_bytes``, at least one; beyond ``w`` and the result, the peak is a
    few temporaries of the chunk's size. Every group lies in one row, so the result is bit-identical for
    every ``chunk_bytes``. Non-finite values are found on the host (a sync): an offline step.

    Returns: ``(w_q [E, N, K // 2] uint8, w_scale [E, N, K // 32] uint8)`` (``[N, ..]`` for a 2-D ``w``):
      two codes a byte, element ``2i`` in the low nibble; ``w_scale`` holds e8m0 codes ``s`` meaning the
      multiplier ``2^(s - 127)``: ``w ~= e2m1(code) * 2^(s - 127)``. The bytes of gpt-oss's
      ``*_blocks [E, N, K // 32, 16]`` are ``w_q``, its ``*_scales`` are ``w_scale``.

    Raises: ValueError (``w`` not 2-D / 3-D, ``K % 32 != 0``, a non-finite value, ``chunk_bytes`` not an
      int >= 1), TypeError (dtype).

    Source: OCP Microscaling Formats (MX) Specification v1.0 (e2m1, e8m0, the scale exponent
    ``floor(log2(amax)) - emax_elem``).
    """
    op = "quantize_weight_mxfp4"
    check_quantize_weight_4bit(op, w, "mxfp4")
    check_positive_int(op, "chunk_bytes", chunk_bytes)
    return ref.quantize_weight_4bit_chunked(op, w, "mxfp4", _w4_chunk_rows(w.shape[-1], chunk_bytes))


@takes_torch_tensors
def dequantize_weight_mxfp4(w_q: torch.Tensor, w_scale: torch.Tensor, *, out_dtype=torch.float32) -> torch.Tensor:
    """MXFP4 weights back to floats: ``wd = e2m1(code) * 2^(s - 127)``, exact in float32, then rounded to
    ``out_dtype`` (nearest even). A group whose scale is 255 (NaN in OCP MX) is NaN throughout.

    Args:
      w_q: ``[E, N, K // 2]`` (or ``[N, K // 2]``) uint8 packed e2m1 codes, element ``2i`` in the low nibble.
      w_scale: ``[E, N, K // 32]`` (or ``[N, K // 32]``) uint8 e8m0 codes.
      out_dtype: float32 (default; bit-identical across the four implementations), bf16 or float16.

    Returns: ``wd [E, N, K]`` (or ``[N, K]``) ``out_dtype``.

    Raises: ValueError (shapes, ``K = 2 * w_q.shape[-1]`` not a multiple of 32), TypeError (dtypes).
    """
    op = "dequantize_weight_mxfp4"
    out_dtype = resolve_dtype(check_dequantize_weight_4bit(op, w_q, w_scale, "mxfp4", out_dtype))
    return ref.dequantize_weight_4bit_reference(w_q, w_scale, "mxfp4", out_dtype)


@takes_torch_tensors
def quantize_weight_int4(w: torch.Tensor, *, chunk_bytes: int = QUANT_CHUNK_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize expert weights to symmetric INT4, one bf16 scale per group of 32 along ``K``
    (CONTRACT.md section 9; compressed-tensors ``pack-quantized``, as Kimi K2-Thinking ships).

    Args:
      w: ``[E, N, K]`` (or one expert's ``[N, K]``) float32 / bf16 / float16, finite, ``K % 32 == 0``;
        not modified.
      chunk_bytes: bytes of float32 one chunk of rows may take (default :data:`QUANT_CHUNK_BYTES`, 1 GiB).

    Per group of 32: ``amax = max |w|`` in float32; ``scale = bf16_rne(max(amax, 1e-10) * float32(2/15))``
    (``amax / 7.5`` as an exact multiplication); ``q = clamp(rne(w / float32(scale)), -8, 7)`` (IEEE
    division, round half to even); the stored code is offset binary, ``q + 8``.

    Memory: ``w`` is quantized a chunk of rows (``w`` viewed as ``[rows, K]``) at a time, the most
    rows whose float32 copy fits ``chunk_bytes``, at least one; beyond ``w`` and the result, the peak is a
    few temporaries of the chunk's size. Every group lies in one row, so the result is bit-identical for
    every ``chunk_bytes``. Non-finite values are found on the host (a sync): an offline step.

    Returns: ``(w_q [E, N, K // 2] uint8, w_scale [E, N, K // 32] bf16)`` (``[N, ..]`` for a 2-D ``w``):
      two codes a byte, element ``2i`` in the low nibble; ``w_scale`` multiplies:
      ``w ~= (code - 8) * scale``. compressed-tensors' ``weight_packed [N, K // 8]`` int32 (element ``i``
      at bits ``4i``) is ``w_q`` viewed as little-endian int32; its ``weight_scale`` is ``w_scale``.

    Raises: ValueError (``w`` not 2-D / 3-D, ``K % 32 != 0``, a non-finite value, ``chunk_bytes`` not an
      int >= 1), TypeError (dtype).

    Source: compressed-tensors (neuralmagic/compressed-tensors) ``pack-quantized`` format: symmetric
    group quantization, offset-binary 4-bit codes packed eight to an int32.
    """
    op = "quantize_weight_int4"
    check_quantize_weight_4bit(op, w, "int4")
    check_positive_int(op, "chunk_bytes", chunk_bytes)
    return ref.quantize_weight_4bit_chunked(op, w, "int4", _w4_chunk_rows(w.shape[-1], chunk_bytes))


@takes_torch_tensors
def dequantize_weight_int4(w_q: torch.Tensor, w_scale: torch.Tensor, *, out_dtype=torch.float32) -> torch.Tensor:
    """INT4 weights back to floats: ``wd = float32(code - 8) * float32(scale)``, then rounded to
    ``out_dtype`` (nearest even).

    Args:
      w_q: ``[E, N, K // 2]`` (or ``[N, K // 2]``) uint8 packed offset-binary codes, element ``2i`` in the
        low nibble.
      w_scale: ``[E, N, K // 32]`` (or ``[N, K // 32]``) bf16 multipliers.
      out_dtype: float32 (default; bit-identical across the four implementations), bf16 or float16.

    Returns: ``wd [E, N, K]`` (or ``[N, K]``) ``out_dtype``.

    Raises: ValueError (shapes, ``K = 2 * w_q.shape[-1]`` not a multiple of 32), TypeError (dtypes).
    """
    op = "dequantize_weight_int4"
    out_dtype = resolve_dtype(check_dequantize_weight_4bit(op, w_q, w_scale, "int4", out_dtype))
    return ref.dequantize_weight_4bit_reference(w_q, w_scale, "int4", out_dtype)


def _mma_permute(op: str, w_q: torch.Tensor, to_mma: bool) -> torch.Tensor:
    check_mma_layout_input(op, str(w_q.dtype).removeprefix("torch."), tuple(w_q.shape))
    return ref.mma_permute(w_q, to_mma)


@takes_torch_tensors
def mxfp4_to_mma_layout(w_q: torch.Tensor) -> torch.Tensor:
    """MXFP4 packed codes re-laid out for the packed bf16 decode (CONTRACT.md section 9, MMA layout): a permutation
    of the 32 bits of each little-endian 4-byte group of a row (``moe_contract/w4_layout.py``), kept beside ``w_q``.

    Args:
      w_q: ``[..., K // 2]`` uint8 packed codes (checkpoint layout), ``K // 2`` a multiple of 4; any device.

    Returns: the same shape, dtype and device. :func:`mxfp4_from_mma_layout` inverts it bit for bit.

    Raises: ValueError (dtype, a last axis not a multiple of 4), TypeError (not a torch tensor).
    """
    return _mma_permute("mxfp4_to_mma_layout", w_q, True)


@takes_torch_tensors
def mxfp4_from_mma_layout(w_q: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`mxfp4_to_mma_layout` (the checkpoint layout back, bit for bit); arguments and errors
    as there."""
    return _mma_permute("mxfp4_from_mma_layout", w_q, False)
