"""FP8 (float8_e4m3fn) quantization reference in jnp: CONTRACT.md section 3; 4-bit weights (MXFP4,
INT4 group 32): section 9. Sources of the 4-bit formats: OCP Microscaling Formats (MX) Specification
v1.0 (e2m1 codes, e8m0 scales, the ``floor(log2(amax))`` scale exponent); compressed-tensors
``pack-quantized`` (symmetric INT4 groups, offset-binary codes packed eight to an int32).

Every scale is a *dequantization multiplier*: ``x ~= q * scale``.
Mirror: ``moe_torch/ops/quant/reference.py``.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from moe_contract.op_checks import W4_GROUP  # values of one 4-bit scale group along K (CONTRACT.md section 9)
from moe_contract.w4_layout import MXFP4_MMA_MAX_SCALE_CODE, mma_moves

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0
#: float32(1/448): scales are ``amax * INV_FP8_MAX`` (a multiplication, exact everywhere).
INV_FP8_MAX = np.float32(1.0 / 448.0)
#: Floor of ``amax`` so that an all-zero row or block gets a finite, positive scale.
AMAX_FLOOR = np.float32(1e-10)


def quantize_div_fp8(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``cast_rne(clamp(x / scale, -448, 448))`` to float8_e4m3fn, with ``/`` correctly rounded.

    XLA's GPU backend lowers float32 division to ``div.full.f32`` (up to 1 ulp off;
    openxla/xla#37181), which moves about one FP8 code in 10^6 across a rounding boundary.
    :func:`fp8_round_quotient` repairs exactly those codes. On the CPU, where ``/`` is exact,
    it changes nothing.

    ``x``: float32, any shape; ``scale``: float32, broadcastable to ``x``.
    """
    return fp8_round_quotient(x, jnp.abs(x) / scale, scale)


def _next_up(m: jax.Array) -> jax.Array:
    """The float32 after ``m`` (``m`` finite, > 0): one step of the bit pattern (kernel-safe ``nextafter``)."""
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(m, jnp.uint32) + jnp.uint32(1), jnp.float32)


def _next_down(m: jax.Array) -> jax.Array:
    """The float32 before ``m`` (``m`` finite, > 0; at ``m = 0`` it gives 0)."""
    bits = jax.lax.bitcast_convert_type(m, jnp.uint32)
    return jax.lax.bitcast_convert_type(jnp.where(bits > 0, bits - jnp.uint32(1), bits), jnp.float32)


def _fp8_code_value(bits: jax.Array) -> jax.Array:
    """The float32 value of float8_e4m3fn magnitude codes ``bits`` (uint8, 0 .. 0x7E), by integer arithmetic.

    Not ``bitcast(bits, fp8).astype(float32)``: XLA folds ``bitcast(bitcast(q))`` to ``q`` and then, on
    the GPU, drops the float32 -> FP8 -> float32 convert chain that leaves (``SimplifyFPConversions``
    under ``--xla_allow_excess_precision``, on by default): the "code" would be the float32 quotient
    itself. ``bits = E * 8 + M``: ``M * 2^-9`` for ``E = 0``, ``(8 + M) * 2^(E - 10)`` above (exact: <= 4
    significant bits times a power of two built from its exponent bits)."""
    b = bits.astype(jnp.int32)
    e, mant = b >> 3, b & 7
    sig = jnp.where(e > 0, mant + 8, mant)
    pow2 = jax.lax.bitcast_convert_type((jnp.maximum(e, 1) + 117) << 23, jnp.float32)  # 2^(max(E, 1) - 10)
    return sig.astype(jnp.float32) * pow2


def _split_hi(v: jax.Array) -> jax.Array:
    """``v`` with its 12 low mantissa bits cleared (``v - hi`` is then exact, 12 bits)."""
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0xFFFFF000), jnp.float32)


def fp8_round_quotient(x: jax.Array, y: jax.Array, scale: jax.Array) -> jax.Array:
    """The FP8 code of ``cast_rne(clamp(fl32(x / scale)))``, given ``y ~= |x| / scale`` within an ulp.

    Let ``q`` be the code ``y`` rounds to. If ``y`` lies above (below) ``q``, the only other
    candidate is the next code ``n`` up (down), and the answer depends on where the correctly
    rounded quotient ``y*`` sits against the midpoint ``m = (q + n) / 2``: past it -> ``n``;
    on it -> the even code; short of it -> ``q``. ``y* > m`` iff ``|x| > (m + u/2) * scale`` and
    ``y* < m`` iff ``|x| < (m - d/2) * scale``, with ``u``, ``d`` the float32 spacings above and
    below ``m`` (``m`` has <= 5 significant bits, so it is even and wins its own ties). Those
    signs are computed exactly: ``scale = s_hi + s_lo`` (12-bit halves) makes every product
    exact in float32, ``|x| - m * s_hi`` is exact (Sterbenz), and the remaining subtractions
    are exact or too large to change sign. Fused multiply-adds, if the compiler makes them,
    change none of this. Valid while ``scale > ~1e-25`` (dynamic scales are >= 2.2e-13).
    Written with kernel-safe ops only (elementwise arithmetic and same-width bitcasts; the
    float32 ``nextafter`` is an integer step of the bit pattern), so the Pallas kernels call it too.

    The codes' float32 values come from their bits (:func:`_fp8_code_value`), never from
    ``q.astype(float32)``: under ``jit`` on the GPU, XLA replaces the float32 -> FP8 -> float32
    round trip by the float32 input (``SimplifyFPConversions``, ``--xla_allow_excess_precision``),
    which turned this repair off and left the approximate quotient's code (seen on an H200: 6 of
    540000 block-scaled bf16 weight codes off by one against torch, all at ``3.5 * 2^-9``).
    """
    a = jnp.abs(x)
    q = jnp.clip(y, 0.0, FP8_MAX).astype(FP8_DTYPE)  # magnitudes only: RNE and the clamp are symmetric
    bits = jax.lax.bitcast_convert_type(q, jnp.uint8)
    qf = _fp8_code_value(bits)
    go_up = (y > qf) & (qf < FP8_MAX)
    go_down = (y < qf) & (qf > 0.0)
    n_bits = jnp.where(go_up, bits + jnp.uint8(1), jnp.where(go_down, bits - jnp.uint8(1), bits))
    nf = _fp8_code_value(n_bits)
    m = (qf + nf) * 0.5  # exact
    half_up = (_next_up(m) - m) * 0.5  # powers of two: exact
    half_down = (m - _next_down(m)) * 0.5
    scale = jnp.broadcast_to(scale, a.shape)
    s_hi = _split_hi(scale)
    s_lo = scale - s_hi
    r = (a - m * s_hi) - m * s_lo  # |x| - m * scale, exactly
    above = ((r - half_up * s_hi) - half_up * s_lo) > 0  # y* > m
    below = ((r + half_down * s_hi) + half_down * s_lo) < 0  # y* < m
    on_mid = ~above & ~below
    n_even = (n_bits & jnp.uint8(1)) == jnp.uint8(0)
    take_n = (go_up & (above | (on_mid & n_even))) | (go_down & (below | (on_mid & n_even)))
    mag = jnp.where(take_n, n_bits, bits)
    sign = (jax.lax.bitcast_convert_type(x, jnp.uint32) >> jnp.uint32(31)).astype(jnp.uint8) << jnp.uint8(7)
    return jax.lax.bitcast_convert_type(mag | sign, FP8_DTYPE)


def scale_from_amax(amax: jax.Array) -> jax.Array:
    """``max(amax, 1e-10) * float32(1/448)`` in float32."""
    return jnp.maximum(amax.astype(jnp.float32), AMAX_FLOOR) * INV_FP8_MAX


def per_token_group_quant_fp8_reference(x: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    """``x [R, K]`` -> ``(q [R, K] fp8, scale [R, K // group_size] f32)``."""
    R, K = x.shape
    xg = x.astype(jnp.float32).reshape(R, K // group_size, group_size)
    scale = scale_from_amax(jnp.abs(xg).max(axis=-1))
    q = quantize_div_fp8(xg, scale[..., None])
    return q.reshape(R, K), scale


def per_token_quant_fp8_reference(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [R, K]`` -> ``(q [R, K] fp8, scale [R, 1] f32)``: one group per row (``K = 0``: the zero-row scale)."""
    R, K = x.shape
    if K == 0:
        return x.astype(FP8_DTYPE), scale_from_amax(jnp.zeros((R, 1), jnp.float32))
    return per_token_group_quant_fp8_reference(x, K)


def static_quant_fp8_reference(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x [..]`` with a given per-tensor ``scale []`` f32 -> ``q [..]`` fp8."""
    return quantize_div_fp8(x.astype(jnp.float32), scale.astype(jnp.float32))


def dequantize_fp8_reference(q: jax.Array, scale: jax.Array) -> jax.Array:
    """``q [R, K]`` fp8 with ``scale [R, K // G]`` (per-token: ``G = K``) or ``[]`` -> float32 ``[R, K]``."""
    qf = q.astype(jnp.float32)
    if scale.ndim == 0:
        return qf * scale.astype(jnp.float32)
    R, K = q.shape
    groups = scale.shape[-1]
    return (qf.reshape(R, groups, K // groups) * scale.astype(jnp.float32)[..., None]).reshape(R, K)


def _block_view(w: jax.Array, block: int) -> tuple[jax.Array, tuple[int, int, int]]:
    """``w [E, N, K]`` zero-padded to multiples of ``block`` and viewed as ``[E, nb, block, kb, block]``."""
    E, N, K = w.shape
    nb, kb = -(-N // block), -(-K // block)
    padded = jnp.pad(w, ((0, 0), (0, nb * block - N), (0, kb * block - K)))
    return padded.reshape(E, nb, block, kb, block), (E, N, K)


def quantize_weight_fp8_reference(w: jax.Array, layout: str, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """``w [E, N, K]`` -> ``(q [E, N, K] fp8, scale)`` with scale ``[E]`` (``"per_expert"``),
    ``[E, N]`` (``"per_channel"``) or ``[E, ceil(N/128), ceil(K/128)]`` (``"block"``)."""
    wf = w.astype(jnp.float32)
    if layout == "per_expert":
        scale = scale_from_amax(jnp.abs(wf).max(axis=(1, 2)))
        return quantize_div_fp8(wf, scale[:, None, None]), scale
    if layout == "per_channel":
        scale = scale_from_amax(jnp.abs(wf).max(axis=2))
        return quantize_div_fp8(wf, scale[:, :, None]), scale
    view, (E, N, K) = _block_view(wf, block)
    scale = scale_from_amax(jnp.abs(view).max(axis=(2, 4)))  # [E, nb, kb]
    q = quantize_div_fp8(view, scale[:, :, None, :, None])
    return q.reshape(E, scale.shape[1] * block, scale.shape[2] * block)[:, :N, :K], scale


def expand_weight_scale(w_scale: jax.Array, shape: tuple[int, int, int], block: int = 128) -> jax.Array:
    """Broadcast a weight scale (``[E]``, ``[E, N]`` or block ``[E, nb, kb]``) to ``[E, N, K]`` float32."""
    E, N, K = shape
    s = w_scale.astype(jnp.float32)
    if s.ndim == 1:
        return jnp.broadcast_to(s[:, None, None], shape)
    if s.ndim == 2:
        return jnp.broadcast_to(s[:, :, None], shape)
    return jnp.repeat(jnp.repeat(s, block, axis=1)[:, :N], block, axis=2)[:, :, :K]


def dequantize_weight_fp8_reference(q: jax.Array, w_scale: jax.Array, block: int = 128) -> jax.Array:
    """``q [E, N, K]`` fp8 with any weight-scale layout -> float32 ``[E, N, K]``."""
    return q.astype(jnp.float32) * expand_weight_scale(w_scale, q.shape, block)


def _weight_scale_shape(shape: tuple[int, int, int], layout: str, block: int) -> tuple[int, ...]:
    """The weight scale's shape: ``[E]``, ``[E, N]`` or ``[E, ceil(N/block), ceil(K/block)]``."""
    E, N, K = shape
    return {"per_expert": (E,), "per_channel": (E, N), "block": (E, -(-N // block), -(-K // block))}[layout]


def quantize_weight_fp8_chunked(w: jax.Array, layout: str, block: int, chunk_experts: int) -> tuple[jax.Array, jax.Array]:
    """:func:`quantize_weight_fp8_reference`, ``chunk_experts`` experts at a time, bit-identical
    (every scale layout is per expert): a ``lax.fori_loop`` whose iteration quantizes one chunk and
    writes its codes and scales into the result in place (``dynamic_update_slice`` of the loop
    carry), so one chunk's temporaries are live at a time. The last chunk is the last ``n`` experts:
    when ``n`` does not divide ``E`` it overlaps the one before (those experts are quantized twice,
    to the same values), so that every iteration has one shape and XLA one set of buffers.
    Jit with ``static_argnames=("layout", "block", "chunk_experts")``."""
    if w.size == 0:
        return quantize_weight_fp8_reference(w, layout, block)
    E, N, K = w.shape
    n = min(chunk_experts, E)
    q = jnp.zeros((E, N, K), FP8_DTYPE)
    scale = jnp.zeros(_weight_scale_shape((E, N, K), layout, block), jnp.float32)

    def body(i, carry):
        q, scale = carry
        start = jnp.minimum(i * n, E - n)
        q_c, scale_c = _quantize_weight_chunk(jax.lax.dynamic_slice_in_dim(w, start, n), layout, block)
        return (jax.lax.dynamic_update_slice_in_dim(q, q_c, start, 0),
                jax.lax.dynamic_update_slice_in_dim(scale, scale_c, start, 0))

    return jax.lax.fori_loop(0, -(-E // n), body, (q, scale))


def _quantize_weight_chunk(w: jax.Array, layout: str, block: int) -> tuple[jax.Array, jax.Array]:
    """One chunk ``w [n, N, K]`` -> ``(q [n, N, K] fp8, scale)``: the reference's arithmetic without
    float32 copies XLA would keep. ``max |x|`` is taken in ``w``'s own dtype (``abs`` and ``max`` are
    exact in every float dtype and the float32 cast after them is exact too), and the block maxima
    with ``reduce_window``, whose padding is the reference's zero padding without a padded copy."""
    n, N, K = w.shape
    a = jnp.abs(w)
    if layout == "per_expert":
        scale = scale_from_amax(a.max(axis=(1, 2)))
        return quantize_div_fp8(w.astype(jnp.float32), scale[:, None, None]), scale
    if layout == "per_channel":
        scale = scale_from_amax(a.max(axis=2))
        return quantize_div_fp8(w.astype(jnp.float32), scale[:, :, None]), scale
    nb, kb = -(-N // block), -(-K // block)
    amax = jax.lax.reduce_window(a, np.array(0, a.dtype), jax.lax.max, (1, block, block), (1, block, block),
                                 ((0, 0), (0, nb * block - N), (0, kb * block - K)))
    scale = scale_from_amax(amax)  # [n, nb, kb]
    expanded = jnp.repeat(jnp.repeat(scale, block, axis=1)[:, :N], block, axis=2)[:, :, :K]  # broadcasts XLA fuses
    return quantize_div_fp8(w.astype(jnp.float32), expanded), scale


# --- 4-bit expert weights: MXFP4 and INT4 group 32 (CONTRACT.md section 9) --------------------------
#
# Codes are packed two a byte along K (element 2i in the low nibble, 2i + 1 in the high one), one scale per
# group of 32 values along K. The quantizers and dequantizers below must be bit-identical to moe_torch's
# on the CPU and the GPU, and two things in XLA stand in the way of plain float code:
#
# - XLA's CPU runtime flushes subnormal float32 values to zero, as inputs and as results (measured here:
#   ``w * 2**127`` of a subnormal ``w`` gives 0), while torch keeps them (as does XLA on the GPU). MXFP4
#   reaches subnormals for real: its smallest scale is ``2^-127``, and a group whose ``max |w|`` is below
#   ``2^-124`` has ``s = 0``, so a subnormal weight may become a nonzero code. So every value that may be
#   subnormal is read and written through its bits, with integer arithmetic; float operations are used
#   only where every operand and result is normal (or where a flush provably changes nothing).
# - XLA's GPU backend lowers float32 ``/`` to an approximate division and drops float32 -> narrow ->
#   float32 convert pairs: no division and no such round trip appears here (the INT4 quotient's rounding
#   is decided by exact comparisons, the bf16 rounding of the INT4 scale is done on the bits).
#
# The kernel-safe decoders (``e2m1_to_float32``, ``e8m0_to_float32``, ``int4_to_float32``) serve the
# Pallas-Triton grouped GEMM, which multiplies them in float32 on its tiles.

#: The e8m0 scale code that means NaN (OCP MX v1.0): its whole group dequantizes to NaN.
E8M0_NAN = 255
#: e2m1 rounding of a magnitude ``|v|``: the midpoints between the values ``0, 0.5, 1, 1.5, 2, 3, 4, 6``
#: and whether a tie on one goes up. A tie goes to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
#: 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); the code is the number of midpoints passed (so above 5 it is
#: 7, the value 6: saturation).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
#: float32(2 / 15): INT4 scales are ``max(amax, 1e-10) * INT4_INV_QMAX`` (compressed-tensors divides by 7.5).
INT4_INV_QMAX = np.float32(2.0 / 15.0)
_F32_INF_BITS = 0x7F800000
_F32_NAN_BITS = 0x7FC00000


def _bits(x: jax.Array) -> jax.Array:
    """The bit pattern of float32 ``x`` as int32 (a same-width bitcast: subnormals pass unchanged)."""
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def _float(bits: jax.Array) -> jax.Array:
    """float32 from an int32 bit pattern."""
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def e2m1_to_float32(code: jax.Array) -> jax.Array:
    """float32 values of e2m1 codes (an int array, values 0..15): sign bit 3, exponent bits 2..1, mantissa
    bit 0; ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` for 0..7 and their negatives for 8..15 (8 is -0.0).

    By arithmetic: exponent ``E``, mantissa ``M``: ``M * 2^-1`` for ``E = 0``, ``(2 + M) * 2^(E - 2)``
    above, the power of two built from its exponent bits (exact). Kernel-safe."""
    c = code.astype(jnp.int32)
    e, m = (c >> 1) & 3, c & 1
    sig = jnp.where(e > 0, m + 2, m)
    mag = sig.astype(jnp.float32) * _float((jnp.maximum(e, 1) + 125) << 23)  # 2^(max(E, 1) - 2)
    return jnp.where((c & 8) != 0, -mag, mag)


def e8m0_to_float32(s: jax.Array) -> jax.Array:
    """float32 ``2^(s - 127)`` of e8m0 scale codes ``s`` (an int array, 0..255), from the bits:
    ``s = 0`` is ``2^-127`` (subnormal: bit 22), ``s = 255`` is NaN (OCP MX v1.0). Kernel-safe."""
    b = s.astype(jnp.int32)
    return _float(jnp.where(b == 0, 1 << 22, jnp.where(b == E8M0_NAN, _F32_NAN_BITS, b << 23)))


def int4_to_float32(code: jax.Array) -> jax.Array:
    """float32 ``code - 8`` of offset-binary INT4 codes (an int array, 0..15): ``-8 .. 7``. Kernel-safe."""
    return (code.astype(jnp.int32) - 8).astype(jnp.float32)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """``codes [..., K]`` (ints 0..15, ``K`` even) -> ``[..., K // 2]`` uint8, element ``2i`` in the low nibble."""
    c = codes.astype(jnp.int32).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (c[..., 0] | (c[..., 1] << 4)).astype(jnp.uint8)


def unpack_nibbles(w_q: jax.Array) -> jax.Array:
    """``w_q [..., K // 2]`` uint8 -> codes ``[..., K]`` int32 (the low nibble is element ``2i``)."""
    b = w_q.astype(jnp.int32)
    return jnp.stack([b & 15, b >> 4], axis=-1).reshape(*w_q.shape[:-1], 2 * w_q.shape[-1])


def _group_bits(w: jax.Array) -> jax.Array:
    """The float32 bits of ``w [..., K]`` (any float dtype: its float32 value is exact), int32 ``[..., K // 32, 32]``."""
    return _bits(w.astype(jnp.float32)).reshape(*w.shape[:-1], w.shape[-1] // W4_GROUP, W4_GROUP)


def _exact_scaled(P: jax.Array, X: jax.Array, negative: jax.Array) -> jax.Array:
    """float32 ``(-1)^negative * P * 2^X``, built on the bits, for int32 ``P`` in ``[0, 2^24)`` and ``X >= -149``
    where that value is a float32 (normal, or subnormal with ``P * 2^(X + 149)`` an integer); above the float32
    range it is inf (IEEE overflow). ``float32(P)`` is exact and normal, its exponent field gives
    ``floor(log2 P)``; the result's exponent is that plus ``X``; a subnormal result is the integer
    ``P * 2^(X + 149)`` itself. ``P = 0`` gives a zero of the sign ``negative``."""
    pb = _bits(P.astype(jnp.float32))
    q = ((pb >> 23) - 127) + X  # the result's exponent
    normal = ((jnp.clip(q, -126, 127) + 127) << 23) | (pb & 0x7FFFFF)
    normal = jnp.where(q > 127, _F32_INF_BITS, normal)
    subnormal = P << jnp.clip(X + 149, 0, 31)
    bits = jnp.where(P == 0, 0, jnp.where(q >= -126, normal, subnormal))
    return _float(bits | (negative.astype(jnp.int32) << 31))


def quantize_weight_mxfp4_reference(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``w [..., N, K]`` float (``K % 32 == 0``) -> ``(w_q [..., N, K // 2] uint8, w_scale [..., N, K // 32] uint8)``.

    CONTRACT.md section 9 on the exact float32 value of ``w``, per group of 32, all on the bits of ``w``
    (``|w| = S * 2^X``, ``S < 2^24`` the significand with its implicit bit, ``X`` the exponent):

    - ``amax = max |w|``: the largest magnitude bit pattern (float32 order is integer order there).
    - ``s = clamp(floor(log2(amax)) - 2 + 127, 0, 254) = max(E_amax - 2, 0)``, ``E_amax`` the biased
      exponent field of ``amax``: ``floor(log2)`` of a normal float32 is ``E - 127``; zero and subnormals
      have ``E = 0`` and ``floor(log2) <= -127``, so ``s = 0``; finite ``E`` is at most 254.
    - ``v = w / 2^(s - 127) = S * 2^p`` with ``p = X + 127 - s``, exact unless it is subnormal, where the
      code is 0 either way. ``|v| < 8`` (``|w| < 2^(E_amax - 126)``), so for ``S >= 1``, ``p <= 2``; and
      for ``p < -26``, ``|v| < 2^-3``. So ``S * 2^clip(p, -26, 2)`` (a normal float32, exact) lies on the
      same side of every midpoint as ``|v|``; the code's magnitude is the number of midpoints it passes
      (:data:`_E2M1_MIDPOINTS`).
    - The sign bit: ``v < 0``, i.e. ``w`` negative and ``fl32(|v|) != 0``, i.e. ``S * 2^p > 2^-150``
      (exactly ``2^-150`` rounds to the even 0).

    Jittable, no host check: a group holding inf or NaN gets the NaN scale 255 (the public
    ``quantize_weight_mxfp4`` refuses such weights on the host)."""
    b = _group_bits(w)
    ab = b & 0x7FFFFFFF
    e_amax = jnp.max(ab, axis=-1) >> 23
    s = jnp.maximum(e_amax - 2, 0)
    e = ab >> 23
    S = jnp.where(e > 0, (ab & 0x7FFFFF) | 0x800000, ab)
    p = jnp.maximum(e, 1) - 150 + 127 - s[..., None]
    a = S.astype(jnp.float32) * _float((jnp.clip(p, -26, 2) + 127) << 23)
    mag = sum(((a >= t) if up else (a > t)).astype(jnp.int32) for t, up in _E2M1_MIDPOINTS)
    d = -150 - p  # fl32(|v|) != 0  <=>  S > 2^d (d >= 0), S >= 1 (d < 0)
    v_nonzero = jnp.where(d < 0, S >= 1, S > (1 << jnp.clip(d, 0, 30)))
    codes = mag | (((b < 0) & v_nonzero).astype(jnp.int32) << 3)
    s = jnp.where(e_amax == 255, E8M0_NAN, s)
    return pack_nibbles(codes.reshape(w.shape)), s.astype(jnp.uint8)


def dequantize_weight_mxfp4_reference(w_q: jax.Array, w_scale: jax.Array) -> jax.Array:
    """``w_q [..., N, K // 2]`` uint8, ``w_scale [..., N, K // 32]`` uint8 -> float32 ``[..., N, K]``:
    ``e2m1(code) * 2^(s - 127)``, NaN for ``s = 255``. Exact (at most 2 significant bits times a power of
    two; 6 or 4 times ``2^127`` overflow to inf), built on the bits (:func:`_exact_scaled`: the results of
    ``s <= 2`` may be subnormal). The e2m1 magnitude is ``sig * 2^(max(E, 1) - 2)`` (see :func:`e2m1_to_float32`)."""
    c = unpack_nibbles(w_q)
    c = c.reshape(*w_scale.shape, W4_GROUP)
    e, m = (c >> 1) & 3, c & 1
    sig = jnp.where(e > 0, m + 2, m)
    s = w_scale.astype(jnp.int32)[..., None]
    out = _exact_scaled(sig, jnp.maximum(e, 1) - 2 + s - 127, (c & 8) != 0)
    out = jnp.where(s == E8M0_NAN, jnp.float32(jnp.nan), out)
    return out.reshape(*w_q.shape[:-1], 2 * w_q.shape[-1])


def int4_scale_reference(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(scale bf16, the same value in float32)`` from a group's ``amax`` (float32):
    ``bf16_rne(max(amax, 1e-10) * float32(2 / 15))``. The product is one correctly rounded float32
    multiplication of normal numbers (a subnormal ``amax`` loses to ``1e-10`` whether or not it is
    flushed); the bf16 rounding is done on the bits (round half to even at bit 16, exact for these finite
    positive values), so no float32 -> bf16 -> float32 convert pair exists for XLA to drop. A non-finite
    ``amax`` gives the NaN scale."""
    t = jnp.maximum(amax, AMAX_FLOOR) * INT4_INV_QMAX
    b = _bits(t)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & ~0xFFFF
    b = jnp.where(_bits(amax) >= _F32_INF_BITS, _F32_NAN_BITS, b)
    scale16 = jax.lax.bitcast_convert_type((b >> 16).astype(jnp.uint16), jnp.bfloat16)
    return scale16, _float(b)


def _int4_midpoint(k: int) -> tuple[float, bool, np.float32]:
    """``(m, ties_up, h)`` for the magnitude ``k + 1``: the midpoint ``m = k + 0.5`` below it, whether a tie of
    ``rne`` on ``m`` goes up (``k`` odd: ``k + 1`` is even), and half the float32 spacing on the side of ``m``
    that decides: above it when ties stay (``k`` even), below it when they go up."""
    m = np.float32(k + 0.5)
    ties_up = k % 2 == 1
    side = np.nextafter(m, np.float32(0)) if ties_up else np.nextafter(m, np.float32(8))
    return float(m), ties_up, np.float32(abs(m - side) / 2)


_INT4_MIDPOINTS = tuple(_int4_midpoint(k) for k in range(8))


def quantize_weight_int4_reference(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``w [..., N, K]`` float (``K % 32 == 0``) -> ``(w_q [..., N, K // 2] uint8, w_scale [..., N, K // 32] bf16)``.

    CONTRACT.md section 9: ``scale`` from :func:`int4_scale_reference` of ``amax = max |w|`` (taken on the
    bits); ``q = clamp(rne(fl32(w / scale)), -8, 7)`` (the correctly rounded float32 quotient, then round
    half to even); ``code = q + 8``.

    No division is computed. For ``a = |w|`` and ``s`` the scale, ``rne(fl32(a / s)) >= k + 1`` iff
    ``fl32(a / s)`` passes the midpoint ``m = k + 0.5``, or lands on it with ``k`` odd. ``m`` has at most 4
    significant bits, so it is an even float32 and wins the ties of float32 rounding: ``fl32(a / s) > m``
    iff ``a / s > m + u/2`` and ``fl32(a / s) >= m`` iff ``a / s >= m - d/2`` (``u``, ``d`` the float32
    spacings above and below ``m``). Times ``s``: ``a - m*s > (u/2)*s`` resp. ``a - m*s >= -(d/2)*s``.
    Both products are exact (``s`` is a normal bf16 value, 8 significant bits, ``>= 1.3e-11``), so is
    ``a - m*s`` where ``m*s/2 <= a <= 2*m*s`` (Sterbenz), and outside that range the difference is at
    least ``m*s/2`` in magnitude, far from the right side (``~2^-22 * s``): each test is exact (a fused
    multiply-add changes nothing, ``m*s`` being exact; a flushed subnormal ``a`` neither: it is far below
    ``m*s``). The magnitude is the number of tests passed, at most 7 for ``w >= 0`` and 8 for ``w < 0`` (the
    clamp); a magnitude 0 is code 8 whatever the sign.

    Jittable, no host check: a group holding inf or NaN gets the NaN scale (the public
    ``quantize_weight_int4`` refuses such weights on the host)."""
    b = _group_bits(w)
    ab = b & 0x7FFFFFFF
    scale16, s = int4_scale_reference(_float(jnp.max(ab, axis=-1)))
    s = s[..., None]
    a = _float(ab)
    mag = sum((((a - m * s) >= -h * s) if up else ((a - m * s) > h * s)).astype(jnp.int32)
              for m, up, h in _INT4_MIDPOINTS)
    q = jnp.where(b < 0, -mag, jnp.minimum(mag, 7))
    return pack_nibbles((q + 8).reshape(w.shape)), scale16


def dequantize_weight_int4_reference(w_q: jax.Array, w_scale: jax.Array) -> jax.Array:
    """``w_q [..., N, K // 2]`` uint8, ``w_scale [..., N, K // 32]`` bf16 -> float32 ``[..., N, K]``:
    ``float32(code - 8) * float32(scale)``, the IEEE product, exact (4 times 8 significant bits): built on
    the bits (:func:`_exact_scaled`) for finite scales, as a subnormal bf16 scale gives subnormal products;
    a NaN / inf scale gives the float product (NaN, or inf of the product's sign; NaN for code 8)."""
    c = unpack_nibbles(w_q).reshape(*w_scale.shape, W4_GROUP)
    q = c - 8
    sb = jax.lax.bitcast_convert_type(w_scale, jnp.uint16).astype(jnp.int32)[..., None]  # bf16 bits
    e = (sb >> 7) & 0xFF
    sig = jnp.where(e > 0, (sb & 0x7F) | 0x80, sb & 0x7F)  # |scale| = sig * 2^(max(e, 1) - 134)
    out = _exact_scaled(jnp.abs(q) * sig, jnp.maximum(e, 1) - 134, (q < 0) ^ ((sb >> 15) == 1))
    out = jnp.where(e == 0xFF, q.astype(jnp.float32) * w_scale.astype(jnp.float32)[..., None], out)
    return out.reshape(*w_q.shape[:-1], 2 * w_q.shape[-1])


def dequantize_weight_4bit_reference(w_q: jax.Array, w_scale: jax.Array, w_format: str) -> jax.Array:
    """:func:`dequantize_weight_mxfp4_reference` or :func:`dequantize_weight_int4_reference` by ``w_format``
    (``"mxfp4_mma"``: the MMA layout's codes, :func:`mxfp4_mma_as_checkpoint` first)."""
    if w_format == "mxfp4_mma":
        return dequantize_weight_mxfp4_reference(*mxfp4_mma_as_checkpoint(w_q, w_scale))
    if w_format == "mxfp4":
        return dequantize_weight_mxfp4_reference(w_q, w_scale)
    return dequantize_weight_int4_reference(w_q, w_scale)


def mma_permute(w_q: jax.Array, to_mma: bool) -> jax.Array:
    """MXFP4 codes ``[..., K // 2]`` uint8 (last axis a multiple of 4, unchecked) to the MMA layout (``to_mma``) or
    back (``moe_contract/w4_layout.py``): each little-endian 32-bit word is ``OR(rotl(word, r) & mask)`` over
    ``mma_moves``. Jittable."""
    words = jax.lax.bitcast_convert_type(w_q.reshape(*w_q.shape[:-1], w_q.shape[-1] // 4, 4), jnp.uint32)
    acc = jnp.zeros_like(words)
    for r, mask in mma_moves(to_mma):
        rot = words if r == 0 else (words << np.uint32(r)) | (words >> np.uint32(32 - r))  # uint32: logical shifts
        acc = acc | (rot & np.uint32(mask))
    return jax.lax.bitcast_convert_type(acc, jnp.uint8).reshape(w_q.shape)


def mma_codes_for_kernel(op: str, w_q: jax.Array, w_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MMA-layout codes as the Pallas-Triton kernels read them (their decode takes the checkpoint layout):
    :func:`mxfp4_mma_as_checkpoint`, a copy of the codes a call, said once in the log (on this path the layout costs
    time instead of saving it: keep ``w4_layout="checkpoint"`` for JAX)."""
    _warn_mma_copy(op)
    return mxfp4_mma_as_checkpoint(w_q, w_scale)


@functools.cache
def _warn_mma_copy(op: str) -> None:
    logging.getLogger("moe_pallas").warning(
        "%s: MMA-layout MXFP4 codes are taken back to the checkpoint layout at each call (a copy of the codes): the "
        "Pallas kernels decode the checkpoint layout; w4_layout='checkpoint' is faster in JAX", op)


def mxfp4_mma_as_checkpoint(w_q: jax.Array, w_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``"mxfp4_mma"`` weights as the ``"mxfp4"`` weights of the same values (CONTRACT.md section 9, MMA layout):
    the codes back in the checkpoint layout, and the scale codes the layout's table does not hold (129..254) as
    255 (NaN), as the kernels reading the layout give them. Jittable."""
    bad = (w_scale > MXFP4_MMA_MAX_SCALE_CODE) & (w_scale != 255)
    return mma_permute(w_q, False), jnp.where(bad, jnp.uint8(255), w_scale)
