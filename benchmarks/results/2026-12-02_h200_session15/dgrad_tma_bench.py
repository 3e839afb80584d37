"""torch dgrad ``d_x = d_y @ w[e]`` on the H200: the pointer kernel, its TMA variant (default on / off through
EPMOE_TRITON_TMA_DGRAD, and candidate TMA configs) and cuBLAS ``torch._grouped_mm(d_y, w, offs=offsets[1:])``.
bf16, E=32 uniform rows (benchmarks/specs.py: group_sizes), shapes gate_up (N=4096 contraction, K=7168 out) and down
(N=7168, K=2048). Each variant is checked against the pointer kernel's result (rel Frobenius) and timed with
triton.testing.do_bench(warmup=25, rep=150); one line a variant.  argv: [M (default 16384)] [routing (uniform)]"""
import dataclasses
import os
import sys

sys.path.insert(0, os.getcwd())
import numpy as np
import torch
import triton

from benchmarks.specs import group_sizes
from moe_torch.ops.grouped_gemm import triton_backward as gb
from moe_torch.ops.grouped_gemm.config import DGRAD_WIDE_CONFIG, GroupedGemmConfig, heuristic_grouped_gemm_dgrad_config
from moe_torch.ops.triton_common import TMA_DGRAD_ENV

M = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
routing = sys.argv[2] if len(sys.argv) > 2 else "uniform"
E = 32
print(torch.cuda.get_device_name(), "M", M, "E", E, routing, flush=True)
TMA_CANDIDATES = {
    "tma 128x256x64 w8 s3 g8 (default at M>=8192)": dataclasses.replace(DGRAD_WIDE_CONFIG, tma=True),
    "tma 128x256x64 w8 s3 g4 persistent": GroupedGemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8,
                                                            num_stages=3, group_m=4, persistent=True, tma=True),
    "tma 128x256x64 w8 s4 g4 persistent": GroupedGemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8,
                                                            num_stages=4, group_m=4, persistent=True, tma=True),
    "tma 128x256x64 w8 s3 g4": GroupedGemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3,
                                                 group_m=4, tma=True),
    "tma 128x128x64 w8 s4 g4 persistent": GroupedGemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8,
                                                            num_stages=4, group_m=4, persistent=True, tma=True),
    "tma 128x256x64 w8 s3 g4 persistent ws": GroupedGemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8,
                                                               num_stages=3, group_m=4, persistent=True, tma=True,
                                                               warp_specialize=True),
}
counts = np.array(list(group_sizes(M, E, routing)))
offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
for shape, (N, K) in {"gate_up": (4096, 7168), "down": (7168, 2048)}.items():
    g = torch.Generator(device="cuda").manual_seed(0)
    d_y = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16, generator=g) / N ** 0.5
    o = torch.tensor(offs, device="cuda")
    ends = o[1:].contiguous()
    flops = 2 * M * N * K
    pointer_cfg = heuristic_grouped_gemm_dgrad_config(M, N, K, E, 16)
    ref = gb.grouped_gemm_dgrad_triton(d_y, w, o, None, torch.bfloat16, pointer_cfg).float()
    default = gb._dgrad_config(M, N, K, E, 16, False, w_fp8=False, sm90=gb._is_sm90(d_y.device), tma=True)
    print(f"--- {shape} N={N} K={K}; default with the switch on: {default}", flush=True)
    fns = {
        "pointer (heuristic, explicit)": (None, lambda: gb.grouped_gemm_dgrad_triton(d_y, w, o, None, torch.bfloat16,
                                                                                      pointer_cfg)),
        "default, EPMOE_TRITON_TMA_DGRAD=1": ("1", lambda: gb.grouped_gemm_dgrad_triton(d_y, w, o, None, torch.bfloat16)),
        "default, EPMOE_TRITON_TMA_DGRAD=0": ("0", lambda: gb.grouped_gemm_dgrad_triton(d_y, w, o, None, torch.bfloat16)),
        **{name: (None, lambda cfg=cfg: gb.grouped_gemm_dgrad_triton(d_y, w, o, None, torch.bfloat16, cfg))
           for name, cfg in TMA_CANDIDATES.items()},
        "cuBLAS torch._grouped_mm": (None, lambda: torch._grouped_mm(d_y, w, offs=ends)),
    }
    for name, (env, f) in fns.items():
        if env is not None:
            os.environ[TMA_DGRAD_ENV] = env
        else:
            os.environ.pop(TMA_DGRAD_ENV, None)
        try:
            out = f().float()
            err = ((out - ref).norm() / ref.norm()).item()
            ms = triton.testing.do_bench(f, warmup=25, rep=150)
            print(f"{shape:7s} {name:46s} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  rel vs pointer {err:.1e}",
                  flush=True)
        except Exception as ex:
            print(f"{shape:7s} {name:46s} FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
    os.environ.pop(TMA_DGRAD_ENV, None)
    del d_y, w, ref
    torch.cuda.empty_cache()
