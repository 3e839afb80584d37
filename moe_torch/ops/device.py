"""The device spec of a torch device (``moe_contract.selection.DeviceSpec``), read from the device once.

Mirror: ``moe_pallas/ops/device.py``.
"""

from __future__ import annotations

import functools
import logging

import torch

from moe_contract.selection import DeviceSpec

log = logging.getLogger("moe_torch")


@functools.cache
def _cuda_spec(index: int) -> DeviceSpec:
    p = torch.cuda.get_device_properties(index)
    # the opt-in maximum a kernel may ask for (227 KiB on sm_90), not the 48 KiB default
    smem = getattr(p, "shared_memory_per_block_optin", 0) or p.shared_memory_per_block
    spec = DeviceSpec(kind=p.name, capability=(p.major, p.minor), sm_count=p.multi_processor_count,
                      smem_per_block=int(smem))
    if not spec.is_hopper:  # said once per device: the defaults take the portable kernels here
        log.info("%s: the sm_90 kernels (Gluon warp-specialized, Triton TMA) do not run here; the grouped GEMMs "
                 "default to the portable Triton pointer kernels", spec.describe())
    return spec


def device_spec(device: torch.device | str | None = None) -> DeviceSpec | None:
    """The :class:`~moe_contract.selection.DeviceSpec` of a CUDA ``device`` (default: the current CUDA device),
    ``None`` for a CPU device. Host-side, cached per device index: no sync, no launch."""
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_spec(device.index if device.index is not None else torch.cuda.current_device())
