"""FP8 (float8_e4m3fn) quantization reference in torch: CONTRACT.md section 3; 4-bit weights
(MXFP4, INT4 group 32): section 9.

Every scale is a *dequantization multiplier*: ``x ~= q * scale``.
Mirror: ``moe_pallas/ops/quant/reference.py``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from moe_contract.w4_layout import MXFP4_MMA_MAX_SCALE_CODE, mma_moves

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


# --------------------------------------------------------------------------------------
# 4-bit weights (CONTRACT.md section 9): MXFP4 (e2m1 codes, e8m0 scales) and INT4 (offset-binary
# codes, bf16 scales), one scale per group of 32 along K, two codes a byte (element 2i in the low
# nibble). Sources: OCP Microscaling Formats (MX) v1.0 (e2m1, e8m0, the floor-exponent scale);
# compressed-tensors ``pack-quantized`` (INT4 group 32, offset binary, eight codes an int32).

#: Elements of ``K`` per 4-bit scale.
W4_GROUP = 32
#: e2m1 code -> value, codes 0-7 and their negatives for 8-15 (code 8 is -0): OCP MX v1.0, table 5.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: Rounding |v| to the nearest e2m1 magnitude, ties to the even code: the code is the number of
#: these bounds that |v| passes, ``>`` at a bound whose tie goes down (to an even code), ``>=`` where
#: it goes up: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; above 5 it is 6
#: (saturation: OCP's floor exponent lets |v| reach just under 8).
_E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
#: e8m0 scale code meaning NaN (OCP MX v1.0): its whole group dequantizes to NaN.
E8M0_NAN = 255
#: float32(2 / 15): INT4 scales are ``amax / 7.5`` written as an exact multiplication (CONTRACT.md section 9).
INT4_SCALE_MUL = float(np.float32(2.0 / 15.0))
#: INT4 codes are offset binary: ``q = code - 8`` in ``[-8, 7]``.
INT4_OFFSET = 8


def _float32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int32 bit patterns -> the float32 values they encode (a reinterpretation, no rounding)."""
    return bits.to(torch.int32).view(torch.float32)


def e8m0_to_float32(s: torch.Tensor) -> torch.Tensor:
    """e8m0 scale codes ``s`` (uint8) -> ``2^(s - 127)`` float32, exactly: ``s << 23`` for ``s >= 1``,
    the subnormal ``2^-127`` (bits ``1 << 22``) for ``s = 0``, NaN for ``s = 255``."""
    si = s.to(torch.int32)
    bits = torch.where(si == 0, 1 << 22, si << 23)
    bits = torch.where(si == E8M0_NAN, 0x7FC00000, bits)
    return _float32_from_bits(bits)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``codes [..., K]`` uint8 in ``[0, 16)`` -> ``[..., K // 2]`` uint8, element ``2i`` in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(w_q: torch.Tensor) -> torch.Tensor:
    """``w_q [..., K // 2]`` uint8 -> ``codes [..., K]`` uint8 (the inverse of :func:`pack_nibbles`)."""
    return torch.stack((w_q & 0xF, w_q >> 4), dim=-1).reshape(*w_q.shape[:-1], 2 * w_q.shape[-1])


def _groups(t: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` -> ``[..., K // 32, 32]``."""
    return t.reshape(*t.shape[:-1], t.shape[-1] // W4_GROUP, W4_GROUP)


def quantize_mxfp4_rows(wf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``wf [..., K]`` float32, finite -> ``(codes [..., K] uint8, s [..., K // 32] uint8)``.

    Per group: ``s = clamp(floor(log2(amax)) - 2 + 127, 0, 254)`` (``frexp``: ``amax = m * 2^e``,
    ``m`` in ``[0.5, 1)``, so ``floor(log2(amax)) = e - 1``, subnormals included), ``s = 0`` for
    ``amax == 0``; ``v = w / 2^(s - 127)`` computed as ``w * 2^(127 - s)`` (the same real number, so
    the same float32: both are exact up to the final rounding, and ``2^(127 - s)`` is a normal float32
    because ``s <= 252`` for every finite float32 ``amax``); the code rounds ``|v|`` to the nearest
    e2m1 value with ties to the even code and saturates at 6; the sign bit is set where ``v < 0``."""
    g = _groups(wf)
    amax = g.abs().amax(dim=-1)
    _, exp = torch.frexp(amax)
    s = torch.clamp(exp - 1 - 2 + 127, 0, 254)
    s = torch.where(amax == 0, 0, s)
    v = g * _float32_from_bits((254 - s) << 23)[..., None]  # 2^(127 - s): biased exponent 254 - s >= 2
    a = v.abs()
    code = torch.zeros(a.shape, dtype=torch.uint8, device=wf.device)
    for bound, tie_up in _E2M1_BOUNDS:
        code += (a >= bound) if tie_up else (a > bound)
    code |= (v < 0).to(torch.uint8) << 3
    return code.reshape(wf.shape), s.to(torch.uint8)


def dequantize_mxfp4_reference(w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``w_q [..., K // 2]`` uint8, ``w_scale [..., K // 32]`` uint8 (e8m0) -> float32 ``[..., K]``:
    ``e2m1(code) * 2^(s - 127)``, exact in float32 (products of a 3-bit significand and a power of 2,
    subnormal results included); a group with ``s = 255`` is NaN."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w_q.device)
    values = table[unpack_nibbles(w_q).to(torch.int64)]
    return (_groups(values) * e8m0_to_float32(w_scale)[..., None]).reshape(values.shape)


def quantize_int4_rows(wf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``wf [..., K]`` float32, finite -> ``(codes [..., K] uint8, scale [..., K // 32] bf16)``:
    ``scale = bf16_rne(max(amax, 1e-10) * float32(2/15))``, ``q = clamp(rne(w / float32(scale)), -8, 7)``
    (IEEE division, round half to even), ``code = q + 8``."""
    g = _groups(wf)
    scale = (torch.clamp(g.abs().amax(dim=-1), min=AMAX_FLOOR) * INT4_SCALE_MUL).to(torch.bfloat16)
    q = torch.round(g / scale.float()[..., None]).clamp_(-INT4_OFFSET, INT4_OFFSET - 1)
    return (q + INT4_OFFSET).to(torch.uint8).reshape(wf.shape), scale


def dequantize_int4_reference(w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``w_q [..., K // 2]`` uint8, ``w_scale [..., K // 32]`` bf16 -> float32 ``[..., K]``:
    ``float32(code - 8) * float32(scale)``."""
    q = unpack_nibbles(w_q).to(torch.float32) - INT4_OFFSET
    return (_groups(q) * w_scale.float()[..., None]).reshape(q.shape)


_W4_QUANTIZERS = {"mxfp4": (quantize_mxfp4_rows, torch.uint8), "int4": (quantize_int4_rows, torch.bfloat16)}
#: Words a chunk of the MMA re-layout (its int64 temporaries: 128 MiB each).
_MMA_CHUNK_WORDS = 1 << 24


def mma_permute(w_q: torch.Tensor, to_mma: bool) -> torch.Tensor:
    """MXFP4 codes ``[..., K // 2]`` uint8 (last axis a multiple of 4, unchecked) to the MMA layout (``to_mma``) or
    back (``moe_contract/w4_layout.py``): each little-endian 32-bit word is ``OR(rotl(word, r) & mask)`` over
    ``mma_moves``. A new tensor on ``w_q``'s device; no host sync."""
    if w_q.numel() == 0:  # (an empty tensor has no words to view)
        return w_q.detach().clone()
    words = w_q.detach().contiguous().view(torch.int32).reshape(-1)
    out = torch.empty_like(words)
    for c0 in range(0, words.numel(), _MMA_CHUNK_WORDS):
        w = words[c0:c0 + _MMA_CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF  # the word as unsigned, in int64
        acc = torch.zeros_like(w)
        for r, mask in mma_moves(to_mma):
            rot = w if r == 0 else ((w << r) | (w >> (32 - r))) & 0xFFFFFFFF
            acc |= rot & mask
        out[c0:c0 + _MMA_CHUNK_WORDS] = torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32)
    return out.view(torch.uint8).reshape(w_q.shape)


def mxfp4_mma_as_checkpoint(w_q: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``"mxfp4_mma"`` weights as the ``"mxfp4"`` weights of the same values (CONTRACT.md section 9, MMA layout):
    the codes back in the checkpoint layout, and the scale codes the layout's table does not hold (129..254) as
    255 (NaN), which is what the kernels reading the layout give for them. New tensors; no host sync."""
    bad = (w_scale > MXFP4_MMA_MAX_SCALE_CODE) & (w_scale != 255)
    return mma_permute(w_q, False), torch.where(bad, torch.full_like(w_scale, 255), w_scale)


_W4_DEQUANTIZERS = {"mxfp4": dequantize_mxfp4_reference, "int4": dequantize_int4_reference,
                    "mxfp4_mma": lambda w_q, w_scale: dequantize_mxfp4_reference(*mxfp4_mma_as_checkpoint(w_q, w_scale))}


def dequantize_weight_4bit_reference(w_q: torch.Tensor, w_scale: torch.Tensor, fmt: str,
                                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``w_q [..., K // 2]`` uint8 with its ``w_scale [..., K // 32]`` -> ``wd [..., K]`` float32,
    rounded to ``out_dtype`` (nearest even). 3-D weights go one expert at a time (one float32
    temporary of ``[N, K]``)."""
    dequant = _W4_DEQUANTIZERS[fmt]
    if w_q.ndim < 3 or out_dtype == torch.float32:
        return dequant(w_q, w_scale).to(out_dtype)
    out = torch.empty((*w_q.shape[:-1], 2 * w_q.shape[-1]), dtype=out_dtype, device=w_q.device)
    for e in range(w_q.shape[0]):
        out[e] = dequant(w_q[e], w_scale[e])  # the float32 value, rounded to nearest even by the copy
    return out


def _check_finite(op: str, chunk: torch.Tensor, row0: int, shape: tuple[int, ...]) -> None:
    """``ValueError`` naming the first non-finite element of ``chunk`` (rows ``row0..`` of ``w`` viewed
    as ``[rows, K]``) by its index in ``w``'s ``shape``."""
    bad = ~torch.isfinite(chunk)
    if bool(bad.any()):
        flat = int(torch.nonzero(bad.reshape(-1))[0, 0]) + row0 * chunk.shape[-1]
        index = tuple(int(i) for i in np.unravel_index(flat, shape))
        value = float(chunk.reshape(-1)[flat - row0 * chunk.shape[-1]])
        raise ValueError(f"{op}: w must be finite (CONTRACT.md section 9: NaN and inf have no 4-bit code); got "
                         f"w[{', '.join(map(str, index))}] = {value} (the first of {int(bad.sum())} non-finite values "
                         f"in rows {row0}..{row0 + chunk.shape[0] - 1} of w viewed as [rows, K])")


def quantize_weight_4bit_chunked(op: str, w: torch.Tensor, fmt: str, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., K]`` float -> ``(w_q [..., K // 2] uint8, w_scale [..., K // 32])`` of ``fmt``, ``chunk_rows``
    rows of ``w`` viewed as ``[rows, K]`` at a time (every group lies in one row, so the result is
    bit-identical for every chunk size). ``ValueError`` (naming ``op``) on a non-finite value, before
    anything is returned; ``w`` is not modified."""
    quantize, scale_dtype = _W4_QUANTIZERS[fmt]
    shape, K = tuple(w.shape), w.shape[-1]
    if w.numel() == 0:  # no rows or K == 0: nothing to quantize
        return (torch.empty((*shape[:-1], K // 2), dtype=torch.uint8, device=w.device),
                torch.empty((*shape[:-1], K // W4_GROUP), dtype=scale_dtype, device=w.device))
    rows = w.reshape(-1, K)  # a view for a contiguous w
    w_q = torch.empty((rows.shape[0], K // 2), dtype=torch.uint8, device=w.device)
    w_scale = torch.empty((rows.shape[0], K // W4_GROUP), dtype=scale_dtype, device=w.device)
    with torch.no_grad():  # codes carry no gradient; no graph may hold a chunk
        for start in range(0, rows.shape[0], max(chunk_rows, 1)):
            chunk = rows[start : start + chunk_rows].to(torch.float32)
            _check_finite(op, chunk, start, shape)
            codes, scale = quantize(chunk)
            w_q[start : start + chunk.shape[0]] = pack_nibbles(codes)
            w_scale[start : start + chunk.shape[0]] = scale
    return w_q.reshape(*shape[:-1], K // 2), w_scale.reshape(*shape[:-1], K // W4_GROUP)
