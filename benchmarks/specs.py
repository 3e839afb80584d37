"""Benchmark problems as data: grouped GEMM, layer and gate specs.

Each spec is a frozen dataclass that knows its FLOPs and the fewest bytes it must move, so the
harness can turn a time into TFLOP/s, GB/s and a percentage of the roofline floor. Nothing here
imports torch or jax: the specs are shared by ``benchmarks/bench.py`` and the CPU tests.

Shapes:

- grouped GEMM: ``E = 32`` experts (DeepSeek-V3's 256 over EP = 8), ``[M, K] x [E, N, K]``,
  ``gate_up`` (K=7168, N=4096 = 2 * I) and ``down`` (K=2048, N=7168), M in {256, 2048, 16384}
  routed rows, rows per expert ``uniform`` or ``zipf``-skewed, dtype ``bf16``, ``fp8`` (per-token
  activation scales ``[M, 1]`` x per-output-channel weight scales ``[E, N]``) or ``fp8_block``
  (DeepSeek-V3's: activation scales per ``1 x 128`` group ``[M, K/128]`` x weight scales per
  ``128 x 128`` block ``[E, ceil(N/128), K/128]``, CONTRACT.md sections 3-4; ``K % 128 == 0``). FP8 codes
  are float8_e4m3fn, scales float32; ``min_bytes`` counts the scales. ``--quick``: bf16 and fp8 only.
- layer: E=32, topk=8, H=7168, I=2048, softmax top-k with renormalisation, T in {32, 512, 4096},
  quant ``none``, ``fp8_per_token`` or ``fp8_block`` (:data:`LAYER_QUANTS`; a model's layer: those its
  sizes allow, :func:`layer_quants`).
- gate: DeepSeek-V3's biased grouped top-k (E=256, 8 groups keep 4, topk 8, rsf 2.5, one fused
  shared expert), T=4096.
- backward (training, CONTRACT.md section 8; ``bench.py --what gemm_bwd,layer_bwd``): the grouped
  GEMM forward + backward (``d_x`` and ``d_w``) of ``gate_up`` and ``down`` at M in {4096, 16384},
  uniform rows, bf16 (:class:`GemmBwdSpec`); the layer forward + backward (gradients of ``x``,
  ``router_logits``, ``w13``, ``w2``) at T in {512, 4096}, bf16 (:class:`LayerBwdSpec`). Their
  ``flops`` count the forward and the backward (``3 x`` the forward's: the backward is two GEMMs per
  forward GEMM, ``d_x`` and ``d_w``); ``fwd_flops`` and ``bwd_flops`` each part.

With a :class:`BenchModel` (``bench.py --preset NAME`` or ``--weights PATH``) every spec takes that
layer's shapes and routing instead: grouped GEMMs ``gate_up`` (K=H, N=2I) and ``down`` (K=I, N=H)
over its E routed experts, the layer with its routing, top-k and shared experts, the gate with its
routing. Spec names then carry the model's name (``layer/<model>/E=...``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from moe_contract import MoEConfig, get_preset
from moe_contract.config import FP8_BLOCK, QUANTS
# the routings' rows per expert are the tuners' too (epmoe tune): one definition, in the package
from moe_contract.tuning import ROUTINGS, ZIPF_S, group_sizes  # noqa: F401

#: name -> (K, N) of the expert weight ``[E, N, K]``.
GEMM_SHAPES = {"gate_up": (7168, 4096), "down": (2048, 7168)}
GEMM_M = (256, 2048, 16384)
GEMM_E = 32
#: The grouped GEMM rows' dtypes: ``bf16``; ``fp8`` per-token x per-output-channel scales; ``fp8_block`` 1x128
#: activation groups x 128x128 weight blocks (DeepSeek-V3). ``--quick`` times :data:`GEMM_DTYPES_QUICK`.
GEMM_DTYPES = ("bf16", "fp8", "fp8_block")
GEMM_DTYPES_QUICK = ("bf16", "fp8")
LAYER_T = (32, 512, 4096)
#: The backward specs' sizes: routed rows of the grouped GEMM, tokens of the layer.
GEMM_BWD_M = (4096, 16384)
LAYER_BWD_T = (512, 4096)
#: The layer rows' quant modes (a model's layer: those its sizes allow, :func:`layer_quants`).
LAYER_QUANTS = ("none", "fp8_per_token", "fp8_block")
#: The layer quant modes the layer rows can time (every mode of the contract).
BENCH_QUANTS = tuple(QUANTS)
#: Bytes a weight element costs in each layer quant mode, its scales included (CONTRACT.md sections 3 and 9):
#: bf16 2; FP8 1 (its float32 scales are one per output channel or per 128x128 block: < 0.1%, not counted);
#: MXFP4 half a byte + one e8m0 byte per 32 (4.25 bits); INT4 half a byte + one bf16 scale per 32 (4.5 bits).
WEIGHT_BYTES = {"none": 2.0, "fp8_per_token": 1.0, "fp8_block": 1.0, "mxfp4": 0.5 + 1 / 32, "int4": 0.5 + 2 / 32}
#: The decode rows (``bench.py --what decode``): tokens per step, and the models in the weight format each ships in,
#: with the expert parallelism it is served with (``(preset, quant, ep_size)``; an EP row is the last rank's part: its
#: routed experts and the shared ones). ``--preset`` takes that model's layer in :data:`DECODE_QUANTS` instead.
DECODE_T = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_MODELS = (("gpt-oss-120b", "mxfp4", 1), ("deepseek-v3", "fp8_block", 8), ("qwen3-30b-a3b", "none", 1),
                 ("kimi-k2", "int4", 1))
DECODE_QUANTS = ("none", "mxfp4", "int4")
DECODE_PRESET = "gpt-oss-120b"

#: The transformers 5.24 MoE block of each checkpoint ``model_type``: the peer of the layer rows
#: (``transformers.models.<model_type>.modeling_<model_type>``).
HF_BLOCKS = {"mixtral": "MixtralSparseMoeBlock", "qwen3_moe": "Qwen3MoeSparseMoeBlock", "deepseek_v3": "DeepseekV3MoE",
             "gpt_oss": "GptOssMLP"}

#: Bytes per element of the operands of each dtype name.
ITEMSIZE = {"bf16": 2, "fp8": 1, "fp8_block": 1, "fp32": 4}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmSpec:
    """One grouped GEMM ``y [M, N] = x [M, K] @ w[e].T`` with ``w [E, N, K]``, ``y`` bf16.

    ``dtype`` (:data:`GEMM_DTYPES`): ``"bf16"``; ``"fp8"``: float8_e4m3fn ``x`` and ``w`` with float32
    scales ``[M, 1]`` (per token) and ``[E, N]`` (per output channel); ``"fp8_block"``: float8_e4m3fn with
    float32 scales ``[M, K/128]`` (per ``1 x 128`` group of ``x``) and ``[E, ceil(N/128), K/128]`` (per
    ``128 x 128`` block of ``w``), DeepSeek-V3's layout (CONTRACT.md sections 3-4).

    Raises: ValueError (``dtype`` not in :data:`GEMM_DTYPES`; ``fp8_block`` with ``K % 128 != 0``: the
    activation groups must tile ``K``).
    """

    shape: str  # "gate_up" | "down" | "tiny"
    E: int
    K: int
    N: int
    M: int
    routing: str  # "uniform" | "zipf"
    dtype: str  # "bf16" | "fp8" | "fp8_block"
    seed: int = 0
    model: str = ""  # BenchModel.name ("": the default shapes)

    def __post_init__(self) -> None:
        if self.dtype not in GEMM_DTYPES:
            raise ValueError(f"GemmSpec: dtype must be one of {GEMM_DTYPES}; got dtype={self.dtype!r}")
        if self.dtype == "fp8_block" and self.K % FP8_BLOCK:
            raise ValueError(f"GemmSpec: K must be a multiple of {FP8_BLOCK} for dtype='fp8_block' (x is quantized per "
                             f"1x{FP8_BLOCK} group along K); got K={self.K}")

    @property
    def name(self) -> str:
        return f"gemm/{self.model + '/' if self.model else ''}{self.shape}/{self.dtype}/M={self.M}/{self.routing}"

    def group_sizes(self) -> np.ndarray:
        return group_sizes(self.M, self.E, self.routing, self.seed)

    def expert_offsets(self) -> np.ndarray:
        """``[E + 1]`` int32: 0 then the cumulative row counts (the contract's offsets)."""
        return np.concatenate([[0], np.cumsum(self.group_sizes())]).astype(np.int32)

    @property
    def flops(self) -> float:
        return 2.0 * self.M * self.N * self.K

    @property
    def min_bytes(self) -> float:
        """x read once, the weights of experts that got rows read once, y (bf16) written once, and the float32
        scales: ``fp8`` ``[M, 1]`` and ``[E, N]``; ``fp8_block`` ``[M, K/128]`` and the ``ceil(N/128) * K/128``
        blocks of each expert that got rows."""
        b = ITEMSIZE[self.dtype]
        active = int((self.group_sizes() > 0).sum())
        scales = 0
        if self.dtype == "fp8":
            scales = (self.M + self.E * self.N) * 4
        elif self.dtype == "fp8_block":
            kb, nb = -(-self.K // FP8_BLOCK), -(-self.N // FP8_BLOCK)
            scales = (self.M * kb + active * nb * kb) * 4
        return float(self.M * self.K * b + active * self.N * self.K * b + self.M * self.N * 2 + scales)

    def fields(self) -> dict:
        return dict(shape=self.shape, E=self.E, M=self.M, K=self.K, N=self.N, routing=self.routing, dtype=self.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """One MoE layer forward ``x [T, H] -> [T, H]``: softmax top-k, renormalised, silu (the default
    specs), or the routing of ``base`` (a :class:`BenchModel`'s config: any routing, shared experts).

    ``arch``: the transformers block that is the peer of this layer (a key of :data:`HF_BLOCKS`), or
    None where transformers has none (plain grouped top-k)."""

    T: int
    quant: str  # "none" | "fp8_per_token" | "fp8_block" | "mxfp4" | "int4"
    E: int = 32
    topk: int = 8
    H: int = 7168
    I: int = 2048  # noqa: E741 (the contract's name)
    seed: int = 0
    model: str = ""  # BenchModel.name ("": the default layer)
    base: MoEConfig | None = None  # routing and sizes (quant 'none'); None: softmax top-k, renormalised
    arch: str | None = "qwen3_moe"
    #: Routed experts the row's tokens actually reach (set by the benchmark from its routing); None: the
    #: expected number under uniform routing (:attr:`min_bytes`).
    touched: int | None = None

    def __post_init__(self) -> None:
        if self.quant not in BENCH_QUANTS:
            raise ValueError(f"LayerSpec: quant must be one of {BENCH_QUANTS}; got quant={self.quant!r}")
        if self.touched is not None and not 0 <= self.touched <= self.E:
            raise ValueError(f"LayerSpec: touched must be None or in [0, E={self.E}]; got touched={self.touched!r}")
        if self.arch is not None and self.arch not in HF_BLOCKS:
            raise ValueError(f"LayerSpec: arch must be one of {tuple(HF_BLOCKS)} or None; got arch={self.arch!r}")
        b = self.base
        if b is not None and (b.num_experts, b.topk, b.hidden_size, b.intermediate_size) != (self.E, self.topk, self.H, self.I):
            raise ValueError(f"LayerSpec: E, topk, H, I must be those of base (={b.num_experts}, {b.topk}, {b.hidden_size}, "
                             f"{b.intermediate_size}); got {self.E}, {self.topk}, {self.H}, {self.I}")

    @property
    def name(self) -> str:
        return f"layer/{self.model + '/' if self.model else ''}E={self.E}/H={self.H}/I={self.I}/{self.quant}/T={self.T}"

    @property
    def dtype(self) -> str:
        """The GEMMs' input dtype (the roofline's peak FLOP/s): FP8 for the FP8 modes; bf16 for ``none`` and the
        4-bit weight-only modes (their weights are decoded to bf16 in the kernel)."""
        return "fp8" if self.quant.startswith("fp8") else "bf16"

    def config(self) -> MoEConfig:
        if self.base is not None:
            return self.base.replace(quant=self.quant)
        return MoEConfig(hidden_size=self.H, intermediate_size=self.I, num_experts=self.E, topk=self.topk,
                         routing="softmax_topk", renormalize=True, quant=self.quant)

    @property
    def num_shared(self) -> int:
        """``S``: fused shared experts (every token goes through each)."""
        return self.base.num_fused_shared_experts if self.base is not None else 0

    @property
    def flops(self) -> float:
        """Both GEMMs over the ``T * (topk + S)`` routed and shared rows: ``2 M (2I) H + 2 M H I``."""
        return 6.0 * self.T * (self.topk + self.num_shared) * self.H * self.I

    @property
    def hit_experts(self) -> float:
        """Experts whose weights the layer must read: the routed experts the tokens reach (:attr:`touched`,
        else the expected number under uniform routing, ``E (1 - (1 - topk/E)^T)``) and the shared experts."""
        routed = self.touched if self.touched is not None else self.E * (1.0 - (1.0 - self.topk / self.E) ** self.T)
        return routed + self.num_shared

    @property
    def min_bytes(self) -> float:
        """Weights of :attr:`hit_experts` (:data:`WEIGHT_BYTES` of the quant mode a weight, scales included;
        with expert biases, their ``2I + H`` bf16 values), ``x`` read and ``out`` written (bf16)."""
        wb = WEIGHT_BYTES[self.quant]
        bias = (2 * self.I + self.H) * 2 if self.base is not None and self.base.expert_bias else 0
        return float(self.hit_experts * (3 * self.H * self.I * wb + bias) + 2 * self.T * self.H * 2)

    def fields(self) -> dict:
        return dict(E=self.E, T=self.T, H=self.H, I=self.I, topk=self.topk, quant=self.quant, dtype=self.dtype,
                    routing=self.config().routing, shape=self.model or None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeSpec(LayerSpec):
    """One MoE layer forward at decode sizes (``bench.py --what decode``): the layer of :class:`LayerSpec`,
    where the weights the step reads are the floor. The benchmark sets :attr:`touched` from the routing of
    its tokens (the routed experts of this rank they reach), so the row's bytes (and its % of the copy ceiling)
    are those of the experts actually read. ``ep_size > 1``: the last EP rank's part of the layer (its
    ``E / ep_size`` routed experts and the shared ones; the output is that rank's partial sum)."""

    ep_size: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ep_size < 1 or self.E % self.ep_size:
            raise ValueError(f"DecodeSpec: ep_size must be >= 1 and divide E={self.E}; got ep_size={self.ep_size!r}")

    @property
    def name(self) -> str:
        return "decode" + super().name[len("layer"):] + (f"/ep{self.ep_size}" if self.ep_size > 1 else "")

    def config(self) -> MoEConfig:
        c = super().config()
        return c.replace(ep_size=self.ep_size, ep_rank=self.ep_size - 1) if self.ep_size > 1 else c

    @property
    def flops(self) -> float:
        """This rank's share of the routed rows (uniform routing's expectation) and every shared row."""
        return 6.0 * self.T * (self.topk / self.ep_size + self.num_shared) * self.H * self.I

    @property
    def hit_experts(self) -> float:
        """This rank's routed experts the tokens reach (:attr:`touched`, else uniform routing's expectation over
        its ``E / ep_size``) and the shared experts (on the last rank: this one)."""
        if self.ep_size == 1:
            return super().hit_experts
        local = self.E // self.ep_size
        routed = self.touched if self.touched is not None else local * (1.0 - (1.0 - self.topk / self.E) ** self.T)
        return routed + self.num_shared

    def fields(self) -> dict:
        return dict(super().fields(), ep_size=self.ep_size) if self.ep_size > 1 else super().fields()


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmBwdSpec(GemmSpec):
    """One grouped GEMM forward and backward: ``y = x @ w[e].T``, then from ``d_y [M, N]``
    ``d_x = d_y @ w[e]`` ``[M, K]`` and ``d_w[e] = d_y[rows(e)].T @ x[rows(e)]`` ``[E, N, K]``
    (CONTRACT.md section 8). Float (bf16) only: FP8 codes get no gradient."""

    def __post_init__(self) -> None:
        if self.dtype != "bf16":
            raise ValueError(f"GemmBwdSpec: dtype must be 'bf16' (FP8 codes are not differentiable); got dtype={self.dtype!r}")

    @property
    def name(self) -> str:
        return "gemm_bwd" + super().name[len("gemm"):]

    @property
    def fwd_flops(self) -> float:
        return 2.0 * self.M * self.N * self.K

    @property
    def bwd_flops(self) -> float:
        """``d_x`` and ``d_w``: two GEMMs of the forward's size."""
        return 2.0 * self.fwd_flops

    @property
    def flops(self) -> float:
        """Forward and backward."""
        return self.fwd_flops + self.bwd_flops

    @property
    def min_bytes(self) -> float:
        """The forward's (:attr:`GemmSpec.min_bytes`), then ``d_y`` and ``x`` read, the weights of the
        experts with rows read, ``d_x`` and those experts' ``d_w`` written, once each (bf16)."""
        active = int((self.group_sizes() > 0).sum())
        return super().min_bytes + float(2 * (self.M * self.N + 2 * self.M * self.K + 2 * active * self.N * self.K))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerBwdSpec(LayerSpec):
    """One MoE layer forward and backward (CONTRACT.md section 8): from ``d_out [T, H]`` the gradients of
    ``x``, ``router_logits``, ``w13`` and ``w2``. Float layers only (``quant='none'``: the rows time the
    weight gradients too)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.quant != "none":
            raise ValueError(f"LayerBwdSpec: quant must be 'none' (FP8 weight codes get no gradient); got quant={self.quant!r}")

    @property
    def name(self) -> str:
        return "layer_bwd" + super().name[len("layer"):]

    @property
    def fwd_flops(self) -> float:
        """The forward's two GEMMs (:attr:`LayerSpec.flops`)."""
        return super().flops

    @property
    def bwd_flops(self) -> float:
        """Two GEMMs (``d_input`` and ``d_weight``) per forward GEMM. ``recompute=True`` runs GEMM 1 once
        more (``fwd_flops * 2 / 3``), not counted: it is the price of the memory saved, not useful work."""
        return 2.0 * self.fwd_flops

    @property
    def flops(self) -> float:
        """Forward and backward."""
        return self.fwd_flops + self.bwd_flops

    @property
    def min_bytes(self) -> float:
        """The forward's (:attr:`LayerSpec.min_bytes`), then the weights of the experts with rows read
        again, every expert's weight gradient written, ``x`` and ``d_out`` read and ``d_x`` written (bf16)."""
        hit = self.E * (1.0 - (1.0 - self.topk / self.E) ** self.T) + self.num_shared
        n = self.E + self.num_shared
        return super().min_bytes + float((hit + n) * 3 * self.H * self.I * 2 + 3 * self.T * self.H * 2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GateSpec:
    """The gate alone on ``router_logits [T, E]`` float32: the routing and sizes of ``moe`` if given
    (a :class:`BenchModel`'s config; ``preset`` is then its name), else of the preset ``preset``."""

    T: int
    preset: str = "deepseek-v3"
    seed: int = 0
    moe: MoEConfig | None = None

    def config(self) -> MoEConfig:
        return self.moe if self.moe is not None else get_preset(self.preset).config()

    @property
    def name(self) -> str:
        c = self.config()
        return f"gate/{self.preset}/{c.routing}/E={c.num_experts}/T={self.T}"

    @property
    def flops(self) -> float:
        return 0.0  # a handful of float ops per logit: never the limit

    @property
    def min_bytes(self) -> float:
        """Logits (float32) and bias read once; weights (float32) and ids (int32) written once."""
        c = self.config()
        return float(self.T * c.num_experts * 4 + c.num_experts * 4 + self.T * c.num_slots * 8)

    def fields(self) -> dict:
        c = self.config()
        return dict(E=c.num_experts, T=self.T, topk=c.topk, routing=c.routing, dtype="fp32", shape=self.preset)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchModel:
    """The layer the benchmark is about when ``--preset`` or ``--weights`` names one.

    ``name``: a preset name or ``ckpt-<model_type>-L<layer>`` (goes into the spec names; no ``/``).
    ``config``: its shapes and routing (quant 'none', one device). ``arch``: the transformers block of
    its layer rows' peer (a key of :data:`HF_BLOCKS`; None: none). ``quants``: the quant modes of the
    layer rows. ``weights``: True when the layer rows run a checkpoint's weights (the GEMM and gate
    rows always draw their own inputs of these shapes).
    """

    name: str
    config: MoEConfig
    arch: str | None
    quants: tuple[str, ...] = LAYER_QUANTS
    weights: bool = False

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"BenchModel: name must be non-empty without '/'; got name={self.name!r}")
        if self.arch is not None and self.arch not in HF_BLOCKS:
            raise ValueError(f"BenchModel: arch must be one of {tuple(HF_BLOCKS)} or None; got arch={self.arch!r}")
        if self.config.quant != "none" or self.config.ep_size != 1:
            raise ValueError(f"BenchModel: config must have quant='none' and ep_size=1; got quant={self.config.quant!r}, "
                             f"ep_size={self.config.ep_size}")
        bad = [q for q in self.quants if q not in BENCH_QUANTS]
        if bad or not self.quants:
            raise ValueError(f"BenchModel: quants must be a non-empty tuple of {BENCH_QUANTS}; got {self.quants!r}")

    @property
    def weight_elements(self) -> int:
        """Elements of ``w13`` and ``w2`` over all experts (routed and shared)."""
        c = self.config
        return 3 * c.num_total_experts * c.hidden_size * c.intermediate_size


def arch_of_preset(name: str) -> str | None:
    """The transformers block of a preset's layer: DeepSeek-V3's for biased grouped top-k (also the
    ``tiny`` preset; GLM-4.5-Air's ``Glm4MoeMoE`` and Kimi K2 compute the same), Mixtral's for ``mixtral-*``,
    Qwen3-MoE's for other softmax top-k without shared experts, gpt-oss's ``GptOssMLP`` for ``gpt-oss-*``; None
    otherwise: no block of those expresses ``sigmoid_topk`` (Llama 4) or Qwen3-Next's shared expert."""
    p = get_preset(name)
    if name.startswith("gpt-oss"):
        return "gpt_oss"
    if p.activation != "silu" or p.gate_up_layout != "concatenated":
        return None
    if p.routing == "biased_grouped_topk":
        return "deepseek_v3"
    if p.routing == "softmax_topk" and p.num_shared_experts == 0 and p.routed_scaling_factor == 1.0:
        return "mixtral" if name.startswith("mixtral") else "qwen3_moe"
    return None


def layer_quants(config: MoEConfig, quants: tuple[str, ...] = LAYER_QUANTS) -> tuple[str, ...]:
    """The modes of ``quants`` that ``config``'s layer can take (``config.replace(quant=q)`` valid): ``fp8_block``
    needs H and I multiples of 128 (gpt-oss's 2880 are not), the 4-bit modes multiples of 32."""
    out = []
    for q in quants:
        try:
            config.replace(quant=q)
        except ValueError:
            continue
        out.append(q)
    return tuple(out)


def preset_model(name: str) -> BenchModel:
    """The :class:`BenchModel` of preset ``name``, its layer rows in the :data:`LAYER_QUANTS` its sizes allow
    (:func:`layer_quants`). Raises ValueError (listing the presets) if ``name`` is unknown."""
    config = get_preset(name).config()
    return BenchModel(name=name, config=config, arch=arch_of_preset(name), quants=layer_quants(config))


def gemm_specs(quick: bool = False, tiny: bool = False, model: BenchModel | None = None) -> list[GemmSpec]:
    """Full: 2 shapes x 3 M x 2 routings x 3 dtypes (:data:`GEMM_DTYPES`) = 36. Quick: gate_up, M in {256,
    16384}, uniform, bf16 and fp8 (:data:`GEMM_DTYPES_QUICK`; 4). Tiny (CPU smoke test): E=4, K=64, N=32, M in
    {16, 64}; ``fp8_block`` at K=256, N=160 (two K-blocks, an N tail). With ``model``: its ``gate_up`` (K=H,
    N=2I) and ``down`` (K=I, N=H) over its E routed experts, the same M (tiny: 16, 64) and routings;
    ``fp8_block`` only for a shape with ``K % 128 == 0``."""
    ms = (16, 64) if tiny else (256, 16384) if quick else GEMM_M
    routings = ("uniform",) if quick else ROUTINGS
    dtypes = GEMM_DTYPES_QUICK if quick else GEMM_DTYPES
    if model is not None:
        c = model.config
        shapes = {"gate_up": (c.hidden_size, 2 * c.intermediate_size), "down": (c.intermediate_size, c.hidden_size)}
        if quick:
            shapes.pop("down")
        return [GemmSpec(shape=s, E=c.num_experts, K=k, N=n, M=M, routing=r, dtype=d, model=model.name)
                for d in dtypes for s, (k, n) in shapes.items() for M in ms for r in routings
                if d != "fp8_block" or k % FP8_BLOCK == 0]
    if tiny:
        return [GemmSpec(shape="tiny", E=4, K=(2 * FP8_BLOCK if d == "fp8_block" else 64),
                         N=(FP8_BLOCK + 32 if d == "fp8_block" else 32), M=M, routing=r, dtype=d)
                for d in dtypes for M in ms for r in ROUTINGS]
    shapes = ("gate_up",) if quick else tuple(GEMM_SHAPES)
    return [GemmSpec(shape=s, E=GEMM_E, K=GEMM_SHAPES[s][0], N=GEMM_SHAPES[s][1], M=M, routing=r, dtype=d)
            for d in dtypes for s in shapes for M in ms for r in routings]


def layer_specs(quick: bool = False, tiny: bool = False, model: BenchModel | None = None,
                ts: tuple[int, ...] | None = None) -> list[LayerSpec]:
    """Full: T in {32, 512, 4096} x quant :data:`LAYER_QUANTS` (none, fp8_per_token, fp8_block) = 9. Quick:
    T=512, every quant (3). Tiny: E=4, topk=2, H=64, I=32 (``fp8_block``: H=I=128, its block), T in {4, 16}.
    With ``model``: its layer (routing, shared experts, peer block) and its quant modes, at the same T.
    ``ts``: these token counts instead (``bench.py --ts``, any T)."""
    ts = tuple(ts) if ts else (4, 16) if tiny else (512,) if quick else LAYER_T
    if model is not None:
        c = model.config
        return [LayerSpec(T=T, quant=q, E=c.num_experts, topk=c.topk, H=c.hidden_size, I=c.intermediate_size,
                          model=model.name, base=c, arch=model.arch) for q in model.quants for T in ts]
    if tiny:
        return [LayerSpec(T=T, quant=q, E=4, topk=2, H=FP8_BLOCK if q == "fp8_block" else 64,
                          I=FP8_BLOCK if q == "fp8_block" else 32) for q in LAYER_QUANTS for T in ts]
    return [LayerSpec(T=T, quant=q) for q in LAYER_QUANTS for T in ts]


def decode_specs(quick: bool = False, tiny: bool = False, model: BenchModel | None = None,
                 ts: tuple[int, ...] | None = None) -> list[DecodeSpec]:
    """The decode rows, T in :data:`DECODE_T` (quick: {1, 64}; ``ts``: these T, ``bench.py --ts``): each model of
    :data:`DECODE_MODELS` in its shipped format (gpt-oss-120b MXFP4, DeepSeek-V3 FP8 blocks as one EP8 rank,
    Qwen3-30B-A3B bf16, Kimi K2 INT4; quick: the first two); with ``model``: its layer in each of
    :data:`DECODE_QUANTS` (quick: bf16 and MXFP4). Tiny (CPU): gpt-oss's layer at E=4, topk 2, H=64, I=32, T in
    {1, 4}, in :data:`DECODE_QUANTS`."""
    ts = tuple(ts) if ts else (1, 4) if tiny else (1, 64) if quick else DECODE_T
    qs = DECODE_QUANTS[:2] if quick else DECODE_QUANTS
    if model is None and tiny:
        base = preset_model(DECODE_PRESET)
        c = base.config.replace(num_experts=4, topk=2, hidden_size=64, intermediate_size=32)
        model = BenchModel(name="gpt-oss-tiny", config=c, arch=base.arch)
    if model is not None:
        runs = [(model, q, 1) for q in qs]
    else:
        runs = [(preset_model(name), q, ep) for name, q, ep in (DECODE_MODELS[:2] if quick else DECODE_MODELS)]
    out = []
    for m, q, ep in runs:
        c = m.config
        out += [DecodeSpec(T=T, quant=q, E=c.num_experts, topk=c.topk, H=c.hidden_size, I=c.intermediate_size,
                           model=m.name, base=c, arch=m.arch, ep_size=ep) for T in ts]
    return out


def gemm_bwd_specs(quick: bool = False, tiny: bool = False, model: BenchModel | None = None) -> list[GemmBwdSpec]:
    """Forward + backward, bf16, uniform rows. Full: ``gate_up`` (K=7168, N=4096) and ``down`` (K=2048,
    N=7168), E=32, M in {4096, 16384} (4). Quick: ``gate_up`` at M=4096 (1). Tiny (CPU, kernels
    interpreted): E=4, K=64, N=32, M=64 (1). With ``model``: its ``gate_up`` (K=H, N=2I) and ``down``
    (K=I, N=H) over its E routed experts, the same M."""
    ms = (64,) if tiny else GEMM_BWD_M[:1] if quick else GEMM_BWD_M
    if model is not None:
        c = model.config
        shapes = {"gate_up": (c.hidden_size, 2 * c.intermediate_size), "down": (c.intermediate_size, c.hidden_size)}
        E, name = c.num_experts, model.name
    elif tiny:
        shapes, E, name = {"tiny": (64, 32)}, 4, ""
    else:
        shapes, E, name = dict(GEMM_SHAPES), GEMM_E, ""
    if quick:
        shapes = dict(list(shapes.items())[:1])
    return [GemmBwdSpec(shape=s, E=E, K=k, N=n, M=M, routing="uniform", dtype="bf16", model=name)
            for s, (k, n) in shapes.items() for M in ms]


def layer_bwd_specs(quick: bool = False, tiny: bool = False, model: BenchModel | None = None,
                    ts: tuple[int, ...] | None = None) -> list[LayerBwdSpec]:
    """Forward + backward, bf16. Full: the built-in layer (E=32, topk 8, H=7168, I=2048) at T in {512,
    4096} (2). Quick: T=512 (1). Tiny (CPU, kernels interpreted): E=4, topk 2, H=64, I=32, T=16 (1).
    With ``model``: its layer (routing, shared experts, peer block), the same T. ``ts``: these T instead."""
    ts = tuple(ts) if ts else (16,) if tiny else LAYER_BWD_T[:1] if quick else LAYER_BWD_T
    if model is not None:
        c = model.config
        return [LayerBwdSpec(T=T, quant="none", E=c.num_experts, topk=c.topk, H=c.hidden_size, I=c.intermediate_size,
                             model=model.name, base=c, arch=model.arch) for T in ts]
    if tiny:
        return [LayerBwdSpec(T=T, quant="none", E=4, topk=2, H=64, I=32) for T in ts]
    return [LayerBwdSpec(T=T, quant="none") for T in ts]


def gate_specs(quick: bool = False, tiny: bool = False, model: BenchModel | None = None) -> list[GateSpec]:
    """DeepSeek-V3's gate at T=4096 (tiny: the ``tiny`` preset, T=64); with ``model``: its gate."""
    T = 64 if tiny else 4096
    if model is not None:
        return [GateSpec(T=T, preset=model.name, moe=model.config)]
    return [GateSpec(T=T, preset="tiny")] if tiny else [GateSpec(T=T)]


def rotation_sets(bytes_per_set: float, l2_bytes: float, cap: int = 32) -> int:
    """How many input sets to cycle so that a set is evicted from L2 before its next use:
    1 when one set is over twice the L2, otherwise enough that the other sets cover twice the L2."""
    if bytes_per_set >= 2 * l2_bytes:
        return 1
    return int(min(cap, 1 + math.ceil(2 * l2_bytes / max(bytes_per_set, 1.0))))
