"""Compile Triton kernels for sm_90 on a machine without a GPU (tests only).

Under ``TRITON_INTERPRET=1`` triton's own jit library (``tl.sigmoid``, ``tl.max``... in
``triton/language/standard.py``) is decorated as InterpretedFunctions when triton is imported,
and the code generator needs JITFunctions, so the kernels are compiled in one child process
without the interpreter. It needs no GPU and no driver, only triton's bundled ptxas.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_COMPILER = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ptx = []
for job in json.loads(sys.stdin.read()):
    kernel = getattr(importlib.import_module(job["module"]), job["kernel"])
    # parameters a job leaves out take their defaults, as constexprs (e.g. the GEMM's TMA-only x_desc=None)
    constexprs = {**{p.name: p.default for p in kernel.params if p.has_default and p.name not in job["signature"]},
                  **job["constexprs"]}
    signature = {**job["signature"], **{k: "constexpr" for k in constexprs}}
    # "divisible": the arguments a launch specializes as multiples of 16 (aligned pointers, such ints)
    names = [p.name for p in kernel.params]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in job.get("divisible", ())}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=job["options"])
    assert compiled.asm["cubin"], "no cubin"
    ptx.append(compiled.asm[job.get("stage", "ptx")])
json.dump(ptx, sys.stdout)
"""


def compile_sm90(jobs: dict[str, dict], module: str | None = None, kernel: str | None = None) -> dict[str, str]:
    """name -> PTX of each job (``module``, ``kernel``, ``signature``, ``constexprs``, ``options``;
    ``module`` / ``kernel`` default to the arguments; ``stage``: another of triton's texts, e.g. ``"ttgir"``),
    compiled for sm_90 in a child process."""
    payload = [{"module": module, "kernel": kernel, **job} for job in jobs.values()]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", _COMPILER], input=json.dumps(payload),
                         capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert run.returncode == 0, f"sm_90 compilation failed:\n{run.stderr[-4000:]}"
    return dict(zip(jobs, json.loads(run.stdout)))


def ptxas_available() -> bool:
    """Whether triton's bundled ptxas is there (the sm_90a compile tests skip without it)."""
    import triton

    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


def run_compile_child(child: str) -> dict:
    """The JSON ``child`` (Python source) prints, run in a child process without ``TRITON_INTERPRET`` and with the
    repository on ``PYTHONPATH`` (the Gluon kernels' sm_90a compile tests: Gluon has no interpreter). Skips the
    calling test without triton's bundled ptxas."""
    import pytest

    if not ptxas_available():
        pytest.skip("triton's bundled ptxas is unavailable")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, cwd=root,
                         timeout=240)
    assert run.returncode == 0, f"sm_90a compilation failed:\n{run.stderr[-4000:]}"
    return json.loads(run.stdout)
