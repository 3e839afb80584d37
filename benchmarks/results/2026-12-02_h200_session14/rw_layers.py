"""torch FP8 per-token layers with the rowwise Gluon kernel on / off (EPMOE_TRITON_GLUON_FP8_ROWWISE), one process."""
import os, sys, time, torch, triton
sys.path.insert(0, os.getcwd())
import moe_torch
from moe_contract import get_preset
dev, bf16 = "cuda", torch.bfloat16
def layer(config, Ts, tag, env="EPMOE_TRITON_GLUON_FP8_ROWWISE"):
    n = config.num_total_experts
    g = torch.Generator(device=dev).manual_seed(0)
    H, I = config.hidden_size, config.intermediate_size
    w13 = torch.empty(n, 2 * I, H, device=dev, dtype=bf16); w2 = torch.empty(n, H, I, device=dev, dtype=bf16)
    for e in range(n):
        w13[e] = (torch.randn(2 * I, H, generator=g, device=dev) * H ** -0.5).to(bf16)
        w2[e] = (torch.randn(H, I, generator=g, device=dev) * I ** -0.5).to(bf16)
    w13, s13, w2, s2 = moe_torch.quantize_layer_weights(w13, w2, config)
    bias = (0.1 * torch.randn(config.num_experts, generator=g, device=dev)) if config.routing == "biased_grouped_topk" else None
    for T in Ts:
        x = torch.randn(T, H, generator=g, device=dev).to(bf16)
        logits = torch.randn(T, config.num_experts, generator=g, device=dev)
        f = lambda impl: moe_torch.moe_forward(x, logits, w13, w2, config, w13_scale=s13, w2_scale=s2,
                                               e_score_correction_bias=bias, implementation=impl)
        ref = f("reference").float()
        out = []
        for rw in ("0", "1", "0", "1"):
            os.environ[env] = rw
            y = f("triton").float()
            err = (torch.linalg.vector_norm(y - ref) / torch.linalg.vector_norm(ref)).item()
            ms = triton.testing.do_bench(lambda: f("triton"), warmup=25, rep=100, return_mode="median")
            out.append(f"rw={rw} {ms:.3f} ms err {err:.1e}")
        print(f"{tag} T={T}: " + " | ".join(out), flush=True)
    del w13, w2, s13, s2
    torch.cuda.empty_cache()
import sys as _s
if _s.argv[1:] == ["block"]:
    E = "EPMOE_TRITON_GLUON_FP8_BLOCK"
    e32 = get_preset("qwen3-30b-a3b").config(hidden_size=7168, intermediate_size=2048, num_experts=32, topk=8, quant="fp8_block")
    layer(e32, (512,), "E=32 fp8_block (gluon block on/off)", E)
    layer(get_preset("deepseek-v3").config(quant="fp8_block"), (512, 1024, 4096), "deepseek-v3 fp8_block (gluon block on/off)", E)
    layer(get_preset("deepseek-v3").config(quant="fp8_per_token"), (1024,), "deepseek-v3 fp8_per_token (rowwise on/off)")
    raise SystemExit
e32 = get_preset("qwen3-30b-a3b").config(hidden_size=7168, intermediate_size=2048, num_experts=32, topk=8, quant="fp8_per_token")
layer(e32, (512, 4096), "E=32 top-8 H=7168 I=2048 fp8_per_token")
ds = get_preset("deepseek-v3").config(quant="fp8_per_token")
layer(ds, (512, 4096), "deepseek-v3 fp8_per_token")
