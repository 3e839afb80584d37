#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
git log --oneline -1 2>/dev/null
el tests+memcheck
( EPMOE_TEST_DEVICE=gpu timeout 420 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gluon_gemm.py tests/test_triton_grouped_gemm.py tests/test_triton_gemm_tma.py tests/test_env_switches.py tests/test_grouped_gemm.py tests/test_layer.py tests/test_crosscheck.py tests/test_grouped_gemm_backward_torch.py > $OUT/tests.txt 2>&1; echo "rc=$?" >> $OUT/tests.txt ) &
( EPMOE_TEST_DEVICE=gpu timeout 420 compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider tests/test_gluon_gemm.py -k "rowwise and (matches_reference or decreasing or dispatch or layer)" > $OUT/memcheck.txt 2>&1; echo "rc=$?" >> $OUT/memcheck.txt ) &
wait
grep -E "^FAILED|^ERROR|passed|failed|rc=" $OUT/tests.txt | tail -15; grep -E "ERROR SUMMARY|passed|failed|rc=" $OUT/memcheck.txt | tail -3
el layers
timeout 200 python3 benchmarks/bench.py --what layer --ts 4096 --backends ours --out /tmp/lay > /tmp/lay.log 2>&1; cp /tmp/lay/bench.md $OUT/layers.md; grep -E "^\| E=" $OUT/layers.md
el gemm
timeout 150 python3 benchmarks/bench.py --what gemm --ms 16384 --gemm-dtypes fp8 --out /tmp/g > /tmp/g.log 2>&1; cp /tmp/g/bench.md $OUT/gemm_fp8.md; grep -E "^\| (gate|down)" $OUT/gemm_fp8.md
el done
