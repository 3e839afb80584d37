"""The MoE families of 2026: Llama 4's ``routing="sigmoid_topk"`` (CONTRACT.md sections 1 and 8),
gpt-oss's router as softmax top-k renormalized, and the presets of gpt-oss, Llama 4, Qwen3-Next, GLM-4.5-Air
and Kimi K2.

What is proved:

- ``sigmoid_topk`` in both frameworks, in the references and the interpreted kernels (Triton,
  Pallas-Triton), equals a float64 numpy formula of section 1 (the top-k logits, weight ``sigmoid``) and
  transformers' own ``Llama4Router`` (a tiny ``Llama4TextConfig``): ids exactly, weights within the gate
  tolerance; on T=1, topk=1 and topk=E, both ``renormalize`` values and both rsf placements (the same
  layer output), ties (lower index; logits whose sigmoid rounds to 1 still ranked by the logit), NaN and
  infinite logits;
- its backward: the reference backward passes finite differences in float64 (``torch.autograd.gradcheck``,
  ``jax.test_util.check_grads``), and every backward (references, kernels, the differentiable forward) is
  within section 8's float32 tolerance of float64 autodiff, ``d_logit = d_w * s * (1 - s)`` on the chosen
  experts and 0 elsewhere without renormalization;
- gpt-oss's ``GptOssTopKRouter`` (softmax over the top-k logits) equals ``softmax_topk`` with
  ``renormalize=True`` within the gate tolerance, every implementation;
- every preset builds a ``MoEConfig``; the values that transformers' config classes hold as defaults are
  those defaults; a tiny override of each runs ``moe_forward`` in both frameworks (references) and equals
  a float64 numpy layer;
- bad input (groups or a bias with ``sigmoid_topk``) raises ``ValueError`` naming the argument; the places
  that cannot serve the new families (checkpoint presets, transformers' blocks) refuse them by name (the
  benchmark's peer block: ``tests/test_benchmarks.py``).

Tiny shapes throughout (the interpreters are slow); well under a minute on two cores.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.test_util import check_grads

import moe_pallas
import moe_torch
from common import TORCH_DEVICE, to_jax, to_torch
from moe_contract import PRESETS, MoEConfig, get_preset, make_layer_inputs
from moe_pallas.ops.gate import reference as jgate
from moe_torch.ops.gate import reference as tgate
from tolerances import F32_REL_FRO, GRAD_F32_REL_FRO, assert_exact, assert_gate_weights, assert_rel_fro, to_numpy

transformers = pytest.importorskip("transformers")

#: (framework, implementation): both references and both interpreted kernels.
IMPLS = [("torch", "reference"), ("torch", "triton"), ("jax", "reference"), ("jax", "pallas_triton")]
IDS = [f"{fw}-{impl}" for fw, impl in IMPLS]
MODULES = {"torch": moe_torch, "jax": moe_pallas}
_GATE_DEFAULTS = dict(routing="sigmoid_topk", renormalize=False, num_expert_group=None, topk_group=None,
                      e_score_correction_bias=None, routed_scaling_factor=1.0,
                      apply_routed_scaling_factor_on_output=False, num_fused_shared_experts=0)


def _arr(fw: str, a: np.ndarray, dtype: str | None = None):
    return to_torch(a, dtype) if fw == "torch" else to_jax(a, dtype)


def _gate(fw: str, impl: str, logits: np.ndarray, dtype: str = "float32", **kw):
    """``(weights, ids)`` as numpy from ``select_experts`` of framework ``fw`` with ``implementation=impl``."""
    w, i = MODULES[fw].select_experts(_arr(fw, logits, dtype), implementation=impl, **kw)
    return to_numpy(w), to_numpy(i)


def sigmoid_topk_f64(logits: np.ndarray, topk: int, renormalize: bool = False, routed_scaling_factor: float = 1.0,
                     apply_routed_scaling_factor_on_output: bool = False, num_fused_shared_experts: int = 0):
    """CONTRACT.md section 1's ``sigmoid_topk`` in float64 numpy: ``(weights [T, topk+S], ids [T, topk+S])``.
    Ranked by the logit (NaN level with -inf, ties to the lower index: a stable sort); weight
    ``sigmoid(logit)``; ``/ (sum + 1e-20)`` if renormalized; shared slots ``1/rsf``; ``* rsf`` on output."""
    x = logits.astype(np.float64)
    key = np.where(np.isnan(x), -np.inf, x) + 0.0
    ids = np.argsort(-key, axis=1, kind="stable")[:, :topk]
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-x))
    w = np.take_along_axis(s, ids, axis=1)
    if renormalize:
        w = w / (w.sum(axis=1, keepdims=True) + 1e-20)
    T, E = x.shape
    S = num_fused_shared_experts
    if S:
        ids = np.concatenate([ids, np.broadcast_to(np.arange(E, E + S), (T, S))], axis=1)
        w = np.concatenate([w, np.full((T, S), 1.0 / routed_scaling_factor)], axis=1)
    if apply_routed_scaling_factor_on_output:
        w = w * routed_scaling_factor
    return w, ids.astype(np.int32)


# --------------------------------------------------------------------------------------
# 1. the forward: float64 formula, transformers' Llama4Router, edges


#: name -> (T, E, kwargs); each comment says which edge it exercises.
CASES = {
    "T1-topk1-llama4": (1, 16, dict(topk=1)),  # T=1, topk=1: Llama 4's decode step
    "renorm-rsf-on-output-shared": (13, 12, dict(topk=3, renormalize=True, routed_scaling_factor=2.5,
                                                 apply_routed_scaling_factor_on_output=True,
                                                 num_fused_shared_experts=1)),  # renormalized, rsf in the gate
    "no-renorm-rsf-in-combine-2-shared": (9, 7, dict(topk=2, routed_scaling_factor=2.5,
                                                     num_fused_shared_experts=2)),  # prime E, rsf left to combine
    "topk-equals-E": (5, 6, dict(topk=6, renormalize=True)),  # topk == E: every expert, in logit order
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fw,impl", IMPLS, ids=IDS)
def test_sigmoid_topk_matches_float64_formula(fw, impl, case):
    T, E, kw = CASES[case]
    kw = {"renormalize": False, **kw}  # select_experts' default is True; Llama 4 does not renormalize
    rng = np.random.default_rng(len(case))
    logits = (rng.standard_normal((T, E)) * 3).astype(np.float32)
    want_w, want_i = sigmoid_topk_f64(logits, **kw)
    w, ids = _gate(fw, impl, logits, routing="sigmoid_topk", **kw)
    assert ids.dtype == np.int32 and w.dtype == np.float32 and ids.shape == w.shape == want_i.shape
    assert_exact(ids, want_i, f"{case}: topk_ids")
    assert_gate_weights(w, want_w.astype(np.float32), f"{case}: topk_weights")


def test_sigmoid_topk_bf16_logits():
    """bf16 logits are upcast exactly: the same ids and weights as their float32 values, every implementation."""
    logits = (np.random.default_rng(5).standard_normal((6, 8)) * 2).astype(np.float32)
    exact = to_numpy(to_torch(logits, "bfloat16").float())
    want_w, want_i = sigmoid_topk_f64(exact, 2, renormalize=True)
    for fw, impl in IMPLS:
        w, ids = _gate(fw, impl, logits, "bfloat16", topk=2, routing="sigmoid_topk", renormalize=True)
        assert_exact(ids, want_i, f"{fw}-{impl}: ids")
        assert_gate_weights(w, want_w.astype(np.float32), f"{fw}-{impl}: weights")


def _llama4_router(E: int, topk: int, H: int = 32, seed: int = 0):
    from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    cfg = Llama4TextConfig(hidden_size=H, intermediate_size=16, num_local_experts=E, num_experts_per_tok=topk,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    router = Llama4Router(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(seed)) * 2 / H**0.5)
    return router


@pytest.mark.parametrize("T,E,topk", [(1, 16, 1), (7, 8, 2)])  # Llama 4's top-1 at T=1; top-2 on several tokens
@pytest.mark.parametrize("fw,impl", IMPLS, ids=IDS)
def test_sigmoid_topk_matches_transformers_llama4_router(fw, impl, T, E, topk):
    """``Llama4Router`` returns ``router_scores [T, E]``: sigmoid of the top-k logits, 0 elsewhere; ours,
    scattered to ``[T, E]``, equals it (weights within the gate tolerance, the same experts)."""
    router = _llama4_router(E, topk, seed=T)
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(10 + T))
    with torch.no_grad():
        scores, logits = router(x)
    w, ids = _gate(fw, impl, logits.numpy(), topk=topk, routing="sigmoid_topk", renormalize=False)
    dense = np.zeros((T, E), np.float32)
    np.put_along_axis(dense, ids.astype(np.int64), w, axis=1)
    np.testing.assert_array_equal(dense > 0, scores.numpy() > 0)  # the same chosen experts
    assert_gate_weights(dense, scores.numpy(), "dense weights vs Llama4Router's router_scores")
    want_order = torch.topk(logits, topk, dim=1).indices.numpy()  # descending logit (no ties in random logits)
    assert_exact(ids, want_order.astype(np.int32), "slot order: descending logit")


@pytest.mark.parametrize("fw,impl", IMPLS, ids=IDS)
def test_softmax_topk_renormalized_equals_gpt_oss_router(fw, impl):
    """CONTRACT.md section 1: gpt-oss's ``GptOssTopKRouter`` (topk of the logits, then softmax over those k)
    is ``softmax_topk`` with ``renormalize=True``: the same ids in the same order, weights within the gate
    tolerance (float32 logits; the router's bias is inside its logits)."""
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    E, topk, H, T = 8, 4, 32, 9
    router = GptOssTopKRouter(GptOssConfig(hidden_size=H, intermediate_size=16, num_local_experts=E,
                                           num_experts_per_tok=topk, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g) * 2 / H**0.5)
        router.bias.copy_(torch.randn(E, generator=g) * 0.5)
        logits, scores, indices = router(torch.randn(T, H, generator=g))
    w, ids = _gate(fw, impl, logits.numpy(), topk=topk, routing="softmax_topk", renormalize=True)
    assert_exact(ids, indices.numpy().astype(np.int32), "topk_ids vs GptOssTopKRouter's router_indices")
    assert_gate_weights(w, scores.numpy(), "topk_weights vs GptOssTopKRouter's router_scores")


@pytest.mark.parametrize("fw,impl", IMPLS, ids=IDS)
def test_sigmoid_topk_ranks_by_logit_ties_to_lower_index(fw, impl):
    """Ties: equal logits -> the lower index first. Logits 30 and 31 both have sigmoid 1.0 in float32: ranked
    by the logit (31 first, as Llama 4's topk of the logits), not by a tie of their sigmoids."""
    logits = np.array([[0.5, 0.5, 0.5, 0.5, 0.5, 0.5],  # all equal: ids 0, 1, 2
                       [-1.0, 2.0, 0.0, 2.0, 2.0, -3.0],  # three tied at the top: 1, 3, 4
                       [30.0, 20.0, 31.0, -5.0, 30.0, 0.0]],  # sigmoid saturates: 2 (31), then 0 and 4 (30)
                      np.float32)
    w, ids = _gate(fw, impl, logits, topk=3, routing="sigmoid_topk", renormalize=False)
    np.testing.assert_array_equal(ids, [[0, 1, 2], [1, 3, 4], [2, 0, 4]])
    np.testing.assert_array_equal(w[2], np.float32([1.0, 1.0, 1.0]))
    assert_gate_weights(w[:2], sigmoid_topk_f64(logits[:2], 3)[0].astype(np.float32))


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # the interpreter's np.max
@pytest.mark.parametrize("fw,impl", IMPLS, ids=IDS)
def test_sigmoid_topk_non_finite_logits(fw, impl):
    """NaN ranks below every finite logit (level with -inf, ties to the lower index); +inf ranks first with
    weight 1; -inf has weight 0; a NaN logit chosen anyway has weight NaN; ids always distinct in [0, E)."""
    nan, inf = np.nan, np.inf
    logits = np.array([[0.1, nan, -0.2, 0.3, nan],  # NaN never chosen while 3 finite are left
                       [nan, nan, nan, nan, nan],  # a whole NaN row: ids 0, 1, 2, weights NaN
                       [-1.0, inf, 0.0, -inf, 2.0],  # +inf first (weight 1)
                       [nan, -inf, -inf, 1.0, nan]],  # one finite, then NaN / -inf level: lowest indices
                      np.float32)
    w, ids = _gate(fw, impl, logits, topk=3, routing="sigmoid_topk", renormalize=False)
    np.testing.assert_array_equal(ids, [[3, 0, 2], [0, 1, 2], [1, 4, 2], [3, 0, 1]])
    assert np.isnan(w[1]).all() and w[2, 0] == 1.0
    assert np.isnan(w[3, 1]) and w[3, 2] == 0.0
    assert_gate_weights(w[0], sigmoid_topk_f64(logits[:1], 3)[0][0].astype(np.float32))


def _layer(fw: str, config: MoEConfig, inputs):
    """``moe_forward`` (the reference) of ``fw`` on ``inputs`` (float32 numpy), as float64 numpy."""
    bias = inputs.e_score_correction_bias if config.routing == "biased_grouped_topk" else None
    args = [_arr(fw, a) for a in (inputs.x, inputs.router_logits, inputs.w13, inputs.w2)]
    b = None if bias is None else _arr(fw, bias)

    def forward(x, logits, w13, w2, b):
        return MODULES[fw].moe_forward(x, logits, w13, w2, config, e_score_correction_bias=b, implementation="reference")

    out = forward(*args, b) if fw == "torch" else jax.jit(forward)(*args, b)  # jit: one compile, not one per eager op
    return to_numpy(out).astype(np.float64)


@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_sigmoid_topk_renormalize_and_rsf_placement(fw):
    """Both ``renormalize`` values (renormalized weights sum to 1, or rsf on output; not renormalized: the
    sigmoids themselves) and both rsf placements: on output the weights are rsf times the combine
    placement's, and the layer output is the same (rsf applied exactly once)."""
    base = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=8, topk=2, routing="sigmoid_topk",
                     routed_scaling_factor=2.5, num_fused_shared_experts=1)
    inputs = make_layer_inputs(base, 6, seed=4)
    lg = inputs.router_logits
    for renormalize in (False, True):
        cfg = base.replace(renormalize=renormalize)
        w_comb, ids_comb = _gate(fw, "reference", lg, **cfg.gate_kwargs())
        w_out, ids_out = _gate(fw, "reference", lg, **cfg.replace(apply_routed_scaling_factor_on_output=True).gate_kwargs())
        assert_exact(ids_out, ids_comb, "ids do not depend on the rsf placement")
        assert_gate_weights(w_out, np.float32(2.5) * w_comb, "on output: rsf * the combine placement's weights")
        routed = w_comb[:, :2].astype(np.float64)
        if renormalize:
            np.testing.assert_allclose(routed.sum(1), 1.0, rtol=1e-6)
        else:
            assert_gate_weights(routed, sigmoid_topk_f64(lg, 2)[0])
        np.testing.assert_array_equal(w_comb[:, 2], np.float32(1 / 2.5))  # the shared slot: 1/rsf before scaling
        out_comb = _layer(fw, cfg, inputs)
        out_gate = _layer(fw, cfg.replace(apply_routed_scaling_factor_on_output=True), inputs)
        assert_rel_fro(out_gate, out_comb, F32_REL_FRO, f"renormalize={renormalize}: both rsf placements")
        assert np.abs(out_comb).max() > 0.1


# --------------------------------------------------------------------------------------
# 2. the backward (CONTRACT.md section 8)


#: name -> (T, E, kwargs) of the backward cases.
BWD_CASES = {
    "plain-T1": (1, 6, dict(topk=2)),  # T=1, no renormalization: d_logit = d_w * s * (1 - s)
    "renorm-rsf-on-output-shared": (5, 8, dict(topk=3, renormalize=True, routed_scaling_factor=2.5,
                                               apply_routed_scaling_factor_on_output=True, num_fused_shared_experts=1)),
    "no-renorm-rsf-on-output": (4, 7, dict(topk=2, routed_scaling_factor=2.5,
                                           apply_routed_scaling_factor_on_output=True)),
}


def _bwd_case(name: str):
    T, E, kw = BWD_CASES[name]
    rng = np.random.default_rng(len(name))
    logits = (rng.standard_normal((T, E)) * 1.5).astype(np.float32)
    d_w = rng.standard_normal((T, kw["topk"] + kw.get("num_fused_shared_experts", 0))).astype(np.float32)
    return {**_GATE_DEFAULTS, **kw}, logits, d_w


def _autodiff64(fw: str, kw: dict, logits: np.ndarray, d_w: np.ndarray) -> np.ndarray:
    """``d_logits`` by the framework's autodiff of the float64 reference forward's weights."""
    if fw == "torch":
        x = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
        (g,) = torch.autograd.grad(tgate.select_experts_reference(x, **kw)[0], x, torch.tensor(d_w, dtype=torch.float64))
        return g.numpy()
    with jax.enable_x64(True):
        f = jax.jit(lambda v, ct: jax.vjp(lambda u: jgate.select_experts_reference(u, **kw)[0], v)[1](ct)[0])
        return np.asarray(f(jnp.asarray(logits, jnp.float64), jnp.asarray(d_w, jnp.float64)))


class _RefPair(torch.autograd.Function):
    """forward: the float64 reference gate's weights; backward: the reference backward (for gradcheck)."""

    @staticmethod
    def forward(ctx, x, kw):
        w, ids = tgate.select_experts_reference(x, **kw)
        ctx.save_for_backward(x, ids)
        ctx.kw = kw
        return w

    @staticmethod
    def backward(ctx, ct):
        x, ids = ctx.saved_tensors
        return tgate.select_experts_backward_reference(x, ids, ct, **ctx.kw), None


@pytest.mark.parametrize("case", list(BWD_CASES))
@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_sigmoid_topk_reference_backward_passes_finite_differences(fw, case):
    """forward = the reference gate's weights, backward = the reference backward, float64:
    ``torch.autograd.gradcheck`` / ``jax.test_util.check_grads`` (reverse mode) agree with finite differences."""
    kw, logits, _ = _bwd_case(case)
    if fw == "torch":
        x = torch.tensor(logits, dtype=torch.float64, device=TORCH_DEVICE, requires_grad=True)
        assert torch.autograd.gradcheck(lambda v: _RefPair.apply(v, kw), (x,), eps=1e-6, atol=1e-7)
        return
    pair = jax.custom_vjp(lambda v: jgate.select_experts_reference(v, **kw)[0])
    pair.defvjp(lambda v: (jgate.select_experts_reference(v, **kw)[0], v),
                lambda v, ct: (jgate.select_experts_backward_reference(v, jgate.select_experts_reference(v, **kw)[1],
                                                                       ct, **kw),))
    with jax.enable_x64(True):
        check_grads(jax.jit(pair), (jnp.asarray(logits, jnp.float64),), order=1, modes=["rev"], eps=1e-6,
                    atol=1e-7, rtol=1e-7)


@pytest.mark.parametrize("case", list(BWD_CASES))
@pytest.mark.parametrize("fw,impl", IMPLS, ids=IDS)
def test_sigmoid_topk_backward_matches_autodiff(fw, impl, case):
    """``select_experts_backward`` (every implementation) and the differentiable ``select_experts`` vs float64
    autodiff of the reference forward: within GRAD_F32_REL_FRO; the shared slots' gradient is ignored;
    without renormalization ``d_logit = c * d_w * s * (1 - s)`` on the chosen experts and exactly 0 elsewhere."""
    kw, logits, d_w = _bwd_case(case)
    want = _autodiff64(fw, kw, logits, d_w)
    mod, lg = MODULES[fw], _arr(fw, logits)
    gkw = {k: v for k, v in kw.items() if k != "e_score_correction_bias"}
    _, ids = mod.select_experts(lg, implementation=impl, **gkw)
    got = to_numpy(mod.select_experts_backward(lg, ids, _arr(fw, d_w), implementation=impl, **gkw))
    assert got.dtype == np.float32 and got.shape == logits.shape
    assert_rel_fro(got, want, GRAD_F32_REL_FRO, f"{case}: select_experts_backward")
    topk, ids = kw["topk"], to_numpy(ids)
    chosen = np.zeros(logits.shape, bool)
    np.put_along_axis(chosen, ids[:, :topk].astype(np.int64), True, axis=1)
    np.testing.assert_array_equal(got[~chosen], 0.0)  # sigmoid is per expert: nothing off the chosen
    if not kw["renormalize"]:
        c = kw["routed_scaling_factor"] if kw["apply_routed_scaling_factor_on_output"] else 1.0
        s = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
        formula = np.zeros(logits.shape)
        np.put_along_axis(formula, ids[:, :topk].astype(np.int64), c * d_w[:, :topk], axis=1)
        assert_rel_fro(got, formula * s * (1 - s), GRAD_F32_REL_FRO, "d_w * s * (1 - s)")
    # the differentiable forward: autograd / jax.grad through select_experts, same implementation
    if fw == "torch":
        x = lg.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(mod.select_experts(x, implementation=impl, **gkw)[0], x, _arr(fw, d_w))
    else:
        g = jax.grad(lambda v: jnp.sum(mod.select_experts(v, implementation=impl, **gkw)[0] * _arr(fw, d_w)))(lg)
    assert_rel_fro(to_numpy(g), want, GRAD_F32_REL_FRO, f"{case}: gradient through select_experts")


# --------------------------------------------------------------------------------------
# 3. presets


#: The 2026 presets: name -> (hf_model_id, H, I, E, topk, routing, renormalize, groups, rsf, S, activation, layout)
NEW_PRESETS = {
    "gpt-oss-20b": ("openai/gpt-oss-20b", 2880, 2880, 32, 4, "softmax_topk", True, None, 1.0, 0, "swiglu_oai",
                    "interleaved"),
    "gpt-oss-120b": ("openai/gpt-oss-120b", 2880, 2880, 128, 4, "softmax_topk", True, None, 1.0, 0, "swiglu_oai",
                     "interleaved"),
    "llama4-scout": ("meta-llama/Llama-4-Scout-17B-16E", 5120, 8192, 16, 1, "sigmoid_topk", False, None, 1.0, 1, "silu",
                     "concatenated"),
    "llama4-maverick": ("meta-llama/Llama-4-Maverick-17B-128E", 5120, 8192, 128, 1, "sigmoid_topk", False, None, 1.0,
                        1, "silu", "concatenated"),
    "qwen3-next-80b-a3b": ("Qwen/Qwen3-Next-80B-A3B-Instruct", 2048, 512, 512, 10, "softmax_topk", True, None, 1.0, 1,
                           "silu", "concatenated"),
    "glm-4.5-air": ("zai-org/GLM-4.5-Air", 4096, 1408, 128, 8, "biased_grouped_topk", True, (1, 1), 1.0, 1, "silu",
                    "concatenated"),
    "kimi-k2": ("moonshotai/Kimi-K2-Instruct", 7168, 2048, 384, 8, "biased_grouped_topk", True, (1, 1), 2.827, 1,
                "silu", "concatenated"),
}


@pytest.mark.parametrize("name", list(NEW_PRESETS))
def test_new_preset_values(name):
    hf_id, H, I, E, topk, routing, renorm, groups, rsf, S, act, layout = NEW_PRESETS[name]
    c = get_preset(name).config()
    assert get_preset(name).hf_model_id == hf_id
    got = (c.hidden_size, c.intermediate_size, c.num_experts, c.topk, c.routing, c.renormalize,
           None if c.num_expert_group is None else (c.num_expert_group, c.topk_group), c.routed_scaling_factor,
           c.num_fused_shared_experts, c.activation, c.gate_up_layout)
    assert got == (H, I, E, topk, routing, renorm, groups, rsf, S, act, layout)


def test_presets_equal_transformers_config_defaults():
    """Where transformers 5.24's config class documents a model (its defaults), the preset holds those values:
    GptOssConfig (gpt-oss-120b), Llama4TextConfig (Scout), Qwen3NextConfig, Glm4MoeConfig (GLM-4.5-Air's
    MoE sizes); the shared experts' intermediate sizes equal I (the fused shared experts need it)."""
    tf = transformers
    oss, l4, qn, glm = tf.GptOssConfig(), tf.Llama4TextConfig(), tf.Qwen3NextConfig(), tf.Glm4MoeConfig()
    for name, want in {
        "gpt-oss-120b": (oss.hidden_size, oss.intermediate_size, oss.num_local_experts, oss.num_experts_per_tok),
        "llama4-scout": (l4.hidden_size, l4.intermediate_size, l4.num_local_experts, l4.num_experts_per_tok),
        "qwen3-next-80b-a3b": (qn.hidden_size, qn.moe_intermediate_size, qn.num_experts, qn.num_experts_per_tok),
        "glm-4.5-air": (glm.hidden_size, glm.moe_intermediate_size, glm.n_routed_experts, glm.num_experts_per_tok),
    }.items():
        p = get_preset(name)
        assert (p.hidden_size, p.intermediate_size, p.num_experts, p.topk) == want, name
    assert get_preset("qwen3-next-80b-a3b").renormalize == qn.norm_topk_prob
    assert qn.shared_expert_intermediate_size == get_preset("qwen3-next-80b-a3b").intermediate_size
    g = get_preset("glm-4.5-air")
    assert (g.num_expert_group, g.topk_group, g.routed_scaling_factor, g.renormalize, g.num_shared_experts) == (
        glm.n_group, glm.topk_group, glm.routed_scaling_factor, glm.norm_topk_prob, glm.n_shared_experts)
    assert oss.swiglu_limit == 7.0 and oss.swiglu_alpha == 1.702  # the constants of activation='swiglu_oai'


def _tiny_num_experts(p) -> int:
    """The fewest experts (>= topk + 2) that keep the preset's groups valid: a multiple of the groups, two or
    more per group, and enough in the kept groups for topk."""
    G = p.num_expert_group or 1
    per = max(2, -(-p.topk // (p.topk_group or 1)))
    return -(-max(G * per, p.topk + 2) // G) * G


def _layer_f64(config: MoEConfig, inputs, weights: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The layer in float64 numpy given the gate's ``(weights, ids)``: ``sum_j c * w[t, j] * down(act(gate, up))``
    (``c`` the combine's rsf), gate / up rows per ``gate_up_layout``, silu or swiglu_oai (CONTRACT.md section 4)."""
    x, w13, w2 = (a.astype(np.float64) for a in (inputs.x, inputs.w13, inputs.w2))
    out = np.zeros_like(x)
    c = config.combine_routed_scaling_factor
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            h = w13[e] @ x[t]
            g, u = (h[0::2], h[1::2]) if config.gate_up_layout == "interleaved" else np.split(h, 2)
            if config.activation == "swiglu_oai":
                gc, uc = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
                a = (uc + 1) * gc / (1 + np.exp(-1.702 * gc))
            else:
                a = g / (1 + np.exp(-g)) * u
            out[t] += c * np.float64(weights[t, j]) * (w2[e] @ a)
    return out


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_tiny_layer_runs_in_both_frameworks(name):
    """Every preset's MoEConfig, shrunk (H=32, I=16, a few experts), runs the reference ``moe_forward`` in both
    frameworks; each equals a float64 numpy layer on the torch reference gate's choice."""
    p = get_preset(name)
    full = p.config()
    assert isinstance(full, MoEConfig) and full.num_experts == p.num_experts
    # Llama 4's router weight on the input and Qwen3-Next's shared gate are the layer's (tests/test_layer_2026.py
    # judges them against their own float64 loop and transformers' blocks); here the plain-combine layer
    assert full.apply_router_weight_on_input == name.startswith("llama4")
    assert full.shared_expert_gate == name.startswith("qwen3-next")
    # gpt-oss's expert biases likewise (tests/test_layer_gpt_oss.py: against float64 and GptOssMLP)
    assert full.expert_bias == name.startswith("gpt-oss")
    config = p.config(hidden_size=32, intermediate_size=16, num_experts=_tiny_num_experts(p),
                      apply_router_weight_on_input=False, shared_expert_gate=False, expert_bias=False)
    inputs = make_layer_inputs(config, 5, seed=7, routing="zipf")
    bias = inputs.e_score_correction_bias if config.routing == "biased_grouped_topk" else None
    w, ids = tgate.select_experts_reference(torch.from_numpy(inputs.router_logits),
                                            e_score_correction_bias=None if bias is None else torch.from_numpy(bias),
                                            **config.gate_kwargs())
    want = _layer_f64(config, inputs, w.numpy(), ids.numpy())
    assert np.abs(want).max() > 0.1
    for fw in ("torch", "jax"):
        assert_rel_fro(_layer(fw, config, inputs), want, F32_REL_FRO, f"{name}: {fw} moe_forward vs float64")


# --------------------------------------------------------------------------------------
# 4. bad input, and the places that cannot serve the new families


@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_sigmoid_topk_refuses_groups_and_bias(fw):
    """``sigmoid_topk`` has no groups and no bias: each given one is a ValueError naming the argument,
    in MoEConfig and in both frameworks' select_experts / select_experts_backward."""
    kw = dict(hidden_size=32, intermediate_size=16, num_experts=8, topk=2, routing="sigmoid_topk")
    for name, value in (("num_expert_group", 2), ("topk_group", 1)):
        with pytest.raises(ValueError, match=f"MoEConfig: {name} must be None for routing='sigmoid_topk'"):
            MoEConfig(**kw, **{name: value})
    mod = MODULES[fw]
    lg = _arr(fw, np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32))
    with pytest.raises(ValueError, match="select_experts: num_expert_group must be None for routing='sigmoid_topk'"):
        mod.select_experts(lg, topk=2, routing="sigmoid_topk", num_expert_group=2, topk_group=1)
    with pytest.raises(ValueError, match="select_experts: e_score_correction_bias must be None for routing='sigmoid_topk'"):
        mod.select_experts(lg, topk=2, routing="sigmoid_topk", e_score_correction_bias=_arr(fw, np.zeros(8, np.float32)))
    ids, d_w = _arr(fw, np.zeros((3, 2), np.int32)), _arr(fw, np.ones((3, 2), np.float32))
    with pytest.raises(ValueError, match="select_experts_backward: topk_group must be None for routing='sigmoid_topk'"):
        mod.select_experts_backward(lg, ids, d_w, topk=2, routing="sigmoid_topk", topk_group=1)
    with pytest.raises(ValueError, match=r"routing must be one of .*'sigmoid_topk'"):  # the list names it
        mod.select_experts(lg, topk=2, routing="sigmoid")


def test_checkpoint_refuses_presets_of_other_families():
    """``MoECheckpointLayer.config(preset)`` without config.json: a Mixtral / Qwen3-MoE / DeepSeek-V3 checkpoint
    with a Llama 4 (sigmoid_topk) or gpt-oss (interleaved gate/up, swiglu_oai) preset computed another model's
    layer before the 2026 families were added (the family check looked at the bias only); now a ValueError naming the preset."""
    from interop.checkpoints import MoECheckpointLayer

    E, H, I = 4, 8, 4
    layer = MoECheckpointLayer(arch="mixtral", layer=0, w13=torch.zeros(E, 2 * I, H), w2=torch.zeros(E, H, I),
                               w13_scale=None, w2_scale=None, router_weight=torch.zeros(E, H),
                               e_score_correction_bias=None, num_shared_experts=0, hf_config=None, path="/nowhere")
    for name in ("llama4-scout", "gpt-oss-20b"):
        with pytest.raises(ValueError, match=rf"preset '{name}' is another family's layer"):
            layer.config(name)
    assert layer.config("mixtral-8x7b").routing == "softmax_topk"  # the checkpoint's own family still works


def test_transformers_gpt_oss_block_is_served():
    """``patch_hf_model`` on a model holding transformers' ``GptOssMLP``: before the 2026 families were added a ValueError "no
    sparse-MoE block" (its router is ``router``, not ``gate``), then NotImplementedError naming the block; now it is
    served (``tests/test_hf_gpt_oss.py`` holds it against transformers), by ``EPMoE.from_hf_block`` too."""
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=1,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), GptOssMLP(cfg))
    assert moe_torch.EPMoE.from_hf_block(model[1]).config.expert_bias
    moe_torch.patch_hf_model(model)
    assert isinstance(model[1], moe_torch.HFMoEBlock) and model[1].replaces == "GptOssMLP"


# --------------------------------------------------------------------------------------
# 5. the new kernel path compiles for the GPU (no GPU needed)


def test_sigmoid_topk_kernels_lower_for_the_gpu():
    """The Triton gate with ROUTING=3 (sigmoid_topk, Llama 4 Maverick's E=128 top-1, bf16 logits, one shared
    expert) compiles to sm_90 (child process, no interpreter); the Pallas-Triton gate lowers for CUDA."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    from moe_pallas.ops.gate.pallas_triton import select_experts_pallas_triton
    from moe_torch.ops.gate.config import gate_config
    from moe_torch.ops.gate.triton import ROUTING_CODES
    from sm90 import compile_sm90

    cfg = gate_config(4096, 128, 1)
    job = {"signature": {"logits_ptr": "*bf16", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32",
                         "T": "i32", "stride_t": "i32", "rsf": "fp32", "shared_w": "fp32"},
           "constexprs": {"E": 128, "ROUTING": ROUTING_CODES["sigmoid_topk"], "G": 1, "TOPK_GROUP": 1, "TOPK": 1,
                          "S": 1, "RENORMALIZE": False, "APPLY_RSF": False, "BLOCK_T": cfg.block_t,
                          "BLOCK_E": cfg.block_e, "BLOCK_G": 1, "BLOCK_K": cfg.block_k},
           "options": {"num_warps": cfg.num_warps, "num_stages": 1}}
    ptx = compile_sm90({"llama4-maverick": job}, module="moe_torch.ops.gate.triton", kernel="_gate_kernel")
    assert ".target sm_90" in ptx["llama4-maverick"] and "div.rn.f32" in ptx["llama4-maverick"]
    h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "cuda"))
    f = lambda lg: select_experts_pallas_triton(lg, topk=2, routing="sigmoid_topk", renormalize=True,  # noqa: E731
                                                 num_fused_shared_experts=1, interpret=False)
    with use_abstract_mesh(h200):
        text = jax.jit(f).trace(jax.ShapeDtypeStruct((37, 16), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert re.search(r"select_experts_sigmoid_topk", text)
