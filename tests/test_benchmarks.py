"""The benchmark harness's CPU-safe parts: specs, row schema, rates, writers, the correctness guard.

The timed GPU run itself is ``benchmarks/bench.py`` on the GPU machine; ``--tiny`` runs it on the
CPU with the interpreters (the whole forward run is not part of this suite: ~40 s; its forward +
backward rows are, ``--tiny --what gemm_bwd,layer_bwd``: ~25 s of CPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `benchmarks` as a namespace package

from benchmarks import bench  # noqa: E402
from benchmarks import harness as H  # noqa: E402
from benchmarks import specs as S  # noqa: E402
from common import needs_triton_interpreter  # noqa: E402


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
    assert len(full) == 2 * 3 * 2 * 3 and len(set(full)) == len(full)  # shapes x M x routings x dtypes
    assert len(quick) == 4 and set(quick) <= set(full)
    assert {(s.K, s.N) for s in full} == {(7168, 4096), (2048, 7168)} and {s.E for s in full} == {32}
    assert len(S.layer_specs()) == 9 and len(S.layer_specs(quick=True)) == 3  # T x (none, fp8_per_token, fp8_block)
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
    assert H.plot_gate(rows, str(tmp_path / "g.png"), cpu=True) and (tmp_path / "g.png").stat().st_size > 1000
    assert not H.plot_gate(layer_rows, str(tmp_path / "none.png"))  # no gate rows
    assert "5 rows, 3 timed, 2 errors (1 wrong results)" == H.stats_line(rows)


def test_parse_args(tmp_path):
    args = bench.parse_args(["--what", "gemm,gate", "--quick", "--out", str(tmp_path)])
    assert args.what == ["gemm", "gate"] and args.quick and args.out == str(tmp_path)
    with pytest.raises(SystemExit):
        bench.parse_args(["--what", "gemmm"])


def test_layer_quants_and_ts_filters(tmp_path):
    """``--layer-quants`` / ``--ts`` pick the layer rows a short ``--max-minutes`` would otherwise cut (the FP8-block
    rows come last); bad values are refused by argparse."""
    args = bench.parse_args(["--out", str(tmp_path), "--layer-quants", "fp8_block", "--ts", "4096, 512"])
    assert args.layer_quants == ["fp8_block"] and args.ts == [4096, 512]
    kept = [(s.quant, s.T) for s in S.layer_specs() if bench.spec_wanted(s, args)]
    assert kept and set(kept) == {("fp8_block", 4096), ("fp8_block", 512)}
    everything = bench.parse_args(["--out", str(tmp_path)])
    assert all(bench.spec_wanted(s, everything) for s in S.layer_specs())
    decode = [s for s in S.decode_specs() if bench.spec_wanted(s, args, quants=False)]
    assert decode == [s for s in S.decode_specs() if s.T in (4096, 512)]
    assert bench.parse_args(["--out", str(tmp_path), "--ms", "16384"]).ms == [16384]
    for bad in (["--layer-quants", "fp9"], ["--ts", "512,x"], ["--ts", "0"], ["--ms", "1k"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--out", str(tmp_path), *bad])


def test_ts_builds_rows_at_any_token_count():
    """``--ts 256`` builds layer / layer_bwd / decode rows at T=256 (not among the default T), e.g. DeepSeek-V3's
    T=256 row that the copy-ceiling target names."""
    model = S.preset_model("deepseek-v3")
    layer = S.layer_specs(model=model, ts=[256])
    assert layer and {s.T for s in layer} == {256} and {s.E for s in layer} == {256}
    assert {s.T for s in S.layer_bwd_specs(ts=[256, 1024])} == {256, 1024}
    assert {s.T for s in S.decode_specs(ts=[3])} == {3}
    assert {s.T for s in S.layer_specs()} == set(S.LAYER_T)


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


def test_fp8_block_gemm_specs_bytes_and_validation():
    """fp8_block GEMM specs (DeepSeek-V3: x in 1x128 groups, w in 128x128 blocks): in the full run at both shapes,
    every M and routing, not in --quick; the tiny ones tile K by 128 (two K-blocks) with an N tail; min_bytes counts
    the 1-byte codes and the float32 scales [M, K/128] and [experts with rows, ceil(N/128), K/128]; the roofline takes
    the FP8 peak; K not a multiple of 128 or an unknown dtype is refused; a model whose K is not (gpt-oss: H = I =
    2880) gets neither fp8_block GEMMs nor fp8_block layer rows, DeepSeek-V3 both."""
    full = [s for s in S.gemm_specs() if s.dtype == "fp8_block"]
    assert {(s.shape, s.K, s.N, s.M, s.routing) for s in full} == {
        (sh, *S.GEMM_SHAPES[sh], M, r) for sh in S.GEMM_SHAPES for M in S.GEMM_M for r in S.ROUTINGS}
    assert full[0].name == "gemm/gate_up/fp8_block/M=256/uniform"
    assert {s.dtype for s in S.gemm_specs(quick=True)} == {"bf16", "fp8"}
    tiny = [s for s in S.gemm_specs(tiny=True) if s.dtype == "fp8_block"]
    assert len(tiny) == 4 and {(s.K, s.N) for s in tiny} == {(256, 160)}
    spec = S.GemmSpec(shape="x", E=8, K=384, N=200, M=5, routing="zipf", dtype="fp8_block")
    active = int((spec.group_sizes() > 0).sum())
    assert 1 <= active <= 5
    codes, out = 5 * 384 + active * 200 * 384, 5 * 200 * 2
    assert spec.min_bytes == codes + out + (5 * 3 + active * 2 * 3) * 4  # K/128 = 3, ceil(200/128) = 2
    assert spec.flops == 2 * 5 * 200 * 384 and H.PEAK_FLOPS["fp8_block"] == H.PEAK_FP8_FLOPS
    with pytest.raises(ValueError, match=r"K must be a multiple of 128 for dtype='fp8_block' \(x is quantized per "
                                         r"1x128 group along K\); got K=64"):
        S.GemmSpec(shape="x", E=2, K=64, N=32, M=4, routing="uniform", dtype="fp8_block")
    with pytest.raises(ValueError, match="GemmSpec: dtype must be one of"):
        S.GemmSpec(shape="x", E=2, K=64, N=32, M=4, routing="uniform", dtype="fp4")
    gpt = S.preset_model("gpt-oss-20b")
    assert gpt.quants == ("none", "fp8_per_token") and {s.dtype for s in S.gemm_specs(model=gpt)} == {"bf16", "fp8"}
    ds = S.preset_model("deepseek-v3")
    assert ds.quants == S.LAYER_QUANTS == ("none", "fp8_per_token", "fp8_block")
    blocks = {(s.shape, s.K) for s in S.gemm_specs(model=ds) if s.dtype == "fp8_block"}
    assert blocks == {("gate_up", 7168), ("down", 2048)}
    assert [(s.H, s.I) for s in S.layer_specs(tiny=True) if s.quant == "fp8_block"] == [(128, 128)] * 2  # its block


@needs_triton_interpreter  # ours-torch-triton runs in Triton's interpreter
def test_fp8_block_gemm_rows_judged_and_tokamax_peer_skipped_on_cpu(tmp_path, monkeypatch):
    """bench_gemm on a tiny fp8_block spec (CPU, kernels interpreted): our three backends have rows, Triton and
    Pallas-Triton judged right against the reference and timed (FP8 rates), Mosaic GPU a skip row (a Hopper GPU's
    kernel, not an error on the CPU), and torch._scaled_grouped_mm a skip row (torch has no 128x128 block-scaled
    grouped GEMM); nothing else. A bf16
    spec's tokamax ragged_dot peer is a skip row on the CPU (needs an NVIDIA GPU), and on a GPU without tokamax
    too (not importable). The gate judges the fp8_block rows: a Triton GEMM that scales every K-block by the first
    one's weight scale (K-block promotion left out), or by the first activation group's scale, is WRONG, not timed."""
    import jax

    import moe_torch

    args = ["--out", str(tmp_path), "--rep-ms", "1", "--warmup-ms", "1"]
    spec = next(s for s in S.gemm_specs(tiny=True) if s.dtype == "fp8_block" and s.M == 64 and s.routing == "zipf")
    ctx = bench.Ctx(bench.parse_args(args))
    bench.bench_gemm(ctx, spec, bench.GemmWeights())
    rows = {r["backend"]: r for r in ctx.rows}
    assert list(rows) == ["ours-torch-triton", "ours-jax-pallas_triton", "ours-jax-pallas_mosaic_gpu",
                          "ours-jax-default", "torch._scaled_grouped_mm"]
    for name in ("ours-torch-triton", "ours-jax-pallas_triton"):
        r = rows[name]
        assert r["error"] is None and r["dtype"] == "fp8_block" and r["K"] == 256 and r["N"] == 160, r
        assert r["rel_err"] is not None and r["rel_err"] < 1e-3 and r["median_ms"] > 0, r
        assert r["tflops"] == pytest.approx(spec.flops / r["median_ms"] / 1e9), r
    mgpu = rows["ours-jax-pallas_mosaic_gpu"]
    assert H.skipped(mgpu) and "pallas_mosaic_gpu needs a Hopper GPU; the JAX backend is cpu" in mgpu["error"], mgpu
    peer = rows["torch._scaled_grouped_mm"]
    assert H.skipped(peer) and "128x128" in peer["error"] and peer["median_ms"] is None, peer

    bf16 = next(s for s in S.gemm_specs(tiny=True) if s.dtype == "bf16")
    ctx = bench.Ctx(bench.parse_args(args + ["--backends", "tokamax"]))
    bench.bench_gemm(ctx, bf16, bench.GemmWeights())
    (tk,) = ctx.rows
    assert tk["backend"] == "tokamax.ragged_dot-mosaic" and H.skipped(tk) and "needs an NVIDIA GPU" in tk["error"], tk
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")

    def no_tokamax():
        raise ImportError("No module named 'tokamax'")

    monkeypatch.setattr(bench, "import_tokamax", no_tokamax)
    assert bench.tokamax_ragged_dots(ctx, "gemm", bf16, None) == []
    assert H.skipped(ctx.rows[-1]) and "tokamax not importable" in ctx.rows[-1]["error"], ctx.rows[-1]
    monkeypatch.undo()

    real = moe_torch.grouped_gemm
    for plant in ("w", "x"):

        def planted(x, w, offs, *, x_scale=None, w_scale=None, implementation=None, plant=plant, **kw):
            if implementation == "triton":
                if plant == "w":
                    w_scale = w_scale[:, :, :1].expand_as(w_scale).contiguous()
                else:
                    x_scale = x_scale[:, :1].expand_as(x_scale).contiguous()
            return real(x, w, offs, x_scale=x_scale, w_scale=w_scale, implementation=implementation, **kw)

        monkeypatch.setattr(moe_torch, "grouped_gemm", planted)
        ctx = bench.Ctx(bench.parse_args(args + ["--backends", "ours-torch-triton"]))
        bench.bench_gemm(ctx, spec, bench.GemmWeights())
        (bad,) = ctx.rows
        assert bad["error"].startswith("WRONG") and bad["median_ms"] is None and bad["rel_err"] > 3e-2, (plant, bad)


@needs_triton_interpreter  # ours-torch-triton runs in Triton's interpreter
def test_fp8_block_layer_rows_on_cpu(tmp_path):
    """The layer rows serve quant 'fp8_block' (weights in 128x128 blocks from quantize_layer_weights, activations in
    1x128 groups): the tiny spec (H = I = 128) runs our Triton layer and the reference, judged and timed."""
    import torch

    ctx = bench.Ctx(bench.parse_args(["--out", str(tmp_path), "--rep-ms", "1", "--warmup-ms", "1", "--backends",
                                      "ours-torch-triton,ref-torch"]))
    spec = next(s for s in S.layer_specs(tiny=True) if s.quant == "fp8_block")
    w13, s13, w2, s2 = bench.layer_weights(ctx, spec, spec.config())
    assert w13.dtype == torch.float8_e4m3fn and tuple(s13.shape) == (4, 2, 1) and tuple(s2.shape) == (4, 1, 1)
    bench.bench_layer(ctx, spec, {})
    assert [r["backend"] for r in ctx.rows] == ["ours-torch-triton", "ref-torch"]
    for r in ctx.rows:
        assert r["error"] is None and r["quant"] == "fp8_block" and r["rel_err"] < 1e-3 and r["median_ms"] > 0, r


def _timed(rows: list[dict]) -> list[dict]:
    """The rows that ran; the others must be the transformers peer's skip rows of quantized specs (its blocks hold
    float weights), with that reason."""
    skipped = [r for r in rows if (r["error"] or "").startswith(bench.H.SKIPPED)]
    for r in skipped:
        assert r["backend"].startswith("transformers") and r["quant"] != "none" and "holds float weights" in r["error"], r
    return [r for r in rows if r not in skipped]


def test_transformers_peer_row_on_tiny_layer_specs(tmp_path):
    """The layer peer ``transformers-Qwen3MoeSparseMoeBlock`` (the built-in shapes' block): transformers' block
    with our weights agrees with our reference (bf16: HF rounds its routing weights to bf16 and, eager,
    accumulates in bf16), is timed for quant='none'; the quantized specs get skip rows saying why (the new-user
    new-user trial found their transformers columns blank)."""
    pytest.importorskip("transformers")
    ctx = bench.Ctx(bench.parse_args(["--out", str(tmp_path), "--backends", "transformers", "--rep-ms", "2",
                                      "--warmup-ms", "1"]))
    for spec in S.layer_specs(tiny=True):
        bench.bench_layer(ctx, spec, {})
    names = {"transformers-Qwen3MoeSparseMoeBlock", "transformers-Qwen3MoeSparseMoeBlock-eager"}
    assert {r["backend"] for r in ctx.rows} == names
    skipped = [r for r in ctx.rows if r["quant"] != "none"]
    assert len(skipped) == 2 * len([s for s in S.layer_specs(tiny=True) if s.quant != "none"]) > 0
    for r in skipped:
        assert r["error"].startswith(bench.H.SKIPPED) and "holds float weights" in r["error"] and r["quant"] in r["error"]
    rows = [r for r in ctx.rows if r["quant"] == "none"]
    assert len(rows) == 2 * len([s for s in S.layer_specs(tiny=True) if s.quant == "none"])
    for r in rows:
        assert r["error"] is None, r
        assert 0 < r["rel_err"] < 1e-2 and r["median_ms"] > 0, r
        assert "experts_implementation=" in r["notes"]


def _layer_case(arch: str, shared: int = 0, seed: int = 0):
    """A small float32 layer of ``arch``'s routing: (config, w13, w2, router weight, bias, x)."""
    import torch

    from moe_contract import MoEConfig

    H, I, E = 64, 32, 8
    if arch == "deepseek_v3":
        config = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, topk=2, routing="biased_grouped_topk",
                           num_expert_group=4, topk_group=2, routed_scaling_factor=2.5, num_fused_shared_experts=shared)
    else:
        config = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, topk=2, routing="softmax_topk",
                           renormalize=arch == "mixtral" or seed % 2 == 0)
    g = torch.Generator().manual_seed(seed)
    n = E + shared
    w13 = torch.randn(n, 2 * I, H, generator=g) * H**-0.5
    w2 = torch.randn(n, H, I, generator=g) * I**-0.5
    gate_w = torch.randn(E, H, generator=g) * H**-0.5
    bias = 0.1 * torch.randn(E, generator=g) if arch == "deepseek_v3" else None
    x = torch.randn(8, H, generator=g)
    return config, w13, w2, gate_w, bias, x


@pytest.mark.parametrize("arch,shared,seed", [("qwen3_moe", 0, 0), ("qwen3_moe", 0, 1), ("mixtral", 0, 0),
                                              ("deepseek_v3", 1, 0), ("deepseek_v3", 2, 1)])
def test_build_hf_block_maps_our_weights(arch, shared, seed):
    """gate_up_proj = w13[:E] (gate rows first), down_proj = w2[:E], DeepSeek-V3's shared experts = our fused
    shared experts (S = 2: the S * I halves side by side), router and bias ours: in float32 the block equals our
    reference on its own logits to float32 rounding (Qwen3 with and without norm_topk_prob); swapping the gate
    and up halves breaks it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import moe_torch

    config, w13, w2, gate_w, bias, x = _layer_case(arch, shared, seed)
    logits = bench.router_logits(arch, x, gate_w)
    ref = moe_torch.moe_forward(x, logits, w13, w2, config, e_score_correction_bias=bias, implementation="reference")
    for impl in ("grouped_mm", "eager"):
        block = bench.build_hf_block(config, w13, w2, gate_w, impl, arch=arch, e_score_correction_bias=bias)
        assert type(block).__name__ == S.HF_BLOCKS[arch]
        assert block.experts.gate_up_proj.data_ptr() == w13.data_ptr()  # shared, not copied
        with torch.no_grad():
            out = block(x[None])[0]
        assert bench.rel_err_t(out, ref) < 1e-5, impl
    I = config.intermediate_size
    swapped = torch.cat([w13[:, I:], w13[:, :I]], 1)
    with torch.no_grad():
        out = bench.build_hf_block(config, swapped, w2, gate_w, "eager", arch=arch, e_score_correction_bias=bias)(x[None])[0]
    assert bench.rel_err_t(out, ref) > 0.1


def test_build_hf_block_refuses_what_the_block_cannot_express():
    pytest.importorskip("transformers")
    config, w13, w2, gate_w, bias, _ = _layer_case("deepseek_v3", 1)
    with pytest.raises(ValueError, match=r"w2 must be \[9, 64, 32\]; got \[9, 64, 31\]"):
        bench.build_hf_block(config, w13, w2[:, :, :-1], gate_w, arch="deepseek_v3", e_score_correction_bias=bias)
    with pytest.raises(ValueError, match="DeepseekV3MoE needs e_score_correction_bias"):
        bench.build_hf_block(config, w13, w2, gate_w, arch="deepseek_v3")
    with pytest.raises(ValueError, match="Qwen3MoeSparseMoeBlock is softmax top-k"):
        bench.build_hf_block(config, w13, w2, gate_w, arch="qwen3_moe")
    softmax, w13, w2, gate_w, _, _ = _layer_case("qwen3_moe", seed=1)  # renormalize=False
    with pytest.raises(ValueError, match="MixtralSparseMoeBlock is softmax top-k, renormalised"):
        bench.build_hf_block(softmax, w13, w2, gate_w, arch="mixtral")
    with pytest.raises(ValueError, match="arch must be one of"):
        bench.build_hf_block(softmax, w13, w2, gate_w, arch="llama")


def test_gpu_check_groups_and_cli_checks(tmp_path):
    """benchmarks/gpu_check.py's pieces that need no GPU: ';'-split test groups (shell quoting inside a
    group) and `epmoe check` run per preset:quant in a child process each (in one process Kimi K2's
    full-size check after Llama 4 Maverick's was killed for host memory), summarised per check, tables to checks.log;
    a check that fails (an unknown preset) is reported with its exit code and the next one still runs."""
    from benchmarks import gpu_check

    assert gpu_check._groups("a.py b.py; c.py -k 'not slow' ;") == [["a.py", "b.py"], ["c.py", "-k", "not slow"]]
    bad, row = gpu_check.run_cli_checks(str(tmp_path), ["no-such-model:none", "tiny:fp8_block"], tokens=4)
    assert bad["check"] == "no-such-model:none" and bad["rc"] not in (0, "timeout") and "ok" not in bad, bad
    assert row["check"] == "tiny:fp8_block" and row["rc"] == 0 and row["ok"] is True, row
    assert row["failed_stages"] == [] and row["max_rel_fro"]["layer"] < 2e-2 and row["n_comparisons"] > 50
    assert row["not_served"] == {}  # every default implementation served (a GPU adds Mosaic GPU, which may not)
    assert "===== epmoe check --preset tiny --quant fp8_block --tokens 4: rc=0" in (tmp_path / "checks.log").read_text()


def test_backends_matching_nothing_is_an_error(tmp_path, monkeypatch, capsys):
    """`--backends zzz` used to print "0 rows" and exit 0 (second new-user trial). bench.py's exit status is
    ``main``'s return value (``sys.exit(main())``): called here, as the other --tiny runs of this file, not in a child
    process (which spent its ~3 s importing)."""
    monkeypatch.setattr(bench, "TINY", True)  # the tiny specs (bench.py reads --tiny from sys.argv at import)
    rc = bench.main(["--tiny", "--what", "gate", "--backends", "zzz", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "--backends 'zzz' matched no backend" in err, err[-2000:]


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


# ---------------------------------------------------------------------------------------------- --preset / --weights


def test_specs_take_a_preset_model():
    """--preset: every spec takes the model's layer: GEMMs gate_up (K=H, N=2I) and down (K=I, N=H) over its E
    experts, the layer with its routing and shared expert (counted in flops and bytes), the gate with its routing;
    spec names carry the model; the peer block follows the routing."""
    m = S.preset_model("deepseek-v3")
    c = m.config
    assert (m.name, m.arch, m.quants, m.weights) == ("deepseek-v3", "deepseek_v3", S.LAYER_QUANTS, False)
    gemms = S.gemm_specs(model=m)
    assert {(g.shape, g.E, g.K, g.N) for g in gemms} == {("gate_up", 256, 7168, 4096), ("down", 256, 2048, 7168)}
    assert len(gemms) == len(S.gemm_specs()) and all(g.name.startswith("gemm/deepseek-v3/") for g in gemms)
    assert {(g.shape, g.M) for g in S.gemm_specs(quick=True, model=m)} == {("gate_up", 256), ("gate_up", 16384)}
    layers = S.layer_specs(model=m)
    assert [(s.T, s.quant) for s in layers] == [(s.T, s.quant) for s in S.layer_specs()]
    spec = layers[0]
    assert spec.config() == c and spec.arch == "deepseek_v3" and spec.name == "layer/deepseek-v3/E=256/H=7168/I=2048/none/T=32"
    assert spec.flops == 6 * 32 * (8 + 1) * 7168 * 2048  # topk + the shared expert
    assert spec.fields()["routing"] == "biased_grouped_topk" and spec.fields()["shape"] == "deepseek-v3"
    assert layers[-1].config().quant == "fp8_block"
    (gate,) = S.gate_specs(model=m)
    assert gate.config() == c and gate.name == "gate/deepseek-v3/biased_grouped_topk/E=256/T=4096"
    assert {n: S.arch_of_preset(n) for n in ("mixtral-8x7b", "qwen3-30b-a3b", "tiny")} == {
        "mixtral-8x7b": "mixtral", "qwen3-30b-a3b": "qwen3_moe", "tiny": "deepseek_v3"}
    assert S.layer_specs()[0].name == "layer/E=32/H=7168/I=2048/none/T=32"  # the built-in shapes keep their names
    with pytest.raises(ValueError, match="name must be non-empty without '/'"):
        S.BenchModel(name="a/b", config=c, arch=None)
    with pytest.raises(ValueError, match="E, topk, H, I must be those of base"):
        S.LayerSpec(T=4, quant="none", base=c)
    with pytest.raises(ValueError, match="quant must be one of"):
        S.LayerSpec(T=4, quant="fp4")


def test_benchmark_peer_blocks_of_new_presets():
    """The benchmark's transformers peer (``arch_of_preset``): gpt-oss's own ``GptOssMLP`` for gpt-oss; none for
    presets no Mixtral / Qwen3-MoE / DeepSeek-V3 / gpt-oss block expresses (before: gpt-oss and Qwen3-Next got
    Qwen3-MoE's, whose builder then refused them); DeepSeek-V3's block for GLM-4.5-Air and Kimi K2 (the same
    computation)."""
    new_presets = ("gpt-oss-20b", "gpt-oss-120b", "llama4-scout", "llama4-maverick", "qwen3-next-80b-a3b",
                   "glm-4.5-air", "kimi-k2")
    got = {n: S.arch_of_preset(n) for n in new_presets}
    assert got == {"gpt-oss-20b": "gpt_oss", "gpt-oss-120b": "gpt_oss", "llama4-scout": None, "llama4-maverick": None,
                   "qwen3-next-80b-a3b": None, "glm-4.5-air": "deepseek_v3", "kimi-k2": "deepseek_v3"}
    assert {n: S.arch_of_preset(n) for n in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")} == {
        "mixtral-8x7b": "mixtral", "qwen3-30b-a3b": "qwen3_moe", "deepseek-v3": "deepseek_v3"}


def test_benchmark_specs_time_4bit_layers_with_their_own_bytes():
    """The benchmark's layer rows time 4-bit layers with their own byte model (before: refused, since FP8's 8 bits a
    weight would have been wrong): MXFP4 rows count 4.25 bits a weight, INT4 4.5, not FP8's 8; an unknown quant is
    still a ValueError naming the modes."""
    from moe_contract import MoEConfig

    gpt_oss = MoEConfig(hidden_size=64, intermediate_size=32, num_experts=4, topk=2, routing="softmax_topk",
                        renormalize=True, activation="swiglu_oai", gate_up_layout="interleaved")
    assert {"mxfp4", "int4", "fp8_block"} <= set(S.BENCH_QUANTS)
    rows = {q: S.LayerSpec(T=4, quant=q, E=4, topk=2, H=64, I=32, touched=2) for q in ("fp8_per_token", "mxfp4", "int4")}
    weights = {q: r.min_bytes - 2 * 4 * 64 * 2 for q, r in rows.items()}  # minus x read and out written
    assert weights == {"fp8_per_token": 2 * 3 * 64 * 32, "mxfp4": 2 * 3 * 64 * 32 * 4.25 / 8,
                       "int4": 2 * 3 * 64 * 32 * 4.5 / 8}
    with pytest.raises(ValueError, match=r"LayerSpec: quant must be one of .*got quant='fp4'"):
        S.LayerSpec(T=4, quant="fp4", E=4, topk=2, H=64, I=32)
    with pytest.raises(ValueError, match=r"BenchModel: quants must be a non-empty tuple of .* got \('fp4',\)"):
        S.BenchModel(name="x", config=gpt_oss, arch=None, quants=("fp4",))


def test_tiny_refuses_a_preset_too_large_to_interpret(tmp_path, monkeypatch, capsys):
    """--tiny --preset deepseek-v3 would interpret an 11G-element layer on the CPU: refused before any work."""
    monkeypatch.setattr(bench, "TINY", True)
    assert bench.main(["--tiny", "--preset", "deepseek-v3", "--out", str(tmp_path / "o")]) == 2
    assert "preset deepseek-v3 has 11318M weight elements" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):
        bench.parse_args(["--layer", "1"])  # --layer needs --weights
    assert "--layer needs --weights" in capsys.readouterr().err


def _save_hf_model(folder, arch: str, *, H: int = 64, I: int = 32, fp8: bool = False) -> None:
    """A one-MoE-layer transformers model of ``arch`` written by ``save_pretrained`` (bf16), its weights redrawn
    ~ N(0, 1/fan_in) (HF's N(0, 0.02) init would give near-equal router logits, i.e. near-ties at the top-k edge)
    and DeepSeek-V3's bias ~ U[0, 0.1]. ``fp8``: the expert projections then rewritten as float8_e4m3fn codes
    with 128x128 ``weight_scale_inv`` (DeepSeek-V3's FP8 format; needs H, I multiples of 128)."""
    import torch
    import transformers as tf

    common = dict(vocab_size=32, hidden_size=H, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    if arch == "mixtral":
        cfg, cls = tf.MixtralConfig(intermediate_size=I, num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2,
                                    **common), tf.MixtralForCausalLM
    elif arch == "qwen3_moe":
        cfg, cls = tf.Qwen3MoeConfig(intermediate_size=2 * I, moe_intermediate_size=I, num_hidden_layers=1, num_experts=4,
                                     num_experts_per_tok=2, norm_topk_prob=True, **common), tf.Qwen3MoeForCausalLM
    else:
        common.update(num_key_value_heads=2)
        cfg, cls = tf.DeepseekV3Config(intermediate_size=2 * I, moe_intermediate_size=I, num_hidden_layers=2,
                                       first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                       topk_group=2, n_shared_experts=1, q_lora_rank=None, kv_lora_rank=16,
                                       qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, **common), tf.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.rand(b.shape, generator=g))
    model.to(torch.bfloat16).save_pretrained(folder)
    if fp8:
        from safetensors.torch import load_file, save_file

        import moe_torch

        path = os.path.join(folder, "model.safetensors")
        tensors = load_file(path)
        for key in [k for k in tensors if ".experts." in k or ".shared_experts." in k]:
            q, scale = moe_torch.quantize_weight_fp8(tensors[key].float()[None], "block")
            tensors[key], tensors[key + "_scale_inv"] = q[0].contiguous(), scale[0].contiguous()
        save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    pytest.importorskip("transformers")
    out = {}
    for arch in CKPT_ARCHS:
        out[arch] = tmp_path_factory.mktemp(arch)
        _save_hf_model(str(out[arch]), arch)
    return out


#: The checkpoint families ``bench.py --weights`` reads (gpt-oss's MXFP4 checkpoints are not among them; its
#: layer is benchmarked from its preset: ``--what decode``).
CKPT_ARCHS = ("mixtral", "qwen3_moe", "deepseek_v3")


@pytest.mark.parametrize("arch", CKPT_ARCHS)
def test_bench_layer_runs_checkpoint_weights_against_their_transformers_block(arch, hf_checkpoints, tmp_path):
    """--weights of a checkpoint written by transformers' save_pretrained: the layer rows run its weights (routed
    and shared experts, router, bias: bit for bit), the peer is transformers' block of that model, and every row
    is judged against our reference: the transformers rows' rel_err (their distance from our layer) is within the
    bf16 rule and not zero (our kernels on these weights: the `epmoe bench --tiny` test below)."""
    import torch
    from safetensors.torch import load_file

    path = str(hf_checkpoints[arch])
    args = bench.parse_args(["--weights", path, "--out", str(tmp_path), "--backends", "transformers,ref-torch",
                             "--rep-ms", "2", "--warmup-ms", "1"])
    model, ckpt = bench.load_model(args)
    L = 1 if arch == "deepseek_v3" else 0
    assert model.name == f"ckpt-{arch}-L{L}" and model.arch == arch and model.weights
    assert model.quants == ("none", "fp8_per_token")  # H=64, I=32: no 128x128 blocks (fp8_block)
    ctx = bench.Ctx(args, model, ckpt)
    specs = S.layer_specs(tiny=True, model=model)
    assert {s.name.split("/")[1] for s in specs} == {model.name} and specs[0].E == model.config.num_experts

    # the weights the rows take are the file's
    file = load_file(os.path.join(path, "model.safetensors"))
    mod, (gn, un, dn) = (("block_sparse_moe", ("w1", "w3", "w2")) if arch == "mixtral"
                         else ("mlp", ("gate_proj", "up_proj", "down_proj")))
    pre = f"model.layers.{L}.{mod}"
    w13, _, w2, _ = bench.layer_weights(ctx, specs[0], specs[0].config())
    gate_w, bias = bench.layer_router(ctx, specs[0], specs[0].config())
    assert torch.equal(w13[1], torch.cat([file[f"{pre}.experts.1.{gn}.weight"], file[f"{pre}.experts.1.{un}.weight"]]).to(w13))
    assert torch.equal(w2[3], file[f"{pre}.experts.3.{dn}.weight"].to(w2))
    assert torch.equal(gate_w, file[f"{pre}.gate.weight"].float().to(gate_w))
    if arch == "deepseek_v3":
        E = model.config.num_experts
        assert w13.shape[0] == E + 1 and torch.equal(w2[E], file[f"{pre}.shared_experts.down_proj.weight"].to(w2))
        assert torch.equal(bias, file[f"{pre}.gate.e_score_correction_bias"].float().to(bias))
    else:
        assert bias is None

    layer_w: dict = {}
    for spec in specs:
        bench.bench_layer(ctx, spec, layer_w)
    rows = {(r["spec"].rsplit("/", 2)[-2], int(r["T"]), r["backend"]): r for r in _timed(ctx.rows)}
    block = f"transformers-{S.HF_BLOCKS[arch]}"
    assert {k for k in rows if k[2].startswith("transformers")} == {
        (q, T, b) for q in ("none",) for T in (4, 16) for b in (block, block + "-eager")}
    for key, r in rows.items():
        assert r["error"] is None and r["median_ms"] > 0, r
        if key[2].startswith("transformers"):
            assert 1e-4 < r["rel_err"] < 1e-2, r


def test_bench_layer_runs_an_fp8_checkpoint_as_stored_and_dequantized(tmp_path):
    """An FP8 (DeepSeek-V3 format) checkpoint: quant 'fp8_block' rows run its codes and block scales as stored,
    quant 'none' rows its dequantized weights, against which transformers' DeepseekV3MoE is the peer."""
    import torch
    from safetensors.torch import load_file

    pytest.importorskip("transformers")
    path = str(tmp_path / "ckpt")
    _save_hf_model(path, "deepseek_v3", H=128, I=128, fp8=True)
    args = bench.parse_args(["--weights", path, "--out", str(tmp_path), "--backends", "transformers,ref-torch",
                             "--rep-ms", "2", "--warmup-ms", "1"])
    model, ckpt = bench.load_model(args)
    assert model.quants == ("none", "fp8_block")
    ctx = bench.Ctx(args, model, ckpt)
    specs = S.layer_specs(tiny=True, model=model)
    file = load_file(os.path.join(path, "model.safetensors"))
    q, s = file["model.layers.1.mlp.experts.2.down_proj.weight"], file["model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"]
    w13, s13, w2, s2 = bench.layer_weights(ctx, specs[-1], specs[-1].config())
    assert specs[-1].quant == "fp8_block" and w2.dtype == torch.float8_e4m3fn
    assert torch.equal(w2[2].view(torch.uint8).cpu(), q.view(torch.uint8)) and torch.equal(s2[2].cpu(), s)
    w13, s13, w2, s2 = bench.layer_weights(ctx, specs[0], specs[0].config())
    assert specs[0].quant == "none" and s2 is None and w2.dtype == torch.bfloat16
    assert torch.equal(w2[2].cpu(), (q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.bfloat16))
    layer_w: dict = {}
    for spec in specs:
        bench.bench_layer(ctx, spec, layer_w)
    for r in _timed(ctx.rows):
        assert r["error"] is None and r["median_ms"] > 0, r
    assert {r["quant"] for r in _timed(ctx.rows) if r["backend"].startswith("transformers-DeepseekV3MoE")} == {"none"}
    assert {r["quant"] for r in ctx.rows if r["backend"] == "ref-torch"} == {"none", "fp8_block"}


@needs_triton_interpreter  # `epmoe bench --tiny`: a child with TRITON_INTERPRET=1 (bench.py's TINY)
def test_epmoe_bench_tiny_with_a_checkpoint_writes_labelled_tables_and_plots(hf_checkpoints, tmp_path, capfd):
    """`epmoe bench --tiny --weights DIR` on the CPU end to end: exit 0, our (interpreted) Pallas kernels and the
    DeepSeek-V3 peer on the checkpoint's layer, every row right, the tables and the plots (gate included)
    written, the tables saying the kernels ran interpreted."""
    from interop.cli import main

    out = tmp_path / "out"
    rc = main(["bench", "--tiny", "--weights", str(hf_checkpoints["deepseek_v3"]), "--what", "layer,gate",
               "--backends", "transformers,ours-jax-pallas_triton", "--rep-ms", "2", "--warmup-ms", "1",
               "--out", str(out)])
    stdout = capfd.readouterr().out  # `epmoe bench --tiny` runs bench.py in a child process
    assert rc == 0, stdout[-3000:]
    assert "model ckpt-deepseek_v3-L1 (E=8 topk=2 H=64 I=32 biased_grouped_topk shared=1, weights from" in stdout
    doc = json.loads((out / "bench.json").read_text())
    assert doc["meta"]["model"] == "ckpt-deepseek_v3-L1" and doc["meta"]["hf_block"] == "DeepseekV3MoE"
    got = {(r["bench"], r["backend"]) for r in doc["rows"]}
    assert got == {("layer", "ours-jax-pallas_triton"), ("layer", "transformers-DeepseekV3MoE"),
                   ("layer", "transformers-DeepseekV3MoE-eager"), ("gate", "ours-jax-pallas_triton")}
    for r in _timed(doc["rows"]):
        assert r["error"] is None and r["rel_err"] < 1e-2 and r["median_ms"] > 0, r
    md = (out / "bench.md").read_text()
    assert H.CPU_NOTE in md.splitlines()[0] and "| ours-jax-pallas_triton (interpreted) |" in md
    for name in ("bench_layer.png", "bench_gate.png"):
        assert (out / name).stat().st_size > 10_000


# ---------------------------------------------------------------------------------------------- plots


def _timed_rows(scale: float, floor_frac: float) -> list[dict]:
    """Timed gemm / layer / gate rows: medians ``scale * (1..5)`` ms, each spec's roofline floor ``scale *
    floor_frac`` ms (as add_rates gives it: ``pct_of_ceiling = 100 * floor / median``)."""
    rows = []
    for k, spec in enumerate(S.gemm_specs(quick=True) + S.layer_specs(quick=True) + S.gate_specs()):
        for i, b in enumerate(("ours-torch-triton", "ref-torch", "torch._grouped_mm")):
            ms = scale * (1 + i + k % 3)
            rows.append(H.make_row(spec.name.split("/")[0], b, spec, median_ms=ms, p20_ms=0.9 * ms, p80_ms=1.1 * ms,
                                   pct_of_ceiling=100 * scale * floor_frac / ms))
    return rows


@pytest.mark.parametrize("cpu", [True, False])
def test_plots_floor_does_not_squash_the_axis_and_legends_cover_no_panel(cpu):
    """Regression: on the CPU the roofline floor lay 4-7 decades under the times and, drawn on the same
    log axis, squashed every line into its top; the legends (``loc="best"``) sat over lines. Now: a floor far
    below is left off (the axis spans the times; the title gives the floor), a floor near the times is drawn and
    in range; each figure's one legend lies outside every panel; CPU titles say the kernels ran interpreted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale, frac = (10.0, 1e-6) if cpu else (0.5, 0.4)
    rows = _timed_rows(scale, frac)
    for make in (H.gemm_figure, H.layer_figure, H.gate_figure):
        fig = make(rows, cpu=cpu)
        fig.canvas.draw()
        used = [ax for ax in fig.axes if ax.axison]
        assert used, make
        for ax in used:
            title = ax.get_title()
            assert (H.CPU_TITLE in title) == cpu, title
            assert ("below the axis, not drawn" in title) == cpu, title
            lo, hi = ax.get_xlim() if make is H.gate_figure else ax.get_ylim()
            dotted = [ln for ln in ax.get_lines() if ln.get_linestyle() == ":"]
            if cpu:
                assert lo > scale / 10 and not dotted, (make, lo)  # the axis holds the times, not the floor
            else:
                assert lo < scale * frac and dotted, (make, lo)  # the floor is drawn, within the axis
            assert hi > scale
        for legend in fig.legends:  # outside every panel: it covers no line
            box = legend.get_window_extent()
            for ax in used:
                assert not box.overlaps(ax.get_window_extent()), make
        if make is H.gate_figure:
            assert not fig.legends and len(used[0].patches) == 3  # one bar per backend, named on the axis
        else:
            assert len(fig.legends) == 1 and not any(ax.get_legend() for ax in used)
        plt.close(fig)


def test_tables_label_cpu_timings():
    """On the CPU the tables' headings and our (interpreted) kernels' columns say so; on the GPU nothing does."""
    rows = _timed_rows(1.0, 0.5)
    cpu, gpu = H.markdown_pivot(rows, cpu=True), H.markdown_pivot(rows, cpu=False)
    assert cpu.count(H.CPU_NOTE) == 3 and "| ours-torch-triton (interpreted) | ref-torch |" in cpu
    assert "interpreted" not in gpu and "interpreted" not in H.markdown_long(rows)
    assert H.CPU_NOTE in H.markdown_long(rows, cpu=True).splitlines()[0]


def test_cpu_labels_say_what_ran():
    """A user trap: `bench --tiny` labelled a column "ours-jax-pallas_mosaic_gpu (interpreted)" (a kernel that never
    runs on a CPU) and the library's default (the reference there) "(interpreted)" too. Only our Triton and
    Pallas-Triton kernels run interpreted; on a GPU no label changes."""
    label = H.backend_label
    assert label("ours-torch-triton", True) == "ours-torch-triton (interpreted)"
    assert label("ours-torch-triton-cudagraph", True) == "ours-torch-triton-cudagraph (interpreted)"
    assert label("ours-jax-pallas_triton-recompute", True) == "ours-jax-pallas_triton-recompute (interpreted)"
    assert label("ours-jax-pallas_mosaic_gpu", True) == "ours-jax-pallas_mosaic_gpu"
    assert label("ours-jax-default", True) == "ours-jax-default (reference on a CPU)"
    for b in ("ours-torch-triton", "ours-jax-pallas_mosaic_gpu", "ours-jax-default", "ref-jax"):
        assert label(b, False) == b


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here: these backends run")
def test_cpu_skips_gpu_only_gemm_backends(tmp_path):
    """A user trap: `bench --tiny` counted the GPU-only backends of the gemm rows (Mosaic GPU kernels, CUDA's
    torch._scaled_grouped_mm) as errors; on the CPU they are skip rows naming the reason."""
    args = bench.parse_args(["--out", str(tmp_path), "--rep-ms", "1", "--warmup-ms", "1",
                             "--backends", "mosaic_gpu,ragged_dot_mgpu,_scaled_grouped_mm"])
    ctx = bench.Ctx(args)
    for dtype in ("bf16", "fp8"):
        spec = next(s for s in S.gemm_specs(tiny=True) if s.dtype == dtype and s.M == 16)
        bench.bench_gemm(ctx, spec, bench.GemmWeights())
    got = {r["backend"]: r["error"] for r in ctx.rows}
    assert set(got) == {"ours-jax-pallas_mosaic_gpu", "jax-ragged_dot_mgpu", "torch._scaled_grouped_mm"}, got
    assert all(H.skipped(r) for r in ctx.rows), got
    assert "CUDA kernels only" in got["torch._scaled_grouped_mm"] and "Mosaic GPU" in got["jax-ragged_dot_mgpu"]
    line = bench.progress_line(ctx.rows[0], 1.0)
    assert " SKIP pallas_mosaic_gpu needs a Hopper GPU" in line and "ERROR" not in line, line


def test_bench_help_shows_tiny(capsys):
    """A user trap: the README advertises `epmoe bench --tiny`, and `bench --help` hid it."""
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    assert "--tiny" in capsys.readouterr().out


def test_bench_weights_with_preset_says_it_is_not_used(hf_checkpoints, tmp_path, capsys):
    """A user trap: `bench --weights DIR --preset X` dropped --preset without a word where config.json gives the
    routing (its documented use: the routing of a checkpoint without config.json)."""
    args = bench.parse_args(["--weights", str(hf_checkpoints["mixtral"]), "--preset", "mixtral-8x7b",
                             "--out", str(tmp_path)])
    bench.load_model(args)
    assert "bench: --preset mixtral-8x7b not used: the routing comes from" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- forward + backward


def test_bwd_specs_shapes_and_flops():
    """--what gemm_bwd,layer_bwd: the backward targets' shapes (E=32, uniform rows, bf16: gate_up K=7168 N=4096 and down K=2048
    N=7168 at M in {4096, 16384}; the layer H=7168 I=2048 topk 8 at T in {512, 4096}), the backward counted as two
    GEMMs per forward GEMM, names apart from the forward specs; FP8 refused (its codes get no gradient)."""
    full = S.gemm_bwd_specs()
    assert [(g.shape, g.K, g.N, g.M, g.E, g.routing, g.dtype) for g in full] == [
        ("gate_up", 7168, 4096, 4096, 32, "uniform", "bf16"), ("gate_up", 7168, 4096, 16384, 32, "uniform", "bf16"),
        ("down", 2048, 7168, 4096, 32, "uniform", "bf16"), ("down", 2048, 7168, 16384, 32, "uniform", "bf16")]
    g = full[1]
    assert g.name == "gemm_bwd/gate_up/bf16/M=16384/uniform" and g.fwd_flops == 2 * 16384 * 4096 * 7168
    assert g.bwd_flops == 2 * g.fwd_flops and g.flops == 3 * g.fwd_flops and g.min_bytes > S.GemmSpec(
        shape="gate_up", E=32, K=7168, N=4096, M=16384, routing="uniform", dtype="bf16").min_bytes
    layers = S.layer_bwd_specs()
    assert [(s.T, s.E, s.H, s.I, s.topk, s.quant) for s in layers] == [(512, 32, 7168, 2048, 8, "none"),
                                                                       (4096, 32, 7168, 2048, 8, "none")]
    assert layers[0].name == "layer_bwd/E=32/H=7168/I=2048/none/T=512" and layers[0].arch == "qwen3_moe"
    assert layers[0].fwd_flops == 6 * 512 * 8 * 7168 * 2048 and layers[0].bwd_flops == 2 * layers[0].fwd_flops
    assert len(S.gemm_bwd_specs(quick=True)) == len(S.layer_bwd_specs(quick=True)) == 1
    assert len(S.gemm_bwd_specs(tiny=True)) == len(S.layer_bwd_specs(tiny=True)) == 1
    m = S.preset_model("deepseek-v3")
    assert {(s.shape, s.E, s.K, s.N) for s in S.gemm_bwd_specs(model=m)} == {("gate_up", 256, 7168, 4096),
                                                                            ("down", 256, 2048, 7168)}
    assert S.layer_bwd_specs(model=m)[0].num_shared == 1
    with pytest.raises(ValueError, match="GemmBwdSpec: dtype must be 'bf16'"):
        S.GemmBwdSpec(shape="x", E=2, K=64, N=32, M=16, routing="uniform", dtype="fp8")
    with pytest.raises(ValueError, match="LayerBwdSpec: quant must be 'none'"):
        S.LayerBwdSpec(T=4, quant="fp8_per_token")
    assert bench.parse_args(["--what", "gemm_bwd,layer_bwd"]).what == ["gemm_bwd", "layer_bwd"]
    assert bench.parse_args([]).what == ["gemm", "layer", "gate"]  # the backward benches only on request


def test_bwd_rates_tables_and_skipped_rows():
    """bwd_ms = fwd+bwd - fwd, the ratio and the backward's TFLOP/s from it; skipped rows are neither timed nor
    errors in the summary and show SKIP; the forward + backward table has a line per row."""
    spec = S.gemm_bwd_specs()[0]
    row = H.make_row("gemm_bwd", "x", spec, median_ms=3.0)
    H.add_bwd_rates(row, 1.0, spec.bwd_flops)
    assert (row["fwd_ms"], row["bwd_ms"], row["bwd_fwd_ratio"]) == (1.0, 2.0, 2.0)
    assert row["bwd_tflops"] == pytest.approx(spec.bwd_flops / 2e-3 / 1e12)
    noisy = H.add_bwd_rates(H.make_row("gemm_bwd", "y", spec, median_ms=1.0), 1.2, spec.bwd_flops)
    assert noisy["bwd_ms"] == pytest.approx(-0.2) and noisy["bwd_fwd_ratio"] is None and noisy["bwd_tflops"] is None
    skip = H.make_row("gemm_bwd", "tokamax.ragged_dot-mosaic", spec, error=H.SKIPPED + "needs a GPU")
    bad = H.make_row("gemm_bwd", "z", spec, error="WRONG: d_w rel_err=0.1 > 0.02; not timed")
    rows = [row, noisy, skip, bad]
    assert H.stats_line(rows) == "4 rows, 2 timed, 1 skipped, 1 errors (1 wrong results)"
    pivot = H.markdown_pivot(rows)
    assert "| SKIP | WRONG |" in pivot and "median ms of forward + backward" in pivot and "a gradient's > 0.02" in pivot
    table = H.markdown_bwd(rows)
    assert table.count("\n") == len(rows) + 1 and "| 1 | 3 | 2 |" in table and "needs a GPU" in table
    assert H.markdown_bwd(fake_rows()) == ""  # no backward rows: no table


def test_bwd_guard_refuses_a_planted_wrong_gradient(tmp_path, monkeypatch):
    """The correctness gate covers gradients: a backward whose d_w is 10% off (planted in the torch and in the JAX
    reference wgrad) gives a WRONG row naming d_w, not timed (no time, no forward time, no memory), while the
    forward output and d_x pass; unplanted, the same rows are timed."""
    pytest.importorskip("torch")
    import jax.numpy as jnp

    import moe_pallas.ops.grouped_gemm.api as japi
    import moe_torch.ops.grouped_gemm.api as tapi

    args = ["--out", str(tmp_path), "--backends", "ref-torch,ref-jax", "--rep-ms", "2", "--warmup-ms", "1"]
    spec = S.gemm_bwd_specs(tiny=True)[0]
    good = bench.Ctx(bench.parse_args(args))
    bench.bench_gemm_bwd(good, spec, bench.GemmWeights())
    assert [r["backend"] for r in good.rows] == ["ref-torch", "ref-jax"]
    for r in good.rows:
        assert r["error"] is None and r["median_ms"] > 0 and r["fwd_ms"] > 0 and r["grad_rel_err"] < 1e-2, r

    t_wgrad, j_wgrad = tapi._wgrad, japi.grouped_gemm_wgrad_reference
    monkeypatch.setattr(tapi, "_wgrad", lambda *a: t_wgrad(*a) * 1.1)
    monkeypatch.setattr(japi, "grouped_gemm_wgrad_reference", lambda *a: (j_wgrad(*a) * 1.1).astype(jnp.bfloat16))
    ctx = bench.Ctx(bench.parse_args(args))
    bench.bench_gemm_bwd(ctx, spec, bench.GemmWeights())
    assert [r["backend"] for r in ctx.rows] == ["ref-torch", "ref-jax"]
    for r in ctx.rows:
        assert r["error"].startswith("WRONG: d_w rel_err=0.1") and "not timed" in r["error"], r
        assert r["median_ms"] is None and r["fwd_ms"] is None and r["bwd_tflops"] is None, r
        assert r["rel_err"] < 1e-2 and r["grad_rel_err"] == pytest.approx(0.1, rel=0.05), r  # y and d_x still right


@needs_triton_interpreter  # `bench.py --tiny`: ours-torch-triton rows run in Triton's interpreter
def test_tiny_bwd_run_every_row_correct_and_missing_peers_skipped(tmp_path):
    """`bench.py --tiny --what gemm_bwd,layer_bwd` on the CPU (kernels interpreted): exit 0; every backend and peer
    of the backward rows has its row; every row that ran is right (forward and each gradient) and timed (forward and
    forward + backward; JAX rows with XLA's memory analysis and what the forward holds, torch rows saying their
    CUDA peak is n/a here); the layer with recompute False and True, the recompute rows holding less; Mosaic GPU
    and tokamax skipped with their reason, not errors."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench.py"), "--tiny", "--what",
                          "gemm_bwd,layer_bwd", "--rep-ms", "1", "--warmup-ms", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=root, timeout=600, env=env)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    got = {(r["bench"], r["backend"]) for r in rows}
    ours = ("ours-jax-pallas_triton", "ours-jax-pallas_mosaic_gpu", "ref-jax", "ours-torch-triton", "ref-torch")
    assert got == {("gemm_bwd", b) for b in (*ours, "torch._grouped_mm", "tokamax.ragged_dot-mosaic", "jax.lax.ragged_dot")} | {
        ("layer_bwd", b + rc) for b in ours for rc in ("", "-recompute")} | {("layer_bwd", "transformers-Qwen3MoeSparseMoeBlock")}
    skipped = {r["backend"]: r["error"] for r in rows if H.skipped(r)}
    assert set(skipped) == {"ours-jax-pallas_mosaic_gpu", "ours-jax-pallas_mosaic_gpu-recompute", "tokamax.ragged_dot-mosaic"}
    assert all("needs" in why and "GPU" in why for why in skipped.values()), skipped
    for r in rows:
        if H.skipped(r):
            assert r["median_ms"] is None, r
            continue
        assert r["error"] is None, r
        assert r["rel_err"] <= H.REL_ERR_MAX and r["grad_rel_err"] <= H.GRAD_REL_ERR_MAX, r
        assert r["median_ms"] > 0 and r["fwd_ms"] > 0 and r["bwd_ms"] is not None, r
        jax_row = "jax" in r["backend"]
        assert r["mem_method"] == ("xla memory_analysis temp+output" if jax_row else
                                   "n/a: torch.cuda memory stats only on a GPU"), r
        assert (r["peak_mem_mib"] is not None) == jax_row and (r["held_mib"] is not None) == jax_row, r
        if r["bench"] == "layer_bwd" and not r["backend"].startswith("transformers"):
            assert r["recompute"] == r["backend"].endswith("-recompute"), r
    held = {(r["spec"], r["backend"]): r["held_mib"] for r in rows if r["held_mib"] is not None}
    layer_jax = [k for k in held if k[0].startswith("layer_bwd") and not k[1].endswith("-recompute")]
    assert layer_jax and all(held[s, b + "-recompute"] < held[s, b] for s, b in layer_jax), held  # h not kept
    assert "19 rows, 15 timed, 4 skipped, 0 errors (0 wrong results)" in run.stdout
    md = (tmp_path / "bench.md").read_text()
    assert "## Forward + backward" in md and "| gemm_bwd/tiny/bf16/M=64/uniform | ours-torch-triton (interpreted) |" in md


# ---------------------------------------------------------------------------------------------- memory columns


class FakeCudaMemory:
    """The interface of ``harness.CudaMemoryStats`` over a counting stand-in for the caching allocator:
    ``alloc(nbytes)`` returns a buffer counted as allocated until it is garbage (as a CUDA tensor would be)."""

    method = "fake counters"

    class Buffer:
        pass

    def __init__(self):
        import weakref

        self._finalize = weakref.finalize
        self.now = self.peak = 0

    def alloc(self, nbytes: int):
        buf = self.Buffer()
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        self._finalize(buf, self._free, nbytes)
        return buf

    def _free(self, nbytes: int) -> None:
        self.now -= nbytes

    def sync(self) -> None:
        pass

    def reset_peak(self) -> None:
        self.peak = self.now

    def allocated(self) -> int:
        return self.now

    def max_allocated(self) -> int:
        return self.peak


MIB = 2**20


def _fake_torch_backend(mem: FakeCudaMemory, x, d_y, *, out: int, act: int, tmp: int, grad: int, recompute: bool):
    """A torch-like forward + backward with planted allocations (MiB): the forward allocates its output
    ``out`` and an activation ``act`` (kept for the backward unless ``recompute``); the backward, in this
    order: (recompute: ``act`` again), a transient ``tmp``, (recompute: ``act`` freed), the gradients
    ``grad``; the graph (a kept ``act``) is freed when the caller drops the result. Numerically
    ``y = 2 x``, ``d_x = 2 d_y`` (right, so the row is judged correct and measured).
    Peak: ``out + act + max(tmp, grad)``, recompute ``out + max(act + tmp, grad)``; held after the
    forward: ``out + act``, recompute ``out``."""

    def fwd():
        return x * 2, mem.alloc(out * MIB), None if recompute else mem.alloc(act * MIB)

    def fwd_bwd():
        y, o, h = fwd()
        if recompute:
            h = mem.alloc(act * MIB)
        t = mem.alloc(tmp * MIB)
        del t
        if recompute:
            h = None
        g = mem.alloc(grad * MIB)
        return y, (d_y * 2,), (o, h, g)

    return fwd, fwd_bwd


def test_torch_memory_is_measured_per_row_with_injected_counters(tmp_path):
    """Each torch forward + backward row reports its own peak and held memory, from counters read around its
    own calls (``ctx.torch_mem_stats`` injected; CUDA's on a GPU): two backends with different allocations
    get different peaks (a large one first must not leak into the small one's: peak reset per row, nothing
    cached per spec, no row dict shared); inputs allocated before are not counted; recompute rows differ
    from their non-recompute twins in held memory and, here where the peak falls after ``h`` would be
    freed, in the peak too. Expected values from the planted sizes (MiB)."""
    import torch

    mem = FakeCudaMemory()
    inputs = mem.alloc(64 * MIB)  # the inputs and weights: allocated before, never counted  # noqa: F841
    ctx = bench.Ctx(bench.parse_args(["--out", str(tmp_path), "--rep-ms", "1", "--warmup-ms", "1"]))
    ctx.torch_mem_stats = mem
    spec = S.gemm_bwd_specs(tiny=True)[0]
    g = torch.Generator().manual_seed(0)
    x, d_y = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
    refs = {"y": x * 2, "d_x": d_y * 2}
    canon = lambda o: {"y": o[0], "d_x": o[1][0]}  # noqa: E731
    plans = {  # backend -> (planted sizes, expected peak, expected held)
        "big": (dict(out=8, act=16, tmp=32, grad=4, recompute=False), 8 + 16 + 32, 8 + 16),
        "small": (dict(out=1, act=2, tmp=1, grad=3, recompute=False), 1 + 2 + 3, 1 + 2),
        "layer": (dict(out=1, act=4, tmp=2, grad=8, recompute=False), 1 + 4 + 8, 1 + 4),
        "layer-recompute": (dict(out=1, act=4, tmp=2, grad=8, recompute=True), 1 + max(4 + 2, 8), 1),
    }
    rows = {}
    for name, (sizes, _, _) in plans.items():
        fwd, fwd_bwd = _fake_torch_backend(mem, x, d_y, **sizes)
        rows[name] = bench.run_torch_bwd(ctx, "gemm_bwd", name, spec, fwd, fwd_bwd, refs, canon=canon,
                                         recompute=sizes["recompute"])
    assert len({id(r) for r in rows.values()}) == len(rows) and ctx.rows == list(rows.values())
    for name, (_, peak, held) in plans.items():
        r = rows[name]
        assert r["error"] is None and r["median_ms"] > 0, r
        assert (r["peak_mem_mib"], r["held_mib"], r["mem_method"]) == (peak, held, "fake counters"), (name, r)
    assert rows["layer-recompute"]["peak_mem_mib"] < rows["layer"]["peak_mem_mib"]
    assert mem.allocated() == 64 * MIB  # every planted buffer freed: the measurement holds nothing
    table = H.markdown_bwd(ctx.rows)
    assert "| 56 | fake counters | 24 |" in table and "| 6 | fake counters | 3 |" in table, table


def test_torch_memory_off_cuda_without_counters_is_none():
    """On the CPU with no counters injected there is no measurement (None, and the reason), not a zero."""
    got = H.torch_memory_mib(lambda: 1, lambda: 2, "cpu")
    assert got == dict(peak_mem_mib=None, held_mib=None, mem_method="n/a: torch.cuda memory stats only on a GPU")


def test_jax_memory_is_each_rows_own_compiled_program(tmp_path):
    """Each JAX forward + backward row's peak is the memory analysis of its own compiled forward + backward
    (not another backend's, not the forward's): a backend whose program also outputs a 4 MiB array reports
    4 MiB more than the lean one; the ``held_mib`` of a ``jax.checkpoint`` (recompute) twin is the forward's
    output alone, less than the plain one's, which also holds ``tanh(x @ w)`` [M, N] float32."""
    import jax
    import jax.numpy as jnp
    import torch

    ctx = bench.Ctx(bench.parse_args(["--out", str(tmp_path), "--rep-ms", "1", "--warmup-ms", "1"]))
    spec = S.gemm_bwd_specs(tiny=True)[0]
    M, K, N = 64, 32, 128
    g = torch.Generator().manual_seed(0)
    x, w, d_y = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g) / K**0.5, torch.randn(M, K, generator=g)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = torch.tanh(xl @ wl) @ wl.T
    refs = dict(zip(("y", "d_x", "d_w"), (y.detach(), *torch.autograd.grad(y, (xl, wl), d_y))))
    canon = lambda o: dict(zip(("y", "d_x", "d_w"), (o[0], *o[1])))  # noqa: E731

    def f(x_, w_):
        return jnp.tanh(x_ @ w_) @ w_.T

    def row(name, fwd, extra: bool = False, recompute=None):
        def fwd_bwd(x_, w_, d_):
            out, vjp = jax.vjp(fwd, x_, w_)
            grads = vjp(d_)
            return (out, grads, jnp.broadcast_to(x_.sum(), (1024, 1024))) if extra else (out, grads)

        return bench.run_jax_bwd(ctx, "gemm_bwd", name, spec, fwd, fwd_bwd, (bench.j(x), bench.j(w)), bench.j(d_y),
                                 refs, canon=canon, recompute=recompute, wrt=(0, 1))

    lean, fat = row("lean", f), row("fat", f, extra=True)
    plain, remat = row("plain", f, recompute=False), row("plain-recompute", jax.checkpoint(f), recompute=True)
    for r in (lean, fat, plain, remat):
        assert r["error"] is None and r["median_ms"] > 0 and r["mem_method"] == "xla memory_analysis temp+output", r
    assert fat["peak_mem_mib"] - lean["peak_mem_mib"] == pytest.approx(4.0, abs=0.05), (fat, lean)
    compiled = [v for k, v in ctx.jit_cache.items() if k[-1].startswith("fwd_bwd")]
    assert sorted(H.jax_memory_mib(c)[0] for c in compiled) == sorted(r["peak_mem_mib"] for r in ctx.rows)
    out_mib = M * K * 4 / MIB
    assert remat["held_mib"] == out_mib, remat
    assert plain["held_mib"] >= out_mib + M * N * 4 / MIB and lean["held_mib"] == plain["held_mib"], (plain, lean)


def test_jax_layer_held_memory_drops_by_h_with_recompute():
    """``moe_pallas.moe_forward`` (reference, bf16): what ``jax.vjp`` holds for the backward with
    ``recompute=False`` exceeds ``recompute=True``'s by exactly GEMM 1's output ``h [T*topk, 2I]`` bf16, and
    both hold more than the output ``[T, H]``: ``held_mib`` sees saved activations (inputs not counted)."""
    import jax
    import jax.numpy as jnp

    import moe_pallas
    from moe_contract import MoEConfig

    T, H_, I, E, k = 48, 64, 32, 4, 2
    c = MoEConfig(hidden_size=H_, intermediate_size=I, num_experts=E, topk=k, routing="softmax_topk", renormalize=True)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    args = (jax.random.normal(keys[0], (T, H_), jnp.bfloat16), jax.random.normal(keys[1], (T, E)),
            jax.random.normal(keys[2], (E, 2 * I, H_), jnp.bfloat16), jax.random.normal(keys[3], (E, H_, I), jnp.bfloat16))
    held = {rc: H.jax_held_mib(lambda *a, rc=rc: moe_pallas.moe_forward(*a, c, implementation="reference", recompute=rc),
                               args) for rc in (False, True)}
    assert held[False] - held[True] == T * k * 2 * I * 2 / MIB, held
    assert held[True] > T * H_ * 2 / MIB, held


# ---------------------------------------------------------------------------------------------- decode rows


def test_decode_specs_bytes_are_the_weights_read():
    """--what decode: four models in their shipped formats (gpt-oss-120b MXFP4, DeepSeek-V3 FP8 blocks as the last
    of 8 EP ranks, Qwen3-30B-A3B bf16, Kimi K2 INT4) at T in {1, 2, ..., 128}; a row's bytes are its hit experts'
    weights at 2 / 1 / (0.5 + 1/32) / (0.5 + 2/32) bytes a weight (the 4-bit scales included) plus their biases,
    and x / out; setting ``touched`` (the experts the tokens reach) replaces the uniform-routing expectation; the EP
    row counts only its rank's 32 routed experts and the shared one. ``--preset``: that layer in bf16, MXFP4 and
    INT4; quick: T in {1, 64}; tiny: gpt-oss's semantics at E=4, H=64, I=32."""
    specs = S.decode_specs()
    ts = (1, 2, 4, 8, 16, 32, 64, 128)
    assert [(s.model, s.quant, s.ep_size, s.T) for s in specs] == [
        (m, q, ep, T) for m, q, ep in (("gpt-oss-120b", "mxfp4", 1), ("deepseek-v3", "fp8_block", 8),
                                       ("qwen3-30b-a3b", "none", 1), ("kimi-k2", "int4", 1)) for T in ts]
    s = specs[0]
    assert s.name == "decode/gpt-oss-120b/E=128/H=2880/I=2880/mxfp4/T=1" and s.arch == "gpt_oss" and s.dtype == "bf16"
    H_, I_ = 2880, 2880
    per_expert = 3 * H_ * I_ * (0.5 + 1 / 32) + (2 * I_ + H_) * 2
    hit = 128 * (1 - (1 - 4 / 128) ** 1)  # = topk at T=1
    assert s.min_bytes == pytest.approx(hit * per_expert + 2 * 1 * H_ * 2)
    t = dataclasses.replace(s, touched=3)
    assert t.min_bytes == pytest.approx(3 * per_expert + 2 * H_ * 2) and t.name == s.name
    with pytest.raises(ValueError, match=r"touched must be None or in \[0, E=128\]; got touched=129"):
        dataclasses.replace(s, touched=129)
    dsv3 = specs[len(ts)]  # the last EP8 rank: routed experts 224..255 and the shared expert 256
    c = dsv3.config()
    assert (c.ep_size, c.ep_rank, c.local_expert_range(), c.quant) == (8, 7, (224, 33), "fp8_block")
    assert dsv3.name.endswith("/fp8_block/T=1/ep8") and dsv3.fields()["ep_size"] == 8
    local = 32 * (1 - (1 - 8 / 256) ** 1)
    assert dsv3.min_bytes == pytest.approx((local + 1) * 3 * 7168 * 2048 + 2 * 7168 * 2)
    assert dataclasses.replace(dsv3, touched=2).hit_experts == 3
    with pytest.raises(ValueError, match="ep_size must be >= 1 and divide E=256; got ep_size=3"):
        dataclasses.replace(dsv3, ep_size=3)
    preset = S.decode_specs(model=S.preset_model("gpt-oss-120b"), ts=[1])
    assert [q.quant for q in preset] == ["none", "mxfp4", "int4"] and {q.ep_size for q in preset} == {1}
    int4 = dataclasses.replace(preset[2], touched=3)
    assert int4.min_bytes == pytest.approx(3 * (3 * H_ * I_ * (0.5 + 2 / 32) + (2 * I_ + H_) * 2) + 2 * H_ * 2)
    assert 3.7 < preset[0].min_bytes / preset[1].min_bytes < 3.8  # bf16 / MXFP4 at T=1
    assert [(q.model, q.T) for q in S.decode_specs(quick=True)] == [
        ("gpt-oss-120b", 1), ("gpt-oss-120b", 64), ("deepseek-v3", 1), ("deepseek-v3", 64)]
    tiny = S.decode_specs(tiny=True)
    c = tiny[0].config()
    assert (c.num_experts, c.topk, c.hidden_size, c.intermediate_size) == (4, 2, 64, 32)
    assert (c.activation, c.gate_up_layout, c.expert_bias) == ("swiglu_oai", "interleaved", True)
    kimi = S.decode_specs(model=S.preset_model("kimi-k2"))
    assert {q.E for q in kimi} == {384} and kimi[0].arch == "deepseek_v3"


def test_build_hf_block_gpt_oss_maps_our_weights():
    """transformers' GptOssMLP holding our weights (w13 [E, 2I, H] with gate/up interleaved rows -> its transposed
    gate_up_proj [E, H, 2I], views, no copy; biases; router weight and bias) equals our reference on its router's
    logits in float32 (its output is (hidden, router_scores)); the concatenated layout's weights break it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import moe_torch
    from moe_contract import get_preset

    config = get_preset("gpt-oss-20b").config().replace(num_experts=8, topk=2, hidden_size=64, intermediate_size=32)
    g = torch.Generator().manual_seed(7)
    E, H_, I_ = 8, 64, 32
    w13, w2 = torch.randn(E, 2 * I_, H_, generator=g) * H_**-0.5, torch.randn(E, H_, I_, generator=g) * I_**-0.5
    gate_w, rb = torch.randn(E, H_, generator=g) * H_**-0.5, 0.1 * torch.randn(E, generator=g)
    b13, b2 = 0.1 * torch.randn(E, 2 * I_, generator=g), 0.1 * torch.randn(E, H_, generator=g)
    x = torch.randn(8, H_, generator=g)
    logits = bench.router_logits("gpt_oss", x, gate_w, rb)
    ref = moe_torch.moe_forward(x, logits, w13, w2, config, w13_bias=b13, w2_bias=b2, implementation="reference")
    for impl in ("grouped_mm", "eager"):
        block = bench.build_hf_block(config, w13, w2, gate_w, impl, arch="gpt_oss", router_bias=rb, w13_bias=b13,
                                     w2_bias=b2)
        assert type(block).__name__ == "GptOssMLP" and block.experts.gate_up_proj.data_ptr() == w13.data_ptr()
        with torch.no_grad():
            out = block(x[None])[0].reshape(8, H_)
        assert (out - ref).norm() / ref.norm() < 1e-5, impl
    wrong = moe_torch.moe_forward(x, logits, w13, w2, config.replace(gate_up_layout="concatenated"), w13_bias=b13,
                                  w2_bias=b2, implementation="reference")
    assert (out - wrong).norm() / ref.norm() > 0.05
    with pytest.raises(ValueError, match="GptOssMLP needs router_bias"):
        bench.build_hf_block(config, w13, w2, gate_w, arch="gpt_oss", w13_bias=b13, w2_bias=b2)


@needs_triton_interpreter  # ours-torch-triton runs in Triton's interpreter
def test_tiny_decode_rows_judged_with_touched_bytes(tmp_path, monkeypatch):
    """bench.py --tiny --what decode (gpt-oss's layer at E=4, topk 2, H=64, I=32; T in {1, 4}): our Triton and
    reference rows of bf16, MXFP4 and INT4 weights are judged right and timed, their bytes those of the experts
    the tokens reach (named in the notes; T=1 reaches topk=2 experts), transformers' GptOssMLP is the bf16 rows'
    peer (judged within the bf16 rule) and a skip row for the 4-bit ones, Mosaic GPU a skip row for 4-bit."""
    monkeypatch.setattr(bench, "TINY", True)  # the tiny specs (bench.py reads --tiny from sys.argv at import)
    rc = bench.main(["--tiny", "--what", "decode", "--out", str(tmp_path), "--rep-ms", "1", "--warmup-ms", "1",
                     "--backends", "ours-torch-triton,ref-torch,transformers,mosaic"])
    assert rc == 0
    rows = json.load(open(tmp_path / "bench.json"))
    rows = rows["rows"] if isinstance(rows, dict) else rows
    assert {r["bench"] for r in rows} == {"decode"}
    by = {(r["backend"], r["quant"], r["T"]): r for r in rows}
    for q in ("none", "mxfp4", "int4"):
        for T in (1, 4):
            r = by[("ours-torch-triton", q, T)]
            assert r["error"] is None and r["rel_err"] < 1e-2 and r["median_ms"] > 0, r
            spec = next(s for s in S.decode_specs(tiny=True) if s.quant == q and s.T == T)
            touched = int(re.search(r"the weights of the (\d+) routed experts", r["notes"]).group(1))
            assert (touched == 2) if T == 1 else (2 <= touched <= 4)
            assert r["gbps"] == pytest.approx(dataclasses.replace(spec, touched=touched).min_bytes / r["median_ms"] / 1e6)
            mosaic = by[("ours-jax-pallas_mosaic_gpu", q, T)]
            if q != "none":
                assert mosaic["error"].startswith(H.SKIPPED) and "no 4-bit weights" in mosaic["error"]
                assert by[("transformers-GptOssMLP", q, T)]["error"].startswith(H.SKIPPED)
            else:
                hf = by[("transformers-GptOssMLP", q, T)]
                assert hf["error"] is None and 0 < hf["rel_err"] < 1e-2, hf


@needs_triton_interpreter  # ours-torch-triton runs in Triton's interpreter
def test_bench_weights_of_a_gpt_oss_mxfp4_checkpoint(tmp_path, monkeypatch):
    """--weights of gpt-oss's MXFP4 checkpoint (a new user's trial): the layer rows run the file's codes
    and e8m0 scales as stored (quant mxfp4) and their exact bf16 dequantization (quant none), with the file's router
    bias and expert biases (before: an MXFP4 checkpoint was taken for FP8 and its biases were drawn at random); every
    row is judged against our reference on those tensors, and transformers' GptOssMLP holding them is the peer."""
    pytest.importorskip("transformers")
    import torch

    import moe_torch
    sys.path.insert(0, os.path.dirname(__file__))
    from test_hf_gpt_oss import gpt_oss_block, mxfp4_checkpoint

    folder, stored = mxfp4_checkpoint(gpt_oss_block(4), tmp_path / "ckpt")
    args = bench.parse_args(["--weights", str(folder), "--out", str(tmp_path / "o"), "--rep-ms", "1",
                             "--warmup-ms", "1", "--backends", "ours-torch-triton,ref-torch,transformers"])
    model, ckpt = bench.load_model(args)
    os.makedirs(args.out)
    assert model.arch == "gpt_oss" and model.quants == ("none", "mxfp4") and ckpt["format"] == "mxfp4"
    ctx = bench.Ctx(args, model, ckpt)
    specs = S.layer_specs(tiny=True, model=model)
    w13, s13, w2, s2 = bench.layer_weights(ctx, next(s for s in specs if s.quant == "mxfp4"), model.config)
    assert torch.equal(w13.cpu(), stored["w13"][0].cpu()) and torch.equal(s13.cpu(), stored["w13"][1].cpu())
    wf13, _, _, _ = bench.layer_weights(ctx, specs[0], model.config.replace(quant="none"))
    ref13 = moe_torch.dequantize_weight_mxfp4(stored["w13"][0], stored["w13"][1]).to(torch.bfloat16)
    assert torch.equal(wf13.cpu(), ref13.cpu())
    ex = bench.layer_extras(ctx, specs[0], model.config)
    assert torch.equal(ex["router_bias"].cpu(), ckpt["router_bias"].cpu()) and set(ex) == {"router_bias", "w13_bias",
                                                                                            "w2_bias"}
    monkeypatch.setattr(bench, "TINY", True)
    for spec in specs[:1] + [s for s in specs if s.quant == "mxfp4"][:1]:
        bench.bench_layer(ctx, spec, {})
    rows = {(r["backend"], r["quant"]): r for r in ctx.rows}
    for q in ("none", "mxfp4"):
        r = rows[("ours-torch-triton", q)]
        assert r["error"] is None and r["rel_err"] < 1e-2, r
    hf = rows[("transformers-GptOssMLP", "none")]
    assert hf["error"] is None and hf["rel_err"] < 1e-2, hf


def test_sass_gemm_counts_the_k_loop_of_the_4bit_decode():
    """benchmarks/sass_gemm.py (the instruction counts of BENCHMARKS.md) on the CPU: the MXFP4 K loop
    decodes on packed registers (HMUL2 on bf16 pairs, no float32 -> bf16 conversions), and the e8m0 table shortens
    it (the scales' selects go); the decode path's kernel B counted by ``--kernel decode_down``."""
    from benchmarks import sass_gemm

    with_table = sass_gemm.hottest_loop(sass_gemm.compile_sass("mxfp4", 16, 128, 64, 4, 3))
    ops = sass_gemm.opcodes(with_table)
    assert ops["HMUL2"] >= 32 and ops["HMMA"] == 16 and "F2FP" not in ops, ops
    without = sass_gemm.hottest_loop(sass_gemm.compile_sass("mxfp4", 16, 128, 64, 4, 3, table=False))
    assert len(with_table) < len(without)
    with pytest.raises(ValueError, match="no backward branch"):
        sass_gemm.hottest_loop("        /*0000*/                   EXIT ;\n")
    # the decode path's kernel B: its I loop on the tensor cores, under 6 instructions a weight a lane (as a float32
    # GEMV it took 7.9 at gpt-oss-120b's sizes)
    sass, weights, warps = sass_gemm.compile_decode_sass("decode_down", "mxfp4", 8)
    loop = sass_gemm.mma_loop(sass)
    assert sass_gemm.opcodes(loop)["HMMA"] >= 1 and len(loop) * 32 * warps / weights < 6.0


def test_tuners_keep_their_table_and_refuse_the_other_frameworks(tmp_path):
    """Both tuners can be pointed at the same folder and write the same file name: an existing file keeps its own
    entries (read and validated as the lookups read them, ``selection.read_table``), a new one starts empty, and each
    tuner refuses the other framework's table, a malformed entry or one of another device kind with a ValueError
    naming the file and the entry (the JAX tuner used to die on a KeyError reading the torch tuner's file)."""
    from moe_pallas.ops.grouped_gemm import tune as tj
    from moe_torch.ops.grouped_gemm import tune as tt

    out = tmp_path / "out"
    out.mkdir()
    torch_entry = {"device": "T", "E": 32, "N": 4096, "K": 7168, "M_cap": 256, "dtype": "bf16",
                   "config": {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3}}
    jax_entry = {**torch_entry, "backend": "pallas_triton", "fast_accum": None}
    choice = {"kind": "backend_choice", "op": "grouped_gemm", "layout": "bf16", "E": 32, "N": 4096, "K": 7168,
              "M_cap": 256, "backend": "pallas_triton", "ms": {"pallas_triton": 1.0, "pallas_mosaic_gpu": 2.0},
              "source": "test", "date": "2026-12-02", "command": "pytest"}
    path = str(out / "T.json")
    assert tt.kept_entries(path, "sm90", "T") == {}  # a new file starts empty
    (out / "T.json").write_text(json.dumps([{**torch_entry, "M_cap": 2048}]))
    assert [e["M_cap"] for e in tt.kept_entries(path, "sm90", "T").values()] == [2048]
    with pytest.raises(ValueError, match=re.escape(f"tuned table {path}: entry 0 measured on device 'T', but the "
                                                   f"file holds 'U' entries")):
        tt.kept_entries(path, "sm90", "U")
    (out / "T.json").write_text(json.dumps([jax_entry, choice]))
    with pytest.raises(ValueError, match=re.escape(f"tuned table {path}: entry 0 names a JAX backend")):
        tt.kept_entries(path, "sm90", "T")
    src, configs, others = tj.kept_entries(path, "sm90", "T")
    assert src == path and list(configs.values()) == [jax_entry] and others == [choice]
    (out / "J.json").write_text(json.dumps([jax_entry, choice]))
    assert tj.kept_entries(str(out / "new.json"), "sm90", "T", str(out / "J.json"))[1:] == (
        {tj.entry_key(jax_entry): jax_entry}, [choice])  # --merge names the file kept
    (out / "T2.json").write_text(json.dumps([torch_entry]))
    with pytest.raises(ValueError, match=re.escape(f"tuned table {out / 'T2.json'}: entry 0 has no \"backend\"")):
        tj.kept_entries(str(out / "T2.json"), "sm90", "T")
    (out / "T3.json").write_text(json.dumps([{**jax_entry, "config": {"block_m": 3}}]))
    with pytest.raises(ValueError, match=r"entry 0 config is not a GroupedGemmConfig"):
        tj.kept_entries(str(out / "T3.json"), "sm90", "T")
    (out / "T4.json").write_text(json.dumps([{**jax_entry, "arch": "sm90"}]))
    with pytest.raises(ValueError, match="entry 0 measured on architecture 'sm90', but the file holds 'sm100' entries"):
        tj.kept_entries(str(out / "T4.json"), "sm100", "T")
    assert tj.kept_entries(str(out / "none.json"), "sm90", "T", None) == (None, {}, [])


def test_jax_tuner_routings_and_ws_only(monkeypatch):
    """``moe_pallas.ops.grouped_gemm.tune --routings uniform,zipf`` times each config on the bench's routings (zipf made split_m's
    128-row tiles 7% slower on a row the uniform-only tuner never saw: BENCHMARKS.md): its problems carry
    those rows per expert; an unknown routing is refused by the parser. ``--ws-only`` sweeps the warp-specialized
    configs alone, ``split_m`` and two K blocks a step among them for FP8."""
    import sys as _sys

    import numpy as np

    from benchmarks import specs
    from moe_pallas.ops.grouped_gemm import tune as tj

    for routing in ("uniform", "zipf"):
        off = np.asarray(tj.make_problem(256, 256, 512, "bf16", routing=routing)[2])
        assert off[0] == 0 and off[-1] == 512
        assert np.array_equal(np.diff(off), specs.group_sizes(512, tj.E, routing, 0))
    monkeypatch.setattr(_sys, "argv", ["moe_pallas.ops.grouped_gemm.tune", "--routings", "uniform,skewed"])
    with pytest.raises(SystemExit):
        tj.main()
    ws = tj.mosaic_candidates("fp8_block", False, ws_only=True)
    assert ws and all(c.warp_specialized and c.grid_block_n > 1 for c in ws)
    assert any(c.split_m and c.block_k == 256 for c in ws) and any(not c.split_m for c in ws)
    assert len(tj.mosaic_candidates("fp8_block", False)) > len(ws)


def test_triton_tuner_routings():
    """``moe_torch.ops.grouped_gemm.tune --routings uniform,zipf``: each routing's offsets are the bench's rows per expert
    (``uniform``: M/E each; ``zipf``: ragged, empty experts allowed), non-decreasing, ending at M; bad lists refused."""
    pytest.importorskip("torch")
    from benchmarks import specs as S
    from moe_torch.ops.grouped_gemm import tune as tt

    assert tt.parse_routings("uniform, zipf") == ["uniform", "zipf"]
    for bad in ("", "uniform,skewed"):
        with pytest.raises(ValueError, match="--routings"):
            tt.parse_routings(bad)
    for routing in tt.ROUTINGS:
        off = tt.routing_offsets(16384, routing, device="cpu")
        assert off.dtype == __import__("torch").int32 and off.shape == (tt.E + 1,)
        assert off[0] == 0 and off[-1] == 16384 and bool((off[1:] >= off[:-1]).all())
        assert off.diff().tolist() == S.group_sizes(16384, tt.E, routing).tolist()
    assert set(tt.routing_offsets(16384, "uniform", device="cpu").diff().tolist()) == {512}


def test_tiny_layer_rows_count_the_experts_reached(tmp_path, monkeypatch):
    """Layer rows' bytes are the weights of the experts the tokens reach, not uniform routing's expectation (the
    DeepSeek-V3 T=256 row printed 139% of the copy ceiling when its drawn bias left 170 of 256 experts reached):
    at T=3 (``--ts 3``, any T) the tiny layer (E=4, top-2; uniform expectation 3.5 experts) reaches a whole number
    of experts, named in the notes, and the row's GB/s are those bytes over its time."""
    monkeypatch.setattr(bench, "TINY", True)
    rc = bench.main(["--tiny", "--what", "layer", "--ts", "3", "--layer-quants", "none", "--out", str(tmp_path),
                     "--rep-ms", "1", "--warmup-ms", "1", "--backends", "ref-torch"])
    assert rc == 0
    rows = json.load(open(tmp_path / "bench.json"))
    rows = rows["rows"] if isinstance(rows, dict) else rows
    (r,) = [r for r in rows if r["backend"] == "ref-torch"]
    assert r["T"] == 3 and r["error"] is None, r
    touched = int(re.search(r"the weights of the (\d+) routed experts the tokens reach", r["notes"]).group(1))
    assert 2 <= touched <= 4
    spec = S.layer_specs(tiny=True, ts=[3])[0]
    assert spec.hit_experts == pytest.approx(3.5)  # what the row counted before
    assert r["gbps"] == pytest.approx(dataclasses.replace(spec, touched=touched).min_bytes / r["median_ms"] / 1e6)
