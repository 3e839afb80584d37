#!/bin/bash
# session 16, call 4: the new defaults (TMA epilogue of the Gluon FP8 kernels, rowwise 5 stages, the torch dgrad's TMA
# variant, the tuned backward tables) on the GPU: tests, then the rows they move.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
el tests
EPMOE_TEST_DEVICE=gpu timeout 170 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gluon_gemm.py::test_default_dispatch_runs_gluon tests/test_gluon_gemm.py::test_rowwise_default_dispatch tests/test_triton_dgrad_tma.py tests/test_grouped_gemm_backward_torch.py tests/test_env_switches.py tests/test_tuned_backward_configs.py tests/test_layer_backward.py tests/test_training.py > $OUT/tests.txt 2>&1; echo "rc=$?" >> $OUT/tests.txt
grep -E "^FAILED|^ERROR|passed|failed|rc=" $OUT/tests.txt | tail -8
el layers
timeout 110 python3 benchmarks/bench.py --what layer --ts 4096 --layer-quants fp8_block,fp8_per_token --backends ours-torch --max-minutes 1.6 --out /tmp/bl > $OUT/layers.log 2>&1; cp /tmp/bl/bench.md $OUT/layers.md; grep -E "^\| " $OUT/layers.md | head -8
timeout 90 python3 benchmarks/bench.py --preset deepseek-v3 --what layer --ts 4096 --layer-quants fp8_block --backends ours-torch --max-minutes 1.2 --out /tmp/bd > $OUT/dsv3.log 2>&1; cp /tmp/bd/bench.md $OUT/dsv3.md; grep -E "^\| " $OUT/dsv3.md | head -6
el bwd
timeout 170 python3 benchmarks/bench.py --what gemm_bwd,layer_bwd --ms 16384 --ts 4096 --layer-quants none --backends "ours-torch-triton,pallas_mosaic_gpu,torch._grouped_mm" --max-minutes 2.5 --out /tmp/bb > $OUT/bwd.log 2>&1; cp /tmp/bb/bench.md $OUT/bench_bwd.md; grep -E "^\| " $OUT/bench_bwd.md | head -12
el done
