"""torch.profiler traces of chosen steps: run.yaml's ``profile.steps`` (unit and real torchrun on
gloo), the rules of a window across restarts and requests (trainer/profiling.py, in process), and
``infractl profile`` against a run on a real 2-node cluster, with its refusals."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
import structlog
import torch
from test_trainer import ok, store_of, tiny_spec, torchrun

from infractl import runstore
from infractl.config import ProfileSpec
from infractl.runstore import ProfileRequest
from infractl.store import FileStore, Store
from trainer.profiling import NEVER, StepProfiler

from conftest import REPO, Cli, module_cluster, write


def markers(store: Store, key: str) -> list[int]:
    """The steps a trace marks (its ``ProfilerStep#N`` ranges), in order."""
    trace = json.loads(gzip.decompress(store.get_bytes(key)))
    names = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    return sorted(int(name.split("#")[1]) for name in names)


# -- the window's rules, in process -----------------------------------------------------------


def file_store(tmp_path: Path) -> FileStore:
    (tmp_path / "store").mkdir()
    return FileStore(tmp_path / "store")


def profiler(tmp_path: Path, store: Store, window: tuple[int, int] | None, **kwargs: object) -> StepProfiler:
    return StepProfiler(
        store, "r", rank=0, device=torch.device("cpu"), workdir=tmp_path / "work", window=window, **kwargs
    )


def train(profiler: StepProfiler, steps: Iterable[int]) -> None:
    """What the training loop does with the profiler, with a little work per step."""
    for step in steps:
        if step >= profiler.due:
            profiler.at(step)
        torch.ones(8, 8) @ torch.ones(8, 8)
    profiler.close()


def test_a_process_that_starts_inside_the_window_traces_the_steps_left(tmp_path: Path) -> None:
    store = file_store(tmp_path)
    restarted = profiler(tmp_path, store, (3, 6))
    with structlog.testing.capture_logs() as logs:
        restarted.start(first_step=5)  # resumed from a checkpoint of step 4
        train(restarted, range(5, 9))
    assert markers(store, runstore.profile_trace_key("r", 3, 6, 0)) == [5, 6]
    assert {"event": "profile_partial", "steps": "3:6", "tracing": "5:6", "source": "profile.steps"} in [
        {k: v for k, v in e.items() if k != "log_level"} for e in logs
    ]
    # The local copy goes once uploaded (its folders stay, for the node's other ranks).
    assert not [p for p in (tmp_path / "work").rglob("*") if p.is_file()]


def test_a_window_already_passed_or_already_traced_is_not_traced_again(tmp_path: Path) -> None:
    store = file_store(tmp_path)
    passed = profiler(tmp_path, store, (3, 5))
    passed.start(first_step=6)
    assert passed.due == NEVER  # nothing but the compare in the loop
    train(passed, range(6, 9))
    assert runstore.profile_traces(store, "r") == {}

    key = runstore.profile_trace_key("r", 3, 5, 0)
    store.put_bytes(key, b"the whole window, traced before a restart")
    resumed_before = profiler(tmp_path, store, (3, 5))
    resumed_before.start(first_step=2)
    assert resumed_before.due == NEVER
    train(resumed_before, range(2, 9))
    assert store.get_bytes(key) == b"the whole window, traced before a restart"


def test_a_request_is_picked_up_by_every_rank_and_one_that_came_too_late_is_missed(tmp_path: Path) -> None:
    store = file_store(tmp_path)
    ranks = profiler(tmp_path, store, None, poll_s=0.05)
    with structlog.testing.capture_logs() as logs:
        ranks.start(first_step=1)
        runstore.write_profile_request(store, "r", ProfileRequest(first=10, last=11, requested=time.time()))
        wait_until(lambda: ranks.due == 10)
        for step in range(1, 15):
            if step >= ranks.due:
                ranks.at(step)
        # The next request names steps the run has passed by the time a rank reads it.
        runstore.write_profile_request(store, "r", ProfileRequest(first=12, last=13, requested=time.time()))
        wait_until(lambda: ranks.due == 12)
        train(ranks, range(15, 17))
    assert markers(store, runstore.profile_trace_key("r", 10, 11, 0)) == [10, 11]
    assert list(runstore.profile_traces(store, "r")) == [(10, 11)]
    assert any(e["event"] == "profile_missed" and e["steps"] == "12:13" for e in logs)


def test_a_store_that_stays_down_is_a_warning_and_the_trace_is_kept(tmp_path: Path) -> None:
    store = file_store(tmp_path)
    down = profiler(tmp_path, store, (1, 2), upload_delays=[0.01])
    down.start(first_step=1)
    (tmp_path / "store").rename(tmp_path / "away")
    with structlog.testing.capture_logs() as logs:
        train(down, range(1, 4))
    (failed,) = [e for e in logs if e["event"] == "profile_upload_failed"]
    assert failed["log_level"] == "warning" and failed["error"].startswith("store file://")
    assert Path(failed["kept"]).is_file() and Path(failed["kept"]).name == "rank-0.pt.trace.json.gz"


def test_a_process_that_exits_inside_the_window_stops_the_profiler_first(tmp_path: Path) -> None:
    # With the profiler on, the interpreter's exit crashes (SIGSEGV): a preempted rank must exit
    # with its own code (0, or 75 to be restarted), the trace dropped.
    script = f"""
from pathlib import Path
import torch
from infractl.log import setup
from infractl.store import FileStore
from trainer.profiling import StepProfiler
setup()
profiler = StepProfiler(FileStore(Path({str(tmp_path / "store")!r})), "r", rank=0, device=torch.device("cpu"),
                        workdir=Path({str(tmp_path / "work")!r}), window=(1, 5))
profiler.start(first_step=1)
profiler.at(1)
torch.ones(8, 8) @ torch.ones(8, 8)
raise SystemExit(75)
"""
    file_store(tmp_path)
    exited = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert exited.returncode == 75, exited.stderr
    assert "profile_abandoned" in exited.stderr
    assert runstore.profile_traces(FileStore(tmp_path / "store"), "r") == {}


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- run.yaml's profile.steps under real torchrun ------------------------------------------------


@pytest.mark.cluster
def test_two_ranks_trace_the_configured_steps_into_the_store_and_finish(tmp_path: Path) -> None:
    spec = tiny_spec(steps=8, profile=ProfileSpec(steps="3:5"))
    run = ok(torchrun(tmp_path, spec))
    store = store_of(tmp_path)
    traces = runstore.profile_traces(store, spec.name)
    assert list(traces) == [(3, 5)] and sorted(traces[(3, 5)]) == [0, 1]
    for rank, info in traces[(3, 5)].items():
        assert info.key == f"runs/tiny/profiles/3-5/rank-{rank}.pt.trace.json.gz"
        assert markers(store, info.key) == [3, 4, 5]  # those steps, and no other
        trace = json.loads(gzip.decompress(store.get_bytes(info.key)))
        assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2
        # record_shapes: the ops carry their input shapes.
        assert any("Input Dims" in e.get("args", {}) for e in trace["traceEvents"])
    assert runstore.latest_committed_step(store, spec.name) == 8
    assert [e["step"] for e in run.event("finished")] == [8]
    assert [e["traced"] for e in run.event("profile_uploaded")] == ["3:5"]  # rank 0's line
    assert not [p for p in (tmp_path / "node0").rglob("*") if p.is_file()]


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("3:5", 'must be FIRST:LAST in quotes, e.g. "3:5" (YAML read a number, 185'),
        ('"5:3"', "5:3: the last step (3) comes before the first (5)"),
        ('"0:2"', "0:2: steps count from 1"),
        ('"1:51"', "1:51 is 51 steps; a window holds at most 50"),
        ('"45:55"', "45:55 ends after the run's last step (50)"),
        ('"3-5"', "must be FIRST:LAST, the first and last step to profile (both included), not '3-5'"),
    ],
)
def test_a_bad_profile_window_is_refused_naming_the_field(cli: Cli, value: str, message: str) -> None:
    run = write(cli.cwd / "run.yaml", f"name: r\nsteps: 50\nprofile: {{steps: {value}}}\n")
    result = cli("train", str(run), "--json", expect=2)
    assert f"run.yaml: profile.steps: {message}" in result.stderr
    assert json.loads(result.stdout)["error"]["field"] == "profile.steps"
    assert not cli.home.exists()


def test_profile_refuses_a_bad_window_and_a_cluster_that_is_not_up(cli: Cli) -> None:
    bad = cli("profile", "r", "--steps", "7", expect=2)
    assert "error: --steps: must be FIRST:LAST" in bad.stderr
    assert "--steps: 9:8: the last step (8) comes before" in cli("profile", "r", "--steps", "9:8", expect=2).stderr
    assert "cluster 'local' is not up" in cli("profile", "r", "--steps", "8:9", expect=2).stderr
    assert not cli.home.exists() or not any(cli.home.iterdir())


# -- infractl profile on a running run (a real 2-node cluster) -----------------------------------

RUN = """\
name: prof
model: {layers: 1, hidden: 32, heads: 2, seq_len: 32}
data: {max_bytes: 100000}
batch_size: 4
steps: 1000000
checkpoint: {every: 100000, keep: 2}
nodes: {min: 1, max: 2}
min_step_s: 0.02
"""


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cli, FileStore]]:
    """A 2-node cluster running a long run, once it recorded its first steps. Paced: at full speed
    on a loaded machine it once ran more steps between two `profile` commands than the lead the
    first refusal named, three times in a row."""
    with module_cluster(tmp_path_factory, "profile") as cli:
        cli("train", str(write(cli.cwd / "run.yaml", RUN)), "--detach")
        store = FileStore(cli.home / "local" / "store")
        wait_until(lambda: runstore.latest_metrics(store, "prof") is not None, timeout=120)
        yield cli, store


@pytest.mark.cluster
@pytest.mark.xdist_group("profile-cluster")
def test_profile_refuses_a_window_in_the_past_or_after_the_end_and_a_run_not_running(
    running: tuple[Cli, FileStore],
) -> None:
    cli, _ = running
    past = cli("profile", "prof", "--steps", "1:2", "--json", expect=2)
    assert "--steps: 1:2 starts too soon: the run's newest step in the store is" in past.stderr
    assert json.loads(past.stdout)["error"]["field"] == "--steps"
    after = cli("profile", "prof", "--steps", "1000000:1000001", expect=2).stderr
    assert "--steps: 1000000:1000001 ends after the run's last step (1000000)" in after
    other = cli("profile", "other", "--steps", "1000:1001", expect=2).stderr
    assert "RUN: run 'other' is not running on cluster 'local'" in other
    assert 'set `profile: {steps: "FIRST:LAST"}` in its run.yaml' in other


@pytest.mark.cluster
@pytest.mark.xdist_group("profile-cluster")
def test_profile_traces_the_requested_steps_on_every_rank_of_a_running_run(running: tuple[Cli, FileStore]) -> None:
    cli, store = running
    # The refusal of a window that starts too soon says where one may start, and the lead.
    refused = cli("profile", "prof", "--steps", "1:1", expect=2).stderr
    for _attempt in range(3):
        earliest = int(re.search(r"start at step (\d+) or later", refused).group(1))  # type: ignore[union-attr]
        lead = int(re.search(r"reaches every rank (\d+) steps later", refused).group(1))  # type: ignore[union-attr]
        # And one lead more: the next command takes a while to start. Steps may still get faster
        # on 2 shared cores than the newest record said; then the refusal names a later step.
        first = earliest + lead
        asked = cli("profile", "prof", "--steps", f"{first}:{first + 2}", "--json", "--timeout", "120", expect=None)
        if asked.returncode == 0:
            break
        refused = asked.stderr
        assert "starts too soon" in refused, refused
    result = json.loads(asked.stdout)
    (window,) = result["windows"]
    assert window["steps"] == f"{first}:{first + 2}"
    assert [t["rank"] for t in window["traces"]] == [0, 1]
    for trace in window["traces"]:
        key = f"runs/prof/profiles/{first}-{first + 2}/rank-{trace['rank']}.pt.trace.json.gz"
        assert trace["location"] == str(store.root / key)
        assert markers(store, key) == [first, first + 1, first + 2]
    listed = cli("profile", "prof").stdout
    assert f"steps {first}:{first + 2} (2 rank(s)):" in listed
    assert f"tensorboard --logdir {store.root / 'runs/prof/profiles'}" in listed
