"""The MXFP4 codes re-laid out for the packed bf16 decode (CONTRACT.md section 9, "MMA layout"): a one-time,
load-time bit permutation of each 4-byte group of a row, kept beside the checkpoint's codes. Framework-free
(numpy); moe_torch and moe_pallas apply the same permutation with their own integer ops.

The checkpoint layout: byte ``i`` of a row holds element ``2i`` in its low nibble and ``2i + 1`` in its high nibble;
a code is ``sign, e1, e0, m`` (bits 3-0). The packed decode (``moe_contract/w4_packed_asm.py``) turns two codes at
once into a bf16 pair by placing ``m, e0, e1`` at bf16 bits 6-8 and the sign at bit 15 of each 16-bit half; from the
checkpoint layout that costs two shifts, a ``lop3`` and an ``fma`` per pair on top of the scale's ``fma``
(``MXFP4_PACKED_ASM``: 22 instructions per 8 codes).

Here the 8 codes of a 4-byte group (elements ``8j .. 8j + 7`` of the row) are spread over the 32-bit little-endian
word so that the four pairs the decode returns come out as:

======  ====================  =========================================================  ========================
pair    elements              bits of the word (m, e0, e1, sign of the first, then        extraction
                                                of the second)
======  ====================  =========================================================  ========================
0       ``8j``, ``8j + 2``    6, 7, 8, 15, 22, 23, 24, 31                                 ``and``
1       ``8j + 4``, ``+ 6``   0, 1, 2, 9, 16, 17, 18, 25                                  ``shl 6``, ``and``
2       ``8j + 1``, ``+ 3``   26, 27, 28, 3, 10, 11, 12, 19                               ``rotate 12``, ``and``
3       ``8j + 5``, ``+ 7``   20, 29, 30, 5, 4, 13, 14, 21                                ``rotate 18`` and
                                                                                         ``rotate 10``, ``lop3``,
                                                                                         ``and``
======  ====================  =========================================================  ========================

(no translate of the bf16 pair's bit set ``{6, 7, 8, 15, 22, 23, 24, 31}`` tiles the word four times, so one pair
takes two rotations), then one ``fma`` each with the scale table ``2^(s - 1)`` (the ``2^126`` that restores the
e2m1 value folded into the scale): 13 instructions per 8 codes (``MXFP4_MMA_PACKED_ASM``). The pairs are the
checkpoint decode's (low nibbles of bytes 0-1, of bytes 2-3, high nibbles of bytes 0-1, of bytes 2-3), so a kernel
swaps the asm and the scale table and keeps everything else. A 4-byte group never straddles a scale group (32
elements, 16 bytes).

The folded scale ``2^(s - 1)`` is a bf16 for e8m0 codes ``s <= 128`` (and NaN for 255); codes 129..254
(``2^(s - 127) >= 4``) are refused by :func:`mma_layout_scale_problem`: their weights keep the checkpoint layout.
"""

from __future__ import annotations

import numpy as np

#: For each pair of the table above: the word's bits holding (m, e0, e1, sign) of its first code, then its second.
MXFP4_MMA_PAIR_BITS = (
    (6, 7, 8, 15, 22, 23, 24, 31),
    (0, 1, 2, 9, 16, 17, 18, 25),
    (26, 27, 28, 3, 10, 11, 12, 19),
    (20, 29, 30, 5, 4, 13, 14, 21),
)
#: The elements (of the group's 8) of each pair, first then second.
MXFP4_MMA_PAIR_ELEMENTS = ((0, 2), (4, 6), (1, 3), (5, 7))
#: The largest e8m0 scale code the MMA layout's folded scale table holds (``2^(128 - 1)``); 255 (NaN) is served too.
MXFP4_MMA_MAX_SCALE_CODE = 128


def _bit_map() -> np.ndarray:
    """``src[d]``: the checkpoint word's bit that lands on bit ``d`` of the MMA-layout word (both little-endian)."""
    src = np.full(32, -1, np.int64)
    for bits, elems in zip(MXFP4_MMA_PAIR_BITS, MXFP4_MMA_PAIR_ELEMENTS):
        for half, elem in enumerate(elems):
            for b in range(4):  # m, e0, e1, sign = code bits 0..3
                src[bits[4 * half + b]] = 4 * elem + b  # element i sits at bits 4i..4i+3 of the checkpoint word
    assert sorted(src.tolist()) == list(range(32))
    return src


#: ``MMA_SRC_BIT[d]``: checkpoint bit of MMA bit ``d``; ``MMA_DST_BIT[s]``: MMA bit of checkpoint bit ``s``.
MMA_SRC_BIT = _bit_map()
MMA_DST_BIT = np.argsort(MMA_SRC_BIT)


def _permute_words(packed: np.ndarray, src_of: np.ndarray, op: str) -> np.ndarray:
    packed = np.asarray(packed)
    check_mma_layout_input(op, str(packed.dtype), packed.shape)
    words = np.ascontiguousarray(packed).view("<u4")
    out = np.zeros_like(words)
    for d, s in enumerate(src_of):
        out |= ((words >> np.uint32(s)) & np.uint32(1)) << np.uint32(d)
    return out.view(np.uint8).reshape(packed.shape)


def mxfp4_to_mma_layout(packed: np.ndarray) -> np.ndarray:
    """MXFP4 codes ``uint8 [..., K // 2]`` (checkpoint layout) -> the same shape in the MMA layout (module
    docstring). Raises ValueError (dtype, a last axis not a multiple of 4)."""
    return _permute_words(packed, MMA_SRC_BIT, "mxfp4_to_mma_layout")


def mxfp4_from_mma_layout(packed: np.ndarray) -> np.ndarray:
    """The inverse of :func:`mxfp4_to_mma_layout`, bit for bit."""
    return _permute_words(packed, MMA_DST_BIT, "mxfp4_from_mma_layout")


def mma_layout_scale_problem(scale_codes: np.ndarray) -> str | None:
    """``None`` if every e8m0 scale code is served by the MMA layout's folded scale table (``<= 128`` or 255), else
    a sentence naming how many are not and the largest."""
    s = np.asarray(scale_codes)
    bad = (s > MXFP4_MMA_MAX_SCALE_CODE) & (s != 255)
    if not bad.any():
        return None
    return (f"{int(bad.sum())} e8m0 scale codes above {MXFP4_MMA_MAX_SCALE_CODE} (scales >= 4; largest code "
            f"{int(s[bad].max())}): the MMA layout's scale table 2^(s - 1) cannot hold them")


def check_mma_layout_scales(op: str, name: str, scale_codes: np.ndarray) -> None:
    """ValueError naming ``op`` and the scale ``name`` unless :func:`mma_layout_scale_problem` accepts the codes: the
    load-time refusal of weights the MMA layout would read as NaN."""
    problem = mma_layout_scale_problem(scale_codes)
    if problem is not None:
        raise ValueError(f"{op}: {name}: {problem}; these weights need w4_layout='checkpoint'")


def e8m0_bf16_bits_mma() -> list[int]:
    """The bf16 bit pattern of ``2^(s - 1)`` for every e8m0 code ``s`` (the MMA layout's scale table: the decode's
    ``2^126`` folded in): ``(s + 126) << 7`` for ``s <= 128``, NaN for 255 and for the refused codes 129..254 (never
    read for weights that passed :func:`mma_layout_scale_problem`; NaN, not a plausible value, if they were)."""
    nan = 0x7FC0
    return [(s + 126) << 7 if s <= MXFP4_MMA_MAX_SCALE_CODE else nan for s in range(256)]


def mma_moves(to_mma: bool = True) -> tuple[tuple[int, int], ...]:
    """The permutation as ``(r, mask)`` pairs: ``out = OR over pairs of (rotate_left(word, r) & mask)`` (32-bit
    words), the form the frameworks apply with their own integer ops; ``to_mma=False``: the inverse."""
    src = MMA_SRC_BIT if to_mma else MMA_DST_BIT
    moves: dict[int, int] = {}
    for d, s in enumerate(src):
        r = (d - int(s)) % 32
        moves[r] = moves.get(r, 0) | (1 << d)
    return tuple(sorted(moves.items()))


def check_mma_layout_input(op: str, dtype_name: str, shape: tuple[int, ...]) -> None:
    """ValueError naming ``op`` unless the packed codes are uint8 with a last axis of a multiple of 4 bytes."""
    if dtype_name != "uint8" or len(shape) < 1 or shape[-1] % 4:
        raise ValueError(f"{op}: packed codes must be uint8 [..., K // 2] with K // 2 a multiple of 4 (K a multiple "
                         f"of 8); got {dtype_name} {tuple(shape)}")
