"""The argument rules of every public op, written once for both frameworks.

Each ``check_<op>`` raises ``ValueError`` / ``TypeError`` naming the op and the argument (see
``validation.py``) and returns what the op needs resolved (a default, a derived size). The
``api.py`` of each op in ``moe_pallas`` and ``moe_torch`` calls it first, before anything is
traced or launched, so the two backends accept and reject exactly the same inputs with the
same words.
"""

from __future__ import annotations

import numbers
from typing import Any

from moe_contract.config import ACTIVATIONS, GATE_UP_LAYOUTS, check_routing_args
from moe_contract.validation import (
    FLOAT_DTYPES,
    FP8_DTYPE,
    INT_ID_DTYPES,
    check_activation_scale,
    check_bool,
    check_choice,
    check_config,
    check_expert_biases,
    check_layer_expert_weights,
    check_dtype,
    check_nonnegative_int,
    check_per_tensor_scale,
    check_positive_int,
    check_rank,
    check_rsf,
    check_shape,
    check_weight_scale,
    dtype_name,
)

PERMUTE_QUANTS = (None, "fp8_per_token", "fp8_per_token_group", "fp8_per_tensor")
ACT_QUANTS = (None, "fp8_per_token", "fp8_per_token_group")
WEIGHT_LAYOUTS = ("per_expert", "per_channel", "block")
#: 4-bit weight formats (CONTRACT.md section 9): packed codes ``[.., N, K // 2]`` uint8, one scale per
#: group of ``W4_GROUP`` along ``K``, ``[.., N, K // 32]`` of the format's scale dtype.
W4_FORMATS = ("mxfp4", "int4")
#: What the grouped GEMM and the decode path read besides: ``"mxfp4_mma"``, MXFP4 codes in the MMA layout
#: (``moe_contract/w4_layout.py``; CONTRACT.md section 9 "MMA layout"), a load-time repack of ``"mxfp4"``'s codes.
GEMM_W4_FORMATS = (*W4_FORMATS, "mxfp4_mma")
W4_GROUP = 32
W4_SCALE_DTYPES = {"mxfp4": "uint8", "int4": "bfloat16", "mxfp4_mma": "uint8"}


def check_select_experts(
    op: str,
    router_logits: Any,
    *,
    topk: int,
    routing: str,
    num_expert_group: int | None,
    topk_group: int | None,
    e_score_correction_bias: Any,
    routed_scaling_factor: float,
    num_fused_shared_experts: int,
    renormalize: bool,
    apply_routed_scaling_factor_on_output: bool,
) -> None:
    check_bool(op, "renormalize", renormalize)
    check_bool(op, "apply_routed_scaling_factor_on_output", apply_routed_scaling_factor_on_output)
    check_rank(op, "router_logits", router_logits, 2, "[T, E]")
    check_dtype(op, "router_logits", router_logits, FLOAT_DTYPES)
    E = router_logits.shape[1]
    check_routing_args(
        op,
        num_experts=E,
        topk=topk,
        routing=routing,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        num_fused_shared_experts=num_fused_shared_experts,
    )
    if routing == "biased_grouped_topk":
        if e_score_correction_bias is None:
            raise ValueError(f"{op}: e_score_correction_bias must be given ([E={E}] float) for routing='biased_grouped_topk'; got None")
        check_shape(op, "e_score_correction_bias", e_score_correction_bias, (E,), f"[E] = ({E},)")
        check_dtype(op, "e_score_correction_bias", e_score_correction_bias, FLOAT_DTYPES)
    elif e_score_correction_bias is not None:
        raise ValueError(f"{op}: e_score_correction_bias must be None for routing={routing!r}; got an array")


def check_routing_metadata(op: str, topk_ids: Any, num_experts: int, expert_start: Any, num_local_experts: Any) -> int:
    """Returns ``num_local_experts`` (default: all experts from ``expert_start`` on)."""
    check_rank(op, "topk_ids", topk_ids, 2, "[T, topk]")
    check_dtype(op, "topk_ids", topk_ids, INT_ID_DTYPES)
    check_positive_int(op, "num_experts", num_experts)
    start_ok = not isinstance(expert_start, bool) and isinstance(expert_start, int) and 0 <= expert_start < num_experts
    if start_ok and num_local_experts is None:
        num_local_experts = num_experts - expert_start
    if start_ok:
        check_positive_int(op, "num_local_experts", num_local_experts)
    if not start_ok or expert_start + num_local_experts > num_experts:
        raise ValueError(
            f"{op}: expert_start must be an int with 0 <= expert_start and expert_start + num_local_experts "
            f"<= num_experts (={num_experts}); got expert_start={expert_start!r}, num_local_experts={num_local_experts}"
        )
    return num_local_experts


def check_permute(op: str, x: Any, dst2src: Any, topk: int, quant: str | None, group_size: int, scale: Any) -> None:
    check_rank(op, "x", x, 2, "[T, H]")
    check_dtype(op, "x", x, FLOAT_DTYPES)
    check_positive_int(op, "topk", topk)
    T, H = x.shape
    check_shape(op, "dst2src", dst2src, (T * topk,), f"[T * topk] = ({T * topk},)")
    check_dtype(op, "dst2src", dst2src, ("int32",))
    check_choice(op, "quant", quant, PERMUTE_QUANTS)
    if quant == "fp8_per_token_group":
        check_positive_int(op, "group_size", group_size)
        if H % group_size:
            raise ValueError(f"{op}: H (=x.shape[1]) must be divisible by group_size={group_size}; got H={H}")
    if quant == "fp8_per_tensor":
        check_per_tensor_scale(op, "scale", scale)
    elif scale is not None:
        raise ValueError(f"{op}: scale must be None unless quant='fp8_per_tensor' (quant={quant!r}); got an array")


def check_activation_input(op: str, x: Any) -> None:
    """``x [rows, K]`` float, the input of a dynamic or static activation quantization."""
    check_rank(op, "x", x, 2, "[rows, K]")
    check_dtype(op, "x", x, FLOAT_DTYPES)


def check_group_size(op: str, x: Any, group_size: int) -> None:
    check_positive_int(op, "group_size", group_size)
    if x.shape[1] % group_size:
        raise ValueError(f"{op}: K (=x.shape[1]) must be divisible by group_size={group_size}; got K={x.shape[1]}")


def check_fp8_activation(op: str, q: Any, scale: Any) -> None:
    check_rank(op, "q", q, 2, "[rows, K]")
    check_dtype(op, "q", q, (FP8_DTYPE,))
    check_activation_scale(op, "scale", scale, q.shape)


def check_weight(op: str, w: Any, layout: str, block: int) -> None:
    check_rank(op, "w", w, 3, "[E, N, K]")
    check_dtype(op, "w", w, FLOAT_DTYPES)
    check_choice(op, "layout", layout, WEIGHT_LAYOUTS)
    check_positive_int(op, "block", block)


def check_fp8_weight(op: str, q: Any, w_scale: Any, block: int) -> None:
    check_rank(op, "q", q, 3, "[E, N, K]")
    check_dtype(op, "q", q, (FP8_DTYPE,))
    check_positive_int(op, "block", block)
    check_weight_scale(op, "w_scale", w_scale, q.shape, block)


def _w4_scale_what(fmt: str, shape: tuple[int, ...]) -> str:
    names = "[E, N, K // 32]" if len(shape) == 3 else "[N, K // 32]"
    return f"{names} = {_shape_text(shape)} {W4_SCALE_DTYPES[fmt]} (one {fmt} scale per group of {W4_GROUP} along K)"


def _shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def check_w4_format(op: str, w_format: Any, w: Any, w_name: str = "w") -> None:
    """``w_format`` is ``"mxfp4"`` / ``"int4"`` when ``w`` is uint8 (4-bit packed codes), else ``None``."""
    if dtype_name(w) == "uint8":
        if w_format is None:
            raise ValueError(f"{op}: w_format must be one of {W4_FORMATS} for uint8 {w_name} (4-bit packed codes "
                             f"[E, N, K // 2]; or 'mxfp4_mma': MXFP4 codes in the MMA layout); got w_format=None")
        check_choice(op, "w_format", w_format, GEMM_W4_FORMATS)
    elif w_format is not None and dtype_name(w).startswith(("int", "uint")):  # codes of another integer type
        raise TypeError(f"{op}: {w_name} must have dtype uint8 for w_format={w_format!r} (4-bit packed codes, two a "
                        f"byte, [E, N, K // 2]; compressed-tensors' int32 weight_packed [N, K // 8] is these bytes: "
                        f"view it as uint8, CONTRACT.md section 9); got {w_name}.dtype={dtype_name(w)}")
    elif w_format is not None:
        raise ValueError(f"{op}: w_format must be None unless {w_name} holds 4-bit packed codes (uint8); got "
                         f"w_format={w_format!r} with {w_name}.dtype={dtype_name(w)}")


def check_w4_weight(op: str, w_q: Any, w_scale: Any, fmt: str, K: int, *, w_name: str = "w_q") -> None:
    """4-bit packed codes ``w_q [.., N, K // 2]`` uint8 with ``w_scale [.., N, K // 32]`` (uint8 for
    ``"mxfp4"`` / ``"mxfp4_mma"``, bfloat16 for ``"int4"``): CONTRACT.md section 9. ``K % 32 != 0`` is a
    ``ValueError``."""
    check_choice(op, "w_format", fmt, GEMM_W4_FORMATS)
    if K % W4_GROUP:
        raise ValueError(f"{op}: K must be a multiple of {W4_GROUP} (one {fmt} scale per group of {W4_GROUP} "
                         f"along K); got K={K}")
    lead = tuple(int(s) for s in w_q.shape[:-1])
    names = "[E, N, K // 2]" if len(lead) == 2 else "[N, K // 2]"
    check_shape(op, w_name, w_q, (*lead, K // 2),
                f"{names} = {_shape_text((*lead, K // 2))} uint8 (two 4-bit codes a byte, K={K})")
    check_dtype(op, w_name, w_q, ("uint8",))
    expected = (*lead, K // W4_GROUP)
    if w_scale is None:
        raise ValueError(f"{op}: w_scale must be given for {fmt} {w_name}: {_w4_scale_what(fmt, expected)}; got None")
    check_shape(op, "w_scale", w_scale, expected, _w4_scale_what(fmt, expected))
    if dtype_name(w_scale) != W4_SCALE_DTYPES[fmt]:
        raise TypeError(f"{op}: w_scale must have dtype {W4_SCALE_DTYPES[fmt]} for {fmt} (CONTRACT.md section 9); "
                        f"got w_scale.dtype={dtype_name(w_scale)}")


def check_quantize_weight_4bit(op: str, w: Any, fmt: str) -> None:
    """``w [E, N, K]`` or ``[N, K]`` float32 / bf16 / float16 with ``K % 32 == 0``, for ``fmt`` in
    :data:`W4_FORMATS` (CONTRACT.md section 9; non-finite values are checked on the data, by the op)."""
    check_choice(op, "w_format", fmt, W4_FORMATS)
    check_rank(op, "w", w, (2, 3), f"[E, N, K] or [N, K] with K % {W4_GROUP} == 0")
    check_dtype(op, "w", w, FLOAT_DTYPES)
    K = int(w.shape[-1])
    if K % W4_GROUP:
        raise ValueError(f"{op}: K (=w.shape[-1]) must be a multiple of {W4_GROUP} (one {fmt} scale per group of "
                         f"{W4_GROUP} along K); got w.shape={_shape_text(w.shape)}")


def check_dequantize_weight_4bit(op: str, w_q: Any, w_scale: Any, fmt: str, out_dtype: Any = "float32") -> Any:
    """``w_q [E, N, K // 2]`` (or ``[N, K // 2]``) uint8 with ``w_scale [E, N, K // 32]`` of ``fmt``'s
    scale dtype; ``K = 2 * w_q.shape[-1]`` must be a multiple of 32. Returns ``out_dtype`` (a float dtype)."""
    check_choice(op, "w_format", fmt, W4_FORMATS)
    check_rank(op, "w_q", w_q, (2, 3), "[E, N, K // 2] or [N, K // 2] uint8 (two 4-bit codes a byte)")
    check_dtype(op, "w_q", w_q, ("uint8",))
    K = 2 * int(w_q.shape[-1])
    if K % W4_GROUP:
        raise ValueError(f"{op}: w_q must be [E, N, K // 2] or [N, K // 2] uint8 with K % {W4_GROUP} == 0 (one {fmt} "
                         f"scale per group of {W4_GROUP} along K); got w_q.shape={_shape_text(w_q.shape)} (K={K})")
    if w_scale is not None:
        check_rank(op, "w_scale", w_scale, len(w_q.shape), _w4_scale_what(fmt, (*w_q.shape[:-1], K // W4_GROUP)))
    check_w4_weight(op, w_q, w_scale, fmt, K)
    check_dtype(op, "out_dtype", out_dtype, FLOAT_DTYPES)
    return out_dtype


def check_grouped_gemm(
    op: str, x: Any, w: Any, expert_offsets: Any, x_scale: Any, w_scale: Any, out_dtype: Any, w_format: Any = None,
    bias: Any = None,
) -> Any:
    """Returns the output dtype (default ``x.dtype``, or ``"bfloat16"`` for FP8 inputs).

    ``w`` is ``[E, N, K]`` of ``x``'s float dtype, float8_e4m3fn codes (with ``x`` FP8 and both scales),
    or 4-bit packed codes ``[E, N, K // 2]`` uint8 with ``w_format`` ``"mxfp4"`` / ``"int4"`` and
    ``w_scale [E, N, K // 32]`` (uint8 / bfloat16; ``x`` float, no ``x_scale``: CONTRACT.md section 9).
    ``bias`` (optional, CONTRACT.md section 4): ``[E, N]`` float32, bfloat16 or ``x``'s float dtype."""
    check_rank(op, "x", x, 2, "[M_cap, K]")
    check_dtype(op, "x", x, (*FLOAT_DTYPES, FP8_DTYPE))
    M_cap, K = x.shape
    if hasattr(w, "dtype") and (dtype_name(w) == "uint8" or w_format is not None):
        check_w4_format(op, w_format, w)
        check_rank(op, "w", w, 3, f"[E, N, K // 2] uint8 (4-bit packed codes) with K == x.shape[1] (={K})")
        out_dtype = _check_grouped_gemm_4bit(op, x, w, expert_offsets, x_scale, w_scale, out_dtype, w_format)
        check_gemm_bias(op, bias, x, int(w.shape[0]), int(w.shape[1]))
        return out_dtype
    check_rank(op, "w", w, 3, f"[E, N, K] with K == x.shape[1] (={K})")
    E, N, Kw = w.shape
    if Kw != K:
        check_shape(op, "w", w, (None, None, K), f"[E, N, K] with K == x.shape[1] (={K})")
    check_shape(op, "expert_offsets", expert_offsets, (E + 1,), f"[E + 1] = ({E + 1},) int32 for w with E={E}")
    check_dtype(op, "expert_offsets", expert_offsets, ("int32",))
    if dtype_name(x) == FP8_DTYPE:
        check_dtype(op, "w", w, (FP8_DTYPE,))
        for name, s in (("x_scale", x_scale), ("w_scale", w_scale)):
            if s is None:
                raise ValueError(f"{op}: {name} must be given for float8_e4m3fn inputs; got None")
        check_activation_scale(op, "x_scale", x_scale, (M_cap, K))
        check_weight_scale(op, "w_scale", w_scale, (E, N, K))
        out_dtype = "bfloat16" if out_dtype is None else out_dtype
    else:
        if dtype_name(w) != dtype_name(x):  # one compute dtype: the message names both sides
            raise TypeError(f"{op}: w must have dtype {dtype_name(x)} (float x and w share one dtype); got "
                            f"w.dtype={dtype_name(w)} with x.dtype={dtype_name(x)} (cast x or w)")
        for name, s in (("x_scale", x_scale), ("w_scale", w_scale)):
            if s is not None:
                raise ValueError(f"{op}: {name} must be None for {dtype_name(x)} inputs (scales are for float8_e4m3fn); got an array")
        out_dtype = x.dtype if out_dtype is None else out_dtype
    check_dtype(op, "out_dtype", out_dtype, FLOAT_DTYPES)
    check_gemm_bias(op, bias, x, E, N)
    return out_dtype


def check_gemm_bias(op: str, bias: Any, x: Any, E: int, N: int) -> None:
    """``bias`` is ``None`` or ``[E, N]`` (one row per local expert of ``w``) of dtype float32, bfloat16 or
    ``x``'s float dtype (CONTRACT.md section 4: widened exactly to float32, added before the rounding)."""
    if bias is None:
        return
    what = f"[E_local, N] = ({int(E)}, {int(N)}) (one row per expert of w [E, N, ...])"
    check_rank(op, "bias", bias, 2, what)
    check_shape(op, "bias", bias, (E, N), what)
    allowed = ("float32", "bfloat16") + ((dtype_name(x),) if dtype_name(x) == "float16" else ())
    check_dtype(op, "bias", bias, allowed)



def _check_offsets_and_float32_out(op: str, expert_offsets: Any, out_dtype: Any) -> Any:
    """``expert_offsets [E + 1]`` int32 (``E >= 0``) and a float ``out_dtype`` (default float32), returned: the
    common tail of the weight- and bias-gradient checks."""
    check_rank(op, "expert_offsets", expert_offsets, 1, "[E + 1] int32")
    if expert_offsets.shape[0] < 1:
        raise ValueError(f"{op}: expert_offsets must be [E + 1] int32 with E >= 0; got expert_offsets.shape=(0,)")
    check_dtype(op, "expert_offsets", expert_offsets, ("int32",))
    out_dtype = "float32" if out_dtype is None else out_dtype
    check_dtype(op, "out_dtype", out_dtype, FLOAT_DTYPES)
    return out_dtype

def check_grouped_gemm_dbias(op: str, d_y: Any, expert_offsets: Any, out_dtype: Any) -> Any:
    """``d_y [M_cap, N]`` float, ``expert_offsets [E + 1]`` int32 (``E >= 0``). Returns the output dtype
    (default float32)."""
    check_rank(op, "d_y", d_y, 2, "[M_cap, N]")
    check_dtype(op, "d_y", d_y, FLOAT_DTYPES)
    return _check_offsets_and_float32_out(op, expert_offsets, out_dtype)


def _check_grouped_gemm_4bit(
    op: str, x: Any, w: Any, expert_offsets: Any, x_scale: Any, w_scale: Any, out_dtype: Any, w_format: str
) -> Any:
    """:func:`check_grouped_gemm` for 4-bit ``w`` (``w`` is 3-D uint8, ``w_format`` valid)."""
    if dtype_name(x) not in FLOAT_DTYPES:
        raise TypeError(f"{op}: x must have dtype {' or '.join(FLOAT_DTYPES)} with {w_format} w (4-bit weights are "
                        f"weight-only: activations stay float); got x.dtype={dtype_name(x)}")
    K = int(x.shape[1])
    if K % W4_GROUP:
        raise ValueError(f"{op}: K (=x.shape[1]) must be a multiple of {W4_GROUP} for {w_format} w (one scale per "
                         f"group of {W4_GROUP} along K); got K={K}")
    E, N = int(w.shape[0]), int(w.shape[1])
    check_shape(op, "w", w, (None, None, K // 2),
                f"[E, N, K // 2] uint8 (two 4-bit codes a byte) with K == x.shape[1] (={K})")
    check_shape(op, "expert_offsets", expert_offsets, (E + 1,), f"[E + 1] = ({E + 1},) int32 for w with E={E}")
    check_dtype(op, "expert_offsets", expert_offsets, ("int32",))
    if x_scale is not None:
        raise ValueError(f"{op}: x_scale must be None for {w_format} w (4-bit weights are weight-only); got an array")
    if w_scale is not None:
        check_rank(op, "w_scale", w_scale, 3, _w4_scale_what(w_format, (E, N, K // W4_GROUP)))
    check_w4_weight(op, w, w_scale, w_format, K, w_name="w")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    check_dtype(op, "out_dtype", out_dtype, FLOAT_DTYPES)
    return out_dtype


def check_grouped_gemm_dgrad(op: str, d_y: Any, w: Any, expert_offsets: Any, w_scale: Any, out_dtype: Any) -> Any:
    """``d_y [M_cap, N]`` float, ``w [E, N, K]`` of ``d_y``'s dtype or float8_e4m3fn codes with ``w_scale``.
    Returns the output dtype (default ``d_y.dtype``)."""
    check_rank(op, "d_y", d_y, 2, "[M_cap, N]")
    check_dtype(op, "d_y", d_y, FLOAT_DTYPES)
    N = d_y.shape[1]
    check_rank(op, "w", w, 3, f"[E, N, K] with N == d_y.shape[1] (={N})")
    E = w.shape[0]
    if w.shape[1] != N:
        check_shape(op, "w", w, (None, N, None), f"[E, N, K] with N == d_y.shape[1] (={N})")
    check_shape(op, "expert_offsets", expert_offsets, (E + 1,), f"[E + 1] = ({E + 1},) int32 for w with E={E}")
    check_dtype(op, "expert_offsets", expert_offsets, ("int32",))
    check_dtype(op, "w", w, (dtype_name(d_y), FP8_DTYPE))
    if dtype_name(w) == FP8_DTYPE:
        if w_scale is None:
            raise ValueError(f"{op}: w_scale must be given for float8_e4m3fn w; got None")
        check_weight_scale(op, "w_scale", w_scale, tuple(w.shape))
    elif w_scale is not None:
        raise ValueError(f"{op}: w_scale must be None for {dtype_name(w)} w (scales are for float8_e4m3fn); got an array")
    out_dtype = d_y.dtype if out_dtype is None else out_dtype
    check_dtype(op, "out_dtype", out_dtype, FLOAT_DTYPES)
    return out_dtype


def check_grouped_gemm_wgrad(op: str, x: Any, d_y: Any, expert_offsets: Any, out_dtype: Any) -> Any:
    """``x [M_cap, K]`` float, ``d_y [M_cap, N]`` of ``x``'s dtype, ``expert_offsets [E + 1]`` int32.
    Returns the output dtype (default float32)."""
    check_rank(op, "x", x, 2, "[M_cap, K]")
    check_dtype(op, "x", x, FLOAT_DTYPES)
    M_cap = x.shape[0]
    check_rank(op, "d_y", d_y, 2, f"[M_cap, N] with M_cap == x.shape[0] (={M_cap})")
    if d_y.shape[0] != M_cap:
        check_shape(op, "d_y", d_y, (M_cap, None), f"[M_cap, N] with M_cap == x.shape[0] (={M_cap})")
    check_dtype(op, "d_y", d_y, (dtype_name(x),))
    return _check_offsets_and_float32_out(op, expert_offsets, out_dtype)


def check_act_and_mul(op: str, h: Any, activation: str, quant: str | None, group_size: int, out_dtype: Any,
                      layout: str = "concatenated") -> Any:
    """``h [M, 2*I]`` float, gate and up where ``layout`` says (CONTRACT.md section 4). Returns the output
    dtype (default ``h.dtype``)."""
    check_choice(op, "activation", activation, ACTIVATIONS)
    check_choice(op, "layout", layout, GATE_UP_LAYOUTS)
    check_rank(op, "h", h, 2, "[M, 2*I]")
    check_dtype(op, "h", h, FLOAT_DTYPES)
    M, two_i = h.shape
    if two_i % 2:
        raise ValueError(f"{op}: h must be [M, 2*I] with an even last dim; got h.shape=({M}, {two_i})")
    check_choice(op, "quant", quant, ACT_QUANTS)
    if quant == "fp8_per_token_group":
        check_positive_int(op, "group_size", group_size)
        if (two_i // 2) % group_size:
            raise ValueError(f"{op}: I (=h.shape[1] // 2) must be divisible by group_size={group_size}; got I={two_i // 2}")
    out_dtype = h.dtype if out_dtype is None else out_dtype
    check_dtype(op, "out_dtype", out_dtype, FLOAT_DTYPES)
    return out_dtype


def check_combine(op: str, y: Any, src2dst: Any, topk_weights: Any, routed_scaling_factor: float, out_dtype: Any) -> Any:
    """Returns the output dtype (default ``y.dtype``)."""
    check_rank(op, "y", y, 2, "[M_cap, H]")
    check_dtype(op, "y", y, FLOAT_DTYPES)
    check_rank(op, "src2dst", src2dst, 2, "[T, topk]")
    check_dtype(op, "src2dst", src2dst, ("int32",))
    T, topk = src2dst.shape
    if y.shape[0] != T * topk:
        raise ValueError(f"{op}: y must be [M_cap, H] with M_cap == T * topk (={T * topk}); got y.shape={tuple(y.shape)}")
    check_shape(op, "topk_weights", topk_weights, (T, topk), f"[T, topk] = ({T}, {topk})")
    check_dtype(op, "topk_weights", topk_weights, ("float32",))
    check_rsf(op, routed_scaling_factor)
    out_dtype = y.dtype if out_dtype is None else out_dtype
    check_dtype(op, "out_dtype", out_dtype, FLOAT_DTYPES)
    return out_dtype


def check_fused_experts_decode(
    op: str, x: Any, topk_weights: Any, topk_ids: Any, w13: Any, w2: Any, config: Any, w13_bias: Any, w2_bias: Any,
    w13_scale: Any, w2_scale: Any,
) -> None:
    """The decode path's expert part (``fused_experts_decode``): ``x [T, H]`` float, ``topk_ids [T, topk + S]`` int32 /
    int64 (global ids; ``-1`` and other ranks' experts are non-local), ``topk_weights`` of the same shape float32, the
    layer's expert weights (:func:`check_layer_expert_weights`: float of ``x``'s dtype, or 4-bit packed codes with
    their scales) and biases (given exactly when ``config.expert_bias``). What a framework's kernels do not serve
    yet is refused by its own ``fused_experts_decode``."""
    check_config(op, config)
    H, k = config.hidden_size, config.num_slots
    check_rank(op, "x", x, 2, f"[T, H] with H={H}")
    check_shape(op, "x", x, (None, H), f"[T, H] with H={H}")
    check_dtype(op, "x", x, FLOAT_DTYPES)
    T = x.shape[0]
    what = lambda: f"[T, topk + S] = ({T}, {k}) (x's tokens, config's slots)"  # noqa: E731
    check_rank(op, "topk_ids", topk_ids, 2, what)
    check_shape(op, "topk_ids", topk_ids, (T, k), what)
    check_dtype(op, "topk_ids", topk_ids, INT_ID_DTYPES)
    check_rank(op, "topk_weights", topk_weights, 2, what)
    check_shape(op, "topk_weights", topk_weights, (T, k), what)
    check_dtype(op, "topk_weights", topk_weights, ("float32",))
    check_layer_expert_weights(op, config, x, w13, w2, w13_scale, w2_scale)
    check_expert_biases(op, config, x, w13_bias, w2_bias)


# --- Backward of the non-GEMM stages (CONTRACT.md section 8) -----------------------------------------


def check_act_and_mul_backward(op: str, h: Any, d_a: Any, activation: str, out_dtype: Any,
                               layout: str = "concatenated") -> Any:
    """``h [M, 2*I]`` float (gate and up where ``layout`` says), ``d_a [M, I]`` float (any of the float
    dtypes). Returns the output dtype (default ``h.dtype``)."""
    check_choice(op, "activation", activation, ACTIVATIONS)
    check_choice(op, "layout", layout, GATE_UP_LAYOUTS)
    check_rank(op, "h", h, 2, "[M, 2*I]")
    check_dtype(op, "h", h, FLOAT_DTYPES)
    M, two_i = h.shape
    if two_i % 2:
        raise ValueError(f"{op}: h must be [M, 2*I] with an even last dim; got h.shape=({M}, {two_i})")
    check_shape(op, "d_a", d_a, (M, two_i // 2), f"[M, I] = ({M}, {two_i // 2}) for h [M, 2*I]")
    check_dtype(op, "d_a", d_a, FLOAT_DTYPES)
    out_dtype = h.dtype if out_dtype is None else out_dtype
    check_dtype(op, "out_dtype", out_dtype, FLOAT_DTYPES)
    return out_dtype


def check_combine_backward(
    op: str, d_out: Any, y: Any, src2dst: Any, topk_weights: Any, routed_scaling_factor: float
) -> None:
    """The forward's rules for ``y``, ``src2dst``, ``topk_weights`` and ``rsf``; ``d_out [T, H]`` float."""
    check_combine(op, y, src2dst, topk_weights, routed_scaling_factor, None)
    T, H = src2dst.shape[0], y.shape[1]
    check_shape(op, "d_out", d_out, (T, H), f"[T, H] = ({T}, {H})")
    check_dtype(op, "d_out", d_out, FLOAT_DTYPES)


def check_permute_backward(op: str, d_xp: Any, src2dst: Any, num_tokens: Any, out_dtype: Any) -> Any:
    """``d_xp [M_cap, H]`` float with ``M_cap == T * topk``, ``src2dst [T, topk]`` int32; ``num_tokens``
    ``None`` or ``T``. Returns the output dtype (default ``d_xp.dtype``)."""
    check_rank(op, "d_xp", d_xp, 2, "[M_cap, H]")
    check_dtype(op, "d_xp", d_xp, FLOAT_DTYPES)
    check_rank(op, "src2dst", src2dst, 2, "[T, topk]")
    check_dtype(op, "src2dst", src2dst, ("int32",))
    T, topk = src2dst.shape
    if d_xp.shape[0] != T * topk:
        raise ValueError(f"{op}: d_xp must be [M_cap, H] with M_cap == T * topk (={T * topk}); "
                         f"got d_xp.shape=({d_xp.shape[0]}, {d_xp.shape[1]})")
    if num_tokens is not None:
        check_nonnegative_int(op, "num_tokens", num_tokens)
        if num_tokens != T:
            raise ValueError(f"{op}: num_tokens must be None or T = src2dst.shape[0] (={T}); got num_tokens={num_tokens}")
    out_dtype = d_xp.dtype if out_dtype is None else out_dtype
    check_dtype(op, "out_dtype", out_dtype, FLOAT_DTYPES)
    return out_dtype


def check_select_experts_backward(
    op: str, router_logits: Any, topk_ids: Any, d_topk_weights: Any, **gate_kwargs: Any
) -> None:
    """The forward's rules (``gate_kwargs``: every ``select_experts`` keyword but ``implementation``);
    ``topk_ids`` int32 / int64 and ``d_topk_weights`` float32, both ``[T, topk + S]``."""
    check_select_experts(op, router_logits, **gate_kwargs)
    T = router_logits.shape[0]
    width = gate_kwargs["topk"] + gate_kwargs["num_fused_shared_experts"]
    what = f"[T, topk + num_fused_shared_experts] = ({T}, {width})"
    check_shape(op, "topk_ids", topk_ids, (T, width), what)
    check_dtype(op, "topk_ids", topk_ids, INT_ID_DTYPES)
    check_shape(op, "d_topk_weights", d_topk_weights, (T, width), what)
    check_dtype(op, "d_topk_weights", d_topk_weights, ("float32",))


def check_router_losses(op: str, router_logits: Any, topk_ids: Any, config: Any, seq_len: Any) -> None:
    """``router_losses`` (CONTRACT.md section 10): ``router_logits [T, E]`` float (``E = config.num_experts``),
    ``topk_ids [T, topk]`` or ``[T, topk + S]`` int32 / int64 (the gate's ids; the routed ``topk`` columns are
    read), ``seq_len`` ``None`` or an int >= 1 dividing ``T`` (sequences of equal length)."""
    check_config(op, config)
    E, k, S = config.num_experts, config.topk, config.num_fused_shared_experts
    check_rank(op, "router_logits", router_logits, 2, f"[T, E] with E = config.num_experts = {E}")
    check_shape(op, "router_logits", router_logits, (None, E), f"[T, E] with E = config.num_experts = {E}")
    check_dtype(op, "router_logits", router_logits, FLOAT_DTYPES)
    T = int(router_logits.shape[0])
    widths = (k,) if S == 0 else (k, k + S)
    what = (f"[T, topk] = ({T}, {k})" if S == 0 else
            f"[T, topk] = ({T}, {k}) or [T, topk + num_fused_shared_experts] = ({T}, {k + S})")
    check_rank(op, "topk_ids", topk_ids, 2, what)
    if int(topk_ids.shape[0]) != T or int(topk_ids.shape[1]) not in widths:
        raise ValueError(f"{op}: topk_ids must be {what}; got topk_ids.shape={_shape_text(topk_ids.shape)}")
    check_dtype(op, "topk_ids", topk_ids, INT_ID_DTYPES)
    check_seq_len(op, seq_len, T)


def check_seq_len(op: str, seq_len: Any, T: int) -> None:
    """``seq_len``: ``None`` or an int >= 1 that divides ``T`` into sequences of equal length (the
    sequence-wise loss, CONTRACT.md section 10)."""
    if seq_len is None:
        return
    check_positive_int(op, "seq_len", seq_len)
    if T % seq_len:
        raise ValueError(f"{op}: seq_len must divide T (={T}) into sequences of equal length (T % seq_len == 0); "
                         f"got seq_len={seq_len}")


def check_router_loss_option(op: str, config: Any, router_logits: Any, return_router_losses: Any,
                             seq_len: Any) -> None:
    """A layer's ``return_router_losses`` (a bool) and ``seq_len`` (given only with ``return_router_losses=True``;
    :func:`check_seq_len` against ``router_logits``' ``T``), before the layer computes anything."""
    check_bool(op, "return_router_losses", return_router_losses)
    if seq_len is not None and not return_router_losses:
        raise ValueError(f"{op}: seq_len is read only with return_router_losses=True (the sequence-wise loss); "
                         f"got seq_len={seq_len!r} with return_router_losses=False")
    if return_router_losses:
        check_seq_len(op, seq_len, int(router_logits.shape[0]))


def check_update_expert_bias(op: str, bias: Any, tokens_per_expert: Any, update_rate: Any) -> None:
    """``update_expert_bias`` (CONTRACT.md section 10): ``bias [E]`` float32, ``tokens_per_expert [E]`` or
    ``[N, E]`` (``N`` layer calls' counts, summed) int32 / int64 / float32, ``update_rate`` a finite real >= 0."""
    check_rank(op, "bias", bias, 1, "[E] float32 (e_score_correction_bias)")
    # float32 only: an update of 1e-3 is below bf16's half-ulp at 1, so a bf16 bias would not move
    check_dtype(op, "bias", bias, ("float32",))
    E = int(bias.shape[0])
    what = f"[E] or [N, E] with E = bias.shape[0] = {E} (counts of one or N layer calls)"
    check_rank(op, "tokens_per_expert", tokens_per_expert, (1, 2), what)
    if int(tokens_per_expert.shape[-1]) != E:
        raise ValueError(f"{op}: tokens_per_expert must be {what}; "
                         f"got tokens_per_expert.shape={_shape_text(tokens_per_expert.shape)}")
    check_dtype(op, "tokens_per_expert", tokens_per_expert, (*INT_ID_DTYPES, "float32"))
    u = update_rate
    if isinstance(u, bool) or not isinstance(u, numbers.Real) or not 0.0 <= float(u) < float("inf"):
        raise ValueError(f"{op}: update_rate must be a finite real >= 0 (a Python or numpy scalar); "
                         f"got update_rate={u!r}")
