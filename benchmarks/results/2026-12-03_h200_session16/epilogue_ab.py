"""Session 16 A/B of the Gluon FP8 kernels' epilogues (``gluon.py``: ``epilogue="pointer"`` vs ``"tma"``), one process.

GEMMs: E=32, M=16384, gate_up (K=7168, N=4096) and down (K=2048, N=7168), uniform and Zipf rows; each config timed
twice, interleaved (A B A B), ``do_bench(warmup=25, rep=100, return_mode="median")``; the TMA output checked
bit-identical to the pointer output first. Layers (``layers`` argument): the torch E=32 FP8-block / FP8 per-token
layer at T=4096 and DeepSeek-V3's FP8-block layer at T=4096, ``gluon.DEFAULT_EPILOGUE`` toggled in-process.
Usage: ``PYTHONPATH=. python3 epilogue_ab.py [gemm] [layers]``.
"""
import os, sys
import numpy as np
import torch, triton
sys.path.insert(0, os.getcwd())
import moe_torch
from benchmarks.specs import group_sizes
from moe_torch.ops.grouped_gemm import gluon as G
dev, bf16 = "cuda", torch.bfloat16
bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")


def problem(M, E, N, K, routing, kind):
    g = torch.Generator(device=dev).manual_seed(0)
    sizes = group_sizes(M, E, routing)
    x = torch.randn(M, K, device=dev, generator=g).to(bf16)
    w = (torch.randn(E, N, K, device=dev, generator=g) * K ** -0.5).to(bf16)
    if kind == "block":
        xq, xs = moe_torch.per_token_group_quant_fp8(x, 128)
        wq, ws = moe_torch.quantize_weight_fp8(w, "block")
    else:
        xq, xs = moe_torch.per_token_quant_fp8(x)
        wq, ws = moe_torch.quantize_weight_fp8(w, "per_channel")
    off = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int32, device=dev)
    return xq.contiguous(), wq.contiguous(), off, xs.contiguous(), ws.contiguous()


def gemms():
    for kind in ("block", "rowwise"):
        for name, N, K in (("gate_up", 4096, 7168), ("down", 7168, 2048)):
            for routing in ("uniform", "zipf"):
                args = problem(16384, 32, N, K, routing, kind)
                if kind == "block":
                    cfgs = {"ptr-5": ("pointer", 5), "tma-5": ("tma", 5), "tma-4": ("tma", 4)}
                    fn = lambda ep, st: G.grouped_gemm_gluon_fp8_block(*args, num_stages=st, epilogue=ep)
                else:
                    cfgs = {"ptr-4": ("pointer", 4), "tma-4": ("tma", 4), "tma-5": ("tma", 5)}
                    fn = lambda ep, st: G.grouped_gemm_gluon_fp8_rowwise(*args, num_stages=st, block_n=128,
                                                                         promote=2, epilogue=ep)
                ref = fn("pointer", cfgs[next(iter(cfgs))][1])
                same = all(torch.equal(fn(ep, st), ref) for ep, st in cfgs.values())
                ms = {k: [] for k in cfgs}
                for _ in range(2):
                    for k, (ep, st) in cfgs.items():
                        ms[k].append(bench(lambda: fn(ep, st)))
                print(f"{kind:7s} {name:7s} {routing:7s} bit-identical={same} " +
                      " | ".join(f"{k} {v[0]:.3f}/{v[1]:.3f}" for k, v in ms.items()), flush=True)
                del args
                torch.cuda.empty_cache()


def layers():
    from moe_contract import get_preset
    e32 = lambda q: get_preset("qwen3-30b-a3b").config(hidden_size=7168, intermediate_size=2048, num_experts=32,
                                                       topk=8, quant=q)
    for tag, config in (("E=32 fp8_block", e32("fp8_block")), ("E=32 fp8_per_token", e32("fp8_per_token")),
                        ("deepseek-v3 fp8_block", get_preset("deepseek-v3").config(quant="fp8_block"))):
        n = config.num_total_experts
        g = torch.Generator(device=dev).manual_seed(0)
        H, I = config.hidden_size, config.intermediate_size
        w13 = (torch.randn(n, 2 * I, H, generator=g, device=dev) * H ** -0.5).to(bf16)
        w2 = (torch.randn(n, H, I, generator=g, device=dev) * I ** -0.5).to(bf16)
        w13, s13, w2, s2 = moe_torch.quantize_layer_weights(w13, w2, config)
        bias = (0.1 * torch.randn(config.num_experts, generator=g, device=dev)
                if config.routing == "biased_grouped_topk" else None)
        T = 4096
        x = torch.randn(T, H, generator=g, device=dev).to(bf16)
        logits = torch.randn(T, config.num_experts, generator=g, device=dev)
        f = lambda impl: moe_torch.moe_forward(x, logits, w13, w2, config, w13_scale=s13, w2_scale=s2,
                                               e_score_correction_bias=bias, implementation=impl)
        ref = f("reference").float()
        out = []
        for ep in ("pointer", "tma", "pointer", "tma"):
            G.DEFAULT_EPILOGUE = ep
            y = f("triton").float()
            err = (torch.linalg.vector_norm(y - ref) / torch.linalg.vector_norm(ref)).item()
            out.append(f"{ep} {bench(lambda: f('triton')):.3f} ms err {err:.1e}")
        print(f"layer {tag} T={T}: " + " | ".join(out), flush=True)
        del w13, w2, s13, s2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    what = sys.argv[1:] or ["gemm", "layers"]
    if "gemm" in what:
        gemms()
    if "layers" in what:
        layers()
