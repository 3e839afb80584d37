"""The compilers and transforms a trainer puts around the layer.

torch: ``torch.compile(fullgraph=True)`` over ``moe_forward`` and ``EPMoE`` (no graph break, forward and backward;
``aot_eager`` runs the custom ops' fake implementations and the ``autograd.Function`` through AOTAutograd), with
the reference and the (interpreted) Triton backends; the compiled outputs and gradients equal the eager ones
bit for bit (the same ops run). ``torch.func.grad`` / ``vjp`` equal ``torch.autograd``; ``vmap``, forward-mode AD
and second-order gradients raise naming the layer. ``torch.autocast`` around a float32 ``EPMoE`` and a float32
``MoEBlock`` fed bf16 activations (one policy, one helper). (The EP layer compiled, over gloo processes:
tests/test_compile_ep_torch.py.) JAX: a whole optax AdamW step under ``jax.jit`` / ``nnx.jit`` with its parameters
and optimizer state donated (no "donated buffers were not usable" warning; the donated inputs consumed), the same
losses and weights as without donation.
"""

from __future__ import annotations

import dataclasses
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

import moe_pallas
import moe_torch
from common import TORCH_DEVICE
from moe_contract.config import MoEConfig
from moe_torch.ops import custom_ops

#: Every optional input of the layer in play: a fused shared expert with its gate, expert biases, an rsf.
CONFIG = MoEConfig(hidden_size=16, intermediate_size=8, num_experts=4, topk=2, num_fused_shared_experts=1,
                   shared_expert_gate=True, expert_bias=True, routed_scaling_factor=2.5)
SECOND_ORDER = r"second-order gradients \(create_graph=True / double backward\) are not supported"


def _inputs(T: int, config: MoEConfig = CONFIG, seed: int = 0) -> dict:
    """``moe_forward``'s differentiable inputs (float32, requires_grad) for ``config`` (one fused shared expert)."""
    g = torch.Generator().manual_seed(seed)
    E, H, I = config.num_experts + 1, config.hidden_size, config.intermediate_size  # noqa: E741
    shapes = dict(x=(T, H), router_logits=(T, config.num_experts), w13=(E, 2 * I, H), w2=(E, H, I),
                  shared_expert_gate_logits=(T, 1), w13_bias=(E, 2 * I), w2_bias=(E, H))
    return {k: (torch.randn(s, generator=g) * 0.5).to(TORCH_DEVICE).requires_grad_() for k, s in shapes.items()}


def _layer(config=CONFIG, implementation="reference", recompute=False):
    def f(x, router_logits, w13, w2, shared_expert_gate_logits, w13_bias, w2_bias):
        return moe_torch.moe_forward(x, router_logits, w13, w2, config, w13_bias=w13_bias, w2_bias=w2_bias,
                                     shared_expert_gate_logits=shared_expert_gate_logits,
                                     implementation=implementation, recompute=recompute)
    return f


def _value_and_grads(f, inputs: dict):
    out = f(**inputs)
    return out, torch.autograd.grad(out.square().sum(), list(inputs.values()))


def _assert_equal(got, want, what: str):
    (out, grads), (out_want, grads_want) = got, want
    assert torch.equal(out, out_want), f"{what}: output"
    for name, g, w in zip(INPUT_NAMES, grads, grads_want):
        assert g.dtype == w.dtype and torch.equal(g, w), f"{what}: d_{name}"


INPUT_NAMES = ("x", "router_logits", "w13", "w2", "shared_expert_gate_logits", "w13_bias", "w2_bias")


@pytest.mark.parametrize("implementation,recompute,capacity_factor", [
    ("reference", False, None), ("reference", True, None), ("reference", False, 0.5), ("triton", False, None)])
def test_compile_fullgraph_equals_eager(implementation, recompute, capacity_factor):
    """``torch.compile(fullgraph=True, backend="aot_eager")`` over ``moe_forward``: no graph break (fullgraph
    raises on one; ``explain`` counts none), output and every gradient equal to eager; with a capacity too
    (its data-dependent drops stay inside the op)."""
    config = dataclasses.replace(CONFIG, capacity_factor=capacity_factor)
    f = _layer(config, implementation=implementation, recompute=recompute)
    inputs = _inputs(5)
    want = _value_and_grads(f, inputs)
    _assert_equal(_value_and_grads(torch.compile(f, backend="aot_eager", fullgraph=True), inputs), want,
                  f"compiled {implementation}")
    if implementation == "reference" and not recompute and capacity_factor is None:
        explained = torch._dynamo.explain(f)(**inputs)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_compile_router_losses():
    """``return_router_losses=True`` under ``torch.compile(fullgraph=True)``: the losses (plain torch ops on the
    logits and the gate's ids that the forward op returns) and the gradients they add equal eager."""
    config = dataclasses.replace(CONFIG, num_fused_shared_experts=0, shared_expert_gate=False)
    inputs = {k: v for k, v in _inputs(6).items() if k != "shared_expert_gate_logits"}
    inputs["w13"], inputs["w2"], inputs["w13_bias"], inputs["w2_bias"] = (
        inputs[k][:4].detach().requires_grad_() for k in ("w13", "w2", "w13_bias", "w2_bias"))

    def f(x, router_logits, w13, w2, w13_bias, w2_bias):
        out, losses = moe_torch.moe_forward(x, router_logits, w13, w2, config, w13_bias=w13_bias, w2_bias=w2_bias,
                                            implementation="reference", return_router_losses=True, seq_len=3)
        return out, losses

    def run(fn):
        out, losses = fn(**inputs)
        total = out.square().sum() + losses.aux_loss + losses.seq_aux_loss + losses.z_loss
        return (out, losses), torch.autograd.grad(total, list(inputs.values()))

    ((out, losses), grads), ((want, want_losses), want_grads) = \
        run(torch.compile(f, backend="aot_eager", fullgraph=True)), run(f)
    assert torch.equal(out, want)
    for got, ref in zip(losses, want_losses):
        assert torch.equal(got, ref)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="Inductor on the CPU needs a C++ compiler")
def test_compile_inductor():
    """The default backend (Inductor) over ``moe_forward``: the custom ops stay opaque calls in its code; the
    output and gradients equal eager (up to Inductor's own fusion of the loss around the layer)."""
    f = _layer()
    inputs = _inputs(5)
    (out, grads), (want, want_grads) = _value_and_grads(torch.compile(f, fullgraph=True), inputs), \
        _value_and_grads(f, inputs)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_compile_dynamic_tokens_and_config_changes():
    """A second token count compiles once more with a symbolic ``T`` (automatic dynamic shapes: the layer's checks
    neither format ``T`` nor specialize it), and a third runs that graph without recompiling. One compiled
    function over two modules whose configs differ only in fields the checks never read (the activation, the
    float rsf) gives each module's own result, never the first one's (every config field is guarded)."""
    f = _layer()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for T in (5, 7, 9):
        inputs = _inputs(T, seed=T)
        with torch._dynamo.config.patch(error_on_recompile=T == 9):
            got = _value_and_grads(compiled, inputs)
        _assert_equal(got, _value_and_grads(f, inputs), f"T={T}")

    def run(module, x, router_logits):
        return module(x, router_logits)

    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    a = {k: v.detach() for k, v in _inputs(6).items()}
    for config in (CONFIG, dataclasses.replace(CONFIG, activation="gelu_tanh", routed_scaling_factor=1.5)):
        layer = moe_torch.EPMoE.from_float(config, a["w13"], a["w2"], w13_bias=a["w13_bias"], w2_bias=a["w2_bias"],
                                           shared_expert_gate=a["x"][:1], implementation="reference")
        assert torch.equal(compiled(layer, a["x"], a["router_logits"]), layer(a["x"], a["router_logits"])), config


def test_compile_module_fullgraph_equals_eager():
    """``torch.compile(EPMoE, fullgraph=True)``: the module's forward (its shared expert gate's linear, the
    layer) and the parameters' gradients equal eager."""
    a = _inputs(6)
    layer = moe_torch.EPMoE.from_float(CONFIG, a["w13"].detach(), a["w2"].detach(), w13_bias=a["w13_bias"].detach(),
                                       w2_bias=a["w2_bias"].detach(), shared_expert_gate=a["x"].detach()[:1] * 0.1,
                                       implementation="reference")
    x, logits = a["x"], a["router_logits"]
    params = [x, logits, *layer.parameters()]

    def run(m):
        out = m(x, logits)
        return out, torch.autograd.grad(out.square().sum(), params)

    (out, grads), (want, want_grads) = run(torch.compile(layer, backend="aot_eager", fullgraph=True)), run(layer)
    assert torch.equal(out, want)
    assert len(grads) == 7 and all(torch.equal(g, w) for g, w in zip(grads, want_grads))


def test_custom_ops_opcheck():
    """``torch.library.opcheck`` of both ops (schema, fake implementation vs the real one's shapes and dtypes,
    AOTAutograd with dynamic shapes), on the reference backend."""
    a = {k: v.detach() for k, v in _inputs(3).items()}
    key, floats = custom_ops.config_key(CONFIG)
    args = (a["x"], a["router_logits"], a["w13"], a["w2"], None, None, None, a["shared_expert_gate_logits"],
            a["w13_bias"], a["w2_bias"])
    for recompute in (False, True):
        torch.library.opcheck(torch.ops.epmoe.moe_layer.default, (*args, key, floats, "reference", recompute))
        saved = torch.ops.epmoe.moe_layer(*args, key, floats, "reference", recompute)[1:]
        needs = [True, True, True, False, True, False, True]
        torch.library.opcheck(torch.ops.epmoe.moe_layer_backward.default,
                              (torch.ones_like(a["x"]), *args, *saved, key, floats, "reference", recompute, needs))


def test_func_grad_and_vjp_equal_autograd():
    """``torch.func.grad`` (every differentiable input) and ``torch.func.vjp`` equal ``torch.autograd.grad``."""
    f = _layer()
    inputs = _inputs(5)
    _, want = _value_and_grads(f, inputs)
    detached = [v.detach() for v in inputs.values()]
    grads = torch.func.grad(lambda *a: f(*a).square().sum(), argnums=tuple(range(7)))(*detached)
    assert all(torch.equal(g, w) for g, w in zip(grads, want))
    out, vjp = torch.func.vjp(f, *detached)
    assert all(torch.equal(g, w) for g, w in zip(vjp(2 * out), want))


def test_unsupported_transforms_raise_naming_them():
    """``vmap``, forward-mode AD (``torch.func.jvp``, ``torch.autograd.forward_ad``) and second-order gradients
    through ``torch.func`` raise naming the layer (never a wrong answer); the EP module refuses ``torch.func``."""
    f = _layer()
    a = [v.detach() for v in _inputs(4).values()]
    x = a[0]
    with pytest.raises(NotImplementedError, match=r"^moe_forward: torch.func.vmap is not supported"):
        torch.func.vmap(f, in_dims=(0, 0, None, None, 0, None, None))(*(t.expand(2, *t.shape) if i in (0, 1, 4) else t
                                                                          for i, t in enumerate(a)))
    with pytest.raises(NotImplementedError, match=r"^moe_forward: forward-mode AD"):
        torch.func.jvp(lambda x: f(x, *a[1:]), (x,), (torch.ones_like(x),))
    with pytest.raises(NotImplementedError, match=r"^moe_forward: forward-mode AD"):
        with torch.autograd.forward_ad.dual_level():
            f(torch.autograd.forward_ad.make_dual(x, torch.ones_like(x)), *a[1:])
    inner = torch.func.grad(lambda x: f(x, *a[1:]).square().sum())
    with pytest.raises(RuntimeError, match=rf"^moe_forward: {SECOND_ORDER}"):
        torch.func.grad(lambda x: inner(x).sum())(x)
    with pytest.raises(RuntimeError, match=rf"^moe_forward: {SECOND_ORDER}"):  # plain autograd, as before
        inputs = _inputs(4)
        torch.autograd.grad(f(**inputs).square().sum(), list(inputs.values()), create_graph=True)
    ep = moe_torch.EPMoE.from_float(CONFIG, a[2], a[3], w13_bias=a[5], w2_bias=a[6], shared_expert_gate=x[:1],
                                    ep_mode="replicated")
    with pytest.raises(NotImplementedError, match=r"^EPMoE: torch.func transforms .* with a process_group"):
        torch.func.grad(lambda x: ep(x, a[1]).sum())(x)


class _AutocastModel(torch.nn.Module):
    """A float32 model whose linear layers autocast makes bf16: the MoE gets bf16 ``x`` and router logits."""

    def __init__(self, implementation="reference"):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        H, E, I = CONFIG.hidden_size, CONFIG.num_experts, CONFIG.intermediate_size  # noqa: E741
        self.proj = torch.nn.Linear(H, H).to(TORCH_DEVICE)
        self.router = torch.nn.Linear(H, E, bias=False).to(TORCH_DEVICE)
        w = lambda *s: (torch.randn(s, generator=g) * 0.3).to(TORCH_DEVICE)  # noqa: E731
        self.moe = moe_torch.EPMoE.from_float(CONFIG, w(E + 1, 2 * I, H), w(E + 1, H, I), w13_bias=w(E + 1, 2 * I),
                                              w2_bias=w(E + 1, H), shared_expert_gate=w(1, H),
                                              implementation=implementation)

    def forward(self, x):
        h = self.proj(x)
        return self.moe(h, self.router(h))


def _autocast_runs(model, x, spelled_out, exact_under_aot) -> torch.Tensor:
    """``model(x)`` under ``torch.autocast(bfloat16)``, eager and compiled (Dynamo alone, and AOTAutograd), against
    ``spelled_out()`` (the same computation with explicit casts, no autocast): the bf16 output bit for bit, and every
    parameter's float32 gradient bit for bit, but under AOTAutograd for the parameters not in ``exact_under_aot``
    (those the custom ops differentiate): AOTAutograd decomposes the backward of torch's own linears (the bf16 ones
    autocast makes, the router's float32 one) and rounds in another order (elements an ulp apart). Returns the
    spelled-out output."""
    device = torch.device(TORCH_DEVICE).type

    def run(fn):
        model.zero_grad(set_to_none=True)
        out = fn()
        out.float().square().sum().backward()
        return out, {n: p.grad for n, p in model.named_parameters()}

    def autocast_run(m):
        with torch.autocast(device, dtype=torch.bfloat16):
            return m(x)

    want, want_grads = run(spelled_out)
    runs = {"eager": model, "dynamo": torch.compile(model, backend="eager", fullgraph=True),
            "aot_eager": torch.compile(model, backend="aot_eager", fullgraph=True)}
    for what, m in runs.items():
        out, grads = run(lambda: autocast_run(m))
        assert out.dtype == torch.bfloat16 and torch.equal(out, want), what
        assert set(grads) == set(want_grads), what
        for name, g in grads.items():
            assert g.dtype == torch.float32, f"{what}: d_{name}"
            if what == "aot_eager" and name not in exact_under_aot:
                w = want_grads[name]
                assert ((g - w).norm() / w.norm()).item() < 1e-2, f"{what}: d_{name}"
            else:
                assert torch.equal(g, want_grads[name]), f"{what}: d_{name}"
    return want


def test_autocast_bf16_activations_into_float32_module():
    """``torch.autocast("cpu", bfloat16)`` around a float32 model whose ``nn.Linear`` hands the MoE bf16 ``x``:
    no dtype error; the MoE runs as transformers' ``grouped_mm`` experts do under autocast: ``x`` cast to the
    weights' dtype (float32 GEMMs), the output back in ``x``'s dtype (bf16). The output and every gradient
    equal that computation spelled out without autocast (the float32 weights get float32 gradients), eager and
    compiled. The layer's ops are not autocast inside: ``moe_forward`` on float32 arrays under autocast equals
    it without."""
    model = _AutocastModel()
    device = torch.device(TORCH_DEVICE).type
    x = torch.randn(5, CONFIG.hidden_size, generator=torch.Generator().manual_seed(4)).to(TORCH_DEVICE)

    def spelled_out():
        h = torch.nn.functional.linear(x.bfloat16(), model.proj.weight.bfloat16(), model.proj.bias.bfloat16())
        logits = torch.nn.functional.linear(h, model.router.weight.bfloat16())
        return model.moe(h.float(), logits).bfloat16()

    want = _autocast_runs(model, x, spelled_out, ("moe.w13", "moe.w2", "moe.w13_bias", "moe.w2_bias"))
    with torch.autocast(device, dtype=torch.bfloat16):
        h = model.proj(x)
        out, losses = model.moe(h, model.router(h), return_router_losses=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want) and losses.aux_loss.dtype == torch.float32
    inputs = {k: v.detach() for k, v in _inputs(5).items()}
    plain = _layer()(**inputs)
    with torch.autocast(device, dtype=torch.bfloat16):
        assert torch.equal(_layer()(**inputs), plain)


#: A Qwen3-Next-style block for the autocast test: router, experts, a gated shared expert (no expert biases: no
#: transformers block has them beside shared experts).
BLOCK_CONFIG = dataclasses.replace(CONFIG, expert_bias=False)


def test_autocast_bf16_activations_into_float32_block():
    """``MoEBlock`` under ``torch.autocast("cpu", bfloat16)``, fed ``[B, S, H]`` bf16 hidden states by a float32
    ``nn.Linear``: the policy of ``EPMoE`` (the same code): the hidden states cast to the experts' float32, the whole
    block (router, experts, shared MLP and its gate) computed with autocast off, the output back in bf16; output and
    gradients equal that spelled out without autocast, eager and compiled; the router losses stay float32."""
    g = torch.Generator().manual_seed(5)
    H, E, I = BLOCK_CONFIG.hidden_size, BLOCK_CONFIG.num_experts, BLOCK_CONFIG.intermediate_size  # noqa: E741
    w = lambda *s: (torch.randn(s, generator=g) * 0.3).to(TORCH_DEVICE)  # noqa: E731
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(H, H).to(TORCH_DEVICE))
    model.add_module("block", moe_torch.MoEBlock.from_float(BLOCK_CONFIG, w(E, H), w(E + 1, 2 * I, H), w(E + 1, H, I),
                                                            shared_expert_gate=w(1, H), implementation="reference"))
    device = torch.device(TORCH_DEVICE).type
    x = torch.randn(2, 3, H, generator=torch.Generator().manual_seed(6)).to(TORCH_DEVICE)

    def spelled_out():
        h = torch.nn.functional.linear(x.bfloat16(), model.proj.weight.bfloat16(), model.proj.bias.bfloat16())
        return model.block(h.float()).bfloat16()

    want = _autocast_runs(model, x, spelled_out, ("block.experts.gate_up_proj", "block.experts.down_proj"))
    assert want.shape == x.shape
    with torch.autocast(device, dtype=torch.bfloat16):
        out, losses = model.block(model.proj(x), return_router_losses=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    assert losses.aux_loss.dtype == losses.seq_aux_loss.dtype == torch.float32


# JAX: one AdamW training step under jit, its parameters and optimizer state donated.

JAX_CONFIG = MoEConfig(hidden_size=16, intermediate_size=8, num_experts=4, topk=2, routed_scaling_factor=2.5)
NOT_USABLE = "Some donated buffers were not usable"


def _jax_problem():
    k = jax.random.split(jax.random.key(0), 5)
    H, E, I = JAX_CONFIG.hidden_size, JAX_CONFIG.num_experts, JAX_CONFIG.intermediate_size  # noqa: E741
    params = dict(w13=0.3 * jax.random.normal(k[0], (E, 2 * I, H)), w2=0.3 * jax.random.normal(k[1], (E, H, I)),
                  router=jax.random.normal(k[2], (H, E)))
    return params, (jax.random.normal(k[3], (6, H)), jax.random.normal(k[4], (6, H)))


def test_jit_train_step_with_donated_params_and_opt_state():
    """``jax.jit(step, donate_argnums=(0, 1))`` over ``(params, opt_state, batch) -> (params, opt_state, loss)``
    (``moe_forward``, its ``custom_vjp`` backward, optax AdamW): every donated buffer used (the warning is an
    error here) and consumed, and two steps give the losses and parameters of the step without donation."""
    tx = optax.adamw(1e-2)

    def loss_fn(p, batch):
        x, y = batch
        out = moe_pallas.moe_forward(x, x @ p["router"], p["w13"], p["w2"], JAX_CONFIG, implementation="reference")
        return jnp.mean((out - y) ** 2)

    def step(p, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    params, batch = _jax_problem()
    runs = {}
    for donate in (True, False):
        p = jax.tree.map(jnp.copy, params)
        s = tx.init(p)
        fn = jax.jit(step, donate_argnums=(0, 1) if donate else ())
        losses = []
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=NOT_USABLE)
            for _ in range(2):
                given = jax.tree.leaves((p, s))
                p, s, loss = fn(p, s, batch)
                losses.append(float(loss))
                assert all(a.is_deleted() == donate for a in given)
        runs[donate] = losses, p
    assert runs[True][0] == runs[False][0]
    jax.tree.map(np.testing.assert_array_equal, runs[True][1], runs[False][1])


def test_nnx_jit_train_step_with_donated_module_and_optimizer():
    """``nnx.jit(step, donate_argnums=(0, 1))`` over an ``MoELayer`` and its ``nnx.Optimizer`` (AdamW over
    ``nnx.Param``): every donated buffer used and consumed; the losses and weights of the step without donation."""
    params, (x, y) = _jax_problem()
    logits = x @ params["router"]

    def step(layer, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x, logits) - y) ** 2))(layer)
        optimizer.update(layer, grads)
        return loss

    runs = {}
    for donate in (True, False):
        layer = moe_pallas.MoELayer.from_float(JAX_CONFIG, jnp.copy(params["w13"]), jnp.copy(params["w2"]),
                                               implementation="reference")  # (the layer holds what it is given)
        optimizer = nnx.Optimizer(layer, optax.adamw(1e-2), wrt=nnx.Param)
        fn = nnx.jit(step, donate_argnums=(0, 1) if donate else ())
        losses = []
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=NOT_USABLE)
            for _ in range(2):
                w13 = layer.w13[...]
                losses.append(float(fn(layer, optimizer)))
                assert w13.is_deleted() == donate
        runs[donate] = losses, np.asarray(layer.w13[...])
    assert runs[True][0] == runs[False][0]
    np.testing.assert_array_equal(runs[True][1], runs[False][1])
