"""The cases of the 4-bit weight quantizers (CONTRACT.md section 9) that every backend passes:
``quantize_weight_mxfp4`` / ``quantize_weight_int4`` and their dequantizations.

Named cases with their expected codes and values (every e2m1 tie, saturation, zero groups, the floor of the
scale exponent, the e8m0 NaN code and the subnormal scale, subnormal weights, the largest scale's overflow, the
INT4 extremes, ties and rounded scale, the nibble order of hand-built bytes, compressed-tensors' int32 view),
random weights against the independent numpy quantizers below (float64 for MXFP4; numpy's IEEE float32 division
and ``rint`` for INT4), round-trip bounds, 2-D weights, chunks and output dtypes, and the errors.

Subclassed by ``tests/test_quant_4bit_torch.py`` (``moe_torch``) and ``tests/test_quant_4bit_jax.py``
(``moe_pallas``). A subclass mixes in the arrays of its framework (``op_cases.TorchArrays`` / ``JaxArrays``),
names its framework's public module (:attr:`Quant4bitCases.OPS`) and implements :meth:`Quant4bitCases.not_an_array`.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from op_cases import ClassParams
from tolerances import assert_exact, to_numpy

FORMATS = ("mxfp4", "int4")
#: The e2m1 values of codes 0..15 (bit 3 the sign).
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def codes(w_q) -> np.ndarray:
    """Unpacked codes ``[..., K]`` of ``w_q [..., K // 2]`` (either framework), element ``2i`` from the low nibble."""
    b = to_numpy(w_q).astype(np.int64)
    return np.stack([b & 15, b >> 4], -1).reshape(*b.shape[:-1], -1)


def group(values, K: int = 32) -> np.ndarray:
    """``values`` padded with zeros to one float32 row of ``K`` (a ``[1, K]`` weight)."""
    g = np.zeros(K, np.float32)
    g[: len(values)] = values
    return g.reshape(1, K)


def f32_bits(a) -> np.ndarray:
    return np.asarray(to_numpy(a), np.float32).view(np.uint32)


def np_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Independent MXFP4 quantizer (float64 numpy, no flushing): ``(codes [..., K], s [..., K // 32])``."""
    g = w.astype(np.float32).reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(g).max(-1).astype(np.float64)
    with np.errstate(divide="ignore"):
        fl = np.where(amax > 0, np.floor(np.log2(amax)), -1000)
    s = np.clip(fl - 2 + 127, 0, 254).astype(np.int64)
    v = (g.astype(np.float64) / 2.0 ** (s[..., None] - 127)).astype(np.float32)  # fl32 of the quotient
    a = np.abs(v).astype(np.float64)
    d = np.abs(a[..., None] - E2M1[:8])
    tie = (d == d.min(-1, keepdims=True)).sum(-1) > 1
    even = np.argmax((d == d.min(-1, keepdims=True)) & (np.arange(8) % 2 == 0), -1)
    mag = np.where(tie, even, np.argmin(d, -1))
    return (mag | ((v < 0) << 3)).reshape(w.shape), s


def np_int4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Independent INT4 quantizer (numpy float32 IEEE division, ``rint``): ``(codes, scale bf16)``."""
    g = w.astype(np.float32).reshape(*w.shape[:-1], -1, 32)
    scale = (np.maximum(np.abs(g).max(-1), np.float32(1e-10)) * np.float32(2 / 15)).astype(ml_dtypes.bfloat16)
    q = np.clip(np.rint(g / scale.astype(np.float32)[..., None]), -8, 7)
    return (q + 8).astype(np.int64).reshape(w.shape), scale


# One group with amax 7.9: floor(log2(7.9)) = 2, s = 2 - 2 + 127 = 127, the multiplier 2^0 = 1, so v = w.
# (value, expected code): every e2m1 tie of section 9 goes to the even code; just off a tie goes to
# the nearer value; 7.9 saturates to 6; -0.1 rounds to -0 (code 8, the sign bit set because v < 0).
MXFP4_CASES = [
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),  # the ties
    (0.2500001, 1), (0.7499999, 1), (1.2500001, 3), (1.7499999, 3), (2.5000002, 5), (3.4999998, 5), (5.0000005, 7),
    (7.9, 7), (6.0, 7), (-0.1, 8), (0.0, 0), (-0.75, 10), (-5.0, 14), (-7.9, 15), (0.5, 1), (-0.25, 8), (4.0, 6),
]

#: The shape of the random weights: one for every such case, so that JAX compiles one quantizer program for them.
SHAPE = (2, 6, 96)
#: ``chunk_bytes`` of one expert of :data:`SHAPE` in float32 (its rows: the shape of a 2-D weight, compiled once).
ONE_EXPERT = SHAPE[1] * SHAPE[2] * 4
#: Random weights of the numpy comparison: magnitude x dtype (float16 only where it holds the values).
RANDOM_WEIGHTS = [(m, d) for d in ("float32", "bfloat16", "float16") for m in (1.0, 1e-3, 1e30, 1e-38, 1e-42)
                  if d != "float16" or 1e-3 <= m <= 1.0]


class Quant4bitCases(ClassParams):
    """The 4-bit quantizers' cases, for any implementation.

    Hooks: ``array`` (the framework mixin: numpy -> the framework's array, ``ml_dtypes.bfloat16`` bits kept),
    :attr:`OPS` (the public module holding ``quantize_weight_{mxfp4,int4}`` and ``dequantize_weight_{...}``, which
    take ``out_dtype`` by name) and :meth:`not_an_array`. Results are read with ``tolerances.to_numpy``.
    """

    #: The framework's public module (``moe_torch`` / ``moe_pallas``).
    OPS = None

    def not_an_array(self) -> tuple[object, str]:
        """A weight of another framework the quantizers must refuse with TypeError, and the message's regex after
        ``quantize_weight_<fmt>: ``."""
        raise NotImplementedError

    def quantize(self, fmt: str, w, **kw):
        return getattr(self.OPS, f"quantize_weight_{fmt}")(w, **kw)

    def dequantize(self, fmt: str, w_q, w_scale, **kw):
        return getattr(self.OPS, f"dequantize_weight_{fmt}")(w_q, w_scale, **kw)

    # --- MXFP4: named cases ---------------------------------------------------------------------------

    def test_mxfp4_named_ties_saturation_and_sign(self):
        """:data:`MXFP4_CASES` in one group of scale 1: uint8 codes and scale, each code, the dequantized e2m1
        values, and -0.1 dequantized to -0.0."""
        w_q, w_scale = self.quantize("mxfp4", self.array(group([v for v, _ in MXFP4_CASES])))
        q, s = to_numpy(w_q), to_numpy(w_scale)
        assert q.dtype == np.uint8 and q.shape == (1, 16)
        assert s.dtype == np.uint8 and s.tolist() == [[127]]
        want = [c for _, c in MXFP4_CASES] + [0] * (32 - len(MXFP4_CASES))
        assert codes(w_q)[0].tolist() == want
        wd = to_numpy(self.dequantize("mxfp4", w_q, w_scale))
        assert_exact(wd[0], E2M1[want].astype(np.float32), "e2m1 values times 2^0")
        assert np.signbit(wd[0, 16]) and wd[0, 16] == 0.0, "-0.1 dequantizes to -0.0"

    def test_mxfp4_every_e2m1_tie_goes_to_the_even_code(self):
        # amax = 6 -> s = floor(log2 6) - 2 + 127 = 127: scale 1, v = w. Ties (CONTRACT.md section 9):
        # 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4, and their negatives.
        ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
        w = group([6.0, *ties, *(-t for t in ties), 0.2500001, 0.7499999, 5.0000005])
        q, s = self.quantize("mxfp4", self.array(w))
        assert to_numpy(s).tolist() == [[127]]
        expected = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 1, 1, 7]  # -0.25 -> code 8 (-0): v < 0
        assert codes(q)[0, :18].tolist() == expected
        assert codes(q)[0, 18:].tolist() == [0] * 14

    def test_mxfp4_saturates_above_6(self):
        # amax = 7.9 -> s = 127 (floor(log2 7.9) = 2): |v| = 7.9 rounds to the largest value, 6 (code 7).
        q, s = self.quantize("mxfp4", self.array(group([7.9, -7.9, 5.5, -6.5])))
        assert to_numpy(s).tolist() == [[127]]
        assert codes(q)[0, :4].tolist() == [7, 15, 7, 15]
        assert to_numpy(self.dequantize("mxfp4", q, s))[0, :4].tolist() == [6.0, -6.0, 6.0, -6.0]

    def test_mxfp4_zero_groups_have_scale_code_0_and_zero_codes(self):
        """amax = 0 -> s = 0 and every code 0: -0.0 divides to -0.0, which is not < 0 (code 0, not 8), whether
        the group is all -0.0 or holds one; beside each, a group of amax 1 -> s = 0 - 2 + 127 = 125."""
        # a third, zero group in each row: the [1, 96] rows of SHAPE, one program for these and the chunked rows
        w = np.zeros((3, SHAPE[-1]), np.float32)
        w[0, 32:64] = -0.0
        w[1, 32:64] = np.linspace(-1, 1, 32)
        w[2, 3], w[2, 40] = -0.0, 1.0
        for row, s in ((0, [[0, 0, 0]]), (1, [[0, 125, 0]]), (2, [[0, 125, 0]])):  # one weight of one row each
            w_q, w_scale = self.quantize("mxfp4", self.array(w[row:row + 1]))
            assert to_numpy(w_scale).tolist() == s, row
            assert not codes(w_q)[0, :32].any(), row
            if row == 0:  # all +-0: every code 0, dequantized 0
                assert not codes(w_q).any() and not to_numpy(self.dequantize("mxfp4", w_q, w_scale)).any()

    def test_mxfp4_scale_exponent_is_floor_not_round(self):
        """amax just under 1 (0.99999994): floor(log2) = -1, s = 124, v = amax * 8 = 7.9999995 -> saturates to 6;
        amax = 2^-120: s = 5, v = 4 exactly (code 6)."""
        w_q, w_scale = self.quantize("mxfp4", self.array(group([np.nextafter(np.float32(1), np.float32(0)), 0.3])))
        assert to_numpy(w_scale).tolist() == [[124]] and codes(w_q)[0, :2].tolist() == [7, 4]  # 0.3 * 8 = 2.4 -> 2
        w_q, w_scale = self.quantize("mxfp4", self.array(group([2.0**-120, -(2.0**-121)])))
        assert to_numpy(w_scale).tolist() == [[5]] and codes(w_q)[0, :2].tolist() == [6, 12]

    def test_mxfp4_subnormal_amax(self):
        """amax = 3 * 2^-128 is a float32 subnormal: floor(log2) = -127 clamps s to 0 (the multiplier 2^-127,
        itself subnormal); v = w * 2^127: 1.5 (code 3), 1 (code 2), -0.5 (code 9), 2^-22 (code 0). Dequantized
        exactly."""
        vals = [3 * 2.0**-128, 2.0**-127, -(2.0**-128), 2.0**-149]
        assert np.float32(vals[0]) < np.finfo(np.float32).tiny
        w_q, w_scale = self.quantize("mxfp4", self.array(group(vals)))
        assert to_numpy(w_scale).tolist() == [[0]]
        assert codes(w_q)[0, :4].tolist() == [3, 2, 9, 0]
        wd = to_numpy(self.dequantize("mxfp4", w_q, w_scale))
        assert wd[0, :4].tolist() == [3 * 2.0**-128, 2.0**-127, -(2.0**-128), 0.0]

    def test_bug_mxfp4_subnormal_weights_get_their_codes(self):
        """A group of subnormal weights: ``amax < 2^-126`` -> ``s = 0``, ``v = w * 2^127`` is an ordinary number.
        ``2^-127 -> v = 1`` (code 2), ``1.5 * 2^-127 -> 1.5`` (code 3), ``2^-129 -> 0.25`` (tie: code 0),
        ``-2^-128 -> -0.5`` (code 9). The first JAX version multiplied in float32 and XLA's CPU runtime flushed
        the subnormal inputs: every code was 0."""
        q, s = self.quantize("mxfp4", self.array(group([2.0**-127, 1.5 * 2.0**-127, 2.0**-129, -(2.0**-128)])))
        assert to_numpy(s).tolist() == [[0]]
        assert codes(q)[0, :5].tolist() == [2, 3, 0, 9, 0]

    def test_mxfp4_sign_bit_only_where_the_quotient_is_nonzero(self):
        # amax = 2^100 -> s = 225: v = w * 2^-98. -2^-30 -> v = -2^-128 (subnormal, nonzero): code 8 (-0);
        # -2^-149 -> v underflows to -0.0, which is not < 0: code 0. (CONTRACT.md: "the sign bit is set when v < 0".)
        q, s = self.quantize("mxfp4", self.array(group([2.0**100, -(2.0**-30), -(2.0**-149)])))
        assert to_numpy(s).tolist() == [[225]]
        assert codes(q)[0, :3].tolist() == [6, 8, 0]

    def test_mxfp4_e8m0_255_is_a_nan_group_and_0_is_2_pow_minus_127(self):
        """Random codes under chosen scales: exactly the groups with s = 255 are NaN, all of each; the others are
        the exact products (s = 0: the subnormal multiplier 2^-127; s = 254: |e2m1| >= 2 overflows to +-inf)."""
        rng = np.random.default_rng(0)
        q_np = rng.integers(0, 256, (2, 3, 32), dtype=np.uint8)
        s_np = np.array([[[127, 255], [0, 254], [1, 130]], [[255, 255], [127, 128], [126, 3]]], np.uint8)
        wd = to_numpy(self.dequantize("mxfp4", self.array(q_np), self.array(s_np)))
        nan_groups = np.repeat(s_np == 255, 32, axis=-1)
        assert np.array_equal(np.isnan(wd), nan_groups), "exactly the groups with s = 255 are NaN, all of each"
        c = codes(q_np)
        expected = E2M1[c] * np.exp2(s_np.astype(np.float64) - 127).repeat(32, axis=-1)
        with np.errstate(over="ignore"):  # s = 254: 2 * 2^127 and above overflow float32 (IEEE: inf)
            expected32 = expected.astype(np.float32)
        assert np.array_equal(wd[~nan_groups], expected32[~nan_groups]), "exact products, subnormals too"
        assert np.abs(wd[0, 1, :32]).max() <= 6 * 2.0**-127  # s = 0: the subnormal multiplier 2^-127
        big, small = wd[0, 1, 32:], np.abs(E2M1[c[0, 1, 32:]]) < 2  # s = 254
        assert np.isinf(big[~small]).all() and np.isfinite(big[small]).all() and (~small).any()

    def test_mxfp4_scale_255_dequantizes_its_group_to_nan(self):
        w_q = np.full((1, 32), 0x21, np.uint8)  # codes 1, 2 (0.5, 1.0) everywhere, code 0 nowhere
        w_q[0, 16] = 0  # a zero code in the NaN group: NaN too (OCP: the whole group)
        wd = to_numpy(self.dequantize("mxfp4", self.array(w_q), self.array(np.array([[127, 255]], np.uint8))))
        assert wd[0, :4].tolist() == [0.5, 1.0, 0.5, 1.0]
        assert np.isnan(wd[0, 32:]).all() and np.isfinite(wd[0, :32]).all()

    def test_bug_mxfp4_scale_code_0_is_the_subnormal_2_to_the_minus_127(self):
        """``s = 0`` means ``2^-127``, a subnormal float32: code 1 (0.5) dequantizes to ``2^-128`` (bits
        0x00200000) and code 7 (6) to ``1.5 * 2^-125``. XLA's CPU runtime flushes subnormal results of float
        multiplications to zero (the first JAX version gave 0 here, while torch gives ``2^-128``); the JAX
        dequantizer builds them on the bits."""
        w_q = self.array(np.array([[0x71, 0x9F] + [0] * 14], np.uint8))  # codes 1, 7, 15, 9
        wd = self.dequantize("mxfp4", w_q, self.array(np.array([[0]], np.uint8)))
        assert f32_bits(wd)[0, :4].tolist() == f32_bits([2.0**-128, 1.5 * 2.0**-125, -1.5 * 2.0**-125,
                                                         -(2.0**-128)]).tolist()
        wd2 = self.dequantize("mxfp4", w_q, self.array(np.array([[2]], np.uint8)))  # 2^-125
        assert f32_bits(wd2)[0, :2].tolist() == f32_bits([2.0**-126, 1.5 * 2.0**-123]).tolist()

    def test_mxfp4_largest_scale_overflows_to_inf(self):
        # s = 254: 6 * 2^127 is above float32's range -> inf (IEEE); 1.5 * 2^127 is finite.
        w_q = self.array(np.array([[0x37] + [0] * 15], np.uint8))  # codes 7 (6), 3 (1.5)
        wd = to_numpy(self.dequantize("mxfp4", w_q, self.array(np.array([[254]], np.uint8))))
        assert wd[0, 0] == np.inf and wd[0, 1] == np.float32(1.5 * 2.0**127)

    def test_mxfp4_round_trip_is_the_nearest_e2m1_multiple(self):
        """Random weights over many binades: every element is rounded to a nearest e2m1 multiple of its group's
        2^(s - 127) (or 6 when |v| > 6), and the dequantized weights re-quantize to themselves."""
        rng = np.random.default_rng(1)
        w = (rng.standard_normal(SHAPE)
             * np.exp(rng.uniform(-20, 20, (*SHAPE[:-1], 3, 1))).repeat(32, -1).reshape(SHAPE)).astype(np.float32)
        w_q, w_scale = self.quantize("mxfp4", self.array(w))
        wd = to_numpy(self.dequantize("mxfp4", w_q, w_scale)).astype(np.float64)
        mult = np.exp2(to_numpy(w_scale).astype(np.float64) - 127).repeat(32, axis=-1)
        v = w.astype(np.float64) / mult
        dist = np.abs(np.abs(v)[..., None] - np.abs(E2M1[:8]))
        got = np.abs(np.abs(v) - np.abs(wd) / mult)
        assert np.all((got == dist.min(-1)) | ((np.abs(v) > 6) & (np.abs(wd) / mult == 6)))
        vmax = np.abs(v).reshape(*SHAPE[:-1], 3, 32).max(-1)
        assert np.all(vmax < 8) and np.all(vmax >= 4)
        assert np.all(np.sign(wd) * np.sign(v) >= 0), "signs kept"
        q2, s2 = self.quantize("mxfp4", self.array(wd.astype(np.float32)))
        # idempotent on its own grid (as values: a -0 re-quantizes to code 0, +0)
        assert np.array_equal(to_numpy(self.dequantize("mxfp4", q2, s2)), wd.astype(np.float32))

    # --- INT4: named cases ----------------------------------------------------------------------------

    def test_int4_named_codes_amax_and_ties(self):
        """amax = 7.5: scale = bf16(7.5 * float32(2/15)) = 1 exactly, so q = rne(w): 7.5 -> 8 clamps to 7 (code
        15), -7.5 -> -8 (code 0), ties to even 2.5 -> 2, 3.5 -> 4, -2.5 -> -2, 0.5 -> 0, 1.5 -> 2; offset binary
        q + 8; zeros are code 8."""
        vals = [7.5, -7.5, 2.5, 3.5, -2.5, 0.5, 1.5, -0.49, 6.6]
        w_q, w_scale = self.quantize("int4", self.array(group(vals)))
        s = to_numpy(w_scale)
        assert s.dtype == ml_dtypes.bfloat16 and s.astype(np.float32).tolist() == [[1.0]]
        assert codes(w_q)[0, : len(vals)].tolist() == [15, 0, 10, 12, 6, 8, 10, 8, 15]
        assert (codes(w_q)[0, len(vals):] == 8).all(), "zeros are code 8"

    def test_int4_extremes_and_ties(self):
        # amax = 7.5 -> scale = bf16(7.5 * float32(2/15)) = 1.0, q = rne(w): ties to even, clamp to [-8, 7].
        w = group([7.5, -7.5, 6.5, 5.5, -0.5, 0.5, 1.5, -2.5, 0.4999999, -7.0])
        q, s = self.quantize("int4", self.array(w))
        assert to_numpy(s).astype(np.float32).tolist() == [[1.0]]
        assert (codes(q)[0, :10] - 8).tolist() == [7, -8, 6, 6, 0, 0, 2, -2, 0, -7]
        assert (codes(q)[0, 10:] - 8).tolist() == [0] * 22
        assert to_numpy(self.dequantize("int4", q, s))[0, :2].tolist() == [7.0, -8.0]

    def test_int4_amax_and_minus_amax_codes_with_a_rounded_scale(self):
        """amax = 1: float32(1 * 2/15) = 0.13333334 rounds to bf16 0.1337890625 (137/128 * 2^-3); 1 / that = 7.47
        -> 7 (code 15) and -1 -> -7 (code 1); dequantized: +-0.9365234375."""
        w_q, w_scale = self.quantize("int4", self.array(group([1.0, -1.0, 0.2])))
        assert to_numpy(w_scale).astype(np.float32).item() == 0.1337890625
        assert float(ml_dtypes.bfloat16(np.float32(1.0) * np.float32(2 / 15))) == 0.1337890625
        assert codes(w_q)[0, :3].tolist() == [15, 1, 9]  # 0.2 / 0.1338 = 1.49 -> 1
        wd = to_numpy(self.dequantize("int4", w_q, w_scale))
        assert wd[0, :3].tolist() == [7 * 0.1337890625, -7 * 0.1337890625, 0.1337890625]

    def test_int4_zero_group_scale_is_the_floor(self):
        """amax 0: the scale is bf16(1e-10 * 2/15) bit for bit (finite, > 0), every code 8 (q = 0), dequantized
        exactly 0."""
        w_q, w_scale = self.quantize("int4", self.array(np.zeros((1, 32), np.float32)))
        expected = (np.float32(1e-10) * np.float32(2 / 15)).astype(ml_dtypes.bfloat16)
        assert float(expected) > 0
        assert_exact(w_scale, np.array([[expected]]), "int4 scale of an all-zero group")
        assert (to_numpy(w_q) == 0x88).all()
        assert not to_numpy(self.dequantize("int4", w_q, w_scale)).any()

    def test_int4_near_ties_follow_the_ieee_quotient(self):
        # w = (k + 0.5) * scale, moved by -2..2 ulp: the float32 quotient decides (numpy's IEEE division + rint).
        rng = np.random.default_rng(3)
        w = rng.standard_normal((4, 8, 64)).astype(np.float32)
        _, scale = np_int4(w)
        k = rng.integers(-8, 8, size=w.shape) + 0.5
        w = (k * np.repeat(scale.astype(np.float32), 32, -1)).astype(np.float32)
        w = (w.view(np.int32) + rng.integers(-2, 3, size=w.shape).astype(np.int32)).view(np.float32)
        q, s = self.quantize("int4", self.array(w))
        c, sc = np_int4(w)
        assert_exact(s, sc, "int4 scales")
        assert_exact(codes(q), c, "int4 codes near ties")

    def test_int4_round_trip_bound(self):
        """Each element within half a step of its group's scale, except above 7.5 steps (clamped to 7)."""
        rng = np.random.default_rng(2)
        w = (rng.standard_normal(SHAPE) * np.exp(rng.uniform(-8, 8, SHAPE))).astype(np.float32)
        w_q, w_scale = self.quantize("int4", self.array(w))
        q = codes(w_q).astype(np.float64) - 8
        scale = to_numpy(w_scale).astype(np.float64).repeat(32, axis=-1)
        r = w.astype(np.float64) / scale
        assert np.all((np.abs(r - q) <= 0.5) | ((q == 7) & (r > 7.5)))
        assert_exact(self.dequantize("int4", w_q, w_scale), (q * scale).astype(np.float32), "q * scale")

    # --- Layout ---------------------------------------------------------------------------------------

    def test_mxfp4_nibble_order_on_hand_built_bytes(self):
        """Byte 0x9F: element 0 = low nibble 0xF (-6), element 1 = high nibble 0x9 (-0.5); 0x71: element 2 = code
        1 (0.5), element 3 = code 7 (6). Under s = 128 (times 2), and under s = 127 with 0x88 (-0) after it; the
        quantizer packs the same way."""
        # one group a call: the [1, 16] codes of the single-group cases (JAX compiles a program per shape)
        for row, s, want, packed in (([0x9F, 0x71] + [0] * 14, 128, [-12.0, -1.0, 1.0, 12.0], [0x9F, 0x71]),
                                     ([0x9F] + [0x88] * 15, 127, [-6.0, -0.5], [0x9F, 0])):  # +0 after: code 0
            wd = to_numpy(self.dequantize("mxfp4", self.array(np.array([row], np.uint8)),
                                          self.array(np.array([[s]], np.uint8))))
            assert wd[0, :len(want)].tolist() == want and not wd[0, len(want):].any(), (row[:2], s)
            q, sq = self.quantize("mxfp4", self.array(group(want)))
            assert to_numpy(sq).tolist() == [[s]] and to_numpy(q)[0, :2].tolist() == packed, (row[:2], s)

    def test_int4_offset_binary_nibble_order_on_hand_built_bytes(self):
        """Byte 0x9F: element 0 = low nibble 15 -> q = 7, element 1 = high nibble 9 -> q = 1; then 0x08 (q = 0,
        -8) or 0x88 (q = 0, 0); under a scale of 0.5."""
        for second, want in ((0x08, [3.5, 0.5, 0.0, -4.0]), (0x88, [3.5, 0.5])):
            w_q = np.array([[0x9F, second] + [0x88] * 14], np.uint8)
            half = self.array(np.array([[0.5]], np.float32), "bfloat16")
            wd = to_numpy(self.dequantize("int4", self.array(w_q), half))
            assert wd[0, :len(want)].tolist() == want and not wd[0, len(want):].any(), hex(second)

    @pytest.mark.parametrize("seed", [3, 5])
    def test_int4_codes_are_compressed_tensors_weight_packed_as_little_endian_int32(self, seed):
        """compressed-tensors' weight_packed [N, K // 8] int32 holds element i at bits 4i: it is w_q viewed as
        little-endian int32, byte for byte."""
        w = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)
        q, _ = self.quantize("int4", self.array(w))
        c = codes(q).astype(np.int64)
        expected = sum(c[..., i::8] << (4 * i) for i in range(8)).astype(np.uint32).view(np.int32)
        assert_exact(to_numpy(q).view("<i4"), expected, "weight_packed")

    # --- Random weights and scales against numpy ------------------------------------------------------

    @pytest.mark.parametrize("magnitude,dtype", RANDOM_WEIGHTS)  # normal .. all-subnormal groups
    def test_random_weights_match_numpy(self, magnitude, dtype):
        """Both formats: codes and scales bit for bit those of the numpy quantizers, dequantized values the exact
        products, for float32 / bf16 / float16 weights from normal to all-subnormal groups."""
        rng = np.random.default_rng(11)
        w = self.array((rng.standard_normal(SHAPE) * magnitude).astype(np.float32), dtype)
        w32 = to_numpy(w).astype(np.float32)
        q, s = self.quantize("mxfp4", w)
        c, sc = np_mxfp4(w32)
        qn, sn = to_numpy(q), to_numpy(s)
        assert qn.shape == (2, 6, 48) and qn.dtype == np.uint8 and sn.shape == (2, 6, 3) and sn.dtype == np.uint8
        assert_exact(sn.astype(np.int64), sc, "mxfp4 scales")
        assert_exact(codes(q), c, "mxfp4 codes")
        expected = (E2M1[c].reshape(2, 6, 3, 32) * 2.0 ** (sc.astype(np.float64) - 127)[..., None]).astype(np.float32)
        assert_exact(self.dequantize("mxfp4", q, s), expected.reshape(SHAPE), "mxfp4 dequantized")
        q, s = self.quantize("int4", w)
        c, sc = np_int4(w32)
        assert to_numpy(s).dtype == ml_dtypes.bfloat16
        assert_exact(s, sc, "int4 scales")
        assert_exact(codes(q), c, "int4 codes")
        expected = (c - 8).astype(np.float32).reshape(2, 6, 3, 32) * sc.astype(np.float32)[..., None]
        assert_exact(self.dequantize("int4", q, s), expected.reshape(SHAPE), "int4 dequantized")

    def test_random_scales_dequantize_exactly(self):
        # every byte and every e8m0 code (0: subnormal, 255: NaN); bf16 scales of any bits (subnormal, negative,
        # inf, NaN): the IEEE float32 products, as numpy computes them (no flushing).
        rng = np.random.default_rng(2)
        w_q = rng.integers(0, 256, size=(2, 4, 1024), dtype=np.uint8)
        s = rng.integers(0, 256, size=(2, 4, 64), dtype=np.uint8)
        c = codes(w_q)
        with np.errstate(over="ignore"):
            expected = (E2M1[c].reshape(2, 4, 64, 32) * np.where(s == 255, np.nan, 2.0 ** (s - 127.0))[..., None])
            expected = expected.astype(np.float32).reshape(2, 4, 2048)
        wd = to_numpy(self.dequantize("mxfp4", self.array(w_q), self.array(s)))
        nan = np.isnan(expected)
        assert (np.isnan(wd) == nan).all()
        assert_exact(np.where(nan, 0, wd), np.where(nan, 0, expected), "mxfp4 any codes")
        sb = rng.integers(0, 1 << 16, size=(2, 4, 64), dtype=np.uint16)
        sb[0, 0, :8] = [0x0001, 0x007F, 0x8001, 0x0080, 0x7F80, 0xFF80, 0x7FC0, 0x8000]
        scale = sb.view(ml_dtypes.bfloat16)
        with np.errstate(invalid="ignore", over="ignore"):
            expected = ((c - 8).astype(np.float32).reshape(2, 4, 64, 32)
                        * scale.astype(np.float32)[..., None]).reshape(2, 4, 2048)
        wd = to_numpy(self.dequantize("int4", self.array(w_q), self.array(scale)))
        nan = np.isnan(expected)
        assert (np.isnan(wd) == nan).all()
        assert_exact(np.where(nan, 0, wd), np.where(nan, 0, expected), "int4 any scales")

    def test_bug_float16_output_keeps_its_subnormals(self):
        """``out_dtype=float16`` of a value below float16's smallest normal (``2^-14``): ``2^-17`` is a float16
        subnormal and ``3 * 2^-26`` rounds to ``2^-24`` (the grid's nearest even). The JAX rounding helper
        ``moe_pallas.ops.common.cast_rounded`` used ``lax.reduce_precision``, which flushes them to 0 (torch and
        numpy keep them): the first version returned 0 for both."""
        w_q = self.array(np.array([[0x99] + [0x88] * 15], np.uint8))  # codes 9, 9: q = 1
        for scale, expected in ((2.0**-17, 2.0**-17), (3 * 2.0**-26, 2.0**-24)):
            s = self.array(np.array([[scale]], np.float32), "bfloat16")
            wd = to_numpy(self.dequantize("int4", w_q, s, out_dtype="float16"))
            assert wd.dtype == np.float16 and wd[0, :2].astype(np.float64).tolist() == [expected, expected]

    # --- Both formats: 2-D weights, chunks, output dtypes ---------------------------------------------

    @pytest.mark.parametrize("fmt", FORMATS)
    def test_2d_bf16_chunks_and_out_dtypes(self, fmt):
        """float32 and bf16 weights: a bf16 weight quantizes as its float32 value and is not modified; ``[N, K]``
        equals the 3-D result's expert; every chunk size (one row a chunk for float32's expert 1, one expert for
        bf16) gives the same bits; bf16 / float16 outputs are the float32 dequantization rounded to nearest even."""
        w32 = np.random.default_rng(4).standard_normal(SHAPE).astype(np.float32)
        wb = self.array(w32, "bfloat16")
        before = to_numpy(wb).copy()
        qb, sb = self.quantize(fmt, wb)
        assert_exact(wb, before, "the caller's weight")
        qf, sf = self.quantize(fmt, self.array(to_numpy(wb).astype(np.float32)))
        assert_exact(qb, qf, "bf16 codes as float32's")
        assert_exact(sb, sf, "bf16 scales as float32's")
        # chunked: the float32 weight's expert 1 ([N, K]) one row a chunk (chunk_bytes under a row: at least one),
        # the 3-D bf16 weight one expert a chunk (JAX compiles a program per chunk shape: these are the 2-D ones')
        for w, chunked, chunk_bytes in ((self.array(w32), 1, 1), (wb, slice(None), ONE_EXPERT)):
            q, s = self.quantize(fmt, w)
            assert to_numpy(q).shape == (2, 6, 48) and to_numpy(s).shape == (2, 6, 3)
            q2, s2 = self.quantize(fmt, w[1])
            assert_exact(q2, to_numpy(q)[1], "2-D codes")
            assert_exact(s2, to_numpy(s)[1], "2-D scales")
            q3, s3 = self.quantize(fmt, w[chunked], chunk_bytes=chunk_bytes)
            assert_exact(q3, to_numpy(q)[chunked], "chunked codes")
            assert_exact(s3, to_numpy(s)[chunked], "chunked scales")
            wd = to_numpy(self.dequantize(fmt, q, s))
            assert wd.dtype == np.float32
            for dt, np_dt in (("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)):
                assert_exact(self.dequantize(fmt, q, s, out_dtype=dt), wd.astype(np_dt), f"{fmt} -> {dt}")

    # --- Errors ---------------------------------------------------------------------------------------

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
    def test_non_finite_weights_are_a_value_error(self, fmt, bad):
        """Named by its index, in one chunk and in the last of several (rows 6..11: one expert a chunk)."""
        w = np.ones(SHAPE, np.float32)
        w[1, 2, 40] = bad
        for kw in ({}, {"chunk_bytes": ONE_EXPERT}):
            with pytest.raises(ValueError, match=rf"quantize_weight_{fmt}: w must be finite .* got w\[1, 2, 40\] = {bad}"):
                self.quantize(fmt, self.array(w), **kw)

    @pytest.mark.parametrize("fmt", FORMATS)
    def test_bad_inputs(self, fmt):
        scale_dtype = np.uint8 if fmt == "mxfp4" else ml_dtypes.bfloat16
        with pytest.raises(ValueError, match=rf"quantize_weight_{fmt}: K \(=w.shape\[-1\]\) must be a multiple of 32"):
            self.quantize(fmt, self.array(np.ones((2, 3, 48), np.float32)))
        with pytest.raises(ValueError, match=rf"quantize_weight_{fmt}: w must be \[E, N, K\] or \[N, K\]"):
            self.quantize(fmt, self.array(np.ones((2, 2, 3, 32), np.float32)))
        with pytest.raises(TypeError, match=rf"quantize_weight_{fmt}: w must have dtype"):
            self.quantize(fmt, self.array(np.ones((3, 32), np.int32)))
        foreign, message = self.not_an_array()
        with pytest.raises(TypeError, match=rf"quantize_weight_{fmt}: {message}"):
            self.quantize(fmt, foreign)
        with pytest.raises(ValueError, match=rf"quantize_weight_{fmt}: chunk_bytes must be an int >= 1"):
            self.quantize(fmt, self.array(np.ones((3, 32), np.float32)), chunk_bytes=0)
        w_q, w_scale = self.array(np.zeros((2, 3, 16), np.uint8)), self.array(np.zeros((2, 3, 1), scale_dtype))
        with pytest.raises(ValueError, match=rf"dequantize_weight_{fmt}: w_q must be .* K % 32 == 0"):
            self.dequantize(fmt, self.array(np.zeros((2, 3, 24), np.uint8)), w_scale)
        with pytest.raises(TypeError, match=rf"dequantize_weight_{fmt}: w_q must have dtype uint8"):
            self.dequantize(fmt, self.array(np.zeros((2, 3, 16), np.int8)), w_scale)
        for shape in ((2, 3, 2), (3, 1)):
            with pytest.raises(ValueError, match=rf"dequantize_weight_{fmt}: w_scale must be \[E, N, K // 32\] = \(2, 3, 1\)"):
                self.dequantize(fmt, w_q, self.array(np.zeros(shape, scale_dtype)))
        with pytest.raises(ValueError, match=rf"dequantize_weight_{fmt}: w_scale must be .*\(2, 1\)"):  # 2-D
            self.dequantize(fmt, self.array(np.zeros((2, 16), np.uint8)), self.array(np.zeros((2, 2), scale_dtype)))
        other = np.float32 if fmt == "mxfp4" else np.uint8
        want = "uint8" if fmt == "mxfp4" else "bfloat16"
        with pytest.raises(TypeError, match=rf"dequantize_weight_{fmt}: w_scale must have dtype {want} for {fmt}"):
            self.dequantize(fmt, w_q, self.array(np.zeros((2, 3, 1), other)))
        with pytest.raises(TypeError, match=rf"dequantize_weight_{fmt}: out_dtype must have dtype"):
            self.dequantize(fmt, w_q, w_scale, out_dtype="int32")
        with pytest.raises(ValueError, match=rf"dequantize_weight_{fmt}: w_scale must be given"):
            self.dequantize(fmt, w_q, None)
