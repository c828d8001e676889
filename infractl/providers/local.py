"""The ``local`` provider: a node is a work directory under the cluster's state directory
(``nodes/node-<i>``, made by infra/local's ``terraform_data``) plus the process tree infractl starts
in it. Nothing leaves this machine and nothing costs money.

Node control is this machine's own: commands and files directly, processes found by their
markers (``infractl.proc``), a watch by one monitor thread for every node.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from infractl import infra, proc
from infractl.config import ClusterSpec, ProviderConfig
from infractl.errors import InfractlError
from infractl.node import Node
from infractl.proc import NodeProcess
from infractl.providers.contract import Plan, Provider
from infractl.providers.nodecontrol import NodeControl, Watch
from infractl.statedir import ClusterIntent, ClusterState, write_private

__all__ = ["Local", "LocalNodes", "node_directories"]


def node_directories(state: ClusterState) -> list[str]:
    """Node directories under the state directory (what ``terraform destroy`` should have removed)."""
    nodes_dir = state.dir / "nodes"
    return [f"node directory {p}" for p in sorted(nodes_dir.iterdir())] if nodes_dir.is_dir() else []


class Local(Provider):
    name = "local"
    config = ProviderConfig(name="local", help="nodes are process trees on this machine.", default=True)
    shares_host_accounts = True

    def terraform_module(self) -> Path:
        """infra/local: one ``terraform_data`` per node, its work directory."""
        return infra.module_dir(self.name)

    def variables(self, spec: ClusterSpec, state: ClusterState) -> dict[str, object]:
        return {
            "cluster_name": spec.name,
            "nodes": spec.nodes,
            "processes_per_node": spec.processes_per_node,
            "state_dir": str(state.dir),
        }

    def dry_run(self, spec: ClusterSpec, state: ClusterState) -> Plan:
        """infra/local makes one ``terraform_data.node`` per node: that is the whole plan."""
        return Plan(
            provider=self.name,
            module=f"infra/{self.name}",
            region=None,
            variables=self.variables(spec, state),
            resources=tuple(f"terraform_data.node[{index}]" for index in range(spec.nodes)),
            cost=None,
            cost_note="the nodes are this machine",
        )

    def preflight(self, spec: ClusterSpec, state: ClusterState) -> None:
        """Nothing to check beyond what ``up`` checks for every provider."""

    def rendezvous_host(self, spec: ClusterSpec, state: ClusterState) -> str:
        """Every node is this machine: the endpoint listens on its loopback."""
        return "127.0.0.1"

    def leftovers(self, state: ClusterState, record: ClusterIntent) -> list[str]:
        return node_directories(state)

    def control(self, state: ClusterState, nodes: Sequence[Node]) -> NodeControl:
        return LocalNodes(state, nodes)


class LocalNodes(NodeControl):
    """Nodes that are this machine."""

    def python(self, node: str) -> str:
        return sys.executable

    def run(self, node: str, argv: Sequence[str], *, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return proc.run(list(argv), timeout=timeout)

    def write_file(self, node: str, path: Path, text: str) -> None:
        write_private(path, text)

    def read_file(self, node: str, path: Path) -> str | None:
        try:
            return path.read_text()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def tail(self, node: str, path: Path, *, lines: int) -> list[str] | None:
        try:
            with path.open(errors="replace") as f:
                return list(deque(f, maxlen=lines or None))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def tail_bytes(self, node: str, path: Path, *, size: int) -> bytes:
        try:
            with path.open("rb") as f:
                f.seek(max(0, path.stat().st_size - size))
                return f.read()
        except OSError:
            return b""

    def start(
        self,
        node: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        workdir: Path,
        log_path: Path,
        header: str,
        image: str | None = None,
        mounts: Sequence[Path] = (),
        files: Mapping[Path, Path] | None = None,
    ) -> subprocess.Popen[bytes]:
        if image is not None:
            raise InfractlError(f"{node}: a local node runs no image (its trainer is this machine's Python)")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("a") as log:
            log.write(header + "\n")
        return proc.spawn(list(argv), env=env, cwd=workdir, log_path=log_path)

    def processes(self, *, node: str | None = None, run: str | None = None) -> list[NodeProcess]:
        # Other processes carry the cluster's marker too (its rendezvous server): only the nodes'.
        return [p for p in proc.listing(self.state.dir, node=node, run=run) if p.node in self.nodes]

    def signal(self, procs: Iterable[NodeProcess], sig: int) -> None:
        proc.signal_listed(procs, sig)

    def watch(self, run: str) -> Watch:
        return _LocalWatch(self, run)

    def kill_node(self, node: str, run: str) -> None:
        """A local node is its process tree: the run's processes there, killed until none is left."""
        proc.kill_all(self.state.dir, node=node, run=run, timeout=proc.KILL_NODE_S)

    def ansible_host(self, node: str) -> dict[str, Any]:
        return {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}


class _LocalWatch(Watch):
    """One monitor thread for every node of the cluster: they are all this machine."""

    def __init__(self, nodes: LocalNodes, run: str) -> None:
        super().__init__(nodes.nodes)
        self._stop = threading.Event()
        names = set(nodes.nodes)

        def emit(procs: list[NodeProcess] | None) -> None:
            if procs is not None:
                self.report(None, [p for p in procs if p.node in names])

        self._thread = threading.Thread(
            target=proc.monitor,
            args=(nodes.state.dir,),
            kwargs={"run": run, "node": None, "emit": emit, "stop": self._stop},
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
