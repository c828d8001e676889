"""``hang-node``: SIGSTOP one node's workers (the agent stays up): the node's watchdog
(``watchdog.step_timeout_s``) must turn the hang into a failure the run recovers from."""

from __future__ import annotations

import signal

from infractl.drill import recovery
from infractl.drill.kind import Drill, Kind, register
from infractl.proc import NodeProcess

__all__ = ["HangNode"]


@register
class HangNode(Kind):
    name = "hang-node"
    help = "SIGSTOP one node's workers: the watchdog (watchdog.step_timeout_s) must turn the hang into a failure."

    def inject(self, drill: Drill) -> list[NodeProcess]:
        stopped = recovery.workers(drill.victims)
        drill.nodes.signal(stopped, signal.SIGSTOP)
        drill.fault |= {"signal": "SIGSTOP", "processes": len(stopped)}
        return drill.workers

    def undo(self, drill: Drill) -> None:
        # Whatever the watchdog did not kill must not stay stopped forever.
        drill.nodes.signal(drill.victims, signal.SIGCONT)
