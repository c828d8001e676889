"""``provider: ssh`` on a team's existing machines (tests/labhosts.py: namespaces made the way a
team's servers are, with a non-root login that has password-less sudo, host keys of their own, and
a process and files of the team's). infractl is given addresses, a user, a key and the known_hosts
file that ``infractl keyscan`` wrote once confirmed.

One lab for the module: a host with a key other than the pinned one, a login without sudo and an
address nobody answers make ``up`` refuse before anything changes; then the cluster comes up on
two hosts with a controller host, trains the quickstart in the pinned image, recovers a killed
node, takes it back with ``rejoin``, writes its handover, and ``teardown`` leaves every host as it
was before ``up``: its processes (the team's alive), users, groups and files. A second ``up``
whose state directory is deleted while it is up is cleaned from every host by ``gc --yes``."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from labhosts import Lab, lab

from infractl import runstore
from infractl.store import FileStore

from conftest import REPO, BuiltImage, Cli, wait_for_commit, write

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("ssh")]

_SUBNET = "10.94.0.0/24"
_HOSTS = ["gpu-a", "gpu-b", "ctl"]
# What a cluster.yaml pins where no image is pulled: `up` refuses (or keyscan scans) before that.
_UNBUILT = "sha256:" + "0" * 64
RUN = """\
name: drilled
model: {layers: 2, hidden: 64, heads: 2, seq_len: 64}
data: {max_bytes: 200000}
batch_size: 8
steps: 300
checkpoint: {every: 10, keep: 2}
nodes: {min: 1, max: 2}
max_restarts: 3
watchdog: {step_timeout_s: 8}
"""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with lab(tmp_path_factory.mktemp("lab"), _SUBNET, _HOSTS) as made:
        yield made


def _cluster(made: Lab, cli: Cli, digest: str, name: str, **changes: object) -> Path:
    """A cluster.yaml of the lab's two training hosts and its controller host, a file store every
    host mounts at the same path (this machine's folders are the hosts')."""
    store = cli.cwd / "store"
    spec: dict[str, object] = {
        "name": name,
        "provider": "ssh",
        "store": store.as_uri(),
        "runtime": {"image": f"infractl/trainer@{digest}"},
        "ssh": {
            "user": "ops",
            "key": str(made.key),
            "known_hosts": "lab_known_hosts",
            "hosts": [
                {"name": "gpu-a", "address": made.hosts["gpu-a"].address},
                {"name": "gpu-b", "address": made.hosts["gpu-b"].address},
            ],
            "controller": {"address": made.hosts["ctl"].address},
        },
    }
    spec["ssh"] = {**spec["ssh"], **changes}  # type: ignore[dict-item]
    return write(cli.cwd / f"{name}.yaml", yaml.safe_dump(spec, sort_keys=False))


def _unchanged(made: Lab, before: dict[str, dict[str, object]]) -> None:
    """Every host as it was: its processes, users, groups and files of its own folders but
    infractl's. Processes are given the time Ansible's SSH connections outlive its last task
    (ControlPersist, 60 s): they end by themselves."""
    deadline = time.monotonic() + 90
    while True:
        after = {name: made.snapshot(name) for name in _HOSTS}
        if all(after[n]["processes"] == before[n]["processes"] for n in _HOSTS) or time.monotonic() > deadline:
            break
        time.sleep(1)
    for name in _HOSTS:
        assert after[name]["processes"] == before[name]["processes"], name
        changed = {
            path
            for path in set(before[name]["files"]) | set(after[name]["files"])  # type: ignore[arg-type]
            if before[name]["files"].get(path) != after[name]["files"].get(path)  # type: ignore[attr-defined]
        }
        assert changed == set(), (name, sorted(changed)[:20])
        assert made.hosts[name].team_pid in after[name]["processes"]  # type: ignore[operator]


def test_keyscan_pins_only_what_the_operator_confirms(hosts: Lab, cli: Cli) -> None:
    cluster = _cluster(hosts, cli, _UNBUILT, "lab")
    refused = cli("keyscan", "-c", str(cluster), expect=2).stderr
    assert "--yes" in refused and not (cli.cwd / "lab_known_hosts").exists()
    scanned = json.loads(cli("keyscan", "-c", str(cluster), "--yes", "--json").stdout)
    assert [k["host"] for k in scanned["keys"]] == ["gpu-a", "gpu-b", "controller"]
    assert all(k["fingerprint"].startswith("ED25519 SHA256:") for k in scanned["keys"]), scanned
    pinned = (cli.cwd / "lab_known_hosts").read_text().splitlines()
    assert pinned == [hosts.hosts[n].public_key_line() for n in _HOSTS]

    # Behind a jump host (ctl, here): its key first, then the others scanned from it; `up` then
    # reaches every host through it with the pinned keys (gpu-b's login has no sudo: refused, the
    # others checked through the jump host and found fine).
    ctl = hosts.hosts["ctl"]
    jumped = _cluster(hosts, cli, _UNBUILT, "jumped", jump={"address": ctl.address})
    scanned = json.loads(cli("keyscan", "-c", str(jumped), "--yes", "--json").stdout)
    assert [k["host"] for k in scanned["keys"]] == ["jump", "gpu-a", "gpu-b", "controller"]
    pinned = (cli.cwd / "lab_known_hosts").read_text().splitlines()
    assert pinned == [hosts.hosts[n].public_key_line() for n in ("ctl", *_HOSTS)]
    refused = _cluster(
        hosts,
        cli,
        _UNBUILT,
        "jumped",
        jump={"address": ctl.address},
        hosts=[
            {"name": "gpu-a", "address": hosts.hosts["gpu-a"].address},
            {"name": "gpu-b", "address": hosts.hosts["gpu-b"].address, "user": "guest"},
        ],
    )
    line = cli("up", "-c", str(refused), expect=2).stderr.strip()
    assert line.startswith("error: ssh.hosts: 1 problem(s) with the hosts, nothing was changed"), line
    assert "gpu-b" in line and "no password-less sudo" in line, line


def test_up_refuses_a_changed_key_a_login_without_sudo_and_an_unreachable_host_before_anything_changes(
    hosts: Lab, cli: Cli
) -> None:
    before = {name: hosts.snapshot(name) for name in _HOSTS}
    # gpu-a's address pinned with ctl's key; gpu-b logged in as guest (no sudo); gpu-c answers nobody.
    known = cli.cwd / "lab_known_hosts"
    a, b, ctl = (hosts.hosts[n] for n in _HOSTS)
    known.write_text(f"{a.address} {' '.join(ctl.public_key_line().split()[1:])}\n")
    known.write_text(known.read_text() + f"{b.public_key_line()}\n{ctl.public_key_line()}\n")
    cluster = _cluster(
        hosts,
        cli,
        _UNBUILT,
        "bad",
        hosts=[
            {"name": "gpu-a", "address": a.address},
            {"name": "gpu-b", "address": b.address, "user": "guest"},
            {"name": "gpu-c", "address": "10.94.0.99"},
        ],
    )
    line = cli("up", "-c", str(cluster), expect=2).stderr.strip()
    assert line.startswith("error: ssh.hosts: 3 problem(s) with the hosts, nothing was changed"), line
    assert f"gpu-a ({a.address}): its host key is not the one pinned in {known}" in line, line
    assert f"gpu-b ({b.address}): user guest is not root and has no password-less sudo" in line, line
    assert "gpu-c (10.94.0.99): unreachable over SSH" in line, line
    assert not (cli.home / "bad").exists()
    _unchanged(hosts, before)


def test_a_team_cluster_trains_recovers_hands_over_and_leaves_every_host_as_it_was(
    hosts: Lab, cli: Cli, cpu_image: BuiltImage
) -> None:
    before = {name: hosts.snapshot(name) for name in _HOSTS}
    hosts.known_hosts(cli.cwd / "lab_known_hosts", *_HOSTS)
    cluster = _cluster(hosts, cli, cpu_image.digest, "lab")
    store = FileStore(cli.cwd / "store")
    try:
        up = cli("up", "-c", str(cluster), timeout=900)
        assert "cluster 'lab' is up: 2 node(s)" in up.stderr, up.stderr
        cli("train", str(REPO / "examples" / "quickstart.yaml"), "-c", "lab", timeout=900)
        manifest = runstore.read_manifest(store, "quickstart", 60)
        assert manifest is not None
        # Read inside the container from what the engine says it ran, not copied from cluster.yaml.
        environment = manifest.extra["environment"]
        assert (environment["runtime"], environment["image_digest"]) == ("container", cpu_image.digest)
        record = json.loads((cli.home / "lab" / "cluster.json").read_text())
        assert environment["image"] == record["image"] and environment["interpreter"] == "/opt/venv/bin/python"
        logs = cli("logs", "-c", "lab", "--run", "quickstart", "--node", "gpu-b").stdout
        assert "checkpoint_committed" in logs and "step=60" in logs

        cli("train", str(write(cli.cwd / "drilled.yaml", RUN)), "-c", "lab", "--detach")
        wait_for_commit(store, "drilled", at_least=10, timeout=300)
        drill = json.loads(
            cli("drill", "kill-node", "-c", "lab", "--node", "gpu-b", "--no-wait", "--json", "--timeout", "400").stdout
        )
        assert drill["outcome"] == "recovered" and drill["resumed_correctly"], drill
        assert drill["world_size_after"] == 1, drill
        cli("rejoin", "gpu-b", "-c", "lab", "--run", "drilled")
        status = json.loads(cli("status", "--json", "-c", "lab").stdout)
        assert {n["name"] for n in status["nodes"]} == {"gpu-a", "gpu-b"}, status

        cli("stop", "--run", "drilled", "-c", "lab")
        cli("bundle", "-c", "lab", "--out", str(cli.cwd / "handover"))
        topology = (cli.cwd / "handover" / "topology.md").read_text()
        assert "Provider: `ssh`" in topology and "The team's own hosts" in topology, topology
        assert f"| gpu-a | {hosts.hosts['gpu-a'].address} |" in topology, topology
        # A host that does not come back is the team's to repair or replace: the runbook says how.
        runbook = (cli.cwd / "handover" / "runbooks" / "node-failure.md").read_text()
        assert "The host is the team's own machine" in runbook and "infractl keyscan" in runbook, runbook
    finally:
        cli("teardown", "-c", "lab", "--yes", timeout=600)
    _unchanged(hosts, before)

    # Up again, this time with this machine as the controller (no spare host); the state directory
    # deleted while it is up: gc finds the hosts in this machine's record and cleans each of them.
    local = _cluster(hosts, cli, cpu_image.digest, "lab", controller="local")
    up = cli("up", "-c", str(local), timeout=900).stderr
    assert "controller: local: the rendezvous endpoint and the image registry run on this machine" in up, up
    assert f"rendezvous: {hosts.gateway}:" in up, up
    shutil.rmtree(cli.home / "lab")
    found = json.loads(cli("gc", "--json").stdout)
    assert [o for o in found["orphans"] if o["kind"] == "ssh cluster"], found
    cli("gc", "--yes")
    _unchanged(hosts, before)
