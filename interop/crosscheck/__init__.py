"""The stage-by-stage cross-check: one set of inputs through four implementations of the MoE layer.

The four implementations (CONTRACT.md, first line): the jnp reference (``moe_pallas``,
``implementation="reference"``), the torch reference (``moe_torch``, ``"reference"``), the Pallas
kernels (``moe_pallas``, ``"pallas_triton"``; interpreted on a CPU) and the Triton kernels
(``moe_torch``, ``"triton"``; interpreted on a CPU). On a GPU, ``"pallas_mosaic_gpu"`` may be
added: its GEMMs on Mosaic GPU, every other stage on ``pallas_triton`` (its backward GEMMs too:
the JAX dgrad / wgrad have no Mosaic kernel).

Forward stages, in the order of ``moe_*/layer.py``::

    weights   float w13, w2 --quantize_weight_fp8 (4-bit: _mxfp4 / _int4)--> codes + scales
                                                                  (FP8 and 4-bit modes; references only)
    gate      router_logits --select_experts--> topk_weights, topk_ids
    slot_weights  topk_weights, shared_expert_gate_logits --slot_weights--> combine_weights, input_scale
                                                                  (shared_expert_gate / apply_router_weight_on_input)
    routing   topk_ids --routing_metadata--> expert_offsets, src2dst, dst2src
    scaled_slot_rows  x, input_scale --scaled_slot_rows--> scaled_rows [T*k', H]   (apply_router_weight_on_input)
    permute   x (or scaled_rows, one per assignment), dst2src --permute (+FP8 quant)--> x_permuted, x_scale
    gemm1     x_permuted, w13 (+ w13_bias) --grouped_gemm--> h     (4-bit weights: w_format)
    act       h --act_and_mul (+FP8 quant)--> a, a_scale
    gemm2     a, w2 (+ w2_bias) --grouped_gemm--> y
    combine   y, src2dst, topk_weights (or combine_weights) --combine--> out
    layer     x, router_logits, weights --moe_forward--> out     (end to end, nothing shared)

The 2026 families' stages run only for the layers that have them (``Stage.applies``; ``OPTIONAL_STAGES``):
``slot_weights`` (CONTRACT.md section 1: Qwen3-Next's shared slots times ``sigmoid(shared_expert_gate_logits)``,
Llama 4's routed weights moved from the combine onto the expert input) and ``scaled_slot_rows`` (section 2:
``round(float32(x[t]) * w[t, j])``), each a framework op that every backend's layer runs (no kernel), and their
backward; gpt-oss's bias gradients ``gemm2_dbias`` / ``gemm1_dbias`` (``grouped_gemm_dbias``).
``shared_expert_gate_logits [T, S]`` are ``x`` times a seeded gate weight (or a given one,
:class:`LayerWeights`), the expert biases seeded (``draw_expert_biases``) and rounded to bf16.

Backward stages (``backward=True``, ``epmoe check --backward``; CONTRACT.md section 8, the stage-level
backward ops of ``moe_*/ops/*/api.py``), in the order the gradient flows, for a seeded random
cotangent ``d_out [T, H]`` (:func:`make_cotangent`)::

    combine_bwd   d_out, y, src2dst, topk_weights --combine_backward--> d_y, d_topk_weights
                  (with slot weights: combine_weights --> d_combine_weights)
    gemm2_dgrad   d_y, w2 --grouped_gemm_dgrad--> d_a                 (4-bit: the decoded weights)
    gemm2_wgrad   a, d_y --grouped_gemm_wgrad--> d_w2                 (float weights only)
    gemm2_dbias   d_y --grouped_gemm_dbias--> d_w2_bias               (expert_bias)
    act_bwd       h, d_a --act_and_mul_backward--> d_h
    gemm1_dgrad   d_h, w13 --grouped_gemm_dgrad--> d_xp
    gemm1_wgrad   x_permuted, d_h --grouped_gemm_wgrad--> d_w13       (float weights only)
    gemm1_dbias   d_h --grouped_gemm_dbias--> d_w13_bias              (expert_bias)
    permute_bwd   d_xp, src2dst --permute_backward--> d_x (apply_router_weight_on_input: d_rows [T*k', H] float32)
    scaled_slot_rows_bwd  x, input_scale, d_rows --scaled_slot_rows_backward--> d_x, d_input_scale
    slot_weights_bwd  topk_weights, shared_expert_gate_logits, d_combine_weights, d_input_scale
                  --slot_weights_backward--> d_topk_weights, d_shared_expert_gate_logits
    gate_bwd      router_logits, topk_ids, d_topk_weights --select_experts_backward--> d_router_logits
    layer_bwd     d_out --vjp of moe_forward--> d_x, d_router_logits, (d_shared_expert_gate_logits, d_w13_bias,
                  d_w2_bias,) d_w13, d_w2   (jax.vjp / torch autograd, end to end, nothing shared)

To isolate a stage, every implementation gets the *same* upstream values: the jnp reference's
output of the previous stage (backward: the previous backward stage's reference gradient and the
forward's reference intermediates), converted (numpy is the hub, so bf16 and FP8 travel as their
bit patterns). A mismatch at a stage is therefore that stage's own. ``layer`` and ``layer_bwd`` run
each implementation end to end. FP8 layers: the backward is straight-through (the dgrads take the
FP8 codes with their scales and use the dequantized weights); the weight codes are frozen, so the
wgrad stages do not run and ``layer_bwd`` gives ``d_x`` and ``d_router_logits`` only (4-bit layers alike: the
dgrads read the weights decoded and rounded to bf16, as the layer's ``dgrad_weight``).

Pairs compared at each stage: each kernel backend against its own framework's reference, the
two references against each other, and Pallas against Triton. The verdict of each comparison
follows CONTRACT.md section 7 (forward) or section 8 (backward); the numbers are :data:`TOLERANCES`
(from :mod:`moe_contract.tolerances`, their one home):

- integer outputs (ids, offsets, ``src2dst``, ``dst2src``): exactly equal; reported as the
  number of mismatches and the first flat index. Section 1 breaks ties by the lower index, so
  ids never legitimately differ. ``dst2src`` is compared on its first ``M`` rows (rows ``>= M``
  are never read, section 2); the row-indexed outputs of the later stages likewise.
- FP8 codes and their scales: bit-identical (reported as the % of equal bytes). The one
  exception is the *fused* FP8 quantization of the activation across frameworks (``act``,
  ``jnp-reference`` vs ``torch-reference`` and Pallas vs Triton): XLA's and torch's ``exp``
  differ by ulps, so a code may move by one FP8 step; those pairs are judged on the
  dequantized values (relative Frobenius error <= ``FP8_REL_FRO``). Within a framework the
  fused codes must be bit-identical.
- gate weights: float32, relative error <= ``GATE_WEIGHT_RTOL`` elementwise; so are ``slot_weights``'
  ``combine_weights`` and ``input_scale`` (the gate's weights, times a float32 sigmoid or moved).
- ``scaled_slot_rows``: bit-identical (one float32 multiply, one rounding to ``x``'s dtype: section 2), as the
  permute. 4-bit weights (section 9): codes and scales exactly equal; the GEMMs and the layer by the bf16 row.
- bf16 outputs (GEMMs, activation, combine, layer): ``||a-b|| / ||b|| <= BF16_REL_FRO``, or
  ``FP8_REL_FRO`` for the FP8 GEMMs and the FP8 layer against a reference; Pallas vs Triton
  always the tighter ``BF16_REL_FRO``. Max abs error is reported alongside.
- gradients (section 8): a backward stage's float32 gradient (``d_topk_weights``,
  ``d_router_logits``, the wgrads' float32 ``d_w13`` / ``d_w2``; float32 math on the same inputs on
  both sides) ``rel_fro <= GRAD_F32_REL_FRO``; a bf16 gradient (``d_y``, ``d_a``, ``d_h``, ``d_xp``,
  ``d_x``) and every gradient of ``layer_bwd`` (bf16 inputs) ``<= GRAD_BF16_REL_FRO``; Pallas vs
  Triton the same rows. The weight gradient of every local expert with no rows is exactly 0 (each
  implementation, wgrad stages and ``layer_bwd``).

Expert parallelism (:func:`run_ep_check`, stage ``"ep"``): with ``ep_size = N > 1`` every
implementation runs the layer once per rank (``moe_forward`` with ``config.for_rank(r)`` and that
rank's ``local_weights``) and the partials are summed in float32 (the contract's EP semantics,
section 6); that ``ep_sum`` is judged against the same implementation's single-device layer
(``ep_size=1``) - relative Frobenius error <= ``F32_REL_FRO`` with float32 inputs, the layer's bf16
(or FP8) rule with bf16 inputs - and the ``ep_sum`` of the implementations against each other (the
pairs above: torch vs jnp, kernel vs its reference, Triton vs Pallas) by the layer's rule. Where
JAX has ``N`` devices the real multi-device path, ``moe_pallas.ep_moe_forward`` under
``shard_map`` (both dispatch modes), is judged against the single device too; otherwise
that row is skipped and says so (``XLA_FLAGS=--xla_force_host_platform_device_count=N`` gives a
CPU ``N`` devices). torch's ``ep_moe_forward`` needs ``torch.distributed`` processes and is not
run here (``tests/test_ep_torch.py`` runs it on gloo). With ``backward=True`` (stage ``"ep_bwd"``,
section 8's EP rule): every rank's ``d_x`` and ``d_router_logits`` summed in float32 against the single
device's, each rank's weight gradients against their slice of the single device's
(``GRAD_F32_REL_FRO`` with float32 inputs, ``GRAD_BF16_REL_FRO`` with bf16), and the implementations
against each other; the multi-device ``ep_moe_forward``'s gradients are not run. ``d_shared_expert_gate_logits``
is summed like ``d_x`` (``EP_GATE_GRADS``), the bias gradients sliced like the weights' (``EP_BIAS_GRADS``).

Modules: ``stages.py`` (the implementations and the stage table: what each stage calls in each
framework), ``run.py`` (inputs, the driver), ``ep.py`` (the EP summary), ``judge.py`` (comparisons and the
contract's verdicts, :class:`CrossCheckResult`), ``render.py`` (tables), ``convert.py`` (numpy hub).
Used by ``epmoe check`` (``interop/cli.py``); the result is a :class:`CrossCheckResult` (``.ok``,
``.failed_stages``, ``.to_json()``).
"""

from interop.crosscheck.convert import _torch_device, from_numpy, to_numpy
from interop.crosscheck.judge import (
    NO_ROWS,
    SELF,
    TOLERANCES,
    Comparison,
    CrossCheckResult,
    backward_rule,
    compare_exact,
    compare_float,
    compare_gate_weights,
    dequantize,
    empty_experts,
    judge_no_rows,
    rel_fro,
)
from interop.crosscheck.render import PAIR_LABEL, render
from interop.crosscheck.ep import (
    EP_BIAS_GRADS,
    EP_DTYPES,
    EP_GATE_GRADS,
    EP_MODES,
    EP_SLICED_GRADS,
    EP_SLICES_VS_SINGLE,
    EP_SUM,
    EP_SUM_VS_SINGLE,
    EP_SUMMED_GRADS,
    ep_grad_output,
    ep_real_output,
    run_ep_check,
)
from interop.crosscheck.run import (
    COTANGENT,
    LayerWeights,
    cast_experts,
    make_cotangent,
    make_inputs,
    merge_results,
    run_crosscheck,
)
from interop.crosscheck.stages import (
    ALL_STAGES,
    BACKWARD_STAGE_NAMES,
    BACKWARD_STAGES,
    BIAS_STAGES,
    DEFAULT_IMPLEMENTATIONS,
    EP_BACKWARD_STAGE,
    EP_STAGE,
    FORWARD_STAGES,
    IMPLEMENTATIONS,
    OPTIONAL_STAGES,
    REFERENCE,
    SLOT_WEIGHT_STAGES,
    STAGE_TABLE,
    STAGES,
    Stage,
)
from moe_contract.config import ACTIVATION_QUANT, WEIGHT_LAYOUT  # noqa: F401 (the layouts of each quant mode)
from moe_contract.tolerances import (  # noqa: F401 (the numbers the verdicts use, re-exported)
    BF16_REL_FRO,
    F32_REL_FRO,
    FP8_REL_FRO,
    GATE_WEIGHT_RTOL,
    GRAD_BF16_REL_FRO,
    GRAD_F32_REL_FRO,
)

__all__ = [
    "ALL_STAGES", "BACKWARD_STAGES", "BACKWARD_STAGE_NAMES", "BIAS_STAGES", "COTANGENT", "DEFAULT_IMPLEMENTATIONS",
    "EP_BACKWARD_STAGE", "EP_BIAS_GRADS", "EP_DTYPES", "EP_GATE_GRADS", "EP_MODES", "EP_SLICED_GRADS", "EP_SLICES_VS_SINGLE", "EP_STAGE", "EP_SUM",
    "EP_SUMMED_GRADS", "EP_SUM_VS_SINGLE", "FORWARD_STAGES", "IMPLEMENTATIONS", "NO_ROWS", "OPTIONAL_STAGES", "PAIR_LABEL",
    "REFERENCE", "SELF", "SLOT_WEIGHT_STAGES", "STAGES", "STAGE_TABLE", "TOLERANCES", "Comparison", "CrossCheckResult", "LayerWeights",
    "Stage", "backward_rule", "cast_experts", "compare_exact", "compare_float", "compare_gate_weights",
    "dequantize", "empty_experts", "ep_grad_output", "ep_real_output", "from_numpy", "judge_no_rows",
    "make_cotangent", "make_inputs", "merge_results", "rel_fro", "render", "run_crosscheck", "run_ep_check",
    "to_numpy",
]
