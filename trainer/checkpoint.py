"""Checkpoints: DCP on local disk, shipped to the store, committed by rank 0; and restore.

Save (every rank, collectively)::

    <workdir>/staging/step-<N>/rank-<R>/   dcp.save writes this rank's shards here (rank 0 also
                                           writes .metadata); each rank uploads what it wrote to
                                           ckpt/step-<N>/ under the same names, then deletes it
    all_gather(ManifestEntry lists)        size + sha256 of every uploaded file
    rank 0: commit_checkpoint, prune       MANIFEST.json then COMMITTED (create-only)

Restore (every rank): the newest committed step that verifies, downloaded to
``<workdir>/restore/step-<N>/`` (each file checked against the manifest's sha256), then
``dcp.load``, which reshards to the current world size.

Ranks on one node share the workdir and nodes may share a filesystem: staging dirs are
per rank, and downloads land under a per-rank temporary name and are renamed into place,
so ranks never see each other's half-written files.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from infractl.log import get_logger
from infractl.runstore import (
    CheckpointError,
    Manifest,
    ManifestEntry,
    checkpoint_prefix,
    commit_checkpoint,
    committed_steps,
    file_sha256,
    prune_checkpoints,
    verify_checkpoint,
)
from infractl.store import Store, StoreKeyError

__all__ = ["Checkpointer"]

log = get_logger(__name__)

_T = TypeVar("_T")

#: Builds the state to save or load; told the manifest being loaded (None when saving).
StateBuilder = Callable[[Manifest | None], dict[str, Any]]


class Checkpointer:
    """Saves and restores one run's checkpoints. Collective: call every method on every rank."""

    def __init__(
        self,
        store: Store,
        *,
        run_id: str,
        workdir: Path,
        rank: int,
        world_size: int,
        keep: int,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.workdir = workdir
        self.rank = rank
        self.world_size = world_size
        self.keep = keep

    # The public methods keep the protocol (who decides, who waits, what must never happen:
    # loading an uncommitted or unverified step); the _hooks only move bytes, so an async
    # or store-specific variant replaces the hooks and leaves the protocol alone.

    def save(self, step: int, state: dict[str, Any], *, extra: dict[str, Any]) -> bool:
        """Save ``state`` as step ``step``; return True where this call committed it (rank 0).

        Saving a step that is already committed happens only after ``load`` skipped it as
        corrupt; its files and manifest are rewritten, which repairs it.
        """
        started = time.monotonic()
        entries = self._save(step, state)
        gathered: list[list[ManifestEntry] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, entries)
        if self.rank != 0:
            return False
        files = sorted((e for part in gathered for e in part or []), key=lambda e: e.key)
        manifest = Manifest(step=step, world_size=self.world_size, files=files, extra=extra)
        committed = commit_checkpoint(self.store, self.run_id, manifest)
        pruned = prune_checkpoints(self.store, self.run_id, keep=self.keep)
        log.info(
            "checkpoint_committed",
            step=step,
            rewritten=not committed,
            files=len(files),
            bytes=sum(e.size for e in files),
            seconds=round(time.monotonic() - started, 3),
            pruned=pruned,
        )
        return committed

    def load(self, build_state: StateBuilder) -> Manifest | None:
        """Load the newest committed step that verifies into ``build_state(manifest)``.

        Returns that step's manifest, or None when the run has no committed step. A step that
        fails verification (missing file, wrong size or sha256) is skipped for the one before
        it; if every committed step fails, raises CheckpointError rather than start over.
        """
        steps = self._on_rank0(
            lambda: sorted(committed_steps(self.store, self.run_id), reverse=True)
        )
        for step in steps:
            manifest, error = self._on_rank0(functools.partial(self._verify, step))
            if manifest is not None:
                # Every rank checks what it downloaded; all must succeed to use the step.
                errors: list[str | None] = [None] * self.world_size
                dist.all_gather_object(errors, self._fetch(manifest))
                error = next((e for e in errors if e), None)
                if error is None:
                    self._load(manifest, build_state(manifest))
                    return manifest
            if self.rank == 0:
                log.warning("checkpoint_invalid", step=step, error=error)
            shutil.rmtree(self._restore_dir(step), ignore_errors=True)
        if steps:
            raise CheckpointError(
                f"run {self.run_id!r}: no committed checkpoint verifies (tried steps {steps})"
            )
        return None

    # -- hooks ---------------------------------------------------------------------------

    def _save(self, step: int, state: dict[str, Any]) -> list[ManifestEntry]:
        staging = self.workdir / "staging" / f"step-{step}" / f"rank-{self.rank}"
        shutil.rmtree(staging, ignore_errors=True)  # leftovers of an interrupted attempt
        staging.mkdir(parents=True)
        dcp.save(state, storage_writer=FileSystemWriter(staging))
        prefix = checkpoint_prefix(self.run_id, step)
        entries = []
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):
            key = path.relative_to(staging).as_posix()
            entries.append(
                ManifestEntry(key=key, size=path.stat().st_size, sha256=file_sha256(path))
            )
            self.store.put_file(f"{prefix}/{key}", path)
        shutil.rmtree(staging)
        _remove_empty(staging.parent, staging.parent.parent)
        return entries

    def _verify(self, step: int) -> tuple[Manifest | None, str | None]:
        try:
            return verify_checkpoint(self.store, self.run_id, step), None
        except CheckpointError as exc:
            return None, str(exc)

    def _restore_dir(self, step: int) -> Path:
        return self.workdir / "restore" / f"step-{step}"

    def _fetch(self, manifest: Manifest) -> str | None:
        """Download the step's files into the restore dir; return what went wrong, if anything."""
        restore = self._restore_dir(manifest.step)
        prefix = checkpoint_prefix(self.run_id, manifest.step)
        try:
            for entry in manifest.files:
                self._download(f"{prefix}/{entry.key}", restore / entry.key, entry)
        except (CheckpointError, StoreKeyError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _load(self, manifest: Manifest, state: dict[str, Any]) -> None:
        restore = self._restore_dir(manifest.step)
        dcp.load(state, storage_reader=FileSystemReader(restore))
        # Ranks sharing this workdir may still be reading it.
        dist.barrier()
        shutil.rmtree(restore, ignore_errors=True)
        _remove_empty(restore.parent)

    def _download(self, key: str, dest: Path, entry: ManifestEntry) -> None:
        if (
            dest.is_file()
            and dest.stat().st_size == entry.size
            and file_sha256(dest) == entry.sha256
        ):
            return  # another rank on this node already fetched it
        tmp = dest.with_name(f".{dest.name}.rank-{self.rank}.part")
        self.store.get_file(key, tmp)
        digest = file_sha256(tmp)
        if digest != entry.sha256:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"{key}: sha256 is {digest}, the manifest says {entry.sha256}")
        os.replace(tmp, dest)

    def _on_rank0(self, compute: Callable[[], _T]) -> _T:
        """``compute()`` run on rank 0 only, its result given to every rank: one decision."""
        box: list[Any] = [compute() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return cast(_T, box[0])


def _remove_empty(*dirs: Path) -> None:
    for path in dirs:
        try:
            path.rmdir()
        except OSError:
            return  # not empty (another rank's files) or already gone
