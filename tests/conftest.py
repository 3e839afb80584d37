"""Shared test setup: both frameworks on the CPU, deterministic hypothesis profile.

On the CPU (``EPMOE_TEST_DEVICE=cpu``, the default) the Triton kernels of ``moe_torch`` run in
Triton's interpreter: ``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported
(``triton.jit`` reads it, through ``triton.knobs``, when a kernel is decorated, i.e. when a module
such as ``moe_torch.ops.combine.triton`` is imported), so it is set here, before any test module
imports anything. On the GPU machine (``EPMOE_TEST_DEVICE=gpu``) the kernels compile for real.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("EPMOE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["TRITON_INTERPRET"] = "1"
else:
    # XLA's GPU default for float32 dots is TF32-like (about 1e-4 relative); the tests compare float32
    # results at 1e-5 (CONTRACT.md section 7/8 rows), as on the CPU. The library's own dots set their
    # precision explicitly; this makes the tests' scaffolding (float64 judges, example models) exact too.
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
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
