"""The Triton gate kernel against the torch reference (CONTRACT.md sections 1, 7).

Kernel: ``moe_torch/ops/gate/triton.py``, called through the public API with
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
import torch
import triton

import moe_torch
from common import TORCH_DEVICE, to_torch
from moe_torch.ops.gate import api as gate_api
from moe_torch.ops.gate.config import GateConfig, gate_config
from moe_torch.ops.gate.reference import select_experts_reference
from test_gate import CASES
from tolerances import assert_exact, assert_gate_weights
from sm90 import compile_sm90



_DEFAULTS = dict(routing="softmax_topk", renormalize=True, num_expert_group=None, topk_group=None,
                 e_score_correction_bias=None, routed_scaling_factor=1.0,
                 apply_routed_scaling_factor_on_output=False, num_fused_shared_experts=0)


def _check(logits: torch.Tensor, what: str, bias: torch.Tensor | None = None, config=None, **kw):
    """Triton (through the API, or directly with ``config``) vs the reference: exact ids, 1e-6 weights."""
    full = {**_DEFAULTS, **kw, "e_score_correction_bias": bias}
    full["routed_scaling_factor"] = float(full["routed_scaling_factor"])
    want_w, want_i = select_experts_reference(logits, **full)
    if config is None:
        got_w, got_i = moe_torch.select_experts(logits, e_score_correction_bias=bias, implementation="triton", **kw)
    else:
        from moe_torch.ops.gate.triton import select_experts_triton

        got_w, got_i = select_experts_triton(logits, config=config, **full)
    assert got_i.dtype == torch.int32 and got_w.dtype == torch.float32, what
    assert_exact(got_i, want_i, f"{what}: topk_ids")
    assert_gate_weights(got_w, want_w, f"{what}: topk_weights")
    return got_w, got_i


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_gate_cases(case, dtype):
    """Every case of tests/test_gate.py (T=1, prime E, topk=1, topk=E, both grouped modes,
    DeepSeek-V3 size with a shared expert, both rsf placements), float32 and bf16 logits."""
    kw = dict(CASES[case])
    T, E = kw.pop("T"), kw.pop("E")
    rng = np.random.default_rng(hash(case) % 2**32)
    logits = to_torch(rng.standard_normal((T, E)).astype(np.float32) * 2, dtype)
    bias = None
    if kw.get("routing") == "biased_grouped_topk":
        bias = to_torch((rng.standard_normal(E) * 0.3).astype(np.float32))
    _check(logits, f"{case}/{dtype}", bias, **kw)


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # the interpreter's np.max
@pytest.mark.parametrize("routing", ["softmax_topk", "grouped_topk", "biased_grouped_topk"])
def test_nan_logits(routing):
    """NaN logits: a NaN expert, a whole NaN row (ties -> lowest ids), ids exactly the reference's."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    x[0, 3] = np.nan
    x[1, :] = np.nan
    x[2, 5] = -np.inf
    kw = dict(topk=3, routing=routing)
    bias = None
    if routing != "softmax_topk":
        kw.update(num_expert_group=2, topk_group=2)
    if routing == "biased_grouped_topk":
        bias = to_torch(np.zeros(8, np.float32))
    _, ids = _check(to_torch(x), f"nan/{routing}", bias, **kw)
    np.testing.assert_array_equal(ids.cpu().numpy()[1], [0, 1, 2])


def test_ties_lower_index_wins():
    """Bug case 4: scores [0.9, 0.5, 0.5, 0.1, 0, 0, 0, 0] -> top-2 ids [0, 1]; top-6 [0..5]; and
    all-equal biased scores keep the lowest groups and experts."""
    scores = np.array([0.9, 0.5, 0.5, 0.1, 0.0, 0.0, 0.0, 0.0], np.float32)
    with np.errstate(divide="ignore"):
        logits = np.log(scores)
    batch = to_torch(np.repeat(logits[None], 64, axis=0))
    _, ids = _check(batch, "ties top-2", topk=2)
    np.testing.assert_array_equal(ids.cpu().numpy(), np.tile([0, 1], (64, 1)))
    _, ids = _check(batch[:1], "ties top-6", topk=6)
    np.testing.assert_array_equal(ids.cpu().numpy(), [[0, 1, 2, 3, 4, 5]])
    for routing, bias in (("biased_grouped_topk", to_torch(np.zeros(16, np.float32))), ("grouped_topk", None)):
        _, ids = _check(to_torch(np.zeros((3, 16), np.float32)), f"group ties {routing}", bias, topk=4,
                        routing=routing, num_expert_group=4, topk_group=2)
        np.testing.assert_array_equal(ids.cpu().numpy(), np.tile([0, 1, 2, 3], (3, 1)))


def test_dropped_groups_masked_with_minus_inf():
    """Bug case 3: negative biased scores; the dropped group is -inf, not 0 -> ids [0, 1], weights [0.5, 0.5]."""
    bias = to_torch(np.array([-0.6, -0.7, -0.9, -0.95], np.float32))
    w, ids = _check(to_torch(np.zeros((1, 4), np.float32)), "mask -inf", bias, topk=2,
                    routing="biased_grouped_topk", num_expert_group=2, topk_group=1)
    np.testing.assert_array_equal(ids.cpu().numpy(), [[0, 1]])
    np.testing.assert_array_equal(w.cpu().numpy(), np.array([[0.5, 0.5]], np.float32))


def test_rsf_without_renormalize():
    """Bug case 2: rsf applied on the output also without renormalisation."""
    x = to_torch(np.array([[2.0, 1.0, 0.0, -1.0]], np.float32))
    w, _ = _check(x, "rsf", topk=2, renormalize=False, routed_scaling_factor=2.5,
                  apply_routed_scaling_factor_on_output=True)
    np.testing.assert_allclose(w.cpu().numpy(), [[1.6098, 0.5922]], atol=5e-5)


@pytest.mark.parametrize("routing,E,G,kg,topk,S,cfg", [
    ("softmax_topk", 512, None, None, 8, 0, GateConfig(block_t=2, block_e=512, block_k=8, num_warps=4)),
    ("biased_grouped_topk", 384, 16, 3, 7, 2, GateConfig(block_t=4, block_e=512, block_k=16, num_warps=4)),
    ("grouped_topk", 60, 5, 2, 6, 1, GateConfig(block_t=8, block_e=64, block_k=8, num_warps=4)),
    ("grouped_topk", 8, 8, 5, 5, 0, GateConfig(block_t=4, block_e=8, block_k=8, num_warps=4)),  # 1 per group
])
def test_forced_configs_and_limits(routing, E, G, kg, topk, S, cfg):
    """E up to 512, 16 groups, one expert per group, padded axes, several programs (last partial),
    forced and heuristic configs; with heavy ties (logits rounded to a coarse grid)."""
    rng = np.random.default_rng(E + topk)
    x = np.round(rng.standard_normal((11, E)) * 2, 1).astype(np.float32)  # many exact ties
    kw = dict(topk=topk, routing=routing, num_fused_shared_experts=S, routed_scaling_factor=2.5,
              apply_routed_scaling_factor_on_output=S > 1)
    if routing != "softmax_topk":
        kw.update(num_expert_group=G, topk_group=kg)
    bias = to_torch(np.round(rng.standard_normal(E) * 0.3, 1).astype(np.float32)) if routing.startswith("biased") else None
    _check(to_torch(x), f"{routing} forced", bias, config=cfg, **kw)
    _check(to_torch(x), f"{routing} heuristic", bias, **kw)


def test_unsupported_sizes_and_dispatch(monkeypatch):
    """E > 512 raises NotImplementedError for ``"triton"``; ``None`` on CPU runs the reference
    without touching Triton; strided logits and T = 0 work."""
    with pytest.raises(NotImplementedError, match="E=1024"):
        moe_torch.select_experts(to_torch(np.zeros((2, 1024), np.float32)), topk=2, implementation="triton")
    x = to_torch(np.random.default_rng(5).standard_normal((7, 32)).astype(np.float32))
    _check(x[:, ::2], "strided", topk=3)
    w, ids = moe_torch.select_experts(x[:0], topk=3, implementation="triton")
    assert tuple(w.shape) == tuple(ids.shape) == (0, 3)
    calls = []

    def refuse(**kwargs):
        calls.append(kwargs)
        raise NotImplementedError("test: triton refused")

    monkeypatch.setattr(gate_api, "_triton_select_experts", refuse)
    with pytest.raises(NotImplementedError, match="test: triton refused"):
        moe_torch.select_experts(x, topk=2, implementation="triton")
    calls.clear()
    w, ids = moe_torch.select_experts(x, topk=2)
    want_w, want_i = select_experts_reference(x, topk=2, **{**_DEFAULTS, "e_score_correction_bias": None})
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
