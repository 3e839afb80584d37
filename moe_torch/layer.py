"""The MoE layer in PyTorch: the stages of CONTRACT.md composed, one EP rank at a time.

Dataflow (``S`` fused shared experts, ``topk' = topk + S``, ``M_cap = T * topk'``)::

    router_logits [T, E] --select_experts--> topk_weights, topk_ids [T, topk']
    topk_ids --routing_metadata--> expert_offsets [E_local+1], src2dst [T, topk'], dst2src [M_cap]
    x [T, H] --permute (+FP8 quant)--> [M_cap, H] --grouped_gemm w13--> [M_cap, 2I]
      --act_and_mul (+FP8 quant)--> [M_cap, I] --grouped_gemm w2--> [M_cap, H]
      --combine (x rsf unless the gate applied it)--> out [T, H]

Mirror: ``moe_pallas/layer.py``.
"""

from __future__ import annotations

import torch

from moe_contract.config import ACTIVATION_QUANT, WEIGHT_LAYOUT, MoEConfig
from moe_contract.validation import check_layer_inputs, check_layer_weights, stage_implementation
from moe_torch.ops.activation import api as activation_api
from moe_torch.ops.activation.api import act_and_mul
from moe_torch.ops.combine import api as combine_api
from moe_torch.ops.combine.api import combine
from moe_torch.ops.common import takes_torch_tensors
from moe_torch.ops.dispatch import check_implementation
from moe_torch.ops.gate import api as gate_api
from moe_torch.ops.gate.api import select_experts
from moe_torch.ops.grouped_gemm import api as grouped_gemm_api
from moe_torch.ops.grouped_gemm.api import grouped_gemm
from moe_torch.ops.permute import api as permute_api
from moe_torch.ops.permute.api import permute, routing_metadata
from moe_torch.ops.quant.api import quantize_weight_fp8

#: Every backend name any stage knows (a stage without the chosen one uses its default).
LAYER_IMPLEMENTATIONS = tuple(dict.fromkeys(
    name for stage in (gate_api, permute_api, grouped_gemm_api, activation_api, combine_api) for name in stage.IMPLEMENTATIONS
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
    e_score_correction_bias: torch.Tensor | None = None,
    implementation: str | None = None,
) -> torch.Tensor:
    """One MoE layer on this EP rank (``config.ep_rank``): ``[T, H] -> [T, H]``.

    Args:
      x: ``[T, H]`` float32 / bf16 / float16.
      router_logits: ``[T, E]`` float (the gate's linear layer output).
      w13: ``[E_local, 2*I, H]`` this rank's gate (rows ``:I``) and up (rows ``I:``)
        projections, ``x.dtype`` for ``quant='none'``, float8_e4m3fn otherwise.
      w2: ``[E_local, H, I]`` down projections, same dtype rule.
      config: the layer (routing, rsf placement, quant, EP).
      w13_scale, w2_scale: FP8 weight scales (see :func:`quantize_layer_weights`).
      e_score_correction_bias: ``[E]`` float, for ``routing='biased_grouped_topk'``.
      implementation: ``"reference"`` or ``"triton"``, used by every stage that has it; a stage
        without it uses its default (``None``). ``None``: every stage's default.

    Returns: ``out [T, H]`` in ``x.dtype``: this rank's partial sum; the sum over EP ranks is
    the layer's output (CONTRACT.md section 6).

    Raises: ValueError / TypeError naming the argument, before any computation.
    """
    op = "moe_forward"
    check_layer_inputs(op, config, x, router_logits, w13, w2, w13_scale, w2_scale)
    check_implementation(op, implementation, LAYER_IMPLEMENTATIONS)

    topk_weights, topk_ids = run_gate(router_logits, config, e_score_correction_bias, implementation)
    expert_start, e_local = config.local_expert_range()
    y, meta = run_experts(x, topk_ids, w13, w2, w13_scale, w2_scale, config, implementation,
                          num_experts=config.num_total_experts, expert_start=expert_start, num_local_experts=e_local)
    return combine(y, meta.src2dst, topk_weights, routed_scaling_factor=config.combine_routed_scaling_factor, out_dtype=x.dtype,
                   implementation=stage_implementation(implementation, combine_api))


# The stages of moe_forward, also composed differently by the EP layers (``ep.py``).


def run_gate(router_logits, config: MoEConfig, e_score_correction_bias, implementation: str | None):
    """``select_experts`` with the layer's routing settings: ``(topk_weights, topk_ids) [T, topk']``."""
    return select_experts(router_logits, **config.gate_kwargs(), e_score_correction_bias=e_score_correction_bias,
                          implementation=stage_implementation(implementation, gate_api))


def run_experts(x, topk_ids, w13, w2, w13_scale, w2_scale, config: MoEConfig, implementation: str | None, *,
                num_experts: int, expert_start: int, num_local_experts: int):
    """The expert stages on the assignments of ``topk_ids [R, k]`` (ids in ``[0, num_experts)``;
    ``[expert_start, expert_start + num_local_experts)`` are the local experts of ``w13``/``w2``):
    routing metadata, permute (+FP8 quant), GEMM 1, act_and_mul (+FP8 quant), GEMM 2.

    Returns ``(y [R*k, H] x.dtype in permuted order, RoutingMetadata)``; rows ``>= M`` are never read."""
    meta = routing_metadata(topk_ids, num_experts, expert_start=expert_start, num_local_experts=num_local_experts,
                            implementation=stage_implementation(implementation, permute_api))
    quant = ACTIVATION_QUANT[config.quant]
    gemm = stage_implementation(implementation, grouped_gemm_api)
    xq, x_scale = permute(x, meta.dst2src, topk=topk_ids.shape[1], quant=quant,
                          implementation=stage_implementation(implementation, permute_api))
    h = grouped_gemm(xq, w13, meta.expert_offsets, x_scale=x_scale, w_scale=w13_scale, out_dtype=x.dtype, implementation=gemm)
    a, a_scale = act_and_mul(h, activation=config.activation, quant=quant,
                             implementation=stage_implementation(implementation, activation_api))
    y = grouped_gemm(a, w2, meta.expert_offsets, x_scale=a_scale, w_scale=w2_scale, out_dtype=x.dtype, implementation=gemm)
    return y, meta


@takes_torch_tensors
def quantize_layer_weights(
    w13: torch.Tensor, w2: torch.Tensor, config: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Float weights -> ``(w13, w13_scale, w2, w2_scale)`` in the form ``config.quant`` takes.

    ``quant='none'``: unchanged, scales ``None``. ``'fp8_per_token'``: per-output-channel
    scales ``[E, N]``. ``'fp8_block'``: 128x128 block scales ``[E, ceil(N/128), ceil(K/128)]``.
    """
    check_layer_weights("quantize_layer_weights", config, w13, w2)
    if config.quant == "none":
        return w13, None, w2, None
    layout = WEIGHT_LAYOUT[config.quant]
    w13_q, w13_scale = quantize_weight_fp8(w13, layout)
    w2_q, w2_scale = quantize_weight_fp8(w2, layout)
    return w13_q, w13_scale, w2_q, w2_scale


@takes_torch_tensors
def local_weights(w: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """This rank's slice ``[E_local, ...]`` of a global ``[E + S, ...]`` expert tensor (or scale)."""
    start, e_local = config.local_expert_range()
    return w[start : start + e_local]
