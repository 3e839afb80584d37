"""Pallas-Triton gate (``moe_pallas/ops/gate/pallas_triton.py``) against the jnp reference.

Interpret mode on the CPU on the shared cases of ``op_cases/gate.py`` (ids exactly equal, weights within
CONTRACT.md section 7's rel. 1e-6), then the config heuristic, the dispatch under ``jax.jit``, and the CUDA
lowering of the kernel on an abstract H200.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

import moe_pallas
from common import to_jax
from moe_pallas.ops.gate.config import GateConfig, gate_config
from moe_pallas.ops.gate.pallas_triton import select_experts_pallas_triton
from op_cases import JaxArrays
from op_cases.gate import CASES, GATE_DEFAULTS, GateKernelCases
from tolerances import assert_exact


#: bf16 logits on a few cases only (each case compiles anew); float32 on all of them.
BF16_CASES = ("softmax-T1", "grouped", "biased-deepseek-v3-size")


class TestGatePallasTriton(JaxArrays, GateKernelCases):
    """``select_experts_pallas_triton`` against the jnp reference. The float32 cases run with ``block_t = 4``
    (several programs, a ragged last one); ``config=None`` goes through
    ``moe_pallas.select_experts(implementation="pallas_triton")``."""

    CASE_DTYPES = {**{f"{c}-float32": (c, "float32") for c in CASES},
                   **{f"{c}-bfloat16": (c, "bfloat16") for c in BF16_CASES}}

    def case_config(self, dtype):
        return GateConfig(block_t=4) if dtype == "float32" else None

    def select_experts(self, logits, bias, config=None, **kw):
        if config is None:
            return moe_pallas.select_experts(logits, e_score_correction_bias=bias, implementation="pallas_triton", **kw)
        return select_experts_pallas_triton(logits, bias, config=config, **{**GATE_DEFAULTS, **kw})

    def reference_select_experts(self, logits_np, dtype, bias_np, **kw):
        bias = None if bias_np is None else to_jax(bias_np)
        return moe_pallas.select_experts(to_jax(logits_np, dtype), e_score_correction_bias=bias,
                                         implementation="reference", **kw)

    def forced_gate_config(self, block_t, block_e, block_k):
        """``block_t`` (the kernel pads the experts and the output columns itself)."""
        return GateConfig(block_t=block_t)


def test_config_heuristic_and_dispatch():
    # One token per one-warp program at E=256 (the H200 sweep's winner); small E packs 256-value tiles.
    assert gate_config(4096, 256) == gate_config(64, 256) == GateConfig(block_t=1, num_warps=1)
    assert gate_config(4096, 512) == GateConfig(block_t=1, num_warps=2)
    assert gate_config(4096, 8) == GateConfig(block_t=32, num_warps=1) and gate_config(3, 8).block_t == 4
    assert gate_config(1, 4096) == GateConfig(block_t=1, num_warps=8)
    with pytest.raises(ValueError, match="power of two"):
        GateConfig(block_t=3)
    with pytest.raises(NotImplementedError, match="Triton"):
        select_experts_pallas_triton(jnp.zeros((2, 8), jnp.float32), topk=2, config=GateConfig(block_t=1 << 18))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((5, 16)), jnp.float32)
    jitted = jax.jit(lambda a: moe_pallas.select_experts(a, topk=3, implementation="pallas_triton"))
    assert_exact(jitted(x)[1], moe_pallas.select_experts(x, topk=3)[1], "jit")  # the CPU default: reference


# --------------------------------------------------------------------------------------
# GPU lowering on the CPU: the kernel must lower for CUDA (Triton), not only interpret.

H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "cuda"))
TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("E,kw", [
    (256, dict(topk=8, routing="biased_grouped_topk", num_expert_group=8, topk_group=4, routed_scaling_factor=2.5,
               apply_routed_scaling_factor_on_output=True, num_fused_shared_experts=1)),
    (7, dict(topk=2)),
    (16, dict(topk=4, routing="grouped_topk", num_expert_group=4, topk_group=2, renormalize=False)),
])
def test_gate_lowers_for_cuda(E, kw):
    f = functools.partial(select_experts_pallas_triton, interpret=False, **kw)
    args = [jax.ShapeDtypeStruct((37, E), jnp.bfloat16)]
    if kw.get("routing") == "biased_grouped_topk":
        args.append(jax.ShapeDtypeStruct((E,), jnp.float32))
    with use_abstract_mesh(H200):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(TRITON_CALL) == 1, text[:2000]
