"""Fault drills against a running job: inject a fault, measure recovery from the store.

``kill_node`` kills every process of one training node (its torchrun agent and the workers,
which run in their own sessions) and then watches only what an operator could watch: the
surviving node's processes and the run's objects in the store (metrics and commits).

Definitions (all times are unix seconds; ``fault_time`` is taken just before the kill):

``detect_s``
    fault -> the first pre-fault *worker* process of a surviving node is gone. A survivor's
    worker exits when its collective fails against the dead peer, or its agent tears the worker
    group down on a membership change; either way it is the first observable sign that the
    survivors noticed. Observed by polling the workers' PIDs every ``_PROC_POLL_S`` seconds, so
    it is an upper bound by at most that much. ``None`` if no survivor worker went away.
``restart_s``
    fault -> the ``time`` field of the first metrics record written after the fault whose
    ``restart_count`` increased or whose ``world_size`` changed (the first step completed after
    resume, per REFERENCES.md "Recovery time, defined").
``resumed_from_step``
    that record's step - 1 (the committed step the survivors loaded).
``lost_work_steps``
    ``step_at_fault - last_committed_step``: steps trained but not committed at the fault.
``outcome``
    ``recovered`` once the run resumed and its final checkpoint (``spec.steps``) is committed;
    ``failed`` if every process of the run exited without that; ``timeout`` otherwise.

The result goes to ``runs/<run>/drills/<drill-id>.json`` in the store.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import psutil

from infractl import proc, runstore
from infractl.cluster import RENDEZVOUS_NODE, store_for
from infractl.errors import StateError, UsageError
from infractl.state import ClusterState
from infractl.store import Store

__all__ = ["KillNodeResult", "running_runs", "kill_node", "drill_key"]

_PROC_POLL_S = 0.05  # survivor workers: cheap liveness checks on held process handles
_STORE_POLL_S = 0.5  # metrics and commits
_GONE_TIMEOUT_S = 30.0


@dataclass
class KillNodeResult:
    drill_id: str
    drill: str
    run_id: str
    cluster: str
    node: str
    survivors: list[str]
    fault_time: float
    step_at_fault: int | None
    last_committed_step: int
    world_size_at_fault: int | None
    detect_s: float | None
    restart_s: float | None
    resumed_from_step: int | None
    lost_work_steps: int | None
    world_size_after: int | None
    final_step: int | None
    final_committed: bool
    steps: int
    outcome: str  # recovered | failed | timeout
    finished_time: float
    timeout_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def drill_key(run_id: str, drill_id: str) -> str:
    return f"{runstore.run_prefix(run_id)}/drills/{drill_id}.json"


def running_runs(state: ClusterState) -> dict[str, set[str]]:
    """run id -> names of the nodes that have live processes of it (the rendezvous server excluded)."""
    runs: dict[str, set[str]] = {}
    for p in proc.find(state.dir):
        try:
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        run, node = env.get(proc.RUN_ENV), env.get(proc.NODE_ENV)
        if run and node and node != RENDEZVOUS_NODE:
            runs.setdefault(run, set()).add(node)
    return runs


def _is_agent(p: psutil.Process) -> bool:
    try:
        return "torch.distributed.run" in p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def _select(state: ClusterState, node: str | None, run: str | None) -> tuple[str, str, list[str], dict[str, Any]]:
    """Validate the target; return (run, node, surviving nodes, run spec). Changes nothing."""
    cluster_nodes = [n["name"] for n in state.read()["nodes"]]
    if node is not None and node not in cluster_nodes:
        raise UsageError(f"--node: no node {node!r} in cluster {state.name!r} (nodes: {', '.join(cluster_nodes)})")
    runs = running_runs(state)
    if run is None:
        if not runs:
            raise StateError(
                f"no run is running on cluster {state.name!r}; start one with `infractl train RUN.yaml --detach`"
            )
        if len(runs) > 1:
            names = ", ".join(sorted(runs))
            raise UsageError(f"several runs are running on cluster {state.name!r} ({names}); pick one with --run")
        run = next(iter(runs))
    elif run not in runs:
        raise StateError(f"--run: run {run!r} is not running on cluster {state.name!r}")
    live = [n for n in cluster_nodes if n in runs[run]]
    if node is None:
        node = live[-1]
    elif node not in live:
        raise StateError(f"--node: node {node!r} runs no process of run {run!r} (running on: {', '.join(live)})")
    record = runstore.read_run_record(store_for(state), run)
    if record is None or "spec" not in record:
        raise StateError(f"run {run!r} has no run.json with its spec in the store of cluster {state.name!r}")
    spec = record["spec"]
    minimum = int(spec["nodes"]["min"])
    survivors = [n for n in live if n != node]
    if len(survivors) < minimum:
        raise UsageError(
            f"--node: killing {node!r} would leave {len(survivors)} node(s) running run {run!r}, "
            f"fewer than its nodes.min ({minimum})"
        )
    return run, node, survivors, spec


def _records_since(store: Store, run_id: str, since: float) -> list[dict[str, Any]]:
    return [r for r in runstore.read_metrics(store, run_id) if float(r.get("time", 0)) > since]


def kill_node(
    state: ClusterState,
    *,
    node: str | None = None,
    run: str | None = None,
    timeout: float = 600.0,
    progress: Callable[[str], None] = lambda _msg: None,
) -> KillNodeResult:
    """Kill one node of a running job, measure its recovery, record the result in the store."""
    run_id, node, survivors, spec = _select(state, node, run)
    store = store_for(state)
    steps = int(spec["steps"])

    latest = runstore.latest_metrics(store, run_id)
    step_at_fault = int(latest["step"]) if latest else None
    restart_before = int(latest.get("restart_count", 0)) if latest else 0
    world_before = int(latest["world_size"]) if latest and "world_size" in latest else None
    last_committed = runstore.latest_committed_step(store, run_id) or 0
    survivor_workers = [
        p for name in survivors for p in proc.find(state.dir, node=name, run=run_id) if not _is_agent(p)
    ]
    victims = proc.find(state.dir, node=node, run=run_id)

    fault_time = time.time()
    proc.kill(victims)
    progress(f"killed node {node!r} ({len(victims)} process(es)) of run {run_id!r} at step {step_at_fault}, "
             f"last committed step {last_committed}")
    if proc.wait_gone(state.dir, node=node, run=run_id, timeout=_GONE_TIMEOUT_S):
        raise StateError(f"node {node!r}: processes of run {run_id!r} survived SIGKILL for {_GONE_TIMEOUT_S:g}s")

    deadline = time.monotonic() + timeout
    detect_time: float | None = None
    resume: dict[str, Any] | None = None
    final_committed = False
    outcome = "timeout"
    next_store = 0.0
    while time.monotonic() < deadline:
        if detect_time is None and survivor_workers and not all(_alive(p) for p in survivor_workers):
            detect_time = time.time()
        if time.monotonic() >= next_store:
            next_store = time.monotonic() + _STORE_POLL_S
            if resume is None:
                fresh = [
                    r for r in _records_since(store, run_id, fault_time)
                    if int(r.get("restart_count", 0)) > restart_before
                    or (world_before is not None and r.get("world_size") != world_before)
                ]
                if fresh:
                    resume = min(fresh, key=lambda r: float(r["time"]))
                    progress(f"resumed at step {resume['step']} on world size {resume.get('world_size')}")
            if resume is not None and (runstore.latest_committed_step(store, run_id) or 0) >= steps:
                final_committed = True
                outcome = "recovered"
                break
            if not proc.find(state.dir, run=run_id):
                final_committed = (runstore.latest_committed_step(store, run_id) or 0) >= steps
                outcome = "recovered" if resume is not None and final_committed else "failed"
                break
        time.sleep(_PROC_POLL_S)

    newest = runstore.latest_metrics(store, run_id)
    result = KillNodeResult(
        drill_id=f"kill-node-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(fault_time))}-{secrets.token_hex(3)}",
        drill="kill-node",
        run_id=run_id,
        cluster=state.name,
        node=node,
        survivors=survivors,
        fault_time=fault_time,
        step_at_fault=step_at_fault,
        last_committed_step=last_committed,
        world_size_at_fault=world_before,
        detect_s=round(detect_time - fault_time, 3) if detect_time is not None else None,
        restart_s=round(float(resume["time"]) - fault_time, 3) if resume is not None else None,
        resumed_from_step=int(resume["step"]) - 1 if resume is not None else None,
        lost_work_steps=step_at_fault - last_committed if step_at_fault is not None else None,
        world_size_after=resume.get("world_size") if resume is not None else None,
        final_step=int(newest["step"]) if newest else None,
        final_committed=final_committed,
        steps=steps,
        outcome=outcome,
        finished_time=time.time(),
        timeout_s=timeout,
    )
    store.put_bytes(drill_key(run_id, result.drill_id), json.dumps(result.to_dict(), indent=1).encode())
    return result
