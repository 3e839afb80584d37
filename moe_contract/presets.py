"""Model presets: the MoE layer shapes and routing of real models, as data.

Used alike by the tests, the CLI and the benchmarks. Sizes are the models' published
``config.json`` values (HF hub): ``hidden_size`` (H), ``moe_intermediate_size`` or
``intermediate_size`` (I), ``n_routed_experts`` / ``num_experts`` / ``num_local_experts`` (E),
``num_experts_per_tok`` (topk), ``n_group`` / ``topk_group``, ``routed_scaling_factor``,
``norm_topk_prob``, ``n_shared_experts``.
"""

from __future__ import annotations

import dataclasses
import types

from moe_contract.config import MoEConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """One model's MoE layer. ``config()`` turns it into a :class:`MoEConfig`."""

    name: str
    hf_model_id: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    topk: int
    routing: str
    renormalize: bool
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    activation: str = "silu"

    def config(self, **overrides) -> MoEConfig:
        """The layer config (shared experts fused); ``overrides`` set quant, EP, rsf placement..."""
        fields = dict(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_experts=self.num_experts,
            topk=self.topk,
            routing=self.routing,
            renormalize=self.renormalize,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            num_fused_shared_experts=self.num_shared_experts,
            activation=self.activation,
        )
        MoEConfig.check_field_names(f"ModelPreset.config (preset {self.name!r})", overrides)
        fields.update(overrides)
        return MoEConfig(**fields)


_PRESETS = (
    ModelPreset(
        name="deepseek-v3",
        hf_model_id="deepseek-ai/DeepSeek-V3",  # R1 has the same MoE layer
        hidden_size=7168,
        intermediate_size=2048,
        num_experts=256,
        topk=8,
        routing="biased_grouped_topk",
        renormalize=True,
        num_expert_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        num_shared_experts=1,
    ),
    ModelPreset(
        name="qwen3-30b-a3b",
        hf_model_id="Qwen/Qwen3-30B-A3B",
        hidden_size=2048,
        intermediate_size=768,
        num_experts=128,
        topk=8,
        routing="softmax_topk",
        renormalize=True,
    ),
    ModelPreset(
        name="qwen3-235b-a22b",
        hf_model_id="Qwen/Qwen3-235B-A22B",
        hidden_size=4096,
        intermediate_size=1536,
        num_experts=128,
        topk=8,
        routing="softmax_topk",
        renormalize=True,
    ),
    ModelPreset(
        name="mixtral-8x7b",
        hf_model_id="mistralai/Mixtral-8x7B-v0.1",
        hidden_size=4096,
        intermediate_size=14336,
        num_experts=8,
        topk=2,
        routing="softmax_topk",
        renormalize=True,  # Mixtral always renormalises its top-2
    ),
    # Runs in seconds on a CPU, and exercises every routing feature of DeepSeek-V3
    # (groups, bias, rsf, a fused shared expert); H and I are multiples of 128 so that
    # quant='fp8_block' applies.
    ModelPreset(
        name="tiny",
        hf_model_id="",
        hidden_size=256,
        intermediate_size=128,
        num_experts=16,
        topk=4,
        routing="biased_grouped_topk",
        renormalize=True,
        num_expert_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        num_shared_experts=1,
    ),
)

#: name -> ModelPreset, read-only.
PRESETS: types.MappingProxyType = types.MappingProxyType({p.name: p for p in _PRESETS})


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"get_preset: name must be one of {tuple(PRESETS)}; got name={name!r}") from None
