"""gpt-oss's MoE layer in both frameworks (CONTRACT.md sections 4, 5, 8, 9):

- per-expert biases (``MoEConfig(expert_bias=True)``; the layer inputs ``w13_bias [E_local, 2I]`` and
  ``w2_bias [E_local, H]``, transformers' ``gate_up_proj_bias`` / ``down_proj_bias``) on both GEMMs, the
  combine weighting the whole ``a @ w2.T + b2`` as ``GptOssExperts`` does, with ``swiglu_oai`` and the
  interleaved gate/up rows;
- 4-bit expert weights in the layer (``quant="mxfp4"``, gpt-oss's checkpoint format, and ``"int4"``):
  packed codes and group scales, activations in ``x``'s float dtype, the backward straight-through.

Judges: a float64 per-token loop written here (torch autograd gives its gradients; on the dequantized
weights for the 4-bit layers) and transformers 5.24's own ``GptOssMLP`` (a tiny ``GptOssConfig``; its
router's bias is added to the logits outside our layer, ``.backward()`` on the block). Every backend: the
references, the Triton kernels (``TRITON_INTERPRET=1``) and the Pallas-Triton kernels (interpreted);
``recompute``; EP with 2 ranks (gloo processes for torch, 2 forced host devices in a child process for
JAX, as ``test_ep_torch.py`` / ``test_ep_jax.py`` do) against the single device, bias gradients included;
the modules (trainable biases, frozen 4-bit codes); bad inputs.

This file is also the JAX EP child (``python tests/test_layer_gpt_oss.py --jax-ep-child``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import tolerances` (and in spawned processes)
sys.path.insert(0, ROOT)

from common import TORCH_DEVICE  # noqa: E402
from gloo_ranks import gather_to_file, spawn_ranks  # noqa: E402
from moe_contract import MoEConfig  # noqa: E402
from tolerances import (BF16_REL_FRO, F32_REL_FRO, FP8_REL_FRO, GRAD_BF16_REL_FRO, GRAD_F32_REL_FRO,  # noqa: E402
                        rel_fro)

# H and I multiples of 32 (the 4-bit modes' group); E = 4 experts, top-2.
H, I, E, TOPK = 64, 32, 4, 2
#: gpt-oss's layer: softmax top-k renormalized (GptOssTopKRouter), swiglu_oai on interleaved gate/up rows,
#: per-expert biases on both projections.
GPT_OSS = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, topk=TOPK, routing="softmax_topk",
                    renormalize=True, activation="swiglu_oai", gate_up_layout="interleaved", expert_bias=True)
#: The biases with a fused shared expert (rows E.. of the bias tensors, as given) and rsf 2 in the combine.
SHARED = GPT_OSS.replace(num_fused_shared_experts=1, routed_scaling_factor=2.0)
CONFIGS = {"gpt_oss": GPT_OSS, "mxfp4": GPT_OSS.replace(quant="mxfp4"), "int4": GPT_OSS.replace(quant="int4"),
           "shared": SHARED}
GRADS = ("x", "router_logits", "w13", "w2", "w13_bias", "w2_bias")
WEIGHT_NAMES = ("w13", "w2", "w13_bias", "w2_bias")


def make_inputs(config: MoEConfig, T: int, seed: int = 0, one_expert: bool = False) -> dict:
    """float32 numpy inputs, O(1) outputs (weights ~ N(0, 1/K), biases ~ N(0, 1/4)); ``one_expert``: expert 0 wins
    every token's first slot (topk=1 then leaves the others without rows)."""
    rng = np.random.default_rng(seed)
    S = config.num_fused_shared_experts
    f32 = np.float32
    logits = rng.standard_normal((T, E), dtype=f32)
    if one_expert:
        logits[:, 0] = logits.max(axis=1) + 1.0
    return dict(
        x=rng.standard_normal((T, H), dtype=f32),
        router_logits=logits,
        w13=rng.standard_normal((E + S, 2 * I, H), dtype=f32) / f32(np.sqrt(H)),
        w2=rng.standard_normal((E + S, H, I), dtype=f32) / f32(np.sqrt(I)),
        w13_bias=rng.standard_normal((E + S, 2 * I), dtype=f32) * f32(0.5),
        w2_bias=rng.standard_normal((E + S, H), dtype=f32) * f32(0.5),
        d_out=rng.standard_normal((T, H), dtype=f32),
    )


# --------------------------------------------------------------------------------------------------
# The float64 judge: the layer as CONTRACT.md writes it, one token at a time.


def loop_reference(config: MoEConfig, x, logits, w13, w2, b13, b2):
    """float64 torch tensors -> ``out [T, H]``: per token, softmax top-k (renormalized), each expert
    ``w2[e] @ swiglu_oai(w13[e] @ x + b13[e]) + b2[e]`` on the interleaved gate (``0::2``) / up (``1::2``) rows,
    weighted whole by the routing weight (transformers' ``GptOssExperts``), rsf on the routed sum, the fused
    shared experts with weight 1 (their bias rows as given). Differentiable (torch autograd: ``clamp`` passes the
    gradient at the bounds, as transformers'), the selection excepted."""
    import torch

    k, S, rsf = config.topk, config.num_fused_shared_experts, config.routed_scaling_factor
    assert config.routing == "softmax_topk" and config.activation == "swiglu_oai"

    def expert(v, e):
        h = w13[e] @ v + b13[e]
        g, u = h[0::2], h[1::2]
        gc, uc = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
        return w2[e] @ ((uc + 1) * gc * torch.sigmoid(1.702 * gc)) + b2[e]

    out = []
    for t in range(x.shape[0]):
        p = torch.softmax(logits[t], 0)
        ids = torch.argsort(p.detach(), descending=True, stable=True)[:k]
        w = p[ids]
        w = w / w.sum() if config.renormalize else w
        routed = sum(w[j] * expert(x[t], e) for j, e in enumerate(ids.tolist()))
        out.append(rsf * routed + sum(expert(x[t], E + i) for i in range(S)))
    return torch.stack(out)


def loop_grads(config: MoEConfig, inputs: dict, weights: dict | None = None):
    """``(out, {name: gradient})`` of :func:`loop_reference` in float64 for ``inputs['d_out']``; ``weights``
    replaces ``w13`` / ``w2`` (the dequantized 4-bit weights: float32 numpy)."""
    import torch

    arrays = dict(inputs, **(weights or {}))
    leaves = {n: torch.from_numpy(np.asarray(arrays[n])).double().requires_grad_() for n in GRADS}
    out = loop_reference(config, *(leaves[n] for n in GRADS))
    out.backward(torch.from_numpy(inputs["d_out"]).double())
    return out.detach().numpy(), {n: leaves[n].grad.numpy() for n in GRADS}


# --------------------------------------------------------------------------------------------------
# Our layers: moe_forward with autograd / jax.vjp.


def quantize(framework: str, config: MoEConfig, inputs: dict):
    """``(codes, dequantized)``: the framework's ``quantize_layer_weights`` of the float32 weights
    (``{w13, w13_scale, w2, w2_scale}`` native arrays) and its dequantization ``{w13, w2}`` (float32 numpy, exact)."""
    if framework == "torch":
        import torch

        import moe_torch as mod

        conv = torch.from_numpy
    else:
        import jax.numpy as jnp

        import moe_pallas as mod

        conv = jnp.asarray
    q13, s13, q2, s2 = mod.quantize_layer_weights(conv(inputs["w13"]), conv(inputs["w2"]), config)
    deq = mod.dequantize_weight_mxfp4 if config.quant == "mxfp4" else mod.dequantize_weight_int4
    from tolerances import to_numpy

    wd = {"w13": to_numpy(deq(q13, s13)).astype(np.float32), "w2": to_numpy(deq(q2, s2)).astype(np.float32)}
    return dict(w13=q13, w13_scale=s13, w2=q2, w2_scale=s2), wd


def torch_layer(config: MoEConfig, inputs: dict, implementation: str, *, recompute: bool = False, dtype="float32",
                bias_dtype=None, codes: dict | None = None, device: str = TORCH_DEVICE):
    """``(out, grads)`` of ``moe_torch.moe_forward`` (autograd, ``.backward(d_out)``) on ``device`` (the suite's
    torch device by default: CUDA in GPU mode, where the Triton kernels need CUDA tensors; numpy out): ``x`` and
    float weights in ``dtype``, the biases in ``bias_dtype`` (default ``dtype``), router logits float32; 4-bit
    ``codes`` (from :func:`quantize`, moved to ``device``) instead of the float weights (then no weight gradients)."""
    import torch

    import moe_torch

    dt, bdt = getattr(torch, dtype), getattr(torch, bias_dtype or dtype)
    names = [n for n in GRADS if codes is None or n not in ("w13", "w2")]
    cast = {"router_logits": torch.float32, "w13_bias": bdt, "w2_bias": bdt}
    leaves = {n: torch.from_numpy(inputs[n]).to(device, cast.get(n, dt)).requires_grad_() for n in names}
    w = ({k: v.to(device) for k, v in codes.items()} if codes is not None else
         {"w13": leaves["w13"], "w2": leaves["w2"]})
    out = moe_torch.moe_forward(leaves["x"], leaves["router_logits"], w["w13"], w["w2"], config,
                                w13_scale=w.get("w13_scale"), w2_scale=w.get("w2_scale"),
                                w13_bias=leaves["w13_bias"], w2_bias=leaves["w2_bias"],
                                implementation=implementation, recompute=recompute)
    out.backward(torch.from_numpy(inputs["d_out"]).to(device, dt))
    for n in ("w13_bias", "w2_bias"):
        assert leaves[n].grad.dtype == bdt, (n, leaves[n].grad.dtype)
    return out.detach().float().cpu().numpy(), {n: leaves[n].grad.float().cpu().numpy() for n in names}


def jax_layer(config: MoEConfig, inputs: dict, implementation: str, *, recompute: bool = False, dtype="float32",
              bias_dtype=None, codes: dict | None = None, jit: bool = False):
    """``(out, grads)`` of ``moe_pallas.moe_forward`` (``jax.vjp`` for ``d_out``, of ``jax.jit`` of it with ``jit``),
    as :func:`torch_layer`."""
    import jax
    import jax.numpy as jnp

    import moe_pallas

    dt, bdt = jnp.dtype(dtype), jnp.dtype(bias_dtype or dtype)
    names = [n for n in GRADS if codes is None or n not in ("w13", "w2")]
    cast = {"router_logits": jnp.float32, "w13_bias": bdt, "w2_bias": bdt}
    args = {n: jnp.asarray(inputs[n]).astype(cast.get(n, dt)) for n in names}
    fixed = codes or {}

    def f(a):
        w = dict(a, **fixed)
        return moe_pallas.moe_forward(a["x"], a["router_logits"], w["w13"], w["w2"], config,
                                      w13_scale=w.get("w13_scale"), w2_scale=w.get("w2_scale"),
                                      w13_bias=a["w13_bias"], w2_bias=a["w2_bias"],
                                      implementation=implementation, recompute=recompute)

    out, vjp = jax.vjp(jax.jit(f) if jit else f, args)
    (g,) = vjp(jnp.asarray(inputs["d_out"]).astype(dt))
    for n in ("w13_bias", "w2_bias"):
        assert g[n].dtype == bdt, (n, g[n].dtype)
    return np.asarray(out.astype(jnp.float32)), {n: np.asarray(g[n].astype(jnp.float32)) for n in names}


LAYERS = {"torch": torch_layer, "jax": jax_layer}


def assert_close_to_loop(config, inputs, out, grads, *, weights=None, out_tol=F32_REL_FRO, grad_tol=GRAD_F32_REL_FRO,
                         what=""):
    ref_out, ref_grads = loop_grads(config, inputs, weights)
    err = rel_fro(out, ref_out)
    assert err <= out_tol, f"{what}: output rel_fro {err:.2e} > {out_tol:.0e}"
    assert set(grads) <= set(ref_grads) and {"x", "router_logits", "w13_bias", "w2_bias"} <= set(grads), sorted(grads)
    for name, g in grads.items():
        err = rel_fro(g, ref_grads[name])
        assert np.isfinite(err) and err <= grad_tol, f"{what}: d_{name} rel_fro {err:.2e} > {grad_tol:.0e}"


# --------------------------------------------------------------------------------------------------
# Against the float64 loop: float weights with biases, every backend; 4-bit weights against the loop on the
# dequantized weights.

CASES = [
    ("torch", "reference", "gpt_oss", False),
    ("jax", "reference", "gpt_oss", False),
    ("torch", "reference", "shared", True),  # a fused shared expert's bias rows, rsf 2; recompute: GEMM 1 + bias again
    ("torch", "triton", "gpt_oss", True),  # the Triton kernels (interpreted): bias in both GEMMs, dbias
    ("jax", "pallas_triton", "gpt_oss", False),  # the Pallas-Triton kernels (interpreted)
    ("torch", "reference", "mxfp4", False),
    ("jax", "reference", "mxfp4", True),
    ("torch", "triton", "mxfp4", False),  # the Triton kernel decodes the e2m1 codes in each tile
    ("jax", "pallas_triton", "mxfp4", True),
    ("torch", "reference", "int4", True),
    ("jax", "reference", "int4", False),
    ("torch", "triton", "int4", True),
]


@pytest.mark.parametrize("framework,implementation,name,recompute", CASES,
                         ids=[f"{f}-{i}-{n}" + ("-recompute" * r) for f, i, n, r in CASES])
def test_layer_equals_float64_loop(framework, implementation, name, recompute):
    """Output and every gradient (x, router_logits, w13, w2 for float weights, w13_bias, w2_bias) within CONTRACT.md
    sections 7/8's float32 rows of the float64 per-token loop's autograd; a 4-bit layer (codes frozen: no weight
    gradient) against the loop on its dequantized weights (section 9)."""
    config = CONFIGS[name]
    inputs = make_inputs(config, T=6, seed=1)
    codes = weights = None
    if config.quant != "none":
        codes, weights = quantize(framework, config, inputs)
    out, grads = LAYERS[framework](config, inputs, implementation, recompute=recompute, codes=codes)
    assert_close_to_loop(config, inputs, out, grads, weights=weights, what=f"{framework} {implementation} {name}")


@pytest.mark.parametrize("framework,name,bias_dtype", [("torch", "gpt_oss", "float32"), ("jax", "gpt_oss", "bfloat16"),
                                                       ("torch", "mxfp4", "bfloat16"), ("jax", "mxfp4", "float32")])
def test_bf16_layer_within_contract(framework, name, bias_dtype):
    """bf16 activations (gpt-oss's case: bf16 x with MXFP4 weights, the weights dequantized and rounded to bf16 in
    the GEMM), float32 or bf16 biases (their gradients in their own dtype): output and gradients within the bf16
    rows of the float64 loop (on the float32 dequantized weights for MXFP4)."""
    config = CONFIGS[name]
    inputs = make_inputs(config, T=6, seed=2)
    codes = weights = None
    if config.quant != "none":
        codes, weights = quantize(framework, config, inputs)
    out, grads = LAYERS[framework](config, inputs, "reference", dtype="bfloat16", bias_dtype=bias_dtype, codes=codes)
    assert_close_to_loop(config, inputs, out, grads, weights=weights, out_tol=BF16_REL_FRO, grad_tol=GRAD_BF16_REL_FRO,
                         what=f"bf16 {name}")


def test_fp8_layer_trains_its_biases():
    """FP8 weights with expert biases (the biases stay float and trainable with any weights, CONTRACT.md section 8):
    torch and JAX agree (the same FP8 codes, bit-identical per section 3) on the output and the gradients of x,
    router_logits and both biases within the float32 rows; against the float64 loop on the dequantized FP8 weights
    (the activations' FP8 rounding is the difference: two FP8 GEMMs, hence 2 * the FP8 row, as
    tests/test_layer_backward.py bounds the FP8 layer's d_x; router logits 5x, its renormalization magnifies them;
    measured 2.1e-2 .. 3.3e-2 on three seeds); the codes get none."""
    import jax.numpy as jnp
    import torch

    import moe_pallas
    import moe_torch
    from tolerances import to_numpy

    config = GPT_OSS.replace(quant="fp8_per_token")
    inputs = make_inputs(config, T=6, seed=3)
    got = {}
    for framework, mod, conv in (("torch", moe_torch, torch.from_numpy), ("jax", moe_pallas, jnp.asarray)):
        q13, s13, q2, s2 = mod.quantize_layer_weights(conv(inputs["w13"]), conv(inputs["w2"]), config)
        codes = dict(w13=q13, w13_scale=s13, w2=q2, w2_scale=s2)
        got[framework] = LAYERS[framework](config, inputs, "reference", codes=codes)
        weights = {"w13": to_numpy(mod.dequantize_weight_fp8(q13, s13)), "w2": to_numpy(mod.dequantize_weight_fp8(q2, s2))}
    (out_t, g_t), (out_j, g_j) = got["torch"], got["jax"]
    assert sorted(g_t) == sorted(g_j) == ["router_logits", "w13_bias", "w2_bias", "x"]
    assert rel_fro(out_t, out_j) <= F32_REL_FRO  # measured ~2e-7
    for name in g_t:
        assert rel_fro(g_t[name], g_j[name]) <= GRAD_F32_REL_FRO, name
    ref_out, ref = loop_grads(config, inputs, weights)
    assert rel_fro(out_t, ref_out) <= 2 * FP8_REL_FRO
    for name in g_t:
        assert rel_fro(g_t[name], ref[name]) <= (5 if name == "router_logits" else 2) * FP8_REL_FRO, name


@pytest.mark.parametrize("framework,implementation", [("torch", "reference"), ("jax", "reference"), ("torch", "triton")])
def test_experts_without_rows_get_zero_bias_gradients(framework, implementation):
    """topk=1 (not renormalized: a renormalized single weight is 1, whose logit gradient is 0) and expert 0 winning
    every token: experts 1..3 get no rows, so their bias (and weight) gradients are exactly 0, and their biases
    reach no output; the rest equals the float64 loop."""
    config = GPT_OSS.replace(topk=1, renormalize=False)
    inputs = make_inputs(config, T=5, seed=4, one_expert=True)
    out, grads = LAYERS[framework](config, inputs, implementation)
    assert_close_to_loop(config, inputs, out, grads, what="one expert")
    for name in WEIGHT_NAMES:
        assert not grads[name][1:].any(), f"d_{name} of experts without rows must be exactly 0"
        assert grads[name][0].any()


def test_routing_weight_multiplies_the_down_bias():
    """CONTRACT.md section 5: the combine weights ``a @ w2.T + b2`` whole (transformers' ``GptOssExperts``). With
    zero weights, ``x`` and ``w13_bias`` the expert outputs are exactly ``b2[e]``, so the layer is
    ``sum_j w[t, j] * b2[e_j]`` (renormalized weights: a convex mix of the chosen experts' biases), not ``b2``
    added once per slot or once per token."""
    import torch

    import moe_torch

    inputs = make_inputs(GPT_OSS, T=5, seed=5)
    t = {n: torch.from_numpy(v) for n, v in inputs.items()}
    zero = torch.zeros_like
    out = moe_torch.moe_forward(zero(t["x"]), t["router_logits"], zero(t["w13"]), zero(t["w2"]), GPT_OSS,
                                w13_bias=zero(t["w13_bias"]), w2_bias=t["w2_bias"])
    w, ids = moe_torch.select_experts(t["router_logits"], **GPT_OSS.gate_kwargs())
    want = (w[:, :, None].double() * t["w2_bias"].double()[ids.long()]).sum(dim=1)
    assert rel_fro(out, want) <= F32_REL_FRO


# --------------------------------------------------------------------------------------------------
# Against transformers' GptOssMLP (float32; .backward() on the block).


def _hf_gpt_oss(seed: int = 0, w13=None, w2=None):
    """A tiny ``GptOssMLP`` (eager experts) with random float32 weights, router weight and bias, expert biases;
    ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` (float32 torch, ours) replace its expert weights when given."""
    import torch
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    torch.manual_seed(seed)
    cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=TOPK,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    cfg._experts_implementation = "eager"  # the block alone, outside a model that would set it
    block = GptOssMLP(cfg).float()
    ex = block.experts
    assert (ex.limit, ex.alpha) == (7.0, 1.702)  # swiglu_oai's constants
    with torch.no_grad():
        block.router.weight.normal_(0.0, 1.0 / np.sqrt(H))
        block.router.bias.normal_(0.0, 0.5)
        ex.gate_up_proj.normal_(0.0, 1.0 / np.sqrt(H))  # [E, H, 2I] (in, out)
        ex.down_proj.normal_(0.0, 1.0 / np.sqrt(I))  # [E, I, H]
        ex.gate_up_proj_bias.normal_(0.0, 0.5)
        ex.down_proj_bias.normal_(0.0, 0.5)
        if w13 is not None:
            ex.gate_up_proj.copy_(w13.transpose(1, 2))
            ex.down_proj.copy_(w2.transpose(1, 2))
    return block


def _our_weights(block) -> dict:
    """Our ``w13 [E, 2I, H]`` (interleaved gate/up rows: transformers' ``gate_up_proj [E, H, 2I]`` transposed),
    ``w2 [E, H, I]`` and the two biases, from ``GptOssMLP``."""
    ex = block.experts
    return dict(w13=ex.gate_up_proj.detach().transpose(1, 2).contiguous(),
                w2=ex.down_proj.detach().transpose(1, 2).contiguous(),
                w13_bias=ex.gate_up_proj_bias.detach().clone(), w2_bias=ex.down_proj_bias.detach().clone())


def _hf_grads(block, x, d_out):
    x = x.clone().requires_grad_()
    out, _ = block(x[None])
    out[0].backward(d_out)
    ex, r = block.experts, block.router
    return out[0].detach(), dict(x=x.grad, router_weight=r.weight.grad, router_bias=r.bias.grad,
                                 w13=ex.gate_up_proj.grad.transpose(1, 2), w2=ex.down_proj.grad.transpose(1, 2),
                                 w13_bias=ex.gate_up_proj_bias.grad, w2_bias=ex.down_proj_bias.grad)


def _check(ours: dict, theirs: dict, out, ref_out, what: str):
    err = rel_fro(out, ref_out)
    assert err <= F32_REL_FRO, f"{what}: output rel_fro {err:.2e}"
    assert set(ours) <= set(theirs) and len(ours) >= 5, sorted(ours)
    for name, g in ours.items():
        err = rel_fro(g, theirs[name])
        assert err <= GRAD_F32_REL_FRO, f"{what}: d_{name} rel_fro {err:.2e} > {GRAD_F32_REL_FRO:.0e}"


def _xd(seed: int):
    import torch

    rng = np.random.default_rng(seed)
    return (torch.from_numpy(rng.standard_normal((6, H), dtype=np.float32)),
            torch.from_numpy(rng.standard_normal((6, H), dtype=np.float32)))


@pytest.mark.parametrize("implementation,quant", [("reference", "none"), ("triton", "none"), ("reference", "mxfp4")])
def test_torch_module_equals_gpt_oss_mlp(implementation, quant):
    """``EPMoE`` holding gpt-oss's expert weights and biases (``router_logits = F.linear(x, router.weight,
    router.bias)`` outside, as ``GptOssTopKRouter`` computes them) equals ``GptOssMLP``: output and the gradients of
    x, the router weight and bias, both biases and (float layer) both expert weights. MXFP4: our layer on the codes
    equals ``GptOssMLP`` loaded with the dequantized weights (the codes frozen: buffers, no weight gradient)."""
    import torch

    import moe_torch

    x, d_out = (t.to(TORCH_DEVICE) for t in _xd(6))
    if quant == "none":
        block = _hf_gpt_oss()
        w = _our_weights(block)
        layer = moe_torch.EPMoE.from_float(GPT_OSS, w["w13"], w["w2"], w13_bias=w["w13_bias"], w2_bias=w["w2_bias"],
                                           implementation=implementation)
    else:
        config = GPT_OSS.replace(quant=quant)
        w = _our_weights(_hf_gpt_oss())
        q13, s13, q2, s2 = moe_torch.quantize_layer_weights(w["w13"], w["w2"], config)
        wd13, wd2 = moe_torch.dequantize_weight_mxfp4(q13, s13), moe_torch.dequantize_weight_mxfp4(q2, s2)
        block = _hf_gpt_oss(w13=wd13, w2=wd2)  # the same seed: router and biases as before
        layer = moe_torch.EPMoE(config, q13, q2, w13_scale=s13, w2_scale=s2, w13_bias=w["w13_bias"],
                                w2_bias=w["w2_bias"], implementation=implementation)
        assert {n for n, _ in layer.named_parameters()} == {"w13_bias", "w2_bias"}
    block, layer = block.to(TORCH_DEVICE), layer.to(TORCH_DEVICE)
    ref_out, theirs = _hf_grads(block, x, d_out)
    xl = x.clone().requires_grad_()
    rw = block.router.weight.detach().clone().requires_grad_()
    rb = block.router.bias.detach().clone().requires_grad_()
    out = layer(xl, torch.nn.functional.linear(xl, rw, rb))
    out.backward(d_out)
    ours = dict(x=xl.grad, router_weight=rw.grad, router_bias=rb.grad, w13_bias=layer.w13_bias.grad,
                w2_bias=layer.w2_bias.grad)
    if quant == "none":
        ours.update(w13=layer.w13.grad, w2=layer.w2.grad)
    _check(ours, theirs, out, ref_out, f"torch {implementation} {quant}")


@pytest.mark.parametrize("quant", ["none", "mxfp4"])
def test_jax_layer_equals_gpt_oss_mlp(quant):
    """``moe_pallas.MoELayer`` (biases as ``nnx.Param``) under a router with a bias (``x @ W.T + b``, float32 at
    ``Precision.HIGHEST``) equals ``GptOssMLP``: output and ``nnx.grad`` of the router weight and bias, the biases,
    the float experts and x; MXFP4 codes (FrozenWeight) against the block on the dequantized weights."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import moe_pallas

    x, d_out = _xd(7)
    j = lambda t: jnp.asarray(t.detach().numpy())  # noqa: E731
    w = _our_weights(_hf_gpt_oss())
    if quant == "none":
        block = _hf_gpt_oss()
        layer = moe_pallas.MoELayer.from_float(GPT_OSS, j(w["w13"]), j(w["w2"]), w13_bias=j(w["w13_bias"]),
                                               w2_bias=j(w["w2_bias"]))
    else:
        config = GPT_OSS.replace(quant=quant)
        layer = moe_pallas.MoELayer.from_float(config, j(w["w13"]), j(w["w2"]), w13_bias=j(w["w13_bias"]),
                                               w2_bias=j(w["w2_bias"]))
        assert isinstance(layer.w13, moe_pallas.module.FrozenWeight) and layer.w13[...].dtype == jnp.uint8
        deq = moe_pallas.dequantize_weight_mxfp4
        import torch

        wd = [torch.from_numpy(np.array(deq(layer.w13[...], layer.w13_scale[...]))),
              torch.from_numpy(np.array(deq(layer.w2[...], layer.w2_scale[...])))]
        block = _hf_gpt_oss(w13=wd[0], w2=wd[1])
    assert isinstance(layer.w13_bias, nnx.Param) and isinstance(layer.w2_bias, nnx.Param)
    ref_out, theirs = _hf_grads(block, x, d_out)

    class Block(nnx.Module):
        def __init__(self, rw, rb, layer):
            self.rw, self.rb, self.layer = nnx.Param(rw), nnx.Param(rb), layer

        def __call__(self, xs):
            logits = jax.lax.dot_general(xs, self.rw[...], (((1,), (1,)), ((), ())),
                                         precision=jax.lax.Precision.HIGHEST) + self.rb[...]
            return self.layer(xs, logits)

    model = Block(j(block.router.weight), j(block.router.bias), layer)

    def loss(m, xs):
        out = m(xs)
        return jnp.sum(out * j(d_out)), out

    (_, out), (g, g_x) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(model, j(x))
    ours = dict(x=g_x, router_weight=g.rw[...], router_bias=g.rb[...], w13_bias=g.layer.w13_bias[...],
                w2_bias=g.layer.w2_bias[...])
    if quant == "none":
        ours.update(w13=g.layer.w13[...], w2=g.layer.w2[...])
    _check(ours, theirs, out, ref_out, f"jax {quant}")


# --------------------------------------------------------------------------------------------------
# Modules: the biases are trainable parameters; 4-bit codes and scales are frozen state.


def test_modules_hold_biases_and_frozen_4bit_codes_alike():
    """``EPMoE`` / ``MoELayer`` of an INT4 gpt-oss layer: codes and (bf16) scales are buffers / FrozenWeight and keep
    their dtype under ``.half()`` / ``.float()``; the biases are trainable parameters (frozen with ``trainable=False``);
    both frameworks give the same output and equal the float64 loop on the dequantized weights; a float state_dict
    into the 4-bit layer is refused (``Parameter.copy_`` would cast float weights to uint8 codes)."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    import moe_pallas
    import moe_torch

    config = CONFIGS["int4"]
    inputs = make_inputs(config, T=6, seed=9)
    kw = {n: inputs[n] for n in WEIGHT_NAMES}
    tl = moe_torch.EPMoE.from_float(config, *(torch.from_numpy(kw[n]) for n in ("w13", "w2")),
                                    w13_bias=torch.from_numpy(kw["w13_bias"]), w2_bias=torch.from_numpy(kw["w2_bias"]))
    jl = moe_pallas.MoELayer.from_float(config, *(jnp.asarray(kw[n]) for n in ("w13", "w2")),
                                        w13_bias=jnp.asarray(kw["w13_bias"]), w2_bias=jnp.asarray(kw["w2_bias"]),
                                        recompute=True)
    assert {n for n, _ in tl.named_parameters()} == {"w13_bias", "w2_bias"}
    assert {n for n, _ in tl.named_buffers()} == {"w13", "w2", "w13_scale", "w2_scale"}
    assert tl.w13.dtype == torch.uint8 and tl.w13_scale.dtype == torch.bfloat16 and not tl.trainable
    assert isinstance(jl.w13, moe_pallas.module.FrozenWeight) and isinstance(jl.w13_scale, moe_pallas.module.FrozenWeight)
    assert isinstance(jl.w13_bias, nnx.Param)
    frozen = moe_pallas.MoELayer.from_float(config, *(jnp.asarray(kw[n]) for n in ("w13", "w2")),
                                            w13_bias=jnp.asarray(kw["w13_bias"]), w2_bias=jnp.asarray(kw["w2_bias"]),
                                            trainable=False)
    assert not isinstance(frozen.w13_bias, nnx.Param)
    assert not moe_torch.EPMoE.from_float(config, torch.from_numpy(kw["w13"]), torch.from_numpy(kw["w2"]),
                                          w13_bias=torch.from_numpy(kw["w13_bias"]),
                                          w2_bias=torch.from_numpy(kw["w2_bias"]), trainable=False).w2_bias.requires_grad
    x, lg = inputs["x"], inputs["router_logits"]
    out_t = tl(torch.from_numpy(x), torch.from_numpy(lg))
    out_j = jl(jnp.asarray(x), jnp.asarray(lg))
    assert rel_fro(out_t, np.asarray(out_j)) <= F32_REL_FRO
    _, wd = quantize("torch", config, inputs)
    ref, _ = loop_grads(config, inputs, wd)
    assert rel_fro(out_t, ref) <= F32_REL_FRO
    out_t.backward(torch.from_numpy(inputs["d_out"]))
    assert tl.w13_bias.grad is not None and tl.w13_bias.grad.abs().sum() > 0
    tl.half()  # float casts reach the biases only: the codes and their bf16 scales keep their dtype
    assert tl.w13.dtype == torch.uint8 and tl.w13_scale.dtype == torch.bfloat16 and tl.w2_bias.dtype == torch.float16
    float_state = moe_torch.EPMoE.from_float(GPT_OSS, torch.from_numpy(kw["w13"]), torch.from_numpy(kw["w2"]),
                                             w13_bias=torch.from_numpy(kw["w13_bias"]),
                                             w2_bias=torch.from_numpy(kw["w2_bias"])).state_dict()
    with pytest.raises(RuntimeError, match=r"dtype mismatch for w13: the module holds uint8 \(4-bit packed codes"):
        tl.load_state_dict(float_state, strict=False)


def test_from_preset_draws_the_biases():
    """gpt-oss's presets set ``expert_bias`` (``ModelPreset.expert_bias``); ``from_preset`` draws the biases
    (``draw_expert_biases``, this rank's rows): the same bits in both frameworks, 4-bit weights alike; a preset
    without the flag has none."""
    import jax.numpy as jnp
    import torch

    import moe_pallas
    import moe_torch
    from moe_contract.inputs import draw_expert_biases
    from moe_contract.presets import get_preset

    assert get_preset("gpt-oss-20b").expert_bias and get_preset("gpt-oss-120b").config().expert_bias
    assert not any(get_preset(n).expert_bias for n in ("deepseek-v3", "llama4-scout", "qwen3-next-80b-a3b"))
    kw = dict(hidden_size=H, intermediate_size=I, num_experts=4, ep_size=2, ep_rank=1)
    for quant in ("none", "mxfp4"):
        tl = moe_torch.EPMoE.from_preset("gpt-oss-20b", dtype=torch.float32, quant=quant, **kw)
        jl = moe_pallas.MoELayer.from_preset("gpt-oss-20b", dtype=jnp.float32, quant=quant, **kw)
        b13, b2 = draw_expert_biases(tl.config, 0)
        assert b13.shape == (4, 2 * I) and b2.shape == (4, H)
        np.testing.assert_array_equal(tl.w13_bias.detach().numpy(), b13[2:])  # rank 1 of 2: experts 2, 3
        np.testing.assert_array_equal(np.asarray(jl.w2_bias[...]), b2[2:])
        np.testing.assert_array_equal(tl.w13.numpy() if quant != "none" else tl.w13.detach().numpy(),
                                      np.asarray(jl.w13[...]))
    assert moe_torch.EPMoE.from_preset("tiny", hidden_size=H, intermediate_size=I).w13_bias is None


# --------------------------------------------------------------------------------------------------
# Bad inputs: ValueError / TypeError naming the argument, before any computation.


def test_config_rules():
    """``expert_bias`` is a bool; the 4-bit modes need ``H`` and ``I`` multiples of 32 (one scale per group of 32
    along K)."""
    with pytest.raises(TypeError, match="MoEConfig: expert_bias must be a bool"):
        GPT_OSS.replace(expert_bias=1)
    with pytest.raises(ValueError, match=r"MoEConfig: hidden_size must be a multiple of 32 for quant='mxfp4' .* "
                                         r"got hidden_size=48"):
        GPT_OSS.replace(quant="mxfp4", hidden_size=48)
    with pytest.raises(ValueError, match=r"MoEConfig: intermediate_size must be a multiple of 32 for quant='int4' .* "
                                         r"got intermediate_size=40"):
        GPT_OSS.replace(quant="int4", intermediate_size=40)
    with pytest.raises(ValueError, match=r"quant must be one of \('none', 'fp8_per_token', 'fp8_block', 'mxfp4', "
                                         r"'int4'\)"):
        GPT_OSS.replace(quant="nvfp4")
    GPT_OSS.replace(quant="fp8_per_token", hidden_size=48)  # FP8 per-token: any H


def _framework_calls(framework: str):
    """``(conv, calls, dtypes)``: the framework's array constructor and its moe_forward / ep_moe_forward (1 rank)."""
    if framework == "torch":
        import torch

        import moe_torch
        from moe_torch.ep import ep_moe_forward

        return torch.from_numpy, [lambda *a, **kw: moe_torch.moe_forward(*a, **kw),
                                  lambda *a, **kw: ep_moe_forward(*a, **kw)], torch
    import jax.numpy as jnp

    import moe_pallas
    from moe_pallas.ep import ep_moe_forward, make_ep_mesh

    return jnp.asarray, [lambda *a, **kw: moe_pallas.moe_forward(*a, **kw),
                         lambda *a, **kw: ep_moe_forward(*a, mesh=make_ep_mesh(1), **kw)], jnp


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_layer_input_errors(framework):
    """Missing / unexpected / misshapen / mistyped expert biases, float weights for a 4-bit layer, a missing or
    mistyped 4-bit scale: the same words from ``moe_forward`` and ``ep_moe_forward``."""
    conv, calls, lib = _framework_calls(framework)
    inputs = make_inputs(GPT_OSS, T=3)
    x, lg, w13, w2, b13, b2 = (conv(inputs[n]) for n in ("x", "router_logits", *WEIGHT_NAMES))
    bf16 = lib.bfloat16
    for call in calls:
        with pytest.raises(ValueError, match=r"w13_bias \[E_local, 2\*I\] = \(4, 64\) \(this rank's experts\) must be "
                                             r"given for config.expert_bias=True \(gpt-oss's gate_up_proj_bias\); "
                                             r"got None"):
            call(x, lg, w13, w2, GPT_OSS)
        with pytest.raises(ValueError, match=r"w2_bias \[E_local, H\] = \(4, 64\) .* must be given"):
            call(x, lg, w13, w2, GPT_OSS, w13_bias=b13)
        with pytest.raises(ValueError, match=r"w13_bias must be None unless config.expert_bias=True"):
            call(x, lg, w13, w2, GPT_OSS.replace(expert_bias=False), w13_bias=b13)
        with pytest.raises(ValueError, match=r"w2_bias must be \[E_local, H\] = \(4, 64\) .* got w2_bias.shape=\(4, 32\)"):
            call(x, lg, w13, w2, GPT_OSS, w13_bias=b13, w2_bias=b2[:, :32])
        with pytest.raises(TypeError, match=r"w13_bias must have dtype float32 or bfloat16; got w13_bias.dtype=int32"):
            call(x, lg, w13, w2, GPT_OSS, w13_bias=conv(inputs["w13_bias"].astype(np.int32)), w2_bias=b2)
        mx = GPT_OSS.replace(quant="mxfp4")
        with pytest.raises(ValueError, match=r"w13 must be \[E_local, 2\*I, H // 2\] = \(4, 64, 32\) uint8 \(mxfp4 "
                                             r"packed codes.* got w13.shape=\(4, 64, 64\)"):
            call(x, lg, w13, w2, mx, w13_bias=b13, w2_bias=b2)
        q13, q2 = conv(np.zeros((4, 2 * I, H // 2), np.uint8)), conv(np.zeros((4, H, I // 2), np.uint8))
        s13, s2 = conv(np.zeros((4, 2 * I, H // 32), np.uint8)), conv(np.zeros((4, H, I // 32), np.uint8))
        with pytest.raises(ValueError, match=r"w2_scale \[E_local, H, I // 32\] = \(4, 64, 1\) uint8 .* must be given "
                                             r"for quant='mxfp4'; got None"):
            call(x, lg, q13, q2, mx, w13_scale=s13, w13_bias=b13, w2_bias=b2)
        with pytest.raises(TypeError, match=r"w13_scale must have dtype bfloat16; got w13_scale.dtype=uint8"):
            call(x, lg, q13, q2, GPT_OSS.replace(quant="int4"), w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2)
        with pytest.raises(TypeError, match=r"w13_bias must have dtype float32 or bfloat16"):  # float16 with f32 x
            call(x, lg, q13, q2, mx, w13_scale=s13, w2_scale=s2, w13_bias=b13.astype(lib.float16) if
                 framework == "jax" else b13.half(), w2_bias=b2)
    xb = x.astype(bf16) if framework == "jax" else x.bfloat16()
    out = calls[0](xb, lg, q13, q2, mx, w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2)  # bf16 x, f32 biases
    assert out.dtype == bf16 and out.shape == (3, H)


def test_jax_mosaic_has_no_4bit_layer():
    """JAX's ``implementation="pallas_mosaic_gpu"`` has no 4-bit GEMM: NotImplementedError before anything runs
    (``moe_forward``, ``ep_moe_forward``, ``MoELayer``), naming the way out."""
    import jax.numpy as jnp

    import moe_pallas
    from moe_pallas.ep import ep_moe_forward, make_ep_mesh

    config = CONFIGS["mxfp4"]
    inputs = make_inputs(config, T=3)
    codes, _ = quantize("jax", config, inputs)
    args = (jnp.asarray(inputs["x"]), jnp.asarray(inputs["router_logits"]), codes["w13"], codes["w2"], config)
    kw = dict(w13_scale=codes["w13_scale"], w2_scale=codes["w2_scale"], w13_bias=jnp.asarray(inputs["w13_bias"]),
              w2_bias=jnp.asarray(inputs["w2_bias"]), implementation="pallas_mosaic_gpu")
    match = r"implementation='pallas_mosaic_gpu' has no 4-bit weight GEMM \(quant='mxfp4'\); use .*'pallas_triton'"
    with pytest.raises(NotImplementedError, match="moe_forward: " + match):
        moe_pallas.moe_forward(*args, **kw)
    with pytest.raises(NotImplementedError, match="ep_moe_forward: " + match):
        ep_moe_forward(*args, mesh=make_ep_mesh(1), **kw)
    with pytest.raises(NotImplementedError, match="MoELayer: " + match):
        moe_pallas.MoELayer(config, codes["w13"], codes["w2"], **kw)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_module_bias_errors(framework):
    if framework == "torch":
        import torch

        import moe_torch

        conv, cls = torch.from_numpy, moe_torch.EPMoE
    else:
        import jax.numpy as jnp

        import moe_pallas

        conv, cls = jnp.asarray, moe_pallas.MoELayer
    inputs = make_inputs(GPT_OSS, T=3)
    w13, w2, b13, b2 = (conv(inputs[n]) for n in WEIGHT_NAMES)
    with pytest.raises(ValueError, match=r"from_float: w13_bias \[E \+ S, 2\*I\] = \(4, 64\) \(every expert of the "
                                         r"layer\) must be given for config.expert_bias=True; got None"):
        cls.from_float(GPT_OSS, w13, w2)
    with pytest.raises(ValueError, match=r"from_float: w2_bias must be None unless config.expert_bias=True"):
        cls.from_float(GPT_OSS.replace(expert_bias=False), w13, w2, w2_bias=b2)
    with pytest.raises(ValueError, match=r"from_float: w2_bias must be \[E \+ S, H\] = \(4, 64\) .* got "
                                         r"w2_bias.shape=\(3, 64\)"):
        cls.from_float(GPT_OSS, w13, w2, w13_bias=b13, w2_bias=b2[:3])
    with pytest.raises(ValueError, match=r"w13_bias \[E_local, 2\*I\] = \(4, 64\) .* must be given"):
        cls(GPT_OSS, w13, w2)


def test_gpt_oss_preset_layer_refuses_missing_biases():
    """Regression: gpt-oss's preset used to compute the layer without its expert biases (a silently other
    layer); its config now sets ``expert_bias`` and ``moe_forward`` without the biases is a ValueError."""
    import torch

    import moe_torch
    from moe_contract.presets import get_preset

    config = get_preset("gpt-oss-20b").config(hidden_size=H, intermediate_size=I, num_experts=E)
    assert config.expert_bias is True
    inputs = make_inputs(config, T=2)
    with pytest.raises(ValueError, match=r"w13_bias .* must be given for config.expert_bias=True"):
        moe_torch.moe_forward(*(torch.from_numpy(inputs[n]) for n in ("x", "router_logits", "w13", "w2")), config)


# --------------------------------------------------------------------------------------------------
# EP, torch: 2 gloo processes; each rank compares its result with the single-device layer.

EP_WORLD = 2
#: (config name, T, all_to_all tokens per rank): T=1 leaves rank 0 without tokens under all_to_all.
EP_CASES = (("gpt_oss", 5, (3, 2)), ("mxfp4", 1, (0, 1)))


def _torch_ep_worker(rank: int, world: int, init_method: str, out_path: str):
    import torch
    import torch.distributed as dist

    import moe_torch
    from moe_torch.ep import ep_moe_forward

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    results = {}
    try:
        for name, T, shards in EP_CASES:
            config1 = CONFIGS[name]
            inputs = make_inputs(config1, T=T, seed=11)
            codes = None
            if config1.quant != "none":
                codes, _ = quantize("torch", config1, inputs)
            ref_out, ref = torch_layer(config1, inputs, "reference", codes=codes, device="cpu")  # gloo: the CPU
            cfg = config1.replace(ep_size=world, ep_rank=rank)
            start, n = cfg.local_expert_range()
            for mode in ("replicated", "all_to_all"):
                lo, hi = (sum(shards[:rank]), sum(shards[:rank + 1])) if mode == "all_to_all" else (0, T)
                leaves = {k: torch.from_numpy(inputs[k][lo:hi]).requires_grad_() for k in ("x", "router_logits")}
                if codes is None:
                    w = {k: moe_torch.local_weights(torch.from_numpy(inputs[k]), cfg).clone().requires_grad_()
                         for k in WEIGHT_NAMES}
                else:
                    w = {k: moe_torch.local_weights(v, cfg) for k, v in codes.items()}
                    w.update({k: moe_torch.local_weights(torch.from_numpy(inputs[k]), cfg).clone().requires_grad_()
                              for k in ("w13_bias", "w2_bias")})
                out = ep_moe_forward(leaves["x"], leaves["router_logits"], w["w13"], w["w2"], cfg, mode=mode,
                                     w13_scale=w.get("w13_scale"), w2_scale=w.get("w2_scale"),
                                     w13_bias=w["w13_bias"], w2_bias=w["w2_bias"],
                                     implementation="reference", recompute=mode == "all_to_all")
                out.backward(torch.from_numpy(inputs["d_out"][lo:hi]))
                errs = {"out": rel_fro(out, ref_out[lo:hi]) if hi > lo else float(out.shape != (0, H))}
                for k, leaf in leaves.items():
                    if leaf.grad is None:  # no gradient reached it: an error (every rank's inputs get one)
                        errs[k] = float("inf")
                    else:
                        errs[k] = rel_fro(leaf.grad, ref[k][lo:hi]) if hi > lo else 0.0
                for k in ref:
                    if k in ("x", "router_logits"):
                        continue
                    want = ref[k][start:start + n]
                    errs[k] = rel_fro(w[k].grad, want) if want.any() else float(w[k].grad.abs().sum())
                results[f"{name}-T{T}-{mode}"] = errs
        gather_to_file(results, rank, world, out_path)
    finally:
        dist.destroy_process_group()


def test_torch_ep_two_ranks_equal_single_device(tmp_path):
    """``moe_torch.ep.ep_moe_forward`` on 2 gloo ranks, both modes (all_to_all with ``recompute``), float weights
    with biases and MXFP4 codes (T=1: a rank without tokens): each rank's output rows and the gradients of its
    x / router_logits rows (replicated: every rank the whole, summed over ranks) and of its slice of the weights and
    biases equal the single-device layer's."""
    out_path = tmp_path / "ep.json"
    results = spawn_ranks(_torch_ep_worker, EP_WORLD, (str(out_path),), out_path)
    assert len(results) == EP_WORLD and len(results[0]) == 2 * len(EP_CASES)
    for rank, mine in enumerate(results):
        for case, errs in mine.items():
            assert {"w13_bias", "w2_bias"} <= set(errs), (case, sorted(errs))
            bad = {k: v for k, v in errs.items() if not (np.isfinite(v) and v <= GRAD_F32_REL_FRO)}
            assert not bad, f"rank {rank} {case}: {bad}"


# --------------------------------------------------------------------------------------------------
# EP, JAX: 2 forced host devices, in a child process (the parent's jax already started with one device).

#: (config name, T, mode): T=5 pads the token split of all_to_all; T=1 leaves a device without tokens.
JAX_EP_CASES = (("gpt_oss", 5, "all_to_all"), ("mxfp4", 1, "replicated"))


def _jax_ep_child() -> None:
    import jax
    import jax.numpy as jnp

    from moe_pallas.ep import ep_moe_forward, make_ep_mesh

    mesh = make_ep_mesh(2)
    results = {}
    for name, T, mode in JAX_EP_CASES:
        config1 = CONFIGS[name]
        inputs = make_inputs(config1, T=T, seed=12)
        codes = None
        if config1.quant != "none":
            codes, _ = quantize("jax", config1, inputs)
        ref_out, ref = jax_layer(config1, inputs, "reference", codes=codes, jit=True)
        cfg = config1.replace(ep_size=2)
        names = list(ref)
        args = {n: jnp.asarray(inputs[n]) for n in names}
        fixed = codes or {}

        def f(a, cfg=cfg, mode=mode, fixed=fixed):
            w = dict(a, **fixed)
            return ep_moe_forward(a["x"], a["router_logits"], w["w13"], w["w2"], cfg, mesh=mesh, mode=mode,
                                  w13_scale=w.get("w13_scale"), w2_scale=w.get("w2_scale"), w13_bias=a["w13_bias"],
                                  w2_bias=a["w2_bias"], implementation="reference", recompute=mode == "replicated")

        out, vjp = jax.vjp(jax.jit(f), args)
        (g,) = vjp(jnp.asarray(inputs["d_out"]))
        errs = {"out": rel_fro(out, ref_out)}
        errs.update({n: rel_fro(g[n], ref[n]) for n in names})
        results[f"{name}-T{T}-{mode}"] = errs
    print(json.dumps(results))


def test_jax_ep_two_devices_equal_single_device():
    """``moe_pallas.ep.ep_moe_forward`` on 2 host devices, both modes (replicated with ``recompute``;
    :data:`JAX_EP_CASES`: float weights in all_to_all, MXFP4 codes replicated, biases in both): output and every
    gradient (the biases' in the global ``[E, N]`` layout) equal the single-device layer's."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "--jax-ep-child"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results) == len(JAX_EP_CASES)
    for case, errs in results.items():
        assert {"w13_bias", "w2_bias"} <= set(errs), (case, sorted(errs))
        bad = {k: v for k, v in errs.items() if not (np.isfinite(v) and v <= GRAD_F32_REL_FRO)}
        assert not bad, f"{case}: {bad}"


if __name__ == "__main__" and sys.argv[1:] == ["--jax-ep-child"]:
    _jax_ep_child()
