"""Count the sm_90 SASS instructions of the Triton grouped GEMM's K loop, on a machine without a GPU.

The 4-bit decode at small M is bound by how many instructions each K step issues (BENCHMARKS.md, 2026-12-01c and d), and
that count can be read off the compiled kernel: ``triton.compile`` for sm_90 (no driver needed), the cubin
disassembled by triton's bundled ``nvdisasm``, the loop found as the longest backward branch. Integer arguments are
specialized as a real launch of gpt-oss-120b's gate_up specializes them (pointers, N, K and the strides of contiguous
tensors divisible by 16), so the loads vectorize as they do on the GPU.

    PYTHONPATH=. python3 benchmarks/sass_gemm.py [--format mxfp4|int4|bf16] [--block 16x128x64] [--warps 4]
        [--stages 3] [--no-table] [--sass FILE]
    PYTHONPATH=. python3 benchmarks/sass_gemm.py --kernel decode_down --format mxfp4 --tokens 8 [--warps N]

``--kernel decode_gate_up`` / ``decode_down``: the decode path's kernels (``moe_torch/ops/decode/triton.py``) at
gpt-oss-120b's sizes (H = I = 2880, 128 experts, top-4, swiglu_oai, interleaved rows, biases; ``--tokens`` T), with
the heuristic configs for that T (``--warps`` overrides); the loop counted is the innermost one holding the tensor-core
instructions (the K / I loop), not the outer loops around it.

Prints the loop's instruction count, the count per weight element and per lane (``instructions x 32 x warps /
(block_n x block_k)``), and the most frequent opcodes. The counts of the library's kernels: BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: The kernel's integer arguments; those divisible by 16 in a real launch (gpt-oss: N=5760, K=2880) are marked so.
INT_ARGS = ("M_cap", "N", "K", "E", "stride_xm", "stride_we", "stride_wn", "stride_om", "stride_xsm", "stride_xsk",
            "stride_wse", "stride_wsn", "stride_wsk", "stride_be")
DIVISIBLE_BY_16 = {"x_ptr", "w_ptr", "offsets_ptr", "x_scale_ptr", "w_scale_ptr", "bias_ptr", "out_ptr", "e8m0_lut",
                   "N", "K", "stride_xm", "stride_we", "stride_wn", "stride_om", "stride_wse", "stride_be"}
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/")


def compile_sass(fmt: str, block_m: int, block_n: int, block_k: int, warps: int, stages: int, table: bool = True,
                 tma: bool = False) -> str:
    """The SASS (text) of ``moe_torch``'s ``_grouped_gemm_kernel`` for bf16 ``x`` and ``fmt`` weights (``fp8_block``:
    FP8 ``x`` and ``w``), for sm_90.
    ``table``: MXFP4 with the e8m0 table argument (as the launcher passes it on a GPU). Under ``TRITON_INTERPRET=1``
    (the test suite) the kernels are interpreter functions, so the compile runs in a child process without it."""
    import triton

    if triton.knobs.runtime.interpret:
        return _compile_in_child(["--format", fmt, "--block", f"{block_m}x{block_n}x{block_k}", "--warps", str(warps),
                                  "--stages", str(stages)] + ([] if table else ["--no-table"])
                                 + (["--tma"] if tma else []))[0]
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_torch.ops.grouped_gemm.triton import W_SCALE_CODES, X_SCALE_CODES, _grouped_gemm_kernel as kernel

    w4 = fmt in ("mxfp4", "int4", "mxfp4_mma")
    fp8 = fmt == "fp8_block"  # DeepSeek-V3's FP8: x per 1 x 128 group, w per 128 x 128 block, float32 scales
    code = "*fp8e4nv" if fp8 else "*bf16"
    sig = {"x_ptr": code, "w_ptr": "*u8" if w4 else code, "offsets_ptr": "*i32", "x_scale_ptr": "*fp32",
           "w_scale_ptr": {"mxfp4": "*u8", "mxfp4_mma": "*u8", "fp8_block": "*fp32"}.get(fmt, "*bf16"), "bias_ptr": "*fp32", "out_ptr": "*bf16",
           **{n: "i32" for n in INT_ARGS}}
    if fmt in ("mxfp4", "mxfp4_mma") and table:
        sig["e8m0_lut"] = "*bf16"
    if tma:  # the TMA variant: x and w tiles through host-side tensor descriptors
        t = code[1:]
        sig["x_desc"] = f"tensordesc<{t}[{block_m}, {block_k}]>"
        sig["w_desc"] = f"tensordesc<{t}[{block_n}, {block_k}]>"
    const = dict(X_SCALE=X_SCALE_CODES["per_token_group" if fp8 else None],
                 W_SCALE=W_SCALE_CODES["block" if fp8 else fmt if w4 else None], X_GROUP=128 if fp8 else 1,
                 W_BLOCK=128 if fp8 else 1, IEEE_F32=False,
                 HAS_BIAS=False, BLOCK_E=256, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=1,
                 PERSISTENT=False, TMA=tma)
    const.update({p.name: p.default for p in kernel.params if p.has_default and p.name not in sig and p.name not in const})
    sig.update({k: "constexpr" for k in const})
    names = [p.name for p in kernel.params]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE_BY_16 if n in sig}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    return _disassemble(compiled)


def _compile_in_child(args: list[str]) -> tuple[str, str]:
    """``(SASS, stdout)`` of this script run with ``args`` in a child process without ``TRITON_INTERPRET`` (under the
    interpreter the kernels are interpreter functions, which do not compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "kernel.sass")
        res = subprocess.run([sys.executable, os.path.abspath(__file__), *args, "--sass", out], env=env, check=True,
                             capture_output=True, text=True, timeout=600)
        with open(out) as f:
            return f.read(), res.stdout


def _disassemble(compiled) -> str:
    """The SASS text of a compiled kernel's cubin, by triton's bundled ``nvdisasm``."""
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout


def compile_decode_sass(kernel: str, fmt: str, T: int, warps: int | None = None) -> tuple[str, int, int]:
    """``(SASS, weights a step of the I / K loop, warps)`` of the decode path's ``kernel`` (``"decode_gate_up"`` /
    ``"decode_down"``) for bf16 activations and ``fmt`` weights (``mxfp4``, ``int4``, ``bf16``) at gpt-oss-120b's sizes
    and ``T`` tokens, the heuristic configs, integer arguments specialized as a real launch specializes them (``S`` is
    never specialized: the kernel says so). In a child process under ``TRITON_INTERPRET=1``, as :func:`compile_sass`."""
    import triton

    if triton.knobs.runtime.interpret:
        sass, stdout = _compile_in_child(["--kernel", kernel, "--format", fmt, "--tokens", str(T)]
                                         + ([] if warps is None else ["--warps", str(warps)]))
        weights, nw = (int(v) for v in stdout.split("DECODE_STEP ")[1].split()[:2])
        return sass, weights, nw
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_torch.ops.decode import triton as D
    from moe_torch.ops.decode.config import decode_down_config, decode_gate_up_config
    from moe_torch.ops.grouped_gemm.triton import W_SCALE_CODES

    H = I = 2880
    E, k = 128, 4
    w4 = fmt in ("mxfp4", "int4", "mxfp4_mma")
    mx = fmt in ("mxfp4", "mxfp4_mma")
    w_ty, s_ty = ("*u8" if w4 else "*bf16"), ("*u8" if mx else "*bf16")
    code = W_SCALE_CODES[fmt if w4 else None]
    lut = {"e8m0_lut": "*bf16"} if mx else {}
    if kernel == "decode_gate_up":
        cfg = decode_gate_up_config(T, k, H, I, E, w4=w4)
        fn, S = D._decode_gate_up_kernel, T * k
        ints = ("S", "H", "I", "E_local", "expert_start", "stride_xt", "stride_we", "stride_wn", "stride_wse",
                "stride_wsn", "stride_wsk", "stride_be", "stride_as")
        sig = {"x_ptr": "*bf16", "ids_ptr": "*i32", "tw_ptr": "*fp32", "w_ptr": w_ty, "ws_ptr": s_ty, "b_ptr": "*bf16",
               "a_ptr": "*bf16", **{n: "i32" for n in ints}, **lut}
        const = dict(K_SLOTS=k, TOPK=k, ON_INPUT=False, ACTIVATION=2, INTERLEAVED=True, HAS_BIAS=True, W_SCALE=code,
                     IEEE_F32=False, BLOCK_E=E, CHUNK_S=cfg.chunk_s, NUM_CHUNKS=triton.cdiv(S, cfg.chunk_s),
                     NUM_M_BLOCKS=triton.cdiv(S, cfg.block_m), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                     BLOCK_K=cfg.block_k)
        weights = 2 * cfg.block_n * cfg.block_k
    else:
        cfg = decode_down_config(T, H, I, w4=w4)
        fn = D._decode_down_kernel
        ints = ("H", "I", "E_local", "expert_start", "stride_as", "stride_we", "stride_wn", "stride_wse", "stride_wsn",
                "stride_wsk", "stride_be", "stride_ot")
        sig = {"a_ptr": "*bf16", "ids_ptr": "*i32", "tw_ptr": "*fp32", "w_ptr": w_ty, "ws_ptr": s_ty, "b_ptr": "*bf16",
               "out_ptr": "*bf16", **{n: "i32" for n in ints}, "rsf": "fp32", **lut}
        const = dict(K_SLOTS=k, TOPK=k, ON_INPUT=False, HAS_BIAS=True, APPLY_RSF=False, W_SCALE=code, USE_DOT=True,
                     BLOCK_H=cfg.block_h, BLOCK_I=cfg.block_i)
        weights = cfg.block_h * cfg.block_i
    nw = warps or cfg.num_warps
    const.update({p.name: p.default for p in fn.params if p.has_default and p.name not in sig and p.name not in const})
    sig.update({n: "constexpr" for n in const})
    names = [p.name for p in fn.params]
    # what a launch at these sizes specializes: 16-byte aligned pointers, ints divisible by 16 (not S: unspecialized)
    divisible = {n for n, t in sig.items() if t.startswith("*")} | {"H", "I", "stride_xt", "stride_we", "stride_wn",
                                                                    "stride_wse", "stride_as", "stride_ot", "stride_be"}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible if n in sig and sig[n] != "constexpr"}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=nw, num_stages=cfg.num_stages))
    return _disassemble(compiled), weights, nw


def loops(sass: str) -> list[list[str]]:
    """The instructions of every loop (a label to the backward branch that returns to it), in program order."""
    where, count, label = {}, 0, re.compile(r"\s*\.L_x_(\d+):")
    instructions = []
    for line in sass.splitlines():
        m = label.match(line)
        if m:
            where[m.group(1)] = count
        elif _INSTRUCTION.match(line):
            instructions.append(line)
            count += 1
    found = []
    for i, line in enumerate(instructions):
        m = re.search(r"BRA[^;]*\.L_x_(\d+)", line)
        if m and m.group(1) in where and where[m.group(1)] <= i:
            found.append(instructions[where[m.group(1)]:i + 1])
    return found


def mma_loop(sass: str) -> list[str]:
    """The shortest loop holding tensor-core instructions (``HMMA``): a decode kernel's K / I loop."""
    inner = [lp for lp in loops(sass) if any("HMMA" in line for line in lp)]
    if not inner:
        raise ValueError("sass_gemm: no loop with HMMA in the kernel's SASS")
    return min(inner, key=len)


def hottest_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (the first of equal ones): from a label to the backward branch that
    returns to it."""
    found = loops(sass)
    if not found:
        raise ValueError("sass_gemm: no backward branch (loop) in the kernel's SASS")
    return max(found, key=len)


def opcodes(loop: list[str]) -> collections.Counter:
    """Opcode (without modifiers) of each instruction, predicates dropped."""
    names = (re.sub(r"^\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", line).split()[0].split(".")[0] for line in loop)
    return collections.Counter(names)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default="mxfp4", choices=("mxfp4", "int4", "bf16", "fp8_block", "mxfp4_mma"),
                   help="the weights (x is bf16; fp8_block: x and w FP8 with DeepSeek-V3's 1 x 128 / 128 x 128 scales; "
                        "mxfp4_mma: MXFP4 codes in the MMA layout)")
    p.add_argument("--block", default="16x128x64", help="BLOCK_MxBLOCK_NxBLOCK_K")
    p.add_argument("--warps", type=int, default=None, help="default: 4 (the GEMM); a decode kernel's heuristic")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--no-table", action="store_true", help="MXFP4 without the e8m0 table (scales from their bits)")
    p.add_argument("--tma", action="store_true", help="the TMA variant (bf16 / fp8_block weights)")
    p.add_argument("--sass", default=None, help="also write the whole SASS here")
    p.add_argument("--kernel", default="gemm", choices=("gemm", "decode_gate_up", "decode_down"),
                   help="the grouped GEMM (default) or one of the decode path's kernels at gpt-oss-120b's sizes")
    p.add_argument("--tokens", type=int, default=8, help="decode kernels: T, the tokens of the layer call")
    p.add_argument("--mma-layout", action="store_true",
                   help="MXFP4 codes in the MMA layout (moe_contract/w4_layout.py): --format mxfp4_mma")
    a = p.parse_args(argv)
    if a.mma_layout:
        if a.format != "mxfp4":
            p.error("--mma-layout: MXFP4 weights only")
        a.format = "mxfp4_mma"
    if a.kernel != "gemm":
        if a.format not in ("mxfp4", "int4", "bf16", "mxfp4_mma"):
            p.error("--kernel decode_*: --format is mxfp4, mxfp4_mma, int4 or bf16")
        sass, weights, nw = compile_decode_sass(a.kernel, a.format, a.tokens, a.warps)
        if a.sass:
            with open(a.sass, "w") as f:
                f.write(sass)
        loop = mma_loop(sass)
        print(f"DECODE_STEP {weights} {nw}")
        print(f"{a.kernel} {a.format} T={a.tokens}, {nw} warps: loop {len(loop)} instructions a step ({weights} weights): "
              f"{len(loop) * 32 * nw / weights:.2f} lane-instructions a weight")
        print("  " + ", ".join(f"{k} {v}" for k, v in opcodes(loop).most_common(16)))
        return 0
    try:
        bm, bn, bk = (int(v) for v in a.block.split("x"))
    except ValueError:
        p.error(f"--block must be BLOCK_MxBLOCK_NxBLOCK_K, e.g. 16x128x64; got {a.block!r}")
    if a.tma and a.format in ("mxfp4", "int4", "mxfp4_mma"):
        p.error("--tma: the TMA variant takes bf16 or fp8_block weights, not 4-bit ones")
    a.warps = a.warps or 4
    sass = compile_sass(a.format, bm, bn, bk, a.warps, a.stages, table=not a.no_table, tma=a.tma)
    if a.sass:
        with open(a.sass, "w") as f:
            f.write(sass)
    loop = hottest_loop(sass)
    per_lane = len(loop) * 32 * a.warps / (bn * bk)
    print(f"{a.format}{' TMA' if a.tma else ''} {bm}x{bn}x{bk}, {a.warps} warps, {a.stages} stages: K loop {len(loop)} "
          f"instructions a step ({bn * bk} weights): {per_lane:.2f} lane-instructions a weight")
    print("  " + ", ".join(f"{k} {v}" for k, v in opcodes(loop).most_common(16)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
