"""Expert parallelism over real processes: ``moe_torch.ep.ep_moe_forward`` and ``EPMoE(process_group=...)``.

Four gloo processes on the CPU (one ``torch.multiprocessing`` spawn for every case, so that the
file stays well under two minutes on a 2-core machine; each rank checks its own output and rank 0
writes every result to a JSON file), and two NCCL processes on two GPUs when there are two.

Each case compares the EP layer with the single-device ``moe_torch.moe_forward`` (``ep_size=1``,
every expert, ``implementation='reference'`` on the CPU) on the same inputs, in three layouts:

- ``replicated``: same ``x [T, H]`` on every rank, all-reduce: every rank's ``[T, H]``;
- ``replicated_sharded``: same, reduce-scatter: rank ``r`` holds ``shard_rows(T, P, r)``;
- ``all_to_all``: rank ``r`` holds an uneven slice of the tokens (sizes in ``SHARDS``, zeros
  included) and gets those tokens' outputs back.

The same spawn runs the backward (CONTRACT.md section 8, "EP"; ``BACKWARD_CASES``): in every layout
each rank's ``w13`` / ``w2`` gradients must equal its slice of the single-device layer's gradients, and
its ``x`` / ``router_logits`` gradients the single-device ones (replicated: the whole ``[T, ...]``,
after the backward's all-reduce; all_to_all: the rows of its own tokens).

And the router losses (CONTRACT.md section 10, ``return_router_losses``): in both modes every rank's losses and
``tokens_per_expert`` are the single-device ones of all ``T`` tokens (all_to_all: the ranks' sums all-reduced), and
their gradient in the rank's ``router_logits`` the single-device gradient's rows.

The checks every framework's EP layer passes (the output, the gradients, the router losses, the backward's edges
exercised) are the shared ones of ``op_cases/ep.py`` (``TestEpGloo``: one record per rank); the torch-only ones (the
module, the reduce-scatter fallback, the group checks, NCCL) beside them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))  # `import tolerances` in the spawned processes too

import moe_torch  # noqa: E402
from gloo_ranks import gather_to_file, spawn_ranks  # noqa: E402
from moe_contract import MoEConfig, get_preset, make_layer_inputs  # noqa: E402
from moe_torch.ep import ep_moe_forward, shard_rows  # noqa: E402
from op_cases.ep import GRAD_NAMES, EPCases, check_forward_errors, check_gradient_records  # noqa: E402
from tolerances import BF16_REL_FRO, F32_REL_FRO, rel_fro  # noqa: E402

WORLD = 4
#: Tokens per rank under ``mode='all_to_all'`` (the caller's sharding; uneven, with empty ranks).
SHARDS = {
    16: (5, 3, 8, 0),
    7: (3, 0, 2, 2),  # T not divisible by P
    1: (0, 0, 1, 0),  # three ranks without tokens (they still serve the experts they own)
    64: (40, 24),  # the two-GPU test
}
#: Configs at CPU size. "tiny": DeepSeek-V3 routing (sigmoid + bias, 4 groups keep 2, rsf 2.5 in
#: the combine), 16 experts + 1 fused shared expert (on rank 3: E_local 4, 4, 4, 5).
#: "no_shared": softmax top-2 of 8 (E_local 2), rsf 2.0 applied by the gate, no shared expert.
CONFIGS = {
    "tiny": lambda **kw: get_preset("tiny").config(**kw),
    "no_shared": lambda **kw: MoEConfig(hidden_size=64, intermediate_size=32, num_experts=8, topk=2,
                                        routing="softmax_topk", routed_scaling_factor=2.0,
                                        apply_routed_scaling_factor_on_output=True, **kw),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LAYOUTS = ("replicated", "replicated_sharded", "all_to_all")


@dataclasses.dataclass(frozen=True)
class Case:
    config: str
    T: int
    quant: str = "none"
    dtype: str = "float32"
    routing: str = "uniform"  # "rank0": logits pick only rank 0's routed experts
    #: the EP layer's stage backends, when not the spawn's (the single-device reference keeps the spawn's)
    implementation: str | None = None
    recompute: bool = False  # backward cases: the EP layer's (the single-device reference keeps False)

    @property
    def name(self) -> str:
        impl = f"-{self.implementation}" if self.implementation else ""
        return f"{self.config}-T{self.T}-{self.quant}-{self.dtype}-{self.routing}{impl}" + ("-recompute" * self.recompute)


CPU_CASES = (
    Case("tiny", 16),
    Case("tiny", 7),  # T % P != 0: padded reduce-scatter, uneven shards
    Case("tiny", 1),  # one token: three ranks hold none under all_to_all
    Case("tiny", 16, routing="rank0"),  # uneven load: ranks 1, 2 get no rows (rank 3 the shared expert)
    Case("no_shared", 16),
    Case("no_shared", 7),
    Case("no_shared", 1),
    Case("no_shared", 16, routing="rank0"),  # ranks 1..3 get no rows at all
    Case("tiny", 16, quant="fp8_per_token", dtype="bfloat16"),
    Case("tiny", 7, dtype="bfloat16"),  # float32 all-reduce of bf16 partials
    Case("no_shared", 7, implementation="triton"),  # the Triton kernels (interpreted) between the collectives
)
# The gloo group runs on CPU tensors: its Triton case needs the interpreter, which the GPU test run
# (EPMOE_TEST_DEVICE=gpu) leaves off; there the NCCL test below runs the compiled kernels.
CPU_CASES = tuple(c for c in CPU_CASES if c.implementation != "triton" or os.environ.get("TRITON_INTERPRET") == "1")
GPU_CASES = (
    Case("dsv3", 64, dtype="bfloat16"),
    Case("dsv3", 64, quant="fp8_block", dtype="bfloat16"),
    Case("dsv3", 64, dtype="bfloat16", routing="rank0"),
)
#: Backward cases (each in the three layouts), edges in the comments.
BACKWARD_CASES = (
    Case("tiny", 7),  # DeepSeek-V3 routing, rsf in the combine, shared expert on rank 3; T % P != 0; rank 1 no tokens
    Case("no_shared", 1, recompute=True),  # T=1: three ranks hold no token under all_to_all; rsf on the gate
    Case("no_shared", 16, routing="rank0"),  # ranks 1..3 get no rows: their weight gradients exactly 0
    Case("tiny", 7, dtype="bfloat16"),  # bf16 gradients, summed over ranks in float32
    Case("tiny", 7, quant="fp8_per_token", dtype="bfloat16"),  # FP8: straight-through (x, router_logits only)
    Case("no_shared", 7, implementation="triton"),  # the Triton backward kernels (interpreted) between the collectives
)
BACKWARD_CASES = tuple(c for c in BACKWARD_CASES if c.implementation != "triton" or os.environ.get("TRITON_INTERPRET") == "1")
GPU_BACKWARD_CASES = (
    Case("dsv3", 64, dtype="bfloat16"),
    Case("dsv3", 64, quant="fp8_block", dtype="bfloat16"),
)


def make_config(case: Case, **kw) -> MoEConfig:
    if case.config == "dsv3":  # DeepSeek-V3 routing and expert count at reduced H, I
        return get_preset("deepseek-v3").config(hidden_size=512, intermediate_size=256, quant=case.quant, **kw)
    return CONFIGS[case.config](quant=case.quant, **kw)


def make_inputs(case: Case, world: int, device: str):
    """Every rank draws the same global inputs: ``(config_1, x, logits, w13, w13_s, w2, w2_s, bias)``
    with every expert's (quantized) weights and the single-device config."""
    config = make_config(case)
    inputs = make_layer_inputs(config, case.T, seed=7)
    logits = inputs.router_logits.copy()
    if case.routing == "rank0":  # rank 0's experts [0, E/P) win every routed slot
        logits[:, : config.num_experts // world] += 30.0
    dtype = DTYPES[case.dtype]
    x = torch.from_numpy(inputs.x).to(device, dtype)
    w13 = torch.from_numpy(inputs.w13).to(device, dtype)
    w2 = torch.from_numpy(inputs.w2).to(device, dtype)
    w13, w13_s, w2, w2_s = moe_torch.quantize_layer_weights(w13, w2, config)
    bias = torch.from_numpy(inputs.e_score_correction_bias).to(device) if config.routing == "biased_grouped_topk" else None
    return config, x, torch.from_numpy(logits).to(device), w13, w13_s, w2, w2_s, bias


def _local(t, config):
    return None if t is None else moe_torch.local_weights(t, config)


def run_cases(rank: int, world: int, cases, device: str, implementation) -> dict:
    """This rank's errors ``{case: {layout: rel. Frobenius error}}`` plus the error-message checks."""
    results = {}
    for case in cases:
        config1, x, logits, w13, w13_s, w2, w2_s, bias = make_inputs(case, world, device)
        ref = moe_torch.moe_forward(x, logits, w13, w2, config1, w13_scale=w13_s, w2_scale=w2_s,
                                    e_score_correction_bias=bias, implementation=implementation)
        cfg = config1.replace(ep_size=world, ep_rank=rank)
        local = dict(w13_scale=_local(w13_s, cfg), w2_scale=_local(w2_s, cfg), e_score_correction_bias=bias,
                     implementation=case.implementation or implementation)
        w13_l, w2_l = _local(w13, cfg), _local(w2, cfg)
        errs = {}
        out = ep_moe_forward(x, logits, w13_l, w2_l, cfg, mode="replicated", **local)
        errs["replicated"] = rel_fro(out, ref)
        start, stop = shard_rows(case.T, world, rank)
        out = ep_moe_forward(x, logits, w13_l, w2_l, cfg, mode="replicated", out="sharded", **local)
        errs["replicated_sharded"] = rel_fro(out, ref[start:stop]) if stop > start else float(out.shape != (0, x.shape[1]))
        sizes = SHARDS[case.T]
        lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
        out = ep_moe_forward(x[lo:hi], logits[lo:hi], w13_l, w2_l, cfg, mode="all_to_all", **local)
        errs["all_to_all"] = rel_fro(out, ref[lo:hi]) if hi > lo else float(out.shape != (0, x.shape[1]))
        results[case.name] = errs
    # The module, both modes, on the first case (EPMoE.from_float slices and quantizes like above).
    case = cases[0]
    config1, x, logits, w13_all, _, w2_all, _, bias = make_inputs(dataclasses.replace(case, quant="none"), world, device)
    ref = moe_torch.moe_forward(x, logits, w13_all, w2_all, config1, e_score_correction_bias=bias, implementation=implementation)
    cfg = config1.replace(ep_size=world, ep_rank=rank)
    sizes = SHARDS[case.T]
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    for mode in ("replicated", "all_to_all"):
        layer = moe_torch.EPMoE.from_float(cfg, w13_all, w2_all, e_score_correction_bias=bias, implementation=implementation,
                                           process_group=dist.group.WORLD, ep_mode=mode)
        out = layer(x, logits) if mode == "replicated" else layer(x[lo:hi], logits[lo:hi])
        results[f"EPMoE-{mode}"] = {mode: rel_fro(out, ref if mode == "replicated" else ref[lo:hi]) if hi > lo or mode == "replicated" else 0.0}
    # A backend without reduce_scatter_tensor (older gloo): the logged all_reduce + slice fallback.
    def unsupported(*args, **kwargs):
        raise RuntimeError("reduce_scatter_tensor is not supported by this backend (simulated)")

    saved, dist.reduce_scatter_tensor = dist.reduce_scatter_tensor, unsupported
    try:
        start, stop = shard_rows(case.T, world, rank)
        out = ep_moe_forward(x, logits, _local(w13_all, cfg), _local(w2_all, cfg), cfg, out="sharded",
                             e_score_correction_bias=bias, implementation=implementation)
        results["reduce_scatter_fallback"] = {"replicated_sharded": rel_fro(out, ref[start:stop]) if stop > start else 0.0}
    finally:
        dist.reduce_scatter_tensor = saved
    # A config that does not match the group: the same ValueError on every rank, before any collective.
    w13_l, w2_l = _local(w13_all, cfg), _local(w2_all, cfg)
    messages = {}
    for what, bad in (("ep_rank", cfg.for_rank((rank + 1) % world)), ("ep_size", config1)):
        try:
            ep_moe_forward(x, logits, _local(w13_all, bad), _local(w2_all, bad), bad, e_score_correction_bias=bias,
                           implementation=implementation)
            messages[what] = "no error"
        except ValueError as exc:
            messages[what] = str(exc)
    results["errors"] = messages
    return results


def run_backward_cases(rank: int, world: int, cases, device: str, implementation) -> dict:
    """This rank's gradient errors ``{case: {layout: {grad name: rel. Frobenius error vs the single-device
    gradient's matching part}}}``, plus ``"zero_rows_exact"``: whether its experts without rows got
    exactly-0 weight gradients (``None``: none such, or FP8), and ``"empty_experts"``: how many there were."""
    results = {}
    for case in cases:
        config1, x, logits, w13, w13_s, w2, w2_s, bias = make_inputs(case, world, device)
        fp8 = case.quant != "none"
        leaf = lambda t: t.detach().clone().requires_grad_()
        rng = np.random.default_rng(11)
        d_out = torch.from_numpy(rng.standard_normal(tuple(x.shape), dtype=np.float32)).to(device, x.dtype)
        ref_in = [leaf(x), leaf(logits), w13 if fp8 else leaf(w13), w2 if fp8 else leaf(w2)]
        moe_torch.moe_forward(*ref_in, config1, w13_scale=w13_s, w2_scale=w2_s, e_score_correction_bias=bias,
                              implementation=implementation).backward(d_out)
        ref = [t.grad for t in ref_in]
        cfg = config1.replace(ep_size=world, ep_rank=rank)
        start, n = cfg.local_expert_range()
        local = dict(w13_scale=_local(w13_s, cfg), w2_scale=_local(w2_s, cfg), e_score_correction_bias=bias,
                     implementation=case.implementation or implementation, recompute=case.recompute)
        sizes = SHARDS[case.T]
        errs = {}
        for layout in LAYOUTS:
            if layout == "all_to_all":
                lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
                rows_in = rows_out = slice(lo, hi)
                kw = dict(mode="all_to_all")
            else:
                rows_in = slice(0, case.T)
                rows_out = slice(*shard_rows(case.T, world, rank)) if layout == "replicated_sharded" else rows_in
                kw = dict(mode="replicated", out="sharded" if layout == "replicated_sharded" else "replicated")
            w13_l, w2_l = _local(w13, cfg), _local(w2, cfg)
            ins = [leaf(x[rows_in]), leaf(logits[rows_in]), w13_l if fp8 else leaf(w13_l), w2_l if fp8 else leaf(w2_l)]
            out = ep_moe_forward(*ins, cfg, **kw, **local)
            out.mul_(1.0)  # in place, as a residual add would be: the output must not be a custom Function's view
            out.backward(d_out[rows_out])
            want = [ref[0][rows_in], ref[1][rows_in]] + [None if r is None else r[start:start + n] for r in ref[2:]]
            e = {}
            for name, t, w in zip(GRAD_NAMES, ins, want):
                if w is None:  # FP8 codes: frozen, no gradient
                    e[name] = 0.0 if t.grad is None else float("inf")
                else:
                    e[name] = rel_fro(t.grad, w) if t.grad is not None else float("inf")
            empty = [] if fp8 else [i for i in range(n) if not want[2][i].any()]
            e["zero_rows_exact"] = None if not empty else all(
                not ins[j].grad[i].any() for i in empty for j in (2, 3))
            e["empty_experts"] = len(empty)
            errs[layout] = e
        results[case.name] = errs
    return results


#: The router-loss case: T = 8 tokens in sequences of 2, all_to_all shards with an empty rank (each a whole number
#: of sequences).
LOSS_T, LOSS_SEQ_LEN, LOSS_SHARDS = 8, 2, (2, 0, 4, 2)


def run_router_loss_case(rank: int, world: int, device: str) -> dict:
    """This rank's errors ``{mode: {"aux_loss", "seq_aux_loss", "z_loss", "d_router_logits": rel. error,
    "tokens_per_expert": exactly equal}}`` against the single-device ``router_losses`` of all ``T`` tokens."""
    config1, x, logits, w13, _, w2, _, bias = make_inputs(Case("tiny", LOSS_T), world, device)
    weights = {"aux_loss": 1.0, "seq_aux_loss": 0.5, "z_loss": 0.1}
    lg = logits.clone().requires_grad_()
    _, ids = moe_torch.select_experts(logits, **config1.gate_kwargs(), e_score_correction_bias=bias)
    ref = moe_torch.router_losses(lg, ids, config1, seq_len=LOSS_SEQ_LEN)
    sum(w * getattr(ref, name) for name, w in weights.items()).backward()
    cfg = config1.replace(ep_size=world, ep_rank=rank)
    results = {}
    for mode in ("replicated", "all_to_all"):
        if mode == "replicated":
            rows = slice(0, LOSS_T)
        else:
            rows = slice(sum(LOSS_SHARDS[:rank]), sum(LOSS_SHARDS[: rank + 1]))
        mine = logits[rows].clone().requires_grad_()
        _, got = ep_moe_forward(x[rows], mine, _local(w13, cfg), _local(w2, cfg), cfg, mode=mode,
                                e_score_correction_bias=bias, implementation="reference", return_router_losses=True,
                                seq_len=LOSS_SEQ_LEN)
        # The losses' backward alone: no collective in it (replicated: none; all_to_all: the identity)
        sum(w * getattr(got, name) for name, w in weights.items()).backward()
        errs = {name: rel_fro(getattr(got, name).detach().reshape(1), getattr(ref, name).detach().reshape(1))
                for name in weights}
        errs["tokens_per_expert"] = bool(torch.equal(got.tokens_per_expert.cpu(), ref.tokens_per_expert.cpu()))
        want = lg.grad[rows]
        errs["d_router_logits"] = 0.0 if want.numel() == 0 and mine.grad.numel() == 0 else rel_fro(mine.grad, want)
        results[mode] = errs
    return results


def worker(rank: int, world: int, init_method: str, backend: str, device_kind: str, cases, implementation, out_path: str,
           backward_cases=()):
    """One process of the group: run every case, gather the results, rank 0 writes them."""
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    else:
        torch.set_num_threads(1)  # 4 processes on 2 cores
        device = "cpu"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        t0 = time.perf_counter()
        mine = run_cases(rank, world, cases, device, implementation)
        mine["seconds"] = time.perf_counter() - t0
        mine["backward"] = run_backward_cases(rank, world, backward_cases, device, implementation)
        mine["backward_seconds"] = time.perf_counter() - t0 - mine["seconds"]
        if device_kind == "cpu":
            mine["router_losses"] = run_router_loss_case(rank, world, device)
        gather_to_file(mine, rank, world, out_path)
    finally:
        dist.destroy_process_group()


def spawn(world: int, backend: str, device_kind: str, cases, implementation, out_path, timeout_s: float = 300.0,
          backward_cases=()) -> list:
    """Run :func:`worker` in ``world`` processes; the per-rank results (kills them after ``timeout_s``)."""
    return spawn_ranks(worker, world, (backend, device_kind, cases, implementation, str(out_path), backward_cases),
                       out_path, timeout_s)


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    return spawn(WORLD, "gloo", "cpu", CPU_CASES, "reference", tmp_path_factory.mktemp("ep") / "results.json",
                 backward_cases=BACKWARD_CASES)


@pytest.fixture(scope="module")
def ep_results(gloo_results):
    """The shared cases' name for the spawn's results."""
    return gloo_results


#: The backward case whose rows all go to rank 0: ranks 1..3 get none.
RANK0_BACKWARD_CASE = next(c for c in BACKWARD_CASES if c.routing == "rank0")


class TestEpGloo(EPCases):
    """``moe_torch.ep.ep_moe_forward`` over the gloo group of :data:`WORLD` processes: one record per rank, each case
    in the three layouts. The backward's edge: the rank-0-only case leaves ranks 1..3 without rows (their experts'
    exact-zero check ran) and none of rank 0's experts without."""

    FORWARD_CASES = {f"{layout}-{case.name}": (case, layout) for layout in LAYOUTS for case in CPU_CASES}
    BACKWARD_CASES = {f"{layout}-{case.name}": (case, layout) for layout in LAYOUTS for case in BACKWARD_CASES}
    ROWLESS = {(RANK0_BACKWARD_CASE, "all_to_all"): [(0, 0)] + [(1, None)] * (WORLD - 1)}

    def forward_errors(self, ep_results, key):
        case, layout = key
        return [r[case.name][layout] for r in ep_results], case.quant, case.dtype

    def backward_records(self, ep_results, key):
        case, layout = key
        return [r["backward"][case.name][layout] for r in ep_results], case.dtype

    def router_loss_records(self, ep_results, mode):
        return [r["router_losses"][mode] for r in ep_results]


@pytest.mark.parametrize("mode", ("replicated", "all_to_all"))
def test_gloo_module(gloo_results, mode):
    errs = [r[f"EPMoE-{mode}"][mode] for r in gloo_results]
    assert all(e <= F32_REL_FRO for e in errs), errs


def test_gloo_reduce_scatter_fallback(gloo_results):
    errs = [r["reduce_scatter_fallback"]["replicated_sharded"] for r in gloo_results]
    assert all(e <= F32_REL_FRO for e in errs), errs


def test_gloo_config_must_match_group(gloo_results):
    for rank, r in enumerate(gloo_results):
        assert r["errors"]["ep_rank"].startswith(f"ep_moe_forward: config.ep_rank must equal this process's rank in the group (={rank})")
        assert r["errors"]["ep_size"] == "ep_moe_forward: config.ep_size must equal the group's size (=4); got config.ep_size=1"


def test_without_torch_distributed_is_a_value_error():
    config = CONFIGS["no_shared"]()
    x, logits = torch.zeros(2, 64), torch.zeros(2, 8)
    w13, w2 = torch.zeros(8, 64, 64), torch.zeros(8, 64, 32)
    with pytest.raises(ValueError, match="ep_moe_forward: group must be a process group of an initialised torch.distributed"):
        ep_moe_forward(x, logits, w13, w2, config)
    with pytest.raises(ValueError, match="ep_moe_forward: mode must be"):
        ep_moe_forward(x, logits, w13, w2, config, mode="deepep")
    with pytest.raises(ValueError, match="out must be 'sharded'"):
        ep_moe_forward(x, logits, w13, w2, config, mode="all_to_all", out="replicated")
    with pytest.raises(TypeError, match="ep_moe_forward: recompute must be a bool; got int 1"):
        ep_moe_forward(x, logits, w13, w2, config, recompute=1)


def test_module_without_group_is_unchanged():
    """No ``process_group`` / ``ep_mode``: the partial sum of ``moe_forward``, nothing moved."""
    cfg = CONFIGS["no_shared"](ep_size=4, ep_rank=1)
    inputs = make_layer_inputs(cfg, 5, seed=1)
    w13, w2 = torch.from_numpy(inputs.w13), torch.from_numpy(inputs.w2)
    layer = moe_torch.EPMoE.from_float(cfg, w13, w2, implementation="reference")
    x, logits = torch.from_numpy(inputs.x), torch.from_numpy(inputs.router_logits)
    want = moe_torch.moe_forward(x, logits, moe_torch.local_weights(w13, cfg), moe_torch.local_weights(w2, cfg), cfg,
                                 implementation="reference")
    assert torch.equal(layer(x, logits), want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_nccl_two_gpus(tmp_path):
    """Both modes over NCCL at DeepSeek-V3 routing (E=256 + 1 shared, topk 8) with H=512, I=256, bf16
    and fp8_block, the default backends (Triton kernels)."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast (inherited by the spawned processes)
    results = spawn(2, "nccl", "cuda", GPU_CASES, None, tmp_path / "results.json", backward_cases=GPU_BACKWARD_CASES)
    for case in GPU_CASES:
        for layout in LAYOUTS:
            check_forward_errors([r[case.name][layout] for r in results], case.quant, case.dtype, f"{case.name} {layout}")
    for mode in ("replicated", "all_to_all"):
        assert all(r[f"EPMoE-{mode}"][mode] <= BF16_REL_FRO for r in results)
    for case in GPU_BACKWARD_CASES:
        for layout in LAYOUTS:
            check_gradient_records([r["backward"][case.name][layout] for r in results], case.dtype,
                                   f"{case.name} {layout}")
