"""Backward of the non-GEMM stages (CONTRACT.md section 8), both frameworks: the references and the
differentiable stage ops.

Stages: ``act_and_mul_backward``, ``combine_backward``, ``permute_backward``,
``select_experts_backward`` (``moe_torch`` and ``moe_pallas``, the same names), and the forwards
``act_and_mul`` / ``combine`` / ``permute`` / ``select_experts`` made differentiable
(``torch.autograd.Function`` / ``jax.custom_vjp``).

What is proved:

- each reference backward IS the derivative of its reference forward: a function whose forward is the
  reference forward and whose backward is the reference backward passes ``torch.autograd.gradcheck``
  / ``jax.test_util.check_grads`` (finite differences, float64), and equals autodiff of the reference
  forward in float64 (``torch.autograd.grad`` / ``jax.vjp`` under ``jax.enable_x64``);
- every public backward op (float32 / bf16 inputs) is within CONTRACT.md section 8's tolerance of that
  float64 autodiff, for every routing mode and the edges (T=1, non-local slots under EP, empty
  experts, all rows on one expert, rows ``>= M`` poisoned with NaN that must not leak);
- the differentiable forwards give the same gradients through ``torch.autograd.grad`` and
  ``jax.grad`` under ``jax.jit``, route integer inputs no gradient, and raise (not return a wrong
  gradient) when asked for one through FP8 quantization;
- the torch and jnp references agree.

Kernels (Triton, Pallas-Triton) are in ``tests/test_backward_kernels.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.test_util import check_grads

import moe_pallas
import moe_torch
from common import TORCH_DEVICE, random_ids, to_jax, to_torch
from moe_pallas.ops.activation import reference as jact
from moe_pallas.ops.combine import reference as jcomb
from moe_pallas.ops.gate import reference as jgate
from moe_pallas.ops.permute import reference as jperm
from moe_torch.ops.activation import reference as tact
from moe_torch.ops.combine import reference as tcomb
from moe_torch.ops.gate import reference as tgate
from moe_torch.ops.permute import reference as tperm
from op_cases.gate import CASES as GATE_CASES
from tolerances import F32_REL_FRO, GRAD_BF16_REL_FRO, GRAD_F32_REL_FRO, assert_exact, assert_rel_fro, rel_fro, to_numpy

FRAMEWORKS = ("torch", "jax")
MODULES = {"torch": moe_torch, "jax": moe_pallas}
#: tolerance of a gradient by the dtype it is returned in (CONTRACT.md section 8).
LIMIT = {"float32": GRAD_F32_REL_FRO, "bfloat16": GRAD_BF16_REL_FRO}
#: float64 agreement of a reference backward with autodiff of the reference forward (both float64).
F64_REL_FRO = 1e-12

_GATE_DEFAULTS = dict(routing="softmax_topk", renormalize=True, num_expert_group=None, topk_group=None,
                      e_score_correction_bias=None, routed_scaling_factor=1.0,
                      apply_routed_scaling_factor_on_output=False, num_fused_shared_experts=0)


def arr(fw: str, a, dtype: str | None = None):
    """numpy -> the framework's array (optionally cast)."""
    return to_torch(a, dtype) if fw == "torch" else to_jax(a, dtype)


def f64(a) -> np.ndarray:
    """Any array (bf16 included) as float64 numpy: the exact values a low-precision input holds."""
    return to_numpy(a).astype(np.float64)


def autodiff64(fw: str, f, inputs: list[np.ndarray], cotangent: np.ndarray, ints: tuple = ()) -> list[np.ndarray]:
    """The vector-Jacobian product of ``f(*inputs, *ints)`` (a reference forward) at float64 ``inputs``,
    by the framework's own autodiff: ``torch.autograd.grad`` or ``jax.vjp`` under ``jax.enable_x64``."""
    if fw == "torch":
        xs = [torch.tensor(x, dtype=torch.float64, device=TORCH_DEVICE, requires_grad=True) for x in inputs]
        ct = torch.tensor(cotangent, dtype=torch.float64, device=TORCH_DEVICE)
        return [g.cpu().numpy() for g in torch.autograd.grad(f(*xs, *ints), xs, ct)]
    with jax.enable_x64(True):  # under jit: one compile instead of one per eager op (much faster on a CPU)
        vjp = jax.jit(lambda xs, ct: jax.vjp(lambda *v: f(*v, *ints), *xs)[1](ct))
        xs = [jnp.asarray(x, jnp.float64) for x in inputs]
        return [np.asarray(g) for g in vjp(xs, jnp.asarray(cotangent, jnp.float64))]


def in64(fw: str, fn, *args, **kwargs):
    """Call a reference ``fn`` on float64 copies of the numpy arrays among ``args`` (ints pass as given)."""
    def conv(a):
        if not (isinstance(a, np.ndarray) and a.dtype.kind == "f"):
            return a
        return torch.tensor(a, dtype=torch.float64, device=TORCH_DEVICE) if fw == "torch" else jnp.asarray(a, jnp.float64)

    if fw == "torch":
        return fn(*map(conv, args), **kwargs)
    with jax.enable_x64(True):
        return jax.tree.map(np.asarray, jax.jit(lambda *a: fn(*a, **kwargs))(*map(conv, args)))


def run(fw: str, fn, *arrays):
    """``fn(*arrays)``; for jax under ``jax.jit`` (the ops validate at trace time; one compile per call
    instead of one per eager op)."""
    return fn(*arrays) if fw == "torch" else jax.jit(fn)(*arrays)


# --------------------------------------------------------------------------------------
# inputs


def _h(rng, M: int, I: int) -> tuple[np.ndarray, np.ndarray]:
    """``h [M, 2*I]`` N(0, 3^2) (silu / gelu away from their linear region) and ``d_a [M, I]`` N(0, 1)."""
    return (rng.standard_normal((M, 2 * I)) * 3).astype(np.float32), rng.standard_normal((M, I)).astype(np.float32)


#: name -> (T, topk, E, expert_start, E_local, ids rule); each comment says which edge it exercises.
ROUTINGS = {
    "T1": (1, 2, 4, 0, 4, "random"),  # T = 1 (decode)
    "ep-nonlocal-empty": (9, 3, 8, 2, 3, "skip-expert-3"),  # EP slice: non-local slots, local expert 1 empty
    "one-expert": (5, 1, 4, 0, 4, "all-expert-2"),  # every row on one expert, the others empty
    "ep-no-local-token": (6, 2, 6, 4, 2, "random"),  # some tokens with no local slot at all (d_x = 0)
}


def _routing(name: str, seed: int = 0):
    """``(T, topk, M, src2dst [T, topk], dst2src [M_cap])`` (numpy int32) from the torch reference metadata."""
    T, topk, E, start, e_local, rule = ROUTINGS[name]
    rng = np.random.default_rng(seed)
    if rule == "random":
        ids = random_ids(rng, T, topk, E)
    elif rule == "skip-expert-3":
        ids = np.stack([rng.permutation([e for e in range(E) if e != 3])[:topk] for _ in range(T)]).astype(np.int32)
    else:
        ids = np.full((T, topk), 2, np.int32)
    offsets, src2dst, dst2src = tperm.routing_metadata_reference(torch.from_numpy(ids), start, e_local)
    return T, topk, int(offsets[-1]), src2dst.numpy(), dst2src.numpy()


def _gate_case(name: str, seed: int = 0):
    """``(kwargs, logits [T, E] float32, bias [E] float32 or None)`` for a case of ``op_cases/gate.py``."""
    kw = {**_GATE_DEFAULTS, **GATE_CASES[name]}
    T, E = kw.pop("T"), kw.pop("E")
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((T, E)) * 2).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.3).astype(np.float32) if kw["routing"] == "biased_grouped_topk" else None
    kw["routed_scaling_factor"] = float(kw["routed_scaling_factor"])
    return kw, logits, bias


def _gate_kwargs(fw: str, kw: dict, bias, dtype: str | None = None) -> dict:
    """``kw`` with the bias as the framework's array (float64 for the autodiff side when ``dtype`` is None)."""
    if bias is None:
        return dict(kw)
    if dtype is None:  # jax: a float64 numpy array (jnp makes it float64 under jax.enable_x64, where it is used)
        b = torch.tensor(bias, dtype=torch.float64, device=TORCH_DEVICE) if fw == "torch" else bias.astype(np.float64)
    else:
        b = arr(fw, bias, dtype)
    return {**kw, "e_score_correction_bias": b}


# --------------------------------------------------------------------------------------
# 1. each reference backward is the derivative of its reference forward (finite differences, float64)


class _RefPair(torch.autograd.Function):
    """forward: a reference forward in float64; backward: the matching reference backward (for gradcheck)."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.save_for_backward(x)
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, ct):
        (x,) = ctx.saved_tensors
        return ctx.bwd(x, ct), None, None


def _pairs(fw: str, rng):
    """name -> (x float64 numpy, forward(x), backward(x, ct)) built from the framework's references."""
    act, comb, perm, gate = (tact, tcomb, tperm, tgate) if fw == "torch" else (jact, jcomb, jperm, jgate)
    T, topk, _, src2dst, dst2src = _routing("ep-nonlocal-empty")
    s2d, d2s = arr(fw, src2dst), arr(fw, dst2src)
    h, _ = _h(rng, 3, 5)
    y = rng.standard_normal((T * topk, 6))
    w = rng.random((T, topk))
    x = rng.standard_normal((T, 6))
    kw, logits, bias = _gate_case("biased-shared-rsf-on-output")
    gkw = _gate_kwargs(fw, kw, bias)
    logits = logits[:5].astype(np.float64)
    if fw == "torch":
        # on the test device, with the routing tensors (arr): a CPU y indexed by CUDA src2dst is torch's error
        w_t = torch.tensor(w, dtype=torch.float64, device=TORCH_DEVICE)
        y_t = torch.tensor(y, dtype=torch.float64, device=TORCH_DEVICE)
    else:
        w_t, y_t = jnp.asarray(w, jnp.float64), jnp.asarray(y, jnp.float64)

    def ids_of(lg):
        return gate.select_experts_reference(lg, **gkw)[1]

    def act_pair(a):  # closures, not default arguments: jax.custom_vjp binds the signature
        return (h.astype(np.float64), lambda v: act.act_and_mul_reference(v, a, None, 128, v.dtype)[0],
                lambda v, ct: act.act_and_mul_backward_reference(v, ct, a, v.dtype))

    return {
        "act-silu": act_pair("silu"),
        "act-gelu_tanh": act_pair("gelu_tanh"),
        "combine-y": (y, lambda v: comb.combine_reference(v, s2d, w_t, 2.5, v.dtype),
                      lambda v, ct: comb.combine_backward_reference(ct, v, s2d, w_t, 2.5)[0]),
        "combine-w": (w, lambda v: comb.combine_reference(y_t, s2d, v, 2.5, v.dtype),
                      lambda v, ct: comb.combine_backward_reference(ct, y_t, s2d, v, 2.5)[1]),
        "permute": (x, lambda v: perm.permute_reference(v, d2s, topk, None, 128, None)[0],
                    lambda v, ct: perm.permute_backward_reference(ct, s2d, v.dtype)),
        "gate-biased-shared-rsf": (logits, lambda v: gate.select_experts_reference(v, **gkw)[0],
                                   lambda v, ct: gate.select_experts_backward_reference(v, ids_of(v), ct, **gkw)),
    }


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_reference_backward_passes_finite_differences(fw):
    """forward = reference forward, backward = reference backward: torch.autograd.gradcheck /
    jax.test_util.check_grads (reverse mode, float64) agree with finite differences, for every stage
    (gate: biased grouped top-k with a shared expert and rsf on the output)."""
    rng = np.random.default_rng(1)
    if fw == "torch":
        for name, (x, fwd, bwd) in _pairs(fw, rng).items():
            xt = torch.tensor(x, dtype=torch.float64, device=TORCH_DEVICE, requires_grad=True)
            assert torch.autograd.gradcheck(lambda v: _RefPair.apply(v, fwd, bwd), (xt,), eps=1e-6, atol=1e-7), name
        return
    with jax.enable_x64(True):
        for name, (x, fwd, bwd) in _pairs(fw, rng).items():
            check_grads(jax.jit(_jax_pair(fwd, bwd)), (jnp.asarray(x, jnp.float64),), order=1, modes=["rev"], eps=1e-6,
                        atol=1e-7, rtol=1e-7)


def _jax_pair(fwd, bwd):
    """A ``jax.custom_vjp`` function: forward ``fwd``, backward ``bwd`` (the jax twin of ``_RefPair``)."""
    pair = jax.custom_vjp(lambda v: fwd(v))
    pair.defvjp(lambda v: (fwd(v), v), lambda v, ct: (bwd(v, ct),))
    return pair


# --------------------------------------------------------------------------------------
# 2. the public backward ops vs float64 autodiff of the reference forward


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("M,I", [(1, 8), (7, 33)])  # M = 1; odd I
def test_act_and_mul_backward(fw, dtype, activation, M, I):
    rng = np.random.default_rng(M * 100 + I)
    h, da = _h(rng, M, I)
    hh, dd = arr(fw, h, dtype), arr(fw, da, dtype)
    ref = tact if fw == "torch" else jact
    (want,) = autodiff64(fw, lambda v: ref.act_and_mul_reference(v, activation, None, 128, v.dtype)[0],
                         [f64(hh)], f64(dd))
    assert np.abs(want).max() > 0.1  # not a trivially small gradient
    # the float64 reference backward is autodiff to float64 rounding
    assert_rel_fro(in64(fw, lambda a, b: ref.act_and_mul_backward_reference(a, b, activation, a.dtype), f64(hh), f64(dd)),
                   want, F64_REL_FRO, "float64 reference backward")
    got = run(fw, lambda a, b: MODULES[fw].act_and_mul_backward(a, b, activation=activation), hh, dd)
    assert got.dtype == hh.dtype and tuple(got.shape) == (M, 2 * I)
    assert_rel_fro(got, want, LIMIT[dtype], f"act_and_mul_backward {fw} {dtype}")
    # out_dtype
    f32 = run(fw, lambda a, b: MODULES[fw].act_and_mul_backward(a, b, activation=activation, out_dtype="float32"), hh, dd)
    assert f32.dtype == arr(fw, h).dtype


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_act_and_mul_backward_rows_stay_apart(fw):
    """Rows ``>= M`` poisoned with NaN (in h and d_a) change only those rows of d_h: the op is row-local."""
    rng = np.random.default_rng(5)
    h, da = _h(rng, 6, 16)
    op = MODULES[fw].act_and_mul_backward
    clean = to_numpy(run(fw, op, arr(fw, h), arr(fw, da)))
    h[4:], da[4:] = np.nan, np.nan
    got = to_numpy(run(fw, op, arr(fw, h), arr(fw, da)))
    assert_exact(got[:4], clean[:4], "rows < M")
    assert np.isnan(got[4:]).all()


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_combine_backward(fw, dtype, routing):
    """d_y and d_topk_weights vs float64 autodiff of the reference combine (rsf in the combine), with the
    rows ``>= M`` of y poisoned with NaN: d_y is exactly 0 there and nothing leaks into d_topk_weights."""
    T, topk, M, src2dst, _ = _routing(routing)
    rng = np.random.default_rng(len(routing))
    H, rsf = 24, 2.5
    y = rng.standard_normal((T * topk, H)).astype(np.float32)
    w = rng.random((T, topk)).astype(np.float32)
    d_out = rng.standard_normal((T, H)).astype(np.float32)
    yy, ww, dd, s2d = arr(fw, y, dtype), arr(fw, w), arr(fw, d_out, dtype), arr(fw, src2dst)
    ref = tcomb if fw == "torch" else jcomb
    want_y, want_w = autodiff64(fw, lambda a, b, s: ref.combine_reference(a, s, b, rsf, a.dtype),
                                [f64(yy), f64(ww)], f64(dd), ints=(s2d,))
    ry, rw = in64(fw, lambda a, b, c: ref.combine_backward_reference(a, b, s2d, c, rsf), f64(dd), f64(yy), f64(ww))
    assert_rel_fro(ry, want_y, F64_REL_FRO, "float64 reference d_y")
    assert_rel_fro(rw, want_w, F64_REL_FRO, "float64 reference d_topk_weights")
    y_poisoned = y.copy()
    y_poisoned[M:] = np.nan  # rows >= M: never read
    got_y, got_w = run(fw, lambda *a: MODULES[fw].combine_backward(*a, routed_scaling_factor=rsf),
                       dd, arr(fw, y_poisoned, dtype), s2d, ww)
    assert got_y.dtype == yy.dtype and to_numpy(got_w).dtype == np.float32
    assert (to_numpy(got_y)[M:] == 0).all(), "rows no slot names are 0"
    assert_rel_fro(got_y, want_y, LIMIT[dtype], "d_y")
    assert_rel_fro(got_w, want_w, GRAD_F32_REL_FRO, "d_topk_weights (float32 out)")
    assert (to_numpy(got_w)[src2dst < 0] == 0).all(), "non-local slots get d_w = 0"


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_permute_backward(fw, dtype, routing):
    """d_x vs float64 autodiff of the reference permute (through dst2src), with the rows ``>= M`` of d_xp
    poisoned with NaN (never read); tokens with no local slot get exactly 0."""
    T, topk, M, src2dst, dst2src = _routing(routing)
    rng = np.random.default_rng(len(routing) + 1)
    H = 24
    x = rng.standard_normal((T, H)).astype(np.float32)
    d_xp = rng.standard_normal((T * topk, H)).astype(np.float32)
    d_xp[M:] = 0  # the gradient of rows >= M (zeros in the forward's output) as the GEMM backward gives it
    xx, dd = arr(fw, x, dtype), arr(fw, d_xp, dtype)
    ref = tperm if fw == "torch" else jperm
    (want,) = autodiff64(fw, lambda v, d: ref.permute_reference(v, d, topk, None, 128, None)[0], [f64(xx)], f64(dd),
                         ints=(arr(fw, dst2src),))
    got_ref = in64(fw, lambda a: ref.permute_backward_reference(a, arr(fw, src2dst), a.dtype), f64(dd))
    assert_rel_fro(got_ref, want, F64_REL_FRO, "float64 reference")
    poisoned = d_xp.copy()
    poisoned[M:] = np.nan
    got = run(fw, lambda *a: MODULES[fw].permute_backward(*a, num_tokens=T), arr(fw, poisoned, dtype), arr(fw, src2dst))
    assert got.dtype == dd.dtype and tuple(got.shape) == (T, H)
    assert_rel_fro(got, want, LIMIT[dtype], "d_x")
    no_slot = (src2dst < 0).all(axis=1)
    assert (to_numpy(got)[no_slot] == 0).all()
    if routing == "ep-no-local-token":
        assert no_slot.any()


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_src2dst_from_dst2src_inverts_routing_metadata(fw):
    """The permute's VJP rebuilds src2dst from dst2src: equal to routing_metadata's, for every routing."""
    ref = tperm if fw == "torch" else jperm
    for name in ROUTINGS:
        T, topk, _, src2dst, dst2src = _routing(name)
        assert_exact(ref.src2dst_from_dst2src(arr(fw, dst2src), T, topk), src2dst, name)


#: The gate cases the JAX side runs (each costs a few XLA compiles on the CPU): every routing mode and
#: rsf placement; torch runs all of op_cases/gate.py's cases.
JAX_GATE_CASES = ("softmax-T1", "softmax-primeE-topk1-norenorm", "grouped", "biased-shared-rsf-on-output",
                  "biased-rsf-in-combine", "biased-no-renorm")


@pytest.mark.parametrize("fw,case", [("torch", c) for c in GATE_CASES] + [("jax", c) for c in JAX_GATE_CASES])
def test_select_experts_backward(fw, case):
    """The gate cases of op_cases/gate.py (softmax with and without renormalize, grouped, biased with rsf
    on the output and in the combine, fused shared experts, T=1, topk=E, DeepSeek-V3 size): d_logits vs
    float64 autodiff of the reference gate, given the ids it chose; float32 logits, and bf16 for the
    cases with a shared expert."""
    kw, logits, bias = _gate_case(case, seed=len(case))
    ref = tgate if fw == "torch" else jgate
    kw64 = _gate_kwargs(fw, kw, bias)
    W = kw["topk"] + kw["num_fused_shared_experts"]
    d_w = np.random.default_rng(7).standard_normal((logits.shape[0], W)).astype(np.float32)

    def ids_and_backward(v, g):
        ids = ref.select_experts_reference(v, **kw64)[1]
        return ids, ref.select_experts_backward_reference(v, ids, g, **kw64)

    for dtype in ("float32", "bfloat16") if kw["num_fused_shared_experts"] else ("float32",):
        lg = arr(fw, logits, dtype)
        (want,) = autodiff64(fw, lambda v: ref.select_experts_reference(v, **kw64)[0], [f64(lg)], f64(arr(fw, d_w)))
        ids, got_ref = in64(fw, ids_and_backward, f64(lg), d_w.astype(np.float64))
        assert_rel_fro(got_ref, want, F64_REL_FRO, "float64 reference")
        kw32 = _gate_kwargs(fw, kw, bias, "float32")
        got = run(fw, lambda *a: MODULES[fw].select_experts_backward(*a, **kw32), lg, arr(fw, to_numpy(ids)), arr(fw, d_w))
        assert to_numpy(got).dtype == np.float32 and got.shape == lg.shape
        assert_rel_fro(got, want, GRAD_F32_REL_FRO, f"{case} {dtype}: float32 math, float32 out")


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_select_experts_backward_shared_slots_and_bias_get_nothing(fw):
    """The shared-expert columns of d_topk_weights are ignored (changing them changes nothing), and the
    bias does not enter: d_logits is the same with another bias (the same ids)."""
    kw, logits, bias = _gate_case("biased-rsf-in-combine")
    mod = MODULES[fw]
    lg = arr(fw, logits)
    kw32, kw32_other = _gate_kwargs(fw, kw, bias, "float32"), _gate_kwargs(fw, kw, bias * 5, "float32")
    _, ids = run(fw, lambda v: mod.select_experts(v, **kw32), lg)
    d_w = np.random.default_rng(3).standard_normal(ids.shape).astype(np.float32)
    base = to_numpy(run(fw, lambda *a: mod.select_experts_backward(*a, **kw32), lg, ids, arr(fw, d_w)))
    d_w[:, kw["topk"]:] = 1e6
    other = to_numpy(run(fw, lambda *a: mod.select_experts_backward(*a, **kw32_other), lg, ids, arr(fw, d_w)))
    assert_exact(other, base, "shared columns and bias ignored")


# --------------------------------------------------------------------------------------
# 3. the differentiable forwards: torch.autograd.grad and jax.grad under jit


def _grad(fw: str, f, inputs: list, cotangents: list):
    """Gradients of ``sum(<f(*inputs)[i], cotangents[i]>)`` w.r.t. ``inputs`` (float arrays of the framework):
    ``torch.autograd.grad`` / ``jax.jit(jax.grad)``."""
    if fw == "torch":
        xs = [x.detach().requires_grad_() for x in inputs]
        outs = f(*xs)
        return list(torch.autograd.grad(outs, xs, cotangents))

    def loss(*xs):
        outs = f(*xs)
        return sum(jnp.sum(o.astype(jnp.float32) * c.astype(jnp.float32)) for o, c in zip(outs, cotangents))

    return list(jax.jit(jax.grad(loss, argnums=tuple(range(len(inputs)))))(*inputs))


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_differentiable_act_and_mul(fw, dtype):
    rng = np.random.default_rng(11)
    h, da = _h(rng, 5, 12)
    hh, dd = arr(fw, h, dtype), arr(fw, da, dtype)
    ref = tact if fw == "torch" else jact
    for activation in ("silu", "gelu_tanh"):
        (want,) = autodiff64(fw, lambda v: ref.act_and_mul_reference(v, activation, None, 128, v.dtype)[0],
                             [f64(hh)], f64(dd))
        (got,) = _grad(fw, lambda v: [MODULES[fw].act_and_mul(v, activation=activation)[0]], [hh], [dd])
        assert got.dtype == hh.dtype
        assert_rel_fro(got, want, LIMIT[dtype], f"{activation} {fw}")


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_differentiable_combine(fw):
    T, topk, M, src2dst, _ = _routing("ep-nonlocal-empty")
    rng = np.random.default_rng(12)
    y = rng.standard_normal((T * topk, 16)).astype(np.float32)
    w = rng.random((T, topk)).astype(np.float32)
    d_out = rng.standard_normal((T, 16)).astype(np.float32)
    s2d = arr(fw, src2dst)
    ref = tcomb if fw == "torch" else jcomb
    for dtype in ("float32", "bfloat16"):
        yy = arr(fw, y, dtype)
        want = autodiff64(fw, lambda a, b: ref.combine_reference(a, s2d, b, 2.5, a.dtype), [f64(yy), w], d_out)
        # bf16 y with out_dtype float32 (as the EP layer combines): the cotangent arrives in float32, d_y leaves in bf16
        got = _grad(fw, lambda a, b: [MODULES[fw].combine(a, s2d, b, routed_scaling_factor=2.5, out_dtype="float32")],
                    [yy, arr(fw, w)], [arr(fw, d_out)])
        assert got[0].dtype == yy.dtype and to_numpy(got[1]).dtype == np.float32
        assert_rel_fro(got[0], want[0], LIMIT[dtype], f"d_y {dtype}")
        assert_rel_fro(got[1], want[1], GRAD_F32_REL_FRO, f"d_topk_weights {dtype}")


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_differentiable_permute(fw):
    T, topk, M, _, dst2src = _routing("ep-nonlocal-empty")
    rng = np.random.default_rng(13)
    x = rng.standard_normal((T, 16)).astype(np.float32)
    d_xp = rng.standard_normal((T * topk, 16)).astype(np.float32)
    d2s = arr(fw, dst2src)
    ref = tperm if fw == "torch" else jperm
    (want,) = autodiff64(fw, lambda v: ref.permute_reference(v, d2s, topk, None, 128, None)[0], [x], d_xp)
    (got,) = _grad(fw, lambda v: [MODULES[fw].permute(v, d2s, topk=topk)[0]], [arr(fw, x)], [arr(fw, d_xp)])
    assert_rel_fro(got, want, GRAD_F32_REL_FRO, "d_x")


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("case", ["softmax-primeE-topk1-norenorm", "grouped", "biased-shared-rsf-on-output"])
def test_differentiable_select_experts(fw, case):
    """Gradient into router_logits through topk_weights only; the bias gets zeros, topk_ids nothing."""
    kw, logits, bias = _gate_case(case, seed=2)
    ref = tgate if fw == "torch" else jgate
    W = kw["topk"] + kw["num_fused_shared_experts"]
    d_w = np.random.default_rng(4).standard_normal((logits.shape[0], W)).astype(np.float32)
    (want,) = autodiff64(fw, lambda v: ref.select_experts_reference(v, **_gate_kwargs(fw, kw, bias))[0], [logits], d_w)
    kw32 = _gate_kwargs(fw, kw, bias, "float32")
    mod = MODULES[fw]
    (got,) = _grad(fw, lambda v: [mod.select_experts(v, **kw32)[0]], [arr(fw, logits)], [arr(fw, d_w)])
    assert_rel_fro(got, want, GRAD_F32_REL_FRO, case)
    if bias is None:
        return
    if fw == "torch":
        b = arr(fw, bias).requires_grad_()
        lg = arr(fw, logits).requires_grad_()
        w, ids = mod.select_experts(lg, **{**kw32, "e_score_correction_bias": b})
        assert not ids.requires_grad
        g_l, g_b = torch.autograd.grad(w, (lg, b), arr(fw, d_w))
        assert (g_b == 0).all()
    else:
        def weighted(b):
            return jnp.sum(mod.select_experts(arr(fw, logits), **{**kw32, "e_score_correction_bias": b})[0] * arr(fw, d_w))

        g_b = jax.jit(jax.grad(weighted))(arr(fw, bias))
        assert g_b.shape == bias.shape and (np.asarray(g_b) == 0).all()


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_no_gradient_through_fp8_quant(fw):
    """act_and_mul / permute with FP8 quant: asking for a gradient of h / x raises ValueError naming the op
    and quant (a wrong gradient is never returned); without a gradient request they run as before."""
    rng = np.random.default_rng(14)
    h, _ = _h(rng, 4, 128)
    T, topk, M, _, dst2src = _routing("T1")
    x = rng.standard_normal((T, 128)).astype(np.float32)
    mod = MODULES[fw]
    cases = [("silu_and_mul", arr(fw, h), lambda v: mod.act_and_mul(v, quant="fp8_per_token")),
             ("permute", arr(fw, x), lambda v: mod.permute(v, arr(fw, dst2src), topk=topk, quant="fp8_per_token_group"))]
    for op, v, f in cases:
        q, s = run(fw, f, v)  # no gradient asked: fine
        assert str(q.dtype).endswith("float8_e4m3fn")
        with pytest.raises(ValueError, match=f"{op}: no gradient through quant='fp8_per_token"):
            if fw == "torch":
                q, s = f(v.detach().requires_grad_())
                (q.float().sum() + s.sum()).backward()
            else:
                def loss(a):
                    q, s = f(a)
                    return jnp.sum(q.astype(jnp.float32)) + jnp.sum(s)

                jax.jit(jax.grad(loss))(v)  # raises while tracing the backward


# --------------------------------------------------------------------------------------
# 4. torch and jnp references agree (float32)


def test_torch_and_jnp_backward_references_agree():
    rng = np.random.default_rng(21)
    h, da = _h(rng, 6, 20)
    for activation in ("silu", "gelu_tanh"):
        t = tact.act_and_mul_backward_reference(to_torch(h), to_torch(da), activation, torch.float32)
        j = jact.act_and_mul_backward_reference(to_jax(h), to_jax(da), activation, jnp.float32)
        assert_rel_fro(t, j, F32_REL_FRO, activation)
    T, topk, M, src2dst, _ = _routing("ep-nonlocal-empty")
    y = rng.standard_normal((T * topk, 16)).astype(np.float32)
    w = rng.random((T, topk)).astype(np.float32)
    d_out = rng.standard_normal((T, 16)).astype(np.float32)
    ty, tw = tcomb.combine_backward_reference(to_torch(d_out), to_torch(y), to_torch(src2dst), to_torch(w), 2.5)
    jy, jw = jcomb.combine_backward_reference(to_jax(d_out), to_jax(y), to_jax(src2dst), to_jax(w), 2.5)
    assert_exact(ty, jy, "d_y (one product a slot: the same float32 rounding)")
    assert_rel_fro(tw, jw, F32_REL_FRO, "d_topk_weights")
    d_xp = rng.standard_normal((T * topk, 16)).astype(np.float32)
    assert_rel_fro(tperm.permute_backward_reference(to_torch(d_xp), to_torch(src2dst), torch.float32),
                   jperm.permute_backward_reference(to_jax(d_xp), to_jax(src2dst), jnp.float32), F32_REL_FRO, "d_x")
    for case in JAX_GATE_CASES:
        kw, logits, bias = _gate_case(case)
        tkw, jkw = _gate_kwargs("torch", kw, bias, "float32"), _gate_kwargs("jax", kw, bias, "float32")
        _, ids = tgate.select_experts_reference(to_torch(logits), **tkw)
        d_w = rng.standard_normal(ids.shape).astype(np.float32)
        t = tgate.select_experts_backward_reference(to_torch(logits), ids, to_torch(d_w), **tkw)
        j = run("jax", lambda *a: jgate.select_experts_backward_reference(*a, **jkw), to_jax(logits),
                to_jax(to_numpy(ids)), to_jax(d_w))
        assert_rel_fro(t, j, F32_REL_FRO, case)


# --------------------------------------------------------------------------------------
# 5. host validation (same words in both frameworks)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_backward_validation(fw):
    mod = MODULES[fw]
    h = arr(fw, np.ones((4, 8), np.float32))
    with pytest.raises(ValueError, match=r"act_and_mul_backward: d_a must be \[M, I\] = \(4, 4\)"):
        mod.act_and_mul_backward(h, arr(fw, np.ones((4, 8), np.float32)))
    with pytest.raises(TypeError, match="act_and_mul_backward: d_a must have dtype"):
        mod.act_and_mul_backward(h, arr(fw, np.ones((4, 4), np.int32)))
    s2d = arr(fw, np.array([[0, -1], [1, 2]], np.int32))
    y = arr(fw, np.ones((4, 8), np.float32))
    with pytest.raises(ValueError, match=r"combine_backward: d_out must be \[T, H\] = \(2, 8\)"):
        mod.combine_backward(arr(fw, np.ones((3, 8), np.float32)), y, s2d, arr(fw, np.ones((2, 2), np.float32)))
    with pytest.raises(TypeError, match="combine_backward: topk_weights must have dtype float32"):
        mod.combine_backward(arr(fw, np.ones((2, 8), np.float32)), y, s2d, arr(fw, np.ones((2, 2), np.float32), "bfloat16"))
    with pytest.raises(ValueError, match=r"permute_backward: d_xp must be \[M_cap, H\] with M_cap == T \* topk \(=4\)"):
        mod.permute_backward(arr(fw, np.ones((3, 8), np.float32)), s2d)
    with pytest.raises(ValueError, match=r"permute_backward: num_tokens must be None or T = src2dst.shape\[0\] \(=2\)"):
        mod.permute_backward(y, s2d, num_tokens=3)
    lg = arr(fw, np.ones((3, 8), np.float32))
    with pytest.raises(ValueError, match=r"select_experts_backward: topk_ids must be \[T, topk \+ num_fused_shared"):
        mod.select_experts_backward(lg, arr(fw, np.zeros((3, 2), np.int32)), arr(fw, np.ones((3, 2), np.float32)), topk=3)
    with pytest.raises(TypeError, match="select_experts_backward: d_topk_weights must have dtype float32"):
        mod.select_experts_backward(lg, arr(fw, np.zeros((3, 2), np.int32)),
                                    arr(fw, np.ones((3, 2), np.float32), "bfloat16"), topk=2)
    with pytest.raises(ValueError, match="select_experts_backward: e_score_correction_bias must be given"):
        mod.select_experts_backward(lg, arr(fw, np.zeros((3, 2), np.int32)), arr(fw, np.ones((3, 2), np.float32)), topk=2,
                                    routing="biased_grouped_topk", num_expert_group=2, topk_group=1)
    with pytest.raises(ValueError, match="combine_backward: implementation must be one of"):
        mod.combine_backward(arr(fw, np.ones((2, 8), np.float32)), y, s2d, arr(fw, np.ones((2, 2), np.float32)),
                             implementation="cuda")
