"""Local control-plane state: ``.infractl/<cluster>/`` (cluster record, Terraform, Ansible, run records, lock).

The root is ``./.infractl`` (or ``$INFRACTL_HOME``). Files that may hold secrets are written 0600.
Commands that change a cluster hold its lock; a second one is refused with a clear message.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from infractl.config import NAME_PATTERN, ClusterSpec, default_cluster_name, load_cluster, parse_cluster
from infractl.errors import ConfigError, InfractlError, LockedError, StateError, UsageError
from infractl.node import Node
from infractl.planning.devices import Device

__all__ = [
    "home",
    "ClusterIntent",
    "ClusterRecord",
    "ClusterState",
    "abandoned",
    "Endpoint",
    "KnownCluster",
    "Orphan",
    "known_clusters",
    "ledger",
    "resolve_cluster",
    "started_clusters",
    "write_private",
]

HOME_ENV = "INFRACTL_HOME"


def home() -> Path:
    return Path(os.environ.get(HOME_ENV) or ".infractl").absolute()


def ledger() -> Path:
    """Where this machine lists every cluster state directory an ``up`` started on it, whatever its
    state root (``gc`` finds what belongs to none of them): machine-wide for root, else the user's."""
    if os.geteuid() == 0:
        return Path("/var/lib/infractl/clusters")
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "infractl" / "clusters"


def write_private(path: Path, data: str) -> bool:
    """Write ``data`` to ``path`` with mode 0600 atomically; return False if it was already identical."""
    if path.is_file() and path.read_text() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(data)
    os.replace(tmp, path)
    return True


@dataclass(frozen=True)
class Endpoint:
    """Where one of the cluster's own servers listens (the rendezvous endpoint, the registry)."""

    host: str
    port: int


@dataclass(frozen=True, kw_only=True)
class ClusterIntent:
    """What an ``up`` is making (``intent.json``), written before it changes anything: an ``up``
    that never wrote the cluster record (it failed, or was killed) is torn down from it."""

    name: str
    spec: ClusterSpec
    """The cluster.yaml the ``up`` began with."""
    store: str
    """The store's URI."""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "spec": self.spec.model_dump(mode="json"), "store": self.store}


@dataclass(frozen=True, kw_only=True)
class ClusterRecord(ClusterIntent):
    """The cluster as its last ``up`` made it (``cluster.json``). Fields a record written by an
    older infractl may lack are optional (a cluster that was up across an upgrade)."""

    id: str | None
    """Unique to this cluster, kept by every later ``up`` of it: each run records it (run.json's
    cluster_id), and ``teardown --purge`` deletes only the runs that carry it, as two clusters of
    one name (on two machines, or one brought up again) may share a store."""
    rendezvous: Endpoint
    nodes: tuple[Node, ...]
    infractl_version: str | None = None
    device: Device | None = None
    """The device each rank trains on, as ``up`` provisioned it."""
    registry: Endpoint | None = None
    """The cluster's image registry, where its nodes pull from one."""
    image: str | None = None
    """What the nodes pulled and run (the pinned image at the cluster's registry), if any."""

    def to_json(self) -> dict[str, Any]:
        document = super().to_json() | {
            "id": self.id,
            "infractl_version": self.infractl_version,
            "rendezvous": asdict(self.rendezvous),
            "nodes": [node.record() for node in self.nodes],
        }
        if self.device is not None:
            document["device"] = asdict(self.device)
        if self.registry is not None:
            document |= {"registry": asdict(self.registry), "image": self.image}
        return document

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> ClusterRecord:
        """The record ``to_json`` wrote, or an older infractl did; ``KeyError``, ``TypeError``,
        ``ValueError`` (a ``ValidationError`` among them) where it is not one."""
        registry = document.get("registry")
        device = document.get("device")
        return cls(
            name=str(document["name"]),
            spec=parse_cluster(document["spec"]),
            store=str(document["store"]),
            id=document.get("id"),
            rendezvous=Endpoint(str(document["rendezvous"]["host"]), int(document["rendezvous"]["port"])),
            nodes=tuple(Node.from_record(item) for item in document["nodes"]),
            infractl_version=document.get("infractl_version"),
            device=Device(**device) if device is not None else None,
            registry=Endpoint(str(registry["host"]), int(registry["port"])) if registry is not None else None,
            image=document.get("image"),
        )


@dataclass(frozen=True)
class ClusterState:
    """Paths and records of one cluster's state directory."""

    name: str
    dir: Path

    @property
    def short_id(self) -> str:
        """Six hex digits of a hash of the state directory's path: names what the cluster makes on this
        machine (access groups, netns interfaces) so two clusters of one name never collide."""
        return hashlib.sha256(str(self.dir.resolve()).encode()).hexdigest()[:6]

    @property
    def record_path(self) -> Path:
        return self.dir / "cluster.json"

    @property
    def terraform_dir(self) -> Path:
        return self.dir / "terraform"

    @property
    def default_store(self) -> Path:
        return self.dir / "store"

    @property
    def bundle_record_path(self) -> Path:
        """Where ``infractl bundle`` last wrote the handover (``{"out": ABS_PATH}``): status points there."""
        return self.dir / "bundle.json"

    @property
    def intent_path(self) -> Path:
        """What ``up`` is making (``{"name", "spec", "store"}``), written before it changes anything:
        an ``up`` that never wrote the cluster record (it failed, or was killed) is torn down from it."""
        return self.dir / "intent.json"

    def is_up(self) -> bool:
        return self.record_path.is_file()

    def was_started(self) -> bool:
        """Whether an ``up`` of the cluster began here (it may have ended before the record)."""
        return self.is_up() or self.intent_path.is_file()

    def start(self, intent: ClusterIntent) -> None:
        """Before ``up`` makes anything: the state directory in this machine's ``ledger`` (refused
        when the ledger cannot be written: gc could not find what the ``up`` makes), then what it
        is about to make (``read_intent``)."""
        entry = ledger() / f"{self.short_id}.json"
        if not entry.is_file():
            try:
                write_private(entry, json.dumps({"name": self.name, "dir": str(self.dir.resolve())}))
            except OSError as exc:
                raise StateError(
                    f"cannot list the cluster in {entry.parent} ({exc.strerror or exc}), where gc finds what "
                    "every `up` made: make it writable; nothing was made"
                ) from None
        write_private(self.intent_path, json.dumps(intent.to_json()))

    def unlist(self) -> None:
        """After ``teardown``: nothing of the cluster is left for the ledger to own."""
        (ledger() / f"{self.short_id}.json").unlink(missing_ok=True)

    def in_use(self) -> bool:
        """Whether the directory holds a cluster: an ``up`` began and no ``teardown`` finished, or a
        command holds the lock (an ``up`` about to begin). A directory deleted in part, its state
        files gone while running agents still write ``nodes/``, holds none."""
        return self.was_started() or self.busy()

    def busy(self) -> bool:
        """Whether a command holds the cluster's lock now."""
        try:
            fd = os.open(self.dir / "lock", os.O_RDWR)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def read_intent(self) -> ClusterIntent:
        """The cluster record of a cluster that is up, else what its interrupted ``up`` was making;
        StateError if no ``up`` began."""
        if self.is_up() or not self.intent_path.is_file():
            return self.record()
        document = self._document(self.intent_path)
        try:
            return ClusterIntent(
                name=str(document["name"]), spec=parse_cluster(document["spec"]), store=str(document["store"])
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InfractlError(f"cannot read {self.intent_path}: {_what(exc)}") from None

    def record(self) -> ClusterRecord:
        """The cluster record written by ``up``, read once; StateError if the cluster is not up."""
        try:
            return ClusterRecord.from_json(self.read())
        except (KeyError, TypeError, ValueError) as exc:
            raise InfractlError(f"cannot read the cluster record {self.record_path}: {_what(exc)}") from None

    def read(self) -> dict[str, Any]:
        """The cluster record's JSON as ``up`` wrote it; StateError if the cluster is not up. Read
        ``record()``: this is for the callers that still take the record's JSON apart themselves."""
        if not self.is_up():
            raise StateError(
                f"cluster {self.name!r} is not up (no cluster record in {self.dir}); run `infractl up` first"
            )
        return self._document(self.record_path)

    def _document(self, path: Path) -> dict[str, Any]:
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise InfractlError(f"cannot read the cluster record {path}: {exc}") from None
        if not isinstance(document, dict):
            raise InfractlError(f"the cluster record {path} is not a JSON object")
        return document

    def write(self, record: ClusterRecord) -> bool:
        return write_private(self.record_path, json.dumps(record.to_json(), indent=1, sort_keys=True) + "\n")

    def spec(self) -> ClusterSpec:
        """The cluster.yaml the cluster was brought up with (or its interrupted ``up`` began with)."""
        return self.read_intent().spec

    @contextlib.contextmanager
    def lock(self, command: str) -> Iterator[None]:
        """Hold the cluster's lock for the duration of ``command``; refuse if another command holds it.

        The lock file names its holder only while held. A command refused inside the lock
        (a ``UsageError``: nothing was changed) leaves the state directory as it found it: if
        the lock had to create the cluster's directory, the directory goes again.
        """
        created = _missing_ancestors(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        refused = False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another infractl command"
                raise LockedError(
                    f"cluster {self.name!r} is busy: {holder} holds its lock; wait for it to finish"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"`infractl {command}` (pid {os.getpid()})".encode(), 0)
            try:
                yield
            except UsageError:
                refused = True
                raise
            finally:
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)
            if refused and created:
                shutil.rmtree(self.dir, ignore_errors=True)
                for parent in created[1:]:  # shared parents (the state root) only if empty
                    with contextlib.suppress(OSError):
                        parent.rmdir()


def _what(exc: Exception) -> str:
    """What is wrong with a record, in a line: a missing key, or the spec's first error (a
    provider no longer installed, say), named."""
    if isinstance(exc, KeyError):
        return f"no {exc.args[0]!r}"
    if isinstance(exc, ValidationError):
        error = exc.errors()[0]
        return f"spec.{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _missing_ancestors(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist yet, deepest first (empty if ``path`` exists)."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


@dataclass(frozen=True)
class KnownCluster:
    """A cluster with state under the state root: up (``cluster.json``), or down with state left
    (a kept store after ``teardown``)."""

    name: str
    up: bool
    provider: str | None
    nodes: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "up": self.up, "provider": self.provider, "nodes": self.nodes}


@dataclass(frozen=True)
class Orphan:
    """Something infractl made on this machine that no cluster state owns any more (``gc``)."""

    kind: str
    name: str
    remove: Callable[[], None] = field(compare=False, repr=False)
    """Deletes it; raises ``InfractlError`` when it cannot."""

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "name": self.name}


def started_clusters() -> list[ClusterState]:
    """Every cluster state directory on this machine that an ``up`` started and no ``teardown``
    finished: those in the ledger and those under the state root."""
    found = {state.dir: state for state in _listed()}
    root = home()
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if path.is_dir() and re.fullmatch(NAME_PATTERN, path.name):
            found.setdefault(path.resolve(), ClusterState(path.name, path.resolve()))
    return [state for state in found.values() if state.in_use()]


def _listed() -> list[ClusterState]:
    """The cluster state directories in this machine's ledger (an ``up`` started each)."""
    found = []
    for entry in sorted(ledger().glob("*.json")) if ledger().is_dir() else []:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            listed = json.loads(entry.read_text())
            found.append(ClusterState(str(listed["name"]), Path(listed["dir"])))
    return found


def abandoned(directory: Path) -> bool:
    """Whether a cluster directory that processes name holds no cluster any more: it is gone, or
    an ``up`` on this machine started it (the ledger lists it) and it holds none now (deleted in
    part: its state files gone while running agents still write ``nodes/``). A directory the ledger
    does not list, that processes started without an ``up`` name (by hand, or a test's), is not
    judged by what it holds."""
    if not directory.exists():
        return True
    resolved = directory.resolve()
    return (
        any(state.dir.resolve() == resolved for state in _listed())
        and not ClusterState(directory.name, directory).in_use()
    )


def known_clusters() -> list[KnownCluster]:
    """Every cluster with a directory under the state root, by name."""
    root = home()
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.iterdir()):
        if not path.is_dir() or not re.fullmatch(NAME_PATTERN, path.name):
            continue
        state = ClusterState(path.name, path)
        if not state.is_up():
            found.append(KnownCluster(path.name, up=False, provider=None, nodes=None))
            continue
        try:
            record = state.record()
            found.append(KnownCluster(path.name, up=True, provider=record.spec.provider, nodes=len(record.nodes)))
        except InfractlError:
            found.append(KnownCluster(path.name, up=True, provider=None, nodes=None))
    return found


def resolve_cluster(option: str | None, *, down_ok: bool = False) -> tuple[ClusterState, ClusterSpec | None]:
    """Interpret ``-c/--cluster``: a cluster.yaml path, the name of a cluster in the state root, or
    nothing (the built-in ``local`` cluster). Returns the state and the spec read from a file, if any.

    With ``down_ok``, a name is taken for a cluster that is not up, or no longer: a ``teardown``
    retried after one that finished (``--purge`` leaves no directory to know the name by) has
    nothing left to do, which is no error."""
    if option is None:
        name = default_cluster_name()
        return ClusterState(name, home() / name), None
    path = Path(option)
    if path.suffix in (".yaml", ".yml") or _is_file(path):
        spec = load_cluster(path)
        return ClusterState(spec.name, home() / spec.name), spec
    if re.fullmatch(NAME_PATTERN, option) and (down_ok or ClusterState(option, home() / option).was_started()):
        return ClusterState(option, home() / option), None
    raise ConfigError(f"{option!r} is neither a cluster file nor a cluster that is up", field="--cluster")


def _is_file(path: Path) -> bool:
    """``path.is_file()`` that is False, not an exception, for a name the OS refuses (too long)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False
