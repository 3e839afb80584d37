"""Test helpers: one numpy input, two frameworks."""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from moe_contract.selection import DeviceSpec, file_key

#: "cpu" in CI; "gpu" when benchmarks/gpu_check.py runs the suite on the GPU machine.
DEVICE = os.environ.get("EPMOE_TEST_DEVICE", "cpu")
TORCH_DEVICE = "cuda" if DEVICE == "gpu" else "cpu"

#: Triton 3.6's interpreter (TRITON_INTERPRET=1) breaks on numpy >= 2.4; the GPU machine has numpy 2.5.
TRITON_INTERPRETER_BROKEN = tuple(int(v) for v in np.__version__.split(".")[:2]) >= (2, 4)
#: Marks a test that runs the Triton interpreter (itself or in a child such as ``epmoe bench --tiny``).
needs_triton_interpreter = pytest.mark.skipif(
    TRITON_INTERPRETER_BROKEN,
    reason="triton 3.6's interpreter breaks on numpy >= 2.4 (triton-lang/triton#9171); the project pins numpy < 2.4, "
           "the GPU machine has 2.5")

JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "int32": jnp.int32,
              "float8_e4m3fn": jnp.float8_e4m3fn}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int32": torch.int32,
                "int64": torch.int64, "float8_e4m3fn": torch.float8_e4m3fn}


def to_jax(a: np.ndarray, dtype: str | None = None):
    arr = jnp.asarray(a)
    return arr if dtype is None else arr.astype(JNP_DTYPES[dtype])


def to_torch(a: np.ndarray, dtype: str | None = None):
    a = np.array(a, copy=True, order="C")
    if a.dtype == ml_dtypes.bfloat16:  # torch.from_numpy knows no bfloat16: through the bits
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(TORCH_DEVICE)
    elif a.dtype == ml_dtypes.float8_e4m3fn:  # nor float8 codes
        t = torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn).to(TORCH_DEVICE)
    else:
        t = torch.from_numpy(a).to(TORCH_DEVICE)
    return t if dtype is None else t.to(TORCH_DTYPES[dtype])


def both(a: np.ndarray, dtype: str | None = None):
    """``(jax array, torch tensor)`` holding the same values (cast to ``dtype`` in each framework)."""
    return to_jax(a, dtype), to_torch(a, dtype)


def random_ids(rng: np.random.Generator, T: int, topk: int, E: int, distinct: bool = True) -> np.ndarray:
    """``[T, topk]`` int32 expert ids; distinct within a row (as a gate makes them) by default."""
    if distinct:
        return np.stack([rng.permutation(E)[:topk] for _ in range(T)]).astype(np.int32).reshape(T, topk)
    return rng.integers(0, E, size=(T, topk), dtype=np.int32)


# ------------------------------------------------------------------------------------------------ tuned tables

#: The simulated GPU of the tuned-table tests (a Hopper: its tables are ``sm90/Test_GPU.json`` and ``sm90.json``).
TEST_SPEC = DeviceSpec(kind="Test GPU", capability=(9, 0), sm_count=132, smem_per_block=232448)


def spec_of_kind(kind: str, capability: tuple[int, int] = (9, 0)) -> DeviceSpec:
    """:data:`TEST_SPEC` with another device kind (and compute capability)."""
    return dataclasses.replace(TEST_SPEC, kind=kind, capability=capability)


def write_tuned(root, entries, spec: DeviceSpec = TEST_SPEC, level: str = "device") -> str:
    """Write ``entries`` (a JSON list) as a tuned table under ``root`` (a patched ``TUNED_DIR``):
    ``root/<arch>/<kind>.json`` (``level="device"``) or ``root/<arch>.json`` (``level="arch"``); returns its path."""
    if level not in ("device", "arch"):
        raise ValueError(f"write_tuned: level must be 'device' or 'arch'; got {level!r}")
    path = (os.path.join(str(root), spec.arch, file_key(spec.kind) + ".json") if level == "device"
            else os.path.join(str(root), spec.arch + ".json"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(list(entries), f)
    return path
