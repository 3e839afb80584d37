"""The cases of ``combine`` (CONTRACT.md section 5) that every backend passes: float32 accumulation, rsf once,
non-local slots and rows >= M never read.

Subclassed by ``tests/test_combine.py`` (the torch op against the jnp op, through the public APIs with the default
implementation: the references on the CPU), ``tests/test_pallas_kernels.py`` (the Pallas-Triton kernel against
the jnp reference) and ``tests/test_triton_kernels.py`` (the Triton kernel against the torch reference). A
subclass mixes in the arrays of its framework (``op_cases.TorchArrays`` / ``JaxArrays``) and implements the hooks.

Outputs are compared with the judge's (float32 within ``F32_REL_FRO``, the input dtype within its row of
CONTRACT.md section 7) and with a float64 numpy combine; the checks against numpy run on the judge's result too.
"""

from __future__ import annotations

import numpy as np
import pytest

from common import random_ids
from op_cases import ClassParams
from op_cases.permute import metadata_of
from tolerances import BF16_REL_FRO, F32_REL_FRO, assert_exact, assert_rel_fro, to_numpy

LIMITS = {"float32": F32_REL_FRO, "bfloat16": BF16_REL_FRO}

#: name -> (T, topk, E, expert_start, E_local, H, rsf, forced blocks (block_t, block_h) or None); the comment
#: says which edge. A backend runs those it lists in ``SHAPES``.
COMBINE_SHAPES = {
    "T1": (1, 1, 2, 0, 2, 48, 1.0, None),  # T=1, topk=1
    "T1-odd-H": (1, 1, 2, 0, 2, 33, 1.0, None),  # T=1, odd H
    "rsf": (13, 3, 8, 0, 8, 48, 2.5, None),  # all local, rsf applied here; T below a token block, not a power of 2
    "two-token-programs": (70, 2, 8, 0, 8, 48, 1.0, None),  # T not a multiple of Triton's token block (64)
    "ep-rank": (16, 4, 16, 8, 4, 48, 1.0, None),  # EP rank: many non-local slots, some tokens with none
    "ep-rank-H64": (16, 4, 16, 8, 4, 64, 1.0, None),  # the same, H a power of 2
    "partial-blocks": (13, 6, 16, 4, 5, 100, 2.5, (4, 32)),  # forced blocks: partial in both grid dims
    "wide-H": (3, 2, 4, 2, 2, 1100, 1.0, None),  # H wider than one column block (1024): two column blocks
    "wide-H-topk8": (9, 8, 32, 4, 8, 1100, 0.5, None),  # H > one block, odd; topk=8 unrolled; EP rank
}


def numpy_combine(y, src2dst, w, rsf):
    """``out[t] = rsf * sum_j w[t, j] * y[src2dst[t, j]]`` over local slots, in float64."""
    out = np.zeros((src2dst.shape[0], y.shape[1]))
    for t, j in zip(*np.nonzero(src2dst >= 0)):
        out[t] += w[t, j] * y[src2dst[t, j]].astype(np.float64)
    return out * rsf


def combine_problem(T: int, topk: int, E: int, start: int, e_local: int, H: int, seed: int,
                    nan_weights: bool = True):
    """``(y [T*topk, H] float32, src2dst [T, topk] int32, topk_weights [T, topk] float32, M)`` in numpy. Rows
    ``>= M`` of ``y`` are NaN (never read), and with ``nan_weights`` the weights of non-local slots too; on an
    EP rank token 0 goes to other ranks only (a token with no local slot)."""
    rng = np.random.default_rng(seed)
    ids = random_ids(rng, T, topk, E)
    if e_local < E:
        ids[0] = rng.permutation([e for e in range(E) if not start <= e < start + e_local])[:topk]
    offsets, src2dst, _ = metadata_of(ids, start, e_local)
    M = int(offsets[-1])
    y = rng.standard_normal((T * topk, H)).astype(np.float32)
    y[M:] = np.nan  # rows >= M hold garbage: they must never reach the output
    w = rng.uniform(0.1, 1.0, (T, topk)).astype(np.float32)
    if nan_weights:
        w[src2dst < 0] = np.nan  # a non-local slot's weight is never used
    return y, src2dst, w, M


class CombineCases(ClassParams):
    """``combine``'s cases, for any implementation.

    Hooks: ``array`` / ``strided`` (the framework mixin), :meth:`combine` (the backend under test),
    :meth:`reference_combine` (its judge), :meth:`forced_config`; :attr:`SHAPES`.
    """

    #: The keys of :data:`COMBINE_SHAPES` this backend runs.
    SHAPES: tuple[str, ...] = tuple(COMBINE_SHAPES)
    #: Whether the weights of non-local slots are NaN in :meth:`test_combine` (the contract: a non-local slot
    #: contributes nothing, its weight included).
    NAN_WEIGHTS_OF_NONLOCAL_SLOTS = True
    CLASS_PARAMS = {"shape": "SHAPES"}

    def combine(self, y, src2dst, w, rsf: float, out_dtype: str | None = None, config=None):
        """The backend under test (``out_dtype`` a key of ``common.TORCH_DTYPES`` / ``JNP_DTYPES``, None: y's).
        ``config=None``: the public op; else the kernel with that launch config."""
        raise NotImplementedError

    def reference_combine(self, y_np, dtype: str, src2dst_np, w_np, rsf: float, out_dtype: str | None = None):
        """The judge's output for numpy inputs (``y_np`` cast to ``dtype``)."""
        raise NotImplementedError

    def forced_config(self, block_t: int, block_h: int):
        """A launch config of ``block_t`` tokens x ``block_h`` columns per program (None: the backend has no
        launch configs; the public op runs)."""
        return None

    def check_output(self, out, T: int, H: int, dtype: str, ref64, no_local, limit: float, what: str) -> None:
        """``out [T, H]`` of ``dtype``, finite, within ``limit`` of the float64 combine; tokens with no local slot
        get exactly 0."""
        o = to_numpy(out)
        assert o.shape == (T, H) and o.dtype.name == dtype, f"{what}: {o.dtype} {o.shape}"
        assert np.isfinite(o.astype(np.float32)).all(), f"{what}: non-finite values (unwritten or leaked)"
        assert_rel_fro(out, ref64, limit, f"{what} vs float64")
        assert not o[no_local].astype(np.float32).any(), f"{what}: tokens with no local slot get exactly 0"

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_combine(self, shape, dtype):
        """Output in y's dtype within its tolerance of the judge and of a float64 combine; the float32 output
        within F32_REL_FRO of both; the dtype output the round-to-nearest-even cast of the float32 one (cast once);
        rows >= M of y (NaN) and the weights of non-local slots (NaN, see
        :attr:`NAN_WEIGHTS_OF_NONLOCAL_SLOTS`) never reach the output; tokens with no local slot get exactly 0;
        the inputs are untouched."""
        T, topk, E, start, e_local, H, rsf, blocks = COMBINE_SHAPES[shape]
        y_np, s_np, w_np, M = combine_problem(T, topk, E, start, e_local, H, seed=T * 100 + H,
                                              nan_weights=self.NAN_WEIGHTS_OF_NONLOCAL_SLOTS)
        no_local = (s_np < 0).all(axis=1)
        if start:
            assert no_local.any() and M < T * topk, "the case must exercise tokens with no local slot and unused rows"
        y, s, w = self.array(y_np, dtype), self.array(s_np), self.array(w_np)
        before = [to_numpy(a).copy() for a in (y, s, w)]
        ref64 = numpy_combine(to_numpy(y).astype(np.float64), s_np, w_np, rsf)  # of y as rounded to dtype
        config = None if blocks is None else self.forced_config(*blocks)
        outs = {}
        for out_dtype, limit in ((None, LIMITS[dtype]), ("float32", F32_REL_FRO)):  # None: y's dtype
            what = f"{shape} {dtype} -> {out_dtype or dtype}"
            got = self.combine(y, s, w, rsf, out_dtype, config)
            want = self.reference_combine(y_np, dtype, s_np, w_np, rsf, out_dtype)
            self.check_output(got, T, H, out_dtype or dtype, ref64, no_local, limit, what)
            self.check_output(want, T, H, out_dtype or dtype, ref64, no_local, limit, f"judge {what}")
            assert_rel_fro(got, want, limit, f"{what} vs judge")
            outs[out_dtype] = to_numpy(got)
        assert_exact(outs[None], outs["float32"].astype(outs[None].dtype), "cast once, round to nearest even")
        for a, b in zip((y, s, w), before):
            assert_exact(a, b, "input unchanged")  # bit patterns: the NaN rows compare equal

    def test_nan_in_unreferenced_rows_everywhere(self):
        """Every row not named by src2dst is NaN (also rows < M of other slots' non-local twins); small forced
        blocks where the backend has launch configs."""
        T, topk, H = 8, 4, 48
        rng = np.random.default_rng(7)
        src2dst = np.full((T, topk), -1, np.int32)
        used = rng.permutation(T * topk)[: T * topk // 2]
        src2dst.flat[rng.permutation(T * topk)[: used.size]] = used
        src2dst[0] = -1  # a token with no local slot
        y = np.full((T * topk, H), np.nan, np.float32)
        y[used] = rng.standard_normal((used.size, H))
        w = rng.uniform(0.1, 1.0, (T, topk)).astype(np.float32)
        out = self.combine(self.array(y), self.array(src2dst), self.array(w), 1.0, None, self.forced_config(2, 16))
        want = self.reference_combine(y, "float32", src2dst, w, 1.0)
        ref64 = numpy_combine(y, src2dst, w, 1.0)
        for o, what in ((out, "combine"), (want, "judge")):
            self.check_output(o, T, H, "float32", ref64, (src2dst < 0).all(axis=1), F32_REL_FRO, what)
        assert_rel_fro(out, want, F32_REL_FRO, "vs judge")

    def test_edge_inputs(self):
        """Column-strided views of y / src2dst / topk_weights where the framework has them (copied, not
        misread); ``T = 0`` (an empty ``[0, H]`` output)."""
        y_np, s_np, w_np, _ = combine_problem(6, 2, 4, 0, 4, 40, seed=5)
        views = [self.strided(self.array(a)) for a in (y_np, s_np, w_np)]
        if views[0] is not None:
            out = self.combine(*views, 1.0)
            assert_rel_fro(out, self.reference_combine(y_np, "float32", s_np, w_np, 1.0), F32_REL_FRO, "strided")
        empty = self.combine(self.array(y_np[:0]), self.array(s_np[:0]), self.array(w_np[:0]), 1.0)
        assert to_numpy(empty).shape == (0, 40) and to_numpy(empty).dtype == np.float32
