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
rule of the lines above (used by the layer's ``custom_vjp``); JAX's autodiff differentiates the same
functions where they run outside one (the EP layer).

Mirror: ``moe_torch/slot_weights.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_contract.config import MoEConfig


def slot_weights(topk_weights: jax.Array, shared_expert_gate_logits: jax.Array | None, config: MoEConfig):
    """``topk_weights [T, k']`` float32 (the gate's) -> ``(combine_weights [T, k'] float32, input_scale
    [T, k'] float32 or None)`` per the module docstring. ``shared_expert_gate_logits [T, S]`` (float32 or
    ``x``'s dtype) when ``config.shared_expert_gate``, else ``None``. Plain jnp (differentiable)."""
    k = config.topk
    w = topk_weights
    if config.shared_expert_gate:
        s = jax.nn.sigmoid(shared_expert_gate_logits.astype(jnp.float32))
        w = jnp.concatenate([w[:, :k], w[:, k:] * s], axis=1)
    if not config.apply_router_weight_on_input:
        return w, None
    routed = (jnp.arange(w.shape[1]) < k)[None, :]
    return jnp.where(routed, jnp.float32(1.0), w), jnp.where(routed, w, jnp.float32(1.0))


def slot_weights_backward(topk_weights, shared_expert_gate_logits, d_combine_weights, d_input_scale, config: MoEConfig):
    """The backward of :func:`slot_weights`: ``(d_topk_weights [T, k'] float32, d_shared_expert_gate_logits
    [T, S] float32 or None)``. ``d_input_scale`` is ``None`` without ``apply_router_weight_on_input``.
    The shared gate: ``d_logit = d_w[t, topk + i] * w_gate[t, topk + i] * s * (1 - s)`` (``w_gate`` the
    gate's shared weight, ``1/rsf`` or 1), and the gate's own shared slots get ``d_w * s`` (which
    ``select_experts_backward`` drops: shared slots carry no gradient into the router logits)."""
    k = config.topk
    d_w = d_combine_weights.astype(jnp.float32)
    if config.apply_router_weight_on_input:
        routed = (jnp.arange(d_w.shape[1]) < k)[None, :]
        d_w = jnp.where(routed, d_input_scale.astype(jnp.float32), d_w)
    d_logits = None
    if config.shared_expert_gate:
        s = jax.nn.sigmoid(shared_expert_gate_logits.astype(jnp.float32))
        d_shared = d_w[:, k:]
        d_logits = d_shared * topk_weights[:, k:] * s * (1.0 - s)
        d_w = jnp.concatenate([d_w[:, :k], d_shared * s], axis=1)
    return d_w, d_logits


def scaled_slot_rows(x: jax.Array, input_scale: jax.Array) -> jax.Array:
    """``x [T, H]``, ``input_scale [T, k]`` float32 -> ``rows [T*k, H]`` in ``x.dtype``: row ``t*k + j`` is
    ``x[t] * input_scale[t, j]`` in float32, rounded once (CONTRACT.md section 2). Differentiable."""
    T, H = x.shape
    k = input_scale.shape[1]
    return (x.astype(jnp.float32)[:, None, :] * input_scale[:, :, None]).astype(x.dtype).reshape(T * k, H)


def scaled_slot_rows_backward(x: jax.Array, input_scale: jax.Array, d_rows: jax.Array):
    """The backward of :func:`scaled_slot_rows` (the rounding passes the gradient): ``d_rows [T*k, H]``
    -> ``(d_x [T, H] float32 = sum_j input_scale[t, j] * d_rows[t*k + j], d_input_scale [T, k] float32 =
    <x[t], d_rows[t*k + j]>)``, accumulated in float32."""
    T, H = x.shape
    k = input_scale.shape[1]
    d = d_rows.astype(jnp.float32).reshape(T, k, H)
    d_x = jnp.sum(input_scale[:, :, None] * d, axis=1)
    d_scale = jnp.sum(x.astype(jnp.float32)[:, None, :] * d, axis=2)
    return d_x, d_scale
