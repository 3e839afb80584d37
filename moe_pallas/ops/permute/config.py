"""Launch configurations of the Pallas-Triton routing-metadata and permute kernels (``pallas_triton.py``).

Mirror: ``moe_torch/ops/permute/config.py`` (when the Triton kernels land).

Routing metadata: a program owns ``block_a`` consecutive assignments ``a = t*topk + j`` and
builds a ``block_a x E_pad`` one-hot tile (``E_pad = next_power_of_2(E_local)``) of int32,
then reduces it (counts) or scans it along the assignments (ranks). The heuristic keeps that
tile near ``TARGET_ONEHOT_ELEMENTS``: a few int32 registers a thread, so the per-block work is
register-resident for E_local up to a few hundred experts.

Permute: a memory-bound row gather (and FP8 quantization). A program handles a
``block_m x block_h`` tile of ``x_permuted [M_cap, H]``, sized like the activation kernel's.
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

#: One-hot elements per routing program: 8192 int32 over 4 warps are 64 values a thread.
TARGET_ONEHOT_ELEMENTS = 8192
#: Bounds on ``block_a``: at least 16 (a Triton block of fewer is wasted lanes), at most 1024
#: assignments per program (more programs keep the SMs busy at large ``T * topk``).
MIN_BLOCK_A, MAX_BLOCK_A = 16, 1024
#: Outputs per permute program (as ``activation/config.py``): 32 values a thread at 4 warps.
TARGET_TILE_ELEMENTS = 4096
#: Widest column block of the plain gather: 1024 columns is a 2 KiB bf16 row segment.
MAX_BLOCK_H = 1024
#: Per-token quantization with rows up to this padded width is one pass (one program holds the
#: row); wider rows take two passes (amax per column block, then quantize).
MAX_ROW_BLOCK = 8192
#: Triton's limit on the elements of one block (``triton._utils.TRITON_MAX_TENSOR_NUMEL``).
MAX_TILE_ELEMENTS = 1 << 20


def _check_pow2(cls: str, obj, names: tuple[str, ...], pow2: tuple[str, ...]) -> None:
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{cls}: {name} must be an int >= 1; got {name}={v!r}")
    for name in pow2:
        v = getattr(obj, name)
        if v & (v - 1):
            raise ValueError(f"{cls}: {name} must be a power of two (a Triton block is); got {name}={v}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoutingMetadataConfig:
    """Launch parameters of the two routing-metadata kernels (count, then rank-and-scatter).

    block_a: assignments per program (a power of two); grid ``(cdiv(T*topk, block_a),)``.
    num_warps, num_stages: Triton launch parameters.
    """

    block_a: int
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self) -> None:
        _check_pow2("RoutingMetadataConfig", self, ("block_a", "num_warps", "num_stages"), ("block_a", "num_warps"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PermuteConfig:
    """Block sizes and launch parameters of the Pallas-Triton permute kernel.

    block_m: permuted rows per program (a power of two).
    block_h: columns per program (a power of two). Per-token-group quantization needs
      ``block_h == group_size``; one-pass per-token quantization needs ``block_h >= H``.
    two_pass: per-token quantization only: amax of each column block first, then quantize.
    num_warps, num_stages: Triton launch parameters.
    """

    block_m: int
    block_h: int
    two_pass: bool = False
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self) -> None:
        _check_pow2("PermuteConfig", self, ("block_m", "block_h", "num_warps", "num_stages"),
                    ("block_m", "block_h", "num_warps"))


def routing_metadata_config(m_cap: int, num_local_experts: int) -> RoutingMetadataConfig:
    """The heuristic for ``M_cap = T*topk`` assignments and ``E_local`` experts.

    ``num_stages=1``: no loops in the kernels.
    """
    e_pad = pl.next_power_of_2(max(num_local_experts, 1))
    block_a = max(MIN_BLOCK_A, min(MAX_BLOCK_A, TARGET_ONEHOT_ELEMENTS // e_pad))
    block_a = min(block_a, max(MIN_BLOCK_A, pl.next_power_of_2(max(m_cap, 1))))
    return RoutingMetadataConfig(block_a=block_a, num_warps=4 if block_a * e_pad <= TARGET_ONEHOT_ELEMENTS else 8)


def permute_config(m_cap: int, H: int, quant: str | None, group_size: int) -> PermuteConfig:
    """The heuristic for ``x_permuted [M_cap, H]`` and the given quantization (as ``act_and_mul_config``)."""
    h_pow2 = pl.next_power_of_2(max(H, 1))
    if quant == "fp8_per_token_group":
        block_h = group_size
    elif quant == "fp8_per_token" and h_pow2 <= MAX_ROW_BLOCK:
        block_h = h_pow2
    else:  # plain gather, static per-tensor, or two-pass per-token for wide rows
        block_h = min(MAX_BLOCK_H, h_pow2)
    two_pass = quant == "fp8_per_token" and block_h < H
    block_m = max(1, min(pl.next_power_of_2(max(m_cap, 1)), TARGET_TILE_ELEMENTS // block_h))
    return PermuteConfig(block_m=block_m, block_h=block_h, two_pass=two_pass,
                         num_warps=4 if block_m * block_h <= TARGET_TILE_ELEMENTS else 8, num_stages=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PermuteBackwardConfig:
    """Block sizes and launch parameters of the Pallas-Triton permute backward kernel (the gather-sum of
    ``topk`` rows of ``d_xp`` per token, the shape of ``combine``).

    block_t: tokens per program (a power of two).
    block_h: columns per program (a power of two).
    num_warps, num_stages: Triton launch parameters.
    """

    block_t: int
    block_h: int
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self) -> None:
        _check_pow2("PermuteBackwardConfig", self, ("block_t", "block_h", "num_warps", "num_stages"),
                    ("block_t", "block_h", "num_warps"))


def permute_backward_config(T: int, H: int) -> PermuteBackwardConfig:
    """The heuristic for ``d_xp [T*topk, H]`` -> ``d_x [T, H]``: column blocks of at most ``MAX_BLOCK_H``,
    tokens to fill ``TARGET_TILE_ELEMENTS`` float32 accumulators (never more than T); 4 warps (32 a
    thread), ``num_stages=1`` (the slot loop is unrolled; the gathers are data-dependent)."""
    block_h = min(MAX_BLOCK_H, pl.next_power_of_2(max(H, 1)))
    block_t = max(1, min(pl.next_power_of_2(max(T, 1)), TARGET_TILE_ELEMENTS // block_h))
    return PermuteBackwardConfig(block_t=block_t, block_h=block_h, num_warps=4, num_stages=1)
