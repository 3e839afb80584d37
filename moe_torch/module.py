"""The MoE layer as a ``torch.nn.Module``: :class:`EPMoE` holds one EP rank's expert weights and
calls :func:`moe_torch.layer.moe_forward`.

State (all ``nn.Parameter(requires_grad=False)``: the Triton kernels have no backward, and
FP8 codes cannot require grad; as parameters they move with ``.to(device)``, show in
``named_parameters()`` and round-trip through ``state_dict``)::

    w13   [E_local, 2*I, H]  bf16 / float16 / float32 (quant='none') or float8_e4m3fn
    w2    [E_local, H, I]    same dtype rule
    w13_scale, w2_scale      float32 FP8 weight scales (None for quant='none'):
                             [E_local, N] per-channel (fp8_per_token) or
                             [E_local, ceil(N/128), ceil(K/128)] blocks (fp8_block)
    e_score_correction_bias  [E] float (routing='biased_grouped_topk' only, else None)

``forward`` does nothing on the host but shape checks and launches (no ``.item()``, no
data-dependent shapes), so it can be captured in a CUDA graph with ``implementation="triton"``
(or ``None`` on CUDA tensors). With a ``process_group`` it runs the whole layer through
:mod:`moe_torch.ep` (``ep_mode="all_to_all"`` syncs with the host once per call).

Mirror: ``moe_pallas/module.py``.
"""

from __future__ import annotations


import torch

from moe_contract.config import MoEConfig
from moe_contract.inputs import draw_preset_weights
from moe_contract.op_checks import check_select_experts
from moe_contract.presets import get_preset
from moe_contract.validation import (
    FLOAT_DTYPES,
    check_choice,
    check_config,
    check_dtype,
    check_layer_inputs,
    check_layer_weights,
    check_shape,
    dtype_name,
)
from moe_torch.ep import EP_MODES, ep_moe_forward
from moe_torch.layer import LAYER_IMPLEMENTATIONS, WEIGHT_LAYOUT, local_weights, moe_forward
from moe_torch.ops.common import check_torch_tensors
from moe_torch.ops.dispatch import check_implementation
from moe_torch.ops.quant.api import quantize_weight_fp8

#: Experts quantized at a time by :meth:`EPMoE.from_float` / :meth:`EPMoE.from_preset`: bounds the
#: float32 temporaries of the quantization at full model size (the result is the same, since every
#: scale layout is per expert).
QUANT_CHUNK_EXPERTS = 16


def check_module_weights(
    op: str,
    config: MoEConfig,
    w13,
    w2,
    w13_scale,
    w2_scale,
    e_score_correction_bias,
) -> None:
    """The weights of one EP rank against ``config``, with the layer's own rules and messages.

    ``quant='none'``: ``w13``, ``w2`` float (one dtype), no scales. FP8: float8_e4m3fn codes with
    the scale layout of the quant mode. ``e_score_correction_bias`` ``[E]`` float exactly when
    ``routing='biased_grouped_topk'``. All tensors on ``w13``'s device.

    Raises: TypeError (not a MoEConfig, not tensors, dtypes), ValueError (shapes, missing or
      unexpected scales or bias, devices).
    """
    check_config(op, config)
    if config.quant == "none":
        check_layer_weights(op, config, w13, w2)
        x_dtype = w13.dtype
    else:
        x_dtype = torch.bfloat16
    # Shape-only stand-ins for x and router_logits (the checks read .shape and .dtype only).
    x = torch.empty((0, config.hidden_size), dtype=x_dtype, device="meta")
    logits = torch.empty((0, config.num_experts), dtype=torch.float32, device="meta")
    check_layer_inputs(op, config, x, logits, w13, w2, w13_scale, w2_scale)
    check_select_experts(
        op,
        logits,
        **config.gate_kwargs(),
        e_score_correction_bias=e_score_correction_bias,
    )
    named = (("w2", w2), ("w13_scale", w13_scale), ("w2_scale", w2_scale), ("e_score_correction_bias", e_score_correction_bias))
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


def quantize_chunked(w: torch.Tensor, config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E_local, N, K]`` float -> ``(q float8_e4m3fn, scale float32)`` in ``config.quant``'s
    weight layout, :data:`QUANT_CHUNK_EXPERTS` experts at a time (bit-identical to one call)."""
    layout = WEIGHT_LAYOUT[config.quant]
    parts = [quantize_weight_fp8(w[i : i + QUANT_CHUNK_EXPERTS], layout) for i in range(0, w.shape[0], QUANT_CHUNK_EXPERTS)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])




def _param(t: torch.Tensor | None) -> torch.nn.Parameter | None:
    return None if t is None else torch.nn.Parameter(t, requires_grad=False)


class EPMoE(torch.nn.Module):
    """One MoE layer on EP rank ``config.ep_rank``: ``forward(x [T, H], router_logits [T, E]) -> [T, H]``.

    Args:
      config: the layer (:class:`moe_contract.MoEConfig`: routing, rsf, quant, EP rank).
      w13: ``[E_local, 2*I, H]`` this rank's gate (rows ``:I``) and up projections: bf16 /
        float16 / float32 for ``quant='none'`` (then ``x`` must have this dtype), float8_e4m3fn
        otherwise.
      w2: ``[E_local, H, I]`` down projections, same dtype as ``w13``.
      w13_scale, w2_scale: float32 dequantization multipliers (``w ~= q * scale``), as
        :func:`moe_torch.quantize_layer_weights` makes them: ``[E_local, N]`` (``fp8_per_token``;
        ``[E_local]`` per-expert also taken) or ``[E_local, ceil(N/128), ceil(K/128)]``
        (``fp8_block``); ``None`` for ``quant='none'``.
      e_score_correction_bias: ``[E]`` float, for (and only for) ``routing='biased_grouped_topk'``.
      implementation: the backend of every stage (``None``, ``"reference"``, ``"triton"``), as
        :func:`moe_torch.moe_forward` takes it.
      process_group: ``None`` (default): ``forward`` returns this rank's partial sum and moves
        nothing. A ``torch.distributed`` group (or ``ep_mode`` given: the default group):
        ``forward`` is :func:`moe_torch.ep.ep_moe_forward` over it and returns the whole layer's
        output; ``config.ep_rank`` / ``ep_size`` must match the group.
      ep_mode: ``"replicated"`` (the default with a group: every rank the same ``x [T, H]``,
        all-reduce) or ``"all_to_all"`` (each rank its own tokens ``x [T_r, H]``, DeepEP-style
        dispatch / combine; a host sync per call, not CUDA-graph capturable).

    The tensors are held as given (no copy): ``load_state_dict`` writes into them.
    ``.to(device)`` moves everything; ``.to(dtype)`` / ``.half()`` also cast FP8 codes and scales
    (torch counts float8 as floating point), after which ``forward`` raises ``TypeError``.

    Raises: TypeError / ValueError from :func:`check_module_weights`, before anything is stored.

    Source: the layout of SGLang / vLLM ``FusedMoE`` (``w13_weight``, ``w2_weight``, FP8
    ``*_weight_scale(_inv)`` held as non-trainable parameters).
    """

    def __init__(
        self,
        config: MoEConfig,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
        e_score_correction_bias: torch.Tensor | None = None,
        implementation: str | None = None,
        process_group=None,
        ep_mode: str | None = None,
    ) -> None:
        super().__init__()
        op = "EPMoE"
        check_choice(op, "ep_mode", ep_mode, (None, *EP_MODES))
        check_torch_tensors(op, dict(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale,
                                     e_score_correction_bias=e_score_correction_bias), required=True)
        check_module_weights(op, config, w13, w2, w13_scale, w2_scale, e_score_correction_bias)
        check_implementation(op, implementation, LAYER_IMPLEMENTATIONS)
        self.config = config
        self.implementation = implementation
        self.process_group = process_group
        self.ep_mode = ep_mode
        self.w13 = _param(w13)
        self.w2 = _param(w2)
        self.register_parameter("w13_scale", _param(w13_scale))
        self.register_parameter("w2_scale", _param(w2_scale))
        self.register_parameter("e_score_correction_bias", _param(e_score_correction_bias))

    @classmethod
    def from_float(
        cls,
        config: MoEConfig,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        e_score_correction_bias: torch.Tensor | None = None,
        implementation: str | None = None,
        process_group=None,
        ep_mode: str | None = None,
    ) -> "EPMoE":
        """This rank's layer from float weights of every expert, quantized per ``config.quant``.

        Args:
          w13: ``[E + S, 2*I, H]`` float32 / bf16 / float16, every expert (fused shared experts last).
          w2: ``[E + S, H, I]`` float.
          e_score_correction_bias: ``[E]`` float (biased_grouped_topk only).

        Returns: an :class:`EPMoE` holding ``local_weights(w, config)``, FP8-quantized with the
        scale layout of ``config.quant`` (bit-identical to :func:`moe_torch.quantize_layer_weights`
        of the slice); for ``quant='none'`` the slices themselves (views, no copy).

        Raises: TypeError / ValueError naming the argument (global shapes, dtypes, bias).
        """
        op = "EPMoE.from_float"
        check_torch_tensors(op, dict(w13=w13, w2=w2, e_score_correction_bias=e_score_correction_bias), required=True)
        check_global_weights(op, config, w13, w2)
        w13, w2 = local_weights(w13, config), local_weights(w2, config)
        s13 = s2 = None
        if config.quant != "none":
            w13, s13 = quantize_chunked(w13, config)
            w2, s2 = quantize_chunked(w2, config)
        return cls(config, w13, w2, w13_scale=s13, w2_scale=s2, e_score_correction_bias=e_score_correction_bias,
                   implementation=implementation, process_group=process_group, ep_mode=ep_mode)

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
        **config_overrides,
    ) -> "EPMoE":
        """A layer of preset ``name`` with random weights, as the tests and benchmarks draw them.

        Args:
          name: a :data:`moe_contract.PRESETS` name (``"tiny"``, ``"deepseek-v3"``...).
          seed: the numpy seed: the weights are this rank's slice of
            ``make_layer_inputs(config, num_tokens=0, seed)`` (``~ N(0, 1/K)``, bias ``~ N(0, 0.01)``
            float32), cast to ``dtype`` (round to nearest even) and quantized per ``config.quant``;
            ``moe_pallas.MoELayer.from_preset`` with the same arguments holds the same bits.
          dtype: the float weights' dtype (and the ``x`` dtype ``quant='none'`` then takes).
          device: default ``torch.get_default_device()``.
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
            w13, s13 = quantize_chunked(w13, config)
            w2, s2 = quantize_chunked(w2, config)
        return cls(config, w13, w2, w13_scale=s13, w2_scale=s2, e_score_correction_bias=bias, implementation=implementation,
                   process_group=process_group, ep_mode=ep_mode)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` (float32 / bf16 / float16; ``w13``'s dtype for ``quant='none'``) and
        ``router_logits [T, E]`` float -> ``out [T, H]`` in ``x.dtype``: this rank's partial sum
        (the sum over EP ranks is the layer's output).

        No host synchronisation with ``implementation="triton"`` (CUDA-graph capturable after a
        warm-up call that compiles the kernels).

        With a ``process_group`` (or an ``ep_mode``): the layer's whole output, through
        :func:`moe_torch.ep.ep_moe_forward` (``x`` and the output are ``[T_r, H]``, this rank's
        tokens, under ``ep_mode="all_to_all"``).

        Raises: ValueError / TypeError from :func:`moe_torch.moe_forward` (shapes, dtypes).
        """
        if self.config.quant == "none" and isinstance(x, torch.Tensor) and x.dtype != self.w13.dtype:
            raise TypeError(f"EPMoE: x must have the layer's dtype {dtype_name(self.w13)} (quant='none'); "
                            f"got x.dtype={dtype_name(x)}")
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
                e_score_correction_bias=self.e_score_correction_bias,
                implementation=self.implementation,
            )
        return moe_forward(
            x,
            router_logits,
            self.w13,
            self.w2,
            self.config,
            w13_scale=self.w13_scale,
            w2_scale=self.w2_scale,
            e_score_correction_bias=self.e_score_correction_bias,
            implementation=self.implementation,
        )

    def extra_repr(self) -> str:
        c = self.config
        return (f"H={c.hidden_size}, I={c.intermediate_size}, E={c.num_experts}, topk={c.topk}, routing={c.routing!r}, "
                f"S={c.num_fused_shared_experts}, quant={c.quant!r}, ep={c.ep_rank}/{c.ep_size}, "
                f"implementation={self.implementation!r}"
                + ("" if self.process_group is None and self.ep_mode is None else f", ep_mode={self.ep_mode or 'replicated'!r}"))
