"""Launch configs of the Triton ``routing_metadata`` and ``permute`` kernels (``moe_torch/ops/permute/triton.py``).

Frozen, keyword-only dataclasses and the heuristics that pick them from the problem shape.
Every constant says why it has its value.
"""

from __future__ import annotations

import dataclasses

import triton

#: Elements of one routing program's ``[BLOCK_A assignments, BLOCK_E experts]`` one-hot tile
#: (int32). 8192 values over 4 warps are 64 per thread: the tile is built, summed and
#: cumsummed in registers; more would spill. Many experts shrink the assignment block.
ROUTING_TILE_ELEMS = 8192
#: Fewest assignments per routing program: below this (E_local > 512) the block scan gets as
#: many rows as there are assignments / 16, and the one-program scan becomes the bottleneck.
MIN_BLOCK_A = 16
#: Elements of the scan program's ``[BLOCK_B blocks, BLOCK_E experts]`` tile: the same
#: register budget as above (one program walks all blocks, one tile per step).
SCAN_TILE_ELEMS = 8192

#: Elements of one permute program's ``[BLOCK_M, BLOCK_N]`` tile. 4096 float32 values over
#: 4 warps are 32 per thread: enough gathered loads in flight to hide HBM latency on a
#: memory-bound gather without spilling registers.
TILE_ELEMS = 4096
#: Widest column block: 1024 bf16 values are 2 KiB per row, 16-byte vector loads for every
#: thread of 4 warps on one row; wider buys nothing on a memory-bound op.
MAX_BLOCK_N = 1024
#: Widest quantization span that one program holds in registers (amax and quantization from
#: the same loaded values). Wider spans (per-token with H > 4096, e.g. DeepSeek-V3's 7168) are
#: walked twice: an amax pass, then a quantize pass that reloads the same row.
MAX_SINGLE_CHUNK = 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoutingConfig:
    """``block_a`` assignments x ``block_e`` (>= E_local, power of 2) experts per count / scatter
    program; the scan program walks the per-block counts ``block_b`` blocks at a time."""

    block_a: int
    block_e: int
    block_b: int
    num_warps: int


def routing_config(m_cap: int, num_local_experts: int) -> RoutingConfig:
    """Heuristic config for ``topk_ids [T, topk]`` (``m_cap = T*topk`` assignments) on a rank
    owning ``num_local_experts`` experts."""
    block_e = triton.next_power_of_2(max(num_local_experts, 1))
    # Assignments per program: fill the tile, at least MIN_BLOCK_A, never more than exist.
    block_a = max(MIN_BLOCK_A, ROUTING_TILE_ELEMS // block_e)
    block_a = max(1, min(block_a, triton.next_power_of_2(max(m_cap, 1))))
    n_blocks = triton.cdiv(max(m_cap, 1), block_a)
    block_b = max(1, min(SCAN_TILE_ELEMS // block_e, triton.next_power_of_2(n_blocks)))
    # 4 warps: at most 64 int32 values per thread in any tile (see ROUTING_TILE_ELEMS).
    return RoutingConfig(block_a=block_a, block_e=block_e, block_b=block_b, num_warps=4)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PermuteConfig:
    """``block_m`` permuted rows x ``block_n`` columns of ``x_perm [M_cap, H]`` per inner step of
    one program.

    With dynamic FP8 quantization a program owns ``block_m`` rows of one quantization span (the
    whole row for per-token, a group for per-token-group), walking its columns in ``block_n``
    chunks; ``single_chunk`` says the span fits in one chunk (loaded once, not twice).
    """

    block_m: int
    block_n: int
    single_chunk: bool
    num_warps: int
    num_stages: int


def permute_config(m_cap: int, H: int, quant: str | None, group_size: int) -> PermuteConfig:
    """Heuristic config for ``x [T, H]`` -> ``x_perm [M_cap, H]``.

    The span (columns sharing one scale) is ``H`` for per-token, ``group_size`` for
    per-token-group; without quant or with a static per-tensor scale it is just the column block.
    """
    dynamic = quant in ("fp8_per_token", "fp8_per_token_group")
    span = {"fp8_per_token": H, "fp8_per_token_group": group_size}.get(quant, H)
    span_pow2 = triton.next_power_of_2(max(span, 1))
    block_n = min(span_pow2, MAX_BLOCK_N)
    single_chunk = not dynamic or span_pow2 <= MAX_SINGLE_CHUNK
    if dynamic and single_chunk:
        block_n = span_pow2  # the whole span in one chunk (masked past `span` if not a power of 2)
    block_m = max(1, min(TILE_ELEMS // block_n, triton.next_power_of_2(max(m_cap, 1))))
    # 4 warps: every tile is at most TILE_ELEMS (block_n <= MAX_SINGLE_CHUNK == TILE_ELEMS).
    # 1 stage: a gather through a data-dependent row index, nothing for the pipeliner to prefetch.
    return PermuteConfig(block_m=block_m, block_n=block_n, single_chunk=single_chunk, num_warps=4, num_stages=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PermuteBackwardConfig:
    """``block_t`` tokens x ``block_h`` hidden columns of ``d_x [T, H]`` per program (the gather-sum
    of ``topk`` rows of ``d_xp`` per token, the shape of ``combine``)."""

    block_t: int
    block_h: int
    num_warps: int
    num_stages: int


def permute_backward_config(T: int, H: int) -> PermuteBackwardConfig:
    """Heuristic config for ``d_xp [M_cap, H]``, ``src2dst [T, topk]`` -> ``d_x [T, H]``."""
    block_h = min(triton.next_power_of_2(max(H, 1)), MAX_BLOCK_N)
    # Tokens per program: fill the tile (TILE_ELEMS float32 accumulators), never more than T.
    block_t = max(1, min(TILE_ELEMS // block_h, triton.next_power_of_2(max(T, 1))))
    # 4 warps: 32 float32 accumulators per thread. 1 stage: gathers through a data-dependent row
    # index, nothing for the pipeliner to prefetch.
    return PermuteBackwardConfig(block_t=block_t, block_h=block_h, num_warps=4, num_stages=1)
