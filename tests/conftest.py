"""Shared test setup: both frameworks on the CPU, deterministic hypothesis profile."""

from __future__ import annotations

import os
import sys

if os.environ.get("EPMOE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))  # `import tolerances`

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,  # CI runs must be reproducible
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
