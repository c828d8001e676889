"""``infractl drill chaos``: a seeded series of random faults against one running run, then the
finished run compared with an uninterrupted reference run of the same spec.

The series is drawn before the first fault (``plan_chaos``, which changes nothing): for each
fault, from ``random.Random(seed)``, the kind (among those the cluster can take), the node (any
node the run runs on, node-0 included), the moment (``delay_s``: seconds after the run was whole
again, between ``min_gap`` and twice that) and, for a partition, the link fault. Each fault draws
the same four numbers whatever it uses, so one seed, count, kind list and node list always give the
same series: ``--plan`` prints it without striking, and the record keeps it.

``run_chaos`` strikes the faults in order. Each is an ordinary drill (``run_drill``, recorded in
``drills/``); a node the fault removed rejoins, and the next fault waits until the run is whole
again and ``delay_s`` has passed. The series stops at the first fault the run does not recover
from. Then it waits for the run to finish, trains the reference (``<run>-reference``: the same
spec without its pace, ``min_step_s``, uninterrupted, on the same cluster; reused when the store
has it finished) unless one is given, and compares the two (``compare``). The series is
recorded in ``chaos/<series-id>.json`` from the start, updated after every fault.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from infractl import launcher, providers, runstore
from infractl.config import RunSpec, derive_run
from infractl.config.loader import validate
from infractl.drill import recovery
from infractl.drill.compare import compare_runs
from infractl.drill.kind import KINDS, Progress, kind_named
from infractl.drill.run import select
from infractl.drill.series import Series, drill_whole_again, whole_again
from infractl.errors import InfractlError, StateError, UsageError
from infractl.runstore import ChaosRecord
from infractl.statedir import ClusterState
from infractl.store import Store, for_cluster

__all__ = ["ChaosPlan", "Fault", "draw", "plan_chaos", "run_chaos"]

#: Link faults a partition of the series draws from: both break the collectives across the cut.
#: (``delay`` only slows them: there would be nothing to recover from.)
_LINKS = ("down", "drop")
#: The kind that strikes the store, not a node: it costs the run no restart.
_NO_RESTART = "store-outage"
_REFERENCE_SUFFIX = "-reference"
# What a reference run may differ in from the run it stands for: it trains the same weights.
_UNTRAINED = {"name", "min_step_s"}


@dataclass(frozen=True)
class Fault:
    """One drawn fault of a series."""

    index: int  # 1-based
    kind: str
    node: str | None  # None: the store
    delay_s: float  # after the run is whole again
    seconds: float | None  # how long a timed fault lasts
    options: dict[str, Any]  # the kind's own (partition: link)

    def describe(self) -> str:
        where = f" on {self.node}" if self.node else ""
        extra = "".join(f" {k}={v}" for k, v in self.options.items())
        lasting = f" for {self.seconds:g}s" if self.seconds else ""
        return f"{self.kind}{where}{extra}{lasting}, {self.delay_s:g}s after the run is whole"


@dataclass(frozen=True)
class ChaosPlan:
    """A drawn series against a run, checked against the run and the cluster; nothing struck yet."""

    run_id: str
    spec: RunSpec
    nodes: list[str]
    kinds: list[str]
    seed: int
    min_gap: float
    faults: list[Fault]
    reference: str | None  # a finished reference run given by the caller


def draw(seed: int, count: int, kinds: list[str], nodes: list[str], *, min_gap: float, spec: RunSpec) -> list[Fault]:
    """The series of ``count`` faults that ``seed`` gives over ``kinds`` and ``nodes`` against a
    run of ``spec`` (a timed fault lasts ``Kind.series_seconds``)."""
    rng = random.Random(seed)
    faults = []
    for index in range(1, count + 1):
        # Four uniform numbers per fault, whatever it uses of them (``choice`` would draw more or
        # fewer bits by the list's length): one list of kinds or another, the same moments.
        u_kind, u_node, gap, u_link = rng.random(), rng.random(), rng.random(), rng.random()
        kind_name, node, link = _pick(kinds, u_kind), _pick(nodes, u_node), _pick(_LINKS, u_link)
        kind = KINDS[kind_name]
        faults.append(
            Fault(
                index=index,
                kind=kind_name,
                node=node if kind.targets_node else None,
                delay_s=round(min_gap * (1 + gap), 1),
                seconds=kind.series_seconds(spec) if kind.timed else None,
                options={"link": link} if kind_name == "partition" else {},
            )
        )
    return faults


def _pick(items: Sequence[str], u: float) -> str:
    """The item a uniform ``u`` in [0, 1) falls on."""
    return items[min(int(u * len(items)), len(items) - 1)]


def plan_chaos(
    state: ClusterState,
    *,
    count: int,
    seed: int,
    kinds: list[str] | None = None,
    min_gap: float = 5.0,
    run: str | None = None,
    reference: str | None = None,
) -> ChaosPlan:
    """Check the run, the kinds and the reference, and draw the series; change nothing."""
    target = select(state, kind_named(_NO_RESTART), None, run)
    store = for_cluster(state)
    spec = _spec(target.spec, target.run_id)
    if not spec.deterministic:
        raise UsageError(
            f"run {target.run_id!r} is not deterministic: a chaos series compares it with a reference run bit for "
            "bit; set `deterministic: true` in its run.yaml",
            field="deterministic",
        )
    nodes = sorted(target.survivors)  # every node the run runs on
    offered = _offered(state, store, spec, nodes)
    if kinds:
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            raise UsageError(f"unknown kind {unknown[0]!r} (one of: {', '.join(sorted(KINDS))})", field="--kinds")
        refused = {k: offered[k] for k in kinds if offered[k] is not None}
        if refused:
            name, why = next(iter(refused.items()))
            raise UsageError(f"{name} cannot strike run {target.run_id!r}: {why}", field="--kinds")
    chosen = sorted(set(kinds)) if kinds else [k for k in sorted(offered) if offered[k] is None]
    faults = draw(seed, count, chosen, nodes, min_gap=min_gap, spec=spec)
    restarts = sum(1 for f in faults if f.kind != _NO_RESTART)
    if restarts > spec.max_restarts:
        raise UsageError(
            f"seed {seed} draws {restarts} faults that each cost the surviving agents a restart; run "
            f"{target.run_id!r} allows max_restarts {spec.max_restarts}: raise it or lower --count",
            field="--count",
        )
    if reference is not None:
        _check_reference(store, reference, spec)
    return ChaosPlan(target.run_id, spec, nodes, chosen, seed, min_gap, faults, reference)


def run_chaos(state: ClusterState, plan: ChaosPlan, *, timeout: float, progress: Progress) -> ChaosRecord:
    """Strike ``plan``'s faults in order, then compare the finished run with its reference."""
    store = for_cluster(state)
    record = ChaosRecord(
        series_id=f"chaos-{plan.seed}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(3)}",
        run_id=plan.run_id,
        cluster=state.name,
        seed=plan.seed,
        count=len(plan.faults),
        kinds=plan.kinds,
        min_gap_s=plan.min_gap,
        plan=[asdict(f) for f in plan.faults],
        started=time.time(),
    )
    runstore.write_chaos_record(store, record)
    series = Series()
    for fault in plan.faults:
        record.stopped = _strike(state, plan, fault, series, timeout=timeout, progress=progress)
        _summarize(record, series)
        runstore.write_chaos_record(store, record)
        if record.stopped is not None:
            break
    if record.stopped is None:
        record.stopped = _finish(state, store, plan, record, timeout=timeout, progress=progress)
    record.finished = time.time()
    runstore.write_chaos_record(store, record)
    return record


def _strike(
    state: ClusterState, plan: ChaosPlan, fault: Fault, series: Series, *, timeout: float, progress: Progress
) -> str | None:
    """Wait for the fault's moment, strike it and see the run whole again; why the series
    stops here, or None."""
    where = f"fault {fault.index}/{len(plan.faults)} ({fault.kind}{f' on {fault.node}' if fault.node else ''})"
    progress(f"chaos {fault.index}/{len(plan.faults)}: {fault.describe()}")
    if not _still_running(state, plan.run_id, fault.delay_s):
        return f"run {plan.run_id!r} ended before {where}: give it more steps"
    try:
        result = drill_whole_again(
            state,
            fault.kind,
            node=fault.node,
            run=plan.run_id,
            seconds=fault.seconds or 0.0,
            timeout=timeout,
            wait_finish=False,
            rejoin=True,
            progress=progress,
            options=fault.options,
        )
    except InfractlError as exc:
        return f"{where} could not strike: {exc}"
    series.results.append(result)
    recovered = kind_named(result.drill).succeeded(result)
    if recovered and whole_again(result):
        return None
    if (runstore.latest_committed_step(for_cluster(state), plan.run_id) or 0) >= plan.spec.steps:
        return f"run {plan.run_id!r} finished during {where}: give it more steps"
    if not recovered:
        return f"{where}: {result.outcome}, resumed from step {result.resumed_from_step} (drill {result.drill_id})"
    return f"{where}: node {result.node!r} did not rejoin the run (drill {result.drill_id})"


def _summarize(record: ChaosRecord, series: Series) -> None:
    summary = series.summary()
    record.drill_ids = summary["drill_ids"]
    record.recovered = summary["succeeded"]
    record.median_restart_s = summary["median_restart_s"]
    record.worst_restart_s = summary["worst_restart_s"]
    record.lost_steps = sum(r.lost_work_steps or 0 for r in series.results)


def _still_running(state: ClusterState, run_id: str, seconds: float) -> bool:
    """Wait ``seconds``; whether the run still has processes then."""
    with providers.control(state).watch(run_id) as watch:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if watch.gone():
                return False
            time.sleep(recovery.STORE_POLL_S)
        return not watch.gone()


def _finish(
    state: ClusterState, store: Store, plan: ChaosPlan, record: ChaosRecord, *, timeout: float, progress: Progress
) -> str | None:
    """Wait for the run's end, get the reference, compare; why the series failed, or None."""
    progress(f"chaos: {record.recovered}/{record.count} recovered; waiting for run {plan.run_id!r} to finish")
    with providers.control(state).watch(plan.run_id) as watch:
        deadline = time.monotonic() + timeout
        while not watch.gone():
            if time.monotonic() > deadline:
                return f"run {plan.run_id!r} did not finish within --timeout {timeout:g}s after the last fault"
            time.sleep(recovery.STORE_POLL_S)
    last = runstore.latest_committed_step(store, plan.run_id) or 0
    if last < plan.spec.steps:
        return f"run {plan.run_id!r} stopped at committed step {last} of {plan.spec.steps}: see `infractl logs`"
    reference = plan.reference or _reference(state, store, plan.spec, progress)
    comparison = compare_runs(store, plan.run_id, reference)
    record.comparison = comparison.to_dict()
    return None


def _reference(state: ClusterState, store: Store, spec: RunSpec, progress: Progress) -> str:
    """The uninterrupted reference run of ``spec``: ``<run>-reference``, reused when the store has
    it finished, else trained now on the cluster."""
    source = Path(store.location(f"{runstore.run_prefix(spec.name)}/run.json"))
    reference = derive_run(spec, source, suffix=_REFERENCE_SUFFIX, min_step_s=0)  # the pace trains nothing
    try:
        _check_reference(store, reference.name, spec)
        progress(f"chaos: reference run {reference.name!r} is in the store")
        return reference.name
    except StateError:
        pass  # none yet, or not one to trust: trained over
    progress(f"chaos: training the reference run {reference.name!r} ({spec.steps} steps, uninterrupted)")
    launcher.run_to_end(state, reference, source, command="drill chaos", log_format="console")
    _check_reference(store, reference.name, spec)
    return reference.name


def _check_reference(store: Store, reference: str, spec: RunSpec) -> None:
    """``StateError`` unless ``reference`` is a finished, uninterrupted run of ``spec`` but its name
    and pace."""
    record = runstore.read_run_record(store, reference)
    if record is None or record.spec is None:
        raise StateError(f"no run {reference!r} in the store {store.uri}", field="--reference")
    if _spec(record.spec, reference).model_dump(exclude=_UNTRAINED) != spec.model_dump(exclude=_UNTRAINED):
        raise StateError(f"run {reference!r} has another spec than run {spec.name!r}", field="--reference")
    last = runstore.latest_committed_step(store, reference) or 0
    restarted = any(r["restart_count"] for r in runstore.read_metrics(store, reference))
    if len(record.attempts) != 1 or restarted or last < spec.steps:
        raise StateError(
            f"run {reference!r} is not a finished uninterrupted run (one launch, no restart, committed step "
            f"{last} of {spec.steps})",
            field="--reference",
        )


def _offered(state: ClusterState, store: Store, spec: RunSpec, nodes: list[str]) -> dict[str, str | None]:
    """Every kind, and why it cannot strike this run on this cluster (None: it can)."""
    links = [link for link in providers.control(state).link_faults if link in _LINKS]
    why: dict[str, str | None] = {}
    for name, kind in KINDS.items():
        why[name] = None
        if kind.node_leaves and len(nodes) - 1 < spec.nodes.min:
            why[name] = f"it takes a node out, and the run runs on {len(nodes)} with nodes.min {spec.nodes.min}"
        elif name == "partition" and not links:
            why[name] = f"the nodes of provider {state.record().spec.provider!r} have no link to cut off"
        elif name == _NO_RESTART:
            try:
                store.outage()
            except UsageError as exc:
                why[name] = str(exc)
    return why


def _spec(raw: dict[str, Any], run_id: str) -> RunSpec:
    return validate(RunSpec, raw, Path(f"run.json of run {run_id}"))
