"""4-bit expert weights in torch (CONTRACT.md section 9): ``moe_torch.quantize_weight_mxfp4`` / ``quantize_weight_int4``
(MXFP4: e2m1 codes, e8m0 scales; INT4 group 32: offset-binary codes, bf16 scales) and their dequantizations, on the
shared cases of ``op_cases/quant_4bit.py``: named cases with their expected codes and values, random weights and
scales against independent numpy implementations, round-trip bounds, 2-D weights, chunks, output dtypes, the
errors."""

from __future__ import annotations

import numpy as np

import moe_torch
from op_cases import TorchArrays
from op_cases.quant_4bit import Quant4bitCases


class TestQuant4bitTorch(TorchArrays, Quant4bitCases):
    """The shared cases on ``moe_torch``'s quantizers (tensors on ``common.TORCH_DEVICE``)."""

    OPS = moe_torch

    def not_an_array(self):
        return np.ones((3, 32), np.float32), "w must be a torch.Tensor"
