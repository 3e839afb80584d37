"""Probe: 4-bit weight decode inside a Triton GEMM at decode sizes (few rows per expert), on the GPU.

Times ``y[e] = x[e] @ wd[e].T`` for ``E`` experts with ``R`` rows each (``x [E, R, K]`` bf16, 4-bit ``w [E, N, K // 2]``
with e8m0 / bf16 scales ``[E, N, K // 32]``) with variants of the decode, against the same GEMM on bf16 weights and
against the copy ceiling of the weight bytes. Each variant is checked against the float reference first.

    PYTHONPATH=. python3 benchmarks/probe_w4.py [--E 111] [--R 2] [--N 5760] [--K 2880] [--quick]
    PROBE_ONLY=mxfp4:2:64:128:4 ncu --kernel-name _k --launch-count 1 --section SpeedOfLight python3 benchmarks/probe_w4.py

Variants (``VARIANT``): 0 the bf16 weights (the bandwidth reference); 1 Triton's ``tl.dot_scaled(bf16, e2m1)``
(MXFP4 only; GPU only: the interpreter has no ``dot_scaled``); 2 the library's float32 decode (``moe_torch``'s
``_w4_tiles`` for float32, rounded to bf16: low / high nibbles against x's even / odd columns, one scale per group
of 32; the earlier float32 decode); 3 as 2 with A and B
swapped (``y^T = wd @ x^T``: the weights as the wide MMA operand); 4 as 1 swapped; 5 the library's tile as it is now
(``_w4_tiles``: on a GPU the packed asm decode, two codes per instruction) in this probe's loop; 6 the library's
kernel itself through ``grouped_gemm_triton`` (its launch, table scales and contiguous x loads; includes a copy of
``y``, ~2 us). Its numbers and the
``ncu`` reading are in BENCHMARKS.md (2026-12-01c). ``PROBE_ONLY=fmt:variant:block_n:block_k:warps``
runs that one config once (for ``ncu``). The default E=111, R=2 is gpt-oss-120b's gate_up at T=64 (111 experts
reached, ~2 rows each).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moe_torch.ops.grouped_gemm.triton import _w4_tiles  # noqa: E402

PEAK_BW = 4.27e12
VARIANTS = [(0, 16, 64, 128, 4, 4)]


@triton.jit
def _k(x_ptr, w_ptr, s_ptr, y_ptr, R, N, K, VARIANT: tl.constexpr, MX: tl.constexpr, BLOCK_M: tl.constexpr,
       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.program_id(1)
    pid_n = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    rmask = rows < R
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    e64 = e.to(tl.int64)
    x_rows = x_ptr + e64 * R * K + rows[:, None] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    HALF: tl.constexpr = BLOCK_K // 2
    G: tl.constexpr = BLOCK_K // 32
    w_rows = w_ptr + e64 * N * (K // 2) + cols[:, None] * (K // 2)
    s_rows = s_ptr + e64 * N * (K // 32) + cols[:, None] * (K // 32)
    for k0 in range(0, K, BLOCK_K):
        if VARIANT == 0:  # bf16 weights (w_ptr: [E, N, K] bf16)
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_rows + ks[None, :], mask=rmask[:, None] & (ks < K)[None, :], other=0.0)
            b = tl.load(w_ptr + e64 * N * K + cols[None, :] * K + ks[:, None], mask=(ks < K)[:, None] & cmask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
        elif VARIANT == 1:  # dot_scaled (mxfp4 only)
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_rows + ks[None, :], mask=rmask[:, None] & (ks < K)[None, :], other=0.0)
            kp = k0 // 2 + tl.arange(0, HALF)
            wq = tl.load(w_rows + kp[None, :], mask=cmask[:, None] & (kp < K // 2)[None, :], other=0)
            kg = k0 // 32 + tl.arange(0, G)
            s = tl.load(s_rows + kg[None, :], mask=cmask[:, None] & (kg < K // 32)[None, :], other=0)
            acc = tl.dot_scaled(a, None, "bf16", tl.trans(wq), s, "e2m1", acc)
        elif VARIANT == 4:  # swap AB with dot_scaled: y^T = wd @ x^T (mxfp4 only)
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_rows + ks[None, :], mask=rmask[:, None] & (ks < K)[None, :], other=0.0)
            kp = k0 // 2 + tl.arange(0, HALF)
            wq = tl.load(w_rows + kp[None, :], mask=cmask[:, None] & (kp < K // 2)[None, :], other=0)
            kg = k0 // 32 + tl.arange(0, G)
            s = tl.load(s_rows + kg[None, :], mask=cmask[:, None] & (kg < K // 32)[None, :], other=0)
            acc_t = tl.dot_scaled(wq, s, "e2m1", tl.trans(a), None, "bf16", acc_t)
        else:  # 2, 3, 5: the library's tile (moe_torch _w4_tiles) against x's even / odd columns
            kp = k0 // 2 + tl.arange(0, HALF)
            km = (kp < K // 2)
            a_e = tl.load(x_rows + (2 * kp)[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
            a_o = tl.load(x_rows + (2 * kp + 1)[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
            if VARIANT == 5:  # bf16: the packed asm decode on a GPU
                lo, hi = _w4_tiles(w_rows, s_rows, 1, k0, K, cmask, 4 if MX else 5, BLOCK_N, BLOCK_K, tl.bfloat16)
            else:  # 2, 3: the float32 decode (the earlier one), rounded to bf16
                lo, hi = _w4_tiles(w_rows, s_rows, 1, k0, K, cmask, 4 if MX else 5, BLOCK_N, BLOCK_K, tl.float32)
                lo, hi = lo.to(tl.bfloat16), hi.to(tl.bfloat16)
            if VARIANT == 3:  # swap AB: y^T [BN, BM] += lo @ x_even^T + hi @ x_odd^T
                acc_t = tl.dot(lo, tl.trans(a_e), acc_t)
                acc_t = tl.dot(hi, tl.trans(a_o), acc_t)
            else:
                acc = tl.dot(a_e, tl.trans(lo), acc)
                acc = tl.dot(a_o, tl.trans(hi), acc)
    if VARIANT == 3 or VARIANT == 4:
        acc = tl.trans(acc_t)
    out = y_ptr + e64 * R * N + rows[:, None] * N + cols[None, :]
    tl.store(out, acc.to(tl.bfloat16), mask=rmask[:, None] & cmask[None, :])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--E", type=int, default=111)
    p.add_argument("--R", type=int, default=2)
    p.add_argument("--N", type=int, default=5760)
    p.add_argument("--K", type=int, default=2880)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--variants", default="0,1,2,3,4,5,6", help="comma-separated variant numbers to time")
    p.add_argument("--configs", default="", help="variant:block_m:block_n:block_k:warps:stages,... instead of the list")
    a = p.parse_args()
    import moe_torch
    dev = "cuda"
    E, R, N, K = a.E, a.R, a.N, a.K
    torch.manual_seed(0)
    x = torch.randn(E, R, K, device=dev).bfloat16()
    w = (torch.randn(E, N, K, device=dev) * K**-0.5).bfloat16()
    for fmt in ("mxfp4", "int4"):
        q = moe_torch.quantize_weight_mxfp4 if fmt == "mxfp4" else moe_torch.quantize_weight_int4
        deq = moe_torch.dequantize_weight_mxfp4 if fmt == "mxfp4" else moe_torch.dequantize_weight_int4
        wq, ws = q(w)
        wd = deq(wq, ws).bfloat16()
        ref = torch.bmm(x.float(), wd.float().transpose(1, 2))
        nbytes4 = wq.numel() + ws.numel() * ws.element_size()
        configs = [tuple(int(v) for v in c.split(":")) for c in a.configs.split(",") if c]
        for variant, bm, bn, bk, warps, stages in configs or VARIANTS if a.quick else configs or [
                (5, 16, 64, 64, 4, 3), (5, 16, 128, 64, 4, 3), (5, 16, 128, 128, 4, 3), (5, 16, 64, 128, 4, 4),
                (5, 16, 256, 64, 8, 3), (5, 16, 128, 256, 4, 3), (5, 16, 256, 128, 8, 3), (5, 16, 128, 128, 8, 3),
                (3, 16, 64, 128, 4, 3), (3, 16, 128, 128, 4, 3), (3, 16, 128, 256, 4, 3), (3, 16, 64, 256, 4, 4),
                (3, 16, 128, 128, 8, 3), (3, 16, 256, 128, 8, 3),
                (4, 16, 64, 128, 4, 3), (4, 16, 128, 128, 4, 3), (4, 16, 128, 256, 4, 3), (4, 16, 128, 128, 8, 3),
                (4, 16, 256, 128, 8, 3),
                (0, 16, 64, 128, 4, 4), (1, 16, 64, 128, 4, 3), (2, 16, 64, 128, 4, 3)]:
            if (variant in (1, 4) and fmt != "mxfp4") or (not configs and str(variant) not in a.variants.split(",")):
                continue
            only = os.environ.get("PROBE_ONLY")  # "fmt:variant:bn:bk:warps" (ncu: one launch of one config)
            if only and only != f"{fmt}:{variant}:{bn}:{bk}:{warps}":
                continue
            y = torch.empty(E, R, N, device=dev, dtype=torch.bfloat16)
            wa = w if variant == 0 else wq
            grid = (triton.cdiv(N, bn), E)
            try:
                if variant == 6:  # the library's kernel itself (grouped_gemm_triton: table scales, contiguous x)
                    from moe_torch.ops.grouped_gemm.config import GroupedGemmConfig
                    from moe_torch.ops.grouped_gemm.triton import grouped_gemm_triton

                    cfg = GroupedGemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
                    offs = (torch.arange(E + 1, device=dev, dtype=torch.int32) * R)
                    x2 = x.reshape(E * R, K)
                    fn = lambda: y.view(E * R, N).copy_(grouped_gemm_triton(x2, wq, offs, None, ws, torch.bfloat16, cfg,
                                                                            w_format=fmt))
                else:
                    fn = lambda: _k[grid](x, wa, ws, y, R, N, K, VARIANT=variant, MX=fmt == "mxfp4", BLOCK_M=bm,
                                          BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                fn()
                torch.cuda.synchronize()
                refv = ref if variant else torch.bmm(x.float(), w.float().transpose(1, 2))
                err = ((y.float() - refv).norm() / refv.norm()).item()
                if only:
                    print(f"{fmt} v{variant}: one launch, err={err:.1e}")
                    continue
                ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                nb = (w.numel() * 2) if variant == 0 else nbytes4
                print(f"{fmt:6s} v{variant} {bm}x{bn}x{bk} w{warps} s{stages}: {ms*1e3:8.1f} us  {nb/ms/1e6:7.0f} GB/s "
                      f"{100*nb/ms/1e-3/PEAK_BW:5.1f}% err={err:.1e}", flush=True)
            except Exception as exc:
                print(f"{fmt} v{variant} {bm}x{bn}x{bk}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
