"""Launch configs of the Triton ``act_and_mul`` kernel (``moe_torch/ops/activation/triton.py``).

One frozen, keyword-only dataclass and the heuristic that picks it from the problem shape.
Every constant says why it has its value.

The gate/up layout (concatenated or interleaved) does not change the heuristics: a program of either layout
reads the same ``2 * rows * columns`` values of ``h`` (interleaved: one block twice as wide instead of two) and
holds the same float32 tiles.
"""

from __future__ import annotations

import dataclasses

import triton

#: Elements of one program's ``[BLOCK_M, BLOCK_N]`` tile. 4096 float32 values over
#: 4 warps (128 threads) are 32 per thread: enough independent loads in flight to hide
#: HBM latency on an elementwise kernel without spilling registers.
TILE_ELEMS = 4096
#: Widest column block. A 1024-wide block of bf16 is 2 KiB per row, i.e. 16-byte vector
#: loads for every thread of 4 warps on one row; wider buys nothing on a memory-bound op.
MAX_BLOCK_N = 1024
#: Widest group that one program holds entirely in registers (per-token-group quant): the
#: group's float32 activations stay live between the amax and the quantization, so they are
#: computed once. Wider groups are looped over twice (amax pass, then quantize pass).
MAX_SINGLE_CHUNK = 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActAndMulConfig:
    """``block_m`` rows x ``block_n`` columns of ``out [M, I]`` per inner step of one program.

    With FP8 quantization a program owns ``block_m`` rows of one quantization group (the whole
    row for per-token), walking its columns in ``block_n`` chunks; ``single_chunk`` says the
    group fits in one chunk (then the activation is computed once, not twice).
    """

    block_m: int
    block_n: int
    single_chunk: bool
    num_warps: int
    num_stages: int


def act_and_mul_config(M: int, I: int, quant: str | None, group_size: int) -> ActAndMulConfig:
    """Heuristic config for ``h [M, 2*I] -> out [M, I]``.

    The quantization span (columns that share one scale) is ``I`` for per-token, ``group_size``
    for per-token-group; without quant it is just the column block.
    """
    span = {None: I, "fp8_per_token": I, "fp8_per_token_group": group_size}[quant]
    span_pow2 = triton.next_power_of_2(max(span, 1))
    block_n = min(span_pow2, MAX_BLOCK_N)
    single_chunk = quant is None or span_pow2 <= MAX_SINGLE_CHUNK
    if quant is not None and single_chunk:
        block_n = span_pow2  # the whole group in one chunk (masked past `span` if not a power of 2)
    # Rows per program: fill the tile, but never more rows than exist (M=1 decode batches).
    block_m = max(1, min(TILE_ELEMS // block_n, triton.next_power_of_2(max(M, 1))))
    # 4 warps: every tile is at most TILE_ELEMS (block_n <= MAX_SINGLE_CHUNK == TILE_ELEMS), i.e.
    # at most 32 float32 values per thread. 1 stage: no tl.dot and no loop worth pipelining
    # through shared memory (the chunk loops only exist for groups wider than 4096).
    return ActAndMulConfig(block_m=block_m, block_n=block_n, single_chunk=single_chunk, num_warps=4, num_stages=1)


#: Elements of one backward program's ``[BLOCK_M, BLOCK_N]`` tile: half the forward's. The backward
#: keeps five float32 tiles live (``g``, ``u``, ``d_a`` and the two results): 2048 values over 4 warps
#: are 16 per thread per tile, 80 registers of data, where 4096 would spill.
BACKWARD_TILE_ELEMS = 2048


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActAndMulBackwardConfig:
    """``block_m`` rows x ``block_n`` columns of ``d_a [M, I]`` per program (``block_n`` a power of 2);
    the program writes the same columns of both halves of ``d_h [M, 2*I]``."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def act_and_mul_backward_config(M: int, I: int) -> ActAndMulBackwardConfig:
    """Heuristic config for ``h [M, 2*I]``, ``d_a [M, I]`` -> ``d_h [M, 2*I]``."""
    block_n = min(triton.next_power_of_2(max(I, 1)), MAX_BLOCK_N)
    # Rows per program: fill the tile, never more rows than exist (M=1).
    block_m = max(1, min(BACKWARD_TILE_ELEMS // block_n, triton.next_power_of_2(max(M, 1))))
    # 4 warps: at most 16 float32 values per thread per live tile. 1 stage: no loop to pipeline.
    return ActAndMulBackwardConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=1)
