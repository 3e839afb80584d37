"""The low-latency decode path's expert part: ``fused_experts_decode``, the layer's experts and combine for a few
tokens (``T`` of 1 to :data:`~moe_pallas.ops.decode.config.DECODE_MAX_TOKENS`) in one jitted program after the
gate: a tiny jnp prelude and two Pallas-Triton kernels (``pallas_triton.py``: GEMM 1 + activation, then GEMM 2 +
combine), where the staged layer takes ~7 launches. What it computes is ``moe_pallas.layer.routed_experts`` on this
rank's experts (CONTRACT.md sections 2-5, 9), for every weight format the layer takes (float, FP8, 4-bit) and
Llama 4's routing weight on the input: ``reference.py`` composes exactly those stages.

Not yet the layer's default: ``moe_forward`` keeps its staged path until GPU timings say where this one wins.

Mirror: ``moe_torch/ops/decode/api.py``.
"""

from __future__ import annotations

import functools

import jax

from moe_contract.config import MoEConfig
from moe_contract.op_checks import check_fused_experts_decode
from moe_contract.validation import check_choice
from moe_pallas.ops.common import takes_jax_arrays
from moe_pallas.ops.decode.pallas_triton import fused_experts_decode_pallas_triton
from moe_pallas.ops.decode.reference import fused_experts_decode_reference
from moe_pallas.ops.dispatch import dispatch

IMPLEMENTATIONS = ("pallas_triton", "reference")

_OP = "fused_experts_decode"
_NOT_DIFFERENTIABLE = (f"{_OP}: not differentiable (an inference path: no backward); got a derivative with respect "
                       "to {name} (jax.grad / jax.vjp / jax.jvp through it; use moe_forward to train)")


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _no_derivative(name: str, a):
    return a


@_no_derivative.defjvp
def _no_derivative_jvp(name, primals, tangents):
    raise RuntimeError(_NOT_DIFFERENTIABLE.format(name=name))


@takes_jax_arrays
def fused_experts_decode(
    x: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    w13: jax.Array,
    w2: jax.Array,
    config: MoEConfig,
    *,
    w13_bias: jax.Array | None = None,
    w2_bias: jax.Array | None = None,
    w13_scale: jax.Array | None = None,
    w2_scale: jax.Array | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """``out[t] = c * sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` over this rank's experts: the
    layer without its gate, for a few tokens (CONTRACT.md sections 2-5, 9).

    ``expert_e(x) = act(g) * u @ w2[e].T + w2_bias[e]`` with ``h = x @ w13[e].T + w13_bias[e]`` rounded to
    ``x.dtype``, ``g`` / ``u`` its gate and up halves (``config.gate_up_layout``), ``act(g) * u``
    (``config.activation``, incl. gpt-oss's clamped ``swiglu_oai``) computed in float32 and rounded to ``x.dtype``,
    GEMM 2's output rounded to ``x.dtype``; the weighted sum in float32 in slot order, times ``c =
    config.combine_routed_scaling_factor`` (1 when the gate applied ``rsf``), rounded once. Exactly the staged
    layer's rounding points: ``implementation="reference"`` is those stages composed.

    FP8 weights (``config.quant`` ``"fp8_per_token"`` / ``"fp8_block"``, CONTRACT.md sections 3, 4): the expert
    input rows and the activation are quantized dynamically to float8_e4m3fn as the staged layer's permute and
    activation do (per token, or in 1x128 groups for ``"fp8_block"``; scale ``max(amax, 1e-10) * float32(1/448)``,
    ``q = cast_rne(clamp(v / scale, -448, 448))``; the activation from its float32 value, not rounded to
    ``x.dtype`` first), so their codes and scales are the staged ops' bit for bit; each GEMM sums the codes'
    products in float32 and applies the scales (per-token: to the finished sum, x's then the weight's; block:
    to each 128-wide K block's partial sum) before its bias and its one rounding to ``x.dtype``. The layer has no
    static activation scales: every FP8 mode is dynamic.

    ``config.apply_router_weight_on_input`` (Llama 4, CONTRACT.md sections 2, 5): a routed slot's expert input is
    ``x[t] * topk_weights[t, j]`` (float32, rounded once to ``x.dtype``; then FP8-quantized if asked) and the combine
    weighs its output 1 (times ``c``); a fused shared slot keeps its input and its weight.

    Args:
      x: ``[T, H]`` float32 / bf16 / float16 (``H = config.hidden_size``).
      topk_weights: ``[T, topk + S]`` float32, the slots' weights (the gate's ``topk_weights``, a shared gate's
        sigmoid applied): the combine's, or with ``config.apply_router_weight_on_input`` the routed slots' input
        scales (above).
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
      w13_scale, w2_scale: the weights' dequantization multipliers (``w ~= q * scale``), exactly for quantized
        weights: ``"fp8_per_token"`` float32 per-expert ``[E_local]`` or per-channel ``[E_local, N]`` (each weight
        its own), ``"fp8_block"`` float32 128x128 blocks ``[E_local, N // 128, K // 128]`` (``N, K = 2*I, H`` for
        ``w13``, ``H, I`` for ``w2``); 4-bit ``[E_local, 2*I, H // 32]`` / ``[E_local, H, I // 32]`` (uint8 e8m0 for
        mxfp4, bf16 for int4).
      implementation: ``None`` (on a GPU: ``"pallas_triton"``, falling back to ``"reference"`` with a logged
        warning; on the CPU: ``"reference"``), ``"pallas_triton"`` (a jitted prelude and two kernels, no host
        synchronisation, shapes static; deterministic: bit-identical across runs and ``jax.jit`` replays;
        interpreted on the CPU) or ``"reference"`` (the staged layer's stage references).

    Returns: ``out [T, H]`` in ``x.dtype``: this rank's partial sum (the sum over EP ranks is the layer's experts'
    output, CONTRACT.md section 6). Jittable (the arguments' checks need only shapes and dtypes). Not
    differentiable (an inference path): a derivative through it raises (below) rather than giving a wrong or
    missing gradient.

    Raises: ValueError / TypeError naming the argument, before anything runs (shapes, dtypes, biases given without
      ``config.expert_bias`` or missing with it, weight scales missing, given for float weights or of another
      layout than ``config.quant`` takes, an array of another framework); RuntimeError naming the input when
      ``jax.grad`` / ``jax.jvp`` differentiate through it (no backward: ``moe_forward`` is the path for training).
    """
    check_fused_experts_decode(_OP, x, topk_weights, topk_ids, w13, w2, config, w13_bias, w2_bias, w13_scale,
                               w2_scale)
    check_choice(_OP, "implementation", implementation, (None, *IMPLEMENTATIONS))
    named = {"x": x, "topk_weights": topk_weights, "w13": w13, "w2": w2, "w13_bias": w13_bias, "w2_bias": w2_bias}
    x, topk_weights, w13, w2, w13_bias, w2_bias = (None if a is None else _no_derivative(name, a)
                                                   for name, a in named.items())
    args = (x, topk_weights, topk_ids, w13, w2, config, w13_bias, w2_bias, w13_scale, w2_scale)
    return dispatch(_OP, implementation, {"pallas_triton": lambda: fused_experts_decode_pallas_triton(*args),
                                          "reference": lambda: fused_experts_decode_reference(*args)})
