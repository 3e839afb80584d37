"""Host-side input validation shared by both backends.

Every public op of ``moe_pallas`` and ``moe_torch`` validates its inputs here, on the
host, before tracing or launching anything. The checks look only at ``.shape`` and
``.dtype`` (which jax arrays, jax tracers, torch tensors and numpy arrays all have), so
one implementation serves both frameworks and the error messages are the same word for
word whichever backend raised them.

Message format, for every op: ``<op>: <arg> must be <expectation>; got <what came>``.
``ValueError`` for shapes and values, ``TypeError`` for dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from moe_contract.config import W4_QUANTS, MoEConfig
from moe_contract.scalar_checks import (  # noqa: F401  (re-exported: the ops import them from here)
    check_bool,
    check_choice,
    check_nonnegative_int,
    check_positive_int,
    check_rsf,
)

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
FP8_DTYPE = "float8_e4m3fn"
INT_ID_DTYPES = ("int32", "int64")


def dtype_name(x: Any) -> str:
    """The dtype of ``x`` as a framework-neutral name: ``'bfloat16'``, ``'float8_e4m3fn'``...

    Works for jax arrays and tracers, numpy arrays, torch tensors, and dtype objects
    themselves (``jnp.bfloat16``, ``torch.float32``, ``np.dtype``).
    """
    if isinstance(x, str):
        return x
    if isinstance(x, type):  # a scalar type: np.float32, jnp.bfloat16 (np.dtype knows them all)
        import numpy as np

        return np.dtype(x).name
    dt = getattr(x, "dtype", x)
    name = getattr(dt, "name", None)  # numpy / jax dtypes
    if isinstance(name, str):
        return name
    text = str(dt)
    return text[len("torch."):] if text.startswith("torch.") else text


def _fmt_shape(shape: Sequence[Any]) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _described(what: str | Callable[[], str]) -> str:
    """A check's description of the expected array: a string, or a function making it (formatted only for an
    error: under ``torch.compile`` a size may be symbolic, and a string built from it would end the graph)."""
    return what() if callable(what) else what


def check_rank(op: str, name: str, x: Any, ndim: int | Iterable[int], what: str | Callable[[], str]) -> None:
    """Raise ``ValueError`` unless ``x.ndim`` is ``ndim`` (or one of them); ``TypeError`` if ``x`` is no array."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{op}: {name} must be an array {_described(what)}; got {type(x).__name__}")
    allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if len(x.shape) not in allowed:
        raise ValueError(f"{op}: {name} must be {_described(what)}; got {name}.shape={_fmt_shape(x.shape)}")


def check_shape(op: str, name: str, x: Any, expected: Sequence[int | None], what: str | Callable[[], str]) -> None:
    """Raise ``ValueError`` unless ``x.shape`` matches ``expected`` (``None`` = any size). The sizes are compared
    as they are (a symbolic size under ``torch.compile`` stays symbolic: no specialization to one value)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{op}: {name} must be an array {_described(what)}; got {type(x).__name__}")
    shape = tuple(x.shape)
    ok = len(shape) == len(expected) and all(e is None or s == e for s, e in zip(shape, expected))
    if not ok:
        raise ValueError(f"{op}: {name} must be {_described(what)}; got {name}.shape={_fmt_shape(shape)}")


def check_dtype(op: str, name: str, x: Any, allowed: Iterable[str]) -> None:
    """Raise ``TypeError`` unless ``x``'s dtype name is in ``allowed``."""
    allowed = tuple(allowed)
    got = dtype_name(x)
    if got not in allowed:
        raise TypeError(f"{op}: {name} must have dtype {' or '.join(allowed)}; got {name}.dtype={got}")


def stage_implementation(implementation: str | None, stage_api, fallback: str | None = None) -> str | None:
    """A layer's ``implementation`` for one stage: itself if the stage's api module lists it in
    ``IMPLEMENTATIONS``, else ``fallback`` (``None``: the stage's default). Framework-neutral: both
    layers, both EP layers and the cross-check pick their stages' backends with it."""
    return implementation if implementation in stage_api.IMPLEMENTATIONS else fallback


def check_ids_in_range(op: str, name: str, ids_host: Any, num_experts: int) -> None:
    """The checked mode: raise ``ValueError`` if any id (a numpy array) is outside ``[0, E)``."""
    if ids_host.size == 0:
        return
    lo, hi = int(ids_host.min()), int(ids_host.max())
    if lo < 0 or hi >= num_experts:
        bad = ids_host[(ids_host < 0) | (ids_host >= num_experts)]
        raise ValueError(
            f"{op}: {name} must lie in [0, E) = [0, {num_experts}); got {bad.size} ids outside it, "
            f"e.g. {int(bad.flat[0])}"
        )


def check_offsets_values(op: str, offsets: Sequence[int], m_cap: int) -> None:
    """The references' check of ``expert_offsets``' values (host ints, ``[E_local + 1]``): ``ValueError`` unless
    they are non-decreasing within ``[0, M_cap]`` (CONTRACT.md section 4). The kernels take them unchecked (the
    values would need a host sync there) and their result is then undefined."""
    offsets = [int(v) for v in offsets]
    for i, v in enumerate(offsets):
        if v < 0 or v > m_cap or (i and v < offsets[i - 1]):
            shown = "[" + ", ".join(map(str, offsets[:16])) + (", ...]" if len(offsets) > 16 else "]")
            why = (f"offsets[{i}] = {v} < offsets[{i - 1}] = {offsets[i - 1]}" if 0 <= v <= m_cap
                   else f"offsets[{i}] = {v} outside [0, {m_cap}]")
            raise ValueError(f"{op}: expert_offsets must be non-decreasing and within [0, M_cap] = [0, {m_cap}] "
                             f"(start at >= 0, end at <= M_cap); got {shown} ({why})")


def check_activation_scale(op: str, name: str, scale: Any, x_shape: tuple[int, ...]) -> None:
    """An activation scale for ``x [rows, K]``: ``[]``, ``[rows, 1]`` or ``[rows, K // G]`` float32."""
    rows, K = x_shape
    what = f"[] (per-tensor), [rows, 1] (per-token) or [rows, K // G] (per-token-group) float32 for x of shape ({rows}, {K})"
    check_rank(op, name, scale, (0, 2), what)
    check_dtype(op, name, scale, ("float32",))
    if scale.ndim == 2:
        check_shape(op, name, scale, (rows, None), what)
        groups = scale.shape[1]
        if groups == 0 or K % groups:
            raise ValueError(f"{op}: {name} must be {what}; got {name}.shape={tuple(scale.shape)}")


def check_weight_scale(op: str, name: str, w_scale: Any, w_shape: tuple[int, int, int], block: int = 128) -> None:
    """A weight scale for ``w [E, N, K]``: ``[E]``, ``[E, N]`` or ``[E, ceil(N/128), ceil(K/128)]`` float32."""
    E, N, K = w_shape
    nb, kb = -(-N // block), -(-K // block)
    what = f"[E] = ({E},), [E, N] = ({E}, {N}) or [E, ceil(N/{block}), ceil(K/{block})] = ({E}, {nb}, {kb}) float32"
    check_rank(op, name, w_scale, (1, 2, 3), what)
    expected = {1: (E,), 2: (E, N), 3: (E, nb, kb)}[w_scale.ndim]
    check_shape(op, name, w_scale, expected, what)
    check_dtype(op, name, w_scale, ("float32",))


def check_per_tensor_scale(op: str, name: str, scale: Any) -> None:
    """A static per-tensor scale: shape ``()`` or ``(1,)``, float32."""
    what = "a per-tensor scale of shape () or (1,)"
    if scale is None:
        raise ValueError(f"{op}: {name} must be {what}, float32; got None")
    if not hasattr(scale, "shape"):
        raise TypeError(f"{op}: {name} must be {what}, a float32 array; got {type(scale).__name__} {scale!r}")
    if tuple(scale.shape) not in ((), (1,)):
        raise ValueError(f"{op}: {name} must be {what}; got {name}.shape={_fmt_shape(scale.shape)}")
    check_dtype(op, name, scale, ("float32",))


def check_config(op: str, config: Any) -> None:
    """``config`` must be a :class:`moe_contract.MoEConfig`."""
    if not isinstance(config, MoEConfig):
        raise TypeError(f"{op}: config must be a MoEConfig; got {type(config).__name__} {config!r}")


def check_layer_weights(op: str, config: Any, w13: Any, w2: Any) -> None:
    """Float weights ``w13 [E_local, 2*I, H]``, ``w2 [E_local, H, I]`` for ``config`` (before quantization)."""
    check_config(op, config)
    H, I = config.hidden_size, config.intermediate_size
    _, e_local = config.local_expert_range()
    check_rank(op, "w13", w13, 3, f"[E_local, 2*I, H] = ({e_local}, {2 * I}, {H}) (this rank's experts)")
    check_shape(op, "w13", w13, (e_local, 2 * I, H), f"[E_local, 2*I, H] = ({e_local}, {2 * I}, {H}) (this rank's experts)")
    check_rank(op, "w2", w2, 3, f"[E_local, H, I] = ({e_local}, {H}, {I}) (this rank's experts)")
    check_shape(op, "w2", w2, (e_local, H, I), f"[E_local, H, I] = ({e_local}, {H}, {I}) (this rank's experts)")
    check_dtype(op, "w13", w13, FLOAT_DTYPES)
    check_dtype(op, "w2", w2, FLOAT_DTYPES)


def check_layer_inputs(
    op: str, config: Any, x: Any, router_logits: Any, w13: Any, w2: Any, w13_scale: Any, w2_scale: Any
) -> None:
    """The MoE layer's arrays against its ``MoEConfig`` (this rank's experts: ``E_local``)."""
    check_config(op, config)
    H, E = config.hidden_size, config.num_experts
    check_rank(op, "x", x, 2, f"[T, H] with H={H}")
    check_shape(op, "x", x, (None, H), f"[T, H] with H={H}")
    check_dtype(op, "x", x, FLOAT_DTYPES)
    T = x.shape[0]
    check_shape(op, "router_logits", router_logits, (T, E), lambda: f"[T, E] = ({T}, {E})")
    check_dtype(op, "router_logits", router_logits, FLOAT_DTYPES)
    check_layer_expert_weights(op, config, x, w13, w2, w13_scale, w2_scale)


def check_layer_expert_weights(op: str, config: Any, x: Any, w13: Any, w2: Any, w13_scale: Any, w2_scale: Any) -> None:
    """The layer's expert weights and their scales against ``config`` and ``x`` (this rank's experts: ``E_local``):
    float ``w13 [E_local, 2*I, H]`` / ``w2 [E_local, H, I]`` of ``x``'s dtype and no scales (``quant='none'``), FP8
    codes with their scales, or 4-bit packed codes with their group scales (CONTRACT.md section 9). ``x`` and
    ``config`` are checked by the caller (:func:`check_layer_inputs`, the decode path's checks)."""
    H, I = config.hidden_size, config.intermediate_size
    _, e_local = config.local_expert_range()
    if config.quant in W4_QUANTS:
        _check_w4_layer_weights(op, config, e_local, w13, w2, w13_scale, w2_scale)
        return
    check_shape(op, "w13", w13, (e_local, 2 * I, H), f"[E_local, 2*I, H] = ({e_local}, {2 * I}, {H}) (this rank's experts)")
    check_shape(op, "w2", w2, (e_local, H, I), f"[E_local, H, I] = ({e_local}, {H}, {I}) (this rank's experts)")
    if config.quant == "none":
        if dtype_name(w13) == dtype_name(w2) != dtype_name(x):  # the weights agree: x is the odd one out
            raise TypeError(f"{op}: x must have dtype {dtype_name(w13)} (quant='none': x, w13 and w2 share one "
                            f"dtype; the weights are {dtype_name(w13)}); got x.dtype={dtype_name(x)}")
        for name, w in (("w13", w13), ("w2", w2)):
            if dtype_name(w) != dtype_name(x):  # one compute dtype: the message names both sides
                raise TypeError(f"{op}: {name} must have dtype {dtype_name(x)} (quant='none': x, w13 and w2 share one "
                                f"dtype); got {name}.dtype={dtype_name(w)}")
        for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
            if s is not None:
                raise ValueError(f"{op}: {name} must be None for quant='none'; got an array")
        return
    for name, w, s in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        check_dtype(op, name, w, (FP8_DTYPE,))
        if s is None:
            raise ValueError(f"{op}: {name}_scale must be given for quant={config.quant!r}; got None")
        check_weight_scale(op, f"{name}_scale", s, tuple(w.shape))
        if config.quant == "fp8_per_token" and len(s.shape) == 3:
            raise ValueError(
                f"{op}: {name}_scale must be per-expert [E_local] or per-channel [E_local, N] scales for "
                f"quant='fp8_per_token' (block scales go with quant='fp8_block'); got {name}_scale.shape={_fmt_shape(s.shape)}"
            )
        if config.quant == "fp8_block" and len(s.shape) != 3:
            raise ValueError(
                f"{op}: {name}_scale must be 128x128 block scales [E_local, ceil(N/128), ceil(K/128)] for "
                f"quant='fp8_block'; got {name}_scale.shape={_fmt_shape(s.shape)}"
            )


#: The dtype of a 4-bit layer's weight scales, per quant mode (CONTRACT.md section 9).
W4_SCALE_DTYPE = {"mxfp4": "uint8", "int4": "bfloat16"}


def _check_w4_layer_weights(op: str, config: Any, e_local: int, w13: Any, w2: Any, w13_scale: Any, w2_scale: Any) -> None:
    """A 4-bit layer's weights (CONTRACT.md section 9, ``config.quant`` ``"mxfp4"`` / ``"int4"``): packed codes
    ``w13 [E_local, 2*I, H // 2]`` / ``w2 [E_local, H, I // 2]`` uint8 with scales ``[E_local, 2*I, H // 32]`` /
    ``[E_local, H, I // 32]`` (uint8 e8m0 for mxfp4, bf16 for int4), as :func:`quantize_layer_weights` makes them."""
    H, I, fmt = config.hidden_size, config.intermediate_size, config.quant
    for name, w, s, N, K in (("w13", w13, w13_scale, 2 * I, H), ("w2", w2, w2_scale, H, I)):
        packed = (e_local, N, K // 2)
        check_shape(op, name, w, packed, f"[E_local, {'2*I, H' if name == 'w13' else 'H, I'} // 2] = "
                                         f"{_fmt_shape(packed)} uint8 ({fmt} packed codes, two a byte; this rank's experts)")
        check_dtype(op, name, w, ("uint8",))
        groups = (e_local, N, K // 32)
        what = (f"[E_local, {'2*I, H' if name == 'w13' else 'H, I'} // 32] = {_fmt_shape(groups)} {W4_SCALE_DTYPE[fmt]} "
                f"(one {fmt} scale per group of 32 along K)")
        if s is None:
            raise ValueError(f"{op}: {name}_scale {what} must be given for quant={fmt!r}; got None")
        check_rank(op, f"{name}_scale", s, 3, what)
        check_shape(op, f"{name}_scale", s, groups, what)
        check_dtype(op, f"{name}_scale", s, (W4_SCALE_DTYPE[fmt],))


def _check_bias_pair(op: str, config: Any, w13_bias: Any, w2_bias: Any, rows: int, rows_name: str, whose: str,
                     dtypes: tuple[str, ...], hf_words: bool) -> None:
    """``w13_bias [rows, 2*I]`` and ``w2_bias [rows, H]``, given exactly when ``config.expert_bias`` (ValueError
    naming the argument either way), of a dtype in ``dtypes`` (TypeError); ``hf_words``: the messages name gpt-oss's
    tensors. Shared by :func:`check_expert_biases` (this rank's) and :func:`check_global_biases` (every expert's)."""
    H, I = config.hidden_size, config.intermediate_size
    for name, b, N, hf in (("w13_bias", w13_bias, 2 * I, "gate_up_proj_bias"), ("w2_bias", w2_bias, H, "down_proj_bias")):
        what = f"[{rows_name}, {'2*I' if name == 'w13_bias' else 'H'}] = ({rows}, {N}) ({whose})"
        if not config.expert_bias:
            if b is not None:
                note = " (gpt-oss's per-expert biases)" if hf_words else ""
                raise ValueError(f"{op}: {name} must be None unless config.expert_bias=True{note}; got an array "
                                 f"with config.expert_bias=False")
            continue
        if b is None:
            note = f" (gpt-oss's {hf})" if hf_words else ""
            raise ValueError(f"{op}: {name} {what} must be given for config.expert_bias=True{note}; got None")
        check_rank(op, name, b, 2, what)
        check_shape(op, name, b, (rows, N), what)
        check_dtype(op, name, b, dtypes)


def check_expert_biases(op: str, config: Any, x: Any, w13_bias: Any, w2_bias: Any) -> None:
    """The layer inputs ``w13_bias [E_local, 2*I]`` and ``w2_bias [E_local, H]`` (gpt-oss's ``gate_up_proj_bias`` /
    ``down_proj_bias``, this rank's experts; CONTRACT.md section 4): given exactly when ``config.expert_bias``
    (ValueError naming the argument either way), float32, bfloat16 or ``x``'s float dtype (TypeError)."""
    _, e_local = config.local_expert_range()
    _check_bias_pair(op, config, w13_bias, w2_bias, e_local, "E_local", "this rank's experts",
                     tuple(dict.fromkeys(("float32", "bfloat16", dtype_name(x)))), hf_words=True)


def check_shared_expert_gate_logits(op: str, config: Any, x: Any, logits: Any) -> None:
    """The layer input ``shared_expert_gate_logits`` (Qwen3-Next's shared-expert gate, CONTRACT.md section 1):
    ``[T, S]`` float32 or ``x``'s dtype exactly when ``config.shared_expert_gate``, else ``None``
    (ValueError naming it either way; TypeError for its dtype)."""
    name = "shared_expert_gate_logits"
    if not config.shared_expert_gate:
        if logits is not None:
            raise ValueError(f"{op}: {name} must be None unless config.shared_expert_gate=True (the fused shared "
                             f"experts are then weighted by sigmoid(logit)); got an array with "
                             f"config.shared_expert_gate=False")
        return
    if logits is None:
        raise ValueError(f"{op}: {name} [T, S] must be given for config.shared_expert_gate=True (the fused shared "
                         f"experts' weight is sigmoid(logit)); got None")
    T, S = x.shape[0], config.num_fused_shared_experts
    what = lambda: f"[T, S] = ({T}, {S}) (one logit per token and fused shared expert)"  # noqa: E731
    check_rank(op, name, logits, 2, what)
    check_shape(op, name, logits, (T, S), what)
    check_dtype(op, name, logits, tuple(dict.fromkeys(("float32", dtype_name(x)))))


def check_shared_expert_gate_weight(op: str, config: Any, weight: Any) -> None:
    """A module's ``shared_expert_gate`` weight: ``[1, H]`` (transformers' ``shared_expert_gate.weight``: one
    gate for the whole shared MLP, i.e. for all ``S`` fused shared slots) or ``[S, H]`` (one per slot), float,
    exactly when ``config.shared_expert_gate``, else ``None`` (ValueError; TypeError for its dtype)."""
    name = "shared_expert_gate"
    if not config.shared_expert_gate:
        if weight is not None:
            raise ValueError(f"{op}: {name} must be None unless config.shared_expert_gate=True; got an array with "
                             f"config.shared_expert_gate=False")
        return
    H, S = config.hidden_size, config.num_fused_shared_experts
    what = f"[1, H] = (1, {H}) or [S, H] = ({S}, {H}) (transformers' shared_expert_gate.weight)"
    if weight is None:
        raise ValueError(f"{op}: {name} {what} must be given for config.shared_expert_gate=True; got None")
    check_rank(op, name, weight, 2, what)
    if len(weight.shape) != 2 or int(weight.shape[0]) not in (1, S) or int(weight.shape[1]) != H:
        raise ValueError(f"{op}: {name} must be {what}; got {name}.shape={_fmt_shape(weight.shape)}")
    check_dtype(op, name, weight, FLOAT_DTYPES)


def check_global_biases(op: str, config: MoEConfig, w13_bias, w2_bias) -> None:
    """Expert biases of every expert: ``w13_bias [E + S, 2*I]``, ``w2_bias [E + S, H]`` float (before slicing),
    exactly when ``config.expert_bias`` (ValueError naming the argument either way; TypeError for dtypes)."""
    _check_bias_pair(op, config, w13_bias, w2_bias, config.num_total_experts, "E + S", "every expert of the layer",
                     FLOAT_DTYPES, hf_words=False)
