#!/bin/bash
# session 17, call 4: issue 14's layer rows in both frameworks (E=32 T=4096 bf16 / FP8 per token / FP8 blocks;
# DeepSeek-V3 FP8 blocks at T=4096 and T=256)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
el layers E=32
timeout 280 python3 benchmarks/bench.py --what layer --ts 4096 --layer-quants none,fp8_per_token,fp8_block --backends "ours-jax-pallas_mosaic,ours-torch-triton" --max-minutes 4.0 --out /tmp/le > /tmp/le.log 2>&1; echo "rc=$?"; cp /tmp/le/bench.json $OUT/layer_e32.json; cp /tmp/le/bench.md $OUT/layer_e32.md
sed -n '/median ms/,/^## All/p' /tmp/le/bench.md | grep "^|" | head -8
el deepseek-v3
timeout 250 python3 benchmarks/bench.py --preset deepseek-v3 --what layer --ts 4096,256 --layer-quants fp8_block --backends "ours-jax-pallas_mosaic,ours-torch-triton" --max-minutes 3.5 --out /tmp/ld > /tmp/ld.log 2>&1; echo "rc=$?"; cp /tmp/ld/bench.json $OUT/layer_dsv3.json; cp /tmp/ld/bench.md $OUT/layer_dsv3.md
sed -n '/median ms/,/^## All/p' /tmp/ld/bench.md | grep "^|" | head -6
grep -E "layer/deepseek" /tmp/ld/bench.md | cut -d'|' -f2-5,9-10,13 | head -8
el gemm fp8 again: call 3 raw files did not come back
timeout 120 python3 benchmarks/bench.py --what gemm --ms 16384 --gemm-dtypes fp8,fp8_block --backends "ours-jax-pallas_mosaic,ours-torch-triton,torch._scaled" --max-minutes 1.8 --out /tmp/gf > /tmp/gf.log 2>&1; echo "rc=$?"; cp /tmp/gf/bench.json $OUT/gemm_fp8.json; cp /tmp/gf/bench.md $OUT/gemm_fp8.md
sed -n '/median ms/,/^## All/p' /tmp/gf/bench.md | grep "^|" | head -10
tail -c 3000 /tmp/le.log > $OUT/logs_tail.txt; tail -c 3000 /tmp/ld.log >> $OUT/logs_tail.txt
el done
