"""``store-outage``: the store refuses every call for ``--seconds`` (the store's own outage hook:
a file:// store's directory is moved away and back, an S3 endpoint served on this machine is
paused and resumed). Training must go on, and commit again once the store is back."""

from __future__ import annotations

import contextlib
import time
from contextlib import AbstractContextManager
from typing import Any

from infractl.drill.kind import Drill, Kind, register
from infractl.proc import NodeProcess
from infractl.runstore import DrillRecord

__all__ = ["StoreOutage"]


@register
class StoreOutage(Kind):
    name = "store-outage"
    help = (
        "Make the store refuse every call for --seconds (a file:// store's directory moves away; an S3 "
        "endpoint on this machine is paused): training must go on and commit again once the store is back."
    )
    targets_node = False
    timed = True

    def __init__(self) -> None:
        self._take_down: AbstractContextManager[dict[str, Any]] | None = None
        self._down = contextlib.ExitStack()
        self._back_time: float | None = None

    def check(self, drill: Drill) -> None:
        self._take_down = drill.store.outage()  # refused here when this store cannot be taken down

    def inject(self, drill: Drill) -> list[NodeProcess]:
        assert self._take_down is not None
        drill.fault |= self._down.enter_context(self._take_down) | {"seconds": drill.seconds}
        return []

    def tick(self, drill: Drill, record: DrillRecord) -> None:
        if self._back_time is None and time.time() - record.fault_time >= drill.seconds:
            self._down.close()
            self._back_time = time.time()
            drill.progress(f"store is back after {self._back_time - record.fault_time:.1f}s")

    def holds_store(self, drill: Drill, record: DrillRecord) -> bool:
        return self._back_time is None

    def recovered(self, drill: Drill, record: DrillRecord) -> bool:
        """The first checkpoint committed after the store came back."""
        after = drill.commits.since(self._back_time or record.fault_time)
        if not after:
            return False
        record.restart_s = round(after[0].created - record.fault_time, 3)
        return True

    def undo(self, drill: Drill) -> None:
        self._down.close()

    def describe(self, record: DrillRecord) -> str:
        return f"store down {record.fault.get('seconds')}s, first commit after it at {record.restart_s}s"

    def succeeded(self, record: DrillRecord) -> bool:
        return record.outcome == "recovered"
