"""The JAX grouped GEMM's kernels as named choices (``moe_contract.selection.KernelRegistry``).

``grouped_gemm(..., implementation=name)`` runs one of them by name; ``implementation=None`` tries them in the
order of the device's tuned table (``backend_table.py``) after dropping, with a logged reason, those this device
cannot run at all:

=====================  ===========================================================================================
name                   serves
=====================  ===========================================================================================
``pallas_mosaic_gpu``  sm_90 (wgmma, TMA, warp specialization): 16-bit and FP8 inputs (``pallas_mosaic_gpu*.py``);
                       its config rules refuse a request it cannot tile (``config.py: mosaic_config_problem``)
``pallas_triton``      every CUDA GPU Triton supports (sm_80 and newer; FP8 from sm_89), and interpret mode: the
                       portable path (``pallas_triton*.py``)
``reference``          everything (plain ``jnp``)
=====================  ===========================================================================================

Mirror: ``moe_torch/ops/grouped_gemm/kernels.py``.
"""

from __future__ import annotations

import functools
import logging

from moe_contract.selection import DeviceSpec, KernelChoice, KernelRegistry

log = logging.getLogger("moe_pallas")


def _mosaic(spec: DeviceSpec | None, layout: str) -> str | None:
    if spec is None:
        return "needs a CUDA GPU (Mosaic GPU does not interpret on the CPU)"
    if not spec.is_hopper:
        return f"needs compute capability 9.0 (sm_90: wgmma, TMA); got {spec.arch}"
    return None


def _pallas_triton(spec: DeviceSpec | None, layout: str) -> str | None:
    if spec is None:
        return None  # interpret mode
    if spec.capability < (8, 0):
        return f"needs compute capability 8.0 or newer; got {spec.arch}"
    if "fp8" in layout and spec.capability < (8, 9):
        return f"FP8 needs compute capability 8.9 or newer; got {spec.arch}"
    return None


#: The grouped GEMMs' GPU kernels; ``problem`` is the request's layout key (``backend_table.gemm_layout`` and its
#: dgrad / wgrad mirrors), the only part of a request that decides whether a device can run a kernel at all.
KERNELS = KernelRegistry("grouped_gemm", [
    KernelChoice("pallas_mosaic_gpu", _mosaic, "Pallas Mosaic GPU: warp-specialized wgmma kernels"),
    KernelChoice("pallas_triton", _pallas_triton, "Pallas-Triton: every CUDA GPU, and interpret mode"),
    KernelChoice("reference", lambda spec, layout: None, "plain jnp"),
])


@functools.cache
def _log_once(op: str, name: str, why: str) -> None:
    log.info("%s: kernel %r is not tried on this device: %s", op, name, why)


def runnable(op: str, order: tuple[str, ...], spec: DeviceSpec | None, layout: str) -> tuple[str, ...]:
    """``order`` without the kernels this device cannot run at all (each reason logged once); the reference
    always stays last."""
    out = []
    for name in order:
        why = KERNELS.choices[name].supported_on(spec, layout) if name in KERNELS.choices else None
        if why is None:
            out.append(name)
        else:
            _log_once(op, name, why)
    return tuple(out)
