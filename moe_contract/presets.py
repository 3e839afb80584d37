"""Model presets: the MoE layer shapes and routing of real models, as data.

Used alike by the tests, the CLI and the benchmarks. Sizes are the models' published
``config.json`` values (HF hub): ``hidden_size`` (H), ``moe_intermediate_size`` or
``intermediate_size`` (I), ``n_routed_experts`` / ``num_experts`` / ``num_local_experts`` (E),
``num_experts_per_tok`` (topk), ``n_group`` / ``topk_group``, ``routed_scaling_factor``,
``norm_topk_prob``, ``n_shared_experts``. The 2026 families (gpt-oss, Llama 4, Qwen3-Next, GLM-4.5,
Kimi K2) say per value where it comes from: the model's ``config.json`` (for Llama 4 its
``text_config``), checked against the defaults and docs of transformers 5.24's config classes
(``models/<family>/configuration_*.py``) and the routers of its modeling files.

A preset describes the whole layer: Llama 4's router weight on the expert input
(``apply_router_weight_on_input``), Qwen3-Next's shared-expert gate (``shared_expert_gate``), gpt-oss's
interleaved gate/up rows, clamped SwiGLU and per-expert biases (``expert_bias``); the routers' own biases
(gpt-oss) are in the logits, which the layer takes as input. gpt-oss ships its experts in MXFP4:
``config(quant="mxfp4")``.
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
    gate_up_layout: str = "concatenated"
    apply_router_weight_on_input: bool = False
    shared_expert_gate: bool = False
    expert_bias: bool = False

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
            gate_up_layout=self.gate_up_layout,
            apply_router_weight_on_input=self.apply_router_weight_on_input,
            shared_expert_gate=self.shared_expert_gate,
            expert_bias=self.expert_bias,
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
    # ---- the 2026 families. Sources per value: "cfg" = the model's config.json on the HF hub;
    # "tf" = transformers 5.24's config class / modeling file of the family (its defaults and docstrings).
    ModelPreset(
        name="gpt-oss-20b",
        hf_model_id="openai/gpt-oss-20b",
        hidden_size=2880,  # cfg hidden_size 2880 (= tf GptOssConfig default)
        intermediate_size=2880,  # cfg intermediate_size 2880 (= tf default; GptOssExperts.expert_dim)
        num_experts=32,  # cfg num_local_experts 32 (tf's default 128 is the 120b's)
        topk=4,  # cfg num_experts_per_tok 4 (= tf default)
        # tf GptOssTopKRouter: top-k of the logits, softmax over those k = softmax top-k renormalized
        # (CONTRACT.md section 1); the router's bias is inside the logits.
        routing="softmax_topk",
        renormalize=True,
        activation="swiglu_oai",  # tf GptOssExperts._apply_gate; cfg swiglu_limit 7.0, tf swiglu_alpha 1.702
        gate_up_layout="interleaved",  # tf GptOssExperts: gate_up[..., ::2] gate, [..., 1::2] up
        expert_bias=True,  # tf GptOssExperts: gate_up_proj_bias [E, 2I], down_proj_bias [E, H], always (no cfg switch)
    ),
    ModelPreset(
        name="gpt-oss-120b",
        hf_model_id="openai/gpt-oss-120b",
        hidden_size=2880,  # cfg hidden_size 2880 (= tf GptOssConfig default)
        intermediate_size=2880,  # cfg intermediate_size 2880 (= tf default)
        num_experts=128,  # cfg num_local_experts 128 (= tf default)
        topk=4,  # cfg num_experts_per_tok 4 (= tf default)
        routing="softmax_topk",  # as gpt-oss-20b (tf GptOssTopKRouter)
        renormalize=True,
        activation="swiglu_oai",
        gate_up_layout="interleaved",
        expert_bias=True,  # as gpt-oss-20b (tf GptOssExperts)
    ),
    ModelPreset(
        name="llama4-scout",
        hf_model_id="meta-llama/Llama-4-Scout-17B-16E",
        hidden_size=5120,  # cfg text_config.hidden_size 5120 (= tf Llama4TextConfig default)
        intermediate_size=8192,  # cfg text_config.intermediate_size 8192 (= tf default; Llama4TextExperts.expert_dim)
        num_experts=16,  # cfg text_config.num_local_experts 16 (= tf default)
        topk=1,  # cfg text_config.num_experts_per_tok 1 (= tf default)
        routing="sigmoid_topk",  # tf Llama4Router: topk of the logits, sigmoid of the chosen
        renormalize=False,  # tf Llama4Router: no renormalization
        num_shared_experts=1,  # tf Llama4TextMoe.shared_expert = Llama4TextMLP(config): intermediate_size = I
        apply_router_weight_on_input=True,  # tf Llama4TextMoe: routed_in = x * sigmoid(top logit); unweighted outputs
    ),
    ModelPreset(
        name="llama4-maverick",
        hf_model_id="meta-llama/Llama-4-Maverick-17B-128E",
        hidden_size=5120,  # cfg text_config.hidden_size 5120
        intermediate_size=8192,  # cfg text_config.intermediate_size 8192 (the dense layers' is intermediate_size_mlp 16384)
        num_experts=128,  # cfg text_config.num_local_experts 128 (MoE every other layer: interleave_moe_layer_step 2)
        topk=1,  # cfg text_config.num_experts_per_tok 1
        routing="sigmoid_topk",  # as llama4-scout (tf Llama4Router)
        renormalize=False,
        num_shared_experts=1,  # tf Llama4TextMoe.shared_expert: intermediate_size = I
        apply_router_weight_on_input=True,  # as llama4-scout
    ),
    ModelPreset(
        name="qwen3-next-80b-a3b",
        hf_model_id="Qwen/Qwen3-Next-80B-A3B-Instruct",  # the Thinking model has the same MoE layer
        hidden_size=2048,  # cfg hidden_size 2048 (= tf Qwen3NextConfig default)
        intermediate_size=512,  # cfg moe_intermediate_size 512 (= tf default)
        num_experts=512,  # cfg num_experts 512 (= tf default)
        topk=10,  # cfg num_experts_per_tok 10 (= tf default)
        routing="softmax_topk",  # tf Qwen3NextTopKRouter: softmax, topk, / sum if norm_topk_prob
        renormalize=True,  # cfg norm_topk_prob true (= tf default)
        num_shared_experts=1,  # cfg shared_expert_intermediate_size 512 (= tf default) = I: one shared expert
        shared_expert_gate=True,  # tf Qwen3NextSparseMoeBlock: sigmoid(x @ shared_expert_gate.T) * shared_expert(x)
    ),
    ModelPreset(
        name="glm-4.5-air",
        hf_model_id="zai-org/GLM-4.5-Air",
        hidden_size=4096,  # cfg hidden_size 4096 (= tf Glm4MoeConfig default)
        intermediate_size=1408,  # cfg moe_intermediate_size 1408 (= tf default)
        num_experts=128,  # cfg n_routed_experts 128 (= tf default)
        topk=8,  # cfg num_experts_per_tok 8 (= tf default)
        routing="biased_grouped_topk",  # tf Glm4MoeTopkRouter: DeepSeek-V3's noaux_tc (sigmoid + bias)
        renormalize=True,  # cfg norm_topk_prob true (= tf default)
        num_expert_group=1,  # cfg n_group 1 (= tf default)
        topk_group=1,  # cfg topk_group 1 (= tf default)
        routed_scaling_factor=1.0,  # cfg routed_scaling_factor 1.0 (= tf default; GLM-4.5, the 355B, has 2.5)
        num_shared_experts=1,  # cfg n_shared_experts 1; tf Glm4MoeMoE.shared_experts: moe_intermediate_size * 1 = I
    ),
    ModelPreset(
        name="kimi-k2",
        hf_model_id="moonshotai/Kimi-K2-Instruct",  # DeepSeek-V3's layout (DeepseekV3ForCausalLM); Base alike
        hidden_size=7168,  # cfg hidden_size 7168
        intermediate_size=2048,  # cfg moe_intermediate_size 2048
        num_experts=384,  # cfg n_routed_experts 384
        topk=8,  # cfg num_experts_per_tok 8
        routing="biased_grouped_topk",  # cfg scoring_func "sigmoid", topk_method "noaux_tc" (tf DeepseekV3TopkRouter)
        renormalize=True,  # cfg norm_topk_prob true
        num_expert_group=1,  # cfg n_group 1
        topk_group=1,  # cfg topk_group 1
        routed_scaling_factor=2.827,  # cfg routed_scaling_factor 2.827
        num_shared_experts=1,  # cfg n_shared_experts 1 (tf DeepseekV3MoE: moe_intermediate_size * 1 = I)
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
