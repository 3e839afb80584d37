"""Exact casts and dots for Triton's interpreter (``TRITON_INTERPRET=1``, triton 3.6), tests only.

triton 3.6's interpreter (``triton/runtime/interpreter.py``) gets wrong what the kernels rely on:

- **casts** (``_convert_float``, reached from ``InterpreterBuilder.cast_impl`` and
  ``create_fp_to_fp``): float32 -> bf16 truncates instead of rounding to nearest even, and
  float32 -> fp8 rounds half away from zero on the mantissa without carrying into the exponent or
  saturating (triton-lang/triton#8322 shows the same for fp16 -> fp8e5).
- **bf16 ``tl.dot``** (``InterpreterBuilder.create_dot``): bf16 tensors are held as uint16 bit
  patterns, and ``np.matmul`` multiplies those integers (triton-lang/triton#11584). Its fp8
  operands go through the same ``_convert_float`` to float16.

:func:`exact_interpreter` replaces, while it is active, the two cast entry points by ``ml_dtypes``'
correctly rounded conversions (with the saturation of NVIDIA's ``cvt.rn.satfinite.e4m3x2.f32``
for float8_e4m3fn) and, with ``dot=True``, ``create_dot`` by a float32 matmul of the operands
upcast exactly (bf16, fp16 and fp8 all embed in float32) and accumulated in the accumulator's
dtype, which is what the tensor cores compute up to summation order. Nothing else changes.
``tests/test_triton_kernels.py::test_casts_round_like_torch`` proves the patched casts
bit-identical to torch. On the GPU (no interpreter) the context manager does nothing.

Users: ``tests/test_triton_kernels.py`` (casts), ``tests/test_triton_grouped_gemm.py`` and
``tests/test_layer.py`` (casts, dot).
"""

from __future__ import annotations

import contextlib
import os

import ml_dtypes
import numpy as np
import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: triton dtype name -> the numpy / ml_dtypes type with the same bits.
_NP_FLOATS = {"fp64": np.float64, "fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16,
              "fp8e4nv": ml_dtypes.float8_e4m3fn, "fp8e5": ml_dtypes.float8_e5m2}
#: Formats numpy cannot hold natively (the interpreter stores their bit patterns as uints).
_BIT_PATTERN_FLOATS = {"bf16", "fp8e4nv", "fp8e5"}


def _exact_float_cast(handle, dst_type):
    """``handle`` cast to ``dst_type`` with round-to-nearest-even; e4m3 saturates like ``satfinite``."""
    from triton.runtime.interpreter import TensorHandle, _get_np_dtype

    src, dst = handle.dtype.scalar, dst_type.scalar
    x = np.asarray(handle.data).view(_NP_FLOATS[src.name])
    if dst.name == "fp8e4nv":  # finite overflow and +-inf -> +-448, NaN stays NaN (PTX cvt ... .satfinite)
        wide = np.float64 if src.name == "fp64" else np.float32  # exact upcast, so the clip rounds nothing
        x = np.clip(x.astype(wide), -448.0, 448.0)
    out = x.astype(_NP_FLOATS[dst.name]).view(_get_np_dtype(dst_type))
    return TensorHandle(out, dst)


def _needs_fix(src, dst) -> bool:
    s, d = src.dtype.scalar, dst.scalar
    return s.is_floating() and d.is_floating() and {s.name, d.name} & _BIT_PATTERN_FLOATS != set() \
        and s.name in _NP_FLOATS and d.name in _NP_FLOATS


def _as_float32(handle) -> np.ndarray:
    """An operand's values as float32 (exact for bf16 / fp16 / fp8 / fp32)."""
    name = handle.dtype.scalar.name
    data = np.asarray(handle.data)
    if name in _BIT_PATTERN_FLOATS:
        data = data.view(_NP_FLOATS[name])
    return data.astype(np.float32)


@contextlib.contextmanager
def exact_interpreter(*, dot: bool = False):
    """Patch the interpreter's float casts (and, with ``dot``, its ``tl.dot``) while active."""
    if not INTERPRETED:
        yield
        return
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    orig_cast, orig_fp_to_fp, orig_dot = (InterpreterBuilder.cast_impl, InterpreterBuilder.create_fp_to_fp,
                                          InterpreterBuilder.create_dot)

    def cast_impl(self, src, dst_type):  # create_fp_trunc / create_fp_ext land here
        return _exact_float_cast(src, dst_type) if _needs_fix(src, dst_type) else orig_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # every cast to or from fp8
        from triton._C.libtriton import ir

        rtne = rounding_mode is None or rounding_mode == ir.ROUNDING_MODE.RTNE
        if rtne and _needs_fix(src, dst_type):
            return _exact_float_cast(src, dst_type)
        return orig_fp_to_fp(self, src, dst_type, rounding_mode)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        floats = {a.dtype.scalar.name, b.dtype.scalar.name} <= set(_NP_FLOATS)
        if not floats or d.dtype.scalar.name != "fp32":
            return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)  # int8 dots, fp16 accumulators
        acc = np.matmul(_as_float32(a), _as_float32(b)) + np.asarray(d.data, dtype=np.float32)
        return TensorHandle(acc.astype(np.float32), d.dtype.scalar)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(InterpreterBuilder, "cast_impl", cast_impl)
        mp.setattr(InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)
        if dot:
            mp.setattr(InterpreterBuilder, "create_dot", create_dot)
        yield
