"""PyTorch side of the EP-MoE pipeline: per-stage ops (a torch reference and a Triton kernel for each
stage, ``implementation="triton"``), the layer (``moe_forward``), torch.distributed expert parallelism
(``ep_moe_forward``), the modules (``EPMoE``; ``MoEBlock``: router + experts under transformers' names),
transformers' MoE blocks served by it (``patch_hf_model``, ``moe_torch/hf.py``, torch only) and transformers'
``ExpertsInterface`` served by the layer (``register_transformers``: ``experts_implementation="epmoe"``,
``moe_torch/hf_experts.py``). Mirrors ``moe_pallas`` file for file; never imports it.

Under ``TRITON_INTERPRET=1`` (set before triton is imported) the Triton kernels run on CPU tensors,
exactly: ``moe_torch/ops/triton_interpret.py`` fixes triton 3.6's interpreter's casts and dots."""

from moe_contract import MoEConfig, PRESETS, get_preset
from moe_torch.capacity import drop_over_capacity
from moe_torch.ep import ep_moe_forward
from moe_torch.hf import HFMoEBlock, patch_hf_model
from moe_torch.hf_experts import experts_forward, register_transformers
from moe_torch.layer import local_weights, moe_forward, quantize_layer_weights
from moe_torch.module import EPMoE, MoEBlock
from moe_torch.ops.activation.api import (
    act_and_mul,
    act_and_mul_backward,
    gelu_tanh_and_mul,
    silu_and_mul,
    swiglu_oai_and_mul,
)
from moe_torch.ops.combine.api import combine, combine_backward
from moe_torch.ops.gate.api import select_experts, select_experts_backward
from moe_torch.ops.gate.losses import RouterLosses, router_losses, update_expert_bias
from moe_torch.ops.grouped_gemm.api import grouped_gemm, grouped_gemm_dbias, grouped_gemm_dgrad, grouped_gemm_wgrad
from moe_torch.ops.permute.api import RoutingMetadata, permute, permute_backward, routing_metadata
from moe_torch.ops.quant.api import (
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
    "EPMoE", "HFMoEBlock", "MoEBlock", "MoEConfig", "PRESETS", "RouterLosses", "RoutingMetadata", "act_and_mul",
    "act_and_mul_backward", "combine",
    "combine_backward", "dequantize_fp8",
    "dequantize_weight_fp8", "dequantize_weight_int4", "dequantize_weight_mxfp4", "drop_over_capacity", "ep_moe_forward",
    "experts_forward", "gelu_tanh_and_mul", "get_preset", "grouped_gemm", "grouped_gemm_dbias", "grouped_gemm_dgrad", "grouped_gemm_wgrad",
    "local_weights",
    "moe_forward", "mxfp4_from_mma_layout", "mxfp4_to_mma_layout", "patch_hf_model", "per_token_group_quant_fp8", "per_token_quant_fp8", "permute", "permute_backward",
    "quantize_layer_weights", "quantize_weight_fp8", "quantize_weight_int4", "quantize_weight_mxfp4", "register_transformers",
    "router_losses", "routing_metadata", "select_experts", "select_experts_backward",
    "silu_and_mul", "static_quant_fp8", "swiglu_oai_and_mul", "update_expert_bias",
]
