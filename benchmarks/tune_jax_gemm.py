"""Tune the JAX grouped GEMMs' launch configs on this GPU: ``moe_pallas.ops.grouped_gemm.tune``'s command line.

Usage (GPU machine, repo root)::

    PYTHONPATH=. python3 benchmarks/tune_jax_gemm.py [--out DIR] [--backends pallas_triton,pallas_mosaic_gpu]
        [--quick] [--max-minutes 8] [--dtypes bf16,fp8,fp8_block] [--ms 256,2048,16384] [--resume] [--jobs 8]
        [--fast-accum both|false|true] [--ops fwd,dgrad,wgrad] [--routings uniform,zipf] [--ws-only]

The tuner lives in the package (``epmoe tune --framework jax`` runs it on a model's shapes); this script keeps the
benchmark's problem set and options (the module's docstring says what each does). ``--out`` defaults to ``$OUT``,
else the user cache's table of this device (``<user cache>/tuned/jax/<arch>/<device kind>.json``).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # the packages from any working directory
    sys.path.insert(0, _ROOT)

from moe_pallas.ops.grouped_gemm.tune import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
