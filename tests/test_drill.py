"""Fault drills end to end: a real 2-node local cluster (Terraform, Ansible, torchrun on gloo),
a detached run, `infractl drill KIND`. Every drill must end in a completed run that resumed
from its last committed step, never step 0."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from infractl import proc, runstore
from infractl.config import load_run
from infractl.drill import recovery
from infractl.store import FileStore, open_store
from trainer.faults import REPLICA_CORRUPT_ENV, UPLOAD_DELAY_ENV

from conftest import Cli, module_cluster, stop_runs, wait_for_commit, wait_for_world, write
from runbook_steps import hung_job_run

# Steps are fast on this tiny model: `steps` sets how long a run lasts after its drill recovered.
RUN = """\
name: {name}
model: {{layers: 2, hidden: 64, heads: 2, seq_len: 64}}
data: {{max_bytes: 200000}}
batch_size: 8
steps: {steps}
min_step_s: {pace}
checkpoint: {checkpoint}
parallel: {{dp: auto, tp: 1}}
nodes: {{min: 1, max: 2}}
max_restarts: 3
watchdog: {{step_timeout_s: 8}}
preemption: {{grace_s: 20}}
"""


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    with module_cluster(tmp_path_factory, "drill") as cli:
        yield cli


@pytest.fixture
def cluster(shared: Cli) -> Iterator[Cli]:
    """The module's 2-node cluster on a file:// store: each test trains a run of its own name on
    it, and no process of that run outlives the test."""
    yield shared
    stop_runs(shared.home / "local")


def start(
    cli: Cli,
    name: str,
    *,
    steps: int = 300,
    pace: float = 0.0,
    env: dict[str, str] | None = None,
    committed: bool = True,
    checkpoint: str = "{every: 10, keep: 2}",
    hung: bool = False,
) -> FileStore:
    """Start run ``name`` detached on the module's cluster (``pace``: its ``min_step_s``, for a run
    the test stops: it spares the CPU; ``hung``: a run whose rank a test stops, with the step
    deadline that leaves its agent time to see the peers restart; ``env``: variables of train's
    environment the run.yaml passes to the trainers, its fault-injection hooks: the run is then a
    rehearsal); return its store once its first checkpoint committed (at once, without
    ``committed``)."""
    text = RUN.format(name=name, steps=steps, pace=pace, checkpoint=checkpoint)
    if env:
        text += f"env: [{', '.join(env)}]\nrehearsal: true\n"
    run = write(cli.cwd / f"{name}.yaml", hung_job_run(text) if hung else text)
    cli("train", str(run), "--detach", env=env)
    store = FileStore(cli.home / "local" / "store")
    if committed:
        wait_for_commit(store, name, at_least=load_run(run).checkpoint.every, timeout=120)
    return store


def drill_json(cli: Cli, *args: str) -> dict[str, Any]:
    return json.loads(cli("drill", *args, "--json", "--timeout", "240").stdout)


def assert_recovered(result: dict[str, Any], store: FileStore, *, world_after: int) -> None:
    """The run resumed from its newest committed step (not 0), on ``world_after`` ranks, and finished."""
    assert result["outcome"] == "recovered", result
    assert result["resumed_correctly"] and result["resumed_from_step"] >= 10, result
    assert result["world_size_at_fault"] == 2 and result["world_size_after"] == world_after, result
    assert 0 < result["restart_s"] and (result["detect_s"] is None or result["detect_s"] <= result["restart_s"])
    assert result["final_committed"] and result["final_step"] == result["steps"]
    run = result["run_id"]
    assert runstore.latest_committed_step(store, run) == result["steps"]
    assert json.loads(store.get_bytes(runstore.drill_key(run, result["drill_id"]))) == result


def test_a_restart_splits_into_phases_that_run_from_the_last_point_seen() -> None:
    record = runstore.DrillRecord(
        drill_id="d", drill="kill-node", run_id="r", cluster="c", node="node-1", survivors=["node-0"],
        fault_time=100.0, fault={}, step_at_fault=50, last_committed_step=40, world_size_at_fault=2,
        detect_s=0.3, stopped_s=0.5, restart_s=6.0,
    )  # fmt: skip
    timeline = {"started": 102.0, "joined": 104.5, "loaded": 105.2}
    phases = recovery.split_restart(record, timeline)
    assert phases == {"detect": 0.3, "stop": 0.2, "rendezvous": 1.5, "startup": 2.5, "load": 0.7, "first_step": 0.8}
    assert list(phases) == list(recovery.PHASES) and sum(phases.values()) == pytest.approx(6.0)  # type: ignore[arg-type]
    record.stopped_s = None
    phases = recovery.split_restart(record, {"joined": 104.5})
    assert phases == {"detect": 0.3, "stop": None, "rendezvous": None, "startup": 4.2, "load": None, "first_step": 1.5}


@pytest.mark.parametrize(
    ("recovered", "resumed", "final_committed", "outcome"),
    [
        (True, True, True, ("recovered", None)),
        # A partition of 30 s: the run resumed without node-1 in 3.9 s and committed its final
        # step 24 s after the link came back, before node-1 had rejoined.
        (False, True, True, ("recovered", "run ended before node-1 rejoined")),
        (True, True, False, ("failed", None)),
        (False, True, False, ("failed", None)),
        (False, False, True, ("failed", None)),
        (False, False, False, ("failed", None)),
    ],
)
def test_a_run_that_ends_before_its_whole_world_is_back_recovered_if_it_resumed_and_committed_its_end(
    recovered: bool, resumed: bool, final_committed: bool, outcome: tuple[str, str | None]
) -> None:
    assert recovery.ended(recovered=recovered, resumed=resumed, final_committed=final_committed, node="node-1") == (
        outcome
    )


def test_the_drill_line_says_the_run_ended_before_the_node_rejoined() -> None:
    from infractl.cli.drill import _line

    outcome, note = recovery.ended(recovered=False, resumed=True, final_committed=True, node="node-1")
    record = runstore.DrillRecord(
        drill_id="d", drill="partition", run_id="r", cluster="c", node="node-1", survivors=["node-0"],
        fault_time=100.0, fault={"link": "down", "seconds": 30.0}, step_at_fault=50, last_committed_step=40,
        world_size_at_fault=2, restart_s=3.9, resumed_from_step=50, expected_resume_step=50, lost_work_steps=0,
        world_size_after=1, final_step=300, final_committed=True, steps=300, outcome=outcome, outcome_note=note,
    )  # fmt: skip
    assert _line(record).endswith("final step 300/300 committed: recovered, run ended before node-1 rejoined")


@pytest.mark.cluster
@pytest.mark.xdist_group("drill")
def test_kill_node_0_recovers_on_the_survivor_and_rejoins(cluster: Cli) -> None:
    refused = cluster("drill", "kill-node", expect=2)
    assert "no run is running on cluster 'local'" in refused.stderr
    # Still going when node-0 rejoins; the fixture stops it (the other drills wait for their runs' end).
    store = start(cluster, "kill0", steps=100_000, pace=0.2)
    refused = cluster("drill", "kill-node", "--node", "node-7", expect=2)
    assert "--node: no node 'node-7' in cluster 'local'" in refused.stderr
    refused = cluster("drill", "store-outage", "--node", "node-0", expect=2)
    assert "No such option: --node" in refused.stderr  # the store is the fault, not a node
    refused = cluster("drill", "kill-node", "--repeat", "5", expect=2)
    assert "--repeat: 5 drills need max_restarts >= 5" in refused.stderr

    result = drill_json(cluster, "kill-node", "--node", "node-0", "--no-wait")
    assert result["outcome"] == "recovered", result
    assert result["node"] == "node-0" and result["survivors"] == ["node-1"]
    assert result["resumed_correctly"] and result["resumed_from_step"] >= 10, result
    assert result["world_size_at_fault"] == 2 and result["world_size_after"] == 1
    assert result["lost_work_steps"] == result["step_at_fault"] - result["resumed_from_step"] >= 0
    assert 0 < result["detect_s"] <= result["stopped_s"] <= result["restart_s"]
    # The restart phase by phase, every point seen: they add up to restart_s.
    phases = result["phases"]
    assert list(phases) == list(recovery.PHASES) and None not in phases.values(), phases
    assert sum(phases.values()) == pytest.approx(result["restart_s"], abs=0.01), phases
    assert json.loads(store.get_bytes(runstore.drill_key("kill0", result["drill_id"]))) == result
    assert proc.find(cluster.home / "local", node="node-0", run="kill0") == []

    # The operator brings node-0 back: the run grows to 2 nodes again and commits there.
    rejoined = time.time()
    joined = json.loads(cluster("rejoin", "node-0", "--json").stdout)
    assert joined["node"] == "node-0" and joined["rejoins"] == 1 and joined["budget"] == 3
    whole = wait_for_world(store, "kill0", size=2, since=rejoined, timeout=120)
    wait_for_commit(store, "kill0", at_least=whole + 10, timeout=120)


@pytest.mark.cluster
@pytest.mark.xdist_group("drill")
def test_kill_node_1_twice_with_a_rejoin_between(cluster: Cli) -> None:
    store = start(cluster, "twice", steps=700)
    summary = drill_json(cluster, "kill-node", "--node", "node-1", "--repeat", "2")
    assert summary["drills"] == 2 and summary["succeeded"] == 2, summary
    first, second = summary["results"]
    # After the first kill node-1 rejoined and the world grew back to 2 before the second.
    assert first["rejoin_s"] > 0 and second["world_size_at_fault"] == 2
    assert summary["median_restart_s"] > 0 and summary["worst_restart_s"] >= summary["median_restart_s"]
    assert_recovered(second, store, world_after=1)
    record = runstore.read_run_record(store, "twice")
    assert record is not None and record.last_attempt is not None
    assert [r.node for r in record.last_attempt.rejoins] == ["node-1"]


@pytest.mark.cluster
@pytest.mark.xdist_group("drill")
def test_rejoin_refuses_a_running_or_unknown_node_and_a_spent_budget(cluster: Cli) -> None:
    store = start(cluster, "budget", steps=100_000, pace=0.2)
    assert "NODE: node 'node-1' is already running run 'budget'" in cluster("rejoin", "node-1", expect=2).stderr
    assert "NODE: no node 'node-9' in cluster 'local'" in cluster("rejoin", "node-9", expect=2).stderr
    # The budget lives in the run record in the store, not in any process: a node that already
    # rejoined this attempt max_restarts (3) times is refused, whoever asks.
    record = runstore.read_run_record(store, "budget")
    assert record is not None and record.last_attempt is not None
    record.last_attempt.rejoins = [runstore.Rejoin(node="node-1", time=0.0, pid=0)] * 3
    runstore.write_run_record(store, record)
    assert proc.kill_all(cluster.home / "local", node="node-1", run="budget", timeout=30)[1] == []
    refused = cluster("rejoin", "node-1", expect=2).stderr
    assert "node 'node-1' has already rejoined attempt 1 of run 'budget' 3 time(s) (max_restarts: 3)" in refused


@pytest.mark.cluster
@pytest.mark.xdist_group("drill")
def test_hung_node_is_detected_and_the_run_completes(cluster: Cli) -> None:
    # Started right after the launch: the drill waits for the run's first commit, not a fault in its start-up.
    # With the drills' 8 s step deadline, the stopped rank's own deadline could expire before its
    # peers' restart reached its agent: the agent's file timer then takes the agent down with the
    # rank (a node lost, trainer/watchdog.py), and nothing kills the stopped rank politely.
    store = start(cluster, "hang", committed=False, hung=True)
    # What a drill cannot strike is refused at once, before that wait: local nodes have no link to cut.
    refused = cluster("drill", "partition", "--node", "node-1", "--timeout", "600", expect=2, timeout=30).stderr
    assert "error: --node: node 'node-1' has no network link of its own to cut" in refused, refused
    result = drill_json(cluster, "hang-node", "--node", "node-1")
    assert result["last_committed_step"] >= 10, result
    assert result["fault"]["signal"] == "SIGSTOP"
    assert_recovered(result, store, world_after=result["world_size_after"])
    assert result["world_size_after"] in (1, 2)
    # The hung node's agent did not wait for its stopped worker to answer SIGTERM (trainer/agent.py).
    log = (cluster.home / "local" / "nodes" / "node-1" / "logs" / "hang.log").read_text()
    assert "it is stopped and cannot answer SIGTERM" in log, log


@pytest.mark.cluster
@pytest.mark.xdist_group("drill")
def test_preemption_commits_an_emergency_checkpoint_that_the_survivor_resumes_from(cluster: Cli) -> None:
    store = start(cluster, "preempt")
    result = drill_json(cluster, "preempt", "--node", "node-1")
    assert result["emergency_checkpoint_step"] is not None, result
    assert result["emergency_checkpoint_s"] < 20  # within preemption.grace_s
    assert result["resumed_from_step"] == result["emergency_checkpoint_step"]
    assert_recovered(result, store, world_after=1)


@pytest.mark.cluster
@pytest.mark.xdist_group("drill")
def test_store_outage_training_goes_on_and_commits_when_the_store_is_back(cluster: Cli) -> None:
    store = start(cluster, "outage", steps=500)
    result = drill_json(cluster, "store-outage", "--seconds", "4")
    assert result["outcome"] == "recovered" and result["final_committed"], result
    assert result["restart_s"] >= 4  # the first commit after the fault came once the store was back
    assert not any(p.name.startswith("store.outage-") for p in store.root.parent.iterdir())
    records = runstore.read_metrics(store, "outage")
    assert [r["step"] for r in records] == list(range(1, 501))  # nothing lost while the store was down
    # Training went on through the outage: no worker restarted.
    assert {r["restart_count"] for r in records} == {0} and {r["world_size"] for r in records} == {2}


@pytest.mark.cluster
@pytest.mark.xdist_group("drill")
def test_kill_during_checkpoint_never_loads_the_partial_step(cluster: Cli) -> None:
    # The knob holds every save between upload and commit, so the drill finds one in flight; at a
    # save every 10 steps, 90 steps last about 40 s (the drill strikes at the second or third save).
    # No replicas: the store's commit is on trial.
    store = start(
        cluster,
        "partial",
        steps=90,
        env={UPLOAD_DELAY_ENV: "4"},
        checkpoint="{every: 10, keep: 2, replicate_every: 0}",
    )
    result = drill_json(cluster, "kill-during-checkpoint", "--node", "node-1")
    partial = result["fault"]["partial_step"]
    assert partial > result["last_committed_step"] >= 10
    assert result["resumed_from_step"] != partial and not result["fault"]["partial_step_committed"]
    assert_recovered(result, store, world_after=1)


@pytest.mark.cluster
@pytest.mark.xdist_group("drill")
def test_a_killed_node_resumes_from_the_replicas_in_memory_losing_at_most_a_step(cluster: Cli) -> None:
    # A replica every step and a commit every 50: the store alone would lose up to 49 steps. A
    # replica is skipped while the previous one is still being copied, which on a loaded machine
    # can take a few of these steps (bench/recovery.py measures the loss on a quiet one).
    store = start(cluster, "memory", steps=100_000, pace=0.2, checkpoint="{every: 50, keep: 2, replicate_every: 1}")
    result = drill_json(cluster, "kill-node", "--node", "node-1", "--no-wait")
    assert result["outcome"] == "recovered" and result["world_size_after"] == 1, result
    assert result["resumed_from"] == "replica" and result["resumed_correctly"], result
    assert result["resumed_from_step"] >= result["last_committed_step"] >= 50, result
    assert result["lost_work_steps"] <= 5, result
    # Rank 0 carried its records not yet in the store in the replica: no step is missing.
    steps = {r["step"] for r in runstore.read_metrics(store, "memory")}
    assert set(range(1, result["resumed_from_step"] + 1)) <= steps


@pytest.mark.cluster
@pytest.mark.xdist_group("drill")
def test_a_corrupt_replica_is_not_loaded_and_the_run_resumes_from_the_store(cluster: Cli) -> None:
    # Each agent flips a byte of every copy it holds for the other node: once node-1 (and the
    # own copy of its rank's files) is gone, the only one left fails its sha256.
    start(
        cluster,
        "corrupt",
        steps=100_000,
        pace=0.1,
        env={REPLICA_CORRUPT_ENV: "peer"},
        checkpoint="{every: 20, keep: 2, replicate_every: 5}",
    )
    result = drill_json(cluster, "kill-node", "--node", "node-1", "--no-wait")
    assert result["outcome"] == "recovered" and result["world_size_after"] == 1, result
    assert result["resumed_from"] == "store" and result["resumed_correctly"], result
    assert result["resumed_from_step"] == result["expected_resume_step"] >= 20, result
    log = (cluster.home / "local" / "nodes" / "node-0" / "logs" / "corrupt.log").read_text()
    assert "replica_invalid" in log and "the manifest says" in log


@pytest.mark.cluster
def test_s3_store_outage_pauses_the_local_endpoint_and_the_run_completes(cli: Cli, s3_store_uri: str) -> None:
    cluster = write(cli.cwd / "cluster.yaml", f"name: s3c\nnodes: 2\nstore: {s3_store_uri}\n")
    run = write(cli.cwd / "run.yaml", RUN.format(name="drill", steps=200, pace=0, checkpoint="{every: 10, keep: 2}"))
    store = open_store(s3_store_uri)
    cli("up", "-c", str(cluster))
    cli("train", str(run), "-c", "s3c", "--detach")
    wait_for_commit(store, "drill", at_least=10, timeout=120)

    result = drill_json(cli, "store-outage", "-c", "s3c", "--seconds", "4")
    assert result["fault"]["how"] == "endpoint server stopped (SIGSTOP)", result
    assert psutil.Process(result["fault"]["pid"]).status() != psutil.STATUS_STOPPED
    assert result["outcome"] == "recovered" and result["final_committed"], result
    assert runstore.latest_committed_step(store, "drill") == 200
    assert [r["step"] for r in runstore.read_metrics(store, "drill")] == list(range(1, 201))
    cli("teardown", "-c", "s3c", "--yes")
    assert proc.find(cli.home / "s3c") == []
