"""Tuning, framework-free: the problems ``epmoe tune`` measures and how its entries join a user's table.

Both frameworks' tuners (``moe_torch/ops/grouped_gemm/tune.py``, ``moe_pallas/ops/grouped_gemm/tune.py``) time
the grouped GEMMs of one MoE layer on the GPU they run on. What they share lives here, free of torch and jax:

* the problems: a layer's two grouped GEMMs (:func:`gemm_shapes`: ``gate_up`` ``w [E, 2 * I, H]``, ``down``
  ``w [E, H, I]``, ``E`` the experts of one rank) from a preset (:func:`preset_shapes`) or a checkpoint's
  ``config.json`` (:func:`checkpoint_shapes`), and the rows per expert of a routing (:func:`group_sizes`);
* the command line's lists (:func:`parse_ops`, :func:`parse_dtypes`, :func:`parse_ms`, :func:`parse_routings`),
  each raising ``ValueError`` naming the option;
* the table: every entry names the architecture and device kind it was measured on (:func:`stamp`); new entries
  replace the stored ones of the same problem (:func:`merge_key`, :func:`merge_entries`) and the whole table is
  validated before it is written (:func:`write_tuned_table`, through :func:`moe_contract.selection.write_table`)
  to ``<user cache>/tuned/<framework>/<arch>/<device kind>.json`` (:func:`tuned_table_path`), never into the
  installed package.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterable, Sequence

import numpy as np

from moe_contract import selection
from moe_contract.presets import get_preset

#: The frameworks with a tuner; each writes its own table (``selection.user_tuned_dir(framework)``).
FRAMEWORKS = ("torch", "jax")
#: Input dtypes a forward entry is tuned for: ``bf16``; ``fp8`` (per-token x per-output-channel scales);
#: ``fp8_block`` (DeepSeek-V3's 1 x 128 activation groups x 128 x 128 weight blocks). The backward is bf16 only.
DTYPES = ("bf16", "fp8", "fp8_block")
#: The ops a tuner times: the forward, the backward's ``d_x = d_y @ w[e]`` and ``d_w[e] = d_y[rows(e)].T @ x[rows(e)]``.
OPS = ("fwd", "dgrad", "wgrad")
#: Rows per expert the configs are timed on: ``uniform`` (``M / E`` each) or a ``zipf`` draw (ragged, some empty).
ROUTINGS = ("uniform", "zipf")
#: Zipf exponent of the expert popularity (rank r gets p ~ r^-ZIPF_S): with s=1.2 and E=32 the
#: top expert takes ~25% of the rows and the tail experts few or none at M=256.
ZIPF_S = 1.2
#: ``epmoe tune``'s default rows (``M``, all the rank's experts together): a prefill-sized and a training-sized batch.
DEFAULT_MS = (2048, 16384)


def group_sizes(M: int, E: int, routing: str, seed: int = 0) -> np.ndarray:
    """Rows per expert, ``[E]`` int64 summing to ``M``; deterministic in ``(M, E, routing, seed)``.

    ``uniform``: ``M // E`` each, the remainder one each to the first experts. ``zipf``: a
    multinomial draw of ``M`` rows over Zipf(ZIPF_S) popularities assigned to experts in a seeded
    random order (so the heavy expert is not always expert 0); experts may get no row.
    Raises ``ValueError`` for another ``routing``.
    """
    if routing == "uniform":
        sizes = np.full(E, M // E, dtype=np.int64)
        sizes[: M % E] += 1
        return sizes
    if routing == "zipf":
        rng = np.random.default_rng(seed)
        p = np.arange(1, E + 1, dtype=np.float64) ** -ZIPF_S
        p = rng.permutation(p / p.sum())
        return rng.multinomial(M, p).astype(np.int64)
    raise ValueError(f"group_sizes: routing must be one of {ROUTINGS}; got routing={routing!r}")


# ------------------------------------------------------------------------------------------------ option lists


def _names(text: str, option: str, allowed: Sequence[str]) -> list[str]:
    """A non-empty comma list of ``allowed`` (order kept, duplicates dropped); ``ValueError`` naming ``option`` and
    the unknown names otherwise."""
    names = list(dict.fromkeys(n.strip() for n in str(text).split(",") if n.strip()))
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        raise ValueError(f"{option}: a comma list of {', '.join(allowed)}; got {text!r}"
                         + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return names


def parse_ops(text: str) -> list[str]:
    """``--ops``: a non-empty comma list of :data:`OPS` (order kept, duplicates dropped); ``ValueError`` naming the
    unknown ones otherwise."""
    return _names(text, "--ops", OPS)


def parse_dtypes(text: str) -> list[str]:
    """``--dtypes``: a non-empty comma list of :data:`DTYPES`; ``ValueError`` naming the unknown ones otherwise."""
    return _names(text, "--dtypes", DTYPES)


def parse_routings(text: str) -> list[str]:
    """``--routings``: a non-empty comma list of :data:`ROUTINGS`; ``ValueError`` otherwise."""
    routings = [r.strip() for r in str(text).split(",") if r.strip()]
    if not routings or set(routings) - set(ROUTINGS):
        raise ValueError(f"--routings: a comma list of {', '.join(ROUTINGS)}; got {text!r}")
    return routings


def parse_ms(text: str) -> list[int]:
    """``--ms``: a non-empty comma list of row counts, ints >= 1 (order kept, duplicates dropped); ``ValueError``
    naming the bad value otherwise."""
    out = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        try:
            m = int(part)
        except ValueError:
            m = 0
        if m < 1:
            raise ValueError(f"--ms: a comma list of row counts (ints >= 1); got {text!r} ({part!r} is not)")
        out.append(m)
    if not out:
        raise ValueError(f"--ms: a comma list of row counts (ints >= 1); got {text!r}")
    return list(dict.fromkeys(out))


# ------------------------------------------------------------------------------------------------ the problems


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmShape:
    """One grouped GEMM of a layer: ``y [M, N] = x [M, K] @ w[e].T`` with ``w [E, N, K]`` (``E``: the experts of
    one rank). ``name``: ``"gate_up"`` or ``"down"``."""

    name: str
    N: int
    K: int
    E: int

    def __post_init__(self):
        for key in ("N", "K", "E"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GemmShape {self.name}: {key} must be an int >= 1; got {value!r}")

    def describe(self) -> str:
        """``"gate_up: w [E=32, N=4096, K=7168]"``."""
        return f"{self.name}: w [E={self.E}, N={self.N}, K={self.K}]"


def gemm_shapes(hidden_size: int, intermediate_size: int, num_experts: int, ep_size: int = 1) -> tuple[GemmShape, ...]:
    """The layer's two grouped GEMMs: ``gate_up`` (``N = 2 * I``, ``K = H``) and ``down`` (``N = H``, ``K = I``), over
    ``E = num_experts / ep_size`` experts (one rank's routed experts; the fused shared experts, every token's rows,
    are left out: their rows are not routed). Raises ``ValueError`` if ``ep_size`` does not divide ``num_experts``."""
    if not isinstance(ep_size, int) or ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"--ep-size: must be an int >= 1 dividing the {num_experts} experts; got {ep_size!r}")
    E = num_experts // ep_size
    return (GemmShape(name="gate_up", N=2 * intermediate_size, K=hidden_size, E=E),
            GemmShape(name="down", N=hidden_size, K=intermediate_size, E=E))


def preset_shapes(name: str, ep_size: int = 1) -> tuple[GemmShape, ...]:
    """:func:`gemm_shapes` of preset ``name`` (``moe_contract/presets.py``); ``ValueError`` for an unknown name."""
    p = get_preset(name)
    return gemm_shapes(p.hidden_size, p.intermediate_size, p.num_experts, ep_size)


#: config.json ``model_type`` -> its keys of (experts, hidden size, expert intermediate size), as the checkpoint reader
#: (``interop/checkpoints.py``) reads them; Llama 4's are under ``text_config``.
HF_SIZE_KEYS = {
    "mixtral": ("num_local_experts", "hidden_size", "intermediate_size"),
    "qwen3_moe": ("num_experts", "hidden_size", "moe_intermediate_size"),
    "deepseek_v3": ("n_routed_experts", "hidden_size", "moe_intermediate_size"),
    "kimi_k2": ("n_routed_experts", "hidden_size", "moe_intermediate_size"),
    "glm4_moe": ("n_routed_experts", "hidden_size", "moe_intermediate_size"),
    "qwen3_next": ("num_experts", "hidden_size", "moe_intermediate_size"),
    "llama4": ("num_local_experts", "hidden_size", "intermediate_size"),
    "llama4_text": ("num_local_experts", "hidden_size", "intermediate_size"),
    "gpt_oss": ("num_local_experts", "hidden_size", "intermediate_size"),
}


#: model_type -> size key -> the other name transformers' config class takes for it (its ``attribute_map``):
#: ``save_pretrained`` writes Qwen3-MoE's ``num_experts`` as ``num_local_experts``, and either is read.
HF_SIZE_ALIASES = {
    "mixtral": {"num_local_experts": "num_experts"},
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "gpt_oss": {"num_local_experts": "num_experts"},
    "deepseek_v3": {"n_routed_experts": "num_local_experts"},
    "kimi_k2": {"n_routed_experts": "num_local_experts"},
    "glm4_moe": {"n_routed_experts": "num_local_experts"},
}


def config_sizes(raw: dict, path: str = "config.json") -> tuple[int, int, int]:
    """``(H, I, E)`` of a checkpoint's ``config.json`` (``raw``, read from ``path``): hidden size, expert
    intermediate size, routed experts, by its ``model_type`` (:data:`HF_SIZE_KEYS`). Raises ``ValueError`` naming
    the file and the key for an unknown ``model_type`` or a key that is absent or not an int >= 1."""
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must hold a JSON object; got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in HF_SIZE_KEYS:
        raise ValueError(f"{path}: model_type must be one of {tuple(HF_SIZE_KEYS)}; got {model_type!r}")
    if model_type == "llama4":
        raw, path = raw.get("text_config"), f"{path}: text_config"
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: must be an object (Llama 4's text model keys)")
    e_key, h_key, i_key = HF_SIZE_KEYS[model_type]
    values = []
    for key in (h_key, i_key, e_key):
        alias = HF_SIZE_ALIASES.get(model_type, {}).get(key)
        if key not in raw and alias in raw:  # the name the file has, in the messages too
            key = alias
        v = raw.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{path}: key {key!r} must be an int >= 1 (model_type {model_type!r}); got {v!r}")
        values.append(v)
    return tuple(values)


def checkpoint_config_path(path: str) -> str:
    """The ``config.json`` of a checkpoint folder (or of the folder of a checkpoint file). Raises
    ``FileNotFoundError`` naming the path when the folder or its ``config.json`` does not exist."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file or folder: {path!r}")
    cfg = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg):
        raise FileNotFoundError(f"no config.json in {folder!r} (the GEMM shapes come from the model's config.json)")
    return cfg


def checkpoint_shapes(path: str, ep_size: int = 1) -> tuple[GemmShape, ...]:
    """:func:`gemm_shapes` of the checkpoint at ``path`` (a folder, or a file in it) from its ``config.json``
    (:func:`config_sizes`; the tensors are not read). Raises ``FileNotFoundError`` (no folder, no config.json),
    ``ValueError`` (invalid JSON, a missing or bad key)."""
    cfg = checkpoint_config_path(path)
    with open(cfg) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{cfg}: not valid JSON ({exc})") from exc
    H, I, E = config_sizes(raw, cfg)
    return gemm_shapes(H, I, E, ep_size)


class Deadline:
    """``--max-minutes``: :meth:`passed` once that many minutes went by (never for ``None``)."""

    def __init__(self, minutes: float | None):
        self.end = None if minutes is None else time.time() + 60 * minutes

    def passed(self) -> bool:
        return self.end is not None and time.time() > self.end


# ------------------------------------------------------------------------------------------------ the table


def stamp(entry: dict, arch: str, kind: str) -> dict:
    """``entry`` with ``"arch"`` (``"sm90"``) and ``"device"`` (the device kind) of the GPU it was measured on, the
    keys the table readers check against the file's (``selection.read_table``), first. Values the entry already has
    are kept: an entry measured elsewhere is refused when the table is written, never relabelled."""
    rest = {k: v for k, v in entry.items() if k not in ("arch", "device")}
    return {"arch": entry.get("arch", arch), "device": entry.get("device", kind), **rest}


def merge_key(entry: dict) -> tuple:
    """The problem an entry answers: its op (``"fwd"`` where absent), dtype, out dtype, ``N``, ``K``, ``M_cap``,
    backend (JAX launch configs), accumulation mode (JAX FP8) and ``"kind"`` / ``"layout"`` (JAX's backend choices,
    whose backend is the answer, not the problem); entries of
    the same key replace each other. ``E`` is not in it: the lookups do not match on the expert count."""
    choice = entry.get("kind") is not None  # a backend choice's backend is its answer, not part of its problem
    return (entry.get("kind"), entry.get("op", "fwd"), entry.get("dtype"), entry.get("layout"),
            entry.get("out_dtype"), entry.get("N"), entry.get("K"), entry.get("M_cap"),
            None if choice else entry.get("backend"), entry.get("fast_accum"))


def merge_entries(existing: Iterable[dict], new: Iterable[dict]) -> list[dict]:
    """``existing`` less the entries whose :func:`merge_key` one of ``new`` has, in their order, then ``new`` (of
    two new entries with one key, the later)."""
    fresh = {}
    for e in new:
        fresh.pop(merge_key(e), None)
        fresh[merge_key(e)] = e
    return [e for e in existing if merge_key(e) not in fresh] + list(fresh.values())


def tuned_table_path(framework: str, arch: str, kind: str) -> str:
    """Where ``epmoe tune`` writes ``framework``'s table of one device: ``<user cache>/tuned/<framework>/<arch>/
    <device kind as a file name>.json`` (``selection.user_tuned_dir``, ``selection.file_key``). Raises
    ``ValueError`` for a framework not in :data:`FRAMEWORKS`."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"tuned_table_path: framework must be one of {FRAMEWORKS}; got {framework!r}")
    return os.path.join(selection.user_tuned_dir(framework), arch, selection.file_key(kind) + ".json")


def write_tuned_table(path: str, new: Sequence[dict], arch: str, kind: str,
                      check: selection.EntryCheck | None = None) -> str:
    """Merge ``new`` entries (stamped with ``arch`` and ``kind``, :func:`stamp`) into the device table at ``path``
    (its entries read and validated first, ``selection.read_table``; none if it does not exist) and write the whole
    table (``selection.write_table``: validated again, nothing written if an entry breaks a rule). Returns ``path``.
    Raises ``ValueError`` naming the file and the entry for a malformed stored or new entry, or one measured on
    another architecture or device kind."""
    existing = selection.read_table(path, arch, kind, check)
    entries = merge_entries(existing, [stamp(e, arch, kind) for e in new])
    return selection.write_table(path, entries, arch, kind, check)
