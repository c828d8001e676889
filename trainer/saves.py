"""When and why the trainer saves: scheduled saves (skipped while a rank's previous save still
runs), the final save (retried until it commits), the emergency save on a preemption notice, and
the in-memory replicas between them (trainer/replicas.py; skipped while a rank's previous one is
still being copied).

Each save writes the step's metrics record first: once the step is committed a crash resumes
after it, and records still buffered would never be written. The record's
``checkpoint_blocking_s`` is known only after the save, so it is written without it and again
after the save with it (``read_metrics`` keeps a step's newest record).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from infractl.log import get_logger
from infractl.runstore import SaveReason, StepRecord
from trainer.backoff import retry_delays
from trainer.checkpoint import Checkpointer, SaveFailed
from trainer.metrics import MetricsWriter
from trainer.replicas import Replicas

__all__ = ["SAVE_WAIT_S", "Saves"]

log = get_logger(__name__)

#: How long a scheduled save waits for the previous one before it is skipped (at most a
#: quarter of the step timeout): enough for a healthy store, short next to the watchdog.
SAVE_WAIT_S = 5.0


class Saves:
    """The saves of one rank. ``state()`` is the state to save; ``extra(reason)`` what the
    manifest records besides the files."""

    def __init__(
        self,
        checkpointer: Checkpointer,
        metrics: MetricsWriter | None,
        *,
        every: int,
        step_timeout_s: float,
        rank: int,
        state: Callable[[], dict[str, Any]],
        extra: Callable[[SaveReason], dict[str, Any]],
        replicas: Replicas | None = None,
        replicate_every: int = 0,
    ) -> None:
        self.checkpointer = checkpointer
        self.metrics = metrics
        self.every = every
        self.replicas = replicas
        self.replicate_every = replicate_every if replicas is not None else 0
        self._skipping = False  # the replicas due since the last one taken were all skipped
        self.wait_s = min(SAVE_WAIT_S, step_timeout_s / 4)
        self.rank = rank
        self._state = state
        self._extra = extra

    def busy(self, step: int) -> bool:
        """On a step due for a save: wait a little for this rank's previous save; True if it is
        still running (the ranks agree on it in the step's log collective, see after_step)."""
        return step % self.every == 0 and self.checkpointer.settle(self.wait_s)

    def replica_due(self, step: int) -> bool:
        return bool(self.replicate_every) and step % self.replicate_every == 0

    def replicating(self, step: int) -> bool:
        """On a step due for a replica: True if this rank's previous one is still being copied
        (the ranks agree on it in the step's log collective, see after_step)."""
        return self.replicas is not None and self.replica_due(step) and self.replicas.busy()

    def record(self, record: StepRecord) -> None:
        """A step's record with no save of its own."""
        if self.metrics is not None:
            self.metrics.add(record)

    def after_step(
        self, step: int, record: StepRecord, *, preempted: bool, ranks_saving: int, ranks_replicating: int = 0
    ) -> None:
        """A log step but the last: save it if it is due and no rank's previous save is still
        running (``ranks_saving``, summed over the ranks from ``busy``), else record it, unless
        a preemption save of it follows (``preempted``) and records it. Then replicate it if it
        is due, no preemption save follows and no rank's previous replica is still being copied
        (``ranks_replicating``, from ``replicating``)."""
        self._scheduled(step, record, preempted=preempted, ranks_saving=ranks_saving)
        if self.replicas is None or preempted or not self.replica_due(step):
            return
        if ranks_replicating:
            if self.rank == 0 and not self._skipping:  # once per streak: it may come every other step
                log.info("replica_skipped", step=step, reason="the previous replica is still being copied")
            self._skipping = True
            return
        self._skipping = False
        self.replicas.save(step, self._state(), extra=self._extra(SaveReason.REPLICA))

    def _scheduled(self, step: int, record: StepRecord, *, preempted: bool, ranks_saving: int) -> None:
        due = step % self.every == 0
        if due and not ranks_saving:
            self._save(step, record, SaveReason.SCHEDULED)
            return
        if due and self.rank == 0:
            log.warning(
                "checkpoint_skipped",
                step=step,
                reason="the previous save is still running",
                ranks_saving=ranks_saving,
                waited_s=self.wait_s,
            )
        if not preempted:
            self.record(record)

    def final(self, step: int, record: StepRecord) -> None:
        """Save the last step and wait until it is committed: the state is still in memory,
        so a failed save (the store is down) is retried with backoff, for up to 10 minutes,
        before the last failure is raised."""
        self._save(step, record, SaveReason.FINAL)
        for delay in [*retry_delays(), None]:
            try:
                self.checkpointer.wait()
                return
            except SaveFailed as exc:
                if delay is None:
                    raise
                if self.rank == 0:
                    log.warning("checkpoint_failed", step=exc.step, error=exc.error, retry_in_s=delay)
                time.sleep(delay)
                self.checkpointer.save(step, self._state(), extra=self._extra(SaveReason.FINAL))

    def preempted(self, step: int, record: StepRecord) -> None:
        """A rank got a preemption notice: commit ``step`` (unless its save is already in
        flight) and wait for it. The agent kills this process if the grace ends first; the
        previous committed step then stays the one to resume from."""
        if self.checkpointer.in_flight_step != step:
            self._save(step, record, SaveReason.PREEMPTION)
        self.close()

    def close(self) -> None:
        """Saves are async: the last one must commit before the process exits 0."""
        if self.replicas is not None:
            self.replicas.close()
        self.checkpointer.close()
        if self.metrics is not None:
            self.metrics.close()

    def _save(self, step: int, record: StepRecord, reason: SaveReason) -> None:
        """Start saving ``step`` and record it (see the module doc)."""
        if self.metrics is not None:
            self.metrics.add(record | {"checkpoint_blocking_s": None})
            self.metrics.flush()
        started = time.perf_counter()
        self.checkpointer.save(step, self._state(), extra=self._extra(reason))
        blocking = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.add(record | {"checkpoint_blocking_s": round(blocking, 6)})
