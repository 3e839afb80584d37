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
``all_reduce`` of a copy plus a slice, with a logged warning (:func:`reduce_scatter_rows`).

Backward (CONTRACT.md section 8, "EP"): differentiable in ``x``, ``router_logits``, this rank's
float ``w13_local`` / ``w2_local`` and its expert biases (``config.expert_bias``), in both modes.
``"replicated"``: the layer is the single-device one (``epmoe::moe_layer``, :mod:`moe_torch.ops.custom_ops`, with
this rank's experts and a float32 output: its own backward, FP8 / 4-bit straight-through) between collectives that
are ``autograd.Function`` s with their transposes (``torch.distributed`` collectives are not autograd-aware;
``_functional_collectives`` has no all-reduce with this transpose, so all are written here alike)::

    x, router_logits: identity        -> backward: all_reduce (sum) of d_x, d_router_logits
    partial -> all_reduce              -> backward: identity (every rank's d_out is the same)
    partial -> reduce_scatter          -> backward: all_gather of the d_out rows

``"all_to_all"``: one ``autograd.Function`` (:class:`_AllToAllLayer`) whose backward runs the forward's stages'
backward ops in reverse order, the exchanges transposed (``combine_backward`` at home, ``d_y`` rows to the owners
over the reverse splits, the experts' backward there (:func:`moe_torch.layer.experts_backward`), ``d_x`` rows home,
``permute_backward``, the slot weights' and the gate's backward); an exchange runs only when a gradient that needs it
is asked for.

So each rank's weight gradient is its slice of the single-device gradient, and ``d_x``,
``d_router_logits`` are the sums over ranks: in "replicated" every rank gets the whole ``[T, ...]``
sum, in "all_to_all" each rank its own tokens' rows. The sums over ranks run in float32 and are cast
once (``d_x`` of bf16 ``x``: each rank's part is already rounded to bf16). Every rank must ask for the
same gradients (as with DDP): the backward runs collectives, which every rank has to enter; a rank
with no tokens or no received rows still takes part (its weights get exactly-0 gradients).
Second-order gradients raise ``RuntimeError`` naming ``ep_moe_forward`` (or the inner layer).

torch.compile: ``torch.compile(fullgraph=True)`` over :func:`ep_moe_forward` (or ``EPMoE`` with a process group)
traces with no graph break, forward and backward, and computes what eager computes, bit for bit: every collective and
every data-dependent step is inside a custom op (namespace ``epmoe``) with a fake implementation, and eager runs the
same ops. The group reaches them by name (:func:`group_name`). Replicated mode: ``epmoe::moe_layer`` between
``epmoe::ep_all_reduce_`` (in place), ``epmoe::ep_reduce_scatter_rows`` and ``epmoe::ep_all_gather_rows``, all of
data-independent output shapes. all_to_all mode: ``epmoe::ep_all_to_all_layer`` and its backward
``epmoe::ep_all_to_all_layer_backward`` hold the count exchange, the host read of the split sizes, both exchanges of
rows and the owner's experts; the output ``[T_r, H]`` has a static shape, but the rows the owner keeps for the
backward (``R`` received rows) have a data-dependent count, an unbacked size in the fake. Dynamo admits that op under
``fullgraph=True``; without it (the default ``torch.compile``) it breaks the graph there and runs the layer eagerly
(correct, one break per call) unless ``torch._dynamo.config.capture_dynamic_output_shape_ops = True``. Each op runs
its collectives in a fixed order, so a compiler reordering the graph around them cannot make ranks enter them in
different orders. ``torch.func`` transforms are not supported with EP (``EPMoE`` raises ``NotImplementedError``).

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
from torch.distributed.distributed_c10d import _resolve_process_group

from moe_contract.config import MoEConfig
from moe_contract.op_checks import check_router_loss_option, check_select_experts
from moe_contract.validation import (check_choice, check_expert_biases, check_layer_inputs,
                                      check_shared_expert_gate_logits, stage_implementation)
from moe_torch.capacity import drop_over_capacity
from moe_torch.layer import LAYER_IMPLEMENTATIONS, experts_backward, run_experts, run_gate
from moe_torch.ops.combine import api as combine_api
from moe_torch.ops.combine.api import combine, combine_backward
from moe_torch.ops.common import takes_torch_tensors
from moe_torch.ops.custom_ops import (GRADS, INPUTS, config_from_key, config_key, grad_flags, grad_outputs,
                                      grad_outputs_fake, moe_layer, plain, refuse_second_order)
from moe_torch.ops.dispatch import check_implementation
from moe_torch.ops.gate import api as gate_api
from moe_torch.ops.gate.api import select_experts_backward
from moe_torch.ops.gate.losses import (RouterLosses, RouterLossSums, router_loss_sums, router_losses,
                                       router_losses_from_sums)
from moe_torch.ops.permute import api as permute_api
from moe_torch.ops.permute.api import RoutingMetadata, permute, permute_backward
from moe_torch.slot_weights import scaled_slot_rows, scaled_slot_rows_backward, slot_weights, slot_weights_backward

log = logging.getLogger("moe_torch")

EP_MODES = ("replicated", "all_to_all")
#: The output layouts: ``"replicated"`` (every rank the whole ``[T, H]``; replicated mode only),
#: ``"sharded"`` (a slice of the tokens per rank).
EP_OUTPUTS = ("replicated", "sharded")

Tensor = torch.Tensor
_OptT = torch.Tensor | None
_GRAD_INDEX = tuple(INPUTS.index(name) for name in GRADS)


def group_name(group) -> str:
    """The name of ``group`` (``None``: the default group) that the EP custom ops take, as
    ``torch.distributed._functional_collectives`` names groups (a string Dynamo reads as a constant)."""
    return (dist.group.WORLD if group is None else group).group_name


def _group(name: str):
    """The process group of :func:`group_name` ``name``."""
    return _resolve_process_group(name)


def _first_order() -> None:
    """The EP Functions' backward refuses ``create_graph=True`` (CONTRACT.md section 8: first order only), naming
    ``ep_moe_forward``. (Not under ``torch.compile``: AOTAutograd traces the backward once and refuses a double
    backward itself.)"""
    if not torch.compiler.is_compiling():
        refuse_second_order("ep_moe_forward", through_functorch=False)


# -- The collectives as custom ops: opaque to torch.compile (no graph break), their fakes give the outputs' shapes
# from the inputs' alone. One op runs its collectives in a fixed order, so every rank enters them alike whatever a
# compiler does around it.


@torch.library.custom_op("epmoe::ep_all_reduce_", mutates_args=("tensors",))
def _all_reduce_op(tensors: list[Tensor], group: str) -> None:
    """Each of ``tensors`` summed over the group, in place (``dist.all_reduce``), in list order."""
    pg = _group(group)
    for t in tensors:
        dist.all_reduce(t, group=pg)


@torch.library.custom_op("epmoe::ep_reduce_scatter_rows", mutates_args=())
def _reduce_scatter_op(partial: Tensor, group: str, world_size: int, rank: int) -> Tensor:
    """:func:`reduce_scatter_rows`: rank ``rank``'s rows of the sum over the group, ``[stop - start, H]``."""
    out = reduce_scatter_rows(partial, _group(group), world_size, rank)
    return out.clone() if out._is_view() else out  # a view would refuse in-place use by the caller


@_reduce_scatter_op.register_fake
def _reduce_scatter_fake(partial, group, world_size, rank):
    start, stop = shard_rows(partial.shape[0], world_size, rank)
    return partial.new_empty((stop - start, partial.shape[1]))


@torch.library.custom_op("epmoe::ep_all_gather_rows", mutates_args=())
def _all_gather_op(rows: Tensor, group: str, world_size: int, num_tokens: int) -> Tensor:
    """The transpose of :func:`reduce_scatter_rows`: every rank's ``rows`` (its :func:`shard_rows` of
    ``num_tokens``) in rank order, ``[num_tokens, H]``: one ``all_gather_into_tensor`` of ``c = ceil(T / P)``
    rows per rank (zero padding rows)."""
    T, P = num_tokens, world_size
    c = -(-T // P)
    mine = torch.nn.functional.pad(rows, (0, 0, 0, c - rows.shape[0])).contiguous()  # [c, H]
    full = mine.new_empty((c * P, rows.shape[1]))
    dist.all_gather_into_tensor(full, mine, group=_group(group))
    return full[:T]


@_all_gather_op.register_fake
def _all_gather_fake(rows, group, world_size, num_tokens):
    return rows.new_empty((num_tokens, rows.shape[1]))


def _sum_over_group(tensors, group: str) -> list[Tensor]:
    """New tensors: each of ``tensors`` summed over the group, taken in float32 and cast once to its dtype (one
    :func:`_all_reduce_op`)."""
    acc = [t.to(torch.float32, copy=True, memory_format=torch.contiguous_format) for t in tensors]
    if acc:
        torch.ops.epmoe.ep_all_reduce_(acc, group)
    return [a.to(t.dtype) for a, t in zip(acc, tensors)]


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
    def backward(ctx, *grads):
        _first_order()
        needs = ctx.needs_input_grad[1:]
        # One op, in this order on every rank (each one asked for)
        sums = _sum_over_group([g for g, need in zip(grads, needs) if need], ctx.group)
        result, i = [None], 0
        for need in needs:
            result.append(sums[i] if need else None)
            i += need
        return tuple(result)


class _AllReduceSum(torch.autograd.Function):
    """``tensors`` summed over the group, in place (one :func:`_all_reduce_op`); backward: the identity (the sums
    are replicated, so every rank's ``d_out`` is the whole layer's and each rank's part gets it as it is). Integer
    tensors get no gradient. ``first_order``: the backward refuses ``create_graph=True`` (the layer's output;
    the router losses' sums stay differentiable twice)."""

    @staticmethod
    def forward(ctx, group, first_order, *tensors):
        ctx.first_order = first_order
        ctx.mark_dirty(*tensors)
        torch.ops.epmoe.ep_all_reduce_(list(tensors), group)
        integers = [t for t in tensors if not t.is_floating_point()]
        if integers:
            ctx.mark_non_differentiable(*integers)
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        if ctx.first_order:
            _first_order()
        return (None, None, *grads)


class _ReduceScatterRows(torch.autograd.Function):
    """:func:`reduce_scatter_rows`; backward: the all-gather of every rank's ``d_out`` rows into ``[T, H]``."""

    @staticmethod
    def forward(ctx, partial, group, world_size, rank):
        ctx.group, ctx.world_size, ctx.T = group, world_size, partial.shape[0]
        return torch.ops.epmoe.ep_reduce_scatter_rows(partial, group, world_size, rank)

    @staticmethod
    def backward(ctx, d_out):
        _first_order()
        return torch.ops.epmoe.ep_all_gather_rows(d_out, ctx.group, ctx.world_size, ctx.T), None, None, None


def shard_rows(T: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, stop)``: the tokens rank ``rank`` holds under ``out="sharded"`` of the replicated
    mode. ``T`` is padded to ``T_pad = c * P`` with ``c = ceil(T / P)``; rank ``r`` holds tokens
    ``[r*c, min((r+1)*c, T))`` (possibly none, for the last ranks when ``T < T_pad``). ``T`` may be a
    ``torch.SymInt`` (a symbolic token count under ``torch.compile``)."""
    c = -(-T // world_size)
    return torch.sym_min(rank * c, T), torch.sym_min((rank + 1) * c, T)


def reduce_scatter_rows(partial: torch.Tensor, group, world_size: int, rank: int) -> torch.Tensor:
    """Sum ``partial [T, H]`` over the group, keep rank ``rank``'s rows (:func:`shard_rows`); ``partial`` is not
    written.

    ``dist.reduce_scatter_tensor`` over ``T`` padded to a multiple of ``world_size`` (NCCL; gloo in
    torch 2.11 has it too). A backend without it (older gloo) gets ``all_reduce`` of a copy + slice, which
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
        summed = partial.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(summed, group=group)
        return summed[start:stop]
    return chunk[: stop - start]


# -- The all_to_all mode as one autograd.Function whose forward and backward are custom ops: the exchanges, their
# host-read split sizes and the owner's data-dependent row count R stay inside them (torch.compile: no graph break;
# R is an unbacked size in the fake).

#: What ``epmoe::ep_all_to_all_layer`` returns after ``out``, in this order (all but ``topk_ids`` for the backward
#: op): the gate's ``topk_ids`` / ``topk_weights [T_r, K]``, ``src2dst [T_r, K]`` (each assignment's row in the send
#: order), the rows that came back ``y_back [T_r*K, H]``, the split sizes ``counts [2, P]`` int64 on the host (sent,
#: received), the owner's received rows ``x_recv [R, H]``, their routing metadata (``expert_offsets [E_local + 1]``,
#: ``own_src2dst [R, 1]``, ``own_dst2src [R]``, int32) and GEMM 1's output ``h [R, 2I]`` (``[0]`` with recompute).
A2A_SAVED = ("topk_ids", "topk_weights", "src2dst", "y_back", "counts", "x_recv", "expert_offsets", "own_src2dst",
             "own_dst2src", "h")


def _all_to_all_forward(x, router_logits, w13, w2, w13_scale, w2_scale, config: MoEConfig, bias, shared_logits,
                        biases, group, implementation, recompute: bool) -> tuple[Tensor, ...]:
    """DeepEP-style (module docstring): dispatch the (token, slot) rows to the owner of their expert, compute, send
    back, combine at home. ``apply_router_weight_on_input``: the rows are scaled at home, before the dispatch.
    Plain tensors (the op's body): ``(out [T_r, H], *A2A_SAVED)``."""
    T, H = x.shape
    K = config.num_slots
    size = dist.get_world_size(group)
    dev = x.device
    i32 = dict(dtype=torch.int32, device=dev)
    if T:
        topk_weights, topk_ids = run_gate(router_logits, config, bias, implementation)
    else:  # nothing to route; the rank still takes part in every collective (and may own rows of others)
        topk_weights = torch.zeros((0, K), dtype=torch.float32, device=dev)
        topk_ids = torch.zeros((0, K), **i32)
    combine_weights, input_scale = slot_weights(topk_weights, shared_logits, config)
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
        total = torch.tensor([T], dtype=torch.int64, device=dev)
        dist.all_reduce(total, group=group)
    # The one host synchronisation of this mode: all_to_all_single takes the splits as lists.
    counts = torch.stack([send_counts, recv_counts]).cpu()
    send_splits, recv_splits = counts.tolist()
    total_tokens = None if total is None else int(total.item())  # read at the same synchronisation point
    R = sum(recv_splits)
    # [A, H]: the token row of each assignment, in send order (x[order // K]), by the permute stage
    # (apply_router_weight_on_input: the scaled slot rows x[t] * w[t, j], gathered one per assignment)
    x_rows, k_rows = (x, K) if input_scale is None else (scaled_slot_rows(x, input_scale), 1)
    x_send, _ = permute(x_rows, order.to(torch.int32), topk=k_rows,
                        implementation=stage_implementation(implementation, permute_api))
    ids_send = ids[order].to(torch.int32)  # [A] global expert ids (weights stay home)
    ids_recv = torch.empty((R,), **i32)
    ids_work = dist.all_to_all_single(ids_recv, ids_send, recv_splits, send_splits, group=group, async_op=True)
    x_recv = x_send.new_empty((R, H))
    dist.all_to_all_single(x_recv, x_send.contiguous(), recv_splits, send_splits, group=group)
    ids_work.wait()
    # -- owner: one expert per received row (topk = 1, weight 1, no rsf): y rows in receive order, x.dtype
    # (the combine of one row with weight 1.0 in float32 is exact); every row is local here, but for dropped ones
    expert_start, e_local = config.local_expert_range()
    if R:
        # The rows arrive by source rank, each rank's in (token, slot) order: the global token order (rank 0's
        # tokens first), so the owner alone drops the slots over its experts' capacity. A dropped row's y is 0.
        ids_own = drop_over_capacity(ids_recv[:, None], config, num_tokens=total_tokens,
                                     implementation=stage_implementation(implementation, permute_api))
        y, meta, h = run_experts(x_recv, ids_own, w13, w2, w13_scale, w2_scale, config, implementation,
                                 num_experts=config.num_total_experts, expert_start=expert_start,
                                 num_local_experts=e_local, return_h=True, w13_bias=biases[0], w2_bias=biases[1])
        ones = torch.ones((R, 1), dtype=torch.float32, device=dev)
        y_recv = combine(y, meta.src2dst, ones, routed_scaling_factor=1.0, out_dtype=x.dtype,
                         implementation=stage_implementation(implementation, combine_api))
        del y
        meta = tuple(meta)
    else:  # no kernel launch on zero rows (the rank still takes part in the exchanges)
        y_recv = x_recv.new_empty((0, H))
        meta = (torch.zeros((e_local + 1,), **i32), torch.zeros((0, 1), **i32), torch.zeros((0,), **i32))
        h = x.new_empty((0, 2 * config.intermediate_size))
    # -- combine: the reverse exchange, then the single-device combine at home
    y_back = x.new_empty((T * K, H))  # send order
    dist.all_to_all_single(y_back, y_recv.contiguous(), send_splits, recv_splits, group=group)
    src2dst = torch.empty((T * K,), **i32)
    src2dst[order] = torch.arange(T * K, **i32)
    src2dst = src2dst.reshape(T, K)
    if T:
        out = combine(y_back, src2dst, combine_weights, routed_scaling_factor=config.combine_routed_scaling_factor,
                      out_dtype=x.dtype, implementation=stage_implementation(implementation, combine_api))
    else:
        out = x.new_empty((0, H))
    return (out, topk_ids, topk_weights, src2dst, y_back, counts, x_recv, *meta,
            x.new_empty((0,)) if recompute else h)


def _all_to_all_backward(d_out, inputs, saved, config: MoEConfig, group, implementation, recompute: bool,
                         needs) -> dict:
    """The backward of :func:`_all_to_all_forward` (plain tensors, the backward op's body): ``{name: gradient or
    None}`` over :data:`GRADS`, ``needs`` one flag per name. The exchanges run in reverse (``d_y`` to the owners,
    ``d_x`` rows home), each only when a gradient that needs it is asked for: every rank decides alike, from the same
    requests (module docstring, "Backward")."""
    x, router_logits, w13, w2, w13_scale, w2_scale, bias, shared_logits, w13_bias, w2_bias = inputs
    topk_ids, topk_weights, src2dst, y_back, counts, x_recv, offsets, own_src2dst, own_dst2src, h = saved
    need_x, need_logits, need_w13, need_w2, need_shared, need_b13, need_b2 = needs
    T, H = x.shape
    K, R, dtype = config.num_slots, x_recv.shape[0], x.dtype
    send_splits, recv_splits = counts.tolist()  # host memory: no synchronisation
    combine_weights, input_scale = slot_weights(topk_weights, shared_logits, config)
    # the rows' gradient: for d_x, and for the input scale's gradient (apply_router_weight_on_input) into the router
    need_rows = need_x or (input_scale is not None and (need_logits or need_shared))
    need_y = need_rows or need_w13 or need_w2 or need_b13 or need_b2  # the d_y exchange and the experts' backward
    need_cw = need_logits or need_shared  # the combine weights' gradient
    d = dict.fromkeys(GRADS)
    d_y_back = d_cw = d_input_scale = None
    if T and (need_y or need_cw):
        d_y_back, d_cw = combine_backward(d_out, y_back, src2dst, combine_weights,
                                          routed_scaling_factor=config.combine_routed_scaling_factor,
                                          implementation=stage_implementation(implementation, combine_api))
    if need_y:
        if d_y_back is None:  # no tokens at home
            d_y_back = y_back.new_zeros((0, H))
        d_y_recv = d_y_back.new_empty((R, H))
        dist.all_to_all_single(d_y_recv, d_y_back.contiguous(), recv_splits, send_splits, group=group)
        del d_y_back
        if R:
            ones = torch.ones((R, 1), dtype=torch.float32, device=x.device)
            g = experts_backward(
                d_y_recv, x_recv, w13, w2, w13_scale, w2_scale, ones, 1, RoutingMetadata(offsets, own_src2dst, own_dst2src), None if recompute else h, config,
                implementation, 1.0, need_rows, need_w13, need_w2, w13_bias=w13_bias, w2_bias=w2_bias,
                need_w13_bias=need_b13, need_w2_bias=need_b2)
            d_x_recv = g.d_x
            d.update(w13=g.d_w13, w2=g.d_w2, w13_bias=g.d_w13_bias, w2_bias=g.d_w2_bias)
        else:  # no rows: the experts' gradients are exactly 0
            d_x_recv = x_recv.new_zeros((0, H))
            for name, t, need in (("w13", w13, need_w13), ("w2", w2, need_w2), ("w13_bias", w13_bias, need_b13),
                                  ("w2_bias", w2_bias, need_b2)):
                d[name] = torch.zeros_like(t) if need else None
        del d_y_recv
        if need_rows:
            d_x_send = d_x_recv.new_empty((T * K, H))
            dist.all_to_all_single(d_x_send, d_x_recv.contiguous(), send_splits, recv_splits, group=group)
            if T:
                perm = stage_implementation(implementation, permute_api)
                if input_scale is None:
                    d["x"] = permute_backward(d_x_send, src2dst, num_tokens=T, out_dtype=dtype, implementation=perm)
                else:  # the scaled slot rows' gradient, then their chain rule (slot_weights.py)
                    d_rows = permute_backward(d_x_send, src2dst.reshape(-1, 1), num_tokens=T * K, out_dtype=dtype,
                                              implementation=perm)
                    d_x, d_input_scale = scaled_slot_rows_backward(x, input_scale, d_rows)
                    d["x"] = d_x.to(dtype)
    if need_cw and T:
        d_topk_weights, d_shared = slot_weights_backward(topk_weights, shared_logits, d_cw, d_input_scale, config)
        if need_logits:
            d["router_logits"] = select_experts_backward(
                router_logits, topk_ids, d_topk_weights, **config.gate_kwargs(), e_score_correction_bias=bias,
                implementation=stage_implementation(implementation, gate_api)).to(router_logits.dtype)
        if need_shared:
            d["shared_expert_gate_logits"] = d_shared.to(shared_logits.dtype)
    for name, t, need in (("x", x, need_x), ("router_logits", router_logits, need_logits),
                          ("shared_expert_gate_logits", shared_logits, need_shared)):
        if need and d[name] is None:  # no tokens at home: [0, ...]
            d[name] = torch.zeros_like(t)
    return d


@torch.library.custom_op("epmoe::ep_all_to_all_layer", mutates_args=())
def _all_to_all_op(x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, w13_scale: _OptT, w2_scale: _OptT,
                   e_score_correction_bias: _OptT, shared_expert_gate_logits: _OptT, w13_bias: _OptT, w2_bias: _OptT,
                   config: str, config_floats: list[float], group: str, implementation: str | None, recompute: bool
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(out [T_r, H], *A2A_SAVED)``: the all_to_all layer on this rank (every rank calls it alike)."""
    cfg = config_from_key(config, config_floats)
    with plain(x.device):
        return _all_to_all_forward(x, router_logits, w13, w2, w13_scale, w2_scale, cfg, e_score_correction_bias,
                                   shared_expert_gate_logits, (w13_bias, w2_bias), _group(group), implementation,
                                   recompute)


@_all_to_all_op.register_fake
def _all_to_all_fake(x, router_logits, w13, w2, w13_scale, w2_scale, e_score_correction_bias, shared_expert_gate_logits,
                     w13_bias, w2_bias, config, config_floats, group, implementation, recompute):
    cfg = config_from_key(config, config_floats)
    T, H = x.shape
    K, P = cfg.num_slots, cfg.ep_size
    _, e_local = cfg.local_expert_range()
    R = torch.library.get_ctx().new_dynamic_size()  # the rows this rank receives: known after the count exchange
    i32 = dict(dtype=torch.int32)
    return (x.new_empty((T, H)), x.new_empty((T, K), **i32), x.new_empty((T, K), dtype=torch.float32),
            x.new_empty((T, K), **i32), x.new_empty((T * K, H)), torch.empty((2, P), dtype=torch.int64, device="cpu"),
            x.new_empty((R, H)), x.new_empty((e_local + 1,), **i32), x.new_empty((R, 1), **i32),
            x.new_empty((R,), **i32),
            x.new_empty((0,) if recompute else (R, 2 * cfg.intermediate_size)))


@torch.library.custom_op("epmoe::ep_all_to_all_layer_backward", mutates_args=())
def _all_to_all_backward_op(d_out: Tensor, x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor,
                            w13_scale: _OptT, w2_scale: _OptT, e_score_correction_bias: _OptT,
                            shared_expert_gate_logits: _OptT, w13_bias: _OptT, w2_bias: _OptT, topk_ids: Tensor,
                            topk_weights: Tensor, src2dst: Tensor, y_back: Tensor, counts: Tensor, x_recv: Tensor,
                            expert_offsets: Tensor, own_src2dst: Tensor, own_dst2src: Tensor, h: Tensor, config: str,
                            config_floats: list[float], group: str, implementation: str | None, recompute: bool,
                            needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :data:`GRADS` (``needs``: one flag per name; empty ``[0]`` where not asked for)."""
    inputs = (x, router_logits, w13, w2, w13_scale, w2_scale, e_score_correction_bias, shared_expert_gate_logits,
              w13_bias, w2_bias)
    saved = (topk_ids, topk_weights, src2dst, y_back, counts, x_recv, expert_offsets, own_src2dst, own_dst2src, h)
    with plain(d_out.device):
        d = _all_to_all_backward(d_out, inputs, saved, config_from_key(config, config_floats), _group(group),
                                 implementation, recompute, needs)
    return grad_outputs("epmoe::ep_all_to_all_layer_backward", [d[name] for name in GRADS], inputs, needs, d_out)


@_all_to_all_backward_op.register_fake
def _all_to_all_backward_fake(d_out, x, router_logits, w13, w2, w13_scale, w2_scale, e_score_correction_bias,
                              shared_expert_gate_logits, w13_bias, w2_bias, *saved_and_args):
    needs = saved_and_args[-1]
    return grad_outputs_fake((x, router_logits, w13, w2, w13_scale, w2_scale, e_score_correction_bias,
                              shared_expert_gate_logits, w13_bias, w2_bias), needs, d_out)


class _AllToAllLayer(torch.autograd.Function):
    """The all_to_all mode: forward ``epmoe::ep_all_to_all_layer``, backward ``epmoe::ep_all_to_all_layer_backward``
    (module docstring, "Backward"). Outputs ``(out, topk_ids)``; ``topk_ids`` is not differentiable."""

    @staticmethod
    def forward(ctx, x, router_logits, w13, w2, w13_scale, w2_scale, bias, shared_logits, w13_bias, w2_bias, config,
                key, floats, group, implementation, recompute):
        out, topk_ids, *saved = torch.ops.epmoe.ep_all_to_all_layer(
            x, router_logits, w13, w2, w13_scale, w2_scale, bias, shared_logits, w13_bias, w2_bias, key, floats, group,
            implementation, recompute)
        ctx.mark_non_differentiable(topk_ids)
        ctx.save_for_backward(x, router_logits, w13, w2, w13_scale, w2_scale, bias, shared_logits, w13_bias, w2_bias,
                              topk_ids, *saved)
        ctx.config, ctx.key, ctx.floats, ctx.group = config, key, floats, group
        ctx.implementation, ctx.recompute = implementation, recompute
        return out, topk_ids

    @staticmethod
    def backward(ctx, d_out, _):
        _first_order()
        saved = ctx.saved_tensors
        inputs = saved[:len(INPUTS)]
        flags = grad_flags(ctx.config, ctx.needs_input_grad, inputs)
        if not any(flags):
            return (None,) * (len(INPUTS) + 6)
        grads = torch.ops.epmoe.ep_all_to_all_layer_backward(d_out.contiguous(), *saved, ctx.key, ctx.floats,
                                                              ctx.group, ctx.implementation, ctx.recompute, flags)
        result = [None] * (len(INPUTS) + 6)
        for i, g, need in zip(_GRAD_INDEX, grads, flags):
            result[i] = g if need else None
        return tuple(result)


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

    ``torch.compile(fullgraph=True)`` traces it with no graph break, forward and backward, and gets eager's bits
    (module docstring, "torch.compile"; ``mode="all_to_all"`` without ``fullgraph`` breaks the graph at the layer).

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
    group = group_name(group)  # what the custom ops take
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
                                   e_score_correction_bias, implementation, group, recompute,
                                   shared_expert_gate_logits, biases)
    if not return_router_losses:
        return result
    return result, _global_router_losses(router_logits, topk_ids, config, seq_len, group)


def _global_router_losses(router_logits, topk_ids, config: MoEConfig, seq_len, group: str) -> RouterLosses:
    """The router losses of the tokens of every rank (``all_to_all`` mode: each holds its own ``[T_r, E]``): each
    rank's :class:`RouterLossSums` summed over the group, then finished. The counts and ``T_r`` (int64) and the float32
    sums go through one :class:`_AllReduceSum` (backward: identity, every rank holding the same loss); no host
    synchronisation."""
    E = config.num_experts
    sums = router_loss_sums(router_logits, topk_ids, config, seq_len=seq_len)
    ints = torch.cat([sums.tokens_per_expert.long(),
                      torch.full((1,), router_logits.shape[0], dtype=torch.long, device=router_logits.device)])
    floats = [sums.prob_sum, sums.z_sum[None]] + ([] if seq_len is None else [sums.seq_aux_sum[None]])
    ints, total = _AllReduceSum.apply(group, False, ints, torch.cat(floats))
    glob = RouterLossSums(ints[:E].int(), total[:E], total[E], None if seq_len is None else total[E + 1])
    return router_losses_from_sums(glob, ints[E], config, seq_len=seq_len)


def _replicated(x, router_logits, w13, w2, w13_scale, w2_scale, config, bias, implementation, group: str, rank, size,
                out, recompute, shared_logits=None, biases=(None, None)):
    """SGLang EPMoE: local experts on all tokens (the single-device layer's op, ``epmoe::moe_layer``, with this
    rank's experts), float32 partial, then the sum over ranks. Returns ``(out, topk_ids [T, topk'])``."""
    # backward: d_x, d_logits (and d_shared_logits) summed over ranks
    if shared_logits is None:
        x, router_logits = _CopyToGroup.apply(group, x, router_logits)
    else:
        x, router_logits, shared_logits = _CopyToGroup.apply(group, x, router_logits, shared_logits)
    # float32 partial: the sum over ranks is then the single-device float32 combine, reassociated. Every rank sees
    # all T tokens' ids, so each drops the same slots (capacity per expert, globally); topk_ids are the gate's own
    # (the router losses count dropped slots: CONTRACT.md section 10).
    partial, topk_ids = moe_layer(x, router_logits, w13, w2, w13_scale, w2_scale, bias, shared_logits, *biases, config,
                                  implementation, recompute, out_dtype=torch.float32)
    if out == "replicated":
        (summed,) = _AllReduceSum.apply(group, True, partial)
        return summed.to(x.dtype), topk_ids
    return _ReduceScatterRows.apply(partial, group, size, rank).to(x.dtype), topk_ids


def _all_to_all(x, router_logits, w13, w2, w13_scale, w2_scale, config, bias, implementation, group: str, recompute,
                shared_logits=None, biases=(None, None)):
    """DeepEP-style dispatch / combine (:class:`_AllToAllLayer`). Returns ``(out [T_r, H], topk_ids [T_r, topk'])``."""
    # No backward can follow (no_grad / inference_mode): keep no GEMM 1 output (the forward computes the same)
    recompute = recompute or not torch.is_grad_enabled()
    return _AllToAllLayer.apply(x, router_logits, w13, w2, w13_scale, w2_scale, bias, shared_logits, *biases, config,
                                *config_key(config), group, implementation, recompute)
