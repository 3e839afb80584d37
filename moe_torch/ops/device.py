"""The device spec of a torch device (``moe_contract.selection.DeviceSpec``), read from the device once.

Mirror: ``moe_pallas/ops/device.py``.
"""

from __future__ import annotations

import functools

import torch

from moe_contract.selection import DeviceSpec


@functools.cache
def _cuda_spec(index: int) -> DeviceSpec:
    p = torch.cuda.get_device_properties(index)
    # the opt-in maximum a kernel may ask for (227 KiB on sm_90), not the 48 KiB default
    smem = getattr(p, "shared_memory_per_block_optin", 0) or p.shared_memory_per_block
    return DeviceSpec(kind=p.name, capability=(p.major, p.minor), sm_count=p.multi_processor_count,
                      smem_per_block=int(smem))


def device_spec(device: torch.device | str | None = None) -> DeviceSpec | None:
    """The :class:`~moe_contract.selection.DeviceSpec` of a CUDA ``device`` (default: the current CUDA device),
    ``None`` for a CPU device. Host-side, cached per device index: no sync, no launch."""
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_spec(device.index if device.index is not None else torch.cuda.current_device())
