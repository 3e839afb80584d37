"""The MoE layer as a flax NNX module: :class:`MoELayer` holds one EP rank's expert weights and
calls :func:`moe_pallas.layer.moe_forward`; :class:`MoEBlock` adds the router of a transformers sparse-MoE
block (``[B, S, H]`` hidden states in and out).

State::

    w13   [E_local, 2*I, H]  nnx.Param (bf16 / float16 / float32, quant='none'; FrozenWeight with
                             trainable=False) or FrozenWeight (float8_e4m3fn codes; 4-bit: packed uint8
                             codes [E_local, 2*I, H // 2])
    w2    [E_local, H, I]    same rule (4-bit: [E_local, H, I // 2])
    w13_scale, w2_scale      FrozenWeight weight scales (None for quant='none'): float32 FP8
                             [E_local, N] per-channel (fp8_per_token) or
                             [E_local, ceil(N/128), ceil(K/128)] blocks (fp8_block); 4-bit
                             [E_local, N, K // 32] uint8 e8m0 (mxfp4) or bf16 (int4)
    w13_bias, w2_bias        [E_local, 2*I] / [E_local, H] nnx.Param (FrozenWeight with trainable=False;
                             config.expert_bias only, else None), with any weights (FP8 and 4-bit layers
                             train them too): gpt-oss's gate_up_proj_bias / down_proj_bias
    e_score_correction_bias  FrozenWeight [E] float (routing='biased_grouped_topk' only, else None)
    shared_expert_gate       [1, H] or [S, H] nnx.Param (FrozenWeight with trainable=False;
                             config.shared_expert_gate only, else None): Qwen3-Next's
                             shared_expert_gate.weight; the layer computes its logits from it

Why two Variable types: ``nnx.grad`` and ``nnx.Optimizer(..., wrt=nnx.Param)`` take
``nnx.Param`` by default. Float weights are ordinary parameters (``trainable=True``, the default, as
``nnx.Linear``'s kernel is): ``nnx.grad(model)`` differentiates them through
:func:`moe_pallas.moe_forward`'s ``custom_vjp`` (CONTRACT.md section 8, every backend) and
``nnx.Optimizer(model, optax.adamw(...), wrt=nnx.Param)`` updates them. FP8 and 4-bit codes are not: a
gradient step on a float8_e4m3fn or 4-bit code is meaningless and the scales belong to the codes; and
DeepSeek-V3's correction bias is moved by its load-balancing rule, not by gradients (HF holds it
as a buffer). So those are
:class:`FrozenWeight`, which every filter on ``nnx.Param`` leaves out, and which
``nnx.state`` / ``nnx.split`` still carry for checkpoints. The config and the implementation
name (and ``recompute``) are static (part of the graphdef), so a jitted model retraces only when
they change. An FP8 layer is straight-through: gradients reach ``x`` and the router in ``x.dtype``.

Modules take jax arrays only (the functional ops take numpy too, as jnp does): a numpy ``x`` is a
``TypeError`` naming ``jnp.asarray(x)``, as ``moe_torch``'s modules refuse what is not a torch tensor.

Mirror: ``moe_torch/module.py``.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_contract.config import MoEConfig
from moe_contract.inputs import (check_seed, draw_expert_biases, draw_preset_weights, draw_router,
                                  draw_shared_expert_gate)
from moe_contract.op_checks import check_select_experts
from moe_contract.presets import get_preset
from moe_contract.w4_layout import check_mma_layout_scales
from moe_contract.validation import (
    FLOAT_DTYPES,
    check_bool,
    check_config,
    check_dtype,
    check_expert_biases,
    check_global_biases,
    check_layer_inputs,
    check_layer_weights,
    check_rank,
    check_shape,
    check_shared_expert_gate_weight,
    dtype_name,
)
from moe_pallas.layer import (LAYER_IMPLEMENTATIONS, check_w4_implementation, local_weights, moe_forward,
                               quantize_layer_weights)
from moe_pallas.ops.common import cast_rounded, check_jax_arrays
from moe_pallas.ops.dispatch import check_implementation
from moe_pallas.ops.gate.losses import RouterLosses


class FrozenWeight(nnx.Variable):
    """Layer state no gradient step updates: FP8 / 4-bit weight codes, their scales, the gate's correction bias."""


def check_module_weights(op: str, config: MoEConfig, w13, w2, w13_scale, w2_scale, e_score_correction_bias,
                         w13_bias=None, w2_bias=None) -> None:
    """The weights of one EP rank against ``config``, with the layer's own rules and messages.

    ``quant='none'``: ``w13``, ``w2`` float (one dtype), no scales. FP8: float8_e4m3fn codes with
    the scale layout of the quant mode; 4-bit: packed uint8 codes with group scales. ``e_score_correction_bias``
    ``[E]`` float exactly when ``routing='biased_grouped_topk'``; ``w13_bias [E_local, 2*I]`` / ``w2_bias
    [E_local, H]`` exactly when ``config.expert_bias`` (float32, bf16, or the float weights' dtype; a quantized
    layer: any float dtype, checked against ``x`` when called).

    Raises: TypeError (not a MoEConfig, not arrays, dtypes), ValueError (shapes, missing or
      unexpected scales or biases).
    """
    check_config(op, config)
    if config.quant == "none":
        check_layer_weights(op, config, w13, w2)
        x_dtype = w13.dtype
    else:  # activations of any float dtype: a float16 bias goes with float16 x
        x_dtype = jnp.float16 if w13_bias is not None and dtype_name(w13_bias) == "float16" else jnp.bfloat16
    # Shape-only stand-ins for x and router_logits (the checks read .shape and .dtype only).
    x = jax.ShapeDtypeStruct((0, config.hidden_size), x_dtype)
    logits = jax.ShapeDtypeStruct((0, config.num_experts), jnp.float32)
    check_layer_inputs(op, config, x, logits, w13, w2, w13_scale, w2_scale)
    check_expert_biases(op, config, x, w13_bias, w2_bias)
    check_select_experts(
        op,
        logits,
        **config.gate_kwargs(),
        e_score_correction_bias=e_score_correction_bias,
    )
    check_module_mma_scales(op, config, w13_scale, w2_scale)


def check_module_mma_scales(op: str, config: MoEConfig, w13_scale, w2_scale) -> None:
    """``config.w4_layout == "mma"``: ValueError naming ``op`` and the scale if an e8m0 code is one the layout's table
    cannot hold (129..254: those weights would read as NaN, CONTRACT.md section 9). Reads concrete scales on the
    host (a load-time check; traced scales, inside a transform, are not read)."""
    if config.w4_layout != "mma":
        return
    for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if isinstance(s, jax.core.Tracer):
            continue
        check_mma_layout_scales(op, name, np.asarray(s))


def check_global_weights(op: str, config: MoEConfig, w13, w2) -> None:
    """Float weights of every expert: ``w13 [E + S, 2*I, H]``, ``w2 [E + S, H, I]`` (before slicing)."""
    check_config(op, config)
    H, I, E_all = config.hidden_size, config.intermediate_size, config.num_total_experts
    what13 = f"[E + S, 2*I, H] = ({E_all}, {2 * I}, {H}) (every expert of the layer)"
    what2 = f"[E + S, H, I] = ({E_all}, {H}, {I}) (every expert of the layer)"
    check_shape(op, "w13", w13, (E_all, 2 * I, H), what13)
    check_shape(op, "w2", w2, (E_all, H, I), what2)
    check_dtype(op, "w13", w13, FLOAT_DTYPES)
    check_dtype(op, "w2", w2, FLOAT_DTYPES)


def check_call_arrays(op: str, named: dict) -> None:
    """The arrays a module is *called* with must be jax arrays (or tracers): a numpy array is a
    ``TypeError`` that names the conversion (``jnp.asarray(x)``), a torch tensor or anything else one
    naming what came. The modules of both packages take their own framework's arrays only (the
    functional ops, ``moe_forward`` included, still take numpy as jnp does)."""
    for name, value in named.items():
        if isinstance(value, jax.Array):
            continue
        if isinstance(value, (np.ndarray, np.generic)):
            raise TypeError(f"{op}: {name} must be a jax array (modules take their framework's arrays only); "
                            f"got numpy.{type(value).__name__}: pass jnp.asarray({name})")
        check_jax_arrays(op, {name: value}, required=True)


class MoELayer(nnx.Module):
    """One MoE layer on EP rank ``config.ep_rank``: ``layer(x [T, H], router_logits [T, E]) -> [T, H]``.

    Args:
      config: the layer (:class:`moe_contract.MoEConfig`: routing, rsf, quant, EP rank, capacity); static.
      w13: ``[E_local, 2*I, H]`` this rank's gate (rows ``:I``) and up projections: bf16 /
        float16 / float32 for ``quant='none'`` (then ``x`` must have this dtype), float8_e4m3fn
        for the FP8 modes, packed 4-bit codes ``[E_local, 2*I, H // 2]`` uint8 for ``'mxfp4'`` / ``'int4'``.
      w2: ``[E_local, H, I]`` down projections, same dtype as ``w13`` (4-bit: ``[E_local, H, I // 2]``).
      w13_scale, w2_scale: dequantization multipliers (``w ~= q * scale``), as
        :func:`moe_pallas.quantize_layer_weights` makes them: float32 ``[E_local, N]`` (``fp8_per_token``;
        ``[E_local]`` per-expert also taken) or ``[E_local, ceil(N/128), ceil(K/128)]``
        (``fp8_block``); 4-bit ``[E_local, N, K // 32]`` uint8 e8m0 (``mxfp4``) or bf16 (``int4``);
        ``None`` for ``quant='none'``.
      w13_bias, w2_bias: for (and only for) ``config.expert_bias`` (gpt-oss): ``[E_local, 2*I]`` / ``[E_local, H]``
        float (``gate_up_proj_bias`` / ``down_proj_bias`` of this rank's experts); ``nnx.Param`` (``trainable``,
        whatever the weights are: FP8 and 4-bit layers train their biases too) or :class:`FrozenWeight`.
      e_score_correction_bias: ``[E]`` float, for (and only for) ``routing='biased_grouped_topk'``.
      shared_expert_gate: for (and only for) ``config.shared_expert_gate`` (Qwen3-Next): ``[1, H]``, transformers'
        ``shared_expert_gate.weight`` (one gate for the whole shared MLP: every fused shared slot), or ``[S, H]``
        (one per slot), float; ``nnx.Param`` (``trainable``) or :class:`FrozenWeight`. The layer computes
        ``shared_expert_gate_logits = x @ shared_expert_gate.T`` in its dtype (float32 accumulation, rounded to
        it, as transformers' ``nn.Linear``), widened to float32. Llama 4's ``config.apply_router_weight_on_input``
        needs no weight.
      implementation: the backend of every stage (``None``, ``"reference"``, ``"pallas_triton"``),
        as :func:`moe_pallas.moe_forward` takes it; static.
      trainable: ``True`` (default): float weights (``quant='none'``) and the expert biases are ``nnx.Param``
        (``nnx.grad`` and optimizers over ``nnx.Param`` train them); ``False``: :class:`FrozenWeight`. FP8 /
        4-bit codes, scales and the correction bias are :class:`FrozenWeight` either way.
      recompute: passed to :func:`moe_pallas.moe_forward` (static): ``False`` (default) keeps GEMM 1's
        output for the backward, ``True`` only the routing (GEMM 1 recomputed in the backward).

    Works eagerly and under ``nnx.jit`` (alone or inside a larger model); differentiable in ``x``,
    ``router_logits``, the float weights and the expert biases (CONTRACT.md section 8).

    Raises: TypeError / ValueError from :func:`check_module_weights`, before anything is stored.

    Source: the layout of SGLang / vLLM ``FusedMoE`` (``w13_weight``, ``w2_weight``, FP8
    ``*_weight_scale(_inv)``).
    """

    def __init__(
        self,
        config: MoEConfig,
        w13: jax.Array,
        w2: jax.Array,
        *,
        w13_scale: jax.Array | None = None,
        w2_scale: jax.Array | None = None,
        w13_bias: jax.Array | None = None,
        w2_bias: jax.Array | None = None,
        e_score_correction_bias: jax.Array | None = None,
        shared_expert_gate: jax.Array | None = None,
        implementation: str | None = None,
        trainable: bool = True,
        recompute: bool = False,
    ) -> None:
        op = "MoELayer"
        check_bool(op, "trainable", trainable)
        check_bool(op, "recompute", recompute)
        check_jax_arrays(op, dict(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale, w13_bias=w13_bias,
                                  w2_bias=w2_bias, e_score_correction_bias=e_score_correction_bias,
                                  shared_expert_gate=shared_expert_gate), required=True)
        check_module_weights(op, config, w13, w2, w13_scale, w2_scale, e_score_correction_bias, w13_bias, w2_bias)
        check_shared_expert_gate_weight(op, config, shared_expert_gate)
        check_implementation(op, implementation, LAYER_IMPLEMENTATIONS)
        check_w4_implementation(op, config, implementation)
        weight = nnx.Param if config.quant == "none" and trainable else FrozenWeight
        self.config = config
        self.implementation = implementation
        self.recompute = recompute
        self.w13 = weight(jnp.asarray(w13))
        self.w2 = weight(jnp.asarray(w2))
        self.w13_scale = None if w13_scale is None else FrozenWeight(jnp.asarray(w13_scale))
        self.w2_scale = None if w2_scale is None else FrozenWeight(jnp.asarray(w2_scale))
        bias = e_score_correction_bias
        self.e_score_correction_bias = None if bias is None else FrozenWeight(jnp.asarray(bias))
        gate = nnx.Param if trainable else FrozenWeight
        self.shared_expert_gate = None if shared_expert_gate is None else gate(jnp.asarray(shared_expert_gate))
        self.w13_bias = None if w13_bias is None else gate(jnp.asarray(w13_bias))  # trainable with any weights
        self.w2_bias = None if w2_bias is None else gate(jnp.asarray(w2_bias))

    @classmethod
    def from_float(
        cls,
        config: MoEConfig,
        w13: jax.Array,
        w2: jax.Array,
        *,
        w13_bias: jax.Array | None = None,
        w2_bias: jax.Array | None = None,
        e_score_correction_bias: jax.Array | None = None,
        shared_expert_gate: jax.Array | None = None,
        implementation: str | None = None,
        trainable: bool = True,
        recompute: bool = False,
    ) -> "MoELayer":
        """This rank's layer from float weights of every expert, quantized per ``config.quant``.

        Args:
          w13: ``[E + S, 2*I, H]`` float32 / bf16 / float16, every expert (fused shared experts last).
          w2: ``[E + S, H, I]`` float.
          w13_bias, w2_bias: ``[E + S, 2*I]`` / ``[E + S, H]`` float, every expert's (``config.expert_bias`` only;
            gpt-oss's ``gate_up_proj_bias`` / ``down_proj_bias``); this rank's rows are kept, never quantized.
          e_score_correction_bias: ``[E]`` float (biased_grouped_topk only).
          shared_expert_gate: ``[1, H]`` / ``[S, H]`` float (``config.shared_expert_gate`` only), as :class:`MoELayer`.
          implementation, trainable, recompute: as :class:`MoELayer`.

        Returns: a :class:`MoELayer` holding ``local_weights(w, config)``, FP8- or 4-bit-quantized in the form of
        ``config.quant`` (bit-identical to :func:`moe_pallas.quantize_layer_weights` of the slice); for
        ``quant='none'`` the slices themselves.

        Raises: TypeError / ValueError naming the argument (global shapes, dtypes, biases).
        """
        op = "MoELayer.from_float"
        check_jax_arrays(op, dict(w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias,
                                  e_score_correction_bias=e_score_correction_bias), required=True)
        check_global_weights(op, config, w13, w2)
        check_global_biases(op, config, w13_bias, w2_bias)
        w13, w2 = local_weights(jnp.asarray(w13), config), local_weights(jnp.asarray(w2), config)
        b13 = None if w13_bias is None else local_weights(jnp.asarray(w13_bias), config)
        b2 = None if w2_bias is None else local_weights(jnp.asarray(w2_bias), config)
        s13 = s2 = None
        if config.quant != "none":
            w13, s13, w2, s2 = quantize_layer_weights(w13, w2, config)
        return cls(config, w13, w2, w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2,
                   e_score_correction_bias=e_score_correction_bias,
                   shared_expert_gate=shared_expert_gate, implementation=implementation, trainable=trainable,
                   recompute=recompute)

    @classmethod
    def from_preset(
        cls,
        name: str,
        *,
        seed: int = 0,
        dtype=jnp.bfloat16,
        implementation: str | None = None,
        trainable: bool = True,
        recompute: bool = False,
        **config_overrides,
    ) -> "MoELayer":
        """A layer of preset ``name`` with random weights, as the tests and benchmarks draw them.

        Args:
          name: a :data:`moe_contract.PRESETS` name (``"tiny"``, ``"deepseek-v3"``...).
          seed: the numpy seed: the weights are this rank's slice of
            ``make_layer_inputs(config, num_tokens=0, seed)`` (``~ N(0, 1/K)``, bias ``~ N(0, 0.01)``
            float32), cast to ``dtype`` (round to nearest even) and quantized per ``config.quant``; the expert
            biases (``config.expert_bias``: gpt-oss's presets) this rank's slice of
            :func:`moe_contract.inputs.draw_expert_biases`, cast to ``dtype``;
            ``moe_torch.EPMoE.from_preset`` with the same arguments holds the same bits.
          dtype: the float weights' dtype (and the ``x`` dtype ``quant='none'`` then takes).
          implementation, trainable, recompute: as :class:`MoELayer`.
          config_overrides: :meth:`ModelPreset.config` fields (``quant``, ``ep_size``, ``ep_rank``,
            ``capacity_factor``, ``hidden_size``...).

        Arrays land on JAX's default device. Drawing is on the host, one expert at a time, this rank's
        experts only (each expert has its own generator), one core (``make_layer_inputs`` draws on all
        cores, but holds the whole layer in float32): seconds for CPU-sized layers, a few minutes for all
        of DeepSeek-V3 on one rank (about 16 s per 10^9 values).

        Raises: ValueError (unknown preset, bad override values, ``seed`` not an int >= 0), TypeError (an unknown
          override name; dtype not float32 / bf16 / float16).
        """
        op = "MoELayer.from_preset"
        config = get_preset(name).config(**config_overrides)
        check_seed(op, seed)
        try:
            ok = dtype_name(dtype) in FLOAT_DTYPES
        except TypeError:
            ok = False
        if not ok:
            raise TypeError(f"{op}: dtype must be a jnp dtype among {FLOAT_DTYPES}; got dtype={dtype!r}")
        dtype = jnp.dtype(dtype_name(dtype))
        parts: dict[str, list] = {"w13": [], "w2": []}
        bias = None
        for kind, _, a in draw_preset_weights(config, seed):
            if kind == "bias":
                bias = jnp.asarray(a) if config.routing == "biased_grouped_topk" else None
            else:
                parts[kind].append(jnp.asarray(a).astype(dtype))
        w13, w2 = jnp.stack(parts["w13"]), jnp.stack(parts["w2"])
        del parts
        s13 = s2 = None
        if config.quant != "none":
            w13, s13, w2, s2 = quantize_layer_weights(w13, w2, config)
        gate = draw_shared_expert_gate(config, seed)  # [1, H] float32, or None
        gate = None if gate is None else jnp.asarray(gate).astype(dtype)
        biases = draw_expert_biases(config, seed)  # ([E + S, 2I], [E + S, H]) float32, or None
        b13, b2 = (None, None) if biases is None else (local_weights(jnp.asarray(b).astype(dtype), config)
                                                       for b in biases)
        return cls(config, w13, w2, w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2, e_score_correction_bias=bias,
                   shared_expert_gate=gate, implementation=implementation, trainable=trainable, recompute=recompute)

    @property
    def trainable(self) -> bool:
        """Whether the float weights are ``nnx.Param`` (``False`` for FP8 / 4-bit layers: codes are FrozenWeight)."""
        return isinstance(self.w13, nnx.Param)

    def __call__(self, x: jax.Array, router_logits: jax.Array, *, return_router_losses: bool = False,
                 seq_len: int | None = None) -> jax.Array | tuple[jax.Array, RouterLosses]:
        """``x [T, H]`` (float32 / bf16 / float16; ``w13``'s dtype for ``quant='none'``) and
        ``router_logits [T, E]`` float -> ``out [T, H]`` in ``x.dtype``: this rank's partial sum
        (the sum over EP ranks is the layer's output).

        ``return_router_losses=True`` (and ``seq_len``, the tokens of one sequence, for ``seq_aux_loss``; both
        static): ``(out, RouterLosses)``, the router's training losses of the call (CONTRACT.md section 10; unscaled
        float32 ``aux_loss``, ``seq_aux_loss``, ``z_loss`` and ``tokens_per_expert [E]`` int32, as
        :func:`moe_pallas.moe_forward` returns them), differentiable in ``router_logits`` by ``nnx.grad``. Feed
        ``tokens_per_expert`` to :func:`moe_pallas.update_expert_bias` for ``e_score_correction_bias``
        (DeepSeek-V3's auxiliary-loss-free balancing: ``layer.e_score_correction_bias[...] = update_expert_bias(...)``
        after the step).

        Raises: TypeError if ``x`` or ``router_logits`` is not a jax array (a numpy array: convert it with
          ``jnp.asarray``); ValueError / TypeError from :func:`moe_pallas.moe_forward` (shapes, dtypes).
        """
        check_call_arrays("MoELayer", dict(x=x, router_logits=router_logits))
        if x.ndim != 2:  # named here: the user called the module, and a [B, S, H] input is the block's
            raise ValueError(f"MoELayer: x must be [T, H] (tokens flattened; moe_pallas.MoEBlock takes [B, S, H]); "
                             f"got x of shape {tuple(x.shape)}")
        if self.config.quant == "none" and hasattr(x, "dtype") and dtype_name(x) != dtype_name(self.w13[...]):
            raise TypeError(f"MoELayer: x must have the layer's dtype {dtype_name(self.w13[...])} (quant='none'); "
                            f"got x.dtype={dtype_name(x)}")

        def value(v):
            return None if v is None else v[...]

        return moe_forward(
            x,
            router_logits,
            self.w13[...],
            self.w2[...],
            self.config,
            w13_scale=value(self.w13_scale),
            w2_scale=value(self.w2_scale),
            w13_bias=value(self.w13_bias),
            w2_bias=value(self.w2_bias),
            e_score_correction_bias=value(self.e_score_correction_bias),
            shared_expert_gate_logits=self.shared_expert_gate_logits(x),
            implementation=self.implementation,
            recompute=self.recompute,
            return_router_losses=return_router_losses,
            seq_len=seq_len,
        )

    def shared_expert_gate_logits(self, x: jax.Array) -> jax.Array | None:
        """``x [T, H]`` -> ``shared_expert_gate_logits [T, S]`` float32 (``None`` without ``config.shared_expert_gate``):
        ``x @ shared_expert_gate.T`` in the weight's dtype (float32 accumulation at ``Precision.HIGHEST``, rounded
        to that dtype, as transformers' ``nn.Linear`` in Qwen3-Next and :meth:`MoEBlock.router_logits`), widened to
        float32; a ``[1, H]`` weight's one logit goes to every fused shared slot."""
        if self.shared_expert_gate is None:
            return None
        w = self.shared_expert_gate[...]
        H = self.config.hidden_size
        check_rank("MoELayer", "x", x, 2, f"[T, H] with H={H}")
        check_shape("MoELayer", "x", x, (None, H), f"[T, H] with H={H}")
        precision = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
        logits = jax.lax.dot_general(x.astype(w.dtype), w, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)
        logits = cast_rounded(logits, w.dtype).astype(jnp.float32)
        return jnp.broadcast_to(logits, (x.shape[0], self.config.num_fused_shared_experts))


class MoEBlock(nnx.Module):
    """A transformers sparse-MoE block in NNX: the router and :class:`MoELayer`, ``[B, S, H] -> [B, S, H]``.

    What ``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock`` and ``DeepseekV3MoE`` compute (transformers
    5.24, ``models/{mixtral,qwen3_moe,deepseek_v3}/modeling_*.py``), with the experts run by our layer:
    ``router_logits = hidden @ router_weight.T`` in the router weight's dtype (float32 accumulation,
    rounded to that dtype: bf16 logits for a bf16 Mixtral / Qwen3 router, float32 for DeepSeek-V3, whose
    ``gate.weight`` transformers keeps in float32), then ``layer(hidden [T, H], router_logits [T, E])``.
    DeepSeek-V3's shared experts are the layer's fused shared experts (``config.num_fused_shared_experts``,
    added with weight 1 as ``DeepseekV3MoE`` adds its ``shared_experts`` MLP). Qwen3-Next's
    ``shared_expert_gate`` (``sigmoid(x @ w.T)`` times the shared MLP) is the layer's own weight
    (:class:`MoELayer` ``shared_expert_gate``, ``config.shared_expert_gate``); Llama 4's input-scaled routing is
    ``config.apply_router_weight_on_input`` (both read from checkpoints by :func:`interop.hf_jax.load_nnx_moe_block`).
    gpt-oss's ``GptOssMLP`` has a router with a bias (transformers 5.24 ``GptOssTopKRouter``,
    ``models/gpt_oss/modeling_gpt_oss.py``: ``router_logits = F.linear(hidden_states, weight, bias)``): give it as
    ``router_bias``; its expert biases and clamped SwiGLU are the layer's (``config.expert_bias``,
    ``activation='swiglu_oai'``, ``gate_up_layout='interleaved'``). ``GptOssTopKRouter``'s softmax over the top-k
    logits is the contract's ``softmax_topk`` with ``renormalize=True``.

    Args:
      router_weight: ``[E, H]`` float32 / bf16 / float16, the ``gate.weight`` of the block (an ``nnx.Param``:
        ``nnx.grad`` reaches it through the gate weights, and the float experts through the layer).
      layer: the :class:`MoELayer` (this EP rank's experts, routing, ``e_score_correction_bias``).
      router_bias: ``None`` (default: no bias, every family but gpt-oss) or ``[E]`` float32, the router's bias
        (gpt-oss's ``router.bias``; a bf16 checkpoint's values widen to float32 exactly); an ``nnx.Param``, trained
        as ``GptOssTopKRouter.bias`` is. The logits are then ``x @ router_weight.T + router_bias``: the bias is added
        to the float32 accumulator and the sum rounded once to the router weight's dtype (:meth:`router_logits`).

    Under EP (``layer.config.ep_size > 1``) the output is this rank's partial sum, as the layer's.
    :func:`interop.hf_jax.load_nnx_moe_block` builds one from a Hugging Face checkpoint directory.

    Raises: TypeError (``router_weight`` not a float jax array, ``router_bias`` not a float32 jax array, ``layer``
      not a :class:`MoELayer`), ValueError (``router_weight`` not ``[E, H]``, ``router_bias`` not ``[E]`` of the
      layer's config), on the host, before anything is stored.

    The torch twin is ``moe_torch.MoEBlock`` (``moe_torch/module.py``: the same constructor and output, its weights
    under transformers' names, the shared experts as transformers' MLP); ``moe_torch.HFMoEBlock`` (``moe_torch/hf.py``)
    is what ``moe_torch.patch_hf_model`` puts in place of a transformers block. This one is built from a checkpoint
    (:func:`interop.hf_jax.load_nnx_moe_block`, saved back by :func:`interop.hf_jax.save_nnx_moe_block`) or a preset.
    """

    def __init__(self, router_weight: jax.Array, layer: MoELayer, *, router_bias: jax.Array | None = None) -> None:
        op = "MoEBlock"
        if not isinstance(layer, MoELayer):
            raise TypeError(f"{op}: layer must be a moe_pallas.MoELayer; got {type(layer).__module__}.{type(layer).__name__}")
        check_call_arrays(op, dict(router_weight=router_weight))
        c = layer.config
        check_shape(op, "router_weight", router_weight, (c.num_experts, c.hidden_size),
                    f"[E, H] = ({c.num_experts}, {c.hidden_size}) (the router of the layer's config)")
        check_dtype(op, "router_weight", router_weight, FLOAT_DTYPES)
        if router_bias is not None:  # gpt-oss: GptOssTopKRouter's bias, logits x @ W.T + b
            check_call_arrays(op, dict(router_bias=router_bias))
            check_shape(op, "router_bias", router_bias, (c.num_experts,),
                        f"[E] = ({c.num_experts},) float32 (the router's bias, one per expert of the layer's config)")
            check_dtype(op, "router_bias", router_bias, ("float32",))
        self.router_weight = nnx.Param(router_weight)
        self.router_bias = None if router_bias is None else nnx.Param(router_bias)
        self.layer = layer

    @classmethod
    def from_preset(
        cls,
        name: str,
        *,
        seed: int = 0,
        dtype=jnp.bfloat16,
        implementation: str | None = None,
        trainable: bool = True,
        recompute: bool = False,
        **config_overrides,
    ) -> "MoEBlock":
        """A block of preset ``name`` with random weights: the layer :meth:`MoELayer.from_preset` with the same
        arguments, the router :func:`moe_contract.inputs.draw_router` (``[E, H]`` ~ N(0, 1/H), cast to ``dtype``, but
        float32 for ``biased_grouped_topk``, whose router transformers keeps in float32; gpt-oss's ``router_bias [E]``
        rounded to ``dtype`` and held in float32). ``moe_torch.MoEBlock.from_preset`` with the same arguments holds
        the same bits (float blocks; an FP8 one there keeps its shared experts float).

        Raises: as :meth:`MoELayer.from_preset`.
        """
        layer = MoELayer.from_preset(name, seed=seed, dtype=dtype, implementation=implementation, trainable=trainable,
                                     recompute=recompute, **config_overrides)
        c, dtype = layer.config, jnp.dtype(dtype_name(dtype))
        weight, bias = draw_router(c, seed)
        weight = jnp.asarray(weight).astype(jnp.float32 if c.routing == "biased_grouped_topk" else dtype)
        # gpt-oss's router bias: the value a dtype model holds, in float32 (as load_nnx_moe_block gives it)
        bias = None if bias is None else jnp.asarray(bias).astype(dtype).astype(jnp.float32)
        return cls(weight, layer, router_bias=bias)

    @property
    def config(self) -> MoEConfig:
        return self.layer.config

    def router_logits(self, hidden_states: jax.Array) -> jax.Array:
        """``hidden_states [B, S, H]`` (or ``[T, H]``) -> ``router_logits [B*S, E]`` in the router weight's
        dtype (what transformers' routers return first, e.g. for an auxiliary load-balancing loss): ``x @ W.T``, or
        with a ``router_bias`` ``x @ W.T + router_bias`` (gpt-oss's ``GptOssTopKRouter``), the float32 bias added to
        the float32 accumulator before the one rounding to the weight's dtype (as ``F.linear``'s fused bias).

        A float32 router multiplies at ``Precision.HIGHEST`` (IEEE float32 products, as torch's
        ``F.linear``): XLA's GPU default for float32 dots is TF32-like (10-bit mantissas), which moved
        the block's output 7e-5 .. 2e-4 from transformers' on an H200. bf16 / float16 routers keep the
        default precision (their products are exact in float32 either way)."""
        w = self.router_weight[...]
        x = self._flat(hidden_states).astype(w.dtype)
        precision = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
        logits = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)
        if self.router_bias is not None:
            logits = logits + self.router_bias[...]
        return cast_rounded(logits, w.dtype)

    def __call__(self, hidden_states: jax.Array, *, return_router_losses: bool = False,
                 seq_len: int | None = None) -> jax.Array | tuple[jax.Array, RouterLosses]:
        """``hidden_states [B, S, H]`` (or ``[T, H]``) -> the block's output, same shape and dtype.

        ``hidden_states`` must have the layer's float dtype for ``quant='none'`` (any float dtype for FP8
        layers, whose activations are quantized per token group / per token by the layer).

        ``return_router_losses=True``: ``(out, RouterLosses)``, the router's training losses of the call
        (:meth:`MoELayer.__call__`), differentiable in the router's weights; ``seq_len`` (static) defaults to
        ``S`` for ``[B, S, H]`` hidden states (DeepSeek-V3's sequence-wise loss per sequence of the batch) and to
        ``None`` (no ``seq_aux_loss``) for ``[T, H]``.

        Raises: TypeError (not a jax array: a numpy array names ``jnp.asarray``; a dtype the layer does not
          take), ValueError (not ``[B, S, H]`` / ``[T, H]`` with the config's ``H``).
        """
        x = self._flat(hidden_states)
        if not return_router_losses:
            out = self.layer(x, self.router_logits(x), seq_len=seq_len)  # seq_len without the losses: the layer raises
            return out.reshape(hidden_states.shape)
        if seq_len is None and hidden_states.ndim == 3:
            seq_len = hidden_states.shape[1]
        out, losses = self.layer(x, self.router_logits(x), return_router_losses=True, seq_len=seq_len)
        return out.reshape(hidden_states.shape), losses

    def _flat(self, hidden_states) -> jax.Array:
        op = "MoEBlock"
        check_call_arrays(op, dict(hidden_states=hidden_states))
        H = self.config.hidden_size
        what = f"[B, S, H] or [T, H] with H={H}"
        check_rank(op, "hidden_states", hidden_states, (2, 3), what)
        check_shape(op, "hidden_states", hidden_states, (None,) * (hidden_states.ndim - 1) + (H,), what)
        check_dtype(op, "hidden_states", hidden_states, FLOAT_DTYPES)
        want = dtype_name(self.layer.w13[...])
        if self.config.quant == "none" and dtype_name(hidden_states) != want:
            raise TypeError(f"{op}: hidden_states must have the layer's dtype {want} (quant='none'); "
                            f"got hidden_states.dtype={dtype_name(hidden_states)}")
        return hidden_states.reshape(-1, H)
