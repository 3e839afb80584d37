"""MXFP4 codes in the MMA layout read by the kernels (CONTRACT.md section 9, "MMA layout"; ``w_format="mxfp4_mma"``,
``MoEConfig(w4_layout="mma")``).

- The grouped GEMM, the decode path and the layer (forward and backward) give bit for bit what they give on the
  checkpoint layout's codes, on every backend of this device (on a GPU the Triton kernels run the MMA layout's packed
  decode; the interpreter and the references take the codes back to the checkpoint layout); scale codes the layout's
  table cannot hold (129..254) read as NaN on every backend, and the load-time repack refuses them.
- The Triton kernels' packed decode gets each row's 4-byte words whole: the operand layout the compiler gives the
  inline asm (sm_90) packs 4 consecutive bytes of a row, starting at a multiple of 4 (else the permutation would be
  read across words: wrong values, no error).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
from common import TORCH_DEVICE

from moe_contract.config import MoEConfig
from moe_torch import grouped_gemm, moe_forward, mxfp4_to_mma_layout, quantize_weight_mxfp4
from moe_torch.ops.decode.api import fused_experts_decode
from moe_torch.layer import mma_layout_weight, quantize_layer_weights

DEV = TORCH_DEVICE


def _weights(seed: int, E: int, N: int, K: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * torch.exp2(torch.randint(-3, 3, (E, N, 1), generator=g).float())
    wq, ws = quantize_weight_mxfp4(w)
    return wq.to(DEV), ws.to(DEV), mxfp4_to_mma_layout(wq).to(DEV)


@pytest.mark.parametrize("implementation", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_gemm_mma_layout_equals_checkpoint_layout(implementation, dtype):
    """Ragged, empty and trailing-unowned rows, an odd N, a K of 3 scale groups: bit for bit the checkpoint codes'
    result; a scale code of 130 (and 129 / 254) gives NaN in exactly the rows of its expert and its column."""
    E, N, K, M = 4, 37, 96, 23
    wq, ws, wm = _weights(0, E, N, K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEV)
    off = torch.tensor([0, 5, 5, 17, 21], dtype=torch.int32, device=DEV)  # expert 1 empty, rows 21.. unowned
    a = grouped_gemm(x, wq, off, w_scale=ws, w_format="mxfp4", implementation=implementation)
    b = grouped_gemm(x, wm, off, w_scale=ws, w_format="mxfp4_mma", implementation=implementation)
    assert torch.equal(a, b)
    assert a[5:21].abs().sum() > 0 and not a[21:].any()
    bad = ws.clone()
    bad[2, 3, 1], bad[3, 30, 0], bad[0, 7, 2] = 130, 254, 128  # 128: the largest code the table holds
    out = grouped_gemm(x, wm, off, w_scale=bad, w_format="mxfp4_mma", implementation=implementation)
    nan = torch.isnan(out).cpu()
    expect = torch.zeros(M, N, dtype=torch.bool)
    expect[5:17, 3] = expect[17:21, 30] = True
    assert torch.equal(nan, expect)
    ok = grouped_gemm(x, wq, off, w_scale=bad, w_format="mxfp4", implementation=implementation)
    assert torch.equal(out[~nan.to(DEV)], ok[~nan.to(DEV)])  # code 128 served: the checkpoint codes' values


def _gpt_oss_like(layout: str, **kw) -> MoEConfig:
    return MoEConfig(hidden_size=64, intermediate_size=96, num_experts=6, topk=2, quant="mxfp4", w4_layout=layout,
                     activation="swiglu_oai", gate_up_layout="interleaved", expert_bias=True, **kw)


def _layer_inputs(cfg: MoEConfig, T: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    H, I, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.3
    w2 = torch.randn(E, H, I, generator=g) * 0.3
    checkpoint = quantize_layer_weights(w13, w2, _gpt_oss_like("checkpoint"))
    mma = quantize_layer_weights(w13, w2, cfg)
    biases = (torch.randn(E, 2 * I, generator=g).to(DEV), torch.randn(E, H, generator=g).to(DEV))
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(DEV)
    logits = torch.randn(T, E, generator=g).to(DEV)
    return [t.to(DEV) for t in checkpoint], [t.to(DEV) for t in mma], biases, x, logits


def test_quantize_layer_weights_mma_layout_and_its_refusal():
    """``quantize_layer_weights`` with ``w4_layout="mma"`` gives the repacked codes and the same scales; a scale code
    above 128 is refused at load time, naming the weight; ``w4_layout="mma"`` is MXFP4's only."""
    cfg = _gpt_oss_like("mma")
    ck, mm, *_ = _layer_inputs(cfg, 1)
    assert torch.equal(mm[0], mxfp4_to_mma_layout(ck[0])) and torch.equal(mm[2], mxfp4_to_mma_layout(ck[2]))
    assert torch.equal(mm[1], ck[1]) and torch.equal(mm[3], ck[3])
    scale = ck[3].clone()
    scale[1, 2, 0] = 131
    with pytest.raises(ValueError, match=r"quantize_layer_weights: w2_scale: 1 e8m0 scale codes above 128.*131"):
        mma_layout_weight("quantize_layer_weights", "w2", ck[2], scale)
    with pytest.raises(ValueError, match="w4_layout='mma' is a layout of MXFP4 codes"):
        MoEConfig(hidden_size=64, intermediate_size=64, num_experts=4, topk=2, quant="int4", w4_layout="mma")


@pytest.mark.parametrize("T", [1, 3])
def test_decode_path_mma_layout_equals_checkpoint_layout(T):
    """gpt-oss's decode path (interleaved swiglu_oai, biases) on MMA-layout codes: bit for bit the checkpoint's."""
    cfg = _gpt_oss_like("mma")
    ck, mm, (b13, b2), x, logits = _layer_inputs(cfg, T)
    w = torch.softmax(logits, -1).topk(2, dim=-1)
    ids, wts = w.indices.to(torch.int32), w.values.float()
    with torch.no_grad():
        a = fused_experts_decode(x, wts, ids, ck[0], ck[2], _gpt_oss_like("checkpoint"), w13_scale=ck[1],
                                 w2_scale=ck[3], w13_bias=b13, w2_bias=b2, implementation="triton")
        b = fused_experts_decode(x, wts, ids, mm[0], mm[2], cfg, w13_scale=mm[1], w2_scale=mm[3], w13_bias=b13,
                                 w2_bias=b2, implementation="triton")
        r = fused_experts_decode(x, wts, ids, mm[0], mm[2], cfg, w13_scale=mm[1], w2_scale=mm[3], w13_bias=b13,
                                 w2_bias=b2, implementation="reference")
    assert torch.equal(a, b) and a.abs().sum() > 0
    ref = fused_experts_decode(x, wts, ids, ck[0], ck[2], _gpt_oss_like("checkpoint"), w13_scale=ck[1],
                               w2_scale=ck[3], w13_bias=b13, w2_bias=b2, implementation="reference")
    assert torch.equal(r, ref)


def test_layer_mma_layout_forward_and_backward_equal_checkpoint_layout():
    """``moe_forward`` on MMA-layout codes: the output and ``d_x`` / ``d_router_logits`` bit for bit the checkpoint
    codes' (T = 7: ragged experts)."""
    cfg = _gpt_oss_like("mma")
    ck, mm, (b13, b2), x, logits = _layer_inputs(cfg, 7)
    outs = []
    for c, (w13, s13, w2, s2) in ((_gpt_oss_like("checkpoint"), ck), (cfg, mm)):
        xi, li = x.clone().requires_grad_(), logits.clone().requires_grad_()
        y = moe_forward(xi, li, w13, w2, c, w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2)
        y.float().square().sum().backward()
        outs.append((y.detach(), xi.grad, li.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert outs[0][1].abs().sum() > 0


# ---------------------------------------------------------------------------------------------------------------
# The compiled kernels: the inline asm's operand packs whole, aligned 4-byte words of a row

_LAYOUT = re.compile(r"^#(\w+) = #ttg\.(linear|blocked)<\{(.*)\}>", re.M)


def _word_aligned(kind: str, body: str) -> bool:
    """Whether a TTGIR layout of a 2-D ``[rows, bytes]`` tensor gives each thread 4 consecutive bytes of a row
    (starting at a multiple of 4) as its consecutive registers, which ``pack=4`` hands to one asm call."""
    if kind == "blocked":
        size = [int(v) for v in re.search(r"sizePerThread = \[([^\]]*)\]", body).group(1).split(",")]
        order = [int(v) for v in re.search(r"order = \[([^\]]*)\]", body).group(1).split(",")]
        return size[-1] % 4 == 0 and order[0] == len(size) - 1
    bases = {k: [[int(v) for v in b.split(",")] for b in re.findall(r"\[(-?\d+, -?\d+)\]", v)]
             for k, v in re.findall(r"(register|lane|warp|block) = (\[[^=]*\])", body)}
    reg = bases["register"]
    rest = reg[2:] + bases.get("lane", []) + bases.get("warp", []) + bases.get("block", [])
    return reg[:2] == [[0, 1], [0, 2]] and all(b[1] % 4 == 0 for b in rest)


def test_word_aligned_reads_layouts():
    """The layout check itself (it must be able to fail)."""
    assert _word_aligned("linear", "register = [[0, 1], [0, 2], [0, 16], [32, 0]], lane = [[0, 4], [1, 0]], "
                                   "warp = [[8, 0]], block = []")
    assert not _word_aligned("linear", "register = [[0, 1], [0, 2]], lane = [[0, 2], [1, 0]], warp = [], block = []")
    assert not _word_aligned("linear", "register = [[0, 1], [1, 0], [0, 2]], lane = [[0, 4]], warp = [], block = []")
    assert _word_aligned("blocked", "sizePerThread = [1, 8], threadsPerWarp = [4, 8], warpsPerCTA = [4, 1], "
                                    "order = [1, 0]")
    assert not _word_aligned("blocked", "sizePerThread = [1, 2], threadsPerWarp = [4, 8], warpsPerCTA = [4, 1], "
                                        "order = [1, 0]")


#: The integer arguments of the jobs below that a launch at gpt-oss's sizes (H = I = 2880) gets divisible by 16
#: (not M_cap / S: a batch's rows; not the scale strides: 90 groups a row).
_DIVISIBLE = {"N", "K", "H", "I", "stride_xm", "stride_we", "stride_wn", "stride_om", "stride_xt", "stride_as",
              "stride_ot", "stride_be"}


@pytest.mark.skipif(TORCH_DEVICE != "cpu", reason="a compile for sm_90 on the CPU; the GPU runs the kernels above")
def test_mma_layout_asm_gets_whole_words_in_every_kernel():
    """The grouped GEMM (the heuristic's 16- and 64-row tiles, a 32-wide and a 128-wide K step) and both decode
    kernels (T = 1 and 64) compiled for sm_90 with
    ``"mxfp4_mma"`` codes: every MMA-layout asm call's byte operand has a word-aligned layout."""
    from sm90 import compile_sm90

    from moe_torch.ops.decode.config import decode_down_config, decode_gate_up_config
    from moe_torch.ops.grouped_gemm.config import heuristic_grouped_gemm_config
    from moe_torch.ops.grouped_gemm.triton import W_SCALE_CODES

    code = W_SCALE_CODES["mxfp4_mma"]
    jobs = {}
    # the heuristic's tiles at few and many rows, and tiles a config may ask for: the narrowest K step (16 bytes a
    # row) and a wide one over 8 warps
    cfgs = {f"gemm-{rows}": heuristic_grouped_gemm_config(rows, 5760, 2880, 32, 16, None, False, "mxfp4")
            for rows in (256, 16384)}
    cfgs["gemm-16x64x32"] = dataclasses.replace(cfgs["gemm-256"], block_m=16, block_n=64, block_k=32, num_warps=4)
    cfgs["gemm-64x128x128-8warps"] = dataclasses.replace(cfgs["gemm-16384"], block_m=64, block_n=128, block_k=128,
                                                         num_warps=8)
    for job_name, cfg in cfgs.items():
        ints = ("M_cap", "N", "K", "E", "stride_xm", "stride_we", "stride_wn", "stride_om", "stride_xsm", "stride_xsk",
                "stride_wse", "stride_wsn", "stride_wsk", "stride_be")
        jobs[job_name] = {
            "module": "moe_torch.ops.grouped_gemm.triton", "kernel": "_grouped_gemm_kernel", "stage": "ttgir",
            "signature": {"x_ptr": "*bf16", "w_ptr": "*u8", "offsets_ptr": "*i32", "x_scale_ptr": "*fp32",
                          "w_scale_ptr": "*u8", "bias_ptr": "*fp32", "out_ptr": "*bf16", **{n: "i32" for n in ints},
                          "e8m0_lut": "*bf16"},
            "constexprs": {"X_SCALE": 0, "W_SCALE": code, "X_GROUP": 1, "W_BLOCK": 1, "IEEE_F32": False,
                           "HAS_BIAS": False, "BLOCK_E": 64, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                           "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m, "PERSISTENT": cfg.persistent},
            "options": {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}}
    H = I = 2880
    E, k = 32, 4
    for T in (1, 64):
        a, b = decode_gate_up_config(T, k, H, I, E, True), decode_down_config(T, H, I, True)
        S = T * k
        jobs[f"gate_up-T{T}"] = {
            "module": "moe_torch.ops.decode.triton", "kernel": "_decode_gate_up_kernel", "stage": "ttgir",
            "signature": {"x_ptr": "*bf16", "ids_ptr": "*i32", "tw_ptr": "*fp32", "w_ptr": "*u8", "ws_ptr": "*u8",
                          "b_ptr": "*bf16", "a_ptr": "*bf16",
                          **{n: "i32" for n in ("S", "H", "I", "E_local", "expert_start", "stride_xt", "stride_we",
                                                "stride_wn", "stride_wse", "stride_wsn", "stride_wsk", "stride_be",
                                                "stride_as")}, "e8m0_lut": "*bf16"},
            "constexprs": dict(K_SLOTS=k, TOPK=k, ON_INPUT=False, ACTIVATION=2, INTERLEAVED=True, HAS_BIAS=True,
                               W_SCALE=code, IEEE_F32=False, BLOCK_E=E, CHUNK_S=a.chunk_s,
                               NUM_CHUNKS=-(-S // a.chunk_s), NUM_M_BLOCKS=-(-S // a.block_m), BLOCK_M=a.block_m,
                               BLOCK_N=a.block_n, BLOCK_K=a.block_k),
            "options": {"num_warps": a.num_warps, "num_stages": a.num_stages}}
        jobs[f"down-T{T}"] = {
            "module": "moe_torch.ops.decode.triton", "kernel": "_decode_down_kernel", "stage": "ttgir",
            "signature": {"a_ptr": "*bf16", "ids_ptr": "*i32", "tw_ptr": "*fp32", "w_ptr": "*u8", "ws_ptr": "*u8",
                          "b_ptr": "*bf16", "out_ptr": "*bf16",
                          **{n: "i32" for n in ("H", "I", "E_local", "expert_start")}, "rsf": "fp32",
                          **{n: "i32" for n in ("stride_as", "stride_we", "stride_wn", "stride_wse", "stride_wsn",
                                                "stride_wsk", "stride_be", "stride_ot")}, "e8m0_lut": "*bf16"},
            "constexprs": dict(K_SLOTS=k, TOPK=k, ON_INPUT=False, HAS_BIAS=True, APPLY_RSF=False, W_SCALE=code,
                               USE_DOT=True, BLOCK_H=b.block_h, BLOCK_I=b.block_i),
            "options": {"num_warps": b.num_warps, "num_stages": b.num_stages}}
    for job in jobs.values():  # what a launch at these sizes specializes: aligned pointers, ints divisible by 16
        job["divisible"] = [n for n, t in job["signature"].items() if t.startswith("*") or n in _DIVISIBLE]
    for name, ttgir in compile_sm90(jobs).items():
        layouts = {m.group(1): (m.group(2), m.group(3)) for m in _LAYOUT.finditer(ttgir)}
        calls = [line for line in ttgir.splitlines() if "elementwise_inline_asm" in line and "shf.l.wrap" in line]
        assert calls, f"{name}: no MMA-layout asm call"
        for line in calls:
            operand = re.search(r"\} %\S+, %\S+ : tensor<\d+x\d+xi8, #(\w+)>", line).group(1)
            assert _word_aligned(*layouts[operand]), f"{name}: the asm's bytes are not whole words: {layouts[operand]}"


def test_jax_takes_mma_layout_codes_with_the_same_results():
    """JAX's grouped GEMM (``w_format="mxfp4_mma"``), decode path and layer (``w4_layout="mma"``) on MMA-layout codes:
    bit for bit their results on the checkpoint codes (the Pallas-Triton kernels read the checkpoint layout: the
    codes go back to it at the call); a scale code of 130 reads as NaN as in torch."""
    import jax
    import jax.numpy as jnp

    import moe_pallas
    from moe_pallas.ops.decode.api import fused_experts_decode as jax_decode

    wq, ws, wm = (np.asarray(t.cpu()) for t in _weights(5, 3, 24, 64))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((9, 64)), jnp.bfloat16)
    off = jnp.asarray([0, 4, 4, 9], jnp.int32)
    a = moe_pallas.grouped_gemm(x, jnp.asarray(wq), off, w_scale=jnp.asarray(ws), w_format="mxfp4")
    bad = ws.copy()
    bad[2, 1, 0] = 130
    b = moe_pallas.grouped_gemm(x, jnp.asarray(wm), off, w_scale=jnp.asarray(bad), w_format="mxfp4_mma")
    nan = np.isnan(np.asarray(b, np.float32))
    assert nan[4:, 1].all() and nan.sum() == 5
    nan[4:, 1] = True
    assert np.array_equal(np.asarray(a)[~nan], np.asarray(b)[~nan])
    cfg, ck_cfg = _gpt_oss_like("mma"), _gpt_oss_like("checkpoint")
    ck, mm, (b13, b2), xt, logits = _layer_inputs(cfg, 5)
    j = lambda t: jnp.asarray(t.detach().cpu().float().numpy()).astype(  # noqa: E731
        jnp.bfloat16 if t.dtype == torch.bfloat16 else jnp.float32) if t.is_floating_point() else jnp.asarray(t.cpu())
    xj, lj, bj = j(xt), j(logits), (j(b13), j(b2))
    outs = [moe_pallas.moe_forward(xj, lj, j(w13), j(w2), c, w13_scale=j(s13), w2_scale=j(s2), w13_bias=bj[0],
                                   w2_bias=bj[1]) for c, (w13, s13, w2, s2) in ((ck_cfg, ck), (cfg, mm))]
    assert np.array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
    top = jax.lax.top_k(jax.nn.softmax(lj, -1), 2)
    dec = [jax_decode(xj, top[0], top[1].astype(jnp.int32), j(w13), j(w2), c, w13_scale=j(s13), w2_scale=j(s2),
                      w13_bias=bj[0], w2_bias=bj[1]) for c, (w13, s13, w2, s2) in ((ck_cfg, ck), (cfg, mm))]
    assert np.array_equal(np.asarray(dec[0]), np.asarray(dec[1]))
    w13, w2 = j(torch.randn(6, 192, 64)), j(torch.randn(6, 64, 96))
    mq, cq = moe_pallas.quantize_layer_weights(w13, w2, cfg), moe_pallas.quantize_layer_weights(w13, w2, ck_cfg)
    assert np.array_equal(np.asarray(mq[0]), np.asarray(moe_pallas.mxfp4_to_mma_layout(cq[0])))
    assert np.array_equal(np.asarray(mq[3]), np.asarray(cq[3]))


def test_mma_layout_modules_refuse_scales_and_save_the_checkpoint_layout(tmp_path):
    """Loading and saving around the layout: ``EPMoE`` / ``MoELayer`` built on MMA-layout codes with a scale code the
    layout cannot hold (131) refuse it, naming the scale, where the layer would read NaN; a JAX ``MoEBlock`` with
    ``w4_layout="mma"`` is saved in the checkpoint layout (the file format transformers reads): reloaded, it computes
    what the block computed; an empty code tensor permutes to an empty one."""
    import jax.numpy as jnp

    import moe_pallas
    import moe_torch
    from interop.hf_jax import load_nnx_moe_block, save_nnx_moe_block

    cfg = _gpt_oss_like("mma")
    _, mm, (b13, b2), _, _ = _layer_inputs(cfg, 1)
    bad = mm[3].clone()
    bad[0, 1, 0] = 131
    with pytest.raises(ValueError, match=r"EPMoE: w2_scale: 1 e8m0 scale codes above 128 .*largest code 131"):
        moe_torch.EPMoE(cfg, mm[0], mm[2], w13_scale=mm[1], w2_scale=bad, w13_bias=b13, w2_bias=b2)
    j = lambda t: jnp.asarray(t.detach().cpu().numpy()) if t.dtype != torch.float32 else jnp.asarray(t.cpu().numpy())  # noqa: E731
    with pytest.raises(ValueError, match=r"w2_scale: 1 e8m0 scale codes above 128"):
        moe_pallas.MoELayer(cfg, j(mm[0]), j(mm[2]), w13_scale=j(mm[1]), w2_scale=j(bad), w13_bias=j(b13),
                            w2_bias=j(b2))
    block = moe_pallas.MoEBlock.from_preset("gpt-oss-20b", seed=0, quant="mxfp4", w4_layout="mma", hidden_size=64,
                                            intermediate_size=64, num_experts=4)
    save_nnx_moe_block(block, str(tmp_path), layer=0, model_type="gpt_oss")
    back = load_nnx_moe_block(str(tmp_path), layer=0)
    assert back.layer.config.w4_layout == "checkpoint"
    assert np.array_equal(np.asarray(back.layer.w13[...]), np.asarray(moe_pallas.mxfp4_from_mma_layout(block.layer.w13[...])))
    x = jnp.full((1, 3, 64), 0.1, jnp.bfloat16)
    assert np.array_equal(np.asarray(block(x)), np.asarray(back(x)))
    assert moe_torch.mxfp4_to_mma_layout(torch.zeros(2, 3, 0, dtype=torch.uint8)).shape == (2, 3, 0)
