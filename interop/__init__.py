"""Where the two backends meet: the DLPack bridge (``dlpack.py``), the stage-by-stage cross-check
(``crosscheck/``), Hugging Face safetensors checkpoints (``checkpoints.py``) and the command line
(``cli.py``, ``epmoe``). The only package besides tests/ and benchmarks/ that imports both
``moe_pallas`` and ``moe_torch``."""
