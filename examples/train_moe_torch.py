"""Train a tiny MoE language model in PyTorch with :class:`moe_torch.EPMoE` as its MoE layers.

The model, its initial weights and the synthetic data are ``examples/tiny_moe_lm.py``'s (numpy, shared
with ``train_moe_jax.py``, which trains the same model in flax NNX from the same bits): embedding and
learned positions, ``num_layers`` decoder layers (RMSNorm, causal self-attention, RMSNorm, a float32
router and an ``EPMoE``), final RMSNorm and ``lm_head``; next-token cross-entropy on a random Markov
chain whose loss floor is ``ln 2``. ``torch.optim.AdamW`` over ``model.parameters()`` trains everything,
the experts included (``EPMoE``'s float weights are trainable parameters; with ``--quant`` the experts
are frozen FP8 codes, buffers no optimizer sees, and the backward is straight-through: the router,
attention and embeddings still train).

Run::

    python examples/train_moe_torch.py                              # 300 steps, CPU: the reference path
    python examples/train_moe_torch.py --device cuda --dtype bfloat16 --implementation triton
    python examples/train_moe_torch.py --quant fp8_per_token --routing mixtral --steps 100
    TRITON_INTERPRET=1 python examples/train_moe_torch.py --implementation triton --steps 5   # CPU: interpreted, slow

Python::

    from examples.train_moe_torch import train
    losses = train(lm_config("deepseek"), steps=300, implementation="triton", device="cuda")

``tests/test_training.py`` trains a few steps with the Triton kernels (interpreted on the CPU) and checks
that the loss curve equals the reference path's, and the JAX example's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere

import moe_torch  # noqa: E402
from examples.tiny_moe_lm import (  # noqa: E402
    ENTROPY_FLOOR, ROUTINGS, LMConfig, init_weights, lm_config, synthetic_batch)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in float32, returned in ``x.dtype``."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class DecoderLayer(torch.nn.Module):
    """RMSNorm + causal multi-head attention + residual; RMSNorm + router + :class:`moe_torch.EPMoE` + residual."""

    def __init__(self, cfg: LMConfig, w: dict, prefix: str, *, implementation, dtype, device, recompute: bool):
        super().__init__()
        p = lambda name, dt=dtype: torch.nn.Parameter(torch.from_numpy(w[prefix + name]).to(device, dt))
        self.cfg = cfg
        self.wq, self.wk, self.wv, self.wo = (p(n) for n in ("wq", "wk", "wv", "wo"))
        self.attn_norm, self.moe_norm = p("attn_norm"), p("moe_norm")
        self.router = p("router", torch.float32)  # router logits in float32, as DeepSeek-V3 keeps them
        t = lambda name, dt=dtype: torch.from_numpy(w[prefix + name]).to(device, dt)
        bias = t("bias", torch.float32) if cfg.moe.routing == "biased_grouped_topk" else None
        self.moe = moe_torch.EPMoE.from_float(cfg.moe, t("w13"), t("w2"), e_score_correction_bias=bias,
                                              implementation=implementation, recompute=recompute)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [B, S, H]
        B, S, H = h.shape
        nh = self.cfg.num_heads
        a = rms_norm(h, self.attn_norm, self.cfg.norm_eps)
        q, k, v = ((a @ w.T).reshape(B, S, nh, H // nh).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = (q.float() @ k.float().transpose(-1, -2)) / np.sqrt(H // nh)  # [B, nh, S, S]
        causal = torch.ones(S, S, dtype=torch.bool, device=h.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1).to(h.dtype)
        h = h + (probs @ v).transpose(1, 2).reshape(B, S, H) @ self.wo.T
        m = rms_norm(h, self.moe_norm, self.cfg.norm_eps).reshape(B * S, H)
        router_logits = m.float() @ self.router.T  # [B*S, E] float32
        return h + self.moe(m, router_logits).reshape(B, S, H)


class TinyMoELM(torch.nn.Module):
    """The model of ``examples/tiny_moe_lm.py``: ``forward(ids [B, S] int) -> logits [B, S, V] float32``."""

    def __init__(self, cfg: LMConfig, *, seed: int = 0, implementation: str | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", recompute: bool = False):
        super().__init__()
        w = init_weights(cfg, seed)
        p = lambda name: torch.nn.Parameter(torch.from_numpy(w[name]).to(device, dtype))
        self.cfg = cfg
        self.embed, self.pos, self.final_norm, self.lm_head = (p(n) for n in ("embed", "pos", "final_norm", "lm_head"))
        self.layers = torch.nn.ModuleList(
            DecoderLayer(cfg, w, f"layers.{i}.", implementation=implementation, dtype=dtype, device=device,
                         recompute=recompute) for i in range(cfg.num_layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed[ids] + self.pos[: ids.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return rms_norm(h, self.final_norm, self.cfg.norm_eps).float() @ self.lm_head.float().T

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``batch [B, S + 1]`` (float32 scalar)."""
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1).long())


def make_optimizer(model: torch.nn.Module, cfg: LMConfig) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` over ``model.parameters()`` (FP8 expert codes are buffers: not among them)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


def train(cfg: LMConfig, steps: int, *, seed: int = 0, implementation: str | None = None,
          dtype: torch.dtype = torch.float32, device: str = "cpu", recompute: bool = False,
          log_every: int = 0, model: TinyMoELM | None = None) -> list[float]:
    """Train ``steps`` AdamW steps on :func:`synthetic_batch` ``0 .. steps-1``; returns the loss of every
    step (before its update). ``model``: continue training this one instead of a fresh ``TinyMoELM``."""
    model = TinyMoELM(cfg, seed=seed, implementation=implementation, dtype=dtype, device=device,
                      recompute=recompute) if model is None else model
    opt = make_optimizer(model, cfg)
    losses = []
    for step in range(steps):
        batch = torch.from_numpy(synthetic_batch(cfg, step, seed)).to(device)
        loss = model.loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--routing", choices=sorted(ROUTINGS), default="deepseek")
    ap.add_argument("--quant", choices=["none", "fp8_per_token", "fp8_block"], default="none")
    ap.add_argument("--implementation", choices=["reference", "triton"], default=None,
                    help="default: Triton on CUDA, the reference on a CPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--hidden", type=int, default=64, help="H (fp8_block: a multiple of 128)")
    ap.add_argument("--intermediate", type=int, default=64, help="I (fp8_block: a multiple of 128)")
    ap.add_argument("--recompute", action="store_true", help="keep only the routing for the backward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=25)
    args = ap.parse_args(argv)
    cfg = lm_config(args.routing, args.quant, hidden_size=args.hidden, intermediate_size=args.intermediate)
    t0 = time.perf_counter()
    losses = train(cfg, args.steps, seed=args.seed, implementation=args.implementation,
                   dtype=getattr(torch, args.dtype), device=args.device, recompute=args.recompute,
                   log_every=args.log_every)
    print(f"{args.steps} steps in {time.perf_counter() - t0:.1f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
          f"(ln V = {np.log(cfg.vocab_size):.3f}, floor ln 2 = {ENTROPY_FLOOR:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
