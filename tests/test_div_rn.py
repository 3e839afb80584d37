"""The FP8 division of the Pallas-Triton permute and activation kernels (``moe_pallas/ops/quant/pallas_triton.py``):
the ``EPMOE_PALLAS_DIV_RN`` switch, PTX ``div.rn.f32`` in the CUDA lowering when it is on (never in interpret mode),
and, on the GPU, FP8 codes bit-identical to the reference's with it on.

The switch is read when a kernel is lowered and jit caches lowered kernels: each test that sets it clears jax's
caches first (``jax.clear_caches()``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from common import DEVICE
from moe_pallas.ops.activation.pallas_triton import act_and_mul_pallas_triton
from moe_pallas.ops.common import DIV_RN_ENV, div_rn_enabled
from moe_pallas.ops.permute.pallas_triton import permute_pallas_triton
from moe_pallas.ops.quant.pallas_triton import kernel_div_rn
from moe_pallas.ops.quant.reference import (per_token_group_quant_fp8_reference, per_token_quant_fp8_reference,
                                            quantize_div_fp8)
from tolerances import assert_exact

ON_GPU = DEVICE == "gpu"
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "cuda"))


@pytest.mark.parametrize("raw, on", [(None, True), ("0", False), ("1", True)])  # every spelling: test_env_switches
def test_kernels_follow_the_switch(monkeypatch, raw, on):
    if raw is None:
        monkeypatch.delenv(DIV_RN_ENV, raising=False)
    else:
        monkeypatch.setenv(DIV_RN_ENV, raw)
    assert div_rn_enabled() is on
    assert kernel_div_rn(interpret=False) is on
    assert kernel_div_rn(interpret=True) is False  # inline PTX has no interpret-mode rule


def test_bug_div_rn_never_below_sm90(monkeypatch):
    """Regression: on sm_89 Triton casts float32 to e4m3 through float16 rounded toward zero (two roundings),
    so the ``div.rn.f32`` path would miss the contract's codes there: the switch is ignored below sm_90 (the
    repaired division's exact code arithmetic does not take that cast); with no GPU attached (lowering for CUDA on a
    CPU) the target is Hopper."""
    from moe_pallas.ops.quant import pallas_triton as qpt

    class Dev:
        def __init__(self, cc):
            self.compute_capability = cc

    monkeypatch.setenv(DIV_RN_ENV, "1")
    for cc, below in (("8.9", True), ("9.0", False), ("10.0", False), ("8.0", True)):
        monkeypatch.setattr(qpt.jax, "devices", lambda backend=None, cc=cc: [Dev(cc)])
        assert qpt._gpu_below_sm90() is below
        assert kernel_div_rn(interpret=False) is (not below)

    def no_gpu(backend=None):
        raise RuntimeError("no gpu")

    monkeypatch.setattr(qpt.jax, "devices", no_gpu)
    assert kernel_div_rn(interpret=False) is True


def _lowered(f, *args) -> str:
    jax.clear_caches()
    with use_abstract_mesh(H200):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("quant", ["fp8_per_token", "fp8_per_token_group"])
def test_kernels_lower_div_rn_only_when_switched_on(monkeypatch, quant):
    """Both kernels' CUDA lowering carries ``div.rn.f32`` with the switch on and not without it."""
    h = jax.ShapeDtypeStruct((37, 2 * 384), jnp.bfloat16)
    act = functools.partial(act_and_mul_pallas_triton, activation="silu", quant=quant, group_size=128, interpret=False)
    x = jax.ShapeDtypeStruct((13, 384), jnp.bfloat16)
    d2s = jax.ShapeDtypeStruct((13 * 2,), jnp.int32)
    perm = functools.partial(permute_pallas_triton, topk=2, quant=quant, group_size=128, interpret=False)
    for on in (False, True):
        monkeypatch.setenv(DIV_RN_ENV, "1" if on else "0")
        assert ("div.rn.f32" in _lowered(act, h)) is on
        assert ("div.rn.f32" in _lowered(perm, x, d2s)) is on
    jax.clear_caches()


@pytest.mark.skipif(not ON_GPU, reason="inline PTX runs on a GPU only")
@pytest.mark.parametrize("quant", ["fp8_per_token", "fp8_per_token_group"])
def test_div_rn_codes_match_the_reference_bit_for_bit(monkeypatch, quant):
    """With the switch on, the activation's and the permute's FP8 codes and scales equal the reference quantization
    of the same float32 values (the repaired division's codes), for random rows over many magnitudes."""
    monkeypatch.setenv(DIV_RN_ENV, "1")
    jax.clear_caches()
    try:
        _check_codes(quant)
    finally:
        jax.clear_caches()


def _edge_rows(rng, rows: int, cols: int) -> np.ndarray:
    """Random rows over many magnitudes, with hand-placed values: signed zeros, bf16 subnormals, values a quotient
    lands on or next to an FP8 midpoint once the row's amax sets the scale (448 / amax), and one row of one value."""
    a = rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-6, 6, (rows, 1)))
    a[0, :4] = [0.0, -0.0, 1e-40, -1e-39]
    a[1, :] = 448.0 * (1.0625 + np.arange(cols) * 2.0**-12) / 1.5  # quotients through a midpoint region
    a[1, 0] = 448.0
    a[2, :] = 3.0
    return a


def _check_codes(quant: str) -> None:
    rng = np.random.default_rng(11)
    M, I, T, topk, H = 300, 512, 150, 2, 640
    h = jnp.asarray(_edge_rows(rng, M, 2 * I), jnp.bfloat16)
    q, s = act_and_mul_pallas_triton(h, activation="silu", quant=quant, group_size=128)
    a32, _ = act_and_mul_pallas_triton(h, activation="silu", out_dtype=jnp.float32)
    ref = (per_token_quant_fp8_reference(a32) if quant == "fp8_per_token"
           else per_token_group_quant_fp8_reference(a32, 128))
    assert_exact(q, ref[0], f"act_and_mul {quant} codes with div.rn.f32")
    assert_exact(s, ref[1], f"act_and_mul {quant} scales with div.rn.f32")
    x = jnp.asarray(_edge_rows(rng, T, H), jnp.bfloat16)
    dst2src = jnp.asarray(rng.permutation(T * topk), jnp.int32)
    qp, sp = permute_pallas_triton(x, dst2src, topk=topk, quant=quant, group_size=128)
    rows = x[np.asarray(dst2src) // topk].astype(jnp.float32)
    ref = (per_token_quant_fp8_reference(rows) if quant == "fp8_per_token"
           else per_token_group_quant_fp8_reference(rows, 128))
    assert_exact(qp, ref[0], f"permute {quant} codes with div.rn.f32")
    assert_exact(sp, ref[1], f"permute {quant} scales with div.rn.f32")
    static = jnp.float32(0.37)  # the per-tensor (static scale) permute
    qs, _ = permute_pallas_triton(x, dst2src, topk=topk, quant="fp8_per_tensor", scale=static)
    assert_exact(qs, quantize_div_fp8(rows, static), "permute fp8_per_tensor codes with div.rn.f32")
