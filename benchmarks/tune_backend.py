"""Write the JAX grouped GEMM's backend choices from benchmark rows: ``moe_pallas.ops.grouped_gemm.tune_backend``'s
command line (its docstring says what it reads and writes), run from any working directory.

    PYTHONPATH=. python3 benchmarks/tune_backend.py RESULTS [RESULTS ...] [--out DIR] [--device KIND] [--arch ARCH]
        [--dry-run]

Default destination: the user's table of the device (``<user cache>/tuned/jax/<arch>/<device kind>.json``); the
shipped tables are regenerated with ``--out moe_pallas/ops/grouped_gemm/tuned``.
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # the packages from any working directory
    sys.path.insert(0, _ROOT)

from moe_pallas.ops.grouped_gemm.tune_backend import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
