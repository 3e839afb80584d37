#!/bin/bash
# session 16: the 16-bit Gluon grouped GEMM (moe_torch/ops/grouped_gemm/gluon_bf16.py, forward + dgrad; its dispatch
# off by default): GPU tests, timings against the Triton kernels and cuBLAS, memcheck. Every step under timeout;
# total under 5 minutes (timeouts 20 + 10 + 120 + 100 + 45 = 295 s). Outputs under $OUT. Memcheck: the TMA epilogue at
# 128-wide tiles, whose straddling shares take the pointer stores too.
set -u
timeout 20 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=benchmarks/results/2026-12-03_h200_session16
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
timeout 10 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
el gluon bf16 tests
EPMOE_TEST_DEVICE=gpu timeout 120 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gluon_bf16.py > $OUT/gluon_bf16_tests.txt 2>&1; echo "rc=$?" >> $OUT/gluon_bf16_tests.txt
grep -E "^FAILED|^ERROR|passed|failed|rc=" $OUT/gluon_bf16_tests.txt | tail -14
el gluon bf16 bench
timeout 100 python3 $R/gluon_bf16_bench.py 2>&1 | grep -v -i warn | tee $OUT/gluon_bf16_bench.txt
el memcheck
EPMOE_TEST_DEVICE=gpu timeout 45 compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider tests/test_gluon_bf16.py -k "matches_reference and bn128 and tma and (straddling or ends-at or K8 or T1)" > $OUT/memcheck_gluon_bf16.txt 2>&1; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck_gluon_bf16.txt | tail -3
el done
