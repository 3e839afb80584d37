"""Per-GEMM errors of the torch FP8 per-token layer with the rowwise kernel: hooks the gluon launcher."""
import sys, os, torch
sys.path.insert(0, os.getcwd())
import moe_torch
import moe_torch.ops.grouped_gemm.gluon as Gm
import moe_torch.ops.grouped_gemm.triton as T
from moe_contract import get_preset
orig = Gm.grouped_gemm_gluon_fp8_rowwise
COUNT = [0]
def hooked(xq, wq, off, xs, ws, out_dtype=torch.bfloat16, **kw):
    y = orig(xq, wq, off, xs, ws, out_dtype, **kw)
    COUNT[0] += 1
    if COUNT[0] > 2:
        return y
    ref = moe_torch.grouped_gemm(xq, wq, off, x_scale=xs, w_scale=ws, out_dtype=out_dtype, implementation="reference")
    os.environ["EPMOE_TRITON_GLUON_FP8_ROWWISE"] = "0"
    tri = moe_torch.grouped_gemm(xq, wq, off, x_scale=xs, w_scale=ws, out_dtype=out_dtype, implementation="triton")
    os.environ["EPMOE_TRITON_GLUON_FP8_ROWWISE"] = "1"
    f = lambda a: (torch.linalg.vector_norm(a.float() - ref.float()) / torch.linalg.vector_norm(ref.float())).item()
    print(f"  gemm K={xq.shape[1]} N={wq.shape[1]} M_cap={xq.shape[0]} off0={int(off[0])} offE={int(off[-1])} kw={kw} rel_err gluon={f(y):.2e} triton={f(tri):.2e} xs[{xs.min().item():.2e},{xs.max().item():.2e}]", flush=True)
    return y
Gm.grouped_gemm_gluon_fp8_rowwise = hooked
os.environ["EPMOE_TRITON_GLUON_FP8_ROWWISE"] = "1"
from benchmarks import bench
for pr, bn in ((0, 128), (0, 256), (2, 128), (4, 128), (8, 128)):
    T.GLUON_ROWWISE_PROMOTE, T.GLUON_ROWWISE_BLOCK_N = pr, bn
    COUNT[0] = 0
    print(f"promote={pr} bn={bn}", flush=True)
    bench.main(["--what", "layer", "--backends", "ours-torch-triton", "--ts", "4096", "--layer-quants", "fp8_per_token", "--out", f"/tmp/err{pr}_{bn}", "--rep-ms", "5", "--warmup-ms", "1"])
