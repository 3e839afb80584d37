"""transformers' ``ExpertsInterface`` served by the layer: ``experts_implementation="epmoe"``.

transformers 5.x runs the experts of its MoE models through ``ExpertsInterface``
(``huggingface/transformers@v5.24.0:src/transformers/integrations/moe.py``): an experts class decorated with
``@use_experts_implementation`` looks up ``config._experts_implementation`` on every call and runs the function
registered under that name as ``fn(experts, hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``, the
routing already computed by the model's own router. :func:`register_transformers` registers:

======================  ==========================================================================================
name                    backend of every stage (:func:`moe_torch.moe_forward`'s ``implementation``)
======================  ==========================================================================================
``"epmoe"``             each stage's default: Triton on CUDA tensors, the torch reference on the CPU
``"epmoe_triton"``      ``"triton"`` (on the CPU: Triton's interpreter, under ``TRITON_INTERPRET=1``)
``"epmoe_reference"``   ``"reference"``
======================  ==========================================================================================

so ``from_pretrained(..., experts_implementation="epmoe")``, ``from_config(config,
experts_implementation="epmoe")`` and ``model.set_experts_implementation("epmoe")`` run the routed experts of
every decorated class through :func:`moe_torch.layer.routed_experts` (forward and backward). Each call is
:func:`experts_forward`. The model's router, shared experts and everything else stay transformers'
(:func:`moe_torch.patch_hf_model` replaces whole blocks, router included, for the blocks it knows).

What an experts module must be (read on every call by :func:`read_experts`; anything else raises
``NotImplementedError`` naming the class and what is not served, never a wrong answer):

- gated (``has_gate``): ``gate_up_proj [E, 2*I, H]`` and ``down_proj [E, H, I]`` (``is_transposed``: in-by-out
  ``[E, H, 2*I]`` / ``[E, I, H]``, read through transposed views), of float32 / bf16 / float16, plain tensors;
  ``has_bias``: ``gate_up_proj_bias [E, 2*I]`` / ``down_proj_bias [E, H]`` (the layer's ``w13_bias`` / ``w2_bias``);
  no ``post_expert_norm``. Non-gated experts (``has_gate=False``: NemotronH's ``up_proj``) are refused.
- its gate, ``_apply_gate``: transformers' default (``act_fn(gate) * up`` on the halves of ``gate_up_proj``'s
  output) with ``act_fn`` SiLU (``"silu"``, ``"swish"``, ``F.silu``) or tanh-GELU (``"gelu_pytorch_tanh"``,
  ``"gelu_new"``); or one of :data:`KNOWN_GATES` (gpt-oss's interleaved ``swiglu_oai``, the concatenated
  ``swiglu_oai`` of OpenAI-Privacy-Filter and MiniMax-M3-VL with alpha 1.702 / limit 7, Beam's float32 SiLU). Any
  other ``_apply_gate`` (DeepSeek-V4's / HY-V4's / GLM-5-Next's clamped SiLU, Inkling2's two-argument activation)
  is refused.
- transformers' ``FP8Experts`` (``integrations/finegrained_fp8.py``, registered in its ``FP8ExpertsInterface`` too):
  float8_e4m3fn codes with float32 ``*_scale_inv`` 128x128 block multipliers, ``activation_scheme="dynamic"``:
  the layer's ``quant="fp8_block"`` (1x128 activation groups, CONTRACT.md section 3), ``H`` and ``I`` multiples of
  128. Static activation scales, UE8M0 scales, FP4-packed experts, other block sizes and a soft-capped or clamped
  gate are refused. FP8 codes are frozen; gradients reach ``hidden_states`` and the routing weights
  (straight-through, as the layer's FP8 backward).

Numerics, as transformers' ``grouped_mm_experts_forward`` does them: ``hidden_states`` are cast to the expert
weights' dtype for the GEMMs (FP8: kept), the gate is computed in float32 and rounded once (CONTRACT.md section 4;
transformers' default gate rounds ``act_fn(gate)`` and the product separately in bf16), the routing weights enter in float32 (an exact cast of bf16 / float16
weights), each token's ``sum_j w[t, j] * y[t, j]`` is accumulated in float32 and cast once to
``hidden_states.dtype`` (grouped_mm does the same when the weights are float32; with bf16 weights it rounds each
product to bf16 first). Expert parallelism (``experts._is_expert_parallel``, transformers' ``MoEParamShard``):
ids ``>= num_experts`` are the other ranks' sentinels; their slots add nothing and get no gradient.

transformers is not imported by ``import moe_torch``: :func:`register_transformers` imports it (importing
transformers takes many times longer than ``import moe_torch``), so the registration is explicit.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from moe_contract.config import MoEConfig
from moe_contract.validation import check_weight_scale, dtype_name
from moe_torch.hf import _ACTIVATIONS, _SWIGLU_OAI
from moe_torch.layer import LAYER_IMPLEMENTATIONS, routed_experts
from moe_torch.ops.dispatch import check_implementation

#: The names registered in transformers' ``ExpertsInterface`` -> the layer's ``implementation``.
EXPERTS_IMPLEMENTATIONS = {"epmoe": None, "epmoe_triton": "triton", "epmoe_reference": "reference"}

_MOE = "transformers.integrations.moe"
_FP8 = "transformers.integrations.finegrained_fp8"

#: ``_apply_gate`` functions other than transformers' default that compute one of the layer's activations:
#: ``module.qualname`` -> ``(activation, gate_up_layout, alpha attribute, limit attribute)``; an activation of
#: ``None`` means ``act_fn`` (read as for the default gate). The swiglu_oai gates are served with alpha 1.702 and
#: limit 7 only (the layer's constants).
KNOWN_GATES = {
    "transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts._apply_gate":
        ("swiglu_oai", "interleaved", "alpha", "limit"),
    "transformers.models.openai_privacy_filter.modeling_openai_privacy_filter.OpenAIPrivacyFilterExperts._apply_gate":
        ("swiglu_oai", "concatenated", "alpha", "limit"),
    "transformers.models.minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLExperts._apply_gate":
        ("swiglu_oai", "concatenated", "swiglu_alpha", "swiglu_limit"),
    # act_fn(gate.float()) * up.float(), rounded once: the layer's act_and_mul computes in float32 too
    "transformers.models.beam.modeling_beam.BeamExperts._apply_gate": (None, "concatenated", None, None),
}

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class ExpertsWeights:
    """One transformers experts module as the layer's inputs (:func:`read_experts`)."""

    num_experts: int  # E (this rank's under expert parallelism)
    hidden_size: int  # H
    intermediate_size: int  # I
    activation: str  # the layer's: silu, gelu_tanh, swiglu_oai
    gate_up_layout: str  # concatenated, interleaved
    quant: str  # none, fp8_block
    w13: torch.Tensor  # [E, 2I, H] (a transposed view of in-by-out experts)
    w2: torch.Tensor  # [E, H, I]
    w13_scale: torch.Tensor | None = None  # fp8_block: [E, 2I/128, H/128] float32
    w2_scale: torch.Tensor | None = None  # fp8_block: [E, H/128, I/128] float32
    w13_bias: torch.Tensor | None = None  # [E, 2I]
    w2_bias: torch.Tensor | None = None  # [E, H]


def _where(experts) -> str:
    cls = type(experts)
    model_type = getattr(getattr(experts, "config", None), "model_type", None)  # the experts get the (text) config
    return f"{cls.__module__}.{cls.__qualname__}" + (f", model_type={model_type!r}" if model_type else "")


def _refuse(op: str, experts, what: str):
    raise NotImplementedError(f"{op}: {type(experts).__name__} ({_where(experts)}) is not served: {what}. Use "
                              f"another experts_implementation for this model (e.g. 'grouped_mm' or 'eager')")


@functools.lru_cache(maxsize=256)
def _layer_config(H: int, I: int, E: int, topk: int, activation: str, layout: str, expert_bias: bool,
                  quant: str) -> MoEConfig:
    # one validated config per layer shape, not one per call (decode runs every layer once per token)
    return MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, topk=topk, activation=activation,
                     gate_up_layout=layout, expert_bias=expert_bias, quant=quant)


def _act_name(act_fn) -> str | None:
    if act_fn is torch.nn.functional.silu:  # Lfm2MoeExperts: the function itself
        return "silu"
    return _ACTIVATIONS.get(type(act_fn).__name__) if isinstance(act_fn, torch.nn.Module) else None


def _act_fn_activation(op: str, experts) -> str:
    act_fn = getattr(experts, "act_fn", None)
    act = _act_name(act_fn)
    if act is None:
        what = type(act_fn).__name__ if isinstance(act_fn, torch.nn.Module) else repr(act_fn)
        _refuse(op, experts, f"its act_fn is {what}; the layer computes SiLU and tanh-GELU "
                             f"(transformers classes {sorted(_ACTIVATIONS)}, or torch.nn.functional.silu)")
    return act


def _gate_function(experts):
    """The ``_apply_gate`` function of ``experts``' class (its ``module.qualname``)."""
    fn = getattr(type(experts), "_apply_gate", None)
    return fn, (f"{fn.__module__}.{fn.__qualname__}" if fn is not None else "<none>")


def _swiglu_oai(op: str, experts, alpha_attr: str, limit_attr: str) -> None:
    got = (getattr(experts, alpha_attr, None), getattr(experts, limit_attr, None))
    if None in got or (float(got[0]), float(got[1])) != _SWIGLU_OAI:
        _refuse(op, experts, f"its swiglu_oai gate has ({alpha_attr}, {limit_attr}) = {got}; the layer's swiglu_oai "
                             f"computes alpha, limit = {_SWIGLU_OAI}")


def _gate(op: str, experts) -> tuple[str, str]:
    """``(activation, gate_up_layout)`` of ``experts``' ``_apply_gate``."""
    fn, name = _gate_function(experts)
    if name == f"{_MOE}._default_apply_gate":  # gate, up = chunk(2); act_fn(gate) * up
        return _act_fn_activation(op, experts), "concatenated"
    if name == f"{_FP8}.FP8Experts._apply_gate":
        if getattr(experts, "gate_softcap", None) is not None:
            _refuse(op, experts, f"its gate is soft-capped (mlp_gate_softcap={experts.gate_softcap})")
        if getattr(experts, "swiglu_alpha", None) is not None:
            _swiglu_oai(op, experts, "swiglu_alpha", "swiglu_limit")
            return "swiglu_oai", "concatenated"
        if getattr(experts, "limit", None) is not None:
            _refuse(op, experts, f"its gate clamps gate and up to limit={experts.limit} (swiglu_limit) before "
                                 f"act_fn; the layer has no clamped SiLU")
        return _act_fn_activation(op, experts), "concatenated"
    known = KNOWN_GATES.get(name)
    if known is None:
        _refuse(op, experts, f"its gate {name} is a function of its own; the layer computes act_fn(gate) * up with "
                             f"SiLU / tanh-GELU (transformers' default gate) and the gates of "
                             f"moe_torch.hf_experts.KNOWN_GATES")
    act, layout, alpha_attr, limit_attr = known
    if act is None:
        return _act_fn_activation(op, experts), layout
    _swiglu_oai(op, experts, alpha_attr, limit_attr)
    return act, layout


def _plain(op: str, experts, name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {type(experts).__name__}.{name} must be a tensor; got {type(t).__name__}")
    if type(t) not in (torch.Tensor, torch.nn.Parameter):  # DTensor, quantized tensor subclasses
        _refuse(op, experts, f"{name} is a {type(t).__module__}.{type(t).__name__}, not a plain tensor")
    return t


def read_experts(experts: torch.nn.Module, op: str = "read_experts") -> ExpertsWeights:
    """The layer's view of one transformers experts module (module docstring: what is served).

    Args:
      experts: an instance of a class decorated with transformers' ``@use_experts_implementation`` (it sets
        ``has_gate``, ``has_bias``, ``is_transposed``, ``has_post_expert_norm``), or transformers' ``FP8Experts``.

    Returns: :class:`ExpertsWeights`, whose tensors are the module's own (views for the in-by-out layout, no copy).

    Raises: NotImplementedError naming the class and what is not served (no gate, a post-expert norm, an
      activation or gate function the layer does not compute, weights that are not float or FP8 block codes or not
      plain tensors); ValueError (weight shapes that disagree with each other or with ``num_experts``); TypeError
      (``experts`` not an ``nn.Module``).
    """
    if not isinstance(experts, torch.nn.Module):
        raise TypeError(f"{op}: experts must be a transformers experts nn.Module; got {type(experts).__name__}")
    name = type(experts).__name__
    if not hasattr(experts, "has_gate"):
        _refuse(op, experts, "it is not an experts class of transformers' @use_experts_implementation (no has_gate; "
                             "e.g. Llama4TextExperts, whose block moe_torch.patch_hf_model serves)")
    if not experts.has_gate:
        _refuse(op, experts, "its experts are not gated (has_gate=False: act_fn(x @ up_proj) @ down_proj); the layer's "
                             "activations are gated (act(gate) * up)")
    if getattr(experts, "has_post_expert_norm", False):
        _refuse(op, experts, "it normalizes each expert's output (has_post_expert_norm=True, post_expert_norm)")
    activation, layout = _gate(op, experts)
    w13 = _plain(op, experts, "gate_up_proj", getattr(experts, "gate_up_proj", None))
    w2 = _plain(op, experts, "down_proj", getattr(experts, "down_proj", None))
    transposed = bool(getattr(experts, "is_transposed", False))
    if w13.ndim != 3 or w2.ndim != 3:
        raise ValueError(f"{op}: {name}: gate_up_proj and down_proj must be 3-D; got {tuple(w13.shape)} and "
                         f"{tuple(w2.shape)}")
    if transposed:  # in-by-out, for x @ w: [E, H, 2I] / [E, I, H]
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    E, two_i, H = w13.shape
    I = two_i // 2
    layout_words = "[E, H, 2*I] / [E, I, H] (is_transposed)" if transposed else "[E, 2*I, H] / [E, H, I]"
    num_experts = getattr(experts, "num_experts", E)
    if two_i % 2 or tuple(w2.shape) != (E, H, I) or E != num_experts:
        raise ValueError(f"{op}: {name}: gate_up_proj / down_proj must be {layout_words} with E = num_experts "
                         f"(={num_experts}); got {tuple(experts.gate_up_proj.shape)} and "
                         f"{tuple(experts.down_proj.shape)}")
    b13 = b2 = None
    if getattr(experts, "has_bias", False):
        b13 = _plain(op, experts, "gate_up_proj_bias", getattr(experts, "gate_up_proj_bias", None))
        b2 = _plain(op, experts, "down_proj_bias", getattr(experts, "down_proj_bias", None))
        if tuple(b13.shape) != (E, 2 * I) or tuple(b2.shape) != (E, H):
            raise ValueError(f"{op}: {name}: gate_up_proj_bias / down_proj_bias must be [E, 2*I] = ({E}, {2 * I}) / "
                             f"[E, H] = ({E}, {H}); got {tuple(b13.shape)} and {tuple(b2.shape)}")
    fields = dict(num_experts=E, hidden_size=H, intermediate_size=I, activation=activation, gate_up_layout=layout,
                  w13=w13, w2=w2, w13_bias=b13, w2_bias=b2)
    if w13.dtype in _FLOAT and w2.dtype == w13.dtype:  # FP8Experts holding float weights computes F.linear too
        return ExpertsWeights(quant="none", **fields)
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        what = f"FP4-packed {dtype_name(w13)} codes (expert_dtype='fp4')" if w13.dtype == torch.int8 else "not served"
        _refuse(op, experts, f"its weights are gate_up_proj {dtype_name(w13)} / down_proj {dtype_name(w2)} ({what}); "
                             f"the layer takes float32 / bf16 / float16 weights or float8_e4m3fn codes with 128x128 "
                             f"block scales")
    s13 = _plain(op, experts, "gate_up_proj_scale_inv", getattr(experts, "gate_up_proj_scale_inv", None))
    s2 = _plain(op, experts, "down_proj_scale_inv", getattr(experts, "down_proj_scale_inv", None))
    block = getattr(experts, "block_size", None)
    if block is None or tuple(block) != (128, 128):
        _refuse(op, experts, f"its FP8 block_size is {block}; the layer's fp8_block scales are 128x128 blocks")
    if getattr(experts, "activation_scheme", "dynamic") != "dynamic":
        _refuse(op, experts, f"activation_scheme={experts.activation_scheme!r}; the layer quantizes activations "
                             f"dynamically (1x128 groups)")
    if s13.dtype != torch.float32 or s2.dtype != torch.float32:
        _refuse(op, experts, f"its weight scales are {dtype_name(s13)} (scale_fmt='ue8m0'?); the layer's are float32")
    if H % 128 or I % 128:
        _refuse(op, experts, f"H={H} and I={I} must be multiples of 128 for the layer's fp8_block")
    check_weight_scale(op, f"{name}.gate_up_proj_scale_inv", s13, tuple(w13.shape))
    check_weight_scale(op, f"{name}.down_proj_scale_inv", s2, tuple(w2.shape))
    return ExpertsWeights(quant="fp8_block", w13_scale=s13, w2_scale=s2, **fields)


def experts_forward(experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, *, implementation: str | None = None,
                    recompute: bool = False) -> torch.Tensor:
    """One call of a transformers experts module, computed by :func:`moe_torch.layer.routed_experts`: what the
    ``"epmoe"`` names of :func:`register_transformers` run (the signature of
    ``huggingface/transformers@v5.24.0:src/transformers/integrations/moe.py``'s ``grouped_mm_experts_forward``).

    Args:
      experts: the experts module (:func:`read_experts`: what is served).
      hidden_states: ``[T, H]`` float32 / bf16 / float16 (cast to the expert weights' dtype for the GEMMs, as
        grouped_mm does).
      top_k_index: ``[T, k]`` int64 / int32, ids in ``[0, num_experts)``; under expert parallelism
        (``experts._is_expert_parallel``) ids ``>= num_experts`` are other ranks' slots and add nothing.
      top_k_weights: ``[T, k]`` float (the router's; any float dtype, taken in float32).
      implementation: the layer's ``implementation`` (``None``, ``"reference"``, ``"triton"``).
      recompute: the layer's ``recompute`` (:func:`moe_torch.moe_forward`).

    Returns: ``[T, H]`` in ``hidden_states.dtype``: ``sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(x[t])``.
      Differentiable in ``hidden_states``, ``top_k_weights``, float expert weights and biases (FP8 codes frozen).

    Raises: as :func:`read_experts` (NotImplementedError names the class and what is not served); TypeError /
      ValueError naming the argument for inputs of another rank, shape, dtype or device; ValueError for a bad
      ``implementation``.
    """
    op = f"experts_forward ({type(experts).__name__})"
    check_implementation(op, implementation, LAYER_IMPLEMENTATIONS)
    ew = read_experts(experts, op)
    E, H = ew.num_experts, ew.hidden_size
    for name, t in (("hidden_states", hidden_states), ("top_k_index", top_k_index), ("top_k_weights", top_k_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor; got {type(t).__name__}")
    if hidden_states.ndim != 2 or hidden_states.shape[1] != H:
        raise ValueError(f"{op}: hidden_states must be [T, H] with H={H}; got {tuple(hidden_states.shape)}")
    if hidden_states.dtype not in _FLOAT:
        raise TypeError(f"{op}: hidden_states must be float32 / bfloat16 / float16; got {dtype_name(hidden_states)}")
    T = hidden_states.shape[0]
    if top_k_index.ndim != 2 or top_k_index.shape[0] != T or top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"{op}: top_k_index and top_k_weights must be [T, k] with T={T}; got "
                         f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}")
    if top_k_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: top_k_index must be int32 / int64; got {dtype_name(top_k_index)}")
    if not top_k_weights.is_floating_point():
        raise TypeError(f"{op}: top_k_weights must be a float tensor; got {dtype_name(top_k_weights)}")
    devices = {t.device for t in (hidden_states, top_k_index, top_k_weights, ew.w13, ew.w2)}
    if len(devices) > 1:
        raise ValueError(f"{op}: hidden_states, top_k_index, top_k_weights and the expert weights must be on one "
                         f"device; got {sorted(str(d) for d in devices)}")
    k = top_k_index.shape[1]
    # routed_experts reads the slots from top_k_index; config.topk only has to be valid (under EP a rank may hold
    # fewer experts than k)
    config = _layer_config(H, ew.intermediate_size, E, max(1, min(k, E)), ew.activation, ew.gate_up_layout,
                           ew.w13_bias is not None, ew.quant)
    x = hidden_states if ew.quant != "none" else hidden_states.to(ew.w13.dtype)
    # EP sentinels (id == num_experts) stay inside the id space, as non-local slots
    num_ids = E + 1 if getattr(experts, "_is_expert_parallel", False) else E
    return routed_experts(x, top_k_weights.float(), top_k_index, ew.w13, ew.w2, config, w13_scale=ew.w13_scale,
                          w2_scale=ew.w2_scale, implementation=implementation, num_experts=num_ids, expert_start=0,
                          num_local_experts=E, routed_scaling_factor=1.0, out_dtype=hidden_states.dtype,
                          recompute=recompute, w13_bias=ew.w13_bias, w2_bias=ew.w2_bias)


def _interface_function(name: str, implementation: str | None):
    def fn(self, hidden_states, top_k_index, top_k_weights):
        return experts_forward(self, hidden_states, top_k_index, top_k_weights, implementation=implementation)

    fn.__name__ = fn.__qualname__ = f"{name}_experts_forward"
    fn.__doc__ = (f"transformers' experts_implementation={name!r}: :func:`experts_forward` with "
                  f"implementation={implementation!r}.")
    return fn


#: The functions registered, one per name of :data:`EXPERTS_IMPLEMENTATIONS` (the same objects every time).
INTERFACE_FUNCTIONS = {name: _interface_function(name, impl) for name, impl in EXPERTS_IMPLEMENTATIONS.items()}


def register_transformers() -> tuple[str, ...]:
    """Register :data:`EXPERTS_IMPLEMENTATIONS` (``"epmoe"``, ``"epmoe_triton"``, ``"epmoe_reference"``) in
    transformers' ``ExpertsInterface`` and its ``FP8ExpertsInterface`` (the one ``FP8Experts`` dispatches through),
    library-wide: afterwards ``from_pretrained(..., experts_implementation="epmoe")``, ``from_config`` and
    ``model.set_experts_implementation("epmoe")`` accept the names. Idempotent (the same function objects each time).

    Imports transformers (``transformers.integrations.moe``: several seconds on a cold start, which is why
    ``import moe_torch`` does not call this).

    Returns: the names registered.

    Raises: ImportError if transformers is not installed or has no ``ExpertsInterface`` (transformers < 5).
    """
    try:
        from transformers.integrations import moe
    except ImportError as exc:
        raise ImportError(f"register_transformers: transformers with ExpertsInterface (transformers >= 5, "
                          f"transformers/integrations/moe.py) is needed; {exc}") from exc
    interfaces = [getattr(moe, "ExpertsInterface", None)]
    if interfaces[0] is None:
        import transformers

        raise ImportError(f"register_transformers: transformers {transformers.__version__} has no "
                          f"transformers.integrations.moe.ExpertsInterface (transformers >= 5 has)")
    try:  # FP8Experts dispatches through its own interface; without it, "epmoe" would be a KeyError there
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface

        interfaces.append(FP8ExpertsInterface)
    except ImportError:
        pass
    for interface in interfaces:
        for name, fn in INTERFACE_FUNCTIONS.items():
            interface.register(name, fn)
    return tuple(INTERFACE_FUNCTIONS)
