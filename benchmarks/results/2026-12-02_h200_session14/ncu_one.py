"""Run one Gluon / Triton grouped GEMM a few times (for ncu): argv: kind(block|rowwise|triton_block) shape(gate_up|down) routing."""
import sys, os, torch
sys.path.insert(0, os.getcwd())
from benchmarks.probe_gluon_gemm import make_problem, gluon_call
from benchmarks.specs import group_sizes
import moe_torch
kind, shape, routing = sys.argv[1:4]
K, N = {"gate_up": (7168, 4096), "down": (2048, 7168)}[shape]
dt = "fp8" if kind.startswith("rowwise") else "fp8_block"
prob = make_problem(list(group_sizes(16384, 32, routing)), N, K, dtype=dt)
for _ in range(3):
    if kind == "triton_block":
        os.environ["EPMOE_TRITON_GLUON_FP8_BLOCK"] = "0"
        xq, wq, off, xs, ws = prob
        moe_torch.grouped_gemm(xq, wq, off, x_scale=xs, w_scale=ws, out_dtype=torch.bfloat16, implementation="triton")
    else:
        gluon_call(dt, prob, 5 if dt == "fp8_block" else 4, 128)
torch.cuda.synchronize()
print("ok")
