"""Per-step metrics, buffered and written to the store in chunks (object stores cannot append)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NotRequired, TypedDict

from infractl.runstore import write_metrics
from infractl.store import Store

__all__ = ["StepRecord", "MetricsWriter"]


class StepRecord(TypedDict):
    """One line of ``runs/<id>/metrics/*.jsonl``; the CLI's status and progress bar read these."""

    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    world_size: int
    attempt: int
    restart_count: int
    time: float
    val_loss: NotRequired[float]  # on evaluation steps only (run.yaml eval.every)


class MetricsWriter:
    """Buffers records and writes a chunk every ``every_steps`` records or ``every_s`` seconds."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        *,
        every_steps: int = 5,
        every_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.every_steps = every_steps
        self.every_s = every_s
        self._clock = clock
        self._pending: list[StepRecord] = []
        self._last_flush = clock()

    def add(self, record: StepRecord) -> None:
        self._pending.append(record)
        if (
            len(self._pending) >= self.every_steps
            or self._clock() - self._last_flush >= self.every_s
        ):
            self.flush()

    def flush(self) -> None:
        if self._pending:
            write_metrics(self.store, self.run_id, [dict(r) for r in self._pending])
            self._pending = []
        self._last_flush = self._clock()
