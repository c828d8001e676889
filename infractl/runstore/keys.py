"""Where a run's objects live in the store (keys and prefixes), and reading and writing the
records kept there: metrics, run records, drills, exports, profiles. Checkpoints' own protocol is
``commit.py``."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict
from typing import Any

from infractl.errors import StoreError
from infractl.runstore.records import ChaosRecord, DrillRecord, ProfileRequest, RunRecord, StepRecord
from infractl.store import ObjectInfo, Store, StoreKeyError

__all__ = [
    "PREFIXES",
    "MetricsTail",
    "bench_prefix",
    "chaos_key",
    "checkpoint_prefix",
    "drill_key",
    "export_record_key",
    "latest_metrics",
    "list_runs",
    "memory_report_key",
    "plan_measured_key",
    "profile_prefix",
    "profile_trace_key",
    "profile_traces",
    "read_chaos_records",
    "read_drill_records",
    "read_export_records",
    "read_metrics",
    "read_profile_request",
    "read_run_record",
    "run_prefix",
    "write_chaos_record",
    "write_drill_record",
    "write_metrics",
    "write_profile_request",
    "write_run_record",
]

#: Every top-level prefix of the store: what the access roles' rights are expressed in.
PREFIXES = ("runs", "plan", "bench", "datasets", "configs")

_METRICS_CHUNK = re.compile(r"^(\d+)-(\d+)\.jsonl$")
_PROFILE_TRACE = re.compile(r"/profiles/(\d+)-(\d+)/rank-(\d+)\.pt\.trace\.json\.gz$")


def run_prefix(run_id: str) -> str:
    return f"runs/{run_id}"


def checkpoint_prefix(run_id: str, step: int) -> str:
    return f"{run_prefix(run_id)}/ckpt/step-{step:08d}"


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


class MetricsTail:
    """A run's per-step records, read again as the run writes more: each ``records()`` lists the
    run's metrics chunks and GETs only those it has not read before (a chunk is never rewritten:
    a resume writes new ones). What a drill or a wait polls every fraction of a second, without
    reading the whole run each time."""

    def __init__(self, store: Store, run_id: str) -> None:
        self.store, self.run_id = store, run_id
        self._read: dict[str, list[StepRecord]] = {}

    def records(self) -> list[StepRecord]:
        """Per-step records sorted by step; a step recorded again after a resume keeps the newest."""
        chunks = sorted((written, first, key) for key, first, written in _metrics_chunks(self.store, self.run_id))
        by_step: dict[int, StepRecord] = {}
        for _written, _first, key in chunks:
            if key not in self._read:
                lines = self.store.get_bytes(key).splitlines()
                self._read[key] = [_parse_json(self.store, key, line) for line in lines if line.strip()]
            for record in self._read[key]:
                by_step[int(record["step"])] = record
        return [by_step[s] for s in sorted(by_step)]


def read_metrics(store: Store, run_id: str) -> list[StepRecord]:
    """Per-step records sorted by step; a step recorded again after a resume keeps the newest."""
    return MetricsTail(store, run_id).records()


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
    records = [DrillRecord.from_dict(raw) for raw in _json_objects(store, f"{run_prefix(run_id)}/drills/")]
    return sorted(records, key=lambda r: r.fault_time)


def _json_objects(store: Store, prefix: str) -> list[Any]:
    """The JSON of every ``.json`` object under ``prefix``."""
    return [
        _parse_json(store, obj.key, store.get_bytes(obj.key)) for obj in store.list(prefix) if obj.key.endswith(".json")
    ]


def chaos_key(run_id: str, series_id: str) -> str:
    return f"{run_prefix(run_id)}/chaos/{series_id}.json"


def write_chaos_record(store: Store, record: ChaosRecord) -> None:
    store.put_bytes(chaos_key(record.run_id, record.series_id), json.dumps(record.to_dict(), indent=1).encode())


def read_chaos_records(store: Store, run_id: str) -> list[ChaosRecord]:
    """Every chaos series of the run, oldest first."""
    records = [ChaosRecord.from_dict(raw) for raw in _json_objects(store, f"{run_prefix(run_id)}/chaos/")]
    return sorted(records, key=lambda r: r.started)


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
