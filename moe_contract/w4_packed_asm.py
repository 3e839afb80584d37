"""PTX of the packed 4-bit -> bf16 decode inside the grouped GEMMs' Triton kernels (CONTRACT.md section 9).

Framework-free text, shared by ``moe_torch/ops/grouped_gemm/triton.py`` (``tl.inline_asm_elementwise``) and
``moe_pallas/ops/grouped_gemm/pallas_triton.py`` (``plgpu.elementwise_inline_asm``), both with ``pack=4``. The
interpreters cannot run inline PTX: there the kernels take their float32 decode, whose values are the same.

Operands of one asm call (4 packed bytes = 8 codes; registers are 32-bit):

* ``$4``: the 4 bytes (uint8 x 4). Byte ``i`` holds element ``2i`` of its row in its low nibble and ``2i + 1`` in
  its high nibble (the checkpoint layout, as stored).
* ``$5``, ``$6``: each byte's scale as bf16 (bf16x2: ``$5`` = the scales of bytes 0-1, ``$6`` = bytes 2-3). MXFP4's
  e8m0 code ``s`` becomes the bf16 ``2^(s - 127)`` (bits ``s << 7``; ``s = 0`` the subnormal ``0x0040``, ``s = 255``
  NaN) before the call; INT4's scale is bf16 already.
* Results: ``$0``, ``$1`` the low nibbles' values (bf16x2: bytes 0-1, bytes 2-3), ``$2``, ``$3`` the high nibbles'.

``prmt`` spreads bytes 0-1 (2-3) into the low bytes of the two 16-bit halves of ``t0`` (``t1``), so every further
instruction decodes two codes at once (the idea of Marlin's dequantization, IST-DASLab/marlin
``marlin/marlin_cuda_kernel.cu: dequant``, worked out anew here for e2m1 / offset INT4 and bf16). Per 8 codes:
MXFP4 22 instructions, INT4 16, where the float32 decode takes ~17 a code (the sm_90 SASS of the torch kernel's K
loop, a 16 x 128 x 64 step over 4 warps: 943 instructions for MXFP4 with the float32 decode, 316 with this one and
the scale table: ``benchmarks/sass_gemm.py``; BENCHMARKS.md).

MXFP4 (e2m1: sign bit 3, exponent bits 2-1, mantissa bit 0): the three magnitude bits go to bf16 bits 8-6 (the two
low exponent bits and the top mantissa bit) and the sign to bit 15 (two shifted copies of ``t`` masked together).
That bf16 is ``e2m1 * 2^-126`` (code 1, 0.5, is the subnormal ``0x0040``); ``* 2^126`` (``0x7E80``) restores the e2m1 value exactly and ``* 2^(s - 127)`` applies the
scale: a product of a 2-bit significand and a power of two, so the one rounding of ``fma.rn.bf16x2`` changes nothing
where the reference's float32 value fits bf16, and over/underflows alike where it does not. The ``-0.0`` addend
keeps a product of ``-0.0`` (code 8) negative, as the reference.

INT4 (offset binary, ``code - 8``): ``(t & 0xF) | 0x4300`` is the bf16 ``128 + code`` (``0x4300`` = 128.0, whose
mantissa step is 1); ``* 1 - 136`` makes ``code - 8`` exactly and ``* scale`` rounds once, as the reference (an
exact float32 product rounded to bf16). The high nibbles are shifted down by 4 first.

``tests/test_w4_packed_decode.py`` executes these strings in a small PTX interpreter against the contract's
dequantization for every byte value and a spread of scales (bit for bit); the GPU runs of the 4-bit GEMM tests
execute them compiled.
"""

from __future__ import annotations

_PROLOGUE = """{{
.reg .b32 t0, t1, a, b, k0, k1, k2, k3;
mov.b32 k0, 0x80008000;
mov.b32 k1, 0x7E807E80;
mov.b32 k2, 0x3F803F80;
mov.b32 k3, 0xC308C308;
prmt.b32 t0, {src}, 0, 0x4140;
prmt.b32 t1, {src}, 0, 0x4342;
"""
# k0 = (-0.0, -0.0), k1 = (2^126, 2^126), k2 = (1.0, 1.0), k3 = (-136.0, -136.0) as bf16x2.

_MXFP4_LOW = """shl.b32 a, {t}, 6;
shl.b32 b, {t}, 12;
lop3.b32 a, a, b, 0x81C081C0, 0xA8;
fma.rn.bf16x2 a, a, k1, k0;
fma.rn.bf16x2 {out}, a, {scale}, k0;
"""
# Low nibble: magnitude bits 2-0 << 6 (to bf16 bits 8-6), sign bit 3 << 12 (to bit 15); lop3 0xA8 is (a | b) & c:
# each shifted copy is zero where the other one's wanted bits land (t holds zero bytes between its two bytes).
_MXFP4_HIGH = """and.b32 b, {t}, 0x00F000F0;
mul.lo.u32 a, b, 0x104;
and.b32 a, a, 0x81C081C0;
fma.rn.bf16x2 a, a, k1, k0;
fma.rn.bf16x2 {out}, a, {scale}, k0;
"""
# High nibble, masked: (b << 2) + (b << 8) in one multiply (the two copies do not overlap, so the sum is their OR):
# magnitude bits 6-4 to bits 8-6, sign bit 7 to bit 15.

_INT4_NIBBLES = """{shift}lop3.b32 a, {src}, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 a, a, k2, k3;
fma.rn.bf16x2 {out}, a, {scale}, k0;
"""


def _render(w_format: str, nibbles: tuple[str, ...]) -> str:
    """The asm of one call returning the values of ``nibbles`` (``"low"`` / ``"high"``, in that order): two bf16x2
    results each (bytes 0-1, bytes 2-3), then the operands: the packed bytes, the two scale pairs."""
    n_out = 2 * len(nibbles)
    src, scales = f"${n_out}", (f"${n_out + 1}", f"${n_out + 2}")
    body = []
    for i, which in enumerate(nibbles):
        high = which == "high"
        for j, t in enumerate(("t0", "t1")):
            out = f"${2 * i + j}"
            if w_format == "mxfp4":
                body.append((_MXFP4_HIGH if high else _MXFP4_LOW).format(t=t, out=out, scale=scales[j]))
            else:
                body.append(_INT4_NIBBLES.format(shift=f"shr.u32 b, {t}, 4;\n" if high else "", src="b" if high else t,
                                                 out=out, scale=scales[j]))
    return _PROLOGUE.format(src=src) + "".join(body) + "}"


#: Both nibbles in one call (moe_torch's ``tl.inline_asm_elementwise`` with two results): ``$0, $1`` low,
#: ``$2, $3`` high, operands ``$4`` (bytes), ``$5, $6`` (scales); constraints :data:`PACKED_ASM_CONSTRAINTS`.
MXFP4_PACKED_ASM = _render("mxfp4", ("low", "high"))
INT4_PACKED_ASM = _render("int4", ("low", "high"))
PACKED_ASM_CONSTRAINTS = "=r,=r,=r,=r,r,r,r"

#: One nibble a call (moe_pallas: jax 0.11.2's lowering of ``plgpu.elementwise_inline_asm`` returns one result
#: only, ``jax/_src/pallas/triton/primitives.py: _elementwise_inline_asm_lowering``): ``$0, $1`` the values,
#: operands ``$2`` (bytes), ``$3, $4`` (scales); constraints :data:`PACKED_ASM_HALF_CONSTRAINTS`.
PACKED_HALF_ASM = {(fmt, which): _render(fmt, (which,)) for fmt in ("mxfp4", "int4") for which in ("low", "high")}
PACKED_ASM_HALF_CONSTRAINTS = "=r,=r,r,r,r"

#: bf16 bits of the e8m0 scale codes 0 (``2^-127``, a subnormal) and 255 (NaN); code ``s`` else is ``s << 7``.
BF16_E8M0_ZERO_BITS = 0x0040
BF16_NAN_BITS = 0x7FC0


def e8m0_bf16_bits() -> list[int]:
    """The bf16 bit pattern of ``2^(s - 127)`` for every e8m0 code ``s`` (0..255): the table moe_torch's Triton kernel
    gathers the MXFP4 scales from (the arithmetic per element costs more there, where the compiler redoes it after
    the broadcast; the Pallas-Triton kernel, one scale a group and row, was slower with a table)."""
    return [BF16_E8M0_ZERO_BITS if s == 0 else BF16_NAN_BITS if s == 255 else s << 7 for s in range(256)]


# The MMA layout (``moe_contract/w4_layout.py``): MXFP4 codes re-laid out at load time so that each bf16 pair comes
# out of the word by one mask (after a shift or a rotation; pair 3 from two rotations joined by a lop3, 0xE4 =
# (a & c) | (b & ~c)), and one fma with the folded scale 2^(s - 1) (``w4_layout.e8m0_bf16_bits_mma``): 13
# instructions per 8 codes, where the checkpoint layout's decode takes 22. Operands as above: ``$4`` the 4 bytes,
# ``$5`` / ``$6`` the scale pairs of bytes 0-1 / 2-3 (the same scale: a 4-byte group lies in one 32-code group).
_MMA_PAIR = {
    0: "and.b32 a, {src}, 0x81C081C0;\n",
    1: "shl.b32 a, {src}, 6;\nand.b32 a, a, 0x81C081C0;\n",
    2: "shf.l.wrap.b32 a, {src}, {src}, 12;\nand.b32 a, a, 0x81C081C0;\n",
    3: ("shf.l.wrap.b32 a, {src}, {src}, 18;\nshf.l.wrap.b32 b, {src}, {src}, 10;\n"
        "lop3.b32 a, a, b, 0x00400040, 0xE4;\nand.b32 a, a, 0x81C081C0;\n"),
}
# Pair 3: bits 20 and 4 (its two codes' m) rotate by 18 onto bits 6 and 22 (mask 0x00400040); the rest rotate by 10.


def _render_mma(pairs: tuple[int, ...]) -> str:
    """The MMA-layout asm returning ``pairs`` (0, 1: the low nibbles of bytes 0-1, 2-3; 2, 3: the high nibbles), one
    bf16x2 result each, then the operands: the packed word, the two scale pairs."""
    src, scales = f"${len(pairs)}", (f"${len(pairs) + 1}", f"${len(pairs) + 2}")
    # (the word copied first, as the prmt does above: no operand is read after a result is written)
    body = ["{\n.reg .b32 w, a, b, k0;\nmov.b32 k0, 0x80008000;\n", f"mov.b32 w, {src};\n"]
    for i, p in enumerate(pairs):
        body.append(_MMA_PAIR[p].format(src="w"))
        body.append(f"fma.rn.bf16x2 ${i}, a, {scales[p % 2]}, k0;\n")
    return "".join(body) + "}"


#: Both nibbles (moe_torch), results and operands as :data:`MXFP4_PACKED_ASM`, constraints
#: :data:`PACKED_ASM_CONSTRAINTS`; the scales from ``w4_layout.e8m0_bf16_bits_mma`` (``2^(s - 1)``).
MXFP4_MMA_PACKED_ASM = _render_mma((0, 1, 2, 3))
#: One nibble a call (moe_pallas), as :data:`PACKED_HALF_ASM`.
MXFP4_MMA_HALF_ASM = {"low": _render_mma((0, 1)), "high": _render_mma((2, 3))}
