"""infractl/handover/reference.py: reference.md covers every config field (every provider's section
included) and every command, and the committed docs/reference.md is that text (unit)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from types import UnionType
from typing import Any, Union, get_args, get_origin

import pytest
import typer.main
from pydantic import BaseModel
from typer.core import TyperGroup

from infractl.cli import app
from infractl.config import RunSpec, cluster_model
from infractl.handover.reference import FAILURE_SIGNATURES, RUNBOOKS, render_reference

from conftest import REPO


@pytest.fixture(scope="module")
def reference() -> str:
    return render_reference(typer.main.get_command(app))


def section(text: str, heading: str) -> str:
    """The lines of ``text`` from ``heading`` to the next heading of its level."""
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n")
    end = text.find(f"\n{level} ", start + 1)
    return text[start : end if end != -1 else None]


def row(text: str, first_cell: str) -> list[str]:
    """The cells of the table row whose first cell is ``first_cell``."""
    [line] = [line for line in text.splitlines() if line.startswith(f"| {first_cell} |")]
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def leaves(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every field of ``model`` that is not itself a section, by dotted path, with its default
    (``REQUIRED`` when it has none): optional sections (each provider's) and the entries of a
    mapping of sections (``<name>`` for the key) are walked like the others."""
    for name, field in model.model_fields.items():
        section = _model_in(field.annotation)
        if section is not None:
            yield from leaves(section, f"{prefix}{name}.")
            continue
        yield f"{prefix}{name}", REQUIRED if field.is_required() else field.get_default(call_default_factory=True)
        entries = _model_in(get_args(field.annotation)[-1]) if get_origin(field.annotation) is dict else None
        if entries is not None:
            yield from leaves(entries, f"{prefix}{name}.<name>.")


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model an annotation holds: ``Model`` or ``Model | None``."""
    optional = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else ()
    for candidate in (annotation, *optional):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


REQUIRED = object()


def shown(default: Any) -> str:
    """A default as reference.md writes it: YAML's spelling in a code span; None as unset."""
    if default is REQUIRED:
        return "required"
    if default is None:
        return "unset"
    if isinstance(default, str):
        return f"`{default}`"
    return f"`{json.dumps(default)}`"


@pytest.mark.parametrize(("heading", "model"), [("## cluster.yaml", cluster_model()), ("## run.yaml", RunSpec)])
def test_every_config_field_appears_with_its_default(reference: str, heading: str, model: type[BaseModel]) -> None:
    table = section(reference, heading)
    paths = list(leaves(model))
    assert paths
    for path, default in paths:
        cells = row(table, f"`{path}`")
        assert cells[2] == shown(default), (path, cells)
        assert cells[4], f"{path} has no meaning"


def test_every_provider_section_is_expanded(reference: str) -> None:
    cluster = section(reference, "## cluster.yaml")
    assert row(cluster, "`aws`")[1:3] == ["section", "unset"]
    assert row(cluster, "`aws.node_groups`")[1:4] == [
        "mapping of section",
        "required",
        "1..8 entries; names: pattern `^[a-z][a-z0-9]{0,15}$`",
    ]
    assert row(cluster, "`aws.node_groups.<name>.spot`")[2] == "`false`"
    assert row(cluster, "`aws.ssh_ingress_cidrs`")[1:4] == ["list of string", "required", "1..16 items"]
    assert row(cluster, "`aws.tags`")[1:3] == ["mapping of string", "`{}`"]
    assert row(cluster, "`netns.subnet`")[2] == "unset"
    assert "key_name" not in reference


def test_committed_reference_is_current(reference: str) -> None:
    committed = (REPO / "docs" / "reference.md").read_text()
    assert committed == reference, "docs/reference.md is stale: run `infractl reference` and commit docs/reference.md"


def test_constraints_come_from_the_schema(reference: str) -> None:
    run = section(reference, "## run.yaml")
    assert row(run, "`log_every`")[1:4] == ["integer", "`10`", "1..10000"]
    assert row(run, "`parallel.dp_shard`")[3] == "one of `none`, `zero1`, `fsdp`"
    assert row(run, "`parallel.pp_schedule`")[3] == "one of `gpipe`, `1f1b`, `interleaved-1f1b`"
    assert row(run, "`data.val_fraction`")[3] == "at least 0; below 1"
    assert "pattern `^([0-9]{1,10}):([0-9]{1,10})$`" in row(run, "`profile.steps`")[3]
    assert row(run, "`model`")[1] == "section"
    assert row(run, "`parallel`")[1] == "section"
    assert row(section(reference, "## cluster.yaml"), "`provider`")[3] == "one of `local`, `aws`, `netns`, `ssh`"


def commands(group: TyperGroup, path: tuple[str, ...] = ("infractl",)) -> Iterator[tuple[str, Any]]:
    for name, command in group.commands.items():
        yield " ".join((*path, name)), command
        if isinstance(command, TyperGroup):
            yield from commands(command, (*path, name))


def test_every_command_and_option_appears(reference: str) -> None:
    root = typer.main.get_command(app)
    assert isinstance(root, TyperGroup)
    found = list(commands(root))
    assert "infractl data prepare" in dict(found) and "infractl drill kill-node" in dict(found)
    for name, command in found:
        text = section(reference, f"### `{name}`")
        for param in command.params:
            if param.opts[0].startswith("-"):
                for opt in (*param.opts, *param.secondary_opts):
                    assert f"`{opt}`" in text, (name, opt)
            else:
                assert f"| `{param.metavar or param.name.upper()}` |" in text, (name, param.name)
    assert row(section(reference, "### `infractl bench`"), "`--steps`")[1:3] == ["int range, 10..1000000", "`50`"]
    assert row(section(reference, "### `infractl train`"), "`--log-format`")[1:3] == ["console\\|json", "`console`"]
    assert row(section(reference, "## Commands"), "`--debug`")[1:3] == ["flag", "off"]


def test_rendering_gives_the_same_bytes_in_processes_with_different_hash_seeds(reference: str) -> None:
    # A set or dict order that leaked into the text would differ between two interpreters' hash seeds.
    script = (
        "import sys, typer.main; from infractl.cli import app; "
        "from infractl.handover.reference import render_reference; "
        "sys.stdout.write(render_reference(typer.main.get_command(app)))"
    )
    rendered = [
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    ]
    assert rendered == [reference, reference]


def test_failure_signatures_quote_real_events_and_name_every_runbook(reference: str) -> None:
    assert {f.runbook for f in FAILURE_SIGNATURES} == set(RUNBOOKS)
    source = "\n".join(p.read_text() for folder in ("infractl", "trainer") for p in (REPO / folder).rglob("*.py"))
    # Every snake_case event a symptom quotes is one the code logs.
    events = {e for f in FAILURE_SIGNATURES for e in re.findall(r"`([a-z]+(?:_[a-z]+)+)`", f.symptom)}
    assert "checkpoint_invalid" in events
    for event in events:
        assert f'"{event}"' in source, event
    table = section(reference, "## Failure signatures")
    assert table.count("\n| ") == len(FAILURE_SIGNATURES) + 1
