"""The store API and the checkpoint commit protocol, on every backend.

Tests taking ``store`` run twice: on ``file://`` and on ``s3://`` against a real S3 API server
(moto's standalone server over HTTP, see ``s3_server`` in conftest). S3-only behaviour (conditional
writes, multipart, pagination, preflight errors) is tested further down.
"""

from __future__ import annotations

import json
import pickle
import re
import time
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from infractl import runstore
from infractl.errors import ConfigError, UsageError
from infractl.runstore import CheckpointError, Manifest, ManifestEntry
from infractl.store import FileStore, S3Store, Store, StoreError, StoreKeyError, StoreUnavailable, open_store
from infractl.store.s3 import S3_READ_TIMEOUT_S

from conftest import REPO, Cli, S3AuthServer, s3_client, write

MIB = 1024 * 1024


@pytest.fixture
def store(store_uri: str) -> Store:
    return open_store(store_uri, field="cluster.store")


# --- the Store API, on every backend ---------------------------------------------------------


def test_put_if_absent_is_create_only(store: Store) -> None:
    assert store.put_if_absent("a/COMMITTED", b"1")
    assert not store.put_if_absent("a/COMMITTED", b"2")
    assert store.get_bytes("a/COMMITTED") == b"1"


def test_list_is_recursive_sorted_and_sized(store: Store) -> None:
    store.put_bytes("p/b/x", b"123")
    store.put_bytes("p/a", b"1")
    store.put_bytes("pq/not-under-p", b"1")
    assert [(o.key, o.size) for o in store.list("p")] == [("p/a", 1), ("p/b/x", 3)]
    assert [(o.key, o.size) for o in store.list("p/")] == [("p/a", 1), ("p/b/x", 3)]
    assert [o.key for o in store.list("p/a")] == ["p/a"]
    assert [o.key for o in store.list("")] == ["p/a", "p/b/x", "pq/not-under-p"]
    assert store.list("missing/") == []


def test_get_missing_key_raises_store_key_error(store: Store, tmp_path: Path) -> None:
    with pytest.raises(StoreKeyError):
        store.get_bytes("nope")
    with pytest.raises(StoreKeyError):
        store.get_file("nope", tmp_path / "dl" / "nope")
    assert not (tmp_path / "dl" / "nope").exists()
    assert not store.exists("nope")


def test_put_file_and_get_file_round_trip(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(b"\x00\x01shard" * 1000)
    store.put_file("ckpt/shard.bin", src)
    assert store.exists("ckpt/shard.bin")
    assert store.list("ckpt") == [store.list("ckpt")[0]]
    assert store.list("ckpt")[0].size == src.stat().st_size
    dest = tmp_path / "restore" / "deep" / "shard.bin"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"old")
    store.get_file("ckpt/shard.bin", dest)
    assert dest.read_bytes() == src.read_bytes()
    assert [p.name for p in dest.parent.iterdir()] == ["shard.bin"]  # no temp file left behind


def test_delete_prefix_counts_objects(store: Store) -> None:
    store.put_bytes("r/1", b"x")
    store.put_bytes("r/d/2", b"x")
    store.put_bytes("rr/keep", b"x")
    assert store.delete_prefix("r") == 2
    assert store.list("r") == []
    assert store.delete_prefix("r") == 0
    assert [o.key for o in store.list("")] == ["rr/keep"]


def test_uri_reopens_the_same_store(store: Store) -> None:
    store.put_bytes("runs/x/run.json", b"{}")
    again = open_store(store.uri, field="other")
    assert again.uri == store.uri
    assert again.get_bytes("runs/x/run.json") == b"{}"
    assert (store.field, again.field) == ("cluster.store", "other")


def test_check_passes_and_leaves_nothing_behind(store: Store) -> None:
    store.check()
    store.check()
    assert store.list("") == []


# --- the checkpoint commit protocol, on every backend ----------------------------------------


def _checkpoint(store: Store, step: int, *, commit: bool = True) -> None:
    prefix = runstore.checkpoint_prefix("r", step)
    store.put_bytes(f"{prefix}/shard", b"abcd")
    if commit:
        manifest = Manifest(step=step, world_size=2, files=[ManifestEntry("shard", 4, "0" * 64)])
        assert runstore.commit_checkpoint(store, "r", manifest)


def test_only_committed_steps_count(store: Store) -> None:
    _checkpoint(store, 10)
    _checkpoint(store, 20, commit=False)
    assert runstore.committed_steps(store, "r") == [10]
    assert runstore.latest_committed_step(store, "r") == 10


def test_a_retried_commit_is_harmless(store: Store) -> None:
    _checkpoint(store, 10)
    manifest = Manifest(step=10, world_size=2, files=[ManifestEntry("shard", 4, "0" * 64)])
    assert not runstore.commit_checkpoint(store, "r", manifest)
    assert runstore.committed_steps(store, "r") == [10]


def test_verify_refuses_uncommitted_and_truncated_steps(store: Store) -> None:
    _checkpoint(store, 10)
    _checkpoint(store, 20, commit=False)
    assert runstore.verify_checkpoint(store, "r", 10).step == 10
    with pytest.raises(CheckpointError, match="not committed"):
        runstore.verify_checkpoint(store, "r", 20)
    store.put_bytes(f"{runstore.checkpoint_prefix('r', 10)}/shard", b"ab")
    with pytest.raises(CheckpointError, match="2 bytes, manifest says 4"):
        runstore.verify_checkpoint(store, "r", 10)


def test_prune_keeps_newest_and_removes_stale_partials(store: Store) -> None:
    for step in (10, 20, 30):
        _checkpoint(store, step)
    _checkpoint(store, 25, commit=False)  # an interrupted save older than the newest commit
    _checkpoint(store, 40, commit=False)  # a save that may still be in flight
    assert runstore.prune_checkpoints(store, "r", keep=2) == [10, 25]
    assert runstore.committed_steps(store, "r") == [20, 30]
    assert store.list(runstore.checkpoint_prefix("r", 40))


def test_a_copy_is_a_second_object_with_the_same_bytes(store: Store) -> None:
    store.put_bytes("a/x", b"payload")
    store.copy("a/x", "b/y")
    assert store.get_bytes("b/y") == b"payload" and store.get_bytes("a/x") == b"payload"
    with pytest.raises(StoreKeyError):
        store.copy("a/missing", "b/z")


def test_set_aside_moves_the_committed_steps_after_one_whole_and_leaves_the_rest(store: Store) -> None:
    for step in (10, 20, 30):
        _checkpoint(store, step)
    _checkpoint(store, 40, commit=False)  # a save interrupted by the stop: the resume deletes it
    with pytest.raises(CheckpointError, match="step 15 of run 'r' is not committed"):
        runstore.set_aside(store, "r", 15)
    assert runstore.committed_steps(store, "r") == [10, 20, 30]

    moved, aside = runstore.set_aside(store, "r", 10)

    assert moved == [20, 30] and aside.startswith("runs/r/rolled-back/")
    assert runstore.committed_steps(store, "r") == [10] and store.list(runstore.checkpoint_prefix("r", 40))
    for step in moved:
        kept = [o.key.rsplit("/", 1)[1] for o in store.list(f"{aside}/step-{step:08d}")]
        assert kept == ["COMMITTED", "MANIFEST.json", "shard"], kept


def test_metrics_keep_the_newest_record_of_a_step(store: Store) -> None:
    runstore.write_metrics(store, "r", [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}])
    runstore.write_metrics(store, "r", [{"step": 2, "loss": 3.5}, {"step": 3, "loss": 3.0}])
    assert [(m["step"], m["loss"]) for m in runstore.read_metrics(store, "r")] == [(1, 5.0), (2, 3.5), (3, 3.0)]
    assert runstore.latest_metrics(store, "r") == {"step": 3, "loss": 3.0}


def test_run_records_are_listed_and_round_trip(store: Store) -> None:
    attempt = runstore.Attempt(
        attempt=1,
        started=1.0,
        resume_from=0,
        nodes=["node-0"],
        rdzv_id="a-1-x",
        rejoins=[runstore.Rejoin(node="node-1", time=2.0, pid=7)],
    )
    runstore.write_run_record(store, runstore.RunRecord(run_id="a", cluster="c", attempts=[attempt]))
    runstore.write_run_record(store, runstore.RunRecord(run_id="b", cluster="c"))
    assert runstore.list_runs(store) == ["a", "b"]
    again = runstore.read_run_record(store, "a")
    assert again == runstore.RunRecord(run_id="a", cluster="c", attempts=[attempt])
    assert again.last_attempt is not None and again.last_attempt.rejoins_of("node-1") == 1
    assert runstore.read_run_record(store, "missing") is None


def test_records_read_fields_they_do_not_know_and_default_those_they_lack(store: Store) -> None:
    store.put_bytes(
        "runs/a/run.json",
        json.dumps(
            {
                "run_id": "a",
                "cluster": "c",
                "from_a_newer_version": 1,
                "attempts": [{"attempt": 1, "started": 1.0, "resume_from": 0, "nodes": [], "rdzv_id": "x"}],
            }
        ).encode(),
    )
    record = runstore.read_run_record(store, "a")
    assert record is not None and record.spec is None and record.attempts[0].rejoins == []
    assert record.cluster_id is None  # written before runs recorded their cluster's id
    store.put_bytes("runs/b/run.json", b'{"cluster": "c"}')
    with pytest.raises(StoreError, match="runs/b/run.json is not a run record"):
        runstore.read_run_record(store, "b")


def test_drill_records_round_trip(store: Store) -> None:
    record = runstore.DrillRecord(
        drill_id="d1",
        drill="kill-node",
        run_id="a",
        cluster="c",
        node="node-1",
        survivors=["node-0"],
        fault_time=5.0,
        fault={"signal": "SIGKILL"},
        step_at_fault=12,
        last_committed_step=10,
        world_size_at_fault=2,
        resumed_from_step=10,
        expected_resume_step=10,
        outcome="recovered",
    )
    runstore.write_drill_record(store, record)
    assert runstore.read_drill_records(store, "a") == [record]
    assert json.loads(store.get_bytes(runstore.drill_key("a", "d1")))["resumed_correctly"] is True


def test_keys_cannot_escape_the_root(store: Store) -> None:
    with pytest.raises(ValueError, match="escapes"):
        store.put_bytes("../outside", b"x")


# --- file:// only ----------------------------------------------------------------------------


def test_open_store_refuses_unknown_scheme() -> None:
    with pytest.raises(ConfigError, match="run.store: unsupported store URI 'gs://b/x'"):
        open_store("gs://b/x", field="run.store")


def test_file_ensure_makes_the_directory_and_check_leaves_it_empty(tmp_path: Path) -> None:
    store = open_store((tmp_path / "a" / "b").as_uri(), field="cluster.store")
    assert isinstance(store, FileStore)
    store.check(create_ok=True)
    assert not (tmp_path / "a").exists()  # a check creates nothing
    store.ensure()
    store.check()
    assert list(store.root.iterdir()) == []


def test_file_store_root_is_made_only_by_ensure_and_check_names_the_field(tmp_path: Path) -> None:
    (tmp_path / "plain-file").write_text("x")
    uri = (tmp_path / "plain-file" / "store").as_uri()
    store = open_store(uri, field="cluster.store")
    assert isinstance(store, FileStore)
    with pytest.raises(ConfigError) as err:
        store.check()
    assert str(err.value) == f"cluster.store: store directory {store.root} does not exist"
    with pytest.raises(ConfigError) as err:
        store.check(create_ok=True)
    assert str(err.value) == f"cluster.store: cannot create {uri}: {tmp_path / 'plain-file'} is not a directory"
    with pytest.raises(ConfigError) as err:
        store.ensure()
    assert str(err.value).startswith(f"cluster.store: cannot create {uri}: ")
    assert "\n" not in str(err.value)


def test_outage_takes_a_file_store_down_and_brings_it_back(tmp_path: Path) -> None:
    store = open_store((tmp_path / "store").as_uri())
    store.ensure()
    store.put_bytes("runs/x/run.json", b"{}")
    with store.outage() as done:
        assert done["how"] == "directory moved away"
        with pytest.raises(StoreUnavailable):
            store.ping()
    assert store.get_bytes("runs/x/run.json") == b"{}"


def test_outage_of_an_s3_store_not_served_here_is_refused_at_once(aws_test_env: dict[str, str]) -> None:
    store = open_store("s3://bkt/p?endpoint_url=http://10.255.255.1:9000")
    with pytest.raises(UsageError, match="is not served on this machine"):
        store.outage()


def test_file_store_whose_directory_vanished_is_unavailable_and_not_recreated(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    store.ensure()
    store.put_bytes("runs/x/run.json", b"{}")
    moved = tmp_path / "elsewhere"
    store.root.rename(moved)
    for call in (
        lambda: store.put_bytes("runs/x/a", b"1"),
        lambda: store.put_file("runs/x/b", moved / "runs/x/run.json"),
        lambda: store.put_if_absent("runs/x/c", b"1"),
        lambda: store.get_bytes("runs/x/run.json"),
        lambda: store.get_file("runs/x/run.json", tmp_path / "out"),
        lambda: store.exists("runs/x/run.json"),
        lambda: store.list("runs"),
        lambda: store.delete_prefix("runs"),
    ):
        with pytest.raises(StoreUnavailable, match="does not exist"):
            call()
    assert not store.root.exists()
    moved.rename(store.root)
    assert store.get_bytes("runs/x/run.json") == b"{}"


# --- s3:// URIs -------------------------------------------------------------------------------


def test_s3_uri_is_canonical_and_keeps_endpoint_and_region() -> None:
    uri = "s3://bkt//a/b/?region=eu-west-1&endpoint_url=http://127.0.0.1:9000/"
    store = open_store(uri, field="f")
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.endpoint_url, store.region) == (
        "bkt",
        "a/b",
        "http://127.0.0.1:9000",
        "eu-west-1",
    )
    assert store.uri == "s3://bkt/a/b?endpoint_url=http://127.0.0.1:9000&region=eu-west-1"
    assert open_store("s3://bkt").uri == "s3://bkt"


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("s3://AKIAX:SECRETX@bkt/p", "credentials do not belong in an s3:// URI"),
        ("s3:///p", "does not name a valid bucket"),
        ("s3://Bad_Bucket/p", "does not name a valid bucket"),
        ("s3://bkt/p?access_key=x", "unknown s3:// URI option 'access_key'"),
        ("s3://bkt/p?region=a&region=b", "option 'region' given twice"),
        ("s3://bkt/p?endpoint_url=localhost:9000", "endpoint_url must look like http(s)://"),
        ("s3://bkt/a/../b", "must not contain '..'"),
        ("s3://[", "is not a URI (Invalid IPv6 URL)"),  # found by the property tests
    ],
)
def test_bad_s3_uris_are_config_errors(uri: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        open_store(uri, field="cluster.store")
    assert str(err.value).startswith("cluster.store: ") and message in str(err.value)
    assert "SECRETX" not in str(err.value)


# --- s3:// against the real S3 API server ---------------------------------------------------


def _s3(uri: str, **knobs: Any) -> S3Store:
    """The store of ``uri`` with tuning knobs (thresholds, page size) changed for a test."""
    base = open_store(uri)
    assert isinstance(base, S3Store)
    return S3Store(base.bucket, base.prefix, endpoint_url=base.endpoint_url, field="cluster.store", **knobs)


def _count_calls(store: S3Store, operation: str) -> list[int]:
    calls: list[int] = []
    store.client.meta.events.register(f"before-call.s3.{operation}", lambda **_: calls.append(1))
    return calls


def test_s3_conditional_put_gets_412_over_http(s3_store_uri: str) -> None:
    store = _s3(s3_store_uri)
    assert store.put_if_absent("ckpt/step-1/COMMITTED", b"1")
    # The server itself refuses the second create-only write: not a client-side existence check.
    raw = s3_client(store.endpoint_url or "")
    with pytest.raises(ClientError) as err:
        raw.put_object(Bucket=store.bucket, Key="store/ckpt/step-1/COMMITTED", Body=b"2", IfNoneMatch="*")
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    puts = _count_calls(store, "PutObject")
    assert not store.put_if_absent("ckpt/step-1/COMMITTED", b"2")
    assert len(puts) == 1  # one conditional request, no head-then-put
    assert store.get_bytes("ckpt/step-1/COMMITTED") == b"1"


def test_s3_keys_live_under_the_prefix(s3_store_uri: str) -> None:
    store = _s3(s3_store_uri)
    store.put_bytes("runs/a/run.json", b"{}")
    raw = s3_client(store.endpoint_url or "")
    keys = [o["Key"] for o in raw.list_objects_v2(Bucket=store.bucket)["Contents"]]
    assert keys == ["store/runs/a/run.json"]
    # Another prefix in the same bucket is another store.
    other = S3Store(store.bucket, "store2", endpoint_url=store.endpoint_url)
    other.put_bytes("runs/b/run.json", b"{}")
    assert [o.key for o in store.list("")] == ["runs/a/run.json"]
    assert [o.key for o in other.list("runs")] == ["runs/b/run.json"]
    assert store.delete_prefix("") == 1 and other.list("") != []


def test_s3_multipart_above_the_threshold(s3_store_uri: str, tmp_path: Path) -> None:
    store = _s3(s3_store_uri, multipart_threshold=5 * MIB, multipart_chunksize=5 * MIB)
    src = tmp_path / "shard.distcp"
    src.write_bytes(bytes(range(256)) * (11 * MIB // 256))  # 11 MiB: three parts
    parts = _count_calls(store, "UploadPart")
    store.put_file("ckpt/shard.distcp", src)
    assert len(parts) == 3
    head = store.client.head_object(Bucket=store.bucket, Key="store/ckpt/shard.distcp")
    assert head["ETag"].strip('"').endswith("-3")  # S3's multipart ETag: <md5 of md5s>-<parts>
    assert store.list("ckpt")[0].size == 11 * MIB
    dest = tmp_path / "restore" / "shard.distcp"
    store.get_file("ckpt/shard.distcp", dest)
    assert dest.read_bytes() == src.read_bytes()
    assert [p.name for p in dest.parent.iterdir()] == ["shard.distcp"]


def test_s3_small_files_are_single_puts(s3_store_uri: str, tmp_path: Path) -> None:
    store = _s3(s3_store_uri, multipart_threshold=5 * MIB)
    src = tmp_path / "small"
    src.write_bytes(b"x" * 1000)
    creates, puts = _count_calls(store, "CreateMultipartUpload"), _count_calls(store, "PutObject")
    store.put_file("small", src)
    assert (len(creates), len(puts)) == (0, 1)


def test_s3_list_and_delete_span_pages_and_batches(s3_store_uri: str) -> None:
    store = _s3(s3_store_uri, page_size=2, delete_batch=3)
    keys = [f"m/{i:02d}" for i in range(7)] + ["m/sub/x"]
    for key in keys:
        store.put_bytes(key, b"ab")
    pages = _count_calls(store, "ListObjectsV2")
    assert [(o.key, o.size) for o in store.list("m")] == [(k, 2) for k in sorted(keys)]
    assert len(pages) == 4
    deletes = _count_calls(store, "DeleteObjects")
    assert store.delete_prefix("m/") == 8
    assert len(deletes) == 3
    assert store.list("m") == []


def test_s3_store_pickles_without_its_client(s3_store_uri: str) -> None:
    store = _s3(s3_store_uri)
    store.put_bytes("k", b"v")
    again = pickle.loads(pickle.dumps(store))
    assert again.get_bytes("k") == b"v" and again.uri == store.uri


# --- s3:// preflight: one clear line, within seconds ----------------------------------------


def _check_error(store: Store) -> str:
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        store.check()
    # The preflight's own client (2 attempts, short timeouts), not the data client's 8 attempts of up
    # to a minute each: a slow machine stays far inside this, a preflight on the data client not.
    assert time.monotonic() - started < S3_READ_TIMEOUT_S
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_s3_check_missing_bucket(s3_server: str) -> None:
    uri = f"s3://no-such-bucket-here/p?endpoint_url={s3_server}"
    assert _check_error(open_store(uri, field="cluster.store")) == (
        "cluster.store: cannot reach s3://no-such-bucket-here/p: bucket does not exist"
    )


def test_s3_check_unreachable_endpoint(aws_test_env: dict[str, str]) -> None:
    store = open_store("s3://bkt/p?endpoint_url=http://127.0.0.1:1", field="cluster.store")
    assert _check_error(store) == (
        "cluster.store: cannot reach s3://bkt/p: could not connect to endpoint http://127.0.0.1:1"
    )


def test_s3_check_credentials(s3_auth_server: S3AuthServer, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"s3://{s3_auth_server.bucket}/p?endpoint_url={s3_auth_server.endpoint}"
    where = f"cluster.store: cannot reach s3://{s3_auth_server.bucket}/p: "
    for name, value in s3_auth_server.env().items():
        monkeypatch.setenv(name, value)
    open_store(uri, field="cluster.store").check()  # the server accepts the right key

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNUNKNOWN00")
    message = _check_error(open_store(uri, field="cluster.store"))
    assert message.startswith(where + "InvalidAccessKeyId (The AWS Access Key Id you provided does not exist")

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_auth_server.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    message = _check_error(open_store(uri, field="cluster.store"))
    assert message.startswith(where + "SignatureDoesNotMatch (")
    assert "not-the-secret" not in message


def test_s3_check_without_credentials(s3_store_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    message = _check_error(open_store(s3_store_uri, field="cluster.store"))
    assert message.endswith(
        ": no AWS credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
        "AWS_PROFILE, or run with an instance role)"
    )


def test_s3_check_refuses_a_read_only_store(s3_auth_server: S3AuthServer, monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3

    iam = boto3.client(
        "iam",
        endpoint_url=s3_auth_server.endpoint,
        region_name="us-east-1",
        aws_access_key_id=s3_auth_server.access_key_id,
        aws_secret_access_key=s3_auth_server.secret_access_key,
    )
    iam.create_user(UserName="reader")
    iam.put_user_policy(
        UserName="reader",
        PolicyName="read",
        PolicyDocument=json.dumps(
            {
                "Version": "2012-10-17",
                "Statement": [
                    {"Effect": "Allow", "Action": ["s3:Get*", "s3:List*"], "Resource": "*"},
                ],
            }
        ),
    )
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    uri = f"s3://{s3_auth_server.bucket}/p?endpoint_url={s3_auth_server.endpoint}"
    message = _check_error(open_store(uri, field="cluster.store"))
    assert message.startswith(f"cluster.store: cannot write to s3://{s3_auth_server.bucket}/p: ")
    assert "AccessDenied" in message


# --- errors: only the store's own family, one line naming the store ---------------------------


def test_s3_unreachable_endpoint_is_store_unavailable_within_seconds(aws_test_env: dict[str, str]) -> None:
    store = open_store("s3://bkt/p?endpoint_url=http://127.0.0.1:1", field="cluster.store", interactive=True)
    for call in (
        lambda: store.get_bytes("runs/x/run.json"),
        lambda: store.list("runs/"),
        store.ping,
        lambda: store.put_bytes("runs/x/a", b"1"),
    ):
        with pytest.raises(StoreUnavailable) as err:
            call()
        assert str(err.value).startswith("store s3://bkt/p?endpoint_url=http://127.0.0.1:1: cannot ")
        assert str(err.value).endswith(": could not connect to endpoint http://127.0.0.1:1")


def test_s3_access_denied_is_a_store_error_not_an_outage(
    s3_auth_server: S3AuthServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = f"s3://{s3_auth_server.bucket}/p?endpoint_url={s3_auth_server.endpoint}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNUNKNOWN00")
    store = open_store(uri, interactive=True)
    with pytest.raises(StoreError) as err:
        store.get_bytes("runs/x/run.json")
    assert not isinstance(err.value, (StoreUnavailable, StoreKeyError))
    assert f"store {store.uri}: cannot read 'runs/x/run.json': InvalidAccessKeyId" in str(err.value)


def test_file_store_os_errors_are_store_errors(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    store.ensure()
    store.put_bytes("runs/x", b"a file where a directory would go")
    with pytest.raises(StoreError) as err:
        store.put_bytes("runs/x/run.json", b"{}")
    assert str(err.value).startswith(f"store {store.uri}: cannot write 'runs/x/run.json': ")
    with pytest.raises(StoreKeyError):
        store.get_bytes("runs/x/run.json")


def test_corrupt_run_records_and_metrics_are_one_line_store_errors(store: Store) -> None:
    store.put_bytes("runs/r/run.json", b"{not json")
    with pytest.raises(StoreError, match=r"runs/r/run.json is not valid JSON"):
        runstore.read_run_record(store, "r")
    store.put_bytes("runs/r/metrics/00000001-5.jsonl", b'{"step": 1}\n{trunc')
    store.put_bytes("runs/r/metrics/notes.txt", b"not a chunk: ignored")
    with pytest.raises(StoreError, match=r"runs/r/metrics/00000001-5.jsonl is not valid JSON"):
        runstore.read_metrics(store, "r")


def test_store_errors_pickle_with_their_fields() -> None:
    for err in (StoreUnavailable("s3://b", "down"), StoreKeyError("s3://b", "k"), StoreError("s3://b", "x")):
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is type(err) and again.message == err.message


def test_no_code_outside_the_store_package_names_a_backend() -> None:
    """Callers hold a ``Store``: a new backend is one new file in infractl/store/, no edit elsewhere."""
    backend = re.compile(r"\b(FileStore|S3Store)\b|\bstore\.(root|endpoint_url|bucket|prefix|client)\b")
    found = []
    for folder in ("infractl", "trainer", "bench"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if (REPO / "infractl" / "store") in path.parents:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if backend.search(line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert found == []


_TWIN_RUN = """\
name: {name}
model: {{layers: 1, hidden: 32, heads: 2, seq_len: 32}}
data: {{max_bytes: 1000000}}
batch_size: 4
steps: 4
checkpoint: {{every: 2, keep: 2}}
nodes: {{min: 1, max: 1}}
"""


@pytest.mark.cluster
def test_a_purge_deletes_only_its_own_runs_from_a_store_shared_with_a_cluster_of_the_same_name(tmp_path: Path) -> None:
    """Two clusters named ``twin`` (two state roots, as on two machines) train into one store; the
    purge of one leaves the other's run, and a run recorded before runs carried their cluster's id
    (which no purge can tell the owner of), and says so."""
    shared = (tmp_path / "shared-store").as_uri()
    twins = {side: Cli(tmp_path / side) for side in ("a", "b")}
    try:
        for side, cli in twins.items():
            cli.cwd.mkdir()
            config = write(cli.cwd / "cluster.yaml", f"name: twin\nprovider: local\nnodes: 1\nstore: {shared}\n")
            cli("up", "-c", str(config))
            cli("train", "-c", "twin", str(write(cli.cwd / "run.yaml", _TWIN_RUN.format(name=f"run-{side}"))))
        ids = {side: json.loads((cli.home / "twin" / "cluster.json").read_text())["id"] for side, cli in twins.items()}
        store = open_store(shared)
        assert ids["a"] != ids["b"]
        recorded = [runstore.read_run_record(store, f"run-{side}") for side in ids]
        assert [run.cluster_id if run else None for run in recorded] == list(ids.values())
        runstore.write_run_record(store, runstore.RunRecord(run_id="legacy", cluster="twin"))

        torn = twins["a"]("teardown", "-c", "twin", "--purge", "--yes")
        assert "kept run(s) legacy: recorded before runs named their cluster's id" in torn.stderr
        assert runstore.list_runs(store) == ["legacy", "run-b"]
        assert runstore.latest_committed_step(store, "run-b") == 4
        done = json.loads(twins["b"]("teardown", "-c", "twin", "--purge", "--yes", "--json").stdout)
        assert done["runs_purged"] == ["run-b"] and runstore.list_runs(store) == ["legacy"]
    finally:
        for cli in twins.values():
            if (cli.home / "twin").is_dir():
                cli("teardown", "-c", "twin", "--yes", expect=None)
