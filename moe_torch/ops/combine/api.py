"""Combine: un-permute the expert outputs and sum them per token (CONTRACT.md section 5).

Mirror: ``moe_pallas/ops/combine/api.py``.
"""

from __future__ import annotations

import torch

from moe_contract.op_checks import check_combine
from moe_contract.validation import check_choice
from moe_torch.ops.combine.reference import combine_reference
from moe_torch.ops.common import resolve_dtype, takes_torch_tensors
from moe_torch.ops.dispatch import dispatch

IMPLEMENTATIONS = ("triton", "reference")


def _triton(*args):
    """The Triton backend, imported on first use (so that ``moe_torch`` imports without triton)."""
    try:
        from moe_torch.ops.combine.triton import combine_triton
    except ImportError as exc:
        raise NotImplementedError(f"combine: triton is not importable ({exc})") from exc
    return combine_triton(*args)


@takes_torch_tensors
def combine(
    y: torch.Tensor,
    src2dst: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    routed_scaling_factor: float = 1.0,
    out_dtype=None,
    implementation: str | None = None,
) -> torch.Tensor:
    """``out[t] = rsf * sum_j topk_weights[t, j] * y[src2dst[t, j]]`` over slots with ``src2dst >= 0``.

    Args:
      y: ``[M_cap, H]`` float, the second GEMM's output in permuted order.
      src2dst: ``[T, topk]`` int32, ``-1`` for non-local slots (they contribute nothing).
      topk_weights: ``[T, topk]`` float32.
      routed_scaling_factor: pass the model's ``rsf`` here unless the gate already applied it
        (then 1.0): it must be applied exactly once.
      out_dtype: default ``y.dtype``.
      implementation: ``None`` (CUDA tensors: ``"triton"``, falling back to ``"reference"``
        with a logged warning; CPU tensors: ``"reference"``), ``"triton"`` or ``"reference"``.

    Returns: ``out [T, H]``, accumulated in float32 and cast once. Tokens with no local slot get 0.

    Raises: ValueError (shapes, rsf), TypeError (dtypes),
      NotImplementedError (``implementation="triton"`` where the kernel cannot run).
    """
    op = "combine"
    out_dtype = resolve_dtype(check_combine(op, y, src2dst, topk_weights, routed_scaling_factor, out_dtype))
    T = src2dst.shape[0]
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    if T == 0:
        return torch.zeros((0, y.shape[1]), dtype=out_dtype, device=y.device)
    args = (y, src2dst, topk_weights, float(routed_scaling_factor), out_dtype)
    backends = {"triton": lambda: _triton(*args), "reference": lambda: combine_reference(*args)}
    return dispatch(op, implementation, backends, y.device)
