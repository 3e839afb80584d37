"""The one place test tolerances live: CONTRACT.md section 7, as numbers and checks.

| what | rule |
|---|---|
| ids, offsets, src2dst, dst2src, counts | exactly equal |
| FP8 codes and scales | bit-identical |
| gate weights | float32 rel. error <= 1e-6 |
| bf16 GEMM / layer output vs float64 reference | ||out-ref|| / ||ref|| <= 1e-2 |
| FP8 GEMM vs reference on the dequantized inputs | ||out-ref|| / ||ref|| <= 2e-2 |
| Pallas vs Triton on the same inputs | the tighter of the two rows above |

CONTRACT.md section 8 (backward):

| what | rule |
|---|---|
| float32 gradients vs float64 autodiff of the reference | rel_fro <= GRAD_F32_REL_FRO (1e-5) |
| bf16 layer gradients vs float64 | rel_fro <= GRAD_BF16_REL_FRO (2e-2) |
| weight gradient of an expert with no rows | exactly 0 (assert_exact) |
| Pallas vs Triton gradients on the same inputs | the rows above |
"""

from __future__ import annotations

import numpy as np

from moe_contract.tolerances import (  # noqa: F401 (re-exported; sections 7 and 8 live there, one place)
    BF16_REL_FRO,
    F32_REL_FRO,
    FP8_REL_FRO,
    GATE_WEIGHT_RTOL,
    GRAD_BF16_REL_FRO,
    GRAD_F32_REL_FRO,
)


def to_numpy(a) -> np.ndarray:
    """A jax array or torch tensor (any device, any dtype incl. bf16/fp8) as numpy."""
    if hasattr(a, "detach"):  # torch
        import torch

        t = a.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(_ml_dtypes().bfloat16)
        if t.dtype == torch.float8_e4m3fn:
            return t.view(torch.uint8).numpy().view(_ml_dtypes().float8_e4m3fn)
        return t.numpy()
    return np.asarray(a)


def _ml_dtypes():
    import ml_dtypes

    return ml_dtypes


def rel_fro(out, ref) -> float:
    """``||out - ref|| / ||ref||`` in float64 (0 if both are 0)."""
    o = to_numpy(out).astype(np.float64)
    r = to_numpy(ref).astype(np.float64)
    assert o.shape == r.shape, (o.shape, r.shape)
    den = np.linalg.norm(r)
    num = np.linalg.norm(o - r)
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return float(num / den)


def assert_rel_fro(out, ref, limit: float, what: str = "") -> None:
    err = rel_fro(out, ref)
    assert np.isfinite(err) and err <= limit, f"{what}: ||out-ref||/||ref|| = {err:.3e} > {limit:.0e}"


def assert_exact(a, b, what: str = "") -> None:
    """Exactly equal (ints) or bit-identical (floats, fp8 codes)."""
    x, y = to_numpy(a), to_numpy(b)
    assert x.shape == y.shape, f"{what}: shapes {x.shape} != {y.shape}"
    if x.dtype.kind in "iub":
        bad = np.flatnonzero(x != y)
    else:  # floats, bf16, fp8: compare bit patterns
        assert x.dtype.itemsize == y.dtype.itemsize, f"{what}: dtypes {x.dtype} != {y.dtype}"
        bad = np.flatnonzero(x.view(f"u{x.dtype.itemsize}") != y.view(f"u{y.dtype.itemsize}"))
    assert bad.size == 0, f"{what}: {bad.size} of {x.size} differ, first at flat index {bad[0]}: {x.flat[bad[0]]} vs {y.flat[bad[0]]}"


def assert_gate_weights(a, b, what: str = "gate weights") -> None:
    np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=GATE_WEIGHT_RTOL, atol=0, err_msg=what)
