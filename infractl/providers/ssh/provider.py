"""The ``ssh`` provider (``Ssh``): the team's own machines. It creates none (no Terraform module):
``up`` checks every host first (``hosts.check_hosts``), records them on this machine for ``gc``,
and configures them with the roles every provider's nodes get; the trainer and infractl's node
side run in the pinned image with the cluster's own image store on each host; ``teardown``
removes what infractl put there and proves nothing of it is left, and never touches anything else.
"""

from __future__ import annotations

import functools
import json
import shlex
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from infractl import image, proc
from infractl.config import ClusterSpec
from infractl.errors import ConfigError, InfractlError, UsageError
from infractl.infra import ApplyResult
from infractl.node import Node, SshLogin
from infractl.planning.devices import CATALOG, Device, shared_cpu
from infractl.providers.contract import KeyScan, Plan, Provider
from infractl.providers.engines import ContainerEngine
from infractl.providers.nodecontrol import NodeControl
from infractl.providers.remote import ImageNodes, RemoteServers
from infractl.providers.servers import LocalServers, ServerHost
from infractl.providers.ssh.hosts import (
    CONTAINERS,
    RUNROOTS,
    HostRecord,
    Reached,
    absent_footprints,
    check_hosts,
    clean_host,
    left_on_host,
    scan_keys,
)
from infractl.providers.ssh.spec import CONFIG, ControllerHost, SshSpec, ssh_settings
from infractl.statedir import ClusterIntent, ClusterState, Orphan

__all__ = ["Ssh", "SshHosts"]

# The controller's name among the hosts infractl reaches.
_CONTROLLER = "controller"
# Free space a host needs besides the image's layers (its unpacked copy, the logs, a checkpoint's staging).
_FREE_MARGIN = 1 << 30


def engine(workdir: Path, short_id: str, node: str) -> ContainerEngine:
    """podman with the cluster's own image store in the host's work directory and its own run
    state: the team's own containers and images are never listed, pulled over or removed. The
    runtime, cgroup manager and limits are the host's own configuration (containers.conf)."""
    home, runroot = workdir / CONTAINERS, RUNROOTS / f"{short_id}-{node}"
    return ContainerEngine.podman_own_store(home, runroot)


def _workdir(spec: ClusterSpec) -> Path:
    return Path(ssh_settings(spec).workdir) / spec.name


def _login(ssh: SshSpec, user: str | None, port: int | None, key: str | None) -> SshLogin:
    jump = None
    if ssh.jump is not None:
        jump = f"ssh://{ssh.jump.user or ssh.user}@{ssh.jump.address}:{ssh.jump.port}"
    return SshLogin(
        user=user or ssh.user,
        identity_file=Path(key or ssh.key),
        known_hosts=Path(ssh.known_hosts),
        jump=jump,
        port=port or ssh.port,
    )


def _nodes(spec: ClusterSpec) -> list[Node]:
    ssh = ssh_settings(spec)
    return [
        Node(
            host.name,
            host.address,
            workdir=_workdir(spec),
            processes=spec.processes_per_node,
            ssh=_login(ssh, host.user, host.port, host.key),
        )
        for host in ssh.hosts
    ]


def _controller(spec: ClusterSpec) -> Node | None:
    ssh = ssh_settings(spec)
    if not isinstance(ssh.controller, ControllerHost):
        return None
    c = ssh.controller
    return Node(_CONTROLLER, c.address, workdir=_workdir(spec), processes=0, ssh=_login(ssh, c.user, c.port, c.key))


def _reached(node: Node) -> Reached:
    assert node.ssh is not None
    return Reached(node.name, node.address, node.ssh)


def _route_source(address: str) -> str:
    """This machine's address on its route to ``address``: where that host reaches it."""
    done = proc.run(["ip", "-json", "route", "get", address], timeout=10)
    routes = json.loads(done.stdout or "[]") if done.returncode == 0 else []
    source = routes[0].get("prefsrc") if routes else None
    if not source:
        raise UsageError(
            f"this machine has no route to {address} (controller: local serves the hosts from this machine)",
            field="ssh.controller",
        )
    return str(source)


class Ssh(Provider):
    name = "ssh"
    config = CONFIG
    serves_images = True

    def dry_run(self, spec: ClusterSpec, state: ClusterState) -> Plan:
        """Nothing is created: the hosts are the team's; ``up`` configures each of them."""
        ssh = ssh_settings(spec)
        controller = ssh.controller if isinstance(ssh.controller, str) else f"{ssh.controller.address}"
        return Plan(
            provider=self.name,
            module=None,
            region=None,
            variables={},
            resources=(),
            cost=None,
            cost_note=(
                f"the team's own hosts ({', '.join(f'{h.name} {h.address}' for h in ssh.hosts)}; controller "
                f"{controller}): up creates no machine and configures each"
            ),
        )

    def device(self, spec: ClusterSpec, environ: Mapping[str, str]) -> Device:
        """``ssh.device`` from the planner's catalog; else the hosts' CPUs: a host's memory (taken to
        be this machine's) shared by its ranks, or the emulated device ``environ`` sets."""
        named = ssh_settings(spec).device
        return CATALOG[named] if named is not None else shared_cpu(spec.processes_per_node, environ)

    def preflight(self, spec: ClusterSpec, state: ClusterState) -> None:
        """This machine's ssh and the pinned keys file, then every host at once: reachable with its
        pinned key, root or password-less sudo, Linux with Python for Ansible, podman and iptables,
        free space for the image, its clock, its GPUs. One line per problem, every host named."""
        ssh = ssh_settings(spec)
        missing = [tool for tool in ("ssh", "ssh-keyscan", "ip") if shutil.which(tool) is None]
        if missing:
            raise UsageError(f"provider ssh needs {', '.join(missing)} on this machine (openssh-client, iproute2)")
        for field, path in (("ssh.key", ssh.key), ("ssh.known_hosts", ssh.known_hosts)):
            if not Path(path).is_file():
                hint = " (`infractl keyscan` writes it)" if field == "ssh.known_hosts" else ""
                raise ConfigError(f"{path} does not exist{hint}", field=field)
        digest = (spec.runtime.image or "").rpartition("@")[2]
        layout = image.locate(digest) if digest else None
        size = sum(p.stat().st_size for p in layout.rglob("*") if p.is_file()) if layout is not None else 0
        controller = _controller(spec)
        problems = check_hosts(
            [(_reached(node), host.gpus) for node, host in zip(_nodes(spec), ssh.hosts, strict=True)],
            _reached(controller) if controller is not None else None,
            ssh.workdir,
            free_bytes=2 * size + _FREE_MARGIN,
        )
        if problems:
            raise ConfigError(
                f"{len(problems)} problem(s) with the hosts, nothing was changed: " + "; ".join(problems),
                field="ssh.hosts",
            )
        if controller is None:
            _route_source(ssh.hosts[0].address)

    def provisioned(self, spec: ClusterSpec, state: ClusterState, applied: ApplyResult | None) -> list[Node]:
        """The hosts as they are; recorded on this machine first (``HostRecord``), so that ``gc``
        finds them should the state directory go without a teardown, with the ``FOOTPRINTS`` each
        host lacks before the cluster's first ``up`` touches it. A host an earlier ``up`` configured
        and cluster.yaml no longer names stays in the record: ``teardown`` cleans it too."""
        nodes = _nodes(spec)
        controller = _controller(spec)
        hosts = [*nodes, *([controller] if controller is not None else [])]
        previous = HostRecord.load(state.short_id)
        if previous is not None:
            hosts += [host for host in previous.hosts if host.name not in {h.name for h in hosts}]
        known = previous.absent if previous is not None else {}
        new = [host for host in hosts if host.name not in known]
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(new)))) as pool:
            probed = dict(
                zip((h.name for h in new), pool.map(lambda h: absent_footprints(_reached(h)), new), strict=True)
            )
        HostRecord(
            short_id=state.short_id,
            name=spec.name,
            cluster_dir=str(state.dir),
            workdir=str(_workdir(spec)),
            base=ssh_settings(spec).workdir,
            hosts=tuple(hosts),
            absent={host.name: known[host.name] if host.name in known else probed[host.name] for host in hosts},
        ).save()
        return nodes

    def notes(self, spec: ClusterSpec) -> list[str]:
        """With ``controller: local``, that the run depends on this machine."""
        if ssh_settings(spec).controller != "local":
            return []
        return [
            "controller: local: the rendezvous endpoint and the image registry run on this machine, so every run "
            "depends on it staying up and reachable from the hosts"
        ]

    def lost_node(self, spec: ClusterSpec) -> str:
        """The host is the team's: repaired, or replaced in cluster.yaml."""
        return (
            "The host is the team's own machine: infractl cannot make it again. Repair it and bring it back "
            "(its sshd answering with its pinned key), or replace it: a new entry in cluster.yaml's `ssh.hosts` "
            "(its key checked and pinned with `infractl keyscan -c CLUSTER.yaml`), then `infractl up -c "
            "CLUSTER.yaml` configures it and `infractl rejoin NODE --run RUN` takes it into the run. The run goes "
            "on on the surviving hosts meanwhile."
        )

    def topology(self, state: ClusterState) -> list[str]:
        spec = state.spec()
        ssh = ssh_settings(spec)
        hosts = ", ".join(f"{h.name} `{h.address}`" + (f" ({h.gpus} GPU)" if h.gpus else "") for h in ssh.hosts)
        controller = (
            "this machine (`controller: local`: the run depends on it staying up and reachable)"
            if ssh.controller == "local"
            else f"host `{ssh.controller.address}`"
        )
        jump = f"; reached through the jump host `{ssh.jump.address}`" if ssh.jump is not None else ""
        return [
            f"The team's own hosts (provider ssh, logged in as `{ssh.user}` with pinned host keys{jump}): {hosts}.",
            f"Rendezvous endpoint and image registry: {controller}. infractl keeps everything it puts on a host "
            f"under `{_workdir(spec)}`; a host that does not come back is the team's to repair or replace.",
        ]

    def rendezvous_host(self, spec: ClusterSpec, state: ClusterState) -> str:
        """The controller host's address, or with ``controller: local`` this machine's address on
        its route to the hosts."""
        ssh = ssh_settings(spec)
        if isinstance(ssh.controller, ControllerHost):
            return ssh.controller.address
        return _route_source(ssh.hosts[0].address)

    def image_registry_host(self, spec: ClusterSpec, state: ClusterState) -> str | None:
        return self.rendezvous_host(spec, state)

    def servers(self, state: ClusterState) -> ServerHost:
        spec = state.read_intent().spec
        controller = _controller(spec)
        if controller is None:
            return LocalServers(state)
        assert isinstance((settings := ssh_settings(spec)).controller, ControllerHost)
        ports = {"rendezvous": settings.controller.rendezvous_port, "registry": settings.controller.registry_port}
        return RemoteServers(
            state, controller, engine=engine(controller.workdir, state.short_id, _CONTROLLER), ports=ports
        )

    def control(self, state: ClusterState, nodes: Sequence[Node]) -> NodeControl:
        return SshHosts(state, nodes)

    def scan_host_keys(self, spec: ClusterSpec) -> KeyScan:
        """Every host's key as it offers it now, for the operator to confirm: the jump host's first,
        directly, then the others from the jump host, logged in with the login key and trusting only
        the key the jump host just offered (pinned nowhere until the operator confirms it)."""
        ssh = ssh_settings(spec)
        hosts = [(h.name, h.address, h.port or ssh.port) for h in ssh.hosts]
        if isinstance(ssh.controller, ControllerHost):
            hosts.append((_CONTROLLER, ssh.controller.address, ssh.controller.port or ssh.port))
        if ssh.jump is None:
            return KeyScan(path=Path(ssh.known_hosts), entries=tuple(scan_keys(hosts, None)))
        found = scan_keys([("jump", ssh.jump.address, ssh.jump.port)], None)
        with tempfile.TemporaryDirectory() as scratch:
            offered = Path(scratch) / "jump_known_hosts"
            offered.write_text("".join(f"{line}\n" for _, line in found))
            login = SshLogin(ssh.jump.user or ssh.user, Path(ssh.key), offered, port=ssh.jump.port)
            found += scan_keys(hosts, Reached("jump", ssh.jump.address, login))
        return KeyScan(path=Path(ssh.known_hosts), entries=tuple(found))

    def before_destroy(self, state: ClusterState, record: ClusterIntent, *, purge: bool) -> list[str]:
        """Every process stopped: remove what infractl put on each host (``clean_host``)."""
        recorded = _record(state, record)
        _clean(recorded)
        return [f"hosts: removed what infractl put on {', '.join(n.name for n in recorded.hosts)}"]

    def leftovers(self, state: ClusterState, record: ClusterIntent) -> list[str]:
        """What of the cluster is still on its hosts (``left_on_host``); once nothing is, this
        machine's record of the hosts goes too."""
        return _left(_record(state, record))

    def orphans(self, owned: set[str]) -> list[Orphan]:
        """The hosts of a cluster this machine configured whose state is gone (no started cluster
        has its ``short_id``): cleaned as ``teardown`` would."""
        return [
            Orphan(
                "ssh cluster",
                f"{recorded.name} on {', '.join(f'{n.name} ({n.address})' for n in recorded.hosts)}",
                functools.partial(_collect, recorded),
            )
            for recorded in HostRecord.every()
            if recorded.short_id not in owned
        ]


def _record(state: ClusterState, record: ClusterIntent) -> HostRecord:
    """This machine's record of the cluster's hosts; without one (an ``up`` stopped before it wrote
    it: nothing was done to a host yet), the hosts cluster.yaml names, with no footprint of ours."""
    recorded = HostRecord.load(state.short_id)
    if recorded is not None:
        return recorded
    hosts = (*_nodes(record.spec), *([c] if (c := _controller(record.spec)) is not None else []))
    return HostRecord(
        short_id=state.short_id,
        name=record.name,
        cluster_dir=str(state.dir),
        workdir=str(_workdir(record.spec)),
        base=ssh_settings(record.spec).workdir,
        hosts=hosts,
        absent={host.name: [] for host in hosts},
    )


def _clean(recorded: HostRecord) -> None:
    """``clean_host`` on every host of ``recorded`` at once. ``InfractlError`` naming every host
    that could not be cleaned."""
    failed: list[str] = []

    def clean(node: Node) -> None:
        try:
            clean_host(
                _reached(node),
                workdir=Path(recorded.workdir),
                base=Path(recorded.base),
                cluster_dir=recorded.cluster_dir,
                short_id=recorded.short_id,
                engine=engine(Path(recorded.workdir), recorded.short_id, node.name).argv,
                absent=recorded.absent.get(node.name, []),
            )
        except InfractlError as exc:
            failed.append(exc.message)

    with ThreadPoolExecutor(max_workers=min(16, len(recorded.hosts))) as pool:
        list(pool.map(clean, recorded.hosts))
    if failed:
        raise InfractlError("; ".join(failed))


def _left(recorded: HostRecord) -> list[str]:
    """What of the cluster is still on the hosts of ``recorded``; the record goes once nothing is."""

    def left(node: Node) -> list[str]:
        return left_on_host(
            _reached(node),
            workdir=Path(recorded.workdir),
            cluster_dir=recorded.cluster_dir,
            short_id=recorded.short_id,
            absent=recorded.absent.get(node.name, []),
        )

    with ThreadPoolExecutor(max_workers=min(16, len(recorded.hosts))) as pool:
        found = [item for items in pool.map(left, recorded.hosts) for item in items]
    if not found:
        recorded.remove()
    return found


def _collect(recorded: HostRecord) -> None:
    """``gc``'s removal of a cluster whose state is gone: clean every host, then prove it."""
    _clean(recorded)
    if found := _left(recorded):
        raise InfractlError(f"left on the hosts after cleaning: {'; '.join(found)}")


class SshHosts(ImageNodes):
    """The team's hosts over SSH, each with the cluster's own image store in its work directory."""

    def containers(self, node: str) -> ContainerEngine:
        return engine(self.node(node).workdir, self.state.short_id, node)

    def ansible_host(self, node: str) -> dict[str, object]:
        """A host has no work directory yet: the base role makes it."""
        return super().ansible_host(node) | {"base_create_workdir": True}

    def remove_containers(self) -> list[str]:
        """Every container and image of the cluster's store on each host, then the store (``teardown``;
        the team's own containers are in another store and stay)."""

        def reset(name: str) -> str:
            argv = self.containers(name).argv
            home = shlex.quote(str(self.node(name).workdir / CONTAINERS))
            done = self._ask(
                name,
                f"if [ -d {home}/storage ]; then {shlex.join(argv)} system reset --force >/dev/null; fi && "
                f"rm -rf -- {home}",
                timeout=300,
            )
            if done.returncode != 0:
                raise InfractlError(
                    f"{name}: could not remove its containers and images: {proc.last_line(done.stderr)}"
                )
            return name

        return self.each(self.nodes, reset)
