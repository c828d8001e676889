"""In-memory checkpoint replicas: every few steps each rank's checkpoint shard is held in host
memory on its own node and on the next one, so a restart loads the newest step from memory
instead of the store's older commit (run.yaml ``checkpoint.replicate_every``).

Where the bytes live: in each node's agent (``ReplicaServer``, started by ``trainer.agent``),
which outlives its workers' restarts and dies with its node, as the memory of a real node does.
The agent serves HTTP on the node's cluster address (the one collectives use) and tells its
workers where (``$INFRACTL_REPLICA_ADDR``); a worker started without our agent has no replicas.
Like torch's rendezvous and TCP stores, it trusts the cluster network.

A replica of step N (every rank, collectively, over a gloo group of its own)::

    training thread     dcp.async_save stages the state to host memory and returns (what
                        training waits for), as the store's checkpoints do
    the replica thread  waits for DCP's write to <workdir>/replicas/step-<N>/rank-<R>/, PUTs each
                        file with its sha256 to this node's agent and to the next node's (a ring
                        over the nodes, in rank order), deletes the local files; then, over the
                        group: all_gather of every rank's files and errors; if none failed, every
                        rank PUTs the step's manifest (every file's sha256, the trainer's extra,
                        rank 0's metrics records not yet in the store) to the same two agents.
                        An agent keeps the newest step with a manifest and the steps after it

A step is a replica once an agent holds its manifest; it is whole while every file the manifest
lists is held by some live agent. On restart (``Checkpointer.load``), rank 0 asks every node's
agent what it holds and picks the newest whole replica not older than the store's newest
commit; every rank fetches every file from a holder and checks its sha256 (another holder on a
mismatch); if any rank cannot, the next candidate is tried, and then the store. So a rank whose
two holders both died, or whose only surviving copy is corrupt, sends the run to the store's
commit, never to a partial or unverified replica. The store's commit rule is untouched: a replica
is never committed, and a run stopped whole resumes from the store.

Fault injection: ``$INFRACTL_REPLICA_CORRUPT=peer`` (read by the agent) makes the agent flip one
byte of every copy it holds for another node, after checking it on receipt, as memory corrupted at
rest would. Tests use it; it is never set in normal runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import hashlib
import http.client
import json
import os
import shutil
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import async_save

from infractl.log import get_logger
from infractl.runstore import Manifest, ManifestEntry, file_sha256

__all__ = [
    "CORRUPT_ENV",
    "REPLICA_ADDR_ENV",
    "Candidate",
    "ReplicaServer",
    "Replicas",
    "fetch",
    "serve",
    "whole_replicas",
]

log = get_logger(__name__)

#: Where this node's agent holds replicas (host:port), set by the agent for its workers.
REPLICA_ADDR_ENV = "INFRACTL_REPLICA_ADDR"
#: Fault-injection knob (module doc): ``peer`` corrupts the copies an agent holds for other nodes.
CORRUPT_ENV = "INFRACTL_REPLICA_CORRUPT"

#: How long an agent may leave one request's socket silent before the request fails.
_TIMEOUT_S = 10.0
#: How long a replica's collectives may wait for the slowest rank's write and copies.
_GROUP_TIMEOUT = datetime.timedelta(minutes=5)


# -- the agent's side ------------------------------------------------------------------------


@dataclass
class _Held:
    """One step an agent holds: file key -> (bytes, sha256 computed on receipt); its manifest."""

    files: dict[str, tuple[bytes, str]]
    manifest: bytes | None = None


class ReplicaServer(ThreadingHTTPServer):
    """A node's replicas, in its agent's memory, over HTTP::

    PUT  /steps/<N>/files/<key>?copy=own|peer   header X-Sha256 (400 if the body differs)
    PUT  /steps/<N>/manifest                    then every step before N is dropped
    GET  /index                                 {"<N>": {"manifest": ..., "files": {key: sha256}}}
    GET  /steps/<N>/files/<key>
    """

    daemon_threads = True

    def __init__(self, host: str, *, corrupt_peer_copies: bool = False) -> None:
        super().__init__((host, 0), _Handler)
        self.corrupt_peer_copies = corrupt_peer_copies
        self.lock = threading.Lock()
        self.steps: dict[int, _Held] = {}

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"{host!s}:{port}"

    def start(self) -> None:
        threading.Thread(target=self.serve_forever, name="replica-server", daemon=True).start()

    def put_file(self, step: int, key: str, body: bytes, sha256: str, *, peer: bool) -> bool:
        if hashlib.sha256(body).hexdigest() != sha256:
            return False
        if peer and self.corrupt_peer_copies and body:  # fault injection (module doc)
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        with self.lock:
            self.steps.setdefault(step, _Held(files={})).files[key] = (body, sha256)
        return True

    def put_manifest(self, step: int, body: bytes) -> None:
        with self.lock:
            self.steps.setdefault(step, _Held(files={})).manifest = body
            for older in [s for s in self.steps if s < step]:
                del self.steps[older]

    def index(self) -> dict[str, Any]:
        with self.lock:
            return {
                str(step): {
                    "manifest": json.loads(held.manifest) if held.manifest is not None else None,
                    "files": {key: sha for key, (_, sha) in held.files.items()},
                }
                for step, held in self.steps.items()
            }

    def get_file(self, step: int, key: str) -> bytes | None:
        with self.lock:
            held = self.steps.get(step)
            return held.files[key][0] if held is not None and key in held.files else None


class _Handler(BaseHTTPRequestHandler):
    server: ReplicaServer
    protocol_version = "HTTP/1.1"

    def do_PUT(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if len(parts) == 4 and parts[0] == "steps" and parts[1].isdigit() and parts[2] == "files":
            query = urllib.parse.parse_qs(url.query)
            ok = self.server.put_file(
                int(parts[1]),
                parts[3],
                body,
                self.headers.get("X-Sha256", ""),
                peer=query.get("copy", ["own"])[0] == "peer",
            )
            self._answer(204 if ok else 400)
        elif len(parts) == 3 and parts[0] == "steps" and parts[1].isdigit() and parts[2] == "manifest":
            self.server.put_manifest(int(parts[1]), body)
            self._answer(204)
        else:
            self._answer(404)

    def do_GET(self) -> None:
        parts = urllib.parse.urlsplit(self.path).path.strip("/").split("/")
        if parts == ["index"]:
            self._answer(200, json.dumps(self.server.index()).encode())
        elif len(parts) == 4 and parts[0] == "steps" and parts[1].isdigit() and parts[2] == "files":
            body = self.server.get_file(int(parts[1]), parts[3])
            self._answer(404) if body is None else self._answer(200, body)
        else:
            self._answer(404)

    def _answer(self, status: int, body: bytes = b"") -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a request per file per replica would drown the agent's log."""


def serve(host: str) -> ReplicaServer:
    """Start this node's replica server on ``host`` (the agent, before its workers start)."""
    server = ReplicaServer(host, corrupt_peer_copies=os.environ.get(CORRUPT_ENV, "").strip() == "peer")
    server.start()
    return server


# -- the ranks' side -------------------------------------------------------------------------


def _request(
    address: str, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> bytes:
    """One request to an agent's replica server; its body. Raises OSError when it failed."""
    host, _, port = address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=_TIMEOUT_S)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        answer = connection.getresponse()
        data = answer.read()
    except (http.client.HTTPException, OSError) as exc:
        raise OSError(f"replica server {address}: {method} {path}: {exc}") from exc
    finally:
        connection.close()
    if answer.status >= 300:
        raise OSError(f"replica server {address}: {method} {path}: HTTP {answer.status}")
    return data


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


class Replicas:
    """This rank's replicas: ``join`` on every rank."""

    def __init__(self, *, rank: int, agents: list[str], workdir: Path, records: Callable[[], list[Any]]) -> None:
        self.rank = rank
        self.world_size = len(agents)
        self.workdir = workdir
        self._records = records  # rank 0's metrics records not yet in the store
        #: Every rank's agent, and so every live node's, in rank order.
        self.agents = agents
        self.own = agents[rank]
        nodes = list(dict.fromkeys(agents))
        #: The next node's agent (a ring over the nodes in rank order); None on a single node.
        self.peer = nodes[(nodes.index(self.own) + 1) % len(nodes)] if len(nodes) > 1 else None
        # Replicas' collectives run off the training thread: a group of their own (see checkpoint.py).
        self._group = dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT)
        self._in_flight: _InFlight | None = None

    @classmethod
    def join(cls, *, rank: int, world_size: int, workdir: Path, records: Callable[[], list[Any]]) -> Replicas | None:
        """Every rank, collectively: this job's replicas, or None where a rank has no agent that
        holds them (a worker started by plain torchrun)."""
        addresses: list[str | None] = [None] * world_size
        dist.all_gather_object(addresses, os.environ.get(REPLICA_ADDR_ENV) or None)
        agents = [a for a in addresses if a]
        if len(agents) < world_size:
            if rank == 0:
                log.warning("replicas_off", reason=f"{world_size - len(agents)} rank(s) have no replica server")
            return None
        return cls(rank=rank, agents=agents, workdir=workdir, records=records)

    def busy(self) -> bool:
        """Whether this rank's previous replica is still being written or copied."""
        return self._in_flight is not None and self._in_flight.thread.is_alive()

    def save(self, step: int, state: dict[str, Any], *, extra: dict[str, Any]) -> None:
        """Start a replica of ``state`` as step ``step``; return once it is staged in host memory.
        Every rank, collectively, and only when no rank is ``busy``."""
        if self._in_flight is not None:
            self._in_flight.thread.join()  # done on every rank: the caller checked
            self._report(self._in_flight)
        staging = self.workdir / "replicas" / f"step-{step}" / f"rank-{self.rank}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        written = cast(
            "Future[Any]",
            async_save(state, storage_writer=FileSystemWriter(staging, sync_files=False), process_group=self._group),
        )
        extra = extra | ({"records": self._records()} if self.rank == 0 else {})
        context = contextvars.copy_context()
        in_flight = _InFlight(step=step, thread=threading.Thread())
        in_flight.thread = threading.Thread(
            target=context.run,
            args=(self._finish, in_flight, staging, written, extra),
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
        with contextlib.suppress(OSError):
            (self.workdir / "replicas").rmdir()

    def _report(self, in_flight: _InFlight) -> None:
        if in_flight.error is not None and self.rank == 0:
            log.warning("replica_failed", step=in_flight.step, error=in_flight.error)

    def _finish(self, in_flight: _InFlight, staging: Path, written: Future[Any], extra: dict[str, Any]) -> None:
        """Write, copy to both agents, agree, publish the manifest. Every rank issues the same
        collectives whatever fails locally: errors travel as data."""
        step = in_flight.step
        started = time.monotonic()
        entries: list[ManifestEntry] = []
        error: str | None = None
        try:
            written.result()
            for path in sorted(p for p in staging.rglob("*") if p.is_file()):
                body = path.read_bytes()  # read once: hashed here, sent to both agents
                entry = ManifestEntry(key=path.name, size=len(body), sha256=hashlib.sha256(body).hexdigest())
                for address, copy in ((self.own, "own"), (self.peer, "peer")):
                    if address is not None:
                        _request(
                            address,
                            "PUT",
                            f"/steps/{step}/files/{urllib.parse.quote(entry.key)}?copy={copy}",
                            body,
                            {"X-Sha256": entry.sha256},
                        )
                entries.append(entry)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            with contextlib.suppress(OSError):  # empty once this node's other ranks are done too
                staging.parent.rmdir()
        try:
            gathered: list[tuple[list[ManifestEntry], str | None] | None] = [None] * self.world_size
            dist.all_gather_object(gathered, (entries, error), group=self._group)
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
                    _request(address, "PUT", f"/steps/{step}/manifest", manifest.to_json())
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
                indexes[address] = json.loads(_request(address, "GET", "/index"))
            except (OSError, ValueError) as exc:
                log.warning("replica_index_failed", agent=address, error=str(exc))
        return whole_replicas(indexes, not_before)


def whole_replicas(indexes: dict[str, dict[str, Any]], not_before: int | None) -> list[Candidate]:
    """The steps with a manifest in some agent's ``index`` (agent -> ``GET /index``), not before
    ``not_before``, whose every file some agent holds with the manifest's sha256, newest first."""
    manifests: dict[int, Manifest] = {}
    for index in indexes.values():
        for key, entry in index.items():
            if entry["manifest"] is not None:
                manifests.setdefault(int(key), Manifest.from_json(json.dumps(entry["manifest"]).encode()))
    found = []
    for step in sorted(manifests, reverse=True):
        if not_before is not None and step < not_before:
            break
        manifest = manifests[step]
        held = {a: index.get(str(step), {}).get("files", {}) for a, index in indexes.items()}
        holders = {e.key: [a for a, files in held.items() if files.get(e.key) == e.sha256] for e in manifest.files}
        missing = [key for key, where in holders.items() if not where]
        if missing:
            log.info("replica_incomplete", step=step, missing=missing)
            continue
        found.append(Candidate(manifest=manifest, holders=holders))
    return found


def fetch(candidate: Candidate, dest: Path, *, tag: str) -> str | None:
    """Every file of ``candidate`` into ``dest``, each checked against the manifest (the next
    holder on a mismatch) and written under a ``tag``-named part file first (ranks on one node
    share ``dest``); what went wrong, if anything."""
    step = candidate.manifest.step
    for entry in candidate.manifest.files:
        target = dest / entry.key
        if target.is_file() and file_sha256(target) == entry.sha256:
            continue  # another rank on this node fetched it
        problems = []
        for address in candidate.holders[entry.key]:
            try:
                body = _request(address, "GET", f"/steps/{step}/files/{urllib.parse.quote(entry.key)}")
            except OSError as exc:
                problems.append(str(exc))
                continue
            digest = hashlib.sha256(body).hexdigest()
            if digest != entry.sha256:
                problems.append(f"{address}: sha256 is {digest}, the manifest says {entry.sha256}")
                continue
            dest.mkdir(parents=True, exist_ok=True)
            part = dest / f".{entry.key}.{tag}.part"
            part.write_bytes(body)
            os.replace(part, target)
            break
        else:
            return f"step {step}: {entry.key}: " + "; ".join(problems)
    return None
