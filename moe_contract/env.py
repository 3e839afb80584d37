"""On/off environment switches shared by both frameworks' kernels (framework-free).

Each backend names its own variables (``moe_pallas/ops/common.py``: ``EPMOE_PALLAS_*``;
``moe_torch/ops/triton_common.py``: ``EPMOE_TRITON_*``) and reads them with :func:`env_switch`.
"""

from __future__ import annotations

import os

SWITCH_OFF = ("0", "false", "off", "no")
SWITCH_ON = ("", "1", "true", "on", "yes")


def env_switch(name: str, default: bool, off_means: str, on_means: str) -> bool:
    """The on/off environment switch ``name`` read now: unset -> ``default``; 1/true/on/yes -> True, 0/false/off/no ->
    False (any case, spaces ignored; empty is the default). Raises ValueError for any other value, naming the
    variable and what each side means."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in SWITCH_OFF or value in SWITCH_ON:
        return value not in SWITCH_OFF
    raise ValueError(f"{name} must be one of {SWITCH_OFF} ({off_means}) or {SWITCH_ON[1:]} ({on_means}); "
                     f"got {name}={raw!r}")
