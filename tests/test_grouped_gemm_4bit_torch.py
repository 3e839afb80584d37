"""Grouped GEMM with 4-bit weights in torch (CONTRACT.md section 9): the shared cases of
``op_cases/grouped_gemm_4bit.py`` (``TestGroupedGemm4bitTorch``: the reference against float64, the Triton kernel,
interpreted on the CPU, against the reference over ragged rows, K tails and the edges, the e8m0 NaN and subnormal
scales, the straight-through gradient of ``x`` on both, no local experts, int32-packed codes, the bad inputs); then
the Triton launch's K steps and guards, the frozen scale, the configs, the CPU default and the sm_90 compilation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moe_torch
from common import TORCH_DEVICE, TORCH_DTYPES, TRITON_INTERPRETER_BROKEN, needs_triton_interpreter
from moe_torch.ops.grouped_gemm.config import GroupedGemmConfig, check_config, grouped_gemm_config
from moe_torch.ops.grouped_gemm.reference import grouped_gemm_reference
from op_cases import TorchArrays
from op_cases.grouped_gemm_4bit import FORMATS, LIMITS, GroupedGemm4bitCases, kernel_cases, w4_problem
from tolerances import assert_exact, assert_rel_fro


class TestGroupedGemm4bitTorch(TorchArrays, GroupedGemm4bitCases):
    """``moe_torch.grouped_gemm(w_format=...)``: the reference, and the Triton kernel through
    ``implementation="triton"`` (its heuristic config). The kernel runs its shapes in both formats and dtypes (K = 96:
    a K tail at block_k 64; the K steps of the other shapes: test_triton_k_tails_and_guards); the gradient runs on
    both implementations."""

    OPS = moe_torch
    KERNEL = "triton"
    KERNEL_CASES = kernel_cases(["ragged-empty-experts", "all-rows-one-expert", "decode-M1", "tail-rows"])
    IMPLEMENTATIONS = {"reference": "reference", "triton": pytest.param("triton", marks=needs_triton_interpreter)}

    @pytest.fixture
    def kernel_runs(self):
        if TRITON_INTERPRETER_BROKEN:
            pytest.skip(needs_triton_interpreter.kwargs["reason"])

    def kernel_grouped_gemm(self, x, w_q, offsets, w_scale, fmt, out_dtype=None):
        return moe_torch.grouped_gemm(x, w_q, offsets, w_scale=w_scale, w_format=fmt, out_dtype=out_dtype,
                                      implementation="triton")

    def reference_grouped_gemm(self, x, w_q, offsets, w_scale, fmt, out_dtype=None):
        return moe_torch.grouped_gemm(x, w_q, offsets, w_scale=w_scale, w_format=fmt, out_dtype=out_dtype,
                                      implementation="reference")

    def float_reference(self, x, w, offsets, out_dtype):
        return grouped_gemm_reference(x, w, offsets, None, None, TORCH_DTYPES[out_dtype])

    def x_gradient(self, x, w_q, offsets, w_scale, fmt, d_y, implementation):
        x = x.detach().requires_grad_()
        y = moe_torch.grouped_gemm(x, w_q, offsets, w_scale=w_scale, w_format=fmt, implementation=implementation)
        (d_x,) = torch.autograd.grad(y, x, d_y)
        return d_x


def problem(seed: int, counts: list[int], N: int, K: int, m_cap: int, fmt: str, dtype: torch.dtype):
    """The shared :func:`w4_problem` as torch tensors: ``x`` in ``dtype``, ``w_q``, ``w_scale``, ``offsets``."""
    x, w, offsets = w4_problem(seed, counts, m_cap, K, N)
    w_q, w_scale = getattr(moe_torch, f"quantize_weight_{fmt}")(torch.from_numpy(w).to(TORCH_DEVICE))
    return torch.from_numpy(x).to(dtype).to(TORCH_DEVICE), w_q, w_scale, torch.from_numpy(offsets).to(TORCH_DEVICE)


@needs_triton_interpreter
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype,block_k,K", [("float32", 64, 96), ("bfloat16", 128, 160), ("bfloat16", 32, 64)])
def test_triton_k_tails_and_guards(fmt, dtype, block_k, K):
    """K steps past K (96 = 64 + half a step, 160 = 128 + a quarter) and whole-group steps (32); the kernel
    writes nothing outside its rows and columns (a NaN-filled buffer one row and 15 columns larger)."""
    from moe_torch.ops.grouped_gemm.triton import _launch

    counts = [2, 0, 9, 3]
    x, w_q, w_scale, offsets = problem(2, counts, 20, K, 16, fmt, TORCH_DTYPES[dtype])
    cfg = GroupedGemmConfig(block_m=16, block_n=16, block_k=block_k, num_warps=4, num_stages=2)
    buf = torch.full((17, 35), float("nan"), dtype=x.dtype, device=x.device)
    view = buf[:16, :20]
    _launch("grouped_gemm", x, w_q, offsets, None, w_scale, view, cfg, fmt)
    M = sum(counts)
    ref = grouped_gemm_reference(x, w_q, offsets, None, w_scale, x.dtype, w_format=fmt)
    assert_rel_fro(view[:M], ref[:M], LIMITS[dtype], f"block_k={block_k} K={K}")
    assert torch.isnan(buf[M:].float()).all(), "rows >= M not written"
    assert torch.isnan(buf[:, 20:].float()).all(), "columns >= N not written"


def test_int4_scale_that_requires_grad_is_refused():
    """4-bit scales are frozen: an INT4 scale that requires grad is a TypeError where a gradient could flow, and
    fine under no_grad (inference)."""
    x, w_q, w_scale, offsets = problem(4, [3, 0, 6], 32, 64, 12, "int4", torch.float32)
    x = torch.nan_to_num(x).requires_grad_()
    scale = w_scale.clone().requires_grad_()
    with pytest.raises(TypeError, match="grouped_gemm: w_scale must not require grad: 4-bit scales are frozen"):
        moe_torch.grouped_gemm(x, w_q, offsets, w_scale=scale, w_format="int4")
    with torch.no_grad():  # inference with such a scale is fine
        moe_torch.grouped_gemm(x, w_q, offsets, w_scale=scale, w_format="int4")


def test_default_config_covers_whole_groups():
    """4-bit K steps cover whole groups of 32 (float32 x would take 32, bf16 64); a config with a 16-wide step
    is refused; the tuned bf16 table is not used for 4-bit weights (its own dtype key)."""
    for bits in (16, 32):
        for M_cap in (1, 4096):
            cfg = grouped_gemm_config(M_cap, 4096, 7168, 32, bits, None, False, None, w_format="int4")
            assert cfg.block_k % 32 == 0
            check_config("grouped_gemm", cfg, bits, None, False, "int4")
    assert grouped_gemm_config(1, 4096, 7168, 32, 16, w_format="mxfp4").block_m == 16, "decode: 16-row tiles"
    bad = GroupedGemmConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="whole mxfp4 scale groups of 32"):
        check_config("grouped_gemm", bad, 16, None, False, "mxfp4")
    check_config("grouped_gemm", dataclasses.replace(bad, block_k=32), 16, None, False, "mxfp4")


@pytest.mark.skipif(TORCH_DEVICE != "cpu", reason="CUDA tensors default to the Triton kernel")
def test_default_implementation_on_cpu_is_the_reference():
    x, w_q, w_scale, offsets = problem(6, [2, 3], 16, 32, 6, "int4", torch.bfloat16)
    assert_exact(moe_torch.grouped_gemm(x, w_q, offsets, w_scale=w_scale, w_format="int4"),
                 grouped_gemm_reference(x, w_q, offsets, None, w_scale, x.dtype, w_format="int4"), "default")


# --------------------------------------------------------------------------------------
# sm_90 compilation on the CPU (tests/sm90.py: a child process without the interpreter)

_INT_ARGS = ("M_cap", "N", "K", "E", "stride_xm", "stride_we", "stride_wn", "stride_om", "stride_xsm", "stride_xsk",
             "stride_wse", "stride_wsn", "stride_wsk", "stride_be")


def _w4_job(fmt: str, dtype: str, M_cap: int, N: int, K: int, E: int) -> dict:
    from moe_torch.ops.grouped_gemm.triton import W_SCALE_CODES

    cfg = grouped_gemm_config(M_cap, N, K, E, 16 if dtype == "bf16" else 32, w_format=fmt)
    return {
        "module": "moe_torch.ops.grouped_gemm.triton", "kernel": "_grouped_gemm_kernel",
        "signature": {"x_ptr": f"*{dtype}", "w_ptr": "*u8", "offsets_ptr": "*i32", "x_scale_ptr": "*fp32",
                      "w_scale_ptr": "*u8" if fmt == "mxfp4" else "*bf16", "bias_ptr": "*fp32", "out_ptr": "*bf16",
                      **{a: "i32" for a in _INT_ARGS},
                      # as _launch: the e8m0 -> bf16 table of the packed MXFP4 decode with bf16 x
                      **({"e8m0_lut": "*bf16"} if fmt == "mxfp4" and dtype == "bf16" else {})},
        "constexprs": {"X_SCALE": 0, "W_SCALE": W_SCALE_CODES[fmt], "X_GROUP": 1, "W_BLOCK": 1,
                       "IEEE_F32": dtype == "fp32", "HAS_BIAS": False, "BLOCK_E": 1 << E.bit_length(), "BLOCK_M": cfg.block_m,
                       "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m,
                       "PERSISTENT": cfg.persistent},
        "options": {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    }


def test_compiles_for_sm90():
    """The 4-bit kernels lower to sm_90 (gpt-oss-like shapes, N = 2 * 2880 over K = 2880, E = 32): many rows per
    expert on wgmma, decode (M_cap = 8) on mma.sync, float32 x on neither (IEEE); bf16 x decodes by the packed asm
    (moe_contract/w4_packed_asm.py: lop3 / fma.rn.bf16x2, two codes an instruction), float32 x by the float32 decode,
    and no multiply flushes subnormals (no .ftz)."""
    from sm90 import compile_sm90

    jobs = {"mxfp4-bf16-64rows": _w4_job("mxfp4", "bf16", 16384, 5760, 2880, 32),
            "int4-bf16-decode": _w4_job("int4", "bf16", 8, 5760, 2880, 32),
            "mxfp4-fp32": _w4_job("mxfp4", "fp32", 256, 5760, 2880, 32)}
    ptx = compile_sm90(jobs)
    assert "wgmma.mma_async.sync.aligned" in ptx["mxfp4-bf16-64rows"] and ".bf16.bf16" in ptx["mxfp4-bf16-64rows"]
    assert "mma.sync.aligned" in ptx["int4-bf16-decode"]
    assert "wgmma" not in ptx["mxfp4-fp32"] and "mma.sync" not in ptx["mxfp4-fp32"] and ".tf32" not in ptx["mxfp4-fp32"]
    for name, text in ptx.items():
        assert ".target sm_90" in text and ".ftz" not in text, name
        packed = "fma.rn.bf16x2" in text and ("0x81C081C0" if "mxfp4" in name else "0x43004300") in text
        assert packed == ("bf16" in name), name
    # the MXFP4 scales come from the table: no per-element e8m0 special cases (s == 0, s == 255) left in the loop
    assert "32704" not in ptx["mxfp4-bf16-64rows"] and "0x7FC0" not in ptx["mxfp4-bf16-64rows"]


def test_heuristic_k_step_of_4bit_weights():
    """bf16 x with 4-bit weights steps K by 128 (the measured choice, BENCHMARKS.md: 5% faster than 64 at
    gpt-oss-120b's decode); float32 x keeps its 16-bit sibling's step; never wider than K needs."""
    from moe_torch.ops.grouped_gemm.config import heuristic_grouped_gemm_config

    for fmt in ("mxfp4", "int4"):
        cfg = heuristic_grouped_gemm_config(256, 5760, 2880, 128, 16, w_format=fmt)
        assert (cfg.block_m, cfg.block_n, cfg.block_k) == (16, 128, 128)
        assert heuristic_grouped_gemm_config(256, 5760, 2880, 128, 32, w_format=fmt).block_k == 32
        assert heuristic_grouped_gemm_config(8, 64, 64, 4, 16, w_format=fmt).block_k == 64
