"""Fault drill end to end: a real 2-node local cluster, a detached run, `infractl drill kill-node`."""

from __future__ import annotations

import json

import pytest

from conftest import Cli, wait_for_commit, write
from infractl import drill, proc, runstore
from infractl.store import FileStore

pytestmark = pytest.mark.e2e

RUN = """\
name: drill
model: {layers: 2, hidden: 64, heads: 2, seq_len: 64}
data: {max_bytes: 200000}
batch_size: 8
steps: 200
checkpoint: {every: 10, keep: 2}
nodes: {min: 1, max: 2}
max_restarts: 3
"""


def test_kill_node_drill_recovers_and_is_recorded(cli: Cli) -> None:
    run = write(cli.cwd / "run.yaml", RUN)
    cluster_dir = cli.home / "local"
    store = FileStore(cluster_dir / "store")

    cli("up")
    refused = cli("drill", "kill-node", expect=2)
    assert "no run is running on cluster 'local'" in refused.stderr

    cli("train", str(run), "--detach")
    wait_for_commit(store, "drill", at_least=10, timeout=120)
    refused = cli("drill", "kill-node", "--node", "node-7", expect=2)
    assert "--node: no node 'node-7' in cluster 'local'" in refused.stderr

    result = json.loads(cli("drill", "kill-node", "--node", "node-0", "--json", "--timeout", "240").stdout)
    assert result["outcome"] == "recovered", result
    assert result["node"] == "node-0" and result["survivors"] == ["node-1"]
    assert result["last_committed_step"] >= 10
    assert result["resumed_from_step"] == result["last_committed_step"], result
    assert result["lost_work_steps"] == result["step_at_fault"] - result["last_committed_step"] >= 0
    assert result["world_size_at_fault"] == 2 and result["world_size_after"] == 1
    assert 0 < result["detect_s"] <= result["restart_s"]
    assert result["final_step"] == 200 and result["final_committed"]
    assert runstore.latest_committed_step(store, "drill") == 200
    assert proc.find(cluster_dir, node="node-0") == []

    stored = json.loads(store.get_bytes(drill.drill_key("drill", result["drill_id"])))
    assert stored == result

    cli("teardown", "--yes")
    assert proc.find(cluster_dir) == []
