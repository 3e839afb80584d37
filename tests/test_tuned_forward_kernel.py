"""The torch 16-bit forward's Gluon-or-Triton choice from the tuned table, on the CPU (GPU tests skip without an sm_90
device): ``config.tuned_forward_kernel`` reads the forward entry ``grouped_gemm_config`` reads (nearest ``M_cap``, same
``N``, ``K``, the bf16 entries; ``"kernel"`` absent = Triton), the choice from ``EPMOE_TRITON_GLUON_BF16``'s three
states (``triton.gluon_bf16_choice``: unset = the entry's kernel, 1 = Gluon, 0 = Triton; the reader itself,
``triton_common.gluon_bf16_switch``, is ``test_env_switches.py``'s), the dispatch's wiring (``triton.gluon_bf16_options``: switch, lookup, eligibility, options; an explicit
``config=`` never asks), the Gluon options the dispatch passes (``gluon_bf16.dispatch_options``), and the tuner's
forward entries (``moe_torch.ops.grouped_gemm.tune.forward_entry`` / ``tune_gluon_forward`` on fake timings; the lookups read them
back).

The tables are temporary device-kind files ``sm90/<kind>.json`` (``common.write_tuned``; ``config.TUNED_DIR`` patched,
caches cleared) of a simulated Hopper (``common.TEST_SPEC``), as in ``test_tuned_backward_configs.py``.
"""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch

from moe_torch.ops import triton_common
from moe_torch.ops.grouped_gemm import config as torch_config
from moe_torch.ops.grouped_gemm import triton as gemm_triton
from moe_torch.ops.grouped_gemm.config import (GroupedGemmConfig, grouped_gemm_config,
                                               heuristic_grouped_gemm_config, tuned_forward_kernel)
from common import TEST_SPEC, TORCH_DEVICE, spec_of_kind, write_tuned

KIND = TEST_SPEC.kind
ENV = triton_common.GLUON_BF16_ENV
TMA = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, group_m=4, persistent=True, tma=True)
PTR = dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3, group_m=8)
G256 = {"block_n": 256, "num_stages": 3, "epilogue": "tma"}
G128 = {"block_n": 128, "num_stages": 4, "epilogue": "pointer"}
DOWN, GATE_UP = (7168, 2048), (4096, 7168)  # (N, K) of w [E, N, K]


@pytest.fixture(autouse=True)
def _fresh_caches():
    """The tuned-file cache and the dispatch's per-problem caches empty before and after each test."""
    caches = (torch_config.tuned_tables, gemm_triton._tuned_forward, gemm_triton._default_config)
    for c in caches:
        c.cache_clear()
    yield
    for c in caches:
        c.cache_clear()


def use_table(tmp_path, monkeypatch, entries, spec=TEST_SPEC) -> str:
    """Point the torch tuned lookup at ``tmp_path/sm90/<kind of spec>.json`` holding ``entries``; returns its path."""
    path = write_tuned(tmp_path, entries, spec)
    monkeypatch.setattr(torch_config, "TUNED_DIR", str(tmp_path))
    torch_config.tuned_tables.cache_clear()
    return path


def fwd_entry(nk, M_cap: int, config: dict, dtype: str = "bf16", **extra) -> dict:
    """A forward entry of ``moe_torch.ops.grouped_gemm.tune`` (``extra``: ``kernel``, ``gluon_config``, ``gluon_ms``...)."""
    N, K = nk
    return {"device": KIND, "E": 32, "N": N, "K": K, "M_cap": M_cap, "dtype": dtype, "config": config, "ms": 1.0,
            "heuristic_ms": 1.1, **extra}


# ------------------------------------------------------------------------------------------------ the lookup


def test_lookup_reads_the_entry_grouped_gemm_config_reads(tmp_path, monkeypatch):
    """``tuned_forward_kernel``: the nearest bf16 forward entry of the same N, K (the one whose ``"config"``
    ``grouped_gemm_config`` returns): its ``"kernel"`` and ``"gluon_config"`` (unknown keys dropped); an entry without
    ``"kernel"`` is Triton; no entry, no device, other widths, backward entries: None. A table with an unknown kernel
    is refused as a whole (ValueError naming the file and the entry), never read with the entry skipped."""
    entries = [
        fwd_entry(DOWN, 16384, TMA, kernel="gluon", gluon_config=dict(G256, num_sms=7), gluon_ms=0.9),
        fwd_entry(DOWN, 2048, PTR),  # tuned before the choice (or Gluon does not serve 2048 rows): Triton
        fwd_entry(DOWN, 16384, PTR, dtype="fp8"),
        fwd_entry(GATE_UP, 16384, TMA, kernel="triton", gluon_config=G128, gluon_ms=1.4),
        fwd_entry((1024, 1024), 16384, TMA, kernel="gluon"),  # a Gluon winner without options: the dispatch's
        {"op": "wgrad", **fwd_entry((512, 512), 16384, {"epilogue": "tma", "num_stages": 3}, kernel="gluon"),
         "out_dtype": "bf16"},
    ]
    unknown = fwd_entry((2048, 1024), 16384, TMA, kernel="cublas")
    path = use_table(tmp_path, monkeypatch, [*entries[:5], unknown, entries[5]])
    with pytest.raises(ValueError, match="kernel must be one of") as exc:
        tuned_forward_kernel(TEST_SPEC, 16384, *DOWN, 16)
    assert f"tuned table {path}: entry 5 " in str(exc.value) and "cublas" in str(exc.value)
    with pytest.raises(ValueError, match="entry 5 kernel must be one of"):  # every lookup of the device: refused
        grouped_gemm_config(16384, *GATE_UP, 32, 16, device=TEST_SPEC)
    use_table(tmp_path, monkeypatch, entries)
    look = lambda M, nk=DOWN, bits=16, dev=TEST_SPEC: tuned_forward_kernel(dev, M, *nk, bits)  # noqa: E731
    assert look(16384) == look(8192) == look(65536) == ("gluon", G256)  # nearest M_cap in log2; num_sms dropped
    assert look(4096) == look(2048) == look(256) == ("triton", {})  # 4096 is nearer 2048 than 16384
    assert look(16384, GATE_UP) == ("triton", G128)  # the Gluon options are kept where Triton won
    assert look(16384, (1024, 1024)) == ("gluon", {})
    assert look(16384, (512, 512)) is None  # a backward entry never serves the forward
    assert look(16384, (4096, 4096)) is None  # no entry of that shape
    assert look(16384, bits=8) is None and look(16384, bits=32) is None  # the Gluon forward is 16-bit only
    assert look(16384, dev=None) is None  # no device (the CPU)
    # the same entry as grouped_gemm_config: its "config" is the Triton kernel's, whatever "kernel" says
    assert grouped_gemm_config(16384, *DOWN, 32, 16, device=TEST_SPEC) == GroupedGemmConfig(**TMA)
    assert grouped_gemm_config(4096, *DOWN, 32, 16, device=TEST_SPEC) == GroupedGemmConfig(**PTR)
    assert grouped_gemm_config(16384, *GATE_UP, 32, 16, device=TEST_SPEC) == GroupedGemmConfig(**TMA)
    # a TMA entry with a bias: grouped_gemm_config falls back to the heuristic (unchanged by the refactor)
    assert (grouped_gemm_config(16384, *DOWN, 32, 16, device=TEST_SPEC, bias=True)
            == heuristic_grouped_gemm_config(16384, *DOWN, 32, 16))


def test_the_h200_table_forward_entries_are_the_tuners():
    """The tree's H200 table: every forward entry keeps a Triton ``"config"``; one with a ``"kernel"`` is a bf16 entry
    with the tuner's fields (a ``"gluon"`` winner names its measured options and a ``"gluon_ms"`` below ``"ms"``); a
    bf16 entry without one reads as Triton. The table is the architecture's (``tuned/sm90.json``): an H100 reads the
    same entries (after its own, ``tuned/sm90/NVIDIA_H100_80GB_HBM3.json``, checked by the same rules), an H20 only
    them, an A100 (sm80) none (the heuristic)."""
    h200 = spec_of_kind("NVIDIA H200")
    entries = torch_config.tuned_tables(h200).entries()
    assert entries, "the H200 table is in the tree"
    assert torch_config.tuned_tables(spec_of_kind("NVIDIA H20")).entries() == entries
    h100 = torch_config.tuned_tables(spec_of_kind("NVIDIA H100 80GB HBM3")).entries()
    own = h100[:len(h100) - len(entries)]
    assert own and h100[len(own):] == entries and {e["device"] for e in own} == {"NVIDIA H100 80GB HBM3"}
    a100 = spec_of_kind("NVIDIA A100-SXM4-80GB", (8, 0))
    assert torch_config.tuned_tables(a100).entries() == ()
    for e in (*own, *entries):
        if e.get("op", "fwd") != "fwd":
            continue
        GroupedGemmConfig(**e["config"])
        if "kernel" in e:
            assert e["kernel"] in torch_config.FORWARD_KERNELS and e["dtype"] == "bf16", e
            assert e["kernel"] == "triton" or (isinstance(e["gluon_config"], dict) and e["gluon_ms"] < e["ms"]), e
        elif e["dtype"] == "bf16":
            assert tuned_forward_kernel(h200, e["M_cap"], e["N"], e["K"], 16) == ("triton", {}), e
    fwd = next(e for e in entries if e.get("op", "fwd") == "fwd" and e["dtype"] == "bf16")
    args = (fwd["M_cap"], fwd["N"], fwd["K"], 32, 16)
    assert grouped_gemm_config(*args, device=h200) == GroupedGemmConfig(**fwd["config"])
    assert tuned_forward_kernel(a100, fwd["M_cap"], fwd["N"], fwd["K"], 16) is None
    assert grouped_gemm_config(*args, device=a100) == heuristic_grouped_gemm_config(*args)


# ------------------------------------------------------------------------------------------------ the switch


def test_choice_from_switch_and_entry():
    """``gluon_bf16_choice``: 0 -> Triton; unset -> Gluon with the entry's options only where its kernel is gluon;
    1 -> Gluon, the entry's options whatever its kernel (``{}``: the dispatch's defaults)."""
    choice = gemm_triton.gluon_bf16_choice
    gluon, triton_e, triton_plain = ("gluon", G256), ("triton", G128), ("triton", {})
    for tuned in (None, gluon, triton_e, triton_plain):
        assert choice(False, tuned) is None
    assert choice(None, gluon) == G256
    assert choice(None, ("gluon", {})) == {}
    assert choice(None, triton_e) is None and choice(None, triton_plain) is None and choice(None, None) is None
    assert choice(None, None, wide=True) == {} and choice(False, None, wide=True) is None
    assert choice(None, triton_e, wide=True) is None  # an entry decides, wide or not
    assert choice(True, gluon) == G256 and choice(True, triton_e) == G128
    assert choice(True, triton_plain) == {} and choice(True, None) == {}
    out = choice(None, gluon)
    out["block_n"] = 128  # a copy: the cached entry is untouched
    assert gluon[1] == G256


# ------------------------------------------------------------------------------------------------ the dispatch


class _FakeCuda:
    """Just what ``gluon_bf16_options`` reads of a tensor before ``forward_refusal`` (patched in these tests)."""

    def __init__(self, *shape, dtype=torch.bfloat16):
        self.shape, self.dtype, self.is_cuda, self.device = tuple(shape), dtype, True, "cuda:0"

    def dim(self) -> int:
        return len(self.shape)


def _patch_gluon(monkeypatch, eligible: bool = True, why: str = "needs contiguous tensors"):
    """``(gluon_bf16 module, calls)``: its ``forward_refusal`` -> ``None`` where ``eligible``, else ``why`` (recording
    its calls), the device :data:`TEST_SPEC`. Skips the test where triton has no Gluon."""
    gb = pytest.importorskip("moe_torch.ops.grouped_gemm.gluon_bf16", reason="triton.experimental.gluon unavailable")
    calls = []
    monkeypatch.setattr(gb, "forward_refusal", lambda *a, **k: calls.append(a) or (None if eligible else why))
    monkeypatch.setattr(gemm_triton, "device_spec", lambda device=None: TEST_SPEC)
    return gb, calls


def test_dispatch_options_tri_state(tmp_path, monkeypatch):
    """``gluon_bf16_options`` on a sm_90-like request: unset -> the entry's kernel (Gluon with its options on down,
    Triton on gate_up; without an entry Gluon's defaults where the problem is wide, else Triton); 1 -> Gluon everywhere it is eligible (the entry's options, else
    ``DISPATCH_OPTIONS``; the pointer epilogue where ``N % 8``); 0 -> Triton, nothing consulted; not eligible, FP8
    scales, another dtype's entry: Triton."""
    gb, calls = _patch_gluon(monkeypatch)
    use_table(tmp_path, monkeypatch, [
        fwd_entry(DOWN, 16384, TMA, kernel="gluon", gluon_config=G128, gluon_ms=0.7),
        fwd_entry(GATE_UP, 16384, TMA, kernel="triton", gluon_config=G256, gluon_ms=1.4),
        fwd_entry((7164, 2048), 16384, TMA, kernel="gluon", gluon_config=G256, gluon_ms=0.7),  # tma at N % 8: invalid
    ])

    def options(nk, M=16384, dtype=torch.bfloat16, **kw):
        N, K = nk
        x, w, off = _FakeCuda(M, K, dtype=dtype), _FakeCuda(32, N, K, dtype=dtype), _FakeCuda(33, dtype=torch.int32)
        return gemm_triton.gluon_bf16_options(x, w, off, kw.get("x_scale"), kw.get("w_scale"), dtype)

    monkeypatch.delenv(ENV, raising=False)
    assert options(DOWN) == options(DOWN, M=8192) == G128
    assert options(DOWN, dtype=torch.float16) == G128  # fp16 reads the bf16 entries
    n_calls = len(calls)
    assert options(GATE_UP) is None and options((1024, 1024), M=2048) is None  # Triton entry / no entry, narrow
    assert len(calls) == n_calls  # the eligibility is not asked where the table keeps Triton
    # no entry, a wide sm_90 problem (config.hopper_wide_config applies): Gluon with its defaults
    assert options((1024, 1024)) == gb.DISPATCH_OPTIONS and options((1024, 1024), M=4096) is None
    assert options((7164, 2048)) == dict(gb.DISPATCH_OPTIONS, epilogue="pointer")  # invalid tuned options
    assert options(DOWN, x_scale=object(), w_scale=object()) is None
    monkeypatch.setenv(ENV, "1")
    assert options(DOWN) == G128
    assert options(GATE_UP) == G256  # forced: the entry's (losing) Gluon options
    assert options((1024, 1024)) == gb.DISPATCH_OPTIONS
    assert options((1004, 1024)) == dict(gb.DISPATCH_OPTIONS, epilogue="pointer")  # N % 8: no TMA store
    monkeypatch.setenv(ENV, "0")
    n_calls = len(calls)
    assert options(DOWN) is None and options((1024, 1024)) is None
    assert len(calls) == n_calls
    monkeypatch.setenv(ENV, "1")
    _patch_gluon(monkeypatch, eligible=False)
    assert options(DOWN) is None  # forward_refusal refuses: Triton whatever the switch
    monkeypatch.delenv(ENV)
    assert options(DOWN) is None
    assert not gemm_triton.gluon_bf16_eligible(_FakeCuda(16384, 2048), _FakeCuda(32, *DOWN), _FakeCuda(33), None,
                                               None, torch.bfloat16)


def test_default_says_when_its_gluon_choice_cannot_serve(tmp_path, monkeypatch, caplog):
    """Where the table (or the wide rule) chooses the 16-bit Gluon kernel and the request is one it cannot take (a
    strided ``x``, say), the default runs Triton and logs why, once per reason; a problem below the kernel's row rule
    falls back without a word (a measured choice, not a refusal). The FP8 Gluon kernels likewise."""
    import logging

    from moe_torch.ops import dispatch

    monkeypatch.setattr(dispatch, "_SAID", set())
    use_table(tmp_path, monkeypatch, [fwd_entry(DOWN, 16384, TMA, kernel="gluon", gluon_config=G128, gluon_ms=0.7)])
    monkeypatch.delenv(ENV, raising=False)
    x, w, off = _FakeCuda(16384, DOWN[1]), _FakeCuda(32, *DOWN), _FakeCuda(33, dtype=torch.int32)
    gb, _ = _patch_gluon(monkeypatch, eligible=False, why="x must be contiguous")
    with caplog.at_level(logging.WARNING, logger="moe_torch"):
        for _ in range(3):
            assert gemm_triton.gluon_bf16_options(x, w, off, None, None, torch.bfloat16) is None
    said = [r.getMessage() for r in caplog.records if "gluon_bf16" in r.getMessage()]
    assert len(said) == 1 and "x must be contiguous" in said[0] and "Triton" in said[0], said
    caplog.clear()
    for quiet in gb.NOT_REPORTED:  # fewer rows than the rule's, another kind of request: no warning
        _patch_gluon(monkeypatch, eligible=False, why=quiet)
        with caplog.at_level(logging.WARNING, logger="moe_torch"):
            assert gemm_triton.gluon_bf16_options(x, w, off, None, None, torch.bfloat16) is None
    assert not caplog.records

    # FP8 blocks on sm_90 at enough rows, a float16 x_scale: the Gluon FP8-block kernel passed over, said once
    class _Fp8(_FakeCuda):
        def is_contiguous(self):
            return True

    K, N, E = 2048, 7168, 32
    fp8 = torch.float8_e4m3fn
    x8, w8, off8 = _Fp8(16384, K, dtype=fp8), _Fp8(E, N, K, dtype=fp8), _Fp8(E + 1, dtype=torch.int32)
    xs, ws = _Fp8(16384, K // 128, dtype=torch.float16), _Fp8(E, N // 128, K // 128, dtype=torch.float32)
    for t in (x8, w8, off8, xs, ws):
        t.ndim = len(t.shape)
    with caplog.at_level(logging.WARNING, logger="moe_torch"):
        for _ in range(2):
            assert not gemm_triton.gluon_fp8_block_eligible(x8, w8, off8, xs, ws, torch.bfloat16)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "gluon_fp8_block" in said[0] and "float32 scales" in said[0], said


def test_dispatch_never_on_cpu_tensors_and_explicit_config_keeps_triton(tmp_path, monkeypatch):
    """On CPU tensors (interpreted Triton) the dispatch returns None before any lookup, whatever the switch; with an
    explicit ``config=`` ``grouped_gemm_triton`` does not even ask it."""
    use_table(tmp_path, monkeypatch, [fwd_entry((32, 64), 1, TMA, kernel="gluon", gluon_config=G128)])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 64, generator=g).to(torch.bfloat16).to(TORCH_DEVICE)
    w = torch.randn(2, 32, 64, generator=g).to(torch.bfloat16).to(TORCH_DEVICE)
    off = torch.tensor([0, 10, 24], dtype=torch.int32, device=TORCH_DEVICE)
    small = GroupedGemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
    real = gemm_triton.gluon_bf16_options
    asked = []
    monkeypatch.setattr(gemm_triton, "gluon_bf16_options", lambda *a, **k: asked.append(1) or real(*a, **k))
    for raw in (None, "1"):
        if raw is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, raw)
        if TORCH_DEVICE == "cpu":
            assert real(x, w, off, None, None, torch.bfloat16) is None
        y = gemm_triton.grouped_gemm_triton(x, w, off, None, None, torch.bfloat16, small)
        assert asked == []
        ref = x.float()[:10] @ w[0].float().T
        torch.testing.assert_close(y[:10].float(), ref, rtol=2e-2, atol=2e-2)
    gemm_triton.grouped_gemm_triton(x, w, off, None, None, torch.bfloat16)  # no config: the dispatch is asked
    assert asked == [1]


def test_dispatch_options_for_n_and_tuned_options():
    """``gluon_bf16.dispatch_options``: valid tuned options as they are (a copy), missing keys the launcher's defaults;
    invalid ones (a ring too deep, an unknown key, tma at ``N % 8``, not a dict) -> ``DISPATCH_OPTIONS``, with the
    pointer epilogue where ``N % 8 != 0``."""
    gb = pytest.importorskip("moe_torch.ops.grouped_gemm.gluon_bf16", reason="triton.experimental.gluon unavailable")
    D = gb.DISPATCH_OPTIONS
    assert gb.dispatch_options(G128, 7168) == G128 and gb.dispatch_options(G128, 7168) is not G128
    assert gb.dispatch_options({"block_n": 256}, 7168) == {"block_n": 256}
    for bad in ({"block_n": 256, "num_stages": 4, "epilogue": "tma"}, {"block_n": 64}, {"num_sms": 3},
                {"epilogue": "smem"}, ["block_n"]):
        assert gb.forward_options_problem(bad, 7168), bad
        assert gb.dispatch_options(bad, 7168) == D
    assert gb.forward_options_problem(G256, 7164)  # a TMA store needs N % 8 == 0
    assert gb.dispatch_options(G256, 7164) == dict(D, epilogue="pointer")
    assert gb.dispatch_options(None, 7168) == gb.dispatch_options({}, 7168) == D
    assert gb.forward_options_problem(dict(D, epilogue="pointer"), 7164) is None


# ------------------------------------------------------------------------------------------------ the tuner


def test_tuner_gluon_candidates():
    """7 options at N % 8 == 0 (no 4-stage ring at block_n 256 with the TMA epilogue), ``DISPATCH_OPTIONS`` first;
    pointer stores only at N % 8 != 0."""
    gb = pytest.importorskip("moe_torch.ops.grouped_gemm.gluon_bf16", reason="triton.experimental.gluon unavailable")
    from moe_torch.ops.grouped_gemm import tune as tt

    cands = tt.gluon_forward_candidates(7168)
    assert len(cands) == 7 and cands[0] == gb.DISPATCH_OPTIONS
    assert {"block_n": 256, "num_stages": 4, "epilogue": "tma"} not in cands
    assert {(c["block_n"], c["num_stages"], c["epilogue"]) for c in cands} >= {(128, 3, "tma"), (256, 4, "pointer")}
    odd = tt.gluon_forward_candidates(7164)
    assert len(odd) == 4 and all(c["epilogue"] == "pointer" for c in odd)


def test_tuner_times_gluon_after_checking_it(monkeypatch):
    """``tune_gluon_forward`` on fake kernels and timings: every candidate checked on every routing before it is
    timed; a wrong one (``inf``, never timed) or a failing one (``inf``) is no winner; past ``--max-minutes`` no
    candidate starts (``None`` if none did); a problem the kernel does not serve: ``None``."""
    gb = pytest.importorskip("moe_torch.ops.grouped_gemm.gluon_bf16", reason="triton.experimental.gluon unavailable")
    from moe_torch.ops.grouped_gemm import tune as tt

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 16, generator=g).to(torch.bfloat16), torch.randn(2, 7168, 16, generator=g).to(torch.bfloat16)
    offs = [torch.tensor([0, 32, 64], dtype=torch.int32), torch.tensor([0, 60, 64], dtype=torch.int32)]
    refs = [torch.randn(64, 8, generator=g) for _ in offs]
    wrong, failing = (128, 4, "tma"), (256, 3, "pointer")
    runs, timed_calls = [], []

    def fake_gluon(x_, w_, off, *, block_n, num_stages, epilogue):
        key = (block_n, num_stages, epilogue)
        runs.append(key)
        if key == failing:
            raise RuntimeError("out of shared memory")
        ref = refs[0] if off is offs[0] else refs[1]
        return torch.zeros_like(ref) if key == wrong else ref.to(torch.bfloat16)

    def fake_time(fn):
        fn()
        timed_calls.append(runs[-1])
        return {(128, 3, "tma"): 0.8, (256, 4, "pointer"): 0.7}.get(runs[-1], 1.0)

    monkeypatch.setattr(gb, "forward_eligible", lambda *a, **k: True)
    monkeypatch.setattr(gb, "grouped_gemm_gluon_bf16", fake_gluon)
    monkeypatch.setattr(tt, "_time", fake_time)
    timed = tt.tune_gluon_forward(x, w, offs, refs, ["uniform", "zipf"], tt.Deadline(None))
    as_key = lambda t: (t[0][1], t[1][1], t[2][1])  # noqa: E731
    by_key = {as_key(k): v for k, v in timed.items()}
    assert len(by_key) == 7 and by_key[wrong] == by_key[failing] == float("inf")
    assert by_key[(256, 4, "pointer")] == 0.7 and by_key[(128, 3, "tma")] == 0.8
    assert wrong not in timed_calls and failing not in timed_calls  # checked first, never timed
    assert timed_calls.count((256, 4, "pointer")) == 2  # each routing
    past = tt.Deadline(0)
    past.end = 0.0
    assert tt.tune_gluon_forward(x, w, offs, refs, ["uniform", "zipf"], past) is None
    monkeypatch.setattr(gb, "forward_eligible", lambda *a, **k: False)
    assert tt.tune_gluon_forward(x, w, offs, refs, ["uniform"], tt.Deadline(None)) is None


def test_tuner_forward_entries_round_trip(tmp_path, monkeypatch):
    """``moe_torch.ops.grouped_gemm.tune.forward_entry``: ``"config"`` / ``"ms"`` the fastest Triton config (the heuristic first at
    equal times); with Gluon timed, ``"kernel"`` the strictly faster kernel and the fastest correct Gluon options in
    ``"gluon_config"`` / ``"gluon_ms"``; without (other dtypes, not served, ``--no-gluon``) the entry as before, no
    ``"kernel"``; the lookups read the written entries back."""
    from moe_torch.ops.grouped_gemm import tune as tt

    heur = GroupedGemmConfig(**PTR)
    tma, slow = GroupedGemmConfig(**TMA), dataclasses.replace(GroupedGemmConfig(**PTR), num_stages=4)
    timed = {tma: 0.80, slow: 1.3, dataclasses.replace(tma, group_m=8): float("inf")}
    g_fast = {tuple(G256.items()): 0.75, tuple(G128.items()): 0.78, (("block_n", 128), ("num_stages", 3),
                                                                      ("epilogue", "tma")): float("inf")}
    g_slow = {tuple(G256.items()): 0.85, tuple(G128.items()): 0.81}
    common = dict(dev=KIND, K=2048, heur=heur, heur_ms=1.1, routings=["uniform", "zipf"])
    down = tt.forward_entry(N=7168, M=16384, dtype="bf16", timed=timed, gluon_timed=g_fast, **common)
    assert down["config"] == dataclasses.asdict(tma) and (down["ms"], down["heuristic_ms"]) == (0.8, 1.1)
    assert (down["kernel"], down["gluon_config"], down["gluon_ms"]) == ("gluon", G256, 0.75)
    assert down["routings"] == ["uniform", "zipf"]
    gate = tt.forward_entry(N=4096, M=16384, dtype="bf16", timed=timed, gluon_timed=g_slow, **common)
    assert (gate["kernel"], gate["gluon_config"], gate["gluon_ms"]) == ("triton", G128, 0.81)
    tie = tt.forward_entry(N=1024, M=16384, dtype="bf16", timed=timed, gluon_timed={tuple(G128.items()): 0.8},
                           **common)
    assert tie["kernel"] == "triton"  # Gluon must be strictly faster
    broken = tt.forward_entry(N=2048, M=16384, dtype="bf16", timed=timed,
                              gluon_timed={tuple(G128.items()): float("inf")}, **common)
    assert broken["kernel"] == "triton" and "gluon_config" not in broken and "gluon_ms" not in broken
    plain = tt.forward_entry(N=7168, M=2048, dtype="bf16", timed={slow: 1.1}, dev=KIND, K=2048, heur=heur,
                             heur_ms=1.1, routings=["uniform"])
    assert plain == {"device": KIND, "E": 32, "N": 7168, "K": 2048, "M_cap": 2048, "dtype": "bf16",
                     "config": dataclasses.asdict(heur), "ms": 1.1, "heuristic_ms": 1.1}  # the heuristic at a tie
    assert tt.entry_key(down) == (32, 7168, 2048, 16384, "bf16", "fwd", None)  # as every forward entry's
    json.dumps([down, gate, tie, broken, plain])  # JSON as written
    use_table(tmp_path, monkeypatch, [down, gate, tie, broken, plain])
    assert tuned_forward_kernel(TEST_SPEC, 16384, 7168, 2048, 16) == ("gluon", G256)
    assert tuned_forward_kernel(TEST_SPEC, 16384, 4096, 2048, 16) == ("triton", G128)
    assert tuned_forward_kernel(TEST_SPEC, 16384, 2048, 2048, 16) == ("triton", {})
    assert tuned_forward_kernel(TEST_SPEC, 2048, 7168, 2048, 16) == ("triton", {})  # the M=2048 entry, no "kernel"
    assert grouped_gemm_config(16384, 7168, 2048, 32, 16, device=TEST_SPEC) == tma


# ------------------------------------------------------------------------------------------------ on an sm_90 GPU


def _sm90() -> bool:
    return TORCH_DEVICE == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _sm90(), reason="the Gluon kernel runs on a CUDA device of compute capability (9, 0) only "
                    "(EPMOE_TEST_DEVICE=gpu on an H100 / H200)")
def test_gpu_dispatch_follows_the_table(tmp_path, monkeypatch):
    """With a table of this GPU's kind (its ``sm90/<kind>.json``, the spec read from the device): unset runs the
    entry's kernel (Gluon with its options where it says gluon, Triton where it says triton), 1 runs Gluon, 0 and an
    explicit config run Triton; results within bf16 of each other, the Gluon ones bit-identical to calling the launcher
    with the same options."""
    gb = pytest.importorskip("moe_torch.ops.grouped_gemm.gluon_bf16", reason="triton.experimental.gluon unavailable")
    import moe_torch
    import moe_torch.ops.device
    from tolerances import BF16_REL_FRO, assert_rel_fro

    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [1100, 0, 2500, 700]
    off = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    x = torch.randn(int(off[-1]), 512, device="cuda", generator=g).to(torch.bfloat16)
    w_g = (torch.randn(4, 256, 512, device="cuda", generator=g) * 512**-0.5).to(torch.bfloat16)
    w_t = (torch.randn(4, 384, 512, device="cuda", generator=g) * 512**-0.5).to(torch.bfloat16)
    spec = moe_torch.ops.device.device_spec()
    assert spec.kind == torch.cuda.get_device_name() and spec.is_hopper
    use_table(tmp_path, monkeypatch, [
        {**fwd_entry((256, 512), 4096, PTR, kernel="gluon", gluon_config=G128, gluon_ms=0.5), "device": spec.kind},
        {**fwd_entry((384, 512), 4096, PTR, kernel="triton", gluon_config=G256, gluon_ms=0.9), "device": spec.kind},
    ], spec=spec)
    calls = []
    real = gb.grouped_gemm_gluon_bf16
    spied = gb.forward_eligible_launch  # the dispatch's entry to the kernel (its tensor checks already ran)
    monkeypatch.setattr(gb, "forward_eligible_launch", lambda *a, **k: calls.append(k) or spied(*a, **k))

    def run(w, **kw):
        return moe_torch.grouped_gemm(x, w, off, out_dtype=torch.bfloat16, implementation="triton", **kw)

    monkeypatch.setenv(ENV, "0")
    base_g, base_t = run(w_g), run(w_t)
    assert calls == []
    monkeypatch.delenv(ENV)
    y = run(w_g)
    assert calls == [G128] and torch.equal(y, real(x, w_g, off, **G128))
    assert_rel_fro(y.float(), base_g.float(), BF16_REL_FRO, "tuned gluon vs Triton")
    assert torch.equal(run(w_t), base_t) and len(calls) == 1  # the entry says triton
    y = gemm_triton.grouped_gemm_triton(x, w_g, off, None, None, torch.bfloat16, GroupedGemmConfig(**PTR))
    assert len(calls) == 1  # an explicit config: Triton
    monkeypatch.setenv(ENV, "1")
    y = run(w_t)
    assert calls[-1] == G256 and torch.equal(y, real(x, w_t, off, **G256))
