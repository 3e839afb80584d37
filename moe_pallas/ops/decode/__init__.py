"""The low-latency decode path of the JAX MoE layer (small ``T``): ``fused_experts_decode``, the layer's experts
and combine in one jitted program of a tiny jnp prelude and two Pallas-Triton kernels (``api.py``; kernels in
``pallas_triton.py``, launch configs and ``DECODE_MAX_TOKENS`` in ``config.py``, the staged reference in
``reference.py``). Not wired into ``moe_forward`` yet.

Mirror: ``moe_torch/ops/decode/__init__.py``.
"""

from moe_pallas.ops.decode.api import fused_experts_decode
from moe_pallas.ops.decode.config import DECODE_MAX_TOKENS

__all__ = ["DECODE_MAX_TOKENS", "fused_experts_decode"]
