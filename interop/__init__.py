"""Where the two backends meet: the command line (and, to come, the DLPack bridge and the
stage-by-stage cross-check). The only package besides tests/ and benchmarks/ that imports
both ``moe_pallas`` and ``moe_torch``."""
