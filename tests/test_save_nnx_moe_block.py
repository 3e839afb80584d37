"""``interop.hf_jax.save_nnx_moe_block``: a JAX ``MoEBlock`` as a checkpoint folder under transformers' names.

- Round trip through ``load_nnx_moe_block``: the same block, every array bit for bit (dtype included) and the same
  config, for Qwen3-MoE, DeepSeek-V3 (float and 128x128 block FP8: the codes and scales as held), Mixtral, Qwen3-Next,
  Llama 4 and gpt-oss (float and MXFP4).
- transformers reads it: the block class of the config.json's family (``AutoConfig.from_pretrained(folder)``) takes the
  tensors by ``load_state_dict`` (strict, the ``model.layers.L.mlp.`` prefix stripped) and computes the JAX block's
  output within ``F32_REL_FRO`` (Qwen3-MoE, DeepSeek-V3); a tiny model's config given as ``hf_config`` makes the folder
  one ``from_pretrained`` loads, layer ``L`` the saved block.
- A block no family can name (DeepSeek-V2's ``grouped_topk``, Qwen3-MoE with an ``rsf``), an ambiguous one, EP shards,
  quant modes without a checkpoint format, clashing ``hf_config`` keys and existing files raise errors naming them.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file

import moe_pallas
from hf_checkpoints import tiny_config
from interop.hf_jax import load_nnx_moe_block, save_nnx_moe_block
from tolerances import F32_REL_FRO, assert_exact, assert_rel_fro

transformers = pytest.importorskip("transformers")

#: name -> (preset, overrides, model_type) of the round trips
BLOCKS = {
    "qwen3_moe": ("qwen3-30b-a3b", dict(hidden_size=128, intermediate_size=128, num_experts=8, topk=2), "qwen3_moe"),
    "deepseek_v3": ("tiny", dict(hidden_size=128, intermediate_size=128), "deepseek_v3"),  # tiny_config's routing
    "deepseek_v3_fp8": ("tiny", dict(quant="fp8_block"), "deepseek_v3"),
    "mixtral": ("mixtral-8x7b", dict(hidden_size=64, intermediate_size=32), "mixtral"),
    "qwen3_next": ("qwen3-next-80b-a3b", dict(hidden_size=64, intermediate_size=32, num_experts=16, topk=4), None),
    "llama4": ("llama4-scout", dict(hidden_size=64, intermediate_size=32, num_experts=8), None),
    "gpt_oss": ("gpt-oss-20b", dict(hidden_size=64, intermediate_size=64, num_experts=8), None),
    "gpt_oss_mxfp4": ("gpt-oss-20b", dict(hidden_size=64, intermediate_size=64, num_experts=8, quant="mxfp4"), None),
}


def jax_block(name: str, seed: int = 0) -> moe_pallas.MoEBlock:
    preset, overrides, _ = BLOCKS[name]
    dtype = jnp.float32 if overrides.get("quant", "none") == "none" else jnp.bfloat16
    return moe_pallas.MoEBlock.from_preset(preset, seed=seed, dtype=dtype, **overrides)


def _state(block) -> dict:
    return {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(block))}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_round_trip_is_bit_exact(name, tmp_path):
    block = jax_block(name)
    folder = str(tmp_path / name)
    assert save_nnx_moe_block(block, folder, layer=3, model_type=BLOCKS[name][2]) == folder
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    back = load_nnx_moe_block(folder, 3)
    assert back.config == block.config
    want, got = _state(block), _state(back)
    assert set(got) == set(want)
    for key, v in want.items():
        assert type(got[key]) is type(v), key  # nnx.Param stays Param, FrozenWeight stays FrozenWeight
        assert np.asarray(got[key][...]).dtype == np.asarray(v[...]).dtype, key
        assert_exact(got[key][...], v[...], f"{name}: {key} after save / load")


def _hf_block(folder: str, layer: int):
    """transformers' block of the folder's config.json family, loaded from its safetensors (strict)."""
    config = transformers.AutoConfig.from_pretrained(folder)
    config._experts_implementation = "eager"
    module = {"qwen3_moe": transformers.models.qwen3_moe.modeling_qwen3_moe,
              "deepseek_v3": transformers.models.deepseek_v3.modeling_deepseek_v3}[config.model_type]
    cls = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "deepseek_v3": "DeepseekV3MoE"}[config.model_type]
    hf = getattr(module, cls)(config).eval()
    prefix = f"model.layers.{layer}.mlp."
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    assert all(k.startswith(prefix) for k in tensors)
    hf.load_state_dict({k[len(prefix):]: v for k, v in tensors.items()}, strict=True)
    return hf


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_transformers_block_reads_it(name, tmp_path):
    block = jax_block(name, seed=1)
    folder = str(tmp_path / name)
    save_nnx_moe_block(block, folder, layer=1, model_type=BLOCKS[name][2])
    hf = _hf_block(folder, 1)
    x = np.random.default_rng(2).standard_normal((2, 5, block.config.hidden_size)).astype(np.float32)
    with torch.no_grad():
        ref = hf(torch.from_numpy(x))
    assert float(ref.abs().mean()) > 0.05
    assert_rel_fro(block(jnp.asarray(x)), ref, F32_REL_FRO, f"{name}: JAX block vs transformers' block of the folder")


def test_from_pretrained_of_a_tiny_model(tmp_path):
    """With a model's config as ``hf_config`` the folder is that model's checkpoint with one MoE layer:
    ``from_pretrained`` loads it (the other weights missing, initialized) and layer 1's block is the saved one."""
    hf_cfg = tiny_config("qwen3_moe")  # H = I = 128, E = 8, top-2, norm_topk_prob, layer 0 dense
    block = jax_block("qwen3_moe", seed=3)
    folder = str(tmp_path / "model")
    save_nnx_moe_block(block, folder, layer=1, hf_config=hf_cfg.to_dict())  # model_type from hf_config
    raw = json.load(open(os.path.join(folder, "config.json")))
    assert raw["vocab_size"] == 32 and raw["mlp_only_layers"] == [0] and raw["head_dim"] == 64  # the model's keys kept
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    mlp = model.model.layers[1].mlp
    x = np.random.default_rng(4).standard_normal((1, 6, 128)).astype(np.float32)
    with torch.no_grad():
        ref = mlp(torch.from_numpy(x))
    assert_rel_fro(block(jnp.asarray(x)), ref, F32_REL_FRO, "JAX block vs from_pretrained's layer 1")
    assert load_nnx_moe_block(folder).config == block.config  # the first MoE layer is layer 1


def test_blocks_no_family_can_name(tmp_path):
    folder = str(tmp_path / "x")
    v2 = moe_pallas.MoEBlock.from_preset("tiny", dtype=jnp.float32, hidden_size=64, intermediate_size=32,
                                         routing="grouped_topk")  # DeepSeek-V2's routing: no transformers 5.24 block
    with pytest.raises(NotImplementedError) as e:
        save_nnx_moe_block(v2, folder)
    msg = str(e.value)
    assert msg.startswith("save_nnx_moe_block: no transformers family's checkpoint can name this block "
                          "('grouped_topk' routing")
    assert "deepseek_v3: it reads back with routing='biased_grouped_topk'" in msg and "qwen3_moe:" in msg
    with pytest.raises(NotImplementedError, match="save_nnx_moe_block: a deepseek_v3 checkpoint cannot name this "
                                                  "block: it reads back with routing='biased_grouped_topk'"):
        save_nnx_moe_block(v2, folder, model_type="deepseek_v3")
    rsf = moe_pallas.MoEBlock.from_preset("qwen3-30b-a3b", dtype=jnp.float32, hidden_size=64, intermediate_size=32,
                                          num_experts=8, routed_scaling_factor=2.5)
    with pytest.raises(NotImplementedError, match=r"save_nnx_moe_block: a qwen3_moe checkpoint cannot name this block: "
                                                  r"it reads back with routed_scaling_factor=1.0 .*the block has "
                                                  r"routed_scaling_factor=2.5"):
        save_nnx_moe_block(rsf, folder, model_type="qwen3_moe")
    biased = moe_pallas.MoEBlock(rsf.router_weight[...], rsf.layer, router_bias=jnp.zeros(8, jnp.float32))
    with pytest.raises(NotImplementedError, match=r"a qwen3_moe checkpoint cannot name this block: a router bias "
                                                  r"\(router_bias\) is gpt-oss's only"):
        save_nnx_moe_block(biased, folder, model_type="qwen3_moe")
    llama4_fp8 = moe_pallas.MoEBlock.from_preset("llama4-scout", hidden_size=128, intermediate_size=128, num_experts=8,
                                                 quant="fp8_block")
    with pytest.raises(NotImplementedError, match="quant='fp8_block' has no checkpoint format here"):
        save_nnx_moe_block(llama4_fp8, folder, model_type="llama4_text")
    per_token = moe_pallas.MoEBlock.from_preset("tiny", quant="fp8_per_token")
    with pytest.raises(NotImplementedError, match=r"save_nnx_moe_block: block.config.quant must be one of \('none', "
                                                  r"'fp8_block', 'mxfp4'\).*got quant='fp8_per_token'"):
        save_nnx_moe_block(per_token, folder)
    assert not os.path.exists(folder)  # nothing written


def test_bad_arguments(tmp_path):
    folder = str(tmp_path / "x")
    block = jax_block("deepseek_v3")
    with pytest.raises(ValueError, match=r"save_nnx_moe_block: the block is a layer of each of \['deepseek_v3', "
                                         r"'glm4_moe', 'kimi_k2'\]; pass model_type="):
        save_nnx_moe_block(block, folder)
    with pytest.raises(TypeError, match="save_nnx_moe_block: block must be a moe_pallas.MoEBlock; got "
                                        "moe_pallas.module.MoELayer"):
        save_nnx_moe_block(block.layer, folder)
    with pytest.raises(ValueError, match="save_nnx_moe_block: layer must be an int >= 0 .*got layer=-1"):
        save_nnx_moe_block(block, folder, layer=-1, model_type="deepseek_v3")
    with pytest.raises(ValueError, match="save_nnx_moe_block: model_type must be None or one of .*got "
                                         "model_type='deepseek_v2'"):
        save_nnx_moe_block(block, folder, model_type="deepseek_v2")
    with pytest.raises(ValueError, match=r"save_nnx_moe_block: hf_config\['n_group'\]=8, but the block has 4 there"):
        save_nnx_moe_block(block, folder, model_type="deepseek_v3", hf_config={"n_group": 8})
    with pytest.raises(ValueError, match=r"hf_config\['first_k_dense_replace'\]=3 makes layer 0 a dense layer"):
        save_nnx_moe_block(block, folder, model_type="deepseek_v3", hf_config={"first_k_dense_replace": 3})
    shard = moe_pallas.MoEBlock.from_preset("tiny", dtype=jnp.float32, ep_size=2, ep_rank=1)
    with pytest.raises(ValueError, match=r"save_nnx_moe_block: block must hold the whole layer \(ep_size=1\); got "
                                         r"ep_size=2"):
        save_nnx_moe_block(shard, folder, model_type="deepseek_v3")
    save_nnx_moe_block(block, folder, model_type="deepseek_v3")
    with pytest.raises(FileExistsError,
                       match=r"already has \['model.safetensors', 'config.json'\]; pass overwrite=True"):
        save_nnx_moe_block(block, folder, model_type="deepseek_v3")
    save_nnx_moe_block(block, folder, model_type="glm4_moe", overwrite=True)
    assert json.load(open(os.path.join(folder, "config.json")))["model_type"] == "glm4_moe"
