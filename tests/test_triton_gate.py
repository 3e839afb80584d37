"""The Triton gate kernel against the torch reference (CONTRACT.md sections 1, 7).

Kernel: ``moe_torch/ops/gate/triton.py``, on the shared cases of ``op_cases/gate.py`` (``TestGateTriton``),
called through the public API with
``implementation="triton"`` (so the dispatch path is exercised too), and directly with forced
configs (several programs, padded token / expert / slot axes). Ids must equal the reference's
exactly; weights within ``GATE_WEIGHT_RTOL`` (1e-6).

On the CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by
``conftest.py``) with the exact casts ``moe_torch`` installs there (``moe_torch/ops/triton_interpret.py``); on the GPU machine
(``EPMOE_TEST_DEVICE=gpu``) the same tests run compiled. ``test_gate_compiles_for_sm90`` lowers the
kernel to sm_90 cubin in a child process without the interpreter (no GPU needed).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import triton

import moe_torch
from common import TORCH_DEVICE, to_torch
from moe_torch.ops.gate import api as gate_api
from moe_torch.ops.gate.config import GateConfig, gate_config
from moe_torch.ops.gate.reference import select_experts_reference
from op_cases import TorchArrays
from op_cases.gate import GATE_DEFAULTS, GateKernelCases
from sm90 import compile_sm90
from tolerances import assert_exact


def _full(bias, kw: dict) -> dict:
    """The kernel's and the reference's keywords: every routing keyword, the bias, a float rsf."""
    full = {**GATE_DEFAULTS, **kw, "e_score_correction_bias": bias}
    full["routed_scaling_factor"] = float(full["routed_scaling_factor"])
    return full


class TestGateTriton(TorchArrays, GateKernelCases):
    """``select_experts_triton`` against the torch reference; ``config=None`` goes through
    ``moe_torch.select_experts(implementation="triton")``."""

    def select_experts(self, logits, bias, config=None, **kw):
        if config is None:
            return moe_torch.select_experts(logits, e_score_correction_bias=bias, implementation="triton", **kw)
        from moe_torch.ops.gate.triton import select_experts_triton

        return select_experts_triton(logits, config=config, **_full(bias, kw))

    def reference_select_experts(self, logits_np, dtype, bias_np, **kw):
        bias = None if bias_np is None else to_torch(bias_np)
        return select_experts_reference(to_torch(logits_np, dtype), **_full(bias, kw))

    def forced_gate_config(self, block_t, block_e, block_k):
        return GateConfig(block_t=block_t, block_e=block_e, block_k=block_k, num_warps=4)


def test_unsupported_sizes_and_dispatch(monkeypatch):
    """E > 512 raises NotImplementedError for ``"triton"``; ``None`` on CPU runs the reference
    without touching Triton."""
    with pytest.raises(NotImplementedError, match="E=1024"):
        moe_torch.select_experts(to_torch(np.zeros((2, 1024), np.float32)), topk=2, implementation="triton")
    x = to_torch(np.random.default_rng(5).standard_normal((7, 32)).astype(np.float32))
    calls = []

    def refuse(**kwargs):
        calls.append(kwargs)
        raise NotImplementedError("test: triton refused")

    monkeypatch.setattr(gate_api, "_triton_select_experts", refuse)
    with pytest.raises(NotImplementedError, match="test: triton refused"):
        moe_torch.select_experts(x, topk=2, implementation="triton")
    calls.clear()
    w, ids = moe_torch.select_experts(x, topk=2)
    want_w, want_i = select_experts_reference(x, **_full(None, dict(topk=2)))
    assert_exact(ids, want_i, "implementation=None")
    assert len(calls) == (1 if TORCH_DEVICE == "cuda" else 0)


@pytest.mark.parametrize("T,E,topk", [(1, 8, 2), (4096, 256, 8), (3, 512, 8), (100, 7, 7)])
def test_gate_configs(T, E, topk):
    """Frozen, keyword-only; power-of-2 blocks covering E and topk; 256-value tiles a warp (one token per
    one-warp program at E=256, the H200 sweep's winner)."""
    c = gate_config(T, E, topk)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_t = 1
    with pytest.raises(TypeError):
        GateConfig(1, 8, 2, 4)  # kw_only
    for v in (c.block_t, c.block_e, c.block_k):
        assert v & (v - 1) == 0
    assert c.block_e >= E and c.block_k >= topk and c.block_t * c.block_e <= max(256, c.block_e)
    assert c.num_warps == max(1, c.block_t * c.block_e // 256)
    if (T, E) == (4096, 256):
        assert (c.block_t, c.num_warps) == (1, 1)
    assert c.block_t <= triton.next_power_of_2(T)


# --------------------------------------------------------------------------------------
# sm_90 compilation on the CPU, in a child process without TRITON_INTERPRET (needs no GPU and
# no driver, only triton's bundled ptxas).



def _gate_job(logit_type: str, routing: int, E: int, G: int, topk_group: int, topk: int, S: int) -> dict:
    cfg = gate_config(4096, E, topk)
    return {
        "signature": {"logits_ptr": logit_type, "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32",
                      "T": "i32", "stride_t": "i32", "rsf": "fp32", "shared_w": "fp32"},
        "constexprs": {"E": E, "ROUTING": routing, "G": G, "TOPK_GROUP": topk_group, "TOPK": topk, "S": S,
                       "RENORMALIZE": True, "APPLY_RSF": True, "BLOCK_T": cfg.block_t, "BLOCK_E": cfg.block_e,
                       "BLOCK_G": triton.next_power_of_2(G), "BLOCK_K": cfg.block_k},
        "options": {"num_warps": cfg.num_warps, "num_stages": 1},
    }


#: name -> job: DeepSeek-V3's biased gate (bf16 logits, E=256, 8 groups keep 4, top-8, one shared
#: expert), Qwen3-MoE's softmax top-8 over 128, DeepSeek-V2's grouped top-6 over 160 in 8 groups.
SM90_JOBS = {
    "biased-deepseek-v3": _gate_job("*bf16", 2, 256, 8, 4, 8, 1),
    "softmax-qwen3": _gate_job("*bf16", 0, 128, 1, 1, 8, 0),
    "grouped-deepseek-v2": _gate_job("*fp32", 1, 160, 8, 3, 6, 0),
}


@pytest.fixture(scope="module")
def sm90_ptx() -> dict[str, str]:
    return compile_sm90(SM90_JOBS, module="moe_torch.ops.gate.triton", kernel="_gate_kernel")


@pytest.mark.parametrize("name", list(SM90_JOBS))
def test_gate_compiles_for_sm90(sm90_ptx, name):
    """The fused gate lowers to sm_90 cubin: one kernel, no atomics, IEEE division in the softmax modes."""
    ptx = sm90_ptx[name]
    assert ".target sm_90" in ptx
    assert not re.search(r"\b(atom|red)\.", ptx), "an atomic in the PTX"
    assert "div.rn.f32" in ptx
