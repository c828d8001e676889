"""The store's typed records: what each object of a run holds (see the package docstring for
where each lives). Records are JSON; readers accept fields they do not know (a newer writer) and
supply defaults for fields a record lacks (an older writer)."""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, NotRequired, TypedDict, TypeVar

__all__ = [
    "Attempt",
    "ChaosRecord",
    "DrillRecord",
    "Manifest",
    "ManifestEntry",
    "ProfileRequest",
    "Rejoin",
    "RunRecord",
    "SaveReason",
    "StepRecord",
    "starts_a_process",
]


class SaveReason(enum.StrEnum):
    """Why a checkpoint was saved (``Manifest.extra["reason"]``)."""

    SCHEDULED = "scheduled"  # every checkpoint.every steps
    FINAL = "final"  # the last step
    PREEMPTION = "preemption"  # the emergency save on a preemption notice
    REPLICA = "replica"  # held in the agents' memory (checkpoint.replicate_every), never in the store


class StepRecord(TypedDict):
    """One line of ``metrics/*.jsonl``: a training step as rank 0 saw it."""

    step: int
    loss: float
    step_time_s: float  # the training step alone: evaluation and checkpointing are outside it
    tokens_per_s: float
    world_size: int
    attempt: int
    restart_count: int
    time: float
    # The split of step_time_s. The parts need not add up to it: the loss all-reduce for the
    # record is in neither, and comm_s overlaps forward_backward_s (see trainer/metrics.py).
    data_s: float  # fetching the batch and moving it to the device
    forward_backward_s: float  # forward, loss, zero_grad, backward (DDP's all-reduce wait too)
    optimizer_s: float  # gradient clipping, optimizer and LR scheduler step
    comm_s: float | None  # gradient all-reduce window (DDP, zero1); None for fsdp
    # Time the training thread spent in Checkpointer.save (staging, and waiting for the
    # previous save) after this step; 0.0 on steps without a checkpoint. None only in the
    # copy of a checkpoint step's record written before the save.
    checkpoint_blocking_s: float | None
    peak_memory_bytes: int  # CPU: the process's max RSS; CUDA: max memory allocated by torch
    grad_norm: NotRequired[float]  # the global gradient norm before clipping (since log_every)
    # How each data-parallel rank took its share of the global batch at this world size:
    # forward/backward passes of at most micro_batch samples (trainer/mesh.py).
    micro_batch: NotRequired[int]
    accumulation: NotRequired[int]
    val_loss: NotRequired[float]  # on evaluation steps only (run.yaml eval.every)
    # The environment fingerprint, in the first record of every trainer process: the first
    # step after a (re)start. ``starts_a_process`` is how readers ask.
    environment: NotRequired[dict[str, Any]]
    # Beside it, when rank 0's process reached each point of its start (unix seconds): ``started``
    # (the process was created: its agent's rendezvous round had completed), ``joined`` (the
    # worker process group formed), ``loaded`` (the committed checkpoint loaded, or none found).
    timeline: NotRequired[dict[str, float]]
    # Beside them too: what rank 0's process resumed from, ``store`` (the newest commit) or
    # ``replica`` (a newer step from the agents' memory); absent when it started at step 0.
    resumed_from: NotRequired[str]


def starts_a_process(record: StepRecord) -> bool:
    """Whether ``record`` is the first step of a trainer process (a start or a restart)."""
    return "environment" in record


_R = TypeVar("_R")


def _from_dict(cls: type[_R], raw: dict[str, Any]) -> _R:
    """A record dataclass from JSON: unknown keys (a newer writer) are ignored, missing ones
    (an older writer) take their defaults."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in raw.items() if k in names})


@dataclass
class Rejoin:
    """A node started again for a running attempt (``infractl rejoin``)."""

    node: str
    time: float
    pid: int


@dataclass
class Attempt:
    """One launch of a run: the agents started together, and what became of them."""

    attempt: int
    started: float
    resume_from: int
    nodes: list[str]
    rdzv_id: str
    rejoins: list[Rejoin] = field(default_factory=list)
    # Set when a foreground `infractl train` saw every agent exit.
    ended: float | None = None
    exit_codes: dict[str, int] = field(default_factory=dict)
    last_committed_step: int | None = None
    outcome: str | None = None  # "completed" | "failed"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Attempt:
        attempt = _from_dict(cls, raw)
        attempt.rejoins = [_from_dict(Rejoin, r) for r in raw.get("rejoins", [])]
        return attempt

    def rejoins_of(self, node: str) -> int:
        return sum(1 for r in self.rejoins if r.node == node)


@dataclass
class RunRecord:
    """``run.json``: what a run is (its resolved spec) and every attempt to train it."""

    run_id: str
    cluster: str
    dataset_version: str | None = None
    # The unique id of the cluster that launched the run last (its cluster record's ``id``): what
    # `teardown --purge` matches, as two clusters of one name may share a store. None in a record
    # written before runs carried it.
    cluster_id: str | None = None
    spec: dict[str, Any] | None = None  # RunSpec as JSON, set at the first launch
    attempts: list[Attempt] = field(default_factory=list)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunRecord:
        record = _from_dict(cls, raw)
        record.attempts = [Attempt.from_dict(a) for a in raw.get("attempts", [])]
        return record

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @property
    def last_attempt(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None


@dataclass
class DrillRecord:
    """``drills/<drill-id>.json``: one fault drill against a running run, measured from outside
    (see infractl/drill/ for how each field is measured)."""

    drill_id: str
    drill: str  # the kind: kill-node, kill-during-checkpoint, hang-node, preempt, store-outage
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
    stopped_s: float | None = None
    restart_s: float | None = None
    # restart_s split into its phases, in seconds, in order (infractl/drill/recovery.py's PHASES);
    # None for a phase whose end was not seen. Empty until the run restarted.
    phases: dict[str, float | None] = field(default_factory=dict)
    resumed_from_step: int | None = None
    # Where the restarted workers loaded it from: "store" (its newest commit) or "replica" (the
    # agents' memory, a step at least as new); None for a writer that did not say.
    resumed_from: str | None = None
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
    # What qualifies the outcome: "run ended before node-1 rejoined" (recovered, and the run
    # finished before its whole world was back). None: nothing to add.
    outcome_note: str | None = None
    finished_time: float = 0.0
    timeout_s: float = 0.0

    @property
    def resumed_correctly(self) -> bool:
        """Resumed from the newest committed step (never step 0 when something was committed),
        or from a replica of a step at least as new."""
        if self.resumed_from_step is None or self.expected_resume_step is None:
            return False
        if self.resumed_from == "replica":
            return self.resumed_from_step >= self.expected_resume_step
        return self.resumed_from_step == self.expected_resume_step

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"resumed_correctly": self.resumed_correctly}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DrillRecord:
        return _from_dict(cls, raw)


@dataclass
class ChaosRecord:
    """``chaos/<series-id>.json``: a seeded series of random faults against one run (``infractl
    drill chaos``): what was drawn, how the run recovered from each fault (its drills are in
    ``drills/``), and how the finished run compared with an uninterrupted reference run."""

    series_id: str
    run_id: str
    cluster: str
    seed: int
    count: int
    kinds: list[str]  # the kinds the series drew from
    min_gap_s: float
    plan: list[dict[str, Any]]  # the drawn faults, in order: what the seed replays
    started: float
    drill_ids: list[str] = field(default_factory=list)  # the faults struck, in order
    recovered: int = 0
    median_restart_s: float | None = None
    worst_restart_s: float | None = None
    lost_steps: int = 0  # steps trained but not kept, over every fault
    stopped: str | None = None  # why the series ended before its count, if it did
    comparison: dict[str, Any] | None = None  # the finished run against the reference (drill/compare.py)
    finished: float = 0.0

    @property
    def passed(self) -> bool:
        """Every fault struck and recovered, and the result matches the reference."""
        matches = self.comparison is not None and bool(self.comparison.get("matches"))
        return self.stopped is None and self.recovered == self.count and matches

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"passed": self.passed}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ChaosRecord:
        return _from_dict(cls, raw)


@dataclass(frozen=True)
class ManifestEntry:
    """One file of a checkpoint. ``key`` is a relative POSIX path under the checkpoint's prefix,
    and a reader writes the file to ``<restore directory>/<key>``: a manifest comes from the
    store (or a peer), so a key that could name a path outside that directory (absolute, with
    ``..``, a backslash, an empty or ``.`` part, a control or other unprintable character, or
    empty) is refused here, whoever builds the entry (``ValueError``)."""

    key: str
    size: int
    sha256: str

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"manifest key {self.key!r} is not a non-empty string")
        if self.key.startswith("/"):
            raise ValueError(f"manifest key {self.key!r} is absolute")
        if "\\" in self.key or not self.key.isprintable():
            raise ValueError(f"manifest key {self.key!r} holds a backslash or an unprintable character")
        if {"", ".", ".."} & set(self.key.split("/")):
            raise ValueError(f"manifest key {self.key!r} has an empty, '.' or '..' part")


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    files: list[ManifestEntry]
    created: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def reason(self) -> SaveReason | None:
        """Why this checkpoint was saved, when the writer said so."""
        reason = self.extra.get("reason")
        if isinstance(reason, str) and reason in {r.value for r in SaveReason}:
            return SaveReason(reason)
        return None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """A manifest from its JSON; ``ValueError``, ``TypeError`` or ``KeyError`` for one that is
        not (a key that could leave the restore directory included: ``ManifestEntry``)."""
        raw = json.loads(data)
        files = [ManifestEntry(**f) for f in raw.pop("files")]
        return cls(files=files, **raw)


@dataclass(frozen=True)
class ProfileRequest:
    """``profiles/request.json``: trace steps ``first`` to ``last`` (both included) on every rank of
    a running run. One at a time: a new request replaces the previous one."""

    first: int
    last: int
    requested: float  # time.time() of the request: the same window asked twice is two requests

    @property
    def steps(self) -> str:
        return f"{self.first}:{self.last}"
