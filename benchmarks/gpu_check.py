"""One call on the GPU machine: the test suite on the GPU, then the reference layer of every
preset at real size in both frameworks (JAX via XLA on the GPU, torch on CUDA), compared.

Usage (on the GPU machine, from the repo root; nothing to install there)::

    PYTHONPATH=. python3 benchmarks/gpu_check.py [--skip-tests] [--tests "tests/test_x.py ...; tests/test_y.py"] [--workers 12] [--memcheck]
        [--bench=--quick] [--tokens 256] [--presets a,b] [--quants none,fp8_block] [--kernels]
        [--cli-checks "mixtral-8x7b:none,deepseek-v3:fp8_block"] [--check-tokens 16]

``;`` splits ``--tests`` / ``--memcheck-tests`` into groups that run as parallel processes (and the
test run beside the memcheck run); ``--cli-checks`` runs ``epmoe check`` at full model size in this
process, its tables into ``$OUT/checks.log``.

Prints a short table last. Weights are drawn on the GPU in torch (bf16, ~ N(0, 1/K)) and
handed to JAX through DLPack (zero-copy), so both frameworks see the same bits; each
framework quantizes them itself (and the FP8 codes are checked bit-identical).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import numpy as np  # noqa: E402


def _pythonpath() -> str:
    """The repo root first, then whatever PYTHONPATH already holds (e.g. a `pip install --target` folder)."""
    return os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)


def _run(cmd: list[str], env: dict, timeout_s: int, log_name: str | None = None,
         out_dir: str | None = None) -> tuple[str, object, float]:
    """Run ``cmd``; return (combined log, return code or "timeout", seconds); the log also goes to
    ``out_dir/log_name`` when both are given."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text = [s.decode(errors="replace") if isinstance(s, bytes) else (s or "") for s in (exc.stdout, exc.stderr)]
        log, rc = "".join(text) + f"\nTIMEOUT after {timeout_s} s", "timeout"
    if out_dir and log_name:
        with open(os.path.join(out_dir, log_name), "w") as f:
            f.write(log)
    return log, rc, time.perf_counter() - t0


def _pytest_digest(log: str) -> list[str]:
    """The lines worth reading from a pytest log: FAILED/ERROR lines (one-line reasons) and the summary.
    (Whole logs can hold MLIR dumps of failed kernels, megabytes long.)"""
    keep = [l[:300] for l in log.splitlines()
            if l.startswith(("FAILED", "ERROR")) or " passed" in l or " failed" in l or "TIMEOUT" in l or l.startswith("/")]
    return keep[-40:]


def _groups(spec: str) -> list[list[str]]:
    """``"a.py b.py; c.py -k 'not slow'"`` -> ``[["a.py", "b.py"], ["c.py", "-k", "not slow"]]``: each group is
    one process (shell quoting inside a group)."""
    import shlex

    return [shlex.split(g) for g in spec.split(";") if g.strip()]


def _parallel(cmds: list[tuple[list[str], str]], env: dict, timeout_s: int, log_name: str, out_dir: str | None):
    """Run the commands at once (the GPU is shared; compiling is CPU-bound and the machine has 16 cores);
    their logs are joined into one file under $OUT (the device tool returns at most 8 files)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(cmds)) as pool:
        results = list(pool.map(lambda c: _run(c[0], env, timeout_s), cmds))
    if out_dir:
        with open(os.path.join(out_dir, log_name), "w") as f:
            for (_, label), (log, rc, dt) in zip(cmds, results):
                f.write(f"\n===== {label}: rc={rc} ({dt:.0f} s) =====\n{log}")
    return results


def _pytest_groups(out_dir: str | None, timeout_s: int, groups: list[list[str]], log_name: str,
                   wrapper: tuple[str, ...] = (), workers: int = 0) -> list[str]:
    """pytest on the GPU (``EPMOE_TEST_DEVICE=gpu``), one process per group, all at once, each under
    ``wrapper`` (e.g. compute-sanitizer); one summary line per group (with the sanitizer's verdict).
    ``workers > 0``: each group spreads its tests over that many pytest-xdist processes (``-n``,
    ``--dist load``: test by test, so one long file no longer sets the wall time)."""
    env = dict(os.environ, EPMOE_TEST_DEVICE="gpu", PYTHONPATH=_pythonpath())
    xdist = ["-n", str(workers), "--dist", "load"] if workers > 0 else []
    cmds = [([*wrapper, sys.executable, "-m", "pytest", "-q", "--tb=line", "--no-header", "-p", "no:cacheprovider",
              *xdist, *g], " ".join(g)) for g in groups]
    what = "memcheck" if wrapper else "pytest on GPU"
    lines = []
    for (_, label), (log, rc, dt) in zip(cmds, _parallel(cmds, env, timeout_s, log_name, out_dir)):
        errors = [l for l in log.splitlines() if "ERROR SUMMARY" in l]
        digest = _pytest_digest(log)
        print("\n".join(digest + errors[-3:]))
        verdict = (errors[-1] if errors else "no summary") + ", " if wrapper else ""
        lines.append(f"{what} ({label}): rc={rc}, {verdict}{digest[-1] if digest else '(no output)'} ({dt:.0f} s)")
    return lines


def run_tests(out_dir: str | None, timeout_s: int, groups: list[list[str]], workers: int = 0) -> list[str]:
    return _pytest_groups(out_dir, timeout_s, groups, "gpu_tests.log", workers=workers)


def run_memcheck(out_dir: str | None, timeout_s: int, groups: list[list[str]]) -> list[str]:
    """The Triton kernel tests under ``compute-sanitizer --tool memcheck``."""
    return _pytest_groups(out_dir, timeout_s, groups, "memcheck.log",
                          wrapper=("compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "9"))


def run_bench(out_dir: str | None, timeout_s: int, bench_args: str) -> str:
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    bench_out = os.path.join(out_dir or "benchmarks/results", "bench")
    cmd = [sys.executable, "benchmarks/bench.py", *bench_args.split(), "--out", bench_out]
    log, rc, dt = _run(cmd, env, timeout_s, "bench.log", out_dir)
    print(log[-6000:])
    return f"bench ({bench_args}): rc={rc} ({dt:.0f} s), tables in {bench_out}/bench.md"


def run_cli_checks(out_dir: str | None, specs: list[str], tokens: int) -> list[dict]:
    """``epmoe check --preset P --quant Q --tokens T`` at full size for each ``P:Q`` in ``specs``, each in a child
    process (so that one check's host memory is given back before the next: in one process, Kimi K2's check after
    Llama 4 Maverick's was killed by the host's out-of-memory killer on the 128 GiB machine); the tables
    go to ``$OUT/checks.log``. One dict per check: exit code, seconds, failed stages, skipped implementations, the
    largest relative error per stage."""
    import io
    import json
    import tempfile

    results = []
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    log = open(os.path.join(out_dir, "checks.log"), "w") if out_dir else io.StringIO()
    with log, tempfile.TemporaryDirectory() as tmp:
        for spec in specs:
            preset, _, quant = spec.partition(":")
            quant = quant or "none"
            jpath = os.path.join(tmp, f"{preset}_{quant}.json")
            argv = ["check", "--preset", preset, "--quant", quant, "--tokens", str(tokens), "--json", jpath]
            cmd = [sys.executable, "-c", "import sys; from interop import cli; sys.exit(cli.main(sys.argv[1:]))", *argv]
            text, rc, dt = _run(cmd, env, 3600)
            if isinstance(rc, int) and rc < 0:  # killed by a signal (e.g. the out-of-memory killer: -9)
                rc = f"killed by signal {-rc}"
            log.write(f"\n===== epmoe {' '.join(argv[:-2])}: rc={rc} ({dt:.0f} s) =====\n{text}")
            log.flush()
            row = {"check": f"{preset}:{quant}", "T": tokens, "rc": rc, "seconds": round(dt, 1)}
            if os.path.exists(jpath):
                data = json.load(open(jpath))
                row.update(ok=data["ok"], failed_stages=data["failed_stages"], skipped=data["skipped"], errors=data["errors"],
                           not_served=data.get("not_served") or {})
                worst: dict[str, float] = {}
                for c in data["comparisons"]:
                    err = c["metrics"].get("rel_fro")
                    if isinstance(err, (int, float)):  # per stage, the largest over outputs and pairs
                        worst[c["stage"]] = max(worst.get(c["stage"], 0.0), float(err))
                row["max_rel_fro"] = worst
                row["n_comparisons"] = len(data["comparisons"])
            results.append(row)
            print(f"epmoe check {preset} {quant} T={tokens}: rc={rc} ({dt:.0f} s)"
                  + (f" failed={row.get('failed_stages')} skipped={list(row.get('skipped', {}))}" if rc != 0 else
                     f", {row.get('n_comparisons')} comparisons, layer max rel err {row.get('max_rel_fro', {}).get('layer', float('nan')):.1e}")
                  + (f"; not served: {', '.join(row['not_served'])}" if row.get("not_served") else ""),
                  flush=True)
    return results


def rel_fro(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def check_preset(name: str, quant: str, T: int, seed: int = 0, kernels: bool = False) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    import moe_pallas
    import moe_torch
    from moe_contract import get_preset

    config = get_preset(name).config(quant=quant)
    H, I, E, Et = config.hidden_size, config.intermediate_size, config.num_experts, config.num_total_experts
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    x = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g, device=dev)
    bias = (0.1 * torch.randn(E, generator=g, device=dev)) if config.routing == "biased_grouped_topk" else None
    w13 = torch.empty(Et, 2 * I, H, device=dev, dtype=torch.bfloat16)
    w2 = torch.empty(Et, H, I, device=dev, dtype=torch.bfloat16)
    for e in range(Et):  # expert by expert: no float32 temporaries of the whole tensor
        w13[e] = (torch.randn(2 * I, H, generator=g, device=dev) * H**-0.5).to(torch.bfloat16)
        w2[e] = (torch.randn(H, I, generator=g, device=dev) * I**-0.5).to(torch.bfloat16)

    def quantize(mod, w13_, w2_):
        """quantize_layer_weights, a few experts at a time (bounded temporaries at DeepSeek-V3 size)."""
        if quant == "none":
            return w13_, None, w2_, None
        return mod.quantize_layer_weights(w13_, w2_, config)

    row = {"preset": name, "quant": quant, "T": T}
    # torch reference
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tw = quantize(moe_torch, w13, w2)
    out_t = moe_torch.moe_forward(x, logits, tw[0], tw[2], config, w13_scale=tw[1], w2_scale=tw[3], e_score_correction_bias=bias)
    torch.cuda.synchronize()
    row["torch_s"] = time.perf_counter() - t0
    out_t_np = out_t.float().cpu().numpy()

    # jnp reference on the same bits (DLPack, zero-copy)
    jx, jlogits = jnp.from_dlpack(x), jnp.from_dlpack(logits)
    jw13, jw2 = jnp.from_dlpack(w13), jnp.from_dlpack(w2)
    jbias = jnp.from_dlpack(bias) if bias is not None else None
    t0 = time.perf_counter()
    jw = quantize(moe_pallas, jw13, jw2)
    fwd = jax.jit(moe_pallas.moe_forward, static_argnames=("config",))
    out_j = fwd(jx, jlogits, jw[0], jw[2], config, w13_scale=jw[1], w2_scale=jw[3], e_score_correction_bias=jbias)
    out_j.block_until_ready()
    row["jax_s"] = time.perf_counter() - t0
    out_j_np = np.asarray(out_j.astype(jnp.float32))

    if quant != "none":  # FP8 weight codes and scales bit-identical on the GPU
        same = True
        for a, b in ((jw[0], tw[0]), (jw[1], tw[1])):
            an = np.asarray(a.view(jnp.uint8) if a.dtype == jnp.float8_e4m3fn else a)
            bn = (b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b).cpu().numpy()
            same &= bool(np.array_equal(an, bn))
        row["fp8_weights_identical"] = same
    row["rel_err"] = rel_fro(out_j_np, out_t_np)
    row["finite"] = bool(np.isfinite(out_j_np).all() and np.isfinite(out_t_np).all())
    row["mean_abs"] = float(np.abs(out_t_np).mean())
    row["ok"] = row["finite"] and row["rel_err"] <= 1e-2 and row.get("fp8_weights_identical", True)

    if kernels:  # each framework's kernel backend against its own reference, and its time
        import triton.testing

        targs = (x, logits, tw[0], tw[2], config)
        tkw = dict(w13_scale=tw[1], w2_scale=tw[3], e_score_correction_bias=bias, implementation="triton")
        out_k = moe_torch.moe_forward(*targs, **tkw)
        row["triton_rel_err"] = rel_fro(out_k.float().cpu().numpy(), out_t_np)
        row["triton_ms"] = triton.testing.do_bench(lambda: moe_torch.moe_forward(*targs, **tkw), return_mode="median")
        kfwd = jax.jit(functools.partial(moe_pallas.moe_forward, implementation="pallas_triton"), static_argnames=("config",))
        jargs = (jx, jlogits, jw[0], jw[2])
        jkw = dict(w13_scale=jw[1], w2_scale=jw[3], e_score_correction_bias=jbias)
        out_pk = kfwd(*jargs, config, **jkw)
        row["pallas_rel_err"] = rel_fro(np.asarray(out_pk.astype(jnp.float32)), out_j_np)
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            kfwd(*jargs, config, **jkw).block_until_ready()
            times.append(time.perf_counter() - t0)
        row["pallas_ms"] = 1e3 * float(np.median(times[2:]))
        mfwd = jax.jit(functools.partial(moe_pallas.moe_forward, implementation="pallas_mosaic_gpu"), static_argnames=("config",))
        row["mosaic_rel_err"] = rel_fro(np.asarray(mfwd(*jargs, config, **jkw).astype(jnp.float32)), out_j_np)
        row["ok"] = row["ok"] and max(row["triton_rel_err"], row["pallas_rel_err"], row["mosaic_rel_err"]) <= 1e-2
    del tw, jw, out_t, out_j, w13, w2, jw13, jw2
    torch.cuda.empty_cache()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--test-timeout", type=int, default=540, help="seconds for the pytest run")
    parser.add_argument("--presets", default="tiny,mixtral-8x7b,qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3")
    parser.add_argument("--quants", default="none,fp8_per_token,fp8_block")
    parser.add_argument("--tests", default="tests",
                        help="pytest targets for the GPU test run; ';' splits them into groups run as parallel processes")
    parser.add_argument("--workers", type=int, default=0,
                        help="pytest-xdist processes per test group (the whole suite on one H200 in one call: "
                             "--workers 12; needs pytest-xdist: README 'GPU checks')")
    parser.add_argument("--memcheck", action="store_true", help="also run the Triton kernel tests under compute-sanitizer")
    parser.add_argument("--memcheck-tests", default="tests/test_triton_kernels.py; tests/test_triton_grouped_gemm.py; "
                        "tests/test_triton_permute.py; tests/test_triton_gate.py", help="';'-separated groups, run in parallel")
    parser.add_argument("--memcheck-timeout", type=int, default=300)
    parser.add_argument("--bench", default=None, help="also run benchmarks/bench.py with these arguments (e.g. '--quick')")
    parser.add_argument("--bench-timeout", type=int, default=420)
    parser.add_argument("--cli-checks", default="",
                        help="comma list of preset:quant for `epmoe check` at full size (e.g. 'mixtral-8x7b:none,deepseek-v3:fp8_block')")
    parser.add_argument("--check-tokens", type=int, default=16, help="T of the --cli-checks")
    parser.add_argument("--kernels", action="store_true",
                        help="also run the layer with the kernel backends (triton, pallas_triton) vs the references")
    args = parser.parse_args()
    # a fresh per-user tuning cache for this run (the shipped tables only); it also spares the GPU machine platformdirs
    os.environ.setdefault("EPMOE_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), f"epmoe-cache-{os.getpid()}"))
    out_dir = os.environ.get("OUT")
    summary = []
    jobs = []  # the GPU test run and the memcheck run go at once (each its own processes)
    if not args.skip_tests:
        if args.workers > 0:
            try:
                import xdist  # noqa: F401
            except ImportError:
                print("gpu_check: --workers needs pytest-xdist on this machine (carry its wheel and execnet's)", file=sys.stderr)
                return 2
        jobs.append(functools.partial(run_tests, out_dir, args.test_timeout, _groups(args.tests), args.workers))
    if args.memcheck:
        jobs.append(functools.partial(run_memcheck, out_dir, args.memcheck_timeout, _groups(args.memcheck_tests)))
    if jobs:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(jobs)) as pool:
            for lines in list(pool.map(lambda job: job(), jobs)):
                summary.extend(lines)
    if args.bench is not None:
        summary.append(run_bench(out_dir, args.bench_timeout, args.bench))
    checks = run_cli_checks(out_dir, [c for c in args.cli_checks.split(",") if c], args.check_tokens) if args.cli_checks else []
    rows = []
    for name in [p for p in args.presets.split(",") if p]:  # --presets "" skips the preset checks
        for quant in args.quants.split(","):
            try:
                row = check_preset(name, quant, args.tokens, kernels=args.kernels)
            except Exception as exc:  # report and go on: one preset's failure must not hide the others
                row = {"preset": name, "quant": quant, "T": args.tokens, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append(row)
            print(row, flush=True)
    import json

    if out_dir:
        with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
            json.dump({"summary": summary, "cli_checks": checks, "rows": rows}, f, indent=1, default=str)
    print("\n".join(summary))
    print(f"\n{'preset':<17}{'quant':<15}{'T':>5}{'jax s':>8}{'torch s':>9}{'rel err':>11}{'fp8 w ==':>10}  verdict")
    for r in rows:
        if "error" in r:
            print(f"{r['preset']:<17}{r['quant']:<15}{r['T']:>5}  ERROR {r['error']}")
            continue
        print(f"{r['preset']:<17}{r['quant']:<15}{r['T']:>5}{r['jax_s']:>8.2f}{r['torch_s']:>9.2f}{r['rel_err']:>11.2e}"
              f"{str(r.get('fp8_weights_identical', '-')):>10}  {'agree' if r['ok'] else 'FAIL'}"
              + (f"  triton {r['triton_rel_err']:.1e} {r['triton_ms']:.2f} ms, pallas {r['pallas_rel_err']:.1e} "
                 f"{r['pallas_ms']:.2f} ms (wall, jit), mosaic GEMMs {r['mosaic_rel_err']:.1e}" if "triton_ms" in r else ""))
    for c in checks:
        print(f"epmoe check {c['check']:<28} T={c['T']:<5} rc={c['rc']}  {c['seconds']:>6.0f} s  "
              + ("agree" if c["rc"] == 0 else f"FAIL {c.get('failed_stages')} {str(c.get('errors'))[:200]}"))
    return 0 if all(r["ok"] for r in rows) and all(c["rc"] == 0 for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
