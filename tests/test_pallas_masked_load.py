"""A masked load running past the end of a buffer (a case from public bug reports about Pallas'
interpret mode disagreeing with the GPU): ``arange(8)`` read at offset 3 with length 8 and fill -1
must give ``[3, 4, 5, 6, 7, -1, -1, -1]`` in interpret mode (CPU, CI) and on the GPU alike.

Every Pallas-Triton kernel of ``moe_pallas`` relies on this: the last row tile of a grouped GEMM,
permute or combine reads past ``M_cap`` with a mask. Interpret mode must not clamp the window's
start (as ``lax.dynamic_slice`` does), or the masked-in lanes would read shifted values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

EXPECTED = [3, 4, 5, 6, 7, -1, -1, -1]


def _kernel(off_ref, x_ref, o_ref, *, length: int, size: int):
    off = off_ref[0]  # read at run time, as the MoE kernels' row offsets are
    idx = off + jnp.arange(length)
    o_ref[...] = plgpu.load(x_ref.at[pl.ds(off, length)], mask=idx < size, other=-1)


def masked_tail_load(x: jax.Array, offset: jax.Array, length: int, interpret: bool) -> jax.Array:
    kernel = functools.partial(_kernel, length=length, size=x.shape[0])
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((length,), x.dtype), interpret=interpret)(offset, x)


def test_masked_load_past_the_end():
    """Interpret mode on a CPU (the kernel path CI runs), and the compiled kernel on a GPU."""
    interpret = jax.default_backend() == "cpu"
    y = masked_tail_load(jnp.arange(8, dtype=jnp.int32), jnp.asarray([3], jnp.int32), 8, interpret)
    assert np.asarray(y).tolist() == EXPECTED


def test_static_out_of_bounds_window_is_rejected_at_trace_time():
    """With a static offset JAX refuses the window while tracing (so no kernel can silently read a
    clamped window); the MoE kernels' offsets are run-time values, the case above."""

    def kernel(x_ref, o_ref):
        o_ref[...] = plgpu.load(x_ref.at[pl.ds(3, 8)], mask=3 + jnp.arange(8) < 8, other=-1)

    with pytest.raises(ValueError, match=r"Out of bound slice: start=3, size=8"):
        pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.int32), interpret=True)(jnp.arange(8, dtype=jnp.int32))


def test_masked_load_lowers_for_cuda():
    """The same kernel lowers for an H200 (checked on the CPU with an abstract device)."""
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "cuda"))
    f = jax.jit(functools.partial(masked_tail_load, length=8, interpret=False))
    args = (jnp.arange(8, dtype=jnp.int32), jnp.asarray([3], jnp.int32))
    with use_abstract_mesh(mesh):
        lowered = f.trace(*args).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text().lower()
