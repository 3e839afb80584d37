"""The JAX grouped GEMM's backward (``moe_pallas/ops/grouped_gemm``, CONTRACT.md section 8).

``grouped_gemm_dgrad`` / ``grouped_gemm_wgrad`` (the jnp reference and the Pallas-Triton kernels, the
latter interpreted on the CPU) against ``jax.vjp`` of a plain float64 per-expert loop, in float32 and
bf16; FP8 dgrad per weight-scale layout against the dequantize-then-float rule; ``jax.grad`` through
``grouped_gemm`` (``custom_vjp``) under ``jit`` and ``shard_map``; the kernels' CUDA lowering on an
abstract H200, with the Triton module verified. Unused input rows (``>= M``) are NaN-poisoned
everywhere, and interpret mode fills outputs with NaN first, so a row that is read or forgotten shows.

The cases every backend passes (dgrad and wgrad against float64 over the shapes' edges, no rows and no experts,
``jax.vjp`` through ``grouped_gemm`` under ``jit``, the FP8 dgrad of every weight-scale layout, the argument checks)
are the shared ones of ``op_cases/grouped_gemm_backward.py``
(``TestGroupedGemmBackwardJax``); below them the JAX-only cases.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

import moe_pallas
from moe_pallas.ops.grouped_gemm.api import grouped_gemm, grouped_gemm_dgrad, grouped_gemm_wgrad
from moe_pallas.ops.grouped_gemm.config import (GroupedGemmDgradConfig, GroupedGemmWgradConfig,
                                                 heuristic_grouped_gemm_dgrad_config,
                                                 heuristic_grouped_gemm_wgrad_config)
from moe_pallas.ops.grouped_gemm.pallas_triton_backward import (grouped_gemm_dgrad_pallas_triton,
                                                                 grouped_gemm_wgrad_pallas_triton)
from op_cases import JaxArrays
from op_cases.grouped_gemm_backward import GroupedGemmBackwardCases
from tolerances import BF16_REL_FRO, GRAD_BF16_REL_FRO, GRAD_F32_REL_FRO, assert_exact, assert_rel_fro, to_numpy

IMPLS = ("reference", "pallas_triton")
DTYPES = {"float32": (jnp.float32, GRAD_F32_REL_FRO), "bfloat16": (jnp.bfloat16, GRAD_BF16_REL_FRO)}


def problem(seed: int, counts, m_cap: int, K: int, N: int, dtype=jnp.float32):
    """x [m_cap, K] ~ N(0, 1), w [E, N, K] ~ N(0, 1/K), d_y [m_cap, N] ~ N(0, 1), offsets from ``counts``;
    the unused rows ``>= sum(counts)`` of x and d_y are NaN (they must never be read)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m_cap, K)).astype(np.float32)
    w = (rng.standard_normal((len(counts), N, K)) / np.sqrt(K)).astype(np.float32)
    d_y = rng.standard_normal((m_cap, N)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    x[offsets[-1]:] = np.nan
    d_y[offsets[-1]:] = np.nan
    return (jnp.asarray(x).astype(dtype), jnp.asarray(w).astype(dtype), jnp.asarray(d_y).astype(dtype),
            jnp.asarray(offsets))


def f64_vjp(x, w, d_y, offsets):
    """``(d_x, d_w)`` by ``jax.vjp`` of a plain float64 per-expert loop ``y[s:t] = x[s:t] @ w[e].T``
    (rows ``>= M`` of ``y`` are constant zeros, so the NaNs there reach nothing), as numpy float64."""
    off = to_numpy(offsets).tolist()
    x64, w64, dy64 = (to_numpy(a).astype(np.float64) for a in (x, w, d_y))
    m_cap, N = dy64.shape

    def forward(x, w):
        parts = [x[off[e]:off[e + 1]] @ w[e].T for e in range(w.shape[0])]
        return jnp.concatenate(parts + [jnp.zeros((m_cap - off[-1], N), x.dtype)])

    with jax.enable_x64(True):
        _, vjp = jax.vjp(forward, jnp.asarray(x64), jnp.asarray(w64))
        d_x, d_w = vjp(jnp.asarray(np.where(np.isnan(dy64), 0.0, dy64)))  # the cotangent of rows >= M: any
        return np.asarray(d_x), np.asarray(d_w)


def check_finite_and_zero_tail(a, offsets, what: str) -> None:
    """Every value finite (no NaN read from rows >= M, none left unwritten); rows >= M exactly zero."""
    a32 = to_numpy(a).astype(np.float32)
    M = int(to_numpy(offsets)[-1])
    assert np.isfinite(a32).all(), f"{what}: {a32.size - np.isfinite(a32).sum()} non-finite values"
    assert not a32[M:].any(), f"{what}: rows >= M must be zero"


def check_empty_experts_zero(d_w, counts, what: str) -> None:
    """CONTRACT section 8: the weight gradient of an expert with no rows is exactly 0."""
    for e, c in enumerate(counts):
        if c == 0:
            assert_exact(d_w[e], np.zeros(d_w.shape[1:], to_numpy(d_w).dtype), f"{what}: d_w[{e}] of an empty expert")


# --------------------------------------------------------------------------------------
# dgrad and wgrad vs float64 autodiff


class TestGroupedGemmBackwardJax(JaxArrays, GroupedGemmBackwardCases):
    """``moe_pallas.grouped_gemm_dgrad`` / ``grouped_gemm_wgrad`` with the jnp references and the Pallas-Triton
    kernels (interpreted, heuristic configs), and ``jax.vjp`` through ``grouped_gemm`` under ``jit`` (float32; bf16
    in test_grad_bf16_inside_shard_map)."""

    OPS = moe_pallas
    IMPLS = IMPLS
    SHAPES = ("M=1", "odd-K-N", "several-tiles", "all-rows-on-one", "E_local=1")
    GRAD_CASE = ([4, 0, 7], 14, 24, 20, 3)
    GRAD_DTYPES = ("float32",)
    FOREIGN_IMPLS = ("pallas_mosaic", "triton")

    def grads(self, x, w, offsets, d_y, implementation):
        @jax.jit
        def vjp(x, w, offsets, d_y):
            _, pullback = jax.vjp(lambda x, w: grouped_gemm(x, w, offsets, implementation=implementation), x, w)
            return pullback(d_y)

        return vjp(x, w, offsets, d_y)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_kernels_with_small_tiles(dtype):
    """Interpret-only 8-row tiles: dgrad's row tiles straddle experts and the unused rows (a partial
    last tile, NaN-poisoned); wgrad's row loop has a partial last step; several N and K tiles."""
    counts, m_cap, K, N = [5, 0, 11, 2, 9], 35, 40, 24
    jdt, limit = DTYPES[dtype]
    x, w, d_y, offsets = problem(7, counts, m_cap, K, N, jdt)
    want_dx, want_dw = f64_vjp(x, w, d_y, offsets)
    d_x = grouped_gemm_dgrad_pallas_triton(d_y, w, offsets, interpret=True,
                                           config=GroupedGemmDgradConfig(block_m=8, block_n=16, block_k=16))
    check_finite_and_zero_tail(d_x, offsets, f"dgrad small tiles {dtype}")
    assert_rel_fro(d_x, want_dx, limit, f"dgrad small tiles {dtype}")
    d_w = grouped_gemm_wgrad_pallas_triton(x, d_y, offsets, interpret=True,
                                           config=GroupedGemmWgradConfig(block_m=4, block_n=16, block_k=16))
    assert_rel_fro(d_w, want_dw, GRAD_F32_REL_FRO, f"wgrad small tiles {dtype}")
    check_empty_experts_zero(d_w, counts, f"wgrad small tiles {dtype}")


def test_wgrad_every_empty_expert_pattern_of_four_experts():
    """E=4: all 2^4 patterns of empty experts through one jit of the kernel (offsets are data); empty
    experts get exactly 0, the others the float64 answer; the capacity left over is NaN-poisoned."""
    E, m_cap, K, N = 4, 12, 16, 16
    x0, _, dy0, _ = problem(4, [3] * E, m_cap, K, N)
    run = jax.jit(functools.partial(grouped_gemm_wgrad_pallas_triton, interpret=True,
                                    config=GroupedGemmWgradConfig(block_m=2, block_n=16, block_k=16)))
    for pattern in itertools.product([0, 1], repeat=E):
        counts = [bit * (1 + e) for e, bit in enumerate(pattern)]
        offsets = jnp.asarray(np.concatenate([[0], np.cumsum(counts)]), jnp.int32)
        M = int(offsets[-1])
        x, d_y = x0.at[M:].set(jnp.nan), dy0.at[M:].set(jnp.nan)
        d_w = run(x, d_y, offsets)
        check_empty_experts_zero(d_w, counts, f"pattern {pattern}")
        off = to_numpy(offsets)
        x64, dy64 = to_numpy(x).astype(np.float64), to_numpy(d_y).astype(np.float64)
        want = np.stack([dy64[off[e]:off[e + 1]].T @ x64[off[e]:off[e + 1]] for e in range(E)])  # float64 loop
        assert_rel_fro(d_w, want, GRAD_F32_REL_FRO, f"pattern {pattern}")


def test_named_exact_answers():
    """Exact small-integer answers: 2 experts, rows 0-2 on expert 0 and 3-5 on expert 1 (M=6 of M_cap=8,
    rows 6-7 NaN), K=N=16, w[g] = (g+1) * I, d_y[i, :] = i+1, x[i, :] = 1:
    d_x[i, :] = (i+1) * (e(i)+1); d_w[0] = (1+2+3) * ones = 6, d_w[1] = (4+5+6) * ones = 15."""
    d_y = np.repeat(np.arange(1.0, 9.0)[:, None], 16, axis=1)
    d_y[6:] = np.nan
    x = np.ones((8, 16))
    x[6:] = np.nan
    d_y, x = jnp.asarray(d_y, jnp.float32), jnp.asarray(x, jnp.float32)
    w = jnp.asarray(np.stack([(g + 1) * np.eye(16) for g in range(2)]), jnp.float32)
    offsets = jnp.asarray([0, 3, 6], jnp.int32)
    want_dx = np.zeros((8, 16), np.float32)
    want_dx[:6] = (np.arange(1.0, 7.0) * np.array([1, 1, 1, 2, 2, 2]))[:, None]
    want_dw = np.stack([np.full((16, 16), 6.0), np.full((16, 16), 15.0)]).astype(np.float32)
    small = dict(dgrad=GroupedGemmDgradConfig(block_m=4, block_n=16, block_k=16),
                 wgrad=GroupedGemmWgradConfig(block_m=2, block_n=16, block_k=16))
    for impl in IMPLS:
        assert_exact(grouped_gemm_dgrad(d_y, w, offsets, implementation=impl), want_dx, f"{impl} d_x")
        assert_exact(grouped_gemm_wgrad(x, d_y, offsets, implementation=impl), want_dw, f"{impl} d_w")
    assert_exact(grouped_gemm_dgrad_pallas_triton(d_y, w, offsets, config=small["dgrad"], interpret=True), want_dx,
                 "kernel d_x, a row tile straddling the experts")
    assert_exact(grouped_gemm_wgrad_pallas_triton(x, d_y, offsets, config=small["wgrad"], interpret=True), want_dw,
                 "kernel d_w, 2-row steps")


# --------------------------------------------------------------------------------------
# FP8 weights (straight-through): dgrad on the dequantized weights rounded to d_y's dtype (every scale layout: the
# shared cases)

WEIGHT_LAYOUTS = ["per_expert", "per_channel", "block"]


def straight_through_weights(wq, ws, dtype) -> jax.Array:
    """CONTRACT section 8: ``q_w * scale_w`` (float32), rounded to ``dtype``."""
    return moe_pallas.dequantize_weight_fp8(wq, ws).astype(jnp.float32).astype(dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_dgrad_block_scales_per_tile(impl):
    """The two 128-row N blocks (the contraction) and two K blocks of w get scales ~2^20 apart: each
    weight tile must be dequantized with its own block's scale (one scale for all is off by orders)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((1, 256, 256))
    w[:, 128:, :128] *= 1e3
    w[:, :128, 128:] *= 1e-3
    wq, ws = moe_pallas.quantize_weight_fp8(jnp.asarray(w, jnp.float32), "block")
    assert float(ws.max() / ws.min()) > 1e5
    d_y = jnp.asarray(rng.standard_normal((8, 256)), jnp.float32)
    offsets = jnp.asarray([0, 8], jnp.int32)
    want = to_numpy(d_y).astype(np.float64) @ to_numpy(straight_through_weights(wq, ws, jnp.float32))[0].astype(np.float64)
    assert_rel_fro(grouped_gemm_dgrad(d_y, wq, offsets, w_scale=ws, implementation=impl), want, GRAD_F32_REL_FRO,
                   f"{impl}: block scales per tile")


# --------------------------------------------------------------------------------------
# grouped_gemm differentiable (custom_vjp)


@pytest.mark.parametrize("impl,check_vma", [("reference", True), ("reference", False), ("pallas_triton", False)])
def test_grad_bf16_inside_shard_map(impl, check_vma):
    """bf16 inputs inside ``shard_map`` (one CPU device; ``check_vma=False`` as ``moe_pallas.ep`` runs it,
    and, for the reference, with the varying-axis types checked): the VJP gives bf16 gradients within
    the bf16 tolerance of float64 autodiff. (The Pallas-Triton kernels, forward included, declare no
    varying axes for their outputs, so ``check_vma=True`` refuses them.)"""
    from jax.sharding import Mesh, PartitionSpec as P

    counts, m_cap, K, N = [3, 5], 9, 16, 16
    x, w, d_y, offsets = problem(5, counts, m_cap, K, N, jnp.bfloat16)
    d_y = jnp.nan_to_num(d_y)
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))

    def local(x, w, offsets, d_y):
        _, vjp = jax.vjp(lambda x, w: grouped_gemm(x, w, offsets, implementation=impl), x, w)
        return vjp(d_y)

    # everything but the offsets varies over the (one-device) mesh axis, as the EP layer's local arrays do
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("ep"), P("ep"), P(), P("ep")),
                              out_specs=(P("ep"), P("ep")), check_vma=check_vma))
    d_x, d_w = f(x, w, offsets, d_y)
    want_dx, want_dw = f64_vjp(x, w, d_y, offsets)
    assert d_x.dtype == jnp.bfloat16 and d_w.dtype == jnp.bfloat16
    assert_rel_fro(d_x, want_dx, GRAD_BF16_REL_FRO, "shard_map d_x")
    assert_rel_fro(d_w, want_dw, GRAD_BF16_REL_FRO, "shard_map d_w")


def test_fp8_grouped_gemm_is_not_differentiable():
    """A gradient through FP8 codes or scales raises (never a wrong gradient); the forward still runs."""
    x, w, _, offsets = problem(2, [3, 4], 8, 32, 16)
    xq, xs = jnp.nan_to_num(x).astype(jnp.float8_e4m3fn), jnp.ones((8, 1), jnp.float32)  # any codes and scales
    wq, ws = w.astype(jnp.float8_e4m3fn), jnp.ones((2, 16), jnp.float32)
    assert grouped_gemm(xq, wq, offsets, x_scale=xs, w_scale=ws).shape == (8, 16)
    loss = lambda xq, xs: jnp.sum(grouped_gemm(xq, wq, offsets, x_scale=xs, w_scale=ws).astype(jnp.float32))
    for argnums in (0, 1):
        with pytest.raises(TypeError, match="grouped_gemm: float8_e4m3fn inputs .* are not differentiable"):
            jax.grad(loss, argnums=argnums)(xq, xs)


# --------------------------------------------------------------------------------------
# Configs (the argument checks: the shared cases)


def test_config_heuristics_and_kernel_limits():
    """Heuristic blocks are >= 16 (tensor-core tiles) and divide 128 (block scales); smaller blocks are
    interpret-only, and block scales refuse a tile straddling two scale blocks (NotImplementedError)."""
    from moe_pallas.ops.grouped_gemm.config import DGRAD_WIDE_CONFIG, WGRAD_WIDE_CONFIG

    for args in [(1, 33, 64, 8, 2), (8191, 4096, 7168, 32, 2), (4096, 7168, 2048, 256, 4)]:
        for cfg in (heuristic_grouped_gemm_dgrad_config(*args), heuristic_grouped_gemm_wgrad_config(*args)):
            assert min(cfg.block_m, cfg.block_n, cfg.block_k) >= 16 and 128 % cfg.block_n == 0 and 128 % cfg.block_k == 0
    # bf16 from 8192 rows: the H200-measured wide tiles; with 128x128 weight blocks the dgrad keeps tiles dividing 128
    big = (16384, 4096, 7168, 32, 2)
    assert heuristic_grouped_gemm_dgrad_config(*big) == DGRAD_WIDE_CONFIG
    assert heuristic_grouped_gemm_wgrad_config(*big) == WGRAD_WIDE_CONFIG
    blocked = heuristic_grouped_gemm_dgrad_config(*big, True)
    assert 128 % blocked.block_n == 0 and 128 % blocked.block_k == 0
    assert heuristic_grouped_gemm_wgrad_config(16384, 4096, 7168, 32, 4) != WGRAD_WIDE_CONFIG  # float32: untouched
    with pytest.raises(ValueError, match="GroupedGemmWgradConfig: block_n must be a power of two"):
        GroupedGemmWgradConfig(block_m=16, block_n=24, block_k=16)
    small = GroupedGemmWgradConfig(block_m=4, block_n=16, block_k=16)
    f = functools.partial(grouped_gemm_wgrad_pallas_triton, interpret=False, config=small)
    with pytest.raises(NotImplementedError, match=r"grouped_gemm_wgrad\[pallas_triton\]: on the GPU every dot block must be >= 16"):
        lower_for_cuda(f, S((8, 32), jnp.bfloat16), S((8, 16), jnp.bfloat16), S((3,), jnp.int32))
    _, w, d_y, offsets = problem(1, [3, 2], 8, 256, 256)
    wq, ws = moe_pallas.quantize_weight_fp8(w, "block")
    with pytest.raises(NotImplementedError, match="block_n and block_k to divide 128"):
        grouped_gemm_dgrad_pallas_triton(d_y, wq, offsets, w_scale=ws, interpret=True,
                                         config=GroupedGemmDgradConfig(block_m=16, block_n=256, block_k=16))


# --------------------------------------------------------------------------------------
# GPU lowering on the CPU, and the Triton module verified (as Triton on the H200 would)

H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "cuda"))
TRITON_CALL = "__gpu$xla.gpu.triton"
S = jax.ShapeDtypeStruct


def lower_for_cuda(f, *args) -> str:
    with use_abstract_mesh(H200):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def triton_modules(monkeypatch, f, *args) -> list:
    """Lower ``f`` for CUDA and return the Triton modules of its Pallas kernels (``verify()`` them: the
    MLIR verifier Triton runs first on the GPU)."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    modules, real = [], registration.lowering.lower_jaxpr_to_triton_module

    def spy(*a, **kw):
        result = real(*a, **kw)
        modules.append(result.module)
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", spy)
    text = lower_for_cuda(f, *args)
    assert text.count(TRITON_CALL) == len(modules) == 1, text[:2000]
    return modules


M_, K_, N_, E_ = 200, 7168, 4096 + 64, 32  # DeepSeek-V3-like K, N with a partial tile


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_backward_kernels_lower_for_cuda(monkeypatch, dtype):
    dgrad = functools.partial(grouped_gemm_dgrad_pallas_triton, interpret=False)
    (module,) = triton_modules(monkeypatch, dgrad, S((M_, N_), dtype), S((E_, N_, K_), dtype), S((E_ + 1,), jnp.int32))
    assert module.operation.verify()
    wgrad = functools.partial(grouped_gemm_wgrad_pallas_triton, interpret=False)
    (module,) = triton_modules(monkeypatch, wgrad, S((M_, K_), dtype), S((M_, N_), dtype), S((E_ + 1,), jnp.int32))
    assert module.operation.verify()  # the data-dependent row loop: an scf.for with int32 bounds


@pytest.mark.parametrize("layout", WEIGHT_LAYOUTS)
def test_fp8_dgrad_lowers_for_cuda(monkeypatch, layout):
    ws = {"per_expert": S((E_,), jnp.float32), "per_channel": S((E_, N_), jnp.float32),
          "block": S((E_, -(-N_ // 128), K_ // 128), jnp.float32)}[layout]

    def f(d_y, w, offsets, w_scale):
        return grouped_gemm_dgrad_pallas_triton(d_y, w, offsets, w_scale=w_scale, interpret=False)

    (module,) = triton_modules(monkeypatch, f, S((M_, N_), jnp.bfloat16), S((E_, N_, K_), jnp.float8_e4m3fn),
                               S((E_ + 1,), jnp.int32), ws)
    assert module.operation.verify()


def test_triton_verifier_catches_loop_bounds_of_two_types(monkeypatch):
    """Why the lowering tests verify the module: the forward's first dynamic K loop,
    ``fori_loop(0, jnp.where(e < E, K // block_k, 0))``, lowered on the CPU but Triton rejected it on
    the H200 ('scf.for' bounds of different types: the where of two Python ints became i1). The verifier
    sees it here; the wgrad's row loop (int32 bounds) passes the same check above."""
    from jax.experimental import pallas as pl

    def kernel(e_ref, o_ref):
        steps = jnp.where(e_ref[0] < 4, 3, 0)
        o_ref[...] = jax.lax.fori_loop(0, steps, lambda i, acc: acc + 1.0, jnp.zeros((16,), jnp.float32))

    f = lambda e: pl.pallas_call(kernel, out_shape=S((16,), jnp.float32))(e)
    (module,) = triton_modules(monkeypatch, f, S((1,), jnp.int32))
    with pytest.raises(Exception, match="scf.for' op failed to verify that all of {lowerBound, upperBound, step} have same type"):
        module.operation.verify()


@pytest.mark.gpu
def test_default_serves_k7000_under_vjp():
    """The reported crash: bf16 ``grouped_gemm`` with K=7000, N=1536 under ``jax.vjp``, ``implementation=None``, E=8
    experts with ragged rows of 0-2000 each (one empty, one at 2000) and unused capacity, on a GPU. It raised
    ``ValueError: Swizzle 16 is not supported`` from the Mosaic wgrad (a 16-byte tile row); now Mosaic GPU refuses
    the three ops before launch and the default order serves them. ``y``, ``d_x``, ``d_w`` against ``jax.vjp`` of a
    float32 per-expert loop (HIGHEST precision) on the same bf16 values: CONTRACT.md sections 7 and 8 (bf16 rows);
    the empty expert's ``d_w`` exactly 0, rows ``>= M`` of ``y`` and ``d_x`` zero."""
    counts = [1333, 0, 2000, 17, 911, 1, 1999, 640]
    E, K, N = len(counts), 7000, 1536
    offsets_np = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    m_cap = int(offsets_np[-1]) + 45
    rng = np.random.default_rng(7000)
    x = jnp.asarray(rng.standard_normal((m_cap, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((E, N, K)) / np.sqrt(K), jnp.bfloat16)
    d_y = jnp.asarray(rng.standard_normal((m_cap, N)), jnp.bfloat16)
    offsets = jnp.asarray(offsets_np)

    y, vjp = jax.vjp(lambda x_, w_: moe_pallas.grouped_gemm(x_, w_, offsets), x, w)
    d_x, d_w = vjp(d_y)

    def loop(x_, w_):  # float32 reference: rows [offsets[e], offsets[e+1]) times w[e].T, zeros past M
        dot = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
        parts = [dot(x_[offsets_np[e]:offsets_np[e + 1]], w_[e].T) for e in range(E)]
        return jnp.concatenate(parts + [jnp.zeros((m_cap - offsets_np[-1], N), jnp.float32)])

    f32 = lambda a: a.astype(jnp.float32)
    y_ref, vjp_ref = jax.vjp(loop, f32(x), f32(w))
    d_x_ref, d_w_ref = vjp_ref(f32(d_y))
    M = int(offsets_np[-1])
    assert_rel_fro(y[:M], y_ref[:M], BF16_REL_FRO, "y")
    assert_rel_fro(d_x[:M], d_x_ref[:M], GRAD_BF16_REL_FRO, "d_x")
    assert_rel_fro(d_w, d_w_ref, GRAD_BF16_REL_FRO, "d_w")
    assert_exact(d_w[1], jnp.zeros_like(d_w[1]), "d_w of the empty expert")
    assert not to_numpy(y[M:]).astype(np.float32).any() and not to_numpy(d_x[M:]).astype(np.float32).any()
