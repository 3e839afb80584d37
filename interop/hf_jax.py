"""A Hugging Face checkpoint's MoE block as a flax NNX module (:class:`moe_pallas.module.MoEBlock`).

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

from interop.checkpoints import load_moe_layer
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
