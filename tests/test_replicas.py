"""In-memory checkpoint replicas (trainer/replicas.py): the agent's server over real HTTP on
loopback, which replicas count as whole, the fetch that never takes a corrupt copy, a replica
saved and loaded by one rank, and one saved by two ranks loaded on one (DCP reshards it). The
drills (tests/test_drill.py) and the four-node cluster (tests/test_elastic_batch.py) run them
across nodes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_schemes import STEPS, copy_of, reference_run, scheme_spec
from test_trainer import REPO, TIMEOUT_S

from infractl import runstore
from infractl.runstore import Manifest, ManifestEntry, SaveReason
from infractl.store import FileStore
from trainer import replicas
from trainer.checkpoint import Checkpointer
from trainer.replica_server import REPLICA_ADDR_ENV, ReplicaServer
from trainer.replicas import Candidate, Replicas, fetch, whole_replicas


@pytest.fixture
def servers() -> Iterator[list[ReplicaServer]]:
    """Two agents' servers on loopback; the second corrupts what it holds for other nodes."""
    started = [ReplicaServer("127.0.0.1"), ReplicaServer("127.0.0.1", corrupt_peer_copies=True)]
    for server in started:
        server.start()
    yield started
    for server in started:
        server.shutdown()
        server.server_close()


def _sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _put(server: ReplicaServer, step: int, key: str, body: bytes, *, copy: str = "own") -> None:
    replicas._request(server.address, "PUT", f"/steps/{step}/files/{key}?copy={copy}", body, {"X-Sha256": _sha(body)})


def _manifest(step: int, files: dict[str, bytes]) -> Manifest:
    entries = [ManifestEntry(key=k, size=len(v), sha256=_sha(v)) for k, v in files.items()]
    return Manifest(step=step, world_size=2, files=entries, extra={"reason": "replica"})


def _index(server: ReplicaServer) -> dict[str, dict[str, object]]:
    return json.loads(replicas._request(server.address, "GET", "/index"))  # type: ignore[no-any-return]


def test_an_agent_refuses_a_copy_that_differs_from_its_hash_and_keeps_one_step_with_a_manifest(
    servers: list[ReplicaServer],
) -> None:
    agent = servers[0]
    with pytest.raises(OSError, match="HTTP 400"):
        replicas._request(agent.address, "PUT", "/steps/5/files/a?copy=own", b"abc", {"X-Sha256": _sha(b"x")})
    _put(agent, 5, "a", b"abc")
    replicas._request(agent.address, "PUT", "/steps/5/manifest", _manifest(5, {"a": b"abc"}).to_json())
    _put(agent, 10, "a", b"def")  # the next replica, still being copied
    assert sorted(_index(agent)) == ["10", "5"]
    assert replicas._request(agent.address, "GET", "/steps/5/files/a") == b"abc"
    with pytest.raises(OSError, match="HTTP 404"):
        replicas._request(agent.address, "GET", "/steps/5/files/b")
    # Step 10's manifest makes it the newest whole step: step 5 goes.
    replicas._request(agent.address, "PUT", "/steps/10/manifest", _manifest(10, {"a": b"def"}).to_json())
    assert list(_index(agent)) == ["10"]


def test_a_replica_is_whole_only_while_every_file_is_held_with_its_hash(servers: list[ReplicaServer]) -> None:
    own, peer = servers
    files = {"__0_0.distcp": b"rank0", "__1_0.distcp": b"rank1", ".metadata": b"meta"}
    # Step 20: rank 0's files on node A (own) and B (peer), rank 1's on B (own) and A (peer).
    for server, copy in ((own, "own"), (peer, "peer")):
        _put(server, 20, "__0_0.distcp", files["__0_0.distcp"], copy=copy)
        _put(server, 20, ".metadata", files[".metadata"], copy=copy)
    for server, copy in ((peer, "own"), (own, "peer")):
        _put(server, 20, "__1_0.distcp", files["__1_0.distcp"], copy=copy)
    for server in servers:
        replicas._request(server.address, "PUT", "/steps/20/manifest", _manifest(20, files).to_json())
    # Step 30: rank 1's file never arrived.
    _put(own, 30, "__0_0.distcp", b"newer")
    _put(own, 30, ".metadata", b"meta")
    newer = _manifest(30, {"__0_0.distcp": b"newer", "__1_0.distcp": b"lost", ".metadata": b"meta"})
    replicas._request(own.address, "PUT", "/steps/30/manifest", newer.to_json())

    indexes = {s.address: _index(s) for s in servers}
    found = whole_replicas(indexes, not_before=10)
    assert [c.manifest.step for c in found] == [20]  # 30 misses a file; own dropped 20 at 30's manifest
    assert found[0].holders == {
        ".metadata": [peer.address],
        "__0_0.distcp": [peer.address],
        "__1_0.distcp": [peer.address],
    }
    assert whole_replicas(indexes, not_before=25) == []  # older than the store's newest commit
    # A copy whose hash differs from the manifest's holds nothing.
    indexes[peer.address]["20"]["files"]["__1_0.distcp"] = "0" * 64  # type: ignore[index]
    assert whole_replicas(indexes, not_before=None) == []


def test_fetch_skips_a_copy_corrupted_at_rest_and_fails_when_it_is_the_only_one(
    servers: list[ReplicaServer], tmp_path: Path
) -> None:
    own, corrupting = servers
    body = b"rank 1's shard"
    _put(own, 7, "__1_0.distcp", body, copy="own")
    _put(corrupting, 7, "__1_0.distcp", body, copy="peer")  # flipped after the check on receipt
    assert _index(corrupting)["7"]["files"] == {"__1_0.distcp": _sha(body)}  # type: ignore[index]
    manifest = _manifest(7, {"__1_0.distcp": body})

    both = Candidate(manifest=manifest, holders={"__1_0.distcp": [corrupting.address, own.address]})
    assert fetch(both, tmp_path / "a", tag="rank-0") is None
    assert (tmp_path / "a" / "__1_0.distcp").read_bytes() == body

    only_corrupt = Candidate(manifest=manifest, holders={"__1_0.distcp": [corrupting.address]})
    error = fetch(only_corrupt, tmp_path / "b", tag="rank-0")
    assert error is not None and "the manifest says" in error
    assert not (tmp_path / "b" / "__1_0.distcp").exists()


def test_a_replica_newer_than_the_commit_is_loaded_and_the_store_is_left_as_it_was(
    tmp_path: Path, one_rank: None, servers: list[ReplicaServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "store").mkdir()
    store = FileStore(tmp_path / "store")
    monkeypatch.setenv(REPLICA_ADDR_ENV, servers[0].address)
    pending = [{"step": 12, "loss": 1.5}]
    held = Replicas.join(rank=0, world_size=1, records=lambda: pending)
    assert held is not None and held.peer is None  # one node: its own agent only

    checkpointer = Checkpointer(store, run_id="r", workdir=tmp_path / "work", rank=0, world_size=1, keep=2)
    weight = torch.zeros(100)
    checkpointer.save(10, {"w": weight}, extra={"reason": SaveReason.SCHEDULED.value})
    checkpointer.wait()
    weight.add_(2)
    held.save(12, {"w": weight}, extra={"reason": SaveReason.REPLICA.value})
    weight.add_(1)  # training goes on while the copy is made
    held.close()

    loaded = torch.zeros(100)
    manifest = checkpointer.load(lambda _: {"w": loaded}, held)
    assert manifest is not None and manifest.step == 12 and manifest.reason is SaveReason.REPLICA
    assert manifest.extra["records"] == pending  # rank 0's records not yet in the store travel with it
    assert torch.equal(loaded, torch.full((100,), 2.0))
    assert list(runstore.step_objects(store, "r")) == [10]  # nothing of the replica in the store

    # Without the agent (a new node, every holder gone) the store's commit is loaded.
    servers[0].steps.clear()
    manifest = checkpointer.load(lambda _: {"w": loaded}, held)
    assert manifest is not None and manifest.step == 10 and torch.equal(loaded, torch.zeros(100))


def _roundtrip(tmp_path: Path, store: FileStore, scheme: str, server: ReplicaServer, nproc: int) -> dict[str, Any]:
    """tests/replica_roundtrip.py on ``nproc`` ranks of one node whose agent is ``server``."""
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(scheme_spec(scheme).model_dump_json())
    out = tmp_path / f"roundtrip-{nproc}.pt"
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}",
        str(REPO / "tests" / "replica_roundtrip.py"),
        "--spec", str(spec_path), "--store", store.uri, "--run-id", "tiny",
        "--workdir", str(tmp_path / "trainer"), "--out", str(out),
    ]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), REPLICA_ADDR_ENV: server.address}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    loaded: dict[str, Any] = torch.load(out, weights_only=False)
    return loaded


@pytest.mark.parametrize("scheme", ["fsdp", "zero1"])
def test_a_replica_saved_on_two_ranks_loads_on_one_exactly_as_the_commit_of_its_step(
    scheme: str, servers: list[ReplicaServer], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """fsdp's DTensor shards and zero1's per-owner optimizer state, replicated on 2 ranks, are
    resharded onto 1 by DCP's load plan over the replica's own files, to the same bits as the
    store's commit of that step."""
    store = copy_of(reference_run(tmp_path_factory, scheme), tmp_path)
    saved = _roundtrip(tmp_path, store, scheme, servers[0], nproc=2)
    assert (saved["step"], saved["resumed_from"]) == (STEPS, "store")
    assert _index(servers[0])[str(STEPS)]["manifest"] is not None  # type: ignore[index]

    loaded = _roundtrip(tmp_path, store, scheme, servers[0], nproc=1)

    assert (loaded["step"], loaded["resumed_from"], loaded["store_resumed_from"]) == (STEPS, "replica", "store")
    replica, committed = loaded["replica"], loaded["store"]
    assert sorted(replica) == sorted(committed) and any(k.startswith("optimizer.state.") for k in replica)
    for key, value in committed.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(replica[key], value), key
        else:
            assert replica[key] == value, key


def test_a_replica_of_a_state_whose_shape_changed_fails_and_the_next_agrees_a_new_layout(
    tmp_path: Path, one_rank: None, servers: list[ReplicaServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(REPLICA_ADDR_ENV, servers[0].address)
    held = Replicas.join(rank=0, world_size=1, records=list)
    assert held is not None
    held.save(1, {"w": torch.ones(4)}, extra={"reason": SaveReason.REPLICA.value})
    # A state that gained a key: the layout agreed at step 1 no longer says where it goes.
    grown = {"w": torch.ones(4), "v": torch.full((2,), 3.0)}
    held.save(2, grown, extra={"reason": SaveReason.REPLICA.value})
    held.save(3, grown, extra={"reason": SaveReason.REPLICA.value})
    held.close()

    assert sorted(_index(servers[0])) == ["3"]  # step 2 sent nothing; 3 dropped step 1
    (tmp_path / "store").mkdir()
    checkpointer = Checkpointer(
        FileStore(tmp_path / "store"), run_id="r", workdir=tmp_path, rank=0, world_size=1, keep=2
    )
    loaded = {"w": torch.zeros(4), "v": torch.zeros(2)}
    manifest = checkpointer.load(lambda _: loaded, held)
    assert manifest is not None and manifest.step == 3
    assert torch.equal(loaded["v"], torch.full((2,), 3.0)) and torch.equal(loaded["w"], torch.ones(4))
