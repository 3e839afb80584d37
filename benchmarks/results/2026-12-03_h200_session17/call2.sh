#!/bin/bash
# session 17, call 2: DeepSeek-V3's torch layer, split-N items off / on (bench.py, alternating processes); the torch
# forward tuner with the Gluon 16-bit candidates (bf16, M=16384); the 16-bit Gluon tests (its epilogue call changed)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=benchmarks/results/2026-12-03_h200_session17
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
el tests
EPMOE_TEST_DEVICE=gpu timeout 110 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gluon_bf16.py tests/test_tuned_forward_kernel.py tests/test_env_switches.py > $OUT/tests.txt 2>&1; echo "rc=$?" >> $OUT/tests.txt
grep -E "^FAILED|^ERROR|passed|failed|rc=" $OUT/tests.txt | tail -8
el dsv3 A/B
i=0; for cap in 0 192 0 192; do i=$((i+1))
  timeout 45 python3 $R/bench_cap.py $cap --preset deepseek-v3 --what layer --ts 4096 --layer-quants fp8_block --backends ours-torch-triton --max-minutes 0.5 --out /tmp/bd$i > $OUT/dsv3_${i}_cap$cap.log 2>&1
  echo "cap $cap: $(grep -E 'ours-torch-triton \|' /tmp/bd$i/bench.md | grep -v cudagraph | cut -d'|' -f4)"
done
el torch tuner
mkdir -p $OUT/torch_tuned
timeout 300 python3 benchmarks/tune_triton_gemm.py --dtypes bf16 --ms 16384 --routings uniform,zipf --tma --ops fwd --out $OUT/torch_tuned > $OUT/torch_tuner.log 2>&1; echo "rc=$?"
grep -E '^\{' $OUT/torch_tuner.log | python3 -c "import sys,json; [print({k: e.get(k) for k in ('N','K','M_cap','kernel','ms','gluon_ms','gluon_config','heuristic_ms')}) for e in map(json.loads, sys.stdin)]"
el done
