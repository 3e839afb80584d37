"""Grouped GEMM ``[M, K] x [E, N, K] -> [M, N]`` over rows grouped by expert (CONTRACT.md section 4),
and its backward (section 8): :func:`grouped_gemm_dgrad`, :func:`grouped_gemm_wgrad`, and
:func:`grouped_gemm` differentiable in ``x`` and ``w`` through ``jax.custom_vjp``; 4-bit weights
(section 9: MXFP4, INT4 group 32), differentiable in ``x`` (straight-through). An optional per-expert
``bias [E_local, N]`` (gpt-oss) is added before the rounding (section 4); its gradient is the op
:func:`grouped_gemm_dbias` (a segment sum of ``d_y``, section 8), and :func:`grouped_gemm` is
differentiable in ``bias`` for float, FP8 and 4-bit weights alike.

Mirror: ``moe_torch/ops/grouped_gemm/api.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from moe_contract.op_checks import (check_grouped_gemm, check_grouped_gemm_dbias, check_grouped_gemm_dgrad,
                                    check_grouped_gemm_wgrad)
from moe_contract.validation import check_choice
from moe_pallas.ops.common import cast_rounded, first_order_only, resolve_dtype, takes_jax_arrays
from moe_pallas.ops.dispatch import dispatch
from moe_pallas.ops.grouped_gemm import backend_table, kernels
from moe_pallas.ops.grouped_gemm.config import gpu_device_spec
from moe_pallas.ops.grouped_gemm.pallas_triton import grouped_gemm_pallas_triton
from moe_pallas.ops.grouped_gemm.pallas_triton_backward import (grouped_gemm_dbias_pallas_triton,
                                                                 grouped_gemm_dgrad_pallas_triton,
                                                                 grouped_gemm_wgrad_pallas_triton)
from moe_pallas.ops.grouped_gemm.reference import (grouped_gemm_dbias_reference, grouped_gemm_dgrad_reference,
                                                   grouped_gemm_reference, grouped_gemm_wgrad_reference)
from moe_pallas.ops.quant.reference import dequantize_weight_4bit_reference

IMPLEMENTATIONS = ("pallas_mosaic_gpu", "pallas_triton", "reference")
#: The backward ops' backends.
DGRAD_IMPLEMENTATIONS = ("pallas_mosaic_gpu", "pallas_triton", "reference")
WGRAD_IMPLEMENTATIONS = ("pallas_mosaic_gpu", "pallas_triton", "reference")
#: The bias gradient's backends (a segment sum: no Mosaic GPU kernel; its forward maps to the default order).
DBIAS_IMPLEMENTATIONS = ("pallas_triton", "reference")


def _mosaic(x, w, expert_offsets, x_scale, w_scale, out_dtype, bias=None):
    """The Hopper backend: GPU only (Mosaic GPU has no CPU interpret mode for this kernel)."""
    if jax.default_backend() != "gpu":
        raise NotImplementedError(f"grouped_gemm[pallas_mosaic_gpu]: needs a Hopper GPU; the default backend is {jax.default_backend()!r}")
    from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu import grouped_gemm_pallas_mosaic_gpu

    extra = {} if bias is None else {"bias": bias}
    return grouped_gemm_pallas_mosaic_gpu(x, w, expert_offsets, x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype,
                                          **extra)


@takes_jax_arrays
def grouped_gemm(
    x: jax.Array,
    w: jax.Array,
    expert_offsets: jax.Array,
    *,
    x_scale: jax.Array | None = None,
    w_scale: jax.Array | None = None,
    out_dtype=None,
    implementation: str | None = None,
    w_format: str | None = None,
    bias: jax.Array | None = None,
) -> jax.Array:
    """``y[m] = x[m] @ w[e(m)].T (+ bias[e(m)])``, expert ``e(m)`` given by ``expert_offsets``; float32 accumulation.

    Args:
      x: ``[M_cap, K]``, float32 / bf16 / float16, or float8_e4m3fn codes.
      w: ``[E_local, N, K]`` (out, in), the same float dtype as ``x``, or float8_e4m3fn when
        ``x`` is; or 4-bit packed codes ``[E_local, N, K // 2]`` uint8 with ``w_format`` (two codes a
        byte, element ``2i`` in the low nibble; CONTRACT.md section 9).
      expert_offsets: ``[E_local + 1]`` int32, rows ``[offsets[e], offsets[e+1])`` use ``w[e]``;
        rows ``>= offsets[-1]`` are not computed (zero in the result). They must be non-decreasing
        within ``[0, M_cap]`` (as ``routing_metadata`` makes them). The kernels check only the shape and
        dtype (the values would need a host sync): they clamp other values and never address outside
        ``x`` or ``y``, but the result is then undefined. ``implementation="reference"`` raises ValueError
        for such values when they are concrete (not under ``jax.jit``, where they are tracers), as do the
        backward ops' references.
      x_scale: FP8 only, float32 dequantization multiplier: ``[]`` per-tensor, ``[M_cap, 1]``
        per-token, or ``[M_cap, K // G]`` per-token-group.
      w_scale: FP8: float32 ``[E_local]`` per-expert, ``[E_local, N]`` per-output-channel,
        or ``[E_local, ceil(N/128), ceil(K/128)]`` 128x128 blocks. 4-bit: ``[E_local, N, K // 32]``,
        one per group of 32 along K: uint8 e8m0 codes (``2^(s - 127)``) for ``"mxfp4"``, bf16
        multipliers for ``"int4"``.
      out_dtype: result dtype; default ``x.dtype`` (bf16 for FP8 inputs).
      implementation: ``"pallas_mosaic_gpu"`` (Hopper GPUs only; no 4-bit weights), ``"pallas_triton"``
        (interpreted on the CPU), ``"reference"``, or ``None``: on a GPU the backend measured fastest for this
        layout and shape on this device kind (the nearest ``M_cap`` of the same ``N``, ``K`` and layout in
        ``tuned/<device kind>.json``, ``backend_table.py``), else the heuristic order (Mosaic GPU first; FP8 with
        128x128 weight blocks Pallas-Triton first); one that cannot serve falls through the rest of the order
        with a logged warning. The reference on the CPU.
      w_format: ``None`` (float / FP8 ``w``), or for uint8 ``w`` (required there) ``"mxfp4"`` (e2m1 codes,
        OCP MX v1.0) or ``"int4"`` (offset-binary ``code - 8``, compressed-tensors ``pack-quantized``).
        ``x`` stays float (weight-only, no ``x_scale``), ``K % 32 == 0``; the weights are dequantized in
        float32 and rounded to ``x.dtype`` before the multiply (the Pallas-Triton kernel decodes each tile).
      bias: optional ``[E_local, N]`` float32, bf16 or ``x``'s float dtype (gpt-oss's ``gate_up_proj_bias`` /
        ``down_proj_bias``): ``bias[e]`` is widened to float32 and added to the accumulator of every row of
        ``e`` (FP8: after the scales) before the one rounding to ``out_dtype`` (CONTRACT.md section 4); rows
        ``>= offsets[-1]`` stay zero. Every backend serves it (Mosaic GPU in its epilogue).

    Returns: ``y [M_cap, N]``.

    Differentiable (``jax.custom_vjp``, under ``jax.jit`` and ``shard_map`` alike) in ``x`` and ``w`` for
    float inputs: the backward is :func:`grouped_gemm_dgrad` and :func:`grouped_gemm_wgrad` with the same
    ``implementation`` where they have it (else their default order), on the cotangent rounded to
    ``x.dtype``; ``d_x`` / ``d_w`` come back in ``x``'s / ``w``'s dtype; ``expert_offsets`` gets none.
    4-bit weights: differentiable in ``x`` only, straight-through (CONTRACT.md section 9):
    ``d_x = grouped_gemm_dgrad(d_y, wd)``, ``wd`` the dequantized weights rounded to ``x.dtype`` (one
    expert's float32 decode live at a time); the codes and scales are frozen: the codes are integers (no
    gradient), and a gradient asked through an INT4 bf16 ``w_scale`` is a TypeError (raised when
    ``jax.grad`` / ``jax.vjp`` traces the call, as ``moe_torch`` raises for a scale that requires grad).
    ``bias`` is differentiable with every kind of weights: ``d_bias = grouped_gemm_dbias(d_y)`` (the
    cotangent as it comes, summed per expert in float32) in ``bias``'s dtype (CONTRACT.md section 8).

    Raises: ValueError (shapes, missing or unexpected scales, ``w_format`` missing for uint8 ``w`` or
      given for another ``w``, ``K % 32 != 0`` with 4-bit ``w``, ``bias`` not ``[E_local, N]``; on the reference,
      concrete ``expert_offsets`` not non-decreasing within ``[0, M_cap]``), TypeError
      (dtypes, ``bias``'s included; and when a gradient is asked through float8_e4m3fn inputs, which are
      not differentiable: CONTRACT.md section 8, or through a 4-bit ``w_scale``; raised when ``jax.grad`` /
      ``jax.vjp`` traces the call),
      NotImplementedError (``implementation="pallas_triton"`` with per-token-group scales whose
      group size ``K // x_scale.shape[1]`` has no power-of-two divisor >= 16;
      ``implementation="pallas_mosaic_gpu"`` off a GPU or outside its limits, see
      ``moe_pallas/ops/grouped_gemm/pallas_mosaic_gpu.py``, or with 4-bit weights).
    """
    op = "grouped_gemm"
    out_dtype = resolve_dtype(check_grouped_gemm(op, x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format,
                                                 bias))
    M_cap, N = x.shape[0], w.shape[1]
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    if M_cap == 0:
        return jnp.zeros((0, N), out_dtype)
    # a derivative of the gradient raises, naming the op
    x, w, x_scale, w_scale, bias = first_order_only(op, x, w, x_scale, w_scale, bias)
    if w_format is not None:  # 4-bit weights: differentiable in x (and bias)
        return _grouped_gemm_4bit(x, w, expert_offsets, w_scale, bias, out_dtype, w_format, implementation)
    if x_scale is None:  # float inputs: differentiable in x and w (and bias)
        return _grouped_gemm_float(x, w, expert_offsets, bias, out_dtype, implementation)
    return _grouped_gemm_fp8(x, w, expert_offsets, x_scale, w_scale, bias, out_dtype, implementation)


def _default_order(op: str, implementation: str | None, layout: str, M_cap: int, N: int, K: int):
    """The order ``dispatch`` tries when ``implementation`` is ``None``: per op, layout and shape
    (``backend_table.default_order``: the measured table of this device, else its heuristic); ``None``
    (unused, no table read) for an explicit ``implementation``, after ``NotImplementedError`` where this GPU cannot
    run that kernel at all (``kernels.py``: Mosaic GPU off sm_90)."""
    if implementation is not None:
        spec = gpu_device_spec()
        if spec is not None and implementation in kernels.KERNELS.choices:  # a GPU that cannot run it says so
            kernels.KERNELS.check(implementation, spec, layout)
        return None
    return backend_table.default_order(op, layout, M_cap=M_cap, N=N, K=K)


def _forward(x, w, expert_offsets, x_scale, w_scale, out_dtype, implementation, w_format=None, bias=None):
    """The forward's dispatch (inputs validated); the default order from ``backend_table``."""
    extra = {} if w_format is None else {"w_format": w_format}  # calls without 4-bit / bias stay as they were
    if bias is not None:
        extra["bias"] = bias
    order = _default_order("grouped_gemm", implementation, backend_table.gemm_layout(x, x_scale, w_scale, w_format),
                           M_cap=x.shape[0], N=w.shape[1], K=x.shape[1])
    return dispatch("grouped_gemm", implementation, order=order, backends={
        "pallas_mosaic_gpu": lambda: (_mosaic(x, w, expert_offsets, x_scale, w_scale, out_dtype, bias)
                                      if w_format is None else _mosaic_4bit(w_format)),
        "pallas_triton": lambda: grouped_gemm_pallas_triton(
            x, w, expert_offsets, x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype, **extra),
        "reference": lambda: grouped_gemm_reference(x, w, expert_offsets, x_scale, w_scale, out_dtype, **extra),
    })


def _mosaic_4bit(w_format: str):
    """The Mosaic GPU kernel has no 4-bit weight path: ``NotImplementedError`` (the default order then
    takes the Pallas-Triton kernel, with a logged warning)."""
    raise NotImplementedError(f"grouped_gemm[pallas_mosaic_gpu]: no 4-bit weights in the Mosaic GPU kernel; got "
                              f"w_format={w_format!r} (implementation='pallas_triton' serves them)")


def backward_implementation(implementation: str | None, available: tuple[str, ...], *, fp8_weights: bool = False
                            ) -> str | None:
    """The backward ops' backend for a forward ``implementation``: the same one where it can serve them,
    else ``None`` (their default order: the Pallas-Triton kernel on a GPU, the reference on a CPU). The
    Mosaic GPU dgrad takes no FP8 weights (``fp8_weights``: the straight-through dgrad of an FP8 layer)."""
    if implementation == "pallas_mosaic_gpu" and fp8_weights:
        return None
    return implementation if implementation in available else None


def _mosaic_backward(name: str):
    """The Mosaic GPU backward kernel ``name`` of ``pallas_mosaic_gpu_backward.py``: GPU only."""
    if jax.default_backend() != "gpu":
        op = name.removesuffix("_pallas_mosaic_gpu")
        raise NotImplementedError(f"{op}[pallas_mosaic_gpu]: needs a Hopper GPU; the default backend is "
                                  f"{jax.default_backend()!r}")
    from moe_pallas.ops.grouped_gemm import pallas_mosaic_gpu_backward

    return getattr(pallas_mosaic_gpu_backward, name)


# --- Differentiable forward (CONTRACT.md section 8): thin glue over the forward and backward ops ---
# expert_offsets is an ordinary (integer) argument that gets no cotangent; out_dtype and implementation
# are static; bias is an array or None (no leaves: its cotangent is then None). The cotangent d_y is
# rounded to x's dtype before the backward GEMMs (the ops take one float dtype, as a bf16 training step
# keeps its gradients in bf16); d_x and d_w come back in x's and w's dtypes (custom_vjp's rule), each
# accumulated in float32. The bias gradient sums d_y as it comes (grouped_gemm_dbias), in bias's dtype;
# the residuals carry that dtype in a 0-size array (never the bias itself).


def _bias_dtype_carrier(bias):
    return None if bias is None else jnp.zeros((0,), bias.dtype)


def _bias_grad(carrier, d_y, expert_offsets, implementation):
    """``d_bias`` in the carried dtype (``None`` without a bias)."""
    if carrier is None:
        return None
    return grouped_gemm_dbias(d_y, expert_offsets, out_dtype=carrier.dtype,
                              implementation=backward_implementation(implementation, DBIAS_IMPLEMENTATIONS))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _grouped_gemm_float(x, w, expert_offsets, bias, out_dtype, implementation):
    return _forward(x, w, expert_offsets, None, None, out_dtype, implementation, bias=bias)


def _grouped_gemm_float_fwd(x, w, expert_offsets, bias, out_dtype, implementation):
    y = _forward(x, w, expert_offsets, None, None, out_dtype, implementation, bias=bias)
    return y, (x, w, expert_offsets, _bias_dtype_carrier(bias))


def _grouped_gemm_float_bwd(out_dtype, implementation, residuals, d_y):
    x, w, expert_offsets, bias_carrier = residuals
    d_bias = _bias_grad(bias_carrier, d_y, expert_offsets, implementation)
    d_y = d_y.astype(x.dtype)
    d_x = grouped_gemm_dgrad(d_y, w, expert_offsets, out_dtype=x.dtype,
                             implementation=backward_implementation(implementation, DGRAD_IMPLEMENTATIONS))
    d_w = grouped_gemm_wgrad(x, d_y, expert_offsets, out_dtype=w.dtype,
                             implementation=backward_implementation(implementation, WGRAD_IMPLEMENTATIONS))
    return d_x, d_w, None, d_bias


_grouped_gemm_float.defvjp(_grouped_gemm_float_fwd, _grouped_gemm_float_bwd)


# FP8: differentiable in bias only. symbolic_zeros=True hands the forward rule each input's ``perturbed``
# flag, so a gradient asked through an FP8 code or a scale is refused while jax.grad / jax.vjp traces the
# call (never a wrong gradient), and one asked through bias alone is served.


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _grouped_gemm_fp8(x, w, expert_offsets, x_scale, w_scale, bias, out_dtype, implementation):
    return _forward(x, w, expert_offsets, x_scale, w_scale, out_dtype, implementation, bias=bias)


def _grouped_gemm_fp8_fwd(x, w, expert_offsets, x_scale, w_scale, bias, out_dtype, implementation):
    if any(a.perturbed for a in (x, w, x_scale, w_scale)):
        raise TypeError(
            "grouped_gemm: float8_e4m3fn inputs (x, w, x_scale, w_scale) are not differentiable: FP8 codes are "
            "frozen and a gradient through them would be wrong (CONTRACT.md section 8: the backward is "
            "straight-through, d_x = grouped_gemm_dgrad(d_y, q_w, expert_offsets, w_scale=w_scale) on the "
            "dequantized weights); got a gradient request through an FP8 grouped_gemm")
    x, w, expert_offsets, x_scale, w_scale = (a.value for a in (x, w, expert_offsets, x_scale, w_scale))
    bias = None if bias is None else bias.value
    y = _forward(x, w, expert_offsets, x_scale, w_scale, out_dtype, implementation, bias=bias)
    return y, (expert_offsets, _bias_dtype_carrier(bias))


def _grouped_gemm_fp8_bwd(out_dtype, implementation, residuals, d_y):
    expert_offsets, bias_carrier = residuals
    if isinstance(d_y, SymbolicZero):  # y's cotangent is a known zero (y unused): an ordinary zero array
        d_y = jnp.zeros(d_y.shape, d_y.dtype)
    return None, None, None, None, None, _bias_grad(bias_carrier, d_y, expert_offsets, implementation)


_grouped_gemm_fp8.defvjp(_grouped_gemm_fp8_fwd, _grouped_gemm_fp8_bwd, symbolic_zeros=True)


# 4-bit weights (CONTRACT.md section 9): differentiable in x only, straight-through. symbolic_zeros=True
# hands the forward rule each input's ``perturbed`` flag, so a gradient asked through the (bf16, INT4)
# scale is refused while jax.grad / jax.vjp traces the call, instead of silently coming back as zero.
# The residuals are the codes, scales and offsets (never a float copy of the weights) and a 0-size
# array that carries x's dtype.


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _grouped_gemm_4bit(x, w, expert_offsets, w_scale, bias, out_dtype, w_format, implementation):
    return _forward(x, w, expert_offsets, None, w_scale, out_dtype, implementation, w_format, bias)


def _grouped_gemm_4bit_fwd(x, w, expert_offsets, w_scale, bias, out_dtype, w_format, implementation):
    if w_scale.perturbed:
        raise TypeError(f"grouped_gemm: w_scale gets no gradient: 4-bit scales are frozen ({w_format} codes and "
                        f"scales get none, CONTRACT.md section 9; only x is differentiable); got a gradient request "
                        f"through w_scale (take it out of the differentiated arguments, or jax.lax.stop_gradient it)")
    x, w, expert_offsets, w_scale = x.value, w.value, expert_offsets.value, w_scale.value
    bias = None if bias is None else bias.value
    y = _forward(x, w, expert_offsets, None, w_scale, out_dtype, implementation, w_format, bias)
    return y, (w, w_scale, expert_offsets, jnp.zeros((0,), x.dtype), _bias_dtype_carrier(bias))


def _grouped_gemm_4bit_bwd(out_dtype, w_format, implementation, residuals, d_y):
    w, w_scale, expert_offsets, x_dtype_carrier, bias_carrier = residuals
    dtype = x_dtype_carrier.dtype
    if isinstance(d_y, SymbolicZero):  # y's cotangent is a known zero (y unused): an ordinary zero array
        d_y = jnp.zeros(d_y.shape, d_y.dtype)
    d_bias = _bias_grad(bias_carrier, d_y, expert_offsets, implementation)
    d_y = d_y.astype(dtype)
    # wd rounded to d_y's (x's) dtype, an expert at a time (one [N, K] float32 decode live)
    wd = jax.lax.map(lambda e: cast_rounded(dequantize_weight_4bit_reference(e[0], e[1], w_format), dtype), (w, w_scale))
    d_x = grouped_gemm_dgrad(d_y, wd, expert_offsets, out_dtype=dtype,
                             implementation=backward_implementation(implementation, DGRAD_IMPLEMENTATIONS))
    return d_x, None, None, None, d_bias


_grouped_gemm_4bit.defvjp(_grouped_gemm_4bit_fwd, _grouped_gemm_4bit_bwd, symbolic_zeros=True)


@takes_jax_arrays
def grouped_gemm_dgrad(
    d_y: jax.Array,
    w: jax.Array,
    expert_offsets: jax.Array,
    *,
    w_scale: jax.Array | None = None,
    out_dtype=None,
    implementation: str | None = None,
) -> jax.Array:
    """``d_x[m] = d_y[m] @ w[e(m)]``: the gradient of :func:`grouped_gemm` w.r.t. ``x`` (CONTRACT.md section 8).

    Args:
      d_y: ``[M_cap, N]`` float32 / bf16 / float16, the gradient of ``y``.
      w: ``[E_local, N, K]``, the forward's weights as they are (no transposed copy): ``d_y``'s dtype, or
        float8_e4m3fn codes with ``w_scale`` (straight-through: ``q_w * w_scale`` in float32, rounded to
        ``d_y.dtype``, used as float weights).
      expert_offsets: ``[E_local + 1]`` int32, as for :func:`grouped_gemm`; rows ``>= offsets[-1]`` are
        zero in ``d_x`` and never read from ``d_y``.
      w_scale: FP8 ``w`` only, float32 multiplier: ``[E_local]`` per-expert, ``[E_local, N]``
        per-channel, or ``[E_local, ceil(N/128), ceil(K/128)]`` 128x128 blocks.
      out_dtype: result dtype; default ``d_y.dtype``.
      implementation: ``"pallas_mosaic_gpu"`` (Hopper GPUs only; 16-bit float ``d_y`` and ``w``),
        ``"pallas_triton"`` (interpreted on the CPU), ``"reference"``, or ``None`` (on a GPU the measured
        choice of ``backend_table.py`` for op ``"grouped_gemm_dgrad"``, else Mosaic GPU, Pallas-Triton; the
        reference on the CPU).

    Returns: ``d_x [M_cap, K]``, float32 accumulation, in ``out_dtype``.

    Raises: ValueError (shapes, a missing or unexpected ``w_scale``), TypeError (dtypes),
      NotImplementedError (an explicit ``implementation`` outside its limits, see
      ``moe_pallas/ops/grouped_gemm/pallas_triton_backward.py`` and ``pallas_mosaic_gpu_backward.py``).

    Source: the transpose of the forward's ``y = x @ w[e].T``; tokamax ``dlhs_ragged_dot``.
    """
    op = "grouped_gemm_dgrad"
    out_dtype = resolve_dtype(check_grouped_gemm_dgrad(op, d_y, w, expert_offsets, w_scale, out_dtype))
    check_choice(op, "implementation", implementation, (None, *DGRAD_IMPLEMENTATIONS))
    M_cap, K = d_y.shape[0], w.shape[2]
    if M_cap == 0:
        return jnp.zeros((0, K), out_dtype)
    order = _default_order(op, implementation, backend_table.dgrad_layout(d_y, w_scale),
                           M_cap=M_cap, N=d_y.shape[1], K=K)
    return dispatch(op, implementation, order=order, backends={
        "pallas_mosaic_gpu": lambda: _mosaic_dgrad(d_y, w, expert_offsets, w_scale, out_dtype),
        "pallas_triton": lambda: grouped_gemm_dgrad_pallas_triton(d_y, w, expert_offsets, w_scale=w_scale,
                                                                  out_dtype=out_dtype),
        "reference": lambda: grouped_gemm_dgrad_reference(d_y, w, expert_offsets, w_scale, out_dtype),
    })


@takes_jax_arrays
def grouped_gemm_wgrad(
    x: jax.Array,
    d_y: jax.Array,
    expert_offsets: jax.Array,
    *,
    out_dtype=jnp.float32,
    implementation: str | None = None,
) -> jax.Array:
    """``d_w[e] = d_y[rows(e)].T @ x[rows(e)]``: the gradient of :func:`grouped_gemm` w.r.t. ``w`` (CONTRACT.md section 8).

    A K-grouped GEMM: the contraction runs over each expert's rows ``[offsets[e], offsets[e+1])``.

    Args:
      x: ``[M_cap, K]`` float32 / bf16 / float16, the forward's input (float: the layer passes the
        dequantized activations of an FP8 forward).
      d_y: ``[M_cap, N]``, ``x``'s dtype, the gradient of ``y``.
      expert_offsets: ``[E_local + 1]`` int32 (gives ``E_local``); rows ``>= offsets[-1]`` are never read.
      out_dtype: result dtype; default float32.
      implementation: ``"pallas_mosaic_gpu"`` (Hopper GPUs only; 16-bit float inputs), ``"pallas_triton"``
        (interpreted on the CPU), ``"reference"``, or ``None`` (on a GPU the measured choice of
        ``backend_table.py`` for op ``"grouped_gemm_wgrad"``, else Mosaic GPU, Pallas-Triton; the reference
        on the CPU).

    Returns: ``d_w [E_local, N, K]`` (the weight layout), float32 accumulation, in ``out_dtype``; an
      expert with no rows gets exactly 0.

    Raises: ValueError (shapes), TypeError (dtypes), NotImplementedError (an explicit ``implementation``
      outside its limits).

    Source: the transpose of the forward's ``y = x @ w[e].T``; tokamax ``drhs_ragged_dot``.
    """
    op = "grouped_gemm_wgrad"
    out_dtype = resolve_dtype(check_grouped_gemm_wgrad(op, x, d_y, expert_offsets, out_dtype))
    check_choice(op, "implementation", implementation, (None, *WGRAD_IMPLEMENTATIONS))
    E, N, K = expert_offsets.shape[0] - 1, d_y.shape[1], x.shape[1]
    if x.shape[0] == 0:  # no rows: every expert is empty
        return jnp.zeros((E, N, K), out_dtype)
    order = _default_order(op, implementation, backend_table.wgrad_layout(x), M_cap=x.shape[0], N=N, K=K)
    return dispatch(op, implementation, order=order, backends={
        "pallas_mosaic_gpu": lambda: _mosaic_backward("grouped_gemm_wgrad_pallas_mosaic_gpu")(
            x, d_y, expert_offsets, out_dtype=out_dtype),
        "pallas_triton": lambda: grouped_gemm_wgrad_pallas_triton(x, d_y, expert_offsets, out_dtype=out_dtype),
        "reference": lambda: grouped_gemm_wgrad_reference(x, d_y, expert_offsets, out_dtype),
    })


def _mosaic_dgrad(d_y, w, expert_offsets, w_scale, out_dtype):
    if w_scale is not None:
        raise NotImplementedError("grouped_gemm_dgrad[pallas_mosaic_gpu]: FP8 weights are not served (Hopper's FP8 "
                                  "wgmma needs K-major operands; the straight-through dgrad dequantizes): use "
                                  "pallas_triton")
    return _mosaic_backward("grouped_gemm_dgrad_pallas_mosaic_gpu")(d_y, w, expert_offsets, out_dtype=out_dtype)


@takes_jax_arrays
def grouped_gemm_dbias(
    d_y: jax.Array,
    expert_offsets: jax.Array,
    *,
    out_dtype=jnp.float32,
    implementation: str | None = None,
) -> jax.Array:
    """``d_bias[e] = sum of d_y[rows(e)]``: the gradient of :func:`grouped_gemm` w.r.t. ``bias`` (CONTRACT.md
    section 8), a segment sum over each expert's rows ``[offsets[e], offsets[e+1])``, float32 accumulation.

    Args:
      d_y: ``[M_cap, N]`` float32 / bf16 / float16, the gradient of ``y``.
      expert_offsets: ``[E_local + 1]`` int32 (gives ``E_local``); rows ``>= offsets[-1]`` are never read.
      out_dtype: result dtype (``bias``'s, in the ``custom_vjp``); default float32.
      implementation: ``"pallas_triton"`` (interpreted on the CPU), ``"reference"``, or ``None`` (the device's
        default order, ``moe_pallas.ops.dispatch``; the reference on the CPU).

    Returns: ``d_bias [E_local, N]`` in ``out_dtype``; an expert with no rows gets exactly 0; a NaN in a row
      ``>= M`` does not reach it.

    Raises: ValueError (shapes), TypeError (dtypes), NotImplementedError (an explicit ``implementation``
      outside its limits).

    Source: the transpose of the forward's broadcast ``y[rows(e)] += bias[e]``.
    """
    op = "grouped_gemm_dbias"
    out_dtype = resolve_dtype(check_grouped_gemm_dbias(op, d_y, expert_offsets, out_dtype))
    check_choice(op, "implementation", implementation, (None, *DBIAS_IMPLEMENTATIONS))
    E, N = expert_offsets.shape[0] - 1, d_y.shape[1]
    if d_y.shape[0] == 0:  # no rows: every expert is empty
        return jnp.zeros((E, N), out_dtype)
    return dispatch(op, implementation, {
        "pallas_triton": lambda: grouped_gemm_dbias_pallas_triton(d_y, expert_offsets, out_dtype=out_dtype),
        "reference": lambda: grouped_gemm_dbias_reference(d_y, expert_offsets, out_dtype),
    })
