"""Grouped GEMM ``[M, K] x [E, N, K] -> [M, N]`` over rows grouped by expert (CONTRACT.md section 4).

Mirror: ``moe_pallas/ops/grouped_gemm/api.py``.
"""

from __future__ import annotations

import torch

from moe_contract.op_checks import check_grouped_gemm
from moe_contract.validation import check_choice
from moe_torch.ops.common import resolve_dtype, takes_torch_tensors
from moe_torch.ops.dispatch import dispatch
from moe_torch.ops.grouped_gemm.reference import grouped_gemm_reference

IMPLEMENTATIONS = ("triton", "reference")


def _triton(*args):
    """The Triton backend, imported on first use (so that ``moe_torch`` imports without triton)."""
    try:
        from moe_torch.ops.grouped_gemm.triton import grouped_gemm_triton
    except ImportError as exc:
        raise NotImplementedError(f"grouped_gemm: triton is not importable ({exc})") from exc
    return grouped_gemm_triton(*args)


@takes_torch_tensors
def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out_dtype=None,
    implementation: str | None = None,
) -> torch.Tensor:
    """``y[m] = x[m] @ w[e(m)].T``, expert ``e(m)`` given by ``expert_offsets``; float32 accumulation.

    Args:
      x: ``[M_cap, K]``, float32 / bf16 / float16, or float8_e4m3fn codes.
      w: ``[E_local, N, K]`` (out, in), the same float dtype as ``x``, or float8_e4m3fn when
        ``x`` is.
      expert_offsets: ``[E_local + 1]`` int32, rows ``[offsets[e], offsets[e+1])`` use ``w[e]``;
        rows ``>= offsets[-1]`` are not computed (zero in the result). Only the shape and dtype
        are checked: the values would need a host sync. They must be non-decreasing within
        ``[0, M_cap]`` (as ``routing_metadata`` makes them); the kernels clamp other values and
        never address outside ``x`` or ``y``, but the result is then undefined.
      x_scale: FP8 only, float32 dequantization multiplier: ``[]`` per-tensor, ``[M_cap, 1]``
        per-token, or ``[M_cap, K // G]`` per-token-group.
      w_scale: FP8 only, float32: ``[E_local]`` per-expert, ``[E_local, N]`` per-output-channel,
        or ``[E_local, ceil(N/128), ceil(K/128)]`` 128x128 blocks.
      out_dtype: result dtype; default ``x.dtype`` (bf16 for FP8 inputs).
      implementation: ``None`` (CUDA tensors: ``"triton"``, falling back to ``"reference"``
        with a logged warning; CPU tensors: ``"reference"``), ``"triton"`` or ``"reference"``.

    Returns: ``y [M_cap, N]``.

    Raises: ValueError (shapes, missing or unexpected scales), TypeError (dtypes),
      NotImplementedError (``implementation="triton"`` where the kernel cannot run, e.g.
      per-token-group scales whose group ``K // x_scale.shape[1]`` has no power-of-2 divisor >= 32).
    """
    op = "grouped_gemm"
    out_dtype = resolve_dtype(check_grouped_gemm(op, x, w, expert_offsets, x_scale, w_scale, out_dtype))
    M_cap, N = x.shape[0], w.shape[1]
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    if M_cap == 0:
        return torch.zeros((0, N), dtype=out_dtype, device=x.device)
    args = (x, w, expert_offsets, x_scale, w_scale, out_dtype)
    backends = {"triton": lambda: _triton(*args), "reference": lambda: grouped_gemm_reference(*args)}
    return dispatch(op, implementation, backends, x.device)
