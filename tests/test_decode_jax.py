"""The JAX decode path (``moe_pallas/ops/decode``): ``fused_experts_decode``'s prelude and two Pallas-Triton kernels
against its reference (the staged layer's stage references composed) and a float64 per-slot loop, CONTRACT.md
sections 4, 5, 7 and 9. The mirror of ``test_decode_torch.py``, case for case.

Routings: T = 1, 2, 3, 7 with ragged and empty experts, every token on one expert, ``-1`` ids, another EP rank's
experts, a token with no local slot, an expert with more slots than one row block; float32 (``F32_REL_FRO``) and
bf16 / fp16 (``BF16_REL_FRO``); gpt-oss's biases with ``swiglu_oai`` on interleaved gate/up rows; a fused shared
expert with rsf in the combine, with and without Llama 4's routing weight on the input; 4-bit weights (mxfp4,
int4); FP8 weights (fp8_per_token, fp8_block: ``FP8_REL_FRO``, the reference against the staged layer's
``routed_experts`` bit for bit, and the activation's codes and scales bit for bit on exact data); bit-identical
reruns and ``jax.jit`` replays on new inputs (where torch captures a CUDA graph); the host-side errors; both kernels
lowered for CUDA (abstract H200).

On the CPU the kernels run in Pallas interpret mode, which fills ``a``'s never-written rows (non-local slots) with
NaN: a read of one would reach the output. Shapes are tiny: H = 48 / 64, I = 24 / 32 (K tails in both GEMMs);
fp8_block needs multiples of 128.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

import moe_pallas
from moe_contract import MoEConfig
from moe_pallas.layer import quantize_layer_weights, routed_experts
from moe_pallas.ops.decode import DECODE_MAX_TOKENS, fused_experts_decode
from moe_pallas.ops.decode import pallas_triton as decode_pt
from moe_pallas.ops.decode.config import DecodeDownConfig, DecodeGateUpConfig
from moe_pallas.ops.quant.pallas_triton import kernel_div_rn
from moe_pallas.slot_weights import slot_weights
from moe_torch.ops.activation.reference import gated, split_gate_up
from tolerances import BF16_REL_FRO, F32_REL_FRO, FP8_REL_FRO, assert_exact, assert_rel_fro, to_numpy

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
LIMITS = {"float32": F32_REL_FRO, "bfloat16": BF16_REL_FRO, "float16": BF16_REL_FRO}
#: gpt-oss's expert settings: swiglu_oai on interleaved gate/up rows, per-expert biases on both projections.
GPT_OSS = dict(activation="swiglu_oai", gate_up_layout="interleaved", expert_bias=True)
ON_CPU = jax.default_backend() == "cpu"


def _inputs(config: MoEConfig, ids: np.ndarray, dtype: str, seed: int = 0, bias_dtype: str = "float32"):
    """``(x, topk_weights, topk_ids, w13, w2, biases)`` as jax arrays for ``config`` and the given ids (biases
    ``{}`` unless ``config.expert_bias``). Weights scaled so that ``h`` and ``y`` are O(1)."""
    rng = np.random.default_rng(seed)
    H, I = config.hidden_size, config.intermediate_size
    _, e_local = config.local_expert_range()
    T, k = ids.shape
    dt = DTYPES[dtype]

    def t(shape, scale, d=dt):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * scale).astype(d)

    x = t((T, H), 1.0)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32))
    w13, w2 = t((e_local, 2 * I, H), H ** -0.5), t((e_local, H, I), I ** -0.5)
    biases = {}
    if config.expert_bias:
        biases = dict(w13_bias=t((e_local, 2 * I), 0.5, DTYPES[bias_dtype]),
                      w2_bias=t((e_local, H), 0.5, DTYPES[bias_dtype]))
    return x, weights, jnp.asarray(ids), w13, w2, biases


def _f64(a) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(to_numpy(a).astype(np.float64))


def _float64_loop(x, weights, ids, w13, w2, config: MoEConfig, w13_bias=None, w2_bias=None) -> np.ndarray:
    """``sum_j w[t, j] * expert(x[t])`` in float64 with no intermediate rounding, slot by slot (the judge of
    CONTRACT.md section 7's float64 rows; torch's float64 activation reference); ``w13`` / ``w2`` float
    (dequantized for 4-bit). With ``config.apply_router_weight_on_input`` a routed slot is ``expert(w[t, j] *
    x[t])`` instead."""
    start, e_local = config.local_expert_range()
    x, weights, w13, w2, w13_bias, w2_bias = (_f64(a) for a in (x, weights, w13, w2, w13_bias, w2_bias))
    ids = to_numpy(ids)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - start
            if int(ids[t, j]) < 0 or not 0 <= e < e_local:
                continue
            on_input = config.apply_router_weight_on_input and j < config.topk
            h = (float(weights[t, j]) * x[t] if on_input else x[t]) @ w13[e].T
            if w13_bias is not None:
                h = h + w13_bias[e]
            g, u = split_gate_up(h[None], config.gate_up_layout)
            y = gated(config.activation, g, u)[0] @ w2[e].T
            if w2_bias is not None:
                y = y + w2_bias[e]
            out[t] += (1.0 if on_input else float(weights[t, j])) * y
    return (out * config.combine_routed_scaling_factor).numpy()


#: ``fused_experts_decode`` under one ``jax.jit``: the reference's stage ops compiled as one program (run eagerly, each
#: of their jnp ops compiles on its own: ~6x the CPU time on a new shape).
_decode_jit = jax.jit(fused_experts_decode, static_argnames=("config", "implementation"))


def _both(x, weights, ids, w13, w2, config, **kw):
    """``(pallas_triton, reference)`` outputs of ``fused_experts_decode`` (the reference jitted)."""
    pt = fused_experts_decode(x, weights, ids, w13, w2, config, implementation="pallas_triton", **kw)
    ref = _decode_jit(x, weights, ids, w13, w2, config=config, implementation="reference", **kw)
    return pt, ref


def _distinct_ids(rng, T: int, k: int, E: int) -> np.ndarray:
    return np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)


# --------------------------------------------------------------------------------------------- against the reference

#: T -> ids over E = 8 experts, top-2: ragged experts (1 to 4 slots), empty experts (5, 7 at T = 7), a -1 id.
ROUTINGS = {
    1: [[5, 2]],
    2: [[3, 0], [0, 6]],
    3: [[1, 4], [4, -1], [1, 2]],
    7: [[0, 3], [3, 0], [3, 6], [2, 3], [0, 1], [6, 4], [3, 2]],
}


_quantize_jit = jax.jit(quantize_layer_weights, static_argnames=("config",))


def _fp8_weights(config: MoEConfig, w13, w2):
    """``dict(w13=, w13_scale=, w2=, w2_scale=)``: float weights quantized as the layer quantizes them
    (``quantize_layer_weights``: per-channel scales for fp8_per_token, 128x128 blocks for fp8_block)."""
    w13q, s13, w2q, s2 = _quantize_jit(w13.astype(jnp.float32), w2.astype(jnp.float32), config=config)
    return dict(w13=w13q, w13_scale=s13, w2=w2q, w2_scale=s2)


@functools.partial(jax.jit, static_argnames=("config",))
def _reference_and_staged(x, weights, ids, w13, w2, config: MoEConfig, **kw) -> tuple[jax.Array, jax.Array]:
    """``(reference, staged)``: ``fused_experts_decode``'s reference, and the staged layer's ``routed_experts``
    (stage references) on the same inputs, the combine's weights and the input scale split from the given weights
    as the layer's ``slot_weights`` does; one jitted program (one compile)."""
    ref = fused_experts_decode(x, weights, ids, w13, w2, config, implementation="reference", **kw)
    combine_weights, input_scale = slot_weights(weights, None, config.replace(shared_expert_gate=False))
    start, e_local = config.local_expert_range()
    staged = routed_experts(x, combine_weights, ids, w13, w2, config, implementation="reference",
                            num_experts=config.num_total_experts, expert_start=start, num_local_experts=e_local,
                            routed_scaling_factor=config.combine_routed_scaling_factor, out_dtype=x.dtype,
                            input_scale=input_scale, **kw)
    return ref, staged


#: (T, dtype, quant, settings): each routing once per float dtype; FP8 at T = 1 and T = 3 (ragged experts, empty
#: ones, a -1 id), fp8_per_token once with the routing weight on the input, fp8_block once on gpt-oss's interleaved
#: rows with biases (two 128-row weight-scale blocks a program).
MATCH_CASES = [(1, "float32", "none", {}), (2, "bfloat16", "none", {}), (3, "float32", "none", {}),
               (7, "bfloat16", "none", {}), (1, "bfloat16", "fp8_per_token", {}),
               (3, "float32", "fp8_per_token", dict(apply_router_weight_on_input=True)),
               (1, "float32", "fp8_block", {}), (3, "bfloat16", "fp8_block", GPT_OSS)]


@pytest.mark.parametrize("T,dtype,quant,settings", MATCH_CASES,
                         ids=[f"{T}-{d}-{q}{'-' + '-'.join(o) if o else ''}" for T, d, q, o in MATCH_CASES])
def test_matches_reference(T, dtype, quant, settings):
    H, I = (128, 128) if quant == "fp8_block" else (48, 24)
    config = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=8, topk=2, quant=quant, **settings)
    x, w, ids, w13, w2, biases = _inputs(config, np.array(ROUTINGS[T], np.int32), dtype, seed=T)
    if quant == "none":
        pt, ref = _both(x, w, ids, w13, w2, config)
        assert pt.dtype == x.dtype and pt.shape == x.shape
        assert_rel_fro(pt, ref, LIMITS[dtype], f"pallas_triton vs reference T={T} {dtype}")
        assert_rel_fro(pt, _float64_loop(x, w, ids, w13, w2, config), LIMITS[dtype], "pallas_triton vs float64")
        return
    weights = _fp8_weights(config, w13, w2)
    pt = fused_experts_decode(x, w, ids, config=config, implementation="pallas_triton", **weights, **biases)
    ref, staged = _reference_and_staged(x, w, ids, config=config, **weights, **biases)
    assert pt.dtype == x.dtype and pt.shape == x.shape
    assert_rel_fro(pt, ref, FP8_REL_FRO, f"pallas_triton vs reference T={T} {dtype} {quant}")
    assert_exact(ref, staged, "reference vs the staged layer")


@pytest.mark.parametrize("case", ["one_expert", "non_local", "int64_ids"])
def test_routing_edges(case):
    """Every token on one expert (its w13 read by one program per column block), ids of -1 / out of range / of
    the other EP rank (a token with no local slot gets exactly 0), int64 ids (with x64 on: an id of 2**32 + 1 is
    out of range, not expert 1, as it would be if the ids were cut to int32 before the shift)."""
    rng = np.random.default_rng(1)
    if case == "one_expert":
        config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=4, topk=2)
        ids = np.stack([np.full(7, 2), rng.choice([0, 1, 3], 7)], axis=1).astype(np.int32)
    elif case == "non_local":  # rank 1 of 2 owns experts 4..7
        config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=8, topk=2, ep_size=2, ep_rank=1)
        ids = np.array([[5, 1], [0, 2], [-1, 7], [4, 9], [6, 5]], np.int32)
    else:
        config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=4, topk=3)
        ids = _distinct_ids(rng, 3, 3, 4).astype(np.int64)
        ids[1, 2] = -1
        ids[2, 0] = 2**32 + 1
    with jax.enable_x64(case == "int64_ids"):
        x, w, ids_j, w13, w2, _ = _inputs(config, ids, "float32")
        assert ids_j.dtype == ids.dtype
        pt, ref = _both(x, w, ids_j, w13, w2, config)
    assert_rel_fro(pt, ref, F32_REL_FRO, case)
    assert_rel_fro(pt, _float64_loop(x, w, ids, w13, w2, config), F32_REL_FRO, case)
    if case == "non_local":
        assert_exact(pt[1], jnp.zeros_like(pt[1]), "token with no local slot")


def test_row_blocks():
    """An expert with more slots than one row block (17 > block_m = 16: two row blocks, the second of one row),
    on the launcher with explicit configs (one K step and one I step short of H and I: the loops' tails)."""
    config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=4, topk=2)
    ids = np.array([[1, 1]] * 8 + [[1, 0]], np.int32)  # expert 1 in both slots of 8 tokens (ids need not be distinct)
    x, w, ids_j, w13, w2, _ = _inputs(config, ids, "float32")
    cfg_a = DecodeGateUpConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=1)
    cfg_b = DecodeDownConfig(block_h=32, block_i=16, num_warps=4, num_stages=1)
    out = decode_pt.fused_experts_decode_pallas_triton(x, w, ids_j, w13, w2, config, gate_up_config=cfg_a,
                                                       down_config=cfg_b)
    ref = _decode_jit(x, w, ids_j, w13, w2, config=config, implementation="reference")
    assert_rel_fro(out, ref, F32_REL_FRO, "two row blocks")


def test_prelude():
    """The prelude's metadata: the reached experts in id order (then unreached ones with count 0), each with its
    slots in slot order; non-local slots (-1, another rank's, out of range) last and of expert -1."""
    ids = jnp.asarray(np.array([[6, 4], [-1, 4], [9, 5], [4, 1]], np.int32))
    se, perm, pe, ps, pc = decode_pt.expert_slots(ids, expert_start=4, e_local=4)  # experts 4..7
    assert_exact(se, np.array([2, 0, -1, 0, -1, 1, 0, -1], np.int32), "slot_expert")
    assert_exact(perm, np.array([1, 3, 6, 5, 0, 2, 4, 7], np.int32), "perm")
    assert_exact(pe[:3], np.array([0, 1, 2], np.int32), "reached experts")
    assert_exact(ps[:3], np.array([0, 3, 4], np.int32), "starts")
    assert_exact(pc, np.array([3, 1, 1, 0], np.int32), "counts")


@pytest.mark.parametrize("bias_dtype", ["float32", "bfloat16"])
def test_gpt_oss_biases(bias_dtype):
    """gpt-oss: swiglu_oai on interleaved gate/up rows, both biases (float32 or bf16), bf16 activations; values large
    enough that the clamps (g > 7, |u| > 7) are hit."""
    config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=4, topk=2, **GPT_OSS)
    ids = np.array([[0, 3], [3, 1], [2, 3]], np.int32)
    x, w, ids_j, w13, w2, biases = _inputs(config, ids, "bfloat16", bias_dtype=bias_dtype)
    x = (x * 6).astype(jnp.bfloat16)  # |h| up to ~20: both clamps of swiglu_oai bite
    pt, ref = _both(x, w, ids_j, w13, w2, config, **biases)
    assert_rel_fro(pt, ref, BF16_REL_FRO, "gpt-oss pallas_triton vs reference")
    assert_rel_fro(pt, _float64_loop(x, w, ids_j, w13, w2, config, **biases), BF16_REL_FRO, "gpt-oss vs float64")


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "swiglu_oai"])
def test_activations_float32(activation):
    """Each activation on its layout's rows (interleaved for swiglu_oai), float32: tight."""
    layout = "interleaved" if activation == "swiglu_oai" else "concatenated"
    config = MoEConfig(hidden_size=32, intermediate_size=24, num_experts=4, topk=2, activation=activation,
                       gate_up_layout=layout)
    x, w, ids, w13, w2, _ = _inputs(config, np.array([[1, 2], [2, 0]], np.int32), "float32", seed=3)
    pt, ref = _both(x, w, ids, w13, w2, config)
    assert_rel_fro(pt, ref, F32_REL_FRO, activation)


@pytest.mark.parametrize("on_input", [False, True])
def test_shared_expert_rsf_fp16(on_input):
    """A fused shared expert (id E, in every token's last slot) with rsf = 2.5 applied by the combine, float16; and
    with Llama 4's ``apply_router_weight_on_input`` (the routed slots' weights scale their inputs, rounded once to
    float16, and the combine weighs them 1; the shared slot keeps its weight), also against the staged layer."""
    config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=4, topk=2, num_fused_shared_experts=1,
                       routed_scaling_factor=2.5, apply_router_weight_on_input=on_input)
    assert config.combine_routed_scaling_factor == 2.5
    ids = np.array([[1, 3, 4], [0, 1, 4]], np.int32)
    x, w, ids_j, w13, w2, _ = _inputs(config, ids, "float16")
    pt = fused_experts_decode(x, w, ids_j, w13, w2, config, implementation="pallas_triton")
    ref, staged = _reference_and_staged(x, w, ids_j, w13, w2, config=config)
    assert_rel_fro(pt, ref, BF16_REL_FRO, "shared + rsf")
    assert_rel_fro(pt, _float64_loop(x, w, ids_j, w13, w2, config), BF16_REL_FRO, "shared + rsf vs float64")
    assert_exact(ref, staged, "reference vs the staged layer")


@pytest.mark.parametrize("quant,dtype", [("mxfp4", "bfloat16"), ("int4", "bfloat16"), ("mxfp4", "float32")])
def test_4bit_weights(quant, dtype):
    """4-bit expert weights (CONTRACT.md section 9) with gpt-oss's activation, layout and biases: the kernels
    decode the packed codes with the grouped GEMM's own helper (``_w4_step_part``), so they agree with the staged
    reference; and with the float64 loop on the dequantized weights."""
    config = MoEConfig(hidden_size=64, intermediate_size=32, num_experts=4, topk=2, quant=quant, **GPT_OSS)
    ids = np.array([[2, 0], [2, -1], [3, 2]], np.int32)
    x, w, ids_j, w13f, w2f, biases = _inputs(config, ids, dtype)
    w13, s13, w2, s2 = quantize_layer_weights(w13f.astype(jnp.float32), w2f.astype(jnp.float32), config)
    kw = dict(w13_scale=s13, w2_scale=s2, **biases)
    pt, ref = _both(x, w, ids_j, w13, w2, config, **kw)
    assert_rel_fro(pt, ref, LIMITS[dtype], f"{quant} pallas_triton vs reference")
    dequantize = getattr(moe_pallas, f"dequantize_weight_{quant}")
    wd13, wd2 = dequantize(w13, s13, out_dtype=jnp.float32), dequantize(w2, s2, out_dtype=jnp.float32)
    assert_rel_fro(pt, _float64_loop(x, w, ids_j, wd13, wd2, config, **biases), LIMITS[dtype], f"{quant} vs float64")


@pytest.mark.parametrize("quant", ["none", "fp8_block"])
def test_deterministic_and_jit_replay(quant):
    """Two runs of the kernels give bit-identical outputs (no atomics; fixed loop orders); and, where torch
    replays a CUDA graph, one ``jax.jit`` program (traced once: no host sync, shape-only grids) run again on new
    ids and inputs gives bit for bit what a fresh call gives on them. FP8: the prelude's quantization of x and
    kernel A's of the activation (codes and scales scattered to their slots) inside the replayed program."""
    H, I = (128, 128) if quant == "fp8_block" else (48, 24)
    config = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=8, topk=2, quant=quant, **GPT_OSS)
    x, w, ids, w13, w2, biases = _inputs(config, np.array(ROUTINGS[7], np.int32), "bfloat16")
    scales = {}
    if quant != "none":
        weights = _fp8_weights(config, w13, w2)
        w13, w2 = weights.pop("w13"), weights.pop("w2")
        scales = weights
    run = functools.partial(fused_experts_decode, config=config, implementation="pallas_triton", **scales)
    first = run(x, w, ids, w13, w2, **biases)
    assert_exact(first, run(x, w, ids, w13, w2, **biases), "rerun")
    traces = []

    def step(x, w, ids, w13, w2, b13, b2):
        traces.append(1)
        return run(x, w, ids, w13, w2, w13_bias=b13, w2_bias=b2)

    jitted = jax.jit(step)
    assert_exact(jitted(x, w, ids, w13, w2, biases["w13_bias"], biases["w2_bias"]), first, "jit vs eager")
    x2, w_new, ids2, *_ = _inputs(config, _distinct_ids(np.random.default_rng(9), 7, 2, 8), "bfloat16", seed=9)
    replay = jitted(x2, w_new, ids2, w13, w2, biases["w13_bias"], biases["w2_bias"])
    assert len(traces) == 1, "the jitted program was traced again"
    assert_exact(replay, run(x2, w_new, ids2, w13, w2, **biases), "jit replay vs eager")


@pytest.mark.parametrize("quant", ["fp8_per_token", "fp8_block"])
def test_fp8_activation_codes_exact(quant):
    """The activation's FP8 codes and scales are the staged ``act_and_mul``'s bit for bit. On exact data GEMM 1 has
    no rounding (integer x with a +-448 in each row or 1x128 group: x's scale is exactly 1 and its codes are x;
    small integer weight codes with power-of-two scales), so ``h`` is the same in both; ``w2`` picks one column of
    ``a`` for each output column (scale 1; fp8_block: the first half of H from a's first group, the second from its
    second) and each token has one local slot of weight 1, so ``out[t, h]`` is ``q_a[i] * scale_a`` rounded once,
    the same in both unless a code or a scale differs (one term: no sum whose order or fused multiply-adds could
    differ). Kernel B's I loop in chunks (a per-token amax over several, with a tail), per-expert ``w2`` scales
    beside per-channel ``w13`` ones."""
    rng = np.random.default_rng(5)
    H, I = (128, 256) if quant == "fp8_block" else (48, 40)
    config = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=4, topk=2, quant=quant)
    T = 3
    x = rng.integers(-8, 9, (T, H)).astype(np.float32)
    group = 128 if quant == "fp8_block" else H
    for g0 in range(0, H, group):
        x[np.arange(T), g0 + rng.integers(0, group, T)] = 448.0 * rng.choice([-1.0, 1.0], T)
    f8 = jnp.float8_e4m3fn
    w13 = jnp.asarray(rng.integers(-2, 3, (4, 2 * I, H)).astype(np.float32)).astype(f8)
    cols = np.arange(H)
    pick = np.where(cols < H // 2, cols, cols + I - H) if I > H else cols  # the column of a each output takes
    eye = np.zeros((4, H, I), np.float32)
    eye[:, cols[pick < I], pick[pick < I]] = 1.0
    w2 = jnp.asarray(eye).astype(f8)
    if quant == "fp8_block":
        s13 = np.exp2(-rng.integers(6, 9, (4, 2 * I // 128, H // 128))).astype(np.float32)
        s2 = np.ones((4, H // 128, I // 128), np.float32)
    else:
        s13, s2 = np.exp2(-rng.integers(6, 9, (4, 2 * I))).astype(np.float32), np.ones((4,), np.float32)
    ids = jnp.asarray(np.array([[1, -1], [3, -1], [1, -1]], np.int32))
    args = (jnp.asarray(x), jnp.ones((T, 2), jnp.float32), ids, w13, w2, config)
    kw = dict(w13_scale=jnp.asarray(s13), w2_scale=jnp.asarray(s2))
    down = DecodeDownConfig(block_h=64, block_i=64 if quant == "fp8_block" else 16)  # several I chunks a slot
    out = decode_pt.fused_experts_decode_pallas_triton(*args, **kw, down_config=down)
    ref = _decode_jit(*args[:5], config=config, **kw, implementation="reference")
    assert np.count_nonzero(to_numpy(ref)) > T * min(H, I) // 2  # the activations reach the output
    assert_exact(out, ref, f"{quant}: q_a * scale_a")


def test_defaults_and_empty():
    """``implementation=None`` on the CPU is the reference; ``T = 0`` gives ``[0, H]``; the constant exists."""
    assert DECODE_MAX_TOKENS == 64
    config = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, topk=2)
    x, w, ids, w13, w2, _ = _inputs(config, np.array([[0, 1]], np.int32), "float32")
    if ON_CPU:
        assert_exact(fused_experts_decode(x, w, ids, w13, w2, config),
                     fused_experts_decode(x, w, ids, w13, w2, config, implementation="reference"), "default")
    for impl in ("pallas_triton", "reference"):
        out = fused_experts_decode(x[:0], w[:0], ids[:0], w13, w2, config, implementation=impl)
        assert out.shape == (0, 32) and out.dtype == x.dtype


# --------------------------------------------------------------------------------------------------- host errors


def test_host_errors(monkeypatch):
    config = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, topk=2)
    x, w, ids, w13, w2, _ = _inputs(config, np.array([[0, 1], [2, 3]], np.int32), "float32")
    op = "fused_experts_decode"
    launched = []
    monkeypatch.setattr(decode_pt, "expert_slots", lambda *a: launched.append(1))  # nothing may get this far

    def call(*args, config=config, **kw):
        base = dict(zip(("x", "topk_weights", "topk_ids", "w13", "w2"), (x, w, ids, w13, w2)))
        base.update(kw)
        impl = base.pop("implementation", "pallas_triton")
        return fused_experts_decode(*base.values(), config, implementation=impl)

    with pytest.raises(ValueError, match=rf"{op}: x must be \[T, H\] with H=32; got x.shape=\(2, 16\)"):
        call(x=x[:, :16])
    with pytest.raises(ValueError, match=rf"{op}: topk_ids must be \[T, topk \+ S\] = \(2, 2\) .*; got topk_ids.shape"):
        call(topk_ids=ids[:, :1])
    with pytest.raises(TypeError, match=rf"{op}: topk_ids must have dtype int32 or int64; got topk_ids.dtype=float32"):
        call(topk_ids=ids.astype(jnp.float32))
    with pytest.raises(TypeError, match=rf"{op}: topk_weights must have dtype float32; got topk_weights.dtype=bfloat16"):
        call(topk_weights=w.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=rf"{op}: w13 must be \[E_local, 2\*I, H\] = \(4, 32, 32\)"):
        call(w13=w13[:, :16])
    with pytest.raises(TypeError, match=rf"{op}: w2 must have dtype float32 .*; got w2.dtype=bfloat16"):
        call(w2=w2.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match=rf"{op}: config must be a MoEConfig"):
        fused_experts_decode(x, w, ids, w13, w2, {"hidden_size": 32})
    with pytest.raises(TypeError, match=rf"{op}: x must be a jax array .*; got torch.Tensor"):
        fused_experts_decode(torch.zeros(2, 32), w, ids, w13, w2, config)
    with pytest.raises(ValueError, match=rf"{op}: implementation must be one of"):
        call(implementation="triton")
    with pytest.raises(ValueError, match=rf"{op}: w13_bias must be None unless config.expert_bias=True"):
        fused_experts_decode(x, w, ids, w13, w2, config, w13_bias=jnp.zeros((4, 32)))
    biased = config.replace(expert_bias=True)
    with pytest.raises(ValueError, match=rf"{op}: w13_bias \[E_local, 2\*I\] = \(4, 32\) .* must be given"):
        fused_experts_decode(x, w, ids, w13, w2, biased, w2_bias=jnp.zeros((4, 32)))
    # FP8: codes with their scales, of the layout the mode takes
    fp8 = config.replace(quant="fp8_per_token")
    with pytest.raises(TypeError, match=rf"{op}: w13 must have dtype float8_e4m3fn; got w13.dtype=float32"):
        call(config=fp8)
    w13q, w2q = w13.astype(jnp.float8_e4m3fn), w2.astype(jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=rf"{op}: w13_scale must be given for quant='fp8_per_token'; got None"):
        call(config=fp8, w13=w13q, w2=w2q)
    with pytest.raises(ValueError, match=rf"{op}: w2_scale must be per-expert \[E_local\] or per-channel"):
        fused_experts_decode(x, w, ids, w13q, w2q, fp8, w13_scale=jnp.ones((4,)), w2_scale=jnp.ones((4, 1, 1)))
    block = MoEConfig(hidden_size=128, intermediate_size=128, num_experts=4, topk=2, quant="fp8_block")
    xb, _, _, w13b, w2b, _ = _inputs(block, np.array([[0, 1], [2, 3]], np.int32), "float32")
    wb = _fp8_weights(block, w13b, w2b)
    one_group = rf"block_n == 128 and block_k, block_h, block_i <= 128 \(quant='fp8_block'\)"
    with pytest.raises(ValueError, match=rf"{op}: configs must have .* {one_group}; got .*block_n=64"):
        decode_pt.fused_experts_decode_pallas_triton(
            xb, w, ids, config=block, **wb, gate_up_config=DecodeGateUpConfig(block_m=16, block_n=64, block_k=128))
    bad = DecodeGateUpConfig(block_m=8, block_n=16, block_k=16)
    with pytest.raises(ValueError, match=rf"{op}: configs must have block_m, block_n >= 16"):
        decode_pt.fused_experts_decode_pallas_triton(x, w, ids, w13, w2, config, gate_up_config=bad,
                                                     down_config=DecodeDownConfig(block_h=16, block_i=16))
    with pytest.raises(ValueError, match=r"DecodeDownConfig: block_h must be a power-of-2 int >= 1 .*; got block_h=48"):
        DecodeDownConfig(block_h=48, block_i=16)
    with pytest.raises(ValueError, match=rf"{op}: configs .*block_h, block_i >= 16 \(kernel B's dot: 16-bit"):
        decode_pt.check_decode_configs(op, DecodeGateUpConfig(block_m=16, block_n=16, block_k=16),
                                       DecodeDownConfig(block_h=8, block_i=16), False, dot=True)
    # no backward (an inference path): a derivative through it names the input
    loss = lambda w13_: call(w13=w13_, implementation="reference").sum()  # noqa: E731
    with pytest.raises(RuntimeError, match=rf"{op}: not differentiable .*; got a derivative with respect to w13"):
        jax.grad(loss)(w13)
    assert not launched


# ----------------------------------------------------------------------------------- lowered for CUDA (on the CPU)

H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "cuda"))


@pytest.mark.parametrize("quant", ["none", "mxfp4", "fp8_per_token", "fp8_block"])
def test_lowers_for_cuda(quant):
    """Both kernels lower to Triton for CUDA at a production size (gpt-oss's H = I = 2880 over 32 local experts,
    T = 16 of top-4, bf16 activations, the default configs): 16-bit weights, and mxfp4 with swiglu_oai,
    interleaved rows and biases, decoded by the grouped GEMM's packed PTX; FP8 at DeepSeek-V3's H = 7168,
    I = 2048 (per-channel scales; 128x128 blocks with gpt-oss's interleaved rows and biases), the activation
    quantized with the kernels' division (``div.rn.f32`` by default)."""
    S = jax.ShapeDtypeStruct
    fp8 = quant.startswith("fp8")
    extra = GPT_OSS if quant in ("mxfp4", "fp8_block") else {}
    T, k, H, I, E = (16, 4, 7168, 2048, 32) if fp8 else (16, 4, 2880, 2880, 32)
    config = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, topk=k, quant=quant, **extra)
    w4 = quant == "mxfp4"
    wdt = jnp.uint8 if w4 else jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    args = [S((T, H), jnp.bfloat16), S((T, k), jnp.float32), S((T, k), jnp.int32),
            S((E, 2 * I, H // 2 if w4 else H), wdt), S((E, H, I // 2 if w4 else I), wdt)]
    kw = {}
    if config.expert_bias:
        kw = dict(w13_bias=S((E, 2 * I), jnp.float32), w2_bias=S((E, H), jnp.float32))
    if w4:
        kw.update(w13_scale=S((E, 2 * I, H // 32), jnp.uint8), w2_scale=S((E, H, I // 32), jnp.uint8))
    elif quant == "fp8_per_token":
        kw.update(w13_scale=S((E, 2 * I), jnp.float32), w2_scale=S((E, H), jnp.float32))
    elif quant == "fp8_block":
        kw.update(w13_scale=S((E, 2 * I // 128, H // 128), jnp.float32),
                  w2_scale=S((E, H // 128, I // 128), jnp.float32))

    def f(*args, **kw):
        return decode_pt.fused_experts_decode_pallas_triton(*args, config, **kw, interpret=False)

    with use_abstract_mesh(H200):
        text = jax.jit(f).trace(*args, **kw).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2, text[:2000]
    assert ("fma.rn.bf16x2" in text) == w4  # the packed decode (moe_contract/w4_packed_asm.py)
    assert ("div.rn.f32" in text) == (fp8 and kernel_div_rn(False))  # the FP8 division (quant/pallas_triton.py)
