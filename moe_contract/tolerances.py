"""CONTRACT.md section 7 as numbers: the one place the tolerances live (tests, the cross-check and
the benchmarks' correctness gate read them from here).

| what | rule |
|---|---|
| ids, offsets, src2dst, dst2src, counts | exactly equal |
| FP8 codes and scales | bit-identical |
| gate weights | float32 rel. error <= GATE_WEIGHT_RTOL |
| bf16 GEMM / layer output vs float64 reference | ||out-ref|| / ||ref|| <= BF16_REL_FRO |
| FP8 GEMM vs reference on the dequantized inputs | ||out-ref|| / ||ref|| <= FP8_REL_FRO |
| Pallas vs Triton on the same inputs | the tighter of the two rows above |
"""

GATE_WEIGHT_RTOL = 1e-6
BF16_REL_FRO = 1e-2
FP8_REL_FRO = 2e-2
#: float32 arithmetic on both sides (the references run in float32): reorderings of float32
#: sums over K <= a few thousand stay far under this (measured ~1e-7..1e-6).
F32_REL_FRO = 1e-5
