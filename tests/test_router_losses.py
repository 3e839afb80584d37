"""Router losses and the auxiliary-loss-free bias update (CONTRACT.md section 10), both frameworks.

Judges written here, in float64: the losses in numpy (``_ref_losses``: ``p`` softmax or normalized sigmoid, the
chosen experts as a count matrix, ``E * sum f * P`` per token set, ``mean logsumexp^2``); their gradient in
``router_logits`` as torch's float64 autograd of the same formula with the counts held constant (torch), and as
numpy central differences of ``_ref_losses`` (JAX). The bias update against ``sign(mean(load) - load)`` in numpy.
The layer and module options must return exactly what the standalone function gives on the gate's own ids.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import moe_pallas
import moe_torch
from common import both, to_jax, to_torch
from moe_contract import MoEConfig
from tolerances import F32_REL_FRO, GRAD_F32_REL_FRO, assert_exact, assert_rel_fro, to_numpy

SIGMOID = ("biased_grouped_topk", "sigmoid_topk")
#: One layer per routing mode, E = 8 (fused shared slots must not enter the losses: the biased case has one).
CONFIGS = {
    "softmax_topk": MoEConfig(hidden_size=8, intermediate_size=4, num_experts=8, topk=2),
    "grouped_topk": MoEConfig(hidden_size=8, intermediate_size=4, num_experts=8, topk=2, routing="grouped_topk",
                              num_expert_group=4, topk_group=2),
    "biased_grouped_topk": MoEConfig(hidden_size=8, intermediate_size=4, num_experts=8, topk=2,
                                     routing="biased_grouped_topk", num_expert_group=4, topk_group=2,
                                     routed_scaling_factor=2.5, num_fused_shared_experts=1),
    "sigmoid_topk": MoEConfig(hidden_size=8, intermediate_size=4, num_experts=8, topk=3, routing="sigmoid_topk",
                              renormalize=False),
}
LOSS_WEIGHTS = (1.0, 0.5, 0.1)  # aux, seq_aux, z: one scalar whose gradient checks all three at once


def _ref_losses(logits: np.ndarray, ids: np.ndarray, config: MoEConfig, seq_len: int | None):
    """float64 ``(aux, seq_aux or None, z, counts)`` of CONTRACT.md section 10, from the definitions."""
    x = logits.astype(np.float64)
    T, E = x.shape
    k = config.topk
    if config.routing in SIGMOID:
        s = 1.0 / (1.0 + np.exp(-x))
        p = s / s.sum(axis=1, keepdims=True)
    else:
        p = np.exp(x - x.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
    chosen = np.zeros((T, E))
    for t in range(T):
        for e in ids[t, :k]:
            chosen[t, e] += 1.0

    def balance(c, q):
        return E * np.sum(c.sum(axis=0) / (len(q) * k) * q.mean(axis=0))

    aux = balance(chosen, p)
    seq = None if seq_len is None else np.mean(
        [balance(chosen[i:i + seq_len], p[i:i + seq_len]) for i in range(0, T, seq_len)])
    m = x.max(axis=1)
    z = np.mean((m + np.log(np.exp(x - m[:, None]).sum(axis=1))) ** 2)
    return aux, seq, z, chosen.sum(axis=0).astype(np.int32)


def _ref_objective(logits, ids, config, seq_len):
    aux, seq, z, _ = _ref_losses(logits, ids, config, seq_len)
    return LOSS_WEIGHTS[0] * aux + LOSS_WEIGHTS[1] * seq + LOSS_WEIGHTS[2] * z


def _torch_ref_grad(logits: np.ndarray, ids: np.ndarray, config: MoEConfig, seq_len: int) -> np.ndarray:
    """float64 autograd of the same formula in torch (the counts constant)."""
    x = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    T, E = x.shape
    k = config.topk
    p = torch.sigmoid(x) / torch.sigmoid(x).sum(1, keepdim=True) if config.routing in SIGMOID else torch.softmax(x, 1)
    chosen = torch.zeros((T, E), dtype=torch.float64)
    for t in range(T):
        for e in ids[t, :k]:
            chosen[t, int(e)] += 1.0

    def balance(c, q):
        return E * (c.sum(0) / (q.shape[0] * k) * q.mean(0)).sum()

    seq = torch.stack([balance(chosen[i:i + seq_len], p[i:i + seq_len]) for i in range(0, T, seq_len)]).mean()
    z = torch.logsumexp(x, 1).square().mean()
    (LOSS_WEIGHTS[0] * balance(chosen, p) + LOSS_WEIGHTS[1] * seq + LOSS_WEIGHTS[2] * z).backward()
    return x.grad.numpy()


def _numpy_fd_grad(logits: np.ndarray, ids: np.ndarray, config: MoEConfig, seq_len: int, h: float = 1e-6):
    """Central differences of the float64 reference in each logit (the ids held fixed)."""
    x = logits.astype(np.float64)
    g = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        up, dn = x.copy(), x.copy()
        up[idx] += h
        dn[idx] -= h
        g[idx] = (_ref_objective(up, ids, config, seq_len) - _ref_objective(dn, ids, config, seq_len)) / (2 * h)
    return g


def _case(routing: str, T: int, seed: int = 0):
    """``(config, logits [T, E] float32, bias or None, gate ids [T, topk + S] int32)``: the ids the gate picks."""
    config = CONFIGS[routing]
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((T, config.num_experts)) * 1.5).astype(np.float32)
    bias = None
    if routing == "biased_grouped_topk":
        bias = (rng.standard_normal(config.num_experts) * 0.3).astype(np.float32)
    _, ids = moe_torch.select_experts(torch.from_numpy(logits), **config.gate_kwargs(),
                                      e_score_correction_bias=None if bias is None else torch.from_numpy(bias))
    return config, logits, bias, ids.numpy()


def _check_losses(got, want, what: str):
    aux, seq, z, counts = want
    assert_exact(got.tokens_per_expert, counts, f"{what}: tokens_per_expert")
    for name, v, w in (("aux_loss", got.aux_loss, aux), ("seq_aux_loss", got.seq_aux_loss, seq),
                       ("z_loss", got.z_loss, z)):
        if w is None:
            assert v is None, f"{what}: {name} must be None without seq_len"
            continue
        assert to_numpy(v).shape == () and to_numpy(v).dtype == np.float32, f"{what}: {name} not a float32 scalar"
        assert_rel_fro(to_numpy(v).reshape(1), np.array([w]), F32_REL_FRO, f"{what}: {name}")


# ------------------------------------------------------------------------------------------------ the losses


@pytest.mark.parametrize("routing", list(CONFIGS))
def test_losses_match_float64_reference(routing):
    config, logits, _, ids = _case(routing, T=8)
    want = _ref_losses(logits, ids, config, seq_len=4)
    jl, tl = both(logits)
    _check_losses(moe_torch.router_losses(tl, to_torch(ids), config, seq_len=4), want, f"torch {routing}")
    _check_losses(moe_pallas.router_losses(jl, to_jax(ids), config, seq_len=4), want, f"jax {routing}")
    # without seq_len: no seq_aux_loss, the rest unchanged; the routed columns alone read ([T, topk] ids too)
    want = _ref_losses(logits, ids, config, seq_len=None)
    _check_losses(moe_torch.router_losses(tl, to_torch(ids[:, :config.topk]), config), want, f"torch {routing}")
    _check_losses(moe_pallas.router_losses(jl, to_jax(ids[:, :config.topk]), config), want, f"jax {routing}")


def test_bf16_logits_and_one_token():
    """T = 1 (every f_e is 0 or 1/k; seq_len = 1), bf16 logits (widened to float32, losses float32)."""
    config, logits, _, ids = _case("softmax_topk", T=1, seed=3)
    want = _ref_losses(logits, ids, config, seq_len=1)
    _check_losses(moe_torch.router_losses(to_torch(logits), to_torch(ids), config, seq_len=1), want, "torch T=1")
    _check_losses(moe_pallas.router_losses(to_jax(logits), to_jax(ids), config, seq_len=1), want, "jax T=1")
    config, logits, _, ids = _case("sigmoid_topk", T=4, seed=4)
    rounded = to_numpy(to_torch(logits, "bfloat16")).astype(np.float32)  # what the bf16 logits hold
    want = _ref_losses(rounded, ids, config, seq_len=2)
    _check_losses(moe_torch.router_losses(to_torch(logits, "bfloat16"), to_torch(ids), config, seq_len=2), want,
                  "torch bf16")
    _check_losses(moe_pallas.router_losses(to_jax(logits, "bfloat16"), to_jax(ids), config, seq_len=2), want,
                  "jax bf16")


@pytest.mark.parametrize("routing", ["softmax_topk", "biased_grouped_topk"])
def test_uniform_routing_gives_one(routing):
    """Equal probabilities (zero logits: softmax 1/E, sigmoid 1/2 normalized to 1/E) and every expert chosen
    equally often: ``aux_loss == seq_aux_loss == 1``, ``z_loss == log(E)^2``."""
    config = CONFIGS[routing]
    E, k = config.num_experts, config.topk
    T = 2 * E // k  # two sequences of E / k tokens, each covering every expert once
    ids = (np.arange(T * k) % E).reshape(T, k).astype(np.int32)
    logits = np.zeros((T, E), np.float32)
    for losses in (moe_torch.router_losses(to_torch(logits), to_torch(ids), config, seq_len=T // 2),
                   moe_pallas.router_losses(to_jax(logits), to_jax(ids), config, seq_len=T // 2)):
        np.testing.assert_allclose(to_numpy(losses.aux_loss), 1.0, rtol=1e-6)
        np.testing.assert_allclose(to_numpy(losses.seq_aux_loss), 1.0, rtol=1e-6)
        np.testing.assert_allclose(to_numpy(losses.z_loss), np.log(E) ** 2, rtol=1e-6)
        assert_exact(losses.tokens_per_expert, np.full(E, T * k // E, np.int32), "tokens_per_expert")


def test_empty_call_gives_zero():
    config = CONFIGS["softmax_topk"]
    logits, ids = np.zeros((0, 8), np.float32), np.zeros((0, 2), np.int32)
    for losses in (moe_torch.router_losses(to_torch(logits), to_torch(ids), config, seq_len=2),
                   moe_pallas.router_losses(to_jax(logits), to_jax(ids), config, seq_len=2)):
        for v in (losses.aux_loss, losses.seq_aux_loss, losses.z_loss):
            assert float(to_numpy(v)) == 0.0
        assert_exact(losses.tokens_per_expert, np.zeros(8, np.int32))


@pytest.mark.parametrize("routing", ["softmax_topk", "biased_grouped_topk"])
def test_gradients_match_float64(routing):
    """d(aux + 0.5 seq_aux + 0.1 z) / d logits: through P and logsumexp only (the counts are constants)."""
    config, logits, _, ids = _case(routing, T=6, seed=1)
    ref_t = _torch_ref_grad(logits, ids, config, seq_len=3)
    ref_fd = _numpy_fd_grad(logits, ids, config, seq_len=3)
    assert_rel_fro(ref_fd, ref_t, 1e-7, "the two float64 judges")

    x = to_torch(logits).requires_grad_()
    L = moe_torch.router_losses(x, to_torch(ids), config, seq_len=3)
    (LOSS_WEIGHTS[0] * L.aux_loss + LOSS_WEIGHTS[1] * L.seq_aux_loss + LOSS_WEIGHTS[2] * L.z_loss).backward()
    assert_rel_fro(x.grad, ref_t, GRAD_F32_REL_FRO, f"torch {routing} d_logits")

    def objective(lg):
        L = moe_pallas.router_losses(lg, to_jax(ids), config, seq_len=3)
        return LOSS_WEIGHTS[0] * L.aux_loss + LOSS_WEIGHTS[1] * L.seq_aux_loss + LOSS_WEIGHTS[2] * L.z_loss

    assert_rel_fro(jax.grad(objective)(to_jax(logits)), ref_fd, GRAD_F32_REL_FRO, f"jax {routing} d_logits")


def test_bad_arguments_raise_before_compute():
    config, logits, _, ids = _case("softmax_topk", T=8)
    for fw, arr in ((moe_torch, to_torch), (moe_pallas, to_jax)):
        with pytest.raises(ValueError, match=r"router_losses: seq_len must divide T \(=8\).*got seq_len=3"):
            fw.router_losses(arr(logits), arr(ids), config, seq_len=3)
        with pytest.raises(ValueError, match="router_losses: seq_len must be an int >= 1; got seq_len=0"):
            fw.router_losses(arr(logits), arr(ids), config, seq_len=0)
        with pytest.raises(ValueError, match=r"router_losses: topk_ids must be \[T, topk\] = \(8, 2\); got"):
            fw.router_losses(arr(logits), arr(ids[:, :1]), config)
        with pytest.raises(ValueError, match=r"router_losses: router_logits must be \[T, E\] with E = "):
            fw.router_losses(arr(logits[:, :4]), arr(ids), config)
        with pytest.raises(TypeError, match="router_losses: topk_ids must have dtype int32 or int64"):
            fw.router_losses(arr(logits), arr(ids.astype(np.float32)), config)
        with pytest.raises(TypeError, match="router_losses: config must be a MoEConfig"):
            fw.router_losses(arr(logits), arr(ids), config.gate_kwargs())


# ------------------------------------------------------------------------------------------------ the layer option


def _layer_inputs(seed: int = 2, T: int = 6):
    config = CONFIGS["biased_grouped_topk"]
    rng = np.random.default_rng(seed)
    H, I, E = config.hidden_size, config.intermediate_size, config.num_total_experts
    x = rng.standard_normal((T, H)).astype(np.float32)
    logits = rng.standard_normal((T, config.num_experts)).astype(np.float32)
    w13 = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    bias = (rng.standard_normal(config.num_experts) * 0.3).astype(np.float32)
    return config, x, logits, w13, w2, bias


def test_layer_option_torch():
    config, x, logits, w13, w2, bias = _layer_inputs()
    args = (to_torch(x), to_torch(w13), to_torch(w2))
    kw = dict(e_score_correction_bias=to_torch(bias))
    _, ids = moe_torch.select_experts(to_torch(logits), **config.gate_kwargs(), **kw)
    alone = moe_torch.router_losses(to_torch(logits), ids, config, seq_len=3)
    plain = moe_torch.moe_forward(args[0], to_torch(logits), *args[1:], config, **kw)
    assert isinstance(plain, torch.Tensor)  # the option off: the return type is unchanged
    with torch.no_grad():
        out, L = moe_torch.moe_forward(args[0], to_torch(logits), *args[1:], config, **kw, return_router_losses=True,
                                       seq_len=3)
    assert_exact(out, plain, "out")
    for name in L._fields:
        assert_exact(getattr(L, name), getattr(alone, name), f"no-grad {name}")
    # the autograd path: the same values; d_logits = the layer's own + the losses' (taken separately)
    d_out = to_torch(np.random.default_rng(5).standard_normal(x.shape).astype(np.float32))
    lg = to_torch(logits).requires_grad_()
    out, L = moe_torch.moe_forward(args[0], lg, *args[1:], config, **kw, return_router_losses=True, seq_len=3)
    for name in L._fields:
        assert_exact(getattr(L, name).detach(), getattr(alone, name), f"grad-mode {name}")
    ((out * d_out).sum() + L.aux_loss + L.seq_aux_loss + L.z_loss).backward()
    lg1, lg2 = to_torch(logits).requires_grad_(), to_torch(logits).requires_grad_()
    (moe_torch.moe_forward(args[0], lg1, *args[1:], config, **kw) * d_out).sum().backward()
    a = moe_torch.router_losses(lg2, ids, config, seq_len=3)
    (a.aux_loss + a.seq_aux_loss + a.z_loss).backward()
    assert_rel_fro(lg.grad, lg1.grad + lg2.grad, 1e-6, "d_logits")
    with pytest.raises(ValueError, match=r"moe_forward: seq_len must divide T \(=6\)"):
        moe_torch.moe_forward(args[0], lg, *args[1:], config, **kw, return_router_losses=True, seq_len=4)
    with pytest.raises(ValueError, match="moe_forward: seq_len is read only with return_router_losses=True"):
        moe_torch.moe_forward(args[0], lg, *args[1:], config, **kw, seq_len=3)
    with pytest.raises(TypeError, match="moe_forward: return_router_losses must be a bool"):
        moe_torch.moe_forward(args[0], lg, *args[1:], config, **kw, return_router_losses=1)


def test_layer_option_jax():
    """Through the layer's custom_vjp (its gate ids an integer output) and outside it, the losses' gradient."""
    config, x, logits, w13, w2, bias = _layer_inputs()
    args = (to_jax(x), to_jax(w13), to_jax(w2))
    kw = dict(e_score_correction_bias=to_jax(bias))
    _, ids = moe_pallas.select_experts(to_jax(logits), **config.gate_kwargs(), **kw)
    alone = moe_pallas.router_losses(to_jax(logits), ids, config, seq_len=3)
    plain = moe_pallas.moe_forward(args[0], to_jax(logits), *args[1:], config, **kw)
    assert isinstance(plain, jax.Array)
    out, L = moe_pallas.moe_forward(args[0], to_jax(logits), *args[1:], config, **kw, return_router_losses=True,
                                    seq_len=3)
    assert_exact(out, plain, "out")
    for name in L._fields:
        assert_exact(getattr(L, name), getattr(alone, name), name)
    d_out = to_jax(np.random.default_rng(5).standard_normal(x.shape).astype(np.float32))

    def with_losses(lg):
        out, L = moe_pallas.moe_forward(args[0], lg, *args[1:], config, **kw, return_router_losses=True, seq_len=3)
        return (out * d_out).sum() + L.aux_loss + L.seq_aux_loss + L.z_loss

    def separately(lg):
        a = moe_pallas.router_losses(lg, jax.lax.stop_gradient(ids), config, seq_len=3)
        out = moe_pallas.moe_forward(args[0], lg, *args[1:], config, **kw)
        return (out * d_out).sum() + a.aux_loss + a.seq_aux_loss + a.z_loss

    assert_rel_fro(jax.grad(with_losses)(to_jax(logits)), jax.grad(separately)(to_jax(logits)), 1e-6, "d_logits")
    with pytest.raises(ValueError, match=r"moe_forward: seq_len must divide T \(=6\)"):
        moe_pallas.moe_forward(args[0], to_jax(logits), *args[1:], config, **kw, return_router_losses=True, seq_len=4)
    with pytest.raises(ValueError, match="moe_forward: seq_len is read only with return_router_losses=True"):
        moe_pallas.moe_forward(args[0], to_jax(logits), *args[1:], config, **kw, seq_len=3)


def test_modules_return_the_layer_losses():
    config, x, logits, w13, w2, bias = _layer_inputs(T=6)
    layer = moe_torch.EPMoE(config, to_torch(w13), to_torch(w2), e_score_correction_bias=to_torch(bias))
    out, L = layer(to_torch(x), to_torch(logits), return_router_losses=True, seq_len=2)
    _, ids = moe_torch.select_experts(to_torch(logits), **config.gate_kwargs(), e_score_correction_bias=to_torch(bias))
    want = moe_torch.router_losses(to_torch(logits), ids, config, seq_len=2)
    for name in L._fields:
        assert_exact(getattr(L, name).detach(), getattr(want, name), f"EPMoE {name}")
    assert isinstance(layer(to_torch(x), to_torch(logits)), torch.Tensor)

    jlayer = moe_pallas.MoELayer(config, to_jax(w13), to_jax(w2), e_score_correction_bias=to_jax(bias))
    router = (np.random.default_rng(8).standard_normal((config.num_experts, config.hidden_size)) * 0.3)
    block = moe_pallas.MoEBlock(to_jax(router.astype(np.float32)), jlayer)
    hidden = to_jax(x.reshape(2, 3, config.hidden_size))
    out, L = block(hidden, return_router_losses=True)  # seq_len defaults to S = 3
    assert out.shape == hidden.shape
    lg = block.router_logits(hidden)
    _, ids = moe_pallas.select_experts(lg, **config.gate_kwargs(), e_score_correction_bias=to_jax(bias))
    want = moe_pallas.router_losses(lg, ids, config, seq_len=3)
    for name in L._fields:
        assert_exact(getattr(L, name), getattr(want, name), f"MoEBlock {name}")


def test_hf_block_records_its_losses():
    """``HFMoEBlock(record_router_losses=True)`` returns what transformers' block returns and keeps the losses of
    the call (``seq_len = S``), differentiable in the router's weight; then the bias update takes its counts."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf_config = DeepseekV3Config(hidden_size=16, intermediate_size=32, moe_intermediate_size=8, n_routed_experts=8,
                                 num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                                 routed_scaling_factor=2.5, norm_topk_prob=True)
    block = DeepseekV3MoE(hf_config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # transformers' init leaves a zero router: every score tied
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
        block.gate.e_score_correction_bias.copy_(0.1 * torch.rand(8, generator=g))
    ours = moe_torch.HFMoEBlock(block, record_router_losses=True)
    x = torch.randn(2, 3, 16, generator=g)
    out = ours(x)
    assert isinstance(out, torch.Tensor) and out.shape == x.shape
    L = ours.last_router_losses
    logits = ours.gate(x.reshape(-1, 16))[0]
    bias = ours.gate.e_score_correction_bias
    _, ids = moe_torch.select_experts(logits, **ours.moe_config.gate_kwargs(), e_score_correction_bias=bias)
    want = moe_torch.router_losses(logits, ids, ours.moe_config, seq_len=3)
    for name in L._fields:
        assert_exact(getattr(L, name).detach(), getattr(want, name).detach(), f"HFMoEBlock {name}")
    L.seq_aux_loss.backward()
    assert ours.gate.weight.grad is not None and ours.gate.weight.grad.abs().sum() > 0
    new = moe_torch.update_expert_bias(bias, L.tokens_per_expert)
    np.testing.assert_allclose(to_numpy(new), _ref_bias(to_numpy(bias), to_numpy(L.tokens_per_expert), 1e-3),
                               rtol=0, atol=1e-7)
    ours.record_router_losses = False
    assert_exact(ours(x), out, "the same output without recording")


# ------------------------------------------------------------------------------------------------ bias update


def _ref_bias(bias: np.ndarray, load: np.ndarray, u: float) -> np.ndarray:
    load = load.astype(np.float64).reshape(-1, load.shape[-1]).sum(axis=0)
    return (bias.astype(np.float64) + u * np.sign(load.mean() - load)).astype(np.float32)


@pytest.mark.parametrize("load", [
    np.array([3, 1, 2, 2, 4, 0, 2, 2], np.int32),  # mean 2: four ties keep their bias exactly
    np.array([[3, 0, 1, 2, 2, 0, 4, 0], [0, 1, 1, 0, 2, 2, 0, 2]], np.int64),  # two calls, summed: mean 2.5
    np.array([1.5, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0], np.float32),  # float loads, mean 1.125
])
@pytest.mark.parametrize("u", [1e-3, 0.25])
def test_update_expert_bias(load, u):
    bias = (np.random.default_rng(6).standard_normal(8) * 0.1).astype(np.float32)
    want = _ref_bias(bias, load, u)
    summed = load.reshape(-1, 8).astype(np.float64).sum(axis=0)
    ties = summed == summed.mean()
    for fw, arr in ((moe_torch, to_torch), (moe_pallas, to_jax)):
        new = to_numpy(fw.update_expert_bias(arr(bias), arr(load), u))
        assert new.shape == (8,) and new.dtype == np.float32
        np.testing.assert_allclose(new, want, rtol=0, atol=1e-7, err_msg=fw.__name__)
        assert_exact(new[ties], bias[ties], f"{fw.__name__}: sign(0) = 0 keeps the bias")
        np.testing.assert_array_equal(np.sign(new - bias), np.sign(summed.mean() - summed))


def test_update_expert_bias_default_rate_and_errors():
    bias = np.zeros(4, np.float32)
    load = np.array([0, 4, 2, 2], np.int32)
    for fw, arr in ((moe_torch, to_torch), (moe_pallas, to_jax)):
        np.testing.assert_array_equal(to_numpy(fw.update_expert_bias(arr(bias), arr(load))),
                                      np.float32([1e-3, -1e-3, 0, 0]))
        with pytest.raises(TypeError, match="update_expert_bias: bias must have dtype float32; got bias.dtype=bf"):
            fw.update_expert_bias(arr(bias, "bfloat16"), arr(load))
        with pytest.raises(ValueError, match=r"update_expert_bias: tokens_per_expert must be \[E\] or \[N, E\] with "
                                              r"E = bias.shape\[0\] = 4"):
            fw.update_expert_bias(arr(bias), arr(load[:3]))
        with pytest.raises(ValueError, match="update_expert_bias: update_rate must be a finite real >= 0"):
            fw.update_expert_bias(arr(bias), arr(load), -1e-3)
