"""Benchmark problems as data: grouped GEMM, layer and gate specs (STYLE.md, "Benchmarks").

Each spec is a frozen dataclass that knows its FLOPs and the fewest bytes it must move, so the
harness can turn a time into TFLOP/s, GB/s and a percentage of the roofline floor. Nothing here
imports torch or jax: the specs are shared by ``benchmarks/bench.py`` and the CPU tests.

Shapes (ENVIRONMENT.md, "The GPU machine in numbers"):

- grouped GEMM: ``E = 32`` experts (DeepSeek-V3's 256 over EP = 8), ``[M, K] x [E, N, K]``,
  ``gate_up`` (K=7168, N=4096 = 2 * I) and ``down`` (K=2048, N=7168), M in {256, 2048, 16384}
  routed rows, rows per expert ``uniform`` or ``zipf``-skewed, bf16 or fp8 (per-token activation
  scales ``[M, 1]`` x per-output-channel weight scales ``[E, N]``).
- layer: E=32, topk=8, H=7168, I=2048, softmax top-k with renormalisation, T in {32, 512, 4096},
  quant ``none`` or ``fp8_per_token``.
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
from moe_contract.config import QUANTS, W4_QUANTS

#: name -> (K, N) of the expert weight ``[E, N, K]``.
GEMM_SHAPES = {"gate_up": (7168, 4096), "down": (2048, 7168)}
GEMM_M = (256, 2048, 16384)
GEMM_E = 32
ROUTINGS = ("uniform", "zipf")
GEMM_DTYPES = ("bf16", "fp8")
LAYER_T = (32, 512, 4096)
#: The backward specs' sizes: routed rows of the grouped GEMM, tokens of the layer.
GEMM_BWD_M = (4096, 16384)
LAYER_BWD_T = (512, 4096)
LAYER_QUANTS = ("none", "fp8_per_token")
#: The layer quant modes the layer rows can time: the 4-bit weight-only modes (``mxfp4`` / ``int4``) are not
#: among them yet (their rows would need their own byte model: 4.25 / 4.5 bits a weight, not FP8's 8).
BENCH_QUANTS = tuple(q for q in QUANTS if q not in W4_QUANTS)
#: Zipf exponent of the expert popularity (rank r gets p ~ r^-ZIPF_S): with s=1.2 and E=32 the
#: top expert takes ~25% of the rows and the tail experts few or none at M=256.
ZIPF_S = 1.2

#: The transformers 5.24 MoE block of each checkpoint ``model_type``: the peer of the layer rows
#: (``transformers.models.<model_type>.modeling_<model_type>``).
HF_BLOCKS = {"mixtral": "MixtralSparseMoeBlock", "qwen3_moe": "Qwen3MoeSparseMoeBlock", "deepseek_v3": "DeepseekV3MoE"}

#: Bytes per element of the operands of each dtype name.
ITEMSIZE = {"bf16": 2, "fp8": 1, "fp32": 4}


def group_sizes(M: int, E: int, routing: str, seed: int = 0) -> np.ndarray:
    """Rows per expert, ``[E]`` int64 summing to ``M``; deterministic in ``(M, E, routing, seed)``.

    ``uniform``: ``M // E`` each, the remainder one each to the first experts. ``zipf``: a
    multinomial draw of ``M`` rows over Zipf(ZIPF_S) popularities assigned to experts in a seeded
    random order (so the heavy expert is not always expert 0); experts may get no row.
    """
    if routing == "uniform":
        sizes = np.full(E, M // E, dtype=np.int64)
        sizes[: M % E] += 1
        return sizes
    if routing == "zipf":
        rng = np.random.default_rng(seed)
        p = np.arange(1, E + 1, dtype=np.float64) ** -ZIPF_S
        p = rng.permutation(p / p.sum())
        return rng.multinomial(M, p).astype(np.int64)
    raise ValueError(f"group_sizes: routing must be one of {ROUTINGS}; got routing={routing!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmSpec:
    """One grouped GEMM ``y [M, N] = x [M, K] @ w[e].T`` with ``w [E, N, K]``."""

    shape: str  # "gate_up" | "down" | "tiny"
    E: int
    K: int
    N: int
    M: int
    routing: str  # "uniform" | "zipf"
    dtype: str  # "bf16" | "fp8"
    seed: int = 0
    model: str = ""  # BenchModel.name ("": the default shapes)

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
        """x read once, the weights of experts that got rows read once, y (bf16) written once, scales."""
        b = ITEMSIZE[self.dtype]
        active = int((self.group_sizes() > 0).sum())
        scales = (self.M + self.E * self.N) * 4 if self.dtype == "fp8" else 0
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
    quant: str  # "none" | "fp8_per_token" | "fp8_block"
    E: int = 32
    topk: int = 8
    H: int = 7168
    I: int = 2048  # noqa: E741 (the contract's name)
    seed: int = 0
    model: str = ""  # BenchModel.name ("": the default layer)
    base: MoEConfig | None = None  # routing and sizes (quant 'none'); None: softmax top-k, renormalised
    arch: str | None = "qwen3_moe"

    def __post_init__(self) -> None:
        if self.quant not in BENCH_QUANTS:
            raise ValueError(f"LayerSpec: quant must be one of {BENCH_QUANTS} (the 4-bit modes {W4_QUANTS} are not "
                             f"timed yet); got quant={self.quant!r}")
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
        return "fp8" if self.quant != "none" else "bf16"

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
    def min_bytes(self) -> float:
        """Weights of the experts expected to get a row (uniform routing) and of the shared experts,
        x read and out written (bf16)."""
        wb = ITEMSIZE[self.dtype]
        hit = self.E * (1.0 - (1.0 - self.topk / self.E) ** self.T) + self.num_shared
        return float(hit * 3 * self.H * self.I * wb + 2 * self.T * self.H * 2)

    def fields(self) -> dict:
        return dict(E=self.E, T=self.T, H=self.H, I=self.I, topk=self.topk, quant=self.quant, dtype=self.dtype,
                    routing=self.config().routing, shape=self.model or None)


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
            raise ValueError(f"BenchModel: quants must be a non-empty tuple of {BENCH_QUANTS} (the 4-bit modes "
                             f"{W4_QUANTS} are not timed yet); got {self.quants!r}")

    @property
    def weight_elements(self) -> int:
        """Elements of ``w13`` and ``w2`` over all experts (routed and shared)."""
        c = self.config
        return 3 * c.num_total_experts * c.hidden_size * c.intermediate_size


def arch_of_preset(name: str) -> str | None:
    """The transformers block of a preset's layer: DeepSeek-V3's for biased grouped top-k (also the
    ``tiny`` preset; GLM-4.5-Air's ``Glm4MoeMoE`` and Kimi K2 compute the same), Mixtral's for ``mixtral-*``,
    Qwen3-MoE's for other softmax top-k without shared experts; None otherwise: no block of those expresses
    ``sigmoid_topk`` (Llama 4), gpt-oss's clamped SwiGLU on interleaved gate/up, or Qwen3-Next's shared expert."""
    p = get_preset(name)
    if p.activation != "silu" or p.gate_up_layout != "concatenated":
        return None
    if p.routing == "biased_grouped_topk":
        return "deepseek_v3"
    if p.routing == "softmax_topk" and p.num_shared_experts == 0 and p.routed_scaling_factor == 1.0:
        return "mixtral" if name.startswith("mixtral") else "qwen3_moe"
    return None


def preset_model(name: str) -> BenchModel:
    """The :class:`BenchModel` of preset ``name`` (``ValueError`` listing the presets if unknown)."""
    return BenchModel(name=name, config=get_preset(name).config(), arch=arch_of_preset(name))


def gemm_specs(quick: bool = False, tiny: bool = False, model: BenchModel | None = None) -> list[GemmSpec]:
    """Full: 2 shapes x 3 M x 2 routings x 2 dtypes = 24. Quick: gate_up, M in {256, 16384}, uniform (4).
    Tiny (CPU smoke test): E=4, K=64, N=32, M in {16, 64}. With ``model``: its ``gate_up`` (K=H, N=2I) and
    ``down`` (K=I, N=H) over its E routed experts, the same M (tiny: 16, 64) and routings."""
    ms = (16, 64) if tiny else (256, 16384) if quick else GEMM_M
    routings = ("uniform",) if quick else ROUTINGS
    if model is not None:
        c = model.config
        shapes = {"gate_up": (c.hidden_size, 2 * c.intermediate_size), "down": (c.intermediate_size, c.hidden_size)}
        if quick:
            shapes.pop("down")
        return [GemmSpec(shape=s, E=c.num_experts, K=k, N=n, M=M, routing=r, dtype=d, model=model.name)
                for d in GEMM_DTYPES for s, (k, n) in shapes.items() for M in ms for r in routings]
    if tiny:
        return [GemmSpec(shape="tiny", E=4, K=64, N=32, M=M, routing=r, dtype=d)
                for d in GEMM_DTYPES for M in ms for r in ROUTINGS]
    shapes = ("gate_up",) if quick else tuple(GEMM_SHAPES)
    return [GemmSpec(shape=s, E=GEMM_E, K=GEMM_SHAPES[s][0], N=GEMM_SHAPES[s][1], M=M, routing=r, dtype=d)
            for d in GEMM_DTYPES for s in shapes for M in ms for r in routings]


def layer_specs(quick: bool = False, tiny: bool = False, model: BenchModel | None = None) -> list[LayerSpec]:
    """Full: T in {32, 512, 4096} x quant {none, fp8_per_token} = 6. Quick: T=512, both quants. Tiny: E=4,
    topk=2, H=64, I=32, T in {4, 16}. With ``model``: its layer (routing, shared experts, peer block) and
    its quant modes, at the same T."""
    ts = (4, 16) if tiny else (512,) if quick else LAYER_T
    if model is not None:
        c = model.config
        return [LayerSpec(T=T, quant=q, E=c.num_experts, topk=c.topk, H=c.hidden_size, I=c.intermediate_size,
                          model=model.name, base=c, arch=model.arch) for q in model.quants for T in ts]
    if tiny:
        return [LayerSpec(T=T, quant=q, E=4, topk=2, H=64, I=32) for q in LAYER_QUANTS for T in ts]
    return [LayerSpec(T=T, quant=q) for q in LAYER_QUANTS for T in ts]


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


def layer_bwd_specs(quick: bool = False, tiny: bool = False, model: BenchModel | None = None) -> list[LayerBwdSpec]:
    """Forward + backward, bf16. Full: the built-in layer (E=32, topk 8, H=7168, I=2048) at T in {512,
    4096} (2). Quick: T=512 (1). Tiny (CPU, kernels interpreted): E=4, topk 2, H=64, I=32, T=16 (1).
    With ``model``: its layer (routing, shared experts, peer block), the same T."""
    ts = (16,) if tiny else LAYER_BWD_T[:1] if quick else LAYER_BWD_T
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
