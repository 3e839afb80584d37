#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
el tests
EPMOE_TEST_DEVICE=gpu timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gluon_wgrad.py tests/test_env_switches.py > $OUT/tests.txt 2>&1; tail -2 $OUT/tests.txt | cut -c1-300
el dgrad-probes
C='128,128,64,3,4,1;128,128,64,3,1,1;128,128,64,3,4,1,1;64,128,64,4,4,1,1;128,64,64,4,4,1'
timeout 120 python3 benchmarks/profile_bwd_jax.py --k 2048 --n 7168 --only-configs --mosaic-dgrad "$C" 2>&1 | grep -E "^mosaic" | tee $OUT/dgrad_down.txt
timeout 120 python3 benchmarks/profile_bwd_jax.py --only-configs --mosaic-dgrad "$C" 2>&1 | grep -E "^mosaic" | tee $OUT/dgrad_gate_up.txt
el done
