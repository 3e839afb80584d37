"""Small numerics helpers shared by the torch references.

Mirror: ``moe_pallas/ops/common.py``.
"""

from __future__ import annotations

import torch


def resolve_dtype(dtype) -> torch.dtype:
    """A ``torch.dtype`` from a dtype or its name (``"bfloat16"``), as JAX accepts both."""
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def cast_rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, rounding to nearest even. (Eager torch always rounds here; the jnp mirror
    must force it under ``jit``, where XLA may keep excess precision.)"""
    return x.to(dtype)
