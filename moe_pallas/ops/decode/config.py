"""Launch configs of the decode path's two Pallas-Triton kernels (``moe_pallas/ops/decode/pallas_triton.py``), and
the token count the path is meant for.

One frozen, keyword-only dataclass per kernel and the heuristic that picks it from the problem shape. Every
constant says why it has its value. None of them is measured yet (no GPU timing of this path exists): they are
the shapes' natural fits, the torch kernels' values, to be tuned before the layer routes small batches here.

Mirror: ``moe_torch/ops/decode/config.py`` (there kernel A also has ``chunk_s``, the lanes of its in-kernel id
scans; here a jnp prelude hands kernel A its expert and slots, so there is no scan and no ``MAX_SLOTS``).
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

#: The largest ``T`` (tokens of one layer call) the decode path is meant for: 1 to 64 tokens (decode steps,
#: speculative-decoding verification batches). Not enforced, and not yet used by ``moe_forward``: the layer keeps
#: its staged path until GPU measurements say below which ``T`` the two launches win (a later change wires it).
DECODE_MAX_TOKENS = 64

#: The narrowest tile side of a Triton dot (the tensor cores' ``m16n8k16`` / ``wgmma`` shapes; Triton refuses
#: smaller), so kernel A's rows are padded to 16 even for one slot, and kernel B's 4-bit GEMV runs the grouped
#: GEMM's decode-and-dot helper on 16 rows of which one is live.
MIN_DOT = 16

#: The K step of both kernels for 4-bit weights: whole scale groups of 32 (the grouped GEMM's ``_w4_step_part``
#: reads ``block_k // 32`` scales a row).
W4_MIN_BLOCK_K = 32

#: FP8-block layers (``quant="fp8_block"``): the activation's 1x128 groups and the weights' 128x128 scale blocks.
#: Kernel A's ``block_n`` is exactly one group (each program quantizes the groups of ``a`` it computes), and the
#: other K / N steps (``block_k``, ``block_h``, ``block_i``) at most one block, so that each step has one scale.
FP8_BLOCK = 128

#: Programs a kernel's grid should hold per SM at small ``T``: a bandwidth-bound kernel needs several weight streams in
#: flight on every SM to approach the copy bandwidth, and a single token's grid is otherwise a fraction of the GPU.
PROGRAMS_PER_SM = 2

#: An SM count to plan for when none is given (an H100 / H200's 132).
DEFAULT_NUM_SMS = 132

#: The narrowest output tile of kernel B for FP8 weights (a multiply and sum, no dot); float and 4-bit weights with
#: 16-bit activations go through a dot, whose side is at least :data:`MIN_DOT`.
MIN_BLOCK_H = 8


def _check_blocks(cls: str, cfg, names: tuple[str, ...]) -> None:
    for name in names:
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
            raise ValueError(f"{cls}: {name} must be a power-of-2 int >= 1 (a Triton block is); got {name}={v!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeGateUpConfig:
    """Kernel A (GEMM 1 + activation): one program per (reached expert, ``block_n`` columns of ``a [T*k, I]``),
    ``block_m`` of the expert's slots a row block (looped over when the expert has more), ``block_k`` of ``H`` per
    K step. Powers of 2 (checked here); the dot sides (``>= 16``, ``block_k >= 32`` for 4-bit) are checked by the
    launcher, which knows the weights."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        _check_blocks("DecodeGateUpConfig", self, ("block_m", "block_n", "block_k", "num_warps", "num_stages"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeDownConfig:
    """Kernel B (GEMM 2 + combine): one program per (token, ``block_h`` columns of ``out [T, H]``), walking ``I``
    in ``block_i`` chunks for each of the token's slots in order."""

    block_h: int
    block_i: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        _check_blocks("DecodeDownConfig", self, ("block_h", "block_i", "num_warps", "num_stages"))


def _pow2_between(n: int, lo: int, hi: int) -> int:
    """The power of 2 at least ``n``, clamped to ``[lo, hi]`` (``lo``, ``hi`` powers of 2)."""
    return max(lo, min(hi, pl.next_power_of_2(max(n, 1))))


def _fill_block(n: int, programs_per_block_row: int, lo: int, hi: int, num_sms: int) -> int:
    """The widest power-of-2 block in ``[lo, hi]`` (and no wider than ``n`` needs) whose grid, ``programs_per_block_row
    * cdiv(n, block)`` programs, still gives every SM :data:`PROGRAMS_PER_SM`; ``lo`` where none does."""
    block = _pow2_between(n, lo, hi)
    while block > lo and programs_per_block_row * pl.cdiv(n, block) < PROGRAMS_PER_SM * num_sms:
        block //= 2
    return block


def decode_gate_up_config(T: int, k: int, H: int, I: int, E_local: int, w4: bool, *,
                          fp8_block: bool = False, num_sms: int = DEFAULT_NUM_SMS) -> DecodeGateUpConfig:
    """Heuristic config of kernel A for ``x [T, H]``, ``k`` slots a token, ``w13 [E_local, 2*I, H]`` (``fp8_block``:
    a ``quant="fp8_block"`` layer; ``num_sms``: the GPU's SMs)."""
    if fp8_block:
        # One 1x128 group of a a program (FP8_BLOCK); rows at most 32 so that the two [32, 128] float32
        # accumulators hold what two [64, 64] ones do; K steps of one 128 x 128 weight block (H is a multiple of it).
        return DecodeGateUpConfig(block_m=_pow2_between(T, MIN_DOT, 32), block_n=FP8_BLOCK, block_k=FP8_BLOCK,
                                  num_warps=4, num_stages=2)
    # Rows: an expert holds at most T slots when a token's ids are distinct (as every gate makes them), so T rows
    # cover it in one block; at least 16 (the dot), at most 64 (two [BLOCK_M, BLOCK_N] float32 accumulators).
    block_m = _pow2_between(T, MIN_DOT, 64)
    # Columns: up to 64 gate + 64 up columns of w13 a program, narrower while the grid (one row of programs per
    # reached expert, at most T*k of them) would leave SMs without a weight stream; at least 16 (the dot).
    block_n = _fill_block(I, min(T * k, E_local), MIN_DOT, 64, num_sms)
    # K step: 128 of H (two 16 KiB bf16 weight tiles of 64 x 128 a step); 32 at least for 4-bit (whole groups).
    block_k = _pow2_between(H, W4_MIN_BLOCK_K if w4 else MIN_DOT, 128)
    # 4 warps: two [64, 128] bf16 weight tiles and two [BLOCK_M, 64] float32 accumulators a program. 2 stages:
    # the K loop streams w13, the one operand worth prefetching (x's rows are few and stay in L1/L2).
    return DecodeGateUpConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=4, num_stages=2)


def decode_down_config(T: int, H: int, I: int, w4: bool, *, fp8: str | None = None,
                       num_sms: int = DEFAULT_NUM_SMS) -> DecodeDownConfig:
    """Heuristic config of kernel B for ``out [T, H]`` from ``a [T*k, I]`` and ``w2 [E_local, H, I]`` (``fp8``: the
    FP8 quant mode, ``"fp8_per_token"`` / ``"fp8_block"``, or ``None``)."""
    # Up to 64 output columns a program, narrower while T * cdiv(H, block_h) programs would leave SMs idle (one
    # token of gpt-oss's H = 2880 at 64 columns is 45 programs on 132 SMs).
    block_h = _fill_block(H, T, MIN_BLOCK_H if fp8 else MIN_DOT, 64, num_sms)
    # I chunk: 128 (a [64, 128] weight tile, 32 float32 values a thread over 4 warps); 32 at least for 4-bit. Both
    # within one FP8 scale block (FP8_BLOCK) as fp8_block needs.
    block_i = _pow2_between(I, W4_MIN_BLOCK_K if w4 else MIN_DOT, 128)
    # 2 stages: the I loop streams w2 rows. The dot (a slot's row padded to 16) gives each warp 16 columns: over
    # 4 warps a 16-column tile is decoded by every warp alike (the sm_90 SASS of gpt-oss's MXFP4 I loop at T = 1:
    # 22 instructions a weight a lane over 4 warps, 5.1 over one); the FP8 GEMV keeps 4 warps.
    warps = 4 if fp8 else max(1, min(4, block_h // MIN_DOT))
    return DecodeDownConfig(block_h=block_h, block_i=block_i, num_warps=warps, num_stages=2)
