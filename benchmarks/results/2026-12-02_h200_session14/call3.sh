#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
el probes
timeout 200 python3 benchmarks/probe_gluon_gemm.py --dtype fp8 --stages 4 5 --block-n 256 128 --promote 0 2 4 > $OUT/probe_rw.txt 2>&1
grep -E "FAIL|ERROR|TIME|done" $OUT/probe_rw.txt | cut -c1-400
timeout 150 python3 benchmarks/probe_gluon_gemm.py --dtype bf16 --stages 4 3 --block-n 256 128 > $OUT/probe_bf16.txt 2>&1
grep -E "FAIL|ERROR|TIME|done" $OUT/probe_bf16.txt | cut -c1-400
timeout 60 python3 benchmarks/probe_gluon_gemm.py --stages 5 --quick > $OUT/probe_block.txt 2>&1; grep -E "FAIL|ERROR|TIME|done" $OUT/probe_block.txt
el errs
timeout 200 python3 .gpu/errs.py > $OUT/errs.txt 2>&1; grep -E "promote|gemm K|fp8_per_token/T=4096 +ours-torch-triton " $OUT/errs.txt | cut -c1-250
el layers
{
for cfg in "GLUON_ROWWISE_PROMOTE=4" "GLUON_ROWWISE_PROMOTE=2"; do
  echo "== rowwise $cfg"; EPMOE_TRITON_GLUON_FP8_ROWWISE=1 timeout 100 python3 .gpu/layer_cfg.py $cfg -- --what layer --backends ours-torch-triton --ts 4096 --layer-quants fp8_per_token --out /tmp/o1 2>&1 | grep -E "^\[" | cut -c1-200
done
echo "== rowwise off"; timeout 100 python3 benchmarks/bench.py --what layer --backends ours-torch-triton --ts 4096 --layer-quants fp8_per_token --out /tmp/o2 2>&1 | grep -E "^\[" | cut -c1-200
for b in 1 0; do
  echo "== bf16 gluon=$b"; EPMOE_TRITON_GLUON_BF16=$b timeout 100 python3 benchmarks/bench.py --what layer --backends ours-torch-triton --ts 4096 --layer-quants none --out /tmp/o3 2>&1 | grep -E "^\[" | cut -c1-200
done
} > $OUT/layers.txt 2>&1
cat $OUT/layers.txt
el done
