"""The MoE layer as a ``torch.nn.Module``: :class:`EPMoE` holds one EP rank's expert weights and
calls :func:`moe_torch.layer.moe_forward`.

State::

    w13   [E_local, 2*I, H]  nn.Parameter (bf16 / float16 / float32, quant='none'; requires_grad=trainable)
                             or a buffer (float8_e4m3fn codes; 4-bit: packed uint8 codes [E_local, 2*I, H // 2])
    w2    [E_local, H, I]    same rule (4-bit: [E_local, H, I // 2])
    w13_scale, w2_scale      buffers: the weight scales (None for quant='none'): float32 FP8
                             [E_local, N] per-channel (fp8_per_token) or
                             [E_local, ceil(N/128), ceil(K/128)] blocks (fp8_block); 4-bit
                             [E_local, N, K // 32] uint8 e8m0 (mxfp4) or bf16 (int4)
    w13_bias, w2_bias        [E_local, 2*I] / [E_local, H] nn.Parameter (config.expert_bias only, else None;
                             requires_grad=trainable, with any weights: FP8 and 4-bit layers train them too):
                             gpt-oss's gate_up_proj_bias / down_proj_bias
    e_score_correction_bias  buffer [E] float (routing='biased_grouped_topk' only, else None)
    shared_expert_gate       [1, H] or [S, H] nn.Parameter (config.shared_expert_gate only, else None):
                             Qwen3-Next's shared_expert_gate.weight; forward computes the layer's
                             shared_expert_gate_logits = x @ shared_expert_gate.T from it

Training (``trainable=True``, the default): the float weights are ordinary trainable parameters, as
an ``nn.Linear``'s are, so an optimizer over ``model.parameters()`` updates them; the layer's backward
is :func:`moe_torch.moe_forward`'s (CONTRACT.md section 8, every backend). FP8 and 4-bit codes, their scales
and DeepSeek-V3's correction bias are buffers: never in ``parameters()``, so no optimizer, weight decay or
``requires_grad_()`` reaches them (a gradient step on an FP8 code is meaningless; the bias moves by its
load-balancing rule, and transformers holds it as a buffer too); an FP8 layer is straight-through
(gradients reach ``x`` and the router, in ``x.dtype``). Buffers and parameters alike move with
``.to(device)`` and round-trip through ``state_dict`` under the same names.

Compilers and transforms: ``forward`` traces under ``torch.compile(fullgraph=True)`` with no graph break,
forward and backward (the layer is the custom ops ``epmoe::moe_layer`` / ``epmoe::moe_layer_backward``,
:mod:`moe_torch.ops.custom_ops`), and ``torch.func.grad`` / ``vjp`` differentiate it; ``torch.func.vmap`` and
forward-mode AD raise ``NotImplementedError``. With a ``process_group`` ``torch.compile(fullgraph=True)`` holds too
(the EP collectives are custom ops as well: :mod:`moe_torch.ep`, "torch.compile"), ``torch.func`` does not.

Autocast (``torch.autocast``, e.g. bf16 around a float32 model): autocast does not reach into the layer's
custom ops, so ``forward`` applies the policy of transformers' ``grouped_mm`` experts (:func:`autocast_policy`, for
:class:`EPMoE` and :class:`MoEBlock` alike): the input is cast to the weights' dtype (``quant='none'``; FP8 / 4-bit
layers keep ``x``'s dtype), the module computes in it with autocast off inside (float32 weights: float32 GEMMs,
float32 accumulation, no bf16 rounding of the weights), and the output is cast back to ``x``'s dtype (bf16 in, bf16
out, as an autocast ``nn.Linear`` would give). Gradients follow the casts: ``x`` gets its gradient in its own dtype,
the float32 weights in float32.

``forward`` does nothing on the host but shape checks and launches (no ``.item()``, no
data-dependent shapes), so it can be captured in a CUDA graph with ``implementation="triton"``
(or ``None`` on CUDA tensors). With a ``process_group`` it runs the whole layer through
:mod:`moe_torch.ep` (``ep_mode="all_to_all"`` syncs with the host once per call).

:class:`MoEBlock` adds the router of a transformers sparse-MoE block (``[B, S, H]`` hidden states in and out), its
weights under that block's names (``gate.weight``, ``experts.gate_up_proj``, ...: ``load_state_dict`` both ways).

Mirror: ``moe_pallas/module.py``.
"""

from __future__ import annotations


import torch

from moe_contract.config import MoEConfig
from moe_contract.inputs import (check_seed, draw_expert_biases, draw_preset_weights, draw_router,
                                  draw_shared_expert_gate)
from moe_contract.op_checks import check_router_loss_option, check_select_experts
from moe_contract.presets import get_preset
from moe_contract.w4_layout import check_mma_layout_scales
from moe_contract.validation import (
    FLOAT_DTYPES,
    check_bool,
    check_choice,
    check_config,
    check_dtype,
    check_expert_biases,
    check_global_biases,
    check_layer_inputs,
    check_layer_weights,
    check_rank,
    check_shape,
    check_shared_expert_gate_weight,
    dtype_name,
)
from moe_torch.ep import EP_MODES, ep_moe_forward
from moe_torch.hf import HF_QUANTS, HFExperts, block_layer_weights, read_block
from moe_torch.layer import LAYER_IMPLEMENTATIONS, local_weights, moe_forward, quantize_layer_weights
from moe_torch.ops.common import check_torch_tensors
from moe_torch.ops.custom_ops import functorch_levels
from moe_torch.ops.dispatch import check_implementation
from moe_torch.ops.gate.losses import RouterLosses
from moe_torch.tensor_guards import (  # noqa: F401  (re-exported: their home before tensor_guards)
    check_code_dtypes_on_load,
    keep_dtypes_fn,
    require_torch_tensors,
)


def check_module_weights(
    op: str,
    config: MoEConfig,
    w13,
    w2,
    w13_scale,
    w2_scale,
    e_score_correction_bias,
    w13_bias=None,
    w2_bias=None,
) -> None:
    """The weights of one EP rank against ``config``, with the layer's own rules and messages.

    ``quant='none'``: ``w13``, ``w2`` float (one dtype), no scales. FP8: float8_e4m3fn codes with
    the scale layout of the quant mode; 4-bit: packed uint8 codes with group scales. ``e_score_correction_bias``
    ``[E]`` float exactly when ``routing='biased_grouped_topk'``; ``w13_bias [E_local, 2*I]`` / ``w2_bias
    [E_local, H]`` exactly when ``config.expert_bias`` (float32, bf16, or the float weights' dtype; a quantized
    layer: any float dtype, checked against ``x`` when called). All tensors on ``w13``'s device.

    Raises: TypeError (not a MoEConfig, not tensors, dtypes), ValueError (shapes, missing or
      unexpected scales or biases, devices).
    """
    check_config(op, config)
    if config.quant == "none":
        check_layer_weights(op, config, w13, w2)
        x_dtype = w13.dtype
    else:  # activations of any float dtype: a float16 bias goes with float16 x
        x_dtype = w13_bias.dtype if w13_bias is not None and w13_bias.dtype == torch.float16 else torch.bfloat16
    # Shape-only stand-ins for x and router_logits (the checks read .shape and .dtype only).
    x = torch.empty((0, config.hidden_size), dtype=x_dtype, device="meta")
    logits = torch.empty((0, config.num_experts), dtype=torch.float32, device="meta")
    check_layer_inputs(op, config, x, logits, w13, w2, w13_scale, w2_scale)
    check_expert_biases(op, config, x, w13_bias, w2_bias)
    check_select_experts(
        op,
        logits,
        **config.gate_kwargs(),
        e_score_correction_bias=e_score_correction_bias,
    )
    named = (("w2", w2), ("w13_scale", w13_scale), ("w2_scale", w2_scale), ("e_score_correction_bias", e_score_correction_bias),
             ("w13_bias", w13_bias), ("w2_bias", w2_bias))
    for name, t in named:
        if t is not None and t.device != w13.device:
            raise ValueError(f"{op}: {name} must be on w13's device ({w13.device}); got {name}.device={t.device}")
    check_module_mma_scales(op, config, w13_scale, w2_scale)


def check_module_mma_scales(op: str, config: MoEConfig, w13_scale, w2_scale) -> None:
    """``config.w4_layout == "mma"``: ValueError naming ``op`` and the scale if an e8m0 code is one the layout's table
    cannot hold (129..254: those weights would read as NaN, CONTRACT.md section 9). Reads the scales on the host:
    a load-time check."""
    if config.w4_layout != "mma":
        return
    for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        check_mma_layout_scales(op, name, s.detach().cpu().numpy())


def check_global_weights(op: str, config: MoEConfig, w13, w2) -> None:
    """Float weights of every expert: ``w13 [E + S, 2*I, H]``, ``w2 [E + S, H, I]`` (before slicing)."""
    check_config(op, config)
    H, I, E_all = config.hidden_size, config.intermediate_size, config.num_total_experts
    what13 = f"[E + S, 2*I, H] = ({E_all}, {2 * I}, {H}) (every expert of the layer)"
    what2 = f"[E + S, H, I] = ({E_all}, {H}, {I}) (every expert of the layer)"
    check_shape(op, "w13", w13, (E_all, 2 * I, H), what13)
    check_shape(op, "w2", w2, (E_all, H, I), what2)
    check_dtype(op, "w13", w13, FLOAT_DTYPES)
    check_dtype(op, "w2", w2, FLOAT_DTYPES)


def autocast_policy(x: torch.Tensor, compute_dtype: torch.dtype | None, forward, return_router_losses: bool):
    """The modules' ``torch.autocast`` policy (module docstring, "Autocast"): ``forward(x_in)`` with autocast off
    on ``x``'s device type, ``x_in`` being ``x`` cast to ``compute_dtype`` (``None``: ``x`` as it is), and the result
    cast back to ``x.dtype`` (with ``return_router_losses``, ``forward`` returns ``(out, RouterLosses)`` and only
    ``out`` is cast: the losses stay float32). Gradients follow the casts."""
    x_in = x if compute_dtype is None else x.to(compute_dtype)
    with torch.autocast(x.device.type, enabled=False):
        result = forward(x_in)
    return (result[0].to(x.dtype), result[1]) if return_router_losses else result.to(x.dtype)


class EPMoE(torch.nn.Module):
    """One MoE layer on EP rank ``config.ep_rank``: ``forward(x [T, H], router_logits [T, E]) -> [T, H]``.

    Args:
      config: the layer (:class:`moe_contract.MoEConfig`: routing, rsf, quant, EP rank, capacity).
      w13: ``[E_local, 2*I, H]`` this rank's gate (rows ``:I``) and up projections: bf16 /
        float16 / float32 for ``quant='none'`` (then ``x`` must have this dtype), float8_e4m3fn
        for the FP8 modes, packed 4-bit codes ``[E_local, 2*I, H // 2]`` uint8 for ``'mxfp4'`` / ``'int4'``.
      w2: ``[E_local, H, I]`` down projections, same dtype as ``w13`` (4-bit: ``[E_local, H, I // 2]``).
      w13_scale, w2_scale: dequantization multipliers (``w ~= q * scale``), as
        :func:`moe_torch.quantize_layer_weights` makes them: float32 ``[E_local, N]`` (``fp8_per_token``;
        ``[E_local]`` per-expert also taken) or ``[E_local, ceil(N/128), ceil(K/128)]``
        (``fp8_block``); 4-bit ``[E_local, N, K // 32]`` uint8 e8m0 (``mxfp4``) or bf16 (``int4``);
        ``None`` for ``quant='none'``.
      w13_bias, w2_bias: for (and only for) ``config.expert_bias`` (gpt-oss): ``[E_local, 2*I]`` / ``[E_local, H]``
        float (``gate_up_proj_bias`` / ``down_proj_bias`` of this rank's experts), ``nn.Parameter``
        (``requires_grad=trainable``) whatever the weights are: FP8 and 4-bit layers train their biases too.
      e_score_correction_bias: ``[E]`` float, for (and only for) ``routing='biased_grouped_topk'``.
      shared_expert_gate: for (and only for) ``config.shared_expert_gate`` (Qwen3-Next): ``[1, H]``, transformers'
        ``shared_expert_gate.weight`` (one gate for the whole shared MLP: every fused shared slot), or ``[S, H]``
        (one per slot), float; an ``nn.Parameter`` (``requires_grad=trainable``). ``forward`` computes
        ``shared_expert_gate_logits = F.linear(x, shared_expert_gate)`` in its dtype (as transformers'
        ``nn.Linear``), widened to float32. Llama 4's ``config.apply_router_weight_on_input`` needs no weight.
      implementation: the backend of every stage (``None``, ``"reference"``, ``"triton"``), or a grouped GEMM
        kernel name for the forward GEMMs (``"gluon_bf16"``, ..., ``"triton_pointer"``), as
        :func:`moe_torch.moe_forward` takes it.
      process_group: ``None`` (default): ``forward`` returns this rank's partial sum and moves
        nothing. A ``torch.distributed`` group (or ``ep_mode`` given: the default group):
        ``forward`` is :func:`moe_torch.ep.ep_moe_forward` over it and returns the whole layer's
        output; ``config.ep_rank`` / ``ep_size`` must match the group.
      ep_mode: ``"replicated"`` (the default with a group: every rank the same ``x [T, H]``,
        all-reduce) or ``"all_to_all"`` (each rank its own tokens ``x [T_r, H]``, DeepEP-style
        dispatch / combine; a host sync per call, not CUDA-graph capturable). Differentiable too
        (:func:`moe_torch.ep.ep_moe_forward`'s backward: each rank's weight gradient is its slice of
        the single-device one; every rank must run the backward, as with DDP).
      trainable: ``True`` (default): float weights (``quant='none'``) and the expert biases are ``nn.Parameter``
        with ``requires_grad=True``, as ``nn.Linear``'s are, so ``torch.optim.AdamW(model.parameters())``
        trains them; inference under ``torch.no_grad()`` / ``torch.inference_mode()`` keeps no
        activations. ``False``: frozen parameters (``requires_grad=False``). FP8 / 4-bit codes, scales and the
        correction bias are buffers either way (module docstring).
      recompute: passed to :func:`moe_torch.moe_forward`: ``False`` (default) keeps GEMM 1's output
        for the backward, ``True`` keeps only the routing and recomputes GEMM 1 in the backward.

    Gradients (CONTRACT.md section 8): ``x``, ``router_logits``, the float weights and the expert biases, from
    :func:`moe_torch.moe_forward`'s backward (:func:`moe_torch.ep.ep_moe_forward`'s with a process
    group) with this layer's ``implementation`` (Triton kernels included); FP8 and 4-bit layers
    straight-through to ``x`` and ``router_logits`` in ``x.dtype``.

    The tensors are held as given (no copy): ``load_state_dict`` writes into them (and raises
    ``RuntimeError`` for float weights into FP8 codes or the reverse: :func:`check_code_dtypes_on_load`).
    ``.to(device)`` moves everything. Dtype casts (``.to(dtype)``, ``.half()``, ``.bfloat16()``,
    ``.float()``, ``model.to(torch.float16)`` around it) cast float weights (``quant='none'``) only:
    FP8 codes, their float32 scales and the float32 ``e_score_correction_bias`` (CONTRACT.md section 1:
    never rounded) keep their dtype and just move (:func:`keep_dtypes_fn`), as transformers' quantized
    layers do.

    Raises: TypeError / ValueError from :func:`check_module_weights`, before anything is stored.

    Source: the layout of SGLang / vLLM ``FusedMoE`` (``w13_weight``, ``w2_weight``, FP8
    ``*_weight_scale(_inv)``).
    """

    def __init__(
        self,
        config: MoEConfig,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        e_score_correction_bias: torch.Tensor | None = None,
        shared_expert_gate: torch.Tensor | None = None,
        implementation: str | None = None,
        process_group=None,
        ep_mode: str | None = None,
        trainable: bool = True,
        recompute: bool = False,
    ) -> None:
        super().__init__()
        op = "EPMoE"
        check_choice(op, "ep_mode", ep_mode, (None, *EP_MODES))
        check_bool(op, "trainable", trainable)
        check_bool(op, "recompute", recompute)
        check_torch_tensors(op, dict(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale, w13_bias=w13_bias,
                                     w2_bias=w2_bias, e_score_correction_bias=e_score_correction_bias,
                                     shared_expert_gate=shared_expert_gate), required=True)
        check_module_weights(op, config, w13, w2, w13_scale, w2_scale, e_score_correction_bias, w13_bias, w2_bias)
        check_shared_expert_gate_weight(op, config, shared_expert_gate)
        if shared_expert_gate is not None and shared_expert_gate.device != w13.device:
            raise ValueError(f"{op}: shared_expert_gate must be on w13's device ({w13.device}); "
                             f"got shared_expert_gate.device={shared_expert_gate.device}")
        check_implementation(op, implementation, LAYER_IMPLEMENTATIONS)
        self.config = config
        self.implementation = implementation
        self.process_group = process_group
        self.ep_mode = ep_mode
        self.recompute = recompute
        if config.quant == "none":  # float weights: parameters, trainable unless asked otherwise
            self.w13 = torch.nn.Parameter(w13.detach(), requires_grad=trainable)
            self.w2 = torch.nn.Parameter(w2.detach(), requires_grad=trainable)
        else:  # FP8 / 4-bit codes: frozen buffers (module docstring)
            self.register_buffer("w13", w13.detach())
            self.register_buffer("w2", w2.detach())
        for name, b in (("w13_bias", w13_bias), ("w2_bias", w2_bias)):  # trainable with any weights
            self.register_parameter(name, None if b is None else torch.nn.Parameter(b.detach(), requires_grad=trainable))
        for name, t in (("w13_scale", w13_scale), ("w2_scale", w2_scale),
                        ("e_score_correction_bias", e_score_correction_bias)):
            self.register_buffer(name, None if t is None else t.detach())
        self.register_parameter("shared_expert_gate", None if shared_expert_gate is None else
                                torch.nn.Parameter(shared_expert_gate.detach(), requires_grad=trainable))

    @property
    def trainable(self) -> bool:
        """Whether the float weights require grad (``False`` for FP8 / 4-bit layers: codes are buffers)."""
        return self.config.quant == "none" and self.w13.requires_grad

    @classmethod
    def from_float(
        cls,
        config: MoEConfig,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        e_score_correction_bias: torch.Tensor | None = None,
        shared_expert_gate: torch.Tensor | None = None,
        implementation: str | None = None,
        process_group=None,
        ep_mode: str | None = None,
        trainable: bool = True,
        recompute: bool = False,
    ) -> "EPMoE":
        """This rank's layer from float weights of every expert, quantized per ``config.quant``.

        Args:
          w13: ``[E + S, 2*I, H]`` float32 / bf16 / float16, every expert (fused shared experts last).
          w2: ``[E + S, H, I]`` float.
          w13_bias, w2_bias: ``[E + S, 2*I]`` / ``[E + S, H]`` float, every expert's (``config.expert_bias`` only;
            gpt-oss's ``gate_up_proj_bias`` / ``down_proj_bias``); this rank's rows are kept (views), never
            quantized.
          e_score_correction_bias: ``[E]`` float (biased_grouped_topk only).
          shared_expert_gate: ``[1, H]`` / ``[S, H]`` float (``config.shared_expert_gate`` only), as :class:`EPMoE`.
          implementation, process_group, ep_mode, trainable, recompute: as :class:`EPMoE`.

        Returns: an :class:`EPMoE` holding ``local_weights(w, config)``, FP8- or 4-bit-quantized in the form of
        ``config.quant`` (bit-identical to :func:`moe_torch.quantize_layer_weights` of the slice); for
        ``quant='none'`` the slices themselves (views, no copy).

        Raises: TypeError / ValueError naming the argument (global shapes, dtypes, biases).
        """
        op = "EPMoE.from_float"
        check_torch_tensors(op, dict(w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias,
                                     e_score_correction_bias=e_score_correction_bias), required=True)
        check_global_weights(op, config, w13, w2)
        check_global_biases(op, config, w13_bias, w2_bias)
        w13, w2 = local_weights(w13, config), local_weights(w2, config)
        b13 = None if w13_bias is None else local_weights(w13_bias, config)
        b2 = None if w2_bias is None else local_weights(w2_bias, config)
        s13 = s2 = None
        if config.quant != "none":
            w13, s13, w2, s2 = quantize_layer_weights(w13, w2, config)
        return cls(config, w13, w2, w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2,
                   e_score_correction_bias=e_score_correction_bias,
                   shared_expert_gate=shared_expert_gate, implementation=implementation, process_group=process_group,
                   ep_mode=ep_mode, trainable=trainable, recompute=recompute)

    @classmethod
    def from_preset(
        cls,
        name: str,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        implementation: str | None = None,
        process_group=None,
        ep_mode: str | None = None,
        trainable: bool = True,
        recompute: bool = False,
        **config_overrides,
    ) -> "EPMoE":
        """A layer of preset ``name`` with random weights, as the tests and benchmarks draw them.

        Args:
          name: a :data:`moe_contract.PRESETS` name (``"tiny"``, ``"deepseek-v3"``...).
          seed: the numpy seed: the weights are this rank's slice of
            ``make_layer_inputs(config, num_tokens=0, seed)`` (``~ N(0, 1/K)``, bias ``~ N(0, 0.01)``
            float32), cast to ``dtype`` (round to nearest even) and quantized per ``config.quant``; the expert
            biases (``config.expert_bias``: gpt-oss's presets) this rank's slice of
            :func:`moe_contract.inputs.draw_expert_biases`, cast to ``dtype``;
            ``moe_pallas.MoELayer.from_preset`` with the same arguments holds the same bits.
          dtype: the float weights' dtype (and the ``x`` dtype ``quant='none'`` then takes): a ``torch.dtype`` or
            its name (``"bfloat16"``, ``"float32"``, ``"float16"``).
          device: default ``torch.get_default_device()``.
          implementation, process_group, ep_mode, trainable, recompute: as :class:`EPMoE`.
          config_overrides: :meth:`ModelPreset.config` fields (``quant``, ``ep_size``, ``ep_rank``,
            ``capacity_factor``, ``hidden_size``...).

        Drawing is on the host, one expert at a time, this rank's
        experts only (each expert has its own generator), one core (``make_layer_inputs`` draws on all
        cores, but holds the whole layer in float32): seconds for CPU-sized layers, a few minutes for all
        of DeepSeek-V3 on one rank (about 16 s per 10^9 values).

        Raises: ValueError (unknown preset, bad override values, ``seed`` not an int >= 0), TypeError (an unknown
          override name; dtype not float32 / bf16 / float16).
        """
        op = "EPMoE.from_preset"
        config = get_preset(name).config(**config_overrides)
        check_seed(op, seed)
        if isinstance(dtype, str) and dtype in FLOAT_DTYPES:  # a name, as MoELayer.from_preset takes it
            dtype = getattr(torch, dtype)
        if not isinstance(dtype, torch.dtype) or dtype_name(dtype) not in FLOAT_DTYPES:
            raise TypeError(f"{op}: dtype must be a torch.dtype or a name among {FLOAT_DTYPES}; got dtype={dtype!r}")
        device = torch.get_default_device() if device is None else torch.device(device)
        _, e_local = config.local_expert_range()
        H, I = config.hidden_size, config.intermediate_size
        w13 = torch.empty((e_local, 2 * I, H), dtype=dtype, device=device)
        w2 = torch.empty((e_local, H, I), dtype=dtype, device=device)
        bias = None
        for kind, e, a in draw_preset_weights(config, seed):
            t = torch.from_numpy(a).to(device)
            if kind == "bias":
                bias = t if config.routing == "biased_grouped_topk" else None
            else:
                (w13 if kind == "w13" else w2)[e] = t.to(dtype)
        s13 = s2 = None
        if config.quant != "none":
            w13, s13, w2, s2 = quantize_layer_weights(w13, w2, config)
        gate = draw_shared_expert_gate(config, seed)  # [1, H] float32, or None
        gate = None if gate is None else torch.from_numpy(gate).to(device, dtype)
        biases = draw_expert_biases(config, seed)  # ([E + S, 2I], [E + S, H]) float32, or None
        b13, b2 = (None, None) if biases is None else (
            local_weights(torch.from_numpy(b).to(device, dtype), config).contiguous() for b in biases)
        return cls(config, w13, w2, w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2, e_score_correction_bias=bias,
                   shared_expert_gate=gate, implementation=implementation, process_group=process_group, ep_mode=ep_mode,
                   trainable=trainable, recompute=recompute)

    @classmethod
    def from_hf_block(
        cls,
        block: torch.nn.Module,
        *,
        implementation: str | None = None,
        quant: str | None = None,
        process_group=None,
        ep_mode: str | None = None,
        trainable: bool = True,
        recompute: bool = False,
        **config_overrides,
    ) -> "EPMoE":
        """This rank's layer from one transformers sparse-MoE block (``MixtralSparseMoeBlock``,
        ``Qwen3MoeSparseMoeBlock``, ``DeepseekV3MoE`` (also Kimi K2's), ``Glm4MoeMoE``, ``Llama4TextMoe``,
        ``Qwen3NextSparseMoeBlock``; :data:`moe_torch.hf.SUPPORTED_BLOCKS`). Llama 4's router weight on the
        input and Qwen3-Next's shared-expert gate (its ``shared_expert_gate [1, H]`` weight) come with it.

        The routing (top-k, renormalize = ``norm_topk_prob``, groups, ``rsf``), the activation and the
        sizes are read from the block's router and experts (transformers fills them from the model
        config; they are what the block computes). DeepSeek-V3's shared-expert MLP
        (intermediate ``n_shared_experts * I``) becomes ``S = n_shared_experts`` fused shared experts
        (``w13[E + j]`` = rows ``j*I:(j+1)*I`` of its ``gate_proj`` and ``up_proj``, ``w2[E + j]`` the
        matching columns of ``down_proj``; exact: the MLP is the sum of those pieces). The weights are
        copied (``torch.cat``) for DeepSeek-V3, views of the block's for the others with ``quant='none'``;
        the routing bias is a view of the block's ``gate.e_score_correction_bias``.

        Args:
          block: the transformers block (float weights).
          quant: ``None`` / ``"none"``, ``"fp8_per_token"`` or ``"fp8_block"`` (quantizes the experts).
          implementation, process_group, ep_mode, trainable, recompute: as :class:`EPMoE`. With
            ``quant='none'`` and no shared experts the layer's weights share the block's storage, so
            training one moves the other's weights too.
          config_overrides: :class:`MoEConfig` fields (``ep_size``, ``ep_rank``,
            ``apply_routed_scaling_factor_on_output``, ``capacity_factor``); the routing fields come from the block.

        Returns: an :class:`EPMoE` with ``forward(x [T, H], router_logits [T, E]) -> [T, H]`` equal to
        ``block(x[None])[0]`` (shared experts included) when ``router_logits = block.gate(x)[0]``, and the
        same gradients (``x``, the router through ``router_logits``, the experts; DeepSeek-V3's shared MLP
        as the rows ``E:`` of ``w13`` / ``w2``): ``tests/test_hf_grad_parity.py``.

        gpt-oss's ``GptOssMLP`` comes with its expert biases (``w13_bias`` / ``w2_bias``); its router's bias is
        in the caller's ``router_logits = block.router(x)[0]``, as for every block.

        Raises: NotImplementedError (a block class or activation not supported), TypeError (an unknown
          override), ValueError (inconsistent block shapes).
        """
        config, w13, w2, bias, gate, b13, b2 = block_layer_weights(
            block, quant=quant, op="EPMoE.from_hf_block", with_shared_expert_gate=True, with_expert_biases=True,
            **config_overrides)
        return cls.from_float(config, w13, w2, w13_bias=b13, w2_bias=b2, e_score_correction_bias=bias,
                              shared_expert_gate=gate, implementation=implementation, process_group=process_group,
                              ep_mode=ep_mode, trainable=trainable, recompute=recompute)

    def _frozen_dtype_names(self) -> tuple[str, ...]:
        codes = ("w13", "w2") if self.config.quant != "none" else ()
        return (*codes, "w13_scale", "w2_scale", "e_score_correction_bias")

    def _apply(self, fn, recurse=True):
        """``Module._apply`` with FP8 codes, scales and the routing bias kept in their dtype
        (:func:`keep_dtypes_fn`)."""
        return super()._apply(keep_dtypes_fn(self, fn, self._frozen_dtype_names()), recurse)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        error_msgs = args[-1]  # (local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if check_code_dtypes_on_load(self, state_dict, prefix, ("w13", "w2"), error_msgs):
            return  # load nothing into this layer: load_state_dict raises with the message
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, *, return_router_losses: bool = False,
                seq_len: int | None = None) -> torch.Tensor | tuple[torch.Tensor, RouterLosses]:
        """``x [T, H]`` (float32 / bf16 / float16; ``w13``'s dtype for ``quant='none'``) and
        ``router_logits [T, E]`` float -> ``out [T, H]`` in ``x.dtype``: this rank's partial sum
        (the sum over EP ranks is the layer's output).

        ``return_router_losses=True`` (and ``seq_len``, the tokens of one sequence, for ``seq_aux_loss``):
        ``(out, RouterLosses)``, the router's training losses of the call (CONTRACT.md section 10; unscaled float32
        ``aux_loss``, ``seq_aux_loss``, ``z_loss`` and ``tokens_per_expert [E]`` int32, as
        :func:`moe_torch.moe_forward` / :func:`moe_torch.ep.ep_moe_forward` return them: global, the same on every
        rank). Add ``coef * aux_loss`` to the training loss; feed ``tokens_per_expert`` to
        :func:`moe_torch.update_expert_bias` for ``e_score_correction_bias`` (DeepSeek-V3's auxiliary-loss-free
        balancing: ``self.e_score_correction_bias.copy_(update_expert_bias(...))`` after the step).

        No host synchronisation with ``implementation="triton"`` (CUDA-graph capturable after a
        warm-up call that compiles the kernels).

        With a ``process_group`` (or an ``ep_mode``): the layer's whole output, through
        :func:`moe_torch.ep.ep_moe_forward` (``x`` and the output are ``[T_r, H]``, this rank's
        tokens, under ``ep_mode="all_to_all"``).

        Differentiable in ``x``, ``router_logits`` and the float weights (and ``shared_expert_gate``, the expert
        biases), with ``recompute=self.recompute``.

        Under ``torch.autocast`` (module docstring): ``x`` of any float dtype, cast to the weights' dtype
        (``quant='none'``), the layer run with autocast off, the output returned in ``x.dtype`` (the router losses
        as they come: float32).

        Raises: TypeError for arrays that are not torch tensors (numpy: convert with ``torch.from_numpy``);
          ValueError / TypeError from :func:`moe_torch.moe_forward` (shapes, dtypes).
        """
        require_torch_tensors("EPMoE", dict(x=x, router_logits=router_logits))
        if x.ndim != 2:  # named here: the user called the module, and a [B, S, H] input is the block's
            raise ValueError(f"EPMoE: x must be [T, H] (tokens flattened; moe_torch.MoEBlock takes [B, S, H]); "
                             f"got x of shape {tuple(x.shape)}")
        if torch.is_autocast_enabled(x.device.type):  # the layer's ops are custom ops, which autocast does not reach
            def forward(x_in):
                return self.forward(x_in, router_logits, return_router_losses=return_router_losses, seq_len=seq_len)

            return autocast_policy(x, self.w13.dtype if self.config.quant == "none" else None, forward,
                                   return_router_losses)
        if self.config.quant == "none" and x.dtype != self.w13.dtype:
            raise TypeError(f"EPMoE: x must have the layer's dtype {dtype_name(self.w13)} (quant='none'); "
                            f"got x.dtype={dtype_name(x)}")
        T, E = x.shape[0], self.config.num_experts  # named here too: the user called the module
        check_shape("EPMoE", "router_logits", router_logits, (T, E), lambda: f"[T, E] = ({T}, {E})")
        shared_logits = self.shared_expert_gate_logits(x)
        if self.process_group is not None or self.ep_mode is not None:
            if not torch.compiler.is_compiling() and functorch_levels():  # the EP layers' Functions lack setup_context
                raise NotImplementedError("EPMoE: torch.func transforms (grad, vjp, vmap, jvp) are not supported with "
                                          "a process_group / ep_mode; without one they are (grad, vjp)")
            return ep_moe_forward(
                x,
                router_logits,
                self.w13,
                self.w2,
                self.config,
                group=self.process_group,
                mode=self.ep_mode or "replicated",
                w13_scale=self.w13_scale,
                w2_scale=self.w2_scale,
                w13_bias=self.w13_bias,
                w2_bias=self.w2_bias,
                e_score_correction_bias=self.e_score_correction_bias,
                shared_expert_gate_logits=shared_logits,
                implementation=self.implementation,
                recompute=self.recompute,
                return_router_losses=return_router_losses,
                seq_len=seq_len,
            )
        return moe_forward(
            x,
            router_logits,
            self.w13,
            self.w2,
            self.config,
            w13_scale=self.w13_scale,
            w2_scale=self.w2_scale,
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias,
            e_score_correction_bias=self.e_score_correction_bias,
            shared_expert_gate_logits=shared_logits,
            implementation=self.implementation,
            recompute=self.recompute,
            return_router_losses=return_router_losses,
            seq_len=seq_len,
        )

    def shared_expert_gate_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x [T, H]`` -> ``shared_expert_gate_logits [T, S]`` float32 (``None`` without ``config.shared_expert_gate``):
        ``F.linear(x, shared_expert_gate)`` in the weight's dtype (rounded to it, as transformers' ``nn.Linear``
        in Qwen3-Next), widened to float32; a ``[1, H]`` weight's one logit goes to every fused shared slot."""
        w = self.shared_expert_gate
        if w is None:
            return None
        H = self.config.hidden_size
        check_rank("EPMoE", "x", x, 2, f"[T, H] with H={H}")
        check_shape("EPMoE", "x", x, (None, H), f"[T, H] with H={H}")
        logits = torch.nn.functional.linear(x.to(w.dtype), w).float()
        return logits.expand(x.shape[0], self.config.num_fused_shared_experts)

    def extra_repr(self) -> str:
        c = self.config
        return (f"H={c.hidden_size}, I={c.intermediate_size}, E={c.num_experts}, topk={c.topk}, routing={c.routing!r}, "
                f"S={c.num_fused_shared_experts}, quant={c.quant!r}, "
                + ("w4_layout='mma', " if c.w4_layout == "mma" else "") + f"ep={c.ep_rank}/{c.ep_size}, "
                + ("apply_router_weight_on_input=True, " if c.apply_router_weight_on_input else "")
                + ("shared_expert_gate=True, " if c.shared_expert_gate else "")
                + ("expert_bias=True, " if c.expert_bias else "")
                + ("" if c.capacity_factor is None else f"capacity_factor={c.capacity_factor}, ")
                + f"implementation={self.implementation!r}, trainable={self.trainable}, recompute={self.recompute}"
                + ("" if self.process_group is None and self.ep_mode is None else f", ep_mode={self.ep_mode or 'replicated'!r}"))


# --------------------------------------------------------------------------------------
# The block: router + experts under transformers' names


#: The ``quant`` modes a :class:`MoEBlock` holds: float experts, or FP8 codes with their ``*_scale_inv`` (transformers'
#: FP8 experts' names); 4-bit codes have no transformers block layout here (the 4-bit layer is :class:`EPMoE`).
BLOCK_QUANTS = HF_QUANTS


def _in_by_out(config: MoEConfig, router_bias) -> bool:
    """Llama 4 (``apply_router_weight_on_input``) and gpt-oss (a router bias, expert biases) store their float experts
    in-by-out (``[E, H, 2*I]`` / ``[E, I, H]``) and call their router ``router``; every other family ``gate``."""
    return config.apply_router_weight_on_input or config.expert_bias or router_bias is not None


class MoERouter(torch.nn.Module):
    """A transformers sparse-MoE router under its names (no top-k of its own: the layer selects).

    State: ``weight [E, H]`` ``nn.Parameter`` (float32 / bf16 / float16; ``gate.weight`` / ``router.weight``),
    ``bias [E]`` float32 ``nn.Parameter`` (gpt-oss's ``GptOssTopKRouter.bias``, else None), ``e_score_correction_bias
    [E]`` float32 buffer (DeepSeek-V3's / GLM-4.5's ``DeepseekV3TopkRouter.e_score_correction_bias``, else None).

    ``forward(x [T, H]) -> router_logits [T, E]`` in ``weight``'s dtype: ``x @ weight.T (+ bias)`` in float32 (exact
    products of bf16 / float16 values, float32 accumulation), rounded once to ``weight``'s dtype, as
    :meth:`moe_pallas.MoEBlock.router_logits` computes them.

    Dtype casts of the module (``.to(dtype)``, ``.half()``) keep ``bias`` and ``e_score_correction_bias`` float32, and
    ``weight`` too when there is an ``e_score_correction_bias`` (transformers keeps DeepSeek-V3's ``gate.weight`` in
    float32: ``_keep_in_fp32_modules_strict``).

    Source: ``huggingface/transformers@v5.24.0:src/transformers/models/deepseek_v3/modeling_deepseek_v3.py``
    (``DeepseekV3TopkRouter``), ``.../gpt_oss/modeling_gpt_oss.py`` (``GptOssTopKRouter``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 e_score_correction_bias: torch.Tensor | None = None, *, trainable: bool = True) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach(), requires_grad=trainable)
        self.register_parameter("bias", None if bias is None else
                                torch.nn.Parameter(bias.detach(), requires_grad=trainable))
        self.register_buffer("e_score_correction_bias",
                             None if e_score_correction_bias is None else e_score_correction_bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, f32 = self.weight, torch.float32
        logits = torch.nn.functional.linear(x.to(f32), w.to(f32), None if self.bias is None else self.bias.to(f32))
        return logits.to(w.dtype)

    def _apply(self, fn, recurse=True):
        kept = ("bias", "e_score_correction_bias") + (("weight",) if self.e_score_correction_bias is not None else ())
        return super()._apply(keep_dtypes_fn(self, fn, kept), recurse)

    def extra_repr(self) -> str:
        E, H = self.weight.shape
        return (f"E={E}, H={H}, dtype={dtype_name(self.weight)}" + (", bias=True" if self.bias is not None else "")
                + (", e_score_correction_bias=True" if self.e_score_correction_bias is not None else ""))


class MoESharedMLP(torch.nn.Module):
    """The shared-expert MLP of a transformers block under its names: ``gate_proj`` / ``up_proj`` ``nn.Linear(H, S*I)``
    and ``down_proj`` ``nn.Linear(S*I, H)``, no biases; ``forward(x [T, H]) -> down_proj(act(gate_proj(x)) *
    up_proj(x))`` in ``x``'s dtype, ``act`` silu or gelu_tanh (``DeepseekV3MLP``, ``Qwen3NextMLP``, ``Llama4TextMLP``).
    """

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation: str, *,
                 trainable: bool = True) -> None:
        super().__init__()
        self.activation = activation
        for name, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            linear.weight = torch.nn.Parameter(w.detach(), requires_grad=trainable)
            self.add_module(name, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate_proj(x)
        F = torch.nn.functional
        act = F.silu(g) if self.activation == "silu" else F.gelu(g, approximate="tanh")
        return self.down_proj(act * self.up_proj(x))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class MoEBlock(torch.nn.Module):
    """A transformers sparse-MoE block as a torch module: the router and the experts, ``[B, S, H] -> [B, S, H]``.

    The torch twin of :class:`moe_pallas.MoEBlock` (the same constructor: a router weight ``[E, H]`` and the layer;
    the same output), holding its weights under the names of the transformers block of its family, so that
    ``block.load_state_dict(hf_block.state_dict())`` and the reverse work:

    ==================================  ======================================================================
    family (the layer's config)         state (transformers 5.24 names)
    ==================================  ======================================================================
    Mixtral, Qwen3-MoE (softmax)        ``gate.weight [E, H]``, ``experts.gate_up_proj [E, 2*I, H]``,
                                        ``experts.down_proj [E, H, I]``
    DeepSeek-V3, Kimi K2, GLM-4.5       the same, plus ``gate.e_score_correction_bias [E]`` (float32 buffer) and
    (``biased_grouped_topk``)           ``shared_experts.{gate_proj,up_proj}.weight [S*I, H]``,
                                        ``shared_experts.down_proj.weight [H, S*I]`` (S >= 1)
    Qwen3-Next (``shared_expert_gate``) ``gate.*``, ``experts.*``, ``shared_expert.*`` (S*I) and
                                        ``shared_expert_gate.weight [1, H]``
    Llama 4                             ``router.weight [E, H]``, ``experts.gate_up_proj [E, H, 2*I]`` and
    (``apply_router_weight_on_input``)  ``experts.down_proj [E, I, H]`` (in-by-out), ``shared_expert.*`` (S*I)
    gpt-oss (``expert_bias``)           ``router.weight [E, H]``, ``router.bias [E]``, ``experts.gate_up_proj
                                        [E, H, 2*I]`` (interleaved gate/up columns), ``experts.gate_up_proj_bias
                                        [E, 2*I]``, ``experts.down_proj [E, I, H]``, ``experts.down_proj_bias [E, H]``
    ==================================  ======================================================================

    (``moe_torch/hf.py``'s docstring has the layouts.) The names follow the layer's config, not a family argument:
    ``router`` and in-by-out experts for ``apply_router_weight_on_input`` or expert biases (else ``gate``),
    ``shared_expert`` for ``shared_expert_gate`` or ``apply_router_weight_on_input`` (else ``shared_experts``). FP8
    blocks hold float8_e4m3fn ``experts.gate_up_proj`` / ``experts.down_proj`` codes in the layer's ``[E, N, K]``
    layout with float32 ``experts.gate_up_proj_scale_inv`` / ``experts.down_proj_scale_inv`` (transformers' FP8
    experts' names); the router and the shared MLP stay float.

    Forward, for ``hidden_states [B, S, H]`` (or ``[T, H]``): ``router_logits = router(x)`` (:meth:`router_logits`),
    :func:`moe_torch.moe_forward` of the routed experts (the layer's routing, DeepSeek-V3's correction bias, Llama 4's
    weight on the input, gpt-oss's expert biases), plus the shared MLP as the transformers block adds it: ``+
    shared_experts(x)`` (DeepSeek-V3), ``+ sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (Qwen3-Next),
    ``shared_expert(x) + routed`` (Llama 4). :class:`moe_pallas.MoEBlock` runs the shared experts as the layer's fused
    shared experts instead: the same sum in another order (float32: within CONTRACT.md section 7's 1e-5). Returns the
    hidden states (with ``return_router_losses=True`` also the router losses), for every family, as the JAX block
    (transformers' ``Llama4TextMoe`` and ``GptOssMLP`` also return their router's logits / scores:
    :meth:`router_logits` gives the logits). Mixtral's training-time
    ``router_jitter_noise`` is not applied.

    Args:
      router_weight: ``[E, H]`` float32 / bf16 / float16 (``gate.weight``).
      layer: an :class:`EPMoE` of the whole layer (``ep_size == 1``, no process group), float or FP8 (FP8 with no
        shared experts: an FP8 layer's fused shared experts are codes, the block's shared MLP is float; build those
        with :meth:`from_float`); its routed experts ``w13[:E]`` / ``w2[:E]`` become ``experts.*`` (views of the
        layer's tensors, transposed copies for the in-by-out families), its fused shared experts ``w13[E:]`` /
        ``w2[E:]`` the shared MLP (rows ``j*I:(j+1)*I`` of ``gate_proj`` / ``up_proj`` and those columns of
        ``down_proj`` for shared expert ``j``: the inverse of :func:`moe_torch.hf.block_layer_weights`' split), its
        ``e_score_correction_bias`` ``gate.e_score_correction_bias``, its ``shared_expert_gate [1, H]``
        ``shared_expert_gate.weight``, its ``implementation`` and ``recompute`` the block's.
      router_bias: ``None`` (every family but gpt-oss) or ``[E]`` float32 (``router.bias``): logits ``x @ W.T + b``.

    Parameters are trainable (``requires_grad``) exactly when the layer's float weights are (an FP8 layer's: always,
    as :class:`moe_pallas.MoEBlock`'s router is an ``nnx.Param``); FP8 codes, scales and the correction bias are
    buffers. Gradients reach ``hidden_states``, the router, the float experts, the shared MLP and gate.

    Raises: TypeError (not tensors, ``layer`` not an :class:`EPMoE`, dtypes), ValueError (``router_weight`` not
      ``[E, H]``, ``router_bias`` not ``[E]``, ``ep_size > 1`` or a process group, an FP8 layer with shared experts),
      NotImplementedError (what no transformers block holds: 4-bit codes, ``[S, H]`` per-slot shared gates with
      ``S > 1``, shared experts with expert biases or ``swiglu_oai``), before anything is stored.

    Source: ``huggingface/transformers@v5.24.0:src/transformers/models/{mixtral,qwen3_moe,deepseek_v3,glm4_moe,
    qwen3_next,llama4,gpt_oss}/modeling_*.py`` (the blocks' module and parameter names). Mirror:
    ``moe_pallas/module.py``'s ``MoEBlock``.
    """

    def __init__(self, router_weight: torch.Tensor, layer: EPMoE, *, router_bias: torch.Tensor | None = None) -> None:
        super().__init__()
        op = "MoEBlock"
        if not isinstance(layer, EPMoE):
            raise TypeError(f"{op}: layer must be a moe_torch.EPMoE; got "
                            f"{type(layer).__module__}.{type(layer).__name__}")
        require_torch_tensors(op, dict(router_weight=router_weight))
        c = layer.config
        E, H, I, S = c.num_experts, c.hidden_size, c.intermediate_size, c.num_fused_shared_experts
        check_shape(op, "router_weight", router_weight, (E, H),
                    f"[E, H] = ({E}, {H}) (the router of the layer's config)")
        check_dtype(op, "router_weight", router_weight, FLOAT_DTYPES)
        if router_bias is not None:  # gpt-oss: GptOssTopKRouter's bias, logits x @ W.T + b
            require_torch_tensors(op, dict(router_bias=router_bias))
            check_shape(op, "router_bias", router_bias, (E,),
                        f"[E] = ({E},) float32 (the router's bias, one per expert of the layer's config)")
            check_dtype(op, "router_bias", router_bias, ("float32",))
        if c.ep_size != 1 or layer.process_group is not None or layer.ep_mode is not None:
            raise ValueError(f"{op}: layer must hold the whole layer (ep_size=1, no process_group / ep_mode: the block "
                             f"holds every expert under transformers' names); got ep_size={c.ep_size}, "
                             f"process_group={layer.process_group!r}, ep_mode={layer.ep_mode!r}. Under EP, give each "
                             f"rank an EPMoE with its process_group and compute the router logits beside it")
        if c.quant not in BLOCK_QUANTS:
            raise NotImplementedError(f"{op}: layer.config.quant must be one of {BLOCK_QUANTS} (float or FP8 experts, "
                                      f"as transformers' blocks hold them); got quant={c.quant!r}: a 4-bit layer is "
                                      f"EPMoE")
        if c.quant != "none" and S:
            raise ValueError(f"{op}: an FP8 layer (quant={c.quant!r}) with S={S} fused shared experts: their FP8 codes "
                             f"have no place in the block's float shared MLP; build it with "
                             f"MoEBlock.from_float(config, router_weight, w13, w2, ...) from float weights (the routed "
                             f"experts are quantized, the shared MLP stays float, as transformers' FP8 blocks keep it)")
        if S and (c.expert_bias or c.activation not in ("silu", "gelu_tanh")):
            raise NotImplementedError(f"{op}: shared experts with expert biases or activation={c.activation!r}: "
                                      f"transformers' shared MLPs have no biases and silu / gelu_tanh; got "
                                      f"expert_bias={c.expert_bias}, S={S}")
        gate_w = layer.shared_expert_gate
        if gate_w is not None and gate_w.shape[0] != 1:
            raise NotImplementedError(f"{op}: layer.shared_expert_gate must be [1, H] (Qwen3-Next's "
                                      f"shared_expert_gate.weight, one gate for the shared MLP); got [S, H] = "
                                      f"{list(gate_w.shape)}: per-slot gates have no transformers block")
        for name, t in (("router_weight", router_weight), ("router_bias", router_bias)):
            if t is not None and t.device != layer.w13.device:
                raise ValueError(f"{op}: {name} must be on the layer's device ({layer.w13.device}); got "
                                 f"{name}.device={t.device}")
        trainable = layer.trainable if c.quant == "none" else True
        self.config = c
        self.implementation = layer.implementation
        self.recompute = layer.recompute
        in_by_out = _in_by_out(c, router_bias)
        router = MoERouter(router_weight, router_bias, layer.e_score_correction_bias, trainable=trainable)
        w13, w2 = layer.w13.detach()[:E], layer.w2.detach()[:E]
        biases = {}
        for name, b in (("gate_up_proj_bias", layer.w13_bias), ("down_proj_bias", layer.w2_bias)):
            if b is not None:
                biases[name] = torch.nn.Parameter(b.detach()[:E], requires_grad=b.requires_grad)
        if c.quant == "none":
            if in_by_out:  # transformers' [E, H, 2I] / [E, I, H] for x @ w (torch.bmm)
                w13, w2 = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
            experts = HFExperts(torch.nn.Parameter(w13, requires_grad=trainable),
                                torch.nn.Parameter(w2, requires_grad=trainable), in_by_out=in_by_out, **biases)
        else:  # FP8 codes in the layer's [E, N, K] layout (frozen buffers), float32 multipliers
            experts = HFExperts(w13, w2, layer.w13_scale, layer.w2_scale, **biases)
        self._router_name = "router" if in_by_out else "gate"
        children = {self._router_name: router, "experts": experts}
        if S:
            parts13, parts2 = layer.w13.detach()[E:], layer.w2.detach()[E:]
            gate = torch.cat([p[0::2] if c.gate_up_layout == "interleaved" else p[:I] for p in parts13])
            up = torch.cat([p[1::2] if c.gate_up_layout == "interleaved" else p[I:] for p in parts13])
            down = torch.cat(list(parts2), dim=1)  # shared expert j: columns j*I:(j+1)*I
            shared = MoESharedMLP(gate, up, down, c.activation, trainable=trainable)
            name = "shared_expert" if c.shared_expert_gate or c.apply_router_weight_on_input else "shared_experts"
            children[name] = shared
        if gate_w is not None:
            linear = torch.nn.Linear(H, 1, bias=False, device="meta")
            linear.weight = torch.nn.Parameter(gate_w.detach(), requires_grad=gate_w.requires_grad)
            children["shared_expert_gate"] = linear
        for name, child in children.items():
            self.add_module(name, child)
        # the routed experts alone: the shared MLP (and Qwen3-Next's gate) run beside the layer, as transformers' do
        self._routed_config = c.replace(num_fused_shared_experts=0, shared_expert_gate=False)

    @property
    def router_module(self) -> MoERouter:
        """The :class:`MoERouter`, whichever transformers name it has (``gate``, or ``router``)."""
        return self._modules[self._router_name]

    @property
    def trainable(self) -> bool:
        """Whether the router weight requires grad (and with it the float experts and the shared MLP)."""
        return self.router_module.weight.requires_grad

    @classmethod
    def from_float(
        cls,
        config: MoEConfig,
        router_weight: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        router_bias: torch.Tensor | None = None,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        e_score_correction_bias: torch.Tensor | None = None,
        shared_expert_gate: torch.Tensor | None = None,
        implementation: str | None = None,
        trainable: bool = True,
        recompute: bool = False,
    ) -> "MoEBlock":
        """A block from float weights of every expert: the routed experts quantized per ``config.quant`` (``'none'``,
        ``'fp8_per_token'``, ``'fp8_block'``), the shared MLP kept float (as :func:`moe_torch.patch_hf_model` keeps it).

        Args:
          config: the layer (``ep_size == 1``).
          router_weight: ``[E, H]`` float; router_bias: ``[E]`` float32 or None, as :class:`MoEBlock`.
          w13, w2, w13_bias, w2_bias, e_score_correction_bias, shared_expert_gate: as :meth:`EPMoE.from_float`
            (``[E + S, 2*I, H]`` / ``[E + S, H, I]`` float, every expert, fused shared experts last).
          implementation, trainable, recompute: as :class:`EPMoE`.

        Returns: a :class:`MoEBlock`; for ``quant='none'`` the routed experts are views of ``w13`` / ``w2`` (but for
        the in-by-out families), for FP8 their codes are bit-identical to :func:`moe_torch.quantize_layer_weights` of
        ``w13[:E]`` / ``w2[:E]``.

        Raises: as :meth:`EPMoE.from_float` and :class:`MoEBlock`; NotImplementedError for a 4-bit ``config.quant``.
        """
        op = "MoEBlock.from_float"
        check_config(op, config)
        if config.quant not in BLOCK_QUANTS:
            raise NotImplementedError(f"{op}: config.quant must be one of {BLOCK_QUANTS} (float or FP8 experts, as "
                                      f"transformers' blocks hold them); got quant={config.quant!r}: a 4-bit layer is "
                                      f"EPMoE.from_float")
        layer = EPMoE.from_float(config.replace(quant="none"), w13, w2, w13_bias=w13_bias, w2_bias=w2_bias,
                                 e_score_correction_bias=e_score_correction_bias, shared_expert_gate=shared_expert_gate,
                                 implementation=implementation, trainable=trainable, recompute=recompute)
        block = cls(router_weight, layer, router_bias=router_bias)
        if config.quant != "none":  # the routed experts only: the shared MLP stays float
            ex = block.experts
            routed = config.replace(num_fused_shared_experts=0, shared_expert_gate=False)
            q13, s13, q2, s2 = quantize_layer_weights(ex.w13.detach().contiguous(), ex.w2.detach().contiguous(), routed)
            biases = dict(gate_up_proj_bias=ex.gate_up_proj_bias, down_proj_bias=ex.down_proj_bias)
            block.experts = HFExperts(q13, q2, s13, s2, **biases)
            block.config = config
            block._routed_config = routed
        return block

    @classmethod
    def from_preset(
        cls,
        name: str,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        implementation: str | None = None,
        trainable: bool = True,
        recompute: bool = False,
        **config_overrides,
    ) -> "MoEBlock":
        """A block of preset ``name`` with random weights: ``moe_pallas.MoEBlock.from_preset`` with the same arguments
        holds the same bits (float blocks; FP8 ones differ in the shared experts, float here).

        Args:
          name: a :data:`moe_contract.PRESETS` name.
          seed: the numpy seed: the experts, the correction bias, Qwen3-Next's shared gate and gpt-oss's expert biases
            as :meth:`EPMoE.from_preset` draws them (every expert in float, cast to ``dtype``), the router
            :func:`moe_contract.inputs.draw_router` (``[E, H]`` ~ N(0, 1/H); gpt-oss's bias ``[E]``): cast to
            ``dtype``, but float32 for ``biased_grouped_topk`` (transformers keeps DeepSeek-V3's router in float32);
            the router bias rounded to ``dtype`` and held in float32.
          dtype: ``torch.float32`` / ``bfloat16`` / ``float16`` or its name.
          device: default ``torch.get_default_device()``.
          implementation, trainable, recompute: as :class:`EPMoE`.
          config_overrides: :meth:`ModelPreset.config` fields (``quant`` among :data:`BLOCK_QUANTS`,
            ``hidden_size``, ``capacity_factor``...; ``ep_size`` must stay 1).

        Raises: as :meth:`EPMoE.from_preset` and :meth:`from_float`.
        """
        op = "MoEBlock.from_preset"
        config = get_preset(name).config(**config_overrides)
        check_seed(op, seed)
        if isinstance(dtype, str) and dtype in FLOAT_DTYPES:
            dtype = getattr(torch, dtype)
        if not isinstance(dtype, torch.dtype) or dtype_name(dtype) not in FLOAT_DTYPES:
            raise TypeError(f"{op}: dtype must be a torch.dtype or a name among {FLOAT_DTYPES}; got dtype={dtype!r}")
        if config.ep_size != 1:
            raise ValueError(f"{op}: ep_size must be 1 (the block holds every expert); got ep_size={config.ep_size}")
        device = torch.get_default_device() if device is None else torch.device(device)
        E_all, H, I = config.num_total_experts, config.hidden_size, config.intermediate_size
        w13 = torch.empty((E_all, 2 * I, H), dtype=dtype, device=device)
        w2 = torch.empty((E_all, H, I), dtype=dtype, device=device)
        bias = None
        for kind, e, a in draw_preset_weights(config, seed):
            t = torch.from_numpy(a).to(device)
            if kind == "bias":
                bias = t if config.routing == "biased_grouped_topk" else None
            else:
                (w13 if kind == "w13" else w2)[e] = t.to(dtype)
        gate = draw_shared_expert_gate(config, seed)
        gate = None if gate is None else torch.from_numpy(gate).to(device, dtype)
        biases = draw_expert_biases(config, seed)
        b13, b2 = (None, None) if biases is None else (torch.from_numpy(b).to(device, dtype) for b in biases)
        rw, rb = draw_router(config, seed)
        rw = torch.from_numpy(rw).to(device, torch.float32 if config.routing == "biased_grouped_topk" else dtype)
        rb = None if rb is None else torch.from_numpy(rb).to(device, dtype).float()  # the value a dtype model holds
        return cls.from_float(config, rw, w13, w2, router_bias=rb, w13_bias=b13, w2_bias=b2,
                              e_score_correction_bias=bias, shared_expert_gate=gate, implementation=implementation,
                              trainable=trainable, recompute=recompute)

    @classmethod
    def from_hf_block(
        cls,
        block: torch.nn.Module,
        *,
        implementation: str | None = None,
        quant: str | None = None,
        trainable: bool = True,
        recompute: bool = False,
        **config_overrides,
    ) -> "MoEBlock":
        """A block from one transformers sparse-MoE block (:data:`moe_torch.hf.SUPPORTED_BLOCKS`: Mixtral, Qwen3-MoE,
        DeepSeek-V3 / Kimi K2, GLM-4.5, Qwen3-Next, Llama 4, gpt-oss), its routing, sizes and activation read from
        the block (:meth:`EPMoE.from_hf_block`), its router weight (and gpt-oss's bias, widened to float32) taken.

        Args:
          block: the transformers block (float weights).
          quant: ``None`` / ``"none"``, ``"fp8_per_token"`` or ``"fp8_block"`` (the routed experts quantized).
          implementation, trainable, recompute: as :class:`EPMoE`.
          config_overrides: ``apply_routed_scaling_factor_on_output``, ``capacity_factor`` (the routing comes from the
            block; ``ep_size`` must stay 1).

        Returns: a :class:`MoEBlock` whose ``state_dict()`` has the block's names and shapes (float: its values), and
        whose ``forward(hidden_states)`` equals the block's hidden states (float32 within 1e-5). With ``quant='none'``
        the router weight, and for the families without shared experts and in-by-out layout the experts, share the
        block's storage (training one moves the other's weights).

        Raises: as :meth:`EPMoE.from_hf_block` and :class:`MoEBlock`.
        """
        op = "MoEBlock.from_hf_block"
        config, w13, w2, bias, gate, b13, b2 = block_layer_weights(
            block, quant=quant, op=op, with_shared_expert_gate=True, with_expert_biases=True, **config_overrides)
        b = read_block(block, op)
        router_bias = getattr(b.gate, "bias", None) if b.name == "GptOssMLP" else None
        router_bias = None if router_bias is None else router_bias.detach().float()
        return cls.from_float(config, b.gate.weight.detach(), w13, w2, router_bias=router_bias, w13_bias=b13,
                              w2_bias=b2, e_score_correction_bias=bias, shared_expert_gate=gate,
                              implementation=implementation, trainable=trainable, recompute=recompute)

    def router_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states [B, S, H]`` (or ``[T, H]``) -> ``router_logits [B*S, E]`` in the router weight's dtype:
        ``x @ W.T`` (gpt-oss: ``+ router.bias``) in float32, rounded once to the weight's dtype (:class:`MoERouter`), as
        :meth:`moe_pallas.MoEBlock.router_logits`.

        Raises: as :meth:`forward`."""
        return self.router_module(self._flat(hidden_states))

    def forward(self, hidden_states: torch.Tensor, *, return_router_losses: bool = False,
                seq_len: int | None = None) -> torch.Tensor | tuple[torch.Tensor, RouterLosses]:
        """``hidden_states [B, S, H]`` (or ``[T, H]``) -> the block's output, same shape and dtype (class docstring).

        ``hidden_states`` must have the experts' float dtype for ``quant='none'`` (any float dtype for FP8 blocks).

        ``return_router_losses=True``: ``(out, RouterLosses)``, the router's training losses of the call
        (:meth:`EPMoE.forward`; unscaled float32 ``aux_loss``, ``seq_aux_loss``, ``z_loss``, ``tokens_per_expert [E]``
        int32), differentiable in the router's weights; ``seq_len`` defaults to ``S`` for ``[B, S, H]`` hidden states
        (DeepSeek-V3's sequence-wise loss per sequence of the batch) and to ``None`` (no ``seq_aux_loss``) for
        ``[T, H]``, as :meth:`moe_pallas.MoEBlock.__call__`.

        Under ``torch.autocast`` (module docstring, :func:`autocast_policy`, as :meth:`EPMoE.forward`): hidden states of
        any float dtype (say bf16 from an autocast ``nn.Linear`` before a float32 block), cast to the experts' dtype
        (an FP8 block: to its shared MLP's float dtype, or kept without one), the whole block (router, experts, shared
        MLP and gate) run with autocast off, the output returned in the hidden states' dtype (the router losses as they
        come: float32); the float32 weights get float32 gradients.

        Raises: TypeError (not a torch tensor: numpy names ``torch.from_numpy``; a dtype the block does not take),
          ValueError (not ``[B, S, H]`` / ``[T, H]`` with the config's ``H``; ``seq_len`` without
          ``return_router_losses`` or not dividing the tokens); from :func:`moe_torch.moe_forward`.
        """
        require_torch_tensors("MoEBlock", dict(hidden_states=hidden_states))
        if torch.is_autocast_enabled(hidden_states.device.type):  # the experts are custom ops: autocast misses them
            check_dtype("MoEBlock", "hidden_states", hidden_states, FLOAT_DTYPES)

            def forward(h):
                return self.forward(h, return_router_losses=return_router_losses, seq_len=seq_len)

            return autocast_policy(hidden_states, self._autocast_dtype(), forward, return_router_losses)
        x = self._flat(hidden_states)
        if return_router_losses is True and seq_len is None and hidden_states.ndim == 3:
            seq_len = hidden_states.shape[1]
        check_router_loss_option("MoEBlock", self.config, x, return_router_losses, seq_len)  # x: the T of the logits
        ex, router = self.experts, self.router_module
        out = moe_forward(x, router(x), ex.w13, ex.w2, self._routed_config, w13_scale=ex.gate_up_proj_scale_inv,
                          w2_scale=ex.down_proj_scale_inv, w13_bias=ex.gate_up_proj_bias, w2_bias=ex.down_proj_bias,
                          e_score_correction_bias=router.e_score_correction_bias, implementation=self.implementation,
                          recompute=self.recompute, return_router_losses=return_router_losses, seq_len=seq_len)
        losses = None
        if return_router_losses:
            out, losses = out
        if "shared_expert_gate" in self._modules:  # Qwen3NextSparseMoeBlock: + sigmoid(gate(x)) * shared_expert(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif "shared_expert" in self._modules:  # Llama4TextMoe: shared_expert(x) + routed
            out = self.shared_expert(x) + out
        elif "shared_experts" in self._modules:  # DeepseekV3MoE / Glm4MoeMoE: routed + shared_experts(x)
            out = out + self.shared_experts(x)
        out = out.reshape(hidden_states.shape)
        return (out, losses) if return_router_losses else out

    def _autocast_dtype(self) -> torch.dtype | None:
        """The dtype the block computes in under ``torch.autocast``: its float experts' (``quant='none'``); an FP8
        block's, its shared MLP's (float), or ``None`` (the hidden states' own) without one."""
        if self.config.quant == "none":
            return self.experts.gate_up_proj.dtype
        shared = self._modules.get("shared_expert", self._modules.get("shared_experts"))
        return None if shared is None else shared.gate_proj.weight.dtype

    def _flat(self, hidden_states) -> torch.Tensor:
        op = "MoEBlock"
        require_torch_tensors(op, dict(hidden_states=hidden_states))
        H = self.config.hidden_size
        what = f"[B, S, H] or [T, H] with H={H}"
        check_rank(op, "hidden_states", hidden_states, (2, 3), what)
        check_shape(op, "hidden_states", hidden_states, (None,) * (hidden_states.ndim - 1) + (H,), what)
        check_dtype(op, "hidden_states", hidden_states, FLOAT_DTYPES)
        want = self.experts.gate_up_proj.dtype
        if self.config.quant == "none" and hidden_states.dtype != want:
            raise TypeError(f"{op}: hidden_states must have the experts' dtype {dtype_name(want)} (quant='none'); "
                            f"got hidden_states.dtype={dtype_name(hidden_states)}")
        return hidden_states.reshape(-1, H)

    def extra_repr(self) -> str:
        c = self.config
        return (f"H={c.hidden_size}, I={c.intermediate_size}, E={c.num_experts}, topk={c.topk}, routing={c.routing!r}, "
                f"S={c.num_fused_shared_experts}, quant={c.quant!r}, implementation={self.implementation!r}, "
                f"recompute={self.recompute}")
