"""``kill-node``: SIGKILL every process of one node (its torchrun agent and workers; on netns,
every process in the node's namespace but its sshd listener)."""

from __future__ import annotations

import psutil

from infractl import proc, runs
from infractl.drill import recovery
from infractl.drill.kind import Drill, Kind, register
from infractl.errors import StateError
from infractl.providers import netns

__all__ = ["KillNode"]


@register
class KillNode(Kind):
    name = "kill-node"
    help = "SIGKILL every process of one node (agent and workers)."
    node_leaves = True

    def __init__(self) -> None:
        self._also: list[psutil.Process] = []

    def prepare(self, drill: Drill) -> None:
        node = runs.node(drill.state, str(drill.target.node), field="--node")
        self._also = netns.node_processes(node) if node.get("namespace") else []

    def inject(self, drill: Drill) -> list[psutil.Process]:
        proc.kill(drill.victims + self._also)
        drill.fault["signal"] = "SIGKILL"
        killed = {p.pid for p in drill.victims}
        return [p for p in drill.workers if p.pid not in killed]

    def settle(self, drill: Drill) -> None:
        if proc.wait_gone(drill.state.dir, node=drill.target.node, run=drill.run_id, timeout=recovery.GONE_TIMEOUT_S):
            raise StateError(
                f"node {drill.target.node!r}: processes of run {drill.run_id!r} survived SIGKILL "
                f"for {recovery.GONE_TIMEOUT_S:g}s"
            )
