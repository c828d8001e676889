"""Where a run's objects live in the store, and the checkpoint commit protocol.

Layout (``<store>/runs/<run-id>/``)::

    run.json                          resolved spec, cluster, attempts (written by the launcher)
    metrics/<first-step>-<ns>.jsonl   per-step records, one object per chunk (no appends)
    ckpt/step-<N>/...                 DCP shards and .metadata
    ckpt/step-<N>/MANIFEST.json       every key with size and sha256, step, world size
    ckpt/step-<N>/COMMITTED           written last and create-only

A checkpoint exists only once COMMITTED exists. The trainer writes; the CLI only reads.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infractl.errors import InfractlError, StoreError
from infractl.store import Store, StoreKeyError

__all__ = [
    "ManifestEntry",
    "Manifest",
    "CheckpointError",
    "run_prefix",
    "checkpoint_prefix",
    "file_sha256",
    "commit_checkpoint",
    "step_objects",
    "read_manifest",
    "committed_steps",
    "latest_committed_step",
    "verify_checkpoint",
    "prune_checkpoints",
    "write_metrics",
    "read_metrics",
    "read_run_record",
    "write_run_record",
    "list_runs",
    "latest_metrics",
]

_STEP_DIR = re.compile(r"^step-(\d+)$")
_METRICS_CHUNK = re.compile(r"^(\d+)-(\d+)\.jsonl$")


class CheckpointError(InfractlError):
    """A checkpoint failed verification (missing key, wrong size or checksum)."""


def _parse_json(store: Store, key: str, data: bytes) -> Any:
    """An object's JSON, or ``StoreError`` naming the object when it is not JSON (a truncated
    or hand-edited record must be one clear line, not a traceback)."""
    try:
        return json.loads(data)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError alike
        raise StoreError(store.uri, f"{key} is not valid JSON ({exc})") from None


@dataclass(frozen=True)
class ManifestEntry:
    key: str  # relative to the checkpoint's prefix
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    files: list[ManifestEntry]
    created: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Manifest":
        raw = json.loads(data)
        files = [ManifestEntry(**f) for f in raw.pop("files")]
        return cls(files=files, **raw)


def run_prefix(run_id: str) -> str:
    return f"runs/{run_id}"


def checkpoint_prefix(run_id: str, step: int) -> str:
    return f"{run_prefix(run_id)}/ckpt/step-{step:08d}"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def commit_checkpoint(
    store: Store, run_id: str, manifest: Manifest, *, replace: bool = False
) -> bool:
    """Publish MANIFEST then COMMITTED (create-only). Every listed file must already be in the store.

    Returns True if this call committed the step. A step that is already committed is left
    untouched and False is returned (a retried commit is harmless), unless ``replace``: then
    its MANIFEST.json is rewritten to describe the files just uploaded over it (the repair of
    a step that failed verification) and False is returned as well.
    """
    prefix = checkpoint_prefix(run_id, manifest.step)
    committed = f"{prefix}/COMMITTED"
    if store.exists(committed) and not replace:
        return False
    store.put_bytes(f"{prefix}/MANIFEST.json", manifest.to_json())
    return store.put_if_absent(committed, str(manifest.step).encode())


def step_objects(store: Store, run_id: str) -> dict[int, set[str]]:
    """Map step -> names of the objects under ckpt/step-<N>/ (committed or not)."""
    steps: dict[int, set[str]] = {}
    base = f"{run_prefix(run_id)}/ckpt/"
    for obj in store.list(base):
        parts = obj.key[len(base):].split("/")
        match = _STEP_DIR.match(parts[0])
        if match:
            steps.setdefault(int(match.group(1)), set()).add("/".join(parts[1:]))
    return steps


def read_manifest(store: Store, run_id: str, step: int) -> Manifest | None:
    """The step's MANIFEST.json, or None if it has none (yet, or any more)."""
    key = f"{checkpoint_prefix(run_id, step)}/MANIFEST.json"
    try:
        data = store.get_bytes(key)
    except StoreKeyError:
        return None
    try:
        return Manifest.from_json(data)
    except (ValueError, TypeError, KeyError) as exc:
        raise StoreError(store.uri, f"{key} is not a valid manifest ({type(exc).__name__}: {exc})") from None


def committed_steps(store: Store, run_id: str) -> list[int]:
    return sorted(step for step, names in step_objects(store, run_id).items() if "COMMITTED" in names)


def latest_committed_step(store: Store, run_id: str) -> int | None:
    steps = committed_steps(store, run_id)
    return steps[-1] if steps else None


def verify_checkpoint(store: Store, run_id: str, step: int) -> Manifest:
    """Check that every manifest entry is present with its recorded size; return the manifest.

    Checksums are verified by whoever downloads the files (see ``file_sha256``).
    """
    prefix = checkpoint_prefix(run_id, step)
    if not store.exists(f"{prefix}/COMMITTED"):
        raise CheckpointError(f"step {step} of run {run_id!r} is not committed")
    manifest = read_manifest(store, run_id, step)
    if manifest is None:
        raise CheckpointError(f"step {step} of run {run_id!r} has no MANIFEST.json")
    present = {o.key[len(prefix) + 1:]: o.size for o in store.list(prefix)}
    for entry in manifest.files:
        if entry.key not in present:
            raise CheckpointError(f"step {step}: {entry.key} is missing from the store")
        if present[entry.key] != entry.size:
            raise CheckpointError(
                f"step {step}: {entry.key} is {present[entry.key]} bytes, manifest says {entry.size}"
            )
    return manifest


def prune_checkpoints(store: Store, run_id: str, *, keep: int, idle: bool = False) -> list[int]:
    """Delete committed steps beyond the newest ``keep`` and uncommitted steps older than the
    newest committed one (leftovers of interrupted saves). Returns the deleted steps.

    An uncommitted step newer than the newest committed one may be a save still in flight, so
    it is kept, unless ``idle``: the caller knows no save is running (a job resuming), and
    every uncommitted step is a leftover.
    """
    if keep < 2:
        raise ValueError("keep must be at least 2")
    dirs = step_objects(store, run_id)
    committed = sorted(s for s, names in dirs.items() if "COMMITTED" in names)
    newest = committed[-1] if committed else -1
    partial = [s for s, names in dirs.items() if "COMMITTED" not in names]
    doomed = committed[:-keep] + [s for s in partial if idle or s < newest]
    for step in sorted(doomed):
        store.delete_prefix(checkpoint_prefix(run_id, step))
    return sorted(doomed)


def write_metrics(store: Store, run_id: str, records: list[dict[str, Any]]) -> None:
    """Write one chunk of per-step records as its own object (object stores cannot append)."""
    if not records:
        return
    first = int(records[0]["step"])
    key = f"{run_prefix(run_id)}/metrics/{first:08d}-{time.time_ns()}.jsonl"
    store.put_bytes(key, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode())


def _metrics_chunks(store: Store, run_id: str) -> list[tuple[str, int, int]]:
    """(key, first step, write time in ns) of every metrics chunk; other objects are ignored."""
    chunks = []
    for obj in store.list(f"{run_prefix(run_id)}/metrics/"):
        match = _METRICS_CHUNK.match(obj.key.rsplit("/", 1)[-1])
        if match:
            chunks.append((obj.key, int(match.group(1)), int(match.group(2))))
    return chunks


def read_metrics(store: Store, run_id: str) -> list[dict[str, Any]]:
    """Per-step records sorted by step; a step recorded again after a resume keeps the newest."""
    chunks = sorted((written, first, key) for key, first, written in _metrics_chunks(store, run_id))
    by_step: dict[int, dict[str, Any]] = {}
    for _written, _first, key in chunks:
        for line in store.get_bytes(key).splitlines():
            if line.strip():
                record = _parse_json(store, key, line)
                by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def read_run_record(store: Store, run_id: str) -> dict[str, Any] | None:
    key = f"{run_prefix(run_id)}/run.json"
    try:
        data = store.get_bytes(key)
    except StoreKeyError:
        return None
    record = _parse_json(store, key, data)
    if not isinstance(record, dict):
        raise StoreError(store.uri, f"{key} is not a run record (a JSON object)")
    return record


def write_run_record(store: Store, run_id: str, record: dict[str, Any]) -> None:
    store.put_bytes(f"{run_prefix(run_id)}/run.json", json.dumps(record, indent=1).encode())


def list_runs(store: Store) -> list[str]:
    return sorted({o.key.split("/")[1] for o in store.list("runs/") if o.key.endswith("/run.json")})


def latest_metrics(store: Store, run_id: str) -> dict[str, Any] | None:
    """The newest per-step record (reads only the most recently written chunk)."""
    newest: tuple[int, str] | None = None
    for key, _first, written in _metrics_chunks(store, run_id):
        if newest is None or written > newest[0]:
            newest = (written, key)
    if newest is None:
        return None
    lines = [line for line in store.get_bytes(newest[1]).splitlines() if line.strip()]
    return _parse_json(store, newest[1], lines[-1]) if lines else None  # type: ignore[no-any-return]
