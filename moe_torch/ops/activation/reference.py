"""``silu_and_mul`` / ``gelu_tanh_and_mul`` reference in torch: CONTRACT.md section 4.

Mirror: ``moe_pallas/ops/activation/reference.py``.
"""

from __future__ import annotations

import math

import torch

from moe_torch.ops.common import cast_rounded
from moe_torch.ops.quant.reference import per_token_group_quant_fp8_reference, per_token_quant_fp8_reference

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _silu(g: torch.Tensor) -> torch.Tensor:
    return g * torch.sigmoid(g)


def _gelu_tanh(g: torch.Tensor) -> torch.Tensor:
    return 0.5 * g * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)))


ACTIVATIONS = {"silu": _silu, "gelu_tanh": _gelu_tanh}


def act_and_mul_reference(
    h: torch.Tensor, activation: str, quant: str | None, group_size: int, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``h [M, 2*I]`` -> ``act(h[:, :I]) * h[:, I:]`` in float32, then cast or quantize."""
    inter = h.shape[1] // 2
    hf = h.float()
    out = ACTIVATIONS[activation](hf[:, :inter]) * hf[:, inter:]
    if quant is None:
        return cast_rounded(out, out_dtype), None
    if quant == "fp8_per_token":
        return per_token_quant_fp8_reference(out)
    return per_token_group_quant_fp8_reference(out, group_size)
