"""transformers' ``ExpertsInterface`` served by the layer: ``experts_implementation="epmoe"``
(``moe_torch.register_transformers``, ``moe_torch/hf_experts.py``).

- Whole models (tiny: hidden 32, 4-8 experts, two layers, float32, weights re-drawn seeded ``N(0, 1/fan_in)`` so
  that routing has no ties), one per family of :data:`FAMILIES`: built by ``from_config(...,
  experts_implementation="epmoe")``, switched with ``set_experts_implementation``. Against ``"grouped_mm"``
  (transformers' default, which runs on the CPU in torch 2.11; ``"batched_mm"`` on CUDA, :data:`REFERENCE`): logits
  within ``F32_REL_FRO``, greedy ``generate`` the same tokens, every parameter's gradient of the LM loss within
  ``GRAD_F32_REL_FRO`` (the experts', the router's through the routing weights, everything else's),
  ``save_pretrained`` + ``from_pretrained(..., experts_implementation="epmoe")`` the same logits bit for bit.
  ``routed_experts`` is counted: once per MoE layer and forward.
- The Triton kernels (``"epmoe_triton"``; Triton's interpreter on the CPU): one family, logits and gradients.
- Every experts class that the installed transformers decorates with ``@use_experts_implementation`` (read from
  its source), built alone at tiny sizes: served ones equal ``grouped_mm`` (output and every gradient, float32
  rule); the others raise ``NotImplementedError`` naming the class and the reason (:data:`REFUSED`: no gate, a
  post-expert norm, a gate function of their own). The classes' own eager loops agree with grouped_mm to ~1e-7 too
  (measured once; not re-run here, their Python loops cost ~13 s).
- transformers' ``FP8Experts`` (128x128 block codes): a float64 emulation of the layer's ``fp8_block`` (1x128
  activation groups, CONTRACT.md section 3), served through ``FP8ExpertsInterface`` in a model; what is refused.
- Expert-parallel sentinels, dtypes as grouped_mm takes them, registration, argument errors.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import moe_torch.hf_experts as hf_experts
from common import TORCH_DEVICE, needs_triton_interpreter
from moe_torch import register_transformers
from moe_torch.hf_experts import EXPERTS_IMPLEMENTATIONS, experts_forward, read_experts
from moe_torch.ops.quant.api import quantize_weight_fp8
from tolerances import BF16_REL_FRO, F32_REL_FRO, FP8_REL_FRO, GRAD_F32_REL_FRO, rel_fro

transformers = pytest.importorskip("transformers")
from transformers.integrations import moe as hf_moe  # noqa: E402

register_transformers()

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)
#: Tiny configs of the families served (and Lfm2-MoE: an ``act_fn`` that is ``F.silu`` itself). Llama 4's
#: ``Llama4TextExperts`` is not decorated in transformers 5.24 (``moe_torch.patch_hf_model`` serves its block).
FAMILIES = {
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4,
                                                  num_experts_per_tok=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, head_dim=8, intermediate_size=64,
                                                     moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                                     decoder_sparse_step=1, norm_topk_prob=True),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **dict(COMMON, num_key_value_heads=4), intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
        first_k_dense_replace=1, norm_topk_prob=True, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(**COMMON, head_dim=8, intermediate_size=64, moe_intermediate_size=16,
                                                   n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                                   n_shared_experts=1, routed_scaling_factor=2.5,
                                                   first_k_dense_replace=0, norm_topk_prob=True),
    "gpt_oss": lambda: transformers.GptOssConfig(**COMMON, head_dim=8, intermediate_size=16, num_local_experts=4,
                                                 num_experts_per_tok=2, sliding_window=4,
                                                 layer_types=["sliding_attention", "full_attention"]),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **COMMON, head_dim=8, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4),
    "lfm2_moe": lambda: transformers.Lfm2MoeConfig(**dict(COMMON, tie_word_embeddings=True), intermediate_size=64,
                                                   moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                                   num_dense_layers=1, layer_types=["conv", "full_attention"]),
}
#: MoE layers per family (routed_experts calls per forward).
MOE_LAYERS = {"mixtral": 2, "qwen3_moe": 2, "deepseek_v3": 1, "glm4_moe": 2, "gpt_oss": 2, "qwen3_next": 2,
              "lfm2_moe": 1}

#: The decorated experts classes of transformers 5.24 that are refused, and a phrase of the reason.
REFUSED = {
    "DeepseekV4Experts": "a function of its own",  # silu(min(gate, limit)) * clamp(up, +-limit)
    "Glm5NextTextExperts": "a function of its own",
    "HYV4Experts": "a function of its own",
    "HYV4VLExperts": "a function of its own",
    "Inkling2Experts": "a function of its own",  # act_fn(gate, up), soft-capped
    "Inkling2LoopExperts": "a function of its own",
    "MuseSparkExperts": "has_post_expert_norm",
    "NemotronHExperts": "not gated",
}


def _reinit_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter re-drawn seeded: norms ``1 + N(0, 0.01)``, embeddings ``N(0, 1)``, biases ``N(0, 0.01)``, the
    rest ``N(0, 1/fan_in)`` (transformers' init gives zero routers: ties)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
    return model


#: What "epmoe" is held to: transformers' default, grouped_mm (its CPU kernel in torch 2.11); on CUDA batched_mm, the
#: same computation with plain bmm in any dtype (whether torch's CUDA grouped_mm takes float32 was not checked).
REFERENCE = "grouped_mm" if TORCH_DEVICE == "cpu" else "batched_mm"
REFERENCE_FN = getattr(hf_moe, f"{REFERENCE}_experts_forward")


def _ids() -> torch.Tensor:
    return torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(1)).to(TORCH_DEVICE)


@pytest.fixture
def count_calls(monkeypatch):
    """The ``implementation`` of every ``routed_experts`` call that the ``"epmoe"`` names make."""
    calls = []
    real = hf_experts.routed_experts

    def counted(*args, **kwargs):
        calls.append(kwargs["implementation"])
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_experts, "routed_experts", counted)
    return calls


def _run(model, ids, implementation: str):
    """``(logits, {name: grad}, greedy tokens)`` of ``model`` with ``implementation``."""
    model.set_experts_implementation(implementation)
    assert model.config._experts_implementation == implementation
    model.zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    return out.logits.detach(), grads, tokens


# --- registration ---------------------------------------------------------------------------------


def test_register_transformers_is_idempotent():
    from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface

    before = {n: hf_moe.ExpertsInterface._global_mapping[n] for n in EXPERTS_IMPLEMENTATIONS}
    assert register_transformers() == tuple(EXPERTS_IMPLEMENTATIONS) == ("epmoe", "epmoe_triton", "epmoe_reference")
    for interface in (hf_moe.ExpertsInterface, FP8ExpertsInterface):
        for name in EXPERTS_IMPLEMENTATIONS:
            assert interface._global_mapping[name] is before[name] is hf_experts.INTERFACE_FUNCTIONS[name]
    assert "epmoe" in hf_moe.ALL_EXPERTS_FUNCTIONS.valid_keys()


def test_import_moe_torch_does_not_import_transformers():
    """transformers stays the caller's import: registering is explicit (``import transformers`` costs 5-12 s here)."""
    code = "import sys, moe_torch; assert 'transformers' not in sys.modules, 'imported'; print('ok')"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# --- whole models: epmoe against grouped_mm --------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_epmoe_equals_grouped_mm(family, tmp_path, count_calls):
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), experts_implementation="epmoe")
    assert model.config._experts_implementation == "epmoe"
    model = _reinit_(model).eval().to(TORCH_DEVICE)
    ids = _ids()
    ref_logits, ref_grads, ref_tokens = _run(model, ids, REFERENCE)
    assert not count_calls
    logits, grads, tokens = _run(model, ids, "epmoe")
    # once per MoE layer and forward (the loss's, generate's prefill and decode steps), each stage's default backend
    n = len(count_calls)
    assert n >= 2 * MOE_LAYERS[family] and n % MOE_LAYERS[family] == 0 and set(count_calls) == {None}, count_calls
    assert float(ref_logits.abs().mean()) > 0.1, "degenerate logits: the test would prove nothing"
    err = rel_fro(logits, ref_logits)
    assert err <= F32_REL_FRO, f"{family}: logits ||epmoe - {REFERENCE}|| / ||{REFERENCE}|| = {err:.2e}"
    assert torch.equal(tokens, ref_tokens), f"{family}: greedy tokens differ"
    assert set(grads) == set(ref_grads)
    experts = [n for n in grads if ".experts." in n]
    assert experts and all(float(grads[n].abs().max()) > 0 for n in experts)
    for name, g in grads.items():
        assert rel_fro(g, ref_grads[name]) <= GRAD_F32_REL_FRO, f"{family}: d loss / d {name}"

    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="epmoe")
    assert reloaded.config._experts_implementation == "epmoe"
    reloaded = reloaded.eval().to(TORCH_DEVICE)
    params = dict(reloaded.named_parameters())
    assert set(params) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():  # every weight survives bit for bit
        assert torch.equal(params[name], p), f"{family}: save_pretrained -> from_pretrained changed {name}"
    with torch.no_grad():
        again = reloaded(ids).logits
    # logits within the float32 row, not bit for bit: transformers' own Qwen3-Next (grouped_mm experts) differs in
    # the last bits after a reload on some CPUs, with every weight equal
    assert rel_fro(again, logits) <= F32_REL_FRO, f"{family}: save_pretrained -> from_pretrained(epmoe) changed the logits"


@needs_triton_interpreter
def test_triton_kernels_in_a_model(count_calls):
    model = _reinit_(transformers.AutoModelForCausalLM.from_config(FAMILIES["qwen3_moe"]())).eval().to(TORCH_DEVICE)
    ids = _ids()
    results = {}
    for impl in (REFERENCE, "epmoe_triton"):
        model.set_experts_implementation(impl)
        model.zero_grad()
        out = model(ids, labels=ids)
        out.loss.backward()
        results[impl] = out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    assert count_calls == ["triton", "triton"]
    (ref, ref_grads), (out, grads) = results[REFERENCE], results["epmoe_triton"]
    assert rel_fro(out, ref) <= F32_REL_FRO
    for name, g in grads.items():
        assert rel_fro(g, ref_grads[name]) <= GRAD_F32_REL_FRO, name


# --- every decorated experts class, alone -----------------------------------------------------------

#: Sizes set on each class's config before it is built (attributes it does not have are left alone).
_SIZES = dict(hidden_size=32, moe_hidden_size=32, intermediate_size=32, moe_intermediate_size=32,
              expert_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4)
#: Constructor keywords where the config's size is not a scalar (Ernie-4.5-VL's per-modality list).
_KWARGS = {"Ernie4_5_VLMoeMoeExperts": dict(intermediate_size=32)}


def decorated_experts_classes() -> list[type]:
    """Every class of the installed transformers' ``models/*/modeling_*.py`` under ``@use_experts_implementation``."""
    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    found = []
    for family in sorted(os.listdir(root)):
        path = os.path.join(root, family, f"modeling_{family}.py")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            source = f.read()
        names = re.findall(r"^@use_experts_implementation(?:\([^)]*\))?\nclass (\w+)", source, re.MULTILINE)
        if names:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
            found += [getattr(module, n) for n in names]
    return found


def _tiny_experts(cls) -> torch.nn.Module:
    """``cls`` built at :data:`_SIZES` from its config class (its ``config`` annotation, else the module's config
    classes, text configs first), weights drawn seeded."""
    module = inspect.getmodule(cls)
    annotation = inspect.signature(cls.__init__.__wrapped__).parameters["config"].annotation
    candidates = [annotation] if isinstance(annotation, type) else []
    candidates += sorted((o for o in vars(module).values() if isinstance(o, type)
                          and issubclass(o, transformers.PreTrainedConfig) and o not in candidates),
                         key=lambda o: ("Text" not in o.__name__, o.__name__))
    failures = []
    for config_class in candidates:
        try:
            config = config_class()
            for key, value in _SIZES.items():
                if hasattr(config, key) and not isinstance(getattr(config, key), list):  # Ernie-4.5-VL: a list
                    setattr(config, key, value)
            with torch.device("meta"):
                experts = cls(config, **_KWARGS.get(cls.__name__, {}))
        except Exception as exc:  # a config class of another part of the model
            failures.append(f"{config_class.__name__}: {type(exc).__name__}")
            continue
        if sum(p.numel() for p in experts.parameters()) <= 100_000:
            break
        failures.append(f"{config_class.__name__}: too large")
    else:
        raise AssertionError(f"{cls.__name__}: no config class builds it tiny: {failures}")
    g = torch.Generator().manual_seed(len(cls.__name__))
    experts = experts.to_empty(device=TORCH_DEVICE)
    with torch.no_grad():
        for p in experts.parameters():
            scale = 1 / np.sqrt(p.shape[-1]) if p.ndim > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return experts


def _experts_inputs(num_experts: int, hidden: int, T: int = 8, k: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, hidden, generator=g)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    return x.to(TORCH_DEVICE), ids.to(TORCH_DEVICE), w.to(TORCH_DEVICE)


def _forward_and_grads(fn, experts, x, ids, w):
    """``fn(experts, x, ids, w)`` and the gradients of ``<out, c>`` w.r.t. ``x``, ``w`` and every parameter."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    experts.zero_grad()
    out = fn(experts, x, ids, w)
    (out * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum().backward()
    return {"out": out.detach(), "x": x.grad, "w": w.grad, **{n: p.grad for n, p in experts.named_parameters()}}


def test_every_decorated_experts_class():
    classes = decorated_experts_classes()
    assert len(classes) >= 60, [c.__name__ for c in classes]
    refused, served = {}, []
    for cls in classes:
        experts = _tiny_experts(cls)
        try:
            read_experts(experts)
        except NotImplementedError as exc:
            refused[cls.__name__] = str(exc)
            with pytest.raises(NotImplementedError, match=cls.__name__):
                experts_forward(experts, *_experts_inputs(experts.num_experts, 32))
            continue
        served.append(cls.__name__)
        inputs = _experts_inputs(experts.num_experts, 32)
        ours = _forward_and_grads(experts_forward, experts, *inputs)
        ref = _forward_and_grads(REFERENCE_FN, experts, *inputs)
        assert set(ref) == set(ours)
        for name, t in ours.items():
            assert t is not None and float(t.abs().max()) > 0, f"{cls.__name__}: d {name} is zero"
            err = rel_fro(t, ref[name])
            assert err <= GRAD_F32_REL_FRO, f"{cls.__name__} vs {REFERENCE}: {name} {err:.2e}"
    assert set(refused) == set(REFUSED), sorted(refused)
    for name, message in refused.items():
        assert REFUSED[name] in message and "is not served" in message, message
    assert {"MixtralExperts", "Qwen3MoeExperts", "DeepseekV3Experts", "GptOssExperts", "Glm4MoeExperts",
            "Qwen3NextExperts", "OpenAIPrivacyFilterExperts", "MiniMaxM3VLExperts"} <= set(served)


def test_llama4_experts_are_not_behind_the_interface():
    """transformers 5.24's ``Llama4TextExperts`` runs its own forward whatever ``experts_implementation`` says; its
    block is ``moe_torch.patch_hf_model``'s (the error says so when the module is given directly)."""
    from transformers.models.llama4 import modeling_llama4

    assert "@use_experts_implementation" not in inspect.getsource(modeling_llama4)
    config = transformers.Llama4TextConfig(hidden_size=32, intermediate_size=16, num_local_experts=4)
    with pytest.raises(NotImplementedError, match="Llama4TextExperts.*patch_hf_model"):
        read_experts(modeling_llama4.Llama4TextExperts(config))


def test_swiglu_oai_constants_and_activations_are_checked():
    experts = _tiny_experts(transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts)
    experts.limit = 8.0
    with pytest.raises(NotImplementedError, match=r"GptOssExperts.*\(alpha, limit\) = \(1.702, 8.0\)"):
        experts_forward(experts, *_experts_inputs(4, 32))
    experts = _tiny_experts(transformers.models.mixtral.modeling_mixtral.MixtralExperts)
    experts.act_fn = torch.nn.GELU()
    with pytest.raises(NotImplementedError, match="MixtralExperts.*act_fn is GELU"):
        experts_forward(experts, *_experts_inputs(4, 32))


# --- expert parallelism, dtypes, arguments ----------------------------------------------------------


def test_expert_parallel_sentinels_add_nothing():
    """Under transformers' EP (``_is_expert_parallel``, ``num_experts`` the rank's) ids ``== num_experts`` are
    other ranks' slots: as grouped_mm, they add nothing and get no gradient."""
    experts = _tiny_experts(transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts)
    experts._is_expert_parallel = True
    x, ids, w = _experts_inputs(4, 32, T=10)
    ids[::3, 1] = 4  # a sentinel in some rows
    ids[5] = 4  # a row with no local slot
    ours = _forward_and_grads(experts_forward, experts, x, ids, w)
    ref = _forward_and_grads(REFERENCE_FN, experts, x, ids, w)
    for name, t in ours.items():
        assert rel_fro(t, ref[name]) <= GRAD_F32_REL_FRO, name
    assert float(ours["out"][5].abs().max()) == 0 and float(ours["w"][ids == 4].abs().max()) == 0


@pytest.mark.parametrize("case", ["bf16", "bf16_routing_weights", "float32_input_bf16_weights"])
def test_dtypes_as_grouped_mm(case):
    """bf16 experts; bf16 routing weights (taken in float32); float32 hidden states on bf16 weights (autocast): the
    GEMMs in the weights' dtype, the result in the hidden states' dtype, as grouped_mm."""
    experts = _tiny_experts(transformers.models.mixtral.modeling_mixtral.MixtralExperts).to(torch.bfloat16)
    x, ids, w = _experts_inputs(4, 32, T=16)
    if case != "float32_input_bf16_weights":
        x = x.to(torch.bfloat16)
    if case == "bf16_routing_weights":
        w = w.to(torch.bfloat16)
    out = experts_forward(experts, x, ids, w)
    if REFERENCE == "batched_mm" and x.dtype != torch.bfloat16:  # its torch.bmm takes one dtype: x in the weights'
        ref = REFERENCE_FN(experts, x.to(torch.bfloat16), ids, w).to(x.dtype)
    else:
        ref = REFERENCE_FN(experts, x, ids, w)
    assert out.dtype == ref.dtype == x.dtype
    experts64 = _tiny_experts(transformers.models.mixtral.modeling_mixtral.MixtralExperts)
    with torch.no_grad():
        for p64, p in zip(experts64.parameters(), experts.parameters()):
            p64.copy_(p.double())
    eager = transformers.models.mixtral.modeling_mixtral.MixtralExperts.forward.__wrapped__
    exact = eager(experts64.double(), x.to(torch.bfloat16).double(), ids, w.double())
    assert rel_fro(out, exact) <= BF16_REL_FRO and rel_fro(ref, exact) <= BF16_REL_FRO


def test_argument_errors_name_the_argument():
    experts = _tiny_experts(transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts)
    x, ids, w = _experts_inputs(4, 32)
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts.*hidden_states must be \[T, H\] with H=32; got \(1, 8, 32"):
        experts_forward(experts, x[None], ids, w)
    with pytest.raises(TypeError, match="top_k_index must be int32 / int64; got float32"):
        experts_forward(experts, x, ids.float(), w)
    with pytest.raises(ValueError, match=r"top_k_index and top_k_weights must be \[T, k\] with T=8"):
        experts_forward(experts, x, ids[:4], w[:4])
    with pytest.raises(ValueError, match="implementation"):
        experts_forward(experts, x, ids, w, implementation="cuda")
    with pytest.raises(ValueError, match=r"gate_up_proj / down_proj must be \[E, 2\*I, H\] / \[E, H, I\]"):
        experts.num_experts = 5
        experts_forward(experts, x, ids, w)


# --- transformers' FP8Experts ------------------------------------------------------------------------


def _fp8_experts(config, experts, **kwargs):
    """transformers' ``FP8Experts`` as its FP8 quantizer builds it (a subclass, so the decorator leaves transformers'
    class alone) holding the 128x128 block codes of ``experts``' float weights."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts

    cls = hf_moe.use_experts_implementation(type("FP8Experts", (FP8Experts,), {}),
                                            experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    fp8 = cls(config, **{"block_size": (128, 128), **kwargs}).to(TORCH_DEVICE)
    for name in ("gate_up_proj", "down_proj"):
        q, s = quantize_weight_fp8(getattr(experts, name).detach(), "block")
        scale = getattr(fp8, f"{name}_scale_inv")  # float32, or UE8M0 with scale_fmt="ue8m0"
        getattr(fp8, name).data, scale.data = q, s.to(scale.dtype)
    return fp8


def _fp8_block_reference(fp8, x, ids, w) -> torch.Tensor:
    """float64: x and each expert's ``a`` quantized in 1x128 groups (amax / 448 scales, e4m3 codes), the codes
    dequantized by their 128x128 block multipliers (CONTRACT.md section 3, the layer's ``fp8_block``)."""

    def groups(t):
        g = t.double().reshape(*t.shape[:-1], -1, 128)
        s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
        return ((g / s).to(torch.float8_e4m3fn).double() * s).reshape(t.shape)

    def weight(q, s):
        E, N, K = q.shape
        return (q.double().reshape(E, N // 128, 128, K // 128, 128) * s.double()[:, :, None, :, None]).reshape(E, N, K)

    w13, w2 = weight(fp8.gate_up_proj, fp8.gate_up_proj_scale_inv), weight(fp8.down_proj, fp8.down_proj_scale_inv)
    h = torch.einsum("tnk,tk->tn", w13[ids].flatten(0, 1), groups(x).repeat_interleave(ids.shape[1], 0))
    g, u = h.chunk(2, dim=-1)
    y = torch.einsum("tnk,tk->tn", w2[ids].flatten(0, 1), groups(torch.nn.functional.silu(g) * u))
    return (y.view(*ids.shape, -1) * w.double()[..., None]).sum(1)


def _fp8_model():
    config = transformers.Qwen3MoeConfig(**dict(COMMON, hidden_size=128, num_hidden_layers=1, num_attention_heads=2),
                                         head_dim=16, intermediate_size=128, moe_intermediate_size=128, num_experts=4,
                                         num_experts_per_tok=2, decoder_sparse_step=1)
    return _reinit_(transformers.Qwen3MoeForCausalLM(config)).eval().to(TORCH_DEVICE)


def test_fp8_experts_are_the_layers_fp8_block(count_calls):
    model = _fp8_model()
    block = model.model.layers[0].mlp
    fp8 = _fp8_experts(model.config, block.experts)
    assert read_experts(fp8).quant == "fp8_block"
    x, ids, w = _experts_inputs(4, 128, T=16)
    err = rel_fro(experts_forward(fp8, x, ids, w), _fp8_block_reference(fp8, x, ids, w))
    assert err <= F32_REL_FRO, f"FP8Experts vs the float64 fp8_block emulation: {err:.2e}"

    # In a model: FP8Experts dispatches through FP8ExpertsInterface, where "epmoe" is registered too.
    ids_ = _ids()
    with torch.no_grad():
        float_logits = model(ids_).logits
    block.experts = fp8
    model.set_experts_implementation("epmoe")
    out = model(ids_, labels=ids_)
    out.loss.backward()
    assert count_calls[-1:] == [None] and len(count_calls) == 2
    assert rel_fro(out.logits, float_logits) <= 2 * FP8_REL_FRO  # the activations' FP8 rounding, two GEMMs
    assert fp8.gate_up_proj.grad is None and fp8.down_proj.grad is None  # codes are frozen
    assert float(block.gate.weight.grad.abs().max()) > 0  # the router trains through the routing weights


@pytest.mark.parametrize("change, message", [
    (dict(activation_scheme="static"), "activation_scheme='static'"),
    (dict(block_size=(64, 64)), r"block_size is \(64, 64\)"),
    (dict(scale_fmt="ue8m0"), "weight scales are float8_e8m0fnu"),
])
def test_fp8_experts_refused(change, message):
    model = _fp8_model()
    fp8 = _fp8_experts(model.config, model.model.layers[0].mlp.experts, **change)
    with pytest.raises(NotImplementedError, match=f"FP8Experts.*{message}"):
        experts_forward(fp8, *_experts_inputs(4, 128))
