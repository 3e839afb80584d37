"""Mosaic GPU grouped GEMM (``moe_pallas/ops/grouped_gemm/pallas_mosaic_gpu.py``, CONTRACT.md section 4).

Mosaic GPU kernels do not interpret on a CPU, so the numerical tests here run on the
GPU machine only (``benchmarks/gpu_check.py``); on a CPU they are skipped and only the host-side rules
run (NotImplementedError off the GPU and outside the kernel's limits, config validation, the kernel
traces for every dtype and scale layout, and the warp-specialized FP8 kernel lowers for CUDA:
``lower(lowering_platforms=("cuda",))`` runs the Pallas-to-Mosaic-GPU lowering without a device).

On the GPU: bf16 against a float64 loop, FP8 with all 9 scale-layout combinations against the
jnp reference, every empty-expert pattern of E=6 in one compiled kernel, unused capacity poisoned
with NaN (never read, written as zeros), the tile-straddling named case, and dispatch falling back
to the Pallas-Triton kernel where Mosaic cannot serve (N not a multiple of the tile).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_pallas
from moe_pallas.ops.device import spec_of
from moe_pallas.ops.grouped_gemm import pallas_mosaic_gpu
from moe_pallas.ops.grouped_gemm.config import (MosaicGroupedGemmConfig, heuristic_mosaic_grouped_gemm_config,
                                                MOSAIC_MAX_SMEM_BYTES, mosaic_grouped_gemm_config, ws_smem_bytes)
from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu import grouped_gemm_pallas_mosaic_gpu
from moe_pallas.ops.grouped_gemm.reference import grouped_gemm_reference
from common import TEST_SPEC, spec_of_kind
from tolerances import BF16_REL_FRO, FP8_REL_FRO, assert_exact, assert_rel_fro, to_numpy
from test_pallas_grouped_gemm import _fresh_tuned_cache  # noqa: F401 - the autouse fixture: a fresh tuned cache
from test_pallas_grouped_gemm import _spy_config, check_rows, f64_loop, problem, tuned_entry, use_tuned_file

ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernels run on a Hopper GPU only (no CPU interpret/lowering)")


# --------------------------------------------------------------------------------------
# Host-side rules (CPU and GPU)


@pytest.mark.skipif(ON_GPU, reason="checks the CPU refusal")
def test_refuses_off_the_gpu():
    x, w, offsets = problem(0, [3, 5], 8, 128, 128, jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"grouped_gemm\[pallas_mosaic_gpu\]: needs a Hopper GPU"):
        moe_pallas.grouped_gemm(x, w, offsets, implementation="pallas_mosaic_gpu")


def test_limits_raise_not_implemented():
    """Valid requests outside the kernel's limits raise NotImplementedError before any tracing."""
    x, w, offsets = problem(0, [3, 5], 8, 128, 100, jnp.bfloat16)  # N=100: not a multiple of block_n
    with pytest.raises(NotImplementedError, match=r"N % block_n == 0 and K % block_k == 0.*N=100"):
        grouped_gemm_pallas_mosaic_gpu(x, w, offsets)
    x32, w32, _ = problem(0, [3, 5], 8, 128, 128, jnp.float32)
    with pytest.raises(NotImplementedError, match=r"x must be bf16, float16 or float8_e4m3fn .*float32"):
        grouped_gemm_pallas_mosaic_gpu(x32, w32, offsets)


@pytest.mark.parametrize("kw, message", [
    (dict(block_m=32, block_n=128, block_k=64), r"block_m must be one of \(64, 128\); got 32"),
    (dict(block_m=64, block_n=100, block_k=64), r"block_n must be a multiple of 8 up to 256; got 100"),
    (dict(block_m=64, block_n=128, block_k=0), r"block_k must be an int >= 1; got block_k=0"),
    (dict(block_m=64, block_n=128, block_k=128, warp_specialized=True, split_m=1), r"split_m must be a bool"),
    (dict(block_m=64, block_n=128, block_k=128, split_m=True), r"split_m splits the warp-specialized CTA tile"),
])
def test_config_rules(kw, message):
    with pytest.raises(ValueError, match=message):
        MosaicGroupedGemmConfig(**kw)


def test_per_step_accumulation_needs_small_tiles():
    """FP8 with promoted accumulation keeps two float32 tiles in registers: a 128x128 tile is refused."""
    xq, xs, wq, ws, offsets = _fp8_problem(1, [70, 0, 130, 9], 256, 256, 256, "per_token", "per_channel")
    cfg = MosaicGroupedGemmConfig(block_m=128, block_n=128, block_k=128)
    with pytest.raises(NotImplementedError, match=r"block_m \* block_n must be <= 64 \* 128"):
        grouped_gemm_pallas_mosaic_gpu(xq, wq, offsets, x_scale=xs, w_scale=ws, config=cfg)
    fast = MosaicGroupedGemmConfig(block_m=128, block_n=128, block_k=128, fast_accum=True)
    assert jax.jit(grouped_gemm_pallas_mosaic_gpu, static_argnames=("config",)).trace(
        xq, wq, offsets, x_scale=xs, w_scale=ws, config=fast).jaxpr is not None


WS_FP8 = MosaicGroupedGemmConfig(block_m=64, block_n=128, block_k=128, max_concurrent_steps=4, warp_specialized=True)


def test_warp_specialized_fp8_rules():
    """The warp-specialized schedule takes FP8 (each consumer warpgroup promotes its own 64 x 128 tile): per-step
    accumulation refuses 128 x 128 consumer tiles and takes block_k 128 or 256 (one or two K blocks a step); per-step
    scales need block_n == 128; ``fast_accum`` takes 128 x 128."""
    from moe_pallas.ops.grouped_gemm.config import mosaic_config_problem

    assert mosaic_config_problem(WS_FP8, 512, 256, 1, True) is None
    assert mosaic_config_problem(WS_FP8, 512, 256, 1, False) is None
    big = MosaicGroupedGemmConfig(block_m=128, block_n=128, block_k=128, max_concurrent_steps=3, warp_specialized=True)
    assert "block_m * block_n must be <= 64 * 128" in mosaic_config_problem(big, 512, 256, 1, False)
    import dataclasses
    assert mosaic_config_problem(dataclasses.replace(big, fast_accum=True), 512, 256, 1, False) is None
    narrow = MosaicGroupedGemmConfig(block_m=64, block_n=64, block_k=128, warp_specialized=True)
    assert "per-K-step scales need block_n == 128" in mosaic_config_problem(narrow, 512, 256, 1, True)
    assert "N % (2 * block_n) == 0" in mosaic_config_problem(WS_FP8, 384, 256, 1, True)  # 384 = 1.5 CTA tiles
    two_blocks = dataclasses.replace(WS_FP8, block_k=256, max_concurrent_steps=2)  # two K blocks a step
    assert mosaic_config_problem(two_blocks, 512, 512, 1, True) is None
    odd = dataclasses.replace(WS_FP8, block_k=64)
    assert "takes block_k 128 or 256" in mosaic_config_problem(odd, 512, 512, 1, False)


def test_split_m_rules_and_heuristic():
    """``split_m`` (consumers splitting the rows of a ``2*block_m x block_n`` CTA tile) needs ``N % block_n`` only:
    N=384 (three 128-wide CTA tiles) is taken, N=320 refused; the heuristic takes it for FP8 with >= 256 rows per
    expert wherever N % 128 == 0, its planar snake 1 wide when the column tiles are not a multiple of 4."""
    import dataclasses
    from moe_pallas.ops.grouped_gemm.config import mosaic_config_problem

    split = dataclasses.replace(WS_FP8, split_m=True)
    assert mosaic_config_problem(split, 384, 256, 1, True) is None
    assert "N % block_n == 0" in mosaic_config_problem(split, 320, 256, 1, True)
    cfg = mosaic_grouped_gemm_config(16384, 384, 7168, 32, 1, per_step_scales=True)
    assert cfg.split_m and cfg.warp_specialized and cfg.grid_block_n == 1


def test_bug_warp_specialized_one_stage_refused():
    """Regression: the persistent warp-specialized kernel with one shared-memory stage deadlocks (a consumer
    frees a step's slot only after issuing the next step's wgmma; the producer waits for that slot to load the next
    step). The rule refuses it on the host, by name, for both accumulation modes."""
    import dataclasses
    from moe_pallas.ops.grouped_gemm.config import mosaic_config_problem

    for cfg in (dataclasses.replace(WS_FP8, max_concurrent_steps=1),
                MosaicGroupedGemmConfig(block_m=128, block_n=64, block_k=64, max_concurrent_steps=1,
                                        warp_specialized=True)):
        for itemsize in (1, 2):
            assert "max_concurrent_steps >= 2" in mosaic_config_problem(cfg, 512, 256, itemsize, False)
    x, w, offsets = problem(0, [3, 5], 8, 128, 128, jnp.bfloat16)
    one = MosaicGroupedGemmConfig(block_m=128, block_n=64, block_k=64, max_concurrent_steps=1, warp_specialized=True)
    with pytest.raises(NotImplementedError, match=r"max_concurrent_steps >= 2"):
        grouped_gemm_pallas_mosaic_gpu(x, w, offsets, config=one)


@pytest.mark.parametrize("x_layout, w_layout, fast_accum, block_k, split_m", [
    ("per_token_group", "block", False, 128, False), ("per_token_group", "block", False, 256, False),
    ("per_token", "per_channel", False, 128, False), ("per_tensor", "per_expert", True, 128, False),
    ("per_token_group", "block", False, 256, True), ("per_token", "per_channel", False, 128, True),
    ("per_tensor", "per_expert", True, 128, True)])
def test_warp_specialized_fp8_lowers_for_cuda(x_layout, w_layout, fast_accum, block_k, split_m):
    """The warp-specialized FP8 kernel (per-step promotion with both per-step scale kinds, one or two K blocks a
    step, epilogue scales, one accumulator with ``fast_accum``; consumers splitting the CTA tile's columns or rows)
    and a float32 bias lower through Mosaic GPU on the CPU: a Mosaic GPU custom call; two K blocks a step wait for
    the first block's wgmma with one still in flight, and so does the one accumulator (the previous step's)."""
    import dataclasses
    S = jax.ShapeDtypeStruct
    M, K, N, E = 256, 512, 512, 4
    xs = {"per_tensor": S((), jnp.float32), "per_token": S((M, 1), jnp.float32),
          "per_token_group": S((M, K // 128), jnp.float32)}[x_layout]
    ws = {"per_expert": S((E,), jnp.float32), "per_channel": S((E, N), jnp.float32),
          "block": S((E, N // 128, K // 128), jnp.float32)}[w_layout]
    cfg = dataclasses.replace(WS_FP8, fast_accum=fast_accum, block_k=block_k,
                              max_concurrent_steps=2 if block_k == 256 else 4, split_m=split_m)
    f = jax.jit(grouped_gemm_pallas_mosaic_gpu, static_argnames=("config",))
    fp8 = jnp.float8_e4m3fn
    text = f.trace(S((M, K), fp8), S((E, N, K), fp8), S((E + 1,), jnp.int32), x_scale=xs, w_scale=ws,
                   bias=S((E, N), jnp.float32), config=cfg).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert ("wgmma.wait_group.sync.aligned 1" in text) == (block_k == 256 or fast_accum)


@pytest.mark.parametrize("split_m", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_aligned_tiles_lower_for_cuda(monkeypatch, split_m, fp8):
    """``EPMOE_PALLAS_ALIGNED_TILES=1``: the warp-specialized kernel (FP8 blocks or bf16; columns or rows split)
    lowers through Mosaic GPU on the CPU with expert-aligned row tiles (its GPU run: the many-items test)."""
    import dataclasses
    from moe_pallas.ops.common import ALIGNED_TILES_ENV

    monkeypatch.setenv(ALIGNED_TILES_ENV, "1")
    jax.clear_caches()
    S = jax.ShapeDtypeStruct
    M, K, N, E = 203, 512, 512, 4
    f = jax.jit(grouped_gemm_pallas_mosaic_gpu, static_argnames=("config",))
    if fp8:
        cfg = dataclasses.replace(WS_FP8, block_k=256, max_concurrent_steps=2, split_m=split_m)
        fp = jnp.float8_e4m3fn
        traced = f.trace(S((M, K), fp), S((E, N, K), fp), S((E + 1,), jnp.int32), x_scale=S((M, K // 128), jnp.float32),
                         w_scale=S((E, N // 128, K // 128), jnp.float32), config=cfg)
    else:
        cfg = MosaicGroupedGemmConfig(block_m=64, block_n=128, block_k=64, max_concurrent_steps=3,
                                      warp_specialized=True, split_m=split_m)
        traced = f.trace(S((M, K), jnp.bfloat16), S((E, N, K), jnp.bfloat16), S((E + 1,), jnp.int32), config=cfg)
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()
    jax.clear_caches()


def test_heuristic():
    assert mosaic_grouped_gemm_config(256, 4096, 7168, 32, 2) == MosaicGroupedGemmConfig(
        block_m=64, block_n=256, block_k=64, max_concurrent_steps=5, grid_block_n=4)
    assert mosaic_grouped_gemm_config(256, 4096, 7168, 32, 1, per_step_scales=True).block_n == 128
    assert mosaic_grouped_gemm_config(16384, 4096, 7168, 32, 2).block_m == 128
    fp8 = mosaic_grouped_gemm_config(16384, 4096, 7168, 32, 1)  # promoted accumulation: 64 x 128 consumer tiles
    assert (fp8.block_m, fp8.block_n, fp8.block_k, fp8.fast_accum) == (64, 128, 256, False)
    fast = mosaic_grouped_gemm_config(16384, 4096, 7168, 32, 1, fast_accum=True)
    assert (fast.block_m, fast.block_n, fast.block_k, fast.fast_accum) == (128, 128, 128, True)
    assert not mosaic_grouped_gemm_config(256, 4096, 7168, 32, 2, fast_accum=True).fast_accum  # bf16: no such thing
    # FP8 with per-step promotion, >= 256 rows per expert: warp-specialized, consumers splitting the
    # rows of a 128 x 128 CTA tile, two K blocks a step where K % 256 == 0; fewer rows keep the
    # one-warpgroup kernel
    assert fp8.warp_specialized and fp8.split_m and fp8.max_concurrent_steps == 2
    blocks = mosaic_grouped_gemm_config(16384, 4096, 7168, 32, 1, per_step_scales=True)
    assert blocks.warp_specialized and blocks.split_m and (blocks.block_m, blocks.block_n, blocks.block_k) == (64, 128, 256)
    odd_k = mosaic_grouped_gemm_config(16384, 4096, 7296, 32, 1, per_step_scales=True)  # 7296 % 256 != 0
    assert odd_k.split_m and (odd_k.block_k, odd_k.max_concurrent_steps) == (128, 4)
    assert not mosaic_grouped_gemm_config(2048, 4096, 7168, 32, 1, per_step_scales=True).warp_specialized
    assert not fast.warp_specialized


def test_bug_warp_specialized_default_fits_shared_memory_with_float32_outputs():
    """The H200 GPU suite: ``test_bf16_vs_float64[big-k-None]`` (M_cap=640, K=2048, N=512, two experts)
    with ``out_dtype=float32`` took the warp-specialized default of 3 stages and Mosaic refused it at compile time
    ("kernel exceeds available shared memory: smem_bytes=278576 > max_smem_bytes=232448"; the dgrad alike). Its two
    output tiles are float32 there: the default now runs 2 stages, and the rule refuses 3 on the host by name."""
    from moe_pallas.ops.grouped_gemm.config import MOSAIC_MAX_SMEM_BYTES, mosaic_config_problem, ws_smem_bytes

    bf16_out = mosaic_grouped_gemm_config(640, 512, 2048, 2, 2)
    f32_out = mosaic_grouped_gemm_config(640, 512, 2048, 2, 2, out_itemsize=4)
    assert bf16_out.warp_specialized and bf16_out.max_concurrent_steps == 3
    assert f32_out.warp_specialized and f32_out.max_concurrent_steps == 2
    assert ws_smem_bytes(bf16_out, 2, 4) + 48 == 278576  # the bytes Mosaic reported
    assert ws_smem_bytes(f32_out, 2, 4) < MOSAIC_MAX_SMEM_BYTES
    assert mosaic_config_problem(bf16_out, 512, 2048, 2, False, out_itemsize=2) is None
    problem = mosaic_config_problem(bf16_out, 512, 2048, 2, False, out_itemsize=4)
    assert problem and "shared memory" in problem and "4-byte outputs" in problem
    x = jnp.ones((640, 2048), jnp.bfloat16)
    w = jnp.ones((2, 512, 2048), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="shared memory"):
        pallas_mosaic_gpu.check_supported(x, w, None, None, 0, jnp.float32, bf16_out)


def test_shared_memory_limit_is_the_device_specs(monkeypatch):
    """The warp-specialized kernels' shared-memory rule and the heuristics that size their stages read the limit from
    the device spec (``smem_per_block``, read from the device); sm_90's 227 KiB only where no spec is known (the CPU,
    interpret mode) or one reports none. A GPU with 99 KiB a block gets no warp-specialized default its shared memory
    cannot hold, and a config that needs more is refused there by name."""
    from moe_pallas.ops.grouped_gemm.config import (heuristic_mosaic_wgrad_config, mosaic_config_problem,
                                                    mosaic_wgrad_config_problem, ws_smem_budget)

    small = dataclasses.replace(TEST_SPEC, kind="Small GPU", smem_per_block=101376)
    assert ws_smem_budget(None) == ws_smem_budget(TEST_SPEC) == MOSAIC_MAX_SMEM_BYTES - 1024
    assert ws_smem_budget(dataclasses.replace(TEST_SPEC, smem_per_block=0)) == MOSAIC_MAX_SMEM_BYTES - 1024
    assert ws_smem_budget(small) == 101376 - 1024
    for device in (None, TEST_SPEC):  # 16-bit, >= 256 rows per expert: the warp-specialized schedule, 3 stages
        cfg = heuristic_mosaic_grouped_gemm_config(16384, 4096, 7168, 32, 2, device=device)
        assert cfg.warp_specialized and cfg.max_concurrent_steps == 3
        assert mosaic_config_problem(cfg, 4096, 7168, 2, False, device=device) is None
    on_small = heuristic_mosaic_grouped_gemm_config(16384, 4096, 7168, 32, 2, device=small)
    assert not on_small.warp_specialized and mosaic_config_problem(on_small, 4096, 7168, 2, False, device=small) is None
    fp8 = heuristic_mosaic_grouped_gemm_config(16384, 4096, 7168, 32, 1, per_step_scales=True, device=small)
    assert not fp8.warp_specialized
    ws = heuristic_mosaic_grouped_gemm_config(16384, 4096, 7168, 32, 2, device=TEST_SPEC)
    problem = mosaic_config_problem(ws, 4096, 7168, 2, False, device=small)
    assert problem and f"over the {101376 - 1024} a CTA can use on Small GPU (sm90" in problem, problem
    assert mosaic_grouped_gemm_config(16384, 4096, 7168, 32, 2, device=small) == on_small  # no table for it: heuristic
    wgrad = heuristic_mosaic_wgrad_config(16384, 4096, 7168, 32, 2, 2, device=TEST_SPEC)
    assert wgrad.warp_specialized
    assert "shared memory" in mosaic_wgrad_config_problem(wgrad, 4096, 7168, 2, 2, device=small)
    assert not heuristic_mosaic_wgrad_config(16384, 4096, 7168, 32, 2, 2, device=small).warp_specialized
    # the kernel's own check reads this GPU's spec (on the host, at trace time)
    x = jnp.ones((256, 7168), jnp.bfloat16)
    w = jnp.ones((2, 4096, 7168), jnp.bfloat16)
    monkeypatch.setattr(pallas_mosaic_gpu, "gpu_device_spec", lambda: TEST_SPEC)
    pallas_mosaic_gpu.check_supported(x, w, None, None, 0, jnp.bfloat16, ws)
    monkeypatch.setattr(pallas_mosaic_gpu, "gpu_device_spec", lambda: small)
    with pytest.raises(NotImplementedError, match="a CTA can use on Small GPU"):
        pallas_mosaic_gpu.check_supported(x, w, None, None, 0, jnp.bfloat16, ws)


def test_sm_count_is_the_device_specs(monkeypatch):
    """The persistent grid has one program per SM of this GPU, from its device spec; 132 (an H100 / H200 SXM) only
    where there is no spec (no GPU backend) or it reports none."""
    monkeypatch.setattr(pallas_mosaic_gpu, "gpu_device_spec", lambda: dataclasses.replace(TEST_SPEC, sm_count=78))
    assert pallas_mosaic_gpu.num_sms() == 78
    monkeypatch.setattr(pallas_mosaic_gpu, "gpu_device_spec", lambda: dataclasses.replace(TEST_SPEC, sm_count=0))
    assert pallas_mosaic_gpu.num_sms() == pallas_mosaic_gpu.DEFAULT_NUM_SMS == 132
    monkeypatch.setattr(pallas_mosaic_gpu, "gpu_device_spec", lambda: None)
    assert pallas_mosaic_gpu.num_sms() == 132


def test_device_spec_shared_memory_by_capability(caplog):
    """JAX reports no shared memory per block: the spec takes the CUDA programming guide's opt-in maximum of the
    device's compute capability; an unknown capability gets 48 KiB (what every CUDA GPU gives a block) with one
    warning, never a crash."""
    import types

    from moe_pallas.ops import device as jax_device

    expected = {(8, 0): 166912, (8, 6): 101376, (8, 9): 101376, (9, 0): 232448, (10, 0): 232448, (12, 0): 101376}
    for (major, minor), smem in expected.items():
        dev = types.SimpleNamespace(compute_capability=f"{major}.{minor}", device_kind="GPU", core_count=84)
        spec = jax_device.spec_of(dev)
        assert (spec.capability, spec.smem_per_block, spec.sm_count) == ((major, minor), smem, 84)
    jax_device.smem_per_block.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="moe_pallas"):
            future = types.SimpleNamespace(compute_capability="13.7", device_kind="Future GPU", core_count=200)
            assert jax_device.spec_of(future).smem_per_block == jax_device.SMEM_PER_BLOCK_UNKNOWN == 49152
            assert jax_device.spec_of(future).smem_per_block == 49152
        said = [r.getMessage() for r in caplog.records if "13.7" in r.getMessage()]
        assert len(said) == 1 and "SMEM_PER_BLOCK_OPTIN" in said[0], said
    finally:
        jax_device.smem_per_block.cache_clear()
    with pytest.raises(ValueError, match="reports no compute capability"):
        jax_device.spec_of(types.SimpleNamespace(device_kind="cpu", core_count=1))


def _mosaic(block_m, block_n, block_k, steps, snake, fast_accum=False) -> dict:
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, max_concurrent_steps=steps, grid_block_n=snake,
                fast_accum=fast_accum)


def test_tuned_lookup_nearest_m_cap_and_fallbacks(tmp_path, monkeypatch):
    """Same backend, N, K, dtype and (FP8) fast_accum, nearest M_cap in log2; the heuristic where the
    nearest entry breaks a rule of the request (per-step scales: 128 x 128 tiles; per-step
    accumulation: at most 64 x 128; whole N tiles)."""
    bf16_small, bf16_big = _mosaic(64, 256, 64, 5, 4), _mosaic(128, 128, 64, 3, 2)
    fp8_promoted, fp8_fast = _mosaic(64, 128, 128, 4, 2), _mosaic(128, 256, 128, 5, 4, True)
    use_tuned_file(tmp_path, monkeypatch, [
        tuned_entry("pallas_mosaic_gpu", 4096, 7168, 256, "bf16", bf16_small),
        tuned_entry("pallas_mosaic_gpu", 4096, 7168, 16384, "bf16", bf16_big),
        tuned_entry("pallas_mosaic_gpu", 4096, 7168, 2048, "fp8", fp8_promoted, fast_accum=False),
        tuned_entry("pallas_mosaic_gpu", 4096, 7168, 2048, "fp8", fp8_fast, fast_accum=True),
        tuned_entry("pallas_mosaic_gpu", 4160, 7168, 256, "bf16", _mosaic(64, 128, 64, 4, 1)),  # 4160 % 128 != 0
        tuned_entry("pallas_triton", 4096, 7168, 4096, "bf16",  # another backend: never taken
                    dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)),
    ])
    cfg = functools.partial(mosaic_grouped_gemm_config, device=TEST_SPEC)
    heur = heuristic_mosaic_grouped_gemm_config
    assert cfg(300, 4096, 7168, 32, 2) == MosaicGroupedGemmConfig(**bf16_small)
    assert cfg(8192, 4096, 7168, 32, 2) == MosaicGroupedGemmConfig(**bf16_big)
    assert cfg(8192, 4096, 7168, 32, 2, fast_accum=True) == MosaicGroupedGemmConfig(**bf16_big)  # no such thing for bf16
    # FP8: promoted (default) and fast accumulation have their own entries
    assert cfg(256, 4096, 7168, 32, 1) == MosaicGroupedGemmConfig(**fp8_promoted)
    assert cfg(256, 4096, 7168, 32, 1, fast_accum=True) == MosaicGroupedGemmConfig(**fp8_fast)
    # per-step scales: the promoted 64 x 128 x 128 entry fits; the fast 128 x 256 one does not
    assert cfg(256, 4096, 7168, 32, 1, per_step_scales=True) == MosaicGroupedGemmConfig(**fp8_promoted)
    assert cfg(256, 4096, 7168, 32, 1, per_step_scales=True, fast_accum=True) == \
        heur(256, 4096, 7168, 32, 1, per_step_scales=True, fast_accum=True)
    # N % block_n != 0: the heuristic (which halves block_n until it divides)
    assert cfg(256, 4160, 7168, 32, 2) == heur(256, 4160, 7168, 32, 2)
    # nothing for this N / K, no device, no file for the device (another kind; another architecture): the heuristic
    assert cfg(256, 2048, 7168, 32, 2) == heur(256, 2048, 7168, 32, 2)
    assert mosaic_grouped_gemm_config(256, 4096, 7168, 32, 2) == heur(256, 4096, 7168, 32, 2)
    for other in (spec_of_kind("Other GPU"), spec_of_kind(TEST_SPEC.kind, (8, 0))):
        assert mosaic_grouped_gemm_config(256, 4096, 7168, 32, 2, device=other) == heur(256, 4096, 7168, 32, 2)


def test_tuned_lookup_fp8_blocks_takes_its_own_then_the_per_token_entries(tmp_path, monkeypatch):
    """FP8 with 128 x 128 weight blocks (``w_block``): the nearest ``M_cap`` over the ``fp8_block`` and the per-token
    ``fp8`` entries, ``fp8_block`` at equal distance; per-token requests never see ``fp8_block`` entries; an entry
    the request cannot take (a 256-wide K step where K % 256 != 0) falls back to the heuristic."""
    ws = dict(block_m=64, block_n=128, max_concurrent_steps=2, grid_block_n=2, warp_specialized=True)
    two, one = dict(ws, block_k=256), dict(ws, block_k=128, max_concurrent_steps=4)
    N, K = 4096, 7168
    use_tuned_file(tmp_path, monkeypatch, [
        tuned_entry("pallas_mosaic_gpu", N, K, 256, "fp8", one, fast_accum=False),
        tuned_entry("pallas_mosaic_gpu", N, K, 16384, "fp8_block", two, fast_accum=False),
        tuned_entry("pallas_mosaic_gpu", N, K, 2048, "fp8", one, fast_accum=False),
        tuned_entry("pallas_mosaic_gpu", N, K, 2048, "fp8_block", two, fast_accum=False),
    ])
    look = functools.partial(mosaic_grouped_gemm_config, N=N, K=K, E=32, itemsize=1, per_step_scales=True,
                             device=TEST_SPEC)
    assert look(16384, w_block=True) == MosaicGroupedGemmConfig(**two)
    assert look(256, w_block=True) == MosaicGroupedGemmConfig(**one)  # nearest: the per-token entry at 256
    assert look(2048, w_block=True) == MosaicGroupedGemmConfig(**two)  # equal distance: fp8_block first
    assert look(16384) == MosaicGroupedGemmConfig(**one)  # per token: its own entries only (nearest 2048)
    odd = mosaic_grouped_gemm_config(16384, N, K + 128, 32, 1, per_step_scales=True, w_block=True,
                                     device=TEST_SPEC)  # no entry for this K: the heuristic
    assert odd == mosaic_grouped_gemm_config(16384, N, K + 128, 32, 1, per_step_scales=True)
    assert odd.block_k == 128  # K = 7296 is not a multiple of 256: one K block a step


def test_bug_split_m_entry_not_taken_with_few_rows_per_expert(tmp_path, monkeypatch):
    """Regression (H200): the nearest tuned entry (E=32, M_cap=16384: ``split_m``, 128-row CTA tiles) served
    DeepSeek-V3's E=256, M_cap=32768 GEMMs (128 rows per expert): its FP8-block layer went 7.04 -> 7.82 ms. Below
    256 rows per expert the entry's tile is split by columns (64 x 256 CTA tiles), its stages fitting shared memory;
    from 256 on it is taken as it is."""
    split = dict(block_m=64, block_n=128, block_k=256, max_concurrent_steps=3, grid_block_n=4, warp_specialized=True,
                 split_m=True)
    use_tuned_file(tmp_path, monkeypatch, [tuned_entry("pallas_mosaic_gpu", 4096, 7168, 16384, "fp8_block", split,
                                                       fast_accum=False)])
    look = functools.partial(mosaic_grouped_gemm_config, N=4096, K=7168, itemsize=1, per_step_scales=True,
                             w_block=True, device=TEST_SPEC)
    assert look(16384, E=32) == MosaicGroupedGemmConfig(**split)  # 512 rows per expert
    assert look(8192, E=32) == MosaicGroupedGemmConfig(**split)  # 256
    few = look(32768, E=256)  # 128 rows per expert
    assert few == MosaicGroupedGemmConfig(**{**split, "split_m": False, "max_concurrent_steps": 2})
    assert ws_smem_bytes(few, 1, 2) <= MOSAIC_MAX_SMEM_BYTES - 1024


def test_tuned_rule_mirrors_check_supported():
    """``mosaic_config_fits`` accepts exactly the configs ``check_supported`` serves (the config-dependent rules)."""
    from moe_pallas.ops.grouped_gemm.config import mosaic_config_fits
    from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu import check_supported

    kinds = [(None, None), ("per_token", "per_channel"), ("per_token_group", "per_channel"), ("per_token", "block")]
    for dtype, (x_kind, w_kind), bm, bn, fast in itertools.product(
            [jnp.bfloat16, jnp.float8_e4m3fn], kinds, [64, 128], [128, 192, 256], [False, True]):
        if (dtype == jnp.bfloat16) != (x_kind is None):
            continue
        N, K, itemsize = 768, 512, jnp.dtype(dtype).itemsize
        c = MosaicGroupedGemmConfig(block_m=bm, block_n=bn, block_k=128 // itemsize, fast_accum=fast and itemsize == 1)
        per_step_scales = x_kind == "per_token_group" or w_kind == "block"
        try:
            check_supported(jax.ShapeDtypeStruct((256, K), dtype), jax.ShapeDtypeStruct((4, N, K), dtype), x_kind,
                            w_kind, 128, jnp.bfloat16, c)
            served = True
        except NotImplementedError:
            served = False
        assert mosaic_config_fits(c, N, K, itemsize, per_step_scales) == served, (dtype, x_kind, w_kind, c)


def test_kernel_default_config_reads_the_device_spec(tmp_path, monkeypatch):
    """The kernel's default config is looked up with the host-side device spec (``None`` on the CPU)."""
    M, K, N = 136, 384, 256  # shapes of no other test: the jit cache cannot hide a trace
    tuned = _mosaic(128, 128, 64, 3, 2)
    use_tuned_file(tmp_path, monkeypatch, [tuned_entry("pallas_mosaic_gpu", N, K, 128, "bf16", tuned)])
    calls = _spy_config(monkeypatch, pallas_mosaic_gpu, "mosaic_grouped_gemm_config")
    x, w, offsets = problem(7, [40, 60, 20], M, K, N, jnp.bfloat16)
    f = jax.jit(grouped_gemm_pallas_mosaic_gpu)
    f.trace(x, w, offsets)
    expected = None if not ON_GPU else spec_of(jax.devices()[0])
    assert calls[-1]["device"] == expected
    if ON_GPU:
        assert expected.kind == jax.devices()[0].device_kind and expected.sm_count == jax.devices()[0].core_count
    monkeypatch.setattr(pallas_mosaic_gpu, "gpu_device_spec", lambda: TEST_SPEC)
    f.trace(x[:-8], w, offsets)  # another shape: a fresh trace
    assert calls[-1]["device"] == TEST_SPEC
    assert calls[-1]["result"] == MosaicGroupedGemmConfig(**tuned)


def _fp8_problem(seed, counts, m_cap, K, N, x_layout, w_layout):
    x, w, offsets = problem(seed, counts, m_cap, K, N, jnp.float32, poison=False)
    if x_layout == "per_tensor":
        xs = jnp.max(jnp.abs(x)) / 448.0
        xq = (x / xs).astype(jnp.float8_e4m3fn)
    elif x_layout == "per_token":
        xq, xs = moe_pallas.per_token_quant_fp8(x)
    else:
        xq, xs = moe_pallas.per_token_group_quant_fp8(x, 128)
    wq, ws = moe_pallas.quantize_weight_fp8(w, w_layout) if w_layout != "per_expert" else (None, None)
    if w_layout == "per_expert":
        ws = jnp.max(jnp.abs(w), axis=(1, 2)) / 448.0
        wq = (w / ws[:, None, None]).astype(jnp.float8_e4m3fn)
    xq = xq.at[int(offsets[-1]):].set(jnp.nan)  # unused capacity: NaN codes, never read
    return xq, xs, wq, ws, offsets


@pytest.mark.parametrize("x_layout, w_layout", list(itertools.product(
    ["per_tensor", "per_token", "per_token_group"], ["per_expert", "per_channel", "block"])))
def test_fp8_traces(x_layout, w_layout):
    """Every scale combination traces (the kernel body is Python-checked on the CPU too)."""
    xq, xs, wq, ws, offsets = _fp8_problem(1, [70, 0, 130, 9], 256, 256, 256, x_layout, w_layout)
    jaxpr = jax.jit(grouped_gemm_pallas_mosaic_gpu).trace(xq, wq, offsets, x_scale=xs, w_scale=ws).jaxpr
    assert jaxpr is not None


# --------------------------------------------------------------------------------------
# Numerics (GPU)

SHAPES = {
    "one-row": ([1], 1, 128, 128),
    "decode-empties": ([0, 3, 0, 1, 5, 0, 0, 2], 40, 256, 384),  # T*topk with many empty experts + unused capacity
    "straddling": ([100, 28, 0, 257, 64], 600, 512, 256),  # tiles straddling experts, a 257-row expert, tail
    "big-k": ([300, 211], 640, 2048, 512),
}


@gpu_only
@pytest.mark.parametrize("config", [None, MosaicGroupedGemmConfig(block_m=128, block_n=256, block_k=64, max_concurrent_steps=3, grid_block_n=2)])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_bf16_vs_float64(shape, config):
    counts, m_cap, K, N = SHAPES[shape]
    if config is not None and N % config.block_n:
        pytest.skip("N not a multiple of this config's block_n")
    x, w, offsets = problem(len(shape), counts, m_cap, K, N, jnp.bfloat16)
    y = grouped_gemm_pallas_mosaic_gpu(x, w, offsets, config=config)
    assert y.shape == (m_cap, N) and y.dtype == jnp.bfloat16
    check_rows(y, offsets, shape)
    assert_rel_fro(y, f64_loop(x, w, offsets), BF16_REL_FRO, f"{shape} vs float64")
    y32 = grouped_gemm_pallas_mosaic_gpu(x, w, offsets, out_dtype=jnp.float32, config=config)
    assert_rel_fro(y32, f64_loop(x, w, offsets), 1e-5, f"{shape} float32 output vs float64")


@gpu_only
def test_every_empty_expert_pattern_of_six():
    """All 2^6 patterns of empty / non-empty experts (37 rows each when non-empty), one compiled kernel
    (fixed M_cap), unused capacity NaN: each matches the float64 loop and writes zeros past M."""
    E, rows, K, N = 6, 37, 128, 128
    m_cap = E * rows + 13
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((m_cap, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((E, N, K)) / np.sqrt(K), jnp.bfloat16)
    f = jax.jit(grouped_gemm_pallas_mosaic_gpu)
    for pattern in range(2**E):
        counts = [rows if pattern >> e & 1 else 0 for e in range(E)]
        offsets = jnp.asarray(np.concatenate([[0], np.cumsum(counts)]), jnp.int32)
        xp = x.at[int(offsets[-1]):].set(jnp.nan)
        y = f(xp, w, offsets)
        check_rows(y, offsets, f"pattern {pattern:06b}")
        assert_rel_fro(y, f64_loop(xp, w, offsets), BF16_REL_FRO, f"pattern {pattern:06b}")


@gpu_only
@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("x_layout, w_layout", list(itertools.product(
    ["per_tensor", "per_token", "per_token_group"], ["per_expert", "per_channel", "block"])))
def test_fp8_every_scale_layout(x_layout, w_layout, fast_accum):
    """FP8 against the jnp reference on the same codes and scales (float32 dots at full precision:
    XLA's float32 dot on the GPU is TF32 by default). Promoted accumulation (the default) is held to
    1e-3 with a float32 output; ``fast_accum`` (one tensor-core accumulator over K) to the contract's
    FP8 tolerance. Block / group scales always accumulate step by step (fast_accum has no effect)."""
    xq, xs, wq, ws, offsets = _fp8_problem(2, [70, 0, 130, 9, 200], 512, 512, 384, x_layout, w_layout)
    per_step_scales = x_layout == "per_token_group" or w_layout == "block"
    cfg = mosaic_grouped_gemm_config(512, 384, 512, 5, 1, per_step_scales=per_step_scales, fast_accum=fast_accum)
    _check_fp8(xq, xs, wq, ws, offsets, cfg, f"{x_layout} x {w_layout}", fast_accum and not per_step_scales)


def _check_fp8(xq, xs, wq, ws, offsets, cfg, name: str, one_accumulator: bool) -> None:
    """The Mosaic FP8 GEMM with ``cfg`` against the jnp reference on the same codes and scales: bf16 output to the
    contract's FP8 tolerance, float32 output to 1e-3 where K steps are promoted (``one_accumulator``: the
    contract's tolerance), rows past ``offsets[-1]`` zero."""
    y = grouped_gemm_pallas_mosaic_gpu(xq, wq, offsets, x_scale=xs, w_scale=ws, config=cfg)
    check_rows(y, offsets, name)
    with jax.default_matmul_precision("highest"):
        ref = grouped_gemm_reference(xq, wq, offsets, xs, ws, jnp.float32)
    assert_rel_fro(y, ref, FP8_REL_FRO, f"{name} vs reference")
    y32 = grouped_gemm_pallas_mosaic_gpu(xq, wq, offsets, x_scale=xs, w_scale=ws, out_dtype=jnp.float32, config=cfg)
    assert_rel_fro(y32, ref, FP8_REL_FRO if one_accumulator else 1e-3, f"{name} float32 output vs reference")


@gpu_only
@pytest.mark.parametrize("fast_accum, block_k, split_m", [(False, 128, False), (True, 128, False), (False, 256, False),
                                                         (True, 256, False), (False, 256, True), (True, 128, True)])
@pytest.mark.parametrize("x_layout, w_layout", list(itertools.product(
    ["per_tensor", "per_token", "per_token_group"], ["per_expert", "per_channel", "block"])))
def test_fp8_warp_specialized_every_scale_layout(x_layout, w_layout, fast_accum, block_k, split_m):
    """The warp-specialized FP8 schedule (producer + two consumer warpgroups, 64 x 256 CTA tiles, or 128 x 128 with
    ``split_m``; N = 512 = two or four CTA tiles; one or two K blocks a pipeline step): every scale layout against
    the jnp reference, as ``test_fp8_every_scale_layout``; empty experts, unused capacity (NaN codes, written as
    zeros) and tiles straddling experts in one problem."""
    import dataclasses
    xq, xs, wq, ws, offsets = _fp8_problem(5, [70, 0, 130, 9, 200], 512, 512, 512, x_layout, w_layout)
    per_step_scales = x_layout == "per_token_group" or w_layout == "block"
    cfg = dataclasses.replace(WS_FP8, fast_accum=fast_accum, block_k=block_k,
                              max_concurrent_steps=2 if block_k == 256 else 4, split_m=split_m)
    _check_fp8(xq, xs, wq, ws, offsets, cfg, f"ws {x_layout} x {w_layout}", fast_accum and not per_step_scales)


@gpu_only
@pytest.mark.parametrize("split_m", [False, True])
@pytest.mark.parametrize("x_layout, w_layout", [("per_token_group", "block"), ("per_token", "per_channel")])
def test_fp8_warp_specialized_with_bias(x_layout, w_layout, split_m):
    """The warp-specialized FP8 forward with a float32 bias (added after the scales, before the one rounding): the
    reference plus the bias of each row's expert, bf16 and float32 outputs; unused rows stay zero."""
    import dataclasses
    xq, xs, wq, ws, offsets = _fp8_problem(6, [70, 0, 130, 9, 200], 512, 512, 512, x_layout, w_layout)
    bias = jnp.asarray(np.random.default_rng(7).standard_normal((5, 512)), jnp.float32)
    cfg = dataclasses.replace(WS_FP8, block_k=256, max_concurrent_steps=2) if w_layout == "block" else WS_FP8
    cfg = dataclasses.replace(cfg, split_m=split_m)
    with jax.default_matmul_precision("highest"):
        ref = grouped_gemm_reference(xq, wq, offsets, xs, ws, jnp.float32)
    rows = np.arange(512)
    expert = np.searchsorted(np.asarray(offsets), rows, side="right") - 1
    used = rows < int(offsets[-1])
    ref = ref + jnp.where(used[:, None], bias[np.minimum(expert, 4)], 0.0)
    for out_dtype, limit in ((jnp.bfloat16, FP8_REL_FRO), (jnp.float32, 1e-3)):
        y = grouped_gemm_pallas_mosaic_gpu(xq, wq, offsets, x_scale=xs, w_scale=ws, bias=bias, out_dtype=out_dtype,
                                           config=cfg)
        check_rows(y, offsets, f"ws bias {x_layout} x {w_layout}")
        assert_rel_fro(y, ref, limit, f"ws bias {x_layout} x {w_layout} {jnp.dtype(out_dtype).name}")


def test_bug_k0_with_bias_is_the_bias():
    """Regression: K = 0 reached the warp-specialized kernel (a barrier index of -1 with one accumulator)
    and a bias was dropped; now the host returns each used row's expert bias, zeros past offsets[-1], before any
    kernel (so this runs on the CPU too)."""
    import dataclasses
    x = jnp.zeros((5, 0), jnp.bfloat16)
    w = jnp.zeros((2, 128, 0), jnp.bfloat16)
    offsets = jnp.asarray([0, 2, 4], jnp.int32)
    bias = jnp.asarray(np.random.default_rng(3).standard_normal((2, 128)), jnp.float32)
    ws = MosaicGroupedGemmConfig(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2, warp_specialized=True)
    for cfg in (None, ws, dataclasses.replace(ws, split_m=True)):
        y = grouped_gemm_pallas_mosaic_gpu(x, w, offsets, bias=bias, config=cfg)
        expected = np.concatenate([np.repeat(np.asarray(bias[:1]), 2, 0), np.repeat(np.asarray(bias[1:]), 2, 0),
                                   np.zeros((1, 128))]).astype(jnp.bfloat16)
        assert_exact(y, expected, f"K=0 {cfg}: bias[e(m)] for used rows, 0 past offsets[-1]")


@gpu_only
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("split_m", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_warp_specialized_many_items_a_cta_and_an_unaligned_slot_ring(monkeypatch, split_m, fp8, aligned):
    """Regression: the GPU tests had at most one work item a CTA for FP8 and ``k_steps % stages == 0``:
    here 2 CTAs (``num_sms`` patched) walk ~10 items each with K = 640 (5 steps of 128 over 3 stages, or 10 of 64),
    so items start mid-ring and the producer runs into the next item; every row against the reference. With
    ``split_m`` (128-row CTA tiles) the counts leave one consumer's half of an item empty, both halves: expert 2's rows
    70-127 and expert 3's 200-208 (the first half), expert 4's 384-408 (the second): that consumer runs no ``wgmma``
    and only releases the slots. ``aligned``: ``EPMOE_PALLAS_ALIGNED_TILES=1``, expert-aligned row
    tiles starting at rows 64, 200, 208, 408 (experts 2-5's first rows rounded down to 8), tiles reaching past M."""
    import dataclasses
    from moe_pallas.ops.common import ALIGNED_TILES_ENV
    from moe_pallas.ops.grouped_gemm import pallas_mosaic_gpu

    monkeypatch.setenv(ALIGNED_TILES_ENV, "1" if aligned else "0")
    monkeypatch.setattr(pallas_mosaic_gpu, "num_sms", lambda: 2)
    jax.clear_caches()
    counts = [70, 0, 130, 9, 200, 41]
    if fp8:
        xq, xs, wq, ws, offsets = _fp8_problem(8, counts, 512, 640, 512, "per_token_group", "block")
        cfg = dataclasses.replace(WS_FP8, max_concurrent_steps=3, split_m=split_m)
        _check_fp8(xq, xs, wq, ws, offsets, cfg, f"ws 2 CTAs split_m={split_m}", False)
    else:
        x, w, offsets = problem(8, counts, 512, 640, 512, jnp.bfloat16)
        cfg = MosaicGroupedGemmConfig(block_m=64, block_n=128, block_k=64, max_concurrent_steps=3,
                                      warp_specialized=True, split_m=split_m)
        y = grouped_gemm_pallas_mosaic_gpu(x, w, offsets, config=cfg)
        check_rows(y, offsets, f"bf16 ws 2 CTAs split_m={split_m}")
        assert_rel_fro(y, f64_loop(x, w, offsets), BF16_REL_FRO, f"bf16 ws 2 CTAs split_m={split_m}")
    jax.clear_caches()


@gpu_only
def test_row_tile_straddling_two_experts():
    """(2) at Mosaic's tile sizes: 2 experts x 3 rows, w[g] = (g+1) * identity (K=N=128), row i of x
    is i+1: one 64-row tile holds both experts, y[3, :] = 8 and y[i] = (i+1) * (e(i)+1) exactly."""
    x = jnp.asarray(np.repeat(np.arange(1.0, 7.0)[:, None], 128, axis=1), jnp.bfloat16)
    w = jnp.asarray(np.stack([(g + 1) * np.eye(128) for g in range(2)]), jnp.bfloat16)
    y = grouped_gemm_pallas_mosaic_gpu(x, w, jnp.asarray([0, 3, 6], jnp.int32))
    expected = np.arange(1.0, 7.0)[:, None] * np.array([1, 1, 1, 2, 2, 2])[:, None] * np.ones((1, 128))
    assert_exact(y, expected.astype(jnp.bfloat16), "y[i] = (i+1) * (e(i)+1)")
    assert float(y[3, 0]) == 8.0


@gpu_only
def test_dispatch_falls_back_where_mosaic_cannot_serve():
    """N=33 (a width Mosaic GPU cannot tile): Mosaic raises NotImplementedError, the default dispatch logs it
    and runs the Pallas-Triton kernel: y[i, :] = 64 * 2^i exactly."""
    x = jnp.asarray(np.repeat(2.0 ** np.arange(4)[:, None], 64, axis=1), jnp.bfloat16)
    w = jnp.ones((2, 33, 64), jnp.bfloat16)
    y = moe_pallas.grouped_gemm(x, w, jnp.asarray([0, 2, 4], jnp.int32))
    assert_exact(y, np.repeat(64.0 * 2.0 ** np.arange(4)[:, None], 33, axis=1).astype(jnp.bfloat16), "y[i, :] = 64 * 2^i")


@gpu_only
def test_inside_an_outer_jit_and_the_layer():
    """The kernel under an outer jit, and the tiny layer with every GEMM on Mosaic (bf16 and FP8)."""
    cfg = moe_pallas.get_preset("tiny").config()
    rng = np.random.default_rng(3)
    T, H, I, Et = 40, cfg.hidden_size, cfg.intermediate_size, cfg.num_total_experts
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    logits = jnp.asarray(rng.standard_normal((T, cfg.num_experts)), jnp.float32)
    bias = jnp.asarray(0.1 * rng.standard_normal(cfg.num_experts), jnp.float32)
    w13 = jnp.asarray(rng.standard_normal((Et, 2 * I, H)) / np.sqrt(H), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((Et, H, I)) / np.sqrt(I), jnp.bfloat16)
    for quant in ("none", "fp8_per_token", "fp8_block"):
        c = cfg.replace(quant=quant)
        q = moe_pallas.quantize_layer_weights(w13, w2, c)
        fwd = jax.jit(moe_pallas.moe_forward, static_argnames=("config", "implementation"))
        kw = dict(w13_scale=q[1], w2_scale=q[3], e_score_correction_bias=bias)
        out = fwd(x, logits, q[0], q[2], c, implementation="pallas_mosaic_gpu", **kw)
        ref = fwd(x, logits, q[0], q[2], c, implementation="reference", **kw)
        assert np.isfinite(to_numpy(out).astype(np.float32)).all()
        assert_rel_fro(out, ref, BF16_REL_FRO if quant == "none" else FP8_REL_FRO, f"layer {quant}")
