"""One MoE layer's weights from a Hugging Face safetensors checkpoint, in the layout both backends take.

Checkpoint names (``L`` the layer, ``i`` the expert; an optional leading ``model.``), in the two layouts
transformers 5.24 writes:

- **per expert** (the hub's files, and ``save_pretrained``'s default ``save_original_format=True``):
  Mixtral (``model_type="mixtral"``) ``model.layers.L.block_sparse_moe.experts.i.{w1,w3,w2}.weight``
  (``w1`` gate ``[I, H]``, ``w3`` up ``[I, H]``, ``w2`` down ``[H, I]``), router
  ``model.layers.L.block_sparse_moe.gate.weight [E, H]``; Qwen3-MoE (``"qwen3_moe"``) and DeepSeek-V3
  (``"deepseek_v3"``) ``model.layers.L.mlp.experts.i.{gate_proj,up_proj,down_proj}.weight``, router
  ``mlp.gate.weight``.
- **fused** (``save_pretrained(save_original_format=False)``: the modules' own parameters, for every
  family under ``mlp``): ``model.layers.L.mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first) and
  ``mlp.experts.down_proj [E, H, I]``, router ``mlp.gate.weight``.

DeepSeek-V3 adds ``mlp.gate.e_score_correction_bias [E]`` and the shared experts
``mlp.shared_experts.{gate_proj,up_proj,down_proj}.weight`` (intermediate ``S * I``, ``S`` =
``n_shared_experts``). **FP8** (DeepSeek-V3's format, transformers' ``FineGrainedFP8Config``,
``quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}``): every expert
projection is float8_e4m3fn with a ``weight_scale_inv [ceil(N/128), ceil(K/128)]`` beside it (fused:
``gate_up_proj_scale_inv [E, ceil(2I/128), ceil(H/128)]``, ``down_proj_scale_inv``). Despite its name
it is the dequantization *multiplier* (``w ~= q * scale`` per 128x128 block): exactly the block
``w_scale`` of CONTRACT.md section 3.

The 2026 families, read by the same rules (``arch`` in brackets; config.json ``model_type``):

- **GLM-4.5 / GLM-4.5-Air** (``glm4_moe``): DeepSeek-V3's names and router (``mlp.gate.weight`` float32,
  ``mlp.gate.e_score_correction_bias``, ``mlp.shared_experts.*``), config class ``Glm4MoeConfig``.
- **Kimi K2** (``deepseek_v3``; ``model_type="kimi_k2"``): DeepSeek-V3's checkpoint format exactly (its
  config.json names ``"architectures": ["DeepseekV3ForCausalLM"]``, and the released files are 128x128 block
  FP8). transformers 5.24 has no ``kimi_k2`` config class (it knows ``kimi_k25``, whose text model is a
  ``deepseek_v3`` config), so its config.json is read through ``DeepseekV3Config``: the keys are DeepSeek-V3's
  (``n_group`` 1, ``topk_group`` 1, ``routed_scaling_factor`` 2.827, ``scoring_func`` "sigmoid", ``topk_method``
  "noaux_tc"); :attr:`MoECheckpointLayer.model_type` keeps ``"kimi_k2"``.
- **Qwen3-Next** (``qwen3_next``): Qwen3-MoE's per-expert names, plus the shared expert
  ``mlp.shared_expert.{gate_proj,up_proj,down_proj}.weight`` (intermediate ``shared_expert_intermediate_size``,
  ``S`` times ``I``) and its gate ``mlp.shared_expert_gate.weight [1, H]`` (:attr:`MoECheckpointLayer.shared_expert_gate`;
  the layer's ``config.shared_expert_gate``). Multi-token-prediction weights (``mtp.*``) are not decoder layers.
- **Llama 4** (``llama4``; ``model_type="llama4"`` with the text model's keys under ``text_config``, as the hub's
  Scout / Maverick, or ``"llama4_text"``, as ``Llama4ForCausalLM.save_pretrained`` writes): the module is
  ``feed_forward``, the experts are fused and stored in-by-out, ``feed_forward.experts.gate_up_proj [E, H, 2I]``
  (gate columns first) and ``feed_forward.experts.down_proj [E, I, H]`` (transposed here: ``w13[e] =
  gate_up_proj[e].T``, ``w2[e] = down_proj[e].T``), the router ``feed_forward.router.weight [E, H]``, one shared
  expert ``feed_forward.shared_expert.{gate_proj,up_proj,down_proj}.weight`` (intermediate ``I``); the
  multimodal checkpoint's names start ``language_model.model.layers.L``. Per-expert names
  (``feed_forward.experts.i.{gate_proj,up_proj,down_proj}.weight``) are read too. The routing is sigmoid top-k
  with the router weight on the expert input (``apply_router_weight_on_input``); Maverick's dense layers
  (``feed_forward.{gate,up,down}_proj``) have no experts and are not MoE layers.
- **gpt-oss** (``gpt_oss``; read by ``_load_gpt_oss``): ``mlp.router.weight [E, H]`` and ``mlp.router.bias [E]``
  (:attr:`MoECheckpointLayer.router_bias`: the logits are ``x @ W.T + b``), ``mlp.experts.gate_up_proj_bias [E, 2I]``
  / ``mlp.experts.down_proj_bias [E, H]`` (``w13_bias`` / ``w2_bias``), and the experts either as the released
  MXFP4 (``quantization_config.quant_method="mxfp4"``) ``mlp.experts.gate_up_proj_blocks [E, 2I, H/32, 16]`` uint8 /
  ``_scales [E, 2I, H/32]`` uint8 e8m0 and ``down_proj_blocks [E, H, I/32, 16]`` / ``_scales [E, H, I/32]`` -- the
  layer's ``quant="mxfp4"`` codes ``[E, N, K/2]`` reshaped and scales as stored, bit for bit (CONTRACT.md section 9;
  transformers' ``convert_moe_packed_tensors`` dequantizes them to the transpose of ours) -- or as float
  ``mlp.experts.gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]`` (``GptOssExperts``' in-by-out, transposed here;
  gate / up interleaved, kept: ``gate_up_layout="interleaved"``). Routing softmax top-k renormalized,
  ``swiglu_oai`` (config.json's ``swiglu_alpha`` 1.702 / ``swiglu_limit`` 7.0 checked), ``expert_bias``.

Assembled (torch CPU tensors **in the checkpoint's dtype**: bf16 stays bf16, FP8 codes float8_e4m3fn):
``w13 = concat(gate, up) along N -> [E + S, 2I, H]``, ``w2 [E + S, H, I]``, block scales float32
``w13_scale [E + S, 2 * ceil(I/128), ceil(H/128)]`` (gate blocks, then up blocks: needs ``I % 128 == 0``),
``w2_scale [E + S, ceil(H/128), ceil(I/128)]``, ``router_weight [E, H]`` (its own dtype: DeepSeek-V3
and GLM-4.5 keep it float32), ``e_score_correction_bias [E]`` float32, Qwen3-Next's ``shared_expert_gate [1, H]``
(its own dtype). The ``S`` shared experts become the fused
shared experts ``E .. E + S - 1`` of the contract, the ``S * I`` intermediate split into ``S`` experts
of ``I`` (the MLP is a sum over intermediate chunks, so this is exact).

Routing: ``config.json`` beside the weights, read through the pinned transformers' config class
(``MixtralConfig``, ``Qwen3MoeConfig``, ``DeepseekV3Config``, ``Glm4MoeConfig``, ``Qwen3NextConfig``,
``Llama4TextConfig``), so an absent key means what transformers
means by it (Qwen3-MoE ``norm_topk_prob`` False, DeepSeek-V3 ``routed_scaling_factor`` 2.5, ``n_group``
8, ``n_shared_experts`` 1, ...). Reading a config.json needs transformers (the ``test`` extra); without
a config.json the routing must come from a preset. Every error names the key, the file and what came.

Files: one ``.safetensors`` file, or a folder with ``model.safetensors.index.json`` (its
``weight_map``) or with ``*.safetensors`` files. Non-finite weights are refused (``ValueError`` naming
each tensor and its NaN / inf count) unless ``allow_nonfinite=True``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings

import numpy as np

from moe_contract.config import FP8_BLOCK, MoEConfig

ARCHS = ("mixtral", "qwen3_moe", "deepseek_v3", "glm4_moe", "qwen3_next", "llama4", "gpt_oss")
#: config.json ``model_type`` -> the arch its tensors are read as.
MODEL_TYPES = {
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",  # Kimi K2: DeepseekV3ForCausalLM's checkpoints; transformers 5.24 has no kimi_k2 class
    "glm4_moe": "glm4_moe",
    "qwen3_next": "qwen3_next",
    "llama4": "llama4",  # the hub's Llama 4 (multimodal): the text model's keys under text_config
    "llama4_text": "llama4",  # Llama4ForCausalLM.save_pretrained
    "gpt_oss": "gpt_oss",
}


@dataclasses.dataclass(frozen=True)
class _Arch:
    """Where one arch keeps its MoE layer's tensors, and what its layer computes beyond its routing."""

    module: str  # the MoE module under the decoder layer (per-expert layout)
    projections: tuple[str, str, str]  # the per-expert gate / up / down projection names
    router: str = "gate"  # the router module under the MoE module
    shared: str | None = None  # the shared-expert MLP module
    biased: bool = False  # the router has an e_score_correction_bias [E] (biased grouped top-k)
    shared_gate: bool = False  # Qwen3-Next: shared_expert_gate.weight [1, H] scales the shared MLP's output
    fused_module: str = "mlp"  # the fused layout's module (transformers 5.x renames Mixtral's block_sparse_moe)
    fused_in_by_out: bool = False  # Llama 4: fused experts [E, H, 2I] / [E, I, H] (x @ w), not [E, 2I, H] / [E, H, I]
    config_class: str = ""  # the transformers config class whose defaults an absent config.json key takes


_GUD = ("gate_proj", "up_proj", "down_proj")
_ARCHS = {
    "mixtral": _Arch("block_sparse_moe", ("w1", "w3", "w2"), config_class="MixtralConfig"),
    "qwen3_moe": _Arch("mlp", _GUD, config_class="Qwen3MoeConfig"),
    "deepseek_v3": _Arch("mlp", _GUD, shared="shared_experts", biased=True, config_class="DeepseekV3Config"),
    "glm4_moe": _Arch("mlp", _GUD, shared="shared_experts", biased=True, config_class="Glm4MoeConfig"),
    "qwen3_next": _Arch("mlp", _GUD, shared="shared_expert", shared_gate=True, config_class="Qwen3NextConfig"),
    "llama4": _Arch("feed_forward", _GUD, router="router", shared="shared_expert", fused_module="feed_forward",
                    fused_in_by_out=True, config_class="Llama4TextConfig"),
    # gpt-oss: fused experts only, read by _load_gpt_oss (MXFP4 blocks / scales or float, biases, a biased router)
    "gpt_oss": _Arch("mlp", _GUD, router="router", fused_in_by_out=True, config_class="GptOssConfig"),
}
#: arch -> the layer its tensors are read as (the routing family a preset for it must have).
_FAMILY_WORDS = {
    "mixtral": "softmax top-k routing with gate/up rows concatenated",
    "qwen3_moe": "softmax top-k routing with gate/up rows concatenated",
    "deepseek_v3": "biased grouped top-k routing with gate/up rows concatenated",
    "glm4_moe": "biased grouped top-k routing with gate/up rows concatenated",
    "qwen3_next": "softmax top-k routing with a sigmoid-gated shared expert (shared_expert_gate)",
    "llama4": "sigmoid top-k routing with the router weight on the expert input (apply_router_weight_on_input)",
    "gpt_oss": "softmax top-k routing (a router with a bias), swiglu_oai on interleaved gate/up rows, expert biases",
}
#: transformers' ``hidden_act`` names -> the contract's activation (both gelu names are the tanh formula).
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
#: A decoder layer's MoE module key: ``[language_model.][model.]layers.L.<module>.<rest>`` (the multimodal Llama 4's
#: text model is ``language_model.model``; transformers 5's VLMs name it ``model.language_model``).
_LAYER_KEY = re.compile(r"^(?P<pre>(?:(?:language_model|model)\.){0,2}layers\.(?P<L>\d+)\."
                        r"(?P<module>block_sparse_moe|mlp|feed_forward))\.(?P<rest>.+)$")
_FLOAT_DTYPES = ("bfloat16", "float16", "float32")
#: safetensors' dtype names -> torch's
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
                       "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "I8": "int8", "U8": "uint8", "I16": "int16",
                       "I32": "int32", "I64": "int64", "BOOL": "bool"}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


class _Files:
    """key -> file over one file, an index, or a folder of ``*.safetensors``; tensors read on demand (torch).
    ``op`` starts every message (the reader of ``examples/jax_hf_model.py`` is ``load_model``)."""

    def __init__(self, path: str, op: str = "load_moe_layer"):
        self.op = op
        if not os.path.exists(path):
            raise FileNotFoundError(f"{self.op}: path {path!r} does not exist")
        self.folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    try:
                        weight_map = json.load(f)["weight_map"]
                    except (json.JSONDecodeError, KeyError, TypeError) as exc:
                        raise ValueError(f"{self.op}: {index!r} is not a safetensors index with a 'weight_map' "
                                         f"({exc!r})") from exc
                self.where = {k: os.path.join(path, v) for k, v in weight_map.items()}
            else:
                files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
                if not files:
                    raise FileNotFoundError(f"{self.op}: no *.safetensors file and no model.safetensors.index.json "
                                            f"in {path!r}")
                self.where = {k: fn for fn in files for k in self._keys(fn, op)}
        else:
            self.where = {k: path for k in self._keys(path, op)}
        self._open: dict = {}

    @staticmethod
    def _keys(fn: str, op: str) -> list[str]:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(fn, framework="pt") as f:
                return list(f.keys())
        except SafetensorError as exc:
            raise ValueError(f"{op}: {fn!r} is not a readable safetensors file ({exc})") from exc

    def has(self, key: str) -> bool:
        return key in self.where

    def _file(self, key: str, what: str):
        if key not in self.where:
            raise ValueError(f"{self.op}: missing key {key!r} ({what}) in {self.folder!r}")
        from safetensors import safe_open

        fn = self.where[key]
        if not os.path.exists(fn):
            raise FileNotFoundError(f"{self.op}: {fn!r} (listed for {key!r} in the index) does not exist")
        if fn not in self._open:
            from safetensors import SafetensorError

            try:  # an index's shards are opened only here: a truncated one is named as the folder's files are
                self._open[fn] = safe_open(fn, framework="pt")
            except SafetensorError as exc:
                raise ValueError(f"{self.op}: {fn!r} is not a readable safetensors file ({exc})") from exc
        return self._open[fn]

    def get(self, key: str, what: str):
        """The tensor ``key`` as a torch CPU tensor, in its stored dtype."""
        return self._file(key, what).get_tensor(key)

    def info(self, key: str, what: str) -> tuple[tuple[int, ...], str]:
        """``(shape, dtype name)`` of ``key`` without reading it (``"bfloat16"``, ``"float8_e4m3fn"``, ...)."""
        sl = self._file(key, what).get_slice(key)
        return tuple(sl.get_shape()), _SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype().lower())


#: The reader of a checkpoint's tensors (one file, an index, or a folder of ``*.safetensors``), for code that reads
#: more of a model than its MoE layers (``examples/jax_hf_model.py``): the same files, the same messages.
CheckpointFiles = _Files


# --------------------------------------------------------------------------------------
# config.json, read as transformers reads it


@dataclasses.dataclass
class _HFConfig:
    """config.json through transformers' config class: values, and which keys were absent."""

    path: str
    raw: dict
    cls_name: str
    obj: object

    def present(self, key: str) -> bool:
        amap = getattr(type(self.obj), "attribute_map", {}) or {}
        names = {key, amap.get(key)} | {a for a, c in amap.items() if c == key}
        return any(n in self.raw for n in names if n)

    def get(self, key: str):
        return getattr(self.obj, key)

    def file_key(self, key: str) -> str:
        """The name config.json gives ``key``: transformers' attribute or its ``attribute_map`` alias, whichever the
        file has (Qwen3-MoE's ``num_experts`` is written ``num_local_experts`` by ``save_pretrained``), so a message
        names what the user finds in the file."""
        if key in self.raw:
            return key
        amap = getattr(type(self.obj), "attribute_map", {}) or {}
        aliases = [amap.get(key)] + [a for a, c in amap.items() if c == key]
        return next((a for a in aliases if a and a in self.raw), key)

    def words(self, key: str) -> str:
        """``'n_group'=8 (absent from config.json: DeepseekV3Config's default)``, the key as config.json spells it."""
        value = self.get(key)
        return f"{self.file_key(key)!r}={value!r}" + ("" if self.present(key) else
                                                     f" (absent from config.json: {self.cls_name}'s default)")


def _read_hf_config(arch: str, raw: dict, path: str) -> _HFConfig:
    name = _ARCHS[arch].config_class
    try:
        import transformers
    except ImportError as exc:  # a test extra: needed here only
        raise ImportError(f"load_moe_layer: reading {path!r} needs transformers (an absent key means what "
                          f"transformers' {name} means by it): pip install transformers==5.24.0 (the 'test' extra)") from exc
    if raw.get("model_type") == "llama4":  # Llama4Config: the text model's keys are text_config's
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"load_moe_layer: {path!r} (model_type 'llama4') must have a 'text_config' object (the "
                             f"text model's keys, read through transformers' {name}); got "
                             f"{'no text_config' if text is None else repr(text)[:80]}")
        raw, path = text, f"{path}: text_config"
    cls = getattr(transformers, name)
    kwargs = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = cls(**kwargs)
    except Exception as exc:  # transformers' strict dataclass validation names the field
        raise ValueError(f"load_moe_layer: transformers' {name} refuses {path!r}: {' '.join(str(exc).split())}") from exc
    return _HFConfig(path=path, raw=raw, cls_name=name, obj=obj)


#: arch -> MoEConfig field -> config.json key (the routing; sizes are checked against the tensors).
_ROUTING_KEYS = {
    "mixtral": {"topk": "num_experts_per_tok", "activation": "hidden_act"},
    "qwen3_moe": {"topk": "num_experts_per_tok", "renormalize": "norm_topk_prob", "activation": "hidden_act"},
    "deepseek_v3": {"topk": "num_experts_per_tok", "renormalize": "norm_topk_prob", "num_expert_group": "n_group",
                    "topk_group": "topk_group", "routed_scaling_factor": "routed_scaling_factor",
                    "activation": "hidden_act"},
    "qwen3_next": {"topk": "num_experts_per_tok", "renormalize": "norm_topk_prob", "activation": "hidden_act"},
    "llama4": {"topk": "num_experts_per_tok", "activation": "hidden_act"},
    "gpt_oss": {"topk": "num_experts_per_tok"},  # the activation is GptOssExperts' swiglu (checked: alpha, limit)
}
_ROUTING_KEYS["glm4_moe"] = _ROUTING_KEYS["deepseek_v3"]  # Glm4MoeTopkRouter is DeepseekV3TopkRouter
#: arch -> tensor size -> config.json key
_SIZE_KEYS = {
    "mixtral": {"E": "num_local_experts", "H": "hidden_size", "I": "intermediate_size"},
    "qwen3_moe": {"E": "num_experts", "H": "hidden_size", "I": "moe_intermediate_size"},
    "deepseek_v3": {"E": "n_routed_experts", "H": "hidden_size", "I": "moe_intermediate_size"},
    "glm4_moe": {"E": "n_routed_experts", "H": "hidden_size", "I": "moe_intermediate_size"},
    "qwen3_next": {"E": "num_experts", "H": "hidden_size", "I": "moe_intermediate_size"},
    "llama4": {"E": "num_local_experts", "H": "hidden_size", "I": "intermediate_size"},  # Llama4TextExperts.expert_dim
    "gpt_oss": {"E": "num_local_experts", "H": "hidden_size", "I": "intermediate_size"},
}
#: gpt-oss's swiglu constants (GptOssConfig swiglu_alpha, swiglu_limit) that the contract's swiglu_oai computes.
_SWIGLU_OAI = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def _routing_from_config(arch: str, hf: _HFConfig) -> dict:
    """MoEConfig routing fields from config.json (module docstring); raises naming the key."""
    keys = _ROUTING_KEYS[arch]
    fields = {"routing": "softmax_topk", "renormalize": True}  # Mixtral's router always renormalizes
    if _ARCHS[arch].biased:
        fields["routing"] = "biased_grouped_topk"
        # transformers' DeepseekV3TopkRouter (and GLM's copy) is sigmoid + noaux_tc whatever these say; refuse others
        for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if key in hf.raw and hf.raw[key] != want:
                raise ValueError(f"load_moe_layer: {hf.path!r} key {key!r} must be {want!r} (DeepSeek-V3's router: "
                                 f"sigmoid scores, biased grouped top-k); got {hf.raw[key]!r}")
    if arch == "qwen3_next":
        fields["shared_expert_gate"] = True  # Qwen3NextSparseMoeBlock: sigmoid(x @ shared_expert_gate.T) * shared
    if arch == "llama4":  # Llama4Router: top-k of the logits, sigmoid of the chosen, no renormalization
        fields.update(routing="sigmoid_topk", renormalize=False, apply_router_weight_on_input=True)
    if arch == "gpt_oss":  # GptOssTopKRouter: softmax of the top-k logits (= renormalized); GptOssExperts' swiglu
        for key, want in _SWIGLU_OAI.items():
            if hf.get(key) != want:
                raise ValueError(f"load_moe_layer: {hf.path!r} key {key!r} must be {want} (the contract's swiglu_oai); "
                                 f"got {hf.words(key)}")
        fields.update(activation="swiglu_oai", gate_up_layout="interleaved", expert_bias=True)
    for field, key in keys.items():
        value = hf.get(key)
        if field == "activation":
            if value not in _ACTIVATIONS:
                raise ValueError(f"load_moe_layer: {hf.path!r} key 'hidden_act' must be one of {sorted(_ACTIVATIONS)}; "
                                 f"got {hf.words('hidden_act')}")
            value = _ACTIVATIONS[value]
        elif field == "renormalize":
            value = bool(value)  # transformers: `if self.norm_topk_prob:`
        elif field == "routed_scaling_factor":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"load_moe_layer: {hf.path!r} key 'routed_scaling_factor' must be a number; "
                                 f"got {hf.words('routed_scaling_factor')}")
            value = float(value)
        fields[field] = value
    return fields


def _quant_from_config(raw: dict, path: str) -> str | None:
    """``"fp8_block"`` if config.json's ``quantization_config`` is 128x128 block FP8, None if it has none;
    refuses every other method or block size (naming the key)."""
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"load_moe_layer: {path!r} key 'quantization_config' must be an object; got {q!r}")
    where = f"load_moe_layer: {path!r} key 'quantization_config."
    method = q.get("quant_method")
    if method == "mxfp4":  # gpt-oss's (transformers' Mxfp4Config): *_blocks / *_scales of the experts
        return "mxfp4"
    if method != "fp8":
        raise ValueError(f"{where}quant_method' must be 'fp8' (transformers' FineGrainedFP8Config: 128x128 block FP8, "
                         f"DeepSeek-V3's format) or 'mxfp4' (gpt-oss's); got {method!r}")
    block = q.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
    if list(block or ()) != [FP8_BLOCK, FP8_BLOCK]:
        raise ValueError(f"{where}weight_block_size' must be [{FP8_BLOCK}, {FP8_BLOCK}] (the contract's block scales); "
                         f"got {block!r}")
    for key, want in (("activation_scheme", "dynamic"), ("expert_dtype", "fp8"), ("fmt", "e4m3")):
        if key in q and q[key] != want:
            raise ValueError(f"{where}{key}' must be {want!r} (dynamic 1x128 activation groups, float8_e4m3fn "
                             f"weights); got {q[key]!r}")
    return "fp8_block"


# --------------------------------------------------------------------------------------
# The layer


@dataclasses.dataclass
class MoECheckpointLayer:
    """One MoE layer's weights, assembled (module docstring): torch CPU tensors in the checkpoint's
    dtype, all experts (routed then shared)."""

    arch: str  # the layout read (ARCHS); Kimi K2's is "deepseek_v3" (model_type says "kimi_k2")
    layer: int
    w13: object  # torch [E + S, 2I, H]: bf16 / fp16 / fp32, or float8_e4m3fn codes
    w2: object  # torch [E + S, H, I]
    w13_scale: object | None  # torch [E + S, 2*ceil(I/128), ceil(H/128)] float32 multiplier (FP8 checkpoints)
    w2_scale: object | None  # torch [E + S, ceil(H/128), ceil(I/128)]
    router_weight: object  # torch [E, H], the checkpoint's dtype
    e_score_correction_bias: object | None  # torch [E] float32 (DeepSeek-V3, GLM-4.5, Kimi K2)
    num_shared_experts: int
    hf_config: dict | None  # config.json as written (None: no config.json)
    path: str = ""
    config_path: str | None = None
    routing: dict | None = None  # MoEConfig routing fields from config.json (None: no config.json)
    routing_words: dict | None = None  # MoEConfig field -> "'key'=value (absent ...: default)"
    shared_expert_gate: object | None = None  # torch [1, H], the checkpoint's dtype (Qwen3-Next), else None
    model_type: str | None = None  # config.json's model_type ("kimi_k2" for Kimi K2's deepseek_v3 layout)
    # gpt-oss: the router's bias [E] and the experts' biases [E, 2I] / [E, H] (the checkpoint's dtype), else None.
    # Its MXFP4 experts: w13 uint8 codes [E, 2I, H/2], w13_scale uint8 e8m0 [E, 2I, H/32], w2 [E, H, I/2],
    # w2_scale [E, H, I/32] (quant "mxfp4", CONTRACT.md section 9).
    router_bias: object | None = None
    w13_bias: object | None = None
    w2_bias: object | None = None

    def __repr__(self) -> str:
        # The generated repr printed every tensor's values and the whole config.json (15 KB for a tiny layer):
        # what was read, where from, and each tensor's shape and dtype.
        tensors = ("w13", "w2", "w13_scale", "w2_scale", "router_weight", "router_bias", "e_score_correction_bias",
                   "shared_expert_gate", "w13_bias", "w2_bias")
        shapes = ", ".join(f"{n}=[{', '.join(map(str, t.shape))}] {_dtype_name(t)}"
                           for n in tensors if (t := getattr(self, n)) is not None)
        routing = ", ".join(f"{k}={v!r}" for k, v in (self.routing or {}).items())
        source = (f"routing from {self.config_path!r}: {routing}" if self.routing
                  else "no config.json: routing from a preset")
        return (f"MoECheckpointLayer(arch={self.arch!r}, model_type={self.model_type!r}, layer={self.layer}, "
                f"path={self.path!r}, E={self.num_experts}, S={self.num_shared_experts}, H={self.hidden_size}, "
                f"I={self.intermediate_size}, quant={self.quant!r}, {shapes}, {source})")

    @property
    def num_experts(self) -> int:
        return self.router_weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.router_weight.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def is_mxfp4(self) -> bool:
        """gpt-oss's MXFP4 experts (uint8 packed codes and e8m0 scales)."""
        return _dtype_name(self.w13) == "uint8"

    @property
    def is_fp8(self) -> bool:
        return self.w13_scale is not None and not self.is_mxfp4

    @property
    def quant(self) -> str:
        """The checkpoint's quantization as a ``MoEConfig.quant``: ``"fp8_block"``, ``"mxfp4"`` or ``"none"``."""
        return "fp8_block" if self.is_fp8 else "mxfp4" if self.is_mxfp4 else "none"

    @property
    def dtype(self) -> str:
        """The expert weights' dtype name (``"bfloat16"``, ``"float8_e4m3fn"``, ...)."""
        return _dtype_name(self.w13)

    def config(self, preset=None, **overrides) -> MoEConfig:
        """The layer's :class:`MoEConfig`: sizes from the tensors, routing from ``config.json`` (else from
        ``preset``, a ``moe_contract.ModelPreset`` or its name, of the checkpoint's routing family; ignored
        when there is a config.json), ``quant`` the
        checkpoint's (:attr:`quant`) unless overridden; ``overrides`` (quant, ep_size, ...) last.

        Raises: ValueError without config.json and preset, on a preset of another family (a DeepSeek-V3 preset
        for softmax-routed weights or the reverse; a sigmoid_topk one (Llama 4's) for any but a Llama 4 checkpoint
        and the reverse; one whose ``shared_expert_gate`` / ``apply_router_weight_on_input`` differ from the
        checkpoint's :attr:`layer_semantics`; a gate/up-interleaved one, gpt-oss's), on sizes or
        :attr:`layer_semantics` overridden to other than the checkpoint's, and on routing values the contract
        refuses (naming the config.json keys they came from).
        """
        sizes = dict(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                     num_experts=self.num_experts, num_fused_shared_experts=self.num_shared_experts)
        MoEConfig.check_field_names("MoECheckpointLayer.config", overrides)
        semantics = self.layer_semantics
        for name, value in semantics.items():  # what the checkpoint's block computes (Llama 4's, Qwen3-Next's)
            if name in overrides and overrides[name] != value:
                raise ValueError(f"MoECheckpointLayer.config: {name} is the {self.arch} checkpoint's ({value}: "
                                 f"{_FAMILY_WORDS[self.arch]}) in {self.path!r}; got {name}={overrides[name]!r}")
        for name, value in sizes.items():
            if name in overrides and overrides[name] != value:
                raise ValueError(f"MoECheckpointLayer.config: {name} is the checkpoint's ({value}, from its tensors); "
                                 f"got {name}={overrides[name]!r}")
        fields = dict(sizes, quant=self.quant)
        if self.routing is not None:
            fields.update(self.routing)
        elif preset is not None:
            if isinstance(preset, str):  # a preset's name, as --preset and from_preset take it
                from moe_contract import get_preset

                preset = get_preset(preset)
            # The checkpoint's tensors fix the routing family: DeepSeek-V3's biased grouped top-k (it has an
            # e_score_correction_bias) or softmax top-k (Mixtral, Qwen3-MoE). A preset of the other family
            # would drop the bias or invent one (found by a new-user trial: a Mixtral preset on DeepSeek-V3
            # weights ran and "agreed").
            biased = self.e_score_correction_bias is not None
            # Sigmoid top-k with the router weight on the input (Llama 4), the sigmoid-gated shared expert (Qwen3-Next)
            # and the interleaved gate/up rows (gpt-oss, not read here) are the tensors' family too: a preset that
            # differs in any of them would compute another model's layer.
            layout = "interleaved" if self.arch == "gpt_oss" else "concatenated"
            if (preset.gate_up_layout != layout or (preset.routing == "sigmoid_topk") != (self.arch == "llama4")
                    or any(bool(getattr(preset, n)) != v for n, v in semantics.items())):
                raise ValueError(
                    f"MoECheckpointLayer.config: preset {preset.name!r} is another family's layer (routing "
                    f"{preset.routing!r}, gate_up_layout {preset.gate_up_layout!r}); this {self.arch} checkpoint "
                    f"in {self.path!r} is read as {_FAMILY_WORDS[self.arch]}; pass a preset of that family, or put its "
                    f"config.json beside the weights")
            if biased != (preset.routing == "biased_grouped_topk"):
                raise ValueError(
                    f"MoECheckpointLayer.config: preset {preset.name!r} routes by {preset.routing!r}, but the "
                    f"{self.arch} checkpoint in {self.path!r} "
                    + ("has an e_score_correction_bias (biased_grouped_topk, DeepSeek-V3)" if biased else
                       "has no e_score_correction_bias (softmax routing)")
                    + "; pass a preset of the checkpoint's family, or put its config.json beside the weights")
            fields.update(topk=preset.topk, routing=preset.routing, renormalize=preset.renormalize,
                          num_expert_group=preset.num_expert_group, topk_group=preset.topk_group,
                          routed_scaling_factor=preset.routed_scaling_factor, activation=preset.activation,
                          gate_up_layout=preset.gate_up_layout, **semantics)
        else:
            raise ValueError(f"MoECheckpointLayer.config: no config.json beside the weights in {self.path!r}; "
                             f"pass a preset for the routing (topk, groups, rsf, renormalize)")
        fields.update(overrides)
        try:
            return MoEConfig(**fields)
        except ValueError as exc:
            if not self.routing_words:
                raise
            named = [w for f, w in self.routing_words.items() if re.search(rf"\b{f}\b", str(exc)) and f not in overrides]
            keys = "; ".join(self.routing_words.values())
            raise ValueError(f"{exc} [from {self.config_path!r}"
                             f"{': ' + ', '.join(named) if named else ''}; all routing keys: {keys}]") from exc

    @property
    def layer_semantics(self) -> dict:
        """The :class:`MoEConfig` fields the checkpoint's block fixes beyond its routing:
        ``apply_router_weight_on_input`` (Llama 4), ``shared_expert_gate`` (Qwen3-Next's gate weight is here) and
        ``expert_bias`` (gpt-oss's expert biases are here)."""
        return dict(apply_router_weight_on_input=self.arch == "llama4",
                    shared_expert_gate=self.shared_expert_gate is not None, expert_bias=self.w13_bias is not None)

    def _check_config(self, config: MoEConfig, op: str) -> None:
        want = dict(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                    num_experts=self.num_experts, num_fused_shared_experts=self.num_shared_experts)
        bad = {k: getattr(config, k) for k, v in want.items() if getattr(config, k) != v}
        if bad:
            raise ValueError(f"MoECheckpointLayer.{op}: config must match the checkpoint's sizes {want}; got {bad}")

    def float_weights(self):
        """``(w13, w2)`` as float torch tensors: the checkpoint's float dtype, or, for FP8 checkpoints,
        the codes dequantized block by block in float32 (``q * scale``, exact; MXFP4: ``code * 2^(scale - 127)``
        per 32 values, float32, exact)."""
        if self.is_mxfp4:
            from moe_torch import dequantize_weight_mxfp4

            return dequantize_weight_mxfp4(self.w13, self.w13_scale), dequantize_weight_mxfp4(self.w2, self.w2_scale)
        if not self.is_fp8:
            return self.w13, self.w2
        return dequantize_block(self.w13, self.w13_scale), dequantize_block(self.w2, self.w2_scale)

    def layer_weights(self, config: MoEConfig):
        """:class:`interop.crosscheck.LayerWeights` (numpy, bf16 / FP8 as ml_dtypes: the bits) for ``config``:
        the codes and scales as stored when the checkpoint is FP8 and ``config.quant='fp8_block'``, or gpt-oss
        MXFP4 and ``config.quant='mxfp4'`` (uint8 codes, uint8 e8m0 scales), float weights otherwise; the router
        weight, the correction bias, Qwen3-Next's ``shared_expert_gate``, and gpt-oss's router bias
        (``router_bias [E]`` float32: the check's logits are ``x @ router_weight.T + router_bias``) and expert biases
        (``w13_bias [E, 2I]`` / ``w2_bias [E, H]``, the stored dtype). Raises ValueError if ``config``'s sizes are
        not the checkpoint's."""
        from interop.crosscheck import LayerWeights, to_numpy

        self._check_config(config, "layer_weights")
        if (self.is_fp8 and config.quant == "fp8_block") or (self.is_mxfp4 and config.quant == "mxfp4"):
            w13, w2, s13, s2 = self.w13, self.w2, self.w13_scale, self.w2_scale
        else:
            (w13, w2), s13, s2 = self.float_weights(), None, None
        # Qwen3-Next's shared-expert gate weight: the check computes its logits from it, not from a seeded one
        gate = {} if self.shared_expert_gate is None else {"shared_expert_gate": to_numpy(self.shared_expert_gate)}
        router_bias = None if self.router_bias is None else to_numpy(self.router_bias.float())
        return LayerWeights(w13=to_numpy(w13), w2=to_numpy(w2), w13_scale=to_numpy(s13), w2_scale=to_numpy(s2),
                            router_weight=to_numpy(self.router_weight),
                            e_score_correction_bias=to_numpy(self.e_score_correction_bias), router_bias=router_bias,
                            w13_bias=to_numpy(self.w13_bias), w2_bias=to_numpy(self.w2_bias), **gate)

    def arrays(self, framework: str, config: MoEConfig | None = None) -> dict:
        """This EP rank's (``config``; default: all experts) weights as jax arrays (default device) or torch
        tensors (CUDA if there is one; on the CPU they share memory with this layer's tensors):
        ``w13, w2, w13_scale, w2_scale, router_weight, e_score_correction_bias, shared_expert_gate`` (Qwen3-Next's
        ``[1, H]``, its stored dtype; None for the other families), ``router_bias [E]``, ``w13_bias [n, 2I]``,
        ``w2_bias [n, H]`` (gpt-oss's, this rank's experts' biases; None for the other families). gpt-oss's MXFP4
        checkpoints give the uint8 codes and e8m0 scales as stored when ``config`` is None or
        ``config.quant == "mxfp4"`` (with ``config.w4_layout == "mma"`` the codes repacked to that layout, ValueError
        for scales it cannot hold), else the codes dequantized to bfloat16 (as transformers' ``dequantize=True``).

        dtypes: the checkpoint's (bf16 stays bf16); FP8 checkpoints give float8_e4m3fn codes and float32
        block scales when ``config`` is None or ``config.quant == "fp8_block"``, else the codes dequantized
        to bfloat16 (as transformers' ``dequantize=True``) and no scales; the router weight in its stored
        dtype; the bias float32. Scales are None for float weights.

        Raises: ValueError on an unknown ``framework`` or a ``config`` whose sizes are not the checkpoint's.
        """
        import torch

        from interop.crosscheck import _torch_device, from_numpy, to_numpy

        if framework not in ("jax", "torch"):
            raise ValueError(f"MoECheckpointLayer.arrays: framework must be 'jax' or 'torch'; got {framework!r}")
        if config is not None:
            self._check_config(config, "arrays")
        lo, n = config.local_expert_range() if config is not None else (0, self.w13.shape[0])
        out = {"w13": self.w13[lo:lo + n], "w2": self.w2[lo:lo + n],
               "w13_scale": None if self.w13_scale is None else self.w13_scale[lo:lo + n],
               "w2_scale": None if self.w2_scale is None else self.w2_scale[lo:lo + n],
               "router_weight": self.router_weight, "e_score_correction_bias": self.e_score_correction_bias,
               "shared_expert_gate": self.shared_expert_gate, "router_bias": self.router_bias,
               "w13_bias": None if self.w13_bias is None else self.w13_bias[lo:lo + n],
               "w2_bias": None if self.w2_bias is None else self.w2_bias[lo:lo + n]}
        if self.is_mxfp4 and config is not None and config.quant != "mxfp4":
            from moe_torch import dequantize_weight_mxfp4

            out["w13"] = dequantize_weight_mxfp4(out["w13"], out["w13_scale"]).to(torch.bfloat16)
            out["w2"] = dequantize_weight_mxfp4(out["w2"], out["w2_scale"]).to(torch.bfloat16)
            out["w13_scale"] = out["w2_scale"] = None
        if self.is_mxfp4 and config is not None and config.w4_layout == "mma":  # the load-time repack
            from moe_torch.layer import mma_layout_weight

            out["w13"], _ = mma_layout_weight("MoECheckpointLayer.arrays", "w13", out["w13"], out["w13_scale"])
            out["w2"], _ = mma_layout_weight("MoECheckpointLayer.arrays", "w2", out["w2"], out["w2_scale"])
        if self.is_fp8 and config is not None and config.quant != "fp8_block":
            out["w13"] = dequantize_block(out["w13"], out.pop("w13_scale")).to(torch.bfloat16)
            out["w2"] = dequantize_block(out["w2"], out.pop("w2_scale")).to(torch.bfloat16)
            out["w13_scale"] = out["w2_scale"] = None
        if framework == "torch":
            device = _torch_device()
            return {k: None if v is None else v.to(device) for k, v in out.items()}
        return {k: from_numpy(to_numpy(v), "jax") for k, v in out.items()}


def dequantize_block(q, scale, block: int = FP8_BLOCK):
    """``[..., N, K]`` FP8 codes times ``[..., ceil(N/b), ceil(K/b)]`` block multipliers, float32 (exact).
    Takes torch tensors (returns torch) or numpy arrays (returns numpy)."""
    import torch

    if not isinstance(q, torch.Tensor):
        from interop.crosscheck import from_numpy, to_numpy

        return to_numpy(dequantize_block(from_numpy(q, "torch").cpu(), from_numpy(np.asarray(scale), "torch").cpu(), block))
    N, K = q.shape[-2:]
    s = scale.float().repeat_interleave(block, dim=-2)[..., :N, :].repeat_interleave(block, dim=-1)[..., :K]
    return q.float() * s


def _nonfinite(t) -> tuple[int, int]:
    """(NaN count, inf count) of a torch tensor (float8_e4m3fn has NaN codes and no inf)."""
    import torch

    if t.dtype == torch.float8_e4m3fn:
        return int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum()), 0
    if not t.is_floating_point():
        return 0, 0
    return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())


def _detect_arch(keys, hf_config: dict | None) -> str:
    if hf_config is not None and hf_config.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[hf_config["model_type"]]
    if hf_config is not None and "model_type" in hf_config:
        raise ValueError(f"load_moe_layer: config.json model_type must be one of {tuple(MODEL_TYPES)}; got "
                         f"{hf_config['model_type']!r}")
    if any(".block_sparse_moe.experts." in k for k in keys):
        return "mixtral"
    if any(k.endswith((".mlp.router.weight", ".mlp.experts.gate_up_proj_blocks", ".mlp.experts.gate_up_proj_bias"))
           for k in keys):
        return "gpt_oss"
    if any(".feed_forward.experts." in k for k in keys):
        return "llama4"
    if any(k.endswith(".mlp.shared_expert_gate.weight") for k in keys):
        return "qwen3_next"
    if any(k.endswith(".gate.e_score_correction_bias") or ".mlp.shared_experts." in k for k in keys):
        return "deepseek_v3"  # GLM-4.5's tensors have the same names (its config.json tells them apart)
    if any(".mlp.experts.gate_up_proj" in k for k in keys):
        raise ValueError("load_moe_layer: the fused layout ('mlp.experts.gate_up_proj') of Mixtral and Qwen3-MoE has the "
                         "same tensor names; put the model's config.json beside the weights, or pass arch=")
    if any(".mlp.experts." in k for k in keys):
        return "qwen3_moe"
    raise ValueError("load_moe_layer: no MoE expert weights found (expected keys like "
                     "'model.layers.L.block_sparse_moe.experts.i.w1.weight', 'model.layers.L.mlp.experts.i.gate_proj.weight', "
                     "'model.layers.L.mlp.experts.gate_up_proj' or 'model.layers.L.feed_forward.experts.gate_up_proj')")


def _shared_from_config(arch: str, hf: _HFConfig, I: int) -> tuple[int, str] | None:
    """``(S, the key's words)``: the shared experts config.json says the layer has (``S * I`` the shared MLP's
    intermediate); None for the families without shared experts."""
    if arch in ("deepseek_v3", "glm4_moe"):
        return hf.get("n_shared_experts"), hf.words("n_shared_experts")
    if arch == "qwen3_next":
        size = hf.get("shared_expert_intermediate_size")
        words = hf.words("shared_expert_intermediate_size")
        if size % I:
            raise ValueError(f"load_moe_layer: {hf.path!r} says {words}, not a multiple of the experts' I={I} "
                             f"(the shared expert is read as fused experts of I)")
        return size // I, words
    if arch == "llama4":  # Llama4TextMoe.shared_expert = Llama4TextMLP(config): intermediate_size, one expert of I
        return 1, f"{hf.words('intermediate_size')} (Llama4TextMoe's shared_expert: one expert of I)"
    return None


def _load_gpt_oss(files: _Files, pre: str, rests: set, layer: int, hf: _HFConfig | None, raw: dict | None, path: str,
                  cfg_path: str, config_quant: str | None, model_type: str | None,
                  allow_nonfinite: bool) -> MoECheckpointLayer:
    """gpt-oss's MoE layer (module docstring of :func:`load_moe_layer`): MXFP4 ``*_blocks`` / ``*_scales`` as the
    layer's packed codes and e8m0 scales (the bytes as stored, reshaped), or float fused experts transposed from
    ``GptOssExperts``' in-by-out ``[E, H, 2I]`` / ``[E, I, H]``; the router's weight and bias; the expert biases."""
    bad: list[tuple[str, int, int]] = []

    def get(key: str, what: str, shape: tuple | None, kind: str = "float"):
        t = files.get(key, what)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"load_moe_layer: {key} ({what}) must have shape {tuple(shape)}; got {tuple(t.shape)}")
        name = _dtype_name(t)
        if kind == "float" and name not in _FLOAT_DTYPES:
            raise TypeError(f"load_moe_layer: {key} ({what}) must be one of {_FLOAT_DTYPES}; got {name}")
        if kind in ("codes", "scales") and name != "uint8":
            raise TypeError(f"load_moe_layer: {key} ({what}) must be uint8 in an MXFP4 checkpoint; got {name}")
        nan, inf = (int((t == 255).sum()), 0) if kind == "scales" else _nonfinite(t)  # e8m0 0xFF is NaN
        if nan or inf:
            bad.append((key, nan, inf))
        return t

    router_key = f"{pre}.router.weight"
    router = get(router_key, "router weight [E, H]", None)
    if router.ndim != 2:
        raise ValueError(f"load_moe_layer: {router_key} must be [E, H]; got shape {tuple(router.shape)}")
    E, H = router.shape
    router_bias = get(f"{pre}.router.bias", "router bias [E] (GptOssTopKRouter: logits x @ W.T + b)", (E,))
    gu, dn = f"{pre}.experts.gate_up_proj", f"{pre}.experts.down_proj"
    mxfp4 = any(r.endswith(("_blocks", "_scales")) for r in rests)
    if mxfp4:
        first = gu + "_blocks"
        shape, _ = files.info(first, "gate_up projection's MXFP4 codes [E, 2I, H/32, 16]")
        if len(shape) != 4 or shape[0] != E or shape[1] % 2 or shape[2] * 32 != H or shape[3] != 16:
            raise ValueError(f"load_moe_layer: {first} must be [E={E}, 2I, H/32={H / 32:g}, 16] (MXFP4 codes, two per "
                             f"byte, groups of 32 along H); got shape {shape}")
        I = shape[1] // 2
        if I % 32:
            raise ValueError(f"load_moe_layer: MXFP4 needs I % 32 == 0 (the down projection's groups); got I={I}")
    else:
        first = gu
        shape, _ = files.info(first, "fused gate_up projection [E, H, 2I] (GptOssExperts: in-by-out, gate/up "
                                     "columns interleaved)")
        if len(shape) != 3 or shape[0] != E or shape[1] != H or shape[2] % 2:
            raise ValueError(f"load_moe_layer: {first} must be [E={E}, H={H}, 2I] (GptOssExperts' in-by-out "
                             f"layout); got shape {shape}")
        I = shape[2] // 2
    if config_quant == "mxfp4" and not mxfp4:
        raise ValueError(f"load_moe_layer: {cfg_path!r} says quantization_config.quant_method='mxfp4' but {pre}.experts "
                         f"has no gate_up_proj_blocks / _scales (float experts)")
    if config_quant == "fp8_block":
        raise ValueError(f"load_moe_layer: {cfg_path!r} says quantization_config.quant_method='fp8'; gpt-oss "
                         f"checkpoints are read as MXFP4 or float")
    if hf is not None:
        for what, value in (("E", E), ("H", H), ("I", I)):
            key = _SIZE_KEYS["gpt_oss"][what]
            if hf.get(key) != value:
                raise ValueError(f"load_moe_layer: {hf.path!r} says {hf.words(key)} but the tensors have {what}={value} "
                                 f"({first if what == 'I' else router_key}); this config.json does not belong "
                                 f"to these weights")
    proj = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales") if mxfp4 else (
        "gate_up_proj", "down_proj")
    allowed = {"router.weight", "router.bias", "experts.gate_up_proj_bias", "experts.down_proj_bias"}
    allowed |= {f"experts.{p}" for p in proj}
    unexpected = sorted(r for r in rests if r not in allowed)
    if unexpected:
        shown = ", ".join(f"'{pre}.{r}'" for r in unexpected[:6])
        raise ValueError(f"load_moe_layer: unexpected key(s) {shown} for a {'MXFP4' if mxfp4 else 'float'} gpt_oss "
                         f"layer (refused rather than ignored)")
    if mxfp4:  # the checkpoint's [E, N, K/32, 16] bytes are the layer's [E, N, K/2] codes; scales [E, N, K/32] as they are
        w13 = get(gu + "_blocks", "gate_up projection's MXFP4 codes [E, 2I, H/32, 16]", (E, 2 * I, H // 32, 16),
                  "codes").reshape(E, 2 * I, H // 2)
        s13 = get(gu + "_scales", "gate_up projection's e8m0 scales [E, 2I, H/32]", (E, 2 * I, H // 32), "scales")
        w2 = get(dn + "_blocks", "down projection's MXFP4 codes [E, H, I/32, 16]", (E, H, I // 32, 16),
                 "codes").reshape(E, H, I // 2)
        s2 = get(dn + "_scales", "down projection's e8m0 scales [E, H, I/32]", (E, H, I // 32), "scales")
    else:
        g = get(gu, "fused gate_up projection [E, H, 2I] (in-by-out)", (E, H, 2 * I))
        d = get(dn, "fused down projection [E, I, H] (in-by-out)", (E, I, H))
        if g.dtype != d.dtype:
            raise TypeError(f"load_moe_layer: {dn} is {_dtype_name(d)} but {gu} is {_dtype_name(g)}; mixed dtypes are "
                            f"not supported")
        w13, w2 = g.transpose(1, 2).contiguous(), d.transpose(1, 2).contiguous()  # interleaved gate/up rows kept
        s13 = s2 = None
    b13 = get(f"{gu}_bias", "gate_up projection's bias [E, 2I] (interleaved gate/up)", (E, 2 * I))
    b2 = get(f"{dn}_bias", "down projection's bias [E, H]", (E, H))
    if bad and not allow_nonfinite:
        listed = ", ".join(f"{k} ({nan} NaN, {inf} inf)" for k, nan, inf in bad[:8])
        raise ValueError(f"load_moe_layer: non-finite values in {files.folder!r}: {listed}; no stage's result "
                         f"means anything on them (allow_nonfinite=True loads them anyway)")
    routing = words = None
    if hf is not None:
        routing = _routing_from_config("gpt_oss", hf)
        words = {f: hf.words(k) for f, k in _ROUTING_KEYS["gpt_oss"].items()}
    return MoECheckpointLayer(arch="gpt_oss", layer=layer, w13=w13, w2=w2, w13_scale=s13, w2_scale=s2,
                              router_weight=router, e_score_correction_bias=None, num_shared_experts=0, hf_config=raw,
                              path=path, config_path=cfg_path if raw is not None else None, routing=routing,
                              routing_words=words, model_type=model_type, router_bias=router_bias, w13_bias=b13,
                              w2_bias=b2)


def load_moe_layer(path: str, layer: int | None = None, arch: str | None = None, *,
                   allow_nonfinite: bool = False) -> MoECheckpointLayer:
    """Load MoE layer ``layer`` (default: the first layer with experts) of the checkpoint at ``path``.

    Args:
      path: a ``.safetensors`` file, or a folder (``model.safetensors.index.json`` or ``*.safetensors``,
        optionally ``config.json``).
      layer: the decoder layer index ``L``.
      arch: one of :data:`ARCHS` (``"mixtral"``, ``"qwen3_moe"``, ``"deepseek_v3"``, ``"glm4_moe"``, ``"qwen3_next"``,
        ``"llama4"``, ``"gpt_oss"``) or a :data:`MODEL_TYPES` name (``"kimi_k2"`` reads as ``"deepseek_v3"``); default:
        ``config.json``'s ``model_type``, else from the key names.
      allow_nonfinite: load NaN / inf weights as they are instead of refusing them.

    Returns: :class:`MoECheckpointLayer` (torch CPU tensors in the checkpoint's dtype).

    Raises: FileNotFoundError (no file); ValueError (no MoE layer, missing or unexpected key, wrong shape,
      non-finite values, FP8 without scales, ``I % 128 != 0`` with block scales, FP8 Llama 4 fused experts, a
      config.json that disagrees with the tensors or that transformers refuses, an unsupported ``hidden_act``,
      ``quantization_config`` or DeepSeek ``scoring_func`` / ``topk_method``, a Llama 4 config.json without
      ``text_config``), each naming the key and the file; TypeError (a dtype other than bf16 / fp16 / fp32 weights
      or float8_e4m3fn codes); ImportError (a config.json and no transformers).
    """
    import torch

    files = _Files(path)
    cfg_path = os.path.join(files.folder, "config.json")
    raw = None
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"load_moe_layer: {cfg_path!r} is not valid JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"load_moe_layer: {cfg_path!r} must hold a JSON object; got {type(raw).__name__}")
    if arch is None:
        arch = _detect_arch(files.where, raw)
    arch = MODEL_TYPES.get(arch, arch) if isinstance(arch, str) else arch
    if arch not in ARCHS:
        raise ValueError(f"load_moe_layer: arch must be one of {ARCHS} (or a model_type of {tuple(MODEL_TYPES)}); "
                         f"got arch={arch!r}")
    model_type = raw.get("model_type") if raw is not None else None
    if model_type is not None and MODEL_TYPES.get(model_type) != arch:
        raise ValueError(f"load_moe_layer: arch={arch!r} but {cfg_path!r} says model_type={model_type!r}")
    hf = _read_hf_config(arch, raw, cfg_path) if raw is not None else None
    config_quant = _quant_from_config(raw, cfg_path) if raw is not None else None
    A = _ARCHS[arch]
    module, (g_name, u_name, d_name) = A.module, A.projections

    # layers with experts: (prefix, layout) per layer index
    found: dict[int, dict[str, set]] = {}
    for k in files.where:
        m = _LAYER_KEY.match(k)
        if m and m.group("module") in (module, A.fused_module):
            found.setdefault(int(m.group("L")), {}).setdefault(m.group("pre"), set()).add(m.group("rest"))
    moe_layers = {L: mods for L, mods in found.items() if any(r.startswith("experts.") for rs in mods.values() for r in rs)}
    if not moe_layers:
        raise ValueError(f"load_moe_layer: no '{module}.experts.*' weights for arch {arch!r} in {files.folder!r}")
    layers = sorted(moe_layers)
    if layer is None:
        layer = layers[0]
    elif layer not in layers:
        raise ValueError(f"load_moe_layer: layer must be one of the MoE layers {layers}; got layer={layer}")
    mods = {p: rs for p, rs in moe_layers[layer].items() if any(r.startswith("experts.") for r in rs)}
    if len(mods) != 1:
        raise ValueError(f"load_moe_layer: layer {layer} has experts under several modules {sorted(mods)}")
    pre, rests = next(iter(mods.items()))
    if arch == "gpt_oss":
        return _load_gpt_oss(files, pre, rests, layer, hf, raw, path, cfg_path, config_quant, model_type,
                             allow_nonfinite)
    if config_quant == "mxfp4":
        raise ValueError(f"load_moe_layer: {cfg_path!r} says quantization_config.quant_method='mxfp4' (gpt-oss's "
                         f"format) but arch is {arch!r}; MXFP4 is read for gpt_oss checkpoints only")
    fused = any(r.startswith(("experts.gate_up_proj", "experts.down_proj")) for r in rests)
    if fused and any(re.match(r"experts\.\d+\.", r) for r in rests):
        raise ValueError(f"load_moe_layer: {pre}.experts has both the fused ('gate_up_proj') and the per-expert layout")
    in_by_out = fused and A.fused_in_by_out
    bad: list[tuple[str, int, int]] = []

    def get(key: str, what: str, shape: tuple | None = None, kind: str = "float"):
        t = files.get(key, what)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"load_moe_layer: {key} ({what}) must have shape {tuple(shape)}; got {tuple(t.shape)}")
        name = _dtype_name(t)
        if kind == "float" and name not in _FLOAT_DTYPES:
            raise TypeError(f"load_moe_layer: {key} ({what}) must be one of {_FLOAT_DTYPES}; got {name}")
        if kind == "fp8" and name != "float8_e4m3fn":
            raise TypeError(f"load_moe_layer: {key} ({what}) must be float8_e4m3fn in an FP8 checkpoint; got {name}")
        if kind == "scale":
            if name not in _FLOAT_DTYPES + ("float8_e8m0fnu",):
                raise TypeError(f"load_moe_layer: {key} ({what}) must be float32 (or bf16 / e8m0: converted exactly); "
                                f"got {name}")
            t = t.float()
        nan, inf = _nonfinite(t)
        if nan or inf:
            bad.append((key, nan, inf))
        return t

    # router
    router_key = f"{pre}.{A.router}.weight"
    router = get(router_key, "router weight [E, H]")
    if router.ndim != 2:
        raise ValueError(f"load_moe_layer: {router_key} must be [E, H]; got shape {tuple(router.shape)}")
    E, H = router.shape
    bias = None
    bias_key = f"{pre}.gate.e_score_correction_bias"
    if files.has(bias_key):
        if not A.biased:
            raise ValueError(f"load_moe_layer: {bias_key} exists but arch {arch!r} has no router bias (only "
                             f"{', '.join(a for a, x in _ARCHS.items() if x.biased)})")
        bias = get(bias_key, "router bias [E]", (E,)).float()
    elif A.biased:
        raise ValueError(f"load_moe_layer: missing key {bias_key!r} (the {arch} router's e_score_correction_bias) in "
                         f"{files.folder!r}")

    # experts: the probe gives I, the dtype and FP8
    if fused:
        first = f"{pre}.experts.gate_up_proj"
        if in_by_out:  # Llama 4: x @ gate_up_proj[e], gate columns first
            shape, dtype_name = files.info(first, "fused gate_up projection [E, H, 2I] (in-by-out)")
            if len(shape) != 3 or shape[0] != E or shape[1] != H or shape[2] % 2:
                raise ValueError(f"load_moe_layer: {first} must be [E={E}, H={H}, 2I] (Llama 4's in-by-out layout); "
                                 f"got shape {shape}")
            I = shape[2] // 2
        else:
            shape, dtype_name = files.info(first, "fused gate_up projection [E, 2I, H]")
            if len(shape) != 3 or shape[0] != E or shape[2] != H or shape[1] % 2:
                raise ValueError(f"load_moe_layer: {first} must be [E={E}, 2I, H={H}]; got shape {shape}")
            I = shape[1] // 2
    else:
        first = f"{pre}.experts.0.{g_name}.weight"
        shape, dtype_name = files.info(first, "expert 0 gate projection [I, H]")
        if len(shape) != 2 or shape[1] != H:
            raise ValueError(f"load_moe_layer: {first} must be [I, H={H}]; got shape {shape}")
        I = shape[0]
    scale_suffix = "_scale_inv"  # weight -> weight_scale_inv; fused gate_up_proj -> gate_up_proj_scale_inv
    fp8 = dtype_name == "float8_e4m3fn"
    if not fp8 and dtype_name not in _FLOAT_DTYPES:
        raise TypeError(f"load_moe_layer: {first} must be one of {_FLOAT_DTYPES} or float8_e4m3fn; got {dtype_name}")
    dtype = getattr(torch, dtype_name)
    if config_quant == "fp8_block" and not fp8:
        raise ValueError(f"load_moe_layer: {cfg_path!r} says quantization_config.quant_method='fp8' but {first} is "
                         f"{dtype_name}, not float8_e4m3fn")
    if fp8 and in_by_out:
        raise ValueError(f"load_moe_layer: {first} is float8_e4m3fn in Llama 4's in-by-out fused layout, whose block "
                         f"scales would be transposed too; no such checkpoint format is read here (bf16 / fp16 / fp32 "
                         f"fused, or per-expert weights with 128x128 weight_scale_inv)")
    if fp8 and I % FP8_BLOCK:
        raise ValueError(f"load_moe_layer: FP8 block scales need I % {FP8_BLOCK} == 0 to concatenate gate and up; got I={I}")
    kind = "fp8" if fp8 else "float"

    def check_dtype(key: str, t):
        if t.dtype != dtype:
            raise TypeError(f"load_moe_layer: {key} is {_dtype_name(t)} but {first} is {dtype_name}; "
                            f"mixed dtypes are not supported")

    # shared experts (DeepSeek-V3, GLM-4.5, Qwen3-Next, Llama 4): the tensors against config.json
    shared_pre = f"{pre}.{A.shared}" if A.shared else None
    shared_key = f"{shared_pre}.{g_name}.weight" if A.shared else None
    S = 0
    if A.shared and files.has(shared_key):
        shape, _ = files.info(shared_key, "shared experts' gate projection [S*I, H]")
        if len(shape) != 2 or shape[1] != H or shape[0] % I or shape[0] == 0:
            raise ValueError(f"load_moe_layer: {shared_key} must be [S * I, H] with I={I}, H={H}, S >= 1; got {shape}")
        S = shape[0] // I
    said = _shared_from_config(arch, hf, I) if hf is not None else None
    if said is not None and said[0] != S:
        S_cfg, words = said
        if S == 0:
            raise ValueError(f"load_moe_layer: missing key {shared_key!r} (the shared experts) in {files.folder!r}: "
                             f"{cfg_path!r} says {words}")
        raise ValueError(f"load_moe_layer: {shared_key} is [{S} * I={I}, H], {S} shared expert(s), but {cfg_path!r} "
                         f"says {words}")
    if S == 0 and A.shared and arch in ("qwen3_next", "llama4"):  # their blocks always hold one (config.json or not)
        raise ValueError(f"load_moe_layer: missing key {shared_key!r} (the shared expert: {arch}'s block always has "
                         f"one) in {files.folder!r}")
    shared_gate = None
    if A.shared_gate:  # Qwen3-Next: sigmoid(x @ shared_expert_gate.weight.T) scales the shared expert's output
        shared_gate = get(f"{pre}.shared_expert_gate.weight", "the shared expert's gate [1, H]", (1, H))

    # config.json's sizes against the tensors
    if hf is not None:
        for what, value in (("E", E), ("H", H), ("I", I)):
            key = _SIZE_KEYS[arch][what]
            if hf.get(key) != value:
                raise ValueError(f"load_moe_layer: {hf.path!r} says {hf.words(key)} but the tensors have {what}={value} "
                                 f"({first if what == 'I' else router_key}); this config.json does not belong "
                                 f"to these weights")

    # unexpected keys under the MoE module: refused, not ignored
    s = scale_suffix if fp8 else None
    allowed = {f"{A.router}.weight"} | ({"gate.e_score_correction_bias"} if bias is not None else set())
    allowed |= {"shared_expert_gate.weight"} if shared_gate is not None else set()
    projections = ("gate_up_proj", "down_proj") if fused else (g_name, u_name, d_name)
    if fused:
        allowed |= {f"experts.{p}" for p in projections} | ({f"experts.{p}{s}" for p in projections} if fp8 else set())
    else:
        for i in range(E):
            allowed |= {f"experts.{i}.{p}.weight" for p in projections}
            allowed |= {f"experts.{i}.{p}.weight{s}" for p in projections} if fp8 else set()
    if S:
        allowed |= {f"{A.shared}.{p}.weight" for p in (g_name, u_name, d_name)}
        allowed |= {f"{A.shared}.{p}.weight{s}" for p in (g_name, u_name, d_name)} if fp8 else set()
    unexpected = sorted(r for r in moe_layers[layer][pre] if r not in allowed)
    if unexpected:
        extra = sorted({int(m.group(1)) for r in unexpected
                        if (m := re.match(r"experts\.(\d+)\.", r)) and int(m.group(1)) >= E})
        if extra:
            raise ValueError(f"load_moe_layer: experts {extra} exist but the router {router_key} has E={E} rows")
        shown = ", ".join(f"'{pre}.{r}'" for r in unexpected[:6])
        shown += f" and {len(unexpected) - 6} more" if len(unexpected) > 6 else ""
        raise ValueError(f"load_moe_layer: unexpected key(s) {shown} for a {'FP8' if fp8 else dtype} {arch} layer "
                         f"(refused rather than ignored)")

    nI, nH = _ceil_div(I, FP8_BLOCK), _ceil_div(H, FP8_BLOCK)
    w13 = torch.empty((E + S, 2 * I, H), dtype=dtype)
    w2 = torch.empty((E + S, H, I), dtype=dtype)
    s13 = torch.empty((E + S, 2 * nI, nH), dtype=torch.float32) if fp8 else None
    s2 = torch.empty((E + S, nH, nI), dtype=torch.float32) if fp8 else None

    def proj(key: str, shape: tuple, what: str):
        w = get(key, what, shape, kind)
        check_dtype(key, w)
        if not fp8:
            return w, None
        sshape = shape[:-2] + (_ceil_div(shape[-2], FP8_BLOCK), _ceil_div(shape[-1], FP8_BLOCK))
        return w, get(key + scale_suffix, f"FP8 block scale of {key} (the dequantization multiplier)", sshape, "scale")

    if in_by_out:  # Llama 4: w13[e] = gate_up_proj[e].T, w2[e] = down_proj[e].T (float only, checked above)
        g, _ = proj(f"{pre}.experts.gate_up_proj", (E, H, 2 * I), "fused gate_up projection [E, H, 2I] (in-by-out)")
        w13[:E] = g.transpose(1, 2)
        d, _ = proj(f"{pre}.experts.down_proj", (E, I, H), "fused down projection [E, I, H] (in-by-out)")
        w2[:E] = d.transpose(1, 2)
    elif fused:
        g, gs = proj(f"{pre}.experts.gate_up_proj", (E, 2 * I, H), "fused gate_up projection [E, 2I, H]")
        w13[:E] = g
        d, ds = proj(f"{pre}.experts.down_proj", (E, H, I), "fused down projection [E, H, I]")
        w2[:E] = d
        if fp8:
            s13[:E], s2[:E] = gs, ds
    else:
        for i in range(E):
            p = f"{pre}.experts.{i}"
            g, gs = proj(f"{p}.{g_name}.weight", (I, H), "gate projection [I, H]")
            u, us = proj(f"{p}.{u_name}.weight", (I, H), "up projection [I, H]")
            d, ds = proj(f"{p}.{d_name}.weight", (H, I), "down projection [H, I]")
            w13[i, :I], w13[i, I:], w2[i] = g, u, d
            if fp8:
                s13[i, :nI], s13[i, nI:], s2[i] = gs, us, ds
    if S:
        g, gs = proj(f"{shared_pre}.{g_name}.weight", (S * I, H), "shared experts' gate projection [S*I, H]")
        u, us = proj(f"{shared_pre}.{u_name}.weight", (S * I, H), "shared experts' up projection [S*I, H]")
        d, ds = proj(f"{shared_pre}.{d_name}.weight", (H, S * I), "shared experts' down projection [H, S*I]")
        for k in range(S):  # shared expert k: intermediate rows / columns [k*I, (k+1)*I)
            w13[E + k, :I], w13[E + k, I:] = g[k * I:(k + 1) * I], u[k * I:(k + 1) * I]
            w2[E + k] = d[:, k * I:(k + 1) * I]
            if fp8:
                s13[E + k, :nI], s13[E + k, nI:] = gs[k * nI:(k + 1) * nI], us[k * nI:(k + 1) * nI]
                s2[E + k] = ds[:, k * nI:(k + 1) * nI]

    if bad and not allow_nonfinite:
        listed = ", ".join(f"{k} ({nan} NaN, {inf} inf)" for k, nan, inf in bad[:8])
        more = f" and {len(bad) - 8} more tensors" if len(bad) > 8 else ""
        raise ValueError(f"load_moe_layer: non-finite values in {files.folder!r}: {listed}{more}; no stage's result "
                         f"means anything on them (allow_nonfinite=True loads them anyway)")

    routing = words = None
    if hf is not None:
        routing = _routing_from_config(arch, hf)
        words = {f: hf.words(k) for f, k in _ROUTING_KEYS[arch].items()}
    return MoECheckpointLayer(arch=arch, layer=layer, w13=w13, w2=w2, w13_scale=s13, w2_scale=s2, router_weight=router,
                              e_score_correction_bias=bias, num_shared_experts=S, hf_config=raw, path=path,
                              config_path=cfg_path if raw is not None else None, routing=routing, routing_words=words,
                              shared_expert_gate=shared_gate, model_type=model_type)


# --------------------------------------------------------------------------------------
# Given inputs (``epmoe check --inputs``)

INPUT_KEYS = ("x", "router_logits")


def load_inputs(path: str, config: MoEConfig) -> tuple[np.ndarray, np.ndarray | None]:
    """``x [T, H]`` and (if present) ``router_logits [T, E]`` from a safetensors file, as float32 numpy
    (bf16 / fp16 converted exactly), checked against ``config``.

    Raises: FileNotFoundError (no file); ValueError (not safetensors, unknown or missing key, wrong
    shape, non-finite values); TypeError (not a float dtype). Each names the file and the key.
    """
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_inputs: {path!r} is not a file")
    try:
        with safe_open(path, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as exc:
        raise ValueError(f"load_inputs: {path!r} is not a readable safetensors file ({exc})") from exc
    unknown = sorted(set(tensors) - set(INPUT_KEYS))
    if unknown:
        raise ValueError(f"load_inputs: {path!r} has key(s) {unknown}; the keys are {INPUT_KEYS} (x [T, H], "
                         f"router_logits [T, E])")
    if "x" not in tensors:
        raise ValueError(f"load_inputs: {path!r} has no key 'x' (the hidden states [T, H={config.hidden_size}]); "
                         f"got {sorted(tensors)}")
    out = {}
    for key, cols, name in (("x", config.hidden_size, "H"), ("router_logits", config.num_experts, "E")):
        if key not in tensors:
            continue
        t = tensors[key]
        if _dtype_name(t) not in _FLOAT_DTYPES:
            raise TypeError(f"load_inputs: {path!r} key {key!r} must be one of {_FLOAT_DTYPES}; got {_dtype_name(t)}")
        T = tensors["x"].shape[0] if tensors["x"].ndim == 2 else None
        if t.ndim != 2 or t.shape[1] != cols or t.shape[0] < 1 or (key != "x" and t.shape[0] != T):
            raise ValueError(f"load_inputs: {path!r} key {key!r} must be [T{'' if key == 'x' else '=' + str(T)}, "
                             f"{name}={cols}] with T >= 1; got shape {tuple(t.shape)}")
        nan, inf = _nonfinite(t)
        if nan or inf:
            raise ValueError(f"load_inputs: {path!r} key {key!r} has non-finite values ({nan} NaN, {inf} inf)")
        out[key] = t.float().numpy()
    return out["x"], out.get("router_logits")
