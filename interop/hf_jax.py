"""A Hugging Face checkpoint's MoE block as a flax NNX module (:class:`moe_pallas.module.MoEBlock`), and back:
:func:`load_nnx_moe_block` reads one, :func:`save_nnx_moe_block` writes one (the same names, bit for bit).

The reading is :func:`interop.checkpoints.load_moe_layer` (routing from ``config.json``, the router
weight, every expert, DeepSeek-V3's correction bias and shared experts, FP8 codes and block scales);
this file turns it into the NNX block, so ``moe_pallas`` itself never reads files. The JAX half of
what ``moe_torch.patch_hf_model`` does for a transformers model (``moe_torch/hf.py``); a whole model
built around it is ``examples/jax_hf_model.py``.

FP8 checkpoints stay FP8: DeepSeek-V3-style ``weight`` float8_e4m3fn + ``weight_scale_inv`` 128x128
block multipliers become a ``quant='fp8_block'`` layer holding those very codes and scales (no
dequantize-requantize round trip). Asking for another ``quant`` dequantizes them (and, for
``fp8_per_token``, requantizes per channel). gpt-oss's MXFP4 checkpoints likewise: ``*_blocks`` / ``*_scales``
become a ``quant='mxfp4'`` layer holding the file's e2m1 codes and e8m0 scales bit for bit; its router's bias is
:class:`MoEBlock`'s ``router_bias``, its expert biases the layer's ``w13_bias`` / ``w2_bias``.
"""

from __future__ import annotations

import jax.numpy as jnp

from interop.checkpoints import (_ARCHS, _FAMILY_WORDS, _ROUTING_KEYS, _SIZE_KEYS, _read_hf_config,
                                 _routing_from_config, _shared_from_config, load_moe_layer)
from moe_contract.config import FP8_BLOCK, MoEConfig
from moe_contract.validation import FLOAT_DTYPES, dtype_name
from moe_pallas.module import MoEBlock, MoELayer
from moe_pallas.ops.quant.api import dequantize_weight_fp8, dequantize_weight_mxfp4


def load_nnx_moe_block(
    path: str,
    layer: int | None = None,
    *,
    implementation: str | None = None,
    dtype=None,
    preset=None,
    **config_overrides,
) -> MoEBlock:
    """MoE layer ``layer`` of the checkpoint at ``path`` as a :class:`moe_pallas.module.MoEBlock`.

    Families (:func:`interop.checkpoints.load_moe_layer`): Mixtral, Qwen3-MoE, DeepSeek-V3 and Kimi K2 (its layout),
    GLM-4.5 (``glm4_moe``: DeepSeek-V3's routing and shared experts), Qwen3-Next (the shared expert fused, its
    ``shared_expert_gate [1, H]`` the layer's ``shared_expert_gate`` weight: ``config.shared_expert_gate``) and
    Llama 4 (sigmoid top-k on the expert input: ``config.apply_router_weight_on_input``; the shared expert fused) and
    gpt-oss (``gpt_oss``: the router's ``router.bias [E]`` the block's ``router_bias``, float32; the experts'
    ``gate_up_proj_bias [E, 2I]`` / ``down_proj_bias [E, H]`` the layer's ``w13_bias`` / ``w2_bias``,
    ``config.expert_bias``; interleaved gate/up rows, ``swiglu_oai``; MXFP4 experts as the file's codes and scales,
    ``quant='mxfp4'``, float experts transposed from ``GptOssExperts``' in-by-out layout). Its block equals
    transformers 5.24's ``GptOssMLP`` (``tests/test_hf_gpt_oss.py``).
    The block returns the hidden states only, for every family (``MoEBlock.router_logits(x)`` gives the logits that
    transformers' ``Llama4TextMoe`` returns beside them).

    Args:
      path: a ``.safetensors`` file or a checkpoint folder (``save_pretrained``'s output, a hub
        snapshot: ``model.safetensors.index.json`` or ``*.safetensors``, with ``config.json``).
      layer: the decoder layer index (default: the first layer with experts).
      implementation: the layer's backend (``None``, ``"reference"``, ``"pallas_triton"``,
        ``"pallas_mosaic_gpu"``), as :class:`moe_pallas.MoELayer` takes it.
      dtype: the float expert weights' dtype (float32 / bfloat16 / float16; the hidden states the block
        then takes for ``quant='none'``), and the router's (and Qwen3-Next's shared-expert gate's, gpt-oss's expert
        biases') for the softmax and Llama 4 families and gpt-oss; default: as the loader returns them (FP8 and
        MXFP4 experts asked for another ``quant``: dequantized exactly, float32). DeepSeek-V3's and GLM-4.5's
        routers stay float32 (transformers keeps their ``gate.weight`` in float32). gpt-oss's router bias is
        rounded to ``dtype`` (the value transformers would hold) and kept in float32.
        FP8 and MXFP4 codes are never cast.
      preset: a :class:`moe_contract.ModelPreset` giving the routing when there is no ``config.json``.
      config_overrides: :class:`moe_contract.MoEConfig` fields (``quant``, ``ep_size``, ``ep_rank``...).
        ``quant`` defaults to ``'fp8_block'`` for an FP8 checkpoint, ``'mxfp4'`` for gpt-oss's MXFP4 one,
        ``'none'`` otherwise.

    Returns: a :class:`MoEBlock`: ``block(hidden_states [B, S, H]) -> [B, S, H]`` (this EP rank's partial
    sum when ``ep_size > 1``); ``block.layer`` is the :class:`MoELayer`, ``block.config`` its config.

    Raises: FileNotFoundError / ValueError from ``load_moe_layer`` (naming the key or file); TypeError
      (``dtype`` not a float dtype); ValueError / TypeError from the config and the module's checks.
    """
    op = "load_nnx_moe_block"
    if dtype is not None:
        try:
            ok = dtype_name(dtype) in FLOAT_DTYPES
        except TypeError:
            ok = False
        if not ok:
            raise TypeError(f"{op}: dtype must be None or one of {FLOAT_DTYPES}; got dtype={dtype!r}")
        dtype = jnp.dtype(dtype_name(dtype))
    ck = load_moe_layer(path, layer)
    # quant: the checkpoint's ('fp8_block', 'mxfp4' or 'none') unless overridden
    config = ck.config(preset, **config_overrides)

    def cast(a):
        return a if dtype is None else a.astype(dtype)

    def optional(a, name):  # Qwen3-Next's shared-expert gate, gpt-oss's expert biases: None for the other families
        return None if a[name] is None else cast(a[name])

    # the checkpoint's own codes and scales (FP8 128x128 blocks, MXFP4 e8m0 groups), this rank's slice
    if (ck.is_fp8 and config.quant == "fp8_block") or (ck.is_mxfp4 and config.quant == "mxfp4"):
        a = ck.arrays("jax", config)
        moe = MoELayer(config, a["w13"], a["w2"], w13_scale=a["w13_scale"], w2_scale=a["w2_scale"],
                       w13_bias=optional(a, "w13_bias"), w2_bias=optional(a, "w2_bias"),
                       e_score_correction_bias=a["e_score_correction_bias"],
                       shared_expert_gate=optional(a, "shared_expert_gate"), implementation=implementation)
    else:  # every expert's float weights; from_float slices this rank's and quantizes per config.quant
        a = ck.arrays("jax")
        w13, w2 = a["w13"], a["w2"]
        if ck.is_fp8:
            w13 = dequantize_weight_fp8(w13, a["w13_scale"])
            w2 = dequantize_weight_fp8(w2, a["w2_scale"])
        elif ck.is_mxfp4:  # exact in float32
            w13 = dequantize_weight_mxfp4(w13, a["w13_scale"])
            w2 = dequantize_weight_mxfp4(w2, a["w2_scale"])
        moe = MoELayer.from_float(config, cast(w13), cast(w2), w13_bias=optional(a, "w13_bias"),
                                  w2_bias=optional(a, "w2_bias"), e_score_correction_bias=a["e_score_correction_bias"],
                                  shared_expert_gate=optional(a, "shared_expert_gate"), implementation=implementation)
    router = a["router_weight"]
    # DeepSeek-V3's and GLM-4.5's routers are float32 (transformers' _keep_in_fp32_modules_strict: gate.weight)
    router = router.astype(jnp.float32) if ck.e_score_correction_bias is not None else cast(router)
    # gpt-oss's GptOssTopKRouter.bias: the value transformers holds in dtype, widened to float32 (exact)
    router_bias = None if a["router_bias"] is None else cast(a["router_bias"]).astype(jnp.float32)
    return MoEBlock(router, moe, router_bias=router_bias)


#: config.json ``model_type`` -> (the arch :func:`interop.checkpoints.load_moe_layer` reads it as, the transformers
#: model class ``architectures`` names). Llama 4 is written as ``Llama4ForCausalLM.save_pretrained`` writes it
#: (``llama4_text``: the keys at the top level, not under the multimodal model's ``text_config``).
SAVE_MODEL_TYPES = {
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "kimi_k2": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "glm4_moe": ("glm4_moe", "Glm4MoeForCausalLM"),
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM"),
    "llama4_text": ("llama4", "Llama4ForCausalLM"),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
}
#: The :class:`MoEConfig` fields a checkpoint holds (through config.json and its tensors); the others (``quant``
#: aside) are how the layer computes, not what it is: pass them to :func:`load_nnx_moe_block` as overrides.
#: (What tells the families apart first, so that a refusal names it.)
_SAVED_FIELDS = ("routing", "expert_bias", "apply_router_weight_on_input", "shared_expert_gate",
                 "num_fused_shared_experts", "gate_up_layout", "activation", "renormalize", "routed_scaling_factor",
                 "num_expert_group", "topk_group", "topk", "hidden_size", "intermediate_size", "num_experts")
#: the contract's activation -> transformers' ``hidden_act`` (inverse of the loader's table)
_HIDDEN_ACT = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}
#: the checkpoint formats a block's ``quant`` is saved in (config.json ``quantization_config``)
_QUANTIZATION_CONFIGS = {
    "none": None,
    "fp8_block": {"quant_method": "fp8", "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "activation_scheme": "dynamic",
                  "fmt": "e4m3"},
    "mxfp4": {"quant_method": "mxfp4"},
}


def _alias(cls_name: str, key: str, base: dict) -> str:
    """``key``, or the ``attribute_map`` alias of it that ``base`` (the caller's config.json) spells, so that a
    conflict is seen whichever name the file uses (Qwen3-MoE's ``num_experts`` / ``num_local_experts``)."""
    import transformers

    amap = getattr(getattr(transformers, cls_name), "attribute_map", {}) or {}
    aliases = [amap.get(key)] + [a for a, c in amap.items() if c == key]
    return next((a for a in aliases if a and a in base), key)


class _CannotName(NotImplementedError):
    """A family whose checkpoint cannot hold the block; the message is the reason, without the op."""


def _block_config_json(op: str, block: MoEBlock, model_type: str, layer: int, base: dict) -> dict:
    """config.json of ``model_type`` holding ``block`` at decoder layer ``layer`` over ``base``; raises ValueError
    naming a key of ``base`` that says otherwise, :class:`_CannotName` naming what of the block the family's
    checkpoint cannot express (its config read back as :func:`load_moe_layer` reads it)."""
    arch, architecture = SAVE_MODEL_TYPES[model_type]
    c, gate = block.config, block.layer.shared_expert_gate
    if block.router_bias is not None and arch != "gpt_oss":
        raise _CannotName("a router bias (router_bias) is gpt-oss's only")
    if gate is not None and tuple(gate[...].shape) != (1, c.hidden_size):
        raise _CannotName(f"layer.shared_expert_gate must be [1, H] (Qwen3-Next's shared_expert_gate.weight); got "
                          f"{list(gate[...].shape)}: per-slot gates have no checkpoint name")
    if c.quant == "fp8_block" and _ARCHS[arch].fused_in_by_out:
        raise _CannotName("quant='fp8_block' has no checkpoint format here (fused experts in-by-out)")
    if c.quant == "mxfp4" and arch != "gpt_oss":
        raise _CannotName("quant='mxfp4' is gpt-oss's checkpoint format only")
    if c.quant == "fp8_block" and c.intermediate_size % FP8_BLOCK:
        raise _CannotName(f"FP8 block checkpoints need I % {FP8_BLOCK} == 0; got I={c.intermediate_size}")
    A = _ARCHS[arch]
    E, H, I, S = c.num_experts, c.hidden_size, c.intermediate_size, c.num_fused_shared_experts
    keys: dict = {"model_type": model_type}
    sizes = {"E": E, "H": H, "I": I}
    for what, key in _SIZE_KEYS[arch].items():
        keys[key] = sizes[what]
    for field, key in _ROUTING_KEYS[arch].items():
        value = getattr(c, field)
        if field == "activation":
            if value not in _HIDDEN_ACT:
                raise _CannotName(f"its hidden_act is one of {sorted(_HIDDEN_ACT)} (transformers' names); the block "
                                  f"has activation={value!r}")
            value = _HIDDEN_ACT[value]
        keys[key] = value
    if A.biased:  # DeepseekV3TopkRouter: sigmoid scores, noaux_tc (the loader refuses other values)
        keys.update(n_shared_experts=S, scoring_func="sigmoid", topk_method="noaux_tc")
    if arch == "qwen3_next":
        keys["shared_expert_intermediate_size"] = S * I
    quantization = _QUANTIZATION_CONFIGS[c.quant]
    if quantization is not None:
        keys["quantization_config"] = quantization
    elif "quantization_config" in base:
        raise ValueError(f"{op}: hf_config has 'quantization_config' ({base['quantization_config']!r}) but the block's "
                         f"experts are float (quant='none')")
    cls_name = A.config_class
    raw = dict(base)
    for key, value in keys.items():
        name = _alias(cls_name, key, base)
        if name in base and base[name] != value:
            raise ValueError(f"{op}: hf_config[{name!r}]={base[name]!r}, but the block has {value!r} there (a "
                             f"{model_type} config.json key the block's weights and config fix)")
        raw[name] = value
    # what transformers needs beyond the layer: enough decoder layers, and layer `layer` an MoE one
    raw.setdefault("architectures", [architecture])
    raw.setdefault("dtype", dtype_name(block.layer.w13[...]) if c.quant == "none" else "bfloat16")
    raw.setdefault("num_hidden_layers", layer + 1)
    if raw["num_hidden_layers"] <= layer:
        raise ValueError(f"{op}: hf_config['num_hidden_layers']={raw['num_hidden_layers']} has no layer {layer}; it "
                         f"must be > layer")
    if A.biased:  # DeepSeek-V3 / GLM-4.5: layers < first_k_dense_replace are dense (3 / 1 by default)
        raw.setdefault("first_k_dense_replace", layer)
        if raw["first_k_dense_replace"] > layer:
            raise ValueError(f"{op}: hf_config['first_k_dense_replace']={raw['first_k_dense_replace']} makes layer "
                             f"{layer} a dense layer in transformers; it must be <= layer")
    # read back as load_moe_layer reads it: every field the checkpoint holds must come back
    try:
        hf = _read_hf_config(arch, raw, "the config.json")
        for what, key in _SIZE_KEYS[arch].items():
            if hf.get(key) != sizes[what]:
                raise ValueError(f"config.json says {hf.words(key)} but the block has {what}={sizes[what]}")
        shared = _shared_from_config(arch, hf, I)
        read = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E,
                         num_fused_shared_experts=0 if shared is None else shared[0], **_routing_from_config(arch, hf))
    except ValueError as exc:  # transformers' config class or the contract refuses the block's values there
        raise _CannotName(f"its config.json cannot hold the block's values ({exc})") from exc
    for field in _SAVED_FIELDS:
        if getattr(read, field) != getattr(c, field):
            raise _CannotName(f"it reads back with {field}={getattr(read, field)!r} ({_FAMILY_WORDS[arch]}); the block "
                              f"has {field}={getattr(c, field)!r}")
    return raw


def _torch_cpu(a):
    """A numpy array (ml_dtypes bf16 / float8_e4m3fn included, bit for bit) as a contiguous CPU torch tensor."""
    import ml_dtypes
    import numpy as np
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return torch.from_numpy(a.copy())


def _block_tensors(c: MoEConfig, block: MoEBlock, arch: str, layer: int) -> dict:
    """The block's tensors under the fused-layout names :func:`load_moe_layer` reads (numpy)."""
    import numpy as np

    A = _ARCHS[arch]
    E, H, I, S = c.num_experts, c.hidden_size, c.intermediate_size, c.num_fused_shared_experts
    m = block.layer

    def value(v):
        return None if v is None else np.asarray(v[...])

    w13, w2, s13, s2 = value(m.w13), value(m.w2), value(m.w13_scale), value(m.w2_scale)
    pre = f"model.layers.{layer}.{A.fused_module}"
    router = value(block.router_weight)
    out = {f"{pre}.{A.router}.weight": router.astype(np.float32) if A.biased else router}  # transformers: float32
    if block.router_bias is not None:
        out[f"{pre}.{A.router}.bias"] = value(block.router_bias)
    if m.e_score_correction_bias is not None:
        out[f"{pre}.gate.e_score_correction_bias"] = value(m.e_score_correction_bias).astype(np.float32)
    gu, dn = f"{pre}.experts.gate_up_proj", f"{pre}.experts.down_proj"
    if c.quant == "mxfp4" and c.w4_layout == "mma":  # the file holds the checkpoint layout (transformers reads it)
        from moe_contract.w4_layout import mxfp4_from_mma_layout

        w13, w2 = mxfp4_from_mma_layout(w13), mxfp4_from_mma_layout(w2)
    if c.quant == "mxfp4":  # gpt-oss: the layer's [E, N, K/2] codes are the file's [E, N, K/32, 16] blocks
        out[f"{gu}_blocks"] = w13[:E].reshape(E, 2 * I, H // 32, 16)
        out[f"{gu}_scales"] = s13[:E]
        out[f"{dn}_blocks"] = w2[:E].reshape(E, H, I // 32, 16)
        out[f"{dn}_scales"] = s2[:E]
    elif A.fused_in_by_out:  # Llama 4, gpt-oss: x @ w, [E, H, 2I] / [E, I, H]
        out[gu], out[dn] = w13[:E].transpose(0, 2, 1), w2[:E].transpose(0, 2, 1)
    else:
        out[gu], out[dn] = w13[:E], w2[:E]
        if c.quant == "fp8_block":
            out[f"{gu}_scale_inv"], out[f"{dn}_scale_inv"] = s13[:E], s2[:E]
    if m.w13_bias is not None:
        out[f"{gu}_bias"], out[f"{dn}_bias"] = value(m.w13_bias)[:E], value(m.w2_bias)[:E]
    if S:  # shared expert j: rows j*I:(j+1)*I of gate_proj / up_proj, those columns of down_proj
        sh = f"{pre}.{A.shared}"
        out[f"{sh}.gate_proj.weight"] = np.concatenate([w13[e, :I] for e in range(E, E + S)])
        out[f"{sh}.up_proj.weight"] = np.concatenate([w13[e, I:] for e in range(E, E + S)])
        out[f"{sh}.down_proj.weight"] = np.concatenate([w2[e] for e in range(E, E + S)], axis=1)
        if c.quant == "fp8_block":  # 128x128 blocks: I % 128 == 0, so shared expert j owns whole scale rows
            nI = -(-I // FP8_BLOCK)
            out[f"{sh}.gate_proj.weight_scale_inv"] = np.concatenate([s13[e, :nI] for e in range(E, E + S)])
            out[f"{sh}.up_proj.weight_scale_inv"] = np.concatenate([s13[e, nI:] for e in range(E, E + S)])
            out[f"{sh}.down_proj.weight_scale_inv"] = np.concatenate([s2[e] for e in range(E, E + S)], axis=1)
    if m.shared_expert_gate is not None:
        out[f"{pre}.shared_expert_gate.weight"] = value(m.shared_expert_gate)
    return out


def save_nnx_moe_block(
    block: MoEBlock,
    path: str,
    *,
    layer: int = 0,
    model_type: str | None = None,
    hf_config: dict | None = None,
    overwrite: bool = False,
) -> str:
    """Write a :class:`moe_pallas.module.MoEBlock` as MoE layer ``layer`` of a Hugging Face checkpoint folder:
    ``path/model.safetensors`` (transformers' names, the inverse of :func:`load_nnx_moe_block`) and
    ``path/config.json`` (the family's keys: sizes, routing, shared experts, ``quantization_config``).

    Names (``L`` = ``layer``; transformers 5.24's fused layout, ``save_pretrained(save_original_format=False)``, the
    modules' own parameters, so ``hf_block.load_state_dict`` takes them with the prefix stripped):
    ``model.layers.L.mlp.gate.weight [E, H]`` (float32 for DeepSeek-V3 / Kimi K2 / GLM-4.5, as transformers keeps it),
    ``mlp.experts.gate_up_proj [E, 2*I, H]`` (``w13[:E]``), ``mlp.experts.down_proj [E, H, I]`` (``w2[:E]``);
    DeepSeek-V3 / GLM-4.5 ``mlp.gate.e_score_correction_bias [E]`` float32 and ``mlp.shared_experts.{gate_proj,
    up_proj}.weight [S*I, H]`` / ``down_proj.weight [H, S*I]`` (the ``S`` fused shared experts joined: rows
    ``j*I:(j+1)*I`` are shared expert ``j``'s); Qwen3-Next ``mlp.shared_expert.*`` and
    ``mlp.shared_expert_gate.weight [1, H]``; Llama 4 (``llama4_text``) ``model.layers.L.feed_forward.router.weight``,
    ``feed_forward.experts.gate_up_proj [E, H, 2*I]`` / ``down_proj [E, I, H]`` (in-by-out) and
    ``feed_forward.shared_expert.*`` (``S = 1``); gpt-oss ``mlp.router.weight`` / ``mlp.router.bias [E]`` (float32),
    ``mlp.experts.gate_up_proj [E, H, 2*I]`` (interleaved gate / up columns) / ``down_proj [E, I, H]``,
    ``mlp.experts.gate_up_proj_bias [E, 2*I]`` / ``down_proj_bias [E, H]``. Float tensors keep their dtype. FP8
    (``quant='fp8_block'``, DeepSeek-V3's format; not for the in-by-out families): the float8_e4m3fn codes under the
    same names, with ``experts.gate_up_proj_scale_inv [E, 2*I/128, ceil(H/128)]``, ``experts.down_proj_scale_inv``
    and ``shared_experts.*.weight_scale_inv`` (float32 multipliers; ``I % 128 == 0``). MXFP4 (gpt-oss,
    ``quant='mxfp4'``): ``experts.gate_up_proj_blocks [E, 2*I, H/32, 16]`` / ``_scales [E, 2*I, H/32]`` uint8,
    ``down_proj_blocks`` / ``_scales``, the layer's codes and e8m0 scales bit for bit (a block with
    ``w4_layout='mma'``: its codes back in the checkpoint layout, as the file format has them).

    Round trips: ``load_nnx_moe_block(path, layer)`` returns the same block (every array bit for bit, the same config
    but for the fields that say how the layer computes: ``implementation``, ``apply_routed_scaling_factor_on_output``,
    ``capacity_factor``, which :func:`load_nnx_moe_block` takes as overrides), and transformers' block of that family
    loads the tensors (``load_state_dict`` of the ``model.layers.L.mlp.`` entries, or ``from_pretrained`` of the
    folder as a model whose other weights are missing) to the same outputs.

    Args:
      block: a :class:`moe_pallas.module.MoEBlock` of the whole layer (``ep_size == 1``).
      path: a folder, created if absent.
      layer: the decoder layer index ``L`` (an int >= 0).
      model_type: the config.json ``model_type`` (:data:`SAVE_MODEL_TYPES`: ``"mixtral"``, ``"qwen3_moe"``,
        ``"deepseek_v3"``, ``"kimi_k2"``, ``"glm4_moe"``, ``"qwen3_next"``, ``"llama4_text"``, ``"gpt_oss"``); default:
        the one family that can hold the block (its config's routing, shared experts, gates and biases decide). A
        block several families hold (a softmax top-k block: Mixtral's when renormalized, or Qwen3-MoE's; a
        DeepSeek-V3 one: DeepSeek-V3's, Kimi K2's or GLM-4.5's) needs it.
      hf_config: ``None`` or a config.json dict to write the block's keys into (a model's ``config.to_dict()``: the
        attention and the other layers' keys are kept); a key that says otherwise than the block is an error.
        Without it, config.json has the family's MoE keys, ``architectures``, ``dtype`` and ``num_hidden_layers =
        layer + 1`` (DeepSeek-V3 / GLM-4.5: ``first_k_dense_replace = layer``, so that layer is a sparse one), and
        transformers' defaults stand for the rest.
      overwrite: replace an existing ``model.safetensors`` / ``config.json`` in ``path``.

    Returns: ``path``.

    Raises: TypeError (``block`` not a :class:`MoEBlock`, ``hf_config`` not a dict), ValueError (``ep_size > 1``; a bad
      ``layer``, ``model_type``; ``hf_config`` keys that disagree with the block; several families and no
      ``model_type``), NotImplementedError (a block no family's checkpoint can name: its routing, shared experts,
      gates, biases or activation, or a ``quant`` without a checkpoint format: ``fp8_per_token``, ``int4``, FP8 for the
      in-by-out families; naming the field), FileExistsError (files there and ``overwrite=False``).

    Source: the names of ``huggingface/transformers@v5.24.0:src/transformers/models/{mixtral,qwen3_moe,deepseek_v3,
    glm4_moe,qwen3_next,llama4,gpt_oss}/modeling_*.py`` (the blocks' parameters) and the keys of their
    ``configuration_*.py``, as :mod:`interop.checkpoints` reads them.
    """
    import json
    import os

    op = "save_nnx_moe_block"
    if not isinstance(block, MoEBlock):
        raise TypeError(f"{op}: block must be a moe_pallas.MoEBlock; got "
                        f"{type(block).__module__}.{type(block).__name__}")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"{op}: layer must be an int >= 0 (the decoder layer index); got layer={layer!r}")
    if hf_config is not None and not isinstance(hf_config, dict):
        raise TypeError(f"{op}: hf_config must be None or a dict (a config.json's keys); got "
                        f"{type(hf_config).__name__}")
    if model_type is not None and model_type not in SAVE_MODEL_TYPES:
        raise ValueError(f"{op}: model_type must be None or one of {tuple(SAVE_MODEL_TYPES)}; got "
                         f"model_type={model_type!r}")
    c = block.config
    if c.ep_size != 1:
        raise ValueError(f"{op}: block must hold the whole layer (ep_size=1); got ep_size={c.ep_size} (rank "
                         f"{c.ep_rank}'s experts only): gather every rank's experts into one block first")
    if c.quant not in _QUANTIZATION_CONFIGS:
        raise NotImplementedError(f"{op}: block.config.quant must be one of {tuple(_QUANTIZATION_CONFIGS)} (the "
                                  f"checkpoint formats read back: float, DeepSeek-V3's 128x128 block FP8, gpt-oss's "
                                  f"MXFP4); got quant={c.quant!r}")
    base = {} if hf_config is None else dict(hf_config)
    if model_type is None and base.get("model_type") in SAVE_MODEL_TYPES:  # the caller's model says which family
        model_type = base["model_type"]
    if model_type is not None:
        try:
            fits = {model_type: _block_config_json(op, block, model_type, layer, base)}
        except _CannotName as exc:
            raise NotImplementedError(f"{op}: a {model_type} checkpoint cannot name this block: {exc}") from None
    else:
        fits, why = {}, {}
        for name in SAVE_MODEL_TYPES:
            try:
                fits[name] = _block_config_json(op, block, name, layer, base)
            except (_CannotName, ValueError) as exc:
                why[name] = str(exc)
        if not fits:
            raise NotImplementedError(
                f"{op}: no transformers family's checkpoint can name this block ({c.routing!r} routing, "
                f"renormalize={c.renormalize}, S={c.num_fused_shared_experts} shared experts, "
                f"routed_scaling_factor={c.routed_scaling_factor}, activation={c.activation!r}, quant={c.quant!r}); "
                + "; ".join(f"{n}: {w}" for n, w in why.items()))
        if len(fits) > 1:
            raise ValueError(f"{op}: the block is a layer of each of {sorted(fits)}; pass model_type= one of them (the "
                             f"config.json model_type, which decides how transformers reads the folder)")
    (model_type, raw), = fits.items()
    arch = SAVE_MODEL_TYPES[model_type][0]
    tensors = _block_tensors(c, block, arch, layer)
    os.makedirs(path, exist_ok=True)
    targets = [os.path.join(path, n) for n in ("model.safetensors", "config.json")]
    others = sorted(n for n in os.listdir(path) if (n.endswith(".safetensors") or n == "model.safetensors.index.json")
                    and n != "model.safetensors")
    if others:  # load_moe_layer would read them with ours
        raise FileExistsError(f"{op}: {path!r} holds other checkpoint files {others}; save into an empty folder")
    if not overwrite and any(os.path.exists(t) for t in targets):
        there = [os.path.basename(t) for t in targets if os.path.exists(t)]
        raise FileExistsError(f"{op}: {path!r} already has {there}; pass overwrite=True or another folder")
    from safetensors.torch import save_file

    save_file({k: _torch_cpu(v) for k, v in tensors.items()}, targets[0], metadata={"format": "pt"})
    with open(targets[1], "w") as f:
        json.dump(raw, f, indent=2, sort_keys=True)
        f.write("\n")
    return path
