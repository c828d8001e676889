"""``partition``: cut one node's network link for ``--seconds`` (on a provider whose nodes have
links of their own), then restore it.

``--kind down`` takes the node's interface down, ``drop`` drops its packets silently, ``delay``
adds ``--latency-ms`` (see ``providers.LINK_FAULTS``; the provider makes them: netns nodes take
every kind from the host, an SSH node such as an aws instance makes ``drop`` and ``delay`` itself,
with its SSH port spared). The cut node's keep-alives stop reaching the rendezvous, which drops
it (``restart.keep_alive_s`` x ``keep_alive_misses``); the other nodes' agents then kill their
workers, waiting on it in a collective (``trainer.rendezvous_patch.peer_lost``; the collective's timeout
is the backstop), and re-rendezvous without it (the endpoint is outside every node, on the host
or the controller, so the cut node can never form a world of its own); the run goes on from
the last committed step or a newer replica. Once the link is back the node comes back into the run: its agent
rejoins the next rendezvous by itself when it is still running, or the drill runs
``infractl rejoin`` when it gave up.

``rejoin_s`` is link back -> the first step on the whole world again; the drill has recovered
only then.
"""

from __future__ import annotations

import time

from infractl import launcher
from infractl.config import RunSpec
from infractl.drill import recovery
from infractl.drill.kind import Drill, Kind, KindOption, register
from infractl.errors import InfractlError, UsageError
from infractl.proc import NodeProcess
from infractl.providers import LINK_FAULTS
from infractl.runstore import DrillRecord

__all__ = ["Partition"]


@register
class Partition(Kind):
    name = "partition"
    help = (
        "Cut one node's network link (--kind down|drop|delay; on a provider whose nodes have links of their "
        "own) for --seconds, then restore it: the others must go on without it, and the node must come back "
        "into the run once its link is."
    )
    timed = True
    seconds = 30.0
    node_leaves = True
    rejoins = True
    options = (
        KindOption(
            "link",
            "--kind",
            "down: the node's interface goes down; drop: its packets vanish silently; delay: latency of --latency-ms.",
            default="down",
            choices=LINK_FAULTS,
        ),
        KindOption(
            "latency_ms",
            "--latency-ms",
            "Latency --kind delay adds to the node's packets.",
            500,
            minimum=1,
            maximum=60_000,
        ),
    )

    @classmethod
    def series_seconds(cls, spec: RunSpec) -> float:
        """Twice the step timeout: the collectives across the cut time out at half of it at most,
        so the run has surely noticed before the link is back (a shorter cut may only stall a step)."""
        return 2.0 * spec.watchdog.step_timeout_s

    def __init__(self) -> None:
        self._node = ""
        self._fault = "down"
        self._cut = False
        self._back: float | None = None
        self._next_look = 0.0

    def check(self, drill: Drill) -> None:
        assert drill.target.node is not None
        self._node = drill.target.node
        self._fault = str(drill.options.get("link", "down"))
        if self._fault not in LINK_FAULTS:
            raise UsageError(f"{self._fault!r} is not a link fault (one of: {', '.join(LINK_FAULTS)})", field="--kind")
        offered = drill.nodes.link_faults
        if not offered:
            raise UsageError(
                f"node {self._node!r} has no network link of its own to cut: partition needs a provider whose "
                "nodes have links",
                field="--node",
            )
        if self._fault not in offered:
            raise UsageError(
                f"node {self._node!r} cannot take a {self._fault!r} fault on this provider "
                f"(one of: {', '.join(offered)})",
                field="--kind",
            )

    def inject(self, drill: Drill) -> list[NodeProcess]:
        latency = int(drill.options.get("latency_ms", 0))
        drill.fault |= drill.nodes.cut_link(self._node, self._fault, latency_ms=latency) | {"seconds": drill.seconds}
        self._cut = True
        return drill.workers

    def tick(self, drill: Drill, record: DrillRecord) -> None:
        now = time.time()
        if self._cut and now - record.fault_time >= drill.seconds:
            self.undo(drill)
            self._back = now
            drill.progress(f"link of {self._node} is back after {now - record.fault_time:.1f}s")
        if self._back is None or "rejoined_by" in drill.fault or time.monotonic() < self._next_look:
            return
        self._next_look = time.monotonic() + recovery.STORE_POLL_S
        # Rejoin only a node that reported it has nothing of the run left, while others still run it.
        if drill.watch.reported(self._node) == [] and drill.watch.nodes():
            # The node's agent gave up while it was cut off: start it again, as on-call would.
            try:
                rejoined = launcher.rejoin(drill.state, self._node, run=drill.run_id)
            except InfractlError as exc:
                drill.fault["rejoined_by"] = f"nobody: `infractl rejoin` failed: {exc}"
                drill.progress(drill.fault["rejoined_by"])
                return
            drill.fault["rejoined_by"] = "infractl rejoin"
            drill.progress(f"node {rejoined.node!r} had stopped: `infractl rejoin` started its agent again")

    def recovered(self, drill: Drill, record: DrillRecord) -> bool:
        """Resumed without the node, and then a step ran on the whole world again after the link was back."""
        if record.restart_s is None and not recovery.resumed(drill.commits, drill.metrics, record):
            return False
        if self._back is None:
            return False
        whole = [
            r["time"]
            for r in drill.metrics.records()
            if r["time"] > self._back and r["world_size"] == record.world_size_at_fault
        ]
        if not whole:
            return False
        record.rejoin_s = round(min(whole) - self._back, 3)
        drill.fault.setdefault("rejoined_by", "itself")
        return True

    def undo(self, drill: Drill) -> None:
        if self._cut:
            drill.nodes.restore_link(self._node, self._fault)
            self._cut = False

    def describe(self, record: DrillRecord) -> str:
        return (
            f"link {record.fault.get('link')} for {record.fault.get('seconds')}s; {super().describe(record)}; "
            f"the node rejoined by {record.fault.get('rejoined_by', '-')} (rejoin_s: link back -> whole world)"
        )
