"""Where a cluster's own servers run (``ServerHost``): the rendezvous endpoint and the image
registry, outside every node's failure domain; this machine's (``LocalServers``) unless a provider
has a host of the cluster for them."""

from __future__ import annotations

import os
import socket
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import ClassVar

from infractl import proc
from infractl.errors import InfractlError
from infractl.statedir import ClusterState, write_private

__all__ = ["SERVER_START_S", "LocalServers", "ServerHost", "free_port", "port_open"]

#: Seconds a server (rendezvous endpoint, image registry) may take to listen once started.
SERVER_START_S = 60


class ServerHost(ABC):
    """Where the cluster's own servers run, outside every node's failure domain: the rendezvous
    endpoint and the image registry. Each server is named (``infractl.proc``'s node name for it)
    and listens on an address every node reaches."""

    python: str
    """The Python that runs infractl's servers there (in ``image`` when ``keep`` is given one)."""
    runs_image: ClassVar[bool] = False
    """infractl's servers run there from the cluster's image (``pull`` puts it there), not from
    this machine's Python."""
    home: Path
    """The folder the servers' files live in there."""

    @abstractmethod
    def keep(self, name: str, argv: Sequence[str], *, host: str, port: int, image: str | None = None) -> bool:
        """Keep server ``name`` (``argv``; in a container of ``image`` when given) listening on
        ``host:port``; whether it was started now. ``InfractlError`` when another process holds
        the port, or the server did not start."""

    @abstractmethod
    def new_port(self, name: str, host: str) -> int:
        """The port a new cluster's server ``name`` listens on at ``host``."""

    @abstractmethod
    def running(self, name: str, *, host: str, port: int) -> bool:
        """Whether server ``name`` runs (listening on ``host:port``)."""

    @abstractmethod
    def put(self, path: Path, text: str) -> None:
        """Write ``text`` to ``path`` there (0600, whole or not at all, parents made)."""

    def reach(self, host: str, port: int) -> AbstractContextManager[tuple[str, int]]:
        """The address this machine reaches ``host:port`` of the servers' host at, while the block
        runs (the same address, where this machine is on the nodes' network)."""
        return nullcontext((host, port))

    @abstractmethod
    def pull(self, reference: str, ca: Path) -> None:
        """Make the image ``reference`` (at the cluster's registry, whose CA is ``ca``) runnable
        there, for ``keep``'s ``image``."""

    @abstractmethod
    def stop(self) -> tuple[int, list[str]]:
        """Stop every server of the cluster: (how many were stopped, those that survived)."""


class LocalServers(ServerHost):
    """The servers on this machine, as processes with the cluster's markers (their logs in the
    state directory): ``teardown`` finds and stops them as it stops a node's."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.python = sys.executable
        self.home = state.dir

    def keep(self, name: str, argv: Sequence[str], *, host: str, port: int, image: str | None = None) -> bool:
        if image is not None:
            raise InfractlError(f"the {name} server of cluster {self.state.name!r} runs this machine's Python")
        if proc.find(self.state.dir, node=name) and port_open(host, port):
            return False
        if port_open(host, port):
            raise InfractlError(
                f"the {name} server's port {host}:{port} of cluster {self.state.name!r} is taken by "
                "another process; stop it, or run `infractl teardown` and `infractl up`"
            )
        env = {**os.environ, proc.CLUSTER_ENV: str(self.state.dir), proc.NODE_ENV: name}
        log = self.state.dir / f"{name}.log"
        child = proc.spawn(list(argv), env=env, cwd=self.state.dir, log_path=log)
        deadline = time.monotonic() + SERVER_START_S
        while not port_open(host, port):
            if child.poll() is not None or time.monotonic() > deadline:
                raise InfractlError(f"the {name} server did not start; see {log}")
            time.sleep(0.2)
        return True

    def new_port(self, name: str, host: str) -> int:
        return free_port(host)

    def running(self, name: str, *, host: str, port: int) -> bool:
        return bool(proc.find(self.state.dir, node=name))

    def put(self, path: Path, text: str) -> None:
        write_private(path, text)

    def pull(self, reference: str, ca: Path) -> None:
        """Nothing to do: the servers run this machine's Python."""

    def stop(self) -> tuple[int, list[str]]:
        """Everything left on this machine with the cluster's marker: the servers, and anything of
        a node that did not answer (on providers whose nodes are this machine)."""
        stopped, alive = proc.kill_all(self.state.dir, timeout=20)
        return stopped, [str(p.pid) for p in alive]


def free_port(host: str) -> int:
    """A TCP port free on ``host`` of this machine now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on ``host:port``, as seen from this machine."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0
