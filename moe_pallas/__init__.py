"""JAX side of the EP-MoE pipeline: per-stage ops (a jnp reference and Pallas kernels for each stage:
the Triton lowering, ``implementation="pallas_triton"``, and for the grouped GEMM Mosaic GPU,
``"pallas_mosaic_gpu"``), the layer (``moe_forward``), shard_map expert parallelism (``ep_moe_forward``)
and the flax NNX modules (``MoELayer``; ``MoEBlock``: router + layer, as a transformers block). Mirrors
``moe_torch`` file for file; never imports it."""

from moe_contract import MoEConfig, PRESETS, get_preset
from moe_pallas.capacity import drop_over_capacity
from moe_pallas.layer import local_weights, moe_forward, quantize_layer_weights
from moe_pallas.ep import ep_moe_forward, make_ep_mesh, shard_expert_weights
from moe_pallas.module import MoEBlock, MoELayer
from moe_pallas.ops.activation.api import (
    act_and_mul,
    act_and_mul_backward,
    gelu_tanh_and_mul,
    silu_and_mul,
    swiglu_oai_and_mul,
)
from moe_pallas.ops.combine.api import combine, combine_backward
from moe_pallas.ops.gate.api import select_experts, select_experts_backward
from moe_pallas.ops.gate.losses import RouterLosses, router_losses, update_expert_bias
from moe_pallas.ops.grouped_gemm.api import grouped_gemm, grouped_gemm_dbias, grouped_gemm_dgrad, grouped_gemm_wgrad
from moe_pallas.ops.permute.api import RoutingMetadata, permute, permute_backward, routing_metadata
from moe_pallas.ops.quant.api import (
    dequantize_fp8,
    dequantize_weight_fp8,
    dequantize_weight_int4,
    dequantize_weight_mxfp4,
    mxfp4_from_mma_layout,
    mxfp4_to_mma_layout,
    per_token_group_quant_fp8,
    per_token_quant_fp8,
    quantize_weight_fp8,
    quantize_weight_int4,
    quantize_weight_mxfp4,
    static_quant_fp8,
)

__all__ = [
    "MoEBlock", "MoELayer", "MoEConfig", "PRESETS", "RouterLosses", "RoutingMetadata", "act_and_mul", "act_and_mul_backward", "combine",
    "combine_backward", "dequantize_fp8",
    "dequantize_weight_fp8", "dequantize_weight_int4", "dequantize_weight_mxfp4", "drop_over_capacity", "ep_moe_forward", "gelu_tanh_and_mul", "get_preset", "grouped_gemm", "grouped_gemm_dbias", "grouped_gemm_dgrad", "grouped_gemm_wgrad", "local_weights",
    "make_ep_mesh", "moe_forward", "mxfp4_from_mma_layout", "mxfp4_to_mma_layout", "per_token_group_quant_fp8", "per_token_quant_fp8", "permute", "permute_backward",
    "quantize_layer_weights", "quantize_weight_fp8", "quantize_weight_int4", "quantize_weight_mxfp4", "router_losses", "routing_metadata", "select_experts", "select_experts_backward",
    "shard_expert_weights",
    "silu_and_mul", "static_quant_fp8", "swiglu_oai_and_mul", "update_expert_bias",
]
