"""``partition``: cut one node's network link for ``--seconds`` (netns provider), then restore it.

``--kind down`` takes the node's interface down, ``drop`` makes the bridge drop its packets
silently, ``delay`` adds ``--latency-ms`` with netem (see ``providers.netns.LINK_FAULTS``). The
other nodes' collectives time out (half the step timeout), their agents re-rendezvous without the
node (the rendezvous endpoint is on the host, outside every node, so the cut node can never form
a world of its own) and the run goes on from the last committed step. Once the link is back the
node comes back into the run: its agent rejoins the next rendezvous by itself when it is still
running, or the drill runs ``infractl rejoin`` when it gave up.

``rejoin_s`` is link back -> the first step on the whole world again; the drill has recovered
only then.
"""

from __future__ import annotations

import time
from typing import Any

import psutil

from infractl import launcher, proc, runs, runstore
from infractl.drill import recovery
from infractl.drill.kind import Drill, Kind, register
from infractl.errors import InfractlError, UsageError
from infractl.providers import netns
from infractl.runstore import DrillRecord

__all__ = ["Partition"]


@register
class Partition(Kind):
    name = "partition"
    help = (
        "Cut one node's network link (--kind down|drop|delay; provider netns) for --seconds, then restore it: "
        "the others must go on without it, and the node must come back into the run once its link is."
    )
    timed = True
    node_leaves = True
    rejoins = True

    def __init__(self) -> None:
        self._node: dict[str, Any] = {}
        self._fault = "down"
        self._cut = False
        self._back: float | None = None
        self._next_look = 0.0

    def prepare(self, drill: Drill) -> None:
        assert drill.target.node is not None
        self._node = runs.node(drill.state, drill.target.node, field="--node")
        self._fault = str(drill.options.get("link", "down"))
        if self._fault not in netns.LINK_FAULTS:
            faults = ", ".join(netns.LINK_FAULTS)
            raise UsageError(f"{self._fault!r} is not a link fault (one of: {faults})", field="--kind")

    def inject(self, drill: Drill) -> list[psutil.Process]:
        latency = int(drill.options.get("latency_ms", 0))
        drill.fault |= netns.cut_link(self._node, self._fault, latency_ms=latency) | {"seconds": drill.seconds}
        self._cut = True
        return drill.workers

    def tick(self, drill: Drill, record: DrillRecord) -> None:
        now = time.time()
        if self._cut and now - record.fault_time >= drill.seconds:
            self.undo(drill)
            self._back = now
            drill.progress(f"link of {self._node['name']} is back after {now - record.fault_time:.1f}s")
        if self._back is None or "rejoined_by" in drill.fault or time.monotonic() < self._next_look:
            return
        self._next_look = time.monotonic() + recovery.STORE_POLL_S
        live = proc.running_runs(drill.state.dir).get(drill.run_id, set())
        if live and self._node["name"] not in live:
            # The node's agent gave up while it was cut off: start it again, as on-call would.
            try:
                rejoined = launcher.rejoin(drill.state, self._node["name"], run=drill.run_id)
            except InfractlError as exc:
                drill.fault["rejoined_by"] = f"nobody: `infractl rejoin` failed: {exc}"
                drill.progress(drill.fault["rejoined_by"])
                return
            drill.fault["rejoined_by"] = "infractl rejoin"
            drill.progress(f"node {rejoined.node!r} had stopped: `infractl rejoin` started its agent again")

    def recovered(self, drill: Drill, record: DrillRecord) -> bool:
        """Resumed without the node, and then a step ran on the whole world again after the link was back."""
        if record.restart_s is None and not recovery.resumed(drill.commits, record):
            return False
        if self._back is None:
            return False
        whole = [
            r["time"]
            for r in runstore.read_metrics(drill.store, drill.run_id)
            if r["time"] > self._back and r["world_size"] == record.world_size_at_fault
        ]
        if not whole:
            return False
        record.rejoin_s = round(min(whole) - self._back, 3)
        drill.fault.setdefault("rejoined_by", "itself")
        return True

    def undo(self, drill: Drill) -> None:
        if self._cut:
            netns.restore_link(self._node, self._fault)
            self._cut = False

    def describe(self, record: DrillRecord) -> str:
        return (
            f"link {record.fault.get('link')} for {record.fault.get('seconds')}s; {super().describe(record)}; "
            f"the node rejoined by {record.fault.get('rejoined_by', '-')} (rejoin_s: link back -> whole world)"
        )
