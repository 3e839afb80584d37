"""Grouped GEMM with 4-bit weights in torch (CONTRACT.md section 9): the reference against a float64 loop on
the dequantized weights, the Triton kernel (interpreted on the CPU) against the reference over ragged rows,
K tails and the edges, the straight-through gradient of ``x``, and the bad inputs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import moe_torch
from common import TORCH_DEVICE, needs_triton_interpreter
from moe_torch.ops.grouped_gemm.config import GroupedGemmConfig, check_config, grouped_gemm_config
from moe_torch.ops.grouped_gemm.reference import grouped_gemm_reference
from tolerances import BF16_REL_FRO, F32_REL_FRO, assert_exact, assert_rel_fro

FORMATS = ("mxfp4", "int4")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def quantize(w: torch.Tensor, fmt: str):
    return getattr(moe_torch, f"quantize_weight_{fmt}")(w)


def dequantize(w_q, w_scale, fmt: str, out_dtype=torch.float32):
    return getattr(moe_torch, f"dequantize_weight_{fmt}")(w_q, w_scale, out_dtype=out_dtype)


def problem(seed: int, counts: list[int], N: int, K: int, m_cap: int, fmt: str, dtype: torch.dtype):
    """``x [m_cap, K]`` (rows >= offsets[-1] are NaN: must never be read), 4-bit ``w`` of ``[E, N, K]`` random
    weights ~ 1/sqrt(K) (outputs O(1)), ``offsets`` from ``counts``."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    assert offsets[-1] <= m_cap
    x = rng.standard_normal((m_cap, K)).astype(np.float32)
    x[offsets[-1]:] = np.nan
    w = (rng.standard_normal((len(counts), N, K)) / np.sqrt(K)).astype(np.float32)
    w_q, w_scale = quantize(torch.from_numpy(w), fmt)
    dev = TORCH_DEVICE
    return (torch.from_numpy(x).to(dtype).to(dev), w_q.to(dev), w_scale.to(dev), torch.from_numpy(offsets).to(dev))


def float64_loop(x: torch.Tensor, wd: torch.Tensor, offsets: torch.Tensor) -> np.ndarray:
    """float64 ``y[m] = x[m] @ wd[e(m)].T``, rows outside ``[0, offsets[-1])`` zero."""
    xn, wn, off = x.float().cpu().numpy().astype(np.float64), wd.float().cpu().numpy().astype(np.float64), offsets.tolist()
    y = np.zeros((x.shape[0], wd.shape[1]))
    for e in range(wd.shape[0]):
        y[off[e]:off[e + 1]] = xn[off[e]:off[e + 1]] @ wn[e].T
    return y


# Each case names the edge it exercises (E experts by their row counts).
CASES = {
    "ragged-empty-experts": ([3, 0, 17, 0, 5], 32),  # empty experts between and at the end, tiles straddle experts
    "all-rows-one-expert": ([0, 0, 21, 0], 24),  # one expert owns every row, spare rows poisoned
    "decode-M1": ([0, 1, 0, 0], 1),  # one token: M = 1 (decode)
    "tail-rows": ([1, 1, 1], 7),  # fewer rows than a tile, rows >= M poisoned
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reference_matches_float64_loop(fmt, dtype):
    """The reference is the float64 product of x with the dequantized weights (float32, rounded to x.dtype),
    within the contract's row for its output dtype; the float32 `wd` judge of section 9 holds for bf16 too."""
    counts, m_cap = CASES["ragged-empty-experts"]
    x, w_q, w_scale, offsets = problem(0, counts, 40, 96, m_cap, fmt, DTYPES[dtype])
    y = moe_torch.grouped_gemm(x, w_q, offsets, w_scale=w_scale, w_format=fmt, implementation="reference")
    assert y.dtype == x.dtype and y.shape == (m_cap, 40)
    wd32 = dequantize(w_q, w_scale, fmt)
    truth = float64_loop(x, wd32, offsets)  # section 9's judge: the float32 wd
    assert_rel_fro(y, truth, F32_REL_FRO if dtype == "float32" else BF16_REL_FRO, f"{fmt} {dtype} vs float64")
    if dtype == "bfloat16":  # and what it computes: wd rounded to bf16, float32 accumulation (float32 out)
        y32 = moe_torch.grouped_gemm(x, w_q, offsets, w_scale=w_scale, w_format=fmt, out_dtype=torch.float32,
                                     implementation="reference")
        assert_rel_fro(y32, float64_loop(x, wd32.to(torch.bfloat16), offsets), F32_REL_FRO, "bf16-rounded wd")
    assert not torch.isnan(y).any() and (y[sum(counts):] == 0).all(), "poisoned rows >= M never read, zero"


@needs_triton_interpreter
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference(fmt, dtype, case):
    counts, m_cap = CASES[case]
    x, w_q, w_scale, offsets = problem(1, counts, 24, 96, m_cap, fmt, DTYPES[dtype])  # K = 96: a K tail at block_k 64
    y = moe_torch.grouped_gemm(x, w_q, offsets, w_scale=w_scale, w_format=fmt, implementation="triton")
    ref = grouped_gemm_reference(x, w_q, offsets, None, w_scale, x.dtype, w_format=fmt)
    M = sum(counts)
    assert not torch.isnan(y).any() and (y[M:] == 0).all(), "rows >= M: not read (NaN), not written (zero)"
    if dtype == "float32":
        assert_rel_fro(y[:M], ref[:M], F32_REL_FRO, f"{case}: triton vs reference")
    else:
        assert_rel_fro(y[:M], ref[:M], BF16_REL_FRO, f"{case}: triton vs reference")
        assert_rel_fro(y[:M], float64_loop(x, dequantize(w_q, w_scale, fmt), offsets)[:M], BF16_REL_FRO, "vs float64")
        # the kernel rounds wd to bf16 before the dot (section 9): a float32 output shows it
        y32 = moe_torch.grouped_gemm(x, w_q, offsets, w_scale=w_scale, w_format=fmt, out_dtype=torch.float32,
                                     implementation="triton")
        wd16 = dequantize(w_q, w_scale, fmt, out_dtype=torch.bfloat16)
        assert_rel_fro(y32[:M], float64_loop(x, wd16, offsets)[:M], F32_REL_FRO, "bf16-rounded wd, float32 sums")


@needs_triton_interpreter
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype,block_k,K", [("float32", 64, 96), ("bfloat16", 128, 160), ("bfloat16", 32, 64)])
def test_triton_k_tails_and_guards(fmt, dtype, block_k, K):
    """K steps past K (96 = 64 + half a step, 160 = 128 + a quarter) and whole-group steps (32); the kernel
    writes nothing outside its rows and columns (a NaN-filled buffer one row and 15 columns larger)."""
    from moe_torch.ops.grouped_gemm.triton import _launch

    counts = [2, 0, 9, 3]
    x, w_q, w_scale, offsets = problem(2, counts, 20, K, 16, fmt, DTYPES[dtype])
    cfg = GroupedGemmConfig(block_m=16, block_n=16, block_k=block_k, num_warps=4, num_stages=2)
    buf = torch.full((17, 35), float("nan"), dtype=x.dtype, device=x.device)
    view = buf[:16, :20]
    _launch("grouped_gemm", x, w_q, offsets, None, w_scale, view, cfg, fmt)
    M = sum(counts)
    ref = grouped_gemm_reference(x, w_q, offsets, None, w_scale, x.dtype, w_format=fmt)
    assert_rel_fro(view[:M], ref[:M], F32_REL_FRO if dtype == "float32" else BF16_REL_FRO, f"block_k={block_k} K={K}")
    assert torch.isnan(buf[M:].float()).all(), "rows >= M not written"
    assert torch.isnan(buf[:, 20:].float()).all(), "columns >= N not written"


@needs_triton_interpreter
def test_triton_mxfp4_scale_edges_nan_and_subnormal():
    """e8m0 255 makes its expert's outputs NaN (in both backends, at the same places); s = 0 and s = 1 scale
    by 2^-127 (a subnormal multiplier) and 2^-126: with x ~ 2^120 the products are normal float32 values that
    the kernel must reproduce (a flushed subnormal would give 0)."""
    rng = np.random.default_rng(3)
    E, N, K = 3, 16, 64
    w_q = torch.from_numpy(rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)).to(TORCH_DEVICE)
    w_scale = torch.from_numpy(rng.integers(0, 3, (E, N, K // 32), dtype=np.uint8)).to(TORCH_DEVICE)  # s in {0, 1, 2}
    w_scale[2, 5, 1] = 255
    offsets = torch.tensor([0, 4, 9, 12], dtype=torch.int32, device=TORCH_DEVICE)
    x = torch.from_numpy((rng.standard_normal((12, K)) * 2.0**120).astype(np.float32)).to(TORCH_DEVICE)
    y = moe_torch.grouped_gemm(x, w_q, offsets, w_scale=w_scale, w_format="mxfp4", implementation="triton")
    ref = moe_torch.grouped_gemm(x, w_q, offsets, w_scale=w_scale, w_format="mxfp4", implementation="reference")
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.isnan(y[9:12, 5]).all() and torch.isnan(y).sum() == 3, "only expert 2's column 5"
    ok = ~torch.isnan(ref)
    assert ref[ok].abs().min() > 0 and ref[ok].abs().max() < 1e6
    assert_rel_fro(y[ok], ref[ok], F32_REL_FRO, "subnormal e8m0 multipliers")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("implementation", [
    "reference", pytest.param("triton", marks=needs_triton_interpreter)])
def test_gradient_of_x_is_straight_through(fmt, dtype, implementation):
    """d_x[m] = d_y[m] @ wd[e(m)], wd dequantized and rounded to x.dtype; rows >= M get 0; no gradient
    reaches w or w_scale (frozen), and a scale that requires grad is refused."""
    counts, m_cap = [3, 0, 6], 12
    x, w_q, w_scale, offsets = problem(4, counts, 32, 64, m_cap, fmt, DTYPES[dtype])
    x = torch.nan_to_num(x).requires_grad_()
    y = moe_torch.grouped_gemm(x, w_q, offsets, w_scale=w_scale, w_format=fmt, implementation=implementation)
    d_y = torch.from_numpy(np.random.default_rng(5).standard_normal(y.shape).astype(np.float32)).to(y)
    (d_x,) = torch.autograd.grad(y, x, d_y)
    assert d_x.dtype == x.dtype
    wd = dequantize(w_q, w_scale, fmt, out_dtype=x.dtype).double()
    want = np.zeros((m_cap, 64))
    off = offsets.tolist()
    for e in range(len(counts)):
        want[off[e]:off[e + 1]] = (d_y[off[e]:off[e + 1]].double() @ wd[e]).cpu().numpy()
    assert (d_x[sum(counts):] == 0).all()
    assert_rel_fro(d_x, want, F32_REL_FRO if dtype == "float32" else BF16_REL_FRO, f"{fmt} d_x")
    if fmt == "int4":
        with pytest.raises(TypeError, match="grouped_gemm: w_scale must not require grad: 4-bit scales are frozen"):
            moe_torch.grouped_gemm(x, w_q, offsets, w_scale=w_scale.clone().requires_grad_(), w_format=fmt)
        with torch.no_grad():  # inference with such a scale is fine
            moe_torch.grouped_gemm(x, w_q, offsets, w_scale=w_scale.clone().requires_grad_(), w_format=fmt)


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


def test_bad_inputs():
    x = torch.ones((4, 64), dtype=torch.bfloat16)
    offsets = torch.tensor([0, 2, 4], dtype=torch.int32)
    w_q = torch.zeros((2, 8, 32), dtype=torch.uint8)
    s8, sbf = torch.zeros((2, 8, 2), dtype=torch.uint8), torch.zeros((2, 8, 2), dtype=torch.bfloat16)
    gg = moe_torch.grouped_gemm
    with pytest.raises(ValueError, match=r"grouped_gemm: w_format must be one of \('mxfp4', 'int4'\) for uint8 w"):
        gg(x, w_q, offsets, w_scale=s8)
    with pytest.raises(ValueError, match="grouped_gemm: w_format must be one of"):
        gg(x, w_q, offsets, w_scale=s8, w_format="fp4")
    with pytest.raises(ValueError, match="grouped_gemm: w_format must be None unless w holds 4-bit packed codes"):
        gg(x, torch.ones((2, 8, 64), dtype=torch.bfloat16), offsets, w_format="int4")
    with pytest.raises(ValueError, match=r"grouped_gemm: K \(=x.shape\[1\]\) must be a multiple of 32"):
        gg(torch.ones((4, 48), dtype=torch.bfloat16), torch.zeros((2, 8, 24), dtype=torch.uint8), offsets,
           w_scale=s8[..., :1], w_format="mxfp4")
    with pytest.raises(ValueError, match=r"grouped_gemm: w must be \[E, N, K // 2\] uint8 .* \(=64\); got w.shape=\(2, 8, 64\)"):
        gg(x, torch.zeros((2, 8, 64), dtype=torch.uint8), offsets, w_scale=s8, w_format="mxfp4")
    with pytest.raises(ValueError, match=r"grouped_gemm: w_scale must be given for int4 w"):
        gg(x, w_q, offsets, w_format="int4")
    with pytest.raises(ValueError, match=r"grouped_gemm: w_scale must be \[E, N, K // 32\] = \(2, 8, 2\) bfloat16"):
        gg(x, w_q, offsets, w_scale=sbf[:, :, :1], w_format="int4")
    with pytest.raises(TypeError, match="grouped_gemm: w_scale must have dtype uint8 for mxfp4"):
        gg(x, w_q, offsets, w_scale=sbf, w_format="mxfp4")
    with pytest.raises(TypeError, match="grouped_gemm: w_scale must have dtype bfloat16 for int4"):
        gg(x, w_q, offsets, w_scale=s8, w_format="int4")
    with pytest.raises(TypeError, match="grouped_gemm: x must have dtype float32 or bfloat16 or float16 with mxfp4 w"):
        gg(x.to(torch.float8_e4m3fn), w_q, offsets, w_scale=s8, w_format="mxfp4")
    with pytest.raises(ValueError, match="grouped_gemm: x_scale must be None for int4 w"):
        gg(x, w_q, offsets, x_scale=torch.ones(()), w_scale=sbf, w_format="int4")
    with pytest.raises(ValueError, match=r"grouped_gemm: expert_offsets must be \[E \+ 1\] = \(3,\)"):
        gg(x, w_q, offsets[:2], w_scale=sbf, w_format="int4")
    assert gg(x, w_q, offsets, w_scale=sbf, w_format="int4").shape == (4, 8)  # the valid call beside them


@pytest.mark.parametrize("fmt", FORMATS)
def test_int32_packed_codes_are_a_type_error_naming_the_uint8_view(fmt):
    """compressed-tensors' ``weight_packed`` is int32 ``[N, K // 8]``; given as ``w`` it is a TypeError saying to view it
    as uint8 (it was a ValueError telling the user to drop ``w_format``). The uint8 view is the quantizer's codes:
    same GEMM bit for bit."""
    x, w_q, w_scale, offsets = problem(11, [3, 2], 8, 64, 6, fmt, torch.bfloat16)
    packed = w_q.view(torch.int32)  # [E, N, K // 8]: eight codes an int32, element i at bits 4i (little-endian)
    with pytest.raises(TypeError, match=rf"grouped_gemm: w must have dtype uint8 for w_format='{fmt}' .*view it as "
                                        r"uint8.*got w.dtype=int32"):
        moe_torch.grouped_gemm(x, packed, offsets, w_scale=w_scale, w_format=fmt)
    with pytest.raises(TypeError, match=r"grouped_gemm: w must have dtype uint8 .*got w.dtype=int8"):
        moe_torch.grouped_gemm(x, w_q.view(torch.int8), offsets, w_scale=w_scale, w_format=fmt)
    assert torch.equal(moe_torch.grouped_gemm(x, packed.view(torch.uint8), offsets, w_scale=w_scale, w_format=fmt),
                       moe_torch.grouped_gemm(x, w_q, offsets, w_scale=w_scale, w_format=fmt))


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
