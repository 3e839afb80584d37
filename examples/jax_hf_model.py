"""A whole Mixtral / Qwen3-MoE / DeepSeek-V3 decoder in flax NNX with our MoE block, from a Hugging Face checkpoint.

What it is: the forward pass of transformers' ``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` and
``DeepseekV3ForCausalLM`` (transformers 5.24, ``models/*/modeling_*.py``), prefill only, in about 300
lines of JAX: token embedding; per layer an RMSNorm, self-attention (rotary GQA for Mixtral / Qwen3-MoE,
with Qwen3's per-head q/k RMSNorm; DeepSeek-V3's multi-head latent attention with its low-rank q/kv
projections and interleaved rope), a residual, an RMSNorm and the MLP (our :class:`moe_pallas.MoEBlock`
where the checkpoint has experts, a dense SwiGLU MLP where it has not: DeepSeek-V3's first
``first_k_dense_replace`` layers, Qwen3-MoE's ``mlp_only_layers``); final RMSNorm and ``lm_head`` (the
embedding when ``tie_word_embeddings``). ``tests/test_hf_jax.py`` checks its logits against the
transformers model the checkpoint was saved from (float32, relative Frobenius error <= 1e-5).

The MoE blocks come from :func:`interop.hf_jax.load_nnx_moe_block` (FP8 checkpoints stay FP8 there:
``quant='fp8_block'`` with the checkpoint's codes and 128x128 block scales); every other tensor is read
here through the library's reader of the safetensors files (FP8 ones dequantized with their
``weight_scale_inv``). ``config.json`` is read through transformers' config class of its ``model_type``, so a
key it lacks means that model's default (Mixtral's ``rms_norm_eps`` 1e-5 and ``rope_theta`` 1e6).

Precision: every float32 matmul runs at ``jax.lax.Precision.HIGHEST`` (IEEE float32 products, what
torch's float32 matmuls compute: torch keeps TF32 off by default), so a float32 model means float32 on
a GPU too, where XLA's default for float32 dots is TF32-like (10-bit mantissas: the logits were 6e-4 ..
8e-4 from transformers' on an H200). bf16 models keep the default precision (bf16 products are exact
in float32 either way). The MoE blocks do the same (``MoEBlock.router_logits``, the float32 GEMMs).

Not covered (each raises or is documented, never silently wrong): rope scaling other than
``rope_type='default'`` (DeepSeek-V3's released checkpoints use YaRN: ``NotImplementedError``), KV
caches / decoding step by step, padding masks (every sequence of the batch is full length),
``hidden_act`` other than silu.

Run::

    python examples/jax_hf_model.py CHECKPOINT_DIR [--tokens 16] [--implementation pallas_triton]

Python::

    from examples.jax_hf_model import load_model
    model = load_model("path/to/checkpoint", dtype=jnp.bfloat16)    # NNX module
    logits = nnx.jit(lambda m, ids: m(ids))(model, input_ids)       # [B, S] int32 -> [B, S, V]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere

from interop.checkpoints import CheckpointFiles  # noqa: E402
from interop.hf_jax import load_nnx_moe_block  # noqa: E402
from moe_pallas.module import MoEBlock  # noqa: E402

ARCHS = ("mixtral", "qwen3_moe", "deepseek_v3")
#: torch dtypes numpy lacks -> (the torch integer dtype of their bits, the ml_dtypes dtype they are viewed as).
_VIEWS = {"bfloat16": (torch.int16, ml_dtypes.bfloat16), "float8_e4m3fn": (torch.int8, ml_dtypes.float8_e4m3fn),
          "float8_e5m2": (torch.int8, ml_dtypes.float8_e5m2)}
FP8_BLOCK = 128


# --- reading the checkpoint --------------------------------------------------------------------------


class Checkpoint:
    """The tensors of a checkpoint folder (``model.safetensors.index.json`` or ``*.safetensors``), read on demand
    through the library's reader (:data:`interop.checkpoints.CheckpointFiles`: a missing path, a truncated or
    unreadable file and a missing key are named as ``load_moe_layer`` names them), as numpy arrays (bf16 and FP8
    through ``ml_dtypes``), and its ``config.json``."""

    def __init__(self, path: str):
        self.path = path
        self.files = CheckpointFiles(path, op="load_model")
        cfg = os.path.join(self.files.folder, "config.json")
        if not os.path.isfile(cfg):
            raise FileNotFoundError(f"load_model: no config.json in {self.files.folder!r} (the model's architecture "
                                    f"and sizes come from it; save_pretrained writes it beside the weights)")
        with open(cfg) as f:
            try:
                self.config = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"load_model: {cfg!r} is not valid JSON ({exc})") from exc
        if not isinstance(self.config, dict):
            raise ValueError(f"load_model: {cfg!r} must hold a JSON object; got {type(self.config).__name__}")

    def has(self, key: str) -> bool:
        return self.files.has(key)

    def numpy(self, key: str) -> np.ndarray:
        t = self.files.get(key, "a tensor of the model")
        name = str(t.dtype).removeprefix("torch.")
        if name in _VIEWS:  # numpy has no bf16 / FP8: the same bits, viewed as ml_dtypes'
            bits, dtype = _VIEWS[name]
            return t.view(bits).numpy().view(dtype)
        return t.numpy()

    def get(self, key: str, dtype) -> jax.Array:
        """Tensor ``key`` as a jax array of ``dtype``; an FP8 weight times its ``weight_scale_inv`` blocks."""
        a = self.numpy(key)
        if a.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
            s = self.numpy(key + "_scale_inv").astype(np.float32)  # the multiplier of each 128x128 block
            N, K = a.shape
            s = np.repeat(np.repeat(s, FP8_BLOCK, axis=0)[:N], FP8_BLOCK, axis=1)[:, :K]
            a = a.astype(np.float32) * s
        return jnp.asarray(a.astype(np.float32)).astype(dtype)


# --- layers ------------------------------------------------------------------------------------------


def matmul_precision(*operands: jax.Array):
    """``Precision.HIGHEST`` when every operand is float32 (float32 means float32 on a GPU too, where
    XLA's default for float32 dots is TF32-like), else ``None`` (the default: bf16 stays bf16)."""
    return jax.lax.Precision.HIGHEST if all(a.dtype == jnp.float32 for a in operands) else None


class Linear(nnx.Module):
    """``y = x @ weight.T (+ bias)``, ``weight [out, in]`` as transformers' ``nn.Linear`` stores it."""

    def __init__(self, ck: Checkpoint, prefix: str, dtype):
        self.weight = nnx.Param(ck.get(prefix + ".weight", dtype))
        self.bias = nnx.Param(ck.get(prefix + ".bias", dtype)) if ck.has(prefix + ".bias") else None

    def __call__(self, x):
        w = self.weight[...]
        y = jnp.matmul(x, w.T, precision=matmul_precision(x, w))
        return y if self.bias is None else y + self.bias[...]


class RMSNorm(nnx.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))`` computed in float32, rounded to ``x.dtype`` before the weight."""

    def __init__(self, ck: Checkpoint, prefix: str, eps: float, dtype):
        self.weight = nnx.Param(ck.get(prefix + ".weight", dtype))
        self.eps = eps

    def __call__(self, x):
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * h.astype(x.dtype)


class MLP(nnx.Module):
    """A dense SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, ck: Checkpoint, prefix: str, dtype):
        self.gate_proj, self.up_proj, self.down_proj = (Linear(ck, f"{prefix}.{n}", dtype)
                                                        for n in ("gate_proj", "up_proj", "down_proj"))

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions, dim: int, theta: float, dtype):
    """``cos, sin [S, dim]`` of the default rope: ``inv_freq = theta^(-2i/dim)``, angles repeated twice."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, cos, sin, interleave: bool = False):
    """``x [B, S, heads, d]``; ``cos, sin [S, d]``. ``interleave``: DeepSeek's pairs ``(x0, x1), (x2, x3)...``
    rotated and written back as ``[evens, odds]`` (transformers' ``apply_rotary_pos_emb_interleave``)."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    if not interleave:
        return x * cos + rotate_half(x) * sin
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attend(q, k, v, scaling: float, sliding_window: int | None):
    """Causal softmax attention. ``q, k [B, S, heads, dk]``, ``v [B, S, heads, dv]`` -> ``[B, S, heads * dv]``;
    scores and softmax in float32, probabilities rounded to ``q.dtype`` (transformers' eager attention)."""
    B, S = q.shape[:2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=matmul_precision(q, k),
                        preferred_element_type=jnp.float32) * scaling
    i, j = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    keep = j <= i
    if sliding_window is not None:
        keep = keep & (i - j < sliding_window)
    scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=matmul_precision(probs, v)).reshape(B, S, -1)


class GQAttention(nnx.Module):
    """Mixtral / Qwen3-MoE self-attention: rotary, grouped KV heads, Qwen3's per-head ``q_norm`` / ``k_norm``."""

    def __init__(self, ck: Checkpoint, prefix: str, spec: dict, dtype):
        c = spec
        self.num_heads, self.num_kv_heads, self.head_dim = c["num_heads"], c["num_kv_heads"], c["head_dim"]
        self.theta, self.sliding_window = c["rope_theta"], c["sliding_window"]
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (Linear(ck, f"{prefix}.{n}", dtype)
                                                              for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        qk_norm = ck.has(f"{prefix}.q_norm.weight")
        self.q_norm = RMSNorm(ck, f"{prefix}.q_norm", c["eps"], dtype) if qk_norm else None
        self.k_norm = RMSNorm(ck, f"{prefix}.k_norm", c["eps"], dtype) if qk_norm else None

    def __call__(self, x):
        B, S, _ = x.shape
        q = self.q_proj(x).reshape(B, S, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, S, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, S, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos_sin(jnp.arange(S), self.head_dim, self.theta, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        return self.o_proj(attend(q, k, v, self.head_dim ** -0.5, self.sliding_window))


class MLAttention(nnx.Module):
    """DeepSeek-V3's multi-head latent attention (``DeepseekV3Attention``): low-rank q (``q_a_proj``,
    ``q_a_layernorm``, ``q_b_proj``; or one ``q_proj``), a shared compressed kv + rope key
    (``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``), rope on ``qk_rope_head_dim`` of each head."""

    def __init__(self, ck: Checkpoint, prefix: str, spec: dict, dtype):
        c = spec
        self.num_heads, self.theta = c["num_heads"], c["rope_theta"]
        self.nope, self.rope, self.v_dim = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        self.kv_lora_rank, self.interleave = c["kv_lora_rank"], c["rope_interleave"]
        if ck.has(f"{prefix}.q_a_proj.weight"):
            self.q_proj = None
            self.q_a_proj = Linear(ck, f"{prefix}.q_a_proj", dtype)
            self.q_a_layernorm = RMSNorm(ck, f"{prefix}.q_a_layernorm", 1e-6, dtype)  # transformers: default eps here
            self.q_b_proj = Linear(ck, f"{prefix}.q_b_proj", dtype)
        else:
            self.q_proj = Linear(ck, f"{prefix}.q_proj", dtype)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_proj_with_mqa = Linear(ck, f"{prefix}.kv_a_proj_with_mqa", dtype)
        self.kv_a_layernorm = RMSNorm(ck, f"{prefix}.kv_a_layernorm", 1e-6, dtype)
        self.kv_b_proj = Linear(ck, f"{prefix}.kv_b_proj", dtype)
        self.o_proj = Linear(ck, f"{prefix}.o_proj", dtype)

    def __call__(self, x):
        B, S, _ = x.shape
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, S, self.num_heads, self.nope + self.rope)
        q_pass, q_rot = q[..., :self.nope], q[..., self.nope:]
        ckv = self.kv_a_proj_with_mqa(x)
        kv, k_rot = self.kv_a_layernorm(ckv[..., :self.kv_lora_rank]), ckv[..., self.kv_lora_rank:]
        k_rot = k_rot.reshape(B, S, 1, self.rope)
        cos, sin = rope_cos_sin(jnp.arange(S), self.rope, self.theta, x.dtype)
        q_rot, k_rot = apply_rope(q_rot, cos, sin, self.interleave), apply_rope(k_rot, cos, sin, self.interleave)
        kv = self.kv_b_proj(kv).reshape(B, S, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        q = jnp.concatenate([q_pass, q_rot], axis=-1)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot, (B, S, self.num_heads, self.rope))], axis=-1)
        return self.o_proj(attend(q, k, v, (self.nope + self.rope) ** -0.5, None))


class DecoderLayer(nnx.Module):
    """``h = x + attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))``."""

    def __init__(self, ck: Checkpoint, i: int, spec: dict, dtype, implementation):
        prefix = f"model.layers.{i}"
        attn = MLAttention if spec["arch"] == "deepseek_v3" else GQAttention
        self.self_attn = attn(ck, f"{prefix}.self_attn", spec, dtype)
        self.input_layernorm = RMSNorm(ck, f"{prefix}.input_layernorm", spec["eps"], dtype)
        self.post_attention_layernorm = RMSNorm(ck, f"{prefix}.post_attention_layernorm", spec["eps"], dtype)
        moe = spec["moe_prefix"]
        if ck.has(f"{prefix}.{moe}.gate.weight"):  # a sparse block: ours
            self.mlp = load_nnx_moe_block(ck.path, i, implementation=implementation, dtype=dtype)
        else:
            self.mlp = MLP(ck, f"{prefix}.mlp", dtype)

    def __call__(self, x):
        h = x + self.self_attn(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


class CausalLM(nnx.Module):
    """``input_ids [B, S]`` int -> ``logits [B, S, vocab]`` in the model's dtype (prefill, positions ``0..S-1``)."""

    def __init__(self, ck: Checkpoint, spec: dict, dtype, implementation):
        self.arch = spec["arch"]
        self.embed_tokens = nnx.Param(ck.get("model.embed_tokens.weight", dtype))
        self.layers = nnx.List([DecoderLayer(ck, i, spec, dtype, implementation) for i in range(spec["num_layers"])])
        self.norm = RMSNorm(ck, "model.norm", spec["eps"], dtype)
        tied = spec["tie_word_embeddings"]  # else a missing lm_head.weight raises
        self.lm_head = None if tied else nnx.Param(ck.get("lm_head.weight", dtype))

    def __call__(self, input_ids):
        h = jnp.take(self.embed_tokens[...], input_ids, axis=0)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        head = (self.embed_tokens if self.lm_head is None else self.lm_head)[...]
        return jnp.matmul(h, head.T, precision=matmul_precision(h, head))

    @property
    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoEBlock)]


def hf_config(config: dict):
    """``config.json`` as transformers' config class of its ``model_type`` reads it (``AutoConfig.for_model``): an
    absent key is that class's default, as the transformers model would see it. Raises ValueError naming the key
    transformers refuses."""
    import transformers

    arch = config.get("model_type")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' notes on keys it renames (rope_scaling ...)
            return transformers.AutoConfig.for_model(arch, **{k: v for k, v in config.items() if k != "model_type"})
    except Exception as exc:  # transformers' strict validation names the field
        raise ValueError(f"load_model: transformers' config class of model_type {arch!r} refuses config.json: "
                         f"{' '.join(str(exc).split())}") from exc


def model_spec(config: dict) -> dict:
    """The fields of ``config.json`` the forward uses, absent keys taking the model class's defaults
    (:func:`hf_config`); refuses what this example does not implement."""
    arch = config.get("model_type")
    if arch not in ARCHS:
        raise ValueError(f"load_model: model_type must be one of {ARCHS}; got {arch!r}")
    c = hf_config(config)
    if c.hidden_act != "silu":
        raise NotImplementedError(f"load_model: hidden_act {c.hidden_act!r} (silu only)")
    rope = dict(getattr(c, "rope_parameters", None) or {})  # transformers folds rope_theta / rope_scaling in here
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"load_model: rope_type {rope_type!r} (this example implements the default rope only)")
    block = (config.get("quantization_config") or {}).get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
    if list(block) != [FP8_BLOCK, FP8_BLOCK]:
        raise NotImplementedError(f"load_model: FP8 weight_block_size {block} (128x128 blocks only)")
    heads = c.num_attention_heads
    window = getattr(c, "sliding_window", None)
    if arch == "qwen3_moe" and not getattr(c, "use_sliding_window", False):
        window = None
    head_dim = None if arch == "deepseek_v3" else getattr(c, "head_dim", None)  # DeepSeek-V3: MLA's dims below
    spec = dict(arch=arch, num_layers=c.num_hidden_layers, eps=float(c.rms_norm_eps),
                num_heads=heads, num_kv_heads=c.num_key_value_heads or heads,
                head_dim=head_dim or c.hidden_size // heads, rope_theta=float(rope["rope_theta"]),
                sliding_window=window, tie_word_embeddings=bool(c.tie_word_embeddings),
                moe_prefix="block_sparse_moe" if arch == "mixtral" else "mlp")
    if arch == "deepseek_v3":
        spec.update({k: getattr(c, k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")},
                    rope_interleave=bool(getattr(c, "rope_interleave", True)))
        if spec["num_kv_heads"] != heads:
            raise NotImplementedError(f"load_model: DeepSeek-V3 attention with num_key_value_heads "
                                      f"({spec['num_kv_heads']}) != num_attention_heads ({heads})")
    return spec


def load_model(path: str, *, dtype=jnp.float32, implementation: str | None = None) -> CausalLM:
    """The decoder of the checkpoint folder ``path`` (``save_pretrained``'s output or a hub snapshot).

    Args:
      dtype: the float dtype of every float weight and of the activations (FP8 experts stay FP8;
        DeepSeek-V3's router stays float32).
      implementation: the MoE layers' backend (``None``, ``"reference"``, ``"pallas_triton"``...).

    Raises: FileNotFoundError (no such path, no ``*.safetensors``, no ``config.json``), ValueError (a truncated or
      unreadable safetensors file, a missing tensor, an unknown ``model_type``, a config.json transformers refuses),
      each naming the file or key; NotImplementedError (what the module docstring lists as not covered).
    """
    ck = Checkpoint(path)
    return CausalLM(ck, model_spec(ck.config), dtype, implementation)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--implementation", default=None)
    args = p.parse_args(argv)
    model = load_model(args.checkpoint, implementation=args.implementation)
    vocab = model.embed_tokens[...].shape[0]
    ids = jnp.asarray(np.random.default_rng(0).integers(0, vocab, size=(1, args.tokens)), jnp.int32)
    logits = nnx.jit(lambda m, ids: m(ids))(model, ids)
    print(f"{model.arch}: {len(model.layers)} layers, {len(model.moe_blocks)} with our MoE block; "
          f"logits {tuple(logits.shape)} {logits.dtype}; next tokens {np.asarray(jnp.argmax(logits[0], -1)).tolist()}")


if __name__ == "__main__":
    main()
