"""Error tests: one per validation rule, matching the message.

Every public op of ``moe_pallas`` and ``moe_torch`` (and ``MoEConfig`` / ``get_preset``) must
reject a bad input on the host, before tracing or launch, with ``ValueError`` (shapes and
values) or ``TypeError`` (dtypes) and a message of the form
``<op>: <arg> must be <expectation>; got <what came>``. Each case below runs the *same* bad
input through both frameworks (the ``fw`` adapter builds jnp arrays or torch tensors from
numpy), asserts the exact exception type and matches the op name, the argument, the key part
of the expectation and what came.

The second half checks the other edge of validation: ``T = 0`` is not an error; every op and
the layer return empty outputs of the right shapes and dtypes (``E = 0`` for the weight ops,
which have no ``T``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from moe_contract.config import ROUTINGS, MoEConfig
from moe_contract.presets import PRESETS
from moe_contract.validation import dtype_name

# --------------------------------------------------------------------------------------
# The framework adapter


class Fw:
    """Builds arrays for one framework from numpy, and names its package (``fw.m``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "jax":
            import jax
            import jax.numpy as jnp

            import moe_pallas

            self.m, self._ns, self.array_type = moe_pallas, jnp, jax.Array
        else:
            import torch

            import moe_torch

            self.m, self._ns, self.array_type = moe_torch, torch, torch.Tensor

    def __repr__(self) -> str:
        return self.name

    def dt(self, name: str) -> Any:
        """The framework's dtype called ``name`` (``"bfloat16"``, ``"float8_e4m3fn"``...)."""
        return getattr(self._ns, name)

    def arr(self, a: Any, dtype: str | None = None) -> Any:
        """``a`` (numpy or nested lists) as a framework array of dtype ``dtype``."""
        a = np.asarray(a)
        dtype = dtype or a.dtype.name
        if self.name == "jax":
            return self._ns.asarray(a).astype(self.dt(dtype))
        return self._ns.from_numpy(a.copy()).to(self.dt(dtype))

    def f(self, *shape: int, dtype: str = "float32") -> Any:
        """Random N(0, 1) values of ``shape`` (never zeros), cast to ``dtype``."""
        rng = np.random.default_rng(len(shape))
        return self.arr(rng.standard_normal(shape).astype(np.float32), dtype)

    def fp8(self, *shape: int) -> Any:
        return self.f(*shape, dtype="float8_e4m3fn")

    def full(self, shape: tuple[int, ...], value: float, dtype: str = "float32") -> Any:
        return self.arr(np.full(shape, value, np.float32), dtype)

    def i(self, values: Any, dtype: str = "int32") -> Any:
        """Integer ids / offsets (int32 by default)."""
        return self.arr(np.asarray(values).astype(dtype))


FRAMEWORKS = {name: Fw(name) for name in ("jax", "torch")}


@pytest.fixture(params=sorted(FRAMEWORKS), ids=str)
def fw(request) -> Fw:
    return FRAMEWORKS[request.param]


# --------------------------------------------------------------------------------------
# Case tables: helpers


class R(str):
    """A message part that is already a regex (the other parts are literal text)."""


def pattern(*parts: str) -> str:
    """The parts in order, each literal (``re.escape``) unless it is an :class:`R`."""
    return ".*".join(p if isinstance(p, R) else re.escape(p) for p in parts)


def bad(id: str, call: Callable[[Fw], Any], exc: type[Exception], *parts: str):
    """One rule: ``call(fw)`` must raise exactly ``exc`` with a message matching ``parts``."""
    return pytest.param(call, exc, pattern(*parts), id=id)


F32, I32, BF16, FP8 = "float32", "int32", "bfloat16", "float8_e4m3fn"
# The backends differ per op and grow; an unknown name is rejected with the list, whatever it holds.
IMPL = R(r"implementation must be one of \(None, (.*, )?'reference'(, .*)?\)")
FLOATS = "must have dtype float32 or bfloat16 or float16"
ACT_SCALE = "must be [] (per-tensor), [rows, 1] (per-token) or [rows, K // G] (per-token-group) float32"

# --------------------------------------------------------------------------------------
# Routing rules: shared by the gate op and MoEConfig (moe_contract.config.check_routing_args),
# so each is checked through both entry points with the same message after "<op>: ".

_G = dict(routing="grouped_topk")
_B = dict(routing="biased_grouped_topk")
ROUTING_RULES = [
    # (id, E, routing kwargs, expectation, what came)
    ("topk-zero", 8, dict(topk=0), "topk must be an int >= 1", "got topk=0"),
    ("topk-not-int", 8, dict(topk=2.0), "topk must be an int >= 1", "got topk=2.0"),
    ("topk-gt-E", 8, dict(topk=9), "topk must be <= E (=8)", "got topk=9"),
    ("routing-unknown", 8, dict(topk=2, routing="noaux_tc"), f"routing must be one of {ROUTINGS}", "got routing='noaux_tc'"),
    ("grouped-num_expert_group-missing", 8, dict(topk=2, **_G, topk_group=1),
     "num_expert_group must be an int >= 1", "got num_expert_group=None"),
    ("grouped-topk_group-missing", 8, dict(topk=2, **_G, num_expert_group=4),
     "topk_group must be an int >= 1", "got topk_group=None"),
    ("grouped-E-not-divisible-by-num_expert_group", 8, dict(topk=2, **_G, num_expert_group=3, topk_group=1),
     "E (=8) must be divisible by num_expert_group", "got num_expert_group=3"),
    ("grouped-topk_group-gt-num_expert_group", 8, dict(topk=2, **_G, num_expert_group=4, topk_group=5),
     "topk_group must be <= num_expert_group (=4)", "got topk_group=5"),
    ("grouped-topk-gt-experts-of-kept-groups", 8, dict(topk=3, **_G, num_expert_group=4, topk_group=1),
     "topk must be <= topk_group * E / num_expert_group (=2)", "got topk=3"),
    ("biased-E-not-divisible-by-num_expert_group", 8, dict(topk=2, **_B, num_expert_group=3, topk_group=1),
     "E (=8) must be divisible by num_expert_group", "got num_expert_group=3"),
    ("biased-topk-gt-experts-of-kept-groups", 8, dict(topk=5, **_B, num_expert_group=2, topk_group=1),
     "topk must be <= topk_group * E / num_expert_group (=4)", "got topk=5"),
    ("biased-one-expert-per-group", 8, dict(topk=2, **_B, num_expert_group=8, topk_group=2),
     "biased_grouped_topk scores a group by its two best experts, so E / num_expert_group must be >= 2", "got 1"),
    ("rsf-zero", 8, dict(topk=2, routed_scaling_factor=0.0), "routed_scaling_factor must be a finite float > 0", "got 0.0"),
    ("rsf-negative", 8, dict(topk=2, routed_scaling_factor=-2.5), "routed_scaling_factor must be a finite float > 0", "got -2.5"),
    ("rsf-inf", 8, dict(topk=2, routed_scaling_factor=math.inf), "routed_scaling_factor must be a finite float > 0", "got inf"),
    ("rsf-nan", 8, dict(topk=2, routed_scaling_factor=math.nan), "routed_scaling_factor must be a finite float > 0", "got nan"),
    ("rsf-not-a-number", 8, dict(topk=2, routed_scaling_factor="2.5"), "routed_scaling_factor must be a finite float > 0", "got '2.5'"),
    ("num_fused_shared_experts-negative", 8, dict(topk=2, num_fused_shared_experts=-1),
     "num_fused_shared_experts must be an int >= 0", "got num_fused_shared_experts=-1"),
    ("num_fused_shared_experts-bool", 8, dict(topk=2, num_fused_shared_experts=True),
     "num_fused_shared_experts must be an int >= 0", "got num_fused_shared_experts=True"),
    ("softmax-with-num_expert_group", 8, dict(topk=2, num_expert_group=4),
     "num_expert_group must be None for routing='softmax_topk'", "got num_expert_group=4"),
    ("softmax-with-topk_group", 8, dict(topk=2, topk_group=2),
     "topk_group must be None for routing='softmax_topk'", "got topk_group=2"),
]


def _gate_call(E: int, kw: dict) -> Callable[[Fw], Any]:
    biased = kw.get("routing") == "biased_grouped_topk"
    return lambda f: f.m.select_experts(f.f(2, E), e_score_correction_bias=f.f(E) if biased else None, **kw)


def _config_call(E: int, kw: dict) -> Callable[[Fw], Any]:
    return lambda f: f.m.MoEConfig(hidden_size=8, intermediate_size=4, num_experts=E, **kw)


ROUTING_CASES = [
    bad(f"{op}/{rid}", make(E, kw), ValueError, f"{op}: {expect}", came)
    for rid, E, kw, expect, came in ROUTING_RULES
    for op, make in (("select_experts", _gate_call), ("MoEConfig", _config_call))
]

# --------------------------------------------------------------------------------------
# select_experts (the rules not shared with MoEConfig)

SE = "select_experts"
SELECT_EXPERTS = [
    bad("select_experts/router_logits-rank", lambda f: f.m.select_experts(f.f(8), topk=2),
        ValueError, f"{SE}: router_logits must be [T, E]", "got router_logits.shape=(8,)"),
    bad("select_experts/router_logits-dtype", lambda f: f.m.select_experts(f.f(2, 8, dtype="int32"), topk=2),
        TypeError, f"{SE}: router_logits {FLOATS}", "got router_logits.dtype=int32"),
    bad("select_experts/bias-missing-in-biased-mode",
        lambda f: f.m.select_experts(f.f(2, 8), topk=2, **_B, num_expert_group=4, topk_group=2),
        ValueError, f"{SE}: e_score_correction_bias must be given ([E=8] float) for routing='biased_grouped_topk'", "got None"),
    bad("select_experts/bias-unexpected-softmax", lambda f: f.m.select_experts(f.f(2, 8), topk=2, e_score_correction_bias=f.f(8)),
        ValueError, f"{SE}: e_score_correction_bias must be None for routing='softmax_topk'", "got an array"),
    bad("select_experts/bias-unexpected-grouped",
        lambda f: f.m.select_experts(f.f(2, 8), topk=2, **_G, num_expert_group=4, topk_group=2, e_score_correction_bias=f.f(8)),
        ValueError, f"{SE}: e_score_correction_bias must be None for routing='grouped_topk'", "got an array"),
    bad("select_experts/bias-shape",
        lambda f: f.m.select_experts(f.f(2, 8), topk=2, **_B, num_expert_group=4, topk_group=2, e_score_correction_bias=f.f(7)),
        ValueError, f"{SE}: e_score_correction_bias must be [E] = (8,)", "got e_score_correction_bias.shape=(7,)"),
    bad("select_experts/bias-rank",
        lambda f: f.m.select_experts(f.f(2, 8), topk=2, **_B, num_expert_group=4, topk_group=2, e_score_correction_bias=f.f(1, 8)),
        ValueError, f"{SE}: e_score_correction_bias must be [E] = (8,)", "got e_score_correction_bias.shape=(1, 8)"),
    bad("select_experts/bias-dtype",
        lambda f: f.m.select_experts(f.f(2, 8), topk=2, **_B, num_expert_group=4, topk_group=2,
                                     e_score_correction_bias=f.i(np.zeros(8))),
        TypeError, f"{SE}: e_score_correction_bias {FLOATS}", "got e_score_correction_bias.dtype=int32"),
    bad("select_experts/implementation-unknown", lambda f: f.m.select_experts(f.f(2, 8), topk=2, implementation="no-such-backend"),
        ValueError, f"{SE}:", IMPL, "got implementation='no-such-backend'"),
]

# --------------------------------------------------------------------------------------
# routing_metadata

RM = "routing_metadata"
ES = "expert_start must be an int with 0 <= expert_start and expert_start + num_local_experts <= num_experts (=4)"
ROUTING_METADATA = [
    bad("routing_metadata/topk_ids-rank", lambda f: f.m.routing_metadata(f.i([0, 1, 2, 3]), 4),
        ValueError, f"{RM}: topk_ids must be [T, topk]", "got topk_ids.shape=(4,)"),
    bad("routing_metadata/topk_ids-dtype", lambda f: f.m.routing_metadata(f.i([[0, 1]], "float32"), 4),
        TypeError, f"{RM}: topk_ids must have dtype int32 or int64", "got topk_ids.dtype=float32"),
    bad("routing_metadata/num_experts-zero", lambda f: f.m.routing_metadata(f.i([[0, 1]]), 0),
        ValueError, f"{RM}: num_experts must be an int >= 1", "got num_experts=0"),
    bad("routing_metadata/num_local_experts-zero", lambda f: f.m.routing_metadata(f.i([[0, 1]]), 4, num_local_experts=0),
        ValueError, f"{RM}: num_local_experts must be an int >= 1", "got num_local_experts=0"),
    bad("routing_metadata/expert_start-negative",
        lambda f: f.m.routing_metadata(f.i([[0, 1]]), 4, expert_start=-1, num_local_experts=2),
        ValueError, f"{RM}: {ES}", "got expert_start=-1, num_local_experts=2"),
    bad("routing_metadata/local-range-past-E",
        lambda f: f.m.routing_metadata(f.i([[0, 1]]), 4, expert_start=3, num_local_experts=2),
        ValueError, f"{RM}: {ES}", "got expert_start=3, num_local_experts=2"),
    bad("routing_metadata/num_local_experts-gt-E", lambda f: f.m.routing_metadata(f.i([[0, 1]]), 4, num_local_experts=5),
        ValueError, f"{RM}: {ES}", "got expert_start=0, num_local_experts=5"),
    bad("routing_metadata/expert_start-not-int",
        lambda f: f.m.routing_metadata(f.i([[0, 1]]), 4, expert_start=1.0, num_local_experts=2),
        ValueError, f"{RM}: {ES}", "got expert_start=1.0, num_local_experts=2"),
    bad("routing_metadata/expert_start-eq-E-default-num_local",
        lambda f: f.m.routing_metadata(f.i([[0, 1]]), 4, expert_start=4),
        ValueError, f"{RM}: expert_start must be an int with 0 <= expert_start", "got expert_start=4"),
    bad("routing_metadata/expert_start-str-default-num_local",
        lambda f: f.m.routing_metadata(f.i([[0, 1]]), 4, expert_start="1"),
        ValueError, f"{RM}: expert_start must be an int with 0 <= expert_start", "got expert_start='1'"),
    bad("routing_metadata/check_ids-id-eq-E", lambda f: f.m.routing_metadata(f.i([[0, 4], [1, 2]]), 4, check_ids=True),
        ValueError, f"{RM}: topk_ids must lie in [0, E) = [0, 4)", "got 1 ids outside it, e.g. 4"),
    bad("routing_metadata/check_ids-negative-ids", lambda f: f.m.routing_metadata(f.i([[-1, 0], [3, -2]]), 4, check_ids=True),
        ValueError, f"{RM}: topk_ids must lie in [0, E) = [0, 4)", "got 2 ids outside it, e.g. -1"),
    bad("routing_metadata/check_ids-under-EP",
        lambda f: f.m.routing_metadata(f.i([[0, 7]]), 6, expert_start=2, num_local_experts=2, check_ids=True),
        ValueError, f"{RM}: topk_ids must lie in [0, E) = [0, 6)", "got 1 ids outside it, e.g. 7"),
    bad("routing_metadata/implementation-unknown", lambda f: f.m.routing_metadata(f.i([[0, 1]]), 4, implementation="no-such-backend"),
        ValueError, f"{RM}:", IMPL, "got implementation='no-such-backend'"),
]

# --------------------------------------------------------------------------------------
# permute: x [2, 8], topk 2, dst2src [4]

PM = "permute"
PER_TENSOR = "scale must be a per-tensor scale of shape () or (1,)"


def _permute(f: Fw, x=None, dst2src=None, **kw):
    x = f.f(2, 8) if x is None else x
    dst2src = f.i([0, 2, 1, 3]) if dst2src is None else dst2src
    return f.m.permute(x, dst2src, **{"topk": 2, **kw})


PERMUTE = [
    bad("permute/x-rank", lambda f: _permute(f, x=f.f(8)), ValueError, f"{PM}: x must be [T, H]", "got x.shape=(8,)"),
    bad("permute/x-dtype", lambda f: _permute(f, x=f.f(2, 8, dtype="int32")), TypeError, f"{PM}: x {FLOATS}", "got x.dtype=int32"),
    bad("permute/topk-zero", lambda f: _permute(f, topk=0), ValueError, f"{PM}: topk must be an int >= 1", "got topk=0"),
    bad("permute/dst2src-length", lambda f: _permute(f, dst2src=f.i([0, 1, 2])),
        ValueError, f"{PM}: dst2src must be [T * topk] = (4,)", "got dst2src.shape=(3,)"),
    bad("permute/dst2src-rank", lambda f: _permute(f, dst2src=f.i([[0, 1], [2, 3]])),
        ValueError, f"{PM}: dst2src must be [T * topk] = (4,)", "got dst2src.shape=(2, 2)"),
    bad("permute/dst2src-dtype", lambda f: _permute(f, dst2src=f.i([0, 1, 2, 3], "float32")),
        TypeError, f"{PM}: dst2src must have dtype int32", "got dst2src.dtype=float32"),
    bad("permute/quant-unknown", lambda f: _permute(f, quant="fp8"),
        ValueError, f"{PM}: quant must be one of (None, 'fp8_per_token', 'fp8_per_token_group', 'fp8_per_tensor')", "got quant='fp8'"),
    bad("permute/H-not-divisible-by-group_size", lambda f: _permute(f, quant="fp8_per_token_group", group_size=3),
        ValueError, f"{PM}: H (=x.shape[1]) must be divisible by group_size=3", "got H=8"),
    bad("permute/group_size-zero", lambda f: _permute(f, quant="fp8_per_token_group", group_size=0),
        ValueError, f"{PM}: group_size must be an int >= 1", "got group_size=0"),
    bad("permute/per-tensor-scale-missing", lambda f: _permute(f, quant="fp8_per_tensor"),
        ValueError, f"{PM}: {PER_TENSOR}, float32", "got None"),
    bad("permute/per-tensor-scale-shape", lambda f: _permute(f, quant="fp8_per_tensor", scale=f.full((2,), 0.1)),
        ValueError, f"{PM}: {PER_TENSOR}", "got scale.shape=(2,)"),
    bad("permute/per-tensor-scale-dtype", lambda f: _permute(f, quant="fp8_per_tensor", scale=f.full((), 0.1, "bfloat16")),
        TypeError, f"{PM}: scale must have dtype float32", "got scale.dtype=bfloat16"),
    bad("permute/per-tensor-scale-python-float", lambda f: _permute(f, quant="fp8_per_tensor", scale=0.1),
        TypeError, f"{PM}: scale must be", R(r"got .*(float|0\.1)")),
    bad("permute/scale-unexpected-without-per-tensor-quant", lambda f: _permute(f, scale=f.full((), 0.1)),
        ValueError, f"{PM}: scale must be None", "got an array"),
    bad("permute/implementation-unknown", lambda f: _permute(f, implementation="no-such-backend"),
        ValueError, f"{PM}:", IMPL, "got implementation='no-such-backend'"),
]

# --------------------------------------------------------------------------------------
# Activation quantization: per_token_quant_fp8, per_token_group_quant_fp8, static_quant_fp8, dequantize_fp8

PT, PG, SQ, DQ = "per_token_quant_fp8", "per_token_group_quant_fp8", "static_quant_fp8", "dequantize_fp8"
ACT_QUANT = [
    bad("per_token_quant_fp8/x-rank", lambda f: f.m.per_token_quant_fp8(f.f(1, 2, 8)),
        ValueError, f"{PT}: x must be [rows, K]", "got x.shape=(1, 2, 8)"),
    bad("per_token_quant_fp8/x-dtype", lambda f: f.m.per_token_quant_fp8(f.f(2, 8, dtype="int32")),
        TypeError, f"{PT}: x {FLOATS}", "got x.dtype=int32"),
    bad("per_token_quant_fp8/x-already-fp8", lambda f: f.m.per_token_quant_fp8(f.fp8(2, 8)),
        TypeError, f"{PT}: x {FLOATS}", "got x.dtype=float8_e4m3fn"),
    bad("per_token_quant_fp8/implementation-unknown", lambda f: f.m.per_token_quant_fp8(f.f(2, 8), implementation="no-such-backend"),
        ValueError, f"{PT}:", IMPL, "got implementation='no-such-backend'"),
    bad("per_token_group_quant_fp8/x-rank", lambda f: f.m.per_token_group_quant_fp8(f.f(8), 4),
        ValueError, f"{PG}: x must be [rows, K]", "got x.shape=(8,)"),
    bad("per_token_group_quant_fp8/x-dtype", lambda f: f.m.per_token_group_quant_fp8(f.f(2, 8, dtype="int32"), 4),
        TypeError, f"{PG}: x {FLOATS}", "got x.dtype=int32"),
    bad("per_token_group_quant_fp8/K-not-divisible-by-G", lambda f: f.m.per_token_group_quant_fp8(f.f(2, 8), 3),
        ValueError, f"{PG}: K (=x.shape[1]) must be divisible by group_size=3", "got K=8"),
    bad("per_token_group_quant_fp8/K-lt-default-G", lambda f: f.m.per_token_group_quant_fp8(f.f(2, 64)),
        ValueError, f"{PG}: K (=x.shape[1]) must be divisible by group_size=128", "got K=64"),
    bad("per_token_group_quant_fp8/group_size-zero", lambda f: f.m.per_token_group_quant_fp8(f.f(2, 8), 0),
        ValueError, f"{PG}: group_size must be an int >= 1", "got group_size=0"),
    bad("per_token_group_quant_fp8/group_size-not-int", lambda f: f.m.per_token_group_quant_fp8(f.f(2, 8), 4.0),
        ValueError, f"{PG}: group_size must be an int >= 1", "got group_size=4.0"),
    bad("per_token_group_quant_fp8/implementation-unknown",
        lambda f: f.m.per_token_group_quant_fp8(f.f(2, 8), 4, implementation="no-such-backend"),
        ValueError, f"{PG}:", IMPL, "got implementation='no-such-backend'"),
    bad("static_quant_fp8/x-rank", lambda f: f.m.static_quant_fp8(f.f(8), f.full((), 0.1)),
        ValueError, f"{SQ}: x must be [rows, K]", "got x.shape=(8,)"),
    bad("static_quant_fp8/x-dtype", lambda f: f.m.static_quant_fp8(f.f(2, 8, dtype="int32"), f.full((), 0.1)),
        TypeError, f"{SQ}: x {FLOATS}", "got x.dtype=int32"),
    bad("static_quant_fp8/scale-missing", lambda f: f.m.static_quant_fp8(f.f(2, 8), None),
        ValueError, f"{SQ}: {PER_TENSOR}, float32", "got None"),
    bad("static_quant_fp8/scale-per-token-shape", lambda f: f.m.static_quant_fp8(f.f(2, 8), f.full((2, 1), 0.1)),
        ValueError, f"{SQ}: {PER_TENSOR}", "got scale.shape=(2, 1)"),
    bad("static_quant_fp8/scale-dtype", lambda f: f.m.static_quant_fp8(f.f(2, 8), f.full((1,), 0.1, "float16")),
        TypeError, f"{SQ}: scale must have dtype float32", "got scale.dtype=float16"),
    bad("static_quant_fp8/scale-python-float", lambda f: f.m.static_quant_fp8(f.f(2, 8), 0.1),
        TypeError, f"{SQ}: scale must be", R(r"got .*(float|0\.1)")),
    bad("static_quant_fp8/implementation-unknown", lambda f: f.m.static_quant_fp8(f.f(2, 8), f.full((), 0.1), implementation="x"),
        ValueError, f"{SQ}:", IMPL, "got implementation='x'"),
    bad("dequantize_fp8/q-rank", lambda f: f.m.dequantize_fp8(f.fp8(8), f.full((), 0.1)),
        ValueError, f"{DQ}: q must be [rows, K]", "got q.shape=(8,)"),
    bad("dequantize_fp8/q-dtype", lambda f: f.m.dequantize_fp8(f.f(2, 8), f.full((2, 1), 0.1)),
        TypeError, f"{DQ}: q must have dtype float8_e4m3fn", "got q.dtype=float32"),
    bad("dequantize_fp8/scale-rank", lambda f: f.m.dequantize_fp8(f.fp8(2, 8), f.full((2,), 0.1)),
        ValueError, f"{DQ}: scale {ACT_SCALE} for x of shape (2, 8)", "got scale.shape=(2,)"),
    bad("dequantize_fp8/scale-rows", lambda f: f.m.dequantize_fp8(f.fp8(2, 8), f.full((3, 1), 0.1)),
        ValueError, f"{DQ}: scale {ACT_SCALE}", "got scale.shape=(3, 1)"),
    bad("dequantize_fp8/scale-groups-not-dividing-K", lambda f: f.m.dequantize_fp8(f.fp8(2, 8), f.full((2, 3), 0.1)),
        ValueError, f"{DQ}: scale {ACT_SCALE}", "got scale.shape=(2, 3)"),
    bad("dequantize_fp8/scale-zero-groups", lambda f: f.m.dequantize_fp8(f.fp8(2, 8), f.full((2, 0), 0.1)),
        ValueError, f"{DQ}: scale {ACT_SCALE}", "got scale.shape=(2, 0)"),
    bad("dequantize_fp8/scale-dtype", lambda f: f.m.dequantize_fp8(f.fp8(2, 8), f.full((2, 1), 0.1, "bfloat16")),
        TypeError, f"{DQ}: scale must have dtype float32", "got scale.dtype=bfloat16"),
]

# --------------------------------------------------------------------------------------
# Weight quantization: w [2, 3, 8]

QW, DW = "quantize_weight_fp8", "dequantize_weight_fp8"
W_SCALE = "w_scale must be [E] = (2,), [E, N] = (2, 3) or [E, ceil(N/128), ceil(K/128)] = (2, 1, 1) float32"
WEIGHT_QUANT = [
    bad("quantize_weight_fp8/w-rank", lambda f: f.m.quantize_weight_fp8(f.f(3, 8)),
        ValueError, f"{QW}: w must be [E, N, K]", "got w.shape=(3, 8)"),
    bad("quantize_weight_fp8/w-dtype", lambda f: f.m.quantize_weight_fp8(f.f(2, 3, 8, dtype="int32")),
        TypeError, f"{QW}: w {FLOATS}", "got w.dtype=int32"),
    bad("quantize_weight_fp8/layout-unknown", lambda f: f.m.quantize_weight_fp8(f.f(2, 3, 8), "per_tensor"),
        ValueError, f"{QW}: layout must be one of ('per_expert', 'per_channel', 'block')", "got layout='per_tensor'"),
    bad("quantize_weight_fp8/block-zero", lambda f: f.m.quantize_weight_fp8(f.f(2, 3, 8), "block", block=0),
        ValueError, f"{QW}: block must be an int >= 1", "got block=0"),
    bad("dequantize_weight_fp8/q-rank", lambda f: f.m.dequantize_weight_fp8(f.fp8(3, 8), f.full((2,), 0.1)),
        ValueError, f"{DW}: q must be [E, N, K]", "got q.shape=(3, 8)"),
    bad("dequantize_weight_fp8/q-dtype", lambda f: f.m.dequantize_weight_fp8(f.f(2, 3, 8), f.full((2,), 0.1)),
        TypeError, f"{DW}: q must have dtype float8_e4m3fn", "got q.dtype=float32"),
    bad("dequantize_weight_fp8/w_scale-rank", lambda f: f.m.dequantize_weight_fp8(f.fp8(2, 3, 8), f.full((2, 3, 1, 1), 0.1)),
        ValueError, f"{DW}: {W_SCALE}", "got w_scale.shape=(2, 3, 1, 1)"),
    bad("dequantize_weight_fp8/w_scale-per-expert-shape", lambda f: f.m.dequantize_weight_fp8(f.fp8(2, 3, 8), f.full((3,), 0.1)),
        ValueError, f"{DW}: {W_SCALE}", "got w_scale.shape=(3,)"),
    bad("dequantize_weight_fp8/w_scale-per-channel-shape", lambda f: f.m.dequantize_weight_fp8(f.fp8(2, 3, 8), f.full((2, 8), 0.1)),
        ValueError, f"{DW}: {W_SCALE}", "got w_scale.shape=(2, 8)"),
    bad("dequantize_weight_fp8/w_scale-block-shape", lambda f: f.m.dequantize_weight_fp8(f.fp8(2, 3, 8), f.full((2, 2, 1), 0.1)),
        ValueError, f"{DW}: {W_SCALE}", "got w_scale.shape=(2, 2, 1)"),
    bad("dequantize_weight_fp8/w_scale-dtype", lambda f: f.m.dequantize_weight_fp8(f.fp8(2, 3, 8), f.full((2, 3), 0.1, "bfloat16")),
        TypeError, f"{DW}: w_scale must have dtype float32", "got w_scale.dtype=bfloat16"),
    bad("dequantize_weight_fp8/block-zero", lambda f: f.m.dequantize_weight_fp8(f.fp8(2, 3, 8), f.full((2, 1, 1), 0.1), block=0),
        ValueError, f"{DW}: block must be an int >= 1", "got block=0"),
]

# --------------------------------------------------------------------------------------
# grouped_gemm: x [4, 8], w [2, 3, 8], expert_offsets [3]

GG = "grouped_gemm"
GG_W = "w must be [E, N, K] with K == x.shape[1] (=8)"


def _gemm(f: Fw, x=None, w=None, offsets=None, fp8: bool = False, **kw):
    if x is None:
        x = f.fp8(4, 8) if fp8 else f.f(4, 8)
    if w is None:
        w = f.fp8(2, 3, 8) if fp8 else f.f(2, 3, 8)
    if fp8:
        kw = {"x_scale": f.full((4, 1), 0.1), "w_scale": f.full((2, 3), 0.1), **kw}
    offsets = f.i([0, 2, 4]) if offsets is None else offsets
    return f.m.grouped_gemm(x, w, offsets, **kw)


GROUPED_GEMM = [
    bad("grouped_gemm/x-rank", lambda f: _gemm(f, x=f.f(1, 4, 8)), ValueError, f"{GG}: x must be [M_cap, K]", "got x.shape=(1, 4, 8)"),
    bad("grouped_gemm/x-dtype", lambda f: _gemm(f, x=f.f(4, 8, dtype="int32")),
        TypeError, f"{GG}: x must have dtype float32 or bfloat16 or float16 or float8_e4m3fn", "got x.dtype=int32"),
    bad("grouped_gemm/w-rank", lambda f: _gemm(f, w=f.f(3, 8)), ValueError, f"{GG}: {GG_W}", "got w.shape=(3, 8)"),
    bad("grouped_gemm/w-K-mismatch", lambda f: _gemm(f, w=f.f(2, 3, 7)), ValueError, f"{GG}: {GG_W}", "got w.shape=(2, 3, 7)"),
    bad("grouped_gemm/w-transposed", lambda f: _gemm(f, w=f.f(2, 8, 3)), ValueError, f"{GG}: {GG_W}", "got w.shape=(2, 8, 3)"),
    bad("grouped_gemm/expert_offsets-length", lambda f: _gemm(f, offsets=f.i([0, 4])),
        ValueError, f"{GG}: expert_offsets must be [E + 1] = (3,) int32 for w with E=2", "got expert_offsets.shape=(2,)"),
    bad("grouped_gemm/expert_offsets-dtype", lambda f: _gemm(f, offsets=f.i([0, 2, 4], "float32")),
        TypeError, f"{GG}: expert_offsets must have dtype int32", "got expert_offsets.dtype=float32"),
    bad("grouped_gemm/w-dtype-differs-from-x", lambda f: _gemm(f, w=f.f(2, 3, 8, dtype="bfloat16")),
        TypeError, f"{GG}: w must have dtype float32", "got w.dtype=bfloat16 with x.dtype=float32"),
    bad("grouped_gemm/w-fp8-with-float-x", lambda f: _gemm(f, w=f.fp8(2, 3, 8)),
        TypeError, f"{GG}: w must have dtype float32", "got w.dtype=float8_e4m3fn"),
    bad("grouped_gemm/fp8-x-float-w", lambda f: _gemm(f, fp8=True, w=f.f(2, 3, 8)),
        TypeError, f"{GG}: w must have dtype float8_e4m3fn", "got w.dtype=float32"),
    bad("grouped_gemm/fp8-x_scale-missing", lambda f: _gemm(f, fp8=True, x_scale=None),
        ValueError, f"{GG}: x_scale must be given for float8_e4m3fn inputs", "got None"),
    bad("grouped_gemm/fp8-w_scale-missing", lambda f: _gemm(f, fp8=True, w_scale=None),
        ValueError, f"{GG}: w_scale must be given for float8_e4m3fn inputs", "got None"),
    bad("grouped_gemm/x_scale-unexpected-float", lambda f: _gemm(f, x_scale=f.full((4, 1), 0.1)),
        ValueError, f"{GG}: x_scale must be None for float32 inputs (scales are for float8_e4m3fn)", "got an array"),
    bad("grouped_gemm/w_scale-unexpected-bf16", lambda f: _gemm(f, x=f.f(4, 8, dtype="bfloat16"), w=f.f(2, 3, 8, dtype="bfloat16"),
                                                                w_scale=f.full((2, 3), 0.1)),
        ValueError, f"{GG}: w_scale must be None for bfloat16 inputs (scales are for float8_e4m3fn)", "got an array"),
    bad("grouped_gemm/x_scale-rank", lambda f: _gemm(f, fp8=True, x_scale=f.full((4,), 0.1)),
        ValueError, f"{GG}: x_scale {ACT_SCALE} for x of shape (4, 8)", "got x_scale.shape=(4,)"),
    bad("grouped_gemm/x_scale-rows", lambda f: _gemm(f, fp8=True, x_scale=f.full((3, 1), 0.1)),
        ValueError, f"{GG}: x_scale {ACT_SCALE}", "got x_scale.shape=(3, 1)"),
    bad("grouped_gemm/x_scale-groups-not-dividing-K", lambda f: _gemm(f, fp8=True, x_scale=f.full((4, 3), 0.1)),
        ValueError, f"{GG}: x_scale {ACT_SCALE}", "got x_scale.shape=(4, 3)"),
    bad("grouped_gemm/x_scale-dtype", lambda f: _gemm(f, fp8=True, x_scale=f.full((4, 1), 0.1, "bfloat16")),
        TypeError, f"{GG}: x_scale must have dtype float32", "got x_scale.dtype=bfloat16"),
    bad("grouped_gemm/w_scale-rank", lambda f: _gemm(f, fp8=True, w_scale=f.full((2, 3, 1, 1), 0.1)),
        ValueError, f"{GG}: {W_SCALE}", "got w_scale.shape=(2, 3, 1, 1)"),
    bad("grouped_gemm/w_scale-per-expert-shape", lambda f: _gemm(f, fp8=True, w_scale=f.full((3,), 0.1)),
        ValueError, f"{GG}: {W_SCALE}", "got w_scale.shape=(3,)"),
    bad("grouped_gemm/w_scale-per-channel-shape", lambda f: _gemm(f, fp8=True, w_scale=f.full((2, 8), 0.1)),
        ValueError, f"{GG}: {W_SCALE}", "got w_scale.shape=(2, 8)"),
    bad("grouped_gemm/w_scale-block-shape", lambda f: _gemm(f, fp8=True, w_scale=f.full((2, 1, 2), 0.1)),
        ValueError, f"{GG}: {W_SCALE}", "got w_scale.shape=(2, 1, 2)"),
    bad("grouped_gemm/w_scale-dtype", lambda f: _gemm(f, fp8=True, w_scale=f.full((2,), 0.1, "float16")),
        TypeError, f"{GG}: w_scale must have dtype float32", "got w_scale.dtype=float16"),
    bad("grouped_gemm/out_dtype", lambda f: _gemm(f, out_dtype=f.dt("int32")),
        TypeError, f"{GG}: out_dtype {FLOATS}", "got out_dtype.dtype=int32"),
    bad("grouped_gemm/fp8-out_dtype", lambda f: _gemm(f, fp8=True, out_dtype=f.dt("float8_e4m3fn")),
        TypeError, f"{GG}: out_dtype {FLOATS}", "got out_dtype.dtype=float8_e4m3fn"),
    bad("grouped_gemm/implementation-unknown", lambda f: _gemm(f, implementation="no-such-backend"),
        ValueError, f"{GG}:", IMPL, "got implementation='no-such-backend'"),
]

# --------------------------------------------------------------------------------------
# act_and_mul / silu_and_mul / gelu_tanh_and_mul: h [4, 8] (I = 4)

ACTIVATION = [
    bad("silu_and_mul/h-rank", lambda f: f.m.silu_and_mul(f.f(8)), ValueError, "silu_and_mul: h must be [M, 2*I]", "got h.shape=(8,)"),
    bad("gelu_tanh_and_mul/h-rank", lambda f: f.m.gelu_tanh_and_mul(f.f(1, 4, 8)),
        ValueError, "gelu_tanh_and_mul: h must be [M, 2*I]", "got h.shape=(1, 4, 8)"),
    bad("silu_and_mul/h-dtype", lambda f: f.m.silu_and_mul(f.f(4, 8, dtype="int32")),
        TypeError, f"silu_and_mul: h {FLOATS}", "got h.dtype=int32"),
    bad("act_and_mul/h-dtype-fp8", lambda f: f.m.act_and_mul(f.fp8(4, 8), activation="gelu_tanh"),
        TypeError, f"gelu_tanh_and_mul: h {FLOATS}", "got h.dtype=float8_e4m3fn"),
    bad("silu_and_mul/odd-last-dim", lambda f: f.m.silu_and_mul(f.f(4, 7)),
        ValueError, "silu_and_mul: h must be [M, 2*I] with an even last dim", "got h.shape=(4, 7)"),
    bad("act_and_mul/activation-unknown", lambda f: f.m.act_and_mul(f.f(4, 8), activation="relu"),
        ValueError, "act_and_mul: activation must be one of ('silu', 'gelu_tanh', 'swiglu_oai')", "got activation='relu'"),
    bad("silu_and_mul/quant-unknown", lambda f: f.m.silu_and_mul(f.f(4, 8), quant="fp8_per_tensor"),
        ValueError, "silu_and_mul: quant must be one of (None, 'fp8_per_token', 'fp8_per_token_group')", "got quant='fp8_per_tensor'"),
    bad("gelu_tanh_and_mul/I-not-divisible-by-group_size",
        lambda f: f.m.gelu_tanh_and_mul(f.f(4, 8), quant="fp8_per_token_group", group_size=3),
        ValueError, "gelu_tanh_and_mul: I (=h.shape[1] // 2) must be divisible by group_size=3", "got I=4"),
    bad("silu_and_mul/group_size-zero", lambda f: f.m.silu_and_mul(f.f(4, 8), quant="fp8_per_token_group", group_size=0),
        ValueError, "silu_and_mul: group_size must be an int >= 1", "got group_size=0"),
    bad("silu_and_mul/out_dtype", lambda f: f.m.silu_and_mul(f.f(4, 8), out_dtype=f.dt("int32")),
        TypeError, f"silu_and_mul: out_dtype {FLOATS}", "got out_dtype.dtype=int32"),
    bad("gelu_tanh_and_mul/implementation-unknown", lambda f: f.m.gelu_tanh_and_mul(f.f(4, 8), implementation="no-such-backend"),
        ValueError, "gelu_tanh_and_mul:", IMPL, "got implementation='no-such-backend'"),
]

# --------------------------------------------------------------------------------------
# combine: y [4, 8], src2dst [2, 2], topk_weights [2, 2]


def _combine(f: Fw, y=None, src2dst=None, w=None, **kw):
    y = f.f(4, 8) if y is None else y
    src2dst = f.i([[0, 2], [1, -1]]) if src2dst is None else src2dst
    w = f.full((2, 2), 0.5) if w is None else w
    return f.m.combine(y, src2dst, w, **kw)


CB = "combine"
COMBINE = [
    bad("combine/y-rank", lambda f: _combine(f, y=f.f(4)), ValueError, f"{CB}: y must be [M_cap, H]", "got y.shape=(4,)"),
    bad("combine/y-dtype", lambda f: _combine(f, y=f.f(4, 8, dtype="int32")), TypeError, f"{CB}: y {FLOATS}", "got y.dtype=int32"),
    bad("combine/src2dst-rank", lambda f: _combine(f, src2dst=f.i([0, 1, 2, 3])),
        ValueError, f"{CB}: src2dst must be [T, topk]", "got src2dst.shape=(4,)"),
    bad("combine/src2dst-dtype", lambda f: _combine(f, src2dst=f.i([[0, 1], [2, 3]], "float32")),
        TypeError, f"{CB}: src2dst must have dtype int32", "got src2dst.dtype=float32"),
    bad("combine/y-rows-not-T-times-topk", lambda f: _combine(f, y=f.f(5, 8)),
        ValueError, f"{CB}: y must be [M_cap, H] with M_cap == T * topk (=4)", "got y.shape=(5, 8)"),
    bad("combine/topk_weights-shape", lambda f: _combine(f, w=f.full((2, 3), 0.5)),
        ValueError, f"{CB}: topk_weights must be [T, topk] = (2, 2)", "got topk_weights.shape=(2, 3)"),
    bad("combine/topk_weights-dtype", lambda f: _combine(f, w=f.full((2, 2), 0.5, "bfloat16")),
        TypeError, f"{CB}: topk_weights must have dtype float32", "got topk_weights.dtype=bfloat16"),
    *[
        bad(f"combine/rsf-{rid}", lambda f, v=v: _combine(f, routed_scaling_factor=v),
            ValueError, f"{CB}: routed_scaling_factor must be a finite float > 0", f"got {v!r}")
        for rid, v in (("zero", 0.0), ("negative", -1.0), ("inf", math.inf), ("nan", math.nan), ("none", None))
    ],
    bad("combine/out_dtype", lambda f: _combine(f, out_dtype=f.dt("int32")),
        TypeError, f"{CB}: out_dtype {FLOATS}", "got out_dtype.dtype=int32"),
    bad("combine/implementation-unknown", lambda f: _combine(f, implementation="no-such-backend"),
        ValueError, f"{CB}:", IMPL, "got implementation='no-such-backend'"),
]

# --------------------------------------------------------------------------------------
# MoEConfig (the rules not shared with the gate: see ROUTING_CASES) and get_preset

MC = "MoEConfig"
BASE = dict(hidden_size=8, intermediate_size=4, num_experts=8, topk=2)


def _cfg(**kw):
    return lambda f: f.m.MoEConfig(**{**BASE, **kw})


CONFIG = [
    *[
        bad(f"MoEConfig/{name}-{v}", _cfg(**{name: v}), ValueError, f"{MC}: {name} must be an int >= 1", f"got {name}={v!r}")
        for name, v in (("hidden_size", 0), ("intermediate_size", -4), ("num_experts", 0), ("ep_size", 0), ("hidden_size", 8.0))
    ],
    bad("MoEConfig/quant-unknown", _cfg(quant="fp8"),
        ValueError, f"{MC}: quant must be one of ('none', 'fp8_per_token', 'fp8_block', 'mxfp4', 'int4')",
        "got quant='fp8'"),
    bad("MoEConfig/activation-unknown", _cfg(activation="gelu"),
        ValueError, f"{MC}: activation must be one of ('silu', 'gelu_tanh', 'swiglu_oai')", "got activation='gelu'"),
    bad("MoEConfig/E-not-divisible-by-ep_size", _cfg(ep_size=3),
        ValueError, f"{MC}: num_experts must be divisible by ep_size (=3)", "got num_experts=8"),
    *[
        bad(f"MoEConfig/ep_rank-{rid}", _cfg(ep_size=2, ep_rank=v),
            ValueError, f"{MC}: ep_rank must be an int in [0, ep_size=2)", f"got ep_rank={v!r}")
        for rid, v in (("negative", -1), ("eq-ep_size", 2), ("not-int", 1.0), ("bool", True))
    ],
    bad("MoEConfig/for_rank-out-of-range", lambda f: f.m.MoEConfig(**BASE, ep_size=2).for_rank(2),
        ValueError, f"{MC}: ep_rank must be an int in [0, ep_size=2)", "got ep_rank=2"),
    bad("MoEConfig/local_expert_range-rank-out-of-range", lambda f: f.m.MoEConfig(**BASE, ep_size=2).local_expert_range(2),
        ValueError, R("local_expert_range: rank must be"), "got rank=2"),
    bad("MoEConfig/fp8_block-H-not-multiple-of-128", _cfg(hidden_size=192, intermediate_size=128, quant="fp8_block"),
        ValueError, f"{MC}: hidden_size must be a multiple of 128 for quant='fp8_block'", "got hidden_size=192"),
    bad("MoEConfig/fp8_block-I-not-multiple-of-128", _cfg(hidden_size=128, intermediate_size=64, quant="fp8_block"),
        ValueError, f"{MC}: intermediate_size must be a multiple of 128 for quant='fp8_block'", "got intermediate_size=64"),
    bad("MoEConfig/replace-revalidates", lambda f: f.m.MoEConfig(**BASE).replace(topk=9),
        ValueError, f"{MC}: topk must be <= E (=8)", "got topk=9"),
    bad("get_preset/name-unknown", lambda f: f.m.get_preset("deepseek-v4"),
        ValueError, f"get_preset: name must be one of {tuple(PRESETS)}", "got name='deepseek-v4'"),
    bad("get_preset/config-override-ep_size", lambda f: f.m.get_preset("tiny").config(ep_size=3),
        ValueError, f"{MC}: num_experts must be divisible by ep_size (=3)", "got num_experts=16"),
    bad("get_preset/config-override-fp8_block", lambda f: f.m.get_preset("tiny").config(intermediate_size=96, quant="fp8_block"),
        ValueError, f"{MC}: intermediate_size must be a multiple of 128 for quant='fp8_block'", "got intermediate_size=96"),
]

# --------------------------------------------------------------------------------------
# moe_forward and quantize_layer_weights

LAYER = MoEConfig(hidden_size=16, intermediate_size=4, num_experts=4, topk=2)
LAYER_FP8 = LAYER.replace(quant="fp8_per_token")
#: biased routing, a fused shared expert, EP rank 1 of 2: E_local = 4 / 2 + 1 = 3.
LAYER_EP = MoEConfig(
    hidden_size=16, intermediate_size=4, num_experts=4, topk=2, routing="biased_grouped_topk", num_expert_group=2,
    topk_group=1, routed_scaling_factor=2.5, num_fused_shared_experts=1, ep_size=2, ep_rank=1,
)
LAYER_BLOCK = MoEConfig(hidden_size=128, intermediate_size=128, num_experts=2, topk=1, quant="fp8_block")


def _forward(f: Fw, config: MoEConfig = LAYER, **over):
    """``moe_forward`` on valid T=2 inputs for ``config``, with the arrays in ``over`` replaced."""
    H, I, E = config.hidden_size, config.intermediate_size, config.num_experts
    _, el = config.local_expert_range()
    args = dict(x=f.f(2, H), router_logits=f.f(2, E), w13=f.f(el, 2 * I, H), w2=f.f(el, H, I))
    if config.quant != "none":
        args.update(w13=f.fp8(el, 2 * I, H), w2=f.fp8(el, H, I))
        if config.quant == "fp8_per_token":
            args.update(w13_scale=f.full((el, 2 * I), 0.01), w2_scale=f.full((el, H), 0.01))
        else:
            args.update(w13_scale=f.full((el, -(-2 * I // 128), -(-H // 128)), 0.01),
                        w2_scale=f.full((el, -(-H // 128), -(-I // 128)), 0.01))
    if config.routing == "biased_grouped_topk":
        args["e_score_correction_bias"] = f.f(E)
    args.update(over)
    return f.m.moe_forward(args.pop("x"), args.pop("router_logits"), args.pop("w13"), args.pop("w2"), config, **args)


MF = "moe_forward"
#: Errors about the layer's gate arguments come from its gate stage (documented: "naming the argument").
MF_OR_GATE = R("(moe_forward|select_experts): ")
LAYER_CASES = [
    bad("moe_forward/x-rank", lambda f: _forward(f, x=f.f(16)), ValueError, f"{MF}: x must be [T, H] with H=16", "got x.shape=(16,)"),
    bad("moe_forward/x-H-mismatch", lambda f: _forward(f, x=f.f(2, 8)),
        ValueError, f"{MF}: x must be [T, H] with H=16", "got x.shape=(2, 8)"),
    bad("moe_forward/x-dtype", lambda f: _forward(f, x=f.f(2, 16, dtype="int32")), TypeError, f"{MF}: x {FLOATS}", "got x.dtype=int32"),
    bad("moe_forward/router_logits-E-mismatch", lambda f: _forward(f, router_logits=f.f(2, 5)),
        ValueError, f"{MF}: router_logits must be [T, E] = (2, 4)", "got router_logits.shape=(2, 5)"),
    bad("moe_forward/router_logits-T-mismatch", lambda f: _forward(f, router_logits=f.f(3, 4)),
        ValueError, f"{MF}: router_logits must be [T, E] = (2, 4)", "got router_logits.shape=(3, 4)"),
    bad("moe_forward/router_logits-dtype", lambda f: _forward(f, router_logits=f.f(2, 4, dtype="int32")),
        TypeError, f"{MF}: router_logits {FLOATS}", "got router_logits.dtype=int32"),
    bad("moe_forward/w13-transposed", lambda f: _forward(f, w13=f.f(4, 16, 8)),
        ValueError, f"{MF}: w13 must be [E_local, 2*I, H] = (4, 8, 16) (this rank's experts)", "got w13.shape=(4, 16, 8)"),
    bad("moe_forward/w13-global-under-EP", lambda f: _forward(f, LAYER_EP, w13=f.f(5, 8, 16)),
        ValueError, f"{MF}: w13 must be [E_local, 2*I, H] = (3, 8, 16) (this rank's experts)", "got w13.shape=(5, 8, 16)"),
    bad("moe_forward/w2-transposed", lambda f: _forward(f, w2=f.f(4, 4, 16)),
        ValueError, f"{MF}: w2 must be [E_local, H, I] = (4, 16, 4) (this rank's experts)", "got w2.shape=(4, 4, 16)"),
    bad("moe_forward/w2-missing-shared-expert-under-EP", lambda f: _forward(f, LAYER_EP, w2=f.f(2, 16, 4)),
        ValueError, f"{MF}: w2 must be [E_local, H, I] = (3, 16, 4) (this rank's experts)", "got w2.shape=(2, 16, 4)"),
    bad("moe_forward/w13-dtype-differs-from-x", lambda f: _forward(f, w13=f.f(4, 8, 16, dtype="bfloat16")),
        TypeError, f"{MF}: w13 must have dtype float32", "got w13.dtype=bfloat16"),
    # new-user trial: float32 x with bf16 weights blamed the weights, never naming x
    bad("moe_forward/x-dtype-differs-from-both-weights",
        lambda f: _forward(f, w13=f.f(4, 8, 16, dtype="bfloat16"), w2=f.f(4, 16, 4, dtype="bfloat16")),
        TypeError, f"{MF}: x must have dtype bfloat16", "the weights are bfloat16); got x.dtype=float32"),
    bad("moe_forward/w2-fp8-for-quant-none", lambda f: _forward(f, w2=f.fp8(4, 16, 4)),
        TypeError, f"{MF}: w2 must have dtype float32", "got w2.dtype=float8_e4m3fn"),
    bad("moe_forward/w13_scale-unexpected-for-quant-none", lambda f: _forward(f, w13_scale=f.full((4, 8), 0.01)),
        ValueError, f"{MF}: w13_scale must be None for quant='none'", "got an array"),
    bad("moe_forward/w2_scale-unexpected-for-quant-none", lambda f: _forward(f, w2_scale=f.full((4, 16), 0.01)),
        ValueError, f"{MF}: w2_scale must be None for quant='none'", "got an array"),
    bad("moe_forward/fp8-w13-not-quantized", lambda f: _forward(f, LAYER_FP8, w13=f.f(4, 8, 16)),
        TypeError, f"{MF}: w13 must have dtype float8_e4m3fn", "got w13.dtype=float32"),
    bad("moe_forward/fp8-w13_scale-missing", lambda f: _forward(f, LAYER_FP8, w13_scale=None),
        ValueError, f"{MF}: w13_scale must be given for quant='fp8_per_token'", "got None"),
    bad("moe_forward/fp8-w2_scale-missing", lambda f: _forward(f, LAYER_FP8, w2_scale=None),
        ValueError, f"{MF}: w2_scale must be given for quant='fp8_per_token'", "got None"),
    bad("moe_forward/fp8-w2_scale-shape", lambda f: _forward(f, LAYER_FP8, w2_scale=f.full((4, 4), 0.01)),
        ValueError, f"{MF}: w2_scale must be [E] = (4,), [E, N] = (4, 16) or [E, ceil(N/128), ceil(K/128)] = (4, 1, 1) float32",
        "got w2_scale.shape=(4, 4)"),
    bad("moe_forward/fp8-w13_scale-dtype", lambda f: _forward(f, LAYER_FP8, w13_scale=f.full((4, 8), 0.01, "bfloat16")),
        TypeError, f"{MF}: w13_scale must have dtype float32", "got w13_scale.dtype=bfloat16"),
    bad("moe_forward/fp8_block-per-channel-scales", lambda f: _forward(f, LAYER_BLOCK, w13_scale=f.full((2, 256), 0.01)),
        ValueError, f"{MF}: w13_scale must be 128x128 block scales [E_local, ceil(N/128), ceil(K/128)] for quant='fp8_block'",
        "got w13_scale.shape=(2, 256)"),
    bad("moe_forward/bias-missing-in-biased-mode", lambda f: _forward(f, LAYER_EP, e_score_correction_bias=None),
        ValueError, MF_OR_GATE, "e_score_correction_bias must be given", "got None"),
    bad("moe_forward/bias-unexpected-softmax", lambda f: _forward(f, e_score_correction_bias=f.f(4)),
        ValueError, MF_OR_GATE, "e_score_correction_bias must be None for routing='softmax_topk'", "got an array"),
    bad("moe_forward/bias-shape", lambda f: _forward(f, LAYER_EP, e_score_correction_bias=f.f(5)),
        ValueError, MF_OR_GATE, "e_score_correction_bias must be [E] = (4,)", "got e_score_correction_bias.shape=(5,)"),
    bad("moe_forward/implementation-unknown", lambda f: _forward(f, implementation="no-such-backend"),
        ValueError, MF_OR_GATE, IMPL, "got implementation='no-such-backend'"),
    bad("moe_forward/config-not-a-MoEConfig",
        lambda f: f.m.moe_forward(f.f(2, 16), f.f(2, 4), f.f(4, 8, 16), f.f(4, 16, 4), "tiny"),
        TypeError, f"{MF}: config must be a MoEConfig", R(r"got .*(str|'tiny')")),
]

QL = "quantize_layer_weights"
def _qlw(config: MoEConfig, w13=((4, 8, 16), "float32"), w2=((4, 16, 4), "float32")):
    """``quantize_layer_weights`` on weights of the given ``(shape, dtype)`` (defaults: valid for LAYER)."""
    return lambda f: f.m.quantize_layer_weights(f.f(*w13[0], dtype=w13[1]), f.f(*w2[0], dtype=w2[1]), config)


QUANTIZE_LAYER = [
    case
    for cfg in (LAYER, LAYER_FP8)
    for case in (
        bad(f"quantize_layer_weights/w13-shape-quant-{cfg.quant}", _qlw(cfg, w13=((4, 16, 8), F32)),
            ValueError, f"{QL}: w13 must be", "got w13.shape=(4, 16, 8)"),
        bad(f"quantize_layer_weights/w2-shape-quant-{cfg.quant}", _qlw(cfg, w2=((4, 4, 16), F32)),
            ValueError, f"{QL}: w2 must be", "got w2.shape=(4, 4, 16)"),
        bad(f"quantize_layer_weights/w13-dtype-quant-{cfg.quant}", _qlw(cfg, w13=((4, 8, 16), "int32")),
            TypeError, f"{QL}: w13 {FLOATS}", "got w13.dtype=int32"),
        bad(f"quantize_layer_weights/w2-already-fp8-quant-{cfg.quant}", _qlw(cfg, w2=((4, 16, 4), FP8)),
            TypeError, f"{QL}: w2 {FLOATS}", "got w2.dtype=float8_e4m3fn"),
    )
]

ALL_CASES = [
    *ROUTING_CASES, *SELECT_EXPERTS, *ROUTING_METADATA, *PERMUTE, *ACT_QUANT, *WEIGHT_QUANT,
    *GROUPED_GEMM, *ACTIVATION, *COMBINE, *CONFIG, *LAYER_CASES, *QUANTIZE_LAYER,
]


@pytest.mark.parametrize("call, exc, match", ALL_CASES)
def test_bad_input_raises(fw: Fw, call, exc, match) -> None:
    with pytest.raises(exc, match=match) as info:
        call(fw)
    assert type(info.value) is exc, f"expected exactly {exc.__name__}, got {type(info.value).__name__}"


def test_case_ids_are_unique() -> None:
    ids = [p.id for p in ALL_CASES]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})


def test_check_ids_under_jit_raises() -> None:
    """JAX: the checked mode reads ids on the host, so under ``jit`` it raises the documented error."""
    import jax
    import jax.numpy as jnp

    import moe_pallas

    f = jax.jit(lambda ids: moe_pallas.routing_metadata(ids, 4, check_ids=True))
    with pytest.raises(ValueError, match=pattern("routing_metadata: check_ids=True reads the ids on the host, so topk_ids must be "
                                                 "concrete", "got a tracer (call it outside jit)")) as info:
        f(jnp.zeros((2, 2), jnp.int32))
    assert type(info.value) is ValueError


@pytest.mark.parametrize("where", ["select_experts", "combine", "MoEConfig"])
def test_rsf_numpy_float_is_accepted(fw: Fw, where: str) -> None:
    rsf = np.float32(2.5)
    if where == "select_experts":
        fw.m.select_experts(fw.f(2, 8), topk=2, routed_scaling_factor=rsf)
    elif where == "combine":
        _combine(fw, routed_scaling_factor=rsf)
    else:
        fw.m.MoEConfig(**BASE, routed_scaling_factor=rsf)


@pytest.mark.parametrize("fw", [pytest.param(FRAMEWORKS["jax"], id="jax"),
                                pytest.param(FRAMEWORKS["torch"], id="torch")])
@pytest.mark.parametrize(
    "op, call",
    [
        ("grouped_gemm", lambda f, dt: _gemm(f, out_dtype=dt)),
        ("silu_and_mul", lambda f, dt: f.m.silu_and_mul(f.f(4, 8), out_dtype=dt)[0]),
        ("combine", lambda f, dt: _combine(f, out_dtype=dt)),
    ],
    ids=["grouped_gemm", "silu_and_mul", "combine"],
)
def test_out_dtype_given_by_name(fw: Fw, op: str, call) -> None:
    """``out_dtype="bfloat16"`` works in both frameworks, or is a TypeError naming ``out_dtype``: never another crash."""
    try:
        out = call(fw, "bfloat16")
    except TypeError as e:
        assert re.search(pattern(f"{op}: out_dtype"), str(e)), str(e)
    else:
        assert dtype_name(out) == "bfloat16"


# --------------------------------------------------------------------------------------
# T = 0 (and E = 0 for the weight ops, which have no T): empty outputs, not errors


def empty(id: str, call: Callable[[Fw], Any], *expected):
    """``call(fw)`` returns outputs with these ``(shape, dtype)`` (``None``: the output is ``None``)."""
    return pytest.param(call, expected, id=id)


EMPTY_CASES = [
    empty("select_experts/softmax", lambda f: f.m.select_experts(f.f(0, 8), topk=2), ((0, 2), F32), ((0, 2), I32)),
    empty("select_experts/biased-shared-expert-rsf-on-output",
          lambda f: f.m.select_experts(f.f(0, 8, dtype="bfloat16"), topk=2, **_B, num_expert_group=4, topk_group=2,
                                       e_score_correction_bias=f.f(8), routed_scaling_factor=2.5,
                                       apply_routed_scaling_factor_on_output=True, num_fused_shared_experts=1),
          ((0, 3), F32), ((0, 3), I32)),
    empty("routing_metadata/all-experts", lambda f: f.m.routing_metadata(f.i(np.zeros((0, 2))), 4),
          ((5,), I32), ((0, 2), I32), ((0,), I32)),
    empty("routing_metadata/EP-rank-checked",
          lambda f: f.m.routing_metadata(f.i(np.zeros((0, 3))), 5, expert_start=2, num_local_experts=3, check_ids=True),
          ((4,), I32), ((0, 3), I32), ((0,), I32)),
    empty("permute/no-quant", lambda f: f.m.permute(f.f(0, 8, dtype="bfloat16"), f.i([]), topk=2), ((0, 8), BF16), None),
    empty("permute/fp8_per_token", lambda f: f.m.permute(f.f(0, 8), f.i([]), topk=2, quant="fp8_per_token"),
          ((0, 8), FP8), ((0, 1), F32)),
    empty("permute/fp8_per_token_group", lambda f: f.m.permute(f.f(0, 8), f.i([]), topk=2, quant="fp8_per_token_group", group_size=4),
          ((0, 8), FP8), ((0, 2), F32)),
    empty("permute/fp8_per_tensor", lambda f: f.m.permute(f.f(0, 8), f.i([]), topk=2, quant="fp8_per_tensor", scale=f.full((), 0.1)),
          ((0, 8), FP8), ((), F32)),
    empty("per_token_quant_fp8", lambda f: f.m.per_token_quant_fp8(f.f(0, 8)), ((0, 8), FP8), ((0, 1), F32)),
    empty("per_token_group_quant_fp8", lambda f: f.m.per_token_group_quant_fp8(f.f(0, 8), 4), ((0, 8), FP8), ((0, 2), F32)),
    empty("static_quant_fp8", lambda f: f.m.static_quant_fp8(f.f(0, 8), f.full((1,), 0.1)), ((0, 8), FP8)),
    empty("dequantize_fp8/per-token-group", lambda f: f.m.dequantize_fp8(f.fp8(0, 8), f.full((0, 2), 0.1)), ((0, 8), F32)),
    empty("dequantize_fp8/per-tensor", lambda f: f.m.dequantize_fp8(f.fp8(0, 8), f.full((), 0.1)), ((0, 8), F32)),
    *[
        empty(f"quantize_weight_fp8/E0-{layout}", lambda f, layout=layout: f.m.quantize_weight_fp8(f.f(0, 3, 8), layout),
              ((0, 3, 8), FP8), (shape, F32))
        for layout, shape in (("per_expert", (0,)), ("per_channel", (0, 3)), ("block", (0, 1, 1)))
    ],
    empty("dequantize_weight_fp8/E0-block", lambda f: f.m.dequantize_weight_fp8(f.fp8(0, 3, 8), f.full((0, 1, 1), 0.1)),
          ((0, 3, 8), F32)),
    empty("grouped_gemm/float", lambda f: f.m.grouped_gemm(f.f(0, 8), f.f(2, 3, 8), f.i([0, 0, 0])), ((0, 3), F32)),
    empty("grouped_gemm/bf16-out-f32",
          lambda f: f.m.grouped_gemm(f.f(0, 8, dtype="bfloat16"), f.f(2, 3, 8, dtype="bfloat16"), f.i([0, 0, 0]), out_dtype=f.dt(F32)),
          ((0, 3), F32)),
    empty("grouped_gemm/fp8-default-bf16",
          lambda f: f.m.grouped_gemm(f.fp8(0, 8), f.fp8(2, 3, 8), f.i([0, 0, 0]), x_scale=f.full((0, 1), 0.1),
                                     w_scale=f.full((2, 3), 0.1)),
          ((0, 3), BF16)),
    empty("silu_and_mul", lambda f: f.m.silu_and_mul(f.f(0, 8, dtype="bfloat16")), ((0, 4), BF16), None),
    empty("gelu_tanh_and_mul/out_dtype", lambda f: f.m.gelu_tanh_and_mul(f.f(0, 8), out_dtype=f.dt("bfloat16")), ((0, 4), BF16), None),
    empty("act_and_mul/fp8_per_token", lambda f: f.m.act_and_mul(f.f(0, 8), quant="fp8_per_token"), ((0, 4), FP8), ((0, 1), F32)),
    empty("act_and_mul/fp8_per_token_group",
          lambda f: f.m.act_and_mul(f.f(0, 8), activation="gelu_tanh", quant="fp8_per_token_group", group_size=2),
          ((0, 4), FP8), ((0, 2), F32)),
    empty("combine", lambda f: f.m.combine(f.f(0, 8), f.i(np.zeros((0, 2))), f.f(0, 2), routed_scaling_factor=2.5), ((0, 8), F32)),
    empty("combine/out_dtype", lambda f: f.m.combine(f.f(0, 8), f.i(np.zeros((0, 2))), f.f(0, 2), out_dtype=f.dt("bfloat16")),
          ((0, 8), BF16)),
    # K = 0 (not T = 0): per_token_quant_fp8 returns empty codes and [rows, 1] scales; the
    # per-token quantization fused into act_and_mul and permute should do the same.
    empty("per_token_quant_fp8/K0", lambda f: f.m.per_token_quant_fp8(f.f(2, 0)), ((2, 0), FP8), ((2, 1), F32)),
    empty("act_and_mul/fp8_per_token-I0", lambda f: f.m.act_and_mul(f.f(2, 0), quant="fp8_per_token"), ((2, 0), FP8), ((2, 1), F32)),
    empty("permute/fp8_per_token-H0", lambda f: f.m.permute(f.f(1, 0), f.i([0, 1]), topk=2, quant="fp8_per_token"),
          ((2, 0), FP8), ((2, 1), F32)),
]


def _check_outputs(fw: Fw, out: Any, expected: tuple) -> None:
    outs = tuple(out) if isinstance(out, tuple) else (out,)
    assert len(outs) == len(expected), f"{len(outs)} outputs, expected {len(expected)}"
    for k, (o, e) in enumerate(zip(outs, expected)):
        if e is None:
            assert o is None, f"output {k}: expected None, got {type(o).__name__}"
            continue
        assert isinstance(o, fw.array_type), f"output {k}: {type(o).__name__} is not a {fw.name} array"
        assert (tuple(int(s) for s in o.shape), dtype_name(o)) == e, f"output {k}"


@pytest.mark.parametrize("call, expected", EMPTY_CASES)
def test_empty_inputs_give_empty_outputs(fw: Fw, call, expected) -> None:
    _check_outputs(fw, call(fw), expected)


@pytest.mark.parametrize(
    "config, x_dtype",
    [
        pytest.param(LAYER, F32, id="softmax-none-f32"),
        pytest.param(LAYER.replace(activation="gelu_tanh"), BF16, id="softmax-none-bf16"),
        pytest.param(LAYER_FP8, F32, id="softmax-fp8_per_token"),
        pytest.param(LAYER_EP.replace(quant="fp8_per_token", apply_routed_scaling_factor_on_output=True), BF16,
                     id="biased-shared-EP-rank1-fp8_per_token"),
        pytest.param(LAYER_BLOCK, BF16, id="softmax-fp8_block"),
    ],
)
def test_layer_with_no_tokens(fw: Fw, config: MoEConfig, x_dtype: str) -> None:
    """``moe_forward`` with ``T = 0``: out ``[0, H]`` in ``x.dtype``, through every stage."""
    H, I, E = config.hidden_size, config.intermediate_size, config.num_experts
    _, el = config.local_expert_range()
    w_dtype = x_dtype if config.quant == "none" else F32
    w13, w13_scale, w2, w2_scale = fw.m.quantize_layer_weights(
        fw.f(el, 2 * I, H, dtype=w_dtype), fw.f(el, H, I, dtype=w_dtype), config
    )
    bias = fw.f(E) if config.routing == "biased_grouped_topk" else None
    out = fw.m.moe_forward(
        fw.f(0, H, dtype=x_dtype), fw.f(0, E), w13, w2, config,
        w13_scale=w13_scale, w2_scale=w2_scale, e_score_correction_bias=bias,
    )
    _check_outputs(fw, out, (((0, H), x_dtype),))


# --------------------------------------------------------------------------------------
# Arrays of the wrong framework, non-arrays, bool flags, scale layouts that don't fit the config


def _other(fw: Fw) -> Fw:
    return FRAMEWORKS["torch" if fw.name == "jax" else "jax"]


@pytest.mark.parametrize("op, call", [
    ("select_experts", lambda m, a: m.select_experts(a.f(2, 8), topk=2)),
    ("per_token_quant_fp8", lambda m, a: m.per_token_quant_fp8(a.f(2, 8))),
    ("quantize_weight_fp8", lambda m, a: m.quantize_weight_fp8(a.f(2, 3, 8))),
    ("routing_metadata", lambda m, a: m.routing_metadata(a.i([[0, 1]]), 4)),
    ("combine", lambda m, a: m.combine(a.f(4, 8), a.i([[0, 1], [2, 3]]), a.f(2, 2))),
    ("moe_forward", lambda m, a: m.moe_forward(a.f(2, 16), a.f(2, 4), a.f(4, 8, 16), a.f(4, 16, 4), LAYER)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_arrays_of_the_other_framework_are_a_type_error(fw: Fw, op, call) -> None:
    """A torch tensor to moe_pallas (or a jax array to moe_torch) names the op and the argument."""
    expected = "must be a jax array" if fw.name == "jax" else "must be a torch.Tensor"
    with pytest.raises(TypeError, match=re.escape(f"{op}: ") + ".*" + re.escape(expected)):
        call(fw.m, _other(fw))


def test_numpy_arrays_are_a_type_error_for_torch() -> None:
    torch_fw = FRAMEWORKS["torch"]
    with pytest.raises(TypeError, match=re.escape("per_token_quant_fp8: x must be a torch.Tensor") + ".*numpy.ndarray"):
        torch_fw.m.per_token_quant_fp8(np.ones((2, 8), np.float32))


@pytest.mark.parametrize("value, kind", [(None, "NoneType"), ([[1.0, 2.0]], "list")])
def test_non_arrays_are_a_type_error(fw: Fw, value, kind) -> None:
    with pytest.raises(TypeError, match=re.escape("per_token_quant_fp8: x must be an array [rows, K]; got " + kind)):
        fw.m.per_token_quant_fp8(value)


@pytest.mark.parametrize("name", ["renormalize", "apply_routed_scaling_factor_on_output"])
def test_bool_flags_must_be_bools(fw: Fw, name) -> None:
    with pytest.raises(TypeError, match=re.escape(f"select_experts: {name} must be a bool; got {name}='no'")):
        fw.m.select_experts(fw.f(2, 8), topk=2, **{name: "no"})
    with pytest.raises(TypeError, match=re.escape(f"MoEConfig: {name} must be a bool; got {name}='no'")):
        MoEConfig(**BASE, **{name: "no"})


def test_fp8_per_token_layer_rejects_block_weight_scales(fw: Fw) -> None:
    config = MoEConfig(hidden_size=128, intermediate_size=128, num_experts=2, topk=1, quant="fp8_per_token")
    w13, w2 = fw.fp8(2, 256, 128), fw.fp8(2, 128, 128)
    block13, block2 = fw.full((2, 2, 1), 0.1), fw.full((2, 1, 1), 0.1)
    with pytest.raises(ValueError, match=re.escape("moe_forward: w13_scale must be per-expert [E_local] or per-channel")):
        fw.m.moe_forward(fw.f(2, 128), fw.f(2, 2), w13, w2, config, w13_scale=block13, w2_scale=block2)


@pytest.mark.parametrize("spelling", ["name", "other-framework"])
def test_out_dtype_in_any_spelling(fw: Fw, spelling) -> None:
    """``out_dtype`` may be a name or the other framework's dtype object: the result is bf16 either way."""
    import jax.numpy as jnp
    import torch

    dt = "bfloat16" if spelling == "name" else (torch.bfloat16 if fw.name == "jax" else jnp.bfloat16)
    out, _ = fw.m.silu_and_mul(fw.f(4, 8), out_dtype=dt)
    assert dtype_name(out) == "bfloat16"


def test_inputs_and_preset_overrides_name_what_is_wrong():
    """Second new-user trial: numpy's bare errors for a negative T or seed, and Python's
    unnamed one for a misspelled preset override, now name the function and the argument."""
    from moe_contract import get_preset, make_layer_inputs

    config = get_preset("tiny").config()
    with pytest.raises(ValueError, match=r"^make_layer_inputs: num_tokens must be an int >= 0; got num_tokens=-1$"):
        make_layer_inputs(config, -1)
    with pytest.raises(ValueError, match=r"^make_layer_inputs: seed must be an int >= 0; got seed=-2$"):
        make_layer_inputs(config, 3, seed=-2)
    with pytest.raises(TypeError, match=r"^ModelPreset.config \(preset 'tiny'\): unknown MoEConfig field\(s\) \['qaunt'\]"):
        get_preset("tiny").config(qaunt="fp8_block")
    with pytest.raises(TypeError, match=r"^MoEConfig.replace: unknown MoEConfig field\(s\) \['ep_sise'\]"):
        config.replace(ep_sise=2)


def test_misspelled_keyword_names_the_op():
    import torch

    import moe_pallas
    import moe_torch

    x = torch.zeros(2, 4)
    with pytest.raises(TypeError, match=r"^moe_forward: got an unexpected keyword argument 'foo'$"):
        moe_torch.moe_forward(x, x, x, x, None, foo=1)
    with pytest.raises(TypeError, match=r"^moe_forward: got an unexpected keyword argument 'foo'$"):
        moe_pallas.moe_forward(1, 2, 3, 4, None, foo=1)


def test_moe_config_takes_numpy_integers_as_ints():
    """New-user trial: MoEConfig(hidden_size=np.int64(256)) was refused ("must be an int >= 1").
    numpy integers are ints (stored as Python ints, so the config hashes as one built from ints); numpy
    floats and bools are still refused."""
    import numpy as np

    from moe_contract import MoEConfig

    kw = dict(hidden_size=np.int64(256), intermediate_size=np.int32(128), num_experts=np.int64(8), topk=np.int64(2))
    config = MoEConfig(**kw)
    assert type(config.hidden_size) is int and config == MoEConfig(hidden_size=256, intermediate_size=128,
                                                                    num_experts=8, topk=2)
    assert hash(config) == hash(MoEConfig(hidden_size=256, intermediate_size=128, num_experts=8, topk=2))
    with pytest.raises(ValueError, match="hidden_size must be an int >= 1"):
        MoEConfig(**{**kw, "hidden_size": np.float64(256)})
    with pytest.raises(ValueError, match="topk must be an int >= 1"):
        MoEConfig(**{**kw, "topk": True})
