"""Profile target for the grouped GEMM backward kernels (Triton) under Nsight Compute, one shape.

Runs ``grouped_gemm`` forward, ``grouped_gemm_dgrad`` and ``grouped_gemm_wgrad`` (torch, ``implementation="triton"``)
on the gate_up shape (E=32, K=7168, N=4096, bf16, uniform rows; ``--m`` rows) a few times, so that ncu can pick one
launch of each kernel:

    ncu --section SpeedOfLight --section LaunchStats --section Occupancy -k regex:'grouped_gemm' \\
        --launch-skip 3 --launch-count 3 python3 benchmarks/profile_bwd.py --m 16384

Prints each op's median time (CUDA events) when run without ncu.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

import moe_torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--e", type=int, default=32)
    p.add_argument("--k", type=int, default=7168)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dgrad-configs", default="", help="';'-list of 'block_m,block_n,block_k,warps,stages,group_m' to time")
    p.add_argument("--wgrad-configs", default="", help="';'-list of 'block_n,block_k,block_m,warps,stages' to time")
    args = p.parse_args()
    M, E, K, N = args.m, args.e, args.k, args.n
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(E, N, K, generator=g, device="cuda") * K**-0.5).to(torch.bfloat16)
    d_y = torch.randn(M, N, generator=g, device="cuda").to(torch.bfloat16)
    offsets = torch.arange(E + 1, device="cuda", dtype=torch.int32) * (M // E)
    ops = {
        "forward": lambda: moe_torch.grouped_gemm(x, w, offsets, implementation="triton"),
        "dgrad": lambda: moe_torch.grouped_gemm_dgrad(d_y, w, offsets, implementation="triton"),
        "wgrad": lambda: moe_torch.grouped_gemm_wgrad(x, d_y, offsets, implementation="triton"),
    }
    for _ in range(args.reps):  # ncu: --launch-skip past the first (compiling) round
        for f in ops.values():
            f()
    torch.cuda.synchronize()
    flops = 2 * M * N * K
    if args.dgrad_configs:  # a quick probe of dgrad tile configs (block_m, block_n over K, block_k over N, warps, stages, group_m)
        from moe_torch.ops.grouped_gemm.config import GroupedGemmConfig, heuristic_grouped_gemm_dgrad_config
        from moe_torch.ops.grouped_gemm.triton_backward import grouped_gemm_dgrad_triton

        print("dgrad heuristic:", heuristic_grouped_gemm_dgrad_config(M, N, K, E, 16), flush=True)
        for spec in args.dgrad_configs.split(";"):
            bm, bn, bk, nw, ns, gm = (int(v) for v in spec.split(","))
            cfg = GroupedGemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, group_m=gm)
            try:
                f = lambda: grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.bfloat16, cfg)
                ref = ops["dgrad"]()
                err = float((f().float() - ref.float()).norm() / ref.float().norm())
                ms = triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")
                print(f"dgrad {spec}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s (rel diff vs default {err:.1e})", flush=True)
            except Exception as exc:  # noqa: BLE001 - a probe: report and go on
                print(f"dgrad {spec}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    if args.wgrad_configs:  # a quick probe of wgrad tile configs (block_n over N, block_k over K, block_m rows, warps, stages)
        from moe_torch.ops.grouped_gemm.config import GroupedGemmWgradConfig, heuristic_grouped_gemm_wgrad_config
        from moe_torch.ops.grouped_gemm.triton_backward import grouped_gemm_wgrad_triton

        print("wgrad heuristic:", heuristic_grouped_gemm_wgrad_config(M, N, K, E, 16), flush=True)
        ref = ops["wgrad"]().float()
        for spec in args.wgrad_configs.split(";"):
            bn, bk, bm, nw, ns = (int(v) for v in spec.split(","))
            cfg = GroupedGemmWgradConfig(block_n=bn, block_k=bk, block_m=bm, num_warps=nw, num_stages=ns)
            for out_dtype in (torch.float32, torch.bfloat16):
                try:
                    f = lambda: grouped_gemm_wgrad_triton(x, d_y, offsets, out_dtype, cfg)  # noqa: E731
                    err = float((f().float() - ref).norm() / ref.norm())
                    ms = triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")
                    print(f"wgrad {spec} -> {str(out_dtype)[6:]}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s "
                          f"(rel diff vs default {err:.1e})", flush=True)
                except Exception as exc:  # noqa: BLE001 - a probe: report and go on
                    print(f"wgrad {spec}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    for name, f in ops.items():
        ms = triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")
        print(f"{name:8s} M={M} E={E} K={K} N={N}: {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
