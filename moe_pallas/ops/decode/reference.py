"""The decode path's reference: the layer's expert stages composed, each on its jnp reference.

``fused_experts_decode_reference`` is what ``moe_pallas.layer.routed_experts`` computes (CONTRACT.md sections 2-5,
9), written out with the same stage ops, every one with ``implementation="reference"``::

    topk_ids --routing_metadata--> expert_offsets, src2dst, dst2src        (this rank's experts; -1 / others: none)
    topk_weights --slot_weights--> combine weights, input scale         (apply_router_weight_on_input: routed
                                                                          slots' weights move to the input)
    x (with an input scale: rows x[t] * s[t, j], float32, rounded to x.dtype)
      --permute (+FP8 quant of the rows)--> xp [T*k, H]
      --grouped_gemm w13 (+ w13_bias)--> h [T*k, 2I]                        (x.dtype: rounded once)
      --act_and_mul (config.activation, config.gate_up_layout)--> a [T*k, I]  (float32 math, rounded to x.dtype;
                                                                          FP8: quantized from float32 instead)
      --grouped_gemm w2 (+ w2_bias)--> y [T*k, H]                           (x.dtype: rounded once)
      --combine (combine weights, config.combine_routed_scaling_factor)--> out [T, H]  (float32 sum, rounded once)

FP8 (``config.quant`` ``"fp8_per_token"`` / ``"fp8_block"``, CONTRACT.md section 3): the permute quantizes each row
of ``xp`` and the activation each row of ``a`` (per token, or in 1x128 groups: ``ACTIVATION_QUANT``), dynamic scales
``max(amax, 1e-10) * float32(1/448)``; each GEMM multiplies the codes with float32 accumulation and applies the
scales (section 4). 4-bit weights (``"mxfp4"`` / ``"int4"``) go to both GEMMs as their ``w_format`` (dequantized
in float32, rounded to ``x.dtype``: section 9). The Pallas-Triton decode kernels must agree with it within
CONTRACT.md section 7 (float32: ``F32_REL_FRO``; bf16 / fp16: ``BF16_REL_FRO``; FP8: ``FP8_REL_FRO``): they round
and quantize at the same points (FP8 codes and scales bit-identical), and differ only in the order of their
float32 sums. Jittable (no host reads): under ``jax.jit`` only shapes are static.

Mirror: ``moe_torch/ops/decode/reference.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_contract.config import ACTIVATION_QUANT, MoEConfig
from moe_pallas.ops.activation.api import act_and_mul
from moe_pallas.ops.combine.api import combine
from moe_pallas.ops.grouped_gemm.api import grouped_gemm
from moe_pallas.ops.permute.api import permute, routing_metadata
from moe_pallas.slot_weights import scaled_slot_rows, slot_weights

_REF = "reference"


def fused_experts_decode_reference(
    x: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    w13: jax.Array,
    w2: jax.Array,
    config: MoEConfig,
    w13_bias: jax.Array | None,
    w2_bias: jax.Array | None,
    w13_scale: jax.Array | None,
    w2_scale: jax.Array | None,
) -> jax.Array:
    """``out [T, H]`` in ``x.dtype``; arguments as :func:`moe_pallas.ops.decode.api.fused_experts_decode`
    (validated there). ``T = 0`` gives ``[0, H]``."""
    T, k = topk_ids.shape
    if T == 0:
        return jnp.zeros((0, x.shape[1]), x.dtype)
    expert_start, e_local = config.local_expert_range()
    w_format = config.w_format
    quant = ACTIVATION_QUANT[config.quant]
    meta = routing_metadata(topk_ids, config.num_total_experts, expert_start=expert_start, num_local_experts=e_local,
                            implementation=_REF)
    # topk_weights already carry any shared-expert gate (the api's contract), so the split is slot_weights' without it
    combine_weights, input_scale = slot_weights(topk_weights, None, config.replace(shared_expert_gate=False))
    rows, rows_k = (x, k) if input_scale is None else (scaled_slot_rows(x, input_scale), 1)  # layer._expert_rows
    xp, x_scale = permute(rows, meta.dst2src, topk=rows_k, quant=quant, implementation=_REF)
    h = grouped_gemm(xp, w13, meta.expert_offsets, x_scale=x_scale, w_scale=w13_scale, out_dtype=x.dtype,
                     implementation=_REF, w_format=w_format, bias=w13_bias)
    a, a_scale = act_and_mul(h, activation=config.activation, layout=config.gate_up_layout, quant=quant,
                             implementation=_REF)
    y = grouped_gemm(a, w2, meta.expert_offsets, x_scale=a_scale, w_scale=w2_scale, out_dtype=x.dtype,
                     implementation=_REF, w_format=w_format, bias=w2_bias)
    return combine(y, meta.src2dst, combine_weights, routed_scaling_factor=config.combine_routed_scaling_factor,
                   out_dtype=x.dtype, implementation=_REF)
