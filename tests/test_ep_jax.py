"""Multi-device EP (``moe_pallas.ep``): both dispatch modes equal the single-device layer.

The multi-device cases need 4 host CPU devices, i.e. ``XLA_FLAGS=--xla_force_host_platform_device_count=4``
before jax's backend starts; other tests of the same pytest process have already started it with
one device. So this file is also a script: the test runs it once as a child process
(``python tests/test_ep_jax.py --child``), which computes every case and prints one JSON list;
the parametrized tests then check each case's numbers. Argument checks and the ``ep_size=1``
path run in-process.

The child also runs the backward (CONTRACT.md section 8, "EP"; :func:`_backward_cases`): ``jax.vjp``
of the jitted EP layer against that of the single-device layer, in both modes: each device's slice of
the weight gradients equals the single-device gradient's (experts without rows: exactly 0), ``d_x`` and
``d_router_logits`` the single-device ones (the sums over devices).

And the router losses (``return_router_losses``, CONTRACT.md section 10; :func:`_child_router_losses`): in both
modes, with ``T`` padded to a multiple of the devices, the losses, ``tokens_per_expert`` and their gradient in
``router_logits`` are the single-device ones.

The checks every framework's EP layer passes (the output, the gradients, the router losses, the backward's edges
exercised) are the shared ones of ``op_cases/ep.py`` (``TestEpJax``: one record per case and run, the mesh's);
the JAX-only ones (shapes, devices, the float32 layer's distance, the ragged path's lowering, ``ep_size=1``, the
argument checks) beside them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from op_cases.ep import EPCases

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Devices of the EP mesh. CPU (default): 4 forced host devices. On a GPU machine:
#: ``EPMOE_TEST_DEVICE=gpu EPMOE_EP=2 pytest tests/test_ep_jax.py`` (the real ragged_all_to_all).
EP = int(os.environ.get("EPMOE_EP", "4"))


def _gpu_count() -> int:
    """CUDA GPUs on this machine (torch asks the driver; JAX is not imported in the parent process)."""
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch or no driver: no GPU
        return 0


#: The EP child runs on GPUs only in GPU mode with at least EP of them; otherwise (CI, or GPU mode on a
#: one-GPU machine) on EP forced host CPU devices, so the cases still run instead of failing for devices.
ON_GPU = os.environ.get("EPMOE_TEST_DEVICE", "cpu") == "gpu" and _gpu_count() >= EP
MODES = (("replicated", "replicated"), ("replicated", "tokens"), ("all_to_all", "replicated"), ("all_to_all", "tokens"))
TWO_MODES = (("replicated", "replicated"), ("all_to_all", "tokens"))
T1_MODES = (("replicated", "tokens"), ("all_to_all", "replicated"), ("all_to_all", "tokens"))


def _exchanges(mode: str) -> tuple[str, ...]:
    """The ``exchange`` arguments each case runs with: on a GPU both of all_to_all mode's row exchanges
    (``ragged``: XLA's native op, or decomposed when XLA_FLAGS asks; ``dense``), else the default."""
    return ("ragged", "dense") if ON_GPU and mode == "all_to_all" else ("default",)


def _cases():
    """(name, preset overrides, T, routing, modes, ep, dtype, weights form). Each line's edge in its name."""
    tiny = ("tiny", {})
    mixtral = ("mixtral-8x7b", {"hidden_size": 64, "intermediate_size": 32})  # E=8, topk=2, no shared expert
    dsv3 = ("deepseek-v3", {"hidden_size": 512, "intermediate_size": 256})
    return [
        # T=7, ep=4: T not divisible by ep (padded to 8, one masked row); S=1: the last rank has 5 experts.
        ("tiny_T7", tiny, 7, "uniform", MODES, EP, "float32", "sharded"),
        # T=1: three of four devices hold only a padding row in all_to_all mode (both out_shardings), and
        # only padding rows of the output under out_sharding="tokens" (both modes); replicated-replicated
        # pads nothing at T=1 (tiny_T7 runs that mode pair).
        ("tiny_T1", tiny, 1, "uniform", T1_MODES, EP, "float32", "sharded"),
        # Uneven load: only rank 0's routed experts (+ the shared one on rank 3); ranks 1, 2 get no row.
        # The edge is in the experts and the row exchange, not in out_sharding (whose two collectives
        # tiny_T7 runs in both modes): one case per mode.
        ("tiny_T16_rank0_only", tiny, 16, "rank0", TWO_MODES, EP, "float32", "sharded"),
        # No shared experts: even shards, no padding experts (mode-independent: one case per mode): at ep=4
        # with every row on rank 0 here, with uniform routing and T padded on the ep=2 sub-mesh below. (The
        # former noshared_T7, uniform at ep=4, ran no path that these two, tiny_T7's padding of T=7 at ep=4
        # and the backward's three noshared_T7 mode pairs, the same layer, do not.)
        ("noshared_T8_rank0_only", mixtral, 8, "rank0", TWO_MODES, EP, "float32", "sharded"),
        # ep=2 on a 2-device sub-mesh, T odd.
        ("noshared_ep2_T5", mixtral, 5, "uniform", TWO_MODES, 2, "float32", "sharded"),
        # The global [E + S, ...] weights, padded inside the call, before the mode's body (the same padding
        # for both modes): replicated mode here, all_to_all mode in the backward's tiny_T7_global_weights.
        ("tiny_T7_global_weights", tiny, 7, "uniform", (("replicated", "replicated"),), EP, "float32", "global"),
        # FP8 per-token activations, per-channel weight scales (sharded with the weights).
        ("tiny_T7_fp8_per_token", (tiny[0], {"quant": "fp8_per_token"}), 7, "uniform", TWO_MODES, EP, "float32", "sharded"),
        # bf16: partials are summed in float32 and rounded once.
        ("tiny_T7_bf16", tiny, 7, "uniform", TWO_MODES, EP, "bfloat16", "sharded"),
        # The Pallas kernels (Triton lowering, interpreted on the CPU) inside shard_map.
        ("tiny_T7_pallas_triton", tiny, 7, "uniform", TWO_MODES, EP, "float32", "sharded"),
    ] + ([
        # GPU only: DeepSeek-V3 routing (E=256 + 1 shared, topk 8, grouped top-k, rsf 2.5) at H=512, I=256, bf16,
        # and FP8 128x128 blocks, with the default GPU kernels (Mosaic / Pallas-Triton) between the collectives.
        ("dsv3_T64_bf16", dsv3, 64, "uniform", TWO_MODES, EP, "bfloat16", "sharded"),
        ("dsv3_T64_fp8_block", (dsv3[0], {**dsv3[1], "quant": "fp8_block"}), 64, "uniform", TWO_MODES, EP, "bfloat16", "sharded"),
        ("dsv3_T64_rank0_only_gpu_kernels", dsv3, 64, "rank0", TWO_MODES, EP, "bfloat16", "sharded"),
    ] if ON_GPU else [])


def _backward_cases():
    """(name, (preset, overrides), T, mode, out_sharding, dtype, weights form, recompute): each line's edge
    in its comment. Mostly Mixtral routing at H=64: its programs compile in about a third of the time
    of DeepSeek-V3's grouped top-k (the child's time is mostly XLA compiling)."""
    tiny = ("tiny", {})
    mixtral = ("mixtral-8x7b", {"hidden_size": 64, "intermediate_size": 32})  # E=8 (E_local 2), topk=2, no shared
    fp8 = ("mixtral-8x7b", {"hidden_size": 64, "intermediate_size": 32, "quant": "fp8_per_token"})
    dsv3 = ("deepseek-v3", {"hidden_size": 512, "intermediate_size": 256})
    return [
        # DeepSeek-V3 routing, rsf in the combine, the shared expert on the last rank (E_local 4, 4, 4, 5: padded
        # slabs), T=7 padded to 8; the global [E + S] weights: the gradient flows back through the padding too.
        ("tiny_T7_global_weights", tiny, 7, "all_to_all", "tokens", "float32", "global", False),
        ("noshared_T7", mixtral, 7, "replicated", "replicated", "float32", "sharded", False),
        ("noshared_T7", mixtral, 7, "replicated", "tokens", "float32", "sharded", False),
        ("noshared_T7", mixtral, 7, "all_to_all", "replicated", "float32", "sharded", False),
        # T=1: three devices hold only a padding row; at most two get rows (the others' weight gradients
        # exactly 0); recompute=True.
        ("noshared_T1_recompute", mixtral, 1, "all_to_all", "tokens", "float32", "sharded", True),
        ("noshared_T7_bf16", mixtral, 7, "replicated", "replicated", "bfloat16", "sharded", False),
        ("noshared_T7_bf16", mixtral, 7, "all_to_all", "tokens", "bfloat16", "sharded", False),
        # FP8 weights and activations: straight-through; the codes get zero cotangents. all_to_all mode only:
        # there the owner quantizes the received rows (and the receive buffer's empty ones); the straight-through
        # backward (routed_experts' custom_vjp) and the sharded weights' cotangents are the same code in both
        # modes, and replicated mode's collectives run in the float32 and bf16 cases above.
        ("noshared_T7_fp8_per_token", fp8, 7, "all_to_all", "tokens", "float32", "sharded", False),
    ] + ([
        # GPU only: DeepSeek-V3 at H=512, I=256, bf16, the default GPU kernels (forward and backward).
        ("dsv3_T64_bf16", dsv3, 64, "replicated", "replicated", "bfloat16", "sharded", False),
        ("dsv3_T64_bf16", dsv3, 64, "all_to_all", "tokens", "bfloat16", "sharded", False),
    ] if ON_GPU else [])


def _child_backward() -> list[dict]:
    """The backward cases (in the child): per case, each gradient's rel. Frobenius error against the
    single-device layer's, and whether the experts without rows got exactly-0 weight gradients.

    As in :func:`_child`, few programs: the single-device references are one, the EP gradients one per
    optimization level (each case's ``jax.vjp`` traced side by side in one ``jit``; nothing flows between
    them, so each gradient is what its own ``jit`` computes)."""
    import jax
    import jax.numpy as jnp

    import moe_pallas
    from moe_contract import get_preset, make_layer_inputs
    from moe_pallas.ep import ep_moe_forward, make_ep_mesh, pad_expert_weights, shard_expert_weights

    def rel(a, b):  # numpy float64 arrays
        den, num = np.linalg.norm(b), np.linalg.norm(a - b)
        return float(num / den) if den else (0.0 if num == 0 else float("inf"))

    cases = []
    for name, (preset, overrides), T, mode, out_sharding, dtype, form, recompute in _backward_cases():
        config = get_preset(preset).config(**overrides)
        dt = jnp.dtype(dtype)
        inputs = make_layer_inputs(config, T, seed=1)
        x, logits = jnp.asarray(inputs.x, dt), jnp.asarray(inputs.router_logits)
        bias = jnp.asarray(inputs.e_score_correction_bias) if config.routing == "biased_grouped_topk" else None
        w13, w13_s, w2, w2_s = moe_pallas.quantize_layer_weights(jnp.asarray(inputs.w13, dt), jnp.asarray(inputs.w2, dt), config)
        d_out = jnp.asarray(np.random.default_rng(5).standard_normal((T, config.hidden_size)), dt)
        cfg = config.replace(ep_size=EP)
        mesh = make_ep_mesh(EP)
        if form == "sharded":  # gradients in the padded [ep * E_lmax, ...] layout, padding experts 0
            args = [shard_expert_weights(w, cfg, mesh) if w is not None else None for w in (w13, w2, w13_s, w2_s)]
        else:
            args = [w13, w2, w13_s, w2_s]
        cases.append(dict(name=name, config=config, cfg=cfg, mesh=mesh, mode=mode, out_sharding=out_sharding,
                          dtype=dtype, form=form, recompute=recompute, T=T,
                          impl=None if name.startswith("dsv3") else "reference",
                          single=(x, logits, w13, w2, w13_s, w2_s, bias, d_out), ep=(x, logits, *args, bias, d_out)))

    def single_grads(cs):  # the single-device layer's cotangents, one per case name
        def run(arrays):
            grads = []
            for c, (x, logits, w13, w2, w13_s, w2_s, bias, d_out) in zip(cs, arrays):
                def single(x_, l_, a_, b_, c=c, w13_s=w13_s, w2_s=w2_s, bias=bias):
                    return moe_pallas.moe_forward(x_, l_, a_, b_, c["config"], w13_scale=w13_s, w2_scale=w2_s,
                                                  e_score_correction_bias=bias, implementation=c["impl"])
                grads.append(jax.vjp(single, x, logits, w13, w2)[1](d_out))
            return grads
        return jax.jit(run)([c["single"] for c in cs])

    def ep_grads(runs):  # the EP layer's cotangents, one per (case, exchange)
        def run(arrays):
            grads = []
            for (c, exchange), (x, logits, w13, w2, w13_s, w2_s, bias, d_out) in zip(runs, arrays):
                def ep(x_, l_, a_, b_, c=c, exchange=exchange, w13_s=w13_s, w2_s=w2_s, bias=bias):
                    return ep_moe_forward(x_, l_, a_, b_, c["cfg"], mesh=c["mesh"], mode=c["mode"], w13_scale=w13_s,
                                          w2_scale=w2_s, e_score_correction_bias=bias, implementation=c["impl"],
                                          out_sharding=c["out_sharding"], exchange=None if exchange == "default" else exchange,
                                          recompute=c["recompute"])
                grads.append(jax.vjp(ep, x, logits, w13, w2)[1](d_out))
            return grads
        return jax.jit(run)([c["ep"] for c, _ in runs])

    # tests/conftest.py gives the suite's child processes -O0 (JAX_DISABLE_MOST_OPTIMIZATIONS), which halves
    # these compiles; only the T=1 case's EP gradient compiles at XLA's default level: at -O0 its d_router_logits
    # (one token: the softmax gradient's entries nearly cancel) lands at 1.009e-5 (9.1e-6 against a default-level
    # reference), past the float32 1e-5 rule; 2.6e-6 with only the reference at -O0, 3.2e-6 with neither. Every
    # other error stays below 4e-7 (float32) / 4e-3 (bf16) at either level.
    o0 = jax.config.read("jax_disable_most_optimizations")
    names = list(dict.fromkeys(c["name"] for c in cases))
    refs = dict(zip(names, single_grads([next(c for c in cases if c["name"] == n) for n in names])))
    results = []
    for level in sorted({o0 and c["T"] > 1 for c in cases}, reverse=True):
        jax.config.update("jax_disable_most_optimizations", level)
        runs = [(c, exchange) for c in cases if (o0 and c["T"] > 1) == level for exchange in _exchanges(c["mode"])]
        for (c, exchange), got in zip(runs, ep_grads(runs)):
            ref = list(refs[c["name"]])
            if c["form"] == "sharded":
                ref[2:] = [pad_expert_weights(r, c["cfg"]) for r in ref[2:]]
            # judged in numpy float64 (eager jnp ops on these arrays would each compile, per shape and sharding)
            got64, ref64 = [np.asarray(g).astype(np.float64) for g in got], [np.asarray(w).astype(np.float64) for w in ref]
            r = {"case": c["name"], "mode": c["mode"], "out_sharding": c["out_sharding"], "exchange": exchange,
                 "dtype": c["dtype"], "quant": c["config"].quant, "finite": all(bool(np.isfinite(g).all()) for g in got64),
                 "dtypes_kept": all(g.dtype == a.dtype for g, a in zip(got, c["ep"][:4]))}
            for n, g, want in zip(("d_x", "d_router_logits", "d_w13", "d_w2"), got64, ref64):
                r[n] = rel(g, want)
            # experts with no rows (the single-device gradient of the expert all 0): exactly 0 here too
            empty = [e for e in range(ref64[2].shape[0]) if not ref64[2][e].any()]
            r["empty_experts"] = len(empty)
            r["zero_rows_exact"] = all(not g[e].any() for e in empty for g in got64[2:])
            results.append(r)
    jax.config.update("jax_disable_most_optimizations", o0)
    return results


def _child() -> list[dict]:
    """Runs in the child process (4 CPU devices): every case, every mode, jitted.

    The child's time is mostly XLA:CPU compiling, which costs less in a few large programs than in many
    small ones (the 23 forward runs of this file took ~15 s to compile as 23 programs, ~11 s as 2). So the
    single-device references of every case are one program, and the EP layers of every case and run on
    one mesh another: each ``ep_moe_forward`` traced side by side in one ``jit``, nothing flowing between
    them, so each output is what its own ``jit`` computes. Results are judged in numpy (eager jnp ops
    compile once per shape, dtype and sharding: ~8 s of the old child)."""
    import functools
    import logging

    import jax
    import jax.numpy as jnp

    import moe_pallas
    from moe_contract import get_preset, make_layer_inputs
    from moe_pallas.ep import ep_moe_forward, make_ep_mesh, shard_expert_weights

    assert jax.device_count() >= EP, jax.devices()
    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("moe_pallas").addHandler(Grab())
    cases = []
    for name, (preset, overrides), T, routing, modes, ep, dtype, form in _cases():
        config = get_preset(preset).config(**overrides)
        inputs = make_layer_inputs(config, T, seed=1)
        logits = inputs.router_logits.copy()
        if routing == "rank0":  # sigmoid/softmax saturate: no correction bias (std 0.1) can reorder these
            logits[:, : config.num_experts // ep] += 10.0
            logits[:, config.num_experts // ep :] -= 10.0
        dt = jnp.dtype(dtype)
        x, logits = jnp.asarray(inputs.x, dt), jnp.asarray(logits)
        bias = jnp.asarray(inputs.e_score_correction_bias) if config.routing == "biased_grouped_topk" else None
        w13, w13_s, w2, w2_s = moe_pallas.quantize_layer_weights(jnp.asarray(inputs.w13, dt), jnp.asarray(inputs.w2, dt), config)
        cfg = config.replace(ep_size=ep)
        mesh = make_ep_mesh(ep)
        if form == "sharded":
            args = [shard_expert_weights(w, cfg, mesh) if w is not None else None for w in (w13, w2, w13_s, w2_s)]
        else:
            args = [w13, w2, w13_s, w2_s]
        impl = "pallas_triton" if name.endswith("pallas_triton") else None if name.endswith("gpu_kernels") or name.startswith("dsv3") else "reference"
        cases.append(dict(name=name, config=config, cfg=cfg, mesh=mesh, T=T, ep=ep, dtype=dtype, impl=impl,
                          same_inputs=(preset, json.dumps(overrides, sort_keys=True), T, routing, dtype),
                          runs=[(mode, osh, exchange) for mode, osh in modes for exchange in _exchanges(mode)],
                          single=(x, logits, w13, w2, w13_s, w2_s, bias, jnp.asarray(inputs.w13), jnp.asarray(inputs.w2)),
                          ep_args=(x, logits, *args, bias)))

    # cases of the same layer and inputs (tiny_T7 and its global-weights and Pallas twins) share their references
    firsts = list({c["same_inputs"]: c for c in reversed(cases)}.values())[::-1]

    def references(arrays):
        """Per layer and inputs: the single-device layer, the float32 layer (the same for a float32
        unquantized case), the routing's expert ids."""
        outs = {}
        for c, (x, logits, w13, w2, w13_s, w2_s, bias, w13_f32, w2_f32) in zip(firsts, arrays):
            config = c["config"]
            ref = moe_pallas.moe_forward(x, logits, w13, w2, config, w13_scale=w13_s, w2_scale=w2_s,
                                         e_score_correction_bias=bias, implementation="reference")
            ref_f32 = ref if config.quant == "none" and x.dtype == jnp.float32 else moe_pallas.moe_forward(
                x.astype(jnp.float32), logits, w13_f32, w2_f32, config.replace(quant="none"),
                e_score_correction_bias=bias, implementation="reference")
            _, ids = moe_pallas.select_experts(
                logits, topk=config.topk, routing=config.routing, renormalize=config.renormalize,
                num_expert_group=config.num_expert_group, topk_group=config.topk_group, e_score_correction_bias=bias,
                routed_scaling_factor=config.routed_scaling_factor, num_fused_shared_experts=config.num_fused_shared_experts)
            outs[c["name"]] = (ref, ref_f32, ids)
        return outs

    def ep_layers(group):
        """Per case of ``group`` (one mesh) and per run (mode, out_sharding, exchange): the EP layer."""
        def run(arrays):
            return [[ep_moe_forward(x, logits, w13, w2, c["cfg"], mesh=c["mesh"], mode=mode, w13_scale=w13_s,
                                    w2_scale=w2_s, e_score_correction_bias=bias, implementation=c["impl"],
                                    out_sharding=out_sharding, exchange=None if exchange == "default" else exchange)
                     for mode, out_sharding, exchange in c["runs"]]
                    for c, (x, logits, w13, w2, w13_s, w2_s, bias) in zip(group, arrays)]
        return jax.jit(run)([c["ep_args"] for c in group])

    refs = jax.jit(references)([c["single"] for c in firsts])
    first_of = {c["same_inputs"]: c["name"] for c in firsts}
    outs = {}
    for ep in dict.fromkeys(c["ep"] for c in cases):
        group = [c for c in cases if c["ep"] == ep]
        outs.update(zip((c["name"] for c in group), ep_layers(group)))
    results = []
    for c in cases:
        ref, ref_f32, ids = refs[first_of[c["same_inputs"]]]
        config, ep = c["config"], c["ep"]
        owner = np.minimum(np.asarray(ids) // (config.num_experts // ep), ep - 1)
        rows_per_rank = np.bincount(owner.ravel(), minlength=ep).tolist()
        for (mode, out_sharding, exchange), out in zip(c["runs"], outs[c["name"]]):
            # in numpy (an eager astype would compile once per shape, dtype and sharding)
            o, r, r32 = (np.asarray(a).astype(np.float64) for a in (out, ref, ref_f32))
            results.append({
                "case": c["name"], "mode": mode, "out_sharding": out_sharding, "exchange": exchange, "T": c["T"], "ep": ep,
                "dtype": c["dtype"], "quant": config.quant, "shape": list(out.shape), "out_dtype": str(out.dtype),
                "devices": len(out.sharding.device_set), "rows_per_rank": rows_per_rank,
                "rel_vs_single": float(np.linalg.norm(o - r) / np.linalg.norm(r)),
                "rel_vs_f32": float(np.linalg.norm(o - r32) / np.linalg.norm(r32)),
                "single_vs_f32": float(np.linalg.norm(r - r32) / np.linalg.norm(r32)),
                "finite": bool(np.isfinite(o).all()),
            })
    # The ragged path (GPU) cannot run on XLA:CPU, but it must trace and lower: force it and lower
    # (a fresh jit, so that no cached trace of the dense path is reused).
    from moe_pallas import ep as ep_module

    config = get_preset("tiny").config(ep_size=EP)
    inputs = make_layer_inputs(config, 7, seed=1)
    mesh = make_ep_mesh(EP)
    dense_exchange = ep_module._ragged_exchange
    ep_module._ragged_exchange = lambda *a, dense, **k: dense_exchange(*a, dense=False, **k)
    try:
        fresh = jax.jit(ep_moe_forward, static_argnames=("config", "mesh", "mode", "implementation", "out_sharding"))
        hlo = fresh.lower(jnp.asarray(inputs.x), jnp.asarray(inputs.router_logits), jnp.asarray(inputs.w13),
                           jnp.asarray(inputs.w2), config, mesh=mesh, mode="all_to_all",
                           e_score_correction_bias=jnp.asarray(inputs.e_score_correction_bias),
                           implementation="reference").as_text()
        # ... and its gradient: the backward adds the transposes of the two row exchanges
        ep = functools.partial(ep_moe_forward, config=config, mesh=mesh, mode="all_to_all",
                               e_score_correction_bias=jnp.asarray(inputs.e_score_correction_bias), implementation="reference")
        grad_hlo = jax.jit(lambda *a: jax.vjp(ep, *a)[1](jnp.ones((7, config.hidden_size)))).lower(
            jnp.asarray(inputs.x), jnp.asarray(inputs.router_logits), jnp.asarray(inputs.w13), jnp.asarray(inputs.w2)).as_text()
    finally:
        ep_module._ragged_exchange = dense_exchange
    return [{"log": records, "ragged_lowered": hlo.count("ragged_all_to_all"),
             "ragged_grad_lowered": grad_hlo.count("ragged_all_to_all"), "backward": _child_backward(),
             "router_losses": _child_router_losses()}] + results


def _child_router_losses() -> dict:
    """In the child: ``{mode: {loss name / "d_router_logits": rel. error, "tokens_per_expert": equal}}`` of the EP
    layer's router losses (``tiny``, ``T = 7``: all_to_all pads to 8 rows) against the single-device ones, values
    and gradients in one jitted program."""
    import functools

    import jax
    import jax.numpy as jnp

    import moe_pallas
    from moe_contract import get_preset, make_layer_inputs
    from moe_pallas.ep import ep_moe_forward, make_ep_mesh

    config, T = get_preset("tiny").config(), 7
    inputs = make_layer_inputs(config, T, seed=3)
    x, logits, w13, w2, bias = (jnp.asarray(a) for a in (inputs.x, inputs.router_logits, inputs.w13, inputs.w2,
                                                         inputs.e_score_correction_bias))
    weights = {"aux_loss": 1.0, "seq_aux_loss": 0.5, "z_loss": 0.1}

    def single(lg):
        _, ids = moe_pallas.select_experts(lg, **config.gate_kwargs(), e_score_correction_bias=bias)
        L = moe_pallas.router_losses(lg, ids, config, seq_len=T)
        return sum(w * getattr(L, n) for n, w in weights.items()), L

    def on_mesh(lg, mode):
        _, L = ep_moe_forward(x, lg, w13, w2, config.replace(ep_size=EP), mesh=make_ep_mesh(EP), mode=mode,
                              e_score_correction_bias=bias, implementation="reference", return_router_losses=True,
                              seq_len=T)
        return sum(w * getattr(L, n) for n, w in weights.items()), L

    modes = ("replicated", "all_to_all")
    fns = [single] + [functools.partial(on_mesh, mode=m) for m in modes]
    outs = jax.jit(lambda lg: [jax.value_and_grad(f, has_aux=True)(lg) for f in fns])(logits)
    (_, ref), ref_grad = outs[0]

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    results = {}
    for mode, ((_, L), grad) in zip(modes, outs[1:]):
        errs = {n: rel(getattr(L, n), getattr(ref, n)) for n in weights}
        errs["tokens_per_expert"] = bool(np.array_equal(L.tokens_per_expert, ref.tokens_per_expert))
        errs["d_router_logits"] = rel(grad, ref_grad)
        results[mode] = errs
    return results


@pytest.fixture(scope="module")
def child_results():
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if not ON_GPU:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={EP}")
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=600)
    assert run.returncode == 0, f"EP child failed:\n{run.stderr[-6000:]}"
    out = json.loads(run.stdout.strip().splitlines()[-1])
    return out[0], {(r["case"], r["mode"], r["out_sharding"], r["exchange"]): r for r in out[1:]}


def _keys():
    return [(name, mode, osh, exchange) for name, _, _, _, modes, _, _, _ in _cases() for mode, osh in modes
            for exchange in _exchanges(mode)]


@pytest.fixture(scope="module")
def ep_results(child_results):
    """The shared cases' name for the child's results."""
    return child_results


def _backward_keys():
    return [(name, mode, osh, exchange) for name, _, _, mode, osh, _, _, _ in _backward_cases() for exchange in _exchanges(mode)]


class TestEpJax(EPCases):
    """``moe_pallas.ep.ep_moe_forward`` on the child's mesh: one record per case and run (mode, out_sharding,
    exchange), the mesh's. A forward record also holds the output's shape, dtype and devices and its distance to the
    float32 layer (:meth:`check_forward_record`); a backward record whether every cotangent is finite and in its
    input's dtype. The backward's edges: T=1 leaves devices without rows (at most two of the 8 experts get rows:
    at least 4 without), and the FP8 weights' cotangents are all 0 (all 8 experts "without gradient")."""

    FORWARD_CASES = {"-".join(k): k for k in _keys()}
    BACKWARD_CASES = {"-".join(k): k for k in _backward_keys()}
    ROWLESS = {("noshared_T1_recompute",): (4, None), ("noshared_T7_fp8_per_token",): (8, 8)}
    GRADIENT_FLAGS = ("finite", "dtypes_kept")

    def forward_errors(self, ep_results, key):
        r = ep_results[1][key]
        return [r["rel_vs_single"]], r["quant"], r["dtype"]

    def check_forward_record(self, ep_results, key):
        import tolerances

        r = ep_results[1][key]
        hidden = {"tiny": 256, "noshared": 64, "dsv3": 512}[r["case"].split("_")[0]]
        assert r["shape"] == [r["T"], hidden], r
        assert r["out_dtype"] == r["dtype"], r
        assert r["finite"], r
        assert r["devices"] == r["ep"], r
        if r["quant"] != "none":
            # Both sides quantize the same rows (per-token FP8 is row-local), so they agree far inside
            # the FP8 row; their distance to the float32 layer (~6e-2: FP8 weights and activations
            # twice) is the same on both sides.
            assert r["rel_vs_f32"] <= r["single_vs_f32"] + tolerances.FP8_REL_FRO / 10, r
        elif r["dtype"] == "bfloat16":
            assert r["rel_vs_f32"] <= tolerances.BF16_REL_FRO, r

    def backward_records(self, ep_results, key):
        """The records whose (case, mode, out_sharding, exchange) start with ``key`` (a case name alone: all its
        runs)."""
        records = [b for b in ep_results[0]["backward"]
                   if (b["case"], b["mode"], b["out_sharding"], b["exchange"])[:len(key)] == tuple(key)]
        return records, records[0]["dtype"] if records else None

    def router_loss_records(self, ep_results, mode):
        return [ep_results[0]["router_losses"][mode]]


def test_uneven_load_really_uneven(child_results):
    """The rank-0-only cases: every routed row on rank 0; the last rank holds only the shared slots."""
    _, results = child_results
    a2a = _exchanges("all_to_all")[0]
    tiny = results[("tiny_T16_rank0_only", "all_to_all", "tokens", a2a)]["rows_per_rank"]
    assert tiny == [16 * 4] + [0] * (EP - 2) + [16], tiny
    noshared = results[("noshared_T8_rank0_only", "all_to_all", "tokens", a2a)]["rows_per_rank"]
    assert noshared == [8 * 2] + [0] * (EP - 1), noshared


@pytest.mark.skipif(ON_GPU, reason="the dense fallback is for XLA:CPU only")
def test_cpu_all_to_all_fallback_is_logged(child_results):
    info, _ = child_results
    assert any("ragged_all_to_all is not implemented by XLA:CPU" in m for m in info["log"]), info["log"]


def test_ragged_path_lowers(child_results):
    """The GPU path: both exchanges (rows + ids out, rows back) become ragged_all_to_all ops."""
    info, _ = child_results
    assert info["ragged_lowered"] >= 3, info


def test_ragged_path_gradient_lowers(child_results):
    """The gradient of the GPU path: the forward's three ragged exchanges plus the two rows' transposes
    (XLA's own transpose rule of ragged_all_to_all: the reverse ragged exchange)."""
    info, _ = child_results
    assert info["ragged_grad_lowered"] >= info["ragged_lowered"] + 2, info


# --- in-process: ep_size=1 on one device, and the argument checks --------------------------------


def _tiny_inputs(T=3):
    import jax.numpy as jnp

    from moe_contract import get_preset, make_layer_inputs

    config = get_preset("tiny").config()
    inp = make_layer_inputs(config, T, seed=2)
    arrays = (inp.x, inp.router_logits, inp.w13, inp.w2, inp.e_score_correction_bias)
    return (config, *(jnp.asarray(a) for a in arrays))


def test_ep_size_1_exchanges_locally():
    """One device: no ragged_all_to_all in the program (XLA:GPU's took 380 ms for a local copy on the
    H200), unless asked for; ``exchange="dense"`` equals the default."""
    import jax

    import tolerances
    from moe_pallas.ep import dense_exchange, ep_moe_forward, make_ep_mesh

    config, x, logits, w13, w2, bias = _tiny_inputs()
    mesh = make_ep_mesh(1)
    fwd = jax.jit(ep_moe_forward, static_argnames=("config", "mesh", "mode", "implementation", "out_sharding", "exchange"))
    kw = dict(mesh=mesh, mode="all_to_all", e_score_correction_bias=bias, implementation="reference")
    assert "ragged_all_to_all" not in fwd.lower(x, logits, w13, w2, config, **kw).as_text()
    tolerances.assert_exact(fwd(x, logits, w13, w2, config, exchange="dense", **kw), fwd(x, logits, w13, w2, config, **kw), "dense")
    assert dense_exchange("op", mesh, None) and dense_exchange("op", mesh, "dense")


@pytest.fixture
def fresh_xla_flags():
    """``ragged_decomposer_enabled`` keeps XLA_FLAGS as first read (what XLA saw at start): forget it
    before and after the test."""
    from moe_pallas import ep as ep_module

    ep_module._xla_flags_at_first_use.cache_clear()
    yield ep_module._xla_flags_at_first_use.cache_clear
    ep_module._xla_flags_at_first_use.cache_clear()


def test_default_exchange_follows_the_decomposer_flag(monkeypatch, tmp_path, fresh_xla_flags):
    """exchange=None on a GPU mesh of ep > 1: ragged only with XLA's ragged_all_to_all decomposer on
    (its native op ran at 2.6 GB/s between two H200s: 214 ms vs 16.5 decomposed, 18.7 dense)."""
    import types

    from moe_pallas.ep import RAGGED_ALL_TO_ALL_DECOMPOSER_FLAG as FLAG
    from moe_pallas.ep import dense_exchange, ragged_decomposer_enabled

    assert FLAG == "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer"
    for flags, on in [("", False), (FLAG, True), (f"{FLAG}=true", True), (f"{FLAG}=1", True), (f"{FLAG}=false", False),
                      (f"--xla_force_host_platform_device_count=4 {FLAG}=True", True), (f"{FLAG}=true {FLAG}=false", False),
                      (f"{FLAG}_other=true", False), (f"  {FLAG}=TRUE\t", True)]:
        assert ragged_decomposer_enabled(flags) is on, flags
    flag_file = tmp_path / "xla_flags"  # XLA_FLAGS not starting with '-' names a file of flags, as in XLA
    flag_file.write_text(f"--xla_force_host_platform_device_count=2\n{FLAG}=true\n")
    assert ragged_decomposer_enabled(str(flag_file)) is True
    with pytest.raises(TypeError, match="ragged_decomposer_enabled: xla_flags must be a str"):
        ragged_decomposer_enabled(True)

    def mesh(platform, ep):  # what dense_exchange reads of a mesh
        return types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform=platform)] * ep), shape={"ep": ep})

    monkeypatch.setenv("XLA_FLAGS", "")
    assert dense_exchange("op", mesh("gpu", 2), None) is True
    assert dense_exchange("op", mesh("gpu", 2), "ragged") is False
    monkeypatch.setenv("XLA_FLAGS", f"{FLAG}=true")  # set after the first read: XLA would not see it either
    assert dense_exchange("op", mesh("gpu", 2), None) is True
    fresh_xla_flags()  # a process that started with the flag
    assert dense_exchange("op", mesh("gpu", 2), None) is False
    assert dense_exchange("op", mesh("gpu", 2), "dense") is True
    assert dense_exchange("op", mesh("gpu", 1), None) is True  # one device: a local copy, never ragged
    assert dense_exchange("op", mesh("cpu", 4), None) is True  # XLA:CPU has no ragged_all_to_all
    with pytest.raises(ValueError, match="exchange='ragged' needs a GPU mesh"):
        dense_exchange("op", mesh("cpu", 4), "ragged")


@pytest.mark.parametrize("mode", ["replicated", "all_to_all"])
def test_ep_size_1_equals_moe_forward(mode):
    import jax

    import moe_pallas
    import tolerances
    from moe_pallas.ep import ep_moe_forward, make_ep_mesh

    config, x, logits, w13, w2, bias = _tiny_inputs()
    mesh = make_ep_mesh(1)
    fwd = jax.jit(ep_moe_forward, static_argnames=("config", "mesh", "mode", "implementation", "out_sharding"))
    out = fwd(x, logits, w13, w2, config, mesh=mesh, mode=mode, e_score_correction_bias=bias, implementation="reference")
    ref = moe_pallas.moe_forward(x, logits, w13, w2, config, e_score_correction_bias=bias, implementation="reference")
    tolerances.assert_rel_fro(out, ref, tolerances.F32_REL_FRO, mode)


def test_errors():
    import jax

    from moe_pallas.ep import ep_moe_forward, make_ep_mesh, shard_expert_weights

    config, x, logits, w13, w2, bias = _tiny_inputs()
    mesh = make_ep_mesh(1)
    with pytest.raises(ValueError, match=r"ep_moe_forward: config.ep_size must equal the size of mesh axis 'ep' \(=1\); got config.ep_size=4"):
        ep_moe_forward(x, logits, w13, w2, config.replace(ep_size=4), mesh=mesh, e_score_correction_bias=bias)
    with pytest.raises(ValueError, match=r"ep_moe_forward: mode must be one of"):
        ep_moe_forward(x, logits, w13, w2, config, mesh=mesh, mode="dense", e_score_correction_bias=bias)
    with pytest.raises(ValueError, match=r"ep_moe_forward: out_sharding must be one of"):
        ep_moe_forward(x, logits, w13, w2, config, mesh=mesh, out_sharding="experts", e_score_correction_bias=bias)
    with pytest.raises(ValueError, match=r"ep_moe_forward: exchange must be one of \('ragged', 'dense'\)"):
        ep_moe_forward(x, logits, w13, w2, config, mesh=mesh, mode="all_to_all", exchange="nccl", e_score_correction_bias=bias)
    with pytest.raises(ValueError, match=r"ep_moe_forward: exchange must be one of \('ragged', 'dense'\); got exchange='Ragged'"):
        ep_moe_forward(x, logits, w13, w2, config, mesh=mesh, mode="replicated", exchange="Ragged", e_score_correction_bias=bias)
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match=r"ep_moe_forward: exchange='ragged' needs a GPU mesh"):
            ep_moe_forward(x, logits, w13, w2, config, mesh=mesh, mode="all_to_all", exchange="ragged", e_score_correction_bias=bias)
        # replicated mode exchanges no rows: one `exchange` for both modes is fine there (jitted: the same checks
        # run at trace time, and the two compiles take ~1 s where the eager calls took ~8)
        rep = dict(mesh=mesh, mode="replicated", e_score_correction_bias=bias, implementation="reference")
        fwd = jax.jit(ep_moe_forward, static_argnames=("config", "mesh", "mode", "implementation", "exchange"))
        np.testing.assert_array_equal(np.asarray(fwd(x, logits, w13, w2, config, exchange="ragged", **rep)),
                                      np.asarray(fwd(x, logits, w13, w2, config, **rep)))
    with pytest.raises(TypeError, match=r"ep_moe_forward: recompute must be a bool; got str 'yes'"):
        ep_moe_forward(x, logits, w13, w2, config, mesh=mesh, recompute="yes", e_score_correction_bias=bias)
    with pytest.raises(ValueError, match=r"ep_moe_forward: w2 must have a leading expert axis"):
        ep_moe_forward(x, logits, w13, w2[:-1], config, mesh=mesh, e_score_correction_bias=bias)
    with pytest.raises(ValueError, match=r"ep_moe_forward: x must be \[T, H\]"):
        ep_moe_forward(x[:, :-1], logits, w13, w2, config, mesh=mesh, e_score_correction_bias=bias)
    with pytest.raises(ValueError, match=r"shard_expert_weights: w must be \[E \+ S, ...\] with E \+ S = 17"):
        shard_expert_weights(w13[:16], config, mesh)
    with pytest.raises(ValueError, match=r"shard_expert_weights: config.ep_size must equal"):
        shard_expert_weights(w13, config.replace(ep_size=2), mesh)
    with pytest.raises(ValueError, match=r"make_ep_mesh: ep_size must be <= the number of devices"):
        make_ep_mesh(len(jax.devices()) + 1)


if __name__ == "__main__" and sys.argv[1:] == ["--child"]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps(_child()))
