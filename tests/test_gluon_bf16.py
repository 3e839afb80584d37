"""The 16-bit Gluon grouped GEMM, forward and dgrad (``moe_torch/ops/grouped_gemm/gluon_bf16.py``): on a CPU, and on
an sm_90 GPU.

* compile-only for sm_90a (one child process without ``TRITON_INTERPRET`` for every job, which ``conftest.py`` sets
  on the CPU): both weight layouts (forward K-major ``w`` boxes, dgrad MN-major), ``block_n`` 128 / 256, both
  epilogues at their deepest rings, E = 32 and 256, bf16 and fp16. The PTX has TMA loads, 16-bit ``wgmma``
  (``m64n{BN}k16.f32.bf16.bf16``), one ``wgmma`` group left in flight (``wait_group 1``; SASS ``DEPBAR.LE gsb0,
  0x1``), mbarriers and ``setmaxnreg``; ``ptxas -arch=sm_90a -v`` rc 0, no C7514 serialization warning, no spill at
  E = 32 (a few bytes in the producer at E = 256: printed), shared memory <= 227 KiB;
* the host-side refusals on CPU tensors (before any launch), and the dispatch never picking the kernels on a CPU or
  with ``EPMOE_TRITON_GLUON_BF16=0`` / ``EPMOE_TRITON_GLUON_DGRAD`` off (its default; the forward's switch unset
  follows the tuned table: ``test_tuned_forward_kernel.py``);
* on an sm_90 GPU (``EPMOE_TEST_DEVICE=gpu``; skipped elsewhere): random problems against the reference (T=1, empty
  experts, all rows on one expert, unowned head and tail rows holding NaN, N and K tails, E=256 ragged, 64-row shares
  straddling an expert's last row, an expert ending at ``M_cap``, more tiles than SMs), both layouts, both tile
  widths and epilogues, bf16 and fp16; decreasing offsets as the Triton kernels; the dispatch with the switches on
  bit-identical to calling the launchers with the dispatch's options. Timings:
  BENCHMARKS.md.
"""

from __future__ import annotations

import pytest
import torch

from common import TORCH_DEVICE
from sm90 import run_compile_child

gb = pytest.importorskip("moe_torch.ops.grouped_gemm.gluon_bf16", reason="triton.experimental.gluon unavailable")
OP, OP_D = "grouped_gemm_gluon_bf16", "grouped_gemm_gluon_dgrad"

_CHILD = r"""
import json, os, subprocess, sys, tempfile
import torch, triton
from moe_torch.ops.grouped_gemm import gluon_bf16 as GB
jobs = {}
for layout, make in (("fwd", GB.compile_sm90_bf16), ("dgrad", GB.compile_sm90_dgrad)):
    for bn in (128, 256):
        for ep in ("pointer", "tma"):
            jobs[f"{layout}-bn{bn}-{ep}-bf16-E32"] = (make, dict(block_n=bn, epilogue=ep, E=32))
        jobs[f"{layout}-bn{bn}-tma-bf16-E256"] = (make, dict(block_n=bn, epilogue="tma", E=256))
    jobs[f"{layout}-bn256-tma-fp16-E32"] = (make, dict(block_n=256, epilogue="tma", E=32, dtype=torch.float16))
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
out = {}
for key, (make, kw) in jobs.items():
    c = make(**kw)
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(c.asm["ptx"])
        open(os.path.join(d, "k.cubin"), "wb").write(c.asm["cubin"])
        info = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o",
                               os.path.join(d, "k.o")], capture_output=True, text=True)
        sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True).stdout
    out[key] = {"ptx": c.asm["ptx"], "ptxas": info.stdout + info.stderr, "ptxas_rc": info.returncode,
                "sass_waits": sorted({l.split("DEPBAR")[1].split(";")[0].strip() for l in sass.splitlines()
                                      if "WARPGROUP.DEPBAR" in l}),
                "shared": c.metadata.shared}
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def compiled():
    return run_compile_child(_CHILD)


def test_compiles_for_sm90a(compiled):
    """Every configuration for sm_90a: TMA loads, 16-bit wgmma of the tile width, wait_group 1, mbarriers,
    setmaxnreg; ptxas rc 0, no C7514, no spill at E = 32 (E = 256: at most a few bytes, printed), <= 227 KiB; the
    TMA epilogue's stores only where asked for."""
    assert len(compiled) == 14, list(compiled)
    facts = {}
    for key, c in compiled.items():
        ptx, info = c["ptx"], c["ptxas"]
        bn = 256 if "-bn256-" in key else 128
        ab = "f16.f16" if "-fp16-" in key else "bf16.bf16"
        assert ".target sm_90a" in ptx, key
        assert "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier" in ptx, key  # TMA loads
        assert f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{ab}" in ptx, key
        assert "wgmma.wait_group.sync.aligned 1" in ptx, key
        assert "mbarrier.try_wait" in ptx and "mbarrier.arrive" in ptx, key
        assert "setmaxnreg" in ptx, key
        assert c["ptxas_rc"] == 0, (key, info)
        assert "C7514" not in info, (key, info)  # wgmma not serialized
        spill = int(info.split(" bytes spill stores")[0].rsplit(" ", 1)[-1])
        assert spill == 0 if key.endswith("E32") else 0 <= spill <= 64, (key, info)
        assert "0x1" in " ".join(c["sass_waits"]), (key, c["sass_waits"])
        assert c["shared"] <= 227 * 1024, (key, c["shared"])
        tma_store = "cp.async.bulk.tensor.2d.global.shared::cta" in ptx
        assert tma_store == ("-tma-" in key), key
        if tma_store:
            assert "fence.proxy.async.shared::cta" in ptx and "cp.async.bulk.wait_group" in ptx, key
        facts[key] = (info.split("Used ")[1].split(" registers")[0], spill, c["shared"])
    print("\nptxas (registers, spill bytes, shared bytes):")
    for key, f in facts.items():
        print(f"  {key}: {f}")


def test_compiled_dgrad_reads_w_mn_major(compiled):
    """The two layouts differ only in the ``w`` operand: the forward's ``wgmma`` B descriptor is K-major, the
    dgrad's MN-major (the wgmma's trailing ``tnspB`` immediate: 0 forward, 1 dgrad; A K-major in both)."""
    import re

    for layout, tnsp_b in (("fwd", "0"), ("dgrad", "1")):
        ptx = compiled[f"{layout}-bn128-pointer-bf16-E32"]["ptx"]
        ops = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16[^;]*;", ptx)
        assert ops, layout
        # ... p, 1, 1, 0, tnspB;  (scale-d, imm-scale-a, imm-scale-b, tnspA, tnspB)
        assert {op.rstrip(";").rsplit(",", 1)[1].strip() for op in ops} == {tnsp_b}, (layout, ops[0][-60:])


# ---------------------------------------------------------------------------------------- host refusals on a CPU

def _inputs(M=4, E=2, N=128, K=64, dtype=torch.bfloat16, dgrad=False):
    a = torch.zeros(M, N if dgrad else K, dtype=dtype)
    w = torch.zeros(E, N, K, dtype=dtype)
    off = torch.tensor([0] + [M] * E, dtype=torch.int32)
    return a, w, off


LAUNCHERS = {"fwd": (OP, "x", gb.grouped_gemm_gluon_bf16), "dgrad": (OP_D, "d_y", gb.grouped_gemm_gluon_dgrad)}


@pytest.mark.parametrize("layout", sorted(LAUNCHERS))
@pytest.mark.parametrize("which, dtype, pattern", [
    ("a", torch.float32, "{a} must be of dtype torch.bfloat16 or torch.float16, got torch.float32"),
    ("a", torch.float8_e4m3fn, "{a} must be of dtype torch.bfloat16 or torch.float16"),
    ("w", torch.float16, "w must be of {a}'s dtype torch.bfloat16, got torch.float16"),
    ("off", torch.int64, "expert_offsets must be of dtype torch.int32, got torch.int64")])
def test_refuses_dtypes(layout, which, dtype, pattern):
    op, a_name, call = LAUNCHERS[layout]
    a, w, off = _inputs(dgrad=layout == "dgrad")
    args = {"a": a, "w": w, "off": off}
    args[which] = args[which].to(dtype)
    with pytest.raises(TypeError, match=f"{op}: " + pattern.format(a=a_name)):
        call(args["a"], args["w"], args["off"])


@pytest.mark.parametrize("layout, a_shape, w_shape, off_len, exc, pattern", [
    ("fwd", (4, 64), (2, 128, 72), 3, ValueError, "w must be \\[E, N, K\\] with K = x.shape\\[1\\] = 64"),
    ("fwd", (4, 60), (2, 128, 60), 3, ValueError, "w must be of K = shape\\[2\\] a positive multiple of 8.*K = 60"),
    ("fwd", (4, 64), (2, 128, 64), 4, ValueError, "expert_offsets must be of shape \\[E \\+ 1\\] = \\[3\\]"),
    ("fwd", (4, 64, 1), (2, 128, 64), 3, ValueError, "x must be 2-D"),
    ("fwd", (4, 64), (0, 128, 64), 1, ValueError, "w must be of E >= 1 and N >= 1"),
    ("dgrad", (4, 128), (2, 192, 64), 3, ValueError, "w must be \\[E, N, K\\] with N = d_y.shape\\[1\\] = 128"),
    ("dgrad", (4, 96), (2, 96, 64), 3, NotImplementedError,
     "d_y must have N = shape\\[1\\] a multiple of 64.*next expert's rows.*N = 96"),
    ("dgrad", (4, 128), (2, 128, 100), 3, ValueError, "w must be of K = shape\\[2\\] a positive multiple of 8"),
    ("dgrad", (4, 64), (4096, 64, 8), 4097, ValueError, "w must be of at most 4095 experts.*E = 4096")])
def test_refuses_shapes(layout, a_shape, w_shape, off_len, exc, pattern):
    op, _, call = LAUNCHERS[layout]
    a = torch.zeros(a_shape, dtype=torch.bfloat16)
    w = torch.empty(w_shape, dtype=torch.bfloat16)
    off = torch.zeros(off_len, dtype=torch.int32)
    with pytest.raises(exc, match=f"{op}: {pattern}"):
        call(a, w, off)


@pytest.mark.parametrize("layout", sorted(LAUNCHERS))
@pytest.mark.parametrize("kwargs, pattern", [
    (dict(block_n=64), "block_n must be 128 or 256, got 64"),
    (dict(block_n=128.0), "block_n must be 128 or 256, got 128.0"),
    (dict(block_n=256, epilogue="tma", num_stages=4), "num_stages must be an int in \\[2, 3\\] at block_n = 256 "
                                                       "with epilogue 'tma'.*got 4"),
    (dict(block_n=128, epilogue="pointer", num_stages=8), "num_stages must be an int in \\[2, 7\\].*got 8"),
    (dict(num_stages=1), "num_stages must be an int in \\[2, "),
    (dict(epilogue="smem"), "epilogue must be 'tma' or 'pointer', got 'smem'")])
def test_refuses_options(layout, kwargs, pattern):
    """Options are checked before the device (so on a CPU too), after the shapes."""
    op, _, call = LAUNCHERS[layout]
    with pytest.raises(ValueError, match=f"{op}: {pattern}"):
        call(*_inputs(dgrad=layout == "dgrad"), **kwargs)


def test_forward_tma_epilogue_needs_n_multiple_of_8():
    x, w, off = _inputs(N=100)
    with pytest.raises(ValueError, match=f"{OP}: epilogue must be 'pointer' for N % 8 != 0.*N = 100"):
        gb.grouped_gemm_gluon_bf16(x, w, off, epilogue="tma")


@pytest.mark.parametrize("layout", sorted(LAUNCHERS))
def test_refuses_non_contiguous(layout):
    op, a_name, call = LAUNCHERS[layout]
    a, w, off = _inputs(M=64, dgrad=layout == "dgrad")
    a_t = torch.zeros(a.shape[1], a.shape[0], dtype=a.dtype).t()
    with pytest.raises(ValueError, match=f"{op}: {a_name} must be contiguous, got strides \\(1, 64\\)"):
        call(a_t, w, off)


@pytest.mark.parametrize("layout", sorted(LAUNCHERS))
def test_refuses_cpu_device(layout):
    op, a_name, call = LAUNCHERS[layout]
    with pytest.raises(NotImplementedError, match=f"{op}: {a_name} .*CUDA device of compute capability \\(9, 0\\)"
                                                  ".*got device cpu"):
        call(*_inputs(dgrad=layout == "dgrad"))


def test_dispatch_never_on_cpu_or_switched_off(monkeypatch):
    """On a CPU (switches unset, on or off) neither dispatch picks the kernels; with the switches off (the forward's
    ``0``, the dgrad's default) the Gluon module is not even consulted."""
    import moe_torch.ops.grouped_gemm.triton as gemm_triton
    import moe_torch.ops.grouped_gemm.triton_backward as gemm_bwd
    from moe_torch.ops import triton_common

    x, w, off = _inputs(M=8192, E=4, N=256, K=512)
    d_y, _, _ = _inputs(M=8192, E=4, N=256, K=512, dgrad=True)
    for raw in (None, "0", "1"):
        for env in (triton_common.GLUON_BF16_ENV, triton_common.GLUON_DGRAD_ENV):
            if raw is None:
                monkeypatch.delenv(env, raising=False)
            else:
                monkeypatch.setenv(env, raw)
        assert triton_common.gluon_bf16_enabled() is (raw == "1")
        assert triton_common.gluon_dgrad_enabled() is (raw == "1")
        assert not gemm_triton.gluon_bf16_eligible(x, w, off, None, None, torch.bfloat16)
        assert not gemm_bwd.gluon_dgrad_eligible(d_y, w, off, None, torch.bfloat16)
        assert not gb.forward_eligible(x, w, off, None, None, torch.bfloat16)
        assert not gb.dgrad_eligible(d_y, w, off, None, torch.bfloat16)
    monkeypatch.setenv(triton_common.GLUON_BF16_ENV, "0")
    monkeypatch.delenv(triton_common.GLUON_DGRAD_ENV)
    monkeypatch.setattr(gb, "forward_refusal", lambda *a, **k: pytest.fail("consulted with the switch off"))
    monkeypatch.setattr(gb, "dgrad_eligible", lambda *a, **k: pytest.fail("consulted with the switch off"))
    assert not gemm_triton.gluon_bf16_eligible(x, w, off, None, None, torch.bfloat16)
    assert not gemm_bwd.gluon_dgrad_eligible(d_y, w, off, None, torch.bfloat16)


# ---------------------------------------------------------------------------------------------- on an sm_90 GPU
# (EPMOE_TEST_DEVICE=gpu on an H100 / H200; skipped elsewhere, with the reason)

def _sm90() -> bool:
    return TORCH_DEVICE == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the Gluon kernel runs on a CUDA device of compute capability "
                                "(9, 0) only (EPMOE_TEST_DEVICE=gpu on an H100 / H200)")


def _problem(sizes, N, K, *, lead=0, tail=0, offsets=None, dgrad=False, dtype=torch.bfloat16, seed=0, nan=True):
    """``(a, w, offsets)``: ``a`` is ``x [M_cap, K]`` (forward) or ``d_y [M_cap, N]`` (dgrad), ``w [E, N, K]``; the
    rows no expert owns (head and tail) hold NaN (``nan``): they must reach no output."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    E = len(sizes) if offsets is None else len(offsets) - 1
    if offsets is None:
        offsets = [lead + int(v) for v in [0, *torch.tensor(sizes, dtype=torch.int64).cumsum(0).tolist()]]
    M_cap = max(offsets) + tail
    C = N if dgrad else K
    a = torch.randn(M_cap, C, device="cuda", generator=g).to(dtype)
    w = (torch.randn(E, N, K, device="cuda", generator=g) * C**-0.5).to(dtype)
    if nan:
        a[: offsets[0]] = float("nan")
        a[max(offsets):] = float("nan")
    return a, w, torch.tensor(offsets, dtype=torch.int32, device="cuda")


def _reference(a, w, off, dgrad):
    import moe_torch
    from moe_torch.ops.grouped_gemm.reference import grouped_gemm_dgrad_reference

    if dgrad:
        return grouped_gemm_dgrad_reference(a, w, off, None, a.dtype)
    return moe_torch.grouped_gemm(a, w, off, out_dtype=a.dtype, implementation="reference")


def _run(a, w, off, dgrad, **kwargs):
    return (gb.grouped_gemm_gluon_dgrad if dgrad else gb.grouped_gemm_gluon_bf16)(a, w, off, **kwargs)


_E256_SIZES = [int(v) for v in torch.randint(0, 40, (256,), generator=torch.Generator().manual_seed(3))]
# (name, forward spec, dgrad spec): the dgrad's contraction N a multiple of 64, its output K with tails
_CASES = [
    ("T1", dict(sizes=[0, 1, 0, 0], N=256, K=256), dict(sizes=[0, 1, 0, 0], N=256, K=256)),
    ("empty-and-tail", dict(sizes=[100, 0, 300, 0, 57], N=160, K=512, lead=37, tail=50),
     dict(sizes=[100, 0, 300, 0, 57], N=192, K=160, lead=37, tail=50)),
    ("all-on-one-expert", dict(sizes=[0, 0, 1000, 0], N=384, K=384, tail=17),
     dict(sizes=[0, 0, 1000, 0], N=384, K=384, tail=17)),
    ("K-and-N-tails", dict(sizes=[64, 300, 5], N=200, K=200), dict(sizes=[64, 300, 5], N=64, K=200)),
    ("K8", dict(sizes=[130, 7], N=136, K=8), dict(sizes=[130, 7], N=128, K=8)),
    ("straddling-shares", dict(sizes=[64, 65, 127, 128, 129, 0, 1, 191, 192, 193], N=256, K=256, lead=5, tail=70),
     dict(sizes=[64, 65, 127, 128, 129, 0, 1, 191, 192, 193], N=256, K=264, lead=5, tail=70)),
    ("ends-at-M_cap", dict(sizes=[300, 0, 128, 100], N=384, K=256), dict(sizes=[300, 0, 128, 100], N=256, K=384)),
    ("more-tiles-than-SMs", dict(sizes=[512] * 32, N=1024, K=256), dict(sizes=[512] * 32, N=256, K=1024)),
    ("E256-ragged", dict(sizes=_E256_SIZES, N=256, K=256), dict(sizes=_E256_SIZES, N=256, K=136)),
]
_CONFIGS = [(128, None, "pointer"), (128, None, "tma"), (256, None, "tma"), (256, 2, "pointer")]


@needs_sm90
@pytest.mark.parametrize("block_n, stages, epilogue", _CONFIGS, ids=[f"bn{c[0]}-s{c[1]}-{c[2]}" for c in _CONFIGS])
@pytest.mark.parametrize("layout", ["fwd", "dgrad"])
@pytest.mark.parametrize("name, fwd, dgrad", _CASES, ids=[c[0] for c in _CASES])
def test_matches_reference(name, fwd, dgrad, layout, block_n, stages, epilogue):
    """Random bf16 problems against the reference, both layouts, both tile widths and epilogues: within the bf16
    tolerance, every owned row finite (the NaN head / tail rows reach nothing), unowned rows exactly 0."""
    from tolerances import BF16_REL_FRO, assert_rel_fro

    is_dgrad = layout == "dgrad"
    a, w, off = _problem(**(dgrad if is_dgrad else fwd), dgrad=is_dgrad)
    y = _run(a, w, off, is_dgrad, block_n=block_n, num_stages=stages, epilogue=epilogue)
    ref = _reference(a, w, off, is_dgrad)
    lo, hi = int(off[0]), int(off[-1])
    assert y.shape == ref.shape and y.dtype == a.dtype
    assert torch.isfinite(y.float()).all(), name
    assert_rel_fro(y[lo:hi].float(), ref[lo:hi].float(), BF16_REL_FRO, f"{name} {layout} bn{block_n} {epilogue}")
    assert not y[:lo].any() and not y[hi:].any()


@needs_sm90
@pytest.mark.parametrize("layout", ["fwd", "dgrad"])
@pytest.mark.parametrize("name", ["straddling-shares", "E256-ragged", "K-and-N-tails"])
def test_fp16_matches_reference(name, layout):
    from tolerances import BF16_REL_FRO, assert_rel_fro

    spec = {c[0]: c for c in _CASES}[name][2 if layout == "dgrad" else 1]
    a, w, off = _problem(**spec, dgrad=layout == "dgrad", dtype=torch.float16)
    y = _run(a, w, off, layout == "dgrad", block_n=256, epilogue="tma" if spec["N"] % 8 == 0 else "pointer")
    ref = _reference(a, w, off, layout == "dgrad")
    lo, hi = int(off[0]), int(off[-1])
    assert y.dtype == torch.float16 and torch.isfinite(y.float()).all()
    assert_rel_fro(y[lo:hi].float(), ref[lo:hi].float(), BF16_REL_FRO, f"fp16 {name} {layout}")
    assert not y[:lo].any() and not y[hi:].any()


@needs_sm90
@pytest.mark.parametrize("layout", ["fwd", "dgrad"])
def test_epilogues_bit_identical(layout):
    """The TMA epilogue writes exactly the values of the pointer one (same accumulators; only the path to memory
    differs), at both tile widths, on shares inside and straddling experts."""
    spec = {c[0]: c for c in _CASES}["straddling-shares"][2 if layout == "dgrad" else 1]
    a, w, off = _problem(**spec, dgrad=layout == "dgrad")
    for bn in (128, 256):
        y_ptr = _run(a, w, off, layout == "dgrad", block_n=bn, epilogue="pointer")
        y_tma = _run(a, w, off, layout == "dgrad", block_n=bn, epilogue="tma")
        assert torch.equal(y_ptr, y_tma), (layout, bn)


@needs_sm90
@pytest.mark.parametrize("layout", ["fwd", "dgrad"])
def test_decreasing_offsets_as_triton(layout, monkeypatch):
    """Offsets ``[0, 48, 0, 64, 60]`` (decreasing: a precondition violation, not checked) give the rows the Triton
    kernels assign (running max): [0, 48), [48, 48), [48, 64), [64, 64); rows >= 64 zero."""
    import moe_torch.ops.grouped_gemm.triton as gemm_triton
    import moe_torch.ops.grouped_gemm.triton_backward as gemm_bwd
    from tolerances import BF16_REL_FRO, assert_rel_fro

    monkeypatch.delenv("EPMOE_TRITON_GLUON_BF16", raising=False)
    monkeypatch.delenv("EPMOE_TRITON_GLUON_DGRAD", raising=False)
    is_dgrad = layout == "dgrad"
    a, w, off = _problem([], 256, 192, offsets=[0, 48, 0, 64, 60], tail=20, dgrad=is_dgrad, nan=False)
    for bn in (128, 256):
        y = _run(a, w, off, is_dgrad, block_n=bn)
        if is_dgrad:
            t = gemm_bwd.grouped_gemm_dgrad_triton(a, w, off, None, a.dtype)
        else:
            t = gemm_triton.grouped_gemm_triton(a, w, off, None, None, a.dtype)
        assert torch.equal(torch.isnan(y), torch.isnan(t))
        assert_rel_fro(y.float(), t.float(), BF16_REL_FRO, f"decreasing offsets {layout} bn{bn}")
        assert not y[64:].any()


@needs_sm90
def test_forward_dispatch_with_switch(monkeypatch):
    """``EPMOE_TRITON_GLUON_BF16=1``: ``grouped_gemm(..., implementation="triton")`` of a 16-bit problem of >= 4096
    rows runs the Gluon kernel with ``DISPATCH_OPTIONS`` (bit-identical to calling it; no tuned entry of this shape);
    unset (no tuned entry says gluon here), 0, a bias, float32 out, fewer rows or an explicit config run the Triton
    kernel. The tuned choice: ``test_tuned_forward_kernel.py``."""
    import moe_torch
    import moe_torch.ops.grouped_gemm.triton as gemm_triton
    from tolerances import BF16_REL_FRO, assert_rel_fro

    x, w, off = _problem([1100, 0, 2500, 700], 256, 512, nan=False)
    monkeypatch.delenv("EPMOE_TRITON_GLUON_BF16", raising=False)
    assert not gemm_triton.gluon_bf16_eligible(x, w, off, None, None, torch.bfloat16)
    y_triton = moe_torch.grouped_gemm(x, w, off, out_dtype=torch.bfloat16, implementation="triton")
    monkeypatch.setenv("EPMOE_TRITON_GLUON_BF16", "1")
    assert gemm_triton.gluon_bf16_eligible(x, w, off, None, None, torch.bfloat16)
    calls = []
    real = gb.grouped_gemm_gluon_bf16
    spied = gb.forward_eligible_launch  # the dispatch's entry to the kernel (its tensor checks already ran)
    monkeypatch.setattr(gb, "forward_eligible_launch", lambda *a, **k: calls.append(k) or spied(*a, **k))
    y = moe_torch.grouped_gemm(x, w, off, out_dtype=torch.bfloat16, implementation="triton")
    assert calls == [gb.DISPATCH_OPTIONS], calls
    assert torch.equal(y, real(x, w, off, **gb.DISPATCH_OPTIONS))
    assert_rel_fro(y.float(), y_triton.float(), BF16_REL_FRO, "dispatch vs Triton")
    bias = torch.zeros(4, 256, device="cuda")
    assert not gemm_triton.gluon_bf16_eligible(x, w, off, None, None, torch.bfloat16, bias=bias)
    assert not gemm_triton.gluon_bf16_eligible(x, w, off, None, None, torch.float32)
    assert not gemm_triton.gluon_bf16_eligible(x[:1000].contiguous(), w, off.clamp(max=1000), None, None,
                                               torch.bfloat16)
    assert not gemm_triton.gluon_bf16_eligible(x.t().contiguous().t(), w, off, None, None, torch.bfloat16)
    monkeypatch.setenv("EPMOE_TRITON_GLUON_BF16", "0")
    assert not gemm_triton.gluon_bf16_eligible(x, w, off, None, None, torch.bfloat16)


@needs_sm90
def test_dgrad_dispatch_with_switch(monkeypatch):
    """``EPMOE_TRITON_GLUON_DGRAD=1``: ``grouped_gemm_dgrad(..., implementation="triton")`` of a 16-bit problem runs
    the Gluon dgrad with ``DGRAD_DISPATCH_OPTIONS`` (bit-identical to calling it); unset, 0, FP8 weights, float32 out,
    ``N % 64 != 0`` or fewer rows run the Triton kernel."""
    import moe_torch
    import moe_torch.ops.grouped_gemm.triton_backward as gemm_bwd
    from tolerances import BF16_REL_FRO, assert_rel_fro

    d_y, w, off = _problem([1100, 0, 2500, 700], 256, 520, dgrad=True, nan=False)
    monkeypatch.delenv("EPMOE_TRITON_GLUON_DGRAD", raising=False)
    assert not gemm_bwd.gluon_dgrad_eligible(d_y, w, off, None, torch.bfloat16)
    d_x_triton = moe_torch.grouped_gemm_dgrad(d_y, w, off, out_dtype=torch.bfloat16, implementation="triton")
    monkeypatch.setenv("EPMOE_TRITON_GLUON_DGRAD", "1")
    assert gemm_bwd.gluon_dgrad_eligible(d_y, w, off, None, torch.bfloat16)
    calls = []
    real = gb.grouped_gemm_gluon_dgrad
    monkeypatch.setattr(gb, "grouped_gemm_gluon_dgrad", lambda *a, **k: calls.append(k) or real(*a, **k))
    d_x = moe_torch.grouped_gemm_dgrad(d_y, w, off, out_dtype=torch.bfloat16, implementation="triton")
    assert calls == [gb.DGRAD_DISPATCH_OPTIONS], calls
    assert torch.equal(d_x, real(d_y, w, off, **gb.DGRAD_DISPATCH_OPTIONS))
    assert_rel_fro(d_x.float(), d_x_triton.float(), BF16_REL_FRO, "dgrad dispatch vs Triton")
    assert not gemm_bwd.gluon_dgrad_eligible(d_y, w, off, None, torch.float32)
    assert not gemm_bwd.gluon_dgrad_eligible(d_y[:, :200].contiguous(), w[:, :200].contiguous(), off, None,
                                             torch.bfloat16)
    assert not gemm_bwd.gluon_dgrad_eligible(d_y[:1000].contiguous(), w, off.clamp(max=1000), None, torch.bfloat16)
    monkeypatch.setenv("EPMOE_TRITON_GLUON_DGRAD", "0")
    assert not gemm_bwd.gluon_dgrad_eligible(d_y, w, off, None, torch.bfloat16)


@needs_sm90
@pytest.mark.parametrize("layout", ["fwd", "dgrad"])
def test_refusals_on_gpu(layout):
    """On a usable device the placement checks come last: a base not 16-byte aligned (a view at an odd offset) and
    tensors on two devices are refused naming the op."""
    op, a_name, call = LAUNCHERS[layout]
    a, w, off = _problem([40, 30], 128, 64, dgrad=layout == "dgrad", nan=False)
    flat = torch.empty(a.numel() + 1, dtype=a.dtype, device="cuda")
    a_odd = flat[1:].view(a.shape)
    with pytest.raises(ValueError, match=f"{op}: {a_name} must be 16-byte aligned"):
        call(a_odd, w, off)
    with pytest.raises(ValueError, match=f"{op}: .* must be on one device"):
        call(a, w, off.cpu())
