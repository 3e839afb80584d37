"""The torch grouped GEMM's kernels as named choices (``moe_contract.selection.KernelRegistry``).

``grouped_gemm(..., implementation=name)`` runs one of them by name; ``implementation=None`` (or ``"triton"``) lets
the library choose among them (:func:`default_kernel`: the device's tuned table, then the measured rules below).

========================  =====================================================================================
name                      serves
========================  =====================================================================================
``gluon_fp8_block``       sm_90, FP8 ``x`` with 1 x 128 group scales and ``w`` with 128 x 128 block scales
                          (DeepSeek-V3), bf16 out, no bias (``gluon.py: grouped_gemm_gluon_fp8_block``)
``gluon_fp8_rowwise``     sm_90, FP8 per-token ``x`` scales x per-channel ``w`` scales, bf16 out, no bias
                          (``gluon.py: grouped_gemm_gluon_fp8_rowwise``)
``gluon_bf16``            sm_90, bf16 / fp16 ``x``, ``w`` and out of one dtype, no scales, no bias
                          (``gluon_bf16.py: grouped_gemm_gluon_bf16``)
``triton_tma``            sm_90 or newer, 16-bit or FP8 inputs without bias or 4-bit weights, 16-byte aligned
                          rows (``triton.py``, ``GroupedGemmConfig.tma``)
``triton_pointer``        every request on any CUDA GPU Triton supports (FP8 from sm_89) and in the interpreter
                          (``triton.py``, pointer loads): the portable path
========================  =====================================================================================

Mirror: ``moe_pallas/ops/grouped_gemm/kernels.py``.
"""

from __future__ import annotations

import dataclasses

import torch

from moe_contract.selection import DeviceSpec, KernelChoice, KernelRegistry
from moe_torch.ops.device import device_spec
from moe_torch.ops.quant.reference import FP8_DTYPE

OP = "grouped_gemm"


@dataclasses.dataclass(frozen=True)
class GemmRequest:
    """One forward request as the kernels' ``supported_on`` see it: the validated arguments of
    :func:`moe_torch.ops.grouped_gemm.api.grouped_gemm` (tensors are only inspected on the host: shapes, dtypes,
    strides, devices; never read)."""

    x: torch.Tensor
    w: torch.Tensor
    expert_offsets: torch.Tensor
    x_scale: torch.Tensor | None
    w_scale: torch.Tensor | None
    out_dtype: torch.dtype
    w_format: str | None = None
    bias: torch.Tensor | None = None

    @property
    def args(self) -> tuple:
        return (self.x, self.w, self.expert_offsets, self.x_scale, self.w_scale, self.out_dtype)


def _hopper(spec: DeviceSpec | None) -> str | None:
    if spec is None:
        return "needs a CUDA device of compute capability 9.0 (sm_90); got tensors off CUDA"
    if not spec.is_hopper:
        return f"needs compute capability 9.0 (sm_90: wgmma, TMA, setmaxnreg); got {spec.arch}"
    return None


def _refusal(check, *args) -> str | None:
    """``check(*args)``'s refusal as a string (``None`` where it accepts)."""
    try:
        check(*args)
    except (TypeError, ValueError, NotImplementedError) as exc:
        return str(exc)
    return None


def _gluon_fp8(spec: DeviceSpec | None, r: GemmRequest, layout_ok: bool, layout: str, check: str) -> str | None:
    """What both FP8 Gluon kernels ask: sm_90, their scale ``layout`` (``layout_ok``), no bias or 4-bit weights,
    and nothing ``gluon.py``'s ``check`` function refuses."""
    why = _hopper(spec)
    if why:
        return why
    if not layout_ok:
        return f"serves FP8 x and w with {layout} only"
    if r.w_format is not None or r.bias is not None:
        return "serves no bias and no 4-bit weights"
    try:
        from moe_torch.ops.grouped_gemm import gluon
    except ImportError as exc:
        return f"triton's Gluon is not importable ({exc})"
    return _refusal(getattr(gluon, check), *r.args)


def _gluon_fp8_block(spec: DeviceSpec | None, r: GemmRequest) -> str | None:
    from moe_torch.ops.grouped_gemm.config import W_SCALE_BLOCK

    K, xs, ws = r.x.shape[1], r.x_scale, r.w_scale
    ok = (xs is not None and ws is not None and xs.ndim == 2 and ws.ndim == 3 and K % W_SCALE_BLOCK == 0
          and xs.shape[1] == K // W_SCALE_BLOCK)
    return _gluon_fp8(spec, r, ok, "1 x 128 group scales [M_cap, K / 128] for x and 128 x 128 block scales for w",
                      "check_inputs")


def _gluon_fp8_rowwise(spec: DeviceSpec | None, r: GemmRequest) -> str | None:
    xs, ws = r.x_scale, r.w_scale
    ok = (xs is not None and ws is not None and tuple(xs.shape) == (r.x.shape[0], 1)
          and tuple(ws.shape) == tuple(r.w.shape[:2]))
    return _gluon_fp8(spec, r, ok, "per-token scales [M_cap, 1] for x and per-channel scales [E, N] for w",
                      "check_inputs_rowwise")


def _gluon_bf16(spec: DeviceSpec | None, r: GemmRequest) -> str | None:
    why = _hopper(spec)
    if why:
        return why
    if r.x_scale is not None or r.w_scale is not None or r.w_format is not None or r.bias is not None:
        return "serves 16-bit x and w without scales, bias or 4-bit weights only"
    if r.x.dtype not in (torch.bfloat16, torch.float16) or r.out_dtype != r.x.dtype:
        return f"serves bf16 / fp16 x with out_dtype the same dtype; got x {r.x.dtype}, out_dtype {r.out_dtype}"
    try:
        from moe_torch.ops.grouped_gemm.gluon_bf16 import check_inputs
    except ImportError as exc:
        return f"triton's Gluon is not importable ({exc})"
    return _refusal(check_inputs, r.x, r.w, r.expert_offsets)


def _triton_tma(spec: DeviceSpec | None, r: GemmRequest) -> str | None:
    if spec is None:
        return "needs a CUDA device of compute capability 9.0 or newer (TMA); got tensors off CUDA"
    if spec.capability < (9, 0):
        return f"needs compute capability 9.0 or newer (TMA); got {spec.arch}"
    if r.w_format is not None or r.bias is not None or r.x.dtype == torch.float32:
        return "serves 16-bit and FP8 inputs without bias or 4-bit weights only"
    from moe_torch.ops.grouped_gemm.triton import TMA_ALIGN_BYTES

    for name, t, stride in (("x", r.x, r.x.stride(0)), ("w", r.w, r.w.stride(1))):
        if t.data_ptr() % TMA_ALIGN_BYTES or (stride * t.element_size()) % TMA_ALIGN_BYTES:
            return f"needs {TMA_ALIGN_BYTES}-byte aligned base addresses and row strides; got {name}"
    return None


def _triton_pointer(spec: DeviceSpec | None, r: GemmRequest) -> str | None:
    from moe_torch.ops.grouped_gemm.triton import _grouped_gemm_kernel
    from moe_torch.ops.triton_common import is_interpreted

    if spec is None:
        if not is_interpreted(_grouped_gemm_kernel):
            return "needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is imported)"
        return None
    if spec.capability < (8, 0):
        return f"needs compute capability 8.0 or newer; got {spec.arch}"
    if r.x.dtype == FP8_DTYPE and spec.capability < (8, 9):
        return f"FP8 inputs need compute capability 8.9 or newer; got {spec.arch}"
    return None


#: The forward's kernels, in the order the default tries them after the tuned table and the measured rules.
KERNELS = KernelRegistry(OP, [
    KernelChoice("gluon_fp8_block", _gluon_fp8_block, "warp-specialized Gluon kernel, FP8 1x128 / 128x128 blocks"),
    KernelChoice("gluon_fp8_rowwise", _gluon_fp8_rowwise, "warp-specialized Gluon kernel, FP8 per token x channel"),
    KernelChoice("gluon_bf16", _gluon_bf16, "warp-specialized Gluon kernel, 16-bit"),
    KernelChoice("triton_tma", _triton_tma, "Triton, TMA loads (tensor descriptors)"),
    KernelChoice("triton_pointer", _triton_pointer, "Triton, pointer loads: every request, every GPU"),
])
#: The names ``grouped_gemm(implementation=...)`` takes besides ``"triton"`` and ``"reference"``.
NAMES = KERNELS.names()


def _spec(x: torch.Tensor) -> DeviceSpec | None:
    return device_spec(x.device) if x.is_cuda else None


def supported(name: str, r: GemmRequest) -> str | None:
    """Why kernel ``name`` cannot serve ``r`` on its tensors' device (``None``: it can)."""
    return KERNELS.choices[name].supported_on(_spec(r.x), r)


def default_kernel(r: GemmRequest) -> str:
    """The kernel ``implementation=None`` / ``"triton"`` runs ``r`` on, as :func:`triton.grouped_gemm_triton` decides
    it without a config (the switches, the device's tuned table, the measured row thresholds), named."""
    from moe_torch.ops.grouped_gemm import triton as T

    a = (*r.args, r.w_format, r.bias)
    if T.gluon_fp8_block_eligible(*a):
        return "gluon_fp8_block"
    if T.gluon_fp8_rowwise_eligible(*a):
        return "gluon_fp8_rowwise"
    if T.gluon_bf16_options(*a) is not None:
        return "gluon_bf16"
    return "triton_tma" if T.default_triton_config(*a).tma else "triton_pointer"


def run(name: str, r: GemmRequest) -> torch.Tensor:
    """``y [M_cap, N]`` from kernel ``name``, asked for by the caller: ``NotImplementedError`` naming the device and
    the reason where it cannot serve ``r`` (before any launch); ``ValueError`` for an unknown name. The kernel's
    options are the default's (tuned table, else measured defaults)."""
    KERNELS.check(name, _spec(r.x), r)
    from moe_torch.ops.grouped_gemm import triton as T

    x, w, offs, xs, ws, out_dtype = r.args
    if name == "gluon_fp8_block":
        from moe_torch.ops.grouped_gemm.gluon import grouped_gemm_gluon_fp8_block

        return grouped_gemm_gluon_fp8_block(x, w, offs, xs, ws, out_dtype, **T.gluon_fp8_block_options(*x.shape[:1],
                                                                                                       w.shape[0]))
    if name == "gluon_fp8_rowwise":
        from moe_torch.ops.grouped_gemm.gluon import grouped_gemm_gluon_fp8_rowwise

        return grouped_gemm_gluon_fp8_rowwise(x, w, offs, xs, ws, out_dtype, num_stages=T.GLUON_ROWWISE_STAGES,
                                              block_n=T.GLUON_ROWWISE_BLOCK_N, promote=T.GLUON_ROWWISE_PROMOTE)
    if name == "gluon_bf16":
        from moe_torch.ops.grouped_gemm.gluon_bf16 import dispatch_options, grouped_gemm_gluon_bf16

        tuned = T.tuned_bf16_options(x, w)
        return grouped_gemm_gluon_bf16(x, w, offs, **dispatch_options(tuned, w.shape[1]))
    cfg = T.default_triton_config(*r.args, r.w_format, r.bias)
    cfg = T.as_tma(cfg) if name == "triton_tma" else dataclasses.replace(cfg, tma=False, warp_specialize=False)
    return T.grouped_gemm_triton(*r.args, config=cfg, w_format=r.w_format, bias=r.bias)


def explain(r: GemmRequest) -> dict[str, str | None]:
    """Every kernel's refusal of ``r`` on its device (``None`` where it serves), and ``"default"``: the kernel
    ``implementation="triton"`` runs ``r`` on (on CUDA tensors also ``None``'s choice; on CPU tensors ``None`` runs
    the reference)."""
    reasons = {name: supported(name, r) for name in NAMES}
    reasons["default"] = default_kernel(r)
    return reasons


# ------------------------------------------------------------------------------------------------- the backward


@dataclasses.dataclass(frozen=True)
class DgradRequest:
    """A dgrad ``d_x = d_y @ w[e]`` request (``grouped_gemm_dgrad``'s validated arguments)."""

    d_y: torch.Tensor
    w: torch.Tensor
    expert_offsets: torch.Tensor
    w_scale: torch.Tensor | None
    out_dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class WgradRequest:
    """A wgrad ``d_w[e] = d_y[rows(e)].T @ x[rows(e)]`` request (``grouped_gemm_wgrad``'s validated arguments)."""

    x: torch.Tensor
    d_y: torch.Tensor
    expert_offsets: torch.Tensor
    out_dtype: torch.dtype


def _dgrad_gluon(spec: DeviceSpec | None, r: DgradRequest) -> str | None:
    why = _hopper(spec)
    if why:
        return why
    if r.w_scale is not None or r.d_y.dtype not in (torch.bfloat16, torch.float16) or r.out_dtype != r.d_y.dtype:
        return "serves 16-bit d_y and w of one dtype (no FP8 weights) with out_dtype that dtype only"
    try:
        from moe_torch.ops.grouped_gemm.gluon_bf16 import check_inputs_dgrad
    except ImportError as exc:
        return f"triton's Gluon is not importable ({exc})"
    return _refusal(check_inputs_dgrad, r.d_y, r.w, r.expert_offsets)


def _dgrad_tma(spec: DeviceSpec | None, r: DgradRequest) -> str | None:
    why = _triton_tma(spec, GemmRequest(r.d_y, r.w, r.expert_offsets, None, None, r.out_dtype))
    if why:
        return why
    if r.w.dtype == FP8_DTYPE:
        return "serves 16-bit weights only (FP8 weights are dequantized per element: the pointer kernel)"
    return None


def _dgrad_pointer(spec: DeviceSpec | None, r: DgradRequest) -> str | None:
    return _triton_pointer(spec, GemmRequest(r.d_y, r.w, r.expert_offsets, None, None, r.out_dtype))


def _wgrad_gluon(spec: DeviceSpec | None, r: WgradRequest) -> str | None:
    why = _hopper(spec)
    if why:
        return why
    try:
        from moe_torch.ops.grouped_gemm.gluon_backward import check_inputs
    except ImportError as exc:
        return f"triton's Gluon is not importable ({exc})"
    return _refusal(check_inputs, r.x, r.d_y, r.expert_offsets, r.out_dtype)


def _wgrad_pointer(spec: DeviceSpec | None, r: WgradRequest) -> str | None:
    return _triton_pointer(spec, GemmRequest(r.x, r.d_y, r.expert_offsets, None, None, r.out_dtype))


#: The dgrad's kernels (``grouped_gemm_dgrad(..., implementation=name)``).
DGRAD_KERNELS = KernelRegistry("grouped_gemm_dgrad", [
    KernelChoice("gluon_bf16", _dgrad_gluon, "warp-specialized Gluon kernel, 16-bit (w read MN-major)"),
    KernelChoice("triton_tma", _dgrad_tma, "Triton, TMA loads"),
    KernelChoice("triton_pointer", _dgrad_pointer, "Triton, pointer loads: every request, every GPU"),
])
#: The wgrad's kernels (``grouped_gemm_wgrad(..., implementation=name)``).
WGRAD_KERNELS = KernelRegistry("grouped_gemm_wgrad", [
    KernelChoice("gluon_bf16", _wgrad_gluon, "warp-specialized Gluon kernel, 16-bit"),
    KernelChoice("triton_pointer", _wgrad_pointer, "Triton, pointer loads: every request, every GPU"),
])


def run_dgrad(name: str, r: DgradRequest) -> torch.Tensor:
    """``d_x [M_cap, K]`` from dgrad kernel ``name`` (``NotImplementedError`` with the reason where it cannot serve)."""
    DGRAD_KERNELS.check(name, _spec(r.d_y), r)
    from moe_torch.ops.grouped_gemm import triton_backward as B

    if name == "gluon_bf16":
        from moe_torch.ops.grouped_gemm.gluon_bf16 import DGRAD_DISPATCH_OPTIONS, grouped_gemm_gluon_dgrad

        return grouped_gemm_gluon_dgrad(r.d_y, r.w, r.expert_offsets, **DGRAD_DISPATCH_OPTIONS)
    from moe_torch.ops.grouped_gemm.triton import as_tma

    cfg = B.default_dgrad_config(r.d_y, r.w, r.w_scale, r.out_dtype)
    cfg = as_tma(cfg) if name == "triton_tma" else dataclasses.replace(cfg, tma=False, warp_specialize=False)
    return B.grouped_gemm_dgrad_triton(r.d_y, r.w, r.expert_offsets, r.w_scale, r.out_dtype, config=cfg)


def run_wgrad(name: str, r: WgradRequest) -> torch.Tensor:
    """``d_w [E, N, K]`` from wgrad kernel ``name`` (``NotImplementedError`` with the reason where it cannot serve)."""
    WGRAD_KERNELS.check(name, _spec(r.x), r)
    if name == "gluon_bf16":
        from moe_torch.ops.grouped_gemm.gluon_backward import grouped_gemm_gluon_wgrad, tuned_wgrad_options

        options = tuned_wgrad_options(r.x, r.d_y, r.expert_offsets, r.out_dtype) or {}
        return grouped_gemm_gluon_wgrad(r.x, r.d_y, r.expert_offsets, r.out_dtype, **options)
    from moe_torch.ops.grouped_gemm.triton_backward import grouped_gemm_wgrad_triton

    return grouped_gemm_wgrad_triton(r.x, r.d_y, r.expert_offsets, r.out_dtype)
