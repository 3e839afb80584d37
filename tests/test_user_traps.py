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
