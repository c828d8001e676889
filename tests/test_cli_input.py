"""Bad input gets one clear line naming the problem, exit code 2, no traceback, nothing changed."""

from __future__ import annotations

import fcntl
import json
import os

import pytest

from conftest import REPO, Cli, write


def test_help_lists_every_command_with_one_line_help(cli: Cli) -> None:
    result = cli("--help")
    commands = (
        "up train status logs metrics teardown plan bench profile export sample bundle schema reference data drill"
    )
    commands += " access"
    for command in commands.split():
        assert f" {command} " in result.stdout, result.stdout


def test_unknown_run_field_names_field_and_file(cli: Cli) -> None:
    run = write(cli.cwd / "run.yaml", "name: r\nmodel: {layers: 2, hiden: 64}\n")
    result = cli("train", str(run), expect=2)
    assert "run.yaml: model.hiden: unknown field" in result.stderr
    assert not cli.home.exists()


def test_mistyped_run_field_names_field_and_file(cli: Cli) -> None:
    run = write(cli.cwd / "run.yaml", "name: r\nsteps: lots\n")
    result = cli("train", str(run), expect=2)
    assert "run.yaml: steps:" in result.stderr
    assert "integer" in result.stderr


def test_unknown_parallel_scheme_lists_the_allowed_ones(cli: Cli) -> None:
    run = write(cli.cwd / "run.yaml", "name: r\nparallel: zero3\n")
    result = cli("train", str(run), expect=2)
    assert "run.yaml: parallel: must be one of ddp, zero1, fsdp or a mapping of dp, dp_shard, tp, pp" in result.stderr
    run = write(cli.cwd / "run.yaml", "name: r\nparallel: 3\n")
    result = cli("train", str(run), expect=2)
    assert "run.yaml: parallel: must be one of ddp, zero1, fsdp or a mapping of dp, dp_shard, tp, pp" in result.stderr
    assert "(got 3)" in result.stderr


def test_missing_run_file(cli: Cli) -> None:
    result = cli("train", "nope.yaml", expect=2)
    assert "run file not found: nope.yaml" in result.stderr


def test_unknown_cluster_field_names_field_and_file(cli: Cli) -> None:
    cluster = write(cli.cwd / "cluster.yaml", "name: c1\nnodes: 2\nprocs: 4\n")
    result = cli("up", "-c", str(cluster), expect=2)
    assert "cluster.yaml: procs: unknown field" in result.stderr
    assert not (cli.home / "c1").exists()


@pytest.mark.parametrize(
    "body",
    [
        "provider: {}",
        "provider: [local]",
        "provider: aws\naws: {node_groups: [1]}",
        "provider: aws\naws: {node_groups: {g: {instance_type: [x]}}}",
    ],
)
def test_a_provider_or_node_group_of_the_wrong_shape_names_the_field(cli: Cli, body: str) -> None:
    cluster = write(cli.cwd / "cluster.yaml", f"name: c1\nnodes: 2\n{body}\n")
    result = cli("up", "-c", str(cluster), expect=2)
    assert result.stderr.startswith(f"error: {cluster}: ") and "internal error" not in result.stderr
    assert ("provider:" if "{}" in body or "[local]" in body else "aws.") in result.stderr
    assert not (cli.home / "c1").exists()


@pytest.mark.parametrize("provider", ["local", "netns"])
@pytest.mark.parametrize(
    ("image", "message"),
    [
        ("registry.example/trainer:latest", "is not pinned by digest: write REPOSITORY@sha256:<64 hex>"),
        ("trainer:1@sha256:" + "a" * 64, "is not REPOSITORY@sha256:<64 lower-case hex> (no tag before the digest)"),
        ("trainer@sha256:" + "A" * 64, "is not REPOSITORY@sha256:<64 lower-case hex>"),
    ],
)
def test_an_image_not_pinned_by_digest_is_refused_on_every_provider(
    cli: Cli, provider: str, image: str, message: str
) -> None:
    cluster = write(cli.cwd / "cluster.yaml", f"name: c1\nprovider: {provider}\nruntime: {{image: '{image}'}}\n")
    result = cli("up", "-c", str(cluster), expect=2)
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: {cluster}: runtime.image: {image!r} {message}"), result.stderr
    assert not (cli.home / "c1").exists()


def test_missing_cluster_file(cli: Cli) -> None:
    result = cli("up", "-c", "missing.yaml", expect=2)
    assert "cluster file not found: missing.yaml" in result.stderr


def test_bad_store_uri_is_refused_before_anything_changes(cli: Cli) -> None:
    cluster = write(cli.cwd / "cluster.yaml", "name: c2\nstore: ftp://somewhere/x\n")
    result = cli("up", "-c", str(cluster), expect=2)
    assert "cluster.store: unsupported store URI 'ftp://somewhere/x'" in result.stderr
    assert not (cli.home / "c2" / "terraform").exists()


def test_train_before_up(cli: Cli) -> None:
    result = cli("train", str(REPO / "examples" / "quickstart.yaml"), expect=2)
    assert "cluster 'local' is not up" in result.stderr
    assert "infractl up" in result.stderr


def test_teardown_of_a_cluster_already_down_succeeds(cli: Cli) -> None:
    """A teardown retried (by automation, after one that was killed once it had removed
    everything) finds nothing to do: that is exit 0, whichever way the cluster is named."""
    result = cli("teardown", "--yes")
    assert "nothing to tear down: cluster 'local' is not up" in result.stderr
    by_name = json.loads(cli("teardown", "-c", "gone", "--purge", "--yes", "--json").stdout)
    assert by_name == {
        "cluster": "gone",
        "processes_killed": 0,
        "nodes_removed": 0,
        "runs_purged": [],
        "already_down": True,
    }
    config = write(cli.cwd / "cluster.yaml", "name: c4\nprovider: local\n")
    assert "nothing to tear down: cluster 'c4' is not up" in cli("teardown", "-c", str(config), "--yes").stderr
    assert not cli.home.exists()


def test_teardown_of_a_cluster_file_that_does_not_exist_is_refused(cli: Cli) -> None:
    result = cli("teardown", "-c", "missing.yaml", "--yes", expect=2)
    assert "cluster file not found: missing.yaml" in result.stderr


def test_up_while_another_command_holds_the_lock(cli: Cli) -> None:
    cluster_dir = cli.home / "local"
    cluster_dir.mkdir(parents=True)
    fd = os.open(cluster_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"`infractl up` (pid 4242)")
        result = cli("up", expect=2)
    finally:
        os.close(fd)
    assert "cluster 'local' is busy: `infractl up` (pid 4242) holds its lock" in result.stderr
    assert sorted(p.name for p in cluster_dir.iterdir()) == ["lock"]


def test_unknown_command_is_a_usage_error(cli: Cli) -> None:
    result = cli("launch", expect=2)
    assert "No such command 'launch'" in result.stderr


def test_unreachable_s3_store_is_refused_before_anything_changes(cli: Cli, aws_test_env: dict[str, str]) -> None:
    cluster = write(cli.cwd / "cluster.yaml", "name: c3\nstore: s3://bucket/runs?endpoint_url=http://127.0.0.1:1\n")
    result = cli("up", "-c", str(cluster), expect=2)
    assert "cluster.store: cannot reach s3://bucket/runs" in result.stderr
    assert "could not connect to endpoint http://127.0.0.1:1" in result.stderr
    assert not (cli.home / "c3" / "terraform").exists()


def test_missing_s3_bucket_is_refused(cli: Cli, s3_server: str) -> None:
    cluster = write(cli.cwd / "cluster.yaml", f"name: c4\nstore: s3://no-such-bucket/x?endpoint_url={s3_server}\n")
    result = cli("up", "-c", str(cluster), expect=2)
    assert "cluster.store: cannot reach s3://no-such-bucket/x" in result.stderr
    assert "bucket does not exist" in result.stderr
    assert not (cli.home / "c4" / "terraform").exists()


def test_s3_store_without_credentials_is_refused(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    cluster = write(cli.cwd / "cluster.yaml", "name: c5\nstore: s3://bucket/runs?endpoint_url=http://127.0.0.1:1\n")
    result = cli("up", "-c", str(cluster), expect=2)
    assert "cluster.store: cannot reach s3://bucket/runs: no AWS credentials found" in result.stderr
