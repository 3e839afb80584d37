"""Grouped GEMM ``[M, K] x [E, N, K] -> [M, N]`` over rows grouped by expert (CONTRACT.md section 4),
and its backward (section 8): ``grouped_gemm_dgrad`` (``d_x``), ``grouped_gemm_wgrad`` (``d_w``), and
``grouped_gemm`` differentiable in ``x`` and ``w`` (a ``torch.autograd.Function`` whose backward runs
those two ops with the forward's ``implementation``; after tokamax ``_src/ops/ragged_dot/base.py``:
the op owns its VJP, each half an op of its own). 4-bit weights (MXFP4, INT4 group 32: section 9) are
a ``w_format`` of ``grouped_gemm``, differentiable in ``x`` only (straight-through). An optional per-expert
``bias [E_local, N]`` (gpt-oss) is added before the rounding (section 4); its gradient is the op
``grouped_gemm_dbias`` (a segment sum of ``d_y``, section 8), and ``grouped_gemm`` is differentiable in
``bias`` for float, FP8 and 4-bit weights alike.

Mirror: ``moe_pallas/ops/grouped_gemm/api.py``.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from moe_contract.op_checks import (
    check_grouped_gemm,
    check_grouped_gemm_dbias,
    check_grouped_gemm_dgrad,
    check_grouped_gemm_wgrad,
)
from moe_contract.validation import check_choice
from moe_torch.ops.common import first_order_backward, resolve_dtype, takes_torch_tensors
from moe_torch.ops.dispatch import dispatch
from moe_torch.ops.grouped_gemm.kernels import DGRAD_KERNELS, KERNELS, WGRAD_KERNELS
from moe_torch.ops.grouped_gemm.reference import (
    grouped_gemm_dbias_reference,
    grouped_gemm_dgrad_reference,
    grouped_gemm_reference,
    grouped_gemm_wgrad_reference,
)
from moe_torch.ops.quant.reference import dequantize_weight_4bit_reference

#: ``"triton"``: the library's choice among its Triton / Gluon kernels (the GPU default); ``"reference"``: plain torch;
#: each op also takes one kernel by name (``kernels.py``; the forward: ``gluon_fp8_block``, ``gluon_fp8_rowwise``,
#: ``gluon_bf16``, ``triton_tma``, ``triton_pointer``; a named forward's backward runs on ``"triton"``'s choice).
IMPLEMENTATIONS = ("triton", "reference")
KERNEL_NAMES, DGRAD_KERNEL_NAMES, WGRAD_KERNEL_NAMES = KERNELS.names(), DGRAD_KERNELS.names(), WGRAD_KERNELS.names()
FORWARD_IMPLEMENTATIONS = IMPLEMENTATIONS + KERNEL_NAMES


def _triton(*args, **kwargs):
    """The Triton backend, imported on first use (so that ``moe_torch`` imports without triton)."""
    try:
        from moe_torch.ops.grouped_gemm.triton import grouped_gemm_triton
    except ImportError as exc:
        raise NotImplementedError(f"grouped_gemm: triton is not importable ({exc})") from exc
    return grouped_gemm_triton(*args, **kwargs)


def _triton_dgrad(*args):
    """The Triton dgrad kernel, imported on first use."""
    try:
        from moe_torch.ops.grouped_gemm.triton_backward import grouped_gemm_dgrad_triton
    except ImportError as exc:
        raise NotImplementedError(f"grouped_gemm_dgrad: triton is not importable ({exc})") from exc
    return grouped_gemm_dgrad_triton(*args)


def _triton_wgrad(*args):
    """The Triton wgrad kernel, imported on first use; the Gluon one instead where :func:`_gluon_wgrad` serves."""
    try:
        from moe_torch.ops.grouped_gemm.triton_backward import grouped_gemm_wgrad_triton
    except ImportError as exc:
        raise NotImplementedError(f"grouped_gemm_wgrad: triton is not importable ({exc})") from exc
    d_w = _gluon_wgrad(*args)
    return grouped_gemm_wgrad_triton(*args) if d_w is None else d_w


def _gluon_wgrad(x, d_y, expert_offsets, out_dtype):
    """``d_w`` from the warp-specialized Gluon wgrad kernel (``gluon_backward.py``) where ``EPMOE_TRITON_GLUON_WGRAD``
    is on (the default; read at each call), ``gluon_wgrad_eligible`` accepts the request (bf16 / fp16, ``N % 128
    == 0``, ``K % 256 == 0``, contiguous, sm_90) and this GPU's tuned ``"op": "wgrad"`` entry, if any, measured it
    faster (``tuned_wgrad_options``: then with the entry's ``epilogue`` / ``num_stages``); else ``None`` (the Triton
    kernel serves it, with its tuned config where one is stored)."""
    from moe_torch.ops.triton_common import gluon_wgrad_enabled

    if not gluon_wgrad_enabled() or not x.is_cuda:
        return None
    try:
        from moe_torch.ops.grouped_gemm.gluon_backward import (gluon_wgrad_eligible, grouped_gemm_gluon_wgrad,
                                                               tuned_wgrad_options)
    except ImportError:  # triton without gluon
        return None
    if not gluon_wgrad_eligible(x, d_y, expert_offsets, out_dtype):
        return None
    options = tuned_wgrad_options(x, d_y, expert_offsets, out_dtype)
    if options is None:  # the tuned entry measured the Triton kernel faster here
        return None
    return grouped_gemm_gluon_wgrad(x, d_y, expert_offsets, out_dtype, **options)


def _triton_dbias(*args):
    """The Triton dbias kernel, imported on first use."""
    try:
        from moe_torch.ops.grouped_gemm.triton_backward import grouped_gemm_dbias_triton
    except ImportError as exc:
        raise NotImplementedError(f"grouped_gemm_dbias: triton is not importable ({exc})") from exc
    return grouped_gemm_dbias_triton(*args)


def _forward(x, w, expert_offsets, x_scale, w_scale, out_dtype, implementation, w_format=None, bias=None):
    """:func:`grouped_gemm` on validated arguments (no autograd: the inputs are detached)."""
    x, w = x.detach(), w.detach()
    w_scale = w_scale.detach() if w_scale is not None else None
    if x.shape[0] == 0:
        return torch.zeros((0, w.shape[1]), dtype=out_dtype, device=x.device)
    args = (x, w, expert_offsets, x_scale, w_scale, out_dtype)
    extra = {} if w_format is None else {"w_format": w_format}  # calls without 4-bit / bias stay as they were
    if bias is not None:
        extra["bias"] = bias.detach()
    backends = {"triton": lambda: _triton(*args, **extra), "reference": lambda: grouped_gemm_reference(*args, **extra)}
    if implementation in KERNEL_NAMES:  # one kernel by name: it serves, or says why not
        from moe_torch.ops.grouped_gemm import kernels

        return kernels.run(implementation, kernels.GemmRequest(*args, w_format=w_format, bias=extra.get("bias")))
    return dispatch("grouped_gemm", implementation, backends, x.device)


def _backward_implementation(implementation: str | None) -> str | None:
    """The backward ops' ``implementation`` for the forward's: a forward kernel asked for by name runs its backward on
    ``"triton"``'s choice (the dgrad and wgrad have their own kernels)."""
    return "triton" if implementation in KERNEL_NAMES else implementation


def _dgrad(d_y, w, expert_offsets, w_scale, out_dtype, implementation):
    """:func:`grouped_gemm_dgrad` on validated arguments."""
    d_y, w = d_y.detach(), w.detach()
    if d_y.shape[0] == 0:
        return torch.zeros((0, w.shape[2]), dtype=out_dtype, device=d_y.device)
    args = (d_y, w, expert_offsets, w_scale, out_dtype)
    if implementation in DGRAD_KERNEL_NAMES:  # one kernel by name: it serves, or says why not
        from moe_torch.ops.grouped_gemm import kernels

        return kernels.run_dgrad(implementation, kernels.DgradRequest(*args))
    backends = {"triton": lambda: _triton_dgrad(*args), "reference": lambda: grouped_gemm_dgrad_reference(*args)}
    return dispatch("grouped_gemm_dgrad", implementation, backends, d_y.device)


def _wgrad(x, d_y, expert_offsets, out_dtype, implementation):
    """:func:`grouped_gemm_wgrad` on validated arguments."""
    x, d_y = x.detach(), d_y.detach()
    if x.shape[0] == 0:  # no rows at all: every expert's gradient is exactly 0
        return torch.zeros((expert_offsets.shape[0] - 1, d_y.shape[1], x.shape[1]), dtype=out_dtype, device=x.device)
    args = (x, d_y, expert_offsets, out_dtype)
    if implementation in WGRAD_KERNEL_NAMES:  # one kernel by name: it serves, or says why not
        from moe_torch.ops.grouped_gemm import kernels

        return kernels.run_wgrad(implementation, kernels.WgradRequest(*args))
    backends = {"triton": lambda: _triton_wgrad(*args), "reference": lambda: grouped_gemm_wgrad_reference(*args)}
    return dispatch("grouped_gemm_wgrad", implementation, backends, x.device)


def _dbias(d_y, expert_offsets, out_dtype, implementation):
    """:func:`grouped_gemm_dbias` on validated arguments."""
    d_y = d_y.detach()
    if d_y.shape[0] == 0:  # no rows at all: every expert's gradient is exactly 0
        return torch.zeros((expert_offsets.shape[0] - 1, d_y.shape[1]), dtype=out_dtype, device=d_y.device)
    args = (d_y, expert_offsets, out_dtype)
    backends = {"triton": lambda: _triton_dbias(*args), "reference": lambda: grouped_gemm_dbias_reference(*args)}
    return dispatch("grouped_gemm_dbias", implementation, backends, d_y.device)


def _bias_grad(ctx, d_y, expert_offsets, index: int):
    """``d_bias`` (CONTRACT.md section 8: the segment sum of the cotangent as it comes, in ``bias``'s dtype)
    if the forward's input ``index`` (the bias) asks for it, else ``None``."""
    if ctx.bias_dtype is None or not ctx.needs_input_grad[index]:
        return None
    return _dbias(d_y, expert_offsets, ctx.bias_dtype, ctx.implementation)


class _GroupedGemmFunction(torch.autograd.Function):
    """Float ``grouped_gemm`` with its backward (CONTRACT.md section 8, GEMM 1 / GEMM 2):
    ``d_x = grouped_gemm_dgrad(d_y, w)`` in ``x.dtype``, ``d_w = grouped_gemm_wgrad(x, d_y)`` in
    ``w.dtype``, ``d_bias = grouped_gemm_dbias(d_y)`` in ``bias.dtype`` (the optional last input), each only
    if asked for, with the forward's ``implementation``. ``expert_offsets`` (integer) gets no gradient.
    ``d_y`` comes in the forward's ``out_dtype`` and is rounded to ``x.dtype`` for the two GEMMs (the ops
    take one float dtype; as torch's own ``.to(dtype)`` backward does, and the JAX mirror: no float32 copy
    of the weights); the bias gradient sums it as it comes. Once differentiable (no double backward)."""

    @staticmethod
    def forward(ctx, x, w, expert_offsets, out_dtype, implementation, bias=None):
        need_dx, need_dw = ctx.needs_input_grad[:2]
        # Keep only what the backward reads: w for d_x, x for d_w (x is an activation: [M_cap, K]).
        ctx.save_for_backward(x if need_dw else None, w if need_dx else None, expert_offsets)
        ctx.dtype, ctx.implementation = x.dtype, _backward_implementation(implementation)  # x.dtype == w.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _forward(x, w, expert_offsets, None, None, out_dtype, implementation, bias=bias)

    @staticmethod
    @first_order_backward("grouped_gemm")
    @once_differentiable
    def backward(ctx, d_y):
        x, w, expert_offsets = ctx.saved_tensors
        d_bias = _bias_grad(ctx, d_y, expert_offsets, 5)
        d_y = d_y.to(ctx.dtype)
        d_x = d_w = None
        if ctx.needs_input_grad[0]:
            d_x = _dgrad(d_y, w, expert_offsets, None, ctx.dtype, ctx.implementation)
        if ctx.needs_input_grad[1]:
            d_w = _wgrad(x, d_y, expert_offsets, ctx.dtype, ctx.implementation)
        return d_x, d_w, None, None, None, d_bias


class _Fp8GroupedGemmFunction(torch.autograd.Function):
    """FP8 ``grouped_gemm`` in a graph that asks for gradients: differentiable in the optional ``bias``
    only (``d_bias = grouped_gemm_dbias(d_y)``, CONTRACT.md section 8); a backward through an FP8 code or a
    scale that requires grad raises (the stage-level op is not differentiable in FP8 codes nor scales;
    section 8: the layer is straight-through itself)."""

    @staticmethod
    def forward(ctx, x, w, expert_offsets, x_scale, w_scale, out_dtype, implementation, bias=None):
        ctx.needs = [name for name, t in (("x", x), ("w", w), ("x_scale", x_scale), ("w_scale", w_scale))
                     if t.requires_grad]
        ctx.bias_dtype, ctx.implementation = (None if bias is None else bias.dtype), _backward_implementation(implementation)
        ctx.save_for_backward(expert_offsets)
        return _forward(x, w, expert_offsets, x_scale, w_scale, out_dtype, implementation, bias=bias)

    @staticmethod
    @first_order_backward("grouped_gemm")
    @once_differentiable
    def backward(ctx, d_y):
        if ctx.needs:
            raise TypeError(
                f"grouped_gemm: not differentiable for float8_e4m3fn inputs (FP8 codes and their scales get no gradient, "
                f"CONTRACT.md section 8: the backward is straight-through on the float weights, grouped_gemm_dgrad / "
                f"grouped_gemm_wgrad); got a gradient request through {', '.join(ctx.needs)}")
        (expert_offsets,) = ctx.saved_tensors
        return None, None, None, None, None, None, None, _bias_grad(ctx, d_y, expert_offsets, 7)


class _W4GroupedGemmFunction(torch.autograd.Function):
    """4-bit ``grouped_gemm`` (CONTRACT.md section 9) in a graph where ``x`` or the optional ``bias``
    requires grad: differentiable in ``x``, straight-through: ``d_x = grouped_gemm_dgrad(d_y, wd)`` with
    ``wd`` the dequantized weights (float32, rounded to ``x.dtype``), and in ``bias`` (``grouped_gemm_dbias``),
    with the forward's ``implementation``. The 4-bit codes and scales are frozen (no gradient;
    :func:`grouped_gemm` refuses a scale that requires grad). Only the codes are kept for the backward;
    ``wd [E_local, N, K]`` exists only while it runs (and only if ``d_x`` is asked for)."""

    @staticmethod
    def forward(ctx, x, w, expert_offsets, w_scale, out_dtype, w_format, implementation, bias=None):
        ctx.save_for_backward(w, w_scale, expert_offsets)
        ctx.dtype, ctx.w_format, ctx.implementation = x.dtype, w_format, _backward_implementation(implementation)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _forward(x, w, expert_offsets, None, w_scale, out_dtype, implementation, w_format, bias)

    @staticmethod
    @first_order_backward("grouped_gemm")
    @once_differentiable
    def backward(ctx, d_y):
        w, w_scale, expert_offsets = ctx.saved_tensors
        d_bias = _bias_grad(ctx, d_y, expert_offsets, 7)
        d_x = None
        if ctx.needs_input_grad[0]:
            d_y = d_y.to(ctx.dtype)
            wd = dequantize_weight_4bit_reference(w, w_scale, ctx.w_format, ctx.dtype)
            d_x = _dgrad(d_y, wd, expert_offsets, None, ctx.dtype, ctx.implementation)
        return d_x, None, None, None, None, None, None, d_bias


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
    w_format: str | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
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
        ``x`` or ``y``, but the result is then undefined. ``implementation="reference"`` reads them on
        the host anyway and raises ValueError for such values.
      x_scale: FP8 only, float32 dequantization multiplier: ``[]`` per-tensor, ``[M_cap, 1]``
        per-token, or ``[M_cap, K // G]`` per-token-group.
      w_scale: FP8: float32 ``[E_local]`` per-expert, ``[E_local, N]`` per-output-channel,
        or ``[E_local, ceil(N/128), ceil(K/128)]`` 128x128 blocks. 4-bit: ``[E_local, N, K // 32]``,
        one per group of 32 along K: uint8 e8m0 codes (``2^(s - 127)``) for ``"mxfp4"``, bf16
        multipliers for ``"int4"``.
      out_dtype: result dtype; default ``x.dtype`` (bf16 for FP8 inputs).
      implementation: ``None`` (CUDA tensors: ``"triton"``, falling back to ``"reference"``
        with a logged warning; CPU tensors: ``"reference"``), ``"triton"`` (the library's choice among its kernels:
        the device's tuned table, looked up by architecture then device kind, else measured rules;
        ``kernels.py: default_kernel``), ``"reference"``, or one kernel by name (``kernels.py``):
        ``"gluon_fp8_block"``, ``"gluon_fp8_rowwise"``, ``"gluon_bf16"``, ``"triton_tma"``, ``"triton_pointer"``;
        a named kernel that cannot serve the request raises NotImplementedError saying why, and its backward runs
        on ``"triton"``. The same contract whichever kernel runs.
      w_format: ``None`` (float / FP8 ``w``), or for uint8 ``w`` (required there) ``"mxfp4"`` (e2m1 codes,
        OCP MX v1.0) or ``"int4"`` (offset-binary ``code - 8``, compressed-tensors ``pack-quantized``).
        ``x`` stays float (weight-only, no ``x_scale``), ``K % 32 == 0``; the weights are dequantized in
        float32 and rounded to ``x.dtype`` before the multiply (the Triton kernel decodes each tile).
      bias: optional ``[E_local, N]`` float32, bf16 or ``x``'s float dtype (gpt-oss's ``gate_up_proj_bias`` /
        ``down_proj_bias``): ``bias[e]`` is widened to float32 and added to the accumulator of every row of
        ``e`` (FP8: after the scales) before the one rounding to ``out_dtype`` (CONTRACT.md section 4); rows
        ``>= offsets[-1]`` stay zero.

    Returns: ``y [M_cap, N]``.

    Differentiable in ``x`` and ``w`` for float inputs (autograd, when either requires grad): the
    backward is :func:`grouped_gemm_dgrad` (``d_x`` in ``x.dtype``) and :func:`grouped_gemm_wgrad`
    (``d_w`` in ``w.dtype``) with the same ``implementation``. FP8 inputs are not differentiable: if an
    FP8 code or a scale requires grad, the backward raises TypeError (never a wrong gradient). 4-bit
    weights: differentiable in ``x`` only, straight-through (``d_x = grouped_gemm_dgrad(d_y, wd)``, ``wd``
    the dequantized weights in ``x.dtype``); codes and scales are frozen, and a ``w_scale`` that requires
    grad (with grad mode on) is a TypeError. ``bias`` is differentiable with every kind of weights:
    ``d_bias = grouped_gemm_dbias(d_y)`` in ``bias.dtype`` (CONTRACT.md section 8).

    Raises: ValueError (shapes, missing or unexpected scales, ``w_format`` missing for uint8 ``w`` or
      given for another ``w``, ``K % 32 != 0`` with 4-bit ``w``, ``bias`` not ``[E_local, N]``; on the reference,
      ``expert_offsets`` not non-decreasing within ``[0, M_cap]``), TypeError
      (dtypes, ``bias``'s included; a 4-bit ``w_scale`` that requires grad),
      NotImplementedError (``implementation="triton"`` where the kernel cannot run, e.g.
      per-token-group scales whose group ``K // x_scale.shape[1]`` has no power-of-2 divisor >= 32).
    """
    op = "grouped_gemm"
    out_dtype = resolve_dtype(check_grouped_gemm(op, x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format,
                                                 bias))
    check_choice(op, "implementation", implementation, (None, *FORWARD_IMPLEMENTATIONS))
    bias_grad = torch.is_grad_enabled() and bias is not None and bias.requires_grad
    if w_format is not None:
        if torch.is_grad_enabled() and w_scale.requires_grad:
            raise TypeError(f"{op}: w_scale must not require grad: 4-bit scales are frozen ({w_format} codes and "
                            f"scales get no gradient, CONTRACT.md section 9; only x is differentiable); got "
                            f"w_scale.requires_grad=True (detach it or set requires_grad=False)")
        if (torch.is_grad_enabled() and x.requires_grad) or bias_grad:
            return _W4GroupedGemmFunction.apply(x, w, expert_offsets, w_scale, out_dtype, w_format, implementation, bias)
        return _forward(x, w, expert_offsets, None, w_scale, out_dtype, implementation, w_format, bias)
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, x_scale, w_scale))
    if (grads or bias_grad) and x_scale is None:
        return _GroupedGemmFunction.apply(x, w, expert_offsets, out_dtype, implementation, bias)
    if grads or bias_grad:
        return _Fp8GroupedGemmFunction.apply(x, w, expert_offsets, x_scale, w_scale, out_dtype, implementation, bias)
    return _forward(x, w, expert_offsets, x_scale, w_scale, out_dtype, implementation, bias=bias)


@takes_torch_tensors
def grouped_gemm_dgrad(
    d_y: torch.Tensor,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    w_scale: torch.Tensor | None = None,
    out_dtype=None,
    implementation: str | None = None,
) -> torch.Tensor:
    """The input gradient of :func:`grouped_gemm`: ``d_x[m] = d_y[m] @ w[e(m)]``, float32 accumulation.

    Args:
      d_y: ``[M_cap, N]`` float32 / bf16 / float16, the gradient of ``y``.
      w: ``[E_local, N, K]`` (the forward's weights, read as they are: no transposed copy), ``d_y``'s
        dtype, or float8_e4m3fn codes with ``w_scale``: straight-through, the weights dequantized
        (``q * w_scale``, a float32 product: ``w_scale`` multiplies) and rounded to ``d_y.dtype``.
      expert_offsets: ``[E_local + 1]`` int32, as for :func:`grouped_gemm` (non-decreasing within
        ``[0, M_cap]``; checked by the reference only, which reads them on the host: ValueError).
      w_scale: FP8 ``w`` only, float32: ``[E_local]``, ``[E_local, N]`` or ``[E_local, ceil(N/128), ceil(K/128)]``.
      out_dtype: result dtype; default ``d_y.dtype``.
      implementation: ``None`` (CUDA tensors: ``"triton"``, falling back to ``"reference"`` with a
        logged warning; CPU tensors: ``"reference"``), ``"triton"``, ``"reference"``, or one kernel by name
        (``kernels.py: DGRAD_KERNELS``: ``"gluon_bf16"``, ``"triton_tma"``, ``"triton_pointer"``; the wgrad's
        ``WGRAD_KERNELS``: ``"gluon_bf16"``, ``"triton_pointer"``), which raises NotImplementedError saying why
        where it cannot serve.

    Returns: ``d_x [M_cap, K]``; rows ``>= M = expert_offsets[-1]`` are zero and their ``d_y`` is never read.

    Raises: ValueError (shapes, a missing or unexpected ``w_scale``), TypeError (dtypes),
      NotImplementedError (``implementation="triton"`` where the kernel cannot run).
    """
    op = "grouped_gemm_dgrad"
    out_dtype = resolve_dtype(check_grouped_gemm_dgrad(op, d_y, w, expert_offsets, w_scale, out_dtype))
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS, *DGRAD_KERNEL_NAMES))
    return _dgrad(d_y, w, expert_offsets, w_scale, out_dtype, implementation)


@takes_torch_tensors
def grouped_gemm_wgrad(
    x: torch.Tensor,
    d_y: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    out_dtype=torch.float32,
    implementation: str | None = None,
) -> torch.Tensor:
    """The weight gradient of :func:`grouped_gemm`: ``d_w[e] = d_y[rows(e)].T @ x[rows(e)]`` (a
    K-grouped GEMM: the contraction runs over each expert's rows), float32 accumulation.

    Args:
      x: ``[M_cap, K]`` float32 / bf16 / float16, the forward's input.
      d_y: ``[M_cap, N]``, ``x``'s dtype, the gradient of ``y``.
      expert_offsets: ``[E_local + 1]`` int32, as for :func:`grouped_gemm`.
      out_dtype: result dtype; default float32.
      implementation: as :func:`grouped_gemm_dgrad`.

    Returns: ``d_w [E_local, N, K]`` (the weight layout); an expert with no rows gets exactly 0; rows
    ``>= M = expert_offsets[-1]`` of ``x`` and ``d_y`` are never read.

    Raises: ValueError (shapes), TypeError (dtypes), NotImplementedError (``implementation="triton"``
      where the kernel cannot run).
    """
    op = "grouped_gemm_wgrad"
    out_dtype = resolve_dtype(check_grouped_gemm_wgrad(op, x, d_y, expert_offsets, out_dtype))
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS, *WGRAD_KERNEL_NAMES))
    return _wgrad(x, d_y, expert_offsets, out_dtype, implementation)


@takes_torch_tensors
def grouped_gemm_dbias(
    d_y: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    out_dtype=torch.float32,
    implementation: str | None = None,
) -> torch.Tensor:
    """The bias gradient of :func:`grouped_gemm`: ``d_bias[e] = sum of d_y[rows(e)]`` (a segment sum over each
    expert's rows), float32 accumulation (CONTRACT.md section 8).

    Args:
      d_y: ``[M_cap, N]`` float32 / bf16 / float16, the gradient of ``y``.
      expert_offsets: ``[E_local + 1]`` int32 (gives ``E_local``), as for :func:`grouped_gemm` (non-decreasing
        within ``[0, M_cap]``; checked by the reference only, which reads them on the host: ValueError).
      out_dtype: result dtype (``bias``'s, in the autograd backward); default float32.
      implementation: ``None`` (CUDA tensors: ``"triton"``, falling back to ``"reference"`` with a
        logged warning; CPU tensors: ``"reference"``), ``"triton"`` or ``"reference"``.

    Returns: ``d_bias [E_local, N]``; an expert with no rows gets exactly 0; rows ``>= M = expert_offsets[-1]``
    of ``d_y`` are never read (a NaN there does not reach the result).

    Raises: ValueError (shapes), TypeError (dtypes), NotImplementedError (``implementation="triton"``
      where the kernel cannot run).
    """
    op = "grouped_gemm_dbias"
    out_dtype = resolve_dtype(check_grouped_gemm_dbias(op, d_y, expert_offsets, out_dtype))
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    return _dbias(d_y, expert_offsets, out_dtype, implementation)
