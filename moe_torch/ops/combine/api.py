"""Combine: un-permute the expert outputs and sum them per token (CONTRACT.md section 5), and its
backward (section 8): ``combine_backward``, and ``combine`` differentiable in ``y`` and ``topk_weights``
(a ``torch.autograd.Function`` whose backward is ``combine_backward`` with the same implementation).

Mirror: ``moe_pallas/ops/combine/api.py``.
"""

from __future__ import annotations

import torch

from moe_contract.op_checks import check_combine, check_combine_backward
from moe_contract.validation import check_choice
from moe_torch.ops.combine.reference import combine_backward_reference, combine_reference, scale_rows_reference
from moe_torch.ops.common import first_order_backward, resolve_dtype, takes_torch_tensors
from moe_torch.ops.dispatch import dispatch

IMPLEMENTATIONS = ("triton", "reference")


def _triton(*args):
    """The Triton backend, imported on first use (so that ``moe_torch`` imports without triton)."""
    try:
        from moe_torch.ops.combine.triton import combine_triton
    except ImportError as exc:
        raise NotImplementedError(f"combine: triton is not importable ({exc})") from exc
    return combine_triton(*args)


def _triton_backward(*args):
    """The Triton backward kernel, imported on first use."""
    try:
        from moe_torch.ops.combine.triton import combine_backward_triton
    except ImportError as exc:
        raise NotImplementedError(f"combine_backward: triton is not importable ({exc})") from exc
    return combine_backward_triton(*args)


def _triton_scale_rows(*args):
    """The Triton row-weight kernel, imported on first use."""
    try:
        from moe_torch.ops.combine.triton import scale_rows_triton
    except ImportError as exc:
        raise NotImplementedError(f"scale_rows: triton is not importable ({exc})") from exc
    return scale_rows_triton(*args)


class _CombineFunction(torch.autograd.Function):
    """``combine`` with a backward: ``(d_y, d_topk_weights) = combine_backward(...)``; src2dst gets none."""

    @staticmethod
    def forward(ctx, y, src2dst, topk_weights, run, routed_scaling_factor, implementation):
        ctx.save_for_backward(y, src2dst, topk_weights)
        ctx.rsf, ctx.implementation = routed_scaling_factor, implementation
        return run()

    @staticmethod
    @first_order_backward("combine")
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        y, src2dst, topk_weights = ctx.saved_tensors
        d_y, d_w = combine_backward(d_out, y, src2dst, topk_weights, routed_scaling_factor=ctx.rsf,
                                    implementation=ctx.implementation)
        return d_y, None, d_w, None, None, None


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

    Differentiable in ``y`` and ``topk_weights`` (autograd, when either requires grad): the backward
    is :func:`combine_backward` with the same ``implementation``.

    Raises: ValueError (shapes, rsf), TypeError (dtypes),
      NotImplementedError (``implementation="triton"`` where the kernel cannot run).
    """
    op = "combine"
    out_dtype = resolve_dtype(check_combine(op, y, src2dst, topk_weights, routed_scaling_factor, out_dtype))
    T = src2dst.shape[0]
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    rsf = float(routed_scaling_factor)
    args = (y.detach(), src2dst, topk_weights.detach(), rsf, out_dtype)
    backends = {"triton": lambda: _triton(*args), "reference": lambda: combine_reference(*args)}

    def run():
        if T == 0:
            return torch.zeros((0, y.shape[1]), dtype=out_dtype, device=y.device)
        return dispatch(op, implementation, backends, y.device)

    if torch.is_grad_enabled() and (y.requires_grad or topk_weights.requires_grad):
        return _CombineFunction.apply(y, src2dst, topk_weights, run, rsf, implementation)
    return run()


@takes_torch_tensors
def combine_backward(
    d_out: torch.Tensor,
    y: torch.Tensor,
    src2dst: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    routed_scaling_factor: float = 1.0,
    implementation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of :func:`combine` (CONTRACT.md section 8), float32 math, ``c = routed_scaling_factor``:
    ``d_y[src2dst[t, j]] = c * w[t, j] * d_out[t]`` and ``d_topk_weights[t, j] = c * <y[src2dst[t, j]], d_out[t]>``.

    Args:
      d_out: ``[T, H]`` float32 / bf16 / float16, the gradient of combine's output.
      y: ``[M_cap, H]`` float, the second GEMM's output the forward combined (``M_cap = T * topk``);
        only rows named by ``src2dst`` are read.
      src2dst: ``[T, topk]`` int32, ``-1`` for non-local slots; every row is named by at most one
        slot (as :func:`routing_metadata` makes it).
      topk_weights: ``[T, topk]`` float32.
      routed_scaling_factor: the ``rsf`` the forward was given (1.0 if the gate applied it).
      implementation: ``None`` (CUDA tensors: ``"triton"``, falling back to ``"reference"`` with a
        logged warning; CPU tensors: ``"reference"``), ``"triton"`` (one kernel, a program per token
        block: plain stores into ``d_y``, no atomics) or ``"reference"``.

    Returns: ``(d_y [M_cap, H] y.dtype, d_topk_weights [T, topk] float32)``; rows of ``d_y`` that no
    local slot names (rows ``>= M``) are 0, non-local slots get ``d_topk_weights = 0``.

    Raises: ValueError (shapes, rsf), TypeError (dtypes),
      NotImplementedError (``implementation="triton"`` where the kernel cannot run).
    """
    op = "combine_backward"
    check_combine_backward(op, d_out, y, src2dst, topk_weights, routed_scaling_factor)
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    args = (d_out.detach(), y.detach(), src2dst, topk_weights.detach(), float(routed_scaling_factor))
    backends = {"triton": lambda: _triton_backward(*args), "reference": lambda: combine_backward_reference(*args)}
    return dispatch(op, implementation, backends, y.device)


def scale_rows(
    g: torch.Tensor,
    row_weights: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    dot_with: torch.Tensor | None = None,
    scale_dot_with: bool = False,
    implementation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Weight each row of ``g`` by its combine weight, and optionally dot it with another tensor's row: the combine's
    backward as the layer's backward folds it into GEMM 2's (CONTRACT.md section 8; ``moe_torch/layer.py``'s
    ``experts_backward``, whose ``w_row[m] = c * topk_weights[slot of permuted row m]``).

    Args:
      g: ``[M, N]`` float32 / bf16 / float16 (e.g. GEMM 2's float32 dgrad, or the permuted ``d_out``); float64
        (the reference only: the float64 gradient checks).
      row_weights: ``[M]`` float32 (float64 with float64 ``g``).
      out_dtype: the dtype of ``out``.
      dot_with: ``None`` or ``[M, N]`` float, as ``g``.
      scale_dot_with: also return ``dot_with`` weighted by the rows' weights (needs ``dot_with``): the layer's
        backward weights GEMM 2's activations ``[M, I]`` for the ``w2`` wgrad instead of the wider ``d_y [M, H]``.
      implementation: ``None`` (CUDA tensors: ``"triton"``, falling back to ``"reference"`` with a logged warning;
        CPU tensors: ``"reference"``), ``"triton"`` (one pass over ``g``) or ``"reference"``.

    Returns: ``(out [M, N] out_dtype, dots [M] float32 or None, dot_with_w [M, N] or None)``: ``out[m] =
    cast(float32(g[m]) * row_weights[m])`` (one rounding), ``dots[m] = sum_n float32(dot_with[m, n]) * float32(g[m,
    n])`` (float32; the two implementations sum in different orders), ``dot_with_w[m] = cast(float32(dot_with[m]) *
    row_weights[m])`` in ``dot_with``'s dtype (one rounding). Every row is computed, padding rows included (the caller
    reads what it needs).

    Raises: ValueError (shapes), TypeError (dtypes), NotImplementedError (``implementation="triton"`` where the kernel
      cannot run).

    No JAX mirror: under ``jax.jit`` XLA fuses the same multiplies and sums of the layer's backward itself.
    """
    op = "scale_rows"
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    floats = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    if g.ndim != 2 or g.dtype not in floats:
        raise TypeError(f"{op}: g must be a 2-D float tensor; got {tuple(g.shape)} {g.dtype}")
    if row_weights.shape != (g.shape[0],) or row_weights.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: row_weights must be float32 [{g.shape[0]}] (one weight a row of g); got "
                         f"{tuple(row_weights.shape)} {row_weights.dtype}")
    if dot_with is not None and (dot_with.shape != g.shape or dot_with.dtype not in floats):
        raise ValueError(f"{op}: dot_with must be a float tensor of g's shape {tuple(g.shape)}; got "
                         f"{tuple(dot_with.shape)} {dot_with.dtype}")
    if out_dtype not in floats:
        raise TypeError(f"{op}: out_dtype must be a float dtype; got {out_dtype}")
    if scale_dot_with and dot_with is None:
        raise ValueError(f"{op}: scale_dot_with=True weights dot_with's rows; got dot_with=None")
    args = (g.detach(), row_weights.detach(), out_dtype, None if dot_with is None else dot_with.detach(),
            bool(scale_dot_with))
    backends = {"triton": lambda: _triton_scale_rows(*args), "reference": lambda: scale_rows_reference(*args)}
    return dispatch(op, implementation, backends, g.device)
