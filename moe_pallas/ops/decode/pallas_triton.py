"""The decode path's two Pallas-Triton kernels: the expert part of the MoE layer for a few tokens (``T`` of 1 to 64)
in one jitted program after the gate: a tiny jnp prelude, then two kernels, with no host synchronisation and grids
that depend only on the shapes. The staged layer (routing metadata, permute, GEMM 1, activation, GEMM 2, combine:
~7 launches and three ``[T*k, *]`` round trips through memory) is built for large ``T``; at decode sizes its
launches and metadata cost more than the weight reads that bound the work.

Names: ``x [T, H]``, ``topk_ids`` / ``topk_weights [T, k]`` (``k = topk + S`` slots), assignment (slot) ``s = t*k
+ j``, local expert ``e = topk_ids[t, j] - expert_start`` when it lies in ``[0, E_local)`` (else the slot is
non-local: ``-1``, a dropped slot, another EP rank's expert; it contributes nothing). Weights ``w13 [E_local, 2I,
H]``, ``w2 [E_local, H, I]`` (float of ``x``'s dtype; float8_e4m3fn codes with float32 scales, CONTRACT.md section
3; or 4-bit packed codes with group scales, section 9), optional biases ``w13_bias [E_local, 2I]``, ``w2_bias
[E_local, H]`` (passed to the kernels in float32, an exact widening, as the grouped GEMM does). ``c[s]``: the
combine's weight of slot ``s``, ``topk_weights`` itself, or with ``apply_router_weight_on_input`` (Llama 4) 1 for a
routed slot, whose weight ``r[s]`` scales its input instead (``moe_pallas.slot_weights.slot_weights``; a shared slot keeps its
weight, ``r = 1``).

**Prelude** (:func:`expert_slots` and one gather, plain jnp on the device, ``O(T*k*H + E_local)``)::

    slot_expert[s] = e(s), or -1 for a non-local slot (compared in the ids' own dtype: no wrap-around)
    perm           = the slots sorted by (expert, slot), a stable argsort; non-local slots last
    counts[e], starts[e] = the expert's slots and its first place in perm
    program i of kernel A: prog_expert[i] = the i-th reached expert in id order, with prog_start[i] /
                   prog_count[i] its range of perm; programs past the reached experts get count 0
    xp             = x[perm // k]: the slots' token rows [T*k, H] in expert order (an expert's rows contiguous)
                     with apply_router_weight_on_input: cast(float32(xp) * r[perm]) (the layer's scaled_slot_rows)
                     FP8: xp, xs = quantized per row (fp8_per_token: xs [T*k]; fp8_block: 1x128 groups, xs
                     [T*k, H/128]): the permute's quantization (quant/reference.py), which commutes with the gather

Why a prelude rather than the torch kernel's in-kernel scans (every program of its kernel A compares all ``T*k``
ids with the ``E_local`` experts, then with its own expert's slots, a chunk at a time): in JAX the metadata is a few
fused XLA ops inside the same jitted program (no host sync, static shapes, as the grouped GEMM's
``tile_metadata``), and with it each program of kernel A does only its own work: no ``O(T*k * E_local)`` compare
tiles per program (the torch kernel's cost that grows with ``T*k`` and its ``MAX_SLOTS`` limit), no in-kernel
cumsums to lower. The gathered ``xp`` makes an expert's rows one contiguous block, which is what the grouped
GEMM's 4-bit helper ``_w4_step_part`` loads (a row slice), so the float and 4-bit paths share it without a copy of
that helper (Pallas interpret mode cannot load a gather of rows next to a slice of columns either). The price is
a few tiny XLA kernels (a sort of ``T*k`` keys, a gather of ``T*k`` rows of ``H``: bytes that are small next to
one expert's ``w13``) before kernel A.

**Kernel A** (:func:`_gate_up_kernel`, GEMM 1 + bias + activation), grid ``(min(T*k, E_local), cdiv(I,
BLOCK_N))``::

    program (i, n): e, start, count = prog_expert[i], prog_start[i], prog_count[i]   (count 0: nothing to do)
      cols = n*BLOCK_N + [0, BLOCK_N) of I; wrows, the gate / up rows of w13: cols and I + cols ("concatenated", two
             accumulators), or the contiguous rows [2*n*BLOCK_N, +2*BLOCK_N) ("interleaved", gpt-oss: one
             [BLOCK_M, 2*BLOCK_N] accumulator whose even / odd columns are split into g and u at the end)
      for each row block mb while mb*BLOCK_M < count:   (a static loop of cdiv(T*k, BLOCK_M), guarded)
          rows = start + mb*BLOCK_M + [0, BLOCK_M);  slot = perm[rows]   (rows past count masked)
          for k0 in 0..H step BLOCK_K:                            (float32 accumulation, a dot of >= 16 rows)
              xs = xp[rows, k0:+BLOCK_K]                          (the slots' token rows, one contiguous block)
              acc += xs @ w13[e, wrows, k0:].T    (4-bit: the grouped GEMM's _w4_step_part decodes the codes to
                                                   x's dtype, low nibbles against x's even columns, high its odd;
                                                   FP8: codes times codes, float32; fp8_block: the step's partial
                                                   sum times xs[rows, k0/128] * w13_scale[e, wrows/128, k0/128])
          fp8_per_token: acc = acc * xs[rows] * w13_scale[e(, wrows)]   (the grouped GEMM's order)
          g, u = float32(cast(acc + w13_bias[e, wrows]))      h rounded to x.dtype: GEMM 1's output (section 4)
          a[slot, cols] = cast(act(g) * u)                      activation/reference.py's gated; x.dtype
                          fp8_per_token: float32 act(g) * u, unrounded (kernel B quantizes the whole row)
                          fp8_block: BLOCK_N = 128 columns are one 1x128 group: its amax, scale and codes as
                          act_and_mul's kernel makes them; a_scale[slot, n] = the scale

so every reached expert's ``w13`` is read once (per column block, by one program), whatever the number of its
slots; ``a [T*k, I]`` is in slot order (a masked scatter of rows, no permutation buffer); non-local slots' rows
are never written (and never read).

**Kernel B** (:func:`_down_kernel`, GEMM 2 + bias + combine), grid ``(T, cdiv(H, BLOCK_H))``::

    program (t, n): cols = n*BLOCK_H + [0, BLOCK_H) of H;  acc = 0 (float32)
      for j in 0..k-1 (slot order, a loop):
          if slot_expert[t*k + j] = e >= 0:              (lax.cond: a non-local slot reads nothing)
              fp8_per_token: sa = max(amax of a[s, :], 1e-10) * float32(1/448)  (a first pass over the row)
              y = sum over I chunks of w2[e, cols, i:+BLOCK_I] * a[t*k + j, i:+BLOCK_I]   (float32 sums)
                  (4-bit weights, or 16-bit a with float weights: a dot of 16 rows of which only the slot's is
                   live (4-bit: _w4_step_part), the [16, BLOCK_H] sums reduced once after the last chunk; float32
                   a: a GEMV;
                   fp8_per_token: the chunk of a quantized with sa first, codes times codes;
                   fp8_block: codes times codes, the chunk's sum times a_scale[s, i/128] * w2_scale[e, cols/128,
                   i/128])
              fp8_per_token: y = y * sa * w2_scale[e(, cols)]
              y = float32(cast(y + w2_bias[e, cols]))       GEMM 2's output, rounded to x.dtype (section 4)
              acc += c[t*k + j] * y                          the combine's float32 sum (section 5)
      out[t, cols] = cast(acc * rsf)                        rsf = config.combine_routed_scaling_factor (if != 1)

Token-major for the down projection (as the torch kernel): each output element is written by exactly one program,
which sums its token's slots in slot order, so the result is bit-identical from run to run (no atomics) and needs
no third kernel.

**FP8** (CONTRACT.md sections 3, 4): the x rows are quantized in the prelude (a few fused XLA ops on ``T*k`` rows;
the same function as the staged permute's, so the same codes and scales); the activation's quantization is fused
into the kernels, from the float32 ``act(g) * u`` as ``act_and_mul`` quantizes it, with its own scale formula and
division (``scale_from_amax``, ``quantize_div_fp8_kernel``), so the codes and scales are the staged op's bit for
bit. The 1x128 groups of ``fp8_block`` fit kernel A (a program's 128 columns are a group); a per-token scale needs
the amax of the whole ``I`` row, which no program of kernel A holds, so kernel A hands kernel B the float32 row and
every program of kernel B takes the amax of its slots' rows itself rather than a jnp reduction and a third launch
between the kernels. Its price: a second read of ``k`` rows of ``I`` float32 values (from L2) a program, and each
element of ``a`` quantized again in each of the ``H / BLOCK_H`` programs, a few dozen instructions with
``div.rn.f32`` next to the ``BLOCK_H`` multiply-adds it feeds (with the repaired division, ``EPMOE_PALLAS_DIV_RN=0``
or sm < 90, far more); not timed on a GPU yet. The scales apply where the grouped GEMM applies them, before the
bias and the one rounding.

Rounding points and sums follow the staged layer (``reference.py``), so the two agree within CONTRACT.md section 7:
float32 to float32 reordering (``F32_REL_FRO``), bf16 / fp16 within ``BF16_REL_FRO``, FP8 within ``FP8_REL_FRO``.
Deterministic: fixed grids, fixed loop orders, no atomics.

Mirror: ``moe_torch/ops/decode/triton.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_contract.config import MoEConfig
from moe_pallas.ops import common as _common  # its import applies patch_pallas_triton_offsets
from moe_pallas.ops.activation.reference import gated
from moe_pallas.ops.decode.config import (DEFAULT_NUM_SMS, FP8_BLOCK, MIN_DOT, W4_MIN_BLOCK_K, DecodeDownConfig,
                                          DecodeGateUpConfig, decode_down_config, decode_gate_up_config)
from moe_pallas.ops.grouped_gemm.pallas_mosaic_gpu import num_sms
from moe_pallas.ops.grouped_gemm.pallas_triton import _w4_step_part
from moe_pallas.ops.quant.pallas_triton import kernel_div_rn, quantize_div_fp8_kernel
from moe_pallas.ops.quant.reference import (FP8_DTYPE, mma_codes_for_kernel, per_token_group_quant_fp8_reference,
                                            per_token_quant_fp8_reference, scale_from_amax)
from moe_pallas.slot_weights import slot_weights

_DOT_DIMS = (((1,), (1,)), ((), ()))  # contract both operands' last dims (x tile [m, k], weight tile [n, k])
#: The layer's FP8 modes as the kernels see them: x and a per token (weights per expert / channel), or in 1x128
#: groups (weights in 128x128 blocks); CONTRACT.md section 3.
_FP8_KIND = {"fp8_per_token": "per_token", "fp8_block": "block"}


def expert_slots(topk_ids: jax.Array, expert_start: int, e_local: int):
    """The prelude's metadata: ``(slot_expert [S], perm [S], prog_expert [G], prog_start [G], prog_count [G])``
    int32 for ``topk_ids [T, k]`` (``S = T*k``, ``G = min(S, E_local)``); module docstring. Plain jnp, jittable."""
    S = topk_ids.size
    ids = topk_ids.reshape(S)
    lid = ids - jnp.asarray(expert_start, ids.dtype)  # shifted in the ids' own dtype
    local = (ids >= 0) & (lid >= 0) & (lid < e_local)
    slot_expert = jnp.where(local, lid, -1).astype(jnp.int32)
    key = jnp.where(local, slot_expert, e_local)  # non-local slots sort last
    perm = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.zeros((e_local + 1,), jnp.int32).at[key].add(1)[:e_local]
    starts = jnp.cumsum(counts) - counts
    G = min(S, e_local)
    reached = counts > 0
    prog_expert = jnp.argsort(jnp.where(reached, 0, 1), stable=True)[:G].astype(jnp.int32)  # reached, in id order
    return slot_expert, perm, prog_expert, starts[prog_expert], counts[prog_expert]


def _block_scales(ws_ref, e, r0, width: int, kb, n_blocks: int):
    """The 128x128 block scales of ``w13[e]`` rows ``[r0, r0 + width)`` (``r0`` a multiple of ``min(width, 128)``) in
    K block ``kb``: a scalar when the rows lie in one block, else ``[width]`` (interleaved rows: two blocks)."""
    if width <= FP8_BLOCK:
        return ws_ref[e, r0 // FP8_BLOCK, kb]
    block = jnp.arange(width) // FP8_BLOCK
    sw = jnp.zeros((width,), jnp.float32)
    for b in range(width // FP8_BLOCK):  # clamped: a block past N belongs to masked rows only
        sw = jnp.where(block == b, ws_ref[e, jnp.minimum(r0 // FP8_BLOCK + b, n_blocks - 1), kb], sw)
    return sw[None, :]


def _gate_up_kernel(pexp_ref, pstart_ref, pcount_ref, perm_ref, xp_ref, w_ref, *refs, k: int, S: int, H: int, I: int,
                    activation: str, interleaved: bool, w_format: str | None, fp8: str | None, w_scale_kind: str | None,
                    has_bias: bool, h_dtype, a_mode: str, div_rn: bool, precision, packed_decode: bool,
                    num_m_blocks: int, block_m: int, block_n: int, block_k: int):
    """Kernel A, program ``(i, n)``: ``a[slots of the i-th reached expert, n*block_n : +block_n]`` (module
    docstring). Refs: ``pexp_ref, pstart_ref, pcount_ref [G]``, ``perm_ref [S]`` int32; ``xp_ref [S, H]``
    (``x[perm // k]``, FP8 codes for ``fp8``: the expert's rows are ``[start, start + count)``);
    ``w_ref [E_local, 2I, H]`` (4-bit: ``[E_local, 2I, H // 2]`` uint8, then ``ws_ref [E_local, 2I, H // 32]``; FP8:
    float8_e4m3fn, then ``xs_ref`` (``[S]`` per token, ``[S, H // 128]`` per group) and ``ws_ref`` (``[E_local]``,
    ``[E_local, 2I]`` or ``[E_local, 2I // 128, H // 128]``) float32); with ``has_bias`` ``b_ref [E_local, 2I]``
    float32; then the outputs by ``a_mode``: ``"cast"`` ``a_ref [S, I]`` of ``h_dtype``, ``"float32"`` ``a_ref``
    float32 (kernel B quantizes it per token), ``"group"`` ``a_ref`` float8_e4m3fn codes and ``as_ref [S * I // 128]``
    float32 scales (slot ``s``'s group ``g`` at ``s * I // 128 + g``)."""
    n_out = 2 if a_mode == "group" else 1
    refs, outs = list(refs[:-n_out]), refs[-n_out:]
    a_ref, as_ref = (outs[0], outs[1]) if a_mode == "group" else (outs[0], None)
    b_ref = refs.pop() if has_bias else None
    xs_ref = ws_ref = None
    if w_format is not None:
        (ws_ref,) = refs
    elif fp8 is not None:
        xs_ref, ws_ref = refs
    i, n = pl.program_id(0), pl.program_id(1)
    e, start, count = pexp_ref[i], pstart_ref[i], pcount_ref[i]
    n0 = n * block_n
    col_ok = n0 + jnp.arange(block_n) < I
    # (w13 rows, their mask, their count, their first row) of each accumulator: [gate | up] two, interleaved one
    # (split at the end)
    if interleaved:
        parts = ((pl.ds(2 * n0, 2 * block_n), 2 * n0 + jnp.arange(2 * block_n) < 2 * I, 2 * block_n, 2 * n0),)
    else:
        parts = ((pl.ds(n0, block_n), col_ok, block_n, n0), (pl.ds(I + n0, block_n), col_ok, block_n, I + n0))
    zero_x, zero_w = jnp.zeros((), xp_ref.dtype), jnp.zeros((), w_ref.dtype)

    def row_block(mb, carry):
        m0 = mb * block_m

        @pl.when(m0 < count)
        def _():
            row_ok = m0 + jnp.arange(block_m) < count
            rows_x = pl.ds(start + m0, block_m)  # the expert's rows of xp: contiguous
            slot = plgpu.load(perm_ref.at[rows_x], mask=row_ok, other=0)  # [block_m]: where they go in a

            def k_step(kk, accs):
                k0 = kk * block_k
                if w_format is not None:  # the grouped GEMM's decode of the step's codes, and its two dots
                    return tuple(acc + _w4_step_part(xp_ref, w_ref, ws_ref, e, rows_x, row_ok, rows, rows_ok, k0, H,
                                                     w_format, block_m, width, block_k, precision, packed_decode)
                                 for acc, (rows, rows_ok, width, _) in zip(accs, parts))
                k_ok = k0 + jnp.arange(block_k) < H
                xs = plgpu.load(xp_ref.at[rows_x, pl.ds(k0, block_k)], mask=row_ok[:, None] & k_ok[None, :],
                                other=zero_x)  # [block_m, block_k]
                if fp8 == "block":  # the step lies in one 128-wide K block: one x scale a row
                    kb = k0 // FP8_BLOCK
                    sx = plgpu.load(xs_ref.at[rows_x, kb], mask=row_ok, other=0.0)[:, None]
                out = []
                for acc, (rows, rows_ok, width, r0) in zip(accs, parts):
                    wt = plgpu.load(w_ref.at[e, rows, pl.ds(k0, block_k)], mask=rows_ok[:, None] & k_ok[None, :],
                                    other=zero_w)  # [width, block_k]
                    part = jax.lax.dot_general(xs, wt, _DOT_DIMS, precision=precision,
                                               preferred_element_type=jnp.float32)
                    if fp8 == "block":  # CONTRACT.md section 4: each K block's partial sum scaled, then accumulated
                        part = part * (sx * _block_scales(ws_ref, e, r0, width, kb, ws_ref.shape[1]))
                    out.append(acc + part)
                return tuple(out)

            accs = jax.lax.fori_loop(0, pl.cdiv(H, block_k), k_step,
                                     tuple(jnp.zeros((block_m, width), jnp.float32) for _, _, width, _ in parts))
            if fp8 == "per_token":  # the grouped GEMM's order: the finished sum times x's scale, then w's
                sx = plgpu.load(xs_ref.at[rows_x], mask=row_ok, other=0.0)[:, None]
                accs = tuple(acc * sx for acc in accs)
                if w_scale_kind == "per_expert":
                    accs = tuple(acc * ws_ref[e] for acc in accs)
                else:
                    accs = tuple(acc * plgpu.load(ws_ref.at[e, rows], mask=rows_ok, other=0.0)[None, :]
                                 for acc, (rows, rows_ok, _, _) in zip(accs, parts))
            if has_bias:  # CONTRACT.md section 4: float32, after the scales, before the one rounding
                accs = tuple(acc + plgpu.load(b_ref.at[e, rows], mask=rows_ok, other=0.0)[None, :]
                             for acc, (rows, rows_ok, _, _) in zip(accs, parts))
            # h = GEMM 1's output in x's dtype, then the activation on its float32 value (CONTRACT.md section 4)
            h = tuple(acc.astype(h_dtype).astype(jnp.float32) for acc in accs)
            g, u = jax.lax.unstack(h[0].reshape(block_m, block_n, 2), axis=2) if interleaved else h
            a = gated(activation, g, u)
            # a scatter of rows to their slots; masked-off rows point past the end (interpret mode's scatter would
            # otherwise see duplicate rows)
            dst = jnp.where(row_ok, slot, S)
            mask = row_ok[:, None] & col_ok[None, :]
            cols = (n0 + jnp.arange(block_n))[None, :]
            if a_mode != "group":  # x's dtype; or float32, exact, for kernel B's per-token quantization
                plgpu.store(a_ref.at[dst[:, None], cols], a.astype(a_ref.dtype), mask=mask)
                return
            # the activation's 1x128 group quantization (act_and_mul's, on the same float32 values): this program's
            # block_n = 128 columns are one group
            scale = scale_from_amax(jnp.max(jnp.where(mask, jnp.abs(a), 0.0), axis=1))  # [block_m]
            plgpu.store(a_ref.at[dst[:, None], cols], quantize_div_fp8_kernel(a, scale[:, None], div_rn=div_rn),
                        mask=mask)
            plgpu.store(as_ref.at[dst * (I // FP8_BLOCK) + n], scale, mask=row_ok)

        return carry

    jax.lax.fori_loop(0, num_m_blocks, row_block, 0)


def _down_kernel(se_ref, tw_ref, a_ref, w_ref, *refs, k: int, H: int, I: int, rsf: float, w_format: str | None,
                 fp8: str | None, w_scale_kind: str | None, has_bias: bool, h_dtype, div_rn: bool, precision,
                 packed_decode: bool, use_dot: bool, block_h: int, block_i: int):
    """Kernel B, program ``(t, n)``: ``out[t, n*block_h : +block_h]`` (module docstring). Refs: ``se_ref [S]``
    int32 (``slot_expert``), ``tw_ref [S]`` float32 (the combine's weights), ``a_ref [S, I]`` (kernel A's; local
    slots' rows only are read: ``h_dtype``, float32 for ``fp8="per_token"``, float8_e4m3fn codes for ``"block"``);
    ``w_ref [E_local, H, I]`` (4-bit: ``[E_local, H, I // 2]`` uint8, then ``ws_ref [E_local, H, I // 32]``; FP8:
    float8_e4m3fn, then for ``"block"`` ``as_ref [S * I // 128]`` float32 (kernel A's), and ``ws_ref``
    (``[E_local]``, ``[E_local, H]`` or ``[E_local, H // 128, I // 128]``) float32); with ``has_bias``
    ``b_ref [E_local, H]`` float32; last ``out_ref [T, H]``."""
    *refs, out_ref = refs
    b_ref = refs.pop() if has_bias else None
    ws_ref = as_ref = None
    if fp8 == "block":
        as_ref, ws_ref = refs
    elif w_format is not None or fp8 is not None:
        (ws_ref,) = refs
    t, n = pl.program_id(0), pl.program_id(1)
    h0 = n * block_h
    cols = pl.ds(h0, block_h)
    col_ok = h0 + jnp.arange(block_h) < H
    n_i = pl.cdiv(I, block_i)
    zero_a, zero_w = jnp.zeros((), a_ref.dtype), jnp.zeros((), w_ref.dtype)

    def slot_step(j, acc):
        s = t * k + j
        e = se_ref[s]

        def add(acc):
            if fp8 == "per_token":  # act_and_mul's per-token scale: the amax of the slot's whole float32 row
                def amax_step(ii, m):
                    i0 = ii * block_i
                    av = plgpu.load(a_ref.at[s, pl.ds(i0, block_i)], mask=i0 + jnp.arange(block_i) < I, other=0.0)
                    return jnp.maximum(m, jnp.max(jnp.abs(av)))

                sa = scale_from_amax(jax.lax.fori_loop(0, n_i, amax_step, jnp.float32(0.0)))

            live = jnp.arange(MIN_DOT) == 0

            def dot_step(ii, acc16):  # 16 rows (the dot's least), only the slot's live: its row is the GEMV
                i0 = ii * block_i
                if w_format is not None:
                    return acc16 + _w4_step_part(a_ref, w_ref, ws_ref, e, pl.ds(s, MIN_DOT), live, cols, col_ok, i0,
                                                 I, w_format, MIN_DOT, block_h, block_i, precision, packed_decode)
                i_ok = i0 + jnp.arange(block_i) < I
                a16 = plgpu.load(a_ref.at[pl.ds(s, MIN_DOT), pl.ds(i0, block_i)], mask=live[:, None] & i_ok[None, :],
                                 other=zero_a)  # [16, block_i]
                wt = plgpu.load(w_ref.at[e, cols, pl.ds(i0, block_i)], mask=col_ok[:, None] & i_ok[None, :],
                                other=zero_w)  # [block_h, block_i]
                return acc16 + jax.lax.dot_general(a16, wt, _DOT_DIMS, precision=precision,
                                                   preferred_element_type=jnp.float32)

            def i_step(ii, y):
                i0 = ii * block_i
                i_ok = i0 + jnp.arange(block_i) < I
                av = plgpu.load(a_ref.at[s, pl.ds(i0, block_i)], mask=i_ok, other=zero_a)
                if fp8 == "per_token":  # the staged activation's codes (act_and_mul's quantization, same values)
                    av = quantize_div_fp8_kernel(av, sa, div_rn=div_rn)
                wt = plgpu.load(w_ref.at[e, cols, pl.ds(i0, block_i)], mask=col_ok[:, None] & i_ok[None, :],
                                other=zero_w).astype(jnp.float32)  # [block_h, block_i]
                part = jnp.sum(wt * av.astype(jnp.float32)[None, :], axis=1)
                if fp8 == "block":  # the chunk lies in one group of a and one 128x128 block of w2: one scale
                    ib = i0 // FP8_BLOCK
                    part = part * (as_ref[s * (I // FP8_BLOCK) + ib] * ws_ref[e, h0 // FP8_BLOCK, ib])
                return y + part

            if use_dot:  # the [16, block_h] sums reduced once: the other rows are exact zeros
                y = jnp.sum(jax.lax.fori_loop(0, n_i, dot_step, jnp.zeros((MIN_DOT, block_h), jnp.float32)), axis=0)
            else:
                y = jax.lax.fori_loop(0, n_i, i_step, jnp.zeros((block_h,), jnp.float32))
            if fp8 == "per_token":  # the grouped GEMM's order: the finished sum times a's scale, then w2's
                y = y * sa
                y = y * (ws_ref[e] if w_scale_kind == "per_expert" else
                         plgpu.load(ws_ref.at[e, cols], mask=col_ok, other=0.0))
            if has_bias:  # CONTRACT.md section 4: float32, after the scales, before the one rounding
                y = y + plgpu.load(b_ref.at[e, cols], mask=col_ok, other=0.0)
            # y = GEMM 2's output in x's dtype; the combine weights it in float32 (CONTRACT.md sections 4, 5)
            return acc + tw_ref[s] * y.astype(h_dtype).astype(jnp.float32)

        return jax.lax.cond(e >= 0, add, lambda acc: acc, acc)  # a non-local slot adds nothing, reads nothing

    acc = jax.lax.fori_loop(0, k, slot_step, jnp.zeros((block_h,), jnp.float32))
    if rsf != 1.0:
        acc = acc * jnp.float32(rsf)
    plgpu.store(out_ref.at[t, cols], acc.astype(out_ref.dtype), mask=col_ok)


def check_decode_configs(op: str, gate_up: DecodeGateUpConfig, down: DecodeDownConfig, w4: bool,
                         fp8_block: bool = False, dot: bool = False) -> None:
    """``ValueError`` naming ``op`` and the configs unless kernel A's dot sides (and kernel B's with ``dot``:
    ``block_h``, ``block_i``) are at least 16, with 4-bit
    weights both K steps hold whole scale groups (>= 32), and with ``fp8_block`` kernel A's ``block_n`` is one
    1x128 group of ``a`` and the other steps lie in one 128 x 128 scale block (``block_k``, ``block_h``,
    ``block_i`` <= 128). (Powers of 2: the config classes check.)"""
    min_k = W4_MIN_BLOCK_K if w4 else MIN_DOT
    bad = min(gate_up.block_m, gate_up.block_n) < MIN_DOT or gate_up.block_k < min_k or (
        w4 and down.block_i < W4_MIN_BLOCK_K) or (dot and min(down.block_h, down.block_i) < MIN_DOT)
    bad = bad or fp8_block and (gate_up.block_n != FP8_BLOCK or max(gate_up.block_k, down.block_h, down.block_i)
                                > FP8_BLOCK)
    if bad:
        need = f"{', block_i >= ' + str(W4_MIN_BLOCK_K) + ' (4-bit weights)' if w4 else ''}"
        if dot:
            need += f", block_h, block_i >= {MIN_DOT} (kernel B's dot: 16-bit activations)"
        if fp8_block:
            need += f", block_n == {FP8_BLOCK} and block_k, block_h, block_i <= {FP8_BLOCK} (quant='fp8_block')"
        raise ValueError(f"{op}: configs must have block_m, block_n >= {MIN_DOT} and block_k >= {min_k}{need}; "
                         f"got {gate_up}, {down}")


@functools.partial(jax.jit, static_argnames=("config", "gate_up_config", "down_config", "interpret"))
def fused_experts_decode_pallas_triton(
    x: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    w13: jax.Array,
    w2: jax.Array,
    config: MoEConfig,
    w13_bias: jax.Array | None = None,
    w2_bias: jax.Array | None = None,
    w13_scale: jax.Array | None = None,
    w2_scale: jax.Array | None = None,
    *,
    gate_up_config: DecodeGateUpConfig | None = None,
    down_config: DecodeDownConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``out [T, H]`` in ``x.dtype`` with the prelude and the two kernels; arguments as
    :func:`moe_pallas.ops.decode.api.fused_experts_decode` (validated there). ``interpret``: Pallas interpret mode
    (default: when ``jax.default_backend() == "cpu"``). Jitted: no host synchronisation, shapes static.

    Raises (at trace time, before anything runs): ValueError (a given config :func:`check_decode_configs`
      refuses), NotImplementedError (an array whose 32-bit offsets this jax's lowering could not widen).
    """
    op = "fused_experts_decode"
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    T, k = topk_ids.shape
    H, I = config.hidden_size, config.intermediate_size
    expert_start, e_local = config.local_expert_range()
    S = T * k
    w_format = config.w_format
    if w_format == "mxfp4_mma":  # these kernels decode the checkpoint layout (as the grouped GEMM's)
        (w13, w13_scale), (w2, w2_scale) = (mma_codes_for_kernel(op, w13, w13_scale),
                                            mma_codes_for_kernel(op, w2, w2_scale))
        w_format = "mxfp4"
    fp8 = _FP8_KIND.get(config.quant)  # None, "per_token" or "block"
    # each weight's own scale layout: fp8_per_token takes per-expert [E_local] or per-channel [E_local, N] for each
    kinds = [None if fp8 is None else {1: "per_expert", 2: "per_channel", 3: "block"}[s.ndim]
             for s in (w13_scale, w2_scale)]
    sms = DEFAULT_NUM_SMS if interpret else num_sms()
    cfg_a = gate_up_config or decode_gate_up_config(T, k, H, I, e_local, w4=w_format is not None,
                                                    fp8_block=fp8 == "block", num_sms=sms)
    cfg_b = down_config or decode_down_config(T, H, I, w4=w_format is not None,
                                              fp8=config.quant if fp8 is not None else None, num_sms=sms)
    # kernel B: 4-bit weights, and float weights with 16-bit a, as a dot of the slot's row padded to 16 rows (the
    # tensor cores take the operands as loaded or decoded); float32 a with float weights keeps the exact float32 GEMV,
    # FP8 its own
    use_dot = w_format is not None or (fp8 is None and x.dtype != jnp.float32)
    check_decode_configs(op, cfg_a, cfg_b, w_format is not None, fp8_block=fp8 == "block", dot=use_dot)
    if not interpret:  # 64-bit offsets where jax's lowering would not give them (common.patch_pallas_triton_offsets)
        _common.pallas_triton_offsets_ok(op, w13=w13, w2=w2)
    if S == 0:
        return jnp.zeros((T, H), x.dtype)
    slot_expert, perm, prog_expert, prog_start, prog_count = expert_slots(topk_ids, expert_start, e_local)
    combine_weights, input_scale = slot_weights(topk_weights, None, config.replace(shared_expert_gate=False))
    # float32 x: IEEE products (the Triton default for DEFAULT precision is TF32); bf16 x compiled: the packed decode
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 and fp8 is None else None
    packed_decode = w_format is not None and not interpret and x.dtype == jnp.bfloat16
    common = dict(w_format=w_format, fp8=fp8, h_dtype=x.dtype,
                  div_rn=kernel_div_rn(interpret), precision=precision, packed_decode=packed_decode)

    xp = x[perm // k]  # the slots' token rows in expert order (T*k rows: small next to one expert's w13)
    if input_scale is not None:  # Llama 4: the layer's scaled_slot_rows, in perm order (float32, one rounding)
        xp = (xp.astype(jnp.float32) * input_scale.reshape(S)[perm][:, None]).astype(x.dtype)
    inputs_a = [prog_expert, prog_start, prog_count, perm]
    if fp8 is None:
        inputs_a += [xp, w13] + ([w13_scale] if w_format is not None else [])
    else:  # the permute's quantization of the same rows (per row: it commutes with the gather)
        xq, xs = (per_token_quant_fp8_reference(xp) if fp8 == "per_token" else
                  per_token_group_quant_fp8_reference(xp, FP8_BLOCK))
        inputs_a += [xq, w13, xs.reshape(S) if fp8 == "per_token" else xs, w13_scale]
    inputs_a += [w13_bias.astype(jnp.float32)] if w13_bias is not None else []  # exact widening; small next to w13
    a_mode = {None: "cast", "per_token": "float32", "block": "group"}[fp8]
    a_shape = jax.ShapeDtypeStruct((S, I), {"cast": x.dtype, "float32": jnp.float32, "group": FP8_DTYPE}[a_mode])
    if a_mode == "group":  # the codes and their scales, slot s's group g at s * I/128 + g (a flat scatter target)
        a_shape = (a_shape, jax.ShapeDtypeStruct((S * (I // FP8_BLOCK),), jnp.float32))
    kernel_a = functools.partial(
        _gate_up_kernel, k=k, S=S, H=H, I=I, activation=config.activation,
        interleaved=config.gate_up_layout == "interleaved", has_bias=w13_bias is not None, a_mode=a_mode,
        w_scale_kind=kinds[0], num_m_blocks=pl.cdiv(S, cfg_a.block_m), block_m=cfg_a.block_m,
        block_n=cfg_a.block_n, block_k=cfg_a.block_k, **common)
    a = pl.pallas_call(
        kernel_a,
        out_shape=a_shape,
        grid=(min(S, e_local), pl.cdiv(I, cfg_a.block_n)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg_a.num_warps, num_stages=cfg_a.num_stages),
        interpret=interpret,
        name="decode_gate_up",
    )(*inputs_a)

    a, a_scale = a if a_mode == "group" else (a, None)
    inputs_b = [slot_expert, combine_weights.reshape(S), a, w2]
    inputs_b += [a_scale] if a_scale is not None else []
    inputs_b += [w2_scale] if w_format is not None or fp8 is not None else []
    inputs_b += [w2_bias.astype(jnp.float32)] if w2_bias is not None else []
    kernel_b = functools.partial(
        _down_kernel, k=k, H=H, I=I, rsf=float(config.combine_routed_scaling_factor), has_bias=w2_bias is not None,
        w_scale_kind=kinds[1], use_dot=use_dot, block_h=cfg_b.block_h, block_i=cfg_b.block_i, **common)
    return pl.pallas_call(
        kernel_b,
        out_shape=jax.ShapeDtypeStruct((T, H), x.dtype),
        grid=(T, pl.cdiv(H, cfg_b.block_h)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg_b.num_warps, num_stages=cfg_b.num_stages),
        interpret=interpret,
        name="decode_down",
    )(*inputs_b)
