"""The JAX decode path (``moe_pallas/ops/decode``): the shared cases of ``op_cases/decode.py`` (``TestDecodeJax``:
``fused_experts_decode``'s prelude and two Pallas-Triton kernels against its reference and a float64 per-slot loop
over the routings, dtypes, biases, activations, the shared expert, 4-bit and FP8 weights, reruns and ``jax.jit``
replays on new inputs (where torch captures a CUDA graph), and the shared host errors); then the JAX-only cases:
the prelude's metadata, the activation's FP8 codes and scales bit for bit on exact data, JAX's own host errors and
both kernels lowered for CUDA (abstract H200).

On the CPU the kernels run in Pallas interpret mode, which fills ``a``'s never-written rows (non-local slots) with
NaN: a read of one would reach the output.
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
import moe_pallas.ops.decode
from moe_contract import MoEConfig
from moe_pallas.layer import quantize_layer_weights, routed_experts
from moe_pallas.ops.decode import fused_experts_decode
from moe_pallas.ops.decode import pallas_triton as decode_pt
from moe_pallas.ops.decode.config import DecodeDownConfig, DecodeGateUpConfig
from moe_pallas.ops.quant.pallas_triton import kernel_div_rn
from moe_pallas.slot_weights import slot_weights
from op_cases import JaxArrays
from op_cases.decode import FP8_CASES, GPT_OSS, DecodeCases
from tolerances import assert_exact, to_numpy

ON_CPU = jax.default_backend() == "cpu"

#: ``fused_experts_decode`` under one ``jax.jit``: the reference's stage ops compiled as one program (run eagerly, each
#: of their jnp ops compiles on its own: ~6x the CPU time on a new shape).
_decode_jit = jax.jit(fused_experts_decode, static_argnames=("config", "implementation"))
_quantize_jit = jax.jit(quantize_layer_weights, static_argnames=("config",))


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


class TestDecodeJax(JaxArrays, DecodeCases):
    """``fused_experts_decode(implementation="pallas_triton")`` against the jitted reference: T = 1, 2, 3, 7 once each
    (alternating float32 and bf16: a program per shape); the FP8 cases with per-channel scales (the layer's), one
    with the routing weight on the input, fp8_block once on gpt-oss's rows; replays under ``jax.jit`` for 16-bit
    and fp8_block weights."""

    OPS = moe_pallas
    DECODE = moe_pallas.ops.decode
    KERNEL = "pallas_triton"
    FOREIGN_KERNEL = "triton"
    DEFAULT_IS_REFERENCE = ON_CPU
    MATCH_CASES = {f"{T}-{d}": (T, d) for T, d in ((1, "float32"), (2, "bfloat16"), (3, "float32"), (7, "bfloat16"))}
    FP8_CASES = {k: FP8_CASES[k] for k in ("fp8_per_token-1-bfloat16-channel", "fp8_per_token-3-float32-channel-on_input",
                                           "fp8_block-1-float32-128", "fp8_block-3-bfloat16-128-gpt_oss")}
    FP8_RERUN = False  # test_deterministic reruns fp8_block (interpret mode is slow)
    DETERMINISTIC_QUANTS = ("none", "fp8_block")

    @pytest.fixture
    def host_errors_guard(self, monkeypatch):
        # every refusal comes before the prelude
        launched = []
        monkeypatch.setattr(decode_pt, "expert_slots", lambda *a: launched.append(1))
        yield
        assert not launched

    def decode(self, x, weights, ids, w13, w2, config, implementation, **kw):
        if implementation == "reference":
            return _decode_jit(x, weights, ids, w13, w2, config=config, implementation="reference", **kw)
        return fused_experts_decode(x, weights, ids, w13, w2, config, implementation=implementation, **kw)

    def kernel_with_blocks(self, x, weights, ids, w13, w2, config, gate_up, down, **kw):
        return decode_pt.fused_experts_decode_pallas_triton(x, weights, ids, w13, w2, config, **kw,
                                                            gate_up_config=DecodeGateUpConfig(**gate_up),
                                                            down_config=DecodeDownConfig(**down))

    def reference_and_staged(self, x, weights, ids, w13, w2, config, **kw):
        return _reference_and_staged(x, weights, ids, w13, w2, config=config, **kw)

    def quantize_layer_weights(self, w13, w2, config):
        # 4-bit quantizers check for non-finite values on the host (no tracers); FP8 ones compile as one program
        quantize = quantize_layer_weights if config.quant in ("mxfp4", "int4") else _quantize_jit
        return quantize(w13.astype(jnp.float32), w2.astype(jnp.float32), config=config)

    def dequantize_4bit(self, w_q, w_scale, quant):
        return getattr(moe_pallas, f"dequantize_weight_{quant}")(w_q, w_scale, out_dtype=jnp.float32)

    def x64(self, enable):
        return jax.enable_x64(enable)

    def check_replay(self, run, inputs, first, new_inputs, w13, w2, **kw):
        """One ``jax.jit`` program (traced once: no host sync, shape-only grids) run again on new ids and inputs
        gives bit for bit what a fresh call gives on them. FP8: the prelude's quantization of x and kernel A's of
        the activation (codes and scales scattered to their slots) inside the replayed program."""
        traces = []

        def step(x, w, ids, w13, w2, kw):
            traces.append(1)
            return run(x, w, ids, w13, w2, **kw)

        jitted = jax.jit(step)
        assert_exact(jitted(*inputs, w13, w2, kw), first, "jit vs eager")
        replay = jitted(*new_inputs, w13, w2, kw)
        assert len(traces) == 1, "the jitted program was traced again"
        assert_exact(replay, run(*new_inputs, w13, w2, **kw), "jit replay vs eager")


def _inputs(config: MoEConfig, ids: np.ndarray, dtype: str, seed: int = 0, bias_dtype: str = "float32"):
    """The shared inputs (``DecodeCases.inputs``) as jax arrays."""
    return TestDecodeJax().inputs(config, ids, dtype, seed, bias_dtype)


def _fp8_weights(config: MoEConfig, w13, w2):
    """``dict(w13=, w13_scale=, w2=, w2_scale=)``: float weights quantized as the layer quantizes them
    (``quantize_layer_weights``: per-channel scales for fp8_per_token, 128x128 blocks for fp8_block)."""
    w13q, s13, w2q, s2 = _quantize_jit(w13.astype(jnp.float32), w2.astype(jnp.float32), config=config)
    return dict(w13=w13q, w13_scale=s13, w2=w2q, w2_scale=s2)


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


# --------------------------------------------------------------------------------------------------- host errors


def test_jax_host_errors(monkeypatch):
    """The refusals of the JAX op beyond the shared ones (``DecodeCases.test_host_errors``): a torch tensor for x,
    the Pallas-Triton configs, a derivative; none gets as far as the prelude."""
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

    with pytest.raises(TypeError, match=rf"{op}: x must be a jax array .*; got torch.Tensor"):
        fused_experts_decode(torch.zeros(2, 32), w, ids, w13, w2, config)
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
