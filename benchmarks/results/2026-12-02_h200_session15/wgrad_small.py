"""wgrad at small and mid M (E=32, uniform): torch Triton vs Gluon, JAX one-warpgroup vs warp-specialized Mosaic."""
import os, sys, time
sys.path.insert(0, os.getcwd())
import numpy as np
from benchmarks.specs import group_sizes
import torch, triton, moe_torch
import jax, jax.numpy as jnp
from moe_pallas.ops.grouped_gemm.config import MosaicGroupedGemmConfig
from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu_backward import grouped_gemm_wgrad_pallas_mosaic_gpu as mw
E = 32
def jt(f, reps=30):
    jax.block_until_ready(f()); jax.block_until_ready(f()); ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); jax.block_until_ready(f()); ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3
for shape, (K, N) in (("gate_up", (7168, 4096)), ("down", (2048, 7168))):
    for M in (256, 2048, 16384):
        offs = np.concatenate([[0], np.cumsum(list(group_sizes(M, E, "uniform")))]).astype(np.int32)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16); dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        o = torch.tensor(offs, device="cuda")
        r = {}
        for sw in ("0", "1"):
            os.environ["EPMOE_TRITON_GLUON_WGRAD"] = sw
            r["torch-" + ("gluon" if sw == "1" else "triton")] = triton.testing.do_bench(
                lambda: moe_torch.grouped_gemm_wgrad(x, dy, o, out_dtype=torch.bfloat16), warmup=25, rep=150)
        r["cuBLAS"] = triton.testing.do_bench(lambda: torch._grouped_mm(dy.t(), x, offs=o[1:]), warmup=25, rep=150)
        del x, dy; torch.cuda.empty_cache()
        xj = jax.random.normal(jax.random.key(0), (M, K), jnp.bfloat16); dyj = jax.random.normal(jax.random.key(1), (M, N), jnp.bfloat16)
        oj = jnp.asarray(offs)
        one = MosaicGroupedGemmConfig(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=4)
        for name, cfg in (("jax-one_wg", one), ("jax-ws", None)):
            f = jax.jit(lambda cfg=cfg: mw(xj, dyj, oj, out_dtype=jnp.bfloat16, config=cfg))
            r[name] = jt(f)
        del xj, dyj
        print(f"{shape:8s} M={M:6d} " + "  ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
