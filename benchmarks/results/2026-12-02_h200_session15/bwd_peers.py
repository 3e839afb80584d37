"""dgrad / wgrad timings, bf16, E=32 uniform (or zipf) rows: torch ours, torch._grouped_mm (cuBLAS), JAX ours (default
backend).  argv: shape(gate_up|down) [routing] [--jax-only|--torch-only] [--wgrad-cfg bm,bn,bk,stages,gbn[,ws]]"""
import sys, os, time
sys.path.insert(0, os.getcwd())
import numpy as np
from benchmarks.specs import group_sizes
shape = sys.argv[1]; routing = sys.argv[2] if len(sys.argv) > 2 and not sys.argv[2].startswith("--") else "uniform"
K, N = {"gate_up": (7168, 4096), "down": (2048, 7168)}[shape]
M, E = 16384, 32
counts = np.array(list(group_sizes(M, E, routing)))
offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
flops = 2 * M * N * K
res = {}
if "--jax-only" not in sys.argv:
    import torch, triton
    import moe_torch
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16, generator=g) / N ** 0.5)
    o = torch.tensor(offs, device="cuda")
    ends = o[1:].contiguous()
    dyT = dy.t()
    fns = {
        "torch ours dgrad": lambda: moe_torch.grouped_gemm_dgrad(dy, w, o),
        "torch ours wgrad": lambda: moe_torch.grouped_gemm_wgrad(x, dy, o, out_dtype=torch.bfloat16),
        "cuBLAS _grouped_mm dgrad": lambda: torch._grouped_mm(dy, w, offs=ends),
        "cuBLAS _grouped_mm wgrad": lambda: torch._grouped_mm(dyT, x, offs=ends),
    }
    ref_d = moe_torch.grouped_gemm_dgrad(dy, w, o).float(); ref_w = moe_torch.grouped_gemm_wgrad(x, dy, o).float()
    for name, f in fns.items():
      try:
        out = f().float()
        ref = ref_d if "dgrad" in name else ref_w
        err = ((out - ref).norm() / ref.norm()).item()
        ms = triton.testing.do_bench(f, warmup=25, rep=200)
        print(f"{name:28s} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  rel {err:.1e}", flush=True)
      except Exception as ex:
        print(f"{name:28s} FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
    del x, dy, w
    torch.cuda.empty_cache()
if "--torch-only" not in sys.argv:
    import jax, jax.numpy as jnp
    import moe_pallas
    from moe_pallas.ops.grouped_gemm.config import MosaicGroupedGemmConfig
    from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu_backward import grouped_gemm_wgrad_pallas_mosaic_gpu
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (M, K), jnp.bfloat16); dy = jax.random.normal(k2, (M, N), jnp.bfloat16)
    w = (jax.random.normal(k3, (E, N, K), jnp.float32) / N ** 0.5).astype(jnp.bfloat16)
    o = jnp.asarray(offs)
    def tm(f, reps=30):
        jax.block_until_ready(f()); jax.block_until_ready(f())
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter(); jax.block_until_ready(f()); ts.append(time.perf_counter() - t0)
        return float(np.median(ts)) * 1e3
    ref_w = None
    fns = {"JAX ours dgrad": jax.jit(lambda: moe_pallas.grouped_gemm_dgrad(dy, w, o)),
           "JAX ours wgrad": jax.jit(lambda: moe_pallas.grouped_gemm_wgrad(x, dy, o, out_dtype=jnp.bfloat16))}
    for a in sys.argv:
        if a.startswith("--wgrad-cfg="):
            for c in a.split("=", 1)[1].split(";"):
                v = [int(t) for t in c.split(",")]
                cfg = MosaicGroupedGemmConfig(block_m=v[0], block_n=v[1], block_k=v[2], max_concurrent_steps=v[3], grid_block_n=v[4],
                                              warp_specialized=bool(v[5]) if len(v) > 5 else False)
                fns[f"JAX mosaic wgrad {c}"] = jax.jit(lambda cfg=cfg: grouped_gemm_wgrad_pallas_mosaic_gpu(x, dy, o, out_dtype=jnp.bfloat16, config=cfg))
    for name, f in fns.items():
        try:
            out = np.asarray(f(), np.float32)
            if "wgrad" in name:
                if ref_w is None:
                    ref_w = out
                err = float(np.linalg.norm(out - ref_w) / np.linalg.norm(ref_w))
            else:
                err = 0.0
            ms = tm(f)
            print(f"{name:28s} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  rel-to-first {err:.1e}", flush=True)
        except Exception as ex:
            print(f"{name:28s} FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
