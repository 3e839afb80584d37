"""transformers' sparse-MoE blocks served by the layer: :func:`patch_hf_model` replaces every supported
block of a transformers model by an :class:`HFMoEBlock`, and :meth:`moe_torch.EPMoE.from_hf_block`
builds one :class:`moe_torch.EPMoE` from one block.

Supported (transformers 5.24, read from ``models/{mixtral,qwen3_moe,deepseek_v3,glm4_moe,qwen3_next,llama4,gpt_oss}/
modeling_*.py``):

============================  ========================================================================
block                         routing, and what else it computes
============================  ========================================================================
``MixtralSparseMoeBlock``     softmax top-k, always renormalized (training: ``router_jitter_noise``)
``Qwen3MoeSparseMoeBlock``    softmax top-k, renormalized iff ``norm_topk_prob``
``DeepseekV3MoE``             sigmoid + ``e_score_correction_bias``, ``n_group`` / ``topk_group`` groups,
                              ``norm_topk_prob``, ``routed_scaling_factor``; plus the shared-expert MLP.
                              Also Kimi K2 (its checkpoints say ``model_type="kimi_k2"`` and load as
                              ``DeepseekV3ForCausalLM``: ``n_group = topk_group = 1``, rsf 2.827)
``Glm4MoeMoE``                GLM-4.5 / GLM-4.5-Air: DeepseekV3MoE's computation (``Glm4MoeTopkRouter`` is
                              ``DeepseekV3TopkRouter`` line for line; ``n_group = topk_group = 1`` in the
                              released configs)
``Qwen3NextSparseMoeBlock``   softmax top-k, renormalized iff ``norm_topk_prob``; plus the shared-expert MLP
                              ``shared_expert`` scaled by ``sigmoid(x @ shared_expert_gate.weight.T)``
                              (``shared_expert_gate [1, H]``, an ``nn.Linear`` without bias)
``Llama4TextMoe``             sigmoid top-k (``Llama4Router``: top-k of the logits, sigmoid of the chosen,
                              no renormalization) applied to the expert *input* (``x * sigmoid(logit)``, then
                              the expert, outputs summed unweighted: ``apply_router_weight_on_input``); plus
                              the shared-expert MLP ``shared_expert``
``GptOssMLP``                 gpt-oss: softmax of the top-k logits (``GptOssTopKRouter``: softmax top-k,
                              renormalized; logits ``F.linear(x, router.weight, router.bias)``), ``swiglu_oai``
                              on interleaved gate/up columns, per-expert biases (``expert_bias``)
============================  ========================================================================

transformers' layout, which is ours (CONTRACT.md, Names), for all but Llama 4: ``block.gate.weight [E, H]``
(the router: ``router_logits = x @ weight.T``; DeepSeek-V3 and GLM-4.5 in float32),
``block.experts.gate_up_proj [E, 2*I, H]`` (``gate, up = linear(x, gate_up_proj[e]).chunk(2)``: gate rows
first = our ``w13``), ``block.experts.down_proj [E, H, I]`` (our ``w2``), DeepSeek-V3's / GLM-4.5's
``block.gate.e_score_correction_bias [E]`` float32 buffer and ``block.shared_experts`` (an MLP of
intermediate ``n_shared_experts * I``, added unweighted), Qwen3-Next's ``block.shared_expert`` (intermediate
``shared_expert_intermediate_size``, a multiple of ``I``) and ``block.shared_expert_gate``. Llama 4
(``Llama4TextExperts``) stores its experts in-by-out for ``torch.bmm``: ``experts.gate_up_proj [E, H, 2*I]``
(``gate, up = (x @ gate_up_proj[e]).chunk(2, -1)``: gate *columns* first) and ``experts.down_proj [E, I, H]``,
so ``w13 = gate_up_proj.transpose(1, 2)`` and ``w2 = down_proj.transpose(1, 2)`` (views); its router is
``block.router`` (``Llama4Router``, an ``nn.Linear [E, H]`` without bias, in the model's dtype) and its shared
MLP ``block.shared_expert`` (intermediate ``I``). gpt-oss (``GptOssExperts``) is in-by-out too:
``experts.gate_up_proj [E, H, 2*I]`` (gate / up *columns* interleaved, ``0::2`` / ``1::2``: ``w13 =
gate_up_proj.transpose(1, 2)`` keeps them as the interleaved rows of ``config.gate_up_layout='interleaved'``),
``experts.down_proj [E, I, H]``, ``experts.gate_up_proj_bias [E, 2*I]`` / ``experts.down_proj_bias [E, H]`` (the layer's
``w13_bias`` / ``w2_bias``); its router is ``block.router`` (weight ``[E, H]`` and bias ``[E]``). Only the float
``GptOssExperts`` is served (transformers' MXFP4 experts class is refused naming it: load with
``Mxfp4Config(dequantize=True)``, or read the codes with ``interop.checkpoints.load_moe_layer``).

What each block's ``forward`` returns, and so what :class:`HFMoEBlock` returns in its place: ``[B, S, H]``
(a tensor; transformers records the router logits with a forward hook on the router module) for all but
Llama 4 and gpt-oss; ``Llama4TextMoe`` returns a tuple ``(out [B*S, H], router_logits [B*S, E])`` (flattened tokens:
its decoder layer views the output back to ``[B, S, H]``), ``GptOssMLP`` ``(out [B, S, H], router_scores [B*S, topk])``
(its router's own softmax of the top-k logits).

:class:`HFMoEBlock` keeps what transformers names and hooks: the router module itself as ``gate`` (Llama 4:
``router``; its forward hook records ``router_logits`` for ``output_router_logits`` and the aux loss; its own
top-k is computed and discarded), the expert tensors, as the very ``Parameter`` objects of the block (no
copy), under ``experts.gate_up_proj`` / ``experts.down_proj`` (Llama 4's in their in-by-out shape; the layer
reads them through transposed views, which the Triton GEMM copies to the ``[E, N, K]`` layout per call),
and the shared MLP (``shared_experts`` / ``shared_expert``) and Qwen3-Next's ``shared_expert_gate`` as they
are (plain torch modules, run beside the layer as transformers runs them). So ``state_dict()`` and
``named_parameters()`` have transformers' names and tensors, and ``save_pretrained`` of a patched float model
loads back into the unpatched class. Its forward: ``router_logits = gate(x)[0]`` (Llama 4:
``router(x)[1]``), then :func:`moe_torch.moe_forward` on them and the routed experts (routing as the block's
router does it, CONTRACT.md section 1; Llama 4 with ``apply_router_weight_on_input``), then the shared MLP as
the block adds it (``+ shared_experts(x)``; Qwen3-Next ``+ sigmoid(shared_expert_gate(x)) * shared_expert(x)``;
Llama 4 ``shared_expert(x) + routed``).

:meth:`moe_torch.EPMoE.from_hf_block` (:func:`block_layer_weights`) fuses the shared MLP instead: ``S``
fused shared experts of intermediate ``I`` (Qwen3-Next's gated by the layer's ``shared_expert_gate`` weight,
``config.shared_expert_gate``; Llama 4's with ``config.apply_router_weight_on_input``, unscaled).

``quant='fp8_per_token'`` / ``'fp8_block'`` replaces the float experts by FP8 codes
(``experts.gate_up_proj`` / ``experts.down_proj`` float8_e4m3fn) and float32 dequantization
multipliers ``experts.gate_up_proj_scale_inv`` / ``experts.down_proj_scale_inv`` (transformers'
FP8 experts' names; ``[E, N]`` per channel, or ``[E, ceil(N/128), ceil(K/128)]`` blocks); the router,
the shared MLPs and Qwen3-Next's shared gate stay float. Llama 4's codes are held in the layer's layout
(``[E, 2*I, H]`` / ``[E, H, I]``, not its in-by-out float shapes). Such a model's ``save_pretrained`` raises
(the unpatched class would read the codes as float weights, without their scales); ``state_dict()`` /
``load_state_dict`` work between models patched alike, and ``load_state_dict`` refuses float weights
into FP8 codes.

No mirror in ``moe_pallas`` (transformers' blocks are torch modules; the JAX side has
``interop/hf_jax.py``). transformers is not imported here: blocks are recognised by class name and
module.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from moe_contract.config import MoEConfig
from moe_contract.validation import check_bool, check_choice, dtype_name
from moe_torch.layer import LAYER_IMPLEMENTATIONS, moe_forward, quantize_layer_weights
from moe_torch.ops.dispatch import check_implementation
from moe_torch.tensor_guards import check_code_dtypes_on_load, keep_dtypes_fn, require_torch_tensors

log = logging.getLogger("moe_torch")

#: The transformers block classes served: class name -> the module that defines it.
SUPPORTED_BLOCKS = {
    "MixtralSparseMoeBlock": "transformers.models.mixtral.modeling_mixtral",
    "Qwen3MoeSparseMoeBlock": "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "DeepseekV3MoE": "transformers.models.deepseek_v3.modeling_deepseek_v3",  # DeepSeek-V3 and Kimi K2
    "Glm4MoeMoE": "transformers.models.glm4_moe.modeling_glm4_moe",
    "Qwen3NextSparseMoeBlock": "transformers.models.qwen3_next.modeling_qwen3_next",
    "Llama4TextMoe": "transformers.models.llama4.modeling_llama4",
    "GptOssMLP": "transformers.models.gpt_oss.modeling_gpt_oss",
}

#: Each served block's child modules in transformers 5.24 (a block holding anything else is refused).
BLOCK_MODULES = {
    "MixtralSparseMoeBlock": ("gate", "experts"),
    "Qwen3MoeSparseMoeBlock": ("gate", "experts"),
    "DeepseekV3MoE": ("experts", "gate", "shared_experts"),
    "Glm4MoeMoE": ("experts", "gate", "shared_experts"),
    "Qwen3NextSparseMoeBlock": ("gate", "experts", "shared_expert", "shared_expert_gate"),
    "Llama4TextMoe": ("experts", "router", "shared_expert"),
    "GptOssMLP": ("router", "experts"),
}

#: transformers 5.24 MoE blocks of the 2026 families that are recognised but not served: class name -> what they
#: compute that is not read yet. ``read_block`` and ``patch_hf_model`` refuse them with this reason. (Empty since
#: gpt-oss's ``GptOssMLP`` is served.)
UNSERVED_BLOCKS: dict[str, str] = {}

#: gpt-oss's ``GptOssExperts`` constants that ``swiglu_oai`` computes (CONTRACT.md section 4): (alpha, limit).
_SWIGLU_OAI = (1.702, 7.0)

#: transformers activation classes (``ACT2CLS`` in ``transformers/activations.py``) -> ours.
_ACTIVATIONS = {
    "SiLUActivation": "silu",  # hidden_act="silu"
    "SiLU": "silu",  # torch.nn.SiLU: hidden_act="swish"
    "GELUTanh": "gelu_tanh",  # "gelu_pytorch_tanh", "gelu_python_tanh"
    "NewGELUActivation": "gelu_tanh",  # "gelu_new": the same tanh formula
}


def supported_block_name(module: torch.nn.Module) -> str | None:
    """The class name of ``module`` if it is one of :data:`SUPPORTED_BLOCKS` (exactly that class,
    not a subclass: a subclass may compute something else), else ``None``."""
    cls = type(module)
    return cls.__name__ if SUPPORTED_BLOCKS.get(cls.__name__) == cls.__module__ else None


@dataclasses.dataclass(frozen=True)
class _Block:
    """What one transformers block computes, read from its modules."""

    name: str  # the class name
    config: MoEConfig  # the routed experts (S = 0), quant 'none' (Llama 4: apply_router_weight_on_input)
    router_name: str  # the router module's name: "gate", or Llama 4's "router"
    gate: torch.nn.Module  # the router module
    gate_up_proj: torch.Tensor  # [E, 2I, H] (Llama 4: [E, H, 2I], in_by_out)
    down_proj: torch.Tensor  # [E, H, I] (Llama 4: [E, I, H], in_by_out)
    in_by_out: bool  # Llama 4's experts, stored for x @ w (torch.bmm)
    shared_name: str | None  # "shared_experts" (DeepSeek-V3, GLM-4.5) / "shared_expert" (Qwen3-Next, Llama 4)
    shared_experts: torch.nn.Module | None  # the shared MLP
    num_shared_experts: int  # its intermediate / I
    shared_expert_gate: torch.nn.Module | None  # Qwen3-Next's nn.Linear(H, 1, bias=False)
    jitter_noise: float  # Mixtral's training-time input jitter
    gate_up_proj_bias: torch.Tensor | None = None  # gpt-oss: [E, 2I] (interleaved gate/up, as the rows of w13)
    down_proj_bias: torch.Tensor | None = None  # gpt-oss: [E, H]

    @property
    def w13(self) -> torch.Tensor:
        """``[E, 2I, H]`` (a transposed view of Llama 4's ``[E, H, 2I]``)."""
        return self.gate_up_proj.transpose(1, 2) if self.in_by_out else self.gate_up_proj

    @property
    def w2(self) -> torch.Tensor:
        """``[E, H, I]`` (a transposed view of Llama 4's ``[E, I, H]``)."""
        return self.down_proj.transpose(1, 2) if self.in_by_out else self.down_proj


def _activation(op: str, name: str, where: str, act_fn) -> str:
    act = _ACTIVATIONS.get(type(act_fn).__name__)
    if act is None:
        raise NotImplementedError(
            f"{op}: {name}: {where} is {type(act_fn).__name__}; the layer has silu and gelu_tanh "
            f"(transformers classes {sorted(_ACTIVATIONS)})")
    return act


def _shape(op: str, name: str, what: str, t, expected: tuple) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != expected:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{op}: {name}: {what} must be {expected}; got {got}")


def _shared_mlp(op: str, name: str, where: str, shared: torch.nn.Module, H: int, I: int, act: str) -> int:
    """The number ``S`` of experts of intermediate ``I`` that the shared MLP ``shared`` (``gate_proj`` / ``up_proj``
    ``[S*I, H]``, ``down_proj [H, S*I]``, no biases, the experts' activation) is."""
    i_shared = shared.gate_proj.weight.shape[0]
    if i_shared == 0 or i_shared % I:
        raise ValueError(f"{op}: {name}: {where}'s intermediate size (={i_shared}) must be a positive multiple of the "
                         f"experts' (I={I})")
    _shape(op, name, f"{where}.gate_proj.weight", shared.gate_proj.weight, (i_shared, H))
    _shape(op, name, f"{where}.up_proj.weight", shared.up_proj.weight, (i_shared, H))
    _shape(op, name, f"{where}.down_proj.weight", shared.down_proj.weight, (H, i_shared))
    if any(getattr(shared, p).bias is not None for p in ("gate_proj", "up_proj", "down_proj")):
        raise NotImplementedError(f"{op}: {name}: {where} with biases are not supported")
    act_fn = shared.act_fn if hasattr(shared, "act_fn") else getattr(shared, "activation_fn", None)  # Llama 4's name
    if _activation(op, name, f"{where}.act_fn", act_fn) != act:
        raise NotImplementedError(f"{op}: {name}: {where}: its activation differs from the experts'")
    return i_shared // I


def read_block(block: torch.nn.Module, op: str = "read_block") -> _Block:
    """The routing, sizes and weights of one supported transformers block.

    Raises: NotImplementedError (not a supported block class; an unsupported activation, router or expert
      bias), ValueError (shapes that disagree with the block's sizes).
    """
    name = supported_block_name(block)
    if name is None and type(block).__name__ in UNSERVED_BLOCKS:
        raise NotImplementedError(f"{op}: {type(block).__name__} is not served: "
                                  f"{UNSERVED_BLOCKS[type(block).__name__]}")
    if name is None:
        raise NotImplementedError(
            f"{op}: block must be one of transformers' {sorted(SUPPORTED_BLOCKS)}; got "
            f"{type(block).__module__}.{type(block).__name__}")
    known = set(BLOCK_MODULES[name])
    if set(block._modules) != known or block._parameters or block._buffers:
        raise NotImplementedError(
            f"{op}: {name} holds {sorted(block._modules)} (and {len(block._parameters)} parameter(s) / "
            f"{len(block._buffers)} buffer(s) of its own); this layer knows transformers 5.24's {sorted(known)}, "
            f"nothing else")
    llama4, gpt_oss = name == "Llama4TextMoe", name == "GptOssMLP"
    router_name = "router" if llama4 or gpt_oss else "gate"
    gate, experts = getattr(block, router_name), block.experts
    if gpt_oss:  # GptOssExperts: in-by-out [E, H, 2I] / [E, I, H], interleaved gate/up columns, biases; router biased
        if type(experts).__name__ != "GptOssExperts":
            raise NotImplementedError(
                f"{op}: {name}.experts is {type(experts).__name__}; the float GptOssExperts is served (transformers' "
                f"MXFP4 experts hold packed codes: load with quantization_config=Mxfp4Config(dequantize=True), or read "
                f"the checkpoint's codes with interop.checkpoints.load_moe_layer)")
        E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
        _shape(op, name, "experts.gate_up_proj [E, H, 2*I] (in-by-out)", experts.gate_up_proj, (E, H, 2 * I))
        _shape(op, name, "experts.down_proj [E, I, H] (in-by-out)", experts.down_proj, (E, I, H))
        _shape(op, name, "experts.gate_up_proj_bias [E, 2*I]", experts.gate_up_proj_bias, (E, 2 * I))
        _shape(op, name, "experts.down_proj_bias [E, H]", experts.down_proj_bias, (E, H))
        _shape(op, name, "router.bias [E]", gate.bias, (E,))
        if (float(experts.alpha), float(experts.limit)) != _SWIGLU_OAI:
            raise NotImplementedError(
                f"{op}: {name}: experts.alpha / experts.limit (swiglu_alpha / swiglu_limit) must be {_SWIGLU_OAI} "
                f"(swiglu_oai's constants); got ({experts.alpha}, {experts.limit})")
    elif llama4:  # Llama4TextExperts: in-by-out, for torch.bmm(x, gate_up_proj)
        E, H, I = experts.num_experts, experts.hidden_size, experts.expert_dim
        _shape(op, name, "experts.gate_up_proj [E, H, 2*I] (in-by-out)", experts.gate_up_proj, (E, H, 2 * I))
        _shape(op, name, "experts.down_proj [E, I, H] (in-by-out)", experts.down_proj, (E, I, H))
        if gate.bias is not None:
            raise NotImplementedError(f"{op}: {name}: a router with a bias is not supported (Llama4Router has none)")
    else:
        E, H, I = experts.num_experts, experts.hidden_dim, experts.intermediate_dim
        _shape(op, name, "experts.gate_up_proj [E, 2*I, H]", experts.gate_up_proj, (E, 2 * I, H))
        _shape(op, name, "experts.down_proj [E, H, I]", experts.down_proj, (E, H, I))
    _shape(op, name, f"{router_name}.weight [E, H]", gate.weight, (E, H))
    act = "swiglu_oai" if gpt_oss else _activation(op, name, "experts.act_fn", experts.act_fn)
    fields = dict(hidden_size=H, intermediate_size=I, num_experts=E, topk=gate.top_k, activation=act)
    shared_name, shared, n_shared, shared_gate, jitter = None, None, 0, None, 0.0
    if name == "MixtralSparseMoeBlock":
        cfg = MoEConfig(**fields, routing="softmax_topk", renormalize=True)  # its router always divides by the sum
        jitter = float(block.jitter_noise)
    elif name == "Qwen3MoeSparseMoeBlock":
        cfg = MoEConfig(**fields, routing="softmax_topk", renormalize=bool(gate.norm_topk_prob))
    elif name == "Qwen3NextSparseMoeBlock":  # Qwen3NextTopKRouter: Qwen3-MoE's; plus the gated shared MLP
        cfg = MoEConfig(**fields, routing="softmax_topk", renormalize=bool(gate.norm_topk_prob))
        shared_name, shared_gate = "shared_expert", block.shared_expert_gate
        _shape(op, name, "shared_expert_gate.weight [1, H]", shared_gate.weight, (1, H))
        if shared_gate.bias is not None:
            raise NotImplementedError(f"{op}: {name}: a shared_expert_gate with a bias is not supported "
                                      f"(transformers' has none)")
    elif gpt_oss:  # GptOssTopKRouter: softmax of the top-k logits (= softmax, top-k, renormalized); bias in the logits
        cfg = MoEConfig(**fields, routing="softmax_topk", renormalize=True, gate_up_layout="interleaved",
                        expert_bias=True)
    elif llama4:  # Llama4Router: topk of the logits, sigmoid of the chosen; the weight scales the expert input
        cfg = MoEConfig(**fields, routing="sigmoid_topk", renormalize=False, apply_router_weight_on_input=True)
        shared_name = "shared_expert"
    else:  # DeepseekV3MoE, Glm4MoeMoE: rsf folded into the gate's weights, as transformers' router does
        _shape(op, name, "gate.e_score_correction_bias [E]", gate.e_score_correction_bias, (E,))
        cfg = MoEConfig(**fields, routing="biased_grouped_topk", renormalize=bool(gate.norm_topk_prob),
                        num_expert_group=gate.num_group, topk_group=gate.topk_group,
                        routed_scaling_factor=float(gate.routed_scaling_factor),
                        apply_routed_scaling_factor_on_output=True)
        shared_name = "shared_experts"
    if shared_name is not None:
        shared = getattr(block, shared_name)
        n_shared = _shared_mlp(op, name, shared_name, shared, H, I, act)
    biases = (experts.gate_up_proj_bias, experts.down_proj_bias) if gpt_oss else (None, None)
    return _Block(name, cfg, router_name, gate, experts.gate_up_proj, experts.down_proj, llama4 or gpt_oss, shared_name,
                  shared, n_shared, shared_gate, jitter, *biases)


#: The ``quant`` choices of the drop-ins: the float weights as they are, or the routed experts in FP8 (the layer's
#: 4-bit weight formats, MXFP4 / INT4, are checkpoint formats and not offered as a conversion here).
HF_QUANTS = ("none", "fp8_per_token", "fp8_block")


def _quant(op: str, quant: str | None) -> str:
    quant = "none" if quant is None else quant
    if quant in ("mxfp4", "int4"):  # the layer's 4-bit modes: say where they are served
        raise ValueError(
            f"{op}: quant must be one of {HF_QUANTS}; got quant={quant!r}: the transformers drop-ins do not convert "
            f"float experts to 4-bit. A 4-bit layer of one block: config, w13, w2, *rest = "
            f"moe_torch.hf.block_layer_weights(block, with_shared_expert_gate=True, with_expert_biases=True), then "
            f"moe_torch.EPMoE.from_float("
            f"config.replace(quant={quant!r}), w13, w2, ...); a gpt-oss MXFP4 checkpoint: "
            f"interop.checkpoints.load_moe_layer")
    check_choice(op, "quant", quant, HF_QUANTS)
    return quant


def block_layer_weights(block: torch.nn.Module, *, quant: str | None = None, op: str = "block_layer_weights",
                        with_shared_expert_gate: bool = False, with_expert_biases: bool = False, **config_overrides):
    """One block as the layer's float inputs: ``(config, w13 [E + S, 2*I, H], w2 [E + S, H, I],
    e_score_correction_bias [E] or None)``, and with ``with_shared_expert_gate=True`` a fifth item,
    ``shared_expert_gate [1, H]`` or None. The shared MLP (DeepSeek-V3's / GLM-4.5's ``shared_experts``, Qwen3-Next's
    and Llama 4's ``shared_expert``) becomes ``S = intermediate / I`` fused shared experts (rows / columns
    ``j*I:(j+1)*I`` of its projections: exact, the MLP is the sum of those pieces). Llama 4's in-by-out experts
    are transposed (a copy). Qwen3-Next's config has ``shared_expert_gate=True`` and its gate weight is
    transformers' ``shared_expert_gate.weight [1, H]`` (one logit for every fused shared slot); Llama 4's has
    ``apply_router_weight_on_input=True``. Used by :meth:`moe_torch.EPMoE.from_hf_block`.

    ``with_expert_biases=True`` appends ``(w13_bias [E, 2*I], w2_bias [E, H])`` (gpt-oss's ``gate_up_proj_bias`` /
    ``down_proj_bias``, views; None for the other blocks) for ``EPMoE.from_float(..., w13_bias=, w2_bias=)``.
    gpt-oss (``GptOssMLP``): ``w13 = gate_up_proj.transpose(1, 2)`` (a contiguous copy, the interleaved gate/up rows
    kept: ``config.gate_up_layout='interleaved'``), ``w2 = down_proj.transpose(1, 2)``, ``config.expert_bias=True``,
    ``activation='swiglu_oai'``; the router's logits are ``F.linear(x, router.weight, router.bias)`` (its bias
    included: ``block.router(x)[0]``).

    Raises: as :func:`read_block`; TypeError for an override that is not a :class:`MoEConfig` field;
      ValueError for a routing field among the overrides (those come from the block); NotImplementedError for
      Qwen3-Next's block without ``with_shared_expert_gate=True`` (the four items cannot carry its gate weight), and
      gpt-oss's without ``with_expert_biases=True`` (nor its biases).
    """
    b = read_block(block, op)
    check_bool(op, "with_shared_expert_gate", with_shared_expert_gate)
    check_bool(op, "with_expert_biases", with_expert_biases)
    if b.gate_up_proj_bias is not None and not with_expert_biases:
        raise NotImplementedError(
            f"{op}: {b.name}'s expert biases (experts.gate_up_proj_bias [E, 2I], experts.down_proj_bias [E, H]) are "
            f"weights of the layer that this call cannot pass; call moe_torch.hf.block_layer_weights(block, "
            f"with_shared_expert_gate=True, with_expert_biases=True) -> (config, w13, w2, bias, shared_expert_gate, "
            f"w13_bias, w2_bias) and EPMoE.from_float(config, w13, w2, w13_bias=w13_bias, w2_bias=w2_bias), or "
            f"patch_hf_model / HFMoEBlock(block)")
    if b.shared_expert_gate is not None and not with_shared_expert_gate:
        raise NotImplementedError(
            f"{op}: {b.name}'s shared_expert_gate [1, H] is a weight of the layer that (config, w13, w2, bias) cannot "
            f"carry; call moe_torch.hf.block_layer_weights(block, with_shared_expert_gate=True) -> (config, w13, w2, "
            f"bias, shared_expert_gate) and pass EPMoE.from_float(config, w13, w2, shared_expert_gate=...)")
    MoEConfig.check_field_names(op, config_overrides)
    routing_fields = set(b.config.gate_kwargs()) - {"apply_routed_scaling_factor_on_output"}
    from_block = routing_fields | {"hidden_size", "intermediate_size", "num_experts", "activation", "quant",
                                   "num_fused_shared_experts", "apply_router_weight_on_input", "shared_expert_gate",
                                   "gate_up_layout", "expert_bias"}
    fixed = sorted(from_block & set(config_overrides))
    if fixed:
        raise ValueError(f"{op}: {fixed} come from the block ({b.name}); overrides may set ep_size, ep_rank, "
                         f"apply_routed_scaling_factor_on_output, capacity_factor; got {sorted(config_overrides)}")
    config = b.config.replace(quant=_quant(op, quant), num_fused_shared_experts=b.num_shared_experts,
                              shared_expert_gate=b.shared_expert_gate is not None, **config_overrides)
    w13, w2 = b.w13.detach(), b.w2.detach()
    if b.in_by_out:  # Llama 4, gpt-oss: the layer's [E, N, K] layout, contiguous (the GEMMs read K with unit stride)
        w13, w2 = w13.contiguous(), w2.contiguous()
    bias = gate = None
    if b.shared_experts is not None:
        I, sh = config.intermediate_size, b.shared_experts
        g, u, d = sh.gate_proj.weight.detach(), sh.up_proj.weight.detach(), sh.down_proj.weight.detach()
        pieces = [slice(j * I, (j + 1) * I) for j in range(b.num_shared_experts)]
        parts13 = [torch.cat([g[p], u[p]])[None] for p in pieces]
        parts2 = [d[:, p][None] for p in pieces]
        w13 = torch.cat([w13, *(p.to(w13.dtype) for p in parts13)])
        w2 = torch.cat([w2, *(p.to(w2.dtype) for p in parts2)])
    if config.routing == "biased_grouped_topk":
        bias = b.gate.e_score_correction_bias.detach()
    if b.shared_expert_gate is not None:
        gate = b.shared_expert_gate.weight.detach()
    out = (config, w13, w2, bias, gate) if with_shared_expert_gate else (config, w13, w2, bias)
    if with_expert_biases:
        biases = (b.gate_up_proj_bias, b.down_proj_bias)
        out += tuple(None if t is None else t.detach() for t in biases)
    return out


class HFExperts(torch.nn.Module):
    """The expert weights of an :class:`HFMoEBlock` under transformers' names (no forward of its own).

    ``gate_up_proj [E, 2*I, H]`` and ``down_proj [E, H, I]`` (Llama 4's float experts ``in_by_out``:
    ``[E, H, 2*I]`` and ``[E, I, H]``, as ``Llama4TextExperts`` holds them; :attr:`w13` / :attr:`w2` are the
    layer's views of either): for ``quant='none'`` the transformers block's own ``Parameter`` objects (its dtype,
    its ``requires_grad``: trainable as in transformers); for FP8 float8_e4m3fn codes in the layer's layout with
    float32 ``gate_up_proj_scale_inv`` / ``down_proj_scale_inv`` (dequantization multipliers, ``w ~= q * scale``):
    frozen buffers (never in ``parameters()``, so no optimizer touches them), kept in their dtype under
    ``.to(dtype)`` / ``.half()`` (:func:`moe_torch.tensor_guards.keep_dtypes_fn`). gpt-oss's ``gate_up_proj_bias [E, 2*I]``
    and ``down_proj_bias [E, H]`` (``GptOssExperts``' own ``Parameter`` objects; None for the other blocks), trainable
    with float or FP8 experts.
    """

    def __init__(self, gate_up_proj, down_proj, gate_up_proj_scale_inv=None, down_proj_scale_inv=None, *,
                 in_by_out: bool = False, gate_up_proj_bias=None, down_proj_bias=None) -> None:
        super().__init__()
        self.in_by_out = in_by_out
        if in_by_out:
            self.num_experts, self.hidden_dim, two_i = gate_up_proj.shape
        else:
            self.num_experts, two_i, self.hidden_dim = gate_up_proj.shape
        self.intermediate_dim = two_i // 2
        # GptOssExperts' order (gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias): state_dict() as its
        tensors = dict(gate_up_proj=gate_up_proj, gate_up_proj_bias=gate_up_proj_bias, down_proj=down_proj,
                       down_proj_bias=down_proj_bias, gate_up_proj_scale_inv=gate_up_proj_scale_inv,
                       down_proj_scale_inv=down_proj_scale_inv)
        for name, t in tensors.items():  # a Parameter as it is (transformers' own), anything else a frozen buffer
            if isinstance(t, torch.nn.Parameter):
                self.register_parameter(name, t)
            else:
                self.register_buffer(name, None if t is None else t.detach())

    @property
    def w13(self) -> torch.Tensor:
        """The layer's ``w13 [E, 2*I, H]``: ``gate_up_proj``, or a transposed view of Llama 4's (autograd reaches the
        parameter through it)."""
        return self.gate_up_proj.transpose(1, 2) if self.in_by_out else self.gate_up_proj

    @property
    def w2(self) -> torch.Tensor:
        """The layer's ``w2 [E, H, I]``: ``down_proj``, or a transposed view of Llama 4's."""
        return self.down_proj.transpose(1, 2) if self.in_by_out else self.down_proj

    @property
    def quantized(self) -> bool:
        return self.gate_up_proj.dtype == torch.float8_e4m3fn

    def _apply(self, fn, recurse=True):
        names = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv") if self.quantized else ()
        return super()._apply(keep_dtypes_fn(self, fn, names), recurse)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        error_msgs = args[-1]  # (local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if check_code_dtypes_on_load(self, state_dict, prefix, ("gate_up_proj", "down_proj"), error_msgs):
            return  # load nothing here: load_state_dict raises with the message
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        return (f"E={self.num_experts}, H={self.hidden_dim}, I={self.intermediate_dim}, "
                f"dtype={dtype_name(self.gate_up_proj)}" + (", in_by_out=True" if self.in_by_out else ""))


class HFMoEBlock(torch.nn.Module):
    """A transformers sparse-MoE block computed by :func:`moe_torch.moe_forward`:
    ``forward(hidden_states [B, S, H])`` returns what the block it replaces returns, in ``hidden_states.dtype``:
    ``[B, S, H]``, or for ``Llama4TextMoe`` the tuple ``(out [B*S, H], router_logits [B*S, E])``, for ``GptOssMLP``
    ``(out [B, S, H], router_scores [B*S, topk])`` (module docstring: what is kept, and the names).

    Attributes: ``gate`` (transformers' router module; Llama 4: ``router``), ``experts`` (:class:`HFExperts`),
    ``shared_experts`` (DeepSeek-V3's / GLM-4.5's MLP) or ``shared_expert`` (Qwen3-Next's, Llama 4's), Qwen3-Next's
    ``shared_expert_gate``, ``moe_config`` (:class:`MoEConfig` of the routed experts), ``implementation`` and
    ``recompute`` (settable), ``replaces`` (the class name it replaced).

    Router losses (CONTRACT.md section 10): transformers' own ``output_router_logits`` / ``router_aux_loss_coef``
    path works unchanged (the router module's hook records the logits, and the model computes its
    ``load_balancing_loss_func`` from them). With ``record_router_losses`` (settable) each forward also keeps
    ``last_router_losses``: the layer's :class:`moe_torch.ops.gate.losses.RouterLosses` of the call (``aux_loss``,
    ``seq_aux_loss`` per sequence of ``[B, S, H]`` hidden states, ``z_loss``, ``tokens_per_expert [E]`` int32; the
    losses differentiable in the router's weight), computed from the gate's own ids, without changing what
    ``forward`` returns: add ``coef * block.last_router_losses.seq_aux_loss`` to the loss (DeepSeek-V3's blocks have
    no auxiliary loss in transformers), and move DeepSeek-V3's ``gate.e_score_correction_bias`` with
    :func:`moe_torch.update_expert_bias` of its ``tokens_per_expert`` after the step (summed over the step's calls:
    each forward replaces ``last_router_losses``). It holds the autograd graph of the losses until the next forward.

    Gradients: every backend (the Triton kernels included) is differentiable through
    :func:`moe_torch.moe_forward`'s backward (CONTRACT.md section 8): ``hidden_states``, the router's
    weight (through ``router_logits``), float experts (Llama 4's through the transposed views), the shared MLP and
    Qwen3-Next's shared gate (plain torch) equal transformers' block's gradients (``tests/test_hf_grad_parity.py``,
    ``tests/test_hf_2026.py``). FP8 experts are frozen and straight-through (gradients reach ``hidden_states`` and
    the router).
    """

    def __init__(self, block: torch.nn.Module, *, implementation: str | None = None,
                 quant: str | None = None, recompute: bool = False, record_router_losses: bool = False) -> None:
        """``block``: a supported transformers block; ``implementation``, ``quant``, ``recompute``,
        ``record_router_losses``: as :func:`patch_hf_model`.

        Raises: as :func:`read_block`; ValueError (bad ``implementation`` / ``quant``), TypeError
          (``recompute`` or ``record_router_losses`` not a bool)."""
        super().__init__()
        op = "HFMoEBlock"
        quant = _quant(op, quant)
        check_implementation(op, implementation, LAYER_IMPLEMENTATIONS)
        check_bool(op, "recompute", recompute)
        check_bool(op, "record_router_losses", record_router_losses)
        self.record_router_losses = record_router_losses
        self.last_router_losses = None
        b = read_block(block, op)
        self.replaces = b.name
        self.moe_config = b.config.replace(quant=quant)
        self.implementation = implementation
        self.recompute = recompute
        self.jitter_noise = b.jitter_noise
        self._router_name, self._shared_name = b.router_name, b.shared_name
        biases = dict(gate_up_proj_bias=b.gate_up_proj_bias, down_proj_bias=b.down_proj_bias)
        if quant == "none":
            experts = HFExperts(b.gate_up_proj, b.down_proj, in_by_out=b.in_by_out, **biases)
        else:  # codes in the layer's [E, N, K] layout (Llama 4's and gpt-oss's too: a new tensor either way)
            q13, s13, q2, s2 = quantize_layer_weights(b.w13.detach().contiguous(), b.w2.detach().contiguous(),
                                                      self.moe_config)
            experts = HFExperts(q13, q2, s13, s2, **biases)
        children = {b.router_name: b.gate, "experts": experts}
        if b.shared_name is not None:
            children[b.shared_name] = b.shared_experts
        if b.shared_expert_gate is not None:
            children["shared_expert_gate"] = b.shared_expert_gate
        for name in block._modules:  # the block's order: state_dict() lists the keys as transformers does
            self.add_module(name, children[name])
        self.train(block.training)  # a new module is in training mode; the model may be in eval mode

    def forward(self, hidden_states: torch.Tensor):
        require_torch_tensors("HFMoEBlock", dict(hidden_states=hidden_states))
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # MixtralSparseMoeBlock's training-time jitter, drawn as it does
            j = self.jitter_noise
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - j, 1.0 + j)
        x = hidden_states.reshape(-1, shape[-1])
        router = getattr(self, self._router_name)
        # Through the router module, so that its hook records router_logits: Llama4Router returns
        # (scores, logits), the others (logits, weights, ids).
        # GptOssTopKRouter returns (logits incl. its bias, scores [T, topk], ids).
        routed = router(x)
        router_logits = routed[1 if self.replaces == "Llama4TextMoe" else 0]
        ex = self.experts
        bias = router.e_score_correction_bias if self.moe_config.routing == "biased_grouped_topk" else None
        record = self.record_router_losses
        check_bool("HFMoEBlock", "record_router_losses", record)  # settable: checked where it is read
        out = moe_forward(x, router_logits, ex.w13, ex.w2, self.moe_config,
                          w13_scale=ex.gate_up_proj_scale_inv, w2_scale=ex.down_proj_scale_inv,
                          w13_bias=ex.gate_up_proj_bias, w2_bias=ex.down_proj_bias,
                          e_score_correction_bias=bias, implementation=self.implementation, recompute=self.recompute,
                          return_router_losses=record, seq_len=shape[-2] if record and len(shape) == 3 else None)
        if record:  # kept beside the output: the block returns what transformers' block returns
            out, self.last_router_losses = out
        if self.replaces == "GptOssMLP":  # (out [B, S, H], router_scores [B*S, topk]: the router's own)
            return out.reshape(shape), routed[1]
        if self.replaces == "Llama4TextMoe":  # out = shared_expert(x); out.add_(routed), flat tokens
            return self.shared_expert(x) + out, router_logits
        if self.replaces == "Qwen3NextSparseMoeBlock":  # routed + sigmoid(shared_expert_gate(x)) * shared_expert(x)
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            return (out + shared).reshape(shape)
        out = out.reshape(shape)
        if self._shared_name is not None:  # DeepseekV3MoE / Glm4MoeMoE: + shared_experts(x)
            out = out + self.shared_experts(hidden_states)
        return out

    def extra_repr(self) -> str:
        c = self.moe_config
        return (f"replaces={self.replaces}, E={c.num_experts}, topk={c.topk}, routing={c.routing!r}, "
                f"renormalize={c.renormalize}, quant={c.quant!r}, implementation={self.implementation!r}, "
                f"recompute={self.recompute}"
                + (", apply_router_weight_on_input=True" if c.apply_router_weight_on_input else "")
                + (", record_router_losses=True" if self.record_router_losses else ""))


def _refuse_save_pretrained(model_class: str, quant: str, *args, **kwargs):
    raise NotImplementedError(
        f"save_pretrained: this {model_class} holds FP8 experts (moe_torch.patch_hf_model(quant={quant!r})); "
        f"transformers' {model_class} would load the FP8 codes as float weights without their scales. Save the "
        f"float model (before patching, or patched with quant=None) and patch again after loading; "
        f"torch.save(model.state_dict()) loads back into a model patched the same way")


def patch_hf_model(model: torch.nn.Module, implementation: str | None = None,
                   quant: str | None = None, *, recompute: bool = False,
                   record_router_losses: bool = False) -> torch.nn.Module:
    """Replace every supported sparse-MoE block of a transformers model by an :class:`HFMoEBlock`, in place.

    Args:
      model: a transformers model (``MixtralForCausalLM``, ``Qwen3MoeModel``, ``DeepseekV3ForCausalLM`` (Kimi K2
        too), ``Glm4MoeForCausalLM``, ``Qwen3NextForCausalLM``, ``Llama4ForCausalLM``,
        ``Llama4ForConditionalGeneration``... any ``nn.Module`` holding :data:`SUPPORTED_BLOCKS`).
      implementation: the layer's backend, as :func:`moe_torch.moe_forward` takes it (``None``: the
        reference on a CPU, the fastest backend on CUDA; ``"reference"``; ``"triton"``).
      quant: ``None`` / ``"none"`` (the float weights themselves, no copy), ``"fp8_per_token"`` or
        ``"fp8_block"`` (the routed experts quantized, module docstring; ``fp8_block`` needs H and I
        multiples of 128).
      recompute: the layer's ``recompute`` (:func:`moe_torch.moe_forward`): ``True`` keeps only the
        routing for the backward and recomputes GEMM 1 there.
      record_router_losses: each block keeps its last call's router losses as ``last_router_losses``
        (:class:`HFMoEBlock`; CONTRACT.md section 10), what the blocks return unchanged.

    The patched model trains like the original (every backend has a backward; FP8 experts are frozen
    buffers, straight-through): its parameters' gradients equal transformers' (float32 within 1e-5,
    ``tests/test_hf_grad_parity.py``, ``tests/test_hf_2026.py``).

    Returns: ``model`` (patched in place). Its logits equal the unpatched model's to the contract
    (float32: a few ulps of summation order; bf16: CONTRACT.md section 7), ``state_dict()`` keeps
    transformers' names, and ``save_pretrained`` of a float-patched model loads into the unpatched
    class; with FP8, ``model.save_pretrained`` raises ``NotImplementedError`` (module docstring).

    Raises: TypeError (``model`` not an ``nn.Module``; ``recompute`` or ``record_router_losses`` not a bool),
      ValueError (bad ``implementation`` / ``quant``; no MoE block found, naming the model class; already patched),
      NotImplementedError (a MoE block class that is not supported, naming it; an unsupported
      activation). The model is unchanged when it raises.
    """
    op = "patch_hf_model"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{op}: model must be a torch.nn.Module (a transformers model); got {type(model).__name__}")
    quant = _quant(op, quant)
    check_implementation(op, implementation, LAYER_IMPLEMENTATIONS)
    check_bool(op, "recompute", recompute)
    check_bool(op, "record_router_losses", record_router_losses)
    targets, unsupported, patched, inside = [], [], [], []
    for path, module in model.named_modules():  # pre-order: a block comes before its submodules
        if any(path.startswith(p + ".") for p in inside):
            continue
        if isinstance(module, HFMoEBlock):
            patched.append(path)
        elif supported_block_name(module) is not None:
            targets.append((path, module))
        elif (all(isinstance(getattr(module, a, None), torch.nn.Module) for a in ("gate", "experts"))
              or type(module).__name__ in UNSERVED_BLOCKS):  # gpt-oss's holds `router`, not `gate`
            unsupported.append((path, type(module).__name__))  # transformers' MoE blocks hold `gate` and `experts`
        else:
            continue
        inside.append(path)
    model_class = type(model).__name__
    if unsupported:
        shown = ", ".join(f"{p or '<model>'} ({c})" for p, c in unsupported[:3])
        shown += " ..." if len(unsupported) > 3 else ""
        why = "".join(f" {c}: {UNSERVED_BLOCKS[c]}." for c in sorted({c for _, c in unsupported}) if c in UNSERVED_BLOCKS)
        raise NotImplementedError(
            f"{op}: {model_class} has MoE blocks of a class that is not supported: {shown}; supported: "
            f"{sorted(SUPPORTED_BLOCKS)}.{why} Nothing was changed")
    if not targets:
        if patched:
            raise ValueError(f"{op}: {model_class} is already patched ({len(patched)} HFMoEBlock, e.g. "
                             f"{patched[0] or '<model>'}); patch the unpatched model")
        raise ValueError(f"{op}: {model_class} has no sparse-MoE block to replace "
                         f"(supported: {sorted(SUPPORTED_BLOCKS)})")
    if targets[0][0] == "":
        raise ValueError(f"{op}: model is itself a {model_class} block; replace it with HFMoEBlock(block) or "
                         f"build the layer with EPMoE.from_hf_block(block)")
    for _, block in targets:  # every block readable before anything changes
        read_block(block, op)
    names = "/".join(sorted({supported_block_name(b) for _, b in targets}))
    paths = [p for p, _ in targets]
    del targets, block  # hold no block here: with FP8 each block's float experts are freed once it is replaced
    for path in paths:
        parent, _, child_name = path.rpartition(".")
        parent = model.get_submodule(parent)
        setattr(parent, child_name, HFMoEBlock(getattr(parent, child_name), implementation=implementation, quant=quant,
                                               recompute=recompute, record_router_losses=record_router_losses))
    if quant != "none" and hasattr(model, "save_pretrained"):
        model.save_pretrained = functools.partial(_refuse_save_pretrained, model_class, quant)
    log.info("%s: %d %s block(s) of %s served by moe_torch (implementation=%r, quant=%r)", op, len(paths), names,
             model_class, implementation, quant)
    return model
