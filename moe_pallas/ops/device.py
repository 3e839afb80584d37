"""The device spec of JAX's default GPU (``moe_contract.selection.DeviceSpec``), read from the device once.

Mirror: ``moe_torch/ops/device.py``.
"""

from __future__ import annotations

import functools
import logging

import jax

from moe_contract.selection import DeviceSpec

log = logging.getLogger("moe_pallas")

#: The most shared memory one thread block may opt in to, by compute capability, in bytes. Source: CUDA C++
#: Programming Guide, Compute Capabilities table (maximum shared memory per thread block). JAX's device object does
#: not report it (torch's ``shared_memory_per_block_optin`` does). sm_80 / sm_87: 163 KiB; sm_86 / sm_89 / sm_120:
#: 99 KiB; sm_90 / sm_100 / sm_103: 227 KiB.
SMEM_PER_BLOCK_OPTIN = {(8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448,
                        (10, 0): 232448, (10, 3): 232448, (12, 0): 101376}
#: A capability missing from the table gets 48 KiB, the static limit every CUDA GPU gives a block without opting in:
#: a kernel sized for it fits anywhere.
SMEM_PER_BLOCK_UNKNOWN = 49152


@functools.cache
def smem_per_block(capability: tuple[int, int]) -> int:
    """The opt-in shared memory per block of compute ``capability`` (:data:`SMEM_PER_BLOCK_OPTIN`); a capability
    the table does not know gets :data:`SMEM_PER_BLOCK_UNKNOWN`, said once per capability (cached)."""
    smem = SMEM_PER_BLOCK_OPTIN.get(capability)
    if smem is None:
        smem = SMEM_PER_BLOCK_UNKNOWN
        log.warning("compute capability %d.%d is not in moe_pallas.ops.device.SMEM_PER_BLOCK_OPTIN: planning for "
                    "%d bytes of shared memory a block (the limit without opt-in); kernels may pick smaller "
                    "tiles than this GPU allows", *capability, smem)
    return smem


def spec_of(device) -> DeviceSpec:
    """The :class:`~moe_contract.selection.DeviceSpec` of a JAX GPU ``device`` (its ``device_kind``,
    ``compute_capability`` such as ``"9.0"``, and ``core_count``, the SM count; the shared memory per block from
    :func:`smem_per_block`). Raises ValueError for a device without a compute capability (not a CUDA GPU)."""
    cc = getattr(device, "compute_capability", None)
    if not cc:
        raise ValueError(f"device_spec: {device} reports no compute capability (not a CUDA GPU)")
    major, minor = (int(p) for p in str(cc).split(".")[:2])
    return DeviceSpec(kind=device.device_kind, capability=(major, minor), sm_count=int(device.core_count),
                      smem_per_block=smem_per_block((major, minor)))


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
