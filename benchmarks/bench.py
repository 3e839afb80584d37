"""The benchmark run: grouped GEMM, MoE layer and gate, our backends against peers and a
speed-of-light stand-in, every row checked against a reference before it is timed.

Usage (on the GPU machine, from the repo root; nothing to install there)::

    PYTHONPATH=. python3 benchmarks/bench.py                 # everything (~6 min on one H200)
    PYTHONPATH=. python3 benchmarks/bench.py --quick         # a small subset (< 2 min)
    PYTHONPATH=. python3 benchmarks/bench.py --what gemm --backends ours,torch._grouped_mm

Writes ``bench.json``, ``bench.csv`` (one row per (spec, backend), schema
``benchmarks/harness.py: ROW_KEYS``; rewritten after every row, so a killed run keeps what it
had), ``bench.md`` (every row), ``bench_gemm.png`` (time vs M) and ``bench_layer.png`` (time vs T) to ``--out`` (default ``$OUT``,
else ``benchmarks/results``), and prints the short table last.

Backends (a backend that cannot run gives a row with ``error``, and the run goes on):

- gemm: ``ours-torch-triton`` (``moe_torch.grouped_gemm(implementation="triton")``),
  ``ours-jax-pallas_triton`` and ``ours-jax-pallas_mosaic_gpu`` (``moe_pallas.grouped_gemm``,
  jitted), ``torch._grouped_mm`` (bf16), ``torch._scaled_grouped_mm`` (fp8 rowwise),
  ``jax.lax.ragged_dot`` (bf16, as ``ragged_dot_general`` on our ``[E, N, K]`` weights),
  ``jax-ragged_dot_mgpu`` (bf16, jax's Pallas Mosaic GPU kernel, best of a few tile configs) and
  ``sol-torch.bmm`` (bf16 ``[E, M/E, K] x [E, K, N]``, uniform routing only: the same FLOPs and
  weight bytes as an even split, the speed-of-light stand-in).
- layer: ``ours-torch-triton``, ``ours-jax-pallas_triton`` (jit, config static),
  ``ours-jax-pallas_mosaic_gpu`` (its grouped GEMMs on Mosaic GPU, the other stages pallas_triton),
  ``ref-torch``, ``ref-jax`` (the references; jnp jitted); and (``quant='none'`` only) the peer
  ``transformers-Qwen3MoeSparseMoeBlock`` (transformers' own block for this layer: softmax top-k,
  ``norm_topk_prob=True``, our ``w13`` / ``w2`` as its ``experts.gate_up_proj`` / ``down_proj``,
  experts implementation ``grouped_mm`` as ``from_pretrained`` picks it where it can dispatch,
  else ``eager``) and ``transformers-Qwen3MoeSparseMoeBlock-eager`` (the per-expert loop). Its
  router computes the logits from ``x`` with its own ``gate.weight`` (bf16 on the GPU), so its
  row is checked against our torch reference on those same logits, and its time includes that
  ``[T, H] x [H, E]`` router matmul (negligible next to the experts).
- gate: ``ours-torch-triton`` (eager, and ``ours-torch-triton-cudagraph``: replayed from a CUDA
  graph), ``ours-jax-pallas_triton``, ``ref-torch``, ``ref-torch-compile`` (``torch.compile`` of the
  torch reference), ``ref-jax``.

Inputs are drawn in torch on the device (bf16, ``x ~ N(0, 1)``, ``w ~ N(0, 1/K)``) and handed
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
import datetime  # noqa: E402
import functools  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

from benchmarks import harness as H  # noqa: E402
from benchmarks import specs as S  # noqa: E402

WHATS = ("gemm", "layer", "gate")
#: Tile configs tried for jax's ragged_dot_mgpu: (block_m, block_n, block_k, max_concurrent_steps,
#: grid_block_n); the first four are those of ENVIRONMENT.md's peer table plus one wider N tile.
MGPU_CONFIGS = ((128, 128, 64, 4, 1), (128, 256, 64, 4, 1), (64, 128, 64, 4, 2), (128, 128, 64, 5, 4))
MGPU_CONFIGS_QUICK = MGPU_CONFIGS[:2]
#: Group rows are padded to this many if torch's grouped GEMMs reject unaligned groups (torch
#: 2.11 should not need it: pytorch/pytorch#155466 lifted the dynamic-dimension check).
PEER_ROW_ALIGN = 16


class Ctx:
    """What every bench function needs: devices, options, the rows so far, the caches."""

    def __init__(self, args):
        import torch

        self.args = args
        self.torch_dev = torch.device("cuda" if torch.cuda.is_available() and not TINY else "cpu")
        self.rows: list[dict] = []
        self.jit_cache: dict = {}
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
    if r.get("error"):
        return f"{head} ERROR {str(r['error'])[:200]}"
    t = f"{r['median_ms']:.4f} ms [{r['p20_ms']:.4f}, {r['p80_ms']:.4f}]" if r.get("median_ms") else "-"
    rates = "".join([f" {r['tflops']:.0f} TFLOP/s" if r.get("tflops") else "",
                     f" {r['gbps']:.0f} GB/s" if r.get("gbps") else "",
                     f" {r['pct_of_ceiling']:.0f}% ({r['bound']})" if r.get("pct_of_ceiling") else ""])
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
    out, ref = out.to(ref.device).double(), ref.double()
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


def judge(row: dict, out, ref) -> bool:
    """The correctness gate of every row: ``rel_err`` of ``out`` against ``ref`` into the row; a wrong
    result is marked WRONG and must not be timed (returns False)."""
    err = rel_err_t(out, ref)
    row["rel_err"] = err
    if not err <= H.REL_ERR_MAX:
        row["error"] = f"WRONG: rel_err={err:.3g} > {H.REL_ERR_MAX:g}; not timed"
        return False
    return True


def run_torch(ctx: Ctx, bench: str, backend: str, spec, fn, ref, *, flops: float, nbytes: float, dtype: str,
              canon=lambda o: o, notes: str | None = None, add: bool = True) -> dict:
    """Check ``canon(fn())`` against ``ref``, then time ``fn``; adds one row (unless ``add=False``) and returns it."""
    row = H.make_row(bench, backend, spec, notes=notes)
    try:
        out, compile_s = H.torch_first_call(fn, ctx.torch_dev)
        row["compile_s"] = compile_s
        ok = judge(row, canon(out), ref)
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
    if spec.dtype == "fp8":
        cache.wq, cache.ws = moe_torch.quantize_weight_fp8(w, "per_channel")  # [E, N, K] e4m3, [E, N] f32
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
    fp8 = spec.dtype == "fp8"
    W = gemm_weights(ctx, spec, wcache)
    g = torch.Generator(device=dev).manual_seed(spec.seed)
    x = torch.randn(spec.M, spec.K, generator=g, device=dev).to(bf16)
    sizes = spec.group_sizes()
    offs = torch.from_numpy(spec.expert_offsets()).to(dev)  # [E + 1] int32, the contract's offsets
    ends = offs[1:].contiguous()  # [E] int32 cumulative ends, torch's `offs`
    if fp8:
        xq, xs = moe_torch.per_token_quant_fp8(x)  # [M, K] e4m3, [M, 1] f32
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
    for impl in ("pallas_triton", "pallas_mosaic_gpu"):
        name = f"ours-jax-{impl}"
        if not ctx.wants(name):
            continue

        def fn(x_, w_, o_, xs_, ws_, impl=impl):
            return moe_pallas.grouped_gemm(x_, w_, o_, x_scale=xs_, w_scale=ws_, out_dtype=jnp.bfloat16, implementation=impl)

        row = run_jax(ctx, "gemm", name, spec, fn, (jx, jw, joffs, jxs, jws), ref, notes=rnote, add=False, **common)
        if row.get("error") and impl == "pallas_mosaic_gpu" and ("ValueError" in row["error"] or "NotImplementedError" in row["error"]):
            row["error"] = "not available: " + row["error"]
        ctx.add(row)

    # peers, torch: grouped GEMMs on our [E, N, K] weights as the column-major [E, K, N] view
    peer = "torch._scaled_grouped_mm" if fp8 else "torch._grouped_mm"
    if ctx.wants(peer):
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
        if ctx.wants("jax-ragged_dot_mgpu"):
            bench_mgpu(ctx, spec, jx, jw, jgs, ref, rnote, common)

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


def bench_layer(ctx: Ctx, spec: S.LayerSpec, wcache: dict) -> None:
    import torch

    import moe_pallas
    import moe_torch

    dev, bf16 = ctx.torch_dev, torch.bfloat16
    config = spec.config()
    key = (spec.E, spec.H, spec.I, spec.quant)
    if wcache.get("key") != key:
        wcache.clear()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        g = torch.Generator(device=dev).manual_seed(2000 + spec.seed)
        w13 = torch.empty(spec.E, 2 * spec.I, spec.H, device=dev, dtype=bf16)
        w2 = torch.empty(spec.E, spec.H, spec.I, device=dev, dtype=bf16)
        for e in range(spec.E):
            w13[e] = (torch.randn(2 * spec.I, spec.H, generator=g, device=dev) * spec.H**-0.5).to(bf16)
            w2[e] = (torch.randn(spec.H, spec.I, generator=g, device=dev) * spec.I**-0.5).to(bf16)
        wcache.update(key=key, w=moe_torch.quantize_layer_weights(w13, w2, config))
        del w13, w2
    w13, s13, w2, s2 = wcache["w"]
    g = torch.Generator(device=dev).manual_seed(spec.seed)
    x = torch.randn(spec.T, spec.H, generator=g, device=dev).to(bf16)
    logits = torch.randn(spec.T, spec.E, generator=g, device=dev)
    ref = moe_torch.moe_forward(x, logits, w13, w2, config, w13_scale=s13, w2_scale=s2, implementation="reference")
    common = dict(flops=spec.flops, nbytes=spec.min_bytes, dtype=spec.dtype, notes=l2_note(ctx, spec))
    for impl, name in (("triton", "ours-torch-triton"), ("reference", "ref-torch")):
        if ctx.wants(name):
            run_torch(ctx, "layer", name, spec,
                      functools.partial(moe_torch.moe_forward, x, logits, w13, w2, config, w13_scale=s13, w2_scale=s2,
                                        implementation=impl), ref, **common)
    if dev.type == "cuda" and ctx.wants("ours-torch-triton-cudagraph"):
        bench_layer_cuda_graph(ctx, spec, x, logits, (w13, s13, w2, s2), config, ref, common)
    jargs = (j(x), j(logits), j(w13), j(w2), j(s13), j(s2))
    # pallas_mosaic_gpu: the grouped GEMMs on Mosaic GPU, every other stage its default (pallas_triton on a GPU)
    for impl, name in (("pallas_triton", "ours-jax-pallas_triton"), ("pallas_mosaic_gpu", "ours-jax-pallas_mosaic_gpu"),
                       ("reference", "ref-jax")):
        if ctx.wants(name):

            def fn(x_, l_, w13_, w2_, s13_, s2_, impl=impl):
                return moe_pallas.moe_forward(x_, l_, w13_, w2_, config, w13_scale=s13_, w2_scale=s2_, implementation=impl)

            run_jax(ctx, "layer", name, spec, fn, jargs, ref, **common)
    del ref, jargs
    if spec.quant == "none":
        bench_layer_transformers(ctx, spec, x, w13, w2, common)


def bench_layer_cuda_graph(ctx: Ctx, spec, x, logits, weights, config, ref, common: dict) -> None:
    """The Triton layer captured once in a CUDA graph and replayed (how SGLang/vLLM run decode): the
    launch overhead of the eager row goes away. Also the GPU proof that the layer captures (no host
    sync on the Triton path)."""
    import moe_torch

    w13, s13, w2, s2 = weights
    static_x, static_logits = x.clone(), logits.clone()
    run_torch_cuda_graph(ctx, "layer", "ours-torch-triton-cudagraph", spec, lambda: moe_torch.moe_forward(
        static_x, static_logits, w13, w2, config, w13_scale=s13, w2_scale=s2, implementation="triton"), ref, common)


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


# transformers' own MoE block for the layer spec (softmax top-k, renormalised, silu): Qwen3-MoE's
HF_BLOCK = "Qwen3MoeSparseMoeBlock"


def hf_router_weight(spec: S.LayerSpec, device, dtype):
    """The HF block's ``gate.weight [E, H]`` ~ N(0, 1/H), seeded: its logits ``x @ W.T`` are ~ N(0, 1) like the spec's."""
    import torch

    g = torch.Generator(device=device).manual_seed(3000 + spec.seed)
    return (torch.randn(spec.E, spec.H, generator=g, device=device) * spec.H**-0.5).to(dtype)


def build_hf_block(config, w13, w2, gate_weight, experts_implementation: str = "grouped_mm"):
    """transformers' ``Qwen3MoeSparseMoeBlock`` holding *our* weights (shared, not copied).

    ``config``: our ``MoEConfig`` (softmax top-k with ``renormalize=True``, silu, quant 'none', no
    shared experts). transformers 5.24 keeps the experts fused, in our layout: ``experts.gate_up_proj
    [E, 2I, H]`` (gate rows first: ``linear(x, gate_up_proj[e]).chunk(2)``) = ``w13``, ``experts.down_proj
    [E, H, I]`` = ``w2``; ``gate.weight [E, H]`` is the router (logits ``= F.linear(x, weight)`` in the
    weights' dtype). Built on the meta device, so no float32 copy of the weights is ever made.
    ``experts_implementation``: ``"grouped_mm"`` (``torch._grouped_mm``; what ``from_pretrained`` picks
    where it can dispatch) or ``"eager"`` (the per-expert loop).
    """
    import torch
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if not (config.routing == "softmax_topk" and config.renormalize and config.activation == "silu"
            and config.quant == "none" and config.num_fused_shared_experts == 0):
        raise ValueError(f"build_hf_block: Qwen3MoeSparseMoeBlock is softmax top-k, renormalised, silu, bf16, no "
                         f"shared experts; got {config}")
    E, I, H = config.num_experts, config.intermediate_size, config.hidden_size
    shapes = {"w13": (tuple(w13.shape), (E, 2 * I, H)), "w2": (tuple(w2.shape), (E, H, I)),
              "gate_weight": (tuple(gate_weight.shape), (E, H))}
    for name, (got, want) in shapes.items():
        if got != want:
            raise ValueError(f"build_hf_block: {name} must be {list(want)}; got {list(got)}")
    hf_cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=config.topk,
                            norm_topk_prob=True, hidden_act="silu")
    hf_cfg._experts_implementation = experts_implementation
    with torch.device("meta"):
        block = Qwen3MoeSparseMoeBlock(hf_cfg)
    block.experts.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    block.experts.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    block.gate.weight = torch.nn.Parameter(gate_weight, requires_grad=False)
    return block.eval()


def bench_layer_transformers(ctx: Ctx, spec: S.LayerSpec, x, w13, w2, common: dict) -> None:
    """transformers' block on the same x and weights; reference: our torch reference on its router's logits."""
    import torch

    import moe_torch

    names = [(f"transformers-{HF_BLOCK}", "grouped_mm"), (f"transformers-{HF_BLOCK}-eager", "eager")]
    names = [(n, impl) for n, impl in names if ctx.wants(n)]
    if not names:
        return
    config = spec.config()
    try:
        gate_w = hf_router_weight(spec, x.device, x.dtype)
        with torch.no_grad():
            logits = torch.nn.functional.linear(x, gate_w)  # what the block's router computes, in x.dtype
        ref = moe_torch.moe_forward(x, logits.float(), w13, w2, config, implementation="reference")
    except Exception as exc:
        for name, _ in names:
            error_row(ctx, "layer", name, spec, "setup: " + short_error(exc))
        return
    x3 = x[None]  # [batch=1, seq=T, H]: the block's input shape
    for name, impl in names:
        note = f"experts_implementation={impl}; includes its router matmul; ref = ours on its bf16 logits"
        try:
            block = build_hf_block(config, w13, w2, gate_w, impl)
        except Exception as exc:
            error_row(ctx, "layer", name, spec, "setup: " + short_error(exc), notes=note)
            continue

        def fn(block=block):
            with torch.no_grad():
                return block(x3)

        run_torch(ctx, "layer", name, spec, fn, ref, canon=lambda o: o.reshape(spec.T, spec.H),
                  **{**common, "notes": "; ".join(n for n in (common.get("notes"), note) if n)})
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Writes bench.json / bench.csv / bench.md / bench_gemm.png / bench_layer.png to --out.")
    p.add_argument("--what", default="gemm,layer,gate", help=f"comma list of {', '.join(WHATS)} (default: all)")
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
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing rows")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # CPU smoke test: tiny shapes, interpreters
    args = p.parse_args(argv)
    args.what = [w for w in args.what.split(",") if w]
    bad = [w for w in args.what if w not in WHATS]
    if bad:
        p.error(f"--what: unknown {bad}; choose from {WHATS}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    ctx = Ctx(args)
    ctx.meta = environment()
    print(f"bench: {ctx.meta.get('torch_device')} / jax {ctx.meta.get('jax_devices')}; out={args.out}; what={args.what}"
          f"{' (quick)' if args.quick else ''}{' (tiny, CPU interpreters)' if TINY else ''}", flush=True)
    # TINY: Triton runs interpreted; moe_torch makes the interpreter's casts and dots exact itself
    # (moe_torch/ops/triton_interpret.py), so nothing is patched here.
    patch = contextlib.nullcontext()
    plan = []
    if "gemm" in args.what:
        plan += [("gemm", s) for s in S.gemm_specs(args.quick, TINY)]
    if "layer" in args.what:
        plan += [("layer", s) for s in S.layer_specs(args.quick, TINY)]
    if "gate" in args.what:
        plan += [("gate", s) for s in S.gate_specs(args.quick, TINY)]
    gemm_w, layer_w = GemmWeights(), {}
    with patch:
        for bench, spec in plan:
            if ctx.over_budget():
                error_row(ctx, bench, "*", spec, f"skipped: over --max-minutes={args.max_minutes}")
                continue
            try:
                if bench == "gemm":
                    bench_gemm(ctx, spec, gemm_w)
                elif bench == "layer":
                    gemm_w.key = gemm_w.w = gemm_w.wq = gemm_w.ws = None
                    bench_layer(ctx, spec, layer_w)
                else:
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
    pivot = H.markdown_pivot(rows)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(f"# bench {ctx.meta['date']} on {ctx.meta.get('torch_device')}\n\n{pivot}\n\n## All rows\n\n{H.markdown_long(rows)}\n")
    plotted = []
    for name, plot in (("bench_gemm.png", H.plot_gemm), ("bench_layer.png", H.plot_layer)):
        try:
            if plot(rows, os.path.join(args.out, name)):
                plotted.append(name)
        except Exception as exc:
            print(f"plot {name} failed: {short_error(exc)}")
    errs: dict = {}
    for r in rows:
        if r.get("error"):
            errs.setdefault((r["bench"], r["backend"]), []).append(r)
    if errs:
        print("\nerrors (per backend: how many rows, the first message; all in bench.md):")
        for (bench, backend), rs in errs.items():
            print(f"  {bench} {backend}: {len(rs)}x, e.g. {rs[0]['spec']}: {str(rs[0]['error'])[:150]}")
    print(f"\n{H.stats_line(rows)} in {ctx.elapsed():.0f} s; wrote {args.out}/bench.{{json,csv,md}}"
          + (f" and {', '.join(plotted)}" if plotted else ""))
    print("\n" + pivot)
    return 1 if any(str(r.get("error") or "").startswith("WRONG") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
