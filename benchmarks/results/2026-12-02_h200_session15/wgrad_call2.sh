#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
EPMOE_TEST_DEVICE=gpu timeout 110 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gluon_wgrad.py > $OUT/tests.txt 2>&1; echo "rc=$?" >> $OUT/tests.txt
grep -E "^FAILED|^ERROR|passed|failed|rc=|Error" $OUT/tests.txt | tail -12
timeout 90 python3 .gpu/wgrad_bench2.py 2>&1 | tail -20
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$CS" ]; then
  EPMOE_TEST_DEVICE=gpu timeout 60 $CS --tool memcheck python3 -m pytest -q -n 0 -p no:cacheprovider tests/test_gluon_wgrad.py -k "test_matches_reference and (one-row or ragged-empty) and (pointer-4 or tma-3)" > $OUT/memcheck.txt 2>&1; echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck.txt | tail -3
else echo "no compute-sanitizer"; fi
