"""The layer modules: ``moe_torch.EPMoE`` (torch.nn) and ``moe_pallas.MoELayer`` (flax NNX).

Each module equals ``moe_forward`` on weights made the plain way (``make_layer_inputs`` ->
``local_weights`` -> ``quantize_layer_weights``), the two modules agree with each other within the
contract's layer tolerance, EP ranks sum to the single device, state round-trips (``state_dict``;
``nnx.split`` / ``merge`` / ``update``), the NNX layer runs under ``nnx.jit`` alone and inside a
model, bad weights raise the layer's messages, and (GPU only) ``EPMoE.forward`` is captured in a
CUDA graph.
"""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import moe_pallas
import moe_torch
from common import DEVICE, TORCH_DEVICE, both
from moe_contract import get_preset, make_layer_inputs
from moe_pallas.module import FrozenWeight, MoELayer
from moe_torch.module import EPMoE
from tolerances import BF16_REL_FRO, F32_REL_FRO, assert_exact, assert_rel_fro, to_numpy

QUANTS = ("none", "fp8_per_token", "fp8_block")
#: Every routing mode of the contract on a preset at CPU size: (preset, config overrides).
ROUTINGS = {
    # DeepSeek-V3: sigmoid + bias, 4 groups keep 2, rsf 2.5, one fused shared expert (E + S = 17)
    "biased_grouped_topk": ("tiny", {}),
    # DeepSeek-V2: softmax, group score = max, same groups and shared expert, no bias
    "grouped_topk": ("tiny", {"routing": "grouped_topk"}),
    # Mixtral: softmax top-2 of 8, no groups, no shared expert (S = 0), rsf 1
    "softmax_topk": ("mixtral-8x7b", {"hidden_size": 256, "intermediate_size": 128}),
    # Llama 4 Scout: the top-1 logit, weight sigmoid, not renormalized, one fused shared expert (E + S = 17)
    "sigmoid_topk": ("llama4-scout", {"hidden_size": 256, "intermediate_size": 128}),
}
#: What each framework calls its kernel backend.
KERNEL_BACKEND = {"jnp": "pallas_triton", "torch": "triton"}
DTYPES = {"jnp": {"bfloat16": jnp.bfloat16, "float32": jnp.float32},
          "torch": {"bfloat16": torch.bfloat16, "float32": torch.float32}}

jit_forward = jax.jit(moe_pallas.moe_forward, static_argnames=("config", "implementation"))
jit_quantize = jax.jit(moe_pallas.quantize_layer_weights, static_argnames=("config",))


@nnx.jit
def jit_call(layer, x, logits):
    return layer(x, logits)


def make_module(framework: str, preset: str, dtype: str = "bfloat16", **kw):
    """``EPMoE`` / ``MoELayer`` ``.from_preset(preset, seed=0, dtype=dtype, **kw)``."""
    if framework == "torch":
        return EPMoE.from_preset(preset, seed=0, dtype=DTYPES["torch"][dtype], device=TORCH_DEVICE, **kw)
    return MoELayer.from_preset(preset, seed=0, dtype=DTYPES["jnp"][dtype], **kw)


def call(framework: str, layer, x, logits):
    return layer(x, logits) if framework == "torch" else jit_call(layer, x, logits)


def weights(framework: str, layer) -> dict:
    """The module's tensors by name (``None`` where absent), as plain arrays."""
    names = ("w13", "w2", "w13_scale", "w2_scale", "e_score_correction_bias")
    if framework == "torch":
        return {n: getattr(layer, n) for n in names}
    return {n: None if getattr(layer, n) is None else getattr(layer, n)[...] for n in names}


def plain_weights(framework: str, config, seed: int = 0, dtype: str = "bfloat16", quantize=None) -> dict:
    """This rank's weights made without the module: ``make_layer_inputs(config, 0, seed)``, sliced, cast, quantized."""
    idx = 0 if framework == "jnp" else 1
    mod = moe_pallas if framework == "jnp" else moe_torch
    g = make_layer_inputs(config, 0, seed=seed)
    w13 = mod.local_weights(both(g.w13, dtype)[idx], config)
    w2 = mod.local_weights(both(g.w2, dtype)[idx], config)
    quantize = quantize or (jit_quantize if framework == "jnp" else mod.quantize_layer_weights)
    w13, s13, w2, s2 = quantize(w13, w2, config=config)
    bias = both(g.e_score_correction_bias)[idx] if config.routing == "biased_grouped_topk" else None
    return dict(w13=w13, w2=w2, w13_scale=s13, w2_scale=s2, e_score_correction_bias=bias)


def layer_inputs(config, T: int, dtype: str = "bfloat16", seed: int = 7):
    """``(x, router_logits)`` per framework: ``{"jnp": (...), "torch": (...)}``."""
    inputs = make_layer_inputs(config, T, seed=seed, routing="zipf")
    (jx, tx), (jl, tl) = both(inputs.x, dtype), both(inputs.router_logits)
    return {"jnp": (jx, jl), "torch": (tx, tl)}


# --- the modules against the layer function and against each other ---------------------------

MATRIX = [(r, q, 5) for r in ROUTINGS for q in QUANTS] + [
    ("biased_grouped_topk", "fp8_block", 1),  # T = 1: one token, 5 rows, most experts empty
    ("biased_grouped_topk", "none", 16),  # T = 16: M_cap = 80 rows over 17 experts
]


@pytest.mark.parametrize("routing,quant,T", MATRIX)
def test_modules_equal_moe_forward_and_each_other(routing, quant, T):
    preset, overrides = ROUTINGS[routing]
    outs = {}
    for f in ("jnp", "torch"):
        layer = make_module(f, preset, quant=quant, implementation="reference", **overrides)
        config = layer.config
        plain = plain_weights(f, config)
        held = weights(f, layer)
        for name, w in plain.items():  # from_preset draws make_layer_inputs' weights and quantizes them the same way
            assert (w is None) == (held[name] is None), name
            if w is not None:
                assert_exact(held[name], w, f"{f} {name}")
        x, logits = layer_inputs(config, T)[f]
        out = call(f, layer, x, logits)
        if f == "torch":
            ref = moe_torch.moe_forward(x, logits, config=config, implementation="reference", **plain)
        else:
            ref = jit_forward(x, logits, config=config, implementation="reference", **plain)
        assert tuple(out.shape) == (T, config.hidden_size) and to_numpy(out).dtype.name == "bfloat16"
        assert_exact(out, ref, f"{f} {routing} {quant}: module vs moe_forward")
        outs[f] = out
    assert np.abs(to_numpy(outs["torch"]).astype(np.float32)).mean() > 0.05  # a real signal
    assert_rel_fro(outs["jnp"], outs["torch"], BF16_REL_FRO, f"{routing} {quant}: MoELayer vs EPMoE")


@pytest.mark.parametrize("framework", ["jnp", "torch"])
def test_from_float_equals_quantize_layer_weights(framework):
    """``from_float`` slices this rank's experts and quantizes them in expert chunks (``quantize_weight_fp8``'s
    byte budget): bit-identical to one eager ``quantize_layer_weights`` of the slice (E_local = 9 on rank 1
    of 2, with the shared expert)."""
    config = get_preset("tiny").config(quant="fp8_block", ep_size=2, ep_rank=1)
    g = make_layer_inputs(config, 0, seed=5)
    idx = 0 if framework == "jnp" else 1
    w13, w2 = both(g.w13, "bfloat16")[idx], both(g.w2, "bfloat16")[idx]
    bias = both(g.e_score_correction_bias)[idx]
    cls = MoELayer if framework == "jnp" else EPMoE
    layer = cls.from_float(config, w13, w2, e_score_correction_bias=bias)
    mod = moe_pallas if framework == "jnp" else moe_torch
    plain = plain_weights(framework, config, seed=5, quantize=lambda a, b, config: mod.quantize_layer_weights(a, b, config))
    held = weights(framework, layer)
    assert tuple(held["w13"].shape) == (9, 256, 256)
    for name, w in plain.items():
        assert_exact(held[name], w, f"{framework} {name}")


def test_from_float_quant_none_keeps_the_dtype():
    config = get_preset("tiny").config()
    g = make_layer_inputs(config, 0, seed=0)
    for f, cls in (("jnp", MoELayer), ("torch", EPMoE)):
        idx = 0 if f == "jnp" else 1
        layer = cls.from_float(config, both(g.w13, "float32")[idx], both(g.w2, "float32")[idx],
                               e_score_correction_bias=both(g.e_score_correction_bias)[idx])
        held = weights(f, layer)
        assert to_numpy(held["w13"]).dtype.name == "float32" and held["w13_scale"] is None


@pytest.mark.parametrize("quant", QUANTS)
def test_ep_ranks_sum_to_single_device(quant):
    """Rank 0 and rank 1 of ep_size=2 (rank 1 owns the shared expert) sum to the ep_size=1 module;
    each rank holds its slice of the single-device weights (float32 weights and activations)."""
    for f in ("jnp", "torch"):
        single = make_module(f, "tiny", "float32", quant=quant, implementation="reference")
        ranks = [make_module(f, "tiny", "float32", quant=quant, ep_size=2, ep_rank=r, implementation="reference")
                 for r in range(2)]
        assert_exact(weights(f, ranks[0])["w13"], weights(f, single)["w13"][:8], f"{f} rank 0 w13")
        assert_exact(weights(f, ranks[1])["w2"], weights(f, single)["w2"][8:], f"{f} rank 1 w2")
        x, logits = layer_inputs(single.config, 7, "float32")[f]
        whole = to_numpy(call(f, single, x, logits)).astype(np.float64)
        split = sum(to_numpy(call(f, layer, x, logits)).astype(np.float64) for layer in ranks)
        assert np.abs(whole).mean() > 0.05
        assert_rel_fro(split, whole, F32_REL_FRO, f"{f} {quant}: rank 0 + rank 1 vs single device")


@pytest.mark.parametrize("framework", ["jnp", "torch"])
def test_kernel_backend_module(framework):
    """One small case with the kernel backend (interpreted on the CPU): the module equals
    ``moe_forward`` with that backend and the reference module within the kernel tolerance."""
    backend = KERNEL_BACKEND[framework]
    layer = make_module(framework, "tiny", quant="fp8_block", implementation=backend)
    ref_layer = make_module(framework, "tiny", quant="fp8_block", implementation="reference")
    x, logits = layer_inputs(layer.config, 3)[framework]
    out = call(framework, layer, x, logits)
    if framework == "torch":  # jnp: nnx.jit of the module and jit of moe_forward are one program
        w = weights(framework, layer)
        assert_exact(out, moe_torch.moe_forward(x, logits, config=layer.config, implementation=backend, **w),
                     "EPMoE vs moe_forward (triton)")
    assert np.isfinite(to_numpy(out).astype(np.float32)).all()
    assert_rel_fro(out, call(framework, ref_layer, x, logits), BF16_REL_FRO, f"{framework} {backend} vs reference")


# --- state round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("quant", QUANTS)
def test_torch_state_dict_round_trip(quant):
    a = make_module("torch", "tiny", quant=quant, implementation="reference")
    b = EPMoE.from_preset("tiny", seed=1, device=TORCH_DEVICE, quant=quant, implementation="reference")
    expected = {"w13", "w2", "e_score_correction_bias"} | ({"w13_scale", "w2_scale"} if quant != "none" else set())
    sd = a.state_dict()
    assert set(sd) == expected
    # trainable=True (default): float weights are trainable parameters; FP8 codes, scales, bias are buffers
    assert [(n, p.requires_grad) for n, p in a.named_parameters()] == ([("w13", True), ("w2", True)] if quant == "none" else [])
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, map_location=TORCH_DEVICE))
    for name in expected:
        assert_exact(getattr(b, name), getattr(a, name), name)
    assert b.w13.dtype == (torch.bfloat16 if quant == "none" else torch.float8_e4m3fn)
    x, logits = layer_inputs(a.config, 4)["torch"]
    assert_exact(b(x, logits), a(x, logits), "after load_state_dict")


@pytest.mark.parametrize("quant", QUANTS)
def test_nnx_state_round_trip(quant):
    a = make_module("jnp", "tiny", quant=quant, implementation="reference")
    b = MoELayer.from_preset("tiny", seed=1, quant=quant, implementation="reference")
    params, frozen = nnx.state(a, nnx.Param), nnx.state(a, FrozenWeight)
    float_names = {"w13", "w2"} if quant == "none" else set()
    assert set(nnx.to_pure_dict(params)) == float_names  # float weights are parameters; FP8 codes and scales are not
    assert set(nnx.to_pure_dict(frozen)) == {"e_score_correction_bias"} | (
        set() if quant == "none" else {"w13", "w2", "w13_scale", "w2_scale"})
    x, logits = layer_inputs(a.config, 4)["jnp"]
    out = jit_call(a, x, logits)
    graphdef, state = nnx.split(a)
    merged = nnx.merge(graphdef, state)
    assert merged.config == a.config and merged.implementation == "reference"
    assert_exact(jit_call(merged, x, logits), out, "after split / merge")
    nnx.update(b, nnx.state(a))
    assert_exact(b.w13[...], a.w13[...], "w13 after update")
    assert_exact(jit_call(b, x, logits), out, "after update")


# --- NNX under jit, in a model -------------------------------------------------------------------


class RouterAndMoE(nnx.Module):
    """A minimal model: a float32 ``nnx.Linear`` router ``[H] -> [E]`` feeding a :class:`MoELayer`."""

    def __init__(self, moe: MoELayer, rngs: nnx.Rngs):
        c = moe.config
        self.router = nnx.Linear(c.hidden_size, c.num_experts, use_bias=False, param_dtype=jnp.float32, rngs=rngs)
        self.moe = moe

    def __call__(self, x):
        return x + self.moe(x, self.router(x.astype(jnp.float32)))


def test_nnx_model_jitted_end_to_end():
    moe = make_module("jnp", "tiny", quant="fp8_block", implementation="reference")
    model = RouterAndMoE(moe, nnx.Rngs(0))
    x = layer_inputs(moe.config, 6)["jnp"][0]
    traces = []

    @nnx.jit
    def step(model, x):
        traces.append(1)
        return model(x)

    out = step(model, x)
    step(model, x)
    assert len(traces) == 1  # config and implementation are static: one trace
    logits = x.astype(jnp.float32) @ model.router.kernel[...]
    ref = x + jit_forward(x, logits, config=moe.config, implementation="reference", **weights("jnp", moe))
    assert_rel_fro(out, ref, BF16_REL_FRO, "model under nnx.jit vs the layer function")
    assert np.isfinite(to_numpy(out).astype(np.float32)).all()

    # Gradients reach the router through the gate weights; FP8 codes and scales are FrozenWeight, not differentiated.
    grads = nnx.jit(nnx.grad(lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)))(model, x)
    assert set(nnx.to_pure_dict(grads)) == {"router"}
    g = np.asarray(grads["router"]["kernel"][...])
    assert np.isfinite(g).all() and np.abs(g).max() > 0


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("framework", ["jnp", "torch"])
def test_bad_weights_raise_the_layers_messages(framework):
    op = "MoELayer" if framework == "jnp" else "EPMoE"
    cls = MoELayer if framework == "jnp" else EPMoE
    none = get_preset("tiny").config()
    block = none.replace(quant="fp8_block")
    w = plain_weights(framework, block)
    f = plain_weights(framework, none)
    bias = f["e_score_correction_bias"]

    with pytest.raises(ValueError) as e:  # wrong shape
        cls(none, f["w13"][:, :10], f["w2"], e_score_correction_bias=bias)
    assert str(e.value) == (f"{op}: w13 must be [E_local, 2*I, H] = (17, 256, 256) (this rank's experts); "
                            f"got w13.shape=(17, 10, 256)")
    with pytest.raises(ValueError) as e:  # global weights where the rank's are due
        cls(block.replace(ep_size=2), w["w13"], w["w2"], w13_scale=w["w13_scale"], w2_scale=w["w2_scale"],
            e_score_correction_bias=bias)
    assert str(e.value) == (f"{op}: w13 must be [E_local, 2*I, H] = (8, 256, 256) (this rank's experts); "
                            f"got w13.shape=(17, 256, 256)")
    with pytest.raises(TypeError) as e:  # FP8 codes for quant='none'
        cls(none, w["w13"], w["w2"], e_score_correction_bias=bias)
    assert str(e.value) == f"{op}: w13 must have dtype float32 or bfloat16 or float16; got w13.dtype=float8_e4m3fn"
    with pytest.raises(TypeError) as e:  # float weights for an FP8 config
        cls(block, f["w13"], f["w2"], w13_scale=w["w13_scale"], w2_scale=w["w2_scale"], e_score_correction_bias=bias)
    assert str(e.value) == f"{op}: w13 must have dtype float8_e4m3fn; got w13.dtype=bfloat16"
    with pytest.raises(TypeError) as e:  # w2 of another float dtype than w13
        w2_f32 = f["w2"].astype(jnp.float32) if framework == "jnp" else f["w2"].float()
        cls(none, f["w13"], w2_f32, e_score_correction_bias=bias)
    assert str(e.value) == f"{op}: w2 must have dtype bfloat16 (quant='none': x, w13 and w2 share one dtype); got w2.dtype=float32"
    with pytest.raises(ValueError) as e:  # missing scale
        cls(block, w["w13"], w["w2"], w2_scale=w["w2_scale"], e_score_correction_bias=bias)
    assert str(e.value) == f"{op}: w13_scale must be given for quant='fp8_block'; got None"
    with pytest.raises(ValueError) as e:  # per-channel scales for block quant
        pc = plain_weights(framework, none.replace(quant="fp8_per_token"))
        cls(block, pc["w13"], pc["w2"], w13_scale=pc["w13_scale"], w2_scale=pc["w2_scale"], e_score_correction_bias=bias)
    assert str(e.value) == (f"{op}: w13_scale must be 128x128 block scales [E_local, ceil(N/128), ceil(K/128)] for "
                            f"quant='fp8_block'; got w13_scale.shape=(17, 256)")
    with pytest.raises(ValueError) as e:  # missing bias for biased_grouped_topk
        cls(none, f["w13"], f["w2"])
    assert str(e.value) == (f"{op}: e_score_correction_bias must be given ([E=16] float) for "
                            f"routing='biased_grouped_topk'; got None")
    with pytest.raises(ValueError) as e:
        cls(none, f["w13"], f["w2"], e_score_correction_bias=bias, implementation="cuda")
    impls = (None, *(moe_pallas.layer if framework == "jnp" else moe_torch.layer).LAYER_IMPLEMENTATIONS)
    assert str(e.value) == f"{op}: implementation must be one of {impls}; got implementation='cuda'"
    with pytest.raises(TypeError) as e:  # another framework's array
        cls(none, torch.zeros(17, 256, 256) if framework == "jnp" else np.zeros((17, 256, 256), np.float32), f["w2"],
            e_score_correction_bias=bias)
    if framework == "torch":
        assert str(e.value) == "EPMoE: w13 must be a torch.Tensor (moe_torch is the PyTorch backend); got numpy.ndarray"
    else:
        assert str(e.value) == "MoELayer: w13 must be a jax array (moe_pallas is the JAX backend); got torch.Tensor"
    with pytest.raises(ValueError) as e:  # from_float takes every expert
        cls.from_float(block.replace(ep_size=2), f["w13"][:8], f["w2"][:8], e_score_correction_bias=bias)
    assert str(e.value) == (f"{op}.from_float: w13 must be [E + S, 2*I, H] = (17, 256, 256) (every expert of the "
                            f"layer); got w13.shape=(8, 256, 256)")
    with pytest.raises(ValueError) as e:
        cls.from_preset("tiny-v9")
    assert str(e.value).startswith("get_preset: name must be one of (")
    with pytest.raises(TypeError) as e:
        cls.from_preset("tiny", dtype="int8")
    assert str(e.value).startswith(f"{op}.from_preset: dtype must be a ")
    # the forward's own checks: x must have the weights' dtype for quant='none'
    layer = cls(none, f["w13"], f["w2"], e_score_correction_bias=bias, implementation="reference")
    x, logits = layer_inputs(none, 2, "float32")[framework]
    with pytest.raises(TypeError) as e:
        layer(x, logits)
    assert str(e.value) == f"{op}: x must have the layer's dtype bfloat16 (quant='none'); got x.dtype=float32"
    with pytest.raises(ValueError) as e:  # [B, S, H] is the block's input, named as the module's error
        layer(x.reshape(1, *x.shape), logits)
    block_cls = "moe_pallas.MoEBlock" if framework == "jnp" else "moe_torch.MoEBlock"
    assert str(e.value) == (f"{op}: x must be [T, H] (tokens flattened; {block_cls} takes [B, S, H]); "
                            f"got x of shape (1, {x.shape[0]}, {x.shape[1]})")


def test_nnx_module_refuses_numpy_inputs():
    """Each module takes its own framework's arrays only. ``MoELayer(x, router_logits)`` and
    ``MoEBlock(hidden_states)`` with a numpy array raise a TypeError naming ``jnp.asarray`` (before,
    ``MoELayer`` silently converted numpy); the jax arrays themselves still work."""
    from moe_pallas.module import MoEBlock

    layer = make_module("jnp", "tiny", quant="none", implementation="reference")
    x, logits = layer_inputs(layer.config, 3)["jnp"]
    with pytest.raises(TypeError) as e:
        layer(np.asarray(x), logits)
    assert str(e.value) == ("MoELayer: x must be a jax array (modules take their framework's arrays only); "
                            "got numpy.ndarray: pass jnp.asarray(x)")
    with pytest.raises(TypeError) as e:
        layer(x, np.asarray(logits))
    assert str(e.value) == ("MoELayer: router_logits must be a jax array (modules take their framework's arrays "
                            "only); got numpy.ndarray: pass jnp.asarray(router_logits)")
    with pytest.raises(TypeError) as e:  # another framework's array: the usual message
        layer(x, torch.zeros(3, 16))
    assert str(e.value) == "MoELayer: router_logits must be a jax array (moe_pallas is the JAX backend); got torch.Tensor"
    block = MoEBlock(jnp.asarray(np.random.default_rng(0).standard_normal((16, 256)), jnp.float32), layer)
    with pytest.raises(TypeError) as e:
        block(np.asarray(x)[None])
    assert str(e.value) == ("MoEBlock: hidden_states must be a jax array (modules take their framework's arrays "
                            "only); got numpy.ndarray: pass jnp.asarray(hidden_states)")
    assert layer(x, logits).shape == (3, 256) and block(x[None]).shape == (1, 3, 256)
    assert_exact(block(x), block(x[None])[0], "MoEBlock: [T, H] and [B, S, H] hidden states")


# --- CUDA graph capture (GPU machine only) -------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available() or DEVICE != "gpu",
                    reason="CUDA graphs need a GPU and compiled kernels (EPMOE_TEST_DEVICE=gpu)")
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("implementation", ["triton", None])
@pytest.mark.parametrize("quant", QUANTS)
def test_cuda_graph_capture(quant, implementation, grad):
    """``EPMoE.forward`` captured in a CUDA graph (no host sync on the Triton path), replayed on new
    inputs copied into the static buffers: bit-identical to the eager call. ``no_grad``: inference
    capture, as a user captures decode (the plain stages). ``grad``: grad mode on, so the trainable
    (default) bf16 layer's forward is ``_MoELayerFunction``'s, which must stay capturable too (FP8 codes
    are frozen buffers: the plain stages either way)."""
    layer = EPMoE.from_preset("tiny", seed=0, device="cuda", quant=quant, implementation=implementation)
    assert layer.trainable == (quant == "none")
    first, second = layer_inputs(layer.config, 24, seed=1)["torch"], layer_inputs(layer.config, 24, seed=2)["torch"]
    static_x, static_logits = first[0].clone(), first[1].clone()
    with torch.set_grad_enabled(grad):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture: compiles the Triton kernels
            for _ in range(2):
                layer(static_x, static_logits)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_x, static_logits)
        assert static_out.requires_grad == (grad and layer.trainable)  # the autograd.Function was captured
        for x, logits in (second, first):
            static_x.copy_(x)
            static_logits.copy_(logits)
            graph.replay()
            torch.cuda.synchronize()
            assert_exact(static_out, layer(x, logits), f"{quant} {implementation} grad={grad}: graph replay vs eager")
