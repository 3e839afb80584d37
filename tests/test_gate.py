"""Gate (CONTRACT.md section 1): the torch op against the jnp op on the shared cases of ``op_cases/gate.py``
(the edge cases of ``CASES``, the bug cases, ties, NaN and infinite logits, T = 0).

Both frameworks' public ops run with ``implementation=None``: the references on the CPU (the device's default
backends under ``EPMOE_TEST_DEVICE=gpu``). The torch op is the one under test, the jnp op its judge: ids equal,
weights within rel. 1e-6, and every check against known values made on both.
"""

from __future__ import annotations

import moe_pallas
import moe_torch
from common import to_jax
from op_cases import TorchArrays
from op_cases.gate import GateCases


class TestGateReference(TorchArrays, GateCases):
    """``moe_torch.select_experts`` against ``moe_pallas.select_experts``."""

    def select_experts(self, logits, bias, config=None, **kw):
        return moe_torch.select_experts(logits, e_score_correction_bias=bias, **kw)

    def reference_select_experts(self, logits_np, dtype, bias_np, **kw):
        bias = None if bias_np is None else to_jax(bias_np)
        return moe_pallas.select_experts(to_jax(logits_np, dtype), e_score_correction_bias=bias, **kw)
