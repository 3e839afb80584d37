"""Small numerics helpers shared by the torch references.

Mirror: ``moe_pallas/ops/common.py``.
"""

from __future__ import annotations

import torch


def cast_rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, rounding to nearest even. (Eager torch always rounds here; the jnp mirror
    must force it under ``jit``, where XLA may keep excess precision.)"""
    return x.to(dtype)
