"""The device spec of JAX's default GPU (``moe_contract.selection.DeviceSpec``), read from the device once.

Mirror: ``moe_torch/ops/device.py``.
"""

from __future__ import annotations

import functools

import jax

from moe_contract.selection import DeviceSpec

#: The most shared memory one block may opt in to, by compute capability, in bytes (CUDA C++ Programming Guide,
#: "Technical Specifications per Compute Capability"): JAX's device object does not report it.
SMEM_PER_BLOCK_OPTIN = {(8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448,
                        (10, 0): 232448, (10, 3): 232448, (12, 0): 101376}


def spec_of(device) -> DeviceSpec:
    """The :class:`~moe_contract.selection.DeviceSpec` of a JAX GPU ``device`` (its ``device_kind``,
    ``compute_capability`` such as ``"9.0"``, and ``core_count``, the SM count). Raises ValueError for a device
    without a compute capability (not a CUDA GPU)."""
    cc = getattr(device, "compute_capability", None)
    if not cc:
        raise ValueError(f"device_spec: {device} reports no compute capability (not a CUDA GPU)")
    major, minor = (int(p) for p in str(cc).split(".")[:2])
    return DeviceSpec(kind=device.device_kind, capability=(major, minor), sm_count=int(device.core_count),
                      smem_per_block=SMEM_PER_BLOCK_OPTIN.get((major, minor), 49152))


@functools.cache
def _default_spec() -> DeviceSpec | None:
    try:
        if jax.default_backend() != "gpu":
            return None
        return spec_of(jax.devices()[0])
    except Exception:  # noqa: BLE001 - no backend to ask, or a device without these attributes: no tuned lookup
        return None


def device_spec() -> DeviceSpec | None:
    """The spec of JAX's first device when the default backend is a GPU, else ``None`` (the CPU: no tuned lookup).
    Host-side only (read at trace time, cached)."""
    return _default_spec()
