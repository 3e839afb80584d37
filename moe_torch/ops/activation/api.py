"""Gated activations between the two GEMMs (silu, gelu_tanh, gpt-oss's swiglu_oai; gate and up concatenated or
interleaved), optionally quantized straight to FP8 (CONTRACT.md section 4),
and their backward (section 8): ``act_and_mul_backward``, and ``act_and_mul`` differentiable in ``h``
(a ``torch.autograd.Function`` whose backward is ``act_and_mul_backward`` with the same implementation).

Mirror: ``moe_pallas/ops/activation/api.py``.
"""

from __future__ import annotations

import torch

from moe_contract.op_checks import check_act_and_mul, check_act_and_mul_backward
from moe_contract.validation import check_choice
from moe_torch.ops.activation.reference import ACTIVATIONS, act_and_mul_backward_reference, act_and_mul_reference
from moe_torch.ops.common import first_order_backward, resolve_dtype, takes_torch_tensors
from moe_torch.ops.dispatch import dispatch

IMPLEMENTATIONS = ("triton", "reference")


def _triton(*args):
    """The Triton backend, imported on first use (so that ``moe_torch`` imports without triton)."""
    try:
        from moe_torch.ops.activation.triton import act_and_mul_triton
    except ImportError as exc:
        raise NotImplementedError(f"act_and_mul: triton is not importable ({exc})") from exc
    return act_and_mul_triton(*args)


def _triton_backward(*args):
    """The Triton backward kernel, imported on first use."""
    try:
        from moe_torch.ops.activation.triton import act_and_mul_backward_triton
    except ImportError as exc:
        raise NotImplementedError(f"act_and_mul_backward: triton is not importable ({exc})") from exc
    return act_and_mul_backward_triton(*args)


class _ActAndMulFunction(torch.autograd.Function):
    """``act_and_mul`` with a backward: ``d_h = act_and_mul_backward(h, d_out)`` (quant=None, the same
    activation and layout). With FP8 quant the codes are not differentiable: the backward raises instead of
    returning a wrong gradient."""

    @staticmethod
    def forward(ctx, h, run, op, activation, layout, quant, implementation):
        out, scale = run()
        ctx.save_for_backward(h)
        ctx.op, ctx.activation, ctx.layout = op, activation, layout
        ctx.quant, ctx.implementation = quant, implementation
        return out, scale

    @staticmethod
    @first_order_backward("act_and_mul")
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, d_scale):
        if ctx.quant is not None:
            raise ValueError(
                f"{ctx.op}: no gradient through quant={ctx.quant!r} (FP8 codes are not differentiable); call it with "
                f"quant=None for training, or act_and_mul_backward on the float h (straight-through); got a gradient "
                f"request for h")
        (h,) = ctx.saved_tensors
        d_h = act_and_mul_backward(h, d_out, activation=ctx.activation, layout=ctx.layout, out_dtype=h.dtype,
                                   implementation=ctx.implementation)
        return d_h, None, None, None, None, None, None


@takes_torch_tensors
def act_and_mul(
    h: torch.Tensor,
    *,
    activation: str = "silu",
    layout: str = "concatenated",
    quant: str | None = None,
    group_size: int = 128,
    out_dtype=None,
    implementation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out = act(g) * u`` in float32, ``g`` and ``u`` the gate and up halves of ``h`` (CONTRACT.md section 4).

    Args:
      h: ``[M, 2*I]`` float32 / bf16 / float16 (the first GEMM's output).
      activation: ``"silu"`` (``g * sigmoid(g)``), ``"gelu_tanh"`` (GELU, tanh approximation) or
        ``"swiglu_oai"`` (gpt-oss, transformers ``GptOssExperts``: ``out = (uc + 1) * gc * sigmoid(1.702 * gc)``
        with ``gc = min(g, 7)``, ``uc = clamp(u, -7, 7)``; a NaN stays NaN).
      layout: ``"concatenated"`` (gate ``h[:, :I]``, up ``h[:, I:]``) or ``"interleaved"`` (gpt-oss's
        ``gate_up_proj``: gate ``h[:, 0::2]``, up ``h[:, 1::2]``).
      quant: ``None``, ``"fp8_per_token"`` (scale ``[M, 1]``) or ``"fp8_per_token_group"``
        (scale ``[M, I // group_size]``), quantized from the float32 values (CONTRACT.md section 3).
      out_dtype: without quant, the result dtype (default ``h.dtype``).
      implementation: ``None`` (CUDA tensors: ``"triton"``, falling back to ``"reference"``
        with a logged warning; CPU tensors: ``"reference"``), ``"triton"`` or ``"reference"``.

    Returns: ``(out [M, I], scale or None)``.

    Differentiable in ``h`` (autograd, when ``h.requires_grad``): the backward is
    :func:`act_and_mul_backward` with the same ``implementation``. With ``quant`` set the backward
    raises ValueError (FP8 codes have no gradient; the layer's FP8 training path is straight-through).

    Raises: ValueError (odd last dim, ``I % group_size``, unknown activation or layout), TypeError (dtype),
      NotImplementedError (``implementation="triton"`` where the kernel cannot run).
    """
    op = f"{activation}_and_mul" if activation in ACTIVATIONS else "act_and_mul"
    out_dtype = resolve_dtype(check_act_and_mul(op, h, activation, quant, group_size, out_dtype, layout))
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    args = (h.detach(), activation, quant, group_size, out_dtype, layout)
    backends = {"triton": lambda: _triton(*args), "reference": lambda: act_and_mul_reference(*args)}
    run = lambda: dispatch(op, implementation, backends, h.device)  # noqa: E731
    if torch.is_grad_enabled() and h.requires_grad:
        return _ActAndMulFunction.apply(h, run, op, activation, layout, quant, implementation)
    return run()


@takes_torch_tensors
def act_and_mul_backward(
    h: torch.Tensor,
    d_a: torch.Tensor,
    *,
    activation: str = "silu",
    layout: str = "concatenated",
    out_dtype=None,
    implementation: str | None = None,
) -> torch.Tensor:
    """The backward of :func:`act_and_mul` (quant=None), CONTRACT.md section 8, in float32:
    ``g, u`` the gate and up halves of ``h``; ``d_u = d_a * act(g)``; ``d_g = d_a * u * act'(g)`` (silu:
    ``s = sigmoid(g)``, ``d_g = d_a * u * s * (1 + g * (1 - s))``, ``d_u = d_a * g * s``; gelu_tanh:
    the derivative of the tanh formula; swiglu_oai, ``s = sigmoid(1.702 * gc)``: ``d_u = d_a * gc * s`` where
    ``-7 <= u <= 7``, ``d_g = d_a * (uc + 1) * s * (1 + 1.702 * gc * (1 - s))`` where ``g <= 7``, else 0).

    Args:
      h: ``[M_cap, 2*I]`` float32 / bf16 / float16, the forward's input.
      d_a: ``[M_cap, I]`` float32 / bf16 / float16, the gradient of the forward's output.
      activation: ``"silu"``, ``"gelu_tanh"`` or ``"swiglu_oai"``.
      layout: where gate and up are in ``h`` (and ``d_g``, ``d_u`` go in ``d_h``): ``"concatenated"`` or
        ``"interleaved"``, as in :func:`act_and_mul`.
      out_dtype: default ``h.dtype``.
      implementation: ``None`` (CUDA tensors: ``"triton"``, falling back to ``"reference"`` with a
        logged warning; CPU tensors: ``"reference"``), ``"triton"`` (one fused kernel: ``h`` and
        ``d_a`` read once) or ``"reference"``.

    Returns: ``d_h`` ``[M_cap, 2*I]`` in ``out_dtype`` (``[d_g | d_u]``, or ``d_g``, ``d_u`` interleaved). Row by
    row: each row of ``d_h`` depends only on the same row of ``h`` and ``d_a`` (rows ``>= M`` of zeros give zeros).

    Raises: ValueError (shapes, unknown activation or layout), TypeError (dtypes), NotImplementedError
      (``implementation="triton"`` where the kernel cannot run).
    """
    op = "act_and_mul_backward"
    out_dtype = resolve_dtype(check_act_and_mul_backward(op, h, d_a, activation, out_dtype, layout))
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    args = (h.detach(), d_a.detach(), activation, out_dtype, layout)
    backends = {"triton": lambda: _triton_backward(*args), "reference": lambda: act_and_mul_backward_reference(*args)}
    return dispatch(op, implementation, backends, h.device)


@takes_torch_tensors
def silu_and_mul(h: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``silu(h[:, :I]) * h[:, I:]``; see :func:`act_and_mul` for the arguments."""
    return act_and_mul(h, activation="silu", **kwargs)


@takes_torch_tensors
def gelu_tanh_and_mul(h: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``gelu_tanh(h[:, :I]) * h[:, I:]``; see :func:`act_and_mul` for the arguments."""
    return act_and_mul(h, activation="gelu_tanh", **kwargs)


@takes_torch_tensors
def swiglu_oai_and_mul(h: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gpt-oss's ``(clamp(u, -7, 7) + 1) * gc * sigmoid(1.702 * gc)``, ``gc = min(g, 7)``; gate and up
    concatenated unless ``layout="interleaved"`` (gpt-oss's ``gate_up_proj``); see :func:`act_and_mul`."""
    return act_and_mul(h, activation="swiglu_oai", **kwargs)
