"""The store's layout and its typed records: the one place that knows where a run's objects
live and what they hold (the CLI, the trainer, drills, and the handover bundle and outside tools
read the store through this module).

Layout (``<store>/runs/<run-id>/``)::

    run.json                          RunRecord: resolved spec, cluster, dataset version, attempts
                                      (each with its nodes, rejoins and outcome); the launcher writes it
    metrics/<first-step>-<ns>.jsonl   StepRecord lines, one object per chunk (object stores cannot
                                      append); a step written again after a resume: the newest counts
    tensorboard/...                   TensorBoard event files, uploaded whole
    ckpt/step-<N>/...                 DCP shards and .metadata
    ckpt/step-<N>/MANIFEST.json       Manifest: every key with size and sha256, step, world size, and
                                      extra (the SaveReason, tokens seen, config hash, dataset version,
                                      environment fingerprint, save timings)
    ckpt/step-<N>/COMMITTED           written last and create-only
    drills/<drill-id>.json            DrillRecord: one fault drill and its measured recovery
    profiles/request.json             ProfileRequest: `infractl profile` asks every rank to trace steps
    profiles/<first>-<last>/rank-<r>.pt.trace.json.gz
                                      rank r's torch.profiler trace of those steps (gzipped Chrome
                                      trace JSON; each folder is a run for TensorBoard's profiler plugin)

Besides the runs (``<store>/``)::

    plan/<run-id>/measured.json       `infractl plan --measure`: the prediction beside what a probe
                                      run of the run.yaml measured (infractl/planning/measure.py)
    bench/<bench-id>/baseline.json    `infractl bench`: the scaling baseline (infractl/planning/bench.py)
    bench/<bench-id>/*.png            its plots: throughput and efficiency, the step-time split

A probe run (``runs/<run-id>/memory/rank-<r>.json``, each rank's measured memory) is deleted once
`plan --measure` has read it.

Two more top-level prefixes belong to the team rather than to a command: ``datasets/`` and
``configs/``, where config-admins keep shared datasets and run configs. Nothing in infractl writes
them; the access roles (infractl/handover/access.py) grant them, so they are part of the layout.
``PREFIXES`` names every top-level prefix.

A checkpoint exists only once COMMITTED exists. Records are JSON; readers accept fields they do not
know (a newer writer) and supply defaults for fields a record lacks (an older writer).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NotRequired, TypedDict, TypeVar

from infractl.errors import InfractlError, StoreError
from infractl.store import ObjectInfo, Store, StoreKeyError

__all__ = [
    "PREFIXES",
    "SaveReason",
    "StepRecord",
    "Rejoin",
    "Attempt",
    "RunRecord",
    "DrillRecord",
    "ManifestEntry",
    "Manifest",
    "CheckpointError",
    "run_prefix",
    "plan_measured_key",
    "bench_prefix",
    "memory_report_key",
    "checkpoint_prefix",
    "file_sha256",
    "fetch_checkpoint_file",
    "commit_checkpoint",
    "step_objects",
    "read_manifest",
    "committed_steps",
    "latest_committed_step",
    "verify_checkpoint",
    "prune_checkpoints",
    "write_metrics",
    "read_metrics",
    "read_run_record",
    "write_run_record",
    "list_runs",
    "latest_metrics",
    "starts_a_process",
    "drill_key",
    "write_drill_record",
    "read_drill_records",
    "ProfileRequest",
    "profile_prefix",
    "profile_trace_key",
    "profile_traces",
    "read_profile_request",
    "write_profile_request",
]

#: Every top-level prefix of the store: what the access roles' rights are expressed in.
PREFIXES = ("runs", "plan", "bench", "datasets", "configs")

_STEP_DIR = re.compile(r"^step-(\d+)$")
_METRICS_CHUNK = re.compile(r"^(\d+)-(\d+)\.jsonl$")
_PROFILE_TRACE = re.compile(r"/profiles/(\d+)-(\d+)/rank-(\d+)\.pt\.trace\.json\.gz$")


class CheckpointError(InfractlError):
    """A checkpoint failed verification (missing key, wrong size or checksum)."""


class SaveReason(enum.StrEnum):
    """Why a checkpoint was saved (``Manifest.extra["reason"]``)."""

    SCHEDULED = "scheduled"  # every checkpoint.every steps
    FINAL = "final"  # the last step
    PREEMPTION = "preemption"  # the emergency save on a preemption notice


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
    # forward/backward passes of at most micro_batch samples (trainer/layout.py).
    micro_batch: NotRequired[int]
    accumulation: NotRequired[int]
    val_loss: NotRequired[float]  # on evaluation steps only (run.yaml eval.every)
    # The environment fingerprint, in the first record of every trainer process: the first
    # step after a (re)start. ``starts_a_process`` is how readers ask.
    environment: NotRequired[dict[str, Any]]


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

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DrillRecord:
        return _from_dict(cls, raw)


def _read_json(store: Store, key: str) -> Any | None:
    """The object's JSON, or None when there is no such object (see ``_parse_json``)."""
    try:
        data = store.get_bytes(key)
    except StoreKeyError:
        return None
    return _parse_json(store, key, data)


def _parse_json(store: Store, key: str, data: bytes) -> Any:
    """An object's JSON, or ``StoreError`` naming the object when it is not JSON (a truncated
    or hand-edited record must be one clear line, not a traceback)."""
    try:
        return json.loads(data)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError alike
        raise StoreError(store.uri, f"{key} is not valid JSON ({exc})") from None


@dataclass(frozen=True)
class ManifestEntry:
    key: str  # relative to the checkpoint's prefix
    size: int
    sha256: str


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
        raw = json.loads(data)
        files = [ManifestEntry(**f) for f in raw.pop("files")]
        return cls(files=files, **raw)


def run_prefix(run_id: str) -> str:
    return f"runs/{run_id}"


def checkpoint_prefix(run_id: str, step: int) -> str:
    return f"{run_prefix(run_id)}/ckpt/step-{step:08d}"


def fetch_checkpoint_file(store: Store, run_id: str, step: int, entry: ManifestEntry, dest: Path, *, tag: str) -> None:
    """One file of a committed step into ``dest``, checked against its manifest entry: skipped
    when ``dest`` already holds it (another rank on this node fetched it), downloaded to a
    ``tag``-named part file and renamed, never left half-written or unchecked."""
    if dest.is_file() and dest.stat().st_size == entry.size and file_sha256(dest) == entry.sha256:
        return
    tmp = dest.with_name(f".{dest.name}.{tag}.part")
    store.get_file(f"{checkpoint_prefix(run_id, step)}/{entry.key}", tmp)
    digest = file_sha256(tmp)
    if digest != entry.sha256:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"step {step}: {entry.key}: sha256 is {digest}, the manifest says {entry.sha256}")
    os.replace(tmp, dest)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def commit_checkpoint(store: Store, run_id: str, manifest: Manifest, *, replace: bool = False) -> bool:
    """Publish MANIFEST then COMMITTED (create-only). Every listed file must already be in the store.

    Returns True if this call committed the step. A step that is already committed is left
    untouched and False is returned (a retried commit is harmless), unless ``replace``: then
    its MANIFEST.json is rewritten to describe the files just uploaded over it (the repair of
    a step that failed verification) and False is returned as well.
    """
    prefix = checkpoint_prefix(run_id, manifest.step)
    committed = f"{prefix}/COMMITTED"
    if store.exists(committed) and not replace:
        return False
    store.put_bytes(f"{prefix}/MANIFEST.json", manifest.to_json())
    return store.put_if_absent(committed, str(manifest.step).encode())


def step_objects(store: Store, run_id: str) -> dict[int, set[str]]:
    """Map step -> names of the objects under ckpt/step-<N>/ (committed or not)."""
    steps: dict[int, set[str]] = {}
    base = f"{run_prefix(run_id)}/ckpt/"
    for obj in store.list(base):
        parts = obj.key[len(base) :].split("/")
        match = _STEP_DIR.match(parts[0])
        if match:
            steps.setdefault(int(match.group(1)), set()).add("/".join(parts[1:]))
    return steps


def read_manifest(store: Store, run_id: str, step: int) -> Manifest | None:
    """The step's MANIFEST.json, or None if it has none (yet, or any more)."""
    key = f"{checkpoint_prefix(run_id, step)}/MANIFEST.json"
    try:
        data = store.get_bytes(key)
    except StoreKeyError:
        return None
    try:
        return Manifest.from_json(data)
    except (ValueError, TypeError, KeyError) as exc:
        raise StoreError(store.uri, f"{key} is not a valid manifest ({type(exc).__name__}: {exc})") from None


def committed_steps(store: Store, run_id: str) -> list[int]:
    return sorted(step for step, names in step_objects(store, run_id).items() if "COMMITTED" in names)


def latest_committed_step(store: Store, run_id: str) -> int | None:
    steps = committed_steps(store, run_id)
    return steps[-1] if steps else None


def verify_checkpoint(store: Store, run_id: str, step: int) -> Manifest:
    """Check that every manifest entry is present with its recorded size; return the manifest.

    Checksums are verified by whoever downloads the files (see ``file_sha256``).
    """
    prefix = checkpoint_prefix(run_id, step)
    if not store.exists(f"{prefix}/COMMITTED"):
        raise CheckpointError(f"step {step} of run {run_id!r} is not committed")
    manifest = read_manifest(store, run_id, step)
    if manifest is None:
        raise CheckpointError(f"step {step} of run {run_id!r} has no MANIFEST.json")
    present = {o.key[len(prefix) + 1 :]: o.size for o in store.list(prefix)}
    for entry in manifest.files:
        if entry.key not in present:
            raise CheckpointError(f"step {step}: {entry.key} is missing from the store")
        if present[entry.key] != entry.size:
            raise CheckpointError(f"step {step}: {entry.key} is {present[entry.key]} bytes, manifest says {entry.size}")
    return manifest


def prune_checkpoints(store: Store, run_id: str, *, keep: int, idle: bool = False) -> list[int]:
    """Delete committed steps beyond the newest ``keep`` and uncommitted steps older than the
    newest committed one (leftovers of interrupted saves). Returns the deleted steps.

    An uncommitted step newer than the newest committed one may be a save still in flight, so
    it is kept, unless ``idle``: the caller knows no save is running (a job resuming), and
    every uncommitted step is a leftover.
    """
    if keep < 2:
        raise ValueError("keep must be at least 2")
    dirs = step_objects(store, run_id)
    committed = sorted(s for s, names in dirs.items() if "COMMITTED" in names)
    newest = committed[-1] if committed else -1
    partial = [s for s, names in dirs.items() if "COMMITTED" not in names]
    doomed = committed[:-keep] + [s for s in partial if idle or s < newest]
    for step in sorted(doomed):
        store.delete_prefix(checkpoint_prefix(run_id, step))
    return sorted(doomed)


def write_metrics(store: Store, run_id: str, records: list[StepRecord]) -> None:
    """Write one chunk of per-step records as its own object (object stores cannot append)."""
    if not records:
        return
    first = int(records[0]["step"])
    key = f"{run_prefix(run_id)}/metrics/{first:08d}-{time.time_ns()}.jsonl"
    store.put_bytes(key, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode())


def _metrics_chunks(store: Store, run_id: str) -> list[tuple[str, int, int]]:
    """(key, first step, write time in ns) of every metrics chunk; other objects are ignored."""
    chunks = []
    for obj in store.list(f"{run_prefix(run_id)}/metrics/"):
        match = _METRICS_CHUNK.match(obj.key.rsplit("/", 1)[-1])
        if match:
            chunks.append((obj.key, int(match.group(1)), int(match.group(2))))
    return chunks


def read_metrics(store: Store, run_id: str) -> list[StepRecord]:
    """Per-step records sorted by step; a step recorded again after a resume keeps the newest."""
    chunks = sorted((written, first, key) for key, first, written in _metrics_chunks(store, run_id))
    by_step: dict[int, StepRecord] = {}
    for _written, _first, key in chunks:
        for line in store.get_bytes(key).splitlines():
            if line.strip():
                record = _parse_json(store, key, line)
                by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def read_run_record(store: Store, run_id: str) -> RunRecord | None:
    key = f"{run_prefix(run_id)}/run.json"
    raw = _read_json(store, key)
    if raw is None:
        return None
    try:
        return RunRecord.from_dict(raw)
    except (TypeError, AttributeError) as exc:
        raise StoreError(store.uri, f"{key} is not a run record ({exc})") from None


def write_run_record(store: Store, record: RunRecord) -> None:
    store.put_bytes(f"{run_prefix(record.run_id)}/run.json", record.to_json())


def list_runs(store: Store) -> list[str]:
    return sorted({o.key.split("/")[1] for o in store.list("runs/") if o.key.endswith("/run.json")})


def latest_metrics(store: Store, run_id: str) -> StepRecord | None:
    """The newest per-step record (reads only the most recently written chunk)."""
    newest: tuple[int, str] | None = None
    for key, _first, written in _metrics_chunks(store, run_id):
        if newest is None or written > newest[0]:
            newest = (written, key)
    if newest is None:
        return None
    lines = [line for line in store.get_bytes(newest[1]).splitlines() if line.strip()]
    record: StepRecord | None = _parse_json(store, newest[1], lines[-1]) if lines else None
    return record


def plan_measured_key(run_id: str) -> str:
    """Where `plan --measure` keeps its comparison for run ``run_id`` (the handover bundle reads it)."""
    return f"plan/{run_id}/measured.json"


def bench_prefix(bench_id: str) -> str:
    """The folder of one `infractl bench`: baseline.json and its plots."""
    return f"bench/{bench_id}"


def export_record_key(run_id: str, step: int, fmt: str) -> str:
    """Where `infractl export` records the newest file it made of ``step`` in format ``fmt``."""
    return f"{run_prefix(run_id)}/exports/step-{step:08d}.{fmt}.json"


def read_export_records(store: Store, run_id: str) -> list[dict[str, Any]]:
    """What `infractl export` recorded of the run's exports: FILE.json's fields plus ``path`` and
    ``command``; by step, then format."""
    return [
        _parse_json(store, obj.key, store.get_bytes(obj.key))
        for obj in sorted(store.list(f"{run_prefix(run_id)}/exports/"), key=lambda o: o.key)
        if obj.key.endswith(".json")
    ]


def memory_report_key(run_id: str, rank: int) -> str:
    """Where rank ``rank`` of a ``plan --measure`` run reports the memory it took."""
    return f"{run_prefix(run_id)}/memory/rank-{rank}.json"


def drill_key(run_id: str, drill_id: str) -> str:
    return f"{run_prefix(run_id)}/drills/{drill_id}.json"


def write_drill_record(store: Store, record: DrillRecord) -> None:
    store.put_bytes(drill_key(record.run_id, record.drill_id), json.dumps(record.to_dict(), indent=1).encode())


def read_drill_records(store: Store, run_id: str) -> list[DrillRecord]:
    """Every drill of the run, oldest first."""
    records = []
    for obj in store.list(f"{run_prefix(run_id)}/drills/"):
        if obj.key.endswith(".json"):
            records.append(DrillRecord.from_dict(_parse_json(store, obj.key, store.get_bytes(obj.key))))
    return sorted(records, key=lambda r: r.fault_time)


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


def profile_prefix(run_id: str, first: int, last: int) -> str:
    """Where every rank's trace of steps ``first`` to ``last`` goes."""
    return f"{run_prefix(run_id)}/profiles/{first}-{last}"


def profile_trace_key(run_id: str, first: int, last: int, rank: int) -> str:
    # <worker>.pt.trace.json.gz is the name TensorBoard's profiler plugin looks for.
    return f"{profile_prefix(run_id, first, last)}/rank-{rank}.pt.trace.json.gz"


def profile_traces(store: Store, run_id: str) -> dict[tuple[int, int], dict[int, ObjectInfo]]:
    """(first, last) -> rank -> its trace of those steps: every trace of the run in the store."""
    traces: dict[tuple[int, int], dict[int, ObjectInfo]] = {}
    for obj in store.list(f"{run_prefix(run_id)}/profiles/"):
        match = _PROFILE_TRACE.search(obj.key)
        if match:
            first, last, rank = (int(g) for g in match.groups())
            traces.setdefault((first, last), {})[rank] = obj
    return traces


def _profile_request_key(run_id: str) -> str:
    return f"{run_prefix(run_id)}/profiles/request.json"


def write_profile_request(store: Store, run_id: str, request: ProfileRequest) -> None:
    store.put_bytes(_profile_request_key(run_id), json.dumps(asdict(request)).encode())


def read_profile_request(store: Store, run_id: str) -> ProfileRequest | None:
    """The run's profile request, or None if it has none."""
    key = _profile_request_key(run_id)
    raw = _read_json(store, key)
    if raw is None:
        return None
    try:
        return ProfileRequest(first=int(raw["first"]), last=int(raw["last"]), requested=float(raw["requested"]))
    except (TypeError, KeyError, ValueError) as exc:
        raise StoreError(store.uri, f"{key} is not a profile request ({type(exc).__name__}: {exc})") from None
