#!/bin/bash
# session 17, call 3: the JAX Mosaic bf16 forward tuner (M=16384, into the tree's table), then issue 14's GEMM rows in
# both frameworks at M=16384 (bf16 against torch._grouped_mm; FP8 per token against torch._scaled_grouped_mm; FP8 blocks)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
el jax tuner
timeout 170 python3 benchmarks/tune_jax_gemm.py --backends pallas_mosaic_gpu --dtypes bf16 --ms 16384 --ws-only --routings uniform,zipf --max-minutes 2.0 > $OUT/jax_tuner.log 2>&1; echo "rc=$?"
mkdir -p $OUT/jax_tuned; cp moe_pallas/ops/grouped_gemm/tuned/NVIDIA_H200.json $OUT/jax_tuned/
grep -E '^\{' $OUT/jax_tuner.log | tail -4 | cut -c1-400
el gemm bf16
timeout 150 python3 benchmarks/bench.py --what gemm --ms 16384 --gemm-dtypes bf16 --backends "ours-jax-pallas_mosaic,ours-torch-triton,torch._grouped_mm" --max-minutes 2.0 --out $OUT/gemm_bf16 > $OUT/gemm_bf16.log 2>&1; echo "rc=$?"
sed -n '/median ms/,/^## All/p' $OUT/gemm_bf16/bench.md | grep "^|" | head -8
el gemm fp8
timeout 200 python3 benchmarks/bench.py --what gemm --ms 16384 --gemm-dtypes fp8,fp8_block --backends "ours-jax-pallas_mosaic,ours-torch-triton,torch._scaled" --max-minutes 2.8 --out $OUT/gemm_fp8 > $OUT/gemm_fp8.log 2>&1; echo "rc=$?"
sed -n '/median ms/,/^## All/p' $OUT/gemm_fp8/bench.md | grep "^|" | head -14
el done
