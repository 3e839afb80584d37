"""FP8 (float8_e4m3fn) quantization reference in torch: CONTRACT.md section 3.

Every scale is a *dequantization multiplier*: ``x ~= q * scale``.
Mirror: ``moe_pallas/ops/quant/reference.py``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
#: float32(1/448) (exactly representable as a python float): scales are ``amax * INV_FP8_MAX``.
INV_FP8_MAX = float(np.float32(1.0 / 448.0))
#: Floor of ``amax`` so that an all-zero row or block gets a finite, positive scale.
AMAX_FLOOR = float(np.float32(1e-10))


def _cast_fp8(xs: torch.Tensor) -> torch.Tensor:
    """Clamp to +-448, then cast with round-to-nearest-even (the clamp removes the stacks' NaN/saturation differences)."""
    return torch.clamp(xs, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax, 1e-10) * float32(1/448)`` in float32."""
    return torch.clamp(amax.float(), min=AMAX_FLOOR) * INV_FP8_MAX


def per_token_group_quant_fp8_reference(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, K]`` -> ``(q [R, K] fp8, scale [R, K // group_size] f32)``."""
    R, K = x.shape
    xg = x.float().reshape(R, K // group_size, group_size)
    scale = scale_from_amax(xg.abs().amax(dim=-1))
    q = _cast_fp8(xg / scale[..., None])  # IEEE division (correctly rounded)
    return q.reshape(R, K), scale


def per_token_quant_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, K]`` -> ``(q [R, K] fp8, scale [R, 1] f32)``: one group per row (``K = 0``: the zero-row scale)."""
    R, K = x.shape
    if K == 0:
        return x.to(FP8_DTYPE), scale_from_amax(torch.zeros((R, 1), dtype=torch.float32, device=x.device))
    return per_token_group_quant_fp8_reference(x, K)


def static_quant_fp8_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..]`` with a given per-tensor ``scale []`` f32 -> ``q [..]`` fp8."""
    return _cast_fp8(x.float() / scale.float())


def dequantize_fp8_reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q [R, K]`` fp8 with ``scale [R, K // G]`` (per-token: ``G = K``) or ``[]`` -> float32 ``[R, K]``."""
    qf = q.float()
    if scale.ndim == 0:
        return qf * scale.float()
    R, K = q.shape
    groups = scale.shape[-1]
    return (qf.reshape(R, groups, K // groups) * scale.float()[..., None]).reshape(R, K)


def _block_view(w: torch.Tensor, block: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``w [E, N, K]`` zero-padded to multiples of ``block`` and viewed as ``[E, nb, block, kb, block]``."""
    E, N, K = w.shape
    nb, kb = -(-N // block), -(-K // block)
    padded = F.pad(w, (0, kb * block - K, 0, nb * block - N))
    return padded.reshape(E, nb, block, kb, block), (E, N, K)


def quantize_weight_fp8_reference(w: torch.Tensor, layout: str, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` -> ``(q [E, N, K] fp8, scale)`` with scale ``[E]`` (``"per_expert"``),
    ``[E, N]`` (``"per_channel"``) or ``[E, ceil(N/128), ceil(K/128)]`` (``"block"``)."""
    wf = w.float()
    if layout == "per_expert":
        scale = scale_from_amax(wf.abs().amax(dim=(1, 2)))
        return _cast_fp8(wf / scale[:, None, None]), scale
    if layout == "per_channel":
        scale = scale_from_amax(wf.abs().amax(dim=2))
        return _cast_fp8(wf / scale[:, :, None]), scale
    view, (E, N, K) = _block_view(wf, block)
    scale = scale_from_amax(view.abs().amax(dim=(2, 4)))  # [E, nb, kb]
    q = _cast_fp8(view / scale[:, :, None, :, None])
    return q.reshape(E, scale.shape[1] * block, scale.shape[2] * block)[:, :N, :K].contiguous(), scale


def expand_weight_scale(w_scale: torch.Tensor, shape: tuple[int, int, int], block: int = 128) -> torch.Tensor:
    """Broadcast a weight scale (``[E]``, ``[E, N]`` or block ``[E, nb, kb]``) to ``[E, N, K]`` float32."""
    E, N, K = shape
    s = w_scale.float()
    if s.ndim == 1:
        return s[:, None, None].expand(shape)
    if s.ndim == 2:
        return s[:, :, None].expand(shape)
    return s.repeat_interleave(block, dim=1)[:, :N].repeat_interleave(block, dim=2)[:, :, :K]


def dequantize_weight_fp8_reference(q: torch.Tensor, w_scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``q [E, N, K]`` fp8 with any weight-scale layout -> float32 ``[E, N, K]``."""
    return q.float() * expand_weight_scale(w_scale, tuple(q.shape), block)


def _weight_scale_shape(shape: tuple[int, int, int], layout: str, block: int) -> tuple[int, ...]:
    """The weight scale's shape: ``[E]``, ``[E, N]`` or ``[E, ceil(N/block), ceil(K/block)]``."""
    E, N, K = shape
    return {"per_expert": (E,), "per_channel": (E, N), "block": (E, -(-N // block), -(-K // block))}[layout]


def quantize_weight_fp8_chunked(
    w: torch.Tensor, layout: str, block: int, chunk_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_weight_fp8_reference`, ``chunk_experts`` experts at a time, bit-identical
    (every scale layout is per expert): the codes and scales are allocated once and each chunk
    writes its slice, through one float32 buffer of the chunk (``[n, N, K]``, or ``[n, N', K']``
    zero-padded to multiples of ``block`` for ``"block"``) that is divided and clamped in place.
    Alive at once beyond ``w`` and the result: that buffer and a few scale-sized temporaries.
    ``w`` is not modified."""
    if w.numel() == 0:
        return quantize_weight_fp8_reference(w, layout, block)
    E, N, K = w.shape
    q = torch.empty((E, N, K), dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty(_weight_scale_shape((E, N, K), layout, block), dtype=torch.float32, device=w.device)
    with torch.no_grad():  # codes cannot carry gradients; no graph may hold a chunk's buffer
        for start in range(0, E, chunk_experts):
            stop = min(start + chunk_experts, E)
            _quantize_weight_chunk_into(w[start:stop], layout, block, q[start:stop], scale[start:stop])
    return q, scale


def _quantize_weight_chunk_into(w: torch.Tensor, layout: str, block: int, q_out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """One chunk ``w [n, N, K]`` -> its codes into ``q_out [n, N, K]`` and scales into ``scale_out``:
    the reference's arithmetic, with one float32 buffer instead of a tensor per step."""
    n, N, K = w.shape
    if layout == "block":
        nb, kb = -(-N // block), -(-K // block)
        pad = nb * block != N or kb * block != K
        buf = (torch.zeros if pad else torch.empty)((n, nb * block, kb * block), dtype=torch.float32, device=w.device)
        buf[:, :N, :K].copy_(w)  # the reference's zero padding
        view, dims = buf.view(n, nb, block, kb, block), (2, 4)
    else:
        buf = torch.empty((n, N, K), dtype=torch.float32, device=w.device)
        buf.copy_(w)
        view, dims = buf, ((1, 2) if layout == "per_expert" else (2,))
    # max |x| = max(max x, -min x) exactly, without an |x| temporary of the chunk's size
    scale = scale_from_amax(torch.maximum(view.amax(dim=dims), view.amin(dim=dims).neg_()))
    if layout == "per_expert":
        divisor = scale[:, None, None]
    elif layout == "per_channel":
        divisor = scale[:, :, None]
    else:
        divisor = scale[:, :, None, :, None]
    view.div_(divisor).clamp_(-FP8_MAX, FP8_MAX)  # the reference's IEEE division and clamp, in place
    q_out.copy_(buf[:, :N, :K])  # the cast of _cast_fp8 (round to nearest even)
    scale_out.copy_(scale)
