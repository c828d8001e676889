"""Hang detection: a deadline around every training step, kept by this node's torchrun agent.

When the agent runs with ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` it serves a ``FileTimerServer``
on the named pipe ``$TORCHELASTIC_TIMER_FILE`` and passes that path to its workers. Each step
this rank arms a timer there and releases it when the step is done; a rank that misses its
deadline (hung in a collective, stopped, stuck in I/O) is SIGKILLed by the agent's server.

How a hang ends, on torch 2.13 (checked with gloo):

- The ranks waiting for the hung one fail their collective first: after the first step the
  default group's timeout is at most half the step timeout (``CollectiveTimeout``), so they
  raise before their own deadline, exit non-zero, and their agent restarts its workers. An agent
  that restarts stops its timer server and SIGTERMs its workers, then SIGKILLs them after 30 s
  (hard-coded in LocalElasticAgent._stop_workers); ours (``trainer.agent``) SIGKILLs a stopped
  worker at once, and a worker stuck in a collective exits when the collective times out.
  Agents on other nodes see the new rendezvous round and do the same. Every node comes back
  and the run resumes from the last committed step.
- If the hung rank's deadline expires first (no peer noticed: a job of one rank, or every
  rank stuck), the timer server SIGKILLs it (nothing else ends a stopped process) and then,
  after reaping, kills its own process, the agent, with the same signal. That node is lost
  as a whole, the failure model's "a node hangs: it turns into a node failure"; the other
  nodes go on without it if ``nodes.min`` allows, and its workers that were not hung fail
  their next collective and exit.

Without the environment variable (plain torchrun, tests) there is no watchdog.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator

import torch.distributed as dist
from torch.distributed.elastic.timer.file_based_local_timer import FileTimerClient

from infractl.config import WatchdogSpec
from infractl.log import get_logger

__all__ = ["CollectiveTimeout", "StepWatchdog", "TIMER_FILE_ENV"]

#: Set by torchrun's agent for its workers when it serves a file timer.
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"

_SCOPE = "training-step"

log = get_logger(__name__)


class StepWatchdog:
    """Arms ``timeout_s`` around each training step once ``start`` was called.

    Before ``start`` (loading a checkpoint, the first step: both may be slow) and without a
    timer file, ``step()`` arms nothing.
    """

    def __init__(self, timeout_s: float, *, timer_file: str | None) -> None:
        self.timeout_s = timeout_s
        self._timer_file = timer_file or ""
        self._client = FileTimerClient(timer_file) if timer_file else None
        self._started = False

    @classmethod
    def from_environ(cls, timeout_s: float) -> StepWatchdog:
        return cls(timeout_s, timer_file=os.environ.get(TIMER_FILE_ENV) or None)

    @property
    def enabled(self) -> bool:
        return self._client is not None

    def start(self) -> None:
        """From now on every ``step()`` is under a deadline."""
        self._started = True

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The block must finish within ``timeout_s`` or the agent kills this process."""
        if self._client is None or not self._started:
            yield
            return
        armed = self._send(lambda client: client.acquire(_SCOPE, time.time() + self.timeout_s))
        try:
            yield
        finally:
            if armed:
                self._send(lambda client: client.release(_SCOPE))

    def _send(self, request: Callable[[FileTimerClient], None]) -> bool:
        """Send a timer request; False, and no watchdog from now on, once the agent's timer
        server is gone. An agent stops its server first when it shuts its workers down (on
        SIGTERM: a preemption; or to restart them), and the workers must still be able to
        finish their emergency checkpoint then, not crash on the missing pipe."""
        assert self._client is not None
        try:
            if not os.path.exists(self._timer_file):
                raise BrokenPipeError(f"{self._timer_file} is gone")
            request(self._client)
            return True
        except BrokenPipeError as exc:
            log.warning("watchdog_stopped", reason=f"the agent's timer server is gone ({exc})")
            self._client = None
            return False


class CollectiveTimeout:
    """How long a collective of the training step waits for the slowest rank, once training started.

    A rank waiting for a hung peer learns of the hang only when its collective times out, so that
    timeout is most of a hang's recovery time. It must outlast what healthy ranks do apart:
    ``FACTOR`` times the slowest step this rank has seen since it started (``observe``: the
    steps' records, the device's time on CUDA, plus what the rank staged of a save or a replica
    after it), at least ``min_s``, at most ``max_s`` (half the step timeout, where it starts:
    before ``MIN_SAMPLES`` steps there is nothing to judge from). The slowest step only grows, so
    the timeout only grows once it has been lowered.

    Where ranks may lag each other by more than that, collectives wait ``max_s`` (``relaxed``):
    the log step's collective (a rank may first wait up to ``trainer.saves.SAVE_WAIT_S`` for its
    previous save) and the step after the first save or replica of a start (its staging, which
    the next step's collectives wait for, has not been timed yet).
    """

    FACTOR = 10
    MIN_SAMPLES = 5

    def __init__(
        self, *, min_s: float, max_s: float, apply: Callable[[float], None], report: Callable[[float, float], None]
    ) -> None:
        self.max_s = max_s
        self.min_s = min(min_s, max_s)
        self._apply = apply
        self._report = report
        self._slowest = 0.0
        self._samples = 0
        self._relaxed = 0  # nested relaxed() blocks open
        self.current: float | None = None

    @classmethod
    def for_default_group(cls, spec: WatchdogSpec, *, report: Callable[[float, float], None]) -> CollectiveTimeout:
        """The default group's, as run.yaml's ``watchdog`` section sets it."""

        def apply(seconds: float) -> None:
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))

        return cls(min_s=spec.collective_timeout_min_s, max_s=spec.step_timeout_s / 2, apply=apply, report=report)

    def start(self) -> None:
        """From now on collectives time out: at ``max_s`` until enough steps were seen."""
        self._set(self.max_s)

    def observe(self, step_times_s: Iterable[float]) -> None:
        """Steps this rank trained: lower or raise the timeout to ``FACTOR`` x the slowest."""
        if self.current is None:
            return
        for seconds in step_times_s:
            self._slowest = max(self._slowest, seconds)
            self._samples += 1
        if self._samples < self.MIN_SAMPLES:
            return
        # Whole half seconds: the timeout changes a few times per start, not at every step.
        target = min(self.max_s, max(self.min_s, math.ceil(self.FACTOR * self._slowest * 2) / 2))
        if target != self.current:
            self._report(target, self._slowest)
            self._set(target)

    @contextlib.contextmanager
    def relaxed(self, when: bool = True) -> Iterator[None]:
        """Collectives in the block wait up to ``max_s`` (if ``when``; see the class doc)."""
        if not when or self.current is None:
            yield
            return
        if not self._relaxed and self.current != self.max_s:
            self._apply(self.max_s)
        self._relaxed += 1
        try:
            yield
        finally:
            self._relaxed -= 1
            if not self._relaxed and self.current != self.max_s:
                self._apply(self.current)

    def _set(self, seconds: float) -> None:
        if not self._relaxed:
            self._apply(seconds)
        self.current = seconds
