"""The netns provider end to end: a real 2-node cluster of network namespaces on a bridge (real
Terraform, Ansible over real SSH to an sshd in each namespace, torchrun on gloo across the nodes'
addresses), a seeded chaos series of ten faults (link cuts of node 1 and of node 0 among them) while
a run trains, and a teardown that leaves no namespace, interface, key or process. The runbooks of
faults a node of its own shows (connection loss, node failure, store outage, a hung job) work here
as on the local cluster (tests/test_runbooks.py): the fault, its named symptoms seen, the bundle's
blocks run as written, and the run trains on both nodes again from its last commit. The refusals
(not root, no namespaces) change nothing."""

from __future__ import annotations

import ipaddress
import itertools
import json
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from infractl import providers, runstore, workdir
from infractl.drill import KINDS, recovery
from infractl.providers.nodecontrol import NodeControl
from infractl.statedir import ClusterState
from infractl.store import FileStore

from conftest import Cli, module_cluster, one_line, running_runs, stop_runs, wait_for_commit, wait_for_world, write
from runbook_steps import (
    HUNG_JOB_LOGS,
    HUNG_JOB_WITHIN_S,
    assert_resumed_from,
    assert_symptoms,
    hung_job_run,
    run_blocks,
    start,
    store_outage_runbook,
)

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("netns")]

#: A worker's last line when it crashed (a collective timed out on a fault), as its node log holds it.
_CRASHED = re.compile(r"stopped\s.*?reason=crashed")

CLUSTER = """\
name: multi
provider: netns
nodes: 2
"""
# No netns.subnet: each cluster takes the /24 its state directory picks, so a run of this module never
# collides with another's bridge on the same machine (a fixed subnet made a second run refuse to go up).

# The runbook tests' run: it trains until the test's fixture stops it (a commit every 2 s, at little
# CPU); the runbooks verify it trains on both nodes again. nodes.min 2: without its lost node the
# run stalls, so it trains on 2 again only if the runbook brought the node back.
RUN = """\
name: {name}
model: {{layers: 2, hidden: 64, heads: 2, seq_len: 64}}
data: {{max_bytes: 200000}}
batch_size: 8
steps: 100000
min_step_s: 0.2
checkpoint: {{every: 10, keep: 2}}
nodes: {{min: {min_nodes}, max: 2}}
max_restarts: 3
watchdog: {{step_timeout_s: 8}}
"""

# A seeded chaos series (infractl/drill/chaos.py): seed 25 draws all six kinds over both nodes, among
# them a partition of each node (node-0's link down, node-1's packets dropped). The run must outlast
# the series, and trains between and during faults: at full speed 5,000 steps, which the reference
# run trained again after it at the cost of the series' own time in CPU. Paced (`min_step_s`), the
# run trains about 190 s (some 500 steps) in the 5.5-minute series; 800 steps at 0.45 s give it 1.9
# times that, at a fraction of the CPU, and the reference (trained without the pace) takes under a
# minute. What the run trains during the series is counted in steps more than in seconds (each fault
# waits for commits and for the whole world), so a slower machine eats little of the margin; the
# series once took 7.4 minutes beside the rest of the suite, and 800 steps at 0.375 s ran out in it.
CHAOS_SEED = 25
CHAOS_RUN = """\
name: storm
model: {layers: 2, hidden: 64, heads: 2, seq_len: 64}
data: {max_bytes: 200000}
batch_size: 8
steps: 800
min_step_s: 0.45
checkpoint: {every: 10, keep: 2}
nodes: {min: 1, max: 2}
max_restarts: 12
deterministic: true
watchdog: {step_timeout_s: 8}
"""


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    with module_cluster(tmp_path_factory, "netns", cluster_yaml=CLUSTER) as cli:
        state = cli.home / "multi"
        # infra/netns names node i's namespace infractl-<the state directory's short id>-<i>.
        short_id = ClusterState("multi", state).short_id
        namespaces = [f"infractl-{short_id}-{index}" for index in range(2)]
        assert set(namespaces) <= set(_namespaces())
        yield cli
    # module_cluster tore it down and found no process with the cluster's marker; nothing else is left
    # either, but the store (kept without --purge) and the lock.
    assert sorted(p.name for p in state.iterdir()) == ["lock", "store"]
    assert [n for n in _namespaces() if n.startswith(f"infractl-{short_id}-")] == []
    links = json.loads(subprocess.run(["ip", "-json", "link"], capture_output=True, text=True, check=True).stdout)
    assert [link["ifname"] for link in links if short_id in link["ifname"]] == []
    assert [p.pid for p in psutil.process_iter(["cmdline"]) if str(state) in " ".join(p.info["cmdline"] or [])] == []


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "-json", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return sorted(n["name"] for n in json.loads(listed or "[]") if n["name"].startswith("infractl-"))


@pytest.fixture
def cluster(multi: Cli) -> Iterator[Cli]:
    yield multi
    stop_runs(multi.home / "multi")


def test_up_reaches_each_node_over_ssh_at_its_own_address_with_a_pinned_host_key(multi: Cli, tmp_path: Path) -> None:
    state = multi.home / "multi"
    record = json.loads((state / "cluster.json").read_text())
    # The bridge's host side, in no node, is the .1 of a /24 of the default block; node i is .(i+2).
    bridge = ipaddress.IPv4Address(record["rendezvous"]["host"])
    assert bridge in ipaddress.IPv4Network("10.200.0.0/13") and int(bridge) % 256 == 1
    assert [(n["name"], n["address"]) for n in record["nodes"]] == [
        ("node-0", str(bridge + 1)),
        ("node-1", str(bridge + 2)),
    ]
    key = state / "ssh" / "id_ed25519"
    assert key.stat().st_mode & 0o777 == 0o600
    hosts = json.loads((state / "ansible" / "inventory" / "hosts.json").read_text())["all"]["hosts"]
    for node in record["nodes"]:
        host = hosts[node["name"]]
        assert host["ansible_connection"] == "ssh" and host["ansible_host"] == node["address"]
        assert "StrictHostKeyChecking=yes" in host["ansible_ssh_common_args"]
        # Ansible logged in with the cluster's key, and the collectives use the namespace's interface.
        sshd_log = (state / "ssh" / "nodes" / node["name"] / "sshd.log").read_text()
        assert f"Accepted publickey for root from {record['rendezvous']['host']}" in sshd_log
        env = workdir.network_env(Path(node["workdir"])).read_text()
        assert "GLOO_SOCKET_IFNAME=eth0" in env and f"INFRACTL_NODE_ADDRESS={node['address']}" in env
    assert "StrictHostKeyChecking=no" not in (state / "ansible" / "inventory" / "hosts.json").read_text()

    # The pin holds: against another host key, ssh refuses to log in.
    node = record["nodes"][1]
    forged = tmp_path / "known_hosts"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    forged.write_text(f"{node['address']} {' '.join((tmp_path / 'other.pub').read_text().split()[:2])}\n")
    login = ["ssh", "-o", f"UserKnownHostsFile={forged}", "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes"]
    refused = subprocess.run(
        [*login, "-i", str(key), f"root@{node['address']}", "true"], capture_output=True, text=True
    )
    assert refused.returncode == 255 and "Host key verification failed" in refused.stderr

    assert "no changes" in multi("up", "-c", str(multi.cwd / "cluster.yaml")).stderr
    # A second cluster on this bridge's subnet is refused before anything is made.
    subnet = ipaddress.IPv4Network(f"{bridge}/24", strict=False)
    taken = write(multi.cwd / "taken.yaml", f"name: taken\nprovider: netns\nnodes: 1\nnetns: {{subnet: {subnet}}}\n")
    refused_up = one_line(multi("up", "-c", str(taken), expect=2).stderr)
    assert refused_up.startswith(f"error: netns.subnet: {subnet} is in use"), refused_up
    assert f"interface ixb{ClusterState('multi', state).short_id} has {bridge}" in refused_up
    assert not (multi.home / "taken").exists()

    # The handover says how to log in to each node, and that command works as written.
    multi("bundle", "-c", "multi", "--out", str(tmp_path / "bundle"))
    topology = (tmp_path / "bundle" / "topology.md").read_text()
    logins = [line for line in topology.splitlines() if line.startswith("ssh ")]
    assert len(logins) == 2 and "StrictHostKeyChecking=yes" in logins[1]
    inside = subprocess.run([*shlex.split(logins[1]), "ip -brief -4 addr show eth0"], capture_output=True, text=True)
    assert inside.returncode == 0 and node["address"] in inside.stdout, inside


def test_a_seeded_chaos_series_of_10_faults_recovers_each_and_trains_what_an_uninterrupted_run_trains(
    cluster: Cli, tmp_path: Path
) -> None:
    run = write(cluster.cwd / "storm.yaml", CHAOS_RUN)
    cluster("train", str(run), "-c", "multi", "--detach")
    store = FileStore(cluster.home / "multi" / "store")
    wait_for_commit(store, "storm", at_least=10, timeout=120)

    # Refusals first, on the running run: each names its option, and nothing is struck.
    assert "--kind" in one_line(cluster("drill", "partition", "-c", "multi", "--kind", "cut", expect=2).stderr)
    if not Path("/sys/module/sch_netem").exists():
        # This kernel has no netem (the machines CI runs on): `--kind delay` must say so, not half-cut the link.
        refused = one_line(cluster("drill", "partition", "-c", "multi", "--kind", "delay", expect=2).stderr)
        assert "error: --kind: cannot make a 'delay' fault on node-1's link" in refused and "sch_netem" in refused
    chaos = ("drill", "chaos", "-c", "multi", "--seed", str(CHAOS_SEED), "--min-gap", "1")
    assert "--kinds: unknown kind 'cut'" in one_line(cluster(*chaos, "--kinds", "kill-node,cut", expect=2).stderr)
    assert "--count: " in one_line(cluster(*chaos, "--count", "40", expect=2).stderr)  # max_restarts 12
    assert "--reference: no run 'nope'" in one_line(cluster(*chaos, "--reference", "nope", expect=2).stderr)
    assert store.list(runstore.run_prefix("storm") + "/drills/") == []
    assert running_runs(cluster.home / "multi")["storm"] == {"node-0", "node-1"}

    # The seed draws the series (the same one every time), over every kind and both nodes.
    planned = json.loads(cluster(*chaos, "--count", "10", "--plan", "--json").stdout)
    assert json.loads(cluster(*chaos, "--count", "10", "--plan", "--json").stdout) == planned
    faults = planned["plan"]
    assert {f["kind"] for f in faults} == set(KINDS) and {f["node"] for f in faults} >= {"node-0", "node-1"}

    done = json.loads(cluster(*chaos, "--count", "10", "--json", timeout=1800).stdout)
    assert (done["recovered"], done["stopped"], done["plan"]) == (10, None, faults), done
    results = done["results"]
    assert [(r["drill"], r["node"]) for r in results] == [(f["kind"], f["node"]) for f in faults]
    for fault, result in zip(faults, results, strict=True):
        # Every fault but the store's costs a restart, from the newest committed step.
        assert result["outcome"] == "recovered", result
        assert result["resumed_correctly"] or fault["kind"] == "store-outage", result
        if fault["kind"] == "partition":
            # The others noticed within the collective timeout and went on from the last commit; the
            # cut node came back into the run once its link was (by itself or by `infractl rejoin`).
            assert result["fault"]["link"] == fault["options"]["link"] and result["survivors"] != [fault["node"]]
            assert result["detect_s"] is not None and result["detect_s"] < fault["seconds"], result
            assert result["rejoin_s"] is not None and result["fault"]["rejoined_by"] in ("itself", "infractl rejoin")
        elif fault["kind"] in ("kill-node", "kill-during-checkpoint", "preempt"):
            assert result["rejoin_s"] is not None, result  # the series brought the node back
    # The faults changed nothing that was trained: the steps before the first step on one node are
    # bitwise those of the reference run (trained after the series, uninterrupted), the rest within 1e-5.
    comparison = done["comparison"]
    assert comparison["matches"] and comparison["reference"] == "storm-reference", comparison
    assert comparison["steps"] == 800 and comparison["first_other_world_step"] is not None, comparison
    assert comparison["bitwise_steps"] == comparison["first_other_world_step"] - 1, comparison
    assert done["passed"] and done["median_restart_s"] <= done["worst_restart_s"]
    # The run kept its pace (min_step_s), the reference ran free: the same steps, in less time. A gap
    # is between two steps' records, each taken after its step's work: one step's work longer than
    # the next's takes that difference off the gap, so the median is the pace within a few ms.
    assert _median_step_gap(store, "storm") >= 0.45 - 0.01 > _median_step_gap(store, "storm-reference")
    # Recorded in the store, and shown in the handover's baseline.
    [recorded] = runstore.read_chaos_records(store, "storm")
    assert recorded.to_dict() | {"results": results} == done
    cluster("bundle", "-c", "multi", "--out", str(tmp_path / "bundle"))
    assert json.loads((tmp_path / "bundle" / "baseline" / "storm.json").read_text())["chaos"] == [recorded.to_dict()]
    assert "<h3>Chaos series</h3>" in (tmp_path / "bundle" / "index.html").read_text()


def _median_step_gap(store: FileStore, run: str) -> float:
    """The median time between a step's record and the next one's (rank 0's clock)."""
    records = sorted(runstore.read_metrics(store, run), key=lambda r: r["step"])
    gaps = sorted(b["time"] - a["time"] for a, b in itertools.pairwise(records) if b["step"] == a["step"] + 1)
    return gaps[len(gaps) // 2]


def _namespace_pids(namespace: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()


def _wait_for_a_crash(cli: Cli, run: str, *, within_s: float) -> None:
    """Until a worker of ``run`` logs that it crashed on the fault (``stopped reason=crashed``: its
    collectives timed out). The world of before the fault is over then: a commit it had agreed to
    landed within moments of the fault, long before, and the next one comes only after the restart.
    The logs are read on this machine, where the nodes' work directories are (a cut node's too)."""
    nodes = json.loads((cli.home / "multi" / "cluster.json").read_text())["nodes"]
    logs = [workdir.run_log(Path(node["workdir"]), run) for node in nodes]
    deadline = time.monotonic() + within_s
    while not any(_CRASHED.search(log.read_text(errors="replace")) for log in logs if log.is_file()):
        assert time.monotonic() < deadline, f"no worker of {run} crashed on the fault within {within_s} s"
        time.sleep(0.2)


def _runbook(cli: Cli, name: str) -> Path:
    return cli.cwd / "handover" / "multi" / "runbooks" / f"{name}.md"


def _nodes(cli: Cli) -> NodeControl:
    return providers.control(ClusterState("multi", cli.home / "multi"))


def test_node_failure_runbook_brings_a_killed_node_back_over_ssh_and_the_run_trains_on_both_again(
    cluster: Cli,
) -> None:
    name = "lost"
    store = start(cluster, RUN.format(name=name, min_nodes=2), cluster="multi", first_commit=10)
    nodes = _nodes(cluster)
    fault_time = time.time()
    nodes.kill_node("node-1", name)  # as `infractl drill kill-node` does (which refuses below nodes.min)
    assert nodes.wait_gone(node="node-1", run=name, timeout=30) == []
    # The node died as a machine does: nothing is left in its namespace but its sshd, which stays so
    # that the node can be reached again (the session of the listing above ends within moments).
    node = json.loads((cluster.home / "multi" / "cluster.json").read_text())["nodes"][1]
    listener = (Path(node["ssh"]["known_hosts"]).parent / "sshd.pid").read_text().strip()
    deadline = time.monotonic() + 10
    namespace = f"infractl-{ClusterState('multi', cluster.home / 'multi').short_id}-1"
    while (left := _namespace_pids(namespace)) != [listener] and time.monotonic() < deadline:
        time.sleep(0.1)
    shown = subprocess.run(["ps", "-o", "pid,args", "-p", ",".join(left)], text=True, capture_output=True)
    assert left == [listener], shown.stdout
    committed = runstore.latest_committed_step(store, name)
    assert committed is not None
    cluster("bundle", "--run", name, "-c", "multi")
    runbook = _runbook(cluster, "node-failure")
    assert_symptoms(cluster, runbook, name, cluster="multi", status={"nodes[node-1].live_processes": 0})
    transcript = run_blocks(cluster, runbook)
    assert f"node 'node-1' is joining run '{name}'" in transcript, transcript  # the runbook's `infractl rejoin`
    assert f"run {name} recovered: " in transcript, transcript
    assert_resumed_from(store, name, fault_time=fault_time, committed=committed, first_commit=10)


def test_connection_loss_runbook_after_a_partition_of_node_0_and_the_run_trains_on_both_again(cluster: Cli) -> None:
    """node-0's link goes down (rank 0's node: node-1 goes on alone, as rank 0); once it is back the
    runbook's health gate passes and node-0's agent, which outlived the cut, rejoins by itself."""
    name = "cut"
    store = start(cluster, RUN.format(name=name, min_nodes=1), cluster="multi", first_commit=10)
    cluster("bundle", "--run", name, "-c", "multi")  # before the cut: then the status waits on no SSH timeout
    nodes = _nodes(cluster)
    fault_time = time.time()
    nodes.cut_link("node-0", "down")  # as `infractl drill partition --node node-0 --kind down` does
    try:
        # node-1 alone commits only after its restart (the rendezvous drops node-0 after 3 missed
        # keep-alives of 1 s, then it trains 10 steps).
        _wait_for_a_crash(cluster, name, within_s=60)
        committed = runstore.latest_committed_step(store, name)
        assert committed is not None
        wait_for_world(store, name, size=1, since=fault_time, timeout=60)
        assert_symptoms(
            cluster,
            _runbook(cluster, "connection-loss"),
            name,
            cluster="multi",
            logs=["peer_lost", "rank_joined"],
            status={
                "runs[].world_size": 1,
                "nodes[node-0].live_processes": None,
                "runs[].attention": {
                    "condition": "degraded",
                    "why": "running on 1 of 2 nodes; node-0 unreachable",
                    "runbook": "connection-loss",
                    "section": f"run-{name}",
                    "path": f"{_runbook(cluster, 'connection-loss')}#run-{name}",
                },
            },
            within_s=30,
        )
    finally:
        nodes.restore_link("node-0", "down")  # the network is repaired
    transcript = run_blocks(cluster, _runbook(cluster, "connection-loss"))
    assert "health: node-0: all_reduce over 2 node(s)" in transcript, transcript
    assert f"run {name} recovered: " in transcript, transcript
    assert_resumed_from(store, name, fault_time=fault_time, committed=committed, first_commit=10)


def test_store_outage_runbook_waits_for_the_store_and_the_run_trains_on_without_a_restart(cluster: Cli) -> None:
    name = "outage"
    store = start(cluster, RUN.format(name=name, min_nodes=2), cluster="multi", first_commit=10)
    cluster("bundle", "--run", name, "-c", "multi")  # before the outage: the bundle is made from the store
    fault_time = store_outage_runbook(cluster, name, cluster="multi", seconds=30)
    # Training went on through the outage on both nodes, without a restart, and commits again.
    after = [r for r in runstore.read_metrics(store, name) if r["time"] > fault_time]
    assert after and not any(runstore.starts_a_process(r) for r in after)
    assert {r["world_size"] for r in after} == {2}
    assert wait_for_commit(store, name, at_least=after[-1]["step"], timeout=60) >= after[-1]["step"]


def test_hung_job_runbook_confirms_the_hang_the_watchdog_cleared_and_the_run_trains_on_both_again(
    cluster: Cli,
) -> None:
    name = "stuck"
    store = start(cluster, hung_job_run(RUN.format(name=name, min_nodes=2)), cluster="multi", first_commit=10)
    cluster("bundle", "--run", name, "-c", "multi")
    nodes = _nodes(cluster)
    fault_time = time.time()
    # As `infractl drill hang-node --node node-1` does: node-1's workers stop, its agent runs on.
    stopped = recovery.workers(nodes.processes(node="node-1", run=name))
    assert stopped
    nodes.signal(stopped, signal.SIGSTOP)
    _wait_for_a_crash(cluster, name, within_s=HUNG_JOB_WITHIN_S)  # node-0's, the stopped rank's peer
    committed = runstore.latest_committed_step(store, name)
    assert committed is not None
    assert_symptoms(
        cluster,
        _runbook(cluster, "hung-job"),
        name,
        cluster="multi",
        logs=HUNG_JOB_LOGS,
        within_s=HUNG_JOB_WITHIN_S,
    )
    transcript = run_blocks(cluster, _runbook(cluster, "hung-job"))
    assert f"run {name} recovered: " in transcript, transcript
    assert_resumed_from(store, name, fault_time=fault_time, committed=committed, first_commit=10)


@pytest.mark.parametrize("how", ["not root", "no namespaces"])
def test_up_refuses_in_one_line_and_changes_nothing(how: str) -> None:
    # A directory every user may enter (pytest's own are root's alone).
    with tempfile.TemporaryDirectory(prefix="infractl-refused-") as scratch:
        cwd = Path(scratch)
        cwd.chmod(0o777)
        write(cwd / "cluster.yaml", CLUSTER).chmod(0o644)
        setpriv = (
            ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
            if how == "not root"
            else ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin"]
        )
        result = subprocess.run(
            [*setpriv, sys.executable, "-m", "infractl", "up", "-c", "cluster.yaml"],
            cwd=cwd,
            env=Cli(cwd).env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2, result
        line = one_line(result.stderr)
        expected = "needs root" if how == "not root" else "cannot create network namespaces"
        assert line.startswith("error: provider: provider netns") and expected in line, line
        assert sorted(p.name for p in cwd.iterdir()) == ["cluster.yaml"]
        # None of its namespaces (the other tests' clusters may come and go meanwhile).
        refused = ClusterState("multi", cwd / ".infractl" / "multi")
        assert [n for n in _namespaces() if n.startswith(f"infractl-{refused.short_id}-")] == []
