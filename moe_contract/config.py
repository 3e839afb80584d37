"""The MoE layer configuration, shared by ``moe_pallas`` and ``moe_torch``.

``MoEConfig`` holds everything about a layer that is not an array: the routing mode
(CONTRACT.md section 1), the routed scaling factor and where it is applied, the fused
shared experts, the quantization mode (section 3) and the expert-parallel placement
(section 6). It is frozen and hashable, so it can be a static argument of ``jax.jit``.

Expert-parallel placement: rank ``r`` of ``ep_size`` owns routed experts
``[r * E / ep_size, (r + 1) * E / ep_size)``; the fused shared experts (ids
``E .. E + S - 1``) are owned by the last rank, whose local range is therefore
``E / ep_size + S`` experts long. Every rank's range is contiguous, which is what the
permutation (section 2) takes.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
import numbers
from typing import Literal

from moe_contract.scalar_checks import (check_bool, check_capacity_factor, check_choice, check_nonnegative_int,
                                        check_positive_int, check_rsf)

Routing = Literal["softmax_topk", "grouped_topk", "biased_grouped_topk", "sigmoid_topk"]
Quant = Literal["none", "fp8_per_token", "fp8_block", "mxfp4", "int4"]
Activation = Literal["silu", "gelu_tanh", "swiglu_oai"]
GateUpLayout = Literal["concatenated", "interleaved"]
W4Layout = Literal["checkpoint", "mma"]

ROUTINGS = ("softmax_topk", "grouped_topk", "biased_grouped_topk", "sigmoid_topk")
#: The routings that split the experts into groups (``num_expert_group`` / ``topk_group`` required).
GROUPED_ROUTINGS = ("grouped_topk", "biased_grouped_topk")
#: The routings whose weights are ``sigmoid(logit)`` (renormalized by ``sum + 1e-20``; backward
#: ``d_logit = d_s * s * (1 - s)``), CONTRACT.md sections 1 and 8.
SIGMOID_ROUTINGS = ("biased_grouped_topk", "sigmoid_topk")
QUANTS = ("none", "fp8_per_token", "fp8_block", "mxfp4", "int4")
#: The FP8 quant modes (float8_e4m3fn weight codes with float32 scales; activations quantized too: section 3).
FP8_QUANTS = ("fp8_per_token", "fp8_block")
#: The 4-bit weight-only quant modes (CONTRACT.md section 9): packed codes ``[E, N, K // 2]`` uint8 with one scale
#: per group of :data:`W4_GROUP` along ``K`` (``[E, N, K // 32]``: uint8 e8m0 for ``"mxfp4"``, bf16 for ``"int4"``);
#: activations stay ``x``'s float dtype. The mode's name is the grouped GEMM's ``w_format``.
W4_QUANTS = ("mxfp4", "int4")
W4_GROUP = 32
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
#: Where the gate and up halves of ``h [M, 2*I]`` (and of ``w13``'s ``2*I`` rows) are (CONTRACT.md section 4):
#: ``"concatenated"`` gate ``[:, :I]``, up ``[:, I:]``; ``"interleaved"`` (gpt-oss) gate ``[:, 0::2]``, up
#: ``[:, 1::2]``.
GATE_UP_LAYOUTS = ("concatenated", "interleaved")
#: How a 4-bit layer's codes are stored (CONTRACT.md section 9): ``"checkpoint"`` (byte ``i`` holds elements
#: ``2i``, ``2i + 1``) or ``"mma"`` (MXFP4 only: the load-time MMA layout, ``moe_contract/w4_layout.py``).
W4_LAYOUTS = ("checkpoint", "mma")
#: ``swiglu_oai`` (gpt-oss, transformers ``GptOssExperts``; CONTRACT.md section 4): the clamp bound of the gate
#: (above) and of the up value (both sides), and the sigmoid's slope: ``(clamp(u) + 1) * gc * sigmoid(alpha * gc)``.
SWIGLU_OAI_LIMIT = 7.0
SWIGLU_OAI_ALPHA = 1.702

#: The FP8 block size of DeepSeek-V3 checkpoints: activations 1x128 groups, weights 128x128.
FP8_BLOCK = 128


#: MoEConfig's integer fields (numpy integers are taken as ints).
_INT_FIELDS = ("hidden_size", "intermediate_size", "num_experts", "topk", "ep_size", "ep_rank", "num_expert_group",
               "topk_group", "num_fused_shared_experts")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """One MoE layer, per CONTRACT.md.

    Attributes:
      hidden_size: ``H``.
      intermediate_size: ``I`` (``w13`` is ``[E_local, 2*I, H]``, ``w2`` is ``[E_local, H, I]``).
      num_experts: ``E``, routed experts in the model (global).
      topk: routed experts chosen per token.
      routing: ``"softmax_topk"`` (Mixtral, Qwen3-MoE), ``"grouped_topk"`` (DeepSeek-V2),
        ``"biased_grouped_topk"`` (DeepSeek-V3/R1 "noaux_tc") or ``"sigmoid_topk"`` (Llama 4: top-k of
        the logits, weight ``sigmoid(logit)``; no groups, no bias).
      renormalize: divide the top-k weights by their sum.
      num_expert_group / topk_group: groups of experts, and how many are kept (grouped modes).
      routed_scaling_factor: ``rsf``, applied exactly once.
      apply_routed_scaling_factor_on_output: apply ``rsf`` in the gate (SGLang's fused gate)
        instead of in the combine step. Both give the same layer output.
      num_fused_shared_experts: ``S`` shared experts run as extra experts ``E .. E+S-1``.
      apply_router_weight_on_input: Llama 4 (vLLM's name): each routed slot's expert input is
        ``x[t] * w[t, j]`` (float32, rounded once to ``x.dtype``) and the combine adds the routed outputs
        with weight 1 (times ``rsf``, which must then be applied by the combine: ``True`` with
        ``apply_routed_scaling_factor_on_output=True`` and ``rsf != 1`` is a ValueError); fused shared
        slots keep their input unscaled and their weight in the combine (CONTRACT.md sections 1, 2, 5).
      shared_expert_gate: Qwen3-Next: the fused shared slots' weights are multiplied by
        ``sigmoid(shared_expert_gate_logits[t, i])`` (a layer input ``[T, S]``), so the layer adds
        ``sigmoid(gate) * shared`` to the routed sum as ``Qwen3NextSparseMoeBlock`` does; needs ``S >= 1``.
      activation: ``"silu"``, ``"gelu_tanh"`` or ``"swiglu_oai"`` (gpt-oss: ``(clamp(u, -7, 7) + 1) *
        gc * sigmoid(1.702 * gc)``, ``gc = min(g, 7)``), the ``*_and_mul`` between the GEMMs (CONTRACT.md section 4).
      gate_up_layout: where gate and up are in ``w13``'s ``2*I`` rows (and so in GEMM 1's output ``h``):
        ``"concatenated"`` (the default; Mixtral, Qwen3-MoE, DeepSeek-V3: gate rows ``:I``, up rows ``I:``) or
        ``"interleaved"`` (gpt-oss's ``gate_up_proj``: gate rows ``0::2``, up rows ``1::2``).
      expert_bias: gpt-oss (transformers ``GptOssExperts``' ``gate_up_proj_bias [E, 2I]`` / ``down_proj_bias
        [E, H]``): the layer takes ``w13_bias [E_local, 2I]`` and ``w2_bias [E_local, H]`` (required exactly when
        set), added by GEMM 1 and GEMM 2 before their rounding; the combine weights ``y = a @ w2.T + b2`` whole
        (CONTRACT.md sections 4, 5, 8). The fused shared experts' rows are the bias tensors' rows ``E..E+S-1``.
      quant: ``"none"`` (bf16/f32 GEMMs), ``"fp8_per_token"`` (activations per-token,
        weights per-output-channel or per-expert), ``"fp8_block"`` (activations 1x128
        groups, weights 128x128 blocks, DeepSeek-V3 style), or the weight-only 4-bit modes ``"mxfp4"``
        (gpt-oss) / ``"int4"`` (group 32, bf16 scales; Kimi K2-Thinking): packed codes with one scale per
        group of 32 along ``K``, activations in ``x``'s float dtype (CONTRACT.md section 9; ``H`` and ``I``
        multiples of 32).
      w4_layout: how 4-bit codes are stored: ``"checkpoint"`` (the default, as above) or ``"mma"``
        (``quant="mxfp4"`` only): ``w13`` / ``w2`` hold ``mxfp4_to_mma_layout`` of the checkpoint codes (a one-time
        repack at load time for the GPU's packed decode; the same values, except that scale codes 129..254, which
        that layout's table cannot hold, read as NaN: CONTRACT.md section 9, "MMA layout").
      ep_size / ep_rank: expert parallelism; see the module docstring for the placement.
      capacity_factor: ``None`` (the default: dropless, every slot reaches its expert) or ``c``, a finite
        float > 0 (MaxText's and Megatron-Core's name): each routed expert takes at most
        ``C = ceil(c * T * topk / E)`` slots of a layer call's ``T`` tokens (:meth:`expert_capacity`), in token
        order (lower token first, then slot order); the slots beyond are dropped: they add nothing to the
        output (no renormalization onto the kept slots) and get no gradient through the expert. Fused shared
        experts are never dropped; under EP ``C`` counts every rank's tokens (CONTRACT.md section 2, "Capacity").

    Raises:
      ValueError: on any inconsistent field (named in the message).
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    topk: int
    routing: Routing = "softmax_topk"
    renormalize: bool = True
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    apply_routed_scaling_factor_on_output: bool = False
    num_fused_shared_experts: int = 0
    apply_router_weight_on_input: bool = False
    shared_expert_gate: bool = False
    expert_bias: bool = False
    activation: Activation = "silu"
    gate_up_layout: GateUpLayout = "concatenated"
    quant: Quant = "none"
    w4_layout: W4Layout = "checkpoint"
    ep_size: int = 1
    ep_rank: int = 0
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        op = "MoEConfig"
        # numpy integers (np.int64 from an array's shape or a config file read with numpy) are ints: stored as
        # Python ints, so the config hashes and compares as one built from ints (a jit static argument).
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value) is not int:
                object.__setattr__(self, name, int(value))
        for name in ("hidden_size", "intermediate_size", "num_experts", "topk", "ep_size"):
            check_positive_int(op, name, getattr(self, name))
        for name in ("renormalize", "apply_routed_scaling_factor_on_output", "apply_router_weight_on_input",
                     "shared_expert_gate", "expert_bias"):
            check_bool(op, name, getattr(self, name))
        check_choice(op, "routing", self.routing, ROUTINGS)
        check_choice(op, "quant", self.quant, QUANTS)
        check_choice(op, "activation", self.activation, ACTIVATIONS)
        check_choice(op, "gate_up_layout", self.gate_up_layout, GATE_UP_LAYOUTS)
        check_choice(op, "w4_layout", self.w4_layout, W4_LAYOUTS)
        if self.w4_layout == "mma" and self.quant != "mxfp4":
            raise ValueError(f"{op}: w4_layout='mma' is a layout of MXFP4 codes (quant='mxfp4'); got "
                             f"quant={self.quant!r}")
        check_capacity_factor(op, self.capacity_factor)
        if self.capacity_factor is not None and type(self.capacity_factor) is not float:
            # a numpy float or an int is stored as a Python float: the same config hashes alike (jit static argument)
            object.__setattr__(self, "capacity_factor", float(self.capacity_factor))
        check_routing_args(
            op,
            num_experts=self.num_experts,
            topk=self.topk,
            routing=self.routing,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            num_fused_shared_experts=self.num_fused_shared_experts,
        )
        if self.shared_expert_gate and not self.num_fused_shared_experts:
            raise ValueError(f"{op}: shared_expert_gate=True gates the fused shared experts, so "
                             f"num_fused_shared_experts must be >= 1; got num_fused_shared_experts=0")
        if (self.apply_router_weight_on_input and self.apply_routed_scaling_factor_on_output
                and self.routed_scaling_factor != 1.0):
            raise ValueError(
                f"{op}: apply_router_weight_on_input=True needs the routed scaling factor in the combine "
                f"(apply_routed_scaling_factor_on_output=False): on the gate's weights it would scale the experts' "
                f"input, inside their nonlinearity, and the two placements would differ (CONTRACT.md section 1); "
                f"got apply_routed_scaling_factor_on_output=True with routed_scaling_factor={self.routed_scaling_factor}")
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"{op}: num_experts must be divisible by ep_size (={self.ep_size}); "
                f"got num_experts={self.num_experts}"
            )
        if isinstance(self.ep_rank, bool) or not isinstance(self.ep_rank, int) or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"{op}: ep_rank must be an int in [0, ep_size={self.ep_size}); got ep_rank={self.ep_rank!r}")
        if self.quant == "fp8_block":
            for name in ("hidden_size", "intermediate_size"):
                if getattr(self, name) % FP8_BLOCK:
                    raise ValueError(
                        f"{op}: {name} must be a multiple of {FP8_BLOCK} for quant='fp8_block'; "
                        f"got {name}={getattr(self, name)}"
                    )
        if self.quant in W4_QUANTS:
            for name in ("hidden_size", "intermediate_size"):
                if getattr(self, name) % W4_GROUP:
                    raise ValueError(
                        f"{op}: {name} must be a multiple of {W4_GROUP} for quant={self.quant!r} (one 4-bit weight "
                        f"scale per group of {W4_GROUP} along K: H for w13, I for w2); got {name}={getattr(self, name)}"
                    )

    @property
    def w_format(self) -> str | None:
        """The grouped GEMM's ``w_format`` for this layer's weights: ``"mxfp4"`` / ``"int4"``, ``"mxfp4_mma"`` with
        ``w4_layout="mma"``, ``None`` for float and FP8 weights."""
        if self.quant not in W4_QUANTS:
            return None
        return "mxfp4_mma" if self.w4_layout == "mma" else self.quant

    @property
    def num_total_experts(self) -> int:
        """``E + S``: routed plus fused shared experts (the id space of ``topk_ids``)."""
        return self.num_experts + self.num_fused_shared_experts

    @property
    def num_slots(self) -> int:
        """Columns of ``topk_ids``: ``topk + S``."""
        return self.topk + self.num_fused_shared_experts

    @property
    def combine_routed_scaling_factor(self) -> float:
        """The rsf the combine applies: 1 when the gate already applied it (applied exactly once,
        CONTRACT.md section 5)."""
        return 1.0 if self.apply_routed_scaling_factor_on_output else self.routed_scaling_factor

    def expert_capacity(self, num_tokens: int) -> int | None:
        """``C``, the most routed slots one expert takes from a layer call of ``num_tokens`` tokens (all EP ranks'):
        ``ceil(capacity_factor * num_tokens * topk / E)``, computed exactly on the float's binary value (no
        rounding to a multiple of anything: no kernel needs it), or ``None`` when dropless
        (``capacity_factor=None``). ``C >= 1`` whenever ``num_tokens >= 1``.

        Raises: ValueError if ``num_tokens`` is not an int >= 0."""
        check_nonnegative_int("MoEConfig.expert_capacity", "num_tokens", num_tokens)
        if self.capacity_factor is None:
            return None
        return math.ceil(fractions.Fraction(self.capacity_factor) * num_tokens * self.topk / self.num_experts)

    def gate_kwargs(self) -> dict:
        """The routing settings as keyword arguments of ``select_experts`` / ``check_select_experts``
        (every argument but the logits, the bias and the implementation): one place, for the layer,
        the EP layers, the modules and the cross-check."""
        return dict(
            topk=self.topk,
            routing=self.routing,
            renormalize=self.renormalize,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            apply_routed_scaling_factor_on_output=self.apply_routed_scaling_factor_on_output,
            num_fused_shared_experts=self.num_fused_shared_experts,
        )

    def local_expert_range(self, rank: int | None = None) -> tuple[int, int]:
        """``(expert_start, E_local)`` owned by ``rank`` (default: ``self.ep_rank``)."""
        rank = self.ep_rank if rank is None else rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.ep_size:
            raise ValueError(f"local_expert_range: rank must be an int in [0, ep_size={self.ep_size}); got rank={rank!r}")
        per_rank = self.num_experts // self.ep_size
        start = rank * per_rank
        extra = self.num_fused_shared_experts if rank == self.ep_size - 1 else 0
        return start, per_rank + extra

    def for_rank(self, rank: int) -> "MoEConfig":
        """The same layer seen from EP rank ``rank``."""
        return dataclasses.replace(self, ep_rank=rank)

    def replace(self, **changes) -> "MoEConfig":
        """A copy with ``changes``. Raises: TypeError naming unknown fields (:meth:`check_field_names`)."""
        MoEConfig.check_field_names("MoEConfig.replace", changes)
        return dataclasses.replace(self, **changes)

    @staticmethod
    def check_field_names(op: str, names) -> None:
        """``TypeError`` naming ``op`` and any of ``names`` that is not a field of :class:`MoEConfig`."""
        fields = [f.name for f in dataclasses.fields(MoEConfig)]
        unknown = sorted(set(names) - set(fields))
        if unknown:
            raise TypeError(f"{op}: unknown MoEConfig field(s) {unknown}; fields are {fields}")


def check_routing_args(
    op: str,
    *,
    num_experts: int,
    topk: int,
    routing: str,
    num_expert_group: int | None,
    topk_group: int | None,
    routed_scaling_factor: float,
    num_fused_shared_experts: int,
) -> None:
    """The gate's value rules (CONTRACT.md section 1), shared by the config and the gate op."""
    check_choice(op, "routing", routing, ROUTINGS)
    check_positive_int(op, "topk", topk)
    if topk > num_experts:
        raise ValueError(f"{op}: topk must be <= E (={num_experts}); got topk={topk}")
    check_nonnegative_int(op, "num_fused_shared_experts", num_fused_shared_experts)
    check_rsf(op, routed_scaling_factor)
    if routing not in GROUPED_ROUTINGS:
        for name, value in (("num_expert_group", num_expert_group), ("topk_group", topk_group)):
            if value is not None:
                raise ValueError(f"{op}: {name} must be None for routing={routing!r} (it has no groups); got {name}={value!r}")
        return
    check_positive_int(op, "num_expert_group", num_expert_group)
    check_positive_int(op, "topk_group", topk_group)
    if num_experts % num_expert_group:
        raise ValueError(
            f"{op}: E (={num_experts}) must be divisible by num_expert_group; "
            f"got num_expert_group={num_expert_group}"
        )
    if topk_group > num_expert_group:
        raise ValueError(
            f"{op}: topk_group must be <= num_expert_group (={num_expert_group}); got topk_group={topk_group}"
        )
    per_group = num_experts // num_expert_group
    if topk > topk_group * per_group:
        raise ValueError(
            f"{op}: topk must be <= topk_group * E / num_expert_group (={topk_group * per_group}), "
            f"the experts of the kept groups; got topk={topk}"
        )
    if routing == "biased_grouped_topk" and per_group < 2:
        raise ValueError(
            f"{op}: biased_grouped_topk scores a group by its two best experts, so "
            f"E / num_expert_group must be >= 2; got {per_group}"
        )


#: The activation quantization each layer quant mode uses (CONTRACT.md section 3; the 4-bit modes are
#: weight-only: none).
ACTIVATION_QUANT = {"none": None, "fp8_per_token": "fp8_per_token", "fp8_block": "fp8_per_token_group",
                    "mxfp4": None, "int4": None}
#: The weight-scale layout each FP8 layer quant mode stores (the 4-bit modes: :data:`W4_QUANTS`, groups of 32).
WEIGHT_LAYOUT = {"fp8_per_token": "per_channel", "fp8_block": "block"}
