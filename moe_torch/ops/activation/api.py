"""Gated activations between the two GEMMs, optionally quantized straight to FP8 (CONTRACT.md section 4).

Mirror: ``moe_pallas/ops/activation/api.py``.
"""

from __future__ import annotations

import torch

from moe_contract.op_checks import check_act_and_mul
from moe_contract.validation import check_choice
from moe_torch.ops.activation.reference import ACTIVATIONS, act_and_mul_reference
from moe_torch.ops.common import resolve_dtype, takes_torch_tensors
from moe_torch.ops.dispatch import dispatch

IMPLEMENTATIONS = ("triton", "reference")


def _triton(*args):
    """The Triton backend, imported on first use (so that ``moe_torch`` imports without triton)."""
    try:
        from moe_torch.ops.activation.triton import act_and_mul_triton
    except ImportError as exc:
        raise NotImplementedError(f"act_and_mul: triton is not importable ({exc})") from exc
    return act_and_mul_triton(*args)


@takes_torch_tensors
def act_and_mul(
    h: torch.Tensor,
    *,
    activation: str = "silu",
    quant: str | None = None,
    group_size: int = 128,
    out_dtype=None,
    implementation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out = act(h[:, :I]) * h[:, I:]`` in float32 (gate half first, then up half).

    Args:
      h: ``[M, 2*I]`` float32 / bf16 / float16 (the first GEMM's output).
      activation: ``"silu"`` (``g * sigmoid(g)``) or ``"gelu_tanh"`` (GELU, tanh approximation).
      quant: ``None``, ``"fp8_per_token"`` (scale ``[M, 1]``) or ``"fp8_per_token_group"``
        (scale ``[M, I // group_size]``), quantized from the float32 values (CONTRACT.md section 3).
      out_dtype: without quant, the result dtype (default ``h.dtype``).
      implementation: ``None`` (CUDA tensors: ``"triton"``, falling back to ``"reference"``
        with a logged warning; CPU tensors: ``"reference"``), ``"triton"`` or ``"reference"``.

    Returns: ``(out [M, I], scale or None)``.

    Raises: ValueError (odd last dim, ``I % group_size``), TypeError (dtype),
      NotImplementedError (``implementation="triton"`` where the kernel cannot run).
    """
    op = f"{activation}_and_mul" if activation in ACTIVATIONS else "act_and_mul"
    out_dtype = resolve_dtype(check_act_and_mul(op, h, activation, quant, group_size, out_dtype))
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    args = (h, activation, quant, group_size, out_dtype)
    backends = {"triton": lambda: _triton(*args), "reference": lambda: act_and_mul_reference(*args)}
    return dispatch(op, implementation, backends, h.device)


@takes_torch_tensors
def silu_and_mul(h: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``silu(h[:, :I]) * h[:, I:]``; see :func:`act_and_mul` for the arguments."""
    return act_and_mul(h, activation="silu", **kwargs)


@takes_torch_tensors
def gelu_tanh_and_mul(h: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``gelu_tanh(h[:, :I]) * h[:, I:]``; see :func:`act_and_mul` for the arguments."""
    return act_and_mul(h, activation="gelu_tanh", **kwargs)
