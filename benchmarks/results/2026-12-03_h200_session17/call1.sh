#!/bin/bash
# session 17, call 1: the FP8-block kernel's split-N items (tests, memcheck, A/B, the DeepSeek-V3 bench row)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=benchmarks/results/2026-12-03_h200_session17
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
el tests
EPMOE_TEST_DEVICE=gpu timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gluon_gemm.py > $OUT/tests.txt 2>&1; echo "rc=$?" >> $OUT/tests.txt
grep -E "^FAILED|^ERROR|passed|failed|rc=" $OUT/tests.txt | tail -12
el A/B
timeout 200 python3 $R/splitn_ab.py 2>&1 | grep -v -i warn | tee $OUT/splitn_ab.txt
el memcheck
EPMOE_TEST_DEVICE=gpu timeout 60 compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider tests/test_gluon_gemm.py -k "split_n and (straddling or N-tail or E256 or N-below or short)" > $OUT/memcheck.txt 2>&1; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck.txt | tail -3
el bench
timeout 70 python3 benchmarks/bench.py --preset deepseek-v3 --what layer --ts 4096 --layer-quants fp8_block --backends ours-torch --max-minutes 1.0 --out /tmp/bd > $OUT/dsv3.log 2>&1; cp /tmp/bd/bench.md $OUT/dsv3.md; grep -E "^\| deep" $OUT/dsv3.md | head -3
el done
