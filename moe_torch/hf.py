"""transformers' sparse-MoE blocks served by the layer: :func:`patch_hf_model` replaces every supported
block of a transformers model by an :class:`HFMoEBlock`, and :meth:`moe_torch.EPMoE.from_hf_block`
builds one :class:`moe_torch.EPMoE` from one block.

Supported (transformers 5.24, read from ``models/{mixtral,qwen3_moe,deepseek_v3}/modeling_*.py``):

==========================  ==========================================================================
block                       routing
==========================  ==========================================================================
``MixtralSparseMoeBlock``   softmax top-k, always renormalized (training: ``router_jitter_noise``)
``Qwen3MoeSparseMoeBlock``  softmax top-k, renormalized iff ``norm_topk_prob``
``DeepseekV3MoE``           sigmoid + ``e_score_correction_bias``, ``n_group`` / ``topk_group`` groups,
                            ``norm_topk_prob``, ``routed_scaling_factor``; plus the shared-expert MLP
==========================  ==========================================================================

transformers' layout, which is ours (CONTRACT.md, Names): ``block.gate.weight [E, H]`` (the router:
``router_logits = x @ weight.T``; DeepSeek-V3 in float32), ``block.experts.gate_up_proj [E, 2*I, H]``
(``gate, up = linear(x, gate_up_proj[e]).chunk(2)``: gate rows first = our ``w13``),
``block.experts.down_proj [E, H, I]`` (our ``w2``), DeepSeek-V3's ``block.gate.e_score_correction_bias
[E]`` float32 buffer and ``block.shared_experts`` (an MLP of intermediate ``n_shared_experts * I``,
added unweighted). Every block's ``forward`` takes ``[B, S, H]`` and returns ``[B, S, H]`` (a tensor,
no router logits: transformers records those with a forward hook on the router module).

:class:`HFMoEBlock` keeps what transformers names and hooks: the router module itself as ``gate``
(its forward hook records ``router_logits`` for ``output_router_logits`` and the aux loss; its own
top-k is computed and discarded), the expert tensors, as the very ``Parameter`` objects of the
block (no copy), under ``experts.gate_up_proj`` / ``experts.down_proj``, and DeepSeek-V3's
``shared_experts`` MLP as it is. So ``state_dict()`` and ``named_parameters()`` have transformers'
names and tensors, and ``save_pretrained`` of a patched float model loads back into the unpatched
class. Its forward: ``router_logits = gate(x)[0]``, then :func:`moe_torch.moe_forward` on them and
the experts (routing as the block's router does it, CONTRACT.md section 1), then ``+ shared_experts(x)``.

``quant='fp8_per_token'`` / ``'fp8_block'`` replaces the float experts by FP8 codes
(``experts.gate_up_proj`` / ``experts.down_proj`` float8_e4m3fn) and float32 dequantization
multipliers ``experts.gate_up_proj_scale_inv`` / ``experts.down_proj_scale_inv`` (transformers'
FP8 experts' names; ``[E, N]`` per channel, or ``[E, ceil(N/128), ceil(K/128)]`` blocks); the router
and DeepSeek-V3's shared MLP stay float. Such a model's ``save_pretrained`` raises (the unpatched
class would read the codes as float weights, without their scales); ``state_dict()`` /
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

from moe_contract.config import QUANTS, MoEConfig
from moe_contract.validation import check_bool, check_choice, dtype_name
from moe_torch.layer import LAYER_IMPLEMENTATIONS, moe_forward
from moe_torch.module import check_code_dtypes_on_load, keep_dtypes_fn, quantize_chunked, require_torch_tensors
from moe_torch.ops.dispatch import check_implementation

log = logging.getLogger("moe_torch")

#: The transformers block classes served: class name -> the module that defines it.
SUPPORTED_BLOCKS = {
    "MixtralSparseMoeBlock": "transformers.models.mixtral.modeling_mixtral",
    "Qwen3MoeSparseMoeBlock": "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "DeepseekV3MoE": "transformers.models.deepseek_v3.modeling_deepseek_v3",
}

#: transformers 5.24 MoE blocks of the 2026 families that are recognised but not served (issue 15): class name ->
#: what they compute that is not read yet. ``read_block`` and ``patch_hf_model`` refuse them with this reason.
UNSERVED_BLOCKS = {
    "Llama4TextMoe": "Llama 4 (routing='sigmoid_topk', preset llama4-scout) is not read here yet: its router weight "
                     "scales the expert input (x * sigmoid(logit), then the expert) and its experts are stored "
                     "[E, H, 2I]",
    "GptOssMLP": "gpt-oss (softmax_topk renormalized, swiglu_oai, interleaved gate/up; preset gpt-oss-20b) is not read "
                 "here yet: its experts have biases and are stored [E, H, 2I]",
    "Qwen3NextSparseMoeBlock": "Qwen3-Next (preset qwen3-next-80b-a3b) is not read here yet: its shared expert's "
                               "output is scaled by sigmoid(x @ shared_expert_gate.T)",
    "Glm4MoeMoE": "GLM-4.5 (DeepSeek-V3's routing, preset glm-4.5-air) is not read here yet",
}

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
    config: MoEConfig  # the routed experts (S = 0), quant 'none'
    gate: torch.nn.Module  # the router module
    gate_up_proj: torch.Tensor  # [E, 2I, H]
    down_proj: torch.Tensor  # [E, H, I]
    shared_experts: torch.nn.Module | None  # DeepSeek-V3's MLP
    num_shared_experts: int  # its intermediate / I
    jitter_noise: float  # Mixtral's training-time input jitter


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


def read_block(block: torch.nn.Module, op: str = "read_block") -> _Block:
    """The routing, sizes and weights of one supported transformers block.

    Raises: NotImplementedError (not a supported block class; an unsupported activation or
      expert layout), ValueError (shapes that disagree with the block's sizes).
    """
    name = supported_block_name(block)
    if name is None and type(block).__name__ in UNSERVED_BLOCKS:
        raise NotImplementedError(f"{op}: {type(block).__name__} is not served: "
                                  f"{UNSERVED_BLOCKS[type(block).__name__]}")
    if name is None:
        raise NotImplementedError(
            f"{op}: block must be one of transformers' {sorted(SUPPORTED_BLOCKS)}; got "
            f"{type(block).__module__}.{type(block).__name__}")
    known = {"gate", "experts"} | ({"shared_experts"} if name == "DeepseekV3MoE" else set())
    if set(block._modules) != known or block._parameters or block._buffers:
        raise NotImplementedError(
            f"{op}: {name} holds {sorted(block._modules)} (and {len(block._parameters)} parameter(s) / "
            f"{len(block._buffers)} buffer(s) of its own); this layer knows transformers 5.24's {sorted(known)}, "
            f"nothing else")
    gate, experts = block.gate, block.experts
    E, H, I = experts.num_experts, experts.hidden_dim, experts.intermediate_dim
    _shape(op, name, "experts.gate_up_proj [E, 2*I, H]", experts.gate_up_proj, (E, 2 * I, H))
    _shape(op, name, "experts.down_proj [E, H, I]", experts.down_proj, (E, H, I))
    _shape(op, name, "gate.weight [E, H]", gate.weight, (E, H))
    act = _activation(op, name, "experts.act_fn", experts.act_fn)
    fields = dict(hidden_size=H, intermediate_size=I, num_experts=E, topk=gate.top_k, activation=act)
    shared, n_shared, jitter = None, 0, 0.0
    if name == "MixtralSparseMoeBlock":
        cfg = MoEConfig(**fields, routing="softmax_topk", renormalize=True)  # its router always divides by the sum
        jitter = float(block.jitter_noise)
    elif name == "Qwen3MoeSparseMoeBlock":
        cfg = MoEConfig(**fields, routing="softmax_topk", renormalize=bool(gate.norm_topk_prob))
    else:  # DeepseekV3MoE: rsf folded into the gate's weights, as transformers' router does
        _shape(op, name, "gate.e_score_correction_bias [E]", gate.e_score_correction_bias, (E,))
        cfg = MoEConfig(**fields, routing="biased_grouped_topk", renormalize=bool(gate.norm_topk_prob),
                        num_expert_group=gate.num_group, topk_group=gate.topk_group,
                        routed_scaling_factor=float(gate.routed_scaling_factor),
                        apply_routed_scaling_factor_on_output=True)
        shared = block.shared_experts
        i_shared = shared.gate_proj.weight.shape[0]
        if i_shared % I:
            raise ValueError(f"{op}: {name}: shared_experts' intermediate size (={i_shared}) must be a multiple of "
                             f"the experts' (I={I})")
        n_shared = i_shared // I
        _shape(op, name, "shared_experts.up_proj.weight", shared.up_proj.weight, (i_shared, H))
        _shape(op, name, "shared_experts.down_proj.weight", shared.down_proj.weight, (H, i_shared))
        if any(getattr(shared, p).bias is not None for p in ("gate_proj", "up_proj", "down_proj")):
            raise NotImplementedError(f"{op}: {name}: shared_experts with biases are not supported")
        if _activation(op, name, "shared_experts.act_fn", shared.act_fn) != act:
            raise NotImplementedError(f"{op}: {name}: shared_experts' activation differs from the experts'")
    return _Block(name, cfg, gate, experts.gate_up_proj, experts.down_proj, shared, n_shared, jitter)


def _quant(op: str, quant: str | None) -> str:
    quant = "none" if quant is None else quant
    check_choice(op, "quant", quant, QUANTS)
    return quant


def block_layer_weights(block: torch.nn.Module, *, quant: str | None = None, op: str = "block_layer_weights",
                        **config_overrides):
    """One block as the layer's float inputs: ``(config, w13 [E + S, 2*I, H], w2 [E + S, H, I],
    e_score_correction_bias [E] or None)``, DeepSeek-V3's shared MLP as ``S = n_shared_experts``
    fused shared experts (rows / columns ``j*I:(j+1)*I`` of its projections). Used by
    :meth:`moe_torch.EPMoE.from_hf_block`.

    Raises: as :func:`read_block`; TypeError for an override that is not a :class:`MoEConfig` field;
      ValueError for a routing field among the overrides (those come from the block).
    """
    b = read_block(block, op)
    MoEConfig.check_field_names(op, config_overrides)
    routing_fields = set(b.config.gate_kwargs()) - {"apply_routed_scaling_factor_on_output"}
    from_block = routing_fields | {"hidden_size", "intermediate_size", "num_experts", "activation", "quant",
                                   "num_fused_shared_experts"}
    fixed = sorted(from_block & set(config_overrides))
    if fixed:
        raise ValueError(f"{op}: {fixed} come from the block ({b.name}); overrides may set ep_size, ep_rank, "
                         f"apply_routed_scaling_factor_on_output; got {sorted(config_overrides)}")
    config = b.config.replace(quant=_quant(op, quant), num_fused_shared_experts=b.num_shared_experts,
                              **config_overrides)
    w13, w2 = b.gate_up_proj.detach(), b.down_proj.detach()
    bias = None
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
    return config, w13, w2, bias


class HFExperts(torch.nn.Module):
    """The expert weights of an :class:`HFMoEBlock` under transformers' names (no forward of its own).

    ``gate_up_proj [E, 2*I, H]`` and ``down_proj [E, H, I]``: for ``quant='none'`` the transformers
    block's own ``Parameter`` objects (its dtype, its ``requires_grad``: trainable as in transformers); for
    FP8 float8_e4m3fn codes with float32 ``gate_up_proj_scale_inv`` / ``down_proj_scale_inv``
    (dequantization multipliers, ``w ~= q * scale``): frozen buffers (never in ``parameters()``, so no
    optimizer touches them), kept in their dtype under ``.to(dtype)`` / ``.half()``
    (:func:`moe_torch.module.keep_dtypes_fn`).
    """

    def __init__(self, gate_up_proj, down_proj, gate_up_proj_scale_inv=None, down_proj_scale_inv=None) -> None:
        super().__init__()
        self.num_experts, two_i, self.hidden_dim = gate_up_proj.shape
        self.intermediate_dim = two_i // 2
        tensors = dict(gate_up_proj=gate_up_proj, down_proj=down_proj, gate_up_proj_scale_inv=gate_up_proj_scale_inv,
                       down_proj_scale_inv=down_proj_scale_inv)
        for name, t in tensors.items():  # a Parameter as it is (transformers' own), anything else a frozen buffer
            if isinstance(t, torch.nn.Parameter):
                self.register_parameter(name, t)
            else:
                self.register_buffer(name, None if t is None else t.detach())

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
                f"dtype={dtype_name(self.gate_up_proj)}")


class HFMoEBlock(torch.nn.Module):
    """A transformers sparse-MoE block computed by :func:`moe_torch.moe_forward`:
    ``forward(hidden_states [B, S, H]) -> [B, S, H]`` in ``hidden_states.dtype``, as the block it
    replaces (module docstring: what is kept, and the names).

    Attributes: ``gate`` (transformers' router module), ``experts`` (:class:`HFExperts`),
    ``shared_experts`` (DeepSeek-V3's MLP, else absent), ``moe_config`` (:class:`MoEConfig` of the
    routed experts), ``implementation`` and ``recompute`` (settable), ``replaces`` (the class name it
    replaced).

    Gradients: every backend (the Triton kernels included) is differentiable through
    :func:`moe_torch.moe_forward`'s backward (CONTRACT.md section 8): ``hidden_states``, the router's
    weight (through ``router_logits``), float experts, DeepSeek-V3's shared MLP (plain torch) equal
    transformers' block's gradients (``tests/test_hf_grad_parity.py``). FP8 experts are frozen and
    straight-through (gradients reach ``hidden_states`` and the router).
    """

    def __init__(self, block: torch.nn.Module, *, implementation: str | None = None,
                 quant: str | None = None, recompute: bool = False) -> None:
        """``block``: a supported transformers block; ``implementation``, ``quant``, ``recompute``: as
        :func:`patch_hf_model`.

        Raises: as :func:`read_block`; ValueError (bad ``implementation`` / ``quant``), TypeError
          (``recompute`` not a bool)."""
        super().__init__()
        op = "HFMoEBlock"
        quant = _quant(op, quant)
        check_implementation(op, implementation, LAYER_IMPLEMENTATIONS)
        check_bool(op, "recompute", recompute)
        b = read_block(block, op)
        self.replaces = b.name
        self.moe_config = b.config.replace(quant=quant)
        self.implementation = implementation
        self.recompute = recompute
        self.jitter_noise = b.jitter_noise
        if quant == "none":
            experts = HFExperts(b.gate_up_proj, b.down_proj)
        else:
            q13, s13 = quantize_chunked(b.gate_up_proj.detach(), self.moe_config)
            q2, s2 = quantize_chunked(b.down_proj.detach(), self.moe_config)
            experts = HFExperts(q13, q2, s13, s2)
        children = dict(gate=b.gate, experts=experts, shared_experts=b.shared_experts)
        for name in block._modules:  # the block's order: state_dict() lists the keys as transformers does
            self.add_module(name, children[name])
        self.train(block.training)  # a new module is in training mode; the model may be in eval mode

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        require_torch_tensors("HFMoEBlock", dict(hidden_states=hidden_states))
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # MixtralSparseMoeBlock's training-time jitter, drawn as it does
            j = self.jitter_noise
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - j, 1.0 + j)
        x = hidden_states.reshape(-1, shape[-1])
        router_logits = self.gate(x)[0]  # through the router module: its hook records router_logits
        ex = self.experts
        bias = self.gate.e_score_correction_bias if self.moe_config.routing == "biased_grouped_topk" else None
        out = moe_forward(x, router_logits, ex.gate_up_proj, ex.down_proj, self.moe_config,
                          w13_scale=ex.gate_up_proj_scale_inv, w2_scale=ex.down_proj_scale_inv,
                          e_score_correction_bias=bias, implementation=self.implementation, recompute=self.recompute)
        out = out.reshape(shape)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(hidden_states)
        return out

    def extra_repr(self) -> str:
        c = self.moe_config
        return (f"replaces={self.replaces}, E={c.num_experts}, topk={c.topk}, routing={c.routing!r}, "
                f"renormalize={c.renormalize}, quant={c.quant!r}, implementation={self.implementation!r}, "
                f"recompute={self.recompute}")


def _refuse_save_pretrained(model_class: str, quant: str, *args, **kwargs):
    raise NotImplementedError(
        f"save_pretrained: this {model_class} holds FP8 experts (moe_torch.patch_hf_model(quant={quant!r})); "
        f"transformers' {model_class} would load the FP8 codes as float weights without their scales. Save the "
        f"float model (before patching, or patched with quant=None) and patch again after loading; "
        f"torch.save(model.state_dict()) loads back into a model patched the same way")


def patch_hf_model(model: torch.nn.Module, implementation: str | None = None,
                   quant: str | None = None, *, recompute: bool = False) -> torch.nn.Module:
    """Replace every supported sparse-MoE block of a transformers model by an :class:`HFMoEBlock`, in place.

    Args:
      model: a transformers model (``MixtralForCausalLM``, ``Qwen3MoeModel``... any ``nn.Module``
        holding :data:`SUPPORTED_BLOCKS`).
      implementation: the layer's backend, as :func:`moe_torch.moe_forward` takes it (``None``: the
        reference on a CPU, the fastest backend on CUDA; ``"reference"``; ``"triton"``).
      quant: ``None`` / ``"none"`` (the float weights themselves, no copy), ``"fp8_per_token"`` or
        ``"fp8_block"`` (the routed experts quantized, module docstring; ``fp8_block`` needs H and I
        multiples of 128).
      recompute: the layer's ``recompute`` (:func:`moe_torch.moe_forward`): ``True`` keeps only the
        routing for the backward and recomputes GEMM 1 there.

    The patched model trains like the original (every backend has a backward; FP8 experts are frozen
    buffers, straight-through): its parameters' gradients equal transformers' (float32 within 1e-5,
    ``tests/test_hf_grad_parity.py``).

    Returns: ``model`` (patched in place). Its logits equal the unpatched model's to the contract
    (float32: a few ulps of summation order; bf16: CONTRACT.md section 7), ``state_dict()`` keeps
    transformers' names, and ``save_pretrained`` of a float-patched model loads into the unpatched
    class; with FP8, ``model.save_pretrained`` raises ``NotImplementedError`` (module docstring).

    Raises: TypeError (``model`` not an ``nn.Module``; ``recompute`` not a bool), ValueError (bad
      ``implementation`` / ``quant``; no MoE block found, naming the model class; already patched),
      NotImplementedError (a MoE block class that is not supported, naming it; an unsupported
      activation). The model is unchanged when it raises.
    """
    op = "patch_hf_model"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{op}: model must be a torch.nn.Module (a transformers model); got {type(model).__name__}")
    quant = _quant(op, quant)
    check_implementation(op, implementation, LAYER_IMPLEMENTATIONS)
    check_bool(op, "recompute", recompute)
    targets, unsupported, patched, inside = [], [], [], []
    for path, module in model.named_modules():  # pre-order: a block comes before its submodules
        if any(path.startswith(p + ".") for p in inside):
            continue
        if isinstance(module, HFMoEBlock):
            patched.append(path)
        elif supported_block_name(module) is not None:
            targets.append((path, module))
        elif (all(isinstance(getattr(module, a, None), torch.nn.Module) for a in ("gate", "experts"))
              or type(module).__name__ in UNSERVED_BLOCKS):  # Llama 4's and gpt-oss's hold `router`, not `gate`
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
                                               recompute=recompute))
    if quant != "none" and hasattr(model, "save_pretrained"):
        model.save_pretrained = functools.partial(_refuse_save_pretrained, model_class, quant)
    log.info("%s: %d %s block(s) of %s served by moe_torch (implementation=%r, quant=%r)", op, len(paths), names,
             model_class, implementation, quant)
    return model
