"""Session 17 A/B of the Gluon FP8-block kernel's work items (``gluon.py``: ``block_m=128``, 128 x 128 tiles, vs
``block_m=64``, split-N 64 x 256 tiles), one process.

GEMMs: gate_up (K=7168, N=4096) and down (K=2048, N=7168) on the rows of: E=32 M=16384 uniform / Zipf; E=32 at 128
and 160 rows an expert; E=64 at 256 an expert; DeepSeek-V3's routed experts at T=4096 (biased grouped top-8 of
``randn`` logits with a ``0.1 N(0, 1)`` bias, the bench's draw: rows per expert from ``select_experts``). Each config
timed twice, interleaved, ``do_bench(warmup=25, rep=100, return_mode="median")``; outputs checked bit-identical
first. Layers: DeepSeek-V3's torch FP8-block layer at T=4096 with ``GLUON_SPLIT_N_MAX_ROWS_PER_EXPERT`` 0 (always 128)
and the default, toggled in-process (A B A B).
Usage: ``PYTHONPATH=. python3 splitn_ab.py [gemm] [layers]``.
"""
import os, sys
import numpy as np
import torch, triton
sys.path.insert(0, os.getcwd())
import moe_torch
import moe_torch.ops.grouped_gemm.triton as gemm_triton
from benchmarks.specs import group_sizes
from moe_contract import get_preset
from moe_torch.ops.grouped_gemm import gluon as G
dev, bf16 = "cuda", torch.bfloat16
bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")


def dsv3_sizes(T=4096, seed=0):
    config = get_preset("deepseek-v3").config(quant="fp8_block")
    g = torch.Generator(device=dev).manual_seed(seed)
    logits = torch.randn(T, config.num_experts, generator=g, device=dev)
    bias = 0.1 * torch.randn(config.num_experts, generator=g, device=dev)
    _, ids = moe_torch.select_experts(logits, **config.gate_kwargs(), e_score_correction_bias=bias,
                                      implementation="reference")
    return torch.bincount(ids.flatten().long(), minlength=config.num_experts)[:config.num_experts].cpu().numpy()


def problem(sizes, N, K):
    g = torch.Generator(device=dev).manual_seed(0)
    M, E = int(sizes.sum()), len(sizes)
    x = torch.randn(M, K, device=dev, generator=g).to(bf16)
    w = (torch.randn(E, N, K, device=dev, generator=g) * K ** -0.5).to(bf16)
    xq, xs = moe_torch.per_token_group_quant_fp8(x, 128)
    wq, ws = moe_torch.quantize_weight_fp8(w, "block")
    off = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int32, device=dev)
    return xq.contiguous(), wq.contiguous(), off, xs.contiguous(), ws.contiguous()


def gemms():
    ds = dsv3_sizes()
    print(f"DeepSeek-V3 T=4096 rows: {int(ds.sum())} over {int((ds > 0).sum())} experts, min {ds.min()} max {ds.max()}, "
          f"128-tiles {int(np.ceil(ds / 128).sum())}, 64-items {int(np.ceil(ds / 64).sum())}", flush=True)
    cases = [("E32-uniform", group_sizes(16384, 32, "uniform")), ("E32-zipf", group_sizes(16384, 32, "zipf")),
             ("E32-128each", group_sizes(4096, 32, "uniform")), ("E32-160each", group_sizes(5120, 32, "uniform")),
             ("E64-256each", group_sizes(16384, 64, "uniform")), ("dsv3-T4096", ds)]
    cfgs = {"bm128-s5": (128, 5), "bm64-s4": (64, 4), "bm64-s3": (64, 3)}
    for tag, sizes in cases:
        for name, N, K in (("gate_up", 4096, 7168), ("down", 7168, 2048)):
            args = problem(np.asarray(sizes), N, K)
            fn = lambda bm, st: G.grouped_gemm_gluon_fp8_block(*args, num_stages=st, block_m=bm)
            ref = fn(128, 5)
            same = all(torch.equal(fn(bm, st), ref) for bm, st in cfgs.values())
            ms = {k: [] for k in cfgs}
            for _ in range(2):
                for k, (bm, st) in cfgs.items():
                    ms[k].append(bench(lambda: fn(bm, st)))
            flops = 2 * int(np.sum(sizes)) * N * K
            best = min(min(v) for v in ms.values())
            print(f"{tag:12s} {name:7s} bit-identical={same} " + " | ".join(f"{k} {v[0]:.3f}/{v[1]:.3f}" for k, v in ms.items())
                  + f" | best {flops / best / 1e9:.0f} TFLOP/s", flush=True)
            del args
            torch.cuda.empty_cache()


def layers():
    config = get_preset("deepseek-v3").config(quant="fp8_block")
    n = config.num_total_experts
    g = torch.Generator(device=dev).manual_seed(0)
    H, I = config.hidden_size, config.intermediate_size
    w13 = (torch.randn(n, 2 * I, H, generator=g, device=dev) * H ** -0.5).to(bf16)
    w2 = (torch.randn(n, H, I, generator=g, device=dev) * I ** -0.5).to(bf16)
    w13, s13, w2, s2 = moe_torch.quantize_layer_weights(w13, w2, config)
    bias = 0.1 * torch.randn(config.num_experts, generator=g, device=dev)
    T = 4096
    x = torch.randn(T, H, generator=g, device=dev).to(bf16)
    logits = torch.randn(T, config.num_experts, generator=g, device=dev)
    f = lambda impl: moe_torch.moe_forward(x, logits, w13, w2, config, w13_scale=s13, w2_scale=s2,
                                           e_score_correction_bias=bias, implementation=impl)
    ref = f("reference").float()
    out = []
    default = gemm_triton.GLUON_SPLIT_N_MAX_ROWS_PER_EXPERT
    for cap in (0, default, 0, default):
        gemm_triton.GLUON_SPLIT_N_MAX_ROWS_PER_EXPERT = cap
        y = f("triton").float()
        err = (torch.linalg.vector_norm(y - ref) / torch.linalg.vector_norm(ref)).item()
        out.append(f"cap {cap}: {bench(lambda: f('triton')):.3f} ms err {err:.1e}")
    gemm_triton.GLUON_SPLIT_N_MAX_ROWS_PER_EXPERT = default
    print(f"layer deepseek-v3 fp8_block T={T}: " + " | ".join(out), flush=True)


if __name__ == "__main__":
    what = sys.argv[1:] or ["gemm", "layers"]
    if "gemm" in what:
        gemms()
    if "layers" in what:
        layers()
