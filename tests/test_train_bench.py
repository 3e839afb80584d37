"""``benchmarks/train_bench.py`` on the CPU at ``--tiny`` sizes: the two torch runs (transformers and
``patch_hf_model``) train to the same loss curve from the same initial weights, the JAX run of the same model does
too, the output files hold what the docstring promises, bad options are refused, and the JAX copy of transformers'
Qwen3-MoE auxiliary loss equals transformers' own.

The auxiliary-loss coefficient is raised (0.5) so that the router losses move the curves: a wrong or missing
auxiliary term in one run would show in the comparison.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `benchmarks` as a namespace package

from benchmarks import train_bench as TB  # noqa: E402

RUN_KEYS = {"arch", "run", "framework", "implementation", "notes", "losses", "aux_losses", "step_times_s",
            "peak_mem_gib", "tokens_per_step", "tokens_per_s", "flops_per_token", "model_tflops", "peak_tflops", "mfu",
            "active_params", "wall_s"}
META_KEYS = {"date", "command", "git", "device_name", "torch", "transformers", "sizes", "loss_rtol",
             "hf_experts_implementation"}


def _read(out) -> dict:
    assert (out / "train_bench.md").is_file()
    with open(out / "train_bench.json") as f:
        return json.load(f)


def test_tiny_torch_runs_agree(tmp_path, capsys):
    """Both architectures, hf and moe_torch: the curves agree step by step (float32: 1e-4), and every key is there."""
    rc = TB.main(["--tiny", "--runs", "hf,moe_torch", "--aux-coef", "0.5", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    got = _read(tmp_path)
    assert META_KEYS <= set(got["meta"]), sorted(META_KEYS - set(got["meta"]))
    assert [(r["arch"], r["run"]) for r in got["runs"]] == [(a, r) for a in TB.ARCHS for r in ("hf", "moe_torch")]
    for r in got["runs"]:
        assert RUN_KEYS <= set(r), sorted(RUN_KEYS - set(r))
        assert len(r["losses"]) == len(r["aux_losses"]) == len(r["step_times_s"]) == 3
        assert np.isfinite(r["losses"]).all() and r["tokens_per_s"] > 0 and r["flops_per_token"] > 0
        assert r["mfu"] is None and r["peak_mem_gib"] is None  # a CPU: no peak, no device memory
        assert min(r["aux_losses"]) > 0.5  # the router losses are on (about topk for Qwen3-MoE, 1 per DeepSeek layer)
    assert [(c["arch"], c["a"], c["b"]) for c in got["checks"]] == [(a, "hf", "moe_torch") for a in TB.ARCHS]
    for c in got["checks"]:
        assert c["pass"] and c["max_rel_diff"] <= c["rtol"] == 1e-4, c
        runs = {r["run"]: r["losses"] for r in got["runs"] if r["arch"] == c["arch"]}
        np.testing.assert_allclose(runs["moe_torch"], runs["hf"], rtol=1e-4)
        assert runs["hf"][-1] < runs["hf"][0]  # it trains
    assert "PASS" in printed and "FAIL" not in printed


@pytest.fixture
def quick_xla_compile():
    """XLA:CPU without most optimizations (LLVM -O0) for this test's one training-step compile, which is most of its
    time; the same HLO, so the same numbers. Restored after."""
    import jax

    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


def test_tiny_jax_run_agrees(tmp_path, quick_xla_compile):
    """The NNX model (MoEBlock) from the same initial weights: its curve is transformers' (one layer: a quick
    compile)."""
    rc = TB.main(["--tiny", "--arch", "qwen3_moe", "--runs", "hf,moe_pallas", "--layers", "1", "--steps", "2",
                  "--aux-coef", "0.5", "--out", str(tmp_path)])
    got = _read(tmp_path)
    assert rc == 0, got["checks"]
    jax_run = [r for r in got["runs"] if r["run"] == "moe_pallas"]
    assert len(jax_run) == 1 and RUN_KEYS <= set(jax_run[0]) and jax_run[0]["framework"] == "jax"
    (check,) = got["checks"]
    assert (check["a"], check["b"], check["pass"]) == ("hf", "moe_pallas", True), check


def test_hf_load_balancing_loss_is_transformers():
    """:func:`hf_load_balancing_loss` (counts from the gate's ids) equals transformers' ``load_balancing_loss_func``."""
    import jax.numpy as jnp
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.default_rng(0)
    E, k, T = 8, 2, 24
    logits = [rng.standard_normal((T, E)).astype(np.float32) for _ in range(3)]
    want = load_balancing_loss_func(tuple(torch.from_numpy(lg) for lg in logits), E, k)
    counts = [np.bincount(np.argsort(-lg, axis=1)[:, :k].ravel(), minlength=E).astype(np.int32) for lg in logits]
    got = TB.hf_load_balancing_loss([jnp.asarray(lg) for lg in logits], [jnp.asarray(c) for c in counts])
    assert float(got) == pytest.approx(float(want), rel=1e-6)


@pytest.mark.parametrize("argv, says", [
    (["--arch", "mixtral"], "--arch"),
    (["--runs", "hf,hf"], "each name once"),
    (["--experts", "8", "--topk", "9"], "--topk"),
    (["--steps", "3", "--warmup", "3"], "--warmup"),
    (["--heads", "6", "--kv-heads", "4"], "--kv-heads"),
    (["--arch", "deepseek_v3", "--experts", "8", "--n-group", "3"], "--n-group"),
    (["--arch", "deepseek_v3", "--experts", "8", "--n-group", "4", "--topk-group", "1", "--topk", "3"], "--topk"),
    (["--layers", "0"], "--layers"),
    (["--lr", "0"], "--lr"),
    (["--aux-coef", "-1"], "--aux-coef"),
    (["--device", "tpu"], "--device"),
])
def test_bad_options_are_refused(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        TB.parse_args(["--tiny", *argv])
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_eager_fallback_is_said(tmp_path, monkeypatch):
    """Where grouped_mm cannot run, the hf run trains on transformers' eager experts and the output says so."""
    said = ("eager", "grouped_mm unavailable: test")
    monkeypatch.setattr(TB, "hf_experts_implementation", lambda device, dtype: said)
    rc = TB.main(["--tiny", "--arch", "qwen3_moe", "--runs", "hf,moe_torch", "--layers", "1", "--steps", "2",
                  "--out", str(tmp_path)])
    got = _read(tmp_path)
    assert rc == 0 and got["meta"]["hf_experts_implementation"] == "eager"
    hf = got["runs"][0]
    assert hf["run"] == "hf" and "eager" in hf["implementation"] and "grouped_mm unavailable" in hf["notes"]
    assert got["checks"][0]["pass"]
