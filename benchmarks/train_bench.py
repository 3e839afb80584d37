"""End-to-end training benchmark: a small MoE decoder built from transformers' own classes, trained for a fixed
number of AdamW steps three ways, with tokens per second, MFU, peak memory and every step's loss.

Usage (from the repo root)::

    PYTHONPATH=. python3 benchmarks/train_bench.py                       # a GPU: both architectures, bf16
    PYTHONPATH=. python3 benchmarks/train_bench.py --arch qwen3_moe --layers 4 --steps 30 --runs hf,moe_torch
    PYTHONPATH=. python3 benchmarks/train_bench.py --tiny                # the CPU smoke test (float32, seconds)

The model: ``Qwen3MoeForCausalLM`` (``--arch qwen3_moe``) and / or ``DeepseekV3ForCausalLM`` (``--arch deepseek_v3``),
made with ``AutoModelForCausalLM.from_config`` from a config of the sizes given (default 8 layers, hidden 2048,
64 experts, top-8, expert intermediate 1024, vocabulary 32768; every size is an option), random init seeded
(transformers' own ``_init_weights``, ``initializer_range`` 0.02), on the device, in ``--dtype`` (bf16; DeepSeek-V3's
router weight and correction bias stay float32, as transformers keeps them). The data: seeded synthetic tokens, a
random Markov chain over the vocabulary in which every token has two equally likely successors, so the loss starts
near ``ln V`` and can fall towards ``ln 2``; batch ``[B, S + 1]``, inputs ``[:, :-1]``, next-token targets ``[:, 1:]``;
the same batches for every run.

The runs (``--runs``), each from the same initial weights (the state dict of a seeded model built before them,
copied to the host):

- ``hf``: transformers as it is, ``experts_implementation="grouped_mm"`` (``torch.nn.functional.grouped_mm``). Where
  that op cannot run for the device and dtype (a probe call fails, or transformers would use its slow fallback
  loop) the run uses ``"eager"`` and its ``notes`` say so.
- ``moe_torch``: the same model patched with ``moe_torch.patch_hf_model`` (``--implementation``: the library's
  default, Triton on CUDA, the reference on a CPU).
- ``moe_pallas``: the same architecture in flax NNX (attention, norms and dense MLPs from
  ``examples/jax_hf_model.py``, the MoE blocks :class:`moe_pallas.MoEBlock` with the shared experts fused), built
  from the same initial weights, trained with ``optax.adamw`` in one ``nnx.jit`` step (``--jax-implementation``).
  Its attention is that example's (scores and softmax in float32 through XLA), not a fused kernel: on a GPU its
  time includes that difference from torch's SDPA.

Optimizer: AdamW (``--lr``, betas (0.9, 0.95), eps 1e-8, ``--weight-decay``) over every trainable parameter, in the
parameters' dtype (torch's states as its parameters; ``fused=True`` on CUDA), the same rule in optax.

Loss: the mean next-token cross-entropy (float32 logits) plus the router's auxiliary loss times ``--aux-coef``:

- Qwen3-MoE: transformers' own, ``output_router_logits=True`` and ``aux_loss`` of ``Qwen3MoeForCausalLM``
  (``load_balancing_loss_func``: Switch's ``E * sum_e f_e * P_e`` over every layer's tokens together, ``f_e`` the
  fraction of tokens routed to ``e``, which makes it ``topk`` times the per-slot form); default coefficient
  transformers' ``router_aux_loss_coef`` (0.001). The JAX run computes the same formula
  (:func:`hf_load_balancing_loss`) from its layers' logits and the gate's counts.
- DeepSeek-V3: transformers has no auxiliary loss for it, so the library's router losses: the sum over MoE layers
  of the sequence-wise loss ``seq_aux_loss`` (DeepSeek-V3 report, section 2.1.2) of ``router_losses``; default
  coefficient 1e-4 (the report's). ``hf`` computes it with ``moe_torch.router_losses`` from the logits and ids its
  routers return (forward hooks), ``moe_torch`` from ``patch_hf_model(record_router_losses=True)`` (the library gate's
  ids), ``moe_pallas`` from ``MoEBlock(..., return_router_losses=True)``.

Measured per run: ``tokens_per_s`` = ``B * S`` tokens per step over the mean wall time of the steps after
``--warmup`` (each step ends synchronised: its loss is read back), ``mfu`` = ``tokens_per_s * flops_per_token /
peak``, ``peak_mem_gib`` (torch: ``torch.cuda.max_memory_allocated`` of the run; JAX: the device's
``memory_stats()["peak_bytes_in_use"]``; None on a CPU), ``losses`` (every step's total loss, before its update)
and ``aux_losses`` (the unscaled auxiliary loss).

Model FLOPs per token (:func:`flops_per_token`): ``6 * N_active + 6 * L * n_heads * S * (d_qk + d_v)``. ``N_active``
is the number of weights of every matmul one token goes through: the attention projections, the router, the
shared and dense MLPs and ``lm_head`` in full, the routed experts' ``gate_up_proj`` / ``down_proj`` times
``topk / E`` (the token's ``topk`` experts), not the embedding (a lookup) nor the norms; 6 = 2 FLOPs per
multiply-add times forward + backward (the backward twice the forward). The second term is the attention's
scores and weighted sum (``QK^T`` and ``PV``, ``S`` keys per query: causality not discounted, PaLM's convention),
``d_qk`` / ``d_v`` the head sizes (DeepSeek-V3: ``qk_nope + qk_rope`` and ``v_head_dim``). ``peak``: the dense bf16
tensor-core peak of the device (:data:`PEAK_BF16_TFLOPS`, by device name); MFU is None for other dtypes, on a CPU
and on devices not in the table.

The check: the ``hf`` and ``moe_torch`` loss curves must agree step by step, ``max_s |L_hf - L_ours| / |L_hf|``
within ``--loss-rtol`` (default: bf16 ``moe_contract.tolerances.BF16_REL_FRO`` = 1e-2, float32 1e-4): PASS or FAIL,
printed and written; the ``moe_pallas`` curve is compared with ``hf``'s the same way (printed and written too; in
bf16 its optimizer arithmetic is optax's, not torch's fused AdamW's, so it is information, not the gate). Exit status
1 if the torch check fails.

Writes ``train_bench.json`` (``meta``: date, command, git commit, device, versions; ``runs``: one object per run;
``checks``) and ``train_bench.md`` (the table, the checks, the per-step losses) to ``--out`` (default ``$OUT``,
else ``benchmarks/results/<date>_train``; with ``--tiny`` ``epmoe_train_bench_tiny`` in the temporary directory),
and prints the markdown.
"""

from __future__ import annotations

import os
import sys

if "--tiny" in sys.argv:  # the CPU smoke test: keep JAX off any GPU (set before jax is imported)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch (the JAX run comes last)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moe_contract.tolerances import BF16_REL_FRO  # noqa: E402

ARCHS = ("qwen3_moe", "deepseek_v3")
RUNS = ("hf", "moe_torch", "moe_pallas")
DTYPES = ("bfloat16", "float32")

#: Dense bf16 tensor-core peak, TFLOP/s, of the devices MFU is reported for: the first entry whose key is in the
#: device's name (torch.cuda.get_device_name / jax device_kind) wins, so the specific keys come first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.0),  # and GH200
    ("H800", 989.0),
    ("A100", 312.0),
    ("B200", 2250.0),
)

#: The sizes and settings of a run without ``--tiny`` (the DeepSeek-V3 ones: its latent attention, groups, shared and
#: dense layers; the Qwen3-MoE ones: its key/value heads and head size).
DEFAULTS = dict(layers=8, hidden=2048, experts=64, topk=8, moe_intermediate=1024, intermediate=None, heads=16,
                kv_heads=4, head_dim=128, vocab=32768, seq=2048, batch=4, steps=20, warmup=3, dtype="bfloat16",
                n_group=8, topk_group=4, shared_experts=1, dense_layers=0, q_lora_rank=768, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, lr=3e-4, weight_decay=0.1)
#: ``--tiny``: sizes a loaded 2-core CPU trains in seconds (explicit options still override them).
TINY = dict(layers=2, hidden=64, experts=8, topk=2, moe_intermediate=32, intermediate=128, heads=4, kv_heads=2,
            head_dim=16, vocab=64, seq=16, batch=2, steps=3, warmup=1, dtype="float32", n_group=4, topk_group=2,
            q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, lr=3e-3,
            device="cpu")
#: Default auxiliary-loss coefficients: transformers' Qwen3-MoE ``router_aux_loss_coef``; DeepSeek-V3's report.
AUX_COEF = {"qwen3_moe": 1e-3, "deepseek_v3": 1e-4}
#: Loss-curve agreement (max relative difference over the steps) by dtype. bf16: the contract's bf16 tolerance.
#: float32: the runs differ in summation order only (1e-7 at --tiny); AdamW's normalised steps may grow that over
#: many steps, so a margin of 1e-4.
LOSS_RTOL = {"bfloat16": BF16_REL_FRO, "float32": 1e-4}
BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8


# ---------------------------------------------------------------------------------------------- arguments


def _positive(name: str, value) -> str | None:
    return None if isinstance(value, int) and value >= 1 else f"--{name.replace('_', '-')} must be >= 1; got {value}"


def parse_args(argv=None) -> argparse.Namespace:
    """The options (module docstring); ``--tiny`` sets :data:`TINY`'s values unless given explicitly. Refuses
    inconsistent sizes with ``SystemExit(2)`` and a message naming the option."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Writes train_bench.json and train_bench.md to --out.")
    p.add_argument("--tiny", action="store_true", help="the CPU smoke test: 2 layers, hidden 64, 8 experts, top-2, "
                   "seq 16, batch 2, 3 steps, float32")
    p.add_argument("--arch", default=",".join(ARCHS), help=f"comma list of {', '.join(ARCHS)} (default: both)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)} (default: all)")
    p.add_argument("--layers", type=int, help="decoder layers (default 8)")
    p.add_argument("--hidden", type=int, help="hidden size H (default 2048)")
    p.add_argument("--experts", type=int, help="routed experts E (default 64)")
    p.add_argument("--topk", type=int, help="experts per token (default 8)")
    p.add_argument("--moe-intermediate", type=int, help="expert intermediate size I (default 1024)")
    p.add_argument("--intermediate", type=int, help="dense MLP intermediate size (DeepSeek-V3's --dense-layers; "
                   "default 4 * hidden)")
    p.add_argument("--heads", type=int, help="attention heads (default 16)")
    p.add_argument("--kv-heads", type=int, help="Qwen3-MoE key/value heads (default 4)")
    p.add_argument("--head-dim", type=int, help="Qwen3-MoE head size (default 128)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default 32768)")
    p.add_argument("--seq", type=int, help="sequence length S (default 2048)")
    p.add_argument("--batch", type=int, help="sequences per step B (default 4)")
    p.add_argument("--steps", type=int, help="training steps (default 20)")
    p.add_argument("--warmup", type=int, help="steps left out of the timing (default 3; compilation happens there)")
    p.add_argument("--dtype", choices=DTYPES, help="parameters and activations (default bfloat16; --tiny float32)")
    p.add_argument("--n-group", type=int, help="DeepSeek-V3 expert groups (default 8)")
    p.add_argument("--topk-group", type=int, help="DeepSeek-V3 groups a token may use (default 4)")
    p.add_argument("--shared-experts", type=int, help="DeepSeek-V3 shared experts (default 1)")
    p.add_argument("--dense-layers", type=int, help="DeepSeek-V3 first_k_dense_replace (default 0: every layer MoE)")
    p.add_argument("--q-lora-rank", type=int, help="DeepSeek-V3 (default 768)")
    p.add_argument("--kv-lora-rank", type=int, help="DeepSeek-V3 (default 512)")
    p.add_argument("--qk-nope-head-dim", type=int, help="DeepSeek-V3 (default 128)")
    p.add_argument("--qk-rope-head-dim", type=int, help="DeepSeek-V3 (default 64)")
    p.add_argument("--v-head-dim", type=int, help="DeepSeek-V3 (default 128)")
    p.add_argument("--lr", type=float, help="AdamW learning rate (default 3e-4; --tiny 3e-3)")
    p.add_argument("--weight-decay", type=float, help="AdamW weight decay (default 0.1)")
    p.add_argument("--aux-coef", type=float, default=None,
                   help="auxiliary-loss coefficient (default: Qwen3-MoE 1e-3, DeepSeek-V3 1e-4; 0 turns it off)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and data (default 0)")
    p.add_argument("--device", default=None, help="torch device (default cuda if available, else cpu; --tiny cpu)")
    p.add_argument("--implementation", default=None,
                   help="moe_torch backend (default: the library's: Triton on CUDA, the reference on a CPU)")
    p.add_argument("--jax-implementation", default=None,
                   help="moe_pallas backend (default: the library's: the fastest kernels on a GPU, the reference "
                        "on a CPU)")
    p.add_argument("--loss-rtol", type=float, default=None,
                   help="loss-curve agreement, max relative difference (default bf16 1e-2, float32 1e-4)")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else benchmarks/results/<date>_train; "
                   "--tiny: a folder under the system's temporary directory)")
    args = p.parse_args(argv)
    base = dict(DEFAULTS, device="cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        base.update(TINY)
    for name, value in base.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.intermediate is None:
        args.intermediate = 4 * args.hidden
    if args.out is None:  # a CPU smoke test's numbers do not belong among the results
        args.out = os.environ.get("OUT") or (
            os.path.join(tempfile.gettempdir(), "epmoe_train_bench_tiny") if args.tiny else
            os.path.join(_ROOT, "benchmarks", "results", f"{datetime.date.today().isoformat()}_train"))

    args.arch = [a for a in args.arch.split(",") if a]
    args.runs = [r for r in args.runs.split(",") if r]
    if not args.arch or [a for a in args.arch if a not in ARCHS]:
        p.error(f"--arch: a comma list of {ARCHS}; got {','.join(args.arch) or 'nothing'}")
    if not args.runs or [r for r in args.runs if r not in RUNS]:
        p.error(f"--runs: a comma list of {RUNS}; got {','.join(args.runs) or 'nothing'}")
    if len(set(args.arch)) != len(args.arch) or len(set(args.runs)) != len(args.runs):
        p.error("--arch / --runs: each name once")
    sizes = ("layers", "hidden", "experts", "topk", "moe_intermediate", "intermediate", "heads", "kv_heads", "head_dim",
             "vocab", "seq", "batch", "steps", "n_group", "topk_group", "shared_experts", "q_lora_rank", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    for name in sizes:
        msg = _positive(name, getattr(args, name))
        if msg:
            p.error(msg)
    if args.warmup < 0 or args.warmup >= args.steps:
        p.error(f"--warmup must be in [0, --steps) so that at least one step is timed; got --warmup {args.warmup} "
                f"with --steps {args.steps}")
    if args.topk > args.experts:
        p.error(f"--topk ({args.topk}) must be at most --experts ({args.experts})")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.qk_rope_head_dim % 2:
        p.error(f"--qk-rope-head-dim must be even (rotary pairs); got {args.qk_rope_head_dim}")
    if args.head_dim % 2:
        p.error(f"--head-dim must be even (rotary pairs); got {args.head_dim}")
    if "deepseek_v3" in args.arch:
        if args.experts % args.n_group:
            p.error(f"--experts ({args.experts}) must be a multiple of --n-group ({args.n_group}) for deepseek_v3")
        if args.experts // args.n_group < 2:
            p.error(f"deepseek_v3 scores a group by its top-2 experts: --experts / --n-group must be >= 2; got "
                    f"{args.experts} / {args.n_group}")
        if args.topk_group > args.n_group:
            p.error(f"--topk-group ({args.topk_group}) must be at most --n-group ({args.n_group})")
        if args.topk > args.topk_group * (args.experts // args.n_group):
            p.error(f"--topk ({args.topk}) must be at most --topk-group * experts per group "
                    f"({args.topk_group} * {args.experts // args.n_group}) for deepseek_v3")
        if not 0 <= args.dense_layers < args.layers:
            p.error(f"--dense-layers must be in [0, --layers) (at least one MoE layer); got {args.dense_layers}")
    for name in ("lr", "weight_decay"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v >= 0) or (name == "lr" and v == 0):
            p.error(f"--{name.replace('_', '-')} must be a finite number {'> 0' if name == 'lr' else '>= 0'}; got {v}")
    if args.aux_coef is not None and not (math.isfinite(args.aux_coef) and args.aux_coef >= 0):
        p.error(f"--aux-coef must be a finite number >= 0; got {args.aux_coef}")
    if args.loss_rtol is not None and not (math.isfinite(args.loss_rtol) and args.loss_rtol > 0):
        p.error(f"--loss-rtol must be a finite number > 0; got {args.loss_rtol}")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        p.error(f"--device: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch sees no CUDA device here")
    if device.type not in ("cuda", "cpu"):
        p.error(f"--device must be cuda or cpu; got {args.device}")
    return args


# ---------------------------------------------------------------------------------------------- the model and data


def hf_config(arch: str, args: argparse.Namespace):
    """The transformers config of ``arch`` with the run's sizes (attention: transformers' default, SDPA)."""
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                  moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_experts_per_tok=args.topk, norm_topk_prob=True,
                  max_position_embeddings=args.seq, tie_word_embeddings=False, use_cache=False)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                              num_experts=args.experts, router_aux_loss_coef=aux_coef(arch, args),
                              output_router_logits=True)
    # num_key_value_heads: DeepseekV3Config defaults it to 128, whatever the heads (its attention needs them equal)
    return DeepseekV3Config(**common, num_key_value_heads=args.heads, n_routed_experts=args.experts,
                            n_shared_experts=args.shared_experts,
                            n_group=args.n_group, topk_group=args.topk_group, first_k_dense_replace=args.dense_layers,
                            q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
                            qk_nope_head_dim=args.qk_nope_head_dim, qk_rope_head_dim=args.qk_rope_head_dim,
                            v_head_dim=args.v_head_dim)


def aux_coef(arch: str, args: argparse.Namespace) -> float:
    return AUX_COEF[arch] if args.aux_coef is None else args.aux_coef


def make_batches(vocab: int, batch: int, seq: int, steps: int, seed: int) -> np.ndarray:
    """``[steps, B, S + 1]`` int64 token ids: a random Markov chain in which every token has two equally likely
    successors (a table drawn from ``seed``), each sequence from a random first token; seeded, so every run and
    framework sees the same batches."""
    rng = np.random.default_rng((seed, 20_251))
    table = rng.integers(0, vocab, size=(vocab, 2))  # successors may repeat: the floor is then below ln 2
    ids = np.empty((steps, batch, seq + 1), np.int64)
    ids[:, :, 0] = rng.integers(0, vocab, (steps, batch))
    coins = rng.integers(0, 2, (steps, batch, seq))
    for t in range(seq):
        ids[:, :, t + 1] = table[ids[:, :, t], coins[:, :, t]]
    return ids


def build_hf_model(arch: str, args: argparse.Namespace, experts_implementation: str, *, seed: int | None):
    """``AutoModelForCausalLM.from_config`` on the device in the run's dtype (transformers keeps DeepSeek-V3's router
    in float32), in training mode; ``seed``: the init's torch seed (None: whatever the generator holds)."""
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(args.device):  # initialised where it trains: no host-side init of large weights
        model = AutoModelForCausalLM.from_config(hf_config(arch, args), dtype=getattr(torch, args.dtype),
                                                 experts_implementation=experts_implementation)
    return model.train()


def flops_per_token(model, arch: str, args: argparse.Namespace) -> tuple[float, int]:
    """``(6 * N_active + attention, N_active)`` (module docstring) from the model's parameters: routed experts'
    ``gate_up_proj`` / ``down_proj`` counted ``topk / E``, the embedding and every 1-D parameter (norms) left out."""
    active = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.endswith("embed_tokens.weight"):
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            active += p.numel() * args.topk / args.experts
        else:
            active += p.numel()
    if arch == "deepseek_v3":
        d_qk, d_v = args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
    else:
        d_qk = d_v = args.head_dim
    attention = 6.0 * args.layers * args.heads * args.seq * (d_qk + d_v)
    return 6.0 * active + attention, int(round(active))


def peak_tflops(device_name: str | None, dtype: str) -> float | None:
    """The device's dense bf16 peak (:data:`PEAK_BF16_TFLOPS`), or None (not bf16, a CPU, or not in the table)."""
    if dtype != "bfloat16" or not device_name:
        return None
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


def hf_experts_implementation(device: str, dtype: str) -> tuple[str, str | None]:
    """``("grouped_mm", None)`` when transformers' grouped_mm experts would run torch's grouped GEMM on this device
    and dtype (forward and backward of a probe call succeed); else ``("eager", why)``."""
    try:
        from transformers.integrations import moe as hf_moe

        dt = getattr(torch, dtype)
        x = torch.randn(8, 16, device=device, dtype=dt, requires_grad=True)
        w = torch.randn(2, 16, 32, device=device, dtype=dt, requires_grad=True)
        offs = torch.tensor([3, 8], device=device, dtype=torch.int32)
        can = getattr(hf_moe, "_can_use_grouped_mm", None)
        if can is not None and not can(x, w, offs):
            return "eager", (f"grouped_mm unavailable on {device} / {dtype} (transformers would run its fallback "
                             f"loop): the hf run uses experts_implementation='eager'")
        op = torch.nn.functional.grouped_mm if hasattr(torch.nn.functional, "grouped_mm") else torch._grouped_mm
        y = op(x, w, offs=offs)
        y.backward(torch.ones_like(y))  # a dense gradient: sum()'s is an expanded view, which the op refuses
    except Exception as exc:  # any failure of the probe: the run still happens, on the eager loop
        return "eager", (f"grouped_mm unavailable on {device} / {dtype} ({type(exc).__name__}: {str(exc)[:200]}): "
                         f"the hf run uses experts_implementation='eager'")
    return "grouped_mm", None


# ---------------------------------------------------------------------------------------------- torch runs


class RouterHooks:
    """Forward hooks on transformers' routers (``DeepseekV3TopkRouter``: it returns ``(logits, weights, ids)``)
    keeping each call's logits and ids, for the library's router losses of the unpatched model."""

    def __init__(self, model, router_class: str) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules()
                        if type(m).__name__ == router_class]

    def _hook(self, module, inputs, output) -> None:
        self.calls.append((output[0], output[2]))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def moe_layer_configs(model) -> list:
    """The :class:`moe_contract.MoEConfig` of every supported MoE block of a transformers model, in order (the
    routing ``router_losses`` reads)."""
    from moe_torch.hf import read_block, supported_block_name

    return [read_block(m).config for m in model.modules() if supported_block_name(m) is not None]


def torch_sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def initial_state(arch: str, args) -> tuple[dict, float, int]:
    """Every run's initial weights: a seeded transformers model's state dict, copied to the host (the model is freed
    before any run), with its FLOPs per token and active matmul weights (:func:`flops_per_token`)."""
    model = build_hf_model(arch, args, "eager", seed=args.seed)
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    flops, active = flops_per_token(model, arch, args)
    del model
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    return state, flops, active


def train_torch(run: str, arch: str, args, batches: np.ndarray, init_state: dict, experts_impl: str) -> dict:
    """Train ``run`` (``hf``: transformers with ``experts_impl``; ``moe_torch``: patched) from ``init_state`` for
    ``args.steps`` steps; returns its losses, unscaled auxiliary losses, step times and peak memory."""
    import moe_torch

    device = args.device
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = build_hf_model(arch, args, experts_impl, seed=None)
    model.load_state_dict(init_state)
    configs = moe_layer_configs(model)
    hooks = None
    if run == "moe_torch":
        moe_torch.patch_hf_model(model, implementation=args.implementation,
                                 record_router_losses=arch == "deepseek_v3")
    elif arch == "deepseek_v3":
        hooks = RouterHooks(model, "DeepseekV3TopkRouter")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=BETAS, eps=ADAM_EPS,
                            weight_decay=args.weight_decay, fused=cuda or None)
    coef = aux_coef(arch, args)
    data = torch.from_numpy(batches).to(device)
    S = args.seq
    blocks = [m for m in model.modules() if type(m).__name__ == "HFMoEBlock"]
    losses, auxes, times = [], [], []
    for step in range(args.steps):
        torch_sync(device)
        t0 = time.perf_counter()
        x, y = data[step, :, :-1], data[step, :, 1:]
        out = model(input_ids=x, use_cache=False, output_router_logits=arch == "qwen3_moe")
        ce = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), y.reshape(-1))
        if arch == "qwen3_moe":  # transformers' load_balancing_loss_func over the recorded router logits
            aux = out.aux_loss
        elif run == "moe_torch":  # the library gate's own ids, recorded by each HFMoEBlock
            aux = sum(b.last_router_losses.seq_aux_loss for b in blocks)
        else:  # the ids transformers' routers chose
            aux = sum(moe_torch.router_losses(logits, ids, cfg, seq_len=S).seq_aux_loss
                      for (logits, ids), cfg in zip(hooks.calls, configs, strict=True))
            hooks.calls.clear()
        loss = ce + coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # reads back after the update: the step is done
        auxes.append(float(aux.detach()) if isinstance(aux, torch.Tensor) else float(aux))
        times.append(time.perf_counter() - t0)
    result = dict(losses=losses, aux_losses=auxes, step_times_s=times,
                  peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
    if hooks is not None:
        hooks.remove()
    del model, opt, out, loss, data
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------------------------- the JAX run


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A host torch tensor as numpy without rounding (bf16 through ``ml_dtypes``, bit for bit)."""
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class StateDictCheckpoint:
    """``examples/jax_hf_model.py``'s ``Checkpoint`` interface (``has``, ``get``) over an in-memory state dict, so
    that example's attention, norm and MLP modules load from the torch run's initial weights."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def has(self, key: str) -> bool:
        return key in self.state

    def get(self, key: str, dtype):
        import jax.numpy as jnp

        if key not in self.state:
            raise KeyError(f"train_bench: no tensor {key!r} in the model's state dict")
        return jnp.asarray(_numpy(self.state[key])).astype(dtype)


def build_jax_model(arch: str, args, init_state: dict):
    """The NNX model of ``arch`` from the initial torch weights: ``examples/jax_hf_model.py``'s attention, RMSNorm and
    dense MLP; each MoE block a :class:`moe_pallas.MoEBlock` of ``moe_torch.hf.block_layer_weights`` (the block's
    routing; DeepSeek-V3's shared MLP as fused shared experts)."""
    import jax.numpy as jnp
    from flax import nnx
    from transformers import AutoModelForCausalLM

    from examples import jax_hf_model as jm
    from moe_pallas import MoEBlock, MoELayer
    from moe_torch.hf import block_layer_weights, supported_block_name

    cfg = hf_config(arch, args)
    dtype = getattr(jnp, args.dtype)
    spec = jm.model_spec(cfg.to_dict())
    ck = StateDictCheckpoint(init_state)
    with torch.device("meta"):  # a shell whose tensors become init_state's: the blocks are read from it, no copy
        shell = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype))
    shell.load_state_dict(init_state, assign=True)
    moe_blocks = {}
    for i, layer in enumerate(shell.model.layers):
        if supported_block_name(layer.mlp) is None:
            continue
        config, w13, w2, bias = block_layer_weights(layer.mlp)
        router = init_state[f"model.layers.{i}.mlp.gate.weight"]
        j = lambda t: jnp.asarray(_numpy(t.contiguous()))  # noqa: E731
        layer_ = MoELayer.from_float(config, j(w13), j(w2), e_score_correction_bias=None if bias is None else j(bias),
                                     implementation=args.jax_implementation)
        moe_blocks[i] = MoEBlock(j(router), layer_)
    del shell

    class DecoderLayer(nnx.Module):
        """``h = x + attn(input_layernorm(x)); h + mlp(post_attention_layernorm(h))``, the MoE block's router logits
        and losses returned beside (None for a dense layer)."""

        def __init__(self, i: int):
            prefix = f"model.layers.{i}"
            attn = jm.MLAttention if arch == "deepseek_v3" else jm.GQAttention
            self.self_attn = attn(ck, f"{prefix}.self_attn", spec, dtype)
            self.input_layernorm = jm.RMSNorm(ck, f"{prefix}.input_layernorm", spec["eps"], dtype)
            self.post_attention_layernorm = jm.RMSNorm(ck, f"{prefix}.post_attention_layernorm", spec["eps"], dtype)
            self.mlp = moe_blocks[i] if i in moe_blocks else jm.MLP(ck, f"{prefix}.mlp", dtype)

        def __call__(self, x):
            h = x + self.self_attn(self.input_layernorm(x))
            m = self.post_attention_layernorm(h)
            if not isinstance(self.mlp, MoEBlock):
                return h + self.mlp(m), None
            out, losses = self.mlp(m, return_router_losses=True)  # seq_len = S: DeepSeek-V3's sequence-wise loss
            return h + out, (self.mlp.router_logits(m), losses)

    class CausalLM(nnx.Module):
        """``ids [B, S]`` -> ``(logits [B, S, V], [(router_logits [B*S, E], RouterLosses) per MoE layer])``."""

        def __init__(self):
            self.embed_tokens = nnx.Param(ck.get("model.embed_tokens.weight", dtype))
            self.layers = nnx.List([DecoderLayer(i) for i in range(args.layers)])
            self.norm = jm.RMSNorm(ck, "model.norm", spec["eps"], dtype)
            self.lm_head = nnx.Param(ck.get("lm_head.weight", dtype))

        def __call__(self, ids):
            h = jnp.take(self.embed_tokens[...], ids, axis=0)
            routers = []
            for layer in self.layers:
                h, r = layer(h)
                if r is not None:
                    routers.append(r)
            h = self.norm(h)
            head = self.lm_head[...]
            return jnp.matmul(h, head.T, precision=jm.matmul_precision(h, head)), routers

    return CausalLM()


def hf_load_balancing_loss(router_logits: list, tokens_per_expert: list):
    """transformers' ``load_balancing_loss_func`` (Qwen3-MoE, unmasked) in jnp: ``E * sum_e f_e * P_e`` over every
    layer's ``T`` tokens together, ``f_e = sum_layers count_e / (L * T)`` (tokens, not slots: ``topk`` times the
    per-slot form), ``P_e`` the mean softmax probability (taken in the logits' dtype, as transformers does);
    ``count_e`` from the layer gate's own ids (``RouterLosses.tokens_per_expert``). Differentiable through ``P``."""
    import jax
    import jax.numpy as jnp

    E = router_logits[0].shape[-1]
    rows = sum(lg.shape[0] for lg in router_logits)
    f = sum(c.astype(jnp.float32) for c in tokens_per_expert) / rows
    P = sum(jax.nn.softmax(lg, axis=-1).astype(jnp.float32).sum(axis=0) for lg in router_logits) / rows
    return E * jnp.sum(f * P)


def train_jax(arch: str, args, batches: np.ndarray, init_state: dict) -> dict:
    """The ``moe_pallas`` run: the NNX model from ``init_state``, ``optax.adamw``, one ``nnx.jit`` step (model and
    optimizer donated), ``args.steps`` steps; returns losses, step times and peak memory."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    model = build_jax_model(arch, args, init_state)
    tx = optax.adamw(args.lr, b1=BETAS[0], b2=BETAS[1], eps=ADAM_EPS, weight_decay=args.weight_decay)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    coef = aux_coef(arch, args)

    def loss_fn(model, batch):
        logits, routers = model(batch[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch[:, 1:]).mean()
        if arch == "qwen3_moe":
            aux = hf_load_balancing_loss([r[0] for r in routers], [r[1].tokens_per_expert for r in routers])
        else:
            aux = sum(r[1].seq_aux_loss for r in routers)
        return ce + coef * aux, aux

    @nnx.jit(donate_argnums=(0, 1))
    def step(model, opt, batch):
        (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        opt.update(model, grads)
        return loss, aux

    data = [jnp.asarray(b.astype(np.int32)) for b in batches]
    losses, auxes, times = [], [], []
    for s in range(args.steps):
        t0 = time.perf_counter()
        loss, aux = step(model, opt, data[s])
        losses.append(float(loss))  # reads back: the step is done
        auxes.append(float(aux))
        times.append(time.perf_counter() - t0)
    stats = None
    with contextlib.suppress(Exception):
        stats = jax.local_devices()[0].memory_stats()
    peak = stats.get("peak_bytes_in_use") if stats else None
    return dict(losses=losses, aux_losses=auxes, step_times_s=times,
                peak_mem_gib=None if peak is None else peak / 2**30)


# ---------------------------------------------------------------------------------------------- results


def max_rel_diff(a: list[float], b: list[float]) -> float:
    """``max_s |a_s - b_s| / |a_s|`` (inf if any value is not finite)."""
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        return math.inf
    return float(np.max(np.abs(x - y) / np.maximum(np.abs(x), 1e-30)))


def environment(args, argv: list[str]) -> dict:
    """Date, command (``argv``: the options given), git commit, devices and versions of the run."""
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                command=shlex.join(["benchmarks/train_bench.py", *argv]), argv=argv,
                python=platform.python_version(), torch_device=args.device,
                XLA_PYTHON_CLIENT_PREALLOCATE=os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"))
    for mod in ("torch", "transformers", "triton", "jax", "jaxlib", "flax", "optax"):
        with contextlib.suppress(Exception):
            meta[mod] = __import__(mod).__version__
    meta["device_name"] = torch.cuda.get_device_name(torch.device(args.device)) \
        if torch.device(args.device).type == "cuda" else platform.processor() or "cpu"
    with contextlib.suppress(Exception):
        meta["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=_ROOT, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               cwd=_ROOT, timeout=5).stdout.strip()
        meta["git_dirty"] = bool(dirty)
    return meta


def finish_run(row: dict, args, flops: float, device_name: str | None) -> dict:
    """Fill ``tokens_per_s``, ``model_tflops``, ``mfu`` of a run from its step times (the steps after warm-up)."""
    timed = row["step_times_s"][args.warmup:]
    tokens = args.batch * args.seq
    row["tokens_per_step"] = tokens
    row["tokens_per_s"] = tokens / (sum(timed) / len(timed))
    row["flops_per_token"] = flops
    row["model_tflops"] = row["tokens_per_s"] * flops / 1e12
    peak = peak_tflops(device_name, args.dtype)
    row["peak_tflops"] = peak
    row["mfu"] = None if peak is None else row["model_tflops"] / peak
    return row


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(meta: dict, runs: list[dict], checks: list[dict], args) -> str:
    """The results table, the checks and the per-step losses, as markdown."""
    lines = [f"# train_bench {meta['date']} on {meta.get('device_name')} ({args.dtype})", "",
             f"`{meta['command']}` at {meta.get('git', '?')}{' (dirty)' if meta.get('git_dirty') else ''}; "
             f"{args.layers} layers, H={args.hidden}, E={args.experts}, top-{args.topk}, I={args.moe_intermediate}, "
             f"V={args.vocab}, B={args.batch}, S={args.seq}, {args.steps} steps ({args.warmup} warm-up), AdamW lr "
             f"{args.lr:g}", "",
             "| arch | run | implementation | tokens/s | model TFLOP/s | MFU | peak mem GiB | loss first -> last "
             "| notes |",
             "|---|---|---|---:|---:|---:|---:|---|---|"]
    for r in runs:
        lines.append(f"| {r['arch']} | {r['run']} | {r['implementation']} | {r['tokens_per_s']:.4g} | "
                     f"{r['model_tflops']:.3g} | {_f(r['mfu'], '.1%')} | {_f(r['peak_mem_gib'], '.2f')} | "
                     f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} | {r.get('notes') or ''} |")
    lines += ["", "| arch | check | max rel. diff | tolerance | result |", "|---|---|---:|---:|---|"]
    for c in checks:
        lines.append(f"| {c['arch']} | {c['a']} vs {c['b']} | {c['max_rel_diff']:.3g} | {c['rtol']:.3g} | "
                     f"{'PASS' if c['pass'] else 'FAIL'} |")
    for arch in args.arch:
        rs = [r for r in runs if r["arch"] == arch]
        if not rs:
            continue
        lines += ["", f"Per-step loss, {arch} (cross-entropy + coef * aux):", "",
                  "| step | " + " | ".join(r["run"] for r in rs) + " |", "|---:|" + "---:|" * len(rs)]
        for s in range(args.steps):
            lines.append(f"| {s} | " + " | ".join(f"{r['losses'][s]:.6f}" for r in rs) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    rtol = args.loss_rtol if args.loss_rtol is not None else LOSS_RTOL[args.dtype]
    os.makedirs(args.out, exist_ok=True)
    meta = environment(args, argv)
    meta.update(sizes={k: getattr(args, k) for k in DEFAULTS}, runs=args.runs, archs=args.arch, seed=args.seed,
                loss_rtol=rtol, peak_bf16_tflops=dict(PEAK_BF16_TFLOPS))
    experts_impl, why = hf_experts_implementation(args.device, args.dtype)
    meta["hf_experts_implementation"] = experts_impl
    print(f"train_bench: {meta['device_name']}, {args.dtype}, archs {args.arch}, runs {args.runs}; hf experts "
          f"implementation {experts_impl}{' (' + why + ')' if why else ''}; out={args.out}", flush=True)
    torch_device = meta["device_name"] if torch.device(args.device).type == "cuda" else None
    by_run: dict[tuple[str, str], dict] = {}
    init = {arch: initial_state(arch, args) for arch in args.arch}  # (state on the host, flops, active) per arch
    batches = make_batches(args.vocab, args.batch, args.seq, args.steps, args.seed)
    # Every torch run first: XLA keeps the device memory it has taken, torch gives its back (empty_cache).
    order = [(arch, run) for arch in args.arch for run in RUNS if run in args.runs and run != "moe_pallas"]
    order += [(arch, "moe_pallas") for arch in args.arch if "moe_pallas" in args.runs]
    for i, (arch, run) in enumerate(order):
        state, flops, active = init[arch]
        t0 = time.perf_counter()
        if run == "moe_pallas":
            import jax

            res = train_jax(arch, args, batches, state)
            dev = jax.local_devices()[0]
            notes = f"jax on {dev.device_kind}; attention: XLA's (examples/jax_hf_model.py)"
            if any(r == "moe_pallas" for _, r in order[:i]) and res["peak_mem_gib"] is not None:
                notes += "; peak memory since the process start (an earlier JAX run included)"
            impl = f"moe_pallas.MoEBlock(implementation={args.jax_implementation!r})"
            row = dict(framework="jax", implementation=impl, notes=notes)
            device_name = dev.device_kind if dev.platform == "gpu" else None
        else:
            res = train_torch(run, arch, args, batches, state, experts_impl)
            impl = (f"transformers experts_implementation={experts_impl}" if run == "hf" else
                    f"moe_torch.patch_hf_model(implementation={args.implementation!r})")
            row = dict(framework="torch", implementation=impl, notes=why if run == "hf" else None)
            device_name = torch_device
        row = dict(arch=arch, run=run, **row, **res, active_params=active, wall_s=time.perf_counter() - t0)
        by_run[arch, run] = finish_run(row, args, flops, device_name)
        print(f"  {arch} {run}: losses {[round(v, 5) for v in res['losses']]} ({row['wall_s']:.1f} s)", flush=True)
    del init
    runs = [by_run[arch, run] for arch in args.arch for run in RUNS if (arch, run) in by_run]
    checks = []
    for arch in args.arch:
        for a, b in (("hf", "moe_torch"), ("hf", "moe_pallas")):
            if (arch, a) in by_run and (arch, b) in by_run:
                d = max_rel_diff(by_run[arch, a]["losses"], by_run[arch, b]["losses"])
                checks.append(dict(arch=arch, a=a, b=b, max_rel_diff=d, rtol=rtol, **{"pass": d <= rtol}))
    text = markdown(meta, runs, checks, args)
    with open(os.path.join(args.out, "train_bench.md"), "w") as f:
        f.write(text)
    tmp = os.path.join(args.out, "train_bench.json.tmp")
    with open(tmp, "w") as f:
        json.dump(dict(meta=meta, runs=runs, checks=checks), f, indent=1, default=str)
    os.replace(tmp, os.path.join(args.out, "train_bench.json"))
    print("\n" + text)
    for c in checks:
        print(f"{c['arch']}: {c['a']} vs {c['b']} loss curves: max relative difference {c['max_rel_diff']:.3g} "
              f"(tolerance {c['rtol']:.3g}): {'PASS' if c['pass'] else 'FAIL'}")
    print(f"wrote {args.out}/train_bench.{{json,md}}")
    # The exit status is the library's torch check; the JAX comparison is printed and written beside it.
    return 0 if all(c["pass"] for c in checks if c["b"] == "moe_torch") else 1


if __name__ == "__main__":
    sys.exit(main())
