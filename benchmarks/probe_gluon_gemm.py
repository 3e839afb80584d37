"""GPU probe of the Gluon FP8 grouped GEMMs (``moe_torch/ops/grouped_gemm/gluon.py``) on one H200 (sm_90a).

Checks the kernel against ``grouped_gemm(..., implementation="reference")`` (relative Frobenius error of the float32
outputs <= 1e-2, rows no expert owns exactly zero) on edge cases, then on the benchmark shapes (E = 32, M = 16384;
gate_up K = 7168, N = 4096; down K = 2048, N = 7168; uniform and zipf routing) and times it against the Triton kernel
(``implementation="triton"``) with ``triton.testing.do_bench(warmup=25, rep=100, return_mode="median")``. One line a
case; a failing case prints its exception type and message and the probe goes on.

Usage (repo root, on the GPU machine)::

    PYTHONPATH=. python3 benchmarks/probe_gluon_gemm.py [--dtype fp8_block|fp8] [--quick] [--stages 4]
        [--block-n 128 256] [--promote 0 2 4] [--case SUBSTRING]

``--dtype``: ``fp8_block`` (default: 1 x 128 / 128 x 128 block scales, ``grouped_gemm_gluon_fp8_block``) or ``fp8``
(per-token x per-channel scales, ``grouped_gemm_gluon_fp8_rowwise``; its edge cases add K not a multiple of 128, and
its timing adds ``torch._scaled_grouped_mm`` with ``use_fast_accum=True``, the accumulation of ``--promote 0``, where
torch has it). The Triton kernel is timed with the matching Gluon switch off (``EPMOE_TRITON_GLUON_FP8_BLOCK=0`` /
``EPMOE_TRITON_GLUON_FP8_ROWWISE=0``). ``--quick``: edge cases and the uniform benchmark shapes only. ``--stages``: the
kernel's ``num_stages`` (several: ``--stages 4 5``; the first is checked, all are timed). ``--block-n``: the rowwise
kernel's tile widths (``--dtype fp8`` only; the first is checked, all are timed). ``--promote``: the rowwise kernel's
promotion groups (every one is checked, at block_n 128 when > 0, and timed at block_n 128; default 2, the
dispatch's; 0: no promotion, the only setting timed at block_n 256). ``--case``: run
only the cases whose name contains it.
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
from moe_torch.ops.grouped_gemm.gluon import grouped_gemm_gluon_fp8_block, grouped_gemm_gluon_fp8_rowwise

TOL = 1e-2


def make_problem(sizes, N, K, *, lead=0, tail=0, seed=0, dev="cuda", dtype="fp8_block"):
    """Quantized inputs (``dtype`` ``fp8_block`` or ``fp8``): ``lead`` unowned rows before expert 0, ``tail`` after
    the last expert."""
    g = torch.Generator(device=dev).manual_seed(seed)
    E = len(sizes)
    M_cap = lead + int(sum(sizes)) + tail
    x = torch.randn(M_cap, K, device=dev, dtype=torch.bfloat16, generator=g)
    w = (torch.randn(E, N, K, device=dev, dtype=torch.bfloat16, generator=g) * K ** -0.5).to(torch.bfloat16)
    if dtype == "fp8":
        xq, xs = moe_torch.per_token_quant_fp8(x)
        wq, ws = moe_torch.quantize_weight_fp8(w, "per_channel")
    else:
        xq, xs = moe_torch.per_token_group_quant_fp8(x, 128)
        wq, ws = moe_torch.quantize_weight_fp8(w, "block")
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]) + lead, dtype=torch.int32, device=dev)
    return xq.contiguous(), wq.contiguous(), offsets, xs.contiguous(), ws.contiguous()


def gluon_call(dtype, prob, stages, block_n, promote=0):
    xq, wq, off, xs, ws = prob
    if dtype == "fp8":
        return grouped_gemm_gluon_fp8_rowwise(xq, wq, off, xs, ws, torch.bfloat16, num_stages=stages, block_n=block_n,
                                              promote=promote)
    return grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, torch.bfloat16, num_stages=stages)


def check(name, prob, stages, dtype="fp8_block", block_n=128, promote=0):
    xq, wq, off, xs, ws = prob
    y = gluon_call(dtype, prob, stages, block_n, promote)
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


def bench(name, prob, stages_list, dtype="fp8_block", block_ns=(128,), promotes=(0,)):
    import triton

    xq, wq, off, xs, ws = prob
    M = int(off[-1] - off[0])
    N, K = wq.shape[1], wq.shape[2]
    flops = 2.0 * M * N * K
    out = []
    for bn in (block_ns if dtype != "fp8_block" else (128,)):
        for st in stages_list:
            for pr in (promotes if dtype == "fp8" else (0,)):
                if (pr and bn != 128) or st > (4 if bn == 256 else 6):
                    continue
                ms = triton.testing.do_bench(lambda: gluon_call(dtype, prob, st, bn, pr), warmup=25, rep=100,
                                             return_mode="median")
                tag = f"s={st},bn={bn}" + (f",p={pr}" if dtype == "fp8" else "") if dtype != "fp8_block" else f"s={st}"
                out.append(f"gluon[{tag}] {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
    # implementation="triton" would dispatch to the Gluon kernel: its switch off for the Triton timing
    env = "EPMOE_TRITON_GLUON_FP8_ROWWISE" if dtype == "fp8" else "EPMOE_TRITON_GLUON_FP8_BLOCK"
    saved = os.environ.get(env)
    os.environ[env] = "0"
    try:
        ms = triton.testing.do_bench(lambda: moe_torch.grouped_gemm(xq, wq, off, x_scale=xs, w_scale=ws,
                                                                    out_dtype=torch.bfloat16, implementation="triton"),
                                     warmup=25, rep=100, return_mode="median")
    finally:
        if saved is None:
            del os.environ[env]
        else:
            os.environ[env] = saved
    out.append(f"triton {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
    if dtype == "fp8" and int(off[0]) == 0:
        try:  # torch's FP8 grouped GEMM (offs: the experts' end rows; rows from offs[0] = 0), fast accumulation
            wt = wq.transpose(1, 2)
            sa, ends = xs.reshape(-1), off[1:].contiguous()
            ms = triton.testing.do_bench(lambda: torch._scaled_grouped_mm(xq, wt, sa, ws, offs=ends,
                                                                          out_dtype=torch.bfloat16,
                                                                          use_fast_accum=True),
                                         warmup=25, rep=100, return_mode="median")
            out.append(f"torch._scaled_grouped_mm {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
        except Exception as exc:  # noqa: BLE001 - optional comparison
            out.append(f"torch._scaled_grouped_mm n/a ({type(exc).__name__}: {str(exc)[:80]})")
    print(f"TIME {name}: " + " | ".join(out), flush=True)


def cases(quick, dtype="fp8_block"):
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
    if dtype == "fp8":  # K need not be a multiple of 128 (% 16 == 0): the last K box is zero-filled by TMA
        yield "K208-tail", dict(sizes=[64, 300, 5], N=200, K=208, tail=9), False
        yield "K16-one-box", dict(sizes=[130, 7], N=136, K=16, lead=5), False
        yield "K1040-tail", dict(sizes=[257, 0, 129], N=512, K=1040), False
    routings = ["uniform"] if quick else ["uniform", "zipf"]
    for routing in routings:
        for K, N, tag in ((7168, 4096, "gate_up"), (2048, 7168, "down")):
            yield f"{tag}-{routing}", dict(sizes=list(group_sizes(16384, E, routing)), N=N, K=K), True


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dtype", choices=["fp8_block", "fp8"], default="fp8_block")
    ap.add_argument("--promote", type=int, nargs="+", default=[2])
    ap.add_argument("--stages", type=int, nargs="+", default=[4])
    ap.add_argument("--block-n", type=int, nargs="+", default=[128])
    ap.add_argument("--case", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)} cap {torch.cuda.get_device_capability(dev)} "
          f"SMs {torch.cuda.get_device_properties(dev).multi_processor_count}", flush=True)
    t0 = time.time()
    failures = 0
    print(f"dtype: {args.dtype}", flush=True)
    for name, spec, timed in cases(args.quick, args.dtype):
        if args.case and args.case not in name:
            continue
        try:
            spec = dict(spec)
            prob = make_problem(spec.pop("sizes"), spec.pop("N"), spec.pop("K"), dtype=args.dtype, **spec)
            ok = True
            for pr in (args.promote if args.dtype == "fp8" else [0]):
                ok &= check(name + (f"[p={pr}]" if args.dtype == "fp8" else ""), prob, args.stages[0], args.dtype,
                            args.block_n[0] if not pr else 128, pr)
            failures += not ok
            if timed:
                bench(name, prob, args.stages, args.dtype, args.block_n, args.promote)
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
