"""``infractl gc``: what no cluster owns any more, planted here one of each kind, is listed without
being touched, then removed with --yes; what a started cluster owns is never listed. In a cloud
account (``--account``, on moto): the clusters whose Terraform state is gone, and no other."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from infractl import proc
from infractl.config import load_cluster
from infractl.state import ClusterState, ledger, started_clusters

from conftest import REPO, Cli, new_bucket_name, s3_client, write

# gc --yes tears down every `up` on this machine that never finished: the other tests that leave
# one for a moment (an `up` killed on purpose, torn down right after: tests/test_interrupted.py,
# tests/test_aws_emulated.py) share this group's worker.
pytestmark = pytest.mark.xdist_group("aws-emulated")

_SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


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
    owner.start({"name": "owner"})
    owner.record_path.write_text("{}")
    namespace, bridge, veth = f"infractl-{orphan}-0", f"ixb{orphan}", f"ixv{orphan}-1"
    groups = {"orphan": f"gcplant-{orphan}-viewer", "owned": f"gcowned-{owner.short_id}-viewer"}
    runroot = Path("/run/infractl") / f"{orphan}-node-0"
    for group in groups.values():
        subprocess.run(["groupadd", group], check=True)
    _ip("netns", "add", namespace)
    _ip("link", "add", bridge, "type", "bridge")
    _ip("link", "add", veth, "type", "veth", "peer", "name", f"gcp{orphan}")
    (runroot / "overlay").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(runroot / "overlay")], check=True)
    processes = {
        "in namespace": subprocess.Popen(["ip", "netns", "exec", namespace, *_SLEEP]),
        "marked": subprocess.Popen(_SLEEP, env={**os.environ, proc.CLUSTER_ENV: str(gone)}),
        "sshd": subprocess.Popen([*_SLEEP, "-f", f"{gone}/ssh/nodes/node-0/sshd_config"]),
    }
    yield {
        "gone": gone,
        "owner": owner,
        "groups": groups,
        "namespace": namespace,
        "links": {bridge, veth},
        "runroot": runroot,
        "processes": processes,
    }
    for process in processes.values():
        process.kill()
        process.wait()
    for group in groups.values():
        subprocess.run(["groupdel", group], capture_output=True)
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
    halfway.start({"name": "halfway", "spec": spec.model_dump(mode="json"), "store": f"file://{halfway.default_store}"})
    processes: dict[str, subprocess.Popen[bytes]] = planted["processes"]  # type: ignore[assignment]
    groups: dict[str, str] = planted["groups"]  # type: ignore[assignment]
    runroot: Path = planted["runroot"]  # type: ignore[assignment]
    expected = {
        ("process", f"{processes['marked'].pid} of {planted['gone']}"),
        ("network namespace", planted["namespace"]),
        *(("interface", link) for link in planted["links"]),  # type: ignore[attr-defined]
        ("container run root", str(runroot)),
        ("sshd process", str(processes["sshd"].pid)),
        ("group", groups["orphan"]),
    }

    listed = json.loads(cli("gc", "--json").stdout)

    found = {(o["kind"], o["name"]) for o in listed["orphans"]}
    assert expected <= found, listed
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
    assert not proc.group_exists(groups["orphan"]) and proc.group_exists(groups["owned"])
    assert planted["namespace"] not in _namespaces()
    assert not planted["links"] & _links()  # type: ignore[operator]
    assert not runroot.exists() and _mounted(runroot) == []
    again = json.loads(cli("gc", "--json").stdout)
    assert not expected & {(o["kind"], o["name"]) for o in again["orphans"]}, again


def test_account_gc_takes_the_aws_clusters_whose_state_is_gone_and_no_other(tmp_path: Path, s3_server: str) -> None:
    """On moto: a VPC tagged for each of three clusters: ``lost`` (no Terraform state in the state
    bucket), ``kept`` (its state is there: a controller somewhere manages it) and ``making`` (only
    the state's lock: an `up` is applying now). gc --account lists and removes ``lost`` alone."""
    import boto3
    import yaml

    from infractl.providers import aws

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
            TagSpecifications=[{"ResourceType": "vpc", "Tags": [{"Key": aws.CLUSTER_TAG, "Value": name}]}],
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
