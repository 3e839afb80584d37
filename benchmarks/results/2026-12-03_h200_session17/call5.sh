#!/bin/bash
# session 17, call 5: JAX Mosaic forward tiles probed (CUPTI kernel time, E=32, M=16384, uniform): bf16 with the
# consumers splitting the rows (split_m, as the tuned dgrad) vs the columns; FP8 blocks with other rings; then ncu
# (SpeedOfLight, WarpStateStats) of the JAX FP8-block gate_up default
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
P=benchmarks/profile_bwd_jax.py
BF="128,128,64,3,4,1;64,256,64,3,4,1,1;128,128,64,3,4,1,1;64,256,64,3,8,1,1;64,256,64,3,2,1,1"
el bf16 down
timeout 120 python3 $P --only-configs --k 2048 --n 7168 --mosaic-fwd "$BF" 2>&1 | grep -E "^mosaic" | tee $OUT/probe_bf16_down.txt
el bf16 gate_up
timeout 120 python3 $P --only-configs --mosaic-fwd "$BF" 2>&1 | grep -E "^mosaic" | tee $OUT/probe_bf16_gate_up.txt
F8="64,128,256,2,4,1,1;64,128,128,6,4,1,1;64,128,256,3,4,1,1;64,128,256,2,8,1,1;64,128,256,2,2,1,1"
el fp8_block gate_up
timeout 110 python3 $P --only-configs --dtype fp8_block --mosaic-fwd "$F8" 2>&1 | grep -E "^mosaic" | tee $OUT/probe_fp8b_gate_up.txt
el fp8_block down
timeout 110 python3 $P --only-configs --dtype fp8_block --k 2048 --n 7168 --mosaic-fwd "$F8" 2>&1 | grep -E "^mosaic" | tee $OUT/probe_fp8b_down.txt
el ncu
timeout 90 ncu --kernel-name regex:mosaic --launch-skip 1 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis python3 $P --ncu --dtype fp8_block > $OUT/ncu_jax_fp8b_gate_up.txt 2>&1
grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Stall|Warp Cycles Per Issued" $OUT/ncu_jax_fp8b_gate_up.txt | head -14
el done
