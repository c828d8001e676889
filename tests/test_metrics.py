"""trainer/metrics.py and trainer/fingerprint.py: the step time split, peak memory, TensorBoard
event files in the store, and the environment fingerprint (unit, and one torchrun on gloo)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_trainer import Run, store_of, tiny_spec, torchrun

import infractl
from infractl.runstore import StepRecord, read_metrics, verify_checkpoint
from infractl.store import Store
from trainer.fingerprint import environment_fingerprint, git_revision, running_image
from trainer.metrics import MetricsWriter, peak_memory_bytes, tensorboard_prefix

REPO = Path(__file__).resolve().parents[1]
SPLIT = ("data_s", "forward_backward_s", "optimizer_s")
# Host timers around work of a few milliseconds: their sum may pass the step's own timer by
# the cost of taking the marks and by rounding to microseconds.
MARGIN_S = 0.002
STEPS, CHECKPOINTS = 12, {5, 10, 12}  # tiny_spec checkpoints every 5 steps, and the last


def record(step: int, **fields: Any) -> StepRecord:
    base = StepRecord(step=step, loss=2.0, step_time_s=0.1, tokens_per_s=1.0, world_size=1,
                      attempt=1, restart_count=0, time=1.0, data_s=0.01, forward_backward_s=0.05,
                      optimizer_s=0.02, comm_s=0.01, checkpoint_blocking_s=0.0,
                      peak_memory_bytes=1)  # fmt: skip
    return base | fields  # type: ignore[return-value]


def scalars(store: Store, run_id: str, tmp_path: Path) -> dict[str, dict[int, float]]:
    """The run's TensorBoard scalars, read back from a download of its event files."""
    local = tmp_path / "tensorboard-download"
    local.mkdir(parents=True)
    for obj in store.list(f"{tensorboard_prefix(run_id)}/"):
        store.get_file(obj.key, local / obj.key.rsplit("/", 1)[-1])
    events = EventAccumulator(str(local))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


# -- unit ------------------------------------------------------------------------------------


def test_peak_memory_is_reported_in_bytes() -> None:
    # A Python process with torch imported holds tens of MiB: KiB read as bytes would not.
    assert peak_memory_bytes(torch.device("cpu")) > 20 * 2**20


def test_fingerprint_names_the_software_the_checkout_and_the_host_runtime() -> None:
    fingerprint = environment_fingerprint(world_size=4)
    assert fingerprint["torch"] == torch.__version__
    assert fingerprint["infractl"] == infractl.__version__
    assert fingerprint["world_size"] == 4
    # This test runs on the host: no container, so no image is claimed.
    assert (fingerprint["runtime"], fingerprint["image"], fingerprint["image_digest"]) == ("host", None, None)
    assert fingerprint["interpreter"] == sys.executable
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert fingerprint["git_revision"] == (head.stdout.strip() if head.returncode == 0 else None)


def test_the_running_image_is_what_the_container_engine_says(tmp_path: Path) -> None:
    digest = "sha256:" + "ab" * 32
    containerenv = tmp_path / ".containerenv"
    containerenv.write_text(
        f'engine="podman-4.3.1"\nname="infractl-r-node-0"\nimage="10.200.3.1:5000/infractl/trainer@{digest}"\n'
        'imageid="0123"\nrootless=0\n'
    )
    assert running_image(containerenv) == {
        "engine": "podman-4.3.1",
        "name": "infractl-r-node-0",
        "image": f"10.200.3.1:5000/infractl/trainer@{digest}",
        "imageid": "0123",
        "rootless": "0",
    }
    assert running_image(tmp_path / "absent") is None


def test_git_revision_is_none_outside_a_checkout(tmp_path: Path) -> None:
    assert git_revision(tmp_path) is None


def test_tensorboard_files_are_uploaded_whole_on_flush_and_local_copies_go_on_close(
    tmp_path: Path,
) -> None:
    store = store_of(tmp_path)
    local = tmp_path / "node0" / "tensorboard" / "r"
    writer = MetricsWriter(store, "r", tensorboard_dir=local, every_steps=100)
    writer.add(record(1, loss=3.0))
    writer.add(record(2, loss=2.5, checkpoint_blocking_s=None))
    writer.flush()
    uploaded = store.list(f"{tensorboard_prefix('r')}/")
    assert len(uploaded) == 1
    assert scalars(store, "r", tmp_path)["loss"] == {1: 3.0, 2: 2.5}

    # A step added again (a checkpoint step, after its save) adds only what was missing.
    writer.add(record(2, loss=2.5, checkpoint_blocking_s=0.25))
    writer.close()
    writer.close()
    charts = scalars(store, "r", tmp_path / "again")
    assert charts["loss"] == {1: 3.0, 2: 2.5}
    assert charts["time/checkpoint_blocking_s"] == {1: 0.0, 2: 0.25}
    assert [r["checkpoint_blocking_s"] for r in read_metrics(store, "r")] == [0.0, 0.25]
    assert not (tmp_path / "node0" / "tensorboard").exists()


def test_without_a_tensorboard_dir_only_records_are_written(tmp_path: Path) -> None:
    store = store_of(tmp_path)
    writer = MetricsWriter(store, "r")
    writer.add(record(1))
    writer.close()
    assert [r["step"] for r in read_metrics(store, "r")] == [1]
    assert not store.list(f"{tensorboard_prefix('r')}/")


# -- torchrun on gloo (integration) -----------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run]:
    tmp_path = tmp_path_factory.mktemp("ddp")
    run = torchrun(tmp_path, tiny_spec(steps=STEPS))
    assert run.ok, run.stderr[-4000:]
    return tmp_path, run


@pytest.mark.cluster
def test_records_split_the_step_time_and_carry_peak_memory(ddp_run: tuple[Path, Run]) -> None:
    tmp_path, _ = ddp_run
    records = read_metrics(store_of(tmp_path), "tiny")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        parts = [r[name] for name in SPLIT]
        assert all(part >= 0 for part in parts), r
        assert sum(parts) <= r["step_time_s"] + MARGIN_S, r
        # DDP's all-reduce overlaps the backward; it can only be in flight within the step.
        assert 0 < r["comm_s"] <= r["step_time_s"] + MARGIN_S, r
        assert r["peak_memory_bytes"] > 0
    assert {r["step"] for r in records if r["checkpoint_blocking_s"] > 0} == CHECKPOINTS
    assert all(r["checkpoint_blocking_s"] == 0.0 for r in records if r["step"] not in CHECKPOINTS)
    peaks = [r["peak_memory_bytes"] for r in records]
    assert peaks == sorted(peaks)  # a peak so far never falls


@pytest.mark.cluster
def test_first_record_and_every_checkpoint_carry_the_fingerprint(
    ddp_run: tuple[Path, Run],
) -> None:
    tmp_path, run = ddp_run
    store = store_of(tmp_path)
    records = read_metrics(store, "tiny")
    assert [r["step"] for r in records if "environment" in r] == [1]
    fingerprint = records[0]["environment"]
    assert fingerprint["world_size"] == 2
    assert fingerprint["torch"] == torch.__version__
    assert fingerprint["infractl"] == infractl.__version__
    for step in (10, 12):  # the checkpoints retention keeps
        assert verify_checkpoint(store, "tiny", step).extra["environment"] == fingerprint
    [logged] = run.event("environment")
    assert {k: logged[k] for k in fingerprint} == fingerprint


@pytest.mark.cluster
def test_tensorboard_event_file_in_the_store_holds_every_step(ddp_run: tuple[Path, Run], tmp_path: Path) -> None:
    run_dir, _ = ddp_run
    store = store_of(run_dir)
    records = read_metrics(store, "tiny")
    charts = scalars(store, "tiny", tmp_path)
    assert charts["loss"] == pytest.approx({r["step"]: r["loss"] for r in records}, rel=1e-6)
    for tag in ("tokens_per_s", "time/data_s", "time/forward_backward_s", "time/optimizer_s",
                "time/comm_s", "time/checkpoint_blocking_s", "memory/peak_bytes"):  # fmt: skip
        assert set(charts[tag]) == set(range(1, STEPS + 1)), tag
    assert not [p for p in (run_dir / "node0").rglob("*") if p.is_file()]  # uploaded, removed
