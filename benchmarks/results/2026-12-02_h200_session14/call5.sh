#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
el ncu-src
timeout 150 ncu --set full --import-source yes --kernel-name regex:fp8_block_kernel --launch-skip 1 --launch-count 1 -o /tmp/down python3 .gpu/ncu_one.py block down uniform > /tmp/ncu.log 2>&1; tail -1 /tmp/ncu.log
for ps in cuda "cuda,sass"; do ncu -i /tmp/down.ncu-rep --page source --csv --print-source $ps > /tmp/src_$ps.csv 2>/tmp/err_$ps.txt; echo "$ps: $(wc -l < /tmp/src_$ps.csv) lines"; head -c 200 /tmp/err_$ps.txt; done
python3 .gpu/stalls.py /tmp/src_cuda.csv > $OUT/stalls_cuda.txt 2>&1; head -50 $OUT/stalls_cuda.txt | cut -c1-160
el tune
cp moe_pallas/ops/grouped_gemm/tuned/NVIDIA_H200.json /tmp/before.json
timeout 260 python3 benchmarks/tune_jax_gemm.py --backends pallas_mosaic_gpu --ws-only --routings uniform,zipf --dtypes fp8 --ms 16384 --fast-accum false --max-minutes 3 --out moe_pallas/ops/grouped_gemm/tuned > $OUT/tune.txt 2>&1; tail -15 $OUT/tune.txt
cp moe_pallas/ops/grouped_gemm/tuned/NVIDIA_H200.json $OUT/NVIDIA_H200_jax.json
el gemm
timeout 120 python3 benchmarks/bench.py --what gemm --ms 16384 --gemm-dtypes fp8 --backends mosaic,_scaled --out /tmp/g > /tmp/g.log 2>&1; grep -E "^\| (gate|down)" /tmp/g/bench.md; cp /tmp/g/bench.md $OUT/gemm_fp8_jax.md
el done
