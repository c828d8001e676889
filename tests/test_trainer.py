"""trainer/: data order as a pure function (unit), and real torchrun runs on gloo (integration)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.distributed.checkpoint.filesystem import FileSystemReader

from infractl import dataset
from infractl.config import CheckpointSpec, DataSpec, EvalSpec, ModelSpec, RunSpec, load_run_json, split_batch
from infractl.errors import ConfigError
from infractl.runstore import (
    StepRecord,
    checkpoint_prefix,
    committed_steps,
    read_metrics,
    verify_checkpoint,
)
from infractl.store import Store, open_store
from trainer.data import ByteBatches, sample_indices
from trainer.metrics import MetricsWriter
from trainer.optimizer import lr_factor

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120
RECORD_FIELDS = {
    "step",
    "loss",
    "step_time_s",
    "tokens_per_s",
    "world_size",
    "attempt",
    "restart_count",
    "time",
    "data_s",
    "forward_backward_s",
    "optimizer_s",
    "comm_s",
    "checkpoint_blocking_s",
    "peak_memory_bytes",
    "grad_norm",
    "micro_batch",
    "accumulation",
}


# -- helpers ------------------------------------------------------------------------------


def tiny_spec(**overrides: Any) -> RunSpec:
    fields: dict[str, Any] = {
        "name": "tiny",
        "model": ModelSpec(layers=2, hidden=32, heads=2, seq_len=32),
        "data": DataSpec(max_bytes=100_000),
        "batch_size": 8,
        "steps": 10,
        "checkpoint": CheckpointSpec(every=5, keep=2),
    }
    return RunSpec(**(fields | overrides))


class Run:
    """Finished torchrun agents: exit codes, stderr, and the trainer's JSON log events."""

    def __init__(self, returncodes: list[int], stderr: str) -> None:
        self.returncodes = returncodes
        self.stderr = stderr
        self.events: list[dict[str, Any]] = []
        for line in stderr.splitlines():
            # Other lines are torchrun's own; a JSON line cut by a killed worker is skipped.
            with contextlib.suppress(json.JSONDecodeError):
                if line.startswith("{"):
                    self.events.append(json.loads(line))

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes)

    def event(self, name: str, *, rank: int | None = 0) -> list[dict[str, Any]]:
        """The ``name`` events of ``rank`` (rank 0, which speaks for the job, by default; None:
        every rank's)."""
        return [e for e in self.events if e["event"] == name and rank in (None, e.get("rank"))]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun(
    tmp_path: Path,
    spec: RunSpec,
    *,
    nproc: int = 2,
    nodes: int = 1,
    attempt: int = 1,
    store_uri: str | None = None,
) -> Run:
    """Run the trainer as the launcher does: one torchrun agent per node, each node its workdir.

    The store is ``store_uri`` (``file://`` or ``s3://...?endpoint_url=``; the trainers find S3
    credentials in the inherited environment), by default ``tmp_path/store``."""
    return start_torchrun(tmp_path, spec, nproc=nproc, nodes=nodes, attempt=attempt, store_uri=store_uri).finish()


@dataclass
class Agents:
    """torchrun agents running in the background (``start_torchrun``), one per node."""

    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]

    def finish(self) -> Run:
        """Wait for every agent; fail the test (after stopping them) if one takes too long."""
        try:
            for agent in self.procs:
                agent.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # SIGTERM, not SIGKILL: the agents then stop their workers (own sessions).
            for agent in self.procs:
                agent.terminate()
            for agent in self.procs:
                agent.wait(timeout=60)
            pytest.fail(f"torchrun did not finish in {TIMEOUT_S}s:\n{self.text()[-4000:]}")
        return Run([a.returncode for a in self.procs], self.text())

    def text(self) -> str:
        """What the agents and their workers wrote to stderr so far."""
        return "".join(log.read_text() for log in self.logs)


def start_torchrun(
    tmp_path: Path,
    spec: RunSpec,
    *,
    nproc: int = 2,
    nodes: int = 1,
    attempt: int = 1,
    store_uri: str | None = None,
    torchrun_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Agents:
    """Start what ``torchrun`` runs and return at once. ``torchrun_args`` go to every agent,
    ``env`` adds to every node's environment."""
    store_uri = store_uri or default_store_uri(tmp_path)
    spec_path = tmp_path / f"spec-{attempt}.json"
    spec_path.write_text(spec.model_dump_json())
    common = (
        os.environ
        | {
            "OMP_NUM_THREADS": "1",
            "INFRACTL_ATTEMPT": str(attempt),
            "INFRACTL_LOG_FORMAT": "json",
            "PYTHONPATH": str(REPO),
        }
        | dict(env or {})
    )
    if nodes == 1:
        rendezvous = [["--standalone", "--nnodes=1"]]
    else:
        port = free_port()
        rendezvous = [
            [
                f"--nnodes={nodes}",
                f"--node-rank={rank}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
            ]
            for rank in range(nodes)
        ]
    agents, logs = [], []
    for node, rdzv in enumerate(rendezvous):
        argv = [
            sys.executable, "-m", "torch.distributed.run",
            *rdzv, f"--nproc-per-node={nproc}", "--monitor-interval=0.2", *torchrun_args,
            "-m", "trainer.train",
            "--spec", str(spec_path),
            "--store", store_uri,
            "--run-id", spec.name,
            "--workdir", str(tmp_path / f"node{node}"),
        ]  # fmt: skip
        logs.append(tmp_path / f"node{node}-attempt{attempt}.log")
        with logs[-1].open("w") as log:
            agents.append(subprocess.Popen(argv, cwd=REPO, env=common, stderr=log))
    return Agents(agents, logs)


def default_store_uri(tmp_path: Path) -> str:
    """The store a test's runs use unless it names another: ``file://<tmp_path>/store``."""
    (tmp_path / "store").mkdir(exist_ok=True)
    return (tmp_path / "store").as_uri()


def store_of(where: Path | str) -> Store:
    """The store of a test: ``tmp_path`` (its default ``file://`` store) or a store URI."""
    if isinstance(where, Path):
        return open_store(default_store_uri(where))
    return open_store(where)


def losses(store: Store, run_id: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(store, run_id)}


#: The events of a rank's lifecycle (trainer/train.py's module doc), as its node's log shows them.
LIFECYCLE = ("rank_joined", "starting", "resumed", "checkpoint_staged", "checkpoint_committed", "stopped")


def lifecycle(run: Run, *, rank: int) -> list[tuple[str, int | None]]:
    """``rank``'s lifecycle events in the order it logged them, each with its step."""
    return [(e["event"], e.get("step")) for e in run.events if e.get("rank") == rank and e["event"] in LIFECYCLE]


def ok(run: Run) -> Run:
    assert run.ok, run.stderr[-4000:]
    return run


# -- data order (unit) ----------------------------------------------------------------------


def test_batch_indices_are_a_pure_function_of_seed_step_rank_world_size() -> None:
    def share(**change: int) -> np.ndarray:
        args = dict(seed=3, step=7, rank=1, world_size=4, batch_size=16, samples=1000) | change
        return sample_indices(**args)

    first = share()
    share(step=2)  # no hidden state carried between calls
    assert np.array_equal(first, share())
    assert not np.array_equal(first, share(seed=4))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8, 16])
def test_ranks_split_the_global_batch_without_overlap(world_size: int) -> None:
    batch_size, samples = 16, 1000
    for step in (1, 2, 50):
        shares = [
            sample_indices(
                seed=0,
                step=step,
                rank=r,
                world_size=world_size,
                batch_size=batch_size,
                samples=samples,
            )
            for r in range(world_size)
        ]
        union = np.concatenate(shares)
        assert len(set(union.tolist())) == batch_size  # no sample on two ranks
        # The global batch does not depend on how many ranks share it.
        whole = sample_indices(seed=0, step=step, rank=0, world_size=1, batch_size=batch_size, samples=samples)
        assert np.array_equal(union, whole)


def test_each_epoch_visits_every_sample_once() -> None:
    samples, batch_size = 64, 8
    seen = np.concatenate(
        [
            sample_indices(seed=1, step=s, rank=r, world_size=2, batch_size=batch_size, samples=samples)
            for s in range(1, samples // batch_size + 1)
            for r in range(2)
        ]
    )
    assert sorted(seen.tolist()) == list(range(samples))


def test_batches_pair_each_byte_with_the_next() -> None:
    corpus = np.frombuffer(bytes(range(256)) * 8, dtype=np.uint8)
    batches = ByteBatches(corpus, seq_len=16, batch_size=4, seed=0, rank=1, world_size=2)
    inputs, targets = batches.batch(3)
    assert inputs.shape == targets.shape == (2, 16)
    assert ((inputs + 1) % 256 == targets).all()


def test_an_uneven_split_gives_the_first_ranks_one_more_sample() -> None:
    assert split_batch(10, 4) == [3, 3, 2, 2]
    assert split_batch(16, 3) == [6, 5, 5]
    assert split_batch(8, 8) == [1] * 8


def test_spec_errors_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text(tiny_spec().model_dump_json().replace('"batch_size":8', '"batch_size":0'))
    with pytest.raises(ConfigError, match=r"spec.json: batch_size: Input should be greater"):
        load_run_json(path)


# -- schedule and metrics (unit) -------------------------------------------------------------


def test_lr_warms_up_linearly_then_decays_by_cosine() -> None:
    factors = [lr_factor(i, total_steps=100) for i in range(100)]
    assert factors[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert all(a >= b for a, b in itertools.pairwise(factors[9:]))
    assert factors[-1] == pytest.approx(0.1, abs=0.01)


def test_metrics_are_written_in_chunks_by_count_and_by_time(tmp_path: Path) -> None:
    store = store_of(tmp_path)
    now = [0.0]
    writer = MetricsWriter(store, "r", every_steps=3, every_s=2.0, clock=lambda: now[0])

    def record(step: int) -> StepRecord:
        return StepRecord(step=step, loss=1.0, step_time_s=0.1, tokens_per_s=1.0, world_size=1,
                          attempt=1, restart_count=0, time=0.0)  # fmt: skip

    for step in (1, 2):
        writer.add(record(step))
    assert read_metrics(store, "r") == []
    writer.add(record(3))  # third record: a chunk
    assert [r["step"] for r in read_metrics(store, "r")] == [1, 2, 3]
    writer.add(record(4))
    now[0] = 2.5
    writer.add(record(5))  # two seconds since the last chunk
    assert [r["step"] for r in read_metrics(store, "r")] == [1, 2, 3, 4, 5]
    writer.add(record(6))
    writer.flush()
    assert len(store.list("runs/r/metrics/")) == 3


# -- torchrun on gloo (integration) -----------------------------------------------------------


@pytest.mark.cluster
def test_two_ranks_finish_commit_the_last_step_and_record_every_step(tmp_path: Path) -> None:
    spec = tiny_spec(steps=12)
    run = ok(torchrun(tmp_path, spec))
    store = store_of(tmp_path)

    assert committed_steps(store, spec.name) == [10, 12]  # every 5, the last step, keep 2
    manifest = verify_checkpoint(store, spec.name, 12)
    assert manifest.world_size == 2
    assert manifest.extra["tokens_seen"] == 12 * spec.batch_size * spec.model.seq_len
    saved = FileSystemReader(tmp_path / "store" / checkpoint_prefix(spec.name, 12)).read_metadata()
    groups = {key.split(".")[0] for key in saved.state_dict_metadata}
    assert groups == {"model", "optimizer", "progress", "rng-rank-0", "rng-rank-1"}
    records = read_metrics(store, spec.name)
    assert [r["step"] for r in records] == list(range(1, 13))
    # The first record of each process also carries its environment fingerprint, and when the
    # process started, joined the group and loaded its state (a drill splits a restart with them).
    assert all(set(r) - {"environment", "timeline"} == RECORD_FIELDS for r in records), records[0].keys()
    assert "environment" in records[0] and all("timeline" not in r for r in records[1:])
    timeline = records[0]["timeline"]
    assert timeline["started"] <= timeline["joined"] <= timeline["loaded"] <= records[0]["time"], timeline
    assert {(r["world_size"], r["attempt"], r["restart_count"]) for r in records} == {(2, 1, 0)}
    assert records[-1]["loss"] < records[0]["loss"]

    assert [e["step"] for e in run.event("starting")] == [0]
    assert [e["step"] for e in run.event("checkpoint_committed")] == [5, 10, 12]
    assert [e["step"] for e in run.event("finished")] == [12]
    # Once 5 steps were seen, collectives wait 10 x the slowest step in whole half seconds, at least
    # the floor (these tiny steps: the floor, unless the machine is loaded), not half the step timeout.
    floor = spec.watchdog.collective_timeout_min_s
    timeouts = [(e["timeout_s"], max(floor, 10 * e["slowest_step_s"])) for e in run.event("collective_timeout")]
    assert timeouts and all(-0.01 <= set_s - wanted_s <= 0.51 for set_s, wanted_s in timeouts), timeouts
    assert [t for t, _ in timeouts] == sorted(t for t, _ in timeouts), timeouts  # the slowest step only grows
    assert not [p for p in (tmp_path / "node0").rglob("*") if p.is_file()]  # staging cleaned up

    # Rank 1's log tells its own story, in order; the job-wide lines are rank 0's alone.
    saves = [(event, step) for step in (5, 10, 12) for event in ("checkpoint_staged", "checkpoint_committed")]
    assert lifecycle(run, rank=1) == [("rank_joined", None), ("starting", 0), *saves, ("stopped", 12)]
    [joined] = run.event("rank_joined", rank=1)
    assert (joined["local_rank"], joined["world_size"], joined["attempt"], joined["restart_count"]) == (1, 2, 1, 0)
    assert [e["reason"] for e in run.event("stopped", rank=None)] == ["finished", "finished"]
    assert not run.event("environment", rank=1) and not run.event("finished", rank=1)


@pytest.mark.cluster
def test_rerun_with_more_steps_resumes_from_the_last_committed_step(tmp_path: Path) -> None:
    store = store_of(tmp_path)
    ok(torchrun(tmp_path, tiny_spec(steps=7)))
    assert committed_steps(store, "tiny") == [5, 7]

    run = ok(torchrun(tmp_path, tiny_spec(steps=12), attempt=2))

    assert [e["step"] for e in run.event("resumed")] == [7]
    assert not run.event("starting", rank=None)
    # Every rank says where it resumed from.
    assert sorted((e["rank"], e["step"], e["saved_reason"]) for e in run.event("resumed", rank=None)) == [
        (0, 7, "final"),
        (1, 7, "final"),
    ]
    assert lifecycle(run, rank=1)[:2] == [("rank_joined", None), ("resumed", 7)]
    records = read_metrics(store, "tiny")
    assert [r["step"] for r in records if r["attempt"] == 2] == list(range(8, 13))
    assert [r["step"] for r in records] == list(range(1, 13))
    assert committed_steps(store, "tiny")[-1] == 12


@pytest.mark.cluster
def test_uncommitted_step_is_never_loaded_and_resume_is_exact(tmp_path: Path, store_uri: str) -> None:
    store = store_of(store_uri)  # file:// and the S3 server (conftest's store_uri)
    spec = tiny_spec(steps=10)
    ok(torchrun(tmp_path, spec, store_uri=store_uri))
    before = losses(store, spec.name)
    # Killed between upload and commit: step 10's files and manifest exist, COMMITTED does not.
    store.delete_prefix(f"{checkpoint_prefix(spec.name, 10)}/COMMITTED")
    assert store.exists(f"{checkpoint_prefix(spec.name, 10)}/MANIFEST.json")

    run = ok(torchrun(tmp_path, spec, attempt=2, store_uri=store_uri))

    assert [e["step"] for e in run.event("resumed")] == [5]
    after = losses(store, spec.name)
    # Same topology and thread count: the replayed steps are bitwise identical.
    assert [after[s] for s in range(6, 11)] == [before[s] for s in range(6, 11)]
    assert committed_steps(store, spec.name) == [5, 10]


@pytest.mark.cluster
def test_corrupt_checkpoint_is_skipped_for_the_previous_committed_step(tmp_path: Path) -> None:
    store = store_of(tmp_path)
    spec = tiny_spec(steps=10)
    ok(torchrun(tmp_path, spec))
    shard = tmp_path / "store" / checkpoint_prefix(spec.name, 10) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different sha256
    shard.write_bytes(bytes(data))

    run = ok(torchrun(tmp_path, spec, attempt=2))

    assert [e["step"] for e in run.event("checkpoint_invalid")] == [10]
    assert "sha256" in run.event("checkpoint_invalid")[0]["error"]
    assert [e["step"] for e in run.event("resumed")] == [5]
    verify_checkpoint(store, spec.name, 10)  # rewritten whole by the resumed run
    assert [e["rewritten"] for e in run.event("checkpoint_committed") if e["step"] == 10] == [True]


@pytest.mark.cluster
def test_resume_on_fewer_ranks_reshards_and_keeps_the_data_order(tmp_path: Path) -> None:
    store = store_of(tmp_path)
    spec = tiny_spec(steps=10)
    ok(torchrun(tmp_path, spec))
    before = losses(store, spec.name)
    store.delete_prefix(f"{checkpoint_prefix(spec.name, 10)}/COMMITTED")

    run = ok(torchrun(tmp_path, spec, nproc=1, attempt=2))

    [resumed] = run.event("resumed")
    assert (resumed["step"], resumed["saved_world_size"], resumed["world_size"]) == (5, 2, 1)
    records = [r for r in read_metrics(store, spec.name) if r["attempt"] == 2]
    assert [(r["step"], r["world_size"]) for r in records] == [(s, 1) for s in range(6, 11)]
    # One rank sees the same global batches as two did; only reduction order differs.
    assert [r["loss"] for r in records] == pytest.approx([before[s] for s in range(6, 11)], rel=1e-4)
    assert verify_checkpoint(store, spec.name, 10).world_size == 1


@pytest.mark.cluster
def test_two_nodes_with_their_own_workdirs_checkpoint_and_resume(tmp_path: Path) -> None:
    store = store_of(tmp_path)
    ok(torchrun(tmp_path, tiny_spec(steps=6), nproc=1, nodes=2))
    # Each node uploaded what it wrote in its own workdir (rank 0 also wrote .metadata).
    keys = {e.key for e in verify_checkpoint(store, "tiny", 6).files}
    assert keys == {".metadata", "__0_0.distcp", "__1_0.distcp"}

    run = ok(torchrun(tmp_path, tiny_spec(steps=8), nproc=1, nodes=2, attempt=2))

    assert [e["step"] for e in run.event("resumed")] == [6]
    assert committed_steps(store, "tiny")[-1] == 8
    for node in ("node0", "node1"):
        assert not [p for p in (tmp_path / node).rglob("*") if p.is_file()]


@pytest.mark.cluster
def test_an_uneven_batch_and_a_micro_batch_cap_train_like_one_rank_in_one_pass(tmp_path: Path) -> None:
    # 9 samples over 2 ranks: shares of 5 and 4, each pass weighted by its share of the batch. Capped
    # at 4 a pass (run.yaml's micro_batch), one rank takes its 9 in 3 passes of 3, gradients accumulated.
    spec = tiny_spec(batch_size=9, deterministic=True)
    for folder in ("two", "one", "capped"):
        (tmp_path / folder).mkdir()
    ok(torchrun(tmp_path / "two", spec))
    ok(torchrun(tmp_path / "one", spec, nproc=1))
    ok(torchrun(tmp_path / "capped", tiny_spec(batch_size=9, deterministic=True, micro_batch=4), nproc=1))

    two, one, capped = (read_metrics(store_of(tmp_path / d), "tiny") for d in ("two", "one", "capped"))
    assert {(r["world_size"], r["micro_batch"], r["accumulation"]) for r in two} == {(2, 5, 1)}
    assert {(r["world_size"], r["micro_batch"], r["accumulation"]) for r in one} == {(1, 9, 1)}
    assert {(r["world_size"], r["micro_batch"], r["accumulation"]) for r in capped} == {(1, 3, 3)}
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["loss"] for r in capped] == pytest.approx([r["loss"] for r in one], rel=1e-5)


@pytest.mark.cluster
def test_prepared_dataset_records_validation_loss_and_a_changed_dataset_is_refused(
    tmp_path: Path,
) -> None:
    def prepared(name: str, salt: str) -> str:
        src = tmp_path / f"src-{name}"
        src.mkdir()
        for i in range(60):
            (src / f"doc{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i} + {salt!r}\n" * 40)
        dataset.prepare([src], tmp_path / name, val_fraction=0.3)
        return str(tmp_path / name)

    spec = tiny_spec(data=DataSpec(source="prepared", path=prepared("ds1", "a")), eval=EvalSpec(every=5, batches=1))
    ok(torchrun(tmp_path, spec))
    records = read_metrics(store_of(tmp_path), "tiny")
    assert [r["step"] for r in records if "val_loss" in r] == [5, 10]
    assert all(r["val_loss"] > 0 for r in records if "val_loss" in r)

    changed = spec.model_copy(update={"steps": 15, "data": DataSpec(source="prepared", path=prepared("ds2", "b"))})
    refused = torchrun(tmp_path, changed, attempt=2)
    assert not refused.ok
    assert "was trained on dataset version" in refused.stderr
    assert max(losses(store_of(tmp_path), "tiny")) == 10, "nothing trained on the changed data"
