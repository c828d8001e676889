"""The cluster trusts only what it keyed (SECURITY.md), attacked on a real 2-node netns cluster:
from an intruder, a network namespace on the cluster's bridge that is not a node (root on a
machine of its own), and from role users (a viewer and an operator) logged in on a node, as a
process of theirs in the node's network namespace.

- A replica planted from the network (a manifest for a future step, files whose sha256 is right,
  no key or a forged signature) is refused and logged with its sender; reads need the key too;
  after a node is killed the run resumes from a step it trained itself.
- A role user reaches neither the rendezvous endpoint nor a replica server, reads the logs and
  nothing root or the trainer keeps, writes nowhere on the node.
- Tokens in train's environment reach no node process and no node file unless the run.yaml's
  `env:` names them; no file a role user can read, and no file of the bundle, holds a private key
  or a planted secret; each node presents a host key of its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from test_access import _throwaway_users

from infractl import proc, runstore, workdir
from infractl.runstore import Manifest, ManifestEntry
from infractl.statedir import ClusterState
from infractl.store import FileStore
from trainer.replica_server import REPLICA_ADDR_ENV, SHA256_HEADER, SIGNATURE_HEADER

from conftest import Cli, module_cluster, stop_runs, wait_for_commit, wait_for_world, write

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("security")]

CLUSTER = """\
name: guard
provider: netns
nodes: 2
"""
# A replica every 2 steps, a commit every 20: after the kill the run resumes from memory or from
# the store, from a step it trained either way. Paced: it trains until the test stops it.
RUN = """\
name: {name}
model: {{layers: 2, hidden: 64, heads: 2, seq_len: 64}}
data: {{max_bytes: 200000}}
batch_size: 8
steps: 100000
min_step_s: 0.2
checkpoint: {{every: 20, keep: 2, replicate_every: 2}}
nodes: {{min: 1, max: 2}}
max_restarts: 3
watchdog: {{step_timeout_s: 8}}
env: [SECURITY_PROBE]
"""
#: The step a forged replica claims: newer than anything the run will train.
FORGED_STEP = 10**9
#: The intruder's address on the bridge: in the cluster's /24, no node's.
INTRUDER_HOST = 200

# Run in a namespace by root or a role user: what a TCP connection to HOST PORT does.
_CONNECT = """\
import socket, sys
s = socket.socket()
s.settimeout(5)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("open")
except OSError as exc:
    print(type(exc).__name__)
"""
# Run in the intruder's namespace: one HTTP request (JSON: method, host, port, path, body, headers);
# prints the status.
_REQUEST = """\
import http.client, json, sys
method, host, port, path, body, headers = json.loads(sys.argv[1])
connection = http.client.HTTPConnection(host, port, timeout=10)
connection.request(method, path, body=None if body is None else body.encode(), headers=headers)
print(connection.getresponse().status)
"""


@dataclass(frozen=True)
class Guarded:
    """The module's cluster, its role users (each granted its role), and the intruder."""

    cli: Cli
    viewer: str
    operator: str
    intruder: str  # the intruder's network namespace
    intruder_address: str

    @property
    def state(self) -> ClusterState:
        return ClusterState("guard", self.cli.home / "guard")

    @property
    def record(self) -> dict[str, object]:
        return self.state.read()

    def node(self, name: str) -> dict[str, str]:
        return next(n for n in self.state.read()["nodes"] if n["name"] == name)

    def as_user(self, user: str, node: str, *argv: str) -> subprocess.CompletedProcess[str]:
        """``argv`` run by ``user`` on ``node``: in its network namespace, as that user."""
        namespace = f"infractl-{self.state.short_id}-{node.rpartition('-')[2]}"  # as infra/netns names it
        command = ["nsenter", f"--net=/run/netns/{namespace}", "runuser", "-u", user, "--", *argv]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    def connect(self, user: str, node: str, address: str) -> str:
        """What ``user`` on ``node`` gets connecting to ``address`` (host:port): open, or the error."""
        host, _, port = address.rpartition(":")
        done = self.as_user(user, node, "/usr/bin/python3", "-c", _CONNECT, host, port)
        return done.stdout.strip() or done.stderr.strip()

    def intruder_connect(self, address: str) -> str:
        """What the intruder (root on its own host) gets connecting to ``address`` (host:port)."""
        host, _, port = address.rpartition(":")
        argv = ["nsenter", f"--net=/run/netns/{self.intruder}", sys.executable, "-c", _CONNECT, host, port]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip()

    def request(self, method: str, address: str, path: str, *, body: str | None = None, headers: dict[str, str]) -> int:
        """The status the intruder gets for one HTTP request to ``address``."""
        host, _, port = address.rpartition(":")
        payload = json.dumps([method, host, int(port), path, body, headers])
        argv = ["nsenter", f"--net=/run/netns/{self.intruder}", sys.executable, "-c", _REQUEST, payload]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return int(done.stdout.strip())


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    # Role users must reach the nodes' directories through the directories above, as on a real
    # machine: pytest's temporary directories are private to root.
    cwd = Path(tempfile.mkdtemp(prefix="infractl-security-"))
    cwd.chmod(0o711)
    try:
        with module_cluster(tmp_path_factory, "security", cwd=cwd, cluster_yaml=CLUSTER) as cli:
            state = ClusterState("guard", cli.home / "guard")
            with _throwaway_users("viewer", "operator") as (viewer, operator), _intruder(state) as (name, address):
                cli("access", "grant", viewer, "viewer", "-c", "guard")
                cli("access", "grant", operator, "operator", "-c", "guard")
                members = json.loads(cli("access", "list", "-c", "guard", "--json").stdout)["roles"]
                assert (members["viewer"]["members"], members["operator"]["members"]) == ([viewer], [operator])
                yield Guarded(cli, viewer, operator, name, address)
                stop_runs(state.dir)
    finally:
        shutil.rmtree(cwd)


@pytest.fixture(scope="module")
def probe() -> dict[str, str]:
    """What train's environment holds: two tokens the run.yaml does not pass, one it does."""
    return {
        "HF_TOKEN": f"hf_{secrets.token_hex(12)}",
        "GITHUB_TOKEN": f"ghp_{secrets.token_hex(12)}",
        "SECURITY_PROBE": f"probe-{secrets.token_hex(12)}",
    }


@pytest.fixture(scope="module")
def running(guarded: Guarded, probe: dict[str, str]) -> str:
    """The module's run, training on both nodes with a commit in the store."""
    run_file = write(guarded.cli.cwd / "secure.yaml", RUN.format(name="secure"))
    guarded.cli("train", str(run_file), "-c", "guard", "--detach", env=probe)
    wait_for_commit(FileStore(guarded.state.dir / "store"), "secure", at_least=20, timeout=300)
    return "secure"


@contextlib.contextmanager
def _intruder(state: ClusterState) -> Iterator[tuple[str, str]]:
    """A network namespace of the intruder's, plugged into the cluster's bridge at .200."""
    short_id = state.short_id
    namespace, veth = f"ixintruder-{short_id}", f"ixi{short_id}"
    gateway = state.read()["rendezvous"]["host"]
    address = f"{gateway.rpartition('.')[0]}.{INTRUDER_HOST}"
    steps = [
        ["ip", "netns", "add", namespace],
        ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace],
        ["ip", "link", "set", veth, "master", f"ixb{short_id}", "up"],
        ["ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0"],
        ["ip", "-n", namespace, "link", "set", "eth0", "up"],
        ["ip", "-n", namespace, "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True)
        yield namespace, address
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", veth], capture_output=True)


def _replica_servers(guarded: Guarded, run: str) -> dict[str, str]:
    """node -> the address of its agent's replica server (a worker's environment names it)."""
    found = {}
    for node in ("node-0", "node-1"):
        worker = next(p for p in proc.listing(guarded.state.dir, node=node, run=run) if not p.agent)
        found[node] = psutil.Process(worker.pid).environ()[REPLICA_ADDR_ENV]
    return found


def _sha(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def test_a_replica_planted_from_the_cluster_network_is_refused_and_the_run_resumes_from_its_own_step(
    guarded: Guarded, running: str, probe: dict[str, str]
) -> None:
    servers = _replica_servers(guarded, running)
    payload = "a pickle that would run code"
    forged = (
        Manifest(
            step=FORGED_STEP,
            world_size=2,
            files=[ManifestEntry(key="rank-0", size=len(payload), sha256=_sha(payload))],
            extra={"reason": "replica"},
        )
        .to_json()
        .decode()
    )
    for address in servers.values():
        file_path = f"/steps/{FORGED_STEP}/files/rank-0?copy=own"
        assert guarded.request("PUT", address, file_path, body=payload, headers={SHA256_HEADER: _sha(payload)}) == 403
        signed = {SHA256_HEADER: _sha(payload), SIGNATURE_HEADER: secrets.token_hex(32)}
        assert guarded.request("PUT", address, file_path, body=payload, headers=signed) == 403
        manifest_path = f"/steps/{FORGED_STEP}/manifest"
        assert guarded.request("PUT", address, manifest_path, body=forged, headers={SIGNATURE_HEADER: "0" * 64}) == 403
        # Reads need the key too: neither the index nor the weights are served to the intruder.
        assert guarded.request("GET", address, "/index", headers={}) == 403
        assert guarded.request("GET", address, "/steps/2/files/rank-0", headers={}) == 403
    # The control plane's own host takes nothing from an address that is not a node's: the
    # rendezvous store (which torch unpickles) is out of the intruder's reach.
    record = guarded.record
    rendezvous = f"{record['rendezvous']['host']}:{record['rendezvous']['port']}"  # type: ignore[index]
    assert guarded.intruder_connect(rendezvous) == "ConnectionRefusedError"
    for node in ("node-0", "node-1"):
        log = Path(guarded.node(node)["workdir"]) / workdir.LOGS / f"{running}.log"
        refused = [line for line in log.read_text().splitlines() if "replica_refused" in line]
        assert len(refused) == 5 and all(f"sender={guarded.intruder_address}:" in line for line in refused), refused

    result = json.loads(
        guarded.cli(
            "drill", "kill-node", "--node", "node-1", "-c", "guard", "--no-wait", "--json", "--timeout", "240"
        ).stdout
    )
    assert result["outcome"] == "recovered" and result["resumed_correctly"], result
    assert result["resumed_from"] in ("replica", "store"), result
    # From the newest step the run's own ranks replicated or committed (the replica's metrics
    # records reach the store at the resume): one it trained, never the forged one.
    assert result["last_committed_step"] <= result["resumed_from_step"] < FORGED_STEP, result
    trained = {r["step"] for r in runstore.read_metrics(FileStore(guarded.state.dir / "store"), running)}
    assert result["resumed_from_step"] in trained, result
    # Nothing but the refusals ever spoke of the forged step: no index listed it, no rank fetched it.
    survivor = (Path(guarded.node("node-0")["workdir"]) / workdir.LOGS / f"{running}.log").read_text()
    assert [line for line in survivor.splitlines() if str(FORGED_STEP) in line and "replica_refused" not in line] == []
    rejoined = time.time()
    guarded.cli("rejoin", "node-1", "-c", "guard", env=probe)  # the run.yaml's env: must be set again
    wait_for_world(FileStore(guarded.state.dir / "store"), running, size=2, since=rejoined, timeout=240)


def test_a_role_user_on_a_node_reaches_no_cluster_port_and_nothing_root_keeps(guarded: Guarded, running: str) -> None:
    record = guarded.record
    rendezvous = f"{record['rendezvous']['host']}:{record['rendezvous']['port']}"  # type: ignore[index]
    servers = _replica_servers(guarded, running)
    home = Path(guarded.node("node-0")["workdir"])
    private = workdir.run_private(home, running)
    for user in (guarded.viewer, guarded.operator):
        for address in (rendezvous, servers["node-0"], servers["node-1"]):
            assert guarded.connect(user, "node-0", address) == "ConnectionRefusedError", (user, address)
        # SSH to another node is not a cluster port.
        assert guarded.connect(user, "node-0", f"{guarded.node('node-1')['address']}:22") == "open"
        # The role's own: the logs, read-only.
        assert guarded.as_user(user, "node-0", "cat", str(home / workdir.LOGS / f"{running}.log")).returncode == 0
        for path in (home, home / workdir.LOGS, home / workdir.PRIVATE, home / workdir.WORK, private):
            assert guarded.as_user(user, "node-0", "test", "-w", str(path)).returncode != 0, (user, path)
        for path in (private / "run.key", private / "spec.json", workdir.network_env(home)):
            assert path.is_file()
            assert guarded.as_user(user, "node-0", "cat", str(path)).returncode != 0, (user, path)
        for path in (home / workdir.PRIVATE, home / workdir.WORK):
            assert guarded.as_user(user, "node-0", "ls", str(path)).returncode != 0, (user, path)
        assert guarded.as_user(user, "node-0", "touch", str(home / workdir.LOGS / "planted")).returncode != 0
    # The same connections from root on the node (its agents) go through.
    assert guarded.connect("root", "node-0", servers["node-1"]) == "open"
    assert guarded.connect("root", "node-0", rendezvous) == "open"
    # The agent's environment file was read and removed at its start.
    assert not (private / "agent.env").exists()


def test_tokens_stay_in_trains_shell_unless_the_run_passes_them_and_no_secret_is_readable(
    guarded: Guarded, running: str, probe: dict[str, str], tmp_path: Path
) -> None:
    withheld = [probe["HF_TOKEN"], probe["GITHUB_TOKEN"]]
    processes = proc.find(guarded.state.dir, run=running)
    assert processes
    for process in processes:
        environ = process.environ()
        assert environ.get("SECURITY_PROBE") == probe["SECURITY_PROBE"], process
        assert not [v for v in environ.values() if any(secret in v for secret in withheld)], process
    grep = ["grep", "-rIl", "-e", "PRIVATE KEY", *(arg for secret in withheld for arg in ("-e", secret))]
    # As root: no file of the nodes (the whole cluster's state, where the nodes' directories live)
    # holds a withheld token.
    tokens = ["grep", "-rIl", *(arg for secret in withheld for arg in ("-e", secret)), str(guarded.state.dir)]
    assert subprocess.run(tokens, capture_output=True, text=True).stdout == ""
    # As each role user: no file they can read holds a private key or a token.
    for user in (guarded.viewer, guarded.operator):
        found = guarded.as_user(user, "node-0", *grep, str(guarded.cli.cwd))
        assert found.stdout == "", (user, found.stdout)
        assert "Permission denied" in found.stderr  # it did meet what it may not read
    # The bundle: nothing of it holds a private key or a token, wherever it was written.
    out = tmp_path / "handover"
    guarded.cli("bundle", "-c", "guard", "--out", str(out))
    assert subprocess.run([*grep, str(out)], capture_output=True, text=True).stdout == ""
    # Each node presents a host key of its own, the one pinned for it.
    keys = {}
    for node in ("node-0", "node-1"):
        address = guarded.node(node)["address"]
        scan = ["nsenter", f"--net=/run/netns/{guarded.intruder}", "ssh-keyscan", "-t", "ed25519", address]
        presented = subprocess.run(scan, capture_output=True, text=True, timeout=60).stdout.split()
        pinned = (guarded.state.dir / "ssh" / "nodes" / node / "known_hosts").read_text().split()
        assert presented[1:3] == pinned[1:3], (node, presented, pinned)
        keys[node] = presented[2]
    assert keys["node-0"] != keys["node-1"]
