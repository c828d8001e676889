"""torch.profiler traces of chosen steps on every rank, uploaded to the store.

Which steps: run.yaml's ``profile.steps`` (FIRST:LAST, both included), and the windows that
``infractl profile`` asks for while the run runs, through ``runs/<run>/profiles/request.json``: a
daemon thread per rank reads it every ``POLL_S`` seconds (a store error: it asks again at the next
poll). Step numbers are the run's (those of the metrics), so every rank decides on its own when a
window starts and ends: no collective.

The training loop pays one integer compare per step, ``step >= profiler.due`` (``NEVER`` while no
window is armed), and calls ``at`` for the rest. Inside a window each step is a range named
``ProfilerStep#<step>`` (what torch's own ``profiler.step()`` names it, and what TensorBoard's
profiler plugin reads as a step) from the top of the step to the top of the next one, so the log
step's read back and checkpoint staging are in it; at the run's last step the trace stops before
the final checkpoint's wait for its commit. The trace holds the CPU ops with their input shapes,
and the CUDA kernels on a CUDA device.

The profiler starts and stops on the training thread, outside the step watchdog (the first start
takes about a second; every rank starts at the same step, so none waits long for another). After
the window's last step a background thread exports the gzipped Chrome trace into the workdir and uploads it
to ``profiles/<first>-<last>/rank-<r>.pt.trace.json.gz``, retrying for a minute. A store that
stays down is a warning line (naming the local file, which is kept), never a failure of training.

Restarts: a window that ended before this process's first step is skipped. A process that exits
inside a window (preempted, say) drops its trace (``profile_abandoned``). A process that starts
inside a window (a restart resumed from a checkpoint in it) traces the steps that are left and logs
``profile_partial``, and so does a rank that gets a request after its first step: the trace's
``ProfilerStep#`` ranges say which steps it holds. A rank whose trace of a window is in the store
already does not trace it again, so a restart that resumes before a traced window does not replace
a whole trace with a partial one.
"""

from __future__ import annotations

import atexit
import contextvars
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, record_function

from infractl import runstore
from infractl.errors import StoreError
from infractl.log import get_logger
from infractl.runstore import ProfileRequest
from infractl.store import Store
from trainer.backoff import retry_delays

__all__ = ["NEVER", "POLL_S", "StepProfiler", "Window"]

log = get_logger(__name__)

#: Seconds between two reads of the request object (``infractl profile`` allows for it).
POLL_S = 2.0
#: ``StepProfiler.due`` while no window is armed: no step reaches it.
NEVER = sys.maxsize
#: How long the end of training waits for traces still being exported or uploaded.
_UPLOAD_WAIT_S = 120.0


@dataclass(frozen=True)
class Window:
    """Steps ``first`` to ``last``, both included, and who asked for them."""

    first: int
    last: int
    source: str  # "profile.steps" (run.yaml) or "request" (infractl profile)

    @property
    def steps(self) -> str:
        return f"{self.first}:{self.last}"


@dataclass
class _Recording:
    """A window being traced: the profiler, and the step range open now."""

    window: Window
    profile: torch.profiler.profile
    first_step: int  # the first step traced: after window.first when the trace is partial
    last_step: int = 0
    marker: record_function | None = None

    def mark(self, step: int) -> None:
        """Close the previous step's range and open ``step``'s."""
        self.close_mark()
        self.marker = record_function(f"ProfilerStep#{step}")
        self.marker.__enter__()  # type: ignore[no-untyped-call]  # not annotated in torch
        self.last_step = step

    def close_mark(self) -> None:
        if self.marker is not None:
            self.marker.__exit__(None, None, None)
            self.marker = None


class StepProfiler:
    """One rank's profiling. The training loop calls ``start`` once before its first step,
    ``at(step)`` at the top of every step with ``step >= due``, ``finish`` before the final
    checkpoint, and ``close`` when it is done."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        *,
        rank: int,
        device: torch.device,
        workdir: Path,
        window: tuple[int, int] | None,
        poll_s: float = POLL_S,
        upload_delays: Sequence[float] | None = None,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.rank = rank
        self.device = device
        self.workdir = workdir
        self.poll_s = poll_s
        # Seconds between the attempts to upload a trace: a store that is back within a minute gets it.
        self.upload_delays = (
            retry_delays(first_s=1.0, cap_s=8.0, total_s=60.0) if upload_delays is None else upload_delays
        )
        #: The loop calls ``at`` from this step on; the poller lowers it when a request comes in.
        self.due = NEVER
        self._configured = window
        self._lock = threading.Lock()  # guards _armed and due between the poller and the loop
        self._armed: list[Window] = []  # windows to trace, by first step
        self._first_step = 1  # this process's first step (set by start)
        self._recording: _Recording | None = None  # the training thread's alone
        self._seen: ProfileRequest | None = None  # the poller's alone
        self._stopping = threading.Event()
        self._uploads: list[threading.Thread] = []

    def start(self, first_step: int) -> None:
        """Arm run.yaml's window and start polling for requests; ``first_step`` is the first step
        this process trains (after a resume: the step after the checkpoint's)."""
        self._first_step = first_step
        if self._configured is not None:
            # Here, not in the poller: the window may begin at this process's first step.
            self._arm(Window(*self._configured, source="profile.steps"))
        self._thread(self._poll, "profile-requests")

    def at(self, step: int) -> None:
        """The top of ``step`` (``step >= due``): open its range, or stop a trace whose window
        ended, or start the next armed window."""
        recording = self._recording
        if recording is not None:
            if step <= recording.window.last:
                recording.mark(step)
                return
            self._stop()
        window = self._take(step)
        if window is not None:
            self._begin(window, step)

    def finish(self) -> None:
        """Stop and hand over the trace in progress, if any (the run's last step)."""
        if self._recording is not None:
            self._stop()

    def close(self) -> None:
        """Stop polling, stop any trace, and wait (bounded) for the traces' uploads."""
        self._stopping.set()
        self.finish()
        deadline = time.monotonic() + _UPLOAD_WAIT_S
        for upload in self._uploads:
            upload.join(max(0.0, deadline - time.monotonic()))
        if any(upload.is_alive() for upload in self._uploads):
            log.warning("profile_upload_unfinished", waited_s=_UPLOAD_WAIT_S)

    def _arm(self, window: Window) -> None:
        """Queue ``window`` unless it ended before this process started or this rank's trace of
        it is in the store already (any thread)."""
        if window.last < self._first_step:
            return  # an earlier process traced it, or it was asked too late: nothing to do now
        if self._traced(window):
            log.info("profile_skipped", steps=window.steps, reason="this rank's trace of these steps is in the store")
            return
        with self._lock:
            self._armed = sorted([*self._armed, window], key=lambda w: w.first)
            self.due = min(self.due, window.first)

    def _traced(self, window: Window) -> bool:
        key = runstore.profile_trace_key(self.run_id, window.first, window.last, self.rank)
        try:
            return self.store.exists(key)
        except StoreError:
            return False  # trace it again rather than not at all

    def _take(self, step: int) -> Window | None:
        """The armed window ``step`` is in, if any; windows already past are dropped (logged)."""
        with self._lock:
            while self._armed and self._armed[0].last < step:
                missed = self._armed.pop(0)
                log.warning("profile_missed", steps=missed.steps, source=missed.source, step=step)
            window = self._armed.pop(0) if self._armed and self._armed[0].first <= step else None
            # While a window is traced the loop calls ``at`` at every step.
            self.due = 0 if window is not None else (self._armed[0].first if self._armed else NEVER)
        return window

    def _begin(self, window: Window, step: int) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=True)
        profile.start()
        self._recording = _Recording(window, profile, first_step=step)
        # The interpreter crashes at exit (SIGSEGV) with a profiler still on: a rank that leaves
        # inside the window (preempted, interrupted) must stop it first.
        atexit.register(self._abandon)
        if step > window.first:
            # A restart inside the window, or a request that came late: trace what is left.
            log.warning("profile_partial", steps=window.steps, tracing=f"{step}:{window.last}", source=window.source)
        else:
            log.info("profile_started", steps=window.steps, source=window.source)
        self._recording.mark(step)

    def _stop(self) -> None:
        """Stop the profiler (training thread); export and upload on a thread of their own."""
        recording, self._recording = self._recording, None
        assert recording is not None
        atexit.unregister(self._abandon)
        recording.close_mark()
        recording.profile.stop()
        self._uploads.append(self._thread(lambda: self._export(recording), "profile-upload"))

    def _abandon(self) -> None:
        """At exit inside a window: stop the profiler and drop the trace (a restart traces the
        steps it has left)."""
        recording, self._recording = self._recording, None
        if recording is not None:
            recording.close_mark()
            recording.profile.stop()
            log.info(
                "profile_abandoned",
                steps=recording.window.steps,
                traced=f"{recording.first_step}:{recording.last_step}",
            )

    def _export(self, recording: _Recording) -> None:
        """Write the gzipped trace into the workdir and upload it; failures are warnings."""
        window = recording.window
        key = runstore.profile_trace_key(self.run_id, window.first, window.last, self.rank)
        folder = self.workdir / "profiles" / self.run_id / f"{window.first}-{window.last}"
        path = folder / f"rank-{self.rank}.pt.trace.json.gz"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            recording.profile.export_chrome_trace(str(path))  # gzipped: the name ends in .gz
        except Exception as exc:  # a full disk, or torch failing to write: the trace is lost, training is not
            log.warning("profile_export_failed", steps=window.steps, error=f"{type(exc).__name__}: {exc}")
            return
        size = path.stat().st_size
        for delay in [*self.upload_delays, None]:
            try:
                self.store.put_file(key, path)
                break
            except StoreError as exc:
                if delay is None:
                    log.warning("profile_upload_failed", key=key, kept=str(path), error=str(exc))
                    return
                time.sleep(delay)
        # The folders stay: the node's other ranks may be about to write theirs into them.
        path.unlink()
        log.info("profile_uploaded", key=key, traced=f"{recording.first_step}:{recording.last_step}", bytes=size)

    def _poll(self) -> None:
        """The poller: arm each new request's window until ``close``."""
        while True:
            try:
                request = runstore.read_profile_request(self.store, self.run_id)
            except StoreError:
                request = None  # the store is down or the object half-written: ask again next time
            if request is not None and request != self._seen:
                self._seen = request
                self._arm(Window(request.first, request.last, source="request"))
            if self._stopping.wait(self.poll_s):
                return

    def _thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        """A daemon thread that logs with this rank's context (a process that exits does not
        wait for it; ``close`` does, bounded)."""
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, args=(target,), name=name, daemon=True)
        thread.start()
        return thread
