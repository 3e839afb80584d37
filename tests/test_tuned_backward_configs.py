"""The backward GEMMs' launch configs from the tuned tables ("per-shape configs from a tuner, stored per
device kind in the tree", dgrad and wgrad too), on the CPU: each lookup picks its own op's entry (``"op": "dgrad"`` /
``"wgrad"``; forward entries have no ``"op"``) with the nearest ``M_cap`` and the same ``N``, ``K``, dtype and out
dtype, skips an entry that breaks the kernel's rules (the heuristic then; a malformed entry, one whose config does not
build, refuses the whole table with a ValueError naming the file and the entry), an explicit ``config=`` wins, forward
lookups never see backward entries and backward lookups never see forward ones; the torch dgrad takes a tuned TMA
config only where ``EPMOE_TRITON_TMA_DGRAD`` allows it (else the entry's ``pointer_config``), the torch wgrad's
dispatch runs the kernel the entry measured (Gluon with its options, or Triton); and the tuners' ``--ops``.

The tables are temporary device-kind files ``<fw>/sm90/<kind>.json`` of a simulated Hopper (``common.TEST_SPEC``,
``common.write_tuned``; each ``config.TUNED_DIR`` patched, caches cleared), as in ``test_pallas_grouped_gemm.py`` /
``test_triton_grouped_gemm.py``.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import pytest
import torch

from moe_pallas.ops.grouped_gemm import config as jax_config
from moe_pallas.ops.grouped_gemm import pallas_mosaic_gpu_backward as mosaic_bwd
from moe_pallas.ops.grouped_gemm.config import (
    MosaicGroupedGemmConfig,
    heuristic_mosaic_grouped_gemm_config,
    heuristic_mosaic_wgrad_config,
    mosaic_dgrad_config,
    mosaic_grouped_gemm_config,
    mosaic_wgrad_config,
)
from moe_torch.ops.device import device_spec
from moe_torch.ops.grouped_gemm import config as torch_config
from moe_torch.ops.grouped_gemm import triton_backward as torch_bwd
from moe_torch.ops.grouped_gemm.config import (GroupedGemmConfig, GroupedGemmWgradConfig,
                                               grouped_gemm_config, grouped_gemm_dgrad_config,
                                               grouped_gemm_wgrad_config, heuristic_grouped_gemm_config,
                                               heuristic_grouped_gemm_dgrad_config, heuristic_grouped_gemm_wgrad_config,
                                               tuned_wgrad_kernel)
from common import TEST_SPEC, TORCH_DEVICE, write_tuned
from test_pallas_grouped_gemm import _spy_config

KIND = TEST_SPEC.kind
MOSAIC = "pallas_mosaic_gpu"
WS = dict(block_k=64, warp_specialized=True)


@pytest.fixture(autouse=True)
def _fresh_caches():
    """Both frameworks' tuned-file caches (and the Gluon options' cache) empty before and after each test."""
    from moe_torch.ops.grouped_gemm import gluon_backward

    caches = (jax_config.tuned_tables, torch_config.tuned_tables, gluon_backward._tuned_options)
    for c in caches:
        c.cache_clear()
    yield
    for c in caches:
        c.cache_clear()


def use_tables(tmp_path, monkeypatch, *, jax_entries=(), torch_entries=()) -> dict[str, str]:
    """Point each framework's tuned lookup at its own ``tmp_path/<fw>/sm90/Test_GPU.json`` holding the entries
    (caches cleared); returns ``{fw: path}``."""
    paths = {}
    for fw, module, entries in (("jax", jax_config, jax_entries), ("torch", torch_config, torch_entries)):
        paths[fw] = write_tuned(tmp_path / fw, entries)
        monkeypatch.setattr(module, "TUNED_DIR", str(tmp_path / fw))
        module.tuned_tables.cache_clear()
    return paths


def jax_entry(op: str | None, N: int, K: int, M_cap: int, config: dict, out_dtype: str | None = "bf16") -> dict:
    """A launch config of ``moe_pallas.ops.grouped_gemm.tune`` (``op=None``: a forward one, no ``"op"`` / ``"out_dtype"``)."""
    e = {"backend": MOSAIC, "device": KIND, "E": 32, "N": N, "K": K, "M_cap": M_cap, "dtype": "bf16",
         "fast_accum": None, "config": config, "ms": 1.0, "heuristic_ms": 1.1}
    return e if op is None else {"op": op, **e, "out_dtype": out_dtype}


# ------------------------------------------------------------------------------------------------ JAX Mosaic GPU


SPLIT = dict(block_m=128, block_n=128, max_concurrent_steps=3, grid_block_n=2, split_m=True, **WS)
ONE_WG = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=2)
FWD = dict(block_m=64, block_n=256, block_k=64, max_concurrent_steps=4, grid_block_n=2)


def test_jax_backward_lookups_take_their_own_entries(tmp_path, monkeypatch):
    """dgrad / wgrad: their own op's entry (nearest M_cap, same N, K, out dtype); an entry breaking the kernel's rules,
    another out dtype, no device: the heuristic. A field the config does not have: the table is refused (ValueError
    naming the file and the entry). Forward and backward entries of the same N, K, M_cap never serve each other."""
    N, K = 7168, 2048  # down: dgrad d_x [M, 2048] contracts over 7168
    entries = [
        jax_entry(None, N, K, 16384, FWD),
        jax_entry("dgrad", N, K, 16384, SPLIT),
        jax_entry("wgrad", N, K, 16384, ONE_WG),
        # gate_up: a dgrad entry whose 128 x 256 consumer tile breaks the warp-specialized rule (<= 128 x 128), a wgrad
        # entry with split_m (not served by the wgrad), a forward-only shape
        jax_entry("dgrad", 4096, 7168, 16384, dict(SPLIT, block_n=256, split_m=False)),
        jax_entry("wgrad", 4096, 7168, 16384, dict(ONE_WG, warp_specialized=True, split_m=True)),
        jax_entry(None, 2048, 7168, 16384, FWD),
    ]
    unknown_field = jax_entry("dgrad", 4096, 2048, 16384, dict(ONE_WG, tile="unknown field"))
    paths = use_tables(tmp_path, monkeypatch, jax_entries=[*entries[:5], unknown_field, *entries[5:]])
    for look in (lambda: mosaic_dgrad_config(16384, N, K, 32, 2, device=TEST_SPEC),
                 lambda: mosaic_grouped_gemm_config(16384, N, K, 32, 2, device=TEST_SPEC)):
        with pytest.raises(ValueError, match="config is not a MosaicGroupedGemmConfig") as exc:
            look()
        assert f"tuned table {paths['jax']}: entry 5 " in str(exc.value) and "tile" in str(exc.value)
    use_tables(tmp_path, monkeypatch, jax_entries=entries)  # the table without the malformed entry
    dgrad = lambda M, n=N, k=K, **kw: mosaic_dgrad_config(M, n, k, 32, 2, device=TEST_SPEC, **kw)  # noqa: E731
    wgrad = lambda M, n=N, k=K, **kw: mosaic_wgrad_config(M, n, k, 32, 2, 2, device=TEST_SPEC, **kw)  # noqa: E731
    heur_dgrad = lambda M, n=N, k=K: heuristic_mosaic_grouped_gemm_config(M, k, n, 32, 2, out_itemsize=2)  # noqa: E731
    assert dgrad(16384) == dgrad(8192) == MosaicGroupedGemmConfig(**SPLIT)  # nearest M_cap; >= 256 rows an expert
    few = dgrad(4096)  # 128 rows an expert: the split_m entry split by columns instead, as the forward's
    assert few == MosaicGroupedGemmConfig(**dict(SPLIT, split_m=False))
    assert wgrad(16384) == wgrad(4096) == MosaicGroupedGemmConfig(**ONE_WG)
    # more than BACKWARD_TUNED_MAX_RATIO (4) away from every entry's M_cap: the heuristics (small problems)
    assert wgrad(2048) == heuristic_mosaic_wgrad_config(2048, N, K, 32, 2, 2)
    assert dgrad(2048) == heur_dgrad(2048)
    assert dgrad(16384, out_itemsize=4) == heuristic_mosaic_grouped_gemm_config(16384, K, N, 32, 2, out_itemsize=4)
    f32_out = mosaic_wgrad_config(16384, N, K, 32, 2, 4, device=TEST_SPEC)  # no float32-out entry
    assert f32_out == heuristic_mosaic_wgrad_config(16384, N, K, 32, 2, 4)
    for n, k in ((4096, 7168), (4096, 2048)):  # breaks a rule / no entry (the malformed one is gone): the heuristic
        assert dgrad(16384, n, k) == heur_dgrad(16384, n, k)
    assert wgrad(16384, 4096, 7168) == heuristic_mosaic_wgrad_config(16384, 4096, 7168, 32, 2, 2)
    assert mosaic_dgrad_config(16384, N, K, 32, 2) == heur_dgrad(16384)  # no device (the CPU)
    # forward vs backward: same N, K, M_cap, each its own
    assert mosaic_grouped_gemm_config(16384, N, K, 32, 2, device=TEST_SPEC) == MosaicGroupedGemmConfig(**FWD)
    assert jax_config.nearest_tuned(TEST_SPEC, MOSAIC, 16384, N, K, 2) == FWD
    assert jax_config.nearest_tuned(TEST_SPEC, MOSAIC, 16384, N, K, 2, op="dgrad") == SPLIT
    assert dgrad(16384, 2048, 7168) == heur_dgrad(16384, 2048, 7168)  # only a forward entry there
    assert wgrad(16384, 2048, 7168) == heuristic_mosaic_wgrad_config(16384, 2048, 7168, 32, 2, 2)
    assert (mosaic_grouped_gemm_config(16384, 4096, 7168, 32, 2, device=TEST_SPEC)  # only backward entries there
            == heuristic_mosaic_grouped_gemm_config(16384, 4096, 7168, 32, 2))


def test_jax_backward_kernels_default_to_the_tuned_entry_and_an_explicit_config_wins(tmp_path, monkeypatch):
    """The Mosaic dgrad / wgrad without ``config`` ask the lookup with the host-side device spec (traced on the CPU)
    and get the tuned entry; with ``config=`` the lookup is not asked."""
    M, N, K = 136, 256, 384  # shapes of no other test: the jit cache cannot hide a trace
    dgrad_cfg = dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
    wgrad_cfg = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=3, grid_block_n=1)
    use_tables(tmp_path, monkeypatch, jax_entries=[jax_entry("dgrad", N, K, 128, dgrad_cfg),
                                                   jax_entry("wgrad", N, K, 128, wgrad_cfg)])
    monkeypatch.setattr(mosaic_bwd, "gpu_device_spec", lambda: TEST_SPEC)
    d_calls = _spy_config(monkeypatch, mosaic_bwd, "mosaic_dgrad_config")
    w_calls = _spy_config(monkeypatch, mosaic_bwd, "mosaic_wgrad_config")
    S = jax.ShapeDtypeStruct
    d_y, w, x, off = S((M, N), jnp.bfloat16), S((4, N, K), jnp.bfloat16), S((M, K), jnp.bfloat16), S((5,), jnp.int32)
    mosaic_bwd.grouped_gemm_dgrad_pallas_mosaic_gpu.trace(d_y, w, off)
    mosaic_bwd.grouped_gemm_wgrad_pallas_mosaic_gpu.trace(x, d_y, off, out_dtype=jnp.bfloat16)
    assert d_calls[-1]["device"] == TEST_SPEC and d_calls[-1]["result"] == MosaicGroupedGemmConfig(**dgrad_cfg)
    assert w_calls[-1]["device"] == TEST_SPEC and w_calls[-1]["result"] == MosaicGroupedGemmConfig(**wgrad_cfg)
    explicit = MosaicGroupedGemmConfig(block_m=64, block_n=128, block_k=64, max_concurrent_steps=2)
    mosaic_bwd.grouped_gemm_dgrad_pallas_mosaic_gpu.trace(d_y, w, off, config=explicit)
    mosaic_bwd.grouped_gemm_wgrad_pallas_mosaic_gpu.trace(x, d_y, off, out_dtype=jnp.bfloat16,
                                                          config=dataclasses.replace(explicit, block_m=128))
    assert len(d_calls) == 1 and len(w_calls) == 1


# ------------------------------------------------------------------------------------------------ torch


WIDE = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4, group_m=8)
POINTER = dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, group_m=8)
T_WGRAD = dict(block_n=128, block_k=256, block_m=32, num_warps=8, num_stages=4)


def torch_entry(op: str | None, N: int, K: int, M_cap: int, config: dict, **extra) -> dict:
    """An entry of ``moe_torch.ops.grouped_gemm.tune`` (``op=None``: a forward one, no ``"op"`` / ``"out_dtype"``)."""
    e = {"device": KIND, "E": 32, "N": N, "K": K, "M_cap": M_cap, "dtype": "bf16", "config": config, "ms": 1.0,
         "heuristic_ms": 1.1}
    return e if op is None else {"op": op, **e, "out_dtype": "bf16", **extra}


def test_torch_dgrad_lookup_honours_the_tma_switch(tmp_path, monkeypatch):
    """A tuned TMA dgrad entry is the default only where the switch allows TMA (``tma``: ``EPMOE_TRITON_TMA_DGRAD``,
    and ``sm90``); else its ``pointer_config``, or the heuristic without one. FP8 weights, another out dtype, an entry
    breaking the rules: the heuristic. Forward and dgrad entries never serve each other."""
    N, K = 7168, 2048
    use_tables(tmp_path, monkeypatch, torch_entries=[
        torch_entry(None, N, K, 16384, WIDE),
        torch_entry("dgrad", N, K, 16384, dict(WIDE, tma=True), pointer_config=POINTER),
        torch_entry("dgrad", 4096, 7168, 16384, dict(WIDE, tma=True)),  # a TMA winner without a pointer_config
        torch_entry("dgrad", 4096, 2048, 16384, dict(POINTER, block_k=96)),  # not a power of 2: breaks the rules
        torch_entry("dgrad", 2048, 4096, 2048, POINTER),
        torch_entry(None, 1024, 7168, 16384, POINTER),
    ])
    look = lambda M, n=N, k=K, **kw: grouped_gemm_dgrad_config(M, n, k, 32, 16, device=TEST_SPEC,  # noqa: E731
                                                               **{"sm90": True, "tma": True, "out_bits": 16, **kw})
    heur = lambda M, n=N, k=K: heuristic_grouped_gemm_dgrad_config(M, n, k, 32, 16)  # noqa: E731
    assert look(16384) == look(8192) == GroupedGemmConfig(**WIDE, tma=True)
    assert look(16384, tma=False) == look(16384, sm90=False) == GroupedGemmConfig(**POINTER)  # the switch off: pointer
    assert look(16384, n=4096, k=7168, tma=False) == heur(16384, 4096, 7168) and not heur(16384, 4096, 7168).tma
    assert look(16384, n=4096, k=7168) == GroupedGemmConfig(**WIDE, tma=True)
    assert look(16384, n=4096, k=2048) == dataclasses.replace(heur(16384, 4096, 2048), tma=True)  # the heuristic's TMA
    assert look(512, n=2048, k=4096) == GroupedGemmConfig(**POINTER)  # the nearest (only) M_cap, 4x away
    # more than BACKWARD_TUNED_MAX_RATIO away: the heuristic (a 256-row step keeps its small tiles)
    assert look(256, n=2048, k=4096) == heur(256, 2048, 4096)
    assert look(16384, w_fp8=True) == heur(16384)  # FP8 weights: another kernel path, never the tuned entry
    assert look(16384, out_bits=32, tma=False) == heur(16384)  # tuned for bf16 d_x only
    assert grouped_gemm_dgrad_config(16384, N, K, 32, 16, sm90=True, tma=False) == heur(16384)  # no device
    # forward vs dgrad: each its own entries
    assert grouped_gemm_config(16384, N, K, 32, 16, device=TEST_SPEC) == GroupedGemmConfig(**WIDE)
    assert (grouped_gemm_config(16384, 4096, 7168, 32, 16, device=TEST_SPEC)  # only a dgrad entry there: the
            == torch_config.hopper_wide_config(16384, 4096, 7168, 32, 16))  # sm90 heuristic of a large forward
    assert look(16384, n=1024, k=7168, tma=False) == heur(16384, 1024, 7168)  # only a forward entry there


def test_torch_explicit_dgrad_and_wgrad_configs_win(monkeypatch):
    """The Triton dgrad / wgrad look a default up only without ``config``: with one, the lookup is not asked. Without,
    it is asked with the device's spec (none on the CPU, interpreted: the heuristic) and the output's width."""
    calls = {"dgrad": [], "wgrad": []}
    for op, name in (("dgrad", "_dgrad_config"), ("wgrad", "_wgrad_config")):
        real = getattr(torch_bwd, name)
        monkeypatch.setattr(torch_bwd, name, lambda *a, _r=real, _c=calls[op], **k: _c.append(k) or _r(*a, **k))
    g = torch.Generator().manual_seed(0)
    d_y, x = torch.randn(8, 16, generator=g).to(TORCH_DEVICE), torch.randn(8, 32, generator=g).to(TORCH_DEVICE)
    w = torch.randn(2, 16, 32, generator=g).to(TORCH_DEVICE)
    off = torch.tensor([0, 3, 8], dtype=torch.int32, device=TORCH_DEVICE)
    spec = device_spec() if TORCH_DEVICE == "cuda" else None
    small = GroupedGemmConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
    torch_bwd.grouped_gemm_dgrad_triton(d_y, w, off, None, torch.float32, small)
    torch_bwd.grouped_gemm_wgrad_triton(x, d_y, off, torch.float32,
                                        GroupedGemmWgradConfig(block_n=16, block_k=16, block_m=16, num_warps=4,
                                                               num_stages=1))
    assert calls == {"dgrad": [], "wgrad": []}
    torch_bwd.grouped_gemm_dgrad_triton(d_y, w, off, None, torch.float32)
    torch_bwd.grouped_gemm_wgrad_triton(x, d_y, off, torch.float32)
    assert calls["dgrad"][-1]["device"] == spec and calls["dgrad"][-1]["out_bits"] == 32
    assert calls["wgrad"][-1]["device"] == spec and calls["wgrad"][-1]["out_bits"] == 32


def test_torch_wgrad_lookup_and_the_dispatch_kernel(tmp_path, monkeypatch):
    """The wgrad entry's ``"kernel"``: Triton (its ``config`` is the Triton kernel's default, and the dispatch skips the
    Gluon kernel) or Gluon (its options for the Gluon kernel; ``triton_config`` for the Triton one); options the Gluon
    kernel refuses or another out dtype: its defaults; no entry: the dispatch's default (Gluon where eligible)."""
    from moe_torch.ops.grouped_gemm import gluon_backward

    gluon_opts = {"epilogue": "pointer", "num_stages": 4}
    use_tables(tmp_path, monkeypatch, torch_entries=[
        torch_entry(None, 7168, 2048, 16384, POINTER),
        torch_entry("wgrad", 7168, 2048, 16384, gluon_opts, kernel="gluon", triton_config=T_WGRAD),
        torch_entry("wgrad", 4096, 7168, 16384, T_WGRAD, kernel="triton"),
        torch_entry("wgrad", 2048, 4096, 16384, {"epilogue": "tma", "num_stages": 9}, kernel="gluon"),
        torch_entry("wgrad", 4096, 2048, 16384, dict(T_WGRAD, block_m=24), kernel="triton"),  # not a power of 2
    ])
    def look(n, k, M=16384, out_bits=16):
        return grouped_gemm_wgrad_config(M, n, k, 32, 16, out_bits=out_bits, device=TEST_SPEC)

    heur = lambda n, k, M=16384: heuristic_grouped_gemm_wgrad_config(M, n, k, 32, 16)  # noqa: E731
    assert look(7168, 2048) == look(4096, 7168) == look(4096, 7168, M=4096) == GroupedGemmWgradConfig(**T_WGRAD)
    assert look(2048, 4096) == heur(2048, 4096)  # a Gluon winner without a Triton config
    assert look(4096, 2048) == heur(4096, 2048)  # breaks the rules
    assert look(7168, 2048, out_bits=32) == heur(7168, 2048)
    assert grouped_gemm_wgrad_config(16384, 7168, 2048, 32, 16) == heur(7168, 2048)  # no device
    assert tuned_wgrad_kernel(16384, 7168, 2048, 16, 16, TEST_SPEC) == ("gluon", gluon_opts)
    assert tuned_wgrad_kernel(16384, 4096, 7168, 16, 16, TEST_SPEC) == ("triton", {})
    assert tuned_wgrad_kernel(16384, 1024, 7168, 16, 16, TEST_SPEC) is None
    # the dispatch's options for an eligible request (api._gluon_wgrad): None runs the Triton kernel
    monkeypatch.setattr(gluon_backward, "device_spec", lambda device=None: TEST_SPEC)
    bf16 = torch.bfloat16

    def options(n, k, out=bf16):
        return gluon_backward.tuned_wgrad_options(torch.empty(16384, k, dtype=bf16), torch.empty(16384, n, dtype=bf16),
                                                  torch.empty(33, dtype=torch.int32), out)

    assert options(7168, 2048) == gluon_opts
    assert options(4096, 7168) is None
    assert options(2048, 4096) == {}  # 9 stages: the kernel would refuse them; its defaults
    assert options(7168, 2048, torch.float32) == {}  # no float32-out entry
    assert options(1024, 7168) == {}
    assert gluon_backward.gluon_wgrad_options_problem("tma", None, torch.float32)
    assert gluon_backward.gluon_wgrad_options_problem("pointer", 4, torch.float32) is None


# ------------------------------------------------------------------------------------------------ the tuners


def test_tuners_parse_ops_and_refuse_unknown_ones(monkeypatch, capsys):
    """``--ops``: a comma list of fwd, dgrad, wgrad (default fwd: the forward alone); an unknown op is a usage error
    naming it, before any GPU is looked for."""
    from moe_pallas.ops.grouped_gemm import tune as tj
    from moe_torch.ops.grouped_gemm import tune as tt

    for mod, prog in ((tj, "moe_pallas.ops.grouped_gemm.tune"), (tt, "moe_torch.ops.grouped_gemm.tune")):
        assert mod.parse_ops("dgrad, wgrad,dgrad") == ["dgrad", "wgrad"]
        assert mod.parse_ops("fwd") == ["fwd"]
        for bad in ("", "fwd,bwd"):
            with pytest.raises(ValueError, match="--ops: a comma list of fwd, dgrad, wgrad"):
                mod.parse_ops(bad)
        monkeypatch.setattr(sys, "argv", [prog, "--ops", "dgrad,dgard"])
        with pytest.raises(SystemExit) as exc:
            mod.main()
        assert exc.value.code == 2
        assert "--ops: a comma list of fwd, dgrad, wgrad; got 'dgrad,dgard' (unknown: dgard)" in capsys.readouterr().err


def test_jax_tuner_backward_candidates_and_keys():
    """The Mosaic backward candidates keep the kernels' rules at both tuned shapes and hold what the tuners need: dgrad's
    split_m variants and snake widths and the one-warpgroup kernel, wgrad's warp-specialized or not and its stages; the
    heuristic is among them at M=16384; forward and backward entries of one problem have different keys."""
    from moe_pallas.ops.grouped_gemm import tune as tj

    for K, N in tj.SHAPES:
        dgrad, wgrad = tj.backward_candidates("dgrad", N, K), tj.backward_candidates("wgrad", N, K)
        assert len(dgrad) == len(tj.MOSAIC_DGRAD_SPACE) and len(wgrad) == len(tj.MOSAIC_WGRAD_SPACE)
        assert {c.split_m for c in dgrad} == {True, False} and len({c.grid_block_n for c in dgrad}) >= 2
        assert {c.warp_specialized for c in dgrad} == {c.warp_specialized for c in wgrad} == {True, False}
        assert len({c.max_concurrent_steps for c in wgrad}) >= 3
        for op, cands in (("dgrad", dgrad), ("wgrad", wgrad)):
            assert tj.backward_heuristic(op, 16384, N, K) in cands
    fwd = jax_entry(None, 7168, 2048, 16384, FWD)
    keys = {tj.entry_key(fwd), tj.entry_key(jax_entry("dgrad", 7168, 2048, 16384, SPLIT)),
            tj.entry_key(jax_entry("wgrad", 7168, 2048, 16384, ONE_WG))}
    assert len(keys) == 3 and tj.entry_key(fwd)[:7] == ("pallas_mosaic_gpu", 32, 7168, 2048, 16384, "bf16", None)


def test_triton_tuner_backward_entries_round_trip(tmp_path, monkeypatch):
    """``moe_torch.ops.grouped_gemm.tune.backward_entry``: the fastest correct candidate (``inf``: wrong or failed, never chosen), a
    TMA dgrad winner with the fastest pointer config beside it, a Gluon wgrad winner with the fastest Triton config; the
    lookups read the entries back as written."""
    from moe_torch.ops.grouped_gemm import tune as tt

    tma, ptr, slow = (GroupedGemmConfig(**WIDE, tma=True), GroupedGemmConfig(**POINTER),
                      GroupedGemmConfig(**dict(POINTER, num_stages=3)))
    where = dict(dev=KIND, M=16384, routings=["uniform"])
    dgrad = tt.backward_entry("dgrad", {("triton", slow): 1.2, ("triton", tma): 0.9, ("triton", ptr): 1.0,
                                        ("triton", dataclasses.replace(ptr, block_m=64)): float("inf")},
                              ("triton", slow), True, N=7168, K=2048, **where)
    assert dgrad["config"] == dataclasses.asdict(tma) and dgrad["pointer_config"] == dataclasses.asdict(ptr)
    assert (dgrad["ms"], dgrad["pointer_ms"], dgrad["heuristic_ms"], dgrad["configs_timed"]) == (0.9, 1.0, 1.2, 3)
    gluon = ("gluon", (("epilogue", "tma"), ("num_stages", 3)))
    trit = ("triton", GroupedGemmWgradConfig(**T_WGRAD))
    wgrad = tt.backward_entry("wgrad", {gluon: 1.5, trit: 1.7}, gluon, False, N=7168, K=2048, **where)
    assert (wgrad["kernel"], wgrad["config"], wgrad["triton_config"], wgrad["complete"]) == (
        "gluon", {"epilogue": "tma", "num_stages": 3}, T_WGRAD, False)
    other = tt.backward_entry("wgrad", {gluon: 1.8, trit: 1.7}, gluon, True, N=4096, K=7168, **where)
    assert other["kernel"] == "triton" and "triton_config" not in other
    assert tt.backward_entry("dgrad", {("triton", ptr): float("inf")}, ("triton", ptr), True, N=1, K=1, **where) is None
    assert len({tt.entry_key(e) for e in (dgrad, wgrad, torch_entry(None, 7168, 2048, 16384, POINTER))}) == 3
    use_tables(tmp_path, monkeypatch, torch_entries=[dgrad, wgrad, other])
    assert grouped_gemm_dgrad_config(16384, 7168, 2048, 32, 16, sm90=True, tma=False, device=TEST_SPEC) == ptr
    assert grouped_gemm_dgrad_config(16384, 7168, 2048, 32, 16, sm90=True, tma=True, device=TEST_SPEC) == tma
    assert tuned_wgrad_kernel(16384, 7168, 2048, 16, 16, TEST_SPEC) == ("gluon", {"epilogue": "tma", "num_stages": 3})
    assert grouped_gemm_wgrad_config(16384, 7168, 2048, 32, 16, device=TEST_SPEC) == trit[1]
    assert tuned_wgrad_kernel(16384, 4096, 7168, 16, 16, TEST_SPEC) == ("triton", {})
