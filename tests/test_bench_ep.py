"""``benchmarks/bench_ep.py --tiny``: the EP benchmark end to end on the CPU.

One run of the script as a child process (JAX with 2 forced host devices in its own grandchild,
torch with 2 gloo processes), both frameworks, both modes, ep 1 and 2, T = 8 tokens per device,
float32; the tests check the rows it writes.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_ep import ROW_KEYS, a2a_bytes, replicated_bytes  # noqa: E402

KEYS = [(fw, mode, ep) for fw in ("torch", "jax") for mode in ("replicated", "all_to_all") for ep in (1, 2)]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_ep")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("XLA_FLAGS", None)
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_ep.py"), "--tiny", "--ep-sizes", "1,2",
                          "--tokens-per-device", "8", "--out", str(out), "--max-minutes", "3", "--exchange", "dense"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(out / "bench_ep.json") as f:
        doc = json.load(f)
    return out, run.stdout, doc


def test_files_and_schema(bench):
    out, stdout, doc = bench
    assert doc["schema"] == list(ROW_KEYS)
    rows = doc["rows"]
    assert sorted((r["framework"], r["mode"], r["ep_size"]) for r in rows) == sorted(KEYS)
    for r in rows:
        assert list(r) == list(ROW_KEYS)
    with open(out / "bench_ep.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    md = (out / "bench_ep.md").read_text()
    assert md.startswith("| framework | mode | ep |")
    assert stdout.rstrip().endswith(md.rstrip().splitlines()[-1])  # the table is printed last


@pytest.mark.parametrize("key", KEYS, ids=lambda k: "-".join(map(str, k)))
def test_row(bench, key):
    fw, mode, ep = key
    (r,) = [r for r in bench[2]["rows"] if (r["framework"], r["mode"], r["ep_size"]) == key]
    assert r["error"] is None, r["error"]
    assert r["tokens_per_device"] == 8 and r["global_tokens"] == 8 * ep and r["dtype"] == "float32"
    for k in ("step_ms", "step_p20_ms", "step_p80_ms", "comm_ms", "comm_share"):
        assert isinstance(r[k], float) and math.isfinite(r[k]) and r[k] >= 0, (k, r[k])
    assert r["step_ms"] > 0 and r["step_p20_ms"] <= r["step_ms"] <= r["step_p80_ms"]
    assert r["comm_share"] == pytest.approx(r["comm_ms"] / r["step_ms"])
    if fw == "torch":
        assert r["step_max_rank_ms"] >= r["step_ms"] * 0.999
    if fw == "jax" and mode == "all_to_all":
        assert "dense exchange" in r["notes"], r["notes"]
    if ep == 1:
        assert r["bytes_per_device"] == 0 and r["rel_err"] is None
    else:
        assert r["rel_err"] is not None and r["rel_err"] <= 1e-5, r["rel_err"]
        assert r["bytes_per_device"] > 0 and r["comm_gbps"] > 0
    if mode == "replicated":
        assert r["payload_bytes"] == 8 * ep * r["H"] * 4
    elif ep > 1:
        assert r["bytes_dispatch"] > 0 and r["bytes_combine"] > 0
        assert r["bytes_per_device"] == r["bytes_dispatch"] + r["bytes_combine"]


def test_byte_formulas():
    assert replicated_bytes(16, 256, 2)["bytes_per_device"] == 16 * 256 * 4
    assert replicated_bytes(16, 256, 1)["bytes_per_device"] == 0
    # device 0 sends 3 rows to device 1 and receives 5 from it; H=4, bf16; 8 bytes of sizes
    b = a2a_bytes([[10, 3], [5, 7]], 4, 2, 8)
    d0, d1 = 3 * (4 * 2 + 4) + 8 + 5 * 4 * 2, 5 * (4 * 2 + 4) + 8 + 3 * 4 * 2
    assert b["bytes_by_rank"] == f"{d0};{d1}" and b["bytes_per_device"] == max(d0, d1)
    assert b["bytes_dispatch"] == 5 * 12 + 8 and b["bytes_combine"] == 3 * 8


def test_argument_errors_are_usage_errors(capsys):
    """Refused while parsing, with the option named: ragged on the CPU mesh of --tiny, a flag without '--'."""
    from benchmarks.bench_ep import parse_args

    for argv, message in [(["--tiny", "--exchange", "ragged"], "--exchange ragged needs GPUs"),
                          (["--tiny", "--xla-flags=garbage"], "--xla-flags: every XLA flag starts with '--'"),
                          (["--tiny", "--ep-sizes", "0"], "--ep-sizes: every value must be an integer >= 1; got 0"),
                          (["--tiny", "--tokens-per-device", "x"], "--tokens-per-device: expected a comma list of integers")]:
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    assert parse_args(["--tiny", "--exchange", "ragged", "--framework", "torch"]).exchange == "ragged"  # torch ignores it


def test_child_failure_shows_the_exception_line():
    from benchmarks.bench_ep import _last_error

    trace = ("Traceback (most recent call last):\n  File \"bench_ep.py\", line 571, in jax_main\n"
             "    dense = ep_module.dense_exchange(\"bench_ep\", mesh, args.exchange)\n"
             "ValueError: bench_ep: exchange='ragged' needs a GPU mesh (XLA:CPU does not implement ragged_all_to_all)\n")
    assert _last_error(trace) == ("ValueError: bench_ep: exchange='ragged' needs a GPU mesh "
                                  "(XLA:CPU does not implement ragged_all_to_all)")
    assert _last_error("Killed\n") == "Killed"
