"""python .gpu/layer_cfg.py GLUON_ROWWISE_PROMOTE=4 GLUON_ROWWISE_BLOCK_N=128 -- <bench.py args>"""
import sys, os
sys.path.insert(0, os.getcwd())
import moe_torch.ops.grouped_gemm.triton as T
i = sys.argv.index("--")
for kv in sys.argv[1:i]:
    k, v = kv.split("=")
    setattr(T, k, int(v))
from benchmarks import bench
sys.exit(bench.main(sys.argv[i + 1:]))
