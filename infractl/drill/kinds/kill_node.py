"""``kill-node``: the node dies at once: SIGKILL its torchrun agent and workers, and whatever else
dies with the node on its provider (on a namespace node, every process but its sshd)."""

from __future__ import annotations

from infractl.drill import recovery
from infractl.drill.kind import Drill, Kind, register
from infractl.errors import StateError
from infractl.proc import NodeProcess

__all__ = ["KillNode"]


@register
class KillNode(Kind):
    name = "kill-node"
    help = "SIGKILL every process of one node (agent and workers)."
    node_leaves = True

    def inject(self, drill: Drill) -> list[NodeProcess]:
        assert drill.target.node is not None
        drill.nodes.kill_node(drill.target.node, drill.run_id)
        drill.fault["signal"] = "SIGKILL"
        killed = {p.key for p in drill.victims}
        return [p for p in drill.workers if p.key not in killed]

    def settle(self, drill: Drill) -> None:
        if drill.nodes.wait_gone(node=drill.target.node, run=drill.run_id, timeout=recovery.GONE_TIMEOUT_S):
            raise StateError(
                f"node {drill.target.node!r}: processes of run {drill.run_id!r} survived SIGKILL "
                f"for {recovery.GONE_TIMEOUT_S:g}s"
            )
