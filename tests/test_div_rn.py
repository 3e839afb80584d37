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
from moe_pallas.ops.quant.reference import per_token_group_quant_fp8_reference, per_token_quant_fp8_reference
from tolerances import assert_exact

ON_GPU = DEVICE == "gpu"
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "cuda"))


@pytest.mark.parametrize("raw, on", [(None, False), ("", False), ("0", False), ("off", False), (" No ", False),
                                     ("1", True), ("true", True), (" ON ", True), ("yes", True)])
def test_switch_values(monkeypatch, raw, on):
    if raw is None:
        monkeypatch.delenv(DIV_RN_ENV, raising=False)
    else:
        monkeypatch.setenv(DIV_RN_ENV, raw)
    assert div_rn_enabled() is on
    assert kernel_div_rn(interpret=False) is on
    assert kernel_div_rn(interpret=True) is False  # inline PTX has no interpret-mode rule


def test_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv(DIV_RN_ENV, "2")
    with pytest.raises(ValueError, match=f"{DIV_RN_ENV}.*got {DIV_RN_ENV}='2'"):
        div_rn_enabled()


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
    rng = np.random.default_rng(11)
    M, I, T, topk, H = 300, 512, 150, 2, 640
    h = jnp.asarray(rng.standard_normal((M, 2 * I)) * np.exp(rng.uniform(-6, 6, (M, 1))), jnp.bfloat16)
    q, s = act_and_mul_pallas_triton(h, activation="silu", quant=quant, group_size=128)
    a32, _ = act_and_mul_pallas_triton(h, activation="silu", out_dtype=jnp.float32)
    ref = (per_token_quant_fp8_reference(a32) if quant == "fp8_per_token"
           else per_token_group_quant_fp8_reference(a32, 128))
    assert_exact(q, ref[0], f"act_and_mul {quant} codes with div.rn.f32")
    assert_exact(s, ref[1], f"act_and_mul {quant} scales with div.rn.f32")
    x = jnp.asarray(rng.standard_normal((T, H)) * np.exp(rng.uniform(-6, 6, (T, 1))), jnp.bfloat16)
    dst2src = jnp.asarray(rng.permutation(T * topk), jnp.int32)
    qp, sp = permute_pallas_triton(x, dst2src, topk=topk, quant=quant, group_size=128)
    rows = x[np.asarray(dst2src) // topk].astype(jnp.float32)
    ref = (per_token_quant_fp8_reference(rows) if quant == "fp8_per_token"
           else per_token_group_quant_fp8_reference(rows, 128))
    assert_exact(qp, ref[0], f"permute {quant} codes with div.rn.f32")
    assert_exact(sp, ref[1], f"permute {quant} scales with div.rn.f32")
    jax.clear_caches()
