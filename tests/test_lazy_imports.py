"""spswap's own modules are imported at the top of a module, except where a lazy import
buys something: the module pulls in torch, vLLM, numpy, NVML, typer or rich (seconds or
tens of milliseconds a command that does not need them would pay), or the importer is on
the Slurm hooks' fast path (``spswap node prolog`` must stay cheap: :mod:`spswap.cli.main`,
:mod:`spswap.node` and what they load). The rule is computed from the imports themselves,
so it holds for new code too; a failure names each import and what to do."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_import_cycles import PACKAGE_DIR, _known, module_files

HEAVY = frozenset({"torch", "vllm", "numpy", "pynvml", "pyslurm", "safetensors", "cuda",
                   "typer", "rich", "click"})  # fmt: skip
# the console script (its lazy import of the typer app is the slow path) and the hooks
ENTRY, HOOKS = "spswap.cli.main", "spswap.node"


def _base(node: ast.ImportFrom, name: str, path: Path) -> str:
    if not node.level:
        return node.module or ""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def _targets(node: ast.stmt, name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """spswap modules an import statement loads (empty: a third-party or stdlib one)."""
    if isinstance(node, ast.Import):
        found = {_known(a.name, modules) for a in node.names if a.name.startswith("spswap")}
    elif isinstance(node, ast.ImportFrom):
        base = _base(node, name, path)
        if not base.startswith("spswap"):
            return set()
        found = {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else _known(base, modules)
                 for a in node.names}  # fmt: skip
    else:
        return set()
    return {m for m in found if m}


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """A module's statements that run when it is imported (not functions, not
    ``if TYPE_CHECKING:``)."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                out += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += _top_level(node.body) + _top_level(node.finalbody)
            for handler in node.handlers:
                out += _top_level(handler.body)
        elif isinstance(node, ast.ClassDef):
            out += _top_level(node.body)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append(node)
    return out


class Imports:
    """Each module's imports at load time, and what each pulls in with it."""

    def __init__(self) -> None:
        self.modules = module_files(PACKAGE_DIR)
        self.trees = {n: ast.parse(p.read_text(), filename=str(p)) for n, p in self.modules.items()}
        self._heavy: dict[str, frozenset[str]] = {}

    def at_load(self, name: str) -> tuple[set[str], set[str]]:
        """(spswap modules, third-party top names) that importing ``name`` runs."""
        own: set[str] = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        third: set[str] = set()
        for node in _top_level(self.trees[name].body):
            own |= _targets(node, name, self.modules[name], self.modules)
            if isinstance(node, ast.Import):
                third |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                third.add(node.module.split(".")[0])
        own.discard(name)
        return own, third - {"spswap", "__future__"}

    def heavy(self, name: str, seen: frozenset[str] = frozenset()) -> frozenset[str]:
        """The heavy third-party modules importing ``name`` loads, through anything."""
        if name in self._heavy:
            return self._heavy[name]
        own, third = self.at_load(name)
        found = set(third & HEAVY)
        for other in own - seen - {name}:
            found |= self.heavy(other, seen | {name})
        self._heavy[name] = frozenset(found)
        return self._heavy[name]

    def fast_path(self) -> set[str]:
        """The hooks' modules: the entry point, the hooks module and what it imports
        anywhere (its lazy imports run in the prolog), and what those load."""
        todo = list(self.at_load(ENTRY)[0])
        for node in ast.walk(self.trees[HOOKS]):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                todo += _targets(node, HOOKS, self.modules[HOOKS], self.modules)
        seen = {ENTRY, HOOKS}
        while todo:
            name = todo.pop()
            if name not in seen and name in self.modules:
                seen.add(name)
                todo += self.at_load(name)[0]
        return seen


def test_lazy_imports_of_spswap_modules_buy_something() -> None:
    imports = Imports()
    fast = imports.fast_path()
    needless = []
    for name, tree in imports.trees.items():
        if name in fast:
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                targets = _targets(node, name, imports.modules[name], imports.modules) \
                    if isinstance(node, (ast.Import, ast.ImportFrom)) else set()  # fmt: skip
                if targets and not any(imports.heavy(t) for t in targets):
                    needless.append(f"{imports.modules[name].relative_to(PACKAGE_DIR)}:"
                                    f"{node.lineno} {ast.unparse(node)}")  # fmt: skip
    assert not needless, (
        "in-function imports of modules that load nothing heavy: move them to the top of "
        "the module (a cycle they would make is one already: tests/test_import_cycles.py)\n  "
        + "\n  ".join(needless)
    )


def test_the_rule_sees_heavy_modules_and_the_fast_path() -> None:
    imports = Imports()
    assert "torch" in imports.heavy("spswap.engines.reference")
    assert not imports.heavy("spswap.daemon.client") and not imports.heavy("spswap.errors")
    fast = imports.fast_path()
    assert {"spswap.node", "spswap.daemon.client", "spswap.config"} <= fast
    assert "spswap.daemon.server" not in fast and "spswap.cli.app" not in fast
