"""The packed 4-bit -> bf16 decode of the grouped GEMMs' Triton kernels (``moe_contract/w4_packed_asm.py``:
``MXFP4_PACKED_ASM``, ``INT4_PACKED_ASM``, used by moe_torch's Triton and moe_pallas' Pallas-Triton kernels), run on
the CPU.

The interpreter cannot execute inline PTX, so these tests execute the kernel's asm strings themselves in a small
PTX interpreter (the few instructions they use: ``mov``, ``prmt``, ``shl``, ``shr``, ``mul.lo``, ``and``, ``lop3``,
``fma.rn.bf16x2``, with the PTX ISA's semantics) for every byte value and a spread of scales, and compare the
result bit for bit with the contract's dequantization (CONTRACT.md section 9, ``dequantize_weight_mxfp4`` /
``dequantize_weight_int4`` rounded to bf16). The GPU tests of the 4-bit GEMMs run the compiled asm.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from moe_torch import dequantize_weight_int4, dequantize_weight_mxfp4
from moe_contract import w4_packed_asm


def _bf16_round(v: np.ndarray) -> np.ndarray:
    """float64 -> bf16 bit patterns (uint32, low 16 bits), round to nearest even, subnormals kept, overflow to
    inf, NaN -> 0x7FC0 (the GPU's canonical NaN differs; callers compare NaN-aware)."""
    v = np.asarray(v, np.float64)
    out = np.zeros(v.shape, np.uint32)
    sign = np.signbit(v).astype(np.uint32) << 15
    a = np.abs(v)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
        quantum = np.exp2(np.maximum(e, -126.0) - 7.0)  # the bf16 spacing at |v| (subnormals: 2^-133)
        r = np.rint(a / quantum) * quantum  # round half to even
    r32 = r.astype(np.float32)  # exact: r has at most 8 significant bits and lies in float32's range or is inf
    bits = (r32.view(np.uint32) >> 16).astype(np.uint32)
    bits = np.where(r >= 2.0**128, 0x7F80, bits)
    out = bits | sign
    return np.where(np.isnan(v), 0x7FC0, out).astype(np.uint32)


def _bf16_value(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, np.uint32) << 16).view(np.float32).astype(np.float64)


def _run_ptx(asm: str, regs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute ``asm`` (one ``{ ... }`` block) on uint32 arrays; ``regs`` holds ``$n`` inputs, returns all registers."""
    regs = {k: np.asarray(v, np.uint32) for k, v in regs.items()}
    shape = next(iter(regs.values())).shape

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.full(shape, int(tok, 0) & 0xFFFFFFFF, np.uint32)

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        d, src = args[0], args[1:]
        if op == "mov.b32":
            r = val(src[0])
        elif op == "shl.b32":
            r = (val(src[0]).astype(np.uint64) << int(src[1], 0)).astype(np.uint32)
        elif op == "shr.u32":
            r = val(src[0]) >> np.uint32(int(src[1], 0))
        elif op == "shf.l.wrap.b32":  # the 64-bit {b, a} shifted left by c mod 32, its upper word (a == b: rotate)
            a, b, n = val(src[0]).astype(np.uint64), val(src[1]).astype(np.uint64), val(src[2]) & np.uint32(31)
            wide = (b << np.uint64(32)) | a
            r = ((wide << n.astype(np.uint64)) >> np.uint64(32)) & np.uint64(0xFFFFFFFF)
        elif op == "mul.lo.u32":
            r = ((val(src[0]).astype(np.uint64) * val(src[1]).astype(np.uint64)) & 0xFFFFFFFF).astype(np.uint32)
        elif op == "and.b32":
            r = val(src[0]) & val(src[1])
        elif op == "lop3.b32":
            a, b, c, lut = val(src[0]), val(src[1]), val(src[2]), int(src[3], 0)
            r = np.zeros(shape, np.uint32)
            for idx in range(8):  # bit index = a<<2 | b<<1 | c (a = 0xF0, b = 0xCC, c = 0xAA)
                if (lut >> idx) & 1:
                    ma = a if idx & 4 else ~a
                    mb = b if idx & 2 else ~b
                    mc = c if idx & 1 else ~c
                    r |= ma & mb & mc
        elif op == "prmt.b32":  # default mode: bytes {b, a}, 4-bit selectors, bit 3 = replicate the sign
            a, b, c = val(src[0]), val(src[1]), val(src[2])
            pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
            r = np.zeros(shape, np.uint32)
            for i in range(4):
                sel = (c >> (4 * i)) & 0xF
                byte = np.choose(sel & 7, pool)
                byte = np.where(sel & 8, np.where(byte & 0x80, 0xFF, 0), byte)
                r |= (byte.astype(np.uint32) << (8 * i))
        elif op == "fma.rn.bf16x2":
            a, b, c = val(src[0]), val(src[1]), val(src[2])
            halves = []
            for sh in (0, 16):
                x, y, z = (_bf16_value((t >> sh) & 0xFFFF) for t in (a, b, c))
                with np.errstate(invalid="ignore", over="ignore"):
                    halves.append(_bf16_round(x * y + z))  # exact in float64, then one rounding
            r = halves[0] | (halves[1] << 16)
        else:
            raise AssertionError(f"PTX op {op!r} not modelled")
        regs[d] = r.astype(np.uint32)
    return regs


def _decode(asm: str, codes: np.ndarray, scale_bits: np.ndarray, n_results: int = 2):
    """codes uint8 [n, 4] (one asm call each), scale_bits uint16 [n, 4] (bf16 scale of each byte) -> the bf16 bits
    [n, 4] of each result (``n_results`` of them: low and high nibbles, or one), operands numbered after them."""
    c = codes.astype(np.uint32)
    packed = c[:, 0] | c[:, 1] << 8 | c[:, 2] << 16 | c[:, 3] << 24
    s = scale_bits.astype(np.uint32)
    n = 2 * n_results
    regs = _run_ptx(asm, {f"${n}": packed, f"${n + 1}": s[:, 0] | s[:, 1] << 16, f"${n + 2}": s[:, 2] | s[:, 3] << 16})
    split = lambda r: [(regs[r] >> sh) & 0xFFFF for sh in (0, 16)]  # noqa: E731
    return tuple(np.stack(split(f"${2 * i}") + split(f"${2 * i + 1}"), axis=1) for i in range(n_results))


def _decode_all_ways(w_format: str, codes: np.ndarray, scale_bits: np.ndarray):
    """(lo, hi) from the fused asm (moe_torch), checked equal to the one-nibble asm pair (moe_pallas)."""
    fused = w4_packed_asm.MXFP4_PACKED_ASM if w_format == "mxfp4" else w4_packed_asm.INT4_PACKED_ASM
    lo, hi = _decode(fused, codes, scale_bits)
    (lo1,) = _decode(w4_packed_asm.PACKED_HALF_ASM[w_format, "low"], codes, scale_bits, 1)
    (hi1,) = _decode(w4_packed_asm.PACKED_HALF_ASM[w_format, "high"], codes, scale_bits, 1)
    assert np.array_equal(lo, lo1) and np.array_equal(hi, hi1)
    return lo, hi


def _same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    nan_g = (got & 0x7F80) == 0x7F80
    nan_g &= (got & 0x7F) != 0
    nan_w = ((want & 0x7F80) == 0x7F80) & ((want & 0x7F) != 0)
    return bool(np.array_equal(nan_g, nan_w) and np.array_equal(np.where(nan_g, 0, got), np.where(nan_w, 0, want)))


def _every_byte_with(scales: list) -> tuple[np.ndarray, np.ndarray]:
    """Every byte value, 4 to an asm call, with every scale of ``scales``: codes [n, 4] uint8, scale index [n, 4]."""
    rng = np.random.default_rng(0)
    codes, sidx = [], []
    for j in range(len(scales)):
        perm = rng.permutation(256).astype(np.uint8).reshape(64, 4)
        codes.append(perm)
        # each call's 4 bytes get different scales too (the asm must pair element i with scale i)
        sidx.append((j + np.arange(4)[None, :] * np.ones((64, 1), int)) % len(scales))
    return np.concatenate(codes), np.concatenate(sidx)


def _reference(dequant, codes: np.ndarray, scale_t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The contract's dequantization of each byte with its own scale: bf16 bits of the low / high nibbles."""
    n = codes.size
    wq = torch.from_numpy(codes.reshape(n, 1, 1).copy())  # [N=n rows... ] as [E=n, N=1, K/2=1]
    wq = torch.from_numpy(np.repeat(codes.reshape(n, 1, 1), 16, axis=2))  # a whole group of 32 values per byte
    wd = dequant(wq, scale_t.reshape(n, 1, 1)).to(torch.bfloat16)  # [n, 1, 32]
    bits = wd.view(torch.int16).numpy().astype(np.uint32) & 0xFFFF
    return bits[:, 0, 0].reshape(codes.shape), bits[:, 0, 1].reshape(codes.shape)


E8M0_SCALES = [0, 1, 2, 64, 100, 119, 126, 127, 128, 129, 140, 200, 253, 254, 255]


def test_mxfp4_packed_decode_matches_the_contract_for_every_byte_and_scale():
    codes, sidx = _every_byte_with(E8M0_SCALES)
    s = np.array(E8M0_SCALES, np.uint32)[sidx]
    # the kernels' e8m0 -> bf16 bits: 2^-127 subnormal for 0, NaN for 255, else s << 7
    s_bits = np.where(s == 0, w4_packed_asm.BF16_E8M0_ZERO_BITS, np.where(s == 255, w4_packed_asm.BF16_NAN_BITS, s << 7))
    lo, hi = _decode_all_ways("mxfp4", codes, s_bits)
    want_lo, want_hi = _reference(dequantize_weight_mxfp4, codes, torch.from_numpy(s.astype(np.uint8)))
    assert _same_bits(lo, want_lo) and _same_bits(hi, want_hi)
    # spot values: byte 0x9F = high nibble 9 (-0.5), low 15 (-6) at scale 2^0; code 8 is -0.0
    one = np.full((1, 4), 127)
    lo, hi = _decode_all_ways("mxfp4", np.array([[0x9F, 0x08, 0x21, 0x7A]], np.uint8), one << 7)
    assert [_bf16_value(v) for v in lo[0]] == [-6.0, -0.0, 0.5, -1.0]
    assert [_bf16_value(v) for v in hi[0]] == [-0.5, 0.0, 1.0, 6.0]
    assert lo[0, 1] == 0x8000  # -0.0, as the reference's code 8


def test_int4_packed_decode_matches_the_contract_for_every_byte_and_scale():
    bf16_scales = torch.tensor([1.0, -1.0, 0.0078125, 3.140625, -0.0017, 1e-30, 2e-39, 1e38, -7.5e37, 0.333, 1e-40,
                                65504.0, float("nan"), 2.0**-126, 0.5], dtype=torch.bfloat16)
    codes, sidx = _every_byte_with(list(range(len(bf16_scales))))
    s_bits = (bf16_scales.view(torch.int16).numpy().astype(np.uint32) & 0xFFFF)[sidx]
    lo, hi = _decode_all_ways("int4", codes, s_bits)
    want_lo, want_hi = _reference(dequantize_weight_int4, codes, bf16_scales[torch.from_numpy(sidx)])
    assert _same_bits(lo, want_lo) and _same_bits(hi, want_hi)
    lo, hi = _decode_all_ways("int4", np.array([[0x0F, 0x80, 0x78, 0xF0]], np.uint8),
                     np.full((1, 4), 0x4000))  # scale 2.0
    assert [_bf16_value(v) for v in lo[0]] == [14.0, -16.0, 0.0, -16.0]
    assert [_bf16_value(v) for v in hi[0]] == [-16.0, 0.0, -2.0, 14.0]


ALL_ASM = {"MXFP4_PACKED_ASM": w4_packed_asm.MXFP4_PACKED_ASM, "INT4_PACKED_ASM": w4_packed_asm.INT4_PACKED_ASM,
           **{f"PACKED_HALF_ASM[{k}]": v for k, v in w4_packed_asm.PACKED_HALF_ASM.items()},
           "MXFP4_MMA_PACKED_ASM": w4_packed_asm.MXFP4_MMA_PACKED_ASM,
           **{f"MXFP4_MMA_HALF_ASM[{k}]": v for k, v in w4_packed_asm.MXFP4_MMA_HALF_ASM.items()}}


@pytest.mark.parametrize("asm_name", sorted(ALL_ASM))
def test_packed_decode_asm_uses_only_modelled_instructions(asm_name):
    """The interpreter above must model every instruction of the kernels' asm (a new one fails here by name), and
    the operands are exactly those the constraints declare."""
    asm = ALL_ASM[asm_name]
    ops = {line.split()[0] for line in asm.splitlines()
           if line.strip() and line.strip() not in "{}" and not line.startswith(".reg")}
    assert ops <= {"mov.b32", "prmt.b32", "shl.b32", "shr.u32", "shf.l.wrap.b32", "mul.lo.u32", "and.b32", "lop3.b32",
                   "fma.rn.bf16x2"}, ops
    constraints = (w4_packed_asm.PACKED_ASM_HALF_CONSTRAINTS if "HALF" in asm_name
                   else w4_packed_asm.PACKED_ASM_CONSTRAINTS)
    assert {int(n) for n in re.findall(r"\$(\d+)", asm)} == set(range(len(constraints.split(","))))


def test_e8m0_table_is_the_contract_scale_of_every_code():
    """The Triton kernel gathers MXFP4 scales from ``e8m0_bf16_bits`` (moe_torch's ``e8m0_bf16_table``):
    ``2^(s - 127)`` exactly for s = 0..254 (s = 0 the bf16 subnormal 2^-127), NaN for 255."""
    from moe_torch.ops.grouped_gemm.triton import e8m0_bf16_table

    bits = np.array(w4_packed_asm.e8m0_bf16_bits(), np.uint32)
    values = _bf16_value(bits)
    assert np.array_equal(values[:255], np.exp2(np.arange(255) - 127.0)) and np.isnan(values[255])
    table = e8m0_bf16_table(torch.device("cpu"))
    assert table.dtype == torch.bfloat16 and np.array_equal(table.view(torch.int16).numpy().astype(np.uint32) & 0xFFFF, bits)


def test_e8m0_table_is_not_built_inside_a_cuda_graph_capture(monkeypatch):
    """A first MXFP4 launch inside CUDA-graph capture cannot copy the table to the device: the launcher gets None
    (the kernel then decodes the scales from their bits, the same values) instead of a capture error; a table built
    before the capture is used in it."""
    from moe_torch.ops.grouped_gemm import triton as gg

    dev = torch.device("cuda", 0)
    monkeypatch.setattr(gg, "_E8M0_TABLES", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert gg.e8m0_bf16_table(dev) is None
    built = gg.e8m0_bf16_table(torch.device("cpu"))  # not a CUDA device: built whatever the capture state
    assert built is not None and built.shape == (256,)
    gg._E8M0_TABLES[(dev, False)] = built  # as if built by an eager launch before the capture
    assert gg.e8m0_bf16_table(dev) is built
    assert gg.e8m0_bf16_table(dev, mma=True) is None  # the MMA layout's table is another one


# --------------------------------------------------------------------------------------
# The MMA layout (moe_contract/w4_layout.py): MXFP4 codes re-laid out at load time for a shorter decode

MMA_SCALES = [0, 1, 2, 64, 100, 119, 126, 127, 128, 255]  # every code the layout serves: <= 128, and NaN


def test_mxfp4_mma_layout_decode_matches_the_contract_for_every_byte_and_scale():
    """Every byte value in every position of a 4-byte group, re-laid out (``mxfp4_to_mma_layout``), decoded by the
    MMA-layout asm (both nibbles in one call, and one nibble a call) with the folded scale table ``2^(s - 1)``:
    bit for bit the contract's dequantization of the checkpoint codes, pairs in the checkpoint decode's order."""
    from moe_contract import w4_layout

    codes, sidx = _every_byte_with(MMA_SCALES)
    sidx = np.repeat(sidx[:, :1], 4, axis=1)  # one scale a 4-byte group (a group of 32 codes holds it whole)
    s = np.array(MMA_SCALES, np.uint32)[sidx]
    lut = np.array(w4_layout.e8m0_bf16_bits_mma(), np.uint32)
    mma = w4_layout.mxfp4_to_mma_layout(codes)
    assert mma.shape == codes.shape and not np.array_equal(mma, codes)
    lo, hi = _decode(w4_packed_asm.MXFP4_MMA_PACKED_ASM, mma, lut[s])
    (lo1,) = _decode(w4_packed_asm.MXFP4_MMA_HALF_ASM["low"], mma, lut[s], 1)
    (hi1,) = _decode(w4_packed_asm.MXFP4_MMA_HALF_ASM["high"], mma, lut[s], 1)
    assert np.array_equal(lo, lo1) and np.array_equal(hi, hi1)
    want_lo, want_hi = _reference(dequantize_weight_mxfp4, codes, torch.from_numpy(s.astype(np.uint8)))
    assert _same_bits(lo, want_lo) and _same_bits(hi, want_hi)


def test_mxfp4_mma_layout_round_trips_and_refuses_what_it_cannot_serve():
    """The re-layout is a bit permutation of each 32-bit word: back to the checkpoint codes bit for bit, on any
    shape whose last axis is a multiple of 4 bytes; other shapes and dtypes are refused by name. Scale codes the
    folded table cannot hold (129..254) are named; the table is ``2^(s - 1)`` exactly for s <= 128, NaN else."""
    from moe_contract import w4_layout

    rng = np.random.default_rng(7)
    codes = rng.integers(0, 256, (3, 5, 24), dtype=np.uint8)
    mma = w4_layout.mxfp4_to_mma_layout(codes)
    assert np.array_equal(w4_layout.mxfp4_from_mma_layout(mma), codes)
    one_bit = np.zeros((32, 4), np.uint8)  # each checkpoint bit alone lands on one distinct bit
    one_bit.view("<u4")[:, 0] = np.uint32(1) << np.arange(32, dtype=np.uint32)
    landed = w4_layout.mxfp4_to_mma_layout(one_bit).view("<u4")[:, 0]
    assert sorted(int(v).bit_length() - 1 for v in landed) == list(range(32))
    for bad in (codes[..., :6], codes.astype(np.int16)):
        with pytest.raises(ValueError, match="mxfp4_to_mma_layout: packed codes must be uint8"):
            w4_layout.mxfp4_to_mma_layout(bad)
    assert w4_layout.mma_layout_scale_problem(np.array([0, 127, 128, 255], np.uint8)) is None
    msg = w4_layout.mma_layout_scale_problem(np.array([[127, 129], [200, 255]], np.uint8))
    assert msg is not None and msg.startswith("2 e8m0 scale codes above 128") and "largest code 200" in msg
    values = _bf16_value(np.array(w4_layout.e8m0_bf16_bits_mma(), np.uint32))
    assert np.array_equal(values[:129], np.exp2(np.arange(129) - 1.0)) and np.isnan(values[129:]).all()


@pytest.mark.gpu
def test_mxfp4_mma_layout_asm_compiled_matches_the_contract():
    """The MMA-layout asm compiled into a Triton kernel (``tl.inline_asm_elementwise``, ``pack=4``, as the kernels call
    it) on every byte value and every served scale: bit for bit the contract's dequantization."""
    import triton
    import triton.language as tl

    from moe_contract import w4_layout

    @triton.jit
    def probe(q_ptr, s_ptr, lo_ptr, hi_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, ASM: tl.constexpr,
              CONSTRAINTS: tl.constexpr):
        offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        q = tl.load(q_ptr + offs)
        s = tl.load(s_ptr + offs)
        lo, hi = tl.inline_asm_elementwise(ASM, CONSTRAINTS, [q, s], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                           pack=4)
        tl.store(lo_ptr + offs, lo)
        tl.store(hi_ptr + offs, hi)

    codes, sidx = _every_byte_with(MMA_SCALES)  # [n, 4]: one 4-byte group a row
    pad = 1024 - codes.shape[0]  # a power-of-2 tile: 256 x 16 bytes (the pad: more random groups)
    codes = np.concatenate([codes, np.random.default_rng(1).integers(0, 256, (pad, 4), dtype=np.uint8)])
    sidx = np.concatenate([sidx[:, :1], np.arange(pad)[:, None] % len(MMA_SCALES)])
    sidx = np.repeat(sidx, 4, axis=1)
    s = np.array(MMA_SCALES, np.uint32)[sidx]
    lut = np.array(w4_layout.e8m0_bf16_bits_mma(), np.uint32)
    mma = w4_layout.mxfp4_to_mma_layout(codes)
    rows, cols = mma.size // 16, 16
    dev = torch.device("cuda")
    q = torch.from_numpy(mma.reshape(rows, cols)).to(dev)
    sb = torch.from_numpy(lut[s].astype(np.int16).reshape(rows, cols)).view(torch.bfloat16).to(dev)
    lo = torch.empty((rows, cols), dtype=torch.bfloat16, device=dev)
    hi = torch.empty_like(lo)
    probe[(1,)](q, sb, lo, hi, ROWS=rows, COLS=cols, ASM=w4_packed_asm.MXFP4_MMA_PACKED_ASM,
                CONSTRAINTS=w4_packed_asm.PACKED_ASM_CONSTRAINTS)
    got_lo, got_hi = ((t.cpu().view(torch.int16).numpy().astype(np.uint32) & 0xFFFF).reshape(codes.shape)
                      for t in (lo, hi))
    want_lo, want_hi = _reference(dequantize_weight_mxfp4, codes, torch.from_numpy(s.astype(np.uint8)))
    assert _same_bits(got_lo, want_lo) and _same_bits(got_hi, want_hi)
