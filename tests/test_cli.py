"""`epmoe` command line: smoke tests of the main job."""

from __future__ import annotations

import os

import pytest

from interop.cli import main

DEVICE = os.environ.get("EPMOE_TEST_DEVICE", "cpu")  # "gpu" when benchmarks/gpu_check.py runs the suite
#: Tokens of the tiny preset's `check` runs (no test here asserts on the count): one shape, tests/test_crosscheck.py's,
#: so that the jnp reference's op-by-op programs XLA compiled for one run serve the next (about a fifth of this
#: file's compile time).
TOKENS = "5"


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


@pytest.mark.parametrize("preset,words", [("gpt-oss-20b", "expert_bias=True"),
                                          ("qwen3-next-80b-a3b", "shared_expert_gate=True")])
def test_demo_runs_the_presets_with_biases_and_a_shared_gate(preset, words, capsys):
    """A user trap: `epmoe demo --preset gpt-oss-20b` (and qwen3-next-80b-a3b) ended in a traceback, the layer's
    expert biases / shared-expert gate logits not passed; now drawn as `check` draws them. Shrunk by the layer
    options (which demo now takes, as check does) to stay fast on a CPU."""
    assert main(["demo", "--preset", preset, "--tokens", "2", "--hidden-size", "64", "--intermediate-size", "32",
                 "--num-experts", "16", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert f"preset {preset}: H=64 I=32 E=16" in out and words in out
    assert "agree" in out and "DISAGREE" not in out


@pytest.mark.parametrize("args", [["demo", "--preset", "nope"], ["demo", "--quant", "int8"], ["frobnicate"]])
def test_bad_arguments_exit_2(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_demo_accepts_dashed_quant():
    from interop.cli import build_parser

    assert build_parser().parse_args(["demo", "--quant", "fp8-block"]).quant == "fp8_block"
    # a new-user trial: "--quant MXFP4" (gpt-oss's own spelling) was refused
    assert build_parser().parse_args(["check", "--quant", "MXFP4"]).quant == "mxfp4"
    assert build_parser().parse_args(["check", "--quant", "FP8-Block"]).quant == "fp8_block"
    assert build_parser().parse_args(["check", "--quant", "int-4"]).quant == "int4"


def test_bug_unknown_quant_is_reported_as_written(capsys):
    """A new-user trial: ``--quant int-5`` was refused as ``'int_5'`` (the converted spelling); the error
    names the value as typed and the choices."""
    from interop.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["check", "--quant", "int-5"])
    err = capsys.readouterr().err
    assert "'int-5'" in err and "int_5" not in err and "fp8_block" in err


def test_version(monkeypatch, capsys):
    """A user trap: there was no `epmoe --version`. The installed package's version, else pyproject.toml's."""
    import tomllib
    from importlib import metadata

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        want = tomllib.load(f)["project"]["version"]
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"epmoe {metadata.version('epmoe')}\n"

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out == f"epmoe {want}\n"


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


def test_help_states_each_default_once(capsys):
    """A user trap: `check --help` gave --ep-rank's default twice ("(default: no per-rank stage table ...)
    (default: None)"); a default the help states is not appended again, and None / a flag's False not at all."""
    import re

    for command in ("check", "demo", "tune"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "(default: None)" not in out and "(default: False)" not in out, command
        options = re.split(r" (?=--[a-z])", out)
        twice = [o for o in options if o.count("default") > 1]
        assert not twice, twice
        if command == "check":
            assert "--seed SEED seed of the random inputs (default: 0)" in out  # 0 is a default, not an absence


def test_check_runs_and_writes_json(tmp_path, capsys):
    import json

    path = tmp_path / "check.json"
    assert main(["check", "--tokens", TOKENS, "--quant", "fp8-block", "--routing", "one_expert", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "within the contract" in out and "gemm1" in out and "triton vs pallas" in out
    data = json.loads(path.read_text())
    assert data["ok"] and data["meta"]["config"]["quant"] == "fp8_block" and data["meta"]["routing_skew"] == "one-expert"
    assert {c["stage"] for c in data["comparisons"]} >= {"gate", "routing", "permute", "gemm1", "act", "gemm2", "combine", "layer"}


def test_check_mxfp4_mma_layout(tmp_path, capsys):
    """``--w4-layout mma``: the four implementations on MMA-layout MXFP4 codes, the weights stage included."""
    import json

    path = tmp_path / "check.json"
    assert main(["check", "--tokens", TOKENS, "--quant", "mxfp4", "--w4-layout", "mma", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["ok"] and data["meta"]["config"]["w4_layout"] == "mma"
    assert "weights" in {c["stage"] for c in data["comparisons"]}


def test_check_fails_naming_the_stage(monkeypatch, capsys):
    import moe_torch.ops.combine.api as api

    real = api._triton
    monkeypatch.setattr(api, "_triton", lambda *a: real(*a) * 2)
    rc = main(["check", "--tokens", TOKENS, "--ep-size", "2", "--ep-rank", "1", "--implementations", "torch-reference,triton"])
    assert rc == 1
    assert "VIOLATION at stage(s) combine, layer" in capsys.readouterr().out


def test_check_ep_summary_all_ranks(tmp_path, capsys):
    """--ep-size N without --ep-rank: every rank end to end, summed, against the single device (no stage table)."""
    import json

    path = tmp_path / "ep.json"
    assert main(["check", "--tokens", TOKENS, "--ep-size", "2", "--implementations", "jnp-reference,torch-reference",
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
    rc = main(["check", "--tokens", TOKENS, "--ep-size", "2", "--ep-rank", "1", "--ep-dtype", "bfloat16",
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
    # found by a new-user trial: raw tracebacks or silent acceptance before
    (["check", "--weights", "README.md"], "load_moe_layer: 'README.md' is not a readable safetensors file"),
    (["check", "--json", "/"], "--json must be a file path; got a folder: '/'"),
    (["check", "--layer", "3"], "--layer needs --weights"),
    (["check", "--tokens", "99999999999"], "--tokens 99999999999 needs about"),
    # found by the second new-user trial
    (["check", "--seed", "-1"], "epmoe check: --seed must be >= 0; got -1"),
    (["check", "--ep-size", "0"], "epmoe check: --ep-size must be >= 1; got 0"),
    (["check", "--json", os.path.join(os.path.abspath(__file__), "x.json")], "is a file, not a folder"),
    (["check", "--implementations", "jnp-reference"], "jnp-reference alone compares nothing"),
    (["check", "--quant", "int4", "--w4-layout", "mma"], "w4_layout='mma' is a layout of MXFP4 codes"),
])
def test_check_refuses_with_exit_2(args, msg, capsys):
    assert main(args) == 2
    assert msg in capsys.readouterr().err


def test_check_json_dash_writes_to_stdout(tmp_path, monkeypatch, capsys):
    """A user trap: `--json -` wrote a file named '-'; now the JSON alone goes to standard output (a pipe into jq)
    and the report to standard error."""
    import json

    monkeypatch.chdir(tmp_path)
    assert main(["check", "--tokens", TOKENS, "--implementations", "jnp-reference,torch-reference", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["ok"] and "within the contract" in err and "wrote" not in err + out
    assert not (tmp_path / "-").exists()


def test_check_json_in_a_missing_folder_is_refused(tmp_path, capsys):
    """A user trap: `--json /nonexistent/x.json` created the folder (a typo became folders); now exit 2 before any
    work, naming the missing parent directory, and nothing is created."""
    path = tmp_path / "typo" / "x.json"
    assert main(["check", "--json", str(path)]) == 2
    assert capsys.readouterr().err == (f"epmoe check: --json: the parent directory {str(path.parent)!r} does not "
                                       f"exist; got --json {str(path)!r} (create the directory first, or give '-' for "
                                       f"standard output)\n")
    assert not path.parent.exists()


def test_check_with_checkpoint_weights(tmp_path, capsys):
    from test_checkpoints import write_layer

    write_layer(tmp_path, "deepseek_v3", fp8=True, shared=1, config={
        "model_type": "deepseek_v3", "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True})
    assert main(["check", "--weights", str(tmp_path), "--quant", "fp8_block", "--tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "with weights from" in out and "E=4" in out and "within the contract" in out


def test_check_weights_with_preset_uses_it_only_without_config_json(tmp_path, capsys):
    """A user trap: `check --weights DIR --preset X` must not drop --preset without a word. As bench documents it,
    --preset gives the routing where the checkpoint has no config.json; with one, the run says it is not used."""
    from test_checkpoints import write_layer

    write_layer(tmp_path / "with", "mixtral", config={"model_type": "mixtral", "num_experts_per_tok": 1})
    write_layer(tmp_path / "without", "mixtral")
    args = ["--preset", "mixtral-8x7b", "--tokens", "2", "--implementations", "jnp-reference,torch-reference"]
    assert main(["check", "--weights", str(tmp_path / "with"), *args]) == 0
    out, err = capsys.readouterr()
    assert (f"epmoe check: --preset mixtral-8x7b not used: the routing comes from "
            f"{tmp_path / 'with' / 'config.json'}") in err
    assert "topk=1" in out  # config.json's, not the preset's 2
    assert main(["check", "--weights", str(tmp_path / "without"), *args]) == 0
    out, err = capsys.readouterr()
    assert "routing from preset mixtral-8x7b (no config.json)" in out and "topk=2" in out and "not used" not in err


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


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here")
def test_check_cpu_token_limit_not_hidden_by_low_host_memory(monkeypatch, capsys):
    """A fresh-clone run with 7 GiB free printed only the host-memory reason for --tokens 100000 on a CPU (with more
    free memory, only the CPU limit): every reason that applies is given, whatever memory is free."""
    import interop.cli as cli

    monkeypatch.setattr(cli, "_host_bytes_available", lambda: 2**20)
    assert main(["check", "--tokens", "100000"]) == 2
    err = capsys.readouterr().err
    assert "at most 512 on a CPU" in err and "needs about" in err and "of host memory" in err


def test_check_adds_the_reference_a_kernel_is_judged_against(capsys):
    """--implementations triton,triton: the torch reference joins (the Triton kernels' judge), once."""
    assert main(["check", "--tokens", TOKENS, "--implementations", "triton,triton"]) == 0
    out = capsys.readouterr().out
    assert "implementations: jnp-reference, triton, torch-reference" in out
    assert "all 0 comparisons" not in out and "within the contract" in out


# --------------------------------------------------------------------------------------
# epmoe check: random weights drawn in bf16 where the float32 ones do not fit (llama4-maverick, kimi-k2)

GIB = 1 << 30


def _fake_host(monkeypatch, available_gib: int, weights_gib: int = 40) -> None:
    """The float32 weights ``weights_gib`` GiB (the float32 path needs 2x, the bf16 draw 1.5x), the host
    ``available_gib`` GiB free."""
    import interop.cli as cli

    monkeypatch.setattr(cli, "_host_bytes_needed", lambda config: weights_gib * GIB)
    monkeypatch.setattr(cli, "_host_bytes_available", lambda: available_gib * GIB)


def test_make_layer_inputs_bf16_weights_are_the_float32_draw_rounded():
    """weights_dtype="bfloat16": w13 / w2 bit-identical to the float32 draw's astype(bf16); every other input equal."""
    import ml_dtypes
    import numpy as np

    from moe_contract import get_preset, make_layer_inputs

    config = get_preset("tiny").config(num_fused_shared_experts=1, shared_expert_gate=True)
    want = make_layer_inputs(config, 5, seed=7, routing="zipf")
    got = make_layer_inputs(config, 5, seed=7, routing="zipf", weights_dtype="bfloat16")
    for name in ("w13", "w2"):
        a, b = getattr(want, name), getattr(got, name)
        assert b.dtype == ml_dtypes.bfloat16 and b.shape == a.shape
        assert np.array_equal(b.view(np.uint16), a.astype(ml_dtypes.bfloat16).view(np.uint16))
    for name in ("x", "router_logits", "e_score_correction_bias", "shared_expert_gate_logits"):
        assert np.array_equal(getattr(got, name), getattr(want, name))
    with pytest.raises(ValueError, match="weights_dtype must be one of"):
        make_layer_inputs(config, 5, weights_dtype="float16")


@pytest.mark.parametrize("extra", [
    ["--quant", "int4"],  # kimi-k2's mode: the 4-bit codes quantized from the bf16 weights
    ["--quant", "fp8-block", "--ep-size", "2", "--ep-rank", "1", "--ep-dtype", "bfloat16"],  # and the EP summary
])
def test_check_draws_the_weights_in_bf16_where_float32_does_not_fit(extra, monkeypatch, tmp_path, capsys):
    """float32 path 80 GiB > 70 GiB available >= 60 GiB of the bf16 draw: the check runs (rc 0) on weights drawn
    straight into bf16, says so, and every comparison is the same as the float32 path's (it rounds to bf16 first)."""
    import json

    import ml_dtypes
    import numpy as np

    import interop.crosscheck.run as run
    from moe_contract import get_preset, make_layer_inputs

    args = ["check", "--tokens", TOKENS, "--seed", "3", "--implementations", "jnp-reference,torch-reference", *extra]
    assert main(args + ["--json", str(tmp_path / "f32.json")]) == 0  # fits here: the float32 draw, as before
    assert "weights drawn in bf16" not in capsys.readouterr().out
    real, drawn = run.make_layer_inputs, []
    monkeypatch.setattr(run, "make_layer_inputs", lambda *a, **k: drawn.append(real(*a, **k)) or drawn[-1])
    _fake_host(monkeypatch, available_gib=70)
    assert main(args + ["--json", str(tmp_path / "bf16.json")]) == 0
    out = capsys.readouterr().out
    assert "weights drawn in bf16 (the float32 weights would need 80 GiB of host memory, 70 available" in out
    assert "within the contract" in out
    want = make_layer_inputs(get_preset("tiny").config(), int(TOKENS), seed=3)
    assert len(drawn) == (2 if "--ep-size" in extra else 1)  # the stage table and the EP summary each draw
    for inputs in drawn:
        for name in ("w13", "w2"):
            w = getattr(inputs, name)
            assert w.dtype == ml_dtypes.bfloat16
            assert np.array_equal(w.view(np.uint16), getattr(want, name).astype(ml_dtypes.bfloat16).view(np.uint16))
    f32, bf16 = (json.loads((tmp_path / f).read_text()) for f in ("f32.json", "bf16.json"))
    assert bf16["meta"]["weights"] == "random (make_layer_inputs), drawn in bfloat16"
    assert f32["meta"]["weights"] == "random (make_layer_inputs)"
    assert bf16["ok"] and bf16["comparisons"] == f32["comparisons"] and len(f32["comparisons"]) > 10


def test_check_refuses_when_even_the_bf16_draw_does_not_fit(monkeypatch, capsys):
    """50 GiB available < 60 GiB (bf16 draw) < 80 GiB (float32): exit 2 before any work, naming both sizes."""
    from interop import crosscheck as cc

    _fake_host(monkeypatch, available_gib=50)
    monkeypatch.setattr(cc, "run_crosscheck", lambda *a, **k: pytest.fail("ran despite the refusal"))
    assert main(["check", "--tokens", "2", "--quant", "int4"]) == 2
    assert ("epmoe check: preset tiny needs about 80 GiB of host memory for its weights, about 60 GiB with them "
            "drawn in bf16 (50 GiB available); use a larger machine") in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--ep-size", "2"], ["--ep-size", "2", "--ep-rank", "0", "--ep-dtype", "float32"]])
def test_check_with_float32_ep_inputs_refuses_as_before(extra, monkeypatch, capsys):
    """--ep-dtype float32 (the EP summary's default) holds the weights in float32: no bf16 draw, today's refusal."""
    from interop import crosscheck as cc

    _fake_host(monkeypatch, available_gib=70)
    monkeypatch.setattr(cc, "run_ep_check", lambda *a, **k: pytest.fail("ran despite the refusal"))
    assert main(["check", "--tokens", "2", *extra]) == 2
    assert capsys.readouterr().err == ("epmoe check: preset tiny needs about 80 GiB of host memory for its weights "
                                       "(70 GiB available); use a larger machine\n")
