"""House rules that keep the code a map a newcomer reads in minutes (ruff and mypy run in
scripts/test.sh; these are the rules they do not check)."""

from __future__ import annotations

import ast
import importlib.metadata
import pkgutil
from pathlib import Path

from infractl import providers
from infractl.config import cluster_model
from infractl.drill import KINDS, kinds

from conftest import REPO, Cli

MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 600
# Issue 48, for the integrator: what other branches of the issue remove, allowed here until they
# are merged; empty both at the merge (the checks then hold with no exception).


def test_no_long_function_without_a_comment_saying_why() -> None:
    """A function over 60 lines carries a ``# long: <why>`` comment on the line above it."""
    found = []
    for folder in ("infractl", "trainer"):
        for path in sorted((REPO / folder).rglob("*.py")):
            lines = path.read_text().splitlines()
            for node in ast.walk(ast.parse("\n".join(lines))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if length > MAX_FUNCTION_LINES and not lines[first - 2].strip().startswith("# long:"):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({length} lines)")
    assert found == []


def test_each_drill_kind_is_one_file_named_after_it() -> None:
    """Adding a fault kind is one new file in infractl/drill/kinds/ (it registers itself)."""
    modules = sorted(m.name for m in pkgutil.iter_modules(kinds.__path__))
    assert sorted(name.replace("-", "_") for name in KINDS) == modules
    for name, kind in KINDS.items():
        assert kind.__module__ == f"infractl.drill.kinds.{name.replace('-', '_')}"
        assert kind.help


def test_every_drill_kind_is_a_command(cli: Cli) -> None:
    listed = cli("drill", "--help").stdout
    for name in KINDS:
        assert f" {name} " in listed, listed


def _modules() -> dict[str, Path]:
    """Every module of infractl/ and trainer/ by dotted name (a package by its own name)."""
    found = {}
    for folder in ("infractl", "trainer"):
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module and of its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that module ``name`` imports: at the top, inside functions, lazily
    (``importlib`` by a constant name aside), and under ``TYPE_CHECKING`` where the imported module
    is a sibling (one package's modules that need each other's types are one concern split in two;
    a type from elsewhere is only a type). ``from a import b`` imports the module ``a.b`` when
    there is one, else ``a``."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported: set[str] = set()
    for node in ast.walk(tree):
        found: set[str] = set()
        if isinstance(node, ast.Import):
            found = {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found = {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        if id(node) in typing_only:
            found = {target for target in found if _known(target, modules).rpartition(".")[0] == _parent(name)}
        imported |= found
    inside = set()
    for target in imported:
        target = _known(target, modules)
        if target and target != name:
            inside.add(target)
    return inside


def _known(target: str, modules: dict[str, Path]) -> str:
    """The module of ``modules`` that an import of ``target`` imports: it, or its nearest package."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target


def _parent(name: str) -> str:
    """The package a module belongs to (a package: the one it is in)."""
    return name.rpartition(".")[0]


def test_no_import_cycle_among_the_modules() -> None:
    """Computed from the code: every import (inside functions too; under TYPE_CHECKING aside)."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles = []
    done: set[str] = set()
    for start in sorted(graph):
        # Depth-first from each module, with the path so far: a module met again on it closes a cycle.
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        while stack:
            name, trail = stack.pop()
            for nxt in sorted(graph[name]):
                if nxt == start:
                    cycles.append(" -> ".join([*trail, start]))
                elif nxt not in trail and nxt not in done:
                    stack.append((nxt, [*trail, nxt]))
        done.add(start)
    assert cycles == []


#: Provider names that are also words of infractl's own, outside any provider: ``ssh`` is the
#: command every SSH node is reached with and a node's login (``Node.ssh``).
_COMMON_WORDS = frozenset({"ssh"})


def test_only_the_providers_name_a_provider() -> None:
    """Outside infractl/providers/, no module imports a provider's module, and no code names a
    provider: no attribute, imported name or string (docstrings and comments aside) is a
    provider's name (a variable may be called ``local``). What a provider does is asked of it
    (infractl.providers). The providers are those registered (infractl's own entry points, and
    any other installed package's)."""
    names = {provider.name for provider in providers.every()}
    assert names == set(cluster_model().model_fields["provider"].annotation.__args__)
    entry_points = importlib.metadata.distribution("infractl").entry_points
    shipped = {entry.name for entry in entry_points if entry.group == providers.ENTRY_POINT_GROUP}
    assert shipped <= names and all(
        providers.get(name).__module__.startswith("infractl.providers.") for name in shipped
    )
    modules = _modules()
    found = []
    for name, path in modules.items():
        if name.startswith("infractl.providers"):
            continue
        tree = ast.parse(path.read_text())
        # A provider's name that is also a word of the tool's own (the ``ssh`` command, a node's
        # ``ssh`` login) names the provider only as a string compared with, or asked for.
        asked = {
            id(operand)
            for node in ast.walk(tree)
            for operand in (
                [node.left, *node.comparators]
                if isinstance(node, ast.Compare)
                else node.args
                if isinstance(node, ast.Call) and ast.unparse(node.func) in ("providers.get", "provider_named")
                else []
            )
            if isinstance(operand, ast.Constant)
        }
        for imported in _imports(name, path, modules):
            if imported.rpartition(".")[2] in names and imported.startswith("infractl.providers."):
                found.append(f"{path.relative_to(REPO)}: imports {imported}")
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            named = None
            if isinstance(node, ast.Attribute):
                named = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                named = node.value
            elif isinstance(node, ast.alias):
                named = node.asname or node.name.rpartition(".")[2]
            if named in names and (named not in _COMMON_WORDS or id(node) in asked):
                found.append(f"{path.relative_to(REPO)}:{getattr(node, 'lineno', '?')}: {named!r}")
    assert found == []


def test_no_module_is_over_600_lines() -> None:
    """A module past 600 lines holds more than one concern: split it by concern (as providers/aws/
    was) before adding to it."""
    found = []
    for folder in ("infractl", "trainer"):
        for path in sorted((REPO / folder).rglob("*.py")):
            length = len(path.read_text().splitlines())
            if length > MAX_MODULE_LINES:
                found.append(f"{path.relative_to(REPO)} ({length} lines)")
    assert found == []


def test_the_checks_above_catch_what_they_look_for(tmp_path: Path) -> None:
    """The house checks find a cycle (through a sibling's types too, not through another
    package's) and a provider's name when there is one."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n    return 'netns'\n")
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    assert _imports("a", modules["a"], modules) == {"b"}
    assert _imports("b", modules["b"], modules) == {"a"}
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import B\n    from q import Q\n"
    (tmp_path / "c.py").write_text(typed)
    packaged = {"p": tmp_path, "p.b": tmp_path / "b.py", "p.c": tmp_path / "c.py", "q": tmp_path / "q.py"}
    assert _imports("p.c", packaged["p.c"], packaged) == {"p.b"}
    tree = ast.parse(modules["b"].read_text())
    assert [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in _docstrings(tree)] == [
        "netns"
    ]
