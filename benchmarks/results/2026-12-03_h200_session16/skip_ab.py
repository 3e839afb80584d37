"""Session 16: the FP8-block Gluon kernel with and without ``skip_empty`` (consumers skip the wgmma of a half tile
with no row of its expert), one process, interleaved A B A B (``do_bench`` medians, ms). GEMMs: DeepSeek-V3-like rows
(E=256, T=4096 top-8 of random logits: M=32768, ~128 rows an expert) and E=32 M=16384 uniform / Zipf, gate_up (K=7168,
N=4096) and down (K=2048, N=7168); outputs checked bit-identical. Layer: DeepSeek-V3's torch FP8-block layer at T=4096
with the dispatch's launcher patched to ``skip_empty=False`` for the B runs."""
import functools, os, sys
import numpy as np
import torch, triton
sys.path.insert(0, os.getcwd())
import moe_torch
from benchmarks.specs import group_sizes
from moe_torch.ops.grouped_gemm import gluon as G
dev, bf16 = "cuda", torch.bfloat16
bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
g = torch.Generator(device=dev).manual_seed(0)
ds_sizes = torch.bincount(torch.randn(4096, 256, device=dev, generator=g).topk(8, dim=-1).indices.flatten(),
                          minlength=256).cpu().numpy()
print("dsv3-like rows an expert: min", ds_sizes.min(), "max", ds_sizes.max(), "128-row tiles",
      int(np.ceil(ds_sizes / 128).sum()), "empty halves", int(((ds_sizes % 128) > 0).sum() - ((ds_sizes % 128) > 64).sum()),
      flush=True)
cases = [("dsv3-like", ds_sizes), ("E32-uniform", group_sizes(16384, 32, "uniform")),
         ("E32-zipf", group_sizes(16384, 32, "zipf"))]
for tag, sizes in cases:
    E, M = len(sizes), int(sizes.sum())
    off = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int32, device=dev)
    x = torch.randn(M, 7168, device=dev, generator=g).to(bf16)
    xq_up, xs_up = moe_torch.per_token_group_quant_fp8(x, 128)
    xq_dn, xs_dn = moe_torch.per_token_group_quant_fp8(x[:, :2048].contiguous(), 128)
    for name, N, K, xq, xs in (("gate_up", 4096, 7168, xq_up, xs_up), ("down", 7168, 2048, xq_dn, xs_dn)):
        w = (torch.randn(E, N, K, device=dev, generator=g) * K ** -0.5).to(bf16)
        wq, ws = moe_torch.quantize_weight_fp8(w, "block")
        del w
        f = lambda skip: G.grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, num_stages=5, skip_empty=skip)
        same = torch.equal(f(True), f(False))
        ms = {True: [], False: []}
        for _ in range(2):
            for skip in (True, False):
                ms[skip].append(bench(lambda: f(skip)))
        print(f"{tag:12s} {name:7s} bit-identical={same} skip {ms[True][0]:.3f}/{ms[True][1]:.3f} | "
              f"no-skip {ms[False][0]:.3f}/{ms[False][1]:.3f}", flush=True)
        del wq, ws
        torch.cuda.empty_cache()
    del x, xq_up, xq_dn
from moe_contract import get_preset
config = get_preset("deepseek-v3").config(quant="fp8_block")
n, H, I = config.num_total_experts, config.hidden_size, config.intermediate_size
w13 = (torch.randn(n, 2 * I, H, generator=g, device=dev) * H ** -0.5).to(bf16)
w2 = (torch.randn(n, H, I, generator=g, device=dev) * I ** -0.5).to(bf16)
w13, s13, w2, s2 = moe_torch.quantize_layer_weights(w13, w2, config)
bias = 0.1 * torch.randn(config.num_experts, generator=g, device=dev)
x = torch.randn(4096, H, generator=g, device=dev).to(bf16)
logits = torch.randn(4096, config.num_experts, generator=g, device=dev)
f = lambda: moe_torch.moe_forward(x, logits, w13, w2, config, w13_scale=s13, w2_scale=s2, e_score_correction_bias=bias,
                                  implementation="triton")
orig = G.grouped_gemm_gluon_fp8_block
out = []
for skip in (True, False, True, False):
    G.grouped_gemm_gluon_fp8_block = orig if skip else functools.partial(orig, skip_empty=False)
    out.append(f"{'skip' if skip else 'no-skip'} {bench(f):.3f}")
G.grouped_gemm_gluon_fp8_block = orig
print("layer deepseek-v3 fp8_block T=4096 torch: " + " | ".join(out), flush=True)
