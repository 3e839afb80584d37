"""``moe_torch.MoEBlock``: router + experts under transformers' names, the torch twin of ``moe_pallas.MoEBlock``.

- Against transformers 5.24's blocks (``Qwen3MoeSparseMoeBlock``, ``DeepseekV3MoE``, and Mixtral's, GLM-4.5's,
  Qwen3-Next's, Llama 4's, gpt-oss's), float32, seeded ``N(0, 1/fan_in)`` weights (transformers' own init leaves the
  router near uniform): ``from_hf_block`` and ``load_state_dict(hf_block.state_dict())`` give the block's hidden
  states within ``F32_REL_FRO`` (1e-5, CONTRACT.md section 7), and the state goes back the other way; the gradients of
  the parameters (same names) within ``GRAD_F32_REL_FRO``.
- Against ``moe_pallas.MoEBlock`` on the same weights: ``from_preset`` with the same seed (the same bits), and a JAX
  block's arrays handed over through DLPack (``interop.dlpack.to_torch``): the same outputs within 1e-5.
- FP8: ``from_hf_block(quant='fp8_block')`` computes what ``HFMoEBlock(quant='fp8_block')`` computes.
- Bad inputs and unsupported layers raise errors naming the op, the argument, the expectation and what came.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import moe_pallas
import moe_torch
from common import TORCH_DEVICE, needs_triton_interpreter
from hf_checkpoints import tiny_config
from interop.dlpack import to_torch
from moe_torch.module import EPMoE, MoEBlock
from tolerances import F32_REL_FRO, GRAD_F32_REL_FRO, assert_exact, assert_rel_fro, rel_fro

transformers = pytest.importorskip("transformers")

#: family -> (transformers module, block class) of transformers 5.24
BLOCKS = {
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3MoE"),
    "mixtral": ("mixtral", "MixtralSparseMoeBlock"),
    "glm4_moe": ("glm4_moe", "Glm4MoeMoE"),
    "qwen3_next": ("qwen3_next", "Qwen3NextSparseMoeBlock"),
    "llama4": ("llama4", "Llama4TextMoe"),
    "gpt_oss": ("gpt_oss", "GptOssMLP"),
}


def _reinit(module: torch.nn.Module, seed: int) -> None:
    """Seeded ``N(0, 1/fan_in)`` matrices, ``N(0, 0.1)`` vectors (biases, DeepSeek-V3's correction bias)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in list(module.named_parameters()) + list(module.named_buffers()):
            if p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def hf_block(family: str, seed: int = 0) -> torch.nn.Module:
    """A transformers block of ``family`` (H = I = 128, tiny_config's sizes; gpt-oss H = I = 64), float32, eval."""
    if family == "gpt_oss":
        config = transformers.GptOssConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                                           num_experts_per_tok=2, head_dim=32)
    else:
        config = tiny_config(family)
    config._experts_implementation = "eager"
    mod, cls = BLOCKS[family]
    module = __import__(f"transformers.models.{mod}.modeling_{mod}", fromlist=[cls])
    block = getattr(module, cls)(config).eval()
    _reinit(block, seed)
    return block


def hf_out(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's hidden states ``[B, S, H]`` (Llama 4's and gpt-oss's blocks also return router logits / scores)."""
    out = block(x)
    return (out[0] if isinstance(out, tuple) else out).reshape(x.shape)


def _x(H: int, seed: int = 1, shape=(2, 5)) -> torch.Tensor:
    return torch.randn(*shape, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(BLOCKS))
def test_equals_transformers_block(family):
    """``from_hf_block`` and ``load_state_dict(hf.state_dict())`` of another block: transformers' names, shapes and
    values, and the block's output within 1e-5; the state loads back into transformers' block."""
    hf = hf_block(family)
    x = _x(64 if family == "gpt_oss" else 128)
    with torch.no_grad():
        ref = hf_out(hf, x)
    assert ref.abs().mean() > 0.05  # O(1) outputs: a wrong expert or a missing shared MLP would show
    block = MoEBlock.from_hf_block(hf)
    assert isinstance(block, moe_torch.MoEBlock)
    want = {k: (tuple(v.shape), v.dtype) for k, v in hf.state_dict().items()}
    assert {k: (tuple(v.shape), v.dtype) for k, v in block.state_dict().items()} == want
    with torch.no_grad():
        out = block(x)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert_rel_fro(out, ref, F32_REL_FRO, f"{family}: MoEBlock.from_hf_block vs transformers")

    other = MoEBlock.from_hf_block(hf_block(family, seed=7))  # other weights, then transformers' state
    with torch.no_grad():
        assert rel_fro(other(x), ref) > 0.1
    other.load_state_dict(hf.state_dict())
    for k, v in hf.state_dict().items():
        assert_exact(other.state_dict()[k], v, f"{family}: {k} after load_state_dict")
    with torch.no_grad():
        assert_rel_fro(other(x), ref, F32_REL_FRO, f"{family}: MoEBlock.load_state_dict(hf.state_dict())")

    back = hf_block(family, seed=9)  # and back: transformers' block loads ours
    back.load_state_dict(block.state_dict())
    with torch.no_grad():
        assert_exact(hf_out(back, x), ref, f"{family}: transformers' block after load_state_dict(ours)")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_gradients_equal_transformers(family):
    """The same loss through both blocks: every parameter's gradient (transformers' names) and the input's."""
    hf = hf_block(family)
    block = MoEBlock.from_hf_block(hf_block(family, seed=3))
    block.load_state_dict(hf.state_dict())
    x = _x(128, shape=(2, 3))
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    grads = []
    for m in (hf, block):
        xi = x.clone().requires_grad_(True)
        (hf_out(m, xi) * w).sum().backward()
        grads.append({"x": xi.grad, **{n: p.grad for n, p in m.named_parameters()}})
    ref, got = grads
    assert set(got) == set(ref)
    for name in ref:
        assert_rel_fro(got[name], ref[name], GRAD_F32_REL_FRO, f"{family}: d loss / d {name}")


@pytest.mark.parametrize("preset, overrides", [
    ("tiny", dict(hidden_size=128, intermediate_size=64)),  # DeepSeek-V3's routing, a shared expert
    ("qwen3-30b-a3b", dict(hidden_size=64, intermediate_size=32, num_experts=8)),
    ("qwen3-next-80b-a3b", dict(hidden_size=64, intermediate_size=32, num_experts=16, topk=4)),
    ("llama4-scout", dict(hidden_size=64, intermediate_size=32, num_experts=8)),
    ("gpt-oss-20b", dict(hidden_size=64, intermediate_size=64, num_experts=8)),
])
def test_equals_jax_block(preset, overrides):
    """``from_preset`` with one seed holds the JAX block's bits; both blocks' outputs agree within 1e-5. A JAX block's
    arrays through DLPack (``EPMoE`` + ``MoEBlock``, the JAX constructor's arguments) give the same torch block."""
    jb = moe_pallas.MoEBlock.from_preset(preset, seed=2, dtype=jnp.float32, **overrides)
    tb = MoEBlock.from_preset(preset, seed=2, dtype=torch.float32, **overrides)
    assert tb.config == jb.config
    E, I = jb.config.num_experts, jb.config.intermediate_size
    assert_exact(tb.router_module.weight, jb.router_weight[...], f"{preset}: router weight")
    w13 = np.asarray(jb.layer.w13[...])
    w13_torch = tb.experts.w13  # [E, 2I, H] (a view of the in-by-out families' [E, H, 2I])
    assert_exact(w13_torch.contiguous(), w13[:E], f"{preset}: routed experts' w13")
    if jb.config.num_fused_shared_experts:
        shared = tb.shared_expert if hasattr(tb, "shared_expert") else tb.shared_experts
        assert_exact(shared.gate_proj.weight[:I], w13[E, :I], f"{preset}: shared expert 0's gate rows")
    x = np.random.default_rng(5).standard_normal((2, 4, jb.config.hidden_size)).astype(np.float32)
    ref = jb(jnp.asarray(x))
    with torch.no_grad():
        out = tb(torch.from_numpy(x))
    assert_rel_fro(out, ref, F32_REL_FRO, f"{preset}: moe_torch.MoEBlock vs moe_pallas.MoEBlock")
    # the router losses beside the output (seq_len = S by default in both)
    ref_out, ref_losses = jb(jnp.asarray(x), return_router_losses=True)
    with torch.no_grad():
        got_out, got_losses = tb(torch.from_numpy(x), return_router_losses=True)
    assert_exact(got_out, out, f"{preset}: the output with the losses")
    assert_exact(got_losses.tokens_per_expert, ref_losses.tokens_per_expert, f"{preset}: tokens_per_expert")
    for name in ("aux_loss", "seq_aux_loss", "z_loss"):
        assert_rel_fro(getattr(got_losses, name), getattr(ref_losses, name), F32_REL_FRO, f"{preset}: {name}")

    m = jb.layer

    def t(v):
        return None if v is None else to_torch(v[...])

    layer = EPMoE(jb.config, t(m.w13), t(m.w2), w13_bias=t(m.w13_bias), w2_bias=t(m.w2_bias),
                  e_score_correction_bias=t(m.e_score_correction_bias), shared_expert_gate=t(m.shared_expert_gate))
    via_dlpack = MoEBlock(t(jb.router_weight), layer, router_bias=t(jb.router_bias))
    for k, v in tb.state_dict().items():
        assert_exact(via_dlpack.state_dict()[k], v, f"{preset}: {k} through DLPack")
    with torch.no_grad():
        assert_exact(via_dlpack(torch.from_numpy(x)), out, f"{preset}: the DLPack-built block")
        # [T, H] in: another T, another blocking of the CPU GEMMs (a few ulps)
        assert_rel_fro(via_dlpack(torch.from_numpy(x[0])), out[0], F32_REL_FRO, f"{preset}: [T, H] hidden states")
        assert_rel_fro(via_dlpack.router_logits(torch.from_numpy(x)), jb.router_logits(jnp.asarray(x)), F32_REL_FRO,
                       f"{preset}: router_logits (float32 dots in two summation orders)")


def test_fp8_equals_hf_drop_in():
    """FP8: the routed experts quantized, the shared MLP float, as ``HFMoEBlock(quant='fp8_block')``; FP8 codes are
    buffers, kept (and the DeepSeek-V3 router kept float32) under ``.to(torch.bfloat16)``."""
    hf = hf_block("deepseek_v3")
    block = MoEBlock.from_hf_block(hf, quant="fp8_block")
    drop_in = moe_torch.HFMoEBlock(hf_block("deepseek_v3"), quant="fp8_block")
    assert block.experts.gate_up_proj.dtype == torch.float8_e4m3fn and block.config.quant == "fp8_block"
    assert "experts.gate_up_proj_scale_inv" in block.state_dict()
    assert_exact(block.experts.gate_up_proj, drop_in.experts.gate_up_proj, "FP8 codes")
    x = _x(128)
    with torch.no_grad():
        assert_rel_fro(block(x), drop_in(x), F32_REL_FRO, "MoEBlock(fp8_block) vs HFMoEBlock(fp8_block)")
    block.to(torch.bfloat16)
    assert block.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert block.gate.weight.dtype == torch.float32 and block.gate.e_score_correction_bias.dtype == torch.float32
    assert block.shared_experts.gate_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert block(x.bfloat16()).dtype == torch.bfloat16


def _msg(exc_info) -> str:
    return str(exc_info.value)


def test_bad_inputs_raise_clear_errors():
    block = MoEBlock.from_preset("qwen3-30b-a3b", dtype=torch.float32, hidden_size=64, intermediate_size=32,
                                 num_experts=8)
    x = _x(64)
    with pytest.raises(TypeError) as e:
        block(x.numpy())
    assert "MoEBlock: hidden_states must be a torch.Tensor" in _msg(e) and "torch.from_numpy(hidden_states)" in _msg(e)
    with pytest.raises(ValueError) as e:
        block(torch.zeros(2, 5, 32))
    assert _msg(e) == ("MoEBlock: hidden_states must be [B, S, H] or [T, H] with H=64; "
                       "got hidden_states.shape=(2, 5, 32)")
    with pytest.raises(ValueError, match=r"MoEBlock: hidden_states must be \[B, S, H\] or \[T, H\] with H=64; got "
                                         r"hidden_states.shape=\(1, 2, 5, 64\)"):
        block(torch.zeros(1, 2, 5, 64))
    with pytest.raises(ValueError, match=r"hidden_states.shape=\(64,\)"):
        block(torch.zeros(64))
    with pytest.raises(TypeError, match="MoEBlock: hidden_states must have the experts' dtype float32 "
                                        r"\(quant='none'\); got hidden_states.dtype=bfloat16"):
        block(x.bfloat16())
    with pytest.raises(TypeError, match="MoEBlock: hidden_states must have dtype .*got hidden_states.dtype=int32"):
        block(torch.zeros(2, 5, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"hidden_states.shape=\(2, 5, 32\)"):
        block.router_logits(torch.zeros(2, 5, 32))
    with pytest.raises(ValueError, match="MoEBlock: seq_len is read only with return_router_losses=True"):
        block(x, seq_len=5)
    with pytest.raises(TypeError, match="MoEBlock: return_router_losses must be a bool"):
        block(x, return_router_losses=1)


def test_bad_constructions_raise_clear_errors():
    layer = EPMoE.from_preset("tiny", dtype=torch.float32)  # DeepSeek-V3's routing, E=16, H=256, a shared expert
    E, H = layer.config.num_experts, layer.config.hidden_size
    w = torch.zeros(E, H)
    with pytest.raises(TypeError, match="MoEBlock: layer must be a moe_torch.EPMoE; got "
                                        "torch.nn.modules.linear.Linear"):
        MoEBlock(w, torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"MoEBlock: router_weight must be a torch.Tensor .*numpy.ndarray"):
        MoEBlock(w.numpy(), layer)
    with pytest.raises(ValueError) as e:
        MoEBlock(torch.zeros(H, E), layer)
    assert _msg(e) == ("MoEBlock: router_weight must be [E, H] = (16, 256) (the router of the layer's config); "
                       "got router_weight.shape=(256, 16)")
    with pytest.raises(ValueError, match=r"MoEBlock: router_bias must be \[E\] = \(16,\) float32 .*got "
                                         r"router_bias.shape=\(15,\)"):
        MoEBlock(w, layer, router_bias=torch.zeros(15))
    with pytest.raises(TypeError, match="MoEBlock: router_bias must have dtype float32; got "
                                        "router_bias.dtype=bfloat16"):
        MoEBlock(w, layer, router_bias=torch.zeros(E, dtype=torch.bfloat16))
    rank0 = EPMoE.from_preset("tiny", dtype=torch.float32, ep_size=2, ep_rank=0)
    with pytest.raises(ValueError, match="MoEBlock: layer must hold the whole layer .*got ep_size=2"):
        MoEBlock(w, rank0)
    with pytest.raises(ValueError, match="MoEBlock.from_preset: ep_size must be 1 .*got ep_size=2"):
        MoEBlock.from_preset("tiny", ep_size=2)
    fp8 = EPMoE.from_preset("tiny", dtype=torch.bfloat16, quant="fp8_block")
    with pytest.raises(ValueError, match=r"MoEBlock: an FP8 layer \(quant='fp8_block'\) with S=1 fused shared experts.*"
                                         r"MoEBlock.from_float"):
        MoEBlock(w, fp8)
    with pytest.raises(NotImplementedError, match=r"MoEBlock: layer.config.quant must be one of \('none', "
                                                  r"'fp8_per_token', 'fp8_block'\).*got quant='mxfp4'"):
        MoEBlock(torch.zeros(8, 64), EPMoE.from_preset("gpt-oss-20b", hidden_size=64, intermediate_size=64,
                                                       num_experts=8, quant="mxfp4"))
    with pytest.raises(NotImplementedError,
                       match="MoEBlock.from_float: config.quant must be one of .*got quant='int4'"):
        MoEBlock.from_preset("tiny", quant="int4")
    with pytest.raises(NotImplementedError, match=r"MoEBlock.from_hf_block: block must be one of transformers' .*"
                                                  r"torch.nn.modules.linear.Linear"):
        MoEBlock.from_hf_block(torch.nn.Linear(2, 2))


@needs_triton_interpreter
@pytest.mark.parametrize("family", ["deepseek_v3", "llama4"])
def test_triton_implementation(family):
    """``implementation="triton"`` (the interpreter on the CPU): the kernels on the block's tensors (Llama 4's experts
    through their transposed in-by-out views) give transformers' output within 1e-5."""
    hf = hf_block(family).to(TORCH_DEVICE)
    block = MoEBlock.from_hf_block(hf, implementation="triton")
    assert block.implementation == "triton"
    x = _x(128, shape=(1, 4)).to(TORCH_DEVICE)
    with torch.no_grad():
        assert_rel_fro(block(x), hf_out(hf, x), F32_REL_FRO, f"{family}: MoEBlock(implementation='triton')")
