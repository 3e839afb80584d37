"""The Gluon FP8-block grouped GEMM (``moe_torch/ops/grouped_gemm/gluon.py``): on a CPU, and on an sm_90 GPU.

* compile-only for sm_90a (in a child process without ``TRITON_INTERPRET``, which ``conftest.py`` sets on the
  CPU): the PTX has TMA copies (``cp.async.bulk.tensor``), FP8 ``wgmma``, mbarriers and ``setmaxnreg`` (the warp
  specialization is real); ``ptxas -arch=sm_90a -v`` gives no C7514 serialization warning and no spills (a few
  bytes in the producer at E = 256), and the
  SASS keeps a ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` (promotion of one K block while the next runs);
* the host-side refusals, on CPU tensors (they come before any launch), and the dispatch never picking it there;
* on an sm_90 GPU (``EPMOE_TEST_DEVICE=gpu``; skipped elsewhere): random problems against the reference (T=1, empty
  experts, all rows on one expert, unowned head and tail, N tail, one K block, E=256), decreasing offsets handled
  as the Triton kernel does, and the default dispatch of ``moe_torch.grouped_gemm``. Timings:
  BENCHMARKS.md.

The per-token x per-channel ("rowwise") kernel of the same module (``grouped_gemm_gluon_fp8_rowwise``; the default
dispatch, ``EPMOE_TRITON_GLUON_FP8_ROWWISE=0`` keeps the Triton kernel): compiled for sm_90a at
E = 32 / 256, block_n 128 / 256 and with promotion every 2 K blocks (spills: 0 at E = 32, a few bytes at E = 256), its
host refusals, ``gluon_fp8_rowwise_eligible`` off on the CPU (switch on or off), and on the GPU (T=1, empty experts,
all rows on one expert, unowned head and tail, N tail, K = 208 / 16 / 1040 not multiples of 128, E=256, with and
without promotion, a promotion group longer than K; decreasing offsets as the Triton kernel; the default dispatch; the
``promote`` refusals; the E=32 FP8 per-token layer through it within the contract's tolerance). Timings:
BENCHMARKS.md.
"""

from __future__ import annotations

import pytest
import torch

from common import TORCH_DEVICE
from sm90 import run_compile_child

gluon_mod = pytest.importorskip("moe_torch.ops.grouped_gemm.gluon", reason="triton.experimental.gluon unavailable")
OP = "grouped_gemm_gluon_fp8_block"
_CHILD = r"""
import json, os, subprocess, sys, tempfile
import triton
from moe_torch.ops.grouped_gemm import gluon as G
out = {}
jobs = [(f"{s}-stages-E{E}", lambda s=s, E=E: G.compile_sm90(num_stages=s, E=E)) for s, E in ((4, 32), (5, 256))]
jobs += [(f"rowwise-bn{bn}-{s}-stages-E{E}",
          lambda s=s, E=E, bn=bn: G.compile_sm90_rowwise(num_stages=s, E=E, block_n=bn))
         for bn, s in ((128, 4), (256, 4)) for E in (32, 256)]
jobs += [(f"rowwise-bn128p2-4-stages-E{E}", lambda E=E: G.compile_sm90_rowwise(num_stages=4, E=E, promote=2))
         for E in (32, 256)]
# the TMA epilogue (shared memory + cp.async.bulk.tensor stores) at the deepest rings it allows
jobs += [(f"tma-5-stages-E{E}", lambda E=E: G.compile_sm90(num_stages=5, E=E, epilogue="tma")) for E in (32, 256)]
jobs += [(f"tma-rowwise-bn128p2-5-stages-E{E}",
          lambda E=E: G.compile_sm90_rowwise(num_stages=5, E=E, promote=2, epilogue="tma")) for E in (32, 256)]
jobs += [("tma-rowwise-bn256-3-stages-E32", lambda: G.compile_sm90_rowwise(num_stages=3, E=32, block_n=256,
                                                                             epilogue="tma"))]
# the split-N tiles (block_m = 64: 64 x 256, both consumers on the same rows) at their deepest TMA ring
jobs += [(f"splitn-tma-4-stages-E{E}", lambda E=E: G.compile_sm90(num_stages=4, E=E, epilogue="tma", block_m=64))
         for E in (32, 256)]
for key, make in jobs:
    c = make()
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(c.asm["ptx"])
        open(os.path.join(d, "k.cubin"), "wb").write(c.asm["cubin"])
        info = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o",
                               os.path.join(d, "k.o")], capture_output=True, text=True)
        sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True).stdout
    out[key] = {"ptx": c.asm["ptx"], "ptxas": info.stdout + info.stderr,
                                    "ptxas_rc": info.returncode,
                   "sass_waits": sorted({l.split("DEPBAR")[1].split(";")[0].strip() for l in sass.splitlines()
                                         if "WARPGROUP.DEPBAR" in l}),
                   "shared": c.metadata.shared}
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def compiled():
    return run_compile_child(_CHILD)


def test_compiles_for_sm90a(compiled):
    for stages, c in compiled.items():
        if stages.startswith(("rowwise", "tma-rowwise")):
            continue
        ptx = c["ptx"]
        assert ".target sm_90a" in ptx, stages
        assert "cp.async.bulk.tensor" in ptx, stages  # TMA loads
        assert "wgmma.mma_async.sync.aligned" in ptx and ".e4m3.e4m3" in ptx, stages  # FP8 wgmma
        assert "wgmma.wait_group.sync.aligned 1" in ptx, stages  # one block awaited, the next in flight
        assert "mbarrier.try_wait" in ptx and "mbarrier.arrive" in ptx, stages
        assert "setmaxnreg" in ptx, stages  # warp specialization with register budgets
        assert c["ptxas_rc"] == 0, c["ptxas"]
        assert "C7514" not in c["ptxas"], c["ptxas"]  # wgmma not serialized
        # E = 256 (a 512-lane expert table): the 1-warp producer (40 registers) spills a few bytes (12 in triton 3.6.0;
        # 68 with the TMA epilogue)
        spill = int(c["ptxas"].split(" bytes spill stores")[0].rsplit(" ", 1)[-1])
        assert spill == 0 if stages.endswith("E32") else spill <= 96, c["ptxas"]
        assert "0x1" in " ".join(c["sass_waits"]), c["sass_waits"]
        assert c["shared"] <= 227 * 1024, c["shared"]


def test_rowwise_compiles_for_sm90a(compiled):
    """The rowwise kernel for sm_90a, both tiles without promotion and 128 x 128 with promotion every 2 K blocks:
    TMA, FP8 wgmma (n128 / n256), one wgmma left in flight (wait_group 1, SASS ``DEPBAR.LE gsb0, 0x1``), setmaxnreg;
    ptxas rc 0, no C7514 (the promoted chain is not serialized); no spill at E = 32, a few bytes at E = 256 (triton
    3.6.0: 16 bytes); shared memory <= 227 KiB."""
    keys = [k for k in compiled if k.startswith(("rowwise", "tma-rowwise"))]
    assert len(keys) == 9, list(compiled)
    spills = {}
    for key in keys:
        c = compiled[key]
        ptx = c["ptx"]
        bn = 256 if "bn256" in key else 128
        assert ".target sm_90a" in ptx, key
        assert "cp.async.bulk.tensor" in ptx, key
        assert f"wgmma.mma_async.sync.aligned.m64n{bn}k32.f32.e4m3.e4m3" in ptx, key
        assert "wgmma.wait_group.sync.aligned 1" in ptx, key
        assert "mbarrier.try_wait" in ptx and "mbarrier.arrive" in ptx, key
        assert "setmaxnreg" in ptx, key
        assert c["ptxas_rc"] == 0, c["ptxas"]
        assert "C7514" not in c["ptxas"], c["ptxas"]
        spill = int(c["ptxas"].split(" bytes spill stores")[0].rsplit(" ", 1)[-1])
        spills[key] = spill
        assert spill == 0 if key.endswith("E32") else spill <= 64, c["ptxas"]
        assert "0x1" in " ".join(c["sass_waits"]), c["sass_waits"]
        assert c["shared"] <= 227 * 1024, c["shared"]
    print("rowwise spills (bytes):", spills)


def test_tma_epilogue_compiles_for_sm90a(compiled):
    """The TMA epilogue (``epilogue="tma"``): TMA stores from shared memory (``cp.async.bulk.tensor.2d.global.shared``)
    with their bulk groups committed and awaited, ``fence.proxy.async`` between the threads' shared-memory writes and
    the store; the pointer epilogue has no TMA store. Both kernels, their deepest rings with it, within 227 KiB."""
    tma_keys = [k for k in compiled if k.startswith("tma")]
    assert len(tma_keys) == 5, list(compiled)
    for key in tma_keys:
        ptx = compiled[key]["ptx"]
        assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx, key
        assert "cp.async.bulk.commit_group" in ptx and "cp.async.bulk.wait_group" in ptx, key
        assert "fence.proxy.async.shared::cta" in ptx, key
        assert compiled[key]["shared"] <= 227 * 1024, (key, compiled[key]["shared"])
    for key in ("4-stages-E32", "rowwise-bn128p2-4-stages-E32"):
        assert "cp.async.bulk.tensor.2d.global.shared" not in compiled[key]["ptx"], key


def test_split_n_compiles_for_sm90a(compiled):
    """``block_m = 64`` (split-N tiles): the checks of :func:`test_compiles_for_sm90a` ran on it (its keys are in that
    loop); here, its shape: three TMA loads a stage (one ``x`` box, two ``w`` boxes: 40 KiB expected on the stage's
    mbarrier, 32 KiB at block_m 128), the n128 FP8 ``wgmma`` of each
    consumer, TMA stores, no spill at E = 32 or 256, within 227 KiB at 4 stages."""
    keys = [k for k in compiled if k.startswith("splitn")]
    assert len(keys) == 2, list(compiled)
    for key in keys:
        c = compiled[key]
        assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in c["ptx"], key
        assert c["ptx"].count("cp.async.bulk.tensor.2d.shared::cluster.global") == 3, key
        assert "expect_tx.shared.b64 _, [" in c["ptx"] and "], 40960;" in c["ptx"], key  # 8 + 2 x 16 KiB a stage
        assert "cp.async.bulk.tensor.2d.global.shared::cta" in c["ptx"], key
        assert " 0 bytes spill stores" in c["ptxas"], c["ptxas"]
        assert c["shared"] <= 227 * 1024, c["shared"]


def test_resolve_epilogue():
    """The epilogue argument: None takes the default where ``N % 8 == 0`` and the pointer stores otherwise; ``"tma"``
    with ``N % 8 != 0`` (rows of ``y`` not at 16-byte strides) and an unknown name raise ``ValueError`` naming the op."""
    assert gluon_mod.resolve_epilogue(OP, None, 4096) == gluon_mod.DEFAULT_EPILOGUE
    assert gluon_mod.resolve_epilogue(OP, None, 4100) == "pointer"
    assert gluon_mod.resolve_epilogue(OP, "pointer", 4100) == "pointer"
    assert gluon_mod.resolve_epilogue(OP, "tma", 4096) == "tma"
    with pytest.raises(ValueError, match=f"{OP}: epilogue must be 'pointer' for N % 8 != 0.*got 'tma' with N = 4100"):
        gluon_mod.resolve_epilogue(OP, "tma", 4100)
    with pytest.raises(ValueError, match=f"{OP}: epilogue must be 'tma' or 'pointer', got 'smem'"):
        gluon_mod.resolve_epilogue(OP, "smem", 4096)


def _inputs(M=4, E=2, N=160, K=256, device="cpu"):
    x = torch.zeros(M, K, dtype=torch.float8_e4m3fn, device=device)
    w = torch.zeros(E, N, K, dtype=torch.float8_e4m3fn, device=device)
    off = torch.tensor([0] + [M] * E, dtype=torch.int32, device=device)
    xs = torch.ones(M, K // 128, device=device)
    ws = torch.ones(E, (N + 127) // 128, K // 128, device=device)
    return x, w, off, xs, ws


def _call(*args, **kwargs):
    return gluon_mod.grouped_gemm_gluon_fp8_block(*args, **kwargs)


def test_refuses_k_not_multiple_of_128():
    x, w, off, _, _ = _inputs(K=200)
    xs, ws = torch.ones(4, 1), torch.ones(2, 2, 1)
    with pytest.raises(ValueError, match=f"{OP}: x_q must be of K = shape\\[1\\] a positive multiple of 128.*K = 200"):
        _call(x, w, off, xs, ws)


def test_refuses_bad_num_stages_after_device_check_order():
    # the device check comes first on a CPU: num_stages is checked only for a usable device
    with pytest.raises(NotImplementedError):
        _call(*_inputs(), num_stages=9)


# ------------------------------------------------------------------------------- rowwise: host refusals on a CPU
OP_RW = "grouped_gemm_gluon_fp8_rowwise"


def _inputs_rw(M=4, E=2, N=160, K=208, device="cpu"):
    x = torch.zeros(M, K, dtype=torch.float8_e4m3fn, device=device)
    w = torch.zeros(E, N, K, dtype=torch.float8_e4m3fn, device=device)
    off = torch.tensor([0] + [M] * E, dtype=torch.int32, device=device)
    return x, w, off, torch.ones(M, 1, device=device), torch.ones(E, N, device=device)


def _call_rw(*args, **kwargs):
    return gluon_mod.grouped_gemm_gluon_fp8_rowwise(*args, **kwargs)


@pytest.mark.parametrize("K", [200, 8, 0])
def test_rowwise_refuses_k_not_multiple_of_16(K):
    x, w, off, xs, ws = _inputs_rw(K=K)
    pattern = f"{OP_RW}: x_q must be of K = shape\\[1\\] a positive multiple of 16.*K = {K}"
    with pytest.raises(ValueError, match=pattern):
        _call_rw(x, w, off, xs, ws)


# ------------------------------------------------------------------ refusals both launchers share (CPU tensors)
#: kernel name -> (op named in the messages, inputs on the CPU, launcher)
LAUNCHERS = {"block": (OP, _inputs, _call), "rowwise": (OP_RW, _inputs_rw, _call_rw)}


@pytest.mark.parametrize("kernel, which, shape, pattern", [
    ("block", "w_q", (2, 160, 128), "w_q must be \\[E, N, K\\] with K"),
    ("block", "expert_offsets", (4,), "expert_offsets must be of shape \\[E \\+ 1\\]"),
    ("block", "x_scale", (4, 1), "x_scale must be of shape \\[M_cap, K // 128\\]"),
    ("block", "w_scale", (2, 1, 2), "w_scale must be of shape \\[E, ceil\\(N / 128\\), K // 128\\]"),
    ("rowwise", "w_q", (2, 160, 192), "w_q must be \\[E, N, K\\] with K"),
    ("rowwise", "expert_offsets", (4,), "expert_offsets must be of shape \\[E \\+ 1\\]"),
    ("rowwise", "x_scale", (4, 2), "x_scale must be of shape \\[M_cap, 1\\]"),
    ("rowwise", "x_scale", (4,), "x_scale must be 2-D"),
    ("rowwise", "w_scale", (2, 2, 1), "w_scale must be 2-D"),
    ("rowwise", "w_scale", (2, 159), "w_scale must be of shape \\[E, N\\]")])
def test_refuses_shapes(kernel, which, shape, pattern):
    op, inputs, call = LAUNCHERS[kernel]
    x, w, off, xs, ws = inputs()
    args = dict(x_q=x, w_q=w, expert_offsets=off, x_scale=xs, w_scale=ws)
    args[which] = torch.zeros(shape, dtype=args[which].dtype)
    with pytest.raises(ValueError, match=f"{op}: {pattern}"):
        call(**args)


@pytest.mark.parametrize("kernel, which, shape", [("block", "x_scale", (2, 4)), ("rowwise", "w_scale", (160, 2))])
def test_refuses_non_contiguous(kernel, which, shape):
    op, inputs, call = LAUNCHERS[kernel]
    x, w, off, xs, ws = inputs()
    args = dict(x_q=x, w_q=w, expert_offsets=off, x_scale=xs, w_scale=ws)
    args[which] = torch.ones(shape).t()  # the transpose of a contiguous tensor: the right shape, wrong strides
    with pytest.raises(ValueError, match=f"{op}: {which} must be contiguous"):
        call(**args)


@pytest.mark.parametrize("kernel", sorted(LAUNCHERS))
@pytest.mark.parametrize("which, dtype", [
    ("x_q", torch.bfloat16), ("w_q", torch.float8_e5m2), ("x_scale", torch.bfloat16), ("w_scale", torch.float16),
    ("expert_offsets", torch.int64)])
def test_refuses_dtypes(kernel, which, dtype):
    op, inputs, call = LAUNCHERS[kernel]
    x, w, off, xs, ws = inputs()
    args = dict(x_q=x, w_q=w, expert_offsets=off, x_scale=xs, w_scale=ws)
    args[which] = args[which].to(dtype)
    with pytest.raises(TypeError, match=f"{op}: {which} must be of dtype"):
        call(**args)


@pytest.mark.parametrize("kernel", sorted(LAUNCHERS))
def test_refuses_out_dtype(kernel):
    op, inputs, call = LAUNCHERS[kernel]
    with pytest.raises(TypeError, match=f"{op}: out_dtype must be torch.bfloat16"):
        call(*inputs(), out_dtype=torch.float16)


@pytest.mark.parametrize("kernel", sorted(LAUNCHERS))
def test_refuses_non_cuda_device(kernel):
    op, inputs, call = LAUNCHERS[kernel]
    with pytest.raises(NotImplementedError, match=f"{op}: x_q .*CUDA device of compute capability \\(9, 0\\).*cpu"):
        call(*inputs())


def test_rowwise_not_eligible_on_cpu_or_switched_off(monkeypatch):
    """Never picked on a CPU (switch on, its default, or off)."""
    import moe_torch.ops.grouped_gemm.triton as gemm_triton
    from moe_torch.ops import triton_common

    x, w, off, xs, ws = _inputs_rw(M=4096)
    monkeypatch.delenv(triton_common.GLUON_FP8_ROWWISE_ENV, raising=False)
    assert triton_common.gluon_fp8_rowwise_enabled()
    assert not gemm_triton.gluon_fp8_rowwise_eligible(x, w, off, xs, ws, torch.bfloat16)
    monkeypatch.setenv(triton_common.GLUON_FP8_ROWWISE_ENV, "0")
    assert not gemm_triton.gluon_fp8_rowwise_eligible(x, w, off, xs, ws, torch.bfloat16)


# ---------------------------------------------------------------------------------------------- on an sm_90 GPU
# (EPMOE_TEST_DEVICE=gpu on an H100 / H200; skipped elsewhere, with the reason)

def _sm90() -> bool:
    return TORCH_DEVICE == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the Gluon kernel runs on a CUDA device of compute capability "
                                "(9, 0) only (EPMOE_TEST_DEVICE=gpu on an H100 / H200)")


def _problem(sizes, N, K, *, lead=0, tail=0, offsets=None, seed=0):
    import moe_torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    E = len(sizes) if offsets is None else len(offsets) - 1
    M_cap = lead + int(sum(sizes)) + tail if offsets is None else max(offsets) + tail
    x = torch.randn(M_cap, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(E, N, K, device="cuda", generator=g) * K**-0.5).to(torch.bfloat16)
    xq, xs = moe_torch.per_token_group_quant_fp8(x, 128)
    wq, ws = moe_torch.quantize_weight_fp8(w, "block")
    if offsets is None:
        offsets = [lead + int(v) for v in [0, *torch.tensor(sizes).cumsum(0).tolist()]]
    return xq, wq, torch.tensor(offsets, dtype=torch.int32, device="cuda"), xs, ws


@needs_sm90
@pytest.mark.parametrize("name, spec", [
    ("M1-one-expert", dict(sizes=[0, 1, 0, 0], N=256, K=256)),
    ("empty-and-tail", dict(sizes=[100, 0, 300, 0, 57], N=160, K=512, lead=37, tail=50)),
    ("all-on-one-expert", dict(sizes=[0, 0, 1000, 0], N=384, K=384)),
    ("K128-odd-blocks", dict(sizes=[64, 300], N=256, K=128)),
    ("E256-ragged", dict(sizes=[int(v) for v in torch.randint(0, 40, (256,), generator=torch.Generator().manual_seed(3))],
                         N=256, K=256)),
])
def test_gluon_matches_reference(name, spec):
    """Random FP8-block problems (T=1, empty experts, all rows on one expert, unowned head and tail rows, an N tail,
    one K block, E=256 ragged): within the FP8 tolerance of the reference, unowned rows exactly 0."""
    import moe_torch
    from tolerances import FP8_REL_FRO, assert_rel_fro

    xq, wq, off, xs, ws = _problem(**spec)
    y = gluon_mod.grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, num_stages=5)
    ref = moe_torch.grouped_gemm(xq, wq, off, x_scale=xs, w_scale=ws, out_dtype=torch.bfloat16,
                                 implementation="reference")
    lo, hi = int(off[0]), int(off[-1])
    assert_rel_fro(y[lo:hi].float(), ref[lo:hi].float(), FP8_REL_FRO, name)
    assert not y[:lo].any() and not y[hi:].any()


@needs_sm90
def test_gluon_decreasing_offsets_as_triton():
    """Offsets that decrease (a precondition violation, not checked: no host sync) are made non-decreasing by a
    running max, as the Triton kernel does: ``[0, 48, 0, 64, 60]`` gives experts rows [0, 48), [48, 48), [48, 64),
    [64, 64) in both kernels, every row written once (no race), rows >= 64 zero."""
    import moe_torch.ops.grouped_gemm.triton as gemm_triton

    xq, wq, off, xs, ws = _problem([], 256, 256, offsets=[0, 48, 0, 64, 60], tail=20)
    y = gluon_mod.grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, num_stages=5)
    t = gemm_triton.grouped_gemm_triton(xq, wq, off, xs, ws, torch.bfloat16)
    assert torch.equal(torch.isnan(y), torch.isnan(t))
    from tolerances import FP8_REL_FRO, assert_rel_fro

    assert_rel_fro(y.float(), t.float(), FP8_REL_FRO, "decreasing offsets")
    assert not y[64:].any()


@needs_sm90
def test_default_dispatch_runs_gluon(monkeypatch):
    """``moe_torch.grouped_gemm(..., implementation="triton")`` of an FP8-block problem of >= GLUON_MIN_ROWS rows
    runs the Gluon kernel (bit-identical to calling it); ``EPMOE_TRITON_GLUON_FP8_BLOCK=0``, a bias, fewer rows or
    an explicit config run the Triton kernel."""
    import moe_torch
    import moe_torch.ops.grouped_gemm.triton as gemm_triton

    xq, wq, off, xs, ws = _problem([1100, 0, 2500, 700], 256, 512)
    assert gemm_triton.gluon_fp8_block_eligible(xq, wq, off, xs, ws, torch.bfloat16)
    y = moe_torch.grouped_gemm(xq, wq, off, x_scale=xs, w_scale=ws, out_dtype=torch.bfloat16, implementation="triton")
    assert gemm_triton.gluon_fp8_block_options(xq.shape[0], 4) == {"block_m": 128, "num_stages": gemm_triton.GLUON_STAGES}
    assert torch.equal(y, gluon_mod.grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, num_stages=gemm_triton.GLUON_STAGES))
    # ~130 rows an expert (<= GLUON_SPLIT_N_MAX_ROWS_PER_EXPERT): the split-N items, bit-identical to calling them
    xq2, wq2, off2, xs2, ws2 = _problem([130 + (i % 7) for i in range(32)], 256, 256)
    assert gemm_triton.gluon_fp8_block_options(xq2.shape[0], 32)["block_m"] == 64
    y2 = moe_torch.grouped_gemm(xq2, wq2, off2, x_scale=xs2, w_scale=ws2, out_dtype=torch.bfloat16,
                                implementation="triton")
    assert torch.equal(y2, gluon_mod.grouped_gemm_gluon_fp8_block(xq2, wq2, off2, xs2, ws2, block_m=64,
                                                                  num_stages=gemm_triton.GLUON_SPLIT_N_STAGES))
    bias = torch.zeros(4, 256, device="cuda")
    assert not gemm_triton.gluon_fp8_block_eligible(xq, wq, off, xs, ws, torch.bfloat16, bias=bias)
    assert not gemm_triton.gluon_fp8_block_eligible(xq[:100].contiguous(), wq, off.clamp(max=100), xs[:100].contiguous(),
                                                    ws, torch.bfloat16)
    monkeypatch.setenv("EPMOE_TRITON_GLUON_FP8_BLOCK", "0")
    assert not gemm_triton.gluon_fp8_block_eligible(xq, wq, off, xs, ws, torch.bfloat16)


def test_fp8_block_options_by_rows_per_expert():
    """The dispatch's tile choice from host ints: split-N 64-row items (4 stages) up to
    ``GLUON_SPLIT_N_MAX_ROWS_PER_EXPERT`` rows an expert on average, 128-row items (``GLUON_STAGES``) above; the
    stage counts are within the launcher's limits for the TMA epilogue."""
    import moe_torch.ops.grouped_gemm.triton as gemm_triton

    cap = gemm_triton.GLUON_SPLIT_N_MAX_ROWS_PER_EXPERT
    assert gemm_triton.gluon_fp8_block_options(32768, 256) == {"block_m": 64, "num_stages": gemm_triton.GLUON_SPLIT_N_STAGES}
    assert gemm_triton.gluon_fp8_block_options(cap * 32, 32)["block_m"] == 64
    assert gemm_triton.gluon_fp8_block_options(cap * 32 + 1, 32) == {"block_m": 128, "num_stages": gemm_triton.GLUON_STAGES}
    assert gemm_triton.gluon_fp8_block_options(16384, 32)["block_m"] == 128
    assert gemm_triton.GLUON_SPLIT_N_STAGES <= gluon_mod._BLOCK_MAX_STAGES[64]["tma"]
    assert gemm_triton.GLUON_STAGES <= gluon_mod._BLOCK_MAX_STAGES[128]["tma"]


def test_not_eligible_off_sm90():
    """On a CPU (or any tensor off an sm_90 CUDA device) the dispatch never picks the Gluon kernel."""
    import moe_torch.ops.grouped_gemm.triton as gemm_triton

    x, w, off, xs, ws = _inputs(M=4096)
    assert not gemm_triton.gluon_fp8_block_eligible(x, w, off, xs, ws, torch.bfloat16)


# ------------------------------------------------------------------------------------- rowwise on an sm_90 GPU

def _problem_rw(sizes, N, K, *, lead=0, tail=0, offsets=None, seed=0):
    import moe_torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    E = len(sizes) if offsets is None else len(offsets) - 1
    M_cap = lead + int(sum(sizes)) + tail if offsets is None else max(offsets) + tail
    x = torch.randn(M_cap, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(E, N, K, device="cuda", generator=g) * K**-0.5).to(torch.bfloat16)
    xq, xs = moe_torch.per_token_quant_fp8(x)
    wq, ws = moe_torch.quantize_weight_fp8(w, "per_channel")
    if offsets is None:
        offsets = [lead + int(v) for v in [0, *torch.tensor(sizes).cumsum(0).tolist()]]
    return (xq.contiguous(), wq.contiguous(), torch.tensor(offsets, dtype=torch.int32, device="cuda"),
            xs.contiguous(), ws.contiguous())


_E256_SIZES = [int(v) for v in torch.randint(0, 40, (256,), generator=torch.Generator().manual_seed(3))]
_RW_CASES = [
    ("M1-one-expert", dict(sizes=[0, 1, 0, 0], N=256, K=256)),
    ("empty-and-tail", dict(sizes=[100, 0, 300, 0, 57], N=160, K=512, lead=37, tail=50)),
    ("all-on-one-expert", dict(sizes=[0, 0, 1000, 0], N=384, K=384)),
    ("K208-tail", dict(sizes=[64, 300, 5], N=200, K=208)),
    ("K16-one-box", dict(sizes=[130, 7], N=136, K=16)),
    ("K1040-tail", dict(sizes=[257, 0, 129], N=512, K=1040, tail=3)),
    ("E256-ragged", dict(sizes=_E256_SIZES, N=256, K=256)),
]


@needs_sm90
@pytest.mark.parametrize("epilogue", ["pointer", "tma"])
@pytest.mark.parametrize("block_n, stages, promote", [(128, 4, 0), (256, 4, 0), (128, 6, 0), (256, 2, 0), (128, 4, 2),
                                                      (128, 5, 4), (128, 3, 1), (128, 4, 3), (128, 2, 16)])
@pytest.mark.parametrize("name, spec", _RW_CASES, ids=[c[0] for c in _RW_CASES])
def test_rowwise_matches_reference(name, spec, block_n, stages, promote, epilogue):
    """Random per-token x per-channel FP8 problems against the reference, both tile widths, with and without
    promotion (``promote`` 3 or 4 on K of 1 or 2 blocks: whole groups of zero-filled boxes past K), both epilogues
    (the TMA one's ring at most its deepest; N = 200 / 136 / 160 not multiples of 128: the N tail clipped by the
    descriptor): within the FP8 tolerance, unowned rows exactly 0, everything finite."""
    import moe_torch
    from tolerances import FP8_REL_FRO, assert_rel_fro

    xq, wq, off, xs, ws = _problem_rw(**spec)
    if epilogue == "tma":
        stages = min(stages, gluon_mod._ROWWISE_MAX_STAGES_TMA[block_n])
    y = gluon_mod.grouped_gemm_gluon_fp8_rowwise(xq, wq, off, xs, ws, num_stages=stages, block_n=block_n,
                                                 promote=promote, epilogue=epilogue)
    ref = moe_torch.grouped_gemm(xq, wq, off, x_scale=xs, w_scale=ws, out_dtype=torch.bfloat16,
                                 implementation="reference")
    lo, hi = int(off[0]), int(off[-1])
    assert torch.isfinite(y.float()).all()
    assert_rel_fro(y[lo:hi].float(), ref[lo:hi].float(), FP8_REL_FRO,
                   f"{name} bn{block_n} s{stages} p{promote} {epilogue}")
    assert not y[:lo].any() and not y[hi:].any()


@needs_sm90
@pytest.mark.parametrize("block_n, promote", [(128, 0), (256, 0), (128, 2)])
def test_rowwise_decreasing_offsets_as_triton(block_n, promote, monkeypatch):
    """Decreasing offsets ``[0, 48, 0, 64, 60]``: the rows the Triton kernel assigns (running max), rows >= 64 zero."""
    import moe_torch.ops.grouped_gemm.triton as gemm_triton
    from tolerances import FP8_REL_FRO, assert_rel_fro

    monkeypatch.setenv("EPMOE_TRITON_GLUON_FP8_ROWWISE", "0")  # the Triton kernel (84 rows: never Gluon anyway)
    xq, wq, off, xs, ws = _problem_rw([], 256, 208, offsets=[0, 48, 0, 64, 60], tail=20)
    y = gluon_mod.grouped_gemm_gluon_fp8_rowwise(xq, wq, off, xs, ws, block_n=block_n, promote=promote)
    t = gemm_triton.grouped_gemm_triton(xq, wq, off, xs, ws, torch.bfloat16)
    assert torch.equal(torch.isnan(y), torch.isnan(t))
    assert_rel_fro(y.float(), t.float(), FP8_REL_FRO, "decreasing offsets")
    assert not y[64:].any()


@needs_sm90
def test_rowwise_default_dispatch(monkeypatch):
    """By default (``EPMOE_TRITON_GLUON_FP8_ROWWISE`` unset): ``grouped_gemm(..., implementation="triton")`` of a
    per-token x per-channel problem of >= GLUON_MIN_ROWS rows runs the rowwise kernel with the dispatch's settings
    (bit-identical to calling it with them); ``=0``, a bias or fewer rows run the Triton kernel."""
    import moe_torch
    import moe_torch.ops.grouped_gemm.triton as gemm_triton

    xq, wq, off, xs, ws = _problem_rw([1100, 0, 2500, 700], 256, 512)
    monkeypatch.setenv("EPMOE_TRITON_GLUON_FP8_ROWWISE", "0")
    assert not gemm_triton.gluon_fp8_rowwise_eligible(xq, wq, off, xs, ws, torch.bfloat16)
    monkeypatch.delenv("EPMOE_TRITON_GLUON_FP8_ROWWISE", raising=False)
    assert gemm_triton.gluon_fp8_rowwise_eligible(xq, wq, off, xs, ws, torch.bfloat16)
    assert not gemm_triton.gluon_fp8_block_eligible(xq, wq, off, xs, ws, torch.bfloat16)
    y = moe_torch.grouped_gemm(xq, wq, off, x_scale=xs, w_scale=ws, out_dtype=torch.bfloat16, implementation="triton")
    assert torch.equal(y, gluon_mod.grouped_gemm_gluon_fp8_rowwise(
        xq, wq, off, xs, ws, num_stages=gemm_triton.GLUON_ROWWISE_STAGES, block_n=gemm_triton.GLUON_ROWWISE_BLOCK_N,
        promote=gemm_triton.GLUON_ROWWISE_PROMOTE))
    bias = torch.zeros(4, 256, device="cuda")
    assert not gemm_triton.gluon_fp8_rowwise_eligible(xq, wq, off, xs, ws, torch.bfloat16, bias=bias)
    assert not gemm_triton.gluon_fp8_rowwise_eligible(xq[:100].contiguous(), wq, off.clamp(max=100),
                                                      xs[:100].contiguous(), ws, torch.bfloat16)


@needs_sm90
@pytest.mark.parametrize("promote, block_n, pattern", [
    (-1, 128, "promote must be an int in \\[0, 16\\]"), (17, 128, "promote must be an int in \\[0, 16\\]"),
    (2.0, 128, "promote must be an int"), (True, 128, "promote must be an int.*bool"),
    (2, 256, "block_n must be 128 with promote = 2 > 0")])
def test_rowwise_refuses_promote(promote, block_n, pattern):
    """``promote`` outside [0, 16], not an int (a bool included), or > 0 with 128 x 256 tiles (256 accumulator
    registers) is refused before any launch (on a usable device: the device check comes first)."""
    with pytest.raises(ValueError, match=f"{OP_RW}: {pattern}"):
        _call_rw(*_problem_rw([64, 30], 128, 128), block_n=block_n, promote=promote)


@needs_sm90
def test_rowwise_fp8_per_token_layer_within_contract(monkeypatch):
    """The E=32 top-8 FP8 per-token torch layer at the benchmark's H=7168, I=2048 (T=512: 4096 routed rows, both GEMMs
    on the rowwise kernel by default) against the reference layer on the same quantized weights: within 1e-2 (the
    bench's WRONG line), and clearly closer than the same kernel without promotion (H200, T=4096: 7.1e-3 vs 1.96e-2,
    BENCHMARKS.md), so the promotion is what keeps it there."""
    import moe_torch
    import moe_torch.ops.grouped_gemm.triton as gemm_triton
    from moe_contract import get_preset
    from tolerances import BF16_REL_FRO, assert_rel_fro, rel_fro

    calls = []
    real = gluon_mod.grouped_gemm_gluon_fp8_rowwise
    monkeypatch.setattr(gluon_mod, "grouped_gemm_gluon_fp8_rowwise", lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.delenv("EPMOE_TRITON_GLUON_FP8_ROWWISE", raising=False)
    config = get_preset("qwen3-30b-a3b").config(hidden_size=7168, intermediate_size=2048, num_experts=32, topk=8,
                                               quant="fp8_per_token")
    g = torch.Generator(device="cuda").manual_seed(5)
    H, I, E = 7168, 2048, 32
    x = torch.randn(512, H, device="cuda", generator=g).to(torch.bfloat16)
    logits = torch.randn(512, E, device="cuda", generator=g)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * I**-0.5).to(torch.bfloat16)
    w13, s13, w2, s2 = moe_torch.quantize_layer_weights(w13, w2, config)

    def layer(impl):
        return moe_torch.moe_forward(x, logits, w13, w2, config, w13_scale=s13, w2_scale=s2,
                                     implementation=impl).float()

    ref = layer("reference")
    out = layer("triton")
    assert len(calls) == 2 and all(c.get("promote", 0) > 0 for c in calls), calls
    assert torch.isfinite(out).all()
    assert_rel_fro(out, ref, BF16_REL_FRO, "FP8 per-token layer, rowwise Gluon GEMMs")
    monkeypatch.setattr(gemm_triton, "GLUON_ROWWISE_PROMOTE", 0)
    unpromoted = layer("triton")
    assert all(c.get("promote") == 0 for c in calls[2:]) and len(calls) == 4, calls
    assert rel_fro(out, ref) < 0.8 * rel_fro(unpromoted, ref), (rel_fro(out, ref), rel_fro(unpromoted, ref))


@needs_sm90
@pytest.mark.parametrize("E, per_expert, eligible", [(256, 16, False), (256, 31, False), (256, 32, True),
                                                     (32, 128, True)])
def test_gluon_needs_rows_per_expert(E, per_expert, eligible, monkeypatch):
    """Both Gluon kernels serve only problems of >= GLUON_MIN_ROWS_PER_EXPERT (32) rows per local expert on average,
    besides >= GLUON_MIN_ROWS rows: DeepSeek-V3's torch layer at T=512 (257 experts, 18 rows each) ran 8-14% slower on
    them (BENCHMARKS.md), so such requests stay on the Triton kernels."""
    import moe_torch.ops.grouped_gemm.triton as gemm_triton

    monkeypatch.delenv("EPMOE_TRITON_GLUON_FP8_BLOCK", raising=False)
    monkeypatch.delenv("EPMOE_TRITON_GLUON_FP8_ROWWISE", raising=False)
    sizes = [per_expert] * E
    assert gemm_triton.gluon_fp8_block_eligible(*_problem(sizes, 128, 256), torch.bfloat16) is eligible
    assert gemm_triton.gluon_fp8_rowwise_eligible(*_problem_rw(sizes, 128, 256), torch.bfloat16) is eligible


# ------------------------------------------------------------------- the TMA epilogue on an sm_90 GPU

# shares of 64 rows wholly inside an expert (TMA), straddling its last row (pointer stores), an expert ending exactly
# at M_cap (t_e = M_cap: the descriptor clips), unowned head / tail rows, empty experts, N tails (N % 128 != 0), more
# tiles than programs (the persistent loop reuses each consumer's buffer: store_wait before the next write)
_TMA_CASES = [
    ("straddling-halves", dict(sizes=[64, 65, 127, 128, 129, 0, 1, 191, 192, 193], N=256, K=256, lead=5, tail=70)),
    ("ends-at-M_cap", dict(sizes=[300, 0, 128, 100], N=384, K=256)),
    ("N-tail", dict(sizes=[200, 64, 0, 333], N=136, K=384, lead=64, tail=1)),
    ("many-tiles", dict(sizes=[512] * 32, N=1024, K=256)),
    ("all-on-one-expert", dict(sizes=[0, 0, 2000, 0], N=512, K=512, tail=17)),
    ("M1", dict(sizes=[0, 1], N=128, K=128)),
    ("E256-ragged", dict(sizes=_E256_SIZES, N=256, K=256)),
]


@needs_sm90
@pytest.mark.parametrize("kernel", ["block", "rowwise-p2", "rowwise-bn256"])
@pytest.mark.parametrize("name, spec", _TMA_CASES, ids=[c[0] for c in _TMA_CASES])
def test_tma_epilogue_bit_identical_to_pointer(name, spec, kernel):
    """``epilogue="tma"`` writes exactly the bf16 values of ``epilogue="pointer"`` (the same accumulators, the same
    rounding; only the way to global memory differs) on every row, the unowned rows zero in both; the block kernel
    and the rowwise one (promoted, 128 wide; unpromoted, 256 wide), at the TMA epilogue's deepest rings."""
    if kernel == "block":
        if spec["K"] % 128:
            pytest.skip("the FP8-block kernel takes K % 128 == 0")
        xq, wq, off, xs, ws = _problem(**spec)
        run = lambda ep, st: gluon_mod.grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, num_stages=st, epilogue=ep)
        y_ptr, y_tma = run("pointer", 5), run("tma", 5)
    else:
        xq, wq, off, xs, ws = _problem_rw(**spec)
        bn, promote, st = (128, 2, 5) if kernel == "rowwise-p2" else (256, 0, 3)
        run = lambda ep: gluon_mod.grouped_gemm_gluon_fp8_rowwise(xq, wq, off, xs, ws, num_stages=st, block_n=bn,
                                                                  promote=promote, epilogue=ep)
        y_ptr, y_tma = run("pointer"), run("tma")
    assert torch.isfinite(y_tma.float()).all(), name
    assert torch.equal(y_tma, y_ptr), (name, (y_tma.float() - y_ptr.float()).abs().max().item())
    lo, hi = int(off[0]), int(off[-1])
    assert not y_tma[:lo].any() and not y_tma[hi:].any()
    assert y_tma[lo:hi].abs().sum() > 0


@needs_sm90
def test_tma_epilogue_refusals():
    """``ValueError`` before any launch: a ring deeper than the TMA epilogue leaves room for (block kernel 6 stages,
    rowwise 256 wide 4 stages), ``"tma"`` with ``N % 8 != 0``, an unknown epilogue."""
    xq, wq, off, xs, ws = _problem([40, 30], 256, 256)
    with pytest.raises(ValueError, match=f"{OP}: num_stages must be an int in \\[2, 5\\].*'tma'"):
        gluon_mod.grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, num_stages=6, epilogue="tma")
    with pytest.raises(ValueError, match=f"{OP}: epilogue must be 'tma' or 'pointer'"):
        gluon_mod.grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, epilogue="TMA")
    xq, wq, off, xs, ws = _problem_rw([40, 30], 20, 256)
    with pytest.raises(ValueError, match=f"{OP_RW}: epilogue must be 'pointer' for N % 8 != 0"):
        gluon_mod.grouped_gemm_gluon_fp8_rowwise(xq, wq, off, xs, ws, epilogue="tma")
    y = gluon_mod.grouped_gemm_gluon_fp8_rowwise(xq, wq, off, xs, ws)  # the default takes the pointer stores there
    assert y.shape == (70, 20)
    xq, wq, off, xs, ws = _problem_rw([40, 30], 256, 256)
    with pytest.raises(ValueError, match=f"{OP_RW}: num_stages must be an int in \\[2, 3\\]"):
        gluon_mod.grouped_gemm_gluon_fp8_rowwise(xq, wq, off, xs, ws, block_n=256, promote=0, num_stages=4,
                                                 epilogue="tma")


# DeepSeek-V3 at T=4096: 256 experts of about 128 rows each, so most experts' second 128-row tile is short
_ABOUT_128 = [int(v) for v in 128 + torch.randint(-12, 13, (256,), generator=torch.Generator().manual_seed(5))]


@needs_sm90
@pytest.mark.parametrize("name, spec", [
    ("short-last-tiles", dict(sizes=[130, 0, 129, 200, 1, 64, 65, 190, 257], N=256, K=384, lead=3, tail=40)),
    ("E256-about-128-an-expert", dict(sizes=_ABOUT_128, N=256, K=256)),
])
def test_skip_empty_halves_bit_identical(name, spec):
    """The FP8-block kernel's consumers skip the ``wgmma`` of a half tile holding no row of its expert (``skip_empty``,
    the default): bit-identical to computing them (both epilogues), within the FP8 tolerance of the reference, unowned
    rows zero; ``skip_empty`` must be a bool."""
    import moe_torch
    from tolerances import FP8_REL_FRO, assert_rel_fro

    xq, wq, off, xs, ws = _problem(**spec)
    for ep in ("tma", "pointer"):
        y = gluon_mod.grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, num_stages=5, epilogue=ep)
        y_all = gluon_mod.grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, num_stages=5, epilogue=ep,
                                                       skip_empty=False)
        assert torch.equal(y, y_all), (name, ep)
    ref = moe_torch.grouped_gemm(xq, wq, off, x_scale=xs, w_scale=ws, out_dtype=torch.bfloat16,
                                 implementation="reference")
    lo, hi = int(off[0]), int(off[-1])
    assert_rel_fro(y[lo:hi].float(), ref[lo:hi].float(), FP8_REL_FRO, name)
    assert not y[:lo].any() and not y[hi:].any()
    with pytest.raises(TypeError, match=f"{OP}: skip_empty must be a bool"):
        gluon_mod.grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, skip_empty=1)


# ------------------------------------------------------------------ split-N tiles (block_m = 64) on an sm_90 GPU
_SPLIT_N_CASES = [c for c in _TMA_CASES if c[1]["K"] % 128 == 0] + [
    ("short-last-tiles", dict(sizes=[130, 0, 129, 200, 1, 64, 65, 190, 257], N=256, K=384, lead=3, tail=40)),
    ("E256-about-128-an-expert", dict(sizes=_ABOUT_128, N=256, K=256)),
    ("N-tail-past-half", dict(sizes=[70, 0, 150, 64], N=320, K=256, tail=9)),  # last tile: 64 of 256 columns
    ("N-below-128", dict(sizes=[33, 100], N=96, K=128)),  # the second consumer has no column anywhere
]


@needs_sm90
@pytest.mark.parametrize("name, spec", _SPLIT_N_CASES, ids=[c[0] for c in _SPLIT_N_CASES])
def test_split_n_bit_identical_to_128(name, spec):
    """``block_m=64`` (64 x 256 tiles, the consumers splitting the columns) writes exactly the bf16 values of the
    128 x 128 tiles (the same ``wgmma`` shape per 64 x 128 share, the same K order and promotion) with both epilogues:
    ragged experts, straddling and short last tiles, experts ending at ``M_cap``, N tails that leave the second
    consumer without columns (its ``w`` scales never read), E = 256; within the FP8 tolerance of the reference,
    unowned rows zero."""
    import moe_torch
    from tolerances import FP8_REL_FRO, assert_rel_fro

    xq, wq, off, xs, ws = _problem(**spec)
    N = wq.shape[1]
    for ep, st in (("tma", 4), ("pointer", 5)):
        if ep == "tma" and N % 8:
            continue
        y64 = gluon_mod.grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, num_stages=st, epilogue=ep, block_m=64)
        y128 = gluon_mod.grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, num_stages=st, epilogue=ep)
        assert torch.equal(y64, y128), (name, ep, (y64.float() - y128.float()).abs().max().item())
    ref = moe_torch.grouped_gemm(xq, wq, off, x_scale=xs, w_scale=ws, out_dtype=torch.bfloat16,
                                 implementation="reference")
    lo, hi = int(off[0]), int(off[-1])
    assert_rel_fro(y64[lo:hi].float(), ref[lo:hi].float(), FP8_REL_FRO, name)
    assert not y64[:lo].any() and not y64[hi:].any()


@needs_sm90
def test_split_n_refusals():
    """``ValueError`` before any launch: ``block_m`` not 128 / 64 (or not an int), and a ring deeper than 40 KiB
    stages leave room for (5 with the TMA epilogue, 6 with pointer stores)."""
    xq, wq, off, xs, ws = _problem([40, 30], 256, 256)
    for bad in (96, 256, 64.0, "64"):
        with pytest.raises(ValueError, match=f"{OP}: block_m must be 128 or 64"):
            gluon_mod.grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, block_m=bad)
    with pytest.raises(ValueError, match=f"{OP}: num_stages must be an int in \\[2, 4\\].*block_m = 64.*'tma'"):
        gluon_mod.grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, num_stages=5, block_m=64, epilogue="tma")
    with pytest.raises(ValueError, match=f"{OP}: num_stages must be an int in \\[2, 5\\].*block_m = 64.*'pointer'"):
        gluon_mod.grouped_gemm_gluon_fp8_block(xq, wq, off, xs, ws, num_stages=6, block_m=64, epilogue="pointer")
