"""Permutation (CONTRACT.md section 2): the torch ops against the jnp ops on the shared cases of
``op_cases/permute.py`` (edge cases, out-of-range ids, T = 0, the property test, the permute per quant mode and
dtype).

Both frameworks' public ops run with ``implementation=None``: the references on the CPU (the device's default
backends under ``EPMOE_TEST_DEVICE=gpu``). The torch op is the one under test (it also takes int64 and strided
ids), the jnp op its judge: they must agree int for int and bit for bit, so every check on the torch results
holds for the jnp results too.
"""

from __future__ import annotations

import moe_pallas
import moe_torch
from common import to_jax
from op_cases import TorchArrays
from op_cases.permute import PermuteCases, RoutingMetadataCases, fit_int32


class TestRoutingMetadataReference(TorchArrays, RoutingMetadataCases):
    """``moe_torch.routing_metadata`` against ``moe_pallas.routing_metadata`` (the int64 ids of the judge
    narrowed by ``fit_int32``: JAX without x64 has no int64)."""

    ID_VARIANTS = ("int32", "int64", "strided")

    def routing_metadata(self, ids, E, start, e_local, config=None, check_ids=False):
        return moe_torch.routing_metadata(ids, E, expert_start=start, num_local_experts=e_local, check_ids=check_ids)

    def reference_routing_metadata(self, ids_np, E, start, e_local):
        return moe_pallas.routing_metadata(to_jax(fit_int32(ids_np)), E, expert_start=start, num_local_experts=e_local)


class TestPermuteReference(TorchArrays, PermuteCases):
    """``moe_torch.permute`` against ``moe_pallas.permute``."""

    SHAPES = ("T1", "odd-T", "H384")

    def permute(self, x, dst2src, topk, quant, group_size, scale, config=None):
        return moe_torch.permute(x, dst2src, topk=topk, quant=quant, group_size=group_size, scale=scale)

    def reference_permute(self, x_np, dtype, dst2src_np, topk, quant, group_size, scale_np):
        scale = None if scale_np is None else to_jax(scale_np)
        return moe_pallas.permute(to_jax(x_np, dtype), to_jax(dst2src_np), topk=topk, quant=quant,
                                  group_size=group_size, scale=scale)
