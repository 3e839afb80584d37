"""Gate (router): ``router_logits [T, E]`` -> ``topk_weights``, ``topk_ids``; and its backward
(CONTRACT.md section 8): ``select_experts_backward``, and ``select_experts`` differentiable in
``router_logits`` (a ``torch.autograd.Function`` whose backward is ``select_experts_backward``).

Mirror: ``moe_pallas/ops/gate/api.py``.
"""

from __future__ import annotations

import torch

from moe_contract.op_checks import check_select_experts, check_select_experts_backward
from moe_contract.validation import check_choice
from moe_torch.ops.gate.reference import select_experts_backward_reference, select_experts_reference
from moe_torch.ops.common import first_order_backward, takes_torch_tensors
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


def _triton_select_experts_backward(*args, **kwargs):
    """The Triton backend of :func:`select_experts_backward`, imported on first use."""
    try:
        from moe_torch.ops.gate.triton import select_experts_backward_triton
    except ImportError as exc:
        raise NotImplementedError(f"select_experts_backward: triton is not importable ({exc})") from exc
    return select_experts_backward_triton(*args, **kwargs)


class _SelectExpertsFunction(torch.autograd.Function):
    """``select_experts`` with a backward into ``router_logits``: ``select_experts_backward`` with the
    forward's settings and implementation. ``topk_ids`` is not differentiable; the bias gets zeros."""

    @staticmethod
    def forward(ctx, router_logits, e_score_correction_bias, run, kwargs, implementation):
        weights, ids = run()
        ctx.mark_non_differentiable(ids)
        ctx.save_for_backward(router_logits, ids)
        ctx.kwargs, ctx.implementation = kwargs, implementation
        return weights, ids

    @staticmethod
    @first_order_backward("select_experts")
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_weights, d_ids):
        router_logits, ids = ctx.saved_tensors
        bias = ctx.kwargs["e_score_correction_bias"]
        d_logits = None
        if ctx.needs_input_grad[0]:
            d_logits = select_experts_backward(router_logits, ids, d_weights.float(), **ctx.kwargs,
                                               implementation=ctx.implementation).to(router_logits.dtype)
        d_bias = torch.zeros_like(bias) if ctx.needs_input_grad[1] else None  # nothing flows through the choice
        return d_logits, d_bias, None, None, None


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
      routing: ``"softmax_topk"`` (Mixtral, Qwen3-MoE; gpt-oss's softmax over the top-k logits is this
        with ``renormalize=True``), ``"grouped_topk"`` (DeepSeek-V2: softmax, group score = max),
        ``"biased_grouped_topk"`` (DeepSeek-V3: sigmoid, selection score ``s + e_score_correction_bias``,
        group score = sum of the top two, dropped groups masked with -inf, weights from the unbiased
        ``s``) or ``"sigmoid_topk"`` (Llama 4: the top-k logits, weight ``sigmoid(logit)``; no groups,
        no bias).
      renormalize: divide the weights by their sum (+1e-20 in the sigmoid modes).
      num_expert_group, topk_group: the grouped modes' groups (``E % num_expert_group == 0``); None
        for ``softmax_topk`` and ``sigmoid_topk``.
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

    Differentiable in ``router_logits`` (autograd, when it requires grad), through ``topk_weights``
    only: the backward is :func:`select_experts_backward` with the same ``implementation``;
    ``topk_ids`` has no gradient, ``e_score_correction_bias`` a zero one.

    Raises:
      ValueError: bad shapes or routing arguments; TypeError: non-float logits or bias;
      NotImplementedError: ``implementation="triton"`` where the kernel cannot run (no CUDA and
      no interpreter, ``E > 512``, more than 16 groups).

    Source: DeepSeek-V3 technical report (arXiv:2412.19437) section 2.1.2; SGLang's
    ``biased_grouped_topk`` semantics as pinned by CONTRACT.md; ``sigmoid_topk``: transformers 5.24
    ``models/llama4/modeling_llama4.py`` (``Llama4Router``).
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
    logits = router_logits.detach()
    bias = None if e_score_correction_bias is None else e_score_correction_bias.detach()
    fwd_kwargs = {**kwargs, "e_score_correction_bias": bias}
    backends = {
        "triton": lambda: _triton_select_experts(router_logits=logits, **fwd_kwargs),
        "reference": lambda: select_experts_reference(logits, **fwd_kwargs),
    }

    def run():
        if T == 0:
            return (
                torch.zeros((0, width), dtype=torch.float32, device=router_logits.device),
                torch.zeros((0, width), dtype=torch.int32, device=router_logits.device),
            )
        return dispatch(op, implementation, backends, router_logits.device)

    bias_grad = e_score_correction_bias is not None and e_score_correction_bias.requires_grad
    if torch.is_grad_enabled() and (router_logits.requires_grad or bias_grad):
        return _SelectExpertsFunction.apply(router_logits, e_score_correction_bias, run, fwd_kwargs, implementation)
    return run()


@takes_torch_tensors
def select_experts_backward(
    router_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    d_topk_weights: torch.Tensor,
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
) -> torch.Tensor:
    """The backward of :func:`select_experts` into ``router_logits`` (CONTRACT.md section 8), float32:
    the chain rule of section 1's weight formulas given the chosen ``topk_ids`` (nothing flows through
    the choice, the kept groups or the bias).

    Per token: softmax routings ``p = softmax(logits)``, ``w_j = p[id_j]``; sigmoid routings (biased,
    ``sigmoid_topk``) ``s = sigmoid(logits)``, ``w_j = s[id_j]``; renormalize ``w / sum(w)`` over the routed
    slots (sigmoid: ``/ (sum + 1e-20)``);
    times ``rsf`` when ``apply_routed_scaling_factor_on_output``. The shared-expert slots (the last
    ``num_fused_shared_experts`` columns) are constants: their gradient is ignored. Softmax couples
    all ``E`` logits: ``d_logit = p * (d_p - sum(p * d_p))`` (a NaN logit makes its row's weights, and so its
    gradient, NaN); sigmoid: ``d_logit = d_s * s * (1 - s)`` on the chosen experts, exactly 0 elsewhere (also
    where the logit is NaN or +-inf).

    Args:
      router_logits: ``[T, E]`` float32 / bf16 / float16, the forward's input.
      topk_ids: ``[T, topk+S]`` int32 / int64, the forward's ids (routed ids in ``[0, E)``).
      d_topk_weights: ``[T, topk+S]`` float32, the gradient of ``topk_weights``.
      topk, routing, renormalize, num_expert_group, topk_group, e_score_correction_bias,
        routed_scaling_factor, apply_routed_scaling_factor_on_output, num_fused_shared_experts:
        the forward's arguments, validated by the same rules (the grouping and the bias only shaped
        the choice: they do not enter the gradient).
      implementation: ``None`` (CUDA tensors: ``"triton"``, falling back to ``"reference"`` with a
        logged warning; CPU tensors: ``"reference"``), ``"triton"`` (one launch, every routing mode)
        or ``"reference"``.

    Returns: ``d_router_logits [T, E]`` float32.

    Raises: ValueError (shapes, routing arguments), TypeError (dtypes), NotImplementedError
      (``implementation="triton"`` where the kernel cannot run: no CUDA and no interpreter, ``E > 512``).
    """
    op = "select_experts_backward"
    kwargs = dict(
        topk=topk,
        routing=routing,
        renormalize=renormalize,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor,
        apply_routed_scaling_factor_on_output=apply_routed_scaling_factor_on_output,
        num_fused_shared_experts=num_fused_shared_experts,
    )
    check_select_experts_backward(op, router_logits, topk_ids, d_topk_weights, **kwargs)
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    kwargs["routed_scaling_factor"] = float(routed_scaling_factor)
    T, E = router_logits.shape
    args = (router_logits.detach(), topk_ids, d_topk_weights.detach())

    def triton_backend():
        if T == 0:
            return torch.zeros((0, E), dtype=torch.float32, device=router_logits.device)
        return _triton_select_experts_backward(*args, **kwargs)

    backends = {
        "triton": triton_backend,
        "reference": lambda: select_experts_backward_reference(*args, **kwargs).float(),
    }
    return dispatch(op, implementation, backends, router_logits.device)
