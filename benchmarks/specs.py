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
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from moe_contract import MoEConfig, get_preset

#: name -> (K, N) of the expert weight ``[E, N, K]``.
GEMM_SHAPES = {"gate_up": (7168, 4096), "down": (2048, 7168)}
GEMM_M = (256, 2048, 16384)
GEMM_E = 32
ROUTINGS = ("uniform", "zipf")
GEMM_DTYPES = ("bf16", "fp8")
LAYER_T = (32, 512, 4096)
LAYER_QUANTS = ("none", "fp8_per_token")
#: Zipf exponent of the expert popularity (rank r gets p ~ r^-ZIPF_S): with s=1.2 and E=32 the
#: top expert takes ~25% of the rows and the tail experts few or none at M=256.
ZIPF_S = 1.2

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

    @property
    def name(self) -> str:
        return f"gemm/{self.shape}/{self.dtype}/M={self.M}/{self.routing}"

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
    """One MoE layer forward ``x [T, H] -> [T, H]`` (softmax top-k, renormalised, silu)."""

    T: int
    quant: str  # "none" | "fp8_per_token"
    E: int = 32
    topk: int = 8
    H: int = 7168
    I: int = 2048  # noqa: E741 (the contract's name)
    seed: int = 0

    @property
    def name(self) -> str:
        return f"layer/E={self.E}/H={self.H}/I={self.I}/{self.quant}/T={self.T}"

    @property
    def dtype(self) -> str:
        return "fp8" if self.quant != "none" else "bf16"

    def config(self) -> MoEConfig:
        return MoEConfig(hidden_size=self.H, intermediate_size=self.I, num_experts=self.E, topk=self.topk,
                         routing="softmax_topk", renormalize=True, quant=self.quant)

    @property
    def flops(self) -> float:
        """Both GEMMs over the ``T * topk`` routed rows: ``2 M (2I) H + 2 M H I``."""
        return 6.0 * self.T * self.topk * self.H * self.I

    @property
    def min_bytes(self) -> float:
        """Weights of the experts expected to get a row (uniform routing), x read and out written (bf16)."""
        wb = ITEMSIZE[self.dtype]
        hit = self.E * (1.0 - (1.0 - self.topk / self.E) ** self.T)
        return float(hit * 3 * self.H * self.I * wb + 2 * self.T * self.H * 2)

    def fields(self) -> dict:
        return dict(E=self.E, T=self.T, H=self.H, I=self.I, topk=self.topk, quant=self.quant, dtype=self.dtype,
                    routing="softmax_topk")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GateSpec:
    """The gate alone on ``router_logits [T, E]`` float32, routing and sizes of a preset."""

    T: int
    preset: str = "deepseek-v3"
    seed: int = 0

    def config(self) -> MoEConfig:
        return get_preset(self.preset).config()

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


def gemm_specs(quick: bool = False, tiny: bool = False) -> list[GemmSpec]:
    """Full: 2 shapes x 3 M x 2 routings x 2 dtypes = 24. Quick: gate_up, M in {256, 16384}, uniform (4).
    Tiny (CPU smoke test): E=4, K=64, N=32, M in {16, 64}."""
    if tiny:
        return [GemmSpec(shape="tiny", E=4, K=64, N=32, M=M, routing=r, dtype=d)
                for d in GEMM_DTYPES for M in (16, 64) for r in ROUTINGS]
    shapes = ("gate_up",) if quick else tuple(GEMM_SHAPES)
    ms = (256, 16384) if quick else GEMM_M
    routings = ("uniform",) if quick else ROUTINGS
    return [GemmSpec(shape=s, E=GEMM_E, K=GEMM_SHAPES[s][0], N=GEMM_SHAPES[s][1], M=M, routing=r, dtype=d)
            for d in GEMM_DTYPES for s in shapes for M in ms for r in routings]


def layer_specs(quick: bool = False, tiny: bool = False) -> list[LayerSpec]:
    """Full: T in {32, 512, 4096} x quant {none, fp8_per_token} = 6. Quick: T=512, both quants."""
    if tiny:
        return [LayerSpec(T=T, quant=q, E=4, topk=2, H=64, I=32) for q in LAYER_QUANTS for T in (4, 16)]
    ts = (512,) if quick else LAYER_T
    return [LayerSpec(T=T, quant=q) for q in LAYER_QUANTS for T in ts]


def gate_specs(quick: bool = False, tiny: bool = False) -> list[GateSpec]:
    """DeepSeek-V3's gate at T=4096 (tiny: the ``tiny`` preset, T=64)."""
    return [GateSpec(T=64, preset="tiny")] if tiny else [GateSpec(T=4096)]


def rotation_sets(bytes_per_set: float, l2_bytes: float, cap: int = 32) -> int:
    """How many input sets to cycle so that a set is evicted from L2 before its next use:
    1 when one set is over twice the L2, otherwise enough that the other sets cover twice the L2."""
    if bytes_per_set >= 2 * l2_bytes:
        return 1
    return int(min(cap, 1 + math.ceil(2 * l2_bytes / max(bytes_per_set, 1.0))))
