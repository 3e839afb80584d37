"""The decode path's two Triton kernels: the expert part of the MoE layer for a few tokens (``T`` of 1 to 64) in two
launches after the gate, with no host synchronisation and grids that depend only on the shapes (CUDA-graph
capturable). The staged layer (routing metadata, permute, GEMM 1, activation, GEMM 2, combine: ~7 launches and
three ``[T*k, *]`` round trips through memory) is built for large ``T``; at decode sizes its launches and
metadata cost more than the weight reads that bound the work.

Names: ``x [T, H]``, ``topk_ids`` / ``topk_weights [T, k]`` (``k = topk + S`` slots), assignment (slot) ``s = t*k
+ j``, local expert ``e = topk_ids[t, j] - expert_start`` when it lies in ``[0, E_local)`` (else the slot is
non-local: ``-1``, a dropped slot, another EP rank's expert; it contributes nothing). Weights ``w13 [E_local, 2I,
H]``, ``w2 [E_local, H, I]`` (float of ``x``'s dtype; float8_e4m3fn codes with float32 scales, CONTRACT.md section 3;
or 4-bit packed codes with group scales, section 9), optional biases ``w13_bias [E_local, 2I]``, ``w2_bias
[E_local, H]``. ``apply_router_weight_on_input`` (Llama 4; ``moe_torch/slot_weights.py``): a routed slot (``j <
topk``) has input scale ``in[s] = topk_weights[t, j]`` and combine weight ``cw[s] = 1``; a fused shared slot, and
every slot without the setting, ``in[s] = 1`` (its input is ``x[t]`` itself) and ``cw[s] = topk_weights[t, j]``.

**Kernel A** (``_decode_gate_up_kernel``, GEMM 1 + bias + activation), grid ``(min(T*k, E_local), cdiv(I,
BLOCK_N))``::

    program (i, n): every program reads all T*k ids (CHUNK_S at a time) and derives its own work:
      reached[e] = #{s : e(s) == e} > 0                 (a [BLOCK_E, CHUNK_S] compare-and-sum per chunk of ids)
      rank[e]    = cumsum(reached)[e]                   (inclusive)
      its expert e = the one with reached and rank == i + 1; none (nothing to do) if fewer are reached
      its slots  = the s with e(s) == e, in slot order: pos(s) = #{s' <= s : e(s') == e} - 1 (a cumsum per chunk
                   plus the earlier chunks' matches), and for a row block m = mb*BLOCK_M + [0, BLOCK_M):
                   slot[m] = sum_s s * (e(s) == e and pos(s) == m)   (a [BLOCK_M, CHUNK_S] compare-and-sum per
                   chunk; row blocks looped while mb*BLOCK_M < count(e))
      cols = n*BLOCK_N + [0, BLOCK_N) of I; gate / up rows of w13: cols and I + cols ("concatenated") or
                   2*cols and 2*cols + 1 ("interleaved", gpt-oss)
      xs(k0) = x[slot // k, k0:+BLOCK_K]               (rows of other slots masked to 0); ON_INPUT:
                   cast(float32(xs) * in[slot])         rounded once to x.dtype (slot_weights.py's scaled_slot_rows)
      fp8_per_token: sx[m] = max(max_k |float32(xs)|, 1e-10) * float32(1/448)   the row's amax over all of H, a
                   first pass over x (section 3: the permute's per-token quantization)
      for k0 in 0..H step BLOCK_K:                      (float32 accumulation, tl.dot: BLOCK_M >= 16 rows)
          float / 4-bit: acc_g += xs @ w13[e, gate rows, k0:].T;  acc_u += xs @ w13[e, up rows, k0:].T
                   (4-bit: the codes decoded to x's dtype by grouped_gemm/triton.py's _w4_tiles, low nibbles
                   against x's even columns, high nibbles against its odd ones, as the grouped GEMM does)
          fp8_per_token: xq = cast_e4m3(clamp(div_rn(float32(xs), sx), -448, 448));  acc += xq @ wq.T (FP8 codes)
          fp8_block (BLOCK_K = 128: one 1 x 128 group of x, one 128 x 128 block of w13 a step):
                   sx = max(max over the step |float32(xs)|, 1e-10) * float32(1/448);  xq as above
                   acc += ((xq @ wq.T) * sx[m]) * w13_scale[e, rows // 128, k0 // 128]
      fp8_per_token: acc = (acc * sx[m]) * w13_scale[e] (per expert) or w13_scale[e, rows] (per channel)
      g, u = float32(cast(acc + float32(w13_bias[e, rows])))   h rounded to x.dtype: GEMM 1's output (section 4)
      a[slot, cols] = cast(act(g) * u)                  activation/triton.py's gated_values; x.dtype (section 4);
                   with FP8 weights a stays float32 (act_and_mul quantizes its float32 values: kernel B does)

so every reached expert's ``w13`` is read once (per column block, by one program), whatever the number of its
slots; ``a [T*k, I]`` is in slot order (no permutation buffer, no metadata); non-local slots are never written.

**Kernel B** (``_decode_down_kernel``, GEMM 2 + bias + combine), grid ``(T, cdiv(H, BLOCK_H))``::

    program (t, n): cols = n*BLOCK_H + [0, BLOCK_H) of H;  acc = 0 (float32)
      for j in 0..k-1 (slot order):
          if slot (t, j) is local with expert e:
              y = sum over I chunks of w2[e, cols, i:+BLOCK_I] * a[t*k + j, i:+BLOCK_I]   (float32 accumulation)
                  16-bit a (float or 4-bit weights): a tl.dot of a [16, BLOCK_I] tile whose row 0 is the slot's
                      row (the rest zero) with the weight tile (4-bit decoded as kernel A), y = row 0 of the
                      [16, BLOCK_H] accumulator after the last chunk
                  float32 a, FP8: a float32 multiply and tl.sum per chunk (a GEMV)
                  fp8_per_token: sa = max(max_i |a[s, i]|, 1e-10) * float32(1/448), a first pass over the row
                      (act_and_mul's per-token quantization, section 3); each chunk quantized as it is read:
                      aq = cast_e4m3(clamp(div_rn(a, sa), -448, 448));  y = sum of wq * aq (FP8 codes: exact
                      products in float32), then y = (y * sa) * w2_scale[e] or w2_scale[e, cols]
                  fp8_block (BLOCK_I = 128, one 1 x 128 group a chunk): sa from the chunk's own amax, aq as above,
                      y += (sum of wq * aq) * sa * w2_scale[e, cols // 128, i // 128]
              y = float32(cast(y + float32(w2_bias[e, cols])))   GEMM 2's output, rounded to x.dtype (section 4)
              acc += cw[t*k + j] * y                             the combine's float32 sum (section 5)
      out[t, cols] = cast(acc * rsf)                             rsf = config.combine_routed_scaling_factor

Why token-major for the down projection: each output element is written by exactly one program, which sums its
token's slots in slot order, so the result is bit-identical from run to run (no atomics) and needs no third
launch (an expert-major GEMM 2 would write ``y [T*k, H]`` and need a combine kernel, or float atomics into
``out`` whose order varies). The price: ``w2[e]``'s tile is read once per (token, slot) rather than once per
expert; at decode sizes the tokens sharing an expert are few and the repeats hit L2. A token's GEMV has one row,
below ``tl.dot``'s 16: padded to 16 rows, the tensor cores take the 16-bit operands as loaded (or decoded), where a
float32 GEMV spends a convert, a multiply and a share of a cross-lane sum on every weight (the sm_90 SASS of the I
loop, gpt-oss MXFP4: ~7.9 instructions a weight a lane as a GEMV; the dot's wasted rows cost nothing the weight
stream notices). float32 ``a`` keeps the exact float32 GEMV; FP8 ``a`` too (bf16 products are exact in float32,
FP8 codes' too).
Per-token FP8 ``a`` needs its row's amax over all of ``I``, which no program of kernel A has (each holds
``BLOCK_N`` columns): kernel B reads each slot's whole row anyway, so it reduces the amax first and quantizes as it
goes, each of a token's ``cdiv(H, BLOCK_H)`` programs the same way (the same codes, recomputed: a few divisions per
element of ``a``, small beside the weight reads at decode sizes). ``a`` stays float32 in memory between the kernels.

Rounding points and sums follow the staged layer (``reference.py``), so the two agree within CONTRACT.md section 7:
float32 to float32 reordering (``F32_REL_FRO``), bf16 / fp16 within ``BF16_REL_FRO`` (a float32 reordering can flip
one rounding to ``x.dtype`` by an ulp). FP8: the quantization is the stages' (triton_common's ``fp8_scale`` and
``quantize_fp8_tile``: the same amax, a float32 multiplication by ``1/448``, ``div_rn``, the clamp, the
round-to-nearest-even cast), so the codes and scales of ``x`` are the permute's bit for bit, and those of ``a``
act_and_mul's given the same float32 ``a``; the scales are applied as the Triton grouped GEMM applies them (the
reference multiplies the dequantized operands instead: a float32 reordering, within ``FP8_REL_FRO`` and in practice
far inside it). Deterministic: fixed grids, fixed loop orders, no atomics.

Costs that scale with ``T*k``: every program of kernel A scans all the ids, compared with the ``E_local`` experts
and then with its expert's row-block slots, in chunks that keep every compare tile at ``config.COUNT_TILE_ELEMS``
lanes (no register tile grows with ``T*k``; the loops do). ``config.MAX_SLOTS`` bounds ``T*k`` (beyond,
``NotImplementedError``: the staged layer is the path for such batches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_contract.config import FP8_QUANTS, MoEConfig
from moe_torch.ops.activation.triton import ACTIVATION_CODES, gated_values
from moe_torch.ops.device import device_spec
from moe_torch.ops.decode.config import (DEFAULT_NUM_SMS, FP8_BLOCK_K, FP8_MIN_BLOCK_K, MAX_SLOTS, MIN_DOT,
                                         W4_MIN_BLOCK_K, DecodeDownConfig, DecodeGateUpConfig, decode_down_config,
                                         decode_gate_up_config)
from moe_torch.ops.grouped_gemm.triton import W_SCALE_CODES, _w4_tiles, w4_kernel_weights
from moe_torch.ops.triton_common import MAX_GRID_AXIS_1, check_triton_device, fp8_scale, quantize_fp8_tile

# The kernels' W_SCALE codes (grouped_gemm/triton.py's W_SCALE_CODES): FP8 per-expert [E] / per-channel [E, N] weight
# scales (per-token activations), 128 x 128 blocks (1 x 128 activation groups), 4-bit codes.
_WS_NONE, _WS_EXPERT, _WS_CHANNEL, _WS_BLOCK, _WS_MXFP4, _WS_INT4, _WS_MXFP4_MMA = (
    tl.constexpr(W_SCALE_CODES[name])
    for name in (None, "per_expert", "per_channel", "block", "mxfp4", "int4", "mxfp4_mma"))
_FP8_BLOCK = tl.constexpr(FP8_BLOCK_K)
MIN_DOT_ROWS = tl.constexpr(MIN_DOT)
#: FP8 weight-scale layout by the scale's rank: [E_local], [E_local, N], [E_local, cdiv(N, 128), cdiv(K, 128)].
_FP8_SCALE_LAYOUTS = {1: "per_expert", 2: "per_channel", 3: "block"}


@triton.jit
def _local_ids(
    ids_ptr,  # [T * k] int32 / int64: topk_ids, contiguous (slot s at s)
    slots,  # [N] int32: slot indices
    S,  # int: T * k (slots >= S are padding)
    expert_start,  # int: this rank's first expert
    E_local,  # int: this rank's experts
):
    """``[N]`` int32: the local expert of each slot in ``slots``, ``-1`` for a non-local id (-1, another rank's, out
    of range) and for padding. The id is shifted in its own dtype (int64 ids do not wrap)."""
    ids = tl.load(ids_ptr + slots, mask=slots < S, other=-1)
    lid = ids - expert_start
    local = (slots < S) & (ids >= 0) & (lid >= 0) & (lid < E_local)
    return tl.where(local, lid, -1).to(tl.int32)


@triton.jit
def _dot(a, b, acc, IEEE_F32: tl.constexpr):
    """``acc + a @ b`` (float32 accumulation); float32 operands multiplied in full float32 (no TF32)."""
    if IEEE_F32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _slot_rows(x_ptr, x_rows, ks, mask, in_scale, ON_INPUT: tl.constexpr):
    """``[BLOCK_M, BLOCK_K]`` of the row block's expert inputs in ``x``'s dtype: ``x[t, ks]``, or with ``ON_INPUT``
    ``x[t, ks] * in_scale[m]`` in float32 rounded once to ``x``'s dtype (slot_weights.py's scaled_slot_rows)."""
    xs = tl.load(x_rows + ks[None, :], mask=mask, other=0.0)
    if ON_INPUT:
        xs = (xs.to(tl.float32) * in_scale[:, None]).to(x_ptr.dtype.element_ty)
    return xs


# S unspecialized: with S divisible by 16 (e.g. 8 tokens of top-4) Triton 3.6 vectorizes the slot scan's id loads
# and miscompiles their per-thread index (sm_90 PTX: out-of-range, misaligned 16-byte reads; CUDA "misaligned
# address" at gpt-oss's T = 8). Unspecialized, the loads stay scalar with correct indices; the ids are few.
@triton.jit(do_not_specialize=["S"])
def _decode_gate_up_kernel(
    x_ptr,  # [T, H] float32 / bf16 / fp16, unit column stride
    ids_ptr,  # [T * k] int32 / int64 topk_ids, contiguous
    tw_ptr,  # ON_INPUT: [T * k] float32 topk_weights, contiguous (unused otherwise)
    w_ptr,  # [E_local, 2I, H] x's dtype / float8_e4m3fn, or 4-bit uint8 [E_local, 2I, H // 2]; unit stride along H
    ws_ptr,  # FP8: float32 [E_local] / [E_local, 2I] / [E_local, 2I // 128, H // 128];
    #          4-bit: [E_local, 2I, H // 32] uint8 e8m0 / bf16 (unused otherwise)
    b_ptr,  # HAS_BIAS: [E_local, 2I] float32 / bf16 / fp16, unit column stride (unused otherwise)
    a_ptr,  # [T * k, I] out: act(g) * u per slot, x's dtype (float32 with FP8 weights); non-local slots not written
    S,  # int: T * k
    H,  # int: hidden size (GEMM 1's K)
    I,  # int: intermediate size
    E_local,  # int: this rank's experts
    expert_start,  # int: this rank's first expert id
    stride_xt,  # int: x.stride(0)
    stride_we,  # int: w13.stride(0)
    stride_wn,  # int: w13.stride(1)
    stride_wse,  # int: w13_scale.stride(0) (FP8, 4-bit)
    stride_wsn,  # int: w13_scale.stride(1) (FP8 per-channel and block, 4-bit)
    stride_wsk,  # int: w13_scale.stride(2) (FP8 block, 4-bit)
    stride_be,  # int: w13_bias.stride(0) (HAS_BIAS)
    stride_as,  # int: a.stride(0)
    K_SLOTS: tl.constexpr,  # k: slots per token
    TOPK: tl.constexpr,  # routed slots per token (the first TOPK of a token's k; the rest are fused shared experts)
    ON_INPUT: tl.constexpr,  # bool: apply_router_weight_on_input (a routed slot's input is x[t] * topk_weights[s])
    ACTIVATION: tl.constexpr,  # 0 silu, 1 gelu_tanh, 2 swiglu_oai (activation/triton.py's ACTIVATION_CODES)
    INTERLEAVED: tl.constexpr,  # bool: gate rows 0::2, up rows 1::2 of w13 (gpt-oss); else [gate | up]
    HAS_BIAS: tl.constexpr,  # bool: add w13_bias[e] before the rounding of h
    W_SCALE: tl.constexpr,  # W_SCALE_CODES: 0 float w13, 1 / 2 / 3 FP8 (expert, channel, block), 4 / 5 4-bit
    IEEE_F32: tl.constexpr,  # bool: float32 x (full float32 dots)
    BLOCK_E: tl.constexpr,  # next_power_of_2(E_local): the experts as one vector
    CHUNK_S: tl.constexpr,  # ids per step of the scans (count, then slots)
    NUM_CHUNKS: tl.constexpr,  # cdiv(S, CHUNK_S)
    NUM_M_BLOCKS: tl.constexpr,  # cdiv(S, BLOCK_M): row blocks an expert may need (looped while it has slots)
    BLOCK_M: tl.constexpr,  # slots per row block (>= 16: tl.dot)
    BLOCK_N: tl.constexpr,  # columns of a (gate and up columns of w13) per program
    BLOCK_K: tl.constexpr,  # H step (>= 32 for 4-bit and FP8; 128 for FP8 blocks)
    e8m0_lut=None,  # MXFP4 with bf16 x on a GPU: bf16 [256] 2^(s - 127) by e8m0 code (the packed decode)
):
    """Grid ``(min(S, E_local), cdiv(I, BLOCK_N))``: program ``(i, n)`` computes ``a[slots of expert i, cols]`` for the
    ``i``-th reached local expert (in id order) and columns ``n*BLOCK_N + [0, BLOCK_N)``; programs past the reached
    experts do nothing (module docstring, kernel A)."""
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)

    # The reached experts (counted a chunk of ids at a time) and this program's: the one of rank pid_e + 1.
    e_ids = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c in range(NUM_CHUNKS):
        lid = _local_ids(ids_ptr, c * CHUNK_S + tl.arange(0, CHUNK_S), S, expert_start, E_local)
        counts += tl.sum((lid[None, :] == e_ids[:, None]).to(tl.int32), axis=1)
    reached = counts > 0
    rank = tl.cumsum(reached.to(tl.int32), axis=0)
    this = reached & (rank == pid_e + 1)
    e = tl.sum(tl.where(this, e_ids, 0), axis=0)
    count = tl.sum(tl.where(this, counts, 0), axis=0)  # 0 when fewer than pid_e + 1 experts are reached

    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < I
    if INTERLEAVED:
        g_rows = (2 * cols).to(tl.int64)
        u_rows = g_rows + 1
    else:
        g_rows = cols.to(tl.int64)
        u_rows = g_rows + I
    e64 = e.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    for mb in range(NUM_M_BLOCKS):
        if mb * BLOCK_M < count:
            # The expert's slots m_ids (ranks among its slots, in slot order), a chunk of ids at a time: a slot's rank
            # is the matches before it (earlier chunks' `base`, plus the inclusive cumsum in its chunk, minus 1).
            m_ids = mb * BLOCK_M + tl.arange(0, BLOCK_M)
            slot = tl.zeros([BLOCK_M], dtype=tl.int32)  # 0 past the expert's slots (masked below)
            base = tl.full([], 0, tl.int32)  # matches in the chunks before
            for c in range(NUM_CHUNKS):
                s_ids = c * CHUNK_S + tl.arange(0, CHUNK_S)
                match = _local_ids(ids_ptr, s_ids, S, expert_start, E_local) == e
                pos = base + tl.cumsum(match.to(tl.int32), axis=0) - 1
                hit = match[None, :] & (pos[None, :] == m_ids[:, None])
                slot += tl.sum(tl.where(hit, s_ids[None, :], 0), axis=1)
                base += tl.sum(match.to(tl.int32), axis=0)
            row_mask = m_ids < count
            x_rows = x_ptr + (slot // K_SLOTS).to(tl.int64)[:, None] * stride_xt
            in_scale = tl.full([BLOCK_M], 1.0, tl.float32)  # fused shared slots keep their input (slot_weights.py)
            if ON_INPUT:
                tw = tl.load(tw_ptr + slot, mask=row_mask, other=1.0)
                in_scale = tl.where(slot % K_SLOTS < TOPK, tw, 1.0)
            if W_SCALE == _WS_EXPERT or W_SCALE == _WS_CHANNEL:
                # Per-token FP8 x: each slot row's amax over all of H first (the permute's quantization, CONTRACT.md
                # section 3); the rows are few and re-read from L1/L2.
                amax = tl.zeros([BLOCK_M], dtype=tl.float32)
                for k0 in range(0, H, BLOCK_K):
                    ks = k0 + offs_k
                    xs = _slot_rows(x_ptr, x_rows, ks, row_mask[:, None] & (ks < H)[None, :], in_scale, ON_INPUT)
                    amax = tl.maximum(amax, tl.max(tl.abs(xs.to(tl.float32)), axis=1))
                sx = fp8_scale(amax)
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, H, BLOCK_K):
                ks = k0 + offs_k
                k_mask = ks < H
                xs = _slot_rows(x_ptr, x_rows, ks, row_mask[:, None] & k_mask[None, :], in_scale, ON_INPUT)
                if W_SCALE == _WS_MXFP4 or W_SCALE == _WS_INT4 or W_SCALE == _WS_MXFP4_MMA:
                    # 4-bit codes decoded to x's dtype (CONTRACT.md section 9), as the grouped GEMM does
                    x_even, x_odd = tl.split(tl.reshape(xs, [BLOCK_M, BLOCK_K // 2, 2]))
                    g_even, g_odd = _w4_tiles(w_ptr + e64 * stride_we + g_rows[:, None] * stride_wn,
                                              ws_ptr + e64 * stride_wse + g_rows[:, None] * stride_wsn, stride_wsk,
                                              k0, H, col_mask, W_SCALE, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty,
                                              e8m0_lut)
                    acc_g = _dot(x_even, tl.trans(g_even), acc_g, IEEE_F32)
                    acc_g = _dot(x_odd, tl.trans(g_odd), acc_g, IEEE_F32)
                    u_even, u_odd = _w4_tiles(w_ptr + e64 * stride_we + u_rows[:, None] * stride_wn,
                                              ws_ptr + e64 * stride_wse + u_rows[:, None] * stride_wsn, stride_wsk,
                                              k0, H, col_mask, W_SCALE, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty,
                                              e8m0_lut)
                    acc_u = _dot(x_even, tl.trans(u_even), acc_u, IEEE_F32)
                    acc_u = _dot(x_odd, tl.trans(u_odd), acc_u, IEEE_F32)
                else:
                    w_mask = k_mask[:, None] & col_mask[None, :]
                    wg = tl.load(w_ptr + e64 * stride_we + g_rows[None, :] * stride_wn + ks[:, None], mask=w_mask,
                                 other=0.0)  # [BLOCK_K, BLOCK_N]
                    wu = tl.load(w_ptr + e64 * stride_we + u_rows[None, :] * stride_wn + ks[:, None], mask=w_mask,
                                 other=0.0)
                    if W_SCALE == _WS_BLOCK:
                        # 1 x 128 groups of x, quantized here (one group a step: BLOCK_K = 128); each step's FP8 sum
                        # scaled by its group's and the weight block's scales before it is accumulated, as the
                        # grouped GEMM does (CONTRACT.md sections 3, 4)
                        xf = xs.to(tl.float32)
                        sx = fp8_scale(tl.max(tl.abs(xf), axis=1))
                        xq = quantize_fp8_tile(xf, sx)
                        kb = k0 // _FP8_BLOCK
                        sg = tl.load(ws_ptr + e64 * stride_wse + (g_rows // _FP8_BLOCK) * stride_wsn + kb * stride_wsk,
                                     mask=col_mask, other=0.0)
                        su = tl.load(ws_ptr + e64 * stride_wse + (u_rows // _FP8_BLOCK) * stride_wsn + kb * stride_wsk,
                                     mask=col_mask, other=0.0)
                        acc_g += tl.dot(xq, wg, max_num_imprecise_acc=BLOCK_K) * sx[:, None] * sg[None, :]
                        acc_u += tl.dot(xq, wu, max_num_imprecise_acc=BLOCK_K) * sx[:, None] * su[None, :]
                    elif W_SCALE != _WS_NONE:  # per-token FP8 x (the row scale sx from above); scales after the loop
                        xq = quantize_fp8_tile(xs.to(tl.float32), sx)
                        acc_g = tl.dot(xq, wg, acc_g, max_num_imprecise_acc=BLOCK_K)
                        acc_u = tl.dot(xq, wu, acc_u, max_num_imprecise_acc=BLOCK_K)
                    else:
                        acc_g = _dot(xs, wg, acc_g, IEEE_F32)
                        acc_u = _dot(xs, wu, acc_u, IEEE_F32)
            if W_SCALE == _WS_EXPERT or W_SCALE == _WS_CHANNEL:  # the row's scale, then the weight's (as the GEMM)
                acc_g = acc_g * sx[:, None]
                acc_u = acc_u * sx[:, None]
                if W_SCALE == _WS_EXPERT:
                    sw = tl.load(ws_ptr + e64 * stride_wse)
                    acc_g = acc_g * sw
                    acc_u = acc_u * sw
                else:
                    acc_g = acc_g * tl.load(ws_ptr + e64 * stride_wse + g_rows * stride_wsn, mask=col_mask,
                                            other=0.0)[None, :]
                    acc_u = acc_u * tl.load(ws_ptr + e64 * stride_wse + u_rows * stride_wsn, mask=col_mask,
                                            other=0.0)[None, :]
            if HAS_BIAS:  # CONTRACT.md section 4: widened to float32, added (after any scales) before the one rounding
                acc_g += tl.load(b_ptr + e64 * stride_be + g_rows, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                acc_u += tl.load(b_ptr + e64 * stride_be + u_rows, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            # h = GEMM 1's output in x's dtype, then the activation on its float32 value (CONTRACT.md section 4);
            # with FP8 weights a is stored in float32 (kernel B quantizes it: act_and_mul's FP8 output)
            g = acc_g.to(x_ptr.dtype.element_ty).to(tl.float32)
            u = acc_u.to(x_ptr.dtype.element_ty).to(tl.float32)
            a = gated_values(g, u, ACTIVATION)
            a_ptrs = a_ptr + slot.to(tl.int64)[:, None] * stride_as + cols[None, :]
            tl.store(a_ptrs, a.to(a_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _quantize_row_chunk(av, scale):
    """``[BLOCK_I]`` float32 ``av`` quantized with the scalar ``scale`` (CONTRACT.md section 3, triton_common's
    ``quantize_fp8_tile``), back as float32 code values ``[1, BLOCK_I]`` (exact: e4m3 embeds in float32)."""
    return quantize_fp8_tile(av[None, :], tl.zeros([1], dtype=tl.float32) + scale).to(tl.float32)


@triton.jit
def _decode_down_kernel(
    a_ptr,  # [T * k, I] kernel A's output, x's dtype (float32 with FP8 weights); only local slots' rows are read
    ids_ptr,  # [T, k] int32 / int64 topk_ids, contiguous
    tw_ptr,  # [T, k] float32 topk_weights, contiguous
    w_ptr,  # [E_local, H, I] x's dtype / float8_e4m3fn, or 4-bit codes uint8 [E_local, H, I // 2]; unit stride along I
    ws_ptr,  # FP8: float32 [E_local] / [E_local, H] / [E_local, H // 128, I // 128];
    #          4-bit: [E_local, H, I // 32] uint8 e8m0 / bf16 (unused otherwise)
    b_ptr,  # HAS_BIAS: [E_local, H] float32 / bf16 / fp16, unit column stride (unused otherwise)
    out_ptr,  # [T, H] x's dtype out
    H,  # int: hidden size
    I,  # int: intermediate size (GEMM 2's K)
    E_local,  # int: this rank's experts
    expert_start,  # int: this rank's first expert id
    rsf,  # float32: the combine's routed scaling factor (used only if APPLY_RSF)
    stride_as,  # int: a.stride(0)
    stride_we,  # int: w2.stride(0)
    stride_wn,  # int: w2.stride(1)
    stride_wse,  # int: w2_scale.stride(0) (FP8, 4-bit)
    stride_wsn,  # int: w2_scale.stride(1) (FP8 per-channel and block, 4-bit)
    stride_wsk,  # int: w2_scale.stride(2) (FP8 block, 4-bit)
    stride_be,  # int: w2_bias.stride(0) (HAS_BIAS)
    stride_ot,  # int: out.stride(0)
    K_SLOTS: tl.constexpr,  # k: slots per token
    TOPK: tl.constexpr,  # routed slots per token (the first TOPK of a token's k)
    ON_INPUT: tl.constexpr,  # bool: apply_router_weight_on_input (routed slots combine with weight 1)
    HAS_BIAS: tl.constexpr,  # bool: add w2_bias[e] before the rounding of y
    APPLY_RSF: tl.constexpr,  # bool: rsf != 1
    W_SCALE: tl.constexpr,  # W_SCALE_CODES: 0 float w2, 1 / 2 / 3 FP8 (expert, channel, block), 4 / 5 4-bit
    USE_DOT: tl.constexpr,  # bool: the slot's GEMV on the tensor cores (16-bit a with float or 4-bit weights)
    BLOCK_H: tl.constexpr,  # output columns per program (>= 16 with USE_DOT)
    BLOCK_I: tl.constexpr,  # I step (>= 32 for 4-bit; 128 for FP8 blocks)
    e8m0_lut=None,  # MXFP4 with bf16 x on a GPU: bf16 [256] (the packed decode's scales)
):
    """Grid ``(T, cdiv(H, BLOCK_H))``: program ``(t, n)`` writes ``out[t, n*BLOCK_H : +BLOCK_H]`` (module docstring,
    kernel B)."""
    t64 = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    cols64 = cols.to(tl.int64)
    offs_i = tl.arange(0, BLOCK_I)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(K_SLOTS):  # a loop, not unrolled: one copy of the GEMV body
        s64 = t64 * K_SLOTS + j
        raw = tl.load(ids_ptr + s64)
        lid = raw - expert_start
        if (raw >= 0) & (lid >= 0) & (lid < E_local):  # a non-local slot adds nothing (and its row of a is unset)
            e64 = lid.to(tl.int64)
            a_row = a_ptr + s64 * stride_as
            if W_SCALE == _WS_EXPERT or W_SCALE == _WS_CHANNEL:
                # Per-token FP8 a: the row's amax over all of I first (act_and_mul's quantization, CONTRACT.md
                # section 3), then each chunk quantized with it below
                amax = tl.zeros([BLOCK_I], dtype=tl.float32)
                for i0 in range(0, I, BLOCK_I):
                    amax = tl.maximum(amax, tl.abs(tl.load(a_row + i0 + offs_i, mask=i0 + offs_i < I, other=0.0)))
                sa = fp8_scale(tl.max(amax, axis=0))
            y = tl.zeros([BLOCK_H], dtype=tl.float32)
            if USE_DOT:
                # The slot's row as row 0 of a 16-row dot operand (the rest masked to zero): one HMMA stream over the
                # decoded weights instead of a float32 multiply, convert and cross-lane sum per weight; the [16,
                # BLOCK_H] accumulator is reduced once per slot (the other rows are exact zeros).
                rows = tl.arange(0, MIN_DOT_ROWS)
                acc16 = tl.zeros([MIN_DOT_ROWS, BLOCK_H], dtype=tl.float32)
                for i0 in range(0, I, BLOCK_I):
                    i_mask = i0 + offs_i < I
                    a16 = tl.load(a_row + rows[:, None] * 0 + (i0 + offs_i)[None, :],
                                  mask=(rows == 0)[:, None] & i_mask[None, :], other=0.0)
                    if W_SCALE == _WS_MXFP4 or W_SCALE == _WS_INT4 or W_SCALE == _WS_MXFP4_MMA:
                        lo, hi = _w4_tiles(w_ptr + e64 * stride_we + cols64[:, None] * stride_wn,
                                           ws_ptr + e64 * stride_wse + cols64[:, None] * stride_wsn, stride_wsk, i0,
                                           I, col_mask, W_SCALE, BLOCK_H, BLOCK_I, a_ptr.dtype.element_ty, e8m0_lut)
                        a_even, a_odd = tl.split(tl.reshape(a16, [MIN_DOT_ROWS, BLOCK_I // 2, 2]))
                        acc16 = tl.dot(a_even, tl.trans(lo), acc16)
                        acc16 = tl.dot(a_odd, tl.trans(hi), acc16)
                    else:
                        w = tl.load(w_ptr + e64 * stride_we + cols64[:, None] * stride_wn + (i0 + offs_i)[None, :],
                                    mask=col_mask[:, None] & i_mask[None, :], other=0.0)
                        acc16 = tl.dot(a16, tl.trans(w), acc16)
                y = tl.sum(tl.where((rows == 0)[:, None], acc16, 0.0), axis=0)
            else:  # a float32 multiply and sum per chunk (float32 a; FP8 codes, exact products)
                for i0 in range(0, I, BLOCK_I):
                    i_mask = i0 + offs_i < I
                    if W_SCALE == _WS_MXFP4 or W_SCALE == _WS_INT4 or W_SCALE == _WS_MXFP4_MMA:
                        # 4-bit codes decoded to x's dtype; low nibbles meet a's even columns, high its odd ones
                        lo, hi = _w4_tiles(w_ptr + e64 * stride_we + cols64[:, None] * stride_wn,
                                           ws_ptr + e64 * stride_wse + cols64[:, None] * stride_wsn, stride_wsk, i0, I,
                                           col_mask, W_SCALE, BLOCK_H, BLOCK_I, a_ptr.dtype.element_ty, e8m0_lut)
                        av = tl.load(a_row + i0 + offs_i, mask=i_mask, other=0.0).to(tl.float32)
                        a_even, a_odd = tl.split(tl.reshape(av, [BLOCK_I // 2, 2]))
                        y += tl.sum(lo.to(tl.float32) * a_even[None, :] + hi.to(tl.float32) * a_odd[None, :], axis=1)
                    else:
                        w = tl.load(w_ptr + e64 * stride_we + cols64[:, None] * stride_wn + (i0 + offs_i)[None, :],
                                    mask=col_mask[:, None] & i_mask[None, :], other=0.0).to(tl.float32)
                        av = tl.load(a_row + i0 + offs_i, mask=i_mask, other=0.0).to(tl.float32)
                        if W_SCALE == _WS_BLOCK:
                            # 1 x 128 groups of a (one a chunk: BLOCK_I = 128), the chunk's FP8 sum scaled by its
                            # group's and the weight blocks' scales before it is accumulated (as GEMM 2 does)
                            sa = fp8_scale(tl.max(tl.abs(av), axis=0))
                            sw = tl.load(ws_ptr + e64 * stride_wse + (cols64 // _FP8_BLOCK) * stride_wsn
                                         + (i0 // _FP8_BLOCK) * stride_wsk, mask=col_mask, other=0.0)
                            y += tl.sum(w * _quantize_row_chunk(av, sa), axis=1) * sa * sw
                        elif W_SCALE != _WS_NONE:  # per-token FP8 a: products of codes (exact in float32), scaled after
                            y += tl.sum(w * _quantize_row_chunk(av, sa), axis=1)
                        else:
                            y += tl.sum(w * av[None, :], axis=1)
            if W_SCALE == _WS_EXPERT or W_SCALE == _WS_CHANNEL:  # the row's scale, then the weight's (as the GEMM)
                y = y * sa
                if W_SCALE == _WS_EXPERT:
                    y = y * tl.load(ws_ptr + e64 * stride_wse)
                else:
                    y = y * tl.load(ws_ptr + e64 * stride_wse + cols64 * stride_wsn, mask=col_mask, other=0.0)
            if HAS_BIAS:  # CONTRACT.md section 4: widened to float32, added (after any scales) before the one rounding
                y += tl.load(b_ptr + e64 * stride_be + cols64, mask=col_mask, other=0.0).to(tl.float32)
            # y = GEMM 2's output in x's dtype; the combine weights it in float32 (CONTRACT.md sections 4, 5). A routed
            # slot whose weight went into its input (ON_INPUT) adds y with weight 1.
            cw = tl.load(tw_ptr + s64)
            if ON_INPUT:
                cw = tl.where(j < TOPK, 1.0, cw)
            acc += cw * y.to(out_ptr.dtype.element_ty).to(tl.float32)
    if APPLY_RSF:
        acc = acc * rsf
    tl.store(out_ptr + t64 * stride_ot + cols64, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def check_decode_configs(op: str, gate_up: DecodeGateUpConfig, down: DecodeDownConfig, w4: bool,
                         fp8: str | None = None, dot: bool = False) -> None:
    """``ValueError`` naming ``op`` and the config unless every block is a power of 2, the dot sides of kernel A (and
    of kernel B's with ``dot``: ``block_h``, ``block_i``) are at least 16 (``tl.dot``), with 4-bit weights both K
    steps hold whole scale groups (>= 32), with FP8 weights (``fp8``: ``"fp8_per_token"`` / ``"fp8_block"``) kernel
    A's K step is at least 32 (the FP8 ``mma``), and for ``"fp8_block"`` both K steps are exactly one 128-wide scale
    block."""
    blocks = (gate_up.block_m, gate_up.block_n, gate_up.block_k, gate_up.chunk_s, down.block_h, down.block_i)
    min_k = W4_MIN_BLOCK_K if w4 else FP8_MIN_BLOCK_K if fp8 else MIN_DOT
    block_steps = fp8 == "fp8_block"
    if (not all(_pow2(b) for b in blocks) or min(gate_up.block_m, gate_up.block_n) < MIN_DOT
            or gate_up.block_k < min_k or (w4 and down.block_i < W4_MIN_BLOCK_K)
            or (dot and min(down.block_h, down.block_i) < MIN_DOT)
            or (block_steps and (gate_up.block_k, down.block_i) != (FP8_BLOCK_K, FP8_BLOCK_K))):
        need = f", block_i >= {W4_MIN_BLOCK_K} (4-bit weights)" if w4 else ""
        if block_steps:
            need = f", block_k = block_i = {FP8_BLOCK_K} (fp8_block: one scale block a K step)"
        if dot:
            need += f", block_h, block_i >= {MIN_DOT} (kernel B's dot: 16-bit activations)"
        raise ValueError(f"{op}: configs must have power-of-2 blocks, block_m, block_n >= {MIN_DOT} and block_k >= "
                         f"{min_k}{need}; got {gate_up}, {down}")


def _unit_last(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with unit stride along its last dim (a copy only where it lacks it: the caller's tensor is untouched)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _scale_code(config: MoEConfig, w_scale: torch.Tensor | None, w_format: str | None) -> int:
    """The kernels' ``W_SCALE`` for one weight: the 4-bit format the kernels read (``w4_kernel_weights``'), its FP8
    scale layout (by rank), or 0 (float)."""
    if w_format is not None:
        return W_SCALE_CODES[w_format]
    if config.quant in FP8_QUANTS:
        return W_SCALE_CODES[_FP8_SCALE_LAYOUTS[w_scale.ndim]]
    return 0


def _scale_strides(w_scale: torch.Tensor | None) -> tuple[int, int, int]:
    """``w_scale``'s strides padded to three (0 where it has fewer dims, or none)."""
    return (*w_scale.stride(), 0, 0, 0)[:3] if w_scale is not None else (0, 0, 0)


def fused_experts_decode_triton(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    config: MoEConfig,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    gate_up_config: DecodeGateUpConfig | None = None,
    down_config: DecodeDownConfig | None = None,
) -> torch.Tensor:
    """``out [T, H]`` in ``x.dtype`` with the two kernels; arguments as
    :func:`moe_torch.ops.decode.api.fused_experts_decode` (validated there). Allocates ``a [T*k, I]`` (``x.dtype``;
    float32 with FP8 weights) and ``out``; the inputs are only read. No host synchronisation.

    Raises: NotImplementedError (no CUDA and no interpreter; FP8 weights on a GPU older than sm_90; ``T*k >
      MAX_SLOTS``; a grid axis over CUDA's limit), ValueError (a given config that :func:`check_decode_configs`
      refuses).
    """
    op = "fused_experts_decode"
    fp8 = config.quant if config.quant in FP8_QUANTS else None
    # FP8: the kernels quantize x and a themselves (float32 -> e4m3 casts: sm_90, triton_common.check_triton_device)
    check_triton_device(op, x.device, _decode_gate_up_kernel, quantizes_fp8=fp8 is not None)
    T, k = topk_ids.shape
    H, I = config.hidden_size, config.intermediate_size
    expert_start, e_local = config.local_expert_range()
    S = T * k
    if S > MAX_SLOTS:
        raise NotImplementedError(f"{op}: the Triton decode kernels take at most {MAX_SLOTS} assignments T * (topk + S) "
                                  f"(every program holds all ids); got T={T}, k={k} ({S}) (the staged layer serves "
                                  f"such batches)")
    w_format = config.w_format
    w4 = w_format is not None
    num_sms = device_spec(x.device).sm_count if x.is_cuda else DEFAULT_NUM_SMS
    cfg_a = gate_up_config or decode_gate_up_config(T, k, H, I, e_local, w4=w4, fp8=fp8, num_sms=num_sms)
    cfg_b = down_config or decode_down_config(T, H, I, w4=w4, fp8=fp8, num_sms=num_sms)
    # Kernel B on the tensor cores where a is 16-bit (float32 a keeps the exact float32 GEMV; FP8 a is float32)
    use_dot = fp8 is None and x.dtype != torch.float32
    check_decode_configs(op, cfg_a, cfg_b, w4, fp8, dot=use_dot)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    x, w13, w2, w13_scale, w2_scale = (_unit_last(t) for t in (x, w13, w2, w13_scale, w2_scale))
    w13_bias, w2_bias = _unit_last(w13_bias), _unit_last(w2_bias)
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    # FP8: a stays float32 between the kernels (act_and_mul quantizes its float32 values, never rounded to x.dtype)
    a = torch.empty((S, I), dtype=torch.float32 if fp8 else x.dtype, device=x.device)
    grid_a = (min(S, e_local), triton.cdiv(I, cfg_a.block_n))
    grid_b = (T, triton.cdiv(H, cfg_b.block_h))
    if max(grid_a[1], grid_b[1]) > MAX_GRID_AXIS_1:
        raise NotImplementedError(f"{op}: {max(grid_a[1], grid_b[1])} column programs exceed CUDA's grid axis 1 limit "
                                  f"{MAX_GRID_AXIS_1}")
    # MMA-layout codes back in the checkpoint layout where the float32 decode runs (the interpreter, non-bf16 x)
    w13, w13_scale, kernel_format, lut = w4_kernel_weights(x, w13, w13_scale, w_format)
    w2, w2_scale, _, _ = w4_kernel_weights(x, w2, w2_scale, w_format)
    on_input = config.apply_router_weight_on_input
    _decode_gate_up_kernel[grid_a](
        x, ids, weights, w13, w13_scale if w13_scale is not None else w13,
        w13_bias if w13_bias is not None else w13, a,
        S, H, I, e_local, expert_start,
        x.stride(0), w13.stride(0), w13.stride(1), *_scale_strides(w13_scale),
        w13_bias.stride(0) if w13_bias is not None else 0, a.stride(0),
        K_SLOTS=k, TOPK=config.topk, ON_INPUT=on_input, ACTIVATION=ACTIVATION_CODES[config.activation],
        INTERLEAVED=config.gate_up_layout == "interleaved", HAS_BIAS=w13_bias is not None,
        W_SCALE=_scale_code(config, w13_scale, kernel_format), IEEE_F32=x.dtype == torch.float32,
        BLOCK_E=triton.next_power_of_2(e_local), CHUNK_S=cfg_a.chunk_s,
        NUM_CHUNKS=triton.cdiv(S, cfg_a.chunk_s), NUM_M_BLOCKS=triton.cdiv(S, cfg_a.block_m),
        BLOCK_M=cfg_a.block_m, BLOCK_N=cfg_a.block_n, BLOCK_K=cfg_a.block_k, e8m0_lut=lut,
        num_warps=cfg_a.num_warps, num_stages=cfg_a.num_stages,
    )
    rsf = float(config.combine_routed_scaling_factor)
    _decode_down_kernel[grid_b](
        a, ids, weights, w2, w2_scale if w2_scale is not None else w2, w2_bias if w2_bias is not None else w2, out,
        H, I, e_local, expert_start, rsf,
        a.stride(0), w2.stride(0), w2.stride(1), *_scale_strides(w2_scale),
        w2_bias.stride(0) if w2_bias is not None else 0, out.stride(0),
        K_SLOTS=k, TOPK=config.topk, ON_INPUT=on_input, HAS_BIAS=w2_bias is not None, APPLY_RSF=rsf != 1.0,
        W_SCALE=_scale_code(config, w2_scale, kernel_format), USE_DOT=use_dot, BLOCK_H=cfg_b.block_h, BLOCK_I=cfg_b.block_i, e8m0_lut=lut,
        num_warps=cfg_b.num_warps, num_stages=cfg_b.num_stages,
    )
    return out
