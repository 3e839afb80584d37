"""GPU probe of the Gluon FP8-block grouped GEMM (``moe_torch/ops/grouped_gemm/gluon.py``) on one H200 (sm_90a).

Checks the kernel against ``grouped_gemm(..., implementation="reference")`` (relative Frobenius error of the float32
outputs <= 1e-2, rows no expert owns exactly zero) on edge cases, then on the benchmark shapes (E = 32, M = 16384;
gate_up K = 7168, N = 4096; down K = 2048, N = 7168; uniform and zipf routing) and times it against the Triton kernel
(``implementation="triton"``) with ``triton.testing.do_bench(warmup=25, rep=100, return_mode="median")``. One line a
case; a failing case prints its exception type and message and the probe goes on.

Usage (repo root, on the GPU machine)::

    PYTHONPATH=. python3 benchmarks/probe_gluon_gemm.py [--quick] [--stages 4] [--case SUBSTRING]

``--quick``: edge cases and the uniform benchmark shapes only. ``--stages``: the kernel's ``num_stages`` (several:
``--stages 4 5``; the first is checked, all are timed). ``--case``: run only the cases whose name contains it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import numpy as np
import torch

import moe_torch
from benchmarks.specs import group_sizes
from moe_torch.ops.grouped_gemm.gluon import grouped_gemm_gluon_fp8_block

TOL = 1e-2


def make_problem(sizes, N, K, *, lead=0, tail=0, seed=0, dev="cuda"):
    """Quantized inputs: ``lead`` unowned rows before expert 0, ``tail`` after the last expert."""
    g = torch.Generator(device=dev).manual_seed(seed)
    E = len(sizes)
    M_cap = lead + int(sum(sizes)) + tail
    x = torch.randn(M_cap, K, device=dev, dtype=torch.bfloat16, generator=g)
    w = (torch.randn(E, N, K, device=dev, dtype=torch.bfloat16, generator=g) * K ** -0.5).to(torch.bfloat16)
    xq, xs = moe_torch.per_token_group_quant_fp8(x, 128)
    wq, ws = moe_torch.quantize_weight_fp8(w, "block")
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]) + lead, dtype=torch.int32, device=dev)
    return xq.contiguous(), wq.contiguous(), offsets, xs.contiguous(), ws.contiguous()


def check(name, prob, stages):
    xq, wq, off, xs, ws = prob
    y = grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, torch.bfloat16, num_stages=stages)
    ref = moe_torch.grouped_gemm(xq, wq, off, x_scale=xs, w_scale=ws, out_dtype=torch.bfloat16,
                                 implementation="reference")
    torch.cuda.synchronize()
    lo, hi = int(off[0].clamp(0, xq.shape[0])), int(off[-1].clamp(0, xq.shape[0]))
    yf, rf = y.float(), ref.float()
    err = (torch.linalg.vector_norm(yf - rf) / torch.linalg.vector_norm(rf).clamp_min(1e-30)).item()
    unowned = torch.cat([yf[:lo], yf[hi:]])
    zero_ok = bool((unowned == 0).all().item()) if unowned.numel() else True
    finite = bool(torch.isfinite(yf).all().item())
    ok = err <= TOL and zero_ok and finite
    print(f"{'PASS' if ok else 'FAIL'} {name}: M_cap={xq.shape[0]} E={wq.shape[0]} N={wq.shape[1]} K={wq.shape[2]} "
          f"rows [{lo}, {hi}) rel_err={err:.3e} unowned_zero={zero_ok} finite={finite}", flush=True)
    return ok


def bench(name, prob, stages_list):
    import triton

    xq, wq, off, xs, ws = prob
    M = int(off[-1] - off[0])
    N, K = wq.shape[1], wq.shape[2]
    flops = 2.0 * M * N * K
    out = []
    for st in stages_list:
        ms = triton.testing.do_bench(lambda: grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, num_stages=st),
                                     warmup=25, rep=100, return_mode="median")
        out.append(f"gluon[s={st}] {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
    os.environ["EPMOE_TRITON_GLUON_FP8_BLOCK"] = "0"  # implementation="triton" would dispatch here to the Gluon kernel
    try:
        ms = triton.testing.do_bench(lambda: moe_torch.grouped_gemm(xq, wq, off, x_scale=xs, w_scale=ws,
                                                                    out_dtype=torch.bfloat16, implementation="triton"),
                                     warmup=25, rep=100, return_mode="median")
    finally:
        del os.environ["EPMOE_TRITON_GLUON_FP8_BLOCK"]
    out.append(f"triton {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
    print(f"TIME {name}: " + " | ".join(out), flush=True)


def cases(quick):
    E = 32
    yield "M1-one-expert", dict(sizes=[0, 1, 0, 0], N=256, K=256), False
    yield "empty-expert", dict(sizes=[100, 0, 300, 0, 57], N=256, K=512), False
    yield "all-on-one-expert", dict(sizes=[0, 0, 1000, 0], N=384, K=384), False
    yield "offsets0>0-and-tail", dict(sizes=[70, 130, 5], N=256, K=256, lead=37, tail=50), False
    yield "N160-tail", dict(sizes=[200, 77, 129], N=160, K=256), False
    yield "K256", dict(sizes=[128, 256, 1], N=512, K=256), False
    yield "K128-single-block", dict(sizes=[64, 300], N=256, K=128), False
    yield "M-not-mult-128", dict(sizes=[333, 411, 19, 250], N=1024, K=1024, tail=3), False
    yield "E256-ragged-small", dict(sizes=list(group_sizes(4096, 256, "zipf")), N=256, K=256), False
    routings = ["uniform"] if quick else ["uniform", "zipf"]
    for routing in routings:
        for K, N, tag in ((7168, 4096, "gate_up"), (2048, 7168, "down")):
            yield f"{tag}-{routing}", dict(sizes=list(group_sizes(16384, E, routing)), N=N, K=K), True


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stages", type=int, nargs="+", default=[4])
    ap.add_argument("--case", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)} cap {torch.cuda.get_device_capability(dev)} "
          f"SMs {torch.cuda.get_device_properties(dev).multi_processor_count}", flush=True)
    t0 = time.time()
    failures = 0
    for name, spec, timed in cases(args.quick):
        if args.case and args.case not in name:
            continue
        try:
            spec = dict(spec)
            prob = make_problem(spec.pop("sizes"), spec.pop("N"), spec.pop("K"), **spec)
            ok = check(name, prob, args.stages[0])
            failures += not ok
            if timed:
                bench(name, prob, args.stages)
            del prob
        except Exception as exc:  # noqa: BLE001 - one failing case must not stop the others
            failures += 1
            msg = str(exc).replace("\n", " ")[:300]
            print(f"ERROR {name}: {type(exc).__name__}: {msg}", flush=True)
            tb = traceback.format_exc().strip().splitlines()
            print("    " + " / ".join(line.strip() for line in tb[-4:])[:300], flush=True)
        torch.cuda.empty_cache()
    print(f"done in {time.time() - t0:.1f} s, {failures} failing case(s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
