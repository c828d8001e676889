"""In-memory checkpoint replicas: every few steps each rank's checkpoint shard is held in host
memory on its own node and on the next one, so a restart loads the newest step from memory
instead of the store's older commit (run.yaml ``checkpoint.replicate_every``).

Where the bytes live: in each node's agent (``trainer.replica_server``, started by ``trainer.agent``),
which outlives its workers' restarts and dies with its node, as the memory of a real node does.
The agent serves HTTP on the node's cluster address (the one collectives use) and tells its
workers where (``$INFRACTL_REPLICA_ADDR``); a worker started without our agent, or without the
run's key, has no replicas. The cluster network is not trusted: every request carries a signature
with the run's key (``trainer.replica_server.RunKey``), the agents refuse what does not verify, and
rank 0 checks each manifest's signature again before it counts a replica, so nothing from the
network is unpickled unless the run's own ranks signed it.

A replica of step N (every rank, collectively, over a gloo group of its own)::

    once per start      the ranks agree, through DCP's save planner, which items of the flattened
                        state each rank holds (a replicated item on one rank only) and the DCP
                        ``Metadata`` of them all (``_Layout``); a replica whose state no longer
                        has that shape fails, and the next one agrees again
    training thread     copies this rank's items in host memory: tensors cloned, other objects
                        pickled (what training waits for)
    the replica thread  serializes them as one file, ``rank-<R>`` (rank 0 adds ``metadata``), PUTs
                        it with its sha256 to this node's agent and to the next node's (a ring over
                        the nodes, in rank order); then, over the group: all_gather of every rank's
                        files and errors; if none failed, every rank PUTs the step's manifest
                        (every file's sha256, the trainer's extra, rank 0's metrics records not
                        yet in the store) to the same two agents. An agent keeps the newest step
                        with a manifest and the steps after it

Not ``dcp.async_save``: its planning collectives and its file per item (each a ``torch.save`` of
its own) made the recovery benchmark's replicas slower than its 0.1 s steps, so replicas were
skipped and the newest whole one fell behind the run (docs/reliability.md). Loading is DCP's
(``ReplicaReader``), so a replica reshards into another world size or layout as a store
checkpoint does.

A step is a replica once an agent holds its manifest; it is whole while every file the manifest
lists is held by some live agent. On restart (``Checkpointer.load``), rank 0 asks every node's
agent what it holds and picks the newest whole replica not older than the store's newest
commit, among the manifests whose signature verifies (one that does not is logged with the agent
that served it and never used); every rank fetches every file from a holder and checks its
signature and its sha256 against that manifest (another holder on a mismatch); if any rank
cannot, the next candidate is tried, and then the store. So a rank whose two holders both died,
or whose only surviving copy is corrupt, sends the run to the store's commit, never to a partial
or unverified replica. The store's commit rule is untouched: a replica is never committed, and a
run stopped whole resumes from the store.

Fault injection (a drill's hook, trainer/faults.py): ``corrupt_peer_replicas`` makes the agent flip
one byte of every copy it holds for another node, after checking it on receipt, as memory corrupted
at rest would.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import hashlib
import http.client
import io
import json
import os
import pickle
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader

from infractl.log import get_logger
from infractl.runstore import CheckpointError, Manifest, ManifestEntry, fetch_verified
from trainer.replica_server import REPLICA_ADDR_ENV, SHA256_HEADER, SIGNATURE_HEADER, RunKey, file_key_ok

__all__ = ["Candidate", "ReplicaReader", "Replicas", "fetch", "get", "put_file", "put_manifest", "whole_replicas"]

log = get_logger(__name__)

#: The key of rank 0's pickled DCP ``Metadata`` among a replica's files (each rank's is ``rank-<R>``).
_METADATA_KEY = "metadata"
#: How long an agent may leave one request's socket silent before the request fails.
_TIMEOUT_S = 10.0
#: How long a replica's collectives may wait for the slowest rank's write and copies.
_GROUP_TIMEOUT = datetime.timedelta(minutes=5)
#: How much of a fetched file is held in memory at a time.
_BLOCK = 1 << 20

_R = TypeVar("_R")


# -- the ranks' side -------------------------------------------------------------------------


def _request(
    address: str, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[bytes, http.client.HTTPMessage]:
    """One request to an agent's replica server; its body and headers. Raises OSError when it failed."""
    return _exchange(address, method, path, body, headers, read=http.client.HTTPResponse.read)


def _exchange(
    address: str,
    method: str,
    path: str,
    body: bytes | None,
    headers: dict[str, str] | None,
    *,
    read: Callable[[http.client.HTTPResponse], _R],
) -> tuple[_R, http.client.HTTPMessage]:
    """``_request``, where ``read`` makes what it returns of the answer (a fetch streams its body
    to a file). Raises OSError when it failed."""
    host, _, port = address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=_TIMEOUT_S)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        answer = connection.getresponse()
        if answer.status >= 300:
            raise OSError(f"HTTP {answer.status}")
        data = read(answer)
    except (http.client.HTTPException, OSError) as exc:
        raise OSError(f"replica server {address}: {method} {path}: {exc}") from exc
    finally:
        connection.close()
    return data, answer.headers


def get(key: RunKey, address: str, path: str) -> tuple[bytes, http.client.HTTPMessage]:
    """A signed GET of ``path`` from the agent at ``address``."""
    return _request(address, "GET", path, headers={SIGNATURE_HEADER: key.sign_request("GET", path)})


def put_file(key: RunKey, address: str, step: int, name: str, body: bytes, *, copy: str) -> None:
    """Send file ``name`` of replica ``step`` to the agent at ``address``, signed."""
    sha256 = hashlib.sha256(body).hexdigest()
    headers = {SHA256_HEADER: sha256, SIGNATURE_HEADER: key.sign_body("file", step, name, sha256)}
    _request(address, "PUT", f"/steps/{step}/files/{name}?copy={copy}", body, headers)


def put_manifest(key: RunKey, address: str, manifest: Manifest) -> None:
    """Send ``manifest`` to the agent at ``address``, signed: the step is a replica from then on."""
    body = manifest.to_json()
    signature = key.sign_body("manifest", manifest.step, "manifest", hashlib.sha256(body).hexdigest())
    _request(address, "PUT", f"/steps/{manifest.step}/manifest", body, {SIGNATURE_HEADER: signature})


@dataclass(frozen=True)
class Candidate:
    """A whole replica rank 0 found: its manifest and, per file, the agents that hold it."""

    manifest: Manifest
    holders: dict[str, list[str]]


@dataclass
class _InFlight:
    step: int
    thread: threading.Thread
    error: str | None = None
    relayout: bool = False  # a rank's state no longer matched the layout: agree a new one


#: A replica's copy of this rank's items, in file order: the tensors, and every other object pickled.
_Staged = tuple[list[torch.Tensor], bytes]


@dataclass(frozen=True)
class _Layout:
    """What this rank's replica file holds, agreed once per start (``Replicas._agree``): the items
    of the flattened state DCP's planner gives this rank (each replicated item on one rank only),
    in file order; the state's shape it was agreed for; on rank 0, the DCP ``Metadata`` of every
    rank's items (pickled), where each item's ``storage_data`` is (file key, kind, position)."""

    signature: tuple[Any, ...]
    items: list[WriteItem]
    metadata: bytes | None


class Replicas:
    """This rank's replicas: ``join`` on every rank."""

    def __init__(self, *, rank: int, agents: list[str], key: RunKey, records: Callable[[], list[Any]]) -> None:
        self.rank = rank
        self.key = key
        self.world_size = len(agents)
        self._records = records  # rank 0's metrics records not yet in the store
        #: Every rank's agent, and so every live node's, in rank order.
        self.agents = agents
        self.own = agents[rank]
        nodes = list(dict.fromkeys(agents))
        #: The next node's agent (a ring over the nodes in rank order); None on a single node.
        self.peer = nodes[(nodes.index(self.own) + 1) % len(nodes)] if len(nodes) > 1 else None
        # Replicas' collectives run off the training thread: a group of their own (see checkpoint.py).
        self._group = dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT)
        self._layout: _Layout | None = None
        self._in_flight: _InFlight | None = None

    @classmethod
    def join(cls, *, rank: int, world_size: int, records: Callable[[], list[Any]]) -> Replicas | None:
        """Every rank, collectively: this job's replicas, or None where a rank has no agent that
        holds them, or not the run's key (a worker started by plain torchrun)."""
        key = RunKey.from_environ(os.environ)
        addresses: list[str | None] = [None] * world_size
        dist.all_gather_object(addresses, os.environ.get(REPLICA_ADDR_ENV) if key is not None else None)
        agents = [a for a in addresses if a]
        if key is None or len(agents) < world_size:
            if rank == 0:
                log.warning("replicas_off", reason=f"{world_size - len(agents)} rank(s) have no replica server")
            return None
        return cls(rank=rank, agents=agents, key=key, records=records)

    def busy(self) -> bool:
        """Whether this rank's previous replica is still being copied."""
        return self._in_flight is not None and self._in_flight.thread.is_alive()

    def save(self, step: int, state: dict[str, Any], *, extra: dict[str, Any]) -> None:
        """Start a replica of ``state`` as step ``step``; return once it is copied in host memory.
        Every rank, collectively, and only when no rank is ``busy``."""
        if self._in_flight is not None:
            self._in_flight.thread.join()  # done on every rank: the caller checked
            self._report(self._in_flight)
            if self._in_flight.relayout:
                self._layout = None
        planner = DefaultSavePlanner()
        planner.set_up_planner({k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()})
        signature = _signature(planner.state_dict)
        if self._layout is None:
            self._layout = self._agree(planner, signature)  # nothing else is on the group now
        staged = _stage(planner, self._layout.items) if signature == self._layout.signature else None
        extra = extra | ({"records": self._records()} if self.rank == 0 else {})
        context = contextvars.copy_context()
        in_flight = _InFlight(step=step, thread=threading.Thread())
        in_flight.thread = threading.Thread(
            target=context.run,
            args=(self._finish, in_flight, self._layout, staged, extra),
            name=f"replica-step-{step}",
            daemon=True,
        )
        self._in_flight = in_flight
        in_flight.thread.start()

    def close(self) -> None:
        """Wait for the replica in flight (the run is ending on every rank)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.thread.join()
            self._report(in_flight)

    def _report(self, in_flight: _InFlight) -> None:
        if in_flight.error is not None and self.rank == 0:
            log.warning("replica_failed", step=in_flight.step, error=in_flight.error)

    def _agree(self, planner: DefaultSavePlanner, signature: tuple[Any, ...]) -> _Layout:
        """Every rank, collectively: DCP's plan of who saves which item, once, instead of on
        every replica as ``dcp.save`` does (its planning and per-item files cost a replica of a
        small model more than its bytes)."""
        plans: list[SavePlan | None] = [None] * self.world_size
        dist.all_gather_object(plans, planner.create_local_plan(), group=self._group)
        per_rank, metadata = planner.create_global_plan(cast("list[SavePlan]", plans))
        storage: dict[MetadataIndex, tuple[str, str, int]] = {}
        for rank, plan in enumerate(per_rank):
            counts = {"tensor": 0, "object": 0}
            for item in plan.items:
                kind = "object" if item.type is WriteItemType.BYTE_IO else "tensor"
                storage[item.index] = (_file_key(rank), kind, counts[kind])
                counts[kind] += 1
        metadata.storage_data = storage
        return _Layout(
            signature=signature,
            items=per_rank[self.rank].items,
            metadata=pickle.dumps(metadata) if self.rank == 0 else None,
        )

    def _finish(self, in_flight: _InFlight, layout: _Layout, staged: _Staged | None, extra: dict[str, Any]) -> None:
        """Serialize, copy to both agents, agree, publish the manifest. Every rank issues the
        same collectives whatever fails locally: errors travel as data."""
        step = in_flight.step
        started = time.monotonic()
        entries: list[ManifestEntry] = []
        error: str | None = None
        try:
            if staged is None:
                raise ValueError("the state's keys or shapes changed since the replicas' layout was agreed")
            tensors, objects = staged
            buffer = io.BytesIO()
            torch.save({"tensors": tensors, "objects": objects}, buffer)
            bodies = [(_file_key(self.rank), buffer.getvalue())]
            if layout.metadata is not None:
                bodies.append((_METADATA_KEY, layout.metadata))
            for name, body in bodies:
                for address, copy in ((self.own, "own"), (self.peer, "peer")):
                    if address is not None:
                        put_file(self.key, address, step, name, body, copy=copy)
                entries.append(ManifestEntry(key=name, size=len(body), sha256=hashlib.sha256(body).hexdigest()))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        try:
            gathered: list[tuple[list[ManifestEntry], str | None, bool] | None] = [None] * self.world_size
            dist.all_gather_object(gathered, (entries, error, staged is None), group=self._group)
            in_flight.relayout = any(part[2] for part in gathered if part)
            errors = [f"rank {r}: {part[1]}" for r, part in enumerate(gathered) if part and part[1]]
            if errors:
                in_flight.error = "; ".join(errors)
                return
            boxed = [extra if self.rank == 0 else None]
            dist.broadcast_object_list(boxed, src=0, group=self._group)
            files = sorted((e for part in gathered if part for e in part[0]), key=lambda e: e.key)
            manifest = Manifest(step=step, world_size=self.world_size, files=files, extra=boxed[0] or {})
            for address in (self.own, self.peer):
                if address is not None:
                    put_manifest(self.key, address, manifest)
            log.debug("replica_saved", step=step, files=len(files), seconds=round(time.monotonic() - started, 3))
        except Exception as exc:
            in_flight.error = f"{type(exc).__name__}: {exc}"

    # -- restore ---------------------------------------------------------------------------

    def candidates(self, not_before: int | None) -> list[Candidate]:
        """Rank 0: the whole replicas the live agents hold of steps not before ``not_before``
        (the store's newest commit), newest first."""
        indexes: dict[str, dict[str, Any]] = {}
        for address in dict.fromkeys(self.agents):
            try:
                indexes[address] = json.loads(get(self.key, address, "/index")[0])
            except (OSError, ValueError) as exc:
                log.warning("replica_index_failed", agent=address, error=str(exc))
        return whole_replicas(indexes, not_before, key=self.key)


def _file_key(rank: int) -> str:
    return f"rank-{rank}"


def _signature(flat: dict[str, Any]) -> tuple[Any, ...]:
    """The flattened state's shape: its keys, and each tensor's size and dtype."""
    return tuple(
        (key, (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None)
        for key, value in sorted(flat.items())
    )


def _stage(planner: DefaultSavePlanner, items: list[WriteItem]) -> _Staged:
    """Copies of this rank's ``items`` of the state ``planner`` was set up with, in file order:
    the tensors cloned, every other object pickled (training goes on and changes them)."""
    tensors: list[torch.Tensor] = []
    objects: list[Any] = []
    for item in items:
        value = planner.lookup_object(item.index)
        if item.type is WriteItemType.BYTE_IO:
            objects.append(value)
        else:
            tensors.append(value.detach().clone())
    return tensors, pickle.dumps(objects)


def whole_replicas(indexes: dict[str, dict[str, Any]], not_before: int | None, *, key: RunKey) -> list[Candidate]:
    """The steps with a manifest signed with ``key`` in some agent's ``index`` (agent -> ``GET
    /index``), not before ``not_before``, whose every file some agent holds with the manifest's
    sha256, newest first. A manifest that does not verify is logged with the agent that served it."""
    manifests: dict[int, Manifest] = {}
    for address, index in indexes.items():
        for listed, entry in index.items():
            manifest = _verified_manifest(key, address, listed, entry)
            if manifest is not None:
                manifests.setdefault(manifest.step, manifest)
    found = []
    for step in sorted(manifests, reverse=True):
        if not_before is not None and step < not_before:
            break
        manifest = manifests[step]
        held = {a: index.get(str(step), {}).get("files", {}) for a, index in indexes.items()}
        holders = {e.key: [a for a, files in held.items() if files.get(e.key) == e.sha256] for e in manifest.files}
        missing = [name for name, where in holders.items() if not where]
        if missing:
            log.info("replica_incomplete", step=step, missing=missing)
            continue
        found.append(Candidate(manifest=manifest, holders=holders))
    return found


def _verified_manifest(key: RunKey, address: str, step: str, entry: Any) -> Manifest | None:
    """The manifest an agent's index lists for ``step``, once its signature verifies and it names
    only a replica's own files; None when there is none yet or it does not verify (logged)."""
    if not isinstance(entry, dict) or entry.get("manifest") is None:
        return None
    try:
        body = str(entry["manifest"]).encode()
        signature = str(entry.get("signature") or "")
        if not key.verify_body(signature, "manifest", int(step), "manifest", hashlib.sha256(body).hexdigest()):
            raise ValueError("its signature does not verify")
        manifest = Manifest.from_json(body)
        if manifest.step != int(step) or not all(file_key_ok(e.key) for e in manifest.files):
            raise ValueError("it names another step or a file that is not a replica's")
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("replica_manifest_refused", agent=address, step=step, error=str(exc))
        return None
    return manifest


def fetch(candidate: Candidate, dest: Path, *, tag: str, key: RunKey) -> str | None:
    """Every file of ``candidate`` into ``dest``, each from the first holder whose copy is signed
    with ``key`` and is the manifest's (``runstore.fetch_verified``: size and sha256, a
    ``tag``-named part file first, since ranks on one node share ``dest``); what went wrong, if
    some file has no such holder."""
    step = candidate.manifest.step
    for entry in candidate.manifest.files:
        problems = []
        for address in candidate.holders[entry.key]:
            try:
                fetch_verified(
                    entry,
                    dest / entry.key,
                    tag=tag,
                    what=address,
                    download=functools.partial(_download, key, address, step, entry),
                )
                break
            except (CheckpointError, OSError) as exc:
                problems.append(str(exc))
        else:
            return f"step {step}: {entry.key}: " + "; ".join(problems)
    return None


def _download(key: RunKey, address: str, step: int, entry: ManifestEntry, part: Path) -> None:
    """File ``entry`` of replica ``step`` from the agent at ``address``, streamed into ``part``
    once the agent's signature of it verifies with ``key`` for the manifest's sha256 (which the
    bytes are then checked against). At most one byte more than the manifest's size is kept: a
    holder that serves more fails the size check without filling the disk."""

    def save(answer: http.client.HTTPResponse) -> None:
        if not key.verify_body(answer.headers.get(SIGNATURE_HEADER, ""), "file", step, entry.key, entry.sha256):
            raise CheckpointError(f"{address}: the signature of {entry.key} does not verify")
        left = entry.size + 1
        with part.open("wb") as out:
            while left > 0 and (block := answer.read(min(_BLOCK, left))):
                out.write(block)
                left -= len(block)

    path = f"/steps/{step}/files/{urllib.parse.quote(entry.key)}"
    _exchange(address, "GET", path, None, {SIGNATURE_HEADER: key.sign_request("GET", path)}, read=save)


class ReplicaReader(StorageReader):
    """DCP's reader of a replica fetched into ``path``: rank 0's metadata file and every rank's
    file (``Replicas._finish``). DCP plans the load, so a replica loads into another world size
    or layout as a store checkpoint does."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.storage_data: dict[MetadataIndex, tuple[str, str, int]] = {}
        self._files: dict[str, tuple[list[torch.Tensor], list[Any]]] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._files = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # Unpickled only once fetch() checked it against a manifest signed with the run's key.
        return cast("Metadata", pickle.loads((self.path / _METADATA_KEY).read_bytes()))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        for item in plan.items:
            key, kind, position = self.storage_data[item.storage_index]
            tensors, objects = self._file(key)
            if kind == "object":
                value = io.BytesIO()
                torch.save(objects[position], value)  # what the planner reads a DCP object from
                value.seek(0)
                planner.load_bytes(item, value)
                continue
            source = tensors[position]
            for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                source = source.narrow(dim, offset, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != source.size():
                raise ValueError(f"{item.storage_index}: size {list(source.size())}, expected {list(target.size())}")
            target.copy_(source)
            planner.commit_tensor(item, target)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def _file(self, key: str) -> tuple[list[torch.Tensor], list[Any]]:
        if key not in self._files:
            held = torch.load(self.path / key, weights_only=True)
            # Objects are unpickled as DCP's own reader does: each file was checked against a manifest
            # signed with the run's key (fetch).
            self._files[key] = (held["tensors"], pickle.loads(held["objects"]))
        return self._files[key]
