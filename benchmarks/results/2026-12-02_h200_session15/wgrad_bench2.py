"""Gluon wgrad (defaults) vs Triton wgrad vs cuBLAS torch._grouped_mm, bf16 in, M=16384, E=32: uniform / zipf, bf16 out;
uniform float32 out (Gluon's pointer epilogue); through the dispatch with the switch on."""
import os, sys
sys.path.insert(0, os.getcwd())
import numpy as np
import torch, triton
import moe_torch
from benchmarks.specs import group_sizes
from moe_torch.ops.grouped_gemm.gluon_backward import grouped_gemm_gluon_wgrad
os.environ.pop("EPMOE_TRITON_GLUON_WGRAD", None)
M, E = 16384, 32
for name, N, K in (("gate_up", 4096, 7168), ("down", 7168, 2048)):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
    flops = 2 * M * N * K
    for routing, odt in (("uniform", torch.bfloat16), ("zipf", torch.bfloat16), ("uniform", torch.float32)):
        counts = group_sizes(M, E, routing)
        off = torch.tensor(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32), device="cuda")
        ends = off[1:].contiguous()
        fns = {"triton (switch off)": lambda: moe_torch.grouped_gemm_wgrad(x, dy, off, out_dtype=odt),
               "gluon (defaults)": lambda: grouped_gemm_gluon_wgrad(x, dy, off, odt)}
        if odt == torch.bfloat16:
            fns = {"cuBLAS _grouped_mm": lambda: torch._grouped_mm(dy.t(), x, offs=ends), **fns}
        ref = None
        for label, f in fns.items():
            try:
                out = f().float()
                ref = out if ref is None else ref
                err = ((out - ref).norm() / ref.norm()).item()
                ms = triton.testing.do_bench(f, warmup=10, rep=60)
                print(f"{name:8s} {routing:8s} {str(odt)[6:]:9s} {label:20s} {ms:7.3f} ms {flops / ms / 1e9:5.0f} "
                      f"TFLOP/s rel-vs-first {err:.1e}", flush=True)
            except Exception as ex:
                print(f"{name:8s} {routing} {label:20s} FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
    off = torch.arange(0, M + 1, M // E, device="cuda", dtype=torch.int32)
    os.environ["EPMOE_TRITON_GLUON_WGRAD"] = "1"
    f = lambda: moe_torch.grouped_gemm_wgrad(x, dy, off, out_dtype=torch.bfloat16)
    ms = triton.testing.do_bench(f, warmup=10, rep=60)
    print(f"{name:8s} uniform  bfloat16  dispatch, switch on  {ms:7.3f} ms", flush=True)
    os.environ.pop("EPMOE_TRITON_GLUON_WGRAD")
    del x, dy
    torch.cuda.empty_cache()
