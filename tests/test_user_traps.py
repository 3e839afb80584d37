"""Traps a new user fell into outside the CLI (the CLI's are in ``test_cli.py``): each test names the trap it holds
shut. Tiny and fast: no layer runs here."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "jax_hf_model.py")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("jax_hf_model", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------
# examples/jax_hf_model.py


@pytest.mark.parametrize("model_type,eps,theta", [("mixtral", 1e-5, 1e6), ("qwen3_moe", 1e-6, 1e4)])
def test_example_config_defaults_are_the_model_class_defaults(example, model_type, eps, theta):
    """Trap: a config.json without rms_norm_eps / rope_theta got the example's own 1e-6 / 1e4 for every model
    (Mixtral's are 1e-5 / 1e6); now transformers' config class of the model_type decides, as for the model."""
    config = {"model_type": model_type, "num_hidden_layers": 1, "num_attention_heads": 4, "hidden_size": 64}
    spec = example.model_spec(config)
    assert spec["eps"] == eps and spec["rope_theta"] == theta
    spec = example.model_spec({**config, "rms_norm_eps": 1e-3, "rope_theta": 5e5})  # what the file says wins
    assert spec["eps"] == 1e-3 and spec["rope_theta"] == 5e5


def _folder(tmp_path, config: bool = True):
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(8, 4)}, str(tmp_path / "model.safetensors"))
    if config:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    return tmp_path


def test_example_truncated_safetensors_file_is_named(example, tmp_path):
    """Trap: a truncated file failed deep in numpy (``cannot reshape array``); now the library's reader names it."""
    path = _folder(tmp_path) / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(ValueError, match=r"^load_model: '.*model\.safetensors' is not a readable safetensors file "
                                         r"\(.*file not fully covered\)"):
        example.load_model(str(tmp_path))


def test_example_missing_config_json_is_named(example, tmp_path):
    """Trap: a folder without config.json raised a bare ``[Errno 2] No such file or directory``."""
    with pytest.raises(FileNotFoundError, match=r"^load_model: no config\.json in '.*' \(the model's architecture and "
                                                r"sizes come from it"):
        example.load_model(str(_folder(tmp_path, config=False)))
    with pytest.raises(FileNotFoundError, match=r"^load_model: path '.*nowhere' does not exist"):
        example.load_model(str(tmp_path / "nowhere"))


# --------------------------------------------------------------------------------------
# the modules' from_preset


def test_epmoe_from_preset_takes_a_dtype_name_as_jax_does():
    """Trap: ``EPMoE.from_preset("tiny", dtype="bfloat16")`` was refused where JAX's ``load_nnx_moe_block`` (and
    ``MoELayer.from_preset``) take the name; both spellings now give the same bits."""
    import moe_torch

    by_name = moe_torch.EPMoE.from_preset("tiny", dtype="bfloat16", hidden_size=64, intermediate_size=32)
    by_dtype = moe_torch.EPMoE.from_preset("tiny", dtype=torch.bfloat16, hidden_size=64, intermediate_size=32)
    assert by_name.w13.dtype == torch.bfloat16 and torch.equal(by_name.w13, by_dtype.w13)
    with pytest.raises(TypeError, match=r"^EPMoE\.from_preset: dtype must be a torch\.dtype or a name among "
                                        r"\('float32', 'bfloat16', 'float16'\); got dtype='int8'$"):
        moe_torch.EPMoE.from_preset("tiny", dtype="int8")


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_from_preset_bad_seed_names_the_argument(framework, seed):
    """Trap: ``from_preset(seed=-1)`` failed with numpy's ``expected non-negative integer``, naming neither the
    method nor the argument."""
    if framework == "torch":
        from moe_torch import EPMoE as cls
    else:
        from moe_pallas import MoELayer as cls
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\.from_preset: seed must be an int >= 0 \(the numpy seed "
                                         rf"of the random weights\); got seed={seed!r}$"):
        cls.from_preset("tiny", seed=seed)


# --------------------------------------------------------------------------------------
# interop/checkpoints.py


def _qwen3_moe_layer(folder, config: dict):
    """A Qwen3-MoE layer of 4 experts (H = I = 128) with ``config`` as its whole config.json."""
    from test_checkpoints import write_layer

    write_layer(folder, "qwen3_moe")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 128,
                                                    "moe_intermediate_size": 128, **config}))
    return str(folder)


def test_config_mismatch_names_the_key_as_the_file_spells_it(tmp_path):
    """Trap: Qwen3-MoE's config.json as save_pretrained writes it has `num_local_experts` (transformers' alias of
    the attribute `num_experts`); a mismatch with the tensors was reported as 'num_experts'=8, a key not in the file."""
    from interop.checkpoints import load_moe_layer

    path = _qwen3_moe_layer(tmp_path, {"num_local_experts": 8})
    with pytest.raises(ValueError, match=r"says 'num_local_experts'=8 but the tensors have E=4") as info:
        load_moe_layer(path)
    assert "'num_experts'" not in str(info.value)


def test_tune_reads_the_experts_key_as_save_pretrained_writes_it(tmp_path):
    """Same trap in `epmoe tune --weights`: Qwen3-MoE's `num_local_experts` (save_pretrained's spelling of
    `num_experts`) was "absent" (`key 'num_experts' must be an int >= 1; got None`)."""
    from moe_contract import tuning

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 256,
                                                      "moe_intermediate_size": 128, "num_local_experts": 8}))
    assert tuning.checkpoint_shapes(str(tmp_path)) == tuning.gemm_shapes(256, 128, 8)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 256,
                                                      "moe_intermediate_size": 128, "num_local_experts": 0}))
    with pytest.raises(ValueError, match=r"key 'num_local_experts' must be an int >= 1 \(model_type 'qwen3_moe'\); "
                                         r"got 0"):
        tuning.checkpoint_shapes(str(tmp_path))


def test_loaded_checkpoint_layer_repr_is_short(tmp_path):
    """Trap: the repr of a loaded layer (``load_moe_layer``'s MoECheckpointLayer) printed every tensor's values and
    the whole config.json, 15 KB for a tiny layer; now the config summary and each tensor's shape and dtype."""
    from interop.checkpoints import load_moe_layer

    text = repr(load_moe_layer(_qwen3_moe_layer(tmp_path, {"num_experts": 4, "num_experts_per_tok": 2})))
    assert len(text) < 1000 and "tensor(" not in text, text
    assert text.startswith("MoECheckpointLayer(arch='qwen3_moe', model_type='qwen3_moe', layer=1, ")
    assert "E=4, S=0, H=128, I=128, quant='none', w13=[4, 256, 128] bfloat16, w2=[4, 128, 128] bfloat16" in text
    assert "routing from" in text and "topk=2" in text
