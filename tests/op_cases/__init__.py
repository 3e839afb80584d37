"""Shared test bases, one module per op: the cases every backend of the op must pass.

A module here (``op_cases/permute.py``, ``op_cases/gate.py``...) holds base classes whose names do not start
with ``Test`` (pytest does not collect them): their ``test_*`` methods are the op's cases, written once against a
few small hooks (run the backend under test, run the judge it is compared with). Each backend's test file
subclasses them (``class TestPermuteTriton(TorchArrays, PermuteKernelCases)``), fills in the hooks, and keeps its
backend-only tests (config heuristics, dispatch, lowering) beside them.

The mixins below make the framework's arrays from numpy with the helpers of ``common.py`` (so that
``EPMOE_TEST_DEVICE=gpu`` places them as everywhere else in the suite), imported when first used: a base that
needs no arrays (``op_cases/ep.py``, whose cases run in other processes) imports neither framework.
"""

from __future__ import annotations

import numpy as np


class TorchArrays:
    """Arrays of a ``moe_torch`` backend: torch tensors on ``common.TORCH_DEVICE``."""

    def array(self, a: np.ndarray, dtype: str | None = None):
        """``a`` as a tensor (cast to ``dtype``, a key of ``common.TORCH_DTYPES``)."""
        from common import to_torch

        return to_torch(a, dtype)

    def strided(self, t):
        """A non-contiguous view holding the values of the 2-D tensor ``t`` (every other column of a
        tensor twice as wide)."""
        import torch

        return torch.repeat_interleave(t, 2, dim=1)[:, ::2]


class JaxArrays:
    """Arrays of a ``moe_pallas`` backend: jax arrays on the default device."""

    def array(self, a: np.ndarray, dtype: str | None = None):
        """``a`` as a jax array (cast to ``dtype``, a key of ``common.JNP_DTYPES``)."""
        from common import to_jax

        return to_jax(a, dtype)

    def strided(self, a):
        """None: a jax array has no strides to get wrong."""
        return None


class ClassParams:
    """Parametrizes a test method's arguments by class attributes, so that each backend's subclass picks its
    values: ``CLASS_PARAMS`` maps an argument name to the name of an attribute holding a tuple of strings (each
    its own test id) or a dict (its keys the test ids, its values the arguments)."""

    CLASS_PARAMS: dict[str, str] = {}

    def pytest_generate_tests(self, metafunc):
        for arg, attr in self.CLASS_PARAMS.items():
            if arg in metafunc.fixturenames:
                values = getattr(self, attr)
                if isinstance(values, dict):
                    metafunc.parametrize(arg, list(values.values()), ids=list(values))
                else:
                    metafunc.parametrize(arg, list(values), ids=[str(v) for v in values])
