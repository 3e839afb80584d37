"""Pallas-Triton grouped GEMM (``moe_pallas/ops/grouped_gemm/pallas_triton.py``, CONTRACT.md section 4).

Interpret mode on the CPU against the jnp reference and a float64 numpy loop (tolerances of
``tests/tolerances.py``): the shared cases of ``op_cases/grouped_gemm.py`` (``TestGroupedGemmPallasTriton``:
ragged, empty and all-on-one experts, M = 1, odd sizes, unused capacity, float dtypes, every FP8 scale layout,
block scales per K block and per column tile, the named tile-edge cases with exact answers, every empty-expert
pattern of E=6, the grouped launch order, the tuned FP8 block entries, the dispatch), the tile metadata's
invariants, and the CUDA lowering of every supported dtype / scale layout on an abstract H200. Interpret mode fills outputs with NaN before the kernel runs, so a
row the kernel forgets to write fails the finiteness checks.
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
from moe_pallas.ops.grouped_gemm import api as gemm_api
from moe_pallas.ops.grouped_gemm import config as gemm_config
from moe_pallas.ops.grouped_gemm import pallas_triton
from moe_pallas.ops.grouped_gemm.config import GroupedGemmConfig, grouped_gemm_config, heuristic_grouped_gemm_config
from moe_pallas.ops.grouped_gemm.pallas_triton import grouped_gemm_pallas_triton, tile_metadata
from moe_pallas.ops.grouped_gemm.reference import grouped_gemm_reference
from common import JNP_DTYPES, TEST_SPEC, spec_of_kind, write_tuned
from op_cases import JaxArrays
from op_cases.grouped_gemm import GroupedGemmKernelCases, empty_expert_patterns, gemm_problem, numpy_grouped_gemm
from tolerances import BF16_REL_FRO, F32_REL_FRO, assert_exact, assert_rel_fro, to_numpy

def SMALL(cfg) -> bool | None:
    """Blocks under 16 exist for interpret-mode tile-edge tests: interpret them on the GPU too."""
    return True if cfg is not None and min(cfg.block_m, cfg.block_n, cfg.block_k) < 16 else None


f64_loop = numpy_grouped_gemm  # float64, expert by expert (the shared base's)


def check_rows(y, offsets, what: str) -> None:
    """Every row finite (written, no NaN leaked), rows ``>= M`` exactly zero (the Mosaic GPU tests' check)."""
    y32 = to_numpy(y).astype(np.float32)
    M = int(to_numpy(offsets)[-1])
    assert np.isfinite(y32).all(), f"{what}: {np.size(y32) - np.isfinite(y32).sum()} non-finite values"
    assert not y32[M:].any(), f"{what}: rows >= M must be zero"


def problem(seed: int, counts, m_cap: int, K: int, N: int, dtype=jnp.float32, poison: bool = True):
    """The shared base's :func:`gemm_problem` as JAX arrays of ``dtype`` (offsets int32)."""
    x, w, offsets = gemm_problem(seed, counts, m_cap, K, N, poison)
    return jnp.asarray(x).astype(dtype), jnp.asarray(w).astype(dtype), jnp.asarray(offsets)


# --------------------------------------------------------------------------------------
# The shared cases (op_cases/grouped_gemm.py)


class TestGroupedGemmPallasTriton(JaxArrays, GroupedGemmKernelCases):
    """``grouped_gemm_pallas_triton`` against the jnp reference; ``config=None`` goes through
    ``moe_pallas.grouped_gemm(implementation="pallas_triton")`` (the dispatch path and the heuristic config). The FP8
    case has K = 192 (a partial 128-wide weight-scale block) and groups of 64 (so block_k = 64: two K steps per
    scale block); the column-block case runs 16- and 128-wide tiles. The kernel writes zeros to the rows >= M itself
    (the metadata's extra group); interpret mode fills its outputs with NaN first, so :meth:`launch` shows a row it
    forgets. Every empty-expert pattern of E=6 runs through one jit of the kernel (offsets are data): 16-row tiles,
    non-empty expert e gets 1 + e % 4 rows."""

    OPS = moe_pallas
    KERNEL = "pallas_triton"
    KERNEL_ENTRY = (gemm_api, "grouped_gemm_pallas_triton")
    CONFIG = GroupedGemmConfig
    SHAPES = ("one-row", "odd-K-N", "prime-E-empties", "several-tiles")
    FP8_CASE = ([5, 0, 11, 3], 24, 192, 160, 64)
    BLOCK_NS = (16, 128)
    N_TAIL_LAUNCHES = (GroupedGemmConfig(block_m=4, block_n=16, block_k=16),)  # three 16-wide tiles, the last partial
    UNUSED_OUT_DTYPE = None
    UNUSED_CASES = {"float32": ("float32", None, None), "bfloat16": ("bfloat16", None, None)}
    UNUSED_LAUNCHES = (GroupedGemmConfig(block_m=8, block_n=16, block_k=16),)
    EMPTY_PATTERNS = empty_expert_patterns([1 + e % 4 for e in range(6)])
    EMPTY_PATTERN_SHAPE = (24, 32, 16)
    EMPTY_PATTERN_TILES = (16, 16, 16)
    LAUNCH_ORDER_CASES = {f"{n}x{c}-g{g}": (n, c, g) for n, c, g in [(9, 3, 2), (9, 3, 3), (7, 5, 8), (1, 4, 8), (12, 1, 4)]}

    def grouped_gemm(self, x, w, offsets, x_scale=None, w_scale=None, out_dtype=None, config=None):
        out_dtype = None if out_dtype is None else JNP_DTYPES[out_dtype]
        if config is None:
            return moe_pallas.grouped_gemm(x, w, offsets, x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype,
                                           implementation="pallas_triton")
        return grouped_gemm_pallas_triton(x, w, offsets, x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype,
                                          config=config, interpret=SMALL(config))

    def reference_grouped_gemm(self, x, w, offsets, x_scale, w_scale, out_dtype):
        return grouped_gemm_reference(x, w, offsets, x_scale, w_scale, JNP_DTYPES[out_dtype])

    def forced_config(self, block_m, block_n, block_k):
        return GroupedGemmConfig(block_m=block_m, block_n=block_n, block_k=block_k)

    def tile_config(self, block_m, block_n, block_k, launch_order):
        return GroupedGemmConfig(block_m=block_m, block_n=block_n, block_k=block_k)

    def launch(self, x, w, offsets, x_scale, w_scale, out_dtype, config):
        # jitted (static config): the patterns of one test share a compile
        return grouped_gemm_pallas_triton(x, w, offsets, x_scale=x_scale, w_scale=w_scale,
                                          out_dtype=None if out_dtype is None else JNP_DTYPES[out_dtype],
                                          config=config, interpret=SMALL(config))

    def launch_order_table(self, n_items, n_cols, group_m):
        s, j = pallas_triton._launch_order(jnp.arange(n_items * n_cols), n_items, n_cols, group_m)
        order = np.full((n_items, n_cols), -1)
        order[to_numpy(s), to_numpy(j)] = np.arange(n_items * n_cols)
        return order

    def tuned_lookup(self, tmp_path, monkeypatch, entries, requests):
        use_tuned_file(tmp_path, monkeypatch, [tuned_entry("pallas_triton", *e) for e in entries])  # cleared after:
        return [grouped_gemm_config(m, n, k, 32, 1, group, w_block=w_block, device=TEST_SPEC)  # _fresh_tuned_cache
                for m, n, k, group, w_block in requests]


# --------------------------------------------------------------------------------------
# The tile metadata and the grouped launch order (the named tile-edge cases with exact answers: the shared base's)


def test_tile_metadata_of_a_row_tile_straddling_two_experts():
    """The metadata of the shared case ``test_bug_row_tile_straddles_two_experts`` (2 experts x 3 rows, M = M_cap
    = 6, block_m=4): 3 steps own rows [0, 3) (expert 0), [3, 4) and [4, 6) (expert 1); the unused group is empty
    (M == M_cap); the grid bound cdiv(6, 4) + 2 = 4 leaves one padding step."""
    ex, lo, hi = (to_numpy(a) for a in tile_metadata(jnp.asarray([0, 3, 6], jnp.int32), 6, 2, 4))
    assert ex.tolist() == [0, 1, 1, 2] and lo.tolist() == [0, 3, 4, 0] and hi.tolist() == [3, 4, 6, 0]


@pytest.mark.parametrize("group_m", [2, 3, 8])
def test_grouped_launch_order_same_result(group_m):
    """``group_m > 1`` (the 1-D grid in the grouped launch order) computes every (step, column tile) once: the
    same output, bit for bit, as the 2-D grid, with ragged experts (one empty), a row tile straddling two experts,
    unused NaN-poisoned capacity and a column tail (N=40 over 16-wide tiles); 3 does not divide the 9 steps."""
    x, w, offsets = problem(5, [7, 0, 12, 3], 26, 32, 40)
    base = GroupedGemmConfig(block_m=4, block_n=16, block_k=16)
    want = grouped_gemm_pallas_triton(x, w, offsets, config=base, interpret=True)
    got = grouped_gemm_pallas_triton(x, w, offsets, config=GroupedGemmConfig(block_m=4, block_n=16, block_k=16,
                                                                             group_m=group_m), interpret=True)
    assert_exact(got, want, f"group_m={group_m} vs the 2-D grid")
    assert_rel_fro(want, grouped_gemm_reference(x, w, offsets, None, None, jnp.float32), F32_REL_FRO, "vs reference")


def test_group_m_must_be_a_positive_int():
    with pytest.raises(ValueError, match="group_m must be an int >= 1; got group_m=0"):
        GroupedGemmConfig(block_m=16, block_n=16, block_k=16, group_m=0)


@pytest.mark.parametrize("seed", range(4))
def test_tile_metadata_invariants(seed):
    """Every row of [0, M_cap) is owned by exactly one step, with its own expert (E for rows >= M),
    inside one row tile; empty experts get no step; the static bound holds."""
    rng = np.random.default_rng(seed)
    E, block_m = 7, 8
    counts = rng.integers(0, 12, E) * (rng.random(E) < 0.6)
    m_cap = int(counts.sum()) + int(rng.integers(0, 20))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    ex, lo, hi = (to_numpy(a) for a in tile_metadata(jnp.asarray(offsets), m_cap, E, block_m))
    assert ex.shape == (-(-m_cap // block_m) + E,)
    owner = np.full(m_cap, -1)
    for s in range(ex.size):
        if lo[s] == hi[s]:
            continue
        assert lo[s] < hi[s] and lo[s] // block_m == (hi[s] - 1) // block_m, f"step {s} stays in one tile"
        assert (owner[lo[s]:hi[s]] == -1).all(), f"step {s} overlaps another step"
        owner[lo[s]:hi[s]] = ex[s]
    expected = np.searchsorted(offsets[1:], np.arange(m_cap), side="right")  # E for rows >= M
    assert_exact(owner, expected, "owner of each row")
    assert set(ex[lo < hi]) <= {e for e in range(E) if counts[e]} | {E}, "empty experts get no step"


@pytest.mark.parametrize("seed", range(6))
def test_tile_metadata_row_aligned_invariants(seed):
    """``row_align`` (the warp-specialized Mosaic kernel's expert-aligned tiles): every row of [0, M_cap) owned by
    exactly one step with its own expert; a step's rows lie in the tile that starts at ``lo // row_align *
    row_align``; an expert with ``n`` rows from ``s`` takes ``cdiv(n + s % row_align, block_m)`` steps (not one more
    for a tile it shares with its neighbour), worst cases included (every expert starting at ``row_align - 1`` past
    an aligned row); the static bound holds."""
    rng = np.random.default_rng(seed)
    E, block_m, align = int(rng.integers(1, 9)), int(rng.choice([8, 16, 64])), 8
    if seed == 0:  # each group 1 + 8j rows: starts at 7 mod 8 after the first, the bound's worst case
        counts = np.full(E, 9)
    else:
        counts = rng.integers(0, 150, E) * (rng.random(E) < 0.7)
    m_cap = int(counts.sum()) + int(rng.integers(0, 20))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    ex, lo, hi = (to_numpy(a) for a in tile_metadata(jnp.asarray(offsets), m_cap, E, block_m, row_align=align))
    assert ex.shape == (-(-(m_cap + (align - 1) * (E + 1)) // block_m) + E,)
    owner = np.full(m_cap, -1)
    steps = np.zeros(E + 1, int)
    for s in range(ex.size):
        if lo[s] == hi[s]:
            continue
        row0 = lo[s] // align * align
        assert lo[s] < hi[s] <= row0 + block_m, f"step {s} stays in its tile"
        assert (owner[lo[s]:hi[s]] == -1).all(), f"step {s} overlaps another step"
        owner[lo[s]:hi[s]] = ex[s]
        steps[ex[s]] += 1
    expected = np.searchsorted(offsets[1:], np.arange(m_cap), side="right")  # E for rows >= M
    assert_exact(owner, expected, "owner of each row")
    starts = np.concatenate([[0], offsets[1:E]])
    for e in range(E):
        want = -(-(counts[e] + starts[e] % align) // block_m) if counts[e] else 0  # an empty expert: no step
        assert steps[e] == want, f"expert {e}'s steps"


# --------------------------------------------------------------------------------------
# FP8: what this backend does not serve (every scale layout's results: the shared cases)

ACT_SCALES = ["per_tensor", "per_token", "per_token_group"]
WEIGHT_LAYOUTS = ["per_expert", "per_channel", "block"]


def test_fp8_unsupported_combinations_raise():
    """Valid requests this backend does not serve: a NotImplementedError with the reason."""
    x, w, offsets = problem(1, [3, 2], 8, 48, 32, poison=False)
    xq, xs = moe_pallas.per_token_group_quant_fp8(x, 24)  # G = 24: no power-of-two block_k >= 16 divides it
    wq, ws = moe_pallas.quantize_weight_fp8(w, "per_expert")
    with pytest.raises(NotImplementedError, match="block_k to divide the group size"):
        grouped_gemm_pallas_triton(xq, wq, offsets, x_scale=xs, w_scale=ws)
    with pytest.raises(NotImplementedError, match="block_k to divide the group size"):
        moe_pallas.grouped_gemm(xq, wq, offsets, x_scale=xs, w_scale=ws, implementation="pallas_triton")
    # the default order falls back to the reference (with a logged warning), never fails
    assert moe_pallas.grouped_gemm(xq, wq, offsets, x_scale=xs, w_scale=ws).shape == (8, 32)
    wq, ws = moe_pallas.quantize_weight_fp8(w, "block")
    xq, xs = moe_pallas.per_token_quant_fp8(x)
    with pytest.raises(NotImplementedError, match="divide 128"):
        grouped_gemm_pallas_triton(xq, wq, offsets, x_scale=xs, w_scale=ws,
                                   config=GroupedGemmConfig(block_m=16, block_n=256, block_k=16))


# --------------------------------------------------------------------------------------
# API wiring and config


def test_api_dispatch_to_pallas_triton():
    """The API with ``implementation="pallas_triton"`` is the kernel's direct call, bit for bit (the default on the CPU
    is the reference: the shared ``test_dispatch``); M_cap = 0 returns early."""
    x, w, offsets = problem(2, [3, 0, 4], 9, 32, 24, jnp.bfloat16)
    got = moe_pallas.grouped_gemm(x, w, offsets, implementation="pallas_triton")
    assert_exact(got, grouped_gemm_pallas_triton(x, w, offsets), "api vs direct call")
    empty = moe_pallas.grouped_gemm(x[:0], w, offsets, implementation="pallas_triton")  # M_cap = 0: the early return
    assert empty.shape == (0, 24)


def test_config_heuristic_fits_the_scale_layouts():
    cfg = grouped_gemm_config(4096, 4096, 7168, 32, 1, 128)  # fp8, groups of 128
    assert cfg.block_k == 128 and 128 % cfg.block_n == 0 and cfg.block_m >= 16
    assert grouped_gemm_config(1, 33, 64, 8, 2).block_m == 16  # never below a tensor-core tile
    assert grouped_gemm_config(8, 4096, 7168, 8, 2, 64).block_k == 64
    with pytest.raises(ValueError, match="power of two"):
        GroupedGemmConfig(block_m=24, block_n=16, block_k=16)


# --------------------------------------------------------------------------------------
# Tuned configs (moe_pallas.ops.grouped_gemm.tune's JSON): nearest M_cap, fallback where a rule breaks


def use_tuned_file(tmp_path, monkeypatch, entries: list[dict], spec=TEST_SPEC, level: str = "device") -> str:
    """Point the tuned lookup at ``tmp_path`` holding ``entries`` as ``spec``'s device-kind table
    (``sm90/<kind>.json``; ``level="arch"``: the architecture's ``sm90.json``); cache cleared (the autouse fixture
    clears it again when the test ends). Returns the file's path."""
    path = write_tuned(tmp_path, entries, spec, level)
    monkeypatch.setattr(gemm_config, "TUNED_DIR", str(tmp_path))
    gemm_config.tuned_tables.cache_clear()
    return path


@pytest.fixture(autouse=True)
def _fresh_tuned_cache():
    """Every test starts and ends with an empty tuned-file cache (a test's temporary file never leaks)."""
    gemm_config.tuned_tables.cache_clear()
    yield
    gemm_config.tuned_tables.cache_clear()


def tuned_entry(backend: str, N: int, K: int, M_cap: int, dtype: str, config: dict, fast_accum=None) -> dict:
    return {"backend": backend, "device": TEST_SPEC.kind, "E": 32, "N": N, "K": K, "M_cap": M_cap, "dtype": dtype,
            "fast_accum": fast_accum, "config": config, "ms": 1.0, "heuristic_ms": 1.0}


TUNED_A = dict(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)
TUNED_B = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4)
TUNED_FP8 = dict(block_m=64, block_n=256, block_k=128, num_warps=8, num_stages=3)
TUNED_FP8_SMALL = dict(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4)


def test_tuned_lookup_nearest_m_cap_and_fallbacks(tmp_path, monkeypatch):
    use_tuned_file(tmp_path, monkeypatch, [
        tuned_entry("pallas_triton", 4096, 7168, 256, "bf16", TUNED_A),
        tuned_entry("pallas_triton", 4096, 7168, 16384, "bf16", TUNED_B),
        tuned_entry("pallas_triton", 4096, 7168, 2048, "fp8", TUNED_FP8),
        tuned_entry("pallas_triton", 7168, 2048, 256, "fp8", TUNED_FP8_SMALL),
        # another backend's entry for the same problem is never taken
        tuned_entry("pallas_mosaic_gpu", 4096, 7168, 4096, "bf16",
                    dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1, fast_accum=False)),
    ])
    cfg, heur = functools.partial(grouped_gemm_config, device=TEST_SPEC), heuristic_grouped_gemm_config
    assert cfg(256, 4096, 7168, 32, 2) == GroupedGemmConfig(**TUNED_A)
    assert cfg(600, 4096, 7168, 32, 2) == GroupedGemmConfig(**TUNED_A)  # log2(600) = 9.2: nearer 8 than 14
    assert cfg(8192, 4096, 7168, 32, 2) == GroupedGemmConfig(**TUNED_B)
    assert cfg(65536, 4096, 7168, 32, 2) == GroupedGemmConfig(**TUNED_B)
    assert cfg(300, 4096, 7168, 32, 4) == heur(300, 4096, 7168, 32, 4)  # float32: no entries (float16 shares bf16's)
    # FP8: dtype key; per-token-group G=128 fits block_k=128; G=64 does not (heuristic: block_k=64)
    assert cfg(256, 4096, 7168, 32, 1) == GroupedGemmConfig(**TUNED_FP8)
    assert cfg(256, 4096, 7168, 32, 1, 128) == GroupedGemmConfig(**TUNED_FP8)
    assert cfg(256, 4096, 7168, 32, 1, 64) == heur(256, 4096, 7168, 32, 1, 64)
    # 128x128 block weight scales: block_n=256 straddles two scale blocks -> heuristic; 128 fits
    assert cfg(256, 4096, 7168, 32, 1, 128, w_block=True) == heur(256, 4096, 7168, 32, 1, 128)
    assert cfg(256, 7168, 2048, 32, 1, 128, w_block=True) == GroupedGemmConfig(**TUNED_FP8_SMALL)
    # no entry for this N / K, no device (CPU, interpret), a device of another kind (no file of its own, no sm90.json
    # here) or of another architecture: the heuristic
    assert cfg(256, 4096 + 64, 7168, 32, 2) == heur(256, 4096 + 64, 7168, 32, 2)
    assert grouped_gemm_config(256, 4096, 7168, 32, 2) == heur(256, 4096, 7168, 32, 2)
    other = spec_of_kind("Other GPU")
    assert grouped_gemm_config(256, 4096, 7168, 32, 2, device=other) == heur(256, 4096, 7168, 32, 2)
    assert gemm_config.tuned_tables(other).entries() == ()
    sm80 = spec_of_kind(TEST_SPEC.kind, (8, 0))
    assert grouped_gemm_config(256, 4096, 7168, 32, 2, device=sm80) == heur(256, 4096, 7168, 32, 2)
    # the architecture's file (sm90.json) serves every Hopper without a file of its own; never an sm80 device
    use_tuned_file(tmp_path, monkeypatch, [tuned_entry("pallas_triton", 4096, 7168, 256, "bf16", TUNED_A)],
                   level="arch")
    assert grouped_gemm_config(256, 4096, 7168, 32, 2, device=other) == GroupedGemmConfig(**TUNED_A)
    assert cfg(256, 4096, 7168, 32, 2) == GroupedGemmConfig(**TUNED_A)
    assert cfg(16384, 4096, 7168, 32, 2) == GroupedGemmConfig(**TUNED_B)  # its own file first, where it has the shape
    assert grouped_gemm_config(256, 4096, 7168, 32, 2, device=sm80) == heur(256, 4096, 7168, 32, 2)


def test_tuned_lookup_without_a_file_is_the_heuristic(tmp_path, monkeypatch):
    monkeypatch.setattr(gemm_config, "TUNED_DIR", str(tmp_path / "missing"))
    gemm_config.tuned_tables.cache_clear()
    for args in [(256, 4096, 7168, 32, 2), (16384, 7168, 2048, 32, 1, 128), (1, 33, 64, 8, 2)]:
        assert grouped_gemm_config(*args, device=spec_of_kind("NVIDIA H200")) == heuristic_grouped_gemm_config(*args)
    if jax.default_backend() == "cpu":  # the CPU: the kernels never look anything up
        assert gemm_config.gpu_device_spec() is None
    else:  # a GPU: its spec, and without the file the lookup is still the heuristic
        spec = gemm_config.gpu_device_spec()
        assert isinstance(spec.kind, str) and spec.kind and spec.sm_count > 0
        assert (grouped_gemm_config(256, 4096, 7168, 32, 2, device=spec)
                == heuristic_grouped_gemm_config(256, 4096, 7168, 32, 2))


def _spy_config(monkeypatch, module, name: str) -> list[dict]:
    """Record the keyword arguments and result of every ``module.<name>`` call (the kernels' config lookup)."""
    calls, real = [], getattr(module, name)

    def spy(*args, **kw):
        cfg = real(*args, **kw)
        calls.append(dict(kw, result=cfg))
        return cfg

    monkeypatch.setattr(module, name, spy)
    return calls


def test_kernel_default_config_uses_tuned_only_off_interpret_mode(tmp_path, monkeypatch):
    """Interpret mode (the CPU) never looks up a tuned config, even when a device spec is known; the
    GPU path (lowered for CUDA here) passes the host-side device spec and gets the tuned config."""
    M, K, N, E = 72, 256, 192, 4  # shapes of no other test: the jit cache cannot hide a trace
    use_tuned_file(tmp_path, monkeypatch, [tuned_entry("pallas_triton", N, K, 64, "bf16", TUNED_A)])
    monkeypatch.setattr(pallas_triton, "gpu_device_spec", lambda: TEST_SPEC)
    calls = _spy_config(monkeypatch, pallas_triton, "grouped_gemm_config")
    x, w, offsets = problem(5, [30, 0, 20, 10], M, K, N, jnp.bfloat16)
    y = pallas_triton.grouped_gemm_pallas_triton(x, w, offsets, interpret=True)
    assert calls[-1]["device"] is None and calls[-1]["result"] == heuristic_grouped_gemm_config(M, N, K, E, 2)
    assert_rel_fro(y, f64_loop(x, w, offsets), BF16_REL_FRO, "interpret mode, default config")
    f = functools.partial(pallas_triton.grouped_gemm_pallas_triton, interpret=False)
    text = _lower_for_cuda(f, S((M, K), jnp.bfloat16), S((E, N, K), jnp.bfloat16), S((E + 1,), jnp.int32))
    assert calls[-1]["device"] == TEST_SPEC and calls[-1]["result"] == GroupedGemmConfig(**TUNED_A)
    assert text.count(TRITON_CALL) == 1


# --------------------------------------------------------------------------------------
# GPU lowering on the CPU: the kernel must lower for CUDA (Triton), not only interpret.

H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "cuda"))
TRITON_CALL = "__gpu$xla.gpu.triton"
S = jax.ShapeDtypeStruct


def _lower_for_cuda(f, *args) -> str:
    with use_abstract_mesh(H200):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_lowers_for_cuda_float(dtype):
    M, K, N, E = 200, 7168, 4096 + 64, 32  # DeepSeek-V3-like K, N with a partial tile
    f = functools.partial(grouped_gemm_pallas_triton, interpret=False)
    text = _lower_for_cuda(f, S((M, K), dtype), S((E, N, K), dtype), S((E + 1,), jnp.int32))
    assert text.count(TRITON_CALL) == 1, text[:2000]


@pytest.mark.parametrize("act,layout", list(itertools.product(ACT_SCALES, WEIGHT_LAYOUTS)))
def test_lowers_for_cuda_fp8(act, layout):
    M, K, N, E = 200, 7168, 4096 + 64, 32
    xs = {"per_tensor": S((), jnp.float32), "per_token": S((M, 1), jnp.float32),
          "per_token_group": S((M, K // 128), jnp.float32)}[act]
    ws = {"per_expert": S((E,), jnp.float32), "per_channel": S((E, N), jnp.float32),
          "block": S((E, -(-N // 128), K // 128), jnp.float32)}[layout]

    def f(x, w, offsets, x_scale, w_scale):
        return grouped_gemm_pallas_triton(x, w, offsets, x_scale=x_scale, w_scale=w_scale, interpret=False)

    text = _lower_for_cuda(f, S((M, K), jnp.float8_e4m3fn), S((E, N, K), jnp.float8_e4m3fn), S((E + 1,), jnp.int32), xs, ws)
    assert text.count(TRITON_CALL) == 1, text[:2000]


def test_small_blocks_are_interpret_only():
    f = functools.partial(grouped_gemm_pallas_triton, interpret=False, config=GroupedGemmConfig(block_m=4, block_n=16, block_k=16))
    with pytest.raises(NotImplementedError, match="dot block must be >= 16"):
        _lower_for_cuda(f, S((8, 32), jnp.bfloat16), S((2, 16, 32), jnp.bfloat16), S((3,), jnp.int32))


# --- Bug seen on the H200: 32-bit pointer offsets into an FP8 array of >= 2**31 elements ---------


def _triton_ir(kernel, out_shape, *arg_shapes, **compiler_params) -> list[str]:
    """The Triton IR lines of a one-kernel ``pallas_call`` lowered for CUDA here (abstract shapes: nothing
    is allocated; ``debug=True`` prints the IR)."""
    import contextlib
    import io

    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    params = plgpu.CompilerParams(**compiler_params) if compiler_params else None

    def f(*args):
        return pl.pallas_call(kernel, out_shape=out_shape, debug=True, compiler_params=params)(*args)

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        _lower_for_cuda(f, *arg_shapes)
    return buf.getvalue().splitlines()


def _addptr_offset_types(w_shape, dtype) -> set[str]:
    """The offset types of the ``tt.addptr`` that loads from ``w`` in a one-load kernel."""
    import re

    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def kernel(w_ref, e_ref, o_ref):
        o_ref[...] = plgpu.load(w_ref.at[e_ref[0], pl.ds(0, 16), pl.ds(0, 32)]).astype(jnp.float32)

    lines = _triton_ir(kernel, S((16, 32), jnp.float32), S(w_shape, dtype), S((1,), jnp.int32), num_warps=4)
    loads = [l for l in lines if "tt.addptr" in l and "masked_load" in l]
    return {m for l in loads for m in re.findall(r"tensor<16x32x(i\d+)>", l)}


def test_bug_fp8_w2_of_deepseek_v3_size_gets_64bit_offsets():
    """DeepSeek-V3's FP8 ``w2 [257, 7168, 2048]`` (3.77G elements, 3.5 GiB) made the Pallas-Triton GEMM
    read outside the buffer on the H200 (CUDA_ERROR_ILLEGAL_ADDRESS in ``epmoe check --preset deepseek-v3
    --quant fp8_block``): jax 0.11's lowering went 64-bit only above 4 GiB, while its signed offsets count
    elements. With ``moe_pallas.ops.common.patch_pallas_triton_offsets`` (applied on import) the load's
    offsets are i64; arrays under 2**31 elements keep i32 (no cost where none is needed)."""
    from moe_pallas.ops import common

    assert common._OFFSETS_PATCHED
    assert _addptr_offset_types((257, 7168, 2048), jnp.float8_e4m3fn) == {"i64"}
    assert _addptr_offset_types((4, 7168, 2048), jnp.float8_e4m3fn) == {"i32"}
    assert common._needs_wide_offsets((257, 7168, 2048), jnp.float8_e4m3fn)
    assert not common._needs_wide_offsets((257, 4096, 7168), jnp.float8_e4m3fn)  # > 4 GiB: jax's own 64-bit path
    assert not common._needs_wide_offsets((257, 7168, 2048), jnp.bfloat16)
    assert common._needs_wide_offsets((2**31,), jnp.int8) and not common._needs_wide_offsets((2**31 - 1,), jnp.int8)


def test_without_the_offsets_patch_such_weights_go_to_another_backend(monkeypatch):
    """Where the patch cannot apply (another jax), the Pallas-Triton GEMM refuses such an FP8 ``w`` with
    NotImplementedError (dispatch then tries the next backend) instead of reading out of bounds."""
    from moe_pallas.ops import common

    monkeypatch.setattr(common, "_OFFSETS_PATCHED", False)
    M, K, N, E = 64, 2048, 7168, 257
    f = functools.partial(grouped_gemm_pallas_triton, interpret=False)
    with pytest.raises(NotImplementedError, match=r"grouped_gemm_pallas_triton: w \(257, 7168, 2048\) float8_e4m3fn has >= 2\*\*31"):
        _lower_for_cuda(lambda x, w, o, xs, ws: f(x, w, o, x_scale=xs, w_scale=ws),
                        S((M, K), jnp.float8_e4m3fn), S((E, N, K), jnp.float8_e4m3fn), S((E + 1,), jnp.int32),
                        S((M, 1), jnp.float32), S((E, N), jnp.float32))


def _dot_lines(dtype, k: int = 128) -> list[str]:
    """The ``tt.dot`` lines of a one-dot kernel over ``K = k`` (a fresh kernel each call)."""

    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = jax.lax.dot_general(a_ref[...], b_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    return [l for l in _triton_ir(kernel, S((64, 128), jnp.float32), S((64, k), dtype), S((128, k), dtype)) if "tt.dot" in l]


def test_fp8_dots_get_max_num_imprecise_acc_when_switched_on(monkeypatch):
    """By default FP8 x FP8 dots carry maxNumImpreciseAcc = min(K, 128) (Triton then uses FP8 wgmma,
    promoted every 128 K, instead of converting to f16 for mma.sync); EPMOE_PALLAS_FP8_WGMMA=0 turns
    that off; bf16 dots never change."""
    from moe_pallas.ops import common

    assert common._FP8_DOTS_PATCHED
    monkeypatch.delenv(common.FP8_WGMMA_ENV, raising=False)
    (line,) = _dot_lines(jnp.float8_e4m3fn)
    assert "maxNumImpreciseAcc = 128 : i32" in line
    (line,) = _dot_lines(jnp.float8_e4m3fn, k=256)  # one dot over K=256: still promoted every 128
    assert "maxNumImpreciseAcc = 128 : i32" in line
    (line,) = _dot_lines(jnp.float8_e4m3fn, k=64)
    assert "maxNumImpreciseAcc = 64 : i32" in line
    monkeypatch.setenv(common.FP8_WGMMA_ENV, "0")
    (line,) = _dot_lines(jnp.float8_e4m3fn)
    assert "maxNumImpreciseAcc" not in line
    monkeypatch.setenv(common.FP8_WGMMA_ENV, "1")
    (line,) = _dot_lines(jnp.float8_e4m3fn)
    assert "maxNumImpreciseAcc = 128 : i32" in line
    (line,) = _dot_lines(jnp.bfloat16)
    assert "maxNumImpreciseAcc" not in line
    for off in ("false", " Off ", "NO"):
        monkeypatch.setenv(common.FP8_WGMMA_ENV, off)
        assert common.fp8_wgmma_enabled() is False
    for on in ("", "TRUE", "yes", " on"):
        monkeypatch.setenv(common.FP8_WGMMA_ENV, on)
        assert common.fp8_wgmma_enabled() is True
    monkeypatch.setenv(common.FP8_WGMMA_ENV, "maybe")
    with pytest.raises(ValueError, match=r"EPMOE_PALLAS_FP8_WGMMA must be one of .*got EPMOE_PALLAS_FP8_WGMMA='maybe'"):
        common.fp8_wgmma_enabled()


def test_tile_metadata_has_no_loop():
    """``tile_metadata`` maps steps to groups with one fused comparison, not a binary-search ``while`` loop (a few
    kernel launches an iteration on the GPU, twice a layer forward: an HLO read of the H200 layer)."""
    from moe_pallas.ops.grouped_gemm.pallas_triton import tile_metadata

    text = jax.jit(tile_metadata, static_argnums=(1, 2, 3)).trace(
        jax.ShapeDtypeStruct((33,), jnp.int32), 32768, 32, 128).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.while" not in text


def test_bug_k0_with_bias_is_the_bias():
    """Regression: with K = 0 (a sum of no terms) and a bias, the kernel returned zeros where the contract
    (and the default implementation) gives each used row its expert's bias; rows past offsets[-1] stay zero."""
    x = jnp.zeros((5, 0), jnp.bfloat16)
    w = jnp.zeros((2, 8, 0), jnp.bfloat16)
    offsets = jnp.asarray([0, 2, 4], jnp.int32)
    bias = jnp.arange(16, dtype=jnp.float32).reshape(2, 8) - 3.5
    y = grouped_gemm_pallas_triton(x, w, offsets, bias=bias)
    expected = np.concatenate([np.repeat(np.asarray(bias[:1]), 2, 0), np.repeat(np.asarray(bias[1:]), 2, 0),
                               np.zeros((1, 8))]).astype(jnp.bfloat16)
    assert_exact(y, expected, "K=0: bias[e(m)] for used rows, 0 past offsets[-1]")
    assert_exact(grouped_gemm_pallas_triton(x, w, offsets), np.zeros((5, 8), jnp.bfloat16), "K=0 without a bias")
