"""Expert-parallel MoE layer across devices: the stages of ``layer.py`` under ``jax.shard_map``.

The mesh has one axis, ``"ep"``, of ``ep_size`` devices; device ``r`` is EP rank ``r`` and owns
the experts of ``config.local_expert_range(r)`` (CONTRACT.md section 6): routed experts
``[r * E/ep, (r + 1) * E/ep)``, and on the last rank also the ``S`` fused shared experts.
Names: ``T`` tokens, ``T_pad`` = ``T`` rounded up to a multiple of ``ep``, ``T_l = T_pad / ep``,
``K' = topk + S`` slots per token, ``E_lmax = E/ep + S`` (the largest local expert count),
``b`` bytes per element of ``x``.

Two dispatch modes (both jit; every buffer has a static worst-case capacity)::

  mode="replicated"  (SGLang ``EPMoE``: sglang/srt/layers/moe/ep_moe/layer.py)
    x [T, H], router_logits [T, E] replicated on every device
    every device: gate (identical everywhere) -> routing metadata for its own experts only
      (other ranks' slots are non-local and never enter its buffers) -> permute -> GEMM w13
      -> act_and_mul -> GEMM w2 -> combine in float32 -> partial [T, H] float32
    psum (out replicated) or psum_scatter (out sharded over tokens), cast once to x.dtype

  mode="all_to_all"  (DeepEP dispatch / combine: deepseek-ai/DeepEP, ``Buffer.dispatch``/``combine``)
    x [T, H], router_logits [T, E] sharded over tokens: device r holds rows [r*T_l, (r+1)*T_l)
    home device:  gate on its T_l tokens; destination of slot (t, j) = owner of topk_ids[t, j]
      (a shared slot goes to the last rank); the (token, slot) rows are grouped by destination
      with the routing-metadata stage itself (destinations as "experts"): send buffer [C, H],
      C = T_l * K' (static: in the worst case every slot goes to one device)
    dispatch:     ragged all-to-all of the rows and their expert ids -> owner's receive buffer
      [ep * C, H], source s's rows at [s*C, s*C + n_s)
    owner:        routing metadata of the received rows (topk 1) over its local experts ->
      permute (+FP8 quant) -> GEMM -> act -> GEMM -> un-permute back to receive order
    combine:      ragged all-to-all in reverse: each row returns to its slot of the home send
      buffer; the home device runs the combine stage with its topk_weights (float32
      accumulation, rsf per the config, cast once): bit-for-bit the single-device combine.

Capacity (``config.capacity_factor``, CONTRACT.md section 2, "Capacity"): per expert, over the layer call's
``T`` tokens. "replicated": every device drops the same slots from the gate's ids (it sees all ``T`` tokens).
"all_to_all": the owner drops the received rows beyond ``C``: they arrive by source device, each in (token,
slot) order, which is the global token order; a dropped row's output is 0 at home. No collective of its own.

Weights: a shard_map shard must be the same size on every device, but the last rank owns
``E/ep + S`` experts and the others ``E/ep``. :func:`shard_expert_weights` pads every rank's
slab to ``E_lmax`` experts with zero experts (and zero scales) that no row is ever routed to,
so a global ``[E + S, ...]`` tensor becomes ``[ep * E_lmax, ...]`` sharded along the expert
axis. The grouped GEMM skips experts with zero rows, so the padding costs memory
(``(ep - 1) * S`` experts), not time. With ``S == 0`` it is a plain even shard.

Collectives (``jax.lax``; never hand-made, CONTRACT.md section 6): ``psum`` / ``psum_scatter``
for "replicated"; ``all_to_all`` of the per-destination sizes and offsets, then
``ragged_all_to_all`` for the rows in "all_to_all" mode. **CPU fallback**: XLA:CPU in jax 0.11.2
does not implement ``ragged_all_to_all`` (``UNIMPLEMENTED: HLO opcode ragged-all-to-all is not
supported by XLA:CPU ThunkEmitter``), so on a CPU mesh the same exchange runs as a dense
``jax.lax.all_to_all`` of fixed-capacity ``[ep, C, ...]`` blocks (same result, ``ep`` times the
worst-case ragged volume); the fallback is logged. GPU meshes use ``ragged_all_to_all`` when
``XLA_FLAGS`` holds :data:`RAGGED_ALL_TO_ALL_DECOMPOSER_FLAG` and the dense exchange otherwise (XLA:GPU's
native ragged op measured far slower than either in jax 0.11.2, BENCHMARKS.md; :func:`ep_moe_forward`'s ``exchange``).

Backward (CONTRACT.md section 8, "EP"): ``jax.grad`` / ``jax.vjp`` of the layer, under ``jit``, in both
modes and both exchanges. The expert stages and the combine run through
:func:`moe_pallas.layer.routed_experts` (the layer's own ``custom_vjp``: the stages' backward ops, FP8
straight-through, ``recompute``), the gate through ``select_experts``' ``custom_vjp``, and every
collective has its transpose in JAX (``psum`` -> ``psum``, ``psum_scatter`` -> ``all_gather``,
``all_gather`` -> ``psum_scatter``, ``all_to_all`` -> the reverse ``all_to_all``, ``ragged_all_to_all``
-> the reverse ``ragged_all_to_all``; the dense exchange's gathers and drop-scatters transpose to
scatter-adds and gathers). With ``check_vma=False`` the ``shard_map`` transpose divides a replicated
output's cotangent by ``ep`` and sums a replicated input's over ``"ep"``, which with ``psum``'s
self-transpose gives: each device's weight gradient is its slice of the single-device gradient (in
the padded ``[ep * E_lmax, ...]`` layout, or the global ``[E + S, ...]`` one when that was passed), and
``d_x`` / ``d_router_logits`` are the single-device ones (the sums over devices).
"""

from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moe_contract.config import MoEConfig
from moe_contract.op_checks import check_router_loss_option
from moe_contract.validation import (check_choice, check_config, check_expert_biases, check_layer_inputs,
                                      check_positive_int, check_rank, check_shared_expert_gate_logits,
                                      stage_implementation)
from moe_pallas.capacity import drop_over_capacity
from moe_pallas.layer import LAYER_IMPLEMENTATIONS, check_w4_implementation, dispatch_ids, routed_experts, run_gate
from moe_pallas.ops.combine import api as combine_api
from moe_pallas.ops.combine.api import combine
from moe_pallas.ops.common import takes_jax_arrays
from moe_pallas.ops.dispatch import check_implementation
from moe_pallas.ops.gate.losses import RouterLosses, router_losses
from moe_pallas.ops.permute import api as permute_api
from moe_pallas.ops.permute.api import permute, routing_metadata
from moe_pallas.slot_weights import scaled_slot_rows, slot_weights

log = logging.getLogger("moe_pallas")

#: The mesh axis EP runs over.
EP_AXIS = "ep"
MODES = ("replicated", "all_to_all")
OUT_SHARDINGS = ("replicated", "tokens")
EXCHANGES = ("ragged", "dense")
#: XLA:GPU flag that rewrites ``ragged_all_to_all`` into dense collectives: in jax 0.11.2 the native op made the
#: all_to_all-mode step an order of magnitude slower than this flag or ``exchange="dense"`` (BENCHMARKS.md).
#: XLA reads it when its GPU backend starts: put it in ``XLA_FLAGS`` before the first jax call.
RAGGED_ALL_TO_ALL_DECOMPOSER_FLAG = "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer"


@functools.cache
def _xla_flags_at_first_use() -> str:
    """``XLA_FLAGS`` as first read here. XLA reads it once, when its backend starts; the first EP call
    comes after that (its mesh needs the devices), so this is what XLA saw unless it was changed in
    between, and later changes (which XLA ignores) are ignored here too."""
    return os.environ.get("XLA_FLAGS", "")


def ragged_decomposer_enabled(xla_flags: str | None = None) -> bool:
    """Whether ``xla_flags`` (default: ``XLA_FLAGS`` as XLA saw it, see :func:`_xla_flags_at_first_use`)
    turns on :data:`RAGGED_ALL_TO_ALL_DECOMPOSER_FLAG` (``--flag``, ``--flag=true`` or ``=1``, any case;
    the last setting wins, as in XLA's parser). A value that does not start with ``-`` names a file
    of flags, as XLA reads it. Raises TypeError for a non-string."""
    if xla_flags is not None and not isinstance(xla_flags, str):
        raise TypeError(f"ragged_decomposer_enabled: xla_flags must be a str (XLA_FLAGS' text) or None; "
                        f"got {type(xla_flags).__name__}")
    flags = _xla_flags_at_first_use() if xla_flags is None else xla_flags
    path = flags.strip()
    if path and not path.startswith("-") and os.path.isfile(path):
        with open(path) as f:
            flags = f.read()
    on = False
    for token in flags.split():
        name, eq, value = token.partition("=")
        if name == RAGGED_ALL_TO_ALL_DECOMPOSER_FLAG:
            on = (not eq) or value.lower() in ("true", "1")
    return on


def make_ep_mesh(ep_size: int, devices=None) -> Mesh:
    """A 1-D mesh ``("ep",)`` of the first ``ep_size`` devices (``jax.devices()`` by default).

    The axis type is ``Auto``, so ``jit`` reshards arguments to the specs of
    :func:`ep_moe_forward` as needed. Raises ValueError if fewer than ``ep_size`` devices exist
    (on a CPU: set ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before jax starts).
    """
    op = "make_ep_mesh"
    check_positive_int(op, "ep_size", ep_size)
    devices = list(jax.devices() if devices is None else devices)
    if ep_size > len(devices):
        raise ValueError(
            f"{op}: ep_size must be <= the number of devices (={len(devices)}); got ep_size={ep_size} "
            "(on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N before jax initializes)"
        )
    return Mesh(np.array(devices[:ep_size]), (EP_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def _check_mesh(op: str, config: MoEConfig, mesh) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{op}: mesh must be a jax.sharding.Mesh (see make_ep_mesh); got {type(mesh).__name__}")
    if EP_AXIS not in mesh.axis_names:
        raise ValueError(f"{op}: mesh must have an axis named {EP_AXIS!r}; got mesh.axis_names={mesh.axis_names}")
    ep = int(mesh.shape[EP_AXIS])
    if config.ep_size != ep:
        raise ValueError(
            f"{op}: config.ep_size must equal the size of mesh axis {EP_AXIS!r} (={ep}); got config.ep_size={config.ep_size}"
        )
    return ep


def _local_counts(config: MoEConfig) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """``(E_lmax, starts, counts)`` of every rank's expert range."""
    ranges = [config.local_expert_range(r) for r in range(config.ep_size)]
    return max(n for _, n in ranges), tuple(s for s, _ in ranges), tuple(n for _, n in ranges)


def pad_expert_weights(w: jax.Array, config: MoEConfig) -> jax.Array:
    """Global ``[E + S, ...]`` -> ``[ep * E_lmax, ...]``: rank ``r``'s experts, then zero experts up
    to ``E_lmax = E/ep + S`` each (the layout :func:`ep_moe_forward` shards). Unchanged if ``S == 0``."""
    e_lmax, starts, counts = _local_counts(config)
    if w.shape[0] == config.ep_size * e_lmax:
        return w
    slabs = []
    for start, n in zip(starts, counts):
        slab = w[start : start + n]
        if n < e_lmax:
            slab = jnp.concatenate([slab, jnp.zeros((e_lmax - n, *w.shape[1:]), w.dtype)])
        slabs.append(slab)
    return jnp.concatenate(slabs)


@takes_jax_arrays
def shard_expert_weights(w: jax.Array, config: MoEConfig, mesh: Mesh) -> jax.Array:
    """Put a global expert tensor (weight, weight scale or expert bias) onto the mesh, sharded over experts.

    Args:
      w: ``[E + S, ...]`` (e.g. ``w13 [E + S, 2I, H]``, ``w2 [E + S, H, I]``, scales ``[E + S]``,
        ``[E + S, N]`` or ``[E + S, nb, kb]``, 4-bit codes and scales, biases ``[E + S, N]``), any dtype.
      config: the layer; ``config.ep_size`` must equal the mesh's ``"ep"`` size.
      mesh: from :func:`make_ep_mesh`.

    Returns: ``[ep * E_lmax, ...]`` with ``NamedSharding(mesh, P("ep"))``: device ``r`` holds rank
    ``r``'s experts padded with zero experts to ``E_lmax = E/ep + S`` (see the module docstring).
    Call it once per layer, not per step.
    """
    op = "shard_expert_weights"
    check_config(op, config)
    _check_mesh(op, config, mesh)
    check_rank(op, "w", w, (1, 2, 3), "[E + S, ...]")
    if w.shape[0] != config.num_total_experts:
        raise ValueError(
            f"{op}: w must be [E + S, ...] with E + S = {config.num_total_experts} (every expert of the layer); "
            f"got w.shape={tuple(w.shape)}"
        )
    return jax.device_put(pad_expert_weights(jnp.asarray(w), config), NamedSharding(mesh, P(EP_AXIS)))


def _ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, ep, capacity, dense):
    """``jax.lax.ragged_all_to_all`` over ``"ep"``, or (``dense``) the same exchange as one dense
    ``all_to_all`` of ``[ep, capacity, ...]`` blocks, for backends without the ragged op (XLA:CPU).

    Same arguments and result as ``ragged_all_to_all``; ``capacity`` bounds every ``send_sizes``.
    """
    if not dense:
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=EP_AXIS)
    i = jnp.arange(capacity, dtype=jnp.int32)
    trailing = (1,) * (operand.ndim - 1)
    send_ok = i[None, :] < send_sizes[:, None]  # [ep, C]
    blocks = operand[jnp.where(send_ok, input_offsets[:, None] + i[None, :], 0)]  # [ep, C, ...]
    blocks = jnp.where(send_ok.reshape(ep, capacity, *trailing), blocks, jnp.zeros((), operand.dtype))
    received = jax.lax.all_to_all(blocks, EP_AXIS, 0, 0, tiled=True)  # [ep, C, ...], block s from source s
    where_to = jax.lax.all_to_all(output_offsets, EP_AXIS, 0, 0, tiled=True)  # [ep]: source s's slice starts here
    recv_ok = i[None, :] < recv_sizes[:, None]
    rows = jnp.where(recv_ok, where_to[:, None] + i[None, :], output.shape[0])  # out of bounds: dropped
    return output.at[rows.reshape(-1)].set(received.reshape(ep * capacity, *operand.shape[1:]), mode="drop")


def ep_moe_forward(
    x: jax.Array,
    router_logits: jax.Array,
    w13: jax.Array,
    w2: jax.Array,
    config: MoEConfig,
    *,
    mesh: Mesh,
    mode: str = "replicated",
    w13_scale: jax.Array | None = None,
    w2_scale: jax.Array | None = None,
    w13_bias: jax.Array | None = None,
    w2_bias: jax.Array | None = None,
    e_score_correction_bias: jax.Array | None = None,
    shared_expert_gate_logits: jax.Array | None = None,
    implementation: str | None = None,
    out_sharding: str = "replicated",
    exchange: str | None = None,
    recompute: bool = False,
    return_router_losses: bool = False,
    seq_len: int | None = None,
) -> jax.Array | tuple[jax.Array, RouterLosses]:
    """One MoE layer over an ``"ep"`` mesh of ``config.ep_size`` devices: ``[T, H] -> [T, H]``.

    Equals the single-device layer (:func:`moe_pallas.moe_forward` with ``ep_size=1``) to float32
    rounding (CONTRACT.md section 6). Jit with ``static_argnames=("config", "mesh", "mode",
    "implementation", "out_sharding", "exchange", "recompute")``. Differentiable in ``x``,
    ``router_logits``, float ``w13`` / ``w2`` and the expert biases (module docstring, "Backward").

    Args:
      x: ``[T, H]`` float32 / bf16 / float16, any sharding (``jit`` reshards it to the mode's
        layout: replicated, or split over tokens for ``"all_to_all"``).
      router_logits: ``[T, E]`` float.
      w13: ``[ep * E_lmax, 2I, H]`` from :func:`shard_expert_weights` (preferred: padded and placed
        once), or the global ``[E + S, 2I, H]`` (padded inside, on every call). ``x.dtype`` for
        ``quant='none'``, float8_e4m3fn for FP8, packed 4-bit codes (``[..., 2I, H // 2]`` uint8) for
        ``quant='mxfp4'`` / ``'int4'``.
      w2: ``[ep * E_lmax, H, I]`` or ``[E + S, H, I]`` (4-bit ``[..., H, I // 2]``), the same way.
      config: the layer; ``config.ep_size`` must equal the mesh's ``"ep"`` size (``ep_rank`` is ignored:
        every device is its own rank); ``config.capacity_factor``: the module docstring's "Capacity".
      mesh: a mesh with an ``"ep"`` axis (:func:`make_ep_mesh`).
      mode: ``"replicated"`` (SGLang EPMoE: every device sees all tokens, sums partial outputs) or
        ``"all_to_all"`` (DeepEP-style: tokens split over devices, rows travel to expert owners).
      w13_scale, w2_scale: FP8 / 4-bit weight scales with the same leading expert axis as the weights.
      w13_bias, w2_bias: the expert biases ``[.., 2I]`` / ``[.., H]`` (``config.expert_bias`` exactly, as
        :func:`moe_pallas.moe_forward`), with the same leading expert axis as the weights (padded, or ``E + S``).
      e_score_correction_bias: ``[E]`` float32 (``routing='biased_grouped_topk'``), replicated.
      shared_expert_gate_logits: ``[T, S]`` float32 or ``x.dtype``, laid out as ``router_logits``, exactly when
        ``config.shared_expert_gate`` (as :func:`moe_pallas.moe_forward`). ``config.apply_router_weight_on_input``
        scales the expert inputs on the device that holds the token (``"all_to_all"``: before the dispatch,
        so the rows travel scaled).
      implementation: a backend name passed to every stage that has it (``"reference"`` on a CPU;
        ``"pallas_triton"`` / ``"pallas_mosaic_gpu"`` / ``None`` on a GPU), as in ``moe_forward``.
      out_sharding: ``"replicated"`` (every device holds ``[T, H]``) or ``"tokens"`` (split over
        devices along T: ``P("ep")`` of ``[T_pad, H]`` inside, sliced to ``[T, H]``).
      exchange: how ``"all_to_all"`` mode moves rows (replicated mode ignores it): ``"ragged"``
        (``jax.lax.ragged_all_to_all``; GPU meshes only), ``"dense"`` (one ``all_to_all`` of
        fixed-capacity blocks, see below), or
        ``None``: ragged on a GPU mesh of ``ep > 1`` when ``XLA_FLAGS`` holds
        :data:`RAGGED_ALL_TO_ALL_DECOMPOSER_FLAG`, else dense (the native ragged op
        was an order of magnitude slower than either, and for ``ep == 1``, a local copy, slower still;
        BENCHMARKS.md).
      recompute: what the forward keeps for the backward (static), as :func:`moe_pallas.moe_forward`'s
        (``False``: the routing and GEMM 1's output; ``True``: the routing only).
      return_router_losses: also return the router's training losses of the layer call (CONTRACT.md section 10;
        static): :func:`moe_pallas.ops.gate.losses.router_losses` of the global ``router_logits [T, E]`` and the
        gate's ids (an integer output of the ``shard_map``), computed outside the ``shard_map``: the global
        losses, differentiable in ``router_logits`` by ``jax.grad``.
      seq_len: with ``return_router_losses``, the tokens of one sequence (dividing ``T``; static) for
        ``seq_aux_loss``; ``None``: no ``seq_aux_loss``.

    Returns: ``out [T, H]`` in ``x.dtype``; with ``return_router_losses``: ``(out, RouterLosses)``, as
    :func:`moe_pallas.moe_forward`.

    Gradients (CONTRACT.md section 8): ``x``, ``router_logits``, ``shared_expert_gate_logits`` as the
    single-device layer's; ``w13`` /
    ``w2``, the expert biases (and zero cotangents for the scales) in the layout passed in, each device's
    experts' rows the single-device gradient's; the padding experts' rows 0. FP8 and 4-bit layers:
    straight-through, the codes get zero cotangents (4-bit: none).

    T not divisible by ``ep``: where the tokens are split (``"all_to_all"``, or
    ``out_sharding="tokens"``) ``T`` is padded to ``T_pad``; padded rows are masked (no slot is
    sent, their output is 0) and sliced off at the end, so the result is ``[T, H]`` whatever ``T``.

    Communication per device per layer (``K'`` slots, ``b`` bytes per ``x`` element):
      "replicated": ``psum`` of ``[T, H]`` float32 (ring all-reduce: about ``2 (ep-1)/ep * T*H*4``
        bytes sent), or ``psum_scatter``: ``(ep-1)/ep * T_pad*H*4`` bytes. The partials travel in
        float32 so that the ranks' sum is rounded to ``x.dtype`` once (CONTRACT.md section 5), at
        twice SGLang's bf16 all-reduce volume.
      "all_to_all" (ragged, GPU): dispatch sends each routed (token, slot) row once, ``H*b + 4``
        bytes (row + int32 expert id), combine returns ``H*b`` bytes for it: on average about
        ``(ep-1)/ep * T_l*K' * (2*H*b + 4)`` bytes off-device, at most ``T_l*K' * (2*H*b + 4)``,
        plus two ``all_to_all`` of ``ep`` int32 sizes/offsets. A shared slot always goes to the
        last rank. Dense CPU fallback: ``ep * T_l*K' * (2*H*b + 4)`` bytes, whatever the routing.
        Rows travel in ``x.dtype`` and are FP8-quantized on the owner (per-token quantization
        is row-local, so this is identical to quantizing at home; DeepEP's FP8 dispatch would
        halve the dispatch bytes, not done yet).

    Raises: ValueError / TypeError naming the argument, before any computation (mesh size vs
      ``config.ep_size``, mode, shapes, dtypes, ``recompute`` not a bool).
    """
    op = "ep_moe_forward"
    check_config(op, config)
    if not isinstance(recompute, bool):
        raise TypeError(f"{op}: recompute must be a bool; got {type(recompute).__name__} {recompute!r}")
    check_router_loss_option(op, config, router_logits, return_router_losses, seq_len)
    ep = _check_mesh(op, config, mesh)
    check_choice(op, "mode", mode, MODES)
    check_choice(op, "out_sharding", out_sharding, OUT_SHARDINGS)
    if mode == "all_to_all":
        dense = dense_exchange(op, mesh, exchange)
    else:  # replicated mode exchanges no rows: only the spelling of `exchange` is checked
        if exchange is not None:
            check_choice(op, "exchange", exchange, EXCHANGES)
        dense = True
    check_implementation(op, implementation, LAYER_IMPLEMENTATIONS)
    check_w4_implementation(op, config, implementation)
    e_lmax, starts, counts = _local_counts(config)
    e_all = config.num_total_experts
    arrays = {"w13": w13, "w2": w2, "w13_scale": w13_scale, "w2_scale": w2_scale, "w13_bias": w13_bias,
              "w2_bias": w2_bias}
    for name, a in arrays.items():
        if a is None:
            continue
        check_rank(op, name, a, (1, 2, 3), "[ep * E_lmax, ...] or [E + S, ...]")
        if a.shape[0] not in (ep * e_lmax, e_all):
            raise ValueError(
                f"{op}: {name} must have a leading expert axis of ep * E_lmax = {ep * e_lmax} "
                f"(shard_expert_weights) or E + S = {e_all} (global); got {name}.shape={tuple(a.shape)}"
            )
    # One rank's view (the last rank's: E_local = E_lmax) checks every shape and dtype rule.
    per_rank = {name: None if a is None else jax.ShapeDtypeStruct((e_lmax, *a.shape[1:]), a.dtype) for name, a in arrays.items()}
    check_layer_inputs(
        op, config.for_rank(ep - 1), x, router_logits, per_rank["w13"], per_rank["w2"], per_rank["w13_scale"], per_rank["w2_scale"]
    )
    check_expert_biases(op, config.for_rank(ep - 1), x, per_rank["w13_bias"], per_rank["w2_bias"])
    check_shared_expert_gate_logits(op, config, x, shared_expert_gate_logits)
    shared = shared_expert_gate_logits
    w13, w2 = pad_expert_weights(w13, config), pad_expert_weights(w2, config)
    w13_scale = None if w13_scale is None else pad_expert_weights(w13_scale, config)
    w2_scale = None if w2_scale is None else pad_expert_weights(w2_scale, config)
    w13_bias = None if w13_bias is None else pad_expert_weights(w13_bias, config)
    w2_bias = None if w2_bias is None else pad_expert_weights(w2_bias, config)

    if mode == "all_to_all" and dense and exchange is None and ep > 1:
        _log_cpu_fallback()

    T, H = x.shape
    T_pad = -(-T // ep) * ep
    logits_in = router_logits  # the caller's (global, unpadded): the router losses read these
    extra = {}
    if mode == "replicated":
        # float32 across the shard_map boundary (the body casts back: exact, the forward is unchanged): the
        # transpose sums the replicated inputs' cotangents over "ep" (a psum) in float32, rounded once, as the
        # forward sums the partials (and moe_torch's backward all-reduce). Costs a convert of x otherwise.
        extra = dict(in_dtypes=(x.dtype, router_logits.dtype, None if shared is None else shared.dtype))
        x, router_logits = x.astype(jnp.float32), router_logits.astype(jnp.float32)
        shared = None if shared is None else shared.astype(jnp.float32)
    body = functools.partial(
        _replicated_body if mode == "replicated" else _all_to_all_body,
        config=config, ep=ep, e_lmax=e_lmax, starts=starts, counts=counts,
        implementation=implementation, out_sharding=out_sharding, T=T, T_pad=T_pad, dense=dense, recompute=recompute,
        **extra,
    )
    tokens = P() if mode == "replicated" else P(EP_AXIS)
    if mode == "all_to_all" and T_pad != T:
        x = jnp.pad(x, ((0, T_pad - T), (0, 0)))
        router_logits = jnp.pad(router_logits, ((0, T_pad - T), (0, 0)))
        shared = None if shared is None else jnp.pad(shared, ((0, T_pad - T), (0, 0)))
    experts = P(EP_AXIS)
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(tokens, tokens, experts, experts, experts, experts, P(), tokens, experts, experts),
        # topk_ids: every device's all T (replicated mode) or its own tokens' rows (all_to_all)
        out_specs=(P() if out_sharding == "replicated" else P(EP_AXIS), tokens),
        # Off: ragged_all_to_all types its result like `output` (a fresh zeros buffer, "replicated")
        # although every device receives different rows, and a psum of a value typed replicated
        # multiplies it by ep. The out_specs are right by construction (psum / all_gather results).
        check_vma=False,
    )
    out, topk_ids = fn(x, router_logits, w13, w2, w13_scale, w2_scale, e_score_correction_bias, shared, w13_bias,
                       w2_bias)
    out = out[:T] if out.shape[0] != T else out
    if not return_router_losses:
        return out
    # Outside the shard_map, on the global logits: jax.grad differentiates the losses itself.
    return out, router_losses(logits_in, topk_ids[:T], config, seq_len=seq_len)


def dense_exchange(op: str, mesh: Mesh, exchange: str | None) -> bool:
    """Whether ``"all_to_all"`` mode exchanges rows densely on ``mesh`` (``exchange`` as in
    :func:`ep_moe_forward`). Raises ValueError for an unknown ``exchange``, or ``"ragged"`` on a CPU
    mesh (XLA:CPU has no ``ragged_all_to_all``)."""
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    if exchange is None:
        if on_cpu or mesh.shape[EP_AXIS] == 1:
            return True
        if ragged_decomposer_enabled():
            return False
        _log_dense_default()
        return True
    check_choice(op, "exchange", exchange, EXCHANGES)
    if exchange == "ragged" and on_cpu:
        raise ValueError(f"{op}: exchange='ragged' needs a GPU mesh (XLA:CPU does not implement ragged_all_to_all); "
                         f"got a mesh of {mesh.devices.flat[0].platform} devices")
    return exchange == "dense"


@functools.cache
def _log_dense_default() -> None:
    log.info(
        "ep_moe_forward: mode='all_to_all' exchanges rows with a dense all_to_all (XLA:GPU's native "
        "ragged_all_to_all is far slower); XLA_FLAGS=%s=true before jax starts makes "
        "exchange=None use ragged_all_to_all, decomposed (the fastest measured)", RAGGED_ALL_TO_ALL_DECOMPOSER_FLAG)


@functools.cache
def _log_cpu_fallback() -> None:
    log.warning(
        "ep_moe_forward: ragged_all_to_all is not implemented by XLA:CPU; mode='all_to_all' uses a dense "
        "all_to_all of fixed-capacity buffers on this CPU mesh (same result, ep times the bytes)"
    )


def _to_local_ids(ids, starts, counts, e_lmax):
    """Global expert ids -> this device's local ids in ``[0, E_lmax)``; other ranks' experts (and
    ids < 0, "no row") -> ``E_lmax``, one past the end, which the routing metadata treats as
    non-local. The rank (``axis_index``) is traced, so its range comes from small constant tables."""
    rank = jax.lax.axis_index(EP_AXIS)
    start = jnp.asarray(starts, jnp.int32)[rank]
    count = jnp.asarray(counts, jnp.int32)[rank]
    local = ids.astype(jnp.int32) - start
    return jnp.where((local >= 0) & (local < count), local, e_lmax)


def _experts(x, topk_weights, local_ids, w13, w2, w13_scale, w2_scale, *, config, e_lmax, implementation,
             routed_scaling_factor, out_dtype, recompute, input_scale=None, biases=(None, None)):
    """This device's experts on rows ``x [R, H]`` with ids ``local_ids [R, topk]`` (``E_lmax`` = not
    here; inputs scaled by ``input_scale``, if given; ``biases``: this device's ``(w13_bias, w2_bias)``),
    combined with ``topk_weights``: ``[R, H]`` in ``out_dtype``, the expert stages and combine of
    ``moe_forward`` with its backward (:func:`moe_pallas.layer.routed_experts`)."""
    return routed_experts(x, topk_weights, local_ids, w13, w2, config, w13_scale=w13_scale, w2_scale=w2_scale,
                          implementation=implementation, num_experts=e_lmax + 1, expert_start=0, num_local_experts=e_lmax,
                          routed_scaling_factor=routed_scaling_factor, out_dtype=out_dtype, recompute=recompute,
                          input_scale=input_scale, w13_bias=biases[0], w2_bias=biases[1])


def _replicated_body(x, router_logits, w13, w2, w13_scale, w2_scale, bias, shared, w13_bias, w2_bias, *, config, ep,
                     e_lmax, starts, counts, implementation, out_sharding, T, T_pad, dense, recompute, in_dtypes):
    """Per device: all ``T`` tokens, its own experts; partial ``[T, H]`` float32 summed over ``"ep"``.
    ``x``, ``router_logits`` (and ``shared``, the shared-expert gate logits) arrive in float32 and are cast
    back to ``in_dtypes`` here. Returns ``(out, topk_ids [T, K'])``."""
    x, router_logits = x.astype(in_dtypes[0]), router_logits.astype(in_dtypes[1])
    shared = None if shared is None else shared.astype(in_dtypes[2])
    topk_weights, topk_ids = run_gate(router_logits, config, bias, implementation)
    combine_weights, input_scale = slot_weights(topk_weights, shared, config)  # autodiff: plain jnp
    # Every device sees all T tokens' ids, so each drops the same slots (capacity per expert, globally).
    local_ids = _to_local_ids(dispatch_ids(topk_ids, config, implementation), starts, counts, e_lmax)
    partial = _experts(x, combine_weights, local_ids, w13, w2, w13_scale, w2_scale, config=config, e_lmax=e_lmax,
                       implementation=implementation, routed_scaling_factor=config.combine_routed_scaling_factor,
                       out_dtype=jnp.float32, recompute=recompute, input_scale=input_scale, biases=(w13_bias, w2_bias))
    if out_sharding == "replicated":
        out = jax.lax.psum(partial, EP_AXIS)
    else:  # psum_scatter splits T evenly: pad the partial to T_pad rows (zeros), sliced off outside
        out = jax.lax.psum_scatter(jnp.pad(partial, ((0, T_pad - T), (0, 0))), EP_AXIS, scatter_dimension=0, tiled=True)
    return out.astype(x.dtype), topk_ids  # float32 -> x.dtype once: exact for float32, one rounding for bf16


def _all_to_all_body(x, router_logits, w13, w2, w13_scale, w2_scale, bias, shared, w13_bias, w2_bias, *, config, ep,
                     e_lmax, starts, counts, implementation, out_sharding, T, T_pad, dense, recompute):
    """Per device: its ``T_l`` tokens; rows to the expert owners and back (module docstring).
    ``apply_router_weight_on_input``: the rows are scaled at home, before the dispatch.
    Returns ``(out, topk_ids [T_l, K'])``."""
    T_l, H = x.shape
    K = config.num_slots
    C = T_l * K  # send capacity: every slot of every local token, if all go to one device
    rank = jax.lax.axis_index(EP_AXIS)
    per_rank = config.num_experts // ep
    permute_impl = stage_implementation(implementation, permute_api)

    topk_weights, topk_ids = run_gate(router_logits, config, bias, implementation)
    combine_weights, input_scale = slot_weights(topk_weights, shared, config)  # autodiff: plain jnp
    # Destination device of each slot; padding tokens (global row >= T) get `ep`: sent nowhere.
    dest = jnp.minimum(topk_ids.astype(jnp.int32) // per_rank, ep - 1)  # shared ids E.. -> last rank
    token = rank * T_l + jnp.arange(T_l, dtype=jnp.int32)
    dest = jnp.where((token < T)[:, None], dest, ep)
    # Group the (token, slot) rows by destination: the routing-metadata stage with devices as experts.
    send = routing_metadata(dest, ep + 1, expert_start=0, num_local_experts=ep, implementation=permute_impl)
    # (apply_router_weight_on_input: the scaled slot rows x[t] * w[t, j], gathered one per assignment)
    x_rows, k_rows = (x, K) if input_scale is None else (scaled_slot_rows(x, input_scale), 1)
    x_send, _ = permute(x_rows, send.dst2src, topk=k_rows, implementation=permute_impl)  # [C, H]
    ids_send = jnp.where(send.dst2src >= 0, topk_ids.reshape(C).astype(jnp.int32)[jnp.maximum(send.dst2src, 0)], -1)
    send_offsets = send.expert_offsets[:-1]  # [ep]: my rows for device d start here
    send_sizes = jnp.diff(send.expert_offsets)  # [ep]
    recv_sizes = jax.lax.all_to_all(send_sizes, EP_AXIS, 0, 0, tiled=True)  # [ep]: rows source s sends me
    home_offsets = jax.lax.all_to_all(send_offsets, EP_AXIS, 0, 0, tiled=True)  # [ep]: where they sit at home
    # Receive layout: source s's rows at [s*C, s*C + recv_sizes[s]); the rest stays empty (id -1).
    slot_of = jnp.arange(ep, dtype=jnp.int32) * C
    my_slot = jnp.full((ep,), rank * C, jnp.int32)
    exchange = functools.partial(_ragged_exchange, ep=ep, capacity=C, dense=dense)
    x_recv = exchange(x_send, jnp.zeros((ep * C, H), x.dtype), send_offsets, send_sizes, my_slot, recv_sizes)
    ids_recv = exchange(ids_send, jnp.full((ep * C,), -1, jnp.int32), send_offsets, send_sizes, my_slot, recv_sizes)

    # Source s's rows sit before source s+1's, each in (token, slot) order: the global token order, so the owner
    # alone drops the slots over its experts' capacity (C from the static T). A dropped row's y is 0.
    ids_recv = drop_over_capacity(ids_recv[:, None], config, num_tokens=T, implementation=permute_impl)[:, 0]
    local_ids = _to_local_ids(ids_recv, starts, counts, e_lmax)[:, None]  # [ep*C, 1]
    # The experts, un-permuted to receive order (weight 1, no rsf, cast back to x.dtype: exact), then each row home.
    y_recv = _experts(x_recv, jnp.ones((ep * C, 1), jnp.float32), local_ids, w13, w2, w13_scale, w2_scale, config=config,
                      e_lmax=e_lmax, implementation=implementation, routed_scaling_factor=1.0, out_dtype=x.dtype,
                      recompute=recompute, biases=(w13_bias, w2_bias))
    y_home = exchange(y_recv, jnp.zeros((C, H), x.dtype), slot_of, recv_sizes, home_offsets, send_sizes)  # [C, H], send order
    out = combine(y_home, send.src2dst, combine_weights, routed_scaling_factor=config.combine_routed_scaling_factor, out_dtype=x.dtype,
                  implementation=stage_implementation(implementation, combine_api))  # [T_l, H]; padding rows: 0
    if out_sharding == "replicated":
        out = jax.lax.all_gather(out, EP_AXIS, axis=0, tiled=True)
    return out, topk_ids
