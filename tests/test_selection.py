"""``moe_contract/selection.py`` on simulated devices (CPU, no framework): the device spec, the tuned tables' files
and their order (architecture first, refined by device kind, the per-user cache before the shipped files), the
validation of every entry on read and before a write, the nearest-entry lookup, the kernel registry and the per-user
cache directory.

The devices are specs as the frameworks would read them (kind, compute capability, SMs, opt-in shared memory a
block): three Hopper GPUs (``sm90``: H100, H200, H20), an Ampere (A100, ``sm80``) and a Blackwell (B200, ``sm100``).
The shipped and user directories are temporary folders (``EPMOE_CACHE_DIR`` patched).
"""

from __future__ import annotations

import json
import os

import pytest

from moe_contract.selection import (CACHE_DIR_ENV, DeviceSpec, KernelChoice, KernelRegistry, NoKernelError,
                                    TunedTables, file_key, read_table, table_paths, user_cache_dir, user_tuned_dir,
                                    write_table)

SMEM_SM90 = 232448  # 227 KiB: the opt-in maximum of a block on sm_90 (and sm_100)
H100 = DeviceSpec(kind="NVIDIA H100 80GB HBM3", capability=(9, 0), sm_count=132, smem_per_block=SMEM_SM90)
H200 = DeviceSpec(kind="NVIDIA H200", capability=(9, 0), sm_count=132, smem_per_block=SMEM_SM90)
H20 = DeviceSpec(kind="NVIDIA H20", capability=(9, 0), sm_count=78, smem_per_block=SMEM_SM90)
A100 = DeviceSpec(kind="NVIDIA A100-SXM4-80GB", capability=(8, 0), sm_count=108, smem_per_block=166912)
B200 = DeviceSpec(kind="NVIDIA B200", capability=(10, 0), sm_count=148, smem_per_block=SMEM_SM90)
FW = "torch"


def entry(N: int, K: int, M_cap: int, tag: str, **extra) -> dict:
    """A tuned entry with the common keys; ``tag`` says which file it came from (what the tests compare)."""
    return {"N": N, "K": K, "M_cap": M_cap, "tag": tag, **extra}


def write(path: str, entries) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(entries, f)
    return path


def device_file(root, spec: DeviceSpec) -> str:
    return os.path.join(str(root), spec.arch, file_key(spec.kind) + ".json")


def arch_file(root, arch: str = "sm90") -> str:
    return os.path.join(str(root), arch + ".json")


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """``(shipped, user)``: an empty shipped tuned folder and the framework's folder of an empty per-user cache."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    return str(shipped), user_tuned_dir(FW)


def tags(tables: TunedTables, N: int, K: int, M_cap: int, **kw) -> str | None:
    found = tables.nearest(lambda t: (t["N"], t["K"]) == (N, K), M_cap, **kw)
    return None if found is None else found["tag"]


# ------------------------------------------------------------------------------------------------ the device spec


def test_device_spec_arch_hopper_describe_and_validation():
    assert [s.arch for s in (H100, H200, H20, A100, B200)] == ["sm90", "sm90", "sm90", "sm80", "sm100"]
    assert H100.is_hopper and H20.is_hopper and not A100.is_hopper and not B200.is_hopper
    assert H100.describe() == "NVIDIA H100 80GB HBM3 (sm90, 132 SMs, 227 KiB shared memory a block)"
    assert A100.describe() == "NVIDIA A100-SXM4-80GB (sm80, 108 SMs, 163 KiB shared memory a block)"
    assert file_key(H100.kind) == "NVIDIA_H100_80GB_HBM3" and file_key("a/b c") == "a_b_c"
    assert len({H100, DeviceSpec(kind=H100.kind, capability=(9, 0), sm_count=132, smem_per_block=SMEM_SM90)}) == 1
    for bad, match in ((dict(capability=[9, 0]), "capability"), (dict(capability=(9,)), "capability"),
                       (dict(sm_count=-1), "sm_count"), (dict(sm_count=True), "sm_count"),
                       (dict(smem_per_block=1.5), "smem_per_block")):
        with pytest.raises(ValueError, match=match):
            DeviceSpec(**{**dict(kind="x", capability=(9, 0), sm_count=1, smem_per_block=1), **bad})


# ------------------------------------------------------------------------------------------------ the files


def test_table_paths_most_specific_first():
    """The user's device-kind and architecture files, then the shipped ones; each with the kind its entries must
    name (``None``: any device of the architecture); without a user folder, the shipped two."""
    got = table_paths(H100, "/pkg/tuned", "/cache/tuned/torch")
    assert got == (("/cache/tuned/torch/sm90/NVIDIA_H100_80GB_HBM3.json", H100.kind),
                   ("/cache/tuned/torch/sm90.json", None),
                   ("/pkg/tuned/sm90/NVIDIA_H100_80GB_HBM3.json", H100.kind),
                   ("/pkg/tuned/sm90.json", None))
    assert table_paths(A100, "/pkg/tuned", None) == (("/pkg/tuned/sm80/NVIDIA_A100-SXM4-80GB.json", A100.kind),
                                                      ("/pkg/tuned/sm80.json", None))
    assert table_paths(B200, "/pkg/tuned", None)[1] == ("/pkg/tuned/sm100.json", None)


def test_load_user_beats_shipped_and_device_file_refines_the_arch_file(dirs):
    shipped, user = dirs
    write(arch_file(shipped), [entry(4096, 7168, 256, "shipped sm90"), entry(7168, 2048, 256, "shipped sm90"),
                               entry(1024, 1024, 256, "shipped sm90")])
    write(device_file(shipped, H20), [entry(4096, 7168, 256, "shipped H20", device=H20.kind)])
    write(arch_file(user), [entry(7168, 2048, 4096, "user sm90")])
    write(device_file(user, H100), [entry(1024, 1024, 256, "user H100")])

    h100, h200, h20 = (TunedTables.load(s, shipped, FW) for s in (H100, H200, H20))
    assert [p for p, _ in h100.tiers] == [device_file(user, H100), arch_file(user), arch_file(shipped)]
    assert [p for p, _ in h20.tiers] == [arch_file(user), device_file(shipped, H20), arch_file(shipped)]
    # the user's files first: even the shipped entry of a nearer M_cap loses to the user's of the same shape
    assert tags(h100, 7168, 2048, 256) == tags(h200, 7168, 2048, 256) == "user sm90"
    assert tags(h100, 1024, 1024, 256) == "user H100" and tags(h200, 1024, 1024, 256) == "shipped sm90"
    # a device's refinement replaces the architecture's entry for the shapes it measured, and only for that device
    assert tags(h20, 4096, 7168, 256) == "shipped H20"
    assert tags(h100, 4096, 7168, 256) == tags(h200, 4096, 7168, 256) == "shipped sm90"
    assert tags(h20, 1024, 1024, 256) == "shipped sm90"  # a shape the H20 file lacks: the architecture's
    assert tags(h20, 512, 512, 256) is None
    assert h100.entries()[0]["tag"] == "user H100" and len(h100.entries()) == 5
    # user=False: the shipped files alone
    assert [p for p, _ in TunedTables.load(H100, shipped, FW, user=False).tiers] == [arch_file(shipped)]
    # another architecture reads no sm90 file; no device (the CPU) or a spec off CUDA: nothing
    write(arch_file(user, "sm100"), [entry(4096, 7168, 256, "user sm100")])
    assert TunedTables.load(A100, shipped, FW).tiers == ()
    assert [tags(TunedTables.load(B200, shipped, FW), 4096, 7168, 256)] == ["user sm100"]
    assert TunedTables.load(None, shipped, FW).tiers == ()
    cpu = DeviceSpec(kind="cpu", capability=(9, 0), sm_count=0, smem_per_block=0, platform="cpu")
    assert TunedTables.load(cpu, shipped, FW).tiers == ()


def test_load_checks_every_file_with_the_framework_check(dirs):
    shipped, _ = dirs
    path = write(arch_file(shipped), [entry(1, 1, 1, "ok"), entry(1, 1, 2, "bad")])
    with pytest.raises(ValueError, match=r"entry 1 tag must be ok"):
        TunedTables.load(H100, shipped, FW, lambda t: None if t["tag"] == "ok" else "tag must be ok")
    assert TunedTables.load(H100, shipped, FW).tiers == ((path, tuple(json.load(open(path)))),)


# ------------------------------------------------------------------------------------------------ validation


def test_read_table_missing_file_and_valid_entries(tmp_path):
    assert read_table(str(tmp_path / "none.json"), "sm90", None) == ()
    any_device = [entry(1, 2, 3, "a", device=H100.kind, arch="sm90"), entry(4, 5, 6, "b", device=H20.kind)]
    assert read_table(write(arch_file(tmp_path), any_device), "sm90", None) == tuple(any_device)
    own = [entry(1, 2, 3, "a", device=H20.kind), entry(1, 2, 4, "b")]  # no "device": the file's kind
    assert read_table(write(device_file(tmp_path, H20), own), "sm90", H20.kind) == tuple(own)


@pytest.mark.parametrize("entries, where, message", [
    ({"entries": []}, None, "must be a JSON list of objects; got dict"),
    ([entry(1, 1, 1, "ok"), "an entry"], 1, "must be a JSON object; got str"),
    ([entry(1, 1, 1, "ok"), {"K": 1, "M_cap": 1}], 1, "missing key 'N'"),
    ([entry(1, 1, 0, "zero")], 0, "M_cap must be an int >= 1; got M_cap=0"),
    ([entry(1, 1, 1, "ok"), entry(1, 1, 1, "ok"), entry(True, 1, 1, "bool")], 2, "N must be an int >= 1"),
    ([entry(1, 1, 1, "ok"), entry(1, 1, 2, "h100", device=H100.kind)], 1,
     "measured on device 'NVIDIA H100 80GB HBM3', but the file holds 'NVIDIA H20' entries"),
    ([entry(1, 1, 1, "ampere", arch="sm80")], 0, "measured on architecture 'sm80', but the file holds 'sm90' entries"),
])
def test_read_table_refuses_naming_the_file_and_the_entry(tmp_path, entries, where, message):
    path = write(device_file(tmp_path, H20), entries)
    with pytest.raises(ValueError) as exc:
        read_table(path, "sm90", H20.kind)
    text = str(exc.value)
    assert text.startswith(f"tuned table {path}: ") and message in text, text
    if where is not None:
        assert f"{path}: entry {where} " in text, text


def test_read_table_refuses_invalid_json_and_an_arch_file_checks_the_arch(tmp_path):
    path = str(tmp_path / "sm90.json")
    open(path, "w").write("[{")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_table(path, "sm90", None)
    write(path, [entry(1, 1, 1, "hopper", arch="sm90"), entry(1, 1, 1, "blackwell", arch="sm100")])
    with pytest.raises(ValueError, match=r"sm90.json: entry 1 measured on architecture 'sm100'"):
        read_table(path, "sm90", None)


def test_write_table_round_trip_and_refusal(tmp_path):
    entries = [entry(4096, 7168, 256, "a", device=H100.kind), entry(4096, 7168, 16384, "b")]
    path = device_file(tmp_path / "cache", H100)  # parent folders made
    assert write_table(path, entries, "sm90", H100.kind) == path
    assert read_table(path, "sm90", H100.kind) == tuple(entries)
    assert not os.path.exists(path + ".tmp")
    for bad in ([*entries, entry(1, 1, 1, "h200", device=H200.kind)], [entry(1, 1, 1, "x", arch="sm80")],
                [{"N": 1, "K": 1}]):
        with pytest.raises(ValueError, match=r"entry \d"):
            write_table(path, bad, "sm90", H100.kind)
        assert read_table(path, "sm90", H100.kind) == tuple(entries)  # the file as it was
        assert not os.path.exists(path + ".tmp")
    with pytest.raises(ValueError, match="entry 0 no"):
        write_table(str(tmp_path / "new" / "sm90.json"), entries, "sm90", None, lambda t: "no")
    assert not os.path.exists(tmp_path / "new" / "sm90.json")


# ------------------------------------------------------------------------------------------------ the lookup


def test_nearest_m_cap_max_ratio_rank_and_tiers():
    device_tier = (entry(1, 1, 16384, "dev 16384"),)
    arch_tier = (entry(1, 1, 256, "arch 256"), entry(1, 1, 4096, "arch 4096 a", key=1),
                 entry(1, 1, 4096, "arch 4096 b", key=0), entry(2, 2, 1024, "arch 1024"),
                 entry(3, 3, 512, "arch 512"), entry(3, 3, 2048, "arch 2048"))
    tables = TunedTables((("dev.json", device_tier), ("arch.json", arch_tier)))
    assert tables.entries() == device_tier + arch_tier
    # the first file with any match answers, even where a later file has a nearer M_cap
    assert tags(tables, 1, 1, 256) == "dev 16384"
    assert tags(tables, 1, 1, 256, max_ratio=4) == "arch 256"  # 16384 is 64x away: the next file
    assert tags(tables, 1, 1, 1024, max_ratio=4) == "arch 256"  # 4x either way: the first stored at a tie
    assert tags(tables, 1, 1, 1, max_ratio=4) is None
    assert tags(tables, 2, 2, 1 << 20) == "arch 1024"  # no max_ratio: any distance
    assert tags(tables, 3, 3, 1024) == "arch 512"  # log2 distance 1 each: the first stored
    assert tags(tables, 3, 3, 1100) == "arch 2048"  # nearer in log2
    assert tags(tables, 3, 3, 0) == "arch 512"  # M_cap 0 counts as 1
    # equal distance: the lower rank, then the first stored
    lone = TunedTables((("arch.json", arch_tier),))
    assert tags(lone, 1, 1, 4096) == "arch 4096 a"
    assert tags(lone, 1, 1, 4096, rank=lambda t: t.get("key", 9)) == "arch 4096 b"
    assert TunedTables(()).nearest(lambda t: True, 256) is None


# ------------------------------------------------------------------------------------------------ the registry


def _registry() -> KernelRegistry:
    def hopper_only(spec, problem):
        return None if spec is not None and spec.is_hopper else "needs sm_90 (wgmma, TMA)"

    def small_k(spec, problem):
        return None if problem["K"] <= 4096 else f"K={problem['K']} > 4096"

    return KernelRegistry("grouped_gemm", [KernelChoice("gluon", hopper_only), KernelChoice("triton", small_k),
                                           KernelChoice("reference", lambda spec, problem: None)])


def test_registry_choose_in_order_with_reasons_and_preferred_first():
    reg = _registry()
    assert reg.names() == ("gluon", "triton", "reference")
    assert reg.choose(H100, {"K": 2048}) == ("gluon", [])
    assert reg.choose(A100, {"K": 2048}) == ("triton", ["gluon: needs sm_90 (wgmma, TMA)"])
    assert reg.choose(None, {"K": 7168}) == ("reference", ["gluon: needs sm_90 (wgmma, TMA)",
                                                           "triton: K=7168 > 4096"])
    # a table's preference first (unknown names ignored), then the registry's order
    assert reg.choose(H100, {"K": 2048}, preferred=("triton",)) == ("triton", [])
    assert reg.choose(H100, {"K": 7168}, preferred=("cublas", "triton")) == ("gluon", ["triton: K=7168 > 4096"])
    assert reg.reasons(B200, {"K": 1}) == {"gluon": "needs sm_90 (wgmma, TMA)", "triton": None, "reference": None}


def test_registry_no_kernel_check_and_unknown_names():
    reg = KernelRegistry("grouped_gemm", list(_registry().choices.values())[:2])
    with pytest.raises(NoKernelError) as exc:
        reg.choose(A100, {"K": 7168})
    assert isinstance(exc.value, NotImplementedError)
    assert str(exc.value) == ("grouped_gemm: no kernel serves this request on " + A100.describe()
                              + ": gluon: needs sm_90 (wgmma, TMA); triton: K=7168 > 4096")
    with pytest.raises(NoKernelError, match="on this device: gluon"):
        reg.choose(None, {"K": 7168})
    reg.check("gluon", H20, {"K": 7168})  # serves: no error
    with pytest.raises(NotImplementedError, match=r"kernel 'gluon' cannot serve this request on NVIDIA B200 \(sm100, "
                                                  r"148 SMs, 227 KiB shared memory a block\): needs sm_90"):
        reg.check("gluon", B200, {"K": 1})
    with pytest.raises(ValueError, match=r"implementation must be one of \('gluon', 'triton'\); got 'cublas'"):
        reg.check("cublas", H100, {"K": 1})
    with pytest.raises(ValueError, match="kernel names must be unique"):
        KernelRegistry("op", [KernelChoice("a", lambda s, p: None), KernelChoice("a", lambda s, p: None)])


# ------------------------------------------------------------------------------------------------ the user cache


def test_user_cache_dir_honours_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert user_cache_dir() == str(tmp_path / "mine")
    assert user_tuned_dir("jax") == os.path.join(str(tmp_path / "mine"), "tuned", "jax")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(CACHE_DIR_ENV, "rel")
    assert user_cache_dir() == os.path.join(str(tmp_path), "rel")  # made absolute
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv(CACHE_DIR_ENV, "~/c")
    assert user_cache_dir() == os.path.join(str(tmp_path), "home", "c")
    for unset in ("", "  "):  # empty: the platform's per-user cache, never the package
        monkeypatch.setenv(CACHE_DIR_ENV, unset)
        got = user_cache_dir()
        assert os.path.isabs(got) and "epmoe" in got and "moe_contract" not in got
