"""The framework-free part of the contract (CONTRACT.md): layer config, model presets,
host-side validation and deterministic inputs. Imported by ``moe_pallas`` and ``moe_torch``
alike, so both validate with the same rules and the same messages."""

from moe_contract.config import FP8_BLOCK, MoEConfig
from moe_contract.inputs import LayerInputs, make_layer_inputs
from moe_contract.presets import PRESETS, ModelPreset, get_preset

__all__ = ["FP8_BLOCK", "LayerInputs", "MoEConfig", "ModelPreset", "PRESETS", "get_preset", "make_layer_inputs"]
