"""Router losses and DeepSeek-V3's auxiliary-loss-free bias update (CONTRACT.md section 10), in jnp:
:func:`router_losses` (the load-balancing loss, the sequence-wise loss, the router z-loss and the per-expert
token counts, from the gate's own logits and ids) and :func:`update_expert_bias`.

Pure jnp, no kernel and no ``custom_vjp``: ``[T, E]`` elementwise work and reductions, differentiable by
``jax.grad`` (also twice), under ``jit`` and ``shard_map``.

Mirror: ``moe_torch/ops/gate/losses.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_contract.config import SIGMOID_ROUTINGS, MoEConfig
from moe_contract.op_checks import check_router_losses, check_update_expert_bias
from moe_pallas.ops.common import takes_jax_arrays


class RouterLosses(NamedTuple):
    """What :func:`router_losses` returns (CONTRACT.md section 10), each loss unscaled (the caller applies its
    coefficient); a pytree (``jit`` returns it, ``jax.grad`` with ``has_aux`` carries it).

    aux_loss: ``[]`` float32, the load-balancing loss ``E * sum_e f_e * P_e`` over the layer call's ``T`` tokens.
    seq_aux_loss: ``[]`` float32, the same per sequence of ``seq_len`` tokens, averaged; ``None`` without ``seq_len``.
    z_loss: ``[]`` float32, ``mean_t logsumexp(logits[t])^2``.
    tokens_per_expert: ``[E]`` int32, the routed slots on each expert (no gradient).
    """

    aux_loss: jax.Array
    seq_aux_loss: jax.Array | None
    z_loss: jax.Array
    tokens_per_expert: jax.Array


def router_probabilities(router_logits: jax.Array, routing: str) -> jax.Array:
    """The router's unbiased probabilities ``p [T, E]`` float32 the losses read (CONTRACT.md section 10):
    ``softmax(logits)`` for the softmax routings, ``s / sum_e s`` with ``s = sigmoid(logits)`` for the sigmoid
    ones (``e_score_correction_bias`` never enters)."""
    logits = router_logits.astype(jnp.float32)
    if routing in SIGMOID_ROUTINGS:
        s = jax.nn.sigmoid(logits)
        return s / s.sum(axis=-1, keepdims=True)
    return jax.nn.softmax(logits, axis=-1)


@takes_jax_arrays
def router_losses(
    router_logits: jax.Array,
    topk_ids: jax.Array,
    config: MoEConfig,
    *,
    seq_len: int | None = None,
) -> RouterLosses:
    """The router's training losses of one layer call (CONTRACT.md section 10), float32, from its logits and
    the gate's chosen ids.

    ``p [T, E]``: :func:`router_probabilities` (softmax for ``softmax_topk`` / ``grouped_topk``; sigmoid normalized
    per token for ``biased_grouped_topk`` / ``sigmoid_topk``); ``f_e = count_e / (T * topk)`` with ``count_e`` the
    routed slots on expert ``e``; ``P_e = mean_t p[t, e]``.

    - ``aux_loss = E * sum_e f_e * P_e`` (1 under perfectly uniform routing). Megatron-Core's ``aux_loss``;
      transformers' ``load_balancing_loss_func`` (Mixtral, Qwen3-MoE) returns ``topk`` times this value (its
      ``f_e`` is divided by ``T``, not ``T * topk``) and concatenates every layer's tokens.
    - ``seq_aux_loss``: the same per sequence (``f``, ``P`` over its tokens), averaged over the ``T / seq_len``
      sequences; sequence ``i`` is tokens ``[i * seq_len, (i + 1) * seq_len)`` (``[B, S, H]`` hidden states
      flattened to ``[B * S, H]``: ``seq_len = S``).
    - ``z_loss = (1 / T) sum_t logsumexp_e(logits[t, e])^2``.
    - ``tokens_per_expert[e] = count_e``.

    Gradients (``jax.grad``, in ``router_logits.dtype``): through ``P`` (``f`` is a count of the integer ids) and,
    for ``z_loss``, through ``logsumexp``. ``T = 0`` gives losses 0 (and zero counts).

    Expert parallelism: the losses read only the logits and ids they are given. :func:`moe_pallas.moe_forward`
    (any ``config.ep_rank``) holds all ``T`` tokens' logits, and :func:`moe_pallas.ep_moe_forward` takes the global
    ``[T, E]`` logits in both modes (``all_to_all`` shards them inside its ``shard_map``), so the losses computed
    on them are the global ones, the same on every device (``ep_moe_forward(return_router_losses=True)`` does
    this). Inside a ``shard_map`` over tokens of one's own, the global losses are
    :func:`router_losses_from_sums` of the ``jax.lax.psum`` over the devices of the :class:`RouterLossSums`
    (``tokens_per_expert``, ``sum_t p[t]`` ``[E]``, ``sum_t logsumexp^2``) and of ``T``.

    Args:
      router_logits: ``[T, E]`` float32 / bf16 / float16 (``E = config.num_experts``), the gate's input.
      topk_ids: ``[T, topk]`` or ``[T, topk + S]`` int32 / int64, the gate's ids (``select_experts``; only the
        ``topk`` routed columns are read, the fused shared slots never enter). An id outside ``[0, E)`` (never
        made by the gate) counts nowhere (values are not checked: under ``jit`` they are not known).
      config: the layer (:class:`moe_contract.MoEConfig`): ``num_experts``, ``topk``, ``routing``.
      seq_len: ``None`` (no ``seq_aux_loss``) or the tokens of one sequence, dividing ``T`` (static).

    Returns: :class:`RouterLosses` ``(aux_loss [], seq_aux_loss [] or None, z_loss [], tokens_per_expert [E] int32)``,
    the losses float32 and unscaled.

    Raises: ValueError (shapes; ``seq_len`` not an int >= 1 or not dividing ``T``), TypeError (dtypes; ``config``
      not a :class:`moe_contract.MoEConfig`), before anything is traced.

    Sources: Switch Transformer (Fedus et al. 2021, eq. 4-6) and GShard (Lepikhin et al. 2020) for ``aux_loss``;
    DeepSeek-V3 technical report (arXiv:2412.19437, 2024) section 2.1.2, "Complementary Sequence-Wise Auxiliary
    Loss", for ``seq_aux_loss`` and the normalized sigmoid scores; ST-MoE (Zoph et al. 2022) for ``z_loss``;
    Megatron-Core ``moe_utils.py`` (``switch_load_balancing_loss_func``, ``sequence_load_balancing_loss_func``,
    ``z_loss_func``).
    """
    op = "router_losses"
    check_router_losses(op, router_logits, topk_ids, config, seq_len)
    sums = router_loss_sums(router_logits, topk_ids, config, seq_len=seq_len)
    return router_losses_from_sums(sums, router_logits.shape[0], config, seq_len=seq_len)


class RouterLossSums(NamedTuple):
    """Sums over a set of tokens from which :func:`router_losses_from_sums` finishes the losses; each is additive
    over disjoint token sets (the devices' tokens), so their ``jax.lax.psum`` gives the global losses.

    tokens_per_expert: ``[E]`` int32, ``count_e``.
    prob_sum: ``[E]`` float32, ``sum_t p[t, e]``.
    z_sum: ``[]`` float32, ``sum_t logsumexp(logits[t])^2``.
    seq_aux_sum: ``[]`` float32, the sum over the set's sequences of their sequence-wise loss; ``None`` without
      ``seq_len``.
    """

    tokens_per_expert: jax.Array
    prob_sum: jax.Array
    z_sum: jax.Array
    seq_aux_sum: jax.Array | None


def router_loss_sums(router_logits: jax.Array, topk_ids: jax.Array, config: MoEConfig, *,
                     seq_len: int | None = None) -> RouterLossSums:
    """:class:`RouterLossSums` of ``router_logits [T, E]`` and ``topk_ids [T, >= topk]`` (as :func:`router_losses`
    takes them, not checked again here: the caller validated them)."""
    T, E = router_logits.shape
    k = config.topk
    p = router_probabilities(router_logits, config.routing)
    ids = jax.lax.stop_gradient(topk_ids[:, :k]).astype(jnp.int32)
    valid = (ids >= 0) & (ids < E)
    ids = jnp.where(valid, ids, 0)
    counts = jnp.zeros(E, jnp.int32).at[ids.reshape(-1)].add(valid.astype(jnp.int32).reshape(-1))
    z_sum = jnp.square(jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1)).sum()
    seq_sum = None
    if seq_len is not None:
        n = T // seq_len
        seq = jnp.arange(T, dtype=jnp.int32)[:, None] // seq_len  # [T, 1] the sequence of each token
        flat = (seq * E + ids).reshape(-1)
        seq_counts = jnp.zeros(n * E, jnp.float32).at[flat].add(valid.astype(jnp.float32).reshape(-1)).reshape(n, E)
        seq_f = seq_counts / (seq_len * k)
        seq_P = p.reshape(n, seq_len, E).mean(axis=1)
        seq_sum = E * (seq_f * seq_P).sum()
    return RouterLossSums(counts, p.sum(axis=0), z_sum, seq_sum)


def router_losses_from_sums(sums: RouterLossSums, num_tokens: int | jax.Array, config: MoEConfig, *,
                            seq_len: int | None = None) -> RouterLosses:
    """The losses of :func:`router_losses` from the :class:`RouterLossSums` of ``num_tokens`` tokens (a Python int,
    or an array: a count summed over devices). Divisors are at least 1: an empty token set (``T = 0``) has zero
    sums, so its losses are 0, not NaN."""
    E, k = config.num_experts, config.topk
    if isinstance(num_tokens, int):
        T, Tk = max(num_tokens, 1), max(num_tokens * k, 1)
        n = None if seq_len is None else max(num_tokens // seq_len, 1)
    else:
        num = jnp.asarray(num_tokens).astype(jnp.float32)
        T, Tk = jnp.maximum(num, 1.0), jnp.maximum(num * k, 1.0)
        n = None if seq_len is None else jnp.maximum(num / seq_len, 1.0)
    f = sums.tokens_per_expert.astype(jnp.float32) / Tk
    P = sums.prob_sum / T
    aux = E * (f * P).sum()
    z = sums.z_sum / T
    seq_aux = None if seq_len is None else sums.seq_aux_sum / n
    return RouterLosses(aux, seq_aux, z, sums.tokens_per_expert)


@takes_jax_arrays
def update_expert_bias(
    bias: jax.Array,
    tokens_per_expert: jax.Array,
    update_rate: float = 1e-3,
) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balancing step (CONTRACT.md section 10): a new
    ``bias_e + u * sign(mean(load) - load_e)``, ``sign(0) = 0`` (a load equal to the mean leaves its bias).

    ``load = tokens_per_expert`` (``[E]``), or its sum over the first axis (``[N, E]``: the counts of the step's
    ``N`` layer calls, e.g. micro-batches, stacked). The sign is taken of ``sum_e load_e - E * load_e`` (the same
    sign, without a division), in float32: exact, ties included, while ``E`` times the total load is below
    ``2^24``; beyond it, a load within float32 rounding of the mean may count as a tie.

    Args:
      bias: ``[E]`` float32, the layer's ``e_score_correction_bias`` (float32 only: a 1e-3 step is below
        bf16's resolution at 1).
      tokens_per_expert: ``[E]`` or ``[N, E]`` int32 / int64 / float32 (:class:`RouterLosses`'
        ``tokens_per_expert``, or a sum of them).
      update_rate: ``u``, a finite real >= 0 (a Python or numpy scalar: static; DeepSeek-V3: 1e-3 for most of
        pre-training, then 0).

    Returns: the updated bias ``[E]`` float32 (a new array, no gradient flows through it: ``stop_gradient``).
    With :class:`moe_pallas.MoELayer`: ``layer.e_score_correction_bias[...] = update_expert_bias(...)``.

    Raises: ValueError (shapes, ``update_rate``), TypeError (dtypes), before anything is traced.

    Source: DeepSeek-V3 technical report (arXiv:2412.19437, 2024) section 2.1.2, "Auxiliary-Loss-Free Load
    Balancing"; Megatron-Core ``moe_utils.py`` (``get_updated_expert_bias``).
    """
    op = "update_expert_bias"
    check_update_expert_bias(op, bias, tokens_per_expert, update_rate)
    load = jax.lax.stop_gradient(tokens_per_expert).astype(jnp.float32)
    if load.ndim == 2:
        load = load.sum(axis=0)
    E = load.shape[0]
    step = jnp.sign(load.sum() - E * load)  # the sign of mean(load) - load, times E > 0
    return jax.lax.stop_gradient(bias) + step * jnp.float32(update_rate)
