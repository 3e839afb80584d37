"""Sweep the gate kernels' launch configs (Triton and Pallas-Triton) on this GPU; JSON rows to --out.

Usage (GPU machine, repo root)::

    PYTHONPATH=. python3 benchmarks/tune_gate.py [--tokens 32,512,4096] [--out DIR]

The problem is the benchmark's gate: DeepSeek-V3's biased grouped top-k (E=256, 8 groups keep 4,
topk 8, 1 fused shared expert, rsf 2.5). Every config's ids must equal the torch reference's and its
weights must be within the contract's gate tolerance before it is timed (Triton: ``do_bench_cudagraph``,
replays of a CUDA graph, one logit set; JAX: CUPTI ``profiler.measure``, kernel time, over 16 rotated
logit sets). Both are kernel times without the host's launch path.
The winners go into the heuristics of ``moe_torch/ops/gate/config.py`` and
``moe_pallas/ops/gate/config.py`` by hand, with the numbers in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import harness as H  # noqa: E402

#: tokens per program x warps; block_t * 256 experts above 16384 float32 values would spill.
BLOCK_T = (1, 2, 4, 8, 16, 32, 64)
NUM_WARPS = (1, 2, 4, 8)
MAX_TILE = 16384


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="32,512,4096", help="comma list of T")
    parser.add_argument("--block-t", default=",".join(map(str, BLOCK_T)),
                        help=f"comma list of tokens per program (powers of two, <= {MAX_TILE // 256})")
    parser.add_argument("--warps", default=",".join(map(str, NUM_WARPS)), help="comma list of num_warps (powers of two)")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args(argv)
    args.tokens = H.int_list(parser, "--tokens", args.tokens)
    args.block_t = H.int_list(parser, "--block-t", args.block_t, power_of_two=True, most=MAX_TILE // 256)
    args.warps = H.int_list(parser, "--warps", args.warps, power_of_two=True, most=32)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("tune_gate.py: needs a CUDA GPU (it times the compiled Triton and Pallas-Triton gates); none is visible")
    import jax
    import jax.numpy as jnp
    import triton.testing
    from jax.experimental.mosaic.gpu import profiler

    from moe_contract import get_preset
    from moe_contract.tolerances import GATE_WEIGHT_RTOL
    from moe_pallas.ops.gate.config import GateConfig as PallasGateConfig
    from moe_pallas.ops.gate.pallas_triton import select_experts_pallas_triton
    from moe_torch.ops.gate.config import GateConfig as TritonGateConfig
    from moe_torch.ops.gate.reference import select_experts_reference
    from moe_torch.ops.gate.triton import select_experts_triton

    config = get_preset("deepseek-v3").config()
    kw = config.gate_kwargs()
    E = config.num_experts
    rows = []
    for T in args.tokens:
        g = torch.Generator(device="cuda").manual_seed(T)
        sets = [torch.randn(T, E, device="cuda", generator=g) for _ in range(16)]
        bias = 0.1 * torch.randn(E, device="cuda", generator=g)
        ref_w, ref_ids = select_experts_reference(sets[0], **kw, e_score_correction_bias=bias)
        j_sets = [jnp.asarray(s.cpu().numpy()) for s in sets]
        j_bias = jnp.asarray(bias.cpu().numpy())
        for block_t, warps in itertools.product(args.block_t, args.warps):
            if block_t > T:
                continue
            row = {"T": T, "E": E, "block_t": block_t, "num_warps": warps}
            # Triton
            try:
                cfg = TritonGateConfig(block_t=block_t, block_e=256, block_k=8, num_warps=warps)
                run = lambda s: select_experts_triton(s, **kw, e_score_correction_bias=bias, config=cfg)  # noqa: E731
                w, ids = run(sets[0])
                ok = torch.equal(ids, ref_ids) and float(((w - ref_w).abs() / ref_w.abs().clamp_min(1e-30)).max()) <= GATE_WEIGHT_RTOL
                # Replayed from a CUDA graph: kernel time without Python's launch path (eager do_bench
                # swings between ~8 and ~60 us with the host for a ~20 us kernel). One logit set: the
                # logits sit in L2, as they do right after the router matmul that makes them.
                with torch.cuda.stream(torch.cuda.Stream()):
                    row["triton_us"] = (1e3 * triton.testing.do_bench_cudagraph(lambda: run(sets[0]), rep=50, return_mode="median")
                                        if ok else None)
                row["triton_ok"] = ok
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is not a candidate
                row["triton_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            # Pallas-Triton
            try:
                pcfg = PallasGateConfig(block_t=block_t, num_warps=warps)
                f = jax.jit(lambda s: select_experts_pallas_triton(s, j_bias, **kw, config=pcfg, interpret=False))
                w, ids = f(j_sets[0])
                ok = np.array_equal(np.asarray(ids), ref_ids.cpu().numpy())
                if ok:
                    times = []
                    for s in j_sets:
                        _, ms = profiler.measure(f)(s)
                        times.append(ms)
                    row["pallas_us"] = 1e3 * float(np.median(times))
                row["pallas_ok"] = ok
            except Exception as exc:  # noqa: BLE001
                row["pallas_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        if rows:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "tune_gate.json"), "w") as fh:
                json.dump(rows, fh, indent=1)
    if not any(r.get("triton_us") or r.get("pallas_us") for r in rows):
        print("tune_gate.py: no config was timed (every block_t > T, or every config failed: see the rows' errors)")
        return 1
    for T in sorted({r["T"] for r in rows}):
        for key in ("triton_us", "pallas_us"):
            cands = [r for r in rows if r["T"] == T and r.get(key)]
            if cands:
                best = min(cands, key=lambda r: r[key])
                print(f"T={T} best {key[:-3]}: block_t={best['block_t']} num_warps={best['num_warps']} {best[key]:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
