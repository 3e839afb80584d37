"""Gluon wgrad vs Triton wgrad vs cuBLAS torch._grouped_mm, bf16, M=16384, E=32 uniform, bf16 out."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch, triton
import moe_torch
from moe_torch.ops.grouped_gemm.gluon_backward import grouped_gemm_gluon_wgrad
os.environ.pop("EPMOE_TRITON_GLUON_WGRAD", None)
M, E = 16384, 32
shapes = [s for s in (("gate_up", 4096, 7168), ("down", 7168, 2048)) if len(sys.argv) < 2 or s[0] in sys.argv[1:]]
for name, N, K in shapes:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
    off = torch.arange(0, M + 1, M // E, device="cuda", dtype=torch.int32)
    ends = off[1:].contiguous()
    flops = 2 * M * N * K
    ref = torch._grouped_mm(dy.t(), x, offs=ends).float()
    fns = {"cuBLAS _grouped_mm": lambda: torch._grouped_mm(dy.t(), x, offs=ends),
           "triton (switch off)": lambda: moe_torch.grouped_gemm_wgrad(x, dy, off, out_dtype=torch.bfloat16)}
    for ep, st in (("tma", 3), ("tma", 2), ("pointer", 4), ("pointer", 3)):
        fns[f"gluon {ep} s{st}"] = lambda ep=ep, st=st: grouped_gemm_gluon_wgrad(x, dy, off, torch.bfloat16,
                                                                                 epilogue=ep, num_stages=st)
    for label, f in fns.items():
        try:
            out = f().float()
            err = ((out - ref).norm() / ref.norm()).item()
            ms = triton.testing.do_bench(f, warmup=10, rep=60)
            print(f"{name:8s} {label:22s} {ms:7.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s rel-vs-cuBLAS {err:.1e}",
                  flush=True)
        except Exception as ex:
            print(f"{name:8s} {label:22s} FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
    del x, dy, ref
    torch.cuda.empty_cache()
