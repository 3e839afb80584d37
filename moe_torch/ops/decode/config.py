"""Launch configs of the decode path's two Triton kernels (``moe_torch/ops/decode/triton.py``), and the token
count the path is meant for.

One frozen, keyword-only dataclass per kernel and the heuristic that picks it from the problem shape. Every
constant says why it has its value: the shapes' natural fits, refined where ``benchmarks/tune_decode.py`` measured a
better choice (BENCHMARKS.md); the layer does not route small batches here by default.
"""

from __future__ import annotations

import dataclasses

import triton

#: The largest ``T`` (tokens of one layer call) the decode path is meant for: 1 to 64 tokens (decode steps,
#: speculative-decoding verification batches). Not enforced, and not yet used by ``moe_forward``: the layer keeps
#: its staged path until GPU measurements say below which ``T`` the two launches win (a later change wires it).
DECODE_MAX_TOKENS = 64

#: The most assignments ``T * (topk + S)`` the Triton kernels take: every program of the gate_up kernel scans all the
#: ids twice (a chunk at a time), so its overhead grows with ``T * k``; 2048 is 256 tokens of top-8, four times the
#: path's intended batches. Beyond, the launcher raises ``NotImplementedError`` (the api's default falls back to the
#: reference; the layer's staged path is the one for such batches).
MAX_SLOTS = 2048

#: Lanes of the gate_up kernel's compare tiles over a chunk of ids: ``[BLOCK_E, CHUNK_S]`` (the experts' counts) and
#: ``[BLOCK_M, CHUNK_S]`` (its expert's slots). 4096 int32 lanes over 4 warps are 32 a thread.
COUNT_TILE_ELEMS = 4096

#: The narrowest tile side of ``tl.dot`` (the tensor cores' ``m16n8k16`` / ``wgmma`` shapes; Triton refuses
#: smaller), so a program's rows are padded to 16 even for one slot.
MIN_DOT = 16

#: The K step of both kernels for 4-bit weights: whole scale groups of 32 (``_w4_tiles`` needs ``BLOCK_K >= 32``).
W4_MIN_BLOCK_K = 32

#: The K step of both kernels for ``quant="fp8_block"``: one 1 x 128 activation group and one 128 x 128 weight block
#: a step, so a step's partial sum takes one activation scale a row and one weight scale a column.
FP8_BLOCK_K = 128

#: The narrowest K step of kernel A for FP8 weights: the FP8 tensor-core ``mma`` takes K = 32.
FP8_MIN_BLOCK_K = 32

#: Programs a kernel's grid should hold per SM at small ``T``: a bandwidth-bound kernel needs several weight streams in
#: flight on every SM to approach the copy bandwidth, and a single token's grid is otherwise a fraction of the GPU.
PROGRAMS_PER_SM = 2

#: An SM count to plan for when none is given (an H100 / H200's 132).
DEFAULT_NUM_SMS = 132


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeGateUpConfig:
    """Kernel A (GEMM 1 + activation): one program per (reached expert, ``block_n`` columns of ``a [T*k, I]``),
    ``block_m`` of the expert's slots a row block (looped over when the expert has more), ``block_k`` of ``H`` per
    K step. ``chunk_s``: ids compared at once in the scans (the experts' counts, the expert's slots)."""

    block_m: int
    block_n: int
    block_k: int
    chunk_s: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeDownConfig:
    """Kernel B (GEMM 2 + combine): one program per (token, ``block_h`` columns of ``out [T, H]``), walking ``I``
    in ``block_i`` chunks for each of the token's slots in order."""

    block_h: int
    block_i: int
    num_warps: int
    num_stages: int


def _pow2_between(n: int, lo: int, hi: int) -> int:
    """The power of 2 at least ``n``, clamped to ``[lo, hi]`` (``lo``, ``hi`` powers of 2)."""
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def _fill_block(n: int, programs_per_block_row: int, lo: int, hi: int, num_sms: int) -> int:
    """The widest power-of-2 block in ``[lo, hi]`` (and no wider than ``n`` needs) whose grid, ``programs_per_block_row
    * cdiv(n, block)`` programs, still gives every SM :data:`PROGRAMS_PER_SM`; ``lo`` where none does."""
    block = _pow2_between(n, lo, hi)
    while block > lo and programs_per_block_row * triton.cdiv(n, block) < PROGRAMS_PER_SM * num_sms:
        block //= 2
    return block


def decode_gate_up_config(T: int, k: int, H: int, I: int, E_local: int, w4: bool,
                          fp8: str | None = None, num_sms: int = DEFAULT_NUM_SMS) -> DecodeGateUpConfig:
    """Heuristic config of kernel A for ``x [T, H]``, ``k`` slots a token, ``w13 [E_local, 2*I, H]``; ``fp8``: the
    FP8 quant mode (``"fp8_per_token"`` / ``"fp8_block"``) or ``None``; ``num_sms``: the GPU's SMs."""
    # Rows: an expert holds at most T slots when a token's ids are distinct (as every gate makes them), so T rows
    # cover it in one block; at least 16 (tl.dot), at most 64 (two [BLOCK_M, BLOCK_N] float32 accumulators).
    block_m = _pow2_between(T, MIN_DOT, 64)
    # Columns: up to 64 gate + 64 up columns of w13 a program, narrower while the grid (one row of programs per
    # reached expert, at most T*k of them) would leave SMs without a weight stream; at least 16 (tl.dot).
    block_n = _fill_block(I, min(T * k, E_local), MIN_DOT, 64, num_sms)
    # K step: 128 of H (two 16 KiB bf16 weight tiles of 64 x 128 a step); 32 at least for 4-bit (whole groups) and
    # FP8 (the FP8 mma's K); exactly one 128-wide scale block for fp8_block.
    block_k = _pow2_between(H, W4_MIN_BLOCK_K if w4 else FP8_MIN_BLOCK_K if fp8 else MIN_DOT, 128)
    if fp8 == "fp8_block":
        block_k = FP8_BLOCK_K
    block_e = triton.next_power_of_2(max(E_local, 1))
    block_s = triton.next_power_of_2(max(T * k, 1))
    chunk_s = max(1, min(block_s, COUNT_TILE_ELEMS // max(block_e, block_m)))
    # 4 warps: two [64, 128] bf16 weight tiles and two [BLOCK_M, 64] float32 accumulators a program. 4 stages: the
    # K loop streams w13, the one operand worth prefetching (x's rows are few and stay in L1/L2), and a small grid
    # needs many bytes in flight (4 stages measured faster than 2 by benchmarks/tune_decode.py: BENCHMARKS.md).
    return DecodeGateUpConfig(block_m=block_m, block_n=block_n, block_k=block_k, chunk_s=chunk_s, num_warps=4,
                              num_stages=4)


#: The narrowest output tile of kernel B for FP8 weights: its GEMV is a multiply and ``tl.sum``, no ``tl.dot``
#: minimum; 8 rows of a 128-wide chunk are still 1 KiB a load. Float and 4-bit weights go through a dot (``MIN_DOT``).
MIN_BLOCK_H = 8


def decode_down_config(T: int, H: int, I: int, w4: bool, fp8: str | None = None,
                       num_sms: int = DEFAULT_NUM_SMS) -> DecodeDownConfig:
    """Heuristic config of kernel B for ``out [T, H]`` from ``a [T*k, I]`` and ``w2 [E_local, H, I]``; ``fp8`` and
    ``num_sms`` as :func:`decode_gate_up_config`."""
    # Up to 64 output columns a program, narrower while T * cdiv(H, block_h) programs would leave SMs idle (one
    # token of gpt-oss's H = 2880 at 64 columns is 45 programs on 132 SMs).
    block_h = _fill_block(H, T, MIN_BLOCK_H if fp8 else MIN_DOT, 64, num_sms)
    # I chunk: 128 (a [64, 128] weight tile, 32 float32 values a thread over 4 warps); 32 at least for 4-bit.
    # fp8_block: exactly one activation group and weight block a chunk.
    block_i = FP8_BLOCK_K if fp8 == "fp8_block" else _pow2_between(I, W4_MIN_BLOCK_K if w4 else MIN_DOT, 128)
    # 2 stages: the I loop streams w2 rows. The dot (a slot's row padded to 16) gives each warp 16 columns: over
    # 4 warps a 16-column tile is decoded by every warp alike (the sm_90 SASS of gpt-oss's MXFP4 I loop at T = 1:
    # 22 instructions a weight a lane over 4 warps, 5.1 over one); the FP8 GEMV keeps 4 warps.
    warps = 4 if fp8 else max(1, min(4, block_h // MIN_DOT))
    return DecodeDownConfig(block_h=block_h, block_i=block_i, num_warps=warps, num_stages=2)
