"""An ``up`` killed at each of its phases (during the Terraform apply, once the rendezvous endpoint
runs, during Ansible, during the health gate), on local and on netns: ``teardown`` removes
everything it made (no process, node directory, namespace, interface, key file or group is
left). One Ctrl-C ends ``up`` with exit 130 and one line naming what finishes or undoes it, and
the next ``up`` picks up where it stopped. A ``teardown`` killed while it destroys the nodes is
run again and finishes."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from infractl import proc
from infractl.access import ROLE_NAMES, group_name
from infractl.statedir import ClusterState, ledger

from conftest import Cli, write

# Each kill leaves an `up` that never finished until the teardown right after it: `gc --yes`
# (tests/test_gc.py) would tear it down first. Both run on the worker of the other tests that do
# this (tests/test_aws_emulated.py).
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("aws-emulated")]

# How long a phase may take to begin (an apply on a busy machine included).
_PHASE_TIMEOUT_S = 300


def _phase_started(state_dir: Path, log: Path, phase: str) -> bool:
    """Whether ``up`` (its stderr in ``log``) has begun ``phase``."""
    said = log.read_text() if log.is_file() else ""
    if phase == "apply":
        return "terraform: applying" in said
    if phase == "rendezvous":
        return "rendezvous:" in said
    if phase == "ansible":
        return "ansible: configuring" in said
    # The health gate: Ansible reported the health role's first task.
    events = state_dir / "ansible" / "artifacts"
    for event in events.glob("*/job_events/*.json") if events.is_dir() else []:
        try:
            data = json.loads(event.read_text()).get("event_data", {})
        except (OSError, ValueError):
            continue  # being written
        if data.get("role") == "health":
            return True
    return False


def _up_until(cli: Cli, config: Path, phase: str, sig: int) -> subprocess.CompletedProcess[str]:
    """Start ``infractl up``, send ``sig`` once ``phase`` began, and wait for its end."""
    state_dir = cli.home / config.stem
    return _until(cli, ("up", "-c", str(config)), phase, lambda log: _phase_started(state_dir, log, phase), sig)


def _until(
    cli: Cli, args: tuple[str, ...], phase: str, began: Callable[[Path], bool], sig: int
) -> subprocess.CompletedProcess[str]:
    """Start ``infractl ARGS``, send ``sig`` once ``began(its stderr's file)``, and wait for its end."""
    log = cli.cwd / f"{args[0]}-{phase}.log"
    with log.open("w") as stderr:
        command = subprocess.Popen(
            [*cli.program, *args], cwd=cli.cwd, env=cli.env(), stdout=subprocess.PIPE, stderr=stderr, text=True
        )
        deadline = time.monotonic() + _PHASE_TIMEOUT_S
        while not began(log):
            assert command.poll() is None, f"{args[0]} ended before {phase}:\n{log.read_text()}"
            assert time.monotonic() < deadline, (
                f"{args[0]} never began {phase} within {_PHASE_TIMEOUT_S}s:\n{log.read_text()}"
            )
            time.sleep(0.1)
        command.send_signal(sig)
        stdout, _ = command.communicate(timeout=_PHASE_TIMEOUT_S)
    return subprocess.CompletedProcess(command.args, command.returncode, stdout, log.read_text())


def _nothing_left(state: ClusterState, provider: str) -> None:
    assert not state.dir.exists(), sorted(state.dir.iterdir())
    assert proc.find(state.dir) == []
    assert not (ledger() / f"{state.short_id}.json").exists()
    assert [name for name in ROLE_NAMES if proc.group_exists(group_name(state, name))] == []
    if provider == "netns":
        listed = subprocess.run(["ip", "-json", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert [n["name"] for n in json.loads(listed or "[]") if state.short_id in n["name"]] == []
        links = subprocess.run(["ip", "-json", "link"], capture_output=True, text=True, check=True).stdout
        assert [link["ifname"] for link in json.loads(links) if state.short_id in link["ifname"]] == []


@pytest.mark.parametrize("provider", ["local", "netns"])
def test_an_up_killed_at_any_phase_is_torn_down_and_an_interrupted_one_resumed(provider: str, tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    nodes = 2 if provider == "local" else 1  # a netns node is slower to make: one shows each phase
    config = write(tmp_path / "halted.yaml", f"name: halted\nprovider: {provider}\nnodes: {nodes}\n")
    state = ClusterState("halted", cli.home / "halted")
    for phase in ("apply", "rendezvous", "ansible", "health"):
        killed = _up_until(cli, config, phase, signal.SIGKILL)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        torn = cli("teardown", "-c", "halted", "--purge", "--yes")
        assert "its `up` never finished" in torn.stderr, torn.stderr
        _nothing_left(state, provider)

    # Ctrl-C while Ansible configures: what it started stops, one line says what to run next.
    interrupted = _up_until(cli, config, "ansible", signal.SIGINT)
    assert interrupted.returncode == 130, interrupted.stderr
    last = interrupted.stderr.strip().splitlines()[-1]
    assert last.startswith("error: interrupted: `infractl up -c halted` again picks up"), interrupted.stderr
    assert "`infractl teardown -c halted`" in last and "Traceback" not in interrupted.stderr
    assert proc.find(state.dir, node="ansible") == []
    # The next `up`, as the line says, picks up where it stopped; the cluster is then torn down as any other.
    assert "cluster 'halted' is up" in cli("up", "-c", "halted", timeout=900).stderr
    # A teardown killed while Terraform destroys the nodes is run again, and finishes the job.
    destroying = _until(
        cli, ("teardown", "-c", "halted", "--purge", "--yes"), "destroy",
        lambda log: "terraform: destroying" in (log.read_text() if log.is_file() else ""), signal.SIGKILL,
    )  # fmt: skip
    assert destroying.returncode == -signal.SIGKILL, destroying.stderr
    # Another process holds the Terraform state's lock (as a second terraform would) until the destroy
    # failed on it: teardown tries again, and finishes.
    log = cli.cwd / "teardown-locked.log"
    locked = _state_locked(state.terraform_dir / "terraform.tfstate", until=log, says="terraform: destroy failed")
    with locked, log.open("w") as stderr:
        again = subprocess.run(
            [*cli.program, "teardown", "-c", "halted", "--purge", "--yes"], cwd=cli.cwd, env=cli.env(),
            stdout=subprocess.DEVNULL, stderr=stderr, timeout=_PHASE_TIMEOUT_S,
        )  # fmt: skip
    said = log.read_text()
    assert again.returncode == 0 and "trying again in 5s" in said, said
    _nothing_left(state, provider)


@contextlib.contextmanager
def _state_locked(path: Path, *, until: Path, says: str) -> Iterator[None]:
    """A child process holds ``path``'s lock (the fcntl lock Terraform's local state takes) until
    the file ``until`` says ``says`` (within the phase timeout); waits for the child at the end."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(path), str(until), says, str(_PHASE_TIMEOUT_S)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    try:
        yield
    finally:
        assert holder.wait(timeout=_PHASE_TIMEOUT_S) == 0, f"nothing said {says!r}"


_HOLD_LOCK = """
import fcntl, pathlib, sys, time
state, until, says, timeout = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3], float(sys.argv[4])
deadline = time.monotonic() + timeout
with open(state, "r+") as held:
    fcntl.lockf(held, fcntl.LOCK_EX)
    print("locked", flush=True)
    while says not in (until.read_text() if until.is_file() else ""):
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.1)
"""
