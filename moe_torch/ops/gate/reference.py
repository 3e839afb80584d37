"""Gate (router) reference in torch: CONTRACT.md section 1, line by line; and its backward (section 8).

Mirror: ``moe_pallas/ops/gate/reference.py``.
"""

from __future__ import annotations

import torch

from moe_contract.config import GROUPED_ROUTINGS, SIGMOID_ROUTINGS


def rank_descending(key: torch.Tensor) -> torch.Tensor:
    """Indices that sort ``key [..., n]`` by descending value along the last dim.

    Ties: the lower index first (a stable sort). NaN ranks below every finite value, level
    with -inf (NaN is mapped to -inf, then the tie rule applies). -0.0 equals +0.0.
    """
    key = torch.where(torch.isnan(key), -torch.inf, key) + 0.0  # "+ 0.0" turns -0.0 into +0.0
    return torch.argsort(-key, dim=-1, stable=True)


def select_experts_reference(
    router_logits: torch.Tensor,
    *,
    topk: int,
    routing: str,
    renormalize: bool,
    num_expert_group: int | None,
    topk_group: int | None,
    e_score_correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
    apply_routed_scaling_factor_on_output: bool,
    num_fused_shared_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> ``(topk_weights [T, topk+S] f32, topk_ids [T, topk+S] i32)``.

    (float64 logits are computed, and weighted, in float64: the tests' autodiff check of the backward.)"""
    cdt = torch.promote_types(router_logits.dtype, torch.float32)
    logits = router_logits.to(cdt)
    T, E = logits.shape
    if routing == "biased_grouped_topk":
        scores = torch.sigmoid(logits)
        select = scores + e_score_correction_bias.to(cdt)[None, :]
    elif routing == "sigmoid_topk":  # Llama 4: ranked by the logit itself (sigmoid ties where it saturates)
        scores = torch.sigmoid(logits)
        select = logits
    else:
        scores = torch.softmax(logits, dim=-1)
        select = scores

    if routing in GROUPED_ROUTINGS:
        per_group = E // num_expert_group
        grouped = select.reshape(T, num_expert_group, per_group)
        clean = torch.where(torch.isnan(grouped), -torch.inf, grouped)
        if routing == "grouped_topk":
            group_score = clean.amax(dim=-1)
        else:  # sum of the two largest selection scores of the group
            group_score = torch.sort(clean, dim=-1, descending=True).values[..., :2].sum(dim=-1)
        kept = rank_descending(group_score)[:, :topk_group]  # [T, topk_group]
        groups = torch.arange(num_expert_group, device=kept.device)
        group_kept = (kept[:, :, None] == groups[None, None, :]).any(dim=1)
        expert_kept = torch.repeat_interleave(group_kept, per_group, dim=1)  # [T, E]
        select = torch.where(expert_kept, select, -torch.inf)  # -inf, not 0: c may be negative

    topk_ids = rank_descending(select)[:, :topk]
    topk_weights = torch.gather(scores, 1, topk_ids)  # unbiased scores
    if renormalize:
        denom = topk_weights.sum(dim=-1, keepdim=True)
        if routing in SIGMOID_ROUTINGS:  # sigmoid weights may all underflow to 0
            denom = denom + 1e-20
        topk_weights = topk_weights / denom

    if num_fused_shared_experts:
        S = num_fused_shared_experts
        shared_ids = torch.arange(E, E + S, device=topk_ids.device, dtype=topk_ids.dtype)[None, :].expand(T, S)
        shared_weights = torch.full((T, S), 1.0 / routed_scaling_factor, dtype=cdt, device=scores.device)
        topk_ids = torch.cat([topk_ids, shared_ids], dim=1)
        topk_weights = torch.cat([topk_weights, shared_weights], dim=1)
    if apply_routed_scaling_factor_on_output:
        topk_weights = topk_weights * torch.tensor(routed_scaling_factor, dtype=torch.float32)
    return topk_weights.to(cdt), topk_ids.to(torch.int32)


def select_experts_backward_reference(
    router_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    d_topk_weights: torch.Tensor,
    *,
    topk: int,
    routing: str,
    renormalize: bool,
    routed_scaling_factor: float,
    apply_routed_scaling_factor_on_output: bool,
    **_choice_only,
) -> torch.Tensor:
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
    cdt = torch.promote_types(router_logits.dtype, torch.float32)  # float64 only for the tests
    logits = router_logits.to(cdt)
    T, E = logits.shape
    sigmoid = routing in SIGMOID_ROUTINGS  # sigmoid scores, + 1e-20 in the renormalization
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    ids = topk_ids[:, :topk].long()
    valid = (ids >= 0) & (ids < E)
    ids = torch.where(valid, ids, 0)
    w = torch.where(valid, torch.gather(scores, 1, ids), 0.0)  # [T, topk]
    g = d_topk_weights[:, :topk].to(cdt)
    if apply_routed_scaling_factor_on_output:
        g = g * torch.tensor(routed_scaling_factor, dtype=torch.float32)
    if renormalize:
        denom = w.sum(dim=-1, keepdim=True)
        if sigmoid:
            denom = denom + 1e-20
        g = (g - (g * w).sum(dim=-1, keepdim=True) / denom) / denom
    d_scores = torch.zeros((T, E), dtype=cdt, device=logits.device).scatter_add_(1, ids, torch.where(valid, g, 0.0))
    if sigmoid:
        # Exactly 0 off the chosen experts: an unchosen NaN logit has s = NaN, and NaN * 0 is NaN.
        chosen = torch.zeros((T, E), dtype=torch.int32, device=logits.device).scatter_add_(1, ids, valid.int()) > 0
        return torch.where(chosen, d_scores * scores * (1.0 - scores), 0.0)
    return scores * (d_scores - (scores * d_scores).sum(dim=-1, keepdim=True))
