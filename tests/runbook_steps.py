"""The steps of a runbook test, on any cluster (tests/test_runbooks.py on local, tests/test_netns.py
on netns): start a detached run, check that the symptoms the runbook names showed, run the
runbook's ``bash`` blocks as written, and check where the run went on from."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml
from markdown_it import MarkdownIt

from infractl import runstore
from infractl.store import FileStore

from conftest import Cli, wait_for_commit, write

#: What a hung rank shows on every cluster (runbooks/hung-job.md): the peers' collectives time
#: out, the hung node's agent kills the worker it cannot stop politely.
HUNG_JOB_LOGS = (
    "stopped reason=crashed",
    "Timed out waiting",
    "killing worker",
    "it is stopped and cannot answer SIGTERM",
)

#: How long the hung-job tests wait for those lines: a loaded machine restarts the peers slowly.
HUNG_JOB_WITHIN_S = 90


def hung_job_run(run_yaml: str) -> str:
    """``run_yaml`` with a 20 s step deadline. The stopped rank's own deadline (its agent's file
    timer, which takes the agent down with it: a node lost) must pass well after its peers'
    collectives time out (at most half the deadline) and their restart reaches its agent, which
    kills it as the runbook says; 8 s left too little of that margin on a loaded machine."""
    run = yaml.safe_load(run_yaml)
    run["watchdog"]["step_timeout_s"] = 20
    return yaml.safe_dump(run, sort_keys=False)


def bash_blocks(markdown: str) -> list[str]:
    """The runbook's fenced ``bash`` blocks, in order, as a Markdown parser reads them."""
    return [t.content for t in MarkdownIt().parse(markdown) if t.type == "fence" and t.info.strip() == "bash"]


def symptoms_section(markdown: str) -> str:
    """The text of the runbook's "Symptoms and where they show" section (up to the next heading)."""
    tokens = MarkdownIt().parse(markdown)
    starts = [
        i for i, t in enumerate(tokens) if t.type == "heading_open" and tokens[i + 1].content.startswith("Symptoms")
    ]
    assert len(starts) == 1, "a runbook has one Symptoms section"
    section = []
    for token in tokens[starts[0] + 3 :]:
        if token.type == "heading_open":
            break
        section.append(token.content)
    return "\n".join(section)


def assert_symptoms(
    cli: Cli,
    runbook: Path,
    run: str,
    *,
    cluster: str = "local",
    logs: Sequence[str] = (),
    status: Mapping[str, object] | None = None,
    within_s: float = 0.0,
) -> None:
    """What the runbook tells the on-call engineer to look for, seen on the cluster before its
    blocks run. Each of ``logs`` (an event and the fields the runbook quotes with it) is named in
    the runbook's Symptoms section and is in the run's node logs. Each of ``status`` (a field of
    ``infractl status --json``: ``runs[].F`` the run's row, ``nodes[NODE].F`` a node's, ``store.F``,
    ``rendezvous.F``)
    is named there (``nodes[].F``) and has the value given. The logs may take ``within_s`` to show them."""
    named = symptoms_section(runbook.read_text())
    paths = {path: re.sub(r"\[[^\]]+\]", "[]", path) for path in status or {}}
    for symptom in [*logs, *paths.values()]:
        assert symptom in named, f"{runbook.name}'s symptoms do not name {symptom!r}"
    patterns = {event: re.escape(event).replace(r"\ ", r"\s.*?") for event in logs}
    deadline = time.monotonic() + within_s
    while patterns:
        # The node logs are printed even while the store is down (then the command exits 1).
        text = cli("logs", "-c", cluster, "--run", run, "--tail", "2000", expect=None).stdout
        missing = [event for event, pattern in patterns.items() if not re.search(pattern, text)]
        if not missing:
            break
        assert time.monotonic() < deadline, f"no {missing} in the logs of {run}"
        time.sleep(1)
    if status:
        shown = json.loads(cli("status", "-c", cluster, "--json").stdout)
        rows = {"runs[]": next(r for r in shown["runs"] if r["run"] == run)}
        rows |= {f"nodes[{n['name']}]": n for n in shown["nodes"]}
        for path, expected in status.items():
            where, _, field = path.rpartition(".")
            actual = (rows[where] if where in rows else shown[where])[field]
            assert actual == expected, f"status {path} is {actual!r}, not {expected!r}"


def run_blocks(cli: Cli, runbook: Path, *, env: Mapping[str, str] | None = None) -> str:
    """Every ``bash`` block of ``runbook`` in order, as the runbook says to run them: ``bash -euo
    pipefail`` from the runbook's folder (as Runme does), with no INFRACTL_HOME of its own (and
    ``env``: what the machine's environment sets, e.g. an emulated device); all must succeed."""
    env = {k: v for k, v in cli.env().items() if k != "INFRACTL_HOME"} | dict(env or {})
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `infractl`, as installed
    blocks = bash_blocks(runbook.read_text())
    assert blocks, runbook
    transcript = []
    for block in blocks:
        assert block.startswith('export INFRACTL_HOME="'), block
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block],
            cwd=runbook.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        transcript.append(f"$ {block}\n{done.stdout}{done.stderr}")
        assert done.returncode == 0, "\n".join(transcript)
    return "\n".join(transcript)


def start(cli: Cli, spec: str, *, cluster: str = "local", first_commit: int = 20) -> FileStore:
    """Start the run ``spec`` (a run.yaml's text) detached on ``cluster``; return the cluster's
    store once step ``first_commit`` committed."""
    name = yaml.safe_load(spec)["name"]
    cli("train", str(write(cli.cwd / f"{name}.yaml", spec)), "-c", cluster, "--detach")
    store = FileStore(cli.home / cluster / "store")
    wait_for_commit(store, name, at_least=first_commit, timeout=180)
    return store


def assert_resumed_from(
    store: FileStore, name: str, *, fault_time: float, committed: int, world: int = 2, first_commit: int = 20
) -> None:
    """After the fault the run restarted from ``committed`` (a commit of ``start``'s, never step 0),
    every attempt resumed from there (or began the run), and it trained on ``world`` ranks after
    that restart (or completed on them)."""
    deadline = time.monotonic() + 300
    metrics = runstore.MetricsTail(store, name)
    while True:
        after = [r for r in metrics.records() if r["time"] > fault_time]
        restarts = [r for r in after if runstore.starts_a_process(r)]
        first = min(restarts, key=lambda r: r["time"]) if restarts else None
        if first is not None and any(r["time"] >= first["time"] and r["world_size"] == world for r in after):
            break
        assert time.monotonic() < deadline, f"{name} did not train on {world} ranks after a restart: {after[-3:]}"
        time.sleep(1)
    assert committed >= first_commit and first["step"] - 1 == committed, (first, committed)
    record = runstore.read_run_record(store, name)
    assert record is not None and all(a.resume_from in (0, committed) for a in record.attempts)


def assert_completed_from(
    store: FileStore,
    name: str,
    *,
    steps: int,
    fault_time: float,
    committed: int,
    world: int = 2,
    first_commit: int = 20,
) -> None:
    """The run completed on ``world`` ranks, and every restart after the fault resumed from ``committed``."""
    wait_for_commit(store, name, at_least=steps, timeout=300)
    assert_resumed_from(store, name, fault_time=fault_time, committed=committed, world=world, first_commit=first_commit)
    last = runstore.read_metrics(store, name)[-1]
    assert last["step"] == steps and last["world_size"] == world


def store_outage_runbook(cli: Cli, name: str, *, cluster: str = "local", seconds: int) -> float:
    """Take the cluster's file store down for ``seconds`` with ``infractl drill store-outage`` (in
    the background), check the symptoms the store-outage runbook names, and run its blocks while
    the store is down: they wait for it, and the run ``name`` is found whole. Returns when the
    store went down, once the drill ended."""
    drill = subprocess.Popen(
        [sys.executable, "-m", "infractl", "drill", "store-outage", "-c", cluster, "--seconds", str(seconds)]
        + ["--run", name, "--no-wait"],
        cwd=cli.cwd,
        env=cli.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        where = cli.home / cluster / "store"
        deadline = time.monotonic() + 60
        while where.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not where.exists(), "the drill did not take the store down"
        fault_time = time.time()
        runbook = cli.cwd / "handover" / cluster / "runbooks" / "store-outage.md"
        # The next save fails; the one after it logs the failure.
        assert_symptoms(
            cli,
            runbook,
            name,
            cluster=cluster,
            logs=["checkpoint_failed"],
            status={"store.reachable": False},
            within_s=20,
        )
        transcript = run_blocks(cli, runbook)
    finally:
        drill_output, _ = drill.communicate(timeout=600)
    assert drill.returncode == 0, drill_output
    assert "UNREACHABLE" in transcript and "the store answers again" in transcript, transcript
    assert f"no node of run {name} is missing" in transcript and f"run {name} recovered: " in transcript
    return fault_time
