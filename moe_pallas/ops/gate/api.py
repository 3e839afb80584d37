"""Gate (router): ``router_logits [T, E]`` -> ``topk_weights``, ``topk_ids``; and its backward
(CONTRACT.md section 8): ``select_experts_backward``, and ``select_experts`` differentiable in
``router_logits`` (a ``jax.custom_vjp`` whose backward is ``select_experts_backward``).

Mirror: ``moe_torch/ops/gate/api.py``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_contract.op_checks import check_select_experts, check_select_experts_backward
from moe_contract.validation import check_choice
from moe_pallas.ops.common import first_order_only, takes_jax_arrays
from moe_pallas.ops.dispatch import dispatch
from moe_pallas.ops.gate.pallas_triton import select_experts_backward_pallas_triton, select_experts_pallas_triton
from moe_pallas.ops.gate.reference import select_experts_backward_reference, select_experts_reference

IMPLEMENTATIONS = ("pallas_triton", "reference")


class _Static(NamedTuple):
    """The validated, hashable (static) arguments of one ``select_experts`` call (all but the bias)."""

    topk: int
    routing: str
    renormalize: bool
    num_expert_group: int | None
    topk_group: int | None
    routed_scaling_factor: float
    apply_routed_scaling_factor_on_output: bool
    num_fused_shared_experts: int
    implementation: str | None


def _select_experts(router_logits, bias, st: _Static):
    kw = st._asdict()
    implementation = kw.pop("implementation")
    if router_logits.shape[0] == 0:
        width = st.topk + st.num_fused_shared_experts
        return jnp.zeros((0, width), jnp.float32), jnp.zeros((0, width), jnp.int32)
    return dispatch("select_experts", implementation, {
        "pallas_triton": lambda: select_experts_pallas_triton(router_logits, bias, **kw),
        "reference": lambda: select_experts_reference(router_logits, e_score_correction_bias=bias, **kw),
    })


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _select_experts_vjp(router_logits, bias, st: _Static):
    return _select_experts(router_logits, bias, st)


def _select_experts_fwd(router_logits, bias, st):
    weights, ids = _select_experts(router_logits, bias, st)
    return (weights, ids), (router_logits, bias, ids)


def _select_experts_bwd(st, residuals, cotangents):
    router_logits, bias, ids = residuals
    d_weights, _ = cotangents  # topk_ids: integer, no gradient
    kw = st._asdict()
    implementation = kw.pop("implementation")
    d_logits = select_experts_backward(router_logits, ids, d_weights.astype(jnp.float32), **kw,
                                       e_score_correction_bias=bias, implementation=implementation)
    d_bias = None if bias is None else jnp.zeros_like(bias)  # nothing flows through the choice
    return d_logits.astype(router_logits.dtype), d_bias


_select_experts_vjp.defvjp(_select_experts_fwd, _select_experts_bwd)


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
      implementation: ``"pallas_triton"`` (one fused kernel, interpreted on the CPU),
        ``"reference"``, or ``None`` (the device's default order, ``moe_pallas.ops.dispatch``;
        the reference on the CPU).

    Returns:
      ``(topk_weights [T, topk+S] float32, topk_ids [T, topk+S] int32)``, slots ordered by
      descending selection score, ties to the lower index, NaN scores ranked last.

    Differentiable in ``router_logits`` (``jax.custom_vjp``), through ``topk_weights`` only: the
    backward is :func:`select_experts_backward` with the same ``implementation``; ``topk_ids`` has no
    gradient, ``e_score_correction_bias`` a zero one.

    Raises:
      ValueError: bad shapes or routing arguments; TypeError: non-float logits or bias;
      NotImplementedError: ``implementation="pallas_triton"`` with a logits tile over Triton's limit.

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
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    st = _Static(topk, routing, renormalize, num_expert_group, topk_group, float(routed_scaling_factor),
                 apply_routed_scaling_factor_on_output, num_fused_shared_experts, implementation)
    # a derivative of the gradient raises, naming the op
    router_logits, e_score_correction_bias = first_order_only(op, router_logits, e_score_correction_bias)
    return _select_experts_vjp(router_logits, e_score_correction_bias, st)


@takes_jax_arrays
def select_experts_backward(
    router_logits: jax.Array,
    topk_ids: jax.Array,
    d_topk_weights: jax.Array,
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
) -> jax.Array:
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
      implementation: ``"pallas_triton"`` (one kernel, every routing mode; interpreted on the CPU),
        ``"reference"``, or ``None`` (the device's default order, ``moe_pallas.ops.dispatch``; the
        reference on the CPU).

    Returns: ``d_router_logits [T, E]`` float32.

    Raises: ValueError (shapes, routing arguments), TypeError (dtypes), NotImplementedError
      (``implementation="pallas_triton"`` with a logits tile over Triton's limit).
    """
    op = "select_experts_backward"
    kw = dict(
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
    check_select_experts_backward(op, router_logits, topk_ids, d_topk_weights, **kw)
    check_choice(op, "implementation", implementation, (None, *IMPLEMENTATIONS))
    kw["routed_scaling_factor"] = float(routed_scaling_factor)
    kernel_kw = {k: kw[k] for k in ("topk", "routing", "renormalize", "routed_scaling_factor",
                                    "apply_routed_scaling_factor_on_output")}
    return dispatch(op, implementation, {
        "pallas_triton": lambda: select_experts_backward_pallas_triton(
            router_logits, topk_ids, d_topk_weights, **kernel_kw),
        "reference": lambda: select_experts_backward_reference(
            router_logits, topk_ids, d_topk_weights, **kw).astype(jnp.float32),
    })
