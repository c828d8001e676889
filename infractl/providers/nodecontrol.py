"""How the control plane reaches a cluster's nodes once they are (``NodeControl``: run a command
on a node, start its agent, find, signal and watch a run's processes, read its logs, inject the
faults the drills need), and a run's processes as they change (``Watch``).

Nothing outside ``infractl/providers/`` knows what a node is: callers name nodes and hold
``NodeProcess`` records, and ask the cluster's ``NodeControl`` (``providers.control(state)``).
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from infractl import proc, workdir
from infractl.errors import InfractlError, UsageError
from infractl.node import Node
from infractl.proc import NodeProcess
from infractl.providers.engines import DOCKER, ContainerEngine
from infractl.statedir import ClusterState

__all__ = ["LINK_FAULTS", "NETEM_HINT", "NodeControl", "Watch"]

#: How a node's link can fail (``drill partition --kind``): ``down`` (the node's interface goes
#: down: its sockets see the network vanish), ``drop`` (packets vanish silently both ways, the link
#: still up), ``delay`` (latency on everything the node sends). A provider makes those it can.
LINK_FAULTS = ("down", "drop", "delay")
#: What a failed ``delay`` fault adds to its error: the usual cause.
NETEM_HINT = " (netem: this kernel lacks the sch_netem qdisc)"

_T = TypeVar("_T")

#: The variables of a node's ``network.env`` an agent takes: the network role's, and NCCL's and
#: libfabric's tuning knobs but those that load code or look for it (a plugin, a path).
_NETWORK_KEYS = frozenset({"GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "INFRACTL_NODE_ADDRESS"})
_NETWORK_PREFIXES = ("NCCL_", "FI_")
_LOADS_CODE = re.compile(r"PLUGIN|PATH|LIB")


class NodeControl(ABC):
    """How the control plane acts on a cluster's nodes, named by their inventory names.

    Processes are those carrying the cluster's markers (``infractl.proc``): what ``start`` ran,
    and everything it started. A node that cannot be reached is left out of a listing and named
    in ``unreachable`` (its processes are not known, not gone).
    """

    #: What ``cut_link`` can make on this provider's nodes (a subset of ``LINK_FAULTS``).
    link_faults: ClassVar[tuple[str, ...]] = ()
    #: Whether ``up`` keeps a node's other users off the cluster's ports and the instance metadata
    #: (the firewall role): where nodes are hosts of their own. Not where a node is the control
    #: machine itself (``local``): blocking its users' loopback would break the machine, and who
    #: uses it is its owner's business (SECURITY.md).
    guards_ports: ClassVar[bool] = False

    def __init__(self, state: ClusterState, nodes: Sequence[Node]) -> None:
        self.state = state
        self.nodes: dict[str, Node] = {n.name: n for n in nodes}
        self.unreachable: set[str] = set()

    def node(self, name: str) -> Node:
        return self.nodes[name]

    def each(self, nodes: Iterable[str], act: Callable[[str], _T]) -> list[_T]:
        """``act(node)`` for every node of ``nodes`` at once (each may wait on its node), in order."""
        names = list(nodes)
        if len(names) <= 1:
            return [act(n) for n in names]
        from concurrent.futures import ThreadPoolExecutor  # imported here: every CLI command imports this module

        with ThreadPoolExecutor(max_workers=len(names)) as pool:
            return list(pool.map(act, names))

    # -- commands and files ---------------------------------------------------------------------

    @abstractmethod
    def python(self, node: str) -> str:
        """The Python on ``node`` that runs infractl's node side and the trainer."""

    @abstractmethod
    def run(self, node: str, argv: Sequence[str], *, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``node`` to its end; the exit code left to the caller (255: unreachable)."""

    @abstractmethod
    def write_file(self, node: str, path: Path, text: str) -> None:
        """Write ``text`` to ``path`` on ``node`` (mode 0600, whole or not at all, parents made)."""

    @abstractmethod
    def read_file(self, node: str, path: Path) -> str | None:
        """The text of ``path`` on ``node``; None when there is no such file (or no node to ask)."""

    @abstractmethod
    def tail(self, node: str, path: Path, *, lines: int) -> list[str] | None:
        """The last ``lines`` lines of ``path`` on ``node`` (0: all), each with its newline; None
        when there is no such file."""

    @abstractmethod
    def tail_bytes(self, node: str, path: Path, *, size: int) -> bytes:
        """The last ``size`` bytes of ``path`` on ``node`` (empty when there is none)."""

    # -- the agent ------------------------------------------------------------------------------

    def network_env(self, node: str) -> dict[str, str]:
        """The collective-communication variables the network role wrote for ``node`` (its
        ``private/network.env``: GLOO/NCCL socket interfaces, the node's address); empty before
        Ansible ran. Read as a list of known keys, never sourced: any other line is left out."""
        text = self.read_file(node, workdir.network_env(self.node(node).workdir)) or ""
        found: dict[str, str] = {}
        for line in text.splitlines():
            key, sep, value = (part.strip() for part in line.partition("="))
            known = key in _NETWORK_KEYS or (key.startswith(_NETWORK_PREFIXES) and not _LOADS_CODE.search(key))
            if sep and known and re.fullmatch(r"[A-Z][A-Z0-9_]*", key) and value.isprintable():
                found[key] = value
        return found

    def agent_env(self, node: str) -> dict[str, str]:
        """What ``node``'s agent needs in its environment from its provider (none by default)."""
        return {}

    @abstractmethod
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
        """Start ``argv`` on ``node`` detached, in ``workdir``, with ``env`` (the cluster's markers
        included), its output and first ``header`` line appended to ``log_path`` on the node. The
        handle exits with the command's exit code (a local process, or the session that runs it).
        With ``image`` (pulled and verified by ``up``), ``argv`` runs in a container of it as the
        image's user, in the node's network, with ``workdir`` and ``mounts`` (folders of the node,
        a ``file://`` store say) at the same paths in it, and ``files`` (files of the node in a
        folder that user cannot enter) alone and read-only at the paths inside it they map to."""

    # -- processes ------------------------------------------------------------------------------

    @abstractmethod
    def processes(self, *, node: str | None = None, run: str | None = None) -> list[NodeProcess]:
        """The cluster's live processes on every node (or ``node``), optionally only ``run``'s."""

    @abstractmethod
    def signal(self, procs: Iterable[NodeProcess], sig: int) -> None:
        """Send ``sig`` to each of ``procs`` still running (never to a process that took a pid since)."""

    @abstractmethod
    def watch(self, run: str) -> Watch:
        """Watch ``run``'s processes on every node from now on (see ``Watch``)."""

    def running_runs(self) -> dict[str, set[str]]:
        """run id -> names of the nodes that have live processes of it."""
        runs: dict[str, set[str]] = {}
        for p in self.processes():
            if p.run is not None:
                runs.setdefault(p.run, set()).add(p.node)
        return runs

    def wait_gone(
        self, *, timeout: float, node: str | None = None, run: str | None = None, poll_s: float = 0.2
    ) -> list[NodeProcess]:
        """Wait up to ``timeout`` seconds for the matching processes to exit; return those alive."""
        return proc.wait_until_gone(lambda: self.processes(node=node, run=run), timeout=timeout, poll_s=poll_s)

    def stop_all(self, *, timeout: float, run: str | None = None) -> tuple[int, list[NodeProcess]]:
        """SIGKILL every process of the cluster (or of ``run``) on every node until none is left
        or ``timeout`` seconds passed (``proc.kill_until_gone``); (how many were signalled, those
        that survived)."""
        return proc.kill_until_gone(
            lambda: self.processes(run=run),
            lambda alive: self.signal(alive, signal.SIGKILL),
            timeout=timeout,
            key=lambda p: p.key,
        )

    # -- faults ---------------------------------------------------------------------------------

    @abstractmethod
    def kill_node(self, node: str, run: str) -> None:
        """``node`` dies at once: SIGKILL ``run``'s processes there and whatever else dies with the
        node, by ``proc.kill_until_gone`` for up to ``proc.KILL_NODE_S`` (anything slow to look up
        is looked up by the caller before: the fault's time is taken just before this call)."""

    def cut_link(self, node: str, fault: str, *, latency_ms: int = 0) -> dict[str, Any]:
        """Make ``fault`` (one of ``link_faults``) on ``node``'s link; what was done, for the
        drill's record. ``UsageError`` when this node has no link to cut or the fault cannot be
        made here (nothing changed then)."""
        raise UsageError(
            f"node {node!r} has no network link of its own to cut: partition needs a provider with node links (netns)",
            field="--node",
        )

    def restore_link(self, node: str, fault: str) -> None:
        """Undo ``cut_link``; ``InfractlError`` if the link could not be restored."""
        raise InfractlError(f"node {node!r} has no link to restore")

    # -- containers -----------------------------------------------------------------------------

    def containers(self, node: str) -> ContainerEngine:
        """How ``node`` runs containers: the Docker daemon of a GPU host, unless the provider says."""
        return DOCKER

    def remove_containers(self) -> list[str]:
        """Remove the cluster's containers and images from every node (``teardown``, after every
        process of the cluster stopped); the nodes whose stores were removed. Nothing to do where a
        node's disk goes with the node."""
        return []

    # -- configuration --------------------------------------------------------------------------

    @abstractmethod
    def ansible_host(self, node: str) -> dict[str, Any]:
        """The inventory variables by which Ansible reaches ``node`` (connection, interpreter)."""

    def host_group(self, node: str) -> str | None:
        """The inventory group of ``node`` (``gpu``, ``cpu``: the playbooks' targets), if any."""
        return None


class Watch(AbstractContextManager["Watch"], ABC):
    """A run's processes on every node as they change, kept current by one monitor per node (or
    one for all, on a provider whose nodes are this machine): each reports the run's processes
    on its node whenever the set changes (``infractl.proc.monitor``). Reading it costs nothing.

    A node not heard from yet (its monitor is starting) or not any more (its link is down) keeps
    its last report: its processes are not known to be gone.
    """

    def __init__(self, nodes: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self._reported: dict[str, list[NodeProcess]] = {}
        self._expected = set(nodes)
        self._heard = threading.Event()

    def report(self, node: str | None, procs: list[NodeProcess]) -> None:
        """A monitor's report: the run's processes on ``node`` (None: on every node, grouped here)."""
        with self._lock:
            if node is not None:
                self._reported[node] = procs
            else:
                for name in self._expected:
                    self._reported[name] = [p for p in procs if p.node == name]
            if self._expected <= set(self._reported):
                self._heard.set()

    def wait_reported(self, timeout: float) -> bool:
        """Wait until every node has reported once (a drill strikes only once it knows where the
        run's processes were); False when some did not within ``timeout`` seconds."""
        return self._heard.wait(timeout)

    def reported(self, node: str) -> list[NodeProcess] | None:
        """The run's processes on ``node`` as it last reported them; None before its first report."""
        with self._lock:
            return self._reported.get(node)

    def processes(self) -> list[NodeProcess]:
        """The run's processes as last reported by every node."""
        with self._lock:
            return [p for procs in self._reported.values() for p in procs]

    def nodes(self) -> set[str]:
        """The nodes that run a process of the run, as last reported."""
        return {p.node for p in self.processes()}

    def gone(self) -> bool:
        """Every node reported, and none has a process of the run left."""
        with self._lock:
            return self._expected <= set(self._reported) and not any(self._reported.values())

    def all_alive(self, procs: Iterable[NodeProcess]) -> bool:
        """Whether every one of ``procs`` is still running, as far as their nodes reported."""
        with self._lock:
            for p in procs:
                reported = self._reported.get(p.node)
                if reported is not None and p.key not in {q.key for q in reported}:
                    return False
        return True

    def none_alive(self, procs: Iterable[NodeProcess]) -> bool:
        """Whether every one of ``procs`` is gone, as their nodes reported (a node that has not
        reported since keeps its processes alive here)."""
        with self._lock:
            for p in procs:
                reported = self._reported.get(p.node)
                if reported is None or p.key in {q.key for q in reported}:
                    return False
        return True

    @abstractmethod
    def close(self) -> None:
        """Stop the monitors."""

    def __exit__(self, *exc: object) -> None:
        self.close()
