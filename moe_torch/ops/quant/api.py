"""FP8 quantization ops (CONTRACT.md section 3): per-token, per-token-group, static per-tensor,
weights per-expert / per-channel / 128x128 block, and the dequantizations.

Mirror: ``moe_pallas/ops/quant/api.py``.
"""

from __future__ import annotations

import torch

from moe_contract.op_checks import (
    check_activation_input,
    check_fp8_activation,
    check_fp8_weight,
    check_group_size,
    check_weight,
)
from moe_contract.validation import check_choice, check_per_tensor_scale, check_positive_int
from moe_torch.ops.quant import reference as ref
from moe_torch.ops.common import takes_torch_tensors

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
