"""Grouped GEMM (CONTRACT.md section 4): the torch op against the jnp op on the shared cases of
``op_cases/grouped_gemm.py`` (ragged, empty and all-on-one experts, M = 1, odd sizes, unused capacity, M_cap = 0,
float dtypes, every FP8 scale layout, block scales per K block), each also against a float64 numpy loop.

Both frameworks' public ops run with ``implementation=None``: the references on the CPU (the device's default
backends under ``EPMOE_TEST_DEVICE=gpu``). Then the jnp reference's row chunks and the references' refusal of
malformed offsets.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moe_pallas
import moe_torch
from common import DEVICE, JNP_DTYPES, TORCH_DTYPES, both, to_jax
from op_cases import TorchArrays
from op_cases.grouped_gemm import GroupedGemmCases
from tolerances import F32_REL_FRO, FP8_REL_FRO, assert_rel_fro, to_numpy


def problem(seed: int, counts: list[int], m_cap: int, K: int, N: int):
    """Random x [m_cap, K], w [E, N, K] ~ 1/sqrt(K), offsets from ``counts`` (sum <= m_cap)."""
    rng = np.random.default_rng(seed)
    E = len(counts)
    x = rng.standard_normal((m_cap, K)).astype(np.float32)
    w = (rng.standard_normal((E, N, K)) / np.sqrt(K)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    assert offsets[-1] <= m_cap
    return x, w, offsets


class TestGroupedGemmReference(TorchArrays, GroupedGemmCases):
    """The shared cases of ``op_cases/grouped_gemm.py``: ``moe_torch.grouped_gemm`` against
    ``moe_pallas.grouped_gemm`` on the same values (the torch tensors as jax arrays), FP8 inputs made by torch's
    quantizers. On the GPU the block-scale case takes FP8_REL_FRO: the default implementations run there on the
    FP8 tensor cores (the bound's reason is in the case's docstring)."""

    OPS = moe_torch
    BLOCKWISE_LIMIT = F32_REL_FRO if DEVICE == "cpu" else FP8_REL_FRO

    def grouped_gemm(self, x, w, offsets, x_scale=None, w_scale=None, out_dtype=None, config=None):
        return moe_torch.grouped_gemm(x, w, offsets, x_scale=x_scale, w_scale=w_scale,
                                      out_dtype=None if out_dtype is None else TORCH_DTYPES[out_dtype])

    def reference_grouped_gemm(self, x, w, offsets, x_scale, w_scale, out_dtype):
        x, w, offsets, x_scale, w_scale = (None if a is None else to_jax(to_numpy(a))
                                           for a in (x, w, offsets, x_scale, w_scale))
        return moe_pallas.grouped_gemm(x, w, offsets, x_scale=x_scale, w_scale=w_scale, out_dtype=JNP_DTYPES[out_dtype])


@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_gemm_jnp_chunked_rows_match_single_chunk(monkeypatch, fp8):
    """The jnp reference gathers weights in chunks of rows at real sizes; force tiny chunks here."""
    from moe_pallas.ops.grouped_gemm import reference as jref

    x, w, offsets = problem(4, [3, 0, 6, 2], 13, 128, 24)
    jx, jw = both(x)[0], both(w)[0]
    kw = {}
    if fp8:
        (jx, xs), (jw, ws) = moe_pallas.per_token_quant_fp8(jx), moe_pallas.quantize_weight_fp8(jw, "block")
        kw = dict(x_scale=xs, w_scale=ws)
    whole = moe_pallas.grouped_gemm(jx, jw, both(offsets)[0], **kw)
    monkeypatch.setattr(jref, "_CHUNK_BYTES", 24 * 128 * 4 * 4)  # 4 rows per chunk, 4 chunks (last padded)
    chunked = moe_pallas.grouped_gemm(jx, jw, both(offsets)[0], **kw)
    assert_rel_fro(chunked, whole, 1e-6, "chunked vs whole")
    assert not to_numpy(chunked).astype(np.float32)[11:].any()


#: Offsets the references refuse (CONTRACT.md section 4: non-decreasing within [0, M_cap]), M_cap = 8, E_local = 3,
#: with the part of the message that names what came.
BAD_OFFSETS = [([0, 5, 3, 8], r"offsets\[2\] = 3 < offsets\[1\] = 5"), ([-2, 1, 4, 8], r"offsets\[0\] = -2 outside"),
               ([0, 2, 4, 9], r"offsets\[3\] = 9 outside \[0, 8\]")]


def _reference_ops(mod, x, w, d_y, bias):
    """``{op name: call(offsets)}`` for the four grouped GEMM ops on their reference implementation."""
    ref = {"implementation": "reference"}
    return {
        "grouped_gemm": lambda off: mod.grouped_gemm(x, w, off, bias=bias, **ref),
        "grouped_gemm_dgrad": lambda off: mod.grouped_gemm_dgrad(d_y, w, off, **ref),
        "grouped_gemm_wgrad": lambda off: mod.grouped_gemm_wgrad(x, d_y, off, **ref),
        "grouped_gemm_dbias": lambda off: mod.grouped_gemm_dbias(d_y, off, **ref),
    }


def _bad_offsets_case():
    rng = np.random.default_rng(3)
    return (rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((3, 5, 4)).astype(np.float32),
            rng.standard_normal((8, 5)).astype(np.float32), rng.standard_normal((3, 5)).astype(np.float32))


def test_reference_bad_offsets_raise_torch():
    """Decreasing, negative or past-M_cap offsets: each reference op raises ValueError naming the op, the argument
    and the offsets (they used to drop or truncate rows silently: zeros where a decreasing expert's rows were)."""
    x, w, d_y, bias = (torch.from_numpy(a).to(DEVICE) for a in _bad_offsets_case())
    for op, call in _reference_ops(moe_torch, x, w, d_y, bias).items():
        call(torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=DEVICE))  # well-formed: served
        for off, came in BAD_OFFSETS:
            with pytest.raises(ValueError, match=rf"^{op}: expert_offsets must be non-decreasing and within "
                                                 rf"\[0, M_cap\] = \[0, 8\].*got \[.*\] \({came}"):
                call(torch.tensor(off, dtype=torch.int32, device=DEVICE))


def test_reference_bad_offsets_raise_jax():
    """As the torch test, for concrete offsets (and through jax.grad of the forward, whose reference sees them
    concrete); under jit the offsets are tracers and the reference cannot check them (documented)."""
    import jax
    import jax.numpy as jnp

    x, w, d_y, bias = (jnp.asarray(a) for a in _bad_offsets_case())
    for op, call in _reference_ops(moe_pallas, x, w, d_y, bias).items():
        call(jnp.asarray([0, 3, 3, 8], jnp.int32))  # well-formed: served
        for off, came in BAD_OFFSETS:
            with pytest.raises(ValueError, match=rf"^{op}: expert_offsets must be non-decreasing and within "
                                                 rf"\[0, M_cap\] = \[0, 8\].*got \[.*\] \({came}"):
                call(jnp.asarray(off, jnp.int32))
    bad = jnp.asarray(BAD_OFFSETS[0][0], jnp.int32)
    loss = lambda x, w: moe_pallas.grouped_gemm(x, w, bad, implementation="reference").sum()  # noqa: E731
    with pytest.raises(ValueError, match="grouped_gemm: expert_offsets must be non-decreasing"):
        jax.grad(loss, argnums=(0, 1))(x, w)
    jax.jit(loss)(x, w)  # tracers: unchecked, no error
