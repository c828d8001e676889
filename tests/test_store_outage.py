"""With the store unreachable, every command still answers in one line.

`status` shows what it can without the store (cluster, nodes, processes) and marks the store
unreachable, exit 0; `metrics`, `logs`, `train` and every drill name the store and the cause in
one line, exit 1, and change nothing (no agent starts, no fault is injected). Each backend gets
one real 2-node cluster (module-scoped) that trains a tiny run to completion; then its store is
taken away: the `file://` directory is moved, the S3 server (moto, over HTTP) is stopped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from infractl import proc
from infractl.drill import KINDS

from conftest import Outage, store_down_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("store-outage")]


@pytest.fixture(scope="module", params=["file", "s3"])
def outage(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, aws_test_env: dict[str, str]
) -> Iterator[Outage]:
    with store_down_cluster(tmp_path_factory.mktemp(f"outage-{request.param}"), request.param) as down:
        yield down


def _store_line(outage: Outage, stderr: str) -> str:
    """The one error line of a command that failed on the store, checked to name it."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"error: store {outage.store_uri}: "), stderr
    return lines[0]


def test_status_shows_the_cluster_and_marks_the_store_unreachable(outage: Outage) -> None:
    result = outage.cli("status", "-c", outage.cluster)
    assert f"store {outage.store_uri} UNREACHABLE" in result.stdout
    assert "node-0" in result.stdout and "node-1" in result.stdout
    # No bundle was written (and none can be while the store is down): status names the runbook.
    hint = f"see runbooks/store-outage.md of a handover bundle written before (`infractl bundle -c {outage.cluster}`)"
    assert hint in result.stderr, result.stderr
    data = json.loads(outage.cli("status", "-c", outage.cluster, "--json").stdout)
    assert data["cluster"] == outage.cluster and [n["name"] for n in data["nodes"]] == ["node-0", "node-1"]
    assert data["store"]["reachable"] is False
    assert data["store"]["error"].startswith(f"store {outage.store_uri}: ")
    assert data["rendezvous"]["running"] is True
    assert data["store"]["runbook"] == {"runbook": "store-outage", "section": None, "path": None}


def test_metrics_names_the_store(outage: Outage) -> None:
    result = outage.cli("metrics", "tiny", "-c", outage.cluster, expect=1)
    _store_line(outage, result.stderr)
    assert result.stdout == ""
    result = outage.cli("metrics", "tiny", "-c", outage.cluster, "--json", expect=1)
    assert json.loads(result.stdout)["error"]["exit_code"] == 1


def test_logs_prints_the_node_logs_then_names_the_store(outage: Outage) -> None:
    result = outage.cli("logs", "-c", outage.cluster, "--run", "tiny", "--tail", "5", expect=1)
    _store_line(outage, result.stderr)
    assert "==> node-0 · run tiny" in result.stdout and "==> node-1 · run tiny" in result.stdout
    # Which run is the latest is the store's to say: without --run there is nothing to print.
    result = outage.cli("logs", "-c", outage.cluster, expect=1)
    _store_line(outage, result.stderr)
    assert result.stdout == ""


def test_train_names_the_store_and_starts_nothing(outage: Outage) -> None:
    before = sorted((p, p.stat().st_size) for p in outage.state_dir.rglob("*") if p.is_file())
    for extra in ([], ["--new", "--yes"]):
        result = outage.cli("train", str(outage.run_file), "-c", outage.cluster, *extra, expect=1)
        _store_line(outage, result.stderr)
    assert proc.find(outage.state_dir, run="tiny") == []
    assert sorted((p, p.stat().st_size) for p in outage.state_dir.rglob("*") if p.is_file()) == before
    assert (outage.state_dir / "lock").read_bytes() == b""


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_drill_names_the_store_and_injects_nothing(outage: Outage, kind: str) -> None:
    live = {p.pid for p in proc.find(outage.state_dir)}
    result = outage.cli("drill", kind, "-c", outage.cluster, expect=1)
    _store_line(outage, result.stderr)
    assert {p.pid for p in proc.find(outage.state_dir)} == live


def test_up_refuses_a_cluster_whose_store_is_gone(outage: Outage) -> None:
    result = outage.cli("up", "-c", outage.cluster, expect=2)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[0].startswith(f"error: cluster.store: the store of cluster {outage.cluster!r} is unreachable ("), lines
    assert "it holds the cluster's checkpoints and run records" in lines[0] and len(lines) == 1
    if outage.store_uri.startswith("file://"):
        assert not Path(outage.store_uri.removeprefix("file://")).exists()  # not recreated empty
