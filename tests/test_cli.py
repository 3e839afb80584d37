"""`epmoe` command line: smoke tests of the main job."""

from __future__ import annotations

import os

import pytest

from interop.cli import main

DEVICE = os.environ.get("EPMOE_TEST_DEVICE", "cpu")  # "gpu" when benchmarks/gpu_check.py runs the suite


@pytest.mark.parametrize("args", [
    ["demo", "--tokens", "3"],
    ["demo", "--tokens", "1", "--quant", "fp8_block", "--routing", "one-expert"],
    ["demo", "--tokens", "5", "--quant", "fp8_per_token", "--dtype", "float32", "--routing", "zipf"],
])
def test_demo_runs_and_agrees(args, capsys):
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "jnp vs torch" in out and "agree" in out and "DISAGREE" not in out
    assert "preset tiny" in out


@pytest.mark.parametrize("args", [["demo", "--preset", "nope"], ["demo", "--quant", "int8"], ["frobnicate"]])
def test_bad_arguments_exit_2(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_demo_accepts_dashed_quant():
    from interop.cli import build_parser

    assert build_parser().parse_args(["demo", "--quant", "fp8-block"]).quant == "fp8_block"


def test_tokens_must_be_positive(capsys):
    assert main(["demo", "--tokens", "0"]) == 2
    assert "--tokens must be >= 1" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# epmoe check


def test_check_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["check", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--ep-size" in out and "--weights" in out and "--implementations" in out


def test_check_runs_and_writes_json(tmp_path, capsys):
    import json

    path = tmp_path / "out" / "check.json"
    assert main(["check", "--tokens", "3", "--quant", "fp8-block", "--routing", "one_expert", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "within the contract" in out and "gemm1" in out and "triton vs pallas" in out
    data = json.loads(path.read_text())
    assert data["ok"] and data["meta"]["config"]["quant"] == "fp8_block" and data["meta"]["routing_skew"] == "one-expert"
    assert {c["stage"] for c in data["comparisons"]} >= {"gate", "routing", "permute", "gemm1", "act", "gemm2", "combine", "layer"}


def test_check_fails_naming_the_stage(monkeypatch, capsys):
    import moe_torch.ops.combine.api as api

    real = api._triton
    monkeypatch.setattr(api, "_triton", lambda *a: real(*a) * 2)
    rc = main(["check", "--tokens", "2", "--ep-size", "2", "--ep-rank", "1", "--implementations", "torch-reference,triton"])
    assert rc == 1
    assert "VIOLATION at stage(s) combine, layer" in capsys.readouterr().out


def test_check_ep_summary_all_ranks(tmp_path, capsys):
    """--ep-size N without --ep-rank: every rank end to end, summed, against the single device (no stage table)."""
    import json

    path = tmp_path / "ep.json"
    assert main(["check", "--tokens", "3", "--ep-size", "2", "--implementations", "jnp-reference,torch-reference",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "EP 2 ranks: all summed (float32 inputs)" in out and "ep_sum vs single-device" in out
    assert "torch vs jnp" in out and "within the contract" in out and "gemm1" not in out
    data = json.loads(path.read_text())
    assert data["ok"] and {c["stage"] for c in data["comparisons"]} == {"ep"} and data["meta"]["ep"]["ep_size"] == 2


def test_check_ep_rank_adds_the_stage_table_and_a_bad_rank_fails(monkeypatch, capsys):
    import moe_torch

    real = moe_torch.moe_forward
    monkeypatch.setattr(moe_torch, "moe_forward",
                        lambda *a, **k: real(*a, **k) * (1.1 if a[4].ep_size == 2 and a[4].ep_rank == 0 else 1.0))
    rc = main(["check", "--tokens", "2", "--ep-size", "2", "--ep-rank", "1", "--ep-dtype", "bfloat16",
               "--implementations", "jnp-reference,torch-reference"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "gemm1" in out and "ep_sum vs single-device" in out and "rank 1 stage by stage" in out
    assert "VIOLATION at stage(s) ep" in out  # rank 1's stages are fine; rank 0's partial is not


@pytest.mark.parametrize("args,msg", [
    pytest.param(["check", "--preset", "deepseek-v3"], "use --preset tiny on a CPU",
                 marks=pytest.mark.skipif(DEVICE == "gpu", reason="a CPU-only refusal (on a GPU the check runs)")),
    (["check", "--ep-size", "2", "--ep-rank", "2"], "--ep-rank must be in [0, --ep-size=2)"),
    (["check", "--implementations", "cuda"], "--implementations must be a comma list"),
    (["check", "--weights", "/nonexistent/ckpt"], "does not exist"),
    # found by a new-user trial (2026-11-30): raw tracebacks or silent acceptance before
    (["check", "--weights", "README.md"], "load_moe_layer: 'README.md' is not a readable safetensors file"),
    (["check", "--json", "/"], "--json must be a file path; got a folder: '/'"),
    (["check", "--layer", "3"], "--layer needs --weights"),
    (["check", "--tokens", "99999999999"], "--tokens 99999999999 needs about"),
    # found by the second new-user trial (2026-11-30)
    (["check", "--seed", "-1"], "epmoe check: --seed must be >= 0; got -1"),
    (["check", "--ep-size", "0"], "epmoe check: --ep-size must be >= 1; got 0"),
    (["check", "--json", os.path.join(os.path.abspath(__file__), "x.json")], "is a file, not a folder"),
    (["check", "--implementations", "jnp-reference"], "jnp-reference alone compares nothing"),
])
def test_check_refuses_with_exit_2(args, msg, capsys):
    assert main(args) == 2
    assert msg in capsys.readouterr().err


def test_check_with_checkpoint_weights(tmp_path, capsys):
    from test_checkpoints import write_layer

    write_layer(tmp_path, "deepseek_v3", fp8=True, shared=1, config={
        "model_type": "deepseek_v3", "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True})
    assert main(["check", "--weights", str(tmp_path), "--quant", "fp8_block", "--tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "with weights from" in out and "E=4" in out and "within the contract" in out


def test_bench_without_gpu_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert main(["bench", "--quick"]) == 2
    assert "there is none here" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here")
@pytest.mark.parametrize("args,msg", [
    (["check", "--implementations", "pallas_mosaic_gpu"], "pallas_mosaic_gpu needs a Hopper GPU"),
    (["check", "--tokens", "100000"], "at most 512 on a CPU"),
])
def test_check_refuses_on_a_cpu(args, msg, capsys):
    assert main(args) == 2
    assert msg in capsys.readouterr().err


def test_check_adds_the_reference_a_kernel_is_judged_against(capsys):
    """--implementations triton,triton: the torch reference joins (the Triton kernels' judge), once."""
    assert main(["check", "--tokens", "3", "--implementations", "triton,triton"]) == 0
    out = capsys.readouterr().out
    assert "implementations: jnp-reference, triton, torch-reference" in out
    assert "all 0 comparisons" not in out and "within the contract" in out
