"""Sweep the torch decode path's launch configs (``moe_torch/ops/decode``: kernel A, GEMM 1 + activation; kernel B,
GEMM 2 + combine) on this GPU, for a model's layer in a weight format at a few token counts; JSON rows to --out.

Usage (GPU machine, repo root)::

    PYTHONPATH=. python3 benchmarks/tune_decode.py [--cases gpt-oss-120b:mxfp4,qwen3-30b-a3b:none] [--ts 1,8,64]
        [--max-minutes 4] [--quick] [--out DIR]
    PYTHONPATH=. compute-sanitizer python3 benchmarks/tune_decode.py --check-only --cases gpt-oss-120b:none --ts 8

A case ``preset:quant[:ep]`` (``ep``: the last of that many EP ranks, its routed experts and the shared ones).
Weights ``N(0, 1/K)`` quantized by the library, tokens ``N(0, 1)``, uniform random logits through the reference gate.
Coordinate descent from the heuristic: kernel A's configs with kernel B's heuristic, then kernel B's with the best A.
Every config's output must be within the contract of the reference before it is timed (``do_bench_cudagraph``:
replays of a CUDA graph, so no host launch path; the layer's weights exceed the L2 at these sizes). The winners go
into ``moe_torch/ops/decode/config.py``'s heuristics by hand, with the numbers in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

#: Kernel A: columns of I a program (gate and up each), K step over H, pipeline stages.
A_BLOCK_N = (16, 32, 64, 128)
A_BLOCK_K = (64, 128, 256)
A_STAGES = (2, 3, 4)
#: Kernel B: output columns a program, I chunk, warps, stages.
B_BLOCK_H = (8, 16, 32, 64)
B_BLOCK_I = (64, 128, 256)
B_WARPS = (1, 2, 4)
B_STAGES = (2, 3)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="gpt-oss-120b:mxfp4,qwen3-30b-a3b:none,deepseek-v3:fp8_block:8,kimi-k2:int4",
                   help="comma list of preset:quant[:ep] (default: the decode benchmark's four models)")
    p.add_argument("--ts", default="1,8,64", help="comma list of token counts (default 1,8,64)")
    p.add_argument("--max-minutes", type=float, default=8.0, help="stop sweeping after this long (default 8)")
    p.add_argument("--quick", action="store_true", help="the tile sides only (K step 128, 4 warps, 2 or 4 stages)")
    p.add_argument("--check-only", action="store_true",
                   help="no sweep: each case once with the heuristic configs against the reference, then the Triton "
                        "gate against the reference gate, synchronised after each (one case a process under "
                        "compute-sanitizer names the faulting kernel)")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(_ROOT, "benchmarks", "results"))
    a = p.parse_args(argv)
    a.cases = [c.split(":") for c in a.cases.split(",") if c]
    a.ts = [int(t) for t in a.ts.split(",") if t]
    for c in a.cases:
        if len(c) not in (2, 3):
            p.error(f"--cases: each case is preset:quant[:ep]; got {':'.join(c)!r}")
    return a


def layer(preset: str, quant: str, ep: int, T: int, dev: str = "cuda"):
    """``(config, args, kwargs)`` of one decode call at the preset's size (this rank's experts only)."""
    import torch

    from moe_contract.presets import get_preset
    from moe_torch.layer import quantize_layer_weights, run_gate

    c = get_preset(preset).config(quant=quant)
    if ep > 1:
        c = c.replace(ep_size=ep, ep_rank=ep - 1)
    n, H, I = c.local_expert_range()[1], c.hidden_size, c.intermediate_size
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.empty(n, 2 * I, H, device=dev, dtype=torch.bfloat16)
    w2 = torch.empty(n, H, I, device=dev, dtype=torch.bfloat16)
    for e in range(n):  # expert by expert: no float32 copy of the whole layer
        w13[e] = torch.randn(2 * I, H, generator=g, device=dev) * H**-0.5
        w2[e] = torch.randn(H, I, generator=g, device=dev) * I**-0.5
    w13, s13, w2, s2 = quantize_layer_weights(w13, w2, c)
    bias = lambda *s: (0.1 * torch.randn(*s, generator=g, device=dev)).bfloat16() if c.expert_bias else None  # noqa: E731
    x = torch.randn(T, H, generator=g, device=dev).bfloat16()
    logits = torch.randn(T, c.num_experts, generator=g, device=dev)
    e_bias = 0.1 * torch.randn(c.num_experts, generator=g, device=dev) if c.routing == "biased_grouped_topk" else None
    tw, ti = run_gate(logits, c, e_bias, "reference")
    kw = dict(w13_bias=bias(n, 2 * I), w2_bias=bias(n, H), w13_scale=s13, w2_scale=s2)
    return c, (x, tw, ti, w13, w2), kw


def check_case(preset, quant, ep, T, c, args, kw, ref, tol) -> None:
    """One case with the heuristic configs: the decode kernels against the reference, then the Triton gate against the
    reference gate on fresh logits, each synchronised so that a fault names its step."""
    import torch

    from moe_torch.layer import run_gate
    from moe_torch.ops.decode import fused_experts_decode

    x, tw, ti, w13, w2 = args
    with torch.no_grad():
        out = fused_experts_decode(x, tw, ti, w13, w2, c, **kw, implementation="triton")
        torch.cuda.synchronize()
        err = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
        again = fused_experts_decode(x, tw, ti, w13, w2, c, **kw, implementation="triton")
        print(f"decode {preset}:{quant}:ep{ep} T={T}: rel err {err:.3g} (max {tol}), bit-identical rerun "
              f"{bool(torch.equal(out, again))}", flush=True)
        g = torch.Generator(device=x.device).manual_seed(1)
        logits = torch.randn(T, c.num_experts, generator=g, device=x.device)
        bias = (0.1 * torch.randn(c.num_experts, generator=g, device=x.device)
                if c.routing == "biased_grouped_topk" else None)
        w_ref, i_ref = run_gate(logits, c, bias, "reference")
        w_tri, i_tri = run_gate(logits, c, bias, "triton")
        torch.cuda.synchronize()
        print(f"gate {preset} T={T}: ids equal {bool(torch.equal(i_tri.long(), i_ref.long()))}, weights max diff "
              f"{float((w_tri - w_ref).abs().max()):.3g}", flush=True)


def main(argv=None) -> int:
    import torch
    import triton.testing

    from moe_contract.tolerances import BF16_REL_FRO, FP8_REL_FRO
    from moe_torch.ops.decode import fused_experts_decode
    from moe_torch.ops.decode.config import decode_down_config, decode_gate_up_config
    from moe_torch.ops.decode.triton import fused_experts_decode_triton

    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t0, rows = time.perf_counter(), []
    dev_name = torch.cuda.get_device_name()
    for case, T in itertools.product(args.cases, args.ts):
        preset, quant = case[0], case[1]
        ep = int(case[2]) if len(case) == 3 else 1
        if time.perf_counter() - t0 > 60 * args.max_minutes:
            print(f"tune_decode: over --max-minutes={args.max_minutes}; stopped before {preset}:{quant} T={T}")
            break
        with torch.no_grad():
            c, (x, tw, ti, w13, w2), kw = layer(preset, quant, ep, T)
            ref = fused_experts_decode(x, tw, ti, w13, w2, c, **kw, implementation="reference").float()
        tol = FP8_REL_FRO if quant.startswith("fp8") else BF16_REL_FRO
        if args.check_only:
            check_case(preset, quant, ep, T, c, (x, tw, ti, w13, w2), kw, ref, tol)
            continue
        w4, fp8 = quant in ("mxfp4", "int4"), quant if quant.startswith("fp8") else None
        H, I, k = c.hidden_size, c.intermediate_size, ti.shape[1]
        heur_a = decode_gate_up_config(T, k, H, I, c.local_expert_range()[1], w4=w4, fp8=fp8)
        heur_b = decode_down_config(T, H, I, w4=w4, fp8=fp8)

        def timed(cfg_a, cfg_b):
            def fn():
                return fused_experts_decode_triton(x, tw, ti, w13, w2, c, kw["w13_bias"], kw["w2_bias"],
                                                   kw["w13_scale"], kw["w2_scale"], cfg_a, cfg_b)
            try:
                with torch.no_grad():
                    out = fn().float()
                    err = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
                    if not err <= tol:
                        return None, f"rel err {err:.3g} > {tol}"
                    return float(triton.testing.do_bench_cudagraph(fn, rep=20)), None
            except Exception as exc:  # a config the kernels refuse or that does not compile: skipped, said why
                return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"

        def record(kernel, cfg_a, cfg_b):
            ms, why = timed(cfg_a, cfg_b)
            rows.append(dict(device=dev_name, preset=preset, quant=quant, ep=ep, T=T, kernel=kernel,
                             a=dataclasses.asdict(cfg_a), b=dataclasses.asdict(cfg_b), ms=ms, error=why))
            return ms

        base = record("heuristic", heur_a, heur_b)
        best_a, best_ms = heur_a, base
        a_space = itertools.product(A_BLOCK_N, (128,) if args.quick else A_BLOCK_K, (2, 4) if args.quick else A_STAGES)
        for bn, bk, st in a_space:
            if fp8 == "fp8_block" and bk != 128:
                continue
            cand = dataclasses.replace(heur_a, block_n=bn, block_k=bk, num_stages=st)
            ms = record("A", cand, heur_b)
            if ms is not None and (best_ms is None or ms < best_ms):
                best_a, best_ms = cand, ms
        best_b = heur_b
        b_space = itertools.product(B_BLOCK_H, (128, 256) if args.quick else B_BLOCK_I, (1, 4) if args.quick else B_WARPS,
                                    (2,) if args.quick else B_STAGES)
        for bh, bi, nw, st in b_space:
            if fp8 == "fp8_block" and bi != 128:
                continue
            cand = dataclasses.replace(heur_b, block_h=bh, block_i=bi, num_warps=nw, num_stages=st)
            ms = record("B", best_a, cand)
            if ms is not None and (best_ms is None or ms < best_ms):
                best_b, best_ms = cand, ms
        print(f"{preset}:{quant}:ep{ep} T={T}: heuristic {base} ms, best {best_ms} ms  A={best_a}  B={best_b}",
              flush=True)
    with open(os.path.join(args.out, "tune_decode.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
