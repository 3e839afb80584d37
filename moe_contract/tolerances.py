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

CONTRACT.md section 8 (backward):

| what | rule |
|---|---|
| float32 gradients vs float64 autodiff of the reference | rel_fro <= GRAD_F32_REL_FRO |
| bf16 layer gradients vs float64 | rel_fro <= GRAD_BF16_REL_FRO |
| weight gradient of an expert with no rows | exactly 0 |
| Pallas vs Triton gradients on the same inputs | the rows above |
"""

GATE_WEIGHT_RTOL = 1e-6
BF16_REL_FRO = 1e-2
FP8_REL_FRO = 2e-2
#: float32 arithmetic on both sides (the references run in float32): reorderings of float32
#: sums over K <= a few thousand stay far under this (measured ~1e-7..1e-6).
F32_REL_FRO = 1e-5

#: CONTRACT.md section 8: float32 gradients vs float64 autodiff of the reference.
GRAD_F32_REL_FRO = 1e-5
#: CONTRACT.md section 8: bf16 gradients vs float64.
GRAD_BF16_REL_FRO = 2e-2
