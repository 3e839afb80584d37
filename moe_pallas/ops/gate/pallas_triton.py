"""The gate (router) as one Pallas kernel with the Triton lowering (CONTRACT.md section 1).

Grid ``(cdiv(T, block_t),)``: program ``i`` owns tokens ``[i*block_t, (i+1)*block_t)``. It loads
their logits as a ``[block_t, E_pad]`` tile (``E_pad = next_power_of_2(E)``), upcasts to float32
and computes, all in registers:

1. scores ``s``: softmax over the real experts (``softmax_topk``, ``grouped_topk``) or sigmoid
   (``biased_grouped_topk``, ``sigmoid_topk``); selection scores ``c = s``, ``c = s + bias`` (float32
   bias) or, ``sigmoid_topk`` (Llama 4), the logit itself ``c = x``.
   NaN selection scores are mapped to -inf (they rank level with -inf, CONTRACT.md).
2. grouped modes: per group ``g`` (a loop over ``num_expert_group``) the group score, max of
   ``c`` (``grouped_topk``) or the sum of its two largest (``biased_grouped_topk``: the largest,
   then the largest of the group without the first index holding it); then ``topk_group``
   rounds of argmax over the groups keep groups; experts of other groups get ``c = -inf``.
3. top-k: ``topk`` rounds (a ``fori_loop``) of iterative argmax over the not-yet-taken experts:
   ``m = max(c)``, the expert is the lowest index with ``c == m`` (ties to the lower index),
   then it is marked in a separate boolean ``taken`` mask. With ``-inf`` as a value and
   ``taken`` as the exclusion, experts at -inf (dropped groups, NaN) stay pickable in index
   order once nothing finite is left: the same ids as the reference's stable descending sort.
   No ``lax.top_k`` / sort: they do not lower for the GPU.
4. weights gathered from the unbiased ``s``; renormalize (``+1e-20`` in the sigmoid modes); the
   ``S`` fused shared-expert slots ``E..E+S-1`` with weight ``1/rsf``; ``* rsf`` when the gate
   applies it.

The ``[block_t, W_pad]`` results (``W = topk + S``) accumulate in registers and are stored once,
masked to the real tokens and slots.

On the GPU the Triton lowering computes ``sigmoid`` as ``1 / (1 + exp(-x))`` and divides
approximately, so scores may differ from XLA's by an ulp or two: ids can then differ from the
reference only for selection scores that are within that of a tie.

**Backward** (CONTRACT.md section 8), ``select_experts_backward_pallas_triton``, the same grid and
``[block_t, E_pad]`` tile of logits per program; nothing flows through the choice, so every routing
mode is one code path but for softmax vs sigmoid: ``s`` is recomputed as above; over the routed slots
(unrolled) ``w_j = s[id_j]``, ``g_j = c * d_topk_weights[t, j]`` (``c = rsf`` on output), ``D = sum w_j``
(``+ 1e-20`` sigmoid), ``A = sum g_j w_j``; then ``d_s[id_j] += (g_j - A / D) / D`` (renormalized; else
``g_j``), and ``d_x = s * (d_s - sum(s * d_s))`` (softmax) or ``d_s * s * (1 - s)`` (sigmoid), float32.

Mirror: ``moe_torch/ops/gate/triton.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_contract.config import GROUPED_ROUTINGS, SIGMOID_ROUTINGS
from moe_pallas.ops.gate.config import MAX_TILE_ELEMENTS, GateConfig, gate_config

NEG_INF = float("-inf")


def _first_max(key: jax.Array, free: jax.Array, idx: jax.Array, n_pad: int) -> jax.Array:
    """Per row, the lowest index ``idx`` among the ``free`` lanes holding the row's max of ``key``.

    ``key [rows, n] f32`` (no NaN), ``free [rows, n] bool`` (at least one per row), ``idx [1, n]
    int32``. Returns ``[rows] int32``.
    """
    m = jnp.max(jnp.where(free, key, NEG_INF), axis=1)
    cand = free & (key == m[:, None])
    return jnp.min(jnp.where(cand, idx, n_pad), axis=1)


def _gate_kernel(logits_ref, bias_ref, w_ref, ids_ref, *, T: int, E: int, topk: int, routing: str,
                 renormalize: bool, num_expert_group: int, topk_group: int, rsf: float, rsf_on_output: bool,
                 S: int, block_t: int, e_pad: int, w_pad: int, g_pad: int):
    """Grid ``(cdiv(T, block_t),)``. Refs (whole arrays): ``logits_ref [T, E]`` float32 / bf16 /
    float16 and ``bias_ref [E]`` float32 (zeros outside the biased mode) in; ``w_ref [T, topk+S]``
    float32 and ``ids_ref [T, topk+S]`` int32 out."""
    t0 = pl.program_id(0) * block_t
    row_ok = t0 + jnp.arange(block_t) < T
    col = jnp.arange(e_pad, dtype=jnp.int32)[None, :]  # [1, e_pad]
    col_ok = col < E
    x = plgpu.load(logits_ref.at[pl.ds(t0, block_t), pl.ds(jnp.int32(0), e_pad)],
                   mask=row_ok[:, None] & col_ok, other=0.0).astype(jnp.float32)
    x = jnp.where(col_ok, x, NEG_INF)  # [block_t, e_pad]
    if routing == "biased_grouped_topk":
        bias = plgpu.load(bias_ref.at[pl.ds(jnp.int32(0), e_pad)], mask=col_ok[0], other=0.0)
        s = jax.nn.sigmoid(x)
        c = s + bias[None, :]
    elif routing == "sigmoid_topk":  # Llama 4: weights sigmoid(x), ranked by x itself (sigmoid ties where it saturates)
        s = jax.nn.sigmoid(x)
        c = x
    else:  # softmax as jax.nn.softmax: exp(x - max) / sum; a NaN logit makes the whole row NaN
        has_nan = jnp.max(jnp.isnan(x).astype(jnp.int32), axis=1) > 0
        m = jnp.max(jnp.where(jnp.isnan(x), NEG_INF, x), axis=1)
        m = jnp.where(has_nan, jnp.float32(jnp.nan), m)  # explicit: the GPU's max may drop NaN
        e = jnp.where(col_ok, jnp.exp(x - m[:, None]), 0.0)
        s = e / jnp.sum(e, axis=1)[:, None]
        c = s
    c = jnp.where(jnp.isnan(c) | ~col_ok, NEG_INF, c) + 0.0  # NaN ranks level with -inf; -0.0 -> +0.0

    if routing in GROUPED_ROUTINGS:
        per = E // num_expert_group
        gid = col // per  # [1, e_pad]; padding lanes fall past the last group
        gcol = jnp.arange(g_pad, dtype=jnp.int32)[None, :]

        def group_score(g, acc):
            in_g = jnp.broadcast_to(gid == g, c.shape)
            if routing == "grouped_topk":
                score = jnp.max(jnp.where(in_g, c, NEG_INF), axis=1)
            else:  # the sum of the two largest c of the group (per >= 2)
                first = _first_max(c, in_g, col, e_pad)
                top1 = jnp.max(jnp.where(in_g, c, NEG_INF), axis=1)
                top2 = jnp.max(jnp.where(in_g & (col != first[:, None]), c, NEG_INF), axis=1)
                score = top1 + top2
            return jnp.where(gcol == g, score[:, None], acc)

        gscore = lax.fori_loop(0, num_expert_group, group_score, jnp.full((block_t, g_pad), NEG_INF, jnp.float32))
        gscore = jnp.where(jnp.isnan(gscore), NEG_INF, gscore)

        def keep_group(_, carry):
            gtaken, kept = carry
            g = _first_max(gscore, ~gtaken, gcol, g_pad)
            return gtaken | (gcol == g[:, None]), kept | (gid == g[:, None])

        gtaken0 = jnp.broadcast_to(gcol >= num_expert_group, (block_t, g_pad))
        _, kept = lax.fori_loop(0, topk_group, keep_group, (gtaken0, jnp.zeros((block_t, e_pad), jnp.bool_)))
        c = jnp.where(kept, c, NEG_INF)  # -inf, not 0: a biased score can be negative

    wcol = jnp.arange(w_pad, dtype=jnp.int32)[None, :]

    def pick(j, carry):
        taken, ids, w = carry
        idx = _first_max(c, ~taken, col, e_pad)  # [block_t]
        hit = col == idx[:, None]
        weight = jnp.sum(jnp.where(hit, s, 0.0), axis=1)  # the unbiased score of the expert
        slot = wcol == j
        return taken | hit, jnp.where(slot, idx[:, None], ids), jnp.where(slot, weight[:, None], w)

    taken0 = jnp.broadcast_to(~col_ok, (block_t, e_pad))
    _, ids, w = lax.fori_loop(0, topk, pick, (taken0, jnp.zeros((block_t, w_pad), jnp.int32),
                                              jnp.zeros((block_t, w_pad), jnp.float32)))
    if renormalize:
        denom = jnp.sum(w, axis=1)  # slots >= topk are 0
        if routing in SIGMOID_ROUTINGS:  # sigmoid weights may all underflow to 0
            denom = denom + jnp.float32(1e-20)
        w = w / denom[:, None]
    if S:
        shared = (wcol >= topk) & (wcol < topk + S)
        ids = jnp.where(shared, E + wcol - topk, ids)
        w = jnp.where(shared, jnp.float32(1.0 / rsf), w)
    if rsf_on_output:
        w = w * jnp.float32(rsf)
    out = (pl.ds(t0, block_t), pl.ds(jnp.int32(0), w_pad))
    mask = row_ok[:, None] & (wcol < topk + S)
    plgpu.store(w_ref.at[out], w, mask=mask)
    plgpu.store(ids_ref.at[out], ids, mask=mask)


@functools.partial(jax.jit, static_argnames=(
    "topk", "routing", "renormalize", "num_expert_group", "topk_group", "routed_scaling_factor",
    "apply_routed_scaling_factor_on_output", "num_fused_shared_experts", "config", "interpret"))
def select_experts_pallas_triton(
    router_logits: jax.Array,
    e_score_correction_bias: jax.Array | None = None,
    *,
    topk: int,
    routing: str = "softmax_topk",
    renormalize: bool = True,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    apply_routed_scaling_factor_on_output: bool = False,
    num_fused_shared_experts: int = 0,
    config: GateConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Fused top-k expert selection, one Pallas-Triton kernel.

    Args (validated by ``moe_pallas.ops.gate.api.select_experts``):
      router_logits: ``[T, E]`` float32 / bf16 / float16.
      e_score_correction_bias: ``[E]`` float (upcast to float32), only for ``biased_grouped_topk``.
      topk, routing, renormalize, num_expert_group, topk_group, routed_scaling_factor,
        apply_routed_scaling_factor_on_output, num_fused_shared_experts: as ``select_experts``; static.
      config: launch config (default: :func:`gate_config` of the shapes).
      interpret: run in Pallas interpret mode (default: when ``jax.default_backend() == "cpu"``).

    Grid: ``(cdiv(T, block_t),)``, static.

    Returns: ``(topk_weights [T, topk+S] float32, topk_ids [T, topk+S] int32)``: ids equal to
    ``select_experts_reference``, weights within float32 rounding of it.

    Raises: NotImplementedError (a ``block_t * E_pad`` tile over Triton's element limit).
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    T, E = router_logits.shape
    S = num_fused_shared_experts
    W = topk + S
    if T == 0:
        return jnp.zeros((0, W), jnp.float32), jnp.zeros((0, W), jnp.int32)
    cfg = gate_config(T, E) if config is None else config
    e_pad = pl.next_power_of_2(E)
    if cfg.block_t * e_pad > MAX_TILE_ELEMENTS:
        raise NotImplementedError(
            f"select_experts[pallas_triton]: a tile of block_t * E_pad = {cfg.block_t} * {e_pad} elements is over "
            f"Triton's {MAX_TILE_ELEMENTS}")
    grouped = routing in GROUPED_ROUTINGS
    if e_score_correction_bias is None:
        bias = jnp.zeros((E,), jnp.float32)
    else:
        bias = e_score_correction_bias.astype(jnp.float32)
    kernel = functools.partial(
        _gate_kernel, T=T, E=E, topk=topk, routing=routing, renormalize=renormalize,
        num_expert_group=num_expert_group if grouped else 1, topk_group=topk_group if grouped else 1,
        rsf=float(routed_scaling_factor), rsf_on_output=apply_routed_scaling_factor_on_output, S=S,
        block_t=cfg.block_t, e_pad=e_pad, w_pad=pl.next_power_of_2(W),
        g_pad=pl.next_power_of_2(num_expert_group if grouped else 1))
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((T, W), jnp.float32), jax.ShapeDtypeStruct((T, W), jnp.int32)),
        grid=(pl.cdiv(T, cfg.block_t),),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"select_experts_{routing}",
    )(router_logits, bias)


# --------------------------------------------------------------------------------------
# backward


def _gate_backward_kernel(logits_ref, ids_ref, dw_ref, dl_ref, *, T: int, E: int, topk: int, sigmoid: bool,
                          renormalize: bool, rsf: float, rsf_on_output: bool, block_t: int, e_pad: int):
    """Grid ``(cdiv(T, block_t),)``. Refs (whole arrays): ``logits_ref [T, E]`` float, ``ids_ref [T, topk+S]``
    int32 / int64 and ``dw_ref [T, topk+S]`` float32 in (routed columns ``< topk`` only are read);
    ``dl_ref [T, E]`` float32 out."""
    t0 = pl.program_id(0) * block_t
    row_ok = t0 + jnp.arange(block_t) < T
    toks = pl.ds(t0, block_t)
    col = jnp.arange(e_pad, dtype=jnp.int32)[None, :]  # [1, e_pad]
    col_ok = col < E
    x = plgpu.load(logits_ref.at[toks, pl.ds(jnp.int32(0), e_pad)], mask=row_ok[:, None] & col_ok,
                   other=0.0).astype(jnp.float32)
    x = jnp.where(col_ok, x, NEG_INF)  # padding experts: s = 0 in both modes
    if sigmoid:
        s = jax.nn.sigmoid(x)
    else:
        e = jnp.where(col_ok, jnp.exp(x - jnp.max(x, axis=1)[:, None]), 0.0)
        s = e / jnp.sum(e, axis=1)[:, None]
    hits, gs = [], []
    for j in range(topk):  # slots by index (a traced int32: interpret mode wants no python int next to a slice)
        idj = plgpu.load(ids_ref.at[toks, jnp.int32(j)], mask=row_ok, other=-1)
        g = plgpu.load(dw_ref.at[toks, jnp.int32(j)], mask=row_ok, other=0.0)
        hits.append(col == idj[:, None].astype(jnp.int32))  # no column for an id outside [0, E)
        gs.append(g * jnp.float32(rsf) if rsf_on_output else g)
    if renormalize:
        denom = jnp.zeros((block_t,), jnp.float32)
        acc = jnp.zeros((block_t,), jnp.float32)
        for hit, g in zip(hits, gs):
            w = jnp.sum(jnp.where(hit, s, 0.0), axis=1)
            denom, acc = denom + w, acc + g * w
        if sigmoid:
            denom = denom + jnp.float32(1e-20)
        denom = jnp.where(row_ok, denom, 1.0)  # padding tokens: no 0/0
        inner = acc / denom
        gs = [(g - inner) / denom for g in gs]
    d_s = jnp.zeros((block_t, e_pad), jnp.float32)
    for hit, g in zip(hits, gs):
        d_s = d_s + jnp.where(hit, g[:, None], 0.0)
    if sigmoid:
        # Exactly 0 off the chosen experts: an unchosen NaN logit has s = NaN, and NaN * 0 is NaN.
        chosen = functools.reduce(jnp.logical_or, hits)
        d_x = jnp.where(chosen, d_s * s * (1.0 - s), 0.0)
    else:
        d_x = s * (d_s - jnp.sum(s * d_s, axis=1)[:, None])
    plgpu.store(dl_ref.at[toks, pl.ds(jnp.int32(0), e_pad)], d_x, mask=row_ok[:, None] & col_ok)


@functools.partial(jax.jit, static_argnames=(
    "topk", "routing", "renormalize", "routed_scaling_factor", "apply_routed_scaling_factor_on_output", "config",
    "interpret"))
def select_experts_backward_pallas_triton(
    router_logits: jax.Array,
    topk_ids: jax.Array,
    d_topk_weights: jax.Array,
    *,
    topk: int,
    routing: str = "softmax_topk",
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    apply_routed_scaling_factor_on_output: bool = False,
    config: GateConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``d_router_logits [T, E]`` float32, one Pallas-Triton kernel (every routing mode: the grouping only
    shaped the choice and does not enter the gradient).

    Args (validated by ``moe_pallas.ops.gate.api.select_experts_backward``):
      router_logits: ``[T, E]`` float32 / bf16 / float16.
      topk_ids: ``[T, topk+S]`` int32 / int64, the forward's ids.
      d_topk_weights: ``[T, topk+S]`` float32 (the shared-expert columns ``>= topk`` are not read).
      topk, routing, renormalize, routed_scaling_factor, apply_routed_scaling_factor_on_output: as
        ``select_experts``; static.
      config: launch config (default: :func:`gate_config` of the shapes, the forward's tile rule: the
        backward keeps as many ``[block_t, E_pad]`` tiles live).
      interpret: run in Pallas interpret mode (default: when ``jax.default_backend() == "cpu"``).

    Grid: ``(cdiv(T, block_t),)``, static.

    Raises: NotImplementedError (a ``block_t * E_pad`` tile over Triton's element limit).
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    T, E = router_logits.shape
    if T == 0:
        return jnp.zeros((0, E), jnp.float32)
    cfg = gate_config(T, E) if config is None else config
    e_pad = pl.next_power_of_2(E)
    if cfg.block_t * e_pad > MAX_TILE_ELEMENTS:
        raise NotImplementedError(
            f"select_experts_backward[pallas_triton]: a tile of block_t * E_pad = {cfg.block_t} * {e_pad} elements "
            f"is over Triton's {MAX_TILE_ELEMENTS}")
    kernel = functools.partial(
        _gate_backward_kernel, T=T, E=E, topk=topk, sigmoid=routing in SIGMOID_ROUTINGS,
        renormalize=renormalize, rsf=float(routed_scaling_factor),
        rsf_on_output=apply_routed_scaling_factor_on_output, block_t=cfg.block_t, e_pad=e_pad)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((T, E), jnp.float32),
        grid=(pl.cdiv(T, cfg.block_t),),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"select_experts_backward_{routing}",
    )(router_logits, topk_ids, d_topk_weights)
