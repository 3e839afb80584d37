"""Gate (router) reference in jnp: CONTRACT.md section 1, line by line; and its backward (section 8).

Mirror: ``moe_torch/ops/gate/reference.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_contract.config import GROUPED_ROUTINGS, SIGMOID_ROUTINGS


def rank_descending(key: jax.Array) -> jax.Array:
    """Indices that sort ``key [..., n]`` by descending value along the last axis.

    Ties: the lower index first (a stable sort). NaN ranks below every finite value, level
    with -inf (NaN is mapped to -inf, then the tie rule applies). -0.0 equals +0.0.
    """
    key = jnp.where(jnp.isnan(key), -jnp.inf, key) + 0.0  # "+ 0.0" turns -0.0 into +0.0
    return jnp.argsort(-key, axis=-1, stable=True)


def select_experts_reference(
    router_logits: jax.Array,
    *,
    topk: int,
    routing: str,
    renormalize: bool,
    num_expert_group: int | None,
    topk_group: int | None,
    e_score_correction_bias: jax.Array | None,
    routed_scaling_factor: float,
    apply_routed_scaling_factor_on_output: bool,
    num_fused_shared_experts: int,
) -> tuple[jax.Array, jax.Array]:
    """``router_logits [T, E]`` -> ``(topk_weights [T, topk+S] f32, topk_ids [T, topk+S] i32)``.

    (float64 logits are computed, and weighted, in float64: the tests' autodiff check of the backward.)"""
    cdt = jnp.promote_types(router_logits.dtype, jnp.float32)
    logits = router_logits.astype(cdt)
    T, E = logits.shape
    if routing == "biased_grouped_topk":
        scores = jax.nn.sigmoid(logits)
        select = scores + e_score_correction_bias.astype(cdt)[None, :]
    elif routing == "sigmoid_topk":  # Llama 4: ranked by the logit itself (sigmoid ties where it saturates)
        scores = jax.nn.sigmoid(logits)
        select = logits
    else:
        scores = jax.nn.softmax(logits, axis=-1)
        select = scores

    if routing in GROUPED_ROUTINGS:
        per_group = E // num_expert_group
        grouped = select.reshape(T, num_expert_group, per_group)
        clean = jnp.where(jnp.isnan(grouped), -jnp.inf, grouped)
        if routing == "grouped_topk":
            group_score = clean.max(axis=-1)
        else:  # sum of the two largest selection scores of the group
            group_score = -jnp.sort(-clean, axis=-1)[..., :2].sum(axis=-1)
        kept = rank_descending(group_score)[:, :topk_group]  # [T, topk_group]
        group_kept = (kept[:, :, None] == jnp.arange(num_expert_group)[None, None, :]).any(axis=1)
        expert_kept = jnp.repeat(group_kept, per_group, axis=1)  # [T, E]
        select = jnp.where(expert_kept, select, -jnp.inf)  # -inf, not 0: c may be negative

    topk_ids = rank_descending(select)[:, :topk]
    topk_weights = jnp.take_along_axis(scores, topk_ids, axis=1)  # unbiased scores
    if renormalize:
        denom = topk_weights.sum(axis=-1, keepdims=True)
        if routing in SIGMOID_ROUTINGS:  # sigmoid weights may all underflow to 0
            denom = denom + 1e-20
        topk_weights = topk_weights / denom

    if num_fused_shared_experts:
        S = num_fused_shared_experts
        shared_ids = jnp.broadcast_to(jnp.arange(E, E + S, dtype=topk_ids.dtype)[None, :], (T, S))
        shared_weights = jnp.full((T, S), 1.0 / routed_scaling_factor, cdt)
        topk_ids = jnp.concatenate([topk_ids, shared_ids], axis=1)
        topk_weights = jnp.concatenate([topk_weights, shared_weights], axis=1)
    if apply_routed_scaling_factor_on_output:
        topk_weights = topk_weights * jnp.float32(routed_scaling_factor)
    return topk_weights.astype(cdt), topk_ids.astype(jnp.int32)


def select_experts_backward_reference(
    router_logits: jax.Array,
    topk_ids: jax.Array,
    d_topk_weights: jax.Array,
    *,
    topk: int,
    routing: str,
    renormalize: bool,
    routed_scaling_factor: float,
    apply_routed_scaling_factor_on_output: bool,
    **_choice_only,
) -> jax.Array:
    """``d_router_logits [T, E]`` float32: the chain rule of :func:`select_experts_reference`'s weights
    given the chosen ``topk_ids`` (CONTRACT.md section 8). Nothing flows through the choice, so the
    grouping arguments (in ``_choice_only``) do not enter; the shared-expert slots (columns
    ``>= topk``) are constants. A routed id outside ``[0, E)`` (never made by the gate) selects nothing.

    Forward, per token: ``s = softmax(x)`` (or ``sigmoid(x)``: biased, sigmoid_topk); ``w_j = s[id_j]``;
    ``D = sum_j w_j`` (``+ 1e-20`` sigmoid); ``out_j = c * w_j / D`` (``c = rsf`` on output, else 1).
    Backward: ``g_j = c * d_out_j``; renormalized: ``d_w_j = (g_j - sum_k g_k w_k / D) / D``;
    ``d_s[id_j] += d_w_j``; softmax: ``d_x = s * (d_s - sum(s * d_s))``; sigmoid: ``d_x = d_s * s * (1 - s)``
    on the chosen experts and exactly 0 elsewhere, even where the logit is NaN or +-inf.
    """
    cdt = jnp.promote_types(router_logits.dtype, jnp.float32)  # float64 only for the tests
    logits = router_logits.astype(cdt)
    T, E = logits.shape
    sigmoid = routing in SIGMOID_ROUTINGS  # sigmoid scores, + 1e-20 in the renormalization
    scores = jax.nn.sigmoid(logits) if sigmoid else jax.nn.softmax(logits, axis=-1)
    ids = topk_ids[:, :topk]
    valid = (ids >= 0) & (ids < E)
    ids = jnp.where(valid, ids, 0)
    w = jnp.where(valid, jnp.take_along_axis(scores, ids, axis=1), 0.0)  # [T, topk]
    g = d_topk_weights[:, :topk].astype(cdt)
    if apply_routed_scaling_factor_on_output:
        g = g * jnp.float32(routed_scaling_factor)
    if renormalize:
        denom = w.sum(axis=-1, keepdims=True)
        if sigmoid:
            denom = denom + 1e-20
        g = (g - (g * w).sum(axis=-1, keepdims=True) / denom) / denom
    rows = jnp.arange(T)[:, None]
    d_scores = jnp.zeros((T, E), cdt).at[rows, ids].add(jnp.where(valid, g, 0.0))
    if sigmoid:
        # Exactly 0 off the chosen experts: an unchosen NaN logit has s = NaN, and NaN * 0 is NaN.
        chosen = jnp.zeros((T, E), jnp.int32).at[rows, ids].add(valid.astype(jnp.int32)) > 0
        return jnp.where(chosen, d_scores * scores * (1.0 - scores), 0.0)
    return scores * (d_scores - (scores * d_scores).sum(axis=-1, keepdims=True))
