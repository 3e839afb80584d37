#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
el tests
EPMOE_TEST_DEVICE=gpu timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gluon_wgrad.py tests/test_grouped_gemm_backward_torch.py tests/test_env_switches.py tests/test_layer_backward.py tests/test_training.py > $OUT/tests.txt 2>&1; tail -4 $OUT/tests.txt | cut -c1-300
el memcheck
EPMOE_TEST_DEVICE=gpu timeout 200 compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider tests/test_pallas_mosaic_gemm_backward.py -k "wgrad and ws and (many or straddling or all-on-one or nan)" > $OUT/memcheck.txt 2>&1; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck.txt | tail -3
el small
timeout 200 python3 .gpu/wgrad_small.py 2>&1 | grep -v -i warn | tee $OUT/wgrad_small.txt
el bench
timeout 300 python3 benchmarks/bench.py --what gemm_bwd,layer_bwd --ms 16384 --ts 4096 --layer-quants none --backends "ours,torch._grouped_mm,transformers" --max-minutes 4.5 --out /tmp/bb > $OUT/bench.log 2>&1; cp /tmp/bb/bench.md $OUT/bench_bwd.md; cp /tmp/bb/bench.json $OUT/bench_bwd.json; grep -E "^\| " $OUT/bench_bwd.md | head -40
el done
