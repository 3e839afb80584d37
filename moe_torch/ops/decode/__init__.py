"""The low-latency decode path of the torch MoE layer (small ``T``): ``fused_experts_decode``, the layer's experts
and combine in two Triton launches (``api.py``; kernels in ``triton.py``, launch configs and
``DECODE_MAX_TOKENS`` in ``config.py``, the staged reference in ``reference.py``). Not wired into ``moe_forward``
yet."""

from moe_torch.ops.decode.api import fused_experts_decode
from moe_torch.ops.decode.config import DECODE_MAX_TOKENS

__all__ = ["DECODE_MAX_TOKENS", "fused_experts_decode"]
