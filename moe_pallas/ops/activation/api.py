"""Gated activations between the two GEMMs, optionally quantized straight to FP8 (CONTRACT.md section 4).

Mirror: ``moe_torch/ops/activation/api.py``.
"""

from __future__ import annotations

import jax

from moe_contract.op_checks import check_act_and_mul
from moe_contract.validation import check_choice
from moe_pallas.ops.activation.pallas_triton import act_and_mul_pallas_triton
from moe_pallas.ops.activation.reference import ACTIVATIONS, act_and_mul_reference
from moe_pallas.ops.common import resolve_dtype, takes_jax_arrays
from moe_pallas.ops.dispatch import dispatch

IMPLEMENTATIONS = ("pallas_triton", "reference")


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

    Raises: ValueError (odd last dim, ``I % group_size``), TypeError (dtype),
      NotImplementedError (``implementation="pallas_triton"`` with a group_size that is not a power of two).
    """
    op = f"{activation}_and_mul" if activation in ACTIVATIONS else "act_and_mul"
    out_dtype = resolve_dtype(check_act_and_mul(op, h, activation, quant, group_size, out_dtype))
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    return dispatch(op, implementation, {
        "pallas_triton": lambda: act_and_mul_pallas_triton(
            h, activation=activation, quant=quant, group_size=group_size, out_dtype=out_dtype),
        "reference": lambda: act_and_mul_reference(h, activation, quant, group_size, out_dtype),
    })


@takes_jax_arrays
def silu_and_mul(h: jax.Array, **kwargs) -> tuple[jax.Array, jax.Array | None]:
    """``silu(h[:, :I]) * h[:, I:]``; see :func:`act_and_mul` for the arguments."""
    return act_and_mul(h, activation="silu", **kwargs)


@takes_jax_arrays
def gelu_tanh_and_mul(h: jax.Array, **kwargs) -> tuple[jax.Array, jax.Array | None]:
    """``gelu_tanh(h[:, :I]) * h[:, I:]``; see :func:`act_and_mul` for the arguments."""
    return act_and_mul(h, activation="gelu_tanh", **kwargs)
