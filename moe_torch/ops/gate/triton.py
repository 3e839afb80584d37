"""Triton kernel for ``select_experts`` (CONTRACT.md section 1): the whole gate in ONE launch.

Grid ``(cdiv(T, BLOCK_T),)``; program ``b`` owns tokens ``[b*BLOCK_T, +BLOCK_T)`` and holds their
``[BLOCK_T, BLOCK_E]`` logits in registers (``BLOCK_E`` = power of 2 >= E, padding columns inert)::

    x = float32(logits)                                  (bf16 / fp16 upcast exactly)
    softmax modes: s = exp(x - max x) / sum  (IEEE div)  sel = s
    biased mode:   s = 1 / (1 + exp(-x))  (IEEE div)     sel = s + float32(bias)
    sigmoid_topk:  s = 1 / (1 + exp(-x))  (IEEE div)     sel = x  (Llama 4: the logit ranks)
    grouped modes (G constexpr groups of PER contiguous experts, unrolled over g):
        clean = sel with NaN -> -inf
        group score = max(clean in g)  (grouped_topk)  or  top1 + top2 of clean in g  (biased)
        keep TOPK_GROUP groups by iterative argmax (lower group wins ties)
        sel = -inf outside kept groups                   (not 0: c may be negative)
    sel NaN -> -inf; TOPK iterations of: m = max(alive sel); idx = min index with sel == m among
        alive; alive[idx] = False; w = s[idx] (UNBIASED scores)
    renormalize: w / sum(w)  (+1e-20 in the sigmoid modes); rsf on output: w * float32(rsf)
    fused shared experts: slots topk..topk+S-1 = ids E..E+S-1, weight float32(1/rsf) (* rsf)

The iterative argmax with lowest-index tie-break is the reference's stable descending argsort
with NaN ranked level with -inf, so the ids match :func:`select_experts_reference` exactly
(given the same float32 scores); weights agree to float32 rounding (exp / sigmoid ulps).
No atomics, no host synchronisation.

**Backward** (CONTRACT.md section 8), ``_gate_backward_kernel``, grid ``(cdiv(T, BLOCK_T),)``, the
same ``[BLOCK_T, BLOCK_E]`` tile of logits per program; nothing flows through the choice, so every
routing mode is the same code but for softmax vs sigmoid::

    s = softmax(x) or sigmoid(x), recomputed as in the forward      float32
    pass 1 over the routed slots j < TOPK (unrolled): hit_j = (col == topk_ids[t, j])
        w_j = sum(s * hit_j);  g_j = c * d_topk_weights[t, j]  (c = rsf on output, else 1)
        D += w_j;  A += g_j * w_j
    D += 1e-20 (sigmoid modes); pass 2: d_s += hit_j * (renormalize ? (g_j - A / D) / D : g_j)
    softmax: d_x = s * (d_s - sum(s * d_s));  sigmoid: d_x = d_s * s * (1 - s)   -> [T, E] float32

The shared-expert slots (columns ``>= TOPK``) are constants and are not read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_contract.config import GROUPED_ROUTINGS, SIGMOID_ROUTINGS
from moe_torch.ops.gate.config import MAX_EXPERTS, MAX_GROUPS, GateConfig, gate_config
from moe_torch.ops.triton_common import check_triton_device

#: ``routing`` name -> the kernel's ``ROUTING`` constexpr.
ROUTING_CODES = {"softmax_topk": 0, "grouped_topk": 1, "biased_grouped_topk": 2, "sigmoid_topk": 3}


@triton.jit
def _gate_kernel(
    logits_ptr,  # [T, E] float32 / bf16 / fp16, unit column stride
    bias_ptr,  # [E] float32: e_score_correction_bias (ignored unless ROUTING == 2)
    weights_ptr,  # [T, TOPK + S] float32 out: topk_weights
    ids_ptr,  # [T, TOPK + S] int32 out: topk_ids
    T,  # int: tokens
    stride_t,  # int: row stride of logits (elements)
    rsf,  # float32: routed_scaling_factor (used only if APPLY_RSF)
    shared_w,  # float32: float32(1 / rsf), the shared experts' weight before scaling
    E: tl.constexpr,  # experts
    ROUTING: tl.constexpr,  # 0 softmax_topk, 1 grouped_topk, 2 biased_grouped_topk, 3 sigmoid_topk
    G: tl.constexpr,  # num_expert_group (1 for softmax_topk and sigmoid_topk)
    TOPK_GROUP: tl.constexpr,  # groups kept
    TOPK: tl.constexpr,  # routed slots
    S: tl.constexpr,  # fused shared experts
    RENORMALIZE: tl.constexpr,
    APPLY_RSF: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_E: tl.constexpr,  # power of 2 >= E
    BLOCK_G: tl.constexpr,  # power of 2 >= G
    BLOCK_K: tl.constexpr,  # power of 2 >= TOPK
):
    """Grid ``(cdiv(T, BLOCK_T),)``: program ``b`` writes rows ``[b*BLOCK_T, +BLOCK_T)`` of both outputs."""
    pid = tl.program_id(0)
    W: tl.constexpr = TOPK + S
    tok = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # int64: T * stride may pass 2**31
    tmask = tok < T
    col = tl.arange(0, BLOCK_E)
    cmask = col < E
    x = tl.load(logits_ptr + tok[:, None] * stride_t + col[None, :], mask=tmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    x = tl.where(cmask[None, :], x, float("-inf"))  # padding experts; padding tokens stay finite (0)

    if ROUTING == 2:
        scores = tl.math.div_rn(tl.full([BLOCK_T, BLOCK_E], 1.0, tl.float32), 1.0 + tl.exp(-x))
        bias = tl.load(bias_ptr + col, mask=cmask, other=0.0)
        sel = scores + bias[None, :]
    elif ROUTING == 3:  # Llama 4: weights sigmoid(x), ranked by x itself (sigmoid rounds large logits to ties)
        scores = tl.math.div_rn(tl.full([BLOCK_T, BLOCK_E], 1.0, tl.float32), 1.0 + tl.exp(-x))
        sel = x
    else:
        m = tl.max(x, axis=1)
        e = tl.exp(x - m[:, None])  # padding columns: exp(-inf) = 0
        scores = tl.math.div_rn(e, tl.sum(e, axis=1)[:, None])  # IEEE: plain `/` is approximate on the GPU
        sel = scores
    sel = tl.where(sel != sel, float("-inf"), sel)  # NaN ranks level with -inf
    sel = tl.where(cmask[None, :], sel, float("-inf"))

    if ROUTING == 1 or ROUTING == 2:
        PER: tl.constexpr = E // G
        gcol = tl.arange(0, BLOCK_G)
        gscore = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(G):
            in_g = (col >= g * PER) & (col < (g + 1) * PER)
            vals = tl.where(in_g[None, :], sel, float("-inf"))
            m1 = tl.max(vals, axis=1)
            if ROUTING == 1 or PER == 1:
                score = m1
            else:  # sum of the two largest: remove ONE occurrence of the max (by lowest index)
                i1 = tl.min(tl.where(in_g[None, :] & (vals == m1[:, None]), col[None, :], BLOCK_E), axis=1)
                m2 = tl.max(tl.where(col[None, :] == i1[:, None], float("-inf"), vals), axis=1)
                score = m1 + m2
            gscore = tl.where(gcol[None, :] == g, score[:, None], gscore)
        gscore = tl.where(gscore != gscore, float("-inf"), gscore)
        galive = tl.broadcast_to((gcol < G)[None, :], [BLOCK_T, BLOCK_G])
        kept = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
        gid = col // PER
        for _ in tl.static_range(TOPK_GROUP):
            gkey = tl.where(galive, gscore, float("-inf"))
            gm = tl.max(gkey, axis=1)
            gi = tl.min(tl.where(galive & (gkey == gm[:, None]), gcol[None, :], BLOCK_G), axis=1)
            galive = galive & (gcol[None, :] != gi[:, None])
            kept = kept | (gid[None, :] == gi[:, None])
        sel = tl.where(kept, sel, float("-inf"))

    alive = tl.broadcast_to(cmask[None, :], [BLOCK_T, BLOCK_E])
    kcol = tl.arange(0, BLOCK_K)
    out_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    out_i = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in range(TOPK):
        key = tl.where(alive, sel, float("-inf"))
        mj = tl.max(key, axis=1)
        idx = tl.min(tl.where(alive & (key == mj[:, None]), col[None, :], BLOCK_E), axis=1)
        hit = col[None, :] == idx[:, None]
        alive = alive & ~hit
        wj = tl.sum(tl.where(hit, scores, 0.0), axis=1)  # the unbiased score (NaN stays NaN)
        out_w = tl.where(kcol[None, :] == j, wj[:, None], out_w)
        out_i = tl.where(kcol[None, :] == j, idx[:, None], out_i)

    if RENORMALIZE:
        denom = tl.sum(out_w, axis=1)  # padding slots are 0
        if ROUTING == 2 or ROUTING == 3:  # sigmoid weights may all underflow to 0
            denom = denom + 1e-20
        out_w = tl.math.div_rn(out_w, denom[:, None])
    if APPLY_RSF:
        out_w = out_w * rsf
    row = tok[:, None] * W
    kmask = tmask[:, None] & (kcol < TOPK)[None, :]
    tl.store(weights_ptr + row + kcol[None, :], out_w, mask=kmask)
    tl.store(ids_ptr + row + kcol[None, :], out_i, mask=kmask)
    if S > 0:
        sw = shared_w
        if APPLY_RSF:
            sw = sw * rsf
        for s in tl.static_range(S):
            tl.store(weights_ptr + tok * W + TOPK + s, tl.full([BLOCK_T], 0.0, tl.float32) + sw, mask=tmask)
            tl.store(ids_ptr + tok * W + TOPK + s, tl.full([BLOCK_T], E + s, tl.int32), mask=tmask)


def select_experts_triton(
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
    config: GateConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` (``T >= 1``) -> ``(topk_weights [T, topk+S] float32, topk_ids
    [T, topk+S] int32)``, the ids equal to :func:`select_experts_reference`'s and the weights
    within float32 rounding; arguments already validated by
    :func:`moe_torch.ops.gate.api.select_experts`. One launch, no host synchronisation.

    Raises: NotImplementedError (no CUDA and no interpreter; ``E > 512``; more than 16 groups),
      ValueError (a given ``config`` that does not cover ``E`` / ``topk``).
    """
    op = "select_experts"
    check_triton_device(op, router_logits.device, _gate_kernel)
    T, E = router_logits.shape
    if E > MAX_EXPERTS:
        raise NotImplementedError(f"{op}: the Triton gate holds at most {MAX_EXPERTS} experts per row in registers; got E={E}")
    G = num_expert_group if routing in GROUPED_ROUTINGS else 1
    if G > MAX_GROUPS:
        raise NotImplementedError(f"{op}: the Triton gate handles at most {MAX_GROUPS} expert groups; got {G}")
    S = num_fused_shared_experts
    if T * (topk + S) >= 2**31:
        raise NotImplementedError(f"{op}: T*(topk+S) = {T * (topk + S)} does not fit int32 indexing")
    cfg = config or gate_config(T, E, topk)
    pow2 = all(v & (v - 1) == 0 for v in (cfg.block_t, cfg.block_e, cfg.block_k))
    if not pow2 or cfg.block_e < E or cfg.block_k < topk:
        raise ValueError(f"{op}: config must have power-of-2 blocks, block_e >= E (={E}) and block_k >= topk "
                         f"(={topk}); got {cfg}")
    device = router_logits.device
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    if routing == "biased_grouped_topk":
        bias = e_score_correction_bias.to(device=device, dtype=torch.float32).contiguous()
    else:
        bias = torch.zeros((1,), dtype=torch.float32, device=device)  # never read
    weights = torch.empty((T, topk + S), dtype=torch.float32, device=device)
    ids = torch.empty((T, topk + S), dtype=torch.int32, device=device)
    rsf = float(routed_scaling_factor)
    grid = (triton.cdiv(T, cfg.block_t),)
    _gate_kernel[grid](
        logits, bias, weights, ids, T, logits.stride(0), rsf, 1.0 / rsf,
        E=E, ROUTING=ROUTING_CODES[routing], G=G, TOPK_GROUP=topk_group or 1,
        TOPK=topk, S=S, RENORMALIZE=bool(renormalize), APPLY_RSF=bool(apply_routed_scaling_factor_on_output),
        BLOCK_T=cfg.block_t, BLOCK_E=cfg.block_e, BLOCK_G=triton.next_power_of_2(G), BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=1,
    )
    return weights, ids


# --------------------------------------------------------------------------------------
# backward


@triton.jit
def _gate_backward_kernel(
    logits_ptr,  # [T, E] float32 / bf16 / fp16, unit column stride
    ids_ptr,  # [T, TOPK + S] int32 / int64: topk_ids (only the routed columns < TOPK are read)
    d_w_ptr,  # [T, TOPK + S] float32: gradient of topk_weights (routed columns only are read)
    d_logits_ptr,  # [T, E] float32 out: gradient of router_logits
    T,  # int: tokens
    stride_t,  # int: row stride of logits (elements)
    stride_ids,  # int: row stride of topk_ids
    stride_dw,  # int: row stride of d_topk_weights
    stride_dl,  # int: row stride of d_logits
    rsf,  # float32: routed_scaling_factor (used only if APPLY_RSF)
    E: tl.constexpr,  # experts
    SIGMOID: tl.constexpr,  # bool: biased_grouped_topk / sigmoid_topk (sigmoid scores, +1e-20 in the renormalization)
    TOPK: tl.constexpr,  # routed slots
    RENORMALIZE: tl.constexpr,
    APPLY_RSF: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_E: tl.constexpr,  # power of 2 >= E
):
    """Grid ``(cdiv(T, BLOCK_T),)``: program ``b`` writes rows ``[b*BLOCK_T, +BLOCK_T)`` of ``d_logits``."""
    pid = tl.program_id(0)
    tok = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # int64: T * stride may pass 2**31
    tmask = tok < T
    col = tl.arange(0, BLOCK_E)
    cmask = col < E
    x = tl.load(logits_ptr + tok[:, None] * stride_t + col[None, :], mask=tmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    x = tl.where(cmask[None, :], x, float("-inf"))  # padding experts: s = 0 in both modes
    if SIGMOID:
        s = tl.math.div_rn(tl.full([BLOCK_T, BLOCK_E], 1.0, tl.float32), 1.0 + tl.exp(-x))
    else:
        m = tl.max(x, axis=1)
        e = tl.exp(x - m[:, None])
        s = tl.math.div_rn(e, tl.sum(e, axis=1)[:, None])

    denom = tl.zeros([BLOCK_T], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    if RENORMALIZE:
        for j in tl.static_range(TOPK):
            idj = tl.load(ids_ptr + tok * stride_ids + j, mask=tmask, other=-1)
            hit = col[None, :] == idj[:, None]  # no column for an id outside [0, E)
            wj = tl.sum(tl.where(hit, s, 0.0), axis=1)
            gj = tl.load(d_w_ptr + tok * stride_dw + j, mask=tmask, other=0.0)
            if APPLY_RSF:
                gj = gj * rsf
            denom += wj
            acc += gj * wj
        if SIGMOID:
            denom = denom + 1e-20
        inner = tl.math.div_rn(acc, tl.where(tmask, denom, 1.0))  # padding tokens: no 0/0
        inv = tl.math.div_rn(tl.full([BLOCK_T], 1.0, tl.float32), tl.where(tmask, denom, 1.0))
    d_s = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    n_hit = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)  # slots choosing each expert (sigmoid: the 0 mask)
    for j in tl.static_range(TOPK):
        idj = tl.load(ids_ptr + tok * stride_ids + j, mask=tmask, other=-1)
        gj = tl.load(d_w_ptr + tok * stride_dw + j, mask=tmask, other=0.0)
        if APPLY_RSF:
            gj = gj * rsf
        if RENORMALIZE:
            gj = (gj - inner) * inv
        hit = col[None, :] == idj[:, None]
        d_s += tl.where(hit, gj[:, None], 0.0)
        n_hit += hit.to(tl.int32)
    if SIGMOID:
        # Exactly 0 off the chosen experts: an unchosen NaN logit has s = NaN, and NaN * 0 is NaN.
        d_x = tl.where(n_hit > 0, d_s * s * (1.0 - s), 0.0)
    else:
        d_x = s * (d_s - tl.sum(s * d_s, axis=1)[:, None])
    tl.store(d_logits_ptr + tok[:, None] * stride_dl + col[None, :], d_x, mask=tmask[:, None] & cmask[None, :])


def select_experts_backward_triton(
    router_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    d_topk_weights: torch.Tensor,
    *,
    topk: int,
    routing: str,
    renormalize: bool,
    routed_scaling_factor: float,
    apply_routed_scaling_factor_on_output: bool,
    config: GateConfig | None = None,
    **_choice_only,
) -> torch.Tensor:
    """``d_router_logits [T, E]`` float32 (``T >= 1``) with one Triton launch; arguments as
    :func:`moe_torch.ops.gate.api.select_experts_backward` (already validated there; the grouping
    arguments only shaped the choice and do not enter). Every routing mode is served.

    Raises: NotImplementedError (no CUDA and no interpreter; ``E > 512``), ValueError (a given
      ``config`` that does not cover ``E``).
    """
    op = "select_experts_backward"
    check_triton_device(op, router_logits.device, _gate_backward_kernel)
    T, E = router_logits.shape
    if E > MAX_EXPERTS:
        raise NotImplementedError(
            f"{op}: the Triton gate holds at most {MAX_EXPERTS} experts per row in registers; got E={E}")
    # The forward's tile rule: the backward keeps as many [block_t, block_e] tiles live (s, d_s, a hit mask).
    cfg = config or gate_config(T, E, topk)
    pow2 = all(v & (v - 1) == 0 for v in (cfg.block_t, cfg.block_e))
    if not pow2 or cfg.block_e < E:
        raise ValueError(f"{op}: config must have power-of-2 blocks and block_e >= E (={E}); got {cfg}")
    device = router_logits.device
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    ids = topk_ids if topk_ids.stride(1) == 1 else topk_ids.contiguous()
    d_w = d_topk_weights if d_topk_weights.stride(1) == 1 else d_topk_weights.contiguous()
    d_logits = torch.empty((T, E), dtype=torch.float32, device=device)
    _gate_backward_kernel[(triton.cdiv(T, cfg.block_t),)](
        logits, ids, d_w, d_logits, T, logits.stride(0), ids.stride(0), d_w.stride(0), d_logits.stride(0),
        float(routed_scaling_factor),
        E=E, SIGMOID=routing in SIGMOID_ROUTINGS, TOPK=topk, RENORMALIZE=bool(renormalize),
        APPLY_RSF=bool(apply_routed_scaling_factor_on_output), BLOCK_T=cfg.block_t, BLOCK_E=cfg.block_e,
        num_warps=cfg.num_warps, num_stages=1,
    )
    return d_logits
