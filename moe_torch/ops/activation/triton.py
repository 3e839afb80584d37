"""Triton kernel for ``silu_and_mul`` / ``gelu_tanh_and_mul`` (CONTRACT.md sections 3-4).

Dataflow, one program per ``[BLOCK_M rows] x [one column span]``::

    h [M, 2*I] (gate half | up half) --load, upcast to float32--> g, u
    a = act(g) * u                                        (float32)
    no quant:  out [M, I] = cast_rne(a)                   (float32 / bf16 / fp16)
    FP8 quant: amax over the span (the row for per-token, a G-wide group for per-token-group)
               scale = max(amax, 1e-10) * float32(1/448)   [M, I // span] float32
               out = cast_rne(clamp(div_rn(a, scale), -448, 448))  float8_e4m3fn

The division is ``tl.math.div_rn`` (IEEE, correctly rounded); plain ``/`` lowers to the
approximate ``div.full.f32`` on NVIDIA GPUs and would break bit-identity with the references.
A span wider than ``config.MAX_SINGLE_CHUNK`` columns is walked twice (amax pass, quantize pass),
recomputing the same float32 activation, so any ``I`` and any ``group_size`` are served.

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
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

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

#: ``activation`` name -> the kernel's ``ACTIVATION`` constexpr.
ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1}


@triton.jit
def _gated_tile(
    h_ptr,  # [M, 2*I] float32 / bf16 / fp16
    row_off,  # [BLOCK_M] int64: row * stride_h
    cols,  # [BLOCK_N] int32 column indices into the gate half
    mask,  # [BLOCK_M, BLOCK_N] bool
    I,  # int: intermediate size (offset of the up half)
    ACTIVATION: tl.constexpr,  # 0: silu, 1: gelu_tanh
):
    """``act(g) * u`` for one ``[BLOCK_M, BLOCK_N]`` tile, float32 (upcast right after the load)."""
    g_ptrs = h_ptr + row_off[:, None] + cols[None, :]
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:
        a = g * tl.sigmoid(g)
    else:
        a = g * tl.sigmoid(_GELU_2C * (g + _GELU_CUBIC * g * g * g))
    return a * u  # masked elements are act(0) * 0 = 0: they never raise an amax



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
    ACTIVATION: tl.constexpr,  # 0: silu, 1: gelu_tanh
    QUANT: tl.constexpr,  # bool: FP8 quantization with one scale per (row, SPAN columns)
    SPAN: tl.constexpr,  # columns per program: BLOCK_N (no quant), I (per-token), G (per-token-group)
    SINGLE_CHUNK: tl.constexpr,  # bool: SPAN <= BLOCK_N (activation computed once)
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per chunk (power of 2)
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
        a = _gated_tile(h_ptr, h_row, cols, mask, I, ACTIVATION)
        if QUANT:
            scale = fp8_scale(tl.max(tl.abs(a), axis=1))
            tl.store(out_ptr + out_row[:, None] + cols[None, :], quantize_fp8_tile(a, scale), mask=mask)
            tl.store(scale_ptr + rows64 * stride_scale + pid_n, scale, mask=row_mask)
        else:
            tl.store(out_ptr + out_row[:, None] + cols[None, :], a.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # QUANT over a span wider than one chunk: amax pass, then quantize pass
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in range(0, SPAN, BLOCK_N):
            cols = col_start + c + offs
            mask = row_mask[:, None] & (cols < col_end)[None, :]
            a = _gated_tile(h_ptr, h_row, cols, mask, I, ACTIVATION)
            amax = tl.maximum(amax, tl.max(tl.abs(a), axis=1))
        scale = fp8_scale(amax)
        for c in range(0, SPAN, BLOCK_N):
            cols = col_start + c + offs
            mask = row_mask[:, None] & (cols < col_end)[None, :]
            a = _gated_tile(h_ptr, h_row, cols, mask, I, ACTIVATION)  # the same float32 values again
            tl.store(out_ptr + out_row[:, None] + cols[None, :], quantize_fp8_tile(a, scale), mask=mask)
        tl.store(scale_ptr + rows64 * stride_scale + pid_n, scale, mask=row_mask)


def act_and_mul_triton(
    h: torch.Tensor,
    activation: str,
    quant: str | None,
    group_size: int,
    out_dtype: torch.dtype,
    config: ActAndMulConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``h [M, 2*I]`` -> ``(out [M, I], scale or None)`` with the Triton kernel; arguments as
    :func:`moe_torch.ops.activation.api.act_and_mul` (already validated there).

    ``out`` is ``out_dtype``, or float8_e4m3fn with ``scale`` ``[M, 1]`` (``"fp8_per_token"``) /
    ``[M, I // group_size]`` (``"fp8_per_token_group"``) float32 dequant multipliers.
    Both are allocated here; ``h`` is only read.

    Raises: NotImplementedError (no CUDA and no interpreter; FP8 before sm_89), ValueError (a
      given ``config`` that cannot cover the quantization span).
    """
    op = f"{activation}_and_mul"
    check_triton_device(op, h.device, _act_and_mul_kernel, needs_fp8=quant is not None)
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
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, scale


# --------------------------------------------------------------------------------------
# backward


@triton.jit
def _act_and_mul_backward_kernel(
    h_ptr,  # [M, 2*I] float32 / bf16 / fp16, gate half then up half
    d_a_ptr,  # [M, I] float32 / bf16 / fp16: gradient of out
    d_h_ptr,  # [M, 2*I] out dtype: gradient of h (d_g | d_u)
    M,  # int: rows
    I,  # int: intermediate size
    stride_h,  # int: h.stride(0)
    stride_da,  # int: d_a.stride(0)
    stride_dh,  # int: d_h.stride(0)
    ACTIVATION: tl.constexpr,  # 0: silu, 1: gelu_tanh
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per program (power of 2)
):
    """Grid ``(cdiv(M, BLOCK_M), cdiv(I, BLOCK_N))``; program ``(pid_m, pid_n)`` writes
    ``d_h[rows, cols]`` and ``d_h[rows, I + cols]`` for ``rows = pid_m*BLOCK_M + [0, BLOCK_M)``,
    ``cols = pid_n*BLOCK_N + [0, BLOCK_N)``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)  # int64: row * stride passes 2**31 for M * 2*I > 2**31 elements
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    g_ptrs = h_ptr + rows64[:, None] * stride_h + cols[None, :]
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    da = tl.load(d_a_ptr + rows64[:, None] * stride_da + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:
        s = tl.sigmoid(g)
        act = g * s
        act_grad = s * (1.0 + g * (1.0 - s))
    else:
        q = tl.sigmoid(_GELU_2C * (g + _GELU_CUBIC * g * g * g))
        act = g * q
        act_grad = q + _GELU_2C * g * q * (1.0 - q) * (1.0 + 3.0 * _GELU_CUBIC * g * g)
    d_ptrs = d_h_ptr + rows64[:, None] * stride_dh + cols[None, :]
    tl.store(d_ptrs, (da * u * act_grad).to(d_h_ptr.dtype.element_ty), mask=mask)
    tl.store(d_ptrs + I, (da * act).to(d_h_ptr.dtype.element_ty), mask=mask)


def act_and_mul_backward_triton(
    h: torch.Tensor,
    d_a: torch.Tensor,
    activation: str,
    out_dtype: torch.dtype,
    config: ActAndMulBackwardConfig | None = None,
) -> torch.Tensor:
    """``h [M, 2*I]``, ``d_a [M, I]`` -> ``d_h [M, 2*I]`` ``out_dtype`` with the fused Triton kernel;
    arguments as :func:`moe_torch.ops.activation.api.act_and_mul_backward` (already validated there).
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
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return d_h
