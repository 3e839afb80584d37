"""Tune the Triton grouped GEMM's launch configs (forward; ops dgrad / wgrad) on this GPU: the tuner of ``epmoe tune``.

``epmoe tune --framework torch`` (``interop/cli.py``) calls :func:`tune` on the GEMMs of a preset or checkpoint
(``moe_contract.tuning``) and writes the entries, merged into the user's table of this device, to
``<user cache>/tuned/torch/<arch>/<device kind>.json`` (``moe_contract.tuning.write_tuned_table``), where the
lookups of ``config.py`` read them. The module's own command line times the benchmark's problems with every
option (the benchmarks' ``tune_triton_gemm.py`` runs it)::

    python -m moe_torch.ops.grouped_gemm.tune [--out DIR] [--quick] [--full] [--tma]
        [--dtypes bf16,fp8,fp8_block] [--ms 256,2048,16384] [--routings uniform,zipf] [--ops fwd,dgrad,wgrad]
        [--max-minutes 3] [--no-gluon]

Every entry written names the architecture (``"arch": "sm90"``) and device kind (``"device"``) it was measured on.

For each problem (the command line's: the benchmark's grouped GEMM set, E=32; (K=7168, N=4096) and (K=2048, N=7168);
M in {256, 2048, 16384}; rows split uniformly; bf16, FP8 per-token x per-channel (``fp8``), and FP8 with
DeepSeek-V3's 1 x 128 activation groups x 128 x 128 weight blocks (``fp8_block``)) every config
of :data:`SEARCH_SPACE` (:func:`tiles`, :func:`launch_orders`) is timed with ``triton.testing.do_bench`` (CUDA
events, median) after a correctness check against the heuristic config's output (a config that
computes a wrong answer is never chosen). ``--routings uniform,zipf``: each config is checked and timed on
each routing's rows per expert (``moe_contract.tuning.group_sizes``: ``uniform`` M/E each, the bench's ``zipf``
draw) and ranked by the mean of its times, so the winner is the best on ragged routing too (the entry names its
``"routings"``; ``ms`` and ``heuristic_ms`` are those means). The file ``<device>.json`` holds one entry per problem::

    {"device": "NVIDIA H200", "E": 32, "N": 4096, "K": 7168, "M_cap": 2048, "dtype": "bf16",
     "config": {"block_m": 64, ..., "group_m": 8, "persistent": false}, "ms": 0.41, "heuristic_ms": 0.47}

Two passes per problem (at most 18 + 3 x 5 = 33 configs): the tile shapes x stages in the default
launch order, then every launch order (``group_m`` x ``persistent``) for the :data:`TOP_K` fastest
tiles. The first pass also times the config the library runs today for the problem on this GPU (``config.py:
grouped_gemm_config`` with the device's spec: a stored entry, else the sm_90 wide heuristic), so a written entry is
never slower than what it replaces. ``--full`` times the whole product instead (108 configs per problem). ``--tma``
(the default of :func:`tune` on a Hopper GPU, whose shipped entries are TMA configs; every
dtype: the variant serves bf16 and FP8) adds a third pass: the TMA variant (``GroupedGemmConfig.tma``; ``warp_specialize``
too on 8-warp tiles) of the :data:`TOP_K` fastest configs so far, in each one's launch order and also
persistent with ``group_m=8`` (at most 3 x 4 = 12 more configs per problem).

bf16 forwards that the warp-specialized Gluon kernel serves (``gluon_bf16.py: forward_eligible`` on the problem's
tensors, whatever ``EPMOE_TRITON_GLUON_BF16`` says: sm_90, at least 4096 rows and 32 a local expert, so M=16384 here,
not 256 / 2048) also time the Gluon kernel (:func:`tune_gluon_forward`, after the Triton passes; ``--no-gluon`` skips
it): :func:`gluon_forward_candidates` (``block_n`` 128 / 256 x ``num_stages`` 3 / 4 x ``epilogue`` ``"tma"`` /
``"pointer"``, those the kernel allows: 7), each checked on every routing against the same reference as the Triton
configs (the heuristic config's output; within :data:`MAX_REL_ERR` / :data:`MAX_ABS_ERR`, the backward's bf16 bounds:
its accumulation may round an element an ulp away from the Triton kernel's) before it is timed. The entry then also
says which kernel won (:func:`forward_entry`)::

    {..., "dtype": "bf16", "config": {...Triton...}, "ms": 0.80, "heuristic_ms": ..., "kernel": "gluon",
     "gluon_config": {"block_n": 256, "num_stages": 3, "epilogue": "tma"}, "gluon_ms": 0.76}

``"config"`` / ``"ms"`` stay the fastest Triton config's (the Triton kernel always has one); ``"kernel"`` is
``"gluon"`` where the fastest correct Gluon options beat it, else ``"triton"``; ``"gluon_config"`` / ``"gluon_ms"``
(the fastest correct Gluon options, whichever kernel won) where one ran correctly. Entries without ``"kernel"`` (other
dtypes, problems Gluon does not serve, ``--no-gluon``, tables tuned before) mean the Triton kernel. The dispatch
(``triton.py: gluon_bf16_options``, ``config.tuned_forward_kernel``) runs the entry's kernel while
``EPMOE_TRITON_GLUON_BF16`` is unset.

``--ops`` (default ``fwd``: the forward, as above; its entries have no ``"op"``) also or instead tunes the backward
(bf16 only: ``--dtypes`` must include bf16; bf16 outputs, as the layer's backward makes them), each candidate checked
against the float32 reference (``reference.py``: relative Frobenius error <= :data:`MAX_REL_ERR` and every element
within :data:`MAX_ABS_ERR` of the reference's largest magnitude, so a missed tile is caught) before it is timed, and
timed against the default the library runs without an entry (``heuristic_ms``):

* ``dgrad`` (``d_x = d_y @ w[e]``, ``triton_backward.py``): :data:`DGRAD_SPACE`, the pointer kernel and its TMA
  variant (``tma=True``) on a few tiles. Entry ``{"op": "dgrad", ..., "out_dtype": "bf16", "config": {...}, "ms": ...,
  "heuristic_ms": ...}``, and where the winner is a TMA config also ``"pointer_config"`` / ``"pointer_ms"`` (the
  fastest pointer config), which ``config.grouped_gemm_dgrad_config`` runs while ``EPMOE_TRITON_TMA_DGRAD`` keeps the
  TMA variant off (its default).
* ``wgrad`` (``d_w[e] = d_y[rows(e)].T @ x[rows(e)]``): the Triton kernel's :data:`WGRAD_SPACE` and, where the dispatch
  would run it (``gluon_backward.gluon_wgrad_eligible``: sm_90, ``EPMOE_TRITON_GLUON_WGRAD`` on, enough rows an
  expert), the Gluon kernel's :data:`GLUON_WGRAD_OPTIONS` (``epilogue`` x ``num_stages``). Entry ``{"op": "wgrad",
  ..., "kernel": "gluon" | "triton", "config": {...}}`` (Gluon: ``{"epilogue": ..., "num_stages": ...}``), and where
  Gluon won also ``"triton_config"`` / ``"triton_ms"``: the dispatch (``api.py: _gluon_wgrad``) runs the winner, the
  Triton one with ``triton_config`` where Gluon is off or cannot serve.

``N`` and ``K`` of every entry are the forward's (``w [E, N, K]``). ``--max-minutes``: no config is started after
that many minutes (every op; the heuristic is always timed); an entry cut short says ``"complete": false``.

``moe_torch.ops.grouped_gemm.config.grouped_gemm_config`` reads it (nearest M_cap, same N, K, dtype; the 16-bit
forward's kernel: ``config.tuned_forward_kernel``, the same entry). Entries of problems a run does not tune are kept;
a JAX table (``moe_pallas``'s tuner writes the same file name under ``tuned/jax``) is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
from collections.abc import Callable, Sequence

import torch
import triton
import triton.testing

from moe_contract import selection
from moe_contract.tuning import ROUTINGS  # noqa: F401 - the routings --routings takes, as before the move
from moe_contract.tuning import (DTYPES, OPS, Deadline, GemmShape, group_sizes, merge_entries, parse_dtypes, parse_ms,
                                 parse_ops, parse_routings, stamp, tuned_table_path)
from moe_torch.ops.device import device_spec as _device_spec
from moe_torch.ops.grouped_gemm.config import (entry_problem, GroupedGemmConfig, GroupedGemmWgradConfig,
                                               grouped_gemm_config, grouped_gemm_dgrad_config,
                                               heuristic_grouped_gemm_config,
                                               heuristic_grouped_gemm_wgrad_config)
from moe_torch.ops.grouped_gemm.reference import grouped_gemm_dgrad_reference, grouped_gemm_wgrad_reference
from moe_torch.ops.grouped_gemm.triton import grouped_gemm_triton
from moe_torch.ops.grouped_gemm.triton_backward import grouped_gemm_dgrad_triton, grouped_gemm_wgrad_triton
from moe_torch.ops.triton_common import tma_dgrad_enabled
from moe_torch.ops.quant.api import per_token_group_quant_fp8, per_token_quant_fp8, quantize_weight_fp8

#: block_m x block_n x num_warps x num_stages x group_m x persistent (GroupedGemmConfig's fields);
#: block_k is fixed by the dtype (128-byte K rows). The last two are the launch order (group_m = 1,
#: not persistent: the default 2-D grid; see moe_torch/ops/grouped_gemm/triton.py, "Launch order").
SEARCH_SPACE = {
    "block_m": (64, 128),
    "block_n": (64, 128, 256),
    "num_warps": (4, 8),
    "num_stages": (3, 4),
    "group_m": (1, 4, 8),
    "persistent": (False, True),
}
#: Tile shapes timed in every launch order in the second pass.
TOP_K = 3
#: The command line's problems: (K, N) of the benchmark's gate_up and down, its M, its experts (DeepSeek-V3's 256
#: over EP = 8).
SHAPES = ((7168, 4096), (2048, 7168))
MS = (256, 2048, 16384)
E = 32


def weak(block_m: int, block_n: int, num_warps: int) -> bool:
    """Tile shapes not worth timing: 64-column tiles over 8 warps (too little work per warp), and
    128 x 256 over 4 warps (a 128 KiB float32 accumulator, 256 registers per thread: spills)."""
    return (block_n == 64 and num_warps == 8) or (block_m == 128 and block_n == 256 and num_warps == 4)


def tiles() -> list[dict]:
    """The first pass: every non-:func:`weak` tile shape x stages, default launch order (18)."""
    keys = ("block_m", "block_n", "num_warps", "num_stages")
    return [dict(zip(keys, v)) for v in itertools.product(*(SEARCH_SPACE[k] for k in keys)) if not weak(*v[:3])]


def launch_orders() -> list[dict]:
    """Every launch order of :data:`SEARCH_SPACE`, the default first."""
    return [dict(group_m=g, persistent=p) for p in SEARCH_SPACE["persistent"] for g in SEARCH_SPACE["group_m"]]


def tma_variants(cfg: GroupedGemmConfig) -> list[GroupedGemmConfig]:
    """The opt-in TMA variants of a (pointer-kernel) config for ``--tma``: ``tma=True`` in ``cfg``'s launch
    order and persistent with ``group_m=8``, each also with ``warp_specialize=True`` on 8 warps (4 warps fail
    to compile for sm_90 with it: ``check_config``)."""
    orders = [dict(), dict(group_m=8, persistent=True)]
    specs = [dict(tma=True)] + ([dict(tma=True, warp_specialize=True)] if cfg.num_warps >= 8 else [])
    return [dataclasses.replace(cfg, **o, **s) for o in orders for s in specs]


#: The Gluon forward's options timed for bf16 problems it serves (``gluon_bf16.py: grouped_gemm_gluon_bf16``); the
#: combinations the kernel refuses (``gluon_bf16.MAX_STAGES``: 4 stages at ``block_n`` 256 with the TMA epilogue;
#: ``"tma"`` with ``N % 8 != 0``) are left out (:func:`gluon_forward_candidates`).
GLUON_FWD_SPACE = {"block_n": (128, 256), "num_stages": (3, 4), "epilogue": ("tma", "pointer")}


def gluon_forward_candidates(N: int) -> list[dict]:
    """The Gluon forward's candidates for ``N`` output columns: :data:`GLUON_FWD_SPACE`'s products the kernel allows
    (``gluon_bf16.forward_options_problem``), the dispatch's ``DISPATCH_OPTIONS`` first (``--max-minutes`` keeps the
    likeliest); ``[]`` where triton has no Gluon."""
    try:
        from moe_torch.ops.grouped_gemm import gluon_bf16 as gb
    except ImportError:
        return []
    keys = tuple(GLUON_FWD_SPACE)
    cands = [dict(zip(keys, v)) for v in itertools.product(*(GLUON_FWD_SPACE[k] for k in keys))]
    cands = [c for c in cands if gb.forward_options_problem(c, N) is None]
    return sorted(cands, key=lambda c: c != gb.DISPATCH_OPTIONS)


def routing_offsets(M: int, routing: str, device: str = "cuda", E: int = E) -> torch.Tensor:
    """``expert_offsets [E + 1]`` int32 (on ``device``) of ``M`` rows split by ``routing``
    (:func:`moe_contract.tuning.group_sizes`, seed 0: the bench's rows)."""
    sizes = group_sizes(M, E, routing)
    return torch.tensor([0, *itertools.accumulate(int(v) for v in sizes)], dtype=torch.int32, device=device)


_WIDE = dict(block_m=128, block_n=256, block_k=64, num_warps=8)  # dgrad: 128 rows x 256 columns of d_x, N steps of 64
#: The dgrad's candidates (``GroupedGemmConfig``: ``block_n`` tiles d_x's K columns, ``block_k`` steps over N), the
#: likeliest first (``--max-minutes`` keeps those): the heuristic's wide tile (DGRAD_WIDE_CONFIG, >= 8192 rows) and its
#: TMA variant, 3 or 4 stages; the forward's tuned TMA shapes of the H200 (warp_specialize, persistent); 128 x 128 over
#: 8 warps; 64-row tiles (the forward heuristic's, below 8192 rows), pointer and TMA.
DGRAD_SPACE = (
    dict(_WIDE, num_stages=3, group_m=8),
    dict(_WIDE, num_stages=3, group_m=8, tma=True),
    dict(_WIDE, num_stages=4, group_m=8),
    dict(_WIDE, num_stages=4, group_m=8, tma=True),
    dict(_WIDE, num_stages=4, group_m=4, persistent=True, tma=True, warp_specialize=True),
    dict(_WIDE, num_stages=3, group_m=4, tma=True, warp_specialize=True),
    dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, group_m=8),
    dict(block_m=64, block_n=256, block_k=64, num_warps=8, num_stages=4, group_m=4, tma=True),
    dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3, group_m=4),
    dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3, group_m=4, tma=True),
)
#: The Triton wgrad's candidates (``GroupedGemmWgradConfig``: ``block_n x block_k`` of d_w[e], ``block_m`` rows a
#: step): the heuristic's wide tile (WGRAD_WIDE_CONFIG) with 3 and 4 stages (4 x 64 x 384 x 2 B = 192 KiB of shared
#: memory), 32-row steps, and the small heuristic's 64 x 128 tile (BENCHMARKS.md: 128 x 128 and 256 x 128 were no
#: better than the wide tile at M=16384).
WGRAD_SPACE = (
    dict(block_n=128, block_k=256, block_m=64, num_warps=8, num_stages=3),
    dict(block_n=128, block_k=256, block_m=64, num_warps=8, num_stages=4),
    dict(block_n=128, block_k=256, block_m=32, num_warps=8, num_stages=4),
    dict(block_n=64, block_k=128, block_m=64, num_warps=4, num_stages=3),
)
#: The Gluon wgrad's options (``gluon_backward.py``; bf16 out): the TMA-store epilogue with 3 (its default) or 2
#: stages, pointer stores with 4 or 3.
GLUON_WGRAD_OPTIONS = (dict(epilogue="tma", num_stages=3), dict(epilogue="tma", num_stages=2),
                       dict(epilogue="pointer", num_stages=4), dict(epilogue="pointer", num_stages=3))
#: A backward candidate is WRONG above this relative Frobenius error of its bf16 output against the float32 reference
#: (bf16 rounding alone is ~2e-3) ...
MAX_REL_ERR = 1e-2
#: ... or where an element is off by more than this fraction of the reference's largest magnitude (a bf16 rounding is
#: at most 2**-8 of its value; a tile not written, or written twice, is caught even when the Frobenius error is small).
MAX_ABS_ERR = 2**-7


def backward_error(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool]:
    """``(relative Frobenius error, correct)`` of a bf16 result against its float32 reference (:data:`MAX_REL_ERR`,
    :data:`MAX_ABS_ERR`; NaN is never correct)."""
    diff = y.float() - ref
    err = float(diff.norm() / ref.norm())
    worst = float(diff.abs().max()) if diff.numel() else 0.0
    return err, err <= MAX_REL_ERR and worst <= MAX_ABS_ERR * float(ref.abs().max())


def _time(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def tune_backward(op: str, K: int, N: int, M: int, routings: list[str], g: torch.Generator, dev: str,
                  deadline: Deadline, device: str = "cuda", *, E: int = E) -> dict | None:
    """Time :data:`DGRAD_SPACE` (``op="dgrad"``) or :data:`WGRAD_SPACE` and :data:`GLUON_WGRAD_OPTIONS` (``"wgrad"``)
    on bf16 inputs of ``w [E, N, K]`` with ``M`` rows over each routing; the entry of the fastest correct one (module
    docstring), ``None`` if none ran correctly. ``device``/``g``: where the inputs are drawn (a CPU run, interpreted,
    is for tests with :func:`_time` patched)."""
    d_y = torch.randn(M, N, device=device, generator=g).to(torch.bfloat16)
    offs = [routing_offsets(M, r, device, E) for r in routings]
    out = torch.bfloat16
    if op == "dgrad":
        w = (torch.randn(E, N, K, device=device, generator=g) * N**-0.5).to(torch.bfloat16)
        refs = [grouped_gemm_dgrad_reference(d_y, w, off, None, torch.float32) for off in offs]
        default = ("triton", grouped_gemm_dgrad_config(M, N, K, E, 16, sm90=True, tma=tma_dgrad_enabled()))
        cands = [("triton", GroupedGemmConfig(**kw)) for kw in DGRAD_SPACE]
        run = lambda cand, off: grouped_gemm_dgrad_triton(d_y, w, off, None, out, cand[1])  # noqa: E731
    else:
        x = torch.randn(M, K, device=device, generator=g).to(torch.bfloat16)
        refs = [grouped_gemm_wgrad_reference(x, d_y, off, torch.float32) for off in offs]
        try:
            from moe_torch.ops.grouped_gemm.gluon_backward import gluon_wgrad_eligible, grouped_gemm_gluon_wgrad
            gluon = all(gluon_wgrad_eligible(x, d_y, off, out) for off in offs)  # what the dispatch would run
        except ImportError:
            gluon = False
        triton_default = ("triton", heuristic_grouped_gemm_wgrad_config(M, N, K, E, 16))
        default = ("gluon", (("epilogue", "tma"), ("num_stages", 3))) if gluon else triton_default
        cands = ([("gluon", tuple(o.items())) for o in GLUON_WGRAD_OPTIONS] if gluon else []) + [triton_default] + [
            ("triton", GroupedGemmWgradConfig(**kw)) for kw in WGRAD_SPACE]

        def run(cand, off):
            if cand[0] == "gluon":
                return grouped_gemm_gluon_wgrad(x, d_y, off, out, **dict(cand[1]))
            return grouped_gemm_wgrad_triton(x, d_y, off, out, cand[1])

    def bench(cand) -> float:
        """Median ms of ``cand`` (the mean over the routings); ``inf`` if wrong, failing, or past the deadline."""
        try:
            times = []
            for off, ref, routing in zip(offs, refs, routings):
                err, ok = backward_error(run(cand, off), ref)
                if not ok:
                    print(f"  WRONG {cand} ({routing}) rel err {err:.2e}", flush=True)
                    return float("inf")
                times.append(_time(lambda: run(cand, off)))
            ms = sum(times) / len(times)
            print(f"  {ms:.4f} ms  err {err:.1e}  {cand[0]} {cand[1]}", flush=True)
            return ms
        except Exception as exc:  # noqa: BLE001 - out of shared memory, a refused config: not a candidate
            print(f"  skip {cand}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            return float("inf")

    timed = {default: bench(default)}
    complete = True
    for cand in cands:
        if cand in timed:
            continue
        if deadline.passed():
            complete = False
            break
        timed[cand] = bench(cand)
    return backward_entry(op, timed, default, complete, dev=dev, N=N, K=K, M=M, routings=routings, E=E)


def backward_entry(op: str, timed: dict, default, complete: bool, *, dev: str, N: int, K: int, M: int,
                   routings: list[str], E: int = E) -> dict | None:
    """The tuned entry of ``op`` from ``timed`` (``{(kernel, config): ms}``, ``inf`` for a wrong or failed candidate;
    ``kernel`` ``"triton"`` with a config dataclass, or ``"gluon"`` with the options as a tuple of items) and the
    ``default`` candidate (``heuristic_ms``): the fastest, and the fastest the dispatch runs where the winner's variant
    is off (module docstring: ``pointer_config``, ``triton_config``); ``None`` if nothing ran correctly."""
    ok = {c: t for c, t in timed.items() if t < float("inf")}
    if not ok:
        return None

    def fields(cand) -> dict:
        return dict(cand[1]) if cand[0] == "gluon" else dataclasses.asdict(cand[1])

    best = min(ok, key=ok.get)
    heur_ms = timed.get(default, float("inf"))
    entry = {"op": op, "device": dev, "E": E, "N": N, "K": K, "M_cap": M, "dtype": "bf16", "out_dtype": "bf16"}
    if op == "wgrad":
        entry["kernel"] = best[0]
    entry.update(config=fields(best), ms=round(ok[best], 4),
                 heuristic_ms=None if heur_ms == float("inf") else round(heur_ms, 4), configs_timed=len(ok),
                 complete=complete)
    # the fastest config the dispatch can run where the winner's variant is off: the pointer dgrad (the TMA switch's
    # default), the Triton wgrad (EPMOE_TRITON_GLUON_WGRAD=0, or a request the Gluon kernel does not serve)
    alt, key = {}, None
    if op == "dgrad" and best[1].tma:
        alt, key = {c: t for c, t in ok.items() if not c[1].tma}, "pointer"
    elif op == "wgrad" and best[0] == "gluon":
        alt, key = {c: t for c, t in ok.items() if c[0] == "triton"}, "triton"
    if alt:
        other = min(alt, key=alt.get)
        entry[f"{key}_config"], entry[f"{key}_ms"] = fields(other), round(alt[other], 4)
    if routings != ["uniform"]:
        entry["routings"] = list(routings)
    return entry


def entry_key(e: dict) -> tuple:
    """An entry's key; a forward entry (no ``"op"``) has op ``"fwd"`` and no ``"out_dtype"``."""
    return e["E"], e["N"], e["K"], e["M_cap"], e["dtype"], e.get("op", "fwd"), e.get("out_dtype")


def kept_entries(path: str, arch: str, kind: str) -> dict:
    """The entries a run writing ``path`` (the table of device ``kind`` of architecture ``arch``) keeps (by
    :func:`entry_key`): the file's own (none for a new file), read and validated as the lookups read it
    (``selection.read_table`` with :func:`check_entry`). ``ValueError`` naming the file and the entry for a malformed
    entry, one measured on another architecture or device kind, or a JAX entry (``moe_pallas.ops.grouped_gemm.tune``
    writes the same file name; its entries name a ``"backend"`` or a ``"kind"``)."""
    return {entry_key(e): e for e in selection.read_table(path, arch, kind, check_entry)}


def tune_gluon_forward(x: torch.Tensor, w: torch.Tensor, offs: list, refs: list, routings: list[str],
                       deadline: Deadline) -> dict | None:
    """Time the Gluon forward (:func:`gluon_forward_candidates`) on ``x [M, K]``, ``w [E, N, K]`` (bf16) over each
    routing's ``expert_offsets`` (``offs``), each candidate first checked against that routing's reference (``refs``:
    the heuristic Triton config's output as float32; :func:`backward_error`'s bounds): ``{options as a tuple of items:
    ms}`` (the mean of the routings' medians; ``inf`` for a wrong or failing candidate).
    Candidates past ``--max-minutes`` are not started (nor in the result). ``None`` where the kernel does not serve the
    problem (``gluon_bf16.forward_eligible`` on every routing's tensors, the switch ignored), triton has no Gluon, or
    no candidate was started: the entry then has no ``"kernel"``."""
    try:
        from moe_torch.ops.grouped_gemm import gluon_bf16 as gb
    except ImportError:
        return None
    if not all(gb.forward_eligible(x, w, off, None, None, x.dtype) for off in offs):
        return None

    def bench(opts: dict) -> float:
        try:
            times = []
            for off, ref, routing in zip(offs, refs, routings):
                err, ok = backward_error(gb.grouped_gemm_gluon_bf16(x, w, off, **opts), ref)
                if not ok:
                    print(f"  WRONG gluon {opts} ({routing}) rel err {err:.2e}", flush=True)
                    return float("inf")
                times.append(_time(lambda: gb.grouped_gemm_gluon_bf16(x, w, off, **opts)))
            ms = sum(times) / len(times)
            each = f" ({', '.join(f'{r} {t:.4f}' for r, t in zip(routings, times))})" if len(times) > 1 else ""
            print(f"  {ms:.4f} ms{each}  gluon {opts}", flush=True)
            return ms
        except Exception as exc:  # noqa: BLE001 - a refused option, out of shared memory: not a candidate
            print(f"  skip gluon {opts}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            return float("inf")

    timed = {}
    for opts in gluon_forward_candidates(w.shape[1]):
        if deadline.passed():
            print("  --max-minutes passed: the remaining Gluon options not timed", flush=True)
            break
        timed[tuple(opts.items())] = bench(opts)
    return timed or None


def forward_entry(*, dev: str, N: int, K: int, M: int, dtype: str, timed: dict, heur: GroupedGemmConfig,
                  heur_ms: float, routings: list[str], gluon_timed: dict | None = None, E: int = E) -> dict:
    """The forward entry of one problem (module docstring): ``"config"`` / ``"ms"`` the fastest of the heuristic
    (``heur``, ``heur_ms``; first at equal times) and the Triton configs ``timed`` (``{GroupedGemmConfig: ms}``, ``inf``
    for a wrong or failed one, never chosen), ``"heuristic_ms"``, ``"routings"`` where not uniform alone. With
    ``gluon_timed`` (:func:`tune_gluon_forward`'s ``{options items: ms}``; ``None``: the Gluon kernel was not timed, no
    ``"kernel"`` key): ``"kernel"`` ``"gluon"`` where its fastest correct options are strictly faster than
    ``"ms"``, else ``"triton"``, and ``"gluon_config"`` / ``"gluon_ms"`` of those options where one ran correctly."""
    ms, cfg = min((heur_ms, heur), *((t, c) for c, t in timed.items()), key=lambda mc: mc[0])
    entry = {"device": dev, "E": E, "N": N, "K": K, "M_cap": M, "dtype": dtype,
             "config": dataclasses.asdict(cfg), "ms": round(ms, 4), "heuristic_ms": round(heur_ms, 4)}
    if routings != ["uniform"]:  # the mean over these routings ranked the configs
        entry["routings"] = list(routings)
    if gluon_timed is not None:
        ok = {opts: t for opts, t in gluon_timed.items() if t < float("inf")}
        best = min(ok, key=ok.get) if ok else None
        entry["kernel"] = "gluon" if best is not None and ok[best] < ms else "triton"
        if best is not None:
            entry["gluon_config"], entry["gluon_ms"] = dict(best), round(ok[best], 4)
    return entry


def first_pass(M: int, N: int, K: int, E: int, bits: int, x_group: int | None = None, w_block: bool = False, *,
               full: bool = False, spec: selection.DeviceSpec | None = None) -> list[GroupedGemmConfig]:
    """The forward's first-pass configs: every tile shape of :func:`tiles` (``block_k`` 128 bytes of K) in the default
    launch order (every order with ``full``), then, with ``spec``, the config the library runs today on that device
    (``config.py: grouped_gemm_config``: a stored entry, else the sm_90 wide heuristic) where the tile space lacks it."""
    orders = launch_orders()
    block_k = 128 * 8 // bits
    first = [GroupedGemmConfig(block_k=block_k, **t, **o) for t in tiles() for o in (orders if full else orders[:1])]
    if spec is not None:
        today = grouped_gemm_config(M, N, K, E, bits, x_group, w_block, device=spec)
        if today not in first:
            first.append(today)
    return first


def tune_forward(K: int, N: int, M: int, dtype: str, *, g: torch.Generator, dev: str, deadline: Deadline,
                 routings: Sequence[str] = ("uniform",), E: int = E, full: bool = False, tma: bool = False,
                 gluon: bool = True, spec: selection.DeviceSpec | None = None) -> dict:
    """Tune the forward of ``x [M, K] @ w[e].T``, ``w [E, N, K]`` (``dtype``: :data:`DTYPES`; bf16 out) on this GPU
    (module docstring: two passes, ``full`` the whole product, ``tma`` the TMA variants, ``gluon`` the Gluon kernel
    where it serves a bf16 problem; with ``spec``, the config the library runs today on that device timed in the first
    pass); inputs drawn with ``g`` (a CUDA generator). Returns the entry
    (:func:`forward_entry`; never empty: the heuristic is always timed). Raises what the heuristic config's run raises
    (a shape the kernel does not take)."""
    routings = list(routings)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(E, N, K, device="cuda", generator=g) * K**-0.5).to(torch.bfloat16)
    offs = [routing_offsets(M, r, "cuda", E) for r in routings]
    kw = {}
    if dtype == "fp8":  # per token x per output channel (the library's quantizers, as the JAX tuner)
        x, xs = per_token_quant_fp8(x)
        w, ws = quantize_weight_fp8(w, "per_channel")
        kw = dict(x_scale=xs, w_scale=ws)
    elif dtype == "fp8_block":  # DeepSeek-V3: x per 1 x 128 group, w per 128 x 128 block
        x, xs = per_token_group_quant_fp8(x, 128)
        w, ws = quantize_weight_fp8(w, "block")
        kw = dict(x_scale=xs, w_scale=ws)
    bits = 16 if dtype == "bf16" else 8
    x_group, w_block = (128, True) if dtype == "fp8_block" else (None, False)
    heur = heuristic_grouped_gemm_config(M, N, K, E, bits, x_group, w_block)
    # the reference is this kernel at the heuristic config (an explicit config: without one, an FP8-block request
    # on sm_90 would run the Gluon kernel, whose bf16 roundings may differ from this kernel's by an ulp)
    refs = [grouped_gemm_triton(x, w, off, kw.get("x_scale"), kw.get("w_scale"), torch.bfloat16, heur).float()
            for off in offs]

    def run(cfg, off):
        return grouped_gemm_triton(x, w, off, kw.get("x_scale"), kw.get("w_scale"), torch.bfloat16, cfg)

    heur_ms = sum(_time(lambda: run(heur, off)) for off in offs) / len(offs)

    def bench(cfg):
        """Median ms of ``cfg`` (the mean over the routings), ``inf`` if it is wrong or does not run (or
        ``--max-minutes`` passed)."""
        if deadline.passed():
            return float("inf")
        try:
            times = []
            for off, ref, routing in zip(offs, refs, routings):
                y = run(cfg, off).float()
                err = float((y - ref).norm() / ref.norm())
                if not err <= 1e-3:
                    print(f"  WRONG {cfg} ({routing}) err={err:.2e}", flush=True)
                    return float("inf")
                times.append(_time(lambda: run(cfg, off)))
            ms = sum(times) / len(times)
            each = f" ({', '.join(f'{r} {t:.4f}' for r, t in zip(routings, times))})" if len(times) > 1 else ""
            print(f"  {ms:.4f} ms{each}  {cfg}", flush=True)  # every timing in the log, not only the winner's
            return ms
        except Exception as exc:  # noqa: BLE001 - out of shared memory etc.: not a candidate
            print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
            return float("inf")

    orders = launch_orders()
    first = first_pass(M, N, K, E, bits, x_group, w_block, full=full, spec=spec)
    timed = {cfg: bench(cfg) for cfg in first}
    if not full:  # second pass: every other launch order of the fastest tile shapes
        for tile, order in itertools.product(sorted(first, key=timed.get)[:TOP_K], orders[1:]):
            cfg = dataclasses.replace(tile, **order)
            timed[cfg] = bench(cfg)
    if tma:  # third pass (opt-in): the TMA variant of the fastest configs
        for best in sorted(timed, key=timed.get)[:TOP_K]:
            for variant in tma_variants(best):
                if variant not in timed:
                    timed[variant] = bench(variant)
    print(f"  timed {len(timed)} configs", flush=True)
    gluon_timed = None
    if dtype == "bf16" and gluon:  # the Gluon forward, where it serves (the switch ignored)
        gluon_timed = tune_gluon_forward(x, w, offs, refs, routings, deadline)
        if gluon_timed is not None:
            print(f"  timed {len(gluon_timed)} Gluon options", flush=True)
    return forward_entry(dev=dev, N=N, K=K, M=M, dtype=dtype, timed=timed, heur=heur, heur_ms=heur_ms,
                         routings=routings, gluon_timed=gluon_timed, E=E)


class NoGPUError(RuntimeError):
    """Tuning was asked for where torch sees no CUDA GPU (the message is one line, for the command line)."""


def require_gpu() -> None:
    """Raises :class:`NoGPUError` unless torch sees a CUDA GPU: tuning measures the GPU it runs on."""
    if not torch.cuda.is_available():
        raise NoGPUError("no CUDA GPU found (torch.cuda.is_available() is False); tuning measures the GPU it runs on")


def device_spec(index: int | None = None) -> selection.DeviceSpec:
    """The :class:`moe_contract.selection.DeviceSpec` of CUDA device ``index`` (default: the current one,
    ``moe_torch/ops/device.py``); its ``kind`` and ``arch`` name the tuned table. Raises :class:`NoGPUError` without
    a CUDA GPU."""
    require_gpu()
    return _device_spec(torch.device("cuda", torch.cuda.current_device() if index is None else index))


def check_entry(e: dict) -> str | None:
    """Why ``e`` is not an entry of a moe_torch table (``None``: it is), beyond the common keys that
    ``selection.read_table`` checks: a JAX entry (a ``"backend"`` or ``"kind"``), an unknown ``"op"``, a missing
    ``"dtype"`` or a ``"config"`` that is not an object. The ``check`` of :func:`moe_contract.tuning.write_tuned_table`
    for the torch tables."""
    if "backend" in e or "kind" in e:
        return "names a JAX backend (a moe_pallas entry; the torch tables hold Triton launch configs)"
    return entry_problem(e)  # the lookups' own rules (config.py), so a table the tuner writes is one they read


def tune(shapes: Sequence[GemmShape], ms: Sequence[int], dtypes: Sequence[str] = DTYPES,
         ops: Sequence[str] = ("fwd",), *, routings: Sequence[str] = ("uniform",), deadline: Deadline | None = None,
         full: bool = False, tma: bool | None = None, gluon: bool = True,
         on_entry: Callable[[dict], None] | None = None) -> list[dict]:
    """Tune the Triton grouped GEMM on this GPU for every ``shape`` x ``M`` of ``ms``: the forward of each of
    ``dtypes`` (``"fwd"`` in ``ops``; :func:`tune_forward`) and the bf16 backward ops ``"dgrad"`` / ``"wgrad"``
    (:func:`tune_backward`; only where ``dtypes`` has bf16). Every entry is stamped with this GPU's ``"arch"`` and
    ``"device"`` (:func:`moe_contract.tuning.stamp`) and passed to ``on_entry`` as soon as it is measured (a run cut
    short keeps what it found). A problem the kernels refuse (``fp8_block`` with ``K % 128 != 0``, a failing
    heuristic) is skipped with its reason printed. Past ``deadline`` (``--max-minutes``) no config starts (each
    forward problem still times its heuristic) and no backward problem starts. Returns the entries.

    Raises :class:`NoGPUError` without a CUDA GPU; ``ValueError`` for an unknown dtype or op (before any launch)."""
    unknown = [d for d in dtypes if d not in DTYPES] + [o for o in ops if o not in OPS]
    if unknown:
        raise ValueError(f"tune: dtypes must be among {DTYPES} and ops among {OPS}; got {unknown}")
    spec = device_spec()
    if tma is None:  # the TMA variants are what the shipped sm_90 entries are; other GPUs lack TMA
        tma = spec.is_hopper
    deadline = deadline or Deadline(None)
    g = torch.Generator(device="cuda").manual_seed(0)
    routings = list(routings)
    entries: list[dict] = []

    def done(entry: dict) -> None:
        entry = stamp(entry, spec.arch, spec.kind)
        entries.append(entry)
        print(json.dumps(entry), flush=True)
        if on_entry is not None:
            on_entry(entry)

    shapes = list(dict.fromkeys(shapes))  # a layer with H == 2I has one problem twice
    for shape, M, dtype in itertools.product(shapes, ms, dtypes if "fwd" in ops else ()):
        print(f"== fwd {shape.describe()} M={M} {dtype}", flush=True)
        if dtype == "fp8_block" and shape.K % 128:
            print(f"  skipped: fp8_block needs K % 128 == 0 (1 x 128 activation groups); K={shape.K}", flush=True)
            continue
        try:
            done(tune_forward(shape.K, shape.N, M, dtype, g=g, dev=spec.kind, deadline=deadline, routings=routings,
                              E=shape.E, full=full, tma=tma, gluon=gluon, spec=spec))
        except Exception as exc:  # noqa: BLE001 - a shape the kernel refuses: the other problems still run
            print(f"  skipped: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        torch.cuda.empty_cache()
    bwd_ops = [op for op in ops if op != "fwd"]
    if bwd_ops and "bf16" not in dtypes:
        print(f"ops {','.join(bwd_ops)}: the backward is tuned for bf16 only; the dtypes have none: not tuned",
              flush=True)
        bwd_ops = []
    for shape, M, op in itertools.product(shapes, ms, bwd_ops):
        if deadline.passed():
            print(f"--max-minutes passed: {op} {shape.describe()} M={M} not tuned", flush=True)
            continue
        print(f"== {op} {shape.describe()} M={M} bf16", flush=True)
        try:
            entry = tune_backward(op, shape.K, shape.N, M, routings, g, spec.kind, deadline, E=shape.E)
        except Exception as exc:  # noqa: BLE001 - as the forward's
            print(f"  skipped: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            entry = None
        torch.cuda.empty_cache()
        if entry is None:
            print("  no correct config timed: no entry", flush=True)
            continue
        done(entry)
    return entries


def summary(entries: Sequence[dict]) -> list[str]:
    """One line per Gluon-or-Triton forward and per backward entry: what was timed and what won."""
    lines = []
    for e in entries:
        if e.get("op", "fwd") == "fwd" and "kernel" in e:
            lines.append(f"fwd   K={e['K']:5d} N={e['N']:5d} M={e['M_cap']:6d} triton {e['ms']} ms, gluon "
                         f"{e.get('gluon_ms')} ms -> {e['kernel']}  {e.get('gluon_config', '')}")
        if e.get("op", "fwd") != "fwd":
            partial = "" if e["complete"] else "  (partial)"
            lines.append(f"{e['op']:5s} K={e['K']:5d} N={e['N']:5d} M={e['M_cap']:6d} heuristic {e['heuristic_ms']} ms "
                         f"-> {e['ms']} ms  {e.get('kernel', '')} {e['config']}{partial}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """The tuner's own command line (module docstring): the benchmark's problems (E=32, :data:`SHAPES`, :data:`MS`),
    every option. ``--out DIR``: the table ``DIR/<arch>/<device kind>.json`` (a new one starts empty); default: this device's table in the user cache (``epmoe tune``'s). Usage errors exit 2
    before any GPU is looked for."""
    parser = argparse.ArgumentParser(prog="python -m moe_torch.ops.grouped_gemm.tune",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or None,
                        help="folder of the table (default: $OUT if set, else the user cache's, as epmoe tune)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--full", action="store_true", help="time every config of SEARCH_SPACE (108 per problem)")
    parser.add_argument("--tma", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the TMA variant (tma, warp_specialize) of the fastest configs "
                             "(default: on a Hopper GPU)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma list of {', '.join(DTYPES)}")
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="comma list of M (rows)")
    parser.add_argument("--routings", default="uniform", help="comma list of uniform, zipf: rank configs by the mean "
                        "of their times over these rows-per-expert splits (default uniform)")
    parser.add_argument("--ops", default="fwd", help="comma list of fwd (the forward, default), dgrad (pointer and TMA "
                        "configs), wgrad (Triton configs and the Gluon kernel's epilogue / stages): backward entries "
                        "with \"op\", bf16 only")
    parser.add_argument("--max-minutes", type=float, default=None, help="start no config after this many minutes")
    parser.add_argument("--no-gluon", action="store_true", help="do not time the Gluon forward on the bf16 problems "
                        "it serves (their entries then have no \"kernel\": the Triton kernel)")
    args = parser.parse_args(argv)
    try:
        routings = parse_routings(args.routings)
        ops = parse_ops(args.ops)
        dtypes = parse_dtypes(args.dtypes)
        ms = [m for m in parse_ms(args.ms) if not (args.quick and m == 2048)]
    except ValueError as exc:
        parser.error(str(exc))
    try:
        spec = device_spec()
    except NoGPUError as exc:
        print(f"tune_triton_gemm: {exc}", file=sys.stderr)
        return 2
    path = (os.path.join(args.out, spec.arch, selection.file_key(spec.kind) + ".json") if args.out
            else tuned_table_path("torch", spec.arch, spec.kind))
    try:  # a broken stored table stops here, before the GPU time is spent
        base = list(kept_entries(path, spec.arch, spec.kind).values())
    except ValueError as exc:
        print(f"tune_triton_gemm: {exc}; fix that file or give another --out", file=sys.stderr)
        return 2
    written: list[dict] = []

    def write(entry: dict) -> None:  # after every problem: a run cut short keeps what it found
        written.append(entry)
        selection.write_table(path, merge_entries(base, written), spec.arch, spec.kind, check_entry)

    shapes = [GemmShape(name=f"K{K}xN{N}", N=N, K=K, E=E) for K, N in SHAPES]
    entries = tune(shapes, ms, dtypes, ops, routings=routings, deadline=Deadline(args.max_minutes), full=args.full,
                   tma=args.tma, gluon=not args.no_gluon, on_entry=write)
    for line in summary(entries):
        print(line)
    print(f"wrote {path}" if entries else f"no entry measured; {path} not written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
