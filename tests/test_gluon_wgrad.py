"""The Gluon bf16 / fp16 wgrad kernel (``moe_torch/ops/grouped_gemm/gluon_backward.py``): on a CPU, and on an sm_90 GPU.

* compile-only for sm_90a (in a child process without ``TRITON_INTERPRET``, which ``conftest.py`` sets on the CPU),
  both epilogues (TMA store for bf16 out, pointer stores for float32 out from fp16 inputs): the PTX has TMA copies,
  16-bit ``wgmma`` with both shared-memory operands MN-major (the transposed ``d_y`` and ``x`` tiles) and with A from
  registers (the ragged step, ``d_y`` masked there after an ``ldmatrix.trans``), one ``wgmma`` group left in flight,
  mbarriers and ``setmaxnreg``; ``ptxas -arch=sm_90a -v`` rc 0, no C7514 serialization warning, no spill; shared
  memory <= 227 KiB. The kernel has no per-expert table, so its code is the same for every ``E`` (E = 32 / 256 alike);
* the host-side refusals, on CPU tensors (they come before any launch), with their exact messages, and the dispatch
  never picking it on a CPU (switch on or off);
* on an sm_90 GPU (``EPMOE_TEST_DEVICE=gpu``; skipped elsewhere): random problems against a float64 reference
  (ragged experts not multiples of 8 nor 64, empty experts exactly 0, all rows on one expert, one row, ``offsets[0] >
  0``, ``M_cap`` not a multiple of 8, unused capacity NaN in both ``x`` and ``d_y``, K = 256 / 512, E = 256), each
  expert alone with every other row NaN, bf16 / fp16 inputs, float32 / bf16 / fp16 out, both epilogues and ring
  depths; decreasing offsets as the Triton kernel; the dispatch with ``EPMOE_TRITON_GLUON_WGRAD`` on (default) vs the Triton
  result with it off.
"""

from __future__ import annotations

import pytest
import torch

from common import TORCH_DEVICE
from sm90 import run_compile_child

gb = pytest.importorskip("moe_torch.ops.grouped_gemm.gluon_backward", reason="triton.experimental.gluon unavailable")
OP = "grouped_gemm_gluon_wgrad"
_CHILD = r"""
import json, os, subprocess, sys, tempfile
import torch, triton
from moe_torch.ops.grouped_gemm import gluon_backward as GB
out = {}
jobs = {"tma-bf16-bf16": (torch.bfloat16, torch.bfloat16, "tma"),
        "pointer-fp16-fp32": (torch.float16, torch.float32, "pointer")}
for key, (dt, odt, ep) in jobs.items():
    c = GB.compile_sm90_wgrad(dt, odt, ep)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(c.asm["ptx"])
        info = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o",
                               os.path.join(d, "k.o")], capture_output=True, text=True)
    out[key] = {"ptx": c.asm["ptx"], "ptxas": info.stdout + info.stderr, "ptxas_rc": info.returncode,
                "shared": c.metadata.shared}
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def compiled():
    return run_compile_child(_CHILD)


@pytest.mark.parametrize("key, ab, tma_store", [("tma-bf16-bf16", "bf16.bf16", True),
                                                ("pointer-fp16-fp32", "f16.f16", False)])
def test_compiles_for_sm90a(compiled, key, ab, tma_store):
    c = compiled[key]
    ptx = c["ptx"]
    assert ".target sm_90a" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier" in ptx  # TMA loads
    assert ("cp.async.bulk.tensor.2d.global.shared::cta" in ptx) is tma_store  # the TMA-store epilogue
    wgmma = [line.strip() for line in ptx.splitlines() if "wgmma.mma_async" in line]
    assert wgmma and all(f"m64n128k16.f32.{ab}" in line for line in wgmma), wgmma[:2]
    # both operands from shared memory, both MN-major (imm-trans-a = imm-trans-b = 1): the full steps
    assert any(line.endswith("1, 1, 1, 1;") and line.count("%rd") == 2 for line in wgmma), wgmma[:2]
    # A from registers (the ragged step's masked d_y, loaded transposed), B MN-major
    assert any("}, {%r" in line and line.endswith("1, 1, 1;") for line in wgmma), wgmma[-2:]
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    assert "wgmma.wait_group.sync.aligned 1" in ptx  # one step awaited, the next in flight
    assert "mbarrier.try_wait" in ptx and "mbarrier.arrive" in ptx
    assert "fence.proxy.async.shared::cta" in ptx  # the masked x box (and the epilogue tile) before the async proxy
    assert "setmaxnreg" in ptx
    assert c["ptxas_rc"] == 0, c["ptxas"]
    assert "C7514" not in c["ptxas"], c["ptxas"]
    assert " 0 bytes spill stores" in c["ptxas"], c["ptxas"]
    assert c["shared"] <= 227 * 1024, c["shared"]


# ------------------------------------------------------------------------------------ host refusals on a CPU

def _inputs(M=8, E=2, N=128, K=256, dtype=torch.bfloat16):
    x = torch.zeros(M, K, dtype=dtype)
    d_y = torch.zeros(M, N, dtype=dtype)
    off = torch.tensor([0] + [M] * E, dtype=torch.int32)
    return x, d_y, off


def _call(*args, **kwargs):
    return gb.grouped_gemm_gluon_wgrad(*args, **kwargs)


@pytest.mark.parametrize("which, value, exc, message", [
    ("x", torch.zeros(8, 256), TypeError,
     f"{OP}: x must be of dtype torch.bfloat16 or torch.float16, got torch.float32"),
    ("d_y", torch.zeros(8, 128, dtype=torch.float16), TypeError,
     f"{OP}: d_y must be of x's dtype torch.bfloat16, got torch.float16"),
    ("expert_offsets", torch.tensor([0, 8, 8]), TypeError,
     f"{OP}: expert_offsets must be of dtype torch.int32, got torch.int64"),
    ("x", [[0.0]], TypeError, f"{OP}: x must be a torch.Tensor, got list"),
    ("x", torch.zeros(8, 256, 1, dtype=torch.bfloat16), ValueError, f"{OP}: x must be 2-D, got shape (8, 256, 1)"),
    ("expert_offsets", torch.zeros(3, 1, dtype=torch.int32), ValueError,
     f"{OP}: expert_offsets must be 1-D, got shape (3, 1)"),
    ("d_y", torch.zeros(9, 128, dtype=torch.bfloat16), ValueError,
     f"{OP}: d_y must be [M_cap, N] with M_cap = x.shape[0] = 8, got shape (9, 128)"),
    ("expert_offsets", torch.zeros(1, dtype=torch.int32), ValueError,
     f"{OP}: expert_offsets must be of shape [E + 1] with E >= 1, got shape (1,)"),
    ("d_y", torch.zeros(8, 192, dtype=torch.bfloat16), NotImplementedError,
     f"{OP}: d_y must have N = shape[1] a positive multiple of 128 (the kernel's 128-row d_w tiles), got N = 192"),
    ("x", torch.zeros(8, 384, dtype=torch.bfloat16), NotImplementedError,
     f"{OP}: x must have K = shape[1] a positive multiple of 256 (the kernel's 256-column d_w tiles), got K = 384"),
    ("x", torch.zeros(8, 256, dtype=torch.bfloat16).t().contiguous().t(), ValueError,
     f"{OP}: x must be contiguous, got strides (1, 8)"),
    ("d_y", torch.zeros(128, 8, dtype=torch.bfloat16).t(), ValueError,
     f"{OP}: d_y must be contiguous, got strides (1, 8)"),
])
def test_refusals(which, value, exc, message):
    x, d_y, off = _inputs()
    args = {"x": x, "d_y": d_y, "expert_offsets": off}
    args[which] = value
    with pytest.raises(exc) as info:
        _call(**args)
    assert str(info.value) == message


def test_refuses_out_dtype():
    with pytest.raises(TypeError) as info:
        _call(*_inputs(), out_dtype=torch.float64)
    assert str(info.value) == (f"{OP}: out_dtype must be torch.float32, torch.bfloat16 or torch.float16, "
                               "got torch.float64")


def test_refuses_non_cuda_device():
    with pytest.raises(NotImplementedError) as info:
        _call(*_inputs(), out_dtype=torch.bfloat16)
    assert str(info.value) == (f"{OP}: x (and every input) must be on a CUDA device of compute capability (9, 0) "
                               "(sm_90a: wgmma, TMA, setmaxnreg), got device cpu")


def test_not_eligible_on_cpu(monkeypatch):
    """On a CPU the dispatch never picks the Gluon kernel, switch on (its default) or off, and the Triton (here
    interpreted) kernel serves ``grouped_gemm_wgrad`` with the switch on."""
    import moe_torch
    from moe_torch.ops import triton_common
    from moe_torch.ops.grouped_gemm import api

    x, d_y, off = _inputs()
    monkeypatch.setenv(triton_common.GLUON_WGRAD_ENV, "0")
    assert not triton_common.gluon_wgrad_enabled()
    assert not gb.gluon_wgrad_eligible(x, d_y, off, torch.bfloat16)
    monkeypatch.delenv(triton_common.GLUON_WGRAD_ENV, raising=False)
    assert triton_common.gluon_wgrad_enabled()
    assert not gb.gluon_wgrad_eligible(x, d_y, off, torch.bfloat16)
    assert api._gluon_wgrad(x, d_y, off, torch.bfloat16) is None
    if TORCH_DEVICE == "cpu":
        x, d_y, off = _inputs(M=4, N=128, K=256)
        x.normal_(generator=torch.Generator().manual_seed(0))
        d_y.normal_(generator=torch.Generator().manual_seed(1))
        out = moe_torch.grouped_gemm_wgrad(x, d_y, off, implementation="triton")
        assert torch.allclose(out[0], d_y.float().T @ x.float(), rtol=1e-5, atol=1e-5) and not out[1].any()


# ---------------------------------------------------------------------------------------------- on an sm_90 GPU
# (EPMOE_TEST_DEVICE=gpu on an H100 / H200; skipped elsewhere, with the reason)

def _sm90() -> bool:
    return TORCH_DEVICE == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the Gluon kernel runs on a CUDA device of compute capability "
                                "(9, 0) only (EPMOE_TEST_DEVICE=gpu on an H100 / H200)")


def _problem(sizes, N, K, *, lead=0, tail=0, offsets=None, dtype=torch.bfloat16, seed=0):
    """``x``, ``d_y`` (NaN in every row no expert owns: before ``offsets[0]`` and from ``max(offsets)``), offsets."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if offsets is None:
        offsets = [lead + int(v) for v in [0, *torch.tensor(sizes, dtype=torch.int64).cumsum(0).tolist()]]
    M_cap = max(offsets) + tail
    x = torch.randn(M_cap, K, device="cuda", generator=g).to(dtype)
    d_y = torch.randn(M_cap, N, device="cuda", generator=g).to(dtype)
    lo, hi = offsets[0], max(offsets)  # the Triton kernel's rows with decreasing offsets end at the largest one
    for t in (x, d_y):
        t[:lo] = float("nan")
        t[hi:] = float("nan")
    return x, d_y, torch.tensor(offsets, dtype=torch.int32, device="cuda")


def _reference(x, d_y, offsets):
    """float64 ``d_w [E, N, K]`` over each expert's rows only (so the NaN rows never enter)."""
    offs = offsets.tolist()
    E, N, K = len(offs) - 1, d_y.shape[1], x.shape[1]
    ref = torch.zeros(E, N, K, dtype=torch.float64, device=x.device)
    for e in range(E):
        s, t = offs[e], max(offs[e + 1], offs[e])
        if t > s:
            ref[e] = d_y[s:t].double().T @ x[s:t].double()
    return ref


def _check(out, ref, offsets, what):
    from tolerances import BF16_REL_FRO, GRAD_F32_REL_FRO, assert_rel_fro

    offs = offsets.tolist()
    assert torch.isfinite(out).all(), what
    for e in range(len(offs) - 1):
        if offs[e + 1] <= offs[e]:
            assert not out[e].any(), f"{what}: expert {e} has no rows, its gradient must be exactly 0"
    limit = GRAD_F32_REL_FRO if out.dtype == torch.float32 else BF16_REL_FRO
    assert_rel_fro(out.double(), ref, limit, what)
    if out.dtype != torch.float32:  # one rounding of a float32 sum: within an ulp or two of the rounded reference
        assert_rel_fro(out.double(), ref.to(out.dtype).double(), 4e-3, what + " (vs the rounded reference)")


_E256_SIZES = [int(v) for v in torch.randint(0, 40, (256,), generator=torch.Generator().manual_seed(3))]
_CASES = [
    ("ragged-empty-lead-tail", dict(sizes=[100, 0, 300, 0, 57, 129], N=256, K=512, lead=37, tail=51)),
    ("all-on-one-expert", dict(sizes=[0, 0, 1000, 0], N=128, K=256, tail=5)),
    ("one-row", dict(sizes=[0, 1, 0], N=128, K=256, lead=3, tail=4)),
    ("full-steps-only", dict(sizes=[64, 128, 0, 192], N=256, K=256)),
    ("E256-ragged", dict(sizes=_E256_SIZES, N=128, K=256, lead=5, tail=3)),
]


@needs_sm90
@pytest.mark.parametrize("dtype, out_dtype, epilogue, stages", [
    (torch.bfloat16, torch.float32, "pointer", 4), (torch.bfloat16, torch.bfloat16, "tma", 3),
    (torch.float16, torch.float32, "pointer", 2), (torch.float16, torch.float16, "tma", 2),
    (torch.bfloat16, torch.bfloat16, "pointer", 3), (torch.float16, torch.bfloat16, "tma", 3)])
@pytest.mark.parametrize("name, spec", _CASES, ids=[c[0] for c in _CASES])
def test_matches_reference(name, spec, dtype, out_dtype, epilogue, stages):
    """Random problems against the float64 reference, the unowned rows NaN in both inputs: finite, within the
    contract's gradient tolerance, empty experts exactly 0."""
    x, d_y, off = _problem(dtype=dtype, **spec)
    out = gb.grouped_gemm_gluon_wgrad(x, d_y, off, out_dtype, epilogue=epilogue, num_stages=stages)
    assert out.dtype == out_dtype and out.shape == (off.numel() - 1, d_y.shape[1], x.shape[1])
    _check(out, _reference(x, d_y, off), off, f"{name} {dtype} -> {out_dtype} {epilogue} s{stages}")


@needs_sm90
@pytest.mark.parametrize("epilogue", ["tma", "pointer"])
def test_other_experts_rows_never_enter(epilogue):
    """Each expert alone with every other row of ``x`` and ``d_y`` NaN (its neighbours' rows and the unused capacity
    inside its ragged last box): its gradient is finite and right (experts of 1, 7, 63, 65 and 200 rows, starting at
    rows not multiples of 8)."""
    sizes = [3, 1, 7, 63, 65, 200, 9]
    x0, d_y0, off = _problem(sizes, 256, 512, lead=5, tail=13)
    offs = off.tolist()
    for e in range(1, len(sizes)):
        x, d_y = x0.clone(), d_y0.clone()
        s, t = offs[e], offs[e + 1]
        for a in (x, d_y):
            a[:s] = float("nan")
            a[t:] = float("nan")
        out_dtype = torch.float32 if epilogue == "pointer" else torch.bfloat16
        out = gb.grouped_gemm_gluon_wgrad(x, d_y, off, out_dtype, epilogue=epilogue)
        ref = d_y[s:t].double().T @ x[s:t].double()
        _check(out[e:e + 1], ref[None], off[e:e + 2] - s, f"expert {e} ({t - s} rows) alone, {epilogue}")


@needs_sm90
def test_decreasing_offsets_as_triton():
    """Offsets that decrease (a precondition violation, not checked: no host sync) give an expert the rows the Triton
    kernel gives it: ``[0, 48, 0, 64, 60]`` -> rows [0, 48), none, [0, 64), none."""
    from moe_torch.ops.grouped_gemm.triton_backward import grouped_gemm_wgrad_triton
    from tolerances import GRAD_F32_REL_FRO, assert_rel_fro

    x, d_y, off = _problem([], 128, 256, offsets=[0, 48, 0, 64, 60], tail=20)
    out = gb.grouped_gemm_gluon_wgrad(x, d_y, off, torch.float32)
    t = grouped_gemm_wgrad_triton(x, d_y, off, torch.float32)
    assert torch.isfinite(out).all() and not out[1].any() and not out[3].any()
    assert_rel_fro(out, t, GRAD_F32_REL_FRO, "decreasing offsets")


@needs_sm90
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dispatch_switch(out_dtype, monkeypatch):
    """``moe_torch.grouped_gemm_wgrad(..., implementation="triton")``: by default (``EPMOE_TRITON_GLUON_WGRAD``
    unset) the Gluon kernel (bit-identical to calling it with its defaults), within the gradient tolerance of the
    Triton kernel's result with the switch set to 0; a shape the kernel does not take (K = 384) stays on Triton."""
    import moe_torch
    from moe_torch.ops.grouped_gemm import api
    from tolerances import BF16_REL_FRO, GRAD_F32_REL_FRO, assert_rel_fro

    x, d_y, off = _problem([1100, 0, 2500, 700, 13], 256, 512, tail=9)
    monkeypatch.setenv("EPMOE_TRITON_GLUON_WGRAD", "0")
    calls = []
    real = gb.grouped_gemm_gluon_wgrad
    monkeypatch.setattr(gb, "grouped_gemm_gluon_wgrad", lambda *a, **k: calls.append(a) or real(*a, **k))
    triton_out = moe_torch.grouped_gemm_wgrad(x, d_y, off, out_dtype=out_dtype, implementation="triton")
    assert not calls
    monkeypatch.delenv("EPMOE_TRITON_GLUON_WGRAD", raising=False)
    out = moe_torch.grouped_gemm_wgrad(x, d_y, off, out_dtype=out_dtype, implementation="triton")
    assert len(calls) == 1
    assert torch.equal(out, real(x, d_y, off, out_dtype))
    limit = GRAD_F32_REL_FRO if out_dtype == torch.float32 else BF16_REL_FRO
    assert_rel_fro(out.double(), triton_out.double(), limit, "gluon vs triton")
    assert_rel_fro(out.double(), _reference(x, d_y, off), limit, "gluon vs float64")
    x3 = torch.randn(x.shape[0], 384, device="cuda").to(x.dtype)
    assert not gb.gluon_wgrad_eligible(x3, d_y, off, out_dtype)
    # fewer than WGRAD_MIN_ROWS_PER_EXPERT rows an expert (E=5: 160 rows): the Triton kernel
    small = slice(0, gb.WGRAD_MIN_ROWS_PER_EXPERT * 5 - 8)
    assert gb.gluon_wgrad_eligible(x[: small.stop + 8].contiguous(), d_y[: small.stop + 8].contiguous(), off, out_dtype)
    assert not gb.gluon_wgrad_eligible(x[small].contiguous(), d_y[small].contiguous(), off, out_dtype)
    assert api._gluon_wgrad(x3, d_y, off, out_dtype) is None
