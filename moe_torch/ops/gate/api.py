"""Gate (router): ``router_logits [T, E]`` -> ``topk_weights``, ``topk_ids``.

Mirror: ``moe_pallas/ops/gate/api.py``.
"""

from __future__ import annotations

import torch

from moe_contract.op_checks import check_select_experts
from moe_contract.validation import check_choice
from moe_torch.ops.gate.reference import select_experts_reference
from moe_torch.ops.common import takes_torch_tensors
from moe_torch.ops.dispatch import dispatch

IMPLEMENTATIONS = ("triton", "reference")


def _triton_select_experts(**kwargs):
    """The Triton backend of :func:`select_experts`, imported on first use (so that ``moe_torch``
    imports without triton)."""
    try:
        from moe_torch.ops.gate.triton import select_experts_triton
    except ImportError as exc:
        raise NotImplementedError(f"select_experts: triton is not importable ({exc})") from exc
    return select_experts_triton(**kwargs)


@takes_torch_tensors
def select_experts(
    router_logits: torch.Tensor,
    *,
    topk: int,
    routing: str = "softmax_topk",
    renormalize: bool = True,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    apply_routed_scaling_factor_on_output: bool = False,
    num_fused_shared_experts: int = 0,
    implementation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
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
      implementation: ``None`` (CUDA tensors: ``"triton"``, falling back to ``"reference"`` with a
        logged warning; CPU tensors: ``"reference"``), ``"triton"`` (one fused launch, no host
        synchronisation) or ``"reference"``.

    Returns:
      ``(topk_weights [T, topk+S] float32, topk_ids [T, topk+S] int32)``, slots ordered by
      descending selection score, ties to the lower index, NaN scores ranked last.

    Raises:
      ValueError: bad shapes or routing arguments; TypeError: non-float logits or bias;
      NotImplementedError: ``implementation="triton"`` where the kernel cannot run (no CUDA and
      no interpreter, ``E > 512``, more than 16 groups).

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
        return (
            torch.zeros((0, width), dtype=torch.float32, device=router_logits.device),
            torch.zeros((0, width), dtype=torch.int32, device=router_logits.device),
        )
    kwargs = dict(
        topk=topk,
        routing=routing,
        renormalize=renormalize,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=float(routed_scaling_factor),
        apply_routed_scaling_factor_on_output=apply_routed_scaling_factor_on_output,
        num_fused_shared_experts=num_fused_shared_experts,
    )
    backends = {
        "triton": lambda: _triton_select_experts(router_logits=router_logits, **kwargs),
        "reference": lambda: select_experts_reference(router_logits, **kwargs),
    }
    return dispatch(op, implementation, backends, router_logits.device)
