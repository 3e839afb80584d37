"""The DLPack bridge: torch tensors as JAX arrays and back, zero-copy, in stream order.

``to_jax(tensor)`` and ``to_torch(array)`` share the buffer (no copy) for every dtype the
contract uses -- float32, bfloat16, float16, float8_e4m3fn, int32, bool -- and for float8_e5m2,
uint8 and int8, on the CPU and on CUDA; all bit patterns cross unchanged (FP8 NaN codes too).
``call_jax(fn, ...)`` runs a JAX function (a ``moe_pallas`` op) on torch tensors and
``call_torch(fn, ...)`` a torch function (a ``moe_torch`` op) on JAX arrays.

What crosses, and how (measured with jax 0.11.2 / torch 2.11, ``tests/test_dlpack.py``):

- **Zero-copy**: any tensor whose strides are a permutation of a dense row-major layout
  (contiguous, transposed / permuted, row slices ``x[a:b]``, size-1 dims with any stride); the
  JAX array keeps the permuted layout (``array.format``), and the way back restores the strides.
  XLA also needs the data pointer aligned (64 bytes on the CPU, 16 on the GPU): a row slice
  that starts mid-line (``x[1:]`` of a ``[4, 3]`` float32) is copied (``.clone()``; with
  ``copy=False``: ``ValueError``). Rows of any contract shape (``H``, ``K`` multiples of 64)
  are aligned. JAX -> torch is always zero-copy.
- **Non-compact strides** (column slices ``x[:, 1:]``, steps ``x[::2]``, ``expand``): JAX's
  importer rejects them (``UNIMPLEMENTED: ... trivial (compact) striding``). Decision: with the
  default ``copy=None`` they are copied by ``tensor.contiguous()`` (on torch's current stream,
  so the copy is stream-ordered too) -- NOT zero-copy; ``copy=False`` raises ``ValueError``.
- **int64** with JAX's x64 off (the default): JAX would silently wrap ``2**40 + 5`` to ``5``.
  Decision: a checked conversion to int32 -- a copy, and a host sync for the range check
  (``torch.aminmax``) -- raising ``ValueError`` if a value lies outside int32's range; SGLang
  and vLLM hand ``topk_ids`` over as int64, and those fit. With x64 on (``JAX_ENABLE_X64=1`` or
  ``jax.enable_x64(True)``) int64 and float64 cross zero-copy. float64 with x64 off raises
  ``TypeError`` (JAX would round it to float32 silently).
- **requires_grad**: detached (``tensor.detach()``, the same memory). No gradient flows through
  the bridge: the JAX result, and what ``call_jax`` returns, are outside the autograd graph.
- **0-size** (``(0,)``, ``(3, 0)``) and **0-dim** arrays cross with shape and dtype kept; a
  0-size tensor has no bytes, so "zero-copy" has no meaning there (any strides are accepted).

Stream order on the GPU (the DLPack / array API ``__dlpack__(stream=...)`` protocol,
https://data-apis.org/array-api/latest/API_specification/generated/array_api.array.__dlpack__.html):

- torch -> JAX: ``jax.dlpack.from_dlpack`` passes JAX's stream for external ready events as
  ``stream`` to ``torch.Tensor.__dlpack__``, which records an event on torch's *current* stream
  and makes JAX's stream wait on it: everything enqueued on torch's current stream before
  ``to_jax`` (including the copies above) happens before any JAX read, with no host sync.
  Work on another torch stream is not covered: switch to it (``torch.cuda.stream(s)``) or sync
  it first.
- JAX -> torch: ``to_torch`` calls ``array.block_until_ready()`` first (a host wait for the
  computation that produces ``array``), then ``torch.from_dlpack`` (which passes torch's current
  stream; jaxlib also makes that stream wait on the buffer's definition events). Decision: the
  host wait is the simple safe choice -- the tensor is then ready for *every* torch stream, not
  only the one current at the call -- at the cost of a sync; do not call ``to_torch`` inside
  CUDA-graph capture or a latency-critical loop.

Aliasing: a zero-copy result shares memory with its source. JAX assumes its arrays are
immutable: writing into the torch tensor in place (or into a tensor ``to_torch`` returned)
changes the JAX array too -- pass ``copy=True`` for an independent buffer. The DLPack capsule
keeps the source's memory alive as long as the result lives; when the result dies the source is
released at once, and neither torch's caching allocator nor XLA's knows of reads still queued on
the other framework's stream: keep the source alive (or synchronize) until they are done.
``call_jax`` / ``call_torch`` do (they wait for the outputs / torch's stream before returning).

Source: the DLPack spec (https://dmlc.github.io/dlpack/latest/python_spec.html), the array API
``__dlpack__`` stream semantics above, ``torch/_tensor.py: Tensor.__dlpack__`` and
``jax/_src/dlpack.py: from_dlpack`` (jax 0.11.2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch

from moe_contract.validation import check_dtype

__all__ = ["to_jax", "to_torch", "call_jax", "call_torch", "ZERO_COPY_DTYPES"]

#: Dtypes that cross zero-copy in both directions (whatever JAX's x64 setting).
ZERO_COPY_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int32", "int8", "uint8", "bool")
_X64_DTYPES = ("int64", "float64")  # zero-copy with JAX's x64 on
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
# Data pointer alignment (bytes) XLA assumes for a buffer it imports. XLA:CPU checks 64 itself (and would
# copy); XLA:GPU assumes 16 for entry parameters (xla/service/gpu/gpu_constants.h: kEntryParameterAlignBytes)
# without checking an imported pointer, so a less aligned tensor is copied here, on both.
_CPU_ALIGNMENT = 64
_GPU_ALIGNMENT = 16


def _type_name(x: Any) -> str:
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _x64_enabled() -> bool:
    # canonicalize_dtype honours both JAX_ENABLE_X64 and the `jax.enable_x64` context.
    return jax.dtypes.canonicalize_dtype(np.int64) == np.dtype(np.int64)


def _check_copy(op: str, copy: Any) -> None:
    if copy is not None and not isinstance(copy, bool):
        raise TypeError(f"{op}: copy must be None, True or False; got copy={copy!r}")


def _is_compact(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when ``strides`` (in elements) are a permutation of a dense row-major layout.

    This is what XLA's DLPack importer accepts (a transposition of the buffer, no gaps, no
    broadcasting); size-1 dims may have any stride.
    """
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(shape, strides) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def to_jax(tensor: torch.Tensor, *, copy: bool | None = None) -> jax.Array:
    """A torch tensor as a ``jax.Array`` on the same device, sharing its memory where it can.

    Args:
      tensor: any shape (0-dim and 0-size included), on the CPU or a CUDA device, dtype
        float32 / bfloat16 / float16 / float8_e4m3fn / float8_e5m2 / int32 / int8 / uint8 /
        bool (zero-copy), or int64 (zero-copy with JAX's x64 on; else a checked int32 copy),
        or float64 (x64 on only). A tensor with ``requires_grad`` is detached first.
      copy: ``None`` (default): zero-copy when the layout allows, else a copy, namely for
        non-compact strides (column slices, ``[::2]``, ``expand``: ``tensor.contiguous()``),
        int64 with x64 off (checked int32), and a data pointer not 64-byte (CPU) / 16-byte
        (GPU) aligned (``clone()``). ``False``: never copy; raise ``ValueError`` where a copy is needed.
        ``True``: always copy (an independent buffer; torch may then write the tensor freely).

    Returns: the ``jax.Array``, same shape, same dtype (int64 -> int32 with x64 off), on the
      JAX device matching ``tensor.device`` (``cuda:i`` -> JAX GPU ``i``). Ordered after all
      work enqueued on torch's current stream (module docstring: stream order).

    Raises:
      TypeError: ``tensor`` is not a ``torch.Tensor``, not dense (``torch.strided``), or of
        another dtype (float64 with x64 off among them); ``copy`` is not a bool or None.
      ValueError: ``tensor`` is on a device other than the CPU or CUDA, or on CUDA while JAX has
        no GPU backend; int64 values outside int32's range with x64 off; ``copy=False`` where a
        copy is needed.

    Example: ``ids = to_jax(topk_ids)`` (``[T, topk]`` int64 from SGLang -> int32 JAX array).
    """
    op = "to_jax"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: tensor must be a torch.Tensor; got {_type_name(tensor)}")
    _check_copy(op, copy)
    if tensor.layout != torch.strided:
        raise TypeError(f"{op}: tensor must be a dense torch.strided tensor; got tensor.layout={tensor.layout}")
    x64 = _x64_enabled()
    if tensor.dtype == torch.float64 and not x64:
        raise TypeError(
            f"{op}: tensor must have dtype {' or '.join(ZERO_COPY_DTYPES + ('int64',))} (float64 only with JAX's x64 "
            "on: JAX would round it to float32); got tensor.dtype=float64"
        )
    allowed = ZERO_COPY_DTYPES + (_X64_DTYPES if x64 else ("int64",))
    check_dtype(op, "tensor", tensor, allowed)
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: tensor must be on the CPU or a CUDA device; got tensor.device={tensor.device}")
    if tensor.device.type == "cuda":
        try:
            jax.devices("gpu")
        except RuntimeError:
            raise ValueError(
                f"{op}: tensor must be on a device JAX can use; got tensor.device={tensor.device} while JAX has "
                f"no GPU backend (jax.default_backend()={jax.default_backend()!r})"
            ) from None
    t = tensor.detach()  # same memory; DLPack cannot carry autograd state (torch refuses to export it)

    if t.dtype == torch.int64 and not x64:
        if copy is False:
            raise ValueError(
                f"{op}: tensor must have a dtype JAX holds without a copy for copy=False; got tensor.dtype=int64 "
                "with JAX's x64 off (it becomes int32: pass copy=None, or enable x64)"
            )
        if t.numel():
            lo, hi = (int(v) for v in torch.aminmax(t))  # host sync
            if lo < _INT32_MIN or hi > _INT32_MAX:
                raise ValueError(
                    f"{op}: tensor (int64, converted to int32 because JAX's x64 is off) must hold values in "
                    f"[{_INT32_MIN}, {_INT32_MAX}]; got values in [{lo}, {hi}]"
                )
        t = t.to(torch.int32, memory_format=torch.contiguous_format)  # a new buffer, on torch's current stream
        copy = None  # already copied
    elif t.numel() == 0:
        # No bytes to share: an empty buffer of the same shape, so that no stride pattern can trip the importer.
        t = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        copy = None
    elif copy:
        t = t.clone(memory_format=torch.contiguous_format)
        copy = None
    elif not _is_compact(tuple(t.shape), tuple(t.stride())):
        if copy is False:
            raise ValueError(
                f"{op}: tensor must have compact strides (a dense layout, possibly transposed) for copy=False; "
                f"got shape={tuple(t.shape)}, stride={tuple(t.stride())} (a column slice, step or expand: "
                "pass copy=None to copy it with .contiguous())"
            )
        t = t.contiguous()
    align = _CPU_ALIGNMENT if t.device.type == "cpu" else _GPU_ALIGNMENT
    if t.numel() and t.data_ptr() % align:
        if copy is False:
            raise ValueError(
                f"{op}: tensor must have its data {align}-byte aligned on {t.device.type} for copy=False (XLA assumes "
                f"it); got data_ptr() % {align} = {t.data_ptr() % align} (a row slice starting mid-line: pass copy=None "
                "to copy it)"
            )
        t = t.clone(memory_format=torch.contiguous_format)  # a fresh allocation: aligned
    if t.device.type == "cuda":
        # torch's __dlpack__ exports only from the current CUDA device.
        with torch.cuda.device(t.device):
            return jax.dlpack.from_dlpack(t)
    return jax.dlpack.from_dlpack(t)


def to_torch(array: jax.Array, *, copy: bool | None = None) -> torch.Tensor:
    """A ``jax.Array`` as a torch tensor on the same device, sharing its memory.

    Args:
      array: a concrete (not traced) ``jax.Array`` on one device (CPU or GPU), any shape
        (0-dim and 0-size included), dtype float32 / bfloat16 / float16 / float8_e4m3fn /
        float8_e5m2 / int32 / int8 / uint8 / bool, or int64 / float64 (x64 on only).
      copy: ``None`` / ``False`` (default): zero-copy (always possible). ``True``: a copy
        (``.clone()``), which torch may write without changing the JAX array.

    Returns: the tensor, same shape and dtype, on ``cpu`` or ``cuda:i``; a JAX array with a
      permuted layout (e.g. from ``to_jax`` of a transposed tensor) comes back with the
      matching strides. The host waits for ``array`` first (``block_until_ready``, module
      docstring: stream order), so the tensor is ready for every torch stream.

    Raises:
      TypeError: ``array`` is not a ``jax.Array``, is a tracer (inside ``jit`` / ``vmap``), or
        has another dtype; ``copy`` is not a bool or None.
      ValueError: ``array`` is sharded over more than one device, or deleted (donated).
    """
    op = "to_torch"
    if isinstance(array, jax.core.Tracer):
        raise TypeError(
            f"{op}: array must be a concrete jax.Array (DLPack cannot export values traced inside jit / vmap / "
            f"grad); got {_type_name(array)}"
        )
    if not isinstance(array, jax.Array):
        raise TypeError(f"{op}: array must be a jax.Array; got {_type_name(array)}")
    _check_copy(op, copy)
    check_dtype(op, "array", array, ZERO_COPY_DTYPES + (_X64_DTYPES if _x64_enabled() else ()))
    if array.is_deleted():
        raise ValueError(f"{op}: array must be alive; got a deleted (donated) array")
    n_devices = len(array.sharding.device_set)
    if n_devices != 1:
        raise ValueError(f"{op}: array must live on one device; got an array sharded over {n_devices} devices")
    array.block_until_ready()  # host wait: ready for any torch stream, not only the current one
    t = torch.from_dlpack(array)  # passes torch's current stream (array API protocol)
    return t.clone() if copy else t


def _map(fn: Callable[[Any], Any], kind: type | tuple[type, ...], tree: Any) -> Any:
    """Apply ``fn`` to every ``kind`` leaf in nested tuples (named too), lists and dicts."""
    if isinstance(tree, kind):
        return fn(tree)
    if isinstance(tree, tuple):
        items = [_map(fn, kind, v) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    if isinstance(tree, list):
        return [_map(fn, kind, v) for v in tree]
    if isinstance(tree, dict):
        return {k: _map(fn, kind, v) for k, v in tree.items()}
    return tree


def call_jax(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a JAX function on torch tensors: ``fn(*to_jax(args), **to_jax(kwargs))`` -> torch.

    Every ``torch.Tensor`` in ``args`` / ``kwargs`` (also inside tuples, named tuples, lists and
    dicts) becomes a JAX array by :func:`to_jax`; every ``jax.Array`` in the result (same
    containers; ``RoutingMetadata`` is a named tuple) becomes a torch tensor by
    :func:`to_torch`. Anything else (ints, configs, dtypes, ``None``) passes unchanged.

    Example: ``y_t = call_jax(moe_pallas.grouped_gemm, x_t, w_t, offsets_t)``
    (``x_t [M_cap, K]`` bf16, ``w_t [E, N, K]`` bf16, ``offsets_t [E + 1]`` int32 or int64
    torch tensors -> ``y_t [M_cap, N]`` bf16 torch tensor, zero-copy both ways).

    Stream order: ``fn`` reads the inputs after the work on torch's current stream; the host
    waits for the outputs (``to_torch``), so the JAX views of the inputs are no longer read
    when this returns. No gradient flows (inputs are detached).

    Raises: what :func:`to_jax`, ``fn`` and :func:`to_torch` raise.
    """
    args, kwargs = _map(to_jax, torch.Tensor, (args, kwargs))
    return _map(to_torch, jax.Array, fn(*args, **kwargs))


def call_torch(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a torch function on JAX arrays: ``fn(*to_torch(args), **to_torch(kwargs))`` -> JAX.

    Every ``jax.Array`` in ``args`` / ``kwargs`` (also inside tuples, named tuples, lists and
    dicts) becomes a torch tensor by :func:`to_torch`; every ``torch.Tensor`` in the result
    becomes a JAX array by :func:`to_jax` (int64 outputs: the checked int32 conversion when
    x64 is off). Anything else passes unchanged.

    Example: ``y = call_torch(moe_torch.grouped_gemm, x, w, offsets, implementation="triton")``
    (``x [M_cap, K]``, ``w [E, N, K]``, ``offsets [E + 1]`` int32 JAX arrays -> ``y [M_cap, N]``
    JAX array).

    Stream order: the inputs are ready before ``fn`` runs (``to_torch`` waits for them); the
    outputs are ordered after torch's current stream (``to_jax``). When an input is on CUDA,
    the host then waits for torch's current stream: the torch views of the JAX inputs die on
    return and JAX could reuse their memory while a torch kernel still reads it.

    Raises: what :func:`to_torch`, ``fn`` and :func:`to_jax` raise.
    """
    args, kwargs = _map(to_torch, jax.Array, (args, kwargs))
    out = _map(to_jax, torch.Tensor, fn(*args, **kwargs))
    cuda_inputs = []
    _map(lambda t: cuda_inputs.append(t.device) if t.is_cuda else None, torch.Tensor, (args, kwargs))
    for device in set(cuda_inputs):
        torch.cuda.current_stream(device).synchronize()
    return out

