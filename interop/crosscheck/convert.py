"""numpy <-> framework: numpy is the cross-check's hub; bf16 and FP8 travel as ml_dtypes, so bits are kept."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def to_numpy(a) -> np.ndarray | None:
    """A jax array or torch tensor (any device; bf16 / fp8 kept bit-exact as ml_dtypes) as numpy."""
    if a is None:
        return None
    if hasattr(a, "detach"):
        import torch

        t = a.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        if t.dtype == torch.float8_e4m3fn:
            return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
        return t.numpy()
    return np.asarray(a)


def _torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def from_numpy(a: np.ndarray | None, framework: str):
    """numpy (incl. ml_dtypes bf16 / fp8) -> a jax array or a torch tensor (CUDA if there is one)."""
    if a is None:
        return None
    if framework == "jax":
        import jax.numpy as jnp

        return jnp.asarray(a)
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    elif a.dtype == ml_dtypes.float8_e4m3fn:
        t = torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    else:
        t = torch.from_numpy(a.copy())
    return t.to(_torch_device())
