"""FP8 quantization inside Pallas-Triton kernels (the permute's and the activation's fused quantization).

:func:`quantize_div_fp8_kernel` is the contract's ``cast_rne(clamp(x / scale, -448, 448))`` (CONTRACT.md section 4,
``/`` correctly rounded; CONTRACT.md section 3) in one of two forms with the same result on sm_90 and newer:

- the reference's :func:`~moe_pallas.ops.quant.reference.quantize_div_fp8`: an approximate quotient, then an exact
  integer repair of the codes it can move (XLA and Triton lower float32 ``/`` to ``div.full.f32``, up to 1 ulp off):
  about 1,800 more instructions a thread in the permute kernel than the division itself (sm_90 SASS, compiled on the
  CPU), so the layer's FP8 permute and activation kernels issue-bound, not memory-bound;
- PTX ``div.rn.f32`` (IEEE round-to-nearest-even, the quotient the contract names) through
  ``jax.experimental.pallas.triton.elementwise_inline_asm``: what torch's Triton kernels emit
  (``tl.math.div_rn``, moe_torch/ops/activation/triton.py). GPU only: inline PTX has no interpret-mode rule.

Which one a kernel takes is decided when it is lowered: :func:`div_rn_enabled` (``EPMOE_PALLAS_DIV_RN``), never in
interpret mode, never for a GPU older than sm_90: Triton 3.6 lowers the float32 -> float8_e4m3fn cast on sm_89 through
``cvt.rz.f16.f32`` then a round-to-nearest to e4m3 (two roundings: ``1.0625 + 2^-20`` becomes 1.0, not 1.125),
which the repaired path's exact code arithmetic does not go through. ``div.rn.f32`` is the default (its codes and
scales match the reference's bit for bit on the GPU, ``tests/test_div_rn.py``, and the layer's FP8 permute is several
times faster with it, BENCHMARKS.md); ``EPMOE_PALLAS_DIV_RN=0`` keeps the repair. A NaN input stays NaN (``jnp.clip`` lowers to ``maxnum`` / ``minnum``, which would drop it).

Mirror: ``moe_torch/ops/triton_common.py`` (``quantize_fp8_tile``: ``tl.math.div_rn``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltr

from moe_pallas.ops.common import div_rn_enabled
from moe_pallas.ops.quant.reference import FP8_DTYPE, FP8_MAX, quantize_div_fp8

__all__ = ["quantize_div_fp8_kernel", "kernel_div_rn"]


def _gpu_below_sm90() -> bool:
    """Whether the attached GPU is older than sm_90 (``False`` without one: lowering for CUDA on a CPU targets
    Hopper, the project's GPU)."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return False
    cc = getattr(devices[0], "compute_capability", None) if devices else None
    if not cc:
        return False
    major, minor, *_ = (int(v) for v in str(cc).split("."))
    return (major, minor) < (9, 0)


def kernel_div_rn(interpret: bool) -> bool:
    """Whether a kernel lowered now divides with ``div.rn.f32``: never in interpret mode nor for a GPU older than
    sm_90 (module docstring), else :func:`~moe_pallas.ops.common.div_rn_enabled`."""
    return (not interpret) and div_rn_enabled() and not _gpu_below_sm90()


def quantize_div_fp8_kernel(x: jax.Array, scale: jax.Array, *, div_rn: bool) -> jax.Array:
    """float8_e4m3fn codes ``cast_rne(clamp(x / scale, -448, 448))`` inside a Pallas-Triton kernel.

    ``x``: float32 ``[rows, cols]``; ``scale``: float32 broadcastable to ``x`` (> 0, from ``scale_from_amax`` or a
    given scale). ``div_rn`` (static, :func:`kernel_div_rn`): PTX ``div.rn.f32`` (GPU lowering only); else the
    reference's repaired division. Both give the contract's codes; the first in ~1/3 of the instructions."""
    if not div_rn:
        return quantize_div_fp8(x, scale)
    s = jnp.broadcast_to(scale, x.shape).astype(jnp.float32)
    [q] = pltr.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[x.astype(jnp.float32), s],
                                      constraints="=f,f,f", pack=1,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    q = jnp.where(jnp.isnan(q), q, jnp.clip(q, -FP8_MAX, FP8_MAX))  # maxnum / minnum would turn NaN into -448
    return q.astype(FP8_DTYPE)
