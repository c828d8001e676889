"""The store API and the checkpoint commit protocol on the file:// backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from infractl import runstore
from infractl.errors import ConfigError
from infractl.runstore import CheckpointError, Manifest, ManifestEntry
from infractl.store import FileStore, StoreKeyError, open_store


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "store")


def test_put_if_absent_is_create_only(store: FileStore) -> None:
    assert store.put_if_absent("a/COMMITTED", b"1")
    assert not store.put_if_absent("a/COMMITTED", b"2")
    assert store.get_bytes("a/COMMITTED") == b"1"


def test_list_is_recursive_sorted_and_sized(store: FileStore) -> None:
    store.put_bytes("p/b/x", b"123")
    store.put_bytes("p/a", b"1")
    assert [(o.key, o.size) for o in store.list("p")] == [("p/a", 1), ("p/b/x", 3)]
    assert store.list("missing/") == []


def test_get_missing_key_raises_store_key_error(store: FileStore) -> None:
    with pytest.raises(StoreKeyError):
        store.get_bytes("nope")


def test_keys_cannot_escape_the_root(store: FileStore) -> None:
    with pytest.raises(ValueError, match="escapes"):
        store.put_bytes("../outside", b"x")


def test_delete_prefix_counts_objects(store: FileStore) -> None:
    store.put_bytes("r/1", b"x")
    store.put_bytes("r/d/2", b"x")
    assert store.delete_prefix("r") == 2
    assert store.list("r") == []


def test_open_store_refuses_unknown_scheme() -> None:
    with pytest.raises(ConfigError, match="run.store: unsupported store URI 'gs://b/x'"):
        open_store("gs://b/x", field="run.store")


def _checkpoint(store: FileStore, step: int, *, commit: bool = True) -> None:
    prefix = runstore.checkpoint_prefix("r", step)
    store.put_bytes(f"{prefix}/shard", b"abcd")
    if commit:
        manifest = Manifest(step=step, world_size=2, files=[ManifestEntry("shard", 4, "0" * 64)])
        assert runstore.commit_checkpoint(store, "r", manifest)


def test_only_committed_steps_count(store: FileStore) -> None:
    _checkpoint(store, 10)
    _checkpoint(store, 20, commit=False)
    assert runstore.committed_steps(store, "r") == [10]
    assert runstore.latest_committed_step(store, "r") == 10


def test_verify_refuses_uncommitted_and_truncated_steps(store: FileStore) -> None:
    _checkpoint(store, 10)
    _checkpoint(store, 20, commit=False)
    assert runstore.verify_checkpoint(store, "r", 10).step == 10
    with pytest.raises(CheckpointError, match="not committed"):
        runstore.verify_checkpoint(store, "r", 20)
    store.put_bytes(f"{runstore.checkpoint_prefix('r', 10)}/shard", b"ab")
    with pytest.raises(CheckpointError, match="2 bytes, manifest says 4"):
        runstore.verify_checkpoint(store, "r", 10)


def test_prune_keeps_newest_and_removes_stale_partials(store: FileStore) -> None:
    for step in (10, 20, 30):
        _checkpoint(store, step)
    _checkpoint(store, 25, commit=False)  # an interrupted save older than the newest commit
    _checkpoint(store, 40, commit=False)  # a save that may still be in flight
    assert runstore.prune_checkpoints(store, "r", keep=2) == [10, 25]
    assert runstore.committed_steps(store, "r") == [20, 30]
    assert store.list(runstore.checkpoint_prefix("r", 40))


def test_metrics_keep_the_newest_record_of_a_step(store: FileStore) -> None:
    runstore.write_metrics(store, "r", [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}])
    runstore.write_metrics(store, "r", [{"step": 2, "loss": 3.5}, {"step": 3, "loss": 3.0}])
    assert [(m["step"], m["loss"]) for m in runstore.read_metrics(store, "r")] == [(1, 5.0), (2, 3.5), (3, 3.0)]
    assert runstore.latest_metrics(store, "r") == {"step": 3, "loss": 3.0}
