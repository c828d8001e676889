"""The ``netns`` provider: a multi-host cluster on one Linux machine. A node is a network namespace
(``infractl-<id>-<i>``) plugged into the cluster's bridge (``ixb<id>``) by a veth pair
(``ixv<id>-<i>``, ``eth0`` inside), with its own address on a private /24 and its own sshd that
accepts only the cluster's key; infra/netns makes them. Ansible and the control plane reach the
nodes over SSH, as they would reach other machines (``remote.SshNodes``), collectives run between
the nodes' addresses, and the rendezvous endpoint listens on the bridge's host side (.1), outside
every node. The filesystem is shared: a node's work directory is under the state directory as on
``local``, and its Python is this machine's.

With ``runtime.image`` the trainer runs in that image: the cluster's registry (``infractl.image.
registry``) listens beside the rendezvous endpoint, and each node runs podman (daemonless) with
its own image store under ``<state>/containers/<node>/``, so every node truly pulls and keeps its
own copy although the nodes share this machine's disk.

Faults a real machine gets from its hypervisor come from this machine, which holds the
namespaces: a killed node loses every process in its namespace but its sshd (so it can be
reached again), and its link is cut on the bridge or inside the namespace.

``<id>`` is the state directory's ``short_id``: interface names may have 15 characters at most.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import re
import resource
import shlex
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import psutil
from pydantic import Field, field_validator

from infractl import infra, proc
from infractl.config import ClusterSpec, ProviderConfig, Spec
from infractl.errors import ConfigError, InfractlError, UsageError
from infractl.node import Node
from infractl.providers.contract import Plan, Provider
from infractl.providers.engines import ContainerEngine
from infractl.providers.local import node_directories
from infractl.providers.nodecontrol import LINK_FAULTS, NETEM_HINT, NodeControl
from infractl.providers.remote import SshNodes
from infractl.statedir import ClusterIntent, ClusterState, Orphan, abandoned

__all__ = ["Netns", "NetnsNodes", "NetnsSpec"]

_SSHD = "/usr/sbin/sshd"
# Commands the module's provisioners and the launcher run, and the Debian package of each.
_TOOLS = {
    "ip": "iproute2",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "unshare": "util-linux",
    "nsenter": "util-linux",
}
# What a cluster with runtime.image needs besides: the nodes' engine, the registry, the copy into it.
_IMAGE_TOOLS = {"podman": "podman", "runc": "runc", "docker-registry": "docker-registry", "skopeo": "skopeo"}
# Where the nodes' container engines keep their run state.
_RUNROOTS = Path("/run/infractl")
# What the netns provider names after a cluster's short_id (``id``), for ``gc``: the nodes'
# namespaces, the bridge and the veths' host ends, the container run roots, and the sshd config
# path of a node (its cluster's state directory, ``dir``).
_NAMESPACE = re.compile(r"infractl-(?P<id>[0-9a-f]{6})-\d+")
_INTERFACE = re.compile(r"ix[bv](?P<id>[0-9a-f]{6})(-\d+)?")
_RUNROOT = re.compile(r"(?P<id>[0-9a-f]{6})-.+")
_GUARD = re.compile(r"-N (?P<chain>ixg(?P<id>[0-9a-f]{6}))")
_SSHD_CONFIG = re.compile(r"-f (?P<dir>\S+)/ssh/nodes/")
# The most processes a container may have (RLIMIT_NPROC) that runc accepted on this machine.
_MAX_NPROC = 32768
# A default subnet is one of the /24s of 10.200.0.0/13, picked by the state directory's hash.
_DEFAULT_BLOCK = ipaddress.IPv4Network("10.200.0.0/13")


class NetnsSpec(Spec):
    """The `netns` provider's settings (infra/netns's variables; its README describes them)."""

    subnet: str | None = Field(
        None,
        description=(
            "Private IPv4 /24 of the cluster's bridge, e.g. 10.213.7.0/24: the host side is .1 (the rendezvous "
            "endpoint), node i is .(i+2). Default: one of 10.200.0.0/13 picked from the cluster's state directory."
        ),
    )

    @field_validator("subnet")
    @classmethod
    def _private_slash_24(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            network = ipaddress.IPv4Network(value)
        except ValueError:
            raise ValueError(f"{value!r} is not an IPv4 network in CIDR form (e.g. 10.213.7.0/24)") from None
        if network.prefixlen != 24 or not network.is_private:
            raise ValueError(f"{value!r} must be a private /24 (10.x.y.0/24, 172.16-31.x.0/24 or 192.168.x.0/24)")
        return str(network)


def _subnet(spec: ClusterSpec, state: ClusterState) -> ipaddress.IPv4Network:
    """The cluster's /24: ``netns.subnet``, or one picked from the state directory."""
    settings = spec.settings(NetnsSpec)
    if settings is not None and settings.subnet is not None:
        return ipaddress.IPv4Network(settings.subnet)
    index = int(state.short_id, 16) % (_DEFAULT_BLOCK.num_addresses // 256)
    return ipaddress.IPv4Network((int(_DEFAULT_BLOCK.network_address) + index * 256, 24))


def _bridge(state: ClusterState) -> str:
    return f"ixb{state.short_id}"


def _guard(state: ClusterState) -> str:
    """The iptables chain that lets only the nodes reach the bridge's host side (infra/netns)."""
    return f"ixg{state.short_id}"


def _ip_json(*args: str) -> list[dict[str, Any]]:
    """What ``ip -json ARGS`` lists (nothing when ip fails)."""
    listed = proc.run(["ip", "-json", *args])
    return list(json.loads(listed.stdout or "[]")) if listed.returncode == 0 else []


def _index(node: str) -> int:
    """A node's index: infra/netns names node i ``node-<i>``."""
    return int(node.rpartition("-")[2])


def _namespace(state: ClusterState, node: str) -> str:
    """The network namespace of ``node``, as infra/netns names it: ``infractl-<id>-<index>``."""
    return f"infractl-{state.short_id}-{_index(node)}"


def _namespaces(state: ClusterState) -> list[str]:
    """The cluster's namespaces that exist on this machine now."""
    return sorted(e["name"] for e in _ip_json("netns", "list") if e["name"].startswith(f"infractl-{state.short_id}-"))


class Netns(Provider):
    name = "netns"
    config = ProviderConfig(
        name="netns",
        help=(
            "nodes are network namespaces on this machine, each with its own address on a bridge and its own "
            "sshd (Linux, root)."
        ),
        section=NetnsSpec,
        section_help="The `netns` provider's settings; only with provider: netns.",
    )
    serves_images = True
    # The nodes are namespaces of this machine: its accounts are theirs.
    shares_host_accounts = True

    def terraform_module(self) -> Path:
        """infra/netns: the nodes' namespaces, their bridge and sshds."""
        return infra.module_dir(self.name)

    def variables(self, spec: ClusterSpec, state: ClusterState) -> dict[str, object]:
        return {
            "cluster_name": spec.name,
            "cluster_id": state.short_id,
            "nodes": spec.nodes,
            "processes_per_node": spec.processes_per_node,
            "state_dir": str(state.dir),
            "subnet": str(_subnet(spec, state)),
            "sshd": _SSHD,
        }

    def dry_run(self, spec: ClusterSpec, state: ClusterState) -> Plan:
        """infra/netns makes the key pair, the bridge, its guard and one ``terraform_data.node`` per node."""
        return Plan(
            provider=self.name,
            module=f"infra/{self.name}",
            region=None,
            variables=self.variables(spec, state),
            resources=(
                "terraform_data.keys",
                "terraform_data.bridge",
                "terraform_data.guard",
                *(f"terraform_data.node[{index}]" for index in range(spec.nodes)),
            ),
            cost=None,
            cost_note="the nodes are this machine",
        )

    def rendezvous_host(self, spec: ClusterSpec, state: ClusterState) -> str:
        """The bridge's host-side address: reachable from every node, and in none of them."""
        return str(_subnet(spec, state).network_address + 1)

    def image_registry_host(self, spec: ClusterSpec, state: ClusterState) -> str | None:
        """Beside the rendezvous endpoint: on the bridge, outside every node."""
        return self.rendezvous_host(spec, state)

    def preflight(self, spec: ClusterSpec, state: ClusterState) -> None:
        """What a netns cluster needs of this machine, checked before anything changes: Linux, root,
        network namespaces, sshd and iproute2, a subnet nothing else uses, a store the nodes reach."""
        if not sys.platform.startswith("linux"):
            raise UsageError(f"provider netns needs Linux network namespaces; this is {sys.platform}", field="provider")
        if os.geteuid() != 0:
            raise UsageError(
                "provider netns needs root (it creates network namespaces, a bridge and an sshd per node); "
                "run `infractl up` as root, or use provider: local",
                field="provider",
            )
        tools = _TOOLS | (_IMAGE_TOOLS if spec.runtime.image is not None else {})
        missing = [f"{tool} ({package})" for tool, package in tools.items() if shutil.which(tool) is None]
        if not Path(_SSHD).is_file():
            missing.append(f"{_SSHD} (openssh-server)")
        if missing:
            raise UsageError(
                f"provider netns needs {', '.join(missing)}: install them "
                "(scripts/bootstrap.sh does, as root on Debian)",
                field="provider",
            )
        probe = proc.run(["unshare", "--net", "true"], timeout=30)
        if probe.returncode != 0:
            why = proc.last_line(probe.stderr)
            raise UsageError(f"provider netns: this machine cannot create network namespaces ({why})", field="provider")
        _check_subnet_free(spec, state)
        self._check_store_reachable(spec, state)

    def _check_store_reachable(self, spec: ClusterSpec, state: ClusterState) -> None:
        """Nodes have their own loopback: an S3 endpoint on this machine's 127.0.0.1 is not theirs."""
        if not (spec.store or "").startswith("s3://"):
            return
        endpoint = (parse_qs(urlsplit(spec.store or "").query).get("endpoint_url") or [""])[0]
        host = urlsplit(endpoint).hostname or ""
        if host in ("localhost", "::1") or host.startswith("127."):
            raise ConfigError(
                f"the nodes of a netns cluster cannot reach {endpoint} (each has its own loopback); serve the "
                f"endpoint on an address they route to, such as the bridge's {self.rendezvous_host(spec, state)}",
                field="store",
            )

    def leftovers(self, state: ClusterState, record: ClusterIntent) -> list[str]:
        """Namespaces, interfaces, sshd processes, the bridge's guard and keys ``terraform destroy``
        left behind."""
        found = [f"network namespace {name}" for name in _namespaces(state)]
        found += [
            f"interface {link['ifname']}"
            for link in _ip_json("link", "show")
            if link.get("ifname", "").startswith((_bridge(state), f"ixv{state.short_id}-"))
        ]
        found += [f"process {p.pid}" for p in proc.find(state.dir)]
        found += [f"sshd process {p.pid}" for p in _sshds(state)]
        if proc.run(["iptables", "-w", "-S", _guard(state)]).returncode == 0:
            found.append(f"iptables chain {_guard(state)}")
        ssh_dir = state.dir / "ssh"
        if ssh_dir.exists():
            found += [f"key file {p}" for p in sorted(ssh_dir.rglob("*")) if p.is_file()] or [f"directory {ssh_dir}"]
        found += _container_leftovers(state)
        return found + node_directories(state)  # node directories, as on local

    def control(self, state: ClusterState, nodes: Sequence[Node]) -> NodeControl:
        return NetnsNodes(state, nodes, python=sys.executable)

    def orphans(self, owned: set[str]) -> list[Orphan]:
        """Namespaces (with everything in them: sshd, a run), bridges, veths and container run
        roots named after no started cluster, and sshd processes of a node whose state directory
        holds no cluster (``statedir.abandoned``: gone, or deleted in part)."""
        return _made(
            lambda short_id: short_id not in owned,
            abandoned,
        )

    def reap(self, state: ClusterState, record: ClusterIntent, *, purge: bool) -> list[str]:
        """What the module's provisioners made after Terraform last saved its state (an apply
        that was killed): the cluster's namespaces, interfaces, run roots and sshd processes."""
        mine = _made(
            lambda short_id: short_id == state.short_id,
            lambda cluster_dir: cluster_dir.resolve() == state.dir.resolve(),
        )
        for thing in mine:
            thing.remove()
        return [f"{thing.kind} {thing.name}" for thing in mine]


class NetnsNodes(SshNodes):
    """SSH nodes whose faults come from the machine that holds their namespaces."""

    link_faults = LINK_FAULTS

    def containers(self, node: str) -> ContainerEngine:
        """podman with the node's own store; runc and cgroupfs (there is no systemd, and crun
        refuses this machine's hybrid cgroup mounts), events in a file (no journald)."""
        home, runroot = _container_home(self.state, node), _container_runroot(self.state, node)
        return ContainerEngine.podman_own_store(
            home,
            runroot,
            options=("--runtime", "runc", "--cgroup-manager", "cgroupfs", "--events-backend", "file"),
            # podman raises the limits past the hard ones by default, which this machine refuses
            # without CAP_SYS_RESOURCE: the node's own hard limits, as its processes have them.
            run_options=tuple(f"--ulimit={name}={hard}:{hard}" for name, hard in _hard_limits().items()),
        )

    def remove_containers(self) -> list[str]:
        """Every container and image of each node's store, then the store itself, by the node's
        engine run from this machine (which holds the nodes' disks: a node whose link is cut is
        cleaned all the same); the engine unmounts what it mounted."""
        homes = [name for name in self.nodes if _container_home(self.state, name).exists()]

        def remove(name: str) -> None:
            try:
                self.containers(name).remove_store()
            except InfractlError as exc:
                raise InfractlError(f"{name}: {exc.message}; run teardown again") from None

        self.each(homes, remove)
        return homes

    def kill_node(self, node: str, run: str) -> None:
        """Every process in the node's namespace but its sshd listener (the node's own: it stays so
        the node can be reached again), the run's among them."""
        entry = self.node(node)
        assert entry.ssh is not None
        pid_file = entry.ssh.known_hosts.with_name("sshd.pid")
        listener = int(pid_file.read_text().strip() or 0) if pid_file.is_file() else 0
        _kill_namespace(_namespace(self.state, node), but=listener)

    def _link_commands(self, node: str, fault: str, latency_ms: int) -> tuple[list[str], list[str]]:
        """The command that makes ``fault`` on the node's link, and the one that undoes it."""
        namespace = _namespace(self.state, node)
        if fault == "down":
            return (
                ["ip", "-n", namespace, "link", "set", "eth0", "down"],
                ["ip", "-n", namespace, "link", "set", "eth0", "up"],
            )
        if fault == "drop":
            # The host side of the node's veth pair (infra/netns names both from the cluster id and index).
            veth = f"ixv{self.state.short_id}-{_index(node)}"
            return (
                ["bridge", "link", "set", "dev", veth, "state", "0"],
                ["bridge", "link", "set", "dev", veth, "state", "3"],
            )
        tc = ["ip", "netns", "exec", namespace, "tc", "qdisc"]
        return (
            [*tc, "add", "dev", "eth0", "root", "netem", "delay", f"{latency_ms}ms"],
            [*tc, "del", "dev", "eth0", "root"],
        )

    def cut_link(self, node: str, fault: str, *, latency_ms: int = 0) -> dict[str, Any]:
        make, _ = self._link_commands(node, fault, latency_ms)
        done = proc.run(make, timeout=30)
        if done.returncode != 0:
            why = proc.last_line(done.stderr)
            hint = NETEM_HINT if fault == "delay" else ""
            raise UsageError(f"cannot make a {fault!r} fault on {node}'s link: {why}{hint}", field="--kind")
        return {"link": fault, "namespace": _namespace(self.state, node)} | (
            {"latency_ms": latency_ms} if fault == "delay" else {}
        )

    def restore_link(self, node: str, fault: str) -> None:
        _, undo = self._link_commands(node, fault, 0)
        done = proc.run(undo, timeout=30)
        if done.returncode != 0:
            why = proc.last_line(done.stderr)
            raise InfractlError(
                f"could not restore {node}'s link after a {fault!r} fault: {why}; run {shlex.join(undo)}"
            )


def _check_subnet_free(spec: ClusterSpec, state: ClusterState) -> None:
    network = _subnet(spec, state)
    for link in _ip_json("-4", "addr", "show"):
        if link.get("ifname") == _bridge(state):
            continue  # this cluster's own bridge (a second `up`)
        for address in link.get("addr_info", []):
            if ipaddress.IPv4Address(address["local"]) in network:
                raise ConfigError(
                    f"{network} is in use on this machine (interface {link.get('ifname')} has {address['local']}); "
                    "choose another netns.subnet",
                    field="netns.subnet",
                )


def _hard_limits() -> dict[str, int]:
    """The hard limits on open files and processes on this machine (the nodes'), processes at most
    ``_MAX_NPROC``: runc refused more here (40000 of a hard limit of 96362)."""
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    return {
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[1],
        "nproc": _MAX_NPROC if nproc == resource.RLIM_INFINITY else min(nproc, _MAX_NPROC),
    }


def _container_home(state: ClusterState, node: str) -> Path:
    return state.dir / "containers" / node


def _container_runroot(state: ClusterState, node: str) -> Path:
    """Under /run (podman refuses a run root longer than 50 characters), per cluster and node."""
    return _RUNROOTS / f"{state.short_id}-{node}"


def _container_leftovers(state: ClusterState) -> list[str]:
    """The nodes' image stores and run roots, and anything still mounted from them."""
    root = state.dir / "containers"
    found = [f"image store {home}" for home in sorted(root.iterdir())] if root.is_dir() else []
    runroots = sorted(_RUNROOTS.glob(f"{state.short_id}-*")) if _RUNROOTS.is_dir() else []
    found += [f"container run root {path}" for path in runroots]
    with open("/proc/self/mountinfo") as mounts:
        points = [line.split()[4] for line in mounts]
    found += [f"mount {point}" for point in points if point.startswith((f"{root}/", f"{_RUNROOTS}/{state.short_id}-"))]
    return found


def _sshds(state: ClusterState | None) -> list[psutil.Process]:
    """The nodes' sshd processes (of every netns cluster with None), by their config path: sshd
    overwrites its environment with its process title, so the cluster's marker does not find them.
    Only ``/usr/sbin/sshd`` run by root, as node.sh starts it: anyone can start a process whose
    command line shows such a path, and gc kills what this finds."""
    configs = str(state.dir / "ssh" / "nodes") + "/" if state is not None else "/ssh/nodes/"
    found = []
    for process in psutil.process_iter():
        try:
            if (
                configs in " ".join(process.cmdline())
                and process.status() != psutil.STATUS_ZOMBIE
                and process.exe() == _SSHD
                and process.uids().real == 0
            ):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _made(named_for: Callable[[str], bool], of_dir: Callable[[Path], bool]) -> list[Orphan]:
    """What the module makes outside the state directory on this machine, where the cluster's
    short_id in its name passes ``named_for`` (an sshd: its state directory passes ``of_dir``),
    processes first: a namespace goes more easily once nothing runs in it."""
    found = []
    for process in _sshds(None):
        config = _SSHD_CONFIG.search(" ".join(process.cmdline()))
        if config and of_dir(Path(config["dir"])):
            found.append(Orphan("sshd process", str(process.pid), functools.partial(proc.kill, [process])))
    found += [
        Orphan("network namespace", name, functools.partial(_delete_namespace, name))
        for name in (e["name"] for e in _ip_json("netns", "list"))
        if (match := _NAMESPACE.fullmatch(name)) and named_for(match["id"])
    ]
    found += [
        Orphan("interface", name, functools.partial(_delete_link, name))
        for name in (link.get("ifname", "") for link in _ip_json("link", "show"))
        if (match := _INTERFACE.fullmatch(name)) and named_for(match["id"])
    ]
    runroots = sorted(_RUNROOTS.iterdir()) if _RUNROOTS.is_dir() else []
    found += [
        Orphan("container run root", str(path), functools.partial(proc.remove_tree, path))
        for path in runroots
        if (match := _RUNROOT.fullmatch(path.name)) and named_for(match["id"])
    ]
    chains = proc.run(["iptables", "-w", "-S"])
    found += [
        Orphan("iptables chain", match["chain"], functools.partial(_delete_guard, match["chain"]))
        for match in (_GUARD.fullmatch(line) for line in chains.stdout.splitlines() if chains.returncode == 0)
        if match and named_for(match["id"])
    ]
    return found


def _delete_guard(chain: str) -> None:
    """The bridge's guard (infra/netns): every jump to it (``-A INPUT ... -j CHAIN``), then the chain."""
    for rule in proc.run(["iptables", "-w", "-S", "INPUT"]).stdout.splitlines():
        if rule.split()[-2:] == ["-j", chain]:
            _ip_or_raise(["iptables", "-w", "-D", *rule.split()[1:]])
    _ip_or_raise(["iptables", "-w", "-F", chain])
    _ip_or_raise(["iptables", "-w", "-X", chain])


def _kill_namespace(name: str, *, but: int = 0) -> None:
    """Every process in the namespace ``name`` (but the pid ``but``), killed until none is left."""

    def in_namespace() -> list[psutil.Process]:
        listed = proc.run(["ip", "netns", "pids", name])
        pids = {int(pid) for pid in listed.stdout.split()} - {but} if listed.returncode == 0 else set()
        return proc.processes(sorted(pids))

    proc.kill_until_gone(in_namespace, proc.kill, timeout=proc.KILL_NODE_S, poll_s=0.05)


def _delete_namespace(name: str) -> None:
    """Every process in it, then the namespace (its veth ends go with it)."""
    _kill_namespace(name)
    _ip_or_raise(["ip", "netns", "del", name])


def _delete_link(name: str) -> None:
    if _ip_json("link", "show", "dev", name):  # a veth goes with its namespace's end
        _ip_or_raise(["ip", "link", "del", name])


def _ip_or_raise(argv: list[str]) -> None:
    done = proc.run(argv)
    if done.returncode != 0:
        raise InfractlError(f"{shlex.join(argv)} failed: {proc.last_line(done.stderr)}")
