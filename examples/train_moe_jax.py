"""Train a tiny MoE language model in flax NNX with :class:`moe_pallas.MoELayer` as its MoE layers.

The model, its initial weights and the synthetic data are ``examples/tiny_moe_lm.py``'s (numpy, shared
with ``train_moe_torch.py``, which trains the same model in PyTorch from the same bits): embedding and
learned positions, ``num_layers`` decoder layers (RMSNorm, causal self-attention, RMSNorm, a float32
router and a ``MoELayer``), final RMSNorm and ``lm_head``; next-token cross-entropy on a random Markov
chain whose loss floor is ``ln 2``. ``nnx.Optimizer(model, optax.adamw(...), wrt=nnx.Param)`` trains
every ``nnx.Param``, the experts included (``MoELayer``'s float weights are ``nnx.Param``; with
``--quant`` the experts are FP8 codes held as ``FrozenWeight``, which ``nnx.grad`` and the optimizer
leave out, and the backward is straight-through: the router, attention and embeddings still train).
One training step is one ``nnx.jit`` program (forward, ``custom_vjp`` backward, AdamW update).

Every float32 matmul (``matmul`` below; the router's always, the rest with ``--dtype float32``) runs at
``jax.lax.Precision.HIGHEST``, and so does its gradient: IEEE float32 products, as the torch example's
(torch keeps TF32 off by default). XLA's GPU default for float32 dots is TF32-like (10-bit mantissas),
which made the JAX loss curve leave the torch one by 1.3e-5 in 3 steps on an H200. bf16 matmuls keep
the default precision.

Run::

    python examples/train_moe_jax.py                                # 300 steps, CPU: the reference path
    python examples/train_moe_jax.py --dtype bfloat16 --implementation pallas_triton      # on a GPU
    python examples/train_moe_jax.py --quant fp8_per_token --routing mixtral --steps 100

Python::

    from examples.train_moe_jax import train
    losses = train(lm_config("deepseek"), steps=300, implementation="pallas_triton")

``tests/test_training.py`` trains a few steps with the Pallas-Triton kernels (interpreted on the CPU) and
checks that the loss curve equals the reference path's, and the torch example's.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere

import moe_pallas  # noqa: E402
from examples.tiny_moe_lm import (  # noqa: E402
    ENTROPY_FLOOR, ROUTINGS, LMConfig, init_weights, lm_config, synthetic_batch)


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b``; at ``Precision.HIGHEST`` when both are float32 (float32 means float32 on a GPU too)."""
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST if a.dtype == b.dtype == jnp.float32 else None)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in float32, returned in ``x.dtype``."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps) * weight.astype(jnp.float32)).astype(x.dtype)


class DecoderLayer(nnx.Module):
    """RMSNorm + causal multi-head attention + residual; RMSNorm + router + :class:`moe_pallas.MoELayer` + residual."""

    def __init__(self, cfg: LMConfig, w: dict, prefix: str, *, implementation, dtype, recompute: bool):
        p = lambda name, dt=dtype: nnx.Param(jnp.asarray(w[prefix + name]).astype(dt))
        self.cfg = cfg
        self.wq, self.wk, self.wv, self.wo = (p(n) for n in ("wq", "wk", "wv", "wo"))
        self.attn_norm, self.moe_norm = p("attn_norm"), p("moe_norm")
        self.router = p("router", jnp.float32)  # router logits in float32, as DeepSeek-V3 keeps them
        t = lambda name, dt=dtype: jnp.asarray(w[prefix + name]).astype(dt)
        bias = t("bias", jnp.float32) if cfg.moe.routing == "biased_grouped_topk" else None
        self.moe = moe_pallas.MoELayer.from_float(cfg.moe, t("w13"), t("w2"), e_score_correction_bias=bias,
                                                  implementation=implementation, recompute=recompute)

    def __call__(self, h: jax.Array) -> jax.Array:  # [B, S, H]
        B, S, H = h.shape
        nh = self.cfg.num_heads
        a = rms_norm(h, self.attn_norm[...], self.cfg.norm_eps)
        q, k, v = (matmul(a, w[...].T).reshape(B, S, nh, H // nh).transpose(0, 2, 1, 3) for w in (self.wq, self.wk, self.wv))
        scores = matmul(q.astype(jnp.float32), k.astype(jnp.float32).transpose(0, 1, 3, 2)) / np.sqrt(H // nh)
        causal = jnp.tril(jnp.ones((S, S), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(h.dtype)
        h = h + matmul(matmul(probs, v).transpose(0, 2, 1, 3).reshape(B, S, H), self.wo[...].T)
        m = rms_norm(h, self.moe_norm[...], self.cfg.norm_eps).reshape(B * S, H)
        router_logits = matmul(m.astype(jnp.float32), self.router[...].T)  # [B*S, E] float32
        return h + self.moe(m, router_logits).reshape(B, S, H)


class TinyMoELM(nnx.Module):
    """The model of ``examples/tiny_moe_lm.py``: ``model(ids [B, S] int) -> logits [B, S, V] float32``."""

    def __init__(self, cfg: LMConfig, *, seed: int = 0, implementation: str | None = None, dtype=jnp.float32,
                 recompute: bool = False):
        w = init_weights(cfg, seed)
        p = lambda name: nnx.Param(jnp.asarray(w[name]).astype(dtype))
        self.cfg = cfg
        self.embed, self.pos, self.final_norm, self.lm_head = (p(n) for n in ("embed", "pos", "final_norm", "lm_head"))
        self.layers = nnx.List([DecoderLayer(cfg, w, f"layers.{i}.", implementation=implementation, dtype=dtype,
                                             recompute=recompute) for i in range(cfg.num_layers)])

    def __call__(self, ids: jax.Array) -> jax.Array:
        h = self.embed[...][ids] + self.pos[...][: ids.shape[1]]
        for layer in self.layers:
            h = layer(h)
        h = rms_norm(h, self.final_norm[...], self.cfg.norm_eps).astype(jnp.float32)
        return matmul(h, self.lm_head[...].astype(jnp.float32).T)

    def loss(self, batch: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy of ``batch [B, S + 1]`` (float32 scalar)."""
        logits = self(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@functools.cache
def _adamw(lr: float, b1: float, b2: float, eps: float, weight_decay: float) -> optax.GradientTransformation:
    # One transformation object per setting: it is static in the optimizer's graphdef, so a new object
    # would make nnx.jit compile train_step again for every new optimizer.
    return optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)


def make_optimizer(model: TinyMoELM, cfg: LMConfig) -> nnx.Optimizer:
    """``optax.adamw`` over the model's ``nnx.Param`` (FP8 expert codes are ``FrozenWeight``: not among them);
    the same hyper-parameters as ``torch.optim.AdamW`` in ``train_moe_torch.py`` (the same update rule)."""
    return nnx.Optimizer(model, _adamw(cfg.lr, *cfg.betas, cfg.eps, cfg.weight_decay), wrt=nnx.Param)


@nnx.jit
def train_step(model: TinyMoELM, optimizer: nnx.Optimizer, batch: jax.Array) -> jax.Array:
    """One AdamW step on ``batch [B, S + 1]``; returns the loss before the update."""
    loss, grads = nnx.value_and_grad(lambda m: m.loss(batch))(model)
    optimizer.update(model, grads)
    return loss


def train(cfg: LMConfig, steps: int, *, seed: int = 0, implementation: str | None = None, dtype=jnp.float32,
          recompute: bool = False, log_every: int = 0, model: TinyMoELM | None = None) -> list[float]:
    """Train ``steps`` AdamW steps on :func:`synthetic_batch` ``0 .. steps-1``; returns the loss of every
    step (before its update). ``model``: continue training this one instead of a fresh ``TinyMoELM``."""
    model = TinyMoELM(cfg, seed=seed, implementation=implementation, dtype=dtype,
                      recompute=recompute) if model is None else model
    optimizer = make_optimizer(model, cfg)
    losses = []
    for step in range(steps):
        losses.append(float(train_step(model, optimizer, jnp.asarray(synthetic_batch(cfg, step, seed)))))
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--routing", choices=sorted(ROUTINGS), default="deepseek")
    ap.add_argument("--quant", choices=["none", "fp8_per_token", "fp8_block"], default="none")
    ap.add_argument("--implementation", choices=["reference", "pallas_triton", "pallas_mosaic_gpu"], default=None,
                    help="default: the fastest kernels on a GPU, the reference on a CPU")
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
                   dtype=getattr(jnp, args.dtype), recompute=args.recompute, log_every=args.log_every)
    print(f"{args.steps} steps in {time.perf_counter() - t0:.1f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
          f"(ln V = {np.log(cfg.vocab_size):.3f}, floor ln 2 = {ENTROPY_FLOOR:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
