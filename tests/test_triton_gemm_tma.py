"""The opt-in TMA variant of the Triton grouped GEMM (``GroupedGemmConfig(tma=True)``,
``_grouped_gemm_kernel`` with ``TMA=True`` in ``moe_torch/ops/grouped_gemm/triton.py``) against the torch reference
and a float64 loop (CONTRACT.md sections 4 and 7), its refusals (each naming the field), and its sm_90
lowering (TMA copies and wgmma; what ``warp_specialize`` does there).

On the CPU the kernel runs in Triton's interpreter, which turns the host-side tensor descriptors into
masked loads (zero outside the bounds, as TMA); on the GPU machine (``EPMOE_TEST_DEVICE=gpu``) the same
tests run compiled. Unused capacity rows of ``x`` are NaN: the variant loads and computes whole row tiles,
so a NaN that reached ``y`` would show a row stored that must not be.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from common import TEST_SPEC, TORCH_DEVICE, to_torch, write_tuned
from moe_torch.ops.grouped_gemm import config as gemm_config
from moe_torch.ops.grouped_gemm.config import GroupedGemmConfig, check_config, grouped_gemm_config
from moe_torch.ops.grouped_gemm.reference import grouped_gemm_reference
from moe_torch.ops.grouped_gemm.triton import _launch, grouped_gemm_triton
from sm90 import compile_sm90
from tolerances import BF16_REL_FRO, F32_REL_FRO, assert_exact, assert_rel_fro
from test_triton_grouped_gemm import assert_guards_untouched, float64_grouped_gemm, make_problem

TMA = GroupedGemmConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=3, tma=True)

#: counts per expert, M_cap, K, N, block_k; the comment says which edge (block_m = block_n = 16).
SHAPES = {
    "ragged-empties": ([5, 0, 19, 0, 3], 32, 48, 40, 32),  # ragged, empty experts, unused capacity, K tail 16 of 32, N tail
    "all-on-one": ([0, 0, 27, 0], 27, 64, 32, 32),  # every row on one expert, M_cap = 27 not a multiple of 16
    "m-cap-k-tail": ([7, 11, 3], 23, 24, 24, 16),  # M_cap 23, K = 24 (tail of 8 with block_k 16), N tail of 8
    "one-row": ([1], 1, 16, 16, 16),  # M = 1 (decode), one whole tile of 15 zero-filled rows
}
#: Launch orders the variant runs under (it shares the pointer kernel's): the default 2-D grid, and a
#: persistent non-power-of-2 group (4 programs in the interpreter, each looping over several tiles).
ORDERS = {"g1": dict(), "g3-persistent": dict(group_m=3, persistent=True)}


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tma_matches_reference(shape, dtype, order):
    """float32 output within F32_REL_FRO of the torch reference and of float64 on the same (rounded) values;
    the ``x.dtype`` output within BF16_REL_FRO of float64; only owned rows are written (a NaN-poisoned,
    over-allocated output keeps NaN in unowned rows and guards); inputs untouched."""
    counts, m_cap, K, N, block_k = SHAPES[shape]
    cfg = dataclasses.replace(TMA, block_k=block_k, **ORDERS[order])
    x_np, w_np, off_np = make_problem(len(shape) + K, counts, m_cap, K, N)
    x, w, offsets = to_torch(x_np, dtype), to_torch(w_np, dtype), to_torch(off_np)
    before = [t.clone() for t in (x, w, offsets)]
    M = int(off_np[-1])
    ref64 = float64_grouped_gemm(x.float().cpu().numpy().astype(np.float64), w.float().cpu().numpy(), off_np)

    f32 = grouped_gemm_triton(x, w, offsets, None, None, torch.float32, cfg)
    ref32 = grouped_gemm_reference(x, w, offsets, None, None, torch.float32)
    assert_rel_fro(f32[:M], ref32[:M], F32_REL_FRO, "TMA float32 output vs torch reference")
    assert_rel_fro(f32, ref64, F32_REL_FRO, "TMA float32 output vs float64")
    assert not f32[M:].any(), "rows >= M are zero"

    buf = torch.full((m_cap + 1, N + 15), float("nan"), dtype=x.dtype, device=x.device)
    view = buf[:m_cap, :N]
    _launch("grouped_gemm", x, w, offsets, None, None, view, cfg)
    assert_guards_untouched(buf, m_cap, N)
    assert torch.isnan(view[M:].float()).all(), "rows >= M never written"
    assert torch.isfinite(view[:M].float()).all()
    assert_rel_fro(view[:M], ref64[:M], BF16_REL_FRO, f"TMA {dtype} output vs float64")
    for t, b in zip((x, w, offsets), before):
        assert_exact(t, b, "input unchanged")


@pytest.mark.parametrize("layout", ["per_token_group-block", "per_token-per_channel"])
@pytest.mark.parametrize("block_n", [16, 256])
def test_tma_fp8_same_as_pointer_kernel(layout, block_n):
    """FP8 through the TMA variant: DeepSeek-V3's 1 x 128 groups x 128 x 128 blocks (the per-step promotion; a
    16-wide tile reads one block scale, a 256-wide one a scale per column) and per-token x per-channel (scales
    after the loop), on ragged experts (one empty), unused capacity and an N tail (N=272: two whole weight
    blocks and a partial one), 2 K blocks: the pointer kernel's output within F32_REL_FRO (the same products;
    the dots may sum them in another order: 1-ulp differences in the interpreter's matmul), and the torch
    reference's within FP8_REL_FRO."""
    from moe_torch import per_token_group_quant_fp8, per_token_quant_fp8, quantize_weight_fp8
    from tolerances import FP8_REL_FRO

    counts, m_cap, K, N = [9, 0, 22, 4], 40, 256, 272
    x_np, w_np, off_np = make_problem(11, counts, m_cap, K, N)
    x_np[int(off_np[-1]):] = 1.0  # unused capacity: finite (the quantizers reject NaN)
    x, w, offsets = to_torch(x_np), to_torch(w_np), to_torch(off_np)
    if layout == "per_token_group-block":
        (xq, xs), (wq, ws) = per_token_group_quant_fp8(x, 128), quantize_weight_fp8(w, "block")
    else:
        (xq, xs), (wq, ws) = per_token_quant_fp8(x), quantize_weight_fp8(w, "per_channel")
    cfg = GroupedGemmConfig(block_m=16, block_n=block_n, block_k=128, num_warps=4, num_stages=3)
    want = grouped_gemm_triton(xq, wq, offsets, xs, ws, torch.float32, cfg)
    got = grouped_gemm_triton(xq, wq, offsets, xs, ws, torch.float32, dataclasses.replace(cfg, tma=True))
    M = int(off_np[-1])
    assert_rel_fro(got, want, F32_REL_FRO, f"TMA vs pointer kernel, fp8 {layout}")
    assert not got[M:].any(), "rows >= M are zero"
    ref = grouped_gemm_reference(xq, wq, offsets, xs, ws, torch.float32)
    assert_rel_fro(got[:M], ref[:M], FP8_REL_FRO, f"TMA fp8 {layout} vs the torch reference")


def test_tma_no_rows_at_all():
    """All experts empty: nothing is stored (the poisoned output stays NaN), zeros from the public launcher."""
    x_np, w_np, off_np = make_problem(3, [0, 0, 0], 8, 32, 16)
    x, w, offsets = to_torch(x_np, "bfloat16"), to_torch(w_np, "bfloat16"), to_torch(off_np)
    assert not grouped_gemm_triton(x, w, offsets, None, None, torch.float32, TMA).any()
    out = torch.full((8, 16), float("nan"), dtype=torch.float32, device=x.device)
    _launch("grouped_gemm", x, w, offsets, None, None, out, TMA)
    assert torch.isnan(out).all()


def test_tma_defaults_off():
    """The new fields default to off, in the dataclass and in every heuristic config: the pointer kernel."""
    cfg = GroupedGemmConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=3)
    assert (cfg.tma, cfg.warp_specialize) == (False, False)
    for bits in (8, 16, 32):
        heur = grouped_gemm_config(2048, 4096, 7168, 32, bits)
        assert (heur.tma, heur.warp_specialize) == (False, False)


def _problem(dtype="bfloat16", K=32):
    x_np, w_np, off_np = make_problem(5, [3, 4], 8, K, 16)
    return to_torch(x_np, dtype), to_torch(w_np, dtype), to_torch(off_np)


def test_tma_refuses_requests_it_does_not_serve():
    """float32, 4-bit weights, a bias and the dgrad with FP8 weights: NotImplementedError naming ``tma=True``
    and what came, from check_config, before any launch (the dgrad's own TMA refusals:
    ``tests/test_triton_dgrad_tma.py``)."""
    for kwargs, what in [(dict(bits=32), "float32"), (dict(bits=16, w_format="mxfp4"), "mxfp4"),
                         (dict(bits=16, bias=True), "bias"), (dict(bits=16, forward=False, w_fp8=True), "dgrad .*FP8")]:
        bits = kwargs.pop("bits")
        with pytest.raises(NotImplementedError, match=f"config tma=True .*{what}"):
            check_config("grouped_gemm", dataclasses.replace(TMA, block_k=32), bits, None, False,
                         kwargs.pop("w_format", None), **kwargs)
    x, w, offsets = _problem("float32")
    with pytest.raises(NotImplementedError, match="grouped_gemm: config tma=True .*float32"):
        grouped_gemm_triton(x, w, offsets, None, None, torch.float32, TMA)
    x, w, offsets = _problem()
    bias = torch.randn(2, 16, device=x.device)
    with pytest.raises(NotImplementedError, match="grouped_gemm: config tma=True .*bias"):
        grouped_gemm_triton(x, w, offsets, None, None, torch.float32, TMA, bias=bias)


def test_tma_config_rules():
    """warp_specialize needs tma (ValueError) and 8 warps (NotImplementedError: sm_90 compile failure);
    non-bool fields and blocks past a TMA box side (256) are ValueError; a valid TMA config passes."""
    check_config("grouped_gemm", TMA, 16, None, False)
    check_config("grouped_gemm", dataclasses.replace(TMA, num_warps=8, warp_specialize=True), 16, None, False)
    with pytest.raises(ValueError, match="warp_specialize=True needs tma=True"):
        check_config("grouped_gemm", dataclasses.replace(TMA, tma=False, warp_specialize=True), 16, None, False)
    with pytest.raises(NotImplementedError, match="warp_specialize=True needs num_warps >= 8"):
        check_config("grouped_gemm", dataclasses.replace(TMA, warp_specialize=True), 16, None, False)
    for bad in (dict(tma=1), dict(warp_specialize=None)):
        with pytest.raises(ValueError, match="bool tma and a bool warp_specialize"):
            check_config("grouped_gemm", dataclasses.replace(TMA, **bad), 16, None, False)
    with pytest.raises(ValueError, match="every block <= 256"):
        check_config("grouped_gemm", dataclasses.replace(TMA, block_n=512), 16, None, False)


def test_tma_refuses_what_tma_cannot_address():
    """Host-side NotImplementedError before launch: a row stride not a multiple of 16 bytes (K = 36 bf16:
    72 B), a base address off 16 bytes, experts not N rows apart in w (no [E * N, K] view)."""
    x, w, offsets = _problem(K=36)
    with pytest.raises(NotImplementedError, match="16-byte aligned .*x .*row stride of 72 bytes"):
        grouped_gemm_triton(x, w, offsets, None, None, torch.float32, TMA)
    x, w, offsets = _problem()
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view(x.shape)
    shifted.copy_(x)
    with pytest.raises(NotImplementedError, match="16-byte aligned .*x at address offset 2"):
        grouped_gemm_triton(shifted, w, offsets, None, None, torch.float32, TMA)
    wide = torch.zeros(2, 24, 32, dtype=w.dtype, device=w.device)
    wide[:, :16] = w
    with pytest.raises(NotImplementedError, match=r"w.stride\(0\) == N \* w.stride\(1\)"):
        grouped_gemm_triton(x, wide[:, :16], offsets, None, None, torch.float32, TMA)


def test_tuned_tma_default_falls_back_to_pointer_kernel_where_tma_cannot_address(monkeypatch):
    """A tuned TMA default (the H200's bf16 and fp8_block entries at M=16384) never makes a request fail
    that the pointer kernel serves: with the default config, inputs TMA cannot address (K = 36 bf16: 72-byte rows; a
    base address off 16 bytes) run the pointer kernel with the same tiles and order (the reference's result); a
    caller's explicit TMA config still raises (test above)."""
    from moe_torch.ops.grouped_gemm import triton as gemm_triton

    monkeypatch.setattr(gemm_triton, "_default_config", lambda *a, **k: dataclasses.replace(TMA, group_m=3))
    x, w, offsets = _problem(K=36)
    ref = grouped_gemm_reference(x, w, offsets, None, None, torch.float32)
    assert_rel_fro(grouped_gemm_triton(x, w, offsets, None, None, torch.float32), ref, F32_REL_FRO, "K=36 default")
    x, w, offsets = _problem()
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view(x.shape)
    shifted.copy_(x)
    ref = grouped_gemm_reference(x, w, offsets, None, None, torch.float32)
    assert_rel_fro(grouped_gemm_triton(shifted, w, offsets, None, None, torch.float32), ref, F32_REL_FRO, "offset x")


def test_tuned_tma_entry_skipped_for_bias(tmp_path, monkeypatch):
    """A tuned bf16 entry with tma=True is the default without bias; with a bias the heuristic (no TMA)."""
    entry = {"device": "Test GPU", "E": 32, "N": 4096, "K": 7168, "M_cap": 16384, "dtype": "bf16",
             "config": dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, tma=True)}
    write_tuned(tmp_path, [entry])
    monkeypatch.setattr(gemm_config, "TUNED_DIR", str(tmp_path))
    gemm_config.tuned_tables.cache_clear()
    try:
        plain = grouped_gemm_config(16384, 4096, 7168, 32, 16, device=TEST_SPEC)
        with_bias = grouped_gemm_config(16384, 4096, 7168, 32, 16, device=TEST_SPEC, bias=True)
    finally:
        gemm_config.tuned_tables.cache_clear()
    assert plain == GroupedGemmConfig(**entry["config"])
    assert not with_bias.tma


# --------------------------------------------------------------------------------------
# sm_90 lowering on the CPU (child process without the interpreter; tests/sm90.py)


_INT_ARGS = ("M_cap", "N", "K", "E", "stride_xm", "stride_we", "stride_wn", "stride_om", "stride_xsm", "stride_xsk",
             "stride_wse", "stride_wsn", "stride_wsk", "stride_be")


def _tma_job(bm, bn, bk, warps, ws, persistent=False, group_m=1, fp8_block=False):
    t = "fp8e4nv" if fp8_block else "bf16"
    return {"signature": {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "offsets_ptr": "*i32", "x_scale_ptr": "*fp32",
                          "w_scale_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*bf16", **{a: "i32" for a in _INT_ARGS},
                          "x_desc": f"tensordesc<{t}[{bm}, {bk}]>", "w_desc": f"tensordesc<{t}[{bn}, {bk}]>"},
            "constexprs": {"X_SCALE": 3 if fp8_block else 0, "W_SCALE": 3 if fp8_block else 0,
                           "X_GROUP": 128 if fp8_block else 1, "W_BLOCK": 128 if fp8_block else 1, "IEEE_F32": False,
                           "HAS_BIAS": False,
                           "BLOCK_E": 64, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m,
                           "PERSISTENT": persistent, "TMA": True, "WARP_SPECIALIZE": ws},
            "options": {"num_warps": warps, "num_stages": 3}}


@pytest.mark.skipif(TORCH_DEVICE != "cpu", reason="compiles in a child process; the GPU run compiles for real")
def test_tma_compiles_for_sm90():
    """The variant lowers to TMA copies (``cp.async.bulk.tensor``) feeding ``wgmma`` (bf16), in the default and
    the persistent grouped order. ``warp_specialize=True`` at 8 warps gives PTX identical to False in triton 3.6
    on sm_90 (no producer partition, no ``setmaxnreg``): the finding of the module docstring; if a new triton
    changes that, this test says so and the docstring must be updated."""
    jobs = {"64x128": _tma_job(64, 128, 64, 4, False), "128x256-persistent-g8": _tma_job(128, 256, 64, 8, False, True, 8),
            "128x256-persistent-g8-ws": _tma_job(128, 256, 64, 8, True, True, 8),
            "fp8-block-64x128-g8": _tma_job(64, 128, 128, 4, False, group_m=8, fp8_block=True)}
    ptx = compile_sm90(jobs, "moe_torch.ops.grouped_gemm.triton", "_grouped_gemm_kernel")
    for name, p in ptx.items():
        assert ".target sm_90" in p and "cp.async.bulk.tensor" in p, name
        assert "wgmma.mma_async.sync.aligned" in p, name
        assert (".e4m3.e4m3" if name.startswith("fp8") else ".bf16.bf16") in p, name
    assert ptx["128x256-persistent-g8-ws"] == ptx["128x256-persistent-g8"], "warp_specialize became effective on sm_90"
    assert "setmaxnreg" not in ptx["128x256-persistent-g8-ws"]


@pytest.mark.skipif(TORCH_DEVICE != "cpu", reason="a compile-only probe, run in a child process on the CPU")
def test_gluon_compiles_the_overlapped_fp8_promotion_for_sm90():
    """The module docstring's finding on Triton 3.6's Gluon (``tests/gluon_promotion_probe.py``): two FP8 K
    blocks a step, the first awaited with the second in flight, keep ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` in the sm_90
    SASS; promoting a block issued in the previous iteration is serialized by ptxas (C7514). If a new triton changes
    either, this test says so and the docstring must be updated."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, os.path.join(root, "tests", "gluon_promotion_probe.py")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if line.startswith(("loop_carried", "two_blocks")))
    assert "0x1" in lines["two_blocks"] and "no serialization warning" in lines["two_blocks"], lines
    assert "0x1" not in lines["loop_carried"] and "C7514" in lines["loop_carried"], lines
