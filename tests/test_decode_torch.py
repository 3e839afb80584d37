"""The torch decode path (``moe_torch/ops/decode``): ``fused_experts_decode``'s two Triton kernels against its
reference (the staged layer's stage references composed) and a float64 per-slot loop, CONTRACT.md sections 4, 5,
7 and 9.

Routings: T = 1, 2, 3, 7 with ragged and empty experts, every token on one expert, ``-1`` ids, another EP rank's
experts, a token with no local slot, an expert with more slots than one row block; float32 (``F32_REL_FRO``) and
bf16 / fp16 (``BF16_REL_FRO``); gpt-oss's biases with ``swiglu_oai`` on interleaved gate/up rows; a fused shared
expert with rsf in the combine; 4-bit weights (mxfp4, int4); FP8 weights (per-token x per-expert / per-channel
scales, 1 x 128 x 128 x 128 blocks: ``FP8_REL_FRO``, the reference equal to ``routed_experts``); Llama 4's routing
weight on the expert input (the reference equal to ``moe_forward``); bit-identical reruns; the host-side errors.

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, ``conftest.py``; made exact by
``moe_torch/ops/triton_interpret.py``). Shapes are tiny: H = 48 / 64, I = 24 / 32 (K tails in both GEMMs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common import TORCH_DEVICE, needs_triton_interpreter
from moe_contract import MoEConfig
from moe_torch.layer import moe_forward, quantize_layer_weights, routed_experts, run_gate
from moe_torch.ops.activation.reference import gated, split_gate_up
from moe_torch.ops.decode import DECODE_MAX_TOKENS, fused_experts_decode
from moe_torch.ops.decode import triton as decode_triton
from moe_torch.ops.decode.config import DecodeDownConfig, DecodeGateUpConfig, decode_down_config
from moe_torch.ops.quant.api import quantize_weight_fp8
from moe_torch.ops.quant.reference import dequantize_weight_4bit_reference
from moe_torch.slot_weights import slot_weights
from tolerances import BF16_REL_FRO, F32_REL_FRO, FP8_REL_FRO, assert_exact, assert_rel_fro

# On the CPU the kernels need the interpreter; on a GPU (EPMOE_TEST_DEVICE=gpu) they compile.
pytestmark = needs_triton_interpreter if TORCH_DEVICE == "cpu" else []

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LIMITS = {"float32": F32_REL_FRO, "bfloat16": BF16_REL_FRO, "float16": BF16_REL_FRO}
#: gpt-oss's expert settings: swiglu_oai on interleaved gate/up rows, per-expert biases on both projections.
GPT_OSS = dict(activation="swiglu_oai", gate_up_layout="interleaved", expert_bias=True)


def _inputs(config: MoEConfig, ids: np.ndarray, dtype: str, seed: int = 0, bias_dtype: str = "float32"):
    """``(x, topk_weights, topk_ids, w13, w2, biases)`` on the test device for ``config`` and the given ids
    (biases ``{}`` unless ``config.expert_bias``). Weights scaled so that ``h`` and ``y`` are O(1)."""
    rng = np.random.default_rng(seed)
    H, I = config.hidden_size, config.intermediate_size
    _, e_local = config.local_expert_range()
    T, k = ids.shape
    dt = DTYPES[dtype]

    def t(shape, scale, d=dt):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale).to(TORCH_DEVICE, d)

    x = t((T, H), 1.0)
    weights = torch.from_numpy(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)).to(TORCH_DEVICE)
    w13, w2 = t((e_local, 2 * I, H), H ** -0.5), t((e_local, H, I), I ** -0.5)
    biases = {}
    if config.expert_bias:
        biases = dict(w13_bias=t((e_local, 2 * I), 0.5, DTYPES[bias_dtype]), w2_bias=t((e_local, H), 0.5, DTYPES[bias_dtype]))
    return x, weights, torch.from_numpy(ids).to(TORCH_DEVICE), w13, w2, biases


def _float64_loop(x, weights, ids, w13, w2, config: MoEConfig, w13_bias=None, w2_bias=None) -> torch.Tensor:
    """``sum_j w[t, j] * expert(x[t])`` in float64 with no intermediate rounding, slot by slot (the judge of
    CONTRACT.md section 7's float64 rows); ``w13`` / ``w2`` float (dequantized for 4-bit)."""
    start, e_local = config.local_expert_range()
    x, weights, ids, w13, w2, w13_bias, w2_bias = (None if t is None else t.cpu()
                                                   for t in (x, weights, ids, w13, w2, w13_bias, w2_bias))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - start
            if int(ids[t, j]) < 0 or not 0 <= e < e_local:
                continue
            h = x[t].double() @ w13[e].double().T
            if w13_bias is not None:
                h = h + w13_bias[e].double()
            g, u = split_gate_up(h[None], config.gate_up_layout)
            y = gated(config.activation, g, u)[0] @ w2[e].double().T
            if w2_bias is not None:
                y = y + w2_bias[e].double()
            out[t] += float(weights[t, j]) * y
    return out * config.combine_routed_scaling_factor


def _both(x, weights, ids, w13, w2, config, **kw):
    """``(triton, reference)`` outputs of ``fused_experts_decode``."""
    tri = fused_experts_decode(x, weights, ids, w13, w2, config, implementation="triton", **kw)
    ref = fused_experts_decode(x, weights, ids, w13, w2, config, implementation="reference", **kw)
    return tri, ref


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T", sorted(ROUTINGS))
def test_matches_reference(T, dtype):
    config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=8, topk=2)
    x, w, ids, w13, w2, _ = _inputs(config, np.array(ROUTINGS[T], np.int32), dtype, seed=T)
    tri, ref = _both(x, w, ids, w13, w2, config)
    assert tri.dtype == x.dtype and tri.shape == x.shape
    assert_rel_fro(tri, ref, LIMITS[dtype], f"triton vs reference T={T} {dtype}")
    assert_rel_fro(tri, _float64_loop(x, w, ids, w13, w2, config), LIMITS[dtype], "triton vs float64")


@pytest.mark.parametrize("case", ["one_expert", "non_local", "int64_ids"])
def test_routing_edges(case):
    """Every token on one expert (its w13 read by one program per column block), ids of -1 / out of range / of
    the other EP rank (a token with no local slot gets exactly 0), int64 ids."""
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
    x, w, ids_t, w13, w2, _ = _inputs(config, ids, "float32")
    tri, ref = _both(x, w, ids_t, w13, w2, config)
    assert_rel_fro(tri, ref, F32_REL_FRO, case)
    assert_rel_fro(tri, _float64_loop(x, w, ids_t, w13, w2, config), F32_REL_FRO, case)
    if case == "non_local":
        assert_exact(tri[1], torch.zeros_like(tri[1]), "token with no local slot")


def test_row_blocks_and_count_chunks():
    """An expert with more slots than one row block (17 > block_m = 16: two row blocks), and the per-expert count
    over several chunks of ids (chunk_s = 4), on the launcher with explicit configs."""
    config = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, topk=2)
    ids = np.array([[1, 1]] * 8 + [[1, 0]], np.int32)  # expert 1 in both slots of 8 tokens (ids need not be distinct)
    x, w, ids_t, w13, w2, _ = _inputs(config, ids, "float32")
    cfg_a = DecodeGateUpConfig(block_m=16, block_n=16, block_k=16, chunk_s=4, num_warps=4, num_stages=1)
    out = decode_triton.fused_experts_decode_triton(x, w, ids_t, w13, w2, config, None, None, None, None, cfg_a,
                                                    decode_down_config(9, 32, 16, False))
    ref = fused_experts_decode(x, w, ids_t, w13, w2, config, implementation="reference")
    assert_rel_fro(out, ref, F32_REL_FRO, "two row blocks")


@pytest.mark.parametrize("bias_dtype", ["float32", "bfloat16"])
def test_gpt_oss_biases(bias_dtype):
    """gpt-oss: swiglu_oai on interleaved gate/up rows, both biases (float32 or bf16), bf16 activations; values large
    enough that the clamps (g > 7, |u| > 7) are hit."""
    config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=4, topk=2, **GPT_OSS)
    ids = np.array([[0, 3], [3, 1], [2, 3]], np.int32)
    x, w, ids_t, w13, w2, biases = _inputs(config, ids, "bfloat16", bias_dtype=bias_dtype)
    x = (x * 6).to(torch.bfloat16)  # |h| up to ~20: both clamps of swiglu_oai bite
    tri, ref = _both(x, w, ids_t, w13, w2, config, **biases)
    assert_rel_fro(tri, ref, BF16_REL_FRO, "gpt-oss triton vs reference")
    assert_rel_fro(tri, _float64_loop(x, w, ids_t, w13, w2, config, **biases), BF16_REL_FRO, "gpt-oss vs float64")


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "swiglu_oai"])
def test_activations_float32(activation):
    """Each activation on both layouts' worth of rows (interleaved for swiglu_oai), float32: tight."""
    layout = "interleaved" if activation == "swiglu_oai" else "concatenated"
    config = MoEConfig(hidden_size=32, intermediate_size=24, num_experts=4, topk=2, activation=activation,
                       gate_up_layout=layout)
    x, w, ids, w13, w2, _ = _inputs(config, np.array([[1, 2], [2, 0]], np.int32), "float32", seed=3)
    tri, ref = _both(x, w, ids, w13, w2, config)
    assert_rel_fro(tri, ref, F32_REL_FRO, activation)


def test_shared_expert_rsf_fp16():
    """A fused shared expert (id E, in every token's last slot) with rsf = 2.5 applied by the combine, float16."""
    config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=4, topk=2, num_fused_shared_experts=1,
                       routed_scaling_factor=2.5)
    ids = np.array([[1, 3, 4], [0, 1, 4]], np.int32)
    x, w, ids_t, w13, w2, _ = _inputs(config, ids, "float16")
    tri, ref = _both(x, w, ids_t, w13, w2, config)
    assert_rel_fro(tri, ref, BF16_REL_FRO, "shared + rsf")
    assert_rel_fro(tri, _float64_loop(x, w, ids_t, w13, w2, config), BF16_REL_FRO, "shared + rsf vs float64")


@pytest.mark.parametrize("quant,dtype", [("mxfp4", "bfloat16"), ("int4", "bfloat16"), ("mxfp4", "float32")])
def test_4bit_weights(quant, dtype):
    """4-bit expert weights (CONTRACT.md section 9) with gpt-oss's activation, layout and biases: the kernels
    decode the packed codes as the grouped GEMM does (``_w4_tiles``), so they agree with the staged reference; and
    with the float64 loop on the dequantized weights."""
    config = MoEConfig(hidden_size=64, intermediate_size=32, num_experts=4, topk=2, quant=quant, **GPT_OSS)
    ids = np.array([[2, 0], [2, -1], [3, 2]], np.int32)
    x, w, ids_t, w13f, w2f, biases = _inputs(config, ids, dtype)
    w13, s13, w2, s2 = quantize_layer_weights(w13f.float(), w2f.float(), config)
    kw = dict(w13_scale=s13, w2_scale=s2, **biases)
    tri, ref = _both(x, w, ids_t, w13, w2, config, **kw)
    assert_rel_fro(tri, ref, LIMITS[dtype], f"{quant} triton vs reference")
    wd13 = dequantize_weight_4bit_reference(w13, s13, quant, torch.float32)
    wd2 = dequantize_weight_4bit_reference(w2, s2, quant, torch.float32)
    assert_rel_fro(tri, _float64_loop(x, w, ids_t, wd13, wd2, config, **biases), LIMITS[dtype], f"{quant} vs float64")


def _spread(w: torch.Tensor, seed: int) -> torch.Tensor:
    """``w [E, N, K]`` times ``2^j``, ``j`` in ``[-2, 2]`` drawn per (expert, row, 128-wide K block): FP8 scales that
    differ by powers of 2 between experts, channels and blocks, so a scale applied to the wrong rows or K block
    shows far above ``FP8_REL_FRO``."""
    E, N, K = w.shape
    kb = -(-K // 128)
    j = np.random.default_rng(seed).integers(-2, 3, (E, N, kb)).astype(np.float32)
    factor = torch.from_numpy(np.repeat(2.0 ** j, 128, axis=2)[:, :, :K]).to(w.device)
    return w * factor


def _routed_experts(x, weights, ids, w13, w2, config: MoEConfig, **kw):
    """The staged layer's experts + combine (``moe_torch.layer.routed_experts``, reference stages) on the decode
    path's inputs: ``topk_weights`` split into combine weights and input scales as the layer's ``slot_weights``."""
    start, e_local = config.local_expert_range()
    combine_weights, input_scale = slot_weights(weights, None, config)
    return routed_experts(x, combine_weights, ids, w13, w2, config, implementation="reference",
                          num_experts=config.num_total_experts, expert_start=start, num_local_experts=e_local,
                          routed_scaling_factor=config.combine_routed_scaling_factor, out_dtype=x.dtype,
                          input_scale=input_scale, **kw)


#: (quant, T, dtype, H, I, scale layouts of w13 / w2): each FP8 mode at T = 1 (six empty experts) and T = 3 (ragged,
#: a -1 id). fp8_per_token at H = 48, I = 24: K tails in both kernels (kernel A's K step is 64, kernel B's 32),
#: per-expert and per-channel weight scales; fp8_block (multiples of 128) at H = I = 256 (two K blocks and four row
#: blocks of w13, two of each for w2) and at H = I = 128.
FP8_CASES = [("fp8_per_token", 1, "bfloat16", 48, 24, ("per_channel", "per_expert")),
             ("fp8_per_token", 3, "float32", 48, 24, ("per_expert", "per_channel")),
             ("fp8_block", 1, "float32", 256, 256, ("block", "block")),
             ("fp8_block", 3, "bfloat16", 128, 128, ("block", "block"))]


@pytest.mark.parametrize("quant,T,dtype,H,I,layouts", FP8_CASES)
def test_fp8_weights(quant, T, dtype, H, I, layouts):
    """FP8 weights (CONTRACT.md sections 3, 4): the kernels quantize x (per token over H, or 1 x 128 groups) and a
    (per token over I from its float32 value, or 1 x 128 groups) as the staged permute and act_and_mul do, and apply
    the scales as the grouped GEMM does: within the contract's FP8 row of the reference, which is the staged layer's
    ``routed_experts`` bit for bit; reruns bit-identical."""
    config = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=8, topk=2, quant=quant)
    x, w, ids, w13f, w2f, _ = _inputs(config, np.array(ROUTINGS[T], np.int32), dtype, seed=T)
    w13, s13 = quantize_weight_fp8(_spread(w13f.float(), 1), layouts[0])
    w2, s2 = quantize_weight_fp8(_spread(w2f.float(), 2), layouts[1])
    kw = dict(w13_scale=s13, w2_scale=s2)
    tri, ref = _both(x, w, ids, w13, w2, config, **kw)
    assert tri.dtype == x.dtype and tri.shape == x.shape
    assert_rel_fro(tri, ref, FP8_REL_FRO, f"{quant} triton vs reference T={T} {dtype}")
    assert_exact(ref, _routed_experts(x, w, ids, w13, w2, config, **kw), f"{quant} reference vs routed_experts")
    if T == 3:
        assert_exact(fused_experts_decode(x, w, ids, w13, w2, config, implementation="triton", **kw), tri, "rerun")


@pytest.mark.parametrize("quant", ["none", "fp8_per_token"])
def test_router_weight_on_input(quant):
    """Llama 4 (``apply_router_weight_on_input``, sigmoid top-1 and a fused shared expert, bf16): a routed slot's
    expert input is ``x[t] * w[t, j]`` rounded once to bf16 (FP8: the scaled row is what is quantized) and it
    combines with weight 1; the shared slot keeps ``x[t]`` and its weight. The reference on the gate's weights is
    ``moe_forward`` bit for bit."""
    config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=4, topk=1, routing="sigmoid_topk",
                       renormalize=False, num_fused_shared_experts=1, apply_router_weight_on_input=True,
                       quant=quant)
    x, _, _, w13f, w2f, _ = _inputs(config, np.zeros((3, 2), np.int32), "bfloat16", seed=5)
    logits = torch.from_numpy(np.random.default_rng(6).standard_normal((3, 4)).astype(np.float32)).to(TORCH_DEVICE)
    w13, s13, w2, s2 = quantize_layer_weights(w13f.float(), w2f.float(), config) if quant != "none" else \
        (w13f, None, w2f, None)
    w, ids = run_gate(logits, config, None, "reference")
    tri, ref = _both(x, w, ids, w13, w2, config, w13_scale=s13, w2_scale=s2)
    assert_rel_fro(tri, ref, BF16_REL_FRO if quant == "none" else FP8_REL_FRO, f"weight on input {quant}")
    layer = moe_forward(x, logits, w13, w2, config, w13_scale=s13, w2_scale=s2, implementation="reference")
    assert_exact(ref, layer, "reference vs moe_forward")


def test_deterministic():
    """Two runs of the kernels give bit-identical outputs (no atomics; fixed loop orders)."""
    config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=8, topk=2, **GPT_OSS)
    x, w, ids, w13, w2, biases = _inputs(config, np.array(ROUTINGS[7], np.int32), "bfloat16")
    first = fused_experts_decode(x, w, ids, w13, w2, config, implementation="triton", **biases)
    second = fused_experts_decode(x, w, ids, w13, w2, config, implementation="triton", **biases)
    assert_exact(first, second, "rerun")


def test_defaults_and_empty():
    """``implementation=None`` on CPU tensors is the reference; ``T = 0`` gives ``[0, H]``; the constant exists."""
    assert DECODE_MAX_TOKENS == 64
    config = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, topk=2)
    x, w, ids, w13, w2, _ = _inputs(config, np.array([[0, 1]], np.int32), "float32")
    if TORCH_DEVICE == "cpu":
        assert_exact(fused_experts_decode(x, w, ids, w13, w2, config),
                     fused_experts_decode(x, w, ids, w13, w2, config, implementation="reference"), "default")
    for impl in ("triton", "reference"):
        out = fused_experts_decode(x[:0], w[:0], ids[:0], w13, w2, config, implementation=impl)
        assert out.shape == (0, 32) and out.dtype == x.dtype


# --------------------------------------------------------------------------------------------------- host errors


def test_host_errors(monkeypatch):
    config = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, topk=2)
    x, w, ids, w13, w2, _ = _inputs(config, np.array([[0, 1], [2, 3]], np.int32), "float32")
    op = "fused_experts_decode"

    def call(*args, config=config, **kw):
        base = dict(zip(("x", "topk_weights", "topk_ids", "w13", "w2"), (x, w, ids, w13, w2)))
        base.update(kw)
        impl = base.pop("implementation", "triton")
        return fused_experts_decode(*base.values(), config, implementation=impl)

    with pytest.raises(ValueError, match=rf"{op}: x must be \[T, H\] with H=32; got x.shape=\(2, 16\)"):
        call(x=x[:, :16])
    with pytest.raises(ValueError, match=rf"{op}: topk_ids must be \[T, topk \+ S\] = \(2, 2\) .*; got topk_ids.shape"):
        call(topk_ids=ids[:, :1])
    with pytest.raises(TypeError, match=rf"{op}: topk_ids must have dtype int32 or int64; got topk_ids.dtype=float32"):
        call(topk_ids=ids.float())
    with pytest.raises(TypeError, match=rf"{op}: topk_weights must have dtype float32; got topk_weights.dtype=bfloat16"):
        call(topk_weights=w.bfloat16())
    with pytest.raises(ValueError, match=rf"{op}: w13 must be \[E_local, 2\*I, H\] = \(4, 32, 32\)"):
        call(w13=w13[:, :16])
    with pytest.raises(TypeError, match=rf"{op}: w2 must have dtype float32 .*; got w2.dtype=bfloat16"):
        call(w2=w2.bfloat16())
    with pytest.raises(TypeError, match=rf"{op}: config must be a MoEConfig"):
        fused_experts_decode(x, w, ids, w13, w2, {"hidden_size": 32})
    with pytest.raises(TypeError, match=rf"{op}: x must be a torch.Tensor"):
        fused_experts_decode(x.cpu().numpy(), w, ids, w13, w2, config)
    with pytest.raises(ValueError, match=rf"{op}: implementation must be one of"):
        call(implementation="pallas")
    with pytest.raises(ValueError, match=rf"{op}: w13_bias must be None unless config.expert_bias=True"):
        fused_experts_decode(x, w, ids, w13, w2, config, w13_bias=torch.zeros(4, 32))
    biased = config.replace(expert_bias=True)
    with pytest.raises(ValueError, match=rf"{op}: w13_bias \[E_local, 2\*I\] = \(4, 32\) .* must be given"):
        fused_experts_decode(x, w, ids, w13, w2, biased, w2_bias=torch.zeros(4, 32))
    with pytest.raises(ValueError, match=rf"{op}: topk_ids must be on x's device \({x.device}\); got topk_ids.device=meta"):
        call(topk_ids=torch.empty(ids.shape, dtype=ids.dtype, device="meta"))
    with pytest.raises(RuntimeError, match=rf"{op}: not differentiable .*; got w13 requiring grad with grad mode on"):
        call(w13=w13.clone().requires_grad_())
    with torch.no_grad():  # an inference call with trainable parameters is fine
        call(w13=w13.clone().requires_grad_(), implementation="reference")
    # FP8: codes with their scales, each mode's scale layout
    fp8 = config.replace(quant="fp8_per_token")
    with pytest.raises(TypeError, match=rf"{op}: w13 must have dtype float8_e4m3fn; got w13.dtype=float32"):
        call(config=fp8)
    w13_q, s13 = quantize_weight_fp8(w13, "per_channel")
    w2_q, s2 = quantize_weight_fp8(w2, "per_channel")
    with pytest.raises(ValueError, match=rf"{op}: w13_scale must be given for quant='fp8_per_token'; got None"):
        fused_experts_decode(x, w, ids, w13_q, w2_q, fp8, w2_scale=s2)
    with pytest.raises(ValueError, match=rf"{op}: w2_scale must be per-expert \[E_local\] or per-channel"):
        fused_experts_decode(x, w, ids, w13_q, w2_q, fp8, w13_scale=s13, w2_scale=s2[:, None, :1])
    bad = DecodeGateUpConfig(block_m=8, block_n=16, block_k=16, chunk_s=4, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match=rf"{op}: configs must have power-of-2 blocks, block_m, block_n >= 16"):
        decode_triton.fused_experts_decode_triton(x, w, ids, w13, w2, config, None, None, None, None, bad,
                                                  DecodeDownConfig(block_h=16, block_i=16, num_warps=4, num_stages=1))
    good = DecodeGateUpConfig(block_m=16, block_n=16, block_k=64, chunk_s=4, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match=rf"{op}: configs must .* block_k = block_i = 128 \(fp8_block: one scale"):
        decode_triton.check_decode_configs(op, good, DecodeDownConfig(block_h=16, block_i=128, num_warps=4,
                                                                      num_stages=1), False, "fp8_block")
    with pytest.raises(ValueError, match=rf"{op}: configs .*block_h, block_i >= 16 \(kernel B's dot: 16-bit"):
        decode_triton.check_decode_configs(op, good, DecodeDownConfig(block_h=8, block_i=16, num_warps=4,
                                                                      num_stages=1), False, dot=True)
    # the Triton kernels' own limits (the default dispatch falls back to the reference on a GPU)
    monkeypatch.setattr(decode_triton, "MAX_SLOTS", 3)
    with pytest.raises(NotImplementedError, match=rf"{op}: the Triton decode kernels take at most 3 assignments"):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["none", "mxfp4"])
@pytest.mark.parametrize("T", [1, 4, 8, 64])
def test_gpt_oss_sizes_default_configs(T, quant):
    """gpt-oss's expert sizes (H = I = 2880: a K tail in both GEMMs' last 128-wide step; interleaved rows, biases)
    over 8 experts, top-4, with the default configs: T = 4, 8, 64 make T * k divisible by 16, where a specialized
    ``S`` made Triton miscompile the slot scan's id loads (a misaligned address at gpt-oss-120b's T = 8, see
    test_gate_up_kernel_keeps_s_unspecialized); triton against the reference, and a synchronised rerun
    bit-identical."""
    config = MoEConfig(hidden_size=2880, intermediate_size=2880, num_experts=8, topk=4, quant=quant, **GPT_OSS)
    ids = _distinct_ids(np.random.default_rng(T), T, 4, 8)
    x, w, ids, w13, w2, biases = _inputs(config, ids, "bfloat16", bias_dtype="bfloat16")
    kw = dict(biases)
    if quant != "none":
        w13, s13, w2, s2 = quantize_layer_weights(w13, w2, config)
        kw.update(w13_scale=s13, w2_scale=s2)
    with torch.no_grad():
        out = fused_experts_decode(x, w, ids, w13, w2, config, implementation="triton", **kw)
        torch.cuda.synchronize()
        ref = fused_experts_decode(x, w, ids, w13, w2, config, implementation="reference", **kw)
        assert_rel_fro(out, ref, BF16_REL_FRO, f"triton vs reference T={T} {quant}")
        assert_exact(out, fused_experts_decode(x, w, ids, w13, w2, config, implementation="triton", **kw), "rerun")


def test_gate_up_kernel_keeps_s_unspecialized():
    """Kernel A's ``S`` (``T * k``) is never specialized on divisibility: with ``S % 16 == 0`` (gpt-oss-120b's
    128 experts, top-4, T = 8) Triton 3.6 vectorized the slot scan's id loads with a wrong per-thread index
    (sm_90 PTX; on the H100 a CUDA misaligned address, compute-sanitizer: 16-byte reads at 4-byte offsets past
    the ids)."""
    kernel = decode_triton._decode_gate_up_kernel  # a JITFunction, or under the interpreter its kwargs' holder
    names = kernel.kwargs["do_not_specialize"] if hasattr(kernel, "kwargs") else kernel.do_not_specialize
    assert "S" in names


@pytest.mark.gpu
def test_cuda_graph_replay():
    """The Triton path captured in a CUDA graph (no host sync, shape-only grids) and replayed on new ids and inputs
    written in place gives what an eager call gives on them."""
    config = MoEConfig(hidden_size=64, intermediate_size=32, num_experts=8, topk=2, **GPT_OSS)
    x, w, ids, w13, w2, biases = _inputs(config, np.array(ROUTINGS[7], np.int32), "bfloat16")
    run = lambda: fused_experts_decode(x, w, ids, w13, w2, config, implementation="triton", **biases)  # noqa: E731
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x2, w_new, ids2, *_ = _inputs(config, _distinct_ids(np.random.default_rng(9), 7, 2, 8), "bfloat16", seed=9)
    x.copy_(x2), w.copy_(w_new), ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    assert_exact(out, run(), "graph replay vs eager")


# ------------------------------------------------------------------------------- compiled for sm_90 (on the CPU)


def _sm90_jobs() -> dict:
    """Both kernels at production sizes (DeepSeek-V3's H and I over 32 local experts, T = 16 of top-8: bf16 weights,
    and FP8 128 x 128 blocks with the weight on the input (a float32 ``a``); gpt-oss's mxfp4 experts with
    swiglu_oai, interleaved rows and biases, e8m0 table), bf16 activations, the default configs."""
    from moe_torch.ops.decode.config import decode_gate_up_config

    def job(kernel, sig, constexprs, cfg):
        return {"module": "moe_torch.ops.decode.triton", "kernel": kernel, "signature": sig, "constexprs": constexprs,
                "options": {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}}

    jobs = {}
    for name, w, ws, b, a, code, act, inter, bias, lut, on_input in (
            ("bf16", "*bf16", "*bf16", "*bf16", "*bf16", 0, 0, False, False, False, False),
            ("mxfp4", "*u8", "*u8", "*fp32", "*bf16", 4, 2, True, True, True, False),
            ("fp8_block", "*fp8e4nv", "*fp32", "*bf16", "*fp32", 3, 0, False, False, False, True)):
        T, k, H, I, E = 16, 8, 7168, 2048, 32
        w4, fp8 = code in (4, 5), "fp8_block" if code == 3 else None
        a_cfg, b_cfg = decode_gate_up_config(T, k, H, I, E, w4, fp8=fp8), decode_down_config(T, H, I, w4, fp8=fp8)
        ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
        extra = {"e8m0_lut": "*bf16"} if lut else {}
        jobs[f"gate_up-{name}"] = job("_decode_gate_up_kernel", {
            "x_ptr": "*bf16", "ids_ptr": "*i32", "tw_ptr": "*fp32", "w_ptr": w, "ws_ptr": ws, "b_ptr": b, "a_ptr": a,
            **ints("S", "H", "I", "E_local", "expert_start", "stride_xt", "stride_we", "stride_wn", "stride_wse",
                   "stride_wsn", "stride_wsk", "stride_be", "stride_as"), **extra},
            dict(K_SLOTS=k, TOPK=k, ON_INPUT=on_input, ACTIVATION=act, INTERLEAVED=inter, HAS_BIAS=bias, W_SCALE=code,
                 IEEE_F32=False, BLOCK_E=E, CHUNK_S=a_cfg.chunk_s, NUM_CHUNKS=T * k // a_cfg.chunk_s,
                 NUM_M_BLOCKS=T * k // a_cfg.block_m, BLOCK_M=a_cfg.block_m, BLOCK_N=a_cfg.block_n,
                 BLOCK_K=a_cfg.block_k), a_cfg)
        jobs[f"down-{name}"] = job("_decode_down_kernel", {
            "a_ptr": a, "ids_ptr": "*i32", "tw_ptr": "*fp32", "w_ptr": w, "ws_ptr": ws, "b_ptr": b,
            "out_ptr": "*bf16", **ints("H", "I", "E_local", "expert_start"), "rsf": "fp32",
            **ints("stride_as", "stride_we", "stride_wn", "stride_wse", "stride_wsn", "stride_wsk", "stride_be",
                   "stride_ot"), **extra},
            dict(K_SLOTS=k, TOPK=k, ON_INPUT=on_input, HAS_BIAS=bias, APPLY_RSF=True, W_SCALE=code,
                 USE_DOT=fp8 is None, BLOCK_H=b_cfg.block_h, BLOCK_I=b_cfg.block_i), b_cfg)
    return jobs


@pytest.mark.skipif(TORCH_DEVICE != "cpu", reason="the GPU run compiles the kernels for its own device")
def test_kernels_compile_for_sm90():
    """Both kernels lower to sm_90 cubin (16-bit, mxfp4 and FP8-block weights), use the tensor cores (GEMM 2 too
    with 16-bit activations; the FP8 GEMV does not), no atomic (kernel B's sum is the combine, in registers: the determinism) and no local-memory spill; the FP8
    quantization is the exact division and the saturating round-to-nearest-even cast (CONTRACT.md section 3)."""
    import re

    from sm90 import compile_sm90

    ptx = compile_sm90(_sm90_jobs())
    for name, text in ptx.items():
        assert ".target sm_90" in text, name
        assert not re.search(r"\b(atom|red)\.", text), f"{name}: an atomic"
        assert ".local" not in text, f"{name}: a local-memory spill"
        assert ("mma" in text) == (name.startswith("gate_up") or not name.endswith("fp8_block")), name
        if name.endswith("fp8_block"):
            assert "div.rn.f32" in text and "cvt.rn.satfinite.e4m3x2.f32" in text, name


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_heuristics_fill_the_gpu_at_small_t(framework):
    """One gpt-oss token (H = I = 2880, top-4) must not leave SMs idle: kernel B's output tile narrows from 64 columns
    (45 programs) until there are two programs an SM, kernel A's columns likewise over the reached experts; at T = 64
    both keep their widest tiles; kernel B's dot (16-bit activations) keeps 16 columns at least, its FP8 GEMV 8;
    the mirrors agree."""
    if framework == "torch":
        from moe_torch.ops.decode import config as C
    else:
        from moe_pallas.ops.decode import config as C
    down = lambda T, H, I, w4=False, fp8=None: C.decode_down_config(T, H, I, w4, fp8=fp8, num_sms=132)  # noqa: E731
    up = lambda T, k, H, I, E, w4=False: C.decode_gate_up_config(T, k, H, I, E, w4, num_sms=132)  # noqa: E731
    b1, a1 = down(1, 2880, 2880), up(1, 4, 2880, 2880, 128)
    assert b1.block_h == 16 == down(1, 2880, 2880, w4=True).block_h  # 180 programs: the dot's narrowest
    assert b1.num_warps == 1 and down(64, 2880, 2880).num_warps == 4  # 16 columns a warp: none decodes twice
    fp8_b1 = down(1, 2880, 2880, fp8="fp8_per_token")
    assert (fp8_b1.block_h, fp8_b1.num_warps) == (8, 4) and -(-2880 // 8) >= 2 * 132
    assert a1.block_n == 32 and 4 * -(-2880 // 32) >= 2 * 132
    assert up(1, 8, 2048, 768, 128).block_n == 16  # Qwen3-30B-A3B: 8 experts x 48 programs
    assert (down(64, 2880, 2880).block_h, up(64, 4, 2880, 2880, 128).block_n) == (64, 64)
    assert down(8, 7168, 2048).block_h == 64  # 8 tokens x 112 programs already fill it
