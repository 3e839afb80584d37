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

``forward`` does nothing on the host but shape checks and launches (no ``.item()``, no
data-dependent shapes), so it can be captured in a CUDA graph with ``implementation="triton"``
(or ``None`` on CUDA tensors). With a ``process_group`` it runs the whole layer through
:mod:`moe_torch.ep` (``ep_mode="all_to_all"`` syncs with the host once per call).

Mirror: ``moe_pallas/module.py``.
"""

from __future__ import annotations


import torch

from moe_contract.config import MoEConfig
from moe_contract.inputs import draw_expert_biases, draw_preset_weights, draw_shared_expert_gate
from moe_contract.op_checks import check_select_experts
from moe_contract.presets import get_preset
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
from moe_torch.hf import block_layer_weights
from moe_torch.layer import LAYER_IMPLEMENTATIONS, local_weights, moe_forward, quantize_layer_weights
from moe_torch.ops.common import check_torch_tensors
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


class EPMoE(torch.nn.Module):
    """One MoE layer on EP rank ``config.ep_rank``: ``forward(x [T, H], router_logits [T, E]) -> [T, H]``.

    Args:
      config: the layer (:class:`moe_contract.MoEConfig`: routing, rsf, quant, EP rank).
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
      implementation: the backend of every stage (``None``, ``"reference"``, ``"triton"``), as
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
          dtype: the float weights' dtype (and the ``x`` dtype ``quant='none'`` then takes).
          device: default ``torch.get_default_device()``.
          implementation, process_group, ep_mode, trainable, recompute: as :class:`EPMoE`.
          config_overrides: :meth:`ModelPreset.config` fields (``quant``, ``ep_size``, ``ep_rank``,
            ``hidden_size``...).

        Drawing is on the host, one expert at a time, this rank's
        experts only (each expert has its own generator), one core (``make_layer_inputs`` draws on all
        cores, but holds the whole layer in float32): seconds for CPU-sized layers, a few minutes for all
        of DeepSeek-V3 on one rank (about 16 s per 10^9 values).

        Raises: ValueError (unknown preset, bad override values), TypeError (an unknown override name; dtype
          not float32 / bf16 / float16).
        """
        op = "EPMoE.from_preset"
        config = get_preset(name).config(**config_overrides)
        if not isinstance(dtype, torch.dtype) or dtype_name(dtype) not in FLOAT_DTYPES:
            raise TypeError(f"{op}: dtype must be a torch.dtype among {FLOAT_DTYPES}; got dtype={dtype!r}")
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
            ``apply_routed_scaling_factor_on_output``); the routing fields come from the block.

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

        Raises: TypeError for arrays that are not torch tensors (numpy: convert with ``torch.from_numpy``);
          ValueError / TypeError from :func:`moe_torch.moe_forward` (shapes, dtypes).
        """
        require_torch_tensors("EPMoE", dict(x=x, router_logits=router_logits))
        if self.config.quant == "none" and x.dtype != self.w13.dtype:
            raise TypeError(f"EPMoE: x must have the layer's dtype {dtype_name(self.w13)} (quant='none'); "
                            f"got x.dtype={dtype_name(x)}")
        shared_logits = self.shared_expert_gate_logits(x)
        if self.process_group is not None or self.ep_mode is not None:
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
                f"S={c.num_fused_shared_experts}, quant={c.quant!r}, ep={c.ep_rank}/{c.ep_size}, "
                + ("apply_router_weight_on_input=True, " if c.apply_router_weight_on_input else "")
                + ("shared_expert_gate=True, " if c.shared_expert_gate else "")
                + ("expert_bias=True, " if c.expert_bias else "")
                + f"implementation={self.implementation!r}, trainable={self.trainable}, recompute={self.recompute}"
                + ("" if self.process_group is None and self.ep_mode is None else f", ep_mode={self.ep_mode or 'replicated'!r}"))
