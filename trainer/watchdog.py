"""Hang detection: a deadline around every training step, kept by this node's torchrun agent.

When the agent runs with ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` it serves a ``FileTimerServer``
on the named pipe ``$TORCHELASTIC_TIMER_FILE`` and passes that path to its workers. Each step
this rank arms a timer there and releases it when the step is done; a rank that misses its
deadline (hung in a collective, stopped, stuck in I/O) is SIGKILLed by the agent's server.

How a hang ends, on torch 2.13 (checked with gloo):

- The ranks waiting for the hung one fail their collective first: after the first step the
  default group's timeout is half the step timeout (``Trainer._warmed_up``), so they raise
  before their own deadline, exit non-zero, and their agent restarts its workers. An agent
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
import os
import time
from collections.abc import Callable, Iterator

from torch.distributed.elastic.timer.file_based_local_timer import FileTimerClient

from infractl.log import get_logger

__all__ = ["StepWatchdog", "TIMER_FILE_ENV"]

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
