"""The host's side of moe_torch's layer on a GPU: how long a forward + backward step takes to *launch* against how long
it takes to *finish*, whether anything in it synchronizes with the GPU, and where the launch time goes.

    python3 benchmarks/host_time.py                      # T = 1024 and 8192, E=64, H=2048, I=1024, top-8, bf16
    python3 benchmarks/host_time.py --stages --ops       # + host time per stage call in a step, per single op call

A step whose launch time is close to its finish time is host-bound: the GPU waits on the launches (no sync is
needed for that). ``--stages`` wraps each stage function the layer calls (``moe_torch.layer``'s names) with a
``perf_counter`` pair (nested calls are counted in each level); ``--ops`` times single public op calls at T=1024's
shapes. A diagnostic tool: what it prints is not a benchmark row.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
import traceback
import warnings


def launch_and_finish(f, n: int) -> tuple[float, float]:
    """Seconds a call of ``f`` takes to return on the host and to finish on the GPU, over ``n`` calls in a row (the GPU
    idle at the start). Also ``profile_layer_stages.py --host``'s."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n, (time.perf_counter() - t0) / n


def print_cprofile(f, n: int, top: int, sorts=("tottime",)) -> None:
    """cProfile of ``n`` calls of ``f`` (host time by function, its own overhead included), printed by each key of
    ``sorts``."""
    import cProfile
    import pstats

    import torch

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        f()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    for key in sorts:
        stats.sort_stats(key).print_stats(top)


def _layer(T: int, H: int, I: int, E: int, topk: int):
    import torch

    from moe_contract.config import MoEConfig

    cfg = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, topk=topk)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(T, H, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    lg = torch.randn(T, E, device="cuda", generator=g).requires_grad_()
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    return cfg, x, lg, w13, w2


def _step(cfg, x, lg, w13, w2) -> None:
    import torch

    import moe_torch

    y = moe_torch.moe_forward(x, lg, w13, w2, cfg)
    y.backward(torch.ones_like(y))


def launch_vs_finish(args) -> None:
    """Per T: ms a step to launch and to finish (1 and 10 steps in a row), and the synchronizing calls of one step
    (``torch.cuda.set_sync_debug_mode``), each with the stack that made it."""
    import torch

    for T in args.ts:
        layer = _layer(T, args.h, args.i, args.e, args.topk)
        for _ in range(3):
            _step(*layer)
        for n in (1, 10):
            host, wall = launch_and_finish(lambda: _step(*layer), n)
            print(f"T={T} x{n}: host {1e3 * host:.3f} ms/step to launch, {1e3 * wall:.3f} ms/step to finish", flush=True)
        seen: collections.Counter = collections.Counter()

        def show(message, category, filename, lineno, file=None, line=None):
            where = "".join(traceback.format_stack(limit=14)[:-3])[-600:]
            if "set_sync_debug_mode" not in where:  # turning the mode on reports itself once
                seen[where] += 1

        old = warnings.showwarning
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _step(*layer)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old
        print(f"T={T}: {sum(seen.values())} synchronizing calls in one step, {len(seen)} places")
        for where, n in seen.items():
            print(f"--- x{n}\n{where}")


_STAGES = ("select_experts", "select_experts_backward", "routing_metadata", "permute", "permute_backward",
           "grouped_gemm", "grouped_gemm_dgrad", "grouped_gemm_wgrad", "act_and_mul", "act_and_mul_backward", "combine",
           "scale_rows", "slot_weights", "slot_weights_backward", "scaled_slot_rows", "scaled_slot_rows_backward",
           "run_gate", "dispatch_ids", "run_experts", "experts_backward", "check_layer_inputs", "check_expert_biases",
           "drop_over_capacity", "router_losses")


def stage_times(args, T: int = 1024, steps: int = 20) -> None:
    """Host ms a step in each stage function ``moe_torch.layer`` calls (wrapped in place for this process)."""
    import torch

    import moe_torch.layer as L

    acc: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += time.perf_counter() - t0
                calls[name] += 1
        return wrapper

    for name in _STAGES:
        if hasattr(L, name):
            setattr(L, name, timed(name, getattr(L, name)))
    layer = _layer(T, args.h, args.i, args.e, args.topk)
    for _ in range(5):
        _step(*layer)
    torch.cuda.synchronize()
    acc.clear()
    calls.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        _step(*layer)
    total = (time.perf_counter() - t0) / steps
    torch.cuda.synchronize()
    print(f"host {total * 1e3:.3f} ms a step (fwd+bwd, T={T})")
    for name, seconds in acc.most_common():
        print(f"  {name:28s} {seconds / steps * 1e3:7.3f} ms a step, {calls[name] // steps} calls")


def _ops(args, T: int = 1024) -> dict:
    """Single public ops at the layer's T=1024 shapes, as zero-argument calls (a torch op for scale)."""
    import torch

    import moe_torch
    from moe_torch.ops.activation.api import act_and_mul
    from moe_torch.ops.gate.api import select_experts
    from moe_torch.ops.grouped_gemm.api import grouped_gemm_dgrad, grouped_gemm_wgrad
    from moe_torch.ops.permute.api import permute, routing_metadata

    k, E, H, I = args.topk, args.e, args.h, args.i
    h = torch.randn(T * k, 2 * I, device="cuda").bfloat16()
    xs = torch.randn(T * k, H, device="cuda").bfloat16()
    dy = torch.randn(T * k, 2 * I, device="cuda").bfloat16()
    w = torch.randn(E, 2 * I, H, device="cuda").bfloat16()
    off = torch.arange(0, E + 1, device="cuda", dtype=torch.int32) * (T * k // E)
    lg = torch.randn(T, E, device="cuda")
    x = torch.randn(T, H, device="cuda").bfloat16()
    _, ids = select_experts(lg, topk=k)
    meta = routing_metadata(ids, E)
    ops = {"torch.add": lambda: torch.add(lg, 1), "act_and_mul": lambda: act_and_mul(h, activation="silu"),
           "select_experts": lambda: select_experts(lg, topk=k), "routing_metadata": lambda: routing_metadata(ids, E),
           "permute": lambda: permute(x, meta.dst2src, topk=k), "grouped_gemm": lambda: moe_torch.grouped_gemm(xs, w, off),
           "grouped_gemm_dgrad": lambda: grouped_gemm_dgrad(dy, w, off),
           "grouped_gemm_wgrad": lambda: grouped_gemm_wgrad(xs, dy, off)}
    return ops


def op_times(args, n: int = 40) -> None:
    """Host microseconds a call of each of :func:`_ops`."""
    for name, fn in _ops(args).items():
        for _ in range(3):
            fn()
        seconds, _ = launch_and_finish(fn, n)
        print(f"{name:26s} host {seconds * 1e6:8.1f} us a call")


def op_profile(args, n: int = 200, top: int = 30) -> None:
    """cProfile of ``n`` calls of each op named in ``args.profile`` (host time by function, the most first)."""
    import torch

    ops = _ops(args)
    for name in args.profile:
        fn = ops[name]
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        print(f"=== {name}: {n} calls, by own time")
        print_cprofile(fn, n, top)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ts", default="1024,8192", help="comma list of token counts for the launch / finish times")
    p.add_argument("--e", type=int, default=64)
    p.add_argument("--h", type=int, default=2048)
    p.add_argument("--i", type=int, default=1024)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--stages", action="store_true", help="host time per stage call in a step (T=1024)")
    p.add_argument("--ops", action="store_true", help="host time per single op call (T=1024's shapes)")
    p.add_argument("--profile", default="", help="comma list of --ops names: a cProfile of their host time")
    args = p.parse_args(argv)
    args.ts = [int(v) for v in args.ts.split(",") if v]
    args.profile = [v for v in args.profile.split(",") if v]
    launch_vs_finish(args)
    if args.stages:
        stage_times(args)
    if args.ops:
        op_times(args)
    if args.profile:
        op_profile(args)


if __name__ == "__main__":
    main()
