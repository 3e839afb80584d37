"""Write the JAX grouped GEMM's backend choices (what ``implementation=None`` runs on a GPU) from benchmark rows.

Usage (no GPU needed: it reads rows a GPU run wrote; ``benchmarks/tune_backend.py`` is the same command)::

    python -m moe_pallas.ops.grouped_gemm.tune_backend RESULTS [RESULTS ...] [--out DIR] [--device KIND]
        [--arch sm90] [--layouts bf16,fp8_block] [--date YYYY-MM-DD] [--command TEXT] [--git COMMIT] [--dry-run]

``RESULTS``: ``benchmarks/bench.py`` outputs (``bench.json``: ``{"meta", "schema", "rows"}`` or a bare list of
rows; or ``bench.csv``, the same rows; ``benchmarks/harness.py`` ``ROW_KEYS``), oldest first: a later file's
measurement of a key replaces an earlier one's, and every measurement replaces the table's entry of its key.

Rows used: ``bench == "gemm"`` (``median_ms``) and ``bench == "gemm_bwd"`` (``fwd_ms``, the forward timed alone
by the same method) of backends ``ours-jax-pallas_triton`` and ``ours-jax-pallas_mosaic_gpu``, for a spec
(``spec``: shape, dtype, M, routing) that BOTH timed and judged correct (no ``error``; ``rel_err <=``
``REL_ERR_MAX``, the benchmark's own judge). Layout (``moe_pallas/ops/grouped_gemm/backend_table.py``): dtype ``bf16`` ->
``"bf16"``, ``fp8`` (per-token x per-output-channel scales, ``specs.GemmSpec``) -> ``"fp8_per_token"``,
``fp8_block`` (1x128 x 128x128) -> ``"fp8_block"``; other dtypes are skipped with their reason printed.
The specs of one key (op, layout, E, N, K, M_cap = the row's M) -- its routings, e.g. uniform and zipf -- are
averaged per backend; the faster mean is the choice. Each entry records both means, the routings, and the
provenance: ``source`` (the file), ``date``, ``command`` and ``git`` (a JSON file's ``meta``; ``--date``,
``--command``, ``--git`` for a file without one, e.g. a CSV).

The table is the device kind's file of its architecture: by default the user's table of that device,
``<user cache>/tuned/jax/<arch>/<device kind>.json`` (``moe_contract.tuning.tuned_table_path``, where ``epmoe tune``
writes and the lookups read first), never the installed package; ``--out DIR`` writes
``DIR/<arch>/<device kind with spaces as _>.json`` instead (a maintainer regenerating the shipped tables passes
``--out moe_pallas/ops/grouped_gemm/tuned``, ``config.TUNED_DIR``). The file also holds the tuners' launch
configs, kept as they are.
The device kind: ``--device``, else the files' ``meta.jax_device_kind`` / ``meta.torch_device`` (all files must
agree). The architecture (bench rows do not record the compute capability): ``--arch``, else the device spec of
this machine's GPU (``moe_pallas.ops.device``) when it is of that device kind; otherwise ``--arch`` is required.
The stored table is read and the merged one written through ``moe_contract.selection`` (``read_table`` /
``write_table`` with ``config.entry_problem``, the lookups' own check: a malformed entry, or one of another
architecture or device kind, is a ``ValueError`` naming the file and the entry, and nothing is written); every new
entry names its ``"arch"`` and ``"device"``. The entries of this run are printed.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys

from moe_contract import selection, tuning
from moe_contract.tolerances import BF16_REL_FRO
from moe_pallas.ops import device as jax_device
from moe_pallas.ops.grouped_gemm.backend_table import BACKEND_CHOICE
from moe_pallas.ops.grouped_gemm.config import entry_problem
from moe_pallas.ops.grouped_gemm.tune import LAYOUTS  # GEMM row dtype -> the dispatch's layout

#: The repository root: a row file's ``source`` is recorded relative to it.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
#: Relative Frobenius error above which a row does not count (the benchmark's judge: the contract's bf16 bound).
REL_ERR_MAX = BF16_REL_FRO

#: Benchmark backend name -> backend of the table.
BACKENDS = {"ours-jax-pallas_triton": "pallas_triton", "ours-jax-pallas_mosaic_gpu": "pallas_mosaic_gpu"}
#: The time of each bench kind that is the forward GEMM's.
TIME_KEY = {"gemm": "median_ms", "gemm_bwd": "fwd_ms"}
INT_KEYS = ("E", "M", "K", "N")
FLOAT_KEYS = ("median_ms", "fwd_ms", "rel_err")


def read_results(path: str) -> tuple[list[dict], dict]:
    """``(rows, meta)`` of a ``bench.json`` (dict with ``rows`` and ``meta``, or a list of rows) or ``bench.csv``
    (no meta; empty cells are None, numbers parsed). ``ValueError`` naming the file for anything else."""
    if path.endswith(".csv"):
        with open(path, newline="") as f:
            rows = [dict(r) for r in csv.DictReader(f)]
        for r in rows:
            for k, v in r.items():
                if v == "":
                    r[k] = None
            for k in INT_KEYS:
                if r.get(k) is not None:
                    r[k] = int(r[k])
            for k in FLOAT_KEYS:
                if r.get(k) is not None:
                    r[k] = float(r[k])
        return rows, {}
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):
        return data, {}
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        return data["rows"], data.get("meta") or {}
    raise ValueError(f"tune_backend: {path} is not bench.py output (a JSON list of rows, or an object with 'rows')")


def row_problem(row: dict) -> str | None:
    """Why a row of an ours-jax backend is not a correct, timed measurement (``None``: it is)."""
    if row.get("error"):
        return f"error: {str(row['error'])[:80]}"
    ms = row.get(TIME_KEY[row["bench"]])
    if not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
        return f"no {TIME_KEY[row['bench']]}"
    err = row.get("rel_err")
    if err is not None and not err <= REL_ERR_MAX:
        return f"rel_err {err} > {REL_ERR_MAX}"
    return None


def measurements(rows: list[dict], layouts: set[str] | None = None, log=print) -> dict[tuple, dict]:
    """``{(op, layout, E, N, K, M_cap): {"ms": {backend: mean ms}, "routings": [...], "measured": [...]}}`` from
    the specs both JAX backends timed correctly; every row left out is reported through ``log``."""
    by_spec: dict[tuple, dict] = {}
    for row in rows:
        if row.get("bench") not in TIME_KEY or row.get("backend") not in BACKENDS:
            continue
        spec = (row["bench"], row["spec"])
        if (problem := row_problem(row)) is not None:
            log(f"  skip {row['spec']} {row['backend']}: {problem}")
            continue
        by_spec.setdefault(spec, {})[BACKENDS[row["backend"]]] = row
    grouped: dict[tuple, dict] = {}
    for (bench, name), pair in by_spec.items():
        if len(pair) < len(BACKENDS):
            log(f"  skip {name}: only {sorted(pair)} timed it correctly (need both JAX backends)")
            continue
        row = next(iter(pair.values()))
        layout = LAYOUTS.get(row.get("dtype"))
        if layout is None:
            log(f"  skip {name}: dtype {row.get('dtype')!r} has no layout (known: {sorted(LAYOUTS)})")
            continue
        if layouts is not None and layout not in layouts:
            continue
        key = ("grouped_gemm", layout, row["E"], row["N"], row["K"], row["M"])
        g = grouped.setdefault(key, {"times": {b: [] for b in pair}, "routings": [], "measured": set()})
        for backend, r in pair.items():
            g["times"][backend].append(float(r[TIME_KEY[bench]]))
        g["routings"].append(row.get("routing"))
        g["measured"].add(f"{TIME_KEY[bench]} of {bench} rows")
    return {key: {"ms": {b: round(sum(t) / len(t), 4) for b, t in g["times"].items()},
                  "routings": g["routings"], "measured": ", ".join(sorted(g["measured"]))}
            for key, g in grouped.items()}


def make_entry(key: tuple, m: dict, device: str, source: str, date: str, command: str, git: str | None) -> dict:
    op, layout, E, N, K, M_cap = key
    entry = {"kind": BACKEND_CHOICE, "op": op, "layout": layout, "device": device, "E": E, "N": N, "K": K,
             "M_cap": M_cap, "backend": min(m["ms"], key=m["ms"].get), "ms": m["ms"], "routings": m["routings"],
             "measured": m["measured"], "source": source, "date": date, "command": command}
    if git:
        entry["git"] = git
    return entry


def choice_key(e: dict) -> tuple:
    return (e["op"], e["layout"], e["E"], e["N"], e["K"], e["M_cap"])


def merge(existing: list[dict], new: list[dict]) -> list[dict]:
    """``existing`` (a tuned file's list) with ``new``'s backend choices: an entry of the same key
    (op, layout, E, N, K, M_cap) is replaced in place, others appended; launch configs are kept as they are."""
    out = list(existing)
    where = {choice_key(e): i for i, e in enumerate(out) if e.get("kind") == BACKEND_CHOICE}
    for e in new:
        k = choice_key(e)
        if k in where:
            out[where[k]] = e
        else:
            where[k] = len(out)
            out.append(e)
    return out


def format_table(entries: list[dict]) -> str:
    lines = [f"{'op':13s} {'layout':14s} {'E':>4s} {'N':>6s} {'K':>6s} {'M_cap':>6s} {'choice':18s} "
             f"{'pallas_triton':>13s} {'mosaic_gpu':>10s}  source"]
    for e in entries:
        ms = e["ms"]
        lines.append(f"{e['op'][:13]:13s} {e['layout']:14s} {e['E']:4d} {e['N']:6d} {e['K']:6d} {e['M_cap']:6d} "
                     f"{e['backend']:18s} {ms.get('pallas_triton', float('nan')):13.4f} "
                     f"{ms.get('pallas_mosaic_gpu', float('nan')):10.4f}  {e['source']}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="bench.json / bench.csv files, oldest first")
    p.add_argument("--out", default=None, help="a tuned folder to write DIR/<arch>/<device kind>.json in (default: the "
                   "user's table of the device, as epmoe tune; the shipped tables: moe_pallas/ops/grouped_gemm/tuned)")
    p.add_argument("--device", default=None, help="device kind, e.g. 'NVIDIA H200' (default: the files' meta)")
    p.add_argument("--arch", default=None, help="the device's architecture, e.g. sm90 (default: this machine's GPU's, "
                   "when it is of the rows' device kind)")
    p.add_argument("--layouts", default=None,
                   help=f"comma-separated layouts to keep (of {sorted(set(LAYOUTS.values()))})")
    p.add_argument("--date", default=None, help="the measurement date of files without meta (CSV)")
    p.add_argument("--command", default=None, help="the command that wrote the files without meta (CSV)")
    p.add_argument("--git", default=None, help="the commit the files without meta ran at (CSV)")
    p.add_argument("--dry-run", action="store_true", help="print the entries, write nothing")
    args = p.parse_args(argv)
    if args.layouts is not None:
        args.layouts = {s for s in args.layouts.split(",") if s}
        if unknown := args.layouts - set(LAYOUTS.values()):
            p.error(f"--layouts: unknown {sorted(unknown)}; choose from {sorted(set(LAYOUTS.values()))}")
    return args


def device_is_cpu(meta: dict) -> bool:
    """Whether a run's meta says it ran on a CPU (bench.py's ``torch_device`` / ``jax_devices``)."""
    torch_dev = str(meta.get("torch_device") or "")
    jax_devs = " ".join(map(str, meta.get("jax_devices") or []))
    return torch_dev.lower() == "cpu" or (bool(jax_devs) and "cuda" not in jax_devs and "gpu" not in jax_devs.lower())


def table_arch(arch: str | None, device: str) -> str:
    """The architecture of the table of ``device`` (the rows' device kind): ``arch`` (``--arch``) if given, else the
    device spec's of this machine's GPU (``moe_pallas.ops.device.device_spec``) when it is of kind ``device``.
    ``ValueError`` saying to pass ``--arch`` otherwise (no GPU here, or another kind: rows do not record the
    compute capability)."""
    if arch:
        return arch
    spec = jax_device.device_spec()
    if spec is None:
        raise ValueError(f"the rows of {device!r} do not record its architecture and JAX sees no GPU here to read it "
                         f"from: pass --arch (e.g. sm90)")
    if spec.kind != device:
        raise ValueError(f"the rows were measured on {device!r} but this machine's GPU is {spec.describe()}: pass "
                         f"--arch for {device!r} (e.g. sm90)")
    return spec.arch


def main(argv=None) -> int:
    args = parse_args(argv)
    new: list[dict] = []
    devices = set()
    for path in args.results:
        try:
            rows, meta = read_results(path)
        except (OSError, ValueError) as exc:  # no such file, not JSON / CSV rows
            print(f"tune_backend: cannot read {path}: {exc}", file=sys.stderr)
            return 2
        if meta.get("tiny") or device_is_cpu(meta):
            print(f"tune_backend: {path} is a CPU run (kernels interpreted): its times choose nothing on a GPU",
                  file=sys.stderr)
            return 2
        if not any(r.get("bench") in ("gemm", "gemm_bwd") for r in rows):
            print(f"{path}: no gemm / gemm_bwd rows (benches {sorted({str(r.get('bench')) for r in rows})}): nothing "
                  f"to take from it", flush=True)
            continue
        device = args.device or meta.get("jax_device_kind") or meta.get("torch_device")
        if not device:
            print(f"tune_backend: {path} names no device (no meta): pass --device", file=sys.stderr)
            return 2
        devices.add(device)
        date = (meta.get("date") or "")[:10] or args.date
        command = " ".join(["python3", *meta["argv"]]) if meta.get("argv") else args.command
        if not date or not command:
            print(f"tune_backend: {path} has no meta date/argv: pass --date and --command (its provenance)",
                  file=sys.stderr)
            return 2
        source = os.path.relpath(os.path.abspath(path), _ROOT)
        print(f"{path}: {len(rows)} rows, device {device}, date {date}", flush=True)
        found = measurements(rows, args.layouts)
        git = meta.get("git") or (None if meta else args.git)
        new = merge(new, [make_entry(k, m, device, source, date, command, git) for k, m in found.items()])
    if not devices:
        print("tune_backend: no gemm rows in the files given: nothing to write", file=sys.stderr)
        return 1
    if len(devices) != 1:
        print(f"tune_backend: the files are of different devices {sorted(devices)}: one table per device kind "
              f"(pass --device to override)", file=sys.stderr)
        return 2
    (device,) = devices
    try:
        arch = table_arch(args.arch, device)
    except ValueError as exc:
        print(f"tune_backend: {exc}", file=sys.stderr)
        return 2
    path = (os.path.join(args.out, arch, selection.file_key(device) + ".json") if args.out
            else tuning.tuned_table_path("jax", arch, device))
    new = [tuning.stamp(e, arch, device) for e in new]
    try:  # read and checked as the lookups read it: a malformed stored table is refused, never overwritten
        table = merge(list(selection.read_table(path, arch, device, entry_problem)), new)
        selection.check_entries(table, path, arch, device, entry_problem)
    except ValueError as exc:
        print(f"tune_backend: {exc}; nothing written", file=sys.stderr)
        return 2
    print(format_table(new) if new else "no spec was timed correctly by both JAX backends: nothing to write")
    if args.dry_run or not new:
        return 0
    selection.write_table(path, table, arch, device, entry_problem)
    print(f"wrote {path}: {len(new)} backend choices from this run, {len(table)} entries in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
