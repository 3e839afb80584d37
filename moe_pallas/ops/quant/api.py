"""FP8 quantization ops (CONTRACT.md section 3): per-token, per-token-group, static per-tensor,
weights per-expert / per-channel / 128x128 block, and the dequantizations.

Mirror: ``moe_torch/ops/quant/api.py``.
"""

from __future__ import annotations

import jax

from moe_contract.op_checks import (
    check_activation_input,
    check_fp8_activation,
    check_fp8_weight,
    check_group_size,
    check_weight,
)
from moe_contract.validation import check_choice, check_per_tensor_scale
from moe_pallas.ops.quant import reference as ref
from moe_pallas.ops.common import takes_jax_arrays

IMPLEMENTATIONS = ("reference",)


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
def quantize_weight_fp8(w: jax.Array, layout: str = "per_channel", *, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """Quantize expert weights ``w [E, N, K]`` to FP8.

    Args:
      layout: ``"per_expert"`` (scale ``[E]``), ``"per_channel"`` (``[E, N]``, one per output
        row) or ``"block"`` (``[E, ceil(N/128), ceil(K/128)]``, DeepSeek-V3's ``weight_scale_inv``).

    Returns: ``(q [E, N, K] float8_e4m3fn, scale float32)``; ``w ~= q * scale`` (broadcast).

    Raises: ValueError (shape, layout), TypeError (dtype).
    """
    op = "quantize_weight_fp8"
    check_weight(op, w, layout, block)
    return ref.quantize_weight_fp8_reference(w, layout, block)


@takes_jax_arrays
def dequantize_weight_fp8(q: jax.Array, w_scale: jax.Array, *, block: int = 128) -> jax.Array:
    """``q [E, N, K]`` fp8 times its weight scale (any layout) -> float32 ``[E, N, K]``."""
    op = "dequantize_weight_fp8"
    check_fp8_weight(op, q, w_scale, block)
    return ref.dequantize_weight_fp8_reference(q, w_scale, block)
