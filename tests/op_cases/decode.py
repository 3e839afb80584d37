"""The cases of the decode path (``fused_experts_decode``, CONTRACT.md sections 4, 5, 7 and 9) that every backend
passes: its kernels against its reference (the staged layer's stage references composed) and a float64 per-slot
loop.

Routings: T = 1, 2, 3, 7 with ragged and empty experts, every token on one expert, ``-1`` ids, another EP rank's
experts, a token with no local slot, int64 ids (one past 2^32), an expert with more slots than one row block;
float32 (``F32_REL_FRO``) and bf16 / fp16 (``BF16_REL_FRO``); gpt-oss's biases with ``swiglu_oai`` on interleaved
gate/up rows; every activation; a fused shared expert with rsf in the combine, with and without Llama 4's routing
weight on the input; 4-bit weights (mxfp4, int4); FP8 weights (per-token x per-expert / per-channel scales, 1 x 128
x 128 x 128 blocks: ``FP8_REL_FRO``, the reference equal to the staged layer's ``routed_experts`` bit for bit);
bit-identical reruns; ``T = 0`` and the default implementation; the host-side errors both backends share.

Subclassed by ``tests/test_decode_torch.py`` (the Triton kernels, interpreted on the CPU) and
``tests/test_decode_jax.py`` (the Pallas-Triton kernels in interpret mode). A subclass mixes in the arrays of its
framework (``op_cases.TorchArrays`` / ``JaxArrays``), names its framework's public module
(:attr:`DecodeCases.OPS`) and implements the hooks. Shapes are tiny: H = 48 / 64, I = 24 / 32 (K tails in both
GEMMs); fp8_block needs multiples of 128.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from moe_contract import MoEConfig
from moe_torch.ops.activation.reference import gated, split_gate_up
from op_cases import ClassParams
from tolerances import BF16_REL_FRO, F32_REL_FRO, FP8_REL_FRO, assert_exact, assert_rel_fro, to_numpy

LIMITS = {"float32": F32_REL_FRO, "bfloat16": BF16_REL_FRO, "float16": BF16_REL_FRO}
#: gpt-oss's expert settings: swiglu_oai on interleaved gate/up rows, per-expert biases on both projections.
GPT_OSS = dict(activation="swiglu_oai", gate_up_layout="interleaved", expert_bias=True)

#: T -> ids over E = 8 experts, top-2: ragged experts (1 to 4 slots), empty experts (5, 7 at T = 7), a -1 id.
ROUTINGS = {
    1: [[5, 2]],
    2: [[3, 0], [0, 6]],
    3: [[1, 4], [4, -1], [1, 2]],
    7: [[0, 3], [3, 0], [3, 6], [2, 3], [0, 1], [6, 4], [3, 2]],
}

#: id -> (quant, T, dtype, H, I, scale layouts of w13 / w2, other MoEConfig settings): the FP8 cases a backend picks
#: from (:attr:`DecodeCases.FP8_CASES`). Each mode at T = 1 (six empty experts) and T = 3 (ragged, a -1 id);
#: fp8_per_token at H = 48, I = 24: K tails in both kernels; fp8_block (multiples of 128) at H = I = 256 (two K
#: blocks and four row blocks of w13) and H = I = 128, once on gpt-oss's interleaved rows with biases.
FP8_CASES = {
    "fp8_per_token-1-bfloat16-channel-expert": ("fp8_per_token", 1, "bfloat16", 48, 24, ("per_channel", "per_expert"), {}),
    "fp8_per_token-3-float32-expert-channel": ("fp8_per_token", 3, "float32", 48, 24, ("per_expert", "per_channel"), {}),
    "fp8_block-1-float32-256": ("fp8_block", 1, "float32", 256, 256, ("block", "block"), {}),
    "fp8_block-3-bfloat16-128": ("fp8_block", 3, "bfloat16", 128, 128, ("block", "block"), {}),
    "fp8_per_token-1-bfloat16-channel": ("fp8_per_token", 1, "bfloat16", 48, 24, ("per_channel", "per_channel"), {}),
    "fp8_per_token-3-float32-channel-on_input": ("fp8_per_token", 3, "float32", 48, 24, ("per_channel", "per_channel"),
                                                 dict(apply_router_weight_on_input=True)),
    "fp8_block-1-float32-128": ("fp8_block", 1, "float32", 128, 128, ("block", "block"), {}),
    "fp8_block-3-bfloat16-128-gpt_oss": ("fp8_block", 3, "bfloat16", 128, 128, ("block", "block"), GPT_OSS),
}


def distinct_ids(rng, T: int, k: int, E: int) -> np.ndarray:
    return np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)


def spread(w: np.ndarray, seed: int) -> np.ndarray:
    """``w [E, N, K]`` times ``2^j``, ``j`` in ``[-2, 2]`` drawn per (expert, row, 128-wide K block): FP8 scales that
    differ by powers of 2 between experts, channels and blocks, so a scale applied to the wrong rows or K block
    shows far above ``FP8_REL_FRO``."""
    E, N, K = w.shape
    j = np.random.default_rng(seed).integers(-2, 3, (E, N, -(-K // 128))).astype(np.float32)
    return w * np.repeat(2.0 ** j, 128, axis=2)[:, :, :K]


def _f64(a) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(to_numpy(a).astype(np.float64))


def float64_loop(x, weights, ids, w13, w2, config: MoEConfig, w13_bias=None, w2_bias=None) -> np.ndarray:
    """``sum_j w[t, j] * expert(x[t])`` in float64 with no intermediate rounding, slot by slot (the judge of
    CONTRACT.md section 7's float64 rows; torch's float64 activation reference); any framework's arrays, ``w13`` /
    ``w2`` float (dequantized for 4-bit). With ``config.apply_router_weight_on_input`` a routed slot is
    ``expert(w[t, j] * x[t])`` instead."""
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


class DecodeCases(ClassParams):
    """The decode path's cases, for any implementation.

    A backend's subclass provides ``array`` (its framework's mixin), :attr:`OPS` (the public module:
    ``quantize_weight_fp8``), :attr:`DECODE` (``fused_experts_decode``, ``DECODE_MAX_TOKENS``), :attr:`KERNEL` (the
    ``implementation=`` under test), :attr:`FOREIGN_KERNEL`, :attr:`DEFAULT_IS_REFERENCE` and
    the hooks :meth:`decode` (``fused_experts_decode``), :meth:`kernel_with_blocks` (its launcher with explicit
    block sizes), :meth:`reference_and_staged`, :meth:`quantize_layer_weights`, :meth:`dequantize_4bit`; it may
    override :meth:`x64` (a context under which int64 ids are kept) and :meth:`check_replay` (a compiled replay on
    new inputs), and the ``host_errors_guard`` fixture. It picks its cases with :attr:`MATCH_CASES`,
    :attr:`FP8_CASES`, :attr:`FP8_RERUN`, :attr:`ON_INPUT` and :attr:`DETERMINISTIC_QUANTS`.
    """

    #: The framework's public module (``moe_torch`` / ``moe_pallas``).
    OPS = None
    #: The framework's decode package (``moe_torch.ops.decode`` / ``moe_pallas.ops.decode``).
    DECODE = None
    #: The implementation under test (``"triton"`` / ``"pallas_triton"``).
    KERNEL = None
    #: The other framework's kernel name, which this one must refuse.
    FOREIGN_KERNEL = None
    #: Whether ``implementation=None`` on this test device is the reference.
    DEFAULT_IS_REFERENCE = False
    #: ``{test id: (T of ROUTINGS, dtype)}``: the cases of :meth:`test_matches_reference`.
    MATCH_CASES: dict = {f"{T}-{d}": (T, d) for T in sorted(ROUTINGS) for d in ("float32", "bfloat16")}
    #: ``{test id: case of the module's FP8_CASES}``: the cases of :meth:`test_fp8_weights`.
    FP8_CASES: dict = {}
    #: Whether :meth:`test_fp8_weights` reruns the kernels at T = 3 (bit-identical).
    FP8_RERUN = True
    #: ``apply_router_weight_on_input`` values of :meth:`test_shared_expert_rsf_fp16`.
    ON_INPUT = (False, True)
    #: The ``quant`` values of :meth:`test_deterministic`.
    DETERMINISTIC_QUANTS = ("none",)
    CLASS_PARAMS = {"match_case": "MATCH_CASES", "fp8_case": "FP8_CASES", "on_input": "ON_INPUT",
                    "det_quant": "DETERMINISTIC_QUANTS"}

    @pytest.fixture
    def host_errors_guard(self):
        """Around :meth:`test_host_errors`: nothing here; a backend may check that no kernel launched."""

    def decode(self, x, weights, ids, w13, w2, config: MoEConfig, implementation: str, **kw):
        """``fused_experts_decode`` with ``implementation``."""
        raise NotImplementedError

    def kernel_with_blocks(self, x, weights, ids, w13, w2, config: MoEConfig, gate_up: dict, down: dict, **kw):
        """The kernels' launcher with ``gate_up`` (``block_m``, ``block_n``, ``block_k``) and ``down`` (``block_h``,
        ``block_i``) block sizes."""
        raise NotImplementedError

    def reference_and_staged(self, x, weights, ids, w13, w2, config: MoEConfig, **kw):
        """``(reference, staged)``: ``fused_experts_decode``'s reference, and the staged layer's ``routed_experts``
        (stage references) on the same inputs, the weights split as the layer's ``slot_weights`` splits them."""
        raise NotImplementedError

    def quantize_layer_weights(self, w13, w2, config: MoEConfig):
        """``(w13, w13_scale, w2, w2_scale)`` of float weights, as the layer quantizes them."""
        raise NotImplementedError

    def dequantize_4bit(self, w_q, w_scale, quant: str):
        """4-bit codes and scales (as ``quantize_layer_weights`` gives them) as float32 weights."""
        raise NotImplementedError

    def x64(self, enable: bool):
        """A context under which int64 ids stay int64 (JAX drops them to int32 without x64)."""
        return contextlib.nullcontext()

    def check_replay(self, run, inputs, first, new_inputs, w13, w2, **kw):
        """The kernels compiled once and replayed on ``new_inputs`` ``(x, weights, ids)`` give what a fresh call
        gives; ``run(x, weights, ids, w13, w2, **kw)`` is the eager call, ``first`` its output on ``inputs``.
        Nothing here (torch replays a CUDA graph on the GPU only)."""

    def both(self, x, weights, ids, w13, w2, config, **kw):
        """``(kernel, reference)`` outputs of ``fused_experts_decode``."""
        return (self.decode(x, weights, ids, w13, w2, config, self.KERNEL, **kw),
                self.decode(x, weights, ids, w13, w2, config, "reference", **kw))

    def inputs(self, config: MoEConfig, ids: np.ndarray, dtype: str, seed: int = 0, bias_dtype: str = "float32"):
        """``(x, topk_weights, topk_ids, w13, w2, biases)`` for ``config`` and the given ids (biases ``{}`` unless
        ``config.expert_bias``). Weights scaled so that ``h`` and ``y`` are O(1)."""
        rng = np.random.default_rng(seed)
        H, I = config.hidden_size, config.intermediate_size
        _, e_local = config.local_expert_range()
        T, k = ids.shape

        def t(shape, scale, d=dtype):
            return self.array(rng.standard_normal(shape).astype(np.float32) * scale, d)

        x = t((T, H), 1.0)
        weights = self.array(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32))
        w13, w2 = t((e_local, 2 * I, H), H ** -0.5), t((e_local, H, I), I ** -0.5)
        biases = {}
        if config.expert_bias:
            biases = dict(w13_bias=t((e_local, 2 * I), 0.5, bias_dtype), w2_bias=t((e_local, H), 0.5, bias_dtype))
        return x, weights, self.array(ids), w13, w2, biases

    # --- Against the reference and float64 ----------------------------------------------------------

    def test_matches_reference(self, match_case):
        """A routing of :data:`ROUTINGS`: x's dtype and shape, within the dtype's row of the reference and of
        float64."""
        T, dtype = match_case
        config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=8, topk=2)
        x, w, ids, w13, w2, _ = self.inputs(config, np.array(ROUTINGS[T], np.int32), dtype, seed=T)
        out, ref = self.both(x, w, ids, w13, w2, config)
        assert out.dtype == x.dtype and out.shape == x.shape
        assert_rel_fro(out, ref, LIMITS[dtype], f"{self.KERNEL} vs reference T={T} {dtype}")
        assert_rel_fro(out, float64_loop(x, w, ids, w13, w2, config), LIMITS[dtype], f"{self.KERNEL} vs float64")

    @pytest.mark.parametrize("case", ["one_expert", "non_local", "int64_ids"])
    def test_routing_edges(self, case):
        """Every token on one expert (its w13 read by one program per column block), ids of -1 / out of range / of
        the other EP rank (a token with no local slot gets exactly 0), int64 ids (an id of 2**32 + 1 is out of
        range, not expert 1, as it would be if the ids were cut to int32 before the shift)."""
        rng = np.random.default_rng(1)
        if case == "one_expert":
            config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=4, topk=2)
            ids = np.stack([np.full(7, 2), rng.choice([0, 1, 3], 7)], axis=1).astype(np.int32)
        elif case == "non_local":  # rank 1 of 2 owns experts 4..7
            config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=8, topk=2, ep_size=2, ep_rank=1)
            ids = np.array([[5, 1], [0, 2], [-1, 7], [4, 9], [6, 5]], np.int32)
        else:
            config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=4, topk=3)
            ids = distinct_ids(rng, 3, 3, 4).astype(np.int64)
            ids[1, 2] = -1
            ids[2, 0] = 2**32 + 1
        with self.x64(case == "int64_ids"):
            x, w, ids_a, w13, w2, _ = self.inputs(config, ids, "float32")
            assert to_numpy(ids_a).dtype == ids.dtype
            out, ref = self.both(x, w, ids_a, w13, w2, config)
        assert_rel_fro(out, ref, F32_REL_FRO, case)
        assert_rel_fro(out, float64_loop(x, w, ids, w13, w2, config), F32_REL_FRO, case)
        if case == "non_local":
            assert_exact(out[1], np.zeros(out.shape[1:], np.float32), "token with no local slot")

    def test_row_blocks(self):
        """An expert with more slots than one row block (17 > block_m = 16: two row blocks, the second of one row),
        on the launcher with explicit block sizes (one K step and one I step short of H and I: the loops' tails)."""
        config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=4, topk=2)
        ids = np.array([[1, 1]] * 8 + [[1, 0]], np.int32)  # expert 1 in both slots of 8 tokens (need not be distinct)
        x, w, ids_a, w13, w2, _ = self.inputs(config, ids, "float32")
        out = self.kernel_with_blocks(x, w, ids_a, w13, w2, config, dict(block_m=16, block_n=16, block_k=32),
                                      dict(block_h=32, block_i=16))
        ref = self.decode(x, w, ids_a, w13, w2, config, "reference")
        assert_rel_fro(out, ref, F32_REL_FRO, "two row blocks")

    @pytest.mark.parametrize("bias_dtype", ["float32", "bfloat16"])
    def test_gpt_oss_biases(self, bias_dtype):
        """gpt-oss: swiglu_oai on interleaved gate/up rows, both biases (float32 or bf16), bf16 activations; values
        large enough that the clamps (g > 7, |u| > 7) are hit."""
        config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=4, topk=2, **GPT_OSS)
        ids = np.array([[0, 3], [3, 1], [2, 3]], np.int32)
        x, w, ids_a, w13, w2, biases = self.inputs(config, ids, "bfloat16", bias_dtype=bias_dtype)
        x = self.array(to_numpy(x).astype(np.float32) * 6, "bfloat16")  # |h| up to ~20: both clamps of swiglu_oai bite
        out, ref = self.both(x, w, ids_a, w13, w2, config, **biases)
        assert_rel_fro(out, ref, BF16_REL_FRO, "gpt-oss kernel vs reference")
        assert_rel_fro(out, float64_loop(x, w, ids_a, w13, w2, config, **biases), BF16_REL_FRO, "gpt-oss vs float64")

    @pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "swiglu_oai"])
    def test_activations_float32(self, activation):
        """Each activation on its layout's rows (interleaved for swiglu_oai), float32: tight."""
        layout = "interleaved" if activation == "swiglu_oai" else "concatenated"
        config = MoEConfig(hidden_size=32, intermediate_size=24, num_experts=4, topk=2, activation=activation,
                           gate_up_layout=layout)
        x, w, ids, w13, w2, _ = self.inputs(config, np.array([[1, 2], [2, 0]], np.int32), "float32", seed=3)
        out, ref = self.both(x, w, ids, w13, w2, config)
        assert_rel_fro(out, ref, F32_REL_FRO, activation)

    def test_shared_expert_rsf_fp16(self, on_input):
        """A fused shared expert (id E, in every token's last slot) with rsf = 2.5 applied by the combine, float16;
        and with Llama 4's ``apply_router_weight_on_input`` (the routed slots' weights scale their inputs, rounded
        once to float16, and the combine weighs them 1; the shared slot keeps its weight), also against the staged
        layer."""
        config = MoEConfig(hidden_size=48, intermediate_size=24, num_experts=4, topk=2, num_fused_shared_experts=1,
                           routed_scaling_factor=2.5, apply_router_weight_on_input=on_input)
        assert config.combine_routed_scaling_factor == 2.5
        ids = np.array([[1, 3, 4], [0, 1, 4]], np.int32)
        x, w, ids_a, w13, w2, _ = self.inputs(config, ids, "float16")
        out = self.decode(x, w, ids_a, w13, w2, config, self.KERNEL)
        ref, staged = self.reference_and_staged(x, w, ids_a, w13, w2, config)
        assert_rel_fro(out, ref, BF16_REL_FRO, "shared + rsf")
        assert_rel_fro(out, float64_loop(x, w, ids_a, w13, w2, config), BF16_REL_FRO, "shared + rsf vs float64")
        assert_exact(ref, staged, "reference vs the staged layer")

    @pytest.mark.parametrize("quant,dtype", [("mxfp4", "bfloat16"), ("int4", "bfloat16"), ("mxfp4", "float32")])
    def test_4bit_weights(self, quant, dtype):
        """4-bit expert weights (CONTRACT.md section 9) with gpt-oss's activation, layout and biases: the kernels
        decode the packed codes as the grouped GEMM does, so they agree with the staged reference; and with the
        float64 loop on the dequantized weights."""
        config = MoEConfig(hidden_size=64, intermediate_size=32, num_experts=4, topk=2, quant=quant, **GPT_OSS)
        ids = np.array([[2, 0], [2, -1], [3, 2]], np.int32)
        x, w, ids_a, w13f, w2f, biases = self.inputs(config, ids, dtype)
        w13, s13, w2, s2 = self.quantize_layer_weights(w13f, w2f, config)
        kw = dict(w13_scale=s13, w2_scale=s2, **biases)
        out, ref = self.both(x, w, ids_a, w13, w2, config, **kw)
        assert_rel_fro(out, ref, LIMITS[dtype], f"{quant} kernel vs reference")
        wd13, wd2 = self.dequantize_4bit(w13, s13, quant), self.dequantize_4bit(w2, s2, quant)
        assert_rel_fro(out, float64_loop(x, w, ids_a, wd13, wd2, config, **biases), LIMITS[dtype], f"{quant} vs float64")

    def test_fp8_weights(self, fp8_case):
        """FP8 weights (CONTRACT.md sections 3, 4; a case of :data:`FP8_CASES`, the weights :func:`spread`): the
        kernels quantize x (per token over H, or 1 x 128 groups) and a (per token over I from its float32 value, or
        1 x 128 groups) as the staged permute and act_and_mul do, and apply the scales as the grouped GEMM does:
        within the contract's FP8 row of the reference, which is the staged layer's ``routed_experts`` bit for bit;
        reruns bit-identical (:attr:`FP8_RERUN`)."""
        quant, T, dtype, H, I, layouts, settings = fp8_case
        config = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=8, topk=2, quant=quant, **settings)
        x, w, ids, w13f, w2f, biases = self.inputs(config, np.array(ROUTINGS[T], np.int32), dtype, seed=T)
        w13, s13 = self.OPS.quantize_weight_fp8(self.array(spread(to_numpy(w13f).astype(np.float32), 1)), layouts[0])
        w2, s2 = self.OPS.quantize_weight_fp8(self.array(spread(to_numpy(w2f).astype(np.float32), 2)), layouts[1])
        kw = dict(w13_scale=s13, w2_scale=s2, **biases)
        out = self.decode(x, w, ids, w13, w2, config, self.KERNEL, **kw)
        ref, staged = self.reference_and_staged(x, w, ids, w13, w2, config, **kw)
        assert out.dtype == x.dtype and out.shape == x.shape
        assert_rel_fro(out, ref, FP8_REL_FRO, f"{quant} kernel vs reference T={T} {dtype}")
        assert_exact(ref, staged, f"{quant} reference vs routed_experts")
        if T == 3 and self.FP8_RERUN:
            assert_exact(self.decode(x, w, ids, w13, w2, config, self.KERNEL, **kw), out, "rerun")

    def test_deterministic(self, det_quant):
        """Two runs of the kernels give bit-identical outputs (no atomics; fixed loop orders), gpt-oss's settings at
        T = 7; and :meth:`check_replay` on new ids and inputs."""
        H, I = (128, 128) if det_quant == "fp8_block" else (48, 24)
        config = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=8, topk=2, quant=det_quant, **GPT_OSS)
        x, w, ids, w13, w2, kw = self.inputs(config, np.array(ROUTINGS[7], np.int32), "bfloat16")
        if det_quant != "none":
            w13, s13, w2, s2 = self.quantize_layer_weights(w13, w2, config)
            kw.update(w13_scale=s13, w2_scale=s2)

        def run(x, w, ids, w13, w2, **kw):
            return self.decode(x, w, ids, w13, w2, config, self.KERNEL, **kw)

        first = run(x, w, ids, w13, w2, **kw)
        assert_exact(first, run(x, w, ids, w13, w2, **kw), "rerun")
        new = self.inputs(config, distinct_ids(np.random.default_rng(9), 7, 2, 8), "bfloat16", seed=9)[:3]
        self.check_replay(run, (x, w, ids), first, new, w13, w2, **kw)

    def test_defaults_and_empty(self):
        """``implementation=None`` on the CPU is the reference; ``T = 0`` gives ``[0, H]``; the constant exists."""
        assert self.DECODE.DECODE_MAX_TOKENS == 64
        config = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, topk=2)
        x, w, ids, w13, w2, _ = self.inputs(config, np.array([[0, 1]], np.int32), "float32")
        if self.DEFAULT_IS_REFERENCE:
            assert_exact(self.DECODE.fused_experts_decode(x, w, ids, w13, w2, config),
                         self.DECODE.fused_experts_decode(x, w, ids, w13, w2, config, implementation="reference"),
                         "default")
        for impl in (self.KERNEL, "reference"):
            out = self.DECODE.fused_experts_decode(x[:0], w[:0], ids[:0], w13, w2, config, implementation=impl)
            assert out.shape == (0, 32) and out.dtype == x.dtype

    # --- Host errors ---------------------------------------------------------------------------------

    @pytest.mark.usefixtures("host_errors_guard")
    def test_host_errors(self):
        """The refusals both backends make before anything runs, each naming the op, the argument and what came."""
        config = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, topk=2)
        x, w, ids, w13, w2, _ = self.inputs(config, np.array([[0, 1], [2, 3]], np.int32), "float32")
        op, decode = "fused_experts_decode", self.DECODE.fused_experts_decode
        cast = lambda a, dtype: self.array(to_numpy(a).astype(np.float32), dtype)  # noqa: E731

        def call(config=config, **kw):
            base = dict(zip(("x", "topk_weights", "topk_ids", "w13", "w2"), (x, w, ids, w13, w2)))
            base.update(kw)
            impl = base.pop("implementation", self.KERNEL)
            return decode(*base.values(), config, implementation=impl)

        with pytest.raises(ValueError, match=rf"{op}: x must be \[T, H\] with H=32; got x.shape=\(2, 16\)"):
            call(x=x[:, :16])
        with pytest.raises(ValueError, match=rf"{op}: topk_ids must be \[T, topk \+ S\] = \(2, 2\) .*; got topk_ids.shape"):
            call(topk_ids=ids[:, :1])
        with pytest.raises(TypeError, match=rf"{op}: topk_ids must have dtype int32 or int64; got topk_ids.dtype=float32"):
            call(topk_ids=cast(ids, "float32"))
        with pytest.raises(TypeError, match=rf"{op}: topk_weights must have dtype float32; got topk_weights.dtype=bfloat16"):
            call(topk_weights=cast(w, "bfloat16"))
        with pytest.raises(ValueError, match=rf"{op}: w13 must be \[E_local, 2\*I, H\] = \(4, 32, 32\)"):
            call(w13=w13[:, :16])
        with pytest.raises(TypeError, match=rf"{op}: w2 must have dtype float32 .*; got w2.dtype=bfloat16"):
            call(w2=cast(w2, "bfloat16"))
        with pytest.raises(TypeError, match=rf"{op}: config must be a MoEConfig"):
            decode(x, w, ids, w13, w2, {"hidden_size": 32})
        with pytest.raises(ValueError, match=rf"{op}: implementation must be one of"):
            call(implementation=self.FOREIGN_KERNEL)
        with pytest.raises(ValueError, match=rf"{op}: w13_bias must be None unless config.expert_bias=True"):
            decode(x, w, ids, w13, w2, config, w13_bias=self.array(np.zeros((4, 32), np.float32)))
        biased = config.replace(expert_bias=True)
        with pytest.raises(ValueError, match=rf"{op}: w13_bias \[E_local, 2\*I\] = \(4, 32\) .* must be given"):
            decode(x, w, ids, w13, w2, biased, w2_bias=self.array(np.zeros((4, 32), np.float32)))
        # FP8: codes with their scales, of the layout the mode takes
        fp8 = config.replace(quant="fp8_per_token")
        with pytest.raises(TypeError, match=rf"{op}: w13 must have dtype float8_e4m3fn; got w13.dtype=float32"):
            call(config=fp8)
        w13_q, s13 = self.OPS.quantize_weight_fp8(w13, "per_channel")
        w2_q, s2 = self.OPS.quantize_weight_fp8(w2, "per_channel")
        with pytest.raises(ValueError, match=rf"{op}: w13_scale must be given for quant='fp8_per_token'; got None"):
            decode(x, w, ids, w13_q, w2_q, fp8, w2_scale=s2)
        with pytest.raises(ValueError, match=rf"{op}: w2_scale must be per-expert \[E_local\] or per-channel"):
            decode(x, w, ids, w13_q, w2_q, fp8, w13_scale=s13, w2_scale=self.array(np.ones((4, 1, 1), np.float32)))
