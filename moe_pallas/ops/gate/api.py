"""Gate (router): ``router_logits [T, E]`` -> ``topk_weights``, ``topk_ids``.

Mirror: ``moe_torch/ops/gate/api.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_contract.op_checks import check_select_experts
from moe_contract.validation import check_choice
from moe_pallas.ops.common import takes_jax_arrays
from moe_pallas.ops.dispatch import dispatch
from moe_pallas.ops.gate.pallas_triton import select_experts_pallas_triton
from moe_pallas.ops.gate.reference import select_experts_reference

IMPLEMENTATIONS = ("pallas_triton", "reference")


@takes_jax_arrays
def select_experts(
    router_logits: jax.Array,
    *,
    topk: int,
    routing: str = "softmax_topk",
    renormalize: bool = True,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: jax.Array | None = None,
    routed_scaling_factor: float = 1.0,
    apply_routed_scaling_factor_on_output: bool = False,
    num_fused_shared_experts: int = 0,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Top-k expert selection (CONTRACT.md section 1), all arithmetic in float32.

    Args:
      router_logits: ``[T, E]`` float32, bf16 or float16.
      topk: routed experts per token, ``1 <= topk <= E``.
      routing: ``"softmax_topk"`` (Mixtral, Qwen3-MoE), ``"grouped_topk"`` (DeepSeek-V2:
        softmax, group score = max) or ``"biased_grouped_topk"`` (DeepSeek-V3: sigmoid,
        selection score ``s + e_score_correction_bias``, group score = sum of the top two,
        dropped groups masked with -inf, weights from the unbiased ``s``).
      renormalize: divide the weights by their sum (+1e-20 in the biased mode).
      num_expert_group, topk_group: the grouped modes' groups (``E % num_expert_group == 0``).
      e_score_correction_bias: ``[E]`` float, required by (and only by) the biased mode.
      routed_scaling_factor: ``rsf``; multiplies the weights here only when
        ``apply_routed_scaling_factor_on_output``, otherwise the combine step applies it.
      num_fused_shared_experts: ``S`` extra slots with ids ``E..E+S-1``, weight ``1/rsf``
        before scaling.
      implementation: ``"pallas_triton"`` (one fused kernel, interpreted on the CPU),
        ``"reference"``, or ``None`` (the device's default order, ``moe_pallas.ops.dispatch``;
        the reference on the CPU).

    Returns:
      ``(topk_weights [T, topk+S] float32, topk_ids [T, topk+S] int32)``, slots ordered by
      descending selection score, ties to the lower index, NaN scores ranked last.

    Raises:
      ValueError: bad shapes or routing arguments; TypeError: non-float logits or bias;
      NotImplementedError: ``implementation="pallas_triton"`` with a logits tile over Triton's limit.

    Source: DeepSeek-V3 technical report (arXiv:2412.19437) section 2.1.2; SGLang's
    ``biased_grouped_topk`` semantics as pinned by CONTRACT.md.
    """
    op = "select_experts"
    check_select_experts(
        op,
        router_logits,
        topk=topk,
        routing=routing,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor,
        num_fused_shared_experts=num_fused_shared_experts,
        renormalize=renormalize,
        apply_routed_scaling_factor_on_output=apply_routed_scaling_factor_on_output,
    )
    T = router_logits.shape[0]
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))

    width = topk + num_fused_shared_experts
    if T == 0:
        return jnp.zeros((0, width), jnp.float32), jnp.zeros((0, width), jnp.int32)
    kw = dict(
        topk=topk,
        routing=routing,
        renormalize=renormalize,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        routed_scaling_factor=float(routed_scaling_factor),
        apply_routed_scaling_factor_on_output=apply_routed_scaling_factor_on_output,
        num_fused_shared_experts=num_fused_shared_experts,
    )
    return dispatch(op, implementation, {
        "pallas_triton": lambda: select_experts_pallas_triton(router_logits, e_score_correction_bias, **kw),
        "reference": lambda: select_experts_reference(
            router_logits, e_score_correction_bias=e_score_correction_bias, **kw),
    })
