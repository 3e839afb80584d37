"""Kernel selection, framework-free: the device spec, the tuned tables keyed by architecture, the per-user cache.

Both frameworks choose their grouped GEMM kernels through the same three pieces (each framework reads its own
device and registers its own kernels: ``moe_torch/ops/grouped_gemm/kernels.py``,
``moe_pallas/ops/grouped_gemm/kernels.py``):

* :class:`DeviceSpec`: what a choice may depend on, read from the device (compute capability, SM count, shared
  memory per block, the device kind), never a constant measured on one GPU.
* :class:`TunedTables`: the measured choices, looked up **architecture first**. A request of a device of kind
  ``"NVIDIA H100 80GB HBM3"`` and capability 9.0 reads, most specific first::

      <user cache>/tuned/<framework>/sm90/NVIDIA_H100_80GB_HBM3.json   (written by ``epmoe tune``)
      <user cache>/tuned/<framework>/sm90.json
      <package>/tuned/sm90/NVIDIA_H100_80GB_HBM3.json                  (shipped refinements of one device kind)
      <package>/tuned/sm90.json                                        (shipped: every Hopper GPU)

  The first of those files that has an entry for the problem (op, dtype, ``N``, ``K``) answers it, with its
  entry of the nearest ``M_cap`` (log2), so a device's refinement replaces the architecture's entry only for the
  shapes it measured. Every file is validated when first read: a malformed entry, or one measured on another
  architecture or device kind than its file says, raises ``ValueError`` naming the file and the entry.
* :func:`user_cache_dir`: ``EPMOE_CACHE_DIR`` if set, else the platform's per-user cache directory
  (``platformdirs``), never the installed package.

vLLM keys its fused-MoE configs by device name alone (``vllm/model_executor/layers/fused_moe/configs/``, one JSON
per device name), so a GPU without a file gets untuned defaults; here the architecture's file serves it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable, Sequence

log = logging.getLogger("moe_contract")

#: Environment variable naming the per-user cache directory (tuned tables of ``epmoe tune``).
CACHE_DIR_ENV = "EPMOE_CACHE_DIR"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator as the kernel choice sees it (hashable: caches key on it).

    ``kind``: the device's name as its framework reports it (``torch.cuda.get_device_name``, JAX's
    ``device_kind``), e.g. ``"NVIDIA H200"``; ``capability``: CUDA compute capability ``(major, minor)``;
    ``sm_count``: streaming multiprocessors; ``smem_per_block``: the most shared memory one block may use, in
    bytes (the opt-in maximum); ``platform``: ``"cuda"`` (the only GPU platform the kernels target) or
    ``"cpu"``."""

    kind: str
    capability: tuple[int, int]
    sm_count: int
    smem_per_block: int
    platform: str = "cuda"

    def __post_init__(self):
        if (not isinstance(self.capability, tuple) or len(self.capability) != 2
                or not all(isinstance(c, int) and c >= 0 for c in self.capability)):
            raise ValueError(f"DeviceSpec: capability must be a (major, minor) tuple of ints; got {self.capability!r}")
        for name in ("sm_count", "smem_per_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"DeviceSpec: {name} must be an int >= 0; got {value!r}")

    @property
    def arch(self) -> str:
        """``"sm<major><minor>"`` (``"sm90"`` for every Hopper GPU: H100, H200, H800, H20, GH200)."""
        return f"sm{self.capability[0]}{self.capability[1]}"

    @property
    def is_hopper(self) -> bool:
        """Compute capability 9.0: wgmma, TMA, warp specialization with ``setmaxnreg``."""
        return self.platform == "cuda" and self.capability == (9, 0)

    def describe(self) -> str:
        """``"NVIDIA H100 80GB HBM3 (sm90, 132 SMs, 227 KiB shared memory a block)"``."""
        return (f"{self.kind} ({self.arch}, {self.sm_count} SMs, {self.smem_per_block // 1024} KiB shared memory "
                f"a block)")


def file_key(kind: str) -> str:
    """A device kind as a file name (spaces and slashes as ``_``): ``"NVIDIA H200"`` -> ``"NVIDIA_H200"``."""
    return kind.replace(" ", "_").replace("/", "_")


def user_cache_dir() -> str:
    """The per-user cache directory: ``$EPMOE_CACHE_DIR`` if set (and not empty), else ``platformdirs``'
    ``user_cache_dir("epmoe")`` (``~/.cache/epmoe`` on Linux). Not created here."""
    env = os.environ.get(CACHE_DIR_ENV, "").strip()
    if env:
        return os.path.abspath(os.path.expanduser(env))
    import platformdirs  # a declared dependency; imported only where the cache is read

    return platformdirs.user_cache_dir("epmoe", appauthor=False)


def user_tuned_dir(framework: str) -> str:
    """Where ``epmoe tune`` writes ``framework``'s tables (``"torch"`` or ``"jax"``): ``<cache>/tuned/<framework>``."""
    return os.path.join(user_cache_dir(), "tuned", framework)


def table_paths(spec: DeviceSpec, shipped_dir: str, user_dir: str | None) -> tuple[tuple[str, str | None], ...]:
    """The files a request on ``spec`` reads, most specific first, each with the device kind its entries must have
    been measured on (``None``: any device of the architecture): the user's device and architecture files (when
    ``user_dir`` is given), then the shipped ones."""
    out = []
    for root in ((user_dir,) if user_dir else ()) + (shipped_dir,):
        out.append((os.path.join(root, spec.arch, file_key(spec.kind) + ".json"), spec.kind))
        out.append((os.path.join(root, spec.arch + ".json"), None))
    return tuple(out)


#: Checks an entry beyond the common keys: returns why it is malformed, or ``None``.
EntryCheck = Callable[[dict], "str | None"]


def _common_problem(t: object) -> str | None:
    if not isinstance(t, dict):
        return f"must be a JSON object; got {type(t).__name__}"
    for k in ("N", "K", "M_cap"):
        if k not in t:
            return f"missing key {k!r}"
        v = t[k]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return f"{k} must be an int >= 1; got {k}={v!r}"
    return None


def read_table(path: str, arch: str, kind: str | None, check: EntryCheck | None = None) -> tuple[dict, ...]:
    """The entries of the tuned file ``path`` (``()`` if it does not exist), every one validated: a JSON object with
    int ``N``, ``K``, ``M_cap`` >= 1, an ``"arch"`` (if present) equal to ``arch``, a ``"device"`` equal to ``kind``
    (a device-kind file; an architecture file, ``kind=None``, takes entries of any device of the architecture), and
    whatever ``check`` asks. Raises ``ValueError`` naming the file and the entry's index for a file that is not a
    JSON list or an entry that breaks a rule."""
    if not os.path.exists(path):
        return ()
    with open(path) as f:
        try:
            entries = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tuned table {path}: not valid JSON ({exc})") from exc
    return check_entries(entries, path, arch, kind, check)


def check_entries(entries: object, path: str, arch: str, kind: str | None, check: EntryCheck | None = None
                  ) -> tuple[dict, ...]:
    """``entries`` (a tuned table's JSON value) checked as :func:`read_table` checks a file (``path`` names it in the
    messages). Raises ``ValueError`` naming ``path`` and the entry's index."""
    if not isinstance(entries, list):
        raise ValueError(f"tuned table {path}: must be a JSON list of objects; got {type(entries).__name__}")
    for i, t in enumerate(entries):
        problem = _common_problem(t)
        if problem is None and t.get("arch", arch) != arch:
            problem = f"measured on architecture {t['arch']!r}, but the file holds {arch!r} entries"
        if problem is None and kind is not None and t.get("device", kind) != kind:
            problem = f"measured on device {t['device']!r}, but the file holds {kind!r} entries"
        if problem is None and check is not None:
            problem = check(t)
        if problem is not None:
            raise ValueError(f"tuned table {path}: entry {i} {problem}; entry: {json.dumps(t)[:300]}")
    return tuple(entries)


@dataclasses.dataclass(frozen=True)
class TunedTables:
    """The tuned files of one device, most specific first (:func:`table_paths`): ``tiers`` is ``((path, entries),
    ...)`` for the files that exist."""

    tiers: tuple[tuple[str, tuple[dict, ...]], ...]

    @classmethod
    def load(cls, spec: DeviceSpec | None, shipped_dir: str, framework: str,
             check: EntryCheck | None = None, *, user: bool = True) -> TunedTables:
        """Read (and validate, :func:`read_table`) every file of ``spec``; no tiers without a spec (the CPU) or
        off CUDA. ``user=False`` skips the per-user cache."""
        if spec is None or spec.platform != "cuda":
            return cls(())
        user_dir = user_tuned_dir(framework) if user else None
        tiers = []
        for path, kind in table_paths(spec, shipped_dir, user_dir):
            entries = read_table(path, spec.arch, kind, check)
            if entries:
                tiers.append((path, entries))
        if not tiers:
            log.info("%s: no tuned %s table for %s: heuristic kernel choices (`epmoe tune` measures this GPU)",
                     framework, framework, spec.describe())
        return cls(tuple(tiers))

    def entries(self) -> tuple[dict, ...]:
        """Every entry, most specific file first."""
        return tuple(t for _, entries in self.tiers for t in entries)

    def nearest(self, match: Callable[[dict], bool], M_cap: int, *, max_ratio: float | None = None,
                rank: Callable[[dict], int] | None = None) -> dict | None:
        """The entry of the most specific file holding any entry ``match`` accepts within ``max_ratio`` of
        ``M_cap`` (``None``: any distance), with the nearest ``M_cap`` in log2 (ties: lower ``rank``, then the first
        stored); ``None`` if no file has one."""
        log_m = math.log2(max(M_cap, 1))
        for _, entries in self.tiers:
            found = []
            for i, t in enumerate(entries):
                if not match(t):
                    continue
                dist = abs(log_m - math.log2(max(t["M_cap"], 1)))
                if max_ratio is not None and dist > math.log2(max_ratio):
                    continue
                found.append((dist, rank(t) if rank else 0, i, t))
            if found:
                return min(found, key=lambda f: f[:3])[3]
        return None


def write_table(path: str, entries: Sequence[dict], arch: str, kind: str | None,
                check: EntryCheck | None = None) -> str:
    """Write ``entries`` to ``path`` as a JSON list (the parent directories made), after checking them as
    :func:`read_table` would read them back; returns ``path``. Raises ``ValueError`` (nothing written) for an entry
    that breaks a rule."""
    entries = json.loads(json.dumps(list(entries)))  # as they will be read back
    check_entries(entries, path, arch, kind, check)
    tmp = path + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(entries, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


class NoKernelError(NotImplementedError):
    """No registered kernel serves the request on this device (the message names the device and each reason)."""


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """A named kernel of one op: ``supported_on(spec, problem)`` returns why it cannot serve ``problem`` on ``spec``
    (``None``: it can). ``problem`` is the framework's own description of the request (shapes, dtypes, scale
    layouts), host-side only."""

    name: str
    supported_on: Callable[[DeviceSpec | None, object], "str | None"]
    doc: str = ""


class KernelRegistry:
    """The named kernels of one op, in the default order (the first that serves is the default where no table
    chooses). ``choose`` says which kernel runs a request and why the ones before it did not."""

    def __init__(self, op: str, choices: Sequence[KernelChoice]):
        self.op = op
        self.choices = {c.name: c for c in choices}
        if len(self.choices) != len(choices):
            raise ValueError(f"{op}: kernel names must be unique; got {[c.name for c in choices]}")

    def names(self) -> tuple[str, ...]:
        return tuple(self.choices)

    def reasons(self, spec: DeviceSpec | None, problem: object) -> dict[str, str | None]:
        """Every kernel's refusal of ``problem`` on ``spec`` (``None`` where it serves), in registry order."""
        return {name: c.supported_on(spec, problem) for name, c in self.choices.items()}

    def check(self, name: str, spec: DeviceSpec | None, problem: object) -> None:
        """``NotImplementedError`` naming the device and the reason when kernel ``name`` cannot serve ``problem``;
        ``ValueError`` for an unknown name."""
        if name not in self.choices:
            raise ValueError(f"{self.op}: implementation must be one of {self.names()}; got {name!r}")
        why = self.choices[name].supported_on(spec, problem)
        if why is not None:
            where = spec.describe() if spec is not None else "this device"
            raise NotImplementedError(f"{self.op}: kernel {name!r} cannot serve this request on {where}: {why}")

    def choose(self, spec: DeviceSpec | None, problem: object, preferred: Sequence[str] = ()) -> tuple[str, list[str]]:
        """The kernel for ``problem``: the first of ``preferred`` (a tuned table's choice), then of the registry's
        order, that serves it; with the reasons of those passed over (``"name: why"``). Raises
        :class:`NoKernelError` naming the device when none serves."""
        passed = []
        order = [n for n in preferred if n in self.choices] + [n for n in self.choices if n not in preferred]
        for name in order:
            why = self.choices[name].supported_on(spec, problem)
            if why is None:
                return name, passed
            passed.append(f"{name}: {why}")
        where = spec.describe() if spec is not None else "this device"
        raise NoKernelError(f"{self.op}: no kernel serves this request on {where}: " + "; ".join(passed))
