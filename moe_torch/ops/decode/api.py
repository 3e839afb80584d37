"""The low-latency decode path's expert part: ``fused_experts_decode``, the layer's experts and combine for a few
tokens (``T`` of 1 to :data:`~moe_torch.ops.decode.config.DECODE_MAX_TOKENS`) in two Triton launches after the gate
(``triton.py``: GEMM 1 + activation, then GEMM 2 + combine), where the staged layer takes ~7. What it computes is
``moe_torch.layer.routed_experts`` on this rank's experts (CONTRACT.md sections 2, 4, 5, 9): ``reference.py``
composes exactly those stages.

Not yet the layer's default: ``moe_forward`` keeps its staged path until GPU timings say where this one wins.

Mirror: ``moe_pallas/ops/decode/api.py``.
"""

from __future__ import annotations

import torch

from moe_contract.config import MoEConfig
from moe_contract.op_checks import check_fused_experts_decode
from moe_contract.validation import check_choice
from moe_torch.ops.common import takes_torch_tensors
from moe_torch.ops.decode.reference import fused_experts_decode_reference
from moe_torch.ops.dispatch import dispatch

IMPLEMENTATIONS = ("triton", "reference")


def _triton(*args):
    """The Triton backend, imported on first use (so that ``moe_torch`` imports without triton)."""
    try:
        from moe_torch.ops.decode.triton import fused_experts_decode_triton
    except ImportError as exc:
        raise NotImplementedError(f"fused_experts_decode: triton is not importable ({exc})") from exc
    return fused_experts_decode_triton(*args)


def _check_devices(op: str, x: torch.Tensor, named: dict) -> None:
    """Every given tensor on ``x``'s device (ValueError naming the argument): the kernels read them all."""
    for name, t in named.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} must be on x's device ({x.device}); got {name}.device={t.device}")


@takes_torch_tensors
def fused_experts_decode(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    config: MoEConfig,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    implementation: str | None = None,
) -> torch.Tensor:
    """``out[t] = c * sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` over this rank's experts: the
    layer without its gate, for a few tokens (CONTRACT.md sections 2, 4, 5, 9).

    ``expert_e(x) = act(g) * u @ w2[e].T + w2_bias[e]`` with ``h = x @ w13[e].T + w13_bias[e]`` rounded to
    ``x.dtype``, ``g`` / ``u`` its gate and up halves (``config.gate_up_layout``), ``act(g) * u``
    (``config.activation``, incl. gpt-oss's clamped ``swiglu_oai``) computed in float32 and rounded to ``x.dtype``,
    GEMM 2's output rounded to ``x.dtype``; the weighted sum in float32, times ``c =
    config.combine_routed_scaling_factor`` (1 when the gate applied ``rsf``), rounded once. Exactly the staged
    layer's rounding points: ``implementation="reference"`` is those stages composed.

    FP8 weights (``config.quant="fp8_per_token"`` / ``"fp8_block"``, CONTRACT.md sections 3, 4): both GEMMs'
    inputs are quantized dynamically as the layer's permute and act_and_mul do, ``scale = max(amax, 1e-10) *
    float32(1/448)``, ``q = cast_e4m3(clamp(v / scale, -448, 448))`` (IEEE division, round to nearest even):
    ``x``'s rows (times the input scale, below) per token over ``H`` or in 1 x 128 groups, ``act(g) * u`` from its
    float32 value (not rounded to ``x.dtype`` first) per token over ``I`` or in 1 x 128 groups; each GEMM is
    ``(q_x @ q_w.T) * scale_x * scale_w`` (block scales per 128-wide K block) plus the bias, rounded to ``x.dtype``.
    ``config.apply_router_weight_on_input`` (Llama 4): a routed slot's expert input is ``x[t] * topk_weights[t, j]``
    (float32, rounded once to ``x.dtype``) and the combine adds its output with weight 1; fused shared slots keep
    ``x[t]`` and their weight (``moe_torch.slot_weights.slot_weights``, CONTRACT.md sections 2, 5).

    Args:
      x: ``[T, H]`` float32 / bf16 / float16 (``H = config.hidden_size``).
      topk_weights: ``[T, topk + S]`` float32, the slots' weights (the gate's ``topk_weights``; with
        ``config.shared_expert_gate``, the shared slots' already times their sigmoid gate, as ``slot_weights`` makes
        them): the combine's weights, except that with ``config.apply_router_weight_on_input`` the routed slots'
        weights scale their expert's input instead.
      topk_ids: ``[T, topk + S]`` int32 / int64, global expert ids in ``[0, E + S)`` as the experts see them (after
        ``drop_over_capacity`` when the config has a capacity). A slot whose id is ``-1``, outside the id space, or
        of another EP rank's expert (outside ``config.local_expert_range()``) contributes exactly 0.
      w13: ``[E_local, 2*I, H]`` of ``x``'s dtype (``config.quant="none"``), gate and up rows as
        ``config.gate_up_layout`` places them; float8_e4m3fn codes for the FP8 modes; ``quant="mxfp4"`` /
        ``"int4"``: packed 4-bit codes ``[E_local, 2*I, H // 2]`` uint8 (CONTRACT.md section 9).
      w2: ``[E_local, H, I]`` likewise (4-bit: ``[E_local, H, I // 2]`` uint8).
      config: the layer (``hidden_size``, ``intermediate_size``, slots, ``activation``, ``gate_up_layout``,
        ``expert_bias``, ``quant``, EP rank, rsf placement).
      w13_bias, w2_bias: ``[E_local, 2*I]`` / ``[E_local, H]`` float32, bf16 or ``x``'s dtype, exactly when
        ``config.expert_bias`` (gpt-oss), added before each GEMM's rounding.
      w13_scale, w2_scale: FP8: float32 dequantization multipliers (``moe_torch.layer.quantize_layer_weights``),
        per expert ``[E_local]`` or per output channel ``[E_local, N]`` for ``"fp8_per_token"`` (each weight its
        own), 128 x 128 blocks ``[E_local, ceil(N/128), ceil(K/128)]`` for ``"fp8_block"`` (``N``, ``K`` of that
        weight); 4-bit: ``[E_local, 2*I, H // 32]`` / ``[E_local, H, I // 32]`` (uint8 e8m0 for mxfp4, bf16 for
        int4). ``None`` for float weights.
      implementation: ``None`` (CUDA tensors: ``"triton"``, falling back to ``"reference"`` with a logged warning;
        CPU tensors: ``"reference"``), ``"triton"`` (two launches, no host synchronisation, CUDA-graph capturable;
        deterministic: bit-identical across runs) or ``"reference"`` (the staged layer's stage references).

    Returns: ``out [T, H]`` in ``x.dtype``: this rank's partial sum (the sum over EP ranks is the layer's experts'
    output, CONTRACT.md section 6). Not differentiable (an inference path): with grad mode on, an input that
    requires grad is refused (below) rather than given a result without a gradient; run it under
    ``torch.no_grad()`` / ``torch.inference_mode()``.

    Raises: ValueError / TypeError naming the argument, before any launch (shapes, dtypes, devices, biases given
      without ``config.expert_bias`` or missing with it, FP8 and 4-bit weight scales); NotImplementedError, with
      ``implementation="triton"``, where the kernels cannot run (no CUDA and no interpreter, FP8 weights on a GPU
      older than sm_90, ``T * (topk + S)`` above ``config.MAX_SLOTS``; the default implementation falls back to the
      reference there);
      RuntimeError naming the input when grad mode is on and an input requires grad (no backward: ``moe_forward``
      is the path for training).
    """
    op = "fused_experts_decode"
    check_fused_experts_decode(op, x, topk_weights, topk_ids, w13, w2, config, w13_bias, w2_bias, w13_scale, w2_scale)
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    _check_devices(op, x, {"topk_weights": topk_weights, "topk_ids": topk_ids, "w13": w13, "w2": w2,
                           "w13_bias": w13_bias, "w2_bias": w2_bias, "w13_scale": w13_scale, "w2_scale": w2_scale})
    if torch.is_grad_enabled():
        for name, t in (("x", x), ("topk_weights", topk_weights), ("w13", w13), ("w2", w2), ("w13_bias", w13_bias),
                        ("w2_bias", w2_bias)):
            if t is not None and t.requires_grad:
                raise RuntimeError(
                    f"{op}: not differentiable (an inference path: no backward); got {name} requiring grad with grad "
                    f"mode on (call it under torch.no_grad() / torch.inference_mode(), or use moe_forward to train)")
    args = tuple(t.detach() if isinstance(t, torch.Tensor) else t
                 for t in (x, topk_weights, topk_ids, w13, w2, config, w13_bias, w2_bias, w13_scale, w2_scale))
    backends = {"triton": lambda: _triton(*args), "reference": lambda: fused_experts_decode_reference(*args)}
    return dispatch(op, implementation, backends, x.device)
