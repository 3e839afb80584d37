"""Mosaic GPU backward GEMMs (``moe_pallas/ops/grouped_gemm/pallas_mosaic_gpu_backward.py``, CONTRACT.md
section 8): the dgrad ``d_x = d_y @ w[e]`` and the K-grouped wgrad ``d_w[e] = d_y[rows(e)].T @ x[rows(e)]``.

Mosaic GPU neither interprets nor lowers on a CPU, so on a CPU only the host-side rules run (refusals,
config rules, the kernel bodies trace). On the GPU (``benchmarks/gpu_check.py``): both kernels against
float64 loops on ragged rows (empty experts, experts not aligned to the row block, all rows on one expert,
M_cap not a multiple of 8), the unused capacity and the rows of other experts poisoned with NaN in BOTH
operands (never read into a result), an empty expert's weight gradient exactly 0, and ``jax.grad``
through ``grouped_gemm(implementation="pallas_mosaic_gpu")`` equal to the Pallas-Triton backward's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import TEST_SPEC

import moe_pallas
from moe_pallas.ops.grouped_gemm.config import MosaicGroupedGemmConfig, heuristic_mosaic_wgrad_config
from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu_backward import (grouped_gemm_dgrad_pallas_mosaic_gpu,
                                                                     grouped_gemm_wgrad_pallas_mosaic_gpu)
from tolerances import BF16_REL_FRO, assert_rel_fro, to_numpy

ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernels run on a Hopper GPU only (no CPU interpret/lowering)")


def _problem(seed: int, counts, m_cap: int, K: int, N: int, dtype=jnp.bfloat16):
    """x [m_cap, K], d_y [m_cap, N] ~ N(0, 1), w [E, N, K] ~ N(0, 1/N); rows >= sum(counts) are NaN in x and d_y."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m_cap, K)).astype(np.float32)
    dy = rng.standard_normal((m_cap, N)).astype(np.float32)
    w = (rng.standard_normal((len(counts), N, K)) / np.sqrt(N)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    x[offsets[-1]:] = np.nan
    dy[offsets[-1]:] = np.nan
    return (jnp.asarray(x, dtype), jnp.asarray(dy, dtype), jnp.asarray(w, dtype), jnp.asarray(offsets))


def _f64_dgrad(dy, w, offsets) -> np.ndarray:
    dy, w, offsets = (to_numpy(a) for a in (dy, w, offsets))
    out = np.zeros((dy.shape[0], w.shape[2]))
    for e in range(w.shape[0]):
        s, t = offsets[e], offsets[e + 1]
        out[s:t] = dy[s:t].astype(np.float64) @ w[e].astype(np.float64)
    return out


def _f64_wgrad(x, dy, offsets) -> np.ndarray:
    x, dy, offsets = (to_numpy(a) for a in (x, dy, offsets))
    E = offsets.shape[0] - 1
    out = np.zeros((E, dy.shape[1], x.shape[1]))
    for e in range(E):
        s, t = offsets[e], offsets[e + 1]
        out[e] = dy[s:t].astype(np.float64).T @ x[s:t].astype(np.float64)
    return out


# --------------------------------------------------------------------------------------
# Host-side rules (CPU and GPU)


@pytest.mark.skipif(ON_GPU, reason="checks the CPU refusal")
@pytest.mark.parametrize("op", ["dgrad", "wgrad"])
def test_refuses_off_the_gpu(op):
    x, dy, w, offsets = _problem(0, [3, 5], 8, 128, 128)
    with pytest.raises(NotImplementedError, match=rf"grouped_gemm_{op}\[pallas_mosaic_gpu\]: needs a Hopper GPU"):
        if op == "dgrad":
            moe_pallas.grouped_gemm_dgrad(dy, w, offsets, implementation="pallas_mosaic_gpu")
        else:
            moe_pallas.grouped_gemm_wgrad(x, dy, offsets, implementation="pallas_mosaic_gpu")


def test_limits_raise_not_implemented():
    x, dy, w, offsets = _problem(0, [3, 5], 8, 128, 128, jnp.float32)
    with pytest.raises(NotImplementedError, match=r"dgrad\[pallas_mosaic_gpu\]: d_y must be bf16 or float16.*float32"):
        grouped_gemm_dgrad_pallas_mosaic_gpu(dy, w, offsets)
    with pytest.raises(NotImplementedError, match=r"wgrad\[pallas_mosaic_gpu\]: x must be bf16 or float16.*float32"):
        grouped_gemm_wgrad_pallas_mosaic_gpu(x, dy, offsets)
    x, dy, w, offsets = _problem(0, [3, 5], 8, 192, 128)  # K=192: no whole 128-wide output tile of d_w
    with pytest.raises(NotImplementedError, match=r"K % block_n == 0.*K=192"):
        grouped_gemm_wgrad_pallas_mosaic_gpu(x, dy, offsets, config=MosaicGroupedGemmConfig(
            block_m=128, block_n=128, block_k=64))
    with pytest.raises(NotImplementedError, match=r"K = x.shape\[1\] .*multiple of 64 values of 2 bytes.*got K=96"):
        grouped_gemm_wgrad_pallas_mosaic_gpu(x[:, :96], dy, offsets)  # no 128-byte tile row divides K=96
    x, dy, w, offsets = _problem(0, [3, 5], 8, 96, 128)
    with pytest.raises(NotImplementedError, match=r"dgrad\[pallas_mosaic_gpu\]: needs N % block_n == 0 .*N=96"):
        grouped_gemm_dgrad_pallas_mosaic_gpu(dy, w[:, :, :96], offsets, config=MosaicGroupedGemmConfig(
            block_m=64, block_n=128, block_k=64))
    with pytest.raises(NotImplementedError, match=r"block_k \(rows per step\) must be a multiple of 64"):
        grouped_gemm_wgrad_pallas_mosaic_gpu(x[:, :64], dy, offsets, config=MosaicGroupedGemmConfig(
            block_m=64, block_n=64, block_k=32))


def test_fp8_dgrad_is_refused_and_the_layer_falls_back():
    """The Mosaic dgrad has no FP8 weights: explicitly asked, NotImplementedError; the layer's backward
    rule sends an FP8 layer's dgrad to the default order instead."""
    from moe_pallas.ops.grouped_gemm import api

    assert api.backward_implementation("pallas_mosaic_gpu", api.DGRAD_IMPLEMENTATIONS) == "pallas_mosaic_gpu"
    assert api.backward_implementation("pallas_mosaic_gpu", api.DGRAD_IMPLEMENTATIONS, fp8_weights=True) is None
    with pytest.raises(NotImplementedError, match=r"FP8 weights are not served"):
        api._mosaic_dgrad(None, None, None, jnp.ones(()), None)


def test_wgrad_heuristic():
    cfg = heuristic_mosaic_wgrad_config(16384, 4096, 7168, 32, 2, 2)
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.max_concurrent_steps, cfg.warp_specialized) == (
        128, 128, 64, 3, True)
    cfg = heuristic_mosaic_wgrad_config(16384, 4096, 7168, 32, 2, 4)  # float32 d_w: 2 stages beside its buffers
    assert (cfg.max_concurrent_steps, cfg.warp_specialized) == (2, True)
    cfg = heuristic_mosaic_wgrad_config(16384, 4096, 7168 - 128, 32, 2, 2)  # K % 256 != 0: one warpgroup
    assert (cfg.block_n, cfg.max_concurrent_steps, cfg.warp_specialized) == (128, 4, False)
    assert heuristic_mosaic_wgrad_config(64, 64, 192, 2, 2).block_n == 64
    # never below one 128-byte row (64 values): K=96 keeps 64, which mosaic_wgrad_config_problem refuses
    assert heuristic_mosaic_wgrad_config(64, 64, 96, 2, 2).block_n == 64


def test_warp_specialized_wgrad_rules_and_lowering():
    """The warp-specialized wgrad's config rules, and its body lowered for CUDA on the CPU (bf16 and float32 d_w)."""
    import dataclasses
    from moe_pallas.ops.grouped_gemm.config import mosaic_wgrad_config_problem

    ws = MosaicGroupedGemmConfig(block_m=128, block_n=128, block_k=64, max_concurrent_steps=3, warp_specialized=True)
    assert mosaic_wgrad_config_problem(ws, 256, 512, 2, 2) is None
    assert "K % (2 * block_n) == 0" in mosaic_wgrad_config_problem(ws, 256, 384, 2, 2)
    assert "split_m is not served" in mosaic_wgrad_config_problem(dataclasses.replace(ws, split_m=True), 256, 512)
    assert "max_concurrent_steps >= 2" in mosaic_wgrad_config_problem(
        dataclasses.replace(ws, max_concurrent_steps=1), 256, 512)
    assert "shared memory with 4-byte outputs" in mosaic_wgrad_config_problem(ws, 256, 512, 2, 4)
    x, dy, _, offsets = _problem(1, [100, 28, 0, 257, 64], 450, 512, 256)
    with pytest.raises(NotImplementedError, match=r"wgrad\[pallas_mosaic_gpu\]: the warp-specialized wgrad needs "
                       r"K % \(2 \* block_n\) == 0.*K=384"):
        grouped_gemm_wgrad_pallas_mosaic_gpu(x[:, :384], dy, offsets, config=ws)
    f = jax.jit(grouped_gemm_wgrad_pallas_mosaic_gpu, static_argnames=("config", "out_dtype"))
    for out_dtype, stages in ((jnp.bfloat16, 3), (jnp.float32, 2)):
        text = f.trace(x, dy, offsets, out_dtype=out_dtype,
                       config=dataclasses.replace(ws, max_concurrent_steps=stages)).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


def test_kernel_bodies_trace():
    """Both kernel bodies trace on the CPU too (Python errors in them show here)."""
    x, dy, w, offsets = _problem(1, [70, 0, 130, 9], 256, 256, 128)
    assert jax.jit(grouped_gemm_dgrad_pallas_mosaic_gpu).trace(dy, w, offsets).jaxpr is not None
    assert jax.jit(grouped_gemm_wgrad_pallas_mosaic_gpu).trace(x, dy, offsets).jaxpr is not None
    assert jax.jit(grouped_gemm_wgrad_pallas_mosaic_gpu, static_argnames=("out_dtype",)).trace(
        x[:250], dy[:250], offsets, out_dtype=jnp.bfloat16).jaxpr is not None


# --------------------------------------------------------------------------------------
# Swizzled tile rows (host side): a config Mosaic GPU cannot trace is refused before launch, so the default
# order falls back (NotImplementedError) instead of failing (ValueError) inside the trace

C = MosaicGroupedGemmConfig


def _run(op: str, N: int, K: int, cfg, lower: bool = False):
    """The Mosaic kernel ``op`` ("fwd", "dgrad", "wgrad") on bf16 ``w [2, N, K]`` and its ``x`` / ``d_y`` (``cfg``:
    a config, or ``None`` for the default); with ``lower``, only lowered for CUDA (on the CPU)."""
    x, dy, w, offsets = _problem(0, [100, 156], 256, K, N)
    fn, args = {"fwd": (moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu.grouped_gemm_pallas_mosaic_gpu, (x, w, offsets)),
                "dgrad": (grouped_gemm_dgrad_pallas_mosaic_gpu, (dy, w, offsets)),
                "wgrad": (grouped_gemm_wgrad_pallas_mosaic_gpu, (x, dy, offsets))}[op]
    if lower:
        return fn.trace(*args, config=cfg).lower(lowering_platforms=("cuda",)).as_text()
    return fn(*args, config=cfg)


# op, N, K (w [E, N, K]), config, the refusal. Without the rule each of these fails inside the trace (ValueError:
# "Swizzle 16 is not supported", "No valid tiling found", "Failed to infer a possible set of layouts", a
# consumer's slice not a whole tile); the last is the heuristic config of the reported K=7000, N=1536 wgrad.
REFUSED = {
    "fwd-16-byte-rows": ("fwd", 256, 256, C(block_m=64, block_n=64, block_k=8), r"block_k=8 \(16 bytes\)"),
    "fwd-ws-48-byte-rows": ("fwd", 256, 96, C(block_m=64, block_n=64, block_k=24, warp_specialized=True,
                                              max_concurrent_steps=2), r"multiple of 32 bytes.*block_k=24 \(48 bytes\)"),
    "dgrad-16-byte-w-rows": ("dgrad", 256, 256, C(block_m=64, block_n=8, block_k=64), r"block_n=8 \(16 bytes\)"),
    "dgrad-ws-consumer-slice": ("dgrad", 256, 256, C(block_m=64, block_n=32, block_k=64, warp_specialized=True,
                                                     max_concurrent_steps=2),
                                r"multiple of 128 bytes.*block_n=32 \(64 bytes\)"),
    "wgrad-32-byte-masked-rows": ("wgrad", 256, 256, C(block_m=64, block_n=16, block_k=64),
                                  r"multiple of 128 bytes.*block_n=16 \(32 bytes\)"),
    "wgrad-K7000-default": ("wgrad", 1536, 7000, None, r"K = x.shape\[1\] .*multiple of 64 values.*got K=7000"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_swizzle_rule_refuses_before_tracing(case):
    op, N, K, cfg, message = REFUSED[case]
    op_name = {"fwd": "grouped_gemm", "dgrad": "grouped_gemm_dgrad", "wgrad": "grouped_gemm_wgrad"}[op]
    with pytest.raises(NotImplementedError, match=rf"^{op_name}\[pallas_mosaic_gpu\]: .*{message}"):
        _run(op, N, K, cfg)


def test_wgrad_heuristic_for_k7000_is_refused_by_its_rule():
    """K=7000 = 8 x 875: no tile width dividing it spans a multiple of 128 bytes of bf16. The heuristic stops
    halving at 64 values (it went down to 8, a 16-byte swizzle) and the rule names K."""
    from moe_pallas.ops.grouped_gemm.config import mosaic_wgrad_config, mosaic_wgrad_config_problem

    for out_itemsize in (2, 4):
        cfg = mosaic_wgrad_config(6000, 1536, 7000, 8, 2, out_itemsize)
        assert cfg.block_n == 64
        assert "K = x.shape[1]" in mosaic_wgrad_config_problem(cfg, 1536, 7000, 2, out_itemsize)
    assert mosaic_wgrad_config_problem(mosaic_wgrad_config(6000, 1536, 7040, 8, 2), 1536, 7040, 2) is None


# The narrowest rows each kernel keeps, at the edge of the rule: they lower for CUDA.
ACCEPTED = {
    "fwd-32-byte-rows": ("fwd", 256, 64, C(block_m=64, block_n=64, block_k=16)),
    "dgrad-32-byte-w-rows": ("dgrad", 256, 64, C(block_m=64, block_n=16, block_k=64)),
    "dgrad-ws-128-byte-rows": ("dgrad", 256, 256, C(block_m=64, block_n=64, block_k=64, warp_specialized=True,
                                                    max_concurrent_steps=2)),
    "wgrad-128-byte-rows": ("wgrad", 256, 192, C(block_m=64, block_n=64, block_k=64)),
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_swizzle_rule_keeps_configs_that_lower(case):
    op, N, K, cfg = ACCEPTED[case]
    assert "mosaic_gpu" in _run(op, N, K, cfg, lower=True)


def _simulated_gpu(monkeypatch):
    """The GPU dispatch on the CPU: the default order is the GPU's (no table: the heuristic, Mosaic GPU first), the
    Mosaic kernels run their host-side checks as on a GPU (a request they serve would fail at launch: Mosaic GPU has
    no CPU path), and the Pallas-Triton kernels are spies returning zeros. Returns the list of ``op:backend`` runs."""
    from moe_pallas.ops.grouped_gemm import api, backend_table, pallas_mosaic_gpu_backward
    from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu import grouped_gemm_pallas_mosaic_gpu

    monkeypatch.setattr(backend_table, "on_gpu", lambda: True)
    monkeypatch.setattr(backend_table, "gpu_device_spec", lambda: TEST_SPEC)  # a Hopper: Mosaic GPU is tried
    monkeypatch.setattr(api, "_mosaic", lambda x, w, off, xs, ws, out_dtype, bias=None: grouped_gemm_pallas_mosaic_gpu(
        x, w, off, x_scale=xs, w_scale=ws, out_dtype=out_dtype))
    monkeypatch.setattr(api, "_mosaic_backward", lambda name: getattr(pallas_mosaic_gpu_backward, name))
    runs = []

    def spy(op, shape_of):
        def run(*args, **kwargs):
            runs.append(f"{op}:pallas_triton")
            shape, dtype = shape_of(*args, **kwargs)
            return jnp.zeros(shape, dtype)
        return run

    monkeypatch.setattr(api, "grouped_gemm_pallas_triton", spy(
        "grouped_gemm", lambda x, w, off, out_dtype=None, **_: ((x.shape[0], w.shape[1]), out_dtype)))
    monkeypatch.setattr(api, "grouped_gemm_dgrad_pallas_triton", spy(
        "grouped_gemm_dgrad", lambda dy, w, off, out_dtype=None, **_: ((dy.shape[0], w.shape[2]), out_dtype)))
    monkeypatch.setattr(api, "grouped_gemm_wgrad_pallas_triton", spy(
        "grouped_gemm_wgrad", lambda x, dy, off, out_dtype=None, **_: (
            (off.shape[0] - 1, dy.shape[1], x.shape[1]), out_dtype)))
    return runs


def test_default_falls_back_for_k7000_under_vjp(monkeypatch, caplog):
    """The reported case's shape (bf16, K=7000, N=1536) under ``jax.vjp`` with ``implementation=None`` on a
    simulated GPU: Mosaic GPU refuses each op before launch (the forward and dgrad by whole tiles, the wgrad by
    its swizzle rule, which it used to fail inside the trace), each refusal logged, and Pallas-Triton serves all
    three."""
    import logging

    runs = _simulated_gpu(monkeypatch)
    x, dy, w, offsets = _problem(0, [0, 9, 7], 20, 7000, 1536)
    with caplog.at_level(logging.WARNING, logger="moe_pallas"):
        y, vjp = jax.vjp(lambda x_, w_: moe_pallas.grouped_gemm(x_, w_, offsets), x, w)
        vjp(dy)
    assert runs == ["grouped_gemm:pallas_triton", "grouped_gemm_dgrad:pallas_triton",
                    "grouped_gemm_wgrad:pallas_triton"]
    refusals = [r.getMessage() for r in caplog.records if "cannot serve" in r.getMessage()]
    assert len(refusals) == 3, refusals
    assert refusals[0].startswith("grouped_gemm: backend 'pallas_mosaic_gpu' cannot serve") and "K=7000" in refusals[0]
    assert refusals[1].startswith("grouped_gemm_dgrad: backend 'pallas_mosaic_gpu' cannot serve")
    assert refusals[2].startswith("grouped_gemm_wgrad: backend 'pallas_mosaic_gpu' cannot serve")
    assert "K = x.shape[1] (d_w's last dim) must be a multiple of 64" in refusals[2]
    assert all(r.endswith("trying 'pallas_triton'") for r in refusals)


# --------------------------------------------------------------------------------------
# Whole operand buffers: a Mosaic GPU kernel refuses an operand that does not start 256-byte aligned ("Input
# buffer i is not 256-byte aligned"), and XLA may pass a contiguous slice to a custom call as a view into the
# sliced buffer (its dynamic-slice fusion). So no operand of a Mosaic custom call may come from a slice.


def _mosaic_operand_producers(text: str) -> list[str]:
    """For every operand of every Mosaic GPU custom call in the StableHLO module ``text``, the op that produces it,
    looked through reshapes (bitcasts to XLA), calls (into the callee's return) and function arguments (to every call
    site; an argument of ``main``, the caller's own buffer, is ``"argument"``)."""
    import re

    funcs, name = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*func\.func (?:public|private) @([\w.$-]+)\(", line)
        if m:
            name = m.group(1)
            funcs[name] = []
        elif name is not None:
            funcs[name].append(line)
    defs = {f: {} for f in funcs}
    for f, lines in funcs.items():
        for line in lines:
            m = re.match(r"\s*(%[\w.-]+)(?::\d+)? = (.*)", line)
            if m:
                defs[f][m.group(1)] = m.group(2)

    def callers(f: str):
        for g, lines in funcs.items():
            for line in lines:
                m = re.search(rf"call @{re.escape(f)}\(([^)]*)\)", line)
                if m:
                    yield g, [a.strip() for a in m.group(1).split(",")]

    def producers(f: str, v: str, depth: int = 0) -> list[str]:
        assert depth < 50, (f, v)
        base, _, index = v.partition("#")
        m = re.fullmatch(r"%arg(\d+)", base)
        if m:
            if f == "main":
                return ["argument"]
            return [p for g, args in callers(f) for p in producers(g, args[int(m.group(1))], depth + 1)]
        rhs = defs[f][base]
        call = re.match(r"call @([\w.$-]+)\(", rhs)
        if call:
            g = call.group(1)
            ret = next(l for l in funcs[g] if l.strip().startswith("return"))
            values = re.match(r"\s*return ([^:]*)", ret).group(1).split(",")
            return producers(g, values[int(index or 0)].strip(), depth + 1)
        op = re.match(r'"?(stablehlo\.\w+|\w+)', rhs).group(1)
        if op == "stablehlo.reshape":
            return producers(f, re.match(r"stablehlo\.reshape (%[\w.#-]+)", rhs).group(1), depth + 1)
        return [op]

    out = []
    for f, lines in funcs.items():
        for line in lines:
            m = re.search(r"stablehlo\.custom_call @mosaic_gpu\w*\(([^)]*)\)", line)
            if m:
                out += [(p, a.strip()) for a in m.group(1).split(",") for p in producers(f, a.strip())]
    return [p for p, _ in out]


def test_wgrad_operands_are_whole_buffers():
    """The wgrad's expert row ranges (``ends = offsets[1:]``, a slice at byte 4) reach the kernel inside one stacked
    ``[2, E]`` buffer: no operand of its custom call comes from a slice."""
    x, dy, _, offsets = _problem(0, [100, 0, 156], 256, 256, 128)
    producers = _mosaic_operand_producers(grouped_gemm_wgrad_pallas_mosaic_gpu.trace(x, dy, offsets).lower(
        lowering_platforms=("cuda",)).as_text())
    assert not [p for p in producers if "slice" in p], producers
    assert len(producers) == 3  # bounds, x, d_y


def test_layer_vjp_mosaic_operands_are_whole_buffers(monkeypatch):
    """The bf16 layer under ``jax.jit(jax.vjp(...))`` with ``implementation=None`` on a simulated GPU (Mosaic GPU
    first for every grouped GEMM), E=64 with empty experts as reported: its six Mosaic custom calls (two forward
    GEMMs, two dgrads, two wgrads), lowered for CUDA on the CPU, take no operand produced by a slice."""
    from moe_contract import MoEConfig, make_layer_inputs
    from moe_pallas.ops.grouped_gemm import api, backend_table, pallas_mosaic_gpu_backward
    from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu import grouped_gemm_pallas_mosaic_gpu

    monkeypatch.setattr(backend_table, "on_gpu", lambda: True)
    monkeypatch.setattr(backend_table, "gpu_device_spec", lambda: TEST_SPEC)  # a Hopper: Mosaic GPU is tried
    monkeypatch.setattr(api, "_mosaic", lambda x, w, off, xs, ws, out_dtype, bias=None: grouped_gemm_pallas_mosaic_gpu(
        x, w, off, x_scale=xs, w_scale=ws, out_dtype=out_dtype))
    monkeypatch.setattr(api, "_mosaic_backward", lambda name: getattr(pallas_mosaic_gpu_backward, name))
    config = MoEConfig(hidden_size=256, intermediate_size=128, num_experts=64, topk=8, routing="softmax_topk",
                       renormalize=True)
    inp = make_layer_inputs(config, num_tokens=64, seed=0)
    logits = np.asarray(inp.router_logits).copy()
    logits[:, 36:] = -1e4  # 28 experts get no rows
    args = (jnp.asarray(inp.x, jnp.bfloat16), jnp.asarray(logits), jnp.asarray(inp.w13, jnp.bfloat16),
            jnp.asarray(inp.w2, jnp.bfloat16))

    def layer_vjp(x, l, w13, w2, d_out):
        out, vjp = jax.vjp(lambda *a: moe_pallas.moe_forward(*a, config), x, l, w13, w2)
        return out, vjp(d_out)

    text = jax.jit(layer_vjp).trace(*args, args[0]).lower(lowering_platforms=("cuda",)).as_text()
    producers = _mosaic_operand_producers(text)
    assert text.count("custom_call @mosaic_gpu") == 6
    assert producers and not [p for p in producers if "slice" in p], producers


# --------------------------------------------------------------------------------------
# Numerics (GPU)

SHAPES = {  # counts, M_cap, K, N
    "one-row": ([1], 1, 128, 128),
    "decode-empties": ([0, 3, 0, 1, 5, 0, 0, 2], 40, 256, 384),
    "straddling": ([100, 28, 0, 257, 64], 600, 512, 256),  # experts not aligned to 64-row blocks, a tail
    "all-on-one": ([0, 0, 203, 0], 203, 128, 256),  # every row on one expert; M_cap not a multiple of 8
    "big-k": ([300, 211], 640, 2048, 512),
    # 40 ragged experts (some empty), 8 wgrad tiles each: more work items than SMs, so each CTA runs several and the
    # warp-specialized producer loads the next item's rows while the consumers store the current one
    "many-items": ([int(c) for c in np.random.default_rng(11).integers(0, 150, 40) * (np.arange(40) % 7 != 3)],
                   3000, 1024, 512),
}


@gpu_only
@pytest.mark.parametrize("shape", list(SHAPES))
def test_dgrad_vs_float64(shape):
    counts, m_cap, K, N = SHAPES[shape]
    _, dy, w, offsets = _problem(2, counts, m_cap, K, N)
    dx = grouped_gemm_dgrad_pallas_mosaic_gpu(dy, w, offsets)
    assert dx.shape == (m_cap, K) and dx.dtype == jnp.bfloat16
    got = to_numpy(dx).astype(np.float32)
    M = int(offsets[-1])
    assert np.isfinite(got).all() and not got[M:].any(), f"{shape}: NaN leaked or rows >= M not zero"
    assert_rel_fro(dx, _f64_dgrad(dy, w, offsets), BF16_REL_FRO, f"{shape} dgrad vs float64")
    dx32 = grouped_gemm_dgrad_pallas_mosaic_gpu(dy, w, offsets, out_dtype=jnp.float32)
    assert_rel_fro(dx32, _f64_dgrad(dy, w, offsets), 1e-5, f"{shape} dgrad float32 output")


def _wgrad_config(schedule: str, K: int, out_dtype) -> MosaicGroupedGemmConfig | None:
    """``"default"``: the heuristic's; ``"one_wg"``: the one-warpgroup kernel; ``"ws"``: the warp-specialized one
    (two consumers' 128 x bn tiles side by side, bn = 64 where K is not a multiple of 256)."""
    if schedule == "default":
        return None
    if schedule == "one_wg":
        return MosaicGroupedGemmConfig(block_m=128, block_n=128 if K % 128 == 0 else 64, block_k=64,
                                       max_concurrent_steps=3)
    return MosaicGroupedGemmConfig(block_m=128, block_n=128 if K % 256 == 0 else 64, block_k=64,
                                   max_concurrent_steps=2 if jnp.dtype(out_dtype).itemsize == 4 else 3,
                                   warp_specialized=True)


@gpu_only
@pytest.mark.parametrize("schedule", ["default", "one_wg", "ws"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_wgrad_vs_float64(shape, out_dtype, schedule):
    counts, m_cap, K, N = SHAPES[shape]
    x, dy, _, offsets = _problem(3, counts, m_cap, K, N)
    dw = grouped_gemm_wgrad_pallas_mosaic_gpu(x, dy, offsets, out_dtype=out_dtype,
                                              config=_wgrad_config(schedule, K, out_dtype))
    assert dw.shape == (len(counts), N, K) and dw.dtype == out_dtype
    got = to_numpy(dw).astype(np.float32)
    assert np.isfinite(got).all(), f"{shape}: a NaN of the unused capacity reached d_w"
    for e, c in enumerate(counts):
        if c == 0:
            assert not got[e].any(), f"{shape}: expert {e} has no rows; its d_w must be exactly 0"
    tol = 1e-5 if out_dtype == jnp.float32 else BF16_REL_FRO
    assert_rel_fro(dw, _f64_wgrad(x, dy, offsets), tol, f"{shape} wgrad vs float64")


@gpu_only
@pytest.mark.parametrize("schedule", ["one_wg", "ws"])
def test_wgrad_neighbours_nan(schedule):
    """Rows of the neighbouring experts inside the first / last 64-row block are NaN: masked by select,
    expert 1's gradient stays finite and exact (a multiply-by-mask would give NaN)."""
    counts, K, N = [37, 50, 41], 256, 128
    x, dy, _, offsets = _problem(4, counts, 128, K, N)
    xs, dys = np.array(to_numpy(x), np.float32), np.array(to_numpy(dy), np.float32)
    xs[:37], dys[:37], xs[87:], dys[87:] = np.nan, np.nan, np.nan, np.nan
    x, dy = jnp.asarray(xs, jnp.bfloat16), jnp.asarray(dys, jnp.bfloat16)
    dw = np.asarray(grouped_gemm_wgrad_pallas_mosaic_gpu(x, dy, offsets, config=_wgrad_config(schedule, K, jnp.float32)))
    ref = dys[37:87].astype(np.float64).T @ xs[37:87].astype(np.float64)
    assert np.isfinite(dw[1]).all()
    assert_rel_fro(dw[1], ref, 1e-5, "expert 1 between NaN neighbours")


@gpu_only
def test_grad_through_grouped_gemm_matches_pallas_triton():
    counts, m_cap, K, N = [100, 0, 37, 211], 400, 256, 384
    x, _, w, offsets = _problem(5, counts, m_cap, K, N)
    x = jnp.where(jnp.isnan(x), 0, x)
    ct = jax.random.normal(jax.random.key(0), (m_cap, N), jnp.float32)

    def loss(x, w, impl):
        y = moe_pallas.grouped_gemm(x, w, offsets, implementation=impl)
        return jnp.sum(y.astype(jnp.float32) * ct)

    got = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, "pallas_mosaic_gpu")
    want = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, "pallas_triton")
    for g, r, name in zip(got, want, ("d_x", "d_w")):
        assert g.dtype == jnp.bfloat16
        assert_rel_fro(g, r, BF16_REL_FRO, f"{name}: Mosaic vs Pallas-Triton backward")


@gpu_only
@pytest.mark.parametrize("quant", ["none", "fp8_per_token"])
def test_layer_gradients_mosaic_vs_pallas_triton(quant):
    """A bf16 layer with implementation="pallas_mosaic_gpu" (Mosaic dgrad and wgrad; an FP8 layer's
    straight-through dgrad falls back to Pallas-Triton) against the Pallas-Triton layer's gradients."""
    from moe_contract import MoEConfig
    from tolerances import GRAD_BF16_REL_FRO

    config = MoEConfig(hidden_size=256, intermediate_size=128, num_experts=8, topk=2, quant=quant)
    T = 96
    keys = jax.random.split(jax.random.key(7), 5)
    x = jax.random.normal(keys[0], (T, 256), jnp.float32).astype(jnp.bfloat16)
    logits = jax.random.normal(keys[1], (T, 8), jnp.float32)
    w13 = (jax.random.normal(keys[2], (8, 256, 256), jnp.float32) / 16).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[3], (8, 256, 128), jnp.float32) / 11).astype(jnp.bfloat16)
    ct = jax.random.normal(keys[4], (T, 256), jnp.float32)
    if quant != "none":
        w13q, s13 = moe_pallas.quantize_weight_fp8(w13, "per_channel")
        w2q, s2 = moe_pallas.quantize_weight_fp8(w2, "per_channel")

    def loss(x, logits, w13, w2, impl):
        kw = {} if quant == "none" else dict(w13_scale=s13, w2_scale=s2)
        a, b = (w13, w2) if quant == "none" else (w13q, w2q)
        out = moe_pallas.moe_forward(x, logits, a, b, config, implementation=impl, **kw)
        return jnp.sum(out.astype(jnp.float32) * ct)

    argnums = (0, 1, 2, 3) if quant == "none" else (0, 1)
    grad = jax.jit(jax.grad(loss, argnums=argnums), static_argnums=4)
    got, want = grad(x, logits, w13, w2, "pallas_mosaic_gpu"), grad(x, logits, w13, w2, "pallas_triton")
    for g, r, name in zip(got, want, ("d_x", "d_router_logits", "d_w13", "d_w2")):
        assert_rel_fro(g, r, GRAD_BF16_REL_FRO, f"{quant} {name}: Mosaic vs Pallas-Triton layer")


# --------------------------------------------------------------------------------------
# The warp-specialized 16-bit schedule (pallas_mosaic_gpu_ws.py): forward and dgrad

WS = MosaicGroupedGemmConfig(block_m=128, block_n=64, block_k=64, max_concurrent_steps=4, warp_specialized=True)


def test_warp_specialized_rules_and_trace():
    from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu import grouped_gemm_pallas_mosaic_gpu

    x, dy, w, offsets = _problem(1, [100, 28, 0, 257, 64], 600, 512, 256)
    assert jax.jit(grouped_gemm_pallas_mosaic_gpu, static_argnames=("config",)).trace(x, w, offsets, config=WS).jaxpr
    assert jax.jit(grouped_gemm_dgrad_pallas_mosaic_gpu, static_argnames=("config",)).trace(dy, w, offsets, config=WS).jaxpr
    import dataclasses
    split = dataclasses.replace(WS, split_m=True)  # consumers splitting rows: 256 x 64 CTA tiles, lowered for CUDA
    for f, a in ((grouped_gemm_pallas_mosaic_gpu, x), (grouped_gemm_dgrad_pallas_mosaic_gpu, dy)):
        text = jax.jit(f, static_argnames=("config",)).trace(a, w, offsets, config=split).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
    with pytest.raises(NotImplementedError, match=r"N % \(2 \* block_n\) == 0"):
        grouped_gemm_pallas_mosaic_gpu(x, w[:, :192], offsets, config=WS)  # N=192: not whole 128-wide CTA tiles
    with pytest.raises(ValueError, match="warp_specialized must be a bool"):
        MosaicGroupedGemmConfig(block_m=64, block_n=64, block_k=64, warp_specialized=1)


@gpu_only
@pytest.mark.parametrize("split_m", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_warp_specialized_forward_and_dgrad_vs_float64(shape, split_m):
    """The 16-bit warp-specialized forward and dgrad, consumers splitting the CTA tile's columns (128 x 128) or rows
    (``split_m``: 256 x 64), against float64 loops; NaN never leaks, rows >= M are zero."""
    import dataclasses
    from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu import grouped_gemm_pallas_mosaic_gpu

    WS_ = dataclasses.replace(WS, split_m=split_m)
    counts, m_cap, K, N = SHAPES[shape]
    x, dy, w, offsets = _problem(6, counts, m_cap, K, N)
    M = int(offsets[-1])
    y = grouped_gemm_pallas_mosaic_gpu(x, w, offsets, config=WS_)
    got = to_numpy(y).astype(np.float32)
    assert np.isfinite(got).all() and not got[M:].any(), f"{shape}: NaN leaked or rows >= M not zero"
    ref = np.zeros((m_cap, N))
    xs, ws_, o = to_numpy(x).astype(np.float64), to_numpy(w).astype(np.float64), to_numpy(offsets)
    for e in range(len(counts)):
        ref[o[e]:o[e + 1]] = xs[o[e]:o[e + 1]] @ ws_[e].T
    assert_rel_fro(y, ref, BF16_REL_FRO, f"{shape} warp-specialized forward vs float64")
    dx = grouped_gemm_dgrad_pallas_mosaic_gpu(dy, w, offsets, config=WS_)
    got = to_numpy(dx).astype(np.float32)
    assert np.isfinite(got).all() and not got[M:].any(), f"{shape}: dgrad NaN leaked or rows >= M not zero"
    assert_rel_fro(dx, _f64_dgrad(dy, w, offsets), BF16_REL_FRO, f"{shape} warp-specialized dgrad vs float64")
