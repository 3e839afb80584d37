"""Guards on a torch module's tensors, shared by :class:`moe_torch.EPMoE` and
:class:`moe_torch.hf.HFExperts`: casts that keep FP8 / 4-bit codes and their scales in their dtype
(:func:`keep_dtypes_fn`), ``load_state_dict`` refusing codes for float weights and the reverse
(:func:`check_code_dtypes_on_load`), and torch-only arguments (:func:`require_torch_tensors`).

A leaf of ``moe_torch``: ``module`` and ``hf`` both import it, and it imports neither.
"""

from __future__ import annotations

import numpy as np
import torch

from moe_contract.validation import dtype_name


def _module_tensor(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """``module``'s own parameter or buffer ``name`` (``None`` if it has none of that name)."""
    t = module._parameters.get(name)
    return module._buffers.get(name) if t is None else t


def keep_dtypes_fn(module: torch.nn.Module, fn, names) -> object:
    """``fn`` of ``Module._apply`` (what ``.to()``, ``.half()``, ``.float()``, ``.cuda()`` apply to
    every tensor) wrapped so that ``module``'s parameters or buffers ``names`` keep their dtype: where
    ``fn`` would cast them, they only move to the device ``fn`` moves to. Everything else gets ``fn``.

    Why: torch counts float8 as floating point, so ``model.half()`` would turn FP8 weight codes into
    float16 numbers (and float32 scales into float16), after which the layer computes garbage or
    raises. transformers' quantized layers keep their codes and scales under casts the same way.
    ``fn`` is probed on an empty tensor of each kept tensor's dtype and device to learn its target.
    """
    kept = {id(p) for name in names if (p := _module_tensor(module, name)) is not None}
    if not kept:
        return fn

    def apply(t):
        if id(t) not in kept:
            return fn(t)
        probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
        if probe.dtype == t.dtype:
            return fn(t)  # a move (or share_memory_, to_empty...): as asked
        return t.detach().to(device=probe.device)  # a cast: the device only (a new tensor object, for swap_tensors)

    return apply


def _code_kind(t: torch.Tensor) -> str:
    """What a weight tensor holds, by dtype: FP8 codes, 4-bit packed codes (uint8) or float weights."""
    if t.dtype == torch.float8_e4m3fn:
        return "FP8 codes with scales"
    if t.dtype == torch.uint8:
        return "4-bit packed codes with scales"
    return "float weights"


def check_code_dtypes_on_load(module: torch.nn.Module, state_dict, prefix: str, names, error_msgs: list) -> bool:
    """For ``Module._load_from_state_dict``: a weight in ``state_dict`` whose kind (float weights, FP8 codes,
    4-bit packed uint8 codes) differs from ``module``'s parameter (or buffer) of that name is an error
    (``load_state_dict`` raises ``RuntimeError`` with it, even with ``strict=False``), since ``Parameter.copy_``
    would cast FP8 / 4-bit codes to float numbers, or float weights to codes, without their scales: a silently
    wrong layer.

    Returns ``True`` if it appended an error (the caller then loads nothing into ``module``)."""
    before = len(error_msgs)
    for name in names:
        p, t = _module_tensor(module, name), state_dict.get(prefix + name)
        if p is None or not isinstance(t, torch.Tensor):
            continue
        if _code_kind(p) != _code_kind(t):
            error_msgs.append(
                f"dtype mismatch for {prefix}{name}: the module holds {dtype_name(p)} ({_code_kind(p)}); the state_dict "
                f"has {dtype_name(t)} (float weights load into a float layer, FP8 or 4-bit codes with their scales into "
                f"a layer of that quant)")
    return len(error_msgs) > before


def require_torch_tensors(op: str, named: dict) -> None:
    """``TypeError`` for an argument that is not a ``torch.Tensor``, naming the conversion to use
    (``torch.from_numpy`` for numpy): each module takes its own framework's arrays only."""
    for name, value in named.items():
        if isinstance(value, torch.Tensor):
            continue
        if value is None:
            raise TypeError(f"{op}: {name} must be a torch.Tensor; got None")
        kind = f"{type(value).__module__}.{type(value).__name__}"
        if isinstance(value, np.ndarray):
            how = f"torch.from_numpy({name})"
        elif hasattr(value, "__dlpack__"):
            how = f"torch.from_dlpack({name}) (or interop.dlpack.to_torch)"
        else:
            how = f"torch.as_tensor({name})"
        raise TypeError(f"{op}: {name} must be a torch.Tensor (moe_torch modules take torch tensors only); got {kind}: "
                        f"convert it with {how}")
