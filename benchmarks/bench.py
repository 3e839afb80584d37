"""The benchmark run: grouped GEMM, MoE layer and gate, our backends against peers and a
speed-of-light stand-in, every row checked against a reference before it is timed.

Usage (on the GPU machine, from the repo root; nothing to install there)::

    PYTHONPATH=. python3 benchmarks/bench.py                 # everything (~6 min on one H200 before the fp8_block rows)
    PYTHONPATH=. python3 benchmarks/bench.py --quick         # a small subset (< 2 min)
    PYTHONPATH=. python3 benchmarks/bench.py --what gemm --backends ours,torch._grouped_mm
    PYTHONPATH=. python3 benchmarks/bench.py --preset mixtral-8x7b   # that model's shapes and routing
    PYTHONPATH=. python3 benchmarks/bench.py --weights /ckpt/DeepSeek-V3 --what layer   # its first MoE layer
    PYTHONPATH=. python3 benchmarks/bench.py --tiny [--preset tiny | --weights DIR]    # the CPU smoke test
    PYTHONPATH=.:/tmp/tk python3 benchmarks/bench.py --what gemm_bwd,layer_bwd   # forward + backward (training);
        # /tmp/tk: `python3 -m pip install --no-deps --target /tmp/tk .whl/*.whl` (tokamax, the peer of the bf16
        # gemm and gemm_bwd rows, as wheels; with it on PYTHONPATH the forward run times it too)
    PYTHONPATH=. python3 benchmarks/bench.py --what decode   # gpt-oss-120b's layer at T in {1, 8, 64, 512}: bf16 / MXFP4 / INT4
    PYTHONPATH=.:/tmp/site python3 benchmarks/bench.py --what decode   # with SGLang's fused MoE as a peer; /tmp/site:
        # `python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl` (benchmarks/sglang_peer.py's wheels)

The layer under test: by default the built-in shapes (``benchmarks/specs.py``: E=32 experts, softmax
top-k); ``--preset NAME`` takes a model preset's layer (shapes, routing, shared experts) for every spec;
``--weights PATH`` one MoE layer of a safetensors checkpoint (``interop/checkpoints.py``): its shapes and
routing for every spec and its weights (router and bias included) for the layer rows; the GEMM and gate
rows draw their own inputs of those shapes.

Writes ``bench.json``, ``bench.csv`` (one row per (spec, backend), schema
``benchmarks/harness.py: ROW_KEYS``; rewritten after every row, so a killed run keeps what it
had), ``bench.md`` (every row), ``bench_gemm.png`` (time vs M), ``bench_layer.png`` (time vs T) and
``bench_gate.png`` (one bar per backend) to ``--out`` (default ``$OUT``, else ``benchmarks/results``),
and prints the short table last. On a CPU (``--tiny``) the kernels run interpreted: the tables'
headings and the plots' titles say so, and the times measure the interpreters, not the kernels.

Backends (a backend that cannot run gives a row with ``error``, and the run goes on):

- gemm (dtypes ``bf16``, ``fp8`` per-token x per-channel, ``fp8_block`` 1x128 x 128x128 blocks:
  ``specs.GemmSpec``): ``ours-torch-triton`` (``moe_torch.grouped_gemm(implementation="triton")``: its default
  dispatch, so ``fp8_block`` rows of >= 4096 rows on sm_90 time the Gluon kernel, ``moe_torch/ops/grouped_gemm/gluon.py``),
  ``ours-jax-pallas_triton`` and ``ours-jax-pallas_mosaic_gpu`` (``moe_pallas.grouped_gemm``,
  jitted), ``torch._grouped_mm`` (bf16), ``torch._scaled_grouped_mm`` (fp8 rowwise; for ``fp8_block``
  a skip row: torch has no grouped GEMM with 1x128 x 128x128 float32 scales, :data:`FP8_BLOCK_NO_PEER`),
  ``jax.lax.ragged_dot`` (bf16, as ``ragged_dot_general`` on our ``[E, N, K]`` weights),
  ``jax-ragged_dot_mgpu`` (bf16, jax's Pallas Mosaic GPU kernel, best of a few tile configs),
  ``tokamax.ragged_dot-mosaic`` (bf16, tokamax's Mosaic GPU ragged dot on ``[E, K, N]`` weights, transposed
  once, untimed; skipped off a GPU or without tokamax, as in gemm_bwd below) and
  ``sol-torch.bmm`` (bf16 ``[E, M/E, K] x [E, K, N]``, uniform routing only: the same FLOPs and
  weight bytes as an even split, the speed-of-light stand-in).
- layer: ``ours-torch-triton``, ``ours-jax-pallas_triton`` (jit, config static),
  ``ours-jax-pallas_mosaic_gpu`` (its grouped GEMMs on Mosaic GPU, the other stages pallas_triton),
  ``ref-torch``, ``ref-jax`` (the references; jnp jitted); and (``quant='none'`` only) the peer:
  transformers' own block of the model (``transformers-<block>``: ``MixtralSparseMoeBlock`` for
  Mixtral, ``Qwen3MoeSparseMoeBlock`` for Qwen3-MoE and the built-in shapes, ``DeepseekV3MoE`` for
  DeepSeek-V3 and the ``tiny`` preset; :func:`build_hf_block`), holding our ``w13`` / ``w2`` as its
  ``experts.gate_up_proj`` / ``down_proj`` (and DeepSeek-V3's shared experts), the same router weight
  (and bias), experts implementation ``grouped_mm`` as ``from_pretrained`` picks it where it can
  dispatch, and ``transformers-<block>-eager`` (the per-expert loop). Every row of a layer spec takes
  the logits that block's router computes from ``x`` (bf16 for Mixtral / Qwen3-MoE, float32 for
  DeepSeek-V3), so all are judged against one reference, our torch reference on those logits: the
  transformers rows' ``rel_err`` is their distance from our layer. Their time includes the
  ``[T, H] x [H, E]`` router matmul (negligible next to the experts). A layer row's bytes (and its % of
  the copy ceiling) are the weights of the experts its tokens reach (counted from the reference gate's
  ``topk_ids``; DeepSeek-V3's drawn bias leaves 168 of 256 reached at T=256), ``x`` and ``out``.
- gate: ``ours-torch-triton`` (eager, and ``ours-torch-triton-cudagraph``: replayed from a CUDA
  graph), ``ours-jax-pallas_triton``, ``ref-torch``, ``ref-torch-compile`` (``torch.compile`` of the
  torch reference), ``ref-jax``.
- gemm_bwd (on request: ``--what gemm_bwd``; bf16, uniform rows; CONTRACT.md section 8): forward +
  backward (``d_x`` and ``d_w`` from ``d_y ~ N(0, 1)``) of ``ours-torch-triton`` and ``ref-torch``
  (``moe_torch.grouped_gemm`` under autograd: its backward is ``grouped_gemm_dgrad`` +
  ``grouped_gemm_wgrad`` of the same backend), ``ours-jax-pallas_triton``, ``ours-jax-pallas_mosaic_gpu``
  (forward, dgrad and wgrad on Mosaic GPU: ``pallas_mosaic_gpu_backward.py``) and ``ref-jax`` (``moe_pallas.grouped_gemm`` under ``jax.vjp``, jitted); peers
  ``torch._grouped_mm`` (autograd), ``tokamax.ragged_dot-mosaic`` (tokamax's Mosaic GPU ragged dot
  under ``jax.vjp``; tokamax is a benchmark-only peer, not a dependency: its wheels travel to the GPU
  machine, and without it the row is skipped) and
  ``jax.lax.ragged_dot`` (``jax.vjp``, XLA); the JAX peers take the weights in their layout
  ``[E, K, N]`` (transposed once, untimed). Judged against float32 per-expert matmuls
  (:func:`gemm_grad_reference`).
- layer_bwd (on request: ``--what layer_bwd``; bf16): forward + backward (gradients of ``x``,
  ``router_logits``, ``w13``, ``w2`` from ``d_out ~ N(0, 1)``) of ``moe_forward`` under autograd /
  ``jax.vjp`` for ``ours-torch-triton``, ``ref-torch``, ``ours-jax-pallas_triton``,
  ``ours-jax-pallas_mosaic_gpu`` and ``ref-jax``, each with ``recompute=False`` and ``recompute=True``
  (``-recompute`` rows); the peer transformers' block (``transformers-<block>``, grouped_mm experts,
  built as for the layer rows) under autograd, its router included. Judged against our torch reference
  under autograd (:func:`layer_grad_reference`); the transformers row, computed by torch's autograd
  through transformers' own code, is the independent check of that reference.
- decode (on request: ``--what decode``; :func:`benchmarks.specs.decode_specs`): the layer rows (same
  backends, CUDA-graph row included, and the decode path: ``ours-torch-decode-cudagraph``, ``ours-jax-decode``;
  MXFP4 also on codes repacked to the MMA layout: ``ours-torch-triton-mma-cudagraph``,
  ``ours-torch-decode-mma-cudagraph``; JAX converts such codes back at each call, so it has no such rows)
  at T in {1, 2, 4, 8, 16, 32, 64, 128} of four models in the weight format each ships in: gpt-oss-120b MXFP4
  (E=128, topk 4, H=I=2880, router and expert biases, clamped SwiGLU on interleaved gate/up), DeepSeek-V3 FP8
  blocks as one EP8 rank (its 32 routed experts and the shared one; the row is that rank's partial sum),
  Qwen3-30B-A3B bf16 and Kimi K2 INT4; or ``--preset``'s layer in bf16, MXFP4 and INT4. A row's bytes are the
  weights of the experts its tokens actually reach
  (their 4.25 / 4.5 bits a weight for MXFP4 / INT4, scales included), so ``pct_of_ceiling`` is the share of
  the copy bandwidth on those bytes; the JAX rows rotate over input sets that reach other experts (the L2
  holds one step's 4-bit weights). The peer is transformers' ``GptOssMLP`` (grouped_mm experts) on the bf16
  weights; its MXFP4 path needs the hub's kernels (no network on the GPU machine): skipped with the reason.
  Second peer, the field's serving kernel: ``sglang-fused_moe-triton`` (CUDA only), SGLang's fused-MoE Triton
  path (``fused_experts_impl`` of the ``sglang`` wheel, ``benchmarks/sglang_peer.py``) after our gate, captured in
  a CUDA graph as ``ours-torch-decode-cudagraph``; its notes name SGLang's launch config and what the adapter
  substitutes (the ``moe_align_block_size`` CUDA op by ours in torch). A benchmark-only peer: its wheels travel
  to the GPU machine; without sglang, and for what it cannot serve (MXFP4; INT4 with gpt-oss's expert biases),
  a skip row with the reason.

Forward + backward rows report (``harness.py``'s docstring): ``median_ms`` of the forward + backward,
``fwd_ms`` (the forward alone), ``bwd_fwd_ratio``, ``bwd_tflops`` (the backward's 2x forward FLOPs over
``median_ms - fwd_ms``), ``peak_mem_mib`` (``mem_method``: the torch CUDA peak delta, or XLA's
compiled memory analysis, each row's own) and ``held_mib`` (what the forward holds for the backward:
``recompute=True`` lowers this, not necessarily the one-layer peak); each output and gradient is
checked before anything is timed, and the tables get a "Forward + backward" section. A row that cannot
run on this machine by design (a Mosaic GPU kernel or tokamax off a GPU, tokamax not installed) is
``skipped`` with its reason, not an error.

Inputs are drawn in torch on the device (bf16, ``x ~ N(0, 1)``, ``w ~ N(0, 1/K)``, the router
``N(0, 1/H)``, DeepSeek-V3's bias ``0.1 N(0, 1)``; or the checkpoint's weights) and handed
to JAX through DLPack (zero-copy), so both frameworks see the same bits; FP8 codes and scales
come from ``moe_torch``'s quantization. The reference of every row is the torch reference of
the op (``implementation="reference"``); a row whose relative Frobenius error is over
``harness.REL_ERR_MAX`` is marked ``WRONG`` and not timed.
"""

from __future__ import annotations

import os
import sys

TINY = "--tiny" in sys.argv  # a CPU smoke test: set up the interpreters before torch/triton/jax import
if TINY:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

from benchmarks import harness as H  # noqa: E402
from benchmarks import specs as S  # noqa: E402
from moe_contract import PRESETS, get_preset  # noqa: E402
from moe_contract.config import SWIGLU_OAI_LIMIT  # noqa: E402

WHATS = ("gemm", "layer", "gate", "gemm_bwd", "layer_bwd", "decode")
#: What a run does unless ``--what`` says otherwise: the forward benches (the backward ones are asked for by name).
DEFAULT_WHAT = "gemm,layer,gate"
#: Tile configs tried for jax's ragged_dot_mgpu: (block_m, block_n, block_k, max_concurrent_steps,
#: grid_block_n); the first four are jax's own examples' tiles plus one wider N tile.
MGPU_CONFIGS = ((128, 128, 64, 4, 1), (128, 256, 64, 4, 1), (64, 128, 64, 4, 2), (128, 128, 64, 5, 4))
MGPU_CONFIGS_QUICK = MGPU_CONFIGS[:2]
#: Group rows are padded to this many if torch's grouped GEMMs reject unaligned groups (torch
#: 2.11 should not need it: pytorch/pytorch#155466 lifted the dynamic-dimension check).
PEER_ROW_ALIGN = 16
#: Why the ``fp8_block`` GEMM rows have no peer (their ``torch._scaled_grouped_mm`` row is a skip): torch 2.11's
#: grouped FP8 GEMMs (``torch._scaled_grouped_mm``, ``torch.nn.functional.scaled_grouped_mm``) take rowwise float32
#: scales (``[M]`` x ``[E, N]``; ``torch/_meta_registrations.py``) or MXFP8 / NVFP4 block scales, no 1x128 x
#: 128x128 float32 blocks (no block-scaled path on Hopper); DeepGEMM and SGLang's kernels are not
#: on the GPU machine, which has no network.
FP8_BLOCK_NO_PEER = ("no peer: torch's grouped FP8 GEMMs take rowwise float32 scales ([M] x [E, N]) or MXFP8/NVFP4 "
                     "blocks, not 1x128 x 128x128 float32 blocks (DeepGEMM, SGLang: not on the GPU machine)")
#: Largest layer (elements of w13 + w2, all experts) that --tiny runs with the kernels interpreted on the
#: CPU: the ``tiny`` preset (17 x 3 x 256 x 128 = 1.7M) fits; Qwen3-30B-A3B's layer (604M) would take hours.
TINY_MAX_WEIGHT_ELEMENTS = 1 << 21


class Ctx:
    """What every bench function needs: devices, options, the rows so far, the caches."""

    def __init__(self, args, model: S.BenchModel | None = None, ckpt: dict | None = None):
        import torch

        self.args = args
        self.model = model  # --preset / --weights: the layer whose shapes (and weights) every spec takes
        self.ckpt = ckpt  # --weights: the layer's tensors (checkpoints.MoECheckpointLayer.arrays), else None
        self.torch_dev = torch.device("cuda" if torch.cuda.is_available() and not TINY else "cpu")
        self.cpu = self.torch_dev.type != "cuda"  # kernels interpreted: tables and plots say so
        self.rows: list[dict] = []
        self.jit_cache: dict = {}
        self.torch_mem_stats = None  # harness.torch_memory_mib's counters; None: CUDA's on a GPU (tests inject a fake)
        self.mgpu_best: dict = {}  # (shape, M, dtype) -> config, found on the uniform spec
        self.t0 = time.perf_counter()
        self.filters = [f for f in (args.backends or "").split(",") if f]
        self.meta: dict = {}

    def wants(self, backend: str) -> bool:
        return not self.filters or any(f in backend for f in self.filters)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.args.max_minutes is not None and self.elapsed() > 60 * self.args.max_minutes

    def add(self, row: dict) -> None:
        self.rows.append(row)
        print(progress_line(row, self.elapsed()), flush=True)
        if self.args.out:
            H.write_json(self.rows, os.path.join(self.args.out, "bench.json"), self.meta)
            H.write_csv(self.rows, os.path.join(self.args.out, "bench.csv"))


def progress_line(r: dict, elapsed: float) -> str:
    head = f"[{elapsed:6.1f}s] {r['spec']:<44} {r['backend']:<26}"
    if H.skipped(r):  # not run here by design: not an error
        return f"{head} SKIP {str(r['error'])[len(H.SKIPPED):][:200]}"
    if r.get("error"):
        return f"{head} ERROR {str(r['error'])[:200]}"
    t = f"{r['median_ms']:.4f} ms [{r['p20_ms']:.4f}, {r['p80_ms']:.4f}]" if r.get("median_ms") else "-"
    rates = "".join([f" {r['tflops']:.0f} TFLOP/s" if r.get("tflops") else "",
                     f" {r['gbps']:.0f} GB/s" if r.get("gbps") else "",
                     f" {r['pct_of_ceiling']:.0f}% ({r['bound']})" if r.get("pct_of_ceiling") else ""])
    if r.get("fwd_ms"):  # a forward + backward row
        rates += (f" | fwd {r['fwd_ms']:.4f} ms" + (f", bwd/fwd {r['bwd_fwd_ratio']:.2f}" if r.get("bwd_fwd_ratio") else "")
                  + (f", bwd {r['bwd_tflops']:.0f} TFLOP/s" if r.get("bwd_tflops") else "")
                  + (f", peak {r['peak_mem_mib']:.0f} MiB" if r.get("peak_mem_mib") is not None else "")
                  + (f", held {r['held_mib']:.3g} MiB" if r.get("held_mib") is not None else "")
                  + f", grad err {r.get('grad_rel_err') or 0:.1e} |")
    return f"{head} {t}{rates} err={r.get('rel_err') or 0:.1e} {r.get('timing_method')} compile={r.get('compile_s') or 0:.1f}s" + (
        f"  ({r['notes']})" if r.get("notes") else "")


def short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


# ---------------------------------------------------------------------------------------------- helpers


def rel_err_t(out, ref) -> float:
    """Relative Frobenius error of two torch tensors (either may come from JAX through DLPack)."""
    import torch

    if not isinstance(out, torch.Tensor):
        out = torch.from_dlpack(out)
    out, ref = out.detach().to(ref.device).double(), ref.detach().double()  # outputs of autograd rows carry a graph
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def j(t):
    """torch tensor -> jax array, zero-copy (None passes)."""
    import jax.numpy as jnp

    return None if t is None else jnp.from_dlpack(t)


def sig(args) -> tuple:
    """A hashable signature of a call's arrays (shapes and dtypes), for the compile cache."""
    import jax

    return tuple((tuple(a.shape), str(a.dtype)) if hasattr(a, "shape") else a for a in jax.tree.leaves(args))


def judge(row: dict, out, ref, tol: float = H.REL_ERR_MAX) -> bool:
    """The correctness gate of every row: ``rel_err`` of ``out`` against ``ref`` into the row; a wrong
    result (over ``tol``) is marked WRONG and must not be timed (returns False)."""
    err = rel_err_t(out, ref)
    row["rel_err"] = err
    if not err <= tol:
        row["error"] = f"WRONG: rel_err={err:.3g} > {tol:g}; not timed"
        return False
    return True


def run_torch(ctx: Ctx, bench: str, backend: str, spec, fn, ref, *, flops: float, nbytes: float, dtype: str,
              canon=lambda o: o, notes: str | None = None, add: bool = True, tol: float = H.REL_ERR_MAX) -> dict:
    """Check ``canon(fn())`` against ``ref`` (within ``tol``), then time ``fn``; adds one row (unless
    ``add=False``) and returns it."""
    row = H.make_row(bench, backend, spec, notes=notes)
    try:
        out, compile_s = H.torch_first_call(fn, ctx.torch_dev)
        row["compile_s"] = compile_s
        ok = judge(row, canon(out), ref, tol)
        del out  # not held while timing
        if ok:
            row.update(H.time_torch(fn, ctx.torch_dev, warmup_ms=ctx.args.warmup_ms, rep_ms=ctx.args.rep_ms))
            H.add_rates(row, flops, nbytes, dtype)
    except Exception as exc:  # one backend's failure must not stop the run
        row["error"] = short_error(exc)
        if ctx.args.verbose:
            traceback.print_exc()
    if add:
        ctx.add(row)
    return row


def run_jax(ctx: Ctx, bench: str, backend: str, spec, fn, args: tuple, ref, *, flops: float, nbytes: float,
            dtype: str, canon=lambda o: o, notes: str | None = None, rot_sets: list[tuple] | None = None,
            add: bool = True, variant: str = "") -> dict:
    """Compile ``fn`` (cached by backend, ``variant``, static config and argument shapes: the
    uniform and zipf specs of one shape share the program), check it, time it (rotating over
    ``rot_sets`` if given); adds one row (unless ``add=False``) and returns it."""
    import jax

    row = H.make_row(bench, backend, spec, notes=notes)
    try:
        compiled, compile_s = H.jax_compile(fn, *args, cache=ctx.jit_cache, key=(backend, variant, spec_key(spec), sig(args)))
        row["compile_s"] = compile_s
        out = compiled(*args)
        jax.block_until_ready(out)
        ok = judge(row, canon(out), ref)
        del out  # not held while timing
        if ok:
            if rot_sets and len(rot_sets) > 1:
                rot, c2 = H.jax_compile(H.rotated(fn, len(rot_sets)), *rot_sets, cache=ctx.jit_cache,
                                        key=(backend, variant, spec_key(spec), "rot", len(rot_sets), sig(rot_sets[0])))
                timing = H.time_jax(rot, tuple(rot_sets), n_sets=len(rot_sets), rep_ms=ctx.args.rep_ms)
            else:
                timing = H.time_jax(compiled, args, rep_ms=ctx.args.rep_ms)
            tnote = timing.pop("notes", None)
            row.update(timing)
            if tnote:
                row["notes"] = "; ".join(x for x in (row.get("notes"), tnote) if x)
            H.add_rates(row, flops, nbytes, dtype)
    except Exception as exc:
        row["error"] = short_error(exc)
        if ctx.args.verbose:
            traceback.print_exc()
    if add:
        ctx.add(row)
    return row


def spec_key(spec) -> tuple:
    """The parts of a spec that change the compiled program (static config), not its data."""
    if isinstance(spec, S.LayerSpec):
        return ("layer", spec.config())
    if isinstance(spec, S.GateSpec):
        return ("gate", spec.config())
    return ()


def l2_note(ctx: Ctx, spec) -> str | None:
    """GEMM and layer inputs are not rotated: their weights alone are far over the L2 (>= 470 MB at
    the real sizes); say so in the row if a spec is ever small enough for that to matter."""
    if ctx.torch_dev.type == "cuda" and S.rotation_sets(spec.min_bytes, H.L2_BYTES) > 1:
        return "inputs < 2x L2, JAX timing not rotated (torch's do_bench flushes L2)"
    return None


def error_row(ctx: Ctx, bench: str, backend: str, spec, error: str, notes: str | None = None) -> None:
    ctx.add(H.make_row(bench, backend, spec, error=error, notes=notes))


# ---------------------------------------------------------------------------------------------- gemm


class GemmWeights:
    """The weights of one (shape, dtype), kept across the specs that share them."""

    key = None
    w = wq = ws = None


def gemm_weights(ctx: Ctx, spec: S.GemmSpec, cache: GemmWeights) -> GemmWeights:
    import torch

    import moe_torch

    key = (spec.E, spec.N, spec.K, spec.dtype)
    if cache.key == key:
        return cache
    cache.key = cache.w = cache.wq = cache.ws = None
    if ctx.torch_dev.type == "cuda":
        torch.cuda.empty_cache()
    g = torch.Generator(device=ctx.torch_dev).manual_seed(1000 + spec.seed)
    w = torch.empty(spec.E, spec.N, spec.K, device=ctx.torch_dev, dtype=torch.bfloat16)
    for e in range(spec.E):  # expert by expert: no float32 temporary of the whole tensor
        w[e] = (torch.randn(spec.N, spec.K, generator=g, device=ctx.torch_dev) * spec.K**-0.5).to(torch.bfloat16)
    cache.w = w
    if spec.dtype in ("fp8", "fp8_block"):
        # [E, N, K] e4m3 and float32 scales: fp8 [E, N] per output channel, fp8_block [E, ceil(N/128), K/128]
        cache.wq, cache.ws = moe_torch.quantize_weight_fp8(w, "per_channel" if spec.dtype == "fp8" else "block")
        cache.w = None
        del w
    cache.key = key
    return cache


def pad_groups(sizes, align: int):
    """Row index map for groups padded to ``align`` rows: (dst index of each real row, padded ends [E])."""
    import numpy as np

    padded = -(-sizes // align) * align
    starts_p = np.concatenate([[0], np.cumsum(padded)[:-1]])
    idx = np.concatenate([np.arange(n) + sp for n, sp in zip(sizes, starts_p)]) if sizes.sum() else np.zeros(0)
    return idx.astype(np.int64), np.cumsum(padded).astype(np.int32)


def bench_gemm(ctx: Ctx, spec: S.GemmSpec, wcache: GemmWeights) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import moe_pallas
    import moe_torch

    dev, bf16 = ctx.torch_dev, torch.bfloat16
    fp8 = spec.dtype != "bf16"  # FP8 codes and float32 scales: "fp8" or "fp8_block"
    block = spec.dtype == "fp8_block"
    W = gemm_weights(ctx, spec, wcache)
    g = torch.Generator(device=dev).manual_seed(spec.seed)
    x = torch.randn(spec.M, spec.K, generator=g, device=dev).to(bf16)
    sizes = spec.group_sizes()
    offs = torch.from_numpy(spec.expert_offsets()).to(dev)  # [E + 1] int32, the contract's offsets
    ends = offs[1:].contiguous()  # [E] int32 cumulative ends, torch's `offs`
    if fp8:  # [M, K] e4m3 and float32 scales: fp8 [M, 1] per token, fp8_block [M, K/128] per 1x128 group
        xq, xs = moe_torch.per_token_group_quant_fp8(x, S.FP8_BLOCK) if block else moe_torch.per_token_quant_fp8(x)
        wq, ws = W.wq, W.ws
        del x
        x = None
    else:
        xq, xs, wq, ws = x, None, W.w, None
    ref = moe_torch.grouped_gemm(xq, wq, offs, x_scale=xs, w_scale=ws, out_dtype=bf16, implementation="reference")
    common = dict(flops=spec.flops, nbytes=spec.min_bytes, dtype=spec.dtype)
    nact = int((sizes > 0).sum())
    rnote = f"{nact}/{spec.E} experts with rows, largest {int(sizes.max())}" if spec.routing != "uniform" else None
    rnote = "; ".join(x for x in (rnote, l2_note(ctx, spec)) if x) or None

    # ours, torch
    if ctx.wants("ours-torch-triton"):
        run_torch(ctx, "gemm", "ours-torch-triton", spec,
                  lambda: moe_torch.grouped_gemm(xq, wq, offs, x_scale=xs, w_scale=ws, out_dtype=bf16, implementation="triton"),
                  ref, notes=rnote, **common)

    # ours, JAX
    jx, jw, joffs, jxs, jws = j(xq), j(wq), j(offs), j(xs), j(ws)
    for impl in ("pallas_triton", "pallas_mosaic_gpu", None):
        name = f"ours-jax-{impl or 'default'}"  # None: the library's own choice (implementation=None)
        if not ctx.wants(name):
            continue
        if impl == "pallas_mosaic_gpu" and mosaic_gpu_missing():  # never runs off a GPU: a skip, not an error
            skip_row(ctx, "gemm", name, spec, mosaic_gpu_missing(), notes=rnote)
            continue

        def fn(x_, w_, o_, xs_, ws_, impl=impl):
            return moe_pallas.grouped_gemm(x_, w_, o_, x_scale=xs_, w_scale=ws_, out_dtype=jnp.bfloat16, implementation=impl)

        row = run_jax(ctx, "gemm", name, spec, fn, (jx, jw, joffs, jxs, jws), ref, notes=rnote, add=False, **common)
        if row.get("error") and impl == "pallas_mosaic_gpu" and ("ValueError" in row["error"] or "NotImplementedError" in row["error"]):
            row["error"] = "not available: " + row["error"]
        ctx.add(row)

    # peers, torch: grouped GEMMs on our [E, N, K] weights as the column-major [E, K, N] view
    peer = "torch._scaled_grouped_mm" if fp8 else "torch._grouped_mm"
    if block and ctx.wants(peer):
        skip_row(ctx, "gemm", peer, spec, FP8_BLOCK_NO_PEER, notes=rnote)
    elif fp8 and ctx.cpu and ctx.wants(peer):  # CUDA only: a skip on the CPU, not an error
        skip_row(ctx, "gemm", peer, spec, f"{peer} has CUDA kernels only; the torch device is cpu", notes=rnote)
    elif ctx.wants(peer):
        wt = wq.transpose(1, 2)  # [E, K, N], column-major: no copy

        def call(a, a_scale, ends_):
            if fp8:
                return torch._scaled_grouped_mm(a, wt, scale_a=a_scale, scale_b=ws, offs=ends_, out_dtype=bf16)
            return torch._grouped_mm(a, wt, offs=ends_, out_dtype=bf16)

        xs_flat = xs.reshape(-1).contiguous() if fp8 else None  # [M] f32
        row = run_torch(ctx, "gemm", peer, spec, lambda: call(xq, xs_flat, ends), ref, notes=rnote, add=False, **common)
        if not row.get("error"):
            ctx.add(row)
        else:  # unaligned groups rejected or miscomputed? pad every group to PEER_ROW_ALIGN rows and say so
            idx, ends_p = pad_groups(sizes, PEER_ROW_ALIGN)
            idx_t = torch.from_numpy(idx).to(dev)
            Mp = int(ends_p[-1]) if len(ends_p) else 0
            xp = torch.randn(Mp, spec.K, generator=g, device=dev).to(xq.dtype)  # padding rows: random, computed, dropped
            xp.view(torch.uint8)[idx_t] = xq.view(torch.uint8)  # byte copy: index_put has no float8 kernel
            xsp = None
            if fp8:
                xsp = torch.ones(Mp, device=dev)
                xsp[idx_t] = xs_flat
            ends_pt = torch.from_numpy(ends_p).to(dev)
            note = f"unpadded call failed ({row['error'][:80]}); groups padded to {PEER_ROW_ALIGN} rows (M={Mp})"
            run_torch(ctx, "gemm", peer, spec, lambda: call(xp, xsp, ends_pt), ref, canon=lambda o: o[idx_t],
                      notes="; ".join(x for x in (rnote, note) if x), **common)

    # peers, JAX (bf16 only: neither takes FP8 scales)
    if not fp8:
        jgs = jnp.asarray(sizes.astype(np.int32))  # [E] int32 rows per expert
        if ctx.wants("jax.lax.ragged_dot"):
            dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                                   lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
            run_jax(ctx, "gemm", "jax.lax.ragged_dot", spec, lambda a, b, gs: jax.lax.ragged_dot_general(a, b, gs, dn),
                    (jx, jw, jgs), ref, notes="; ".join(x for x in (rnote, "ragged_dot_general on [E, N, K]") if x), **common)
        if ctx.wants("jax-ragged_dot_mgpu") and mosaic_gpu_missing():  # a Mosaic GPU kernel: a skip off a GPU
            skip_row(ctx, "gemm", "jax-ragged_dot_mgpu", spec, f"ragged_dot_mgpu is a Mosaic GPU kernel (a Hopper "
                     f"GPU); the JAX backend is {jax.default_backend()}", notes=rnote)
        elif ctx.wants("jax-ragged_dot_mgpu"):
            bench_mgpu(ctx, spec, jx, jw, jgs, ref, rnote, common)
        # tokamax's ragged_dot in its layout, rhs [E, K, N] (a transposed copy of ours made once, untimed)
        tnote = "; ".join(x for x in (rnote, "rhs [E, K, N] (its layout; transposed once, untimed)") if x)
        tk = tokamax_ragged_dots(ctx, "gemm", spec, tnote)
        if tk:
            jw_kn = jax.block_until_ready(jnp.swapaxes(jw, 1, 2))
            for name, rd, extra in tk:
                run_jax(ctx, "gemm", name, spec, rd, (jx, jw_kn, jgs), ref, notes=f"{tnote}; {extra}", **common)
            del jw_kn

    # speed of light: the same FLOPs and weight bytes as an even split, as one batched matmul
    if not fp8 and spec.routing == "uniform" and spec.M % spec.E == 0 and ctx.wants("sol-torch.bmm"):
        xb = xq.view(spec.E, spec.M // spec.E, spec.K)
        wt = wq.transpose(1, 2)
        run_torch(ctx, "gemm", "sol-torch.bmm", spec, lambda: torch.bmm(xb, wt), ref,
                  canon=lambda o: o.reshape(spec.M, spec.N), notes=f"[{spec.E}, {spec.M // spec.E}, K] x [{spec.E}, K, N]", **common)
    del ref


def bench_mgpu(ctx: Ctx, spec: S.GemmSpec, jx, jw, jgs, ref, rnote, common) -> None:
    """jax's ragged_dot_mgpu: the configs that fit (K % block_k, N % (grid_block_n * block_n)), best one
    reported; a zipf spec reuses the best config of its uniform twin."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    except Exception as exc:
        error_row(ctx, "gemm", "jax-ragged_dot_mgpu", spec, f"not importable: {short_error(exc)}")
        return
    names = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")
    twin = ctx.mgpu_best.get((spec.shape, spec.M, spec.dtype))
    pool = MGPU_CONFIGS_QUICK if ctx.args.quick else MGPU_CONFIGS
    if TINY:
        pool = ((16, 16, 16, 2, 1),)
    configs = [twin] if twin else [c for c in pool if spec.K % c[2] == 0 and spec.N % (c[1] * c[4]) == 0]
    tried, best, last = [], None, None
    for cfg in configs:
        kw = dict(zip(names, cfg))

        def fn(a, b, gs, kw=kw):
            return ragged_dot_mgpu.ragged_dot(a, b, group_sizes=gs, transpose_rhs=True, **kw)

        note = "cfg " + "/".join(map(str, cfg))
        row = run_jax(ctx, "gemm", "jax-ragged_dot_mgpu", spec, fn, (jx, jw, jgs), ref, notes=note, add=False,
                      variant=note, **common)
        tried.append(f"{'/'.join(map(str, cfg))}: "
                     + (f"{row['median_ms']:.3f} ms" if row.get("median_ms") else f"err ({str(row.get('error'))[:60]})"))
        last = row
        if row.get("median_ms") and not row.get("error") and (best is None or row["median_ms"] < best["median_ms"]):
            best, best_cfg = row, cfg
    if best is None:
        row = last or H.make_row("gemm", "jax-ragged_dot_mgpu", spec, error="no config fits the shape")
        row["notes"] = "; ".join(x for x in (rnote, "tried " + ", ".join(tried)) if x)
        ctx.add(row)
        return
    if spec.routing == "uniform":
        ctx.mgpu_best[(spec.shape, spec.M, spec.dtype)] = best_cfg
    what = "best of " + ", ".join(tried) if len(tried) > 1 else ("uniform's best " if twin else "") + best["notes"]
    best["notes"] = "; ".join(x for x in (rnote, f"(block_m/n/k/steps/grid_n) {what}") if x)
    ctx.add(best)


# ---------------------------------------------------------------------------------------------- layer


def layer_weights(ctx: Ctx, spec: S.LayerSpec, config) -> tuple:
    """``(w13, w13_scale, w2, w2_scale)`` on the device in the form ``spec.quant`` takes: the checkpoint's
    (``--weights``: bf16; FP8 codes and block scales as stored for ``fp8_block``, gpt-oss's MXFP4 codes and e8m0
    scales as stored for ``mxfp4``; a quantized checkpoint dequantized expert by expert for the other modes) or drawn (bf16, ``w ~ N(0, 1/K)``, seeded), for the
    routed and the shared experts (``[E + S, ...]``)."""
    import torch

    import moe_torch

    dev, bf16 = ctx.torch_dev, torch.bfloat16
    ck = ctx.ckpt
    stored = None if ck is None else ck.get("format")  # "fp8_block" / "mxfp4": the file's codes and scales
    if stored is not None and spec.quant == stored:  # the checkpoint's own codes and scales, as stored
        f = torch.float32 if stored == "fp8_block" else None
        return ck["w13"].to(dev), ck["w13_scale"].to(dev, f), ck["w2"].to(dev), ck["w2_scale"].to(dev, f)
    n = config.local_expert_range()[1]  # this rank's routed and shared experts (one device: all of them)
    w13 = torch.empty(n, 2 * spec.I, spec.H, device=dev, dtype=bf16)
    w2 = torch.empty(n, spec.H, spec.I, device=dev, dtype=bf16)
    g = torch.Generator(device=dev).manual_seed(2000 + spec.seed)
    for e in range(n):  # expert by expert: no float32 temporary of the whole tensor
        if ck is None:
            w13[e] = (torch.randn(2 * spec.I, spec.H, generator=g, device=dev) * spec.H**-0.5).to(bf16)
            w2[e] = (torch.randn(spec.H, spec.I, generator=g, device=dev) * spec.I**-0.5).to(bf16)
        elif stored is None:
            w13[e], w2[e] = ck["w13"][e].to(dev, bf16), ck["w2"][e].to(dev, bf16)
        elif stored == "mxfp4":  # exact: e2m1 x 2^k fits bf16
            for w, q, s in ((w13, ck["w13"], ck["w13_scale"]), (w2, ck["w2"], ck["w2_scale"])):
                w[e] = moe_torch.dequantize_weight_mxfp4(q[e:e + 1].to(dev), s[e:e + 1].to(dev))[0].to(bf16)
        else:
            for w, q, s in ((w13, ck["w13"], ck["w13_scale"]), (w2, ck["w2"], ck["w2_scale"])):
                w[e] = moe_torch.dequantize_weight_fp8(q[e:e + 1].to(dev), s[e:e + 1].to(dev, torch.float32))[0].to(bf16)
    return moe_torch.quantize_layer_weights(w13, w2, config)


def layer_router(ctx: Ctx, spec: S.LayerSpec, config) -> tuple:
    """``(router_weight [E, H] float32, e_score_correction_bias [E] float32 or None)``: the checkpoint's
    (``--weights``) or drawn (``N(0, 1/H)``, so that the logits ``x @ W.T`` are ~ N(0, 1); the bias
    ``0.1 * N(0, 1)``); the bias only for biased grouped top-k (the only routing that takes one)."""
    import torch

    dev = ctx.torch_dev
    biased = config.routing == "biased_grouped_topk"
    if ctx.ckpt is not None:
        bias = ctx.ckpt["e_score_correction_bias"]
        if biased and bias is None:
            raise ValueError(f"layer_router: {config.routing} needs the checkpoint's e_score_correction_bias; it has none")
        return (ctx.ckpt["router_weight"].to(dev, torch.float32),
                bias.to(dev, torch.float32) if biased else None)
    gate_w = hf_router_weight(spec, dev, torch.float32)
    g = torch.Generator(device=dev).manual_seed(4000 + spec.seed)
    return gate_w, (0.1 * torch.randn(spec.E, generator=g, device=dev) if biased else None)


def router_logits(arch: str | None, x, router_weight, router_bias=None):
    """``[T, E]`` float32: the logits transformers' block of ``arch`` computes from ``x [T, H]``: Mixtral,
    Qwen3-MoE and gpt-oss in the activations' dtype (``F.linear(x, gate.weight)``, bf16 here; gpt-oss's
    ``GptOssTopKRouter`` adds its ``bias [E]``), DeepSeek-V3 in float32 (it casts both operands). Our rows take
    these same logits, so every row of a spec has one reference."""
    import torch

    if arch in (None, "deepseek_v3"):
        return torch.nn.functional.linear(x.float(), router_weight.float(),
                                          None if router_bias is None else router_bias.float())
    return torch.nn.functional.linear(x, router_weight.to(x.dtype),
                                      None if router_bias is None else router_bias.to(x.dtype)).float()


def layer_extras(ctx: Ctx, spec: S.LayerSpec, config) -> dict:
    """The drawn tensors a layer's semantics need beyond ``x``, the logits and the weights (seeded, bf16-exact):
    gpt-oss's router bias ``[E]`` (``spec.arch == 'gpt_oss'``; ``0.1 N(0, 1)``) and expert biases ``w13_bias
    [E + S, 2I]`` / ``w2_bias [E + S, H]`` (``config.expert_bias``; bf16 ``0.1 N(0, 1)``, the scale of a GEMM
    output); Qwen3-Next's shared-expert gate weight ``[S, H]`` (``config.shared_expert_gate``; ``N(0, 1/H)``).
    With ``--weights``: the checkpoint's own tensors of these. Absent keys: the layer has no such tensor."""
    import torch

    dev, bf16 = ctx.torch_dev, torch.bfloat16
    ck = ctx.ckpt
    if ck is not None:  # --weights: the checkpoint's own (router_bias [E] float32; biases and gate as stored)
        out = {k: ck[v].to(dev) for k, v in (("router_bias", "router_bias"), ("w13_bias", "w13_bias"),
                                             ("w2_bias", "w2_bias"), ("shared_gate", "shared_expert_gate"))
               if ck.get(v) is not None}
        return out
    g = torch.Generator(device=dev).manual_seed(5000 + spec.seed)
    out = {}
    n = config.local_expert_range()[1]
    if spec.arch == "gpt_oss":
        out["router_bias"] = (0.1 * torch.randn(spec.E, generator=g, device=dev)).to(bf16).float()
    if config.expert_bias:
        out["w13_bias"] = (0.1 * torch.randn(n, 2 * spec.I, generator=g, device=dev)).to(bf16)
        out["w2_bias"] = (0.1 * torch.randn(n, spec.H, generator=g, device=dev)).to(bf16)
    if config.shared_expert_gate:
        S_ = config.num_fused_shared_experts
        out["shared_gate"] = (torch.randn(S_, spec.H, generator=g, device=dev) * spec.H**-0.5).to(bf16)
    return out


def touched_experts(logits, config, bias) -> int:
    """This rank's routed experts that at least one token of ``logits [T, E]`` reaches (the reference gate's
    ``topk_ids``; one device: every routed expert)."""
    import torch

    import moe_torch

    _, ids = moe_torch.select_experts(logits, **config.gate_kwargs(), e_score_correction_bias=bias,
                                      implementation="reference")
    lo = config.local_expert_range()[0]
    hi = lo + config.num_experts // config.ep_size
    return int(torch.unique(ids[(ids >= lo) & (ids < hi)]).numel())


def bench_layer(ctx: Ctx, spec: S.LayerSpec, wcache: dict) -> None:
    """The layer rows of ``spec`` (bench ``layer``; a :class:`~benchmarks.specs.DecodeSpec`: bench ``decode``).

    The spec's ``touched`` is set from the routing of the row's tokens (the mean over the input sets), so a
    row's bytes (and its % of the copy ceiling) are the weights actually read. Decode rows: the JAX rows rotate
    over enough input sets (other tokens, other experts) that a set's weights have left the L2 before its next
    use (torch's ``do_bench`` flushes the L2 between calls)."""
    import torch

    import moe_pallas
    import moe_torch

    bench = "decode" if isinstance(spec, S.DecodeSpec) else "layer"
    dev, bf16 = ctx.torch_dev, torch.bfloat16
    config = spec.config()
    key = (spec.model, spec.E, spec.H, spec.I, spec.quant, getattr(spec, "ep_size", 1))
    if wcache.get("key") != key:
        wcache.clear()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        wcache.update(key=key, w=layer_weights(ctx, spec, config), router=layer_router(ctx, spec, config),
                      extras=layer_extras(ctx, spec, config))
    w13, s13, w2, s2 = wcache["w"]
    gate_w, bias = wcache["router"]
    ex = wcache["extras"]
    rb, b13, b2, sg = ex.get("router_bias"), ex.get("w13_bias"), ex.get("w2_bias"), ex.get("shared_gate")
    g = torch.Generator(device=dev).manual_seed(spec.seed)
    n_sets = S.rotation_sets(spec.min_bytes, H.L2_BYTES) if bench == "decode" and dev.type == "cuda" else 1
    xs = [torch.randn(spec.T, spec.H, generator=g, device=dev).to(bf16) for _ in range(n_sets)]
    with torch.no_grad():
        lgs = [router_logits(spec.arch, x, gate_w, rb) for x in xs]
        sgls = [None if sg is None else torch.nn.functional.linear(x.float(), sg.float()) for x in xs]
    x, logits, sgl = xs[0], lgs[0], sgls[0]
    # every row's bytes are the weights of the experts its tokens reach (a biased or grouped gate reaches far
    # fewer than uniform routing's expectation: DeepSeek-V3's drawn bias, 168 of 256 at T=256)
    touched = [touched_experts(lg, config, bias) for lg in lgs]
    spec = dataclasses.replace(spec, touched=sum(touched) / len(touched))
    notes = "; ".join(x for x in (
        l2_note(ctx, spec) if bench == "layer" else None,
        f"bytes: the weights of the {spec.touched:g} routed experts the tokens reach"
        + (f" and of the {spec.num_shared} shared" if spec.num_shared else "")
        + (f" (mean of {n_sets} input sets; JAX rotates over them, torch's do_bench flushes the L2)"
           if n_sets > 1 else "")) if x)
    kw = dict(w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2, e_score_correction_bias=bias)
    ref = moe_torch.moe_forward(x, logits, w13, w2, config, **kw, shared_expert_gate_logits=sgl,
                                implementation="reference")
    common = dict(flops=spec.flops, nbytes=spec.min_bytes, dtype=spec.dtype, notes=notes)
    for impl, name in (("triton", "ours-torch-triton"), ("reference", "ref-torch")):
        if ctx.wants(name):
            run_torch(ctx, bench, name, spec,
                      functools.partial(moe_torch.moe_forward, x, logits, w13, w2, config, **kw,
                                        shared_expert_gate_logits=sgl, implementation=impl), ref, **common)
    if dev.type == "cuda" and ctx.wants("ours-torch-triton-cudagraph"):
        bench_layer_cuda_graph(ctx, spec, x, logits, (w13, w2), dict(kw, shared_expert_gate_logits=sgl), config, ref, common,
                               bench=bench)
    if dev.type == "cuda" and bench == "decode" and ctx.wants("ours-torch-decode-cudagraph"):
        bench_decode_path(ctx, spec, x, logits, (w13, w2), kw, sgl, config, ref, common)
    mma_rows = [n for n in ("ours-torch-triton-mma-cudagraph", "ours-torch-decode-mma-cudagraph") if ctx.wants(n)]
    if dev.type == "cuda" and config.quant == "mxfp4" and mma_rows:  # the codes repacked for the MMA (load time)
        from moe_torch.layer import mma_layout_weight

        mma = config.replace(w4_layout="mma")
        m13, _ = mma_layout_weight("bench", "w13", w13, kw["w13_scale"])
        m2, _ = mma_layout_weight("bench", "w2", w2, kw["w2_scale"])
        if "ours-torch-triton-mma-cudagraph" in mma_rows:
            bench_layer_cuda_graph(ctx, spec, x, logits, (m13, m2), dict(kw, shared_expert_gate_logits=sgl), mma, ref,
                                   common, bench=bench, name="ours-torch-triton-mma-cudagraph")
        if bench == "decode" and "ours-torch-decode-mma-cudagraph" in mma_rows:
            bench_decode_path(ctx, spec, x, logits, (m13, m2), kw, sgl, mma, ref, common,
                              name="ours-torch-decode-mma-cudagraph")
    jsets = [(j(x_), j(l_), j(w13), j(w2), j(s13), j(s2), j(bias), j(b13), j(b2), j(s_))
             for x_, l_, s_ in zip(xs, lgs, sgls)]
    # pallas_mosaic_gpu: the grouped GEMMs on Mosaic GPU, every other stage its default (pallas_triton on a GPU)
    for impl, name in (("pallas_triton", "ours-jax-pallas_triton"), ("pallas_mosaic_gpu", "ours-jax-pallas_mosaic_gpu"),
                       (None, "ours-jax-default"), ("reference", "ref-jax")):
        if ctx.wants(name) and impl == "pallas_mosaic_gpu" and spec.quant in ("mxfp4", "int4"):
            skip_row(ctx, bench, name, spec, f"the Mosaic GPU grouped GEMM has no 4-bit weights ({spec.quant}); "
                     f"moe_forward's default serves them with Pallas-Triton (the ours-jax-pallas_triton row)")
        elif ctx.wants(name) and impl == "pallas_mosaic_gpu" and mosaic_gpu_missing():
            skip_row(ctx, bench, name, spec, mosaic_gpu_missing())
        elif ctx.wants(name):

            def fn(x_, l_, w13_, w2_, s13_, s2_, b_, b13_, b2_, sgl_, impl=impl):
                return moe_pallas.moe_forward(x_, l_, w13_, w2_, config, w13_scale=s13_, w2_scale=s2_, w13_bias=b13_,
                                              w2_bias=b2_, e_score_correction_bias=b_, shared_expert_gate_logits=sgl_,
                                              implementation=impl)

            run_jax(ctx, bench, name, spec, fn, jsets[0], ref, rot_sets=jsets if n_sets > 1 else None, **common)
    if bench == "decode" and ctx.wants("ours-jax-decode"):
        from moe_pallas.layer import run_gate as jax_run_gate
        from moe_pallas.ops.decode import fused_experts_decode as jax_decode
        from moe_pallas.slot_weights import slot_weights as jax_slot_weights

        def fn_decode(x_, l_, w13_, w2_, s13_, s2_, b_, b13_, b2_, sgl_):
            tw, ti = jax_run_gate(l_, config, b_, "pallas_triton")
            # the decode path takes the slots' weights with any shared-expert gate applied (its api)
            tw, _ = jax_slot_weights(tw, sgl_, config.replace(apply_router_weight_on_input=False))
            return jax_decode(x_, tw, ti, w13_, w2_, config, w13_bias=b13_, w2_bias=b2_, w13_scale=s13_,
                              w2_scale=s2_, implementation="pallas_triton")

        run_jax(ctx, bench, "ours-jax-decode", spec, fn_decode, jsets[0], ref,
                rot_sets=jsets if n_sets > 1 else None, **common)
    if dev.type == "cuda" and bench == "decode" and ctx.wants("sglang-fused_moe-triton"):
        # the field's serving kernel, a benchmark-only peer (benchmarks/sglang_peer.py): our gate, SGLang's experts
        from benchmarks import sglang_peer
        from moe_torch.layer import run_gate

        sgl_name = sglang_peer.ROW_NAME
        try:
            peer = sglang_peer.SGLangFusedMoE(w13, w2, config, w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2)
            peer_notes = "; ".join(n for n in (notes, peer.notes(spec.T, config.topk + config.num_fused_shared_experts)) if n)
        except (ImportError, NotImplementedError) as exc:  # not installed, or a layer it cannot serve
            skip_row(ctx, bench, sgl_name, spec, str(exc), notes=notes)
        except Exception as exc:
            error_row(ctx, bench, sgl_name, spec, "setup: " + short_error(exc), notes=notes)
        else:
            sgl_x, sgl_logits = x.clone(), logits.clone()

            def fn_sglang():
                topk_weights, topk_ids = run_gate(sgl_logits, config, bias, "triton")
                return peer(sgl_x, topk_weights, topk_ids)

            tol = H.FP8_PEER_REL_ERR_MAX if spec.quant.startswith("fp8") else H.REL_ERR_MAX
            run_torch_cuda_graph(ctx, bench, sgl_name, spec, fn_sglang, ref, {**common, "notes": peer_notes, "tol": tol})
            del peer
    del jsets
    if config.ep_size > 1 and spec.arch is not None:  # an EP rank's partial sum: no whole-layer peer
        for name in (f"transformers-{S.HF_BLOCKS[spec.arch]}", f"transformers-{S.HF_BLOCKS[spec.arch]}-eager"):
            if ctx.wants(name):
                skip_row(ctx, bench, name, spec, f"one EP rank's part of the layer (ep_size={config.ep_size}); "
                         f"transformers' block computes the whole layer")
    elif spec.quant == "none":
        bench_layer_transformers(ctx, spec, x, (w13, w2, gate_w, bias, rb, b13, b2), ref, common, bench=bench)
    elif spec.arch is not None:  # quantized rows (decode and layer): the peer's columns say why they are empty
        block = S.HF_BLOCKS[spec.arch]
        why = {"mxfp4": f"transformers' {block} runs float weights only here (its MXFP4 path needs the hub's kernels, "
                        f"which the GPU machine cannot download)",
               "int4": f"transformers' {block} has no INT4 expert path"}.get(
            spec.quant, f"transformers' {block} holds float weights; this row's weights are {spec.quant}")
        for name in (f"transformers-{block}", f"transformers-{block}-eager"):
            if ctx.wants(name):
                skip_row(ctx, bench, name, spec, why)
    del ref


def bench_layer_cuda_graph(ctx: Ctx, spec, x, logits, weights: tuple, kw: dict, config, ref, common: dict,
                           bench: str = "layer", name: str = "ours-torch-triton-cudagraph") -> None:
    """The Triton layer captured once in a CUDA graph and replayed (how SGLang/vLLM run decode): the
    launch overhead of the eager row goes away. Also the GPU proof that the layer captures (no host
    sync on the Triton path). ``kw``: moe_forward's weight-side keywords (scales, biases, gate logits)."""
    import moe_torch

    w13, w2 = weights
    static_x, static_logits = x.clone(), logits.clone()
    run_torch_cuda_graph(ctx, bench, name, spec, lambda: moe_torch.moe_forward(
        static_x, static_logits, w13, w2, config, **kw, implementation="triton"), ref, common)


def bench_decode_path(ctx: Ctx, spec, x, logits, weights: tuple, kw: dict, shared_gate_logits, config, ref,
                      common: dict, name: str = "ours-torch-decode-cudagraph") -> None:
    """The low-latency decode path (``moe_torch.ops.decode.fused_experts_decode``: GEMM 1 + activation, GEMM 2 +
    combine, two launches) after the layer's gate, captured in a CUDA graph (``ours-torch-decode-cudagraph``)."""
    from moe_torch.layer import run_gate
    from moe_torch.ops.decode import fused_experts_decode
    from moe_torch.slot_weights import slot_weights

    w13, w2 = weights
    static_x, static_logits = x.clone(), logits.clone()
    static_sgl = None if shared_gate_logits is None else shared_gate_logits.clone()

    def forward():
        topk_weights, topk_ids = run_gate(static_logits, config, kw["e_score_correction_bias"], "triton")
        # the decode path takes the slots' weights with any shared-expert gate applied (its api)
        topk_weights, _ = slot_weights(topk_weights, static_sgl, config.replace(apply_router_weight_on_input=False))
        return fused_experts_decode(static_x, topk_weights, topk_ids, w13, w2, config, w13_bias=kw["w13_bias"],
                                    w2_bias=kw["w2_bias"], w13_scale=kw["w13_scale"], w2_scale=kw["w2_scale"],
                                    implementation="triton")

    run_torch_cuda_graph(ctx, "decode", name, spec, forward, ref, common)


def run_torch_cuda_graph(ctx: Ctx, what: str, row_name: str, spec, forward, ref, common: dict) -> None:
    """``forward()`` (static inputs) captured once in a CUDA graph, its replay timed as a row. Warm-up on a
    side stream first (kernel compilation), as torch documents; a capture failure becomes the row's error."""
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = forward()

        def replay():
            graph.replay()
            return static_out

        run_torch(ctx, what, row_name, spec, replay, ref, **common)
    except Exception as exc:  # a capture failure is a finding: record it, go on
        row = H.make_row(what, row_name, spec, notes=common.get("notes"))
        row["error"] = "capture: " + short_error(exc)
        ctx.add(row)


def hf_router_weight(spec: S.LayerSpec, device, dtype):
    """A drawn router ``gate.weight [E, H]`` ~ N(0, 1/H), seeded: its logits ``x @ W.T`` are ~ N(0, 1)."""
    import torch

    g = torch.Generator(device=device).manual_seed(3000 + spec.seed)
    return (torch.randn(spec.E, spec.H, generator=g, device=device) * spec.H**-0.5).to(dtype)


def build_hf_block(config, w13, w2, gate_weight, experts_implementation: str = "grouped_mm", *, arch: str = "qwen3_moe",
                   e_score_correction_bias=None, router_bias=None, w13_bias=None, w2_bias=None):
    """transformers' MoE block of ``arch`` (:data:`benchmarks.specs.HF_BLOCKS`) holding *our* weights
    (shared, not copied, except the shared experts' halves when ``S > 1``).

    transformers 5.24 keeps the routed experts fused, in our layout: ``experts.gate_up_proj [E, 2I, H]``
    (gate rows first: ``linear(x, gate_up_proj[e]).chunk(2)``) = ``w13[:E]``, ``experts.down_proj [E, H, I]``
    = ``w2[:E]``; ``gate.weight [E, H]`` is the router. Mixtral and Qwen3-MoE compute the logits in the
    weights' dtype (``gate_weight`` is cast to ``w13``'s); DeepSeek-V3 keeps ``gate.weight`` and its
    ``e_score_correction_bias [E]`` in float32 and adds ``shared_experts`` (a ``DeepseekV3MLP`` of
    intermediate ``S * I``: ``gate_proj``/``up_proj`` the halves of ``w13[E:]``, ``down_proj`` the ``w2[E:]``
    side by side), which are our fused shared experts ``E .. E + S - 1``. Built on the meta device, so no
    float32 copy of the weights is ever made.

    Args:
      config: our ``MoEConfig`` (quant 'none', silu): Mixtral needs softmax top-k renormalised, Qwen3-MoE
        softmax top-k (``norm_topk_prob = renormalize``), both rsf 1 and no shared experts; DeepSeek-V3
        biased grouped top-k.
      w13: ``[E + S, 2I, H]``; w2: ``[E + S, H, I]``; gate_weight: ``[E, H]``;
      e_score_correction_bias: ``[E]`` (DeepSeek-V3 only).
      router_bias, w13_bias, w2_bias: gpt-oss only (``GptOssMLP``): ``router.bias [E]``, ``experts.gate_up_proj_bias
        [E, 2I]``, ``experts.down_proj_bias [E, H]``. gpt-oss keeps its experts transposed (``gate_up_proj [E, H, 2I]``,
        gate/up interleaved along ``2I`` as our ``gate_up_layout='interleaved'`` rows; ``down_proj [E, I, H]``):
        the block gets the transposed views of ``w13`` / ``w2`` (no copy).
      experts_implementation: ``"grouped_mm"`` (``torch._grouped_mm``; what ``from_pretrained`` picks where
        it can dispatch) or ``"eager"`` (the per-expert loop).

    Raises: ValueError (a layer the block cannot express, a wrong shape, a missing bias), naming it.
    """
    import torch

    op = "build_hf_block"
    if arch not in S.HF_BLOCKS:
        raise ValueError(f"{op}: arch must be one of {tuple(S.HF_BLOCKS)}; got arch={arch!r}")
    E, I, H, Sh = config.num_experts, config.intermediate_size, config.hidden_size, config.num_fused_shared_experts
    want = {"mixtral": ("softmax_topk", "softmax top-k, renormalised, rsf 1, no shared experts"),
            "qwen3_moe": ("softmax_topk", "softmax top-k, rsf 1, no shared experts"),
            "deepseek_v3": ("biased_grouped_topk", "biased grouped top-k"),
            "gpt_oss": ("softmax_topk", "softmax top-k renormalised, rsf 1, no shared experts, swiglu_oai on interleaved "
                                        "gate/up rows, expert biases")}[arch]
    act, layout = ("swiglu_oai", "interleaved") if arch == "gpt_oss" else ("silu", "concatenated")
    fits = (config.routing == want[0] and config.activation == act and config.gate_up_layout == layout
            and config.quant == "none" and config.expert_bias == (arch == "gpt_oss")
            and (arch == "deepseek_v3" or (config.routed_scaling_factor == 1.0 and Sh == 0))
            and (arch not in ("mixtral", "gpt_oss") or config.renormalize))
    if not fits:
        raise ValueError(f"{op}: {S.HF_BLOCKS[arch]} is {want[1]}, {act}, quant 'none'; got {config}")
    shapes = {"w13": (tuple(w13.shape), (E + Sh, 2 * I, H)), "w2": (tuple(w2.shape), (E + Sh, H, I)),
              "gate_weight": (tuple(gate_weight.shape), (E, H))}
    if arch == "deepseek_v3":
        if e_score_correction_bias is None:
            raise ValueError(f"{op}: DeepseekV3MoE needs e_score_correction_bias [E={E}]; got None")
        shapes["e_score_correction_bias"] = (tuple(e_score_correction_bias.shape), (E,))
    if arch == "gpt_oss":
        for name, t, exp in (("router_bias", router_bias, (E,)), ("w13_bias", w13_bias, (E, 2 * I)),
                             ("w2_bias", w2_bias, (E, H))):
            if t is None:
                raise ValueError(f"{op}: GptOssMLP needs {name} {list(exp)}; got None")
            shapes[name] = (tuple(t.shape), exp)
    for name, (got, exp) in shapes.items():
        if got != exp:
            raise ValueError(f"{op}: {name} must be {list(exp)}; got {list(got)}")

    param = functools.partial(torch.nn.Parameter, requires_grad=False)
    if arch == "mixtral":
        from transformers.models.mixtral.configuration_mixtral import MixtralConfig as Cfg
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        hf_cfg = Cfg(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=config.topk,
                     router_jitter_noise=0.0, hidden_act="silu")
    elif arch == "qwen3_moe":
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig as Cfg
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        hf_cfg = Cfg(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=config.topk,
                     norm_topk_prob=config.renormalize, hidden_act="silu")
    elif arch == "gpt_oss":
        from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig as Cfg
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as Block

        hf_cfg = Cfg(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=config.topk,
                     swiglu_limit=SWIGLU_OAI_LIMIT)  # swiglu_alpha is GptOssExperts' 1.702 = SWIGLU_OAI_ALPHA
    else:
        from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config as Cfg
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block

        hf_cfg = Cfg(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=config.topk,
                     n_group=config.num_expert_group or 1, topk_group=config.topk_group or 1, n_shared_experts=Sh,
                     routed_scaling_factor=config.routed_scaling_factor, norm_topk_prob=config.renormalize,
                     hidden_act="silu")
    hf_cfg._experts_implementation = experts_implementation
    with torch.device("meta"):
        block = Block(hf_cfg)
    if arch == "gpt_oss":
        ex, dt = block.experts, w13.dtype
        ex.gate_up_proj, ex.down_proj = param(w13.transpose(1, 2)), param(w2.transpose(1, 2))
        ex.gate_up_proj_bias, ex.down_proj_bias = param(w13_bias.to(dt)), param(w2_bias.to(dt))
        block.router.weight, block.router.bias = param(gate_weight.to(dt)), param(router_bias.to(dt))
    else:
        block.experts.gate_up_proj = param(w13[:E])
        block.experts.down_proj = param(w2[:E])
    if arch == "deepseek_v3":
        block.gate.weight = param(gate_weight.float())
        block.gate.e_score_correction_bias = e_score_correction_bias.float()  # a buffer
        sh = block.shared_experts
        sh.gate_proj.weight = param(w13[E:, :I].reshape(Sh * I, H))  # a view for S = 1
        sh.up_proj.weight = param(w13[E:, I:].reshape(Sh * I, H))
        sh.down_proj.weight = param(w2[E:].permute(1, 0, 2).reshape(H, Sh * I))
    elif arch != "gpt_oss":
        block.gate.weight = param(gate_weight.to(w13.dtype))
    left = [n for n, t in [*block.named_parameters(), *block.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{op}: {S.HF_BLOCKS[arch]} has tensors this builder does not set: {left}")
    return block.eval()


def bench_layer_transformers(ctx: Ctx, spec: S.LayerSpec, x, weights: tuple, ref, common: dict,
                             bench: str = "layer") -> None:
    """transformers' block of the spec's model (``spec.arch``) on the same ``x`` and weights, timed like our
    rows, judged against the same reference (our torch reference on the logits its router computes);
    its rel. error is therefore against our layer. ``weights``: ``(w13, w2, gate_w, e_score_correction_bias,
    router_bias, w13_bias, w2_bias)`` (the last three None where the layer has none)."""
    import torch

    names = []
    if spec.arch is not None:
        cls = S.HF_BLOCKS[spec.arch]
        names = [(n, impl) for n, impl in ((f"transformers-{cls}", "grouped_mm"), (f"transformers-{cls}-eager", "eager"))
                 if ctx.wants(n)]
    elif ctx.wants("transformers"):
        error_row(ctx, bench, "transformers", spec, f"not available: no transformers block for routing "
                  f"{spec.config().routing!r}")
    if not names:
        return
    w13, w2, gate_w, bias, rb, b13, b2 = weights
    x3 = x[None]  # [batch=1, seq=T, H]: the block's input shape
    for name, impl in names:
        note = f"experts_implementation={impl}; includes its router matmul; ref = ours on its router's logits"
        try:
            block = build_hf_block(spec.config(), w13, w2, gate_w, impl, arch=spec.arch, e_score_correction_bias=bias,
                                   router_bias=rb, w13_bias=b13, w2_bias=b2)
        except Exception as exc:
            error_row(ctx, bench, name, spec, "setup: " + short_error(exc), notes=note)
            continue

        def fn(block=block):
            with torch.no_grad():
                return block(x3)

        run_torch(ctx, bench, name, spec, fn, ref,  # GptOssMLP returns (out, router_scores)
                  canon=lambda o: (o[0] if isinstance(o, tuple) else o).reshape(spec.T, spec.H),
                  **{**common, "notes": "; ".join(n for n in (common.get("notes"), note) if n)})
        del block



# ---------------------------------------------------------------------------------------------- backward
# Forward + backward rows (``--what gemm_bwd,layer_bwd``; CONTRACT.md section 8). Each row is checked on every
# output first (the forward's and each gradient, against float32 / reference gradients: judge_grads), then
# its forward + backward call is timed (median_ms), its forward alone (fwd_ms), and its memory taken, per row:
# the forward + backward's peak and what the forward holds for the backward (harness.torch_memory_mib;
# harness.jax_memory_mib of the row's own compiled forward + backward and harness.jax_held_mib).

#: tokamax's ``ragged_dot`` implementations benchmarked as peers of the bf16 ``gemm`` rows (forward) and of the
#: ``gemm_bwd`` rows (under ``jax.vjp``) (tokamax 0.0.17 on the H200 registers ``"mosaic"`` and ``"xla"``;
#: ``"xla"`` is XLA's ragged_dot, already the ``jax.lax.ragged_dot`` row).
TOKAMAX_IMPLEMENTATIONS = ("mosaic",)


def import_tokamax():
    """tokamax, imported for benchmarking only (not a dependency of the library): the GPU machine gets it
    as wheels. Its ``tokamax/_src/benchmarking.py``
    imports ``xprof.cli.tools`` at module level; without xprof, an empty stand-in module ``xprof.cli.tools``
    (``get_kernel_stats_tool = None``) goes into ``sys.modules`` first. Raises ImportError if tokamax is
    not installed."""
    import importlib.util
    import types

    try:
        have_xprof = importlib.util.find_spec("xprof") is not None
    except (ImportError, ValueError):
        have_xprof = False
    if not have_xprof and "xprof.cli.tools" not in sys.modules:
        for name in ("xprof", "xprof.cli"):
            sys.modules.setdefault(name, types.ModuleType(name))
        tools = types.ModuleType("xprof.cli.tools")
        tools.get_kernel_stats_tool = None
        sys.modules["xprof.cli.tools"] = tools
    import tokamax

    return tokamax


def tokamax_wanted(ctx: Ctx) -> list[str]:
    """The :data:`TOKAMAX_IMPLEMENTATIONS` whose row (``tokamax.ragged_dot-<impl>``) ``--backends`` asks for."""
    return [impl for impl in TOKAMAX_IMPLEMENTATIONS if ctx.wants(f"tokamax.ragged_dot-{impl}")]


def tokamax_ragged_dots(ctx: Ctx, bench: str, spec, notes: str | None) -> list[tuple]:
    """tokamax's ``ragged_dot`` as a peer of ``bench``'s rows of ``spec``: ``(row name, fn, note)`` for each
    implementation of :func:`tokamax_wanted` that can run here, ``fn(lhs [M, K], rhs [E, K, N], group_sizes [E]
    int32) -> [M, N]`` (its layout: ``rhs`` K-major per group), the note naming tokamax's version. Where one cannot
    run by design (``mosaic`` off an NVIDIA GPU; tokamax not importable: a benchmark-only peer whose wheels travel
    to the GPU machine), a skip row with ``notes`` instead."""
    import jax

    peers = []
    for impl in tokamax_wanted(ctx):
        name = f"tokamax.ragged_dot-{impl}"
        if impl == "mosaic" and jax.default_backend() != "gpu":
            skip_row(ctx, bench, name, spec, f"tokamax mosaic needs an NVIDIA GPU; the JAX backend is {jax.default_backend()}",
                     notes=notes)
            continue
        try:
            tokamax = import_tokamax()
        except Exception as exc:
            skip_row(ctx, bench, name, spec, f"tokamax not importable ({short_error(exc)[:160]}); it is a benchmark-only "
                     "peer: install its wheels (pip install tokamax)", notes=notes)
            continue
        peers.append((name, lambda a, b, gs, impl=impl: tokamax.ragged_dot(a, b, gs, implementation=impl),
                      f"tokamax {getattr(tokamax, '__version__', '?')} implementation={impl!r}"))
    return peers


def judge_grads(row: dict, outs: dict, refs: dict) -> bool:
    """The correctness gate of a forward + backward row: ``rel_err`` of each of ``outs`` (name -> array) against
    ``refs`` (the same names; the first is the forward's output, the others gradients) into the row:
    ``rel_err`` the forward's, ``grad_rel_err`` the largest gradient's, every one in ``notes``. A forward over
    ``REL_ERR_MAX`` or a gradient over ``GRAD_REL_ERR_MAX`` marks the row WRONG, naming them: it must not be
    timed (returns False)."""
    errs = {name: rel_err_t(outs[name], ref) for name, ref in refs.items()}
    first = next(iter(refs))
    row["rel_err"] = errs[first]
    grads = [e for name, e in errs.items() if name != first]
    row["grad_rel_err"] = max(grads) if grads else None
    detail = "rel err " + ", ".join(f"{name} {e:.2g}" for name, e in errs.items())
    row["notes"] = "; ".join(x for x in (row.get("notes"), detail) if x)
    bad = [f"{name} rel_err={e:.3g} > {H.REL_ERR_MAX if name == first else H.GRAD_REL_ERR_MAX:g}" for name, e in errs.items()
           if not e <= (H.REL_ERR_MAX if name == first else H.GRAD_REL_ERR_MAX)]
    if bad:
        row["error"] = f"WRONG: {', '.join(bad)}; not timed"
        return False
    return True


def bwd_row(bench: str, backend: str, spec, notes: str | None, recompute: bool | None) -> dict:
    return H.make_row(bench, backend, spec, notes=notes, recompute=recompute)


def run_torch_bwd(ctx: Ctx, bench: str, backend: str, spec, fwd, fwd_bwd, refs: dict, *, canon, notes: str | None = None,
                  recompute: bool | None = None) -> dict:
    """A torch forward + backward row: ``canon(fwd_bwd())`` (a dict like ``refs``) checked (:func:`judge_grads`),
    then its memory (:func:`harness.torch_memory_mib`: the peak of one ``fwd_bwd()``, what one ``fwd()`` holds;
    ``ctx.torch_mem_stats`` the counters), the time of ``fwd_bwd()`` (median_ms) and ``fwd()``'s (fwd_ms). Adds the row.
    On a CPU (``--tiny``: kernels interpreted, times meaningless) one timed call each, so the smoke test stays short."""
    row = bwd_row(bench, backend, spec, notes, recompute)
    timing = dict(warmup_ms=ctx.args.warmup_ms, rep_ms=ctx.args.rep_ms, cpu_loops=1)
    try:
        out, compile_s = H.torch_first_call(fwd_bwd, ctx.torch_dev)
        row["compile_s"] = compile_s
        ok = judge_grads(row, canon(out), refs)
        del out  # not held while timing
        if ok:
            row.update(H.torch_memory_mib(fwd, fwd_bwd, ctx.torch_dev, stats=ctx.torch_mem_stats))
            row.update(H.time_torch(fwd_bwd, ctx.torch_dev, **timing))
            H.add_rates(row, spec.flops, spec.min_bytes, spec.dtype)
            f = H.time_torch(fwd, ctx.torch_dev, **timing)
            H.add_bwd_rates(row, f["median_ms"], spec.bwd_flops)
    except Exception as exc:  # one backend's failure must not stop the run
        row["error"] = short_error(exc)
        if ctx.args.verbose:
            traceback.print_exc()
    ctx.add(row)
    return row


def run_jax_bwd(ctx: Ctx, bench: str, backend: str, spec, fwd, fwd_bwd, args: tuple, d_out, refs: dict, *, canon,
                notes: str | None = None, recompute: bool | None = None, wrt: tuple[int, ...] | None = None) -> dict:
    """A JAX forward + backward row: ``fwd_bwd(*args, d_out)`` jitted, its memory analysis taken (this row's
    compiled program: :func:`harness.jax_memory_mib`) and what ``jax.vjp`` of ``fwd`` in the ``wrt``
    positions of ``args`` holds for the backward (:func:`harness.jax_held_mib`), its output
    (``canon``: a dict like ``refs``) checked (:func:`judge_grads`), then timed (median_ms), and ``fwd(*args)``
    jitted and timed (fwd_ms). Adds the row. Compiled programs are cached by backend, static config and
    argument shapes, ``fwd_bwd`` also by ``recompute`` (the forward alone does not depend on it: it only
    changes what the VJP keeps, so the two rows of a backend share the forward's program)."""
    import jax

    row = bwd_row(bench, backend, spec, notes, recompute)
    base = backend.removesuffix("-recompute")
    key = (base, "bwd", spec_key(spec), sig(args))
    try:
        compiled, compile_s = H.jax_compile(fwd_bwd, *args, d_out, cache=ctx.jit_cache,
                                            key=key + (f"fwd_bwd recompute={recompute}",))
        row["compile_s"] = compile_s
        row["peak_mem_mib"], row["mem_method"] = H.jax_memory_mib(compiled)  # known even if the run fails (OOM)
        row["held_mib"] = H.jax_held_mib(fwd, args, wrt)
        out = compiled(*args, d_out)
        jax.block_until_ready(out)
        ok = judge_grads(row, canon(out), refs)
        del out
        if ok:
            timing = H.time_jax(compiled, (*args, d_out), rep_ms=ctx.args.rep_ms)
            tnote = timing.pop("notes", None)
            row.update(timing)
            H.add_rates(row, spec.flops, spec.min_bytes, spec.dtype)
            compiled_f, compile_f = H.jax_compile(fwd, *args, cache=ctx.jit_cache, key=key + ("fwd",))  # any recompute
            row["compile_s"] = compile_s + compile_f
            f = H.time_jax(compiled_f, args, rep_ms=ctx.args.rep_ms)
            tnote = "; ".join(x for x in (tnote, f.get("notes") and "forward: " + f["notes"]) if x)
            if tnote:
                row["notes"] = "; ".join(x for x in (row.get("notes"), tnote) if x)
            H.add_bwd_rates(row, f["median_ms"], spec.bwd_flops)
    except Exception as exc:
        row["error"] = short_error(exc)
        if ctx.args.verbose:
            traceback.print_exc()
    ctx.add(row)
    return row


def skip_row(ctx: Ctx, bench: str, backend: str, spec, reason: str, notes: str | None = None,
             recompute: bool | None = None) -> None:
    """A row that does not run on this machine by design, with its reason (``harness.SKIPPED``)."""
    row = bwd_row(bench, backend, spec, notes, recompute)
    row["error"] = H.SKIPPED + reason
    ctx.add(row)


def mosaic_gpu_missing() -> str | None:
    """Why ``pallas_mosaic_gpu`` cannot run here (None on a GPU): Mosaic GPU kernels need a Hopper GPU."""
    import jax

    backend = jax.default_backend()
    return None if backend == "gpu" else f"pallas_mosaic_gpu needs a Hopper GPU; the JAX backend is {backend}"


def gemm_grad_reference(x, w, d_y, expert_offsets) -> dict:
    """The grouped GEMM's output and gradients in float32, one plain torch matmul per expert (CONTRACT.md
    sections 4 and 8; independent of every backend benchmarked): ``{"y" [M, N], "d_x" [M, K], "d_w" [E, N, K]}``."""
    import torch

    M, K = x.shape
    E, N, _ = w.shape
    f32 = torch.float32
    y = torch.zeros(M, N, dtype=f32, device=x.device)
    d_x = torch.zeros(M, K, dtype=f32, device=x.device)
    d_w = torch.zeros(E, N, K, dtype=f32, device=x.device)
    offs = expert_offsets.tolist()
    for e in range(E):
        s, t = offs[e], offs[e + 1]
        if t <= s:
            continue
        xe, we, dye = x[s:t].to(f32), w[e].to(f32), d_y[s:t].to(f32)
        y[s:t], d_x[s:t], d_w[e] = xe @ we.T, dye @ we, dye.T @ xe
    return {"y": y, "d_x": d_x, "d_w": d_w}


def bench_gemm_bwd(ctx: Ctx, spec: S.GemmBwdSpec, wcache: GemmWeights) -> None:
    """Grouped GEMM forward + backward (``d_x`` and ``d_w``) of every backend, bf16, ``d_y ~ N(0, 1)``: ours
    (``grouped_gemm`` under autograd / ``jax.vjp``, its backward ``grouped_gemm_dgrad`` +
    ``grouped_gemm_wgrad`` of the same backend), the references, and the peers ``torch._grouped_mm``
    (autograd), tokamax ``ragged_dot`` (``jax.vjp``), ``jax.lax.ragged_dot`` (``jax.vjp``, XLA). Judged
    against :func:`gemm_grad_reference`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import moe_pallas
    import moe_torch

    dev, bf16 = ctx.torch_dev, torch.bfloat16
    w = gemm_weights(ctx, spec, wcache).w  # [E, N, K] bf16
    g = torch.Generator(device=dev).manual_seed(spec.seed)
    x = torch.randn(spec.M, spec.K, generator=g, device=dev).to(bf16)
    d_y = torch.randn(spec.M, spec.N, generator=g, device=dev).to(bf16)
    offs = torch.from_numpy(spec.expert_offsets()).to(dev)  # [E + 1] int32
    refs = gemm_grad_reference(x, w, d_y, offs)
    names = ("y", "d_x", "d_w")
    canon = lambda o: dict(zip(names, (o[0], *o[1])))  # (y, (d_x, d_w)) -> the refs' names  # noqa: E731
    bench = "gemm_bwd"
    note = l2_note(ctx, spec)

    # ours and the references, torch: grouped_gemm under autograd
    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()  # leaves sharing x's and w's memory
    for impl, name in (("triton", "ours-torch-triton"), ("reference", "ref-torch")):
        if ctx.wants(name):
            fwd = functools.partial(moe_torch.grouped_gemm, xl, wl, offs, implementation=impl)

            def fwd_bwd(fwd=fwd):
                y = fwd()
                return y, torch.autograd.grad(y, (xl, wl), d_y)

            run_torch_bwd(ctx, bench, name, spec, fwd, fwd_bwd, refs, canon=canon, notes=note)

    # peer, torch: torch._grouped_mm autograd on our [E, N, K] weights as the column-major [E, K, N] view
    if ctx.wants("torch._grouped_mm"):
        ends = offs[1:].contiguous()

        def gmm():
            return torch._grouped_mm(xl, wl.transpose(1, 2), offs=ends, out_dtype=bf16)

        def gmm_bwd():
            y = gmm()
            return y, torch.autograd.grad(y, (xl, wl), d_y)

        run_torch_bwd(ctx, bench, "torch._grouped_mm", spec, gmm, gmm_bwd, refs, canon=canon,
                      notes="; ".join(x for x in (note, "autograd; weights as the [E, K, N] view of ours (no copy)") if x))

    # ours and the reference, JAX: grouped_gemm under jax.vjp
    jx, jw, joffs, jdy = j(x), j(w), j(offs), j(d_y)
    for impl, name in (("pallas_triton", "ours-jax-pallas_triton"), ("pallas_mosaic_gpu", "ours-jax-pallas_mosaic_gpu"),
                       ("reference", "ref-jax")):
        if not ctx.wants(name):
            continue
        inote = note
        if impl == "pallas_mosaic_gpu" and mosaic_gpu_missing():
            skip_row(ctx, bench, name, spec, mosaic_gpu_missing(), notes=inote)
            continue

        def fwd(x_, w_, o_, impl=impl):
            return moe_pallas.grouped_gemm(x_, w_, o_, implementation=impl)

        def fwd_bwd(x_, w_, o_, d_, fwd=fwd):
            y, vjp = jax.vjp(lambda a, b: fwd(a, b, o_), x_, w_)
            return y, vjp(d_)

        run_jax_bwd(ctx, bench, name, spec, fwd, fwd_bwd, (jx, jw, joffs), jdy, refs, canon=canon, notes=inote, wrt=(0, 1))

    # peers, JAX: ragged_dot's own layout, rhs [E, K, N] (a transposed copy of ours made once, outside the timing)
    if not (tokamax_wanted(ctx) or ctx.wants("jax.lax.ragged_dot")):
        return
    jgs = jnp.asarray(spec.group_sizes().astype(np.int32))  # [E] rows per expert
    jw_kn = jax.block_until_ready(jnp.swapaxes(jw, 1, 2))  # [E, K, N]
    canon_kn = lambda o: {"y": o[0], "d_x": o[1][0], "d_w": torch.from_dlpack(o[1][1]).transpose(1, 2)}  # noqa: E731
    pnote = "; ".join(x for x in (note, "jax.vjp; rhs [E, K, N] (its layout; transposed once, untimed)") if x)
    peers = []
    if ctx.wants("jax.lax.ragged_dot"):
        peers.append(("jax.lax.ragged_dot", lambda a, b, gs: jax.lax.ragged_dot(a, b, gs), None))
    peers += tokamax_ragged_dots(ctx, bench, spec, pnote)
    for name, rd, extra in peers:

        def fwd_bwd(a, b, gs, d_, rd=rd):
            y, vjp = jax.vjp(lambda a_, b_: rd(a_, b_, gs), a, b)
            return y, vjp(d_)

        run_jax_bwd(ctx, bench, name, spec, rd, fwd_bwd, (jx, jw_kn, jgs), jdy, refs, canon=canon_kn,
                    notes="; ".join(x for x in (pnote, extra) if x), wrt=(0, 1))
    del jw_kn


def layer_grad_reference(spec: S.LayerSpec, config, x, gate_w, bias, w13, w2, d_out) -> tuple[dict, dict]:
    """The layer's output and gradients from our torch reference (``moe_forward(implementation="reference")``
    under autograd) on the logits of the spec's router (:func:`router_logits`), that router included:
    ``(ours, hf)``. ``ours``: ``out``, ``d_x`` (through the experts only: our layer takes the logits as an
    input), ``d_router_logits``, ``d_w13``, ``d_w2``. ``hf`` (transformers' block computes the logits from
    ``x`` itself): ``out``, ``d_x`` (both paths, float32 sum), ``d_gate_weight``, ``d_w13``, ``d_w2``."""
    import torch

    import moe_torch

    x_m, x_r = x.detach().requires_grad_(), x.detach().requires_grad_()
    gw = gate_w.detach().requires_grad_()
    w13l, w2l = w13.detach().requires_grad_(), w2.detach().requires_grad_()
    logits = router_logits(spec.arch, x_r, gw)
    out = moe_torch.moe_forward(x_m, logits, w13l, w2l, config, e_score_correction_bias=bias, implementation="reference")
    d_xm, d_logits, d_w13, d_w2, d_xr, d_gw = torch.autograd.grad(out, (x_m, logits, w13l, w2l, x_r, gw), d_out)
    out = out.detach()
    ours = {"out": out, "d_x": d_xm, "d_router_logits": d_logits, "d_w13": d_w13, "d_w2": d_w2}
    hf = {"out": out, "d_x": d_xm.float() + d_xr.float(), "d_gate_weight": d_gw, "d_w13": d_w13, "d_w2": d_w2}
    return ours, hf


def bench_layer_bwd(ctx: Ctx, spec: S.LayerBwdSpec, wcache: dict) -> None:
    """The layer forward + backward (gradients of ``x``, ``router_logits``, ``w13``, ``w2``) of every backend with
    ``recompute`` False and True (``-recompute`` rows), bf16, ``d_out ~ N(0, 1)``, and the peer transformers'
    block (grouped_mm experts: its router, experts and their weights' gradients). Judged against
    :func:`layer_grad_reference`."""
    import jax
    import torch

    import moe_pallas
    import moe_torch

    dev, bf16 = ctx.torch_dev, torch.bfloat16
    config = spec.config()
    key = (spec.model, spec.E, spec.H, spec.I, spec.quant, getattr(spec, "ep_size", 1))
    if wcache.get("key") != key:
        wcache.clear()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        wcache.update(key=key, w=layer_weights(ctx, spec, config), router=layer_router(ctx, spec, config))
    w13, _, w2, _ = wcache["w"]
    gate_w, bias = wcache["router"]
    g = torch.Generator(device=dev).manual_seed(spec.seed)
    x = torch.randn(spec.T, spec.H, generator=g, device=dev).to(bf16)
    d_out = torch.randn(spec.T, spec.H, generator=g, device=dev).to(bf16)
    with torch.no_grad():
        logits = router_logits(spec.arch, x, gate_w)
    refs, refs_hf = layer_grad_reference(spec, config, x, gate_w, bias, w13, w2, d_out)
    names = tuple(refs)  # out, d_x, d_router_logits, d_w13, d_w2
    canon = lambda o: dict(zip(names, (o[0], *o[1])))  # (out, (d_x, d_logits, d_w13, d_w2))  # noqa: E731
    bench, note = "layer_bwd", l2_note(ctx, spec)
    rc_note = lambda rc: "recompute=True: h recomputed in the backward (one more GEMM 1)" if rc else None  # noqa: E731

    xl, ll = x.detach().requires_grad_(), logits.detach().requires_grad_()
    w13l, w2l = w13.detach().requires_grad_(), w2.detach().requires_grad_()
    for impl, base in (("triton", "ours-torch-triton"), ("reference", "ref-torch")):
        for rc in (False, True):
            name = base + ("-recompute" if rc else "")
            if not ctx.wants(name):
                continue
            fwd = functools.partial(moe_torch.moe_forward, xl, ll, w13l, w2l, config, e_score_correction_bias=bias,
                                    implementation=impl, recompute=rc)

            def fwd_bwd(fwd=fwd):
                out = fwd()
                return out, torch.autograd.grad(out, (xl, ll, w13l, w2l), d_out)

            run_torch_bwd(ctx, bench, name, spec, fwd, fwd_bwd, refs, canon=canon, recompute=rc,
                          notes="; ".join(x for x in (note, rc_note(rc)) if x) or None)

    jargs, jd = (j(x), j(logits), j(w13), j(w2), j(bias)), j(d_out)
    for impl, base in (("pallas_triton", "ours-jax-pallas_triton"), ("pallas_mosaic_gpu", "ours-jax-pallas_mosaic_gpu"),
                       ("reference", "ref-jax")):
        for rc in (False, True):
            name = base + ("-recompute" if rc else "")
            if not ctx.wants(name):
                continue
            inote = "; ".join(x for x in (note, rc_note(rc), "GEMMs on Mosaic GPU, the other stages pallas_triton"
                                          if impl == "pallas_mosaic_gpu" else None) if x) or None
            if impl == "pallas_mosaic_gpu" and mosaic_gpu_missing():
                skip_row(ctx, bench, name, spec, mosaic_gpu_missing(), notes=inote, recompute=rc)
                continue

            def fwd(x_, l_, w13_, w2_, b_, impl=impl, rc=rc):
                return moe_pallas.moe_forward(x_, l_, w13_, w2_, config, e_score_correction_bias=b_, implementation=impl,
                                              recompute=rc)

            def fwd_bwd(x_, l_, w13_, w2_, b_, d_, fwd=fwd):
                out, vjp = jax.vjp(lambda a, l, p, q: fwd(a, l, p, q, b_), x_, l_, w13_, w2_)
                return out, vjp(d_)

            run_jax_bwd(ctx, bench, name, spec, fwd, fwd_bwd, jargs, jd, refs, canon=canon, notes=inote, recompute=rc,
                        wrt=(0, 1, 2, 3))
    del jargs, jd
    bench_layer_bwd_transformers(ctx, spec, x, d_out, (w13, w2, gate_w, bias), refs_hf, note)


def bench_layer_bwd_transformers(ctx: Ctx, spec: S.LayerBwdSpec, x, d_out, weights: tuple, refs: dict,
                                 note: str | None) -> None:
    """transformers' block of the spec's model (:func:`build_hf_block`, grouped_mm experts) forward and forward +
    backward: gradients of ``x`` (its router's path included), its router weight and its experts' weights (the
    shared experts' mapped back into ``w13`` / ``w2``), judged against the reference with that router."""
    import torch

    if spec.arch is None:
        if ctx.wants("transformers"):
            skip_row(ctx, "layer_bwd", "transformers", spec, f"no transformers block for routing {spec.config().routing!r}")
        return
    name = f"transformers-{S.HF_BLOCKS[spec.arch]}"
    if not ctx.wants(name):
        return
    hnote = "; ".join(x for x in (note, "experts_implementation=grouped_mm; autograd; its router (matmul and gradient) "
                                  "included; d_x through router and experts") if x)
    w13, w2, gate_w, bias = weights
    config = spec.config()
    E, I, Sh = config.num_experts, config.intermediate_size, config.num_fused_shared_experts
    try:
        block = build_hf_block(config, w13, w2, gate_w, "grouped_mm", arch=spec.arch, e_score_correction_bias=bias)
    except Exception as exc:
        error_row(ctx, "layer_bwd", name, spec, "setup: " + short_error(exc), notes=hnote)
        return
    for p in block.parameters():
        p.requires_grad_(True)  # its weights are ours (shared storage); gradients come from autograd.grad, not .grad
    params = [block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]
    if Sh:
        sh = block.shared_experts
        params += [sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight]
    xl = x.detach().requires_grad_()

    def fwd():
        return block(xl[None])

    def fwd_bwd():
        out = fwd()
        return out, torch.autograd.grad(out, (xl, *params), d_out[None])

    def canon(o):
        out, (d_x, d_gate, d_gu, d_down, *shared) = o
        if shared:  # DeepSeek-V3's shared experts -> our fused experts E .. E + S - 1
            d_g, d_u, d_d = shared
            H_ = d_d.shape[0]
            d_gu = torch.cat([d_gu, torch.cat([d_g.reshape(Sh, I, H_), d_u.reshape(Sh, I, H_)], 1)])
            d_down = torch.cat([d_down, d_d.reshape(H_, Sh, I).permute(1, 0, 2)])
        return {"out": out.reshape(spec.T, spec.H), "d_x": d_x, "d_gate_weight": d_gate, "d_w13": d_gu, "d_w2": d_down}

    run_torch_bwd(ctx, "layer_bwd", name, spec, fwd, fwd_bwd, refs, canon=canon, notes=hnote)
    del block


# ---------------------------------------------------------------------------------------------- gate


def bench_gate(ctx: Ctx, spec: S.GateSpec) -> None:
    import jax
    import torch

    import moe_pallas
    import moe_torch
    from moe_torch.ops.gate.reference import select_experts_reference

    dev = ctx.torch_dev
    c = spec.config()
    kw = dict(topk=c.topk, routing=c.routing, renormalize=c.renormalize, num_expert_group=c.num_expert_group,
              topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor,
              apply_routed_scaling_factor_on_output=c.apply_routed_scaling_factor_on_output,
              num_fused_shared_experts=c.num_fused_shared_experts)
    g = torch.Generator(device=dev).manual_seed(spec.seed)
    n_sets = S.rotation_sets(spec.T * c.num_experts * 4, H.L2_BYTES) if jax.default_backend() == "gpu" else 1
    logit_sets = [torch.randn(spec.T, c.num_experts, generator=g, device=dev) for _ in range(n_sets)]
    logits = logit_sets[0]
    bias = 0.1 * torch.randn(c.num_experts, generator=g, device=dev)
    bias = bias if c.routing == "biased_grouped_topk" else None  # the only routing that takes one

    def dense(out):
        """(weights [T, k] f32, ids [T, k] i32) -> [T, E + S] f32 with the weights at their ids:
        compares selection and weights in one number, independent of slot order."""
        w, i = (o if isinstance(o, torch.Tensor) else torch.from_dlpack(o) for o in out)
        return torch.zeros(w.shape[0], c.num_total_experts, device=w.device).scatter_(1, i.long(), w.float())

    ref = dense(moe_torch.select_experts(logits, e_score_correction_bias=bias, implementation="reference", **kw))
    common = dict(flops=spec.flops, nbytes=spec.min_bytes, dtype="fp32", canon=dense)
    for impl, name in (("triton", "ours-torch-triton"), ("reference", "ref-torch")):
        if ctx.wants(name):
            run_torch(ctx, "gate", name, spec,
                      functools.partial(moe_torch.select_experts, logits, e_score_correction_bias=bias, implementation=impl, **kw),
                      ref, **common)
    if dev.type == "cuda" and ctx.wants("ours-torch-triton-cudagraph"):
        # Replayed from a CUDA graph (how an engine runs it): the eager row's time at this size is mostly
        # Python's launch path. One logit set (the graph's static input; do_bench still flushes L2).
        run_torch_cuda_graph(ctx, "gate", "ours-torch-triton-cudagraph", spec, functools.partial(
            moe_torch.select_experts, logits, e_score_correction_bias=bias, implementation="triton", **kw), ref, common)
    if ctx.wants("ref-torch-compile"):
        try:
            compiled = torch.compile(functools.partial(select_experts_reference, **kw), dynamic=False)
            run_torch(ctx, "gate", "ref-torch-compile", spec, lambda: compiled(logits, e_score_correction_bias=bias), ref,
                      notes="compile_s includes torch.compile", **common)
        except Exception as exc:
            error_row(ctx, "gate", "ref-torch-compile", spec, short_error(exc))
    jbias = j(bias)
    jsets = [(j(lg), jbias) for lg in logit_sets]
    for impl, name in (("pallas_triton", "ours-jax-pallas_triton"), ("reference", "ref-jax")):
        if ctx.wants(name):

            def fn(l_, b_, impl=impl):
                return moe_pallas.select_experts(l_, e_score_correction_bias=b_, implementation=impl, **kw)

            run_jax(ctx, "gate", name, spec, fn, jsets[0], ref, rot_sets=jsets, **common)


# ---------------------------------------------------------------------------------------------- main


def environment() -> dict:
    import platform

    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), argv=sys.argv, python=platform.python_version(),
                tiny=TINY)
    for mod in ("torch", "triton", "jax", "jaxlib"):
        with contextlib.suppress(Exception):
            meta[mod] = __import__(mod).__version__
    with contextlib.suppress(Exception):
        import torch

        meta["torch_device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    with contextlib.suppress(Exception):
        import jax

        meta["jax_devices"] = [str(d) for d in jax.devices()]
    with contextlib.suppress(Exception):
        meta["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=_ROOT,
                                     timeout=5).stdout.strip()
    meta["ceilings"] = dict(bf16_tflops=H.PEAK_BF16_FLOPS / 1e12, fp8_tflops=H.PEAK_FP8_FLOPS / 1e12, copy_tbps=H.PEAK_BW / 1e12)
    meta["EPMOE_PALLAS_FP8_WGMMA"] = os.environ.get("EPMOE_PALLAS_FP8_WGMMA", "")  # moe_pallas.ops.common
    return meta


def spec_wanted(spec, args: argparse.Namespace, quants: bool = True) -> bool:
    """Whether a layer / layer_bwd / decode spec passes ``--layer-quants`` (unless ``quants`` is False: the decode
    rows' quant modes are their own) and ``--ts`` (each empty: everything passes)."""
    if quants and args.layer_quants and spec.quant not in args.layer_quants:
        return False
    return not args.ts or spec.T in args.ts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Writes bench.json / bench.csv / bench.md / bench_gemm.png / bench_layer.png / "
                                       "bench_gate.png to --out.")
    p.add_argument("--what", default=DEFAULT_WHAT, help=f"comma list of {', '.join(WHATS)} (default: {DEFAULT_WHAT}; "
                   "gemm_bwd, layer_bwd: forward + backward, on request)")
    p.add_argument("--quick", action="store_true", help="a small subset (gate_up M in {256, 16384} uniform; layer T=512; gate)")
    default_out = os.path.join("/tmp", "epmoe_bench_tiny") if TINY else os.path.join(_ROOT, "benchmarks", "results")
    p.add_argument("--out", default=os.environ.get("OUT") or default_out,
                   help="output folder (default: $OUT, else benchmarks/results)")
    p.add_argument("--backends", default="", help="comma list of substrings; run only backends whose name contains one "
                                                  "(e.g. 'ours,torch._grouped_mm'); default: all")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up, ms (default 25)")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetitions / JAX iterations target, ms (default 100)")
    p.add_argument("--max-minutes", type=float, default=9.0,
                   help="stop starting new specs after this many minutes (rows written so far are kept; default 9)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a model preset: every spec takes its layer's shapes and routing (GEMMs K=H, N=2I and K=I, N=H "
                        "over its E experts; the layer; the gate), the layer rows its transformers block as the peer "
                        "(default: the built-in E=32 shapes). With --weights: the routing where the checkpoint has no "
                        "config.json")
    p.add_argument("--weights", metavar="PATH", default=None,
                   help="one MoE layer of a Mixtral, Qwen3-MoE, DeepSeek-V3 (Kimi K2, GLM-4.5), Qwen3-Next, Llama 4 or "
                        "gpt-oss safetensors checkpoint (file or folder): "
                        "its shapes and routing for every spec, its weights for the layer rows (an FP8 checkpoint: "
                        "quant none (dequantized) and fp8_block (as stored)); the peer is transformers' block of "
                        "that model")
    p.add_argument("--layer", type=int, default=None, help="with --weights: the layer index (default: the first MoE layer)")
    p.add_argument("--gemm-dtypes", default="", help=f"comma list of {', '.join(S.GEMM_DTYPES)}: only these gemm specs "
                   "(default: all of the run's)")
    p.add_argument("--layer-quants", default="", help=f"comma list of {', '.join(S.BENCH_QUANTS)}: only the layer / "
                   "layer_bwd rows of these quant modes (default: all of the run's; e.g. fp8_block, the last ones a "
                   "--max-minutes limit would cut)")
    p.add_argument("--ts", default="", help="comma list of token counts T: the layer / layer_bwd / decode rows "
                   "at these T instead of the run's (any T, e.g. 256; default: the run's)")
    p.add_argument("--ms", default="", help="comma list of row counts M: only the gemm / gemm_bwd rows of these M "
                   "(default: all of the run's)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing rows")
    p.add_argument("--tiny", action="store_true",
                   help="the CPU smoke test: tiny shapes, our Triton and Pallas-Triton kernels interpreted, one timed "
                        "call per row (times meaningless), GPU-only backends skipped; with --preset tiny or --weights "
                        "of a tiny checkpoint")
    args = p.parse_args(argv)
    if args.layer is not None and not args.weights:
        p.error("--layer needs --weights (it picks a layer of the checkpoint)")
    args.layer_quants = [q for q in args.layer_quants.split(",") if q]
    if [q for q in args.layer_quants if q not in S.BENCH_QUANTS]:
        p.error(f"--layer-quants: unknown {[q for q in args.layer_quants if q not in S.BENCH_QUANTS]}; choose from "
                f"{S.BENCH_QUANTS}")
    try:
        args.ts = [int(t) for t in args.ts.split(",") if t.strip()]
    except ValueError:
        p.error(f"--ts: a comma list of positive integers; got {args.ts!r}")
    if [t for t in args.ts if t < 1]:
        p.error(f"--ts: token counts must be >= 1; got {args.ts}")
    try:
        args.ms = [int(m) for m in args.ms.split(",") if m.strip()]
    except ValueError:
        p.error(f"--ms: a comma list of positive integers; got {args.ms!r}")
    args.gemm_dtypes = [d for d in args.gemm_dtypes.split(",") if d]
    if [d for d in args.gemm_dtypes if d not in S.GEMM_DTYPES]:
        p.error(f"--gemm-dtypes: unknown {[d for d in args.gemm_dtypes if d not in S.GEMM_DTYPES]}; choose from "
                f"{S.GEMM_DTYPES}")
    args.what = [w for w in args.what.split(",") if w]
    bad = [w for w in args.what if w not in WHATS]
    if bad:
        p.error(f"--what: unknown {bad}; choose from {WHATS}")
    return args


def load_model(args) -> tuple[S.BenchModel | None, dict | None]:
    """``--preset`` / ``--weights`` -> ``(the BenchModel, the checkpoint layer's tensors or None)``;
    ``(None, None)`` for the built-in shapes. The checkpoint's tensors are
    ``interop.checkpoints.load_moe_layer(path).arrays("torch")`` (``w13, w2, w13_scale, w2_scale,
    router_weight, e_score_correction_bias``: all experts, FP8 as codes and scales), its name
    ``ckpt-<model_type>-L<layer>``; the routing comes from its config.json, else from ``--preset``.

    Raises: ValueError / FileNotFoundError / OSError from the loader (no file, no MoE layer, a missing key,
    no routing: no config.json and no --preset).
    """
    if args.weights:
        from interop.checkpoints import load_moe_layer

        ckpt = load_moe_layer(args.weights, layer=args.layer)
        if args.preset and ckpt.routing is not None:  # said, not dropped silently (as epmoe check says it)
            print(f"bench: --preset {args.preset} not used: the routing comes from {ckpt.config_path}", file=sys.stderr)
        config = ckpt.config(get_preset(args.preset) if args.preset else None, quant="none")
        arrays = ckpt.arrays("torch")  # all experts, the checkpoint's dtype (FP8 / MXFP4: codes and scales)
        arrays["format"] = "fp8_block" if ckpt.is_fp8 else "mxfp4" if ckpt.is_mxfp4 else None
        quants = ("none", arrays["format"]) if arrays["format"] else S.layer_quants(config)  # those its sizes allow
        model = S.BenchModel(name=f"ckpt-{ckpt.arch}-L{ckpt.layer}", config=config, arch=ckpt.arch, quants=quants,
                             weights=True)
        return model, arrays
    if args.preset:
        return S.preset_model(args.preset), None
    return None, None


def main(argv=None) -> int:
    args = parse_args(argv)
    if TINY and args.preset and not args.weights:  # refuse before any work: the interpreters would take hours
        n = S.preset_model(args.preset).weight_elements
        if n > TINY_MAX_WEIGHT_ELEMENTS:
            print(f"bench: --tiny runs the kernels interpreted on the CPU; preset {args.preset} has {n / 1e6:.0f}M weight "
                  f"elements (at most {TINY_MAX_WEIGHT_ELEMENTS / 1e6:.1f}M here: --preset tiny); run it on a GPU",
                  file=sys.stderr)
            return 2
    try:
        model, ckpt = load_model(args)
    except (ValueError, FileNotFoundError, KeyError, OSError) as exc:
        print(f"bench: --weights {args.weights}: {exc}", file=sys.stderr)
        return 2
    if TINY and model is not None and model.weight_elements > TINY_MAX_WEIGHT_ELEMENTS:
        print(f"bench: --tiny runs the kernels interpreted on the CPU; {model.name} has {model.weight_elements / 1e6:.0f}M "
              f"weight elements (at most {TINY_MAX_WEIGHT_ELEMENTS / 1e6:.1f}M here); run it on a GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    ctx = Ctx(args, model, ckpt)
    ctx.meta = environment()
    if model is not None:
        ctx.meta.update(model=model.name, model_config=repr(model.config), hf_block=S.HF_BLOCKS.get(model.arch),
                        weights=os.path.abspath(args.weights) if args.weights else None)
    print(f"bench: {ctx.meta.get('torch_device')} / jax {ctx.meta.get('jax_devices')}; out={args.out}; what={args.what}"
          + (f"; model {model.name} (E={model.config.num_experts} topk={model.config.topk} H={model.config.hidden_size} "
             f"I={model.config.intermediate_size} {model.config.routing} shared={model.config.num_fused_shared_experts}"
             f"{', weights from ' + args.weights if args.weights else ''})" if model else "")
          + f"{' (quick)' if args.quick else ''}{' (tiny, CPU interpreters)' if TINY else ''}", flush=True)
    # TINY: Triton runs interpreted; moe_torch makes the interpreter's casts and dots exact itself
    # (moe_torch/ops/triton_interpret.py), so nothing is patched here.
    patch = contextlib.nullcontext()
    plan = []
    if "gemm" in args.what:
        plan += [("gemm", s) for s in S.gemm_specs(args.quick, TINY, model)
                 if (not args.gemm_dtypes or s.dtype in args.gemm_dtypes) and (not args.ms or s.M in args.ms)]
    if "layer" in args.what:
        plan += [("layer", s) for s in S.layer_specs(args.quick, TINY, model, ts=args.ts) if spec_wanted(s, args)]
    if "gate" in args.what:
        plan += [("gate", s) for s in S.gate_specs(args.quick, TINY, model)]
    if "gemm_bwd" in args.what:
        plan += [("gemm_bwd", s) for s in S.gemm_bwd_specs(args.quick, TINY, model) if not args.ms or s.M in args.ms]
    if "layer_bwd" in args.what:
        plan += [("layer_bwd", s) for s in S.layer_bwd_specs(args.quick, TINY, model, ts=args.ts) if spec_wanted(s, args)]
    if "decode" in args.what:
        plan += [("decode", s) for s in S.decode_specs(args.quick, TINY, model, ts=args.ts)
                 if spec_wanted(s, args, quants=False)]
    gemm_w, layer_w = GemmWeights(), {}
    with patch:
        for bench, spec in plan:
            if ctx.over_budget():
                error_row(ctx, bench, "*", spec, f"skipped: over --max-minutes={args.max_minutes}")
                continue
            try:
                if bench in ("gemm", "gemm_bwd"):
                    layer_w.clear()
                    (bench_gemm if bench == "gemm" else bench_gemm_bwd)(ctx, spec, gemm_w)
                elif bench in ("layer", "layer_bwd", "decode"):
                    gemm_w.key = gemm_w.w = gemm_w.wq = gemm_w.ws = None
                    (bench_layer_bwd if bench == "layer_bwd" else bench_layer)(ctx, spec, layer_w)
                else:
                    gemm_w.key = gemm_w.w = gemm_w.wq = gemm_w.ws = None
                    layer_w.clear()
                    bench_gate(ctx, spec)
            except Exception as exc:  # set-up failure (inputs, reference): one row says so, the run goes on
                error_row(ctx, bench, "*", spec, "setup: " + short_error(exc))
                if args.verbose:
                    traceback.print_exc()
    rows = ctx.rows
    if args.backends and not rows:
        print(f"bench: --backends {args.backends!r} matched no backend of {args.what}", file=sys.stderr)
        return 2
    ctx.meta["runtime_s"] = round(ctx.elapsed(), 1)
    H.write_json(rows, os.path.join(args.out, "bench.json"), ctx.meta)
    H.write_csv(rows, os.path.join(args.out, "bench.csv"))
    pivot = H.markdown_pivot(rows, cpu=ctx.cpu)
    bwd = H.markdown_bwd(rows, cpu=ctx.cpu)
    bwd = f"## Forward + backward\n\n{bwd}\n\n" if bwd else ""
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(f"# bench {ctx.meta['date']} on {ctx.meta.get('torch_device')}"
                + (f" ({H.CPU_NOTE})" if ctx.cpu else "") + (f", model {model.name}" if model else "")
                + f"\n\n{pivot}\n\n{bwd}## All rows\n\n{H.markdown_long(rows, cpu=ctx.cpu)}\n")
    plotted = []
    for name, plot in (("bench_gemm.png", H.plot_gemm), ("bench_layer.png", H.plot_layer), ("bench_gate.png", H.plot_gate)):
        try:
            if plot(rows, os.path.join(args.out, name), cpu=ctx.cpu):
                plotted.append(name)
        except Exception as exc:
            print(f"plot {name} failed: {short_error(exc)}")
    errs: dict = {}
    for r in rows:
        if r.get("error") and not H.skipped(r):
            errs.setdefault((r["bench"], r["backend"]), []).append(r)
    if errs:
        print("\nerrors (per backend: how many rows, the first message; all in bench.md):")
        for (bench, backend), rs in errs.items():
            print(f"  {bench} {backend}: {len(rs)}x, e.g. {rs[0]['spec']}: {str(rs[0]['error'])[:400]}")
    print(f"\n{H.stats_line(rows)} in {ctx.elapsed():.0f} s; wrote {args.out}/bench.{{json,csv,md}}"
          + (f" and {', '.join(plotted)}" if plotted else ""))
    skips = {(r["bench"], r["backend"]): r["error"] for r in rows if H.skipped(r)}
    if skips:
        print("\nskipped (not on this machine):")
        for (bench, backend), why in skips.items():
            print(f"  {bench} {backend}: {why[len(H.SKIPPED):]}")  # whole: the reasons are written to be read
    print("\n" + pivot)
    if bwd:
        print("\n" + bwd)
    return 1 if any(str(r.get("error") or "").startswith("WRONG") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
