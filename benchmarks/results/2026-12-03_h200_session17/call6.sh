#!/bin/bash
# session 17, call 6: ncu of the bf16 down GEMM (E=32, M=16384) by each framework's default: JAX Mosaic GPU (1.05-1.08x
# torch._grouped_mm in call 3) and torch's (the tuned Gluon 16-bit kernel, 0.91x)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=benchmarks/results/2026-12-03_h200_session17
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
S="--section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats"
el jax
timeout 150 ncu --kernel-name regex:mosaic --launch-skip 1 --launch-count 1 $S python3 $R/ncu_bf16.py jax > $OUT/ncu_jax_bf16_down.txt 2>&1
grep -E "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|L2 Cache Throughput|DRAM Throughput|Warp Cycles Per Issued|Spilling Requests|Registers Per|Est. Local|stalled" $OUT/ncu_jax_bf16_down.txt | head -14
el torch
timeout 120 ncu --kernel-name regex:"16bit|grouped_gemm" --launch-skip 1 --launch-count 1 $S python3 $R/ncu_bf16.py torch > $OUT/ncu_torch_bf16_down.txt 2>&1
grep -E "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|L2 Cache Throughput|DRAM Throughput|Warp Cycles Per Issued|Spilling Requests|Registers Per|Est. Local|stalled" $OUT/ncu_torch_bf16_down.txt | head -14
el done
