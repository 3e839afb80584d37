"""``epmoe tune``: the command line without a GPU (its refusal, ``--dry-run``, bad arguments), the shapes of a preset
or a checkpoint's config.json, and the tuned table's merge and round trip through ``moe_contract.selection`` on a
simulated H100. No kernel runs: the tuners' pure functions and a stand-in tuner are all this touches."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types

import pytest

from interop.cli import main
from moe_contract import selection, tuning

H100 = selection.DeviceSpec(kind="NVIDIA H100 80GB HBM3", capability=(9, 0), sm_count=132, smem_per_block=232448)
NO_GPU = "epmoe tune: no CUDA GPU found ({}); tuning measures the GPU it runs on\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh per-user cache (``EPMOE_CACHE_DIR``)."""
    monkeypatch.setenv(selection.CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def torch_fwd(M: int, ms: float, **extra) -> dict:
    """A forward entry as ``moe_torch.ops.grouped_gemm.tune.forward_entry`` writes it."""
    return {"device": H100.kind, "E": 32, "N": 4096, "K": 7168, "M_cap": M, "dtype": "bf16",
            "config": {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3}, "ms": ms, "heuristic_ms": 1.0, **extra}


# ------------------------------------------------------------------------------------------------ the command line


@pytest.mark.parametrize("framework, why", [("torch", "torch.cuda.is_available() is False"),
                                            ("jax", "jax.default_backend() is 'cpu'")])
def test_tune_refuses_without_a_gpu(framework, why, cache, monkeypatch, capsys):
    """Not a dry run, no GPU: exit 2 and one line saying why, no traceback, nothing written."""
    import jax
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert main(["tune", "--preset", "tiny", "--framework", framework]) == 2
    captured = capsys.readouterr()
    assert captured.err == NO_GPU.format(why) and "Traceback" not in captured.out
    assert not cache.exists()
    # both frameworks: torch is asked first, and nothing is measured before every framework has a GPU
    assert main(["tune", "--preset", "tiny"]) == 2
    assert capsys.readouterr().err == NO_GPU.format("torch.cuda.is_available() is False")


def test_dry_run_prints_the_shapes_and_the_destination(cache, monkeypatch, capsys):
    """DeepSeek-V3 over 8 ranks: 32 local experts, gate_up N = 2 x 2048, K = 7168; down N = 7168, K = 2048. Without a
    GPU the destination names the user cache's folder of each framework; with one (simulated) the device's file."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune", "--preset", "deepseek-v3", "--ep-size", "8", "--dry-run", "--ms", "4096"]) == 0
    out = capsys.readouterr().out
    assert "gate_up: w [E=32, N=4096, K=7168]" in out and "down: w [E=32, N=7168, K=2048]" in out
    assert "M (rows): 4096; dtypes: bf16, fp8, fp8_block; ops: fwd" in out
    for fw in ("torch", "jax"):
        assert (f"{fw}: {os.path.join(str(cache), 'tuned', fw, '<arch>', '<device kind>.json')} (no CUDA GPU here: "
                f"the GPU it runs on names the file)") in out
    assert "shared memory" not in out  # nothing is known of a device that is not there
    # a (simulated) GPU: each framework's own device spec names the file and is described
    from moe_pallas.ops import device as jax_device
    from moe_torch.ops import device as torch_device

    props = types.SimpleNamespace(name=H100.kind, major=9, minor=0, multi_processor_count=132,
                                  shared_memory_per_block_optin=232448, shared_memory_per_block=49152)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(jax_device, "device_spec", lambda: H100)
    torch_device._cuda_spec.cache_clear()
    try:
        assert main(["tune", "--preset", "gpt-oss-20b", "--dry-run"]) == 0
    finally:
        torch_device._cuda_spec.cache_clear()  # the simulated H100 must not outlive the test
    out = capsys.readouterr().out
    assert "gate_up: w [E=32, N=5760, K=2880]" in out and "down: fp8_block not tuned (K=2880" in out
    for fw in ("torch", "jax"):
        assert (f"{fw}: {os.path.join(str(cache), 'tuned', fw, 'sm90', 'NVIDIA_H100_80GB_HBM3.json')} "
                f"(NVIDIA H100 80GB HBM3 (sm90, 132 SMs, 227 KiB shared memory a block))") in out
    assert main(["tune", "--preset", "gpt-oss-20b", "--framework", "jax", "--dry-run"]) == 0
    assert "torch:" not in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--preset", "nope"], "argument --preset: invalid choice: 'nope'"),
    (["--weights", "/no/such/checkpoint"], "argument --weights: no such file or folder: '/no/such/checkpoint'"),
    (["--preset", "tiny", "--ms", "2048,lots"], "argument --ms: a comma list of row counts (ints >= 1); got "
                                                "'2048,lots' ('lots' is not)"),
    (["--preset", "tiny", "--ms", "0"], "argument --ms:"),
    (["--preset", "tiny", "--dtypes", "fp4"], "argument --dtypes: a comma list of bf16, fp8, fp8_block"),
    (["--preset", "tiny", "--ops", "fwd,bwd"], "argument --ops: a comma list of fwd, dgrad, wgrad; got 'fwd,bwd' "
                                               "(unknown: bwd)"),
    (["--preset", "tiny", "--ep-size", "3"], "argument --ep-size: must be an int >= 1 dividing the 16 experts"),
    (["--preset", "tiny", "--max-minutes", "0"], "argument --max-minutes: must be a number of minutes > 0"),
    (["--preset", "tiny", "--out", "t.json"], "argument --out: names one table file; give --framework torch or jax"),
    (["--preset", "tiny", "--framework", "tf"], "argument --framework: invalid choice: 'tf'"),
    ([], "one of the arguments --preset --weights is required"),
])
def test_tune_bad_arguments_are_usage_errors(args, message, cache, capsys):
    with pytest.raises(SystemExit) as info:
        main(["tune", *args, "--dry-run"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: epmoe tune") and message in err, err
    assert not cache.exists()


def test_checkpoint_shapes_from_config_json(tmp_path, capsys):
    """``--weights DIR``: the sizes from config.json by its model_type (Llama 4's under text_config); a missing key
    or no config.json is named."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "deepseek_v3", "hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 256}))
    assert tuning.checkpoint_shapes(str(tmp_path), ep_size=8) == tuning.preset_shapes("deepseek-v3", 8)
    assert main(["tune", "--weights", str(tmp_path), "--ep-size", "8", "--dry-run"]) == 0
    assert "down: w [E=32, N=7168, K=2048]" in capsys.readouterr().out
    llama = {"model_type": "llama4", "text_config": {"hidden_size": 5120, "intermediate_size": 8192,
                                                     "num_local_experts": 16}}
    assert tuning.config_sizes(llama) == (5120, 8192, 16)
    with pytest.raises(ValueError, match=re.escape("x/config.json: key 'moe_intermediate_size' must be an int >= 1")):
        tuning.config_sizes({"model_type": "qwen3_moe", "hidden_size": 2048, "num_experts": 128}, "x/config.json")
    with pytest.raises(ValueError, match="model_type must be one of"):
        tuning.config_sizes({"model_type": "llama"})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit):
        main(["tune", "--weights", str(empty), "--dry-run"])
    assert f"argument --weights: no config.json in '{empty}'" in capsys.readouterr().err
    assert tuning.preset_shapes("mixtral-8x7b") == (tuning.GemmShape(name="gate_up", N=28672, K=4096, E=8),
                                                    tuning.GemmShape(name="down", N=4096, K=14336, E=8))


# ------------------------------------------------------------------------------------------------ the table


def test_tuned_table_round_trip_and_merge(cache):
    """Entries of both tuners (their entry builders, fake timings) written for a simulated H100 read back identically
    through ``selection.read_table`` and ``TunedTables.load``, stamped with the arch and device; a second run
    replaces the entries of the same op / dtype / N / K / M_cap / backend (whatever their E) and keeps the rest."""
    from moe_pallas.ops.grouped_gemm import tune as tj
    from moe_torch.ops.grouped_gemm import tune as tt
    from moe_torch.ops.grouped_gemm.config import GroupedGemmConfig, GroupedGemmWgradConfig

    heur = GroupedGemmConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)
    fast = dataclasses.replace(heur, num_stages=4)
    fwd = tt.forward_entry(dev=H100.kind, N=4096, K=7168, M=2048, dtype="bf16", timed={fast: 0.5}, heur=heur,
                           heur_ms=0.6, routings=["uniform"], E=256)
    wgrad = tt.backward_entry("wgrad", {("triton", GroupedGemmWgradConfig(block_n=128, block_k=256, block_m=64,
                                                                          num_warps=8, num_stages=3)): 1.0},
                              None, True, dev=H100.kind, N=4096, K=7168, M=16384, routings=["uniform"], E=256)
    path = tuning.tuned_table_path("torch", H100.arch, H100.kind)
    assert path == os.path.join(str(cache), "tuned", "torch", "sm90", "NVIDIA_H100_80GB_HBM3.json")
    assert tuning.write_tuned_table(path, [fwd, wgrad], H100.arch, H100.kind, tt.check_entry) == path
    written = [tuning.stamp(fwd, "sm90", H100.kind), tuning.stamp(wgrad, "sm90", H100.kind)]
    assert [(e["arch"], e["device"], e["E"]) for e in written] == [("sm90", H100.kind, 256)] * 2
    assert list(selection.read_table(path, "sm90", H100.kind, tt.check_entry)) == written
    shipped = cache / "shipped"
    tables = selection.TunedTables.load(H100, str(shipped), "torch", tt.check_entry)
    assert tables.tiers == ((path, tuple(written)),) and tables.entries() == tuple(written)
    assert tables.nearest(lambda t: t.get("op", "fwd") == "fwd" and t["dtype"] == "bf16", 4096) == written[0]

    again = dict(fwd, E=32, ms=0.45, config=dataclasses.asdict(heur))  # same problem, other experts: replaces
    other = dict(fwd, M_cap=16384)
    tuning.write_tuned_table(path, [again, other], H100.arch, H100.kind, tt.check_entry)
    assert [(e.get("op", "fwd"), e["M_cap"], e["E"], e["ms"]) for e in selection.read_table(path, "sm90", H100.kind)] \
        == [("wgrad", 16384, 256, 1.0), ("fwd", 2048, 32, 0.45), ("fwd", 16384, 256, 0.5)]

    # JAX: one file per framework; FP8 accumulation modes and backends are separate problems
    jax_path = tuning.tuned_table_path("jax", H100.arch, H100.kind)
    mosaic = {"backend": "pallas_mosaic_gpu", "device": H100.kind, "E": 32, "N": 4096, "K": 7168, "M_cap": 2048,
              "dtype": "fp8", "fast_accum": False, "config": {"block_m": 64, "block_n": 128, "block_k": 128}, "ms": 0.3, "heuristic_ms": 0.3,
              "configs_timed": 9, "complete": True}
    new = [mosaic, dict(mosaic, fast_accum=True), dict(mosaic, backend="pallas_triton", fast_accum=None)]
    tuning.write_tuned_table(jax_path, new, H100.arch, H100.kind, tj.check_entry)
    assert len({tj.entry_key(e) for e in new}) == 3
    assert selection.TunedTables.load(H100, str(shipped), "jax", tj.check_entry).entries() == tuple(
        tuning.stamp(e, "sm90", H100.kind) for e in new)
    with pytest.raises(ValueError, match="names a JAX backend"):  # a JAX entry in the torch table
        tuning.write_tuned_table(path, [mosaic], H100.arch, H100.kind, tt.check_entry)
    with pytest.raises(ValueError, match="has no \"backend\""):
        tuning.write_tuned_table(jax_path, [fwd], H100.arch, H100.kind, tj.check_entry)


def test_write_table_refuses_a_malformed_entry(cache):
    """A malformed entry: ``ValueError`` naming the file and the entry; the stored table is left as it was."""
    from moe_torch.ops.grouped_gemm import tune as tt

    path = tuning.tuned_table_path("torch", H100.arch, H100.kind)
    tuning.write_tuned_table(path, [torch_fwd(2048, 0.5)], H100.arch, H100.kind, tt.check_entry)
    before = open(path).read()
    bad = dict(torch_fwd(16384, 0.7), N="4096")
    with pytest.raises(ValueError, match=re.escape(f"tuned table {path}") + r".*entry 1 N must be an int >= 1; "
                       r"got N='4096'; entry: \{"):
        tuning.write_tuned_table(path, [bad], H100.arch, H100.kind, tt.check_entry)
    with pytest.raises(ValueError, match=re.escape(path) + r".*entry 0 config must be an object"):
        selection.write_table(path, [dict(torch_fwd(256, 0.1), config=None)], H100.arch, H100.kind, tt.check_entry)
    assert open(path).read() == before and sorted(os.listdir(os.path.dirname(path))) == [os.path.basename(path)]


def test_an_entry_of_another_device_is_refused(cache):
    """A device kind's table takes only entries measured on that kind and architecture: an H200 entry (or one of
    sm80) is refused when written, and a stored table holding one stops the next run before it measures."""
    path = tuning.tuned_table_path("torch", H100.arch, H100.kind)
    h200 = dict(torch_fwd(2048, 0.5), device="NVIDIA H200")
    with pytest.raises(ValueError, match=re.escape(path) + r".*entry 0 measured on device 'NVIDIA H200', but the "
                       r"file holds 'NVIDIA H100 80GB HBM3' entries"):
        tuning.write_tuned_table(path, [h200], H100.arch, H100.kind)
    with pytest.raises(ValueError, match="measured on architecture 'sm80', but the file holds 'sm90' entries"):
        selection.write_table(path, [dict(torch_fwd(2048, 0.5), arch="sm80")], H100.arch, H100.kind)
    assert not os.path.exists(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump([h200], f)
    with pytest.raises(ValueError, match=re.escape(f"tuned table {path}: entry 0 measured on device 'NVIDIA H200'")):
        tuning.write_tuned_table(path, [torch_fwd(16384, 0.5)], H100.arch, H100.kind)


def test_tune_writes_the_user_table(cache, monkeypatch, capsys):
    """The whole command with a stand-in tuner on a simulated H100: the preset's shapes and options reach the tuner,
    each entry is merged into the stored table as it comes (the same problem replaced, the others kept) and the path
    is printed; a malformed stored table stops the run before anything is measured."""
    from interop import cli
    from moe_torch.ops.grouped_gemm import tune as tt

    path = tuning.tuned_table_path("torch", H100.arch, H100.kind)
    tuning.write_tuned_table(path, [torch_fwd(2048, 0.9), torch_fwd(256, 0.1)], H100.arch, H100.kind)
    calls = []

    def fake_tune(shapes, ms, dtypes, ops, *, routings, deadline, on_entry):
        calls.append((tuple(shapes), ms, dtypes, ops, routings))
        entries = [tuning.stamp(torch_fwd(M, 0.5), H100.arch, H100.kind) for M in ms]
        for e in entries:
            on_entry(e)
        return entries

    fake = types.SimpleNamespace(NoGPUError=tt.NoGPUError, require_gpu=lambda: None, device_spec=lambda: H100,
                                 check_entry=tt.check_entry, tune=fake_tune, summary=lambda entries: [])
    monkeypatch.setattr(cli, "_tune_module", lambda fw: fake)
    assert main(["tune", "--preset", "deepseek-v3", "--ep-size", "8", "--framework", "torch", "--ms", "2048,512",
                 "--dtypes", "bf16", "--routings", "uniform,zipf"]) == 0
    assert calls == [(tuning.preset_shapes("deepseek-v3", 8), [2048, 512], ["bf16"], ["fwd"], ["uniform", "zipf"])]
    assert f"wrote 2 torch entries to {path}" in capsys.readouterr().out
    assert [(e["M_cap"], e["ms"]) for e in selection.read_table(path, "sm90", H100.kind, tt.check_entry)] == [
        (256, 0.1), (2048, 0.5), (512, 0.5)]
    with open(path, "w") as f:
        json.dump([{"N": 1}], f)
    assert main(["tune", "--preset", "tiny", "--framework", "torch"]) == 2
    assert "entry 0 missing key 'K'" in capsys.readouterr().err and len(calls) == 1


def test_option_lists_and_merge_key():
    assert tuning.parse_ms("16384, 2048,16384") == [16384, 2048]
    assert tuning.parse_dtypes("fp8_block,bf16") == ["fp8_block", "bf16"]
    with pytest.raises(ValueError, match=re.escape("--dtypes: a comma list of bf16, fp8, fp8_block; got 'int8' "
                                                   "(unknown: int8)")):
        tuning.parse_dtypes("int8")
    fwd = torch_fwd(2048, 0.5)
    assert tuning.merge_key(fwd) == tuning.merge_key(dict(fwd, E=8, ms=9.0, op="fwd"))
    for other in (dict(fwd, op="dgrad", out_dtype="bf16"), dict(fwd, dtype="fp8"), dict(fwd, M_cap=4096),
                  dict(fwd, backend="pallas_triton"), dict(fwd, kind="backend_choice")):
        assert tuning.merge_key(other) != tuning.merge_key(fwd)
    assert tuning.merge_entries([fwd, dict(fwd, M_cap=1)], [dict(fwd, ms=0.1)]) == [dict(fwd, M_cap=1),
                                                                                      dict(fwd, ms=0.1)]


def test_jax_tune_writes_the_backend_choice(cache):
    """The JAX tuner's backend choice of a problem both kernels were timed on: a valid entry naming the faster, stored
    in the user's table, answered by the default order on that device before the shipped ``sm90.json``; a later
    run's choice of the same problem replaces it even where the answer changed; the summary prints it."""
    from moe_pallas.ops.grouped_gemm import backend_table, config as gemm_config, tune as tj

    def first():  # the tables are read once per process: a new process reads the new table
        gemm_config.tuned_tables.cache_clear()
        try:
            return backend_table.gpu_order("grouped_gemm", "fp8_block", 16384, 4096, 7168, H100)[0]
        finally:
            gemm_config.tuned_tables.cache_clear()

    choice = tj.backend_choice(32, 4096, 7168, 16384, "fp8_block",
                               {"pallas_mosaic_gpu": 0.95, "pallas_triton": 1.9}, ["uniform"])
    assert (choice["layout"], choice["backend"], tj.check_entry(choice)) == ("fp8_block", "pallas_mosaic_gpu", None)
    path = tuning.tuned_table_path("jax", H100.arch, H100.kind)
    tuning.write_tuned_table(path, [choice], H100.arch, H100.kind, tj.check_entry)
    assert first() == "pallas_mosaic_gpu"
    flipped = tj.backend_choice(32, 4096, 7168, 16384, "fp8_block", {"pallas_mosaic_gpu": 2.0, "pallas_triton": 1.0},
                                ["uniform"])
    tuning.write_tuned_table(path, [flipped], H100.arch, H100.kind, tj.check_entry)
    assert [e["backend"] for e in selection.read_table(path, "sm90", H100.kind)] == ["pallas_triton"]
    assert first() == "pallas_triton"
    assert "choice: pallas_triton 1.0000, pallas_mosaic_gpu 2.0000" in tj.summary([flipped])[1]


def test_torch_tuner_times_todays_choice_and_tma_on_hopper():
    """The torch tuner's first pass holds the config the library runs today on the device (on sm_90 at the
    benchmark's M=16384, the wide TMA config, outside the pointer tile space), so a written entry is never slower
    than what it replaces; the TMA pass is the Hopper default of ``tune`` (``--tma`` / ``--no-tma`` override)."""
    from moe_contract.selection import DeviceSpec
    from moe_torch.ops.grouped_gemm import tune as tt
    from moe_torch.ops.grouped_gemm.config import grouped_gemm_config

    hopper = DeviceSpec(kind="NVIDIA Test Hopper", capability=(9, 0), sm_count=132, smem_per_block=232448)
    plain = tt.first_pass(16384, 4096, 7168, 32, 16)
    with_today = tt.first_pass(16384, 4096, 7168, 32, 16, spec=hopper)
    today = grouped_gemm_config(16384, 4096, 7168, 32, 16, device=hopper)
    assert today.tma and today not in plain and with_today == [*plain, today]
    assert all(c.block_k == 64 for c in plain) and all(c.block_k == 128 for c in tt.first_pass(2048, 64, 256, 4, 8))
