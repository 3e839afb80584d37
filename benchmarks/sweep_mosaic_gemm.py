"""Sweep MosaicGroupedGemmConfig on the benchmark GEMM problems (GPU machine); JSON rows to $OUT/mosaic_sweep.json.

Usage: PYTHONPATH=. python3 benchmarks/sweep_mosaic_gemm.py SECONDS  (stops starting configs after SECONDS)
Timing: jax.experimental.mosaic.gpu.profiler.measure (CUPTI), median of 10. Used for the heuristic in
moe_pallas/ops/grouped_gemm/config.py (BENCHMARKS.md).
"""
import os, functools, sys, json, itertools, time
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE","false")
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.mosaic.gpu import profiler
from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu import grouped_gemm_pallas_mosaic_gpu as mos
from moe_pallas.ops.grouped_gemm.config import MosaicGroupedGemmConfig as C
E=32; out=[]; t_end=time.time()+float(sys.argv[1])
def t(f,*a,**k):
    f=jax.jit(functools.partial(f,**k)); f(*a).block_until_ready()
    _,ts=profiler.measure(f,iterations=10)(*a); return float(np.median(ts))
for dtype,(K,N),M in itertools.product(("bf16","fp8"),((7168,4096),(2048,7168)),(256,2048,16384)):
    k1,k2=jax.random.split(jax.random.key(0))
    x=jax.random.normal(k1,(M,K),jnp.bfloat16); w=(jax.random.normal(k2,(E,N,K),jnp.float32)*K**-0.5).astype(jnp.bfloat16)
    off=jnp.arange(E+1,dtype=jnp.int32)*(M//E); kw={}
    if dtype=="fp8":
        x=x.astype(jnp.float8_e4m3fn); w=(w*16).astype(jnp.float8_e4m3fn); kw=dict(x_scale=jnp.full((M,1),0.5),w_scale=jnp.full((E,N),1/16))
    bk=64 if dtype=="bf16" else 128
    res={"default":t(mos,x,w,off,**kw)}
    for bm,bn,(mc,gb) in itertools.product((64,128),(128,256),((4,1),(5,4),(3,2))):
        if time.time()>t_end: break
        try: res[f"{bm},{bn},{mc},{gb}"]=t(mos,x,w,off,config=C(block_m=bm,block_n=bn,block_k=bk,max_concurrent_steps=mc,grid_block_n=gb),**kw)
        except Exception as e: res[f"{bm},{bn},{mc},{gb}"]=type(e).__name__
    num={k:v for k,v in res.items() if isinstance(v,float)}
    best=min(num,key=num.get)
    row=dict(dtype=dtype,K=K,N=N,M=M,default=round(res["default"],4),best=best,best_ms=round(num[best],4),all={k:(round(v,4) if isinstance(v,float) else v) for k,v in res.items()})
    out.append(row); print(json.dumps(row),flush=True)
    json.dump(out,open(os.path.join(os.environ.get("OUT","."),"mosaic_sweep.json"),"w"),indent=1)
