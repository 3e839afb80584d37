"""An ``ncu`` target: the bf16 down GEMM (E=32, M=16384, K=2048, N=7168, uniform rows) by one framework's default
dispatch, run twice (profile the second launch). Usage: ``python3 ncu_bf16.py jax|torch``."""
import sys

M, E, K, N = 16384, 32, 2048, 7168
if sys.argv[1] == "jax":
    import jax
    import jax.numpy as jnp
    import moe_pallas

    k = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(k[0], (M, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (E, N, K), jnp.float32) * K**-0.5).astype(jnp.bfloat16)
    off = jnp.arange(E + 1, dtype=jnp.int32) * (M // E)
    f = jax.jit(lambda x, w, o: moe_pallas.grouped_gemm(x, w, o, implementation="pallas_mosaic_gpu"))
    for _ in range(2):
        jax.block_until_ready(f(x, w, off))
else:
    import torch
    import moe_torch

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(E, N, K, device="cuda", generator=g) * K**-0.5).to(torch.bfloat16)
    off = torch.arange(E + 1, dtype=torch.int32, device="cuda") * (M // E)
    for _ in range(2):
        moe_torch.grouped_gemm(x, w, off, implementation="triton")
    torch.cuda.synchronize()
