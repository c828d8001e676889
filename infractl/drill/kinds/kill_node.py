"""``kill-node``: SIGKILL every process of one node (its torchrun agent and workers)."""

from __future__ import annotations

import psutil

from infractl import proc
from infractl.drill import measure
from infractl.drill.kind import Drill, Kind, register
from infractl.errors import StateError

__all__ = ["KillNode"]


@register
class KillNode(Kind):
    name = "kill-node"
    help = "SIGKILL every process of one node (agent and workers)."
    node_leaves = True

    def inject(self, drill: Drill) -> list[psutil.Process]:
        proc.kill(drill.victims)
        drill.fault["signal"] = "SIGKILL"
        killed = {p.pid for p in drill.victims}
        return [p for p in drill.workers if p.pid not in killed]

    def settle(self, drill: Drill) -> None:
        if proc.wait_gone(drill.state.dir, node=drill.target.node, run=drill.run_id, timeout=measure.GONE_TIMEOUT_S):
            raise StateError(
                f"node {drill.target.node!r}: processes of run {drill.run_id!r} survived SIGKILL "
                f"for {measure.GONE_TIMEOUT_S:g}s"
            )
