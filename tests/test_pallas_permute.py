"""Pallas-Triton routing metadata and permute (``moe_pallas/ops/permute/pallas_triton.py``) against the jnp reference.

Interpret mode on the CPU (every output starts as NaN / garbage there, so a row a kernel forgets
to write fails the exact checks), then the CUDA lowering of each kernel on an abstract H200
Metadata is compared int for int, permuted rows,
FP8 codes and scales bit for bit (CONTRACT.md section 7).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

import moe_pallas
from common import random_ids
from moe_pallas.ops.permute.config import PermuteConfig, RoutingMetadataConfig, permute_config
from moe_pallas.ops.permute.pallas_triton import permute_pallas_triton, routing_metadata_pallas_triton
from moe_pallas.ops.permute.reference import permute_reference, routing_metadata_reference
from test_permute import CASES, _ids, check_invariants
from tolerances import assert_exact

NAMES = ("expert_offsets", "src2dst", "dst2src")
QUANTS = [None, "fp8_per_token", "fp8_per_token_group", "fp8_per_tensor"]


def _check_metadata(ids: np.ndarray, start: int, e_local: int, config=None) -> None:
    got = routing_metadata_pallas_triton(jnp.asarray(ids), expert_start=start, num_local_experts=e_local, config=config)
    want = routing_metadata_reference(jnp.asarray(ids), start, e_local)
    for name, g, w in zip(NAMES, got, want):
        assert_exact(g, w, name)
    check_invariants(ids, start, e_local, *got)


@pytest.mark.parametrize("case", list(CASES))
def test_routing_metadata_cases(case):
    """block_a = 16: most cases span several blocks, so the scan across blocks is exercised."""
    T, topk, E, start, e_local, how = CASES[case]
    _check_metadata(_ids(np.random.default_rng(0), T, topk, E, how), start, e_local, RoutingMetadataConfig(block_a=16))


@settings(max_examples=6)
@given(E=st.integers(1, 12), T=st.integers(1, 40), data=st.data())
def test_property_routing_metadata(E, T, data):
    topk = data.draw(st.integers(1, E))
    start = data.draw(st.integers(0, E - 1))
    e_local = data.draw(st.integers(1, E - start))
    block_a = data.draw(st.sampled_from([16, 32]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    ids = random_ids(rng, T, topk, E, distinct=data.draw(st.booleans()))
    _check_metadata(ids, start, e_local, RoutingMetadataConfig(block_a=block_a))


def test_routing_metadata_out_of_range_ids_are_non_local():
    ids = np.array([[-1, 3], [9, 2], [3, 100], [0, 2]], np.int32)  # unchecked: -1, 9, 100 are non-local
    got = routing_metadata_pallas_triton(jnp.asarray(ids), expert_start=2, num_local_experts=2)
    for name, g, w in zip(NAMES, got, routing_metadata_reference(jnp.asarray(ids), 2, 2)):
        assert_exact(g, w, name)


def _permute_case(T: int, H: int, topk: int, E: int, dtype, seed: int):
    """An EP rank owning half the experts: some rows are non-local, rows >= M are -1."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((T, H)) * np.exp(rng.uniform(-4, 4, (T, 1)))).astype(np.float32)
    x[0, : H // 3] = 0.0  # a partly zero row
    ids = random_ids(rng, T, topk, E)
    _, _, dst2src = routing_metadata_reference(jnp.asarray(ids), 1, E // 2)
    return jnp.asarray(x, dtype), dst2src


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("quant", QUANTS)
def test_permute_bit_identical(quant, dtype):
    x, dst2src = _permute_case(11, 256, 3, 8, dtype, seed=3)
    scale = jnp.float32(0.037) if quant == "fp8_per_tensor" else None
    got = permute_pallas_triton(x, dst2src, topk=3, quant=quant, group_size=128, scale=scale)
    want = permute_reference(x, dst2src, 3, quant, 128, scale)
    assert_exact(got[0], want[0], f"rows {quant}")
    if quant is None:
        assert got[1] is None
    else:
        assert_exact(got[1], want[1], f"scale {quant}")
    assert int((np.asarray(dst2src) < 0).sum()) > 0  # the case has rows >= M


@pytest.mark.parametrize("quant,group_size,config", [
    ("fp8_per_token", 128, PermuteConfig(block_m=4, block_h=64, two_pass=True)),  # two passes, odd H
    ("fp8_per_token_group", 32, None),
    (None, 128, PermuteConfig(block_m=2, block_h=64)),  # several column blocks, odd H
])
def test_permute_configs(quant, group_size, config):
    H = 160 if quant != "fp8_per_token_group" else 96
    x, dst2src = _permute_case(7, H, 2, 6, jnp.bfloat16, seed=9)
    got = permute_pallas_triton(x, dst2src, topk=2, quant=quant, group_size=group_size, config=config)
    want = permute_reference(x, dst2src, 2, quant, group_size, None)
    for g, w in zip(got, want):
        if w is not None:
            assert_exact(g, w, f"{quant} {config}")


def test_permute_config_heuristic():
    assert permute_config(64, 7168, "fp8_per_token_group", 128).block_h == 128
    assert not permute_config(64, 7168, "fp8_per_token", 128).two_pass
    assert permute_config(64, 14336, "fp8_per_token", 128).two_pass
    with pytest.raises(NotImplementedError, match="power of two"):
        permute_pallas_triton(jnp.zeros((2, 96), jnp.bfloat16), jnp.zeros((4,), jnp.int32), topk=2,
                              quant="fp8_per_token_group", group_size=48)


def test_dispatch_pallas_triton():
    """The public ops with implementation="pallas_triton"; T = 0 early returns; the CPU default stays the reference."""
    ids = random_ids(np.random.default_rng(4), 9, 2, 8)
    meta = moe_pallas.routing_metadata(jnp.asarray(ids), 8, expert_start=2, num_local_experts=4, check_ids=True,
                                       implementation="pallas_triton")
    for name, g, w in zip(NAMES, meta, routing_metadata_reference(jnp.asarray(ids), 2, 4)):
        assert_exact(g, w, name)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((9, 128)), jnp.bfloat16)
    for quant in QUANTS:
        scale = jnp.float32(0.02) if quant == "fp8_per_tensor" else None
        got = moe_pallas.permute(x, meta.dst2src, topk=2, quant=quant, scale=scale, implementation="pallas_triton")
        want = moe_pallas.permute(x, meta.dst2src, topk=2, quant=quant, scale=scale, implementation="reference")
        for g, w in zip(got, want):
            if w is not None:
                assert_exact(g, w, f"dispatch {quant}")
    empty = moe_pallas.routing_metadata(jnp.zeros((0, 2), jnp.int32), 8, implementation="pallas_triton")
    assert [a.shape for a in empty] == [(9,), (0, 2), (0,)]
    q, s = moe_pallas.permute(x[:0], meta.dst2src[:0], topk=2, quant="fp8_per_token", implementation="pallas_triton")
    assert q.shape == (0, 128) and s.shape == (0, 1)


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
