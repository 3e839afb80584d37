"""FP8 (float8_e4m3fn) quantization reference in jnp: CONTRACT.md section 3.

Every scale is a *dequantization multiplier*: ``x ~= q * scale``.
Mirror: ``moe_torch/ops/quant/reference.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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
