"""What the Triton backends of ``moe_torch`` share: the pre-launch device check, and the FP8
quantization step of CONTRACT.md section 3 as ``@triton.jit`` helpers.

Mirror: ``moe_pallas/ops/quant/pallas_triton.py`` (the JAX kernels' FP8 division: by default on sm_90+ the same
``div.rn.f32`` as here; the repaired quotient in interpret mode or with ``EPMOE_PALLAS_DIV_RN=0``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moe_contract.env import env_switch
from moe_torch.ops import triton_interpret
from moe_torch.ops.quant.reference import AMAX_FLOOR, FP8_MAX, INV_FP8_MAX

# Under TRITON_INTERPRET=1, make the interpreter's casts and dots exact before any kernel of ours runs
# (moe_torch/ops/triton_interpret.py says what triton 3.6 gets wrong there).
triton_interpret.install()

FP8_MAX_C = tl.constexpr(FP8_MAX)
#: float32 values (exactly representable), as in ``moe_torch/ops/quant/reference.py``.
AMAX_FLOOR_C = tl.constexpr(AMAX_FLOOR)
INV_FP8_MAX_C = tl.constexpr(INV_FP8_MAX)

#: Environment switch, read when a Triton grouped GEMM (forward or dgrad) is launched (:func:`aligned_tiles_enabled`):
#: unset or 1/true/on/yes (the default) gives each expert its own row tiles ``[s_e + j * BLOCK_M, ...)``
#: (moe_torch/ops/grouped_gemm/triton.py, ``_expert_row_tiles``: no tile spent on the few rows an expert shares with a
#: neighbour); 0/false/off/no keeps the global ``t * BLOCK_M`` grid. The default because the torch layers were faster
#: or level with it at every measured shape (BENCHMARKS.md).
#: Mirror: ``EPMOE_PALLAS_ALIGNED_TILES`` (moe_pallas/ops/common.py).
ALIGNED_TILES_ENV = "EPMOE_TRITON_ALIGNED_TILES"


def aligned_tiles_enabled() -> bool:
    """:data:`ALIGNED_TILES_ENV` read now: unset, empty or 1/true/on/yes -> True; 0/false/off/no -> False (any case,
    spaces ignored). Raises ValueError for any other value, naming the variable."""
    return env_switch(ALIGNED_TILES_ENV, True, "row tiles on the global grid", "expert-aligned row tiles, the default")


#: Environment switch, read at each launch of a torch grouped GEMM with FP8 1 x 128 activation groups and 128 x 128
#: weight blocks (DeepSeek-V3) and no explicit config (:func:`gluon_fp8_block_enabled`): unset or 1/true/on/yes (the
#: default) runs it, where it can (``moe_torch/ops/grouped_gemm/triton.py: gluon_fp8_block_eligible``: sm_90, bf16
#: out, no bias, contiguous, at least ``GLUON_MIN_ROWS`` rows and ``GLUON_MIN_ROWS_PER_EXPERT`` a local expert), on the
#: warp-specialized Gluon kernel with the promotion off the critical path (``moe_torch/ops/grouped_gemm/gluon.py``);
#: 0/false/off/no keeps the Triton kernel.
GLUON_FP8_BLOCK_ENV = "EPMOE_TRITON_GLUON_FP8_BLOCK"


def gluon_fp8_block_enabled() -> bool:
    """:data:`GLUON_FP8_BLOCK_ENV` read now: unset, empty or 1/true/on/yes -> True; 0/false/off/no -> False (any case,
    spaces ignored). Raises ValueError for any other value, naming the variable."""
    return env_switch(GLUON_FP8_BLOCK_ENV, True, "the Triton kernel for FP8 blocks", "the Gluon kernel for FP8 blocks")


#: Environment switch, read at each launch of a torch grouped GEMM with FP8 per-token activation scales ``[M_cap, 1]``
#: and per-channel weight scales ``[E, N]`` and no explicit config (:func:`gluon_fp8_rowwise_enabled`): unset or
#: 1/true/on/yes (the default) runs it, where it can (``moe_torch/ops/grouped_gemm/triton.py:
#: gluon_fp8_rowwise_eligible``: sm_90, bf16 out, no bias, contiguous, at least ``GLUON_MIN_ROWS`` rows and
#: ``GLUON_MIN_ROWS_PER_EXPERT`` a local expert), on the
#: warp-specialized Gluon kernel (``moe_torch/ops/grouped_gemm/gluon.py: grouped_gemm_gluon_fp8_rowwise``, promotion
#: every ``GLUON_ROWWISE_PROMOTE`` K blocks); 0/false/off/no keeps the Triton kernel.
GLUON_FP8_ROWWISE_ENV = "EPMOE_TRITON_GLUON_FP8_ROWWISE"


def gluon_fp8_rowwise_enabled() -> bool:
    """:data:`GLUON_FP8_ROWWISE_ENV` read now: unset, empty or 1/true/on/yes -> True (the default); 0/false/off/no ->
    False (any case, spaces ignored). Raises ValueError for any other value, naming the variable."""
    return env_switch(GLUON_FP8_ROWWISE_ENV, True, "the Triton kernel for FP8 per-token x per-channel",
                      "the Gluon kernel for FP8 per-token x per-channel")


#: Environment switch, read at each launch of a torch ``grouped_gemm_wgrad`` on the Triton backend
#: (:func:`gluon_wgrad_enabled`): unset, empty or 1/true/on/yes (the default) runs it, where it can
#: (``moe_torch/ops/grouped_gemm/gluon_backward.py: gluon_wgrad_eligible``: bf16 / fp16 inputs, ``N % 128 == 0``,
#: ``K % 256 == 0``, contiguous, sm_90), on the warp-specialized Gluon wgrad kernel (``gluon_backward.py``: faster
#: than the Triton wgrad and cuBLAS's at the measured shapes, BENCHMARKS.md); 0/false/off/no keeps the Triton kernel.
GLUON_WGRAD_ENV = "EPMOE_TRITON_GLUON_WGRAD"


def gluon_wgrad_enabled() -> bool:
    """:data:`GLUON_WGRAD_ENV` read now: unset, empty or 1/true/on/yes -> True (the default); 0/false/off/no -> False
    (any case, spaces ignored). Raises ValueError for any other value, naming the variable."""
    return env_switch(GLUON_WGRAD_ENV, True, "the Triton wgrad kernel", "the Gluon wgrad kernel")


#: Environment switch, read at each launch of a torch ``grouped_gemm_dgrad`` on the Triton backend without an explicit
#: config (:func:`tma_dgrad_enabled`): unset, empty or 1/true/on/yes (the default) runs 16-bit ``d_y``
#: and ``w`` on sm_90 at ``M_cap >= DGRAD_TMA_MIN_ROWS`` (or a tuned TMA entry, ``tuned/sm90.json``) through the
#: dgrad's TMA variant (``moe_torch/ops/grouped_gemm/config.py: grouped_gemm_dgrad_config``; ``triton_backward.py``,
#: "TMA variant"); 0/false/off/no keeps the pointer loads (the same tiles and launch order, or the tuned entry's
#: ``pointer_config``). On by default because the TMA loads beat the pointer loads on both of the layer's dgrads,
#: with the heuristic's tiles and the tuned ones (BENCHMARKS.md).
TMA_DGRAD_ENV = "EPMOE_TRITON_TMA_DGRAD"


def tma_dgrad_enabled() -> bool:
    """:data:`TMA_DGRAD_ENV` read now: unset, empty or 1/true/on/yes -> True (the default); 0/false/off/no -> False
    (any case, spaces ignored). Raises ValueError for any other value, naming the variable."""
    return env_switch(TMA_DGRAD_ENV, True, "the dgrad's pointer loads", "the dgrad's TMA variant where it serves")


#: Environment switch (three states), read at each launch of a torch grouped GEMM with 16-bit ``x`` and ``w`` and no
#: explicit config (:func:`gluon_bf16_switch`; ``moe_torch/ops/grouped_gemm/triton.py: gluon_bf16_options``), for the
#: requests the warp-specialized Gluon kernel serves (``gluon_bf16.py: forward_eligible``: sm_90, bf16 / fp16 in and
#: out, no scales, no bias, contiguous, ``K % 8 == 0``, at least ``GLUON_MIN_ROWS`` rows and
#: ``GLUON_MIN_ROWS_PER_EXPERT`` a local expert): unset or empty (the default) runs the kernel the device's tuned
#: forward entry measured faster (``config.py: tuned_forward_kernel``: ``"kernel": "gluon"`` with its
#: ``"gluon_config"``; Triton without an entry, or with one tuned before the choice); 1/true/on/yes runs the Gluon
#: kernel (``gluon_bf16.py: grouped_gemm_gluon_bf16``, the entry's Gluon options or ``DISPATCH_OPTIONS``) wherever it
#: serves; 0/false/off/no keeps the Triton kernel. The choice is per shape because neither kernel wins everywhere
#: (Gluon the down forward, Triton gate_up's: BENCHMARKS.md).
GLUON_BF16_ENV = "EPMOE_TRITON_GLUON_BF16"
_GLUON_BF16_MEANS = ("the Triton kernel for 16-bit inputs", "the Gluon kernel for 16-bit inputs where it serves")


def gluon_bf16_switch() -> bool | None:
    """:data:`GLUON_BF16_ENV` read now: unset, empty or spaces -> None (the tuned table chooses); 1/true/on/yes ->
    True (forced on); 0/false/off/no -> False (forced off); any case, spaces ignored. Raises ValueError for any other
    value, naming the variable."""
    raw = os.environ.get(GLUON_BF16_ENV)
    if raw is None or not raw.strip():
        return None
    return env_switch(GLUON_BF16_ENV, False, *_GLUON_BF16_MEANS)


def gluon_bf16_enabled() -> bool:
    """Whether :data:`GLUON_BF16_ENV` forces the Gluon kernel on, read now: 1/true/on/yes -> True; unset, empty or
    0/false/off/no -> False (any case, spaces ignored); :func:`gluon_bf16_switch` is the three-state reading (unset:
    the tuned table's choice), which the dispatch uses. Raises ValueError for any other value, naming the variable."""
    return env_switch(GLUON_BF16_ENV, False, *_GLUON_BF16_MEANS)


#: Environment switch, read at each launch of a torch ``grouped_gemm_dgrad`` on the Triton backend without an explicit
#: config (:func:`gluon_dgrad_enabled`): 1/true/on/yes runs 16-bit ``d_y`` and ``w`` (out dtype the same) where it
#: can (``moe_torch/ops/grouped_gemm/triton_backward.py: gluon_dgrad_eligible``: sm_90, no ``w_scale``, ``N % 64 ==
#: 0``, ``K % 8 == 0``, contiguous, enough rows as :data:`GLUON_BF16_ENV`) on the Gluon kernel of ``gluon_bf16.py``
#: (``grouped_gemm_gluon_dgrad``: ``w [E, N, K]`` read as MN-major ``wgmma`` operands); unset, empty or
#: 0/false/off/no (the default) keeps the Triton dgrad. Off by default: level with the tuned Triton TMA dgrad, not
#: faster (BENCHMARKS.md).
GLUON_DGRAD_ENV = "EPMOE_TRITON_GLUON_DGRAD"


def gluon_dgrad_enabled() -> bool:
    """:data:`GLUON_DGRAD_ENV` read now: 1/true/on/yes -> True; unset, empty or 0/false/off/no -> False (the default;
    any case, spaces ignored). Raises ValueError for any other value, naming the variable."""
    return env_switch(GLUON_DGRAD_ENV, False, "the Triton dgrad kernel", "the Gluon dgrad kernel where it serves")


#: CUDA's limit on grid axis 1 (axis 0 goes to 2**31 - 1 and carries the rows).
MAX_GRID_AXIS_1 = 65535


@triton.jit
def fp8_scale(amax):
    """``max(amax, 1e-10) * float32(1/448)``: the dequantization multiplier of a row or group."""
    return tl.maximum(amax, AMAX_FLOOR_C) * INV_FP8_MAX_C


@triton.jit
def quantize_fp8_tile(
    x,  # [BLOCK_M, BLOCK_N] float32
    scale,  # [BLOCK_M] float32 dequantization multiplier (or a broadcast scalar)
):
    """``cast_rne(clamp(div_rn(x, scale), -448, 448))`` -> float8_e4m3fn (CONTRACT.md section 3)."""
    x, s = tl.broadcast(x, scale[:, None])
    q = tl.math.div_rn(x, s)  # IEEE division: plain `/` is approximate on the GPU
    q = tl.clamp(q, -FP8_MAX_C, FP8_MAX_C, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, as torch.clamp
    return q.to(tl.float8e4nv)  # round to nearest even (cvt.rn.satfinite.e4m3x2.f32)


def is_interpreted(kernel) -> bool:
    """``True`` if ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (it then runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_triton_device(op: str, device: torch.device, kernel, needs_fp8: bool = False,
                        quantizes_fp8: bool = False) -> None:
    """``NotImplementedError`` if ``kernel`` cannot run on ``device``: CPU tensors without the
    interpreter, a float8_e4m3fn conversion on a GPU older than sm_89 (Ada / Hopper), or (``quantizes_fp8``: the
    kernel casts float32 quotients to FP8 codes; implies ``needs_fp8``) a GPU older than sm_90, where Triton 3.6's cast rounds twice
    (0.3% of codes off in an emulation); the dispatch then falls back to the reference.

    Under the interpreter it (re)installs the exact casts and dots of ``triton_interpret`` first, so
    every interpreted launch of a ``moe_torch`` kernel computes what the GPU does."""
    if is_interpreted(kernel):
        triton_interpret.install()
    if device.type != "cuda" and not is_interpreted(kernel):
        raise NotImplementedError(
            f"{op}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is imported); "
            f"got tensors on {device}"
        )
    if (needs_fp8 or quantizes_fp8) and device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise NotImplementedError(f"{op}: float8_e4m3fn conversion needs sm_89 or newer; got sm_{cap[0]}{cap[1]}")
        if quantizes_fp8 and cap < (9, 0):
            raise NotImplementedError(
                f"{op}: FP8 quantization in the Triton kernel needs sm_90 or newer: Triton lowers the float32 -> "
                f"float8_e4m3fn cast on sm_{cap[0]}{cap[1]} through float16 rounded toward zero, then to e4m3 (two "
                f"roundings: not the contract's cast_rne); got sm_{cap[0]}{cap[1]}")
