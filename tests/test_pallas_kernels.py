"""Pallas-Triton kernels (``moe_pallas/ops/*/pallas_triton.py``) against the jnp references.

On the CPU the kernels run in Pallas interpret mode, which fills every output with NaN before
the kernel runs (``pallas.primitives.uninitialized_value``): an element a kernel forgets to
write shows up as NaN (or an FP8 NaN code) and fails the finiteness / exactness checks below.
The act_and_mul and combine kernels run the shared cases of ``op_cases/activation.py`` and
``op_cases/combine.py`` (``TestActivationPallasTriton``, ``TestCombinePallasTriton``).
The second half lowers each kernel for CUDA on an abstract H200, which runs the whole Pallas -> Triton-IR
lowering without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

import moe_pallas
from common import JNP_DTYPES, to_jax
from moe_pallas.ops.activation.config import MAX_ROW_BLOCK, ActAndMulConfig, act_and_mul_config
from moe_pallas.ops.activation.pallas_triton import act_and_mul_pallas_triton
from moe_pallas.ops.quant.reference import fp8_round_quotient
from moe_pallas.ops.activation.reference import act_and_mul_reference
from moe_pallas.ops.combine.config import CombineConfig, combine_config
from moe_pallas.ops.combine.pallas_triton import combine_pallas_triton
from moe_pallas.ops.combine.reference import combine_reference
from moe_pallas.ops.quant.reference import (
    FP8_DTYPE,
    dequantize_fp8_reference,
    per_token_group_quant_fp8_reference,
    per_token_quant_fp8_reference,
    quantize_div_fp8,
)
from op_cases import JaxArrays
from op_cases.activation import ACT_FP8_CASES, ActivationCases, h_problem
from op_cases.combine import CombineCases, combine_problem
from tolerances import BF16_REL_FRO, F32_REL_FRO, assert_exact, assert_rel_fro, to_numpy


def _h(M: int, I: int, dtype, seed: int) -> jax.Array:
    """``h [M, 2*I]``: N(0, 3^2) values (never zeros; silu/gelu are non-trivial there)."""
    return jnp.asarray(h_problem(M, I, seed)).astype(dtype)


# --------------------------------------------------------------------------------------
# act_and_mul: plain cast, and fused with FP8 quantization (codes and scales bit-identical to the reference
# applied to the kernel's own float32 activation; and close to the reference's fused output)


class TestActivationPallasTriton(JaxArrays, ActivationCases):
    """``act_and_mul_pallas_triton`` against the jnp reference on the shared cases of ``op_cases/activation.py``;
    ``config=None`` goes through ``moe_pallas.silu_and_mul`` / ``gelu_tanh_and_mul`` with
    ``implementation="pallas_triton"``."""

    FP8_CASES = ("token-M1", "token-odd-I", "token-ragged-M", "token-two-pass-64", "token-two-pass-16",
                 "group-M1-f32", "group-ragged-M-f32", "group-32")

    def act_and_mul(self, h, activation, quant=None, group_size=128, out_dtype=None, config=None):
        out_dtype = None if out_dtype is None else JNP_DTYPES[out_dtype]
        if config is None:
            return getattr(moe_pallas, f"{activation}_and_mul")(h, quant=quant, group_size=group_size,
                                                                out_dtype=out_dtype, implementation="pallas_triton")
        return act_and_mul_pallas_triton(h, activation=activation, quant=quant, group_size=group_size,
                                         out_dtype=out_dtype, config=config)

    def reference_act_and_mul(self, h_np, dtype, activation, quant=None, group_size=128, out_dtype=None):
        return act_and_mul_reference(to_jax(h_np, dtype), activation, quant, group_size, JNP_DTYPES[out_dtype or dtype])

    def quantize(self, a32, quant, group_size):
        if quant == "fp8_per_token":
            return per_token_quant_fp8_reference(a32)
        return per_token_group_quant_fp8_reference(a32, group_size)

    def dequantize(self, q, scale):
        return dequantize_fp8_reference(q, scale)

    def forced_config(self, block_m, block_i):
        return ActAndMulConfig(block_m=block_m, block_i=block_i, two_pass=True)


def test_act_and_mul_config_two_pass_for_wide_rows():
    """Per-token rows wider than MAX_ROW_BLOCK take two passes; narrower ones (the shared FP8 cases without
    forced blocks among them) one."""
    cfg = act_and_mul_config(4, 2 * MAX_ROW_BLOCK + 1, "fp8_per_token", 128)
    assert cfg.two_pass and cfg.block_i < 2 * MAX_ROW_BLOCK + 1
    assert not act_and_mul_config(4, MAX_ROW_BLOCK, "fp8_per_token", 128).two_pass
    for name in TestActivationPallasTriton.FP8_CASES:
        quant, G, M, I, _, blocks = ACT_FP8_CASES[name]
        if quant == "fp8_per_token" and blocks is None:
            assert not act_and_mul_config(M, I, quant, G).two_pass, name


@pytest.mark.parametrize("scale", [0.125, 3.0 / 448.0, 0.7316])  # exact ties (a power of two), an amax-like and a random scale
def test_round_quotient_repairs_approximate_division(scale):
    """The in-kernel rounding, given a quotient off by up to 2 ulps (as ``div.full.f32`` may be on
    the GPU), returns the code of the correctly rounded quotient, at and around every rounding midpoint.
    On the CPU the kernels divide exactly, so this is where the repair itself is tested."""
    rng = np.random.default_rng(0)
    codes = np.arange(0, 127, dtype=np.uint8).view(np.dtype(jnp.float8_e4m3fn)).astype(np.float32)  # 0 .. 448
    mids = (codes[:-1] + codes[1:]) / 2  # exact in float32: the rounding boundaries
    scale = np.float32(scale)
    targets = np.concatenate([mids, codes, rng.uniform(0, 460, 2000).astype(np.float32)])
    x = (targets.astype(np.float64) * np.float64(scale)).astype(np.float32)
    bits = x.view(np.uint32).astype(np.int64)
    x = np.concatenate([(bits + d).clip(0).astype(np.uint32).view(np.float32) for d in range(-3, 4)])  # neighbours
    x = np.concatenate([x, -x])
    x, s = jnp.asarray(x), jnp.asarray(scale)
    exact = quantize_div_fp8(x, s)  # on the CPU `/` is correctly rounded
    y_bits = np.asarray(jnp.abs(x) / s).view(np.uint32).astype(np.int64)
    naive_wrong = 0
    for d in (-2, -1, 0, 1, 2):  # a float32 quotient of non-negative operands stays >= 0
        y_off = jnp.asarray((y_bits + d).clip(0).astype(np.uint32).view(np.float32))
        assert_exact(fp8_round_quotient(x, y_off, s), exact, f"quotient off by {d} ulp")
        naive = jnp.clip(y_off, 0, 448).astype(FP8_DTYPE)
        naive_wrong += int((to_numpy(naive).view(np.uint8) != (to_numpy(exact).view(np.uint8) & 0x7F)).sum())
    assert naive_wrong > 0, "the inputs must include quotients whose naive rounding is wrong"


def test_act_and_mul_group_size_not_power_of_two():
    h = _h(4, 192, jnp.float32, seed=1)
    with pytest.raises(NotImplementedError, match="power of two"):
        act_and_mul_pallas_triton(h, quant="fp8_per_token_group", group_size=96)
    with pytest.raises(NotImplementedError, match="power of two"):
        moe_pallas.silu_and_mul(h, quant="fp8_per_token_group", group_size=96, implementation="pallas_triton")


# --------------------------------------------------------------------------------------
# combine


class TestCombinePallasTriton(JaxArrays, CombineCases):
    """``combine_pallas_triton`` against the jnp reference on the shared cases of ``op_cases/combine.py``;
    ``config=None`` goes through ``moe_pallas.combine(implementation="pallas_triton")``."""

    SHAPES = ("T1-odd-H", "rsf", "ep-rank-H64", "partial-blocks", "wide-H")

    def combine(self, y, src2dst, w, rsf, out_dtype=None, config=None):
        out_dtype = None if out_dtype is None else JNP_DTYPES[out_dtype]
        if config is None:
            return moe_pallas.combine(y, src2dst, w, routed_scaling_factor=rsf, out_dtype=out_dtype,
                                      implementation="pallas_triton")
        return combine_pallas_triton(y, src2dst, w, routed_scaling_factor=rsf, out_dtype=out_dtype, config=config)

    def reference_combine(self, y_np, dtype, src2dst_np, w_np, rsf, out_dtype=None):
        return combine_reference(to_jax(y_np, dtype), to_jax(src2dst_np), to_jax(w_np), rsf,
                                 JNP_DTYPES[out_dtype or dtype])

    def forced_config(self, block_t, block_h):
        return CombineConfig(block_t=block_t, block_h=block_h)


# --------------------------------------------------------------------------------------
# The public ops with implementation="pallas_triton" (through moe_pallas.ops.dispatch)


def test_dispatch_pallas_triton():
    h = _h(9, 256, jnp.bfloat16, seed=11)
    for quant in (None, "fp8_per_token", "fp8_per_token_group"):
        got = moe_pallas.gelu_tanh_and_mul(h, quant=quant, implementation="pallas_triton")
        want = act_and_mul_pallas_triton(h, activation="gelu_tanh", quant=quant)
        ref = moe_pallas.gelu_tanh_and_mul(h, quant=quant, implementation="reference")
        for g, k in zip(got, want):
            if k is not None:
                assert_exact(g, k, f"dispatch {quant}")
        if quant is None:
            assert_rel_fro(got[0], ref[0], BF16_REL_FRO, "dispatch vs reference")
    # implementation=None on the CPU stays the reference, bit for bit
    for g, r in zip(moe_pallas.silu_and_mul(h, quant="fp8_per_token"),
                    act_and_mul_reference(h, "silu", "fp8_per_token", 128, None)):
        assert_exact(g, r, "default implementation on the CPU")

    y, src2dst, w, _ = combine_problem(16, 4, 16, 8, 4, 64, seed=5, nan_weights=False)
    y, src2dst, w = to_jax(y, "bfloat16"), to_jax(src2dst), to_jax(w)
    got = moe_pallas.combine(y, src2dst, w, routed_scaling_factor=2.5, out_dtype=jnp.float32, implementation="pallas_triton")
    assert_exact(got, combine_pallas_triton(y, src2dst, w, routed_scaling_factor=2.5, out_dtype=jnp.float32), "combine dispatch")
    assert_rel_fro(got, combine_reference(y, src2dst, w, 2.5, jnp.float32), F32_REL_FRO, "combine dispatch vs reference")
    assert_exact(moe_pallas.combine(y, src2dst, w), combine_reference(y, src2dst, w, 1.0, jnp.bfloat16), "combine default on CPU")


# --------------------------------------------------------------------------------------
# GPU lowering on the CPU: the kernels must lower for CUDA (Triton), not only interpret.

H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "cuda"))
TRITON_CALL = "__gpu$xla.gpu.triton"


def _lower_for_cuda(f, *args) -> str:
    with use_abstract_mesh(H200):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("activation,quant,group_size,config,kernels", [
    ("silu", None, 128, None, 1),
    ("gelu_tanh", "fp8_per_token", 128, None, 1),
    ("silu", "fp8_per_token", 128, ActAndMulConfig(block_m=4, block_i=128, two_pass=True), 2),
    ("gelu_tanh", "fp8_per_token_group", 128, None, 1),
])
def test_act_and_mul_lowers_for_cuda(activation, quant, group_size, config, kernels):
    h = jax.ShapeDtypeStruct((37, 2 * 384), jnp.bfloat16)
    f = functools.partial(act_and_mul_pallas_triton, activation=activation, quant=quant, group_size=group_size,
                          config=config, interpret=False)
    text = _lower_for_cuda(f, h)
    assert text.count(TRITON_CALL) == kernels, text[:2000]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_combine_lowers_for_cuda(dtype):
    T, topk, H = 13, 6, 7168
    args = (jax.ShapeDtypeStruct((T * topk, H), dtype), jax.ShapeDtypeStruct((T, topk), jnp.int32),
            jax.ShapeDtypeStruct((T, topk), jnp.float32))
    f = functools.partial(combine_pallas_triton, routed_scaling_factor=2.5, interpret=False)
    text = _lower_for_cuda(f, *args)
    assert text.count(TRITON_CALL) == 1, text[:2000]
    assert combine_config(T, H, topk).block_h == 1024
