"""The named kernels of both frameworks (``kernels.py``), on the CPU with simulated device specs: what each kernel
says of a request on an H100, H200, H20, A100 and B200, what the default order keeps, and the named choices' errors
and results through the public ops (Triton interpreted, JAX interpret mode)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from moe_contract.selection import DeviceSpec
from moe_pallas.ops.grouped_gemm import backend_table
from moe_pallas.ops.grouped_gemm import kernels as jax_kernels
from moe_torch.ops.grouped_gemm import kernels as torch_kernels
from moe_torch.ops.grouped_gemm.api import grouped_gemm, grouped_gemm_dgrad, grouped_gemm_wgrad

H100 = DeviceSpec(kind="NVIDIA H100 80GB HBM3", capability=(9, 0), sm_count=132, smem_per_block=232448)
H200 = DeviceSpec(kind="NVIDIA H200", capability=(9, 0), sm_count=132, smem_per_block=232448)
H20 = DeviceSpec(kind="NVIDIA H20", capability=(9, 0), sm_count=78, smem_per_block=232448)
A100 = DeviceSpec(kind="NVIDIA A100-SXM4-80GB", capability=(8, 0), sm_count=108, smem_per_block=166912)
B200 = DeviceSpec(kind="NVIDIA B200", capability=(10, 0), sm_count=148, smem_per_block=232448)
HOPPER, OTHERS = (H100, H200, H20), (A100, B200)


def _request(dtype=torch.bfloat16, E=4, M=64, N=64, K=128):
    x = torch.zeros(M, K, dtype=dtype)
    w = torch.zeros(E, N, K, dtype=dtype)
    offs = torch.linspace(0, M, E + 1).to(torch.int32)
    return torch_kernels.GemmRequest(x, w, offs, None, None, dtype)


@pytest.mark.parametrize("spec", HOPPER + OTHERS, ids=lambda s: s.kind)
def test_torch_kernels_by_architecture(spec):
    """The Hopper-only kernels name the architecture off sm_90; the portable pointer kernel serves every GPU;
    ``triton_tma`` serves sm_90 and newer (B200 too)."""
    r = _request()
    reasons = {name: choice.supported_on(spec, r) for name, choice in torch_kernels.KERNELS.choices.items()}
    assert reasons["triton_pointer"] is None
    for name in ("gluon_fp8_block", "gluon_fp8_rowwise", "gluon_bf16"):
        if spec.is_hopper:
            assert reasons[name] is None or spec.arch not in reasons[name], (name, reasons[name])
        else:
            assert f"got {spec.arch}" in reasons[name], (name, reasons[name])
    assert (reasons["triton_tma"] is None) == (spec.capability >= (9, 0)) or "aligned" in (reasons["triton_tma"] or "")
    # the FP8 kernels refuse a 16-bit request by its scales, on every GPU that could run them
    if spec.is_hopper:
        assert "FP8" in reasons["gluon_fp8_block"] and "FP8" in reasons["gluon_fp8_rowwise"]


def test_torch_fp8_pointer_needs_sm89():
    r = _request(dtype=torch.float8_e4m3fn)
    ampere = DeviceSpec(kind="NVIDIA A10", capability=(8, 6), sm_count=72, smem_per_block=101376)
    assert "8.9 or newer" in torch_kernels.KERNELS.choices["triton_pointer"].supported_on(ampere, r)
    assert torch_kernels.KERNELS.choices["triton_pointer"].supported_on(H100, r) is None


def test_named_torch_kernels_through_the_op():
    """``implementation=<name>``: the portable kernel runs (interpreted) and equals the reference; a kernel this
    device cannot run raises NotImplementedError naming why, before any launch; an unknown name is a ValueError;
    a named forward's backward runs on the Triton family; the backward ops take their own names."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 64, generator=g, requires_grad=True)
    w = torch.randn(3, 48, 64, generator=g)
    offs = torch.tensor([0, 0, 20, 33], dtype=torch.int32)  # an empty expert
    ref = grouped_gemm(x, w, offs, implementation="reference")
    y = grouped_gemm(x, w, offs, implementation="triton_pointer")
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    y.sum().backward()  # runs grouped_gemm_dgrad on "triton"
    torch.testing.assert_close(x.grad, grouped_gemm_dgrad(torch.ones(33, 48), w, offs, implementation="reference"),
                               rtol=1e-5, atol=1e-4)
    for name in ("gluon_bf16", "gluon_fp8_block", "gluon_fp8_rowwise", "triton_tma"):
        with pytest.raises(NotImplementedError, match=f"kernel '{name}' cannot serve this request"):
            grouped_gemm(x.detach(), w, offs, implementation=name)
    with pytest.raises(ValueError, match="implementation must be one of"):
        grouped_gemm(x.detach(), w, offs, implementation="cublas")
    d_y = torch.randn(33, 48, generator=g)
    torch.testing.assert_close(grouped_gemm_wgrad(x.detach(), d_y, offs, implementation="triton_pointer"),
                               grouped_gemm_wgrad(x.detach(), d_y, offs, implementation="reference"),
                               rtol=1e-5, atol=1e-4)
    with pytest.raises(NotImplementedError, match="'gluon_bf16' cannot serve"):
        grouped_gemm_dgrad(d_y, w, offs, implementation="gluon_bf16")
    with pytest.raises(ValueError, match="implementation must be one of"):
        grouped_gemm_dgrad(d_y, w, offs, implementation="gluon_fp8_block")


def test_torch_explain_names_the_default():
    reasons = torch_kernels.explain(_request())
    assert reasons["default"] == "triton_pointer"  # CPU tensors: the interpreted portable kernel
    assert set(reasons) == {*torch_kernels.NAMES, "default"}


@pytest.mark.parametrize("spec", HOPPER + OTHERS, ids=lambda s: s.kind)
@pytest.mark.parametrize("layout", ["bf16", "fp8_block", "fp8_per_token"])
def test_jax_default_order_by_architecture(spec, layout, caplog):
    """Mosaic GPU is tried only on sm_90 (every Hopper, whatever its name, reads the sm90 table: Mosaic first for
    these shapes, but for the H100's bf16, where its own table puts the tuned Pallas-Triton first); elsewhere
    Pallas-Triton then the reference, with the reason logged."""
    order = backend_table.gpu_order("grouped_gemm", layout, 16384, 4096, 7168, spec)
    with caplog.at_level(logging.INFO, logger="moe_pallas"):
        jax_kernels._log_once.cache_clear()
        kept = jax_kernels.runnable("grouped_gemm", order, spec, layout)
    if spec.is_hopper:
        first = "pallas_triton" if (spec.kind, layout) == (H100.kind, "bf16") else "pallas_mosaic_gpu"
        assert kept == order and kept[0] == first
    elif "fp8" in layout and spec.capability < (8, 9):
        assert kept == ("reference",)  # no FP8 tensor cores: the reference serves, with both reasons logged
        assert caplog.text.count(f"got {spec.arch}") == 2
    else:
        assert kept == ("pallas_triton", "reference")
        assert f"got {spec.arch}" in caplog.text


def test_jax_pallas_triton_fp8_needs_sm89():
    ampere = DeviceSpec(kind="NVIDIA A10", capability=(8, 6), sm_count=72, smem_per_block=101376)
    assert jax_kernels.runnable("grouped_gemm", ("pallas_mosaic_gpu", "pallas_triton", "reference"), ampere,
                                "fp8_block") == ("reference",)
    assert jax_kernels.runnable("grouped_gemm", ("pallas_triton", "reference"), ampere, "bf16") == (
        "pallas_triton", "reference")


def test_the_same_choices_on_every_hopper():
    """The point of keying by architecture: an H20 (no table of its own) gets the H200's tuned choices (torch configs,
    the Gluon-or-Triton choice, JAX backend order), an H100 its own refinements first (``tuned/sm90/<kind>.json``)
    and the architecture's where they hold no entry; an A100 gets none."""
    import json
    import os

    from moe_torch.ops.grouped_gemm import config as tc

    own = os.path.join(os.path.dirname(tc.__file__), "tuned", "sm90", "NVIDIA_H100_80GB_HBM3.json")
    entry = next(e for e in json.load(open(own)) if (e["N"], e["K"], e["dtype"], e["M_cap"]) == (4096, 7168, "bf16",
                                                                                                  16384))
    assert tc.grouped_gemm_config(16384, 4096, 7168, 32, 16, device=H100) == tc.GroupedGemmConfig(**entry["config"])
    assert tc.grouped_gemm_config(2048, 1024, 512, 32, 16, device=H100) == tc.grouped_gemm_config(
        2048, 1024, 512, 32, 16, device=H200)  # no H100 entry of this shape: the architecture's answer
    for spec in (H20,):
        assert tc.grouped_gemm_config(16384, 4096, 7168, 32, 16, device=spec) == tc.grouped_gemm_config(
            16384, 4096, 7168, 32, 16, device=H200)
        assert tc.tuned_forward_kernel(spec, 16384, 7168, 2048, 16) == tc.tuned_forward_kernel(H200, 16384, 7168, 2048,
                                                                                               16)
        assert backend_table.gpu_order("grouped_gemm", "fp8_block", 16384, 4096, 7168, spec) == backend_table.gpu_order(
            "grouped_gemm", "fp8_block", 16384, 4096, 7168, H200)
    assert tc.grouped_gemm_config(16384, 4096, 7168, 32, 16, device=H200).tma
    assert tc.grouped_gemm_config(16384, 4096, 7168, 32, 16, device=A100) == tc.heuristic_grouped_gemm_config(
        16384, 4096, 7168, 32, 16)
    assert np.all([tc.tuned_forward_kernel(A100, 16384, 7168, 2048, 16) is None])


def test_jax_named_mosaic_on_a_gpu_without_it(monkeypatch):
    """``implementation="pallas_mosaic_gpu"`` on a (simulated) A100 raises NotImplementedError naming the GPU and
    why, before anything is traced; the portable kernels still take the request."""
    import jax.numpy as jnp

    import moe_pallas
    from moe_pallas.ops.grouped_gemm import api as jax_api

    monkeypatch.setattr(jax_api, "gpu_device_spec", lambda: A100)
    x, w = jnp.ones((8, 64), jnp.bfloat16), jnp.ones((2, 32, 64), jnp.bfloat16)
    offs = jnp.array([0, 4, 8], jnp.int32)
    with pytest.raises(NotImplementedError, match=r"'pallas_mosaic_gpu' cannot serve this request on NVIDIA A100.*sm80"):
        moe_pallas.grouped_gemm(x, w, offs, implementation="pallas_mosaic_gpu")
    assert float(moe_pallas.grouped_gemm(x, w, offs, implementation="reference")[0, 0]) == 64.0


def test_torch_hopper_heuristic_without_a_table(monkeypatch, tmp_path):
    """No table at all for an sm_90 GPU: large 16-bit / FP8 forwards get the wide TMA tiles every tuned sm90 entry
    of that size has; a bias, few rows per expert, small M and other architectures keep the portable heuristic."""
    from moe_torch.ops.grouped_gemm import config as tc

    monkeypatch.setattr(tc, "TUNED_DIR", str(tmp_path))
    tc.tuned_tables.cache_clear()
    try:
        wide = tc.grouped_gemm_config(16384, 4096, 7168, 32, 16, device=H20)
        assert (wide.block_m, wide.block_n, wide.num_warps, wide.tma) == (128, 256, 8, True)
        fp8 = tc.grouped_gemm_config(16384, 4096, 7168, 32, 8, 128, True, device=H100)
        assert (fp8.block_m, fp8.block_k, fp8.tma, fp8.persistent) == (128, 128, True, True)
        heur = tc.heuristic_grouped_gemm_config
        assert tc.grouped_gemm_config(16384, 4096, 7168, 32, 16, device=H100, bias=True) == heur(16384, 4096, 7168, 32, 16)
        assert tc.grouped_gemm_config(16384, 4096, 7168, 256, 16, device=H100) == heur(16384, 4096, 7168, 256, 16)
        assert tc.grouped_gemm_config(2048, 4096, 7168, 8, 16, device=H100) == heur(2048, 4096, 7168, 8, 16)
        assert tc.grouped_gemm_config(16384, 4096, 7168, 32, 16, device=A100) == heur(16384, 4096, 7168, 32, 16)
    finally:
        tc.tuned_tables.cache_clear()


def test_torch_layer_takes_a_gemm_kernel_name():
    """``moe_forward(..., implementation=<kernel>)``, as ``moe_pallas``' layer takes ``"pallas_mosaic_gpu"``: the
    forward GEMMs run on that kernel (``triton_pointer`` interpreted here: the reference's result within float32, and a
    gradient through the default backward), a kernel this device cannot run raises NotImplementedError naming it
    before any launch, an unknown name is a ValueError."""
    import moe_torch
    from moe_contract import MoEConfig, make_layer_inputs

    config = MoEConfig(num_experts=4, topk=2, hidden_size=32, intermediate_size=16)
    inp = make_layer_inputs(config, 5, seed=1)
    x = torch.from_numpy(inp.x).requires_grad_(True)
    logits, w13, w2 = (torch.from_numpy(a) for a in (inp.router_logits, inp.w13, inp.w2))
    y = moe_torch.moe_forward(x, logits, w13, w2, config, implementation="triton_pointer")
    torch.testing.assert_close(y, moe_torch.moe_forward(x, logits, w13, w2, config, implementation="reference"),
                               rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    with pytest.raises(NotImplementedError, match="kernel 'gluon_bf16' cannot serve this request"):
        moe_torch.moe_forward(x.detach(), logits, w13, w2, config, implementation="gluon_bf16")
    with pytest.raises(ValueError, match="implementation"):
        moe_torch.moe_forward(x.detach(), logits, w13, w2, config, implementation="cublas")
