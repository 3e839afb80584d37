#!/bin/bash
# session 16, call 1: the Gluon TMA epilogue (tests, A/B, memcheck) and session 15's untested torch dgrad TMA variant
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=benchmarks/results/2026-12-03_h200_session16
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
el gluon tests
EPMOE_TEST_DEVICE=gpu timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gluon_gemm.py > $OUT/gluon_tests.txt 2>&1; echo "rc=$?" >> $OUT/gluon_tests.txt
grep -E "^FAILED|^ERROR|passed|failed|rc=" $OUT/gluon_tests.txt | tail -12
el epilogue gemm A/B
timeout 150 python3 $R/epilogue_ab.py gemm 2>&1 | grep -v -i warn | tee $OUT/epilogue_gemm.txt
el dgrad tma tests
EPMOE_TEST_DEVICE=gpu timeout 120 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_triton_dgrad_tma.py tests/test_triton_gemm_tma.py tests/test_grouped_gemm_backward_torch.py > $OUT/dgrad_tests.txt 2>&1; echo "rc=$?" >> $OUT/dgrad_tests.txt
grep -E "^FAILED|^ERROR|passed|failed|rc=" $OUT/dgrad_tests.txt | tail -8
el dgrad tma bench
timeout 100 python3 benchmarks/results/2026-12-02_h200_session15/dgrad_tma_bench.py 2>&1 | grep -v -i warn | tail -26 | tee $OUT/dgrad_bench.txt
el epilogue layers
timeout 150 python3 $R/epilogue_ab.py layers 2>&1 | grep -v -i warn | tee $OUT/epilogue_layers.txt
el memcheck
EPMOE_TEST_DEVICE=gpu timeout 60 compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider tests/test_gluon_gemm.py -k "bit_identical and (straddling or many or ends or N-tail)" > $OUT/memcheck_gluon.txt 2>&1; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck_gluon.txt | tail -3
EPMOE_TEST_DEVICE=gpu timeout 45 compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider tests/test_triton_dgrad_tma.py -x > $OUT/memcheck_dgrad.txt 2>&1; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck_dgrad.txt | tail -3
el done
