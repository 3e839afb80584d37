"""The 2026 MoE families in the Hugging Face drop-ins and the checkpoint loader: Llama 4 (``Llama4TextMoe``),
Qwen3-Next (``Qwen3NextSparseMoeBlock``), GLM-4.5 (``Glm4MoeMoE``) and Kimi K2 (``DeepseekV3MoE`` with one expert
group; its checkpoints say ``model_type="kimi_k2"``, which transformers 5.24 has no class for).

Tiny random transformers 5.24 models of each family are built here (``tests/hf_checkpoints.py``: two decoder
layers, layer 0 dense, layer 1 the MoE block; H=64, I=32, E=8 (Kimi K2: 16); Llama 4 top-2 of sigmoid on the expert
input with one shared expert; Qwen3-Next a shared expert of 2*I (two fused experts) and its sigmoid gate; GLM-4.5
and Kimi K2 DeepSeek-V3's biased router with n_group = topk_group = 1 and rsf 2.5 / 2.827), weights re-drawn seeded
``N(0, 1/fan_in)`` (the correction bias ``N(0, 0.05)``), nothing downloaded. Before the 2026 families were added, ``patch_hf_model`` and
``EPMoE.from_hf_block`` refused the first three blocks by name and the loader refused the model types: every test
here that builds one fails on that code.

What is held (CONTRACT.md sections 7 and 8, ``tests/tolerances.py``):

- a whole patched model (all four families could be patched whole: ``Llama4ForCausalLM``, ``Qwen3NextForCausalLM``
  with full attention in both layers, ``Glm4MoeForCausalLM``, ``DeepseekV3ForCausalLM``): float32 logits and router
  logits within ``F32_REL_FRO`` (1e-5) of transformers', the same greedy tokens, transformers' ``state_dict`` names
  and tensors (no copy), ``save_pretrained`` reloading into the unpatched class bit-exactly, and the same loss and
  parameter gradients when trained (reference backend);
- each block (``HFMoEBlock``, what ``patch_hf_model`` puts in place) with the reference and the Triton kernels
  (interpreted here): the block's return signature (Llama 4: ``(out [T, H], router_logits [T, E])``), float32
  outputs within 1e-5, and ``.backward()`` gradients of x, the router weight, the experts, the shared expert(s) and
  Qwen3-Next's shared gate within ``GRAD_F32_REL_FRO`` (1e-5) of transformers' block's;
- ``EPMoE.from_hf_block`` (the shared MLP fused; Qwen3-Next's gate the layer's ``shared_expert_gate``): the same,
  and two EP ranks summing to the layer;
- bf16 (the model as ``from_pretrained(dtype=torch.bfloat16)`` loads it: GLM's / Kimi's router float32): every patched
  block within ``BF16_REL_FRO`` of a float64 computation of the block with transformers' own routing decisions, and
  the patched model's logit error against the float32 model at most twice transformers' own bf16 model's;
- JAX: ``load_nnx_moe_block`` of each family's saved checkpoint equals transformers' block (float32) with the
  reference (and for Llama 4 and Qwen3-Next the Pallas-Triton kernels), and ``nnx.grad`` equals its ``.backward()``;
- the loader (``interop.checkpoints.load_moe_layer``) reads each family's names (per-expert, fused, Llama 4's
  in-by-out fused experts and the multimodal ``language_model.`` prefix, Kimi K2's FP8 block format) and config.json
  (``model_type`` llama4 with ``text_config``, llama4_text, qwen3_next, glm4_moe, kimi_k2), and its layer equals the
  block; each missing tensor and each config.json key that decides something is named in its error.
"""

from __future__ import annotations

import copy
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import moe_torch
from common import TORCH_DEVICE
from moe_torch.hf import HFMoEBlock, block_layer_weights, patch_hf_model
from moe_torch.module import EPMoE
from tolerances import BF16_REL_FRO, F32_REL_FRO, GRAD_F32_REL_FRO, assert_exact, assert_rel_fro, rel_fro

transformers = pytest.importorskip("transformers")
from hf_checkpoints import FAMILIES_2026, MODEL_TYPES, hf_moe_forward, make_hf_model, moe_block, quantize_fp8_block, \
    save_checkpoint  # noqa: E402
from interop.checkpoints import load_moe_layer  # noqa: E402
from interop.hf_jax import load_nnx_moe_block  # noqa: E402

FAMILIES = FAMILIES_2026
BLOCK_CLASS = {"llama4": "Llama4TextMoe", "qwen3_next": "Qwen3NextSparseMoeBlock", "glm4_moe": "Glm4MoeMoE",
               "kimi_k2": "DeepseekV3MoE"}
H = 64
#: hf_checkpoints' models at H=64, I=32 (its defaults, H = I = 128, are for FP8 blocks): cheap for the interpreted
#: kernels. Qwen3-Next's shared expert is 2*I (two fused experts); Llama 4's dense layer 2*I.
SIZES = {
    "llama4": dict(hidden_size=H, intermediate_size=32, intermediate_size_mlp=64),
    "qwen3_next": dict(hidden_size=H, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "glm4_moe": dict(hidden_size=H, intermediate_size=64, moe_intermediate_size=32),
    "kimi_k2": dict(hidden_size=H, intermediate_size=64, moe_intermediate_size=32),
}
#: What EPMoE.from_hf_block / the loader read: (routing, renormalize, S, apply_router_weight_on_input,
#: shared_expert_gate, num_expert_group, topk_group, rsf, topk)
EXPECTED = {
    "llama4": ("sigmoid_topk", False, 1, True, False, None, None, 1.0, 2),
    "qwen3_next": ("softmax_topk", True, 2, False, True, None, None, 1.0, 2),
    "glm4_moe": ("biased_grouped_topk", True, 1, False, False, 1, 1, 2.5, 2),
    "kimi_k2": ("biased_grouped_topk", True, 1, False, False, 1, 1, 2.827, 4),
}
#: A bug (a wrong expert, weight, gate, half of gate_up) moves logits by O(1e-1).
BROKEN_MIN_ERR = 1e-2
_MODELS: dict = {}


def hf_model(family: str) -> torch.nn.Module:
    """The family's tiny float32 transformers model (eval mode, on the test device); a fresh deep copy per call."""
    if family not in _MODELS:
        _MODELS[family] = make_hf_model(family, torch.float32, seed=FAMILIES.index(family) + 20,
                                        **SIZES[family]).to(TORCH_DEVICE)
    return copy.deepcopy(_MODELS[family])


def router_of(block) -> torch.nn.Module:
    """transformers' router module of a block (Llama 4's ``router``, the others' ``gate``)."""
    return block.router if hasattr(block, "router") else block.gate


def router_logits_of(block, x2: torch.Tensor) -> torch.Tensor:
    """``router_logits [T, E]`` of transformers' block on ``x2 [T, H]`` (``Llama4Router`` returns them second)."""
    out = router_of(block)(x2)
    return out[1] if type(block).__name__ == "Llama4TextMoe" else out[0]


def _out(y):
    return y[0] if isinstance(y, tuple) else y


def input_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(seed)).to(TORCH_DEVICE)


def _inputs(T: int = 9, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, H, generator=g).to(TORCH_DEVICE), torch.randn(1, T, H, generator=g).to(TORCH_DEVICE)


def hf_blocks(model) -> list:
    return [m for m in model.modules() if type(m).__name__ in BLOCK_CLASS.values()]


def our_blocks(model) -> list[HFMoEBlock]:
    return [m for m in model.modules() if isinstance(m, HFMoEBlock)]


# ----------------------------------------------------------------------------------------------
# Whole models, float32
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_float32_model_equals_transformers(family, tmp_path):
    hf = hf_model(family)
    model = patch_hf_model(hf_model(family))
    assert [b.replaces for b in our_blocks(model)] == [BLOCK_CLASS[family]] and not hf_blocks(model)
    sd_hf, sd = hf.state_dict(), model.state_dict()
    assert list(sd) == list(sd_hf)  # transformers' names, in its order
    original = hf_model(family)
    before = {k: v.data_ptr() for k, v in original.state_dict().items()}
    patch_hf_model(original)  # the very same tensors: no copy (Llama 4's in-by-out experts included)
    assert {k: v.data_ptr() for k, v in original.state_dict().items()} == before

    ids = input_ids()
    with torch.no_grad():
        ref, out = hf(ids, output_router_logits=True), model(ids, output_router_logits=True)
    assert float(ref.logits.abs().mean()) > 0.1, "degenerate logits: the test would prove nothing"
    assert_rel_fro(out.logits, ref.logits, F32_REL_FRO, f"{family}: patched logits")
    ref_rl, rl = getattr(ref, "router_logits", None), getattr(out, "router_logits", None)
    if ref_rl is not None:  # output_router_logits: recorded by the router module's hook, ours too
        assert len(rl) == len(ref_rl) == 1
        assert_exact(rl[0], ref_rl[0], f"{family}: router logits")
    if getattr(ref, "aux_loss", None) is not None:
        assert abs(float(out.aux_loss) - float(ref.aux_loss)) <= 1e-5 * abs(float(ref.aux_loss))
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids, **gen), hf.generate(ids, **gen)), f"{family}: greedy tokens differ"

    model.save_pretrained(tmp_path)
    reloaded = type(hf).from_pretrained(tmp_path).eval().to(TORCH_DEVICE)
    reloaded.set_experts_implementation("eager")  # as hf_checkpoints builds them (from_pretrained's default differs)
    assert not our_blocks(reloaded)
    with torch.no_grad():
        assert_exact(reloaded(ids).logits, ref.logits, f"{family}: saved patched model reloaded unpatched")


def test_negative_control_llama4_without_input_scaling_is_caught():
    """The model comparison can fail: Llama 4's router weight on the expert *output* instead of its input."""
    hf = hf_model("llama4")
    model = patch_hf_model(hf_model("llama4"))
    for b in our_blocks(model):
        b.moe_config = b.moe_config.replace(apply_router_weight_on_input=False)
    with torch.no_grad():
        assert rel_fro(model(input_ids()).logits, hf(input_ids()).logits) > BROKEN_MIN_ERR


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_trains_as_transformers(family):
    """``loss.backward()`` through the patched model (reference backend): the loss and every parameter's gradient
    (embeddings, attention, router, experts, shared expert(s), Qwen3-Next's shared gate) as transformers'."""
    hf, model = hf_model(family).train(), patch_hf_model(hf_model(family).train(), implementation="reference")
    ids = input_ids(3)
    losses, grads = [], []
    for m in (hf, model):
        m.zero_grad(set_to_none=True)
        loss = m(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert abs(losses[0] - losses[1]) <= 1e-6 * abs(losses[0])
    assert list(grads[1]) == list(grads[0])
    assert any(".experts.gate_up_proj" in n for n in grads[1])
    for name, want in grads[0].items():
        assert grads[1][name] is not None, f"{family}: {name} got no gradient"
        assert_rel_fro(grads[1][name], want, GRAD_F32_REL_FRO, f"{family} d_{name}")


# ----------------------------------------------------------------------------------------------
# Blocks: HFMoEBlock (reference and Triton) and EPMoE.from_hf_block, outputs and gradients
# ----------------------------------------------------------------------------------------------


def block_grads(block, x: torch.Tensor, d_out: torch.Tensor):
    """``.backward()`` of ``<block(x) output, d_out>``: ``(output, {"x": d_x, <parameter name>: grad})``; the
    output as the block returns it (Llama 4: the tuple)."""
    x = x.clone().requires_grad_()
    y = block(x)
    (_out(y).reshape(d_out.shape) * d_out).sum().backward()
    grads = {"x": x.grad}
    grads.update({n: p.grad for n, p in block.named_parameters()})
    return y, grads


@pytest.mark.parametrize("implementation", ["reference", "triton"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_block_outputs_and_gradients_equal_transformers(family, implementation):
    block = moe_block(hf_model(family))
    ours = HFMoEBlock(copy.deepcopy(block), implementation=implementation)
    x, d_out = _inputs()
    want_y, want = block_grads(block, x, d_out)
    got_y, got = block_grads(ours, x, d_out)
    # the block's return signature: Llama4TextMoe -> (out [T, H], router_logits [T, E]); the others -> [B, S, H]
    assert type(got_y) is type(want_y)
    if isinstance(want_y, tuple):
        assert len(got_y) == len(want_y) == 2 and got_y[0].shape == want_y[0].shape == (9, H)
        assert_exact(got_y[1], want_y[1], f"{family}: returned router logits")
    else:
        assert got_y.shape == want_y.shape == x.shape
    assert float(_out(want_y).detach().abs().mean()) > 0.1
    assert_rel_fro(_out(got_y), _out(want_y), F32_REL_FRO, f"{family} {implementation}: output")
    assert set(got) == set(want)
    assert any("shared_expert" in n for n in want)
    assert any("shared_expert_gate" in n for n in want) == (family == "qwen3_next")
    for name, w in want.items():
        assert got[name] is not None, f"{family} {implementation}: {name} got no gradient"
        assert_rel_fro(got[name], w, GRAD_F32_REL_FRO, f"{family} {implementation} d_{name}")


def _layer_from_block(block, **kw) -> EPMoE:
    """``EPMoE.from_hf_block`` (the reference implementation)."""
    return EPMoE.from_hf_block(block, implementation="reference", **kw)


def _fused_weight_grads(family: str, block, grads: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' expert and shared-MLP gradients as our ``d_w13 [E + S, 2I, H]``, ``d_w2 [E + S, H, I]``."""
    g13, g2 = grads["experts.gate_up_proj"], grads["experts.down_proj"]
    if family == "llama4":  # in-by-out
        g13, g2 = g13.transpose(1, 2), g2.transpose(1, 2)
    shared = "shared_expert" if hasattr(block, "shared_expert") else "shared_experts"
    g, u, d = (grads[f"{shared}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
    I = g13.shape[1] // 2
    S = g.shape[0] // I
    s13 = [torch.cat([g[j * I:(j + 1) * I], u[j * I:(j + 1) * I]]) for j in range(S)]
    s2 = [d[:, j * I:(j + 1) * I] for j in range(S)]
    return torch.cat([g13, torch.stack(s13)]), torch.cat([g2, torch.stack(s2)])


@pytest.mark.parametrize("family", FAMILIES)
def test_epmoe_from_hf_block_equals_the_block(family):
    block = moe_block(hf_model(family))
    twin = copy.deepcopy(block)
    layer = _layer_from_block(twin)
    c = layer.config
    routing, renorm, S, on_input, gated, groups, topk_group, rsf, topk = EXPECTED[family]
    assert (c.routing, c.renormalize, c.num_fused_shared_experts, c.apply_router_weight_on_input,
            c.shared_expert_gate, c.routed_scaling_factor, c.topk) == (routing, renorm, S, on_input, gated, rsf, topk)
    if groups is not None:
        assert (c.num_expert_group, c.topk_group) == (groups, topk_group)
    x, d_out = _inputs(seed=8)
    want_y, want = block_grads(block, x, d_out)
    xs = x[0].clone().requires_grad_()
    out = layer(xs, router_logits_of(twin, xs))
    (out * d_out[0]).sum().backward()
    assert_rel_fro(out, _out(want_y).reshape(out.shape), F32_REL_FRO, f"{family}: EPMoE.from_hf_block output")
    assert_rel_fro(xs.grad, want["x"][0], GRAD_F32_REL_FRO, f"{family} d_x")
    rname = "router.weight" if family == "llama4" else "gate.weight"
    assert_rel_fro(router_of(twin).weight.grad, want[rname], GRAD_F32_REL_FRO, f"{family} d_{rname}")
    d13, d2 = _fused_weight_grads(family, block, want)
    assert layer.w13.grad.shape == d13.shape == (c.num_experts + S, 64, H)
    assert_rel_fro(layer.w13.grad, d13, GRAD_F32_REL_FRO, f"{family} d_w13 (routed and fused shared)")
    assert_rel_fro(layer.w2.grad, d2, GRAD_F32_REL_FRO, f"{family} d_w2 (routed and fused shared)")
    if gated:
        assert_rel_fro(layer.shared_expert_gate.grad, want["shared_expert_gate.weight"], GRAD_F32_REL_FRO,
                       f"{family} d_shared_expert_gate")
    # two EP ranks (the fused shared experts on the last) sum to the layer
    with torch.no_grad():
        xd = x[0]
        split = sum(_layer_from_block(block, ep_size=2, ep_rank=r)(xd, router_logits_of(block, xd)) for r in (0, 1))
        assert_rel_fro(split, out.detach(), F32_REL_FRO, f"{family}: EP ranks 0 + 1")
    with pytest.raises(ValueError, match=r"\['topk'\] come from the block"):
        block_layer_weights(block, with_shared_expert_gate=True, topk=1)


def test_epmoe_from_hf_block_qwen3_next():
    """``EPMoE.from_hf_block`` on ``Qwen3NextSparseMoeBlock`` equals the block, the gate weight its
    ``shared_expert_gate`` (``block_layer_weights`` with ``with_shared_expert_gate=True``)."""
    block = moe_block(hf_model("qwen3_next"))
    layer = EPMoE.from_hf_block(block, implementation="reference")
    x = _inputs()[0][0]
    with torch.no_grad():
        assert_rel_fro(layer(x, block.gate(x)[0]), block(x[None])[0], F32_REL_FRO, "qwen3_next from_hf_block")


def test_block_layer_weights_never_drops_the_shared_gate():
    """The four-item ``block_layer_weights`` (what ``EPMoE.from_hf_block`` unpacks) cannot carry Qwen3-Next's
    ``shared_expert_gate``: it raises naming the five-item call instead of returning a layer that would add the
    shared expert ungated (the other families' four items are unchanged)."""
    with pytest.raises(NotImplementedError, match=r"shared_expert_gate \[1, H\].*with_shared_expert_gate=True"):
        block_layer_weights(moe_block(hf_model("qwen3_next")))
    config, *_, gate = block_layer_weights(moe_block(hf_model("qwen3_next")), with_shared_expert_gate=True)
    assert config.shared_expert_gate and gate.shape == (1, H)
    assert len(block_layer_weights(moe_block(hf_model("llama4")))) == 4


@pytest.mark.parametrize("family", ["llama4", "qwen3_next"])
def test_fp8_patch_of_the_new_blocks(family):
    """``patch_hf_model(quant='fp8_per_token')``: the routed experts become float8_e4m3fn codes in the layer's
    ``[E, 2I, H]`` / ``[E, H, I]`` layout (Llama 4's too, not its in-by-out float shapes) with float32
    ``*_scale_inv`` beside them, transformers' other names unchanged (router, shared expert, shared gate: float);
    the logits stay close to the float model's (quantized, yet close) and ``save_pretrained`` is refused."""
    hf = hf_model(family)
    model = patch_hf_model(hf_model(family), quant="fp8_per_token", implementation="reference")
    ex = moe_block(model).experts
    E, I = ex.num_experts, ex.intermediate_dim
    assert ex.gate_up_proj.dtype == ex.down_proj.dtype == torch.float8_e4m3fn
    assert ex.gate_up_proj.shape == (E, 2 * I, H) and ex.down_proj.shape == (E, H, I)
    sd = model.state_dict()
    scales = {k for k in sd if k.endswith("_scale_inv")}
    assert set(sd) - scales == set(hf.state_dict()) and len(scales) == 2
    with torch.no_grad():
        err = rel_fro(model(input_ids()).logits, hf(input_ids()).logits)
    assert 1e-4 < err < 0.1, f"{family}: FP8 logits vs float: {err:.2e}"
    with pytest.raises(NotImplementedError, match="FP8 experts"):
        model.save_pretrained("/nonexistent/never-written")


# ----------------------------------------------------------------------------------------------
# bf16: every patched block within the contract, the model no worse than transformers' own bf16 model
# ----------------------------------------------------------------------------------------------


def _mlp64(mlp, x):
    return copy.deepcopy(mlp).double()(x)


def _block_reference64(block, x: torch.Tensor) -> torch.Tensor:
    """Float64 output ``[T, H]`` of transformers' block on ``x [..., H]`` with its own routing decisions (the ids and
    weights of its router in the model's precision), by a plain per-slot loop."""
    x2 = x.reshape(-1, x.shape[-1])
    name = type(block).__name__
    with torch.no_grad():
        ex, xd = block.experts, x2.double()
        if name == "Llama4TextMoe":  # weights on the expert input; the experts in-by-out
            scores, logits = block.router(x2)
            ids = logits.topk(block.router.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
            w13, w2 = ex.gate_up_proj.double().transpose(1, 2), ex.down_proj.double().transpose(1, 2)
        else:
            _, weights, ids = block.gate(x2)
            w13, w2 = ex.gate_up_proj.double(), ex.down_proj.double()
        I = w2.shape[-1]
        out = torch.zeros_like(xd)
        for j in range(ids.shape[1]):
            wj = weights[:, j, None].double()
            xin = xd * wj if name == "Llama4TextMoe" else xd
            h = torch.einsum("toh,th->to", w13[ids[:, j]], xin)
            y = torch.einsum("thi,ti->th", w2[ids[:, j]], ex.act_fn(h[:, :I]) * h[:, I:])
            out += y if name == "Llama4TextMoe" else wj * y
        if name == "Qwen3NextSparseMoeBlock":
            out += torch.sigmoid(_mlp64(block.shared_expert_gate, xd)) * _mlp64(block.shared_expert, xd)
        elif name == "Llama4TextMoe":
            out += _mlp64(block.shared_expert, xd)
        else:
            out += _mlp64(block.shared_experts, xd)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_bf16_model_within_the_contract(family, tmp_path):
    f32 = hf_model(family)
    save_checkpoint(f32, tmp_path / "f32")  # config.json + model.safetensors: what from_pretrained reads
    load = lambda: type(f32).from_pretrained(tmp_path / "f32", dtype=torch.bfloat16).eval().to(TORCH_DEVICE)  # noqa: E731
    hf, model = load(), patch_hf_model(load())
    if family in ("glm4_moe", "kimi_k2"):  # transformers keeps these routers in float32
        assert router_of(moe_block(model)).weight.dtype == torch.float32
    seen = []
    hooks = [b.register_forward_hook(lambda m, args, out: seen.append((args[0], out))) for b in our_blocks(model)]
    ids = input_ids(2)
    with torch.no_grad():
        out = model(ids).logits
    for h in hooks:
        h.remove()
    (x, y), hf_block = seen[0], hf_blocks(hf)[0]
    assert len(seen) == 1 and x.dtype == _out(y).dtype == torch.bfloat16
    ref = _block_reference64(hf_block, x)
    assert_rel_fro(_out(y).reshape(ref.shape), ref, BF16_REL_FRO, f"{family}: our bf16 block vs float64")
    with torch.no_grad():  # the judge is right: transformers' own bf16 block meets it too
        assert_rel_fro(_out(hf_block(x)).reshape(ref.shape), ref, BF16_REL_FRO, f"{family}: transformers' bf16 block")
        ref32, hf16 = f32(ids).logits, hf(ids).logits
    hf_err, err = rel_fro(hf16, ref32), rel_fro(out, ref32)
    assert err <= 2 * hf_err, f"{family}: bf16 logits error {err:.2e} vs transformers' own bf16 model's {hf_err:.2e}"


# ----------------------------------------------------------------------------------------------
# JAX: load_nnx_moe_block of each family's checkpoint
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> the folder of its tiny float32 model's checkpoint (save_pretrained; Kimi K2's model_type)."""
    return {f: save_checkpoint(hf_model(f), tmp_path_factory.mktemp(f), model_type=MODEL_TYPES.get(f))
            for f in FAMILIES}


@pytest.mark.parametrize("family,implementation", [
    *((f, "reference") for f in FAMILIES),
    # the Pallas-Triton kernels (interpreted) on the new layer semantics; DeepSeek-V3's routing has its own there
    ("llama4", "pallas_triton"), ("qwen3_next", "pallas_triton"),
])
def test_jax_block_outputs_and_gradients_equal_transformers(family, implementation, saved):
    block = moe_block(hf_model(family))
    ours = load_nnx_moe_block(saved[family], 1, implementation=implementation)
    c = ours.config
    routing, renorm, S, on_input, gated, *_ = EXPECTED[family]
    assert (c.routing, c.renormalize, c.num_fused_shared_experts, c.apply_router_weight_on_input,
            c.shared_expert_gate) == (routing, renorm, S, on_input, gated)
    x, d_out = _inputs(seed=11)
    want_y, want = block_grads(block, x, d_out)
    j = lambda t: jnp.asarray(t.detach().cpu().numpy())  # noqa: E731

    def loss(m, xs):
        out = m(xs)
        return jnp.sum(out * j(d_out)), out

    # under nnx.jit: one compile instead of an eager compile per op (~180 of them: kimi_k2 14 s -> 3 s), the
    # same block and gradients (test_hf_jax.py's example models run jitted too; test_hf_gpt_oss.py keeps an eager
    # nnx.value_and_grad of a loaded MoEBlock)
    (_, out), (g, g_x) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(ours, j(x))
    assert out.shape == x.shape  # MoEBlock returns the hidden states only (Llama 4's logits: ours.router_logits)
    assert_rel_fro(out, _out(want_y).reshape(x.shape), F32_REL_FRO, f"jax {family} {implementation}: output")
    d13, d2 = _fused_weight_grads(family, block, want)
    rname = "router.weight" if family == "llama4" else "gate.weight"
    pairs = dict(x=(g_x, want["x"]), router=(g.router_weight[...], want[rname]), w13=(g.layer.w13[...], d13),
                 w2=(g.layer.w2[...], d2))
    if gated:
        pairs["shared_expert_gate"] = (g.layer.shared_expert_gate[...], want["shared_expert_gate.weight"])
    for name, (got, w) in pairs.items():
        assert_rel_fro(got, w, GRAD_F32_REL_FRO, f"jax {family} {implementation} d_{name}")
    if family == "llama4":  # the logits transformers' Llama4TextMoe returns beside its output
        assert_rel_fro(ours.router_logits(j(x)), block.router(x[0])[1], F32_REL_FRO, "llama4 router logits")


# ----------------------------------------------------------------------------------------------
# The loader: names and config.json of each family
# ----------------------------------------------------------------------------------------------


def _our_layer_out(ck, x2: torch.Tensor, **overrides) -> torch.Tensor:
    """Our torch layer from the loaded checkpoint on ``x2 [T, H]`` (router logits ``x @ router.T`` in float32)."""
    cfg = ck.config(**overrides)
    a = ck.arrays("torch")
    layer = EPMoE.from_float(cfg, a["w13"].float(), a["w2"].float(), e_score_correction_bias=a["e_score_correction_bias"],
                             shared_expert_gate=None if a["shared_expert_gate"] is None else a["shared_expert_gate"].float(),
                             implementation="reference")
    x2 = x2.to(layer.w13.device)
    with torch.no_grad():
        return layer(x2, x2 @ a["router_weight"].float().T).cpu()


def _llama4_multimodal(tensors: dict) -> None:
    """The hub's Llama 4 names (``Llama4ForConditionalGeneration``): ``language_model.model.layers.L...``."""
    for k in list(tensors):
        tensors["language_model." + k] = tensors.pop(k)


def _llama4_per_expert(tensors: dict) -> None:
    """Llama 4's fused in-by-out experts rewritten as per-expert ``nn.Linear`` weights (``[I, H]``, ``[H, I]``)."""
    pre = "model.layers.1.feed_forward.experts"
    gu, d = tensors.pop(f"{pre}.gate_up_proj"), tensors.pop(f"{pre}.down_proj")
    I = d.shape[1]
    for e in range(gu.shape[0]):
        tensors[f"{pre}.{e}.gate_proj.weight"] = gu[e, :, :I].T.contiguous()
        tensors[f"{pre}.{e}.up_proj.weight"] = gu[e, :, I:].T.contiguous()
        tensors[f"{pre}.{e}.down_proj.weight"] = d[e].T.contiguous()


@pytest.mark.parametrize("family,layout", [
    ("llama4", "fused"), ("llama4", "multimodal"), ("llama4", "per_expert"),
    ("qwen3_next", "per_expert"), ("qwen3_next", "fused"),
    ("glm4_moe", "per_expert"), ("glm4_moe", "fused"),
    ("kimi_k2", "per_expert"),
])
def test_loader_reads_each_family_and_equals_the_block(family, layout, tmp_path):
    model = hf_model(family)
    kw = dict(model_type=MODEL_TYPES.get(family), fused=layout == "fused",
              edit={"multimodal": _llama4_multimodal, "per_expert": _llama4_per_expert}.get(layout)
              if family == "llama4" else None)
    folder = save_checkpoint(model, tmp_path, **kw)
    if layout == "multimodal":  # the hub's config.json: model_type llama4, the text model's keys in text_config
        path = os.path.join(folder, "config.json")
        text = json.load(open(path))
        json.dump({"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"], "text_config": text,
                   "vision_config": {"hidden_size": 16}}, open(path, "w"))
    ck = load_moe_layer(folder)
    assert ck.config_path is not None  # the routing comes from config.json
    assert ck.layer == 1 and ck.arch == {"kimi_k2": "deepseek_v3"}.get(family, family)
    assert ck.model_type == {"llama4": "llama4" if layout == "multimodal" else "llama4_text"}.get(family, family)
    cfg = ck.config()
    routing, renorm, S, on_input, gated, groups, topk_group, rsf, topk = EXPECTED[family]
    assert (cfg.routing, cfg.renormalize, cfg.num_fused_shared_experts, cfg.apply_router_weight_on_input,
            cfg.shared_expert_gate, cfg.routed_scaling_factor, cfg.topk) == (routing, renorm, S, on_input, gated, rsf, topk)
    assert (ck.shared_expert_gate is not None) == gated and (ck.e_score_correction_bias is not None) == (groups is not None)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(4))
    ref = hf_moe_forward(model, x.to(TORCH_DEVICE)).cpu()
    assert float(ref.abs().mean()) > 0.1
    assert_rel_fro(_our_layer_out(ck, x), ref, F32_REL_FRO, f"{family} {layout}: loaded layer vs transformers' block")


def test_kimi_k2_fp8_checkpoint_reads_as_its_codes():
    """Kimi K2's released format (DeepSeek-V3's: float8_e4m3fn projections with 128x128 ``weight_scale_inv``,
    ``quantization_config`` fp8): the file's codes and scales, ``quant='fp8_block'``, Kimi's routing; dequantized,
    the layer is within the FP8 rule of transformers' float block."""
    import tempfile

    model = make_hf_model("kimi_k2", torch.float32, seed=7)  # H = I = 128: whole FP8 blocks
    with tempfile.TemporaryDirectory() as tmp:
        ck = load_moe_layer(save_checkpoint(model, tmp, fp8=True, model_type="kimi_k2"))
    assert ck.model_type == "kimi_k2" and ck.is_fp8 and ck.w13.dtype == torch.float8_e4m3fn
    cfg = ck.config()
    assert (cfg.quant, cfg.routing, cfg.num_expert_group, cfg.topk_group, cfg.routed_scaling_factor) == (
        "fp8_block", "biased_grouped_topk", 1, 1, 2.827)
    q, s = quantize_fp8_block(moe_block(model).experts.gate_up_proj.detach()[3, :128])  # expert 3's gate rows
    assert_exact(ck.w13[3, :128], q, "expert 3 gate codes")
    assert_exact(ck.w13_scale[3, :1], s, "expert 3 gate block scales")


def _drop(*suffixes):
    def edit(tensors):
        for k in [k for k in tensors if k.endswith(suffixes)]:
            del tensors[k]
    return edit


@pytest.mark.parametrize("family,suffixes,match", [
    ("llama4", ("feed_forward.router.weight",), r"missing key 'model\.layers\.1\.feed_forward\.router\.weight' \(router"),
    ("llama4", ("feed_forward.experts.down_proj",),
     r"missing key 'model\.layers\.1\.feed_forward\.experts\.down_proj' \(fused down projection \[E, I, H\]"),
    ("llama4", ("feed_forward.shared_expert.up_proj.weight",),
     r"missing key 'model\.layers\.1\.feed_forward\.shared_expert\.up_proj\.weight' \(shared experts' up"),
    ("llama4", ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "shared_expert.down_proj.weight"),
     r"missing key 'model\.layers\.1\.feed_forward\.shared_expert\.gate_proj\.weight' \(the shared experts\).*"
     r"Llama4TextMoe's shared_expert"),
    ("qwen3_next", ("mlp.shared_expert_gate.weight",),
     r"missing key 'model\.layers\.1\.mlp\.shared_expert_gate\.weight' \(the shared expert's gate \[1, H\]\)"),
    ("qwen3_next", ("mlp.experts.3.up_proj.weight",), r"missing key 'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight'"),
    ("qwen3_next", ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "shared_expert.down_proj.weight"),
     r"missing key 'model\.layers\.1\.mlp\.shared_expert\.gate_proj\.weight' \(the shared experts\).*"
     r"'shared_expert_intermediate_size'=64"),
    ("glm4_moe", ("mlp.gate.e_score_correction_bias",),
     r"missing key 'model\.layers\.1\.mlp\.gate\.e_score_correction_bias' \(the glm4_moe router's"),
    ("glm4_moe", ("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"),
     r"missing key 'model\.layers\.1\.mlp\.shared_experts\.gate_proj\.weight' \(the shared experts\).*'n_shared_experts'=1"),
    ("kimi_k2", ("mlp.gate.e_score_correction_bias",),
     r"missing key 'model\.layers\.1\.mlp\.gate\.e_score_correction_bias' \(the deepseek_v3 router's"),
    ("kimi_k2", ("mlp.experts.15.down_proj.weight",), r"missing key 'model\.layers\.1\.mlp\.experts\.15\.down_proj\.weight'"),
])
def test_loader_names_each_missing_tensor(family, suffixes, match, tmp_path):
    folder = save_checkpoint(hf_model(family), tmp_path, model_type=MODEL_TYPES.get(family), edit=_drop(*suffixes))
    with pytest.raises(ValueError, match=match):
        load_moe_layer(folder)


@pytest.mark.parametrize("family,drop,set_,match", [
    # Llama 4: the hub's config.json keeps the text model's keys in text_config
    ("llama4", (), {"model_type": "llama4"}, r"model_type 'llama4'\) must have a 'text_config' object"),
    ("llama4", ("num_local_experts",), None,
     r"'num_local_experts'=16 \(absent from config\.json: Llama4TextConfig's default\) but the tensors have E=8"),
    ("llama4", (), {"hidden_act": "relu"}, r"key 'hidden_act' must be one of .*got 'hidden_act'='relu'"),
    ("qwen3_next", ("shared_expert_intermediate_size",), None,
     r"'shared_expert_intermediate_size'=512 \(absent from config\.json: Qwen3NextConfig's default\)"),
    ("qwen3_next", (), {"shared_expert_intermediate_size": 48}, r"'shared_expert_intermediate_size'=48, not a multiple "
                                                                r"of the experts' I=32"),
    ("qwen3_next", ("moe_intermediate_size",), None, r"'moe_intermediate_size'=512 \(absent .*\) but the tensors have I=32"),
    ("glm4_moe", ("n_routed_experts",), None,
     r"'n_routed_experts'=128 \(absent from config\.json: Glm4MoeConfig's default\) but the tensors have E=8"),
    ("glm4_moe", (), {"n_shared_experts": 2}, r"1 shared expert\(s\), but .* says 'n_shared_experts'=2"),
    ("glm4_moe", (), {"topk_method": "greedy"}, r"key 'topk_method' must be 'noaux_tc'"),
    ("kimi_k2", (), {"scoring_func": "softmax"}, r"key 'scoring_func' must be 'sigmoid'"),
    ("kimi_k2", ("n_routed_experts",), None,
     r"'n_routed_experts'=256 \(absent from config\.json: DeepseekV3Config's default\) but the tensors have E=16"),
    ("kimi_k2", (), {"n_group": 3}, r"divisible by num_expert_group.*'n_group'=3"),
])
def test_loader_config_errors_name_the_key(family, drop, set_, match, tmp_path):
    folder = save_checkpoint(hf_model(family), tmp_path, model_type=MODEL_TYPES.get(family), config_drop=drop,
                             config_set=set_)
    with pytest.raises(ValueError, match=match):
        load_moe_layer(folder).config()


@pytest.mark.parametrize("family,drop,field,expected", [
    # an absent key means what transformers' config class means by it
    ("glm4_moe", ("n_group", "topk_group"), ("num_expert_group", "topk_group"), (1, 1)),  # Glm4MoeConfig's defaults
    ("glm4_moe", ("routed_scaling_factor",), ("routed_scaling_factor",), (1.0,)),  # GLM-4.5-Air's value
    ("qwen3_next", ("norm_topk_prob",), ("renormalize",), (True,)),  # Qwen3NextConfig's default (Qwen3-MoE's: False)
    ("kimi_k2", ("routed_scaling_factor",), ("routed_scaling_factor",), (2.5,)),  # DeepseekV3Config's (Kimi has 2.827)
    ("llama4", ("num_experts_per_tok",), ("topk",), (1,)),  # Llama4TextConfig's default: Scout / Maverick's top-1
])
def test_loader_absent_config_keys_mean_what_transformers_means(family, drop, field, expected, tmp_path):
    folder = save_checkpoint(hf_model(family), tmp_path, model_type=MODEL_TYPES.get(family), config_drop=drop)
    ck = load_moe_layer(folder)
    cfg = ck.config()
    assert tuple(getattr(cfg, f) for f in field) == expected
    assert all("absent from config.json" in ck.routing_words[f] for f in field)


def test_loader_without_config_json_and_presets(tmp_path):
    """Without config.json: the family from the key names, the routing from a preset of that family only; the
    layer semantics (Llama 4's input scaling, Qwen3-Next's shared gate) are the tensors' and cannot be overridden."""
    got = {}
    for family in FAMILIES:
        folder = save_checkpoint(hf_model(family), tmp_path / family, config_drop=("config.json",))
        got[family] = load_moe_layer(folder)
        assert got[family].config_path is None
    assert {f: c.arch for f, c in got.items()} == {"llama4": "llama4", "qwen3_next": "qwen3_next",
                                                    "glm4_moe": "deepseek_v3", "kimi_k2": "deepseek_v3"}
    llama4, qwen3_next = got["llama4"], got["qwen3_next"]
    cfg = llama4.config("llama4-scout")
    assert (cfg.routing, cfg.apply_router_weight_on_input, cfg.topk, cfg.hidden_size) == ("sigmoid_topk", True, 1, H)
    cfg = qwen3_next.config("qwen3-next-80b-a3b", topk=2)  # its top-10 exceeds these 8 experts
    assert (cfg.routing, cfg.shared_expert_gate, cfg.num_fused_shared_experts) == ("softmax_topk", True, 2)
    for ck, preset in ((llama4, "mixtral-8x7b"), (llama4, "qwen3-next-80b-a3b"), (qwen3_next, "qwen3-30b-a3b"),
                       (qwen3_next, "llama4-scout"), (got["glm4_moe"], "llama4-maverick")):
        with pytest.raises(ValueError, match=rf"preset '{preset}' is another family's layer"):
            ck.config(preset)
    assert got["glm4_moe"].config("glm-4.5-air").routed_scaling_factor == 1.0
    with pytest.raises(ValueError, match=r"apply_router_weight_on_input is the llama4 checkpoint's \(True: sigmoid top-k"):
        llama4.config("llama4-scout", apply_router_weight_on_input=False)
    with pytest.raises(ValueError, match=r"shared_expert_gate is the qwen3_next checkpoint's \(True"):
        qwen3_next.config("qwen3-next-80b-a3b", shared_expert_gate=False)


def test_check_takes_the_checkpoints_shared_gate(saved, capsys):
    """``epmoe check --weights`` of a Qwen3-Next checkpoint: ``layer_weights`` carries the file's
    ``shared_expert_gate`` (the check's gate logits are ``x`` times it, not a seeded weight's), and the check runs
    (references; exit 0) for Qwen3-Next and Llama 4."""
    from interop.cli import main

    ck = load_moe_layer(saved["qwen3_next"])
    lw = ck.layer_weights(ck.config())
    assert_exact(lw.shared_expert_gate, ck.shared_expert_gate, "the checkpoint's shared_expert_gate")
    for family in ("qwen3_next", "llama4"):
        assert main(["check", "--weights", saved[family], "--tokens", "3",
                     "--implementations", "jnp-reference,torch-reference"]) == 0
        out = capsys.readouterr().out
        assert {"qwen3_next": "shared_expert_gate=True", "llama4": "apply_router_weight_on_input=True"}[family] in out


def test_loader_refuses_fp8_llama4_fused_experts(tmp_path):
    """Llama 4's fused experts are in-by-out; an FP8 copy of them would need transposed block scales, a format no
    checkpoint has: refused naming the tensor rather than read with the scales the wrong way round."""
    def fp8(tensors):
        for k in ("model.layers.1.feed_forward.experts.gate_up_proj", "model.layers.1.feed_forward.experts.down_proj"):
            tensors[k] = tensors[k].to(torch.float8_e4m3fn)
    folder = save_checkpoint(hf_model("llama4"), tmp_path, edit=fp8)
    with pytest.raises(ValueError, match=r"feed_forward\.experts\.gate_up_proj is float8_e4m3fn in Llama 4's in-by-out"):
        load_moe_layer(folder)


def test_llama4_maverick_dense_layers_are_not_moe_layers(tmp_path):
    """Llama 4 interleaves dense layers (``feed_forward.{gate,up,down}_proj``, no experts): layer 0 here. The loader
    lists only layer 1, and asking for layer 0 names the MoE layers."""
    folder = save_checkpoint(hf_model("llama4"), tmp_path)
    assert load_moe_layer(folder).layer == 1
    with pytest.raises(ValueError, match=r"layer must be one of the MoE layers \[1\]; got layer=0"):
        load_moe_layer(folder, layer=0)
