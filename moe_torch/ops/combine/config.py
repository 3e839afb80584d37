"""Launch config of the Triton ``combine`` kernel (``moe_torch/ops/combine/triton.py``).

One frozen, keyword-only dataclass and the heuristic that picks it from the problem shape.
Every constant says why it has its value.
"""

from __future__ import annotations

import dataclasses

import triton

#: Elements of one program's ``[BLOCK_T, BLOCK_H]`` output tile. 4096 float32 accumulators
#: over 4 warps are 32 per thread: enough gathered loads in flight per slot to hide HBM
#: latency, without spilling registers (each of the ``topk`` slots adds one row load per token).
TILE_ELEMS = 4096
#: Widest hidden-dim block. 1024 bf16 values are 2 KiB per gathered row: 16-byte vector loads
#: for all threads of 4 warps on one row. Large H (7168) is split over several programs, which
#: also gives small-T decode batches enough programs to fill the GPU.
MAX_BLOCK_H = 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class CombineConfig:
    """``block_t`` tokens x ``block_h`` hidden columns of ``out [T, H]`` per program."""

    block_t: int
    block_h: int
    num_warps: int
    num_stages: int


def combine_config(T: int, H: int, topk: int) -> CombineConfig:
    """Heuristic config for ``y [M_cap, H]``, ``src2dst [T, topk]`` -> ``out [T, H]``."""
    del topk  # the slot loop is unrolled (topk <= ~10); it does not change the tile
    block_h = min(triton.next_power_of_2(max(H, 1)), MAX_BLOCK_H)
    # Tokens per program: fill the tile for small H (e.g. tests' H=48), never more than T.
    block_t = max(1, min(TILE_ELEMS // block_h, triton.next_power_of_2(max(T, 1))))
    # 4 warps: the tile is at most TILE_ELEMS, i.e. 32 float32 accumulators per thread.
    # 1 stage: gathers through a data-dependent row index, nothing for the pipeliner to prefetch.
    return CombineConfig(block_t=block_t, block_h=block_h, num_warps=4, num_stages=1)


#: Elements of one backward chunk ``[BLOCK_T, BLOCK_H]``: each of the ``topk`` slots gathers a
#: ``y`` tile of this size and stores a ``d_y`` tile (the ``d_out`` tile is loaded once per chunk).
#: 2048 float32 values over 4 warps are 16 per thread per live tile (``d_out``, a gathered ``y``
#: row block and its ``d_y``), half the forward's tile: the backward keeps more tiles live.
BACKWARD_TILE_ELEMS = 2048


@dataclasses.dataclass(frozen=True, kw_only=True)
class CombineBackwardConfig:
    """``block_t`` tokens per program, walking the hidden dim in ``block_h`` chunks (the row dot
    products ``d_topk_weights`` need the whole row, so one program owns its tokens' full rows);
    ``block_k`` (power of 2 >= topk) columns of the in-register ``d_topk_weights`` tile."""

    block_t: int
    block_h: int
    block_k: int
    num_warps: int
    num_stages: int


def combine_backward_config(T: int, H: int, topk: int) -> CombineBackwardConfig:
    """Heuristic config for ``d_out [T, H]``, ``y [M_cap, H]``, ``src2dst [T, topk]`` ->
    ``d_y [M_cap, H]``, ``d_topk_weights [T, topk]``."""
    block_h = min(triton.next_power_of_2(max(H, 1)), MAX_BLOCK_H)
    # Tokens per program: fill the chunk, never more than T (T=1 decode gets one-token programs, and
    # large T gets T / block_t programs: 2048 at T=4096, H=7168, enough to fill 132 SMs many times).
    block_t = max(1, min(BACKWARD_TILE_ELEMS // block_h, triton.next_power_of_2(max(T, 1))))
    # 4 warps: 16 float32 values per thread per live tile. 1 stage: data-dependent gathers and
    # scatters, nothing for the pipeliner to prefetch.
    return CombineBackwardConfig(block_t=block_t, block_h=block_h, block_k=triton.next_power_of_2(max(topk, 1)),
                                 num_warps=4, num_stages=1)
