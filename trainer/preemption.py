"""Preemption: a SIGTERM (spot reclaim, maintenance notice, the node being stopped) asks this
rank to save an emergency checkpoint and exit.

torchrun's agent, on SIGTERM, forwards it to its workers and SIGKILLs them after its
``--shutdown-timeout`` (the launcher passes ``preemption.grace_s``). An agent restarting its
workers (a peer failed, a node joined) SIGTERMs them too, with 30 s before SIGKILL (a stopped
worker is SIGKILLed at once, see ``trainer.agent``): they then save the step they reached as well,
which costs little and loses nothing. The handler only records
the notice: the training loop tells every rank about it in the next log step's all-reduce (see
``Trainer.train``; at most ``log_every`` steps later), so all ranks save the same step together,
without a collective of their own.
"""

from __future__ import annotations

import signal
from types import FrameType

__all__ = ["PEER_PREEMPTED_EXIT", "SPOT_NOTICE_ENV", "PreemptionNotice"]

#: Exit code of a rank that was not signalled but whose peer was: "a peer was preempted;
#: restart me". Non-zero, so its agent restarts it; it then re-rendezvouses without the
#: preempted node and resumes from the emergency checkpoint. (75 is EX_TEMPFAIL.)
PEER_PREEMPTED_EXIT = 75
#: The instance metadata service (its ``/latest`` URL) whose spot interruption notice a node's agent
#: polls, on a node that may be reclaimed (``trainer.agent``); a provider whose nodes get such
#: notices sets it in their agents' environment, unset elsewhere.
SPOT_NOTICE_ENV = "INFRACTL_SPOT_NOTICE_URL"


class PreemptionNotice:
    """Whether this process got SIGTERM since ``install``. Install from the main thread (Python
    runs signal handlers only there)."""

    def __init__(self) -> None:
        self.signalled = False
        #: The step the training loop is on (it sets this); the notice records it.
        self.step = 0
        self.noticed_at_step: int | None = None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.signalled:
            self.noticed_at_step = self.step
        self.signalled = True
