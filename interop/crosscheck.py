"""The stage-by-stage cross-check: one set of inputs through four implementations of the MoE layer.

The four implementations (CONTRACT.md, first line): the jnp reference (``moe_pallas``,
``implementation="reference"``), the torch reference (``moe_torch``, ``"reference"``), the Pallas
kernels (``moe_pallas``, ``"pallas_triton"``; interpreted on a CPU) and the Triton kernels
(``moe_torch``, ``"triton"``; interpreted on a CPU). On a GPU, ``"pallas_mosaic_gpu"`` may be
added: its GEMMs on Mosaic GPU, every other stage on ``pallas_triton``.

Stages, in the order of ``moe_*/layer.py``::

    weights   float w13, w2 --quantize_weight_fp8--> codes + scales     (FP8 modes; references only)
    gate      router_logits --select_experts--> topk_weights, topk_ids
    routing   topk_ids --routing_metadata--> expert_offsets, src2dst, dst2src
    permute   x, dst2src --permute (+FP8 quant)--> x_permuted, x_scale
    gemm1     x_permuted, w13 --grouped_gemm--> h
    act       h --act_and_mul (+FP8 quant)--> a, a_scale
    gemm2     a, w2 --grouped_gemm--> y
    combine   y, src2dst, topk_weights --combine--> out
    layer     x, router_logits, weights --moe_forward--> out     (end to end, nothing shared)

To isolate a stage, every implementation gets the *same* upstream values: the jnp reference's
output of the previous stage, converted (numpy is the hub, so bf16 and FP8 travel as their bit
patterns). A mismatch at a stage is therefore that stage's own. The ``layer`` stage then runs
each implementation end to end.

Pairs compared at each stage: each kernel backend against its own framework's reference, the
two references against each other, and Pallas against Triton. The verdict of each comparison
follows CONTRACT.md section 7 (the numbers are :data:`TOLERANCES`):

- integer outputs (ids, offsets, ``src2dst``, ``dst2src``): exactly equal; reported as the
  number of mismatches and the first flat index. Section 1 breaks ties by the lower index, so
  ids never legitimately differ. ``dst2src`` is compared on its first ``M`` rows (rows ``>= M``
  are never read, section 2); the row-indexed outputs of the later stages likewise.
- FP8 codes and their scales: bit-identical (reported as the % of equal bytes). The one
  exception is the *fused* FP8 quantization of the activation across frameworks (``act``,
  ``jnp-reference`` vs ``torch-reference`` and Pallas vs Triton): XLA's and torch's ``exp``
  differ by ulps, so a code may move by one FP8 step; those pairs are judged on the
  dequantized values (relative Frobenius error <= ``FP8_REL_FRO``). Within a framework the
  fused codes must be bit-identical.
- gate weights: float32, relative error <= ``GATE_WEIGHT_RTOL`` elementwise.
- bf16 outputs (GEMMs, activation, combine, layer): ``||a-b|| / ||b|| <= BF16_REL_FRO``, or
  ``FP8_REL_FRO`` for the FP8 GEMMs and the FP8 layer against a reference; Pallas vs Triton
  always the tighter ``BF16_REL_FRO``. Max abs error is reported alongside.

Expert parallelism (:func:`run_ep_check`, stage ``"ep"``): with ``ep_size = N > 1`` every
implementation runs the layer once per rank (``moe_forward`` with ``config.for_rank(r)`` and that
rank's ``local_weights``) and the partials are summed in float32 (the contract's EP semantics,
section 6); that ``ep_sum`` is judged against the same implementation's single-device layer
(``ep_size=1``) - relative Frobenius error <= ``F32_REL_FRO`` with float32 inputs, the layer's bf16
(or FP8) rule with bf16 inputs - and the ``ep_sum`` of the implementations against each other (the
pairs above: torch vs jnp, kernel vs its reference, Triton vs Pallas) by the layer's rule. Where
JAX has ``N`` devices the real multi-device path, ``moe_pallas.ep_moe_forward`` under
``shard_map`` (both dispatch modes), is judged against the single-device layer too; otherwise
that row is skipped and says so (``XLA_FLAGS=--xla_force_host_platform_device_count=N`` gives a
CPU ``N`` devices). torch's ``ep_moe_forward`` needs ``torch.distributed`` processes and is not
run here (``tests/test_ep_torch.py`` runs it on gloo).

Used by ``epmoe check`` (``interop/cli.py``); the result is a :class:`CrossCheckResult`
(``.ok``, ``.failed_stages``, ``.to_json()``).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from moe_contract.config import MoEConfig
from moe_contract.inputs import LayerInputs, for_each_expert, make_layer_inputs
from moe_contract.validation import stage_implementation

# --------------------------------------------------------------------------------------
# Tolerances: CONTRACT.md section 7 as numbers, from their one home (tests/tolerances.py reads the same).

from moe_contract.tolerances import BF16_REL_FRO, F32_REL_FRO, FP8_REL_FRO, GATE_WEIGHT_RTOL  # noqa: E402
TOLERANCES = {"gate_weight_rtol": GATE_WEIGHT_RTOL, "bf16_rel_fro": BF16_REL_FRO, "fp8_rel_fro": FP8_REL_FRO,
              "f32_rel_fro": F32_REL_FRO}

#: name -> (framework, implementation argument of the stage ops, implementation for stages without it)
IMPLEMENTATIONS = {
    "jnp-reference": ("jax", "reference", "reference"),
    "torch-reference": ("torch", "reference", "reference"),
    "pallas_triton": ("jax", "pallas_triton", "pallas_triton"),
    "triton": ("torch", "triton", "triton"),
    "pallas_mosaic_gpu": ("jax", "pallas_mosaic_gpu", "pallas_triton"),  # GEMMs only; GPU only
}
REFERENCE = {"jax": "jnp-reference", "torch": "torch-reference"}
DEFAULT_IMPLEMENTATIONS = ("jnp-reference", "torch-reference", "pallas_triton", "triton")
STAGES = ("weights", "gate", "routing", "permute", "gemm1", "act", "gemm2", "combine", "layer")
#: The stage name of the expert-parallel summary (:func:`run_ep_check`): every rank end to end, summed.
EP_STAGE = "ep"

#: The activation quantization / weight-scale layout of each layer quant mode.
from moe_contract.config import ACTIVATION_QUANT, WEIGHT_LAYOUT  # noqa: E402


# --------------------------------------------------------------------------------------
# numpy <-> framework (numpy is the hub; bf16 / fp8 as ml_dtypes, so bits are kept)

def to_numpy(a) -> np.ndarray | None:
    """A jax array or torch tensor (any device; bf16 / fp8 kept bit-exact as ml_dtypes) as numpy."""
    if a is None:
        return None
    if hasattr(a, "detach"):
        import torch

        t = a.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        if t.dtype == torch.float8_e4m3fn:
            return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
        return t.numpy()
    return np.asarray(a)


def _torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def from_numpy(a: np.ndarray | None, framework: str):
    """numpy (incl. ml_dtypes bf16 / fp8) -> a jax array or a torch tensor (CUDA if there is one)."""
    if a is None:
        return None
    if framework == "jax":
        import jax.numpy as jnp

        return jnp.asarray(a)
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    elif a.dtype == ml_dtypes.float8_e4m3fn:
        t = torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    else:
        t = torch.from_numpy(a.copy())
    return t.to(_torch_device())


# --------------------------------------------------------------------------------------
# Comparisons

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


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind not in "iub" else x


def _shape_error(a: np.ndarray, b: np.ndarray) -> dict | None:
    if a.shape != b.shape:
        return {"error": f"shapes {a.shape} != {b.shape}"}
    if a.dtype.itemsize != b.dtype.itemsize or (a.dtype.kind in "iu") != (b.dtype.kind in "iu"):
        if not (a.dtype.kind in "iu" and b.dtype.kind in "iu"):
            return {"error": f"dtypes {a.dtype} != {b.dtype}"}
    return None


def compare_exact(a: np.ndarray, b: np.ndarray) -> dict:
    """Integers equal / floats bit-identical: count and first flat index of mismatches."""
    err = _shape_error(a, b)
    if err:
        return err
    bad = np.flatnonzero(a.astype(np.int64) != b.astype(np.int64)) if a.dtype.kind in "iu" else \
        np.flatnonzero(_bits(a) != _bits(b))
    out = {"mismatches": int(bad.size), "size": int(a.size), "first_index": int(bad[0]) if bad.size else None}
    if bad.size:
        out["first_values"] = [a.flat[bad[0]].item(), b.flat[bad[0]].item()]
        out["first_values"] = [float(v) if not isinstance(v, int) else v for v in out["first_values"]]
    if a.dtype == ml_dtypes.float8_e4m3fn:
        out["bytes_equal_pct"] = 100.0 * (1 - bad.size / max(a.size, 1))
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


# --------------------------------------------------------------------------------------
# Running the stages

def _modules(framework: str):
    if framework == "jax":
        import moe_pallas

        return moe_pallas
    import moe_torch

    return moe_torch


class _Impl:
    def __init__(self, name: str):
        self.name = name
        self.framework, self.impl, self.other_impl = IMPLEMENTATIONS[name]
        self.mod = _modules(self.framework)

    def stage_impl(self, op_module) -> str:
        return stage_implementation(self.impl, op_module, fallback=self.other_impl)

    def native(self, a):
        return from_numpy(a, self.framework)


def _op_api(framework: str, stage: str):
    pkg = "moe_pallas" if framework == "jax" else "moe_torch"
    return importlib.import_module(f"{pkg}.ops.{stage}.api")


@dataclasses.dataclass
class CrossCheckResult:
    """What :func:`run_crosscheck` found. ``ok`` is False if any comparison broke the contract."""

    meta: dict
    comparisons: list[Comparison]
    skipped: dict[str, str]  # implementation -> why it did not run
    errors: dict[str, str]  # "stage/implementation" -> the exception

    @property
    def ok(self) -> bool:
        return not self.errors and all(c.ok for c in self.comparisons)

    @property
    def failed_stages(self) -> list[str]:
        bad = {c.stage for c in self.comparisons if not c.ok} | {k.split("/")[0] for k in self.errors}
        return [s for s in STAGES + (EP_STAGE,) if s in bad]

    def to_json(self) -> dict:
        return {"meta": self.meta, "ok": self.ok, "failed_stages": self.failed_stages, "skipped": self.skipped,
                "errors": self.errors, "tolerances": TOLERANCES,
                "comparisons": [dataclasses.asdict(c) for c in self.comparisons]}


def _pairs(names: Sequence[str]) -> list[tuple[str, str]]:
    """(a, b) pairs, ``b`` the one judged against: kernel vs own reference, torch ref vs jnp ref, Triton vs Pallas."""
    pairs = []
    for n in names:
        fw = IMPLEMENTATIONS[n][0]
        if n != REFERENCE[fw] and REFERENCE[fw] in names:
            pairs.append((n, REFERENCE[fw]))
    if "torch-reference" in names and "jnp-reference" in names:
        pairs.append(("torch-reference", "jnp-reference"))
    for p in ("pallas_triton", "pallas_mosaic_gpu"):
        if "triton" in names and p in names:
            pairs.append(("triton", p))
    return pairs


@dataclasses.dataclass
class LayerWeights:
    """Global float (or FP8) weights of one layer: ``w13 [E+S, 2I, H]``, ``w2 [E+S, H, I]``, numpy.

    ``w13_scale`` / ``w2_scale``: given with FP8 codes (e.g. a DeepSeek-V3 FP8 checkpoint), else None.
    ``router_weight [E, H]``: the gate's linear layer; when given, ``router_logits = x @ router_weight.T``.
    """

    w13: np.ndarray
    w2: np.ndarray
    w13_scale: np.ndarray | None = None
    w2_scale: np.ndarray | None = None
    router_weight: np.ndarray | None = None
    e_score_correction_bias: np.ndarray | None = None


def cast_experts(w: np.ndarray, dtype) -> np.ndarray:
    """``w [E, ...].astype(dtype)`` as a new C-contiguous array, one expert per task on all cores
    (:func:`moe_contract.inputs.for_each_expert`; a DeepSeek-V3 layer is 11G values)."""
    out = np.empty(w.shape, dtype)
    for_each_expert(lambda e: out.__setitem__(e, w[e]), w.shape[0])
    return out


def make_inputs(config: MoEConfig, num_tokens: int, seed: int, routing: str, weights: LayerWeights | None,
                x: np.ndarray | None = None, router_logits: np.ndarray | None = None):
    """The float32 layer inputs (``LayerInputs``) plus the FP8 weights given, if any.

    ``x [T, H]`` and ``router_logits [T, E]`` (float, e.g. :func:`interop.checkpoints.load_inputs`) replace
    the random ones; without ``router_logits`` they are ``x @ router_weight.T`` (``weights`` must have the
    router then). Raises ValueError on shapes other than ``[num_tokens, H]`` / ``[num_tokens, E]``.
    """
    T, H, E = num_tokens, config.hidden_size, config.num_experts
    if x is not None and (x.ndim != 2 or x.shape != (T, H)):
        raise ValueError(f"make_inputs: x must be [T={T}, H={H}]; got shape {x.shape}")
    if router_logits is not None and (x is None or router_logits.shape != (T, E)):
        raise ValueError(f"make_inputs: router_logits must come with x and be [T={T}, E={E}]; got shape "
                         f"{router_logits.shape}{'' if x is not None else ' without x'}")
    if x is not None and router_logits is None and (weights is None or weights.router_weight is None):
        raise ValueError("make_inputs: x without router_logits needs the router weight (weights.router_weight) "
                         "to compute them; random weights have none")
    if weights is None:
        inputs = make_layer_inputs(config, num_tokens, seed=seed, routing=routing)
        if x is not None:
            inputs = dataclasses.replace(inputs, x=np.asarray(x, np.float32),
                                         router_logits=np.asarray(router_logits, np.float32))
        return inputs, None, None
    rng = np.random.default_rng(seed)
    if x is None:
        x = rng.standard_normal((num_tokens, config.hidden_size), dtype=np.float32)
    x = np.asarray(x, np.float32)
    if router_logits is not None:
        logits = np.asarray(router_logits, np.float32)
    elif weights.router_weight is not None:
        xb = x.astype(ml_dtypes.bfloat16).astype(np.float32)
        logits = (xb @ weights.router_weight.astype(np.float32).T).astype(np.float32)
    else:
        logits = rng.standard_normal((num_tokens, config.num_experts), dtype=np.float32)
    bias = weights.e_score_correction_bias
    if bias is None:
        bias = np.zeros((config.num_experts,), np.float32)
    inputs = LayerInputs(x=x, router_logits=logits, w13=weights.w13, w2=weights.w2,
                         e_score_correction_bias=bias.astype(np.float32))
    return inputs, weights.w13_scale, weights.w2_scale


def run_crosscheck(
    config: MoEConfig,
    num_tokens: int = 16,
    *,
    seed: int = 0,
    routing: str = "uniform",
    implementations: Sequence[str] = DEFAULT_IMPLEMENTATIONS,
    weights: LayerWeights | None = None,
    progress: Callable[[str], None] | None = None,
    x: np.ndarray | None = None,
    router_logits: np.ndarray | None = None,
) -> CrossCheckResult:
    """Run one set of inputs through ``implementations`` stage by stage and compare (module docstring).

    Args:
      config: the layer, with ``quant`` and the EP placement (``ep_size``, ``ep_rank``); this rank's
        experts are sliced from the global weights (``local_weights``).
      num_tokens: ``T``.
      seed, routing: the random inputs (``make_layer_inputs``; ``routing`` skews the logits).
      implementations: names from :data:`IMPLEMENTATIONS`; the references are what the kernels are
        judged against, so keep the one of each framework you run kernels of.
      weights: the layer's own weights (e.g. :func:`interop.checkpoints.load_moe_layer`) instead of
        random ones; FP8 codes with scales are used as they are (``config.quant`` must match).
      progress: called with a short message before each unit of work.
      x, router_logits: given inputs ``[T, H]`` / ``[T, E]`` instead of random ones (:func:`make_inputs`).

    Returns: :class:`CrossCheckResult`. A backend that raises ``NotImplementedError`` at a stage is
    recorded in ``skipped`` (not a violation); any other exception is an error (a violation).
    """
    progress = progress or (lambda msg: None)
    unknown = [n for n in implementations if n not in IMPLEMENTATIONS]
    if unknown:
        raise ValueError(f"run_crosscheck: implementations must be among {tuple(IMPLEMENTATIONS)}; got {unknown}")
    names = list(dict.fromkeys(implementations))
    impls = {n: _Impl(n) for n in names}
    ref_name = "jnp-reference"
    ref = _Impl(ref_name)  # the upstream values always come from the jnp reference
    skipped: dict[str, str] = {}
    errors: dict[str, str] = {}
    comparisons: list[Comparison] = []
    outputs: dict[str, dict[str, dict[str, np.ndarray]]] = {s: {} for s in STAGES}
    timings: dict[str, dict[str, float]] = {s: {} for s in STAGES}
    t_start = time.perf_counter()

    progress("inputs")
    inputs_given = x is not None
    inputs, given_s13, given_s2 = make_inputs(config, num_tokens, seed, routing, weights, x, router_logits)
    bf16 = ml_dtypes.bfloat16
    start, e_local = config.local_expert_range()
    w13_f = cast_experts(inputs.w13[start:start + e_local], bf16)
    w2_f = cast_experts(inputs.w2[start:start + e_local], bf16)
    x = inputs.x.astype(bf16)
    logits = inputs.router_logits.astype(np.float32)
    bias = inputs.e_score_correction_bias.astype(np.float32) if config.routing == "biased_grouped_topk" else None
    quant = ACTIVATION_QUANT[config.quant]
    fp8 = config.quant != "none"

    def run(stage: str, impl: _Impl, fn: Callable[[_Impl], dict[str, Any]]) -> dict[str, np.ndarray] | None:
        if impl.name in skipped:
            return None
        progress(f"{stage}: {impl.name}")
        t0 = time.perf_counter()
        try:
            out = {k: to_numpy(v) for k, v in fn(impl).items()}
        except NotImplementedError as exc:
            skipped[impl.name] = f"{stage}: {' '.join(str(exc).split())}"
            return None
        except Exception as exc:  # a crash at a stage is that stage's violation
            errors[f"{stage}/{impl.name}"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
            return None
        timings[stage][impl.name] = round(time.perf_counter() - t0, 3)
        outputs[stage][impl.name] = out
        return out

    # ---- weights: FP8 quantization of this rank's weights (references: there is no kernel)
    if fp8 and given_s13 is None:
        layout = WEIGHT_LAYOUT[config.quant]

        def quant_chunks(impl: _Impl, w: np.ndarray):
            """quantize_weight_fp8 a few experts at a time (<= 1 GiB of float32 temporaries on the device:
            a DeepSeek-V3 w13 whole would need 30 GB beside the other framework's memory), back to host."""
            step = max(1, (1 << 28) // max(1, w[0].size))
            parts = [tuple(to_numpy(t) for t in impl.mod.quantize_weight_fp8(impl.native(w[i:i + step]), layout))
                     for i in range(0, w.shape[0], step)]
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

        def quant_weights(impl: _Impl):
            q13, s13 = quant_chunks(impl, w13_f)
            q2, s2 = quant_chunks(impl, w2_f)
            return {"w13": q13, "w13_scale": s13, "w2": q2, "w2_scale": s2}

        for n in ("jnp-reference", "torch-reference"):
            if n in impls or n == ref_name:
                run("weights", impls.get(n) or ref, quant_weights)
        wq = outputs["weights"].get(ref_name)
        if wq is None:
            raise RuntimeError(f"run_crosscheck: the jnp reference failed to quantize the weights: {errors}")
        w13, s13, w2, s2 = wq["w13"], wq["w13_scale"], wq["w2"], wq["w2_scale"]
    elif fp8:
        w13 = np.ascontiguousarray(inputs.w13[start:start + e_local])
        w2 = np.ascontiguousarray(inputs.w2[start:start + e_local])
        s13 = np.ascontiguousarray(given_s13[start:start + e_local]).astype(np.float32)
        s2 = np.ascontiguousarray(given_s2[start:start + e_local]).astype(np.float32)
    else:
        w13, s13, w2, s2 = w13_f, None, w2_f, None

    order = [ref_name] + [n for n in names if n != ref_name]

    def each(stage: str, fn):
        """Run ``fn`` for the jnp reference first (its output feeds the next stage), then the rest."""
        for n in order:
            out = run(stage, impls.get(n) or ref, fn)
            if n == ref_name and out is None:
                raise RuntimeError(f"run_crosscheck: the jnp reference failed at stage {stage}: {errors or skipped}")

    # ---- gate
    def gate(impl: _Impl):
        w, ids = impl.mod.select_experts(
            impl.native(logits), **config.gate_kwargs(), e_score_correction_bias=impl.native(bias),
            implementation=impl.stage_impl(_op_api(impl.framework, "gate")))
        return {"topk_weights": w, "topk_ids": ids}

    each("gate", gate)
    g = outputs["gate"][ref_name]

    # ---- routing metadata
    def routing_meta(impl: _Impl):
        meta = impl.mod.routing_metadata(
            impl.native(g["topk_ids"]), config.num_total_experts, expert_start=start, num_local_experts=e_local,
            implementation=impl.stage_impl(_op_api(impl.framework, "permute")))
        return {"expert_offsets": meta.expert_offsets, "src2dst": meta.src2dst, "dst2src": meta.dst2src}

    each("routing", routing_meta)
    r = outputs["routing"][ref_name]
    M = int(r["expert_offsets"][-1])

    # ---- permute (+ FP8 quantization)
    def permute(impl: _Impl):
        xq, xs = impl.mod.permute(impl.native(x), impl.native(r["dst2src"]), topk=config.num_slots, quant=quant,
                                  implementation=impl.stage_impl(_op_api(impl.framework, "permute")))
        return {"x_permuted": xq, "x_scale": xs} if xs is not None else {"x_permuted": xq}

    each("permute", permute)
    p = outputs["permute"][ref_name]

    # ---- GEMM 1 and GEMM 2: the same op on different operands
    def gemm(name: str, x_rows, x_scale, w, w_scale):
        def run(impl: _Impl):
            return {name: impl.mod.grouped_gemm(
                impl.native(x_rows), impl.native(w), impl.native(r["expert_offsets"]),
                x_scale=impl.native(x_scale), w_scale=impl.native(w_scale), out_dtype=_bf16(impl),
                implementation=impl.stage_impl(_op_api(impl.framework, "grouped_gemm")))}
        return run

    each("gemm1", gemm("h", p["x_permuted"], p.get("x_scale"), w13, s13))
    h = outputs["gemm1"][ref_name]["h"]

    # ---- activation (+ FP8 quantization)
    def act(impl: _Impl):
        which = impl.stage_impl(_op_api(impl.framework, "activation"))
        a, s = impl.mod.act_and_mul(impl.native(h), activation=config.activation, quant=quant, implementation=which)
        if s is None:
            return {"a": a}
        # the same implementation's float32 activation, and the framework reference's quantization of
        # it: the fused codes and scales must be exactly that (CONTRACT.md section 3)
        a32, _ = impl.mod.act_and_mul(impl.native(h), activation=config.activation, out_dtype=_f32(impl),
                                      implementation=which)
        if quant == "fp8_per_token":
            rq, rs = impl.mod.per_token_quant_fp8(a32, implementation="reference")
        else:
            rq, rs = impl.mod.per_token_group_quant_fp8(a32, implementation="reference")
        return {"a": a, "a_scale": s, "a_f32": a32, "a_requant": rq, "a_requant_scale": rs}

    each("act", act)
    a = outputs["act"][ref_name]

    # ---- GEMM 2
    each("gemm2", gemm("y", a["a"], a.get("a_scale"), w2, s2))
    y = outputs["gemm2"][ref_name]["y"]

    # ---- combine
    rsf = config.combine_routed_scaling_factor

    def combine(impl: _Impl):
        out = impl.mod.combine(impl.native(y), impl.native(r["src2dst"]), impl.native(g["topk_weights"]),
                               routed_scaling_factor=rsf, out_dtype=_bf16(impl),
                               implementation=impl.stage_impl(_op_api(impl.framework, "combine")))
        return {"out": out}

    each("combine", combine)

    # ---- the whole layer, end to end (eager: kernels are jitted inside; a jit here would cache
    # across calls and hide a patched stage)
    def layer(impl: _Impl):
        out = impl.mod.moe_forward(
            impl.native(x), impl.native(logits), impl.native(w13), impl.native(w2), config,
            w13_scale=impl.native(s13), w2_scale=impl.native(s2), e_score_correction_bias=impl.native(bias),
            implementation=impl.impl)
        return {"out": out}

    each("layer", layer)

    # ---- compare
    for stage in STAGES:
        if stage == "act" and fp8:  # each implementation's fused quantization against its own float32 activation
            for n in names:
                o = outputs[stage].get(n)
                if o is None:
                    continue
                for key, rkey in (("a", "a_requant"), ("a_scale", "a_requant_scale")):
                    m = compare_exact(o[key][:M], o[rkey][:M])
                    comparisons.append(Comparison(stage, key, n, SELF, "fp8" if key == "a" else "exact", m.get("mismatches") == 0,
                                                  m, "bit-identical to the reference quantization of its own float32 activation"))
        for a_name, b_name in _pairs(names):
            oa, ob = outputs[stage].get(a_name), outputs[stage].get(b_name)
            if oa is None or ob is None:
                continue
            for key in ob:
                if key in ("a_requant", "a_requant_scale"):
                    continue
                comparisons.append(_judge(stage, key, a_name, b_name, oa.get(key), ob[key], M, fp8, oa, ob))

    meta = {
        "config": dataclasses.asdict(config), "num_tokens": num_tokens, "seed": seed, "routing_skew": routing,
        "M": M, "implementations": names, "weights": "given" if weights is not None else "random (make_layer_inputs)",
        "inputs": "given" if inputs_given else "random",
        "timings_s": timings, "runtime_s": round(time.perf_counter() - t_start, 2), "devices": _devices(),
    }
    return CrossCheckResult(meta=meta, comparisons=comparisons, skipped=skipped, errors=errors)


# --------------------------------------------------------------------------------------
# Expert parallelism: every rank end to end, summed over ranks, against the single device

EP_DTYPES = ("float32", "bfloat16")
EP_MODES = ("replicated", "all_to_all")
#: The Comparison.output of each EP row.
EP_SUM_VS_SINGLE = "ep_sum vs single-device"
EP_SUM = "ep_sum"


def ep_real_output(mode: str) -> str:
    return f"ep_moe_forward[{mode}] vs single-device"


def _matmul_precision(impl: _Impl, dtype: str):
    """float32 inputs: XLA's float32 dots in full float32 (no TF32 on a GPU), as the contract's references."""
    import contextlib

    if impl.framework == "jax" and dtype == "float32":
        import jax

        return jax.default_matmul_precision("float32")
    return contextlib.nullcontext()


def run_ep_check(
    config: MoEConfig,
    num_tokens: int = 16,
    *,
    seed: int = 0,
    routing: str = "uniform",
    implementations: Sequence[str] = DEFAULT_IMPLEMENTATIONS,
    weights: LayerWeights | None = None,
    dtype: str = "float32",
    real_ep: bool = True,
    progress: Callable[[str], None] | None = None,
    x: np.ndarray | None = None,
    router_logits: np.ndarray | None = None,
) -> CrossCheckResult:
    """The expert-parallel summary (module docstring, stage ``"ep"``): for each implementation, the sum over
    the ``config.ep_size`` ranks of its per-rank layer against its single-device layer, and the
    implementations' sums against each other; the real JAX multi-device path where there are devices.

    Args:
      config: the layer with ``ep_size = N >= 1`` (``ep_rank`` is ignored: every rank runs).
      num_tokens, seed, routing, weights: the inputs, as :func:`run_crosscheck` draws them.
      implementations: names from :data:`IMPLEMENTATIONS`.
      dtype: ``"float32"`` (x and the float weights in float32: the rank sum must equal the single
        device to float32 rounding, ``F32_REL_FRO``) or ``"bfloat16"`` (each rank's partial is rounded
        to bf16 by its ``moe_forward``: judged by the layer's bf16 / FP8 rule). The float weights are
        rounded to bf16 first either way (a model's weights); FP8 codes come from each framework's own
        ``quantize_layer_weights`` of them (or the checkpoint's, as given).
      real_ep: also run ``moe_pallas.ep_moe_forward`` (both modes) for the JAX implementations when
        ``jax.device_count() >= N``.

    Returns: :class:`CrossCheckResult` with stage ``"ep"`` comparisons; ``meta["ep"]`` holds notes
    (what was skipped and why). A backend raising ``NotImplementedError`` is skipped, anything else is
    an error (a violation).
    """
    progress = progress or (lambda msg: None)
    unknown = [n for n in implementations if n not in IMPLEMENTATIONS]
    if unknown:
        raise ValueError(f"run_ep_check: implementations must be among {tuple(IMPLEMENTATIONS)}; got {unknown}")
    if dtype not in EP_DTYPES:
        raise ValueError(f"run_ep_check: dtype must be one of {EP_DTYPES}; got {dtype!r}")
    names = list(dict.fromkeys(implementations))
    N = config.ep_size
    single_cfg = config.replace(ep_size=1, ep_rank=0)
    skipped: dict[str, str] = {}
    errors: dict[str, str] = {}
    comparisons: list[Comparison] = []
    notes: list[str] = []
    t_start = time.perf_counter()

    progress("ep: inputs")
    inputs_given = x is not None
    inputs, given_s13, given_s2 = make_inputs(config, num_tokens, seed, routing, weights, x, router_logits)
    fp8 = config.quant != "none"
    act_dt = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    x = inputs.x.astype(act_dt)
    logits = inputs.router_logits.astype(np.float32)
    bias = inputs.e_score_correction_bias.astype(np.float32) if config.routing == "biased_grouped_topk" else None
    if fp8 and given_s13 is not None:  # FP8 codes and scales as given
        w13_g, w2_g = inputs.w13, inputs.w2
    else:  # float weights: a model's bf16 values, held in the compute dtype
        w13_g = cast_experts(cast_experts(inputs.w13, ml_dtypes.bfloat16), act_dt)
        w2_g = cast_experts(cast_experts(inputs.w2, ml_dtypes.bfloat16), act_dt)

    single: dict[str, np.ndarray] = {}
    ep_sum: dict[str, np.ndarray] = {}
    real: dict[tuple[str, str], np.ndarray] = {}
    timings: dict[str, float] = {}

    def global_weights(impl: _Impl):
        """(w13, w13_scale, w2, w2_scale) of every expert, native to ``impl``."""
        if fp8 and given_s13 is not None:
            return (impl.native(w13_g), impl.native(np.asarray(given_s13, np.float32)), impl.native(w2_g),
                    impl.native(np.asarray(given_s2, np.float32)))
        w13, s13, w2, s2 = impl.mod.quantize_layer_weights(impl.native(w13_g), impl.native(w2_g), single_cfg)
        return w13, s13, w2, s2

    def forward(impl: _Impl, cfg: MoEConfig, w):
        out = impl.mod.moe_forward(impl.native(x), impl.native(logits), w[0], w[2], cfg, w13_scale=w[1], w2_scale=w[3],
                                   e_score_correction_bias=impl.native(bias), implementation=impl.impl)
        return to_numpy(out).astype(np.float32)

    for n in names:
        impl = _Impl(n)
        t0 = time.perf_counter()
        try:
            with _matmul_precision(impl, dtype):
                progress(f"ep: {n} weights")
                w_all = global_weights(impl)
                progress(f"ep: {n} single device")
                single[n] = forward(impl, single_cfg, w_all)
                total = np.zeros_like(single[n], dtype=np.float32)
                for r in range(N):
                    progress(f"ep: {n} rank {r}/{N}")
                    cfg_r = config.for_rank(r)
                    w_r = tuple(None if w is None else impl.mod.local_weights(w, cfg_r) for w in w_all)
                    total += forward(impl, cfg_r, w_r)  # float32 sum over ranks (section 6)
                ep_sum[n] = total
        except NotImplementedError as exc:
            skipped[n] = f"{EP_STAGE}: {' '.join(str(exc).split())}"
            single.pop(n, None)
            continue
        except Exception as exc:
            errors[f"{EP_STAGE}/{n}"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
            single.pop(n, None)
            continue
        timings[n] = round(time.perf_counter() - t0, 3)

        # the real multi-device path (JAX), where there are N devices
        if not (real_ep and impl.framework == "jax" and N > 1):
            continue
        import jax

        if jax.device_count() < N:
            note = (f"jax ep_moe_forward: skipped: needs {N} devices, have {jax.device_count()} "
                    f"(XLA_FLAGS=--xla_force_host_platform_device_count={N})")
            if note not in notes:
                notes.append(note)
            continue
        import moe_pallas

        mesh = moe_pallas.make_ep_mesh(N)
        fwd = jax.jit(moe_pallas.ep_moe_forward, static_argnames=("config", "mesh", "mode", "implementation"))
        for mode in EP_MODES:
            progress(f"ep: {n} ep_moe_forward[{mode}] on {N} devices")
            try:
                with _matmul_precision(impl, dtype):
                    out = fwd(impl.native(x), impl.native(logits), w_all[0], w_all[2], config, mesh=mesh, mode=mode,
                              w13_scale=w_all[1], w2_scale=w_all[3], e_score_correction_bias=impl.native(bias),
                              implementation=impl.impl)
                real[(n, mode)] = to_numpy(out).astype(np.float32)
            except NotImplementedError as exc:
                notes.append(f"{n} ep_moe_forward[{mode}]: skipped ({' '.join(str(exc).split())[:200]})")
            except Exception as exc:
                errors[f"{EP_STAGE}/{n} ep_moe_forward[{mode}]"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    if N > 1:
        notes.append("torch ep_moe_forward: not run here (needs torch.distributed processes; tests/test_ep_torch.py)")

    # ---- compare
    same_limit = F32_REL_FRO if dtype == "float32" else (FP8_REL_FRO if fp8 else BF16_REL_FRO)
    same_rule = (f"rel <= {same_limit:.0e} ({'float32 inputs: float32 rounding' if dtype == 'float32' else 'bf16 inputs'})")
    for n in names:
        if n in ep_sum:
            m = compare_float(ep_sum[n], single[n])
            comparisons.append(Comparison(EP_STAGE, EP_SUM_VS_SINGLE, n, n, "float",
                                          "error" not in m and m["rel_fro"] <= same_limit, m, same_rule))
        for mode in EP_MODES:
            if (n, mode) in real:
                m = compare_float(real[(n, mode)], single[n])
                comparisons.append(Comparison(EP_STAGE, ep_real_output(mode), n, n, "float",
                                              "error" not in m and m["rel_fro"] <= same_limit, m, same_rule))
    for a_name, b_name in _pairs(names):
        if a_name in ep_sum and b_name in ep_sum:
            pallas_vs_triton = (a_name, b_name) in {("triton", "pallas_triton"), ("triton", "pallas_mosaic_gpu")}
            limit = FP8_REL_FRO if fp8 and not pallas_vs_triton else BF16_REL_FRO
            m = compare_float(ep_sum[a_name], ep_sum[b_name])
            comparisons.append(Comparison(EP_STAGE, EP_SUM, a_name, b_name, "float",
                                          "error" not in m and m["rel_fro"] <= limit, m, f"rel <= {limit:.0e}"))

    meta = {
        "config": dataclasses.asdict(config), "num_tokens": num_tokens, "seed": seed, "routing_skew": routing, "M": None,
        "implementations": names, "weights": "given" if weights is not None else "random (make_layer_inputs)",
        "inputs": "given" if inputs_given else "random",
        "timings_s": {EP_STAGE: timings}, "runtime_s": round(time.perf_counter() - t_start, 2), "devices": _devices(),
        "ep": {"ep_size": N, "dtype": dtype, "notes": notes},
    }
    return CrossCheckResult(meta=meta, comparisons=comparisons, skipped=skipped, errors=errors)


def merge_results(stages: CrossCheckResult | None, ep: CrossCheckResult | None) -> CrossCheckResult:
    """One result of a per-rank stage-by-stage check and an EP summary (either may be None)."""
    if stages is None or ep is None:
        return stages or ep
    meta = {**stages.meta, "ep": ep.meta["ep"], "runtime_s": round(stages.meta["runtime_s"] + ep.meta["runtime_s"], 2),
            "timings_s": {**stages.meta["timings_s"], **ep.meta["timings_s"]}}
    skipped = {**stages.skipped, **{f"{k} ({EP_STAGE})" if k in stages.skipped else k: v for k, v in ep.skipped.items()}}
    return CrossCheckResult(meta=meta, comparisons=stages.comparisons + ep.comparisons, skipped=skipped,
                            errors={**stages.errors, **ep.errors})


def _f32(impl: _Impl):
    if impl.framework == "jax":
        import jax.numpy as jnp

        return jnp.float32
    import torch

    return torch.float32


def _bf16(impl: _Impl):
    if impl.framework == "jax":
        import jax.numpy as jnp

        return jnp.bfloat16
    import torch

    return torch.bfloat16


def _devices() -> dict:
    out = {}
    try:
        import jax

        out["jax"] = jax.default_backend()
    except Exception:  # pragma: no cover - informational only
        pass
    try:
        import torch

        out["torch"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # pragma: no cover
        pass
    out["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return out


#: The pseudo-implementation of a self-consistency comparison (fused FP8 = quantize(own float32)).
SELF = "own float32, requantized"
_ROW_OUTPUTS = {"dst2src", "x_permuted", "x_scale", "h", "a", "a_scale", "a_f32", "y"}  # [M_cap, ...]: rows >= M never read


def _judge(stage, key, a_name, b_name, va, vb, M, fp8, oa, ob) -> Comparison:
    if va is None:
        return Comparison(stage, key, a_name, b_name, "exact", False, {"error": f"{a_name} gave no {key}"}, "present")
    if key in _ROW_OUTPUTS:
        va, vb = va[:M], vb[:M]
    pallas_vs_triton = (a_name, b_name) in {("triton", "pallas_triton"), ("triton", "pallas_mosaic_gpu")}
    if vb.dtype.kind in "iu":
        m = compare_exact(va, vb)
        return Comparison(stage, key, a_name, b_name, "exact", m.get("mismatches") == 0, m, "exactly equal")
    if key == "topk_weights":
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
    if vb.dtype == ml_dtypes.float8_e4m3fn or key.endswith("scale") or (stage == "permute"):
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


# --------------------------------------------------------------------------------------
# Output

PAIR_LABEL = {
    ("pallas_triton", "jnp-reference"): "pallas vs jnp",
    ("pallas_mosaic_gpu", "jnp-reference"): "mosaic vs jnp",
    ("triton", "torch-reference"): "triton vs torch",
    ("torch-reference", "jnp-reference"): "torch vs jnp",
    ("triton", "pallas_triton"): "triton vs pallas",
    ("triton", "pallas_mosaic_gpu"): "triton vs mosaic",
}


def _pair_label(a: str, b: str) -> str:
    if b == SELF:
        return "fused = quant(own f32)"
    return PAIR_LABEL.get((a, b), f"{a} vs {b}")


def render(result: CrossCheckResult, console=None) -> None:
    """The result as a rich table (one row per stage output, one column per pair) and a verdict line."""
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:  # a log or a pipe: wide enough for one line per row
            console = Console(width=160)
    cfg = result.meta["config"]
    stage_comps = [c for c in result.comparisons if c.stage != EP_STAGE]
    if stage_comps or "ep" not in result.meta:
        _render_stages(result, stage_comps, console, cfg)
    if "ep" in result.meta:
        _render_ep(result, console, cfg)
    for name, why in result.skipped.items():
        console.print(f"[yellow]skipped {name}[/yellow] (NotImplementedError at {why})")
    for where, why in result.errors.items():
        console.print(f"[bold red]error at {where}[/bold red]: {why}")
    if result.ok:
        console.print(f"[bold green]all {len(result.comparisons)} comparisons within the contract[/bold green] "
                      f"({result.meta['runtime_s']:.1f} s)")
    else:
        bad = [c for c in result.comparisons if not c.ok]
        console.print(f"[bold red]VIOLATION at stage(s) {', '.join(result.failed_stages)}[/bold red]: "
                      + "; ".join(f"{c.stage}/{c.output} {_ep_label(c) if c.stage == EP_STAGE else _pair_label(c.a, c.b)}: "
                                  f"{c.summary()} (rule: {c.rule})" for c in bad[:6]))


def _ep_label(c: Comparison) -> str:
    return c.a if c.a == c.b else _pair_label(c.a, c.b)


def _render_ep(result: CrossCheckResult, console, cfg) -> None:
    from rich.table import Table

    ep = result.meta["ep"]
    table = Table(title=f"expert parallelism: the {ep['ep_size']} ranks' layer outputs summed in float32 (ep_sum) "
                        f"vs the single device; T={result.meta['num_tokens']} quant={cfg['quant']} inputs={ep['dtype']} "
                        f"seed={result.meta['seed']}")
    for col in ("check", "implementation(s)", "result", "rule"):
        table.add_column(col)
    for c in (c for c in result.comparisons if c.stage == EP_STAGE):
        res = f"[green]{c.summary()}[/green]" if c.ok else f"[bold red]{c.summary()} ✗[/bold red]"
        table.add_row(c.output, _ep_label(c), res, c.rule)
    console.print(table)
    for note in ep["notes"]:
        console.print(f"[yellow]{note}[/yellow]")


def _render_stages(result: CrossCheckResult, comparisons: list[Comparison], console, cfg) -> None:
    from rich.table import Table

    present = {(c.a, c.b) for c in comparisons if c.b != SELF}
    pairs = [p for p in _pairs(result.meta["implementations"]) if p in present]
    table = Table(title=f"cross-check: T={result.meta['num_tokens']} M={result.meta['M']} quant={cfg['quant']} "
                        f"EP rank {cfg['ep_rank']}/{cfg['ep_size']} seed={result.meta['seed']}")
    table.add_column("stage")
    table.add_column("output")
    for p in pairs:
        table.add_column(_pair_label(*p))
    rows: dict[tuple[str, str], dict] = {}
    for c in comparisons:
        rows.setdefault((c.stage, c.output), {})[(c.a, c.b)] = c
    own = {}
    for c in comparisons:
        if c.b == SELF:
            own.setdefault(c.a, []).append(c)
    for (stage, output), cells in rows.items():
        row = [stage, output]
        for p in pairs:
            c = cells.get(p)
            row.append("" if c is None else (f"[green]{c.summary()}[/green]" if c.ok else f"[bold red]{c.summary()} ✗[/bold red]"))
        table.add_row(*row)
    console.print(table)
    if own:
        cells = [f"{n} [green]yes[/green]" if all(c.ok for c in cs) else
                 f"{n} [bold red]NO ({'; '.join(c.output + ': ' + c.summary() for c in cs if not c.ok)})[/bold red]"
                 for n, cs in own.items()]
        console.print("act: fused FP8 codes and scales = the reference quantization of the same implementation's "
                      "float32 activation: " + ", ".join(cells))
