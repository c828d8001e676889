"""Checkpoints: DCP staged in host memory, written and shipped to the store in the background,
committed by rank 0; and restore.

Save (every rank, collectively; at most one save in flight)::

    save(), training thread       waits for the previous save; dcp.async_save stages the state
                                  to host memory (a copy: training may go on mutating the live
                                  tensors) and returns. This is all that training waits for.
    DCP's writer thread           writes the staged copy to <workdir>/staging/step-<N>/rank-<R>/
                                  (this rank's shards; rank 0 also writes .metadata)
    the save's own thread         uploads what this rank wrote to ckpt/step-<N>/ under the same
                                  names and deletes it locally; then, over the checkpoint group:
                                  all_gather(ManifestEntry lists), rank 0 commits (MANIFEST.json,
                                  whose ``created`` is the commit time, then COMMITTED
                                  create-only) and prunes, and tells every rank
    wait(), next save, close()    block until that thread is done. A failed save (on any rank:
                                  the outcome is agreed) raises from wait() and close(); the
                                  next save logs it and training goes on, the store may be back

The caller keeps training from waiting long on a slow or unreachable store: before a
scheduled save it calls ``settle`` (a bounded wait for the previous save) on every rank and,
if that save is still running anywhere, skips this one (the ranks agree on it; see
``Trainer.train``). Only a save that must happen (the last step, a preemption) waits it out.

Collectives issued off the training thread (DCP's own plan exchange, the manifest gather, the
commit outcome) all go over one dedicated gloo group created with the Checkpointer, never over
the default group the training step uses: two threads' collectives on one group would interleave.

Restore (every rank): first, leftovers of interrupted saves are deleted (nothing is in flight
when a job starts, so every uncommitted step is one); then the newest committed step that
verifies is downloaded to ``<workdir>/restore/step-<N>/`` (each file checked against the
manifest's sha256) and loaded with ``dcp.load``, which reshards to the current world size.

Ranks on one node share the workdir and nodes may share a filesystem: staging dirs are
per rank, and downloads land under a per-rank temporary name and are renamed into place,
so ranks never see each other's half-written files.

Fault injection (a drill's hook, trainer/faults.py): ``upload_delay_s`` makes every save sleep
after its shards are uploaded and before the manifest is gathered and committed, so a drill or a
test can kill a job while a step's files are in the store and the step is not committed.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.checkpoint.storage import StorageReader

from infractl.log import get_logger
from infractl.runstore import (
    CheckpointError,
    Manifest,
    ManifestEntry,
    checkpoint_prefix,
    commit_checkpoint,
    committed_steps,
    fetch_checkpoint_file,
    file_sha256,
    prune_checkpoints,
    verify_checkpoint,
)
from infractl.store import Store, StoreError
from trainer.replicas import ReplicaReader, Replicas
from trainer.replicas import fetch as fetch_replica

__all__ = ["Checkpointer", "SaveFailed"]

log = get_logger(__name__)

_T = TypeVar("_T")

#: Builds the state to save or load; told the manifest being loaded (None when saving).
StateBuilder = Callable[[Manifest | None], dict[str, Any]]

#: How long a checkpoint collective may wait for the slowest rank's write and upload.
_GROUP_TIMEOUT = datetime.timedelta(minutes=30)


class SaveFailed(CheckpointError):
    """A save did not commit: its step, and what went wrong on which rank."""

    def __init__(self, step: int, error: str) -> None:
        super().__init__(f"checkpoint of step {step} failed: {error}")
        self.step = step
        self.error = error


@dataclass
class _Staged:
    """One save after staging: where DCP writes this rank's files, and its write in flight."""

    step: int
    dir: Path
    written: Future[Any]


@dataclass
class _InFlight:
    """The save whose write, upload and commit are running on ``thread``."""

    step: int
    timings: dict[str, float]
    thread: threading.Thread = field(default_factory=threading.Thread)
    error: str | None = None
    committed: bool | None = None  # rank 0's answer: False = rewrote a committed step


class Checkpointer:
    """Saves and restores one run's checkpoints. Collective: call every method on every rank,
    in the same order. ``save`` returns once the state is staged; ``wait`` until it is committed;
    ``close`` after the last save (it waits, and raises if that save failed)."""

    def __init__(
        self,
        store: Store,
        *,
        run_id: str,
        workdir: Path,
        rank: int,
        world_size: int,
        keep: int,
        upload_delay_s: float = 0.0,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.workdir = workdir
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.upload_delay_s = upload_delay_s  # fault injection (see module doc)
        # Collective: every rank creates it here, in the same order as any other group.
        self._group = dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT)
        self._in_flight: _InFlight | None = None
        self._settled_s = 0.0  # waited by ``settle`` since the last save
        # Committed steps that ``load`` found corrupt: saving one of them again repairs it.
        self._repair: set[int] = set()
        self._closed = False

    # The public methods keep the protocol (who decides, who waits, what must never happen:
    # loading an uncommitted or unverified step, two saves in flight, a committed step
    # overwritten unasked); the _hooks only move bytes, so an async or store-specific
    # variant replaces the hooks and leaves the protocol alone.

    def save(self, step: int, state: dict[str, Any], *, extra: dict[str, Any]) -> None:
        """Start saving ``state`` as step ``step``; return once it is staged in host memory.

        Waits first for the previous save to finish. If that one failed (the store was down,
        say), the failure is logged and training goes on: this save tries again, and ``close``
        raises if the last one fails. The write, upload and commit run in the background;
        ``wait`` blocks until they are done. Saving a step that is already committed rewrites
        it only where ``load`` skipped it as corrupt (a repair); otherwise its files are left
        alone.
        """
        if self._closed:
            raise RuntimeError("Checkpointer.save after close()")
        called, self._settled_s = time.monotonic() - self._settled_s, 0.0
        try:
            self.wait()
        except SaveFailed as exc:
            if self.rank == 0:  # every rank has the same outcome; rank 0 speaks for the job
                log.error("checkpoint_failed", step=exc.step, error=exc.error)
        waited = time.monotonic() - called
        if self.rank == 0:
            log.info("checkpoint_started", step=step, waited_s=round(waited, 3))
        staged = self._stage(step, state)
        blocking = time.monotonic() - called
        # Every rank: from here training goes on while the copy is written, uploaded, committed.
        log.info("checkpoint_staged", step=step, reason=extra.get("reason"), blocking_s=round(blocking, 3))
        in_flight = _InFlight(step=step, timings={"called": called, "waited_s": waited, "blocking_s": blocking})
        # The thread carries this thread's log context (the rank) into its log lines.
        context = contextvars.copy_context()
        in_flight.thread = threading.Thread(
            target=context.run,
            args=(self._finish, in_flight, staged, extra),
            name=f"checkpoint-step-{step}",
            daemon=True,
        )
        self._in_flight = in_flight
        in_flight.thread.start()

    def settle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for this rank's part of the save in flight; return True if
        it is still running (a ``save`` or ``wait`` now would block). The time waited counts
        as the next save's ``waited_s``."""
        if self._in_flight is None:
            return False
        started = time.monotonic()
        self._in_flight.thread.join(timeout_s)
        self._settled_s += time.monotonic() - started
        return self._in_flight.thread.is_alive()

    @property
    def in_flight_step(self) -> int | None:
        """The step of the save started last and not yet waited for, if any."""
        return self._in_flight.step if self._in_flight is not None else None

    def wait(self) -> int | None:
        """Block until the save in flight (if any) is done; return its step.

        Raises SaveFailed if it failed on any rank (every rank raises: the outcome is agreed
        over the checkpoint group).
        """
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return None
        in_flight.thread.join()
        if in_flight.error is not None:
            raise SaveFailed(in_flight.step, in_flight.error)
        return in_flight.step

    def close(self) -> None:
        """Wait for the last save to commit. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.wait()

    def load(self, build_state: StateBuilder, replicas: Replicas | None = None) -> Manifest | None:
        """Load the newest committed step that verifies into ``build_state(manifest)``, or a
        newer whole replica from the agents' memory (``replicas``, see trainer/replicas.py).

        Returns that step's manifest, or None when the run has no committed step. A step that
        fails verification (missing file, wrong size or sha256) is skipped for the one before
        it; if every committed step fails, raises CheckpointError rather than start over.
        Leftovers of interrupted saves (uncommitted steps, local staging) are deleted first.
        """
        self.wait()
        _remove_contents(self._staging_dir(None))
        steps = self._on_rank0(self._clean_and_list)
        if replicas is not None:
            manifest = self._load_replica(replicas, build_state, not_before=steps[0] if steps else None)
            if manifest is not None:
                return manifest
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
            self._repair.add(step)
            shutil.rmtree(self._restore_dir(step), ignore_errors=True)
        if steps:
            raise CheckpointError(f"run {self.run_id!r}: no committed checkpoint verifies (tried steps {steps})")
        return None

    def _load_replica(
        self, replicas: Replicas, build_state: StateBuilder, *, not_before: int | None
    ) -> Manifest | None:
        """The newest whole replica not older than ``not_before`` whose every file every rank
        fetched and verified, loaded; None when there is none (then the store's commit is loaded)."""
        for candidate in self._on_rank0(lambda: replicas.candidates(not_before)):
            manifest = candidate.manifest
            restore = self._restore_dir(manifest.step)
            errors: list[str | None] = [None] * self.world_size
            dist.all_gather_object(errors, fetch_replica(candidate, restore, tag=f"rank-{self.rank}", key=replicas.key))
            error = next((e for e in errors if e), None)
            if error is None:
                self._load(manifest, build_state(manifest), reader=ReplicaReader(restore))
                return manifest
            if self.rank == 0:
                log.warning("replica_invalid", step=manifest.step, error=error)
            dist.barrier()  # every rank is done with the files before they go
            shutil.rmtree(restore, ignore_errors=True)
        return None

    # -- protocol, off the training thread ----------------------------------------------

    def _finish(self, in_flight: _InFlight, staged: _Staged, extra: dict[str, Any]) -> None:
        """Write, upload, gather, commit. Every rank issues the same collectives in the same
        order whatever fails locally: errors travel as data, so no rank is left waiting."""
        step = staged.step
        try:
            error: str | None = None
            entries: list[ManifestEntry] = []
            try:
                self._write(staged)
            except Exception as exc:
                error = _describe(exc)
            # A committed step is rewritten only when load found it corrupt.
            exists, check_error = self._on_rank0(functools.partial(self._committed_unasked, step), group=self._group)
            error = error or check_error
            if error is None and not exists:
                try:
                    entries = self._upload(staged)
                    if self.upload_delay_s:
                        time.sleep(self.upload_delay_s)  # fault injection (see module doc)
                except Exception as exc:
                    error = _describe(exc)
            shutil.rmtree(staged.dir, ignore_errors=True)
            _remove_empty(staged.dir.parent)  # staging/ itself stays (see _staging_dir)

            gathered: list[tuple[list[ManifestEntry], str | None] | None] = [None] * self.world_size
            dist.all_gather_object(gathered, (entries, error), group=self._group)
            errors = [f"rank {r}: {part[1]}" for r, part in enumerate(gathered) if part and part[1]]
            outcome: tuple[bool | None, str | None] = (None, "; ".join(errors) or None)
            if self.rank == 0 and not errors:
                if exists:
                    log.warning("checkpoint_exists", step=step, reason="already committed")
                else:
                    files = [e for part in gathered if part for e in part[0]]
                    try:
                        outcome = (self._commit(in_flight, step, files, extra), None)
                    except Exception as exc:
                        outcome = (None, f"rank 0: commit: {_describe(exc)}")
            outcome = self._on_rank0(lambda: outcome, group=self._group)
            in_flight.committed, in_flight.error = outcome
            if self.rank != 0 and in_flight.committed is not None:
                # Rank 0 logged it with the details when it committed; the others learn it now.
                log.info("checkpoint_committed", step=step, rewritten=not in_flight.committed)
            if in_flight.error is None:
                self._repair.discard(step)
        except BaseException as exc:  # a collective failed: a rank died or timed out
            in_flight.error = _describe(exc)
            shutil.rmtree(staged.dir, ignore_errors=True)

    def _committed_unasked(self, step: int) -> tuple[bool, str | None]:
        """Rank 0: is ``step`` committed and not one to repair (then its files stay as they are)?"""
        if step in self._repair:
            return False, None
        try:
            return self.store.exists(f"{checkpoint_prefix(self.run_id, step)}/COMMITTED"), None
        except Exception as exc:
            return False, _describe(exc)

    def _commit(self, in_flight: _InFlight, step: int, files: list[ManifestEntry], extra: dict[str, Any]) -> bool:
        """Rank 0: publish the manifest and COMMITTED, prune, log. True if newly committed."""
        timings = in_flight.timings
        seconds = time.monotonic() - timings["called"]
        measured = {
            "blocking_s": round(timings["blocking_s"], 4),
            "waited_s": round(timings["waited_s"], 4),
            "seconds": round(seconds, 4),
        }
        manifest = Manifest(
            step=step,
            world_size=self.world_size,
            files=sorted(files, key=lambda e: e.key),
            extra=extra | measured,
        )
        repair = step in self._repair
        committed = commit_checkpoint(self.store, self.run_id, manifest, replace=repair)
        try:
            pruned = prune_checkpoints(self.store, self.run_id, keep=self.keep)
        except Exception as exc:  # the step is committed; the next commit prunes again
            log.warning("checkpoint_prune_failed", step=step, error=_describe(exc))
            pruned = []
        log.info(
            "checkpoint_committed",
            step=step,
            rewritten=not committed,
            files=len(files),
            bytes=sum(e.size for e in files),
            pruned=pruned,
            **measured,
        )
        return committed

    def _clean_and_list(self) -> list[int]:
        """Rank 0, at load: delete every uncommitted step (none is in flight when a job starts)
        and what retention no longer keeps; return the committed steps, newest first."""
        removed = prune_checkpoints(self.store, self.run_id, keep=self.keep, idle=True)
        if removed:
            log.info("checkpoints_cleaned", steps=removed)
        return sorted(committed_steps(self.store, self.run_id), reverse=True)

    # -- hooks ---------------------------------------------------------------------------

    def _staging_dir(self, step: int | None) -> Path:
        """Where ``step``'s files are staged (None: the folder of every step's). The folder itself
        is the node's: the base role makes it and the access role gives it its ACL, so only what is
        in it comes and goes."""
        base = self.workdir / "staging"
        return base if step is None else base / f"step-{step}" / f"rank-{self.rank}"

    def _stage(self, step: int, state: dict[str, Any]) -> _Staged:
        """Training thread: copy ``state`` to host memory and start writing it; return at once."""
        staging = self._staging_dir(step)
        shutil.rmtree(staging, ignore_errors=True)  # leftovers of an interrupted attempt
        staging.mkdir(parents=True)
        # The writer stages (a CPU copy, as BlockingAsyncStager) before the write is queued.
        # Files are read back at once for upload: fsync of scratch files buys nothing.
        written = async_save(
            state,
            storage_writer=FileSystemWriter(staging, sync_files=False),
            process_group=self._group,
        )
        return _Staged(step=step, dir=staging, written=cast("Future[Any]", written))

    def _write(self, staged: _Staged) -> None:
        """Background: wait for DCP's write of this rank's files to finish."""
        staged.written.result()

    def _upload(self, staged: _Staged) -> list[ManifestEntry]:
        """Background: put this rank's files under the step's prefix; return their entries."""
        prefix = checkpoint_prefix(self.run_id, staged.step)
        entries = []
        for path in sorted(p for p in staged.dir.rglob("*") if p.is_file()):
            key = path.relative_to(staged.dir).as_posix()
            entries.append(ManifestEntry(key=key, size=path.stat().st_size, sha256=file_sha256(path)))
            self.store.put_file(f"{prefix}/{key}", path)
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
        try:
            for entry in manifest.files:
                fetch_checkpoint_file(
                    self.store, self.run_id, manifest.step, entry, restore / entry.key, tag=f"rank-{self.rank}"
                )
        except (CheckpointError, StoreError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _load(self, manifest: Manifest, state: dict[str, Any], *, reader: StorageReader | None = None) -> None:
        """Load the step fetched into its restore directory: DCP's files, or a replica's (``reader``)."""
        restore = self._restore_dir(manifest.step)
        load(state, storage_reader=reader or FileSystemReader(restore))
        # Ranks sharing this workdir may still be reading it.
        dist.barrier()
        shutil.rmtree(restore, ignore_errors=True)
        _remove_empty(restore.parent)

    def _on_rank0(self, compute: Callable[[], _T], *, group: dist.ProcessGroup | None = None) -> _T:
        """``compute()`` run on rank 0 only, its result given to every rank: one decision.

        ``group``: the checkpoint group off the training thread; the default group otherwise.
        """
        box: list[Any] = [compute() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        return cast(_T, box[0])


def _remove_contents(folder: Path) -> None:
    """Delete what ``folder`` holds (leftovers of interrupted saves), not the folder."""
    if folder.is_dir():
        for child in folder.iterdir():
            shutil.rmtree(child, ignore_errors=True)


def _remove_empty(*dirs: Path) -> None:
    for path in dirs:
        try:
            path.rmdir()
        except OSError:
            return  # not empty (another rank's files) or already gone


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
