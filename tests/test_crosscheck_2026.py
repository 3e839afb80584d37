"""`epmoe check` on the 2026 families: every new preset, made small by the CLI's layer options, passes
stage by stage in the four implementations, forward and backward; the stages where Llama 4's router weight on the
expert input (``scaled_slot_rows``) and Qwen3-Next's shared-expert gate (``slot_weights``) enter, and their backward
(``scaled_slot_rows_bwd``, ``slot_weights_bwd``: ``d_topk_weights``, ``d_shared_expert_gate_logits``), gpt-oss's
expert biases (the GEMMs' ``bias=``, ``gemm1_dbias`` / ``gemm2_dbias``) and 4-bit weights (``w_format=``, the
``weights`` stage) are judged by the contract; a planted wrong stage is caught at its own stage; the EP summary sums
the shared gate's gradient and slices the biases'; what the cross-check cannot take is refused in one line (exit 2)."""

from __future__ import annotations

import json

import pytest

import moe_torch.layer as torch_layer
import moe_torch.ops.grouped_gemm.api as torch_gemm_api
import moe_torch.slot_weights as torch_slots
from common import DEVICE
from interop import crosscheck as cc
from interop.cli import main
from moe_contract import get_preset

#: The CLI's layer options that make a preset small enough for the interpreters (one shape for every preset, so the
#: kernels compiled for one serve the next where topk agrees); H and I multiples of 32 (the 4-bit groups).
SMALL = ("--hidden-size", "32", "--intermediate-size", "32", "--num-experts", "16", "--tokens", "2")
SMALL_FIELDS = dict(hidden_size=32, intermediate_size=32, num_experts=16)
FOUR_PAIRS = {("pallas_triton", "jnp-reference"), ("triton", "torch-reference"), ("torch-reference", "jnp-reference"),
              ("triton", "pallas_triton")}
REFS = ("jnp-reference", "torch-reference")
ALL4 = None  # the CLI's default: the four implementations
#: Every new preset, with the quant mode and implementations its check runs. The new kernel paths run once with the
#: four implementations (interpreted kernels: about 12 s each on 2 cores), the other presets with the references
#: (jnp and torch, about 4 s; the suite's time): Llama 4 (scout: the sigmoid top-k gate kernel, the permute of the
#: scaled rows; maverick is the same layer at these sizes, so scout's check is maverick's:
#: test_llama4_maverick_small_check_is_llama4_scouts) and gpt-oss-120b (the bias GEMMs, dbias and the clamped
#: SwiGLU, with MXFP4 weights, the format it ships); Qwen3-Next's shared gate (no kernel of its own: a framework op
#: before the combine), gpt-oss-20b in bf16, GLM-4.5-Air (DeepSeek-V3's routing with one group) and Kimi K2 with INT4
#: weights (K2-Thinking's format) on the references. The kernels have their own tests (test_layer_2026.py with every
#: backend, test_grouped_gemm_bias.py, the 4-bit GEMM tests).
NEW_PRESETS = (("llama4-scout", "none", ALL4), ("qwen3-next-80b-a3b", "none", REFS),
               ("glm-4.5-air", "none", REFS), ("kimi-k2", "int4", REFS), ("gpt-oss-20b", "none", REFS),
               ("gpt-oss-120b", "mxfp4", ALL4))


def _check(args, tmp_path, capsys):
    path = tmp_path / "check.json"
    rc = main(["check", *args, "--json", str(path)])
    out = capsys.readouterr()
    return rc, out.out, out.err, (json.loads(path.read_text()) if path.exists() else None)


def _expected_stages(preset: str, quant: str) -> set[str]:
    config = get_preset(preset).config()
    stages = (set(cc.STAGES) | set(cc.BACKWARD_STAGE_NAMES)) - {"weights"} - set(cc.OPTIONAL_STAGES)
    if config.apply_router_weight_on_input or config.shared_expert_gate:
        stages |= {"slot_weights", "slot_weights_bwd"}
    if config.apply_router_weight_on_input:
        stages |= {"scaled_slot_rows", "scaled_slot_rows_bwd"}
    if config.expert_bias:
        stages |= set(cc.BIAS_STAGES)
    if quant != "none":  # the 4-bit codes: made by the weights stage, frozen (no wgrad stages)
        stages = stages - {"gemm1_wgrad", "gemm2_wgrad"} | {"weights"}
    return stages


@pytest.mark.parametrize("preset,quant,implementations", NEW_PRESETS)
def test_new_preset_small_check_passes_forward_and_backward(preset, quant, implementations, tmp_path, capsys):
    """`epmoe check --preset P --backward` with the layer options (H=32, I=32, E=16, T=2): every stage of that
    layer, forward and backward, every pair of the implementations (the four's four pairs; the weights stage: the
    references), within the contract (exit 0)."""
    which = [] if implementations is ALL4 else ["--implementations", ",".join(implementations)]
    rc, out, err, data = _check(["--preset", preset, *SMALL, "--quant", quant, "--seed", "1", "--backward", *which],
                                tmp_path, capsys)
    assert rc == 0, out + err
    assert f"preset {preset}: H=32 I=32 E=16" in out and "within the contract" in out
    assert data["ok"] and not data["skipped"] and not data["errors"]
    comps = data["comparisons"]
    stages = {c["stage"] for c in comps}
    assert stages == _expected_stages(preset, quant)
    pairs = FOUR_PAIRS if implementations is ALL4 else {REFS[::-1]}
    for stage in stages - {"weights"}:
        assert pairs <= {(c["a"], c["b"]) for c in comps if c["stage"] == stage}, stage
    rules = {(c["stage"], c["output"]): c["rule"] for c in comps if (c["a"], c["b"]) == ("torch-reference", "jnp-reference")}
    config = get_preset(preset).config()
    if config.apply_router_weight_on_input:  # Llama 4: section 2's scaled rows, bit-identical (one rounding)
        assert rules[("scaled_slot_rows", "scaled_rows")] == "bit-identical"
        assert rules[("slot_weights", "input_scale")].startswith("rel <= 1e-06")  # the gate weights' rule
        assert rules[("permute_bwd", "d_rows")].startswith("rel <= 1e-05")
        assert rules[("scaled_slot_rows_bwd", "d_input_scale")].startswith("rel <= 1e-05")
        assert ("combine_bwd", "d_combine_weights") in rules and ("slot_weights_bwd", "d_topk_weights") in rules
    if config.shared_expert_gate:  # Qwen3-Next: the gate's gradient, at its stage and end to end
        assert rules[("slot_weights", "combine_weights")].startswith("rel <= 1e-06")
        assert rules[("slot_weights_bwd", "d_shared_expert_gate_logits")].startswith("rel <= 1e-05")
        assert rules[("layer_bwd", "d_shared_expert_gate_logits")].startswith("rel <= 2e-02")
        assert data["meta"]["shared_expert_gate_logits"].startswith("x @ the seeded gate weight")
    if not (config.apply_router_weight_on_input or config.shared_expert_gate):  # the gate's weights go to the combine
        assert ("combine_bwd", "d_topk_weights") in rules
    if config.expert_bias:  # gpt-oss: the bias gradients at their stages and end to end, 0 for experts with no rows
        for stage, grad in (("gemm2_dbias", "d_w2_bias"), ("gemm1_dbias", "d_w13_bias")):
            assert rules[(stage, grad)].startswith("rel <= 1e-05")
            assert rules[("layer_bwd", grad)].startswith("rel <= 2e-02")
        assert {c["stage"] for c in comps if c["b"] == cc.NO_ROWS} >= set(cc.BIAS_STAGES)  # E=16, T=2: idle experts
    if quant != "none":  # section 9: the codes and scales bit-identical, the GEMMs by the bf16 rule
        assert rules[("weights", "w13")] == "exactly equal"  # uint8 packed codes
        assert rules[("weights", "w2_scale")] == ("exactly equal" if quant == "mxfp4" else "bit-identical")  # e8m0/bf16
        assert rules[("gemm1", "h")] == rules[("layer", "out")] == "rel <= 1e-02"
        assert "gemm1_wgrad: not run: 4-bit layer" in out


def test_llama4_maverick_small_check_is_llama4_scouts():
    """Llama 4 Maverick differs from Scout only in E (128 vs 16), which SMALL sets to 16: at these sizes its layer is
    Scout's field for field, and so are the check's seeded inputs, stages and rules, so Scout's case of
    test_new_preset_small_check_passes_forward_and_backward (the four implementations, whose pairs include the
    references' pair that a Maverick case ran) is Maverick's check, run once instead of twice."""
    maverick, scout = (get_preset(p) for p in ("llama4-maverick", "llama4-scout"))
    assert maverick.num_experts != scout.num_experts
    assert maverick.config(**SMALL_FIELDS) == scout.config(**SMALL_FIELDS)
    assert _expected_stages("llama4-maverick", "none") == _expected_stages("llama4-scout", "none")


def test_llama4_and_qwen3_next_together_under_ep(tmp_path, capsys):
    """Both semantics at once (Llama 4 + --shared-expert-gate), 2 EP ranks: the last rank's stage table (its routed
    experts and the fused shared one) and every rank summed against the single device, forward and backward,
    d_shared_expert_gate_logits summed like d_x (references: the EP summary's own rules)."""
    rc, out, err, data = _check(["--preset", "llama4-scout", *SMALL, "--shared-expert-gate", "--tokens", "3",
                                 "--ep-size", "2", "--ep-rank", "1", "--backward", "--implementations",
                                 ",".join(REFS)], tmp_path, capsys)
    assert rc == 0, out + err
    assert "apply_router_weight_on_input=True shared_expert_gate=True" in out
    comps = data["comparisons"]
    stages = {c["stage"] for c in comps}
    assert set(cc.SLOT_WEIGHT_STAGES) <= stages and {cc.EP_STAGE, cc.EP_BACKWARD_STAGE} <= stages
    assert 0 < data["meta"]["M"] < 3 * 2  # rank 1 of 2: some slots are not its
    ep_rows = {(c["output"], c["a"]) for c in comps if c["stage"] == cc.EP_BACKWARD_STAGE}
    for n in REFS:
        assert (cc.ep_grad_output("d_shared_expert_gate_logits"), n) in ep_rows
    gate = [c for c in comps if c["output"] == cc.ep_grad_output("d_shared_expert_gate_logits")]
    assert gate and all(c["ok"] and c["metrics"]["rel_fro"] < 1e-6 for c in gate)  # float32 inputs


# --------------------------------------------------------------------------------------------------
# Planted wrong stages: caught at their own stage (references only: fast, and the plant is torch's)

def _plant(monkeypatch, name, fn):
    """Replace ``moe_torch.slot_weights.<name>`` where the cross-check's stage calls it and where the layer does."""
    monkeypatch.setattr(torch_slots, name, fn)
    monkeypatch.setattr(torch_layer, name, fn)


def _bad(result):
    return {(c.stage, c.output) for c in result.comparisons if not c.ok}


def test_scaled_rows_without_the_weight_are_caught_at_scaled_slot_rows(monkeypatch):
    """The expert input x[t] instead of x[t] * w[t, j] (Llama 4's weight dropped): a violation at scaled_slot_rows
    (torch vs jnp) and at the whole layer; the permute, fed the reference's rows, passes."""
    real = torch_slots.scaled_slot_rows
    _plant(monkeypatch, "scaled_slot_rows", lambda x, input_scale: real(x, input_scale * 0 + 1))
    config = get_preset("llama4-scout").config(**SMALL_FIELDS)
    result = cc.run_crosscheck(config, 2, seed=1, implementations=REFS)
    assert result.failed_stages == ["scaled_slot_rows", "layer"]
    assert _bad(result) == {("scaled_slot_rows", "scaled_rows"), ("layer", "out")}
    c = next(c for c in result.comparisons if c.stage == "scaled_slot_rows")
    assert c.rule == "bit-identical" and c.metrics["mismatches"] > 0


def test_ignored_shared_expert_gate_is_caught_at_slot_weights(monkeypatch):
    """Qwen3-Next's sigmoid gate ignored (the shared slot keeps the gate's weight 1): a violation at slot_weights
    (combine_weights, torch vs jnp) and at the layer; the combine, fed the reference's weights, passes."""
    real = torch_slots.slot_weights
    _plant(monkeypatch, "slot_weights",
           lambda w, logits, config: real(w, None, config.replace(shared_expert_gate=False)))
    config = get_preset("qwen3-next-80b-a3b").config(**SMALL_FIELDS)
    result = cc.run_crosscheck(config, 2, seed=1, implementations=REFS)
    assert result.failed_stages == ["slot_weights", "layer"]
    assert _bad(result) == {("slot_weights", "combine_weights"), ("layer", "out")}


def test_wrong_shared_gate_gradient_is_caught_at_slot_weights_bwd(monkeypatch):
    """d_shared_expert_gate_logits without the sigmoid's derivative g * (1 - g): a violation at slot_weights_bwd and
    in the layer's d_shared_expert_gate_logits only (d_topk_weights, d_router_logits and the rest pass)."""
    import torch

    real = torch_slots.slot_weights_backward

    def wrong(topk_weights, logits, d_w, d_scale, config):
        d_topk, d_logits = real(topk_weights, logits, d_w, d_scale, config)
        g = torch.sigmoid(logits.float())
        return d_topk, d_logits / (g * (1 - g))

    _plant(monkeypatch, "slot_weights_backward", wrong)
    config = get_preset("qwen3-next-80b-a3b").config(**SMALL_FIELDS)
    result = cc.run_crosscheck(config, 2, seed=1, implementations=REFS, backward=True)
    assert result.failed_stages == ["slot_weights_bwd", "layer_bwd"]
    assert _bad(result) == {("slot_weights_bwd", "d_shared_expert_gate_logits"),
                            ("layer_bwd", "d_shared_expert_gate_logits")}


def test_dropped_expert_bias_is_caught_at_the_gemms(monkeypatch):
    """gpt-oss's biases dropped by torch's reference GEMM: a violation at gemm1 (h), gemm2 (y) and the layer."""
    real = torch_gemm_api.grouped_gemm_reference
    monkeypatch.setattr(torch_gemm_api, "grouped_gemm_reference", lambda *args, bias=None, **kw: real(*args, **kw))
    config = get_preset("gpt-oss-20b").config(**SMALL_FIELDS)
    result = cc.run_crosscheck(config, 2, seed=1, implementations=REFS)
    assert result.failed_stages == ["gemm1", "gemm2", "layer"]
    assert _bad(result) == {("gemm1", "h"), ("gemm2", "y"), ("layer", "out")}


def test_wrong_bias_gradient_is_caught_at_the_dbias_stages(monkeypatch):
    """torch's reference grouped_gemm_dbias 10 % off: a violation at gemm2_dbias and gemm1_dbias (section 8's float32
    rule) and in the layer's d_w13_bias / d_w2_bias; every other gradient passes."""
    real = torch_gemm_api.grouped_gemm_dbias_reference
    monkeypatch.setattr(torch_gemm_api, "grouped_gemm_dbias_reference", lambda *args: real(*args) * 1.1)
    config = get_preset("gpt-oss-20b").config(**SMALL_FIELDS)
    result = cc.run_crosscheck(config, 2, seed=1, implementations=REFS, backward=True)
    assert result.failed_stages == ["gemm2_dbias", "gemm1_dbias", "layer_bwd"]
    assert _bad(result) == {("gemm2_dbias", "d_w2_bias"), ("gemm1_dbias", "d_w13_bias"), ("layer_bwd", "d_w13_bias"),
                            ("layer_bwd", "d_w2_bias")}


def test_default_backend_that_cannot_serve_is_reported_not_served(monkeypatch, tmp_path, capsys):
    """A backend from the CLI's default list (as ``pallas_mosaic_gpu`` joins on a GPU) raising NotImplementedError
    (a valid layer it cannot serve): printed ``<name>: not served: <reason>``, in the JSON's ``not_served`` (not
    ``skipped``), exit 0; named in --implementations, the same backend stays ``skipped`` (today's behaviour)."""
    import moe_torch

    real = moe_torch.select_experts

    def unserved(*args, implementation=None, **kwargs):
        if implementation == "triton":
            raise NotImplementedError("select_experts: no such gate in this kernel")
        return real(*args, implementation=implementation, **kwargs)

    monkeypatch.setattr(moe_torch, "select_experts", unserved)
    monkeypatch.setattr(cc, "DEFAULT_IMPLEMENTATIONS", ("jnp-reference", "torch-reference", "triton"))  # fast
    rc, out, err, data = _check(["--preset", "tiny", "--tokens", "2"], tmp_path, capsys)
    assert rc == 0, out + err
    assert "triton: not served: gate: select_experts: no such gate in this kernel" in out
    assert data["ok"] and not data["skipped"] and not data["errors"]
    assert data["not_served"] == {"triton": "gate: select_experts: no such gate in this kernel"}
    rc, out, err, data = _check(["--preset", "tiny", "--tokens", "2", "--implementations", "triton"], tmp_path, capsys)
    assert rc == 0 and "not served" not in out and "skipped triton" in out, out + err
    assert data["skipped"] == {"triton": "gate: select_experts: no such gate in this kernel"} and not data["not_served"]


# --------------------------------------------------------------------------------------------------
# Refusals: one line, exit 2, no traceback

@pytest.mark.parametrize("exc", [NotImplementedError("run_crosscheck: no such\n  layer here"),
                                 ValueError("make_inputs: x must be\n[T, H]")])
def test_cli_prints_a_cross_check_refusal_in_one_line(exc, monkeypatch, capsys):
    """A NotImplementedError / ValueError from the cross-check: `epmoe check: <type>: <message on one line>`, exit 2."""
    def refuse(*args, **kwargs):
        raise exc

    monkeypatch.setattr(cc, "run_crosscheck", refuse)
    assert main(["check", "--tokens", "2", "--implementations", "torch-reference"]) == 2
    err = capsys.readouterr().err
    assert err == f"epmoe check: {type(exc).__name__}: {' '.join(str(exc).split())}\n"
    assert "Traceback" not in err


def test_cli_refuses_a_layer_the_jnp_reference_cannot_serve_in_one_line(monkeypatch, capsys):
    """The jnp reference (whose outputs feed every other implementation) raising NotImplementedError at a stage: the
    cross-check raises NotImplementedError naming the stage (was: a RuntimeError and a traceback), the CLI one line."""
    import moe_pallas

    def unserved(*args, **kwargs):
        raise NotImplementedError("select_experts: no such routing here")

    monkeypatch.setattr(moe_pallas, "select_experts", unserved)
    with pytest.raises(NotImplementedError, match="the jnp reference cannot run stage gate"):
        cc.run_crosscheck(get_preset("tiny").config(), 2, implementations=REFS)
    assert main(["check", "--tokens", "2", "--implementations", "torch-reference"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epmoe check: NotImplementedError: run_crosscheck: the jnp reference cannot run stage gate")
    assert err.count("\n") == 1 and "select_experts: no such routing here" in err


@pytest.mark.parametrize("args,msg", [
    (["--preset", "glm-4.5-air", "--hidden-size", "64", "--weights", "x"],
     "--hidden-size: not used with --weights"),
    pytest.param(["--preset", "qwen3-next-80b-a3b"],
                 "or shrink this one: --hidden-size, --intermediate-size, --num-experts",
                 marks=pytest.mark.skipif(DEVICE == "gpu", reason="a CPU-only refusal (on a GPU the check runs)")),
    (["--preset", "kimi-k2", *SMALL, "--num-shared-experts", "0", "--shared-expert-gate"],
     "shared_expert_gate=True gates the fused shared experts"),
    (["--preset", "llama4-scout", *SMALL, "--activation", "relu"], "invalid choice: 'relu'"),
])
def test_cli_layer_option_refusals(args, msg, capsys):
    try:
        rc = main(["check", *args])
    except SystemExit as exit_:  # argparse's own refusal
        rc = exit_.code
    assert rc == 2
    assert msg in capsys.readouterr().err
