"""Run ``benchmarks/bench.py`` (the arguments after the first) with ``triton.py: GLUON_SPLIT_N_MAX_ROWS_PER_EXPERT``
set to the first argument (0: the FP8-block Gluon kernel always takes 128-row items) in this process.
Usage: ``PYTHONPATH=. python3 bench_cap.py CAP --preset deepseek-v3 --what layer ...``."""
import runpy, sys
import moe_torch.ops.grouped_gemm.triton as gemm_triton

gemm_triton.GLUON_SPLIT_N_MAX_ROWS_PER_EXPERT = int(sys.argv[1])
print("GLUON_SPLIT_N_MAX_ROWS_PER_EXPERT =", gemm_triton.GLUON_SPLIT_N_MAX_ROWS_PER_EXPERT, flush=True)
sys.argv = ["benchmarks/bench.py"] + sys.argv[2:]
runpy.run_path("benchmarks/bench.py", run_name="__main__")
