"""One way to time every backend, one row schema, and the writers (JSON, CSV, markdown, plot).

Timing:

- **torch** (CUDA): ``triton.testing.do_bench(fn, warmup, rep, return_mode="all")``: CUDA events
  around each call, the L2 cache flushed (a 256 MB memset) before each call, so no rotation of
  inputs is needed. ``timing_method = "cuda_events"``.
- **JAX** (GPU): ``jax.experimental.mosaic.gpu.profiler.measure(compiled, iterations=n)``: CUPTI
  kernel durations, summed over the kernels of one call (so the gaps between a pipeline's launches
  are *not* counted; compare ``wall_ms`` for that). ``timing_method = "cupti"``. Inputs smaller
  than the L2 are rotated: the timed program runs the op on ``n_sets`` input sets in turn and the
  time per iteration is divided by ``n_sets`` (``timing_method = "cupti_rotN"``). If CUPTI fails,
  the host wall clock of ``n`` back-to-back async calls then ``block_until_ready``, divided by
  ``n`` (``"wall_loop"``; the median/p20/p80 are then over a few such loops).
- **CPU** (``--tiny`` smoke runs): the same wall-clock loop, for both frameworks.
- ``compile_s``: the first call (torch: Triton JIT / torch.compile, plus one run) or
  ``jit(...).lower(...).compile()`` (JAX), measured apart from the timed calls.
- ``wall_ms``: host wall clock of back-to-back calls / n, no L2 flush, every backend: the
  end-to-end time a caller sees (launch overhead and gaps included).

Forward + backward rows (``bench.py --what gemm_bwd,layer_bwd``): ``median_ms`` (and p20, p80,
``wall_ms``) time one forward + backward call, ``fwd_ms`` the forward alone (the same method);
``bwd_ms = median_ms - fwd_ms``, ``bwd_fwd_ratio = bwd_ms / fwd_ms``, ``bwd_tflops = bwd_flops /
bwd_ms`` (the backward is 2x the forward's FLOPs). ``peak_mem_mib``: the memory one forward +
backward call takes on top of its inputs, MiB, measured per row, as ``mem_method`` says: torch
``torch.cuda.max_memory_allocated`` minus ``memory_allocated`` before the call (peak reset first;
the outputs and gradients included; CUDA only; :func:`torch_memory_mib`), JAX
``compiled.memory_analysis()`` temp + output bytes of the compiled forward + backward (what XLA plans to
allocate besides the arguments; on any backend; :func:`jax_memory_mib`). ``held_mib``: what the forward
leaves allocated for the backward besides its inputs (its output and saved activations; torch:
``memory_allocated`` delta after the forward, graph alive; JAX: the output and residuals of ``jax.vjp``,
:func:`jax_held_mib`). The two differ in kind: the peak of one layer's forward + backward is reached in
the backward, where ``recompute=True`` has rebuilt ``h``, so recompute need not lower it; it lowers
``held_mib``, the memory a training step holds per layer until that layer's backward. For a grouped GEMM
with no temporaries the peak is exactly its outputs ``y + d_x + d_w``, the same for every such backend.
Every output is checked first: the forward's against ``REL_ERR_MAX``, each gradient
against ``GRAD_REL_ERR_MAX``; a row with a wrong one is not timed.

Ceilings (one H200, measured):
``pct_of_ceiling = 100 * max(flops / PEAK_FLOPS[dtype], bytes / PEAK_BW) / median``, the
roofline floor over the measured time; ``bound`` says which term is larger.

Plots (``plot_gemm``, ``plot_layer``, ``plot_gate``; matplotlib, Agg): log time axes limited to the
measured times, the roofline floor drawn only where it does not squash them (``log_limits``), one
legend per figure outside the panels, and on a CPU (``cpu=True``) every title says the kernels ran
interpreted (``CPU_NOTE``); the markdown tables say so in their headings and column names.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

#: bf16 dense matmul 8192^3 via torch on the H200: 680-790 TFLOP/s; the conservative low end.
PEAK_BF16_FLOPS = 680e12
#: fp8 dense ``torch._scaled_mm`` 8192^3 on the H200.
PEAK_FP8_FLOPS = 1223e12
#: device-to-device copy on the H200, bytes read + written per second.
PEAK_BW = 4.27e12
PEAK_FLOPS = {"bf16": PEAK_BF16_FLOPS, "fp8": PEAK_FP8_FLOPS, "fp8_block": PEAK_FP8_FLOPS, "fp32": PEAK_BF16_FLOPS}
#: H200 L2 cache, 50 MB (for the rotation of small inputs).
L2_BYTES = 50e6
#: Relative Frobenius error above which a backend's output is called wrong and not timed.
REL_ERR_MAX = 1e-2
#: The same for a peer's FP8 layer against our FP8 reference: its own activation quantization (rounding, scale
#: formula) flips a few codes, so it agrees within the contract's FP8 tolerance (CONTRACT.md section 7), not ours.
FP8_PEER_REL_ERR_MAX = 2e-2
#: The same for a gradient (forward + backward rows): CONTRACT.md section 8, bf16 layer gradients
#: ``rel_fro <= 2e-2`` (a wrong gradient is off by O(1)).
GRAD_REL_ERR_MAX = 2e-2
#: The ``error`` prefix of a row that did not run by design (a peer or backend this machine lacks: tokamax
#: not installed, a Mosaic GPU kernel off a GPU); its reason follows. Not a failure: tables say SKIP.
SKIPPED = "skipped: "

#: The stable row schema, in column order (CSV header, JSON keys). Fields that do not apply are None.
ROW_KEYS = (
    "bench", "backend", "spec", "shape", "E", "M", "K", "N", "T", "H", "I", "topk", "routing", "dtype", "quant",
    "median_ms", "p20_ms", "p80_ms", "wall_ms", "tflops", "gbps", "pct_of_ceiling", "bound", "rel_err",
    "timing_method", "n_input_sets", "compile_s", "notes", "error",
    # forward + backward rows only (module docstring): the forward's time, the backward's, their ratio, the
    # backward's TFLOP/s, the largest gradient error, the call's peak memory, what the forward holds for the
    # backward, how the peak was measured, and the layer's recompute setting
    "fwd_ms", "bwd_ms", "bwd_fwd_ratio", "bwd_tflops", "grad_rel_err", "peak_mem_mib", "mem_method", "recompute",
    "held_mib",
)


def make_row(bench: str, backend: str, spec, **values) -> dict:
    """A row with every key of ROW_KEYS (None where unset), the spec's fields filled in."""
    row = dict.fromkeys(ROW_KEYS)
    row.update(bench=bench, backend=backend, spec=spec.name, **spec.fields())
    unknown = set(values) - set(ROW_KEYS)
    if unknown:
        raise ValueError(f"make_row: unknown row keys {sorted(unknown)}")
    row.update(values)
    return row


def add_rates(row: dict, flops: float, nbytes: float, dtype: str) -> dict:
    """Fill tflops, gbps, pct_of_ceiling and bound from ``row['median_ms']`` (in place; returns row)."""
    ms = row.get("median_ms")
    if not ms or ms <= 0:
        return row
    s = ms * 1e-3
    row["tflops"] = flops / s / 1e12 if flops else None
    row["gbps"] = nbytes / s / 1e9
    t_flop = flops / PEAK_FLOPS.get(dtype, PEAK_BF16_FLOPS)
    t_byte = nbytes / PEAK_BW
    row["bound"] = "compute" if t_flop >= t_byte else "memory"
    row["pct_of_ceiling"] = 100.0 * max(t_flop, t_byte) / s
    return row


def add_bwd_rates(row: dict, fwd_ms: float | None, bwd_flops: float) -> dict:
    """Fill ``fwd_ms``, ``bwd_ms = median_ms - fwd_ms``, ``bwd_fwd_ratio`` and ``bwd_tflops`` (``bwd_flops``
    over ``bwd_ms``) of a forward + backward row (in place; returns row). A backward not measurably
    longer than zero (noise) leaves the ratio and rate None."""
    ms = row.get("median_ms")
    row["fwd_ms"] = fwd_ms
    if not ms or not fwd_ms or fwd_ms <= 0:
        return row
    bwd = ms - fwd_ms
    row["bwd_ms"] = bwd
    if bwd > 0:
        row["bwd_fwd_ratio"] = bwd / fwd_ms
        row["bwd_tflops"] = bwd_flops / (bwd * 1e-3) / 1e12 if bwd_flops else None
    return row


def skipped(row: dict) -> bool:
    """Whether a row did not run by design (``error`` starts with :data:`SKIPPED`)."""
    return str(row.get("error") or "").startswith(SKIPPED)


def rel_fro(out, ref) -> float:
    """``||out - ref||_F / ||ref||_F`` in float64 (numpy arrays); inf if ``out`` has NaN/inf."""
    a, b = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"rel_fro: shapes differ, out {a.shape} vs ref {b.shape}")
    if not np.isfinite(a).all():
        return math.inf
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def summarize(times_ms: Sequence[float]) -> dict:
    """median, p20, p80 (ms) of a list of times."""
    t = np.asarray(list(times_ms), np.float64)
    return dict(median_ms=float(np.median(t)), p20_ms=float(np.percentile(t, 20)), p80_ms=float(np.percentile(t, 80)))


# ---------------------------------------------------------------------------------------------- torch


def torch_sync(device) -> None:
    import torch

    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize()


def torch_first_call(fn: Callable, device) -> tuple[object, float]:
    """Run ``fn`` once (JIT compilation, autotuning, handle creation), synchronised: (out, seconds)."""
    torch_sync(device)
    t0 = time.perf_counter()
    out = fn()
    torch_sync(device)
    return out, time.perf_counter() - t0


def wall_loop_ms(fn: Callable, sync: Callable[[object], None], n: int) -> float:
    """Host wall clock of ``n`` back-to-back calls, synchronised once at the end, per call (ms)."""
    sync(fn())
    t0 = time.perf_counter()
    out = None
    for _ in range(n):
        out = fn()
    sync(out)
    return 1e3 * (time.perf_counter() - t0) / n


def time_torch(fn: Callable, device, *, warmup_ms: float = 25, rep_ms: float = 100, cpu_loops: int = 3) -> dict:
    """Times a torch callable. CUDA: do_bench (events, L2 flushed). CPU: ``cpu_loops`` wall-clock loops of one
    call (each after one untimed call).

    Returns dict(median_ms, p20_ms, p80_ms, wall_ms, timing_method, n_input_sets=1).
    """
    sync = lambda _out: torch_sync(device)  # noqa: E731
    if getattr(device, "type", device) == "cuda":
        import triton.testing

        times = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
        res = summarize(times)
        n = max(3, min(200, int(rep_ms / max(res["median_ms"], 1e-3))))
        res.update(wall_ms=wall_loop_ms(fn, sync, n), timing_method="cuda_events", n_input_sets=1)
        return res
    loops = [wall_loop_ms(fn, sync, 1) for _ in range(cpu_loops)]
    res = summarize(loops)
    res.update(wall_ms=res["median_ms"], timing_method="wall_loop", n_input_sets=1)
    return res


# ---------------------------------------------------------------------------------------------- JAX


def jax_block(out) -> None:
    import jax

    jax.block_until_ready(out)


def jax_compile(fn: Callable, *args, cache: dict | None = None, key=None):
    """``jax.jit(fn).lower(*args).compile()``: (compiled, seconds); reused from ``cache[key]`` if there."""
    import jax

    if cache is not None and key is not None and key in cache:
        return cache[key], 0.0
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    dt = time.perf_counter() - t0
    if cache is not None and key is not None:
        cache[key] = compiled
    return compiled, dt


def time_jax(compiled, args: Sequence, *, n_sets: int = 1, rep_ms: float = 100, min_iters: int = 5,
             max_iters: int = 50) -> dict:
    """Times a compiled JAX callable on ``args`` (a tuple); ``n_sets`` > 1 means ``compiled`` runs
    the op on that many input sets per call (see :func:`rotated`) and times are divided by it.

    CUPTI first (``profiler.measure``), the wall-clock loop if that fails (the reason lands in
    ``notes``). Returns dict(median_ms, p20_ms, p80_ms, wall_ms, timing_method, n_input_sets, notes).
    """
    import jax

    call = lambda: compiled(*args)  # noqa: E731
    jax_block(call())  # warm (module load, autotuning)
    # a rough per-call time to size the repetitions
    est_ms = wall_loop_ms(call, jax_block, 2)
    iters = int(max(min_iters, min(max_iters, rep_ms / max(est_ms, 1e-3))))
    wall = wall_loop_ms(call, jax_block, iters) / n_sets
    res: dict = dict(wall_ms=wall, n_input_sets=n_sets, notes=None)
    suffix = f"_rot{n_sets}" if n_sets > 1 else ""
    if jax.default_backend() == "gpu":
        try:
            from jax.experimental.mosaic.gpu import profiler

            _, per_iter = profiler.measure(compiled, iterations=iters)(*args)
            if per_iter is None:
                raise RuntimeError("CUPTI saw no kernel launch")
            per_iter = per_iter if isinstance(per_iter, list) else [per_iter]
            res.update(summarize([t / n_sets for t in per_iter]), timing_method="cupti" + suffix)
            return res
        except Exception as exc:  # fall back, and say why
            res["notes"] = f"cupti failed ({type(exc).__name__}: {str(exc)[:120]}); wall clock instead"
    loops = [wall_loop_ms(call, jax_block, max(1, iters // 3)) / n_sets for _ in range(3)]
    res.update(summarize(loops), timing_method="wall_loop" + suffix)
    return res


class CudaMemoryStats:
    """torch's CUDA caching-allocator counters on ``device``, as :func:`torch_memory_mib` reads them:
    ``sync()``, ``reset_peak()``, ``allocated()`` and ``max_allocated()`` (bytes of live tensors, not the
    allocator's reserved pool). Any object with these four methods can stand in (the CPU tests' fake)."""

    method = "torch.cuda.max_memory_allocated delta"

    def __init__(self, device) -> None:
        self.device = device

    def sync(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        import torch

        return torch.cuda.memory_allocated(self.device)

    def max_allocated(self) -> int:
        import torch

        return torch.cuda.max_memory_allocated(self.device)


def torch_memory_mib(fwd: Callable, fwd_bwd: Callable, device, stats=None) -> dict:
    """The memory of one torch forward + backward row, MiB, on top of what is allocated before each call
    (the inputs, weights, references):

    - ``peak_mem_mib``: peak of one ``fwd_bwd()`` (peak counter reset just before it, after the inputs
      exist; ``max_allocated() - allocated()`` from before the call; its outputs and gradients are held
      until the peak is read, so they count);
    - ``held_mib``: what one ``fwd()`` leaves allocated with its autograd graph alive: its output and the
      tensors saved for the backward (the memory a training step holds per layer between forward and
      backward; what ``recompute=True`` shrinks);
    - ``mem_method``: ``stats.method`` (or the class name), or why there is none.

    ``stats``: the counters (:class:`CudaMemoryStats` interface); default: CUDA's on a CUDA ``device``,
    else none and both values ``None``. Each call measures afresh: nothing is cached between rows."""
    if stats is None:
        if getattr(device, "type", device) != "cuda":
            return dict(peak_mem_mib=None, held_mib=None, mem_method="n/a: torch.cuda memory stats only on a GPU")
        stats = CudaMemoryStats(device)
    stats.sync()
    base = stats.allocated()
    out = fwd()
    stats.sync()
    held = stats.allocated() - base
    del out  # frees the graph and what it saved
    stats.sync()
    base = stats.allocated()
    stats.reset_peak()
    out = fwd_bwd()
    stats.sync()
    peak = stats.max_allocated() - base
    del out
    method = getattr(stats, "method", None) or type(stats).__name__
    return dict(peak_mem_mib=peak / 2**20, held_mib=held / 2**20, mem_method=method)


def jax_memory_mib(compiled) -> tuple[float | None, str]:
    """What XLA plans to allocate for one call of ``compiled`` besides its arguments, MiB: temp + output bytes
    of ``compiled.memory_analysis()`` (any backend; Pallas kernels' outputs are XLA buffers, so counted;
    a kernel's own scratch is not), and the method's name; ``(None, reason)`` if there is no analysis.
    Temp is the peak of XLA's buffer assignment (buffers freed at their last use), so for the compiled
    forward + backward this is the call's peak. Not the device's ``memory_stats()["peak_bytes_in_use"]``:
    that counter cannot be reset, so after the first large row every later row would read its peak."""
    try:
        m = compiled.memory_analysis()
        return (m.temp_size_in_bytes + m.output_size_in_bytes) / 2**20, "xla memory_analysis temp+output"
    except Exception as exc:  # an old jaxlib or a backend without it
        return None, f"n/a: memory_analysis failed ({type(exc).__name__})"


def jax_held_mib(fwd: Callable, args: Sequence, wrt: Sequence[int] | None = None) -> float | None:
    """What ``jax.vjp(fwd, *args[wrt])`` keeps between the forward and the backward besides its inputs,
    MiB: the forward's output and its residuals (the leaves of the VJP function), counted once each, read
    from the traced jaxpr (no compilation, no run); an input kept as a residual costs nothing and is not
    counted. ``wrt``: the positions of ``args`` differentiated (default: all); the others are passed
    through as arguments, not differentiated. The JAX counterpart of :func:`torch_memory_mib`'s
    ``held_mib``; ``None`` if tracing fails."""
    import jax

    wrt = tuple(range(len(args))) if wrt is None else tuple(wrt)

    def forward(*a):
        def g(*d):
            full = list(a)
            for i, v in zip(wrt, d):
                full[i] = v
            return fwd(*full)

        return jax.vjp(g, *(a[i] for i in wrt))

    try:
        closed, shapes = jax.make_jaxpr(forward, return_shape=True)(*args)
    except Exception:
        return None
    jaxpr = closed.jaxpr
    free = {id(v) for v in (*jaxpr.invars, *jaxpr.constvars)}  # inputs: already allocated
    seen: set[int] = set()
    total = 0
    n_out = len(jax.tree_util.tree_leaves(shapes[0]))
    for v in jaxpr.outvars[: n_out + len(jax.tree_util.tree_leaves(shapes[1]))]:
        aval = getattr(v, "aval", None)
        if aval is None or hasattr(v, "val") or id(v) in free or id(v) in seen:  # a literal, an input, or twice
            continue
        seen.add(id(v))
        total += int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
    return total / 2**20


def rotated(fn: Callable, n_sets: int) -> Callable:
    """``g(sets) -> [fn(*s) for s in sets]``, for timing ``fn`` on ``n_sets`` input sets in turn in one
    program (so each set has left the L2 before its next use)."""

    def g(*sets):
        if len(sets) != n_sets:
            raise ValueError(f"rotated: expected {n_sets} input sets; got {len(sets)}")
        return [fn(*s) for s in sets]

    return g


# ---------------------------------------------------------------------------------------------- output


def _fmt(v, nd: int = 3) -> str:
    """A number for the tables: ``nd`` significant digits (``-`` for None)."""
    if v is None or v == "":
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.{nd}g}" if nd else f"{v:.0f}"
    return str(v)


def write_json(rows: list[dict], path: str, meta: dict | None = None) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta or {}, "schema": list(ROW_KEYS), "rows": rows}, f, indent=1, default=str)
    os.replace(tmp, path)  # a run killed mid-write leaves the previous file whole


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(ROW_KEYS), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in ROW_KEYS})


def read_csv(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


#: Table and plot label of timings taken on a CPU (``bench.py --tiny``): the kernels ran in the Triton and
#: Pallas interpreters, so their times say nothing about the kernels' speed on a GPU.
CPU_NOTE = "CPU: Triton / Pallas kernels interpreted, references eager on the CPU; not GPU timings"
#: The line each plot panel's title gets on a CPU.
CPU_TITLE = "[CPU timings: kernels interpreted]"


#: Our backends whose kernels run in an interpreter on a CPU (Triton's, Pallas' interpret mode). The Mosaic GPU
#: kernels never run there (their rows are skips), and a default backend (``ours-*-default``) is the reference there.
INTERPRETED_BACKENDS = ("ours-torch-triton", "ours-jax-pallas_triton")


def interpreted(backend: str, cpu: bool) -> bool:
    """Whether ``backend``'s row timed a kernel in an interpreter: :data:`INTERPRETED_BACKENDS` on a CPU."""
    return cpu and backend.startswith(INTERPRETED_BACKENDS)


def backend_label(backend: str, cpu: bool) -> str:
    """A backend's name in tables and plots, saying what ran on a CPU: ``(interpreted)`` where a kernel ran
    interpreted, ``(reference on a CPU)`` for a default backend (the library's CPU default is the reference)."""
    if interpreted(backend, cpu):
        return backend + " (interpreted)"
    if cpu and backend.startswith("ours-") and backend.endswith("-default"):
        return backend + " (reference on a CPU)"
    return backend


def markdown_long(rows: list[dict], cpu: bool = False) -> str:
    """Every row: spec, backend, median [p20, p80] ms, TFLOP/s, GB/s, % of ceiling, rel err, method, error.
    ``cpu``: the times were taken on a CPU (header and interpreted backends say so)."""
    where = f" ({CPU_NOTE})" if cpu else ""
    out = [f"| spec | backend | median ms [p20, p80]{where} | wall ms | TFLOP/s | GB/s | % ceil | rel err | method | "
           "compile s | notes / error |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = f"{_fmt(r['median_ms'])} [{_fmt(r['p20_ms'])}, {_fmt(r['p80_ms'])}]" if r.get("median_ms") else "-"
        note = " ".join(x for x in (r.get("notes"), f"ERROR {r['error']}" if r.get("error") else None) if x)
        out.append(f"| {r['spec']} | {backend_label(r['backend'], cpu)} | {t} | {_fmt(r.get('wall_ms'))} | "
                   f"{_fmt(r.get('tflops'))} | "
                   f"{_fmt(r.get('gbps'), 0)} | {_fmt(r.get('pct_of_ceiling'))} | {_fmt(r.get('rel_err'), 2)} | "
                   f"{r.get('timing_method') or '-'} | {_fmt(r.get('compile_s'), 2)} | {note.replace('|', '/')[:160]} |")
    return "\n".join(out)


def markdown_pivot(rows: list[dict], cpu: bool = False) -> str:
    """The short table: one line per spec, one column per backend, median ms (``ERR`` / ``WRONG``);
    ``*`` marks the fastest. One block per bench. ``cpu``: the times were taken on a CPU (each block's
    heading and the interpreted backends' columns say so)."""
    blocks = []
    where = f"; {CPU_NOTE}" if cpu else ""
    for bench in dict.fromkeys(r["bench"] for r in rows):
        rs = [r for r in rows if r["bench"] == bench]
        backends = list(dict.fromkeys(r["backend"] for r in rs))
        specs = list(dict.fromkeys(r["spec"] for r in rs))
        what = "median ms of forward + backward" if bench.endswith("_bwd") else "median ms"
        lines = [f"**{bench}** ({what}{where}; `*` fastest; ERR = failed or not available, WRONG = rel err > {REL_ERR_MAX:g}"
                 + (f" or a gradient's > {GRAD_REL_ERR_MAX:g}" if bench.endswith("_bwd") else "")
                 + (", SKIP = not on this machine (reason in bench.md)" if any(skipped(r) for r in rs) else "") + ")",
                 "", "| spec | " + " | ".join(backend_label(b, cpu) for b in backends) + " |", "|---" * (len(backends) + 1) + "|"]
        for s in specs:
            cells = {r["backend"]: r for r in rs if r["spec"] == s}
            times = {b: r["median_ms"] for b, r in cells.items() if r.get("median_ms") and not r.get("error")}
            best = min(times, key=times.get) if times else None
            row = []
            for b in backends:
                r = cells.get(b)
                if r is None:
                    row.append("")
                elif skipped(r):
                    row.append("SKIP")
                elif r.get("error"):
                    row.append("WRONG" if str(r["error"]).startswith("WRONG") else "ERR")
                elif r.get("median_ms"):
                    row.append(f"{r['median_ms']:.3f}" + ("*" if b == best else ""))
                else:
                    row.append("-")
            short = s.split("/", 1)[1] if "/" in s else s
            lines.append(f"| {short} | " + " | ".join(row) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


# ---------------------------------------------------------------------------------------------- plots

#: The roofline floor is drawn to scale only while it lies at most this many decades below the
#: fastest time of its panel (on the H200: GEMM and layer floors within 1, the gate's 1.2); further
#: down it would squash every measured line into the top of the axis (on a CPU it is 4 to 7 decades
#: below), so it is left off the axis and its value is written in the panel's title instead.
FLOOR_MAX_DECADES_BELOW = 1.5


def floor_ms(row: dict) -> float | None:
    """The roofline floor of a timed row, ms: ``median * pct_of_ceiling / 100`` (None if not rated)."""
    if not row.get("median_ms") or not row.get("pct_of_ceiling"):
        return None
    return float(row["median_ms"]) * float(row["pct_of_ceiling"]) / 100


def log_limits(times: Sequence[float], floors: Sequence[float]) -> tuple[tuple[float, float], bool]:
    """Log-axis limits for ``times`` (ms), and whether ``floors`` fit on that axis: the floor joins the
    range only while its lowest value is at most ``FLOOR_MAX_DECADES_BELOW`` decades under the fastest
    time, so that it never squashes the measured data. Returns ``((lo, hi), floor_in_view)``."""
    lo, hi = min(times), max(times)
    in_view = bool(floors) and min(floors) >= lo / 10**FLOOR_MAX_DECADES_BELOW
    if in_view:
        lo, hi = min(lo, min(floors)), max(hi, max(floors))
    pad = max(1.25, (hi / lo) ** 0.06)  # a margin of ~6% of the span on a log axis, at least 25%
    return (lo / pad, hi * pad), in_view


def _floor_title(floors: Sequence[float], in_view: bool) -> str:
    """The title line of a roofline floor left off its axis ("" if drawn or absent)."""
    if not floors or in_view:
        return ""
    lo, hi = min(floors), max(floors)
    span = f"{lo:.2g} ms" if math.isclose(lo, hi, rel_tol=0.05) else f"{lo:.2g}-{hi:.2g} ms"
    return f"roofline floor {span}: below the axis, not drawn"


def _title(ax, *lines: str) -> None:
    """A panel title of several short lines (each wrapped to the panel's width, so that neighbouring
    panels' titles and the legend never overlap); empty lines dropped."""
    import textwrap

    ax.set_title("\n".join(textwrap.fill(x, 62) for x in lines if x), fontsize=9)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_log_labels(axis) -> None:
    """Tick labels of a log axis as plain numbers (0.2, 1, 10): decades always, and 2 and 5 of each
    decade when the axis spans less than two decades (else they crowd)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = sorted(axis.get_view_interval())
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    if hi / lo < 100:
        axis.set_minor_locator(LogLocator(base=10, subs=(2.0, 5.0)))
        axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    else:
        axis.set_minor_formatter(NullFormatter())


def _plain_log_x(ax, xs: Sequence[int]) -> None:
    """A log x-axis with ticks at the measured values only, labelled plainly (16, 64, 4096)."""
    from matplotlib.ticker import FixedLocator, NullLocator

    xs = sorted(set(xs))
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(xs))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(x) for x in xs])
    if len(xs) == 1:
        ax.set_xlim(xs[0] / 2, xs[0] * 2)
    else:
        ax.set_xlim(xs[0] / 1.3, xs[-1] * 1.3)


def _finish(fig, axes, n_used: int, handles: list, labels: list, cpu: bool, what: str):
    """Unused panels off; the CPU note as the figure's title; the layout; one legend for the figure,
    outside every axis (right of the panels: it covers no line). Returns ``fig``."""
    for ax in list(axes.flat)[n_used:]:
        ax.axis("off")
    if cpu:
        fig.suptitle(f"{what}: {CPU_NOTE}", fontsize=9, color="firebrick")
    fig.tight_layout()
    if handles:
        fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 0.97), fontsize=7, frameon=False)
    return fig


def _save(fig, path: str) -> bool:
    """Write ``fig`` (PNG; the image grows to hold the legend outside the panels) and close it; False if
    there was no figure."""
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return True


def _legend_entries(axes) -> tuple[list, list]:
    """The labelled lines of all panels, each label once, in first-seen order."""
    seen: dict = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    labels = sorted(seen, key=lambda lab: lab.startswith("roofline"))  # the backends first (stable), the floor last
    return [seen[lab] for lab in labels], labels


def _timed(rows: list[dict], bench: str) -> list[dict]:
    return [r for r in rows if r["bench"] == bench and r.get("median_ms") and not r.get("error")]


def plot_gemm(rows: list[dict], path: str, cpu: bool = False) -> bool:
    """:func:`gemm_figure` written to ``path`` (PNG); False if there is no timed gemm row."""
    return _save(gemm_figure(rows, cpu), path)


def plot_layer(rows: list[dict], path: str, cpu: bool = False) -> bool:
    """:func:`layer_figure` written to ``path`` (PNG); False if there is no timed layer row."""
    return _save(layer_figure(rows, cpu), path)


def plot_gate(rows: list[dict], path: str, cpu: bool = False) -> bool:
    """:func:`gate_figure` written to ``path`` (PNG); False if there is no timed gate row."""
    return _save(gate_figure(rows, cpu), path)


def gemm_figure(rows: list[dict], cpu: bool = False):
    """Time vs M per backend, one panel per (shape, dtype); uniform solid, zipf dashed, the roofline
    floor dotted (left off an axis it would squash: :func:`log_limits`); one legend, outside the panels.
    ``cpu``: CPU timings (titles say so). A matplotlib figure, or None if there is no timed gemm row."""
    rs = _timed(rows, "gemm")
    if not rs:
        return None
    plt = _pyplot()
    from matplotlib.lines import Line2D

    panels = list(dict.fromkeys((r["shape"], r["dtype"]) for r in rs))
    ncol = min(2, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.0 * ncol, 4.4 * nrow), squeeze=False)
    backends = list(dict.fromkeys(r["backend"] for r in rs))
    colors = {b: plt.cm.tab10(i % 10) for i, b in enumerate(backends)}
    for ax, (shape, dtype) in zip(axes.flat, panels):
        pr = [r for r in rs if (r["shape"], r["dtype"]) == (shape, dtype)]
        for b in dict.fromkeys(r["backend"] for r in pr):
            for routing, ls in (("uniform", "-"), ("zipf", "--")):
                pts = sorted((int(r["M"]), float(r["median_ms"])) for r in pr if r["backend"] == b and r["routing"] == routing)
                if pts:
                    ax.plot(*zip(*pts), ls, marker="o", ms=4, color=colors[b], label=backend_label(b, cpu))
        floor = {int(r["M"]): floor_ms(r) for r in pr if r["routing"] == "uniform" and floor_ms(r)}
        (lo, hi), in_view = log_limits([float(r["median_ms"]) for r in pr], list(floor.values()))
        if floor and in_view:
            ax.plot(*zip(*sorted(floor.items())), ":", color="black", label="roofline floor (measured ceilings)")
        r0 = pr[0]
        parts = r0["spec"].split("/")  # gemm[/<model>]/<shape>/<dtype>/M=<M>/<routing>
        model = f"{parts[1]} " if len(parts) == 6 else ""
        ax.set(yscale="log", ylim=(lo, hi), xlabel="M (routed rows)", ylabel="median ms")
        _title(ax, f"{model}{shape} E={r0['E']} K={r0['K']} N={r0['N']} {dtype}", CPU_TITLE if cpu else "",
               _floor_title(list(floor.values()), in_view))
        _plain_log_x(ax, [int(r["M"]) for r in pr])
        _plain_log_labels(ax.yaxis)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = _legend_entries(axes)
    handles += [Line2D([], [], color="gray", ls="-"), Line2D([], [], color="gray", ls="--")]
    labels += ["uniform routing (solid)", "zipf routing (dashed)"]
    return _finish(fig, axes, len(panels), handles, labels, cpu, "grouped GEMM")


def layer_figure(rows: list[dict], cpu: bool = False):
    """Layer forward time vs tokens T per backend, one panel per (model, quant) (log-log), the roofline
    floor dotted (left off an axis it would squash); one legend, outside the panels. ``cpu``: CPU
    timings (titles say so). A matplotlib figure, or None if there is no timed layer row."""
    rs = _timed(rows, "layer")
    if not rs:
        return None
    plt = _pyplot()

    panels = list(dict.fromkeys((r.get("shape"), r["quant"]) for r in rs))
    ncol = min(2, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.0 * ncol, 4.4 * nrow), squeeze=False)
    backends = list(dict.fromkeys(r["backend"] for r in rs))
    colors = {b: plt.cm.tab10(i % 10) for i, b in enumerate(backends)}
    for ax, (model, quant) in zip(axes.flat, panels):
        pr = [r for r in rs if (r.get("shape"), r["quant"]) == (model, quant)]
        for b in dict.fromkeys(r["backend"] for r in pr):
            pts = sorted((int(r["T"]), float(r["median_ms"])) for r in pr if r["backend"] == b)
            ax.plot(*zip(*pts), "-", marker="o", ms=4, color=colors[b], label=backend_label(b, cpu))
        floor = {int(r["T"]): floor_ms(r) for r in pr if floor_ms(r)}
        (lo, hi), in_view = log_limits([float(r["median_ms"]) for r in pr], list(floor.values()))
        if floor and in_view:
            ax.plot(*zip(*sorted(floor.items())), ":", color="black", label="roofline floor (measured ceilings)")
        r0 = pr[0]
        ax.set(yscale="log", ylim=(lo, hi), xlabel="T (tokens)", ylabel="median ms")
        _title(ax, f"layer {model + ' ' if model else ''}{r0['routing']}", f"E={r0['E']} topk={r0['topk']} H={r0['H']} "
               f"I={r0['I']} quant {quant}", CPU_TITLE if cpu else "", _floor_title(list(floor.values()), in_view))
        _plain_log_x(ax, [int(r["T"]) for r in pr])
        _plain_log_labels(ax.yaxis)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = _legend_entries(axes)
    return _finish(fig, axes, len(panels), handles, labels, cpu, "MoE layer forward")


def gate_figure(rows: list[dict], cpu: bool = False):
    """The gate: one horizontal bar per backend (median ms, whiskers p20-p80, log axis), one panel per
    gate spec; the roofline floor a dotted vertical line where it does not squash the axis. The bars
    are named on the axis (no legend to cover them). ``cpu``: CPU timings (titles say so). A matplotlib
    figure, or None if there is no timed gate row."""
    rs = _timed(rows, "gate")
    if not rs:
        return None
    plt = _pyplot()

    specs = list(dict.fromkeys(r["spec"] for r in rs))
    n_bars = max(sum(1 for r in rs if r["spec"] == s) for s in specs)
    panel_h = max(2.2, 1.2 + 0.42 * n_bars)  # inches: the title's lines and the axis label, then a bar each
    fig, axes = plt.subplots(len(specs), 1, figsize=(8.0, panel_h * len(specs)), squeeze=False)
    backends = list(dict.fromkeys(r["backend"] for r in rs))
    colors = {b: plt.cm.tab10(i % 10) for i, b in enumerate(backends)}
    for ax, spec in zip(axes.flat, specs):
        pr = [r for r in rs if r["spec"] == spec]
        ys = list(range(len(pr)))[::-1]  # the first row on top
        med = [float(r["median_ms"]) for r in pr]
        lo_err = [m - float(r["p20_ms"] or m) for m, r in zip(med, pr)]
        hi_err = [float(r["p80_ms"] or m) - m for m, r in zip(med, pr)]
        ax.barh(ys, med, xerr=[lo_err, hi_err], color=[colors[r["backend"]] for r in pr], height=0.6,
                error_kw=dict(ecolor="black", capsize=2, lw=0.8))
        ax.set_yticks(ys)
        ax.set_yticklabels([backend_label(r["backend"], cpu) for r in pr], fontsize=8)
        floors = [f for f in (floor_ms(r) for r in pr) if f]
        (lo, hi), in_view = log_limits(med + [m + e for m, e in zip(med, hi_err)], floors)
        hi *= 3  # room for the value labels right of the bars
        if floors and in_view:
            ax.axvline(min(floors), ls=":", color="black")
            ax.text(min(floors), ys[0] + 0.45, " roofline floor", fontsize=7, va="bottom")
        for y, m, e in zip(ys, med, hi_err):
            ax.text((m + e) * 1.12, y, f"{m:.3g} ms", va="center", fontsize=7)
        r0 = pr[0]
        ax.set(xscale="log", xlim=(lo, hi), ylim=(-0.6, len(pr) - 0.4 + (0.5 if floors and in_view else 0)),
               xlabel="median ms (whiskers: p20-p80)")
        _title(ax, f"gate {r0['shape']} {r0['routing']} E={r0['E']} topk={r0['topk']} T={r0['T']}",
               CPU_TITLE if cpu else "", _floor_title(floors, in_view))
        _plain_log_labels(ax.xaxis)
        ax.grid(True, axis="x", which="both", alpha=0.3)
    return _finish(fig, axes, len(specs), [], [], cpu, "gate")


def int_list(parser, name: str, text: str, *, power_of_two: bool = False, most: int | None = None) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; a bad entry is a usage error naming the option
    (``parser.error``: exit code 2)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"{name}: expected a comma list of integers; got {text!r}")
    for v in values:
        if v < 1 or (power_of_two and v & (v - 1)) or (most is not None and v > most):
            parser.error(f"{name}: every value must be an integer >= 1" + (", a power of two" if power_of_two else "")
                         + (f", <= {most}" if most is not None else "") + f"; got {v}")
    if not values:
        parser.error(f"{name}: expected at least one value; got {text!r}")
    return values


def markdown_bwd(rows: list[dict], cpu: bool = False) -> str:
    """The forward + backward rows (benches ``*_bwd``), one line each: forward ms, forward + backward ms,
    backward / forward, backward TFLOP/s, peak memory (MiB, and how measured), the memory the forward holds
    for the backward (MiB), the forward's and the largest gradient's rel. error, notes or the error. ""
    if there is none."""
    rs = [r for r in rows if str(r.get("bench") or "").endswith("_bwd")]
    if not rs:
        return ""
    where = f" ({CPU_NOTE})" if cpu else ""
    out = [f"| spec | backend | fwd ms{where} | fwd+bwd ms | bwd/fwd | bwd TFLOP/s | peak MiB | memory method | "
           "held after fwd MiB | rel err out / grads | notes / error |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        note = " ".join(x for x in (r.get("notes"), f"ERROR {r['error']}" if r.get("error") else None) if x)
        out.append(f"| {r['spec']} | {backend_label(r['backend'], cpu)} | {_fmt(r.get('fwd_ms'))} | {_fmt(r.get('median_ms'))} | "
                   f"{_fmt(r.get('bwd_fwd_ratio'))} | {_fmt(r.get('bwd_tflops'))} | {_fmt(r.get('peak_mem_mib'), 0)} | "
                   f"{r.get('mem_method') or '-'} | {_fmt(r.get('held_mib'))} | "
                   f"{_fmt(r.get('rel_err'), 2)} / {_fmt(r.get('grad_rel_err'), 2)} | "
                   f"{note.replace('|', '/')[:200]} |")
    return "\n".join(out)


def stats_line(rows: list[dict]) -> str:
    n_skip = sum(1 for r in rows if skipped(r))
    n_err = sum(1 for r in rows if r.get("error")) - n_skip
    n_wrong = sum(1 for r in rows if str(r.get("error") or "").startswith("WRONG"))
    return (f"{len(rows)} rows, {len(rows) - n_err - n_skip} timed, " + (f"{n_skip} skipped, " if n_skip else "")
            + f"{n_err} errors ({n_wrong} wrong results)")

