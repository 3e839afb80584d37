"""The Triton ``routing_metadata`` and ``permute`` kernels against the torch references (CONTRACT.md sections 2-3, 7).

Kernels: ``moe_torch/ops/permute/triton.py``, on the shared cases of ``op_cases/permute.py``
(``TestRoutingMetadataTriton``, ``TestPermuteTriton``), called through the public API with
``implementation="triton"`` (so the dispatch path is exercised too), and directly with forced
configs (small blocks, so that the cross-block scan and the two-pass quantization run on small
inputs). The metadata must be exactly the reference's, including the stable order within an
expert; permuted rows, FP8 codes and scales bit-identical.

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
``conftest.py``), with the exact float casts that ``moe_torch`` installs there
(``moe_torch/ops/triton_interpret.py``: the interpreter's own float32 -> fp8 cast rounds wrongly).
On the GPU machine (``EPMOE_TEST_DEVICE=gpu``) the same tests run compiled. ``test_*_compiles_for_sm90``
lowers the kernels to sm_90 cubin in a child process without the interpreter (no GPU needed).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import triton

import moe_torch
from common import TORCH_DEVICE, random_ids, to_torch
from moe_torch.ops.permute import api as permute_api
from moe_torch.ops.permute.config import PermuteConfig, RoutingConfig, permute_config, routing_config
from moe_torch.ops.permute.reference import permute_reference, routing_metadata_reference
from op_cases import TorchArrays
from op_cases.permute import (
    PermuteKernelCases,
    RoutingMetadataKernelCases,
    assert_metadata_equal,
    assert_permute_equal,
    permute_problem,
)
from sm90 import compile_sm90


class TestRoutingMetadataTriton(TorchArrays, RoutingMetadataKernelCases):
    """``routing_metadata_triton`` against the torch reference, with int32, int64 and strided ids;
    ``config=None`` goes through ``moe_torch.routing_metadata(implementation="triton")`` (the dispatch path and
    the heuristic config)."""

    ID_VARIANTS = ("int32", "int64", "strided")

    def routing_metadata(self, ids, E, start, e_local, config=None, check_ids=False):
        if config is None:
            return moe_torch.routing_metadata(ids, E, expert_start=start, num_local_experts=e_local,
                                              check_ids=check_ids, implementation="triton")
        from moe_torch.ops.permute.triton import routing_metadata_triton

        return routing_metadata_triton(ids, start, e_local, config=config)

    def reference_routing_metadata(self, ids_np, E, start, e_local):
        return routing_metadata_reference(to_torch(ids_np), start, e_local)

    def forced_routing_config(self, block_a, block_b, e_local):
        return RoutingConfig(block_a=block_a, block_e=triton.next_power_of_2(e_local), block_b=block_b, num_warps=4)


class TestPermuteTriton(TorchArrays, PermuteKernelCases):
    """``permute_triton`` against the torch reference; ``config=None`` goes through
    ``moe_torch.permute(implementation="triton")``."""

    SHAPES = ("T1", "odd-T", "H384-G96", "wide-H")
    FORCED_CONFIGS = {
        "fp8_per_token": (9, 256, 2, 6, "fp8_per_token", 128, PermuteConfig(
            block_m=2, block_n=64, single_chunk=False, num_warps=4, num_stages=1)),
        "fp8_per_token_group": (9, 256, 2, 6, "fp8_per_token_group", 128, PermuteConfig(
            block_m=4, block_n=32, single_chunk=False, num_warps=4, num_stages=1)),
        "None": (9, 256, 2, 6, None, 128, PermuteConfig(
            block_m=1, block_n=16, single_chunk=True, num_warps=4, num_stages=1)),
        "fp8_per_tensor": (9, 256, 2, 6, "fp8_per_tensor", 128, PermuteConfig(
            block_m=8, block_n=64, single_chunk=True, num_warps=4, num_stages=1)),
    }

    def permute(self, x, dst2src, topk, quant, group_size, scale, config=None):
        if config is None:
            return moe_torch.permute(x, dst2src, topk=topk, quant=quant, group_size=group_size, scale=scale,
                                     implementation="triton")
        from moe_torch.ops.permute.triton import permute_triton

        return permute_triton(x, dst2src, topk, quant, group_size, scale, config=config)

    def reference_permute(self, x_np, dtype, dst2src_np, topk, quant, group_size, scale_np):
        scale = None if scale_np is None else to_torch(scale_np)
        return permute_reference(to_torch(x_np, dtype), to_torch(dst2src_np), topk, quant, group_size, scale)


# --------------------------------------------------------------------------------------
# Configs, dispatch


def test_permute_config_checked():
    """An explicit config that cannot cover the quantization span is refused before launch."""
    from moe_torch.ops.permute.triton import permute_triton

    x_np, dst2src_np, _ = permute_problem(2, 256, 1, 2, seed=1)
    x, dst2src = to_torch(x_np), to_torch(dst2src_np)
    bad = PermuteConfig(block_m=2, block_n=128, single_chunk=True, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="quantization span"):
        permute_triton(x, dst2src, 1, "fp8_per_token", 128, None, config=bad)


def test_dispatch(monkeypatch):
    """``implementation="triton"`` runs the kernels (their NotImplementedError reaches the caller);
    ``None`` on CPU tensors runs the reference and never touches Triton."""
    ids = to_torch(random_ids(np.random.default_rng(4), 6, 2, 4))
    x = to_torch(np.ones((6, 128), np.float32))
    calls = []

    def refuse(*args):
        calls.append(args)
        raise NotImplementedError("test: triton refused")

    monkeypatch.setattr(permute_api, "_triton_routing_metadata", refuse)
    monkeypatch.setattr(permute_api, "_triton_permute", refuse)
    with pytest.raises(NotImplementedError, match="test: triton refused"):
        moe_torch.routing_metadata(ids, 4, implementation="triton")
    with pytest.raises(NotImplementedError, match="test: triton refused"):
        moe_torch.permute(x, to_torch(np.full(12, -1, np.int32)), topk=2, implementation="triton")
    calls.clear()
    meta = moe_torch.routing_metadata(ids, 4)  # default: reference on CPU, fallback on CUDA
    assert_metadata_equal(meta, routing_metadata_reference(ids, 0, 4), "implementation=None")
    assert_permute_equal(moe_torch.permute(x, meta.dst2src, topk=2), permute_reference(x, meta.dst2src, 2, None, 128, None),
                         "implementation=None")
    assert len(calls) == (2 if TORCH_DEVICE == "cuda" else 0)


@pytest.mark.parametrize("m_cap,e_local", [(1, 1), (8, 7), (4096, 8), (65536 * 8, 256), (100, 1024)])
def test_routing_configs(m_cap, e_local):
    """Frozen, keyword-only configs; power-of-2 blocks; block_e covers E_local; no more
    assignments per block than exist."""
    c = routing_config(m_cap, e_local)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_a = 1
    with pytest.raises(TypeError):
        RoutingConfig(1, 1, 1, 4)  # kw_only
    for v in (c.block_a, c.block_e, c.block_b):
        assert v & (v - 1) == 0
    assert c.block_e >= e_local and c.block_a <= triton.next_power_of_2(m_cap)


@pytest.mark.parametrize("M,H,quant,G", [(1, 128, None, 128), (7, 7168, None, 128), (4096, 7168, "fp8_per_token", 128),
                                         (4096, 7168, "fp8_per_token_group", 128), (3, 4096, "fp8_per_tensor", 128),
                                         (5, 8192, "fp8_per_token_group", 8192)])
def test_permute_configs(M, H, quant, G):
    """Tiles of at most 4096 elements; single_chunk exactly when a dynamic span fits one block."""
    c = permute_config(M, H, quant, G)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_m = 1
    assert c.block_m & (c.block_m - 1) == 0 and c.block_n & (c.block_n - 1) == 0
    assert c.block_m * c.block_n <= 4096 and c.block_m <= triton.next_power_of_2(M)
    span = {"fp8_per_token": H, "fp8_per_token_group": G}.get(quant, c.block_n)
    assert c.single_chunk == (span <= c.block_n)


# --------------------------------------------------------------------------------------
# sm_90 compilation on the CPU, in a child process without TRITON_INTERPRET (the interpreter
# decorates triton's own jit library as InterpretedFunctions, which the code generator rejects).
# Needs no GPU and no driver, only triton's bundled ptxas.



def _routing_jobs(m_cap: int, e_local: int) -> dict[str, dict]:
    cfg = routing_config(m_cap, e_local)
    opts = {"num_warps": cfg.num_warps, "num_stages": 1}
    ints = {"M_cap": "i32", "expert_start": "i32", "E_local": "i32"}
    return {
        "routing/count": {"kernel": "_routing_count_kernel", "signature": {"ids_ptr": "*i32", "counts_ptr": "*i32", **ints},
                          "constexprs": {"BLOCK_A": cfg.block_a, "BLOCK_E": cfg.block_e}, "options": opts},
        "routing/scan": {"kernel": "_routing_scan_kernel",
                         "signature": {"counts_ptr": "*i32", "prefix_ptr": "*i32", "offsets_ptr": "*i32",
                                       "n_blocks": "i32", "E_local": "i32"},
                         "constexprs": {"BLOCK_B": cfg.block_b, "BLOCK_E": cfg.block_e}, "options": opts},
        "routing/scatter": {"kernel": "_routing_scatter_kernel",
                            "signature": {"ids_ptr": "*i64", "prefix_ptr": "*i32", "offsets_ptr": "*i32",
                                          "src2dst_ptr": "*i32", "dst2src_ptr": "*i32", **ints},
                            "constexprs": {"BLOCK_A": cfg.block_a, "BLOCK_E": cfg.block_e}, "options": opts},
    }


def _permute_job(quant, H, G):
    cfg = permute_config(4096 * 8, H, quant, G)
    return {
        "kernel": "_permute_kernel",
        "signature": {"x_ptr": "*bf16", "dst2src_ptr": "*i32", "out_ptr": "*fp8e4nv" if quant else "*bf16",
                      "scale_ptr": "*fp32" if quant else "*bf16", "M_cap": "i32", "H": "i32", "topk": "i32",
                      "stride_x": "i32", "stride_out": "i32", "stride_scale": "i32"},
        "constexprs": {"QUANT": {None: 0, "fp8_per_tensor": 1, "fp8_per_token": 2, "fp8_per_token_group": 3}[quant],
                       "SPAN": {"fp8_per_token": H, "fp8_per_token_group": G}.get(quant, cfg.block_n),
                       "SINGLE_CHUNK": cfg.single_chunk, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n},
        "options": {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    }


#: name -> job: the three routing kernels at DeepSeek-V3's E_local = 256 (int32 and int64 ids),
#: and every permute path at H = 7168 (per-token is the two-pass path there).
SM90_JOBS = {
    **_routing_jobs(4096 * 8, 256),
    "permute/none": _permute_job(None, 7168, 128),
    "permute/fp8_per_tensor": _permute_job("fp8_per_tensor", 7168, 128),
    "permute/fp8_per_token-two-pass": _permute_job("fp8_per_token", 7168, 128),
    "permute/fp8_per_token_group": _permute_job("fp8_per_token_group", 7168, 128),
}


@pytest.fixture(scope="module")
def sm90_ptx() -> dict[str, str]:
    """PTX of every job in SM90_JOBS, compiled for sm_90 in a child process without the interpreter."""
    return compile_sm90(SM90_JOBS, module="moe_torch.ops.permute.triton")


@pytest.mark.parametrize("name", [n for n in SM90_JOBS if n.startswith("routing")])
def test_routing_compiles_for_sm90(sm90_ptx, name):
    """The routing kernels lower to sm_90 cubin, with no atomics (a deterministic order)."""
    ptx = sm90_ptx[name]
    assert ".target sm_90" in ptx
    assert not re.search(r"\b(atom|red)\.", ptx), "an atomic in the PTX"  # (not the "red." of "shared.")


@pytest.mark.parametrize("name", [n for n in SM90_JOBS if n.startswith("permute")])
def test_permute_compiles_for_sm90(sm90_ptx, name):
    """The permute kernel lowers to sm_90 cubin with 64-bit row offsets; the FP8 variants divide
    with the IEEE ``div.rn.f32`` and convert with ``cvt.rn.satfinite.e4m3x2.f32``."""
    ptx = sm90_ptx[name]
    assert ".target sm_90" in ptx
    assert "mul.wide.s32" in ptx or "mul.lo.s64" in ptx
    if "fp8" in name:
        assert "div.rn.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
