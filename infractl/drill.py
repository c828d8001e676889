"""Fault drills against a running job: inject a fault, measure recovery from the outside.

A drill injects one fault into a run started with ``infractl train --detach`` and then watches
only what an operator could watch: the nodes' processes and the run's objects in the store
(metrics records, committed checkpoints and their manifests). Kinds:

``kill-node``               SIGKILL every process of one node (its torchrun agent and workers).
``kill-during-checkpoint``  wait until a checkpoint is uploading (its files are in the store, it
                            is not committed yet), then kill one node as ``kill-node`` does.
``hang-node``               SIGSTOP one node's workers (the agent stays up): the node's
                            watchdog must kill them (``watchdog.step_timeout_s``).
``preempt``                 SIGTERM one node's agent, as a spot reclaim or maintenance notice
                            does: the workers save an emergency checkpoint within
                            ``preemption.grace_s``, the node leaves, the others go on.
``store-outage``            the store refuses every call for ``seconds``: a file:// store's
                            directory is moved away and back; an S3 endpoint served on this
                            machine is SIGSTOPped and resumed.

Measurements (unix seconds; ``fault_time`` is taken just before the fault):

``detect_s``
    fault -> the first worker that was running at the fault (and that the drill did not kill
    itself) is gone: the first sign that the job noticed. Polled every ``_PROC_POLL_S`` s, so an
    upper bound by that much. ``None`` for ``store-outage`` (no process needs to die).
``restart_s``
    fault -> the ``time`` of the first step completed by a restarted worker group (the first
    metrics record after the fault that carries ``environment``, which every trainer process
    adds to its first step). ``store-outage``: fault -> the first checkpoint committed after
    the store came back.
``resumed_from_step``
    that record's step - 1: the committed step the workers loaded. ``expected_resume_step`` is
    the newest step committed before that record (from the manifests), and the drill checks
    the two are equal: a run never resumes from anything but its last committed step.
``lost_work_steps``
    ``step_at_fault - resumed_from_step`` (at least 0): steps trained but not kept. ``step_at_fault`` is the
    newest step in the store at the fault; metrics are flushed every few steps or seconds, so
    it may trail the ranks by that much.
``outcome``
    ``recovered`` once the run resumed (``store-outage``: committed after the outage) and, when
    the drill waits for the end, its final checkpoint (``spec.steps``) is committed; ``failed``
    if every process of the run exited without that; ``timeout`` otherwise.

``--repeat N`` runs N drills in series on the same run: after each recovery a node the fault
removed is brought back (``launcher.rejoin``) and the drill waits until the world is whole
again (``rejoin_s``) before the next fault. Every result goes to
``runs/<run>/drills/<drill-id>.json`` in the store.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from infractl import launcher, proc, runstore
from infractl.cluster import store_for
from infractl.errors import StateError, UsageError
from infractl.runstore import Manifest
from infractl.state import ClusterState
from infractl.store import Store

__all__ = ["KINDS", "DrillResult", "Series", "run_drill", "run_series", "drill_key"]

KINDS = ("kill-node", "kill-during-checkpoint", "hang-node", "preempt", "store-outage")
#: Kinds after which the faulted node is out of the run (a series rejoins it).
_NODE_LEAVES = ("kill-node", "kill-during-checkpoint", "preempt")

_PROC_POLL_S = 0.05  # held process handles: cheap liveness checks
_COMMIT_POLL_S = 0.2  # committed steps and their manifests
_STORE_POLL_S = 0.5  # metrics records, and whether the run still has processes
_GONE_TIMEOUT_S = 30.0

Progress = Callable[[str], None]


@dataclass
class DrillResult:
    drill_id: str
    drill: str
    run_id: str
    cluster: str
    node: str | None
    survivors: list[str]
    fault_time: float
    fault: dict[str, Any]
    step_at_fault: int | None
    last_committed_step: int
    world_size_at_fault: int | None
    detect_s: float | None = None
    restart_s: float | None = None
    resumed_from_step: int | None = None
    expected_resume_step: int | None = None
    lost_work_steps: int | None = None
    world_size_after: int | None = None
    emergency_checkpoint_step: int | None = None
    emergency_checkpoint_s: float | None = None
    rejoin_s: float | None = None
    final_step: int | None = None
    final_committed: bool = False
    steps: int = 0
    outcome: str = "timeout"  # recovered | failed | timeout
    finished_time: float = 0.0
    timeout_s: float = 0.0

    @property
    def resumed_correctly(self) -> bool:
        """Resumed from the newest committed step (never step 0 when something was committed)."""
        return self.resumed_from_step is not None and self.resumed_from_step == self.expected_resume_step

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"resumed_correctly": self.resumed_correctly}


@dataclass
class Series:
    """``--repeat N``: the drills in order, and what an operator asks of them."""

    results: list[DrillResult] = field(default_factory=list)

    @property
    def succeeded(self) -> int:
        return sum(1 for r in self.results if r.outcome == "recovered" and (r.drill == "store-outage" or r.resumed_correctly))

    def restart_times(self) -> list[float]:
        return [r.restart_s for r in self.results if r.restart_s is not None]

    def summary(self) -> dict[str, Any]:
        times = self.restart_times()
        return {
            "drills": len(self.results),
            "succeeded": self.succeeded,
            "median_restart_s": round(statistics.median(times), 3) if times else None,
            "worst_restart_s": max(times) if times else None,
            "drill_ids": [r.drill_id for r in self.results],
        }


def drill_key(run_id: str, drill_id: str) -> str:
    return f"{runstore.run_prefix(run_id)}/drills/{drill_id}.json"


# -- the target ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    run_id: str
    node: str | None
    survivors: list[str]
    spec: dict[str, Any]


def _select(state: ClusterState, kind: str, node: str | None, run: str | None) -> _Target:
    """Validate the target; change nothing."""
    if kind not in KINDS:
        raise UsageError(f"unknown drill {kind!r} (one of: {', '.join(KINDS)})", field="KIND")
    cluster_nodes = [n["name"] for n in state.read()["nodes"]]
    if node is not None and node not in cluster_nodes:
        raise UsageError(f"no node {node!r} in cluster {state.name!r} (nodes: {', '.join(cluster_nodes)})",
                         field="--node")
    # A drill measures recovery through the store: with the store down it would strike blind.
    store = store_for(state)
    store.ping()
    runs = launcher.running_nodes(state)
    if run is None:
        if not runs:
            raise StateError(
                f"no run is running on cluster {state.name!r}; start one with `infractl train RUN.yaml --detach`"
            )
        if len(runs) > 1:
            raise UsageError(f"several runs are running on cluster {state.name!r} ({', '.join(sorted(runs))}); "
                             "pick one with --run", field="--run")
        run = next(iter(runs))
    elif run not in runs:
        raise StateError(f"run {run!r} is not running on cluster {state.name!r}", field="--run")
    live = [n for n in cluster_nodes if n in runs[run]]
    record = runstore.read_run_record(store, run)
    if record is None or "spec" not in record:
        raise StateError(f"run {run!r} has no run.json with its spec in the store of cluster {state.name!r}")
    spec = record["spec"]
    if kind == "store-outage":
        return _Target(run, None, live, spec)
    if node is None:
        node = live[-1]
    elif node not in live:
        raise StateError(f"node {node!r} runs no process of run {run!r} (running on: {', '.join(live)})",
                         field="--node")
    survivors = [n for n in live if n != node]
    minimum = int(spec["nodes"]["min"])
    if kind in _NODE_LEAVES and len(survivors) < minimum:
        raise UsageError(f"{kind} on {node!r} would leave {len(survivors)} node(s) running run {run!r}, "
                         f"fewer than its nodes.min ({minimum})", field="--node")
    return _Target(run, node, survivors, spec)


# -- what the store shows ----------------------------------------------------------------------


class _Commits:
    """Every commit of the run seen since the drill began (step -> its manifest).

    Retention deletes old steps within seconds on a fast run, so commits are polled often and
    remembered: which step was the newest committed one at a given moment is then known even
    after it is gone from the store.
    """

    def __init__(self, store: Store, run_id: str) -> None:
        self.store, self.run_id = store, run_id
        self.seen: dict[int, Manifest] = {}

    def poll(self) -> None:
        for step in runstore.committed_steps(self.store, self.run_id):
            if step not in self.seen and (manifest := runstore.read_manifest(self.store, self.run_id, step)):
                self.seen[step] = manifest

    def since(self, when: float) -> list[Manifest]:
        """Commits later than ``when``, oldest first."""
        return sorted((m for m in self.seen.values() if m.created > when), key=lambda m: m.created)

    def newest_before(self, when: float) -> int | None:
        steps = [step for step, m in self.seen.items() if m.created < when]
        return max(steps) if steps else None


def _uploading_step(store: Store, run_id: str, after: int) -> int | None:
    """A step newer than ``after`` with files in the store and no COMMITTED yet."""
    dirs = runstore.step_objects(store, run_id)
    pending = [step for step, names in dirs.items() if step > after and names and "COMMITTED" not in names]
    return min(pending) if pending else None


# -- faults --------------------------------------------------------------------------------------


def _workers(procs: list[psutil.Process]) -> list[psutil.Process]:
    def is_agent(p: psutil.Process) -> bool:
        try:
            return "torch.distributed.run" in p.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return True  # gone: not a worker to watch

    return [p for p in procs if not is_agent(p)]


def _agents(procs: list[psutil.Process]) -> list[psutil.Process]:
    workers = {p.pid for p in _workers(procs)}
    return [p for p in procs if p.pid not in workers]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


# -- one drill -----------------------------------------------------------------------------------


def run_drill(
    state: ClusterState,
    kind: str,
    *,
    node: str | None = None,
    run: str | None = None,
    seconds: float = 10.0,
    timeout: float = 600.0,
    wait_finish: bool = True,
    progress: Progress = lambda _msg: None,
) -> DrillResult:
    """Inject one ``kind`` fault into a running job, measure its recovery, record the result."""
    target = _select(state, kind, node, run)
    store = store_for(state)
    run_id, spec = target.run_id, target.spec
    deadline = time.monotonic() + timeout
    drill_id = f"{kind}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(3)}"
    fault: dict[str, Any] = {}

    commits = _Commits(store, run_id)
    commits.poll()
    # Everything slow to look up is looked up before the fault: kill-during-checkpoint must
    # strike within the moment between a step's upload and its commit.
    latest = runstore.latest_metrics(store, run_id)
    step_at_fault = int(latest["step"]) if latest else None
    world_before = int(latest["world_size"]) if latest and "world_size" in latest else None
    workers = _workers(proc.find(state.dir, run=run_id))
    victims = proc.find(state.dir, node=target.node, run=run_id) if target.node else []
    victim_pids = {p.pid for p in victims}
    take_down = store.outage() if kind == "store-outage" else None  # refused here if it cannot be
    if kind == "kill-during-checkpoint":
        partial = None
        while partial is None:
            if time.monotonic() >= deadline:
                raise StateError(f"run {run_id!r} uploaded no checkpoint within --timeout {timeout:g}s")
            # After a first commit, so the drill shows a resume from it and not from step 0.
            partial = _uploading_step(store, run_id, max(commits.seen)) if commits.seen else None
            if partial is None:
                time.sleep(_PROC_POLL_S)
                commits.poll()
        fault["partial_step"] = partial
    last_committed = max(commits.seen, default=0)

    fault_time = time.time()
    outage: contextlib.ExitStack | None = None
    if kind in ("kill-node", "kill-during-checkpoint"):
        proc.kill(victims)
        watched = [p for p in workers if p.pid not in victim_pids]
        fault["signal"] = "SIGKILL"
    elif kind == "hang-node":
        stopped = _workers(victims)
        proc.kill(stopped, signal.SIGSTOP)
        watched = workers
        fault |= {"signal": "SIGSTOP", "processes": len(stopped)}
    elif kind == "preempt":
        proc.kill(_agents(victims), signal.SIGTERM)
        watched = workers
        fault |= {"signal": "SIGTERM", "grace_s": spec.get("preemption", {}).get("grace_s")}
    else:
        assert take_down is not None
        outage = contextlib.ExitStack()
        fault |= outage.enter_context(take_down) | {"seconds": seconds}
        watched = []
    where = f"node {target.node!r}" if target.node else "the store"
    progress(f"{kind}: fault on {where} of run {run_id!r} at step {step_at_fault}, last committed step {last_committed}")

    result = DrillResult(
        drill_id=drill_id, drill=kind, run_id=run_id, cluster=state.name, node=target.node,
        survivors=target.survivors, fault_time=fault_time, fault=fault, step_at_fault=step_at_fault,
        last_committed_step=last_committed, world_size_at_fault=world_before, steps=int(spec["steps"]),
        timeout_s=timeout,
    )
    try:
        if kind in ("kill-node", "kill-during-checkpoint") and proc.wait_gone(
            state.dir, node=target.node, run=run_id, timeout=_GONE_TIMEOUT_S
        ):
            raise StateError(f"node {target.node!r}: processes of run {run_id!r} survived SIGKILL for {_GONE_TIMEOUT_S:g}s")
        _observe(state, result, commits, watched=watched, outage=outage, seconds=seconds, deadline=deadline,
                 wait_finish=wait_finish, progress=progress)
        if wait_finish and result.final_committed:
            # The last commit comes just before the processes exit: the drill ends with the run.
            proc.wait_gone(state.dir, run=run_id, timeout=_GONE_TIMEOUT_S)
    finally:
        if outage is not None:
            outage.close()
        if kind == "hang-node":
            # Whatever the watchdog did not kill must not stay stopped forever.
            proc.kill([p for p in victims if _alive(p)], signal.SIGCONT)
    if "partial_step" in fault:
        # Killed after every rank's shards were uploaded and gathered, the step still commits
        # (nothing of it is missing); killed before, it never does and is never loaded.
        fault["partial_step_committed"] = fault["partial_step"] in commits.seen
    newest = runstore.latest_metrics(store, run_id)
    result.final_step = int(newest["step"]) if newest else None
    result.finished_time = time.time()
    store.put_bytes(drill_key(run_id, result.drill_id), json.dumps(result.to_dict(), indent=1).encode())
    return result


def _observe(state: ClusterState, result: DrillResult, commits: _Commits, *, watched: list[psutil.Process],
             outage: contextlib.ExitStack | None, seconds: float, deadline: float, wait_finish: bool,
             progress: Progress) -> None:
    """Poll processes and store until the run recovered (and finished, with ``wait_finish``)."""
    run_id, fault_time = result.run_id, result.fault_time
    back_time: float | None = None
    recovered = False
    next_commits = next_metrics = 0.0
    while time.monotonic() < deadline:
        if outage is not None and back_time is None and time.time() - fault_time >= seconds:
            outage.close()
            back_time = time.time()
            progress(f"store is back after {back_time - fault_time:.1f}s")
        if result.detect_s is None and watched and not all(_alive(p) for p in watched):
            result.detect_s = round(time.time() - fault_time, 3)
        if time.monotonic() < next_commits or (outage is not None and back_time is None):
            time.sleep(_PROC_POLL_S)
            continue
        next_commits = time.monotonic() + _COMMIT_POLL_S
        commits.poll()
        committed = max(commits.seen, default=0)
        if recovered and (not wait_finish or committed >= result.steps):
            result.final_committed = committed >= result.steps
            result.outcome = "recovered"
            return
        if time.monotonic() < next_metrics:
            continue
        # Metrics records and the /proc scan cost more than a listing of commits: less often.
        next_metrics = time.monotonic() + _STORE_POLL_S
        if not recovered:
            recovered = _recovered(commits, result, back_time)
            if recovered:
                if result.drill == "preempt":
                    _emergency_checkpoint(commits, result)
                progress(f"recovered: {_describe(result)}")
                continue
        if not proc.find(state.dir, run=run_id):
            commits.poll()
            result.final_committed = max(commits.seen, default=0) >= result.steps
            result.outcome = "recovered" if recovered and result.final_committed else "failed"
            return


def _recovered(commits: _Commits, result: DrillResult, back_time: float | None) -> bool:
    """Fill in the resume fields once the store shows recovery; True then."""
    if result.drill == "store-outage":
        after = commits.since(back_time or result.fault_time)
        if not after:
            return False
        result.restart_s = round(after[0].created - result.fault_time, 3)
        return True
    records = [r for r in runstore.read_metrics(commits.store, result.run_id)
               if float(r.get("time", 0)) > result.fault_time and "environment" in r]
    if not records:
        return False
    first = min(records, key=lambda r: float(r["time"]))
    result.restart_s = round(float(first["time"]) - result.fault_time, 3)
    result.resumed_from_step = int(first["step"]) - 1
    result.expected_resume_step = commits.newest_before(float(first["time"])) or 0
    result.world_size_after = first.get("world_size")
    if result.step_at_fault is not None:
        # step_at_fault may trail the ranks (see the module doc): a resume from a step saved
        # after the fault (preemption) lost nothing, not a negative amount.
        result.lost_work_steps = max(0, result.step_at_fault - result.resumed_from_step)
    return True


def _emergency_checkpoint(commits: _Commits, result: DrillResult) -> None:
    """The checkpoint saved on the preemption notice: committed after the fault with reason
    ``preemption``, or the save of that very step that was already in flight (reason
    ``scheduled``) if the run resumed from a step committed after the fault."""
    after = commits.since(result.fault_time)
    chosen = next((m for m in after if m.extra.get("reason") == "preemption"), None)
    if chosen is None:
        chosen = next((m for m in after if m.step == result.resumed_from_step), None)
    if chosen is not None:
        result.emergency_checkpoint_step = chosen.step
        result.emergency_checkpoint_s = round(chosen.created - result.fault_time, 3)


def _describe(r: DrillResult) -> str:
    if r.drill == "store-outage":
        return f"first commit after the outage {r.restart_s}s after the fault"
    return (f"resumed from step {r.resumed_from_step} (last committed {r.expected_resume_step}) on world size "
            f"{r.world_size_after}, {r.restart_s}s after the fault")


# -- a series --------------------------------------------------------------------------------


def run_series(
    state: ClusterState,
    kind: str,
    repeat: int,
    *,
    node: str | None = None,
    run: str | None = None,
    seconds: float = 10.0,
    timeout: float = 600.0,
    wait_finish: bool = True,
    progress: Progress = lambda _msg: None,
) -> Series:
    """``repeat`` drills in a row on one run; a node a fault removed rejoins before the next one.

    Each drill waits only for recovery; with ``wait_finish`` the last also waits for the run to
    finish. Stops early if a drill does not recover (the run is then in no state for the next).
    """
    target = _select(state, kind, node, run)
    budget = int(target.spec["max_restarts"])
    if repeat > budget:
        raise UsageError(f"{repeat} drills need max_restarts >= {repeat} in run {target.run_id!r} "
                         f"(it is {budget}): every fault costs the surviving agents one restart", field="--repeat")
    series = Series()
    for i in range(repeat):
        last = i == repeat - 1
        progress(f"drill {i + 1}/{repeat}")
        result = run_drill(state, kind, node=target.node, run=target.run_id, seconds=seconds, timeout=timeout,
                           wait_finish=last and wait_finish, progress=progress)
        series.results.append(result)
        if result.outcome != "recovered":
            break
        if kind in _NODE_LEAVES and not last:
            _rejoin(state, store_for(state), result, timeout=timeout, progress=progress)
            store_for(state).put_bytes(drill_key(result.run_id, result.drill_id),
                                       json.dumps(result.to_dict(), indent=1).encode())
            if result.rejoin_s is None:
                break
    return series


def _rejoin(state: ClusterState, store: Store, result: DrillResult, *, timeout: float, progress: Progress) -> None:
    """Bring the drill's node back and wait until a step runs on the whole world again."""
    assert result.node is not None
    proc.wait_gone(state.dir, node=result.node, run=result.run_id, timeout=_GONE_TIMEOUT_S)
    started = time.time()
    launcher.rejoin(state, result.node, run=result.run_id)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        grown = [r for r in runstore.read_metrics(store, result.run_id)
                 if float(r.get("time", 0)) > started and r.get("world_size") == result.world_size_at_fault]
        if grown:
            result.rejoin_s = round(min(float(r["time"]) for r in grown) - started, 3)
            progress(f"node {result.node!r} rejoined: world size {result.world_size_at_fault} again after {result.rejoin_s}s")
            return
        if not proc.find(state.dir, run=result.run_id):
            return
        time.sleep(_STORE_POLL_S)
