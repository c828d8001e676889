"""The bundle's runbooks are executable: on a real 2-node local cluster, inject a fault into a
detached run, generate the bundle, run the ``bash`` blocks of the fault's runbook in order as
written, from the runbook's folder, and the run completes from its last committed checkpoint
(never step 0), also from a copy of the bundle whose original is gone. Also: every runbook renders
for any cluster, with nothing left unfilled."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from infractl import proc, runstore
from infractl.config import RunSpec, load_run, parse_cluster
from infractl.drill import recovery
from infractl.handover.reference import RUNBOOKS
from infractl.handover.runbooks import render_runbooks, section
from infractl.node import Node
from infractl.planning.plan import format_bytes, run_budget
from infractl.runs import Attention, RunState, attention
from infractl.runstore import Manifest, RunRecord, StepRecord
from infractl.statedir import ClusterRecord, ClusterState, Endpoint, write_private
from infractl.store import FileStore, Store
from trainer.faults import CORRUPT_WEIGHTS_ENV

from conftest import Cli, module_cluster, one_line, wait_for_commit, write
from runbook_steps import (
    HUNG_JOB_LOGS,
    HUNG_JOB_WITHIN_S,
    assert_completed_from,
    assert_symptoms,
    bash_blocks,
    hung_job_run,
    run_blocks,
    start,
    store_outage_runbook,
    symptoms_section,
)

# nodes.min 2: without node-1 the survivor waits in the rendezvous and the run stalls, so it
# completes only if the runbook's commands bring node-1 back (or launch the run again).
RUN = """\
name: {name}
model: {{layers: 2, hidden: 64, heads: 2, seq_len: 64}}
data: {{max_bytes: 200000}}
batch_size: 8
steps: {steps}
checkpoint: {{every: 20, keep: 2}}
nodes: {{min: 2, max: 2}}
max_restarts: 3
watchdog: {{step_timeout_s: 8}}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    with module_cluster(tmp_path_factory, "runbooks") as cli:
        yield cli


@pytest.mark.cluster
@pytest.mark.xdist_group("runbooks")
def test_node_failure_runbook_brings_the_run_back_and_it_completes_from_the_last_commit(cluster: Cli) -> None:
    steps = 200  # the run stalls without node-1: it cannot end before the runbook brought it back
    store = start(cluster, RUN.format(name="lost", steps=steps))
    node_dir = cluster.home / "local"
    fault_time = time.time()
    assert proc.kill_all(node_dir, node="node-1", timeout=30)[1] == []
    cluster("bundle", "--run", "lost")
    # status points the degraded run at its section of the runbook the bundle just wrote.
    runbook = cluster.cwd / "handover" / "local" / "runbooks" / "node-failure.md"
    (row,) = [r for r in json.loads(cluster("status", "--json").stdout)["runs"] if r["run"] == "lost"]
    assert row["attention"] == {
        "condition": "degraded",
        "why": "running on 1 of 2 nodes",
        "runbook": "node-failure",
        "section": "run-lost",
        "path": f"{runbook}#run-lost",
    }
    assert f"run lost is degraded (running on 1 of 2 nodes): see {runbook}#run-lost" in cluster("status").stdout
    assert_symptoms(cluster, runbook, "lost", status={"nodes[node-1].live_processes": 0})
    # The survivor waits in the rendezvous for nodes.min: nothing commits until node-1 is back.
    committed = runstore.latest_committed_step(store, "lost")
    assert committed is not None and committed >= 20
    transcript = run_blocks(cluster, runbook)
    assert "run lost is restarting" in transcript and "infractl rejoin" in transcript
    assert "run lost recovered: " in transcript
    assert_completed_from(store, "lost", steps=steps, fault_time=fault_time, committed=committed)
    assert proc.wait_gone(node_dir, run="lost", timeout=60) == []
    status = json.loads(cluster("status", "--json").stdout)
    assert [(r["state"], r["attention"]) for r in status["runs"] if r["run"] == "lost"] == [("completed", None)]


@pytest.mark.cluster
@pytest.mark.xdist_group("runbooks")
def test_a_copied_bundle_launches_a_run_that_lost_every_node_again_from_its_own_config(
    cluster: Cli, tmp_path: Path
) -> None:
    steps = 60  # two more commits after the relaunch: it resumes, it is not merely done
    store = start(cluster, RUN.format(name="orphan", steps=steps))
    node_dir = cluster.home / "local"
    fault_time = time.time()
    assert proc.kill_all(node_dir, run="orphan", timeout=30)[1] == []  # every node: no agent is left to resume it
    committed = runstore.latest_committed_step(store, "orphan")
    assert committed is not None
    # Handed over: written to one folder, copied to the ops team's share, the original deleted.
    written = tmp_path / "written"
    cluster("bundle", "--run", "orphan", "--out", str(written))
    copy = Path(shutil.copytree(written, tmp_path / "ops-share" / "local"))
    shutil.rmtree(written)
    assert_symptoms(
        cluster,
        copy / "runbooks" / "node-failure.md",
        "orphan",
        status={"runs[].state": "stopped", "nodes[node-0].live_processes": 0, "nodes[node-1].live_processes": 0},
    )
    transcript = run_blocks(cluster, copy / "runbooks" / "node-failure.md")
    # The stopped run is launched again from the copy's configs/runs/orphan.yaml.
    assert "run orphan is stopped" in transcript and "run orphan recovered: " in transcript, transcript
    assert_completed_from(store, "orphan", steps=steps, fault_time=fault_time, committed=committed)


@pytest.mark.cluster
@pytest.mark.xdist_group("runbooks")
def test_store_outage_runbook_waits_for_the_store_and_the_run_completes(cluster: Cli) -> None:
    steps = 2000  # still training when the store is back and the runbook verifies
    store = start(cluster, RUN.format(name="outage", steps=steps))
    cluster("bundle", "--run", "outage")  # before the outage: the bundle is made from the store
    fault_time = store_outage_runbook(cluster, "outage", seconds=40)
    wait_for_commit(store, "outage", at_least=steps, timeout=300)
    after = [r for r in runstore.read_metrics(store, "outage") if r["time"] > fault_time]
    assert after and not any(runstore.starts_a_process(r) for r in after)  # training went on, no restart
    assert after[-1]["step"] == steps and after[-1]["world_size"] == 2


@pytest.mark.cluster
@pytest.mark.xdist_group("runbooks")
def test_hung_job_runbook_brings_the_run_back_and_it_completes_from_the_last_commit(cluster: Cli) -> None:
    steps = 200  # the run may end before the runbook's last block: it verifies "or has completed"
    store = start(cluster, hung_job_run(RUN.format(name="stuck", steps=steps)))
    node_dir = cluster.home / "local"
    fault_time = time.time()
    proc.signal_listed(recovery.workers(proc.listing(node_dir, node="node-1")), signal.SIGSTOP)
    cluster("bundle", "--run", "stuck")  # no step completes past a stopped rank: nothing commits until the restart
    committed = runstore.latest_committed_step(store, "stuck")
    assert committed is not None
    runbook = cluster.cwd / "handover" / "local" / "runbooks" / "hung-job.md"
    # Within seconds the collectives time out and the hung worker is killed: the run restarts by itself.
    assert_symptoms(
        cluster,
        runbook,
        "stuck",
        logs=HUNG_JOB_LOGS,
        within_s=HUNG_JOB_WITHIN_S,
    )
    transcript = run_blocks(cluster, runbook)
    assert "run stuck recovered: " in transcript, transcript
    assert_completed_from(store, "stuck", steps=steps, fault_time=fault_time, committed=committed)


def test_every_runbook_renders_for_each_run_with_nothing_left_to_fill_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFRACTL_HOME", str(tmp_path / "state"))
    cluster = ClusterRecord(
        name="lab",
        spec=parse_cluster({"name": "lab", "processes_per_node": 2}),
        store=f"file://{tmp_path}/store",
        id=None,
        rendezvous=Endpoint("127.0.0.1", 29400),
        nodes=tuple(Node(f"node-{index}", "127.0.0.1", tmp_path / f"node-{index}", 2) for index in range(2)),
    )
    records = [
        RunRecord("beta", "lab", spec={"name": "beta", "steps": 40, "nodes": {"min": 1, "max": 2}}),
        RunRecord("alpha", "lab", spec={"name": "alpha", "steps": 30, "env": ["HF_TOKEN"]}),
    ]
    files = render_runbooks(cluster, records)
    assert sorted(files) == sorted(f"runbooks/{name}.md" for name in RUNBOOKS)
    assert render_runbooks(cluster, records) == files  # deterministic
    for name, content in files.items():
        text = content.decode()
        assert not re.search(r"\$(cluster|home|store|run|config|world|ckpt|commits|recover|verify|run_from)\b", text)
        # Where the blocks run is said before the first of them, not as the summary the page shows.
        paragraphs = text.split("\n\n")
        assert paragraphs[2].startswith("Run the `bash` blocks below from the folder this runbook is in"), name
        for block in bash_blocks(text):
            assert block.startswith(f'export INFRACTL_HOME="{tmp_path / "state"}"\n'), (name, block)
            assert subprocess.run(["bash", "-n", "-c", block], capture_output=True).returncode == 0, (name, block)
    # A run that passes a variable from the shell (run.yaml env:): its launching blocks stop first,
    # naming it, where it is not set, before `train` or `rejoin` would refuse.
    restart = files["runbooks/full-restart.md"].decode()
    [launch] = [b for b in bash_blocks(restart) if "infractl train ../configs/runs/alpha.yaml" in b]
    guard = launch.splitlines()[1]
    unset = subprocess.run(["bash", "-c", guard], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert unset.returncode != 0 and "run alpha passes HF_TOKEN to its trainers" in unset.stderr, unset
    set_ = subprocess.run(["bash", "-c", guard], capture_output=True, env={"PATH": "/usr/bin:/bin", "HF_TOKEN": "x"})
    assert set_.returncode == 0
    assert not [b for b in bash_blocks(restart) if "alpha" not in b and "HF_TOKEN" in b]
    node_failure = files["runbooks/node-failure.md"].decode()
    assert node_failure.index("## Run `beta`") < node_failure.index("## Run `alpha`")  # the given order
    assert "infractl rejoin" in node_failure and "infractl train ../configs/runs/alpha.yaml -c lab" in node_failure
    assert "on all 4 ranks" in node_failure  # nodes.max 2 x 2 processes per node
    teardown = files["runbooks/teardown.md"].decode()
    assert teardown.count("infractl teardown -c lab --yes") == 1 and teardown.count("infractl export") == 2
    empty = render_runbooks(cluster, [])
    assert "No run of this cluster" in empty["runbooks/node-failure.md"].decode()


def test_status_names_the_runbook_of_a_failed_degraded_or_stalled_run(tmp_path: Path) -> None:
    spec = RunSpec.model_validate({"name": "r", "nodes": {"min": 1, "max": 2}, "watchdog": {"step_timeout_s": 30}})
    newest: StepRecord = {"step": 5, "time": 1000.0, "step_time_s": 0.5, "world_size": 2}  # type: ignore[typeddict-item]
    crashed = b"stopped reason=crashed error='OutOfMemoryError: CUDA out of memory'\n"
    killed = b"checkpoint_committed step=4\n"

    def check(
        state: RunState,
        *,
        live: int = 2,
        at: float = 1001.0,
        logs: tuple[bytes, ...] = (),
        world: int = 2,
        unreachable: tuple[str, ...] = (),
    ) -> Attention | None:
        return attention(
            spec,
            state,
            newest={**newest, "world_size": world},
            live_nodes=live,
            cluster_nodes=3,
            processes_per_node=1,
            started=900.0,
            log_tails=list(logs),
            now=at,
            unreachable=unreachable,
        )

    assert check("running") is None and check("completed") is None and check("stopped") is None
    assert check("failed", logs=(killed, crashed)) == Attention(
        "failed", "a rank ran out of device memory", "out-of-memory"
    )
    assert check("failed", logs=(killed,)) == Attention(
        "failed", "every node's agent gave up before the last step", "node-failure"
    )
    assert check("running", live=1) == Attention("degraded", "running on 1 of 2 nodes", "node-failure")
    assert check("running", at=1044.0) is None  # 30 s + log_every (10) x 0.5 s + 10 s for the metrics to land
    assert check("running", at=1046.0) == Attention("stalled", "no step recorded for 46 s (limit 45 s)", "hung-job")
    assert check("running", world=1) == Attention("degraded", "world size 1 of 2", "node-failure")
    # A node the control plane cannot reach either: the network, not the node.
    assert check("running", live=1, unreachable=("node-0",)) == Attention(
        "degraded", "running on 1 of 2 nodes; node-0 unreachable", "connection-loss"
    )


def test_a_runbook_section_has_a_path_only_once_a_bundle_holds_it(tmp_path: Path) -> None:
    state = ClusterState("lab", tmp_path / "state")
    assert section(state, "node-failure", "r") == {"runbook": "node-failure", "section": "run-r", "path": None}
    (tmp_path / "out" / "runbooks").mkdir(parents=True)
    write(tmp_path / "out" / "runbooks" / "node-failure.md", "# Runbook\n\n## Run `other`\n")
    write_private(state.bundle_record_path, json.dumps({"out": str(tmp_path / "out")}))
    assert section(state, "node-failure", "r")["path"] is None  # the bundle predates run r
    write(tmp_path / "out" / "runbooks" / "node-failure.md", "# Runbook\n\n## Run `r`\n")
    assert section(state, "node-failure", "r")["path"] == f"{tmp_path}/out/runbooks/node-failure.md#run-r"
    assert section(state, "node-failure", None)["path"] == f"{tmp_path}/out/runbooks/node-failure.md"


@pytest.mark.cluster
@pytest.mark.xdist_group("runbooks")
def test_preemption_runbook_brings_the_preempted_node_back_and_the_run_completes_from_its_save(
    cluster: Cli,
) -> None:
    steps = 200  # the survivor waits for nodes.min: the run cannot end before the runbook brought node-1 back
    store = start(cluster, RUN.format(name="reclaimed", steps=steps))
    node_dir = cluster.home / "local"
    fault_time = time.time()
    # A spot reclaim's notice: SIGTERM to the node's agent, whose workers save the step and leave.
    proc.signal_listed([p for p in proc.listing(node_dir, node="node-1", run="reclaimed") if p.agent], signal.SIGTERM)
    assert proc.wait_gone(node_dir, node="node-1", timeout=60) == []
    cluster("bundle", "--run", "reclaimed")
    runbook = cluster.cwd / "handover" / "local" / "runbooks" / "preemption.md"
    assert_symptoms(
        cluster,
        runbook,
        "reclaimed",
        logs=["preempted", "stopped reason=preempted", "stopped reason=peer_preempted"],
        status={"nodes[node-1].live_processes": 0},
        within_s=20,
    )
    # The step the preempted rank stopped at is committed (by its own save, or a scheduled one in flight).
    preempted_log = cluster("logs", "--run", "reclaimed", "--node", "node-1").stdout
    stopped = re.search(r"reason=preempted step=(\d+)", preempted_log)
    committed = runstore.latest_committed_step(store, "reclaimed")
    assert stopped is not None and committed == int(stopped.group(1)), (stopped, committed)
    transcript = run_blocks(cluster, runbook)
    assert "infractl rejoin" in transcript and "run reclaimed recovered: " in transcript, transcript
    assert_completed_from(store, "reclaimed", steps=steps, fault_time=fault_time, committed=committed or 0)


@pytest.mark.cluster
@pytest.mark.xdist_group("runbooks")
def test_full_restart_runbook_recreates_the_cluster_and_the_run_completes_from_its_last_commit(cluster: Cli) -> None:
    steps = 120
    store = start(cluster, RUN.format(name="everything", steps=steps))
    node_dir = cluster.home / "local"
    fault_time = time.time()
    # Every process of the cluster dies, the rendezvous server with the nodes' agents and workers.
    assert proc.kill_all(node_dir, timeout=30)[1] == []
    committed = runstore.latest_committed_step(store, "everything")
    cluster("bundle", "--run", "everything")
    runbook = cluster.cwd / "handover" / "local" / "runbooks" / "full-restart.md"
    assert_symptoms(
        cluster,
        runbook,
        "everything",
        status={
            "rendezvous.running": False,
            "runs[].state": "stopped",
            "nodes[node-0].live_processes": 0,
            "nodes[node-1].live_processes": 0,
        },
    )
    transcript = run_blocks(cluster, runbook)
    assert "infractl teardown" in transcript and "run everything recovered: " in transcript, transcript
    assert_completed_from(store, "everything", steps=steps, fault_time=fault_time, committed=committed or 0)


# A run whose activations outweigh the rest (tests/test_plan.py sizes the same shape).
SQUEEZED = """\
name: squeezed
model: {layers: 2, hidden: 64, heads: 2, seq_len: 128}
data: {max_bytes: 200000}
batch_size: 64
steps: 60
checkpoint: {every: 20, keep: 2}
nodes: {min: 2, max: 2}
max_restarts: 1
watchdog: {step_timeout_s: 8}
"""
#: Devices of 68 MiB, emulated on the CPU nodes (trainer/held.py): the run's plain ddp holds 72 MiB
#: in its forward there (91 MiB by the plan); with activation checkpointing the plan says 65 MiB.
#: Set in the agents' environment after `up`, which recorded this machine's memory: smaller
#: devices than the cluster was provisioned with, which `train`'s check cannot see.
SMALL_DEVICES = {"INFRACTL_DEVICE_MEMORY": str(68 << 20)}


@pytest.mark.cluster
@pytest.mark.xdist_group("runbooks")
def test_train_refuses_a_run_its_plan_does_not_fit_before_anything_starts(cluster: Cli) -> None:
    """What the plan can see never gets as far as the out-of-memory runbook: a 48 x 8192 model
    needs more per device, at its smallest world, than the devices `up` recorded (this machine's
    memory shared by the two ranks), and `train` says by how much, starting nothing."""
    run = write(cluster.cwd / "huge.yaml", "name: huge\nmodel: {layers: 48, hidden: 8192, heads: 64, seq_len: 2048}\n"
                                           "batch_size: 16\nnodes: {min: 2, max: 2}\n")  # fmt: skip
    line = one_line(cluster("train", str(run), expect=2).stderr)
    recorded = ClusterState("local", cluster.home / "local").record().device
    assert recorded is not None
    budget = run_budget(load_run(run), world_size=2, max_world_size=2, cuda=False)
    shortfall = format_bytes(budget.total - recorded.memory_bytes)
    assert (
        f"huge.yaml: run 'huge' does not fit the devices of cluster 'local': as configured (ddp) it needs "
        f"{format_bytes(budget.total)} per device on its smallest world (2 node(s) x 1 process(es), "
        f"nodes.min), {shortfall} more than the {format_bytes(recorded.memory_bytes)} of a cpu device;" in line
    )
    assert FileStore(cluster.home / "local" / "store").list("runs/huge") == []
    assert "huge" not in cluster("status", "--json").stdout
    # A cluster brought up before `up` recorded its device is sized as `up` would size it now.
    state = ClusterState("local", cluster.home / "local")
    record = state.record()
    state.write(dataclasses.replace(record, device=None))
    try:
        assert one_line(cluster("train", str(run), expect=2).stderr) == line
    finally:
        state.write(record)


@pytest.mark.cluster
@pytest.mark.xdist_group("runbooks")
def test_out_of_memory_runbook_changes_the_run_to_a_way_that_fits_and_it_completes_from_its_last_commit(
    cluster: Cli,
) -> None:
    """The run trained to a commit, then moved to nodes with smaller devices than `up` recorded
    (``SMALL_DEVICES``): every rank runs out of memory in its first step's forward, the restart
    too, and the run fails. The runbook
    changes its config to the first way that fits and launches it again, on the same devices."""
    store = start(cluster, SQUEEZED)
    cluster("stop", "--run", "squeezed")  # a preemption: the step it was on is committed
    committed = runstore.latest_committed_step(store, "squeezed")
    assert committed is not None and committed >= 20
    fault_time = time.time()
    moved = cluster("train", str(cluster.cwd / "squeezed.yaml"), env=SMALL_DEVICES, expect=None)
    assert moved.returncode != 0 and "stopped at committed step" in moved.stderr, moved.stderr
    cluster("bundle", "--run", "squeezed")
    runbook = cluster.cwd / "handover" / "local" / "runbooks" / "out-of-memory.md"
    assert_symptoms(
        cluster,
        runbook,
        "squeezed",
        logs=['stopped error="OutOfMemoryError'],
        status={"runs[].state": "failed"},
    )
    (row,) = [r for r in json.loads(cluster("status", "--json").stdout)["runs"] if r["run"] == "squeezed"]
    assert row["attention"]["runbook"] == "out-of-memory", row
    transcript = run_blocks(cluster, runbook, env=SMALL_DEVICES)
    assert "now says activation_checkpointing: true" in transcript, transcript
    assert "run squeezed recovered: " in transcript, transcript
    assert_completed_from(store, "squeezed", steps=60, fault_time=fault_time, committed=committed)
    # It trained with activation checkpointing on the same devices: the change made it fit.
    record = runstore.read_run_record(store, "squeezed")
    assert record is not None and record.spec["activation_checkpointing"] is True


def rolled_back(store: Store, name: str, transcript: str) -> int:
    """The step the rollback runbook's ``infractl rollback`` went back to; every committed step
    it moved is checked to be kept whole aside (its manifest, every file it lists, its COMMITTED)."""
    moved = re.search(rf"run '{name}' rolled back to step (\d+): step\(s\) ([\d, ]+) moved to (\S+);", transcript)
    assert moved is not None, transcript
    to, steps = int(moved.group(1)), [int(s) for s in moved.group(2).split(", ")]
    assert steps and min(steps) > to
    aside = moved.group(3).rstrip("/").rsplit("/runs/", 1)[1]
    for step in steps:
        prefix = f"runs/{aside}/step-{step:08d}"
        held = {o.key[len(prefix) + 1 :]: o.size for o in store.list(prefix)}
        manifest = Manifest.from_json(store.get_bytes(f"{prefix}/MANIFEST.json"))
        assert {e.key: e.size for e in manifest.files}.items() <= held.items() and "COMMITTED" in held, step
    return to


@pytest.mark.cluster
@pytest.mark.xdist_group("runbooks")
def test_rollback_runbook_sets_the_bad_steps_aside_and_the_run_goes_on_from_the_step_before_the_jump(
    cluster: Cli,
) -> None:
    """A bad update at step 50 (trainer/engine.py's injected one) makes the loss jump, and the
    steps committed after it hold the bad weights. The run is still training when the runbook
    runs: it is stopped without a save, the steps after the one the engineer picked from the
    losses are moved aside whole, and the run goes on from that step, its loss back where it
    was. (On an S3 store: tests/test_e2e.py.)"""
    name = "diverged"
    store = FileStore(cluster.home / "local" / "store")
    # Paced (a commit every 4 s), and 40 commits kept: the bad steps committed while the runbook is
    # read (a minute under CI's load) do not push the good ones out of retention.
    spec = RUN.format(name=name, steps=2000).replace("keep: 2", "keep: 40") + "min_step_s: 0.2\n"
    run_file = write(cluster.cwd / f"{name}.yaml", spec + f"env: [{CORRUPT_WEIGHTS_ENV}]\nrehearsal: true\n")
    cluster("train", str(run_file), "--detach", env={CORRUPT_WEIGHTS_ENV: "50"})
    wait_for_commit(store, name, at_least=60, timeout=300)  # a commit after the bad update
    # Refused, one line, nothing moved: a running run.
    refused = cluster("rollback", name, "--to", "20", "--yes", expect=2).stderr
    assert f"run {name!r} is running: stop it first (`infractl stop --run {name}`)" in refused
    cluster("bundle", "--run", name)
    runbook = cluster.cwd / "handover" / "local" / "runbooks" / "rollback.md"
    # The symptom the runbook names: the loss jumps, in `infractl metrics` (what step 1 prints).
    assert "the loss jumps" in symptoms_section(runbook.read_text())
    shown = cluster("metrics", name).stdout
    losses = {r["step"]: r["loss"] for r in runstore.read_metrics(store, name)}
    assert losses[51] > 2 * losses[50], (losses[49], losses[50], losses[51])
    assert re.search(rf"\b51\b.*{losses[51]:.4f}", shown), shown
    # As the runbook says: the engineer picks the newest committed step before the jump.
    to = max(step for step in runstore.committed_steps(store, name) if step <= 50)
    fault_time = time.time()
    # The run's env: passes the hook, so the runbook's launch needs it set: to step 0, which no run
    # trains (the bad update's cause, fixed).
    transcript = run_blocks(cluster, runbook, env={"ROLLBACK_TO": str(to), CORRUPT_WEIGHTS_ENV: "0"})

    assert f"infractl stop --run {name} --no-save" in transcript and f"run {name} recovered: " in transcript
    assert rolled_back(store, name, transcript) == to == 40
    # The run resumed from the step rolled back to, with the weights of before the jump.
    after = [r for r in runstore.read_metrics(store, name) if r["time"] > fault_time]
    restarts = [r for r in after if runstore.starts_a_process(r)]
    resumed = min(restarts, key=lambda r: r["time"]) if restarts else None
    assert resumed is not None and resumed["step"] == to + 1, restarts[:2]
    again = [r for r in after if r["time"] >= resumed["time"]]
    assert again and all(r["loss"] < 2 * losses[50] for r in again), again[:12]
    # A plain stop is a preemption of every node: the step the workers were on is committed.
    stopped = json.loads(cluster("stop", "--run", name, "--json").stdout)
    newest = max(runstore.read_metrics(store, name), key=lambda r: r["time"])  # the steps set aside ran further
    assert stopped["killed"] == 0 and stopped["last_committed_step"] == newest["step"], (stopped, newest)
    refused = cluster("rollback", name, "--to", str(to + 1), "--yes", expect=2).stderr
    assert f"--to: step {to + 1} is not a committed step of run {name!r} (committed: " in refused


@pytest.mark.cluster
@pytest.mark.xdist_group("runbooks")
def test_teardown_runbook_exports_the_model_and_leaves_the_store_readable(cluster: Cli) -> None:
    """Last of the module's cluster tests: the runbook tears the cluster down; it is brought up
    again for the module's own teardown."""
    steps = 40
    run_file = write(cluster.cwd / "window.yaml", RUN.format(name="window", steps=steps))
    cluster("train", str(run_file))  # the training window: the run completes
    store = FileStore(cluster.home / "local" / "store")
    cluster("bundle", "--run", "window")
    runbook = cluster.cwd / "handover" / "local" / "runbooks" / "teardown.md"
    assert_symptoms(cluster, runbook, "window", status={"runs[].state": "completed"})
    try:
        transcript = run_blocks(cluster, runbook)
        assert "cluster local is down" in transcript, transcript
        assert proc.find(cluster.home / "local") == []
        # The store outlives the cluster, whole: every committed step verifies, the metrics and
        # run records read, and the exported weights are the ones the run trained last.
        assert runstore.committed_steps(store, "window")[-1] == steps
        for step in runstore.committed_steps(store, "window"):
            runstore.verify_checkpoint(store, "window", step)
        assert runstore.read_metrics(store, "window")[-1]["step"] == steps
        exported = cluster.home.parent / "exports" / "window.safetensors"
        described = json.loads(exported.with_name("window.safetensors.json").read_text())
        assert described["step"] == steps and runstore.file_sha256(exported) == described["sha256"]
    finally:
        cluster("up")
