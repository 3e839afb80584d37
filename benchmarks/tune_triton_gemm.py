"""Tune the Triton grouped GEMM's launch config on this GPU; write the winners as JSON with named keys.

Usage (GPU machine, repo root)::

    PYTHONPATH=. python3 benchmarks/tune_triton_gemm.py [--out moe_torch/ops/grouped_gemm/tuned] [--quick] [--full] [--tma]
        [--dtypes bf16,fp8,fp8_block] [--ms 256,2048,16384] [--routings uniform,zipf]

For each problem of the benchmark's grouped GEMM set (E=32; (K=7168, N=4096) and (K=2048, N=7168);
M in {256, 2048, 16384}; rows split uniformly; bf16, FP8 per-token x per-channel (``fp8``), and FP8 with
DeepSeek-V3's 1 x 128 activation groups x 128 x 128 weight blocks (``fp8_block``)) every config
of :func:`candidates` (from :data:`SEARCH_SPACE`) is timed with ``triton.testing.do_bench`` (CUDA
events, median) after a correctness check against the heuristic config's output (a config that
computes a wrong answer is never chosen). ``--routings uniform,zipf``: each config is checked and timed on
each routing's rows per expert (``benchmarks/specs.py: group_sizes``: ``uniform`` M/E each, the bench's ``zipf``
draw) and ranked by the mean of its times, so the winner is the best on ragged routing too (the entry names its
``"routings"``; ``ms`` and ``heuristic_ms`` are those means). The file ``<device>.json`` holds one entry per problem::

    {"device": "NVIDIA H200", "E": 32, "N": 4096, "K": 7168, "M_cap": 2048, "dtype": "bf16",
     "config": {"block_m": 64, ..., "group_m": 8, "persistent": false}, "ms": 0.41, "heuristic_ms": 0.47}

Two passes per problem (at most 18 + 3 x 5 = 33 configs): the tile shapes x stages in the default
launch order, then every launch order (``group_m`` x ``persistent``) for the :data:`TOP_K` fastest
tiles. ``--full`` times the whole product instead (108 configs per problem). ``--tma`` (opt-in; every
dtype: the variant serves bf16 and FP8) adds a third pass: the opt-in TMA variant (``GroupedGemmConfig.tma``; ``warp_specialize``
too on 8-warp tiles) of the :data:`TOP_K` fastest configs so far, in each one's launch order and also
persistent with ``group_m=8`` (at most 3 x 4 = 12 more configs per problem).

``moe_torch.ops.grouped_gemm.config.grouped_gemm_config`` reads it (nearest M_cap, same N, K, dtype). Entries of
problems this run does not tune (other ``--dtypes`` / ``--ms``) are kept: the output file's, or for a new file
(e.g. in ``$OUT``, the default where set) the table in the tree's. A JAX table (``tune_jax_gemm.py`` writes the
same file name) is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

import torch
import triton
import triton.testing

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # benchmarks.specs (the routings' group sizes) from any working directory
    sys.path.insert(0, _ROOT)

from benchmarks.specs import group_sizes  # noqa: E402

from moe_torch.ops.grouped_gemm.config import TUNED_DIR, GroupedGemmConfig, heuristic_grouped_gemm_config
from moe_torch.ops.grouped_gemm.triton import grouped_gemm_triton
from moe_torch.ops.quant.api import per_token_group_quant_fp8, per_token_quant_fp8, quantize_weight_fp8

#: block_m x block_n x num_warps x num_stages x group_m x persistent (GroupedGemmConfig's fields);
#: block_k is fixed by the dtype (128-byte K rows). The last two are the launch order (group_m = 1,
#: not persistent: the default 2-D grid; see moe_torch/ops/grouped_gemm/triton.py, "Launch order").
SEARCH_SPACE = {
    "block_m": (64, 128),
    "block_n": (64, 128, 256),
    "num_warps": (4, 8),
    "num_stages": (3, 4),
    "group_m": (1, 4, 8),
    "persistent": (False, True),
}
#: Tile shapes timed in every launch order in the second pass.
TOP_K = 3
SHAPES = ((7168, 4096), (2048, 7168))
MS = (256, 2048, 16384)
E = 32


def weak(block_m: int, block_n: int, num_warps: int) -> bool:
    """Tile shapes not worth timing: 64-column tiles over 8 warps (too little work per warp), and
    128 x 256 over 4 warps (a 128 KiB float32 accumulator, 256 registers per thread: spills)."""
    return (block_n == 64 and num_warps == 8) or (block_m == 128 and block_n == 256 and num_warps == 4)


def tiles() -> list[dict]:
    """The first pass: every non-:func:`weak` tile shape x stages, default launch order (18)."""
    keys = ("block_m", "block_n", "num_warps", "num_stages")
    return [dict(zip(keys, v)) for v in itertools.product(*(SEARCH_SPACE[k] for k in keys)) if not weak(*v[:3])]


def launch_orders() -> list[dict]:
    """Every launch order of :data:`SEARCH_SPACE`, the default first."""
    return [dict(group_m=g, persistent=p) for p in SEARCH_SPACE["persistent"] for g in SEARCH_SPACE["group_m"]]


def tma_variants(cfg: GroupedGemmConfig) -> list[GroupedGemmConfig]:
    """The opt-in TMA variants of a (pointer-kernel) config for ``--tma``: ``tma=True`` in ``cfg``'s launch
    order and persistent with ``group_m=8``, each also with ``warp_specialize=True`` on 8 warps (4 warps fail
    to compile for sm_90 with it: ``check_config``)."""
    orders = [dict(), dict(group_m=8, persistent=True)]
    specs = [dict(tma=True)] + ([dict(tma=True, warp_specialize=True)] if cfg.num_warps >= 8 else [])
    return [dataclasses.replace(cfg, **o, **s) for o in orders for s in specs]


DTYPES = ("bf16", "fp8", "fp8_block")


def problems(quick: bool, dtypes=DTYPES, ms=MS):
    for (K, N), M, dtype in itertools.product(SHAPES, ms, dtypes):
        if quick and M == 2048:
            continue
        yield K, N, M, dtype


ROUTINGS = ("uniform", "zipf")


def routing_offsets(M: int, routing: str, device: str = "cuda") -> torch.Tensor:
    """``expert_offsets [E + 1]`` int32 (on ``device``) of ``M`` rows split by ``routing`` (:func:`benchmarks.specs.group_sizes`,
    seed 0: the bench's rows)."""
    sizes = group_sizes(M, E, routing)
    return torch.tensor([0, *itertools.accumulate(int(v) for v in sizes)], dtype=torch.int32, device=device)


def parse_routings(text: str) -> list[str]:
    """``--routings``: a non-empty comma list of :data:`ROUTINGS`; ``ValueError`` otherwise."""
    routings = [r.strip() for r in text.split(",") if r.strip()]
    if not routings or set(routings) - set(ROUTINGS):
        raise ValueError(f"--routings: a comma list of {', '.join(ROUTINGS)}; got {text!r}")
    return routings


def entry_key(e: dict) -> tuple:
    return e["E"], e["N"], e["K"], e["M_cap"], e["dtype"]


def kept_entries(path: str, tuned_dir: str = TUNED_DIR) -> dict:
    """The entries a run writing ``path`` keeps (by :func:`entry_key`): the file's own, or for a new file (e.g. in
    ``$OUT``) those of the table of the same name in ``tuned_dir`` (the tree's), so the written file is always the
    whole table. ``ValueError`` for a JAX table (``tune_jax_gemm.py`` writes the same file name; its entries name a
    ``"backend"`` or a ``"kind"``)."""
    seed = path if os.path.exists(path) else os.path.join(tuned_dir, os.path.basename(path))
    if not os.path.exists(seed):
        return {}
    with open(seed) as f:
        loaded = json.load(f)
    if foreign := [e for e in loaded if "backend" in e or "kind" in e]:
        raise ValueError(f"{seed} is not a moe_torch table: {len(foreign)} entries name a JAX backend "
                         f"(benchmarks/tune_jax_gemm.py writes such entries under the same file name); give another --out")
    return {entry_key(e): e for e in loaded}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "moe_torch/ops/grouped_gemm/tuned"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--full", action="store_true", help="time every config of SEARCH_SPACE (108 per problem)")
    parser.add_argument("--tma", action="store_true",
                        help="also time the TMA variant (tma, warp_specialize) of the fastest configs")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma list of {', '.join(DTYPES)}")
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="comma list of M (rows)")
    parser.add_argument("--routings", default="uniform", help="comma list of uniform, zipf: rank configs by the mean "
                        "of their times over these rows-per-expert splits (default uniform)")
    args = parser.parse_args()
    try:
        routings = parse_routings(args.routings)
    except ValueError as exc:
        parser.error(str(exc))
    dtypes = [d for d in args.dtypes.split(",") if d]
    if unknown := set(dtypes) - set(DTYPES):
        parser.error(f"unknown dtypes {sorted(unknown)}; choose from {DTYPES}")
    dev = torch.cuda.get_device_name()
    g = torch.Generator(device="cuda").manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, dev.replace(" ", "_") + ".json")
    try:
        kept = kept_entries(path)
    except ValueError as exc:
        print(f"tune_triton_gemm: {exc}", file=sys.stderr)
        return 2
    entries = []
    for K, N, M, dtype in problems(args.quick, dtypes, [int(m) for m in args.ms.split(",") if m]):
        x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(E, N, K, device="cuda", generator=g) * K**-0.5).to(torch.bfloat16)
        offs = [routing_offsets(M, r) for r in routings]
        kw = {}
        if dtype == "fp8":  # per token x per output channel (the library's quantizers, as the JAX tuner)
            x, xs = per_token_quant_fp8(x)
            w, ws = quantize_weight_fp8(w, "per_channel")
            kw = dict(x_scale=xs, w_scale=ws)
        elif dtype == "fp8_block":  # DeepSeek-V3: x per 1 x 128 group, w per 128 x 128 block
            x, xs = per_token_group_quant_fp8(x, 128)
            w, ws = quantize_weight_fp8(w, "block")
            kw = dict(x_scale=xs, w_scale=ws)
        bits = 16 if dtype == "bf16" else 8
        block_k = 128 * 8 // bits
        x_group, w_block = (128, True) if dtype == "fp8_block" else (None, False)
        heur = heuristic_grouped_gemm_config(M, N, K, E, bits, x_group, w_block)
        # the reference is this kernel at the heuristic config (an explicit config: without one, an FP8-block request
        # on sm_90 would run the Gluon kernel, whose bf16 roundings may differ from this kernel's by an ulp)
        refs = [grouped_gemm_triton(x, w, off, kw.get("x_scale"), kw.get("w_scale"), torch.bfloat16, heur).float()
                for off in offs]
        run = lambda cfg, off: grouped_gemm_triton(x, w, off, kw.get("x_scale"), kw.get("w_scale"), torch.bfloat16,  # noqa: E731
                                                   cfg)
        heur_ms = sum(triton.testing.do_bench(lambda: run(heur, off), warmup=25, rep=100, return_mode="median")
                      for off in offs) / len(offs)

        def bench(cfg):
            """Median ms of ``cfg`` (the mean over the routings), ``inf`` if it is wrong or does not run."""
            try:
                times = []
                for off, ref, routing in zip(offs, refs, routings):
                    y = run(cfg, off).float()
                    err = float((y - ref).norm() / ref.norm())
                    if not err <= 1e-3:
                        print(f"  WRONG {cfg} ({routing}) err={err:.2e}", flush=True)
                        return float("inf")
                    times.append(triton.testing.do_bench(lambda: run(cfg, off), warmup=25, rep=100,
                                                         return_mode="median"))
                ms = sum(times) / len(times)
                each = f" ({', '.join(f'{r} {t:.4f}' for r, t in zip(routings, times))})" if len(times) > 1 else ""
                print(f"  {ms:.4f} ms{each}  {cfg}", flush=True)  # every timing in the log, not only the winner's
                return ms
            except Exception as exc:  # noqa: BLE001 - out of shared memory etc.: not a candidate
                print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                return float("inf")

        orders = launch_orders()
        first = [GroupedGemmConfig(block_k=block_k, **t, **o)
                 for t in tiles() for o in (orders if args.full else orders[:1])]
        timed = {cfg: bench(cfg) for cfg in first}
        if not args.full:  # second pass: every other launch order of the fastest tile shapes
            for tile, order in itertools.product(sorted(first, key=timed.get)[:TOP_K], orders[1:]):
                cfg = dataclasses.replace(tile, **order)
                timed[cfg] = bench(cfg)
        if args.tma:  # third pass (opt-in): the TMA variant of the fastest configs
            for best in sorted(timed, key=timed.get)[:TOP_K]:
                for variant in tma_variants(best):
                    if variant not in timed:
                        timed[variant] = bench(variant)
        print(f"  timed {len(timed)} configs", flush=True)
        ms, cfg = min((heur_ms, heur), *((t, c) for c, t in timed.items()), key=lambda mc: mc[0])
        entry = {"device": dev, "E": E, "N": N, "K": K, "M_cap": M, "dtype": dtype,
                 "config": dataclasses.asdict(cfg), "ms": round(ms, 4), "heuristic_ms": round(heur_ms, 4)}
        if routings != ["uniform"]:  # the mean over these routings ranked the configs
            entry["routings"] = list(routings)
        entries.append(entry)
        kept.pop(entry_key(entry), None)
        print(json.dumps(entry), flush=True)
        with open(path, "w") as f:  # after every problem: a run cut short keeps what it found
            json.dump(list(kept.values()) + entries, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
