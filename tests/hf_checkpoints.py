"""Tiny random transformers checkpoints, built on the spot (no downloads): a test helper, not a test file.

transformers 5.24's own models (``MixtralForCausalLM``, ``Qwen3MoeForCausalLM``, ``DeepseekV3ForCausalLM``;
the 2026 families of :data:`FAMILIES_2026`: ``Llama4ForCausalLM``, ``Qwen3NextForCausalLM``, ``Glm4MoeForCausalLM`` and
Kimi K2, a ``DeepseekV3ForCausalLM`` with one expert group whose config.json says ``model_type="kimi_k2"``)
at tiny sizes (``H = I = 128``, two decoder layers; layer 1 is an MoE layer in every family, layer 0 is
dense in Qwen3-MoE and DeepSeek-V3 and another MoE layer in Mixtral), every parameter re-drawn seeded
~ ``N(0, 1/fan_in)`` (so outputs are O(1)), DeepSeek-V3's ``e_score_correction_bias`` ~ ``N(0, 0.05)``. Written by transformers' ``save_pretrained``:

- ``fused=False`` (its default ``save_original_format=True``): the hub's per-expert names
  (``block_sparse_moe.experts.i.w1.weight``, ``mlp.experts.i.gate_proj.weight``);
- ``fused=True`` (``save_original_format=False``): the modules' own ``mlp.experts.gate_up_proj [E, 2I, H]``
  and ``mlp.experts.down_proj [E, H, I]``.

``fp8=True`` quantizes every expert projection (routed and shared) to DeepSeek-V3's format here (an
independent 128x128 block quantizer, :func:`quantize_fp8_block`: float8_e4m3fn codes and a float32
``weight_scale_inv`` multiplier) and adds ``quantization_config`` to config.json. ``sharded=True``
spreads the tensors round-robin over three files with a ``model.safetensors.index.json``.

Usage::

    model = make_hf_model("deepseek_v3", torch.bfloat16)
    folder = save_checkpoint(model, tmp_path / "ds", sharded=True, fp8=True, config_drop=("n_group",))
    out = hf_moe_forward(model, x)                  # [T, H], transformers' MoE block of layer 1
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import numpy as np
import torch

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
#: The 2026 families: Llama 4 (layer 0 dense, as Maverick interleaves them; sigmoid top-2 on the expert input, one
#: shared expert), Qwen3-Next (full attention only, layer 0 dense; a shared expert of 2 * I: two fused experts, and
#: its sigmoid gate), GLM-4.5 (DeepSeek-V3's router with one group, rsf 2.5, a shared expert) and Kimi K2
#: (DeepseekV3ForCausalLM, n_group = topk_group = 1, rsf 2.827).
FAMILIES_2026 = ("llama4", "qwen3_next", "glm4_moe", "kimi_k2")
#: config.json's model_type where transformers has no class of that name (save_checkpoint(model_type=...)).
MODEL_TYPES = {"kimi_k2": "kimi_k2"}
H = 128  # hidden size: a multiple of the FP8 block
I = 128  # expert intermediate size: a multiple of the FP8 block
#: Routed experts per family: DeepSeek-V3's 16 fit its default grouping (n_group=8 groups of 2, topk_group=4)
#: and Qwen3-MoE's 8 its default topk=8, so configs without those keys still load (Mixtral-8x7B has 8).
NUM_EXPERTS = {"mixtral": 8, "qwen3_moe": 8, "deepseek_v3": 16, "llama4": 8, "qwen3_next": 8, "glm4_moe": 8,
               "kimi_k2": 16}
MOE_LAYER = 1
FP8_BLOCK = 128
FP8_MAX = 448.0


def tiny_config(family: str, **overrides):
    """The transformers config of a tiny ``family`` model (``overrides`` last)."""
    import transformers

    common = dict(vocab_size=32, hidden_size=H, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  max_position_embeddings=64)
    if family == "mixtral":
        kw = dict(intermediate_size=I, num_local_experts=NUM_EXPERTS[family], num_experts_per_tok=2)
        cls = transformers.MixtralConfig
    elif family == "qwen3_moe":
        kw = dict(intermediate_size=2 * I, moe_intermediate_size=I, num_experts=NUM_EXPERTS[family],
                  num_experts_per_tok=2, norm_topk_prob=True, head_dim=64, mlp_only_layers=[0])
        cls = transformers.Qwen3MoeConfig
    elif family == "deepseek_v3":
        kw = dict(intermediate_size=2 * I, moe_intermediate_size=I, n_routed_experts=NUM_EXPERTS[family],
                  num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                  norm_topk_prob=True, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                  qk_nope_head_dim=8, v_head_dim=8)
        cls = transformers.DeepseekV3Config
    elif family == "kimi_k2":  # Kimi-K2-Instruct's routing: one group, rsf 2.827, one shared expert
        kw = dict(intermediate_size=2 * I, moe_intermediate_size=I, n_routed_experts=NUM_EXPERTS[family],
                  num_experts_per_tok=4, n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.827,
                  norm_topk_prob=True, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                  qk_nope_head_dim=8, v_head_dim=8)
        cls = transformers.DeepseekV3Config
    elif family == "glm4_moe":
        kw = dict(intermediate_size=2 * I, moe_intermediate_size=I, n_routed_experts=NUM_EXPERTS[family],
                  num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
                  norm_topk_prob=True, first_k_dense_replace=1, head_dim=64)
        cls = transformers.Glm4MoeConfig
    elif family == "qwen3_next":
        kw = dict(intermediate_size=2 * I, moe_intermediate_size=I, shared_expert_intermediate_size=2 * I,
                  num_experts=NUM_EXPERTS[family], num_experts_per_tok=2, norm_topk_prob=True, head_dim=64,
                  layer_types=["full_attention"] * 2, mlp_only_layers=[0])
        cls = transformers.Qwen3NextConfig
    elif family == "llama4":  # interleave_moe_layer_step=2: moe_layers = [1], layer 0 a dense Llama4TextMLP
        kw = dict(intermediate_size=I, intermediate_size_mlp=2 * I, num_local_experts=NUM_EXPERTS[family],
                  num_experts_per_tok=2, head_dim=64, interleave_moe_layer_step=2)
        cls = transformers.Llama4TextConfig
    else:
        raise ValueError(f"tiny_config: family must be one of {FAMILIES + FAMILIES_2026}; got {family!r}")
    config = cls(**{**common, **kw, **overrides})
    config._experts_implementation = "eager"  # the plain per-expert loop (no kernels)
    return config


def make_hf_model(family: str, dtype: torch.dtype = torch.float32, *, seed: int = 0, **overrides):
    """A tiny random ``family`` causal LM (transformers 5.24), eval mode, in ``dtype`` (DeepSeek-V3's, Kimi K2's and
    GLM-4.5's routers stay float32, as transformers keeps them)."""
    import transformers

    config = tiny_config(family, **overrides)
    cls = {"mixtral": transformers.MixtralForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
           "deepseek_v3": transformers.DeepseekV3ForCausalLM, "kimi_k2": transformers.DeepseekV3ForCausalLM,
           "glm4_moe": transformers.Glm4MoeForCausalLM, "qwen3_next": transformers.Qwen3NextForCausalLM,
           "llama4": transformers.Llama4ForCausalLM}[family]
    torch.manual_seed(seed)
    model = cls(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    model = model.to(dtype)
    if family in ("deepseek_v3", "kimi_k2", "glm4_moe"):  # the router in float32 (_keep_in_fp32_modules_strict)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "e_score_correction_bias"):
                layer.mlp.gate.float()
    return model


def moe_block(model, layer: int = MOE_LAYER):
    """transformers' MoE block of decoder layer ``layer`` (Llama 4's is ``feed_forward``)."""
    decoder = model.model.layers[layer]
    return decoder.feed_forward if hasattr(decoder, "feed_forward") else decoder.mlp


@torch.no_grad()
def hf_moe_forward(model, x: torch.Tensor, layer: int = MOE_LAYER) -> torch.Tensor:
    """transformers' MoE block of ``layer`` on ``x [T, H]`` -> ``[T, H]`` (its dtype; Llama 4's block returns
    ``(out [T, H], router_logits)``)."""
    out = moe_block(model, layer)(x[None])
    return (out[0] if isinstance(out, tuple) else out).reshape(x.shape)


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> (float8_e4m3fn codes, float32 ``weight_scale_inv [..., ceil(N/128), ceil(K/128)]``):
    per 128x128 block ``scale = amax / 448``, ``q = rne(clamp(w / scale))``; ``w ~= q * scale``."""
    w = w.float()
    N, K = w.shape[-2:]
    nN, nK = -(-N // FP8_BLOCK), -(-K // FP8_BLOCK)
    pad = torch.zeros(*w.shape[:-2], nN * FP8_BLOCK, nK * FP8_BLOCK)
    pad[..., :N, :K] = w
    blocks = pad.reshape(*w.shape[:-2], nN, FP8_BLOCK, nK, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-12) / FP8_MAX  # [..., nN, nK]
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(pad.shape)[..., :N, :K].contiguous()
    return q, scale.float()


_EXPERT_WEIGHT = re.compile(r"\.(experts\.\d+\.\w+\.weight|shared_experts?\.\w+\.weight|experts\.(gate_up_proj|down_proj))$")


def save_checkpoint(model, folder, *, sharded: bool = False, fp8: bool = False, fused: bool = False,
                    config_drop=(), config_set: dict | None = None, edit=None, model_type: str | None = None) -> str:
    """Write ``model`` as a checkpoint into ``folder`` (created; returned as a str).

    Args:
      sharded: three ``model-0000k-of-00003.safetensors`` and an index, else one ``model.safetensors``.
      fp8: expert projections as FP8 codes + ``weight_scale_inv`` (module docstring), config.json gets
        ``quantization_config`` (``{"quant_method": "fp8", "weight_block_size": [128, 128], ...}``).
      fused: transformers' fused expert names (``save_original_format=False``).
      config_drop: config.json keys to remove (e.g. ``("norm_topk_prob",)``); ``"config.json"`` removes the file.
      config_set: config.json keys to set (after ``fp8``'s quantization_config; ``None`` values kept as null).
      edit: ``fn(tensors: dict) -> None`` to change the tensors in place before they are written.
      model_type: config.json's ``model_type`` instead of the class's (``"kimi_k2"``: :data:`MODEL_TYPES`), set before
        ``config_set``.
    """
    from safetensors.torch import load_file, save_file

    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, save_original_format=not fused, max_shard_size="100GB")
        tensors = load_file(os.path.join(tmp, "model.safetensors"))
        with open(os.path.join(tmp, "config.json")) as f:
            config = json.load(f)
    if fp8:
        for key in [k for k in tensors if _EXPERT_WEIGHT.search(k)]:
            q, s = quantize_fp8_block(tensors[key])
            tensors[key] = q
            tensors[key + "_scale_inv"] = s
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    if edit is not None:
        edit(tensors)
    for name in os.listdir(folder):
        if name.endswith((".safetensors", ".json")):
            os.remove(os.path.join(folder, name))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if sharded:
        keys = sorted(tensors)
        n = 3
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            save_file({k: tensors[k] for k in keys[i::n]}, os.path.join(folder, name), metadata={"format": "pt"})
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: names[j % n] for j, k in enumerate(keys)}}
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=1)
    else:
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    if "config.json" not in config_drop:
        for key in config_drop:
            config.pop(key, None)
        if model_type is not None:
            config["model_type"] = model_type
        config.update(config_set or {})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
    return folder


def copy_checkpoint(src, dst, *, config_drop=(), config_set: dict | None = None) -> str:
    """A copy of checkpoint folder ``src`` at ``dst`` with config.json edited (as :func:`save_checkpoint`)."""
    dst = str(dst)
    shutil.copytree(str(src), dst)
    path = os.path.join(dst, "config.json")
    if "config.json" in config_drop:
        os.remove(path)
        return dst
    with open(path) as f:
        config = json.load(f)
    for key in config_drop:
        config.pop(key, None)
    config.update(config_set or {})
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    return dst
