"""Expert parallelism, 1 vs N GPUs: step time, bytes moved per all-to-all, and the share
of time in communication, for both frameworks and both EP modes.

Usage (from the repo root; nothing to install on the GPU machine)::

    PYTHONPATH=. python3 benchmarks/bench_ep.py                          # both frameworks, ep 1 and #GPUs
    PYTHONPATH=. python3 benchmarks/bench_ep.py --framework torch --ep-sizes 1,2 --tokens-per-device 256
    PYTHONPATH=. python3 benchmarks/bench_ep.py --tiny --ep-sizes 1,2     # CPU smoke run (2 host devices / gloo)

Writes ``bench_ep.json``, ``bench_ep.csv`` and ``bench_ep.md`` to ``--out`` (default ``$OUT``, else
``benchmarks/results``; rewritten after every framework / EP size, so a killed run keeps what it
had) and prints the short markdown table last. A row that fails carries ``error``; the run goes on.

What is run, per (framework, ep_size, mode, T = tokens per device):

- The layer: the DeepSeek-V3 MoE layer (``--preset deepseek-v3``: H=7168, I=2048, E=256 + 1 fused
  shared expert, topk 8, biased grouped top-k (8 groups keep 4), rsf 2.5; bf16, ``--quant none``
  by default) over an EP group of ``ep_size`` devices. **Global tokens = T * ep_size in both
  modes**: ``mode="all_to_all"`` (DeepEP-style) gives each device its ``T`` tokens;
  ``mode="replicated"`` (SGLang EPMoE) gives every device all ``T * ep_size`` tokens (each device
  runs its experts on all of them, then a float32 all-reduce). So a row at ep=2 does twice the
  work of the ep=1 row with the same T: compare throughput, not only step time.
- JAX: ``moe_pallas.ep_moe_forward`` jitted on a mesh of ``ep_size`` devices (out_sharding
  ``"replicated"`` for the replicated mode (psum), ``"tokens"`` for all_to_all (no all-gather),
  default GPU backends). ``step_ms``: host wall clock of ``n`` back-to-back calls +
  ``block_until_ready``, divided by ``n``; median / p20 / p80 over a few such loops.
  ``kernel_ms``: CUPTI kernel sum of one call (``jax.experimental.mosaic.gpu.profiler.measure``)
  where it works (``notes`` says why not otherwise); for ep > 1 this may sum the kernels of all
  devices (not verified), so ``step_ms`` is the number to compare.
- torch: ``moe_torch.ep_moe_forward``, one process per GPU (``torch.multiprocessing`` spawn,
  NCCL; gloo on the CPU), every rank drawing its own experts. ``dist.barrier()`` before timing,
  CUDA events around each step (``n`` steps after a warm-up); ``step_ms`` / p20 / p80 are rank 0's,
  ``step_max_rank_ms`` the largest median over ranks. The all_to_all mode synchronises with the
  host once per step (the split sizes), as DeepEP's normal mode.

Weights are drawn ON each device, expert by expert (``w ~ N(0, 1/K)``, bf16), each expert seeded
by its global index (JAX: ``fold_in(key, e)``; torch: a generator seeded from ``e``), so every EP
size sees the same global weights and no device ever holds more than its shard (ep=1 holds the
whole layer: 257 x 3 x 7168 x 2048 x 2 B = 22.6 GB bf16). Tokens ``x``, router logits and the
correction bias are drawn the same way, on the device, for ``T * max(ep_sizes)`` global tokens;
every EP size uses the first ``T * ep_size`` of them.

Communication (``comm_ms``, ``comm_share = comm_ms / step_ms``): an **isolated-collective
estimate, not an overlap-aware trace**: the collectives of the mode timed alone, on buffers of the
step's shapes and dtypes, with the step's actual split sizes (from the routing of the same
tokens), timed the same way as the step:

- replicated: the all-reduce (JAX ``psum`` in a ``shard_map``; torch ``dist.all_reduce``) of the
  float32 partial ``[T*ep, H]``.
- all_to_all: the size/offset exchanges and the ragged dispatch (rows + int32 expert ids) and
  combine (rows back) (JAX: ``ragged_all_to_all`` via ``moe_pallas.ep._ragged_exchange``, the
  dense fixed-capacity fallback on a CPU mesh; torch: ``all_to_all_single`` of the counts, then of
  the rows and ids with the uneven splits, then of the rows back, with the host sync of the splits).

Bytes per device per step (from the buffer shapes and dtypes; ``b`` bytes per element of ``x``):

- replicated: ``payload_bytes = T*ep * H * 4`` (the float32 partial); ``bytes_per_device =
  2 (P-1)/P * payload`` (what a ring all-reduce sends per device; 0 at ep=1).
- all_to_all: from the routing counted on the device (``counts[s, d]`` = (token, slot) rows that
  home device ``s`` sends to device ``d``): ``bytes_dispatch = sum_{d != r} counts[r, d] *
  (H*b + 4)`` + the size exchanges (JAX: two ``all_to_all`` of ``P`` int32; torch: one of ``P``
  int64, ``(P-1)`` entries leave the device), ``bytes_combine = sum_{s != r} counts[s, r] * H*b``;
  ``bytes_per_device`` = their sum, the maximum over devices ``r`` (``bytes_by_rank`` lists every
  device's). Rows a device keeps for itself are not counted (a local copy). On the CPU fallback
  JAX actually moves ``P`` times the worst case (dense blocks); the bytes still count the ragged
  exchange.
- ``comm_gbps = bytes_per_device / comm_ms`` (the bus-bandwidth sense: bytes a device sends per
  second of the collective).

Correctness guard: for ep_size > 1 the output is compared with the single-device layer
(``moe_forward`` of the same framework, ``ep_size=1``, all experts on one device) on the same
``T * ep_size`` global tokens, computed during the ep=1 pass when 1 is among ``--ep-sizes``
(``rel_err``: relative Frobenius error, max over ranks; None when there is no reference). At
DeepSeek-V3 size the reference needs the full 22.6 GB layer on one GPU: fine on an H200.
"""

from __future__ import annotations

import os
import sys

TINY = "--tiny" in sys.argv
os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast (inherited by spawned ranks); harmless for JAX
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks import harness as H  # noqa: E402

MODES = ("replicated", "all_to_all")
#: The stable row schema, in column order (CSV header, JSON keys). Fields that do not apply are None.
ROW_KEYS = (
    "bench", "framework", "backend", "preset", "mode", "ep_size", "tokens_per_device", "global_tokens",
    "H", "I", "E", "topk", "dtype", "quant",
    "step_ms", "step_p20_ms", "step_p80_ms", "step_max_rank_ms", "kernel_ms", "n_iters",
    "comm_ms", "comm_p20_ms", "comm_p80_ms", "comm_share",
    "bytes_per_device", "bytes_dispatch", "bytes_combine", "payload_bytes", "bytes_by_rank", "comm_gbps",
    "tokens_per_s", "rel_err", "timing_method", "compile_s", "notes", "error",
)
#: rel err above which an ep>1 row is marked WRONG (bf16; the float32 CPU test asks for 1e-5 itself).
REL_ERR_MAX = H.REL_ERR_MAX


# ---------------------------------------------------------------------------------------------- common


def make_config(args, **kw):
    from moe_contract import get_preset

    return get_preset("tiny" if args.tiny else args.preset).config(quant=args.quant, **kw)


def dtype_name(args) -> str:
    return args.dtype or ("float32" if args.tiny else "bfloat16")


def new_row(framework: str, backend: str, args, config, mode: str, ep: int, T: int) -> dict:
    row = dict.fromkeys(ROW_KEYS)
    row.update(bench="ep", framework=framework, backend=backend, preset="tiny" if args.tiny else args.preset, mode=mode,
               ep_size=ep, tokens_per_device=T, global_tokens=T * ep, H=config.hidden_size, I=config.intermediate_size,
               E=config.num_experts, topk=config.topk, dtype=dtype_name(args), quant=config.quant)
    return row


def iters_for(args, T: int) -> int:
    """Timed steps per loop: the same on every rank (collectives must pair up)."""
    if args.iters:
        return args.iters
    if args.tiny:
        return 3
    return 20 if T <= 1024 else 8


def replicated_bytes(T_global: int, H_: int, ep: int) -> dict:
    payload = T_global * H_ * 4
    ring = 2 * (ep - 1) / ep * payload
    return dict(payload_bytes=payload, bytes_per_device=ring, bytes_dispatch=None, bytes_combine=None,
                bytes_by_rank=";".join(str(int(ring)) for _ in range(ep)))


def a2a_bytes(counts: np.ndarray, H_: int, b: int, size_exchange_bytes: int) -> dict:
    """``counts[s, d]``: rows home device ``s`` sends to device ``d``. Per device ``r``: rows sent to
    others (dispatch: row + int32 id) and rows returned to others (combine: row)."""
    counts = np.asarray(counts, np.int64)
    ep = counts.shape[0]
    off = counts * (1 - np.eye(ep, dtype=np.int64))
    dispatch = off.sum(axis=1) * (H_ * b + 4) + (size_exchange_bytes if ep > 1 else 0)
    combine = off.sum(axis=0) * H_ * b
    total = dispatch + combine
    r = int(np.argmax(total))
    return dict(payload_bytes=int(counts.sum()) * H_ * b, bytes_per_device=int(total[r]), bytes_dispatch=int(dispatch[r]),
                bytes_combine=int(combine[r]), bytes_by_rank=";".join(str(int(t)) for t in total))


def finish_row(row: dict) -> dict:
    if row.get("step_ms") and row.get("comm_ms") is not None:
        row["comm_share"] = row["comm_ms"] / row["step_ms"]
    if row.get("comm_ms") and row.get("bytes_per_device"):
        row["comm_gbps"] = row["bytes_per_device"] / (row["comm_ms"] * 1e-3) / 1e9
    if row.get("step_ms"):
        row["tokens_per_s"] = row["global_tokens"] / (row["step_ms"] * 1e-3)
    if row.get("rel_err") is not None and not row["rel_err"] <= REL_ERR_MAX and not row.get("error"):
        row["error"] = f"WRONG: rel_err={row['rel_err']:.3g} > {REL_ERR_MAX:g} vs the single-device layer"
    return row


def short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def error_rows(framework: str, args, ep: int, msg: str) -> list[dict]:
    config = make_config(args)
    return [dict(new_row(framework, "-", args, config, m, ep, T), error=msg) for T in args.tokens for m in args.modes_list]


# ---------------------------------------------------------------------------------------------- torch


def _torch_seed(seed: int, *parts: int) -> int:
    s = seed
    for p in parts:
        s = (s * 1_000_003 + p + 1) % (2**62)
    return s


def torch_draw_local(config, device, dtype, seed: int):
    """This rank's ``w13 [E_local, 2I, H]``, ``w2 [E_local, H, I]`` (and FP8 scales), drawn on
    ``device`` expert by expert, expert ``e`` seeded by ``e`` (same bits whatever the EP size)."""
    import torch

    from moe_contract.config import WEIGHT_LAYOUT
    from moe_torch.ops.quant.api import quantize_weight_fp8

    Hs, I_ = config.hidden_size, config.intermediate_size
    start, n = config.local_expert_range()
    out = []
    for which, shape, k in ((0, (2 * I_, Hs), Hs), (1, (Hs, I_), I_)):
        w = torch.empty((n, *shape), dtype=dtype, device=device)
        for i in range(n):
            g = torch.Generator(device=device).manual_seed(_torch_seed(seed, which, start + i))
            w[i] = (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * (1.0 / math.sqrt(k))).to(dtype)
        if config.quant == "none":
            out += [w, None]
        else:
            qs = [quantize_weight_fp8(w[i : i + 1], WEIGHT_LAYOUT[config.quant]) for i in range(n)]
            del w
            out += [torch.cat([q for q, _ in qs]), torch.cat([s for _, s in qs])]
    return out  # w13, w13_s, w2, w2_s


def torch_draw_tokens(config, n_tokens: int, T: int, device, dtype, seed: int):
    import torch

    g = torch.Generator(device=device).manual_seed(_torch_seed(seed, 7, T))
    x = torch.randn((n_tokens, config.hidden_size), generator=g, device=device, dtype=torch.float32).to(dtype)
    logits = torch.randn((n_tokens, config.num_experts), generator=g, device=device, dtype=torch.float32)
    return x, logits


def torch_draw_bias(config, device, seed: int):
    import torch

    g = torch.Generator(device=device).manual_seed(_torch_seed(seed, 9))
    return torch.randn((config.num_experts,), generator=g, device=device, dtype=torch.float32) * 0.1


def torch_time(fn, device, n: int, warmup: int) -> list[float]:
    """Per-step ms of ``n`` steps (CUDA events on a GPU, perf_counter on the CPU), after a warm-up
    and a barrier, so that every rank starts together."""
    import torch
    import torch.distributed as dist

    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    times = []
    if cuda:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in ev]
    else:
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return times


def torch_worker(rank: int, world: int, init_method: str, backend: str, args, ref_dir: str, out_path: str) -> None:
    """One rank: draw its experts, run every (T, mode), rank 0 writes the merged rows."""
    import torch
    import torch.distributed as dist

    import moe_torch
    from moe_torch.ep import ep_moe_forward
    from moe_torch.layer import run_gate

    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            device_id=device if backend == "nccl" else None)
    dtype = getattr(torch, dtype_name(args))
    impl = "reference" if args.tiny else None
    max_ep = max(args.ep_list)
    config1 = make_config(args)
    cfg = config1.replace(ep_size=world, ep_rank=rank)
    rows = []
    try:
        t0 = time.perf_counter()
        w13, w13_s, w2, w2_s = torch_draw_local(cfg, device, dtype, args.seed)
        bias = torch_draw_bias(cfg, device, args.seed)
        if device.type == "cuda":
            torch.cuda.synchronize()
        draw_s = time.perf_counter() - t0
        kw = dict(w13_scale=w13_s, w2_scale=w2_s, e_score_correction_bias=bias, implementation=impl)
        b = torch.empty((), dtype=dtype).element_size()
        for T in args.tokens:
            T_global = T * world
            x_all, logits_all = torch_draw_tokens(cfg, T * max_ep, T, device, dtype, args.seed)
            ref_path = os.path.join(ref_dir, f"torch_ref_T{T}.pt")
            ref = torch.load(ref_path) if world > 1 and os.path.exists(ref_path) else None
            n = iters_for(args, T)
            for mode in args.modes_list:
                row = new_row("torch", "moe_torch" + ("-reference" if impl else "-default"), args, cfg, mode, world, T)
                row.update(n_iters=n, timing_method="cuda_events" if device.type == "cuda" else "perf_counter",
                           notes=f"weights drawn in {draw_s:.1f} s")
                mine: dict = {}
                try:
                    if mode == "replicated":
                        lo, hi = 0, T_global
                        x, logits = x_all[:T_global], logits_all[:T_global]
                    else:
                        lo, hi = rank * T, (rank + 1) * T
                        x, logits = x_all[lo:hi], logits_all[lo:hi]
                    step = lambda: ep_moe_forward(x, logits, w13, w2, cfg, mode=mode, **kw)  # noqa: E731
                    t1 = time.perf_counter()
                    out = step()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    mine["compile_s"] = time.perf_counter() - t1
                    if ref is not None:
                        mine["rel_err"] = H.rel_fro(out.float().cpu().numpy(), ref[lo:hi].numpy())
                    del out
                    mine["step"] = torch_time(step, device, n, warmup=2)
                    # -- the collectives alone, same shapes / splits
                    if mode == "replicated":
                        partial = torch.zeros((T_global, cfg.hidden_size), dtype=torch.float32, device=device)
                        comm = lambda: dist.all_reduce(partial)  # noqa: E731
                        mine["counts"] = None
                    else:
                        _, topk_ids = run_gate(logits, cfg, bias, impl)
                        K = cfg.num_slots
                        per_rank = cfg.num_experts // world
                        ids = topk_ids.reshape(-1)
                        owner = torch.clamp(ids.long() // per_rank, max=world - 1)
                        order = torch.argsort(owner, stable=True)
                        send_counts = torch.bincount(owner, minlength=world)
                        x_send = x[order // K].contiguous()
                        ids_send = ids[order].to(torch.int32)
                        mine["counts"] = send_counts.tolist()

                        def comm():
                            recv_counts = torch.empty_like(send_counts)
                            dist.all_to_all_single(recv_counts, send_counts)
                            ss, rs = send_counts.tolist(), recv_counts.tolist()
                            R = sum(rs)
                            x_recv = x_send.new_empty((R, x_send.shape[1]))
                            ids_recv = ids_send.new_empty((R,))
                            ws = [dist.all_to_all_single(x_recv, x_send, rs, ss, async_op=True),
                                  dist.all_to_all_single(ids_recv, ids_send, rs, ss, async_op=True)]
                            for w in ws:
                                w.wait()
                            y_back = x_send.new_empty(x_send.shape)
                            dist.all_to_all_single(y_back, x_recv, ss, rs)
                            return y_back
                    comm()
                    mine["comm"] = torch_time(comm, device, n, warmup=2)
                except Exception as exc:  # noqa: BLE001 - a row never aborts the run
                    mine["error"] = short_error(exc)
                    if args.verbose:
                        traceback.print_exc()
                gathered = [None] * world
                dist.all_gather_object(gathered, mine)
                if rank == 0:
                    errs = [g.get("error") for g in gathered if g.get("error")]
                    if errs:
                        row["error"] = errs[0]
                    if all("step" in g for g in gathered):
                        s = H.summarize(gathered[0]["step"])
                        row.update(step_ms=s["median_ms"], step_p20_ms=s["p20_ms"], step_p80_ms=s["p80_ms"],
                                   step_max_rank_ms=max(float(np.median(g["step"])) for g in gathered))
                    if all("comm" in g for g in gathered):
                        c = H.summarize(gathered[0]["comm"])
                        row.update(comm_ms=c["median_ms"], comm_p20_ms=c["p20_ms"], comm_p80_ms=c["p80_ms"])
                    row["compile_s"] = gathered[0].get("compile_s")
                    rel = [g["rel_err"] for g in gathered if g.get("rel_err") is not None]
                    row["rel_err"] = max(rel) if len(rel) == world else None
                    if mode == "replicated":
                        row.update(replicated_bytes(T_global, cfg.hidden_size, world))
                    elif all(g.get("counts") is not None for g in gathered):
                        row.update(a2a_bytes(np.array([g["counts"] for g in gathered]), cfg.hidden_size, b, (world - 1) * 8))
                    rows.append(finish_row(row))
                    print(progress_line(row), flush=True)
                    with open(out_path, "w") as f:  # after every row: a killed run keeps what it had
                        json.dump(rows, f)
            # The single-device reference for the ep>1 runs: every expert is here at ep=1.
            if world == 1 and max_ep > 1:
                try:
                    ref = moe_torch.moe_forward(x_all, logits_all, w13, w2, config1, **kw)
                    torch.save(ref.float().cpu(), ref_path)
                    del ref
                except Exception as exc:  # noqa: BLE001
                    print(f"torch reference at T={T * max_ep} failed: {short_error(exc)}", flush=True)
            del x_all, logits_all
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch(args, ep: int, ref_dir: str, deadline: float) -> list[dict]:
    import torch
    import torch.multiprocessing as mp

    cuda = torch.cuda.is_available() and not args.tiny
    if cuda and torch.cuda.device_count() < ep:
        return error_rows("torch", args, ep, f"needs {ep} GPUs; {torch.cuda.device_count()} visible")
    out_path = os.path.join(ref_dir, f"torch_rows_ep{ep}.json")
    init = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.start_processes(torch_worker, args=(ep, init, "nccl" if cuda else "gloo", args, ref_dir, out_path),
                             nprocs=ep, join=False, start_method="spawn")
    failure = None
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                failure = "timed out (time budget --max-minutes)"
                break
    except Exception as exc:  # noqa: BLE001 - a rank raised: its traceback, shortened
        failure = short_error(exc)
    rows = []
    if os.path.exists(out_path):
        with open(out_path) as f:
            rows = json.load(f)
    elif failure is None:
        failure = "no rows written by rank 0"
    if failure:  # the rows not produced carry the failure
        done = {(r["tokens_per_device"], r["mode"]) for r in rows}
        rows += [r for r in error_rows("torch", args, ep, failure) if (r["tokens_per_device"], r["mode"]) not in done]
    return rows


# ---------------------------------------------------------------------------------------------- JAX


def jax_draw_sharded(config, mesh, which: int, seed: int, dtype):
    """``w13`` (which=0) or ``w2`` (which=1) in ``shard_expert_weights`` layout ``[ep * E_lmax, ...]``,
    each device's slab drawn on that device, expert ``e`` from ``fold_in(key, e)``; padding experts
    (and their scales) are zero. Returns ``(w, scale or None)``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from moe_contract.config import WEIGHT_LAYOUT
    from moe_pallas.ops.quant.api import quantize_weight_fp8

    Hs, I_ = config.hidden_size, config.intermediate_size
    shape, k = ((2 * I_, Hs), Hs) if which == 0 else ((Hs, I_), I_)
    ep = config.ep_size
    ranges = [config.local_expert_range(r) for r in range(ep)]
    e_lmax = max(n for _, n in ranges)
    quant = config.quant

    @jax.jit
    def draw(key, ids):
        def one(e):
            w = jax.random.normal(jax.random.fold_in(key, jnp.maximum(e, 0)), shape, jnp.float32) * (1.0 / math.sqrt(k))
            w = jnp.where(e >= 0, w, 0.0).astype(dtype)
            if quant == "none":
                return w, jnp.zeros((), jnp.float32)
            q, s = quantize_weight_fp8(w[None], WEIGHT_LAYOUT[quant])
            return jnp.where(e >= 0, q[0], jnp.zeros_like(q[0])), jnp.where(e >= 0, s[0], 0.0)

        return jax.lax.map(one, ids)

    ws, ss = [], []
    for (start, n), dev in zip(ranges, mesh.devices.flat):
        ids = np.full((e_lmax,), -1, np.int32)
        ids[:n] = np.arange(start, start + n)
        key = jax.device_put(jax.random.fold_in(jax.random.PRNGKey(seed), which), dev)
        w, s = draw(key, jax.device_put(ids, dev))
        ws.append(w)
        ss.append(s)
    sharding = NamedSharding(mesh, P("ep"))
    w = jax.make_array_from_single_device_arrays((ep * e_lmax, *ws[0].shape[1:]), sharding, ws)
    s = None if quant == "none" else jax.make_array_from_single_device_arrays((ep * e_lmax, *ss[0].shape[1:]), sharding, ss)
    return w, s


def jax_time(compiled, args_, n: int, loops: int) -> dict:
    """Host wall clock: ``loops`` loops of ``n`` calls + block_until_ready, per call; median / p20 / p80."""
    call = lambda: compiled(*args_)  # noqa: E731
    H.jax_block(call())
    return H.summarize([H.wall_loop_ms(call, H.jax_block, n) for _ in range(loops)])


def jax_kernel_ms(compiled, args_, n: int) -> tuple[float | None, str | None]:
    import jax

    if jax.default_backend() != "gpu":
        return None, None
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, per_iter = profiler.measure(compiled, iterations=n)(*args_)
        if per_iter is None:
            return None, "cupti saw no kernel"
        per_iter = per_iter if isinstance(per_iter, list) else [per_iter]
        return float(np.median(per_iter)), None
    except Exception as exc:  # noqa: BLE001
        return None, f"cupti failed ({type(exc).__name__}: {str(exc)[:100]})"


def jax_main(args, rows_path: str) -> None:
    """The JAX pass (its own process: forced host devices on the CPU, GPU memory apart from torch)."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import moe_pallas
    from moe_pallas import ep as ep_module
    from moe_pallas.layer import run_gate

    rows: list[dict] = []
    dtype = jnp.dtype(dtype_name(args))
    b = dtype.itemsize
    impl = "reference" if args.tiny else None
    max_ep = max(args.ep_list)
    config1 = make_config(args)
    refs: dict[int, np.ndarray] = {}
    loops = 3 if args.tiny else 5
    backend = "moe_pallas" + ("-reference" if impl else "-default")
    dev0 = jax.devices()[0]
    bias = jax.device_put(jax.random.normal(jax.random.PRNGKey(args.seed + 2), (config1.num_experts,)) * 0.1, dev0)

    def tokens(T):
        key = jax.random.fold_in(jax.random.PRNGKey(args.seed + 1), T)
        kx, kl = jax.random.split(key)
        with jax.default_device(dev0):
            x = jax.random.normal(kx, (T * max_ep, config1.hidden_size), jnp.float32).astype(dtype)
            lg = jax.random.normal(kl, (T * max_ep, config1.num_experts), jnp.float32)
        return x, lg

    def save():
        with open(rows_path, "w") as f:
            json.dump(rows, f)

    for ep in args.ep_list:
        if ep > jax.device_count():
            rows.extend(error_rows("jax", args, ep, f"needs {ep} devices; {jax.device_count()} visible"))
            save()
            continue
        try:
            mesh = moe_pallas.make_ep_mesh(ep)
            cfg = config1.replace(ep_size=ep)
            t0 = time.perf_counter()
            w13, w13_s = jax_draw_sharded(cfg, mesh, 0, args.seed, dtype)
            w2, w2_s = jax_draw_sharded(cfg, mesh, 1, args.seed, dtype)
            jax.block_until_ready((w13, w2))
            draw_s = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001
            rows.extend(error_rows("jax", args, ep, "weights: " + short_error(exc)))
            save()
            continue
        rep = NamedSharding(mesh, P())
        split = NamedSharding(mesh, P("ep"))
        dense = ep_module.dense_exchange("bench_ep", mesh, args.exchange) if "all_to_all" in args.modes_list else False
        for T in args.tokens:
            T_global = T * ep
            n = iters_for(args, T)
            x_all, lg_all = tokens(T)
            bias_r = jax.device_put(bias, rep)
            for mode in args.modes_list:
                row = new_row("jax", backend, args, cfg, mode, ep, T)
                row.update(n_iters=n, timing_method="wall_loop", notes=f"weights drawn in {draw_s:.1f} s"
                           + (f"; {'dense' if dense else 'ragged'} exchange" if mode == "all_to_all" else "")
                           + (f"; XLA_FLAGS+={args.xla_flags}" if args.xla_flags else ""))
                try:
                    x = jax.device_put(x_all[:T_global], rep if mode == "replicated" else split)
                    lg = jax.device_put(lg_all[:T_global], rep if mode == "replicated" else split)
                    osh = "replicated" if mode == "replicated" else "tokens"

                    def step(x, lg, w13, w2, w13_s, w2_s, bias, mode=mode, osh=osh):
                        return ep_module.ep_moe_forward(x, lg, w13, w2, cfg, mesh=mesh, mode=mode, w13_scale=w13_s,
                                                        w2_scale=w2_s, e_score_correction_bias=bias,
                                                        implementation=impl, out_sharding=osh, exchange=args.exchange)

                    sargs = (x, lg, w13, w2, w13_s, w2_s, bias_r)
                    t1 = time.perf_counter()
                    compiled = jax.jit(step).lower(*sargs).compile()
                    row["compile_s"] = time.perf_counter() - t1
                    out = compiled(*sargs)
                    if ep > 1 and T in refs:
                        row["rel_err"] = H.rel_fro(np.asarray(out.astype(jnp.float32)), refs[T][:T_global])
                    del out
                    s = jax_time(compiled, sargs, n, loops)
                    row.update(step_ms=s["median_ms"], step_p20_ms=s["p20_ms"], step_p80_ms=s["p80_ms"])
                    km, note = jax_kernel_ms(compiled, sargs, n)
                    row["kernel_ms"] = km
                    if note:
                        row["notes"] += "; " + note
                    # -- the collectives alone
                    if mode == "replicated":
                        partial = jax.device_put(jnp.zeros((T_global, cfg.hidden_size), jnp.float32), rep)
                        comm = jax.jit(jax.shard_map(lambda p: jax.lax.psum(p, "ep"), mesh=mesh, in_specs=P(),
                                                     out_specs=P(), check_vma=False))
                        cargs = (partial,)
                        row.update(replicated_bytes(T_global, cfg.hidden_size, ep))
                    else:
                        gate = jax.jit(lambda lg_, b_, cfg=cfg, impl=impl: run_gate(lg_, cfg, b_, impl))
                        with jax.default_device(dev0):
                            _, ids = gate(lg_all[:T_global], bias)
                        ids = np.asarray(ids)
                        dest = np.minimum(ids // (cfg.num_experts // ep), ep - 1)
                        counts = np.stack([np.bincount(dest[r * T:(r + 1) * T].ravel(), minlength=ep) for r in range(ep)])
                        row.update(a2a_bytes(counts, cfg.hidden_size, b, 2 * (ep - 1) * 4))
                        C = T * cfg.num_slots
                        exchange = functools.partial(ep_module._ragged_exchange, ep=ep, capacity=C, dense=dense)

                        def body(x_send, ids_send, sizes):
                            send_sizes = sizes[0]
                            send_offsets = jnp.cumsum(send_sizes) - send_sizes
                            recv_sizes = jax.lax.all_to_all(send_sizes, "ep", 0, 0, tiled=True)
                            home_offsets = jax.lax.all_to_all(send_offsets, "ep", 0, 0, tiled=True)
                            rank = jax.lax.axis_index("ep")
                            my_slot = jnp.full((ep,), rank * C, jnp.int32)
                            slot_of = jnp.arange(ep, dtype=jnp.int32) * C
                            x_recv = exchange(x_send, jnp.zeros((ep * C, x_send.shape[1]), x_send.dtype), send_offsets,
                                              send_sizes, my_slot, recv_sizes)
                            ids_recv = exchange(ids_send, jnp.full((ep * C,), -1, jnp.int32), send_offsets, send_sizes,
                                                my_slot, recv_sizes)
                            y_home = exchange(x_recv, jnp.zeros((C, x_send.shape[1]), x_send.dtype), slot_of, recv_sizes,
                                              home_offsets, send_sizes)
                            return y_home, ids_recv

                        comm = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep")),
                                                     out_specs=(P("ep"), P("ep")), check_vma=False))
                        cargs = (jax.device_put(jnp.ones((ep * C, cfg.hidden_size), dtype), split),
                                 jax.device_put(jnp.zeros((ep * C,), jnp.int32), split),
                                 jax.device_put(jnp.asarray(counts, jnp.int32), split))
                    ccomp = comm.lower(*cargs).compile()
                    c = jax_time(ccomp, cargs, n, loops)
                    row.update(comm_ms=c["median_ms"], comm_p20_ms=c["p20_ms"], comm_p80_ms=c["p80_ms"])
                    del compiled, ccomp
                except Exception as exc:  # noqa: BLE001
                    row["error"] = short_error(exc)
                    if args.verbose:
                        traceback.print_exc()
                rows.append(finish_row(row))
                print(progress_line(row), flush=True)
                save()
            if ep == 1 and max_ep > 1:  # the single-device layer on T * max_ep tokens, for the ep>1 rows
                try:
                    single = jax.jit(functools.partial(moe_pallas.moe_forward, config=config1, implementation=impl))
                    ref = single(x_all, lg_all, w13, w2, w13_scale=w13_s, w2_scale=w2_s, e_score_correction_bias=bias)
                    refs[T] = np.asarray(ref.astype(jnp.float32))
                    del ref
                except Exception as exc:  # noqa: BLE001
                    print(f"jax reference at T={T * max_ep} failed: {short_error(exc)}", flush=True)
            del x_all, lg_all
        del w13, w2, w13_s, w2_s
    save()


def _last_error(stderr: str, limit: int = 400) -> str:
    """The exception line of a child's traceback (``SomeError: message``), else its last words."""
    lines = [l.strip() for l in stderr.splitlines() if l.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b.*", line):
            return line[:limit]
    return " ".join(" ".join(lines).split()[-60:])[-limit:]


def run_jax(args, tmp_dir: str, deadline: float) -> list[dict]:
    rows_path = os.path.join(tmp_dir, "jax_rows.json")
    env = {**os.environ, "PYTHONPATH": _ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if args.tiny:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={max(args.ep_list)}")
    if args.xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--jax-child", rows_path]
    try:
        sys.stdout.flush()
        # progress lines stream through; stderr (JAX's warnings) is kept for the failure message only
        proc = subprocess.run(cmd, env=env, cwd=_ROOT, timeout=max(10.0, deadline - time.monotonic()),
                              stdout=None, stderr=None if args.verbose else subprocess.PIPE, text=True)
        failure = None if proc.returncode == 0 else f"JAX child exited {proc.returncode}: " + _last_error(proc.stderr or "")
    except subprocess.TimeoutExpired:
        failure = "timed out (time budget --max-minutes)"
    rows = []
    if os.path.exists(rows_path):
        with open(rows_path) as f:
            rows = json.load(f)
    if failure:  # rows not produced get the failure
        done = {(r["ep_size"], r["tokens_per_device"], r["mode"]) for r in rows}
        rows += [r for ep in args.ep_list for r in error_rows("jax", args, ep, failure)
                 if (ep, r["tokens_per_device"], r["mode"]) not in done]
    return rows


# ---------------------------------------------------------------------------------------------- output


def progress_line(r: dict) -> str:
    head = f"[ep] {r['framework']:<5} {r['mode']:<10} ep={r['ep_size']} T/dev={r['tokens_per_device']:<5}"
    if r.get("error") and not r.get("step_ms"):
        return f"{head} ERROR {str(r['error'])[:200]}"
    f = H._fmt
    return (f"{head} step {f(r.get('step_ms'))} ms [{f(r.get('step_p20_ms'))}, {f(r.get('step_p80_ms'))}] "
            f"comm {f(r.get('comm_ms'))} ms ({f(r.get('comm_share'), 2)}) {f((r.get('bytes_per_device') or 0) / 1e6)} MB/dev "
            f"rel_err {f(r.get('rel_err'), 2)}" + (f" ERROR {r['error']}" if r.get("error") else ""))


def write_rows(rows: list[dict], out: str, meta: dict) -> None:
    import csv

    tmp = os.path.join(out, "bench_ep.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "schema": list(ROW_KEYS), "rows": rows}, f, indent=1, default=str)
    os.replace(tmp, os.path.join(out, "bench_ep.json"))
    with open(os.path.join(out, "bench_ep.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(ROW_KEYS), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in ROW_KEYS})
    with open(os.path.join(out, "bench_ep.md"), "w") as f:
        f.write(markdown(rows) + "\n")


def markdown(rows: list[dict]) -> str:
    f = H._fmt
    out = ["| framework | mode | ep | T/dev | step ms [p20, p80] | max-rank ms | Mtok/s | comm ms | comm share | MB/dev | comm GB/s | rel err | error |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        step = f"{f(r.get('step_ms'))} [{f(r.get('step_p20_ms'))}, {f(r.get('step_p80_ms'))}]" if r.get("step_ms") else "-"
        mb = None if r.get("bytes_per_device") is None else r["bytes_per_device"] / 1e6
        tps = None if r.get("tokens_per_s") is None else r["tokens_per_s"] / 1e6
        err = str(r.get("error") or "").replace("|", "/")[:80]
        out.append(f"| {r['framework']} | {r['mode']} | {r['ep_size']} | {r['tokens_per_device']} | {step} | "
                   f"{f(r.get('step_max_rank_ms'))} | {f(tps)} | {f(r.get('comm_ms'))} | {f(r.get('comm_share'), 2)} | {f(mb)} | "
                   f"{f(r.get('comm_gbps'))} | {f(r.get('rel_err'), 2)} | {err} |")
    return "\n".join(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=("jax", "torch", "both"), default="both")
    p.add_argument("--ep-sizes", default=None, help="comma list (default: 1 and the number of visible GPUs; --tiny: 1,2)")
    p.add_argument("--tokens-per-device", default=None, help="comma list (default 256,4096; --tiny: 8)")
    p.add_argument("--modes", default="replicated,all_to_all")
    p.add_argument("--preset", default="deepseek-v3")
    p.add_argument("--quant", default="none", choices=("none", "fp8_per_token", "fp8_block"))
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"), help="x / weight dtype (default bf16; --tiny float32)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per loop (default 20 for T<=1024, else 8; --tiny 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true", help="tiny preset on the CPU (2 forced host devices / gloo)")
    p.add_argument("--exchange", default=None, choices=("ragged", "dense"),
                   help="JAX all_to_all mode's row exchange (moe_pallas.ep_moe_forward's exchange; default: ragged on GPUs "
                        "for ep > 1 when XLA_FLAGS turns on XLA's ragged_all_to_all decomposer, else dense)")
    p.add_argument("--xla-flags", default="", help="appended to XLA_FLAGS of the JAX child process; write it with '=' "
                   "(--xla-flags=--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true), each flag starting with --")
    p.add_argument("--max-minutes", type=float, default=8.0, help="stop starting work after this long (rows get an error)")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--jax-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.tokens = H.int_list(p, "--tokens-per-device", args.tokens_per_device or ("8" if args.tiny else "256,4096"))
    args.modes_list = [m for m in args.modes.split(",") if m]
    for m in args.modes_list:
        if m not in MODES:
            p.error(f"--modes: {m!r} is not one of {MODES}")
    bad = [t for t in args.xla_flags.split() if not t.startswith("--")]
    if bad:
        p.error(f"--xla-flags: every XLA flag starts with '--'; got {bad} (write --xla-flags=--flag=value)")
    if args.tiny and args.exchange == "ragged" and args.framework in ("jax", "both"):
        p.error("--exchange ragged needs GPUs (XLA:CPU has no ragged_all_to_all); --tiny runs on a CPU mesh: "
                "use --exchange dense or leave it out")
    if args.ep_sizes:
        args.ep_list = sorted(set(H.int_list(p, "--ep-sizes", args.ep_sizes)))
    elif args.tiny:
        args.ep_list = [1, 2]
    else:
        n = _visible_gpus()
        args.ep_list = sorted({1, max(1, n)})
    return args


def _visible_gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        n = 0
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and cvd.strip():
        n = min(n, len([d for d in cvd.split(",") if d.strip()]))
    return n


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.jax_child:
        jax_main(args, args.jax_child)
        return []
    out = args.out or os.environ.get("OUT") or os.path.join(_ROOT, "benchmarks", "results")
    os.makedirs(out, exist_ok=True)
    deadline = time.monotonic() + 60 * args.max_minutes
    meta = dict(started=datetime.datetime.now().isoformat(timespec="seconds"), argv=sys.argv[1:], ep_sizes=args.ep_list,
                tokens_per_device=args.tokens, tiny=args.tiny, nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
                comm_note="comm_ms: isolated-collective estimate (the mode's collectives alone, same buffers), not an overlap-aware trace")
    print(f"bench_ep: framework={args.framework} ep_sizes={args.ep_list} T/dev={args.tokens} modes={args.modes_list} "
          f"preset={'tiny' if args.tiny else args.preset} quant={args.quant} out={out}", flush=True)
    rows: list[dict] = []
    tmp = tempfile.mkdtemp(prefix="bench_ep_")  # references and per-run rows: never under $OUT
    try:
        if args.framework in ("torch", "both"):
            for ep in args.ep_list:
                if time.monotonic() > deadline:
                    rows += error_rows("torch", args, ep, "skipped: time budget --max-minutes")
                    continue
                rows += run_torch(args, ep, tmp, deadline)
                write_rows(rows, out, meta)
        if args.framework in ("jax", "both"):
            rows += run_jax(args, tmp, deadline) if time.monotonic() < deadline else [
                r for ep in args.ep_list for r in error_rows("jax", args, ep, "skipped: time budget --max-minutes")]
        meta["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
        write_rows(rows, out, meta)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
