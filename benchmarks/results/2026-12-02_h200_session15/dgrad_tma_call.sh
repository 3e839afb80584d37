#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
el tests
EPMOE_TEST_DEVICE=gpu timeout 90 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_triton_dgrad_tma.py tests/test_triton_gemm_tma.py tests/test_grouped_gemm_backward_torch.py > $OUT/tests.txt 2>&1; echo "rc=$?" >> $OUT/tests.txt
grep -E "^FAILED|^ERROR|passed|failed|rc=" $OUT/tests.txt | tail -8
el bench
timeout 100 python3 benchmarks/results/2026-12-02_h200_session15/dgrad_tma_bench.py 2>&1 | grep -v -i warn | tail -26 | tee $OUT/bench.txt
el memcheck
EPMOE_TEST_DEVICE=gpu timeout 45 compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider tests/test_triton_dgrad_tma.py -x > $OUT/memcheck.txt 2>&1; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck.txt | tail -3
el done
