#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
el probe-rowwise
timeout 150 python3 benchmarks/probe_gluon_gemm.py --dtype fp8 --stages 4 3 --block-n 128 256 > $OUT/probe_rw.txt 2>&1
grep -E "FAIL|ERROR|TIME|done" $OUT/probe_rw.txt
el layers
for rw in 1 0 1; do
  EPMOE_TRITON_GLUON_FP8_ROWWISE=$rw timeout 150 python3 benchmarks/bench.py --what layer --backends ours-torch-triton --ts 4096 --layer-quants fp8_per_token --out /tmp/lay$rw > /tmp/l$rw.txt 2>&1; echo "rw=$rw"; grep -E "^\| E=" /tmp/lay$rw/bench.md; cat /tmp/lay$rw/bench.md >> $OUT/layers.md
done
el ncu-source
timeout 200 ncu --set full --import-source no --kernel-name regex:fp8_block_kernel --launch-skip 1 --launch-count 1 -o /tmp/down python3 .gpu/ncu_one.py block down uniform > /tmp/ncu.log 2>&1; tail -2 /tmp/ncu.log
ncu -i /tmp/down.ncu-rep --page source --csv --print-source sass > /tmp/src.csv 2>/tmp/src.err; head -c 300 /tmp/src.err
python3 .gpu/stalls.py /tmp/src.csv > $OUT/stalls.txt 2>&1; head -60 $OUT/stalls.txt
ncu -i /tmp/down.ncu-rep --page details --print-details all > $OUT/down_details.txt 2>&1
el gemm-small
timeout 330 python3 benchmarks/bench.py --what gemm --ms 256,2048 --max-minutes 5 --out /tmp/gs > $OUT/gemm_small.log 2>&1; cp /tmp/gs/bench.md $OUT/gemm_small.md; cp /tmp/gs/bench.json $OUT/gemm_small.json
grep -E "^\| (gemm|E=)" $OUT/gemm_small.md | head -40
el done
