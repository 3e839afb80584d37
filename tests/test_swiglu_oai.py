"""gpt-oss's ``swiglu_oai`` activation and the interleaved gate/up layout (CONTRACT.md sections 4 and 8).

The judge is transformers' own formula: ``GptOssExperts._apply_gate`` (transformers 5.24,
``models/gpt_oss/modeling_gpt_oss.py``; ``gate, up = gate_up[..., ::2], gate_up[..., 1::2]``, torch ``clamp``,
``(up + 1) * gate * sigmoid(alpha * gate)``) run in float64 here, and torch's autograd of it for the gradients
(torch's ``clamp`` passes the gradient at its bounds, gives 0 beyond them and for NaN: the contract's rule).

What is proved, in both frameworks, for the references and the interpreted kernels (Triton, Pallas-Triton),
in both layouts (``"concatenated"`` ``[g | u]``, ``"interleaved"`` ``g0 u0 g1 u1 ...``):

- named cases: the clamp boundaries exactly at ``g = 7`` and ``u = +-7`` (the value as at the bound, the
  gradient passed at the bound and 0 beyond it), large ``|g|`` and ``|u|`` (no overflow), NaN in ``g`` or ``u``
  kept NaN (the clamps are selects) without leaking into the neighbours, in the forward, the backward op and
  autograd through the public forward;
- several column programs (forced small tiles, odd ``I``, a partial last block), float32 and bf16;
- the fused FP8 output (per token, per token group; one- and multi-chunk kernels): codes and scales are exactly
  the quantization of the same implementation's float32 output;
- the references' backward is the derivative of their forward (``torch.autograd.gradcheck``,
  ``jax.test_util.check_grads``, float64);
- the layer: ``moe_forward`` with ``activation="swiglu_oai"`` (both layouts) equals a float64 per-token loop
  written here, and its gradients for ``x``, ``router_logits``, ``w13``, ``w2`` equal autodiff of that loop, for
  every implementation, with ``recompute``, under expert parallelism (sum of ranks) and with FP8 weights;
  the modules (``EPMoE``, ``MoELayer``) honour the layout;
- bad input (unknown activation or layout, odd widths) raises naming the argument;
- the new kernel variants compile for sm_90 (Triton) and lower for CUDA (Pallas), without a GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
from jax.test_util import check_grads

import moe_pallas
import moe_torch
from common import TORCH_DEVICE, to_jax, to_torch
from moe_contract import MoEConfig, get_preset
from moe_pallas.ops.activation import reference as jact
from moe_pallas.ops.activation.config import ActAndMulBackwardConfig as JBwdConfig
from moe_pallas.ops.activation.config import ActAndMulConfig as JFwdConfig
from moe_pallas.ops.activation.pallas_triton import act_and_mul_backward_pallas_triton, act_and_mul_pallas_triton
from moe_torch.ops.activation import reference as tact
from moe_torch.ops.activation.config import ActAndMulBackwardConfig as TBwdConfig
from moe_torch.ops.activation.config import ActAndMulConfig as TFwdConfig
from moe_torch.ops.activation.triton import act_and_mul_backward_triton, act_and_mul_triton
from sm90 import compile_sm90
from tolerances import BF16_REL_FRO, F32_REL_FRO, GRAD_F32_REL_FRO, assert_exact, assert_rel_fro, to_numpy

LIMIT, ALPHA = 7.0, 1.702
LAYOUTS = ("concatenated", "interleaved")
MODULES = {"torch": moe_torch, "jax": moe_pallas}
#: (framework, implementation): the references and the interpreted kernels.
IMPLS = [("torch", "reference"), ("torch", "triton"), ("jax", "reference"), ("jax", "pallas_triton")]
#: tl.sigmoid(x) = 1 / (1 + exp(-x)) in Triton's interpreter: exp(340) overflows to inf in numpy (warning) and
#: 1 / inf = 0 is the right sigmoid; the named case "g-large-negative" does that on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


# --------------------------------------------------------------------------------------
# the judge: transformers' GptOssExperts._apply_gate, float64, and torch autograd of it


@functools.cache
def _gpt_oss_experts():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(GptOssConfig(num_local_experts=1, hidden_size=2, intermediate_size=2))
    assert (experts.limit, experts.alpha) == (LIMIT, ALPHA)  # the contract's constants are gpt-oss's
    return experts


def pack(g: np.ndarray, u: np.ndarray, layout: str) -> np.ndarray:
    """``g, u [M, I]`` -> ``h [M, 2*I]`` in ``layout``."""
    if layout == "interleaved":
        return np.stack([g, u], axis=2).reshape(g.shape[0], 2 * g.shape[1])
    return np.concatenate([g, u], axis=1)


def unpack(h: np.ndarray, layout: str) -> tuple[np.ndarray, np.ndarray]:
    if layout == "interleaved":
        return h[:, 0::2], h[:, 1::2]
    return np.split(h, 2, axis=1)


def transformers_oai(g: np.ndarray, u: np.ndarray, d_a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(out, d_g, d_u)`` in float64: transformers' ``_apply_gate`` on gpt-oss's interleaved ``gate_up`` and
    torch's autograd of it for the cotangent ``d_a``."""
    gu = torch.tensor(pack(g, u, "interleaved"), dtype=torch.float64, requires_grad=True)
    out = _gpt_oss_experts()._apply_gate(gu)
    out.backward(torch.tensor(d_a, dtype=torch.float64))
    d_g, d_u = unpack(gu.grad.numpy(), "interleaved")
    return out.detach().numpy(), d_g, d_u


# --------------------------------------------------------------------------------------
# framework plumbing


def arr(fw: str, a: np.ndarray, dtype: str = "float32"):
    return to_torch(a, dtype) if fw == "torch" else to_jax(a, dtype)


def act_fwd(fw, impl, h, layout, **kw):
    return MODULES[fw].act_and_mul(h, activation="swiglu_oai", layout=layout, implementation=impl, **kw)


def act_bwd(fw, impl, h, d_a, layout):
    return MODULES[fw].act_and_mul_backward(h, d_a, activation="swiglu_oai", layout=layout, implementation=impl)


def autograd_bwd(fw, impl, h, d_a, layout):
    """``d_h`` by the framework's autograd through the public (differentiable) ``act_and_mul``."""
    if fw == "torch":
        hh = h.detach().clone().requires_grad_(True)
        out, _ = act_fwd(fw, impl, hh, layout)
        out.backward(d_a)
        return hh.grad
    _, vjp = jax.vjp(lambda v: act_fwd(fw, impl, v, layout)[0], h)
    return vjp(d_a)[0]


# --------------------------------------------------------------------------------------
# 1. named cases against transformers' formula

NAN = float("nan")
#: name -> (g, u) placed at gate column 1 of its own row (the other columns random); each comment says which edge.
CASES = {
    "g-below-limit": (6.5, 0.5),  # inside: the plain formula
    "g-at-limit": (7.0, 0.5),  # the gate bound itself: value unclamped, gradient passed
    "g-above-limit": (7.5, 0.5),  # clamped: the value at g = 7, d_g = 0
    "u-at-plus-limit": (1.5, 7.0),  # the up bound: d_u passed
    "u-above-plus-limit": (1.5, 8.0),  # clamped: the value at u = 7, d_u = 0
    "u-at-minus-limit": (1.5, -7.0),  # the lower up bound: d_u passed
    "u-below-minus-limit": (1.5, -9.0),  # clamped: the value at u = -7, d_u = 0
    "u-minus-one": (2.0, -1.0),  # uc + 1 = 0: out 0, d_g 0, d_u not 0
    "g-large-negative": (-200.0, 3.0),  # sigmoid(-340) underflows float32: out -0, no NaN
    "g-large-positive": (1e30, 3.0),  # clamped before the sigmoid: no overflow, the value at g = 7
    "u-large-negative": (2.0, -1e30),  # clamped to -7
    "g-nan": (NAN, 0.5),  # NaN stays NaN (a min instruction would give 7); d_g = 0, d_u NaN (torch)
    "u-nan": (0.5, NAN),  # NaN stays NaN; d_u = 0, d_g NaN (torch)
}
NAMES = list(CASES)
CASE_COL, I_NAMED = 1, 5  # odd I


def _named_inputs(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``g, u, d_a [len(CASES), I]`` float32: row r holds case r at column CASE_COL, N(0, 4^2) elsewhere."""
    rng = np.random.default_rng(seed)
    M = len(CASES)
    g = (rng.standard_normal((M, I_NAMED)) * 4).astype(np.float32)
    u = (rng.standard_normal((M, I_NAMED)) * 4).astype(np.float32)
    for r, (gv, uv) in enumerate(CASES.values()):
        g[r, CASE_COL], u[r, CASE_COL] = gv, uv
    d_a = (rng.standard_normal((M, I_NAMED)) + 2.0).astype(np.float32)  # no zero cotangent at the cases
    return g, u, d_a


def _close(got, want, what: str, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """float32 against float64, NaN where and only where the judge has NaN."""
    np.testing.assert_allclose(to_numpy(got).astype(np.float64), want, rtol=rtol, atol=atol, equal_nan=True,
                               err_msg=what)


def _case(a: np.ndarray, name: str) -> float:
    return float(a[NAMES.index(name), CASE_COL])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fw,impl", IMPLS)
def test_named_cases_match_transformers(fw, impl, layout):
    """Every named case (and its random neighbours) against transformers' formula and torch's autograd of it:
    forward, ``act_and_mul_backward`` and autograd through the public ``act_and_mul``; plus the clamp facts."""
    g, u, d_a = _named_inputs()
    want_out, want_dg, want_du = transformers_oai(g.astype(np.float64), u.astype(np.float64), d_a.astype(np.float64))
    h = arr(fw, pack(g, u, layout))
    da = arr(fw, d_a)
    out, scale = act_fwd(fw, impl, h, layout)
    assert scale is None and to_numpy(out).dtype == np.float32 and to_numpy(out).shape == g.shape
    out = to_numpy(out)
    for name in NAMES:  # the named element first, so that a failure names its case
        _close(out[NAMES.index(name)], want_out[NAMES.index(name)], f"{fw}/{impl}/{layout} forward, case {name}")
    # the clamps, as facts of the contract (independent of the judge)
    assert _case(out, "g-above-limit") == _case(out, "g-at-limit") != _case(out, "g-below-limit")
    assert _case(out, "u-above-plus-limit") == _case(out, "u-at-plus-limit")
    assert _case(out, "u-below-minus-limit") == _case(out, "u-at-minus-limit")
    assert _case(out, "g-large-positive") == pytest.approx(4.0 * 7.0 / (1.0 + math.exp(-ALPHA * 7.0)), rel=1e-6)
    assert _case(out, "u-large-negative") == pytest.approx(-6.0 * 2.0 / (1.0 + math.exp(-ALPHA * 2.0)), rel=1e-6)
    assert _case(out, "u-minus-one") == 0.0 and _case(out, "g-large-negative") == 0.0
    nan_rows = [NAMES.index("g-nan"), NAMES.index("u-nan")]
    assert np.isnan(out[nan_rows, CASE_COL]).all()
    assert np.isfinite(np.delete(out, CASE_COL, axis=1)).all()  # no NaN leaks into a neighbour

    for how, fn in (("backward op", act_bwd), ("autograd", autograd_bwd)):
        d_g, d_u = unpack(to_numpy(fn(fw, impl, h, da, layout)), layout)
        what = f"{fw}/{impl}/{layout} {how}"
        for name in NAMES:
            r = NAMES.index(name)
            _close(d_g[r], want_dg[r], f"{what} d_g, case {name}")
            _close(d_u[r], want_du[r], f"{what} d_u, case {name}")
        # gradient at the bounds: passed; beyond: exactly 0
        assert _case(d_g, "g-at-limit") != 0.0 and _case(d_g, "g-above-limit") == 0.0
        assert _case(d_g, "g-large-positive") == 0.0
        for bound, beyond in (("u-at-plus-limit", "u-above-plus-limit"), ("u-at-minus-limit", "u-below-minus-limit")):
            assert _case(d_u, bound) != 0.0 and _case(d_u, beyond) == 0.0, (what, bound)
        assert _case(d_u, "u-large-negative") == 0.0 and _case(d_g, "u-minus-one") == 0.0
        assert _case(d_g, "g-nan") == 0.0 and math.isnan(_case(d_u, "g-nan"))
        assert _case(d_u, "u-nan") == 0.0 and math.isnan(_case(d_g, "u-nan"))
        finite = np.delete(np.concatenate([d_g, d_u], axis=1), [CASE_COL, I_NAMED + CASE_COL], axis=1)
        assert np.isfinite(finite).all(), what


# --------------------------------------------------------------------------------------
# 2. several column programs (forced small tiles), float32 and bf16


def _random_h(rng, M: int, I: int, scale: float = 4.0):
    """``g, u [M, I]`` N(0, 4^2) (about 8% beyond each clamp bound) and ``d_a [M, I]`` N(0, 1)."""
    g, u = (rng.standard_normal((2, M, I)) * scale).astype(np.float32)
    return g, u, rng.standard_normal((M, I)).astype(np.float32)


def _kernel_direct(fw: str, h, d_a, layout: str):
    """The kernels called directly with forced tiles: 4 gate columns x 2 rows per program; outputs in h's dtype."""
    if fw == "torch":
        out, _ = act_and_mul_triton(h, "swiglu_oai", None, 128, h.dtype, layout,
                                    config=TFwdConfig(block_m=2, block_n=4, single_chunk=True, num_warps=4, num_stages=1))
        d_h = act_and_mul_backward_triton(h, d_a, "swiglu_oai", h.dtype, layout,
                                          config=TBwdConfig(block_m=2, block_n=4, num_warps=4, num_stages=1))
        return out, d_h
    out, _ = act_and_mul_pallas_triton(h, activation="swiglu_oai", layout=layout, config=JFwdConfig(block_m=2, block_i=4))
    d_h = act_and_mul_backward_pallas_triton(h, d_a, activation="swiglu_oai", layout=layout,
                                             config=JBwdConfig(block_m=2, block_i=4))
    return out, d_h


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_kernels_with_several_column_programs(fw, layout, dtype):
    """M = 7, I = 13: 4 row programs (the last half empty) x 4 column programs (the last with 1 of 4 columns)."""
    g, u, d_a = _random_h(np.random.default_rng(3), 7, 13)
    h, da = arr(fw, pack(g, u, layout), dtype), arr(fw, d_a, dtype)
    g64, u64 = unpack(to_numpy(h).astype(np.float64), layout)  # the values the low-precision input holds
    want_out, want_dg, want_du = transformers_oai(g64, u64, to_numpy(da).astype(np.float64))
    out, d_h = _kernel_direct(fw, h, da, layout)
    assert to_numpy(out).dtype.name == dtype and to_numpy(d_h).dtype.name == dtype
    limit = F32_REL_FRO if dtype == "float32" else BF16_REL_FRO
    assert_rel_fro(out, want_out, limit, f"{fw} {layout} {dtype} forward")
    assert_rel_fro(d_h, pack(want_dg, want_du, layout), limit, f"{fw} {layout} {dtype} backward")
    # and the public ops (default tiles) agree with the kernels called directly
    ref_out, _ = act_fwd(fw, "reference", h, layout)
    assert_rel_fro(out, ref_out, limit, "kernel vs reference")


# --------------------------------------------------------------------------------------
# 3. the fused FP8 output


def _fp8_configs(fw: str, quant: str):
    """``None`` (the heuristic: one chunk) and a forced multi-chunk config of the kernel."""
    if fw == "torch":
        forced = TFwdConfig(block_m=2, block_n=64, single_chunk=False, num_warps=4, num_stages=1)
    else:
        forced = (JFwdConfig(block_m=2, block_i=64, two_pass=True) if quant == "fp8_per_token" else
                  JFwdConfig(block_m=2, block_i=128))
    return [None, forced]


@pytest.mark.parametrize("quant", ["fp8_per_token", "fp8_per_token_group"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_fp8_output(layout, quant):
    """Codes and scales of the fused path are exactly the framework reference's quantization of the same
    implementation's float32 output; dequantized, near the float64 formula (2^-4, e4m3's step); jnp and
    torch within the bf16 row of each other (an ulp of sigmoid may move a code by one step)."""
    g, u, _ = _random_h(np.random.default_rng(5), 6, 256)
    hnp = pack(g, u, layout)
    want, _, _ = transformers_oai(*unpack(to_numpy(to_torch(hnp, "bfloat16")).astype(np.float64), layout),
                                  np.zeros(g.shape))
    deq = {}
    for fw, impl in IMPLS:
        mod, h = MODULES[fw], arr(fw, hnp, "bfloat16")
        f32 = torch.float32 if fw == "torch" else jnp.float32
        a32, _ = act_fwd(fw, impl, h, layout, out_dtype=f32)
        rq, rs = (mod.per_token_quant_fp8(a32, implementation="reference") if quant == "fp8_per_token" else
                  mod.per_token_group_quant_fp8(a32, 128, implementation="reference"))
        q, s = act_fwd(fw, impl, h, layout, quant=quant, group_size=128)
        assert_exact(q, rq, f"{fw}/{impl} codes")
        assert_exact(s, rs, f"{fw}/{impl} scales")
        if impl != "reference":  # the multi-chunk / two-pass kernels: the same codes and scales
            for cfg in _fp8_configs(fw, quant)[1:]:
                if fw == "torch":
                    q2, s2 = act_and_mul_triton(h, "swiglu_oai", quant, 128, f32, layout, config=cfg)
                else:
                    q2, s2 = act_and_mul_pallas_triton(h, activation="swiglu_oai", layout=layout, quant=quant,
                                                       group_size=128, config=cfg)
                assert_exact(q2, q, f"{fw} forced {cfg} codes")
                assert_exact(s2, s, f"{fw} forced {cfg} scales")
        deq[(fw, impl)] = mod.dequantize_fp8(q, s)
        assert_rel_fro(deq[(fw, impl)], want, 2.0**-4, f"{fw}/{impl} fp8 near float64")
    assert_rel_fro(deq[("jax", "pallas_triton")], deq[("torch", "triton")], BF16_REL_FRO, "Pallas vs Triton")


# --------------------------------------------------------------------------------------
# 4. the references' backward is the derivative of their forward (finite differences, float64)


def _away_from_bounds(x: np.ndarray) -> np.ndarray:
    """Move values within 1e-3 of +-7 off the kink (finite differences straddling it are not a derivative)."""
    return np.where(np.abs(np.abs(x) - LIMIT) < 1e-3, x + 0.01, x)


class _RefPair(torch.autograd.Function):
    """forward: the torch reference forward; backward: the torch reference backward (float64)."""

    @staticmethod
    def forward(ctx, h, layout):
        ctx.save_for_backward(h)
        ctx.layout = layout
        return tact.act_and_mul_reference(h, "swiglu_oai", None, 128, h.dtype, layout)[0]

    @staticmethod
    def backward(ctx, ct):
        (h,) = ctx.saved_tensors
        return tact.act_and_mul_backward_reference(h, ct, "swiglu_oai", h.dtype, ctx.layout), None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_backward_passes_finite_differences(layout):
    """Both references (torch.autograd.gradcheck, jax check_grads; float64), inputs on both sides of every
    clamp (N(0, 5^2): the clamped region's zero gradient is checked too)."""
    g, u = _away_from_bounds(np.random.default_rng(7).standard_normal((2, 3, 6)) * 5)
    g[0, 0], u[1, 1], u[2, 2] = 9.3, 8.2, -7.9  # one of each clamped region, whatever the draw
    h = pack(g, u, layout)
    ht = torch.tensor(h, dtype=torch.float64, device=TORCH_DEVICE, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: _RefPair.apply(v, layout), (ht,), eps=1e-6, atol=1e-7)

    def fwd(v):
        return jact.act_and_mul_reference(v, "swiglu_oai", None, 128, v.dtype, layout)[0]

    pair = jax.custom_vjp(fwd)
    pair.defvjp(lambda v: (fwd(v), v),
                lambda v, ct: (jact.act_and_mul_backward_reference(v, ct, "swiglu_oai", v.dtype, layout),))
    with jax.enable_x64(True):
        check_grads(jax.jit(pair), (jnp.asarray(h, jnp.float64),), order=1, modes=["rev"], eps=1e-6, atol=1e-7,
                    rtol=1e-7)
        # and jax's own autodiff of the jnp reference forward is the reference backward (the selects' rule)
        hj, ct = jnp.asarray(h, jnp.float64), jnp.asarray(np.ones((3, 6)), jnp.float64)
        auto = jax.vjp(fwd, hj)[1](ct)[0]
        assert_rel_fro(auto, jact.act_and_mul_backward_reference(hj, ct, "swiglu_oai", jnp.float64, layout), 1e-12)


# --------------------------------------------------------------------------------------
# 5. the layer against a float64 per-token loop (and autodiff of it)

T_L, H_L, I_L, E_L, TOPK_L = 5, 16, 6, 4, 2


def _layer_inputs(seed: int = 11):
    """x N(0, 1), logits N(0, 1), w13 N(0, 16/H) (so h ~ N(0, 4^2): about 8% of g, u beyond the clamps),
    w2 N(0, 1/I); float32 numpy, gpt-oss-like shapes in miniature."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T_L, H_L)).astype(np.float32)
    logits = rng.standard_normal((T_L, E_L)).astype(np.float32)
    w13 = (rng.standard_normal((E_L, 2 * I_L, H_L)) * 4 / math.sqrt(H_L)).astype(np.float32)
    w2 = (rng.standard_normal((E_L, H_L, I_L)) / math.sqrt(I_L)).astype(np.float32)
    return x, logits, w13, w2


def loop_layer(x, logits, w13, w2, layout: str, activation: str = "swiglu_oai"):
    """The layer in float64 torch, one token and one slot at a time: softmax over E, top-k, renormalize,
    ``h = w13[e] @ x[t]``, gate/up by ``layout``, the activation (swiglu_oai: transformers' ``_apply_gate``
    formula with ``torch.clamp``), ``w2[e] @ a``, weighted sum."""
    out = []
    for t in range(x.shape[0]):
        p = torch.softmax(logits[t], dim=0)
        ids = torch.topk(p, TOPK_L).indices
        w = p[ids] / p[ids].sum()
        acc = torch.zeros(x.shape[1], dtype=x.dtype)
        for j in range(TOPK_L):
            e = int(ids[j])
            h = w13[e] @ x[t]
            g, u = (h[0::2], h[1::2]) if layout == "interleaved" else (h[:I_L], h[I_L:])
            if activation == "swiglu_oai":
                g = g.clamp(min=None, max=LIMIT)
                a = (u.clamp(min=-LIMIT, max=LIMIT) + 1) * (g * torch.sigmoid(g * ALPHA))
            else:
                a = g * torch.sigmoid(g) * u
            acc = acc + w[j] * (w2[e] @ a)
        out.append(acc)
    return torch.stack(out)


def loop_with_grads(inputs, layout: str, activation: str, d_out: np.ndarray):
    ts = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in inputs]
    out = loop_layer(*ts, layout, activation)
    grads = torch.autograd.grad(out, ts, torch.tensor(d_out, dtype=torch.float64))
    return out.detach().numpy(), [g.numpy() for g in grads]


def layer_with_grads(fw: str, inputs, config: MoEConfig, d_out: np.ndarray, implementation, recompute=False):
    """``(out, [d_x, d_router_logits, d_w13, d_w2])`` of ``moe_forward`` in float32."""
    if fw == "torch":
        ts = [to_torch(a).requires_grad_(True) for a in inputs]
        out = moe_torch.moe_forward(*ts, config, implementation=implementation, recompute=recompute)
        out.backward(to_torch(d_out))
        return out, [t.grad for t in ts]
    out, vjp = jax.vjp(lambda *a: moe_pallas.moe_forward(*a, config, implementation=implementation,
                                                         recompute=recompute), *[to_jax(a) for a in inputs])
    return out, list(vjp(to_jax(d_out)))


GRAD_NAMES = ("d_x", "d_router_logits", "d_w13", "d_w2")


#: every implementation on gpt-oss's combination; the references also on the two others (file time).
LAYER_CASES = ([(fw, impl, "swiglu_oai", "interleaved") for fw, impl in IMPLS]
               + [(fw, "reference", act, layout) for fw in ("torch", "jax")
                  for act, layout in (("swiglu_oai", "concatenated"), ("silu", "interleaved"))])


@pytest.mark.parametrize("fw,impl,activation,layout", LAYER_CASES)
def test_layer_matches_float64_loop(fw, impl, activation, layout):
    """``moe_forward`` (float32) and its four gradients vs the float64 loop and its autodiff."""
    inputs = _layer_inputs()
    d_out = np.random.default_rng(12).standard_normal((T_L, H_L)).astype(np.float32)
    want, want_grads = loop_with_grads(inputs, layout, activation, d_out)
    config = MoEConfig(hidden_size=H_L, intermediate_size=I_L, num_experts=E_L, topk=TOPK_L, activation=activation,
                       gate_up_layout=layout)
    out, grads = layer_with_grads(fw, inputs, config, d_out, impl)
    assert_rel_fro(out, want, F32_REL_FRO, f"{fw}/{impl} out")
    for name, got, ref in zip(GRAD_NAMES, grads, want_grads):
        assert_rel_fro(got, ref, GRAD_F32_REL_FRO, f"{fw}/{impl} {name}")
    if layout == "interleaved":  # the layout is honoured: read concatenated, the same weights give another layer
        other = loop_layer(*[torch.tensor(a, dtype=torch.float64) for a in inputs], "concatenated", activation)
        assert np.linalg.norm(want - other.numpy()) > 0.1 * np.linalg.norm(want)


@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_layer_recompute_and_expert_parallel(fw):
    """gpt-oss's layer (swiglu_oai, interleaved), reference: ``recompute=True`` gives the loop's gradients; under
    EP (2 ranks) the ranks' outputs and router-logit / x gradients sum to the loop's, each rank's weight
    gradients are its slice of the loop's."""
    inputs = _layer_inputs(13)
    d_out = np.random.default_rng(14).standard_normal((T_L, H_L)).astype(np.float32)
    want, want_grads = loop_with_grads(inputs, "interleaved", "swiglu_oai", d_out)
    config = MoEConfig(hidden_size=H_L, intermediate_size=I_L, num_experts=E_L, topk=TOPK_L, activation="swiglu_oai",
                       gate_up_layout="interleaved")
    _, grads = layer_with_grads(fw, inputs, config, d_out, None, recompute=True)
    for name, got, ref in zip(GRAD_NAMES, grads, want_grads):
        assert_rel_fro(got, ref, GRAD_F32_REL_FRO, f"recompute {name}")
    ep = config.replace(ep_size=2)
    x, logits, w13, w2 = inputs
    total, d_x, d_logits = 0.0, 0.0, 0.0
    for r in range(2):
        cfg = ep.for_rank(r)
        start, e_local = cfg.local_expert_range()
        sl = slice(start, start + e_local)
        out, (gx, gl, g13, g2) = layer_with_grads(fw, (x, logits, w13[sl], w2[sl]), cfg, d_out, None)
        total, d_x, d_logits = total + to_numpy(out), d_x + to_numpy(gx), d_logits + to_numpy(gl)
        assert_rel_fro(g13, want_grads[2][sl], GRAD_F32_REL_FRO, f"rank {r} d_w13")
        assert_rel_fro(g2, want_grads[3][sl], GRAD_F32_REL_FRO, f"rank {r} d_w2")
    assert_rel_fro(total, want, F32_REL_FRO, "EP sum of ranks")
    assert_rel_fro(d_x, want_grads[0], GRAD_F32_REL_FRO, "EP d_x")
    assert_rel_fro(d_logits, want_grads[1], GRAD_F32_REL_FRO, "EP d_router_logits")


@pytest.mark.parametrize("fw,impl", [("torch", "triton"), ("jax", "pallas_triton")])
def test_fp8_layer(fw, impl):
    """gpt-oss's layer with FP8 weights (per output channel) and per-token FP8 activations, the kernels (the
    references' FP8 activation with the layout is ``test_fused_fp8_output``'s; the layer passes the same
    arguments to either): near the float64 loop on the dequantized weights, and ``x``'s gradient (straight-through)
    near the loop's. The error is the two e4m3 activation quantizations' (measured 4.1e-2 for the output,
    2.6e-2 for d_x, in all four implementations): bound 0.1; the other layout's loop is 1.6 away (checked
    to be far)."""
    x, logits, w13, w2 = _layer_inputs(15)
    config = MoEConfig(hidden_size=H_L, intermediate_size=I_L, num_experts=E_L, topk=TOPK_L, activation="swiglu_oai",
                       gate_up_layout="interleaved", quant="fp8_per_token")
    mod, conv = MODULES[fw], (to_torch if fw == "torch" else to_jax)
    q13, s13, q2, s2 = mod.quantize_layer_weights(conv(w13), conv(w2), config)
    deq = [to_numpy(mod.dequantize_weight_fp8(q, s)).astype(np.float64) for q, s in ((q13, s13), (q2, s2))]
    d_out = np.random.default_rng(16).standard_normal((T_L, H_L)).astype(np.float32)
    want, want_grads = loop_with_grads((x, logits, *deq), "interleaved", "swiglu_oai", d_out)
    if fw == "torch":
        xt = to_torch(x).requires_grad_(True)
        out = moe_torch.moe_forward(xt, to_torch(logits), q13, q2, config, w13_scale=s13, w2_scale=s2,
                                    implementation=impl)
        out.backward(to_torch(d_out))
        d_x = xt.grad
    else:
        out, vjp = jax.vjp(lambda v: moe_pallas.moe_forward(v, to_jax(logits), q13, q2, config, w13_scale=s13,
                                                            w2_scale=s2, implementation=impl), to_jax(x))
        (d_x,) = vjp(to_jax(d_out))
    assert_rel_fro(out, want, 0.1, f"{fw}/{impl} fp8 out")
    assert_rel_fro(d_x, want_grads[0], 0.1, f"{fw}/{impl} fp8 d_x (straight-through)")
    wrong = loop_layer(*[torch.tensor(a, dtype=torch.float64) for a in (x, logits, *deq)], "concatenated")
    assert np.linalg.norm(to_numpy(out) - wrong.numpy()) > 0.5 * np.linalg.norm(wrong.numpy())


def test_modules_and_presets_take_the_layout():
    """``EPMoE`` and ``MoELayer`` run gpt-oss's layer: the float64 loop's output, and the torch module's weight
    gradients are the loop's; a preset takes the two fields as overrides."""
    cfg = get_preset("tiny").config(activation="swiglu_oai", gate_up_layout="interleaved")
    assert (cfg.activation, cfg.gate_up_layout, cfg.hidden_size) == ("swiglu_oai", "interleaved", 256)
    x, logits, w13, w2 = _layer_inputs(17)
    d_out = np.random.default_rng(18).standard_normal((T_L, H_L)).astype(np.float32)
    want, want_grads = loop_with_grads((x, logits, w13, w2), "interleaved", "swiglu_oai", d_out)
    config = MoEConfig(hidden_size=H_L, intermediate_size=I_L, num_experts=E_L, topk=TOPK_L, activation="swiglu_oai",
                       gate_up_layout="interleaved")
    t_layer = moe_torch.EPMoE(config, to_torch(w13), to_torch(w2))
    out = t_layer(to_torch(x), to_torch(logits))
    out.backward(to_torch(d_out))
    assert_rel_fro(out, want, F32_REL_FRO, "EPMoE")
    assert_rel_fro(t_layer.w13.grad, want_grads[2], GRAD_F32_REL_FRO, "EPMoE d_w13")
    assert_rel_fro(t_layer.w2.grad, want_grads[3], GRAD_F32_REL_FRO, "EPMoE d_w2")
    j_layer = moe_pallas.MoELayer(config, to_jax(w13), to_jax(w2))
    assert_rel_fro(j_layer(to_jax(x), to_jax(logits)), want, F32_REL_FRO, "MoELayer")


# --------------------------------------------------------------------------------------
# 6. bad input


@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_bad_input_raises_naming_the_argument(fw):
    mod = MODULES[fw]
    h, d_a = arr(fw, np.ones((3, 8), np.float32)), arr(fw, np.ones((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"swiglu_oai_and_mul: layout must be one of \('concatenated', 'interleaved'\); "
                                         r"got layout='gate_first'"):
        mod.act_and_mul(h, activation="swiglu_oai", layout="gate_first")
    with pytest.raises(ValueError, match=r"act_and_mul_backward: layout must be one of .*got layout='interleave'"):
        mod.act_and_mul_backward(h, d_a, activation="swiglu_oai", layout="interleave")
    with pytest.raises(ValueError, match=r"act_and_mul: activation must be one of \('silu', 'gelu_tanh', 'swiglu_oai'\); "
                                         r"got activation='swiglu'"):
        mod.act_and_mul(h, activation="swiglu", layout="interleaved")
    with pytest.raises(ValueError, match=r"act_and_mul_backward: activation must be one of .*got activation='swigluoai'"):
        mod.act_and_mul_backward(h, d_a, activation="swigluoai")
    odd = arr(fw, np.ones((3, 7), np.float32))
    for layout in LAYOUTS:
        with pytest.raises(ValueError, match=r"swiglu_oai_and_mul: h must be \[M, 2\*I\] with an even last dim; "
                                             r"got h.shape=\(3, 7\)"):
            mod.swiglu_oai_and_mul(odd, layout=layout)
        with pytest.raises(ValueError, match=r"act_and_mul_backward: h must be \[M, 2\*I\] with an even last dim"):
            mod.act_and_mul_backward(odd, d_a, activation="swiglu_oai", layout=layout)
        with pytest.raises(ValueError, match=r"act_and_mul_backward: d_a must be \[M, I\] = \(3, 4\)"):
            mod.act_and_mul_backward(h, arr(fw, np.ones((3, 8), np.float32)), activation="swiglu_oai", layout=layout)
        with pytest.raises(ValueError, match=r"I \(=h.shape\[1\] // 2\) must be divisible by group_size=3; got I=4"):
            mod.act_and_mul(h, activation="swiglu_oai", layout=layout, quant="fp8_per_token_group", group_size=3)
    with pytest.raises(TypeError, match=r"swiglu_oai_and_mul: h must have dtype"):
        mod.act_and_mul(arr(fw, np.ones((3, 8), np.int32), "int32"), activation="swiglu_oai")


def test_config_validates_activation_and_layout():
    base = dict(hidden_size=8, intermediate_size=4, num_experts=4, topk=2)
    cfg = MoEConfig(**base, activation="swiglu_oai", gate_up_layout="interleaved")
    assert (cfg.activation, cfg.gate_up_layout) == ("swiglu_oai", "interleaved")
    assert MoEConfig(**base).gate_up_layout == "concatenated"  # the default: Mixtral, Qwen3-MoE, DeepSeek-V3
    assert hash(cfg) != hash(cfg.replace(gate_up_layout="concatenated"))  # a jit static argument tells them apart
    with pytest.raises(ValueError, match=r"MoEConfig: gate_up_layout must be one of \('concatenated', 'interleaved'\); "
                                         r"got gate_up_layout='gate_up'"):
        MoEConfig(**base, gate_up_layout="gate_up")
    with pytest.raises(ValueError, match=r"MoEConfig: activation must be one of .*'swiglu_oai'.*got activation='swiglu-oai'"):
        MoEConfig(**base, activation="swiglu-oai")


# --------------------------------------------------------------------------------------
# 7. the new kernel variants compile for sm_90 (Triton) and lower for CUDA (Pallas), without a GPU


def test_kernels_compile_for_gpu():
    """gpt-oss's shapes (I = 2880, bf16): the Triton forward (cast, fused FP8 per-token-group) and backward,
    interleaved, compile to sm_90 cubin with no ``min`` / ``max`` instruction on the float32 activation's path
    (the clamps are selects; the FP8 kernel's amax and saturation use max); every Pallas variant lowers to
    one Triton call."""
    fsig = {"h_ptr": "*bf16", "out_ptr": "*bf16", "scale_ptr": "*fp32", "M": "i32", "I": "i32", "stride_h": "i32",
            "stride_out": "i32", "stride_scale": "i32"}
    bsig = {"h_ptr": "*bf16", "d_a_ptr": "*bf16", "d_h_ptr": "*bf16", "M": "i32", "I": "i32", "stride_h": "i32",
            "stride_da": "i32", "stride_dh": "i32"}

    def job(kernel, sig, constexprs):
        return {"kernel": kernel, "signature": sig, "constexprs": constexprs,
                "options": {"num_warps": 4, "num_stages": 1}}

    ptx = compile_sm90({
        "forward": job("_act_and_mul_kernel", fsig, {"ACTIVATION": 2, "QUANT": False, "SPAN": 1024,
                                                     "SINGLE_CHUNK": True, "BLOCK_M": 4, "BLOCK_N": 1024,
                                                     "INTERLEAVED": True}),
        "forward_fp8": job("_act_and_mul_kernel", {**fsig, "out_ptr": "*fp8e4nv"},
                           {"ACTIVATION": 2, "QUANT": True, "SPAN": 128, "SINGLE_CHUNK": True, "BLOCK_M": 32,
                            "BLOCK_N": 128, "INTERLEAVED": True}),
        "backward": job("_act_and_mul_backward_kernel", bsig, {"ACTIVATION": 2, "BLOCK_M": 2, "BLOCK_N": 1024,
                                                               "INTERLEAVED": True}),
    }, module="moe_torch.ops.activation.triton")
    for name, text in ptx.items():
        assert ".target sm_90" in text, name
    for name in ("forward", "backward"):
        assert not any(f"{op}.f32" in ptx[name] or f"{op}.NaN.f32" in ptx[name] for op in ("min", "max")), name

    S, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    h, d_a = S((37, 2 * 2880), bf16), S((37, 2880), bf16)
    jobs = [(functools.partial(act_and_mul_backward_pallas_triton, activation="swiglu_oai", layout=layout,
                               interpret=False), (h, d_a)) for layout in LAYOUTS]
    jobs += [(functools.partial(act_and_mul_pallas_triton, activation="swiglu_oai", layout=layout, quant=quant,
                                interpret=False), (h,))
             for layout in LAYOUTS for quant in (None, "fp8_per_token", "fp8_per_token_group")]
    with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "cuda"))):
        for f, args in jobs:
            text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("__gpu$xla.gpu.triton") == 1, f
