"""``infractl gc``: what no cluster owns any more, planted here one of each kind, is listed without
being touched, then removed with --yes; what a started cluster owns, and a process that only looks
like an orphan (another user's, or another program's), is never listed. In a cloud
account (``--account``, on moto): the clusters whose Terraform state is gone, and no other."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from infractl import gc, proc, providers, servers
from infractl.config import load_cluster, parse_cluster
from infractl.providers.servers import free_port, port_open
from infractl.statedir import ClusterIntent, ClusterState, ledger, started_clusters

from conftest import REPO, Cli, new_bucket_name, s3_client, write

# gc --yes tears down every `up` on this machine that never finished: the other tests that leave
# one for a moment (an `up` killed on purpose, torn down right after: tests/test_interrupted.py,
# tests/test_aws_emulated.py) share this group's worker.
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("aws-emulated")]

_SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
_SSHD = "/usr/sbin/sshd"
_NOBODY = 65534


def _free_id() -> str:
    """A short_id no started cluster has."""
    owned = {state.short_id for state in started_clusters()}
    while (found := secrets.token_hex(3)) in owned:
        continue
    return found


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "-json", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {entry["name"] for entry in json.loads(listed or "[]")}


def _links() -> set[str]:
    listed = subprocess.run(["ip", "-json", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {entry["ifname"] for entry in json.loads(listed)}


def _sshd(state_dir: Path, keys: Path, *, user: int | None = None) -> subprocess.Popen[bytes]:
    """A real sshd (as root, or as ``user``) listening on loopback with its config where a netns
    node's is (``<state_dir>/ssh/nodes/node-0/sshd_config``), which ``gc`` matches it by; its host
    key in ``keys``. Returned once it listens."""
    config = state_dir / "ssh" / "nodes" / "node-0" / "sshd_config"
    config.parent.mkdir(parents=True)
    keys.mkdir(exist_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "host")], check=True)
    port = free_port("127.0.0.1")
    config.write_text(f"ListenAddress 127.0.0.1:{port}\nHostKey {keys / 'host'}\nPidFile none\n")
    if user is not None:  # its config readable by it, its host key its own
        subprocess.run(["chmod", "-R", "a+rX", str(state_dir), str(keys)], check=True)
        (keys / "host").chmod(0o600)
        os.chown(keys / "host", user, user)
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege-separation directory
    sshd = subprocess.Popen(
        [_SSHD, "-D", "-f", str(config)],
        stderr=subprocess.DEVNULL,
        user=user,
        group=user,
        extra_groups=None if user is None else [],
    )
    deadline = time.monotonic() + 10
    while not port_open("127.0.0.1", port):
        assert sshd.poll() is None and time.monotonic() < deadline, "the planted sshd did not start"
        time.sleep(0.1)
    return sshd


def _mounted(below: Path) -> list[str]:
    with open("/proc/self/mountinfo") as mounts:
        return [line.split()[4] for line in mounts if line.split()[4].startswith(f"{below}/")]


@pytest.fixture
def planted(tmp_path: Path) -> Iterator[dict[str, object]]:
    """One orphan of each kind gc removes, named after an id no cluster has (or the marker of a
    state directory that is gone), and one group a started cluster owns. Whatever a failed test
    leaves is removed after it."""
    orphan, gone = _free_id(), tmp_path / "deleted-state"
    owner = ClusterState("owner", tmp_path / "owner")  # a cluster that is up
    owner.start(ClusterIntent(name="owner", spec=parse_cluster({"name": "owner"}), store=owner.default_store.as_uri()))
    owner.record_path.write_text("{}")
    namespace, bridge, veth = f"infractl-{orphan}-0", f"ixb{orphan}", f"ixv{orphan}-1"
    groups = {"orphan": f"gcplant-{orphan}-viewer", "owned": f"gcowned-{owner.short_id}-viewer"}
    runroot = Path("/run/infractl") / f"{orphan}-node-0"
    for group in groups.values():
        subprocess.run(["groupadd", group], check=True)
    _ip("netns", "add", namespace)
    _ip("link", "add", bridge, "type", "bridge")
    _ip("link", "add", veth, "type", "veth", "peer", "name", f"gcp{orphan}")
    # The bridge's guard (infra/netns): a chain, and INPUT's jump to it.
    guard = f"ixg{orphan}"
    subprocess.run(["iptables", "-w", "-N", guard], check=True)
    subprocess.run(["iptables", "-w", "-I", "INPUT", "1", "-i", bridge, "-j", guard], check=True)
    (runroot / "overlay").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(runroot / "overlay")], check=True)
    # Another user's state directory, which that user can read (/tmp/pytest-of-root cannot be).
    theirs = Path(tempfile.mkdtemp(prefix="infractl-gc-theirs-"))
    theirs.chmod(0o755)
    processes = {
        "in namespace": subprocess.Popen(["ip", "netns", "exec", namespace, *_SLEEP]),
        "marked": subprocess.Popen(_SLEEP, env={**os.environ, proc.CLUSTER_ENV: str(gone)}),
        "sshd": _sshd(gone, tmp_path / "keys"),
    }
    # What only looks like them: the marker, or an sshd's config path, in a process of another
    # user (nobody's), or of another program. gc must never list or kill one.
    lookalikes = {
        # The same Python, become nobody (who could not start it: it lives under /root here).
        "marked, another user's": subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import os, time; os.setgroups([]); os.setgid({_NOBODY}); os.setuid({_NOBODY}); time.sleep(600)",
            ],
            env={**os.environ, proc.CLUSTER_ENV: str(gone)},
        ),  # fmt: skip
        "marked, another program": subprocess.Popen(["sleep", "600"], env={**os.environ, proc.CLUSTER_ENV: str(gone)}),
        "sshd, another user's": _sshd(theirs / "state", theirs / "keys", user=_NOBODY),
        "sshd, another program": subprocess.Popen([*_SLEEP, "-f", f"{gone}/ssh/nodes/node-1/sshd_config"]),
    }
    # Every state directory named in them is gone now, as after an `rm -rf` without a teardown.
    shutil.rmtree(gone)
    shutil.rmtree(theirs)
    yield {
        "gone": gone,
        "owner": owner,
        "groups": groups,
        "namespace": namespace,
        "links": {bridge, veth},
        "guard": guard,
        "runroot": runroot,
        "processes": processes,
        "lookalikes": lookalikes,
    }
    for process in [*processes.values(), *lookalikes.values()]:
        process.kill()
        process.wait()
    for group in groups.values():
        subprocess.run(["groupdel", group], capture_output=True)
    subprocess.run(["iptables", "-w", "-D", "INPUT", "-i", bridge, "-j", guard], capture_output=True)
    subprocess.run(["iptables", "-w", "-X", guard], capture_output=True)
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
    for link in (bridge, veth):
        subprocess.run(["ip", "link", "del", link], capture_output=True)
    for point in _mounted(runroot):
        subprocess.run(["umount", "-l", point], capture_output=True)
    subprocess.run(["rm", "-rf", str(runroot)], check=True)
    owner.unlist()


def test_gc_lists_then_removes_an_orphan_of_each_kind_and_keeps_what_a_cluster_owns(
    cli: Cli, planted: dict[str, object]
) -> None:
    # An `up` that never got further than its intent (killed right after): gc tears it down.
    config = write(cli.cwd / "cluster.yaml", "name: halfway\nprovider: local\nnodes: 1\n")
    halfway = ClusterState("halfway", cli.home / "halfway")
    spec = load_cluster(config)
    halfway.start(ClusterIntent(name="halfway", spec=spec, store=halfway.default_store.as_uri()))
    processes: dict[str, subprocess.Popen[bytes]] = planted["processes"]  # type: ignore[assignment]
    lookalikes: dict[str, subprocess.Popen[bytes]] = planted["lookalikes"]  # type: ignore[assignment]
    groups: dict[str, str] = planted["groups"]  # type: ignore[assignment]
    runroot: Path = planted["runroot"]  # type: ignore[assignment]
    expected = {
        ("process", f"{processes['marked'].pid} of {planted['gone']}"),
        ("network namespace", planted["namespace"]),
        *(("interface", link) for link in planted["links"]),  # type: ignore[attr-defined]
        ("container run root", str(runroot)),
        ("iptables chain", planted["guard"]),
        ("sshd process", str(processes["sshd"].pid)),
        ("group", groups["orphan"]),
    }

    listed = json.loads(cli("gc", "--json").stdout)

    found = {(o["kind"], o["name"]) for o in listed["orphans"]}
    assert expected <= found, listed
    named = " ".join(o["name"] for o in listed["orphans"])
    assert not [what for what, p in lookalikes.items() if re.search(rf"\b{p.pid}\b", named)], listed
    assert not any(groups["owned"] == o["name"] for o in listed["orphans"]), listed
    assert {"name": "halfway", "dir": str(halfway.dir.resolve())} in listed["interrupted"]
    # Listed, not touched.
    assert listed["removed"] is False and halfway.dir.is_dir() and proc.group_exists(groups["orphan"])
    assert planted["namespace"] in _namespaces() and all(p.poll() is None for p in processes.values())

    removed = json.loads(cli("gc", "--yes", "--json").stdout)

    assert removed["removed"] is True and removed["failed"] == [], removed
    assert not halfway.dir.exists() and not (ledger() / f"{halfway.short_id}.json").exists()
    for process in processes.values():
        assert process.wait(timeout=30) != 0
    assert [what for what, process in lookalikes.items() if process.poll() is not None] == []
    assert not proc.group_exists(groups["orphan"]) and proc.group_exists(groups["owned"])
    assert planted["namespace"] not in _namespaces()
    assert not planted["links"] & _links()  # type: ignore[operator]
    assert not runroot.exists() and _mounted(runroot) == []
    chains = subprocess.run(["iptables", "-w", "-S"], capture_output=True, text=True, check=True).stdout
    assert f"-N {planted['guard']}" not in chains.splitlines() and f"-j {planted['guard']}" not in chains
    again = json.loads(cli("gc", "--json").stdout)
    assert not expected & {(o["kind"], o["name"]) for o in again["orphans"]}, again


def test_a_state_directory_deleted_in_part_leaves_its_rendezvous_server_an_orphan(tmp_path: Path) -> None:
    """The state files of a cluster deleted, ``nodes/`` left (running agents still write it): the
    rendezvous server ``up`` started for it belongs to no cluster, and gc lists it and removes it.
    The ledger lists the directory, as ``up`` does: processes that name a directory no ``up``
    started (a test's own torchrun, say) are not judged by what it holds."""
    state = ClusterState("partial", tmp_path / "partial")
    state.dir.mkdir()
    state.intent_path.write_text("{}")
    state.record_path.write_text("{}")
    write(ledger() / f"{state.short_id}.json", json.dumps({"name": state.name, "dir": str(state.dir.resolve())}))
    _, started = servers.ensure_rendezvous(providers.get("local").servers(state), "127.0.0.1", None, None)
    server = proc.find(state.dir, node=servers.RENDEZVOUS_NODE)
    try:
        assert started and len(server) == 1, server
        name = f"{server[0].pid} of {state.dir}"
        assert name not in [o.name for o in gc.find().orphans], "a cluster's server while its state is there"
        (state.dir / "nodes" / "node-0").mkdir(parents=True)
        state.intent_path.unlink()
        state.record_path.unlink()

        orphans = [o for o in gc.find().orphans if o.name == name]

        assert [o.kind for o in orphans] == ["process"]
        orphans[0].remove()
        server[0].wait(timeout=30)
        assert proc.find(state.dir) == []
    finally:
        proc.kill(server)
        state.unlist()


def test_account_gc_takes_the_aws_clusters_whose_state_is_gone_and_no_other(tmp_path: Path, s3_server: str) -> None:
    """On moto: a VPC tagged for each of three clusters: ``lost`` (no Terraform state in the state
    bucket), ``kept`` (its state is there: a controller somewhere manages it) and ``making`` (only
    the state's lock: an `up` is applying now). gc --account lists and removes ``lost`` alone."""
    import boto3
    import yaml

    from infractl.providers.aws.sweep import CLUSTER_TAG

    bucket = new_bucket_name()
    s3 = s3_client(s3_server)
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="infractl/kept/terraform.tfstate", Body=b"{}")
    s3.put_object(Bucket=bucket, Key="infractl/making/terraform.tfstate.tflock", Body=b"{}")
    config = yaml.safe_load((REPO / "examples" / "aws" / "cluster.yaml").read_text())
    config["aws"] |= {"state_bucket": bucket, "endpoint_url": s3_server, "region": "us-east-1"}
    account = write(tmp_path / "account.yaml", yaml.safe_dump(config))
    ec2 = boto3.client("ec2", endpoint_url=s3_server, region_name="us-east-1")
    vpcs = {
        name: ec2.create_vpc(
            CidrBlock=f"10.{97 - i}.0.0/16",
            TagSpecifications=[{"ResourceType": "vpc", "Tags": [{"Key": CLUSTER_TAG, "Value": name}]}],
        )["Vpc"]["VpcId"]
        for i, name in enumerate(("lost", "kept", "making"))
    }
    cli = Cli(tmp_path)

    listed = json.loads(cli("gc", "--account", str(account), "--json").stdout)
    ours = [o for o in listed["orphans"] if o["kind"] == "aws cluster"]
    assert [o["name"] for o in ours] == [f"lost in us-east-1 (no Terraform state): vpc {vpcs['lost']}"], listed
    assert {v["VpcId"] for v in ec2.describe_vpcs(VpcIds=list(vpcs.values()))["Vpcs"]} == set(vpcs.values())

    cli("gc", "--account", str(account), "--yes")
    left = {v["VpcId"] for v in ec2.describe_vpcs()["Vpcs"]}
    assert vpcs["lost"] not in left and {vpcs["kept"], vpcs["making"]} <= left
    again = json.loads(cli("gc", "--account", str(account), "--json").stdout)
    assert [o for o in again["orphans"] if o["kind"] == "aws cluster"] == []
