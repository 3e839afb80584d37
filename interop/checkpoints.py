"""One MoE layer's weights from a Hugging Face safetensors checkpoint, in the layout both backends take.

Checkpoint names (the hub's files; ``L`` the layer, ``i`` the expert):

- **Mixtral** (``model_type="mixtral"``): ``model.layers.L.block_sparse_moe.experts.i.{w1,w3,w2}.weight``
  (``w1`` gate ``[I, H]``, ``w3`` up ``[I, H]``, ``w2`` down ``[H, I]``), router
  ``model.layers.L.block_sparse_moe.gate.weight [E, H]``.
- **Qwen3-MoE** (``"qwen3_moe"``) and **DeepSeek-V3** (``"deepseek_v3"``):
  ``model.layers.L.mlp.experts.i.{gate_proj,up_proj,down_proj}.weight``, router ``mlp.gate.weight``;
  DeepSeek-V3 adds ``mlp.gate.e_score_correction_bias [E]`` and the shared experts
  ``mlp.shared_experts.{gate_proj,up_proj,down_proj}.weight`` (intermediate ``S * I``).
- **DeepSeek-V3 FP8**: every projection's ``weight`` is float8_e4m3fn with a float32
  ``weight_scale_inv [ceil(N/128), ceil(K/128)]`` beside it. Despite its name it is the
  dequantization *multiplier* (``w ~= q * scale`` per 128x128 block), which is exactly the block
  ``w_scale`` of CONTRACT.md section 3 (``moe_*/ops/quant``: ``[E, ceil(N/128), ceil(K/128)]``).

Assembled (numpy; FP8 as ``ml_dtypes.float8_e4m3fn``, float weights as float32, exact for bf16):
``w13 = concat(gate, up) along N -> [E + S, 2I, H]``, ``w2 [E + S, H, I]``, block scales
``w13_scale [E + S, 2 * ceil(I/128), ceil(H/128)]`` (gate blocks, then up blocks: needs
``I % 128 == 0`` so the concatenation keeps the 128-row blocks), ``w2_scale [E + S, ceil(H/128),
ceil(I/128)]``, ``router_weight [E, H]`` float32, ``e_score_correction_bias [E]``. The ``S``
shared experts (DeepSeek-V3) become the fused shared experts ``E .. E + S - 1`` of the contract,
the ``S * I`` intermediate split into ``S`` experts of ``I`` (the MLP is a sum over intermediate
chunks, so this is exact).

Files: one ``.safetensors`` file, or a folder with ``model.safetensors.index.json`` (its
``weight_map``) or with ``*.safetensors`` files; ``config.json`` beside them, if there, gives the
routing (``num_experts_per_tok``, ``n_group``, ``topk_group``, ``routed_scaling_factor``,
``norm_topk_prob``). Errors (``ValueError``, ``FileNotFoundError``) name the key, the file, the
expected shape and what came.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import ml_dtypes
import numpy as np

from moe_contract.config import FP8_BLOCK, MoEConfig

ARCHS = ("mixtral", "qwen3_moe", "deepseek_v3")

#: arch -> (module prefix under the layer, gate / up / down projection names, router name)
_NAMES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), "gate"),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), "gate"),
    "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj"), "gate"),
}
_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.(block_sparse_moe|mlp)\.experts\.(\d+)\.")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _Files:
    """key -> file over one file, an index, or a folder of ``*.safetensors``; tensors read on demand."""

    def __init__(self, path: str):
        if not os.path.exists(path):
            raise FileNotFoundError(f"load_moe_layer: path {path!r} does not exist")
        self.folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    try:
                        weight_map = json.load(f)["weight_map"]
                    except (json.JSONDecodeError, KeyError) as exc:
                        raise ValueError(f"load_moe_layer: {index!r} is not a safetensors index with a 'weight_map' ({exc!r})") from exc
                self.where = {k: os.path.join(path, v) for k, v in weight_map.items()}
            else:
                files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
                if not files:
                    raise FileNotFoundError(f"load_moe_layer: no *.safetensors file and no model.safetensors.index.json in {path!r}")
                self.where = {k: fn for fn in files for k in self._keys(fn)}
        else:
            self.where = {k: path for k in self._keys(path)}
        self._open: dict = {}

    @staticmethod
    def _keys(fn: str) -> list[str]:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(fn, framework="pt") as f:
                return list(f.keys())
        except SafetensorError as exc:
            raise ValueError(f"load_moe_layer: {fn!r} is not a readable safetensors file ({exc})") from exc

    def has(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str, what: str) -> np.ndarray:
        """The tensor ``key`` as numpy (bf16 / fp16 -> float32 exactly, fp8 e4m3 -> ml_dtypes)."""
        if key not in self.where:
            raise ValueError(f"load_moe_layer: missing key {key!r} ({what}) in {self.folder!r}")
        from safetensors import safe_open
        import torch

        fn = self.where[key]
        if not os.path.exists(fn):
            raise FileNotFoundError(f"load_moe_layer: {fn!r} (listed for {key!r} in the index) does not exist")
        if fn not in self._open:
            self._open[fn] = safe_open(fn, framework="pt")
        t = self._open[fn].get_tensor(key)
        if t.dtype == torch.float8_e4m3fn:
            return t.contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
        if t.dtype in (torch.bfloat16, torch.float16):
            return t.float().numpy()
        return t.numpy()


@dataclasses.dataclass
class MoECheckpointLayer:
    """One MoE layer's weights, assembled (module docstring): numpy, all experts (routed then shared)."""

    arch: str
    layer: int
    w13: np.ndarray  # [E + S, 2I, H] float32, or float8_e4m3fn codes
    w2: np.ndarray  # [E + S, H, I]
    w13_scale: np.ndarray | None  # [E + S, 2*ceil(I/128), ceil(H/128)] float32 multiplier (FP8 checkpoints)
    w2_scale: np.ndarray | None  # [E + S, ceil(H/128), ceil(I/128)]
    router_weight: np.ndarray  # [E, H] float32
    e_score_correction_bias: np.ndarray | None  # [E] float32 (DeepSeek-V3)
    num_shared_experts: int
    hf_config: dict | None

    @property
    def num_experts(self) -> int:
        return self.router_weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]

    @property
    def is_fp8(self) -> bool:
        return self.w13_scale is not None

    def config(self, preset=None, **overrides) -> MoEConfig:
        """The layer's :class:`MoEConfig`: sizes from the tensors, routing from ``config.json`` (else
        from ``preset``, a ``moe_contract.ModelPreset``); ``overrides`` (quant, ep_size, ...) last."""
        fields = dict(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                      num_experts=self.num_experts, num_fused_shared_experts=self.num_shared_experts)
        c = self.hf_config
        if c is not None:
            topk = c.get("num_experts_per_tok")
            if self.arch == "mixtral":
                fields.update(topk=topk or 2, routing="softmax_topk", renormalize=True)
            elif self.arch == "qwen3_moe":
                fields.update(topk=topk, routing="softmax_topk", renormalize=bool(c.get("norm_topk_prob", True)))
            else:
                fields.update(topk=topk, routing="biased_grouped_topk", renormalize=bool(c.get("norm_topk_prob", True)),
                              num_expert_group=c.get("n_group"), topk_group=c.get("topk_group"),
                              routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)))
            if c.get("hidden_act", "silu") not in ("silu",):
                raise ValueError(f"load_moe_layer: hidden_act must be 'silu'; got {c.get('hidden_act')!r}")
        elif preset is not None:
            fields.update(topk=preset.topk, routing=preset.routing, renormalize=preset.renormalize,
                          num_expert_group=preset.num_expert_group, topk_group=preset.topk_group,
                          routed_scaling_factor=preset.routed_scaling_factor, activation=preset.activation)
        else:
            raise ValueError("MoECheckpointLayer.config: no config.json beside the weights; pass a preset for the routing")
        if fields.get("topk") is None:
            raise ValueError("MoECheckpointLayer.config: config.json has no num_experts_per_tok")
        if self.is_fp8 and overrides.get("quant", "fp8_block") == "fp8_per_token":
            pass  # dequantized and requantized per channel by layer_weights
        fields.update(overrides)
        return MoEConfig(**fields)

    def float_weights(self) -> tuple[np.ndarray, np.ndarray]:
        """``(w13, w2)`` float32 (FP8 checkpoints dequantized block by block)."""
        if not self.is_fp8:
            return self.w13, self.w2
        return dequantize_block(self.w13, self.w13_scale), dequantize_block(self.w2, self.w2_scale)

    def layer_weights(self, config: MoEConfig):
        """:class:`interop.crosscheck.LayerWeights` for ``config``: FP8 codes and scales as stored when
        ``config.quant='fp8_block'`` and the checkpoint is FP8, float weights otherwise."""
        from interop.crosscheck import LayerWeights

        if self.is_fp8 and config.quant == "fp8_block":
            w13, w2, s13, s2 = self.w13, self.w2, self.w13_scale, self.w2_scale
        else:
            (w13, w2), s13, s2 = self.float_weights(), None, None
        return LayerWeights(w13=w13, w2=w2, w13_scale=s13, w2_scale=s2, router_weight=self.router_weight,
                            e_score_correction_bias=self.e_score_correction_bias)

    def arrays(self, framework: str, config: MoEConfig | None = None) -> dict:
        """This EP rank's (``config``; default: all experts) weights as jax arrays or torch tensors:
        ``w13, w2, w13_scale, w2_scale, router_weight, e_score_correction_bias`` (scales None if float)."""
        from interop.crosscheck import from_numpy

        lo, n = config.local_expert_range() if config is not None else (0, self.w13.shape[0])
        out = {"w13": self.w13[lo:lo + n], "w2": self.w2[lo:lo + n],
               "w13_scale": None if self.w13_scale is None else self.w13_scale[lo:lo + n],
               "w2_scale": None if self.w2_scale is None else self.w2_scale[lo:lo + n],
               "router_weight": self.router_weight, "e_score_correction_bias": self.e_score_correction_bias}
        return {k: from_numpy(None if v is None else np.ascontiguousarray(v), framework) for k, v in out.items()}


def dequantize_block(q: np.ndarray, scale: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """``[..., N, K]`` FP8 codes times ``[..., ceil(N/b), ceil(K/b)]`` block multipliers, float32."""
    N, K = q.shape[-2:]
    s = np.repeat(np.repeat(scale.astype(np.float32), block, axis=-2)[..., :N, :], block, axis=-1)[..., :K]
    return q.astype(np.float32) * s


def _detect_arch(keys, hf_config: dict | None) -> str:
    if hf_config is not None and hf_config.get("model_type") in ARCHS:
        return hf_config["model_type"]
    if hf_config is not None and hf_config.get("model_type") == "deepseek_v2":
        raise ValueError("load_moe_layer: model_type 'deepseek_v2' is not supported (mixtral, qwen3_moe, deepseek_v3)")
    if any(".block_sparse_moe.experts." in k for k in keys):
        return "mixtral"
    if any(k.endswith("e_score_correction_bias") or ".shared_experts." in k or k.endswith("weight_scale_inv") for k in keys):
        return "deepseek_v3"
    if any(".mlp.experts." in k for k in keys):
        return "qwen3_moe"
    raise ValueError("load_moe_layer: no MoE expert weights found (expected keys like "
                     "'model.layers.L.block_sparse_moe.experts.i.w1.weight' or 'model.layers.L.mlp.experts.i.gate_proj.weight')")


def load_moe_layer(path: str, layer: int | None = None, arch: str | None = None) -> MoECheckpointLayer:
    """Load MoE layer ``layer`` (default: the first layer with experts) of the checkpoint at ``path``.

    Args:
      path: a ``.safetensors`` file, or a folder (``model.safetensors.index.json`` or ``*.safetensors``,
        optionally ``config.json``).
      layer: the decoder layer index ``L``.
      arch: ``"mixtral"``, ``"qwen3_moe"`` or ``"deepseek_v3"``; default: ``config.json``'s
        ``model_type``, else from the key names.

    Returns: :class:`MoECheckpointLayer`.

    Raises: FileNotFoundError (no file), ValueError (no MoE layer, missing key, wrong shape or dtype,
      FP8 without scales, ``I % 128 != 0`` with block scales), each naming the key.
    """
    files = _Files(path)
    cfg_path = os.path.join(files.folder, "config.json")
    hf_config = None
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            try:
                hf_config = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"load_moe_layer: {cfg_path!r} is not valid JSON ({exc})") from exc
    if arch is None:
        arch = _detect_arch(files.where, hf_config)
    if arch not in ARCHS:
        raise ValueError(f"load_moe_layer: arch must be one of {ARCHS}; got arch={arch!r}")
    module, (g_name, u_name, d_name), r_name = _NAMES[arch]
    layers = sorted({int(m.group(1)) for k in files.where if (m := _EXPERT_KEY.match(k)) and m.group(2) == module})
    if not layers:
        raise ValueError(f"load_moe_layer: no '{module}.experts.*' weights for arch {arch!r} in {files.folder!r}")
    if layer is None:
        layer = layers[0]
    elif layer not in layers:
        raise ValueError(f"load_moe_layer: layer must be one of the MoE layers {layers}; got layer={layer}")
    pre = f"model.layers.{layer}.{module}"

    router = files.get(f"{pre}.{r_name}.weight", "router weight [E, H]").astype(np.float32)
    if router.ndim != 2:
        raise ValueError(f"load_moe_layer: {pre}.{r_name}.weight must be [E, H]; got shape {router.shape}")
    E, H = router.shape
    bias = None
    if files.has(f"{pre}.{r_name}.e_score_correction_bias"):
        bias = files.get(f"{pre}.{r_name}.e_score_correction_bias", "").astype(np.float32)
        if bias.shape != (E,):
            raise ValueError(f"load_moe_layer: {pre}.{r_name}.e_score_correction_bias must be [E={E}]; got shape {bias.shape}")
    elif arch == "deepseek_v3":
        raise ValueError(f"load_moe_layer: missing key '{pre}.{r_name}.e_score_correction_bias' (DeepSeek-V3's router bias)")

    first = f"{pre}.experts.0.{g_name}.weight"
    fp8 = files.has(first + "_scale_inv") or (files.has(first) and files.get(first, "").dtype == ml_dtypes.float8_e4m3fn)
    probe = files.get(first, "expert 0 gate projection [I, H]")
    if probe.ndim != 2 or probe.shape[1] != H:
        raise ValueError(f"load_moe_layer: {first} must be [I, H={H}]; got shape {probe.shape}")
    I = probe.shape[0]
    if fp8 and I % FP8_BLOCK:
        raise ValueError(f"load_moe_layer: FP8 block scales need I % {FP8_BLOCK} == 0 to concatenate gate and up; got I={I}")

    def proj(prefix: str, name: str, shape: tuple[int, int]):
        key = f"{prefix}.{name}.weight"
        w = files.get(key, f"[{shape[0]}, {shape[1]}] projection")
        if w.shape != shape:
            raise ValueError(f"load_moe_layer: {key} must have shape {shape}; got {w.shape}")
        if not fp8:
            if w.dtype == ml_dtypes.float8_e4m3fn:
                raise ValueError(f"load_moe_layer: {key} is float8_e4m3fn but expert 0 is not; mixed checkpoints are not supported")
            return w.astype(np.float32), None
        if w.dtype != ml_dtypes.float8_e4m3fn:
            raise ValueError(f"load_moe_layer: {key} must be float8_e4m3fn in an FP8 checkpoint; got {w.dtype}")
        s = files.get(key + "_scale_inv", "its FP8 block scale (the dequantization multiplier)").astype(np.float32)
        want = (_ceil_div(shape[0], FP8_BLOCK), _ceil_div(shape[1], FP8_BLOCK))
        if s.shape != want:
            raise ValueError(f"load_moe_layer: {key}_scale_inv must be [ceil(N/128), ceil(K/128)] = {want}; got {s.shape}")
        return w, s

    def expert(prefix: str, inter: int):
        g, gs = proj(prefix, g_name, (inter, H))
        u, us = proj(prefix, u_name, (inter, H))
        d, ds = proj(prefix, d_name, (H, inter))
        w13 = np.concatenate([g, u], axis=0)
        s13 = None if gs is None else np.concatenate([gs, us], axis=0)
        return w13, s13, d, ds

    parts = [expert(f"{pre}.experts.{i}", I) for i in range(E)]
    extra = sorted({int(m.group(3)) for k in files.where if (m := _EXPERT_KEY.match(k))
                    and int(m.group(1)) == layer and m.group(2) == module and int(m.group(3)) >= E})
    if extra:
        raise ValueError(f"load_moe_layer: experts {extra} exist but the router {pre}.{r_name}.weight has E={E} rows")

    S = 0
    shared_pre = f"{pre}.shared_experts"
    if files.has(f"{shared_pre}.{g_name}.weight"):
        sg = files.get(f"{shared_pre}.{g_name}.weight", "shared experts' gate projection")
        if sg.ndim != 2 or sg.shape[1] != H or sg.shape[0] % I:
            raise ValueError(f"load_moe_layer: {shared_pre}.{g_name}.weight must be [S * I, H] with I={I}, H={H}; got {sg.shape}")
        S = sg.shape[0] // I
        w13, s13, d, ds = expert(shared_pre, S * I)
        nb = I // FP8_BLOCK if fp8 else 0
        for k in range(S):  # shared expert k: intermediate rows / columns [k*I, (k+1)*I)
            rows = np.r_[k * I:(k + 1) * I, S * I + k * I:S * I + (k + 1) * I]
            ks = None if s13 is None else np.concatenate([s13[k * nb:(k + 1) * nb], s13[S * nb + k * nb:S * nb + (k + 1) * nb]])
            kd = None if ds is None else ds[:, k * nb:(k + 1) * nb]
            parts.append((w13[rows], ks, np.ascontiguousarray(d[:, k * I:(k + 1) * I]), kd))

    w13 = np.stack([p[0] for p in parts])
    w2 = np.stack([p[2] for p in parts])
    s13 = np.stack([p[1] for p in parts]) if fp8 else None
    s2 = np.stack([p[3] for p in parts]) if fp8 else None
    return MoECheckpointLayer(arch=arch, layer=layer, w13=w13, w2=w2, w13_scale=s13, w2_scale=s2, router_weight=router,
                              e_score_correction_bias=bias, num_shared_experts=S, hf_config=hf_config)
