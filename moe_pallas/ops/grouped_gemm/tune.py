"""Tune the JAX grouped GEMMs' launch configs (forward; Mosaic dgrad / wgrad) on this GPU: ``epmoe tune``'s tuner.

``epmoe tune --framework jax`` (``interop/cli.py``) calls :func:`tune` on the GEMMs of a preset or checkpoint
(``moe_contract.tuning``) and writes the entries, merged into the user's table of this device, to
``<user cache>/tuned/jax/<arch>/<device kind>.json`` (``moe_contract.tuning.write_tuned_table``), where the lookups of
``config.py`` read them. The module's own command line times the benchmark's problems with every option (the
benchmarks' ``tune_jax_gemm.py`` runs it)::

    python -m moe_pallas.ops.grouped_gemm.tune [--out DIR] [--backends pallas_triton,pallas_mosaic_gpu]
        [--quick] [--max-minutes 8] [--dtypes bf16,fp8,fp8_block] [--ms 256,2048,16384] [--resume] [--jobs 8]
        [--fast-accum both|false|true] [--ops fwd,dgrad,wgrad]

Every entry written names the architecture (``"arch": "sm90"``) and device kind (``"device"``) it was measured on.

``--out DIR`` defaults to ``$OUT`` if set, else the user cache's table of this device (as ``epmoe tune``). The
file is ``DIR/<arch>/<device kind>.json`` (the kind with spaces as ``_``, e.g. ``sm90/NVIDIA_H200.json``); one entry
per (backend, problem, FP8 accumulation mode)::

    {"backend": "pallas_mosaic_gpu", "device": "NVIDIA H200", "E": 32, "N": 4096, "K": 7168, "M_cap": 2048,
     "dtype": "fp8", "fast_accum": false, "config": {...every field...}, "ms": 0.26, "heuristic_ms": 0.27,
     "configs_timed": 9, "complete": true}

``fast_accum`` is ``null`` for bf16 and for Pallas-Triton. ``--ops`` (default ``fwd``: the forward, as above; entries
without ``"op"``) also or instead tunes the Mosaic GPU backward kernels (``pallas_mosaic_gpu_backward.py``; bf16
only, the only inputs they take; the Pallas-Triton backward keeps its heuristics): ``dgrad`` (``d_x = d_y @ w[e]``,
candidates :data:`MOSAIC_DGRAD_SPACE`: the warp-specialized tile, its ``split_m`` variant and snake widths
``grid_block_n``, the one-warpgroup tiles) and ``wgrad`` (the K-grouped ``d_w[e] = d_y[rows(e)].T @ x[rows(e)]``,
:data:`MOSAIC_WGRAD_SPACE`: warp-specialized or not, stages, snakes), each timed against the kernel's heuristic,
bf16 outputs (the layer's backward: ``d_x`` in ``x``'s dtype, ``d_w`` in ``w``'s); entries with ``"op": "dgrad"`` /
``"wgrad"`` and ``"out_dtype": "bf16"``, ``N`` and ``K`` the forward's (``w [E, N, K]``), read by
``config.mosaic_dgrad_config`` / ``mosaic_wgrad_config``::

    {"op": "dgrad", "backend": "pallas_mosaic_gpu", "device": "NVIDIA H200", "E": 32, "N": 7168, "K": 2048,
     "M_cap": 16384, "dtype": "bf16", "out_dtype": "bf16", "fast_accum": null, "config": {...}, "ms": 0.99,
     "heuristic_ms": 1.08, "configs_timed": 9, "complete": true}

Entries with a ``"kind"`` (the backend choices of
``tune_backend.py``) are kept as they are. ``complete`` is false when ``--max-minutes``
ran out inside that sweep (the entry is the best of what was timed, never slower than the heuristic
it was timed against). Entries already in the output file (or in ``--merge``) are kept unless this
run tunes the same key again (a new output file starts empty, or from the ``--merge`` table); ``--resume`` skips
keys that already have a complete entry, so a sweep can be split over several commands. The stored table is read as
the lookups read it (``selection.read_table``): a malformed entry, one of another device, or a file of moe_torch's
tuner (same file name, entries without ``"backend"``) stops the run before anything is measured.
(``--resume``, ``--merge``, ``--ws-only``, ``--jobs`` are the command line's; :func:`tune` takes the rest.)

Problems (the command line's; :func:`tune` takes any layer's): the benchmark's grouped GEMM set (E=32; (K=7168, N=4096) and (K=2048, N=7168); M in
{256, 2048, 16384} (``--quick``: 256 and 16384); rows split uniformly; bf16, FP8 per-token
activation x per-channel weight scales (``fp8``), and FP8 with DeepSeek-V3's 1 x 128 activation groups x
128 x 128 weight blocks (``fp8_block``: Pallas-Triton ``block_n`` dividing 128, Mosaic GPU 64 x 128 tiles)), bf16
output. Search space: :data:`TRITON_SPACE`
(minus tiles whose float32 accumulator exceeds :data:`MAX_ACC_REGS` registers a thread; then the grouped
launch orders :data:`GROUP_MS` of the :data:`TOP_K` fastest) and
:data:`MOSAIC_SPACE` (FP8 with promoted accumulation: 64 x 128 tiles only, the per-step path's
register rule, plus the warp-specialized two-K-block step and ``split_m`` variants; FP8 with ``fast_accum``: every
tile; ``--ws-only``: the warp-specialized configs with planar snakes 2 / 4 wide, a short sweep).

Each config: compiled ahead of time (``--jobs`` XLA compiles in parallel threads; lowering stays on
the main thread), checked against ``grouped_gemm_reference`` computed under
``jax.default_matmul_precision("highest")`` (relative Frobenius error of the bf16 output <= 1e-2,
else WRONG and never chosen), then timed with ``jax.experimental.mosaic.gpu.profiler.measure``
(CUPTI, sum of the executable's kernels, median of 10 iterations). A config that fails to lower or
compile (NotImplementedError, shared memory, ...) is skipped with its reason. The JSON is rewritten
after every sweep, so a run cut short keeps what it found. A short table is printed last.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import moe_pallas
from moe_contract import selection
from moe_contract.tuning import (DTYPES, OPS, Deadline, GemmShape, group_sizes, merge_entries, parse_dtypes,
                                 parse_ms, parse_ops, parse_routings, stamp, tuned_table_path)
from moe_pallas.ops.device import spec_of
from moe_pallas.ops.grouped_gemm.config import (
    entry_problem,
    MOSAIC_BACKEND,
    TRITON_BACKEND,
    GroupedGemmConfig,
    MosaicGroupedGemmConfig,
    grouped_gemm_config,
    heuristic_grouped_gemm_config,
    heuristic_mosaic_grouped_gemm_config,
    heuristic_mosaic_wgrad_config,
    mosaic_config_problem,
    mosaic_grouped_gemm_config,
    mosaic_wgrad_config_problem,
)
from moe_pallas.ops.grouped_gemm.reference import grouped_gemm_reference

#: The command line's problems: experts (DeepSeek-V3's 256 over EP = 8), (K, N) of the benchmark's gate_up and down, M.
E = 32
SHAPES = ((7168, 4096), (2048, 7168))
MS = (256, 2048, 16384)
BACKENDS = (TRITON_BACKEND, MOSAIC_BACKEND)
#: Pallas-Triton: block_k is fixed by the dtype (64 bf16, 128 fp8: 128-byte K rows).
TRITON_SPACE = {"block_m": (32, 64, 128), "block_n": (64, 128, 256), "num_warps": (4, 8), "num_stages": (3, 4)}
#: Pallas-Triton's second pass: these launch orders (``group_m``) of the TOP_K fastest tiles of the first.
GROUP_MS = (4, 8)
TOP_K = 3
#: Float32 accumulator registers a thread, at most: ``block_m * block_n / (32 * num_warps)``. 128 x 256
#: over 4 warps is 256 a thread (spills); everything else in TRITON_SPACE is <= 128.
MAX_ACC_REGS = 128
#: Pallas Mosaic GPU: block_k fixed by the dtype (64 bf16, 128 fp8; FP8 with per-step accumulation in the
#: warp-specialized schedule also 256 = two K blocks a step, 2 stages, and the consumers splitting the CTA tile's
#: rows, ``split_m``: :func:`mosaic_candidates`; ``--ws-only`` keeps the warp-specialized configs alone).
MOSAIC_SPACE = {"block_m": (64, 128), "block_n": (128, 256), "max_concurrent_steps": (3, 4, 5), "grid_block_n": (1, 2, 4),
                "warp_specialized": (False, True)}
_WS = dict(block_k=64, warp_specialized=True)  # 16-bit: 64-value (128-byte) steps
#: The Mosaic GPU dgrad's candidates for bf16 (the config of the swapped problem: ``block_n`` tiles d_x's K columns,
#: ``block_k`` steps over N; every one with whole tiles at both tuned shapes), the likeliest first (a run cut short
#: by ``--max-minutes`` keeps those). The heuristic's tile at >= 256 rows per expert (warp-specialized, consumers
#: side by side: a 128 x 256 CTA tile) with another snake width; its ``split_m`` variant (256 x 128 CTA tile; a probe
#: found it faster on down, within the spread: BENCHMARKS.md) and the 64-row split ones (128 x 128, 128 x 256 CTA tiles);
#: the one-warpgroup tiles (the heuristic's below 256 rows per expert).
MOSAIC_DGRAD_SPACE = (
    dict(block_m=128, block_n=128, max_concurrent_steps=3, grid_block_n=4, split_m=True, **_WS),
    dict(block_m=128, block_n=128, max_concurrent_steps=3, grid_block_n=2, split_m=True, **_WS),
    dict(block_m=128, block_n=128, max_concurrent_steps=3, grid_block_n=4, **_WS),
    dict(block_m=128, block_n=128, max_concurrent_steps=3, grid_block_n=2, **_WS),
    dict(block_m=64, block_n=128, max_concurrent_steps=5, grid_block_n=4, split_m=True, **_WS),
    dict(block_m=64, block_n=256, max_concurrent_steps=3, grid_block_n=4, split_m=True, **_WS),
    dict(block_m=64, block_n=256, block_k=64, max_concurrent_steps=5, grid_block_n=4),
    dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=5, grid_block_n=4),
)
#: The Mosaic GPU wgrad's candidates for bf16 (``block_m`` rows of d_w[e] along N, ``block_n`` columns along K,
#: ``block_k`` rows of the expert a step), the likeliest first: the heuristic's warp-specialized tile (two consumers'
#: 128 x 128 side by side; 3 stages fit beside bf16 output buffers) with another snake and 2 stages, the 64-row one
#: (4 stages fit), and the one-warpgroup kernel (4 and 3 stages).
MOSAIC_WGRAD_SPACE = (
    dict(block_m=128, block_n=128, max_concurrent_steps=3, grid_block_n=4, **_WS),
    dict(block_m=128, block_n=128, max_concurrent_steps=3, grid_block_n=2, **_WS),
    dict(block_m=128, block_n=128, max_concurrent_steps=2, grid_block_n=4, **_WS),
    dict(block_m=64, block_n=128, max_concurrent_steps=4, grid_block_n=4, **_WS),
    dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=4),
    dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=3, grid_block_n=4),
)
#: Relative Frobenius error of the bf16 output against the float32 reference above which a config is WRONG.
MAX_REL_ERR = 1e-2
ITERATIONS = 10


def triton_candidates(dtype: str) -> list[GroupedGemmConfig]:
    block_k = 64 if dtype == "bf16" else 128
    keys = tuple(TRITON_SPACE)
    out = []
    for values in itertools.product(*TRITON_SPACE.values()):
        kw = dict(zip(keys, values))
        if kw["block_m"] * kw["block_n"] // (32 * kw["num_warps"]) > MAX_ACC_REGS:
            continue
        if dtype == "fp8_block" and 128 % kw["block_n"]:
            continue  # 128 x 128 weight blocks: block_n divides 128 (triton_config_problem)
        out.append(GroupedGemmConfig(block_k=block_k, **kw))
    return out


def mosaic_candidates(dtype: str, fast_accum: bool | None, ws_only: bool = False) -> list[MosaicGroupedGemmConfig]:
    """The Mosaic GPU configs of :data:`MOSAIC_SPACE` that the kernel takes for ``dtype``; FP8 with per-step
    promotion also gets the warp-specialized two-K-block step (``block_k = 256``, 2 stages) and the consumers splitting
    the CTA tile's rows (``split_m``: 128 x 128 CTA tiles; 6 stages of 128 or 2 / 3 of 256 fit). ``ws_only``: the
    warp-specialized configs alone, planar snakes 2 / 4 wide (a short sweep where the rest is known to lose: >= 256
    rows per expert)."""
    block_k = 64 if dtype == "bf16" else 128
    keys = tuple(MOSAIC_SPACE)
    out = []
    for values in itertools.product(*MOSAIC_SPACE.values()):
        kw = dict(zip(keys, values))
        if ws_only and (not kw["warp_specialized"] or kw["grid_block_n"] == 1):
            continue
        if dtype != "bf16" and not fast_accum and kw["block_m"] * kw["block_n"] > 64 * 128:
            continue  # per-step accumulation: two float32 tiles in one warpgroup's registers
        if dtype == "fp8_block" and kw["block_n"] != 128:
            continue  # per-step scales: one 128 x 128 weight block a tile and K step (mosaic_config_problem)
        out.append(MosaicGroupedGemmConfig(block_k=block_k, fast_accum=bool(fast_accum), **kw))
        if dtype != "bf16" and not fast_accum and kw["warp_specialized"] and kw["max_concurrent_steps"] == 3:
            # two K blocks a step (the first's promotion overlaps the second's wgmma): 2 stages fit
            out.append(MosaicGroupedGemmConfig(block_k=2 * block_k, fast_accum=False,
                                               **{**kw, "max_concurrent_steps": 2}))
            # consumers splitting the rows of a 128 x 128 CTA tile (20% fewer loads a K step than 64 x 256)
            for bk, stages in ((block_k, 6), (2 * block_k, 2), (2 * block_k, 3)):
                out.append(MosaicGroupedGemmConfig(block_k=bk, fast_accum=False, split_m=True,
                                                   **{**kw, "max_concurrent_steps": stages}))
    return out


def backward_candidates(op: str, N: int, K: int, out_itemsize: int = 2, *,
                        device: selection.DeviceSpec | None = None) -> list[MosaicGroupedGemmConfig]:
    """The configs of :data:`MOSAIC_DGRAD_SPACE` / :data:`MOSAIC_WGRAD_SPACE` (``op``) that keep the kernel's rules
    for ``w [E, N, K]`` with bf16 inputs and ``out_itemsize``-byte outputs on ``device`` (``mosaic_config_problem`` of
    the swapped problem, ``mosaic_wgrad_config_problem``; ``None``: sm_90's shared memory)."""
    space = MOSAIC_DGRAD_SPACE if op == "dgrad" else MOSAIC_WGRAD_SPACE
    cfgs = [MosaicGroupedGemmConfig(**kw) for kw in space]
    if op == "dgrad":
        return [c for c in cfgs
                if mosaic_config_problem(c, K, N, 2, False, out_itemsize=out_itemsize, device=device) is None]
    return [c for c in cfgs if mosaic_wgrad_config_problem(c, N, K, 2, out_itemsize, device=device) is None]


def backward_heuristic(op: str, M: int, N: int, K: int, E: int = E, *,
                       device: selection.DeviceSpec | None = None) -> MosaicGroupedGemmConfig:
    """The config the Mosaic backward kernel ``op`` runs on ``device`` without a tuned entry (bf16 in and out)."""
    if op == "dgrad":
        return heuristic_mosaic_grouped_gemm_config(M, K, N, E, 2, out_itemsize=2, device=device)
    return heuristic_mosaic_wgrad_config(M, N, K, E, 2, 2, device=device)


def variants(backend: str, dtype: str) -> list[bool | None]:
    """The ``fast_accum`` values tuned separately: Mosaic FP8 per token has two accumulation modes; FP8 blocks
    accumulate step by step (their scales change along K), so one."""
    if dtype == "fp8_block":
        return [None] if backend == TRITON_BACKEND else [False]
    return [False, True] if (backend == MOSAIC_BACKEND and dtype == "fp8") else [None]


def heuristic(backend: str, M: int, N: int, K: int, dtype: str, fast_accum: bool | None, E: int = E, *,
              device: selection.DeviceSpec | None = None):
    """The config the library runs today on ``device`` (default: this GPU's spec, :func:`device_spec`) without this
    problem's entry (for FP8 blocks: each backend's tuned lookup, which takes the nearest ``fp8_block`` or per-token
    ``fp8`` entry where one fits: :func:`grouped_gemm_config`, :func:`mosaic_grouped_gemm_config`; a re-tune of a
    stored key times against that entry)."""
    itemsize = 2 if dtype == "bf16" else 1
    device = device or device_spec()
    if dtype == "fp8_block" and backend == MOSAIC_BACKEND:
        return mosaic_grouped_gemm_config(M, N, K, E, 1, per_step_scales=True, w_block=True, device=device)
    if dtype == "fp8_block":
        return grouped_gemm_config(M, N, K, E, 1, 128, w_block=True, device=device)
    if backend == TRITON_BACKEND:
        return heuristic_grouped_gemm_config(M, N, K, E, itemsize)
    return heuristic_mosaic_grouped_gemm_config(M, N, K, E, itemsize, fast_accum=bool(fast_accum), device=device)


def kernel_fn(backend: str, cfg, op: str = "fwd"):
    """A jitted ``f(x, w, offsets, x_scale, w_scale) -> y`` (bf16) of ``backend`` with ``cfg``; ``op="dgrad"``:
    ``f(d_y, w, offsets) -> d_x``, ``op="wgrad"``: ``f(x, d_y, offsets) -> d_w`` (Mosaic GPU, bf16 out)."""
    if op != "fwd":
        from moe_pallas.ops.grouped_gemm import pallas_mosaic_gpu_backward as bwd

        kernel = bwd.grouped_gemm_dgrad_pallas_mosaic_gpu if op == "dgrad" else bwd.grouped_gemm_wgrad_pallas_mosaic_gpu
        return jax.jit(lambda a, b, off: kernel(a, b, off, out_dtype=jnp.bfloat16, config=cfg))
    if backend == TRITON_BACKEND:
        from moe_pallas.ops.grouped_gemm.pallas_triton import grouped_gemm_pallas_triton

        def f(x, w, off, xs, ws):
            return grouped_gemm_pallas_triton(x, w, off, x_scale=xs, w_scale=ws, out_dtype=jnp.bfloat16, config=cfg,
                                              interpret=False)
    else:
        from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu import grouped_gemm_pallas_mosaic_gpu

        def f(x, w, off, xs, ws):
            return grouped_gemm_pallas_mosaic_gpu(x, w, off, x_scale=xs, w_scale=ws, out_dtype=jnp.bfloat16, config=cfg)
    return jax.jit(f)


def with_routing(M: int, routing: str, seed: int = 0, E: int = E) -> jax.Array:
    """``expert_offsets [E + 1]`` int32 of ``M`` rows split by ``routing`` (``moe_contract.tuning.group_sizes``)."""
    return jnp.asarray(np.concatenate([[0], np.cumsum(group_sizes(M, E, routing, seed))]), jnp.int32)


def make_problem(K: int, N: int, M: int, dtype: str, seed: int = 0, routing: str = "uniform", E: int = E):
    """``(x, w, offsets, x_scale, w_scale)``: x ~ N(0, 1), w ~ N(0, 1/K) (outputs O(1)) with ``w [E, N, K]``, rows
    per expert by ``routing`` (``moe_contract.tuning.group_sizes``: ``uniform`` M/E each, or the bench's ``zipf``
    draw)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (M, K), jnp.bfloat16)
    w = (jax.random.normal(k2, (E, N, K), jnp.bfloat16) * K**-0.5).astype(jnp.bfloat16)
    off = with_routing(M, routing, seed, E)
    if dtype == "bf16":
        return x, w, off, None, None
    if dtype == "fp8_block":  # DeepSeek-V3: x per 1 x 128 group, w per 128 x 128 block
        xq, xs = moe_pallas.per_token_group_quant_fp8(x, 128)
        wq, ws = moe_pallas.quantize_weight_fp8(w, "block")
        del w
        return xq, wq, off, xs, ws
    xq, xs = moe_pallas.per_token_quant_fp8(x)
    wq, ws = moe_pallas.quantize_weight_fp8(w, "per_channel")
    del w
    return xq, wq, off, xs, ws


def make_backward_problem(op: str, K: int, N: int, M: int, seed: int = 0, E: int = E) -> tuple:
    """The dgrad's ``(d_y [M, N], w [E, N, K])`` or the wgrad's ``(x [M, K], d_y [M, N])``, bf16: x, d_y ~ N(0, 1),
    w ~ N(0, 1/N) (d_x O(1)); the offsets come from :func:`with_routing`."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    d_y = jax.random.normal(k1, (M, N), jnp.bfloat16)
    if op == "dgrad":
        return d_y, (jax.random.normal(k2, (E, N, K), jnp.float32) * N**-0.5).astype(jnp.bfloat16)
    return jax.random.normal(k2, (M, K), jnp.bfloat16), d_y


def backward_reference(op: str, a, b, off) -> jax.Array:
    """The float32 reference of the dgrad ``(a, b) = (d_y, w)`` / wgrad ``(x, d_y)`` (``Precision.HIGHEST``)."""
    from moe_pallas.ops.grouped_gemm.reference import grouped_gemm_dgrad_reference, grouped_gemm_wgrad_reference

    with jax.default_matmul_precision("highest"):
        if op == "dgrad":
            return jax.jit(grouped_gemm_dgrad_reference, static_argnums=4)(a, b, off, None, jnp.float32)
        return jax.jit(grouped_gemm_wgrad_reference, static_argnums=3)(a, b, off, jnp.float32)


def short(cfg) -> str:
    if isinstance(cfg, GroupedGemmConfig):
        return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
                + (f" g{cfg.group_m}" if cfg.group_m > 1 else ""))
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} c{cfg.max_concurrent_steps} g{cfg.grid_block_n}"
            + (" fast" if cfg.fast_accum else "") + (" ws" if cfg.warp_specialized else "")
            + (" split_m" if cfg.split_m else ""))


def entry_key(e: dict) -> tuple:
    """A launch config's key; a forward entry (no ``"op"``) has op ``"fwd"`` and no ``"out_dtype"``."""
    return (e["backend"], e["E"], e["N"], e["K"], e["M_cap"], e["dtype"], e.get("fast_accum"), e.get("op", "fwd"),
            e.get("out_dtype"))


def sweep(backend: str, cfgs: list, problems: list[tuple], deadline: Deadline,
          pool: concurrent.futures.ThreadPoolExecutor, op: str = "fwd") -> tuple[dict, bool]:
    """``({cfg: ms}, finished)``: the correct configs of ``cfgs`` (in order) until ``deadline``
    (``finished``: every config was tried); prints every skip / WRONG with its reason. Lowering on
    this thread, XLA compilation in ``pool``. ``problems``: ``(args_, ref, ref_norm)`` of each routing (same shapes:
    one compile); a config's time is the mean of its medians over them, and it must be correct on each. ``op``:
    :func:`kernel_fn`'s (the backward's ``args_`` are its three arrays)."""
    from jax.experimental.mosaic.gpu import profiler  # CUPTI: a GPU's; imported where it times

    args_ = problems[0][0]
    futures, finished = {}, True
    for cfg in cfgs:
        if deadline.passed():
            finished = False
            break
        try:
            lowered = kernel_fn(backend, cfg, op).lower(*args_)
        except Exception as exc:  # noqa: BLE001 - NotImplementedError (rules), lowering errors: not a candidate
            print(f"  skip {short(cfg)}: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}",
                  flush=True)
            continue
        futures[cfg] = pool.submit(lowered.compile)
    timed, run_errors = {}, 0
    for cfg, fut in futures.items():
        if deadline.passed():
            finished = False
            break
        try:
            compiled = fut.result()
        except Exception as exc:  # noqa: BLE001 - out of shared memory / registers etc.
            print(f"  skip {short(cfg)}: compile {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}",
                  flush=True)
            continue
        try:
            ms_each, err = [], 0.0
            for p_args, ref, ref_norm in problems:
                y = compiled(*p_args)
                err = max(err, float(jnp.linalg.norm(y.astype(jnp.float32) - ref)) / ref_norm)
                if not err <= MAX_REL_ERR:
                    break
                _, ts = profiler.measure(compiled, iterations=ITERATIONS)(*p_args)
                if not ts:
                    break
                ms_each.append(float(np.median(ts)))
            if not err <= MAX_REL_ERR:
                print(f"  WRONG {short(cfg)}: rel err {err:.2e}", flush=True)
                continue
            ts = [float(np.mean(ms_each))] if len(ms_each) == len(problems) else None
            run_errors = 0
        except Exception as exc:  # noqa: BLE001 - a run-time failure
            run_errors += 1
            print(f"  skip {short(cfg)}: run {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}",
                  flush=True)
            if run_errors >= 3:
                raise RuntimeError("three run-time failures in a row: the GPU context is probably lost") from exc
            continue
        if not ts:
            print(f"  skip {short(cfg)}: CUPTI saw no kernel", flush=True)
            continue
        timed[cfg] = float(np.median(ts))
        print(f"  {short(cfg):32s} {timed[cfg]:8.4f} ms  err {err:.1e}", flush=True)
    return timed, finished


def kept_entries(path: str, arch: str, kind: str, merge: str | None = None) -> tuple[str | None, dict, list]:
    """``(file read, launch configs by entry_key, other entries)`` a run writing ``path`` (the table of device ``kind``
    of architecture ``arch``) keeps: ``merge`` if given, else the file's own (none for a new file). Entries with a
    ``"kind"`` (backend choices, ``tune_backend.py``) are kept as they are. The file is read and validated as the
    lookups read it (``selection.read_table`` with :func:`check_entry`): ``ValueError`` naming the file and the entry
    for a malformed entry, one measured on another architecture or device kind, or a moe_torch entry
    (``moe_torch.ops.grouped_gemm.tune`` writes the same file name; its launch configs have no ``"backend"``)."""
    src = merge or path
    if not os.path.exists(src):
        return None, {}, []
    loaded = selection.read_table(src, arch, kind, check_entry)
    return src, {entry_key(e): e for e in loaded if "kind" not in e}, [e for e in loaded if "kind" in e]


class NoGPUError(RuntimeError):
    """Tuning was asked for where JAX has no GPU backend (the message is one line, for the command line)."""


def require_gpu() -> None:
    """Raises :class:`NoGPUError` unless JAX's default backend is a GPU: tuning measures the GPU it runs on."""
    backend = jax.default_backend()
    if backend != "gpu":
        raise NoGPUError(f"no CUDA GPU found (jax.default_backend() is {backend!r}); tuning measures the GPU it "
                         f"runs on")


def device_spec() -> selection.DeviceSpec:
    """The :class:`moe_contract.selection.DeviceSpec` of JAX's first GPU (``moe_pallas/ops/device.py``); its ``kind``
    and ``arch`` name the tuned table. Raises :class:`NoGPUError` without a GPU."""
    require_gpu()
    return spec_of(jax.devices()[0])


def check_entry(e: dict) -> str | None:
    """Why ``e`` is not an entry of a JAX table (``None``: it is), beyond the common keys that
    ``selection.read_table`` checks: a launch config without a ``"backend"`` of :data:`BACKENDS` (a moe_torch
    entry), with an unknown ``"op"``, without a ``"dtype"`` or with a ``"config"`` that is not an object. Backend
    choices (``"kind"``, ``backend_table.py``) pass. The ``check`` of
    :func:`moe_contract.tuning.write_tuned_table` for the JAX tables."""
    if "kind" not in e and "backend" not in e:
        return "has no \"backend\" (a moe_torch entry; the JAX tables name the backend of each launch config)"
    return entry_problem(e)  # the lookups' own rules (config.py), so a table the tuner writes is one they read


#: The default dispatch's layout key (``backend_table.gemm_layout``) of each tuned dtype.
LAYOUTS = {"bf16": "bf16", "fp8": "fp8_per_token", "fp8_block": "fp8_block"}


def backend_choice(E_: int, N: int, K: int, M: int, dtype: str, best_ms: dict[str, float],
                   routings: Sequence[str]) -> dict:
    """The backend choice (``backend_table.py``'s ``"kind": "backend_choice"`` entry) of one forward problem from each
    backend's best time in the accumulation mode ``implementation=None`` runs (FP8 per token: not ``fast_accum``):
    the fastest backend is what the default tries first on this device."""
    return {"kind": "backend_choice", "op": "grouped_gemm", "layout": LAYOUTS[dtype], "E": E_, "N": N, "K": K,
            "M_cap": M, "backend": min(best_ms, key=best_ms.get), "ms": dict(best_ms), "routings": list(routings),
            "source": "epmoe tune", "date": time.strftime("%Y-%m-%d"),
            "command": "epmoe tune --framework jax"}


def tune(shapes: Sequence[GemmShape], ms: Sequence[int], dtypes: Sequence[str] = DTYPES,
         ops: Sequence[str] = ("fwd",), *, backends: Sequence[str] = BACKENDS, routings: Sequence[str] = ("uniform",),
         deadline: Deadline | None = None, fast_accum: str = "both", ws_only: bool = False, jobs: int = 8,
         skip: Callable[[tuple], bool] | None = None, on_entry: Callable[[dict], None] | None = None) -> list[dict]:
    """Tune the JAX grouped GEMMs on this GPU for every ``shape`` x ``M`` of ``ms``: the forward of each of
    ``dtypes`` on each of ``backends`` (``"fwd"`` in ``ops``; Mosaic FP8 per token in the ``fast_accum`` modes
    ``"both"`` / ``"false"`` / ``"true"``) and the Mosaic GPU backward ops ``"dgrad"`` / ``"wgrad"`` (bf16 only: where
    ``dtypes`` has bf16 and ``backends`` Mosaic GPU); module docstring. Every entry is stamped with this GPU's
    ``"arch"`` and ``"device"`` (:func:`moe_contract.tuning.stamp`) and passed to ``on_entry`` as soon as it is
    measured (a run cut short keeps what it found). ``skip(entry_key)``: problems not to tune (``--resume``).
    ``fp8_block`` with ``K % 128 != 0`` is skipped (1 x 128 activation groups). Past ``deadline`` no config and no
    problem starts. ``jobs``: parallel XLA compilations. Returns the entries.

    Raises :class:`NoGPUError` without a GPU; ``ValueError`` for an unknown dtype, op or backend (before any
    launch); ``RuntimeError`` after three run-time failures in a row (the GPU context is probably lost)."""
    unknown = ([d for d in dtypes if d not in DTYPES] + [o for o in ops if o not in OPS]
               + [b for b in backends if b not in BACKENDS])
    if unknown or fast_accum not in ("both", "false", "true"):
        raise ValueError(f"tune: dtypes must be among {DTYPES}, ops among {OPS}, backends among {BACKENDS}, "
                         f"fast_accum one of both, false, true; got {unknown or fast_accum!r}")
    spec = device_spec()
    dev = spec.kind
    deadline = deadline or Deadline(None)
    routings = list(routings)
    skip = skip or (lambda key: False)
    entries: list[dict] = []

    def done(entry: dict) -> None:
        entry = stamp(entry, spec.arch, dev)
        entries.append(entry)
        print(json.dumps(entry), flush=True)
        if on_entry is not None:
            on_entry(entry)

    shapes = list(dict.fromkeys(shapes))  # a layer with H == 2I has one problem twice
    bwd_ops = [op for op in ops if op != "fwd"]
    if bwd_ops and (MOSAIC_BACKEND not in backends or "bf16" not in dtypes):
        print(f"  ops {','.join(bwd_ops)}: the Mosaic GPU backward kernels take bf16 only; the backends and dtypes "
              f"must include {MOSAIC_BACKEND} and bf16: not tuned", flush=True)
        bwd_ops = []
    pool = concurrent.futures.ThreadPoolExecutor(max(1, jobs))
    try:
        for shape, M, dtype in itertools.product(shapes, ms, dtypes if "fwd" in ops else ()):
            K, N, E_ = shape.K, shape.N, shape.E
            todo = [(b, fa) for b in backends for fa in variants(b, dtype)
                    if fa is None or fast_accum in ("both", str(fa).lower())
                    if not skip((b, E_, N, K, M, dtype, fa, "fwd", None))]
            if not todo or deadline.passed():
                continue
            print(f"== fwd {shape.describe()} M={M} {dtype}", flush=True)
            if dtype == "fp8_block" and K % 128:
                print(f"  skipped: fp8_block needs K % 128 == 0 (1 x 128 activation groups); K={K}", flush=True)
                continue
            problems = []
            base = make_problem(K, N, M, dtype, E=E_)
            for routing in routings:  # one x and w: the routings differ in the offsets alone
                args_ = (base[0], base[1], with_routing(M, routing, 0, E_), *base[3:])
                with jax.default_matmul_precision("highest"):
                    ref = jax.jit(grouped_gemm_reference, static_argnums=5)(*args_, jnp.float32)
                problems.append((args_, ref, float(jnp.linalg.norm(ref))))
            best_ms: dict[str, float] = {}  # each backend's best, in the accumulation mode the default runs
            for backend, fa in todo:
                if deadline.passed():
                    break
                print(f"-- {backend}" + ("" if fa is None else f" fast_accum={fa}"), flush=True)
                try:
                    heur = heuristic(backend, M, N, K, dtype, fa, E_, device=spec)
                except Exception as exc:  # noqa: BLE001 - a shape no config of the backend takes
                    print(f"  skipped: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                heur_timed, _ = sweep(backend, [heur], problems, Deadline(None), pool)
                heur_ms = heur_timed.get(heur)
                cands = [c for c in (triton_candidates(dtype) if backend == TRITON_BACKEND
                                     else mosaic_candidates(dtype, fa, ws_only)) if c != heur]
                timed, complete = sweep(backend, cands, problems, deadline, pool)
                timed.update(heur_timed)
                if backend == TRITON_BACKEND and timed:  # second pass: the grouped launch orders of the TOP_K tiles
                    again = [dataclasses.replace(c, group_m=g) for c in sorted(timed, key=timed.get)[:TOP_K]
                             for g in GROUP_MS]
                    more, complete2 = sweep(backend, [c for c in again if c not in timed], problems, deadline, pool)
                    timed.update(more)
                    complete = complete and complete2
                if not timed:
                    print("  no correct config timed: no entry", flush=True)
                    continue
                best = min(timed, key=timed.get)
                entry = {"backend": backend, "device": dev, "E": E_, "N": N, "K": K, "M_cap": M, "dtype": dtype,
                         "fast_accum": fa, "config": dataclasses.asdict(best), "ms": round(timed[best], 4),
                         "heuristic_ms": None if heur_ms is None else round(heur_ms, 4),
                         "configs_timed": len(timed), "complete": complete}
                if routings != ["uniform"]:  # the mean over these routings ranked the configs
                    entry["routings"] = list(routings)
                done(entry)
                if not fa:
                    best_ms[backend] = entry["ms"]
            if len(best_ms) >= 2:
                done(backend_choice(E_, N, K, M, dtype, best_ms, routings))
            del problems, base, args_, ref
            jax.clear_caches()
        for shape, M, op in itertools.product(shapes, ms, bwd_ops):  # the Mosaic backward kernels, bf16 in and out
            K, N, E_ = shape.K, shape.N, shape.E
            if deadline.passed() or skip((MOSAIC_BACKEND, E_, N, K, M, "bf16", None, op, "bf16")):
                continue
            print(f"== {op} {shape.describe()} M={M} bf16 -- {MOSAIC_BACKEND}", flush=True)
            a, b = make_backward_problem(op, K, N, M, E=E_)
            problems = []
            for routing in routings:
                off = with_routing(M, routing, 0, E_)
                ref = backward_reference(op, a, b, off)
                problems.append(((a, b, off), ref, float(jnp.linalg.norm(ref))))
            heur = backward_heuristic(op, M, N, K, E_, device=spec)
            heur_timed, _ = sweep(MOSAIC_BACKEND, [heur], problems, Deadline(None), pool, op)
            heur_ms = heur_timed.get(heur)
            cands = [c for c in backward_candidates(op, N, K, device=spec) if c != heur]
            timed, complete = sweep(MOSAIC_BACKEND, cands, problems, deadline, pool, op)
            timed.update(heur_timed)
            if timed:
                best = min(timed, key=timed.get)
                entry = {"op": op, "backend": MOSAIC_BACKEND, "device": dev, "E": E_, "N": N, "K": K, "M_cap": M,
                         "dtype": "bf16", "out_dtype": "bf16", "fast_accum": None,
                         "config": dataclasses.asdict(best), "ms": round(timed[best], 4),
                         "heuristic_ms": None if heur_ms is None else round(heur_ms, 4),
                         "configs_timed": len(timed), "complete": complete}
                if routings != ["uniform"]:
                    entry["routings"] = list(routings)
                done(entry)
            else:
                print("  no correct config timed: no entry", flush=True)
            del problems, a, b, ref
            jax.clear_caches()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return entries


def summary(entries: Sequence[dict]) -> list[str]:
    """A table of the tuned entries: op, backend, dtype, accumulation, shape, heuristic and tuned ms, config."""
    lines = [f"{'op':5s} {'backend':18s} {'dtype':9s} {'fast':5s} {'K':>5s} {'N':>5s} {'M':>6s} {'heur ms':>8s} "
             f"{'ms':>8s} {'x':>5s}  config"]
    for e in entries:
        if "kind" in e:  # a backend choice: the backends' best times, the fastest first in the default's order
            times = ", ".join(f"{b} {ms:.4f}" for b, ms in sorted(e["ms"].items(), key=lambda kv: kv[1]))
            lines.append("%-5s %-18s %-9s %-5s %5d %5d %6d  choice: %s" % (
                "fwd", e["backend"], e["layout"], "", e["K"], e["N"], e["M_cap"], times))
            continue
        h = e["heuristic_ms"]
        cfg = (GroupedGemmConfig if e["backend"] == TRITON_BACKEND else MosaicGroupedGemmConfig)(**e["config"])
        heur_s = "-" if h is None else "%.4f" % h
        gain = "-" if h is None else "%.2f" % (h / e["ms"])
        lines.append("%-5s %-18s %-9s %-5s %5d %5d %6d %8s %8.4f %5s  %s%s" % (
            e.get("op", "fwd"), e["backend"], e["dtype"], e["fast_accum"], e["K"], e["N"], e["M_cap"], heur_s,
            e["ms"], gain, short(cfg), "" if e["complete"] else "  (partial)"))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """The tuner's own command line (module docstring): the benchmark's problems (E=32, :data:`SHAPES`, :data:`MS`),
    every option. Usage errors exit 2 before any GPU is looked for; so does a machine without one."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX's backend starts: no 75% pool
    parser = argparse.ArgumentParser(prog="python -m moe_pallas.ops.grouped_gemm.tune",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or None,
                        help="folder of the table (default: $OUT if set, else the user cache's, as epmoe tune)")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--quick", action="store_true", help="M in {256, 16384} only")
    parser.add_argument("--max-minutes", type=float, default=None, help="start no config after this many minutes")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--ms", default=None, help="comma-separated M_cap values (default: all, or --quick's)")
    parser.add_argument("--resume", action="store_true", help="skip keys with a complete entry in the output / --merge file")
    parser.add_argument("--merge", default=None, help="tuned JSON whose entries are kept (default: the output file)")
    parser.add_argument("--jobs", type=int, default=8, help="parallel XLA compilations (1: sequential)")
    parser.add_argument("--ws-only", action="store_true", help="Mosaic GPU: the warp-specialized configs alone")
    parser.add_argument("--routings", default="uniform", help="comma list of uniform, zipf: rows per expert of the "
                        "timed problems (several: one compile, the mean of their times ranks the configs)")
    parser.add_argument("--fast-accum", choices=("both", "false", "true"), default="both",
                        help="Mosaic FP8 per token: which accumulation mode(s) to tune")
    parser.add_argument("--ops", default="fwd", help="comma list of fwd (the forward, default), dgrad, wgrad (the "
                        "Mosaic GPU backward kernels, bf16 only: entries with \"op\": \"dgrad\" / \"wgrad\"; "
                        "--backends must include pallas_mosaic_gpu)")
    args = parser.parse_args(argv)
    try:
        ops = parse_ops(args.ops)
        routings = parse_routings(args.routings)
        dtypes = parse_dtypes(args.dtypes)
        ms = parse_ms(args.ms) if args.ms else [m for m in MS if not (args.quick and m == 2048)]
    except ValueError as exc:
        parser.error(str(exc))
    backends = [b for b in args.backends.split(",") if b]
    if unknown := set(backends) - set(BACKENDS):
        parser.error(f"unknown backends {sorted(unknown)}; choose from {BACKENDS}")
    try:
        spec = device_spec()
    except NoGPUError as exc:
        print(f"tune_jax_gemm: {exc}", file=sys.stderr)
        return 2
    path = (os.path.join(args.out, spec.arch, selection.file_key(spec.kind) + ".json") if args.out
            else tuned_table_path("jax", spec.arch, spec.kind))
    try:  # a broken stored table stops here, before the GPU time is spent
        merge, configs, others = kept_entries(path, spec.arch, spec.kind, args.merge)
    except ValueError as exc:
        print(f"tune_jax_gemm: {exc}; fix that file or give another --out / --merge", file=sys.stderr)
        return 2
    base = others + list(configs.values())
    if base:
        print(f"kept {len(base)} entries of {merge}", flush=True)
    print(f"device {spec.kind}; ops {ops}; backends {backends}; dtypes {dtypes}; M {ms}; output {path}", flush=True)
    written: list[dict] = []

    def write(entry: dict) -> None:  # after every sweep: a run cut short keeps what it found
        written.append(entry)
        selection.write_table(path, merge_entries(base, written), spec.arch, spec.kind, check_entry)

    deadline = Deadline(args.max_minutes)
    shapes = [GemmShape(name=f"K{K}xN{N}", N=N, K=K, E=E) for K, N in SHAPES]
    entries = tune(shapes, ms, dtypes, ops, backends=backends, routings=routings, deadline=deadline,
                   fast_accum=args.fast_accum, ws_only=args.ws_only, jobs=args.jobs, on_entry=write,
                   skip=(lambda key: configs.get(key, {}).get("complete", False)) if args.resume else None)
    print(f"wrote {path} ({len(entries)} tuned in this run)" if entries else f"no entry measured; {path} not written",
          ("-- stopped at --max-minutes" if deadline.passed() else ""), flush=True)
    for line in summary(entries):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
