#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
el tests+memcheck
( EPMOE_TEST_DEVICE=gpu timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gluon_gemm.py tests/test_triton_grouped_gemm.py tests/test_env_switches.py > $OUT/tests.txt 2>&1; echo "rc=$?" >> $OUT/tests.txt ) &
( EPMOE_TEST_DEVICE=gpu timeout 300 compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider tests/test_gluon_gemm.py -k "matches_reference or decreasing or dispatch" > $OUT/memcheck.txt 2>&1; echo "rc=$?" >> $OUT/memcheck.txt ) &
wait
tail -3 $OUT/tests.txt; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck.txt | tail -3
el probes
{ timeout 120 python3 benchmarks/probe_gluon_gemm.py --stages 5 ; timeout 180 python3 benchmarks/probe_gluon_gemm.py --dtype fp8 --stages 4 5 --block-n 128 256; } > $OUT/probe.txt 2>&1
grep -E "FAIL|ERROR|TIME|done" $OUT/probe.txt
el layers
for rw in 0 1; do
  EPMOE_TRITON_GLUON_FP8_ROWWISE=$rw timeout 150 python3 benchmarks/bench.py --what layer --backends ours-torch-triton --ts 4096 --layer-quants fp8_per_token,fp8_block --out $OUT/layer_rw$rw.json > /tmp/l$rw.txt 2>&1; grep -E "ms|Error" /tmp/l$rw.txt | tail -4
done
el ncu
for k in block:down block:gate_up triton_block:down; do
  kind=${k%%:*}; shp=${k##*:}
  timeout 150 ncu --kernel-name regex:"fp8_block_kernel|grouped_gemm" --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section LaunchStats python3 .gpu/ncu_one.py $kind $shp uniform > /tmp/ncu_${kind}_${shp}.txt 2>&1
  cat /tmp/ncu_${kind}_${shp}.txt >> $OUT/ncu.txt
done
grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers|Stall|No Eligible|Issued Warp" $OUT/ncu.txt | head -60
el done
