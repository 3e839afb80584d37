"""Small numerics helpers shared by the torch references.

Mirror: ``moe_pallas/ops/common.py``.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np
import torch

from moe_contract.validation import dtype_name


def takes_torch_tensors(fn):
    """Decorator: an argument that is an array of another kind (numpy, jax) is a ``TypeError``
    naming the op and the argument, raised before anything runs. (Numpy scalars are scalars.)"""
    signature = inspect.signature(fn)
    params = signature.parameters.values()
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    n_positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        names, n_positional = None, -1  # (no fast path: *args / **kwargs)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        # the common call (tensors, None, Python scalars and strings, known keywords) needs no binding: it costs
        # host time on every op call, which shows at small shapes
        if (len(args) <= n_positional and kwargs.keys() <= names
                and all(type(v) in _PLAIN or isinstance(v, torch.Tensor) for v in args)
                and all(type(v) in _PLAIN or isinstance(v, torch.Tensor) for v in kwargs.values())):
            return fn(*args, **kwargs)
        try:
            bound = signature.bind_partial(*args, **kwargs)
        except TypeError as exc:  # a misspelled keyword or too many arguments: name the op, as Python would
            raise TypeError(f"{fn.__name__}: {exc}") from None
        check_torch_tensors(fn.__name__, bound.arguments)
        return fn(*args, **kwargs)

    return wrapper


#: Values that are never an array of another kind (:func:`takes_torch_tensors`' fast path).
_PLAIN = frozenset({type(None), bool, int, float, str, torch.dtype})


def check_torch_tensors(op: str, named: dict, *, required: bool = False) -> None:
    """``TypeError`` naming ``op`` and the argument for a value of ``named`` that is an array of
    another kind (numpy, jax; numpy scalars are scalars); with ``required``, for any value that is
    neither ``None`` nor a ``torch.Tensor``. (A ``torch.distributed`` process group is no array: passed over
    without a look at its attributes, which ``torch.compile`` could not trace.)"""
    for name, value in named.items():
        if value is None or isinstance(value, torch.Tensor) or _is_process_group(value):
            continue
        is_array = not isinstance(value, (type, np.generic)) and hasattr(value, "shape") and hasattr(value, "dtype")
        if is_array or required:
            kind = f"{type(value).__module__}.{type(value).__name__}"
            raise TypeError(f"{op}: {name} must be a torch.Tensor (moe_torch is the PyTorch backend); got {kind}")


def _is_process_group(value) -> bool:
    return torch.distributed.is_available() and isinstance(value, torch.distributed.ProcessGroup)


def first_order_backward(op: str):
    """Decorator for an ``autograd.Function``'s ``backward`` that is not itself differentiable (it detaches, runs
    kernels, or is ``once_differentiable``): called with grad mode on, i.e. ``create_graph=True`` (autograd runs a
    backward with grad mode = ``create_graph``), it raises ``RuntimeError`` naming ``op`` instead of returning a
    gradient without a graph (a gradient penalty would silently lose its second-order terms). Put it above
    ``once_differentiable``, which turns grad mode off inside."""

    def decorate(backward):
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"{op}: second-order gradients (create_graph=True / double backward) are not supported: its "
                    f"backward is not differentiable; got a backward with create_graph=True (use create_graph=False, "
                    f"or keep this layer out of the differentiated gradient)")
            return backward(ctx, *grads)

        return checked

    return decorate


def resolve_dtype(dtype) -> torch.dtype:
    """A ``torch.dtype`` from any dtype spelling (``torch.bfloat16``, ``"bfloat16"``, ``jnp.bfloat16``)."""
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype_name(dtype))


def cast_rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, rounding to nearest even. (Eager torch always rounds here; the jnp mirror
    must force it under ``jit``, where XLA may keep excess precision.)"""
    return x.to(dtype)
