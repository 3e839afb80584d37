"""What every Triton backend of ``moe_torch`` checks before a launch.

Mirror: none (the JAX side lowers its Pallas kernels through XLA, which needs no such check).
"""

from __future__ import annotations

import torch


def is_interpreted(kernel) -> bool:
    """``True`` if ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (it then runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_triton_device(op: str, device: torch.device, kernel, needs_fp8: bool = False) -> None:
    """``NotImplementedError`` if ``kernel`` cannot run on ``device``: CPU tensors without the
    interpreter, or a float8_e4m3fn conversion on a GPU older than sm_89 (Ada / Hopper)."""
    if device.type != "cuda" and not is_interpreted(kernel):
        raise NotImplementedError(
            f"{op}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is imported); "
            f"got tensors on {device}"
        )
    if needs_fp8 and device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise NotImplementedError(f"{op}: float8_e4m3fn conversion needs sm_89 or newer; got sm_{cap[0]}{cap[1]}")
