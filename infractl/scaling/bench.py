"""``infractl bench``: a run.yaml's model trained at each node count through the normal launcher,
then its throughput, scaling efficiency and where each step's time goes, written to the store as
the baseline (``bench/<id>/``).

Each count is a run of its own, ``<run>-bench-<N>n``, started over with ``nodes: {min: N, max:
N}`` and ``--steps`` steps; checkpoints as the run.yaml says. The batch follows one rule:

- weak scaling (the default): the per-rank batch is the run.yaml's ``batch_size`` split over
  its largest world (``nodes.max`` x processes per node), the same at every count; the global
  batch grows with the ranks.
- strong scaling (``--strong``): the run.yaml's ``batch_size`` is the global batch at every
  count; each rank's share shrinks.

The figures come from the trainer's per-step records (``runstore.StepRecord``) of rank 0, after
the first ``WARMUP_STEPS`` steps (the first step builds DDP's buckets and allocates; the next
few are still noisy):

- median step time: of ``step_time_s`` (the training step alone; checkpoint blocking is outside
  it, and in the split); tokens/s = tokens per global batch / median step time.
- speedup = tokens/s at N / tokens/s at the smallest count N1; efficiency = speedup / (N / N1).
  Under strong scaling the tokens per step are fixed, so this is the ratio of speeds.
- the split, as shares of the measured steps' wall time (from their records' timestamps):
  data wait ``data_s``; optimizer ``optimizer_s`` (zero1's parameter broadcast included);
  checkpoint blocking ``checkpoint_blocking_s``; exposed communication: DDP's gradient
  all-reduce window ``comm_s`` (never more than ``forward_backward_s``, which waits for it),
  plus the log steps' loss read-back (``step_time_s`` beyond data + forward/backward +
  optimizer: one small all-reduce the host waits on). Both include waiting for the slowest
  rank. The window is exactly the exposed wait when the gradients fit in DDP's first bucket
  (1 MiB: the all-reduce starts once the last gradient is ready); with more buckets it
  overlaps the backward and is an upper bound. compute is ``forward_backward_s`` less the
  window. fsdp records no ``comm_s`` (its collectives run on their own streams): its exposed
  communication is None, and compute holds its communication and the read-back. Between
  steps: the wall time beyond all of these (handing the metrics to the store on log steps,
  evaluation, logging; approximate, never below 0).
- the dominant idle cause: the largest share but compute.
- CPU utilization of the ranks: CPU seconds of every process under each node's agent (the
  workers and what they start), sampled every 0.1 s (or as often as the nodes answer) while
  the run trains, over the measured steps' wall time and the ranks (above 1 when a rank runs
  more than one busy thread). GPU
  utilization: NVML's, where the ``pynvml`` module and a device are present; else None.
"""

from __future__ import annotations

import importlib
import re
import secrets
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from infractl import launcher, runstore
from infractl.config import RunSpec, check_layout, derive_run
from infractl.errors import ConfigError, TrainingError, UsageError
from infractl.launcher import Launch
from infractl.planning import memory
from infractl.runstore import StepRecord
from infractl.statedir import ClusterState
from infractl.store import for_cluster

__all__ = [
    "WARMUP_STEPS",
    "MIN_STEPS",
    "DEFAULT_STEPS",
    "EFFICIENT",
    "SHARES",
    "Trial",
    "Bench",
    "RankSampler",
    "Measured",
    "parse_counts",
    "check_counts",
    "plan_bench",
    "run_trials",
    "figures",
    "new_bench_id",
]

#: Steps at the start of each count left out of every figure.
WARMUP_STEPS = 5
#: The fewest steps a count may run: the warm-up and at least as many measured steps.
MIN_STEPS = 2 * WARMUP_STEPS
DEFAULT_STEPS = 50
#: Scaling efficiency below this is where adding nodes stops paying.
EFFICIENT = 0.8
#: The split's parts (keys of a result's ``shares``), in the order tables and plots show them.
SHARES = {
    "data_wait": "data wait",
    "compute": "compute",
    "exposed_comm": "exposed communication",
    "optimizer": "optimizer",
    "checkpoint_blocking": "checkpoint blocking",
    "between_steps": "between steps",
}
#: DDP's first gradient bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES).
_DDP_FIRST_BUCKET_BYTES = 1 << 20
#: Seconds between samples of the ranks' CPU time while a count trains.
_POLL_S = 0.1

Scaling = Literal["weak", "strong"]


@dataclass(frozen=True)
class Trial:
    """One node count: the derived run that measures it."""

    nodes: int
    ranks: int
    spec: RunSpec
    steps: int  # the measured run's steps; a profiled window (``spec.profile``) follows them

    @property
    def per_rank_batch(self) -> int:
        return self.spec.batch_size // self.ranks

    def figured(self, records: list[StepRecord]) -> list[StepRecord]:
        """The records the figures are taken from: after warm-up, before any profiled step."""
        return [r for r in records if WARMUP_STEPS < r["step"] <= self.steps]


@dataclass(frozen=True)
class Bench:
    """What ``infractl bench`` will run, decided (and checked) before anything starts."""

    source: RunSpec
    run_file: Path
    scaling: Scaling
    batch_rule: str
    processes: int
    trials: list[Trial]


def parse_counts(text: str) -> list[int]:
    """``--nodes 1,2,4`` as ascending counts; UsageError naming ``--nodes`` for anything but
    distinct positive integers."""
    words = [w.strip() for w in text.split(",")]
    if not text.strip() or any(not w for w in words):
        raise UsageError(f"expected node counts separated by commas (e.g. 1,2), got {text!r}", field="--nodes")
    counts = []
    for word in words:
        if not re.fullmatch(r"[-+]?[0-9]{1,12}", word):  # more digits than any cluster has nodes
            raise UsageError(f"{word!r} is not a node count (a whole number)", field="--nodes")
        counts.append(int(word))
    if min(counts) < 1:
        raise UsageError(f"node counts must be at least 1, got {min(counts)}", field="--nodes")
    if len(set(counts)) != len(counts):
        raise UsageError(f"{text!r} names a node count twice", field="--nodes")
    return sorted(counts)


def check_counts(counts: Sequence[int], *, cluster: str, cluster_nodes: int) -> None:
    """Every count fits the cluster; UsageError naming ``--nodes`` and its node count if not."""
    if max(counts) > cluster_nodes:
        raise UsageError(f"{max(counts)} exceeds the {cluster_nodes} node(s) of cluster {cluster!r}", field="--nodes")


def plan_bench(
    source: RunSpec,
    run_file: Path,
    *,
    counts: Sequence[int],
    steps: int,
    strong: bool,
    processes: int,
    profile_steps: int = 0,
) -> Bench:
    """The derived run of every count, with the batch rule applied; ConfigError naming
    ``batch_size`` when the rule cannot split it evenly. ``profile_steps``: that many more steps
    after the measured ones, traced with torch.profiler on every rank (left out of the figures)."""
    largest = source.nodes.max * processes
    if strong:
        rule = f"strong scaling: global batch {source.batch_size} (batch_size) at every count, split over the ranks"
        check_layout(
            source,
            [(c * processes, f"{c} node(s) x {processes} process(es), as --nodes asks") for c in counts],
            file=str(run_file),
        )
        batches = {count: source.batch_size for count in counts}
    else:
        if source.batch_size % largest:
            raise ConfigError(
                f"{source.batch_size} does not split evenly over nodes.max x processes per node "
                f"({source.nodes.max} x {processes} = {largest} ranks), where the per-rank batch is taken",
                file=str(run_file),
                field="batch_size",
            )
        per_rank = source.batch_size // largest
        rule = (
            f"weak scaling: per-rank batch {per_rank} (batch_size {source.batch_size} / nodes.max {source.nodes.max} "
            f"x {processes} process(es) per node) at every count; global batch = {per_rank} x ranks"
        )
        batches = {count: per_rank * count * processes for count in counts}
    trials = [
        Trial(
            count,
            count * processes,
            derive_run(
                source,
                run_file,
                suffix=f"-bench-{count}n",
                steps=steps + profile_steps,
                profile={"steps": f"{steps + 1}:{steps + profile_steps}" if profile_steps else None},
                batch_size=batches[count],
                nodes={"min": count, "max": count},
            ),
            steps,
        )
        for count in counts
    ]
    return Bench(source, run_file, "strong" if strong else "weak", rule, processes, trials)


@dataclass
class RankSampler:
    """Called at every poll while a count trains (``launcher.run_to_end(watch=...)``): the CPU
    seconds of the run's processes but the agents (the workers and what they start) on every
    node, summed over every process seen (one that exited keeps its last reading), and NVML's
    GPU utilization where present."""

    cpu: list[tuple[float, float]] = field(default_factory=list)  # (time, cumulative CPU seconds)
    gpu: list[tuple[float, float]] = field(default_factory=list)  # (time, mean utilization 0..1)
    _seen: dict[tuple[str, int, float], float] = field(default_factory=dict)
    _nvml: Any = None

    def __post_init__(self) -> None:
        self._nvml = _nvml()

    def __call__(self, launch: Launch) -> None:
        now = time.time()
        for p in launch.control.processes(run=launch.run_id):
            if p.worker:
                self._seen[p.key] = p.cpu_s
        self.cpu.append((now, sum(self._seen.values())))
        if self._nvml is not None:
            self.gpu.append((now, _gpu_utilization(self._nvml)))

    def cpu_utilization(self, start: float, end: float, ranks: int) -> float | None:
        """CPU seconds per rank per wall second between the first and last sample in
        [start, end]; None when fewer than two samples fall in it (a count too short)."""
        inside = [(t, cpu) for t, cpu in self.cpu if start <= t <= end]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] <= 0:
            return None
        return (inside[-1][1] - inside[0][1]) / ((inside[-1][0] - inside[0][0]) * ranks)

    def gpu_utilization(self, start: float, end: float) -> float | None:
        inside = [u for t, u in self.gpu if start <= t <= end]
        return statistics.fmean(inside) if inside else None


def _nvml() -> Any:
    """The ``pynvml`` module, initialized, when it is installed and sees a device; else None."""
    try:
        nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
        return nvml if nvml.nvmlDeviceGetCount() > 0 else None
    except Exception:  # not installed, no driver, no device: no GPU figure, never a failed bench
        return None


def _gpu_utilization(nvml: Any) -> float:
    """Mean utilization (0..1) over the machine's devices, as NVML reports it now."""
    count: int = nvml.nvmlDeviceGetCount()
    rates: list[int] = [
        nvml.nvmlDeviceGetUtilizationRates(nvml.nvmlDeviceGetHandleByIndex(i)).gpu for i in range(count)
    ]
    return sum(rates) / (100.0 * count)


@dataclass(frozen=True)
class Measured:
    """One count as it ran: its records (the attempt's, at its world size) and the samples."""

    trial: Trial
    records: list[StepRecord]
    sampler: RankSampler


def run_trials(state: ClusterState, bench: Bench, *, progress: Callable[[str], None]) -> list[Measured]:
    """Run every count through the launcher, one after the other; TrainingError on a count
    that did not complete (its run and logs name it)."""
    done = []
    for trial in bench.trials:
        spec = trial.spec
        progress(
            f"bench: {trial.nodes} node(s), {trial.ranks} rank(s): run {spec.name!r}, {spec.steps} steps, "
            f"global batch {spec.batch_size} ({trial.per_rank_batch} per rank)"
        )
        sampler = RankSampler()
        attempt = launcher.run_to_end(
            state, spec, bench.run_file, command="bench", log_format="console", poll_s=_POLL_S, watch=sampler
        )
        if attempt.outcome != "completed":
            raise TrainingError(
                f"bench run {spec.name!r} stopped at committed step {attempt.last_committed_step} of {spec.steps} "
                f"(agent exit codes {attempt.exit_codes}); see `infractl logs --run {spec.name}`"
            )
        records = [
            r
            for r in runstore.read_metrics(for_cluster(state), spec.name)
            if r["attempt"] == attempt.attempt and r["world_size"] == trial.ranks
        ]
        if len(trial.figured(records)) < trial.steps - WARMUP_STEPS:
            raise TrainingError(
                f"bench run {spec.name!r} completed but recorded {len(records)} of its {trial.steps} measured steps "
                f"at world size {trial.ranks}; see `infractl metrics {spec.name}`"
            )
        done.append(Measured(trial, records, sampler))
    return done


def _window(trial: Trial, records: list[StepRecord]) -> tuple[float, float]:
    """The measured steps' wall-clock span by their records' timestamps (taken as each step's
    optimizer step ends): from the end of the last warm-up step to the end of the last measured step."""
    measured = trial.figured(records)
    warm = [r["time"] for r in records if r["step"] == WARMUP_STEPS]
    start = warm[0] if warm else min(r["time"] - r["step_time_s"] for r in measured)
    return start, max(r["time"] for r in measured)


def _split_seconds(records: list[StepRecord], *, comm: bool, wall_s: float) -> dict[str, float | None]:
    """Mean seconds per step of each part of the split (see the module docstring); ``wall_s``:
    the measured steps' wall-clock span."""

    def mean(part: Callable[[StepRecord], float]) -> float:
        return statistics.fmean(part(r) for r in records)

    fb = mean(lambda r: r["forward_backward_s"])
    readback = mean(lambda r: max(r["step_time_s"] - r["data_s"] - r["forward_backward_s"] - r["optimizer_s"], 0.0))
    split: dict[str, float | None] = {
        "data_wait": mean(lambda r: r["data_s"]),
        "compute": fb + readback,
        "exposed_comm": None,
        "optimizer": mean(lambda r: r["optimizer_s"]),
        "checkpoint_blocking": mean(lambda r: r["checkpoint_blocking_s"] or 0.0),
    }
    if comm:
        window = mean(lambda r: min(r["comm_s"] or 0.0, r["forward_backward_s"]))
        split |= {"compute": fb - window, "exposed_comm": window + readback}
    inside = sum(v for v in split.values() if v is not None)
    return split | {"between_steps": max(wall_s / len(records) - inside, 0.0)}


def _count_figures(measured: Measured, *, comm: bool) -> dict[str, Any]:
    """Every figure of one count but those relative to the smallest (speedup, efficiency)."""
    trial, records = measured.trial, measured.trial.figured(measured.records)
    median_s = statistics.median(r["step_time_s"] for r in records)
    start, end = _window(trial, measured.records)
    seconds = _split_seconds(records, comm=comm, wall_s=end - start)
    total = sum(v for v in seconds.values() if v is not None)
    shares = {k: (None if v is None else v / total) for k, v in seconds.items()}
    idle = {k: v for k, v in shares.items() if k != "compute" and v is not None}
    return {
        "nodes": trial.nodes,
        "ranks": trial.ranks,
        "run_id": trial.spec.name,
        "global_batch": trial.spec.batch_size,
        "per_rank_batch": trial.per_rank_batch,
        "steps": trial.steps,
        "measured_steps": len(records),
        "profile_traces": None
        if trial.spec.profile.window is None
        else runstore.profile_prefix(trial.spec.name, *trial.spec.profile.window),
        "restarts": max(r["restart_count"] for r in records),  # a worker restart inside the count skews it
        "median_step_time_s": median_s,
        "tokens_per_s": trial.spec.batch_size * trial.spec.model.seq_len / median_s,
        "seconds_per_step": seconds | {"total": total},
        "shares": shares,
        "dominant_idle_cause": max(idle, key=lambda k: idle[k]),
        "cpu_utilization": measured.sampler.cpu_utilization(start, end, trial.ranks),
        "gpu_utilization": measured.sampler.gpu_utilization(start, end),
    }


def _comm_measure(bench: Bench) -> str:
    """What the exposed-communication share is, for this run's scheme and size."""
    if bench.source.parallel.dp_shard == "fsdp":
        return "not measured: fsdp records no all-reduce window (its communication is in compute)"
    gradient_bytes = 4 * memory.parameters(bench.source.model)
    if gradient_bytes <= _DDP_FIRST_BUCKET_BYTES:
        return f"exact: the gradients ({gradient_bytes:,} B) fit one DDP bucket, all-reduced after the backward"
    return f"upper bound: the gradients ({gradient_bytes:,} B) span several DDP buckets, overlapping the backward"


def figures(bench: Bench, measured: list[Measured], *, cluster: str, bench_id: str, started: float) -> dict[str, Any]:
    """The baseline: every figure of every count, and what they were measured on."""
    comm = bench.source.parallel.dp_shard != "fsdp"
    results = [_count_figures(m, comm=comm) for m in measured]
    base = results[0]
    for result in results:
        result["speedup"] = result["tokens_per_s"] / base["tokens_per_s"]
        result["efficiency"] = result["speedup"] / (result["nodes"] / base["nodes"])
    below = next((r["nodes"] for r in results if r["efficiency"] < EFFICIENT), None)
    first = measured[0].records[0] if measured[0].records else None
    source = bench.source
    return {
        "bench_id": bench_id,
        "run": source.name,
        "run_file": str(bench.run_file),
        "cluster": cluster,
        "model": source.model.model_dump(mode="json"),
        "parallel": source.parallel.label,
        "mixed_precision": source.mixed_precision,
        "activation_checkpointing": source.activation_checkpointing,
        "scaling": bench.scaling,
        "batch_rule": bench.batch_rule,
        "processes_per_node": bench.processes,
        "counts": [t.nodes for t in bench.trials],
        "steps": bench.trials[0].steps,
        "warmup_steps": WARMUP_STEPS,
        "exposed_comm_measure": _comm_measure(bench),
        "gpu_utilization_source": "NVML"
        if any(m.sampler.gpu for m in measured)
        else "absent (no NVML: pynvml is not installed, or it sees no device)",
        "environment": first.get("environment") if first else None,
        "started": _iso(started),
        "finished": _iso(time.time()),
        "results": results,
        "dominant_idle_cause": results[-1]["dominant_idle_cause"],
        "efficiency_threshold": EFFICIENT,
        "efficiency_below_80_at": below,
    }


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


def new_bench_id() -> str:
    """Unique and sortable by time: ``20261201T120000Z-1a2b3c``."""
    return f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"
