"""The MoE layer as two PyTorch custom ops, for ``torch.compile``, ``torch.func`` and autocast.

:func:`moe_torch.moe_forward` runs through :func:`moe_layer`: an ``autograd.Function``
(:class:`MoELayerFunction`, with ``setup_context``, as ``torch.func`` requires) whose forward is the
custom op ``epmoe::moe_layer`` and whose backward is the custom op ``epmoe::moe_layer_backward``
(``torch.library.custom_op``). Their bodies are the layer's own forward and backward
(``moe_torch.layer._MoELayerFunction``, handed over by :func:`register_layer_function`: this module does not
import the layer), so there is one implementation of each, whichever way autograd reaches it.

What that gives:

- ``torch.compile(fullgraph=True)``: Dynamo traces the argument checks (shapes and dtypes only, no tensor values)
  and the ``autograd.Function``, and stops at the two ops, which are opaque: the reference backends' host reads
  (``expert_offsets.tolist()``), the data-dependent ``bincount`` and the Triton launches stay inside them, so
  there is no graph break. Their fake implementations (``register_fake``) give every output's shape and dtype
  from the inputs and the config alone, for AOTAutograd and Inductor.
- ``torch.func.grad`` / ``vjp``: through ``setup_context``. ``vmap`` and forward-mode AD (``jvp``, ``jacfwd``)
  raise ``NotImplementedError`` naming them (no batching rule, no JVP).
- autocast: custom ops are not autocast ops, and the bodies run with autocast off (a reference matmul inside must
  not be lowered to bf16 behind the layer's back); the dtype policy is the caller's (``moe_torch.module.EPMoE`` and
  ``MoEBlock``: ``moe_torch.module.autocast_policy``).
- second-order gradients stay refused (CONTRACT.md section 8): plain ``create_graph=True`` and nested
  ``torch.func.grad`` raise ``RuntimeError`` naming ``moe_forward``; one level of ``torch.func.grad`` (which
  runs its backward with grad mode on) does not.

The config crosses the op boundary as a string and a list of floats (:func:`config_key`: custom ops take tensors,
numbers, strings and lists only); the ops rebuild it (:func:`config_from_key`, cached). Dynamo reads every field
on the way, so a config that differs recompiles. Its integers must be static: Dynamo makes them symbolic for a
config in a closure or an argument of the compiled function under ``dynamic=True``, or in an argument whose sizes
change between calls, and the layer's checks and ops do not take that (Dynamo stops with an error there). A
module's config (``EPMoE``) or a global one stays static, and so does any config under the default automatic
dynamic shapes while only the token count changes (``T`` goes symbolic).

Torch only (no mirror in ``moe_pallas``: ``jax.custom_vjp`` is already traceable by ``jit`` and the transforms).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools

import torch

from moe_contract.config import MoEConfig

#: The custom ops' namespace: ``torch.ops.epmoe.moe_layer`` / ``torch.ops.epmoe.moe_layer_backward``.
NAMESPACE = "epmoe"

#: ``moe_forward``'s differentiable inputs, as the layer's ``autograd.Function`` takes them (the first 10 of its
#: inputs, then ``config``, ``implementation``, ``recompute``); the routing and ``h`` follow them in its saved tensors.
INPUTS = ("x", "router_logits", "w13", "w2", "w13_scale", "w2_scale", "e_score_correction_bias",
          "shared_expert_gate_logits", "w13_bias", "w2_bias")
#: What the forward keeps besides the inputs (the order of the layer's ``save_for_backward``); ``h`` is empty
#: (``[0]``) with ``recompute=True``.
SAVED = ("topk_weights", "topk_ids", "expert_offsets", "src2dst", "dst2src", "h")
#: The gradients the backward op returns (the inputs that can have one), in this order; a gradient not asked
#: for is an empty ``[0]`` tensor.
GRADS = ("x", "router_logits", "w13", "w2", "shared_expert_gate_logits", "w13_bias", "w2_bias")
_GRAD_INDEX = tuple(INPUTS.index(name) for name in GRADS)

_LAYER_FUNCTION = []  # [the layer's autograd.Function class], set once by register_layer_function


def register_layer_function(function) -> None:
    """Hand over the layer's ``autograd.Function`` class whose ``forward(ctx, *inputs, config, implementation,
    recompute)`` and ``backward(ctx, d_out)`` are the ops' bodies (``moe_torch.layer`` calls this on import)."""
    _LAYER_FUNCTION[:] = [function]


def _layer_function():
    if not _LAYER_FUNCTION:  # moe_torch.layer registers it on import; the ops exist only through it
        raise RuntimeError("epmoe::moe_layer: the layer is not registered (import moe_torch.layer first)")
    return _LAYER_FUNCTION[0]


def config_key(config: MoEConfig) -> tuple[str, list[float]]:
    """``config`` as what the custom ops take: ``(key, floats)``, ``key`` the repr of its non-float ``(field,
    value)`` pairs and of its float fields' names, ``floats`` those fields' values (a float read under
    ``torch.compile(dynamic=True)`` may be symbolic, and has no repr then; as an op argument it is fine).
    Traceable by Dynamo, which then guards on each field (another config recompiles or reaches the op as it is)."""
    pairs = [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]
    floats = [value for _, value in pairs if isinstance(value, float)]
    names = tuple(name for name, value in pairs if isinstance(value, float))
    return repr((tuple(pair for pair in pairs if not isinstance(pair[1], float)), names)), floats


def config_from_key(key: str, floats) -> MoEConfig:
    """The :class:`MoEConfig` of :func:`config_key`'s ``(key, floats)``."""
    return _config_from_key(key, tuple(float(v) for v in floats))


@functools.lru_cache(maxsize=256)
def _config_from_key(key: str, floats: tuple[float, ...]) -> MoEConfig:
    pairs, names = ast.literal_eval(key)
    return MoEConfig(**dict(pairs), **dict(zip(names, floats)))


class _Context:
    """The part of an autograd context that the layer's forward and backward use, for running them as plain
    functions inside the ops (the ops are below autograd: no graph is recorded there)."""

    def __init__(self, config, implementation, recompute, saved=(), needs_input_grad=()):
        self.config, self.implementation, self.recompute = config, implementation, recompute
        self.saved_tensors, self.needs_input_grad = tuple(saved), tuple(needs_input_grad)

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):
        pass  # the ops are below autograd; MoELayerFunction marks its own outputs


@contextlib.contextmanager
def plain(device: torch.device):
    """No autograd and no autocast: the bodies compute exactly what they compute eagerly, in the dtypes given."""
    with torch.no_grad(), torch.autocast(device_type=device.type, enabled=False):
        yield


Tensor = torch.Tensor
_OptT = torch.Tensor | None


@torch.library.custom_op(f"{NAMESPACE}::moe_layer", mutates_args=())
def _moe_layer_op(x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, w13_scale: _OptT, w2_scale: _OptT,
                  e_score_correction_bias: _OptT, shared_expert_gate_logits: _OptT, w13_bias: _OptT, w2_bias: _OptT,
                  config: str, config_floats: list[float], implementation: str | None, recompute: bool,
                  out_dtype: torch.dtype | None = None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(out, topk_weights, topk_ids, expert_offsets, src2dst, dst2src, h)``: the layer's output (in ``out_dtype``,
    ``None``: ``x.dtype``) and what its backward reads (``h`` empty with ``recompute``)."""
    ctx = _Context(config_from_key(config, config_floats), implementation, recompute)
    inputs = (x, router_logits, w13, w2, w13_scale, w2_scale, e_score_correction_bias, shared_expert_gate_logits,
              w13_bias, w2_bias)
    with plain(x.device):
        out, _ = _layer_function().forward(ctx, *inputs, ctx.config, implementation, recompute,
                                           out_dtype)  # (out, topk_ids)
    saved = ctx.saved_tensors[len(INPUTS):]
    if len(saved) != len(SAVED):  # the layer's save_for_backward and SAVED must agree
        raise RuntimeError(f"epmoe::moe_layer: the layer saved {len(ctx.saved_tensors)} tensors; expected "
                           f"{len(INPUTS) + len(SAVED)} ({', '.join(INPUTS + SAVED)})")
    *routing, h = saved
    return (out, *routing, x.new_empty(0) if h is None else h)


@_moe_layer_op.register_fake
def _moe_layer_fake(x, router_logits, w13, w2, w13_scale, w2_scale, e_score_correction_bias,
                    shared_expert_gate_logits, w13_bias, w2_bias, config, config_floats, implementation, recompute,
                    out_dtype=None):
    cfg = config_from_key(config, config_floats)
    T, k = x.shape[0], cfg.num_slots
    _, e_local = cfg.local_expert_range()
    i32 = dict(dtype=torch.int32)
    return (x.new_empty(x.shape, dtype=out_dtype or x.dtype), x.new_empty((T, k), dtype=torch.float32),
            x.new_empty((T, k), **i32), x.new_empty((e_local + 1,), **i32), x.new_empty((T, k), **i32), x.new_empty((T * k,), **i32),
            x.new_empty((0,) if recompute else (T * k, 2 * cfg.intermediate_size)))


@torch.library.custom_op(f"{NAMESPACE}::moe_layer_backward", mutates_args=())
def _moe_layer_backward_op(d_out: Tensor, x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor,
                           w13_scale: _OptT, w2_scale: _OptT, e_score_correction_bias: _OptT,
                           shared_expert_gate_logits: _OptT, w13_bias: _OptT, w2_bias: _OptT, topk_weights: Tensor,
                           topk_ids: Tensor, expert_offsets: Tensor, src2dst: Tensor, dst2src: Tensor, h: Tensor,
                           config: str, config_floats: list[float], implementation: str | None, recompute: bool,
                           needs: list[bool]
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :data:`GRADS` (``needs``: one flag per name; empty ``[0]`` where not asked for)."""
    inputs = (x, router_logits, w13, w2, w13_scale, w2_scale, e_score_correction_bias, shared_expert_gate_logits,
              w13_bias, w2_bias)
    flags = [False] * (len(INPUTS) + 3)
    for i, need in zip(_GRAD_INDEX, needs):
        flags[i] = need
    saved = (*inputs, topk_weights, topk_ids, expert_offsets, src2dst, dst2src, None if recompute else h)
    ctx = _Context(config_from_key(config, config_floats), implementation, recompute, saved, flags)
    with plain(d_out.device):
        grads = _layer_function().backward(ctx, d_out, None)  # (no gradient for its integer topk_ids output)
    return grad_outputs("epmoe::moe_layer_backward", [grads[i] for i in _GRAD_INDEX], inputs, needs, d_out)


def grad_outputs(op: str, grads, inputs, needs, d_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What a backward op returns: for each of :data:`GRADS` (``grads``, in that order), the gradient (contiguous)
    where ``needs`` asks for it, an empty ``[0]`` tensor (of the input's dtype, or ``d_out``'s) elsewhere.
    ``inputs``: the layer's :data:`INPUTS`. RuntimeError if an asked-for gradient is ``None`` (the fake promises it)."""
    out = []
    for name, i, g, need in zip(GRADS, _GRAD_INDEX, grads, needs):
        if need and g is None:  # the layer and grad_flags disagree
            raise RuntimeError(f"{op}: d_{name} was asked for and not formed")
        out.append(g.contiguous() if need else inputs[i].new_empty(0) if inputs[i] is not None else d_out.new_empty(0))
    return tuple(out)


def grad_outputs_fake(inputs, needs, d_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`grad_outputs`' shapes and dtypes (a backward op's fake): each asked-for gradient like its input."""
    out = []
    for i, need in zip(_GRAD_INDEX, needs):
        t = inputs[i]
        out.append(t.new_empty(t.shape) if need else (t if t is not None else d_out).new_empty(0))
    return tuple(out)


@_moe_layer_backward_op.register_fake
def _moe_layer_backward_fake(d_out, x, router_logits, w13, w2, w13_scale, w2_scale, e_score_correction_bias,
                             shared_expert_gate_logits, w13_bias, w2_bias, topk_weights, topk_ids, expert_offsets,
                             src2dst, dst2src, h, config, config_floats, implementation, recompute, needs):
    inputs = (x, router_logits, w13, w2, w13_scale, w2_scale, e_score_correction_bias, shared_expert_gate_logits,
              w13_bias, w2_bias)
    return grad_outputs_fake(inputs, needs, d_out)


def grad_flags(config: MoEConfig, needs_input_grad, inputs) -> list[bool]:
    """Which of :data:`GRADS` the backward forms: asked for by autograd, and the input given and not frozen
    (FP8 / 4-bit weight codes get no gradient: CONTRACT.md section 8)."""
    frozen = config.quant != "none"
    flags = []
    for name, i in zip(GRADS, _GRAD_INDEX):
        flags.append(bool(needs_input_grad[i]) and inputs[i] is not None and not (frozen and name in ("w13", "w2")))
    return flags


def functorch_levels() -> list:
    """The ``torch.func`` transforms active around the call, outermost first (their ``TransformType``s)."""
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return [interpreter.key() for interpreter in retrieve_all_functorch_interpreters()]


def second_order_error(op: str) -> RuntimeError:
    """The refusal of a gradient of ``op``'s gradient (CONTRACT.md section 8), as ``first_order_backward`` words it."""
    return RuntimeError(
        f"{op}: second-order gradients (create_graph=True / double backward) are not supported: its "
        f"backward is not differentiable; got a backward with create_graph=True (use create_graph=False, "
        f"or keep this layer out of the differentiated gradient)")


def refuse_second_order(op: str, through_functorch: bool) -> None:
    """Raise :func:`second_order_error` if this backward's result would itself be differentiated. Plain autograd
    (``through_functorch`` false): grad mode on, i.e. ``create_graph=True``. Reached through ``torch.func``
    (which runs every backward with grad mode on: ``grad``, and a ``vjp`` function called with grad mode on):
    more than one differentiating level (``grad(grad(...))``); should the result of a first-order one be
    differentiated all the same, :class:`_BackwardFunction` refuses then. (Not under ``torch.compile``:
    AOTAutograd traces the backward once and refuses a double backward itself.)"""
    if not through_functorch:
        if torch.is_grad_enabled():
            raise second_order_error(op)
        return
    from torch._C._functorch import TransformType

    if sum(level in (TransformType.Grad, TransformType.Jvp) for level in functorch_levels()) > 1:
        raise second_order_error(op)


class _BackwardFunction(torch.autograd.Function):
    """``epmoe::moe_layer_backward`` where ``torch.func`` may record it (its inputs are the transform's tensors):
    a custom op alone cannot be (``torch.func`` needs an ``autograd.Function`` with ``setup_context``); its own
    backward, a second-order gradient, raises."""

    @staticmethod
    def forward(*args):
        return torch.ops.epmoe.moe_layer_backward(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise second_order_error("moe_forward")

    @staticmethod
    def vmap(info, in_dims, *args):
        raise _vmap_error()


def _vmap_error() -> NotImplementedError:
    return NotImplementedError(
        "moe_forward: torch.func.vmap is not supported (the layer has no batching rule: call it on the "
        "flattened tokens [T, H] instead, or loop); torch.func.grad and torch.func.vjp are")


class MoELayerFunction(torch.autograd.Function):
    """``moe_forward`` for autograd, ``torch.compile`` and ``torch.func``: forward ``epmoe::moe_layer``, backward
    ``epmoe::moe_layer_backward``. Outputs ``(out, *SAVED)``; only ``out`` is differentiable."""

    @staticmethod
    def forward(x, router_logits, w13, w2, w13_scale, w2_scale, bias, shared_logits, w13_bias, w2_bias, config,
                key, floats, implementation, recompute, out_dtype):
        return torch.ops.epmoe.moe_layer(x, router_logits, w13, w2, w13_scale, w2_scale, bias, shared_logits,
                                         w13_bias, w2_bias, key, floats, implementation, recompute, out_dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, *saved = output
        ctx.mark_non_differentiable(*saved)
        ctx.set_materialize_grads(False)  # no zeros of h's size for the outputs nobody differentiates
        ctx.save_for_backward(*inputs[:len(INPUTS)], *saved)
        ctx.config, ctx.key, ctx.floats, ctx.implementation, ctx.recompute, _ = inputs[len(INPUTS):]

    @staticmethod
    def backward(ctx, d_out, *_):
        if not torch.compiler.is_compiling():  # torch.func runs it with the context of a Function it generates
            refuse_second_order("moe_forward", through_functorch=not isinstance(ctx, MoELayerFunction._backward_cls))
        saved = ctx.saved_tensors
        inputs = saved[:len(INPUTS)]
        flags = grad_flags(ctx.config, ctx.needs_input_grad, inputs)
        if d_out is None or not any(flags):
            return (None,) * (len(INPUTS) + 6)
        args = (d_out, *saved, ctx.key, ctx.floats, ctx.implementation, ctx.recompute, flags)
        # under torch.compile the op itself (AOTAutograd traces it); elsewhere where torch.func can record it
        grads = torch.ops.epmoe.moe_layer_backward(*args) if torch.compiler.is_compiling() \
            else _BackwardFunction.apply(*args)
        result = [None] * (len(INPUTS) + 6)
        for i, g, need in zip(_GRAD_INDEX, grads, flags):
            result[i] = g if need else None
        return tuple(result)

    @staticmethod
    def vmap(info, in_dims, *args):
        raise _vmap_error()


def _refuse_forward_mode(*inputs) -> None:
    """``NotImplementedError`` under forward-mode AD (``torch.func.jvp`` / ``jacfwd``, or a dual tensor input of
    ``torch.autograd.forward_ad``): the layer has a reverse-mode backward only. (A ``jvp`` staticmethod saying so
    would stop Dynamo from tracing :class:`MoELayerFunction`.)"""
    from torch._C._functorch import TransformType

    dual = torch.autograd.forward_ad._current_level >= 0 and any(
        t is not None and torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in inputs)
    if dual or TransformType.Jvp in functorch_levels():
        raise NotImplementedError(
            "moe_forward: forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad) is not supported: the "
            "layer has a reverse-mode backward only (torch.autograd, torch.func.grad, vjp, jacrev)")


def moe_layer(x, router_logits, w13, w2, w13_scale, w2_scale, e_score_correction_bias, shared_expert_gate_logits,
              w13_bias, w2_bias, config: MoEConfig, implementation: str | None,
              recompute: bool, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_forward``'s computation on validated arguments: ``(out [T, H] in out_dtype (None: x.dtype), topk_ids
    [T, topk + S] int32)``, ``out`` differentiable as ``moe_forward`` documents (through :class:`MoELayerFunction`),
    ``topk_ids`` the gate's own ids (before any capacity drop), for the router losses. ``out_dtype=torch.float32``
    is the EP replicated mode's partial (``moe_torch.ep``), summed over the ranks before it is rounded."""
    if not torch.compiler.is_compiling():  # (Dynamo refuses forward-mode AD through an autograd.Function itself)
        _refuse_forward_mode(x, router_logits, w13, w2, shared_expert_gate_logits, w13_bias, w2_bias)
    # No backward can follow (no_grad / inference_mode): the op's h output would only hold GEMM 1's [M_cap, 2I]
    # until the layer returns; recompute drops it (the forward computes the same either way).
    recompute = recompute or not torch.is_grad_enabled()
    outputs = MoELayerFunction.apply(x, router_logits, w13, w2, w13_scale, w2_scale, e_score_correction_bias,
                                     shared_expert_gate_logits, w13_bias, w2_bias, config, *config_key(config),
                                     implementation, recompute, out_dtype)
    return outputs[0], outputs[1 + SAVED.index("topk_ids")]
