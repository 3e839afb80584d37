"""Times the JAX grouped GEMM backward kernels (Mosaic GPU and Pallas-Triton) and their configs, one shape.

Times ``grouped_gemm`` forward, ``grouped_gemm_dgrad`` and ``grouped_gemm_wgrad`` (bf16, E experts, uniform
rows, ``--m`` rows; gate_up K=7168 N=4096 by default) for each backend, and with ``--mosaic-wgrad`` /
``--mosaic-dgrad`` a few Mosaic GPU configs, each checked against the Pallas-Triton result:

    python3 benchmarks/profile_bwd_jax.py --m 16384 --mosaic-wgrad '128,128,64,4,4;128,128,128,3,4'

Config strings are ``block_m,block_n,block_k,max_concurrent_steps,grid_block_n`` (MosaicGroupedGemmConfig).
Medians of ``benchmarks/harness.py``-style CUDA-synchronised loops; a diagnostic tool, not a benchmark row.

``--dtype fp8`` / ``fp8_block`` (FP8 per token x per channel, or DeepSeek-V3's 1 x 128 x 128 x 128 blocks): the forward
only (the backward GEMMs are 16-bit), each backend's default and the ``--mosaic-fwd`` configs; with ``--ncu`` the
Mosaic GPU forward twice, an ``ncu`` target for the FP8 kernel::

    ncu --set full -k regex:mosaic python3 benchmarks/profile_bwd_jax.py --ncu --dtype fp8_block
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import moe_pallas
from moe_pallas.ops.grouped_gemm.config import MosaicGroupedGemmConfig
from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu_backward import (grouped_gemm_dgrad_pallas_mosaic_gpu,
                                                                     grouped_gemm_wgrad_pallas_mosaic_gpu)


def _time(f, reps: int = 20) -> float:
    jax.block_until_ready(f())
    jax.block_until_ready(f())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f())
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--e", type=int, default=32)
    p.add_argument("--k", type=int, default=7168)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--ncu", action="store_true", help="run the Mosaic GPU forward, dgrad and wgrad twice each and stop "
                   "(an ncu target: every launch of the program is a candidate, no timing loops)")
    p.add_argument("--mosaic-wgrad", default="", help="';'-list of Mosaic wgrad configs")
    p.add_argument("--mosaic-dgrad", default="", help="';'-list of Mosaic dgrad configs")
    p.add_argument("--only-configs", action="store_true", help="skip the default backends' rows (the configs' rel diff "
                   "is then against the first config of each kind)")
    p.add_argument("--mosaic-fwd", default="", help="';'-list of Mosaic forward configs (a 6th value 1: warp_specialized; a 7th value 1: split_m)")
    p.add_argument("--pt-dgrad", default="", help="';'-list of Pallas-Triton dgrad configs 'block_m,block_n,block_k,warps,stages'")
    p.add_argument("--pt-wgrad", default="", help="';'-list of Pallas-Triton wgrad configs 'block_m,block_n,block_k,warps,stages'")
    p.add_argument("--dtype", choices=("bf16", "fp8", "fp8_block"), default="bf16",
                   help="the forward's inputs (fp8 / fp8_block: the forward only)")
    args = p.parse_args()
    M, E, K, N = args.m, args.e, args.k, args.n
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (M, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (E, N, K), jnp.float32) * K**-0.5).astype(jnp.bfloat16)
    d_y = jax.random.normal(keys[2], (M, N), jnp.float32).astype(jnp.bfloat16)
    offsets = jnp.arange(E + 1, dtype=jnp.int32) * (M // E)
    flops = 2 * M * N * K
    if args.dtype != "bf16":
        fp8_forward(args, x, w, offsets, flops)
        return
    if args.ncu:
        for f in (lambda: moe_pallas.grouped_gemm(x, w, offsets, implementation="pallas_mosaic_gpu"),
                  lambda: moe_pallas.grouped_gemm_dgrad(d_y, w, offsets, implementation="pallas_mosaic_gpu"),
                  lambda: moe_pallas.grouped_gemm_wgrad(x, d_y, offsets, out_dtype=jnp.bfloat16,
                                                        implementation="pallas_mosaic_gpu")):
            jax.block_until_ready(f())
            jax.block_until_ready(f())
        return
    refs = {}
    for impl in () if args.only_configs else ("pallas_triton", "pallas_mosaic_gpu"):
        ops = {
            "forward": jax.jit(lambda x, w, o, impl=impl: moe_pallas.grouped_gemm(x, w, o, implementation=impl)),
            "dgrad": jax.jit(lambda d, w, o, impl=impl: moe_pallas.grouped_gemm_dgrad(d, w, o, implementation=impl)),
            "wgrad": jax.jit(lambda x, d, o, impl=impl: moe_pallas.grouped_gemm_wgrad(
                x, d, o, out_dtype=jnp.bfloat16, implementation=impl)),
        }
        operands = {"forward": (x, w, offsets), "dgrad": (d_y, w, offsets), "wgrad": (x, d_y, offsets)}
        for name, f in ops.items():
            try:
                out = f(*operands[name])
                err = _rel(out, refs[name]) if name in refs else 0.0
                refs.setdefault(name, out)
                ms = _time(lambda: f(*operands[name]))
                print(f"{impl:18s} {name:8s} M={M} E={E} K={K} N={N}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s "
                      f"(rel diff vs pallas_triton {err:.1e})", flush=True)
            except Exception as exc:  # noqa: BLE001 - a probe: report and go on
                print(f"{impl:18s} {name:8s}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    for flag, kind in ((args.mosaic_wgrad, "wgrad"), (args.mosaic_dgrad, "dgrad"), (args.mosaic_fwd, "forward")):
        for spec in filter(None, flag.split(";")):
            bm, bn, bk, st, gb, *ws = (int(v) for v in spec.split(","))
            cfg = MosaicGroupedGemmConfig(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=st, grid_block_n=gb,
                                          warp_specialized=bool(ws and ws[0]), split_m=bool(len(ws) > 1 and ws[1]))
            try:
                if kind == "forward":
                    from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu import grouped_gemm_pallas_mosaic_gpu

                    f = jax.jit(lambda cfg=cfg: grouped_gemm_pallas_mosaic_gpu(x, w, offsets, config=cfg))
                elif kind == "wgrad":
                    f = jax.jit(lambda cfg=cfg: grouped_gemm_wgrad_pallas_mosaic_gpu(x, d_y, offsets, out_dtype=jnp.bfloat16,
                                                                                     config=cfg))
                else:
                    f = jax.jit(lambda cfg=cfg: grouped_gemm_dgrad_pallas_mosaic_gpu(d_y, w, offsets, config=cfg))
                out = f()
                err = _rel(out, refs.setdefault(kind, out))
                if kind == "forward":  # CUPTI kernel time, as the tuner and the FP8 probe (no dispatch)
                    from jax.experimental.mosaic.gpu import profiler

                    ms = float(np.median(profiler.measure(f, iterations=10)()[1]))
                else:
                    ms = _time(f)
                print(f"mosaic {kind} {spec}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s (rel diff {err:.1e})", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"mosaic {kind} {spec}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


    from moe_pallas.ops.grouped_gemm.config import GroupedGemmDgradConfig, GroupedGemmWgradConfig
    from moe_pallas.ops.grouped_gemm.pallas_triton_backward import (grouped_gemm_dgrad_pallas_triton,
                                                                     grouped_gemm_wgrad_pallas_triton)

    for flag, kind in ((args.pt_dgrad, "dgrad"), (args.pt_wgrad, "wgrad")):
        for spec in filter(None, flag.split(";")):
            bm, bn, bk, nw, ns = (int(v) for v in spec.split(","))
            try:
                if kind == "wgrad":
                    cfg = GroupedGemmWgradConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                    f = jax.jit(lambda cfg=cfg: grouped_gemm_wgrad_pallas_triton(x, d_y, offsets, out_dtype=jnp.bfloat16,
                                                                                 config=cfg))
                else:
                    cfg = GroupedGemmDgradConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                    f = jax.jit(lambda cfg=cfg: grouped_gemm_dgrad_pallas_triton(d_y, w, offsets, config=cfg))
                err = _rel(f(), refs[kind])
                ms = _time(f)
                print(f"pallas_triton {kind} {spec}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s (rel diff {err:.1e})",
                      flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"pallas_triton {kind} {spec}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


def fp8_forward(args, x, w, offsets, flops: int) -> None:
    """The FP8 forward: quantized with the library's quantizers (``--dtype``), each backend's default and the
    ``--mosaic-fwd`` configs (rel diff against the Pallas-Triton default); ``--ncu``: the Mosaic GPU default twice."""
    from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu import grouped_gemm_pallas_mosaic_gpu

    if args.dtype == "fp8_block":
        xq, xs = moe_pallas.per_token_group_quant_fp8(x, 128)
        wq, ws = moe_pallas.quantize_weight_fp8(w, "block")
    else:
        xq, xs = moe_pallas.per_token_quant_fp8(x)
        wq, ws = moe_pallas.quantize_weight_fp8(w, "per_channel")
    shape = f"{args.dtype} M={args.m} E={args.e} K={args.k} N={args.n}"
    if args.ncu:
        for _ in range(2):
            jax.block_until_ready(moe_pallas.grouped_gemm(xq, wq, offsets, x_scale=xs, w_scale=ws,
                                                          implementation="pallas_mosaic_gpu"))
        return
    ref = None
    runs = [] if args.only_configs else [(impl, None) for impl in ("pallas_triton", "pallas_mosaic_gpu")]
    for spec in filter(None, args.mosaic_fwd.split(";")):
        bm, bn, bk, st, gb, *flags = (int(v) for v in spec.split(","))
        runs.append((f"mosaic {spec}", MosaicGroupedGemmConfig(
            block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=st, grid_block_n=gb,
            warp_specialized=bool(flags and flags[0]), split_m=bool(len(flags) > 1 and flags[1]))))
    from jax.experimental.mosaic.gpu import profiler

    for name, cfg in runs:
        try:
            if cfg is None:
                f = jax.jit(lambda *a, impl=name: moe_pallas.grouped_gemm(a[0], a[1], a[2], x_scale=a[3], w_scale=a[4],
                                                                          implementation=impl))
            else:
                f = jax.jit(lambda *a, cfg=cfg: grouped_gemm_pallas_mosaic_gpu(a[0], a[1], a[2], x_scale=a[3],
                                                                              w_scale=a[4], config=cfg))
            operands = (xq, wq, offsets, xs, ws)
            out = f(*operands)
            ref = out if ref is None else ref
            _, ts = profiler.measure(f, iterations=10)(*operands)  # CUPTI: the kernels' time, as the tuner
            ms = float(np.median(ts))
            print(f"{name:22s} forward {shape}: {ms:.3f} ms kernel time {flops / ms / 1e9:.0f} TFLOP/s "
                  f"(rel diff {_rel(out, ref):.1e})", flush=True)
        except Exception as exc:  # noqa: BLE001 - a probe: report and go on
            print(f"{name:22s} forward {shape}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
