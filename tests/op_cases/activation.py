"""The cases of ``silu_and_mul`` / ``gelu_tanh_and_mul`` (CONTRACT.md section 4), optionally fused with FP8
quantization (section 3), that every backend passes.

Subclassed by ``tests/test_activation.py`` (the torch ops against the jnp ops, through the public APIs with the
default implementation: the references on the CPU), ``tests/test_pallas_kernels.py`` (the Pallas-Triton kernel
against the jnp reference) and ``tests/test_triton_kernels.py`` (the Triton kernel against the torch reference).
A subclass mixes in the arrays of its framework (``op_cases.TorchArrays`` / ``JaxArrays``) and implements the
hooks.

Float32 math then one round-to-nearest-even cast; fused FP8 codes and scales bit-identical to the quantization
of the backend's own float32 activation. Every output is compared with the judge's and with a float64 numpy
activation; the checks against numpy and the quantization run on the judge's result too.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from op_cases import ClassParams
from tolerances import BF16_REL_FRO, F32_REL_FRO, FP8_REL_FRO, assert_exact, assert_rel_fro, to_numpy

ACTIVATIONS = ["silu", "gelu_tanh"]
LIMITS = {"float32": F32_REL_FRO, "bfloat16": BF16_REL_FRO, "float16": BF16_REL_FRO}
#: The FP8 step: a dequantized activation is within it of the exact one.
FP8_STEP_REL_FRO = 2**-4

#: name -> (M, I, strided): ``h [M, 2*I]``; ``strided``: a view with a non-unit column stride where the framework
#: has them (the launcher must copy, never write it). The comment says which edge.
ACT_SHAPES = {
    "M1": (1, 128, False),  # M=1 (decode), one column block
    "odd-I": (3, 33, False),  # odd I (masked columns; the up half starts mid-line), M smaller than the row block
    "ragged-M": (37, 200, False),  # M not a multiple of the row block, I not a power of 2
    "wide-I": (5, 1300, True),  # I wider than one column block (1024): two column programs, the last partial
}

#: name -> (quant, group_size, M, I, h dtype, forced blocks (block_m, block_i) or None); the comment says which
#: edge. A backend runs those it lists in ``FP8_CASES``.
ACT_FP8_CASES = {
    "token-M1": ("fp8_per_token", 128, 1, 128, "bfloat16", None),  # M=1
    "token-odd-I": ("fp8_per_token", 128, 7, 33, "bfloat16", None),  # M below a block, odd I
    "token-ragged-M": ("fp8_per_token", 128, 37, 200, "bfloat16", None),  # M not a multiple of the row block
    "token-M12": ("fp8_per_token", 128, 12, 512, "bfloat16", None),  # a plain case
    "token-wide": ("fp8_per_token", 128, 3, 4352, "bfloat16", None),  # I > 4096: Triton's two-pass path
    # forced two passes (amax per column block, then quantize): 5 column blocks, the last partial (the amax of
    # its masked tail must be 0); odd I in 3 blocks of 16
    "token-two-pass-64": ("fp8_per_token", 128, 5, 300, "bfloat16", (4, 64)),
    "token-two-pass-16": ("fp8_per_token", 128, 9, 33, "bfloat16", (4, 16)),
    "group-M1": ("fp8_per_token_group", 128, 1, 128, "bfloat16", None),  # one group
    "group-M1-f32": ("fp8_per_token_group", 128, 1, 128, "float32", None),  # one group, float32 h
    "group-ragged-M": ("fp8_per_token_group", 128, 21, 512, "bfloat16", None),  # 4 groups, M not a block multiple
    "group-ragged-M-f32": ("fp8_per_token_group", 128, 37, 384, "float32", None),  # three groups, float32 h
    "group-M12": ("fp8_per_token_group", 128, 12, 512, "bfloat16", None),  # a plain case
    "group-32": ("fp8_per_token_group", 32, 6, 96, "float32", None),  # a smaller power-of-2 group
    "group-96": ("fp8_per_token_group", 96, 5, 288, "bfloat16", None),  # G not a power of 2: masked single chunk
    "group-8192": ("fp8_per_token_group", 8192, 2, 8192, "bfloat16", None),  # G > 4096: Triton's two-pass path
}


def numpy_act_and_mul(h: np.ndarray, activation: str) -> np.ndarray:
    """``act(g) * u`` in float64 for ``h = [g | u]``."""
    h = h.astype(np.float64)
    g, u = np.split(h, 2, axis=1)
    if activation == "silu":
        a = g / (1.0 + np.exp(-g))
    else:
        a = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))
    return a * u


def h_problem(M: int, I: int, seed: int) -> np.ndarray:
    """``h [M, 2*I]`` float32 of N(0, 3^2) values (O(1) outputs, never zeros)."""
    return (np.random.default_rng(seed).standard_normal((M, 2 * I)) * 3).astype(np.float32)


class ActivationCases(ClassParams):
    """``act_and_mul``'s cases, for any implementation.

    Hooks: ``array`` / ``strided`` (the framework mixin), :meth:`act_and_mul` (the backend under test) and
    :meth:`reference_act_and_mul` (its judge), :meth:`quantize` / :meth:`dequantize` (the FP8 reference
    quantization in the backend's framework) and :meth:`reference_quantize` / :meth:`reference_dequantize`
    (in the judge's), :meth:`forced_config`; :attr:`SHAPES`, :attr:`DTYPES`, :attr:`FP8_CASES`.
    """

    #: The keys of :data:`ACT_SHAPES` / :data:`ACT_FP8_CASES` this backend runs, and its dtypes of ``h``.
    SHAPES: tuple[str, ...] = tuple(ACT_SHAPES)
    FP8_CASES: tuple[str, ...] = tuple(ACT_FP8_CASES)
    DTYPES: tuple[str, ...] = ("float32", "bfloat16")
    #: How close the dequantized fused output is to the judge's fused output (codes may differ by a step where
    #: the two float32 activations differ by an ulp).
    FUSED_REL_FRO = FP8_REL_FRO
    CLASS_PARAMS = {"shape": "SHAPES", "dtype": "DTYPES", "fp8_case": "FP8_CASES"}

    def act_and_mul(self, h, activation: str, quant=None, group_size: int = 128, out_dtype: str | None = None,
                    config=None):
        """The backend under test: ``(out or codes, scale or None)``. ``config=None``: the public op; else the
        kernel with that launch config."""
        raise NotImplementedError

    def reference_act_and_mul(self, h_np, dtype: str, activation: str, quant=None, group_size: int = 128,
                              out_dtype: str | None = None):
        """The judge's ``(out or codes, scale or None)`` for numpy ``h_np`` cast to ``dtype``."""
        raise NotImplementedError

    def quantize(self, a32, quant: str, group_size: int):
        """The reference FP8 quantization of a float32 activation, in the backend's framework."""
        raise NotImplementedError

    def dequantize(self, q, scale):
        raise NotImplementedError

    def reference_quantize(self, a32, quant: str, group_size: int):
        """:meth:`quantize` in the judge's framework."""
        return self.quantize(a32, quant, group_size)

    def reference_dequantize(self, q, scale):
        return self.dequantize(q, scale)

    def forced_config(self, block_m: int, block_i: int):
        """A launch config of ``block_m`` rows x ``block_i`` columns per program, the per-token amax over several
        column blocks (None: the backend has no launch configs; the public op runs)."""
        return None

    @pytest.mark.parametrize("activation", ACTIVATIONS)
    def test_act_and_mul(self, shape, dtype, activation):
        """Float32 math then one RNE cast: the float32 output within F32_REL_FRO of the judge's and of float64;
        the output in h's dtype exactly the cast of the backend's own float32 output, and within its row of the
        judge's and of float64; no scale; the input is left untouched."""
        M, I, strided = ACT_SHAPES[shape]
        h_np = h_problem(M, I, seed=M * I)
        h = self.array(h_np, dtype)
        if strided and self.strided(h) is not None:
            h = self.strided(h)
        h_before = to_numpy(h).copy()
        ref64 = numpy_act_and_mul(to_numpy(h).astype(np.float64), activation)  # of h as rounded to dtype
        outs = {}
        for out_dtype in ("float32", None):  # None: h's dtype
            name = out_dtype or dtype
            got = self.act_and_mul(h, activation, out_dtype=out_dtype)
            want = self.reference_act_and_mul(h_np, dtype, activation, out_dtype=out_dtype)
            for (out, scale), what in ((got, name), (want, f"judge {name}")):
                o = to_numpy(out)
                assert scale is None and o.shape == (M, I) and o.dtype.name == name, f"{what}: {o.dtype} {o.shape}"
                assert np.isfinite(o.astype(np.float32)).all(), f"{what}: non-finite values (unwritten or leaked)"
                assert_rel_fro(out, ref64, LIMITS[name], f"{what} vs float64")
            assert_rel_fro(got[0], want[0], LIMITS[name], f"{name} vs judge")
            outs[out_dtype], outs[f"judge {out_dtype}"] = got[0], want[0]
        assert_rel_fro(outs[None], outs["judge float32"], LIMITS[dtype], "output vs the judge's float32 output")
        out32 = to_numpy(outs["float32"])
        assert_exact(outs[None], out32.astype(to_numpy(outs[None]).dtype), "cast once, round to nearest even")
        assert_exact(h, h_before, "h unchanged")

    def check_fused(self, q, s, a32, quantize, M: int, I: int, quant: str, group_size: int, what: str) -> None:
        """Codes ``[M, I]`` float8_e4m3fn and float32 scales ``[M, 1]`` / ``[M, I // G]``, bit-identical to
        ``quantize`` applied to the float32 activation ``a32`` of the same implementation."""
        qn, sn = to_numpy(q), to_numpy(s)
        spans = 1 if quant == "fp8_per_token" else I // group_size
        assert qn.dtype.name == "float8_e4m3fn" and qn.shape == (M, I), f"{what}: codes {qn.dtype} {qn.shape}"
        assert sn.dtype == np.float32 and sn.shape == (M, spans), f"{what}: scales {sn.dtype} {sn.shape}"
        q2, s2 = quantize(a32, quant, group_size)
        assert_exact(s, s2, f"{what}: scales vs quantizing its own float32 activation")
        assert_exact(q, q2, f"{what}: codes vs quantizing its own float32 activation")

    @pytest.mark.parametrize("activation", ACTIVATIONS)
    def test_act_and_mul_fp8(self, fp8_case, activation):
        """Fused FP8 (CONTRACT.md section 3): codes and scales bit-identical to the reference quantization of
        the backend's own float32 activation; the scales within F32_REL_FRO of the judge's fused op and the
        dequantized output within :attr:`FUSED_REL_FRO` of the judge's; within the FP8 step of the float32
        and float64 activations. Row 0's up half is zero, so its amax is 0 and its scale the floor
        ``1e-10 / 448``."""
        quant, G, M, I, dtype, blocks = ACT_FP8_CASES[fp8_case]
        h_np = h_problem(M, I, seed=I + M)
        h_np[0, I:] = 0
        h = self.array(h_np, dtype)
        ref64 = numpy_act_and_mul(to_numpy(h).astype(np.float64), activation)
        config = None if blocks is None else self.forced_config(*blocks)
        q, s = self.act_and_mul(h, activation, quant, G, config=config)
        a32, _ = self.act_and_mul(h, activation, out_dtype="float32")
        q_ref, s_ref = self.reference_act_and_mul(h_np, dtype, activation, quant, G)
        a32_ref, _ = self.reference_act_and_mul(h_np, dtype, activation, out_dtype="float32")
        self.check_fused(q, s, a32, self.quantize, M, I, quant, G, fp8_case)
        self.check_fused(q_ref, s_ref, a32_ref, self.reference_quantize, M, I, quant, G, f"judge {fp8_case}")
        deq, deq_ref = self.dequantize(q, s), self.reference_dequantize(q_ref, s_ref)
        for d, what in ((deq, "dequantized"), (deq_ref, "judge's dequantized")):
            assert_rel_fro(d, ref64, FP8_STEP_REL_FRO, f"{what} vs float64")
        assert_rel_fro(deq, a32_ref, FP8_STEP_REL_FRO, "dequantized vs the judge's float32 activation")
        assert_rel_fro(s, s_ref, F32_REL_FRO, "scales vs the judge's fused op")
        assert_rel_fro(deq, deq_ref, self.FUSED_REL_FRO, "dequantized vs the judge's fused op")

    @pytest.mark.parametrize("M,I", [(0, 128), (3, 0)])  # no rows; no columns (nothing to launch)
    @pytest.mark.parametrize("quant", [None, "fp8_per_token", "fp8_per_token_group"])
    def test_empty(self, M, I, quant):
        """Empty inputs give the judge's shapes, dtypes and values (per-token with ``I = 0``: the floor scale)."""
        h_np = np.ones((M, 2 * I), np.float32)
        got = self.act_and_mul(self.array(h_np, "bfloat16"), "silu", quant)
        want = self.reference_act_and_mul(h_np, "bfloat16", "silu", quant)
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if g is not None:
                assert_exact(g, w, "empty")
