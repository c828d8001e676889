"""A fault kind, and what a drill of any kind shares while it runs.

A kind is a small class in ``kinds/`` (one file each) that says how to inject its fault, how to
undo it, and what counts as recovered; ``register`` adds it to ``KINDS`` by name. Everything
else (choosing the target, watching processes and the store, the record, series) is shared.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from infractl import runstore
from infractl.config import RunSpec
from infractl.drill import recovery
from infractl.errors import UsageError
from infractl.proc import NodeProcess
from infractl.providers import NodeControl, Watch
from infractl.runstore import DrillRecord
from infractl.statedir import ClusterState
from infractl.store import Store

__all__ = ["Drill", "Kind", "KindOption", "KINDS", "Progress", "Target", "kind_named", "register"]

Progress = Callable[[str], None]


@dataclass(frozen=True)
class KindOption:
    """A command-line option of one kind's drill (``infractl drill KIND --flag``): its value
    reaches the kind as ``drill.options[name]``."""

    name: str
    flag: str
    help: str
    default: str | int
    choices: tuple[str, ...] = ()
    """The values a text option takes (none: any)."""
    minimum: int | None = None
    maximum: int | None = None


@dataclass(frozen=True)
class Target:
    """What a drill strikes: a run, and a node of it (None for a fault of the store)."""

    run_id: str
    node: str | None
    survivors: list[str]
    spec: dict[str, Any]


@dataclass
class Drill:
    """One drill while it runs: the target, what was looked up before the fault, and what the
    fault did (``fault``, recorded as is)."""

    state: ClusterState
    store: Store
    target: Target
    commits: recovery.Commits
    metrics: runstore.MetricsTail
    nodes: NodeControl
    watch: Watch  # the run's processes on every node, from before the fault
    workers: list[NodeProcess]  # every worker of the run at the fault
    victims: list[NodeProcess]  # the target node's processes of the run
    deadline: float  # time.monotonic() by which the drill gives up
    timeout: float
    seconds: float  # how long a timed fault lasts (store-outage, partition)
    progress: Progress
    options: dict[str, Any] = field(default_factory=dict)  # the kind's own (partition: link, latency_ms)
    fault: dict[str, Any] = field(default_factory=dict)
    watched: list[NodeProcess] = field(default_factory=list)  # whose exit means the job noticed

    @property
    def run_id(self) -> str:
        return self.target.run_id

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


class Kind:
    """A fault kind. A new instance serves each drill, so it may keep that drill's state."""

    name: ClassVar[str]
    help: ClassVar[str]
    #: The fault strikes a node (``--node``); else it strikes the store.
    targets_node: ClassVar[bool] = True
    #: The fault lasts ``--seconds``, then the kind ends it itself (``tick``).
    timed: ClassVar[bool] = False
    #: The struck node is out of the run afterwards: a series rejoins it before the next drill,
    #: and the run's nodes.min must allow it to leave.
    node_leaves: ClassVar[bool] = False
    #: The drill brings the struck node back itself and records ``rejoin_s`` (a series has
    #: nothing to rejoin between drills).
    rejoins: ClassVar[bool] = False
    #: Options of this kind alone, besides every drill's.
    options: ClassVar[tuple[KindOption, ...]] = ()
    #: How long a timed fault lasts unless ``--seconds`` says otherwise.
    seconds: ClassVar[float] = 10.0

    @classmethod
    def series_seconds(cls, spec: RunSpec) -> float:
        """How long a timed fault of a chaos series lasts against a run of ``spec``."""
        return cls.seconds

    def check(self, drill: Drill) -> None:
        """Before anything else, the run's start-up included: refuse what this drill cannot
        strike (its options, a node or store this kind cannot take down). Nothing waits here."""

    def prepare(self, drill: Drill) -> None:
        """Right before the fault: look up whatever the fault needs (may wait)."""

    def inject(self, drill: Drill) -> list[NodeProcess]:
        """Strike; record what was done in ``drill.fault``. Return the processes whose exit is
        the first sign that the job noticed (detect_s), if any."""
        raise NotImplementedError

    def settle(self, drill: Drill) -> None:
        """Right after the fault, before watching (a killed node's processes are gone, say)."""

    def tick(self, drill: Drill, record: DrillRecord) -> None:
        """Called at every poll while watching: a timed fault ends here."""

    def holds_store(self, drill: Drill, record: DrillRecord) -> bool:
        """Called while watching: True while the store must not be polled (it is down)."""
        return False

    def recovered(self, drill: Drill, record: DrillRecord) -> bool:
        """Whether the store shows the run recovered; fill in the record's resume fields then."""
        return recovery.resumed(drill.commits, drill.metrics, record)

    def on_recovered(self, drill: Drill, record: DrillRecord) -> None:
        """Once recovered: anything more to read off the store."""

    def undo(self, drill: Drill) -> None:
        """After watching, whatever happened: leave nothing of the fault behind."""

    def finish(self, drill: Drill, record: DrillRecord) -> None:
        """Last entries in the record, before it is written."""

    def describe(self, record: DrillRecord) -> str:
        """How the run came back, for the drill's line."""
        return (
            f"resumed from step {record.resumed_from_step}{' (a replica)' if record.resumed_from == 'replica' else ''} "
            f"(last committed {record.expected_resume_step}) "
            f"on world size {record.world_size_after}, lost {record.lost_work_steps} step(s)"
        )

    def succeeded(self, record: DrillRecord) -> bool:
        """Recovered, and from the newest committed step or a newer replica."""
        return record.outcome == "recovered" and record.resumed_correctly


KINDS: dict[str, type[Kind]] = {}


def register(kind: type[Kind]) -> type[Kind]:
    """Class decorator: make ``kind`` available by its name."""
    KINDS[kind.name] = kind
    return kind


def kind_named(name: str) -> Kind:
    """A fresh instance of the kind ``name``; ``UsageError`` for an unknown one."""
    if name not in KINDS:
        raise UsageError(f"unknown drill {name!r} (one of: {', '.join(KINDS)})", field="KIND")
    return KINDS[name]()
