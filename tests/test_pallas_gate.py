"""Pallas-Triton gate (``moe_pallas/ops/gate/pallas_triton.py``) against the jnp reference.

Interpret mode on the CPU on the cases of ``test_gate.py`` (ids exactly equal, weights within
CONTRACT.md section 7's rel. 1e-6), then the CUDA lowering of the kernel on an abstract H200.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

import moe_pallas
from moe_pallas.ops.gate.config import GateConfig, gate_config
from moe_pallas.ops.gate.pallas_triton import select_experts_pallas_triton
from test_gate import CASES
from tolerances import assert_exact, assert_gate_weights, to_numpy

DEFAULTS = dict(routing="softmax_topk", renormalize=True, num_expert_group=None, topk_group=None,
                routed_scaling_factor=1.0, apply_routed_scaling_factor_on_output=False, num_fused_shared_experts=0)


def _check(logits: np.ndarray, bias: np.ndarray | None = None, dtype=jnp.float32, config=None, **kw):
    """Kernel (interpreted; through the public op, or the kernel entry point when a ``config`` is
    given) vs the reference; returns the kernel's ``(w, ids)``."""
    x = jnp.asarray(logits, dtype)
    b = None if bias is None else jnp.asarray(bias)
    if config is None:
        got = moe_pallas.select_experts(x, e_score_correction_bias=b, implementation="pallas_triton", **kw)
    else:
        got = select_experts_pallas_triton(x, b, config=config, **{**DEFAULTS, **kw})
    want = moe_pallas.select_experts(x, e_score_correction_bias=b, implementation="reference", **kw)
    assert_exact(got[1], want[1], "topk_ids")
    assert_gate_weights(got[0], want[0])
    return got


#: bf16 logits on a few cases only (the interpreter is slow); float32 on all of them.
BF16_CASES = ("softmax-T1", "grouped", "biased-deepseek-v3-size")


@pytest.mark.parametrize("case,dtype", [(c, jnp.float32) for c in CASES] + [(c, jnp.bfloat16) for c in BF16_CASES])
def test_gate_cases(case, dtype):
    kw = dict(CASES[case])
    T, E = kw.pop("T"), kw.pop("E")
    rng = np.random.default_rng(hash(case) % 2**32)
    logits = rng.standard_normal((T, E)).astype(np.float32) * 2
    bias = (rng.standard_normal(E) * 0.3).astype(np.float32) if kw.get("routing") == "biased_grouped_topk" else None
    config = GateConfig(block_t=4) if dtype == jnp.float32 else None  # several programs, a ragged last one
    w, ids = _check(logits, bias, dtype, config=config, **kw)
    assert ids.shape == w.shape == (T, kw["topk"] + kw.get("num_fused_shared_experts", 0))


def test_bug_dropped_groups_masked_with_minus_inf():
    """Selection scores [-0.1, -0.2, -0.4, -0.45]: group 0 wins although every score is negative."""
    w, ids = _check(np.zeros((1, 4), np.float32), np.array([-0.6, -0.7, -0.9, -0.95], np.float32), topk=2,
                    routing="biased_grouped_topk", num_expert_group=2, topk_group=1)
    np.testing.assert_array_equal(to_numpy(ids), [[0, 1]])
    np.testing.assert_array_equal(to_numpy(w), np.array([[0.5, 0.5]], np.float32))


def test_bug_rsf_without_renormalize():
    w, ids = _check(np.array([[2.0, 1.0, 0.0, -1.0]], np.float32), topk=2, renormalize=False,
                    routed_scaling_factor=2.5, apply_routed_scaling_factor_on_output=True)
    np.testing.assert_array_equal(to_numpy(ids), [[0, 1]])
    np.testing.assert_allclose(to_numpy(w), [[1.6098, 0.5922]], atol=5e-5)


def test_ties_lower_index_wins():
    """Exact ties at 0.5 and at 0 (-inf logits): lower index first, also past the finite scores."""
    with np.errstate(divide="ignore"):
        logits = np.log(np.array([0.9, 0.5, 0.5, 0.1, 0.0, 0.0, 0.0, 0.0], np.float32))
    _, ids = _check(np.repeat(logits[None], 64, axis=0), topk=2)
    np.testing.assert_array_equal(to_numpy(ids), np.tile([0, 1], (64, 1)))
    _, ids = _check(logits[None], topk=6)
    np.testing.assert_array_equal(to_numpy(ids), [[0, 1, 2, 3, 4, 5]])
    _, ids = _check(logits[None], topk=8)  # topk = E: the whole zero tail, in index order
    np.testing.assert_array_equal(to_numpy(ids), [list(range(8))])


@pytest.mark.parametrize("routing", ["biased_grouped_topk", "grouped_topk"])
def test_group_ties_lower_group_wins(routing):
    bias = np.zeros(16, np.float32) if routing == "biased_grouped_topk" else None
    _, ids = _check(np.zeros((3, 16), np.float32), bias, topk=4, routing=routing, num_expert_group=4, topk_group=2)
    np.testing.assert_array_equal(to_numpy(ids), np.tile([0, 1, 2, 3], (3, 1)))
    # topk > experts of one group: the second kept group (group 1) supplies the rest, in index order
    _, ids = _check(np.zeros((2, 16), np.float32), bias, topk=6, routing=routing, num_expert_group=4, topk_group=2)
    np.testing.assert_array_equal(to_numpy(ids), np.tile([0, 1, 2, 3, 4, 5], (2, 1)))


def test_biased_all_kept_experts_minus_inf_still_picked():
    """topk reaches past the finite selection scores of the kept groups: the NaN (-inf) experts of
    kept groups come next in index order, never a dropped group's expert."""
    logits = np.zeros((1, 8), np.float32)
    logits[0, [1, 2]] = np.nan
    bias = np.array([0.0, 0.0, 0.0, 0.0, -1.0, -1.0, -1.0, -1.0], np.float32)
    _, ids = _check(logits, bias, topk=4, routing="biased_grouped_topk", num_expert_group=2, topk_group=1,
                    renormalize=False)
    np.testing.assert_array_equal(to_numpy(ids), [[0, 3, 1, 2]])


@pytest.mark.parametrize("routing", ["softmax_topk", "biased_grouped_topk", "grouped_topk"])
def test_nan_and_inf_logits(routing):
    rng = np.random.default_rng(3)
    T, E = 7, 8
    logits = rng.standard_normal((T, E)).astype(np.float32)
    logits[0, 3] = np.nan  # one NaN expert
    logits[1, :] = np.nan  # a whole row
    logits[2, :] = -np.inf  # softmax of an all -inf row is NaN
    logits[3, 5] = np.inf
    logits[4, 2] = -np.inf
    kw = dict(topk=3, routing=routing)
    bias = None
    if routing != "softmax_topk":
        kw.update(num_expert_group=2, topk_group=2 if routing == "biased_grouped_topk" else 1)
    if routing == "biased_grouped_topk":
        bias = np.zeros(E, np.float32)
    w, ids = _check(logits, bias, **kw)
    ids = to_numpy(ids)
    assert ((ids >= 0) & (ids < E)).all() and all(len(set(r)) == 3 for r in ids.tolist())
    np.testing.assert_array_equal(ids[1], [0, 1, 2])


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
    w, ids = moe_pallas.select_experts(jnp.zeros((0, 8), jnp.float32), topk=2, num_fused_shared_experts=1,
                                       implementation="pallas_triton")
    assert w.shape == ids.shape == (0, 3)
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
