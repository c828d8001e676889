"""One drill: choose the target, look up what the fault needs, strike, watch (the drill loop),
record."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from infractl import providers, runs, runstore
from infractl.drill import recovery
from infractl.drill.kind import Drill, Kind, Progress, Target, kind_named
from infractl.errors import StateError, UsageError
from infractl.runstore import DrillRecord
from infractl.statedir import ClusterState
from infractl.store import for_cluster

__all__ = ["run_drill", "select"]

# Seconds the nodes' monitors may take to make their first report (an SSH login each).
_REPORTED_TIMEOUT_S = 60.0
_COMMIT_POLL_S = 0.2  # committed steps and their manifests, while watching


def select(state: ClusterState, kind: Kind, node: str | None, run: str | None) -> Target:
    """Validate the target; change nothing. A drill measures recovery through the store: with
    the store unreachable it would strike blind, so that is checked first."""
    cluster_nodes = [n.name for n in state.record().nodes]
    if node is not None:
        runs.node(state, node, field="--node")
    for_cluster(state).ping()
    run, running_on = runs.running_run(state, run)
    live = [n for n in cluster_nodes if n in running_on]
    record = runstore.read_run_record(for_cluster(state), run)
    if record is None or record.spec is None:
        raise StateError(f"run {run!r} has no run.json with its spec in the store of cluster {state.name!r}")
    spec = record.spec
    if not kind.targets_node:
        return Target(run, None, live, spec)
    if node is None:
        node = live[-1]
    elif node not in live:
        raise StateError(
            f"node {node!r} runs no process of run {run!r} (running on: {', '.join(live)})", field="--node"
        )
    survivors = [n for n in live if n != node]
    minimum = int(spec["nodes"]["min"])
    if kind.node_leaves and len(survivors) < minimum:
        raise UsageError(
            f"{kind.name} on {node!r} would leave {len(survivors)} node(s) running run {run!r}, "
            f"fewer than its nodes.min ({minimum})",
            field="--node",
        )
    return Target(run, node, survivors, spec)


def run_drill(
    state: ClusterState,
    kind_name: str,
    *,
    node: str | None = None,
    run: str | None = None,
    seconds: float = 10.0,
    timeout: float = 600.0,
    wait_finish: bool = True,
    progress: Progress = lambda _msg: None,
    options: dict[str, Any] | None = None,
) -> DrillRecord:
    """Inject one fault of ``kind_name`` into a running job, measure its recovery, record it in
    the store (``runs/<run>/drills/<id>.json``) and return the record."""
    kind = kind_named(kind_name)
    target = select(state, kind, node, run)
    store = for_cluster(state)
    nodes = providers.control(state)
    with nodes.watch(target.run_id) as watch:
        if not watch.wait_reported(_REPORTED_TIMEOUT_S):
            raise StateError(
                f"not every node of cluster {state.name!r} reported the processes of run {target.run_id!r} "
                f"within {_REPORTED_TIMEOUT_S:g}s: a drill needs to see every node (`infractl status`)"
            )
        drill = Drill(
            state=state,
            store=store,
            target=target,
            commits=recovery.Commits(store, target.run_id),
            metrics=runstore.MetricsTail(store, target.run_id),
            nodes=nodes,
            watch=watch,
            workers=[],
            victims=[],
            deadline=time.monotonic() + timeout,
            timeout=timeout,
            seconds=seconds,
            progress=progress,
            options=options or {},
        )
        kind.check(drill)
        _wait_started(drill)
        record = _strike(drill, kind)
        try:
            kind.settle(drill)
            _observe(drill, kind, record, wait_finish=wait_finish)
            if wait_finish and record.final_committed:
                # The last commit comes just before the processes exit: the drill ends with the run.
                _wait(watch.gone, timeout=recovery.GONE_TIMEOUT_S)
        finally:
            kind.undo(drill)
    kind.finish(drill, record)
    newest = runstore.latest_metrics(store, target.run_id)
    record.final_step = newest["step"] if newest else None
    record.finished_time = time.time()
    runstore.write_drill_record(store, record)
    return record


def _wait_started(drill: Drill) -> None:
    """Until the run's current attempt has committed a checkpoint and trains on the ranks of every
    node running it, it is still starting (a run just launched or relaunched, nodes that came up
    late and join in a later round): a fault then would measure its start-up, or a smaller world
    than the run has, not a recovery. Wait for both, within the drill's timeout."""
    run_id = drill.target.run_id
    record = runstore.read_run_record(drill.store, run_id)
    started = record.last_attempt.started if record is not None and record.last_attempt is not None else 0.0
    running = [*drill.target.survivors, *([drill.target.node] if drill.target.node else [])]
    full = runs.full_world(
        int(drill.target.spec["nodes"]["max"]), len(running), max(drill.nodes.node(n).processes for n in running)
    )
    said = ""
    while True:
        drill.commits.poll()
        if not drill.commits.since(started):
            waiting = "its first checkpoint in this attempt"
        else:
            newest = runstore.latest_metrics(drill.store, run_id)
            world = newest["world_size"] if newest is not None else 0
            if world >= full:
                return
            waiting = f"its full world ({full} ranks on {len(running)} node(s); world size {world} now)"
        if waiting != said:
            drill.progress(f"run {run_id!r} is still starting: waiting for {waiting}")
            said = waiting
        if drill.watch.gone():
            raise StateError(f"run {run_id!r} ended while the drill waited for {waiting}: there is nothing to recover")
        if time.monotonic() > drill.deadline:
            raise StateError(
                f"run {run_id!r} did not reach {waiting} within the drill's --timeout ({drill.timeout:g}s): a drill "
                "measures the recovery of a run that has started; look at `infractl status` and `infractl logs`",
                field="--timeout",
            )
        time.sleep(recovery.STORE_POLL_S)


def _observe(drill: Drill, kind: Kind, record: DrillRecord, *, wait_finish: bool) -> None:
    """The drill loop: poll processes and store until the run recovered (and finished, with
    ``wait_finish``) or every process of the run exited; the outcome stays ``timeout`` past the
    drill's deadline. What each number means: ``recovery``'s module doc."""
    watched = drill.watched
    recovered = False
    next_commits = next_metrics = 0.0
    while time.monotonic() < drill.deadline:
        kind.tick(drill, record)
        holding = kind.holds_store(drill, record)
        if record.detect_s is None and watched and not drill.watch.all_alive(watched):
            record.detect_s = round(time.time() - record.fault_time, 3)
        if record.stopped_s is None and watched and drill.watch.none_alive(watched):
            record.stopped_s = round(time.time() - record.fault_time, 3)
        if time.monotonic() < next_commits or holding:
            time.sleep(recovery.PROC_POLL_S)
            continue
        next_commits = time.monotonic() + _COMMIT_POLL_S
        drill.commits.poll()
        if recovered and (not wait_finish or drill.commits.newest() >= record.steps):
            record.final_committed = drill.commits.newest() >= record.steps
            record.outcome = "recovered"
            return
        if time.monotonic() < next_metrics:
            continue
        # Metrics records cost more than a listing of commits: less often.
        next_metrics = time.monotonic() + recovery.STORE_POLL_S
        if not recovered:
            recovered = kind.recovered(drill, record)
            if recovered:
                kind.on_recovered(drill, record)
                drill.progress(f"recovered: {kind.describe(record)}, {record.restart_s}s after the fault")
                continue
        if drill.watch.gone():
            drill.commits.poll()
            record.final_committed = drill.commits.newest() >= record.steps
            record.outcome, record.outcome_note = recovery.ended(
                recovered=recovered,
                resumed=record.restart_s is not None,
                final_committed=record.final_committed,
                node=record.node,
            )
            return


def _wait(done: Callable[[], bool], *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(recovery.PROC_POLL_S)


def _strike(drill: Drill, kind: Kind) -> DrillRecord:
    """Look up what the fault needs, inject it, and start the drill's record."""
    target = drill.target
    # Everything slow to look up is looked up before the fault: kill-during-checkpoint must
    # strike within the moment between a step's upload and its commit.
    drill.commits.poll()
    latest = runstore.latest_metrics(drill.store, target.run_id)
    running = drill.nodes.processes(run=target.run_id)
    drill.workers = recovery.workers(running)
    drill.victims = [p for p in running if p.node == target.node]
    kind.prepare(drill)
    last_committed = drill.commits.newest()

    fault_time = time.time()
    drill.watched = kind.inject(drill)
    step_at_fault = latest["step"] if latest else None
    where = f"node {target.node!r}" if target.node else "the store"
    drill.progress(
        f"{kind.name}: fault on {where} of run {target.run_id!r} at step {step_at_fault}, "
        f"last committed step {last_committed}"
    )
    return DrillRecord(
        drill_id=f"{kind.name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(fault_time))}-{secrets.token_hex(3)}",
        drill=kind.name,
        run_id=target.run_id,
        cluster=drill.state.name,
        node=target.node,
        survivors=target.survivors,
        fault_time=fault_time,
        fault=drill.fault,
        step_at_fault=step_at_fault,
        last_committed_step=last_committed,
        world_size_at_fault=latest["world_size"] if latest else None,
        steps=int(target.spec["steps"]),
        timeout_s=drill.timeout,
    )
