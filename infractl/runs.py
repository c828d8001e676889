"""Which run, which node, what state a run is in, and the rows of ``infractl status``: the
control plane's questions about runs, answered one way for every caller (the CLI, the launcher,
drills and status).

"The run" of a command that acts on a running job (drill, rejoin) is the run named by ``--run``
if it is running, else the one run that is running. Commands that read a run's past (logs) take
the run that is running, else the run of this cluster whose latest attempt started last, by the
run records in the store: the store is the source of truth, not files on this machine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import ValidationError

from infractl import providers, runstore, workdir
from infractl.config import RunSpec
from infractl.errors import StateError, StoreError, UsageError
from infractl.handover import runbooks
from infractl.node import Node
from infractl.providers import NodeControl
from infractl.runstore import RunRecord, StepRecord
from infractl.servers import rendezvous_running
from infractl.statedir import ClusterState
from infractl.store import Store, for_cluster

__all__ = [
    "LOG_TAIL_BYTES",
    "Attention",
    "RunState",
    "attention",
    "node",
    "running",
    "running_run",
    "latest_run",
    "cluster_runs",
    "full_world",
    "run_state",
    "status",
]

RunState = Literal["running", "restarting", "completed", "failed", "stopped"]


def node(state: ClusterState, name: str, *, field: str) -> Node:
    """Node ``name`` of the cluster; ``UsageError`` naming ``field`` and the nodes there are."""
    nodes = state.record().nodes
    for entry in nodes:
        if entry.name == name:
            return entry
    names = ", ".join(n.name for n in nodes)
    raise UsageError(f"no node {name!r} in cluster {state.name!r} (nodes: {names})", field=field)


def running(state: ClusterState) -> dict[str, set[str]]:
    """run id -> the nodes with live processes of it."""
    return providers.control(state).running_runs()


def running_run(state: ClusterState, run: str | None, *, field: str = "--run") -> tuple[str, set[str]]:
    """The run a command acts on while it runs, and the nodes running it: ``run`` when it is
    running, else the one run that is running (refused when none is, or several are)."""
    live = running(state)
    if run is None:
        if not live:
            raise StateError(
                f"no run is running on cluster {state.name!r}; start one with `infractl train RUN.yaml --detach`"
            )
        if len(live) > 1:
            raise UsageError(
                f"several runs are running on cluster {state.name!r} ({', '.join(sorted(live))}); pick one",
                field=field,
            )
        run = next(iter(live))
    elif run not in live:
        raise StateError(f"run {run!r} is not running on cluster {state.name!r}", field=field)
    return run, live[run]


def cluster_runs(state: ClusterState, store: Store) -> list[RunRecord]:
    """The run records of this cluster's runs in the store, by run id."""
    records = (runstore.read_run_record(store, run_id) for run_id in runstore.list_runs(store))
    return [r for r in records if r is not None and r.cluster == state.name]


def latest_run(state: ClusterState, store: Store) -> str:
    """The run that is running (if exactly one), else the run whose latest attempt started last."""
    live = running(state)
    if len(live) == 1:
        return next(iter(live))
    launched = [r for r in cluster_runs(state, store) if r.last_attempt is not None]
    if not launched:
        raise StateError(f"no run has been launched on cluster {state.name!r}")
    return max(launched, key=lambda r: r.last_attempt.started if r.last_attempt else 0.0).run_id


def run_state(
    record: RunRecord, *, is_running: bool, training: bool, last_committed: int | None, steps: int | None
) -> RunState:
    """running while it has processes and workers among them (``training``); restarting while its
    agents have no workers (between two worker groups: a node left or came back, a worker
    failed); completed once its last step is committed; failed when its last attempt ended
    without that; stopped otherwise (killed, or never followed to the end)."""
    if is_running:
        return "running" if training else "restarting"
    if steps is not None and (last_committed or 0) >= steps:
        return "completed"
    attempt = record.last_attempt
    if attempt is not None and attempt.outcome == "failed":
        return "failed"
    return "stopped"


#: Seconds a metrics chunk may take to reach the store after its step (trainer/metrics.py writes
#: one every 2 s), plus slack for a slow store.
_METRICS_DELAY_S = 10.0
#: What a rank's error says when the device ran out of memory (trainer/train.py logs it in the
#: `stopped reason=crashed` line). The kernel's OOM killer leaves no line: that is a node failure.
_OOM_MARKERS = (b"OutOfMemoryError", b"out of memory")
LOG_TAIL_BYTES = 64 * 1024


@dataclass(frozen=True)
class Attention:
    """Why a run needs a person, and the runbook (reference.RUNBOOKS) that tells what to do."""

    condition: Literal["failed", "degraded", "stalled"]
    why: str
    runbook: str


def full_world(nodes_max: int, nodes: int, processes_per_node: int) -> int:
    """The ranks a run trains on when nothing is missing: its ``nodes.max`` nodes, or all the
    ``nodes`` it runs on when they are fewer, of ``processes_per_node`` ranks each."""
    return min(nodes_max, nodes) * processes_per_node


def attention(
    spec: RunSpec,
    state: RunState,
    *,
    newest: StepRecord | None,
    live_nodes: int,
    cluster_nodes: int,
    processes_per_node: int,
    started: float | None,
    log_tails: list[bytes],
    now: float,
    unreachable: Sequence[str] = (),
) -> Attention | None:
    """A failed run (its last attempt ended short of its last step), a degraded one (running on
    fewer nodes or ranks than ``nodes.max``, or than all ``cluster_nodes`` when they are fewer) or
    a stalled one (running, and no step recorded for longer than the watchdog allows one step);
    None for a run that needs nobody. ``started``: when its last attempt started; ``log_tails``:
    the end of each of its node logs (``LOG_TAIL_BYTES``), read for a device out-of-memory error;
    ``unreachable``: the nodes the control plane cannot reach either, which make a degraded run a
    connection loss rather than a node failure."""
    if state == "failed":
        if any(marker in tail for tail in log_tails for marker in _OOM_MARKERS):
            return Attention("failed", "a rank ran out of device memory", "out-of-memory")
        return Attention("failed", "every node's agent gave up before the last step", "node-failure")
    if state not in ("running", "restarting"):  # a restart that waits for a missing node needs a person too
        return None
    # A missing node comes first: the survivors may wait for it in the rendezvous (a stall too).
    full_nodes = min(spec.nodes.max, cluster_nodes)
    world = full_world(spec.nodes.max, cluster_nodes, processes_per_node)
    lost, cut = ("connection-loss", f"; {', '.join(unreachable)} unreachable") if unreachable else ("node-failure", "")
    if live_nodes < full_nodes:
        return Attention("degraded", f"running on {live_nodes} of {full_nodes} nodes{cut}", lost)
    if newest is not None and newest["world_size"] < world:
        return Attention("degraded", f"world size {newest['world_size']} of {world}{cut}", lost)
    step_time = newest["step_time_s"] if newest else 0.0
    limit = spec.watchdog.step_timeout_s + spec.log_every * step_time + _METRICS_DELAY_S
    # A step of an earlier attempt says nothing of this one: count from the later of the two.
    since = max((t for t in (newest["time"] if newest else None, started) if t is not None), default=None)
    if since is not None and now - since > limit:
        return Attention("stalled", f"no step recorded for {now - since:.0f} s (limit {limit:.0f} s)", "hung-job")
    return None


def status(state: ClusterState) -> dict[str, Any]:
    """What ``infractl status`` shows of a cluster that is up: the cluster, its rendezvous server,
    its nodes with their live processes, and every run of it in the store with its state, last
    committed step, newest metrics and, for a run that needs a person, where its runbook section
    is. With the store unreachable, the runs are what the nodes' processes tell, and the store's
    entry says so and where the store-outage runbook is."""
    record = state.record()
    control = providers.control(state)
    nodes, live, training = _node_rows(record.nodes, control)
    store_status: dict[str, Any] = {"uri": record.store, "reachable": True, "error": None}
    try:
        rows = _run_rows(state, for_cluster(state), control, live, training)
    except StoreError as exc:
        store_status |= {
            "reachable": False,
            "error": exc.message,
            "runbook": runbooks.section(state, "store-outage", None),
        }
        rows = _running_rows(live)
    return {
        "cluster": record.name,
        "provider": record.spec.provider,
        "store": store_status,
        "rendezvous": {**asdict(record.rendezvous), "running": rendezvous_running(state)},
        # What the nodes run the trainer in (pulled by digest at `up`); None: their own Python.
        "image": record.image,
        "nodes": nodes,
        "runs": rows,
    }


def _node_rows(
    cluster_nodes: Sequence[Node], control: NodeControl
) -> tuple[list[dict[str, Any]], dict[str, set[str]], set[str]]:
    """Each node with how many processes of the cluster it runs (None: it did not answer), run id
    -> the nodes running it, and the runs with workers (a run with agents alone is restarting)."""
    processes = control.processes()
    live: dict[str, set[str]] = {}
    for p in processes:
        if p.run is not None:
            live.setdefault(p.run, set()).add(p.node)
    rows = [
        {
            **n.record(),
            "live_processes": None if n.name in control.unreachable else sum(1 for p in processes if p.node == n.name),
        }
        for n in cluster_nodes
    ]
    return rows, live, {p.run for p in processes if p.run is not None and p.worker}


def _run_rows(
    state: ClusterState, store: Store, nodes: NodeControl, live: dict[str, set[str]], training: set[str]
) -> list[dict[str, Any]]:
    """Every run of the cluster: its state, attempts, last committed step, newest metrics, and
    the runbook section of a run that needs a person (failed, degraded or stalled). ``live``: run
    -> the nodes running it; ``training``: the runs with workers."""
    rows = []
    for record in cluster_runs(state, store):
        try:
            spec: RunSpec | None = RunSpec.model_validate(record.spec)
        except ValidationError:
            spec = None  # a record without a valid spec (written by another version): still listed
        steps = spec.steps if spec else None
        committed = runstore.committed_steps(store, record.run_id)
        last = committed[-1] if committed else None
        latest = runstore.latest_metrics(store, record.run_id)
        current = run_state(
            record,
            is_running=record.run_id in live,
            training=record.run_id in training,
            last_committed=last,
            steps=steps,
        )
        needs = (
            attention(
                spec,
                current,
                newest=latest,
                live_nodes=len(live.get(record.run_id, ())),
                cluster_nodes=len(nodes.nodes),
                processes_per_node=next(iter(nodes.nodes.values())).processes,
                started=record.last_attempt.started if record.last_attempt else None,
                log_tails=_log_tails(nodes, record.run_id) if current == "failed" else [],
                now=time.time(),
                unreachable=sorted(nodes.unreachable),
            )
            if spec
            else None
        )
        rows.append(
            {
                "run": record.run_id,
                "state": current,
                "attempts": len(record.attempts),
                "steps": steps,
                "last_committed_step": last,
                "committed_steps": committed,
                "last_step": latest["step"] if latest else None,
                "loss": latest["loss"] if latest else None,
                "world_size": latest["world_size"] if latest else None,
                "attention": None
                if not needs
                else {
                    "condition": needs.condition,
                    "why": needs.why,
                    **runbooks.section(state, needs.runbook, record.run_id),
                },
            }
        )
    return rows


def _log_tails(nodes: NodeControl, run: str) -> list[bytes]:
    return [
        nodes.tail_bytes(name, workdir.run_log(node.workdir, run), size=LOG_TAIL_BYTES)
        for name, node in nodes.nodes.items()
    ]


def _running_rows(live: dict[str, set[str]]) -> list[dict[str, Any]]:
    """Without the store, what the processes show: each run that runs, and on which nodes."""
    return [
        {
            "run": run_id,
            "state": "running",
            "nodes": sorted(nodes),
            "attempts": None,
            "steps": None,
            "last_committed_step": None,
            "committed_steps": None,
            "last_step": None,
            "loss": None,
            "world_size": None,
            "attention": None,
        }
        for run_id, nodes in sorted(live.items())
    ]
