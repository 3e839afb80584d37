#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
el tests
EPMOE_TEST_DEVICE=gpu timeout 300 python3 -m pytest -q -n 8 tests/test_gluon_gemm.py tests/test_env_switches.py -p no:cacheprovider > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt
el bwd
for s in gate_up down; do timeout 150 python3 .gpu/bwd_peers.py $s 2>&1 | grep -v Warning | tee -a $OUT/bwd.txt; done
el done
