"""Capacity factor with token dropping (CONTRACT.md section 2, "Capacity"), both frameworks, forward and backward.

The judge (:func:`judge`) is plain float64 numpy, written here and sharing no code with the library: the expert
ids come from the layer's own gate (nothing flows through the choice), the weights from section 1's formulas, the
capacity from a loop over tokens in order (one counter per routed expert), and every gradient is written out by
hand (section 8's formulas, a dropped slot skipped). ``moe_forward``'s output and its gradients for ``x``,
``router_logits``, ``w13`` and ``w2`` must equal it within the float32 rows of sections 7 and 8, on the reference
path and on the kernels (Triton / Pallas-Triton, interpreted on the CPU), for: every routed slot dropped (``C = 0``),
``C = 1``, an exact fit (nothing dropped: bit-identical to dropless), an overflow, every token on one expert, an EP
rank with non-local rows, and the EP layers (JAX in process on one device; PyTorch on two gloo processes).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # `import tolerances` in the spawned processes too

import moe_torch  # noqa: E402
from common import TORCH_DEVICE  # noqa: E402
from gloo_ranks import gather_to_file, spawn_ranks  # noqa: E402
from moe_contract import MoEConfig, make_layer_inputs  # noqa: E402
from tolerances import F32_REL_FRO, GRAD_F32_REL_FRO, assert_exact, assert_rel_fro, rel_fro, to_numpy  # noqa: E402

T = 8  # 8 tokens x topk 2 over E = 4 experts: T * topk / E = 4 slots per expert on average
#: A Mixtral-like layer, and one with a fused shared expert, no renormalization and rsf 2.5 in the combine.
PLAIN = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, topk=2)
SHARED = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, topk=2, renormalize=False,
                   routed_scaling_factor=2.5, num_fused_shared_experts=1)
KERNELS = {"torch": "triton", "jax": "pallas_triton"}
NAMES = ("d_x", "d_router_logits", "d_w13", "d_w2")


def judge_keep(ids: np.ndarray, config: MoEConfig, capacity: int) -> np.ndarray:
    """``[T, topk]`` bool: the routed slots kept, first come first served in token order, then slot order."""
    taken = np.zeros(config.num_experts, np.int64)
    keep = np.zeros((ids.shape[0], config.topk), bool)
    for t in range(ids.shape[0]):
        for j in range(config.topk):
            e = ids[t, j]
            keep[t, j] = taken[e] < capacity
            taken[e] += 1
    return keep


def judge(config: MoEConfig, x, logits, w13, w2, ids, d_out, capacity: int | None):
    """float64 ``(out [T, H], [d_x, d_router_logits, d_w13, d_w2])`` of softmax top-k routing with this EP rank's
    experts (``w13`` / ``w2`` its ``[E_local, ...]``), ``ids [T, topk + S]`` the gate's, silu experts; routed slots
    beyond ``capacity`` (``None``: none) skipped, their weights not renormalized away."""
    x, logits, w13, w2, d_out = (np.asarray(a, np.float64) for a in (x, logits, w13, w2, d_out))
    T_, H = x.shape
    k, S, I, rsf = config.topk, config.num_fused_shared_experts, config.intermediate_size, config.routed_scaling_factor
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    rows = np.arange(T_)[:, None]
    sel = p[rows, ids[:, :k]]  # [T, k]
    den = sel.sum(1, keepdims=True) if config.renormalize else np.ones((T_, 1))
    w = rsf * sel / den
    keep = np.ones((T_, k), bool) if capacity is None else judge_keep(ids, config, capacity)
    start, n_local = config.local_expert_range()
    out, d_x, d_w = np.zeros_like(x), np.zeros_like(x), np.zeros((T_, k))
    d_w13, d_w2 = np.zeros_like(w13), np.zeros_like(w2)
    for t in range(T_):
        for j in range(k + S):
            e = int(ids[t, j]) - start
            if (j < k and not keep[t, j]) or not 0 <= e < n_local:
                continue
            weight = w[t, j] if j < k else 1.0  # a shared slot: 1/rsf, times rsf
            h = w13[e] @ x[t]
            g, u = h[:I], h[I:]
            s = 1 / (1 + np.exp(-g))
            a = g * s * u
            y = w2[e] @ a
            out[t] += weight * y
            d_y = weight * d_out[t]
            if j < k:
                d_w[t, j] = y @ d_out[t]
            d_w2[e] += np.outer(d_y, a)
            d_a = w2[e].T @ d_y
            d_h = np.concatenate([d_a * u * s * (1 + g * (1 - s)), d_a * g * s])
            d_w13[e] += np.outer(d_h, x[t])
            d_x[t] += w13[e].T @ d_h
    # gate: w = rsf * sel / den (den = sum(sel) when renormalizing), sel = p[ids], p = softmax(logits)
    d_sel = rsf * d_w / den
    if config.renormalize:
        d_sel -= rsf * (d_w * sel).sum(1, keepdims=True) / den**2
    d_p = np.zeros_like(p)
    np.add.at(d_p, (np.broadcast_to(rows, (T_, k)), ids[:, :k]), d_sel)
    d_logits = p * (d_p - (p * d_p).sum(1, keepdims=True))
    return out, [d_x, d_logits, d_w13, d_w2]


def inputs(config: MoEConfig, seed: int, routing: str = "uniform"):
    """``(x, router_logits, w13, w2, d_out)`` float32 numpy, this rank's experts. ``routing``: ``"uniform"``,
    ``"zipf"`` (:func:`make_layer_inputs`') or ``"one-expert"``: expert 0's logit raised by 8, so that every token
    picks it first while the others keep probabilities whose float32 gradients are still well conditioned
    (``make_layer_inputs``' +30 leaves them at ~1e-13)."""
    inp = make_layer_inputs(config, num_tokens=T, seed=seed, routing="uniform" if routing == "one-expert" else routing)
    logits = inp.router_logits.copy()
    if routing == "one-expert":
        logits[:, 0] += 8.0
    start, n = config.local_expert_range()
    d_out = np.random.default_rng(seed + 1).standard_normal((T, config.hidden_size)).astype(np.float32)
    return inp.x, logits, inp.w13[start:start + n], inp.w2[start:start + n], d_out


def run_torch(config, x, logits, w13, w2, d_out, implementation=None):
    """The library's ``(out, [grads], topk_ids)`` (numpy): autograd of ``moe_forward``."""
    leaf = lambda a: torch.tensor(a, device=TORCH_DEVICE).requires_grad_()
    args = [leaf(a) for a in (x, logits, w13, w2)]
    out = moe_torch.moe_forward(*args, config, implementation=implementation)
    out.backward(torch.tensor(d_out, device=TORCH_DEVICE))
    _, ids = moe_torch.select_experts(args[1].detach(), **config.gate_kwargs())
    return to_numpy(out), [to_numpy(a.grad) for a in args], to_numpy(ids)


def run_jax(config, x, logits, w13, w2, d_out, implementation=None):
    """The library's ``(out, [grads], topk_ids)`` (numpy): ``jax.vjp`` of ``moe_forward``, op by op (tiny shapes:
    the ops' compilations are shared by every case, where each case's ``jit`` would compile a program of its own)."""
    import jax
    import jax.numpy as jnp

    import moe_pallas

    fn = lambda *a: moe_pallas.moe_forward(*a, config, implementation=implementation)  # noqa: E731
    args = [jnp.asarray(a) for a in (x, logits, w13, w2)]
    out, vjp = jax.vjp(fn, *args)
    _, ids = moe_pallas.select_experts(args[1], **config.gate_kwargs())
    return to_numpy(out), [to_numpy(g) for g in vjp(jnp.asarray(d_out))], to_numpy(ids)


RUN = {"torch": run_torch, "jax": run_jax}


def check_against_judge(framework, config, args, implementation=None, capacity=None):
    """Run the layer and judge it (``capacity``: ``config.expert_capacity(T)`` unless given): ``(the judge's keep
    mask, the gate's ids, out, grads)``."""
    out, grads, ids = RUN[framework](config, *args, implementation=implementation)
    capacity = config.expert_capacity(T) if capacity is None else capacity
    want_out, want = judge(config, *args[:4], ids, args[4], capacity)
    what = f"{framework} {implementation or 'default'} C={capacity}"
    assert_rel_fro(out, want_out, F32_REL_FRO, f"{what} out")
    for name, g, w in zip(NAMES, grads, want):
        assert_rel_fro(g, w, GRAD_F32_REL_FRO, f"{what} {name}")
    return judge_keep(ids, config, capacity), ids, out, grads


# ------------------------------------------------------------------------------------------------ the config


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, float("nan"), float("inf"), "1.0", True])
def test_bad_capacity_factor_raises(bad):
    with pytest.raises(ValueError, match=r"^MoEConfig: capacity_factor must be None \(dropless\) or a finite float "
                                         r"> 0; got capacity_factor="):
        PLAIN.replace(capacity_factor=bad)


def test_capacity_is_exact_and_dropless_by_default():
    assert PLAIN.capacity_factor is None and PLAIN.expert_capacity(T) is None
    config = PLAIN.replace(capacity_factor=np.float32(1.25))  # a numpy scalar is stored as a Python float
    assert type(config.capacity_factor) is float and config == PLAIN.replace(capacity_factor=1.25)
    assert hash(config) == hash(PLAIN.replace(capacity_factor=1.25))  # a jit static argument
    assert config.expert_capacity(8) == 5  # ceil(1.25 * 8 * 2 / 4), exactly 5
    assert PLAIN.replace(capacity_factor=1.0).expert_capacity(6) == 3  # exactly 3, not rounded to a multiple of 8
    assert PLAIN.replace(capacity_factor=1e-9).expert_capacity(1) == 1  # C >= 1 whenever T >= 1
    assert config.expert_capacity(0) == 0
    with pytest.raises(ValueError, match=r"^MoEConfig.expert_capacity: num_tokens must be an int >= 0; got num_tokens=-1"):
        config.expert_capacity(-1)


# ------------------------------------------------------------------------------------------------ the drop


#: ``[T, topk + S]`` ids (E = 4, S = 1: id 4 is the shared expert; -1 is no expert), C = 1 by capacity_factor 0.25
#: (ceil(0.25 * 4 * 2 / 4) = 1).
IDS = np.array([[0, 1, 4], [0, 2, 4], [1, 0, 4], [3, -1, 4]], np.int32)
KEPT = np.array([[0, 1, 4], [-1, 2, 4], [-1, -1, 4], [3, -1, 4]], np.int32)
KEPT_C2 = np.array([[0, 1, 4], [0, 2, 4], [1, -1, 4], [3, -1, 4]], np.int32)  # num_tokens=16: C = 2


@pytest.mark.parametrize("implementation", ["reference", "kernel"])
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_drop_over_capacity_ids(framework, implementation):
    """Lower tokens first, then slot order; the shared expert never counts or drops; -1 stays -1; ``num_tokens``
    sets C (the EP owner's global token count)."""
    config = SHARED.replace(capacity_factor=0.25)
    impl = KERNELS[framework] if implementation == "kernel" else "reference"
    if framework == "torch":
        drop, ids = moe_torch.drop_over_capacity, torch.tensor(IDS, device=TORCH_DEVICE)
    else:
        import jax.numpy as jnp

        import moe_pallas

        drop, ids = moe_pallas.drop_over_capacity, jnp.asarray(IDS)
    assert_exact(drop(ids, config, implementation=impl), KEPT, f"{framework} {impl}")
    assert_exact(drop(ids, config, num_tokens=16, implementation=impl), KEPT_C2, f"{framework} {impl} C=2")
    assert drop(ids, SHARED, implementation=impl) is ids  # dropless: the ids themselves
    with pytest.raises(ValueError, match=r"^drop_over_capacity: num_tokens must be an int >= 0; got num_tokens=-2"):
        drop(ids, config, num_tokens=-2)
    with pytest.raises(TypeError, match=r"^drop_over_capacity: topk_ids must have dtype int32 or int64; got "
                                        r"topk_ids.dtype=float32"):
        drop(ids.astype("float32") if framework == "jax" else ids.float(), config)


# ------------------------------------------------------------------------------------------------ the layer


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_every_routed_slot_dropped_leaves_the_shared_expert(framework, monkeypatch):
    """C = 0 (no capacity_factor > 0 gives it for T >= 1: patched in): the output is the shared expert's alone, the
    routed experts and the router get exactly zero gradient."""
    config = SHARED.replace(capacity_factor=0.375)  # a config of its own: no trace of it is cached with C = 3
    monkeypatch.setattr(MoEConfig, "expert_capacity", lambda self, num_tokens: 0)
    keep, _, _, grads = check_against_judge(framework, config, inputs(config, seed=3), capacity=0)
    assert not keep.any()
    E = config.num_experts
    for name, g in (("d_router_logits", grads[1]), ("d_w13 routed", grads[2][:E]), ("d_w2 routed", grads[3][:E])):
        assert not np.any(g), f"{framework} {name} must be exactly 0 with every routed slot dropped"
    assert np.any(grads[2][E:]) and np.any(grads[3][E:])  # the shared expert still trains


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("case", ["C=1", "overflow", "one-expert"])
def test_layer_with_drops_equals_judge(case, framework):
    """C = 1 (shared expert, rsf 2.5, no renormalization); an overflow (C = 2 under uniform routing); every token's
    first choice on expert 0 (C = 4 of its 8 slots). Forward and the four gradients, reference path."""
    config, routing = {"C=1": (SHARED.replace(capacity_factor=0.25), "uniform"),
                       "overflow": (PLAIN.replace(capacity_factor=0.5), "uniform"),
                       "one-expert": (SHARED.replace(capacity_factor=1.0), "one-expert")}[case]
    keep, ids, _, _ = check_against_judge(framework, config, inputs(config, seed=5, routing=routing), "reference")
    assert not keep.all(), f"{case}: nothing was dropped, the case tests nothing"
    if case == "one-expert":
        assert (ids[:, 0] == 0).all() and keep[:, 0].sum() == 4


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_layer_with_drops_on_the_kernels(framework):
    """Every stage on its kernel (Triton / Pallas-Triton, interpreted on the CPU; the drop's sort too): drops need no
    kernel of their own. Every token on expert 0 first, a shared expert beside it."""
    config = SHARED.replace(capacity_factor=1.0)
    keep = check_against_judge(framework, config, inputs(config, seed=7, routing="one-expert"), KERNELS[framework])[0]
    assert keep[:, 0].sum() == 4


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_exact_fit_and_large_capacity_equal_dropless(framework):
    """C equal to the busiest expert's slots drops nothing: output and gradients bit-identical to dropless (the
    default), as with a capacity far above any load (PyTorch)."""
    args = inputs(PLAIN, seed=9, routing="zipf")
    out0, grads0, ids = RUN[framework](PLAIN, *args)
    busiest = int(np.bincount(ids.ravel(), minlength=PLAIN.num_experts).max())
    exact = PLAIN.replace(capacity_factor=busiest / 4)  # T * topk / E = 4: C = busiest, exactly
    assert exact.expert_capacity(T) == busiest
    assert judge_keep(ids, exact, busiest).all() and not judge_keep(ids, exact, busiest - 1).all()
    configs = (exact, PLAIN.replace(capacity_factor=100.0)) if framework == "torch" else (exact,)  # JAX: one case
    for config in configs:
        out, grads, _ = RUN[framework](config, *args)
        assert_exact(out, out0, f"{framework} capacity_factor={config.capacity_factor} out")
        for name, g, g0 in zip(NAMES, grads, grads0):
            assert_exact(g, g0, f"{framework} capacity_factor={config.capacity_factor} {name}")


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_ep_rank_counts_every_token(framework):
    """``moe_forward`` on EP rank 1 of 2 (experts 2, 3 and the shared one; the slots on experts 0, 1 are non-local):
    its output and gradients are the judge's with its experts only and the global capacity (C counts all T tokens,
    and the slots over capacity are ranked among every rank's slots on the expert)."""
    config = SHARED.replace(capacity_factor=0.5, ep_size=2, ep_rank=1)
    keep, ids, _, _ = check_against_judge(framework, config, inputs(config, seed=11), "reference")
    local = (ids[:, :2] >= 2)
    assert not keep[local].all() and not local.all()


# ------------------------------------------------------------------------------------------------ the EP layers


@pytest.mark.parametrize("mode", ["replicated", "all_to_all"])
def test_jax_ep_layer_drops_like_the_layer(mode):
    """``ep_moe_forward`` on a one-device mesh: all_to_all drops on the owner's received rows, replicated on the
    gate's ids; both equal the judge, forward and gradients."""
    import jax
    import jax.numpy as jnp

    import moe_pallas

    config = SHARED.replace(capacity_factor=0.5)
    mesh = moe_pallas.make_ep_mesh(1)
    x, logits, w13, w2, d_out = inputs(config, seed=13)
    fn = jax.jit(lambda *a: moe_pallas.ep_moe_forward(*a, config, mesh=mesh, mode=mode))
    args = [jnp.asarray(a) for a in (x, logits, w13, w2)]
    out, vjp = jax.vjp(fn, *args)
    _, ids = moe_pallas.select_experts(args[1], **config.gate_kwargs())
    want_out, want = judge(config, x, logits, w13, w2, to_numpy(ids), d_out, config.expert_capacity(T))
    assert not judge_keep(to_numpy(ids), config, config.expert_capacity(T)).all()
    assert_rel_fro(out, want_out, F32_REL_FRO, f"{mode} out")
    for name, g, w in zip(NAMES, vjp(jnp.asarray(d_out)), want):
        assert_rel_fro(g, w, GRAD_F32_REL_FRO, f"{mode} {name}")


#: Rank 0 holds tokens [0, 3), rank 1 [3, 8) in all_to_all mode: uneven, so a rank-local capacity would differ.
SPLIT = 3


def _gloo_worker(rank: int, world: int, init_method: str, out_path: str) -> None:
    """Both EP modes' output rows and gradients on this rank (numpy lists, gathered to ``out_path`` by rank 0)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        config = SHARED.replace(capacity_factor=0.5, ep_size=world, ep_rank=rank)
        inp = make_layer_inputs(config, num_tokens=T, seed=17)
        start, n = config.local_expert_range()
        d_out = torch.from_numpy(np.random.default_rng(18).standard_normal((T, config.hidden_size)).astype(np.float32))
        mine = {}
        for mode, rows in (("replicated", slice(0, T)), ("all_to_all", slice(*((0, SPLIT), (SPLIT, T))[rank]))):
            leaf = lambda a: torch.from_numpy(np.ascontiguousarray(a)).requires_grad_()
            args = [leaf(inp.x[rows]), leaf(inp.router_logits[rows]), leaf(inp.w13[start:start + n]),
                    leaf(inp.w2[start:start + n])]
            out, losses = moe_torch.ep_moe_forward(*args, config, mode=mode, implementation="reference",
                                                   return_router_losses=True)
            out.backward(d_out[rows])
            mine[mode] = [out.detach().numpy().tolist()] + [a.grad.numpy().tolist() for a in args]
            mine[mode + " tokens_per_expert"] = losses.tokens_per_expert.tolist()
        gather_to_file(mine, rank, world, out_path)
    finally:
        dist.destroy_process_group()


def test_torch_ep_layer_drops_globally(tmp_path):
    """Two gloo processes, both modes: the ranks' output rows and gradients are the single-device judge's with the
    global capacity; in all_to_all mode rank 0 has 3 tokens and rank 1 5, so a capacity counted per rank, or an owner
    that ranked its received rows out of token order, would give other outputs. The router losses' counts are the
    gate's, dropped slots included, on every rank in both modes."""
    results = spawn_ranks(_gloo_worker, 2, (str(tmp_path / "out.json"),), tmp_path / "out.json")
    config = SHARED.replace(capacity_factor=0.5)
    inp = make_layer_inputs(config, num_tokens=T, seed=17)
    d_out = np.random.default_rng(18).standard_normal((T, config.hidden_size)).astype(np.float32)
    _, ids = moe_torch.select_experts(torch.from_numpy(inp.router_logits), **config.gate_kwargs())
    capacity = config.expert_capacity(T)
    assert not judge_keep(to_numpy(ids), config, capacity).all()
    want_out, want = judge(config, inp.x, inp.router_logits, inp.w13, inp.w2, to_numpy(ids), d_out, capacity)
    for mode in ("replicated", "all_to_all"):
        got = [[np.asarray(a, np.float32) for a in r[mode]] for r in results]
        if mode == "replicated":  # every rank the whole output; d_x, d_logits are the sums (each rank has them)
            out, d_x, d_logits = got[0][0], got[0][1], got[0][2]
        else:  # each rank its own tokens' rows
            out, d_x, d_logits = (np.concatenate([g[i] for g in got]) for i in range(3))
        assert_rel_fro(out, want_out, F32_REL_FRO, f"{mode} out")
        assert_rel_fro(d_x, want[0], GRAD_F32_REL_FRO, f"{mode} d_x")
        assert_rel_fro(d_logits, want[1], GRAD_F32_REL_FRO, f"{mode} d_router_logits")
        for i, name in ((3, "d_w13"), (4, "d_w2")):  # rank 0: experts 0, 1; rank 1: 2, 3 and the shared one
            assert_rel_fro(np.concatenate([g[i] for g in got]), want[i - 1], GRAD_F32_REL_FRO, f"{mode} {name}")
        # the router losses count the router's choices, dropped slots included (CONTRACT.md section 10)
        routed = to_numpy(ids)[:, :config.topk]
        for r in results:
            assert r[mode + " tokens_per_expert"] == np.bincount(routed.ravel(), minlength=config.num_experts).tolist()


# ------------------------------------------------------------------------------------------------ the modules


def test_modules_take_capacity_factor_from_preset():
    """``EPMoE.from_preset`` / ``MoELayer.from_preset`` take ``capacity_factor`` as a config override, and EPMoE's
    forward is the capacity layer's: ``moe_forward`` with that config, not the dropless one."""
    import jax.numpy as jnp

    import moe_pallas

    layer = moe_torch.EPMoE.from_preset("tiny", dtype=torch.float32, capacity_factor=0.5)
    assert layer.config.capacity_factor == 0.5 and "capacity_factor=0.5" in repr(layer)
    inp = make_layer_inputs(layer.config, num_tokens=T, seed=19)
    x, logits = torch.from_numpy(inp.x), torch.from_numpy(inp.router_logits)
    bias = layer.e_score_correction_bias
    with torch.no_grad():
        out = layer(x, logits)
        dropless = moe_torch.moe_forward(x, logits, layer.w13, layer.w2, layer.config.replace(capacity_factor=None),
                                         e_score_correction_bias=bias)
    assert_exact(out, moe_torch.moe_forward(x, logits, layer.w13, layer.w2, layer.config, e_score_correction_bias=bias)
                 .detach(), "EPMoE")
    assert rel_fro(out, dropless) > 1e-3  # C = 1 of the 2 slots per expert on average: something was dropped
    # MoELayer calls moe_forward with its config as EPMoE does (the layer tests above cover JAX's capacity)
    assert moe_pallas.MoELayer.from_preset("tiny", dtype=jnp.float32, capacity_factor=0.5).config == layer.config
