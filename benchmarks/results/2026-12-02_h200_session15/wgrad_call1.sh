#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
EPMOE_TEST_DEVICE=gpu timeout 110 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gluon_wgrad.py -x > $OUT/tests.txt 2>&1; echo "rc=$?" >> $OUT/tests.txt
grep -E "^FAILED|^ERROR|passed|failed|rc=|Error" $OUT/tests.txt | tail -12
timeout 70 python3 .gpu/wgrad_bench.py 2>&1 | tail -20
