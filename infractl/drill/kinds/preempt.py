"""``preempt``: SIGTERM one node's agent, as a spot reclaim or maintenance notice does: the
workers save an emergency checkpoint within ``preemption.grace_s``, the node leaves, and the
others go on from that checkpoint."""

from __future__ import annotations

import signal

from infractl.drill import recovery
from infractl.drill.kind import Drill, Kind, register
from infractl.proc import NodeProcess
from infractl.runstore import DrillRecord, SaveReason

__all__ = ["Preempt"]


@register
class Preempt(Kind):
    name = "preempt"
    help = "SIGTERM one node's agent: an emergency checkpoint must commit within preemption.grace_s."
    node_leaves = True

    def inject(self, drill: Drill) -> list[NodeProcess]:
        drill.nodes.signal(recovery.agents(drill.victims), signal.SIGTERM)
        drill.fault |= {"signal": "SIGTERM", "grace_s": drill.target.spec.get("preemption", {}).get("grace_s")}
        return drill.workers

    def on_recovered(self, drill: Drill, record: DrillRecord) -> None:
        """The checkpoint saved on the notice: committed after the fault with reason
        ``preemption``, or the save of that very step that was already in flight (reason
        ``scheduled``) if the run resumed from a step committed after the fault."""
        after = drill.commits.since(record.fault_time)
        chosen = next((m for m in after if m.reason == SaveReason.PREEMPTION), None)
        if chosen is None:
            chosen = next((m for m in after if m.step == record.resumed_from_step), None)
        if chosen is not None:
            record.emergency_checkpoint_step = chosen.step
            record.emergency_checkpoint_s = round(chosen.created - record.fault_time, 3)
