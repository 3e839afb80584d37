"""Launch config of the Triton grouped GEMM kernel (``moe_torch/ops/grouped_gemm/triton.py``).

One frozen, keyword-only dataclass, the heuristic that picks it from the problem shape, and the
rules a config must follow. Every constant says why it has its value.

Tuned configs: the tables of :func:`tuned_tables` (``moe_contract/selection.py``: the per-user cache of ``epmoe
tune``, then ``tuned/<arch>/<device kind>.json``, then ``tuned/<arch>.json``; named keys). Lookup order of every default:
the entry with the same op (no ``"op"`` key: the forward, :func:`grouped_gemm_config` and, for 16-bit inputs, the
Gluon-or-Triton choice :func:`tuned_forward_kernel`; ``"op": "dgrad"`` / ``"wgrad"``: :func:`grouped_gemm_dgrad_config`,
:func:`grouped_gemm_wgrad_config`, :func:`tuned_wgrad_kernel`), ``N``, ``K`` (``w [E, N, K]``), dtype (and out dtype
for the backward) and the nearest ``M_cap`` in log2, where it keeps the kernel's rules; else the heuristic. An
explicit ``config`` of a kernel wins over both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import triton

from moe_contract.selection import DeviceSpec, TunedTables

#: Width of one weight-scale block along K (CONTRACT.md section 3: 128 x 128 blocks, DeepSeek-V3's
#: ``weight_scale_inv``). A K step must not straddle two blocks, so ``block_k`` must divide it.
W_SCALE_BLOCK = 128
#: Smallest K extent ``tl.dot`` accepts on NVIDIA (triton 3.6 ``backends/nvidia/compiler.py:
#: min_dot_size``): 16 for 16/32-bit operands, 32 for 8-bit ones. M and N are padded, K is not.
MIN_BLOCK_K = {16: 16, 32: 16, 8: 32}
#: Default K step in *bytes* per row: 128 B is one full 128-byte swizzled shared-memory line for
#: the Hopper tensor cores (64 bf16, 128 fp8, 32 fp32 elements).
K_STEP_BYTES = 128
#: Widest N tile: 128 columns x 64 rows x float32 is 32 KiB of accumulator over 4 warps
#: (64 registers per thread), the usual Hopper wgmma tile without spilling.
MAX_BLOCK_N = 128
#: Row tile bounds: 16 is the M of ``mma.sync.m16n8k16`` (smaller tiles are padded and waste the
#: tensor core); 64 rows is one warpgroup's wgmma M. With 4 warps triton 3.6 emits Hopper's
#: ``wgmma`` only for 64-row tiles; 16- and 32-row tiles use ``mma.sync`` (FP8 operands upcast
#: exactly to fp16 first), slower per FLOP but less padding for small experts (decode). Read off the
#: PTX of ``tests/test_triton_grouped_gemm.py::test_compiles_for_sm90``; to be tuned on the H200.
MIN_BLOCK_M = 16
MAX_BLOCK_M = 64
#: 4-bit weights (CONTRACT.md section 9): one scale per group of 32 along K. A K step of the 4-bit
#: kernel covers whole groups (``block_k`` a multiple of 32: a power of 2 >= 32), so that every
#: step's packed bytes and scales are whole rows of ``w_q`` and ``w_scale`` tiles.
W4_MIN_BLOCK_K = 32
#: The heuristic K step with 4-bit weights (16-bit ``x``: 128 K values, 256 bytes of ``x`` and 64 of codes a row).
W4_BLOCK_K = 128
#: Largest block side of the TMA variant (``GroupedGemmConfig.tma``): a TMA box has at most 256 elements
#: per dimension (CUDA driver API, ``cuTensorMapEncodeTiled``: ``boxDim[i] <= 256``).
TMA_MAX_BLOCK = 256


#: The default runs the Gluon kernels (``triton.py``: FP8 blocks, FP8 rowwise, the tuned 16-bit choice) on problems of
#: at least this many rows: below it their persistent 128-row tiles were not measured faster than the Triton kernel
#: (BENCHMARKS.md).
GLUON_MIN_ROWS = 4096
#: ... and of at least this many rows per local expert on average (``M_cap >= 32 * E``): with fewer, most of each
#: expert's 128-row tile is padding and the Triton kernel's smaller tiles win (DeepSeek-V3's 257 experts at T=512).
GLUON_MIN_ROWS_PER_EXPERT = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedGemmConfig:
    """``block_m`` rows x ``block_n`` columns of ``y [M_cap, N]`` per program, walking K in
    ``block_k`` steps. All three are powers of 2; ``block_k`` must be at least the ``tl.dot``
    minimum (16, or 32 for FP8) and, for FP8 with per-step scales (per-token-group activations,
    128x128 weight blocks), divide the scale's K group so that each step lies in one group.

    ``group_m`` and ``persistent`` choose the launch order only (module docstring of
    ``moe_torch/ops/grouped_gemm/triton.py``, "Launch order"); the result is the same for every value."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    #: L2 swizzle of the launch order (triton-lang/triton ``python/tutorials/03-matrix-multiplication.py``,
    #: ``GROUP_SIZE_M``): ``group_m`` consecutive work items (row tile, expert) sweep all column tiles
    #: together, so one expert's weight tile is reused ``group_m`` times while the group's ``x`` tiles
    #: stay in L2. Why: the default order re-reads all of ``x`` from HBM for every column tile (1.26-1.48x
    #: behind torch._grouped_mm at M=16384, BENCHMARKS.md). Rules: an int >= 1, any value (3 is fine);
    #: 1 (default) keeps today's 2-D grid, work item fastest.
    group_m: int = 1
    #: Persistent launch: ``min(#SMs, tiles)`` programs loop over the tiles (same order, ``group_m``
    #: applies) instead of one program per tile. Why: no idle programs for the static grid's spare
    #: work items, and the offsets' prefix sums once per program. Rules: a bool; False (default) keeps
    #: one program per tile.
    persistent: bool = False
    #: Opt-in TMA variant (``_grouped_gemm_kernel`` with ``TMA`` in ``triton.py``; findings in its module docstring,
    #: "Hopper: what Triton 3.6 offers"): ``x`` and ``w`` tiles loaded through host-side tensor descriptors
    #: (Hopper's TMA engine), the store still the masked pointer store. Why: TMA loads lift a dense Triton matmul well
    #: above the pointer loads' throughput, and the tuner picks this variant for bf16 at large M (BENCHMARKS.md). Rules: a bool; serves 16-bit (bf16 / fp16) and FP8 forwards without
    #: bias, and the dgrad of 16-bit ``d_y`` and ``w`` (``triton_backward.py``, "TMA variant"), only
    #: (:func:`check_config`: float32, 4-bit weights, bias, FP8 weights of the dgrad are refused, naming the
    #: field); every block <= :data:`TMA_MAX_BLOCK`. False (default) keeps the pointer kernel.
    tma: bool = False
    #: ``tl.range(0, K, block_k, warp_specialize=True)`` on the TMA variant's K loop (Triton's automatic warp
    #: specialization: a producer partition issuing the TMA loads, consumers running the MMAs). Documented
    #: "Blackwell only" in Triton 3.6, yet its sm_90 pipeline runs ``add_hopper_warpspec``: to be measured.
    #: Compiled for sm_90 on the CPU: 4 warps fail in the compiler (refused), 8 warps give PTX identical to
    #: ``warp_specialize=False`` (no producer partition, no ``setmaxnreg``): a no-op (on the H200 the tuner's
    #: winners have it on for gate_up and off for down, within run-to-run noise of each other).
    #: Rules: a bool; needs ``tma=True`` and ``num_warps >= 8``. False (default) leaves the loop unannotated.
    warp_specialize: bool = False


def _pow2_divisor(n: int) -> int:
    """The largest power of 2 dividing ``n > 0``."""
    return n & -n


def k_step_limit(x_group: int | None, w_block: bool) -> int | None:
    """Largest ``block_k`` allowed by the per-step scales (``None``: no limit).

    ``x_group``: the activations' per-token-group width ``G`` (``None`` without group scales);
    ``w_block``: 128x128 weight-scale blocks. ``block_k`` is a power of 2, so it must divide the
    power-of-2 part of ``G`` and of 128.
    """
    limits = ([_pow2_divisor(x_group)] if x_group else []) + ([W_SCALE_BLOCK] if w_block else [])
    return min(limits) if limits else None


def min_block_k(bits: int, w_format: str | None = None) -> int:
    """Smallest ``block_k``: ``tl.dot``'s minimum K for ``bits``-wide operands, and for 4-bit weights
    (``w_format``) whole scale groups (:data:`W4_MIN_BLOCK_K`)."""
    return max(MIN_BLOCK_K[bits], W4_MIN_BLOCK_K if w_format else 0)


def check_config(op: str, cfg: GroupedGemmConfig, bits: int, x_group: int | None, w_block: bool,
                 w_format: str | None = None, *, bias: bool = False, forward: bool = True,
                 w_fp8: bool = False) -> None:
    """``ValueError`` if ``cfg`` breaks the rules of :class:`GroupedGemmConfig` for this problem
    (``w_format``: ``"mxfp4"`` / ``"int4"`` for 4-bit weights, whose K steps cover whole groups of 32);
    ``NotImplementedError`` if ``cfg.tma`` / ``cfg.warp_specialize`` (the TMA variant) is asked of a request that
    variant does not serve. Forward (``forward=True``): float32 operands, 4-bit weights, ``bias``; 16-bit and FP8
    (every scale layout) forwards are served. dgrad (``forward=False``, ``triton_backward.py``; ``bits`` is ``d_y``'s
    width): float32 operands and FP8 weights (``w_fp8``: dequantized per element in the kernel, so they keep the
    pointer loads); 16-bit ``d_y`` with 16-bit ``w`` is served."""
    pow2 = all(b > 0 and b & (b - 1) == 0 for b in (cfg.block_m, cfg.block_n, cfg.block_k))
    limit = k_step_limit(x_group, w_block)
    lowest = min_block_k(bits, w_format)
    if type(cfg.group_m) is not int or cfg.group_m < 1 or type(cfg.persistent) is not bool:
        raise ValueError(f"{op}: config must have an int group_m >= 1 and a bool persistent; got {cfg}")
    if type(cfg.tma) is not bool or type(cfg.warp_specialize) is not bool:
        raise ValueError(f"{op}: config must have a bool tma and a bool warp_specialize; got {cfg}")
    if cfg.warp_specialize and not cfg.tma:
        raise ValueError(f"{op}: config warp_specialize=True needs tma=True (it annotates the TMA variant's K loop); "
                         f"got {cfg}")
    if cfg.tma:
        field = "tma=True" + (" (and warp_specialize=True)" if cfg.warp_specialize else "")
        if forward:
            refused = (f"{w_format} 4-bit weights" if w_format
                       else "float32 operands" if bits == 32
                       else "a bias" if bias else None)
            if refused:
                raise NotImplementedError(f"{op}: config {field} serves 16-bit (bf16 / fp16) and FP8 forwards without "
                                          f"bias only; got {refused}")
        else:
            refused = ("float32 operands" if bits == 32
                       else "FP8 weights (dequantized per element: the pointer kernel)" if w_fp8 else None)
            if refused:
                raise NotImplementedError(f"{op}: config {field} serves the dgrad of 16-bit (bf16 / fp16) d_y and w "
                                          f"only; got {refused}")
        if cfg.warp_specialize and cfg.num_warps < 8:
            raise NotImplementedError(f"{op}: config warp_specialize=True needs num_warps >= 8: with 4 warps triton 3.6's "
                                      f"sm_90 pass NVGPUWarpSpecialization fails to compile the kernel; got {cfg}")
        if max(cfg.block_m, cfg.block_n, cfg.block_k) > TMA_MAX_BLOCK:
            raise ValueError(f"{op}: config tma=True needs every block <= {TMA_MAX_BLOCK} (a TMA box's side); got {cfg}")
    if not pow2 or cfg.block_k < lowest or (limit is not None and limit % cfg.block_k):
        raise ValueError(
            f"{op}: config must have power-of-2 blocks, block_k >= {lowest} (tl.dot on {bits}-bit operands"
            + (f"; whole {w_format} scale groups of {W4_MIN_BLOCK_K}" if w_format else "") + ")"
            + (f" and block_k dividing {limit} (one scale group per K step)" if limit else "")
            + f"; got {cfg}"
        )


def heuristic_grouped_gemm_config(M_cap: int, N: int, K: int, E: int, bits: int, x_group: int | None = None,
                                  w_block: bool = False, w_format: str | None = None) -> GroupedGemmConfig:
    """Heuristic config for ``x [M_cap, K] x w [E, N, K] -> y [M_cap, N]`` with ``bits``-wide inputs
    (``x``'s width; 4-bit weights, ``w_format``, are decoded to it in the kernel, and their K step
    is at least one scale group, :func:`min_block_k`). 4-bit: the tiles of ``x``'s dtype (small ``M_cap``, decode,
    gets 16-row tiles), with 16-bit ``x`` 128-wide K steps: faster than 64 for both MXFP4 and INT4 on gpt-oss-120b's
    decode gate_up (BENCHMARKS.md).

    Raises: NotImplementedError when the scale groups are too narrow for ``tl.dot`` (a K step
    must lie inside one scale group, and ``tl.dot`` needs ``block_k >= MIN_BLOCK_K[bits]``).
    """
    limit = k_step_limit(x_group, w_block)
    block_k = K_STEP_BYTES * 8 // bits
    if limit is not None:
        if limit < MIN_BLOCK_K[bits]:
            raise NotImplementedError(
                f"grouped_gemm: per-token-group scales of width G={x_group} need a K step dividing {limit}, below "
                f"tl.dot's minimum K of {MIN_BLOCK_K[bits]} for {bits}-bit operands"
            )
        block_k = min(block_k, limit)
    if w_format is not None and bits == 16:
        block_k = W4_BLOCK_K  # the packed decode's per-step overhead halves (measured: see the docstring)
    # No wider than K needs (small test and decode shapes), never below tl.dot's minimum (nor a 4-bit group).
    block_k = max(min_block_k(bits, w_format), min(block_k, triton.next_power_of_2(max(K, 1))))
    # Rows per tile from the average rows per expert (M_cap is the only size known without a
    # host sync): each expert adds at most one partly-filled tile, so small experts want small tiles.
    rows_per_expert = math.ceil(max(M_cap, 1) / max(E, 1))
    block_m = max(MIN_BLOCK_M, min(MAX_BLOCK_M, triton.next_power_of_2(rows_per_expert)))
    block_n = max(16, min(MAX_BLOCK_N, triton.next_power_of_2(max(N, 1))))
    # 4 warps: one warpgroup, the unit of a Hopper wgmma. 3 stages: the K loop's loads pipelined
    # through shared memory, 3 x (64 x 128 B + 128 x 128 B) = 72 KiB, well under sm_90's 227 KiB.
    return GroupedGemmConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=4, num_stages=3)


#: The shipped tuned tables: ``tuned/<arch>.json`` (every GPU of the architecture, e.g. ``sm90.json``) and
#: ``tuned/<arch>/<device kind>.json`` (refinements of one device kind); ``moe_contract/selection.py`` says the order.
TUNED_DIR = os.path.join(os.path.dirname(__file__), "tuned")
#: The ``"kernel"`` of a tuned 16-bit forward entry: the warp-specialized Gluon kernel (``gluon_bf16.py``; the entry's
#: ``"gluon_config"`` holds its options) or the Triton one (``triton.py``; the entry's ``"config"``). Entries without
#: ``"kernel"`` mean the Triton kernel.
FORWARD_KERNELS = ("gluon", "triton")
#: The ``"op"`` of a tuned entry: the forward (entries without ``"op"`` are forward ones), the dgrad and the wgrad.
TUNED_OPS = ("fwd", "dgrad", "wgrad")
#: The ``"kernel"`` of a tuned wgrad entry: the Gluon wgrad (``gluon_backward.py``; its ``"config"`` holds
#: ``epilogue`` and ``num_stages``) or the Triton one (``triton_backward.py``; a :class:`GroupedGemmWgradConfig`).
WGRAD_KERNELS = ("gluon", "triton")


def entry_problem(t: dict) -> str | None:
    """Why ``t`` is not a valid torch tuned entry (``None``: it is): ``"op"`` one of :data:`TUNED_OPS`, a string
    ``"dtype"``, a ``"config"`` object that builds the op's config dataclass (a wgrad's Gluon ``"kernel"``: the Gluon
    options), a ``"kernel"`` the op knows. The common keys (``N``, ``K``, ``M_cap``, ``arch``, ``device``) are
    :func:`moe_contract.selection.read_table`'s."""
    op = t.get("op", "fwd")
    if op not in TUNED_OPS:
        return f"op must be one of {TUNED_OPS}; got op={op!r}"
    if not isinstance(t.get("dtype"), str):
        return f"dtype must be a string; got dtype={t.get('dtype')!r}"
    kernels = WGRAD_KERNELS if op == "wgrad" else FORWARD_KERNELS
    kernel = t.get("kernel", "triton")
    if kernel not in kernels:
        return f"kernel must be one of {kernels}; got kernel={kernel!r}"
    fields = t.get("config")
    if not isinstance(fields, dict):
        return f"config must be an object; got config={fields!r}"
    if op == "wgrad" and kernel == "gluon":
        unknown = sorted(set(fields) - {"epilogue", "num_stages"})
        return f"a Gluon wgrad config takes epilogue and num_stages; got unknown keys {unknown}" if unknown else None
    cls = GroupedGemmWgradConfig if op == "wgrad" else GroupedGemmConfig
    try:
        cls(**fields)
    except (TypeError, ValueError) as exc:
        return f"config is not a {cls.__name__} ({exc})"
    return None


@functools.cache
def tuned_tables(device: DeviceSpec | None) -> TunedTables:
    """The tuned tables of ``device`` (the per-user cache, then the shipped files; architecture first, refined by
    device kind: ``moe_contract/selection.py``), read and validated once. No tables for ``None`` (the CPU).
    Raises ValueError naming the file and the entry for a malformed entry."""
    return TunedTables.load(device, TUNED_DIR, "torch", entry_problem)


def nearest_forward_entry(device: DeviceSpec | None, M_cap: int, N: int, K: int, bits: int, w_block: bool = False,
                          w_format: str | None = None) -> dict | None:
    """The forward entry (no ``"op"`` key, or ``"op": "fwd"``) for ``device`` that :func:`grouped_gemm_config` and
    :func:`tuned_forward_kernel` read: the same ``N``, ``K`` and dtype key (``bits``: ``"bf16"`` for 16-bit inputs,
    fp16 included; ``"fp8"``; with 4-bit weights ``"bf16_mxfp4"`` / ``"bf16_int4"``; FP8 with 128 x 128 weight blocks,
    ``w_block``, ``"fp8_block"`` then ``"fp8"``) with the nearest ``M_cap`` in log2 (at equal distance the first key's
    entry, then the first stored), from the most specific table that has one (:class:`TunedTables`); ``None``
    without a device or a match."""
    dtype = {8: "fp8", 16: "bf16"}.get(bits)
    keys = (dtype,)
    if w_format is not None:  # 4-bit weights: their own entries (the bf16 ones tile another kernel)
        keys = (f"{dtype}_{w_format}" if dtype else None,)
    elif dtype == "fp8" and w_block:  # 128 x 128 weight blocks: their own entries, and the per-token ones
        keys = ("fp8_block", "fp8")
    if device is None or None in keys:
        return None
    return tuned_tables(device).nearest(
        lambda t: t.get("op", "fwd") == "fwd" and (t["N"], t["K"]) == (N, K) and t["dtype"] in keys, M_cap,
        rank=lambda t: keys.index(t["dtype"]))


#: The Gluon forward's options a tuned ``"gluon_config"`` may hold (``gluon_bf16.py: grouped_gemm_gluon_bf16``'s
#: keyword arguments; ``num_sms`` is the device's, never tuned).
GLUON_FORWARD_OPTION_KEYS = ("block_n", "num_stages", "epilogue")


def tuned_forward_kernel(device: DeviceSpec | None, M_cap: int, N: int, K: int, bits: int) -> tuple[str, dict] | None:
    """The measured kernel of a 16-bit forward ``x [M_cap, K] @ w [E, N, K] -> y [M_cap, N]`` (bf16 / fp16, no scales,
    no 4-bit weights) from the forward entry :func:`grouped_gemm_config` reads (:func:`nearest_forward_entry`: same
    ``N``, ``K``, the ``"bf16"`` entries, nearest ``M_cap``; the experts are not matched, as there): ``(kernel, options)``
    with ``kernel`` the entry's ``"kernel"`` (:data:`FORWARD_KERNELS`; ``"triton"`` for an entry without one) and
    ``options`` its ``"gluon_config"`` (the fastest Gluon options the tuner timed, stored whatever kernel won) restricted
    to :data:`GLUON_FORWARD_OPTION_KEYS`, unchecked (``{}`` without one). ``None`` for other widths (``bits != 16``),
    without a device spec or an entry: the dispatch's default.

    Read by the dispatch (``triton.py: gluon_bf16_options``) after ``EPMOE_TRITON_GLUON_BF16``: unset, the Gluon
    kernel runs where this says ``"gluon"`` (and ``gluon_bf16.py: forward_eligible`` accepts); ``1`` runs it with
    these options wherever it is eligible; ``0`` never."""
    if bits != 16:
        return None
    entry = nearest_forward_entry(device, M_cap, N, K, bits)
    kernel = None if entry is None else entry.get("kernel", "triton")
    if kernel not in FORWARD_KERNELS:
        return None
    fields = entry.get("gluon_config")
    options = {k: v for k, v in fields.items() if k in GLUON_FORWARD_OPTION_KEYS} if isinstance(fields, dict) else {}
    return kernel, options


def grouped_gemm_config(M_cap: int, N: int, K: int, E: int, bits: int, x_group: int | None = None,
                        w_block: bool = False, device: DeviceSpec | None = None,
                        w_format: str | None = None, bias: bool = False) -> GroupedGemmConfig:
    """The tuned config of ``device`` for the same ``N``, ``K`` and dtype (``bits``; with 4-bit
    weights ``"bf16_mxfp4"`` / ``"bf16_int4"``, none stored yet; FP8 with 128 x 128 weight blocks ``"fp8_block"``
    and the per-token ``"fp8"`` ones, ``fp8_block`` first at equal distance) with the nearest ``M_cap`` (in log2), if
    one is stored and fits this problem's scale layout and ``bias`` (:func:`check_config`: a tuned ``tma``
    entry is skipped for a request with a bias); else :func:`heuristic_grouped_gemm_config`. Forward entries only
    (no ``"op"`` key, or ``"op": "fwd"``; the backward's are :func:`grouped_gemm_dgrad_config`'s and
    :func:`grouped_gemm_wgrad_config`'s). A 16-bit entry's ``"kernel"`` (``"gluon"`` / ``"triton"``) is the dispatch's
    (:func:`tuned_forward_kernel`): its ``"config"`` is always the Triton kernel's."""
    best = nearest_forward_entry(device, M_cap, N, K, bits, w_block, w_format)
    candidates = [GroupedGemmConfig(**best["config"])] if best is not None else []  # absent keys: the defaults
    if device is not None and device.is_hopper:  # measured on sm_90 only
        candidates.append(hopper_wide_config(M_cap, N, K, E, bits))
    for cfg in candidates:
        if cfg is None:
            continue
        try:
            check_config("grouped_gemm", cfg, bits, x_group, w_block, w_format, bias=bias)
            return cfg
        except (ValueError, NotImplementedError):
            pass  # tuned for other scale layouts (or a TMA entry, a request with bias): the heuristic knows the rules
    return heuristic_grouped_gemm_config(M_cap, N, K, E, bits, x_group, w_block, w_format)


#: Rows (``M_cap``) and rows per expert from which :func:`hopper_wide_config` applies: the sizes whose tuned sm90
#: entries are all 128-row TMA tiles over 8 warps (BENCHMARKS.md); below them the smaller heuristic tiles waste less.
HOPPER_WIDE_MIN_ROWS = 8192
HOPPER_WIDE_MIN_ROWS_PER_EXPERT = 128


def hopper_wide_config(M_cap: int, N: int, K: int, E: int, bits: int) -> GroupedGemmConfig | None:
    """The sm90 heuristic of a large forward where no table has an entry: what the tuned sm90 entries of the
    benchmark's shapes have in common (two wgmma warpgroups on 128-row TMA tiles, grouped launch order), so that a
    GPU or shape without a table is not left on the 4-warp tiles of :func:`heuristic_grouped_gemm_config`. 16-bit:
    128 x 256 x 64, 3 stages; FP8: 128 x 128 x 128, 4 stages, persistent. ``None`` below
    :data:`HOPPER_WIDE_MIN_ROWS` rows or :data:`HOPPER_WIDE_MIN_ROWS_PER_EXPERT` a expert, for narrow ``N`` or
    ``K``, and for other widths (the caller's :func:`check_config` refuses it for bias, 4-bit weights or scale
    groups it cannot step)."""
    if M_cap < HOPPER_WIDE_MIN_ROWS or M_cap < HOPPER_WIDE_MIN_ROWS_PER_EXPERT * max(E, 1) or min(N, K) < 256:
        return None
    if bits == 16:
        return GroupedGemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, group_m=8,
                                 tma=True)
    if bits == 8:
        return GroupedGemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4, group_m=8,
                                 persistent=True, tma=True)
    return None


# --------------------------------------------------------------------------------------
# Backward (CONTRACT.md section 8; kernels in ``triton_backward.py``)


def heuristic_grouped_gemm_dgrad_config(M_cap: int, N: int, K: int, E: int, bits: int,
                                        w_block: bool = False) -> GroupedGemmConfig:
    """Heuristic config of the dgrad ``d_y [M_cap, N] x w [E, N, K] -> d_x [M_cap, K]``.

    dgrad is the forward's row-grouped GEMM with the roles of N and K swapped, so it takes the
    forward's :class:`GroupedGemmConfig` and heuristic: ``block_n`` tiles ``d_x``'s K columns and
    ``block_k`` steps over N (the reduction). ``bits``: ``d_y``'s element width (FP8 ``w`` is
    dequantized to ``d_y``'s dtype inside the kernel, so ``tl.dot`` sees 16- or 32-bit operands);
    ``w_block``: 128x128 weight-scale blocks, so that one reduction step lies in one block along N
    (the same rule as the forward's K step, :func:`check_config`).

    bf16 / float16 at ``M_cap >= DGRAD_WIDE_MIN_ROWS``: 128 x 256 tiles over 8 warps, 3 stages, ``group_m=8``
    (:data:`DGRAD_WIDE_CONFIG`). Why: the forward heuristic's 4-warp 64 x 128 tiles left the dgrad DRAM-bound (ncu);
    the wide tiles were much faster on both of the layer's shapes (``benchmarks/profile_bwd.py --dgrad-configs``;
    BENCHMARKS.md).
    """
    if bits == 16 and M_cap >= DGRAD_WIDE_MIN_ROWS:
        return DGRAD_WIDE_CONFIG
    return heuristic_grouped_gemm_config(M_cap, K, N, E, bits, None, w_block)


#: Rows (``M_cap``) from which :func:`grouped_gemm_dgrad_config` runs 16-bit dgrads on sm_90 through the TMA variant
#: (``EPMOE_TRITON_TMA_DGRAD``, on by default; 0 keeps the pointer loads) where no tuned entry serves: measured
#: faster than the pointer loads at large M with the heuristic's tiles (BENCHMARKS.md).
DGRAD_TMA_MIN_ROWS = 4096
#: ... on wgmma-sized row tiles only (the heuristic's ``block_m`` at least one warpgroup's 64 rows): the 16- and
#: 32-row tiles of many small experts run ``mma.sync``, where TMA was never measured.
DGRAD_TMA_MIN_BLOCK_M = 64


#: ``"dtype"`` / ``"out_dtype"`` keys of the backward entries by element width (16-bit floats share bf16's).
_BWD_DTYPE_KEYS = {16: "bf16", 32: "f32"}


#: The backward's tuned entries serve ``M_cap`` within this factor of theirs (tuned at M=16384 / 2048: the heuristics
#: keep the small problems, e.g. a 256-row step).
BACKWARD_TUNED_MAX_RATIO = 4


def nearest_backward_entry(op: str, device: DeviceSpec | None, M_cap: int, N: int, K: int, bits: int,
                           out_bits: int | None = None) -> dict | None:
    """The tuned entry of ``device`` with ``"op": op`` (``"dgrad"`` or ``"wgrad"``, written by
    ``benchmarks/tune_triton_gemm.py --ops``) for the same ``N``, ``K`` (the forward's names: ``w [E, N, K]``), input
    dtype (``bits``: ``"bf16"`` for 16-bit; no float32 entries are tuned) and, unless ``out_bits`` is ``None``,
    ``"out_dtype"``, with the nearest ``M_cap`` in log2 within a factor :data:`BACKWARD_TUNED_MAX_RATIO` (ties: the
    first stored), as the forward's
    :func:`grouped_gemm_config`; ``None`` without a device spec or a match. The whole entry (its ``"config"`` and, for
    the dgrad, ``"pointer_config"``; for the wgrad ``"kernel"`` and ``"triton_config"``)."""
    dtype = _BWD_DTYPE_KEYS.get(bits)
    if device is None or dtype is None:
        return None
    out = None if out_bits is None else _BWD_DTYPE_KEYS.get(out_bits, "")
    return tuned_tables(device).nearest(
        lambda t: (t.get("op", "fwd") == op and (t["N"], t["K"]) == (N, K) and t["dtype"] == dtype
                   and (out is None or t.get("out_dtype") == out)), M_cap, max_ratio=BACKWARD_TUNED_MAX_RATIO)


def _tuned(cls, fields) -> object | None:
    """``cls(**fields)``, ``None`` for no fields or fields the dataclass refuses (a tuned entry of another version)."""
    if not isinstance(fields, dict):
        return None
    try:
        return cls(**fields)
    except (TypeError, ValueError):
        return None


def grouped_gemm_dgrad_config(M_cap: int, N: int, K: int, E: int, bits: int, w_block: bool = False, *,
                              w_fp8: bool = False, sm90: bool = False, tma: bool = True,
                              device: DeviceSpec | None = None, out_bits: int | None = None) -> GroupedGemmConfig:
    """The default config of the dgrad ``d_y [M_cap, N] x w [E, N, K] -> d_x [M_cap, K]`` (``out_bits``: ``d_x``'s
    element width; ``None`` matches a tuned entry of any).

    Lookup order: (1) the tuned entry of ``device`` with ``"op": "dgrad"`` (``benchmarks/tune_triton_gemm.py
    --ops dgrad``; :func:`nearest_backward_entry`: nearest ``M_cap``, same ``N``, ``K``, dtype and out dtype), not for
    FP8 weights (``w_fp8``: another kernel path): its ``"config"`` (the fastest timed) if it keeps
    :func:`check_config` and, where it has ``tma=True``, the TMA switch allows it (``tma``: ``EPMOE_TRITON_TMA_DGRAD``,
    off by default, and ``sm90``), else its ``"pointer_config"`` (the fastest with ``tma=False``, stored where the
    winner is a TMA config) if that keeps the rules; (2) else the heuristic:
    :func:`heuristic_grouped_gemm_dgrad_config`, with ``tma=True`` (the TMA variant of the same tiles and launch
    order: ``d_y`` and ``w`` tiles through tensor descriptors, ``triton_backward.py``) where ``tma`` (the switch,
    read by the caller at each launch), ``sm90`` (a device of compute capability 9.0),
    16-bit ``d_y`` (``bits``), 16-bit weights (not ``w_fp8``), ``M_cap >=`` :data:`DGRAD_TMA_MIN_ROWS` and the tile's
    ``block_m >=`` :data:`DGRAD_TMA_MIN_BLOCK_M`. The TMA tiles at ``M_cap >= DGRAD_WIDE_MIN_ROWS`` are
    :data:`DGRAD_WIDE_CONFIG`'s 128 x 256 over 8 warps, the shape of the forward's tuned TMA entries at M=16384
    (``tuned/sm90.json``). A request the descriptors cannot address (``N % block_k``, alignment) runs the
    pointer kernel with the same tiles (``triton_backward.py: _launch_dgrad``), a tuned TMA default too. An explicit
    ``config`` of the kernel bypasses this function."""
    entry = None if w_fp8 else nearest_backward_entry("dgrad", device, M_cap, N, K, bits, out_bits)
    if entry is not None:
        for key in ("config", "pointer_config"):
            cfg = _tuned(GroupedGemmConfig, entry.get(key))
            if cfg is None or (cfg.tma and not (tma and sm90)):
                continue  # a TMA config while the switch (or the device) keeps the pointer loads
            try:
                check_config("grouped_gemm_dgrad", cfg, bits, None, w_block, forward=False, w_fp8=w_fp8)
            except (ValueError, NotImplementedError):
                continue  # breaks a rule of this request (128 x 128 weight blocks): the next, or the heuristic
            return cfg
    cfg = heuristic_grouped_gemm_dgrad_config(M_cap, N, K, E, bits, w_block)
    if (tma and sm90 and bits == 16 and not w_fp8 and M_cap >= DGRAD_TMA_MIN_ROWS
            and cfg.block_m >= DGRAD_TMA_MIN_BLOCK_M):
        return dataclasses.replace(cfg, tma=True)
    return cfg


#: dgrad's wide tiles (see :func:`heuristic_grouped_gemm_dgrad_config`): 128 rows x 256 columns of d_x per
#: program (two 64-row wgmma warpgroups), N stepped by 64 (inside one 128-wide weight-scale block), 3 stages
#: (3 x (128x64 + 64x256) x 2 B = 144 KB of shared memory), group_m=8 for L2 reuse of an expert's weights.
DGRAD_WIDE_CONFIG = GroupedGemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, group_m=8)
#: Rows from which the wide tiles pay (measured at 16384; below, the forward heuristic's smaller tiles keep
#: more programs per SM).
DGRAD_WIDE_MIN_ROWS = 8192


#: d_w tile rows (N): 64 is one warpgroup's wgmma M, as the forward's MAX_BLOCK_M.
MAX_WGRAD_BLOCK_N = 64
#: d_w tile columns (K): 64 x 128 float32 accumulator over 4 warps is 64 registers per thread, the
#: forward's largest tile (MAX_BLOCK_N), no spilling.
MAX_WGRAD_BLOCK_K = 128
#: Smallest d_w tile side: tl.dot pads M and N, but tiles below 16 waste the tensor core's m16n8k16.
MIN_WGRAD_BLOCK = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedGemmWgradConfig:
    """The wgrad ``d_w[e] = d_y[rows(e)].T @ x[rows(e)]`` (a K-grouped GEMM: the contraction runs
    over each expert's rows): one program per expert and ``block_n x block_k`` tile of ``d_w[e]``
    (``[E, N, K]``), looping over that expert's rows ``block_m`` at a time.

    Rules (:func:`check_wgrad_config`): all three blocks powers of 2; ``block_m`` (the ``tl.dot``
    reduction) at least ``MIN_BLOCK_K[bits]`` (16 for 16- and 32-bit operands)."""

    block_n: int
    block_k: int
    block_m: int
    num_warps: int
    num_stages: int


def check_wgrad_config(op: str, cfg: GroupedGemmWgradConfig, bits: int) -> None:
    """``ValueError`` if ``cfg`` breaks the rules of :class:`GroupedGemmWgradConfig`."""
    blocks = (cfg.block_n, cfg.block_k, cfg.block_m)
    pow2 = all(type(b) is int and b > 0 and b & (b - 1) == 0 for b in blocks)
    if not pow2 or cfg.block_m < MIN_BLOCK_K[bits]:
        raise ValueError(f"{op}: config must have power-of-2 blocks and block_m >= {MIN_BLOCK_K[bits]} (the tl.dot "
                         f"reduction runs over rows, {bits}-bit operands); got {cfg}")


#: wgrad's wide tiles (see :func:`heuristic_grouped_gemm_wgrad_config`): a 128 x 256 tile of d_w[e] per
#: program over 8 warps (two wgmma warpgroups), 64 rows a step, 3 stages (3 x 64 x (128 + 256) x 2 B = 144 KiB).
WGRAD_WIDE_CONFIG = GroupedGemmWgradConfig(block_n=128, block_k=256, block_m=64, num_warps=8, num_stages=3)
#: Rows from which the wide tiles pay (measured at 16384, as the dgrad's).
WGRAD_WIDE_MIN_ROWS = 8192


def heuristic_grouped_gemm_wgrad_config(M_cap: int, N: int, K: int, E: int, bits: int) -> GroupedGemmWgradConfig:
    """Heuristic config of the wgrad ``x [M_cap, K], d_y [M_cap, N] -> d_w [E, N, K]`` with ``bits``-wide
    inputs (16 or 32).

    bf16 / float16 at ``M_cap >= WGRAD_WIDE_MIN_ROWS`` with ``N >= 128``, ``K >= 256`` and at least 64
    rows per expert on average: :data:`WGRAD_WIDE_CONFIG`, the fastest of the tiles compared on both of the layer's
    shapes (``benchmarks/profile_bwd.py --wgrad-configs``: 128 x 128 over 4 or 8 warps and 256 x 128 no better,
    64 x 256 worse; BENCHMARKS.md)."""
    if bits == 16 and M_cap >= WGRAD_WIDE_MIN_ROWS and N >= 128 and K >= 256 and M_cap >= 64 * max(E, 1):
        return WGRAD_WIDE_CONFIG
    block_n = max(MIN_WGRAD_BLOCK, min(MAX_WGRAD_BLOCK_N, triton.next_power_of_2(max(N, 1))))
    block_k = max(MIN_WGRAD_BLOCK, min(MAX_WGRAD_BLOCK_K, triton.next_power_of_2(max(K, 1))))
    # Rows per step: K_STEP_BYTES * 8 / bits (64 bf16, 32 float32 rows), so that one pipeline stage holds
    # (block_n + block_k) x 128 B, as the forward's; fewer for small experts (the average rows per expert
    # is the only size known without a host sync), never below tl.dot's minimum reduction.
    rows_per_expert = math.ceil(max(M_cap, 1) / max(E, 1))
    block_m = max(MIN_BLOCK_K[bits], min(K_STEP_BYTES * 8 // bits, triton.next_power_of_2(rows_per_expert)))
    # 4 warps: one warpgroup (wgmma). 3 stages: 3 x (64 + 128) x 128 B = 72 KiB of shared memory, as the forward.
    return GroupedGemmWgradConfig(block_n=block_n, block_k=block_k, block_m=block_m, num_warps=4, num_stages=3)


def grouped_gemm_wgrad_config(M_cap: int, N: int, K: int, E: int, bits: int, *, out_bits: int | None = None,
                              device: DeviceSpec | None = None) -> GroupedGemmWgradConfig:
    """The default config of the Triton wgrad ``x [M_cap, K], d_y [M_cap, N] -> d_w [E, N, K]`` (``out_bits``:
    ``d_w``'s element width; ``None`` matches a tuned entry of any).

    Lookup order: (1) the tuned entry of ``device`` with ``"op": "wgrad"`` (``benchmarks/tune_triton_gemm.py
    --ops wgrad``; :func:`nearest_backward_entry`): its ``"config"`` where its ``"kernel"`` is ``"triton"``, else its
    ``"triton_config"`` (the fastest Triton config, stored where the Gluon wgrad won: the Triton kernel serves what the
    Gluon one does not, or ``EPMOE_TRITON_GLUON_WGRAD=0``), if it keeps :func:`check_wgrad_config`; (2) else
    :func:`heuristic_grouped_gemm_wgrad_config`. Whether the Gluon kernel runs instead is the dispatch's choice
    (``api.py: _gluon_wgrad``, :func:`tuned_wgrad_kernel`). An explicit ``config`` of the kernel bypasses this."""
    entry = nearest_backward_entry("wgrad", device, M_cap, N, K, bits, out_bits)
    if entry is not None:
        fields = entry.get("config") if entry.get("kernel", "triton") == "triton" else entry.get("triton_config")
        cfg = _tuned(GroupedGemmWgradConfig, fields)
        if cfg is not None:
            try:
                check_wgrad_config("grouped_gemm_wgrad", cfg, bits)
                return cfg
            except ValueError:
                pass  # the heuristic knows the rules
    return heuristic_grouped_gemm_wgrad_config(M_cap, N, K, E, bits)


def tuned_wgrad_kernel(M_cap: int, N: int, K: int, bits: int, out_bits: int | None,
                       device: DeviceSpec | None) -> tuple[str, dict] | None:
    """The measured kernel of a wgrad the dispatch may run on either kernel (``api.py: _gluon_wgrad``, after its
    switch and eligibility): ``("gluon", {"epilogue": ..., "num_stages": ...})`` (the Gluon wgrad's options as the
    tuned entry's ``"config"`` holds them, unchecked: ``gluon_backward.py: gluon_wgrad_options_problem``) or
    ``("triton", {})`` from the ``"op": "wgrad"`` entry of :func:`nearest_backward_entry`; ``None`` without an entry
    (or with an unknown ``"kernel"``): the dispatch's default."""
    entry = nearest_backward_entry("wgrad", device, M_cap, N, K, bits, out_bits)
    kernel = None if entry is None else entry.get("kernel", "triton")
    if kernel == "triton":
        return "triton", {}
    if kernel == "gluon" and isinstance(entry.get("config"), dict):
        return "gluon", {k: v for k, v in entry["config"].items() if k in ("epilogue", "num_stages")}
    return None


# --------------------------------------------------------------------------------------
# Bias gradient ``d_bias[e] = sum of d_y[rows(e)]`` (CONTRACT.md section 8; kernel in ``triton_backward.py``)

#: Columns of ``d_bias`` per program, at most: a 32 x 256 float32 partial-sum tile is 64 registers a
#: thread over 4 warps, and 256 bf16 values are 512 contiguous bytes of a ``d_y`` row per load.
MAX_DBIAS_BLOCK_N = 256
#: Rows of ``d_y`` per step, at most (the tile above); fewer for small experts (decode).
MAX_DBIAS_BLOCK_M = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedGemmDbiasConfig:
    """The bias gradient (a segment sum over each expert's rows): one program per expert and ``block_n``
    columns of ``d_bias [E, N]``, walking that expert's rows ``block_m`` at a time into a float32
    ``[block_m, block_n]`` partial-sum tile that is reduced over its rows once at the end.

    Rules (:func:`check_dbias_config`): ``block_m``, ``block_n`` and ``num_warps`` powers of 2 (Triton
    blocks; no ``tl.dot``, so no tensor-core minimum); ``num_stages`` an int >= 1."""

    block_m: int
    block_n: int
    num_warps: int = 4
    #: ``d_y`` loads of the row loop in flight (software pipelining), as the wgrad's 3.
    num_stages: int = 3


def check_dbias_config(op: str, cfg: GroupedGemmDbiasConfig) -> None:
    """``ValueError`` if ``cfg`` breaks the rules of :class:`GroupedGemmDbiasConfig`."""
    values = (cfg.block_m, cfg.block_n, cfg.num_warps)
    ok = all(type(v) is int and v > 0 and v & (v - 1) == 0 for v in values)
    if not ok or type(cfg.num_stages) is not int or cfg.num_stages < 1:
        raise ValueError(f"{op}: config must have power-of-2 block_m, block_n and num_warps and num_stages >= 1; "
                         f"got {cfg}")


def heuristic_grouped_gemm_dbias_config(M_cap: int, N: int, E: int) -> GroupedGemmDbiasConfig:
    """``d_y [M_cap, N]`` -> ``d_bias [E, N]``: ``block_n`` up to :data:`MAX_DBIAS_BLOCK_N` columns, ``block_m`` the
    average rows per expert (the only size known without a host sync) rounded up to a power of 2, at
    most :data:`MAX_DBIAS_BLOCK_M`. Memory-bound (each ``d_y`` element is read once); untuned."""
    rows_per_expert = math.ceil(max(M_cap, 1) / max(E, 1))
    block_m = min(MAX_DBIAS_BLOCK_M, triton.next_power_of_2(rows_per_expert))
    block_n = max(16, min(MAX_DBIAS_BLOCK_N, triton.next_power_of_2(max(N, 1))))
    return GroupedGemmDbiasConfig(block_m=block_m, block_n=block_n, num_warps=4)
