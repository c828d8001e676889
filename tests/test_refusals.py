"""Refusals are one safe line, exit 2, and change nothing; `--json` refusals are one JSON object.

Regression tests for inputs that once broke the contract (each named below), the output's
markup safety, and `status` with nothing up. The generated-input version of these checks is
tests/test_properties.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import Cli, one_line, run_cli, write

# --- the four inputs of the bug report ----------------------------------------------------------


def test_store_uri_with_markup_like_text_is_one_line_and_creates_nothing(cli: Cli) -> None:
    # The message holds `s3://BUCKET[/PREFIX]`: printed as markup, `[/PREFIX]` crashed the printer.
    cluster = write(cli.cwd / "cluster.yaml", "name: c1\nstore: 's3://'\n")
    line = one_line(cli("up", "-c", str(cluster), expect=2).stderr)
    assert "cluster.store: 's3://' does not name a valid bucket (s3://BUCKET[/PREFIX];" in line
    assert not cli.home.exists()


def test_deeply_nested_run_yaml_is_refused_inone_line(cli: Cli) -> None:
    run = write(cli.cwd / "run.yaml", "name: r\nmodel: " + "[" * 5000 + "]" * 5000 + "\n")
    line = one_line(cli("train", str(run), expect=2).stderr)
    assert "run.yaml: line 2: not valid YAML" in line


def test_nesting_beyond_the_limit_is_refused_with_the_limit(cli: Cli) -> None:
    run = write(cli.cwd / "run.yaml", "name: r\nmodel: " + "[" * 40 + "]" * 40 + "\n")
    line = one_line(cli("train", str(run), expect=2).stderr)
    assert "run.yaml: line 2: nested deeper than 32 levels" in line


def test_huge_run_yaml_is_refused_by_its_size_before_parsing(cli: Cli) -> None:
    run = cli.cwd / "run.yaml"
    with run.open("w") as f:
        f.write("name: r\n#")
        f.write("x" * 50_000_000)
    line = one_line(cli("train", str(run), expect=2).stderr)
    assert "run.yaml: 50,000,009 bytes; a config file may have at most 1,048,576 (1 MiB)" in line


def test_refused_up_leaves_no_state_directory_or_lock(cli: Cli) -> None:
    cluster = write(cli.cwd / "cluster.yaml", "name: c2\nstore: ftp://somewhere/x\n")
    line = one_line(cli("up", "-c", str(cluster), expect=2).stderr)
    assert "cluster.store: unsupported store URI 'ftp://somewhere/x'" in line
    assert not cli.home.exists()


def test_store_that_cannot_be_created_is_refused_before_anything_changes(cli: Cli) -> None:
    blocker = write(cli.cwd / "a-file", "not a directory\n")
    cluster = write(cli.cwd / "cluster.yaml", f"name: c3\nstore: {(blocker / 'store').as_uri()}\n")
    line = one_line(cli("up", "-c", str(cluster), expect=2).stderr)
    assert f"cluster.store: cannot create {(blocker / 'store').as_uri()}: {blocker} is not a directory" in line
    assert not cli.home.exists()


def test_refusal_inside_the_lock_removes_the_cluster_directory_the_lock_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from infractl.errors import ConfigError
    from infractl.statedir import ClusterState

    state = ClusterState("c4", tmp_path / ".infractl" / "c4")
    with pytest.raises(ConfigError), state.lock("up"):
        assert (state.dir / "lock").read_text() == f"`infractl up` (pid {os.getpid()})"
        raise ConfigError("refused")
    assert not (tmp_path / ".infractl").exists()
    state.dir.mkdir(parents=True)
    with pytest.raises(ConfigError), state.lock("up"):
        raise ConfigError("refused")
    assert [p.name for p in state.dir.iterdir()] == ["lock"] and (state.dir / "lock").read_bytes() == b""


def test_an_up_that_cannot_list_its_cluster_in_the_ledger_is_refused_before_it_makes_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from infractl import statedir as state_module
    from infractl.config import parse_cluster
    from infractl.errors import StateError
    from infractl.statedir import ClusterIntent, ClusterState

    blocker = write(tmp_path / "a-file", "not a directory\n")
    monkeypatch.setattr(state_module, "ledger", lambda: blocker / "clusters")
    state = ClusterState("c5", tmp_path / ".infractl" / "c5")
    with pytest.raises(StateError) as refused, state.lock("up"):
        state.start(ClusterIntent(name="c5", spec=parse_cluster({"name": "c5"}), store=state.default_store.as_uri()))
    assert f"cannot list the cluster in {blocker / 'clusters'} (Not a directory)" in str(refused.value)
    assert not (tmp_path / ".infractl").exists()


# --- more of the same class -------------------------------------------------------------------


def test_alias_expansion_bomb_is_refused(cli: Cli) -> None:
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcde", "bcdef", strict=True):
        lines.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]")
    run = write(cli.cwd / "run.yaml", "\n".join(lines) + "\n")
    line = one_line(cli("train", str(run), expect=2).stderr)
    assert "run.yaml: expands to more than 100,000 values (aliases included)" in line


def test_control_characters_and_non_utf8_are_refused_visibly(cli: Cli) -> None:
    run = write(cli.cwd / "run.yaml", 'name: r\ndata: {source: prepared, path: "/tmp/a\\x1b[31mb"}\n')
    line = one_line(cli("train", str(run), expect=2).stderr)
    assert "run.yaml: data.path: must not contain control characters" in line
    assert "\x1b" not in line

    raw = cli.cwd / "latin1.yaml"
    raw.write_bytes(b"name: r\nseed: 1 # caf\xe9\n")
    line = one_line(cli("train", str(raw), expect=2).stderr)
    assert "latin1.yaml: not UTF-8 text (invalid byte at offset 21)" in line


def test_numbers_out_of_any_useful_range_are_refused_before_launch(cli: Cli) -> None:
    for field, value, message in (
        ("steps", "1000000000000", "steps: Input should be less than or equal to 1000000000"),
        ("seed", "99999999999999999999", "seed: Input should be less than 9223372036854775808"),
        ("lr", ".inf", "lr: Input should be a finite number"),
    ):
        run = write(cli.cwd / "run.yaml", f"name: r\n{field}: {value}\n")
        assert message in one_line(cli("train", str(run), expect=2).stderr)


def test_printed_values_are_never_markup(cli: Cli) -> None:
    line = one_line(cli("train", "[bold]run[/bold]:smile:.yaml", expect=2).stderr)
    assert line == "error: run file not found: [bold]run[/bold]:smile:.yaml"


def test_run_names_on_the_command_line_cannot_reach_outside_the_store(cli: Cli) -> None:
    line = one_line(cli("metrics", "../../etc", expect=2).stderr)
    assert "Invalid value for 'RUN': expected a name" in line


def test_command_line_errors_are_one_line_with_where_help_is(cli: Cli) -> None:
    line = one_line(cli("logs", "--tail", "many", expect=2).stderr)
    assert line.startswith("error: Invalid value for '--tail'") and line.endswith("(see `infractl logs --help`)")
    line = one_line(cli("status", "--frobnicate", expect=2).stderr)
    assert line == "error: No such option: --frobnicate (see `infractl status --help`)"
    # Found by the property tests: a huge --tail overflowed the line buffer (a traceback).
    line = one_line(cli("logs", "--tail", "1" + "0" * 30, expect=2).stderr)
    assert "Invalid value for '--tail': Input should be less than or equal to 1000000000" in line
    line = one_line(cli("drill", "store-outage", "--seconds", "inf", expect=2).stderr)
    assert "Invalid value for '--seconds'" in line
    # Found by the property tests: a source name the OS refuses (too long) was a traceback.
    line = one_line(cli("data", "prepare", "a" * 3000, "--out", "ds", expect=2).stderr)
    assert line.startswith("error: SRC: cannot use aaaa") and line.endswith(": File name too long")


def test_json_refusals_print_one_error_object_on_stdout(cli: Cli) -> None:
    run = write(cli.cwd / "run.yaml", "name: r\nmodel: {hiden: 64}\n")
    result = cli("train", str(run), "--json", expect=2)
    assert json.loads(result.stdout) == {
        "error": {
            "message": f"{run}: model.hiden: unknown field",
            "exit_code": 2,
            "field": "model.hiden",
            "file": str(run),
        }
    }
    one_line(result.stderr)

    result = cli("status", "--json", "--frobnicate", expect=2)
    assert json.loads(result.stdout)["error"]["field"] == "--frobnicate"


# --- status with nothing up ---------------------------------------------------------------------


def test_status_with_nothing_up_lists_known_clusters(cli: Cli) -> None:
    result = cli("status")
    assert result.stdout.strip() == "no cluster is up" and result.stderr == ""
    assert json.loads(cli("status", "--json").stdout) == {"clusters": []}

    # A cluster torn down keeps its store: it is known here, and down.
    (cli.home / "old" / "store").mkdir(parents=True)
    result = cli("status")
    assert "no cluster is up" in result.stdout
    assert "old" in result.stdout and "down" in result.stdout
    assert json.loads(cli("status", "--json").stdout) == {
        "clusters": [{"name": "old", "up": False, "provider": None, "nodes": None}]
    }


def test_status_of_a_named_cluster_that_is_not_up_is_refused(cli: Cli) -> None:
    cluster = write(cli.cwd / "cluster.yaml", "name: c5\n")
    line = one_line(cli("status", "-c", str(cluster), expect=2).stderr)
    assert "cluster 'c5' is not up" in line
    assert not Path(cli.home / "c5").exists()


def test_a_bug_is_one_line_exit_70_and_debug_shows_the_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import infractl.cli.cluster

    def broken() -> list[object]:
        raise RuntimeError("boom")

    monkeypatch.setattr(infractl.cli.cluster, "known_clusters", broken)
    outcome = run_cli(["status", "--json"], home=tmp_path / ".infractl", cwd=tmp_path)
    assert outcome.code == 70
    assert outcome.stderr == (
        "error: internal error: RuntimeError: boom (a bug in infractl; rerun with --debug for the "
        "traceback and report it)\n"
    )
    assert json.loads(outcome.stdout)["error"]["exit_code"] == 70
    with pytest.raises(RuntimeError, match="boom"):
        run_cli(["--debug", "status"], home=tmp_path / ".infractl", cwd=tmp_path)
