"""The Triton ``routing_metadata`` and ``permute`` kernels against the torch references (CONTRACT.md sections 2-3, 7).

Kernels: ``moe_torch/ops/permute/triton.py``, called through the public API with
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
import torch
import triton
from hypothesis import given

import moe_torch
from common import TORCH_DEVICE, random_ids, to_torch
from moe_torch.ops.permute import api as permute_api
from moe_torch.ops.permute.config import PermuteConfig, RoutingConfig, permute_config, routing_config
from moe_torch.ops.permute.reference import permute_reference, routing_metadata_reference
from test_permute import CASES, _ids, check_invariants, routing_problems
from tolerances import assert_exact
from sm90 import compile_sm90



def _meta_triton(ids: torch.Tensor, E: int, start: int, e_local: int):
    return moe_torch.routing_metadata(ids, E, expert_start=start, num_local_experts=e_local, implementation="triton")


def _assert_meta_equal(got, ids: torch.Tensor, start: int, e_local: int, what: str = "") -> None:
    want = routing_metadata_reference(ids, start, e_local)
    for name, g, w in zip(("expert_offsets", "src2dst", "dst2src"), got, want):
        assert g.dtype == torch.int32, f"{what} {name}: dtype {g.dtype}"
        assert_exact(g, w, f"{what} {name}")


# --------------------------------------------------------------------------------------
# routing_metadata


@pytest.mark.parametrize("id_dtype", ["int32", "int64"])
@pytest.mark.parametrize("case", list(CASES))
def test_routing_metadata_cases(case, id_dtype):
    """Every edge case of tests/test_permute.py: exactly the reference, and the contract's invariants."""
    T, topk, E, start, e_local, how = CASES[case]
    ids_np = _ids(np.random.default_rng(0), T, topk, E, how)
    ids = to_torch(ids_np, id_dtype)
    meta = _meta_triton(ids, E, start, e_local)
    _assert_meta_equal(meta, ids, start, e_local, case)
    check_invariants(ids_np, start, e_local, *meta)


@pytest.mark.parametrize("T,topk,E,start,e_local,block_a,block_b", [
    (37, 3, 8, 0, 8, 4, 2),  # 28 blocks of 4 assignments, scanned 2 at a time (last block partial)
    (50, 2, 16, 4, 5, 8, 4),  # EP rank, E_local not a power of 2 (padded expert columns)
    (16, 1, 4, 0, 4, 1, 1),  # one assignment per block: the order comes from the scan alone
    (300, 8, 256, 0, 256, 16, 8),  # DeepSeek-V3-like E=256, topk=8: 150 blocks
])
def test_routing_metadata_many_blocks(T, topk, E, start, e_local, block_a, block_b):
    """Small forced blocks: one expert's rows span many blocks and many scan steps, and stay in
    assignment order (block-wise counts + exclusive scan + in-block one-hot cumsum)."""
    from moe_torch.ops.permute.triton import routing_metadata_triton

    rng = np.random.default_rng(T + E)
    ids = to_torch(np.concatenate([random_ids(rng, T // 2, topk, E),  # distinct in a row
                                   rng.integers(0, min(E, 3), (T - T // 2, topk)).astype(np.int32)]))  # skewed, repeats
    cfg = RoutingConfig(block_a=block_a, block_e=triton.next_power_of_2(e_local), block_b=block_b, num_warps=4)
    _assert_meta_equal(routing_metadata_triton(ids, start, e_local, config=cfg), ids, start, e_local, "forced config")
    _assert_meta_equal(_meta_triton(ids, E, start, e_local), ids, start, e_local, "heuristic config")


def test_routing_metadata_out_of_range_ids_unchecked():
    """Unchecked mode: ids outside ``[0, num_experts)`` (negative, huge, int64 beyond int32) are
    non-local, as in the reference; the input is left untouched."""
    ids_np = np.array([[1, -5], [9, 2], [2**40, 0], [-(2**40), 3], [2, 2]], np.int64)
    ids = to_torch(ids_np)
    before = ids.clone()
    for start, e_local in ((0, 4), (1, 2)):
        meta = _meta_triton(ids, 4, start, e_local)
        _assert_meta_equal(meta, ids, start, e_local, f"start={start}")
    assert_exact(ids, before, "topk_ids unchanged")
    with pytest.raises(ValueError):
        moe_torch.routing_metadata(ids, 4, check_ids=True, implementation="triton")  # checked mode: a host check


def test_routing_metadata_strided_and_empty():
    """A non-contiguous ``topk_ids`` view is read correctly; ``T = 0`` keeps the API's early return."""
    ids_np = random_ids(np.random.default_rng(3), 9, 2, 6)
    ids = to_torch(np.repeat(ids_np, 2, axis=1))[:, ::2]
    _assert_meta_equal(_meta_triton(ids, 6, 1, 4), ids.contiguous(), 1, 4, "strided")
    empty = _meta_triton(to_torch(np.zeros((0, 3), np.int32)), 6, 0, 6)
    assert_exact(empty.expert_offsets, np.zeros(7, np.int32), "T=0 offsets")
    assert tuple(empty.src2dst.shape) == (0, 3) and tuple(empty.dst2src.shape) == (0,)


@given(routing_problems())
def test_property_routing_metadata_matches_reference(problem):
    """Random (E, T, topk, EP rank, skew, repeated ids): exactly the reference, and the invariants."""
    ids_np, E, start, e_local = problem
    ids = to_torch(ids_np)
    meta = _meta_triton(ids, E, start, e_local)
    _assert_meta_equal(meta, ids, start, e_local, "property")
    check_invariants(ids_np, start, e_local, *meta)


# --------------------------------------------------------------------------------------
# permute

PERMUTE_QUANTS = [None, "fp8_per_token", "fp8_per_token_group", "fp8_per_tensor"]


def _permute_problem(T: int, H: int, topk: int, E: int, dtype: str, seed: int):
    """``(x [T, H], dst2src, M)`` on an EP rank (some rows non-local, so rows >= M exist); rows of
    widely different magnitudes (scales differ); token 0 is all zero (the floor scale)."""
    rng = np.random.default_rng(seed)
    x_np = (rng.standard_normal((T, H)) * np.exp(rng.uniform(-4, 4, (T, 1)))).astype(np.float32)
    x_np[0] = 0
    ids = to_torch(random_ids(rng, T, topk, E))
    _, _, dst2src = routing_metadata_reference(ids, 1, max(1, E // 2))
    return to_torch(x_np, dtype), dst2src, int((dst2src >= 0).sum())


def _assert_permute_equal(got, want, what: str) -> None:
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape, f"{what}: {q.dtype} {q.shape} vs {q_ref.dtype} {q_ref.shape}"
    assert_exact(q, q_ref, f"{what}: rows / codes")
    assert (s is None) == (s_ref is None), what
    if s is not None:
        assert s.dtype == torch.float32 and s.shape == s_ref.shape, f"{what}: scale {s.dtype} {s.shape}"
        assert_exact(s, s_ref, f"{what}: scales")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant", PERMUTE_QUANTS)
@pytest.mark.parametrize("T,H,topk,E,G", [
    (1, 128, 1, 2, 128),  # T=1
    (7, 256, 3, 5, 128),  # odd T, two groups
    (12, 384, 2, 16, 96),  # G not a power of 2 (masked single chunk); H not a power of 2
    (3, 4352, 2, 4, 128),  # H > 4096: per-token takes the two-pass path; 34 groups
])
def test_permute(T, H, topk, E, G, quant, dtype):
    """Rows, FP8 codes and scales bit-identical to the reference for each quant mode; rows >= M
    are zero (with the zero-row scale); the inputs are untouched."""
    x, dst2src, M = _permute_problem(T, H, topk, E, dtype, seed=T * H + G)
    before = (x.clone(), dst2src.clone())
    scale = to_torch(np.array(0.05, np.float32)) if quant == "fp8_per_tensor" else None
    kw = dict(topk=topk, quant=quant, group_size=G, scale=scale)
    got = moe_torch.permute(x, dst2src, implementation="triton", **kw)
    want = permute_reference(x, dst2src, topk, quant, G, scale)
    _assert_permute_equal(got, want, f"{quant} {dtype}")
    assert not got[0][M:].float().any(), "rows >= M are zero"
    assert_exact(x, before[0], "x unchanged")
    assert_exact(dst2src, before[1], "dst2src unchanged")


@pytest.mark.parametrize("quant,cfg", [
    ("fp8_per_token", PermuteConfig(block_m=2, block_n=64, single_chunk=False, num_warps=4, num_stages=1)),
    ("fp8_per_token_group", PermuteConfig(block_m=4, block_n=32, single_chunk=False, num_warps=4, num_stages=1)),
    (None, PermuteConfig(block_m=1, block_n=16, single_chunk=True, num_warps=4, num_stages=1)),
    ("fp8_per_tensor", PermuteConfig(block_m=8, block_n=64, single_chunk=True, num_warps=4, num_stages=1)),
])
def test_permute_forced_configs(quant, cfg):
    """Multi-chunk spans (amax pass, then quantize pass) and many column programs: still bit-identical."""
    from moe_torch.ops.permute.triton import permute_triton

    x, dst2src, _ = _permute_problem(9, 256, 2, 6, "bfloat16", seed=11)
    scale = to_torch(np.array(0.125, np.float32)) if quant == "fp8_per_tensor" else None
    got = permute_triton(x, dst2src, 2, quant, 128, scale, config=cfg)
    _assert_permute_equal(got, permute_reference(x, dst2src, 2, quant, 128, scale), f"{quant} {cfg}")


def test_permute_config_checked():
    """An explicit config that cannot cover the quantization span is refused before launch."""
    from moe_torch.ops.permute.triton import permute_triton

    x, dst2src, _ = _permute_problem(2, 256, 1, 2, "float32", seed=1)
    bad = PermuteConfig(block_m=2, block_n=128, single_chunk=True, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="quantization span"):
        permute_triton(x, dst2src, 1, "fp8_per_token", 128, None, config=bad)


def test_permute_edge_inputs():
    """A strided ``x`` view (copied, not misread); per-tensor scale of shape ``(1,)``; ``T = 0``."""
    x, dst2src, _ = _permute_problem(5, 128, 2, 4, "float32", seed=2)
    xs = to_torch(np.repeat(x.cpu().numpy(), 2, axis=1))[:, ::2]
    _assert_permute_equal(moe_torch.permute(xs, dst2src, topk=2, implementation="triton"),
                          permute_reference(x, dst2src, 2, None, 128, None), "strided x")
    s1 = to_torch(np.array([0.25], np.float32))
    got = moe_torch.permute(x, dst2src, topk=2, quant="fp8_per_tensor", scale=s1, implementation="triton")
    _assert_permute_equal(got, permute_reference(x, dst2src, 2, "fp8_per_tensor", 128, s1.reshape(())), "scale (1,)")
    x0 = to_torch(np.zeros((0, 128), np.float32))
    d0 = to_torch(np.zeros((0,), np.int32))
    for quant in ("fp8_per_token", "fp8_per_token_group", None):
        _assert_permute_equal(moe_torch.permute(x0, d0, topk=2, quant=quant, implementation="triton"),
                              permute_reference(x0, d0, 2, quant, 128, None), f"T=0 {quant}")


# --------------------------------------------------------------------------------------
# Dispatch, configs


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
    _assert_meta_equal(meta, ids, 0, 4, "implementation=None")
    _assert_permute_equal(moe_torch.permute(x, meta.dst2src, topk=2), permute_reference(x, meta.dst2src, 2, None, 128, None),
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
