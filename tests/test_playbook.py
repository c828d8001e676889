"""infractl.playbook: real ansible-runner on real Terraform nodes, through a real rendezvous."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infractl import access, infra, providers, workdir
from infractl.config import RuntimeSpec, parse_cluster
from infractl.errors import ConfigureError
from infractl.node import Node
from infractl.playbook import ConfigureResult, _unsafe_yaml, configure
from infractl.providers import NodeControl
from infractl.statedir import ClusterIntent, ClusterState


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for_port(port: int, process: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"rendezvous server exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"rendezvous server not listening on {port} after {timeout_s}s")


@pytest.fixture(scope="module")
def rendezvous() -> Iterator[tuple[str, int]]:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "infractl.servers.tcpstore", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port, process)
        yield ("127.0.0.1", port)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _vars(state_dir: Path) -> dict[str, Any]:
    """The access role's variables for a cluster without members."""
    return access.node_vars(ClusterState("test", state_dir), {})


@contextlib.contextmanager
def _access_groups(state_dir: Path) -> Iterator[dict[str, Any]]:
    """``_vars``; the groups the access role creates on this machine are removed afterwards, as
    `infractl teardown` does. Meanwhile the state directory is a started cluster's, as `up` makes
    it (in the machine's ledger): `infractl gc` leaves its groups alone."""
    state = ClusterState("test", state_dir)
    state.start(ClusterIntent(name="test", spec=parse_cluster({"name": "test"}), store=state.default_store.as_uri()))
    state.record_path.write_text("{}")
    try:
        yield _vars(state_dir)
    finally:
        access.remove_groups(state)
        state.unlist()


def _control(state_dir: Path, nodes: list[Node]) -> NodeControl:
    """How the control plane reaches local nodes."""
    return providers.get("local").control(ClusterState("test", state_dir), nodes)


def _provision(state_dir: Path, nodes: int) -> list[Node]:
    variables = {
        "cluster_name": "test",
        "nodes": nodes,
        "processes_per_node": 1,
        "state_dir": str(state_dir),
    }
    return infra.apply(state_dir / "terraform", infra.module_dir("local"), variables).nodes


@pytest.fixture(scope="module")
def configured(
    tmp_path_factory: pytest.TempPathFactory, rendezvous: tuple[str, int]
) -> Iterator[tuple[Path, list[Node], ConfigureResult]]:
    state_dir = tmp_path_factory.mktemp("cluster")
    nodes = _provision(state_dir, 2)
    with _access_groups(state_dir) as groups:
        result = configure(
            state_dir,
            _control(state_dir, nodes),
            runtime=RuntimeSpec(),
            rendezvous=rendezvous,
            nonce="first",
            access=groups,
        )
        yield state_dir, nodes, result


def test_configure_writes_the_network_environment(
    configured: tuple[Path, list[Node], ConfigureResult],
) -> None:
    _, nodes, result = configured

    assert result.changed > 0
    for node in nodes:
        lines = workdir.network_env(node.workdir).read_text().splitlines()
        assert "GLOO_SOCKET_IFNAME=lo" in lines
        assert "NCCL_SOCKET_IFNAME=lo" in lines
        for sub in workdir.DIRECTORIES:
            assert (node.workdir / sub).is_dir()
        # What root reads and the trainer's files: root's alone, no ACL a file made there inherits.
        for sub in (workdir.PRIVATE, workdir.WORK):
            acl = subprocess.run(["getfacl", "-cp", str(node.workdir / sub)], capture_output=True, text=True)
            assert sorted(acl.stdout.split()) == ["group::---", "other::---", "user::rwx"], acl.stdout


def test_health_check_reports_every_node_with_positive_bandwidth(
    configured: tuple[Path, list[Node], ConfigureResult],
) -> None:
    _, nodes, result = configured

    assert [report["node"] for report in result.health] == [node.name for node in nodes]
    for rank, report in enumerate(result.health):
        assert report["rank"] == rank
        assert report["world"] == 2
        assert report["bytes"] > 0
        assert report["algbw_gbps"] > 0
        assert report["busbw_gbps"] > 0


def test_second_configure_changes_nothing(
    configured: tuple[Path, list[Node], ConfigureResult], rendezvous: tuple[str, int]
) -> None:
    state_dir, nodes, _ = configured

    again = configure(
        state_dir,
        _control(state_dir, nodes),
        runtime=RuntimeSpec(),
        rendezvous=rendezvous,
        nonce="first",
        access=_vars(state_dir),
    )

    assert again.changed == 0
    assert len(again.health) == 2


def test_wrong_torch_pin_is_refused_naming_node_and_field(tmp_path: Path, rendezvous: tuple[str, int]) -> None:
    nodes = _provision(tmp_path, 2)

    with _access_groups(tmp_path) as groups, pytest.raises(ConfigureError) as excinfo:
        configure(
            tmp_path,
            _control(tmp_path, nodes),
            runtime=RuntimeSpec(torch="9.9"),
            rendezvous=rendezvous,
            nonce="pin",
            access=groups,
        )

    message = str(excinfo.value)
    assert message.startswith(("node-0: runtime: ", "node-1: runtime: "))
    assert "runtime.torch=9.9" in message
    assert len(message.splitlines()) == 1


def test_the_network_environment_is_read_as_known_keys_never_sourced(tmp_path: Path) -> None:
    """What the agents take from a node's network.env: the network role's variables and NCCL's and
    libfabric's knobs, never a variable that loads code or anything else the file holds."""
    node = Node(name="node-0", address="127.0.0.1", workdir=tmp_path / "node-0", processes=1)
    path = workdir.network_env(node.workdir)
    path.parent.mkdir(parents=True)
    path.write_text(
        "# written by the network role\n"
        "GLOO_SOCKET_IFNAME=eth0\nNCCL_SOCKET_IFNAME=eth0\nNCCL_DEBUG=WARN\nFI_PROVIDER=efa\n"
        "INFRACTL_NODE_ADDRESS=10.0.0.2\n"
        "LD_PRELOAD=/tmp/evil.so\nNCCL_NET_PLUGIN=/tmp/evil.so\nFI_PROVIDER_PATH=/tmp\nPYTHONPATH=/tmp\n"
        "export NCCL_ALGO=Ring\nNCCL_BAD=\x1b[31m\nnot a line\n"
    )

    found = _control(tmp_path, [node]).network_env("node-0")

    assert found == {
        "GLOO_SOCKET_IFNAME": "eth0",
        "NCCL_SOCKET_IFNAME": "eth0",
        "NCCL_DEBUG": "WARN",
        "FI_PROVIDER": "efa",
        "INFRACTL_NODE_ADDRESS": "10.0.0.2",
    }


def test_what_infractl_hands_ansible_is_never_rendered_as_a_template(tmp_path: Path) -> None:
    """Every string of the variables file that could hold a template is !unsafe: a template in one
    stays text, the lookup it asks for never runs, and the other strings stay strings."""
    planted = tmp_path / "rendered"
    variables = {
        "user": f"{{{{ lookup('pipe', 'touch {planted}') }}}}",
        "members": {"g": ["{{ 6 * 7 }}"]},
        "n": 3,
        "torch": "9.9",
    }
    extravars = tmp_path / "extravars.yml"
    extravars.write_text(_unsafe_yaml(variables))
    playbook = tmp_path / "show.yml"
    playbook.write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - ansible.builtin.debug: {msg: '{{ user }} {{ members.g[0] }} {{ n + 1 }} {{ torch | length }}'}\n"
    )
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local"]
    done = subprocess.run([*argv, "-e", f"@{extravars}", str(playbook)], capture_output=True, text=True, timeout=300)

    assert done.returncode == 0, done.stdout + done.stderr
    # ... and a string stays a string ("9.9" has a length; a number would not).
    assert "{{ 6 * 7 }} 4 3" in done.stdout and "lookup('pipe'" in done.stdout
    assert not planted.exists()
