"""interop/checkpoints.py: one MoE layer from HF-named safetensors, in every supported layout."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from interop.checkpoints import dequantize_block, load_moe_layer
from interop.crosscheck import LayerWeights

E, H, I = 4, 128, 128


def _rand(rng, *shape):
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).to(torch.bfloat16)


def _fp8(w: torch.Tensor):
    """DeepSeek-V3 style: 128x128 block codes and the float32 multiplier (``weight_scale_inv``)."""
    import moe_torch

    q, s = moe_torch.quantize_weight_fp8(w[None].float(), "block")
    return q[0], s[0]


def write_layer(folder, arch: str, *, layer: int = 1, fp8: bool = False, shared: int = 0, seed: int = 0,
                split: bool = False, config: dict | None = None, drop: str | None = None, reshape: str | None = None):
    """A checkpoint with one dense layer 0 (no experts) and MoE layer ``layer``; returns the float weights written."""
    rng = np.random.default_rng(seed)
    t: dict[str, torch.Tensor] = {"model.layers.0.mlp.gate_proj.weight": _rand(rng, I, H)}  # a dense layer: ignored
    module, names = ("block_sparse_moe", ("w1", "w3", "w2")) if arch == "mixtral" else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    pre = f"model.layers.{layer}.{module}"
    t[f"{pre}.gate.weight"] = _rand(rng, E, H)
    if arch == "deepseek_v3":
        t[f"{pre}.gate.e_score_correction_bias"] = torch.from_numpy(rng.standard_normal(E, dtype=np.float32) * 0.1)
    want = {"w13": [], "w2": []}

    def put(prefix, inter):
        g, u, d = _rand(rng, inter, H), _rand(rng, inter, H), _rand(rng, H, inter)
        for name, w in zip(names, (g, u, d)):
            if fp8:
                q, s = _fp8(w)
                t[f"{prefix}.{name}.weight"], t[f"{prefix}.{name}.weight_scale_inv"] = q, s
            else:
                t[f"{prefix}.{name}.weight"] = w
        return g, u, d

    for i in range(E):
        g, u, d = put(f"{pre}.experts.{i}", I)
        want["w13"].append(torch.cat([g, u]).float().numpy())
        want["w2"].append(d.float().numpy())
    if shared:
        g, u, d = put(f"{pre}.shared_experts", shared * I)
        for k in range(shared):
            sl = slice(k * I, (k + 1) * I)
            want["w13"].append(torch.cat([g[sl], u[sl]]).float().numpy())
            want["w2"].append(d[:, sl].float().numpy())
    if drop:
        del t[drop.format(pre=pre)]
    if reshape:
        key = reshape.format(pre=pre)
        t[key] = t[key][:, :-1].contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    if split:  # two shards and an index
        keys = sorted(t)
        shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
        for fn, ks in shards.items():
            save_file({k: t[k] for k in ks}, str(folder / fn))
        index = {"metadata": {}, "weight_map": {k: fn for fn, ks in shards.items() for k in ks}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(t, str(folder / "model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return {k: np.stack(v) for k, v in want.items()}, t


@pytest.mark.parametrize("arch,shared,split", [("mixtral", 0, False), ("qwen3_moe", 0, True), ("deepseek_v3", 1, False),
                                               ("deepseek_v3", 2, True)])
def test_bf16_round_trip_exact(tmp_path, arch, shared, split):
    want, t = write_layer(tmp_path, arch, shared=shared, split=split)
    got = load_moe_layer(str(tmp_path))
    assert got.arch == arch and got.layer == 1 and got.num_shared_experts == shared and not got.is_fp8
    assert got.w13.shape == (E + shared, 2 * I, H) and got.w2.shape == (E + shared, H, I)
    np.testing.assert_array_equal(got.w13, want["w13"])
    np.testing.assert_array_equal(got.w2, want["w2"])
    module = "block_sparse_moe" if arch == "mixtral" else "mlp"
    np.testing.assert_array_equal(got.router_weight, t[f"model.layers.1.{module}.gate.weight"].float().numpy())
    if arch == "deepseek_v3":
        np.testing.assert_array_equal(got.e_score_correction_bias, t["model.layers.1.mlp.gate.e_score_correction_bias"].numpy())
    # both backends get the same bits
    jx, th = got.arrays("jax"), got.arrays("torch")
    np.testing.assert_array_equal(np.asarray(jx["w13"]), th["w13"].cpu().numpy())


def test_single_file_path_and_layer_choice(tmp_path):
    write_layer(tmp_path, "qwen3_moe", layer=3)
    got = load_moe_layer(str(tmp_path / "model.safetensors"))
    assert got.layer == 3
    with pytest.raises(ValueError, match=r"layer must be one of the MoE layers \[3\]; got layer=0"):
        load_moe_layer(str(tmp_path), layer=0)


@pytest.mark.parametrize("shared,split", [(0, False), (1, True)])
def test_deepseek_fp8_block_scales(tmp_path, shared, split):
    want, t = write_layer(tmp_path, "deepseek_v3", fp8=True, shared=shared, split=split)
    got = load_moe_layer(str(tmp_path))
    assert got.is_fp8 and got.w13.dtype == ml_dtypes.float8_e4m3fn
    assert got.w13_scale.shape == (E + shared, 2 * I // 128, H // 128) and got.w2_scale.shape == (E + shared, H // 128, I // 128)
    # codes exact, and scale = the multiplier: codes * scale per block == the stored expert's dequantization
    q = t["model.layers.1.mlp.experts.2.up_proj.weight"]
    s = t["model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"]
    np.testing.assert_array_equal(got.w13[2, I:].view(np.uint8), q.view(torch.uint8).numpy())
    import moe_torch

    deq_torch = moe_torch.dequantize_weight_fp8(q[None], s[None])[0].float().numpy()
    w13f, w2f = got.float_weights()
    np.testing.assert_array_equal(w13f[2, I:], deq_torch)
    np.testing.assert_array_equal(dequantize_block(got.w2, got.w2_scale), w2f)
    # and within half an FP8 step of the bf16 weights that were quantized
    assert np.abs(w13f - want["w13"]).max() <= np.abs(want["w13"]).max() / 16
    with pytest.raises(ValueError, match="no config.json"):  # a preset is needed for the routing then
        got.config(None, quant="fp8_block")
    cfg = got.config(_ds_preset(), quant="fp8_block")
    lw = got.layer_weights(cfg)
    assert isinstance(lw, LayerWeights) and lw.w13_scale is got.w13_scale
    assert got.layer_weights(cfg.replace(quant="none")).w13_scale is None


def _ds_preset():
    from moe_contract.presets import ModelPreset

    return ModelPreset(name="t", hf_model_id="", hidden_size=H, intermediate_size=I, num_experts=E, topk=2,
                       routing="biased_grouped_topk", renormalize=True, num_expert_group=2, topk_group=1,
                       routed_scaling_factor=2.5)


def test_config_json_gives_the_routing(tmp_path):
    write_layer(tmp_path, "deepseek_v3", shared=1, config={
        "model_type": "deepseek_v3", "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_routed_experts": E, "hidden_act": "silu"})
    cfg = load_moe_layer(str(tmp_path)).config(quant="none", ep_size=2, ep_rank=1)
    assert (cfg.num_experts, cfg.topk, cfg.num_expert_group, cfg.topk_group, cfg.routing) == (E, 2, 2, 1, "biased_grouped_topk")
    assert cfg.num_fused_shared_experts == 1 and cfg.routed_scaling_factor == 2.5 and cfg.local_expert_range() == (2, 3)


@pytest.mark.parametrize("arch,kw,match", [
    ("mixtral", dict(drop="{pre}.experts.2.w3.weight"), r"missing key 'model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight'"),
    ("qwen3_moe", dict(drop="{pre}.gate.weight"), r"missing key 'model\.layers\.1\.mlp\.gate\.weight' \(router"),
    # without the bias the keys look like Qwen3-MoE's: config.json's model_type says what it is
    ("deepseek_v3", dict(drop="{pre}.gate.e_score_correction_bias", config={"model_type": "deepseek_v3"}),
     r"missing key 'model\.layers\.1\.mlp\.gate\.e_score_correction_bias'"),
    ("deepseek_v3", dict(fp8=True, drop="{pre}.experts.1.down_proj.weight_scale_inv"), r"experts\.1\.down_proj\.weight_scale_inv"),
    ("qwen3_moe", dict(reshape="{pre}.experts.3.down_proj.weight"),
     r"experts\.3\.down_proj\.weight must have shape \(128, 128\); got \(128, 127\)"),
])
def test_errors_name_the_key(tmp_path, arch, kw, match):
    write_layer(tmp_path, arch, **kw)
    with pytest.raises(ValueError, match=match):
        load_moe_layer(str(tmp_path))


def test_no_experts_and_no_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_moe_layer(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_moe_layer(str(tmp_path))
    save_file({"model.layers.0.mlp.gate_proj.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no MoE expert weights"):
        load_moe_layer(str(tmp_path))
