"""End to end through real Terraform, real Ansible and real torchrun on gloo: up, train, kill, resume, teardown."""

from __future__ import annotations

import json

import pytest
from test_runbooks import rolled_back, run_blocks

from infractl import proc, runstore
from infractl.store import FileStore, open_store

from conftest import Cli, wait_for_commit, write

pytestmark = pytest.mark.cluster

RUN = """\
name: e2e
model: {layers: 2, hidden: 64, heads: 2, seq_len: 64}
data: {max_bytes: 200000}
batch_size: 8
steps: 240
checkpoint: {every: 10, keep: 2}
nodes: {min: %(min)d, max: %(max)d}
max_restarts: 0
"""


def test_up_train_kill_resume_teardown(cli: Cli) -> None:
    run = write(cli.cwd / "run.yaml", RUN % {"min": 1, "max": 2})
    cluster_dir = cli.home / "local"
    store = FileStore(cluster_dir / "store")

    first = json.loads(cli("up", "--json").stdout)
    assert first["changed"] and first["terraform"] == "2 added, 0 changed, 0 destroyed"
    assert [h["world"] for h in first["health"]] == [2, 2]
    assert all(h["busbw_gbps"] > 0 for h in first["health"])

    again = cli("up").stderr
    assert "terraform: no changes" in again and "ansible: 0 task(s) changed" in again, again
    assert "cluster 'local' is up: no changes" in again

    too_big = write(cli.cwd / "big.yaml", RUN % {"min": 3, "max": 3})
    refused = cli("train", str(too_big), expect=2)
    assert "big.yaml: nodes.min: 3 exceeds the 2 node(s) of cluster 'local'" in refused.stderr

    # Tensor parallel over 2 ranks cannot go on if the elastic range lets the run shrink to 1.
    odd = write(cli.cwd / "odd.yaml", (RUN % {"min": 1, "max": 2}) + "parallel: {tp: 2}\n")
    refused = cli("train", str(odd), expect=2)
    assert (
        "odd.yaml: parallel: tp x pp = 2 rank(s) per model copy does not divide the world size 1 "
        "(1 node(s) x 1 process(es), in the range nodes.min to nodes.max)" in refused.stderr
    )

    started = json.loads(cli("train", str(run), "--detach", "--json").stdout)
    assert started["attempt"] == 1 and started["resume_from"] == 0
    assert set(started["agents"]) == {"node-0", "node-1"}

    # Kill the training mid-run: every process of both nodes (agents and their workers).
    wait_for_commit(store, "e2e", at_least=20, timeout=180)
    victims = proc.find(cluster_dir, run="e2e")
    assert len(victims) >= 4, "expected an agent and a worker per node"
    proc.kill(victims)
    assert proc.wait_gone(cluster_dir, run="e2e", timeout=30) == []
    committed = runstore.latest_committed_step(store, "e2e")
    assert committed is not None and 20 <= committed < 240

    status = json.loads(cli("status", "--json").stdout)
    (row,) = status["runs"]
    assert row["state"] == "stopped" and row["last_committed_step"] == committed
    assert status["rendezvous"]["running"]

    resumed = json.loads(cli("train", str(run), "--json").stdout)
    assert resumed["attempt"] == 2 and resumed["outcome"] == "completed"
    assert resumed["resume_from"] == committed
    assert resumed["last_committed_step"] == 240
    assert runstore.latest_committed_step(store, "e2e") == 240

    records = runstore.read_metrics(store, "e2e")
    second_attempt = [r["step"] for r in records if r["attempt"] == 2]
    assert min(second_attempt) == committed + 1, "the resumed run must continue after the committed step"
    assert [r["step"] for r in records] == list(range(1, 241))
    log = (cluster_dir / "nodes" / "node-0" / "logs" / "e2e.log").read_text()
    assert "resumed" in log and f"step={committed}" in log
    # Each node's log tells its own story (trainer/train.py's module doc), whichever rank it ran.
    for node in ("node-0", "node-1"):
        killed, finished = (cluster_dir / "nodes" / node / "logs" / "e2e.log").read_text().split("attempt 2 of run")
        assert_in_order(killed, ("rank_joined",), ("starting", "step=0"), ("checkpoint_committed", "step=10"))
        assert_in_order(finished, ("rank_joined",), ("resumed",), ("stopped", "reason=finished", "step=240"))

    shown = json.loads(cli("metrics", "e2e", "--json").stdout)
    assert len(shown) == 240 and shown[-1]["step"] == 240
    assert "node-1" in cli("logs", "--node", "node-1").stdout
    assert json.loads(cli("status", "--json").stdout)["runs"][0]["state"] == "completed"

    again = cli("train", str(run))
    assert "run 'e2e' already completed (committed step 240 of 240)" in again.stderr
    other_data = write(
        cli.cwd / "other.yaml", (RUN % {"min": 1, "max": 2}).replace("max_bytes: 200000", "max_bytes: 150000")
    )
    refused = cli("train", str(other_data), expect=2)
    assert "other.yaml: data: run 'e2e' was trained on dataset version" in refused.stderr
    other_shape = write(cli.cwd / "shape.yaml", (RUN % {"min": 1, "max": 2}).replace("hidden: 64", "hidden: 32"))
    refused = cli("train", str(other_shape), expect=2)
    assert "shape.yaml: model: run 'e2e' has checkpoints of another shape (model.hidden=64)" in refused.stderr
    refused = cli("train", str(run), "--new", expect=2)
    assert "pass --yes to confirm" in refused.stderr
    assert runstore.latest_committed_step(store, "e2e") == 240, "a refused --new deletes nothing"

    restarted = json.loads(cli("train", str(run), "--new", "--yes", "--detach", "--json").stdout)
    assert restarted["attempt"] == 1 and restarted["resume_from"] == 0
    wait_for_commit(store, "e2e", at_least=10, timeout=180)
    assert runstore.committed_steps(store, "e2e")[0] < 240, "--new starts over from step 0"

    done = json.loads(cli("teardown", "--yes", "--json").stdout)
    assert done["nodes_removed"] == 2
    assert done["processes_killed"] >= 5, "the running run (agents, workers) and the rendezvous server"
    assert proc.find(cluster_dir) == []
    assert not (cluster_dir / "nodes").exists()
    assert not (cluster_dir / "terraform").exists()
    assert runstore.latest_committed_step(store, "e2e") is not None, "teardown keeps the store"
    again = cli("teardown", "--yes")
    assert "nothing to tear down: cluster 'local' is not up" in again.stderr, "a retried teardown succeeds"


def test_train_checkpoints_into_s3_rolls_back_there_and_purge_removes_the_run(cli: Cli, s3_store_uri: str) -> None:
    cluster = write(cli.cwd / "cluster.yaml", f"name: s3c\nnodes: 2\nstore: {s3_store_uri}\n")
    run = write(cli.cwd / "run.yaml", (RUN % {"min": 2, "max": 2}).replace("steps: 240", "steps: 20"))
    store = open_store(s3_store_uri)

    cli("up", "-c", str(cluster))
    finished = json.loads(cli("train", str(run), "-c", "s3c", "--json").stdout)
    assert finished["outcome"] == "completed" and finished["last_committed_step"] == 20
    assert runstore.committed_steps(store, "e2e") == [10, 20]
    assert runstore.verify_checkpoint(store, "e2e", 20).world_size == 2
    assert [r["step"] for r in runstore.read_metrics(store, "e2e")] == list(range(1, 21))
    assert json.loads(cli("status", "-c", "s3c", "--json").stdout)["runs"][0]["state"] == "completed"

    # The rollback runbook on the S3 store: step 20 is moved aside in the bucket (server-side
    # copies), and the run, launched again, resumes from step 10 and completes.
    cli("bundle", "-c", "s3c", "--run", "e2e")
    transcript = run_blocks(cli, cli.cwd / "handover" / "s3c" / "runbooks" / "rollback.md")
    assert rolled_back(store, "e2e", transcript) == 10 and "run e2e recovered: " in transcript, transcript
    wait_for_commit(store, "e2e", at_least=20, timeout=180)
    record = runstore.read_run_record(store, "e2e")
    assert record is not None and record.attempts[-1].resume_from == 10

    done = json.loads(cli("teardown", "-c", "s3c", "--yes", "--purge", "--json").stdout)
    assert done["runs_purged"] == ["e2e"]
    assert store.list("runs/") == []
    assert not (cli.home / "s3c").exists()


def assert_in_order(log: str, *lines: tuple[str, ...]) -> None:
    """``log`` has a line holding each tuple's strings, those lines in the order given."""
    rows = log.splitlines()
    found = [next((i for i, row in enumerate(rows) if all(part in row for part in line)), -1) for line in lines]
    assert -1 not in found and found == sorted(found), (lines, found, log[-4000:])
