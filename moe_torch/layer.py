"""The MoE layer in PyTorch: the stages of CONTRACT.md composed, one EP rank at a time.

Dataflow (``S`` fused shared experts, ``topk' = topk + S``, ``M_cap = T * topk'``)::

    router_logits [T, E] --select_experts--> topk_weights, topk_ids [T, topk']
    topk_ids --drop_over_capacity (config.capacity_factor; else unchanged)--> ids, dropped slots -1
    ids --routing_metadata--> expert_offsets [E_local+1], src2dst [T, topk'], dst2src [M_cap]
    x [T, H] --permute (+FP8 quant)--> [M_cap, H] --grouped_gemm w13 (+ w13_bias)--> [M_cap, 2I]
      --act_and_mul (+FP8 quant)--> [M_cap, I] --grouped_gemm w2 (+ w2_bias)--> [M_cap, H]
      --combine (x rsf unless the gate applied it)--> out [T, H]

Weights: float (``quant='none'``), FP8 codes with scales, or 4-bit packed codes with group scales
(``quant='mxfp4'`` / ``'int4'``, weight-only: the grouped GEMM decodes them, CONTRACT.md section 9).

Mirror: ``moe_pallas/layer.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import torch

from moe_contract.config import ACTIVATION_QUANT, W4_QUANTS, WEIGHT_LAYOUT, MoEConfig
from moe_contract.op_checks import check_router_loss_option
from moe_contract.w4_layout import check_mma_layout_scales
from moe_contract.validation import (check_expert_biases, check_layer_inputs, check_layer_weights, check_positive_int,
                                      check_shared_expert_gate_logits, stage_implementation)
from moe_torch.capacity import drop_over_capacity
from moe_torch.ops.activation import api as activation_api
from moe_torch.ops.activation.api import act_and_mul, act_and_mul_backward
from moe_torch.ops.combine import api as combine_api
from moe_torch.ops.combine.api import combine, scale_rows
from moe_torch.ops.common import first_order_backward, takes_torch_tensors
from moe_torch.ops.custom_ops import moe_layer, register_layer_function
from moe_torch.ops.dispatch import check_implementation
from moe_torch.ops.gate import api as gate_api
from moe_torch.ops.gate.api import select_experts, select_experts_backward
from moe_torch.ops.gate.losses import RouterLosses, router_losses
from moe_torch.ops.grouped_gemm import api as grouped_gemm_api
from moe_torch.ops.grouped_gemm.api import grouped_gemm, grouped_gemm_dbias, grouped_gemm_dgrad, grouped_gemm_wgrad
from moe_torch.ops.permute import api as permute_api
from moe_torch.ops.permute.api import RoutingMetadata, permute, permute_backward, routing_metadata
from moe_torch.ops.quant.api import (QUANT_CHUNK_BYTES, dequantize_fp8, mxfp4_to_mma_layout, quantize_weight_fp8,
                                     quantize_weight_int4, quantize_weight_mxfp4)
from moe_torch.ops.quant.reference import dequantize_weight_4bit_reference
from moe_torch.slot_weights import scaled_slot_rows, scaled_slot_rows_backward, slot_weights, slot_weights_backward

#: The forward GEMMs' choices: the stage's backends and the grouped GEMM's kernel names (``gluon_bf16``, ...,
#: ``triton_pointer``; ``moe_torch.ops.grouped_gemm.kernels``). A layer asked for a kernel runs its forward GEMMs on
#: it and every other stage, and the backward's GEMMs, on their defaults (as ``pallas_mosaic_gpu`` in ``moe_pallas``).
_GEMM_FORWARD = SimpleNamespace(IMPLEMENTATIONS=grouped_gemm_api.FORWARD_IMPLEMENTATIONS)

#: Every backend name any stage knows (a stage without the chosen one uses its default).
LAYER_IMPLEMENTATIONS = tuple(dict.fromkeys(
    name for stage in (gate_api, permute_api, _GEMM_FORWARD, activation_api, combine_api) for name in stage.IMPLEMENTATIONS
))


@takes_torch_tensors
def moe_forward(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    config: MoEConfig,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    shared_expert_gate_logits: torch.Tensor | None = None,
    implementation: str | None = None,
    recompute: bool = False,
    return_router_losses: bool = False,
    seq_len: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, RouterLosses]:
    """One MoE layer on this EP rank (``config.ep_rank``): ``[T, H] -> [T, H]``, differentiable.

    Args:
      x: ``[T, H]`` float32 / bf16 / float16.
      router_logits: ``[T, E]`` float (the gate's linear layer output).
      w13: ``[E_local, 2*I, H]`` this rank's gate and up projections (rows ``:I`` and ``I:``, or with
        ``config.gate_up_layout="interleaved"`` rows ``0::2`` and ``1::2``), ``x.dtype`` for ``quant='none'``,
        float8_e4m3fn for the FP8 modes; ``quant='mxfp4'`` / ``'int4'``: packed 4-bit codes
        ``[E_local, 2*I, H // 2]`` uint8 (CONTRACT.md section 9).
      w2: ``[E_local, H, I]`` down projections, same dtype rule (4-bit: ``[E_local, H, I // 2]`` uint8).
      config: the layer (routing, rsf placement, activation and gate/up layout, expert biases, quant, EP, capacity).
      w13_scale, w2_scale: the weight scales (see :func:`quantize_layer_weights`): FP8 float32; 4-bit
        ``[E_local, 2*I, H // 32]`` / ``[E_local, H, I // 32]``, uint8 e8m0 (mxfp4) or bf16 (int4).
      w13_bias, w2_bias: ``[E_local, 2*I]`` / ``[E_local, H]`` float32, bf16 or ``x.dtype``, exactly when
        ``config.expert_bias`` (gpt-oss's ``gate_up_proj_bias`` / ``down_proj_bias``, this rank's rows, the
        fused shared experts' included): GEMM 1 computes ``h = xp @ w13[e].T + w13_bias[e]`` and GEMM 2
        ``y = a @ w2[e].T + w2_bias[e]``, each bias added to the float32 accumulator before the rounding
        (CONTRACT.md section 4); the combine weights the whole ``y``, bias included, as transformers'
        ``GptOssExperts`` (``(a @ down_proj + down_proj_bias) * routing_weight``; section 5).
      e_score_correction_bias: ``[E]`` float, for ``routing='biased_grouped_topk'``.
      shared_expert_gate_logits: ``[T, S]`` float32 or ``x.dtype``, exactly when ``config.shared_expert_gate``
        (Qwen3-Next: ``x @ shared_expert_gate.weight.T``, as ``router_logits`` from outside): fused shared
        slot ``E + i`` of token ``t`` gets weight ``sigmoid(logit[t, i])`` (CONTRACT.md section 1), so the
        layer is ``routed sum + sigmoid(gate) * shared`` as transformers' ``Qwen3NextSparseMoeBlock``.
        With ``config.apply_router_weight_on_input`` (Llama 4) the routed weights scale each slot's expert
        input instead of its output (sections 2, 5; :mod:`moe_torch.slot_weights`: the scaling is a torch
        op before the permute kernel, not fused).
      implementation: ``"reference"`` or ``"triton"``, used by every stage that has it (forward and
        backward); a stage without it uses its default (``None``). ``None``: every stage's default. Or one of
        the grouped GEMM's kernel names (``moe_torch.ops.grouped_gemm.kernels.NAMES``: ``"gluon_fp8_block"``,
        ``"gluon_fp8_rowwise"``, ``"gluon_bf16"``, ``"triton_tma"``, ``"triton_pointer"``): the forward GEMMs
        run on that kernel (``NotImplementedError`` naming the device and the reason where it cannot serve them,
        before its launch), every other stage and the backward's GEMMs on their defaults.
      recompute: what the forward keeps for the backward (only when a gradient can be asked for:
        grad mode on and an input that requires grad). ``False``: the routing (``topk_weights``,
        ``topk_ids``, ``expert_offsets``, ``src2dst``, ``dst2src``) and GEMM 1's output ``h``;
        ``a = act(g) * u`` is recomputed from ``h``. ``True``: the routing only; the backward
        re-permutes ``x`` and recomputes ``h`` (one more GEMM 1) and ``a``.
      return_router_losses: also return the router's training losses of this call (CONTRACT.md section 10):
        :func:`moe_torch.ops.gate.losses.router_losses` of ``router_logits`` and the gate's own ``topk_ids``
        (no second gate), differentiable in ``router_logits`` by autograd beside the layer's backward. Every EP
        rank holds all ``T`` tokens' logits, so every rank gets the same, global losses.
      seq_len: with ``return_router_losses``, the tokens of one sequence (dividing ``T``) for ``seq_aux_loss``;
        ``None``: no ``seq_aux_loss``.

    Activation memory kept per token (``k' = topk + S`` slots, ``b`` bytes of ``x.dtype``), besides
    ``x`` and ``router_logits`` which autograd holds anyway: ``recompute=False``:
    ``k' * (2*I*b + 16)`` bytes (DeepSeek-V3, bf16: 9 * (8192 + 16) = 73.9 KB); ``recompute=True``:
    ``16 * k'`` bytes (144 B). The permuted input ``xp`` and GEMM 2's output ``y`` are never kept: the
    routing-weight gradient uses ``<y[m], d_out[t]> = <a[m], d_out[t] @ w2[e]>`` (SonicMoE,
    arXiv 2512.14080, section 3), so the combine's backward needs no ``y``.

    Capacity (``config.capacity_factor``, CONTRACT.md section 2, "Capacity";
    :func:`moe_torch.capacity.drop_over_capacity`): each routed expert takes its first
    ``C = ceil(c * T * topk / E)`` slots in token order. A dropped slot is skipped by every stage as a
    non-local one is: its expert output is left out (the kept weights are not renormalized), it gives no
    gradient to the expert weights, their biases or ``x``, and its ``d_topk_weights`` is 0, so the router
    logits get gradient through the kept slots' weights only (a softmax or renormalization still couples
    those to the dropped expert's logit). Fused shared experts are never dropped. ``C`` counts this call's
    ``T`` tokens: every EP rank sees them all, so the capacity is per expert, globally.

    Gradients (CONTRACT.md section 8): ``x``, ``router_logits`` (through ``topk_weights`` only),
    ``shared_expert_gate_logits``, float ``w13`` / ``w2`` (``[E_local, ...]``, this rank's slice), ``w13_bias``
    / ``w2_bias`` (``grouped_gemm_dbias`` of ``d_h`` / of the weighted ``d_y``), each accumulated in float32 and
    returned in its input's dtype. FP8 and 4-bit layers: the backward is straight-through (quantization has
    gradient identity) on the dequantized weights in ``x.dtype`` (4-bit: each weight dequantized whole,
    ``[E_local, N, K]`` of ``x.dtype``, around its dgrad only); weight codes, weight scales and
    ``e_score_correction_bias`` get no gradient (the expert biases do).

    Returns: ``out [T, H]`` in ``x.dtype``: this rank's partial sum; the sum over EP ranks is
    the layer's output (CONTRACT.md section 6). With ``return_router_losses``: ``(out, RouterLosses)``
    (``aux_loss``, ``seq_aux_loss`` (``None`` without ``seq_len``), ``z_loss``: ``[]`` float32, unscaled;
    ``tokens_per_expert [E]`` int32).

    Raises: ValueError / TypeError naming the argument, before any computation (``seq_len`` not dividing ``T``, or
      given without ``return_router_losses``, included); RuntimeError from the backward
      when it runs with ``create_graph=True`` (second-order gradients are not supported, CONTRACT.md section 8).
    """
    op = "moe_forward"
    check_layer_inputs(op, config, x, router_logits, w13, w2, w13_scale, w2_scale)
    check_expert_biases(op, config, x, w13_bias, w2_bias)
    check_shared_expert_gate_logits(op, config, x, shared_expert_gate_logits)
    check_implementation(op, implementation, LAYER_IMPLEMENTATIONS)
    if not isinstance(recompute, bool):
        raise TypeError(f"{op}: recompute must be a bool; got {type(recompute).__name__} {recompute!r}")
    check_router_loss_option(op, config, router_logits, return_router_losses, seq_len)
    # _MoELayerFunction's forward and backward, each as one custom op (ops/custom_ops.py): no graph break under
    # torch.compile, torch.func.grad / vjp through setup_context
    out, topk_ids = moe_layer(x, router_logits, w13, w2, w13_scale, w2_scale, e_score_correction_bias,
                              shared_expert_gate_logits, w13_bias, w2_bias, config, implementation, recompute)
    if not return_router_losses:
        return out
    # From the caller's router_logits, outside the layer's Function: autograd differentiates the losses itself.
    return out, router_losses(router_logits, topk_ids, config, seq_len=seq_len)


# The stages of moe_forward, also composed differently by the EP layers (``ep.py``).


def run_gate(router_logits, config: MoEConfig, e_score_correction_bias, implementation: str | None):
    """``select_experts`` with the layer's routing settings: ``(topk_weights, topk_ids) [T, topk']``."""
    return select_experts(router_logits, **config.gate_kwargs(), e_score_correction_bias=e_score_correction_bias,
                          implementation=stage_implementation(implementation, gate_api))


def dispatch_ids(topk_ids, config: MoEConfig, implementation: str | None):
    """The gate's ``topk_ids [T, topk']`` as the experts see them: with ``config.capacity_factor``, the routed slots
    over their expert's capacity set to ``-1`` (non-local on every rank: skipped by every stage;
    :func:`moe_torch.capacity.drop_over_capacity`), else ``topk_ids`` itself."""
    return drop_over_capacity(topk_ids, config, implementation=stage_implementation(implementation, permute_api))


def run_experts(x, topk_ids, w13, w2, w13_scale, w2_scale, config: MoEConfig, implementation: str | None, *,
                num_experts: int, expert_start: int, num_local_experts: int, return_h: bool = False, input_scale=None,
                w13_bias=None, w2_bias=None):
    """The expert stages on the assignments of ``topk_ids [R, k]`` (ids in ``[0, num_experts)``;
    ``[expert_start, expert_start + num_local_experts)`` are the local experts of ``w13``/``w2``):
    routing metadata, permute (+FP8 quant), GEMM 1 (+ ``w13_bias``), act_and_mul (+FP8 quant), GEMM 2
    (+ ``w2_bias``); 4-bit weights (``config.quant`` mxfp4 / int4) go to the grouped GEMM as its ``w_format``.
    ``input_scale [R, k]`` float32 (``apply_router_weight_on_input``, :func:`moe_torch.slot_weights.slot_weights`):
    slot ``(r, j)``'s expert input is ``x[r] * input_scale[r, j]`` (rounded once to ``x.dtype``).

    Returns ``(y [R*k, H] x.dtype in permuted order, RoutingMetadata)`` (and GEMM 1's output
    ``h [R*k, 2I]`` with ``return_h``); rows ``>= M`` are never read."""
    meta = routing_metadata(topk_ids, num_experts, expert_start=expert_start, num_local_experts=num_local_experts,
                            implementation=stage_implementation(implementation, permute_api))
    h = _gemm1(x, meta, topk_ids.shape[1], w13, w13_scale, config, implementation, input_scale, w13_bias)
    a, a_scale = _act(h, config, implementation)
    y = grouped_gemm(a, w2, meta.expert_offsets, x_scale=a_scale, w_scale=w2_scale, out_dtype=x.dtype,
                     implementation=stage_implementation(implementation, _GEMM_FORWARD),
                     w_format=w_format(config), bias=w2_bias)
    return (y, meta, h) if return_h else (y, meta)


def w_format(config: MoEConfig) -> str | None:
    """The grouped GEMM's ``w_format`` of the layer's weights (``MoEConfig.w_format``): the 4-bit modes' format
    (``"mxfp4_mma"`` for MMA-layout codes), else ``None``."""
    return config.w_format


def _expert_rows(x, k: int, input_scale):
    """What the permute gathers from: ``(x [R, H], k)``, or with an ``input_scale [R, k]`` the scaled slot
    rows ``(x[r] * input_scale[r, j] [R*k, H], 1)`` (:func:`moe_torch.slot_weights.scaled_slot_rows`; not
    fused into the permute kernel)."""
    return (x, k) if input_scale is None else (scaled_slot_rows(x, input_scale), 1)


def _gemm1(x, meta, k: int, w13, w13_scale, config: MoEConfig, implementation, input_scale=None, w13_bias=None):
    """permute (+FP8 quant) and GEMM 1 (+ ``w13_bias``): ``h [M_cap, 2I]`` in ``x.dtype``."""
    x, k = _expert_rows(x, k, input_scale)
    xq, x_scale = permute(x, meta.dst2src, topk=k, quant=ACTIVATION_QUANT[config.quant],
                          implementation=stage_implementation(implementation, permute_api))
    return grouped_gemm(xq, w13, meta.expert_offsets, x_scale=x_scale, w_scale=w13_scale, out_dtype=x.dtype,
                        implementation=stage_implementation(implementation, _GEMM_FORWARD),
                        w_format=w_format(config), bias=w13_bias)


def _act(h, config: MoEConfig, implementation):
    """act_and_mul (+FP8 quant): ``(a [M_cap, I], a_scale or None)``."""
    return act_and_mul(h, activation=config.activation, layout=config.gate_up_layout,
                       quant=ACTIVATION_QUANT[config.quant], implementation=stage_implementation(implementation, activation_api))


class _MoELayerFunction(torch.autograd.Function):
    """:func:`moe_forward` with the backward of CONTRACT.md section 8, built from the stages' backward
    ops (each with the layer's ``implementation``). Forward: the stages as in :func:`moe_forward`,
    keeping the routing and ``h`` (``recompute=False``) or the routing only. Backward, ``c`` the
    combine's rsf (1 when the gate applied it), ``w_row[m] = c * topk_weights`` of row ``m``'s slot::

        d_y0 = permute(d_out)                          gathered d_out rows [M_cap, H] (unscaled)
        d_a0 = grouped_gemm_dgrad(d_y0, w2)            float32 [M_cap, I]   (d_out[t] @ w2[e])
        d_topk_weights[t, j] = c * <y[m], d_out[t]>    m = src2dst[t, j]; 0 if non-local, where
                             = c * (<a[m], d_a0[m]> + <w2_bias[e], d_y0[m]>)   (the bias term with expert_bias)
        d_a = w_row * d_a0;  d_w2 = grouped_gemm_wgrad(w_row * a, d_y0)   (= wgrad(a, w_row * d_y0): the
                                                       weights go on the narrower operand, [M_cap, I] not [M_cap, H])
        d_w2_bias = grouped_gemm_dbias(w_row * d_y0)
        d_h = act_and_mul_backward(h, d_a);  d_w13_bias = grouped_gemm_dbias(d_h)
        d_xp = grouped_gemm_dgrad(d_h, w13);  d_w13 = grouped_gemm_wgrad(permute(x), d_h)
        d_x = permute_backward(d_xp);  d_router_logits = select_experts_backward(d_topk_weights)

    FP8 layers: ``a`` is its dequantized codes (what GEMM 2 consumed), the dgrads dequantize the weight
    codes to ``x.dtype`` (straight-through), and no weight gradient is formed (frozen codes). 4-bit layers
    (weight-only): the dgrads run on the weights dequantized to ``x.dtype`` (each alive only around its dgrad),
    no weight gradient either. The expert biases get theirs with every kind of weights.

    The 2026 families (:mod:`moe_torch.slot_weights`): the combine takes ``combine_weights`` and the
    permute the scaled slot rows (``apply_router_weight_on_input``), whose backward gives ``d_x`` and
    ``d_input_scale[t, j] = <x[t], d_xp[src2dst[t, j]]>``; :func:`slot_weights_backward` turns the two
    into ``d_topk_weights`` and ``d_shared_expert_gate_logits``.
    ``out_dtype`` is the combine's output dtype (``None``: ``x.dtype``; the EP replicated mode's float32 partial).
    Run by the custom ops ``epmoe::moe_layer`` / ``epmoe::moe_layer_backward`` (``ops/custom_ops.py``) with a
    stand-in context: what they save and return follows ``save_for_backward`` here (``custom_ops.SAVED``).
    Mirror: ``moe_pallas/layer.py`` (``jax.custom_vjp``).
    """

    @staticmethod
    def forward(ctx, x, router_logits, w13, w2, w13_scale, w2_scale, bias, shared_logits, w13_bias, w2_bias, config,
                implementation, recompute, out_dtype=None):
        topk_weights, topk_ids = run_gate(router_logits, config, bias, implementation)
        combine_weights, input_scale = slot_weights(topk_weights, shared_logits, config)
        expert_start, e_local = config.local_expert_range()
        # the gate's backward takes the gate's own ids (saved below); the experts see the capacity's
        y, meta, h = run_experts(x, dispatch_ids(topk_ids, config, implementation), w13, w2, w13_scale, w2_scale,
                                 config, implementation, num_experts=config.num_total_experts,
                                 expert_start=expert_start, num_local_experts=e_local, return_h=True,
                                 input_scale=input_scale, w13_bias=w13_bias, w2_bias=w2_bias)
        out = combine(y, meta.src2dst, combine_weights, routed_scaling_factor=config.combine_routed_scaling_factor,
                      out_dtype=out_dtype or x.dtype, implementation=stage_implementation(implementation, combine_api))
        ctx.save_for_backward(x, router_logits, w13, w2, w13_scale, w2_scale, bias, shared_logits, w13_bias, w2_bias,
                              topk_weights, topk_ids, meta.expert_offsets, meta.src2dst, meta.dst2src,
                              None if recompute else h)
        ctx.config, ctx.implementation, ctx.recompute = config, implementation, recompute
        ctx.mark_non_differentiable(topk_ids)
        return out, topk_ids  # the ids for the router losses (moe_forward's return_router_losses)

    @staticmethod
    @first_order_backward("moe_forward")
    def backward(ctx, d_out, d_topk_ids):  # d_topk_ids: integer output, no gradient
        (x, router_logits, w13, w2, w13_scale, w2_scale, bias, shared_logits, w13_bias, w2_bias, topk_weights, topk_ids,
         offsets, src2dst, dst2src, h) = ctx.saved_tensors
        config, impl = ctx.config, ctx.implementation
        need_x, need_logits, need_w13, need_w2 = ctx.needs_input_grad[:4]
        need_shared, need_b13, need_b2 = ctx.needs_input_grad[7:10]
        combine_weights, input_scale = slot_weights(topk_weights, shared_logits, config)
        g = experts_backward(
            d_out, x, w13, w2, w13_scale, w2_scale, combine_weights, topk_ids.shape[1],
            RoutingMetadata(offsets, src2dst, dst2src), h, config, impl, config.combine_routed_scaling_factor,
            need_x, need_w13, need_w2, input_scale=input_scale, w13_bias=w13_bias, w2_bias=w2_bias,
            need_w13_bias=need_b13, need_w2_bias=need_b2)
        d_topk_weights, d_shared = slot_weights_backward(topk_weights, shared_logits, g.d_topk_weights,
                                                         g.d_input_scale, config)
        d_logits = None
        if need_logits:
            d_logits = select_experts_backward(
                router_logits, topk_ids, d_topk_weights, **config.gate_kwargs(), e_score_correction_bias=bias,
                implementation=stage_implementation(impl, gate_api)).to(router_logits.dtype)
        d_shared = d_shared.to(shared_logits.dtype) if need_shared else None
        return (g.d_x, d_logits, g.d_w13, g.d_w2, None, None, None, d_shared, g.d_w13_bias, g.d_w2_bias, None, None,
                None, None)


register_layer_function(_MoELayerFunction)


class ExpertGrads(NamedTuple):
    """What :func:`experts_backward` returns (``None`` where not asked for, or frozen)."""

    d_x: torch.Tensor | None
    d_topk_weights: torch.Tensor
    d_w13: torch.Tensor | None
    d_w2: torch.Tensor | None
    d_input_scale: torch.Tensor | None
    d_w13_bias: torch.Tensor | None
    d_w2_bias: torch.Tensor | None


def dgrad_weight(w, w_scale, config: MoEConfig, dtype):
    """The ``(w, w_scale)`` the straight-through dgrad reads: float and FP8 weights as they are (the FP8 dgrad
    dequantizes its codes itself); 4-bit codes dequantized in float32 and rounded to ``dtype`` (CONTRACT.md
    section 9: ``d_x = d_y @ wd[e]``, ``wd`` in ``d_y``'s dtype), ``[E_local, N, K]`` while the caller holds it."""
    if config.quant not in W4_QUANTS:
        return w, w_scale
    return dequantize_weight_4bit_reference(w, w_scale, config.w_format, dtype), None


def _bias_dots(d_y0, w2_bias, offsets):
    """``<w2_bias[e(m)], d_y0[m]>`` per permuted row ``m`` (float32 ``[M_cap]``; rows ``>= M``: not meaningful, never
    read): the bias part of ``<y[m], d_out[t]>``. The expert of each row from ``offsets`` (a search, no host sync);
    one ``[M_cap, H]`` float32 gather of the bias rows lives while it runs."""
    rows = torch.arange(d_y0.shape[0], device=d_y0.device, dtype=offsets.dtype)
    expert = torch.searchsorted(offsets[1:].contiguous(), rows, right=True).clamp(max=offsets.shape[0] - 2)
    return (d_y0.float() * w2_bias.float()[expert]).sum(dim=1)


def experts_backward(d_out, x, w13, w2, w13_scale, w2_scale, topk_weights, k: int, meta: RoutingMetadata, h,
                      config: MoEConfig, impl, c: float, need_x: bool, need_w13: bool, need_w2: bool, *,
                      input_scale=None, w13_bias=None, w2_bias=None, need_w13_bias: bool = False,
                      need_w2_bias: bool = False) -> ExpertGrads:
    """The backward of the expert stages and the combine (CONTRACT.md section 8; the formulas in
    :class:`_MoELayerFunction`), shared by it and :class:`_RoutedExpertsFunction`: :class:`ExpertGrads`, ``None``
    where not asked for (FP8 and 4-bit weights: always ``None``, frozen codes). ``topk_weights`` are the combine's
    weights; ``input_scale [R, k]`` float32 or ``None``: the expert inputs' scale (``apply_router_weight_on_input``),
    whose gradient ``d_input_scale[r, j] = <x[r], d_xp[src2dst[r, j]]>`` (float32) is then formed (else ``None``).
    ``w13_bias`` / ``w2_bias``: the GEMMs' biases (``config.expert_bias``) or ``None``; their gradients are
    ``grouped_gemm_dbias`` of ``d_h`` and of ``d_y = w_row * d_y0`` (float32), in each bias's dtype. ``h`` is GEMM
    1's output, or ``None`` (recomputed here); ``c`` the combine's scaling factor."""
    offsets, src2dst, dst2src = meta.expert_offsets, meta.src2dst, meta.dst2src
    frozen = config.quant != "none"
    need_w13, need_w2 = need_w13 and not frozen, need_w2 and not frozen  # FP8 / 4-bit codes are frozen
    need_w13_bias, need_w2_bias = need_w13_bias and w13_bias is not None, need_w2_bias and w2_bias is not None
    gemm = stage_implementation(impl, grouped_gemm_api)
    perm = stage_implementation(impl, permute_api)
    T = topk_weights.shape[0]
    dtype = x.dtype
    if h is None:  # recompute=True: one more GEMM 1
        h = _gemm1(x, meta, k, w13, w13_scale, config, impl, input_scale, w13_bias)
    a, a_scale = _act(h, config, impl)
    a = dequantize_fp8(a, a_scale).to(dtype) if a_scale is not None else a  # what GEMM 2 consumed, in x.dtype
    d_y0, _ = permute(d_out.to(dtype).contiguous(), dst2src, topk=k, implementation=perm)
    w2_d, s2_d = dgrad_weight(w2, w2_scale, config, dtype)
    d_a0 = grouped_gemm_dgrad(d_y0, w2_d, offsets, w_scale=s2_d, out_dtype=torch.float32, implementation=gemm)
    del w2_d, s2_d
    live = dst2src >= 0
    w_row = torch.where(live, topk_weights.reshape(-1)[dst2src.clamp(min=0).long()] * c, 0.0)  # [M_cap] float32
    # one pass over d_a0: d_a = w_row * d_a0 (float32 math, one rounding) and the row dots <a[m], d_out[t] @ w2[e]>
    combine_impl = stage_implementation(impl, combine_api)
    # (and w_row * a for the w2 wgrad: d_w2 = (w_row * d_y0)^T a = d_y0^T (w_row * a), a pass over [M, I], not [M, H])
    d_a, dots, a_w = scale_rows(d_a0, w_row, out_dtype=dtype, dot_with=a, scale_dot_with=need_w2,
                                implementation=combine_impl)
    if w2_bias is not None:  # y = a @ w2.T + b2: <y[m], d_out[t]> has the bias's part too
        dots = dots + _bias_dots(d_y0, w2_bias, offsets)
    d_topk_weights = torch.where(src2dst >= 0, c * dots[src2dst.clamp(min=0).long()], 0.0)
    del d_a0, dots  # intermediates go as soon as they are used: the backward's peak is the wgrads'
    d_w2 = d_w2_bias = None
    if need_w2 or need_w2_bias:  # float32 accumulation in the kernels, stored once in the weight's / bias's dtype
        if need_w2_bias:
            d_y = w_row[:, None] * d_y0.float()
            d_w2_bias = grouped_gemm_dbias(d_y, offsets, out_dtype=w2_bias.dtype, implementation=gemm)
            del d_y
        if need_w2:  # (no float32 [E, H, I]); the weights on a, rounded once by scale_rows
            d_w2 = grouped_gemm_wgrad(a_w, d_y0, offsets, out_dtype=w2.dtype, implementation=gemm)
    del a, a_w, d_y0
    d_h = act_and_mul_backward(h, d_a, activation=config.activation, layout=config.gate_up_layout, out_dtype=dtype,
                               implementation=stage_implementation(impl, activation_api))
    del h, d_a
    d_w13_bias = grouped_gemm_dbias(d_h, offsets, out_dtype=w13_bias.dtype, implementation=gemm) if need_w13_bias \
        else None
    d_x = d_w13 = d_input_scale = None
    if need_x or input_scale is not None:
        w13_d, s13_d = dgrad_weight(w13, w13_scale, config, dtype)
        d_xp = grouped_gemm_dgrad(d_h, w13_d, offsets, w_scale=s13_d, out_dtype=dtype, implementation=gemm)
        del w13_d, s13_d
        if input_scale is None:
            d_x = permute_backward(d_xp, src2dst, num_tokens=T, out_dtype=dtype, implementation=perm)
        else:  # the scaled slot rows: each slot's row gradient (float32), then their chain rule (slot_weights.py)
            d_rows = permute_backward(d_xp, src2dst.reshape(-1, 1), num_tokens=src2dst.numel(), out_dtype=torch.float32,
                                      implementation=perm)
            d_x, d_input_scale = scaled_slot_rows_backward(x, input_scale, d_rows)
            d_x = d_x.to(dtype) if need_x else None
            del d_rows
        del d_xp
    if need_w13:
        x_rows, k_rows = _expert_rows(x, k, input_scale)
        xp, _ = permute(x_rows, dst2src, topk=k_rows, implementation=perm)
        d_w13 = grouped_gemm_wgrad(xp, d_h, offsets, out_dtype=w13.dtype, implementation=gemm)
    return ExpertGrads(d_x, d_topk_weights, d_w13, d_w2, d_input_scale, d_w13_bias, d_w2_bias)


# The expert stages and the combine on a given routing, differentiable: what transformers' experts interface
# (``hf_experts.py``) runs on the routing its model computed.


def routed_experts(x, topk_weights, topk_ids, w13, w2, config: MoEConfig, *, w13_scale=None, w2_scale=None,
                   implementation: str | None = None, num_experts: int, expert_start: int, num_local_experts: int,
                   routed_scaling_factor: float, out_dtype: torch.dtype, recompute: bool = False,
                   input_scale: torch.Tensor | None = None, w13_bias: torch.Tensor | None = None,
                   w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``combine(run_experts(x, topk_ids), topk_weights)``: the layer without its gate, for ``hf_experts.py``.

    ``x [R, H]``, ``topk_weights [R, k]`` float32, ``topk_ids [R, k]`` int32 in ``[0, num_experts)``
    (``[expert_start, expert_start + num_local_experts)`` are the experts of ``w13 [E_local, 2I, H]`` /
    ``w2 [E_local, H, I]`` (4-bit: packed codes), the others non-local), the combine's ``routed_scaling_factor``
    and ``out_dtype``. ``topk_weights`` are the combine's weights; ``input_scale [R, k]`` float32 (or ``None``)
    scales each slot's expert input (:func:`run_experts`); ``w13_bias [E_local, 2I]`` / ``w2_bias [E_local, H]``
    (``config.expert_bias``) the GEMMs' biases. Returns ``[R, H]`` in ``out_dtype``. Differentiable in ``x``,
    ``topk_weights``, ``input_scale``, float ``w13`` / ``w2`` and the biases with :func:`moe_forward`'s backward
    (the same stages' backward ops, FP8 / 4-bit straight-through, ``recompute`` as there); ``topk_ids`` and the
    scales get none. No argument checks: the caller validated the layer's inputs."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, topk_weights, w13, w2, input_scale, w13_bias, w2_bias)):
        return _RoutedExpertsFunction.apply(x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale, input_scale,
                                            w13_bias, w2_bias, config, implementation, recompute,
                                            (num_experts, expert_start, num_local_experts, routed_scaling_factor,
                                             out_dtype))
    y, meta = run_experts(x, topk_ids, w13, w2, w13_scale, w2_scale, config, implementation, num_experts=num_experts,
                          expert_start=expert_start, num_local_experts=num_local_experts, input_scale=input_scale,
                          w13_bias=w13_bias, w2_bias=w2_bias)
    return combine(y, meta.src2dst, topk_weights, routed_scaling_factor=routed_scaling_factor, out_dtype=out_dtype,
                   implementation=stage_implementation(implementation, combine_api))


class _RoutedExpertsFunction(torch.autograd.Function):
    """:func:`routed_experts` with :func:`experts_backward` (``d_topk_weights`` returned, not turned into
    ``d_router_logits``: the caller's gate has its own backward). Saves what :class:`_MoELayerFunction` saves."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale, input_scale, w13_bias, w2_bias, config,
                implementation, recompute, spec):
        num_experts, expert_start, num_local_experts, c, out_dtype = spec
        y, meta, h = run_experts(x, topk_ids, w13, w2, w13_scale, w2_scale, config, implementation,
                                 num_experts=num_experts, expert_start=expert_start,
                                 num_local_experts=num_local_experts, return_h=True, input_scale=input_scale,
                                 w13_bias=w13_bias, w2_bias=w2_bias)
        out = combine(y, meta.src2dst, topk_weights, routed_scaling_factor=c, out_dtype=out_dtype,
                      implementation=stage_implementation(implementation, combine_api))
        ctx.save_for_backward(x, w13, w2, w13_scale, w2_scale, topk_weights, input_scale, w13_bias, w2_bias,
                              meta.expert_offsets, meta.src2dst, meta.dst2src, None if recompute else h)
        ctx.config, ctx.implementation, ctx.c, ctx.k = config, implementation, c, topk_ids.shape[1]
        return out

    @staticmethod
    @first_order_backward("routed_experts")
    def backward(ctx, d_out):
        (x, w13, w2, w13_scale, w2_scale, topk_weights, input_scale, w13_bias, w2_bias, offsets, src2dst, dst2src,
         h) = ctx.saved_tensors
        need_x, need_weights, _, need_w13, need_w2 = ctx.needs_input_grad[:5]
        need_scale, need_b13, need_b2 = ctx.needs_input_grad[7:10]
        g = experts_backward(
            d_out, x, w13, w2, w13_scale, w2_scale, topk_weights, ctx.k, RoutingMetadata(offsets, src2dst, dst2src), h,
            ctx.config, ctx.implementation, ctx.c, need_x, need_w13, need_w2, input_scale=input_scale,
            w13_bias=w13_bias, w2_bias=w2_bias, need_w13_bias=need_b13, need_w2_bias=need_b2)
        return (g.d_x, g.d_topk_weights if need_weights else None, None, g.d_w13, g.d_w2, None, None,
                g.d_input_scale if need_scale else None, g.d_w13_bias, g.d_w2_bias, None, None, None, None)


@takes_torch_tensors
def quantize_layer_weights(
    w13: torch.Tensor, w2: torch.Tensor, config: MoEConfig, *, chunk_bytes: int = QUANT_CHUNK_BYTES
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Float weights -> ``(w13, w13_scale, w2, w2_scale)`` in the form ``config.quant`` takes.

    ``w13 [E, 2*I, H]``, ``w2 [E, H, I]`` float (``E`` the experts given: all ``E + S``, or one
    rank's ``E_local``). ``quant='none'``: unchanged, scales ``None``. ``'fp8_per_token'``:
    float8_e4m3fn codes with per-output-channel scales ``[E, N]`` float32. ``'fp8_block'``: 128x128
    block scales ``[E, ceil(N/128), ceil(K/128)]`` float32. ``'mxfp4'`` / ``'int4'`` (CONTRACT.md section 9,
    :func:`quantize_weight_mxfp4` / :func:`quantize_weight_int4`): packed codes ``[E, N, K // 2]`` uint8 with
    one scale per group of 32 along ``K``, ``[E, N, K // 32]`` uint8 e8m0 / bf16.

    Memory: each weight goes through its quantizer (``w13`` first, then ``w2``), a chunk at a time (of
    experts for FP8, of rows for 4-bit): beyond the weights and the results, the peak memory is at most one
    chunk's float32 copy (``chunk_bytes``, default 1 GiB, or one expert's / row's copy if that is larger)
    plus a few temporaries of the size of the chunk's scales.

    Raises: ValueError / TypeError (shapes, dtypes, ``chunk_bytes`` not an int >= 1; 4-bit: a non-finite
      weight).
    """
    check_layer_weights("quantize_layer_weights", config, w13, w2)
    check_positive_int("quantize_layer_weights", "chunk_bytes", chunk_bytes)
    if config.quant == "none":
        return w13, None, w2, None
    if config.quant in W4_QUANTS:
        quantize = quantize_weight_mxfp4 if config.quant == "mxfp4" else quantize_weight_int4
        w13_q, w13_scale = quantize(w13, chunk_bytes=chunk_bytes)
        w2_q, w2_scale = quantize(w2, chunk_bytes=chunk_bytes)
        if config.w4_layout == "mma":
            return (*mma_layout_weight("quantize_layer_weights", "w13", w13_q, w13_scale),
                    *mma_layout_weight("quantize_layer_weights", "w2", w2_q, w2_scale))
        return w13_q, w13_scale, w2_q, w2_scale
    layout = WEIGHT_LAYOUT[config.quant]
    w13_q, w13_scale = quantize_weight_fp8(w13, layout, chunk_bytes=chunk_bytes)
    w2_q, w2_scale = quantize_weight_fp8(w2, layout, chunk_bytes=chunk_bytes)
    return w13_q, w13_scale, w2_q, w2_scale


def mma_layout_weight(op: str, name: str, w_q: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 codes ``w_q`` (checkpoint layout) and their e8m0 ``w_scale`` as ``MoEConfig(w4_layout="mma")`` takes
    them: ``(mxfp4_to_mma_layout(w_q), w_scale)``. A load-time step: it reads the scales on the host (one sync) and
    raises ValueError naming ``op`` and ``name`` if a scale code is one the layout's table cannot hold (129..254,
    ``moe_contract/w4_layout.py: check_mma_layout_scales``), rather than let those weights read as NaN."""
    check_mma_layout_scales(op, f"{name}_scale", w_scale.detach().cpu().numpy())
    return mxfp4_to_mma_layout(w_q), w_scale


@takes_torch_tensors
def local_weights(w: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """This rank's slice ``[E_local, ...]`` of a global ``[E + S, ...]`` expert tensor (or scale)."""
    start, e_local = config.local_expert_range()
    return w[start : start + e_local]
