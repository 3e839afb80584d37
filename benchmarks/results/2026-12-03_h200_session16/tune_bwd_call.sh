#!/bin/bash
# session 16: the backward GEMMs' launch configs from the tuners (issue 14): tune_jax_gemm.py and tune_triton_gemm.py
# --ops dgrad,wgrad (bf16 in and out, E=32, gate_up K=7168 N=4096 and down K=2048 N=7168, uniform rows) at M=16384;
# torch also at M=2048 (its Triton binaries are cached by the M=16384 step: cheap). Both tables are written IN PLACE in
# the tree (each tuner keeps every other entry of its file: forward launch configs, the JAX backend choices) and copied
# under $OUT; copy back
#   $OUT/NVIDIA_H200_jax.json   -> moe_pallas/ops/grouped_gemm/tuned/NVIDIA_H200.json
#   $OUT/NVIDIA_H200_torch.json -> moe_torch/ops/grouped_gemm/tuned/NVIDIA_H200.json
# Each step under timeout and --max-minutes (no config started after it; a problem cut short is written with
# "complete": false, later problems of that step are skipped): at most ~7.8 min in all.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
J=moe_pallas/ops/grouped_gemm/tuned/NVIDIA_H200.json
T=moe_torch/ops/grouped_gemm/tuned/NVIDIA_H200.json
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
el jax dgrad,wgrad M=16384
timeout 215 python3 benchmarks/tune_jax_gemm.py --ops dgrad,wgrad --backends pallas_mosaic_gpu --dtypes bf16 --ms 16384 \
    --max-minutes 2.7 --out $(dirname $J) > $OUT/tune_jax.txt 2>&1; echo "rc=$?" >> $OUT/tune_jax.txt
grep -E "^(==|dgrad|wgrad) |WRONG|Error|wrote|rc=" $OUT/tune_jax.txt | tail -14
cp $J $OUT/NVIDIA_H200_jax.json
el torch dgrad,wgrad M=16384
timeout 170 python3 benchmarks/tune_triton_gemm.py --ops dgrad,wgrad --dtypes bf16 --ms 16384 --max-minutes 2.3 \
    --out $(dirname $T) > $OUT/tune_torch.txt 2>&1; echo "rc=$?" >> $OUT/tune_torch.txt
grep -E "^(==|dgrad|wgrad) |WRONG|Error|wrote|rc=" $OUT/tune_torch.txt | tail -10
cp $T $OUT/NVIDIA_H200_torch.json
el torch dgrad,wgrad M=2048
timeout 45 python3 benchmarks/tune_triton_gemm.py --ops dgrad,wgrad --dtypes bf16 --ms 2048 --max-minutes 0.4 \
    --out $(dirname $T) > $OUT/tune_torch_2048.txt 2>&1; echo "rc=$?" >> $OUT/tune_torch_2048.txt
grep -E "^(==|dgrad|wgrad) |WRONG|Error|wrote|rc=" $OUT/tune_torch_2048.txt | tail -10
cp $T $OUT/NVIDIA_H200_torch.json
el lookups
# the tables as the library reads them: the JAX backend choices still valid, each lookup's pick per shape
timeout 25 python3 - <<'EOF' 2>&1 | grep -v -i warn | tee $OUT/lookups.txt
from moe_pallas.ops.grouped_gemm import backend_table, config as j
from moe_torch.ops.grouped_gemm import config as t
D = "NVIDIA H200"
print("jax backend choices:", len(backend_table.backend_choices(D)))
for K, N in ((7168, 4096), (2048, 7168)):
    for M in (2048, 16384):
        print(f"K={K} N={N} M={M}")
        print("  jax dgrad  ", j.mosaic_dgrad_config(M, N, K, 32, 2, out_itemsize=2, device_kind=D))
        print("  jax wgrad  ", j.mosaic_wgrad_config(M, N, K, 32, 2, 2, device_kind=D))
        for tma in (False, True):
            print(f"  torch dgrad tma={tma}", t.grouped_gemm_dgrad_config(M, N, K, 32, 16, sm90=True, tma=tma,
                                                                        device_name=D, out_bits=16))
        print("  torch wgrad", t.tuned_wgrad_kernel(M, N, K, 16, 16, D),
              t.grouped_gemm_wgrad_config(M, N, K, 32, 16, out_bits=16, device_name=D))
EOF
el done
