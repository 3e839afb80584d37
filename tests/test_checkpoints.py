"""interop/checkpoints.py: one MoE layer of a transformers checkpoint, read as transformers reads it.

The checkpoints are tiny random transformers 5.24 models written by transformers' own ``save_pretrained``
(``tests/hf_checkpoints.py``, no downloads): one per family (Mixtral, Qwen3-MoE, DeepSeek-V3), float32 /
bf16 / FP8-block (DeepSeek-V3's format), single-file / sharded, per-expert (the hub's) / fused
(``save_original_format=False``), and the config.json / tensor variants a user reported. The layer built from
a loaded checkpoint is compared with transformers' own MoE block of the same checkpoint
(``AutoModelForCausalLM.from_pretrained``): float32, within ``F32_REL_FRO``.

Each case that was wrong before the loader was fixed says so in its docstring (what the old loader did); those tests
fail on the old code. ``write_layer`` (hand-made keys, for the error cases transformers cannot write) is
also used by ``tests/test_cli.py``.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hf_checkpoints import FAMILIES, MOE_LAYER, NUM_EXPERTS, H, I, hf_moe_forward, make_hf_model, moe_block, \
    quantize_fp8_block, save_checkpoint
from interop.checkpoints import load_inputs, load_moe_layer
from interop.cli import main
from tolerances import F32_REL_FRO, rel_fro

transformers = pytest.importorskip("transformers")

#: What a routing bug moves the layer output by (a wrong renormalization or rsf: O(1e-1)).
BROKEN_MIN_ERR = 5e-2
REFS = ["--implementations", "jnp-reference,torch-reference"]  # the CLI runs that need no kernels


# ----------------------------------------------------------------------------------------------
# Checkpoints, each built once per module
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """``ckpt(family, dtype="bfloat16", **save_checkpoint kwargs) -> folder``; ``ckpt.model(family, dtype)``."""
    models: dict = {}
    folders: dict = {}

    def model(family: str, dtype: str = "bfloat16"):
        if (family, dtype) not in models:
            models[(family, dtype)] = make_hf_model(family, getattr(torch, dtype), seed=FAMILIES.index(family))
        return models[(family, dtype)]

    def make(family: str, dtype: str = "bfloat16", **kw):
        key = (family, dtype, repr(sorted(kw.items())))
        if key not in folders:
            folders[key] = save_checkpoint(model(family, dtype), tmp_path_factory.mktemp(f"{family}-{dtype}"), **kw)
        return folders[key]

    make.model = model
    return make


def _x(T: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(100 + seed))


def _ours(layer, cfg, x: torch.Tensor) -> torch.Tensor:
    """Our torch reference layer on the loaded weights; logits = x @ router.T in float32 (HF's router)."""
    import moe_torch

    a = layer.arrays("torch", cfg)
    x = x.to(a["w13"].device)
    logits = x.float() @ a["router_weight"].float().T
    out = moe_torch.moe_forward(x.to(a["w13"].dtype), logits, a["w13"], a["w2"], cfg,
                                e_score_correction_bias=a["e_score_correction_bias"])
    return out.float().cpu()


def _hf(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager").eval()


def _expected_w13_w2(model, family: str):
    """The model's own expert weights in the contract's layout (shared experts appended)."""
    block = moe_block(model)
    w13, w2 = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    if family == "deepseek_v3":
        sh = block.shared_experts
        w13 = torch.cat([w13, torch.cat([sh.gate_proj.weight, sh.up_proj.weight])[None].detach()])
        w2 = torch.cat([w2, sh.down_proj.weight[None].detach()])
    return w13, w2


# ----------------------------------------------------------------------------------------------
# HF drop-in 3: the checkpoint's dtype, both layouts, single file and shards
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["single", "sharded", "fused"])
def test_loader_keeps_the_checkpoint_dtype(ckpt, family, layout):
    """bf16 stays bf16, bit for bit, as torch tensors and as jax arrays (the old loader returned float32 numpy:
    twice the memory); the fused layout (save_original_format=False) gives the same tensors."""
    import jax.numpy as jnp

    folder = ckpt(family, sharded=layout == "sharded", fused=layout == "fused")
    layer = load_moe_layer(folder, layer=MOE_LAYER)
    model = ckpt.model(family)
    w13, w2 = _expected_w13_w2(model, family)
    router = moe_block(model).gate.weight.detach()
    assert layer.arch == family and layer.layer == MOE_LAYER and not layer.is_fp8 and layer.dtype == "bfloat16"
    assert layer.w13.dtype == torch.bfloat16 and layer.w2.dtype == torch.bfloat16
    assert torch.equal(layer.w13, w13) and torch.equal(layer.w2, w2)
    assert layer.router_weight.dtype == router.dtype == (torch.float32 if family == "deepseek_v3" else torch.bfloat16)
    assert torch.equal(layer.router_weight, router)
    if family == "deepseek_v3":
        assert layer.num_shared_experts == 1 and layer.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(layer.e_score_correction_bias, moe_block(model).gate.e_score_correction_bias)
    th, jx = layer.arrays("torch"), layer.arrays("jax")
    assert th["w13"].dtype == torch.bfloat16 and jx["w13"].dtype == jnp.bfloat16 and jx["w2"].dtype == jnp.bfloat16
    assert th["w13_scale"] is None and jx["w13_scale"] is None
    np.testing.assert_array_equal(np.asarray(jx["w13"]).view(np.uint16), th["w13"].cpu().view(torch.int16).numpy().view(np.uint16))
    # one EP rank's slice: rank 1 of 2 owns the second half of the routed experts (and the shared ones)
    cfg = layer.config(ep_size=2, ep_rank=1)
    E = NUM_EXPERTS[family]
    assert torch.equal(layer.arrays("torch", cfg)["w13"].cpu(), w13[E // 2:])


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_checkpoint_equals_the_transformers_block(ckpt, family):
    """The layer of a float32 checkpoint equals transformers' MoE block of the same checkpoint."""
    folder = ckpt(family, "float32")
    layer = load_moe_layer(folder, layer=MOE_LAYER)
    assert layer.w13.dtype == torch.float32
    x = _x()
    err = rel_fro(_ours(layer, layer.config(), x), hf_moe_forward(_hf(folder), x))
    assert err <= F32_REL_FRO, err


# ----------------------------------------------------------------------------------------------
# An absent config.json key means what transformers' config class means
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,drop,set_,field,expected,old", [
    # old loader: renormalize=True (Qwen3MoeConfig: norm_topk_prob=False); layer off by O(0.1-1)
    ("qwen3_moe", "norm_topk_prob", None, "renormalize", False, True),
    # old loader: rsf 1.0 (DeepseekV3Config: 2.5)
    ("deepseek_v3", "routed_scaling_factor", None, "routed_scaling_factor", 2.5, 1.0),
    # old loader: "num_expert_group must be an int >= 1; got None" (DeepseekV3Config: n_group=8)
    ("deepseek_v3", "n_group", None, "num_expert_group", 8, None),
    ("deepseek_v3", "topk_group", None, "topk_group", 4, None),
    ("deepseek_v3", "num_experts_per_tok", None, "topk", 8, None),
    ("qwen3_moe", "num_experts_per_tok", None, "topk", 8, None),
    ("deepseek_v3", "norm_topk_prob", None, "renormalize", True, None),
    ("deepseek_v3", "n_shared_experts", None, "num_fused_shared_experts", 1, None),
    ("mixtral", "num_experts_per_tok", None, "topk", 2, None),
    ("mixtral", "hidden_act", None, "activation", "silu", None),
    # old loader: refused every hidden_act but silu
    ("qwen3_moe", None, {"hidden_act": "gelu_pytorch_tanh"}, "activation", "gelu_tanh", None),
    # the hub's Qwen3-MoE key (save_pretrained writes its alias num_local_experts)
    ("qwen3_moe", "num_local_experts", {"num_experts": 8}, "num_experts", 8, None),
])
def test_config_json_means_what_transformers_means(ckpt, family, drop, set_, field, expected, old):
    folder = ckpt(family, "float32", config_drop=(drop,) if drop else (), config_set=set_)
    layer = load_moe_layer(folder, layer=MOE_LAYER)
    cfg = layer.config()
    assert getattr(cfg, field) == expected
    hf = _hf(folder)
    key = drop or next(iter(set_))
    if key != "hidden_act":
        assert getattr(hf.config, key) == expected  # transformers' own reading of this config.json
    x = _x()
    ref = hf_moe_forward(hf, x)
    err = rel_fro(_ours(layer, cfg, x), ref)
    assert err <= F32_REL_FRO, err
    if old is not None:  # the old reading is measurably wrong: the comparison can fail
        assert rel_fro(_ours(layer, cfg.replace(**{field: old}), x), ref) > BROKEN_MIN_ERR


@pytest.mark.parametrize("family,drop,set_,exc,match", [
    # old loader: "num_expert_group must be an int >= 1; got None", no config key named
    ("deepseek_v3", None, {"n_group": None}, ValueError, r"num_expert_group must be an int >= 1.*config\.json.*'n_group'=None"),
    ("deepseek_v3", None, {"n_group": 3}, ValueError, r"divisible by num_expert_group.*'n_group'=3"),
    ("deepseek_v3", None, {"topk_group": 5}, ValueError, r"topk_group must be <= num_expert_group.*'topk_group'=5"),
    ("qwen3_moe", None, {"num_experts_per_tok": 9}, ValueError, r"topk must be <= E.*'num_experts_per_tok'=9"),
    ("deepseek_v3", None, {"routed_scaling_factor": None}, ValueError,
     r"transformers' DeepseekV3Config refuses .*field 'routed_scaling_factor'"),
    ("deepseek_v3", "n_routed_experts", None, ValueError,
     r"'n_routed_experts'=256 \(absent from config\.json: DeepseekV3Config's default\) but the tensors have E=16"),
    ("qwen3_moe", None, {"hidden_size": 256}, ValueError, r"'hidden_size'=256 but the tensors have H=128"),
    ("mixtral", None, {"intermediate_size": 64}, ValueError, r"'intermediate_size'=64 but the tensors have I=128"),
    ("mixtral", None, {"hidden_act": "relu"}, ValueError, r"key 'hidden_act' must be one of .*got 'hidden_act'='relu'"),
    ("deepseek_v3", None, {"scoring_func": "softmax"}, ValueError, r"key 'scoring_func' must be 'sigmoid'"),
    ("deepseek_v3", None, {"topk_method": "greedy"}, ValueError, r"key 'topk_method' must be 'noaux_tc'"),
    ("qwen3_moe", None, {"norm_topk_prob": "yes"}, ValueError, r"transformers' Qwen3MoeConfig refuses .*norm_topk_prob"),
    ("mixtral", None, {"model_type": "qwen2_moe"}, ValueError, r"model_type must be one of"),
])
def test_config_errors_name_the_config_json_key(ckpt, family, drop, set_, exc, match):
    folder = ckpt(family, config_drop=(drop,) if drop else (), config_set=set_)
    with pytest.raises(exc, match=match):
        load_moe_layer(folder, layer=MOE_LAYER).config()


# ----------------------------------------------------------------------------------------------
# Shared experts, config.json against the tensors
# ----------------------------------------------------------------------------------------------


def _drop_shared(tensors: dict) -> None:
    for k in [k for k in tensors if ".shared_experts." in k]:
        del tensors[k]


@pytest.mark.parametrize("kw,match", [
    # old loader: zero shared experts, silently
    (dict(edit=_drop_shared), r"missing key 'model\.layers\.1\.mlp\.shared_experts\.gate_proj\.weight' \(the shared "
                              r"experts\).*says 'n_shared_experts'=1$"),
    (dict(edit=_drop_shared, config_drop=("n_shared_experts",)),
     r"missing key .*shared_experts\.gate_proj\.weight.*'n_shared_experts'=1 \(absent from config\.json: "
     r"DeepseekV3Config's default\)"),
    # old loader: config.json's count ignored
    (dict(config_set={"n_shared_experts": 0}), r"1 shared expert\(s\), but .* says 'n_shared_experts'=0"),
    (dict(config_set={"n_shared_experts": 2}), r"1 shared expert\(s\), but .* says 'n_shared_experts'=2"),
])
def test_deepseek_shared_experts_must_match_config_json(ckpt, kw, match):
    with pytest.raises(ValueError, match=match):
        load_moe_layer(ckpt("deepseek_v3", **kw))


def test_unexpected_keys_are_refused(ckpt):
    """A tensor the loader would not read (here Qwen2-MoE's shared-expert gate in a Qwen3-MoE layer) is an
    error, not ignored (the old loader ignored it)."""
    folder = ckpt("qwen3_moe", edit=lambda t: t.__setitem__("model.layers.1.mlp.shared_expert_gate.weight",
                                                               torch.ones(1, H, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match=r"unexpected key\(s\) 'model\.layers\.1\.mlp\.shared_expert_gate\.weight'"):
        load_moe_layer(folder)


# ----------------------------------------------------------------------------------------------
# Non-finite weights and inputs
# ----------------------------------------------------------------------------------------------


def _poison(tensors: dict) -> None:
    up = tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    up.view(-1)[[0, 5, 77]] = float("nan")
    tensors["model.layers.1.mlp.gate.weight"].view(-1)[3] = float("inf")


def test_nonfinite_weights_are_refused_naming_each_tensor(ckpt):
    """The old loader returned NaN / inf weights as they were (and check then reported 'VIOLATION at gemm2')."""
    folder = ckpt("qwen3_moe", edit=_poison)
    with pytest.raises(ValueError, match=r"non-finite values in .*model\.layers\.1\.mlp\.gate\.weight \(0 NaN, 1 inf\), "
                                         r"model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight \(3 NaN, 0 inf\)"):
        load_moe_layer(folder)
    layer = load_moe_layer(folder, allow_nonfinite=True)  # the opt-out returns them as they are
    assert int(torch.isnan(layer.w13[2, I:]).sum()) == 3 and int(torch.isinf(layer.router_weight).sum()) == 1


def test_fp8_nan_codes_and_scales_are_refused(ckpt):
    def poison(t):
        t["model.layers.1.mlp.experts.0.down_proj.weight"].view(torch.uint8).view(-1)[[1, 2]] = 0x7F  # FP8 NaN codes
        t["model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv"][0, 0] = float("nan")

    with pytest.raises(ValueError, match=r"experts\.0\.down_proj\.weight \(2 NaN, 0 inf\).*shared_experts\.up_proj"
                                         r"\.weight_scale_inv \(1 NaN, 0 inf\)"):
        load_moe_layer(ckpt("deepseek_v3", fp8=True, edit=poison))


def test_check_refuses_nonfinite_weights_before_any_stage(ckpt, capsys):
    """Old: exit 1, 'VIOLATION at gemm2'. Now: exit 2 and the tensors named, before any stage is judged."""
    assert main(["check", "--weights", ckpt("qwen3_moe", edit=_poison), "--tokens", "2", *REFS]) == 2
    out, err = capsys.readouterr()
    assert "experts.2.up_proj.weight (3 NaN, 0 inf)" in err and "gemm" not in out


# ----------------------------------------------------------------------------------------------
# FP8 checkpoints
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["single", "sharded", "fused"])
def test_fp8_checkpoint_gives_codes_and_fp8_block(ckpt, layout):
    """config() of an FP8 checkpoint says quant='fp8_block' (old: 'none', and its codes then failed with a dtype
    error); codes and scales are the checkpoint's bits, float8_e4m3fn and float32, in torch and jax."""
    import jax.numpy as jnp

    folder = ckpt("deepseek_v3", fp8=True, sharded=layout == "sharded", fused=layout == "fused")
    layer = load_moe_layer(folder)
    assert layer.is_fp8 and layer.quant == "fp8_block" and layer.dtype == "float8_e4m3fn"
    cfg = layer.config()
    assert cfg.quant == "fp8_block"
    w13, w2 = _expected_w13_w2(ckpt.model("deepseek_v3"), "deepseek_v3")
    q13, s13 = quantize_fp8_block(w13)  # 128-row blocks: gate and up quantized apart == [2I, H] at once
    q2, s2 = quantize_fp8_block(w2)
    assert torch.equal(layer.w13.view(torch.uint8), q13.view(torch.uint8)) and torch.equal(layer.w13_scale, s13)
    assert torch.equal(layer.w2.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(layer.w2_scale, s2)
    assert layer.w13_scale.shape == (17, 2 * I // 128, H // 128) and layer.w2_scale.shape == (17, H // 128, I // 128)
    th, jx = layer.arrays("torch", cfg), layer.arrays("jax", cfg)
    assert th["w13"].dtype == torch.float8_e4m3fn and th["w13_scale"].dtype == torch.float32
    assert jx["w2"].dtype == jnp.float8_e4m3fn and jx["w2_scale"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(jx["w13"]).view(np.uint8), q13.view(torch.uint8).numpy())
    # quant='none': the codes dequantized to bf16 (as transformers' dequantize=True), no scales
    deq = layer.arrays("torch", cfg.replace(quant="none"))
    assert deq["w13"].dtype == torch.bfloat16 and deq["w13_scale"] is None
    exact = q13.float() * s13.repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert torch.equal(deq["w13"].cpu(), exact.to(torch.bfloat16))
    assert (exact - w13.float()).abs().max() <= w13.float().abs().max() / 16  # within an FP8 step


@pytest.mark.parametrize("quant_config,match", [
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"'quantization_config\.weight_block_size' must be \[128, 128\]"),
    ({"quant_method": "compressed-tensors"}, r"'quantization_config\.quant_method' must be 'fp8'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, r"'quantization_config\.activation_scheme' must be 'dynamic'"),
])
def test_fp8_quantization_config_other_than_128_blocks_is_refused(ckpt, quant_config, match):
    """Old loader: quantization_config ignored."""
    with pytest.raises(ValueError, match=match):
        load_moe_layer(ckpt("deepseek_v3", fp8=True, config_set={"quantization_config": quant_config}))


def test_fp8_quantization_config_on_float_weights_is_refused(ckpt):
    folder = ckpt("deepseek_v3", config_set={"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match=r"quant_method='fp8' but .*experts\.0\.gate_proj\.weight is bfloat16"):
        load_moe_layer(folder)


def test_check_takes_an_fp8_checkpoints_quantization(ckpt, capsys):
    """`epmoe check --weights FP8` without --quant runs the checkpoint's codes with quant=fp8_block."""
    assert main(["check", "--weights", ckpt("deepseek_v3", fp8=True), "--tokens", "2", *REFS]) == 0
    out = capsys.readouterr().out
    assert "deepseek_v3 layer 1 (float8_e4m3fn) with weights from" in out and "quant=fp8_block" in out
    assert "rsf=2.5" in out and "within the contract" in out


# ----------------------------------------------------------------------------------------------
# Check without config.json
# ----------------------------------------------------------------------------------------------


def test_check_without_config_json_refuses_unless_preset(ckpt, capsys):
    """Old: the tiny preset's routing (biased grouped top-4) for Mixtral weights, exit 0."""
    folder = ckpt("mixtral", config_drop=("config.json",))
    assert not os.path.exists(os.path.join(folder, "config.json"))
    assert main(["check", "--weights", folder, "--tokens", "2", *REFS]) == 2
    err = capsys.readouterr().err
    assert "no config.json" in err and "--preset NAME" in err
    # asked for explicitly: that preset's routing, and the header says so
    assert main(["check", "--weights", folder, "--preset", "mixtral-8x7b", "--tokens", "2", *REFS]) == 0
    out = capsys.readouterr().out
    assert "routing from preset mixtral-8x7b (no config.json)" in out and "topk=2 routing=softmax_topk" in out


def test_preset_of_the_other_routing_family_is_refused(ckpt, capsys):
    """New-user trial: `check --weights <DeepSeek-V3 without config.json> --preset mixtral-8x7b`
    ran softmax routing, dropped the checkpoint's e_score_correction_bias and exited 0. Now refused, both ways;
    a preset may also be given by name."""
    deepseek = ckpt("deepseek_v3", config_drop=("config.json",))
    assert main(["check", "--weights", deepseek, "--preset", "mixtral-8x7b", "--tokens", "2", *REFS]) == 2
    err = capsys.readouterr().err
    assert "preset 'mixtral-8x7b' routes by 'softmax_topk'" in err and "has an e_score_correction_bias" in err
    mixtral = load_moe_layer(ckpt("mixtral", config_drop=("config.json",)))
    with pytest.raises(ValueError, match="has no e_score_correction_bias"):
        mixtral.config("deepseek-v3")
    assert mixtral.config("mixtral-8x7b").routing == "softmax_topk"  # by name


# ----------------------------------------------------------------------------------------------
# HF drop-in 5: --inputs FILE
# ----------------------------------------------------------------------------------------------


def test_check_on_given_inputs(ckpt, tmp_path, capsys):
    """x [T, H] (bf16) alone (router_logits from the checkpoint's router) or with router_logits."""
    from interop.crosscheck import make_inputs

    folder = ckpt("deepseek_v3")
    x = _x(3).to(torch.bfloat16)
    save_file({"x": x}, str(tmp_path / "x.safetensors"))
    assert main(["check", "--weights", folder, "--inputs", str(tmp_path / "x.safetensors"), *REFS]) == 0
    out = capsys.readouterr().out
    assert "T=3 x (router_logits = x @ router weight) from" in out and "within the contract" in out
    # the given values are what the cross-check runs on
    layer = load_moe_layer(folder)
    cfg = layer.config()
    logits = torch.randn(3, NUM_EXPERTS["deepseek_v3"], generator=torch.Generator().manual_seed(7))
    save_file({"x": x, "router_logits": logits}, str(tmp_path / "xl.safetensors"))
    gx, gl = load_inputs(str(tmp_path / "xl.safetensors"), cfg)
    inputs, _, _ = make_inputs(cfg, 3, 0, "uniform", layer.layer_weights(cfg), gx, gl)
    np.testing.assert_array_equal(inputs.x, x.float().numpy())
    np.testing.assert_array_equal(inputs.router_logits, logits.numpy())


def test_check_inputs_need_router_logits_without_weights(tmp_path, capsys):
    from moe_contract import get_preset

    save_file({"x": torch.randn(2, get_preset("tiny").hidden_size)}, str(tmp_path / "x.safetensors"))
    assert main(["check", "--inputs", str(tmp_path / "x.safetensors"), *REFS]) == 2
    assert "has no 'router_logits'" in capsys.readouterr().err


def test_check_refuses_nonfinite_inputs_before_any_stage(tmp_path, capsys):
    from moe_contract import get_preset

    tiny = get_preset("tiny")
    x, logits = torch.randn(2, tiny.hidden_size), torch.randn(2, tiny.num_experts)
    logits[1, 0] = float("inf")
    path = str(tmp_path / "xl.safetensors")
    save_file({"x": x, "router_logits": logits}, path)
    assert main(["check", "--inputs", path, *REFS]) == 2
    out, err = capsys.readouterr()
    assert f"load_inputs: {path!r} key 'router_logits' has non-finite values (0 NaN, 1 inf)" in err and "gate" not in out


@pytest.mark.parametrize("tensors,exc,match", [
    (dict(hidden=("randn", (3, H))), ValueError, r"has key\(s\) \['hidden'\]; the keys are \('x', 'router_logits'\)"),
    (dict(router_logits=("randn", (3, 16))), ValueError, r"has no key 'x'"),
    (dict(x=("randn", (3, 64))), ValueError, r"key 'x' must be \[T, H=128\] with T >= 1; got shape \(3, 64\)"),
    (dict(x=("randn", (3, H)), router_logits=("randn", (3, 4))), ValueError, r"key 'router_logits' must be \[T=3, E=16\]"),
    (dict(x=("randn", (3, H)), router_logits=("randn", (2, 16))), ValueError, r"key 'router_logits' must be \[T=3, E=16\]"),
    (dict(x=("int", (3, H))), TypeError, r"key 'x' must be one of \('bfloat16', 'float16', 'float32'\); got int32"),
    (dict(x=("nan", (3, H))), ValueError, r"key 'x' has non-finite values \(1 NaN, 0 inf\)"),
])
def test_load_inputs_errors_name_the_file_and_key(ckpt, tmp_path, tensors, exc, match):
    cfg = load_moe_layer(ckpt("deepseek_v3")).config()
    made = {}
    for key, (kind, shape) in tensors.items():
        t = torch.randn(shape) if kind != "int" else torch.ones(shape, dtype=torch.int32)
        if kind == "nan":
            t[1, 2] = float("nan")
        made[key] = t
    path = str(tmp_path / "inputs.safetensors")
    save_file(made, path)
    with pytest.raises(exc, match=match) as info:
        load_inputs(path, cfg)
    assert path in str(info.value)


# ----------------------------------------------------------------------------------------------
# Hand-made keys (what transformers cannot write); write_layer is also used by tests/test_cli.py
# ----------------------------------------------------------------------------------------------

E = 4


def _rand(rng, *shape):
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).to(torch.bfloat16)


def _config_sizes(arch: str, shared: int) -> dict:
    """The size keys of config.json for write_layer's tensors (absent keys would mean transformers' defaults)."""
    if arch == "mixtral":
        return {"hidden_size": H, "intermediate_size": I, "num_local_experts": E}
    sizes = {"hidden_size": H, "moe_intermediate_size": I}
    if arch == "qwen3_moe":
        return {**sizes, "num_experts": E}
    return {**sizes, "n_routed_experts": E, "n_shared_experts": shared}


def write_layer(folder, arch: str, *, layer: int = 1, fp8: bool = False, shared: int = 0, seed: int = 0,
                split: bool = False, config: dict | None = None, drop: str | None = None, reshape: str | None = None):
    """A checkpoint with one dense layer 0 (no experts) and MoE layer ``layer``; returns the float weights written.
    ``config``: config.json's routing keys (the size keys of the tensors are added unless given)."""
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
                q, s = quantize_fp8_block(w)
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
        (folder / "config.json").write_text(json.dumps({**_config_sizes(arch, shared), **config}))
    return {k: np.stack(v) for k, v in want.items()}, t


@pytest.mark.parametrize("arch,shared,split", [("mixtral", 0, False), ("qwen3_moe", 0, True), ("deepseek_v3", 2, True)])
def test_hand_made_round_trip_exact(tmp_path, arch, shared, split):
    """Without config.json: the arch from the key names; two shared experts split into two fused ones."""
    want, t = write_layer(tmp_path, arch, shared=shared, split=split)
    got = load_moe_layer(str(tmp_path))
    assert got.arch == arch and got.layer == 1 and got.num_shared_experts == shared and got.config_path is None
    assert got.w13.shape == (E + shared, 2 * I, H) and got.w2.shape == (E + shared, H, I)
    np.testing.assert_array_equal(got.w13.float().numpy(), want["w13"])
    np.testing.assert_array_equal(got.w2.float().numpy(), want["w2"])
    with pytest.raises(ValueError, match="no config.json beside the weights"):  # a preset is needed for the routing
        got.config()
    cfg = got.config(_ds_preset(), quant="fp8_block") if arch == "deepseek_v3" else None
    if cfg is not None:
        assert cfg.num_fused_shared_experts == 2 and cfg.routed_scaling_factor == 2.5


def _ds_preset():
    from moe_contract.presets import ModelPreset

    return ModelPreset(name="t", hf_model_id="", hidden_size=H, intermediate_size=I, num_experts=E, topk=2,
                       routing="biased_grouped_topk", renormalize=True, num_expert_group=2, topk_group=1,
                       routed_scaling_factor=2.5)


def test_single_file_path_and_layer_choice(tmp_path):
    write_layer(tmp_path, "qwen3_moe", layer=3)
    got = load_moe_layer(str(tmp_path / "model.safetensors"))
    assert got.layer == 3
    with pytest.raises(ValueError, match=r"layer must be one of the MoE layers \[3\]; got layer=0"):
        load_moe_layer(str(tmp_path), layer=0)


def test_config_sizes_must_match_the_overrides(tmp_path):
    write_layer(tmp_path, "deepseek_v3", shared=1, config={
        "model_type": "deepseek_v3", "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "hidden_act": "silu"})
    got = load_moe_layer(str(tmp_path))
    cfg = got.config(quant="none", ep_size=2, ep_rank=1)
    assert (cfg.num_experts, cfg.topk, cfg.num_expert_group, cfg.topk_group, cfg.routing) == (E, 2, 2, 1, "biased_grouped_topk")
    assert cfg.num_fused_shared_experts == 1 and cfg.routed_scaling_factor == 2.5 and cfg.local_expert_range() == (2, 3)
    with pytest.raises(ValueError, match=r"num_experts is the checkpoint's \(4, from its tensors\); got num_experts=8"):
        got.config(num_experts=8)
    with pytest.raises(ValueError, match=r"config must match the checkpoint's sizes"):
        got.arrays("torch", cfg.replace(intermediate_size=256))


@pytest.mark.parametrize("arch,kw,exc,match", [
    ("mixtral", dict(drop="{pre}.experts.2.w3.weight"), ValueError,
     r"missing key 'model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight'"),
    ("qwen3_moe", dict(drop="{pre}.gate.weight"), ValueError, r"missing key 'model\.layers\.1\.mlp\.gate\.weight' \(router"),
    # without the bias the keys look like Qwen3-MoE's: config.json's model_type says what it is
    ("deepseek_v3", dict(drop="{pre}.gate.e_score_correction_bias", config={"model_type": "deepseek_v3"}), ValueError,
     r"missing key 'model\.layers\.1\.mlp\.gate\.e_score_correction_bias'"),
    ("deepseek_v3", dict(fp8=True, drop="{pre}.experts.1.down_proj.weight_scale_inv"), ValueError,
     r"experts\.1\.down_proj\.weight_scale_inv"),
    ("qwen3_moe", dict(reshape="{pre}.experts.3.down_proj.weight"), ValueError,
     r"experts\.3\.down_proj\.weight \(down projection \[H, I\]\) must have shape \(128, 128\); got \(128, 127\)"),
])
def test_errors_name_the_key(tmp_path, arch, kw, exc, match):
    write_layer(tmp_path, arch, **kw)
    with pytest.raises(exc, match=match):
        load_moe_layer(str(tmp_path))


def test_mixed_and_unsupported_dtypes_are_type_errors(tmp_path):
    _, t = write_layer(tmp_path, "qwen3_moe")
    t["model.layers.1.mlp.experts.1.gate_proj.weight"] = t["model.layers.1.mlp.experts.1.gate_proj.weight"].float()
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(TypeError, match=r"experts\.1\.gate_proj\.weight is float32 but .*experts\.0\.gate_proj\.weight "
                                        r"is bfloat16; mixed dtypes"):
        load_moe_layer(str(tmp_path))
    t["model.layers.1.mlp.experts.1.gate_proj.weight"] = torch.ones(I, H, dtype=torch.float8_e5m2)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(TypeError, match=r"experts\.1\.gate_proj\.weight \(gate projection \[I, H\]\) must be one of"):
        load_moe_layer(str(tmp_path))


def test_no_experts_and_no_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_moe_layer(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_moe_layer(str(tmp_path))
    save_file({"model.layers.0.mlp.gate_proj.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no MoE expert weights"):
        load_moe_layer(str(tmp_path))
