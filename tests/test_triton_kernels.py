"""The Triton kernels of ``moe_torch`` against the torch references (CONTRACT.md sections 3-5, 7).

Kernels: ``act_and_mul`` (``moe_torch/ops/activation/triton.py``, on the shared cases of
``op_cases/activation.py``: ``TestActivationTriton``) and ``combine`` (``moe_torch/ops/combine/triton.py``, on
those of ``op_cases/combine.py``: ``TestCombineTriton``), called through the public API with
``implementation="triton"`` (so the dispatch path is exercised too), and directly with forced small blocks.

On the CPU (``EPMOE_TEST_DEVICE=cpu``) they run in Triton's interpreter (``TRITON_INTERPRET=1``
is set by ``conftest.py``). triton 3.6's interpreter gets two casts that the kernels use wrong
(``_convert_float`` in ``triton/runtime/interpreter.py``, reached from ``cast_impl`` and
``create_fp_to_fp``): float32 -> bf16 truncates instead of rounding to nearest even, and
float32 -> fp8 rounds half away from zero on the mantissa without carrying into the exponent or
saturating (triton-lang/triton#8322 shows the same for fp16 -> fp8e5). ``moe_torch`` replaces
those two conversions, whenever it runs under the interpreter, by
``ml_dtypes``' correctly rounded ones (``moe_torch/ops/triton_interpret.py``), with the saturation of NVIDIA's
``cvt.rn.satfinite.e4m3x2.f32`` for float8_e4m3fn; ``test_casts_round_like_torch`` proves the
patched casts (and, on the GPU, the hardware casts) bit-identical to torch; all tests run on the
CPU and none is skipped.

On the GPU machine (``EPMOE_TEST_DEVICE=gpu``) the same tests run compiled.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import moe_torch
from common import TORCH_DEVICE, TORCH_DTYPES, to_torch
from moe_torch.ops.activation import api as act_api
from moe_torch.ops.activation.config import ActAndMulConfig, act_and_mul_config
from moe_torch.ops.activation.reference import act_and_mul_reference
from moe_torch.ops.combine import api as combine_api
from moe_torch.ops.combine.config import CombineConfig, combine_config
from moe_torch.ops.combine.reference import combine_reference
from moe_torch.ops.quant.reference import (
    dequantize_fp8_reference,
    per_token_group_quant_fp8_reference,
    per_token_quant_fp8_reference,
)
from moe_torch.ops.triton_common import check_triton_device
from op_cases import TorchArrays
from op_cases.activation import ActivationCases, h_problem
from op_cases.combine import CombineCases
from tolerances import assert_exact
from sm90 import compile_sm90

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

@triton.jit
def _cast_probe_kernel(
    x_ptr,  # [N] float32
    bf16_ptr,  # [N] bf16: cast_rne(x)
    fp16_ptr,  # [N] float16: cast_rne(x)
    fp8_ptr,  # [N] float8_e4m3fn: cast_rne(x), saturating
    up_ptr,  # [N] float32: float32(bf16 value) + float32(fp8 value), the upcasts
    N,  # int
    BLOCK: tl.constexpr,  # elements per program
):
    """Grid ``(cdiv(N, BLOCK),)``: the casts the kernels use, on their own."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    b = x.to(tl.bfloat16)
    q = x.to(tl.float8e4nv)
    tl.store(bf16_ptr + offs, b, mask=mask)
    tl.store(fp16_ptr + offs, x.to(tl.float16), mask=mask)
    tl.store(fp8_ptr + offs, q, mask=mask)
    tl.store(up_ptr + offs, b.to(tl.float32) + q.to(tl.float32), mask=mask)


@pytest.mark.skipif(TORCH_DEVICE == "cuda", reason=(
    "checks the interpreter patch; on the H200 (2026-11-29, triton 3.6.0) this probe kernel failed in "
    "ConvertTritonGPUToLLVM, while every kernel's own casts passed their GPU tests"))
def test_casts_round_like_torch():
    """float32 -> bf16 / fp16 / fp8 (and back) bit-identical to torch: random values over the whole
    exponent range, exact ties of each format (RNE), subnormals, and fp8 overflow (saturates)."""
    rng = np.random.default_rng(0)
    mags = np.exp2(rng.uniform(-24, 12, 6000)).astype(np.float32) * rng.choice([-1, 1], 6000)
    bf16_ties = (rng.integers(0x3F00, 0x4400, 500).astype(np.uint32) << 16 | 0x8000).view(np.float32)
    fp8_ties = np.array([1.0625, 1.1875, 3 * 2.0**-10, -3.375, 17.0, 248.0, 2.0**-10],
                        np.float32)  # halfway between two e4m3 codes -> the even one (248 -> 256 carries into the exponent)
    specials = np.array([448.0, 449.0, 463.9, 464.0, 1e6, -1e6, np.inf, -np.inf, 0.0, -0.0, 1e-40, 2.0**-9],
                        np.float32)
    x_np = np.concatenate([mags, bf16_ties, fp8_ties, specials])
    x = to_torch(x_np)
    N = x.numel()
    outs = [torch.empty(N, dtype=d, device=x.device) for d in (torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                                              torch.float32)]
    _cast_probe_kernel[(triton.cdiv(N, 1024),)](x, *outs, N, BLOCK=1024)
    ref_fp8 = torch.clamp(x, -448.0, 448.0).to(torch.float8_e4m3fn)  # satfinite == clamp, then RNE
    assert_exact(outs[0], x.to(torch.bfloat16), "float32 -> bf16")
    assert_exact(outs[1], x.to(torch.float16), "float32 -> fp16")
    assert_exact(outs[2], ref_fp8, "float32 -> float8_e4m3fn")
    assert_exact(outs[3], x.to(torch.bfloat16).float() + ref_fp8.float(), "bf16 / fp8 -> float32")


# --------------------------------------------------------------------------------------
# act_and_mul


def _h(M: int, I: int, dtype: str, seed: int) -> torch.Tensor:
    """``h [M, 2*I]`` of N(0, 3^2) values (O(1) outputs, never zeros)."""
    return to_torch(h_problem(M, I, seed), dtype)


class TestActivationTriton(TorchArrays, ActivationCases):
    """``act_and_mul_triton`` against the torch reference on the shared cases of ``op_cases/activation.py``
    (float32, bf16 and fp16 ``h``); ``config=None`` goes through ``moe_torch.silu_and_mul`` /
    ``gelu_tanh_and_mul`` with ``implementation="triton"``."""

    DTYPES = ("float32", "bfloat16", "float16")

    def act_and_mul(self, h, activation, quant=None, group_size=128, out_dtype=None, config=None):
        out_dtype = None if out_dtype is None else TORCH_DTYPES[out_dtype]
        if config is None:
            return getattr(moe_torch, f"{activation}_and_mul")(h, quant=quant, group_size=group_size,
                                                               out_dtype=out_dtype, implementation="triton")
        from moe_torch.ops.activation.triton import act_and_mul_triton

        return act_and_mul_triton(h, activation, quant, group_size, out_dtype or h.dtype, config=config)

    def reference_act_and_mul(self, h_np, dtype, activation, quant=None, group_size=128, out_dtype=None):
        return act_and_mul_reference(to_torch(h_np, dtype), activation, quant, group_size,
                                     TORCH_DTYPES[out_dtype or dtype])

    def quantize(self, a32, quant, group_size):
        if quant == "fp8_per_token":
            return per_token_quant_fp8_reference(a32)
        return per_token_group_quant_fp8_reference(a32, group_size)

    def dequantize(self, q, scale):
        return dequantize_fp8_reference(q, scale)

    def forced_config(self, block_m, block_i):
        return ActAndMulConfig(block_m=block_m, block_n=block_i, single_chunk=False, num_warps=4, num_stages=1)


# --------------------------------------------------------------------------------------
# combine


class TestCombineTriton(TorchArrays, CombineCases):
    """``combine_triton`` against the torch reference on the shared cases of ``op_cases/combine.py``;
    ``config=None`` goes through ``moe_torch.combine(implementation="triton")``."""

    SHAPES = ("T1", "rsf", "two-token-programs", "ep-rank", "partial-blocks", "wide-H-topk8")

    def combine(self, y, src2dst, w, rsf, out_dtype=None, config=None):
        out_dtype = None if out_dtype is None else TORCH_DTYPES[out_dtype]
        if config is None:
            return moe_torch.combine(y, src2dst, w, routed_scaling_factor=rsf, out_dtype=out_dtype, implementation="triton")
        from moe_torch.ops.combine.triton import combine_triton

        return combine_triton(y, src2dst, w, rsf, out_dtype or y.dtype, config=config)

    def reference_combine(self, y_np, dtype, src2dst_np, w_np, rsf, out_dtype=None):
        return combine_reference(to_torch(y_np, dtype), to_torch(src2dst_np), to_torch(w_np), rsf,
                                 TORCH_DTYPES[out_dtype or dtype])

    def forced_config(self, block_t, block_h):
        return CombineConfig(block_t=block_t, block_h=block_h, num_warps=4, num_stages=1)


# --------------------------------------------------------------------------------------
# Dispatch, NotImplementedError, configs


def test_dispatch(monkeypatch):
    """``implementation="triton"`` runs the kernel (its NotImplementedError reaches the caller);
    ``None`` on CPU tensors runs the reference and never touches Triton; on CUDA tensors ``None``
    prefers Triton and falls back to the reference."""
    h = _h(4, 64, "float32", seed=1)
    y, s, w = to_torch(np.ones((4, 8), np.float32)), to_torch(np.array([[0, 1], [2, -1]], np.int32)), \
        to_torch(np.full((2, 2), 0.5, np.float32))
    calls = []

    def refuse(*args):
        calls.append(args)
        raise NotImplementedError("test: triton refused")

    monkeypatch.setattr(act_api, "_triton", refuse)
    monkeypatch.setattr(combine_api, "_triton", refuse)
    with pytest.raises(NotImplementedError, match="test: triton refused"):
        moe_torch.silu_and_mul(h, implementation="triton")
    with pytest.raises(NotImplementedError, match="test: triton refused"):
        moe_torch.combine(y, s, w, implementation="triton")
    calls.clear()
    out, _ = moe_torch.silu_and_mul(h)  # default: reference on CPU, fallback on CUDA
    ref, _ = act_and_mul_reference(h, "silu", None, 128, torch.float32)
    assert_exact(out, ref, "implementation=None")
    assert_exact(moe_torch.combine(y, s, w), combine_reference(y, s, w, 1.0, torch.float32), "implementation=None")
    assert len(calls) == (2 if TORCH_DEVICE == "cuda" else 0)


def test_not_implemented_without_cuda_or_interpreter():
    """A compiled (non-interpreted) kernel refuses CPU tensors with a reason, before any launch."""
    with pytest.raises(NotImplementedError, match="combine: the Triton kernel needs CUDA tensors"):
        check_triton_device("combine", torch.device("cpu"), kernel=object())


def test_bug_fp8_quantization_refused_below_sm90(monkeypatch):
    """Regression: Triton 3.6 lowers the float32 -> float8_e4m3fn cast on sm_89 through float16 rounded
    toward zero, then to e4m3: two roundings (1.0625 + 2^-20 -> 1.0 instead of 1.125), so the permute's and the
    activation's FP8 quantization missed the contract on Ada GPUs. Quantizing kernels now need sm_90 (sm_89 keeps the
    FP8 GEMMs, which only read codes); sm_90 passes."""
    caps = {"cap": (8, 9)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: caps["cap"])
    cuda = torch.device("cuda")
    with pytest.raises(NotImplementedError, match=r"permute: FP8 quantization .* needs sm_90 .* got sm_89"):
        check_triton_device("permute", cuda, kernel=object(), needs_fp8=True, quantizes_fp8=True)
    check_triton_device("grouped_gemm", cuda, kernel=object(), needs_fp8=True)  # reading FP8 codes: sm_89 is fine
    caps["cap"] = (9, 0)
    check_triton_device("permute", cuda, kernel=object(), needs_fp8=True, quantizes_fp8=True)


@pytest.mark.parametrize("M", [1, 7, 100, 65536])
@pytest.mark.parametrize("I,quant,G", [(128, None, 128), (33, None, 128), (14336, None, 128), (768, "fp8_per_token", 128),
                                       (14336, "fp8_per_token", 128), (2048, "fp8_per_token_group", 128),
                                       (8192, "fp8_per_token_group", 8192)])
def test_configs(M, I, quant, G):
    """Heuristics give frozen, keyword-only configs with power-of-2 blocks, tiles of at most 4096
    elements, no more rows / tokens per program than exist, and single_chunk exactly when a
    quantization span fits in one block."""
    c = act_and_mul_config(M, I, quant, G)
    assert isinstance(c, ActAndMulConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_m = 1
    with pytest.raises(TypeError):
        ActAndMulConfig(1, 1, True, 4, 1)  # kw_only
    assert c.block_m & (c.block_m - 1) == 0 and c.block_n & (c.block_n - 1) == 0
    assert c.block_m * c.block_n <= 4096 and c.block_m <= triton.next_power_of_2(M)
    span = {None: c.block_n, "fp8_per_token": I, "fp8_per_token_group": G}[quant]
    assert c.single_chunk == (span <= c.block_n)
    k = combine_config(M, I, 8)
    assert isinstance(k, CombineConfig) and k.block_t * k.block_h <= 4096 and k.block_t <= triton.next_power_of_2(M)


def test_act_and_mul_config_checked():
    """An explicit config that cannot cover the quantization span is refused before launch."""
    from moe_torch.ops.activation.triton import act_and_mul_triton

    h = _h(2, 256, "float32", seed=3)
    bad = ActAndMulConfig(block_m=2, block_n=128, single_chunk=True, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="quantization span"):
        act_and_mul_triton(h, "silu", "fp8_per_token", 128, torch.float32, config=bad)
    two_pass = ActAndMulConfig(block_m=2, block_n=64, single_chunk=False, num_warps=4, num_stages=1)
    q, s = act_and_mul_triton(h, "silu", "fp8_per_token", 128, torch.float32, config=two_pass)  # 4 chunks
    f32, _ = moe_torch.silu_and_mul(h, implementation="triton")
    q_ref, s_ref = per_token_quant_fp8_reference(f32)
    assert_exact(s, s_ref, "scales")
    assert_exact(q, q_ref, "codes")


# --------------------------------------------------------------------------------------
# sm_90 compilation on the CPU (in a child process without the interpreter: tests/sm90.py says why)


def _act_job(quant, I, G):
    cfg = act_and_mul_config(4096, I, quant, G)
    return {
        "module": "moe_torch.ops.activation.triton", "kernel": "_act_and_mul_kernel",
        "signature": {"h_ptr": "*bf16", "out_ptr": "*fp8e4nv" if quant else "*bf16",
                      "scale_ptr": "*fp32" if quant else "*bf16", "M": "i32", "I": "i32",
                      "stride_h": "i32", "stride_out": "i32", "stride_scale": "i32"},
        "constexprs": {"ACTIVATION": 1 if quant == "fp8_per_token_group" else 0, "QUANT": quant is not None,
                       "SPAN": {None: cfg.block_n, "fp8_per_token": I}.get(quant, G),
                       "SINGLE_CHUNK": cfg.single_chunk, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n},
        "options": {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    }


def _combine_job():
    cfg = combine_config(4096, 7168, 8)
    return {
        "module": "moe_torch.ops.combine.triton", "kernel": "_combine_kernel",
        "signature": {"y_ptr": "*bf16", "src2dst_ptr": "*i32", "w_ptr": "*fp32", "out_ptr": "*bf16", "T": "i32",
                      "H": "i32", "rsf": "fp32", "stride_y": "i32", "stride_s": "i32", "stride_w": "i32",
                      "stride_out": "i32"},
        "constexprs": {"TOPK": 8, "APPLY_RSF": True, "BLOCK_T": cfg.block_t, "BLOCK_H": cfg.block_h},
        "options": {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    }


#: name -> job: every code path of both kernels (no quant; single-chunk group quant with GELU;
#: two-pass per-token quant, Mixtral's I = 14336), at production shapes.
SM90_JOBS = {
    "act_and_mul/none": _act_job(None, 4096, 128),
    "act_and_mul/fp8_per_token_group": _act_job("fp8_per_token_group", 2048, 128),
    "act_and_mul/fp8_per_token-two-pass": _act_job("fp8_per_token", 14336, 128),
    "combine": _combine_job(),
    # the layer backward's row weights with the row dots (d_a0 float32 [M, I=2048], a bf16)
    "scale_rows": {
        "module": "moe_torch.ops.combine.triton", "kernel": "_scale_rows_kernel",
        "signature": {"g_ptr": "*fp32", "w_ptr": "*fp32", "a_ptr": "*bf16", "out_ptr": "*bf16", "dots_ptr": "*fp32",
                      "as_ptr": "*bf16", "M": "i32", "N": "i32", "stride_g": "i32", "stride_a": "i32", "stride_o": "i32"},
        "constexprs": {"HAS_DOTS": True, "SCALE_A": True, "N_CHUNKS": 2, "BLOCK_M": 4, "BLOCK_N": 1024},
        "options": {"num_warps": 4, "num_stages": 2},
    },
}


@pytest.fixture(scope="module")
def sm90_ptx() -> dict[str, str]:
    """PTX of every job in SM90_JOBS, compiled for sm_90 in a child process without the interpreter."""
    return compile_sm90(SM90_JOBS)


@pytest.mark.parametrize("name", [n for n in SM90_JOBS if n.startswith("act_and_mul")])
def test_act_and_mul_compiles_for_sm90(sm90_ptx, name):
    """The kernel lowers to sm_90 cubin; the FP8 variants divide with the IEEE ``div.rn.f32`` and
    convert with ``cvt.rn.satfinite.e4m3x2.f32`` (CONTRACT.md section 3)."""
    ptx = sm90_ptx[name]
    assert ".target sm_90" in ptx
    if "fp8" in name:
        assert "div.rn.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx


@pytest.mark.parametrize("name", ["combine", "scale_rows"])
def test_combine_compiles_for_sm90(sm90_ptx, name):
    """The combine kernel and the layer backward's row-weight kernel lower to sm_90 cubin, with 64-bit row offsets
    (``mul.wide`` / s64)."""
    ptx = sm90_ptx[name]
    assert ".target sm_90" in ptx
    assert "mul.wide.s32" in ptx or "mul.lo.s64" in ptx or "mul.wide.u32" in ptx

