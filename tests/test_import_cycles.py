"""No import cycles among the library's modules (``moe_contract``, ``moe_torch``, ``moe_pallas``, ``interop``).

The graph is read from the source with ``ast``, every ``import`` statement counted wherever it stands: at the top,
inside a function (a lazy import hides a cycle, it does not remove it) or under ``if TYPE_CHECKING:``. An edge goes
to the most specific module of the package that the statement names: ``from moe_torch import hf`` is an edge to
``moe_torch.hf``, ``from moe_torch import EPMoE`` one to the package ``moe_torch`` (its ``__init__``). A strongly
connected component of more than one module is a cycle.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("moe_contract", "moe_torch", "moe_pallas", "interop")

#: Cycles allowed, each exactly as its set of modules: none.
ALLOWED: set[frozenset] = set()


def package_modules(root: pathlib.Path, packages=PACKAGES) -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``) for every ``.py`` file under ``packages``."""
    mods = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return mods


def import_graph(mods: dict[str, tuple[pathlib.Path, bool]]) -> dict[str, set[str]]:
    """module -> the modules of ``mods`` it imports (any import statement anywhere in its file)."""

    def owner(name: str) -> str | None:  # the longest prefix of ``name`` that is one of ours
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for name in names:
                target = owner(name)
                if target is not None and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(frozenset(comp))
    return found


def test_no_import_cycles():
    mods = package_modules(ROOT)
    assert {"moe_contract.config", "moe_torch.module", "moe_pallas.module", "interop.cli"} <= set(mods)
    graph = import_graph(mods)
    bad = [sorted(c) for c in cycles(graph) if c not in ALLOWED]
    assert not bad, "import cycles (break each: move the shared piece into a module both can import): " + "; ".join(
        " <-> ".join(c) for c in bad)


def test_cycle_finder_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: a cycle closed only by an import inside a function, or by a relative import, is found;
    a package ``__init__`` importing its submodules, which import each other one way, is no cycle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\nfrom pkg import b\n")
    (pkg / "a.py").write_text("import pkg.b\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import c\n")
    (pkg / "c.py").write_text("from .sub import d\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "d.py").write_text("from ..b import f\n")
    (pkg / "e.py").write_text("from pkg.a import A\n")
    graph = import_graph(package_modules(tmp_path, ("pkg",)))
    assert graph["pkg.c"] == {"pkg.sub.d"} and graph["pkg.sub.d"] == {"pkg.b"}
    assert cycles(graph) == [frozenset({"pkg.b", "pkg.c", "pkg.sub.d"})]
