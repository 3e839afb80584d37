"""``silu_and_mul`` / ``gelu_tanh_and_mul`` as a Pallas kernel with the Triton lowering (CONTRACT.md sections 3-4).

Dataflow: ``h [M, 2*I]`` (gate half first, then up half) -> per program a
``block_m x block_i`` tile ``a = act(gate) * up`` in float32 -> either ``out [M, I]`` in the
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
elementwise ops and same-width bitcasts, which lower inside a kernel).

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
from moe_pallas.ops.activation.reference import ACTIVATION_GRADS, ACTIVATIONS
from moe_pallas.ops.quant.reference import FP8_DTYPE, quantize_div_fp8, scale_from_amax


def _kernel(h_ref, *refs, mode: str, activation: str, M: int, I: int, block_m: int, block_i: int):
    """One ``block_m x block_i`` tile of ``act(h[:, :I]) * h[:, I:]``.

    Grid: ``(cdiv(M, block_m), n_col_blocks)``; program ``(i, j)`` owns rows
    ``[i*block_m, (i+1)*block_m)`` and output columns ``[j*block_i, (j+1)*block_i)``.
    Refs are whole arrays: ``h_ref [M, 2*I]`` in; then by ``mode``:

    - ``"cast"``: ``out_ref [M, I]`` out.
    - ``"quant"``: ``q_ref [M, I]`` fp8 and ``scale_ref [M, n_col_blocks]`` f32 out; the tile's
      column block is one scale group.
    - ``"amax"``: ``amax_ref [M, n_col_blocks]`` f32 out (first pass of two-pass per-token).
    - ``"quant_given"``: ``scale_ref [M, 1]`` f32 in, ``q_ref [M, I]`` fp8 out (second pass).
    """
    i, j = pl.program_id(0), pl.program_id(1)
    # Column indices next to a slice are traced int32: interpret mode rejects python ints there.
    row0, col0 = i * block_m, j * block_i
    row_ok = row0 + jnp.arange(block_m) < M  # [block_m]
    col_ok = col0 + jnp.arange(block_i) < I  # [block_i]
    mask = row_ok[:, None] & col_ok[None, :]
    rows, cols = pl.ds(row0, block_m), pl.ds(col0, block_i)
    g = plgpu.load(h_ref.at[rows, cols], mask=mask, other=0.0).astype(jnp.float32)
    u = plgpu.load(h_ref.at[rows, pl.ds(I + col0, block_i)], mask=mask, other=0.0).astype(jnp.float32)
    a = ACTIVATIONS[activation](g) * u  # masked lanes: act(0) * 0 = 0
    if mode == "cast":
        (out_ref,) = refs
        plgpu.store(out_ref.at[rows, cols], a.astype(out_ref.dtype), mask=mask)
        return
    if mode == "quant_given":
        scale_ref, q_ref = refs
        scale = plgpu.load(scale_ref.at[rows, jnp.int32(0)], mask=row_ok, other=1.0)
        plgpu.store(q_ref.at[rows, cols], quantize_div_fp8(a, scale[:, None]), mask=mask)
        return
    amax = jnp.max(jnp.where(mask, jnp.abs(a), 0.0), axis=1)  # [block_m]
    if mode == "amax":
        (amax_ref,) = refs
        plgpu.store(amax_ref.at[rows, j], amax, mask=row_ok)
        return
    q_ref, scale_ref = refs
    scale = scale_from_amax(amax)
    plgpu.store(q_ref.at[rows, cols], quantize_div_fp8(a, scale[:, None]), mask=mask)
    plgpu.store(scale_ref.at[rows, j], scale, mask=row_ok)


def _call(h, mode, activation, out_shape, extra_inputs, cfg: ActAndMulConfig, n_col_blocks: int, interpret: bool):
    M, two_i = h.shape
    kernel = functools.partial(_kernel, mode=mode, activation=activation, M=M, I=two_i // 2,
                               block_m=cfg.block_m, block_i=cfg.block_i)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(M, cfg.block_m), n_col_blocks),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"{activation}_and_mul_{mode}",
    )(h, *extra_inputs)


def check_supported(h_shape: tuple[int, int], quant: str | None, group_size: int, cfg: ActAndMulConfig) -> None:
    """Raise ``NotImplementedError`` for a valid request this backend cannot serve."""
    I = h_shape[1] // 2
    if cfg.block_m * cfg.block_i > MAX_TILE_ELEMENTS:
        raise NotImplementedError(
            f"act_and_mul[pallas_triton]: a tile of block_m * block_i = {cfg.block_m} * {cfg.block_i} elements is over "
            f"Triton's {MAX_TILE_ELEMENTS} (group_size={group_size})")
    if quant == "fp8_per_token_group" and cfg.block_i != group_size:
        raise NotImplementedError(
            f"act_and_mul[pallas_triton]: per-token-group quantization needs block_i == group_size "
            f"(a power of two: a Triton block is); got group_size={group_size}, block_i={cfg.block_i}")
    if quant == "fp8_per_token" and not cfg.two_pass and cfg.block_i < I:
        raise NotImplementedError(
            f"act_and_mul[pallas_triton]: one-pass per-token quantization needs block_i >= I (={I}); "
            f"got block_i={cfg.block_i} (set two_pass=True)")


@functools.partial(jax.jit, static_argnames=("activation", "quant", "group_size", "out_dtype", "config", "interpret"))
def act_and_mul_pallas_triton(
    h: jax.Array,
    *,
    activation: str = "silu",
    quant: str | None = None,
    group_size: int = 128,
    out_dtype=None,
    config: ActAndMulConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """``act(h[:, :I]) * h[:, I:]`` in float32, cast or quantized to FP8, as a Pallas-Triton kernel.

    Args (validated by ``moe_pallas.ops.activation.api.act_and_mul``):
      h: ``[M, 2*I]`` float32 / bf16 / float16, gate half first.
      activation: ``"silu"`` or ``"gelu_tanh"``.
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
    check_supported(h.shape, quant, group_size, cfg)
    n_groups = {None: 0, "fp8_per_token": 1, "fp8_per_token_group": I // group_size}[quant]
    if M == 0 or I == 0:  # nothing to launch; the contract's values for empty rows
        if quant is None:
            return jnp.zeros((M, I), out_dtype), None
        return jnp.zeros((M, I), FP8_DTYPE), jnp.full((M, n_groups), scale_from_amax(jnp.float32(0.0)))
    n_blocks = pl.cdiv(I, cfg.block_i)
    run = functools.partial(_call, h, activation=activation, cfg=cfg, interpret=interpret)
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


def _backward_kernel(h_ref, da_ref, dh_ref, *, activation: str, M: int, I: int, block_m: int, block_i: int):
    """Grid ``(cdiv(M, block_m), cdiv(I, block_i))``; program ``(i, j)`` writes ``d_h[rows, cols]`` and
    ``d_h[rows, I + cols]`` for ``rows = [i*block_m, (i+1)*block_m)``, ``cols = [j*block_i, (j+1)*block_i)``.

    Refs (whole arrays): ``h_ref [M, 2*I]`` and ``da_ref [M, I]`` float in; ``dh_ref [M, 2*I]`` out.
    """
    i, j = pl.program_id(0), pl.program_id(1)
    row0, col0 = i * block_m, j * block_i
    mask = (row0 + jnp.arange(block_m) < M)[:, None] & (col0 + jnp.arange(block_i) < I)[None, :]
    rows, cols, up = pl.ds(row0, block_m), pl.ds(col0, block_i), pl.ds(I + col0, block_i)
    g = plgpu.load(h_ref.at[rows, cols], mask=mask, other=0.0).astype(jnp.float32)
    u = plgpu.load(h_ref.at[rows, up], mask=mask, other=0.0).astype(jnp.float32)
    da = plgpu.load(da_ref.at[rows, cols], mask=mask, other=0.0).astype(jnp.float32)
    plgpu.store(dh_ref.at[rows, cols], (da * u * ACTIVATION_GRADS[activation](g)).astype(dh_ref.dtype), mask=mask)
    plgpu.store(dh_ref.at[rows, up], (da * ACTIVATIONS[activation](g)).astype(dh_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("activation", "out_dtype", "config", "interpret"))
def act_and_mul_backward_pallas_triton(
    h: jax.Array,
    d_a: jax.Array,
    *,
    activation: str = "silu",
    out_dtype=None,
    config: ActAndMulBackwardConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``d_h = [d_a * u * act'(g) | d_a * act(g)]`` in float32, cast once, as one fused Pallas-Triton kernel.

    Args (validated by ``moe_pallas.ops.activation.api.act_and_mul_backward``):
      h: ``[M, 2*I]`` float32 / bf16 / float16, gate half first.
      d_a: ``[M, I]`` float32 / bf16 / float16.
      activation: ``"silu"`` or ``"gelu_tanh"``.
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
    if cfg.block_m * cfg.block_i > MAX_TILE_ELEMENTS:
        raise NotImplementedError(
            f"act_and_mul_backward[pallas_triton]: a tile of block_m * block_i = {cfg.block_m} * {cfg.block_i} "
            f"elements is over Triton's {MAX_TILE_ELEMENTS}")
    if M == 0 or I == 0:  # nothing to launch
        return jnp.zeros((M, two_i), out_dtype)
    kernel = functools.partial(_backward_kernel, activation=activation, M=M, I=I, block_m=cfg.block_m,
                               block_i=cfg.block_i)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, two_i), out_dtype),
        grid=(pl.cdiv(M, cfg.block_m), pl.cdiv(I, cfg.block_i)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"{activation}_and_mul_backward",
    )(h, d_a)
