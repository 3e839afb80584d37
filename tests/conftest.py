"""Shared test setup: both frameworks on the CPU, deterministic hypothesis profile.

On the CPU (``EPMOE_TEST_DEVICE=cpu``, the default) the Triton kernels of ``moe_torch`` run in
Triton's interpreter: ``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported
(``triton.jit`` reads it, through ``triton.knobs``, when a kernel is decorated, i.e. when a module
such as ``moe_torch.ops.combine.triton`` is imported), so it is set here, before any test module
imports anything. On the GPU machine (``EPMOE_TEST_DEVICE=gpu``) the kernels compile for real.
On the CPU, the tests' child processes compile with ``JAX_DISABLE_MOST_OPTIMIZATIONS=1`` (LLVM -O0: faster
compiles, same HLO); the pytest processes themselves keep XLA's default.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("EPMOE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # The tests' child processes (test_ep_jax's 4-device child, the 2-device EP children, bench.py / gpu_check /
    # bench_ep runs) spend most of their time in XLA:CPU compiling programs once each: with jax's
    # JAX_DISABLE_MOST_OPTIMIZATIONS (LLVM -O0 without its expensive passes; HLO passes unchanged) they compile
    # ~2x faster (test_ep_jax's child 139 -> ~70 s). Only the children get it: jax reads the variable when it is
    # imported, so it is set after this process's import. The pytest workers keep XLA's default: in a suite run
    # with -O0 in every process too, one worker segfaulted inside an XLA compile after hundreds of compiles
    # (not reproduced alone).
    if os.environ.pop("EPMOE_CHILD_XLA_O0", None):  # a pytest-xdist worker: inherited from the controller's conftest
        os.environ.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
    import jax  # noqa: F401  (reads JAX_DISABLE_MOST_OPTIMIZATIONS now: unset here, XLA's default)

    if "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ:
        os.environ.update(JAX_DISABLE_MOST_OPTIMIZATIONS="1", EPMOE_CHILD_XLA_O0="1")
    os.environ["TRITON_INTERPRET"] = "1"
    # One OpenMP thread per process (torch's ATen and MKL; numpy's OpenBLAS reads it too), the pytest processes and
    # their children alike (a user's own setting wins). The suite runs two pytest-xdist processes on two cores
    # (scripts/test.sh) plus child processes: with torch's default of one OpenMP thread per core, every small op's
    # parallel region waits at a barrier for a thread another process has the core for. Measured on the 2-core CI
    # machine with other load on it: test_triton_grouped_gemm.py alone 40 -> 21 s, test_hf_2026.py 63 -> 31 s;
    # the JAX-only files unchanged (XLA:CPU runs its own thread pool). Set before anything imports torch.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
else:
    # XLA's GPU default for float32 dots is TF32-like (about 1e-4 relative); the tests compare float32
    # results at 1e-5 (CONTRACT.md section 7/8 rows), as on the CPU. The library's own dots set their
    # precision explicitly; this makes the tests' scaffolding (float64 judges, example models) exact too.
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
sys.path.insert(0, os.path.dirname(__file__))  # `import tolerances`

# Tuned tables from a user's own `epmoe tune` runs must not change what the tests see: an empty per-user cache
# (unless a run names one).
if not os.environ.get("EPMOE_CACHE_DIR"):
    import tempfile

    os.environ["EPMOE_CACHE_DIR"] = tempfile.mkdtemp(prefix="epmoe-test-cache-")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,  # CI runs must be reproducible
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests (pyproject.toml's marker) are skipped unless ``EPMOE_TEST_DEVICE=gpu``."""
    import pytest

    if os.environ.get("EPMOE_TEST_DEVICE", "cpu") == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (EPMOE_TEST_DEVICE=gpu, benchmarks/gpu_check.py)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
