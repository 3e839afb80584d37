"""Tune the Triton grouped GEMM's launch configs on this GPU: ``moe_torch.ops.grouped_gemm.tune``'s command line.

Usage (GPU machine, repo root)::

    PYTHONPATH=. python3 benchmarks/tune_triton_gemm.py [--out DIR] [--quick] [--full] [--tma]
        [--dtypes bf16,fp8,fp8_block] [--ms 256,2048,16384] [--routings uniform,zipf] [--ops fwd,dgrad,wgrad]
        [--max-minutes 3] [--no-gluon]

The tuner lives in the package (``epmoe tune --framework torch`` runs it on a model's shapes); this script keeps the
benchmark's problem set and options (the module's docstring says what each does). ``--out`` defaults to ``$OUT``,
else the user cache's table of this device (``<user cache>/tuned/torch/<arch>/<device kind>.json``).
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # the packages from any working directory
    sys.path.insert(0, _ROOT)

from moe_torch.ops.grouped_gemm.tune import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
