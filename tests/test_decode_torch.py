"""The torch decode path (``moe_torch/ops/decode``): the shared cases of ``op_cases/decode.py`` (``TestDecodeTorch``:
``fused_experts_decode``'s two Triton kernels against its reference and a float64 per-slot loop over the routings,
dtypes, biases, activations, the shared expert, 4-bit and FP8 weights, reruns and the shared host errors); then
the torch-only cases: a count over several chunks of ids, Llama 4's routing weight on the input against
``moe_forward``, torch's own host errors, gpt-oss's sizes and a CUDA graph replay on the GPU, the unspecialized
``S``, the sm_90 compilation and the config heuristics.

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, ``conftest.py``; made exact by
``moe_torch/ops/triton_interpret.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moe_torch
import moe_torch.ops.decode
from common import TORCH_DEVICE, needs_triton_interpreter
from moe_contract import MoEConfig
from moe_torch.layer import moe_forward, quantize_layer_weights, routed_experts, run_gate
from moe_torch.ops.decode import fused_experts_decode
from moe_torch.ops.decode import triton as decode_triton
from moe_torch.ops.decode.config import DecodeDownConfig, DecodeGateUpConfig, decode_down_config
from moe_torch.ops.quant.reference import dequantize_weight_4bit_reference
from moe_torch.slot_weights import slot_weights
from op_cases import TorchArrays
from op_cases.decode import FP8_CASES, GPT_OSS, ROUTINGS, DecodeCases, distinct_ids
from tolerances import BF16_REL_FRO, F32_REL_FRO, FP8_REL_FRO, assert_exact, assert_rel_fro

# On the CPU the kernels need the interpreter; on a GPU (EPMOE_TEST_DEVICE=gpu) they compile.
pytestmark = needs_triton_interpreter if TORCH_DEVICE == "cpu" else []


def _routed_experts(x, weights, ids, w13, w2, config: MoEConfig, **kw):
    """The staged layer's experts + combine (``moe_torch.layer.routed_experts``, reference stages) on the decode
    path's inputs: ``topk_weights`` split into combine weights and input scales as the layer's ``slot_weights``."""
    start, e_local = config.local_expert_range()
    combine_weights, input_scale = slot_weights(weights, None, config)
    return routed_experts(x, combine_weights, ids, w13, w2, config, implementation="reference",
                          num_experts=config.num_total_experts, expert_start=start, num_local_experts=e_local,
                          routed_scaling_factor=config.combine_routed_scaling_factor, out_dtype=x.dtype,
                          input_scale=input_scale, **kw)


class TestDecodeTorch(TorchArrays, DecodeCases):
    """``fused_experts_decode(implementation="triton")`` against ``implementation="reference"``: every routing in
    float32 and bf16; the FP8 cases at two scale layouts a mode, H = I = 256 for one fp8_block case; the shared
    expert also with the routing weight on the input."""

    OPS = moe_torch
    DECODE = moe_torch.ops.decode
    KERNEL = "triton"
    FOREIGN_KERNEL = "pallas"
    DEFAULT_IS_REFERENCE = TORCH_DEVICE == "cpu"
    FP8_CASES = {k: FP8_CASES[k] for k in ("fp8_per_token-1-bfloat16-channel-expert",
                                           "fp8_per_token-3-float32-expert-channel", "fp8_block-1-float32-256",
                                           "fp8_block-3-bfloat16-128")}

    def decode(self, x, weights, ids, w13, w2, config, implementation, **kw):
        return fused_experts_decode(x, weights, ids, w13, w2, config, implementation=implementation, **kw)

    def kernel_with_blocks(self, x, weights, ids, w13, w2, config, gate_up, down, **kw):
        # chunk_s = 4: the per-expert counts over several chunks of ids (and a tail chunk)
        cfg_a = DecodeGateUpConfig(**gate_up, chunk_s=4, num_warps=4, num_stages=1)
        cfg_b = DecodeDownConfig(**down, num_warps=4, num_stages=1)
        return decode_triton.fused_experts_decode_triton(x, weights, ids, w13, w2, config, kw.get("w13_bias"),
                                                         kw.get("w2_bias"), kw.get("w13_scale"), kw.get("w2_scale"),
                                                         cfg_a, cfg_b)

    def reference_and_staged(self, x, weights, ids, w13, w2, config, **kw):
        return (fused_experts_decode(x, weights, ids, w13, w2, config, implementation="reference", **kw),
                _routed_experts(x, weights, ids, w13, w2, config, **kw))

    def quantize_layer_weights(self, w13, w2, config):
        return quantize_layer_weights(w13.float(), w2.float(), config)

    def dequantize_4bit(self, w_q, w_scale, quant):
        return dequantize_weight_4bit_reference(w_q, w_scale, quant, torch.float32)


def _inputs(config: MoEConfig, ids: np.ndarray, dtype: str, seed: int = 0, bias_dtype: str = "float32"):
    """The shared inputs (``DecodeCases.inputs``) as torch tensors."""
    return TestDecodeTorch().inputs(config, ids, dtype, seed, bias_dtype)


def test_row_blocks_and_count_chunks():
    """An expert with more slots than one row block (17 > block_m = 16: two row blocks), and the per-expert count
    over several chunks of ids (chunk_s = 4), on the launcher with explicit configs (kernel B's the heuristic's)."""
    config = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, topk=2)
    ids = np.array([[1, 1]] * 8 + [[1, 0]], np.int32)  # expert 1 in both slots of 8 tokens (ids need not be distinct)
    x, w, ids_t, w13, w2, _ = _inputs(config, ids, "float32")
    cfg_a = DecodeGateUpConfig(block_m=16, block_n=16, block_k=16, chunk_s=4, num_warps=4, num_stages=1)
    out = decode_triton.fused_experts_decode_triton(x, w, ids_t, w13, w2, config, None, None, None, None, cfg_a,
                                                    decode_down_config(9, 32, 16, False))
    ref = fused_experts_decode(x, w, ids_t, w13, w2, config, implementation="reference")
    assert_rel_fro(out, ref, F32_REL_FRO, "two row blocks")


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
    tri = fused_experts_decode(x, w, ids, w13, w2, config, implementation="triton", w13_scale=s13, w2_scale=s2)
    ref = fused_experts_decode(x, w, ids, w13, w2, config, implementation="reference", w13_scale=s13, w2_scale=s2)
    assert_rel_fro(tri, ref, BF16_REL_FRO if quant == "none" else FP8_REL_FRO, f"weight on input {quant}")
    layer = moe_forward(x, logits, w13, w2, config, w13_scale=s13, w2_scale=s2, implementation="reference")
    assert_exact(ref, layer, "reference vs moe_forward")


# --------------------------------------------------------------------------------------------------- host errors


def test_torch_host_errors(monkeypatch):
    """The refusals of the torch op beyond the shared ones (``DecodeCases.test_host_errors``): a non-tensor x,
    another device, a weight requiring grad, the Triton configs and slot limit."""
    config = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, topk=2)
    x, w, ids, w13, w2, _ = _inputs(config, np.array([[0, 1], [2, 3]], np.int32), "float32")
    op = "fused_experts_decode"

    def call(*args, config=config, **kw):
        base = dict(zip(("x", "topk_weights", "topk_ids", "w13", "w2"), (x, w, ids, w13, w2)))
        base.update(kw)
        impl = base.pop("implementation", "triton")
        return fused_experts_decode(*base.values(), config, implementation=impl)

    with pytest.raises(TypeError, match=rf"{op}: x must be a torch.Tensor"):
        fused_experts_decode(x.cpu().numpy(), w, ids, w13, w2, config)
    with pytest.raises(ValueError, match=rf"{op}: topk_ids must be on x's device \({x.device}\); got topk_ids.device=meta"):
        call(topk_ids=torch.empty(ids.shape, dtype=ids.dtype, device="meta"))
    with pytest.raises(RuntimeError, match=rf"{op}: not differentiable .*; got w13 requiring grad with grad mode on"):
        call(w13=w13.clone().requires_grad_())
    with torch.no_grad():  # an inference call with trainable parameters is fine
        call(w13=w13.clone().requires_grad_(), implementation="reference")
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
    ids = distinct_ids(np.random.default_rng(T), T, 4, 8)
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
    x2, w_new, ids2, *_ = _inputs(config, distinct_ids(np.random.default_rng(9), 7, 2, 8), "bfloat16", seed=9)
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
