"""silu_and_mul / gelu_tanh_and_mul (CONTRACT.md section 4), optionally fused with FP8 quantization: the torch ops
against the jnp ops on the shared cases of ``op_cases/activation.py``.

Both frameworks' public ops run with ``implementation=None``: the references on the CPU (the device's default
backends under ``EPMOE_TEST_DEVICE=gpu``). The torch op is the one under test, the jnp op its judge; both are
checked against a float64 numpy activation, and each framework's fused FP8 output against its own
``per_token_quant_fp8`` / ``per_token_group_quant_fp8`` of its float32 activation.
"""

from __future__ import annotations

import moe_pallas
import moe_torch
from common import JNP_DTYPES, TORCH_DTYPES, to_jax
from op_cases import TorchArrays
from op_cases.activation import ActivationCases
from tolerances import BF16_REL_FRO


def _quantize(mod, a32, quant, group_size):
    return mod.per_token_quant_fp8(a32) if quant == "fp8_per_token" else mod.per_token_group_quant_fp8(a32, group_size)


class TestActivationReference(TorchArrays, ActivationCases):
    """``moe_torch``'s ops against ``moe_pallas``'s."""

    SHAPES = ("M1", "odd-I", "ragged-M")
    FP8_CASES = ("token-M12", "group-M12")
    #: silu's exp may differ by an ulp between XLA and torch, so codes may (rarely) differ by one step.
    FUSED_REL_FRO = BF16_REL_FRO

    def act_and_mul(self, h, activation, quant=None, group_size=128, out_dtype=None, config=None):
        out_dtype = None if out_dtype is None else TORCH_DTYPES[out_dtype]
        return getattr(moe_torch, f"{activation}_and_mul")(h, quant=quant, group_size=group_size, out_dtype=out_dtype)

    def reference_act_and_mul(self, h_np, dtype, activation, quant=None, group_size=128, out_dtype=None):
        out_dtype = None if out_dtype is None else JNP_DTYPES[out_dtype]
        return getattr(moe_pallas, f"{activation}_and_mul")(to_jax(h_np, dtype), quant=quant, group_size=group_size,
                                                            out_dtype=out_dtype)

    def quantize(self, a32, quant, group_size):
        return _quantize(moe_torch, a32, quant, group_size)

    def dequantize(self, q, scale):
        return moe_torch.dequantize_fp8(q, scale)

    def reference_quantize(self, a32, quant, group_size):
        return _quantize(moe_pallas, a32, quant, group_size)

    def reference_dequantize(self, q, scale):
        return moe_pallas.dequantize_fp8(q, scale)
