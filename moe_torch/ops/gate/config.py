"""Launch config of the Triton gate kernel (``moe_torch/ops/gate/triton.py``).

A frozen, keyword-only dataclass and the heuristic that picks it from the problem shape.
Every constant says why it has its value.
"""

from __future__ import annotations

import dataclasses

import triton

#: Elements of one program's ``[BLOCK_T tokens, BLOCK_E experts]`` float32 tile per warp. The kernel
#: keeps about three such tiles live (scores, selection scores, the not-yet-chosen mask): 256 values
#: over one warp are 8 per thread per tile. One token per one-warp program measured fastest on DeepSeek-V3's
#: gate (``benchmarks/tune_gate.py``; BENCHMARKS.md): 4096-element tiles over 4 warps need so many registers
#: a thread (ptxas) that only 2 programs fit an SM.
TILE_ELEMS = 256
#: Most warps a program (E = 512 takes 2).
MAX_WARPS = 8
#: Widest expert axis one program holds in registers (DeepSeek-V3 has 256, the largest routers
#: in use 512); wider would need a multi-pass top-k, which this kernel does not have.
MAX_EXPERTS = 512
#: Most expert groups: the group scores are built by a statically unrolled loop over the groups.
MAX_GROUPS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class GateConfig:
    """``block_t`` tokens x ``block_e`` (power of 2 >= E) experts per program; ``block_k``
    (power of 2 >= topk) columns of the in-register output tile."""

    block_t: int
    block_e: int
    block_k: int
    num_warps: int


def gate_config(T: int, E: int, topk: int) -> GateConfig:
    """Heuristic config for ``router_logits [T, E]`` -> ``topk`` routed slots."""
    block_e = triton.next_power_of_2(max(E, 1))
    # Tokens per program: fill the tile, never more than exist (T=1 decode gets one-row programs).
    block_t = max(1, min(TILE_ELEMS // block_e, triton.next_power_of_2(max(T, 1))))
    block_k = triton.next_power_of_2(max(topk, 1))
    # One warp per TILE_ELEMS of the tile: 8 float32 values per thread in each live tile.
    num_warps = max(1, min(MAX_WARPS, block_t * block_e // TILE_ELEMS))
    return GateConfig(block_t=block_t, block_e=block_e, block_k=block_k, num_warps=num_warps)
