"""The interface every provider implements: how a cluster's nodes are made (Terraform variables,
preflight, what destroy may leave behind) and how the control plane reaches them once they are
(``NodeControl``: run a command on a node, start its agent, find, signal and watch a run's
processes, read its logs, inject the faults the drills need).

Nothing outside ``infractl/providers/`` knows what a node is: callers name nodes and hold
``NodeProcess`` records, and ask the cluster's ``NodeControl`` (``providers.control(state)``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from infractl import proc
from infractl.config import ClusterSpec, ProviderConfig, register_provider
from infractl.errors import InfractlError, UsageError
from infractl.infra import ApplyResult, Node, RootSettings
from infractl.planning.devices import Device, shared_cpu
from infractl.proc import NodeProcess
from infractl.statedir import ClusterState, Orphan, write_private

__all__ = [
    "DOCKER",
    "IMAGE_PYTHON",
    "LINK_FAULTS",
    "ContainerEngine",
    "LocalServers",
    "NodeControl",
    "Provider",
    "SERVER_START_S",
    "ServerHost",
    "Watch",
    "free_port",
    "port_open",
    "provider_named",
    "register",
]

#: How a node's link can fail (``drill partition --kind``): ``down`` (the node's interface goes
#: down: its sockets see the network vanish), ``drop`` (packets vanish silently both ways, the link
#: still up), ``delay`` (latency on everything the node sends). A provider makes those it can.
LINK_FAULTS = ("down", "drop", "delay")
#: What a failed ``delay`` fault adds to its error: the usual cause.
NETEM_HINT = " (netem: this kernel lacks the sch_netem qdisc)"

#: The trainer image's Python, first on its PATH (images/trainer/README.md's contract).
IMAGE_PYTHON = "python"
#: The trainer image's user, ``trainer``, and its group (the same contract): the trainer's
#: container runs as it, so a node's root is never the trainer's.
IMAGE_UID = 10001
#: Where the trainer's container finds the files of its run that the launcher hands it (its spec,
#: its key), each mounted there alone and read-only: the folder they live in on the node is root's.
IMAGE_RUN_DIR = Path("/run/infractl")

#: Seconds a server (rendezvous endpoint, image registry) may take to listen once started.
SERVER_START_S = 60

_T = TypeVar("_T")


class Provider(ABC):
    """One kind of node. ``up``, ``teardown`` and ``up --dry-run`` call these and never branch on
    the provider themselves."""

    name: ClassVar[str]
    #: The nodes pull the pinned image from the cluster's own registry (``image_registry_host``).
    serves_images: ClassVar[bool] = False
    #: The nodes share this machine's user accounts: what ``up`` made there for the access roles
    #: (Unix groups) outlives ``terraform destroy`` and is removed by ``teardown``. (A real node's
    #: groups go with the machine.)
    shares_host_accounts: ClassVar[bool] = False

    @abstractmethod
    def variables(self, spec: ClusterSpec, state: ClusterState) -> dict[str, object]:
        """The Terraform variables of ``infra/<provider>/`` for the cluster."""

    @abstractmethod
    def dry_run(self, spec: ClusterSpec, state: ClusterState) -> dict[str, Any]:
        """What ``up`` would create (variables, resource addresses, hourly cost or None), computed
        offline and changing nothing."""

    @abstractmethod
    def preflight(self, spec: ClusterSpec, state: ClusterState) -> None:
        """What this machine must offer before ``up`` changes anything (a ``UsageError`` or
        ``ConfigError`` naming the field otherwise)."""

    def root_settings(self, spec: ClusterSpec, state: ClusterState) -> RootSettings:
        """What the root module that calls ``infra/<provider>/`` adds (provider and backend blocks,
        outputs, the Terraform CLI configuration): nothing where the module needs no provider."""
        return RootSettings()

    def device(self, spec: ClusterSpec, environ: Mapping[str, str]) -> Device:
        """The device each rank of the cluster trains on, as ``up`` provisions it (``train`` refuses
        a run that does not fit it). Here: nodes on this machine, whose ranks share its memory,
        or the emulated device ``$INFRACTL_DEVICE_MEMORY`` in ``environ`` sets."""
        return shared_cpu(spec.nodes * spec.processes_per_node, environ)

    def provisioned(self, spec: ClusterSpec, state: ClusterState, applied: ApplyResult) -> list[Node]:
        """The nodes of an apply, as the control plane reaches them (the module's inventory, where
        it says all of that itself)."""
        return applied.nodes

    def topology(self, state: ClusterState) -> list[str]:
        """What the handover's topology says of a cluster that is up beyond its nodes (one line of
        Markdown each): where its hosts run, what they are. Nothing by default."""
        return []

    def makes_store(self, spec: ClusterSpec) -> bool:
        """Whether the module creates the cluster's store (so it cannot be checked before ``up``
        applies it)."""
        return False

    @abstractmethod
    def rendezvous_host(self, spec: ClusterSpec, state: ClusterState) -> str:
        """The address the cluster's rendezvous endpoint listens on, reachable from every node."""

    def image_registry_host(self, spec: ClusterSpec, state: ClusterState) -> str | None:
        """Where the cluster's own image registry listens (``infractl.image.registry``), reachable
        from every node (once provisioned); None where the nodes run no image (``local``)."""
        return None

    def servers(self, state: ClusterState) -> ServerHost:
        """Where the cluster's own servers run (the rendezvous endpoint, the image registry): this
        machine, unless the provider has a host of the cluster for them."""
        return LocalServers(state)

    def before_destroy(self, state: ClusterState, record: dict[str, Any], *, purge: bool) -> list[str]:
        """Just before ``terraform destroy`` (every process stopped, and with ``purge`` every run
        deleted): make the state say what destroy may remove. Lines saying what was done."""
        return []

    def reap(self, state: ClusterState, record: dict[str, Any], *, purge: bool) -> list[str]:
        """After ``terraform destroy`` of an ``up`` that was interrupted (its Terraform state may
        lack what it made last): delete what is still the cluster's by the provider's own marks
        (its tag), the store it made too with ``purge``. What was deleted, one item each; nothing
        where destroy leaves nothing unnamed."""
        return []

    @abstractmethod
    def leftovers(self, state: ClusterState, record: dict[str, Any]) -> list[str]:
        """After ``terraform destroy`` (and after every node process was stopped): what of the
        cluster still exists, one line each (empty when nothing is left)."""

    @abstractmethod
    def control(self, state: ClusterState, nodes: Sequence[Node]) -> NodeControl:
        """How the control plane reaches ``nodes`` (the cluster's, as provisioned)."""

    def orphans(self, owned: set[str]) -> list[Orphan]:
        """What the provider makes on this machine under a cluster's ``short_id`` and no started
        cluster (``owned``: their ids) owns: an interrupted test run's, a deleted state
        directory's. Nothing where it makes nothing outside the state directory."""
        return []

    def account_orphans(self, spec: ClusterSpec) -> list[Orphan]:
        """What the provider's account holds, where ``spec`` points (its account and region), of
        clusters whose state is gone from everywhere, not just from this machine. Nothing for a
        provider whose clusters live on this machine alone."""
        return []


_PROVIDERS: dict[str, Provider] = {}


def register(provider: Provider, config: ProviderConfig) -> None:
    """Make ``provider`` known, and its cluster.yaml section with it (each provider module calls
    this once, when it is imported)."""
    if config.name != provider.name:
        raise ValueError(f"provider {provider.name!r} registers the config of {config.name!r}")
    _PROVIDERS[provider.name] = provider
    register_provider(config)


def provider_named(name: str) -> Provider:
    """The provider ``name`` (one of cluster.yaml's ``provider`` values)."""
    return _PROVIDERS[name]


def every_provider() -> list[Provider]:
    return list(_PROVIDERS.values())


@dataclass(frozen=True)
class ContainerEngine:
    """How a node runs containers (the ``container_runtime`` and ``trainer_image`` roles, and the
    launcher, run ``argv`` on the node)."""

    argv: tuple[str, ...]
    """The engine's command with the node's own options (its image store, runtime, cgroup manager)."""
    home: Path | None
    """The node's own image store and trusted registry CAs (``storage/``, ``certs/``); None where
    the engine keeps its system-wide ones (a Docker daemon)."""
    runroot: Path | None = None
    """The node's own run state (podman's ``--runroot``: a short path, sockets live there)."""
    run_options: tuple[str, ...] = ()
    """What ``run`` needs on this node besides the launcher's options (limits, devices)."""
    named_options: tuple[str, ...] = ()
    """What ``run`` needs for a named container (replacing one that a killed node left behind)."""
    certs_dir: Path | None = None
    """Where an engine with a system-wide store trusts a registry's CA: ``<certs_dir>/<host:port>/ca.crt``."""

    def run_prefix(
        self,
        *,
        name: str | None = None,
        labels: Mapping[str, str] | None = None,
        env: Iterable[str] = (),
        volumes: Iterable[Path] = (),
        files: Mapping[Path, Path] | None = None,
        workdir: Path | None = None,
        confined: bool = False,
    ) -> list[str]:
        """The command line before the image and its command that runs a container as a process
        of the node would run: in the node's network, PID and IPC namespaces (collectives bind the
        node's address; status, drills and ``kill`` find and signal its processes as the node's),
        never pulling (``up`` pulled and verified the image). ``confined`` (the trainer's: code a
        run brings runs there) runs as the image's user (``IMAGE_UID``) with no capability and no
        way to gain one (setuid binaries included); otherwise as root (infractl's own node side,
        which reads and signals every process of the node, the trainer's user's among them).
        ``env``: names of variables passed from the caller's environment; ``volumes``: folders at
        the same paths inside; ``files``: files of the node (keys) mounted read-only at the paths
        inside (values)."""
        return [
            *self.argv,
            "run",
            "--rm",
            *([f"--name={name}", *self.named_options] if name else []),
            "--pull=never",
            "--network=host",
            "--pid=host",
            "--ipc=host",
            *(
                [f"--user={IMAGE_UID}:{IMAGE_UID}", "--cap-drop=ALL", "--security-opt=no-new-privileges"]
                if confined
                # Reading another user's /proc/PID/environ (the trainer's markers) takes CAP_SYS_PTRACE.
                else ["--user=root", "--cap-add=SYS_PTRACE"]
            ),
            *([f"--workdir={workdir}"] if workdir else []),
            *self.run_options,
            *(f"--label={key}={value}" for key, value in (labels or {}).items()),
            *(f"--env={variable}" for variable in env),
            *(f"--volume={path}:{path}" for path in volumes),
            *(f"--volume={path}:{inside}:ro" for path, inside in (files or {}).items()),
        ]

    def remove_store(self) -> None:
        """Every container and image of the engine's own store (run from this machine, which holds
        it), then the store and the run root; ``InfractlError`` when the engine cannot. The engine
        unmounts what it mounted; what a reset cut short left mounted is unmounted here."""
        assert self.home is not None, "an engine with a system-wide store keeps it"
        for attempt in range(_RESET_ATTEMPTS):
            # A container killed a moment ago may still be removing its files from the run root
            # ("directory not empty"): the next attempt finds it gone.
            done = proc.run([*self.argv, "system", "reset", "--force"], timeout=120)
            if done.returncode == 0:
                break
            time.sleep(2 * (attempt + 1))
        if done.returncode != 0:
            raise InfractlError(f"could not remove its containers and images: {proc.last_line(done.stderr)}")
        proc.remove_tree(self.home)
        if self.runroot is not None:
            proc.remove_tree(self.runroot)


# How many times an engine's `system reset` runs before the removal of its store gives up.
_RESET_ATTEMPTS = 3


#: A GPU host's engine: Docker's daemon, with its system-wide store.
DOCKER = ContainerEngine(argv=("/usr/bin/docker",), home=None, certs_dir=Path("/etc/docker/certs.d"))


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
