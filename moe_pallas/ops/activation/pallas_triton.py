"""``silu_and_mul`` / ``gelu_tanh_and_mul`` / ``swiglu_oai_and_mul`` as a Pallas kernel with the Triton lowering
(CONTRACT.md sections 3-4).

Dataflow: ``h [M, 2*I]`` (gate half first, then up half; or interleaved ``g0 u0 g1 u1 ...``) -> per program a
``block_m x block_i`` tile ``a = act(gate) * up`` in float32 (the reference's own elementwise
``gated``: swiglu_oai's clamps are selects, a NaN stays NaN) -> either ``out [M, I]`` in the
output dtype, or FP8 e4m3 codes ``q [M, I]`` plus their dequantization scales, fused:

- per-token-group (``scale [M, I // G]``): one program per ``block_m`` rows and one group
  (``block_i == G``) computes the group's amax, the scale and the codes;
- per-token (``scale [M, 1]``): rows up to ``MAX_ROW_BLOCK`` wide are one group of one
  program (the same code as above with ``block_i >= I``); wider rows take two passes: a first
  kernel writes the amax of every ``block_i`` column block (``[M, n_blocks]`` float32), XLA
  takes the row max and the scale, and the second kernel recomputes the activation and
  quantizes it with the given scale.

The FP8 codes are bit-identical to ``quant/reference.py`` applied to the same float32
activation values: plain ``/`` is approximate (``div.full.f32``) in the Pallas-Triton
lowering, so the kernel quantizes with the reference's own ``quantize_div_fp8``, whose
``fp8_round_quotient`` repairs each code to the correctly rounded quotient's (it uses only
elementwise ops and same-width bitcasts, which lower inside a kernel; interpret mode, and ``EPMOE_PALLAS_DIV_RN=0``),
or, by default on an sm_90+ GPU, with PTX ``div.rn.f32`` (the same codes in a third of the instructions:
``moe_pallas/ops/quant/pallas_triton.py``).

Gate/up layout: concatenated, ``g`` and ``u`` are two ``block_m x block_i`` loads ``I`` columns apart;
interleaved (gpt-oss), one contiguous ``block_m x 2*block_i`` load, reshaped to ``[block_m, block_i, 2]`` and
unstacked (``lax.unstack`` on the last axis lowers to ``tt.split``) into ``g`` (even columns) and ``u`` (odd);
the backward stacks ``d_g``, ``d_u`` (``tt.join``) into one contiguous store the same way.

Loads and stores are masked (``jax.experimental.pallas.triton.load/store``); refs are whole
arrays, so odd ``I`` and any ``M`` work. Masking pattern learned from
jax-ml/jax@jax-v0.11.2:jax/experimental/pallas/ops/gpu/rms_norm.py.

**Backward** (CONTRACT.md section 8), ``act_and_mul_backward_pallas_triton``, grid
``(cdiv(M, block_m), cdiv(I, block_i))``, fused: per program ``g, u`` (the tile's columns of both
halves of ``h``) and ``d_a`` are read once, upcast to float32, and ``d_h = [d_a * u * act'(g) |
d_a * act(g)]`` is written once (the same ``ACTIVATION_GRADS`` as the reference: silu
``s (1 + g (1 - s))``, gelu_tanh the derivative of the tanh formula).

Mirror: ``moe_torch/ops/activation/triton.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_pallas.ops.activation.config import (
    MAX_TILE_ELEMENTS,
    ActAndMulBackwardConfig,
    ActAndMulConfig,
    act_and_mul_backward_config,
    act_and_mul_config,
)
from moe_pallas.ops.activation.reference import gated, gated_backward
from moe_pallas.ops.quant.pallas_triton import kernel_div_rn, quantize_div_fp8_kernel
from moe_pallas.ops.quant.reference import FP8_DTYPE, scale_from_amax


def _load_gate_up(h_ref, row0, col0, row_ok, *, I: int, interleaved: bool, block_m: int, block_i: int):
    """``(g, u)`` ``[block_m, block_i]`` float32 (masked elements 0) of gate columns ``col0 + [0, block_i)``:
    concatenated, two loads ``I`` columns apart; interleaved, one contiguous ``[block_m, 2*block_i]`` load of
    ``h`` columns ``[2*col0, 2*col0 + 2*block_i)`` split into even (gate) and odd (up) columns."""
    rows = pl.ds(row0, block_m)
    if interleaved:
        pair_ok = 2 * col0 + jnp.arange(2 * block_i) < 2 * I
        x = plgpu.load(h_ref.at[rows, pl.ds(2 * col0, 2 * block_i)], mask=row_ok[:, None] & pair_ok[None, :],
                       other=0.0).astype(jnp.float32)
        g, u = jax.lax.unstack(x.reshape(block_m, block_i, 2), axis=2)
        return g, u
    mask = row_ok[:, None] & (col0 + jnp.arange(block_i) < I)[None, :]
    g = plgpu.load(h_ref.at[rows, pl.ds(col0, block_i)], mask=mask, other=0.0).astype(jnp.float32)
    u = plgpu.load(h_ref.at[rows, pl.ds(I + col0, block_i)], mask=mask, other=0.0).astype(jnp.float32)
    return g, u


def _kernel(h_ref, *refs, mode: str, activation: str, interleaved: bool, M: int, I: int, block_m: int, block_i: int,
            div_rn: bool = False):
    """One ``block_m x block_i`` tile of ``act(g) * u`` (``g``, ``u`` concatenated or ``interleaved`` in ``h``).

    Grid: ``(cdiv(M, block_m), n_col_blocks)``; program ``(i, j)`` owns rows
    ``[i*block_m, (i+1)*block_m)`` and output columns ``[j*block_i, (j+1)*block_i)``.
    Refs are whole arrays: ``h_ref [M, 2*I]`` in; then by ``mode``:

    - ``"cast"``: ``out_ref [M, I]`` out.
    - ``"quant"``: ``q_ref [M, I]`` fp8 and ``scale_ref [M, n_col_blocks]`` f32 out; the tile's
      column block is one scale group.
    - ``"amax"``: ``amax_ref [M, n_col_blocks]`` f32 out (first pass of two-pass per-token).
    - ``"quant_given"``: ``scale_ref [M, 1]`` f32 in, ``q_ref [M, I]`` fp8 out (second pass).

    ``div_rn``: the FP8 division's form (:func:`~moe_pallas.ops.quant.pallas_triton.quantize_div_fp8_kernel`).
    """
    i, j = pl.program_id(0), pl.program_id(1)
    # Column indices next to a slice are traced int32: interpret mode rejects python ints there.
    row0, col0 = i * block_m, j * block_i
    row_ok = row0 + jnp.arange(block_m) < M  # [block_m]
    col_ok = col0 + jnp.arange(block_i) < I  # [block_i]
    mask = row_ok[:, None] & col_ok[None, :]
    rows, cols = pl.ds(row0, block_m), pl.ds(col0, block_i)
    g, u = _load_gate_up(h_ref, row0, col0, row_ok, I=I, interleaved=interleaved, block_m=block_m, block_i=block_i)
    a = gated(activation, g, u)  # masked lanes: act(0) * (0 or 1) = 0
    if mode == "cast":
        (out_ref,) = refs
        plgpu.store(out_ref.at[rows, cols], a.astype(out_ref.dtype), mask=mask)
        return
    if mode == "quant_given":
        scale_ref, q_ref = refs
        scale = plgpu.load(scale_ref.at[rows, jnp.int32(0)], mask=row_ok, other=1.0)
        plgpu.store(q_ref.at[rows, cols], quantize_div_fp8_kernel(a, scale[:, None], div_rn=div_rn), mask=mask)
        return
    amax = jnp.max(jnp.where(mask, jnp.abs(a), 0.0), axis=1)  # [block_m]
    if mode == "amax":
        (amax_ref,) = refs
        plgpu.store(amax_ref.at[rows, j], amax, mask=row_ok)
        return
    q_ref, scale_ref = refs
    scale = scale_from_amax(amax)
    plgpu.store(q_ref.at[rows, cols], quantize_div_fp8_kernel(a, scale[:, None], div_rn=div_rn), mask=mask)
    plgpu.store(scale_ref.at[rows, j], scale, mask=row_ok)


def _call(h, mode, activation, layout, out_shape, extra_inputs, cfg: ActAndMulConfig, n_col_blocks: int,
          interpret: bool):
    M, two_i = h.shape
    kernel = functools.partial(_kernel, mode=mode, activation=activation, interleaved=layout == "interleaved", M=M,
                               I=two_i // 2, block_m=cfg.block_m, block_i=cfg.block_i, div_rn=kernel_div_rn(interpret))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(M, cfg.block_m), n_col_blocks),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"{activation}_and_mul_{mode}",
    )(h, *extra_inputs)


def check_supported(h_shape: tuple[int, int], quant: str | None, group_size: int, cfg: ActAndMulConfig,
                    layout: str = "concatenated") -> None:
    """Raise ``NotImplementedError`` for a valid request this backend cannot serve."""
    I = h_shape[1] // 2
    load = 2 if layout == "interleaved" else 1  # the interleaved load is one [block_m, 2*block_i] block
    if load * cfg.block_m * cfg.block_i > MAX_TILE_ELEMENTS:
        raise NotImplementedError(
            f"act_and_mul[pallas_triton]: a tile of {'2 * ' if load == 2 else ''}block_m * block_i = "
            f"{load * cfg.block_m * cfg.block_i} elements (block_m={cfg.block_m}, block_i={cfg.block_i}, "
            f"layout={layout!r}) is over Triton's {MAX_TILE_ELEMENTS} (group_size={group_size})")
    if quant == "fp8_per_token_group" and cfg.block_i != group_size:
        raise NotImplementedError(
            f"act_and_mul[pallas_triton]: per-token-group quantization needs block_i == group_size "
            f"(a power of two: a Triton block is); got group_size={group_size}, block_i={cfg.block_i}")
    if quant == "fp8_per_token" and not cfg.two_pass and cfg.block_i < I:
        raise NotImplementedError(
            f"act_and_mul[pallas_triton]: one-pass per-token quantization needs block_i >= I (={I}); "
            f"got block_i={cfg.block_i} (set two_pass=True)")


@functools.partial(jax.jit, static_argnames=("activation", "layout", "quant", "group_size", "out_dtype", "config",
                                             "interpret"))
def act_and_mul_pallas_triton(
    h: jax.Array,
    *,
    activation: str = "silu",
    layout: str = "concatenated",
    quant: str | None = None,
    group_size: int = 128,
    out_dtype=None,
    config: ActAndMulConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """``act(g) * u`` in float32, cast or quantized to FP8, as a Pallas-Triton kernel.

    Args (validated by ``moe_pallas.ops.activation.api.act_and_mul``):
      h: ``[M, 2*I]`` float32 / bf16 / float16, gate and up as ``layout`` places them.
      activation: ``"silu"``, ``"gelu_tanh"`` or ``"swiglu_oai"``.
      layout: ``"concatenated"`` (gate ``h[:, :I]``) or ``"interleaved"`` (gate ``h[:, 0::2]``, up ``h[:, 1::2]``).
      quant: ``None`` (``out [M, I]`` in ``out_dtype``, default ``h.dtype``),
        ``"fp8_per_token"`` (``scale [M, 1]``) or ``"fp8_per_token_group"``
        (``scale [M, I // group_size]``). Scales are dequantization multipliers (``x ~= q * scale``).
      config: launch config (default: :func:`act_and_mul_config` of the shapes).
      interpret: run in Pallas interpret mode (default: when ``jax.default_backend() == "cpu"``).

    Grid: ``(cdiv(M, block_m), n_col_blocks)`` with ``n_col_blocks = cdiv(I, block_i)``
    (``I // group_size`` for per-token-group, 1 for one-pass per-token); static.

    Returns: ``(out [M, I], None)`` or ``(q [M, I] float8_e4m3fn, scale float32)``.

    Raises: NotImplementedError (group_size not a power of two, or a config that does not fit
    the quantization).
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    M, two_i = h.shape
    I = two_i // 2
    out_dtype = h.dtype if out_dtype is None else jnp.dtype(out_dtype)
    if quant == "fp8_per_token_group" and group_size & (group_size - 1):
        raise NotImplementedError(
            f"act_and_mul[pallas_triton]: group_size must be a power of two (a Triton block is); got group_size={group_size}")
    cfg = act_and_mul_config(M, I, quant, group_size) if config is None else config
    check_supported(h.shape, quant, group_size, cfg, layout)
    n_groups = {None: 0, "fp8_per_token": 1, "fp8_per_token_group": I // group_size}[quant]
    if M == 0 or I == 0:  # nothing to launch; the contract's values for empty rows
        if quant is None:
            return jnp.zeros((M, I), out_dtype), None
        return jnp.zeros((M, I), FP8_DTYPE), jnp.full((M, n_groups), scale_from_amax(jnp.float32(0.0)))
    n_blocks = pl.cdiv(I, cfg.block_i)
    run = functools.partial(_call, h, activation=activation, layout=layout, cfg=cfg, interpret=interpret)
    if quant is None:
        out = run(mode="cast", out_shape=jax.ShapeDtypeStruct((M, I), out_dtype), extra_inputs=(), n_col_blocks=n_blocks)
        return out, None
    q_shape = jax.ShapeDtypeStruct((M, I), FP8_DTYPE)
    if quant == "fp8_per_token" and cfg.two_pass:
        amax = run(mode="amax", out_shape=jax.ShapeDtypeStruct((M, n_blocks), jnp.float32), extra_inputs=(),
                   n_col_blocks=n_blocks)
        scale = scale_from_amax(amax.max(axis=1, keepdims=True))  # [M, 1]: max is exact in any order
        q = run(mode="quant_given", out_shape=q_shape, extra_inputs=(scale,), n_col_blocks=n_blocks)
        return q, scale
    q, scale = run(mode="quant", out_shape=(q_shape, jax.ShapeDtypeStruct((M, n_groups), jnp.float32)),
                   extra_inputs=(), n_col_blocks=n_groups)
    return q, scale



# --------------------------------------------------------------------------------------
# backward


def _backward_kernel(h_ref, da_ref, dh_ref, *, activation: str, interleaved: bool, M: int, I: int, block_m: int,
                     block_i: int):
    """Grid ``(cdiv(M, block_m), cdiv(I, block_i))``; program ``(i, j)`` writes the gradients of gate columns
    ``cols = [j*block_i, (j+1)*block_i)`` and their up columns (``d_h[rows, cols]`` and ``d_h[rows, I + cols]``;
    interleaved ``d_h[rows, 2*cols]`` and ``d_h[rows, 2*cols + 1]``) for ``rows = [i*block_m, (i+1)*block_m)``.

    Refs (whole arrays): ``h_ref [M, 2*I]`` and ``da_ref [M, I]`` float in; ``dh_ref [M, 2*I]`` out.
    """
    i, j = pl.program_id(0), pl.program_id(1)
    row0, col0 = i * block_m, j * block_i
    row_ok = row0 + jnp.arange(block_m) < M
    mask = row_ok[:, None] & (col0 + jnp.arange(block_i) < I)[None, :]
    rows, cols = pl.ds(row0, block_m), pl.ds(col0, block_i)
    g, u = _load_gate_up(h_ref, row0, col0, row_ok, I=I, interleaved=interleaved, block_m=block_m, block_i=block_i)
    da = plgpu.load(da_ref.at[rows, cols], mask=mask, other=0.0).astype(jnp.float32)
    d_g, d_u = gated_backward(activation, g, u, da)
    if interleaved:  # one contiguous [block_m, 2*block_i] store: d_g, d_u, d_g, d_u, ...
        pair_ok = 2 * col0 + jnp.arange(2 * block_i) < 2 * I
        d = jax.lax.stack([d_g, d_u], axis=2).reshape(block_m, 2 * block_i)
        plgpu.store(dh_ref.at[rows, pl.ds(2 * col0, 2 * block_i)], d.astype(dh_ref.dtype),
                    mask=row_ok[:, None] & pair_ok[None, :])
        return
    plgpu.store(dh_ref.at[rows, cols], d_g.astype(dh_ref.dtype), mask=mask)
    plgpu.store(dh_ref.at[rows, pl.ds(I + col0, block_i)], d_u.astype(dh_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("activation", "layout", "out_dtype", "config", "interpret"))
def act_and_mul_backward_pallas_triton(
    h: jax.Array,
    d_a: jax.Array,
    *,
    activation: str = "silu",
    layout: str = "concatenated",
    out_dtype=None,
    config: ActAndMulBackwardConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``d_h = [d_a * u * act'(g) | d_a * act(g)]`` in float32 (swiglu_oai: the reference's ``gated_backward``;
    interleaved: ``d_g``, ``d_u`` where ``h`` has ``g``, ``u``), cast once, as one fused Pallas-Triton kernel.

    Args (validated by ``moe_pallas.ops.activation.api.act_and_mul_backward``):
      h: ``[M, 2*I]`` float32 / bf16 / float16, gate and up as ``layout`` places them.
      d_a: ``[M, I]`` float32 / bf16 / float16.
      activation: ``"silu"``, ``"gelu_tanh"`` or ``"swiglu_oai"``.
      layout: ``"concatenated"`` or ``"interleaved"``.
      out_dtype: default ``h.dtype``.
      config: launch config (default: :func:`act_and_mul_backward_config` of the shapes).
      interpret: run in Pallas interpret mode (default: when ``jax.default_backend() == "cpu"``).

    Grid: ``(cdiv(M, block_m), cdiv(I, block_i))``, static.

    Returns: ``d_h [M, 2*I]`` in ``out_dtype``.

    Raises: NotImplementedError (a tile over Triton's element limit).
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    M, two_i = h.shape
    I = two_i // 2
    out_dtype = h.dtype if out_dtype is None else jnp.dtype(out_dtype)
    cfg = act_and_mul_backward_config(M, I) if config is None else config
    load = 2 if layout == "interleaved" else 1  # the interleaved load and store are [block_m, 2*block_i] blocks
    if load * cfg.block_m * cfg.block_i > MAX_TILE_ELEMENTS:
        raise NotImplementedError(
            f"act_and_mul_backward[pallas_triton]: a tile of {'2 * ' if load == 2 else ''}block_m * block_i = "
            f"{load * cfg.block_m * cfg.block_i} elements (block_m={cfg.block_m}, block_i={cfg.block_i}, "
            f"layout={layout!r}) is over Triton's {MAX_TILE_ELEMENTS}")
    if M == 0 or I == 0:  # nothing to launch
        return jnp.zeros((M, two_i), out_dtype)
    kernel = functools.partial(_backward_kernel, activation=activation, interleaved=layout == "interleaved", M=M, I=I,
                               block_m=cfg.block_m, block_i=cfg.block_i)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, two_i), out_dtype),
        grid=(pl.cdiv(M, cfg.block_m), pl.cdiv(I, cfg.block_i)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"{activation}_and_mul_backward",
    )(h, d_a)
