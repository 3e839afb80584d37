#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
EPMOE_TEST_DEVICE=gpu timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gluon_gemm.py tests/test_env_switches.py > $OUT/tests.txt 2>&1; echo "rc=$?" >> $OUT/tests.txt
grep -E "^FAILED|^ERROR|passed|failed|rc=" $OUT/tests.txt | tail -8
