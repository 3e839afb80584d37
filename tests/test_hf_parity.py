"""HF parity: our MoE layer equals HF transformers' MoE blocks, an independent implementation.

The layers under test are ``moe_torch.moe_forward`` and ``moe_pallas.moe_forward`` (and their
``select_experts``). The references are transformers 5.24's

- ``MixtralSparseMoeBlock``  (softmax top-k, always renormalised),
- ``Qwen3MoeSparseMoeBlock`` (softmax top-k, ``norm_topk_prob`` on or off),
- ``DeepseekV3MoE``          (sigmoid + ``e_score_correction_bias``, grouped top-k
  "noaux_tc", ``routed_scaling_factor``, one shared expert),

built from small configs, re-initialised with seeded ``N(0, 1/fan_in)`` weights (so that every
output is O(1), never zero; HF's own init would be ``N(0, 0.02)`` or zeros for the router),
and their weights copied into ours.

transformers 5.24 parameter layout (read from ``modeling_{mixtral,qwen3_moe,deepseek_v3}.py``):

- ``block.gate.weight``             ``[E, H]``: router logits ``= F.linear(x, weight)``.
  Mixtral / Qwen3 compute it in the input dtype (bf16 logits for a bf16 model); DeepSeek-V3
  casts both operands to float32, and keeps ``gate.weight`` and ``e_score_correction_bias``
  (a buffer ``[E]``) in float32 (``_keep_in_fp32_modules_strict``).
- ``block.experts.gate_up_proj``    ``[E, 2*I, H]``; the forward does
  ``gate, up = linear(x, gate_up_proj[e]).chunk(2, -1)``: rows ``:I`` are gate, ``I:`` up,
  which is exactly our ``w13``.
- ``block.experts.down_proj``       ``[E, H, I]``, exactly our ``w2``.
- DeepSeek-V3 ``block.shared_experts``: a ``DeepseekV3MLP`` with ``gate_proj``/``up_proj``
  ``[I*n_shared, H]`` and ``down_proj`` ``[H, I*n_shared]`` (``nn.Linear``), added unweighted.
  Ours runs it as the fused shared expert id ``E`` (``num_fused_shared_experts=1``):
  ``w13[E] = cat(gate_proj, up_proj)``, ``w2[E] = down_proj``, gate weight 1 after rsf.
- The experts classes are ``@use_experts_implementation``-decorated: their forward dispatches
  on ``config._experts_implementation``; ``None`` (standalone block) falls back to the
  original per-expert loop with a warning, so the tests set ``"eager"`` explicitly.

Tolerances (``tests/tolerances.py``, CONTRACT.md section 7), errors measured in float64 on the
host as ``||out - ref|| / ||ref||``:

- float32: ``F32_REL_FRO = 1e-5``. Both sides do the same float32 arithmetic (same router
  logits, same GEMM shapes) and differ only in summation order (BLAS blocking, and ours sums a
  token's expert outputs in slot order where HF ``index_add_``s them expert by expert), so
  the error is a few float32 ulps of accumulated rounding: measured 6e-8..4e-7 here (the
  float64 reference is as far from HF's own float32 output), >= 25x under the limit, while any
  real bug (a wrong expert, weight, rsf or half of ``w13``) is O(1e-1).
- bfloat16: ``BF16_REL_FRO = 1e-2`` against a float64 reference, which is HF's own expert
  code run in float64 on the same bf16 inputs/weights with HF's own (bf16-model) routing
  decisions; HF's bf16 output must meet it too, and ours must be within it of HF's bf16 output
  (measured: ours vs float64 3e-3..6e-3, HF vs float64 4e-3..5.4e-3, ours vs HF <= 5.7e-3).
- gate weights: float32 rel. error ``GATE_WEIGHT_RTOL = 1e-6`` where HF keeps them in float32
  (Qwen3 rounds them to the logits' dtype: there, bf16 rounding ``2**-8``).
- selected ids: exactly equal as sets per token (HF DeepSeek uses ``topk(sorted=False)``).
  Routing near an exact tie at the top-k boundary would be ambiguous (``torch.topk`` does not
  promise our lower-index rule), so each case asserts its seed has no such tie.

Known contract difference: the masking of dropped groups in DeepSeek-V3's router.
Our contract masks the experts of dropped groups with ``-inf``. DeepSeek's original remote
code and transformers before huggingface/transformers#45441 (issue #45440) masked them with
``0.0`` (``scores_for_choice.masked_fill(~score_mask.bool(), 0.0)``). The two agree while all
biased selection scores ``c = sigmoid(logit) + bias`` are >= 0; when a kept group holds
negative scores, the 0.0 mask ranks any expert of a *dropped* group (0.0) above them and
may select it, the -inf mask never does. transformers 5.24 (the pinned version) already masks
with ``-inf``, i.e. it agrees with our contract in every regime. Hence:

(a) the parity grid draws ``bias ~ U[0, 0.1]`` (all ``c >= 0``: both conventions agree);
(b) ``test_deepseek_group_mask_negative_score_crafted`` builds a token whose 4th-best
    kept-group score is negative and asserts: ours and HF 5.24 select the kept-group expert, while the 0.0-mask rule
    (reproduced below as ``_router_ids_zero_mask``, HF 5.24's router with the old fill value)
    selects an expert of a dropped group instead, exactly as predicted; a random layer-level
    case with negative biases (``test_deepseek_layer_parity_with_negative_biases``) shows full
    parity with HF 5.24 and that the 0.0 rule would differ.
    Should the pinned transformers ever go back to a 0.0 mask, these tests fail and say so.

Negative controls (the comparisons can fail): a wrong rsf, swapped gate/up halves and a
dropped shared expert each give an O(1e-1) error.
"""

from __future__ import annotations

import copy
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import moe_pallas
import moe_torch
from moe_contract import MoEConfig
from tolerances import BF16_REL_FRO, F32_REL_FRO, GATE_WEIGHT_RTOL, rel_fro

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter  # noqa: E402
from transformers.models.mixtral.configuration_mixtral import MixtralConfig  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

DTYPES = {"float32": (torch.float32, jnp.float32), "bfloat16": (torch.bfloat16, jnp.bfloat16)}
BACKENDS = ("torch", "jax")
#: A bug (wrong expert, weight, rsf) moves the output by O(1e-1); the negative controls need this much.
BROKEN_MIN_ERR = 5e-2


# ----------------------------------------------------------------------------------------------
# Building an HF block and its twin in our layout
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """An HF block (float32 master weights) and the same layer in our terms."""

    name: str
    hf: torch.nn.Module
    cfg: MoEConfig
    w13: torch.Tensor  # [E + S, 2I, H] float32
    w2: torch.Tensor  # [E + S, H, I] float32
    bias: torch.Tensor | None  # [E] float32 (DeepSeek only)


def _reinit_(module: torch.nn.Module, seed: int) -> None:
    """Every parameter ~ N(0, 1/fan_in), fan_in = the last dim ([.., out, in] layout), seeded."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) / np.sqrt(p.shape[-1]))


def _eager(config):
    config._experts_implementation = "eager"  # the original per-expert loop (see module docstring)
    return config


def make_mixtral(seed: int = 0) -> Case:
    H, I, E, K = 64, 32, 8, 2
    hf_cfg = _eager(MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
                                  hidden_act="silu", router_jitter_noise=0.0))
    hf = MixtralSparseMoeBlock(hf_cfg).eval()
    _reinit_(hf, seed)
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, topk=K, routing="softmax_topk", renormalize=True)
    return Case("mixtral", hf, cfg, hf.experts.gate_up_proj.detach().clone(), hf.experts.down_proj.detach().clone(), None)


def make_qwen3(seed: int = 1, norm_topk_prob: bool = True) -> Case:
    H, I, E, K = 96, 48, 16, 4
    hf_cfg = _eager(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                                   norm_topk_prob=norm_topk_prob, hidden_act="silu"))
    hf = Qwen3MoeSparseMoeBlock(hf_cfg).eval()
    _reinit_(hf, seed)
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, topk=K, routing="softmax_topk",
                    renormalize=norm_topk_prob)
    return Case(f"qwen3-norm{int(norm_topk_prob)}", hf, cfg,
                hf.experts.gate_up_proj.detach().clone(), hf.experts.down_proj.detach().clone(), None)


DSV3 = dict(H=128, I=64, E=16, K=4, n_group=4, topk_group=2, rsf=2.5)


def make_deepseek(seed: int = 2, *, rsf_on_output: bool = True, bias_range=(0.0, 0.1), rsf: float = DSV3["rsf"]) -> Case:
    H, I, E, K = DSV3["H"], DSV3["I"], DSV3["E"], DSV3["K"]
    hf_cfg = _eager(DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                                     n_group=DSV3["n_group"], topk_group=DSV3["topk_group"], n_shared_experts=1,
                                     routed_scaling_factor=rsf, norm_topk_prob=True, hidden_act="silu"))
    hf = DeepseekV3MoE(hf_cfg).eval()
    _reinit_(hf, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    lo, hi = bias_range
    with torch.no_grad():
        hf.gate.e_score_correction_bias.copy_(lo + (hi - lo) * torch.rand(E, generator=g))
    sh = hf.shared_experts
    w13 = torch.cat([hf.experts.gate_up_proj.detach(), torch.cat([sh.gate_proj.weight, sh.up_proj.weight], 0)[None]], 0)
    w2 = torch.cat([hf.experts.down_proj.detach(), sh.down_proj.weight.detach()[None]], 0)
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, topk=K, routing="biased_grouped_topk",
                    renormalize=True, num_expert_group=DSV3["n_group"], topk_group=DSV3["topk_group"],
                    routed_scaling_factor=DSV3["rsf"], apply_routed_scaling_factor_on_output=rsf_on_output,
                    num_fused_shared_experts=1)
    return Case(f"deepseek-rsf_on_output{int(rsf_on_output)}", hf, cfg, w13.detach().clone(), w2.detach().clone(),
                hf.gate.e_score_correction_bias.detach().clone())


def _hf_in_dtype(case: Case, dtype: torch.dtype) -> torch.nn.Module:
    """The HF block as a ``dtype`` model is loaded: all weights in ``dtype``, except DeepSeek-V3's
    router (``gate.weight``, ``e_score_correction_bias``), which HF keeps in float32."""
    hf = copy.deepcopy(case.hf).to(dtype)
    if isinstance(hf, DeepseekV3MoE):
        hf.gate.to(torch.float32)
        with torch.no_grad():
            hf.gate.weight.copy_(case.hf.gate.weight)
            hf.gate.e_score_correction_bias.copy_(case.hf.gate.e_score_correction_bias)
    return hf


def _inputs(case: Case, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randn(1, T, case.cfg.hidden_size, generator=g)  # [batch=1, seq=T, H], HF's shape


# ----------------------------------------------------------------------------------------------
# Running both sides
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class HFRun:
    out: torch.Tensor  # [T, H] in the model dtype
    logits: torch.Tensor  # [T, E] as HF's router computed them
    ids: torch.Tensor  # [T, topk] HF's selection (int64)
    weights: torch.Tensor  # [T, topk] HF's routing weights (rsf included for DeepSeek)
    ref64: torch.Tensor  # [T, H] float64: HF's expert code in float64 on HF's routing


def run_hf(case: Case, x3: torch.Tensor, dtype: torch.dtype) -> HFRun:
    hf = _hf_in_dtype(case, dtype)
    x3 = x3.to(dtype)
    x2 = x3.reshape(-1, x3.shape[-1])
    with torch.no_grad():
        out = hf(x3).reshape(x2.shape)
        logits, weights, ids = hf.gate(x2)
        experts64 = copy.deepcopy(hf.experts).double()
        ref64 = experts64(x2.double(), ids, weights.double())
        if isinstance(hf, DeepseekV3MoE):
            ref64 = ref64 + copy.deepcopy(hf.shared_experts).double()(x2.double())
    return HFRun(out, logits, ids, weights, ref64)


def run_ours(backend: str, case: Case, x2: torch.Tensor, logits: torch.Tensor, dtype_name: str, cfg: MoEConfig | None = None,
             w13: torch.Tensor | None = None):
    """``(out, topk_weights, topk_ids)`` of our layer, as float64 / float32 / int64 numpy."""
    cfg = case.cfg if cfg is None else cfg
    w13 = case.w13 if w13 is None else w13
    tdt, jdt = DTYPES[dtype_name]
    gate_kw = dict(topk=cfg.topk, routing=cfg.routing, renormalize=cfg.renormalize, num_expert_group=cfg.num_expert_group,
                   topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
                   apply_routed_scaling_factor_on_output=cfg.apply_routed_scaling_factor_on_output,
                   num_fused_shared_experts=cfg.num_fused_shared_experts)
    if backend == "torch":
        x, lg = x2.to(tdt), logits  # logits exactly as HF computed them (bf16 for Mixtral/Qwen3 bf16)
        bias = case.bias
        out = moe_torch.moe_forward(x, lg, w13.to(tdt), case.w2.to(tdt), cfg, e_score_correction_bias=bias)
        w, ids = moe_torch.select_experts(lg, e_score_correction_bias=bias, **gate_kw)
        return out.double().numpy(), w.numpy(), ids.long().numpy()
    # jax: arrays built from the same numbers via numpy (bf16 values round-trip through float32 exactly)
    np32 = lambda t: t.detach().float().numpy()  # noqa: E731
    ldt = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}[logits.dtype]
    x = jnp.asarray(np32(x2.to(tdt)), dtype=jdt)
    lg = jnp.asarray(np32(logits), dtype=ldt)
    bias = None if case.bias is None else jnp.asarray(np32(case.bias), dtype=jnp.float32)
    out = moe_pallas.moe_forward(x, lg, jnp.asarray(np32(w13.to(tdt)), dtype=jdt), jnp.asarray(np32(case.w2.to(tdt)), dtype=jdt),
                                 cfg, e_score_correction_bias=bias)
    w, ids = moe_pallas.select_experts(lg, e_score_correction_bias=bias, **gate_kw)
    return np.asarray(out).astype(np.float64), np.asarray(w), np.asarray(ids).astype(np.int64)


def _by_id(ids: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's slots sorted by expert id (to compare selections as sets, weights by expert)."""
    order = np.argsort(ids, axis=1, kind="stable")
    return np.take_along_axis(ids, order, 1), np.take_along_axis(w, order, 1)


def _assert_no_boundary_tie(case: Case, logits: torch.Tensor) -> None:
    """The seed's softmax routing has no exact tie at the top-k boundary (else ids are ambiguous)."""
    if case.cfg.routing != "softmax_topk":
        return
    p = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True).values
    k = case.cfg.topk
    assert bool((p[:, k - 1] > p[:, k]).all()), f"{case.name}: a top-k boundary tie; pick another seed"


# ----------------------------------------------------------------------------------------------
# (a) Parity grid
# ----------------------------------------------------------------------------------------------

MAKERS = {
    "mixtral": make_mixtral,
    "qwen3-norm1": lambda: make_qwen3(norm_topk_prob=True),
    "qwen3-norm0": lambda: make_qwen3(norm_topk_prob=False),
    "deepseek-rsf_on_output1": lambda: make_deepseek(rsf_on_output=True),
    "deepseek-rsf_on_output0": lambda: make_deepseek(rsf_on_output=False),
}
_CASES: dict[str, Case] = {}


def get_case(name: str) -> Case:
    if name not in _CASES:
        _CASES[name] = MAKERS[name]()
    return _CASES[name]


_HF_RUNS: dict[tuple, HFRun] = {}


def get_hf_run(name: str, T: int, dtype_name: str) -> tuple[Case, torch.Tensor, HFRun]:
    case = get_case(name)
    x3 = _inputs(case, T, seed=T)
    key = (name, T, dtype_name)
    if key not in _HF_RUNS:
        _HF_RUNS[key] = run_hf(case, x3, DTYPES[dtype_name][0])
    return case, x3, _HF_RUNS[key]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [1, 13])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_layer_matches_hf(name, dtype_name, T, backend):
    case, x3, hf = get_hf_run(name, T, dtype_name)
    _assert_no_boundary_tie(case, hf.logits)
    x2 = x3.reshape(T, -1)
    out, w, ids = run_ours(backend, case, x2, hf.logits, dtype_name)
    cfg, E, K = case.cfg, case.cfg.num_experts, case.cfg.topk
    assert np.isfinite(out).all() and np.abs(out).max() > 0.1, "degenerate output: the test would prove nothing"

    # Selection: the same expert set per token; the shared expert is the fused extra slot.
    hf_ids, hf_w = _by_id(hf.ids.numpy(), hf.weights.float().numpy())
    our_ids, our_w = _by_id(ids[:, :K], w[:, :K])
    np.testing.assert_array_equal(our_ids, hf_ids, err_msg=f"{case.name}: selected experts differ from HF")
    if cfg.num_fused_shared_experts:
        np.testing.assert_array_equal(ids[:, K:], np.full((T, 1), E))

    # Gate weights: HF folds rsf into them (DeepSeek); ours does when rsf is applied on the output.
    scale = 1.0 if cfg.apply_routed_scaling_factor_on_output else cfg.routed_scaling_factor
    rtol = GATE_WEIGHT_RTOL if hf.weights.dtype == torch.float32 else 2.0**-8
    np.testing.assert_allclose(our_w.astype(np.float64) * scale, hf_w, rtol=rtol, atol=0, err_msg=f"{case.name}: gate weights")
    if cfg.num_fused_shared_experts:
        np.testing.assert_allclose(w[:, K:].astype(np.float64) * scale, 1.0, rtol=GATE_WEIGHT_RTOL)

    # The layer output.
    hf_out = hf.out.double().numpy()
    ref64 = hf.ref64.numpy()
    if dtype_name == "float32":
        err = rel_fro(out, hf_out)
        assert err <= F32_REL_FRO, f"{case.name} {backend} T={T} f32: rel err vs HF {err:.2e} > {F32_REL_FRO:.0e}"
    else:
        err_hf = rel_fro(hf_out, ref64)
        assert err_hf <= BF16_REL_FRO, f"{case.name} T={T}: HF's own bf16 error {err_hf:.2e} (tolerance unjustified)"
        for what, ref in (("float64 reference", ref64), ("HF bf16 output", hf_out)):
            err = rel_fro(out, ref)
            assert err <= BF16_REL_FRO, f"{case.name} {backend} T={T} bf16: rel err vs {what} {err:.2e} > {BF16_REL_FRO:.0e}"


# ----------------------------------------------------------------------------------------------
# Negative controls: the comparison detects real bugs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_controls_break_parity(backend):
    T = 13
    # (1) rsf applied with the wrong value (1.0 instead of HF's 2.5): the routed part is off by 2.5x.
    case, x3, hf = get_hf_run("deepseek-rsf_on_output0", T, "float32")
    x2 = x3.reshape(T, -1)
    hf_out = hf.out.double().numpy()
    ok, _, _ = run_ours(backend, case, x2, hf.logits, "float32")
    assert rel_fro(ok, hf_out) <= F32_REL_FRO
    wrong = case.cfg.replace(routed_scaling_factor=1.0)
    bad, _, _ = run_ours(backend, case, x2, hf.logits, "float32", cfg=wrong)
    assert rel_fro(bad, hf_out) > BROKEN_MIN_ERR, "a wrong rsf went unnoticed"
    # ... and applied on both the gate and the combine (twice), also caught.
    twice = case.cfg.replace(routed_scaling_factor=case.cfg.routed_scaling_factor**2, apply_routed_scaling_factor_on_output=False)
    bad, _, _ = run_ours(backend, case, x2, hf.logits, "float32", cfg=twice)
    assert rel_fro(bad, hf_out) > BROKEN_MIN_ERR, "rsf applied twice went unnoticed"
    # (2) the shared expert left out (a zero shared slot).
    w13 = case.w13.clone()
    w13[case.cfg.num_experts] = 0
    bad, _, _ = run_ours(backend, case, x2, hf.logits, "float32", w13=w13)
    assert rel_fro(bad, hf_out) > BROKEN_MIN_ERR, "a missing shared expert went unnoticed"
    # (3) gate and up halves swapped: silu(up) * gate != silu(gate) * up.
    case, x3, hf = get_hf_run("mixtral", T, "float32")
    I = case.cfg.intermediate_size
    swapped = torch.cat([case.w13[:, I:], case.w13[:, :I]], dim=1)
    bad, _, _ = run_ours(backend, case, x3.reshape(T, -1), hf.logits, "float32", w13=swapped)
    assert rel_fro(bad, hf.out.double().numpy()) > BROKEN_MIN_ERR, "swapped gate/up halves went unnoticed"


# ----------------------------------------------------------------------------------------------
# (b) The dropped-group mask: -inf (ours, HF 5.24) vs 0.0 (DeepSeek remote code, older HF)
# ----------------------------------------------------------------------------------------------


def _router_ids_zero_mask(router: DeepseekV3TopkRouter, x2: torch.Tensor) -> torch.Tensor:
    """HF 5.24's ``DeepseekV3TopkRouter.forward`` selection, verbatim, but with the pre-#45441
    fill value ``0.0`` for the experts of dropped groups."""
    logits = torch.nn.functional.linear(x2.float(), router.weight.float())
    s = logits.sigmoid() + router.e_score_correction_bias
    n, per = router.num_group, router.num_experts // router.num_group
    group_scores = s.view(-1, n, per).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n, per).reshape(-1, router.num_experts)
    s = s.masked_fill(~score_mask.bool(), 0.0)
    return torch.topk(s, k=router.top_k, dim=-1, sorted=False)[1]


def test_deepseek_group_mask_negative_score_crafted():
    """One token, E=16 in 4 groups of 4, topk_group=2, topk=4. Target selection scores c:

        group 0 (ids  0.. 3): -0.90 -1.00 -1.10 -1.20   group score -1.90  dropped
        group 1 (ids  4.. 7): +0.90 +0.80 -0.50 -0.60   group score +1.70  kept
        group 2 (ids  8..11): -0.95 -1.05 -1.15 -1.25   group score -2.00  dropped
        group 3 (ids 12..15): +0.70 -0.20 -0.30 -0.40   group score +0.50  kept

    Only 3 kept-group experts have c > 0, so the 4th pick is where the conventions part:
    -inf mask -> expert 13 (c = -0.20, the best remaining kept-group score);
     0.0 mask -> one of the dropped groups' experts {0..3, 8..11} (masked to 0.0 > -0.20).
    """
    E, K, n_group, topk_group = 16, 4, 4, 2
    c = torch.tensor([-0.90, -1.00, -1.10, -1.20, 0.90, 0.80, -0.50, -0.60,
                      -0.95, -1.05, -1.15, -1.25, 0.70, -0.20, -0.30, -0.40])
    logits = torch.linspace(-1.5, 1.5, E)[None, :]  # distinct, so that s differ
    bias = (c - logits.sigmoid()[0]).float()
    assert ((logits.sigmoid() + bias) < 0).any(), "the case needs a negative biased score"

    kept = {4, 5, 6, 7, 12, 13, 14, 15}
    dropped = set(range(E)) - kept
    expected_ours = [4, 5, 12, 13]  # descending c

    # HF's router, with H = E and weight = identity, so that its logits are exactly `logits`.
    hf_cfg = DeepseekV3Config(hidden_size=E, n_routed_experts=E, num_experts_per_tok=K, n_group=n_group,
                              topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(hf_cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        router.e_score_correction_bias.copy_(bias)
        hf_logits, hf_w, hf_ids = router(logits)
    torch.testing.assert_close(hf_logits, logits, rtol=0, atol=0)

    # Ours: never an expert of a dropped group.
    gate_kw = dict(topk=K, routing="biased_grouped_topk", renormalize=True, num_expert_group=n_group,
                   topk_group=topk_group, routed_scaling_factor=2.5)
    _, ids_t = moe_torch.select_experts(logits, e_score_correction_bias=bias, **gate_kw)
    _, ids_j = moe_pallas.select_experts(jnp.asarray(logits.numpy()), e_score_correction_bias=jnp.asarray(bias.numpy()), **gate_kw)
    assert ids_t.tolist() == [expected_ours]
    assert np.asarray(ids_j).tolist() == [expected_ours]

    # The 0.0-mask rule: 13 is displaced by an expert of a dropped group, exactly as predicted.
    zero_ids = set(_router_ids_zero_mask(router, logits)[0].tolist())
    assert {4, 5, 12} <= zero_ids and 13 not in zero_ids
    assert len(zero_ids & dropped) == 1, f"the 0.0 mask should pick one dropped-group expert; got {sorted(zero_ids)}"

    # HF 5.24 masks with -inf: it agrees with ours (a 0.0-mask transformers would fail here).
    assert sorted(hf_ids[0].tolist()) == sorted(expected_ours), (
        f"HF's DeepseekV3TopkRouter picked {sorted(hf_ids[0].tolist())}: this transformers masks dropped groups "
        f"with 0.0 (pre huggingface/transformers#45441), not -inf as CONTRACT.md and transformers 5.24 do")


@pytest.mark.parametrize("backend", BACKENDS)
def test_deepseek_layer_parity_with_negative_biases(backend):
    """Biases ~ U[-1, -0.4]: many c < 0. HF 5.24 (-inf mask) still equals ours at the layer level,
    while the 0.0-mask rule would route some tokens into a dropped group."""
    T = 13
    case = make_deepseek(seed=3, rsf_on_output=True, bias_range=(-1.0, -0.4))
    x3 = _inputs(case, T, seed=T)
    hf = run_hf(case, x3, torch.float32)
    x2 = x3.reshape(T, -1)
    K, E, per = case.cfg.topk, case.cfg.num_experts, case.cfg.num_experts // case.cfg.num_expert_group

    c = hf.logits.sigmoid() + case.bias
    assert (c < 0).any()
    zero_ids = _router_ids_zero_mask(case.hf.gate, x2).sort(dim=1).values
    hf_ids = hf.ids.sort(dim=1).values
    differ = (zero_ids != hf_ids).any(dim=1)
    assert differ.any(), "the seed should produce a token where the 0.0 mask changes the selection"
    # Where they differ, the 0.0 rule picked an expert outside the groups ours/HF kept.
    for t in torch.nonzero(differ)[:, 0].tolist():
        kept_groups = set((hf_ids[t] // per).tolist())
        assert not set((zero_ids[t] // per).tolist()) <= kept_groups

    out, w, ids = run_ours(backend, case, x2, hf.logits, "float32")
    np.testing.assert_array_equal(np.sort(ids[:, :K], axis=1), hf_ids.numpy())
    assert (ids[:, K:] == E).all()
    err = rel_fro(out, hf.out.double().numpy())
    assert err <= F32_REL_FRO, f"negative-bias parity: rel err {err:.2e}"
