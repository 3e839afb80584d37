"""Backend dispatch for the ops of ``moe_torch``: one op, several backends, one reference.

``implementation=None`` tries the op's backends in the default order for the input's device;
a backend that cannot serve a *valid* request raises ``NotImplementedError`` and the next one
is tried, with a logged warning (never silently). An explicit ``implementation`` runs that
backend only, and its ``NotImplementedError`` reaches the caller.

Mirror: ``moe_pallas/ops/dispatch.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from moe_contract.validation import check_choice

log = logging.getLogger("moe_torch")

#: Preferred order for CUDA tensors. On a CPU, Triton only runs interpreted (slow, for tests),
#: so the default there is the reference; ask for ``"triton"`` explicitly to interpret it.
GPU_ORDER = ("triton", "reference")
CPU_ORDER = ("reference",)


def check_implementation(op: str, implementation: str | None, available: tuple[str, ...]) -> None:
    """``implementation`` is ``None`` or one of the op's backends (``ValueError`` otherwise)."""
    check_choice(op, "implementation", implementation, (None, *available))


def default_order(device: torch.device) -> tuple[str, ...]:
    return GPU_ORDER if device.type == "cuda" else CPU_ORDER


def dispatch(op: str, implementation: str | None, backends: Mapping[str, Callable[[], Any]], device: torch.device) -> Any:
    """Run ``backends[implementation]()``, or with ``None`` the first default backend that serves."""
    check_implementation(op, implementation, tuple(backends))
    if implementation is not None:
        return backends[implementation]()
    order = [name for name in default_order(device) if name in backends] or ["reference"]
    for name in order[:-1]:
        try:
            return backends[name]()
        except NotImplementedError as exc:
            log.warning("%s: backend %r cannot serve this request (%s); trying %r", op, name, exc, order[order.index(name) + 1])
    return backends[order[-1]]()


_SAID: set[tuple] = set()


def warn_once(message: str, *args) -> None:
    """``log.warning(message, *args)`` the first time this message and these arguments come (a per-call condition,
    such as a copy a call, said once a process)."""
    key = (message, *args)
    if key not in _SAID:
        _SAID.add(key)
        log.warning(message, *args)


def passed_over(op: str, kernel: str, why: str, instead: str) -> None:
    """Log (once per reason) that the default's measured choice ``kernel`` cannot serve a request and ``instead`` runs
    it: a default never changes kernel without saying so."""
    warn_once("%s: the default's kernel %r cannot serve this request (%s); running %s", op, kernel, why, instead)
