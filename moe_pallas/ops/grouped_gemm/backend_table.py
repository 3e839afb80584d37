"""Which backend the grouped GEMMs run by default on a GPU: a measured table per device kind, a heuristic elsewhere.

``implementation=None`` on a GPU tries the backends in the order :func:`default_order` gives for the
request's op, layout and shape (``moe_pallas.ops.dispatch.dispatch(..., order=...)``):

1. The table's choice first: the entry of the device's tuned tables (``config.tuned_tables``: the per-user cache of
   ``epmoe tune``, then ``tuned/<arch>/<device kind>.json``, then ``tuned/<arch>.json``, so every Hopper GPU reads
   ``sm90.json``) with the same ``op``, ``layout``, ``N`` and ``K`` and the nearest ``M_cap`` in log2 (ties: the first
   stored), as :func:`~moe_pallas.ops.grouped_gemm.config.nearest_tuned` picks launch configs. Then the rest of the
   heuristic order, so a choice that cannot serve a request (``NotImplementedError``) falls through it with the
   dispatch's logged warning.
2. No entry for the op, layout, ``N`` and ``K`` (or no table for the device): :func:`heuristic_order`,
   ``GPU_ORDER``.

On the CPU the order is ``CPU_ORDER`` (the reference; kernels only interpreted when asked for by name).

**The table** is one of the device's tuned files (:data:`~moe_pallas.ops.grouped_gemm.config.TUNED_DIR`; each one
JSON list that also holds launch configs, which have no ``"kind"``). A backend choice is an
entry with ``"kind": "backend_choice"``, written by ``tune_backend.py`` (beside this module) from benchmark rows, or by ``epmoe tune``
where both JAX kernels timed the same GEMM and both were correct::

    {"kind": "backend_choice", "op": "grouped_gemm", "layout": "fp8_block", "device": "NVIDIA H200",
     "E": 32, "N": 4096, "K": 7168, "M_cap": 16384, "backend": "pallas_triton",
     "ms": {"pallas_triton": 1.72, "pallas_mosaic_gpu": 2.90}, "routings": ["uniform"],
     "source": "benchmarks/results/...", "date": "2026-12-01", "command": "python3 benchmarks/bench.py ..."}

Required: ``kind``, ``op`` (one of :data:`OPS`), ``layout`` (see :func:`gemm_layout`), ``E``, ``N``, ``K``,
``M_cap`` (ints >= 1; ``E`` is recorded, not matched), ``backend`` (one of :data:`KERNEL_BACKENDS`), ``ms``
(median ms of each backend timed, at least two; ``backend`` the fastest of them), and the provenance
``source`` (the file the numbers came from), ``date``, ``command``. Optional: ``device``, ``routings``
(row distributions averaged into ``ms``), ``git``, ``measured``, ``note``. A malformed entry is a
``ValueError`` naming the file and the entry (never skipped: the table is part of the tree).

Mirror: ``moe_torch/ops/grouped_gemm/config.py``'s tuned forward kernel choice (``tuned_forward_kernel``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from moe_contract.selection import DeviceSpec, TunedTables
from moe_pallas.ops.dispatch import CPU_ORDER, GPU_ORDER
from moe_pallas.ops.grouped_gemm import config as gemm_config
from moe_pallas.ops.grouped_gemm import kernels
from moe_pallas.ops.grouped_gemm.config import (BACKEND_CHOICE, KERNEL_BACKENDS, OPS, OPTIONAL_KEYS,  # noqa: F401
                                                REQUIRED_KEYS, backend_choice_problem as entry_problem,
                                                gpu_device_spec)
from moe_pallas.ops.grouped_gemm.pallas_triton import scale_kinds

#: Short names of the float dtypes in layouts.
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float8_e4m3fn": "fp8"}



def _dtype_name(dtype) -> str:
    name = jnp.dtype(dtype).name
    return DTYPE_NAMES.get(name, name)


def gemm_layout(x: jax.Array, x_scale: jax.Array | None, w_scale: jax.Array | None, w_format: str | None) -> str:
    """The forward's layout key, from ``x``'s dtype and the scales' shapes as the kernels read them
    (``pallas_triton.scale_kinds``): ``"bf16"`` / ``"f16"`` / ``"f32"`` (float ``x`` and ``w``); FP8
    ``"fp8_block"`` (``w_scale [E, ceil(N/128), ceil(K/128)]``, whatever ``x_scale`` is; DeepSeek-V3 pairs it
    with 1x128 groups), else ``"fp8_" +`` the activation scale's kind: ``"fp8_per_tensor"`` (``[]``),
    ``"fp8_per_token"`` (``[M_cap, 1]``), ``"fp8_per_token_group"`` (``[M_cap, K // G]``), with per-expert or
    per-channel weight scales (both applied in the epilogue); 4-bit weights ``"<x dtype>_<w_format>"``
    (``"bf16_mxfp4"``, ``"bf16_int4"``; MMA-layout MXFP4 codes are ``"bf16_mxfp4"``'s: the same kernels)."""
    dtype = _dtype_name(x.dtype)
    if w_format is not None:
        return f"{dtype}_{'mxfp4' if w_format == 'mxfp4_mma' else w_format}"
    if x_scale is None:
        return dtype
    x_kind, w_kind, _ = scale_kinds(x_scale, w_scale, x.shape[1])
    return "fp8_block" if w_kind == "block" else f"fp8_{x_kind}"


def dgrad_layout(d_y: jax.Array, w_scale: jax.Array | None) -> str:
    """The dgrad's layout key: ``d_y``'s dtype (``"bf16"``, ...), with FP8 weights ``"<d_y dtype>_fp8_<w kind>"``
    (``"bf16_fp8_per_expert"``, ``"bf16_fp8_per_channel"``, ``"bf16_fp8_block"``: dequantized to ``d_y``'s dtype)."""
    dtype = _dtype_name(d_y.dtype)
    if w_scale is None:
        return dtype
    return f"{dtype}_fp8_" + {1: "per_expert", 2: "per_channel", 3: "block"}[w_scale.ndim]


def wgrad_layout(x: jax.Array) -> str:
    """The wgrad's layout key: the inputs' dtype (``"bf16"``, ...)."""
    return _dtype_name(x.dtype)


def heuristic_order(op: str, layout: str) -> tuple[str, ...]:
    """The GPU order where the table has no entry: ``GPU_ORDER`` (Mosaic GPU, Pallas-Triton, reference) for every op
    and layout: the warp-specialized Mosaic kernels are the faster ones on sm_90 wherever both were measured
    (BENCHMARKS.md), and ``kernels.runnable`` drops Mosaic GPU off sm_90."""
    return GPU_ORDER


def check_entries(entries: Sequence[dict], where: str) -> list[dict]:
    """The backend choices of ``entries`` (a tuned file's list), each checked; ``ValueError`` naming ``where``
    (the file) and the entry's index for a malformed one or an unknown ``"kind"``."""
    out = []
    for i, t in enumerate(entries):
        if "kind" not in t:  # a launch config (config.nearest_tuned)
            continue
        if t["kind"] != BACKEND_CHOICE:
            raise ValueError(f"tuned table {where}: entry {i} has kind={t['kind']!r}; the known kind is "
                             f"{BACKEND_CHOICE!r} (launch configs have no 'kind')")
        problem = entry_problem(t)
        if problem is not None:
            raise ValueError(f"tuned table {where}: backend choice entry {i} is malformed: {problem}; entry: {t}")
        out.append(t)
    return out


def backend_choices(device: DeviceSpec) -> TunedTables:
    """The checked backend choices of ``device``'s tuned tables (``config.tuned_tables``: the user's, then the shipped
    device-kind and architecture files), per file, most specific first. The files are read once; the check runs at
    each lookup (trace time; a few dozen entries)."""
    tiers = gemm_config.tuned_tables(device).tiers
    return TunedTables(tuple((path, tuple(check_entries(entries, path))) for path, entries in tiers))


def nearest_backend_choice(device: DeviceSpec | None, op: str, layout: str, M_cap: int, N: int, K: int) -> dict | None:
    """The backend choice for ``device`` with the same ``op``, ``layout``, ``N`` and ``K`` and the nearest ``M_cap`` in
    log2 (ties: the first stored), from the most specific table that has one; ``None`` without a device or a match."""
    if device is None:
        return None
    return backend_choices(device).nearest(lambda t: (t["op"], t["layout"], t["N"], t["K"]) == (op, layout, N, K),
                                           M_cap)


def gpu_order(op: str, layout: str, M_cap: int, N: int, K: int, device: DeviceSpec | None) -> tuple[str, ...]:
    """The GPU order: the table's choice (:func:`nearest_backend_choice`) first, then the rest of
    :func:`heuristic_order`; the heuristic order alone where the table has no entry."""
    heuristic = heuristic_order(op, layout)
    entry = nearest_backend_choice(device, op, layout, M_cap, N, K)
    if entry is None:
        return heuristic
    return (entry["backend"], *(name for name in heuristic if name != entry["backend"]))


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU (the tests patch this to run the GPU lookup on a CPU)."""
    return jax.default_backend() == "gpu"


def default_order(op: str, layout: str, *, M_cap: int, N: int, K: int) -> tuple[str, ...]:
    """The order ``implementation=None`` tries for ``op`` (one of :data:`OPS`) on ``layout`` with ``M_cap`` rows,
    ``N`` output columns and contraction ``K`` (the forward's names: the dgrad's output is ``[M_cap, K]``, the
    wgrad's ``[E, N, K]``): ``CPU_ORDER`` off a GPU, else :func:`gpu_order` for this device (read on the host
    at trace time) without the kernels it cannot run at all (``kernels.runnable``: Mosaic GPU off sm_90). Raises ``ValueError`` (naming the file) if the device kind's table is malformed."""
    if not on_gpu():
        return CPU_ORDER
    spec = gpu_device_spec()
    return kernels.runnable(op, gpu_order(op, layout, M_cap, N, K, spec), spec, layout)
