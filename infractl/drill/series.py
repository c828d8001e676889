"""``--repeat N``: drills in a row on one run, a node the fault removed rejoining in between."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from infractl import launcher, providers, runstore
from infractl.drill import recovery
from infractl.drill.kind import Progress, kind_named
from infractl.drill.run import run_drill, select
from infractl.errors import UsageError
from infractl.runstore import DrillRecord
from infractl.statedir import ClusterState
from infractl.store import Store, for_cluster

__all__ = ["Series", "drill_whole_again", "run_series", "whole_again"]


@dataclass
class Series:
    """The drills of a series in order, and what an operator asks of them."""

    results: list[DrillRecord] = field(default_factory=list)

    @property
    def succeeded(self) -> int:
        return sum(1 for r in self.results if kind_named(r.drill).succeeded(r))

    def restart_times(self) -> list[float]:
        return [r.restart_s for r in self.results if r.restart_s is not None]

    def summary(self) -> dict[str, Any]:
        times = self.restart_times()
        return {
            "drills": len(self.results),
            "succeeded": self.succeeded,
            "median_restart_s": round(statistics.median(times), 3) if times else None,
            "worst_restart_s": max(times) if times else None,
            "median_phases": self.median_phases(),
            "drill_ids": [r.drill_id for r in self.results],
        }

    def median_phases(self) -> dict[str, float | None]:
        """Each phase of the restarts (``DrillRecord.phases``): its median over the drills that
        measured it; empty when no drill restarted the run."""
        measured = [r.phases for r in self.results if r.phases]
        if not measured:
            return {}
        medians: dict[str, float | None] = {}
        for name in recovery.PHASES:
            values = [seconds for p in measured if (seconds := p.get(name)) is not None]
            medians[name] = round(statistics.median(values), 3) if values else None
        return medians


def run_series(
    state: ClusterState,
    kind_name: str,
    repeat: int,
    *,
    node: str | None = None,
    run: str | None = None,
    seconds: float = 10.0,
    timeout: float = 600.0,
    wait_finish: bool = True,
    progress: Progress = lambda _msg: None,
    options: dict[str, Any] | None = None,
) -> Series:
    """``repeat`` drills in a row on one run; a node a fault removed rejoins before the next one.

    Each drill waits only for recovery; with ``wait_finish`` the last also waits for the run to
    finish. Stops early if a drill does not recover (the run is then in no state for the next).
    """
    kind = kind_named(kind_name)
    target = select(state, kind, node, run)
    budget = int(target.spec["max_restarts"])
    if repeat > budget:
        raise UsageError(
            f"{repeat} drills need max_restarts >= {repeat} in run {target.run_id!r} "
            f"(it is {budget}): every fault costs the surviving agents one restart",
            field="--repeat",
        )
    series = Series()
    for i in range(repeat):
        last = i == repeat - 1
        progress(f"drill {i + 1}/{repeat}")
        record = drill_whole_again(
            state,
            kind_name,
            node=target.node,
            run=target.run_id,
            seconds=seconds,
            timeout=timeout,
            wait_finish=last and wait_finish,
            rejoin=not last,
            progress=progress,
            options=options,
        )
        series.results.append(record)
        if not whole_again(record):
            break
    return series


def drill_whole_again(
    state: ClusterState,
    kind_name: str,
    *,
    node: str | None,
    run: str,
    seconds: float,
    timeout: float,
    wait_finish: bool,
    rejoin: bool,
    progress: Progress,
    options: dict[str, Any] | None,
) -> DrillRecord:
    """One drill of a series (``run_drill``); with ``rejoin``, a node the fault removed (and the
    kind does not bring back itself) rejoins afterwards and the drill's record gets its
    ``rejoin_s``. ``whole_again`` says whether the run is then fit for the next fault."""
    kind = kind_named(kind_name)
    record = run_drill(
        state,
        kind_name,
        node=node,
        run=run,
        seconds=seconds,
        timeout=timeout,
        wait_finish=wait_finish,
        progress=progress,
        options=options,
    )
    # A node that left the world (a kill, a preemption, or a hang whose watchdog took its agent
    # down too) rejoins; a kind that brings its node back itself does so.
    shrunk = _shrunk(record)
    if record.outcome == "recovered" and rejoin and record.node is not None and shrunk and not kind.rejoins:
        store = for_cluster(state)
        _rejoin(state, store, record, timeout=timeout, progress=progress)
        runstore.write_drill_record(store, record)
    return record


def whole_again(record: DrillRecord) -> bool:
    """Whether the run recovered from the drill with every node it had at the fault."""
    return record.outcome == "recovered" and (not _shrunk(record) or record.rejoin_s is not None)


def _shrunk(record: DrillRecord) -> bool:
    """Whether the run resumed on fewer ranks than it had at the fault (a fault of the store: no)."""
    after, before = record.world_size_after, record.world_size_at_fault
    return after is not None and before is not None and after < before


def _rejoin(state: ClusterState, store: Store, record: DrillRecord, *, timeout: float, progress: Progress) -> None:
    """Bring the drill's node back and wait until a step runs on the whole world again."""
    assert record.node is not None
    nodes = providers.control(state)
    alive = nodes.wait_gone(node=record.node, run=record.run_id, timeout=recovery.GONE_TIMEOUT_S)
    started = time.time()
    if not alive:  # else its agent lives on and joins the next rendezvous by itself
        launcher.rejoin(state, record.node, run=record.run_id)
    deadline = time.monotonic() + timeout
    metrics = runstore.MetricsTail(store, record.run_id)
    with nodes.watch(record.run_id) as watch:
        while time.monotonic() < deadline:
            grown = [
                r for r in metrics.records() if r["time"] > started and r["world_size"] == record.world_size_at_fault
            ]
            if grown:
                record.rejoin_s = round(min(r["time"] for r in grown) - started, 3)
                progress(
                    f"node {record.node!r} rejoined: world size {record.world_size_at_fault} again "
                    f"after {record.rejoin_s}s"
                )
                return
            if watch.gone():
                return
            time.sleep(recovery.STORE_POLL_S)
