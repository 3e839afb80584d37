"""Launch configuration of the Pallas-Triton grouped GEMM (``pallas_triton.py``).

Mirror: ``moe_torch/ops/grouped_gemm/config.py`` (when the Triton kernel lands).

A program computes one ``block_m x block_n`` tile of ``y [M_cap, N]`` for the rows of one
expert, looping over ``K`` in ``block_k`` steps (``x`` tile ``[block_m, block_k]`` times the
K-major weight tile ``[block_n, block_k]``, float32 accumulator in registers). The numbers
below are first, untuned choices (no GPU measurements yet); the constraints are hard ones.

Tuned configs: the tables of :func:`tuned_tables` (``moe_contract/selection.py``: the per-user cache of ``epmoe
tune``, then ``tuned/<arch>/<device kind>.json``, then ``tuned/<arch>.json``; entries with named keys, both backends
in one file). :func:`grouped_gemm_config` and
:func:`mosaic_grouped_gemm_config` prefer the entry of the same backend, ``N``, ``K`` and dtype
(and ``fast_accum`` for Mosaic) with the nearest ``M_cap`` (in log2) when they are given the
device spec (the kernels pass :func:`gpu_device_spec`, read on the host at trace time; none on
the CPU or in interpret mode), and fall back to the heuristics (:func:`heuristic_grouped_gemm_config`,
:func:`heuristic_mosaic_grouped_gemm_config`) when no entry matches or the nearest one breaks a
rule of this request (scale layout, whole tiles). Mirror of ``moe_torch/ops/grouped_gemm/config.py``.
The same file holds the measured backend choices (entries with ``"kind": "backend_choice"``, written by
``tune_backend.py``, read by ``backend_table.py``); launch configs have no ``"kind"``.

The Pallas-Triton backward kernels (``pallas_triton_backward.py``) take :class:`GroupedGemmDgradConfig` and
:class:`GroupedGemmWgradConfig`, from their heuristics only. The Mosaic GPU backward (``pallas_mosaic_gpu_backward.py``)
looks its defaults up as the forward does, in the same file: :func:`mosaic_dgrad_config` and :func:`mosaic_wgrad_config`
take the entry with ``"op": "dgrad"`` / ``"wgrad"`` (written by ``benchmarks/tune_jax_gemm.py --ops dgrad,wgrad``; the
nearest ``M_cap``, the same ``N``, ``K`` of ``w [E, N, K]``, dtype and ``out_dtype``) where it keeps the kernel's rules,
else their heuristics; forward entries have no ``"op"`` (:data:`TUNED_OPS`), and each lookup sees only its own op's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

from jax.experimental import pallas as pl

from moe_contract.selection import DeviceSpec, TunedTables
from moe_contract.op_checks import W4_GROUP  # K values per scale of 4-bit weights (CONTRACT.md section 9)
from moe_pallas.ops.device import device_spec

#: The heuristic K step with 4-bit weights and 16-bit ``x`` (128 K values: 256 bytes of ``x``, 64 of codes a row).
W4_BLOCK_K = 128

#: Smallest block of a ``dot`` dimension: Hopper's tensor-core instructions (and Triton's
#: ``tt.dot`` lowering for them) need M, N and K tiles of at least 16.
MIN_DOT_BLOCK = 16
#: Rows per program, at most. 64 x 128 float32 accumulators are 64 registers a thread at 4
#: warps, leaving room for the pipelined operand tiles; MoE experts rarely get more rows
#: than that per tile at decode sizes, and a smaller tile wastes less on a partial tile.
MAX_BLOCK_M = 64
#: Output columns per program. 128 is also the weight-scale block of DeepSeek-V3 checkpoints,
#: so with block scales an N tile never straddles two scale blocks (block_n must divide it).
MAX_BLOCK_N = 128
#: The weight-scale block edge of the contract (CONTRACT.md section 3: ``128 x 128``).
SCALE_BLOCK = 128
#: Bytes of one row of a K tile: 128 bytes is one L2 line / a full 128-byte TMA-like
#: coalesced read per row (64 bf16, 128 fp8, 32 float32 values).
K_TILE_BYTES = 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedGemmConfig:
    """Block sizes and launch parameters of the Pallas-Triton grouped GEMM.

    block_m: rows of ``x`` per program (power of two; >= 16 to run on the GPU, smaller
      blocks are for interpret-mode tests of tile edges).
    block_n: output columns per program (power of two, >= 16 on the GPU); must divide 128 with
      128x128 block weight scales.
    block_k: the K step of the inner loop (power of two, >= 16 on the GPU); must divide 128 with block
      weight scales and the group size ``G`` with per-token-group activation scales (each
      K step then lies inside one scale group).
    num_warps, num_stages: Triton launch parameters (``num_stages`` software-pipelines the K loop).
    group_m: launch order. 1: the 2-D grid, row-tile steps fastest (all of ``x`` read again for every
      column tile); ``G > 1``: a 1-D grid in which ``G`` consecutive row-tile steps sweep all column
      tiles together (their ``x`` tiles stay in L2), as moe_torch's ``group_m`` (triton-lang/triton
      ``python/tutorials/03-matrix-multiplication.py``, ``GROUP_SIZE_M``). Never changes the result.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 1

    def __post_init__(self) -> None:
        check_triton_blocks(self)
        if not isinstance(self.group_m, int) or isinstance(self.group_m, bool) or self.group_m < 1:
            raise ValueError(f"GroupedGemmConfig: group_m must be an int >= 1; got group_m={self.group_m!r}")


def check_triton_blocks(cfg) -> None:
    """``ValueError`` unless every field of a Pallas-Triton config (``block_m``, ``block_n``, ``block_k``,
    ``num_warps``, ``num_stages``) is an int >= 1 and all but ``num_stages`` are powers of two."""
    cls = type(cfg).__name__
    for name in ("block_m", "block_n", "block_k", "num_warps", "num_stages"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{cls}: {name} must be an int >= 1; got {name}={v!r}")
    for name in ("block_m", "block_n", "block_k", "num_warps"):
        v = getattr(cfg, name)
        if v & (v - 1):
            raise ValueError(f"{cls}: {name} must be a power of two (a Triton block is); got {name}={v}")


def largest_pow2_divisor(n: int) -> int:
    """The largest power of two that divides ``n`` (``n >= 1``)."""
    return n & -n


def heuristic_grouped_gemm_config(M_cap: int, N: int, K: int, E: int, itemsize: int,
                                  group_size: int | None = None, w_format: str | None = None) -> GroupedGemmConfig:
    """The heuristic: a config for ``x [M_cap, K]`` (``itemsize`` bytes a value) x ``w [E, N, K]``.

    ``block_m``: the average rows per expert, ``M_cap / E``, rounded up to a power of two and
    clamped to ``[16, MAX_BLOCK_M]`` (at decode sizes most experts get a handful of rows).
    ``block_k``: ``K_TILE_BYTES / itemsize`` (128 for FP8: one weight-scale block), at most
    ``group_size``'s largest power-of-two divisor for per-token-group scales.
    INT4 weights with 16-bit ``x``: ``block_k`` 128 (:data:`W4_BLOCK_K`); MXFP4 keeps 64: on gpt-oss-120b's decode
    layer the 128-wide K step was faster for INT4 at every T and for MXFP4 only at T=1 (BENCHMARKS.md).
    ``num_stages=3``: three K steps in flight; at the largest tiles (fp8, 64x128 + 128x128 bytes,
    or bf16 64x64 + 128x64 x 2 bytes) that is under 80 KiB of the H200's 228 KiB shared memory.
    """
    rows_per_expert = -(-max(M_cap, 1) // max(E, 1))
    block_m = max(MIN_DOT_BLOCK, min(MAX_BLOCK_M, pl.next_power_of_2(rows_per_expert)))
    block_n = max(MIN_DOT_BLOCK, min(MAX_BLOCK_N, pl.next_power_of_2(max(N, 1))))
    block_k = max(MIN_DOT_BLOCK, min(K_TILE_BYTES // itemsize, pl.next_power_of_2(max(K, 1))))
    if group_size is not None:
        block_k = max(MIN_DOT_BLOCK, min(block_k, largest_pow2_divisor(group_size)))
    if w_format == "int4" and itemsize == 2:
        block_k = max(W4_GROUP, min(W4_BLOCK_K, pl.next_power_of_2(max(K, 1))))
    return GroupedGemmConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=4, num_stages=3)


# --- Pallas-Triton backward kernels: ``pallas_triton_backward.py`` ---------------------------
# No tuned entries yet (no GPU measurements): the kernels take these heuristics unless given a config.


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedGemmDgradConfig:
    """Block sizes of the Pallas-Triton dgrad ``d_x [M_cap, K] = d_y [M_cap, N] @ w[e] [N, K]``.

    A program owns a ``block_m x block_k`` tile of ``d_x`` for the rows of one expert and loops over
    ``N`` (the contraction) in ``block_n`` steps. Names follow the weight's dims: ``block_n`` tiles
    ``N``, ``block_k`` tiles ``K``, as in :class:`GroupedGemmConfig` (whose roles are swapped).

    block_m: rows per program (power of two; >= 16 on the GPU, smaller only for interpret-mode tests).
    block_n: the N step of the inner loop (power of two, >= 16 on the GPU); must divide 128 with
      128x128 block weight scales (one scale per weight tile).
    block_k: output columns of ``d_x`` per program (power of two, >= 16 on the GPU); must divide 128
      with block weight scales.
    num_warps, num_stages: Triton launch parameters (``num_stages`` pipelines the N loop).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        check_triton_blocks(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedGemmWgradConfig:
    """Block sizes of the Pallas-Triton wgrad ``d_w[e] [N, K] = d_y[rows(e)].T @ x[rows(e)]``.

    A program owns a ``block_n x block_k`` tile of one expert's ``d_w[e]`` and loops over that
    expert's rows (the contraction) in ``block_m`` steps.

    block_m: rows per step of the inner loop (power of two, >= 16 on the GPU).
    block_n: rows of the ``d_w`` tile (along ``N``; power of two, >= 16 on the GPU).
    block_k: columns of the ``d_w`` tile (along ``K``; power of two, >= 16 on the GPU).
    num_warps, num_stages: Triton launch parameters (``num_stages`` pipelines the row loop).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        check_triton_blocks(self)


def _pow2_block(n: int, cap: int) -> int:
    """``next_power_of_2(n)`` clamped to ``[MIN_DOT_BLOCK, cap]``."""
    return max(MIN_DOT_BLOCK, min(cap, pl.next_power_of_2(max(n, 1))))


#: Wide tiles of the Pallas-Triton dgrad (see :func:`heuristic_grouped_gemm_dgrad_config`): 128 rows x 256
#: columns of d_x per program over 8 warps (two wgmma warpgroups), N stepped by 64, 3 stages.
DGRAD_WIDE_CONFIG = GroupedGemmDgradConfig(block_m=128, block_n=64, block_k=256, num_warps=8, num_stages=3)
#: Wide tiles of the Pallas-Triton wgrad (see :func:`heuristic_grouped_gemm_wgrad_config`): a 128 x 256 tile
#: of d_w[e] per program over 8 warps, 64 rows a step, 3 stages.
WGRAD_WIDE_CONFIG = GroupedGemmWgradConfig(block_m=64, block_n=128, block_k=256, num_warps=8, num_stages=3)
#: Rows from which the wide backward tiles pay (measured at 16384, as the Triton kernels' in moe_torch).
WIDE_MIN_ROWS = 8192


def heuristic_grouped_gemm_dgrad_config(M_cap: int, N: int, K: int, E: int, itemsize: int, w_block: bool = False
                                        ) -> GroupedGemmDgradConfig:
    """Untuned first choice for the dgrad of ``d_y [M_cap, N]`` (``itemsize`` bytes a value: the dot
    operands', i.e. ``d_y``'s, also for FP8 weights, which are dequantized to it) and ``w [E, N, K]``.

    The forward's tile with N and K swapped: ``block_m`` the average rows per expert (power of two in
    ``[16, MAX_BLOCK_M]``); ``block_k`` (output columns) up to ``MAX_BLOCK_N`` = 128, also the scale
    block; ``block_n`` (the contraction step) one 128-byte row of ``d_y`` (``K_TILE_BYTES / itemsize``).
    Powers of two <= 128 always divide 128, so block weight scales fit. 4 warps: a 64 x 128 float32
    accumulator is 64 registers a thread; 3 stages: ``3 x (64 x 64 + 64 x 128) x 2`` bytes = 72 KiB of
    shared memory at the largest bf16 tile (float32: half the N step, the same bytes).

    16-bit ``d_y`` at ``M_cap >= WIDE_MIN_ROWS`` without 128x128 weight blocks (``w_block``: a 256-wide
    tile would straddle two scale blocks) and ``K >= 256``: :data:`DGRAD_WIDE_CONFIG`, much faster on both of the
    layer's shapes with bit-identical results (``benchmarks/profile_bwd_jax.py --pt-dgrad``; BENCHMARKS.md)."""
    if itemsize == 2 and M_cap >= WIDE_MIN_ROWS and not w_block and K >= 256:
        return DGRAD_WIDE_CONFIG
    block_m = _pow2_block(-(-max(M_cap, 1) // max(E, 1)), MAX_BLOCK_M)
    block_k = _pow2_block(K, MAX_BLOCK_N)
    block_n = _pow2_block(N, K_TILE_BYTES // itemsize)
    return GroupedGemmDgradConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=4, num_stages=3)


#: Rows of the wgrad's ``d_w`` tile (along N), at most: 64 x 128 float32 accumulators are 64
#: registers a thread at 4 warps (the forward's budget).
MAX_WGRAD_BLOCK_N = 64
#: Columns of the wgrad's ``d_w`` tile (along K), at most: 128 values of a K-major row of ``x``.
MAX_WGRAD_BLOCK_K = 128


def heuristic_grouped_gemm_wgrad_config(M_cap: int, N: int, K: int, E: int, itemsize: int) -> GroupedGemmWgradConfig:
    """Untuned first choice for the wgrad of ``x [M_cap, K]``, ``d_y [M_cap, N]`` (``itemsize`` bytes a
    value) into ``d_w [E, N, K]``.

    ``block_n x block_k`` = up to ``64 x 128`` (the accumulator stays in registers, see
    :data:`MAX_WGRAD_BLOCK_N`); ``block_m`` (the row step, the contraction) 128 bytes of
    contraction per operand column (``K_TILE_BYTES / itemsize``: 64 bf16, 32 float32), at most the
    average rows per expert rounded up to a power of two (a decode-size expert with 3 rows reads one
    16-row step, not 64). 3 stages: ``3 x (64 x 64 + 64 x 128) x 2`` bytes = 72 KiB of shared memory
    at the largest bf16 tile.

    16-bit inputs at ``M_cap >= WIDE_MIN_ROWS`` with ``N >= 128``, ``K >= 256`` and at least 64 rows per
    expert on average: :data:`WGRAD_WIDE_CONFIG`, faster on the down shape (``profile_bwd_jax.py --pt-wgrad``; the
    torch Triton kernel's probe chose the same tile for gate_up; BENCHMARKS.md)."""
    if itemsize == 2 and M_cap >= WIDE_MIN_ROWS and N >= 128 and K >= 256 and M_cap >= 64 * max(E, 1):
        return WGRAD_WIDE_CONFIG
    block_n = _pow2_block(N, MAX_WGRAD_BLOCK_N)
    block_k = _pow2_block(K, MAX_WGRAD_BLOCK_K)
    block_m = _pow2_block(-(-max(M_cap, 1) // max(E, 1)), K_TILE_BYTES // itemsize)
    return GroupedGemmWgradConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=4, num_stages=3)


def triton_backward_config_problem(op: str, cfg, w_block: bool = False, *, interpret: bool = False) -> str | None:
    """Why ``cfg`` (a :class:`GroupedGemmDgradConfig` or :class:`GroupedGemmWgradConfig`) cannot serve a
    request of ``op`` (``None``: it can): every dot block >= 16 on the GPU; with 128x128 weight-scale
    blocks (dgrad of FP8 weights), ``block_n`` and ``block_k`` divide 128."""
    small = {n: getattr(cfg, n) for n in ("block_m", "block_n", "block_k") if getattr(cfg, n) < MIN_DOT_BLOCK}
    if small and not interpret:
        return (f"{op}: on the GPU every dot block must be >= {MIN_DOT_BLOCK} (tensor-core tiles); "
                f"got {', '.join(f'{n}={v}' for n, v in small.items())} (smaller blocks are for interpret mode)")
    if w_block and (SCALE_BLOCK % cfg.block_n or SCALE_BLOCK % cfg.block_k):
        return (f"{op}: 128x128 block weight scales need block_n and block_k to divide {SCALE_BLOCK} "
                f"(one scale per weight tile); got block_n={cfg.block_n}, block_k={cfg.block_k}")
    return None


# --- Bias gradient ``d_bias[e] = sum of d_y[rows(e)]`` (``pallas_triton_backward.py``) ----------------

#: Columns of ``d_bias`` per program, at most: a 32 x 256 float32 partial-sum tile is 64 registers a
#: thread over 4 warps (the same budget as the forward's accumulator).
MAX_DBIAS_BLOCK_N = 256
#: Rows of ``d_y`` per step, at most; fewer for small experts (decode).
MAX_DBIAS_BLOCK_M = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedGemmDbiasConfig:
    """Block sizes of the Pallas-Triton bias gradient (a segment sum over each expert's rows).

    A program owns ``block_n`` columns of ``d_bias[e]`` and walks expert ``e``'s rows ``block_m`` at a time
    into a float32 ``[block_m, block_n]`` partial-sum tile, reduced over its rows once at the end.

    block_m, block_n: powers of two (Triton blocks; no dot, so no tensor-core minimum).
    num_warps: a power of two.
    num_stages: ``d_y`` loads of the row loop in flight (software pipelining), as the wgrad's.
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or (name != "num_stages" and v & (v - 1)):
                raise ValueError(f"GroupedGemmDbiasConfig: {name} must be an int >= 1"
                                 + ("" if name == "num_stages" else ", a power of two (a Triton block)")
                                 + f"; got {name}={v!r}")


def heuristic_grouped_gemm_dbias_config(M_cap: int, N: int, E: int) -> GroupedGemmDbiasConfig:
    """``d_y [M_cap, N]`` -> ``d_bias [E, N]``: ``block_n`` up to :data:`MAX_DBIAS_BLOCK_N` (at least 16),
    ``block_m`` the average rows per expert rounded up to a power of two, at most :data:`MAX_DBIAS_BLOCK_M`.
    Memory-bound (every ``d_y`` element is read once); untuned (no GPU measurement yet)."""
    block_m = min(MAX_DBIAS_BLOCK_M, pl.next_power_of_2(-(-max(M_cap, 1) // max(E, 1))))
    block_n = max(MIN_DOT_BLOCK, min(MAX_DBIAS_BLOCK_N, pl.next_power_of_2(max(N, 1))))
    return GroupedGemmDbiasConfig(block_m=block_m, block_n=block_n, num_warps=4)


# --- Pallas Mosaic GPU (Hopper) backend: ``pallas_mosaic_gpu.py`` ---------------------------

#: wgmma's M per warpgroup instruction: a row tile is 64 or 128 rows (one or two instructions).
MOSAIC_BLOCK_M = (64, 128)
#: One K step is one 128-byte swizzled shared-memory row (the widest TMA/wgmma swizzle): 64 bf16
#: or 128 FP8 values; 128 is also the K width of the contract's FP8 scale groups and blocks.
MOSAIC_K_STEP_BYTES = 128

#: Mosaic GPU swizzles a TMA tile in shared memory by the byte width of the tile's innermost (contiguous) dimension
#: and takes only 32, 64 or 128 bytes: a 16-byte row fails when the kernel is traced ("Swizzle 16 is not supported"),
#: a 48-byte one finds no tiling. So every such tile row spans a multiple of 32 bytes.
MOSAIC_MIN_ROW_BYTES = 32
#: Tiles that two consumer warpgroups slice (the warp-specialized dgrad's) or that are masked row by row in shared
#: memory (the wgrad's) lower only on whole 128-byte swizzle rows: with 32 or 64 bytes Mosaic GPU finds no tiling of
#: the consumer's slice or no register layout for the mask (lowering for CUDA on the CPU shows it).
MOSAIC_SWIZZLE_ROW_BYTES = 128


def mosaic_row_bytes_problem(op: str, itemsize: int, row_bytes: int, what: str, **blocks: int) -> str | None:
    """Why the tiles whose rows are ``blocks`` (name -> values along a tile's innermost dimension, ``itemsize`` bytes
    each; ``what`` says which tiles) cannot be swizzled: each row must span a multiple of ``row_bytes``
    (:data:`MOSAIC_MIN_ROW_BYTES` or :data:`MOSAIC_SWIZZLE_ROW_BYTES`); ``None`` when they do."""
    bad = {name: v for name, v in blocks.items() if (v * itemsize) % row_bytes}
    if not bad:
        return None
    got = ", ".join(f"{name}={v} ({v * itemsize} bytes)" for name, v in bad.items())
    return (f"{op}: {' and '.join(blocks)} ({what}) must each span a multiple of {row_bytes} bytes, i.e. be a "
            f"multiple of {max(1, row_bytes // itemsize)} values of {itemsize} bytes (Mosaic GPU swizzles a TMA tile "
            f"in shared memory by its row's bytes, 32, 64 or 128); got {got}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicGroupedGemmConfig:
    """Launch parameters of the Mosaic GPU grouped GEMM (one warpgroup per CTA, persistent grid).

    block_m: rows per tile, 64 or 128 (multiples of wgmma's M = 64).
    block_n: output columns per tile, a multiple of 8 up to 256 (wgmma's N); must divide N.
    block_k: K per pipeline step (must divide K): 64 for 16-bit, 128 for FP8 (128-byte rows); 256 for FP8 with
      per-step accumulation in the warp-specialized schedule (two K blocks a step).
    max_concurrent_steps: TMA loads in flight (shared-memory stages).
    grid_block_n: width, in column tiles, of the planar snake over (row steps, column tiles).
    fast_accum: FP8 only. ``False`` (default): every K step (128 K values, 4 wgmma instructions)
      accumulates into a fresh tensor-core accumulator that is then added to a float32 register
      accumulator ("promotion", DeepSeek-V3 section 3.3.2: Hopper's FP8 MMA keeps only about 14
      bits of the running sum, so one long accumulation drifts). ``True``: one accumulator over the
      whole K loop (faster; on the H200 its relative error was 1.9e-3 at K=2048..7168 against
      about 4e-5 for the promoted Pallas-Triton kernel, and 2e-2 over the FP8 layer; BENCHMARKS.md).
      Like ``use_fast_accum`` of ``torch._scaled_mm``.
    warp_specialized: ``pallas_mosaic_gpu_ws.py`` (the forward with every input of this kernel, and the 16-bit
      dgrad): a producer warpgroup loads, two consumer warpgroups each compute ``block_m x block_n`` of a
      ``block_m x 2*block_n`` CTA tile (so ``N`` must be a multiple of ``2 * block_n``; of ``block_n`` with
      ``split_m``), over ``max_concurrent_steps >= 2`` shared-memory stages; with FP8's per-step
      promotion, one consumer scales and adds its finished K step while the other's ``wgmma`` runs.
    split_m: warp-specialized only: the two consumers split the CTA tile's rows instead of its columns (a
      ``2*block_m x block_n`` CTA tile, ``N % block_n == 0``): per K step the CTA loads ``(2*block_m + block_n) *
      block_k`` values for ``2 * block_m * block_n`` outputs, 20% fewer than ``(block_m + 2*block_n) * block_k`` at
      ``64 x 128`` (the producer's loads are what the FP8 kernel waits on: BENCHMARKS.md).
    """

    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int = 4
    grid_block_n: int = 1
    fast_accum: bool = False
    warp_specialized: bool = False
    split_m: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MosaicGroupedGemmConfig: {name} must be an int >= 1; got {name}={v!r}")
        for name in ("fast_accum", "warp_specialized", "split_m"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MosaicGroupedGemmConfig: {name} must be a bool; got {name}={getattr(self, name)!r}")
        if self.block_m not in MOSAIC_BLOCK_M:
            raise ValueError(f"MosaicGroupedGemmConfig: block_m must be one of {MOSAIC_BLOCK_M}; got {self.block_m}")
        if self.block_n % 8 or self.block_n > 256:
            raise ValueError(f"MosaicGroupedGemmConfig: block_n must be a multiple of 8 up to 256; got {self.block_n}")
        if self.split_m and not self.warp_specialized:
            raise ValueError(f"MosaicGroupedGemmConfig: split_m splits the warp-specialized CTA tile; it needs "
                             f"warp_specialized=True; got {self}")


#: Shared memory one CTA may use where no device spec is known (the CPU, interpret mode, a config built without a
#: device): sm_90's opt-in maximum (227 KiB), the architecture the Mosaic GPU kernels target. On a GPU the spec's
#: ``smem_per_block`` (read from the device) is the limit Mosaic enforces ("kernel exceeds available shared memory").
MOSAIC_MAX_SMEM_BYTES = 232448
#: Room left for the pipeline's barriers and Mosaic's own scratch beside the estimate below.
_SMEM_SLACK_BYTES = 1024


def ws_smem_budget(device: DeviceSpec | None = None) -> int:
    """The shared memory a warp-specialized Mosaic kernel's stages and output buffers may take on ``device``: its
    spec's ``smem_per_block`` (:data:`MOSAIC_MAX_SMEM_BYTES` without a spec, or one that reports none) less
    ``_SMEM_SLACK_BYTES`` for the barriers and Mosaic's scratch."""
    smem = device.smem_per_block if device is not None and device.smem_per_block > 0 else MOSAIC_MAX_SMEM_BYTES
    return smem - _SMEM_SLACK_BYTES


#: Rows per expert (``ceil(M_cap / E)``) from which a tuned ``split_m`` entry is taken as it is: a ``split_m`` entry
#: tuned at E=32, M=16384 made DeepSeek-V3's E=256 FP8-block layer (~143 rows an expert) slower (BENCHMARKS.md).
SPLIT_M_MIN_ROWS = 256


def ws_cta_tile(cfg: MosaicGroupedGemmConfig) -> tuple[int, int]:
    """``(rows, columns)`` of the warp-specialized kernel's CTA tile: two consumer tiles of ``block_m x block_n``
    side by side (``block_m x 2*block_n``), or one above the other with ``split_m`` (``2*block_m x block_n``)."""
    return (2 * cfg.block_m, cfg.block_n) if cfg.split_m else (cfg.block_m, 2 * cfg.block_n)


def ws_smem_bytes(cfg: MosaicGroupedGemmConfig, itemsize: int, out_itemsize: int) -> int:
    """Shared memory of the warp-specialized kernel (``pallas_mosaic_gpu_ws.py``): ``max_concurrent_steps`` stages of
    the CTA's ``x`` tile ``[cta_m, block_k]`` and weight tile ``[cta_n, block_k]`` (:func:`ws_cta_tile`), plus one
    ``[block_m, block_n]`` output buffer per consumer warpgroup (2) in the output dtype (Mosaic asked 278576 bytes = this + 48
    for 128 x 128 x 64 over 3 stages with float32 outputs)."""
    cta_m, cta_n = ws_cta_tile(cfg)
    stages = cfg.max_concurrent_steps * (cta_m + cta_n) * cfg.block_k * itemsize
    return stages + 2 * cfg.block_m * cfg.block_n * out_itemsize


def heuristic_mosaic_grouped_gemm_config(M_cap: int, N: int, K: int, E: int, itemsize: int, *,
                                         per_step_scales: bool = False, fast_accum: bool = False,
                                         out_itemsize: int = 2, device: DeviceSpec | None = None
                                         ) -> MosaicGroupedGemmConfig:
    """Heuristic from a sweep on the H200 (BENCHMARKS.md; E=32, K/N of the benchmark).

    One accumulator (16-bit inputs, or FP8 with ``fast_accum``): experts averaging < 256 rows get
    ``64 x 256`` tiles (less MMA work wasted on partial tiles, half the weight re-reads per row
    tile), more rows ``128 x 128``; 5 TMA stages and a planar snake 4 column tiles wide won
    everywhere. Per-K-step accumulation (FP8 by default, and per-token-group / block scales) holds
    two ``[block_m, block_n]`` float32 accumulators in one warpgroup's registers, so the tile is
    ``64 x 128`` (64 + 64 registers a thread) and ``block_k = 128`` (one scale group per step).
    With >= 256 rows per expert, FP8 with per-step accumulation runs the warp-specialized schedule (below) and
    16-bit inputs on 128 x 128 tiles too. ``out_itemsize``: the output's bytes a value (the warp-specialized
    schedule keeps two output tiles in shared memory: with float32 outputs it runs 2 stages, not 3). ``device``: its
    shared memory per block bounds the warp-specialized stages (:func:`ws_smem_budget`; ``None``: sm_90's)."""
    budget = ws_smem_budget(device)
    fp8 = itemsize == 1
    per_step = per_step_scales or (fp8 and not fast_accum)
    block_k = 128 if per_step else MOSAIC_K_STEP_BYTES // itemsize
    rows_per_expert = -(-max(M_cap, 1) // max(E, 1))
    if per_step:
        block_m, block_n = 64, 128
    else:
        block_m, block_n = (64, 256) if rows_per_expert < 256 else (128, 128)
    while block_n > 64 and N % block_n:  # whole column tiles (else the kernel refuses the request)
        block_n //= 2
    grid_n = max(N // block_n, 1)
    grid_block_n = 4 if grid_n % 4 == 0 else 1
    if fp8 and per_step and rows_per_expert >= 256 and N % 128 == 0 and K % 128 == 0:
        # FP8 with per-step promotion, >= 256 rows per expert: the warp-specialized schedule (two consumer
        # warpgroups of 64 x 128, so one promotes while the other's wgmma runs), the consumers splitting the rows of
        # a 128 x 128 CTA tile (split_m: 20% fewer loads a K step than 64 x 256), two K blocks a step where K allows
        # (the first's promotion overlaps the second's wgmma): faster than the 64 x 256 CTA for FP8 blocks and per
        # token on both shapes (profile_bwd_jax.py; BENCHMARKS.md).
        two = K % 256 == 0
        cfg = MosaicGroupedGemmConfig(block_m=64, block_n=128, block_k=256 if two else 128,
                                      max_concurrent_steps=2 if two else 4,
                                      grid_block_n=4 if (N // 128) % 4 == 0 else 1, warp_specialized=True,
                                      split_m=True)
        if ws_smem_bytes(cfg, itemsize, out_itemsize) <= budget:
            return cfg
    if itemsize == 2 and not per_step and (block_m, block_n) == (128, 128) and N % 256 == 0 and K % block_k == 0:
        # 16-bit, >= 256 rows per expert: the warp-specialized schedule (a producer and two consumer warpgroups,
        # 128 x 256 per CTA; 3 stages fit beside its two output buffers): faster than one warpgroup in same-run probes
        # (benchmarks/profile_bwd_jax.py --mosaic-fwd / --mosaic-dgrad; BENCHMARKS.md).
        cfg = MosaicGroupedGemmConfig(block_m=128, block_n=128, block_k=block_k, max_concurrent_steps=3,
                                      grid_block_n=grid_block_n, warp_specialized=True)
        while cfg.max_concurrent_steps > 2 and ws_smem_bytes(cfg, itemsize, out_itemsize) > budget:
            cfg = dataclasses.replace(cfg, max_concurrent_steps=cfg.max_concurrent_steps - 1)
        if ws_smem_bytes(cfg, itemsize, out_itemsize) <= budget:
            return cfg
    return MosaicGroupedGemmConfig(block_m=block_m, block_n=block_n, block_k=block_k, max_concurrent_steps=5,
                                   grid_block_n=grid_block_n, fast_accum=fast_accum and fp8)


# --- Tuned configs --------------------------------------------------------------------------

#: The shipped tuned tables: ``tuned/<arch>.json`` (every GPU of the architecture, e.g. ``sm90.json``) and
#: ``tuned/<arch>/<device kind>.json`` (refinements of one device kind); ``moe_contract/selection.py`` says the order.
TUNED_DIR = os.path.join(os.path.dirname(__file__), "tuned")
#: The ``"backend"`` key of the tuned entries of each kernel.
TRITON_BACKEND = "pallas_triton"
MOSAIC_BACKEND = "pallas_mosaic_gpu"


def gpu_device_spec() -> DeviceSpec | None:
    """The :class:`~moe_contract.selection.DeviceSpec` of JAX's GPU (``moe_pallas/ops/device.py``), ``None`` off a GPU.
    Host-side only (no device state is traced); the kernels call it at trace time."""
    return device_spec()


# --- Backend choices (``backend_table.py`` reads them; their schema lives here so the tables are checked on read)

#: The ``"kind"`` of a backend-choice entry in the tuned file.
BACKEND_CHOICE = "backend_choice"
#: The ops a backend choice can be stored for (the public functions of ``api.py``).
OPS = ("grouped_gemm", "grouped_gemm_dgrad", "grouped_gemm_wgrad")
#: The backends a table can choose (the reference is never a measured choice: it is always last).
KERNEL_BACKENDS = ("pallas_mosaic_gpu", "pallas_triton")
#: Keys every backend choice has, and the optional ones.
REQUIRED_KEYS = ("kind", "op", "layout", "E", "N", "K", "M_cap", "backend", "ms", "source", "date", "command")
OPTIONAL_KEYS = ("arch", "device", "routings", "git", "measured", "note")

def backend_choice_problem(t: dict) -> str | None:
    """Why ``t`` is not a valid backend choice (``None``: it is); the schema is ``backend_table.py``'s module
    docstring."""
    missing = [k for k in REQUIRED_KEYS if k not in t]
    if missing:
        return f"missing keys {missing}"
    unknown = sorted(set(t) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        return f"unknown keys {unknown} (allowed: {REQUIRED_KEYS + OPTIONAL_KEYS})"
    if t["op"] not in OPS:
        return f"op must be one of {OPS}; got op={t['op']!r}"
    if not isinstance(t["layout"], str) or not t["layout"]:
        return f"layout must be a non-empty string; got layout={t['layout']!r}"
    for k in ("E", "N", "K", "M_cap"):
        if not isinstance(t[k], int) or isinstance(t[k], bool) or t[k] < 1:
            return f"{k} must be an int >= 1; got {k}={t[k]!r}"
    if t["backend"] not in KERNEL_BACKENDS:
        return f"backend must be one of {KERNEL_BACKENDS}; got backend={t['backend']!r}"
    ms = t["ms"]
    if (not isinstance(ms, dict) or len(ms) < 2 or not set(ms) <= set(KERNEL_BACKENDS)
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                       for v in ms.values())):
        return (f"ms must map at least two of {KERNEL_BACKENDS} to their measured median ms (> 0); "
                f"got ms={ms!r}")
    if t["backend"] not in ms or ms[t["backend"]] > min(ms.values()):
        return f"backend must be the fastest in ms; got backend={t['backend']!r}, ms={ms!r}"
    for k in ("source", "date", "command"):
        if not isinstance(t[k], str) or not t[k]:
            return f"{k} (provenance) must be a non-empty string; got {k}={t[k]!r}"
    return None


def entry_problem(t: dict) -> str | None:
    """Why ``t`` is not a valid JAX tuned entry (``None``: it is): a backend choice (``"kind"``) by
    :func:`backend_choice_problem`; a launch config: ``"backend"`` one of the two kernels, ``"op"`` one of :data:`TUNED_OPS`, a string
    ``"dtype"``, a ``"config"`` object that builds the backend's config dataclass."""
    if "kind" in t:
        if t["kind"] != BACKEND_CHOICE:
            return f"has kind={t['kind']!r}; the known kind is {BACKEND_CHOICE!r} (launch configs have no 'kind')"
        return backend_choice_problem(t)
    backend, op = t.get("backend"), t.get("op", "fwd")
    if backend not in (TRITON_BACKEND, MOSAIC_BACKEND):
        return f"backend must be one of {(TRITON_BACKEND, MOSAIC_BACKEND)}; got backend={backend!r}"
    if op not in TUNED_OPS:
        return f"op must be one of {TUNED_OPS}; got op={op!r}"
    if not isinstance(t.get("dtype"), str):
        return f"dtype must be a string; got dtype={t.get('dtype')!r}"
    fields = t.get("config")
    cls = GroupedGemmConfig if backend == TRITON_BACKEND else MosaicGroupedGemmConfig
    if not isinstance(fields, dict):
        return f"config must be an object; got config={fields!r}"
    try:
        cls(**fields)
    except (TypeError, ValueError) as exc:
        return f"config is not a {cls.__name__} ({exc})"
    return None


@functools.cache
def tuned_tables(device: DeviceSpec | None) -> TunedTables:
    """The tuned tables of ``device`` (the per-user cache, then the shipped files; architecture first, refined by
    device kind: ``moe_contract/selection.py``), read once, every launch config validated (:func:`entry_problem`;
    backend choices: ``backend_table.py``). One JSON list per file holds launch configs (no ``"kind"`` key;
    :func:`nearest_tuned`) and backend choices (``"kind": "backend_choice"``). No tables for ``None`` (the CPU).
    Raises ValueError naming the file and the entry for a malformed entry."""
    return TunedTables.load(device, TUNED_DIR, "jax", entry_problem)


def _dtype_key(itemsize: int) -> str | None:
    """The ``"dtype"`` key of the tuned entries for inputs of ``itemsize`` bytes (16-bit floats share bf16's)."""
    return {1: "fp8", 2: "bf16"}.get(itemsize)


#: The ``"op"`` of a launch-config entry: the forward (entries without ``"op"`` are forward ones), the dgrad
#: ``d_x = d_y @ w[e]`` and the K-grouped wgrad ``d_w[e] = d_y[rows(e)].T @ x[rows(e)]`` (``tune_jax_gemm.py --ops``).
TUNED_OPS = ("fwd", "dgrad", "wgrad")


def out_dtype_key(out_itemsize: int) -> str | None:
    """The ``"out_dtype"`` key of the backward entries for outputs of ``out_itemsize`` bytes (16-bit floats share
    bf16's, as the inputs' ``"dtype"``)."""
    return {2: "bf16", 4: "f32"}.get(out_itemsize)


def nearest_tuned(device: DeviceSpec | None, backend: str, M_cap: int, N: int, K: int, itemsize: int,
                  fast_accum: bool | None = None, dtypes: tuple[str, ...] | None = None, *, op: str = "fwd",
                  out_dtype: str | None = None, max_ratio: float | None = None) -> dict | None:
    """The ``"config"`` dict of the tuned launch config of ``backend`` and ``op`` (:data:`TUNED_OPS`; an entry
    without ``"op"`` is a forward one) for the same ``N``, ``K`` (the forward's names, ``w [E, N, K]``, for every
    op), dtype (and, when not ``None``, ``fast_accum`` and the ``"out_dtype"``, :func:`out_dtype_key`) with the
    nearest ``M_cap`` in log2 (ties: the earlier key of ``dtypes``, then the first stored); ``None`` if
    ``device`` is ``None`` or nothing matches. Entries with a ``"kind"`` (backend choices) are not launch
    configs and are skipped. ``dtypes``: the entries' keys (default from ``itemsize``: ``("bf16",)`` /
    ``("fp8",)``; ``"fp8_block"``: FP8 tuned with 128 x 128 weight blocks). ``max_ratio``: entries whose ``M_cap``
    is more than this factor away from ``M_cap`` are not taken (the backward's lookups: :data:`BACKWARD_TUNED_MAX_RATIO`)."""
    dtypes = dtypes or (_dtype_key(itemsize),)
    if device is None or None in dtypes:
        return None
    entry = tuned_tables(device).nearest(
        lambda t: ("kind" not in t  # a launch config (backend choices carry "kind": backend_table.py)
                   and t.get("op", "fwd") == op
                   and (t.get("backend"), t["N"], t["K"]) == (backend, N, K) and t["dtype"] in dtypes
                   and (fast_accum is None or bool(t.get("fast_accum")) == fast_accum)
                   and (out_dtype is None or t.get("out_dtype") == out_dtype)),
        M_cap, max_ratio=max_ratio, rank=lambda t: dtypes.index(t["dtype"]))
    return None if entry is None else entry["config"]


def triton_config_problem(cfg: GroupedGemmConfig, group_size: int | None, w_block: bool, *,
                          interpret: bool = False, w_4bit: bool = False) -> str | None:
    """Why ``cfg`` cannot serve a Pallas-Triton request (``None``: it can): every dot block >= 16 on the
    GPU; ``block_k`` divides the per-token-group size ``G``; with 128x128 weight blocks, ``block_n``
    and ``block_k`` divide 128; with 4-bit weights (``w_4bit``), ``block_k`` is a multiple of 32 (each
    K step holds whole scale groups). The one home of these rules (``pallas_triton.check_supported``
    raises the message; the tuned lookup skips an entry that has one)."""
    op = "grouped_gemm[pallas_triton]"
    small = {n: getattr(cfg, n) for n in ("block_m", "block_n", "block_k") if getattr(cfg, n) < MIN_DOT_BLOCK}
    if small and not interpret:
        return (f"{op}: on the GPU every dot block must be >= {MIN_DOT_BLOCK} (tensor-core tiles); "
                f"got {', '.join(f'{n}={v}' for n, v in small.items())} (smaller blocks are for interpret mode)")
    if group_size and group_size % cfg.block_k:
        return (f"{op}: per-token-group activation scales need block_k to divide the group size "
                f"G = K // x_scale.shape[1] (each K step inside one scale group; block_k is a power of two >= 16); "
                f"got G={group_size}, block_k={cfg.block_k}")
    if w_block and (SCALE_BLOCK % cfg.block_n or SCALE_BLOCK % cfg.block_k):
        return (f"{op}: 128x128 block weight scales need block_n and block_k to divide {SCALE_BLOCK} "
                f"(one scale per tile and K step); got block_n={cfg.block_n}, block_k={cfg.block_k}")
    if w_4bit and cfg.block_k % W4_GROUP:
        return (f"{op}: 4-bit weights need block_k to be a multiple of {W4_GROUP} (each K step decodes whole "
                f"scale groups of {W4_GROUP}); got block_k={cfg.block_k}")
    return None


def triton_config_fits(cfg: GroupedGemmConfig, group_size: int | None, w_block: bool) -> bool:
    """Whether ``cfg`` keeps the rules of :func:`triton_config_problem` on the GPU."""
    return triton_config_problem(cfg, group_size, w_block) is None


def _ws_smem_problem(op: str, what: str, smem: int, out_itemsize: int, cfg: MosaicGroupedGemmConfig,
                     device: DeviceSpec | None) -> str | None:
    """The refusal of a warp-specialized kernel (``what``: "schedule", the forward / dgrad, or "wgrad") whose stages and
    output buffers (``smem`` bytes) exceed a CTA's shared memory on ``device`` (:func:`ws_smem_budget`); ``None`` when
    they fit."""
    budget = ws_smem_budget(device)
    if smem <= budget:
        return None
    where = device.describe() if device is not None else "an sm_90 GPU (no device spec)"
    return (f"{op}: the warp-specialized {what} needs about {smem} bytes of shared memory with {out_itemsize}-byte "
            f"outputs, over the {budget} a CTA can use on {where}: fewer max_concurrent_steps; got {cfg}")


def mosaic_config_problem(cfg: MosaicGroupedGemmConfig, N: int, K: int, itemsize: int, per_step_scales: bool, *,
                          op: str = "grouped_gemm[pallas_mosaic_gpu]", out_itemsize: int = 2,
                          dgrad: bool = False, device: DeviceSpec | None = None) -> str | None:
    """Why ``cfg`` cannot serve a Mosaic request (``None``: it can): swizzled tile rows (the forward's ``x`` and ``w``
    tiles span ``block_k`` values, a multiple of :data:`MOSAIC_MIN_ROW_BYTES`; the dgrad's ``d_y`` and ``w`` tiles
    ``block_k`` and ``block_n``, multiples of :data:`MOSAIC_MIN_ROW_BYTES`, warp-specialized of
    :data:`MOSAIC_SWIZZLE_ROW_BYTES`); whole TMA tiles (``N % block_n``,
    ``K % block_k``); per-step scales need ``block_n == 128`` and ``block_k == 128`` (the warp-specialized
    schedule: 128 or 256, one or two K blocks a step); per-step accumulation (those scales, or FP8 without
    ``fast_accum``) keeps the float32 tile and a partial a K block of a step in registers, at most ``64 x 128``.
    The one home of the config-dependent rules (``pallas_mosaic_gpu.check_supported`` raises the message;
    the dgrad passes its own ``op`` and ``dgrad=True``, with ``N`` its output width and ``K`` its contraction).
    ``device``: the warp-specialized stages must fit its shared memory per block (``None``: sm_90's)."""
    if dgrad:  # d_y tile [block_m, block_k]; w tile [block_k, block_n] (the CTA's 2 * block_n, sliced per consumer)
        row_bytes = MOSAIC_SWIZZLE_ROW_BYTES if cfg.warp_specialized else MOSAIC_MIN_ROW_BYTES
        problem = mosaic_row_bytes_problem(op, itemsize, row_bytes, "the d_y tile's rows along N, the w tile's along K",
                                           block_k=cfg.block_k, block_n=cfg.block_n)
    else:  # x tile [block_m, block_k], w tile [block_n, block_k]
        problem = mosaic_row_bytes_problem(op, itemsize, MOSAIC_MIN_ROW_BYTES, "the x and w tiles' rows along K",
                                           block_k=cfg.block_k)
    if problem:
        return problem
    if cfg.warp_specialized:
        if itemsize not in (1, 2):
            return f"{op}: the warp-specialized schedule takes 16-bit or FP8 inputs; got {itemsize}-byte values"
        if cfg.max_concurrent_steps < 2:
            # a consumer frees a step's slot only after issuing the next step's wgmma (one accumulator) or
            # after the step's loads of the next item ran ahead (the persistent producer): one slot deadlocks
            return (f"{op}: the warp-specialized schedule needs max_concurrent_steps >= 2 (shared-memory stages); "
                    f"got {cfg}")
        cta_n = ws_cta_tile(cfg)[1]
        if N % cta_n or K % cfg.block_k or cfg.block_m * cfg.block_n > 128 * 128:
            return (f"{op}: the warp-specialized schedule needs N % {'block_n' if cfg.split_m else '(2 * block_n)'} "
                    f"== 0, K % block_k == 0 and block_m * block_n <= 128 * 128; got N={N}, K={K}, {cfg}")
        per_step = accumulates_per_step(itemsize, per_step_scales, cfg)
        if per_step and cfg.block_k not in (SCALE_BLOCK, 2 * SCALE_BLOCK):
            return (f"{op}: per-K-step accumulation in the warp-specialized schedule takes block_k {SCALE_BLOCK} or "
                    f"{2 * SCALE_BLOCK} (one or two K blocks of {SCALE_BLOCK} a pipeline step); got {cfg}")
        if per_step_scales and cfg.block_n != SCALE_BLOCK:
            return f"{op}: per-K-step scales need block_n == {SCALE_BLOCK}; got {cfg}"
        if per_step and cfg.block_m * cfg.block_n > 64 * 128:
            return (f"{op}: per-K-step accumulation keeps the float32 tile and one per K block of a step in each "
                    f"consumer warpgroup's registers: block_m * block_n must be <= 64 * 128; got {cfg}")
        return _ws_smem_problem(op, "schedule", ws_smem_bytes(cfg, itemsize, out_itemsize), out_itemsize, cfg,
                                device)
    if N % cfg.block_n or K % cfg.block_k:
        return (f"{op}: needs N % block_n == 0 and K % block_k == 0 (whole TMA tiles); "
                f"got N={N}, K={K}, block_n={cfg.block_n}, block_k={cfg.block_k}")
    if per_step_scales and (cfg.block_k != SCALE_BLOCK or cfg.block_n != SCALE_BLOCK):
        return f"{op}: per-K-step scales need block_n == block_k == {SCALE_BLOCK}; got {cfg}"
    if accumulates_per_step(itemsize, per_step_scales, cfg) and cfg.block_m * cfg.block_n > 64 * 128:
        return (f"{op}: per-K-step accumulation keeps two float32 tiles in one warpgroup's registers: "
                f"block_m * block_n must be <= 64 * 128; got {cfg}")
    return None


def accumulates_per_step(itemsize: int, per_step_scales: bool, cfg: MosaicGroupedGemmConfig) -> bool:
    """Whether each K step of the Mosaic kernel gets its own accumulator, added in float32 registers:
    per-step scales (per-token-group, 128x128 blocks) need it; FP8 does it unless ``cfg.fast_accum``."""
    return per_step_scales or (itemsize == 1 and not cfg.fast_accum)


def mosaic_config_fits(cfg: MosaicGroupedGemmConfig, N: int, K: int, itemsize: int, per_step_scales: bool,
                       out_itemsize: int = 2, device: DeviceSpec | None = None) -> bool:
    """Whether ``cfg`` keeps the rules of :func:`mosaic_config_problem` on ``device``."""
    return mosaic_config_problem(cfg, N, K, itemsize, per_step_scales, out_itemsize=out_itemsize,
                                 device=device) is None


def grouped_gemm_config(M_cap: int, N: int, K: int, E: int, itemsize: int, group_size: int | None = None, *,
                        w_block: bool = False, device: DeviceSpec | None = None,
                        w_format: str | None = None) -> GroupedGemmConfig:
    """The Pallas-Triton config: the tuned one of ``device`` (:func:`nearest_tuned`) if one is
    stored and fits this request (:func:`triton_config_fits`; ``w_block``: 128x128 block weight
    scales), else :func:`heuristic_grouped_gemm_config`. FP8 with 128 x 128 weight blocks looks up its own
    entries (``"fp8_block"``) and the per-token ``"fp8"`` ones (the nearest ``M_cap``; ``fp8_block`` at equal
    distance). ``device=None`` (the CPU, interpret mode): the heuristic."""
    dtypes = ("fp8_block", "fp8") if (w_block and itemsize == 1) else None
    tuned = None if w_format else nearest_tuned(device, TRITON_BACKEND, M_cap, N, K, itemsize, dtypes=dtypes)
    if tuned is not None:
        cfg = GroupedGemmConfig(**tuned)
        if triton_config_fits(cfg, group_size, w_block):
            return cfg
    return heuristic_grouped_gemm_config(M_cap, N, K, E, itemsize, group_size, w_format)


def mosaic_grouped_gemm_config(M_cap: int, N: int, K: int, E: int, itemsize: int, *, per_step_scales: bool = False,
                               fast_accum: bool = False, device: DeviceSpec | None = None,
                               out_itemsize: int = 2, w_block: bool = False) -> MosaicGroupedGemmConfig:
    """The Mosaic GPU config: the tuned one of ``device`` for the same ``fast_accum`` (FP8; 16-bit
    entries have none) if one is stored and fits this request (:func:`mosaic_config_fits`), else
    :func:`heuristic_mosaic_grouped_gemm_config`. FP8 with 128 x 128 weight blocks (``w_block``) looks up its own
    entries (``"fp8_block"``) and the per-token ``"fp8"`` ones, as :func:`grouped_gemm_config`. A ``split_m`` entry
    serves requests with fewer than :data:`SPLIT_M_MIN_ROWS` rows per expert (entries are keyed by ``M_cap``, not
    ``E``) with its tile split by columns instead, its stages cut to fit shared memory.
    ``device=None``: the heuristic. Shared memory is bounded by ``device``'s (``None``: sm_90's)."""
    fast_accum = fast_accum and itemsize == 1
    dtypes = ("fp8_block", "fp8") if (w_block and itemsize == 1) else None
    tuned = nearest_tuned(device, MOSAIC_BACKEND, M_cap, N, K, itemsize, fast_accum if itemsize == 1 else None,
                          dtypes=dtypes)
    if tuned is not None:
        cfg = _split_m_for_rows(MosaicGroupedGemmConfig(**{**tuned, "fast_accum": fast_accum}), M_cap, E, itemsize,
                                out_itemsize, device)
        if mosaic_config_fits(cfg, N, K, itemsize, per_step_scales, out_itemsize, device):
            return cfg
    return heuristic_mosaic_grouped_gemm_config(M_cap, N, K, E, itemsize, per_step_scales=per_step_scales,
                                                fast_accum=fast_accum, out_itemsize=out_itemsize, device=device)


def _split_m_for_rows(cfg: MosaicGroupedGemmConfig, M_cap: int, E: int, itemsize: int, out_itemsize: int,
                      device: DeviceSpec | None) -> MosaicGroupedGemmConfig:
    """A tuned ``cfg`` for a request with ``M_cap`` rows over ``E`` experts: a ``split_m`` entry with fewer than
    :data:`SPLIT_M_MIN_ROWS` rows per expert split by columns instead, its stages cut to fit shared memory (the
    nearest entry came from more rows per expert: entries are keyed by ``M_cap``, not ``E``; with fewer, 128-row CTA
    tiles waste MMA work on partial tiles); else ``cfg`` as it is."""
    if cfg.split_m and -(-max(M_cap, 1) // max(E, 1)) < SPLIT_M_MIN_ROWS:
        cfg = dataclasses.replace(cfg, split_m=False)
        while cfg.max_concurrent_steps > 2 and ws_smem_bytes(cfg, itemsize, out_itemsize) > ws_smem_budget(device):
            cfg = dataclasses.replace(cfg, max_concurrent_steps=cfg.max_concurrent_steps - 1)
    return cfg


def heuristic_mosaic_wgrad_config(M_cap: int, N: int, K: int, E: int, itemsize: int, out_itemsize: int = 4, *,
                                  device: DeviceSpec | None = None) -> MosaicGroupedGemmConfig:
    """The Mosaic GPU wgrad's config (``pallas_mosaic_gpu_backward.py``): ``block_m`` rows
    of ``d_w[e]`` (over N) x ``block_n`` columns (over K), ``block_k`` rows of the expert per pipeline
    step. 16-bit inputs with ``N % 128 == 0`` and ``K % 256 == 0``: the warp-specialized wgrad, two consumers'
    ``128 x 128`` tiles side by side (faster than the one-warpgroup kernel on both of the layer's shapes, which is
    latency-bound; BENCHMARKS.md). Otherwise one warpgroup:
    ``128 x 128`` tiles (its float32 accumulator), 64 rows a step, 4 TMA stages (3 for a float32 output tile,
    whose staging buffer takes 64 KiB of shared memory), halved where N or K is not a multiple. ``device``: its shared
    memory per block bounds the warp-specialized stages (``None``: sm_90's)."""
    block_m = 128 if N % 128 == 0 else 64
    block_n = 128
    # halved where K needs it, down to one 128-byte swizzle row (no narrower masked x tile lowers; a K that no such
    # block divides is refused by mosaic_wgrad_config_problem, and the dispatch takes the Pallas-Triton wgrad)
    while block_n > MOSAIC_SWIZZLE_ROW_BYTES // itemsize and K % block_n:
        block_n //= 2
    grid_n = max(K // block_n, 1)
    if itemsize == 2 and block_m == 128 and K % 256 == 0:
        # the warp-specialized wgrad: a producer warpgroup and two consumers of 128 x 128 (a 128 x 256 CTA tile),
        # 3 stages beside two 16-bit output buffers, 2 beside float32 ones
        grid_n2 = K // 256
        cfg = MosaicGroupedGemmConfig(block_m=128, block_n=128, block_k=64,
                                      max_concurrent_steps=3 if out_itemsize <= 2 else 2,
                                      grid_block_n=4 if grid_n2 % 4 == 0 else 1, warp_specialized=True)
        if mosaic_wgrad_config_problem(cfg, N, K, itemsize, out_itemsize, device=device) is None:
            return cfg
    return MosaicGroupedGemmConfig(block_m=block_m, block_n=block_n, block_k=64,
                                   max_concurrent_steps=3 if out_itemsize == 4 else 4,
                                   grid_block_n=4 if grid_n % 4 == 0 else 1)


def ws_wgrad_smem_bytes(cfg: MosaicGroupedGemmConfig, itemsize: int, out_itemsize: int) -> int:
    """Shared memory of the warp-specialized wgrad: ``max_concurrent_steps`` stages of one ``d_y`` tile
    ``[block_k, block_m]`` and two ``x`` tiles ``[block_k, block_n]``, plus one ``[block_m, block_n]`` output buffer
    per consumer warpgroup in the output dtype."""
    stages = cfg.max_concurrent_steps * cfg.block_k * (cfg.block_m + 2 * cfg.block_n) * itemsize
    return stages + 2 * cfg.block_m * cfg.block_n * out_itemsize


def mosaic_wgrad_config_problem(cfg: MosaicGroupedGemmConfig, N: int, K: int, itemsize: int = 2,
                                out_itemsize: int = 4, *, device: DeviceSpec | None = None) -> str | None:
    """Why ``cfg`` cannot serve a Mosaic wgrad ``d_w [E, N, K]`` (``None``: it can): whole output tiles
    (``N % block_m``, ``K % block_n``; warp-specialized: ``K % (2 * block_n)``, the two consumers' tiles side by
    side), ``block_k`` (rows per step) a multiple of 64 (wgmma's transposed A operand), one float32 accumulator of
    at most ``128 x 128`` in a warpgroup's registers; warp-specialized: ``max_concurrent_steps >= 2``, no
    ``split_m``, and the stages and output buffers within a CTA's shared memory on ``device`` (``None``: sm_90's).
    First the swizzle rule: the masked ``x`` tile ``[block_k, block_n]`` and ``d_y`` tile ``[block_k, block_m]`` rows
    span multiples of :data:`MOSAIC_SWIZZLE_ROW_BYTES`, so ``K`` (``x.shape[1]``, in whole tiles) must be a multiple
    of 128 bytes' values (64 16-bit ones) whatever the config."""
    op = "grouped_gemm_wgrad[pallas_mosaic_gpu]"
    if (K * itemsize) % MOSAIC_SWIZZLE_ROW_BYTES:
        return (f"{op}: K = x.shape[1] (d_w's last dim) must be a multiple of {MOSAIC_SWIZZLE_ROW_BYTES // itemsize} "
                f"values of {itemsize} bytes: d_w is written in whole tiles along K, each from an x tile [block_k, "
                f"block_n] masked row by row in shared memory, which Mosaic GPU lowers only on whole "
                f"{MOSAIC_SWIZZLE_ROW_BYTES}-byte swizzle rows (the Pallas-Triton wgrad serves any K); got K={K}")
    problem = mosaic_row_bytes_problem(op, itemsize, MOSAIC_SWIZZLE_ROW_BYTES,
                                       "the masked x tile's rows along K, the d_y tile's along N",
                                       block_n=cfg.block_n, block_m=cfg.block_m)
    if problem:
        return problem
    if cfg.warp_specialized:
        if cfg.split_m:
            return f"{op}: the warp-specialized wgrad splits the CTA tile's columns (split_m is not served); got {cfg}"
        if cfg.max_concurrent_steps < 2:
            return (f"{op}: the warp-specialized schedule needs max_concurrent_steps >= 2 (shared-memory stages); "
                    f"got {cfg}")
        if K % (2 * cfg.block_n):
            return (f"{op}: the warp-specialized wgrad needs K % (2 * block_n) == 0 (two consumer tiles side by "
                    f"side); got K={K}, {cfg}")
        problem = _ws_smem_problem(op, "wgrad", ws_wgrad_smem_bytes(cfg, itemsize, out_itemsize), out_itemsize, cfg,
                                   device)
        if problem:
            return problem
    if N % cfg.block_m or K % cfg.block_n:
        return (f"{op}: needs N % block_m == 0 and K % block_n == 0 (whole output tiles); "
                f"got N={N}, K={K}, block_m={cfg.block_m}, block_n={cfg.block_n}")
    if cfg.block_k % 64:
        return f"{op}: block_k (rows per step) must be a multiple of 64; got {cfg}"
    if cfg.block_m * cfg.block_n > 128 * 128:
        return f"{op}: block_m * block_n must be <= 128 * 128 (one warpgroup's float32 accumulator); got {cfg}"
    return None


# --- Tuned backward configs of the Mosaic GPU kernels (``pallas_mosaic_gpu_backward.py``) -------------------------


def _backward_entry(tuned: dict | None) -> MosaicGroupedGemmConfig | None:
    """The :class:`MosaicGroupedGemmConfig` of a tuned backward entry's ``"config"`` (16-bit: no ``fast_accum``);
    ``None`` for no entry or one the dataclass refuses (unknown field, a value out of its rules)."""
    if tuned is None:
        return None
    try:
        return MosaicGroupedGemmConfig(**{**tuned, "fast_accum": False})
    except (TypeError, ValueError):
        return None


#: The backward's tuned entries serve ``M_cap`` within this factor of theirs (tuned at M=16384 / 2048: a wide
#: warp-specialized tile tuned for 16384 rows is not taken for a 256-row step; the heuristics know small problems).
BACKWARD_TUNED_MAX_RATIO = 4


def mosaic_dgrad_config(M_cap: int, N: int, K: int, E: int, itemsize: int, *, out_itemsize: int = 2,
                        device: DeviceSpec | None = None) -> MosaicGroupedGemmConfig:
    """The Mosaic GPU dgrad's default config for ``d_y [M_cap, N]`` x ``w [E, N, K]`` -> ``d_x [M_cap, K]`` (the
    forward's names; the config's ``block_n`` tiles ``K``, its ``block_k`` steps over ``N``).

    Lookup order: (1) the tuned entry of ``device`` with ``"op": "dgrad"`` (written by
    ``benchmarks/tune_jax_gemm.py --ops dgrad``), backend ``pallas_mosaic_gpu``, the same ``N``, ``K``, dtype and
    ``out_dtype`` and the nearest ``M_cap`` in log2 within a factor :data:`BACKWARD_TUNED_MAX_RATIO` (:func:`nearest_tuned`; a ``split_m`` entry is split by columns
    below :data:`SPLIT_M_MIN_ROWS` rows per expert, as the forward's), if it keeps the kernel's rules
    (:func:`mosaic_config_problem` of the swapped problem); (2) else :func:`heuristic_mosaic_grouped_gemm_config` of
    the swapped problem (``N`` and ``K`` exchanged). ``device=None`` (the CPU): the heuristic. An explicit
    ``config=`` of the kernel bypasses this lookup."""
    tuned = nearest_tuned(device, MOSAIC_BACKEND, M_cap, N, K, itemsize, op="dgrad",
                          out_dtype=out_dtype_key(out_itemsize), max_ratio=BACKWARD_TUNED_MAX_RATIO)
    cfg = _backward_entry(tuned)
    if cfg is not None:
        cfg = _split_m_for_rows(cfg, M_cap, E, itemsize, out_itemsize, device)
        if mosaic_config_problem(cfg, K, N, itemsize, False, op="grouped_gemm_dgrad[pallas_mosaic_gpu]",
                                 out_itemsize=out_itemsize, dgrad=True, device=device) is None:
            return cfg
    return heuristic_mosaic_grouped_gemm_config(M_cap, K, N, E, itemsize, out_itemsize=out_itemsize, device=device)


def mosaic_wgrad_config(M_cap: int, N: int, K: int, E: int, itemsize: int, out_itemsize: int = 4, *,
                        device: DeviceSpec | None = None) -> MosaicGroupedGemmConfig:
    """The Mosaic GPU wgrad's default config for ``x [M_cap, K]``, ``d_y [M_cap, N]`` -> ``d_w [E, N, K]``.

    Lookup order: (1) the tuned entry of ``device`` with ``"op": "wgrad"`` (written by
    ``benchmarks/tune_jax_gemm.py --ops wgrad``), backend ``pallas_mosaic_gpu``, the same ``N``, ``K``, dtype and
    ``out_dtype`` and the nearest ``M_cap`` in log2 within a factor :data:`BACKWARD_TUNED_MAX_RATIO`
    (:func:`nearest_tuned`), if it keeps the kernel's rules (:func:`mosaic_wgrad_config_problem`); (2) else :func:`heuristic_mosaic_wgrad_config`. ``device=None``
    (the CPU): the heuristic. An explicit ``config=`` of the kernel bypasses this lookup."""
    tuned = nearest_tuned(device, MOSAIC_BACKEND, M_cap, N, K, itemsize, op="wgrad",
                          out_dtype=out_dtype_key(out_itemsize), max_ratio=BACKWARD_TUNED_MAX_RATIO)
    cfg = _backward_entry(tuned)
    if cfg is not None:
        if mosaic_wgrad_config_problem(cfg, N, K, itemsize, out_itemsize, device=device) is None:
            return cfg
    return heuristic_mosaic_wgrad_config(M_cap, N, K, E, itemsize, out_itemsize, device=device)
