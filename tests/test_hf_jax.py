"""The JAX Hugging Face drop-in: ``interop.hf_jax.load_nnx_moe_block`` and ``examples/jax_hf_model.py``.

Tiny random transformers 5.24 models (``MixtralForCausalLM``, ``Qwen3MoeForCausalLM``,
``DeepseekV3ForCausalLM``: hidden 64, 2 layers, vocab 128, E = 4 / 8 / 8, float32), re-initialised
with seeded ``N(0, 1/fan_in)`` weights (transformers' own init, ``N(0, 0.02)``, leaves the router
near uniform and the MoE output ~1e-3 of the residual: a wrong expert would hardly show), written by
``save_pretrained`` and read back by our loaders; nothing is downloaded.

- The block (router + our layer) equals the transformers block on random ``[B, S, H]`` hidden
  states: float32, ``||out - ref|| / ||ref|| <= F32_REL_FRO`` (1e-5; CONTRACT.md section 7: the same
  float32 arithmetic in another summation order).
- The example model's logits equal the transformers model's, same limit, for all three families
  (attention, rope, norms, dense and MoE layers, head); a control shows the MoE blocks move the
  logits by far more than the limit.
- bf16 (DeepSeek-V3): our logits no further from float32 than twice transformers' own bf16 model's.
- ``implementation="pallas_triton"`` (interpreted on the CPU) for DeepSeek-V3: the same limit.
- FP8: a DeepSeek-V3 checkpoint in the released format (float8_e4m3fn ``weight`` + 128x128
  ``weight_scale_inv`` for every projection) loads as a ``quant='fp8_block'`` block holding the
  file's codes and scales bit for bit; the block and the model's logits equal transformers run on the
  dequantized weights with the contract's per-128-group FP8 activation quantization patched into its
  experts, within the float32 limit.
"""

from __future__ import annotations

import importlib.util
import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from common import DEVICE
from interop.hf_jax import load_nnx_moe_block
from jax_dots import assert_float32_dots_highest
from moe_pallas.module import MoEBlock
from tolerances import F32_REL_FRO, FP8_REL_FRO, assert_exact, assert_rel_fro, rel_fro

transformers = pytest.importorskip("transformers")

_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "jax_hf_model.py")
_spec = importlib.util.spec_from_file_location("jax_hf_model", _EXAMPLE)
jax_hf_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(jax_hf_model)

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_experts_per_tok=2,
              max_position_embeddings=64)
#: arch -> (transformers class name prefix, config, the decoder layers with experts)
ARCHS = {
    # Mixtral: GQA (4 query / 2 kv heads), E=4, top-2 renormalised softmax, every layer MoE.
    "mixtral": ("Mixtral", dict(intermediate_size=32, num_key_value_heads=2, num_local_experts=4), (0, 1)),
    # Qwen3-MoE: per-head q/k norm, head_dim 24 != H / heads (= 16), E=8, norm_topk_prob off,
    # layer 0 dense through mlp_only_layers.
    "qwen3_moe": ("Qwen3Moe", dict(intermediate_size=48, moe_intermediate_size=32, num_key_value_heads=2, head_dim=24,
                                   num_experts=8, norm_topk_prob=False, mlp_only_layers=[0]), (1,)),
    # DeepSeek-V3: MLA (q_lora_rank, kv_lora_rank, interleaved rope), E=8 in 4 groups, top-2 groups, rsf 2.5,
    # one shared expert, layer 0 dense (first_k_dense_replace=1).
    "deepseek_v3": ("DeepseekV3", dict(intermediate_size=48, moe_intermediate_size=32, num_key_value_heads=4,
                                       n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2,
                                       routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=32,
                                       kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16), (1,)),
}


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Seeded ``N(0, 1/fan_in)`` for every matrix (fan_in = last dim; embeddings N(0, 1)), norms
    ``1 + N(0, 0.1)``, DeepSeek's correction bias ``N(0, 0.1)`` (negative scores included: transformers
    5.24 masks dropped groups with -inf, as the contract does)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def _build(arch: str, folder: str, seed: int = 0, **extra):
    name, cfg, _ = ARCHS[arch]
    config = getattr(transformers, f"{name}Config")(**{**COMMON, **cfg, **extra})
    config._experts_implementation = "eager"
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    _reinit(model, seed)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (the transformers model, its save_pretrained folder)."""
    out = {}
    for i, arch in enumerate(ARCHS):
        folder = str(tmp_path_factory.mktemp(arch))
        out[arch] = (_build(arch, folder, seed=i), folder)
    return out


def _ids(seed: int, shape=(2, 7)):
    return np.random.default_rng(seed).integers(0, COMMON["vocab_size"], size=shape)


def _hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


def _jax_logits(model, ids) -> np.ndarray:
    return np.asarray(nnx.jit(lambda m, i: m(i))(model, jnp.asarray(ids, jnp.int32)))


@nnx.jit
def run(block, x):
    """``block(x)`` under ``nnx.jit``: one compile instead of an eager compile per op (3x faster here)."""
    return block(x)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_block_equals_transformers_block(arch, checkpoints):
    """``load_nnx_moe_block(folder, layer)`` vs the transformers block of that layer on the same
    ``[B, S, H]`` hidden states; the routing comes from config.json (topk, groups, rsf, renormalize)."""
    hf, folder = checkpoints[arch]
    moe_layers = ARCHS[arch][2]
    x = torch.randn(3, 5, COMMON["hidden_size"], generator=torch.Generator().manual_seed(1))
    for layer in moe_layers:
        block = load_nnx_moe_block(folder, layer)
        assert isinstance(block, MoEBlock) and block.config.quant == "none"
        assert block.config.topk == 2 and block.config.num_fused_shared_experts == (arch == "deepseek_v3")
        with torch.no_grad():
            ref = hf.model.layers[layer].mlp(x).numpy()
        out = run(block, jnp.asarray(x.numpy()))
        assert out.shape == (3, 5, COMMON["hidden_size"]) and out.dtype == jnp.float32
        assert np.abs(ref).mean() > 0.1  # O(1) outputs, not a near-zero block
        assert_rel_fro(out, ref, F32_REL_FRO, f"{arch} layer {layer}: MoEBlock vs transformers")


def test_float32_router_logits_at_highest_precision(checkpoints):
    """Regression (H200): ``MoEBlock.router_logits`` multiplied a float32 router at the default precision,
    TF32-like on the GPU: the block was 7e-5 .. 2e-4 from transformers' (> F32_REL_FRO). A float32 router
    asks for ``Precision.HIGHEST``; a bf16 one keeps the default (float32 accumulation either way)."""
    _, folder = checkpoints["mixtral"]
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3, COMMON["hidden_size"])), jnp.float32)
    block = load_nnx_moe_block(folder, 0)
    dots = assert_float32_dots_highest(block.router_logits, x, at_least=1)
    assert len(dots) == 1, dots
    bf16 = load_nnx_moe_block(folder, 0, dtype=jnp.bfloat16)
    dots = assert_float32_dots_highest(bf16.router_logits, x.astype(jnp.bfloat16), at_least=0)
    assert dots == [("bfloat16", "bfloat16", None)], dots


def test_block_ep_ranks_sum_to_the_block(checkpoints):
    """DeepSeek-V3 with ``ep_size=2``: each rank's block holds its 4 routed experts (rank 1 also the shared
    one) and the two partial outputs sum to the single-device block."""
    _, folder = checkpoints["deepseek_v3"]
    x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 4, COMMON["hidden_size"])), jnp.float32)
    whole = run(load_nnx_moe_block(folder, 1), x)
    ranks = [load_nnx_moe_block(folder, 1, ep_size=2, ep_rank=r) for r in range(2)]
    assert [b.layer.w13[...].shape[0] for b in ranks] == [4, 5]
    assert_rel_fro(run(ranks[0], x) + run(ranks[1], x), whole, F32_REL_FRO, "rank 0 + rank 1 vs single device")


def test_block_errors(checkpoints):
    _, folder = checkpoints["mixtral"]
    with pytest.raises(TypeError) as e:
        load_nnx_moe_block(folder, dtype="int8")
    assert str(e.value) == ("load_nnx_moe_block: dtype must be None or one of ('float32', 'bfloat16', 'float16'); "
                            "got dtype='int8'")
    block = load_nnx_moe_block(folder, dtype=jnp.bfloat16)
    assert block.layer.w13[...].dtype == jnp.bfloat16 and block.router_weight[...].dtype == jnp.bfloat16
    router = block.router_weight[...]
    with pytest.raises(ValueError) as e:
        MoEBlock(router[:, :32], block.layer)
    assert str(e.value) == ("MoEBlock: router_weight must be [E, H] = (4, 64) (the router of the layer's config); "
                            "got router_weight.shape=(4, 32)")
    with pytest.raises(TypeError) as e:
        MoEBlock(router.astype(jnp.int32), block.layer)
    assert str(e.value) == "MoEBlock: router_weight must have dtype float32 or bfloat16 or float16; got router_weight.dtype=int32"
    with pytest.raises(TypeError) as e:
        MoEBlock(router, block)
    assert str(e.value) == "MoEBlock: layer must be a moe_pallas.MoELayer; got moe_pallas.module.MoEBlock"
    with pytest.raises(ValueError) as e:
        block(jnp.zeros((2, 3, 65), jnp.bfloat16))
    assert str(e.value) == "MoEBlock: hidden_states must be [B, S, H] or [T, H] with H=64; got hidden_states.shape=(2, 3, 65)"
    with pytest.raises(TypeError) as e:  # quant='none': the layer's dtype
        block(jnp.ones((2, 3, 64), jnp.float32))
    assert str(e.value) == ("MoEBlock: hidden_states must have the layer's dtype bfloat16 (quant='none'); "
                            "got hidden_states.dtype=float32")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_example_model_logits_equal_transformers(arch, checkpoints):
    """The example's whole decoder (embedding, attention, norms, dense + MoE MLPs, head) from the
    checkpoint equals the transformers model's logits; rolling each MoE router's rows (another expert
    per token) moves the logits by > 100x the limit, so the comparison sees the MoE blocks."""
    hf, folder = checkpoints[arch]
    ids = _ids(2)
    ref = _hf_logits(hf, ids)
    model = jax_hf_model.load_model(folder)
    assert model.arch == arch and len(model.moe_blocks) == len(ARCHS[arch][2])
    out = _jax_logits(model, ids)
    assert out.shape == (2, 7, COMMON["vocab_size"]) and out.dtype == np.float32
    assert_rel_fro(out, ref, F32_REL_FRO, f"{arch}: example model vs transformers logits")
    for block in model.moe_blocks:
        block.router_weight[...] = jnp.roll(block.router_weight[...], 1, axis=0)
    assert rel_fro(_jax_logits(model, ids), ref) > 100 * F32_REL_FRO


@pytest.mark.parametrize("arch", list(ARCHS))
def test_example_model_float32_matmuls_at_highest_precision(arch, checkpoints):
    """Regression (H200): the example's float32 matmuls (projections, attention, head, router) used the
    default precision, TF32-like on the GPU: the logits were 6e-4 .. 8e-4 from transformers' (> F32_REL_FRO).
    Every float32 dot of the float32 model asks for ``Precision.HIGHEST``; the bf16 model's bf16 dots keep
    the default (DeepSeek-V3's float32 router: HIGHEST)."""
    _, folder = checkpoints[arch]
    ids = jnp.asarray(_ids(2), jnp.int32)
    model = jax_hf_model.load_model(folder)
    assert_float32_dots_highest(model, ids, at_least=10)
    if arch == "deepseek_v3":
        dots = assert_float32_dots_highest(jax_hf_model.load_model(folder, dtype=jnp.bfloat16), ids, at_least=1)
        assert sum(d == ("bfloat16", "bfloat16", None) for d in dots) >= 10, dots  # bf16 stays bf16


def test_example_model_bf16_no_worse_than_transformers_bf16(checkpoints):
    """DeepSeek-V3 in bf16 (weights, activations; router and correction bias float32, as transformers keeps
    them): our logits' error against the float32 transformers model is at most twice that of transformers'
    own bf16 model (``from_pretrained(dtype=torch.bfloat16)``), the rule of flash-attention's tests
    (measured: 1.14e-2 both)."""
    hf, folder = checkpoints["deepseek_v3"]
    ids = _ids(8)
    ref = _hf_logits(hf, ids)
    model = jax_hf_model.load_model(folder, dtype=jnp.bfloat16)
    block = model.moe_blocks[0]
    assert block.layer.w13[...].dtype == jnp.bfloat16 and block.router_weight[...].dtype == jnp.float32
    out = _jax_logits(model, ids)
    assert out.dtype == jnp.bfloat16
    hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                                experts_implementation="eager").eval()
    with torch.no_grad():
        ref_bf16 = hf_bf16(torch.from_numpy(ids)).logits.float().numpy()
    assert rel_fro(out, ref) <= 2 * rel_fro(ref_bf16, ref), (rel_fro(out, ref), rel_fro(ref_bf16, ref))


def test_example_model_pallas_triton(checkpoints):
    """DeepSeek-V3 (grouped biased gate, shared expert) with every MoE stage on the Pallas-Triton kernels
    (interpreted on the CPU): the transformers logits within the float32 limit."""
    hf, folder = checkpoints["deepseek_v3"]
    ids = _ids(3, (1, 9))
    model = jax_hf_model.load_model(folder, implementation="pallas_triton")
    assert all(b.layer.implementation == "pallas_triton" for b in model.moe_blocks)
    assert_rel_fro(_jax_logits(model, ids), _hf_logits(hf, ids), F32_REL_FRO, "pallas_triton model vs transformers")


# --- FP8 ------------------------------------------------------------------------------------------


def _quantize_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float32 -> (float8_e4m3fn codes, ``[ceil(N/128), ceil(K/128)]`` float32 multipliers), DeepSeek-V3's format."""
    N, K = w.shape
    nb, kb = -(-N // 128), -(-K // 128)
    pad = torch.zeros(nb * 128, kb * 128)
    pad[:N, :K] = w
    blocks = pad.reshape(nb, 128, kb, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.reshape(nb * 128, kb * 128)[:N, :K].contiguous(), scale.float()


FP8_H = 128


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """DeepSeek-V3 with hidden 128 and moe_intermediate_size 128 (fp8_block needs H and I multiples of 128) saved twice: in the
    released FP8 format (every projection of the decoder layers FP8 + ``weight_scale_inv``, router, norms,
    embeddings and head float; ``quantization_config`` in config.json) and with those weights dequantized,
    which transformers loads as the reference. Returns (reference model, fp8 folder, fp8 tensors)."""
    float_dir, fp8_dir, deq_dir = (str(tmp_path_factory.mktemp(n)) for n in ("float", "fp8", "deq"))
    _build("deepseek_v3", float_dir, seed=7, hidden_size=FP8_H, moe_intermediate_size=128)
    tensors = load_file(os.path.join(float_dir, "model.safetensors"))
    fp8, deq = {}, {}
    for key, w in tensors.items():
        if key.startswith("model.layers.") and (key.endswith("proj.weight") or key.endswith("proj_with_mqa.weight")):
            q, s = _quantize_block(w)
            fp8[key], fp8[key + "_scale_inv"] = q, s
            deq[key] = (q.float() * s.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]])
        else:
            fp8[key] = deq[key] = w
    with open(os.path.join(float_dir, "config.json")) as f:
        config = json.load(f)
    for folder, t, extra in ((fp8_dir, fp8, {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                                     "activation_scheme": "dynamic",
                                                                     "weight_block_size": [128, 128]}}),
                             (deq_dir, deq, {})):
        save_file(t, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({**config, **extra}, f)
    load = lambda: transformers.AutoModelForCausalLM.from_pretrained(deq_dir, experts_implementation="eager").eval()
    plain, emulated = load(), load()
    _emulate_fp8_activations(emulated.model.layers[1].mlp)
    return plain, emulated, fp8_dir, fp8


def _fp8_group_qdq(x: torch.Tensor) -> torch.Tensor:
    """CONTRACT.md section 3's per-token-group FP8 quantization (1 x 128, float32), dequantized again."""
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // 128, 128)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) * torch.tensor(1 / 448, dtype=torch.float32)
    return ((g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape)


def _emulate_fp8_activations(block) -> None:
    """Make a transformers DeepseekV3MoE quantize its expert inputs and intermediates as our fp8_block
    layer does (the weights are already the dequantized FP8 ones): the routed experts' eager loop and
    the shared experts' MLP, each GEMM input through :func:`_fp8_group_qdq`."""
    experts, shared = block.experts, block.shared_experts

    def experts_forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(experts.num_experts):
            tok, pos = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            gate, up = torch.nn.functional.linear(_fp8_group_qdq(hidden_states[tok]), experts.gate_up_proj[e]).chunk(2, -1)
            y = torch.nn.functional.linear(_fp8_group_qdq(experts.act_fn(gate) * up), experts.down_proj[e])
            out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
        return out

    def shared_forward(x):
        xq = _fp8_group_qdq(x)
        return shared.down_proj(_fp8_group_qdq(shared.act_fn(shared.gate_proj(xq)) * shared.up_proj(xq)))

    experts.forward, shared.forward = experts_forward, shared_forward


def test_fp8_checkpoint_stays_fp8(fp8_checkpoint):
    """The block holds the checkpoint's FP8 codes and block scales bit for bit (gate rows then up rows,
    the shared expert last). It, and the whole example model, equal transformers on the dequantized
    weights with its expert inputs and intermediates quantized per 1x128 group as CONTRACT.md section 3
    says (``_emulate_fp8_activations``) within the float32 limit (measured 3e-7 / 4e-7: the same FP8 codes
    on both sides, only float32 summation orders differ); against transformers without that emulation the
    error is the activation quantization's, 4e-2.

    On a GPU the float32 limit holds for the ``reference`` stages (XLA, float32 products at
    ``Precision.HIGHEST``): the default FP8 GEMMs there are Hopper FP8 tensor-core chains (wgmma), whose
    accumulator keeps about 14 bits within each 128-wide K step (README, "Numerics"); the re-quantized
    intermediate then moves a few FP8 codes (the block was 2.96e-3 off on an H200, its float32 router then
    TF32-like too). Those kernels are held to the contract's FP8 bound against the same emulated reference."""
    plain, emulated, folder, t = fp8_checkpoint
    exact_impl = "reference" if DEVICE == "gpu" else None  # the CPU's default stages are the reference's
    block = load_nnx_moe_block(folder, 1, implementation=exact_impl)
    layer = block.layer
    assert block.config.quant == "fp8_block" and layer.w13[...].dtype == jnp.float8_e4m3fn
    pre = "model.layers.1.mlp"

    def codes(key):
        return t[key].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)

    for e, p in ((3, f"{pre}.experts.3"), (8, f"{pre}.shared_experts")):
        assert_exact(layer.w13[...][e], np.concatenate([codes(f"{p}.gate_proj.weight"), codes(f"{p}.up_proj.weight")]),
                     f"w13 codes of expert {e}")
        assert_exact(layer.w2[...][e], codes(f"{p}.down_proj.weight"), f"w2 codes of expert {e}")
        assert_exact(layer.w13_scale[...][e], np.concatenate([t[f"{p}.gate_proj.weight_scale_inv"].numpy(),
                                                              t[f"{p}.up_proj.weight_scale_inv"].numpy()]), f"w13 scales {e}")
        assert_exact(layer.w2_scale[...][e], t[f"{p}.down_proj.weight_scale_inv"].numpy(), f"w2 scales {e}")

    x = torch.randn(2, 6, FP8_H, generator=torch.Generator().manual_seed(4))
    out = run(block, jnp.asarray(x.numpy()))
    with torch.no_grad():
        ref, ref_plain = emulated.model.layers[1].mlp(x).numpy(), plain.model.layers[1].mlp(x).numpy()
    assert_rel_fro(out, ref, F32_REL_FRO, "FP8 block vs transformers with the contract's FP8 activations")
    assert rel_fro(out, ref_plain) > 100 * F32_REL_FRO  # the activation quantization is what the emulation adds
    if DEVICE == "gpu":  # the default kernels: FP8 tensor cores
        assert_rel_fro(run(load_nnx_moe_block(folder, 1), jnp.asarray(x.numpy())), ref, FP8_REL_FRO,
                       "FP8 block, default GPU kernels, vs transformers with the contract's FP8 activations")
    dequantized = load_nnx_moe_block(folder, 1, quant="none")  # the codes times their scales, float32 weights
    assert dequantized.layer.w13[...].dtype == jnp.float32
    assert_rel_fro(run(dequantized, jnp.asarray(x.numpy())), ref_plain, F32_REL_FRO, "quant='none' from an FP8 checkpoint")

    ids = _ids(5)
    model = jax_hf_model.load_model(folder, implementation=exact_impl)
    assert model.moe_blocks[0].config.quant == "fp8_block" and model.moe_blocks[0].layer.w2[...].dtype == jnp.float8_e4m3fn
    assert_rel_fro(_jax_logits(model, ids), _hf_logits(emulated, ids), F32_REL_FRO, "FP8 example model vs transformers")
