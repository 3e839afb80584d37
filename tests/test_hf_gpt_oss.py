"""gpt-oss in the Hugging Face drop-ins and the checkpoint loader: transformers 5.24's ``GptOssMLP`` served by
``moe_torch.patch_hf_model`` / ``HFMoEBlock`` / ``moe_torch.hf.block_layer_weights``, and gpt-oss safetensors
checkpoints (``model_type="gpt_oss"``; MXFP4 ``*_blocks`` / ``*_scales`` or float experts) read by
``interop.checkpoints.load_moe_layer``. Before this file ``GptOssMLP`` was refused by name and the loader refused
the model type: every test here fails on that code.

A tiny ``GptOssConfig`` (H=64, I=32, E=4, top-2: multiples of MXFP4's group of 32), every parameter re-drawn seeded
(weights ``N(0, 1/fan_in)``, router and expert biases ``N(0, 1/4)``), nothing downloaded. What is held (CONTRACT.md
sections 7 and 8, ``tests/tolerances.py``):

- the block (``HFMoEBlock``, reference and Triton kernels, interpreted): ``GptOssMLP``'s return signature
  ``(out [B, S, H], router_scores [T, topk])``, float32 output within 1e-5 and ``.backward()`` gradients of x, the
  router's weight and bias, both expert weights and both expert biases within 1e-5;
- a whole patched ``GptOssForCausalLM``: logits, router logits (the router module's hook), state_dict names and
  tensors (no copy), the loss and every parameter gradient; ``save_pretrained`` reloads unpatched bit-exactly;
- ``block_layer_weights(..., with_expert_biases=True)`` into ``EPMoE.from_float`` equals the block;
- the loader: a synthetic MXFP4 checkpoint (our ``quantize_weight_mxfp4`` codes written in gpt-oss's
  ``[E, N, K/32, 16]`` blocks) gives those codes and scales bit for bit, transformers' own
  ``convert_moe_packed_tensors`` of the file's blocks equals our dequantization (the orientation), and its layer
  (``quant="mxfp4"``) equals ``GptOssMLP`` holding the dequantized weights; a float checkpoint
  (``save_pretrained``) equals the block; each missing tensor and a wrong ``swiglu_limit`` are named;
- the router's bias (both refused before): ``interop.hf_jax.load_nnx_moe_block`` of both checkpoints
  (``MoEBlock.router_bias``) equals ``GptOssMLP``, output and ``nnx.grad``; the bias moves the routing (dropped, the
  experts chosen and the output differ); ``epmoe check --weights`` of both passes, its logits ``GptOssTopKRouter``'s
  (``LayerWeights.router_bias``); a bad ``router_bias`` is refused on the host.
"""

from __future__ import annotations

import copy
import json
import os
import re

import numpy as np
import pytest
import torch

import moe_torch
from common import TORCH_DEVICE
from moe_torch.hf import HFMoEBlock, block_layer_weights, patch_hf_model
from moe_torch.module import EPMoE
from tolerances import BF16_REL_FRO, F32_REL_FRO, GRAD_F32_REL_FRO, assert_exact, assert_rel_fro, rel_fro

transformers = pytest.importorskip("transformers")
from interop.checkpoints import load_moe_layer  # noqa: E402

H, I, E, TOPK = 64, 32, 4, 2
PRE = "model.layers.0.mlp"


def gpt_oss_config(**overrides):
    cfg = transformers.GptOssConfig(vocab_size=32, hidden_size=H, intermediate_size=I, num_local_experts=E,
                                    num_experts_per_tok=TOPK, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                                    layer_types=["full_attention"], **overrides)
    cfg._experts_implementation = "eager"
    cfg._attn_implementation = "eager"
    return cfg


def _redraw(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if p.ndim >= 2:  # in-by-out experts [E, K, N]: fan_in is dim 1; linears [N, K]: dim -1
                fan_in = p.shape[1] if name.endswith(("gate_up_proj", "down_proj")) else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(fan_in))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


def gpt_oss_block(seed: int = 0):
    """A tiny ``GptOssMLP`` (float32, eager experts), every parameter re-drawn."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    block = GptOssMLP(gpt_oss_config()).float()
    _redraw(block, seed)
    return block


def gpt_oss_model(seed: int = 0):
    """A tiny ``GptOssForCausalLM`` (one decoder layer, full attention), eval mode, every parameter re-drawn."""
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(gpt_oss_config()).float().eval()
    _redraw(model, seed)
    return model


def block_grads(block, x: torch.Tensor, d_out: torch.Tensor):
    """``.backward()`` of ``<block(x)[0], d_out>``: ``(what the block returns, {"x": d_x, <parameter>: grad})``."""
    x = x.clone().requires_grad_()
    y = block(x)
    (y[0] * d_out).sum().backward()
    grads = {"x": x.grad}
    grads.update({n: p.grad for n, p in block.named_parameters()})
    return y, grads


def _inputs(T: int = 7, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, H, generator=g), torch.randn(1, T, H, generator=g)


# ----------------------------------------------------------------------------------------------
# The block and the model
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["reference", "triton"])
def test_hf_block_outputs_and_gradients_equal_gpt_oss_mlp(implementation):
    block = gpt_oss_block().to(TORCH_DEVICE)
    ours = HFMoEBlock(copy.deepcopy(block), implementation=implementation)
    assert ours.replaces == "GptOssMLP" and list(ours.state_dict()) == list(block.state_dict())
    c = ours.moe_config
    assert (c.routing, c.renormalize, c.activation, c.gate_up_layout, c.expert_bias, c.topk) == (
        "softmax_topk", True, "swiglu_oai", "interleaved", True, TOPK)
    x, d_out = (t.to(TORCH_DEVICE) for t in _inputs())
    want_y, want = block_grads(block, x, d_out)
    got_y, got = block_grads(ours, x, d_out)
    # GptOssMLP returns (out [B, S, H], router_scores [B*S, topk]): the same tuple, the router's own scores
    assert isinstance(got_y, tuple) and len(got_y) == len(want_y) == 2
    assert got_y[0].shape == want_y[0].shape == x.shape and got_y[1].shape == want_y[1].shape == (7, TOPK)
    assert_exact(got_y[1], want_y[1], "router_scores")
    assert float(want_y[0].detach().abs().mean()) > 0.1
    assert_rel_fro(got_y[0], want_y[0], F32_REL_FRO, f"{implementation}: output")
    assert set(got) == set(want) == {"x", "router.weight", "router.bias", "experts.gate_up_proj",
                                     "experts.gate_up_proj_bias", "experts.down_proj", "experts.down_proj_bias"}
    for name, w in want.items():
        assert got[name] is not None, f"{implementation}: {name} got no gradient"
        assert_rel_fro(got[name], w, GRAD_F32_REL_FRO, f"{implementation} d_{name}")


def test_negative_control_concatenated_gate_up_is_caught():
    """The comparison can fail: gate/up read as concatenated halves instead of interleaved rows."""
    block = gpt_oss_block()
    ours = HFMoEBlock(copy.deepcopy(block), implementation="reference")
    ours.moe_config = ours.moe_config.replace(gate_up_layout="concatenated")
    x, _ = _inputs()
    with torch.no_grad():
        assert rel_fro(ours(x)[0], block(x)[0]) > 1e-2


def test_patched_gpt_oss_model_equals_transformers(tmp_path):
    hf, model = gpt_oss_model(), gpt_oss_model()
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    patch_hf_model(model, implementation="reference")
    assert [type(m).__name__ for m in model.modules() if isinstance(m, HFMoEBlock)] == ["HFMoEBlock"]
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before  # transformers' tensors, no copy
    assert list(model.state_dict()) == list(hf.state_dict())
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, out = hf(ids, output_router_logits=True), model(ids, output_router_logits=True)
    assert float(ref.logits.abs().mean()) > 0.1
    assert_rel_fro(out.logits, ref.logits, F32_REL_FRO, "patched logits")
    assert len(out.router_logits) == len(ref.router_logits) == 1
    assert_exact(out.router_logits[0], ref.router_logits[0], "router logits (the router's hook)")
    assert abs(float(out.aux_loss) - float(ref.aux_loss)) <= 1e-5 * abs(float(ref.aux_loss))

    model.save_pretrained(tmp_path)
    reloaded = transformers.GptOssForCausalLM.from_pretrained(tmp_path).eval()
    assert not [m for m in reloaded.modules() if isinstance(m, HFMoEBlock)]
    with torch.no_grad():
        # the saved tensors are transformers' own, bit for bit; the logits of the reloaded model may differ from the
        # first run in the last float32 bits (transformers' CPU kernels on reloaded tensors: 123 of 384 logits 2 ulps
        # apart in one CI-like run under load), so they are held to the float32 tolerance
        saved = reloaded.state_dict()
        for name, t in hf.state_dict().items():
            assert_exact(saved[name], t, f"reloaded {name}")
        assert_rel_fro(reloaded(ids).logits, ref.logits, F32_REL_FRO, "saved patched model reloaded unpatched")

    hf.train(), model.train()
    grads = []
    for m in (hf, model):
        loss = m(ids, labels=ids).loss
        loss.backward()
        grads.append((loss.item(), {n: p.grad for n, p in m.named_parameters()}))
    assert abs(grads[0][0] - grads[1][0]) <= 1e-6 * abs(grads[0][0])
    for name, want in grads[0][1].items():
        assert grads[1][1][name] is not None, f"{name} got no gradient"
        assert_rel_fro(grads[1][1][name], want, GRAD_F32_REL_FRO, f"d_{name}")


def test_block_layer_weights_with_biases_equal_the_block():
    """``block_layer_weights(with_expert_biases=True)``: ``w13 = gate_up_proj.T`` (interleaved rows), ``w2 =
    down_proj.T``, the biases; ``EPMoE.from_float`` on them under ``router_logits = block.router(x)[0]`` (its bias
    included) equals the block, and so does ``EPMoE.from_hf_block``. Without the flag it raises naming the call
    that carries them."""
    block = gpt_oss_block(3)
    config, w13, w2, bias, gate, b13, b2 = block_layer_weights(block, with_shared_expert_gate=True,
                                                               with_expert_biases=True)
    assert bias is None and gate is None and config.expert_bias and config.gate_up_layout == "interleaved"
    assert_exact(w13, block.experts.gate_up_proj.detach().transpose(1, 2), "w13")
    assert_exact(b13, block.experts.gate_up_proj_bias.detach(), "w13_bias")
    layer = EPMoE.from_float(config, w13, w2, w13_bias=b13, w2_bias=b2, implementation="reference")
    x, _ = _inputs(seed=8)
    with torch.no_grad():
        want = block(x)[0][0]
        got = layer(x[0], block.router(x[0])[0])
    assert_rel_fro(got, want, F32_REL_FRO, "EPMoE.from_float(block_layer_weights(...))")
    # the four-item form has no place for the biases; other blocks get None for them
    with pytest.raises(NotImplementedError, match=r"GptOssMLP's expert biases .*with_expert_biases=True"):
        block_layer_weights(block)
    # EPMoE.from_hf_block passes them (named regression: it raised NotImplementedError before)
    with torch.no_grad():
        assert_rel_fro(EPMoE.from_hf_block(block, implementation="reference")(x[0], block.router(x[0])[0]), want,
                       F32_REL_FRO, "EPMoE.from_hf_block(GptOssMLP)")


def test_gpt_oss_other_swiglu_constants_refused():
    block = gpt_oss_block()
    block.experts.limit = 8.0
    with pytest.raises(NotImplementedError, match=r"swiglu_limit\) must be \(1\.702, 7\.0\)"):
        HFMoEBlock(block)


# ----------------------------------------------------------------------------------------------
# The loader
# ----------------------------------------------------------------------------------------------


def _write_checkpoint(folder, tensors: dict, config: dict | None) -> str:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    if config is not None:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
    return str(folder)


def mxfp4_checkpoint(block, folder, drop=(), config_set=None):
    """gpt-oss's MXFP4 checkpoint of ``block``'s MoE layer (layer 0): the experts quantized by
    ``moe_torch.quantize_weight_mxfp4`` in our layout, written as ``*_blocks [E, N, K/32, 16]`` / ``*_scales
    [E, N, K/32]``; router and biases float. Returns ``(folder, {name: (codes, scales)})``."""
    ex = block.experts
    q13, s13 = moe_torch.quantize_weight_mxfp4(ex.gate_up_proj.detach().transpose(1, 2).contiguous())  # [E, 2I, H]
    q2, s2 = moe_torch.quantize_weight_mxfp4(ex.down_proj.detach().transpose(1, 2).contiguous())  # [E, H, I]
    t = {f"{PRE}.router.weight": block.router.weight.detach(), f"{PRE}.router.bias": block.router.bias.detach(),
         f"{PRE}.experts.gate_up_proj_blocks": q13.reshape(E, 2 * I, H // 32, 16),
         f"{PRE}.experts.gate_up_proj_scales": s13,
         f"{PRE}.experts.gate_up_proj_bias": ex.gate_up_proj_bias.detach(),
         f"{PRE}.experts.down_proj_blocks": q2.reshape(E, H, I // 32, 16), f"{PRE}.experts.down_proj_scales": s2,
         f"{PRE}.experts.down_proj_bias": ex.down_proj_bias.detach()}
    for suffix in drop:
        del t[f"{PRE}.{suffix}"]
    config = gpt_oss_config().to_dict()
    config.update(model_type="gpt_oss", quantization_config={"quant_method": "mxfp4",
                                                             "modules_to_not_convert": ["router", "self_attn"]})
    config.update(config_set or {})
    return _write_checkpoint(folder, t, config), dict(w13=(q13, s13), w2=(q2, s2))


def test_loader_reads_mxfp4_codes_and_equals_the_block(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    block = gpt_oss_block(4)
    folder, codes = mxfp4_checkpoint(block, tmp_path)
    ck = load_moe_layer(folder)
    assert (ck.arch, ck.model_type, ck.quant, ck.is_mxfp4, ck.is_fp8) == ("gpt_oss", "gpt_oss", "mxfp4", True, False)
    assert (ck.num_experts, ck.hidden_size, ck.intermediate_size) == (E, H, I)
    for name in ("w13", "w2"):  # the file's bytes, bit for bit
        assert_exact(getattr(ck, name), codes[name][0], f"{name} codes")
        assert_exact(getattr(ck, f"{name}_scale"), codes[name][1], f"{name} scales")
    # the orientation: transformers' own dequantization of the file's blocks is our dequantization, transposed
    from safetensors.torch import load_file

    raw = load_file(os.path.join(folder, "model.safetensors"))
    theirs = convert_moe_packed_tensors(raw[f"{PRE}.experts.gate_up_proj_blocks"],
                                        raw[f"{PRE}.experts.gate_up_proj_scales"], dtype=torch.float32)
    wd13, wd2 = ck.float_weights()
    assert theirs.shape == (E, H, 2 * I)
    assert_exact(theirs, wd13.transpose(1, 2), "convert_moe_packed_tensors vs dequantize_weight_mxfp4")

    cfg = ck.config()
    assert (cfg.quant, cfg.routing, cfg.renormalize, cfg.activation, cfg.gate_up_layout, cfg.expert_bias, cfg.topk) == (
        "mxfp4", "softmax_topk", True, "swiglu_oai", "interleaved", True, TOPK)
    a = ck.arrays("torch", cfg)
    layer = EPMoE(cfg, a["w13"].cpu(), a["w2"].cpu(), w13_scale=a["w13_scale"].cpu(), w2_scale=a["w2_scale"].cpu(),
                  w13_bias=a["w13_bias"].cpu(), w2_bias=a["w2_bias"].cpu(), implementation="reference")
    deq = copy.deepcopy(block)  # GptOssMLP holding the dequantized weights
    with torch.no_grad():
        deq.experts.gate_up_proj.copy_(wd13.transpose(1, 2))
        deq.experts.down_proj.copy_(wd2.transpose(1, 2))
    x, _ = _inputs(seed=9)
    with torch.no_grad():
        want = deq(x)[0][0]
        got = layer(x[0], torch.nn.functional.linear(x[0], a["router_weight"].cpu(), a["router_bias"].cpu()))
    assert float(want.abs().mean()) > 0.1
    assert_rel_fro(got, want, F32_REL_FRO, "MXFP4 checkpoint layer vs GptOssMLP on the dequantized weights")
    # asked for float: the codes dequantized (bf16, as transformers' dequantize=True), the biases as stored
    f = ck.arrays("torch", cfg.replace(quant="none"))
    assert f["w13_scale"] is None and f["w13"].dtype == torch.bfloat16
    assert_exact(f["w13"].float(), wd13.to(torch.bfloat16).float(), "dequantized w13")


def test_loader_reads_a_float_gpt_oss_checkpoint(tmp_path):
    """``GptOssForCausalLM.save_pretrained``: the float experts ``[E, H, 2I]`` / ``[E, I, H]`` transposed to ours,
    the biases; the layer equals transformers' block."""
    model = gpt_oss_model(6)
    model.save_pretrained(tmp_path)
    ck = load_moe_layer(str(tmp_path))
    assert (ck.arch, ck.quant, ck.layer) == ("gpt_oss", "none", 0)
    block = model.model.layers[0].mlp
    assert_exact(ck.w13, block.experts.gate_up_proj.detach().transpose(1, 2), "w13")
    cfg = ck.config()
    a = ck.arrays("torch", cfg)
    layer = EPMoE.from_float(cfg, a["w13"].cpu(), a["w2"].cpu(), w13_bias=a["w13_bias"].cpu(),
                             w2_bias=a["w2_bias"].cpu(), implementation="reference")
    x, _ = _inputs(seed=10)
    with torch.no_grad():
        want = block(x)[0][0]
        got = layer(x[0], block.router(x[0])[0])
    assert_rel_fro(got, want, F32_REL_FRO, "float checkpoint layer vs GptOssMLP")


@pytest.mark.parametrize("suffix", ["router.weight", "router.bias", "experts.gate_up_proj_blocks",
                                    "experts.gate_up_proj_scales", "experts.down_proj_blocks",
                                    "experts.down_proj_scales", "experts.gate_up_proj_bias",
                                    "experts.down_proj_bias"])
def test_loader_names_each_missing_gpt_oss_tensor(suffix, tmp_path):
    folder, _ = mxfp4_checkpoint(gpt_oss_block(), tmp_path, drop=(suffix,))
    with pytest.raises(ValueError, match=rf"missing key '{re.escape(PRE + '.' + suffix)}' \("):
        load_moe_layer(folder)


@pytest.mark.parametrize("config_set,match", [
    ({"swiglu_limit": 8.0}, r"key 'swiglu_limit' must be 7\.0 .*got 'swiglu_limit'=8\.0"),
    ({"num_local_experts": 8}, r"'num_local_experts'=8 but the tensors have E=4"),
])
def test_loader_gpt_oss_config_errors_name_the_key(config_set, match, tmp_path):
    folder, _ = mxfp4_checkpoint(gpt_oss_block(), tmp_path, config_set=config_set)
    with pytest.raises(ValueError, match=match):
        load_moe_layer(folder).config()


# ----------------------------------------------------------------------------------------------
# The router's bias: load_nnx_moe_block (MoEBlock.router_bias) and `epmoe check --weights` (LayerWeights.router_bias)
# ----------------------------------------------------------------------------------------------


def _jax(t):
    import jax.numpy as jnp

    return jnp.asarray(t.detach().cpu().numpy())


@pytest.fixture(scope="module")
def gpt_oss_checkpoints(tmp_path_factory):
    """``{"mxfp4": (folder, GptOssMLP holding the file's experts dequantized), "float": (folder, the saved model's
    GptOssMLP)}``: a synthetic MXFP4 checkpoint (:func:`mxfp4_checkpoint`) and ``GptOssForCausalLM.save_pretrained``."""
    block = gpt_oss_block(4)
    folder, _ = mxfp4_checkpoint(block, tmp_path_factory.mktemp("mxfp4"))
    wd13, wd2 = load_moe_layer(folder).float_weights()  # exact in float32
    deq = copy.deepcopy(block)
    with torch.no_grad():
        deq.experts.gate_up_proj.copy_(wd13.transpose(1, 2))
        deq.experts.down_proj.copy_(wd2.transpose(1, 2))
    model = gpt_oss_model(6)
    saved = tmp_path_factory.mktemp("float")
    model.save_pretrained(saved)
    return {"mxfp4": (folder, deq), "float": (str(saved), model.model.layers[0].mlp)}


@pytest.mark.parametrize("kind", ["mxfp4", "float"])
def test_load_nnx_moe_block_gpt_oss_equals_gpt_oss_mlp(kind, gpt_oss_checkpoints):
    """Named regression: ``load_nnx_moe_block`` of a gpt-oss checkpoint raised NotImplementedError
    ("router bias"). Now the block holds the file's ``router.bias`` as ``router_bias`` (float32), the expert biases
    (``config.expert_bias``), and for MXFP4 the file's codes and e8m0 scales bit for bit (``quant="mxfp4"``); its output
    and ``nnx.grad`` of x, the router weight and bias, both expert biases (and the float experts) equal
    ``GptOssMLP``'s ``.backward()`` within 1e-5 (float32; the MXFP4 block against ``GptOssMLP`` on the dequantized
    experts)."""
    import jax.numpy as jnp
    from flax import nnx

    from interop.hf_jax import load_nnx_moe_block

    folder, block = gpt_oss_checkpoints[kind]
    block = copy.deepcopy(block)  # .backward() below accumulates into its parameters' .grad
    ck = load_moe_layer(folder)
    ours = load_nnx_moe_block(folder)
    c = ours.config
    assert (c.quant, c.routing, c.renormalize, c.activation, c.gate_up_layout, c.expert_bias, c.topk) == (
        "mxfp4" if kind == "mxfp4" else "none", "softmax_topk", True, "swiglu_oai", "interleaved", True, TOPK)
    assert ours.router_bias[...].dtype == jnp.float32 and isinstance(ours.router_bias, nnx.Param)
    assert_exact(ours.router_bias[...], block.router.bias.detach(), "router_bias: the file's router.bias")
    assert_exact(ours.layer.w13_bias[...], ck.w13_bias, "w13_bias: the file's gate_up_proj_bias")
    assert_exact(ours.layer.w2_bias[...], ck.w2_bias, "w2_bias: the file's down_proj_bias")
    if kind == "mxfp4":  # the file's bytes: no dequantize-requantize round trip
        for name in ("w13", "w2", "w13_scale", "w2_scale"):
            assert_exact(getattr(ours.layer, name)[...], getattr(ck, name), f"{name}: the file's MXFP4 bytes")
    x, d_out = _inputs(seed=12)
    want_y, want = block_grads(block, x, d_out)

    def loss(m, xs):
        out = m(xs)
        return jnp.sum(out * _jax(d_out)), out

    (_, out), (g, g_x) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(ours, _jax(x))
    assert float(want_y[0].detach().abs().mean()) > 0.1
    assert_rel_fro(out, want_y[0], F32_REL_FRO, f"{kind}: load_nnx_moe_block vs GptOssMLP")
    pairs = {"x": (g_x, want["x"]), "router.weight": (g.router_weight[...], want["router.weight"]),
             "router.bias": (g.router_bias[...], want["router.bias"]),
             "experts.gate_up_proj_bias": (g.layer.w13_bias[...], want["experts.gate_up_proj_bias"]),
             "experts.down_proj_bias": (g.layer.w2_bias[...], want["experts.down_proj_bias"])}
    if kind == "float":  # in-by-out [E, H, 2I] / [E, I, H]: ours is the transpose
        pairs["experts.gate_up_proj"] = (g.layer.w13[...], want["experts.gate_up_proj"].transpose(1, 2))
        pairs["experts.down_proj"] = (g.layer.w2[...], want["experts.down_proj"].transpose(1, 2))
    for name, (got, w) in pairs.items():
        assert_rel_fro(got, w, GRAD_F32_REL_FRO, f"{kind}: d_{name}")


def test_router_bias_changes_the_routing(gpt_oss_checkpoints):
    """The bias moves the choice of experts: the block's routing (``select_experts`` of ``router_logits``, which
    equal ``GptOssTopKRouter``'s logits) is ``router_indices`` for every token; the same block without its bias
    chooses other experts for some tokens and its output is far outside the contract, so a dropped bias cannot pass."""
    import moe_pallas
    from interop.hf_jax import load_nnx_moe_block
    from moe_pallas.module import MoEBlock

    folder, block = gpt_oss_checkpoints["float"]
    ours = load_nnx_moe_block(folder)
    bare = MoEBlock(ours.router_weight[...], ours.layer)  # the same block, no router bias
    assert bare.router_bias is None
    x, _ = _inputs(T=32, seed=13)
    with torch.no_grad():
        want_logits, _, want_ids = block.router(x[0])
        want = block(x)[0]
    logits = ours.router_logits(_jax(x))
    assert_rel_fro(logits, want_logits, F32_REL_FRO, "router_logits vs GptOssTopKRouter (x @ W.T + b)")
    kw = ours.config.gate_kwargs()
    ids = np.sort(np.asarray(moe_pallas.select_experts(logits, **kw)[1]), axis=1)
    bare_ids = np.sort(np.asarray(moe_pallas.select_experts(bare.router_logits(_jax(x)), **kw)[1]), axis=1)
    theirs = np.sort(want_ids.numpy(), axis=1)
    assert_exact(ids, theirs, "experts chosen with the router bias vs GptOssTopKRouter's router_indices")
    moved = int((bare_ids != theirs).any(axis=1).sum())
    # measured: 5 of 32 tokens route differently, output rel_fro 0.37
    assert moved >= 2, f"without the bias only {moved} of 32 tokens route differently"
    assert_rel_fro(ours(_jax(x)), want, F32_REL_FRO, "with the router bias")
    assert rel_fro(bare(_jax(x)), want) > 10 * BF16_REL_FRO  # far outside even the bf16 rule


@pytest.mark.parametrize("kind,extra", [("mxfp4", ["--ep-size", "2", "--ep-rank", "1"]), ("float", [])])
def test_check_weights_of_a_gpt_oss_checkpoint_passes(kind, extra, gpt_oss_checkpoints, capsys):
    """Named regression: ``MoECheckpointLayer.layer_weights`` raised NotImplementedError for gpt-oss (no
    place for the router bias), so ``epmoe check --weights`` refused. Now ``LayerWeights`` carries ``router_bias``
    (float32) and the expert biases (MXFP4: the file's uint8 codes and e8m0 scales, which the check runs on as they
    are, as an FP8 checkpoint's); the check's router logits are ``GptOssTopKRouter``'s on its bf16 ``x``
    (``bf16(x) @ W.T + b``), and the check passes: MXFP4 on the file's codes (rank 1's stage table and the EP summary
    of both ranks), the float checkpoint."""
    from interop.cli import main
    from interop.crosscheck import make_inputs

    folder, block = gpt_oss_checkpoints[kind]
    ck = load_moe_layer(folder)
    cfg = ck.config()
    lw = ck.layer_weights(cfg)
    assert lw.router_bias.dtype == np.float32
    assert_exact(lw.router_bias, block.router.bias.detach(), "LayerWeights.router_bias")
    assert_exact(lw.w13_bias, ck.w13_bias, "LayerWeights.w13_bias")
    assert_exact(lw.w2_bias, ck.w2_bias, "LayerWeights.w2_bias")
    if kind == "mxfp4":
        assert lw.w13.dtype == lw.w13_scale.dtype == np.uint8
        assert_exact(lw.w13, ck.w13, "MXFP4 codes as stored")
        assert_exact(lw.w2_scale, ck.w2_scale, "e8m0 scales as stored")
    inputs, _, _ = make_inputs(cfg, 8, 0, "uniform", lw)
    xb = torch.from_numpy(inputs.x).to(torch.bfloat16).float()
    with torch.no_grad():
        want = torch.nn.functional.linear(xb, block.router.weight, block.router.bias)
    assert_rel_fro(inputs.router_logits, want, F32_REL_FRO, "the check's router logits vs GptOssTopKRouter")
    assert main(["check", "--weights", folder, "--tokens", "3", "--implementations", "jnp-reference,torch-reference",
                 *extra]) == 0
    out = capsys.readouterr().out
    assert "gpt_oss layer 0" in out and "expert_bias=True" in out and f"quant={cfg.quant}" in out
    assert "within the contract" in out


@pytest.mark.parametrize("shape,dtype,numpy_array,error,match", [
    ((E + 1,), "float32", False, ValueError, r"MoEBlock: router_bias must be \[E\] = \(4,\) float32 .*got "
                                             r"router_bias\.shape=\(5,\)"),
    ((1, E), "float32", False, ValueError, r"MoEBlock: router_bias must be \[E\] = \(4,\) .*got router_bias\.shape=\(1, 4\)"),
    ((E,), "bfloat16", False, TypeError, r"MoEBlock: router_bias must have dtype float32; got router_bias\.dtype=bfloat16"),
    ((E,), "float32", True, TypeError, r"MoEBlock: router_bias must be a jax array .*jnp\.asarray\(router_bias\)"),
])
def test_moe_block_router_bias_checked_on_the_host(shape, dtype, numpy_array, error, match, gpt_oss_checkpoints):
    """A bad ``router_bias`` raises at construction, naming the argument, the expectation and what came; so does
    the cross-check's ``LayerWeights.router_bias`` of another shape."""
    import jax.numpy as jnp

    from interop.crosscheck import make_inputs
    from interop.hf_jax import load_nnx_moe_block
    from moe_pallas.module import MoEBlock

    ours = load_nnx_moe_block(gpt_oss_checkpoints["float"][0])
    bias = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    bias = bias if numpy_array else jnp.asarray(bias).astype(dtype)
    with pytest.raises(error, match=match):
        MoEBlock(ours.router_weight[...], ours.layer, router_bias=bias)
    if error is ValueError:
        ck = load_moe_layer(gpt_oss_checkpoints["float"][0])
        lw = ck.layer_weights(ck.config())
        lw.router_bias = np.asarray(bias)
        with pytest.raises(ValueError, match=rf"make_inputs: weights\.router_bias must be \[E\] = \(4,\) .*got shape "
                                             rf"{re.escape(str(tuple(shape)))}"):
            make_inputs(ck.config(), 3, 0, "uniform", lw)
