"""The benchmark harness's CPU-safe parts: specs, row schema, rates, writers, the correctness guard.

The timed GPU run itself is ``benchmarks/bench.py`` on the GPU machine; ``--tiny`` runs it on the
CPU with the interpreters (not part of this suite: ~40 s).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `benchmarks` as a namespace package

from benchmarks import bench  # noqa: E402
from benchmarks import harness as H  # noqa: E402
from benchmarks import specs as S  # noqa: E402


@pytest.mark.parametrize("routing", S.ROUTINGS)
@pytest.mark.parametrize("M", [1, 31, 256, 2048, 16384])
def test_group_sizes_sum_to_M(M, routing):
    sizes = S.group_sizes(M, 32, routing, seed=0)
    assert sizes.shape == (32,) and sizes.dtype == np.int64
    assert sizes.sum() == M and (sizes >= 0).all()
    if routing == "uniform":
        assert sizes.max() - sizes.min() <= 1


def test_zipf_deterministic_skewed_and_may_leave_experts_empty():
    a, b = S.group_sizes(2048, 32, "zipf", seed=0), S.group_sizes(2048, 32, "zipf", seed=0)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, S.group_sizes(2048, 32, "zipf", seed=1))
    assert a.max() > 4 * 2048 / 32  # the heavy expert takes several times its even share
    assert any((S.group_sizes(256, 32, "zipf", seed=s) == 0).any() for s in range(4))


def test_group_sizes_rejects_unknown_routing():
    with pytest.raises(ValueError, match="routing must be one of"):
        S.group_sizes(16, 4, "one-expert")


def test_spec_counts_and_fields():
    full, quick = S.gemm_specs(), S.gemm_specs(quick=True)
    assert len(full) == 2 * 3 * 2 * 2 and len(set(full)) == len(full)
    assert len(quick) == 4 and set(quick) <= set(full)
    assert {(s.K, s.N) for s in full} == {(7168, 4096), (2048, 7168)} and {s.E for s in full} == {32}
    assert len(S.layer_specs()) == 6 and len(S.layer_specs(quick=True)) == 2
    for spec in full + S.gemm_specs(tiny=True):
        offs = spec.expert_offsets()
        assert offs.dtype == np.int32 and offs.shape == (spec.E + 1,) and offs[0] == 0 and offs[-1] == spec.M
        assert (np.diff(offs) >= 0).all()
        assert spec.flops == 2 * spec.M * spec.N * spec.K and spec.min_bytes > 0
    layer = S.layer_specs()[0]
    c = layer.config()
    assert (c.num_experts, c.topk, c.hidden_size, c.intermediate_size, c.routing, c.renormalize) == (
        32, 8, 7168, 2048, "softmax_topk", True)
    gate = S.gate_specs()[0]
    gc = gate.config()
    assert (gate.T, gc.num_experts, gc.num_expert_group, gc.topk_group, gc.topk, gc.routing) == (
        4096, 256, 8, 4, 8, "biased_grouped_topk")


def test_min_bytes_counts_only_experts_with_rows():
    spec = S.GemmSpec(shape="x", E=32, K=128, N=64, M=4, routing="zipf", dtype="bf16")
    active = int((spec.group_sizes() > 0).sum())
    assert active <= 4
    assert spec.min_bytes == 4 * 128 * 2 + active * 64 * 128 * 2 + 4 * 64 * 2


def test_rotation_sets():
    assert S.rotation_sets(1e9, H.L2_BYTES) == 1
    n = S.rotation_sets(4e6, H.L2_BYTES)
    assert 2 <= n <= 32 and (n - 1) * 4e6 >= 2 * H.L2_BYTES
    assert S.rotation_sets(1.0, H.L2_BYTES) == 32  # capped


def fake_rows() -> list[dict]:
    g = S.gemm_specs()[0]
    rows = []
    for backend, ms, err in (("ours-torch-triton", 0.5, None), ("torch._grouped_mm", 0.4, None),
                             ("jax-ragged_dot_mgpu", None, "WRONG: rel_err=0.5 > 0.01; not timed"),
                             ("ours-jax-pallas_mosaic_gpu", None, "not available: ValueError: x")):
        row = H.make_row("gemm", backend, g, median_ms=ms, p20_ms=ms, p80_ms=ms, error=err, rel_err=1e-3,
                         timing_method="cuda_events", notes="a | b")
        rows.append(H.add_rates(row, g.flops, g.min_bytes, g.dtype))
    rows.append(H.make_row("gate", "ref-torch", S.gate_specs()[0], median_ms=0.1, p20_ms=0.1, p80_ms=0.1))
    return rows


def test_row_schema_and_rates():
    rows = fake_rows()
    for r in rows:
        assert tuple(r) == H.ROW_KEYS
    with pytest.raises(ValueError, match="unknown row keys"):
        H.make_row("gemm", "x", S.gemm_specs()[0], bogus=1)
    r = H.make_row("gemm", "x", S.GemmSpec(shape="s", E=1, K=8192, N=8192, M=8192, routing="uniform", dtype="bf16"))
    r["median_ms"] = 2 * 8192**3 / H.PEAK_BF16_FLOPS * 1e3  # exactly the bf16 ceiling
    H.add_rates(r, 2 * 8192**3, 3 * 8192**2 * 2, "bf16")
    assert r["bound"] == "compute" and r["pct_of_ceiling"] == pytest.approx(100.0)
    assert r["tflops"] == pytest.approx(H.PEAK_BF16_FLOPS / 1e12)


def test_writers(tmp_path):
    rows = fake_rows()
    H.write_json(rows, str(tmp_path / "b.json"), {"device": "fake"})
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["schema"] == list(H.ROW_KEYS) and len(data["rows"]) == len(rows)
    H.write_csv(rows, str(tmp_path / "b.csv"))
    back = H.read_csv(str(tmp_path / "b.csv"))
    assert list(back[0]) == list(H.ROW_KEYS) and len(back) == len(rows)
    assert float(back[0]["median_ms"]) == 0.5 and back[2]["median_ms"] == ""
    pivot = H.markdown_pivot(rows)
    assert "**gemm**" in pivot and "**gate**" in pivot and "0.400*" in pivot and "WRONG" in pivot and "ERR" in pivot
    long = H.markdown_long(rows)
    assert long.count("\n") == len(rows) + 1 and "a / b" in long  # pipes in notes escaped
    assert H.plot_gemm(rows, str(tmp_path / "p.png")) and (tmp_path / "p.png").stat().st_size > 1000
    assert not H.plot_gemm(rows[-1:], str(tmp_path / "none.png"))
    layer_rows = [H.make_row("layer", b, spec, median_ms=ms * spec.T, p20_ms=ms, p80_ms=ms)
                  for spec in S.layer_specs() for b, ms in (("ours-torch-triton", 1e-3), ("ref-torch", 1e-2))]
    assert H.plot_layer(layer_rows, str(tmp_path / "l.png")) and (tmp_path / "l.png").stat().st_size > 1000
    assert not H.plot_layer(rows, str(tmp_path / "none.png"))  # no layer rows
    assert "5 rows, 3 timed, 2 errors (1 wrong results)" == H.stats_line(rows)


def test_parse_args(tmp_path):
    args = bench.parse_args(["--what", "gemm,gate", "--quick", "--out", str(tmp_path)])
    assert args.what == ["gemm", "gate"] and args.quick and args.out == str(tmp_path)
    with pytest.raises(SystemExit):
        bench.parse_args(["--what", "gemmm"])


def test_guard_refuses_to_time_wrong_output(tmp_path):
    torch = pytest.importorskip("torch")
    ctx = bench.Ctx(bench.parse_args(["--out", str(tmp_path)]))
    spec = S.gemm_specs(tiny=True)[0]
    ref = torch.randn(16, 32)
    kw = dict(flops=spec.flops, nbytes=spec.min_bytes, dtype="bf16")
    bad = bench.run_torch(ctx, "gemm", "bad", spec, lambda: ref * 1.1, ref, **kw)
    assert bad["error"].startswith("WRONG") and bad["median_ms"] is None and bad["rel_err"] == pytest.approx(0.1)
    nan = bench.run_torch(ctx, "gemm", "nan", spec, lambda: ref * float("nan"), ref, **kw)
    assert nan["error"].startswith("WRONG")
    good = bench.run_torch(ctx, "gemm", "good", spec, lambda: ref.clone(), ref, **kw)
    # CPU tensors are timed by a wall-clock loop; on the GPU machine the harness uses CUDA events.
    want = "cuda_events" if torch.cuda.is_available() else "wall_loop"
    assert good["error"] is None and good["median_ms"] > 0 and good["timing_method"] == want
    assert len(ctx.rows) == 3 and (tmp_path / "bench.csv").exists()  # rows written as they come


def test_time_jax_falls_back_to_wall_clock_on_cpu():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    x = jnp.ones((64, 64))
    compiled, secs = H.jax_compile(lambda a: a @ a, x)
    res = H.time_jax(compiled, (x,), rep_ms=5)
    assert secs >= 0 and res["median_ms"] > 0 and res["p20_ms"] <= res["median_ms"] <= res["p80_ms"]
    assert res["timing_method"] == ("wall_loop" if jax.default_backend() != "gpu" else "cupti")
    rot = H.rotated(lambda a: a @ a, 2)
    c2, _ = H.jax_compile(rot, (x,), (x + 1,))
    assert len(c2((x,), (x + 1,))) == 2


def test_pad_groups():
    sizes = np.array([3, 0, 17, 16])
    idx, ends = bench.pad_groups(sizes, 16)
    np.testing.assert_array_equal(ends, [16, 16, 48, 64])
    np.testing.assert_array_equal(idx, list(range(3)) + list(range(16, 33)) + list(range(48, 64)))


def test_transformers_peer_row_on_tiny_layer_specs(tmp_path):
    """The layer peer ``transformers-Qwen3MoeSparseMoeBlock``: transformers' block with our weights agrees with
    our reference (bf16: HF rounds its routing weights to bf16 and, eager, accumulates in bf16), is timed, and
    comes only for quant='none'."""
    pytest.importorskip("transformers")
    ctx = bench.Ctx(bench.parse_args(["--out", str(tmp_path), "--backends", "transformers", "--rep-ms", "2",
                                      "--warmup-ms", "1"]))
    for spec in S.layer_specs(tiny=True):
        bench.bench_layer(ctx, spec, {})
    rows = ctx.rows
    names = {f"transformers-{bench.HF_BLOCK}", f"transformers-{bench.HF_BLOCK}-eager"}
    assert {r["backend"] for r in rows} == names
    assert {r["quant"] for r in rows} == {"none"} and len(rows) == 2 * len([s for s in S.layer_specs(tiny=True)
                                                                           if s.quant == "none"])
    for r in rows:
        assert r["error"] is None, r
        assert 0 < r["rel_err"] < 1e-2 and r["median_ms"] > 0, r
        assert "experts_implementation=" in r["notes"]


def test_build_hf_block_maps_our_weights():
    """gate_up_proj = w13 (gate rows first), down_proj = w2: float32, the block equals our reference on its
    own logits to float32 rounding; swapping the gate and up halves breaks it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import moe_torch

    spec = S.LayerSpec(T=8, quant="none", E=4, topk=2, H=64, I=32)
    config = spec.config()
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(spec.E, 2 * spec.I, spec.H, generator=g) * spec.H**-0.5
    w2 = torch.randn(spec.E, spec.H, spec.I, generator=g) * spec.I**-0.5
    x = torch.randn(spec.T, spec.H, generator=g)
    gate_w = bench.hf_router_weight(spec, "cpu", torch.float32)
    logits = torch.nn.functional.linear(x, gate_w)
    ref = moe_torch.moe_forward(x, logits, w13, w2, config, implementation="reference")
    for impl in ("grouped_mm", "eager"):
        block = bench.build_hf_block(config, w13, w2, gate_w, impl)
        assert block.experts.gate_up_proj.data_ptr() == w13.data_ptr()  # shared, not copied
        with torch.no_grad():
            out = block(x[None])[0]
        assert bench.rel_err_t(out, ref) < 1e-5, impl
    swapped = torch.cat([w13[:, spec.I:], w13[:, :spec.I]], 1)
    with torch.no_grad():
        out = bench.build_hf_block(config, swapped, w2, gate_w, "eager")(x[None])[0]
    assert bench.rel_err_t(out, ref) > 0.1
    with pytest.raises(ValueError, match="w2 must be"):
        bench.build_hf_block(config, w13, w2[:, :, :-1], gate_w)
    with pytest.raises(ValueError, match="softmax top-k"):
        bench.build_hf_block(config.replace(renormalize=False), w13, w2, gate_w)


def test_gpu_check_groups_and_cli_checks(tmp_path):
    """benchmarks/gpu_check.py's pieces that need no GPU: ';'-split test groups (shell quoting inside a
    group) and `epmoe check` run in-process per preset:quant, summarised per check, tables to checks.log."""
    from benchmarks import gpu_check

    assert gpu_check._groups("a.py b.py; c.py -k 'not slow' ;") == [["a.py", "b.py"], ["c.py", "-k", "not slow"]]
    (row,) = gpu_check.run_cli_checks(str(tmp_path), ["tiny:fp8_block"], tokens=4)
    assert row["check"] == "tiny:fp8_block" and row["rc"] == 0 and row["ok"] is True, row
    assert row["failed_stages"] == [] and row["max_rel_fro"]["layer"] < 2e-2 and row["n_comparisons"] > 50
    assert "===== epmoe check --preset tiny --quant fp8_block --tokens 4: rc=0" in (tmp_path / "checks.log").read_text()


def test_backends_matching_nothing_is_an_error(tmp_path):
    """`--backends zzz` used to print "0 rows" and exit 0 (second new-user trial, 2026-11-30)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench.py"), "--tiny", "--what", "gate",
                          "--backends", "zzz", "--out", str(tmp_path)], capture_output=True, text=True, cwd=root, timeout=300)
    assert run.returncode == 2 and "--backends 'zzz' matched no backend" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("argv,message", [
    (["--block-t", "x"], "--block-t: expected a comma list of integers; got 'x'"),
    (["--warps", "3"], "--warps: every value must be an integer >= 1, a power of two, <= 32; got 3"),
    (["--tokens", "0"], "--tokens: every value must be an integer >= 1; got 0"),
    (["--block-t", "128"], "--block-t: every value must be an integer >= 1, a power of two, <= 64; got 128"),
    (["--tokens", ","], "--tokens: expected at least one value"),
])
def test_tune_gate_argument_errors(argv, message, capsys):
    from benchmarks import tune_gate

    with pytest.raises(SystemExit) as exc:
        tune_gate.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert tune_gate.parse_args(["--tokens", "32,4096", "--block-t", "1,2"]).block_t == [1, 2]
