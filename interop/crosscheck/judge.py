"""Judging: the comparisons of two implementations' outputs and their verdicts by CONTRACT.md sections 7
(forward) and 8 (backward); the numbers come from :mod:`moe_contract.tolerances` (their one home)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from interop.crosscheck.stages import ALL_STAGES, PALLAS_VS_TRITON, Stage, pairs
from moe_contract.tolerances import (
    BF16_REL_FRO,
    F32_REL_FRO,
    FP8_REL_FRO,
    GATE_WEIGHT_RTOL,
    GRAD_BF16_REL_FRO,
    GRAD_F32_REL_FRO,
)

TOLERANCES = {"gate_weight_rtol": GATE_WEIGHT_RTOL, "bf16_rel_fro": BF16_REL_FRO, "fp8_rel_fro": FP8_REL_FRO,
              "f32_rel_fro": F32_REL_FRO, "grad_f32_rel_fro": GRAD_F32_REL_FRO, "grad_bf16_rel_fro": GRAD_BF16_REL_FRO}

#: The pseudo-implementation of a self-consistency comparison (fused FP8 = quantize(own float32)).
SELF = "own float32, requantized"
#: The pseudo-implementation of the empty-expert rule: the weight gradient of an expert with no rows is exactly 0.
NO_ROWS = "0 for experts with no rows"
PSEUDO = (SELF, NO_ROWS)
#: Outputs judged as the gate's weights (float32, elementwise rel <= GATE_WEIGHT_RTOL): the gate's, and what
#: ``slot_weights`` makes of them (the shared gate's sigmoid, the weights moved onto the input), section 1.
GATE_WEIGHT_OUTPUTS = ("topk_weights", "combine_weights", "input_scale")
#: Forward stages whose float outputs are bit-identical by the contract: the permute (a gather, + the exact FP8
#: quantization) and the scaled slot rows (one float32 multiply, one rounding to x's dtype: section 2).
BIT_EXACT_STAGES = ("permute", "scaled_slot_rows")


@dataclasses.dataclass
class Comparison:
    """One output of one stage, implementation ``a`` against ``b``."""

    stage: str
    output: str
    a: str
    b: str
    kind: str  # "exact" | "fp8" | "gate_weights" | "float" | "fp8_dequantized"
    ok: bool
    metrics: dict[str, Any]
    rule: str

    def summary(self) -> str:
        m = self.metrics
        if "error" in m:
            return m["error"]
        if self.kind == "exact":
            return "equal" if m["mismatches"] == 0 else f"{m['mismatches']}/{m['size']} differ, first @{m['first_index']}"
        if self.kind == "fp8":
            return f"bytes {m['bytes_equal_pct']:.2f}% equal" + ("" if m["mismatches"] == 0 else f", first @{m['first_index']}")
        if self.kind == "fp8_dequantized":
            return f"bytes {m['bytes_equal_pct']:.1f}%, deq rel {m['rel_fro']:.1e}"
        if self.kind == "gate_weights":
            return f"max rel {m['max_rel']:.1e}"
        return f"rel {m['rel_fro']:.1e} max {m['max_abs']:.1e}"


@dataclasses.dataclass
class CrossCheckResult:
    """What ``run_crosscheck`` / ``run_ep_check`` found. ``ok`` is False if any comparison broke the contract."""

    meta: dict
    comparisons: list[Comparison]
    skipped: dict[str, str]  # implementation -> why it did not run
    errors: dict[str, str]  # "stage/implementation" -> the exception
    #: implementation -> why it cannot serve this layer (its NotImplementedError), for a backend that came from the
    #: CLI's default list (not named in --implementations): reported, not a violation (``epmoe check`` fills it).
    not_served: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors and all(c.ok for c in self.comparisons)

    @property
    def failed_stages(self) -> list[str]:
        bad = {c.stage for c in self.comparisons if not c.ok} | {k.split("/")[0] for k in self.errors}
        return [s for s in ALL_STAGES if s in bad]

    def to_json(self) -> dict:
        return {"meta": self.meta, "ok": self.ok, "failed_stages": self.failed_stages, "skipped": self.skipped,
                "not_served": self.not_served, "errors": self.errors, "tolerances": TOLERANCES,
                "comparisons": [dataclasses.asdict(c) for c in self.comparisons]}


# --------------------------------------------------------------------------------------
# Metrics

def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind not in "iub" else x


def _shape_error(a: np.ndarray, b: np.ndarray) -> dict | None:
    if a.shape != b.shape:
        return {"error": f"shapes {a.shape} != {b.shape}"}
    if a.dtype.itemsize != b.dtype.itemsize or (a.dtype.kind in "iu") != (b.dtype.kind in "iu"):
        if not (a.dtype.kind in "iu" and b.dtype.kind in "iu"):
            return {"error": f"dtypes {a.dtype} != {b.dtype}"}
    return None


#: Elements compared at a time by :func:`compare_exact`: its temporaries stay near this many bytes whatever the size
#: (Kimi K2's INT4 w13 codes are 5.6G bytes: widened whole to int64 they took 45 GB a side, and the full-size
#: check was killed for host memory on a 128 GiB GPU machine).
EXACT_CHUNK = 1 << 24


def compare_exact(a: np.ndarray, b: np.ndarray) -> dict:
    """Integers equal / floats bit-identical: count and first flat index of mismatches. Compared
    :data:`EXACT_CHUNK` elements at a time (integers of one dtype as they are, mixed ones widened per chunk)."""
    err = _shape_error(a, b)
    if err:
        return err
    fa, fb = a.reshape(-1), b.reshape(-1)  # views of contiguous arrays (a copy otherwise, as before)
    ints = a.dtype.kind in "iu"
    widen = ints and a.dtype != b.dtype
    n_bad, first = 0, None
    for i in range(0, fa.size, EXACT_CHUNK):
        ca, cb = fa[i:i + EXACT_CHUNK], fb[i:i + EXACT_CHUNK]
        if widen:
            ca, cb = ca.astype(np.int64), cb.astype(np.int64)
        elif not ints:
            ca, cb = _bits(ca), _bits(cb)
        bad = np.flatnonzero(ca != cb)
        if bad.size and first is None:
            first = i + int(bad[0])
        n_bad += int(bad.size)
    out = {"mismatches": n_bad, "size": int(a.size), "first_index": first}
    if n_bad:
        out["first_values"] = [fa[first].item(), fb[first].item()]
        out["first_values"] = [float(v) if not isinstance(v, int) else v for v in out["first_values"]]
    if a.dtype == ml_dtypes.float8_e4m3fn:
        out["bytes_equal_pct"] = 100.0 * (1 - n_bad / max(a.size, 1))
    return out


def rel_fro(a: np.ndarray, b: np.ndarray) -> float:
    """``||a - b|| / ||b||`` in float64 (0 if both are 0; inf if only ``b`` is)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    num, den = np.linalg.norm(a64 - b64), np.linalg.norm(b64)
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return float(num / den)


def compare_float(a: np.ndarray, b: np.ndarray) -> dict:
    err = _shape_error(a, b)
    if err:
        return err
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    finite = bool(np.isfinite(a64).all() and np.isfinite(b64).all())
    return {"rel_fro": rel_fro(a, b) if finite else float("inf"),
            "max_abs": float(np.max(np.abs(a64 - b64))) if a.size else 0.0, "finite": finite}


def compare_gate_weights(a: np.ndarray, b: np.ndarray) -> dict:
    err = _shape_error(a, b)
    if err:
        return err
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    diff = np.abs(a64 - b64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(diff == 0, 0.0, diff / np.abs(b64))
    return {"max_rel": float(np.max(rel)) if a.size else 0.0, "max_abs": float(np.max(diff)) if a.size else 0.0}


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """FP8 codes ``[M, K]`` times a per-row ``[M, 1]`` or per-group ``[M, K // G]`` scale, float64."""
    q64 = q.astype(np.float64)
    g = q.shape[1] // scale.shape[1]
    return (q64.reshape(q.shape[0], scale.shape[1], g) * scale.astype(np.float64)[:, :, None]).reshape(q.shape)


def empty_experts(expert_offsets: np.ndarray) -> np.ndarray:
    """Local expert indices with no rows (``expert_offsets[e] == expert_offsets[e + 1]``)."""
    off = np.asarray(expert_offsets, np.int64)
    return np.flatnonzero(off[1:] == off[:-1])


# --------------------------------------------------------------------------------------
# Verdicts

def _judge_forward(stage, key, a_name, b_name, va, vb, fp8, oa, ob, M) -> Comparison:
    """CONTRACT.md section 7 (module docstring of the package)."""
    pallas_vs_triton = (a_name, b_name) in PALLAS_VS_TRITON
    if vb.dtype.kind in "iu":
        m = compare_exact(va, vb)
        return Comparison(stage, key, a_name, b_name, "exact", m.get("mismatches") == 0, m, "exactly equal")
    if key in GATE_WEIGHT_OUTPUTS:
        m = compare_gate_weights(va, vb)
        ok = "error" not in m and m["max_rel"] <= GATE_WEIGHT_RTOL
        return Comparison(stage, key, a_name, b_name, "gate_weights", ok, m, f"rel <= {GATE_WEIGHT_RTOL:.0e}")
    if stage == "act" and key == "a_f32":
        m = compare_float(va, vb)
        ok = "error" not in m and m["rel_fro"] <= F32_REL_FRO
        return Comparison(stage, key, a_name, b_name, "float", ok, m, f"rel <= {F32_REL_FRO:.0e} (float32 math)")
    if stage == "act" and key in ("a", "a_scale") and fp8:
        # the implementations' exp differ by ulps (XLA, torch, Triton's interpreter or its GPU exp), so a fused
        # code or scale may move by one step: judge the dequantized activation, report the codes' equality
        # alongside. The fused quantization itself is held bit-exact by the self-consistency rows.
        if key == "a_scale":
            m = compare_float(va, vb)
            ok = "error" not in m and m["rel_fro"] <= FP8_REL_FRO
            return Comparison(stage, key, a_name, b_name, "float", ok, m, f"rel <= {FP8_REL_FRO:.0e} (fused; exp ulps)")
        ex = compare_exact(va, vb)
        if "error" in ex:
            return Comparison(stage, key, a_name, b_name, "fp8_dequantized", False, ex, "dequantized")
        da, db = dequantize(va, oa["a_scale"][:M]), dequantize(vb, ob["a_scale"][:M])
        m = {**ex, **compare_float(da, db)}
        ok = m["rel_fro"] <= FP8_REL_FRO
        return Comparison(stage, key, a_name, b_name, "fp8_dequantized", ok, m,
                          f"dequantized rel <= {FP8_REL_FRO:.0e} (fused; exp ulps)")
    if vb.dtype == ml_dtypes.float8_e4m3fn or key.endswith("scale") or stage in BIT_EXACT_STAGES:
        m = compare_exact(va, vb)
        if vb.dtype == ml_dtypes.float8_e4m3fn:
            m.setdefault("bytes_equal_pct", 100.0 * (1 - m.get("mismatches", 1) / max(vb.size, 1)))
        kind = "fp8" if vb.dtype == ml_dtypes.float8_e4m3fn else "exact"
        return Comparison(stage, key, a_name, b_name, kind, m.get("mismatches") == 0, m, "bit-identical")
    fp8_gemm = fp8 and stage in ("gemm1", "gemm2", "layer")
    limit = FP8_REL_FRO if fp8_gemm and not pallas_vs_triton else BF16_REL_FRO
    m = compare_float(va, vb)
    ok = "error" not in m and m["rel_fro"] <= limit
    return Comparison(stage, key, a_name, b_name, "float", ok, m, f"rel <= {limit:.0e}")


def backward_rule(stage: str, vb: np.ndarray) -> tuple[float, str]:
    """CONTRACT.md section 8 for one gradient: ``(limit, rule)``. A stage's float32 gradient (the wgrads'
    float32 results, ``d_topk_weights``, ``d_router_logits``): float32 math on the same inputs on both
    sides, ``GRAD_F32_REL_FRO``; a bf16 gradient, and every gradient of the whole layer (bf16 inputs, so
    bf16 intermediates however the result is stored): ``GRAD_BF16_REL_FRO``. Pallas vs Triton: the same
    rows (section 8's table)."""
    if stage != "layer_bwd" and vb.dtype == np.float32:
        return GRAD_F32_REL_FRO, f"rel <= {GRAD_F32_REL_FRO:.0e} (float32 gradient)"
    what = "bf16 layer gradients" if stage == "layer_bwd" else "bf16 gradient"
    return GRAD_BF16_REL_FRO, f"rel <= {GRAD_BF16_REL_FRO:.0e} ({what})"


def _judge_backward(stage, key, a_name, b_name, va, vb) -> Comparison:
    limit, rule = backward_rule(stage, vb)
    m = compare_float(va, vb)
    ok = "error" not in m and m["rel_fro"] <= limit
    return Comparison(stage, key, a_name, b_name, "float", ok, m, rule)


def judge(stage: Stage, key: str, a_name: str, b_name: str, oa: dict, ob: dict, M: int, fp8: bool) -> Comparison:
    """Output ``key`` of ``stage``: implementation ``a_name`` (outputs ``oa``) against ``b_name`` (``ob``)."""
    va, vb = oa.get(key), ob[key]
    if va is None:
        return Comparison(stage.name, key, a_name, b_name, "exact", False, {"error": f"{a_name} gave no {key}"},
                          "present")
    if key in stage.rows:  # rows >= M are never read (section 2)
        va, vb = va[:M], vb[:M]
    if stage.backward:
        return _judge_backward(stage.name, key, a_name, b_name, va, vb)
    return _judge_forward(stage.name, key, a_name, b_name, va, vb, fp8, oa, ob, M)


def judge_no_rows(stage: str, key: str, name: str, d_w: np.ndarray, expert_offsets: np.ndarray) -> Comparison | None:
    """Section 8: the weight gradient ``d_w [E_local, N, K]`` of every expert with no rows is exactly 0
    (None if every expert has rows)."""
    empty = empty_experts(expert_offsets)
    if empty.size == 0:
        return None
    part = d_w[empty].astype(np.float64)
    bad = np.flatnonzero(part != 0)  # -0.0 is 0
    m = {"mismatches": int(bad.size), "size": int(part.size), "first_index": int(bad[0]) if bad.size else None,
         "experts": empty.tolist()}
    return Comparison(stage, key, name, NO_ROWS, "exact", bad.size == 0, m,
                      f"exactly 0 for the {empty.size} local expert(s) with no rows")


def judge_stage(stage: Stage, outputs: dict[str, dict[str, np.ndarray]], names: Sequence[str], M: int, fp8: bool,
                expert_offsets: np.ndarray | None) -> list[Comparison]:
    """Every comparison of one stage: the pairs (:func:`pairs`) on every output, the fused FP8 activation
    against its own float32 (``act``, FP8), and the empty-expert rule on weight gradients."""
    out: list[Comparison] = []
    if stage.name == "act" and fp8:  # each implementation's fused quantization against its own float32 activation
        for n in names:
            o = outputs.get(n)
            if o is None:
                continue
            for key, rkey in (("a", "a_requant"), ("a_scale", "a_requant_scale")):
                m = compare_exact(o[key][:M], o[rkey][:M])
                out.append(Comparison(stage.name, key, n, SELF, "fp8" if key == "a" else "exact",
                                      m.get("mismatches") == 0, m,
                                      "bit-identical to the reference quantization of its own float32 activation"))
    if stage.weight_grads and expert_offsets is not None:
        for n in names:
            for key in stage.weight_grads:
                o = outputs.get(n) or {}
                if o.get(key) is not None:
                    c = judge_no_rows(stage.name, key, n, o[key], expert_offsets)
                    if c is not None:
                        out.append(c)
    for a_name, b_name in pairs(names):
        oa, ob = outputs.get(a_name), outputs.get(b_name)
        if oa is None or ob is None:
            continue
        for key in ob:
            if key in ("a_requant", "a_requant_scale") or ob[key] is None:
                continue
            out.append(judge(stage, key, a_name, b_name, oa, ob, M, fp8))
    return out

