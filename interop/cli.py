"""epmoe: the project's command line.

`epmoe demo` runs the reference MoE layer of a model preset in both frameworks (jnp and
torch) on the same random inputs and prints what they computed and how far apart they are.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from moe_contract import PRESETS, get_preset, make_layer_inputs
from moe_contract.config import QUANTS
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


def _host_bytes_available() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


def run_demo(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp
    import torch

    import moe_pallas
    import moe_torch

    preset = get_preset(args.preset)
    config = preset.config(quant=args.quant)
    need, have = _host_bytes_needed(config), _host_bytes_available()
    if 2 * need > have:  # the weights, plus a converted copy per framework
        print(f"epmoe: preset {preset.name} needs about {2 * need / 2**30:.0f} GiB of host memory for its weights "
              f"({have / 2**30:.0f} GiB available); use --preset tiny here, or a larger machine", file=sys.stderr)
        return 2
    inputs = make_layer_inputs(config, args.tokens, seed=args.seed, routing=args.routing)
    jdt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"preset {preset.name}: H={config.hidden_size} I={config.intermediate_size} E={config.num_experts} "
          f"topk={config.topk} routing={config.routing} rsf={config.routed_scaling_factor} "
          f"shared={config.num_fused_shared_experts} quant={config.quant} dtype={args.dtype}")
    print(f"T={args.tokens} routing skew={args.routing} seed={args.seed}; jax on {jax.default_backend()}, torch on {device}")

    outs = {}
    # jnp reference
    t0 = time.perf_counter()
    jw13, jw2 = jnp.asarray(inputs.w13, jdt), jnp.asarray(inputs.w2, jdt)
    w13, s13, w2, s2 = moe_pallas.quantize_layer_weights(jw13, jw2, config)
    fwd = jax.jit(moe_pallas.moe_forward, static_argnames=("config",))
    bias = jnp.asarray(inputs.e_score_correction_bias) if config.routing == "biased_grouped_topk" else None
    out_j = fwd(jnp.asarray(inputs.x, jdt), jnp.asarray(inputs.router_logits), w13, w2, config,
                w13_scale=s13, w2_scale=s2, e_score_correction_bias=bias)
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
    out_t = moe_torch.moe_forward(torch.from_numpy(inputs.x).to(device, tdt), torch.from_numpy(inputs.router_logits).to(device),
                                  w13, w2, config, w13_scale=s13, w2_scale=s2, e_score_correction_bias=tbias)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epmoe", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run the reference MoE layer of a preset in jnp and torch and compare",
        description="Run the reference MoE layer of a model preset in jnp and torch on the same random "
        "inputs; print what they computed and their difference; exit 1 if they disagree.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                      help="model preset (all but 'tiny' need tens of GB: a GPU machine)")
    demo.add_argument("--tokens", type=int, default=16, help="T, tokens in the batch")
    demo.add_argument("--quant", default="none", choices=QUANTS, help="layer quantization mode")
    demo.add_argument("--routing", default="uniform", choices=ROUTING_SKEWS,
                      help="skew of the random router logits (the gate algorithm itself comes from the preset)")
    demo.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="activation and weight dtype")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    demo.set_defaults(func=run_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tokens < 1:
        print(f"epmoe: --tokens must be >= 1; got {args.tokens}", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
