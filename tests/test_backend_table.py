"""The grouped GEMMs' default backend on a GPU (``moe_pallas/ops/grouped_gemm/backend_table.py``) and its writer
(``moe_pallas/ops/grouped_gemm/tune_backend.py``).

The GPU lookup runs on the CPU here: ``backend_table.on_gpu`` and ``backend_table.gpu_device_spec`` are patched (a
simulated Hopper, ``common.TEST_SPEC``), the table is a temporary device-kind file ``sm90/<kind>.json``
(``common.write_tuned``; ``config.TUNED_DIR`` patched), and the backends ``api.py``'s
dispatch calls are replaced by spies that record their name and return the reference's result, so the order
``implementation=None`` tries is observed directly (no kernel runs; fast).
"""

from __future__ import annotations

import json
import logging
import os

import jax
import jax.numpy as jnp
import pytest

import moe_pallas
from moe_pallas.ops.dispatch import GPU_ORDER
from moe_pallas.ops.grouped_gemm import api as gemm_api
from moe_pallas.ops.grouped_gemm import backend_table
from moe_pallas.ops.grouped_gemm import config as gemm_config
from moe_pallas.ops.grouped_gemm.reference import grouped_gemm_reference
from common import TEST_SPEC, spec_of_kind, write_tuned
from moe_pallas.ops.grouped_gemm import tune_backend
from tolerances import assert_exact

KIND = TEST_SPEC.kind
TRITON_FIRST = ("pallas_triton", "pallas_mosaic_gpu", "reference")


@pytest.fixture(autouse=True)
def _fresh_tuned_cache():
    """The tuned-file cache is cleared before and after each test (a temporary table never leaks)."""
    gemm_config.tuned_tables.cache_clear()
    yield
    gemm_config.tuned_tables.cache_clear()


def choice(backend: str, N: int, K: int, M_cap: int, layout: str = "bf16", op: str = "grouped_gemm", **ms) -> dict:
    """A backend-choice entry; ``ms`` defaults to the chosen backend 1.0 ms, the other 2.0 ms."""
    other = next(b for b in backend_table.KERNEL_BACKENDS if b != backend)
    return {"kind": "backend_choice", "op": op, "layout": layout, "E": 4, "N": N, "K": K, "M_cap": M_cap,
            "backend": backend, "ms": ms or {backend: 1.0, other: 2.0}, "source": "test", "date": "2026-12-02",
            "command": "pytest"}


def use_table(tmp_path, monkeypatch, entries: list[dict], *, gpu: bool = True) -> str:
    """The device looks like the GPU TEST_SPEC whose table is ``entries`` (a temporary device-kind file); returns its
    path."""
    path = write_tuned(tmp_path, entries)
    monkeypatch.setattr(gemm_config, "TUNED_DIR", str(tmp_path))
    monkeypatch.setattr(backend_table, "on_gpu", lambda: gpu)
    monkeypatch.setattr(backend_table, "gpu_device_spec", lambda: TEST_SPEC)
    gemm_config.tuned_tables.cache_clear()
    return path


def spy_backends(monkeypatch, refuse: tuple[str, ...] = ()) -> list[str]:
    """Replace the forward's three backends in ``api.py`` by spies: each appends its name to the returned list,
    then raises NotImplementedError (those in ``refuse``) or returns the reference's result."""
    calls: list[str] = []

    def make(name):
        def spy(x, w, offsets, *args, **kwargs):
            calls.append(name)
            if name in refuse:
                raise NotImplementedError(f"grouped_gemm[{name}]: refused by the test")
            if name == "pallas_mosaic_gpu":  # _mosaic(x, w, offsets, x_scale, w_scale, out_dtype, bias)
                xs, ws, out_dtype = args[:3]
                return grouped_gemm_reference(x, w, offsets, xs, ws, out_dtype)
            if name == "pallas_triton":  # grouped_gemm_pallas_triton(x, w, offsets, x_scale=, w_scale=, out_dtype=)
                return grouped_gemm_reference(x, w, offsets, kwargs["x_scale"], kwargs["w_scale"], kwargs["out_dtype"])
            return grouped_gemm_reference(x, w, offsets, *args, **kwargs)
        return spy

    monkeypatch.setattr(gemm_api, "_mosaic", make("pallas_mosaic_gpu"))
    monkeypatch.setattr(gemm_api, "grouped_gemm_pallas_triton", make("pallas_triton"))
    monkeypatch.setattr(gemm_api, "grouped_gemm_reference", make("reference"))
    return calls


def bf16_problem(M=24, N=16, K=32, E=4, seed=0):
    """Random bf16 ``x [M, K]``, ``w [E, N, K]`` (scaled by 1/sqrt(K)) and offsets with an empty expert."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (M, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(k2, (E, N, K), jnp.float32) * K**-0.5).astype(jnp.bfloat16)
    offsets = jnp.array([0, 7, 7, 20, M - 2][: E + 1], jnp.int32)  # expert 1 empty, 2 rows past the end
    return x, w, offsets


def fp8_block_problem(M=8, N=16, K=256, E=2, seed=1):
    """Random FP8 codes with 1x128 activation-group scales ``[M, K/128]`` and 128x128 weight-block scales."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k1, (M, K), jnp.float32).astype(jnp.float8_e4m3fn)
    w = jax.random.normal(k2, (E, N, K), jnp.float32).astype(jnp.float8_e4m3fn)
    xs = jax.random.uniform(k3, (M, K // 128), jnp.float32, 0.01, 0.1)
    ws = jax.random.uniform(k4, (E, 1, K // 128), jnp.float32, 0.01, 0.1)
    return x, w, jnp.array([0, 3, M], jnp.int32), xs, ws


# ------------------------------------------------------------------------------------------------ lookup


def test_table_winner_runs_first(tmp_path, monkeypatch):
    """implementation=None on a GPU runs the table's choice for this op, layout, N and K: Pallas-Triton (which the
    heuristic order puts second for bf16), then with the table flipped, Mosaic GPU; the result is the backend's."""
    x, w, offsets = bf16_problem()
    use_table(tmp_path, monkeypatch, [choice("pallas_triton", N=16, K=32, M_cap=24)])
    calls = spy_backends(monkeypatch)
    y = moe_pallas.grouped_gemm(x, w, offsets)
    assert calls == ["pallas_triton"]
    assert_exact(y, grouped_gemm_reference(x, w, offsets, None, None, jnp.bfloat16))
    assert backend_table.default_order("grouped_gemm", "bf16", M_cap=24, N=16, K=32) == TRITON_FIRST

    use_table(tmp_path, monkeypatch, [choice("pallas_mosaic_gpu", N=16, K=32, M_cap=24)])
    calls = spy_backends(monkeypatch)
    moe_pallas.grouped_gemm(x, w, offsets)
    assert calls == ["pallas_mosaic_gpu"]


def test_nearest_m_cap_in_log2_and_exact_keys(tmp_path, monkeypatch):
    """The entry of the same op/layout/N/K with the nearest M_cap in log2 (ties: the first stored); another N, K,
    layout or op never matches; E is recorded, not matched."""
    use_table(tmp_path, monkeypatch, [
        choice("pallas_mosaic_gpu", N=4096, K=7168, M_cap=256),
        choice("pallas_triton", N=4096, K=7168, M_cap=16384),
        choice("pallas_triton", N=7168, K=2048, M_cap=512),  # another shape
        choice("pallas_triton", N=4096, K=7168, M_cap=512, layout="fp8_per_token"),  # another layout
        choice("pallas_triton", N=4096, K=7168, M_cap=512, op="grouped_gemm_dgrad"),  # another op
    ])
    nearest = backend_table.nearest_backend_choice
    assert nearest(TEST_SPEC, "grouped_gemm", "bf16", 1, 4096, 7168)["M_cap"] == 256
    assert nearest(TEST_SPEC, "grouped_gemm", "bf16", 1024, 4096, 7168)["M_cap"] == 256  # log2 distance 2 vs 4
    assert nearest(TEST_SPEC, "grouped_gemm", "bf16", 4096, 4096, 7168)["M_cap"] == 16384  # 2 vs 4
    assert nearest(TEST_SPEC, "grouped_gemm", "bf16", 2048, 4096, 7168)["M_cap"] == 256  # 3 vs 3: the first stored
    assert nearest(TEST_SPEC, "grouped_gemm", "bf16", 10**6, 4096, 7168)["M_cap"] == 16384
    order = lambda M, **kw: backend_table.default_order("grouped_gemm", kw.get("layout", "bf16"), M_cap=M,  # noqa: E731
                                                        N=kw.get("N", 4096), K=kw.get("K", 7168))
    assert order(300) == GPU_ORDER and order(9000) == TRITON_FIRST
    assert order(300, N=7168, K=2048) == TRITON_FIRST and order(300, N=7168, K=7168) == GPU_ORDER
    assert backend_table.default_order("grouped_gemm_dgrad", "bf16", M_cap=300, N=4096, K=7168) == TRITON_FIRST
    assert backend_table.default_order("grouped_gemm_wgrad", "bf16", M_cap=300, N=4096, K=7168) == GPU_ORDER
    assert nearest(None, "grouped_gemm", "bf16", 256, 4096, 7168) is None  # no device: no table


def test_no_entry_or_no_file_is_the_heuristic(tmp_path, monkeypatch):
    """Without an entry of the op/layout/N/K, or without a file for the device (another kind, another architecture), the
    order is the heuristic's (bf16: Mosaic GPU first, as before the table); off a GPU it is the reference."""
    use_table(tmp_path, monkeypatch, [choice("pallas_triton", N=64, K=64, M_cap=24)])
    x, w, offsets = bf16_problem()
    calls = spy_backends(monkeypatch)
    moe_pallas.grouped_gemm(x, w, offsets)
    assert calls == ["pallas_mosaic_gpu"]
    monkeypatch.setattr(backend_table, "gpu_device_spec", lambda: spec_of_kind("GPU without a table"))
    assert backend_table.default_order("grouped_gemm", "bf16", M_cap=24, N=64, K=64) == GPU_ORDER
    # an sm80 GPU reads no sm90 table, and Mosaic GPU (sm_90 only) is not tried there
    monkeypatch.setattr(backend_table, "gpu_device_spec", lambda: spec_of_kind(KIND, (8, 0)))
    assert backend_table.default_order("grouped_gemm", "bf16", M_cap=24, N=64, K=64) == ("pallas_triton", "reference")
    monkeypatch.setattr(backend_table, "on_gpu", lambda: False)
    assert backend_table.default_order("grouped_gemm", "bf16", M_cap=24, N=64, K=64) == ("reference",)


def test_heuristic_order_is_mosaic_first_on_every_layout(tmp_path, monkeypatch):
    """With no table entry on an sm_90 GPU, every layout (FP8 128x128 blocks included: the warp-specialized Mosaic FP8
    kernel is the faster one on sm_90) tries Mosaic GPU first, so a Hopper GPU without its own table does not fall to
    Pallas-Triton's slower FP8-block kernel."""
    use_table(tmp_path, monkeypatch, [])
    x, w, offsets, xs, ws = fp8_block_problem()
    calls = spy_backends(monkeypatch)
    y = moe_pallas.grouped_gemm(x, w, offsets, x_scale=xs, w_scale=ws)
    assert calls == ["pallas_mosaic_gpu"]
    assert_exact(y, grouped_gemm_reference(x, w, offsets, xs, ws, jnp.bfloat16))
    for layout in ("fp8_block", "bf16", "fp8_per_token", "fp8_per_token_group", "bf16_mxfp4"):
        assert backend_table.heuristic_order("grouped_gemm", layout) == GPU_ORDER
    assert backend_table.heuristic_order("grouped_gemm_dgrad", "bf16_fp8_block") == GPU_ORDER


def test_layout_from_the_scales_shapes():
    """The layout key is derived from x's dtype and the scales' shapes, as the kernels read them."""
    M, K, N, E = 8, 256, 16, 2
    f8 = jnp.float8_e4m3fn
    x8, xb = jnp.ones((M, K), f8), jnp.ones((M, K), jnp.bfloat16)
    layout = backend_table.gemm_layout
    assert layout(xb, None, None, None) == "bf16"
    assert layout(jnp.ones((M, K), jnp.float32), None, None, None) == "f32"
    assert layout(jnp.ones((M, K), jnp.float16), None, None, None) == "f16"
    assert layout(x8, jnp.ones((M, 1)), jnp.ones((E, N)), None) == "fp8_per_token"
    assert layout(x8, jnp.ones((M, 1)), jnp.ones((E,)), None) == "fp8_per_token"
    assert layout(x8, jnp.ones(()), jnp.ones((E,)), None) == "fp8_per_tensor"
    assert layout(x8, jnp.ones((M, 2)), jnp.ones((E, N)), None) == "fp8_per_token_group"
    assert layout(x8, jnp.ones((M, 2)), jnp.ones((E, 1, 2)), None) == "fp8_block"
    assert layout(x8, jnp.ones((M, 1)), jnp.ones((E, 1, 2)), None) == "fp8_block"
    assert layout(xb, None, jnp.ones((E, N, K // 32), jnp.uint8), "mxfp4") == "bf16_mxfp4"
    assert backend_table.dgrad_layout(xb, None) == "bf16"
    assert backend_table.dgrad_layout(xb, jnp.ones((E, 1, 2))) == "bf16_fp8_block"
    assert backend_table.dgrad_layout(xb, jnp.ones((E, N))) == "bf16_fp8_per_channel"
    assert backend_table.wgrad_layout(xb) == "bf16"


def test_winner_that_cannot_serve_falls_through_with_a_warning(tmp_path, monkeypatch, caplog):
    """The table's choice raising NotImplementedError falls through the rest of the heuristic order, each step
    logged: Pallas-Triton (the table's) -> Mosaic GPU (refuses too) -> the reference."""
    x, w, offsets = bf16_problem()
    use_table(tmp_path, monkeypatch, [choice("pallas_triton", N=16, K=32, M_cap=24)])
    calls = spy_backends(monkeypatch, refuse=("pallas_triton", "pallas_mosaic_gpu"))
    with caplog.at_level(logging.WARNING, logger="moe_pallas"):
        y = moe_pallas.grouped_gemm(x, w, offsets)
    assert calls == ["pallas_triton", "pallas_mosaic_gpu", "reference"]
    assert_exact(y, grouped_gemm_reference(x, w, offsets, None, None, jnp.bfloat16))
    msgs = [r.getMessage() for r in caplog.records]
    assert any("grouped_gemm: backend 'pallas_triton' cannot serve this request" in m
               and "trying 'pallas_mosaic_gpu'" in m for m in msgs), msgs
    assert any("backend 'pallas_mosaic_gpu' cannot serve" in m and "trying 'reference'" in m for m in msgs), msgs


def test_explicit_implementation_reads_no_table(tmp_path, monkeypatch):
    """An explicit implementation runs that backend only: even a malformed table is not read."""
    use_table(tmp_path, monkeypatch, [{"kind": "backend_choice", "op": "grouped_gemm"}])
    x, w, offsets = bf16_problem()
    calls = spy_backends(monkeypatch)
    moe_pallas.grouped_gemm(x, w, offsets, implementation="pallas_triton")
    assert calls == ["pallas_triton"]


def test_backward_ops_take_their_own_entries(tmp_path, monkeypatch):
    """dgrad and wgrad look up their own op's entries (the forward's do not apply), by the forward's N and K."""
    M, N, K, E = 24, 16, 32, 4
    use_table(tmp_path, monkeypatch, [choice("pallas_triton", N=N, K=K, M_cap=M, op="grouped_gemm_dgrad"),
                                      choice("pallas_triton", N=N, K=K, M_cap=M, op="grouped_gemm_wgrad")])
    seen = []
    monkeypatch.setattr(gemm_api, "grouped_gemm_dgrad_pallas_triton", lambda *a, **k: seen.append("dgrad") or 0)
    monkeypatch.setattr(gemm_api, "grouped_gemm_wgrad_pallas_triton", lambda *a, **k: seen.append("wgrad") or 0)
    x, w, offsets = bf16_problem(M, N, K, E)
    d_y = jax.random.normal(jax.random.key(3), (M, N), jnp.float32).astype(jnp.bfloat16)
    moe_pallas.grouped_gemm_dgrad(d_y, w, offsets)
    moe_pallas.grouped_gemm_wgrad(x, d_y, offsets)
    assert seen == ["dgrad", "wgrad"]
    assert backend_table.default_order("grouped_gemm", "bf16", M_cap=M, N=N, K=K) == GPU_ORDER


@pytest.mark.parametrize("entry, message", [
    ({**choice("pallas_triton", 16, 32, 24), "ms": None}, "ms must map at least two"),
    ({k: v for k, v in choice("pallas_triton", 16, 32, 24).items() if k != "source"}, r"missing keys \['source'\]"),
    (choice("pallas_triton", 16, 32, 24, pallas_triton=2.0, pallas_mosaic_gpu=1.0), "backend must be the fastest"),
    ({**choice("pallas_triton", 16, 32, 24), "backend": "reference"}, "backend must be one of"),
    ({**choice("pallas_triton", 16, 32, 24), "M_cap": 0}, "M_cap must be an int >= 1"),
    ({**choice("pallas_triton", 16, 32, 24), "op": "gemm"}, "op must be one of"),
    ({**choice("pallas_triton", 16, 32, 24), "winner": "x"}, r"unknown keys \['winner'\]"),
    ({**choice("pallas_triton", 16, 32, 24), "kind": "backend-choice"}, "kind='backend-choice'"),
])
def test_malformed_entry_is_an_error_naming_the_file(tmp_path, monkeypatch, entry, message):
    """A malformed backend choice is a ValueError naming the table's file and the entry's index (never skipped),
    raised at the lookup, i.e. when grouped_gemm(implementation=None) is traced on the GPU."""
    launch_config = {"backend": "pallas_triton", "E": 4, "N": 16, "K": 32, "M_cap": 24, "dtype": "bf16",
                     "config": {"block_m": 16, "block_n": 16, "block_k": 32}}
    path = use_table(tmp_path, monkeypatch, [launch_config, entry])
    x, w, offsets = bf16_problem()
    spy_backends(monkeypatch)
    with pytest.raises(ValueError, match=message) as exc:
        moe_pallas.grouped_gemm(x, w, offsets)
    assert f"tuned table {path}: " in str(exc.value) and "entry 1" in str(exc.value)


def test_table_file_not_a_list_names_the_file(tmp_path, monkeypatch):
    path = use_table(tmp_path, monkeypatch, [])
    open(path, "w").write(json.dumps({"entries": []}))
    with pytest.raises(ValueError, match=f"tuned table {path}: must be a JSON list of objects"):
        backend_table.default_order("grouped_gemm", "bf16", M_cap=24, N=16, K=32)
    gemm_config.tuned_tables.cache_clear()
    open(path, "w").write("[{")
    with pytest.raises(ValueError, match=f"tuned table {path}: not valid JSON"):
        backend_table.default_order("grouped_gemm", "bf16", M_cap=24, N=16, K=32)


def test_launch_config_lookup_skips_backend_choices(tmp_path, monkeypatch):
    """Regression: the launch-config lookup (config.nearest_tuned) shares the file and skips the backend choices
    (before, it read their missing "dtype" and raised KeyError)."""
    cfg = {"block_m": 32, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}
    use_table(tmp_path, monkeypatch, [
        choice("pallas_triton", N=4096, K=7168, M_cap=2048),
        {"backend": "pallas_triton", "device": KIND, "E": 32, "N": 4096, "K": 7168, "M_cap": 16384, "dtype": "bf16",
         "fast_accum": None, "config": cfg, "ms": 1.0, "heuristic_ms": 1.0},
    ])
    assert gemm_config.nearest_tuned(TEST_SPEC, "pallas_triton", 2048, 4096, 7168, 2) == cfg
    assert (gemm_config.grouped_gemm_config(2048, 4096, 7168, 32, 2, device=TEST_SPEC)
            == gemm_config.GroupedGemmConfig(**cfg))


def test_seeded_h200_table_is_valid_and_cites_its_sources():
    """The table in the tree: every entry well-formed, its source a file in the tree, and the
    measured findings in it: DeepSeek-V3's FP8-block GEMMs on Mosaic GPU (its warp-specialized FP8 kernel). The table
    is the architecture's (``tuned/sm90.json``): an H20 gets the same choices, an H100 its own device file's first
    (``tuned/sm90/NVIDIA_H100_80GB_HBM3.json``, then the same), an A100 (sm80) none (the heuristic order)."""
    h200, h100 = spec_of_kind("NVIDIA H200"), spec_of_kind("NVIDIA H100 80GB HBM3")
    a100 = spec_of_kind("NVIDIA A100-SXM4-80GB", (8, 0))
    entries = backend_table.backend_choices(h200).entries()
    assert entries
    assert backend_table.backend_choices(spec_of_kind("NVIDIA H20")).entries() == entries
    h100_entries = backend_table.backend_choices(h100).entries()
    own = h100_entries[:len(h100_entries) - len(entries)]
    assert own and h100_entries[len(own):] == entries and {e["device"] for e in own} == {h100.kind}
    assert backend_table.backend_choices(a100).entries() == ()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for e in own + entries:
        assert os.path.exists(os.path.join(root, e["source"])), e["source"]
    for N, K in ((4096, 7168), (7168, 2048)):
        for hopper in (h200, h100):
            assert backend_table.gpu_order("grouped_gemm", "fp8_block", 2048, N, K, hopper)[0] == "pallas_mosaic_gpu"
            assert backend_table.gpu_order("grouped_gemm", "fp8_block", 16384, N, K, hopper)[0] == "pallas_mosaic_gpu"
            assert backend_table.gpu_order("grouped_gemm", "bf16", 16384, N, K, hopper)[0] == (
                "pallas_triton" if hopper is h100 else "pallas_mosaic_gpu")  # the H100's tuned Pallas-Triton wins
        for other in (None, a100):
            assert (backend_table.gpu_order("grouped_gemm", "fp8_block", 2048, N, K, other)
                    == backend_table.heuristic_order("grouped_gemm", "fp8_block"))
            assert (backend_table.gpu_order("grouped_gemm", "bf16", 16384, N, K, other)
                    == backend_table.heuristic_order("grouped_gemm", "bf16"))


# ------------------------------------------------------------------------------------------------ tune_backend.py


def bench_row(spec, backend, ms, *, bench="gemm", shape="gate_up", M=2048, routing="uniform", dtype="bf16",
              error=None, rel_err=1e-3):
    N, K = (4096, 7168) if shape == "gate_up" else (7168, 2048)
    row = {"bench": bench, "backend": backend, "spec": spec, "shape": shape, "E": 32, "M": M, "K": K, "N": N,
           "routing": routing, "dtype": dtype, "quant": None, "median_ms": ms, "rel_err": rel_err, "error": error,
           "fwd_ms": None}
    if bench == "gemm_bwd":
        row.update(median_ms=3 * ms, fwd_ms=ms)
    return row


def test_tune_backend_merges_bench_rows(tmp_path, monkeypatch, capsys):
    """tune_backend.py: specs both JAX backends timed correctly become entries (routings averaged, the faster
    mean chosen; gemm_bwd's fwd_ms counts as the forward), one-sided, failed or wrong rows are left out (and
    said), the table's launch configs are kept, an old entry of the same key is replaced; the lookup reads it."""
    PT, MG = "ours-jax-pallas_triton", "ours-jax-pallas_mosaic_gpu"
    rows = [
        bench_row("gemm/gate_up/bf16/M=2048/uniform", PT, 0.50),
        bench_row("gemm/gate_up/bf16/M=2048/uniform", MG, 0.49),
        bench_row("gemm/gate_up/bf16/M=2048/zipf", PT, 0.61, routing="zipf"),
        bench_row("gemm/gate_up/bf16/M=2048/zipf", MG, 0.68, routing="zipf"),  # means: PT 0.555 < Mosaic 0.585
        bench_row("gemm/down/fp8_block/M=16384/uniform", PT, 0.87, shape="down", M=16384, dtype="fp8_block"),
        bench_row("gemm/down/fp8_block/M=16384/uniform", MG, 1.54, shape="down", M=16384, dtype="fp8_block"),
        bench_row("gemm/down/bf16/M=256/uniform", PT, 0.25, shape="down", M=256),  # Mosaic failed: left out
        bench_row("gemm/down/bf16/M=256/uniform", MG, None, shape="down", M=256, error="RuntimeError: boom"),
        bench_row("gemm/down/fp8/M=256/uniform", PT, 0.14, shape="down", M=256, dtype="fp8"),  # Mosaic WRONG
        bench_row("gemm/down/fp8/M=256/uniform", MG, 0.15, shape="down", M=256, dtype="fp8", rel_err=0.5),
        bench_row("gemm/down/bf16/M=2048/uniform", PT, 0.26, shape="down"),  # only one backend timed it
        bench_row("gemm/gate_up/bf16/M=2048/uniform", "ours-torch-triton", 0.10),  # not a JAX backend
        bench_row("gemm_bwd/gate_up/bf16/M=4096/uniform", PT, 0.77, bench="gemm_bwd", M=4096),
        bench_row("gemm_bwd/gate_up/bf16/M=4096/uniform", MG, 0.74, bench="gemm_bwd", M=4096),
    ]
    results = tmp_path / "bench.json"
    results.write_text(json.dumps({"meta": {"date": "2026-12-02T10:00:00", "argv": ["benchmarks/bench.py", "--what",
                                                                                    "gemm"], "git": "abc1234",
                                            "torch_device": "Test GPU"}, "rows": rows}))
    launch_config = {"backend": "pallas_triton", "E": 32, "N": 4096, "K": 7168, "M_cap": 256, "dtype": "bf16",
                     "config": {"block_m": 16, "block_n": 64, "block_k": 64}}
    old = {**choice("pallas_mosaic_gpu", N=4096, K=7168, M_cap=2048), "E": 32}
    kept = choice("pallas_mosaic_gpu", N=64, K=64, M_cap=8)
    table_path = write_tuned(tmp_path, [launch_config, old, kept])  # <out>/sm90/Test_GPU.json
    # the architecture from this machine's GPU's device spec (a simulated Test GPU, the rows' device kind)
    monkeypatch.setattr(tune_backend.jax_device, "device_spec", lambda: TEST_SPEC)
    assert tune_backend.main([str(results), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "skip gemm/down/bf16/M=256/uniform ours-jax-pallas_mosaic_gpu: error: RuntimeError: boom" in out
    assert "skip gemm/down/fp8/M=256/uniform ours-jax-pallas_mosaic_gpu: rel_err 0.5" in out
    assert "skip gemm/down/bf16/M=2048/uniform: only ['pallas_triton']" in out
    table = json.loads(open(table_path).read())
    assert table[0] == launch_config and table[2] == kept and len(table) == 5
    new = {(e["layout"], e["N"], e["M_cap"]): e for e in table if e.get("kind") == "backend_choice"}
    gate_up = table[1]  # replaced in place
    assert (gate_up["backend"], gate_up["ms"], gate_up["routings"]) == (
        "pallas_triton", {"pallas_triton": 0.555, "pallas_mosaic_gpu": 0.585}, ["uniform", "zipf"])
    assert (gate_up["date"], gate_up["command"], gate_up["git"], gate_up["device"], gate_up["arch"], gate_up["E"]) == (
        "2026-12-02", "python3 benchmarks/bench.py --what gemm", "abc1234", "Test GPU", "sm90", 32)
    assert gate_up["source"] == os.path.relpath(str(results), tune_backend._ROOT)
    assert new[("fp8_block", 7168, 16384)]["backend"] == "pallas_triton"
    assert new[("bf16", 4096, 4096)]["ms"] == {"pallas_triton": 0.77, "pallas_mosaic_gpu": 0.74}
    assert new[("bf16", 4096, 4096)]["measured"] == "fwd_ms of gemm_bwd rows"
    assert ("bf16", 7168, 256) not in new and ("fp8_per_token", 7168, 256) not in new
    # the lookup reads what was written
    monkeypatch.setattr(gemm_config, "TUNED_DIR", str(tmp_path))
    gemm_config.tuned_tables.cache_clear()
    assert backend_table.gpu_order("grouped_gemm", "bf16", 2048, 4096, 7168, TEST_SPEC) == TRITON_FIRST
    assert backend_table.gpu_order("grouped_gemm", "bf16", 8192, 4096, 7168, TEST_SPEC) == GPU_ORDER


def test_tune_backend_csv_needs_provenance_and_refuses_to_write_a_bad_table(tmp_path, capsys):
    """A CSV has no meta: --device, --date and --command are required; a table whose existing entries are malformed
    (or measured on another device kind) is refused, naming the file and the entry, before anything is written."""
    PT, MG = "ours-jax-pallas_triton", "ours-jax-pallas_mosaic_gpu"
    rows = [bench_row("gemm/gate_up/bf16/M=256/uniform", PT, 0.48, M=256),
            bench_row("gemm/gate_up/bf16/M=256/uniform", MG, 0.44, M=256)]
    keys = list(rows[0])
    csv_path = tmp_path / "bench.csv"
    csv_path.write_text(",".join(keys) + "\n" + "\n".join(",".join("" if r[k] is None else str(r[k]) for k in keys)
                                                         for r in rows) + "\n")
    assert tune_backend.main([str(csv_path), "--out", str(tmp_path)]) == 2
    assert "pass --device" in capsys.readouterr().err
    assert tune_backend.main([str(csv_path), "--out", str(tmp_path), "--device", "Test GPU"]) == 2
    assert "pass --date and --command" in capsys.readouterr().err
    args = [str(csv_path), "--out", str(tmp_path), "--arch", "sm90", "--device", "Test GPU", "--date", "2026-11-30",
            "--command", "bench"]
    assert tune_backend.main(args) == 0
    table_path = tmp_path / "sm90" / "Test_GPU.json"  # the device kind's file of the architecture (sm90)
    (entry,) = json.loads(table_path.read_text())
    assert (entry["backend"], entry["M_cap"], entry["ms"]) == ("pallas_mosaic_gpu", 256,
                                                              {"pallas_triton": 0.48, "pallas_mosaic_gpu": 0.44})
    assert (entry["arch"], entry["device"]) == ("sm90", "Test GPU")
    bad = [{**entry, "ms": {"pallas_mosaic_gpu": 0.44}}, choice("pallas_triton", 16, 32, 24)]
    table_path.write_text(json.dumps(bad))
    capsys.readouterr()
    assert tune_backend.main(args[:-4] + ["--date", "2026-11-30", "--command", "bench", "--layouts", "fp8_block"]) == 2
    err = capsys.readouterr().err
    assert f"tune_backend: tuned table {table_path}: entry 0 " in err and "ms must map at least two" in err, err
    assert json.loads(table_path.read_text()) == bad  # untouched
    other = [{**entry, "device": "NVIDIA H200"}]
    table_path.write_text(json.dumps(other))
    assert tune_backend.main(args) == 2
    assert "entry 0 measured on device 'NVIDIA H200', but the file holds 'Test GPU' entries" in capsys.readouterr().err
    assert json.loads(table_path.read_text()) == other
    assert tune_backend.parse_args(["f.json", "--layouts", "bf16,fp8_block"]).layouts == {"bf16", "fp8_block"}


def test_tune_backend_refuses_cpu_runs_missing_files_and_runs_without_gemm_rows(tmp_path, capsys):
    """A new user's trial: a missing file ended in a traceback, a CPU (--tiny) run with made-up Mosaic
    times was written into cpu.json, and a decode-only run said just "nothing timed by both backends". Now: a clean
    error (rc 2) naming the file; a CPU run is refused (its interpreted times choose nothing on a GPU); a run with no
    gemm rows says so and nothing is written (rc 1)."""
    PT, MG = "ours-jax-pallas_triton", "ours-jax-pallas_mosaic_gpu"
    assert tune_backend.main([str(tmp_path / "nope.json"), "--out", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err
    rows = [bench_row("gemm/gate_up/bf16/M=256/uniform", PT, 0.48, M=256),
            bench_row("gemm/gate_up/bf16/M=256/uniform", MG, 0.44, M=256)]
    meta = {"date": "2026-12-01T00:00:00", "argv": ["bench.py", "--tiny"], "torch_device": "cpu",
            "jax_devices": ["cpu:0"], "tiny": True}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    assert tune_backend.main([str(path), "--out", str(tmp_path)]) == 2
    assert "is a CPU run" in capsys.readouterr().err and not (tmp_path / "cpu.json.tmp").exists()
    decode = [dict(r, bench="decode", spec=r["spec"].replace("gemm/", "decode/")) for r in rows]
    meta_gpu = dict(meta, torch_device="NVIDIA H200", jax_devices=["cuda:0"], tiny=False)
    path = tmp_path / "decode.json"
    path.write_text(json.dumps({"meta": meta_gpu, "rows": decode}))
    assert tune_backend.main([str(path), "--out", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "no gemm / gemm_bwd rows" in out.out and "nothing to write" in out.err
    assert not (tmp_path / "sm90" / "NVIDIA_H200.json").exists() and not (tmp_path / "NVIDIA_H200.json").exists()


def test_tune_backend_writes_the_user_table_by_default(tmp_path, monkeypatch, capsys):
    """Without ``--out`` the choices go to the user's table of the device (``EPMOE_CACHE_DIR``, as ``epmoe tune``),
    never into the installed package; the architecture is this machine's GPU's (its device spec) where it is the rows'
    device kind, else ``--arch`` is asked for (rows do not record the compute capability)."""
    from moe_contract import selection, tuning

    cache = tmp_path / "cache"
    monkeypatch.setenv(selection.CACHE_DIR_ENV, str(cache))
    PT, MG = "ours-jax-pallas_triton", "ours-jax-pallas_mosaic_gpu"
    rows = [bench_row("gemm/gate_up/bf16/M=256/uniform", PT, 0.48, M=256),
            bench_row("gemm/gate_up/bf16/M=256/uniform", MG, 0.44, M=256)]
    results = tmp_path / "bench.json"
    results.write_text(json.dumps({"meta": {"date": "2026-12-02T10:00:00", "argv": ["bench.py"],
                                            "torch_device": "NVIDIA H100 80GB HBM3"}, "rows": rows}))
    package = os.path.dirname(os.path.abspath(moe_pallas.__file__))
    before = sorted(os.walk(package))

    monkeypatch.setattr(tune_backend.jax_device, "device_spec", lambda: None)  # no GPU here
    assert tune_backend.main([str(results)]) == 2
    assert "JAX sees no GPU here to read it from: pass --arch" in capsys.readouterr().err
    monkeypatch.setattr(tune_backend.jax_device, "device_spec", lambda: spec_of_kind("NVIDIA H200"))
    assert tune_backend.main([str(results)]) == 2
    assert "this machine's GPU is NVIDIA H200 (sm90" in capsys.readouterr().err
    assert not cache.exists()

    h100 = spec_of_kind("NVIDIA H100 80GB HBM3", (9, 0))
    monkeypatch.setattr(tune_backend.jax_device, "device_spec", lambda: h100)
    assert tune_backend.main([str(results)]) == 0
    path = tuning.tuned_table_path("jax", "sm90", h100.kind)
    assert path == os.path.join(str(cache), "tuned", "jax", "sm90", "NVIDIA_H100_80GB_HBM3.json")
    assert f"wrote {path}" in capsys.readouterr().out
    assert os.path.commonpath([path, package]) != package
    (entry,) = selection.read_table(path, "sm90", h100.kind, gemm_config.entry_problem)
    assert (entry["backend"], entry["arch"], entry["device"]) == ("pallas_mosaic_gpu", "sm90", h100.kind)
    # --arch names the table where this machine cannot (another GPU, or none)
    monkeypatch.setattr(tune_backend.jax_device, "device_spec", lambda: None)
    assert tune_backend.main([str(results), "--arch", "sm90", "--dry-run"]) == 0
    assert sorted(os.walk(package)) == before  # nothing written into the package
