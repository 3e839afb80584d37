#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
el ab
timeout 150 python3 .gpu/ab.py > $OUT/ab.txt 2>&1; cat $OUT/ab.txt | tail -12
el tests+memcheck
( EPMOE_TEST_DEVICE=gpu timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gluon_gemm.py tests/test_triton_grouped_gemm.py tests/test_layer.py > $OUT/tests.txt 2>&1; echo "rc=$?" >> $OUT/tests.txt ) &
( EPMOE_TEST_DEVICE=gpu timeout 240 compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider tests/test_gluon_gemm.py -k "matches_reference or decreasing or dispatch or layer" > $OUT/memcheck.txt 2>&1; echo "rc=$?" >> $OUT/memcheck.txt ) &
wait
grep -E "^FAILED|^ERROR|passed|failed|rc=" $OUT/tests.txt | tail -8; grep -E "ERROR SUMMARY|passed|failed|rc=" $OUT/memcheck.txt | tail -3
el layers
timeout 120 python3 benchmarks/bench.py --what layer --ts 4096 --backends ours-torch --layer-quants fp8_per_token,fp8_block --out /tmp/lay > /tmp/lay.log 2>&1; grep -E "^\| E=" /tmp/lay/bench.md; cp /tmp/lay/bench.md $OUT/layers.md
timeout 150 python3 benchmarks/bench.py --what layer --preset deepseek-v3 --ts 4096 --backends ours-torch --layer-quants fp8_block --out /tmp/ds > /tmp/ds.log 2>&1; grep -E "^\| E=" /tmp/ds/bench.md; cp /tmp/ds/bench.md $OUT/ds.md
el done
