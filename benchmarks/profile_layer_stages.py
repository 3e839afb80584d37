"""Per-kernel time of one MoE layer forward (the bench's default layer: E=32, H=7168, I=2048, top-8 softmax), JAX or
PyTorch, on the GPU: where the layer's time goes beside its two grouped GEMMs (torch: ``--backward`` profiles the
forward + backward).

    python3 benchmarks/profile_layer_stages.py --framework jax --quant fp8_block --t 4096
    python3 benchmarks/profile_layer_stages.py --framework torch --quant fp8_block --t 4096

JAX: ``jax.experimental.mosaic.gpu.profiler.measure(aggregate=False)`` (CUPTI: every kernel of the jitted
``moe_forward``, median over ``--iterations``). PyTorch: ``torch.profiler`` CUDA kernel times (mean over the
iterations). Prints each kernel's ms and share, largest first, and the total. One framework a process (a torch
row timed beside JAX in one process measured slower at small M: BENCHMARKS.md). A diagnostic tool, not a
benchmark row (``bench.py --what layer`` gives those).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # ``benchmarks.host_time`` when run as a script
    sys.path.insert(0, _ROOT)


def _report(kernels: dict[str, float], label: str, top: int) -> None:
    total = sum(kernels.values())
    print(f"== {label}: {len(kernels)} kernels, {total:.3f} ms a step", flush=True)
    for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {ms:8.4f} ms {100 * ms / total:5.1f}%  {name[:110]}", flush=True)


def profile_jax(args) -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental.mosaic.gpu import profiler

    import moe_pallas

    config = moe_pallas.MoEConfig(hidden_size=args.h, intermediate_size=args.i, num_experts=args.e, topk=args.topk,
                                  routing="softmax_topk", renormalize=True, quant=args.quant)
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (args.t, args.h), jnp.float32).astype(jnp.bfloat16)
    logits = jax.random.normal(k[1], (args.t, args.e), jnp.float32)
    # drawn in bf16: a float32 draw of w13 at E=256 is a 28 GiB temporary
    w13 = jax.random.normal(k[2], (args.e, 2 * args.i, args.h), jnp.bfloat16) * jnp.bfloat16(args.h**-0.5)
    w2 = jax.random.normal(k[3], (args.e, args.h, args.i), jnp.bfloat16) * jnp.bfloat16(args.i**-0.5)
    w13, s13, w2, s2 = moe_pallas.quantize_layer_weights(w13, w2, config)

    @jax.jit
    def f(x, logits, w13, w2, s13, s2):
        return moe_pallas.moe_forward(x, logits, w13, w2, config, w13_scale=s13, w2_scale=s2,
                                      implementation=args.implementation)

    _, timings = profiler.measure(f, aggregate=False, iterations=args.iterations)(x, logits, w13, w2, s13, s2)
    if not timings:
        raise SystemExit("profile_layer_stages: CUPTI saw no kernel (a GPU is needed)")
    if args.iterations == 1:  # measure returns one iteration's list unwrapped
        timings = [timings]
    per = collections.defaultdict(list)
    for it in timings:
        seen = collections.Counter()
        for name, ms in it:
            seen[name] += 1
            per[f"{name} #{seen[name]}" if seen[name] > 1 else name].append(ms)
    _report({n: float(np.median(v)) for n, v in per.items()}, f"jax {args.implementation} {args.quant} T={args.t}",
            args.top)


def profile_torch(args) -> None:
    import torch

    import moe_torch

    if args.backward and args.quant != "none":
        raise SystemExit("profile_layer_stages: --backward profiles the bf16 layer (--quant none)")

    dev = torch.device("cuda")
    config = moe_torch.MoEConfig(hidden_size=args.h, intermediate_size=args.i, num_experts=args.e, topk=args.topk,
                                 routing="softmax_topk", renormalize=True, quant=args.quant)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(args.t, args.h, generator=g, device=dev).to(torch.bfloat16)
    logits = torch.randn(args.t, args.e, generator=g, device=dev)
    w13 = (torch.randn(args.e, 2 * args.i, args.h, generator=g, device=dev) * args.h**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(args.e, args.h, args.i, generator=g, device=dev) * args.i**-0.5).to(torch.bfloat16)
    w13, s13, w2, s2 = moe_torch.quantize_layer_weights(w13, w2, config)
    if args.backward:
        for t in (x, logits, w13, w2):
            t.requires_grad_(True)
        d_out = torch.randn(args.t, args.h, generator=g, device=dev).to(torch.bfloat16)

    def f():
        out = moe_torch.moe_forward(x, logits, w13, w2, config, w13_scale=s13, w2_scale=s2, implementation="triton",
                                    recompute=args.recompute)
        if args.backward:
            torch.autograd.grad(out, (x, logits, w13, w2), d_out)

    for _ in range(3):
        f()
    torch.cuda.synchronize()
    if args.host:
        _report_host(f, args.iterations, args.top)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iterations):
            f()
        torch.cuda.synchronize()
    if args.gaps:
        _report_gaps(prof, args.iterations, args.top)
    kernels = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if t > 0:
            kernels[ev.key] = t / 1e3 / args.iterations
    _report(kernels, f"torch triton {args.quant} T={args.t}" + (" forward + backward" if args.backward else ""),
            args.top)


def _report_gaps(prof, iterations: int, top: int) -> None:
    """The GPU's idle time between the profiled steps' kernels, memsets and copies (from the chrome trace): a
    wall time above the kernels' sum is host work the GPU waited for (a sync, a slow launch path)."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    evs = sorted((e["ts"], e["ts"] + e.get("dur", 0.0), e.get("name", "?")) for e in trace.get("traceEvents", [])
                 if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))
    if not evs:
        print("== gaps: no GPU events in the trace")
        return
    gaps, busy, end = [], 0.0, evs[0][0]
    for i, (t0, t1, name) in enumerate(evs):
        if t0 > end:
            gaps.append((t0 - end, evs[i - 1][2] if i else "?", name))
        busy += t1 - t0
        end = max(end, t1)
    span = evs[-1][1] - evs[0][0]
    print(f"== gaps: span {span / 1e3 / iterations:.3f} ms a step, GPU busy {busy / 1e3 / iterations:.3f}, idle "
          f"{sum(g for g, _, _ in gaps) / 1e3 / iterations:.3f} ({len(gaps)} gaps over {iterations} steps)")
    for g, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {g / 1e3:8.4f} ms  after {before[:70]}  before {after[:70]}")


def _report_host(f, iterations: int, top: int) -> None:
    """The host's time a step (Python: checks, config choices, launches) by function, from ``cProfile`` (its own
    overhead included): what the GPU waits for where a step's kernels are short."""
    from benchmarks.host_time import launch_and_finish, print_cprofile

    host, wall = launch_and_finish(f, iterations)
    print(f"== host: {host * 1e3:.3f} ms a step to launch (unprofiled), {wall * 1e3:.3f} ms a step to finish")
    print_cprofile(f, iterations, top, sorts=("cumulative", "tottime"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", choices=("jax", "torch"), required=True)
    p.add_argument("--quant", default="fp8_block", choices=("none", "fp8_per_token", "fp8_block"))
    p.add_argument("--t", type=int, default=4096)
    p.add_argument("--e", type=int, default=32)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--h", type=int, default=7168)
    p.add_argument("--i", type=int, default=2048)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--top", type=int, default=25, help="kernels printed")
    p.add_argument("--implementation", default="pallas_mosaic_gpu", help="JAX: moe_forward's implementation")
    p.add_argument("--backward", action="store_true", help="torch: profile forward + backward (gradients of x, the "
                   "router logits, w13 and w2 from a random d_out), bf16")
    p.add_argument("--recompute", action="store_true", help="torch: moe_forward(recompute=True)")
    p.add_argument("--host", action="store_true", help="torch: also the host's time a step by function (cProfile)")
    p.add_argument("--gaps", action="store_true", help="torch: also the GPU's idle time between the steps' kernels "
                   "and the longest gaps (what the kernel sum leaves out of a step's wall time)")
    args = p.parse_args()
    (profile_jax if args.framework == "jax" else profile_torch)(args)


if __name__ == "__main__":
    main()
