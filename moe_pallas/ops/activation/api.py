"""Gated activations between the two GEMMs, optionally quantized straight to FP8 (CONTRACT.md section 4),
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
from moe_pallas.ops.common import resolve_dtype, takes_jax_arrays
from moe_pallas.ops.dispatch import dispatch

IMPLEMENTATIONS = ("pallas_triton", "reference")


class _Static(NamedTuple):
    """The validated, hashable (static) arguments of one ``act_and_mul`` call."""

    op: str
    activation: str
    quant: str | None
    group_size: int
    out_dtype: Any
    implementation: str | None


def _act_and_mul(h: jax.Array, st: _Static) -> tuple[jax.Array, jax.Array | None]:
    return dispatch(st.op, st.implementation, {
        "pallas_triton": lambda: act_and_mul_pallas_triton(
            h, activation=st.activation, quant=st.quant, group_size=st.group_size, out_dtype=st.out_dtype),
        "reference": lambda: act_and_mul_reference(h, st.activation, st.quant, st.group_size, st.out_dtype),
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
    d_h = act_and_mul_backward(h, d_out, activation=st.activation, out_dtype=h.dtype, implementation=st.implementation)
    return (d_h,)


_act_and_mul_vjp.defvjp(_act_and_mul_fwd, _act_and_mul_bwd)


@takes_jax_arrays
def act_and_mul(
    h: jax.Array,
    *,
    activation: str = "silu",
    quant: str | None = None,
    group_size: int = 128,
    out_dtype=None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """``out = act(h[:, :I]) * h[:, I:]`` in float32 (gate half first, then up half).

    Args:
      h: ``[M, 2*I]`` float32 / bf16 / float16 (the first GEMM's output).
      activation: ``"silu"`` (``g * sigmoid(g)``) or ``"gelu_tanh"`` (GELU, tanh approximation).
      quant: ``None``, ``"fp8_per_token"`` (scale ``[M, 1]``) or ``"fp8_per_token_group"``
        (scale ``[M, I // group_size]``), quantized from the float32 values (CONTRACT.md section 3).
      out_dtype: without quant, the result dtype (default ``h.dtype``).
      implementation: ``"pallas_triton"`` (interpreted on the CPU), ``"reference"``, or ``None``
        (the device's default order, ``moe_pallas.ops.dispatch``; the reference on the CPU).

    Returns: ``(out [M, I], scale or None)``.

    Differentiable in ``h`` (``jax.custom_vjp``): the backward is :func:`act_and_mul_backward` with the
    same ``implementation``. With ``quant`` set the backward raises ValueError (FP8 codes have no
    gradient; the layer's FP8 training path is straight-through).

    Raises: ValueError (odd last dim, ``I % group_size``), TypeError (dtype),
      NotImplementedError (``implementation="pallas_triton"`` with a group_size that is not a power of two).
    """
    op = f"{activation}_and_mul" if activation in ACTIVATIONS else "act_and_mul"
    out_dtype = resolve_dtype(check_act_and_mul(op, h, activation, quant, group_size, out_dtype))
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    return _act_and_mul_vjp(h, _Static(op, activation, quant, group_size, out_dtype, implementation))


@takes_jax_arrays
def act_and_mul_backward(
    h: jax.Array,
    d_a: jax.Array,
    *,
    activation: str = "silu",
    out_dtype=None,
    implementation: str | None = None,
) -> jax.Array:
    """The backward of :func:`act_and_mul` (quant=None), CONTRACT.md section 8, in float32:
    ``g, u = h[:, :I], h[:, I:]``; ``d_u = d_a * act(g)``; ``d_g = d_a * u * act'(g)`` (silu:
    ``s = sigmoid(g)``, ``d_g = d_a * u * s * (1 + g * (1 - s))``, ``d_u = d_a * g * s``; gelu_tanh:
    the derivative of the tanh formula).

    Args:
      h: ``[M_cap, 2*I]`` float32 / bf16 / float16, the forward's input (gate half first).
      d_a: ``[M_cap, I]`` float32 / bf16 / float16, the gradient of the forward's output.
      activation: ``"silu"`` or ``"gelu_tanh"``.
      out_dtype: default ``h.dtype``.
      implementation: ``"pallas_triton"`` (one fused kernel: ``h`` and ``d_a`` read once; interpreted on
        the CPU), ``"reference"``, or ``None`` (the device's default order, ``moe_pallas.ops.dispatch``;
        the reference on the CPU).

    Returns: ``d_h = [d_g | d_u]`` ``[M_cap, 2*I]`` in ``out_dtype``. Row by row: each row of ``d_h``
    depends only on the same row of ``h`` and ``d_a`` (rows ``>= M`` of zeros give zeros).

    Raises: ValueError (shapes), TypeError (dtypes), NotImplementedError (``implementation="pallas_triton"``
      with a config over Triton's tile limit).
    """
    op = "act_and_mul_backward"
    out_dtype = resolve_dtype(check_act_and_mul_backward(op, h, d_a, activation, out_dtype))
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    return dispatch(op, implementation, {
        "pallas_triton": lambda: act_and_mul_backward_pallas_triton(h, d_a, activation=activation, out_dtype=out_dtype),
        "reference": lambda: act_and_mul_backward_reference(h, d_a, activation, out_dtype),
    })


@takes_jax_arrays
def silu_and_mul(h: jax.Array, **kwargs) -> tuple[jax.Array, jax.Array | None]:
    """``silu(h[:, :I]) * h[:, I:]``; see :func:`act_and_mul` for the arguments."""
    return act_and_mul(h, activation="silu", **kwargs)


@takes_jax_arrays
def gelu_tanh_and_mul(h: jax.Array, **kwargs) -> tuple[jax.Array, jax.Array | None]:
    """``gelu_tanh(h[:, :I]) * h[:, I:]``; see :func:`act_and_mul` for the arguments."""
    return act_and_mul(h, activation="gelu_tanh", **kwargs)
