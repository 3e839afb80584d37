"""Expert parallelism across processes: the MoE layer with ``torch.distributed`` collectives
(NCCL on GPUs, gloo on CPUs) around the stages of CONTRACT.md (section 6).

``P = ep_size`` ranks; rank ``r`` owns routed experts ``[r*E/P, (r+1)*E/P)``, and the last rank
also the ``S`` fused shared experts (ids ``E .. E+S-1``), as :meth:`MoEConfig.local_expert_range`
says. Two ways to move the data, picked by ``mode``:

``"replicated"`` (SGLang's ``EPMoE``): every rank holds the same ``x [T, H]`` and
``router_logits [T, E]``::

    router_logits --select_experts--> topk_ids, topk_weights [T, topk']     (every rank, same result)
    topk_ids --routing_metadata(expert_start, E_local)--> this rank's rows only (others: src2dst = -1)
    x --permute--> --grouped_gemm w13--> --act_and_mul--> --grouped_gemm w2--> --combine--> partial [T, H] float32
    partial --all_reduce (sum)--> out [T, H]            (out="replicated")
    partial --reduce_scatter--> out [rows of rank r, H] (out="sharded")

  No host synchronisation: CUDA-graph capturable with ``implementation="triton"``.

``"all_to_all"`` (DeepEP-style dispatch / combine, normal mode): rank ``r`` holds only its own
tokens ``x [T_r, H]`` (any ``T_r``, 0 included)::

    home:  select_experts on its T_r tokens -> topk_ids, topk_weights [T_r, topk']
           owner of each assignment (t, j): the rank of expert topk_ids[t, j]; stable sort by owner
           all_to_all_single(counts [P])                     -> rows to receive from each rank
           all_to_all_single(x rows, expert ids; uneven splits)   (topk_weights stay home)
    owner: routing_metadata over the received rows (topk = 1) -> permute -> GEMM -> act -> GEMM
           all_to_all_single(y rows back; the reverse splits)
    home:  combine(y rows, src2dst = position of each assignment in the send order,
                   topk_weights, rsf) -> out [T_r, H]  (float32 accumulation, cast once)

  The split sizes must be on the host (``all_to_all_single`` takes Python lists), so this mode
  synchronises with the host once per layer and is **not CUDA-graph capturable**, as DeepEP's
  normal mode (the low-latency mode pads to a fixed capacity instead).

Capacity (``config.capacity_factor``, CONTRACT.md section 2, "Capacity"): per expert, over the layer call's
tokens of every rank. ``"replicated"``: every rank drops the same slots from the gate's ids (it sees all ``T``
tokens). ``"all_to_all"``: the tokens are every rank's in rank order (rank 0's first); the owner drops the rows
it receives (by source rank, each in (token, slot) order: that order) beyond ``C``, the token count coming from
an ``all_reduce`` read at the mode's one host synchronisation; a dropped row's output is 0 at home.

Numerics: each row's expert computation is the single-device one; ``"replicated"`` sums the
ranks' float32 partials (also for bf16 / float16 ``x``: the collective runs in float32 and the
sum is cast once), ``"all_to_all"`` runs the single-device combine on the home rank. Either
equals :func:`moe_torch.moe_forward` on one device to float32 rounding (reassociation of the
sum over slots, in ``"replicated"``).

gloo (torch 2.11): ``all_reduce``, ``reduce_scatter_tensor``, ``all_gather_into_tensor`` and
``all_to_all_single`` with uneven splits (and zero-row splits) all work, so the CPU runs the same
code as NCCL; should a backend lack ``reduce_scatter_tensor``, the reduce-scatter falls back to
``all_reduce`` plus a slice, with a logged warning (:func:`reduce_scatter_rows`).

Backward (CONTRACT.md section 8, "EP"): differentiable in ``x``, ``router_logits``, this rank's
float ``w13_local`` / ``w2_local`` and its expert biases (``config.expert_bias``), in both modes.
The expert stages and the combine run through :func:`moe_torch.layer.routed_experts` (the layer's
own backward, FP8 / 4-bit straight-through), the gate through ``select_experts``' backward, and each
collective is an ``autograd.Function`` with its transpose (``torch.distributed`` collectives are not
autograd-aware; ``_functional_collectives`` has no all-reduce with this transpose, so all four are
written here alike)::

    replicated:  x, router_logits: identity        -> backward: all_reduce (sum) of d_x, d_router_logits
                 partial -> all_reduce              -> backward: identity (every rank's d_out is the same)
                 partial -> reduce_scatter          -> backward: all_gather of the d_out rows
    all_to_all:  rows -> all_to_all_single(splits)  -> backward: all_to_all_single(reverse splits)

so each rank's weight gradient is its slice of the single-device gradient, and ``d_x``,
``d_router_logits`` are the sums over ranks: in "replicated" every rank gets the whole ``[T, ...]``
sum, in "all_to_all" each rank its own tokens' rows. The sums over ranks run in float32 and are cast
once (``d_x`` of bf16 ``x``: each rank's part is already rounded to bf16). Every rank must ask for the
same gradients (as with DDP): the backward runs collectives, which every rank has to enter; a rank
with no tokens or no received rows still takes part (its weights get exactly-0 gradients).

Sources: SGLang ``EPMoE`` (sgl-project/sglang@3f02617653b8d762affee5011e1d9b2c6c1cc0cb:
python/sglang/srt/layers/moe/ep_moe/layer.py: local-expert routing on replicated tokens, then
an all-reduce); DeepEP ``Buffer.get_dispatch_layout`` / ``dispatch`` / ``combine``
(deepseek-ai/DeepEP@dcfd954851157f0bf683e1c3f1a7778f78344759:deep_ep/buffer.py: counts per
rank, a host-synchronised receive count in normal mode, weighted combine at home).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from moe_contract.config import MoEConfig
from moe_contract.op_checks import check_router_loss_option, check_select_experts
from moe_contract.validation import (check_choice, check_expert_biases, check_layer_inputs,
                                      check_shared_expert_gate_logits, stage_implementation)
from moe_torch.capacity import drop_over_capacity
from moe_torch.layer import LAYER_IMPLEMENTATIONS, dispatch_ids, routed_experts, run_gate
from moe_torch.ops.combine import api as combine_api
from moe_torch.ops.combine.api import combine
from moe_torch.ops.common import first_order_backward, takes_torch_tensors
from moe_torch.ops.dispatch import check_implementation
from moe_torch.ops.gate.losses import (RouterLosses, RouterLossSums, router_loss_sums, router_losses,
                                       router_losses_from_sums)
from moe_torch.ops.permute import api as permute_api
from moe_torch.ops.permute.api import permute
from moe_torch.slot_weights import scaled_slot_rows, slot_weights

log = logging.getLogger("moe_torch")

EP_MODES = ("replicated", "all_to_all")
#: The output layouts: ``"replicated"`` (every rank the whole ``[T, H]``; replicated mode only),
#: ``"sharded"`` (a slice of the tokens per rank).
EP_OUTPUTS = ("replicated", "sharded")


def _experts(x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale, config: MoEConfig, implementation, *,
             routed_scaling_factor: float, out_dtype, recompute: bool, input_scale=None, biases=(None, None)):
    """This rank's experts (global ids) on the assignments of ``topk_ids [R, k]`` (inputs scaled by
    ``input_scale``, if given; ``biases``: this rank's ``(w13_bias, w2_bias)``), combined with ``topk_weights``:
    ``[R, H]`` in ``out_dtype``, differentiable (:func:`moe_torch.layer.routed_experts`)."""
    expert_start, e_local = config.local_expert_range()
    return routed_experts(x, topk_weights, topk_ids, w13, w2, config, w13_scale=w13_scale, w2_scale=w2_scale,
                          implementation=implementation, num_experts=config.num_total_experts, expert_start=expert_start,
                          num_local_experts=e_local, routed_scaling_factor=routed_scaling_factor, out_dtype=out_dtype,
                          recompute=recompute, input_scale=input_scale, w13_bias=biases[0], w2_bias=biases[1])


def _sum_over_group(t: torch.Tensor, group) -> torch.Tensor:
    """A new tensor: the sum of ``t`` over the group, taken in float32 and cast once to ``t.dtype``."""
    acc = t.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
    dist.all_reduce(acc, group=group)
    return acc.to(t.dtype)


class _CopyToGroup(torch.autograd.Function):
    """Replicated inputs (``x``, ``router_logits``, and ``shared_expert_gate_logits`` when given): identity
    forward; the backward sums each gradient over the group (every rank's part comes from its own experts;
    as Megatron-LM's ``_CopyToModelParallelRegion``, megatron/core/tensor_parallel/mappings.py)."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        for t, need in zip(tensors, ctx.needs_input_grad[1:]):
            if not need:  # stays a tensor without gradient (and without this backward)
                ctx.mark_non_differentiable(t)
        return tensors

    @staticmethod
    @first_order_backward("ep_moe_forward")
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        # Always in this order on every rank (each one asked for).
        return (None, *(_sum_over_group(g, ctx.group) if need else None
                        for g, need in zip(grads, ctx.needs_input_grad[1:])))


class _AllReduceSum(torch.autograd.Function):
    """The float32 partials' sum over the group, in place; backward: identity (the output is replicated,
    so every rank's ``d_out`` is the whole layer's and each rank's partial gets it as it is)."""

    @staticmethod
    def forward(ctx, partial, group):
        ctx.mark_dirty(partial)
        dist.all_reduce(partial, group=group)
        return partial

    @staticmethod
    def backward(ctx, d_out):
        return d_out, None


class _ReduceScatterRows(torch.autograd.Function):
    """:func:`reduce_scatter_rows`; backward: the all-gather of every rank's ``d_out`` rows into ``[T, H]``."""

    @staticmethod
    def forward(ctx, partial, group, world_size, rank):
        ctx.group, ctx.world_size, ctx.T = group, world_size, partial.shape[0]
        out = reduce_scatter_rows(partial, group, world_size, rank)
        return out.clone() if out._is_view() else out  # a view here would refuse in-place use by the caller

    @staticmethod
    @first_order_backward("ep_moe_forward")
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        T, P = ctx.T, ctx.world_size
        c = -(-T // P)
        mine = torch.nn.functional.pad(d_out, (0, 0, 0, c - d_out.shape[0])).contiguous()  # [c, H], zero padding rows
        full = mine.new_empty((c * P, d_out.shape[1]))
        dist.all_gather_into_tensor(full, mine, group=ctx.group)
        return full[:T], None, None, None


class _AllToAllRows(torch.autograd.Function):
    """``all_to_all_single`` of rows ``[sum(send_splits), H] -> [sum(recv_splits), H]``; backward: the
    reverse exchange of the gradient rows (splits swapped)."""

    @staticmethod
    def forward(ctx, rows, recv_splits, send_splits, group):
        ctx.recv_splits, ctx.send_splits, ctx.group = recv_splits, send_splits, group
        out = rows.new_empty((sum(recv_splits), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    @first_order_backward("ep_moe_forward")
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        d_rows = d_out.new_empty((sum(ctx.send_splits), d_out.shape[1]))
        dist.all_to_all_single(d_rows, d_out.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)
        return d_rows, None, None, None


class _NoRows(torch.autograd.Function):
    """``[0, H]`` rows that depend on ``rows [0, H]`` and ``others`` without computing anything: an owner
    that received no rows (``others``: its weights), a home rank with no tokens (``others``: its
    ``router_logits [0, E]``). Backward: zero gradients of the inputs' shapes (the weights' are exactly 0:
    their experts had no rows). Keeps the rank on the autograd path, so that its backward still enters
    the exchanges every other rank enters."""

    @staticmethod
    def forward(ctx, rows, *others):
        ctx.like = (rows, *others)  # the gradients' shapes and dtypes
        return rows.new_empty((0, rows.shape[1]))

    @staticmethod
    @first_order_backward("ep_moe_forward")
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        return tuple(torch.zeros_like(t) if need else None for t, need in zip(ctx.like, ctx.needs_input_grad))


def shard_rows(T: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, stop)``: the tokens rank ``rank`` holds under ``out="sharded"`` of the replicated
    mode. ``T`` is padded to ``T_pad = c * P`` with ``c = ceil(T / P)``; rank ``r`` holds tokens
    ``[r*c, min((r+1)*c, T))`` (possibly none, for the last ranks when ``T < T_pad``)."""
    c = -(-T // world_size)
    return min(rank * c, T), min((rank + 1) * c, T)


def reduce_scatter_rows(partial: torch.Tensor, group, world_size: int, rank: int) -> torch.Tensor:
    """Sum ``partial [T, H]`` over the group, keep rank ``rank``'s rows (:func:`shard_rows`).

    ``dist.reduce_scatter_tensor`` over ``T`` padded to a multiple of ``world_size`` (NCCL; gloo in
    torch 2.11 has it too). A backend without it (older gloo) gets ``all_reduce`` + slice, which
    moves twice the bytes; the fallback is logged, never silent.
    """
    T, H = partial.shape
    c = -(-T // world_size)
    start, stop = shard_rows(T, world_size, rank)
    padded = partial if c * world_size == T else torch.nn.functional.pad(partial, (0, 0, 0, c * world_size - T))
    chunk = partial.new_empty((c, H))
    try:
        dist.reduce_scatter_tensor(chunk, padded.contiguous(), group=group)
    except (RuntimeError, NotImplementedError) as exc:
        # Only "this backend has no such collective", which every rank raises locally before any
        # traffic; any other failure (a timeout, a broken peer) is the caller's to see.
        if "support" not in str(exc).lower():
            raise
        log.warning("ep_moe_forward: reduce_scatter_tensor unsupported on backend %r (%s); using all_reduce + slice",
                    dist.get_backend(group), exc)
        dist.all_reduce(partial, group=group)
        return partial[start:stop]
    return chunk[: stop - start]


def _group_rank_size(op: str, group, config: MoEConfig, x: torch.Tensor) -> tuple[int, int]:
    """The group's ``(rank, size)``, checked against ``config.ep_rank`` / ``ep_size`` and the device."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{op}: group must be a process group of an initialised torch.distributed "
                         f"(dist.init_process_group); got group={group!r} with torch.distributed not initialised")
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{op}: group must contain this process; got a group without it (rank {dist.get_rank()} of the world)")
    if config.ep_size != size:
        raise ValueError(f"{op}: config.ep_size must equal the group's size (={size}); got config.ep_size={config.ep_size}")
    if config.ep_rank != rank:
        raise ValueError(f"{op}: config.ep_rank must equal this process's rank in the group (={rank}); "
                         f"got config.ep_rank={config.ep_rank}")
    backend = dist.get_backend(group)
    if backend == "nccl" and x.device.type != "cuda":
        raise ValueError(f"{op}: x must be a CUDA tensor for the group's backend 'nccl'; got x.device={x.device}")
    return rank, size


@takes_torch_tensors
def ep_moe_forward(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13_local: torch.Tensor,
    w2_local: torch.Tensor,
    config: MoEConfig,
    *,
    group=None,
    mode: str = "replicated",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    shared_expert_gate_logits: torch.Tensor | None = None,
    implementation: str | None = None,
    out: str | None = None,
    recompute: bool = False,
    return_router_losses: bool = False,
    seq_len: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, RouterLosses]:
    """The whole MoE layer over an EP process group: every rank calls it, each with its experts.

    Args:
      x: float32 / bf16 / float16. ``mode="replicated"``: ``[T, H]``, the same on every rank.
        ``mode="all_to_all"``: ``[T_r, H]``, this rank's tokens (``T_r`` may differ per rank, and be 0).
      router_logits: ``[T, E]`` / ``[T_r, E]`` float, alongside ``x``.
      w13_local: ``[E_local, 2*I, H]`` this rank's experts (:func:`moe_torch.local_weights`),
        ``x.dtype`` for ``quant='none'``, float8_e4m3fn for FP8, packed 4-bit codes ``[E_local, 2*I, H // 2]``
        uint8 for ``quant='mxfp4'`` / ``'int4'``; ``w2_local`` ``[E_local, H, I]`` (4-bit ``[E_local, H, I // 2]``).
      config: the layer; ``config.ep_size`` / ``config.ep_rank`` must be the group's size and
        this process's rank in it; ``config.capacity_factor``: the module docstring's "Capacity".
      group: the EP process group (``None``: the default group). NCCL wants CUDA tensors, gloo CPU ones.
      mode: ``"replicated"`` or ``"all_to_all"`` (module docstring).
      w13_scale, w2_scale: this rank's weight scales (FP8, 4-bit; as :func:`moe_torch.moe_forward`).
      w13_bias, w2_bias: this rank's expert biases ``[E_local, 2*I]`` / ``[E_local, H]``
        (:func:`moe_torch.local_weights` of the global ``[E + S, ...]``), exactly when ``config.expert_bias``
        (as :func:`moe_torch.moe_forward`).
      e_score_correction_bias: ``[E]`` float, for ``routing='biased_grouped_topk'``.
      shared_expert_gate_logits: ``[T, S]`` / ``[T_r, S]`` float32 or ``x.dtype``, alongside ``x``, exactly
        when ``config.shared_expert_gate`` (as :func:`moe_torch.moe_forward`). ``config.apply_router_weight_on_input``
        scales the expert inputs on the rank that holds the token (all_to_all: before the dispatch, so the
        rows travel scaled).
      implementation: every stage's backend (``"reference"``, ``"triton"``, ``None``), as
        :func:`moe_torch.moe_forward`.
      out: ``"replicated"`` (replicated mode's default: every rank gets ``[T, H]``) or
        ``"sharded"``: replicated mode, rank ``r`` gets tokens :func:`shard_rows` ``(T, P, r)``;
        all_to_all mode (its default and only layout), each rank gets its own ``[T_r, H]``.
      recompute: what the forward keeps for the backward, as :func:`moe_torch.moe_forward`'s (``False``:
        the routing and GEMM 1's output; ``True``: the routing only, GEMM 1 recomputed in the backward).
      return_router_losses: also return the router's training losses of the layer call (CONTRACT.md section 10),
        the global ones (over every rank's tokens), the same on every rank: ``"replicated"``:
        :func:`moe_torch.ops.gate.losses.router_losses` of ``router_logits`` (every rank holds all ``T`` tokens)
        and the gate's ids; ``"all_to_all"``: each rank's :class:`~moe_torch.ops.gate.losses.RouterLossSums` of its
        ``T_r`` tokens summed over the group (two ``all_reduce``: ``E + 1`` int64, the counts and ``T_r``; ``E + 2``
        float32, ``E + 3`` with ``seq_len``, the sums), then :func:`~moe_torch.ops.gate.losses.router_losses_from_sums`.
        Differentiable in this rank's ``router_logits`` (autograd): the global loss's gradient with respect to this
        rank's tokens' logits (the float32 all-reduce's backward is the identity, as every rank holds the same loss; no
        collective in the backward). Every rank must ask for them alike (they add collectives to the forward).
      seq_len: with ``return_router_losses``, the tokens of one sequence for ``seq_aux_loss`` (``None``: none); it
        must divide ``T`` (``"all_to_all"``: every rank's ``T_r``; a rank whose ``T_r`` it does not divide raises
        ``ValueError`` before any collective, as for its other inputs).

    Returns: the layer's output (the sum over every rank's experts) in ``x.dtype``, laid out per ``out``; with
    ``return_router_losses``: ``(out, RouterLosses)``, as :func:`moe_torch.moe_forward`.

    Gradients (when grad mode is on and an input requires grad; module docstring, "Backward"): this
    rank's float ``w13_local`` / ``w2_local`` and its expert biases get their slice of the single-device gradient;
    ``x``,
    ``router_logits`` and ``shared_expert_gate_logits`` get the sum over ranks (replicated: the whole ``[T, ...]``; all_to_all: this rank's
    ``[T_r, ...]``). FP8 layers are straight-through (the codes get none). Every rank must ask for the
    same gradients and call ``backward``: the backward runs the transposed collectives.

    Bytes sent per rank per layer (``P`` ranks, ``b`` bytes per element of ``x``, ring algorithms):
      replicated + all_reduce: ``2 (P-1)/P * T*H*4`` (the float32 partial);
      replicated + reduce_scatter: ``(P-1)/P * T_pad*H*4``;
      all_to_all: dispatch ``R_out * (H*b + 4)`` (rows and int32 expert ids) plus ``8P`` (counts),
      combine ``R_in * H*b``, where ``R_out`` = this rank's assignments bound for other ranks
      (``~ T_r * topk * (P-1)/P`` under uniform routing, plus ``T_r * S`` to the last rank for the
      shared experts) and ``R_in`` the rows it received from others. Rows a rank keeps for itself
      are copied locally by the collective.

    Raises: ValueError (shapes, mode / out, a config not matching the group, torch.distributed not
      initialised, NCCL with CPU tensors), TypeError (dtypes; ``recompute`` not a bool), before any collective.
    """
    op = "ep_moe_forward"
    check_layer_inputs(op, config, x, router_logits, w13_local, w2_local, w13_scale, w2_scale)
    check_expert_biases(op, config, x, w13_bias, w2_bias)
    check_shared_expert_gate_logits(op, config, x, shared_expert_gate_logits)
    if not isinstance(recompute, bool):
        raise TypeError(f"{op}: recompute must be a bool; got {type(recompute).__name__} {recompute!r}")
    check_router_loss_option(op, config, router_logits, return_router_losses, seq_len)
    # The gate's rules too, here: a rank with no tokens (all_to_all) skips the gate, and every rank
    # must raise alike, or the others would wait in a collective.
    check_select_experts(op, router_logits, **config.gate_kwargs(), e_score_correction_bias=e_score_correction_bias)
    check_implementation(op, implementation, LAYER_IMPLEMENTATIONS)
    check_choice(op, "mode", mode, EP_MODES)
    check_choice(op, "out", out, (None, *EP_OUTPUTS))
    if mode == "all_to_all" and out == "replicated":
        raise ValueError(f"{op}: out must be 'sharded' (or None) for mode='all_to_all' (each rank gets its own "
                         f"tokens back); got out='replicated'")
    rank, size = _group_rank_size(op, group, config, x)
    biases = (w13_bias, w2_bias)
    if mode == "replicated":
        result, topk_ids = _replicated(x, router_logits, w13_local, w2_local, w13_scale, w2_scale, config,
                                       e_score_correction_bias, implementation, group, rank, size, out or "replicated",
                                       recompute, shared_expert_gate_logits, biases)
        if not return_router_losses:
            return result
        # The caller's router_logits, not the group copy: its backward would sum the same gradient over the ranks.
        return result, router_losses(router_logits, topk_ids, config, seq_len=seq_len)
    result, topk_ids = _all_to_all(x, router_logits, w13_local, w2_local, w13_scale, w2_scale, config,
                                   e_score_correction_bias, implementation, group, size, recompute,
                                   shared_expert_gate_logits, biases)
    if not return_router_losses:
        return result
    return result, _global_router_losses(router_logits, topk_ids, config, seq_len, group)


def _global_router_losses(router_logits, topk_ids, config: MoEConfig, seq_len, group) -> RouterLosses:
    """The router losses of the tokens of every rank (``all_to_all`` mode: each holds its own ``[T_r, E]``): each
    rank's :class:`RouterLossSums` summed over the group, then finished. The float32 sums go through
    :class:`_AllReduceSum` (backward: identity, every rank holding the same loss), the counts and ``T_r`` through a
    plain int64 ``all_reduce``; no host synchronisation."""
    E = config.num_experts
    sums = router_loss_sums(router_logits, topk_ids, config, seq_len=seq_len)
    ints = torch.cat([sums.tokens_per_expert.long(),
                      torch.full((1,), router_logits.shape[0], dtype=torch.long, device=router_logits.device)])
    dist.all_reduce(ints, group=group)
    floats = [sums.prob_sum, sums.z_sum[None]] + ([] if seq_len is None else [sums.seq_aux_sum[None]])
    total = _AllReduceSum.apply(torch.cat(floats), group)
    glob = RouterLossSums(ints[:E].int(), total[:E], total[E], None if seq_len is None else total[E + 1])
    return router_losses_from_sums(glob, ints[E], config, seq_len=seq_len)


def _replicated(x, router_logits, w13, w2, w13_scale, w2_scale, config, bias, implementation, group, rank, size, out,
                recompute, shared_logits=None, biases=(None, None)):
    """SGLang EPMoE: local experts on all tokens, float32 partial, then the sum over ranks. Returns
    ``(out, topk_ids [T, topk'])``."""
    # backward: d_x, d_logits (and d_shared_logits) summed over ranks
    if shared_logits is None:
        x, router_logits = _CopyToGroup.apply(group, x, router_logits)
    else:
        x, router_logits, shared_logits = _CopyToGroup.apply(group, x, router_logits, shared_logits)
    topk_weights, topk_ids = run_gate(router_logits, config, bias, implementation)
    combine_weights, input_scale = slot_weights(topk_weights, shared_logits, config)  # autograd: plain torch ops
    # Every rank sees all T tokens' ids, so each drops the same slots (capacity per expert, globally); the router
    # losses take the gate's own ids (they count dropped slots: CONTRACT.md section 10).
    ids = dispatch_ids(topk_ids, config, implementation)
    # float32 partial: the sum over ranks is then the single-device float32 combine, reassociated.
    partial = _experts(x, combine_weights, ids, w13, w2, w13_scale, w2_scale, config, implementation,
                       routed_scaling_factor=config.combine_routed_scaling_factor, out_dtype=torch.float32,
                       recompute=recompute, input_scale=input_scale, biases=biases)
    if out == "replicated":
        return _AllReduceSum.apply(partial, group).to(x.dtype), topk_ids
    return _ReduceScatterRows.apply(partial, group, size, rank).to(x.dtype), topk_ids


def _all_to_all(x, router_logits, w13, w2, w13_scale, w2_scale, config, bias, implementation, group, size, recompute,
                shared_logits=None, biases=(None, None)):
    """DeepEP-style: dispatch (token, slot) rows to the owner of their expert, compute, send back,
    combine at home. ``apply_router_weight_on_input``: the rows are scaled at home, before the dispatch.
    Returns ``(out [T_r, H], topk_ids [T_r, topk'])``."""
    T, H = x.shape
    K = config.num_slots
    if T:
        topk_weights, topk_ids = run_gate(router_logits, config, bias, implementation)
    else:  # nothing to route; the rank still takes part in every collective (and may own rows of others)
        topk_weights = torch.zeros((0, K), dtype=torch.float32, device=x.device)
        topk_ids = torch.zeros((0, K), dtype=torch.int32, device=x.device)
    combine_weights, input_scale = slot_weights(topk_weights, shared_logits, config)  # autograd: plain torch ops
    # -- dispatch layout: owner rank of each assignment a = t*K + j (shared ids E.. belong to the last rank)
    per_rank = config.num_experts // size
    ids = topk_ids.reshape(-1)
    owner = torch.clamp(ids.long() // per_rank, max=size - 1)  # [A]
    order = torch.argsort(owner, stable=True)  # send slot -> assignment index; grouped by owner, stable within
    send_counts = torch.bincount(owner, minlength=size)  # int64 [P]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    total = None
    if config.capacity_factor is not None:  # C = ceil(c * T * topk / E) counts every rank's tokens
        total = torch.tensor([T], dtype=torch.int64, device=x.device)
        dist.all_reduce(total, group=group)
    # The one host synchronisation of this mode: all_to_all_single takes the splits as lists.
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    total_tokens = None if total is None else int(total.item())  # read at the same synchronisation point
    R = sum(recv_splits)
    # [A, H]: the token row of each assignment, in send order (x[order // K]); the permute stage, so that its
    # backward sums each token's slots in float32 (permute_backward)
    # (apply_router_weight_on_input: the scaled slot rows x[t] * w[t, j], gathered one per assignment)
    x_rows, k_rows = (x, K) if input_scale is None else (scaled_slot_rows(x, input_scale), 1)
    x_send, _ = permute(x_rows, order.to(torch.int32), topk=k_rows,
                        implementation=stage_implementation(implementation, permute_api))
    ids_send = ids[order].to(torch.int32)  # [A] global expert ids (weights stay home)
    ids_recv = torch.empty((R,), dtype=torch.int32, device=x.device)
    ids_work = dist.all_to_all_single(ids_recv, ids_send, recv_splits, send_splits, group=group, async_op=True)
    x_recv = _AllToAllRows.apply(x_send, recv_splits, send_splits, group)  # [R, H]
    ids_work.wait()
    # -- owner: one expert per received row (topk = 1, weight 1, no rsf): y rows in receive order, x.dtype
    # (the combine of one row with weight 1.0 in float32 is exact); every row is local here, but for dropped ones
    if R:
        ones = torch.ones((R, 1), dtype=torch.float32, device=x.device)
        # The rows arrive by source rank, each rank's in (token, slot) order: the global token order (rank 0's
        # tokens first), so the owner alone drops the slots over its experts' capacity. A dropped row's y is 0.
        ids_own = drop_over_capacity(ids_recv[:, None], config, num_tokens=total_tokens,
                                     implementation=stage_implementation(implementation, permute_api))
        y_recv = _experts(x_recv, ones, ids_own, w13, w2, w13_scale, w2_scale, config, implementation,
                          routed_scaling_factor=1.0, out_dtype=x.dtype, recompute=recompute, biases=biases)
    else:  # no kernel launch on zero rows (still on the autograd path: the backward's exchange needs this rank)
        y_recv = _NoRows.apply(x_recv, w13, w2, *(b for b in biases if b is not None))
    # -- combine: the reverse exchange, then the single-device combine at home
    y_back = _AllToAllRows.apply(y_recv, send_splits, recv_splits, group)  # [T*K, H], send order
    if T == 0:  # [0, H], on the autograd path through both exchanges (and router_logits [0, E])
        return _NoRows.apply(y_back, router_logits, *(() if shared_logits is None else (shared_logits,))), topk_ids
    src2dst = torch.empty((T * K,), dtype=torch.int32, device=x.device)
    src2dst[order] = torch.arange(T * K, dtype=torch.int32, device=x.device)
    return combine(y_back, src2dst.reshape(T, K), combine_weights, routed_scaling_factor=config.combine_routed_scaling_factor,
                   out_dtype=x.dtype, implementation=stage_implementation(implementation, combine_api)), topk_ids
