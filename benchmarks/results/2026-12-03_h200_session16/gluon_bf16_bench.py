"""Session 16: the 16-bit Gluon grouped GEMM (``moe_torch/ops/grouped_gemm/gluon_bf16.py``) against today's Triton
kernels and cuBLAS, forward and dgrad, one process.

E=32, M=16384, bf16; gate_up (K=7168, N=4096) and down (K=2048, N=7168); uniform and Zipf rows
(``benchmarks/specs.py: group_sizes``). Forward ``y = x @ w[e].T``: Gluon (block_n 128 / 256, two ring depths, both
epilogues) vs ``grouped_gemm_triton`` with ``EPMOE_TRITON_GLUON_BF16`` off (today's Triton kernel, its default
config) vs ``torch._grouped_mm(x, w.transpose(1, 2), offs=offsets[1:])``. Dgrad ``d_x = d_y @ w[e]``: Gluon vs
``grouped_gemm_dgrad_triton`` with ``EPMOE_TRITON_GLUON_DGRAD`` off vs ``torch._grouped_mm(d_y, w, offs=offsets[1:])``.
Every variant is checked against the Triton result first (``rel_fro``; ``WRONG`` above 1e-2, then not timed);
``triton.testing.do_bench(warmup=25, rep=100, return_mode="median")``; one line a variant, flushed (a timeout keeps
what was printed). Usage: ``PYTHONPATH=. python3 gluon_bf16_bench.py [fwd] [dgrad]`` (both by default).
"""
import os
import sys

import numpy as np
import torch
import triton

sys.path.insert(0, os.getcwd())
os.environ.pop("EPMOE_TRITON_GLUON_BF16", None)  # the Triton baselines: the switches off (their default)
os.environ.pop("EPMOE_TRITON_GLUON_DGRAD", None)
from benchmarks.specs import group_sizes  # noqa: E402
from moe_torch.ops.grouped_gemm import gluon_bf16 as GB  # noqa: E402
from moe_torch.ops.grouped_gemm.triton import grouped_gemm_triton  # noqa: E402
from moe_torch.ops.grouped_gemm.triton_backward import grouped_gemm_dgrad_triton  # noqa: E402

dev, bf16 = "cuda", torch.bfloat16
E, M = 32, 16384
SHAPES = (("gate_up", 4096, 7168), ("down", 7168, 2048))
#: (block_n, num_stages, epilogue)
GLUON = ((128, 6, "tma"), (128, 4, "tma"), (128, 7, "pointer"), (256, 3, "tma"), (256, 2, "tma"), (256, 4, "pointer"))


def bench(f):
    return triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")


def rel_fro(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def problem(N, K, routing, dgrad):
    g = torch.Generator(device=dev).manual_seed(0)
    sizes = group_sizes(M, E, routing)
    C = N if dgrad else K
    a = torch.randn(M, C, device=dev, generator=g).to(bf16)
    w = (torch.randn(E, N, K, device=dev, generator=g) * C ** -0.5).to(bf16)
    off = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int32, device=dev)
    return a, w, off


def run(op, names_fns, ref):
    for name, fn in names_fns:
        try:
            out = fn()
            err = rel_fro(out, ref)
            if not err <= 1e-2:
                print(f"{op} {name:24s} WRONG rel_fro={err:.3e}", flush=True)
                continue
            print(f"{op} {name:24s} {bench(fn):.3f} ms  rel_fro={err:.1e}", flush=True)
        except Exception as exc:  # one variant failing must not hide the others
            print(f"{op} {name:24s} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)


def main(which):
    for tag, N, K in SHAPES:
        for routing in ("uniform", "zipf"):
            for kind in which:
                dgrad = kind == "dgrad"
                a, w, off = problem(N, K, routing, dgrad)
                op = f"{kind:5s} {tag:7s} {routing:7s}"
                if dgrad:
                    ref = grouped_gemm_dgrad_triton(a, w, off, None, bf16)
                    fns = [("triton", lambda: grouped_gemm_dgrad_triton(a, w, off, None, bf16)),
                           ("torch._grouped_mm", lambda: torch._grouped_mm(a, w, offs=off[1:]))]
                    launch = GB.grouped_gemm_gluon_dgrad
                else:
                    ref = grouped_gemm_triton(a, w, off, None, None, bf16)
                    fns = [("triton", lambda: grouped_gemm_triton(a, w, off, None, None, bf16)),
                           ("torch._grouped_mm", lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=off[1:]))]
                    launch = GB.grouped_gemm_gluon_bf16
                for bn, st, ep in GLUON:
                    fns.append((f"gluon bn{bn} {ep} s{st}",
                                lambda bn=bn, st=st, ep=ep: launch(a, w, off, block_n=bn, num_stages=st, epilogue=ep)))
                run(op, fns, ref)
                del a, w, off, ref
                torch.cuda.empty_cache()


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    main([k for k in sys.argv[1:] if k in ("fwd", "dgrad")] or ["fwd", "dgrad"])
