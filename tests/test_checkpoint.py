"""Checkpoints: the commit protocol (unit), and async saves and crash safety under real torchrun
on gloo with a file:// store, and for a kill during upload also the S3 server (integration)."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer import tiny_spec

from infractl import proc, runstore
from infractl.config import CheckpointSpec, ModelSpec, RunSpec
from infractl.runstore import (
    Manifest,
    ManifestEntry,
    checkpoint_prefix,
    committed_steps,
)
from infractl.store import FileStore, Store, StoreError, open_store
from trainer.checkpoint import Checkpointer, SaveFailed
from trainer.faults import REHEARSAL_ENV, UPLOAD_DELAY_ENV

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120


# -- commit protocol (unit) -------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    (tmp_path / "store").mkdir()
    return FileStore(tmp_path / "store")


def _manifest(step: int, sha: str) -> Manifest:
    return Manifest(step=step, world_size=1, files=[ManifestEntry("shard", 4, sha)])


def _put_step(store: Store, step: int, *, commit: bool) -> None:
    store.put_bytes(f"{checkpoint_prefix('r', step)}/shard", b"abcd")
    if commit:
        assert runstore.commit_checkpoint(store, "r", _manifest(step, "0" * 64))


def test_commit_leaves_a_committed_step_alone_unless_asked_to_repair_it(store: FileStore) -> None:
    prefix = checkpoint_prefix("r", 10)
    _put_step(store, 10, commit=True)
    original = store.get_bytes(f"{prefix}/MANIFEST.json")

    assert not runstore.commit_checkpoint(store, "r", _manifest(10, "1" * 64))
    assert store.get_bytes(f"{prefix}/MANIFEST.json") == original  # refused: untouched

    assert not runstore.commit_checkpoint(store, "r", _manifest(10, "2" * 64), replace=True)
    repaired = Manifest.from_json(store.get_bytes(f"{prefix}/MANIFEST.json"))
    assert repaired.files[0].sha256 == "2" * 64
    assert store.get_bytes(f"{prefix}/COMMITTED") == b"10"


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("/etc/cron.d/job", "is absolute"),
        ("../../../etc/cron.d/job", "'..' part"),
        ("shards/../../escape", "'..' part"),
        ("..", "'..' part"),
        ("shards\\..\\..\\escape", "backslash"),
        ("shard\x00.distcp", "unprintable"),
        ("shard\n.distcp", "unprintable"),
        ("shard\x1b[2J", "unprintable"),
        ("", "not a non-empty string"),
        ("shards//x", "empty, '.' or '..' part"),
        ("./shard", "empty, '.' or '..' part"),
        ("shards/", "empty, '.' or '..' part"),
    ],
)
def test_a_manifest_key_that_could_leave_the_restore_directory_is_refused_when_parsed(
    store: FileStore, key: str, why: str
) -> None:
    good = json.loads(_manifest(10, "0" * 64).to_json())
    bad = good | {"files": [*good["files"], {"key": key, "size": 4, "sha256": "0" * 64}]}
    with pytest.raises(ValueError, match=why):
        Manifest.from_json(json.dumps(bad).encode())
    store.put_bytes(f"{checkpoint_prefix('r', 10)}/MANIFEST.json", json.dumps(bad).encode())
    with pytest.raises(StoreError, match="MANIFEST.json is not a valid manifest"):
        runstore.read_manifest(store, "r", 10)


def test_the_keys_a_checkpoint_has_are_accepted() -> None:
    keys = ["__0_0.distcp", ".metadata", "replica/rank-0.pt", "a..b", "step-10/shard 1.bin"]
    files = [{"key": key, "size": 1, "sha256": "0" * 64} for key in keys]
    raw = json.dumps({"step": 1, "world_size": 1, "files": files}).encode()
    assert [entry.key for entry in Manifest.from_json(raw).files] == keys


def test_a_fetch_never_writes_through_a_link_out_of_the_restore_directory(store: FileStore, tmp_path: Path) -> None:
    store.put_bytes(f"{checkpoint_prefix('r', 10)}/shards/0.distcp", b"abcd")
    entry = ManifestEntry("shards/0.distcp", 4, hashlib.sha256(b"abcd").hexdigest())
    outside, restore = tmp_path / "outside", tmp_path / "restore"
    outside.mkdir()
    restore.mkdir()
    (restore / "shards").symlink_to(outside)
    with pytest.raises(runstore.CheckpointError, match="outside the restore directory"):
        runstore.fetch_checkpoint_file(store, "r", 10, entry, restore / entry.key, tag="rank-0")
    assert list(outside.iterdir()) == []
    # A part file planted as a link out is refused the same way; a real directory takes the file.
    (restore / "shards").unlink()
    (restore / "shards").mkdir()
    (restore / "shards" / ".0.distcp.rank-0.part").symlink_to(outside / "target")
    with pytest.raises(runstore.CheckpointError, match="outside the restore directory"):
        runstore.fetch_checkpoint_file(store, "r", 10, entry, restore / entry.key, tag="rank-0")
    assert list(outside.iterdir()) == []
    (restore / "shards" / ".0.distcp.rank-0.part").unlink()
    runstore.fetch_checkpoint_file(store, "r", 10, entry, restore / entry.key, tag="rank-0")
    assert (restore / entry.key).read_bytes() == b"abcd"


def test_a_fetched_file_lands_only_with_the_manifest_size_and_sha256(store: FileStore, tmp_path: Path) -> None:
    store.put_bytes(f"{checkpoint_prefix('r', 10)}/0.distcp", b"abcde")
    restore = tmp_path / "restore"
    for entry, why in (
        (ManifestEntry("0.distcp", 4, hashlib.sha256(b"abcd").hexdigest()), "5 bytes, the manifest says 4"),
        (ManifestEntry("0.distcp", 5, hashlib.sha256(b"abcdf").hexdigest()), "sha256 is"),
    ):
        with pytest.raises(runstore.CheckpointError, match=f"step 10: 0.distcp: {why}"):
            runstore.fetch_checkpoint_file(store, "r", 10, entry, restore / entry.key, tag="rank-0")
        assert list(restore.iterdir()) == []  # neither the file nor its part file
    entry = ManifestEntry("0.distcp", 5, hashlib.sha256(b"abcde").hexdigest())
    runstore.fetch_checkpoint_file(store, "r", 10, entry, restore / entry.key, tag="rank-0")
    assert [p.name for p in restore.iterdir()] == ["0.distcp"]


def test_prune_keeps_a_newer_partial_step_unless_no_save_is_in_flight(store: FileStore) -> None:
    for step in (10, 20, 30):
        _put_step(store, step, commit=True)
    _put_step(store, 25, commit=False)
    _put_step(store, 40, commit=False)  # may be in flight while training runs

    assert runstore.prune_checkpoints(store, "r", keep=2) == [10, 25]
    assert store.list(checkpoint_prefix("r", 40))
    # Resuming: nothing is in flight, so step 40 is a leftover of a killed save.
    assert runstore.prune_checkpoints(store, "r", keep=2, idle=True) == [40]
    assert runstore.committed_steps(store, "r") == [20, 30]
    assert [o.key.split("/")[3] for o in store.list("runs/r/ckpt/")].count("step-00000040") == 0


def test_idle_prune_removes_partials_when_nothing_is_committed(store: FileStore) -> None:
    _put_step(store, 5, commit=False)
    assert runstore.prune_checkpoints(store, "r", keep=2) == []
    assert runstore.prune_checkpoints(store, "r", keep=2, idle=True) == [5]
    assert store.list("runs/r/ckpt/") == []


# -- the Checkpointer in a job of one, in this process ----------------------------------------


class FlakyStore(FileStore):
    """A file:// store whose uploads of some steps fail (an object store that is down)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.failing: set[int] = set()

    def put_file(self, key: str, path: Path) -> None:
        if any(key.startswith(checkpoint_prefix("r", step) + "/") for step in self.failing):
            raise OSError("store unreachable")
        super().put_file(key, path)


def _checkpointer(store: Store, tmp_path: Path) -> Checkpointer:
    return Checkpointer(store, run_id="r", workdir=tmp_path / "work", rank=0, world_size=1, keep=2)


def test_a_failed_save_is_reported_training_goes_on_and_close_raises_if_the_last_fails(
    tmp_path: Path, one_rank: None
) -> None:
    (tmp_path / "store").mkdir()
    store = FlakyStore(tmp_path / "store")
    store.failing = {2, 3, 5}
    checkpointer = _checkpointer(store, tmp_path)
    weight = torch.zeros(64)
    checkpointer.save(1, {"w": weight}, extra={})
    assert checkpointer.wait() == 1

    checkpointer.save(2, {"w": weight}, extra={})
    with pytest.raises(SaveFailed, match="step 2 failed: rank 0: OSError: store unreachable"):
        checkpointer.wait()
    checkpointer.save(3, {"w": weight}, extra={})
    checkpointer.save(4, {"w": weight}, extra={})  # step 3 failed in flight: logged, goes on
    assert checkpointer.wait() == 4
    assert committed_steps(store, "r") == [1, 4]

    checkpointer.save(5, {"w": weight}, extra={})
    with pytest.raises(SaveFailed, match="step 5 failed"):
        checkpointer.close()  # the last checkpoint did not commit: the trainer must not exit 0
    assert committed_steps(store, "r") == [1, 4]
    # Nothing is left staged; the folder itself is the node's and stays.
    assert list((tmp_path / "work" / "staging").iterdir()) == []


def test_the_saved_state_is_the_one_at_save_time_and_a_committed_step_is_left_alone(
    tmp_path: Path, one_rank: None
) -> None:
    (tmp_path / "store").mkdir(exist_ok=True)
    store = FileStore(tmp_path / "store")
    checkpointer = _checkpointer(store, tmp_path)
    weight = torch.zeros(1000)
    checkpointer.save(1, {"w": weight}, extra={})
    weight.add_(1)  # training goes on while the save is in flight
    checkpointer.wait()
    shard = tmp_path / "store" / checkpoint_prefix("r", 1) / "__0_0.distcp"
    saved = shard.read_bytes()

    checkpointer.save(1, {"w": weight}, extra={})  # not a repair: step 1 is committed and fine
    checkpointer.close()
    assert shard.read_bytes() == saved

    loaded = torch.full((1000,), 7.0)
    manifest = _checkpointer(store, tmp_path).load(lambda _: {"w": loaded})
    assert manifest is not None and manifest.step == 1
    assert torch.equal(loaded, torch.zeros(1000))


# -- torchrun on gloo (integration) -----------------------------------------------------------


def spec_of(**overrides: Any) -> RunSpec:
    """test_trainer's tiny spec, a little wider so that saves take measurable time."""
    fields: dict[str, Any] = {"name": "ck", "model": ModelSpec(layers=2, hidden=64, heads=2, seq_len=32)}
    return tiny_spec(**(fields | overrides))


class Job:
    """One torchrun agent (2 workers) started in the background; its JSON log events. Its store
    is ``store_uri`` (``file://`` or ``s3://``), by default ``tmp_path/store``."""

    def __init__(
        self,
        tmp_path: Path,
        spec: RunSpec,
        *,
        attempt: int,
        env: dict[str, str],
        store_uri: str | None = None,
    ) -> None:
        spec_path = tmp_path / f"spec-{attempt}.json"
        spec_path.write_text(spec.model_dump_json())
        (tmp_path / "store").mkdir(exist_ok=True)
        self.log_path = tmp_path / f"attempt{attempt}.log"
        argv = [
            sys.executable, "-m", "torch.distributed.run",
            "--standalone", "--nnodes=1", "--nproc-per-node=2", "--monitor-interval=0.2",
            "-m", "trainer.train",
            "--spec", str(spec_path),
            "--store", store_uri or (tmp_path / "store").as_uri(),
            "--run-id", spec.name,
            "--workdir", str(tmp_path / "node0"),
        ]  # fmt: skip
        environ = (
            os.environ
            | env
            | {
                "OMP_NUM_THREADS": "1",
                "INFRACTL_ATTEMPT": str(attempt),
                "INFRACTL_LOG_FORMAT": "json",
                "PYTHONPATH": str(REPO),
                # Inherited by the agent and its workers (which start their own sessions): finds
                # the whole tree to kill it.
                proc.CLUSTER_ENV: str(tmp_path),
            }
        )
        with self.log_path.open("w") as log:
            self.agent = subprocess.Popen(argv, cwd=REPO, env=environ, stderr=log)

    def wait(self) -> int:
        try:
            return self.agent.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.agent.terminate()
            self.agent.wait(timeout=60)
            pytest.fail(f"torchrun did not finish in {TIMEOUT_S}s:\n{self.text()[-4000:]}")

    def text(self) -> str:
        return self.log_path.read_text()

    def events(self, name: str, *, rank: int = 0) -> list[dict[str, Any]]:
        """Rank ``rank``'s ``name`` events (rank 0, which speaks for the job, by default)."""
        found = []
        for line in self.text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line cut by a kill
                if line.startswith("{") and (event := json.loads(line))["event"] == name and event["rank"] == rank:
                    found.append(event)
        return found


def run(
    tmp_path: Path,
    spec: RunSpec,
    *,
    attempt: int = 1,
    store_uri: str | None = None,
    **env: str,
) -> Job:
    job = Job(tmp_path, spec, attempt=attempt, env=env, store_uri=store_uri)
    assert job.wait() == 0, job.text()[-4000:]
    return job


def timestamp(event: dict[str, Any]) -> float:
    return datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


@pytest.mark.cluster
def test_killed_while_uploading_resumes_from_the_previous_commit_and_cleans_up(tmp_path: Path, store_uri: str) -> None:
    store = open_store(store_uri)  # file:// and the S3 server (conftest's store_uri)
    run(tmp_path, spec_of(steps=5), store_uri=store_uri)
    assert committed_steps(store, "ck") == [5]

    # Resumed at 5, the save of step 10 uploads its shards, then (fault injection) waits
    # before the manifest and COMMITTED: kill the whole tree in that window.
    job = Job(
        tmp_path, spec_of(steps=10), attempt=2, env={REHEARSAL_ENV: "1", UPLOAD_DELAY_ENV: "60"}, store_uri=store_uri
    )
    step10 = checkpoint_prefix("ck", 10)

    def uploaded() -> set[str]:
        return {o.key.rsplit("/", 1)[-1] for o in store.list(f"{step10}/")}

    deadline = time.monotonic() + TIMEOUT_S
    while not {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= uploaded():
        assert job.agent.poll() is None, job.text()[-4000:]
        assert time.monotonic() < deadline, job.text()[-4000:]
        time.sleep(0.05)
    tree = proc.find(tmp_path)
    assert len(tree) >= 3  # the agent and its two workers
    proc.kill(tree)
    assert proc.wait_gone(tmp_path, timeout=20) == []
    job.agent.wait(timeout=20)
    assert uploaded() == {"__0_0.distcp", "__1_0.distcp", ".metadata"}  # no MANIFEST, COMMITTED
    assert [e["step"] for e in job.events("checkpoint_started")] == [10]
    assert not job.events("checkpoint_committed")

    resumed = run(tmp_path, spec_of(steps=7), attempt=3, store_uri=store_uri)

    assert [e["step"] for e in resumed.events("resumed")] == [5]
    assert [e["steps"] for e in resumed.events("checkpoints_cleaned")] == [[10]]
    assert store.list(f"{step10}/") == []
    if isinstance(store, FileStore):
        assert not (store.root / step10).exists()  # no empty directory left either
    assert committed_steps(store, "ck") == [5, 7]
    assert not [p for p in (tmp_path / "node0").rglob("*") if p.is_file()]  # no staging left


@pytest.mark.cluster
def test_save_blocks_training_only_while_staging(tmp_path: Path) -> None:
    # Big enough (20 MB of model and optimizer state) that writing and uploading take a while.
    spec = spec_of(model=ModelSpec(layers=2, hidden=256, heads=4, seq_len=32), steps=10)
    # Each upload holds 1 s more, so the background part outlasts staging even on a loaded machine
    # (staging 20 MB took up to 0.19 s under a busy CI run; the upload alone about as long).
    job = run(tmp_path, spec, **{REHEARSAL_ENV: "1", UPLOAD_DELAY_ENV: "1.0"})
    (tmp_path / "store").mkdir(exist_ok=True)
    store = FileStore(tmp_path / "store")

    committed = job.events("checkpoint_committed")
    assert [e["step"] for e in committed] == [5, 10]
    for event in committed:
        assert event["blocking_s"] < event["seconds"], event
        # Of the time training was blocked, staging (a host-memory copy) is what the save
        # itself cost (the rest waited for the previous save); the write, sha256 and upload
        # that followed ran in the background and took longer.
        staging = event["blocking_s"] - event["waited_s"]
        assert staging < event["seconds"] - event["blocking_s"], event
        assert event["bytes"] > 10_000_000
    extra = runstore.verify_checkpoint(store, "ck", 10).extra
    last = committed[-1]
    assert (extra["blocking_s"], extra["seconds"]) == (last["blocking_s"], last["seconds"])


@pytest.mark.cluster
def test_one_save_in_flight_training_goes_on_and_the_last_commits_before_exit(
    tmp_path: Path,
) -> None:
    spec = spec_of(steps=8, checkpoint=CheckpointSpec(every=2, keep=2))
    # Each save holds for 0.5 s after its upload: the next save (two steps later) finds it in
    # flight and must wait for it.
    job = run(tmp_path, spec, **{REHEARSAL_ENV: "1", UPLOAD_DELAY_ENV: "0.5"})
    (tmp_path / "store").mkdir(exist_ok=True)
    store = FileStore(tmp_path / "store")

    order = [
        (e["event"], e["step"])
        for e in (json.loads(line) for line in job.text().splitlines() if line.startswith("{"))
        if e["event"] in ("checkpoint_started", "checkpoint_committed", "finished") and e["rank"] == 0
    ]
    # Never two in flight: each save starts only once the previous one committed, and the
    # last one committed before the trainer finished (and exited 0).
    assert order == [
        (event, step) for step in (2, 4, 6, 8) for event in ("checkpoint_started", "checkpoint_committed")
    ] + [("finished", 8)]
    committed = job.events("checkpoint_committed")
    assert all(e["waited_s"] > 0 for e in committed[1:]), committed  # the guard did wait
    assert all(e["blocking_s"] < e["seconds"] for e in committed)
    assert committed_steps(store, "ck") == [6, 8]
    runstore.verify_checkpoint(store, "ck", 8)

    # Training went on while each save was in flight: the next step finished before it committed.
    finished_at = {r["step"]: r["time"] for r in runstore.read_metrics(store, "ck")}
    for event in committed[:-1]:
        assert finished_at[event["step"] + 1] < timestamp(event), event
