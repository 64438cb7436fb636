"""No import cycle among spswap's modules, so the layers stay layers.

The walk reads every ``import spswap...`` and ``from spswap... import`` (relative ones
too) with :mod:`ast`: at the top of a module, inside functions, and under
``if TYPE_CHECKING:`` alike (an import that only a type checker runs still ties the two
modules together for a reader). A failure names the modules of each cycle in order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import spswap

PACKAGE_DIR = Path(spswap.__file__).parent

# Cycles that exist and are known, as the set of modules each one runs through; a new
# cycle, or a known one that grows, fails. None are left (issue 14 removed the daemon's
# and the pool's); add one only with the issue that will remove it.
ALLOWED_CYCLES: tuple[frozenset[str], ...] = ()


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the package."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` when it is a module, else the nearest package or module above it."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` (file ``path``) imports, anywhere in it."""
    top = name.partition(".")[0]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # `from pkg import sub` imports the module pkg.sub; `from mod import name`, mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]  # fmt: skip
        else:
            continue
        for target in targets:
            if target == top or target.startswith(top + "."):
                known = _known(target, modules)
                if known is not None and known != name:
                    found.add(known)
    return found


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    modules = module_files(package_dir)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycle_groups(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of modules that import each other, directly or around (the strongly
    connected components of more than one module, by Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def one_cycle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest cycle inside ``group`` from its first module back to it: ``[a, ..., a]``."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(group)  # not reached: a group of more than one module has a cycle


def test_no_import_cycles() -> None:
    graph = import_graph(PACKAGE_DIR)
    new = [g for g in cycle_groups(graph) if not any(g <= allowed for allowed in ALLOWED_CYCLES)]
    assert not new, "import cycles (break each, e.g. move what both need into a leaf):\n" + \
        "\n".join(f"{len(g)} modules {sorted(g)}, e.g. {' -> '.join(one_cycle(graph, g))}"
                  for g in new)  # fmt: skip


def test_allowed_cycles_still_exist() -> None:
    found = cycle_groups(import_graph(PACKAGE_DIR))
    gone = [sorted(a) for a in ALLOWED_CYCLES if not any(f & a for f in found)]
    assert not gone, f"these cycles are gone: delete them from ALLOWED_CYCLES: {gone}"


def test_the_walk_sees_function_level_relative_and_type_checking_imports(
    tmp_path: Path,
) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .c import g\n")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    import pkg.a\n")  # fmt: skip
    (pkg / "d.py").write_text("import pkg.a\nfrom pkg import sub\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.sub.c"}
    assert graph["pkg.d"] == {"pkg.a", "pkg.sub"}
    assert cycle_groups(graph) == [{"pkg.a", "pkg.sub.b", "pkg.sub.c"}]
    assert one_cycle(graph, {"pkg.a", "pkg.sub.b", "pkg.sub.c"}) == [
        "pkg.a",
        "pkg.sub.b",
        "pkg.sub.c",
        "pkg.a",
    ]
