"""``kill-during-checkpoint``: wait until a checkpoint is uploading (its files are in the store,
it is not committed yet), then kill one node as ``kill-node`` does. The partial step must never
be loaded: the run resumes from the step committed before it."""

from __future__ import annotations

import time

from infractl.drill import recovery
from infractl.drill.kind import Drill, register
from infractl.drill.kinds.kill_node import KillNode
from infractl.errors import StateError
from infractl.runstore import DrillRecord

__all__ = ["KillDuringCheckpoint"]


@register
class KillDuringCheckpoint(KillNode):
    name = "kill-during-checkpoint"
    help = "Wait until a checkpoint is uploading, then kill one node: the partial step must never be loaded."

    def prepare(self, drill: Drill) -> None:
        super().prepare(drill)
        partial = None
        while partial is None:
            if drill.remaining() <= 0:
                raise StateError(f"run {drill.run_id!r} uploaded no checkpoint within --timeout {drill.timeout:g}s")
            # After a first commit, so the drill shows a resume from it and not from step 0.
            if drill.commits.seen:
                partial = recovery.uploading_step(drill.store, drill.run_id, drill.commits.newest())
            if partial is None:
                time.sleep(recovery.PROC_POLL_S)
                drill.commits.poll()
        drill.fault["partial_step"] = partial

    def finish(self, drill: Drill, record: DrillRecord) -> None:
        # Killed after every rank's shards were uploaded and gathered, the step still commits
        # (nothing of it is missing); killed before, it never does and is never loaded.
        drill.fault["partial_step_committed"] = drill.fault["partial_step"] in drill.commits.seen
