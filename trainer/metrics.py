"""Per-step metrics: how a step's time splits and what it cost, measured cheaply; records
buffered and written to the store in chunks (object stores cannot append), mirrored into
TensorBoard event files that are uploaded whole."""

from __future__ import annotations

import contextlib
import contextvars
import resource
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from infractl.log import get_logger
from infractl.runstore import StepRecord, run_prefix, write_metrics
from infractl.store import Store
from trainer.backoff import retry_delays

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = [
    "MetricsWriter",
    "StepClock",
    "CommTimer",
    "peak_memory_bytes",
    "tensorboard_prefix",
]

log = get_logger(__name__)


#: TensorBoard tags of the numeric record fields (the rest are not worth a chart).
_SCALARS = {
    "loss": "loss",
    "val_loss": "val_loss",
    "grad_norm": "grad_norm",
    "tokens_per_s": "tokens_per_s",
    "step_time_s": "time/step_s",
    "data_s": "time/data_s",
    "forward_backward_s": "time/forward_backward_s",
    "optimizer_s": "time/optimizer_s",
    "comm_s": "time/comm_s",
    "checkpoint_blocking_s": "time/checkpoint_blocking_s",
    "peak_memory_bytes": "memory/peak_bytes",
}


def tensorboard_prefix(run_id: str) -> str:
    """Where a run's TensorBoard event files are uploaded (one object per file)."""
    return f"{run_prefix(run_id)}/tensorboard"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank so far: torch's allocations on CUDA, the max RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux, in bytes on macOS.
    return int(peak if sys.platform == "darwin" else peak * 1024)


# A mark on the step's timeline: host seconds on CPU; on CUDA an event recorded on the current
# stream, so that durations are the device's and need no synchronization to take.
Mark = float | torch.cuda.Event


class StepClock:
    """Takes marks during a step and turns pairs of them into seconds.

    On CPU every op has finished when the host moves on, so the host clock is the truth and a
    mark costs one ``perf_counter``. On CUDA the host only queues work: marks are CUDA events,
    read with ``seconds`` once the device got past them (the log step's read back, see
    trainer/steplog.py); reading them earlier would block.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Mark:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # not annotated in torch
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Mark, end: Mark) -> float:
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            return float(start.elapsed_time(end)) / 1000.0
        assert isinstance(start, float) and isinstance(end, float)
        return end - start


class CommTimer:
    """Times DDP's gradient all-reduce through a communication hook.

    The hook is DDP's default all-reduce, with a mark when a bucket's all-reduce is launched
    and one when it completes. ``comm_s`` is the window from the first launch to the last
    completion in a step. DDP launches a bucket as soon as its gradients are ready, so this
    window overlaps the backward pass: it is *not* a part to add to forward_backward_s; it
    tells how long gradient communication was in flight. Where it is much shorter than the
    backward, communication is hidden; where the backward ends with a long tail of it (the
    last bucket), communication is what the step waits for.

    FSDP2 has no such hook (its all-gathers and reduce-scatters are issued from its own
    autograd hooks, on their own streams): measuring them would take the profiler, so its
    ``comm_s`` is None.
    """

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self._lock = threading.Lock()  # completions arrive on the backend's threads
        self._first: Mark | None = None
        self._last: Mark | None = None

    def attach(self, model: DistributedDataParallel) -> None:
        model.register_comm_hook(self, _timed_allreduce)

    def reset(self) -> None:
        with self._lock:
            self._first = self._last = None

    def window(self) -> tuple[Mark, Mark] | None:
        """The step's first launch and last completion, to read once the step is synchronized."""
        with self._lock:
            return None if self._first is None or self._last is None else (self._first, self._last)

    def launched(self) -> None:
        mark = self.clock.mark()
        with self._lock:
            if self._first is None:
                self._first = mark

    def completed(self) -> None:
        mark = self.clock.mark()
        with self._lock:
            self._last = mark


# No annotations: DDP checks a hook's annotations against the real types, and with postponed
# annotations (this module's __future__ import) they are strings. (CommTimer, GradBucket) ->
# Future[Tensor].
def _timed_allreduce(timer, bucket):  # type: ignore[no-untyped-def]
    timer.launched()

    def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        # On CUDA the callback runs with its stream made to wait for the all-reduce, so an
        # event recorded here marks its completion on the device.
        timer.completed()
        return fut.value()

    # None: the default process group, as DDP's own default hook passes it (the stub says a group).
    return default_hooks.allreduce_hook(None, bucket).then(done)  # type: ignore[arg-type]


class MetricsWriter:
    """Buffers records and writes a chunk every ``every_steps`` records or ``every_s`` seconds.

    Chunks are written by a background thread, so a store that is down or slow never stops
    training: the training thread hands a chunk over and waits for it (at most
    ``handoff_wait_s``) only while the writer is idle and the store healthy, which keeps writes
    effectively synchronous in normal runs. A chunk the store refuses stays queued and goes
    out with the next one (``read_metrics`` keeps a step's newest record, so nothing is lost
    and rewriting is harmless); a failure streak is logged once when it starts and once when
    it ends. ``close`` writes what is left, retrying while the store is down.

    With ``tensorboard_dir``, every record's numbers also go to a TensorBoard event file there;
    ``flush`` uploads the event files whole to ``runs/<id>/tensorboard/`` (object stores
    cannot append), and ``close`` uploads them a last time and deletes the local copies.
    """

    def __init__(
        self,
        store: Store,
        run_id: str,
        *,
        tensorboard_dir: Path | None = None,
        every_steps: int = 5,
        every_s: float = 2.0,
        handoff_wait_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        close_retry_delays: Sequence[float] | None = None,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.tensorboard_dir = tensorboard_dir
        self.every_steps = every_steps
        self.every_s = every_s
        self.handoff_wait_s = handoff_wait_s
        self._clock = clock
        self._close_retry_delays = retry_delays() if close_retry_delays is None else list(close_retry_delays)
        self._pending: list[StepRecord] = []  # the training thread's, not yet handed over
        self._last_flush = clock()
        self._tensorboard: SummaryWriter | None = None
        self._charted: dict[int, set[str]] = {}  # step -> fields already in TensorBoard
        # Shared with the writer thread, under _cond.
        self._cond = threading.Condition()
        self._queue: list[StepRecord] = []  # handed over, not yet in the store
        self._upload_due = False
        self._requested = False  # handed over, not yet taken by the writer
        self._busy = False  # the writer is writing
        self._failing = False  # the last write failed
        self._stopping = False
        self._closed = False
        # The thread carries the caller's log context (the rank) into its log lines.
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run,), name="metrics-writer", daemon=True)
        self._thread.start()

    def add(self, record: StepRecord) -> None:
        """Buffer ``record``. Adding a step again supersedes it (``read_metrics`` keeps the
        newest); TensorBoard then gets only the fields it did not have."""
        self._pending.append(record)
        self._chart(record)
        if len(self._pending) >= self.every_steps or self._clock() - self._last_flush >= self.every_s:
            self._hand_over(upload=False)

    def flush(self) -> None:
        """Hand the buffered records and the TensorBoard event files to the writer."""
        if self._tensorboard is not None:
            self._tensorboard.flush()
        self._hand_over(upload=self._tensorboard is not None)

    def unwritten(self) -> list[StepRecord]:
        """The records added and not yet known to be in the store (a replica carries them: a
        run resumed from it writes them again)."""
        with self._cond:
            return [*self._queue, *self._pending]

    def close(self) -> None:
        """Write everything (retrying while the store is down), then close TensorBoard's
        writer; once the event files are in the store the local copies go (the workdir is
        scratch). Raises the store's error if records are still unwritten after the retries.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()  # then everything below is this thread's alone
        self._queue.extend(self._pending)
        self._pending = []
        for delay in [*self._close_retry_delays, None]:
            try:
                self._write(self._queue)
            except Exception as exc:
                self._report(exc, unwritten=len(self._queue))
                if delay is None:
                    raise
                time.sleep(delay)
            else:
                self._report(None, unwritten=0)
                self._queue.clear()
                break
        if self.tensorboard_dir is not None and self._upload():
            shutil.rmtree(self.tensorboard_dir, ignore_errors=True)
            with contextlib.suppress(OSError):  # the runs' shared parent, once it is empty
                self.tensorboard_dir.parent.rmdir()

    def _hand_over(self, *, upload: bool) -> None:
        """Training thread: queue the pending records for the writer. Wait (bounded) for
        them to be written only if the writer was idle and the store healthy."""
        with self._cond:
            self._queue.extend(self._pending)
            self._pending = []
            self._upload_due = self._upload_due or upload
            wait = not self._busy and not self._failing
            self._requested = True
            self._cond.notify_all()
            if wait:
                self._cond.wait_for(lambda: not self._requested and not self._busy, timeout=self.handoff_wait_s)
        self._last_flush = self._clock()

    def _run(self) -> None:
        """The writer thread: write what is queued whenever something was handed over."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._requested or self._stopping)
                if self._stopping:
                    return
                self._requested = False
                self._busy = True
                records = list(self._queue)
                upload, self._upload_due = self._upload_due, False
            error: Exception | None = None
            try:
                self._write(records)
            except Exception as exc:
                error = exc
            uploaded = not upload or (error is None and self._upload())
            with self._cond:
                if error is None:
                    del self._queue[: len(records)]
                self._upload_due = self._upload_due or not uploaded  # the next hand-over retries
                self._report(error, unwritten=len(self._queue))
                self._busy = False
                self._cond.notify_all()

    def _report(self, error: Exception | None, *, unwritten: int) -> None:
        """Log a failure streak once at its start and once at its end (under _cond)."""
        if error is not None and not self._failing:
            log.warning("metrics_write_failed", error=_describe(error), unwritten=unwritten)
        elif error is None and self._failing:
            log.info("metrics_write_recovered")
        self._failing = error is not None

    def _write(self, records: list[StepRecord]) -> None:
        if records:
            write_metrics(self.store, self.run_id, records)

    def _chart(self, record: StepRecord) -> None:
        if self.tensorboard_dir is None:
            return
        step = record["step"]
        if self._tensorboard is None:
            # Imported here: it takes a second or two and only rank 0 needs it. purge_step
            # makes TensorBoard drop what an earlier attempt wrote from this step on, so a
            # resumed run's replayed steps are not drawn twice.
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.tensorboard_dir), purge_step=step, flush_secs=3600)
        charted = self._charted.setdefault(step, set())
        raw: dict[str, Any] = dict(record)
        for field, tag in _SCALARS.items():
            value = raw.get(field)
            if value is not None and field not in charted:
                self._tensorboard.add_scalar(tag, value, step, walltime=record["time"])
                charted.add(field)
        # Only the newest steps can be added again.
        for old in [s for s in self._charted if s < step - 1]:
            del self._charted[old]

    def _upload(self) -> bool:
        """Put every event file in the store, whole; False (logged) if the store failed:
        training goes on and the next flush tries again."""
        assert self.tensorboard_dir is not None
        prefix = tensorboard_prefix(self.run_id)
        try:
            for path in sorted(self.tensorboard_dir.glob("events.out.tfevents.*")):
                self.store.put_file(f"{prefix}/{path.name}", path)
        except Exception as exc:
            log.warning("tensorboard_upload_failed", error=_describe(exc))
            return False
        return True


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
