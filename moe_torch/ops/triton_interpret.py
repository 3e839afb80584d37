"""Exact float casts and dots for Triton's interpreter (``TRITON_INTERPRET=1``, triton 3.6).

Triton runs ``@triton.jit`` kernels on CPU tensors when ``TRITON_INTERPRET=1`` is set before
``triton`` is imported. triton 3.6's interpreter (``triton/runtime/interpreter.py``) gets wrong what
the kernels of ``moe_torch`` rely on, silently:

- **casts** (``_convert_float``, reached from ``InterpreterBuilder.cast_impl`` and
  ``create_fp_to_fp``): float32 -> bf16 truncates instead of rounding to nearest even, and
  float32 -> fp8 rounds half away from zero on the mantissa without carrying into the exponent or
  saturating, and turns NaN into ``0x7c`` (triton-lang/triton#8322 shows the same for fp16 -> fp8e5);
- **bf16 ``tl.dot``** (``InterpreterBuilder.create_dot``): bf16 tensors are held as uint16 bit
  patterns and ``np.matmul`` multiplies those integers (triton-lang/triton#11584): a bf16 grouped
  GEMM of ones gave 1.69e10 where 64 is right. Its fp8 operands go through the same ``_convert_float``;
- **bf16 / fp8 elementwise arithmetic** (``binary_op``): ``np.add`` etc. on the bit patterns.

:func:`install` replaces these entry points of ``InterpreterBuilder`` by exact ones: casts through
``ml_dtypes``' correctly rounded conversions (float8_e4m3fn saturating to +-448 with NaN kept, as
NVIDIA's ``cvt.rn.satfinite.e4m3x2.f32``), dots as a float32 matmul of the operands upcast exactly
(bf16, fp16 and fp8 all embed in float32) plus the accumulator, then cast to the accumulator's dtype
(what the tensor cores compute, up to summation order), and bf16 / fp8 add, sub, mul, div computed in
float32 and rounded to nearest even. One speed-up, not a fix: ``tl.associative_scan`` with a combine function
registered through :func:`register_scan` (the grouped GEMM's running max of the offsets) runs as that numpy
ufunc's ``accumulate`` on integer data instead of the interpreter's element-by-element Python loop (identical
values; that loop took nearly all of an interpreted DeepSeek-V3 layer's (E=256) time).
Two more, also not fixes (:func:`_faster_interpreter`): a ``@triton.jit`` function called from a kernel does not
re-patch ``triton.language`` when its launch already did, and ``_get_np_dtype``'s table is built once.
Everything else of the interpreter is left as it is.

``moe_torch`` installs it when a Triton module of its own is imported under the interpreter
(``moe_torch/ops/triton_common.py``) and again before every launch (``check_triton_device``), so
every interpreted launch of a ``moe_torch`` kernel is exact, with nothing to import from ``tests/``.
The patch is process-wide: other interpreted Triton kernels in the process get the exact casts and
dots too. On a GPU (no interpreter) it does nothing. ``tests/test_triton_interpret.py`` proves the
patched casts bit-identical to torch and the reported reproducers exact.

Sources: triton-lang/triton@v3.6.0:python/triton/runtime/interpreter.py (the handlers replaced);
the saturation rule: PTX ISA, ``cvt`` with ``.satfinite``.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np

#: triton dtype name -> the numpy / ml_dtypes type with the same bits.
_NP_FLOATS = {"fp64": np.float64, "fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16,
              "fp8e4nv": ml_dtypes.float8_e4m3fn, "fp8e5": ml_dtypes.float8_e5m2}
#: Formats numpy cannot hold natively (the interpreter stores their bit patterns as uints).
_BIT_PATTERN_FLOATS = frozenset({"bf16", "fp8e4nv", "fp8e5"})
_FP8_E4M3_MAX = 448.0

_installed = False

#: combine function (the ``@triton.jit`` object) -> numpy ufunc whose ``accumulate`` computes the same scan.
_FAST_SCANS: dict = {}


def register_scan(combine_fn, ufunc) -> None:
    """Run interpreted ``tl.associative_scan(x, axis, combine_fn)`` over one integer tensor as
    ``ufunc.accumulate(x, axis)`` (e.g. ``np.maximum`` for a running max). The caller vouches that the two agree;
    floats (held as bit patterns for bf16 / fp8), several inputs and other combine functions keep the interpreter's
    own loop. Harmless off the interpreter."""
    _FAST_SCANS[combine_fn] = ufunc


def interpreting() -> bool:
    """``True`` if ``TRITON_INTERPRET`` asks for the interpreter (as ``triton.knobs`` reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "off", "no")


def is_installed() -> bool:
    """``True`` once :func:`install` has patched the interpreter in this process."""
    return _installed


def _values(handle) -> np.ndarray:
    """A handle's data as its float type (bit patterns viewed as bf16 / fp8)."""
    name = handle.dtype.scalar.name
    data = np.asarray(handle.data)
    return data.view(_NP_FLOATS[name]) if name in _BIT_PATTERN_FLOATS else data


def _to_float(values: np.ndarray, dst, handle_cls):
    """``values`` (any float numpy array) rounded to nearest even into triton dtype ``dst``, as a handle."""
    from triton.runtime.interpreter import _get_np_dtype

    if dst.name == "fp8e4nv":  # finite overflow and +-inf -> +-448, NaN stays NaN (PTX cvt ... .satfinite)
        wide = np.float64 if values.dtype == np.float64 else np.float32  # exact upcast: the clip rounds nothing
        values = np.clip(values.astype(wide), -_FP8_E4M3_MAX, _FP8_E4M3_MAX)
    out = np.asarray(values).astype(_NP_FLOATS[dst.name]).view(_get_np_dtype(dst))
    return handle_cls(out, dst)


def _float_pair(src_scalar, dst_scalar) -> bool:
    """A float -> float cast that the interpreter gets wrong and ml_dtypes does exactly."""
    return (src_scalar.is_floating() and dst_scalar.is_floating() and src_scalar.name in _NP_FLOATS
            and dst_scalar.name in _NP_FLOATS and bool({src_scalar.name, dst_scalar.name} & _BIT_PATTERN_FLOATS))


def install() -> None:
    """Patch triton's ``InterpreterBuilder`` (casts, dots, bf16 / fp8 arithmetic) to be exact; idempotent.

    A no-op unless ``TRITON_INTERPRET`` is set. Raises nothing; see the module docstring for what changes.
    """
    global _installed
    if _installed or not interpreting():
        return
    from triton.runtime.interpreter import InterpreterBuilder, ScanOps, TensorHandle

    orig_cast, orig_fp_to_fp = InterpreterBuilder.cast_impl, InterpreterBuilder.create_fp_to_fp
    orig_dot, orig_binary = InterpreterBuilder.create_dot, InterpreterBuilder.binary_op

    def cast_impl(self, src, dst_type):  # create_fp_trunc / create_fp_ext land here
        if _float_pair(src.dtype.scalar, dst_type.scalar):
            return _to_float(_values(src), dst_type.scalar, TensorHandle)
        return orig_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # every cast to or from fp8
        from triton._C.libtriton import ir

        rtne = rounding_mode is None or rounding_mode == ir.ROUNDING_MODE.RTNE
        if rtne and _float_pair(src.dtype.scalar, dst_type.scalar):
            return _to_float(_values(src), dst_type.scalar, TensorHandle)
        return orig_fp_to_fp(self, src, dst_type, rounding_mode)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        names = {a.dtype.scalar.name, b.dtype.scalar.name, d.dtype.scalar.name}
        if not names <= set(_NP_FLOATS):
            return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)  # integer dots are exact already
        acc = np.matmul(_values(a).astype(np.float32), _values(b).astype(np.float32))
        acc = acc + _values(d).astype(np.float32)
        return _to_float(acc, d.dtype.scalar, TensorHandle)

    def binary_op(self, lhs, rhs, op):
        name = lhs.dtype.scalar.name
        if name in _BIT_PATTERN_FLOATS and rhs.dtype.scalar.name == name and op in _FLOAT_OPS:
            with np.errstate(all="ignore"):
                out = op(_values(lhs).astype(np.float32), _values(rhs).astype(np.float32))
            return _to_float(out, lhs.dtype.scalar, TensorHandle)
        return orig_binary(self, lhs, rhs, op)

    orig_scan = ScanOps.apply_impl

    def scan_apply_impl(self, input):
        ufunc = _FAST_SCANS.get(self.combine_fn)
        if ufunc is None or len(input) != 1 or input[0].handle.data.dtype.kind not in "iu":
            return orig_scan(self, input)
        data = input[0].handle.data
        data = np.flip(data, axis=self.axis) if self.reverse else data
        out = ufunc.accumulate(data, axis=self.axis).astype(data.dtype)
        out = np.flip(out, axis=self.axis) if self.reverse else out
        return [self.to_tensor(np.ascontiguousarray(out), input[0].dtype)]

    ScanOps.apply_impl = scan_apply_impl
    _faster_interpreter()
    InterpreterBuilder.cast_impl = cast_impl
    InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
    InterpreterBuilder.create_dot = create_dot
    InterpreterBuilder.binary_op = binary_op
    # The class-level lambdas (create_fp_ext, create_fadd, ...) call these through `self`, so they follow.
    _installed = True


def _faster_interpreter() -> None:
    """Speed-ups, not fixes. A ``@triton.jit`` function called from an interpreted kernel re-patches
    ``triton.language`` (``_patch_lang``: ``inspect.getmembers`` over ``tl``, ``tl.tensor``, ``tl.math``) on every
    call, though the launch (``GridExecutor``) has already patched those modules for its whole run; in an interpreted
    DeepSeek-V3 torch layer (E=256: ~800 programs, each calling the expert-search helpers) that was a large share of
    the interpreted time. Here a call skips ``_patch_lang`` when every language module its function sees was already
    patched within the current launch (the skipped call would have re-set the same interpreter hooks, bound to the same
    builder: triton 3.6 never restores a nested call's patches anyway); any other call patches as before. And
    ``_get_np_dtype``'s table is built once instead of per call."""
    import threading

    from triton.runtime import interpreter as interp

    orig_patch_lang, orig_grid_call = interp._patch_lang, interp.GridExecutor.__call__
    state = threading.local()  # .patched: ids of the language modules patched in the current launch (None outside)
    lang_ids = frozenset(map(id, (interp.tl, interp.tl.core)))  # the modules _patch_lang patches

    def patch_lang(fn):
        seen = lang_ids.intersection(map(id, list(fn.__globals__.values())))
        patched = getattr(state, "patched", None)
        if patched is not None and seen and seen <= patched:
            return interp._LangPatchScope()  # nothing set, nothing to restore
        scope = orig_patch_lang(fn)
        if patched is not None:
            patched |= seen
        return scope

    def grid_call(self, *args, **kwargs):
        outer = getattr(state, "patched", None)
        state.patched = set()
        try:
            return orig_grid_call(self, *args, **kwargs)
        finally:
            state.patched = outer

    interp._patch_lang = patch_lang
    interp.GridExecutor.__call__ = grid_call

    # ``_get_np_dtype`` (every interpreted op asks it) rebuilt its dict of 17 numpy dtypes on each call: the same map,
    # built once (pointers and blocks of pointers: uint64; a block: its element type's)
    tl = interp.tl
    np_types = {tl.int1: np.dtype(bool), tl.float16: np.dtype(np.float16), tl.float32: np.dtype(np.float32),
                tl.float64: np.dtype(np.float64), tl.int8: np.dtype(np.int8), tl.uint8: np.dtype(np.uint8),
                tl.int16: np.dtype(np.int16), tl.uint16: np.dtype(np.uint16), tl.int32: np.dtype(np.int32),
                tl.uint32: np.dtype(np.uint32), tl.int64: np.dtype(np.int64), tl.uint64: np.dtype(np.uint64),
                tl.bfloat16: np.dtype(np.uint16), tl.float8e5: np.dtype(np.uint8), tl.float8e5b16: np.dtype(np.uint8),
                tl.float8e4nv: np.dtype(np.uint8), tl.float8e4b8: np.dtype(np.uint8),
                tl.float8e4b15: np.dtype(np.uint8)}
    uint64 = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return uint64
        if isinstance(tt_dtype, tl.block_type):
            if isinstance(tt_dtype.element_ty, tl.pointer_type):
                return uint64
            return np_types[tt_dtype.element_ty]
        return np_types[tt_dtype]

    interp._get_np_dtype = get_np_dtype


#: The elementwise float ops of the interpreter's ``binary_op`` (create_fadd, create_fsub, create_fmul, create_fdiv).
_FLOAT_OPS = (np.add, np.subtract, np.multiply, np.divide)
