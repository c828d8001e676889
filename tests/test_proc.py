"""The one kill primitive (``proc.kill_until_gone``) every kill path goes through: the control
plane's ``stop_all``, ``kill_all`` on this machine, each provider's ``kill_node`` and the node
side's ``python -m infractl.proc kill``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from infractl import proc


def test_kill_until_gone_lists_again_and_kills_what_a_killed_process_left() -> None:
    # A process forking as it was killed: its child appears in the second listing only.
    listings = iter([["parent"], ["parent", "child"], []])
    sent: list[list[str]] = []
    count, alive = proc.kill_until_gone(
        lambda: next(listings), lambda procs: sent.append(list(procs)), timeout=10, poll_s=0
    )
    assert (count, alive) == (2, [])
    assert sent == [["parent"], ["parent", "child"]]


def test_kill_until_gone_returns_the_survivors_at_its_deadline() -> None:
    started = time.monotonic()
    count, alive = proc.kill_until_gone(lambda: ["stuck"], lambda procs: None, timeout=0.3, poll_s=0.05)
    assert (count, alive) == (1, ["stuck"])
    assert 0.3 <= time.monotonic() - started < 5


def test_wait_until_gone_signals_nothing() -> None:
    listings = iter([["a"], ["a"], []])
    assert proc.wait_until_gone(lambda: next(listings), timeout=10, poll_s=0) == []
    assert proc.wait_until_gone(lambda: ["a"], timeout=0.1, poll_s=0.05) == ["a"]


@pytest.fixture
def marked_node(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """A node's process tree, like an agent's: a shell with a child in a session of its own."""
    env = {**os.environ, proc.CLUSTER_ENV: str(tmp_path), proc.NODE_ENV: "node-1", proc.RUN_ENV: "r"}
    tree = subprocess.Popen(["sh", "-c", "setsid sleep 600 & sleep 600"], env=env, start_new_session=True)
    deadline = time.monotonic() + 10
    while len(proc.find(tmp_path)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield tmp_path, tree
    proc.kill_all(tmp_path, timeout=10)
    tree.wait()


def test_the_node_side_kill_leaves_nothing_of_the_run(marked_node: tuple[Path, subprocess.Popen[bytes]]) -> None:
    cluster_dir, tree = marked_node
    assert len(proc.find(cluster_dir, node="node-1", run="r")) == 3
    argv = ["kill", "--cluster", str(cluster_dir), "--node", "node-1", "--run", "r"]
    done = subprocess.run([sys.executable, "-m", "infractl.proc", *argv], capture_output=True, check=False, timeout=30)
    assert done.returncode == 0, done.stderr
    tree.wait(timeout=10)
    assert proc.find(cluster_dir) == []
