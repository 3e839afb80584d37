"""A/B of the consumers' next-tile prefetch (PREFETCH constexpr) on the benchmark GEMMs, plus checks."""
import sys, os, torch, triton
sys.path.insert(0, os.getcwd())
import moe_torch
from moe_torch.ops.grouped_gemm import gluon as G
from benchmarks.probe_gluon_gemm import make_problem
from benchmarks.specs import group_sizes
for dt in ("fp8_block", "fp8"):
    for routing in ("uniform", "zipf"):
        for K, N, tag in ((7168, 4096, "gate_up"), (2048, 7168, "down")):
            prob = make_problem(list(group_sizes(16384, 32, routing)), N, K, dtype=dt)
            xq, wq, off, xs, ws = prob
            ref = moe_torch.grouped_gemm(xq, wq, off, x_scale=xs, w_scale=ws, out_dtype=torch.bfloat16, implementation="reference").float()
            res = []
            for pf in (False, True, False, True):
                if dt == "fp8_block":
                    f = lambda: G._launch(G._grouped_gemm_fp8_block_kernel, xq, wq, off, xs, ws, torch.bfloat16, 128, 5, None, PREFETCH=pf)
                else:
                    f = lambda: G._launch(G._grouped_gemm_fp8_rowwise_kernel, xq, wq, off, xs, ws, torch.bfloat16, 128, 4, None, BN=128, G=2, PREFETCH=pf)
                y = f().float()
                err = (torch.linalg.vector_norm(y - ref) / torch.linalg.vector_norm(ref)).item()
                ms = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
                res.append(f"pf={int(pf)} {ms:.3f} ms err {err:.1e}")
            print(f"{dt} {tag} {routing}: " + " | ".join(res), flush=True)
