"""epmoe: the project's command line.

`epmoe check` (the main job) runs one set of inputs through the four implementations of the
MoE layer (jnp and torch references, Pallas and Triton kernels) stage by stage and judges every
stage against the numerics contract (`interop/crosscheck/`; `--backward` adds the backward stages and the
layer's gradients); exit 1 names the failing stage.
`epmoe demo` runs the reference MoE layer of a model preset in both frameworks (jnp and torch)
on the same random inputs and prints what they computed and how far apart they are.
`epmoe bench` forwards to `benchmarks/bench.py` (a GPU machine; `--tiny` is a CPU smoke test).
`epmoe tune` measures the grouped GEMMs' launch configs of a preset's or checkpoint's layer on this GPU and writes
them to the user's tuned table of this device, which the kernels read before the shipped ones.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import numpy as np

from moe_contract import PRESETS, get_preset, make_layer_inputs
from moe_contract.config import ACTIVATIONS, GATE_UP_LAYOUTS, QUANTS, W4_LAYOUTS
from moe_contract.inputs import ROUTING_SKEWS


def _rel_fro(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(b64), 1e-300))


def _fmt(values: np.ndarray) -> str:
    return "[" + ", ".join(f"{float(v):+.4f}" for v in values) + "]"


def _host_bytes_needed(config) -> int:
    """float32 host bytes of the numpy inputs (w13 + w2 dominate), as make_layer_inputs draws them."""
    H, I, E_all = config.hidden_size, config.intermediate_size, config.num_total_experts
    return 4 * 3 * E_all * H * I


def _host_bytes_needed_bf16(config) -> int:
    """Host bytes of ``check`` with its random weights drawn straight into bf16 (``weights_dtype="bfloat16"``):
    the bf16 layer (2 bytes a weight), a converted copy of it (torch's host copy on the way to the device) and the
    two references' codes (FP8: 1 byte a weight each; at most as much as one more bf16 copy): 3x the bf16 bytes."""
    return 3 * (_host_bytes_needed(config) // 2)


def _host_bytes_available() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


#: The MoEConfig flags of the 2026 families a header names when they are on.
_SEMANTICS = ("apply_router_weight_on_input", "shared_expert_gate", "expert_bias")


def run_demo(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp
    import torch

    import moe_pallas
    import moe_torch

    from interop.crosscheck.run import expert_biases

    preset = get_preset(args.preset)
    try:
        config = preset.config(quant=args.quant, **_layer_overrides(args))
    except (ValueError, TypeError) as exc:
        print(f"epmoe demo: {exc}", file=sys.stderr)
        return 2
    need, have = _host_bytes_needed(config), _host_bytes_available()
    if 2 * need > have:  # the weights, plus a converted copy per framework
        print(f"epmoe demo: preset {preset.name} needs about {2 * need / 2**30:.0f} GiB of host memory for its weights "
              f"({have / 2**30:.0f} GiB available); use --preset tiny here, shrink this one (--hidden-size, "
              f"--intermediate-size, --num-experts), or use a larger machine", file=sys.stderr)
        return 2
    inputs = make_layer_inputs(config, args.tokens, seed=args.seed, routing=args.routing)
    # The layer inputs a preset's semantics ask for, drawn as `check` draws them: gpt-oss's per-expert biases
    # (seeded, bf16 like a model's), Qwen3-Next's shared-expert gate logits (x @ the seeded gate weight).
    biases = expert_biases(config, args.seed, None)  # (w13_bias, w2_bias) or None
    biases = None if biases is None else tuple(np.asarray(b, np.float32) for b in biases)
    shared = inputs.shared_expert_gate_logits  # [T, S] float32 or None
    jdt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"preset {preset.name}: H={config.hidden_size} I={config.intermediate_size} E={config.num_experts} "
          f"topk={config.topk} routing={config.routing} rsf={config.routed_scaling_factor} "
          f"shared={config.num_fused_shared_experts} activation={config.activation} "
          f"{''.join(f'{n}=True ' for n in _SEMANTICS if getattr(config, n, False))}"
          f"quant={config.quant} dtype={args.dtype}")
    print(f"T={args.tokens} routing skew={args.routing} seed={args.seed}; jax on {jax.default_backend()}, torch on {device}")

    outs = {}
    # jnp reference
    t0 = time.perf_counter()
    jw13, jw2 = jnp.asarray(inputs.w13, jdt), jnp.asarray(inputs.w2, jdt)
    w13, s13, w2, s2 = moe_pallas.quantize_layer_weights(jw13, jw2, config)
    fwd = jax.jit(moe_pallas.moe_forward, static_argnames=("config",))
    bias = jnp.asarray(inputs.e_score_correction_bias) if config.routing == "biased_grouped_topk" else None
    jb13, jb2 = (None, None) if biases is None else (jnp.asarray(b).astype(jdt) for b in biases)
    out_j = fwd(jnp.asarray(inputs.x, jdt), jnp.asarray(inputs.router_logits), w13, w2, config,
                w13_scale=s13, w2_scale=s2, w13_bias=jb13, w2_bias=jb2, e_score_correction_bias=bias,
                shared_expert_gate_logits=None if shared is None else jnp.asarray(shared))
    outs["jnp reference"] = np.asarray(out_j.astype(jnp.float32))
    weights, ids = moe_pallas.select_experts(
        jnp.asarray(inputs.router_logits), topk=config.topk, routing=config.routing, renormalize=config.renormalize,
        num_expert_group=config.num_expert_group, topk_group=config.topk_group, e_score_correction_bias=bias,
        routed_scaling_factor=config.routed_scaling_factor, apply_routed_scaling_factor_on_output=True,
        num_fused_shared_experts=config.num_fused_shared_experts)
    t_j = time.perf_counter() - t0

    # torch reference
    t0 = time.perf_counter()
    tw13 = torch.from_numpy(inputs.w13).to(device, tdt)
    tw2 = torch.from_numpy(inputs.w2).to(device, tdt)
    w13, s13, w2, s2 = moe_torch.quantize_layer_weights(tw13, tw2, config)
    tbias = torch.from_numpy(inputs.e_score_correction_bias).to(device) if bias is not None else None
    tb13, tb2 = (None, None) if biases is None else (torch.from_numpy(b).to(device, tdt) for b in biases)
    out_t = moe_torch.moe_forward(torch.from_numpy(inputs.x).to(device, tdt), torch.from_numpy(inputs.router_logits).to(device),
                                  w13, w2, config, w13_scale=s13, w2_scale=s2, w13_bias=tb13, w2_bias=tb2,
                                  e_score_correction_bias=tbias,
                                  shared_expert_gate_logits=None if shared is None else
                                  torch.tensor(shared, device=device))
    outs["torch reference"] = out_t.float().cpu().numpy()
    t_t = time.perf_counter() - t0

    counts = np.bincount(np.asarray(ids).reshape(-1), minlength=config.num_total_experts)
    print(f"rows per expert (routed, then shared): {counts.tolist()}")
    print(f"token 0: experts {np.asarray(ids)[0].tolist()} weights (rsf applied) {_fmt(np.asarray(weights)[0])}")
    print()
    print(f"{'implementation':<18}{'out shape':<14}{'mean |out|':>12}{'out[0, :4]':>44}{'seconds':>10}  (jnp: incl. jit compile)")
    for (name, out), sec in zip(outs.items(), (t_j, t_t)):
        print(f"{name:<18}{str(out.shape):<14}{np.abs(out).mean():>12.5f}{_fmt(out[0, :4]):>44}{sec:>10.2f}")
    err = _rel_fro(outs["jnp reference"], outs["torch reference"])
    limit = 1e-2 if (args.dtype == "bfloat16" or config.quant != "none") else 1e-5
    verdict = "agree" if err <= limit else "DISAGREE"
    print(f"\njnp vs torch: ||a-b||/||b|| = {err:.3e} (limit {limit:.0e}): {verdict}")
    return 0 if err <= limit else 1


# --------------------------------------------------------------------------------------
# epmoe check

#: Largest weights (elements of w13 + w2, all experts) the CPU interpreters are asked to run: the tiny preset, any
#: preset its layer options make small (``--hidden-size``, ...), or a checkpoint's layer.
CPU_MAX_WEIGHT_ELEMENTS = 1 << 24
#: Tokens the CPU (interpreted kernels) takes in ``check``: T=16 takes about 10 s on 2 cores.
CPU_MAX_TOKENS = 512


def _quant_arg(value: str) -> str:
    """``--quant`` as written by people: ``fp8-block``, ``MXFP4`` (the checkpoint's spelling), ``int-4`` -> the
    contract's name (case, ``-`` and ``_`` ignored). Anything else: ``argparse.ArgumentTypeError`` naming the value as
    written and the choices (``int-4`` was reported as ``'int_4'``, a spelling nobody typed)."""
    names = {q.replace("_", ""): q for q in QUANTS}
    key = value.lower().replace("-", "").replace("_", "")
    if key not in names:
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(QUANTS)}; case, '-' and "
                                         f"'_' do not matter)")
    return names[key]


#: ``demo``'s and ``check``'s layer options: (MoEConfig field, option, type, help). Each overrides the preset's value
#: (shapes to run a preset small, e.g. on a CPU; the layer semantics of the 2026 families); with --weights the
#: checkpoint decides.
LAYER_OPTIONS = (
    ("hidden_size", "--hidden-size", int, "H, the hidden size"),
    ("intermediate_size", "--intermediate-size", int, "I, the expert intermediate size"),
    ("num_experts", "--num-experts", int, "E, the routed experts (the preset's groups must divide it)"),
    ("topk", "--topk", int, "K, the routed experts per token"),
    ("num_fused_shared_experts", "--num-shared-experts", int, "S, the fused shared experts"),
    ("activation", "--activation", str, "the act_and_mul between the GEMMs (" + ", ".join(ACTIVATIONS) + ")"),
    ("gate_up_layout", "--gate-up-layout", str, "where gate and up are in w13's 2I rows (" + ", ".join(GATE_UP_LAYOUTS)
     + "; gpt-oss: interleaved)"),
    ("apply_router_weight_on_input", "--apply-router-weight-on-input", bool,
     "Llama 4: the routed weights scale the experts' input, the combine adds their outputs with weight 1"),
    ("shared_expert_gate", "--shared-expert-gate", bool,
     "Qwen3-Next: the fused shared experts weighted by sigmoid(shared_expert_gate_logits) (seeded x @ gate weight)"),
    ("expert_bias", "--expert-bias", bool, "gpt-oss: per-expert biases of both GEMMs (w13_bias, w2_bias)"),
    ("w4_layout", "--w4-layout", str, "how MXFP4 codes are stored (" + ", ".join(W4_LAYOUTS)
     + "; mma: repacked for the GPU's decode, --quant mxfp4 only)"),
)


def _layer_overrides(args: argparse.Namespace) -> dict:
    """The MoEConfig fields the layer options set (:data:`LAYER_OPTIONS`; those not given are left out)."""
    return {field: getattr(args, field) for field, *_ in LAYER_OPTIONS if getattr(args, field, None) is not None}


def _routing_arg(value: str) -> str:
    return value.replace("_", "-")


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _cpu_tokens_problem(tokens: int) -> str | None:
    """The refusal of ``--tokens`` beyond :data:`CPU_MAX_TOKENS` on a machine without a GPU (None: fine)."""
    if tokens > CPU_MAX_TOKENS and not _has_gpu():
        return (f"no GPU here, so the kernels run interpreted; --tokens {tokens} would take hours (at most "
                f"{CPU_MAX_TOKENS} on a CPU)")
    return None


def _prepare_interpreters() -> None:
    """No GPU: run the Triton kernels in Triton's interpreter (set before any kernel module is imported)."""
    if "moe_torch.ops.grouped_gemm.triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"


def _ep_words(config, args) -> str:
    if config.ep_size == 1:
        return "EP rank 0/1"
    what = f"EP {config.ep_size} ranks: all summed ({args.ep_dtype} inputs)"
    return what + (f", rank {args.ep_rank} stage by stage" if args.ep_rank is not None else "")


#: Host bytes per token the cross-check holds at most (x, logits and every stage's [T * topk', ...] outputs
#: for four implementations, float32): a bound for refusing absurd --tokens before allocating.
def _token_bytes(config) -> int:
    H, I, slots = config.hidden_size, config.intermediate_size, config.topk + config.num_fused_shared_experts
    return 4 * 4 * (2 * H + config.num_experts + slots * (3 * I + 2 * H))


def _check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments of ``check`` before any work (None: nothing)."""
    if args.layer is not None and not args.weights:
        return "--layer needs --weights (it picks a layer of the checkpoint)"
    if args.json and args.json != "-":  # "-": standard output
        target = os.path.abspath(args.json)
        if os.path.isdir(target):
            return f"--json must be a file path; got a folder: {args.json!r}"
        parent = os.path.dirname(target)
        probe = parent
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe):
            return f"--json: {probe!r} is a file, not a folder; got --json {args.json!r}"
        if probe != parent:  # a typo in the path should not become new folders
            return (f"--json: the parent directory {parent!r} does not exist; got --json {args.json!r} (create the "
                    f"directory first, or give '-' for standard output)")
        if not os.access(parent, os.W_OK):
            return f"--json: cannot write under {parent!r}"
        import tempfile

        try:  # prove the folder takes a file now, not after the run
            tempfile.TemporaryFile(dir=parent).close()
        except OSError as exc:
            return f"--json: cannot write under {parent!r} ({exc.strerror or exc})"
    if args.weights and _layer_overrides(args):
        names = [opt for field, opt, *_ in LAYER_OPTIONS if field in _layer_overrides(args)]
        return f"{', '.join(names)}: not used with --weights (the checkpoint and its config.json give the layer)"
    try:
        config = get_preset(args.preset).config(quant=args.quant, **_layer_overrides(args))
    except (ValueError, TypeError):
        return None  # reported with the other config errors
    backward = 2 if args.backward else 1  # every stage output has a gradient beside it
    need, have = backward * args.tokens * _token_bytes(config), _host_bytes_available()
    problems = [] if args.inputs else [_cpu_tokens_problem(args.tokens)]  # with --inputs their rows decide, later
    if need > have:
        problems.append(f"--tokens {args.tokens} needs about {need / 2**30:.0f} GiB of host memory for the compared "
                        f"stage outputs ({have / 2**30:.0f} GiB available)")
    # every reason that applies: which one came alone used to depend on the host memory free at that moment
    return "; ".join(p for p in problems if p) or None


def run_check(args: argparse.Namespace) -> int:
    if getattr(args, "json", None) == "-":  # stdout carries the JSON alone (a pipe into jq); the report: stderr
        stdout = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            return _run_check(args, stdout)
    return _run_check(args, sys.stdout)


def _run_check(args: argparse.Namespace, json_stream) -> int:
    gpu = _has_gpu()
    if not gpu:
        _prepare_interpreters()
    from interop import crosscheck as cc

    args.layer = getattr(args, "layer", None)
    args.implementations = getattr(args, "implementations", None)
    args.backward = getattr(args, "backward", False)
    args.inputs = getattr(args, "inputs", None)
    # --preset / --quant given or not (the parser leaves them out when not): with --weights the
    # checkpoint's config.json and dtype decide, and a preset's routing is taken only when asked for.
    preset_given, quant_given = getattr(args, "preset", None), getattr(args, "quant", None)
    args.preset, args.quant = preset_given or "tiny", quant_given or "none"
    problem = _check_args(args)
    if problem:
        print(f"epmoe check: {problem}", file=sys.stderr)
        return 2
    preset = get_preset(args.preset)
    overrides = dict(ep_size=args.ep_size, ep_rank=args.ep_rank or 0, **_layer_overrides(args))
    if quant_given is not None or not args.weights:
        overrides["quant"] = args.quant
    weights = ckpt = x = logits = None
    try:
        if args.weights:
            from interop.checkpoints import load_moe_layer

            ckpt = load_moe_layer(args.weights, layer=args.layer)
            if ckpt.routing is None and preset_given is None:
                print(f"epmoe check: --weights {args.weights}: no config.json beside the weights, and the routing "
                      f"(topk, groups, routed_scaling_factor, renormalize) is not in the tensors: put the model's "
                      f"config.json there, or pass --preset NAME to take that preset's routing", file=sys.stderr)
                return 2
            if ckpt.routing is not None and preset_given is not None:
                print(f"epmoe check: --preset {preset_given} not used: the routing comes from {ckpt.config_path}",
                      file=sys.stderr)
            config = ckpt.config(preset, **overrides)
            weights = ckpt.layer_weights(config)
        else:
            config = preset.config(**overrides)
        if args.inputs:
            from interop.checkpoints import load_inputs

            x, logits = load_inputs(args.inputs, config)
            if logits is None and weights is None:
                print(f"epmoe check: --inputs {args.inputs} has no 'router_logits' [T, E={config.num_experts}], and "
                      f"without --weights there is no router weight to compute them from x", file=sys.stderr)
                return 2
            args.tokens = x.shape[0]
    except (ValueError, TypeError, FileNotFoundError, KeyError, OSError, ImportError) as exc:
        print(f"epmoe check: {exc}", file=sys.stderr)
        return 2
    args.quant = config.quant
    n_weights = 3 * config.num_total_experts * config.hidden_size * config.intermediate_size
    if not gpu and n_weights > CPU_MAX_WEIGHT_ELEMENTS:
        print(f"epmoe check: no GPU here, so the Pallas and Triton kernels run interpreted, which takes hours at "
              f"the size of {'these weights' if weights is not None else 'preset ' + preset.name} "
              f"({n_weights / 1e6:.0f}M weight elements, at most {CPU_MAX_WEIGHT_ELEMENTS / 1e6:.1f}M here); use "
              f"--preset tiny on a CPU{'' if weights is not None else ' (or shrink this one: --hidden-size, --intermediate-size, --num-experts)'}, "
              f"or run on a GPU machine", file=sys.stderr)
        return 2
    if not gpu and (problem := _cpu_tokens_problem(args.tokens)):
        print(f"epmoe check: {problem}", file=sys.stderr)
        return 2
    need, have = _host_bytes_needed(config), _host_bytes_available()
    # The check rounds the random float32 weights to bf16 before any stage (the EP summary too with --ep-dtype
    # bfloat16): where the float32 layer does not fit, draw them straight into bf16 (the same values).
    weights_need, weights_dtype = 2 * need, "float32"
    bf16_check = config.ep_size == 1 or args.ep_dtype == "bfloat16"
    if weights is None and 2 * need > have and bf16_check:
        weights_need, weights_dtype = _host_bytes_needed_bf16(config), "bfloat16"
        if weights_need > have:
            print(f"epmoe check: preset {preset.name} needs about {2 * need / 2**30:.0f} GiB of host memory for its "
                  f"weights, about {weights_need / 2**30:.0f} GiB with them drawn in bf16 ({have / 2**30:.0f} GiB "
                  f"available); use a larger machine", file=sys.stderr)
            return 2
    if weights is None and weights_need > have:
        print(f"epmoe check: preset {preset.name} needs about {2 * need / 2**30:.0f} GiB of host memory for its weights "
              f"({have / 2**30:.0f} GiB available); use a larger machine", file=sys.stderr)
        return 2
    # --backward with float weights: up to five implementations each keep float32 wgrads and bf16 layer
    # gradients of the weights (1.5x the float32 weights each); FP8 codes get no weight gradient.
    grad_need = 8 * need if args.backward and config.quant == "none" else 0
    if grad_need and (0 if weights is not None else weights_need) + grad_need > have:
        print(f"epmoe check: --backward holds every implementation's weight gradients, about {grad_need / 2**30:.0f} "
              f"GiB of host memory at this size ({have / 2**30:.0f} GiB available); use an FP8 --quant (no weight "
              f"gradients) or a larger machine", file=sys.stderr)
        return 2
    implementations = list(cc.DEFAULT_IMPLEMENTATIONS)
    if gpu and args.implementations is None:
        implementations.append("pallas_mosaic_gpu")
    if args.implementations is not None:
        implementations = list(dict.fromkeys(n.strip() for n in args.implementations.split(",") if n.strip()))
        bad = [n for n in implementations if n not in cc.IMPLEMENTATIONS]
        if bad or not implementations:
            print(f"epmoe check: --implementations must be a comma list of {', '.join(cc.IMPLEMENTATIONS)}; got {bad or '(none)'}",
                  file=sys.stderr)
            return 2
        if "pallas_mosaic_gpu" in implementations and not gpu:
            print("epmoe check: --implementations pallas_mosaic_gpu needs a Hopper GPU (Mosaic GPU kernels do not run "
                  "interpreted); none here", file=sys.stderr)
            return 2
        # Each kernel is judged against its framework's reference: add the reference it needs.
        for name in list(implementations):
            ref = cc.REFERENCE[cc.IMPLEMENTATIONS[name][0]]
            if ref not in implementations:
                implementations.append(ref)
        if "jnp-reference" in implementations:  # the upstream values and the judge of the JAX kernels: first
            implementations.remove("jnp-reference")
        implementations.insert(0, "jnp-reference")
        if implementations == ["jnp-reference"]:
            print("epmoe check: --implementations jnp-reference alone compares nothing; add torch-reference or a kernel "
                  "backend", file=sys.stderr)
            return 2

    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if ckpt is not None:
        what = (f"{ckpt.arch} layer {ckpt.layer} ({ckpt.dtype}) with weights from {args.weights}, routing from "
                f"{ckpt.config_path or 'preset ' + preset.name + ' (no config.json)'}")
    else:
        what = f"preset {preset.name}"
    inputs_words = (f"x{', router_logits' if logits is not None else ' (router_logits = x @ router weight)'} "
                    f"from {args.inputs}" if x is not None else f"skew={args.routing} seed={args.seed}")
    print(f"epmoe check: {what}: "
          f"H={config.hidden_size} I={config.intermediate_size} E={config.num_experts} topk={config.topk} "
          f"routing={config.routing} renormalize={config.renormalize} rsf={config.routed_scaling_factor} "
          f"shared={config.num_fused_shared_experts} activation={config.activation}"
          f"{'' if config.gate_up_layout == 'concatenated' else ' (' + config.gate_up_layout + ')'} "
          f"{''.join(f'{n}=True ' for n in _SEMANTICS if getattr(config, n, False))}"
          f"quant={config.quant} {_ep_words(config, args)}; T={args.tokens} {inputs_words}; "
          f"{'GPU' if gpu else 'no GPU: kernels interpreted'}; implementations: {', '.join(implementations)}"
          f"{'; forward and backward' if args.backward else ''}", flush=True)
    if weights_dtype != "float32":
        print(f"weights drawn in bf16 (the float32 weights would need {2 * need / 2**30:.0f} GiB of host memory, "
              f"{have / 2**30:.0f} available; the check rounds them to bf16 first, so the values are the same)",
              flush=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("starting", total=None)

        def progress(msg: str) -> None:
            bar.update(task, description=msg)
            if not console.is_terminal and args.verbose:
                print(f"  .. {msg}", file=sys.stderr, flush=True)

        stages = ep = None
        try:
            if config.ep_size == 1 or args.ep_rank is not None:  # one rank, stage by stage
                stages = cc.run_crosscheck(config, args.tokens, seed=args.seed, routing=args.routing,
                                           implementations=implementations, weights=weights, progress=progress,
                                           x=x, router_logits=logits, backward=args.backward,
                                           weights_dtype=weights_dtype)
            if config.ep_size > 1:  # every rank end to end, summed, against the single device
                ep = cc.run_ep_check(config, args.tokens, seed=args.seed, routing=args.routing,
                                     implementations=implementations, weights=weights, dtype=args.ep_dtype,
                                     progress=progress, x=x, router_logits=logits, backward=args.backward,
                                     weights_dtype=weights_dtype)
        except (NotImplementedError, ValueError) as exc:  # a layer the check cannot take, or bad values: one line
            refused = f"epmoe check: {type(exc).__name__}: {' '.join(str(exc).split())}"
        else:
            refused = None
            result = cc.merge_results(stages, ep)
            if args.implementations is None:  # a default backend that cannot serve this layer: shown, not a failure
                result.not_served.update(result.skipped)
                result.skipped.clear()
    if refused:
        print(refused, file=sys.stderr)
        return 2
    cc.render(result)
    if args.json == "-":
        import json

        json.dump(result.to_json(), json_stream, indent=1, default=float)
        json_stream.write("\n")
        json_stream.flush()
    elif args.json:
        import json

        try:
            with open(args.json, "w") as f:
                json.dump(result.to_json(), f, indent=1, default=float)
        except OSError as exc:
            print(f"epmoe check: --json: cannot write {args.json!r} ({exc.strerror or exc})", file=sys.stderr)
            return 2
        print(f"wrote {args.json}")
    return 0 if result.ok else 1


# --------------------------------------------------------------------------------------
# epmoe bench

def run_bench(args: argparse.Namespace) -> int:
    """``benchmarks/bench.py``'s main with the remaining arguments (loaded by path: not a package)."""
    import importlib.util

    argv = list(args.bench_args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "benchmarks", "bench.py")
    if not os.path.exists(path):
        print(f"epmoe bench: {path} not found (the benchmarks live in the source tree, not the wheel)", file=sys.stderr)
        return 2
    tiny = "--tiny" in argv
    if tiny:
        # The CPU smoke test runs in a child process: it needs the interpreters (JAX on the CPU,
        # TRITON_INTERPRET=1) set before torch / jax / triton import, and setting them here would leak
        # into this process (a test run or a notebook), turning later Triton imports into interpreted ones.
        import subprocess

        env = dict(os.environ, TRITON_INTERPRET="1")
        env.setdefault("JAX_PLATFORMS", "cpu")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        return subprocess.run([sys.executable, path, *argv], env=env).returncode
    if "-h" not in argv and "--help" not in argv and not _has_gpu():
        print("epmoe bench: the benchmarks time the kernels on a GPU and there is none here; "
              "`epmoe bench --tiny` runs the CPU smoke test (interpreted, tiny shapes, timings meaningless; "
              "with --preset tiny or --weights of a tiny checkpoint)", file=sys.stderr)
        return 2
    saved = sys.argv
    sys.argv = [path, *argv]
    try:
        spec = importlib.util.spec_from_file_location("_epmoe_bench", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return int(module.main(argv) or 0)
    finally:
        sys.argv = saved


# --------------------------------------------------------------------------------------
# epmoe tune

def _list_arg(parse):
    """An argparse ``type`` from a ``moe_contract.tuning`` list parser: its ``ValueError`` becomes the usage error
    ``argument --ms: ...`` (the option's name once)."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None
    return convert


def _minutes_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of minutes > 0; got {text!r}")
    return value


def _weights_arg(text: str) -> str:
    from moe_contract.tuning import checkpoint_config_path

    try:
        checkpoint_config_path(text)
    except FileNotFoundError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _tune_frameworks(args: argparse.Namespace) -> list[str]:
    return ["torch", "jax"] if args.framework == "both" else [args.framework]


def _tune_module(framework: str):
    if framework == "torch":
        from moe_torch.ops.grouped_gemm import tune
    else:
        from moe_pallas.ops.grouped_gemm import tune
    return tune


def _tune_dry_run(args: argparse.Namespace, shapes) -> int:
    """Print the problems and where each framework's table would go; no kernel runs (the device is read through each
    framework's device spec where it sees a GPU)."""
    from moe_contract import selection, tuning

    source = f"preset {args.preset}" if args.preset else f"checkpoint {args.weights}"
    print(f"epmoe tune (dry run): the grouped GEMMs of {source}, EP size {args.ep_size}:")
    for shape in shapes:
        print(f"  {shape.describe()}")
    print(f"  M (rows): {', '.join(map(str, args.ms))}; dtypes: {', '.join(args.dtypes)}; ops: {', '.join(args.ops)}; "
          f"routings: {', '.join(args.routings)}")
    for shape in shapes:
        if "fp8_block" in args.dtypes and shape.K % 128:
            print(f"  {shape.name}: fp8_block not tuned (K={shape.K}; its 1 x 128 activation groups need K % 128 == 0)")
    if "bf16" not in args.dtypes and set(args.ops) - {"fwd"}:
        print("  dgrad / wgrad not tuned: the backward is tuned for bf16 only")
    for fw in _tune_frameworks(args):
        spec = _tune_device_spec(fw)
        if args.out:
            dest = os.path.abspath(args.out)
        elif spec is not None:
            dest = tuning.tuned_table_path(fw, spec.arch, spec.kind)
        else:
            dest = os.path.join(selection.user_tuned_dir(fw), "<arch>", "<device kind>.json")
        # without a GPU nothing about the device is known: no spec (shared memory, SMs) is printed for it
        where = spec.describe() if spec is not None else "no CUDA GPU here: the GPU it runs on names the file"
        print(f"  {fw}: {dest} ({where})")
    return 0


def _tune_device_spec(framework: str):
    """The device spec ``framework``'s tuner would measure on (its own device spec function, read from the device:
    ``moe_torch.ops.device`` / ``moe_pallas.ops.device``), ``None`` where that framework sees no CUDA GPU."""
    if framework == "torch":
        import torch

        if not torch.cuda.is_available():
            return None
        from moe_torch.ops.device import device_spec

        return device_spec()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # a dry run: JAX must not take the GPU's memory
    from moe_pallas.ops.device import device_spec

    return device_spec()


def run_tune(args: argparse.Namespace) -> int:
    """``epmoe tune``: the shapes of ``--preset`` / ``--weights``, measured per framework on this GPU, merged into the
    user's table of this device (or ``--out``) and written after every problem."""
    from moe_contract import selection, tuning

    parser = args.tune_parser
    if args.out and args.framework == "both":
        parser.error("argument --out: names one table file; give --framework torch or jax with it")
    if args.out and (os.path.isdir(args.out) or not args.out.endswith(".json")):
        parser.error(f"argument --out: must be a .json file path (the table); got {args.out!r}")
    try:
        shapes = (tuning.preset_shapes(args.preset, args.ep_size) if args.preset
                  else tuning.checkpoint_shapes(args.weights, args.ep_size))
    except ValueError as exc:
        option, _, why = str(exc).partition(": ")
        if option != "--ep-size":
            option, why = ("--preset" if args.preset else "--weights"), str(exc)
        parser.error(f"argument {option}: {why}")
    if args.dry_run:
        return _tune_dry_run(args, shapes)
    frameworks = _tune_frameworks(args)
    modules = {}
    for fw in frameworks:  # every framework's GPU before any measurement
        modules[fw] = _tune_module(fw)
        try:
            modules[fw].require_gpu()
        except modules[fw].NoGPUError as exc:
            print(f"epmoe tune: {exc}", file=sys.stderr)
            return 2
    deadline = tuning.Deadline(args.max_minutes)
    for fw in frameworks:
        mod = modules[fw]
        spec = mod.device_spec()
        path = os.path.abspath(args.out) if args.out else tuning.tuned_table_path(fw, spec.arch, spec.kind)
        try:  # a broken stored table stops here, before the GPU time is spent
            kept = selection.read_table(path, spec.arch, spec.kind, mod.check_entry)
        except ValueError as exc:
            print(f"epmoe tune: {exc}; fix or remove that file", file=sys.stderr)
            return 2
        print(f"epmoe tune: {fw} on {spec.describe()}: {len(kept)} stored entries in {path}", flush=True)
        written: list[dict] = []

        def write(entry: dict, path=path, spec=spec, mod=mod, written=written) -> None:
            written.append(entry)
            tuning.write_tuned_table(path, written, spec.arch, spec.kind, mod.check_entry)

        kw = dict(routings=args.routings, deadline=deadline, on_entry=write)
        try:
            entries = mod.tune(shapes, args.ms, args.dtypes, args.ops, **kw)
        except (RuntimeError, ValueError) as exc:
            print(f"epmoe tune: {fw}: {exc}", file=sys.stderr)
            return 1
        for line in mod.summary(entries):
            print(line)
        if fw == "torch" and "jax" in frameworks:
            import torch

            torch.cuda.empty_cache()  # the JAX tuner's arrays next
        print(f"epmoe tune: wrote {len(entries)} {fw} entries to {path}" if entries
              else f"epmoe tune: no {fw} entry measured; {path} not written", flush=True)
    return 0


def _add_input_args(parser: argparse.ArgumentParser, preset_help: str) -> None:
    """The options that say which random inputs to build, shared by ``demo`` and ``check``."""
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help=preset_help)
    parser.add_argument("--tokens", type=int, default=16, help="T, tokens in the batch")
    parser.add_argument("--quant", default="none", type=_quant_arg, choices=QUANTS,
                        help="layer quantization mode (dashes or underscores: fp8-block = fp8_block)")
    parser.add_argument("--routing", default="uniform", type=_routing_arg, choices=ROUTING_SKEWS,
                        help="skew of the random router logits (the gate algorithm itself comes from the preset)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends an option's default to its help, except where the help states it already (said twice otherwise) or
    where there is none to state (None: not given; a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


def _add_layer_options(parser: argparse.ArgumentParser, note: str = "") -> None:
    """:data:`LAYER_OPTIONS` as a group of ``parser`` (``demo`` and ``check``): left out of the namespace when not
    given, so that the preset's value stays."""
    layer = parser.add_argument_group(
        "layer options", f"override the preset's layer{note}: its shapes (any preset runs on a CPU once small "
        "enough, e.g. --hidden-size 64 --intermediate-size 32 --num-experts 16) and its semantics")
    for field, option, kind, what in LAYER_OPTIONS:
        if kind is bool:
            layer.add_argument(option, dest=field, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=what + " (default: the preset's)")
        else:
            choices = {"activation": ACTIVATIONS, "gate_up_layout": GATE_UP_LAYOUTS, "w4_layout": W4_LAYOUTS}.get(field)
            layer.add_argument(option, dest=field, type=kind, default=argparse.SUPPRESS, choices=choices,
                               metavar=None if choices else what.split(",")[0].split()[0],
                               help=what + " (default: the preset's)")


def _version() -> str:
    """The installed package's version (its metadata); from a source tree never installed, pyproject.toml's."""
    from importlib import metadata

    try:
        return metadata.version("epmoe")
    except metadata.PackageNotFoundError:
        import tomllib

        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
        try:
            with open(path, "rb") as f:
                return tomllib.load(f)["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown (not installed, and no pyproject.toml beside the sources)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epmoe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"epmoe {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run the reference MoE layer of a preset in jnp and torch and compare",
        description="Run the reference MoE layer of a model preset in jnp and torch on the same random "
        "inputs; print what they computed and their difference; exit 1 if they disagree.",
        formatter_class=_HelpFormatter,
    )
    _add_input_args(demo, "model preset (all but 'tiny' need tens of GB at full size: a GPU machine, or shrink "
                          "one with the layer options)")
    demo.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="activation and weight dtype")
    _add_layer_options(demo)
    demo.set_defaults(func=run_demo)

    from interop.crosscheck import IMPLEMENTATIONS as CHECK_IMPLEMENTATIONS

    check = sub.add_parser(
        "check",
        help="cross-check jnp, torch, Pallas and Triton stage by stage against the contract (the main job)",
        description="Build one set of inputs (a preset's random weights, or --weights from a checkpoint) and run "
        "them through the jnp reference, the torch reference, the Pallas kernels and the Triton kernels stage "
        "by stage (gate, routing metadata, permute+quant, GEMM 1, activation+quant, GEMM 2, combine, and the "
        "whole layer), every implementation fed the jnp reference's output of the previous stage. Prints a "
        "table per stage and pair, judged by CONTRACT.md section 7; exit 1 names the violating stage(s), "
        "2 on bad arguments or a layer the check cannot take. Without a GPU the kernels run interpreted (the tiny "
        "preset, or any preset shrunk by the layer options, at most 16.8M weight elements). With --ep-size N > 1: "
        "every implementation runs every rank's experts end to end and the N partial outputs, summed in float32, "
        "are judged against its single-device layer and the other implementations' sums (and JAX's multi-device "
        "ep_moe_forward where jax has N devices); --ep-rank r adds rank r's stage-by-stage table.",
        formatter_class=_HelpFormatter,
    )
    _add_input_args(check, "model preset (default: tiny; CPU: tiny, or any preset made small by the layer "
                           "options); with --weights only for a checkpoint "
                           "without config.json, whose routing (topk, groups, rsf) it then gives")
    for action in check._actions:  # left out when not given: run_check tells given from default
        if action.dest in ("preset", "quant"):
            action.default = argparse.SUPPRESS
        if action.dest == "quant":
            action.help += "; default: none, with --weights the checkpoint's (fp8_block for an FP8 checkpoint)"
    _add_layer_options(check, " (not with --weights)")
    check.add_argument("--ep-size", type=int, default=1, help="expert-parallel ranks (E must divide)")
    check.add_argument("--ep-rank", type=int, default=None,
                       help="with --ep-size N > 1: also check this rank's experts and partial sum stage by stage "
                            "(default: no per-rank stage table; the EP summary of all ranks always runs)")
    check.add_argument("--ep-dtype", default="float32", choices=("float32", "bfloat16"),
                       help="with --ep-size N > 1: input dtype of the EP summary (every rank's layer end to end, summed "
                            "in float32, vs the single device: float32 rounding with float32 inputs, the bf16 rule "
                            "with bf16); the real multi-device JAX path joins where jax has N devices")
    check.add_argument("--backward", action="store_true",
                       help="also the backward, judged by CONTRACT.md section 8: each backward stage (combine, GEMM 2 "
                            "dgrad / wgrad, activation, GEMM 1 dgrad / wgrad, permute, gate: d_y, d_topk_weights, d_a, "
                            "d_w2, d_h, d_xp, d_w13, d_x, d_router_logits; the 2026 families also slot_weights_bwd, "
                            "scaled_slot_rows_bwd, gemm*_dbias) fed the reference's upstream gradient, and "
                            "the whole layer's gradients for a seeded random d_out; FP8 layers: straight-through, no "
                            "weight gradients; with --ep-size N > 1 the EP summary adds the ranks' gradients (d_x, "
                            "d_router_logits summed, weight gradients as slices) vs the single device")
    check.add_argument("--json", metavar="PATH", help="also write every comparison as JSON to PATH (its folder must "
                       "exist); '-': to standard output, the report then going to standard error")
    check.add_argument("--weights", metavar="PATH",
                       help="a safetensors checkpoint (file or folder with model.safetensors.index.json) of a "
                            "Mixtral, Qwen3-MoE, DeepSeek-V3 (bf16 or FP8), Kimi K2, GLM-4.5, Qwen3-Next, Llama 4 "
                            "or gpt-oss (MXFP4 as stored) model: one MoE layer's weights; the "
                            "routing from its config.json, read as transformers reads it (without one: --preset)")
    check.add_argument("--inputs", metavar="FILE", default=argparse.SUPPRESS,
                       help="a safetensors file with x [T, H] (and optionally router_logits [T, E]; without them, "
                            "x @ the --weights router weight) to check on instead of random inputs; T is x's rows "
                            "(--tokens is not used)")
    check.add_argument("--layer", type=int, default=argparse.SUPPRESS,
                       help="with --weights: the layer index (default: the first MoE layer)")
    check.add_argument("--implementations", metavar="LIST", default=argparse.SUPPRESS,
                       help="comma list among " + ", ".join(CHECK_IMPLEMENTATIONS) + " (default: the four; on a "
                            "GPU also pallas_mosaic_gpu); the jnp reference always runs, and each kernel's own "
                            "framework reference is added (its judge); duplicates are dropped")
    check.add_argument("--verbose", action="store_true", help="print each unit of work when not on a terminal")
    check.set_defaults(func=run_check)

    bench = sub.add_parser(
        "bench",
        help="the benchmarks (benchmarks/bench.py; a GPU machine; --tiny: CPU smoke test)",
        description="Forwards every argument to benchmarks/bench.py (`epmoe bench -- --help` lists them), e.g. "
        "`epmoe bench --quick`, `epmoe bench --preset mixtral-8x7b` (that model's shapes and routing, its "
        "transformers block as the layer's peer) or `epmoe bench --weights PATH` (one MoE layer of a Mixtral, "
        "Qwen3-MoE or DeepSeek-V3 safetensors checkpoint: its shapes for every spec, its weights for the layer "
        "rows, compared against transformers' block of that model). Needs a GPU; `--tiny` is a CPU smoke test "
        "(kernels interpreted; with --preset tiny or a tiny checkpoint).",
        add_help=False,
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=run_bench)

    from moe_contract import tuning

    tune = sub.add_parser(
        "tune",
        help="measure the grouped GEMMs' launch configs of a model's layer on this GPU (the user's tuned table)",
        description="Time the grouped GEMM launch configs of one MoE layer (gate_up: N = 2 x intermediate, "
        "K = hidden; down: N = hidden, K = intermediate; over the experts of one rank) on the GPU it runs on, each "
        "checked against the float32 reference (torch forward: the heuristic config's output) before it is timed, "
        "and merge the winners into the user's table of this device, <user cache>/tuned/<framework>/<arch>/"
        "<device kind>.json (EPMOE_CACHE_DIR, else the platform's cache folder), which the kernels read before "
        "the tables shipped with the package; an entry of the same op, dtype, N, K, M and backend is replaced. "
        "Needs a CUDA GPU (--dry-run does not).",
        formatter_class=_HelpFormatter,
    )
    source = tune.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(PRESETS), default=None, help="the layer of a model preset")
    source.add_argument("--weights", metavar="DIR", type=_weights_arg, default=None,
                        help="a checkpoint folder: the layer's sizes from its config.json")
    tune.add_argument("--framework", choices=("torch", "jax", "both"), default="both",
                      help="whose kernels: torch (Triton), jax (Pallas-Triton and Mosaic GPU) or both")
    tune.add_argument("--dtypes", type=_list_arg(tuning.parse_dtypes), default=",".join(tuning.DTYPES),
                      metavar="LIST", help="comma list of " + ", ".join(tuning.DTYPES))
    tune.add_argument("--ms", type=_list_arg(tuning.parse_ms), default=",".join(map(str, tuning.DEFAULT_MS)), metavar="LIST",
                      help="comma list of M, the rows of all the rank's experts together")
    tune.add_argument("--ops", type=_list_arg(tuning.parse_ops), default="fwd", metavar="LIST",
                      help="comma list of fwd, dgrad, wgrad (the backward: bf16 only)")
    tune.add_argument("--routings", type=_list_arg(tuning.parse_routings), default="uniform", metavar="LIST",
                      help="comma list of uniform, zipf: rank the configs by the mean of their times over these "
                           "rows-per-expert splits")
    tune.add_argument("--ep-size", type=int, default=1, help="expert-parallel ranks: E = the model's experts / this")
    tune.add_argument("--max-minutes", type=_minutes_arg, default=None,
                      help="start no config after this many minutes (what was measured is written)")
    tune.add_argument("--out", metavar="PATH", default=None,
                      help="write this .json table instead of the user's (one framework)")
    tune.add_argument("--dry-run", action="store_true", help="print the shapes and the destination; measure nothing")
    tune.set_defaults(func=run_tune, tune_parser=tune)
    return parser


def main(argv: list[str] | None = None) -> int:
    # On a GPU, JAX and torch share the device: no JAX preallocation (75% of its memory by default).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "bench":  # everything after `bench` belongs to benchmarks/bench.py
        return run_bench(argparse.Namespace(bench_args=argv[1:]))
    # check: JAX memory goes back to the device when freed (not kept in JAX's pool), so that the torch
    # stages fit beside it at full model size (timing does not matter here; tune's does).
    if not argv or argv[0] != "tune":
        os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    args = build_parser().parse_args(argv)
    problem = None
    if args.command == "tune":
        if args.ep_size < 1:
            args.tune_parser.error(f"argument --ep-size: must be >= 1; got {args.ep_size}")
        return args.func(args)
    if args.command == "check" and args.ep_size < 1:
        problem = f"--ep-size must be >= 1; got {args.ep_size}"
    elif args.command == "check" and args.ep_rank is not None and not 0 <= args.ep_rank < args.ep_size:
        problem = f"--ep-rank must be in [0, --ep-size={args.ep_size}); got {args.ep_rank}"
    elif args.tokens < 1:
        problem = f"--tokens must be >= 1; got {args.tokens}"
    elif args.seed < 0:
        problem = f"--seed must be >= 0; got {args.seed}"
    if problem:
        print(f"epmoe {args.command}: {problem}", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
