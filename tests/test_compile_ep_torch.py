"""``torch.compile(fullgraph=True)`` over the torch expert-parallel layer (``EPMoE`` with a process group, i.e.
``moe_torch.ep.ep_moe_forward``): two gloo processes on the CPU, one spawn for both modes.

Each rank compiles with ``backend="aot_eager"`` (AOTAutograd runs the EP custom ops' fake implementations, the
all_to_all op's received row count as an unbacked size) and compares with eager, bit for bit: the outputs, the router
losses and the gradients of the inputs and of every parameter. ``fullgraph=True`` makes a graph break an error
(raised in the rank, with its traceback, by the spawn). The modes: replicated (the collective copy of the inputs, the
float32 partial's all-reduce; beside it ``ep_moe_forward(out="sharded")``: reduce-scatter, all-gather in the
backward) and all_to_all with uneven token counts and a capacity (the exchanges and the host-read split sizes inside
the layer's ops, the router losses' all-reduce). Small sizes: about 20 s on two cores. (The EP numerics against the
single device: tests/test_ep_torch.py; the single-device layer compiled: tests/test_compile_transforms.py.)
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))  # `import gloo_ranks` in the spawned processes too

import moe_torch  # noqa: E402
from gloo_ranks import gather_to_file, spawn_ranks  # noqa: E402
from moe_contract.config import MoEConfig  # noqa: E402
from moe_torch.ep import ep_moe_forward  # noqa: E402

WORLD = 2
#: Every optional input of the layer in play: a fused shared expert (on rank 1) with its gate, expert biases, an rsf.
CONFIG = MoEConfig(hidden_size=16, intermediate_size=8, num_experts=4, topk=2, num_fused_shared_experts=1,
                   shared_expert_gate=True, expert_bias=True, routed_scaling_factor=2.5)
#: all_to_all: the tokens of rank r (uneven: the ranks' graphs differ in their sizes).
TOKENS = (5, 3)
SEQ_LEN = 1  # the router losses' sequence length (divides every rank's tokens)
MODES = ("replicated", "all_to_all")


def _weights() -> dict:
    """Every expert's weights (float32, the same on every rank), the shared expert gate, and ``x`` / router logits of
    all ``sum(TOKENS)`` tokens."""
    g = torch.Generator().manual_seed(0)
    E, H, I, T = CONFIG.num_total_experts, CONFIG.hidden_size, CONFIG.intermediate_size, sum(TOKENS)  # noqa: E741
    shapes = dict(w13=(E, 2 * I, H), w2=(E, H, I), w13_bias=(E, 2 * I), w2_bias=(E, H), shared_expert_gate=(1, H),
                  x=(T, H), router_logits=(T, CONFIG.num_experts))
    return {k: torch.randn(s, generator=g) * 0.5 for k, s in shapes.items()}


def _value_and_grads(fn, leaves: list) -> list:
    """``fn()``'s outputs ``(out, RouterLosses, *more)`` and the gradients of ``leaves`` of a loss over all of them."""
    out, losses, *more = fn()
    total = sum(o.square().sum() for o in (out, *more)) + losses.aux_loss + losses.seq_aux_loss + losses.z_loss
    return [out, *losses, *more, *torch.autograd.grad(total, leaves)]


def _case(mode: str, rank: int):
    """``(fn, leaves)`` of ``mode`` on rank ``rank``: ``fn(*leaves[:2])`` returns ``(out, RouterLosses, *more)`` of an
    ``EPMoE`` with the default process group; ``leaves``: ``x``, the router logits and the module's parameters."""
    w = _weights()
    if mode == "all_to_all":  # this rank's tokens; a capacity, counted over both ranks' tokens
        config = CONFIG.replace(ep_size=WORLD, ep_rank=rank, capacity_factor=1.0)
        rows = slice(sum(TOKENS[:rank]), sum(TOKENS[:rank + 1]))
    else:
        config = CONFIG.replace(ep_size=WORLD, ep_rank=rank)
        rows = slice(None)
    x, logits = (w[k][rows].clone().requires_grad_() for k in ("x", "router_logits"))
    layer = moe_torch.EPMoE.from_float(config, w["w13"], w["w2"], w13_bias=w["w13_bias"], w2_bias=w["w2_bias"],
                                       shared_expert_gate=w["shared_expert_gate"], implementation="reference",
                                       process_group=dist.group.WORLD, ep_mode=mode)

    def fn(x, logits):
        out, losses = layer(x, logits, return_router_losses=True, seq_len=SEQ_LEN)
        if mode == "all_to_all":
            return out, losses
        # the same layer with the output sharded over the ranks (reduce-scatter; all-gather in the backward)
        sharded = ep_moe_forward(x, logits, layer.w13, layer.w2, config, out="sharded", w13_bias=layer.w13_bias,
                                 w2_bias=layer.w2_bias, shared_expert_gate_logits=layer.shared_expert_gate_logits(x),
                                 implementation="reference")
        return out, losses, sharded

    return fn, [x, logits, *layer.parameters()]


def _worker(rank: int, world: int, init_method: str, out_path: str) -> None:
    """Per case: the names of the outputs / gradients where compiled and eager differ (none expected)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        mismatches = {}
        for mode in MODES:
            fn, leaves = _case(mode, rank)
            want = _value_and_grads(lambda: fn(*leaves[:2]), leaves)
            compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
            got = _value_and_grads(lambda: compiled(*leaves[:2]), leaves)
            assert len(got) == len(want) == 5 + (mode == "replicated") + len(leaves)
            mismatches[mode] = [i for i, (a, b) in enumerate(zip(got, want))
                                if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b)]
        gather_to_file(mismatches, rank, world, out_path)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def compiled_vs_eager(tmp_path_factory):
    out_path = tmp_path_factory.mktemp("ep_compile") / "results.json"
    return spawn_ranks(_worker, WORLD, (str(out_path),), out_path, timeout_s=180.0)


@pytest.mark.parametrize("mode", MODES)
def test_ep_compile_fullgraph_equals_eager(compiled_vs_eager, mode):
    """``torch.compile(fullgraph=True, backend="aot_eager")`` of ``EPMoE(process_group=..., ep_mode=mode)`` on two
    gloo ranks (replicated: with ``ep_moe_forward(out="sharded")`` beside it): no graph break, and the outputs, router
    losses and every gradient (inputs and parameters) equal eager bit for bit on each rank (the indices that differ
    are listed: output, 4 losses, the sharded output, then the leaves' gradients)."""
    assert [r[mode] for r in compiled_vs_eager] == [[]] * WORLD
