"""The one subprocess runner: start node processes detached, find them again, kill whole trees;
run a short command to its end.

Every process infractl starts carries marker variables in its environment (inherited by all of
its descendants, including torchrun workers that start new sessions and survive their agent's
process group). Finding a node's processes scans for the marker instead of trusting a PID tree
that breaks as soon as a parent dies.
"""

from __future__ import annotations

import grp
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import psutil

__all__ = [
    "AGENT_MODULE",
    "CLUSTER_ENV",
    "NODE_ENV",
    "RUN_ENV",
    "group_exists",
    "run",
    "spawn",
    "find",
    "running_runs",
    "kill",
    "wait_gone",
]

CLUSTER_ENV = "INFRACTL_CLUSTER_DIR"
NODE_ENV = "INFRACTL_NODE"
RUN_ENV = "INFRACTL_RUN"
#: The module a node's elastic agent runs (``python -m trainer.agent``): tells agents from workers.
AGENT_MODULE = "trainer.agent"


def run(argv: list[str], *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a short command on this machine to its end (``setfacl``, ``groupdel``): stdout and
    stderr captured as text, the exit code left to the caller. ``OSError`` when it cannot start,
    ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False)


def group_exists(name: str) -> bool:
    """Whether this machine has the Unix group ``name`` (the access roles' groups)."""
    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


def spawn(
    argv: list[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    log_path: Path,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own session with stdout and stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            argv,
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def find(cluster_dir: Path, *, node: str | None = None, run: str | None = None) -> list[psutil.Process]:
    """Live processes carrying this cluster's marker (optionally one node's or one run's)."""
    want = {CLUSTER_ENV: str(cluster_dir)}
    if node is not None:
        want[NODE_ENV] = node
    if run is not None:
        want[RUN_ENV] = run
    me = os.getpid()
    found = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
            if all(env.get(k) == v for k, v in want.items()) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def running_runs(cluster_dir: Path) -> dict[str, set[str]]:
    """run id -> names of the nodes that have live processes of it (processes that belong to no
    run, such as the cluster's rendezvous server, are left out)."""
    runs: dict[str, set[str]] = {}
    for p in find(cluster_dir):
        try:
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        run, node = env.get(RUN_ENV), env.get(NODE_ENV)
        if run and node:
            runs.setdefault(run, set()).add(node)
    return runs


def kill(procs: Iterable[psutil.Process], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to every process (already-gone processes are ignored)."""
    for proc in procs:
        try:
            proc.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


def wait_gone(
    cluster_dir: Path, *, timeout: float, node: str | None = None, run: str | None = None
) -> list[psutil.Process]:
    """Wait up to ``timeout`` seconds for the matching processes to exit; return those still alive."""
    deadline = time.monotonic() + timeout
    while True:
        alive = find(cluster_dir, node=node, run=run)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.2)
