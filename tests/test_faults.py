"""Faults the trainer must ride out: a hung worker (watchdog), preemption (SIGTERM), a store outage;
and the drills' hooks that inject faults (trainer/faults.py), refused outside a rehearsal.

Unit tests for the pure parts, then real torchrun runs on gloo with tiny models.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import structlog
import torch
from test_trainer import REPO, Agents, Run, ok, start_torchrun, store_of, tiny_spec, torchrun

from infractl.config import CheckpointSpec, WatchdogSpec
from infractl.errors import UsageError
from infractl.runstore import (
    StepRecord,
    committed_steps,
    latest_committed_step,
    latest_metrics,
    read_metrics,
    verify_checkpoint,
)
from infractl.store import FileStore
from trainer.backoff import retry_delays
from trainer.checkpoint import Checkpointer
from trainer.faults import CORRUPT_WEIGHTS_ENV, REHEARSAL_ENV, REPLICA_CORRUPT_ENV, UPLOAD_DELAY_ENV, Faults
from trainer.metrics import MetricsWriter
from trainer.watchdog import CollectiveTimeout

from conftest import wait_for_commit

#: How long torchrun's agent waits for its workers to end after SIGTERM before it SIGKILLs them.
SIGTERM_GRACE_S = 30

# -- helpers ----------------------------------------------------------------------------------


class OutageStore(FileStore):
    """A file store whose writes fail while ``down`` (unit tests only; the integration test
    takes the real store's directory away)."""

    down = False

    def put_bytes(self, key: str, data: bytes) -> None:
        if self.down:
            raise OSError("store unreachable")
        super().put_bytes(key, data)


def record(step: int) -> StepRecord:
    return StepRecord(step=step, loss=1.0, step_time_s=0.1, tokens_per_s=1.0, world_size=1,
                      attempt=1, restart_count=0, time=0.0)  # fmt: skip


def worker_pids(agent: subprocess.Popen[bytes], count: int, *, timeout: float = 60) -> list[int]:
    """The pids of the agent's ``count`` workers, once it started them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = psutil.Process(agent.pid).children()
        if len(children) >= count:
            return [c.pid for c in children]
        time.sleep(0.1)
    raise AssertionError(f"torchrun {agent.pid} did not start {count} workers in {timeout}s")


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie whose dead parent was the agent does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def still_running(pids: list[int], *, within: float) -> list[str]:
    """Those of ``pids`` still running after ``within`` seconds, with their state and command line.
    An orphaned worker (its agent was SIGKILLed) may need a moment to finish exiting under load."""
    deadline = time.monotonic() + within
    while [pid for pid in pids if running(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    left = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if running(pid):
                p = psutil.Process(pid)
                left.append(f"{pid} {p.status()} {' '.join(p.cmdline())}")
    return left


def wait_for_step(store: FileStore, run_id: str, *, at_least: int, timeout: float) -> int:
    """Poll the metrics until a record of ``at_least`` or later is written; return its step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        newest = latest_metrics(store, run_id)
        if newest is not None and newest["step"] >= at_least:
            return int(newest["step"])
        time.sleep(0.05)
    raise AssertionError(f"run {run_id} recorded no step {at_least} within {timeout}s")


# -- unit -------------------------------------------------------------------------------------


def _wait_for_log(agents: Agents, *wanted: tuple[str, ...], timeout: float) -> None:
    """Until the running agents' log has, for each tuple of ``wanted``, an event of one of its names
    (any rank's)."""
    deadline = time.monotonic() + timeout
    while True:
        run = Run([], agents.text())
        missing = [names for names in wanted if not any(run.event(n, rank=None) for n in names)]
        if not missing:
            return
        assert time.monotonic() < deadline, f"no {' or '.join(missing[0])} event within {timeout:g}s"
        time.sleep(0.2)


def test_retry_delays_double_up_to_the_cap_and_stay_within_the_total() -> None:
    delays = retry_delays(first_s=1.0, cap_s=15.0, total_s=600.0)
    assert delays[:6] == [1.0, 2.0, 4.0, 8.0, 15.0, 15.0]
    assert 600.0 - 15.0 < sum(delays) <= 600.0


def test_metrics_refused_by_the_store_are_kept_and_written_when_it_is_back(
    tmp_path: Path,
) -> None:
    (tmp_path / "store").mkdir()
    store = OutageStore(tmp_path / "store")
    writer = MetricsWriter(store, "r", every_steps=2, every_s=3600.0)
    store.down = True
    with structlog.testing.capture_logs() as logs:
        for step in range(1, 7):
            writer.add(record(step))  # three failed chunks: training is not interrupted
        store.down = False
        writer.add(record(7))
        writer.flush()
        writer.close()

    assert [r["step"] for r in read_metrics(store, "r")] == list(range(1, 8))
    events = [e["event"] for e in logs if e["event"].startswith("metrics_write")]
    assert events == ["metrics_write_failed", "metrics_write_recovered"]  # one per streak


def test_closing_the_metrics_retries_until_the_store_is_back(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    store = OutageStore(tmp_path / "store")
    writer = MetricsWriter(store, "r", close_retry_delays=[0.0] * 5)
    writer.add(record(1))
    store.down = True
    retries = iter(range(5))

    def sleep(seconds: float) -> None:  # the store comes back during the third wait
        store.down = next(retries) < 2

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("trainer.metrics.time.sleep", sleep)
        writer.close()
    assert [r["step"] for r in read_metrics(store, "r")] == [1]


def test_closing_the_metrics_raises_once_the_retries_are_spent(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    store = OutageStore(tmp_path / "store")
    writer = MetricsWriter(store, "r", close_retry_delays=[0.0, 0.0])
    writer.add(record(1))
    store.down = True
    with pytest.raises(OSError, match="store unreachable"):
        writer.close()


def test_settle_waits_a_bounded_time_for_the_save_in_flight(
    tmp_path: Path, one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "store").mkdir()
    store = FileStore(tmp_path / "store")
    checkpointer = Checkpointer(
        store, run_id="r", workdir=tmp_path / "work", rank=0, world_size=1, keep=2, upload_delay_s=1
    )
    assert checkpointer.settle(0.1) is False  # nothing in flight
    checkpointer.save(1, {"w": torch.zeros(8)}, extra={})
    # Still in its upload delay after 0.1 s: settle says so instead of waiting the upload out.
    assert checkpointer.settle(0.1) is True
    assert checkpointer.settle(30) is False
    checkpointer.save(2, {"w": torch.ones(8)}, extra={"reason": "final"})
    checkpointer.close()
    manifest = verify_checkpoint(store, "r", 2)
    assert manifest.extra["reason"] == "final"
    assert manifest.extra["waited_s"] > 0.5  # settling counts as the save's wait


def test_the_hooks_are_read_typed_in_a_rehearsal() -> None:
    assert Faults.from_environ({}) == Faults()
    hooks = {UPLOAD_DELAY_ENV: "1.5", CORRUPT_WEIGHTS_ENV: "50", REPLICA_CORRUPT_ENV: "peer", REHEARSAL_ENV: "1"}
    assert Faults.from_environ(hooks) == Faults(
        upload_delay_s=1.5, corrupt_weights_at_step=50, corrupt_peer_replicas=True
    )
    assert Faults.from_environ({CORRUPT_WEIGHTS_ENV: " ", REHEARSAL_ENV: "0"}) == Faults()  # empty: unset


@pytest.mark.parametrize("hook", [UPLOAD_DELAY_ENV, CORRUPT_WEIGHTS_ENV, REPLICA_CORRUPT_ENV])
def test_a_hook_outside_a_rehearsal_is_refused_naming_it(hook: str) -> None:
    for rehearsal in ({}, {REHEARSAL_ENV: "0"}):
        with pytest.raises(
            UsageError, match=f"^{hook}: a fault-injection hook .* this run is not a rehearsal"
        ) as refused:
            Faults.from_environ({hook: "1", **rehearsal})
        assert refused.value.field == hook


@pytest.mark.parametrize(
    ("hook", "value", "message"),
    [
        (UPLOAD_DELAY_ENV, "soon", "must be a number of seconds"),
        (UPLOAD_DELAY_ENV, "-1", "must be a number of seconds, at least 0"),
        (UPLOAD_DELAY_ENV, "nan", "must be a number of seconds"),
        (CORRUPT_WEIGHTS_ENV, "none", "must be a step number"),
        (CORRUPT_WEIGHTS_ENV, "-3", "must be a step number"),
        (REPLICA_CORRUPT_ENV, "own", "must be 'peer'"),
    ],
)
def test_a_hook_set_to_a_value_it_does_not_take_is_refused(hook: str, value: str, message: str) -> None:
    with pytest.raises(UsageError, match=f"^{hook}: {message}"):
        Faults.from_environ({hook: value, REHEARSAL_ENV: "1"})


# -- torchrun on gloo (integration) -----------------------------------------------------------


def test_the_collective_timeout_follows_the_slowest_step_within_its_bounds() -> None:
    applied: list[float] = []
    timeout = CollectiveTimeout(min_s=5, max_s=150, apply=applied.append, report=lambda seconds, slowest: None)
    timeout.observe([9.0])  # before start: the first step's loading is not a pace
    timeout.start()
    timeout.observe([0.2] * 4)  # too few steps to judge
    assert applied == [150]
    timeout.observe([0.3])
    assert applied == [150, 5] and timeout.current == 5  # 10 x 0.3 s is below the floor
    timeout.observe([1.23])
    assert applied[-1] == 12.5  # 10 x the slowest, in whole half seconds
    timeout.observe([0.1])
    assert applied[-1] == 12.5  # the slowest step only grows
    with timeout.relaxed():  # the log step's collective: a rank may wait for its save first
        assert applied[-1] == 150
        with timeout.relaxed():
            timeout.observe([1.4])  # 14 s, applied when the outer block ends
        assert applied[-1] == 150
    assert applied[-1] == 14
    with timeout.relaxed(when=False):
        assert applied[-1] == 14
    timeout.observe([60.0])
    assert applied[-1] == 150  # at most half the step timeout
    assert CollectiveTimeout(min_s=5, max_s=4, apply=applied.append, report=print).min_s == 4


@pytest.mark.cluster
def test_a_hung_worker_is_reaped_by_the_watchdog_and_the_next_run_resumes_from_the_last_commit(
    tmp_path: Path,
) -> None:
    # With the file timer on, as the launcher runs it. The stopped rank's peer fails its
    # collective at half the step timeout and exits; the agent then gives the stopped worker
    # 30 s to end after SIGTERM, but its deadline comes first: the agent's timer server
    # SIGKILLs it and then the agent itself (torch 2.13, see trainer/watchdog.py). The node is
    # lost; the next attempt resumes from the last committed step.
    spec = tiny_spec(
        steps=30,
        checkpoint=CheckpointSpec(every=5, keep=2),
        watchdog=WatchdogSpec(step_timeout_s=6),
        max_restarts=1,
    )
    store = store_of(tmp_path)
    timer = {
        "TORCHELASTIC_ENABLE_FILE_TIMER": "1",
        "TORCHELASTIC_TIMER_FILE": str(tmp_path / "timer"),
    }
    agents = start_torchrun(tmp_path, spec, torchrun_args=["--max-restarts=1"], env=timer)
    workers = worker_pids(agents.procs[0], 2)
    wait_for_commit(store, spec.name, at_least=5, timeout=60)
    stopped = time.monotonic()
    os.kill(workers[1], signal.SIGSTOP)

    run = agents.finish()
    # Read once every process is gone: a commit whose files were all uploaded may land after the stop.
    committed_before = latest_committed_step(store, spec.name)

    assert run.returncodes == [-signal.SIGKILL], run.stderr[-4000:]
    # The deadline reaped the stopped worker: the agent's SIGTERM grace would have taken 30 s.
    assert time.monotonic() - stopped < SIGTERM_GRACE_S
    assert still_running(workers, within=10) == []  # nothing left behind
    assert "Timed out waiting 3000ms" in run.stderr  # the peer's collective: half of 6 s
    assert [e["file_timer"] for e in run.event("watchdog_started")] == [True]
    assert committed_before is not None and committed_before > 0

    again = ok(torchrun(tmp_path, spec, attempt=2))

    assert [e["step"] for e in again.event("resumed")] == [committed_before]
    records = read_metrics(store, spec.name)
    assert [r["step"] for r in records if r["attempt"] == 2][0] == committed_before + 1
    assert [r["step"] for r in records] == list(range(1, spec.steps + 1))
    assert committed_steps(store, spec.name)[-1] == spec.steps


@pytest.mark.cluster
def test_sigterm_saves_an_emergency_checkpoint_and_the_next_run_resumes_from_it(
    tmp_path: Path,
) -> None:
    # No scheduled save within the run: the only checkpoint is the emergency one.
    spec = tiny_spec(steps=30, checkpoint=CheckpointSpec(every=1000, keep=2), log_every=4)
    store = store_of(tmp_path)
    agents = start_torchrun(tmp_path, spec, torchrun_args=["--shutdown-timeout=30"])
    worker_pids(agents.procs[0], 2)
    reached = wait_for_step(store, spec.name, at_least=3, timeout=60)
    agents.procs[0].send_signal(signal.SIGTERM)
    run = agents.finish()

    [preempted] = run.event("preempted")  # rank 0 speaks for the job
    step = preempted["step"]
    # The agent signals its workers one after the other: the step's all-reduce may carry one
    # notice or both.
    assert preempted["signalled"] is True and preempted["ranks_signalled"] in (1, 2)
    assert reached <= step < spec.steps
    # The ranks learn of the notice at the next log step: within log_every steps of it.
    assert 0 <= step - preempted["noticed_at_step"] <= spec.log_every, preempted
    assert committed_steps(store, spec.name) == [step]
    manifest = verify_checkpoint(store, spec.name, step)
    assert manifest.extra["reason"] == "preemption"
    # The agent itself reports the signal with a traceback; the trainers exit cleanly.
    assert f'File "{REPO / "trainer"}' not in run.stderr, run.stderr[-4000:]
    assert not [e for e in run.events if e["level"] == "error"], run.stderr[-4000:]

    again = ok(torchrun(tmp_path, spec, attempt=2))

    assert [e["step"] for e in again.event("resumed")] == [step]
    records = read_metrics(store, spec.name)
    assert [r["step"] for r in records if r["attempt"] == 2][0] == step + 1
    assert [r["step"] for r in records] == list(range(1, spec.steps + 1))
    assert verify_checkpoint(store, spec.name, spec.steps).extra["reason"] == "final"


def test_a_trainer_started_with_a_hook_outside_a_rehearsal_refuses_and_writes_nothing(tmp_path: Path) -> None:
    spec = tiny_spec(steps=5)
    run = start_torchrun(tmp_path, spec, env={UPLOAD_DELAY_ENV: "1"}).finish()
    assert not run.ok
    refused = [e["event"] for e in run.events if e.get("level") == "error"]
    assert refused and all(e.startswith(f"{UPLOAD_DELAY_ENV}: a fault-injection hook") for e in refused), refused
    assert run.event("stopped", rank=None) and {e["reason"] for e in run.event("stopped", rank=None)} == {"refused"}
    assert committed_steps(store_of(tmp_path), spec.name) == []


@pytest.mark.cluster
def test_training_rides_out_a_store_outage_and_commits_when_the_store_is_back(
    tmp_path: Path,
) -> None:
    spec = tiny_spec(steps=120, checkpoint=CheckpointSpec(every=5, keep=2))
    store = store_of(tmp_path)
    root, away = tmp_path / "store", tmp_path / "store-away"
    # Each save takes over a second: saves overlap each other and the outage.
    agents = start_torchrun(tmp_path, spec, env={REHEARSAL_ENV: "1", UPLOAD_DELAY_ENV: "1"})
    wait_for_commit(store, spec.name, at_least=5, timeout=60)
    root.rename(away)
    try:
        with pytest.raises(OSError):
            FileStore(root).put_bytes("probe", b"")
        assert not root.exists(), "FileStore must never re-create its vanished root"
        # The outage lasts until training has met it: a save and a metrics write failed.
        _wait_for_log(agents, ("metrics_write_failed",), ("checkpoint_failed", "checkpoint_skipped"), timeout=120)
    finally:
        away.rename(root)
    run = ok(agents.finish())

    assert committed_steps(store, spec.name)[-1] == spec.steps
    for step in committed_steps(store, spec.name):
        verify_checkpoint(store, spec.name, step)
    assert [r["step"] for r in read_metrics(store, spec.name)] == list(range(1, spec.steps + 1))
    assert run.event("checkpoint_failed") or run.event("checkpoint_skipped")
    assert len(run.event("metrics_write_failed")) == 1  # one warning for the whole outage
    assert not run.event("resumed")  # nothing was loaded, let alone an uncommitted step
