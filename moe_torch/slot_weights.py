"""Where each slot's weight goes, for the 2026 MoE families (CONTRACT.md sections 1, 2, 5 and 8).

The gate gives ``topk_weights [T, k']`` (``k' = topk + S``: routed slots, then the ``S`` fused shared
slots). Two config fields move or change those weights before the experts and the combine::

    shared_expert_gate (Qwen3-Next):   w[t, topk + i] *= sigmoid(shared_expert_gate_logits[t, i])   (float32)
    apply_router_weight_on_input (Llama 4):
        input_scale[t, j]     = w[t, j] for a routed slot (j < topk), 1 for a shared slot
        combine_weights[t, j] = 1 for a routed slot,                 w[t, j] for a shared slot
    otherwise: combine_weights = w, no input scale

The expert input of slot ``(t, j)`` is then ``x[t] * input_scale[t, j]`` (float32, rounded once to
``x.dtype``: :func:`scaled_slot_rows`), and the combine sums ``combine_weights[t, j] * y`` (times the
combine's ``rsf``). Not fused: the scaled rows ``[T*k', H]`` are an elementwise op here, before the
permute kernel (which then gathers them with ``topk=1``), so the layer holds one more ``[T*k', H]``
buffer of ``x.dtype`` (the permute kernel has no per-row scale).

Backward (section 8): :func:`slot_weights_backward` and :func:`scaled_slot_rows_backward`, the chain
rule of the lines above, which the layer's backward and the EP all_to_all layer's call (:mod:`moe_torch.ep`).

Mirror: ``moe_pallas/slot_weights.py``.
"""

from __future__ import annotations

import torch

from moe_contract.config import MoEConfig


def slot_weights(topk_weights: torch.Tensor, shared_expert_gate_logits: torch.Tensor | None, config: MoEConfig):
    """``topk_weights [T, k']`` float32 (the gate's) -> ``(combine_weights [T, k'] float32, input_scale
    [T, k'] float32 or None)`` per the module docstring. ``shared_expert_gate_logits [T, S]`` (float32 or
    ``x``'s dtype) when ``config.shared_expert_gate``, else ``None``. Plain torch ops (autograd-aware)."""
    k = config.topk
    w = topk_weights
    if config.shared_expert_gate:
        s = torch.sigmoid(shared_expert_gate_logits.float())
        w = torch.cat([w[:, :k], w[:, k:] * s], dim=1)
    if not config.apply_router_weight_on_input:
        return w, None
    routed = (torch.arange(w.shape[1], device=w.device) < k)[None, :]
    return torch.where(routed, 1.0, w), torch.where(routed, w, 1.0)


def slot_weights_backward(topk_weights, shared_expert_gate_logits, d_combine_weights, d_input_scale, config: MoEConfig):
    """The backward of :func:`slot_weights`: ``(d_topk_weights [T, k'] float32, d_shared_expert_gate_logits
    [T, S] float32 or None)``. ``d_input_scale`` is ``None`` without ``apply_router_weight_on_input``.
    The shared gate: ``d_logit = d_w[t, topk + i] * w_gate[t, topk + i] * s * (1 - s)`` (``w_gate`` the
    gate's shared weight, ``1/rsf`` or 1), and the gate's own shared slots get ``d_w * s`` (which
    ``select_experts_backward`` drops: shared slots carry no gradient into the router logits)."""
    k = config.topk
    d_w = d_combine_weights.float()
    if config.apply_router_weight_on_input:
        routed = (torch.arange(d_w.shape[1], device=d_w.device) < k)[None, :]
        d_w = torch.where(routed, d_input_scale.float(), d_w)
    d_logits = None
    if config.shared_expert_gate:
        s = torch.sigmoid(shared_expert_gate_logits.float())
        d_shared = d_w[:, k:]
        d_logits = d_shared * topk_weights[:, k:] * s * (1.0 - s)
        d_w = torch.cat([d_w[:, :k], d_shared * s], dim=1)
    return d_w, d_logits


def scaled_slot_rows(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """``x [T, H]``, ``input_scale [T, k]`` float32 -> ``rows [T*k, H]`` in ``x.dtype``: row ``t*k + j`` is
    ``x[t] * input_scale[t, j]`` in float32, rounded once (CONTRACT.md section 2). Autograd-aware."""
    T, H = x.shape
    k = input_scale.shape[1]
    return (x.float()[:, None, :] * input_scale[:, :, None]).to(x.dtype).reshape(T * k, H)


def scaled_slot_rows_backward(x: torch.Tensor, input_scale: torch.Tensor, d_rows: torch.Tensor):
    """The backward of :func:`scaled_slot_rows` (the rounding passes the gradient): ``d_rows [T*k, H]``
    -> ``(d_x [T, H] float32 = sum_j input_scale[t, j] * d_rows[t*k + j], d_input_scale [T, k] float32 =
    <x[t], d_rows[t*k + j]>)``, accumulated in float32."""
    T, H = x.shape
    k = input_scale.shape[1]
    d = d_rows.float().reshape(T, k, H)
    d_x = (input_scale[:, :, None] * d).sum(dim=1)
    d_scale = (x.float()[:, None, :] * d).sum(dim=2)
    return d_x, d_scale
