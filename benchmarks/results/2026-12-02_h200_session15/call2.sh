#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
el tests
EPMOE_TEST_DEVICE=gpu timeout 240 python3 -m pytest -q -n 8 tests/test_pallas_mosaic_gemm_backward.py -p no:cacheprovider -x > $OUT/tests.txt 2>&1; tail -15 $OUT/tests.txt | cut -c1-400
el bwd
C="--wgrad-cfg=128,128,64,4,4,0;128,128,64,3,4,1;128,128,64,3,1,1;64,128,64,4,4,1;128,64,64,4,4,1"
for s in gate_up down; do timeout 150 python3 .gpu/bwd_peers.py $s --jax-only "$C" 2>&1 | grep -v -i warn | tee -a $OUT/bwd.txt; done
el done
