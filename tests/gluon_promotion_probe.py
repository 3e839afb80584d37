"""Can Triton 3.6 express DeepGEMM's FP8 promotion off the critical path? A compile-only probe (no GPU needed).

Compiles, for sm_90 on this machine, two Gluon (``triton.experimental.gluon``) K loops of one warpgroup over a
64 x 128 FP8 tile that scale and add each 128-wide K block's partial product (a fresh asynchronous
``warpgroup_mma(..., use_acc=False, is_async=True)``) while another block's MMA runs
(``warpgroup_mma_wait(num_outstanding=1)``), and prints what ``ptxas`` kept:

- ``loop-carried``: block ``k``'s MMA is issued, then block ``k - 1``'s result (issued in the previous iteration)
  awaited and promoted;
- ``two-blocks``: two blocks a loop step, both issued, the first awaited with the second in flight, as
  ``moe_pallas``'s warp-specialized Mosaic GPU kernel with ``block_k = 256``.

Usage (repo root; run by ``tests/test_triton_gemm_tma.py``, not collected by pytest itself)::

    python3 tests/gluon_promotion_probe.py

Compiled with triton 3.6.0: ``loop-carried`` -> ``ptxas`` C7514 ("wgmma.mma_async instructions are serialized due to
non wgmma instructions reading accumulator registers of a wgmma between start and end of the pipeline stage"), SASS
waits ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` only; ``two-blocks`` -> no warning, SASS keeps ``DEPBAR.LE gsb0, 0x1``. The
loads here are plain (no TMA, no pipelining): the probe is about the MMA waits only.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia import hopper

BM, BN, BK = 64, 128, 128


@gluon.jit
def _tile_io(x_ptr, w_ptr, K: gl.constexpr, kb, a_dst, b_dst):
    blk: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    rm = gl.arange(0, 64, layout=gl.SliceLayout(1, blk))
    rn = gl.arange(0, 128, layout=gl.SliceLayout(1, blk))
    rk = gl.arange(0, 128, layout=gl.SliceLayout(0, blk))
    a_dst.store(gl.load(x_ptr + rm[:, None] * K + kb * 128 + rk[None, :]))
    b_dst.store(gl.load(w_ptr + rn[:, None] * K + kb * 128 + rk[None, :]))


@gluon.jit
def _store(y_ptr, acc):
    blk: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    rm = gl.arange(0, 64, layout=gl.SliceLayout(1, blk))
    rn = gl.arange(0, 128, layout=gl.SliceLayout(0, blk))
    gl.store(y_ptr + rm[:, None] * 128 + rn[None, :], gl.convert_layout(acc, blk))


@gluon.jit
def loop_carried(x_ptr, w_ptr, s_ptr, y_ptr, K: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    a_s = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, 128], sl)
    b_s = gl.allocate_shared_memory(gl.float8e4nv, [2, 128, 128], sl)  # [N, K]: K-major B, as FP8 wgmma needs
    acc = gl.zeros([64, 128], gl.float32, layout=mma)
    _tile_io(x_ptr, w_ptr, K, 0, a_s.index(0), b_s.index(0))
    hopper.fence_async_shared()
    prev = hopper.warpgroup_mma(a_s.index(0), b_s.index(0).permute((1, 0)), gl.zeros([64, 128], gl.float32, layout=mma),
                                use_acc=False, is_async=True)
    for kb in range(1, K // 128):
        _tile_io(x_ptr, w_ptr, K, kb, a_s.index(kb % 2), b_s.index(kb % 2))
        hopper.fence_async_shared()
        cur = hopper.warpgroup_mma(a_s.index(kb % 2), b_s.index(kb % 2).permute((1, 0)),
                                   gl.zeros([64, 128], gl.float32, layout=mma), use_acc=False, is_async=True)
        part = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[prev])
        acc = acc + part * gl.load(s_ptr + kb - 1)
        prev = cur
    part = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[prev])
    _store(y_ptr, acc + part * gl.load(s_ptr + K // 128 - 1))


@gluon.jit
def two_blocks(x_ptr, w_ptr, s_ptr, y_ptr, K: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    a_s = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, 128], sl)
    b_s = gl.allocate_shared_memory(gl.float8e4nv, [2, 128, 128], sl)
    acc = gl.zeros([64, 128], gl.float32, layout=mma)
    for kb in range(0, K // 128, 2):
        _tile_io(x_ptr, w_ptr, K, kb, a_s.index(0), b_s.index(0))
        _tile_io(x_ptr, w_ptr, K, kb + 1, a_s.index(1), b_s.index(1))
        hopper.fence_async_shared()
        t0 = hopper.warpgroup_mma(a_s.index(0), b_s.index(0).permute((1, 0)), gl.zeros([64, 128], gl.float32, layout=mma),
                                  use_acc=False, is_async=True)
        t1 = hopper.warpgroup_mma(a_s.index(1), b_s.index(1).permute((1, 0)), gl.zeros([64, 128], gl.float32, layout=mma),
                                  use_acc=False, is_async=True)
        p0 = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[t0])  # block kb done, kb + 1 still running
        acc = acc + p0 * gl.load(s_ptr + kb)
        p1 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[t1])
        acc = acc + p1 * gl.load(s_ptr + kb + 1)
    _store(y_ptr, acc)


def probe(fn) -> str:
    sig = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*fp32", "K": "constexpr"}
    c = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs={"K": 512}), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4})
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.cubin"), "wb") as f:
            f.write(c.asm["cubin"])
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(c.asm["ptx"])
        sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True, check=True).stdout
        info = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o",
                               os.path.join(d, "k.o")], capture_output=True, text=True)
    waits = sorted({line.split("DEPBAR")[1].split(";")[0].strip() for line in sass.splitlines() if "WARPGROUP.DEPBAR" in line})
    warning = [line.strip() for line in (info.stdout + info.stderr).splitlines() if "C7514" in line]
    return (f"{fn.__name__}: PTX wait_group 1 x{c.asm['ptx'].count('wgmma.wait_group.sync.aligned 1')}; SASS waits "
            f"{waits}; ptxas: {warning[0] if warning else 'no serialization warning'}")


if __name__ == "__main__":
    for kernel in (loop_carried, two_blocks):
        print(probe(kernel), flush=True)
