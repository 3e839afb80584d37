"""Launch configuration of the Pallas-Triton gate kernel (``pallas_triton.py``).

Mirror: ``moe_torch/ops/gate/config.py`` (the same tile rule for the Triton gate).

A program owns ``block_t`` tokens and holds their ``[block_t, E_pad]`` float32 scores, selection
scores and a boolean "taken" mask in registers (``E_pad = next_power_of_2(E)``); the top-k is
``topk`` rounds of max / min-index reductions over that tile. The heuristic keeps the tile near
``TARGET_TILE_ELEMENTS`` per warp: a handful of live ``[block_t, E_pad]`` tensors stay
register-resident (8 values a thread each).
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

#: Score elements per program per warp: one warp holds 256 float32 values, 8 a thread per live tensor.
#: One token on one warp measured fastest on DeepSeek-V3's gate (E=256) at large and small T
#: (``benchmarks/tune_gate.py``; BENCHMARKS.md): 2048-element tiles need so many registers a thread that only
#: 2 programs fit an SM.
TARGET_TILE_ELEMENTS = 256
#: At most this many tokens a program (more programs keep the SMs busy at large T).
MAX_BLOCK_T = 64
#: Most warps a program (very wide E, where ``block_t`` bottoms out at 1).
MAX_WARPS = 8
#: Triton's limit on the elements of one block (``triton._utils.TRITON_MAX_TENSOR_NUMEL``).
MAX_TILE_ELEMENTS = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class GateConfig:
    """Launch parameters of the Pallas-Triton gate kernel.

    block_t: tokens per program (a power of two); grid ``(cdiv(T, block_t),)``.
    num_warps, num_stages: Triton launch parameters.
    """

    block_t: int
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("block_t", "num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GateConfig: {name} must be an int >= 1; got {name}={v!r}")
        for name in ("block_t", "num_warps"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"GateConfig: {name} must be a power of two (a Triton block is); got {name}={v}")


def gate_config(T: int, E: int) -> GateConfig:
    """The heuristic for ``router_logits [T, E]``: ``block_t * E_pad ~ TARGET_TILE_ELEMENTS`` (one
    token a program from E = 256 up), at most ``next_power_of_2(T)`` and ``MAX_BLOCK_T``; one warp per
    ``TARGET_TILE_ELEMENTS`` of the tile (E = 512: 2 warps), at most ``MAX_WARPS``."""
    e_pad = pl.next_power_of_2(max(E, 1))
    block_t = max(1, min(MAX_BLOCK_T, TARGET_TILE_ELEMENTS // e_pad, pl.next_power_of_2(max(T, 1))))
    num_warps = max(1, min(MAX_WARPS, block_t * e_pad // TARGET_TILE_ELEMENTS))
    return GateConfig(block_t=block_t, num_warps=num_warps, num_stages=1)
