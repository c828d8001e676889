"""The checkpoint commit protocol: a step exists only once its COMMITTED marker does. Writers
upload every file, then publish MANIFEST.json (every key with size and sha256) and COMMITTED last
and create-only; readers list committed steps, verify a step against its manifest before loading
it, and check each file's checksum as they fetch it; retention deletes old steps only after a
newer one committed."""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from infractl.errors import InfractlError, StoreError
from infractl.runstore.keys import checkpoint_prefix, run_prefix
from infractl.runstore.records import Manifest, ManifestEntry
from infractl.store import Store, StoreKeyError

__all__ = [
    "CheckpointError",
    "commit_checkpoint",
    "committed_steps",
    "fetch_checkpoint_file",
    "fetch_verified",
    "file_sha256",
    "latest_committed_step",
    "prune_checkpoints",
    "read_manifest",
    "set_aside",
    "step_objects",
    "verify_checkpoint",
]

_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(InfractlError):
    """A checkpoint failed verification (missing key, wrong size or checksum)."""


def fetch_verified(entry: ManifestEntry, dest: Path, *, tag: str, what: str, download: Callable[[Path], None]) -> None:
    """The one way a file a manifest lists is fetched, from the store or from a replica's holder:
    into ``dest`` (``<directory>/<entry.key>``). Skipped when ``dest`` already holds it (its size
    and sha256: another rank on this node fetched it). Else ``download(part)`` writes the bytes,
    streamed, to a ``tag``-named part file beside ``dest``, whose size and sha256 are checked
    against ``entry`` (read back in blocks: never the whole file in memory) before it is renamed
    onto ``dest``; the part file is removed whatever happens. ``CheckpointError`` (its message
    starting with ``what``) when the bytes are not the manifest's, or when ``dest`` or the part
    file would lead outside the directory; ``download``'s own errors are left to the caller."""
    part = dest.with_name(f".{dest.name}.{tag}.part")
    _confine(what, entry.key, dest, part)
    if _holds(dest, entry):
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        download(part)
        size = part.stat().st_size
        if size != entry.size:
            raise CheckpointError(f"{what}: {size} bytes, the manifest says {entry.size}")
        digest = file_sha256(part)
        if digest != entry.sha256:
            raise CheckpointError(f"{what}: sha256 is {digest}, the manifest says {entry.sha256}")
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)


def _holds(path: Path, entry: ManifestEntry) -> bool:
    return path.is_file() and path.stat().st_size == entry.size and file_sha256(path) == entry.sha256


def fetch_checkpoint_file(store: Store, run_id: str, step: int, entry: ManifestEntry, dest: Path, *, tag: str) -> None:
    """One file of a committed step into ``dest`` (``<restore directory>/<entry.key>``), by
    ``fetch_verified``: ``CheckpointError`` when it is not the manifest's, the store's errors as
    they come."""
    key = f"{checkpoint_prefix(run_id, step)}/{entry.key}"
    fetch_verified(
        entry, dest, tag=tag, what=f"step {step}: {entry.key}", download=lambda part: store.get_file(key, part)
    )


def _confine(what: str, key: str, dest: Path, tmp: Path) -> None:
    """``CheckpointError`` unless ``dest`` and its part file ``tmp``, resolved, lie inside the
    directory ``dest`` is ``key`` under. The key itself cannot climb out (``ManifestEntry``), but
    a symlink in the directory can lead out of it, and the download would write through it."""
    parts = PurePosixPath(key).parts
    if dest.parts[-len(parts) :] != parts:
        raise ValueError(f"{dest} is not <restore directory>/{key}")
    directory = dest.parents[len(parts) - 1].resolve()
    for path in (dest, tmp):
        if not path.resolve().is_relative_to(directory):
            raise CheckpointError(f"{what}: leads to {path.resolve()}, outside the restore directory {directory}")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def commit_checkpoint(store: Store, run_id: str, manifest: Manifest, *, replace: bool = False) -> bool:
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
        parts = obj.key[len(base) :].split("/")
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
    present = {o.key[len(prefix) + 1 :]: o.size for o in store.list(prefix)}
    for entry in manifest.files:
        if entry.key not in present:
            raise CheckpointError(f"step {step}: {entry.key} is missing from the store")
        if present[entry.key] != entry.size:
            raise CheckpointError(f"step {step}: {entry.key} is {present[entry.key]} bytes, manifest says {entry.size}")
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


def set_aside(store: Store, run_id: str, after: int) -> tuple[list[int], str]:
    """Roll the run back to its committed step ``after``: move every committed step newer than it
    under ``runs/<run>/rolled-back/<UTC time>/``, where nothing reads them and retention never
    deletes them. Returns the steps moved and that prefix. Uncommitted leftovers stay: the run's
    resume deletes them, as after any interrupted save.

    Each step is copied whole first, then uncommitted (its COMMITTED marker deleted), then deleted.
    Interrupted, a step is either still committed in place (and its copy may be partial: run it
    again) or already whole in the copy (a resume deletes what is left in place).
    """
    committed = committed_steps(store, run_id)
    if after not in committed:
        raise CheckpointError(f"step {after} of run {run_id!r} is not committed")
    aside = f"{run_prefix(run_id)}/rolled-back/{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    moved = [step for step in committed if step > after]
    for step in moved:
        prefix = checkpoint_prefix(run_id, step)
        for obj in store.list(prefix):
            store.copy(obj.key, f"{aside}/{obj.key[len(run_prefix(run_id)) + len('/ckpt/') :]}")
        store.delete_prefix(f"{prefix}/COMMITTED")
        store.delete_prefix(prefix)
    return moved, aside
