"""Triton kernel for ``silu_and_mul`` / ``gelu_tanh_and_mul`` / ``swiglu_oai_and_mul`` (CONTRACT.md sections 3-4).

Dataflow, one program per ``[BLOCK_M rows] x [one column span]``::

    h [M, 2*I] (gate half | up half, or interleaved g0 u0 g1 u1 ...) --load, upcast to float32--> g, u
    a = act(g) * u                                        (float32; swiglu_oai: (uc + 1) * act(gc))
    no quant:  out [M, I] = cast_rne(a)                   (float32 / bf16 / fp16)
    FP8 quant: amax over the span (the row for per-token, a G-wide group for per-token-group)
               scale = max(amax, 1e-10) * float32(1/448)   [M, I // span] float32
               out = cast_rne(clamp(div_rn(a, scale), -448, 448))  float8_e4m3fn

The division is ``tl.math.div_rn`` (IEEE, correctly rounded); plain ``/`` lowers to the
approximate ``div.full.f32`` on NVIDIA GPUs and would break bit-identity with the references.
A span wider than ``config.MAX_SINGLE_CHUNK`` columns is walked twice (amax pass, quantize pass),
recomputing the same float32 activation, so any ``I`` and any ``group_size`` are served.

Gate/up layout (``INTERLEAVED``): concatenated, ``g`` and ``u`` are two ``[BLOCK_M, BLOCK_N]`` loads ``I``
columns apart; interleaved (gpt-oss), one load of the ``[BLOCK_M, BLOCK_N, 2]`` pairs of columns
``[2*c0, 2*c0 + 2*BLOCK_N)`` (contiguous in memory) split on the last axis (``tl.split``) into ``g`` (even
columns) and ``u`` (odd); the backward joins ``d_g``, ``d_u`` the same way (``tl.join``) into one store.

swiglu_oai (transformers ``GptOssExperts``): ``gc = min(g, 7)``, ``uc = clamp(u, -7, 7)`` written as
``tl.where`` selects (``tl.minimum`` / ``tl.maximum`` may drop a NaN: a NaN must stay NaN), then
``(uc + 1) * (gc * sigmoid(1.702 * gc))``.

GELU (tanh approximation) is evaluated as ``g * sigmoid(2 * sqrt(2/pi) * (g + 0.044715 g^3))``,
which equals ``0.5 * g * (1 + tanh(...))`` exactly in real arithmetic (``1 + tanh(z) =
2 * sigmoid(2z)``) and needs no ``tanh`` (absent from ``tl``; libdevice is not interpretable).

Must match ``moe_torch/ops/activation/reference.py`` (float32 outputs to float32 rounding,
FP8 codes and scales bit for bit given the same float32 activation values).

**Backward** (CONTRACT.md section 8), ``_act_and_mul_backward_kernel``, one program per
``[BLOCK_M rows] x [BLOCK_N columns]`` of ``d_a``, fused: ``h`` and ``d_a`` are read once,
``d_h`` written once::

    g, u = h[:, cols], h[:, I + cols]; da = d_a[:, cols]     (upcast to float32)
    silu:      s = sigmoid(g);  act = g s;  act' = s (1 + g (1 - s))
    gelu_tanh: q = sigmoid(2 c (g + 0.044715 g^3)) (= (1 + tanh z) / 2);  act = g q;
               act' = q + 2 c g q (1 - q) (1 + 3 * 0.044715 g^2)   (1 - tanh^2 z = 4 q (1 - q))
    d_h[:, cols] = da * u * act'     d_h[:, I + cols] = da * act   (cast once to d_h's dtype)
    swiglu_oai: s = sigmoid(1.702 gc);  d_g = where(g <= 7, da (uc + 1) s (1 + 1.702 gc (1 - s)), 0)
                d_u = where(-7 <= u <= 7, da gc s, 0)      (interleaved: d_g, d_u written interleaved)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moe_contract.config import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from moe_torch.ops.activation.config import (
    ActAndMulBackwardConfig,
    ActAndMulConfig,
    act_and_mul_backward_config,
    act_and_mul_config,
)
from moe_torch.ops.quant.reference import FP8_DTYPE
from moe_torch.ops.triton_common import MAX_GRID_AXIS_1, check_triton_device, fp8_scale, quantize_fp8_tile

#: ``2 * sqrt(2 / pi)``: ``0.5 * (1 + tanh(z)) == sigmoid(2 z)``.
_GELU_2C = tl.constexpr(2.0 * math.sqrt(2.0 / math.pi))
_GELU_CUBIC = tl.constexpr(0.044715)
#: swiglu_oai's clamp bound and sigmoid slope (``moe_contract.config``, CONTRACT.md section 4).
_SWIGLU_LIMIT = tl.constexpr(SWIGLU_OAI_LIMIT)
_SWIGLU_ALPHA = tl.constexpr(SWIGLU_OAI_ALPHA)

#: ``activation`` name -> the kernel's ``ACTIVATION`` constexpr.
ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}


@triton.jit
def _load_gate_up(
    h_ptr,  # [M, 2*I] float32 / bf16 / fp16
    row_off,  # [BLOCK_M] int64: row * stride_h
    row_mask,  # [BLOCK_M] bool
    col0,  # int: first column of the tile in [0, I)
    col_end,  # int: columns >= col_end are masked (<= I)
    I,  # int: intermediate size (offset of the up half when concatenated)
    INTERLEAVED: tl.constexpr,  # bool: h is g0 u0 g1 u1 ... (gpt-oss), else [g | u]
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``(g, u)`` ``[BLOCK_M, BLOCK_N]`` float32 (upcast right after the load; masked elements 0) of gate columns
    ``cols = col0 + [0, BLOCK_N)``. Interleaved: one load of the ``[BLOCK_M, BLOCK_N, 2]`` pairs
    ``h[rows, 2*cols + {0, 1}]`` (contiguous ``2*BLOCK_N`` columns), split on the last axis into gate (even) and up (odd)."""
    cols = col0 + tl.arange(0, BLOCK_N)
    mask = row_mask[:, None] & (cols < col_end)[None, :]
    if INTERLEAVED:
        pairs = h_ptr + row_off[:, None, None] + 2 * cols[None, :, None] + tl.arange(0, 2)[None, None, :]
        g, u = tl.split(tl.load(pairs, mask=mask[:, :, None], other=0.0).to(tl.float32))
    else:
        g_ptrs = h_ptr + row_off[:, None] + cols[None, :]
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(g_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    return g, u


@triton.jit
def _clamp_gate(g):
    """swiglu_oai's ``min(g, limit)`` as a select: a NaN stays NaN (``tl.minimum`` may drop it)."""
    return tl.where(g > _SWIGLU_LIMIT, _SWIGLU_LIMIT, g)


@triton.jit
def _clamp_up(u):
    """swiglu_oai's ``clamp(u, -limit, limit)`` as selects: a NaN stays NaN."""
    return tl.where(u > _SWIGLU_LIMIT, _SWIGLU_LIMIT, tl.where(u < -_SWIGLU_LIMIT, -_SWIGLU_LIMIT, u))


@triton.jit
def _gated_tile(
    h_ptr,  # [M, 2*I] float32 / bf16 / fp16
    row_off,  # [BLOCK_M] int64: row * stride_h
    row_mask,  # [BLOCK_M] bool
    col0,  # int: first gate column of the tile
    col_end,  # int: columns >= col_end are masked
    I,  # int: intermediate size
    ACTIVATION: tl.constexpr,  # 0: silu, 1: gelu_tanh, 2: swiglu_oai
    INTERLEAVED: tl.constexpr,  # bool: gate/up layout of h
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``act(g) * u`` for one ``[BLOCK_M, BLOCK_N]`` tile, float32 (swiglu_oai: ``(uc + 1) * act(gc)``)."""
    g, u = _load_gate_up(h_ptr, row_off, row_mask, col0, col_end, I, INTERLEAVED, BLOCK_M, BLOCK_N)
    return gated_values(g, u, ACTIVATION)  # masked elements are act(0) * (0 or 1) = 0: they never raise an amax


@triton.jit
def gated_values(
    g,  # float32 tile: gate values
    u,  # float32 tile of the same shape: up values
    ACTIVATION: tl.constexpr,  # 0: silu, 1: gelu_tanh, 2: swiglu_oai (ACTIVATION_CODES)
):
    """``act(g) * u`` in float32, elementwise (swiglu_oai: ``(uc + 1) * act(gc)``, the clamps as selects): the one
    formula of every Triton kernel that applies the activation (this module's, and the decode path's
    ``moe_torch/ops/decode/triton.py``, which computes ``g`` and ``u`` itself)."""
    if ACTIVATION == 0:
        a = g * tl.sigmoid(g) * u
    elif ACTIVATION == 1:
        a = g * tl.sigmoid(_GELU_2C * (g + _GELU_CUBIC * g * g * g)) * u
    else:
        gc = _clamp_gate(g)
        a = (_clamp_up(u) + 1.0) * (gc * tl.sigmoid(_SWIGLU_ALPHA * gc))
    return a



@triton.jit
def _act_and_mul_kernel(
    h_ptr,  # [M, 2*I] float32 / bf16 / fp16, gate half then up half
    out_ptr,  # [M, I] out dtype (float32 / bf16 / fp16), or float8_e4m3fn if QUANT
    scale_ptr,  # [M, I // SPAN] float32 dequant multipliers if QUANT (unused otherwise)
    M,  # int: rows
    I,  # int: intermediate size
    stride_h,  # int: h.stride(0)
    stride_out,  # int: out.stride(0)
    stride_scale,  # int: scale.stride(0)
    ACTIVATION: tl.constexpr,  # 0: silu, 1: gelu_tanh, 2: swiglu_oai
    QUANT: tl.constexpr,  # bool: FP8 quantization with one scale per (row, SPAN columns)
    SPAN: tl.constexpr,  # columns per program: BLOCK_N (no quant), I (per-token), G (per-token-group)
    SINGLE_CHUNK: tl.constexpr,  # bool: SPAN <= BLOCK_N (activation computed once)
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per chunk (power of 2)
    INTERLEAVED: tl.constexpr = False,  # bool: h is g0 u0 g1 u1 ... (gpt-oss), else [g | u]
):
    """Grid ``(cdiv(M, BLOCK_M), I // SPAN)`` (``cdiv(I, BLOCK_N)`` without quant).

    Program ``(pid_m, pid_n)`` writes ``out[pid_m*BLOCK_M : +BLOCK_M, pid_n*SPAN : +SPAN]`` and,
    with QUANT, ``scale[rows, pid_n]``. ``SPAN`` is a constexpr (one compile per model's ``I`` or
    ``G``) so that the chunk loops have static bounds (the interpreter's ``range`` over a runtime
    value breaks with numpy >= 2.4, triton-lang/triton#9171).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)  # int64: row * stride passes 2**31 for M * 2*I > 2**31 elements
    h_row = rows64 * stride_h
    out_row = rows64 * stride_out
    col_start = pid_n * SPAN
    col_end = tl.minimum(col_start + SPAN, I)
    offs = tl.arange(0, BLOCK_N)

    if SINGLE_CHUNK:
        cols = col_start + offs
        mask = row_mask[:, None] & (cols < col_end)[None, :]
        a = _gated_tile(h_ptr, h_row, row_mask, col_start, col_end, I, ACTIVATION, INTERLEAVED, BLOCK_M, BLOCK_N)
        if QUANT:
            scale = fp8_scale(tl.max(tl.abs(a), axis=1))
            tl.store(out_ptr + out_row[:, None] + cols[None, :], quantize_fp8_tile(a, scale), mask=mask)
            tl.store(scale_ptr + rows64 * stride_scale + pid_n, scale, mask=row_mask)
        else:
            tl.store(out_ptr + out_row[:, None] + cols[None, :], a.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # QUANT over a span wider than one chunk: amax pass, then quantize pass
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in range(0, SPAN, BLOCK_N):
            a = _gated_tile(h_ptr, h_row, row_mask, col_start + c, col_end, I, ACTIVATION, INTERLEAVED, BLOCK_M,
                            BLOCK_N)
            amax = tl.maximum(amax, tl.max(tl.abs(a), axis=1))
        scale = fp8_scale(amax)
        for c in range(0, SPAN, BLOCK_N):
            cols = col_start + c + offs
            mask = row_mask[:, None] & (cols < col_end)[None, :]
            a = _gated_tile(h_ptr, h_row, row_mask, col_start + c, col_end, I, ACTIVATION, INTERLEAVED, BLOCK_M,
                            BLOCK_N)  # the same float32 values again
            tl.store(out_ptr + out_row[:, None] + cols[None, :], quantize_fp8_tile(a, scale), mask=mask)
        tl.store(scale_ptr + rows64 * stride_scale + pid_n, scale, mask=row_mask)


def act_and_mul_triton(
    h: torch.Tensor,
    activation: str,
    quant: str | None,
    group_size: int,
    out_dtype: torch.dtype,
    layout: str = "concatenated",
    config: ActAndMulConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``h [M, 2*I]`` -> ``(out [M, I], scale or None)`` with the Triton kernel; arguments as
    :func:`moe_torch.ops.activation.api.act_and_mul` (already validated there; ``layout`` the gate/up layout).

    ``out`` is ``out_dtype``, or float8_e4m3fn with ``scale`` ``[M, 1]`` (``"fp8_per_token"``) /
    ``[M, I // group_size]`` (``"fp8_per_token_group"``) float32 dequant multipliers.
    Both are allocated here; ``h`` is only read.

    Raises: NotImplementedError (no CUDA and no interpreter; FP8 before sm_89), ValueError (a
      given ``config`` that cannot cover the quantization span).
    """
    op = f"{activation}_and_mul"
    check_triton_device(op, h.device, _act_and_mul_kernel, quantizes_fp8=quant is not None)
    M, I = h.shape[0], h.shape[1] // 2
    if h.stride(1) != 1:
        h = h.contiguous()  # a copy: the caller's tensor is untouched
    cfg = config or act_and_mul_config(M, I, quant, group_size)
    if quant is None:
        span, n_spans = cfg.block_n, triton.cdiv(I, cfg.block_n)
        out = torch.empty((M, I), dtype=out_dtype, device=h.device)
        scale = None
    else:
        span = I if quant == "fp8_per_token" else group_size
        n_spans = 1 if quant == "fp8_per_token" else I // group_size
        out = torch.empty((M, I), dtype=FP8_DTYPE, device=h.device)
        scale = torch.empty((M, n_spans), dtype=torch.float32, device=h.device)
    if cfg.block_n & (cfg.block_n - 1) or (cfg.single_chunk and span > cfg.block_n) or (quant is None and not cfg.single_chunk):
        raise ValueError(f"{op}: config must have a power-of-2 block_n, single_chunk without quant, and block_n >= the "
                         f"quantization span (={span}) if single_chunk; got {cfg}")
    if n_spans > MAX_GRID_AXIS_1:
        raise NotImplementedError(f"{op}: {n_spans} column programs exceed CUDA's grid axis 1 limit {MAX_GRID_AXIS_1}")
    grid = (triton.cdiv(M, cfg.block_m), n_spans)
    if grid[0] == 0 or grid[1] == 0:
        return out, scale  # nothing to compute (M = 0, or I = 0 without a per-token scale)
    _act_and_mul_kernel[grid](
        h,
        out,
        out if scale is None else scale,  # never written without QUANT
        M,
        I,
        h.stride(0),
        out.stride(0),
        0 if scale is None else scale.stride(0),
        ACTIVATION=ACTIVATION_CODES[activation],
        QUANT=quant is not None,
        SPAN=span,
        SINGLE_CHUNK=cfg.single_chunk,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        INTERLEAVED=layout == "interleaved",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, scale


# --------------------------------------------------------------------------------------
# backward


@triton.jit
def _act_and_mul_backward_kernel(
    h_ptr,  # [M, 2*I] float32 / bf16 / fp16, gate half then up half (or interleaved)
    d_a_ptr,  # [M, I] float32 / bf16 / fp16: gradient of out
    d_h_ptr,  # [M, 2*I] out dtype: gradient of h (d_g | d_u, or interleaved as h)
    M,  # int: rows
    I,  # int: intermediate size
    stride_h,  # int: h.stride(0)
    stride_da,  # int: d_a.stride(0)
    stride_dh,  # int: d_h.stride(0)
    ACTIVATION: tl.constexpr,  # 0: silu, 1: gelu_tanh, 2: swiglu_oai
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per program (power of 2)
    INTERLEAVED: tl.constexpr = False,  # bool: h and d_h are g0 u0 g1 u1 ... (gpt-oss), else [g | u]
):
    """Grid ``(cdiv(M, BLOCK_M), cdiv(I, BLOCK_N))``; program ``(pid_m, pid_n)`` writes the gradients of gate
    columns ``cols = pid_n*BLOCK_N + [0, BLOCK_N)`` and their up columns (``d_h[rows, cols]`` and
    ``d_h[rows, I + cols]``; interleaved ``d_h[rows, 2*cols]`` and ``d_h[rows, 2*cols + 1]``) for
    ``rows = pid_m*BLOCK_M + [0, BLOCK_M)``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)  # int64: row * stride passes 2**31 for M * 2*I > 2**31 elements
    col0 = pid_n * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    mask = row_mask[:, None] & (cols < I)[None, :]
    g, u = _load_gate_up(h_ptr, rows64 * stride_h, row_mask, col0, I, I, INTERLEAVED, BLOCK_M, BLOCK_N)
    da = tl.load(d_a_ptr + rows64[:, None] * stride_da + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:
        s = tl.sigmoid(g)
        d_g = da * u * (s * (1.0 + g * (1.0 - s)))
        d_u = da * (g * s)
    elif ACTIVATION == 1:
        q = tl.sigmoid(_GELU_2C * (g + _GELU_CUBIC * g * g * g))
        d_g = da * u * (q + _GELU_2C * g * q * (1.0 - q) * (1.0 + 3.0 * _GELU_CUBIC * g * g))
        d_u = da * (g * q)
    else:  # the clamps select the whole product (0 beyond the bounds and for NaN), as torch's clamp backward
        gc = _clamp_gate(g)
        s = tl.sigmoid(_SWIGLU_ALPHA * gc)
        act_grad = s * (1.0 + _SWIGLU_ALPHA * gc * (1.0 - s))
        d_g = tl.where(g <= _SWIGLU_LIMIT, da * (_clamp_up(u) + 1.0) * act_grad, 0.0)
        d_u = tl.where((u >= -_SWIGLU_LIMIT) & (u <= _SWIGLU_LIMIT), da * (gc * s), 0.0)
    d_row = d_h_ptr + rows64[:, None] * stride_dh
    if INTERLEAVED:  # one store of the [BLOCK_M, BLOCK_N, 2] pairs (d_g, d_u): 2*BLOCK_N contiguous columns
        pairs = d_row[:, :, None] + 2 * cols[None, :, None] + tl.arange(0, 2)[None, None, :]
        tl.store(pairs, tl.join(d_g, d_u).to(d_h_ptr.dtype.element_ty), mask=mask[:, :, None])
    else:
        tl.store(d_row + cols[None, :], d_g.to(d_h_ptr.dtype.element_ty), mask=mask)
        tl.store(d_row + I + cols[None, :], d_u.to(d_h_ptr.dtype.element_ty), mask=mask)


def act_and_mul_backward_triton(
    h: torch.Tensor,
    d_a: torch.Tensor,
    activation: str,
    out_dtype: torch.dtype,
    layout: str = "concatenated",
    config: ActAndMulBackwardConfig | None = None,
) -> torch.Tensor:
    """``h [M, 2*I]``, ``d_a [M, I]`` -> ``d_h [M, 2*I]`` ``out_dtype`` (in ``h``'s gate/up ``layout``) with the
    fused Triton kernel; arguments as :func:`moe_torch.ops.activation.api.act_and_mul_backward` (already
    validated there).
    ``d_h`` is allocated here; the inputs are only read.

    Raises: NotImplementedError (no CUDA and no interpreter; too many column programs), ValueError (a
      given ``config`` whose ``block_n`` is not a power of 2).
    """
    op = "act_and_mul_backward"
    check_triton_device(op, h.device, _act_and_mul_backward_kernel)
    M, I = h.shape[0], h.shape[1] // 2
    h = h if h.stride(1) == 1 else h.contiguous()  # copies: the caller's tensors are untouched
    d_a = d_a if d_a.stride(1) == 1 else d_a.contiguous()
    cfg = config or act_and_mul_backward_config(M, I)
    if cfg.block_n & (cfg.block_n - 1) or cfg.block_m & (cfg.block_m - 1):
        raise ValueError(f"{op}: config must have power-of-2 block_m and block_n; got {cfg}")
    d_h = torch.empty((M, 2 * I), dtype=out_dtype, device=h.device)
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(I, cfg.block_n))
    if grid[1] > MAX_GRID_AXIS_1:
        raise NotImplementedError(f"{op}: {grid[1]} column programs exceed CUDA's grid axis 1 limit {MAX_GRID_AXIS_1}")
    if grid[0] == 0 or grid[1] == 0:
        return d_h  # M = 0 or I = 0: nothing to compute
    _act_and_mul_backward_kernel[grid](
        h, d_a, d_h, M, I, h.stride(0), d_a.stride(0), d_h.stride(0),
        ACTIVATION=ACTIVATION_CODES[activation], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        INTERLEAVED=layout == "interleaved", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return d_h
