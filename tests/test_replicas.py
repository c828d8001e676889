"""In-memory checkpoint replicas (trainer/replicas.py): the agent's server over real HTTP on
loopback, which replicas count as whole, the fetch that never takes a corrupt copy, a replica
saved and loaded by one rank, and one saved by two ranks loaded on one (DCP reshards it); every
request signed with the run's key, and what is not (or is signed with another key) refused. The
drills (tests/test_drill.py) and the four-node cluster (tests/test_elastic_batch.py) run them
across nodes; tests/test_security.py attacks them from the cluster network."""

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
from trainer.replica_server import (
    REPLICA_ADDR_ENV,
    RUN_KEY_FILE_ENV,
    SHA256_HEADER,
    SIGNATURE_HEADER,
    ReplicaServer,
    RunKey,
)
from trainer.replicas import Candidate, Replicas, fetch, whole_replicas

#: The run key of every test here, and one of another run (what an intruder could sign with).
KEY = RunKey(secret=bytes(range(32)), run="r", attempt=1)
OTHER_KEY = RunKey(secret=bytes(32), run="r", attempt=1)
#: The servers' cap on a file's body.
MAX_BYTES = 1 << 20


@pytest.fixture
def servers() -> Iterator[list[ReplicaServer]]:
    """Two agents' servers on loopback; the second corrupts what it holds for other nodes."""
    started = [
        ReplicaServer("127.0.0.1", KEY, max_bytes=MAX_BYTES),
        ReplicaServer("127.0.0.1", KEY, max_bytes=MAX_BYTES, corrupt_peer_copies=True),
    ]
    for server in started:
        server.start()
    yield started
    for server in started:
        server.shutdown()
        server.server_close()


@pytest.fixture
def keyed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process (and what it starts) in run ``KEY``'s environment, as the launcher sets a node's."""
    key_file = tmp_path / "run.key"
    key_file.write_text(KEY.secret.hex())
    env = {RUN_KEY_FILE_ENV: str(key_file), "INFRACTL_RUN": KEY.run, "INFRACTL_ATTEMPT": str(KEY.attempt)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def _sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _put(server: ReplicaServer, step: int, key: str, body: bytes, *, copy: str = "own") -> None:
    replicas.put_file(KEY, server.address, step, key, body, copy=copy)


def _manifest(step: int, files: dict[str, bytes]) -> Manifest:
    entries = [ManifestEntry(key=k, size=len(v), sha256=_sha(v)) for k, v in files.items()]
    return Manifest(step=step, world_size=2, files=entries, extra={"reason": "replica"})


def _index(server: ReplicaServer) -> dict[str, dict[str, object]]:
    return json.loads(replicas.get(KEY, server.address, "/index")[0])  # type: ignore[no-any-return]


def test_an_agent_refuses_a_copy_that_differs_from_its_hash_and_keeps_one_step_with_a_manifest(
    servers: list[ReplicaServer],
) -> None:
    agent = servers[0]
    wrong = {SHA256_HEADER: _sha(b"x"), SIGNATURE_HEADER: KEY.sign_body("file", 5, "rank-0", _sha(b"x"))}
    with pytest.raises(OSError, match="HTTP 400"):
        replicas._request(agent.address, "PUT", "/steps/5/files/rank-0?copy=own", b"abc", wrong)
    _put(agent, 5, "rank-0", b"abc")
    replicas.put_manifest(KEY, agent.address, _manifest(5, {"rank-0": b"abc"}))
    _put(agent, 10, "rank-0", b"def")  # the next replica, still being copied
    assert sorted(_index(agent)) == ["10", "5"]
    assert replicas.get(KEY, agent.address, "/steps/5/files/rank-0")[0] == b"abc"
    with pytest.raises(OSError, match="HTTP 404"):
        replicas.get(KEY, agent.address, "/steps/5/files/rank-1")
    # Step 10's manifest makes it the newest whole step: step 5 goes.
    replicas.put_manifest(KEY, agent.address, _manifest(10, {"rank-0": b"def"}))
    assert list(_index(agent)) == ["10"]


def test_an_agent_refuses_what_the_run_key_did_not_sign_and_keeps_what_it_held(
    servers: list[ReplicaServer], capsys: pytest.CaptureFixture[str]
) -> None:
    agent = servers[0]
    _put(agent, 5, "rank-0", b"real")
    replicas.put_manifest(KEY, agent.address, _manifest(5, {"rank-0": b"real"}))
    forged = _manifest(10**9, {"rank-0": b"payload"})
    body = forged.to_json()
    attempts = [
        # A file with the right sha256 and no signature, then one signed with another key.
        ("PUT", "/steps/1000000000/files/rank-0?copy=own", b"payload", {SHA256_HEADER: _sha(b"payload")}, 403),
        (
            "PUT",
            "/steps/1000000000/files/rank-0?copy=own",
            b"payload",
            {
                SHA256_HEADER: _sha(b"payload"),
                SIGNATURE_HEADER: OTHER_KEY.sign_body("file", 10**9, "rank-0", _sha(b"payload")),
            },
            403,
        ),
        # A manifest of a future step: it would drop every real step were it taken.
        (
            "PUT",
            "/steps/1000000000/manifest",
            body,
            {SIGNATURE_HEADER: OTHER_KEY.sign_body("manifest", 10**9, "manifest", _sha(body))},
            403,
        ),
        # A name that is not a replica's file, a body larger than the cap (refused unread).
        (
            "PUT",
            "/steps/5/files/..%2Fescape?copy=own",
            b"x",
            {SHA256_HEADER: _sha(b"x"), SIGNATURE_HEADER: "0" * 64},
            404,
        ),
        ("PUT", "/steps/5/files/rank-1?copy=own", b"", {"Content-Length": str(MAX_BYTES + 1)}, 413),
        # Reads need the key too: the weights and the index.
        ("GET", "/index", None, {}, 403),
        (
            "GET",
            "/steps/5/files/rank-0",
            None,
            {SIGNATURE_HEADER: OTHER_KEY.sign_request("GET", "/steps/5/files/rank-0")},
            403,
        ),
    ]
    for method, path, payload, headers, status in attempts:
        with pytest.raises(OSError, match=f"HTTP {status}"):
            replicas._request(agent.address, method, path, payload, headers)
    assert sorted(_index(agent)) == ["5"]
    assert replicas.get(KEY, agent.address, "/steps/5/files/rank-0")[0] == b"real"
    said = capsys.readouterr()
    refusals = [line for line in (said.out + said.err).splitlines() if "replica_refused" in line]
    assert len(refusals) == len(attempts) and all("127.0.0.1:" in line for line in refusals), refusals


def test_a_replica_is_whole_only_while_every_file_is_held_with_its_hash(servers: list[ReplicaServer]) -> None:
    own, peer = servers
    files = {"rank-0": b"rank0", "rank-1": b"rank1", "metadata": b"meta"}
    # Step 20: rank 0's files on node A (own) and B (peer), rank 1's on B (own) and A (peer).
    for server, copy in ((own, "own"), (peer, "peer")):
        _put(server, 20, "rank-0", files["rank-0"], copy=copy)
        _put(server, 20, "metadata", files["metadata"], copy=copy)
    for server, copy in ((peer, "own"), (own, "peer")):
        _put(server, 20, "rank-1", files["rank-1"], copy=copy)
    for server in servers:
        replicas.put_manifest(KEY, server.address, _manifest(20, files))
    # Step 30: rank 1's file never arrived.
    _put(own, 30, "rank-0", b"newer")
    _put(own, 30, "metadata", b"meta")
    newer = _manifest(30, {"rank-0": b"newer", "rank-1": b"lost", "metadata": b"meta"})
    replicas.put_manifest(KEY, own.address, newer)

    indexes = {s.address: _index(s) for s in servers}
    found = whole_replicas(indexes, not_before=10, key=KEY)
    assert [c.manifest.step for c in found] == [20]  # 30 misses a file; own dropped 20 at 30's manifest
    assert found[0].holders == {"metadata": [peer.address], "rank-0": [peer.address], "rank-1": [peer.address]}
    assert whole_replicas(indexes, not_before=25, key=KEY) == []  # older than the store's newest commit
    # Checked with another run's key, no manifest verifies: nothing is whole.
    assert whole_replicas(indexes, not_before=None, key=OTHER_KEY) == []
    # A copy whose hash differs from the manifest's holds nothing.
    indexes[peer.address]["20"]["files"]["rank-1"] = "0" * 64  # type: ignore[index]
    assert whole_replicas(indexes, not_before=None, key=KEY) == []


def test_a_manifest_an_index_lists_counts_only_once_its_signature_verifies(servers: list[ReplicaServer]) -> None:
    """What an agent that was lied to (or a forged index) lists: a manifest for a future step
    whose files are held with the right sha256, signed with another key or not at all."""
    own = servers[0]
    _put(own, 4, "rank-0", b"real")
    replicas.put_manifest(KEY, own.address, _manifest(4, {"rank-0": b"real"}))
    index = _index(own)
    payload = b"not the run's"
    forged = _manifest(10**9, {"rank-0": payload}).to_json().decode()
    for signature in ("", OTHER_KEY.sign_body("manifest", 10**9, "manifest", _sha(forged.encode()))):
        index[str(10**9)] = {"manifest": forged, "signature": signature, "files": {"rank-0": _sha(payload)}}
        assert [c.manifest.step for c in whole_replicas({own.address: index}, not_before=None, key=KEY)] == [4]


def test_fetch_skips_a_copy_corrupted_at_rest_and_fails_when_it_is_the_only_one(
    servers: list[ReplicaServer], tmp_path: Path
) -> None:
    own, corrupting = servers
    body = b"rank 1's shard"
    _put(own, 7, "rank-1", body, copy="own")
    _put(corrupting, 7, "rank-1", body, copy="peer")  # flipped after the check on receipt
    assert _index(corrupting)["7"]["files"] == {"rank-1": _sha(body)}  # type: ignore[index]
    manifest = _manifest(7, {"rank-1": body})

    both = Candidate(manifest=manifest, holders={"rank-1": [corrupting.address, own.address]})
    assert fetch(both, tmp_path / "a", tag="rank-0", key=KEY) is None
    assert (tmp_path / "a" / "rank-1").read_bytes() == body

    only_corrupt = Candidate(manifest=manifest, holders={"rank-1": [corrupting.address]})
    error = fetch(only_corrupt, tmp_path / "b", tag="rank-0", key=KEY)
    assert error is not None and "the manifest says" in error
    assert not (tmp_path / "b" / "rank-1").exists()


def test_fetch_passes_over_a_holder_whose_copy_was_not_signed_with_the_run_key(
    servers: list[ReplicaServer], tmp_path: Path
) -> None:
    """A holder that serves the manifest's bytes under another signature (what it was given was
    not the run's) is passed over for one whose copy verifies."""
    lying, own = servers
    body = b"rank 0's shard"
    lying.put_file(3, "rank-0", body, _sha(body), OTHER_KEY.sign_body("file", 3, "rank-0", _sha(body)), peer=False)
    _put(own, 3, "rank-0", body)
    manifest = _manifest(3, {"rank-0": body})
    only_lying = Candidate(manifest=manifest, holders={"rank-0": [lying.address]})
    error = fetch(only_lying, tmp_path / "a", tag="rank-0", key=KEY)
    assert error is not None and "does not verify" in error and not (tmp_path / "a" / "rank-0").exists()
    both = Candidate(manifest=manifest, holders={"rank-0": [lying.address, own.address]})
    assert fetch(both, tmp_path / "b", tag="rank-0", key=KEY) is None


def test_a_replica_newer_than_the_commit_is_loaded_and_the_store_is_left_as_it_was(
    tmp_path: Path, one_rank: None, servers: list[ReplicaServer], keyed: dict[str, str], monkeypatch: pytest.MonkeyPatch
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


def _roundtrip(
    tmp_path: Path, store: FileStore, scheme: str, server: ReplicaServer, keyed: dict[str, str], nproc: int
) -> dict[str, Any]:
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
    env = os.environ | keyed | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), REPLICA_ADDR_ENV: server.address}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    loaded: dict[str, Any] = torch.load(out, weights_only=False)
    return loaded


@pytest.mark.cluster
@pytest.mark.parametrize("scheme", ["fsdp", "zero1"])
def test_a_replica_saved_on_two_ranks_loads_on_one_exactly_as_the_commit_of_its_step(
    scheme: str,
    servers: list[ReplicaServer],
    keyed: dict[str, str],
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """fsdp's DTensor shards and zero1's per-owner optimizer state, replicated on 2 ranks, are
    resharded onto 1 by DCP's load plan over the replica's own files, to the same bits as the
    store's commit of that step."""
    store = copy_of(reference_run(tmp_path_factory, scheme), tmp_path)
    saved = _roundtrip(tmp_path, store, scheme, servers[0], keyed, nproc=2)
    assert (saved["step"], saved["resumed_from"]) == (STEPS, "store")
    assert _index(servers[0])[str(STEPS)]["manifest"] is not None  # type: ignore[index]

    loaded = _roundtrip(tmp_path, store, scheme, servers[0], keyed, nproc=1)

    assert (loaded["step"], loaded["resumed_from"], loaded["store_resumed_from"]) == (STEPS, "replica", "store")
    replica, committed = loaded["replica"], loaded["store"]
    assert sorted(replica) == sorted(committed) and any(k.startswith("optimizer.state.") for k in replica)
    for key, value in committed.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(replica[key], value), key
        else:
            assert replica[key] == value, key


def test_a_replica_of_a_state_whose_shape_changed_fails_and_the_next_agrees_a_new_layout(
    tmp_path: Path, one_rank: None, servers: list[ReplicaServer], keyed: dict[str, str], monkeypatch: pytest.MonkeyPatch
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
