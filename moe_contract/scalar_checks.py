"""Scalar argument checks: ints, bools, choices, the routed scaling factor and the capacity factor.

The bottom of ``moe_contract``'s import graph: :mod:`moe_contract.config` validates its
fields with these, and :mod:`moe_contract.validation` (which checks arrays against a
``MoEConfig``, so imports ``config``) re-exports them. Same message format as
``validation``: ``<op>: <arg> must be <expectation>; got <what came>``.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any


def check_nonnegative_int(op: str, name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{op}: {name} must be an int >= 0; got {name}={value!r}")


def check_positive_int(op: str, name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{op}: {name} must be an int >= 1; got {name}={value!r}")


def check_bool(op: str, name: str, value: Any) -> None:
    """Raise ``TypeError`` unless ``value`` is a bool (a string such as "no" would read as True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool; got {name}={value!r}")


def check_choice(op: str, name: str, value: Any, choices: Iterable[Any]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{op}: {name} must be one of {choices}; got {name}={value!r}")


def check_rsf(op: str, rsf: Any) -> None:
    """``routed_scaling_factor``: a finite real > 0 (python or numpy scalar)."""
    if isinstance(rsf, bool) or not isinstance(rsf, numbers.Real) or not 0 < float(rsf) < float("inf"):
        raise ValueError(f"{op}: routed_scaling_factor must be a finite float > 0; got {rsf!r}")


def check_capacity_factor(op: str, value: Any) -> None:
    """``capacity_factor``: ``None`` (dropless) or a finite real > 0 (python or numpy scalar)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < float("inf"):
        raise ValueError(f"{op}: capacity_factor must be None (dropless) or a finite float > 0; "
                         f"got capacity_factor={value!r}")
