"""The decode path's reference: the layer's expert stages composed, each on its torch reference.

``fused_experts_decode_reference`` is what ``moe_torch.layer.routed_experts`` computes (CONTRACT.md sections 2, 3, 4,
5, 9), written out with the same stage ops, every one with ``implementation="reference"``::

    topk_ids --routing_metadata--> expert_offsets, src2dst, dst2src        (this rank's experts; -1 / others: none)
    topk_weights --slot_weights--> combine weights (, input scales: apply_router_weight_on_input)
    x (--scaled_slot_rows: x[t] * input_scale[t, j], float32 rounded once to x.dtype)
      --permute (+FP8 quant of the rows)--> xp [T*k, H]
      --grouped_gemm w13 (+ FP8 scales, + w13_bias)--> h [T*k, 2I]          (x.dtype: rounded once)
      --act_and_mul (config.activation, config.gate_up_layout)--> a [T*k, I] (float32 math, rounded to x.dtype, or
                                                                             FP8-quantized from float32)
      --grouped_gemm w2 (+ FP8 scales, + w2_bias)--> y [T*k, H]             (x.dtype: rounded once)
      --combine (combine weights, config.combine_routed_scaling_factor)--> out [T, H]  (float32 sum, rounded once)

FP8 weights (``config.quant`` ``"fp8_per_token"`` / ``"fp8_block"``) quantize both GEMMs' inputs as the layer does
(``ACTIVATION_QUANT``: per token, or 1 x 128 groups; CONTRACT.md section 3); 4-bit weights (``"mxfp4"`` /
``"int4"``) go to both GEMMs as their ``w_format`` (dequantized in float32, rounded to ``x.dtype``: section 9). The
Triton decode kernels must agree with it within CONTRACT.md section 7: they round at the same points, quantize the
same values the same way, and differ only in the order of their float32 sums.

Reads the routing on the host (the grouped GEMM reference does): a reference, not a CUDA-graph path.
"""

from __future__ import annotations

import torch

from moe_contract.config import ACTIVATION_QUANT, MoEConfig
from moe_torch.ops.activation.api import act_and_mul
from moe_torch.ops.combine.api import combine
from moe_torch.ops.grouped_gemm.api import grouped_gemm
from moe_torch.ops.permute.api import permute, routing_metadata
from moe_torch.slot_weights import scaled_slot_rows, slot_weights

_REF = "reference"


def fused_experts_decode_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    config: MoEConfig,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
) -> torch.Tensor:
    """``out [T, H]`` in ``x.dtype``; arguments as :func:`moe_torch.ops.decode.api.fused_experts_decode` (validated
    there). ``T = 0`` gives ``[0, H]``."""
    T, k = topk_ids.shape
    if T == 0:
        return torch.zeros((0, x.shape[1]), dtype=x.dtype, device=x.device)
    expert_start, e_local = config.local_expert_range()
    w_format = config.w_format
    quant = ACTIVATION_QUANT[config.quant]
    meta = routing_metadata(topk_ids, config.num_total_experts, expert_start=expert_start, num_local_experts=e_local,
                            implementation=_REF)
    # topk_weights already carry any shared-expert gate (the api's contract), so the split is slot_weights' without it
    combine_weights, input_scale = slot_weights(topk_weights, None, config.replace(shared_expert_gate=False))
    rows, k_rows = (x, k) if input_scale is None else (scaled_slot_rows(x, input_scale), 1)
    xp, x_scale = permute(rows, meta.dst2src, topk=k_rows, quant=quant, implementation=_REF)
    h = grouped_gemm(xp, w13, meta.expert_offsets, x_scale=x_scale, w_scale=w13_scale, out_dtype=x.dtype,
                     implementation=_REF, w_format=w_format, bias=w13_bias)
    a, a_scale = act_and_mul(h, activation=config.activation, layout=config.gate_up_layout, quant=quant,
                             implementation=_REF)
    y = grouped_gemm(a, w2, meta.expert_offsets, x_scale=a_scale, w_scale=w2_scale, out_dtype=x.dtype,
                     implementation=_REF, w_format=w_format, bias=w2_bias)
    return combine(y, meta.src2dst, combine_weights, routed_scaling_factor=config.combine_routed_scaling_factor,
                   out_dtype=x.dtype, implementation=_REF)
