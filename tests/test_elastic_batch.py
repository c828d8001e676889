"""Elastic world sizes keep the global batch: a run on a 4-node local cluster (real Terraform,
Ansible, torchrun on gloo) with `nodes: {min: 1, max: 4}` and `batch_size: 16`, a batch no
world size of 3 divides, loses a node and goes on with 3 ranks: shares of 6, 5 and 5 samples in
two passes each, and the losses of an uninterrupted run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_trainer import ok, store_of, torchrun

from infractl import runstore
from infractl.config import load_run
from infractl.store import FileStore

from conftest import Cli, module_cluster, wait_for_commit, write

pytestmark = pytest.mark.e2e

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
