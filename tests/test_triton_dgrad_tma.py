"""The TMA variant of the Triton grouped-GEMM dgrad (``d_x[m] = d_y[m] @ w[e(m)]``, CONTRACT.md section 8, GEMM 1 and
GEMM 2; ``GroupedGemmConfig(tma=True)`` on ``_grouped_gemm_dgrad_kernel`` in
``moe_torch/ops/grouped_gemm/triton_backward.py``, module docstring "TMA variant") against a float64 loop and the
pointer kernel, its refusals (each naming the field), its default (``config.py: grouped_gemm_dgrad_config``,
``EPMOE_TRITON_TMA_DGRAD``) and its sm_90 lowering. Modelled on ``tests/test_triton_gemm_tma.py`` (the forward's).

On the CPU the kernel runs in Triton's interpreter, which turns the host-side tensor descriptors into masked loads
(zero outside the bounds, as TMA); on the GPU machine (``EPMOE_TEST_DEVICE=gpu``) the same tests run compiled, plus
the default (``EPMOE_TRITON_TMA_DGRAD`` unset or 1; on by default because these tests pass on sm_90 and the
variant measured faster, BENCHMARKS.md) at a size where it picks the TMA variant. Unused capacity rows of ``d_y`` are NaN: the variant loads and
computes whole row tiles, so a NaN that reached ``d_x`` would show a row stored that must not be.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from common import TORCH_DEVICE, to_torch
from moe_torch.ops.device import device_spec
from moe_torch.ops.grouped_gemm import config as gemm_config
from moe_torch.ops.grouped_gemm import triton_backward as gemm_bwd
from moe_torch.ops.grouped_gemm.config import (DGRAD_WIDE_CONFIG, GroupedGemmConfig, check_config,
                                               grouped_gemm_dgrad_config, heuristic_grouped_gemm_dgrad_config)
from moe_torch.ops.grouped_gemm.triton_backward import _launch_dgrad, grouped_gemm_dgrad_triton
from moe_torch.ops.triton_common import TMA_DGRAD_ENV
from sm90 import compile_sm90
from tolerances import BF16_REL_FRO, F32_REL_FRO, assert_exact, assert_rel_fro

OP = "grouped_gemm_dgrad"
TMA = GroupedGemmConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=3, tma=True)

#: counts per expert, M_cap, N (the contraction), K (d_x's columns), block_k; block_m = block_n = 16. Every N is a
#: multiple of its block_k (the variant's rule; the tail case is test_contraction_tail_refused_or_falls_back).
SHAPES = {
    "ragged-empties": ([5, 0, 19, 0, 3], 32, 64, 40, 32),  # ragged, empty experts, NaN capacity rows, K tail 8 of 16
    "all-on-one": ([0, 0, 27, 0], 27, 32, 32, 16),  # every row on one expert, M_cap = 27 not a multiple of 16
    "m-cap-k-tail": ([7, 11, 3], 23, 48, 24, 16),  # M_cap 23 with NaN rows 21-22, 3 N steps, K tail 8 of 16
    "one-row": ([1], 1, 16, 16, 16),  # M = 1 (decode), one tile of 15 zero-filled rows past M_cap
}
#: Launch orders (the forward's): the default 2-D grid, and a persistent non-power-of-2 group (4 programs in the
#: interpreter, each looping over several tiles).
ORDERS = {"g1": dict(), "g3-persistent": dict(group_m=3, persistent=True)}


def make_dgrad_problem(seed: int, counts: list[int], m_cap: int, N: int, K: int):
    """``d_y [m_cap, N]`` ~ N(0, 1), ``w [E, N, K]`` ~ N(0, 1/N) (O(1) outputs), offsets from ``counts``; rows of
    ``d_y`` past ``sum(counts)`` are NaN (unused capacity: never stored from)."""
    rng = np.random.default_rng(seed)
    d_y = rng.standard_normal((m_cap, N)).astype(np.float32)
    w = (rng.standard_normal((len(counts), N, K)) / np.sqrt(N)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    assert offsets[-1] <= m_cap
    d_y[offsets[-1]:] = np.nan
    return d_y, w, offsets


def float64_dgrad(d_y: np.ndarray, w: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """float64 ``d_x[m] = d_y[m] @ w[e(m)]``, rows outside ``[offsets[0], offsets[-1])`` zero."""
    d_x = np.zeros((d_y.shape[0], w.shape[2]))
    for e in range(w.shape[0]):
        s, t = offsets[e], offsets[e + 1]
        d_x[s:t] = d_y[s:t].astype(np.float64) @ w[e].astype(np.float64)
    return d_x


def _torch_problem(shape: str, dtype: str):
    counts, m_cap, N, K, _ = SHAPES[shape]
    dy_np, w_np, off_np = make_dgrad_problem(len(shape) + N, counts, m_cap, N, K)
    return to_torch(dy_np, dtype), to_torch(w_np, dtype), to_torch(off_np), off_np


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tma_dgrad_matches_float64(shape, dtype, order):
    """float32 output within F32_REL_FRO of float64 on the same (rounded) values and of the pointer kernel with the
    same tiles; the ``d_y.dtype`` output within BF16_REL_FRO of float64; only owned rows are written (a NaN-poisoned,
    over-allocated output keeps NaN in unowned rows and guards: the NaN capacity rows of ``d_y`` never reach a stored
    row); inputs untouched."""
    counts, m_cap, N, K, block_k = SHAPES[shape]
    cfg = dataclasses.replace(TMA, block_k=block_k, **ORDERS[order])
    d_y, w, offsets, off_np = _torch_problem(shape, dtype)
    before = [t.clone() for t in (d_y, w, offsets)]
    M = int(off_np[-1])
    ref64 = float64_dgrad(d_y.float().cpu().numpy(), w.float().cpu().numpy(), off_np)

    f32 = grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.float32, cfg)
    assert_rel_fro(f32, ref64, F32_REL_FRO, "TMA dgrad float32 output vs float64")
    assert not f32[M:].any(), "rows >= M are zero"
    pointer = grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.float32, dataclasses.replace(cfg, tma=False))
    assert_rel_fro(f32, pointer, F32_REL_FRO, "TMA dgrad vs the pointer kernel, same tiles")

    buf = torch.full((m_cap + 1, K + 15), float("nan"), dtype=d_y.dtype, device=d_y.device)
    view = buf[:m_cap, :K]
    _launch_dgrad(OP, d_y, w, offsets, None, view, cfg)
    assert torch.isnan(buf[:, K:].float()).all(), "nothing written past column K - 1"
    assert torch.isnan(buf[m_cap].float()).all(), "nothing written past row M_cap - 1"
    assert torch.isnan(view[M:].float()).all(), "rows >= M never written"
    assert torch.isfinite(view[:M].float()).all()
    assert_rel_fro(view[:M], ref64[:M], BF16_REL_FRO, f"TMA dgrad {dtype} output vs float64")
    for t, b in zip((d_y, w, offsets), before):
        assert_exact(t, b, "input unchanged")


def test_tma_dgrad_no_rows_at_all():
    """All experts empty: nothing is stored (the poisoned output stays NaN), zeros from the public launcher."""
    dy_np, w_np, off_np = make_dgrad_problem(3, [0, 0, 0], 8, 32, 16)
    d_y, w, offsets = to_torch(dy_np, "bfloat16"), to_torch(w_np, "bfloat16"), to_torch(off_np)
    assert not grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.float32, TMA).any()
    out = torch.full((8, 16), float("nan"), dtype=torch.float32, device=d_y.device)
    _launch_dgrad(OP, d_y, w, offsets, None, out, TMA)
    assert torch.isnan(out).all()


def test_contraction_tail_refused_or_falls_back(monkeypatch):
    """N = 40 with block_k 32 (a last step would read 24 of the next expert's weight rows): a caller's TMA config is
    refused (NotImplementedError naming block_k, before launch); a TMA default runs the pointer kernel with the same
    tiles (float64's result; the next expert's weights hold NaN there, and no NaN reaches d_x)."""
    counts, m_cap, N, K = [6, 9, 0], 16, 40, 16
    dy_np, w_np, off_np = make_dgrad_problem(7, counts, m_cap, N, K)
    d_y, w, offsets = to_torch(dy_np, "bfloat16"), to_torch(w_np, "bfloat16"), to_torch(off_np)
    with pytest.raises(NotImplementedError,
                       match=r"grouped_gemm_dgrad: config tma=True needs N > 0 and N % block_k == 0 .*got N=40, "
                             r"block_k=32"):
        grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.float32, TMA)
    w_nan = w.clone()
    w_nan[2] = float("nan")  # the empty last expert: the rows a tail step of expert 1 would read
    monkeypatch.setattr(gemm_bwd, "_dgrad_config", lambda *a, **k: dataclasses.replace(TMA, group_m=3))
    got = grouped_gemm_dgrad_triton(d_y, w_nan, offsets, None, torch.float32)
    ref64 = float64_dgrad(d_y.float().cpu().numpy(), w.float().cpu().numpy(), off_np)
    assert torch.isfinite(got).all()
    assert_rel_fro(got, ref64, F32_REL_FRO, "N tail: the pointer kernel under a TMA default")


def _small(dtype="bfloat16", N=32, K=32):
    dy_np, w_np, off_np = make_dgrad_problem(5, [3, 4], 8, N, K)
    return to_torch(dy_np, dtype), to_torch(w_np, dtype), to_torch(off_np)


def test_tma_dgrad_refuses_requests_it_does_not_serve():
    """float32 ``d_y`` and FP8 weights: NotImplementedError naming ``tma=True`` and what came, from check_config,
    before any launch; 16-bit dgrads pass check_config."""
    check_config(OP, TMA, 16, None, False, forward=False)
    check_config(OP, dataclasses.replace(TMA, num_warps=8, warp_specialize=True), 16, None, False, forward=False)
    want = r"grouped_gemm_dgrad: config tma=True serves the dgrad of 16-bit \(bf16 / fp16\) d_y and w only; got "
    with pytest.raises(NotImplementedError, match=want + "float32 operands"):
        check_config(OP, TMA, 32, None, False, forward=False)
    with pytest.raises(NotImplementedError, match=want + r"FP8 weights \(dequantized per element"):
        check_config(OP, TMA, 16, None, True, forward=False, w_fp8=True)
    with pytest.raises(NotImplementedError, match="warp_specialize=True needs num_warps >= 8"):
        check_config(OP, dataclasses.replace(TMA, warp_specialize=True), 16, None, False, forward=False)
    d_y, w, offsets = _small("float32")
    with pytest.raises(NotImplementedError, match=want + "float32 operands"):
        grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.float32, TMA)
    if TORCH_DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        return  # no FP8 conversion before sm_89 (check_triton_device says so first)
    from moe_torch import quantize_weight_fp8

    d_y, w, offsets = _small()
    wq, ws = quantize_weight_fp8(w.float(), "per_channel")
    with pytest.raises(NotImplementedError, match=want + "FP8 weights"):
        grouped_gemm_dgrad_triton(d_y, wq, offsets, ws, torch.float32, TMA)


def test_tma_dgrad_refuses_what_tma_cannot_address(monkeypatch):
    """Host-side NotImplementedError before launch: w's row stride not a multiple of 16 bytes (K = 36 bf16: 72 B),
    a base address of d_y off 16 bytes, experts not N rows apart in w (no [E * N, K] view), M_cap or E * N past the
    int32 coordinates (the limit lowered for the test); the same inputs under a TMA default run the pointer kernel."""
    d_y, w, offsets = _small(K=36)
    with pytest.raises(NotImplementedError, match="16-byte aligned .*w at address offset 0 with a row stride of 72"):
        grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.float32, TMA)
    d_y, w, offsets = _small()
    shifted = torch.empty(d_y.numel() + 1, dtype=d_y.dtype, device=d_y.device)[1:].view(d_y.shape)
    shifted.copy_(d_y)
    with pytest.raises(NotImplementedError, match="16-byte aligned .*d_y at address offset 2"):
        grouped_gemm_dgrad_triton(shifted, w, offsets, None, torch.float32, TMA)
    tall = torch.zeros(2, 48, 32, dtype=w.dtype, device=w.device)
    tall[:, :32] = w
    with pytest.raises(NotImplementedError, match=r"w.stride\(0\) == N \* w.stride\(1\)"):
        grouped_gemm_dgrad_triton(d_y, tall[:, :32], offsets, None, torch.float32, TMA)
    monkeypatch.setattr(gemm_bwd, "_MAX_TMA_ROWS", 63)
    with pytest.raises(NotImplementedError, match=r"int32 TMA coordinates, .*got M_cap=8, E \* N=64"):
        grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.float32, TMA)
    monkeypatch.undo()

    monkeypatch.setattr(gemm_bwd, "_dgrad_config", lambda *a, **k: TMA)
    for dy_, w_ in ((shifted, w), (d_y, tall[:, :32]), _small(K=36)[:2]):
        ref = grouped_gemm_dgrad_triton(dy_, w_, offsets, None, torch.float32, dataclasses.replace(TMA, tma=False))
        assert_exact(grouped_gemm_dgrad_triton(dy_, w_, offsets, None, torch.float32), ref, "pointer fallback")


def test_default_config():
    """grouped_gemm_dgrad_config: the heuristic's tiles with tma=True for 16-bit d_y and w on sm_90 from
    DGRAD_TMA_MIN_ROWS rows on wgmma row tiles (the wide 128 x 256 tiles at M_cap >= 8192) with the switch on;
    the heuristic itself otherwise (float32, FP8 weights, not sm_90, switch off, small row tiles, fewer rows)."""
    assert gemm_config.DGRAD_TMA_MIN_ROWS == 4096
    wide = grouped_gemm_dgrad_config(16384, 4096, 7168, 32, 16, sm90=True)
    assert wide == dataclasses.replace(DGRAD_WIDE_CONFIG, tma=True)
    mid = grouped_gemm_dgrad_config(4096, 7168, 2048, 32, 16, sm90=True)
    assert mid == dataclasses.replace(heuristic_grouped_gemm_dgrad_config(4096, 7168, 2048, 32, 16), tma=True)
    assert mid.block_m == 64
    check_config(OP, wide, 16, None, False, forward=False)
    check_config(OP, mid, 16, None, False, forward=False)
    for M_cap, E, bits, kw in [(16384, 32, 32, dict(sm90=True)), (16384, 32, 16, dict(sm90=True, w_fp8=True)),
                               (16384, 32, 16, dict()), (16384, 32, 16, dict(sm90=True, tma=False)),
                               (4096, 256, 16, dict(sm90=True)), (2048, 32, 16, dict(sm90=True))]:
        got = grouped_gemm_dgrad_config(M_cap, 4096, 7168, E, bits, **kw)
        assert got == heuristic_grouped_gemm_dgrad_config(M_cap, 4096, 7168, E, bits) and not got.tma, (M_cap, E, kw)


def test_default_reads_the_switch_at_each_launch(monkeypatch):
    """_launch_dgrad (no config) asks grouped_gemm_dgrad_config with EPMOE_TRITON_TMA_DGRAD read now (unset: on),
    whether the device is sm_90, FP8-ness of w, the device spec (its tuned entries; none on the CPU) and d_x's width;
    a caller's config is used as it is."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return dataclasses.replace(TMA, tma=kwargs["tma"])

    monkeypatch.setattr(gemm_bwd, "_dgrad_config", spy)
    d_y, w, offsets = _small()
    ref = grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.float32, dataclasses.replace(TMA, tma=False))
    sm90 = TORCH_DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    spec = device_spec() if TORCH_DEVICE == "cuda" else None
    for raw, want in ((None, True), ("0", False), ("on", True), ("off", False)):
        if raw is None:
            monkeypatch.delenv(TMA_DGRAD_ENV, raising=False)
        else:
            monkeypatch.setenv(TMA_DGRAD_ENV, raw)
        assert_rel_fro(grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.float32), ref, F32_REL_FRO, str(raw))
        assert calls[-1] == dict(w_fp8=False, sm90=sm90, tma=want, device=spec, out_bits=32), raw
    monkeypatch.setenv(TMA_DGRAD_ENV, "maybe")
    with pytest.raises(ValueError, match=f"{TMA_DGRAD_ENV}.*got {TMA_DGRAD_ENV}='maybe'"):
        grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.float32)
    n = len(calls)
    grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.float32, TMA)  # explicit: the switch is not read
    assert len(calls) == n


@pytest.mark.skipif(TORCH_DEVICE == "cpu", reason="the default picks TMA on sm_90 at >= 4096 rows: too big for the "
                                                  "interpreter")
@pytest.mark.parametrize("shape", ["gate_up-like", "down-like"])
def test_gpu_switch_on_is_tma_and_matches_pointer(monkeypatch, shape):
    """Compiled, at a size where the default (``EPMOE_TRITON_TMA_DGRAD`` unset) takes the TMA variant on sm_90 (ragged
    experts, one empty, NaN capacity rows, M_cap not a multiple of 128): that default (TMA where sm_90) equals the pointer kernel's result within
    F32_REL_FRO and float64 within BF16_REL_FRO; the wide config under warp_specialize and persistent group 4 too."""
    N, K = {"gate_up-like": (512, 896), "down-like": (896, 256)}[shape]
    counts = [900, 0, 1500, 37, 2000, 300, 1, 1422]
    m_cap = sum(counts) + 70
    dy_np, w_np, off_np = make_dgrad_problem(11, counts, m_cap, N, K)
    d_y, w, offsets = to_torch(dy_np, "bfloat16"), to_torch(w_np, "bfloat16"), to_torch(off_np)
    M = int(off_np[-1])
    monkeypatch.delenv(TMA_DGRAD_ENV, raising=False)  # the default: on
    cfg = gemm_bwd._dgrad_config(m_cap, N, K, len(counts), 16, False, w_fp8=False,
                                 sm90=gemm_bwd._is_sm90(d_y.device), tma=True)
    assert cfg.tma == (torch.cuda.get_device_capability() == (9, 0))
    got = grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.bfloat16)
    got32 = grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.float32)
    pointer32 = grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.float32, dataclasses.replace(cfg, tma=False))
    ref64 = float64_dgrad(d_y.float().cpu().numpy(), w.float().cpu().numpy(), off_np)
    assert torch.isfinite(got.float()).all() and not got[M:].any() and not got32[M:].any()
    assert_rel_fro(got32, pointer32, F32_REL_FRO, "default vs pointer")
    assert_rel_fro(got32, ref64, F32_REL_FRO, "default float32 vs float64")
    assert_rel_fro(got, ref64, BF16_REL_FRO, "default bf16 vs float64")
    for extra in (dict(persistent=True, group_m=4, warp_specialize=True),
                  dict(block_n=128, num_stages=4, persistent=True, group_m=4)):
        wide = dataclasses.replace(DGRAD_WIDE_CONFIG, tma=True, **extra)
        out = grouped_gemm_dgrad_triton(d_y, w, offsets, None, torch.float32, wide)
        assert not out[M:].any()
        assert_rel_fro(out, pointer32, F32_REL_FRO, f"TMA {extra} vs pointer")


# --------------------------------------------------------------------------------------
# sm_90 lowering on the CPU (child process without the interpreter; tests/sm90.py)

_INTS = ("M_cap", "N", "K", "E", "stride_dym", "stride_we", "stride_wn", "stride_om", "stride_wse", "stride_wsn",
         "stride_wsk")


def _tma_dgrad_job(bm, bn, bk, warps, stages, ws=False, persistent=False, group_m=1, t="bf16"):
    return {"signature": {"dy_ptr": f"*{t}", "w_ptr": f"*{t}", "offsets_ptr": "*i32", "w_scale_ptr": "*fp32",
                          "out_ptr": f"*{t}", **{a: "i32" for a in _INTS},
                          "dy_desc": f"tensordesc<{t}[{bm}, {bk}]>", "w_desc": f"tensordesc<{t}[{bk}, {bn}]>"},
            "constexprs": {"W_SCALE": 0, "W_BLOCK": 1, "IEEE_F32": False, "BLOCK_E": 64, "BLOCK_M": bm, "BLOCK_N": bn,
                           "BLOCK_K": bk, "GROUP_M": group_m, "PERSISTENT": persistent, "ALIGNED": True, "TMA": True,
                           "WARP_SPECIALIZE": ws},
            "options": {"num_warps": warps, "num_stages": stages}}


@pytest.mark.skipif(TORCH_DEVICE != "cpu", reason="compiles in a child process; the GPU run compiles for real")
def test_tma_dgrad_compiles_for_sm90():
    """The variant lowers to TMA copies (``cp.async.bulk.tensor``, no ``cp.async`` of the pointer kernel's pipeline)
    feeding ``wgmma`` (bf16 m64n256 for the default wide tiles in their group-8 order, fp16 m64n128 for 64 x 128
    over 4 warps in a persistent group 4); ``warp_specialize=True`` gives the same PTX (as in the forward,
    ``tests/test_triton_gemm_tma.py``)."""
    jobs = {"wide-g8": _tma_dgrad_job(128, 256, 64, 8, 3, group_m=8),
            "wide-g8-ws": _tma_dgrad_job(128, 256, 64, 8, 3, ws=True, group_m=8),
            "64x128-fp16-persistent-g4": _tma_dgrad_job(64, 128, 64, 4, 3, persistent=True, group_m=4, t="fp16")}
    ptx = compile_sm90(jobs, "moe_torch.ops.grouped_gemm.triton_backward", "_grouped_gemm_dgrad_kernel")
    for name, p in ptx.items():
        assert ".target sm_90" in p and "cp.async.bulk.tensor" in p, name
        assert not re.search(r"cp\.async\.(ca|cg)", p), f"{name}: pointer loads of d_y / w"
        mma = "m64n128k16.f32.f16.f16" if "fp16" in name else "m64n256k16.f32.bf16.bf16"
        assert f"wgmma.mma_async.sync.aligned.{mma}" in p, name
    assert ptx["wide-g8-ws"] == ptx["wide-g8"], "warp_specialize became effective on sm_90"
