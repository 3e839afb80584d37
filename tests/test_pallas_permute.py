"""Pallas-Triton routing metadata and permute (``moe_pallas/ops/permute/pallas_triton.py``) against the jnp reference.

The shared cases of ``op_cases/permute.py`` in interpret mode on the CPU (every output starts as NaN / garbage
there, so a row a kernel forgets to write fails the exact checks): metadata int for int, permuted rows, FP8 codes
and scales bit for bit (CONTRACT.md section 7). Then the config heuristic, and the CUDA lowering of each kernel
on an abstract H200.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

import moe_pallas
from common import to_jax
from moe_pallas.ops.permute.config import MIN_BLOCK_A, PermuteConfig, RoutingMetadataConfig, permute_config
from moe_pallas.ops.permute.pallas_triton import permute_pallas_triton, routing_metadata_pallas_triton
from moe_pallas.ops.permute.reference import permute_reference, routing_metadata_reference
from op_cases import JaxArrays
from op_cases.permute import PermuteKernelCases, RoutingMetadataKernelCases


class TestRoutingMetadataPallasTriton(JaxArrays, RoutingMetadataKernelCases):
    """``routing_metadata_pallas_triton`` against the jnp reference. The edge cases run with ``block_a = 16``
    (most of them span several blocks, so the scan across blocks is exercised), the property test with 16 or
    32; ``config=None`` goes through ``moe_pallas.routing_metadata(implementation="pallas_triton")``."""

    CASE_CONFIG = RoutingMetadataConfig(block_a=16)
    PROPERTY_CONFIGS = (RoutingMetadataConfig(block_a=16), RoutingMetadataConfig(block_a=32))
    PROPERTY_MAX_T = 40
    PROPERTY_EXAMPLES = 6

    def routing_metadata(self, ids, E, start, e_local, config=None, check_ids=False):
        if config is None:
            return moe_pallas.routing_metadata(ids, E, expert_start=start, num_local_experts=e_local,
                                               check_ids=check_ids, implementation="pallas_triton")
        return routing_metadata_pallas_triton(ids, expert_start=start, num_local_experts=e_local, config=config)

    def reference_routing_metadata(self, ids_np, E, start, e_local):
        return routing_metadata_reference(jnp.asarray(ids_np), start, e_local)

    def forced_routing_config(self, block_a, block_b, e_local):
        """``block_a``, at least the kernel's smallest block ``MIN_BLOCK_A`` (the scan across blocks is jnp's:
        no ``block_b``)."""
        return RoutingMetadataConfig(block_a=max(block_a, MIN_BLOCK_A))


class TestPermutePallasTriton(JaxArrays, PermuteKernelCases):
    """``permute_pallas_triton`` against the jnp reference; ``config=None`` goes through
    ``moe_pallas.permute(implementation="pallas_triton")`` (the dispatch path and the heuristic config)."""

    SHAPES = ("topk3-E8",)
    FORCED_CONFIGS = {
        "two-pass-odd-H": (7, 160, 2, 6, "fp8_per_token", 128, PermuteConfig(block_m=4, block_h=64, two_pass=True)),
        "group-32": (7, 96, 2, 6, "fp8_per_token_group", 32, None),
        "column-blocks-odd-H": (7, 160, 2, 6, None, 128, PermuteConfig(block_m=2, block_h=64)),
    }

    def permute(self, x, dst2src, topk, quant, group_size, scale, config=None):
        if config is None:
            return moe_pallas.permute(x, dst2src, topk=topk, quant=quant, group_size=group_size, scale=scale,
                                      implementation="pallas_triton")
        return permute_pallas_triton(x, dst2src, topk=topk, quant=quant, group_size=group_size, scale=scale,
                                     config=config)

    def reference_permute(self, x_np, dtype, dst2src_np, topk, quant, group_size, scale_np):
        scale = None if scale_np is None else to_jax(scale_np)
        return permute_reference(to_jax(x_np, dtype), to_jax(dst2src_np), topk, quant, group_size, scale)


def test_permute_config_heuristic():
    assert permute_config(64, 7168, "fp8_per_token_group", 128).block_h == 128
    assert not permute_config(64, 7168, "fp8_per_token", 128).two_pass
    assert permute_config(64, 14336, "fp8_per_token", 128).two_pass
    with pytest.raises(NotImplementedError, match="power of two"):
        permute_pallas_triton(jnp.zeros((2, 96), jnp.bfloat16), jnp.zeros((4,), jnp.int32), topk=2,
                              quant="fp8_per_token_group", group_size=48)


# --------------------------------------------------------------------------------------
# GPU lowering on the CPU: the kernels must lower for CUDA (Triton), not only interpret.

H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "cuda"))
TRITON_CALL = "__gpu$xla.gpu.triton"


def _lower_for_cuda(f, *args) -> str:
    with use_abstract_mesh(H200):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("E_local,block_a", [(5, None), (256, 32)])
def test_routing_metadata_lowers_for_cuda(E_local, block_a):
    config = None if block_a is None else RoutingMetadataConfig(block_a=block_a)
    f = functools.partial(routing_metadata_pallas_triton, expert_start=3, num_local_experts=E_local, config=config,
                          interpret=False)
    text = _lower_for_cuda(f, jax.ShapeDtypeStruct((37, 8), jnp.int32))
    assert text.count(TRITON_CALL) == 2, text[:2000]  # count, then rank-and-scatter


@pytest.mark.parametrize("quant,config,kernels", [
    (None, None, 1),
    ("fp8_per_token", None, 1),
    ("fp8_per_token", PermuteConfig(block_m=4, block_h=128, two_pass=True), 2),
    ("fp8_per_token_group", None, 1),
    ("fp8_per_tensor", None, 1),
])
def test_permute_lowers_for_cuda(quant, config, kernels):
    T, topk, H = 13, 6, 384
    f = functools.partial(permute_pallas_triton, topk=topk, quant=quant, config=config, interpret=False)
    args = [jax.ShapeDtypeStruct((T, H), jnp.bfloat16), jax.ShapeDtypeStruct((T * topk,), jnp.int32)]
    if quant == "fp8_per_tensor":
        args.append(jax.ShapeDtypeStruct((), jnp.float32))
        f = functools.partial(lambda x, d, s, g: g(x, d, scale=s), g=f)
    text = _lower_for_cuda(f, *args)
    assert text.count(TRITON_CALL) == kernels, text[:2000]
