"""The tiny MoE language model of the training examples, framework-free: its sizes, its initial weights
and its synthetic data, in numpy, so ``train_moe_torch.py`` and ``train_moe_jax.py`` start from the
same bits and see the same batches (their loss curves can be compared step by step).

The model (both examples compute exactly this; float32 by default, ``--dtype bfloat16`` for the weights and
activations, with float32 norms, attention softmax, router logits and loss; float32 matmuls at full float32
precision on a GPU too: ``Precision.HIGHEST`` in JAX, torch's default with TF32 off)::

    ids [B, S] int --embed + pos--> h [B, S, H]
    per layer:  h += attention(rmsnorm(h) ; causal, num_heads heads, no rope: learned positions)
                m  = rmsnorm(h);  router_logits = m @ router.T  (float32, [B*S, E])
                h += MoE(m [B*S, H], router_logits)             (the library's layer: EPMoE / MoELayer)
    logits = rmsnorm(h) @ lm_head.T  [B, S, V];  loss = mean cross-entropy of the next token

Weights (``init_weights``; ``[out, in]`` layout, as ``torch.nn.Linear`` and the contract's experts):
``embed [V, H] ~ N(0, 1)``, ``pos [S, H] ~ N(0, 0.01)``, every projection ``~ N(0, 1/fan_in)``, norms 1,
and each layer's experts ``w13 [E + S_shared, 2I, H]``, ``w2 [E + S_shared, H, I]`` and
``e_score_correction_bias [E]`` from :func:`moe_contract.make_layer_inputs` (``N(0, 1/K)``).

The data (:func:`synthetic_batch`): a random Markov chain over the vocabulary in which every token has
two equally likely successors (a table drawn from ``seed``): the loss starts near ``ln V`` and can fall
to ``ln 2 = 0.693`` (the entropy of the next token), which a model that has learned the table reaches.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moe_contract import MoEConfig, make_layer_inputs

#: MoE routings of the examples (sizes filled in by :func:`lm_config`).
ROUTINGS = {
    # DeepSeek-V3's: sigmoid + correction bias, groups, rsf, one fused shared expert
    "deepseek": dict(num_experts=8, topk=2, routing="biased_grouped_topk", num_expert_group=4, topk_group=2,
                     renormalize=True, routed_scaling_factor=2.5, num_fused_shared_experts=1),
    # Mixtral's: softmax top-2, renormalized
    "mixtral": dict(num_experts=8, topk=2, routing="softmax_topk", renormalize=True),
}


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """The tiny model and its training run (AdamW's hyper-parameters, the same in torch and optax)."""

    moe: MoEConfig
    vocab_size: int = 64
    seq_len: int = 32
    batch_size: int = 8
    num_layers: int = 2
    num_heads: int = 4
    norm_eps: float = 1e-6
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    @property
    def hidden_size(self) -> int:
        return self.moe.hidden_size


def lm_config(routing: str = "deepseek", quant: str = "none", *, hidden_size: int = 64, intermediate_size: int = 64,
              **fields) -> LMConfig:
    """An :class:`LMConfig` with the MoE routing ``routing`` (:data:`ROUTINGS`) and ``quant``
    (``"none"``, ``"fp8_per_token"``, ``"fp8_block"``: H and I multiples of 128). ``fields``: other
    :class:`LMConfig` fields (``vocab_size``, ``seq_len``, ``batch_size``, ``num_layers``, ``lr``...).

    Raises: ValueError (an unknown routing; MoEConfig's own checks), TypeError (an unknown field)."""
    if routing not in ROUTINGS:
        raise ValueError(f"lm_config: routing must be one of {sorted(ROUTINGS)}; got routing={routing!r}")
    unknown = sorted(set(fields) - ({f.name for f in dataclasses.fields(LMConfig)} - {"moe"}))
    if unknown:
        raise TypeError(f"lm_config: unknown field(s) {unknown}; LMConfig has "
                        f"{sorted(f.name for f in dataclasses.fields(LMConfig) if f.name != 'moe')}")
    moe = MoEConfig(hidden_size=hidden_size, intermediate_size=intermediate_size, quant=quant, **ROUTINGS[routing])
    cfg = LMConfig(moe=moe, **fields)
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"lm_config: hidden_size (={cfg.hidden_size}) must be a multiple of num_heads "
                         f"(={cfg.num_heads})")
    return cfg


def init_weights(cfg: LMConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Every weight of the model, float32 numpy, by name (``embed``, ``pos``, ``layers.{i}.{wq,wk,wv,wo,
    attn_norm,moe_norm,router,w13,w2,bias}``, ``final_norm``, ``lm_head``); module docstring for the draws."""
    rng = np.random.default_rng(seed)
    H, V, E = cfg.hidden_size, cfg.vocab_size, cfg.moe.num_experts
    f32 = np.float32

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=f32) * f32(std)).astype(f32)

    w = {"embed": normal((V, H), 1.0), "pos": normal((cfg.seq_len, H), 0.01)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for name in ("wq", "wk", "wv", "wo"):
            w[p + name] = normal((H, H), 1 / np.sqrt(H))
        w[p + "attn_norm"] = np.ones(H, f32)
        w[p + "moe_norm"] = np.ones(H, f32)
        w[p + "router"] = normal((E, H), 1 / np.sqrt(H))
        experts = make_layer_inputs(cfg.moe, num_tokens=0, seed=seed * 1000 + i + 1)
        w[p + "w13"], w[p + "w2"] = experts.w13, experts.w2
        w[p + "bias"] = experts.e_score_correction_bias
    w["final_norm"] = np.ones(H, f32)
    w["lm_head"] = normal((V, H), 1 / np.sqrt(H))
    return w


def successor_table(cfg: LMConfig, seed: int = 0) -> np.ndarray:
    """``[V, 2]`` int: the two successors of every token (distinct), the chain :func:`synthetic_batch` walks."""
    rng = np.random.default_rng(10_000 + seed)
    return np.stack([rng.choice(cfg.vocab_size, size=2, replace=False) for _ in range(cfg.vocab_size)])


def synthetic_batch(cfg: LMConfig, step: int, seed: int = 0) -> np.ndarray:
    """``[B, S + 1]`` int32 token ids of batch ``step``: inputs ``[:, :-1]``, next-token targets ``[:, 1:]``."""
    table = successor_table(cfg, seed)
    rng = np.random.default_rng((seed, step))
    B, S = cfg.batch_size, cfg.seq_len
    ids = np.empty((B, S + 1), np.int64)
    ids[:, 0] = rng.integers(0, cfg.vocab_size, B)
    coins = rng.integers(0, 2, (B, S))
    for t in range(S):
        ids[:, t + 1] = table[ids[:, t], coins[:, t]]
    return ids.astype(np.int32)


#: The loss a model that knows the chain reaches: the entropy of two equally likely successors.
ENTROPY_FLOOR = float(np.log(2.0))
