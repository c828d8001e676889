"""What a drill watches, and how it turns that into measurements (the drill loop that watches is
``drill.run``'s).

A drill watches only what an operator could: the nodes' processes (through the provider's
``Watch``: a monitor on each node reports the run's processes as they change) and the run's
objects in the store (metrics records, committed checkpoints and their manifests). Times are unix
seconds; ``fault_time`` is taken just before the fault.

``detect_s``
    fault -> the first worker that was running at the fault (and that the drill did not kill
    itself) is gone: the first sign that the job noticed. Each node's monitor sees an exit within
    50 ms and the drill reads its reports every ``PROC_POLL_S`` s, so an upper bound by that much
    (and by the report's way from the node). None when no process needs to die (store-outage).
``stopped_s``
    fault -> every worker that was running at the fault (and that the drill did not kill
    itself) is gone: the survivors' old worker group stopped. None when there is none, or when
    a node whose workers these were stopped reporting (cut off).
``restart_s``
    fault -> the ``time`` of the first step completed by a restarted worker group (the first
    metrics record after the fault that starts a process, ``runstore.starts_a_process``).
    store-outage: fault -> the first checkpoint committed after the store came back.
``phases``
    ``restart_s`` split at the points above and at the restarted rank 0's ``timeline`` (in its
    first metrics record): ``detect`` (fault -> detect_s), ``stop`` (-> stopped_s),
    ``rendezvous`` (-> the new worker process started: the agents' rendezvous round, which
    torchrun follows at once with the workers), ``startup`` (-> the worker process group
    formed: Python, importing torch, the store check, the group's own rendezvous), ``load``
    (-> the model built and the committed checkpoint loaded) and ``first_step`` (-> the first
    step completed). Each phase runs from the last point seen before it; None when its own end
    was not seen. Points come from the nodes' clocks and the drill's, so a phase under 10 ms
    may read 0.
``resumed_from_step``
    that record's step - 1: the step the workers loaded, from the store or (``resumed_from``
    ``replica``) from the agents' memory. ``expected_resume_step`` is the newest step committed
    before that record (from the manifests), and the drill checks that a resume from the store
    loaded exactly that step and one from a replica no older step: a run never resumes from
    anything older than its last committed step.
``lost_work_steps``
    ``step_at_fault - resumed_from_step`` (at least 0): steps trained but not kept.
    ``step_at_fault`` is the newest step in the store at the fault; metrics are flushed every
    few steps or seconds, so it may trail the ranks by that much.
``outcome``
    ``recovered`` once the run recovered (by its kind's measure: a partition's node back in the
    world too) and, when the drill waits for the end, its final checkpoint (``spec.steps``) is
    committed; ``failed`` if every process of the run exited without that; ``timeout``
    otherwise. A run that resumed and committed its final step but ended before its whole world
    was back (a partition's node had not rejoined yet) recovered: ``outcome_note`` says the run
    ended first (``ended``).
"""

from __future__ import annotations

from infractl import runstore
from infractl.proc import NodeProcess
from infractl.runstore import DrillRecord, Manifest
from infractl.store import Store

__all__ = [
    "Commits",
    "GONE_TIMEOUT_S",
    "PHASES",
    "PROC_POLL_S",
    "STORE_POLL_S",
    "agents",
    "ended",
    "resumed",
    "split_restart",
    "uploading_step",
    "workers",
]

PROC_POLL_S = 0.05  # the watch: reading it costs nothing
STORE_POLL_S = 0.5  # metrics records, and whether the run still has processes
GONE_TIMEOUT_S = 30.0
#: A restart's phases, in order (``phases`` in the module doc).
PHASES = ("detect", "stop", "rendezvous", "startup", "load", "first_step")


class Commits:
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

    def newest(self) -> int:
        return max(self.seen, default=0)

    def since(self, when: float) -> list[Manifest]:
        """Commits later than ``when``, oldest first."""
        return sorted((m for m in self.seen.values() if m.created > when), key=lambda m: m.created)

    def newest_before(self, when: float) -> int | None:
        steps = [step for step, m in self.seen.items() if m.created < when]
        return max(steps) if steps else None


def uploading_step(store: Store, run_id: str, after: int) -> int | None:
    """A step newer than ``after`` with files in the store and no COMMITTED yet."""
    dirs = runstore.step_objects(store, run_id)
    pending = [step for step, names in dirs.items() if step > after and names and "COMMITTED" not in names]
    return min(pending) if pending else None


# -- processes ---------------------------------------------------------------------------------


def workers(procs: list[NodeProcess]) -> list[NodeProcess]:
    """The training workers among a node's processes (not its torchrun agent)."""
    return [p for p in procs if p.worker]


def agents(procs: list[NodeProcess]) -> list[NodeProcess]:
    return [p for p in procs if p.agent]


# -- recovery ----------------------------------------------------------------------------------


def resumed(commits: Commits, metrics: runstore.MetricsTail, record: DrillRecord) -> bool:
    """Fill in the resume fields once a restarted worker group completed a step; True then."""
    restarts = [r for r in metrics.records() if r["time"] > record.fault_time and runstore.starts_a_process(r)]
    if not restarts:
        return False
    first = min(restarts, key=lambda r: r["time"])
    record.restart_s = round(first["time"] - record.fault_time, 3)
    record.resumed_from_step = first["step"] - 1
    record.resumed_from = first.get("resumed_from")
    record.expected_resume_step = commits.newest_before(first["time"]) or 0
    record.world_size_after = first["world_size"]
    record.phases = split_restart(record, first.get("timeline", {}))
    if record.step_at_fault is not None:
        # step_at_fault may trail the ranks (see the module doc): a resume from a step saved
        # after the fault (preemption) lost nothing, not a negative amount.
        record.lost_work_steps = max(0, record.step_at_fault - record.resumed_from_step)
    return True


def split_restart(record: DrillRecord, timeline: dict[str, float]) -> dict[str, float | None]:
    """``restart_s`` split into ``PHASES`` (the module doc), given the restarted rank 0's timeline."""

    def after_fault(point: str) -> float | None:
        return timeline[point] - record.fault_time if point in timeline else None

    ends = [
        record.detect_s,
        record.stopped_s,
        after_fault("started"),
        after_fault("joined"),
        after_fault("loaded"),
        record.restart_s,
    ]
    phases: dict[str, float | None] = {}
    previous = 0.0
    for name, end in zip(PHASES, ends, strict=True):
        phases[name] = None if end is None else round(max(0.0, end - previous), 3)
        previous = previous if end is None else max(previous, end)
    return phases


def ended(*, recovered: bool, resumed: bool, final_committed: bool, node: str | None) -> tuple[str, str | None]:
    """The outcome of a drill whose run's processes all exited, and its note (``outcome`` in the
    module doc), from what was seen: whether the run recovered by its kind's measure, whether it
    resumed after the fault (``restart_s``), whether its final step is committed, and the struck
    node. A kind that waits for its node to rejoin (partition) has not recovered until then; a
    run that resumed without the node and committed its final step before the node was back
    recovered all the same: only the rejoin went unseen, and the note says so."""
    if final_committed and recovered:
        return "recovered", None
    if final_committed and resumed:
        waited = f"{node} rejoined" if node is not None else "its whole world was back"
        return "recovered", f"run ended before {waited}"
    return "failed", None
