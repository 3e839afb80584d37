"""`epmoe` command line: smoke tests of the main job."""

from __future__ import annotations

import pytest

from interop.cli import main


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


@pytest.mark.parametrize("args", [["demo", "--preset", "nope"], ["demo", "--quant", "int4"], ["frobnicate"]])
def test_bad_arguments_exit_2(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_tokens_must_be_positive(capsys):
    assert main(["demo", "--tokens", "0"]) == 2
    assert "--tokens must be >= 1" in capsys.readouterr().err
