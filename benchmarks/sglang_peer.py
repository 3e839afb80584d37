"""SGLang's fused-MoE Triton kernels as a benchmark-only peer of the decode rows (``bench.py --what decode``,
row ``sglang-fused_moe-triton``).

What is timed: ``sglang.srt.layers.moe.fused_moe_triton.fused_moe.fused_experts_impl`` of the ``sglang`` wheel
(version :data:`SGLANG_VERSION`), the function behind SGLang's ``fused_experts`` (its Triton MoE runner for the
standard dispatch; its custom op ``outplace_fused_experts`` only forwards to it, and is registered for CUDA alone, so
the function itself is called, the same on the GPU and in the CPU self-test), out of place (``inplace=False``: the
output in a buffer of its own, as a CUDA graph replays best; ``no_combine=False``) on our layer's ``x``, the
gate's ``topk_weights`` / ``topk_ids`` and our weights converted once (:class:`SGLangFusedMoE`): its
``moe_align_block_size``, ``fused_moe_kernel`` (or ``fused_moe_kernel_gptq_awq`` for INT4) for GEMM 1, its
activation, the same kernel for GEMM 2 (routing weights applied there) and its combine, with the launch
configuration SGLang picks itself (``try_get_optimal_moe_config``: a tuned JSON of its wheel for this GPU, E
and N if there is one, else its default; the row's notes say which). sglang is NOT a dependency of the
library, of its tests or of ``bench.py``: without it the row is skipped with :data:`INSTALL_HINT`.

Import chain. ``import sglang.srt.layers.moe.fused_moe_triton.fused_moe`` as a package import runs
``sglang/__init__.py`` (``sglang.lang``: pybase64, IPython, ...), ``sglang/srt/layers/moe/__init__.py`` (the
MoE runner, distributed state, DP attention), ``fused_moe_triton/__init__.py`` (the ``FusedMoE`` layer) and
``sglang.srt.server_args`` (openai, pydantic, fastapi, ...), most of which the GPU machine lacks and none of
which the kernels use. :func:`import_fused_moe` therefore loads only the kernel modules of the wheel, unchanged
(``fused_moe``, ``fused_moe_triton_kernels``, ``fused_moe_triton_config``, ``moe_align_block_size``,
``quantization.fp8_kernel`` / ``int8_kernel``, ``batch_invariant_ops``, ``deep_gemm_wrapper.configurer`` and the
real ``sglang.srt.utils`` / ``environ`` / ``custom_op`` they import), and puts in ``sys.modules`` first:

- bare package objects (a ``__path__`` into the wheel, their ``__init__.py`` not run) for ``sglang``,
  ``sglang.srt.layers.moe``, ``sglang.srt.layers.moe.fused_moe_triton`` (with ``get_config() -> None``: the
  package's "no ``override_config``" default, read by ``try_get_optimal_moe_config``),
  ``sglang.srt.layers.quantization`` and ``sglang.srt.layers.deep_gemm_wrapper``;
- ``sglang.srt.server_args`` stand-in: ``get_global_server_args()`` gives ``ServerArgs``' defaults of the two
  fields this path reads, ``enable_fused_moe_sum_all_reduce=False``, ``enable_deterministic_inference=False``;
- ``sglang.srt.layers.moe.moe_runner`` stand-in: ``MoeRunnerConfig``, a placeholder class (``fused_moe.py``
  imports it for ``fused_experts``' signature; :class:`SGLangFusedMoE` calls ``fused_experts_impl`` directly);
- ``sglang.jit_kernel.per_tensor_quant_fp8`` / ``per_token_group_quant_8bit`` stand-ins (imported by
  ``fp8_kernel`` on CUDA; the real ones JIT-compile CUDA through tvm-ffi): functions that raise if called;
- ``sgl_kernel`` (SGLang's CUDA kernel wheel, not required) stand-in, :data:`SGL_KERNEL_STUBS`:
  ``moe_align_block_size`` = :func:`moe_align_block_size_torch` (ours, torch ops, CUDA-graph capturable: the
  op's outputs as SGLang's CUDA kernel defines them), ``moe_sum_reduce`` = SGLang's own Triton
  ``moe_sum_reduce_triton`` (what its HIP build calls; its combine for T > 32, unless one or two slots with rsf 1
  take its ``torch.add`` path), every other
  name a function that raises if called.

After the import, two module globals are rebound: ``moe_align_block_size.sgl_moe_align_block_size`` (bound
only on CUDA by the module itself) to :func:`moe_align_block_size_torch`, and
``fused_moe_triton_kernels.sglang_per_token_group_quant_fp8`` (CUDA: the JIT CUDA kernel above) to
``fp8_kernel.per_token_group_quant_fp8``, SGLang's Triton 1x128 activation quantizer (what it uses off CUDA).
``fused_experts_impl`` is called with ``filter_expert=True`` (SGLang's value under expert parallelism), so its
activation is SGLang's Triton ``act_and_mul_triton`` (silu / gelu) rather than ``sgl_kernel``'s CUDA
``silu_and_mul``; gpt-oss's clamped SwiGLU is SGLang's ``torch.compile``'d ``_swiglu_gpt_oss_sigmoid_alpha``
either way. The timed GEMM kernels are SGLang's, unchanged. The row's notes list these substitutions.

Formats (our weights as ``moe_torch.quantize_layer_weights`` stores them; SGLang's ``w1`` / ``w2`` are our
``w13 [E, 2I, H]`` / ``w2 [E, H, I]``, so most conversions are the identity):

- ``'none'``: bf16 weights. Gate/up rows: SGLang's silu / gelu take them concatenated (gate rows first), its
  gpt-oss SwiGLU (``gemm1_alpha`` 1.702, ``gemm1_limit`` 7) interleaved: rows are permuted once where our
  ``gate_up_layout`` differs (biases and INT4 scales with them).
- ``'fp8_block'``: ``use_fp8_w8a8=True``, ``block_shape=[128, 128]``; our float8_e4m3fn codes and
  ``[E, ceil(N/128), ceil(K/128)]`` float32 scales are its layout; activations quantized per 1x128 group by
  SGLang's Triton quantizer (above). A gate/up layout it does not take is refused (a row permutation would
  cross the 128-row scale blocks).
- ``'int4'``: ``use_int4_w4a16=True``, ``block_shape=[0, 32]``, no zero point (SGLang then subtracts 8): our
  packed ``[E, N, K // 2]`` uint8 codes (element ``2i`` in the low nibble, CONTRACT.md section 9) and
  ``[E, N, K // 32]`` bf16 scales are exactly what ``fused_moe_kernel_gptq_awq`` reads (``(code - 8) *
  scale`` in float32, rounded to bf16). That kernel takes no bias: gpt-oss's expert biases are refused.
- ``'mxfp4'``, ``'fp8_per_token'``: NotImplementedError (below).

Everything the adapter cannot serve raises NotImplementedError naming the reason (the bench row is then a
skip row with it): MXFP4 (SGLang serves it through other kernels: triton_kernels' ``matmul_ogs``, FlashInfer,
Marlin, not ``fused_moe_triton``), per-token FP8 (its activation quantizer is an ``sgl_kernel`` CUDA op),
capacity, Qwen3-Next's shared-expert gate, INT4
with expert biases, ``apply_router_weight_on_input`` with biases or fused shared experts (SGLang scales GEMM
1's output, not its input), one slot per token with ``rsf != 1`` (its combine is skipped then), float32 ``x``.
One EP rank (``ep_size > 1``) runs as SGLang's EP layers run it: the rank's experts, the gate's ids mapped to local ids
(``-1`` for other ranks' experts, which ``filter_expert=True`` skips), the output that rank's partial sum.

On the GPU machine (no network) the wheels travel in ``.whl/`` (git-ignored) with the working tree:
:data:`WHEELS`, 6.3 MB; the device image has the rest of what the import chain loads (torch and its
dependencies, triton, numpy, psutil, requests, pillow, torchvision, packaging, anyio). Command prefix::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \\
        && export PYTHONPATH=.:/tmp/site
    python3 benchmarks/bench.py --what decode --backends decode,sglang

Download (here, with network; wheels for the device's Python 3.12)::

    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl sglang==0.5.10.post1 orjson==3.11.5 pybase64==1.4.3 starlette==0.50.0

Self-test (CPU, no GPU: SGLang's kernels under ``TRITON_INTERPRET=1``, exact casts and dots from
``moe_torch.ops.triton_interpret``, the CUDA branches of ``fused_experts_impl`` taken;
``torch.compile``'d helpers run eagerly unless ``--compile``)::

    PYTHONPATH=.:/tmp/site python3 benchmarks/sglang_peer.py --selftest
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types

#: The sglang wheel this adapter was written against (its stand-ins name this version's modules).
SGLANG_VERSION = "0.5.10.post1"

#: The bench row.
ROW_NAME = "sglang-fused_moe-triton"

#: The wheels the GPU machine needs for this row (``.whl/``): sglang itself and the three modules its
#: ``sglang.srt.utils.common`` imports at module level that the device image lacks.
WHEELS = (
    "sglang-0.5.10.post1-py3-none-any.whl",  # 6.06 MB
    "orjson-3.11.5-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",  # 0.14 MB
    "pybase64-1.4.3-cp312-cp312-manylinux1_x86_64.manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_5_x86_64.whl",
    # 0.07 MB
    "starlette-0.50.0-py3-none-any.whl",  # 0.07 MB
)

INSTALL_HINT = (f"sglang is a benchmark-only peer, not installed here: carry its wheels in .whl/ ({', '.join(WHEELS)}; "
                "benchmarks/sglang_peer.py says how) and run `python3 -m pip install -q --no-index --no-deps "
                "--no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=.:/tmp/site`")

#: ``sgl_kernel`` names the loaded modules import, and what the stand-in gives for each.
SGL_KERNEL_STUBS = {
    "moe_align_block_size": "moe_align_block_size_torch (ours)",
    "moe_sum_reduce": "SGLang's Triton moe_sum_reduce_triton",
    "silu_and_mul": "raises (not reached: filter_expert=True)",
    "gelu_and_mul": "raises (not reached: filter_expert=True)",
    "sgl_per_token_quant_fp8": "raises (per-token FP8 is refused)",
    "sgl_per_token_group_quant_8bit": "raises (not reached: the quantizer is rebound)",
    "sgl_per_token_group_quant_fp8": "raises (not reached)",
    "sgl_per_token_group_quant_int8": "raises (not reached)",
}

#: The self-test's bound on an FP8 layer's distance from ours: SGLang's FP8 rows differ from ours by a few codes of
#: the 1x128-quantized activations (its act-and-mul rounds twice, its scales divide), 1-2% of the output at the
#: self-test's shapes, while both lie ~4-5% from the layer on float activations. bench.py's gate is
#: ``harness.REL_ERR_MAX`` for every row.
FP8_REL_ERR_MAX = 3e-2

_BARE_PACKAGES = ("sglang", "sglang.srt.layers.moe", "sglang.srt.layers.moe.fused_moe_triton",
                  "sglang.srt.layers.quantization", "sglang.srt.layers.deep_gemm_wrapper")


# ---------------------------------------------------------------------------------------------- alignment

def moe_align_block_size_torch(topk_ids, num_experts: int, block_size: int, sorted_token_ids, expert_ids,
                               num_tokens_post_pad, cumsum_buffer=None, pad_sorted_token_ids: bool = False) -> None:
    """``sgl_kernel.moe_align_block_size`` in torch ops (ours; fixed shapes, no host sync: CUDA-graph capturable).

    As SGLang calls it (``fused_moe_triton/moe_align_block_size.py``), ``num_experts`` counts one bucket more than
    the experts: slot ``i`` of ``topk_ids.flatten()`` goes to bucket ``topk_ids[i] + 1``, so id ``-1`` (an expert
    filtered out under EP) is bucket 0. Each bucket's count is padded up to a multiple of ``block_size``; bucket
    ``b`` owns ``[cumsum[b], cumsum[b + 1])`` of ``sorted_token_ids``, its slots' flat indices first (here in
    ascending order; the CUDA op's order within a bucket is that of its atomics), then padding; with
    ``pad_sorted_token_ids`` (as SGLang calls it) every other entry of the buffer is ``topk_ids.numel()``.
    ``expert_ids[blk] = b - 1`` for the blocks of bucket ``b``; ``num_tokens_post_pad[0] = cumsum[-1]``. The blocks
    past ``num_tokens_post_pad``, which the CUDA op leaves unwritten (no kernel reads them), get ``-1`` here.
    ``cumsum_buffer`` (the op's scratch) is not used."""
    import torch

    dev = topk_ids.device
    n = topk_ids.numel()
    bucket = topk_ids.reshape(-1).to(torch.int64) + 1
    onehot = (bucket[:, None] == torch.arange(num_experts, device=dev)[None, :]).to(torch.int32)  # [n, buckets]
    padded = (onehot.sum(0, dtype=torch.int64) + block_size - 1) // block_size * block_size
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    rank = torch.cumsum(onehot, 0).gather(1, bucket[:, None]).squeeze(1) - 1  # rank of slot i in its bucket
    if pad_sorted_token_ids:  # SGLang always asks for it; without it the padding entries are left as they were
        sorted_token_ids.fill_(n)
    sorted_token_ids.scatter_(0, starts[bucket] + rank, torch.arange(n, device=dev, dtype=sorted_token_ids.dtype))
    total = ends[-1:]
    num_tokens_post_pad.copy_(total.to(num_tokens_post_pad.dtype))
    block_start = torch.arange(expert_ids.numel(), device=dev, dtype=torch.int64) * block_size
    owner = torch.searchsorted(ends, block_start, right=True)  # the bucket whose range holds the block
    expert_ids.copy_(torch.where(block_start < total, owner - 1, -1).to(expert_ids.dtype))


# ---------------------------------------------------------------------------------------------- import

def _bare_package(name: str, root: str) -> types.ModuleType:
    """A package object for ``name`` whose submodules load from the wheel, its ``__init__.py`` not run."""
    path = os.path.join(root, *name.split(".")[1:])
    mod = types.ModuleType(name)
    mod.__path__ = [path]
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = mod.__path__
    mod.__spec__ = spec
    mod.__package__ = name
    return mod


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return mod


def _unavailable(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"sglang_peer: {name} is a stand-in (the real one is not required); this call "
                                  f"should not happen on the path the adapter runs")

    fn.__name__ = name.rsplit(".", 1)[-1]
    return fn


def _sgl_kernel_stub() -> types.ModuleType:
    def moe_sum_reduce(input, output, routed_scaling_factor):
        # SGLang's own Triton combine (its HIP build's), imported at call time: the stub is built before it exists
        from sglang.srt.layers.moe.fused_moe_triton.fused_moe_triton_kernels import moe_sum_reduce_triton

        moe_sum_reduce_triton(input, output, routed_scaling_factor)

    attrs = {name: _unavailable(f"sgl_kernel.{name}") for name in SGL_KERNEL_STUBS}
    attrs.update(moe_align_block_size=moe_align_block_size_torch, moe_sum_reduce=moe_sum_reduce,
                 __version__="stand-in (benchmarks/sglang_peer.py)")
    return _module("sgl_kernel", **attrs)


@functools.lru_cache(maxsize=None)
def import_fused_moe() -> types.ModuleType:
    """``sglang.srt.layers.moe.fused_moe_triton.fused_moe``, loaded as the module docstring says (once per process).

    Raises: ImportError (:data:`INSTALL_HINT`) if sglang is not installed; ImportError naming the module if a
      module of the chain is missing; RuntimeError if the installed sglang is not :data:`SGLANG_VERSION`, whose
      modules the stand-ins replace."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(INSTALL_HINT)
    try:
        from importlib.metadata import version

        got = version("sglang")
    except Exception:  # noqa: BLE001 (no metadata: an unpacked tree; the imports below decide)
        got = None
    if got is not None and got != SGLANG_VERSION:
        raise RuntimeError(f"sglang_peer: written against sglang {SGLANG_VERSION} (its stand-ins replace that "
                           f"version's modules); installed: {got}")
    root = list(spec.submodule_search_locations)[0]
    if "sglang" in sys.modules and getattr(sys.modules["sglang"], "__file__", None):
        raise RuntimeError("sglang_peer: sglang is already imported as a whole package in this process; the adapter "
                           "loads only its kernel modules and must come first")
    for name in _BARE_PACKAGES:
        sys.modules.setdefault(name, _bare_package(name, root))
    sys.modules["sglang.srt.layers.moe.fused_moe_triton"].get_config = lambda: None  # no override_config
    server_args = types.SimpleNamespace(enable_fused_moe_sum_all_reduce=False, enable_deterministic_inference=False)
    sys.modules.setdefault("sglang.srt.server_args", _module(
        "sglang.srt.server_args", get_global_server_args=lambda: server_args))

    class MoeRunnerConfig:  # a placeholder: fused_moe.py names it in fused_experts' signature only
        pass

    sys.modules.setdefault("sglang.srt.layers.moe.moe_runner", _module(
        "sglang.srt.layers.moe.moe_runner", MoeRunnerConfig=MoeRunnerConfig))
    for name, fn in (("per_tensor_quant_fp8", "per_tensor_quant_fp8"),
                     ("per_token_group_quant_8bit", "per_token_group_quant_8bit")):
        full = f"sglang.jit_kernel.{name}"
        sys.modules.setdefault(full, _module(full, **{fn: _unavailable(full + "." + fn)}))
    sys.modules.setdefault("sgl_kernel", _sgl_kernel_stub())

    fused_moe = importlib.import_module("sglang.srt.layers.moe.fused_moe_triton.fused_moe")
    align = importlib.import_module("sglang.srt.layers.moe.fused_moe_triton.moe_align_block_size")
    kernels = importlib.import_module("sglang.srt.layers.moe.fused_moe_triton.fused_moe_triton_kernels")
    fp8 = importlib.import_module("sglang.srt.layers.quantization.fp8_kernel")
    align.sgl_moe_align_block_size = moe_align_block_size_torch  # bound by the module itself on CUDA only
    kernels.sglang_per_token_group_quant_fp8 = fp8.per_token_group_quant_fp8  # CUDA: a tvm-ffi JIT kernel
    return fused_moe


def follow_cuda_branches(fused_moe: types.ModuleType) -> None:
    """For the CPU self-test: make ``fused_experts_impl`` take the branches it takes on CUDA (``act_and_mul_triton``
    for silu / gelu, ``torch.add`` / ``moe_sum_reduce_torch_compile`` / ``sgl_kernel.moe_sum_reduce`` for the
    combine), binding the ``sgl_kernel`` names the module imports on CUDA only; and name the device ``"cpu"`` for
    the tuned-config lookup (no file matches: SGLang's defaults). Not for the GPU, where all this is so."""
    stub = sys.modules["sgl_kernel"]
    fused_moe._is_cuda = True
    for name in ("gelu_and_mul", "moe_sum_reduce", "silu_and_mul"):
        setattr(fused_moe, name, getattr(stub, name))
    # SGLang's get_device_name() is None without a GPU, and its config lookup formats it into a file name
    cfg = sys.modules["sglang.srt.layers.moe.fused_moe_triton.fused_moe_triton_config"]
    if cfg.get_device_name() is None:
        cfg.get_device_name = lambda device_id=0: "cpu"


def sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001
        return "?"


# ---------------------------------------------------------------------------------------------- the layer

def _to_layout(w, src: str, dst: str):
    """``w [E, 2I, ...]``'s gate/up rows (dim 1) from layout ``src`` to ``dst`` (a copy unless they agree)."""
    import torch

    if w is None or src == dst:
        return w
    i = w.shape[1] // 2
    if dst == "concatenated":
        return torch.cat((w[:, 0::2], w[:, 1::2]), dim=1).contiguous()
    return torch.stack((w[:, :i], w[:, i:]), dim=2).reshape(w.shape).contiguous()


class SGLangFusedMoE:
    """SGLang's ``fused_experts_impl`` for one layer: weights converted once here, ``self(x, topk_weights,
    topk_ids)`` runs it (no host sync; CUDA-graph capturable once warm: its ``torch.compile``'d helpers compile on
    the first calls).

    Args (our layer's, as ``moe_torch.moe_forward`` takes them): ``w13 [E + S, 2I, H]``, ``w2 [E + S, H, I]``
    (bf16; float8_e4m3fn codes for ``fp8_block``; packed uint8 codes ``[.., K // 2]`` for ``int4``), ``config``
    (``MoEConfig``), ``w13_scale`` / ``w2_scale`` (``fp8_block``: ``[E, ceil(N/128), ceil(K/128)]`` float32;
    ``int4``: ``[E, N, K // 32]`` bf16), ``w13_bias [E, 2I]`` / ``w2_bias [E, H]`` (``config.expert_bias``).

    Raises: NotImplementedError naming what SGLang's Triton path cannot serve (module docstring); ImportError /
      RuntimeError from :func:`import_fused_moe`.
    """

    def __init__(self, w13, w2, config, *, w13_scale=None, w2_scale=None, w13_bias=None, w2_bias=None):
        from moe_contract.config import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

        c = config
        why = None
        if c.quant == "mxfp4":
            why = ("SGLang serves MXFP4 MoE weights through other kernels (triton_kernels' matmul_ogs, FlashInfer, "
                   "Marlin), not fused_moe_triton's fused_moe_kernel")
        elif c.quant == "fp8_per_token":
            why = ("SGLang's per-token FP8 activation quantizer on CUDA is an sgl_kernel op (sgl_per_token_quant_fp8), "
                   "a CUDA wheel this peer does not require")
        elif c.capacity_factor is not None:
            why = "capacity (capacity_factor): SGLang's fused_experts has no token dropping"
        elif c.shared_expert_gate:
            why = "Qwen3-Next's shared-expert sigmoid gate: SGLang's fused_experts has none"
        elif c.quant == "int4" and c.expert_bias:
            why = ("SGLang's INT4 w4a16 kernel (fused_moe_kernel_gptq_awq) takes no bias; this layer has expert "
                   "biases (gpt-oss)")
        elif c.apply_router_weight_on_input and (c.expert_bias or c.num_fused_shared_experts):
            why = ("apply_router_weight_on_input: SGLang scales GEMM 1's output by the routing weight, which equals "
                   "scaling its input only without biases and without fused shared experts (whose input stays unscaled)")
        elif c.topk + c.num_fused_shared_experts == 1 and c.combine_routed_scaling_factor != 1.0:
            why = ("one slot per token with routed_scaling_factor != 1: SGLang's fused_experts then writes GEMM 2 "
                   "straight to the output and its combine reads an unwritten buffer")
        act, layout = {"silu": ("silu", "concatenated"), "gelu_tanh": ("gelu", "concatenated"),
                       "swiglu_oai": ("silu", "interleaved")}[c.activation]
        if why is None and c.quant == "fp8_block" and c.gate_up_layout != layout:
            why = (f"fp8_block with gate_up_layout={c.gate_up_layout!r}: SGLang's {c.activation} reads the gate/up rows "
                   f"{layout}, and permuting FP8 rows would cross their 128-row scale blocks")
        if why is not None:
            raise NotImplementedError(f"{ROW_NAME}: {why}")
        self.fused_moe = import_fused_moe()
        self.config = c
        self.activation = act
        self.gemm1_alpha, self.gemm1_limit = (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT) if c.activation == "swiglu_oai" \
            else (None, None)
        src = c.gate_up_layout
        self.w1 = _to_layout(w13, src, layout).contiguous()
        self.w2 = w2.contiguous()
        self.b1 = _to_layout(w13_bias, src, layout)
        self.b2 = w2_bias
        self.quant_kw = dict(use_fp8_w8a8=c.quant == "fp8_block", use_int4_w4a16=c.quant == "int4",
                             w1_scale=None, w2_scale=None, block_shape=None)
        if c.quant == "fp8_block":
            self.quant_kw.update(w1_scale=w13_scale.float().contiguous(), w2_scale=w2_scale.float().contiguous(),
                                 block_shape=[128, 128])
        elif c.quant == "int4":  # no zero point: SGLang subtracts 8, our offset-binary codes
            self.quant_kw.update(w1_scale=_to_layout(w13_scale, src, layout).contiguous(),
                                 w2_scale=w2_scale.contiguous(), block_shape=[0, 32])
        self.routed_scaling_factor = float(c.combine_routed_scaling_factor)
        # one EP rank: SGLang's EP layers hand fused_experts local expert ids, -1 for other ranks' (filter_expert)
        self.expert_start, self.num_local = c.local_expert_range()

    def __call__(self, x, topk_weights, topk_ids):
        import torch

        if x.dtype not in (torch.bfloat16, torch.float16):
            raise NotImplementedError(f"{ROW_NAME}: x of {x.dtype} (SGLang's kernels compute in bf16 or float16)")
        if self.config.ep_size > 1:
            local = topk_ids.to(torch.int32) - self.expert_start
            topk_ids = torch.where((local >= 0) & (local < self.num_local), local, -1)
        return self.fused_moe.fused_experts_impl(
            x, self.w1, self.w2, topk_weights, topk_ids, b1=self.b1, b2=self.b2, inplace=False,
            activation=self.activation, is_gated=True,
            apply_router_weight_on_input=self.config.apply_router_weight_on_input, **self.quant_kw,
            no_combine=False, routed_scaling_factor=self.routed_scaling_factor, gemm1_alpha=self.gemm1_alpha,
            gemm1_limit=self.gemm1_limit, filter_expert=True)

    def launch_config(self, num_tokens: int, slots: int) -> tuple[dict, bool]:
        """``(config, tuned)``: the Triton launch configuration SGLang picks for ``num_tokens`` tokens of ``slots``
        slots (GEMM 1's; GEMM 2 takes the same unless a tuned ``_down`` file exists) and whether it came from a
        tuned JSON of the wheel (else its default)."""
        cfg_mod = sys.modules["sglang.srt.layers.moe.fused_moe_triton.fused_moe_triton_config"]
        q = self.quant_kw
        dtype = cfg_mod.get_config_dtype_str(dtype=None, use_fp8_w8a8=q["use_fp8_w8a8"],
                                             use_int4_w4a16=q["use_int4_w4a16"])
        block = q["block_shape"]
        E, _, N = self.w2.shape
        tuned = cfg_mod.get_moe_configs(E, N, dtype, block[0] if block else 0, block[1] if block else 0) is not None
        config, _ = cfg_mod.try_get_optimal_moe_config(tuple(self.w1.shape), tuple(self.w2.shape), slots, dtype,
                                                       num_tokens, block_shape=block, return_down_config=True)
        return dict(config), tuned

    def notes(self, num_tokens: int, slots: int) -> str:
        """What the row times, for its ``notes``: the version, the path, its launch config and the substitutions of
        the adapter that this call reaches."""
        config, tuned = self.launch_config(num_tokens, slots)
        kernel = "fused_moe_kernel_gptq_awq" if self.quant_kw["use_int4_w4a16"] else "fused_moe_kernel"
        act = ("_swiglu_gpt_oss_sigmoid_alpha (torch.compile)" if self.gemm1_alpha is not None
               else f"act_and_mul_triton ({self.activation})")
        cfg = ", ".join(f"{k}={v}" for k, v in config.items())
        ours = ["moe_align_block_size: ours in torch (sgl_kernel's CUDA op not required)"]
        if self.quant_kw["use_fp8_w8a8"]:
            ours.append("1x128 FP8 activations: SGLang's Triton quantizer (its CUDA one is a tvm-ffi JIT kernel)")
        if num_tokens > 32 and not (slots <= 2 and self.routed_scaling_factor == 1.0):
            ours.append("combine: SGLang's moe_sum_reduce_triton for sgl_kernel's moe_sum_reduce")
        return (f"sglang {sglang_version()} fused_experts_impl ({kernel} x2, {act}; inplace=False, filter_expert=True); "
                f"launch config {'tuned' if tuned else 'default (no tuned file for this GPU, E, N)'}: {cfg}; "
                + "; ".join(ours))


def sglang_fused_moe(x, topk_weights, topk_ids, w13, w2, config, *, w13_scale=None, w2_scale=None, w13_bias=None,
                     w2_bias=None):
    """A zero-argument callable running SGLang's fused MoE on these inputs (``x [T, H]`` bf16, ``topk_weights
    [T, k']`` float32, ``topk_ids [T, k']`` int32; the rest as :class:`SGLangFusedMoE`), weights converted once
    here; its ``notes`` attribute says what it runs. Raises as :class:`SGLangFusedMoE`."""
    layer = SGLangFusedMoE(w13, w2, config, w13_scale=w13_scale, w2_scale=w2_scale, w13_bias=w13_bias,
                           w2_bias=w2_bias)
    fn = functools.partial(layer, x, topk_weights, topk_ids)
    fn.notes = layer.notes(x.shape[0], topk_ids.shape[1])
    return fn


# ---------------------------------------------------------------------------------------------- self-test

def _align_reference(ids: list[int], buckets: int, block: int) -> tuple[list[int], list[int], int]:
    """The alignment op's outputs, slot by slot in plain Python (valid entries only)."""
    counts = [0] * buckets
    for e in ids:
        counts[e + 1] += 1
    starts, total = [], 0
    for c in counts:
        starts.append(total)
        total += (c + block - 1) // block * block
    sorted_ids = [len(ids)] * total
    seen = [0] * buckets
    for i, e in enumerate(ids):
        sorted_ids[starts[e + 1] + seen[e + 1]] = i
        seen[e + 1] += 1
    expert_ids = [b - 1 for b in range(buckets) for _ in range(((counts[b] + block - 1) // block))]
    return sorted_ids, expert_ids, total


def _check_alignment() -> list[str]:
    import torch

    fails = []
    g = torch.Generator().manual_seed(0)
    for T, k, E, block in ((1, 4, 128, 16), (3, 2, 4, 16), (40, 8, 16, 64), (5, 3, 6, 4)):
        ids = torch.randint(-1, E, (T, k), generator=g, dtype=torch.int32)
        numel = ids.numel()
        size = numel * block if numel < E + 1 else numel + (E + 1) * (block - 1)  # SGLang's buffer sizes
        sorted_ids = torch.full((size,), -7, dtype=torch.int32)
        expert_ids = torch.full(((size + block - 1) // block,), -7, dtype=torch.int32)
        post = torch.empty(1, dtype=torch.int32)
        moe_align_block_size_torch(ids, E + 1, block, sorted_ids, expert_ids, post, None, True)
        want_sorted, want_experts, total = _align_reference(ids.flatten().tolist(), E + 1, block)
        ok = (int(post) == total and sorted_ids[:total].tolist() == want_sorted
              and (sorted_ids[total:] == numel).all() and expert_ids[:total // block].tolist() == want_experts
              and (expert_ids[total // block:] == -1).all())
        if not ok:
            fails.append(f"alignment T={T} k={k} E={E} block={block}")
    return fails


def _stand_in_missing(names: tuple[str, ...]) -> list[str]:
    """Empty modules for packages the GPU machine has but this CPU environment may lack (``sglang.srt.utils.common``
    imports them at module level; the kernels never call them)."""
    made = []
    for name in names:
        top = name.split(".")[0]
        try:
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            for part in (top, name):
                sys.modules.setdefault(part, _module(part))
            made.append(name)
    if "torchvision.io" in made:
        sys.modules["torchvision.io"].decode_jpeg = _unavailable("torchvision.io.decode_jpeg")
    return made


def selftest(compile_helpers: bool = False) -> int:
    """Run SGLang's fused MoE through :class:`SGLangFusedMoE` at tiny shapes under Triton's interpreter and compare
    it with our reference layer (``moe_forward(implementation="reference")``, same logits: within ``harness.REL_ERR_MAX``;
    FP8 within :data:`FP8_REL_ERR_MAX` and no farther than 1.25x ours from the layer on float activations); also
    :func:`moe_align_block_size_torch` against a plain-Python statement of the op and the refusals. Returns the
    number of failures (prints one line per case)."""
    os.environ["TRITON_INTERPRET"] = "1"
    if not compile_helpers:
        os.environ["TORCHDYNAMO_DISABLE"] = "1"  # SGLang's torch.compile'd helpers run eagerly (no inductor C++ build)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    made = _stand_in_missing(("requests", "torchvision.io"))
    if made:
        print(f"stand-ins for packages of the GPU image missing here (never called by the kernels): {made}")
    import dataclasses

    import torch

    import moe_torch
    from benchmarks.harness import REL_ERR_MAX
    from moe_contract import MoEConfig
    from moe_torch.layer import run_gate
    from moe_torch.ops import triton_interpret

    triton_interpret.install()  # exact bf16 / fp8 casts and dots for SGLang's kernels too (process-wide)
    fused_moe = import_fused_moe()
    follow_cuda_branches(fused_moe)
    print(f"sglang {sglang_version()}: fused_moe imported from {fused_moe.__file__}")
    fails = _check_alignment()
    print("alignment (moe_align_block_size_torch vs the op's definition, ids -1 included):", "FAIL" if fails else "ok")

    base = dict(hidden_size=256, intermediate_size=128, num_experts=4, topk=2)
    cases = [
        ("bf16 silu", dict(), 3),
        ("fp8_block silu", dict(quant="fp8_block"), 3),
        ("int4 silu", dict(quant="int4"), 3),
        ("bf16 gelu_tanh, interleaved rows (permuted once)", dict(activation="gelu_tanh", gate_up_layout="interleaved"), 3),
        ("bf16 gpt-oss swiglu_oai + biases, top-3", dict(activation="swiglu_oai", gate_up_layout="interleaved",
                                                         expert_bias=True, topk=3), 3),
        ("fp8_block gpt-oss swiglu_oai + biases", dict(quant="fp8_block", activation="swiglu_oai",
                                                       gate_up_layout="interleaved", expert_bias=True), 3),
        ("bf16 S=1 shared, rsf 2.5 in the combine, top-2 (3 slots)", dict(num_fused_shared_experts=1,
                                                                          routed_scaling_factor=2.5), 3),
        ("bf16 silu T=34, top-3 (moe_sum_reduce stand-in)", dict(topk=3), 34),
        ("int4 apply_router_weight_on_input, top-1", dict(quant="int4", topk=1, apply_router_weight_on_input=True), 3),
        ("bf16 last of 2 EP ranks, S=1 shared", dict(ep_size=2, ep_rank=1, num_fused_shared_experts=1), 3),
    ]
    refused = [("mxfp4", dict(quant="mxfp4")), ("int4 + expert biases", dict(quant="int4", activation="swiglu_oai",
                                                                           gate_up_layout="interleaved", expert_bias=True)),
               ]
    g = torch.Generator().manual_seed(1)
    bf16 = torch.bfloat16
    notes = "-"

    def rel(a, b) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    for name, kw, T in cases:
        c = MoEConfig(**{**base, **kw})
        E, H, I = c.local_expert_range()[1], c.hidden_size, c.intermediate_size
        x = torch.randn(T, H, generator=g).to(bf16)
        logits = torch.randn(T, c.num_experts, generator=g)
        w13 = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(bf16)
        w2 = (torch.randn(E, H, I, generator=g) * I**-0.5).to(bf16)
        b13 = (torch.randn(E, 2 * I, generator=g) * 0.1).to(bf16) if c.expert_bias else None
        b2 = (torch.randn(E, H, generator=g) * 0.1).to(bf16) if c.expert_bias else None
        q13, s13, q2, s2 = moe_torch.quantize_layer_weights(w13, w2, c)
        ref = moe_torch.moe_forward(x, logits, q13, q2, c, w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2,
                                    implementation="reference")
        tw, ti = run_gate(logits, c, None, "reference")
        try:
            fn = sglang_fused_moe(x, tw, ti, q13, q2, c, w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2)
            out, notes = fn(), fn.notes
            err = rel(out, ref)
            if c.quant != "fp8_block":
                ok = err <= REL_ERR_MAX
                line = f"rel err {err:.2e} (max {REL_ERR_MAX:g})"
            else:  # both quantize the activations to FP8, with other roundings: judged against the float activations
                d13, d2 = (moe_torch.dequantize_weight_fp8(q, s).to(bf16) for q, s in ((q13, s13), (q2, s2)))
                exact = moe_torch.moe_forward(x, logits, d13, d2, dataclasses.replace(c, quant="none"), w13_bias=b13,
                                              w2_bias=b2, implementation="reference")
                e_sgl, e_ours = rel(out, exact), rel(ref, exact)
                ok = err <= FP8_REL_ERR_MAX and e_sgl <= 1.25 * e_ours
                line = (f"rel err {err:.2e} vs ours (max {FP8_REL_ERR_MAX:g}); from the layer on float activations: "
                        f"SGLang {e_sgl:.2e}, ours {e_ours:.2e} (max 1.25x ours)")
            ok = ok and bool(torch.isfinite(out).all())
        except Exception as exc:  # noqa: BLE001 (reported as the case's failure)
            ok, line = False, f"{type(exc).__name__}: {exc}"
        print(f"{'ok  ' if ok else 'FAIL'} {name} (E={c.num_experts}, H={H}, I={I}, T={T}): {line}")
        if not ok:
            fails.append(name)
    print("notes of the last case:", notes)
    for name, kw in refused:
        c = MoEConfig(**{**base, **kw})
        try:
            SGLangFusedMoE(torch.empty(0), torch.empty(0), c)
            fails.append(f"refusal: {name}")
            print(f"FAIL {name}: not refused")
        except NotImplementedError as exc:
            print(f"ok   {name} refused: {exc}")
    print(f"{len(fails)} failure(s)" + (f": {fails}" if fails else ""))
    return len(fails)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--selftest", action="store_true", help="check the adapter on the CPU (Triton interpreter)")
    p.add_argument("--compile", action="store_true", help="with --selftest: let torch.compile build SGLang's helpers")
    a = p.parse_args()
    if not a.selftest:
        p.print_help()
        sys.exit(0)
    sys.exit(1 if selftest(compile_helpers=a.compile) else 0)
