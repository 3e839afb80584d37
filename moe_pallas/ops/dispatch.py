"""Backend dispatch for the ops of ``moe_pallas``: one op, several backends, one reference.

``implementation=None`` tries the op's backends in the default order for the current
device; a backend that cannot serve a *valid* request raises ``NotImplementedError`` and the
next one is tried, with a logged warning (never silently); the backend that runs is logged at DEBUG
(logger ``moe_pallas``; at trace time under ``jax.jit``). An explicit ``implementation``
runs that backend only, and its ``NotImplementedError`` reaches the caller. An op may pass its
own default order (``order=``): the grouped GEMMs take theirs per shape and layout from a measured
table per device kind (``moe_pallas/ops/grouped_gemm/backend_table.py``).

Mirror: ``moe_torch/ops/dispatch.py`` (no ``order=`` there: one GPU backend, Triton).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from moe_contract.validation import check_choice

log = logging.getLogger("moe_pallas")

#: Preferred order on a GPU. On a CPU the kernels only run interpreted (slow, for tests), so
#: the default there is the reference; ask for a kernel explicitly to interpret it.
GPU_ORDER = ("pallas_mosaic_gpu", "pallas_triton", "reference")
CPU_ORDER = ("reference",)


def check_implementation(op: str, implementation: str | None, available: tuple[str, ...]) -> None:
    """``implementation`` is ``None`` or one of the op's backends (``ValueError`` otherwise)."""
    check_choice(op, "implementation", implementation, (None, *available))


def default_order() -> tuple[str, ...]:
    return GPU_ORDER if jax.default_backend() == "gpu" else CPU_ORDER


def dispatch(op: str, implementation: str | None, backends: Mapping[str, Callable[[], Any]], *,
             order: Sequence[str] | None = None) -> Any:
    """Run ``backends[implementation]()``, or with ``None`` the first backend of the default order that serves:
    ``order`` (backend names; the op's own, e.g. the grouped GEMM's measured choice first), else
    :func:`default_order`. Names ``backends`` lacks are skipped; the last one left runs unguarded."""
    check_implementation(op, implementation, tuple(backends))
    if implementation is not None:
        log.debug("%s: backend %r (asked for)", op, implementation)
        return backends[implementation]()
    order = [name for name in (default_order() if order is None else order) if name in backends] or ["reference"]
    for name in order[:-1]:
        try:
            out = backends[name]()
        except NotImplementedError as exc:
            log.warning("%s: backend %r cannot serve this request (%s); trying %r", op, name, exc, order[order.index(name) + 1])
            continue
        log.debug("%s: backend %r serves this request (default order %s)", op, name, order)
        return out
    log.debug("%s: backend %r serves this request (last of the default order %s)", op, order[-1], order)
    return backends[order[-1]]()
