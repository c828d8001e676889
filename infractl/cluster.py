"""Cluster lifecycle: ``up`` (Terraform, rendezvous endpoint, Ansible + health gate) and ``teardown``."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infractl import __version__, access, image, infra, playbook, proc, providers, runs, runstore
from infractl.config import ClusterSpec
from infractl.errors import ConfigError, InfractlError, InfraError, Interrupted, UsageError
from infractl.image import registry
from infractl.node import Node
from infractl.output import Output
from infractl.planning.devices import Device
from infractl.planning.plan import format_bytes
from infractl.providers.engines import IMAGE_UID
from infractl.providers.nodecontrol import NodeControl
from infractl.providers.servers import ServerHost
from infractl.servers import ensure_registry, ensure_rendezvous
from infractl.statedir import ClusterIntent, ClusterRecord, ClusterState, Endpoint
from infractl.store import Store, StoreUnavailable, for_cluster, open_store

__all__ = [
    "UpResult",
    "TeardownResult",
    "device_line",
    "preflight",
    "up",
    "teardown",
]

# In the state directory once `terraform destroy` succeeded: a teardown run again only looks for leftovers.
_DESTROYED = "destroyed"
#: Seconds before each new try of a failed ``terraform destroy`` (then the failure stands).
DESTROY_RETRY_S = (5.0, 20.0)
# `up` names the changed tasks when there are this few (a re-run that should change nothing did).
_NAMED_CHANGES = 4


@dataclass
class UpResult:
    cluster: str
    nodes: list[dict[str, Any]]
    terraform: str
    terraform_changed: bool
    rendezvous: str
    rendezvous_started: bool
    ansible_changed: int
    health: list[dict[str, Any]] = field(default_factory=list)
    image: str | None = None
    """What the nodes pulled and run: the pinned image at the cluster's registry (None: no image)."""
    image_changed: bool = False
    """The registry was started, or the image copied into it, by this ``up``."""

    @property
    def changed(self) -> bool:
        return self.terraform_changed or self.rendezvous_started or self.image_changed or self.ansible_changed > 0


@dataclass
class TeardownResult:
    cluster: str
    processes_killed: int
    nodes_removed: int
    runs_purged: list[str]
    already_down: bool = False
    """Nothing was left to tear down: the cluster was not up."""


def store_uri(state: ClusterState, spec: ClusterSpec) -> str:
    return spec.store or state.default_store.as_uri()


def preflight(state: ClusterState, spec: ClusterSpec) -> Store:
    """What ``up`` checks before it takes the lock or changes anything: the store URI, and that
    the store can be reached and written (a new cluster's store: or created by ``up``). The store
    of a cluster that is up must still be there: a vanished store held the cluster's checkpoints,
    and an empty one in its place would hide that."""
    providers.get(spec.provider).preflight(spec, state)
    uri = store_uri(state, spec)
    store = open_store(uri, field="cluster.store")
    previous = state.record() if state.is_up() else None
    if previous is not None and previous.store == uri:
        try:
            store.ping()
        except StoreUnavailable as exc:
            raise ConfigError(
                f"the store of cluster {state.name!r} is unreachable ({exc.cause}); it holds the cluster's "
                "checkpoints and run records: bring it back (restore or mount it) and rerun `infractl up`",
                field="cluster.store",
            ) from None
    _check_image_cached(state, spec, previous)
    # A store made with the nodes is checked by `up` once they are applied.
    if previous is not None or not providers.get(spec.provider).makes_store(spec):
        store.check(create_ok=previous is None or previous.store != uri)
    return store


def _check_image_cached(state: ClusterState, spec: ClusterSpec, previous: ClusterRecord | None) -> None:
    """A cluster whose nodes pull from its own registry gets a newly pinned image from this
    machine's build cache: it must be there before ``up`` starts anything. (An image the cluster's
    registry served before is there still.)"""
    pinned = spec.runtime.image
    if pinned is None or not providers.get(spec.provider).serves_images:
        return
    digest = pinned.rpartition("@")[2]
    if previous is not None and (previous.image or "").endswith(f"@{digest}"):
        return
    if image.locate(digest) is None:
        raise UsageError(
            f"image {digest} is not in this machine's image cache: build it with `infractl image build`, "
            "then pin the digest it prints",
            field="runtime.image",
        )


def _serve_image(
    state: ClusterState, spec: ClusterSpec, servers: ServerHost, previous: ClusterRecord | None, out: Output
) -> tuple[registry.Registry | None, str | None, bool]:
    """For a pinned image on a provider whose nodes pull from the cluster's own registry: keep
    that registry running and the image in it (and on the servers' host, where infractl's servers
    run from it). (The registry, what the nodes pull, whether anything changed); Nones when the
    nodes pull no image from the cluster."""
    provider = providers.get(spec.provider)
    if spec.runtime.image is None or not provider.serves_images:
        return None, None, False
    host = provider.image_registry_host(spec, state)
    assert host is not None
    served, started = ensure_registry(state, servers, host, previous)
    out.info(f"registry: {served.address} ({'started' if started else 'already running'})")
    with servers.reach(served.host, served.port) as (via_host, via_port):
        pulled, pushed = registry.publish(served, spec.runtime.image, progress=out.info, via=f"{via_host}:{via_port}")
    out.info(f"image: {pulled} ({'pushed' if pushed else 'already in the registry'})")
    if servers.runs_image:
        servers.pull(pulled, served.ca)
    return served, pulled, started or pushed


def _provision(
    state: ClusterState, spec: ClusterSpec, store: Store, out: Output
) -> tuple[infra.ApplyResult | None, list[Node]]:
    """Apply the provider's module, with the store ready before (or, where the module makes it,
    after); the apply (None for a provider without a module: its nodes exist already), and the
    nodes as the control plane reaches them."""
    provider = providers.get(spec.provider)
    module = provider.terraform_module()
    if module is None:
        out.info(f"nodes: {spec.nodes} of provider {spec.provider} (it has no Terraform module: nothing to apply)")
    else:
        out.info(f"terraform: applying {module.parent.name}/{module.name} for {spec.nodes} node(s)…")
    if not provider.makes_store(spec):
        store.ensure()
    (state.dir / _DESTROYED).unlink(missing_ok=True)  # what teardown destroyed, this apply makes again
    if module is None:
        return None, provider.provisioned(spec, state, None)
    applied = infra.apply(
        state.terraform_dir,
        module,
        provider.variables(spec, state),
        root=provider.root_settings(spec, state),
    )
    out.info(f"terraform: {applied.summary}")
    if provider.makes_store(spec):
        store.ensure()
    return applied, provider.provisioned(spec, state, applied)


# Set by ``interruptible``'s signal handler; what ``up`` gives Ansible's run as its cancel callback.
_INTERRUPTED = threading.Event()
# Set while Ansible runs: the handler then only sets _INTERRUPTED, and the run cancels itself.
_CANCELLABLE = threading.Event()


@contextlib.contextmanager
def interruptible(state: ClusterState) -> Iterator[None]:
    """Around ``up``: Ctrl-C, a closed terminal (SIGHUP) or SIGTERM stop it between two steps
    (a Terraform apply under way ends first), stop the Ansible run it started (in a session of its
    own, the terminal's signal never reaches it), and end the command with one line saying what
    finishes or undoes the rest. Everything made so far is in the state directory."""

    def interrupt(signum: int, frame: object) -> None:
        _INTERRUPTED.set()
        if not _CANCELLABLE.is_set():  # Ansible's run polls the flag: an exception there is lost in its threads
            raise KeyboardInterrupt

    _INTERRUPTED.clear()
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    except KeyboardInterrupt:
        proc.kill_all(state.dir, node=playbook.ANSIBLE_NODE, timeout=20)
        raise Interrupted(
            f"interrupted: `infractl up -c {state.name}` again picks up where this one stopped; "
            f"`infractl teardown -c {state.name}` removes what it made"
        ) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _configure(
    state: ClusterState,
    spec: ClusterSpec,
    nodes: NodeControl,
    rendezvous: tuple[str, int],
    image: str | None,
    registry_ca: Path | None,
) -> playbook.ConfigureResult:
    """Ansible's run of ``up``, cancelled through its callback when ``interruptible`` is told to stop."""
    members = access.node_vars(state, access.load_members(state))
    _CANCELLABLE.set()
    try:
        configured = playbook.configure(
            state.dir,
            nodes,
            runtime=spec.runtime,
            rendezvous=rendezvous,
            nonce=secrets.token_hex(4),
            access=members,
            image=image,
            registry_ca=registry_ca,
            cancel=_INTERRUPTED.is_set,
        )
    finally:
        _CANCELLABLE.clear()
    if _INTERRUPTED.is_set():
        raise KeyboardInterrupt
    return configured


def _roles(nodes: NodeControl, image: str | None) -> str:
    """What site.yml will do on ``nodes``, in words."""
    roles = "base, access, " + ("container engine, trainer image, " if image else "") + "runtime, network, health gate"
    if gpu_nodes := [name for name in nodes.nodes if nodes.host_group(name) == "gpu"]:
        roles += f"; then GPU preflight, toolkit, NCCL and the nccl-tests gate on {', '.join(gpu_nodes)}"
    return roles


def device_line(device: Device) -> str:
    """How ``up`` (and its dry run) names the device each rank trains on."""
    return (
        f"devices: {device.name}, {format_bytes(device.memory_bytes)} per rank "
        "(`infractl train` refuses a run whose plan does not fit them)"
    )


def up(state: ClusterState, spec: ClusterSpec, store: Store, out: Output) -> UpResult:
    """Provision and configure the cluster (``store`` from ``preflight``); running it again on an
    unchanged cluster changes nothing."""
    previous = state.record() if state.is_up() else None
    uri = store_uri(state, spec)
    provider = providers.get(spec.provider)
    state.start(ClusterIntent(name=spec.name, spec=spec, store=uri))
    for note in provider.notes(spec):
        out.warn(note)
    applied, provisioned = _provision(state, spec, store, out)
    nodes = provider.control(state, provisioned)

    servers = provider.servers(state)
    served, pulled, image_changed = _serve_image(state, spec, servers, previous, out)

    host = provider.rendezvous_host(spec, state)
    port, started = ensure_rendezvous(servers, host, previous, pulled)
    out.info(f"rendezvous: {host}:{port} ({'started' if started else 'already running'})")

    out.info(f"ansible: configuring nodes ({_roles(nodes, pulled)})…")
    configured = _configure(state, spec, nodes, (host, port), pulled, served.ca if served is not None else None)
    out.info(f"ansible: {configured.changed} task(s) changed")
    if 0 < configured.changed <= _NAMED_CHANGES:
        out.info("ansible: changed " + "; ".join(configured.changed_tasks))
    if pulled:  # the trainer runs as the image's user: a store of files the nodes share is its to write
        store.admit_trainer(IMAGE_UID)

    device = provider.device(spec, os.environ)
    out.info(device_line(device))
    state.write(
        ClusterRecord(
            name=spec.name,
            spec=spec,
            store=uri,
            id=(previous.id if previous is not None else None) or secrets.token_hex(8),
            infractl_version=__version__,
            rendezvous=Endpoint(host, port),
            nodes=tuple(provisioned),
            device=device,
            registry=Endpoint(served.host, served.port) if served is not None else None,
            image=pulled if served is not None else None,
        )
    )
    return UpResult(
        cluster=spec.name,
        nodes=[{"name": n.name, "address": n.address, "workdir": str(n.workdir)} for n in provisioned],
        terraform=applied.summary if applied is not None else "no Terraform module",
        terraform_changed=applied is not None and applied.changed,
        rendezvous=f"{host}:{port}",
        rendezvous_started=started,
        image=pulled,
        image_changed=image_changed,
        ansible_changed=configured.changed,
        health=configured.health,
    )


def _stop_and_destroy(
    state: ClusterState, provider: providers.Provider, record: ClusterRecord, out: Output, *, purge: bool
) -> tuple[int, list[str]]:
    """Teardown's first half: every process of the cluster stopped, its containers removed, with
    ``purge`` its runs deleted, then ``terraform destroy``. (Processes stopped, runs purged.)"""
    if purge:
        for_cluster(state).ping()  # a purge that cannot reach the store must fail before anything goes
    # Before anything goes: a store that cannot take the roles' rights back keeps the cluster up.
    if access.remove_from_store(state, for_cluster(state)):
        out.info("access: the roles' rights in the store are taken back")
    if record.image:
        for_cluster(state).admit_trainer(IMAGE_UID, admitted=False)
    nodes = providers.control(state)
    stopped, survived = nodes.stop_all(timeout=20)
    # Then the cluster's own servers (the rendezvous endpoint, the registry).
    own, leftover = provider.servers(state).stop()
    if stopped or own:
        out.info(f"stopped {stopped + own} process(es) of cluster {state.name!r}")
    if survived or leftover:
        pids = [f"{p.node}:{p.pid}" for p in survived] + leftover
        raise InfractlError(f"processes of cluster {state.name!r} survived SIGKILL: {', '.join(pids)}")

    if record.image is not None and (cleaned := nodes.remove_containers()):
        out.info(f"containers: removed the containers and images of {', '.join(cleaned)}")
    purged: list[str] = []
    if purge:
        purged = _purge_runs(state, record, out)
    _destroy(state, provider, record, out, purge=purge)
    return stopped + own, purged


def _purge_runs(state: ClusterState, record: ClusterRecord, out: Output) -> list[str]:
    """Delete the runs of this cluster from its store: those whose run.json carries the cluster's
    id, never a run of another cluster of the same name that shares the store. A run recorded
    before runs carried an id is this cluster's only when the cluster has none either (both from
    before ids): otherwise it is kept and named. Returns the runs deleted."""
    store = for_cluster(state)
    purged, unclaimed = [], []
    for run in runs.cluster_runs(state, store):
        if run.cluster_id == record.id:
            store.delete_prefix(runstore.run_prefix(run.run_id))
            purged.append(run.run_id)
        elif run.cluster_id is None:
            unclaimed.append(run.run_id)
    # The default store lies in the state directory, which a purge deletes whole.
    if unclaimed and record.store != state.default_store.as_uri():
        out.warn(
            f"store: kept run(s) {', '.join(unclaimed)}: recorded before runs named their cluster's id, they may be "
            f"another cluster {state.name!r}'s; if they are this one's, delete runs/<run>/ in {record.store}"
        )
    return purged


def _destroy(
    state: ClusterState, provider: providers.Provider, record: ClusterIntent, out: Output, *, purge: bool
) -> None:
    for line in provider.before_destroy(state, record, purge=purge):
        out.info(line)
    if provider.terraform_module() is None:
        return  # the provider made no machines: they stay, as they were before `up`
    out.info("terraform: destroying nodes…")
    for wait in (*DESTROY_RETRY_S, None):
        try:
            infra.destroy(state.terraform_dir)
            return
        except InfraError as exc:
            if wait is None:
                raise
            # A destroy is idempotent: an API that throttled, a device still busy a moment, go again.
            out.warn(f"terraform: destroy failed ({exc.message}); trying again in {wait:g}s")
            time.sleep(wait)


def teardown(state: ClusterState, out: Output, *, purge: bool) -> TeardownResult:
    """Stop everything the cluster runs, destroy its nodes, and prove nothing is left. A teardown
    that destroyed the nodes and then found something left is run again from that point: the
    operator removed what it named, and only the proof is left to do."""
    record = state.read_intent()
    provider = providers.get(record.spec.provider)
    destroyed = state.dir / _DESTROYED
    stopped, purged = 0, list[str]()
    if destroyed.is_file():
        out.info("terraform: the nodes were destroyed by an earlier teardown; looking for what is left")
    elif isinstance(record, ClusterRecord):
        stopped, purged = _stop_and_destroy(state, provider, record, out, purge=purge)
        destroyed.touch()
    else:
        out.info(f"cluster {state.name!r}: its `up` never finished; destroying what its Terraform state holds")
        stopped, _ = provider.servers(state).stop()
        # What the interrupted `up` left running on this machine (Ansible, in a session of its own).
        killed, _ = proc.kill_all(state.dir, timeout=20)
        stopped += killed
        _destroy(state, provider, record, out, purge=purge)
        # What the interrupted apply made after Terraform last saved its state: the state never held it.
        if reaped := provider.reap(state, record, purge=purge):
            out.info(
                f"terraform's state did not hold {len(reaped)} resource(s) of the cluster; deleted: {'; '.join(reaped)}"
            )
        destroyed.touch()
    leftovers = provider.leftovers(state, record)
    if leftovers:
        raise InfractlError(
            f"terraform destroy left {len(leftovers)} resource(s) of cluster {state.name!r} behind: "
            f"{'; '.join(leftovers)}; remove them (they cost money and nothing manages them), then run teardown again"
        )
    if provider.shares_host_accounts:
        # The access roles' groups live on the nodes, and these nodes' accounts are this machine's.
        access.remove_groups(state)

    # Everything but the default store (kept unless --purge) and the lock we hold goes.
    keep = {"lock"} if purge else {"lock", state.default_store.name}
    for child in state.dir.iterdir():
        if child.name in keep:
            continue
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()
    if {c.name for c in state.dir.iterdir()} <= {"lock"}:
        shutil.rmtree(state.dir)
    state.unlist()
    return TeardownResult(
        cluster=state.name,
        processes_killed=stopped,
        nodes_removed=len(record.nodes) if isinstance(record, ClusterRecord) else 0,
        runs_purged=purged,
    )
