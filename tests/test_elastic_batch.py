"""Runs on a 4-node local cluster (real Terraform, Ansible, torchrun on gloo).

Elastic world sizes keep the global batch: a run with `nodes: {min: 1, max: 4}` and
`batch_size: 16`, a batch no world size of 3 divides, loses a node and goes on with 3 ranks:
shares of 6, 5 and 5 samples in two passes each, and the losses of an uninterrupted run.

In-memory replicas never load a partial step: a run on three of the nodes loses two at once, one
of them holding the other's only copy, and resumes from the store's commit."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from test_trainer import ok, store_of, torchrun

from infractl import proc, runstore
from infractl.config import load_run
from infractl.store import FileStore
from trainer import replicas
from trainer.replica_server import REPLICA_ADDR_ENV, RunKey

from conftest import Cli, module_cluster, stop_runs, wait_for_commit, wait_for_world, write

pytestmark = pytest.mark.cluster

STEPS = 150

RUN = f"""\
name: batch16
model: {{layers: 2, hidden: 32, heads: 2, seq_len: 32}}
data: {{max_bytes: 100000}}
batch_size: 16
steps: {STEPS}
log_every: 5
checkpoint: {{every: 10, keep: 2}}
parallel: {{dp: auto, tp: 1}}
deterministic: true
nodes: {{min: 1, max: 4}}
max_restarts: 3
watchdog: {{step_timeout_s: 10}}
"""

#: Largest relative loss difference from the uninterrupted run at the same step. The global
#: batch and the data order do not depend on the world size; the float32 sums do (see
#: test_schemes.RESHARD_REL_TOL).
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def four_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    with module_cluster(tmp_path_factory, "four", cluster_yaml="name: four\nnodes: 4\n") as cli:
        yield cli


def uninterrupted(tmp_path: Path, run_file: Path) -> dict[int, float]:
    """The same run on one rank, never interrupted: its loss per step."""
    ok(torchrun(tmp_path, load_run(run_file), nproc=1))
    return {r["step"]: r["loss"] for r in runstore.read_metrics(store_of(tmp_path), "batch16")}


@pytest.mark.xdist_group("four")
def test_losing_one_of_four_nodes_keeps_the_global_batch_and_the_losses(four_nodes: Cli, tmp_path: Path) -> None:
    run_file = write(four_nodes.cwd / "batch16.yaml", RUN)
    four_nodes("train", str(run_file), "--detach", "-c", "four")
    store = FileStore(four_nodes.home / "four" / "store")
    wait_for_commit(store, "batch16", at_least=10, timeout=180)

    result = json.loads(
        four_nodes("drill", "kill-node", "--node", "node-3", "--json", "--timeout", "300", "-c", "four").stdout
    )
    assert result["outcome"] == "recovered", result
    assert result["world_size_at_fault"] == 4 and result["world_size_after"] == 3, result
    wait_for_commit(store, "batch16", at_least=STEPS, timeout=300)

    records = runstore.read_metrics(store, "batch16")
    by_world = {r["world_size"]: (r["micro_batch"], r["accumulation"]) for r in records}
    # Sized for 4 ranks: 4 samples a pass. On 3 ranks the shares are 6, 5, 5: two passes.
    assert by_world[4] == (4, 1) and by_world[3] == (4, 2), by_world
    reference = uninterrupted(tmp_path, run_file)
    assert sorted({r["step"] for r in records}) == list(range(1, STEPS + 1))
    for record in records:
        step, loss = record["step"], record["loss"]
        assert loss == pytest.approx(reference[step], rel=REL_TOL), (record["world_size"], step, loss)


RING_EVERY = 20  # the ring run's checkpoint interval, in steps of at least 0.1 s
RING = f"""\
name: ring
model: {{layers: 2, hidden: 32, heads: 2, seq_len: 32}}
data: {{max_bytes: 100000}}
batch_size: 12
steps: 100000
min_step_s: 0.1
checkpoint: {{every: {RING_EVERY}, keep: 2, replicate_every: 2}}
nodes: {{min: 1, max: 3}}
max_restarts: 3
watchdog: {{step_timeout_s: 10}}
"""


@pytest.mark.xdist_group("four")
def test_two_of_three_nodes_lost_with_a_ranks_both_copies_resume_from_the_store(four_nodes: Cli) -> None:
    # Copies go to the node itself and the next in a ring of three: of any two nodes, one holds
    # the other's second copy, so killing both leaves some rank's files nowhere.
    four_nodes("train", str(write(four_nodes.cwd / "ring.yaml", RING)), "--detach", "-c", "four")
    cluster_dir = four_nodes.home / "four"
    store = FileStore(cluster_dir / "store")
    try:
        wait_for_commit(store, "ring", at_least=20, timeout=180)
        # A node that came up late joins in a later round: the copies form a ring of three from then on.
        wait_for_world(store, "ring", size=3, since=0, timeout=180)
        newer_replica(cluster_dir, "node-0", "ring", store)
        killed = time.time()
        proc.kill(proc.find(cluster_dir, node="node-1", run="ring") + proc.find(cluster_dir, node="node-2", run="ring"))
        wait_for_world(store, "ring", size=1, since=killed, timeout=180)
        first = min(
            (r for r in runstore.read_metrics(store, "ring") if r["time"] > killed and runstore.starts_a_process(r)),
            key=lambda r: r["time"],
        )
        assert first["resumed_from"] == "store", first
        committed = [s for s in runstore.committed_steps(store, "ring") if s < first["step"]]
        assert first["step"] - 1 == max(committed)
        log = (cluster_dir / "nodes" / "node-0" / "logs" / "ring.log").read_text()
        assert "replica_incomplete" in log
    finally:
        stop_runs(cluster_dir)


def newer_replica(cluster_dir: Path, node: str, run: str, store: FileStore) -> int:
    """Wait until ``node``'s agent holds a replica manifest newer than the run's newest commit
    (asked over its replica server, as the ranks do), at least 10 steps before the next checkpoint
    (a commit newer than it, landing before the kill, would leave it unconsidered); its step."""
    # The agent set it for its workers after it started: a worker's environment has it.
    worker = next(p for p in proc.listing(cluster_dir, node=node, run=run) if p.worker)
    environ = psutil.Process(worker.pid).environ()
    address, key = environ[REPLICA_ADDR_ENV], RunKey.from_environ(environ)
    assert key is not None, "the worker was started without the run's key"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        index = json.loads(replicas.get(key, address, "/index")[0])
        steps = [int(step) for step, held in index.items() if held["manifest"] is not None]
        newest = max(steps, default=0)
        if newest > (runstore.latest_committed_step(store, run) or 0) and RING_EVERY - newest % RING_EVERY >= 10:
            return newest
        time.sleep(0.05)
    raise AssertionError(f"{node}'s agent held no replica newer than the commit within 60 s")
