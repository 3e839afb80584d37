"""Combine (CONTRACT.md section 5): the torch op against the jnp op on the shared cases of ``op_cases/combine.py``
(float32 accumulation, rsf once, non-local slots and rows >= M never read, T = 0, strided inputs).

Both frameworks' public ops run with ``implementation=None``: the references on the CPU (the device's default
backends under ``EPMOE_TEST_DEVICE=gpu``). The torch op is the one under test, the jnp op its judge; both are
checked against a float64 numpy combine.
"""

from __future__ import annotations

import moe_pallas
import moe_torch
from common import JNP_DTYPES, TORCH_DTYPES, to_jax
from op_cases import TorchArrays
from op_cases.combine import CombineCases


class TestCombineReference(TorchArrays, CombineCases):
    """``moe_torch.combine`` against ``moe_pallas.combine``."""

    SHAPES = ("T1", "rsf", "ep-rank")

    def combine(self, y, src2dst, w, rsf, out_dtype=None, config=None):
        out_dtype = None if out_dtype is None else TORCH_DTYPES[out_dtype]
        return moe_torch.combine(y, src2dst, w, routed_scaling_factor=rsf, out_dtype=out_dtype)

    def reference_combine(self, y_np, dtype, src2dst_np, w_np, rsf, out_dtype=None):
        out_dtype = None if out_dtype is None else JNP_DTYPES[out_dtype]
        return moe_pallas.combine(to_jax(y_np, dtype), to_jax(src2dst_np), to_jax(w_np), routed_scaling_factor=rsf,
                                  out_dtype=out_dtype)
