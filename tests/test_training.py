"""Training through the modules and the examples.

- ``examples/train_moe_torch.py`` / ``examples/train_moe_jax.py`` (the same tiny 2-layer DeepSeek-style MoE
  language model in both frameworks, from the same numpy bits, ``examples/tiny_moe_lm.py``) trained a few
  AdamW steps: the loss curve with the kernels (Triton, Pallas-Triton; interpreted on the CPU) equals the
  reference path's, and torch's equals JAX's, within float32 rounding (``CURVE_RTOL``: one float32 program
  against another in another summation order; measured 1.2e-7 kernels vs reference, 4e-7 torch vs JAX over
  the 3 steps, 6e-6 over 12 steps of the default-size model), and the kernel-trained weights equal the
  reference-trained ones (measured 1.8e-7).
- ``EPMoE`` / ``MoELayer`` train by default (``trainable=True``): AdamW / ``optax.adamw`` over the model's
  parameters change the experts and lower the loss (the regression: ``EPMoE`` weights were
  ``requires_grad=False``, so an optimizer over ``model.parameters()`` never updated the experts).
- FP8 layers: forward in FP8, backward straight-through (CONTRACT.md section 8): the other parameters
  train and the codes stay bit-identical (buffers / ``FrozenWeight``); torch's and JAX's gradients agree
  within the bf16 bound and each is the float layer's on the dequantized weights within the FP8 bound
  (before the layer's backward, autodiff through the FP8 reference was 1.13 (JAX) and 0.22 (torch) off).
- ``EPMoE`` with a process group trains too (``ep_moe_forward``'s backward), and ``trainable`` / ``recompute``
  are module options.
- The silent drop: a path without a backward (the stages with fused FP8 quantization) raises when asked
  for a gradient, in both frameworks, reference and kernels.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import moe_pallas
import moe_pallas.module
import moe_torch
from common import TORCH_DEVICE
from jax_dots import assert_float32_dots_highest
from moe_contract import MoEConfig, make_layer_inputs
from moe_pallas.module import FrozenWeight
from tolerances import FP8_REL_FRO, GRAD_BF16_REL_FRO, assert_exact, assert_rel_fro, rel_fro, to_numpy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root: examples/
from examples import train_moe_jax, train_moe_torch  # noqa: E402
from examples.tiny_moe_lm import lm_config, synthetic_batch  # noqa: E402

#: Loss curves of two float32 programs (another summation order, the same routing): relative difference.
CURVE_RTOL = 1e-5
#: Weights after a few AdamW steps, kernels vs reference: float32 rounding, amplified a little by Adam's
#: normalization of each step (m / sqrt(v) of near-zero gradients).
WEIGHT_REL_FRO = 1e-5
STEPS = 3
#: The examples' 2-layer DeepSeek-style model (sigmoid + bias, groups, rsf 2.5, a shared expert) at test size.
CFG = lm_config("deepseek", hidden_size=32, intermediate_size=32, vocab_size=32, seq_len=8, batch_size=2, num_heads=2)
IMPLS = {"torch": ("reference", "triton"), "jax": ("reference", "pallas_triton")}


@functools.cache
def _trained(framework: str, implementation: str):
    """``(losses, model)`` after ``STEPS`` steps of the framework's example on ``CFG`` (cached: two tests read it)."""
    if framework == "torch":
        model = train_moe_torch.TinyMoELM(CFG, implementation=implementation, device=TORCH_DEVICE)
        return train_moe_torch.train(CFG, STEPS, model=model, device=TORCH_DEVICE), model
    model = train_moe_jax.TinyMoELM(CFG, implementation=implementation)
    return train_moe_jax.train(CFG, STEPS, model=model), model


def _weights(framework: str, model) -> dict[str, np.ndarray]:
    if framework == "torch":
        return {n: to_numpy(p) for n, p in model.named_parameters()}
    return {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _fixed_batch_steps(framework: str, model, steps: int) -> list[float]:
    """``steps`` AdamW steps on batch 0 (one batch again and again: its loss must fall)."""
    batch = synthetic_batch(CFG, 0)
    if framework == "torch":
        opt = train_moe_torch.make_optimizer(model, model.cfg)
        losses = []
        for _ in range(steps):
            loss = model.loss(torch.from_numpy(batch).to(TORCH_DEVICE))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for name, p in model.named_parameters():  # no silently missing gradient anywhere
                assert p.grad is not None and p.grad.abs().max() > 0, f"{name} got no gradient"
            opt.step()
            losses.append(loss.item())
        return losses
    opt = train_moe_jax.make_optimizer(model, model.cfg)
    return [float(train_moe_jax.train_step(model, opt, jnp.asarray(batch))) for _ in range(steps)]


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_default_modules_train_experts_with_adamw(framework):  # before the kernel test: it compiles the
    # reference train step the kernel test's reference run then reuses (nnx.jit keeps the latest program)
    """Regression: ``EPMoE`` held its float weights as ``requires_grad=False`` parameters, so
    ``torch.optim.AdamW(model.parameters())`` never updated the experts. Expected (both frameworks, default
    ``trainable=True``): the expert weights are optimizer parameters, every parameter gets a gradient, the
    experts move, and the loss on a batch falls over a few steps on it."""
    if framework == "torch":
        model = train_moe_torch.TinyMoELM(CFG, implementation="reference", device=TORCH_DEVICE)
        moe = model.layers[0].moe
        assert moe.trainable and moe.w13.requires_grad and moe.w2.requires_grad
        assert any(p is moe.w13 for p in model.parameters())
        before = moe.w13.detach().clone()
        after = lambda: moe.w13
    else:
        model = train_moe_jax.TinyMoELM(CFG, implementation="reference")
        moe = model.layers[0].moe
        assert moe.trainable and isinstance(moe.w13, nnx.Param) and isinstance(moe.w2, nnx.Param)
        before = np.asarray(moe.w13[...])
        after = lambda: moe.w13[...]
    losses = _fixed_batch_steps(framework, model, 5)
    assert losses[-1] < 0.9 * losses[0], losses
    assert rel_fro(after(), before) > 1e-3, "the experts did not move"


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_kernel_training_loss_curve_equals_reference(framework):
    """A few AdamW steps of the example model with the Triton (torch) / Pallas-Triton (JAX) kernels, interpreted
    here: forward and backward kernels in every step; the loss curve and the trained weights (experts,
    router, attention, embeddings) equal the reference path's."""
    ref_impl, kernel_impl = IMPLS[framework]
    ref_losses, ref_model = _trained(framework, ref_impl)
    losses, model = _trained(framework, kernel_impl)
    np.testing.assert_allclose(losses, ref_losses, rtol=CURVE_RTOL, err_msg=f"{framework} {kernel_impl} loss curve")
    want, got = _weights(framework, ref_model), _weights(framework, model)
    assert set(got) == set(want) and any("w13" in n for n in got)
    init = _weights(framework, {"torch": train_moe_torch, "jax": train_moe_jax}[framework].TinyMoELM(CFG))
    for name, w in want.items():
        assert not np.array_equal(w, init[name]), f"{framework}: {name} was not trained"
        assert_rel_fro(got[name], w, WEIGHT_REL_FRO, f"{framework} {kernel_impl} {name} after {STEPS} steps")


def test_torch_and_jax_training_loss_curves_agree():
    """The same model, bits and batches in both frameworks (reference paths): the same loss curve."""
    torch_losses, _ = _trained("torch", "reference")
    jax_losses, _ = _trained("jax", "reference")
    assert torch_losses[0] == pytest.approx(jax_losses[0], rel=1e-6)  # step 0: the same initial weights
    np.testing.assert_allclose(torch_losses, jax_losses, rtol=CURVE_RTOL, err_msg="torch vs JAX loss curve")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_example_float32_matmuls_at_highest_precision(dtype):
    """Regression (H200): ``train_moe_jax``'s float32 matmuls used the default precision, TF32-like on the
    GPU: its step-0 loss was 1.3e-5 from torch's (4.02764 vs 4.02759) and the Pallas-Triton run 1.2e-4 from
    the reference one after 3 steps. Every float32 dot of a training step (forward and gradient) asks for
    ``Precision.HIGHEST``; with ``dtype=bfloat16`` the bf16 projections keep the default."""
    model = train_moe_jax.TinyMoELM(CFG, dtype=getattr(jnp, dtype))
    batch = jnp.asarray(synthetic_batch(CFG, 0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = lambda p: nnx.merge(graphdef, p, rest).loss(batch)
    dots = assert_float32_dots_highest(jax.value_and_grad(loss), params, at_least=15)
    if dtype == "bfloat16":
        assert sum(d == ("bfloat16", "bfloat16", None) for d in dots) >= 8, dots


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_fp8_layers_train_the_rest_and_keep_codes_bit_identical(framework):
    """FP8 experts (``fp8_per_token``): codes and scales are buffers (torch) / ``FrozenWeight`` (JAX), outside
    the optimizer, bit-identical after AdamW steps; the backward is straight-through, so the router, attention
    and embeddings train and the loss on a batch falls."""
    cfg = lm_config("deepseek", "fp8_per_token", hidden_size=32, intermediate_size=32, vocab_size=32, seq_len=8,
                    batch_size=2, num_heads=2)
    names = ("w13", "w2", "w13_scale", "w2_scale", "e_score_correction_bias")
    if framework == "torch":
        model = train_moe_torch.TinyMoELM(cfg, implementation="reference", device=TORCH_DEVICE)
        moe = model.layers[0].moe
        assert not moe.trainable and not any(n.endswith(names) for n, _ in model.named_parameters())
        frozen = {n: getattr(moe, n).detach().clone() for n in names}
        router, embed = model.layers[0].router.detach().clone(), model.embed.detach().clone()
        now = lambda: ({n: getattr(moe, n) for n in names}, model.layers[0].router, model.embed)
    else:
        model = train_moe_jax.TinyMoELM(cfg, implementation="reference")
        moe = model.layers[0].moe
        assert not moe.trainable and all(isinstance(getattr(moe, n), FrozenWeight) for n in names)
        frozen = {n: np.asarray(getattr(moe, n)[...]) for n in names}
        router, embed = np.asarray(model.layers[0].router[...]), np.asarray(model.embed[...])
        now = lambda: ({n: getattr(moe, n)[...] for n in names}, model.layers[0].router[...], model.embed[...])
    assert to_numpy(frozen["w13"]).dtype.itemsize == 1  # FP8 codes
    losses = _fixed_batch_steps(framework, model, 4)
    assert losses[-1] < losses[0], losses
    codes, router_now, embed_now = now()
    for n in names:
        assert_exact(codes[n], frozen[n], f"{framework} {n} after training")
    assert rel_fro(router_now, router) > 1e-4 and rel_fro(embed_now, embed) > 1e-4


#: A DeepSeek-style layer with FP8-block-sized H and I (multiples of 128), small E.
FP8_LAYER = MoEConfig(hidden_size=128, intermediate_size=128, num_experts=8, topk=2, routing="biased_grouped_topk",
                      num_expert_group=4, topk_group=2, renormalize=True, routed_scaling_factor=2.5,
                      num_fused_shared_experts=1)


def _fp8_layer_grads(framework: str, quant: str, float_layer: bool):
    """``(d_x, d_router_logits)`` float32 of the bf16 module (``EPMoE`` / ``MoELayer.from_float``) with ``quant``
    experts or, ``float_layer``, the float module on those experts' dequantized weights (rounded to bf16); the
    same inputs, weights and ``d_out`` in both frameworks."""
    config = FP8_LAYER.replace(quant=quant)
    inp = make_layer_inputs(config, num_tokens=8, seed=0)
    d_out = np.random.default_rng(50).standard_normal((8, config.hidden_size)).astype(np.float32)
    if framework == "torch":
        t = lambda a, dt=torch.bfloat16: torch.tensor(a, device=TORCH_DEVICE).to(dt)
        layer = moe_torch.EPMoE.from_float(config, t(inp.w13), t(inp.w2), implementation="reference",
                                           e_score_correction_bias=t(inp.e_score_correction_bias, torch.float32))
        if float_layer:
            w13 = moe_torch.dequantize_weight_fp8(layer.w13, layer.w13_scale).to(torch.bfloat16)
            w2 = moe_torch.dequantize_weight_fp8(layer.w2, layer.w2_scale).to(torch.bfloat16)
            layer = moe_torch.EPMoE(config.replace(quant="none"), w13, w2, implementation="reference",
                                    e_score_correction_bias=layer.e_score_correction_bias)
        x, logits = t(inp.x).requires_grad_(), t(inp.router_logits, torch.float32).requires_grad_()
        layer(x, logits).backward(t(d_out))
        return to_numpy(x.grad).astype(np.float32), to_numpy(logits.grad)
    j = lambda a, dt=jnp.bfloat16: jnp.asarray(a).astype(dt)
    layer = moe_pallas.MoELayer.from_float(config, j(inp.w13), j(inp.w2), implementation="reference",
                                           e_score_correction_bias=j(inp.e_score_correction_bias, jnp.float32))
    if float_layer:
        w13 = moe_pallas.dequantize_weight_fp8(layer.w13[...], layer.w13_scale[...]).astype(jnp.bfloat16)
        w2 = moe_pallas.dequantize_weight_fp8(layer.w2[...], layer.w2_scale[...]).astype(jnp.bfloat16)
        layer = moe_pallas.MoELayer(config.replace(quant="none"), w13, w2, implementation="reference",
                                    e_score_correction_bias=layer.e_score_correction_bias[...])

    @nnx.jit
    def grads(layer, x, logits, d_out):
        return jax.vjp(lambda a, b: layer(a, b), x, logits)[1](d_out)

    d_x, d_logits = grads(layer, j(inp.x), j(inp.router_logits, jnp.float32), j(d_out))
    return np.asarray(d_x).astype(np.float32), np.asarray(d_logits)


@pytest.mark.parametrize("quant", ["fp8_per_token", "fp8_block"])
def test_fp8_layer_gradients_straight_through_and_equal_across_frameworks(quant):
    """CONTRACT.md section 8 for FP8 modules, both frameworks. Regression: autodiff through the FP8
    reference gave gradients 1.13 (JAX) and 0.22 (torch) relative from the float layer's. Expected: torch and
    JAX agree within the bf16 gradient bound (the same straight-through backward on the same FP8 codes:
    measured 0 to 3.5e-4); each is the float layer on the dequantized weights within the FP8 bounds of
    tests/test_layer_backward.py (``d_x``: two FP8 errors, ``2 * FP8_REL_FRO``, measured 2.7e-2..2.9e-2;
    ``d_router_logits`` through ``<y, d_out>``: three, measured 2.3e-2..5.5e-2 over five seeds)."""
    got = {fw: _fp8_layer_grads(fw, quant, float_layer=False) for fw in ("torch", "jax")}
    for i, name in enumerate(("d_x", "d_router_logits")):
        assert_rel_fro(got["jax"][i], got["torch"][i], GRAD_BF16_REL_FRO, f"{quant} {name}: JAX vs torch")
    for fw in ("torch", "jax"):
        flt = _fp8_layer_grads(fw, quant, float_layer=True)
        assert_rel_fro(got[fw][0], flt[0], 2 * FP8_REL_FRO, f"{fw} {quant} d_x vs the float layer")
        assert_rel_fro(got[fw][1], flt[1], 3 * FP8_REL_FRO, f"{fw} {quant} d_router_logits vs the float layer")


def test_module_options_trainable_and_recompute(monkeypatch):
    """``trainable=False`` freezes float weights (``requires_grad=False`` / ``FrozenWeight``); ``recompute`` reaches
    ``moe_forward`` (torch: bit-identical gradients either way, only what is kept differs; the function-level
    gradients of both frameworks: tests/test_layer_backward.py); both options are checked bools."""
    config = FP8_LAYER.replace(hidden_size=32, intermediate_size=16)
    inp = make_layer_inputs(config, num_tokens=5, seed=3)
    tw = lambda: dict(w13=torch.tensor(inp.w13, device=TORCH_DEVICE), w2=torch.tensor(inp.w2, device=TORCH_DEVICE),
                      e_score_correction_bias=torch.tensor(inp.e_score_correction_bias, device=TORCH_DEVICE))
    jw = dict(w13=jnp.asarray(inp.w13), w2=jnp.asarray(inp.w2),
              e_score_correction_bias=jnp.asarray(inp.e_score_correction_bias))
    t = moe_torch.EPMoE.from_float(config, **tw(), trainable=False)
    assert not t.trainable and not t.w13.requires_grad and [n for n, _ in t.named_parameters()] == ["w13", "w2"]
    j = moe_pallas.MoELayer.from_float(config, **jw, trainable=False)
    assert not j.trainable and isinstance(j.w13, FrozenWeight)
    assert not nnx.state(j, nnx.Param)  # nothing for nnx.grad / an optimizer
    grads, seen = {}, []
    real = moe_pallas.module.moe_forward
    spy = lambda *a, **kw: seen.append(kw["recompute"]) or real(*a, **kw)
    monkeypatch.setattr(moe_pallas.module, "moe_forward", spy)
    for recompute in (False, True):
        layer = moe_torch.EPMoE.from_float(config, **tw(), recompute=recompute)
        x = torch.tensor(inp.x, device=TORCH_DEVICE, requires_grad=True)
        layer(x, torch.tensor(inp.router_logits, device=TORCH_DEVICE)).square().sum().backward()
        grads[recompute] = [x.grad, layer.w13.grad, layer.w2.grad]
        nnx_layer = moe_pallas.MoELayer.from_float(config, **jw, recompute=recompute)
        nnx_layer(jnp.asarray(inp.x), jnp.asarray(inp.router_logits))
    assert seen == [False, True]
    for a, b in zip(grads[False], grads[True]):
        assert_exact(a, b, "recompute=True vs False")
    for make, kw in ((moe_torch.EPMoE.from_float, tw()), (moe_pallas.MoELayer.from_float, jw)):
        for opt in ("trainable", "recompute"):
            with pytest.raises(TypeError, match=rf"{opt} must be a bool; got {opt}='yes'"):
                make(config, **kw, **{opt: "yes"})


def test_epmoe_expert_parallel_path_trains(tmp_path):
    """``EPMoE`` with a process group (gloo, one rank here) trains through ``ep_moe_forward``'s backward, both
    modes: ``x``, ``router_logits`` and expert gradients equal the single-device module's (the EP backward
    itself, over several ranks: tests/test_ep_torch.py)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    config = FP8_LAYER.replace(hidden_size=32, intermediate_size=16)
    inp = make_layer_inputs(config, num_tokens=6, seed=4)

    def grads(create_graph=False, **kw):
        layer = moe_torch.EPMoE.from_float(config, torch.tensor(inp.w13), torch.tensor(inp.w2),
                                           e_score_correction_bias=torch.tensor(inp.e_score_correction_bias),
                                           implementation="reference", **kw)
        x, logits = torch.tensor(inp.x, requires_grad=True), torch.tensor(inp.router_logits, requires_grad=True)
        layer(x, logits).square().sum().backward(create_graph=create_graph)
        return [x.grad, logits.grad, layer.w13.grad, layer.w2.grad]

    single = grads()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        for mode in ("replicated", "all_to_all"):
            got = grads(ep_mode=mode, recompute=True)
            for name, g, w in zip(("d_x", "d_router_logits", "d_w13", "d_w2"), got, single):
                assert g is not None, f"{mode}: {name} missing"
                assert_rel_fro(g, w, 1e-6, f"EPMoE ep_mode={mode} {name}")
            # second order: refused, named, by the first backward that runs (a collective, the combine, the experts)
            with pytest.raises(RuntimeError, match=r"^(ep_moe_forward|routed_experts|combine): second-order gradients"):
                grads(create_graph=True, ep_mode=mode)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("stage", ["permute", "act_and_mul"])
def test_paths_without_a_backward_raise_when_asked(stage, framework):
    """The silent-drop rule: a path with no backward raises when a gradient is asked for, never
    returns a missing or wrong one. The stages with fused FP8 quantization have none (FP8 codes are not
    differentiable; the layer goes straight-through around them); asked through autograd / ``jax.grad``
    they raise, naming the stage, on the reference and kernel paths alike."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 32)).astype(np.float32)
    dst2src = np.arange(8, dtype=np.int32)
    if framework == "torch":
        mod, impls = moe_torch, ("reference", "triton")
        arg = lambda: torch.tensor(a, device=TORCH_DEVICE, requires_grad=True)
        idx = torch.tensor(dst2src, device=TORCH_DEVICE)
    else:
        mod, impls = moe_pallas, ("reference", "pallas_triton")
        arg, idx = lambda: jnp.asarray(a), jnp.asarray(dst2src)
    call = {"permute": lambda v, impl: mod.permute(v, idx, topk=1, quant="fp8_per_token", implementation=impl)[0],
            "act_and_mul": lambda v, impl: mod.act_and_mul(v, quant="fp8_per_token", implementation=impl)[0]}[stage]
    what = {"permute": "permute", "act_and_mul": "silu_and_mul"}[stage]
    for impl in impls:
        with pytest.raises((ValueError, NotImplementedError), match=rf"{what}: no gradient through quant="):
            if framework == "torch":
                call(arg(), impl).float().sum().backward()
            else:
                jax.grad(lambda v: call(v, impl).astype(jnp.float32).sum())(arg())


#: A small float layer for the second-order checks (sigmoid routing with a bias: every gate input in play).
SECOND_ORDER_LAYER = MoEConfig(hidden_size=16, intermediate_size=8, num_experts=4, topk=2, routing="biased_grouped_topk",
                               num_expert_group=2, topk_group=1, renormalize=True, routed_scaling_factor=2.5)
SECOND_ORDER = r"second-order gradients \(create_graph=True / double backward\) are not supported"


def test_create_graph_refused_torch():
    """``torch.autograd.grad(..., create_graph=True)`` through the layer raises naming the op (the regression: the
    layer's backward ran with grad mode on and returned a gradient with no graph, so a gradient penalty silently
    lost the MoE's second-order terms). ``moe_forward`` (reference and Triton), ``EPMoE`` and a stage op alone;
    the first-order gradient is unchanged (a ``create_graph=False`` call after the refused one)."""
    config = SECOND_ORDER_LAYER
    inp = make_layer_inputs(config, num_tokens=3, seed=2)
    t = lambda a, grad=True: torch.tensor(a, device=TORCH_DEVICE, requires_grad=grad)
    x, logits, w13, w2 = t(inp.x), t(inp.router_logits), t(inp.w13), t(inp.w2)
    bias = t(inp.e_score_correction_bias, grad=False)
    for impl in IMPLS["torch"]:
        loss = lambda: moe_torch.moe_forward(x, logits, w13, w2, config, e_score_correction_bias=bias,  # noqa: E731
                                             implementation=impl).square().sum()
        with pytest.raises(RuntimeError, match=rf"^moe_forward: {SECOND_ORDER}"):
            torch.autograd.grad(loss(), (x, logits, w13), create_graph=True)
        d_x, d_logits, d_w13 = torch.autograd.grad(loss(), (x, logits, w13))
        assert d_x.grad_fn is None and torch.isfinite(d_logits).all() and d_w13.abs().sum() > 0
    layer = moe_torch.EPMoE.from_float(config, t(inp.w13, False), t(inp.w2, False), e_score_correction_bias=bias,
                                       implementation="reference")
    with pytest.raises(RuntimeError, match=rf"^moe_forward: {SECOND_ORDER}"):
        torch.autograd.grad(layer(x, logits).square().sum(), [x, *layer.parameters()], create_graph=True)
    weights, _ = moe_torch.select_experts(logits, topk=2)
    with pytest.raises(RuntimeError, match=rf"^select_experts: {SECOND_ORDER}"):
        torch.autograd.grad(weights.square().sum(), logits, create_graph=True)


def test_second_order_refused_jax():
    """``jax.grad(jax.grad(...))`` and ``jax.jacfwd(jax.grad(...))`` through the layer raise ``NotImplementedError``
    naming the op (the regression: JAX failed inside its internals, a ``while_loop`` reverse-mode error on the
    reference path and a bare ``AssertionError`` on Pallas-Triton, or with ``jacfwd`` a message naming no op);
    under ``jit`` too. The first-order gradient still runs (the same function, one level)."""
    config = SECOND_ORDER_LAYER
    inp = make_layer_inputs(config, num_tokens=3, seed=2)
    x, logits, w13, w2, bias = (jnp.asarray(a) for a in (inp.x, inp.router_logits, inp.w13, inp.w2,
                                                          inp.e_score_correction_bias))
    message = r"second-order gradients \(jax.grad of jax.grad, .*\) are not supported"
    for impl in IMPLS["jax"]:
        loss = lambda x, w13: jnp.square(moe_pallas.moe_forward(  # noqa: E731
            x, logits, w13, w2, config, e_score_correction_bias=bias, implementation=impl)).sum()
        grad_sum = lambda x: jax.grad(loss, argnums=(0, 1))(x, w13)[1].sum()  # noqa: E731
        second_orders = {"grad(grad)": jax.grad(grad_sum), "jacfwd(grad)": jax.jacfwd(jax.grad(lambda x: loss(x, w13))),
                         "jit(grad(grad))": jax.jit(jax.grad(grad_sum))}
        for name, second in second_orders.items():
            with pytest.raises(NotImplementedError, match=rf"^moe_forward: {message}"):
                second(x)
        assert np.isfinite(np.asarray(jax.grad(loss)(x, w13))).all()
    gate = lambda lg: jax.grad(lambda v: moe_pallas.select_experts(v, topk=2)[0].sum())(lg).sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match=rf"^select_experts: {message}"):
        jax.grad(gate)(logits)
