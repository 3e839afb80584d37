"""Gated activations between the two GEMMs (silu, gelu_tanh, gpt-oss's swiglu_oai; gate and up concatenated or
interleaved), optionally quantized straight to FP8 (CONTRACT.md section 4),
and their backward (section 8): ``act_and_mul_backward``, and ``act_and_mul`` differentiable in ``h``
(a ``jax.custom_vjp`` whose backward is ``act_and_mul_backward`` with the same implementation).

Mirror: ``moe_torch/ops/activation/api.py``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax

from moe_contract.op_checks import check_act_and_mul, check_act_and_mul_backward
from moe_contract.validation import check_choice
from moe_pallas.ops.activation.pallas_triton import act_and_mul_backward_pallas_triton, act_and_mul_pallas_triton
from moe_pallas.ops.activation.reference import ACTIVATIONS, act_and_mul_backward_reference, act_and_mul_reference
from moe_pallas.ops.common import first_order_only, resolve_dtype, takes_jax_arrays
from moe_pallas.ops.dispatch import dispatch

IMPLEMENTATIONS = ("pallas_triton", "reference")


class _Static(NamedTuple):
    """The validated, hashable (static) arguments of one ``act_and_mul`` call."""

    op: str
    activation: str
    layout: str
    quant: str | None
    group_size: int
    out_dtype: Any
    implementation: str | None


def _act_and_mul(h: jax.Array, st: _Static) -> tuple[jax.Array, jax.Array | None]:
    return dispatch(st.op, st.implementation, {
        "pallas_triton": lambda: act_and_mul_pallas_triton(
            h, activation=st.activation, layout=st.layout, quant=st.quant, group_size=st.group_size,
            out_dtype=st.out_dtype),
        "reference": lambda: act_and_mul_reference(h, st.activation, st.quant, st.group_size, st.out_dtype, st.layout),
    })


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _act_and_mul_vjp(h: jax.Array, st: _Static) -> tuple[jax.Array, jax.Array | None]:
    return _act_and_mul(h, st)


def _act_and_mul_fwd(h, st):
    return _act_and_mul(h, st), h


def _act_and_mul_bwd(st, h, cotangents):
    if st.quant is not None:
        raise ValueError(
            f"{st.op}: no gradient through quant={st.quant!r} (FP8 codes are not differentiable); call it with "
            f"quant=None for training, or act_and_mul_backward on the float h (straight-through); got a gradient "
            f"request for h")
    d_out, _ = cotangents
    d_h = act_and_mul_backward(h, d_out, activation=st.activation, layout=st.layout, out_dtype=h.dtype,
                               implementation=st.implementation)
    return (d_h,)


_act_and_mul_vjp.defvjp(_act_and_mul_fwd, _act_and_mul_bwd)


@takes_jax_arrays
def act_and_mul(
    h: jax.Array,
    *,
    activation: str = "silu",
    layout: str = "concatenated",
    quant: str | None = None,
    group_size: int = 128,
    out_dtype=None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
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
      implementation: ``"pallas_triton"`` (interpreted on the CPU), ``"reference"``, or ``None``
        (the device's default order, ``moe_pallas.ops.dispatch``; the reference on the CPU).

    Returns: ``(out [M, I], scale or None)``.

    Differentiable in ``h`` (``jax.custom_vjp``): the backward is :func:`act_and_mul_backward` with the
    same ``implementation``. With ``quant`` set the backward raises ValueError (FP8 codes have no
    gradient; the layer's FP8 training path is straight-through).

    Raises: ValueError (odd last dim, ``I % group_size``, unknown activation or layout), TypeError (dtype),
      NotImplementedError (``implementation="pallas_triton"`` with a group_size that is not a power of two).
    """
    op = f"{activation}_and_mul" if activation in ACTIVATIONS else "act_and_mul"
    out_dtype = resolve_dtype(check_act_and_mul(op, h, activation, quant, group_size, out_dtype, layout))
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    h = first_order_only(op, h)  # a derivative of the gradient raises, naming the op
    return _act_and_mul_vjp(h, _Static(op, activation, layout, quant, group_size, out_dtype, implementation))


@takes_jax_arrays
def act_and_mul_backward(
    h: jax.Array,
    d_a: jax.Array,
    *,
    activation: str = "silu",
    layout: str = "concatenated",
    out_dtype=None,
    implementation: str | None = None,
) -> jax.Array:
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
      implementation: ``"pallas_triton"`` (one fused kernel: ``h`` and ``d_a`` read once; interpreted on
        the CPU), ``"reference"``, or ``None`` (the device's default order, ``moe_pallas.ops.dispatch``;
        the reference on the CPU).

    Returns: ``d_h`` ``[M_cap, 2*I]`` in ``out_dtype`` (``[d_g | d_u]``, or ``d_g``, ``d_u`` interleaved). Row by
    row: each row of ``d_h`` depends only on the same row of ``h`` and ``d_a`` (rows ``>= M`` of zeros give zeros).

    Raises: ValueError (shapes, unknown activation or layout), TypeError (dtypes), NotImplementedError
      (``implementation="pallas_triton"`` with a config over Triton's tile limit).
    """
    op = "act_and_mul_backward"
    out_dtype = resolve_dtype(check_act_and_mul_backward(op, h, d_a, activation, out_dtype, layout))
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    return dispatch(op, implementation, {
        "pallas_triton": lambda: act_and_mul_backward_pallas_triton(h, d_a, activation=activation, layout=layout,
                                                                    out_dtype=out_dtype),
        "reference": lambda: act_and_mul_backward_reference(h, d_a, activation, out_dtype, layout),
    })


@takes_jax_arrays
def silu_and_mul(h: jax.Array, **kwargs) -> tuple[jax.Array, jax.Array | None]:
    """``silu(h[:, :I]) * h[:, I:]``; see :func:`act_and_mul` for the arguments."""
    return act_and_mul(h, activation="silu", **kwargs)


@takes_jax_arrays
def gelu_tanh_and_mul(h: jax.Array, **kwargs) -> tuple[jax.Array, jax.Array | None]:
    """``gelu_tanh(h[:, :I]) * h[:, I:]``; see :func:`act_and_mul` for the arguments."""
    return act_and_mul(h, activation="gelu_tanh", **kwargs)


@takes_jax_arrays
def swiglu_oai_and_mul(h: jax.Array, **kwargs) -> tuple[jax.Array, jax.Array | None]:
    """gpt-oss's ``(clamp(u, -7, 7) + 1) * gc * sigmoid(1.702 * gc)``, ``gc = min(g, 7)``; gate and up
    concatenated unless ``layout="interleaved"`` (gpt-oss's ``gate_up_proj``); see :func:`act_and_mul`."""
    return act_and_mul(h, activation="swiglu_oai", **kwargs)
