#!/bin/bash
# session 17, call 7: JAX Mosaic forward, wider snakes (grid_block_n 8 / 16: more column tiles a row step sweeps, so
# x is re-read fewer times; ncu in call 6 showed the bf16 down kernel moving a third more DRAM bytes than torch's)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
P=benchmarks/profile_bwd_jax.py
el bf16 down
timeout 150 python3 $P --only-configs --k 2048 --n 7168 --mosaic-fwd "128,128,64,3,4,1;128,128,64,3,8,1;128,128,64,3,16,1;64,256,64,3,8,1,1" 2>&1 | grep -E "^mosaic" | tee $OUT/probe_bf16_down_snake.txt
el fp8_block down
timeout 60 python3 $P --only-configs --dtype fp8_block --k 2048 --n 7168 --mosaic-fwd "64,128,256,2,8,1,1;64,128,256,2,16,1,1" 2>&1 | grep -E "^mosaic" | tee $OUT/probe_fp8b_down_snake.txt
el done
