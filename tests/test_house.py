"""House rules that keep the code a map a newcomer reads in minutes (ruff and mypy run in
scripts/test.sh; these are the rules they do not check)."""

from __future__ import annotations

import ast
import pkgutil

from infractl.drill import KINDS, kinds

from conftest import REPO, Cli

MAX_FUNCTION_LINES = 60


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
