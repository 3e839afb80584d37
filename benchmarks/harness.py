"""One way to time every backend, one row schema, and the writers (JSON, CSV, markdown, plot).

Timing (STYLE.md "Benchmarks", .library/device/METHOD.md "Time properly"):

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

Ceilings (ENVIRONMENT.md, "The GPU machine in numbers", one H200 measured here):
``pct_of_ceiling = 100 * max(flops / PEAK_FLOPS[dtype], bytes / PEAK_BW) / median``, the
roofline floor over the measured time; ``bound`` says which term is larger.
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
PEAK_FLOPS = {"bf16": PEAK_BF16_FLOPS, "fp8": PEAK_FP8_FLOPS, "fp32": PEAK_BF16_FLOPS}
#: H200 L2 cache, 50 MB (for the rotation of small inputs).
L2_BYTES = 50e6
#: Relative Frobenius error above which a backend's output is called wrong and not timed.
REL_ERR_MAX = 1e-2

#: The stable row schema, in column order (CSV header, JSON keys). Fields that do not apply are None.
ROW_KEYS = (
    "bench", "backend", "spec", "shape", "E", "M", "K", "N", "T", "H", "I", "topk", "routing", "dtype", "quant",
    "median_ms", "p20_ms", "p80_ms", "wall_ms", "tflops", "gbps", "pct_of_ceiling", "bound", "rel_err",
    "timing_method", "n_input_sets", "compile_s", "notes", "error",
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


def time_torch(fn: Callable, device, *, warmup_ms: float = 25, rep_ms: float = 100) -> dict:
    """Times a torch callable. CUDA: do_bench (events, L2 flushed). CPU: a few wall-clock loops.

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
    loops = [wall_loop_ms(fn, sync, 1) for _ in range(3)]
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


def markdown_long(rows: list[dict]) -> str:
    """Every row: spec, backend, median [p20, p80] ms, TFLOP/s, GB/s, % of ceiling, rel err, method, error."""
    out = ["| spec | backend | median ms [p20, p80] | wall ms | TFLOP/s | GB/s | % ceil | rel err | method | compile s | notes / error |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = f"{_fmt(r['median_ms'])} [{_fmt(r['p20_ms'])}, {_fmt(r['p80_ms'])}]" if r.get("median_ms") else "-"
        note = " ".join(x for x in (r.get("notes"), f"ERROR {r['error']}" if r.get("error") else None) if x)
        out.append(f"| {r['spec']} | {r['backend']} | {t} | {_fmt(r.get('wall_ms'))} | {_fmt(r.get('tflops'))} | "
                   f"{_fmt(r.get('gbps'), 0)} | {_fmt(r.get('pct_of_ceiling'))} | {_fmt(r.get('rel_err'), 2)} | "
                   f"{r.get('timing_method') or '-'} | {_fmt(r.get('compile_s'), 2)} | {note.replace('|', '/')[:160]} |")
    return "\n".join(out)


def markdown_pivot(rows: list[dict]) -> str:
    """The short table: one line per spec, one column per backend, median ms (``ERR`` / ``WRONG``);
    ``*`` marks the fastest. One block per bench."""
    blocks = []
    for bench in dict.fromkeys(r["bench"] for r in rows):
        rs = [r for r in rows if r["bench"] == bench]
        backends = list(dict.fromkeys(r["backend"] for r in rs))
        specs = list(dict.fromkeys(r["spec"] for r in rs))
        lines = [f"**{bench}** (median ms; `*` fastest; ERR = failed or not available, WRONG = rel err > {REL_ERR_MAX:g})", "",
                 "| spec | " + " | ".join(backends) + " |", "|---" * (len(backends) + 1) + "|"]
        for s in specs:
            cells = {r["backend"]: r for r in rs if r["spec"] == s}
            times = {b: r["median_ms"] for b, r in cells.items() if r.get("median_ms") and not r.get("error")}
            best = min(times, key=times.get) if times else None
            row = []
            for b in backends:
                r = cells.get(b)
                if r is None:
                    row.append("")
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


def plot_gemm(rows: list[dict], path: str) -> bool:
    """Time vs M per backend, one panel per (shape, dtype); uniform solid, zipf dashed, the roofline
    floor dotted. False if there is no timed gemm row."""
    rs = [r for r in rows if r["bench"] == "gemm" and r.get("median_ms") and not r.get("error")]
    if not rs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["shape"], r["dtype"]) for r in rs))
    ncol = min(2, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.5 * ncol, 4.5 * nrow), squeeze=False)
    backends = list(dict.fromkeys(r["backend"] for r in rs))
    colors = {b: plt.cm.tab10(i % 10) for i, b in enumerate(backends)}
    for ax, (shape, dtype) in zip(axes.flat, panels):
        pr = [r for r in rs if (r["shape"], r["dtype"]) == (shape, dtype)]
        for b in dict.fromkeys(r["backend"] for r in pr):
            for routing, ls in (("uniform", "-"), ("zipf", "--")):
                pts = sorted((int(r["M"]), float(r["median_ms"])) for r in pr if r["backend"] == b and r["routing"] == routing)
                if pts:
                    ax.plot(*zip(*pts), ls, marker="o", color=colors[b], label=f"{b} ({routing})")
        floor = {}  # roofline floor per M (uniform routing): median * pct_of_ceiling / 100
        for r in pr:
            if r["routing"] == "uniform" and r.get("pct_of_ceiling"):
                floor[int(r["M"])] = float(r["median_ms"]) * float(r["pct_of_ceiling"]) / 100
        if floor:
            ax.plot(*zip(*sorted(floor.items())), ":", color="black", label="roofline floor (measured ceilings)")
        k, n = pr[0]["K"], pr[0]["N"]
        ax.set(xscale="log", yscale="log", xlabel="M (routed rows)", ylabel="median ms",
               title=f"{shape} K={k} N={n} {dtype}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_layer(rows: list[dict], path: str) -> bool:
    """Layer forward time vs tokens T per backend, one panel per quant mode (log-log). False if there
    is no timed layer row."""
    rs = [r for r in rows if r["bench"] == "layer" and r.get("median_ms") and not r.get("error")]
    if not rs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quants = list(dict.fromkeys(r["quant"] for r in rs))
    fig, axes = plt.subplots(1, len(quants), figsize=(6.5 * len(quants), 4.5), squeeze=False)
    backends = list(dict.fromkeys(r["backend"] for r in rs))
    colors = {b: plt.cm.tab20(i % 20) for i, b in enumerate(backends)}
    for ax, quant in zip(axes.flat, quants):
        pr = [r for r in rs if r["quant"] == quant]
        for b in dict.fromkeys(r["backend"] for r in pr):
            pts = sorted((int(r["T"]), float(r["median_ms"])) for r in pr if r["backend"] == b)
            ax.plot(*zip(*pts), "-", marker="o", color=colors[b], label=b)
        r0 = pr[0]
        ax.set(xscale="log", yscale="log", xlabel="T (tokens)", ylabel="median ms",
               title=f"layer E={r0['E']} topk={r0['topk']} H={r0['H']} I={r0['I']} {quant}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


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


def stats_line(rows: list[dict]) -> str:
    n_err = sum(1 for r in rows if r.get("error"))
    n_wrong = sum(1 for r in rows if str(r.get("error") or "").startswith("WRONG"))
    return f"{len(rows)} rows, {len(rows) - n_err} timed, {n_err} errors ({n_wrong} wrong results)"

