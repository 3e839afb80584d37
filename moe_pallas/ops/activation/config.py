"""Launch configuration of the Pallas-Triton ``act_and_mul`` kernel (``pallas_triton.py``).

Mirror: ``moe_torch/ops/activation/config.py`` (when the Triton kernel lands).

The kernel is memory-bound: it reads ``h [M, 2*I]`` once (twice for the two-pass per-token
quantization of very wide rows) and writes ``out [M, I]``. A program handles a
``block_m x block_i`` tile of ``out``; the heuristic aims at a tile of about
``TARGET_TILE_ELEMENTS`` outputs, which keeps every thread busy with a few 16-byte vectors
without spilling the float32 intermediates of the exact FP8 rounding.

The gate/up layout (concatenated or interleaved) does not change the heuristics: a program of either layout
reads the same ``2 * rows * columns`` values of ``h`` (interleaved: one block twice as wide instead of two) and
holds the same float32 tiles.
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

#: Outputs per program: 4096 float32 values over 4 warps (128 threads) are 32 values a
#: thread (eight 16-byte bf16 loads of each half), enough to hide HBM latency on an H200
#: while the ~20 float32 temporaries of the exact FP8 rounding still fit in registers.
TARGET_TILE_ELEMENTS = 4096
#: Widest column block of the plain (cast) path: 1024 columns is a 2 KiB bf16 row segment,
#: i.e. whole 128-byte lines for every warp; wider blocks only reduce the number of rows.
MAX_BLOCK_I = 1024
#: Per-token quantization needs the amax of a whole row. Rows up to this padded width are
#: done in one pass (one program holds the row: 8192 float32 = 32 KiB across the program's
#: registers, i.e. 64 values a thread at 4 warps, 32 at 8 warps); wider rows (Mixtral's
#: I = 14336) take two passes (amax per column block, then quantize), reading ``h`` twice
#: instead of spilling.
MAX_ROW_BLOCK = 8192
#: Triton's limit on the elements of one block (``triton._utils.TRITON_MAX_TENSOR_NUMEL``).
MAX_TILE_ELEMENTS = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActAndMulConfig:
    """Block sizes and launch parameters of the Pallas-Triton ``act_and_mul`` kernel.

    block_m: rows of ``h`` per program (a power of two).
    block_i: output columns per program (a power of two). Per-token-group quantization
      needs ``block_i == group_size``; one-pass per-token quantization needs
      ``block_i >= I`` (the whole row).
    two_pass: per-token quantization only: first the amax of each ``block_i`` column block,
      then the quantization (for rows wider than one program can hold).
    num_warps, num_stages: Triton launch parameters.
    """

    block_m: int
    block_i: int
    two_pass: bool = False
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "block_i", "num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ActAndMulConfig: {name} must be an int >= 1; got {name}={v!r}")
        for name in ("block_m", "block_i", "num_warps"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"ActAndMulConfig: {name} must be a power of two (a Triton block is); got {name}={v}")


def _num_warps(tile_elements: int) -> int:
    # 4 warps for tiles up to the target size; 8 for the wide one-row tiles of per-token
    # quantization, so that a thread holds at most 32-64 float32 values of each half.
    return 4 if tile_elements <= TARGET_TILE_ELEMENTS else 8


def act_and_mul_config(M: int, I: int, quant: str | None, group_size: int) -> ActAndMulConfig:
    """The heuristic: a config for ``h [M, 2*I]`` and the given quantization.

    ``num_stages=1`` everywhere: the kernel has no loop, so there is nothing to pipeline.
    """
    rows_pow2 = pl.next_power_of_2(max(M, 1))
    if quant == "fp8_per_token_group":
        block_i = group_size
    elif quant == "fp8_per_token" and pl.next_power_of_2(max(I, 1)) <= MAX_ROW_BLOCK:
        block_i = pl.next_power_of_2(max(I, 1))
    else:  # plain cast, or the two-pass per-token quantization of wide rows
        block_i = min(MAX_BLOCK_I, pl.next_power_of_2(max(I, 1)))
    two_pass = quant == "fp8_per_token" and block_i < I
    block_m = max(1, min(rows_pow2, TARGET_TILE_ELEMENTS // block_i))
    return ActAndMulConfig(block_m=block_m, block_i=block_i, two_pass=two_pass,
                           num_warps=_num_warps(block_m * block_i), num_stages=1)


#: Outputs per backward program (``block_m * block_i`` of ``d_a``): half the forward's target. The
#: backward keeps five float32 tiles live (``g``, ``u``, ``d_a`` and the two results): 2048 values over
#: 4 warps are 16 a thread per tile, where 4096 would spill.
BACKWARD_TILE_ELEMENTS = 2048


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActAndMulBackwardConfig:
    """Block sizes and launch parameters of the Pallas-Triton ``act_and_mul`` backward kernel.

    block_m: rows per program (a power of two).
    block_i: columns of ``d_a [M, I]`` per program (a power of two); the program writes the same
      columns of both halves of ``d_h [M, 2*I]``.
    num_warps, num_stages: Triton launch parameters.
    """

    block_m: int
    block_i: int
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "block_i", "num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ActAndMulBackwardConfig: {name} must be an int >= 1; got {name}={v!r}")
        for name in ("block_m", "block_i", "num_warps"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(
                    f"ActAndMulBackwardConfig: {name} must be a power of two (a Triton block is); got {name}={v}")


def act_and_mul_backward_config(M: int, I: int) -> ActAndMulBackwardConfig:
    """The heuristic for ``h [M, 2*I]``, ``d_a [M, I]`` -> ``d_h [M, 2*I]``: column blocks of at most
    ``MAX_BLOCK_I``, rows to fill ``BACKWARD_TILE_ELEMENTS``; 4 warps (16 values a thread per tile),
    ``num_stages=1`` (no loop to pipeline)."""
    block_i = min(MAX_BLOCK_I, pl.next_power_of_2(max(I, 1)))
    block_m = max(1, min(pl.next_power_of_2(max(M, 1)), BACKWARD_TILE_ELEMENTS // block_i))
    return ActAndMulBackwardConfig(block_m=block_m, block_i=block_i, num_warps=4, num_stages=1)
