"""Launch configuration of the Pallas-Triton ``combine`` kernel (``pallas_triton.py``).

Mirror: ``moe_torch/ops/combine/config.py`` (when the Triton kernel lands).

The kernel is a gather-and-sum: per program ``block_t`` tokens x ``block_h`` hidden columns,
``topk`` gathered rows of ``y`` each. It is memory-bound (``T * topk * H`` reads of ``y``,
``T * H`` writes), so the config only has to keep enough bytes in flight per program.
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

#: Hidden columns per program: 1024 bf16 values are 2 KiB per gathered row, so each of the
#: ``block_t`` rows is read in whole 128-byte lines; H = 7168 (DeepSeek-V3) is 7 blocks.
MAX_BLOCK_H = 1024
#: Outputs per program (``block_t * block_h``): 4096 float32 accumulators over 4 warps are 32
#: a thread, and each of the ``topk`` gathered tiles is 8 KiB (bf16) in flight per program.
TARGET_TILE_ELEMENTS = 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class CombineConfig:
    """Block sizes and launch parameters of the Pallas-Triton ``combine`` kernel.

    block_t: tokens per program (a power of two).
    block_h: hidden columns per program (a power of two).
    num_warps, num_stages: Triton launch parameters.
    """

    block_t: int
    block_h: int
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("block_t", "block_h", "num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"CombineConfig: {name} must be an int >= 1; got {name}={v!r}")
        for name in ("block_t", "block_h", "num_warps"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"CombineConfig: {name} must be a power of two (a Triton block is); got {name}={v}")


def combine_config(T: int, H: int, topk: int) -> CombineConfig:
    """The heuristic: a config for ``y [T*topk, H]`` summed into ``out [T, H]``.

    ``num_warps=4``: a 4096-element tile is 32 values a thread, no need for more threads.
    ``num_stages=1``: the loop over ``topk`` slots is unrolled at trace time, so Triton has
    no loop to software-pipeline; the ``topk`` independent gathers are already in flight.
    """
    del topk  # the slot loop is unrolled; it does not change the tile
    block_h = min(MAX_BLOCK_H, pl.next_power_of_2(max(H, 1)))
    block_t = max(1, min(pl.next_power_of_2(max(T, 1)), TARGET_TILE_ELEMENTS // block_h))
    return CombineConfig(block_t=block_t, block_h=block_h, num_warps=4, num_stages=1)


#: Elements of one backward chunk ``[block_t, block_h]``: half the forward's tile. Each of the ``topk``
#: slots gathers a ``y`` tile of this size and stores a ``d_y`` tile (``d_out`` is loaded once a chunk):
#: 2048 float32 values over 4 warps are 16 a thread per live tile.
BACKWARD_TILE_ELEMENTS = 2048


@dataclasses.dataclass(frozen=True, kw_only=True)
class CombineBackwardConfig:
    """Block sizes and launch parameters of the Pallas-Triton ``combine`` backward kernel.

    block_t: tokens per program (a power of two); a program owns its tokens' full rows (the row dot
      products of ``d_topk_weights``) and walks the hidden dim in ``block_h`` chunks.
    block_h: hidden columns per chunk (a power of two).
    num_warps, num_stages: Triton launch parameters.
    """

    block_t: int
    block_h: int
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("block_t", "block_h", "num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"CombineBackwardConfig: {name} must be an int >= 1; got {name}={v!r}")
        for name in ("block_t", "block_h", "num_warps"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(
                    f"CombineBackwardConfig: {name} must be a power of two (a Triton block is); got {name}={v}")


def combine_backward_config(T: int, H: int, topk: int) -> CombineBackwardConfig:
    """The heuristic for ``d_out [T, H]``, ``y [T*topk, H]`` -> ``d_y``, ``d_topk_weights``: chunks of at
    most ``MAX_BLOCK_H`` columns, tokens to fill ``BACKWARD_TILE_ELEMENTS`` (never more than T). 4 warps
    (16 values a thread per tile); ``num_stages=1``: data-dependent gathers and scatters."""
    del topk  # the slot loop is unrolled; it does not change the tile
    block_h = min(MAX_BLOCK_H, pl.next_power_of_2(max(H, 1)))
    block_t = max(1, min(pl.next_power_of_2(max(T, 1)), BACKWARD_TILE_ELEMENTS // block_h))
    return CombineBackwardConfig(block_t=block_t, block_h=block_h, num_warps=4, num_stages=1)
