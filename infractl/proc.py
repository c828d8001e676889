"""The one subprocess runner: start node processes detached, find them again, kill whole trees;
run a short command to its end. Everything here acts on *this* machine.

Every process infractl starts carries marker variables in its environment (inherited by all of
its descendants, including torchrun workers that start new sessions and survive their agent's
process group). Finding a node's processes scans for the marker instead of trusting a PID tree
that breaks as soon as a parent dies.

A node that is another machine runs the same code there for the control plane (the providers'
node control, over SSH): ``python -m infractl.proc list|signal|monitor`` prints what it found as
JSON, one ``NodeProcess`` per process, so the control plane sees every node the same way.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import psutil

from infractl.errors import InfractlError

__all__ = [
    "AGENT_MODULE",
    "CLUSTER_ENV",
    "LAUNCH_LAST_CALL_KEY",
    "NODE_ENV",
    "RUN_ENV",
    "NodeProcess",
    "group_exists",
    "run",
    "last_line",
    "remove_tree",
    "spawn",
    "find",
    "kill",
    "processes",
    "KILL_NODE_S",
    "kill_until_gone",
    "wait_until_gone",
    "kill_all",
    "wait_gone",
    "listing",
    "marked",
    "signal_listed",
    "monitor",
    "main",
]

CLUSTER_ENV = "INFRACTL_CLUSTER_DIR"
NODE_ENV = "INFRACTL_NODE"
RUN_ENV = "INFRACTL_RUN"
#: The module a node's elastic agent runs (``python -m trainer.agent``): tells agents from workers.
AGENT_MODULE = "trainer.agent"
#: The image reference (pinned by digest) a containerized agent and its workers run in, as the
#: launcher told the node's engine to run it (``--pull=never``: what ``up`` pulled and verified);
#: the checkpoints' environment fingerprint records it. Unset on a node's own Python.
IMAGE_ENV = "INFRACTL_IMAGE"
#: The agent's ``--rdzv-conf`` key of the seconds a launch's first rendezvous round waits for its
#: nodes (``trainer.rendezvous_patch``; torch ignores the key).
LAUNCH_LAST_CALL_KEY = "launch_last_call"


def run(argv: list[str], *, timeout: float = 120, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run a short command on this machine to its end (``setfacl``, ``groupdel``, ``ssh``): stdout
    and stderr captured as text, ``input`` on its stdin (else nothing), the exit code left to the
    caller. ``OSError`` when it cannot start, ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        errors="replace",  # a log's tail, say, may cut a character in two
        timeout=timeout,
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
        check=False,
    )


def last_line(stderr: str) -> str:
    """What a failed command said last: its reason, for the one-line error that names it."""
    return (stderr.strip().splitlines() or ["no output"])[-1]


def remove_tree(path: Path) -> None:
    """Unmount what is still mounted below ``path`` (deepest first: an image store's overlay, a
    container's run root), then remove it; ``InfractlError`` when something of it stays."""
    with open("/proc/self/mountinfo") as mounts:
        points = [line.split()[4] for line in mounts]
    for point in sorted((p for p in points if p.startswith(f"{path}/")), reverse=True):
        run(["umount", "-l", point])
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        raise InfractlError(f"cannot remove {path}")


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
    want = {key: value for key, value in ((NODE_ENV, node), (RUN_ENV, run)) if value is not None}
    found = []
    for marked_dir, proc in marked():
        if str(marked_dir) != str(cluster_dir):
            continue
        try:
            if all(proc.environ().get(k) == v for k, v in want.items()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def marked() -> list[tuple[Path, psutil.Process]]:
    """Every live process on this machine that carries a cluster's marker, with its cluster's
    state directory."""
    me = os.getpid()
    found = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            cluster_dir = proc.environ().get(CLUSTER_ENV)
            if cluster_dir is not None and proc.status() != psutil.STATUS_ZOMBIE:
                found.append((Path(cluster_dir), proc))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill(procs: Iterable[psutil.Process], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to every process (already-gone processes are ignored)."""
    for proc in procs:
        try:
            proc.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


def processes(pids: Iterable[int]) -> list[psutil.Process]:
    """The processes of ``pids`` that still run on this machine."""
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return found


#: How long killing a node (``kill_node`` of every provider, ``python -m infractl.proc kill`` on the
#: node itself) lists and kills again while something of it is left.
KILL_NODE_S = 5.0
# How often the loops below list again by default.
_POLL_S = 0.2

_P = TypeVar("_P")


def _itself(item: object) -> object:
    return item


def kill_until_gone(
    listing: Callable[[], Sequence[_P]],
    send_kill: Callable[[Sequence[_P]], None],
    *,
    timeout: float,
    key: Callable[[_P], object] = _itself,
    poll_s: float = _POLL_S,
) -> tuple[int, list[_P]]:
    """The one way infractl kills processes, wherever they are: ``send_kill`` (SIGKILL) what
    ``listing`` returns, list again, and so on until the listing is empty or ``timeout`` seconds
    passed. One signal is not enough: a process that was forking when it was killed leaves a child
    that no earlier listing held (Ansible's workers start a shell per task, torchrun's agent its
    workers). Return how many processes were signalled (told apart by ``key``) and those still
    alive at the deadline."""
    signalled: set[object] = set()

    def kill_listed(alive: Sequence[_P]) -> None:
        send_kill(alive)
        signalled.update(key(p) for p in alive)

    alive = _until_gone(listing, act=kill_listed, timeout=timeout, poll_s=poll_s)
    return len(signalled), alive


def wait_until_gone(listing: Callable[[], Sequence[_P]], *, timeout: float, poll_s: float = _POLL_S) -> list[_P]:
    """Wait up to ``timeout`` seconds for ``listing`` to come back empty; return what it held last."""
    return _until_gone(listing, act=None, timeout=timeout, poll_s=poll_s)


def _until_gone(
    listing: Callable[[], Sequence[_P]],
    *,
    act: Callable[[Sequence[_P]], None] | None,
    timeout: float,
    poll_s: float,
) -> list[_P]:
    deadline = time.monotonic() + timeout
    while True:
        alive = listing()
        if not alive or time.monotonic() >= deadline:
            return list(alive)
        if act is not None:
            act(alive)
        time.sleep(poll_s)


def kill_all(
    cluster_dir: Path, *, timeout: float, node: str | None = None, run: str | None = None
) -> tuple[int, list[psutil.Process]]:
    """``kill_until_gone`` for the cluster's processes on this machine (one node's, one run's)."""
    return kill_until_gone(lambda: find(cluster_dir, node=node, run=run), kill, timeout=timeout)


def wait_gone(
    cluster_dir: Path, *, timeout: float, node: str | None = None, run: str | None = None
) -> list[psutil.Process]:
    """``wait_until_gone`` for the cluster's processes on this machine (one node's, one run's)."""
    return wait_until_gone(lambda: find(cluster_dir, node=node, run=run), timeout=timeout)


# -- what a node reports to the control plane ---------------------------------------------------


@dataclass(frozen=True)
class NodeProcess:
    """A process of a cluster on one of its nodes, as the node reports it."""

    node: str
    pid: int
    started: float
    """Its start time (``psutil``'s create_time): a pid the kernel gave to another process since is
    never signalled in its place."""
    run: str | None
    agent: bool
    """The node's torchrun agent (``trainer.agent``)."""
    cpu_s: float = 0.0
    """User and system CPU seconds it had used when it was listed."""
    helper: bool = False
    """A process the agent started for itself (``_agent_helper``): neither the agent nor a worker."""

    @property
    def worker(self) -> bool:
        """A training worker, or a process a worker started: it lives one attempt of the run."""
        return not (self.agent or self.helper)

    @property
    def key(self) -> tuple[str, int, float]:
        """What names the process whenever it is listed (its CPU time changes)."""
        return self.node, self.pid, self.started


def _describe(process: psutil.Process) -> NodeProcess | None:
    """``process`` as its node reports it; None when it is gone or carries no node marker."""
    try:
        env = process.environ()
        node = env.get(NODE_ENV)
        if node is None:
            return None
        times = process.cpu_times()
        cmdline = process.cmdline()
        return NodeProcess(
            node=node,
            pid=process.pid,
            started=process.create_time(),
            run=env.get(RUN_ENV),
            agent=AGENT_MODULE in cmdline,
            cpu_s=times.user + times.system,
            helper=_agent_helper(process, cmdline),
        )
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _agent_helper(process: psutil.Process, cmdline: list[str]) -> bool:
    """Whether ``process`` (command line ``cmdline``) is a multiprocessing helper a node's agent
    started for itself: the fork server its warm workers are forked from, and the resource tracker.
    A worker is the agent's child (a new Python) or the fork server's (warm). Only a process whose
    command line names multiprocessing costs a look at its parent."""
    if not any("multiprocessing." in part for part in cmdline):
        return False
    parent = process.parent()
    return parent is not None and AGENT_MODULE in parent.cmdline()


def listing(cluster_dir: Path, *, node: str | None = None, run: str | None = None) -> list[NodeProcess]:
    """The live processes of the cluster (one node's, one run's) on this machine, by pid."""
    found = (_describe(p) for p in find(cluster_dir, node=node, run=run))
    return sorted((p for p in found if p is not None), key=lambda p: p.pid)


def signal_listed(procs: Iterable[NodeProcess], sig: int) -> None:
    """Send ``sig`` to each listed process that still runs on this machine (never to another that
    took its pid since)."""
    for listed in procs:
        try:
            process = psutil.Process(listed.pid)
            if process.create_time() == listed.started:
                process.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue


# A full scan reads every process's environment; the processes already found are only checked
# for life, often, so an exit is seen within _CHECK_S.
_SCAN_S = 0.5
_CHECK_S = 0.05
# A monitor says it is still there this often even when nothing changes.
_HEARTBEAT_S = 2.0


def monitor(
    cluster_dir: Path,
    *,
    run: str,
    node: str | None,
    emit: Callable[[list[NodeProcess] | None], None],
    stop: threading.Event,
) -> None:
    """Until ``stop``: report the run's processes on this machine (one node's, or all of them)
    through ``emit`` each time the set changes (by ``NodeProcess.key``), and ``emit(None)`` as a
    heartbeat when nothing changed for a while. What a drill watches a run by."""
    known: dict[tuple[str, int, float], tuple[psutil.Process, NodeProcess]] = {}
    last: list[tuple[str, int, float]] | None = None
    next_scan = next_beat = 0.0
    while not stop.is_set():
        now = time.monotonic()
        if now >= next_scan:
            known = {}
            for process in find(cluster_dir, node=node, run=run):
                described = _describe(process)
                if described is not None:
                    known[described.key] = (process, described)
            next_scan = now + _SCAN_S
        else:
            known = {key: entry for key, entry in known.items() if _alive(entry[0])}
        keys = sorted(known)
        if keys != last:
            emit([known[key][1] for key in keys])
            last, next_beat = keys, now + _HEARTBEAT_S
        elif now >= next_beat:
            emit(None)
            next_beat = now + _HEARTBEAT_S
        stop.wait(_CHECK_S)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def _print_json(value: object) -> None:
    print(json.dumps(value, separators=(",", ":")), flush=True)


def _listed(text: str) -> NodeProcess:
    """``NODE:PID:STARTED`` (a process as the control plane names it on the command line)."""
    node, pid, started = text.rsplit(":", 2)
    return NodeProcess(node=node, pid=int(pid), started=float(started), run=None, agent=False)


def main(argv: Sequence[str] | None = None) -> int:
    """The node side of the control plane's node control (see the module docstring):

    - ``list --cluster DIR [--node N] [--run R]``: the processes, a JSON list of ``NodeProcess``;
    - ``signal --sig N NODE:PID:STARTED...``: signal those that still run;
    - ``kill --cluster DIR --node N --run R``: SIGKILL the run's processes on the node until none
      is left (for up to ``KILL_NODE_S``), as every provider kills a node;
    - ``monitor --cluster DIR --run R [--node N]``: a JSON line for every change of the run's
      processes (a list) and ``null`` heartbeats, until its stdin closes.
    """
    import argparse  # imported here: every CLI command imports this module, only the node side parses with it

    parser = argparse.ArgumentParser(prog="python -m infractl.proc", description="A node's processes, as JSON.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("list", "monitor", "kill"):
        command = commands.add_parser(name)
        command.add_argument("--cluster", type=Path, required=True, help="the cluster's marker (its state dir)")
        command.add_argument("--node", required=name == "kill")
        command.add_argument("--run", required=name != "list")
    signalling = commands.add_parser("signal")
    signalling.add_argument("--sig", type=int, required=True)
    signalling.add_argument("procs", nargs="*", type=_listed)
    args = parser.parse_args(argv)
    if args.command == "list":
        _print_json([asdict(p) for p in listing(args.cluster, node=args.node, run=args.run)])
    elif args.command == "signal":
        signal_listed(args.procs, args.sig)
    elif args.command == "kill":
        kill_all(args.cluster, node=args.node, run=args.run, timeout=KILL_NODE_S)
    else:
        _monitor_until_stdin_closes(args.cluster, run=args.run, node=args.node)
    return 0


def _monitor_until_stdin_closes(cluster_dir: Path, *, run: str, node: str | None) -> None:
    stop = threading.Event()

    def wait_for_eof() -> None:
        # The control plane ends a monitor by closing its stdin (the SSH session ending does).
        sys.stdin.read()
        stop.set()

    def emit(procs: list[NodeProcess] | None) -> None:
        _print_json(None if procs is None else [asdict(p) for p in procs])

    threading.Thread(target=wait_for_eof, daemon=True).start()
    try:
        monitor(cluster_dir, run=run, node=node, emit=emit, stop=stop)
    except BrokenPipeError:
        pass  # the control plane went away without closing stdin


if __name__ == "__main__":
    sys.exit(main())
