"""One aws cluster's whole life against an emulated AWS (tests/awsemu.py), as docs/aws.md walks it:
``up`` through the real Terraform and AWS provider, the pinned image pulled by digest, training
with checkpoints in the emulated S3, recoveries from a killed node, a partition and a spot
interruption, the bundle, and ``teardown --purge`` proving nothing is left.

On an emulation of its own, in a VPC range of its own, so that it runs beside tests/test_aws_emulated.py
(the longest test of the suite: it is not queued behind that module on one worker)."""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path
from typing import Any

import pytest
from test_aws_emulated import cluster_yaml, ssh

from infractl import providers, runstore, workdir
from infractl.node import Node
from infractl.providers.aws.sweep import CLUSTER_TAG, sweep
from infractl.statedir import ClusterState
from infractl.store import open_store

from awsemu import EmulatedAws
from conftest import REPO, BuiltImage, Cli, emulation_fixture, wait_for_commit, wait_for_world, write

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("aws-e2e"), pytest.mark.usefixtures("aws_left_clean")]

#: Not tests/awsemu.py's default: that one is tests/test_aws_emulated.py's, which may run meanwhile.
VPC_CIDR = "10.76.0.0/16"


# An IMDSv2 session token from the instance's metadata service (what anything on it asks first).
_IMDS_TOKEN = (
    "import urllib.request as r; print(r.urlopen(r.Request('http://169.254.169.254/latest/api/token', method='PUT', "
    "headers={'X-aws-ec2-metadata-token-ttl-seconds': '60'}), timeout=5).read().decode())"
)


emulation = emulation_fixture("awsemu-e2e", VPC_CIDR)


#: Lives through three faults of main-1, each recovered on main-0, and is stopped below: paced, it
#: spares the CPU meanwhile. It keeps its commits: the preemption's save is read back at the end.
DRILLED_RUN = """\
name: drilled
model: {layers: 2, hidden: 64, heads: 2, seq_len: 64}
data: {max_bytes: 200000}
batch_size: 8
steps: 100000
min_step_s: 0.2
checkpoint: {every: 10, keep: 100}
nodes: {min: 1, max: 2}
max_restarts: 3
watchdog: {step_timeout_s: 8}
"""


def _plant_leaks(emulation: EmulatedAws, cluster: str) -> list[str]:
    """Make what a crashed launcher leaves behind, outside Terraform, with the cluster's tag: an
    instance, a volume, a NAT gateway and an Elastic IP (in a VPC of their own). Their ids."""
    ec2 = emulation.client("ec2")

    def tags(kind: str) -> list[dict[str, Any]]:
        return [{"ResourceType": kind, "Tags": [{"Key": CLUSTER_TAG, "Value": cluster}]}]

    vpc = ec2.create_vpc(CidrBlock="10.99.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.99.1.0/24")["Subnet"]["SubnetId"]
    instance = ec2.run_instances(
        ImageId=emulation.image_id,
        InstanceType="c7i.4xlarge",
        MinCount=1,
        MaxCount=1,
        SubnetId=subnet,
        TagSpecifications=tags("instance"),
    )["Instances"][0]["InstanceId"]
    volume = ec2.create_volume(AvailabilityZone="us-east-1a", Size=8, TagSpecifications=tags("volume"))["VolumeId"]
    address = ec2.allocate_address(Domain="vpc", TagSpecifications=tags("elastic-ip"))["AllocationId"]
    nat = ec2.create_nat_gateway(SubnetId=subnet, AllocationId=address, TagSpecifications=tags("natgateway"))
    return [instance, volume, nat["NatGateway"]["NatGatewayId"], address]


def _remove_leaks(emulation: EmulatedAws, planted: list[str]) -> None:
    instance, volume, nat, address = planted
    ec2 = emulation.client("ec2")
    ec2.terminate_instances(InstanceIds=[instance])
    ec2.delete_volume(VolumeId=volume)
    ec2.delete_nat_gateway(NatGatewayId=nat)
    ec2.release_address(AllocationId=address)


# long: one cluster's whole life on the emulated AWS, as docs/aws.md walks it (bringing it up takes minutes).
def test_a_cluster_comes_up_trains_recovers_hands_over_and_leaves_nothing(
    emulation: EmulatedAws, cpu_image: BuiltImage, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``up`` with 2 c7i nodes: the module applied by the real provider, both hosts configured over
    SSH through the controller, the pinned image pulled by digest from the cluster's registry on
    the controller, the health gate passed. The quickstart trains to its end with checkpoints in
    the emulated S3 bucket, reached with the instances' own credentials; a killed node is
    recovered from, and so is a spot interruption notice (the emergency checkpoint commits, the run
    goes on without the node); the bundle describes the aws topology. ``teardown --purge`` names leaks planted
    outside Terraform and exits 1; once they are removed, it runs again and nothing is left."""
    cli = Cli(tmp_path_factory.mktemp("e2e"))
    groups = {"main": {"instance_type": "c7i.4xlarge", "nodes": 2}}
    pinned = f"infractl/trainer@{cpu_image.digest}"
    config = cluster_yaml(
        cli.cwd, emulation.endpoint, emulation.image_id, groups, runtime_image=pinned, vpc_cidr=VPC_CIDR
    )
    name = cli.cwd.name
    up = cli("up", "-c", str(config), timeout=1200)
    record = json.loads((cli.home / name / "cluster.json").read_text())
    controller = record["rendezvous"]["host"]
    assert controller.startswith("10.76.16."), record["rendezvous"]  # the controller, in the public subnet
    assert record["image"] == f"{controller}:5000/{pinned}"
    assert f"image: {record['image']} (pushed)" in up.stderr and up.stderr.count("all_reduce over 2 node(s)") == 2
    nodes = [Node.from_record(item) for item in record["nodes"]]
    assert [n.name for n in nodes] == ["main-0", "main-1"]
    inventory = json.loads((cli.home / name / "ansible" / "inventory" / "hosts.json").read_text())["all"]
    assert inventory["children"] == {"cpu": {"hosts": {"main-0": {}, "main-1": {}}}}
    host = inventory["hosts"]["main-0"]
    assert (host["node_instance_type"], host["ansible_become"], host["ansible_python_interpreter"]) == (
        "c7i.4xlarge",
        False,  # the emulation logs in as root; a cloud image's user gets sudo
        "/usr/bin/python3",
    )
    for node in nodes:
        inspected = ssh(node, f"podman image inspect --format '{{{{.Digest}}}}' {record['image']}")
        assert inspected.stdout.strip() == cpu_image.digest, inspected.stderr
    store = open_store(record["store"])
    try:
        cli("train", str(REPO / "examples" / "quickstart.yaml"), "-c", name, timeout=900)
        assert runstore.latest_committed_step(store, "quickstart") == 60
        # The nodes reached the bucket with the instance profile's credentials: none of this machine's went
        # there. The agent's environment file is gone once the agent read it, and no file names the key.
        agent_env = workdir.run_private(Path("/mnt/infractl"), "quickstart") / "agent.env"
        leaked = ssh(nodes[0], f"test ! -e {agent_env} && ! grep -rl AWS_SECRET_ACCESS_KEY /mnt/infractl")
        assert leaked.returncode == 0, (leaked.stdout, leaked.stderr)
        # The instance's metadata (the node role's credentials, the user data) is root's (and the
        # trainer's: its agent reads spot notices there): any other user of the instance is refused.
        token = shlex.quote(_IMDS_TOKEN)
        assert ssh(nodes[0], f"/usr/bin/python3 -c {token}").stdout.strip(), "root got no metadata token"
        refused = ssh(nodes[0], f"runuser -u nobody -- /usr/bin/python3 -c {token}")
        assert refused.returncode != 0 and "Connection refused" in refused.stderr, (refused.stdout, refused.stderr)

        # One run, three faults of main-1: a kill, a partition, a spot interruption notice.
        cli("train", str(write(cli.cwd / "drilled.yaml", DRILLED_RUN)), "-c", name, "--detach")
        wait_for_commit(store, "drilled", at_least=10, timeout=300)
        drill = json.loads(
            cli("drill", "kill-node", "-c", name, "--node", "main-1", "--no-wait", "--json", "--timeout", "400").stdout
        )
        assert drill["outcome"] == "recovered" and drill["resumed_correctly"], drill
        assert drill["world_size_after"] == 1, drill
        cli("rejoin", "main-1", "-c", name, "--run", "drilled")

        # A partition the instance makes itself (iptables; its SSH port spared, so the drill can
        # undo it): main-0 goes on alone, and main-1 comes back into the run once its link is. The
        # drill waits for the run to be on both nodes again before it cuts.
        refused = cli("drill", "partition", "-c", name, "--node", "main-1", "--kind", "down", expect=2).stderr
        assert "error: --kind: node 'main-1' cannot take a 'down' fault" in refused, refused
        partition = json.loads(
            cli(
                "drill", "partition", "-c", name, "--node", "main-1", "--kind", "drop", "--seconds", "45",
                "--no-wait", "--json", "--timeout", "400",
            ).stdout
        )  # fmt: skip
        assert partition["world_size_at_fault"] == 2, partition
        assert partition["outcome"] == "recovered" and partition["survivors"] == ["main-0"], partition
        assert partition["world_size_after"] == 1 and partition["resumed_correctly"], partition
        assert partition["fault"]["rejoined_by"] in ("itself", "infractl rejoin"), partition
        assert "INFRACTL-CUT" not in ssh(nodes[1], "iptables -S").stdout  # the firewall role's own chain stays

        # A spot interruption notice in one instance's metadata service: its agent takes it as the
        # preemption it announces (emergency checkpoint, the node leaves), and the run goes on.
        wait_for_world(store, "drilled", size=2, since=time.time(), timeout=300)
        [reclaimed] = [h.instance_id for h in emulation.hosts.values() if h.private_ip == nodes[1].address]
        interrupted = time.time()
        emulation.interrupt(reclaimed)
        wait_for_world(store, "drilled", size=1, since=interrupted, timeout=600)
        log = ssh(nodes[1], "cat /mnt/infractl/logs/drilled.log").stdout
        assert "spot interruption notice" in log, log[-3000:]
        preempted = re.search(r"\bstopped\b.*reason=preempted.*step=(\d+)", log)
        assert preempted is not None, log[-3000:]
        assert runstore.read_manifest(store, "drilled", int(preempted[1])) is not None
        control = providers.control(ClusterState(name, cli.home / name))
        control.kill_node(nodes[0].name, "drilled")

        cli("bundle", "-c", name, "--out", str(cli.cwd / "handover"))
        topology = (cli.cwd / "handover" / "topology.md").read_text()
        assert "Provider: `aws`" in topology and f"`{controller}:{record['rendezvous']['port']}`" in topology
        assert all(f"| {n.name} | {n.address} |" in topology for n in nodes), topology
        assert "instances: main-0 `c7i.4xlarge`, main-1 `c7i.4xlarge`" in topology, topology
        assert "Controller `m7i.large`" in topology and f"private `{controller}`" in topology, topology
    finally:
        planted = _plant_leaks(emulation, name)
        refused = cli("teardown", "-c", name, "--purge", "--yes", expect=1)
    assert all(resource in refused.stderr for resource in planted), refused.stderr
    _remove_leaks(emulation, planted)
    cli("teardown", "-c", name, "--purge", "--yes")
    assert sweep(name, "us-east-1", endpoint_url=emulation.endpoint) == []
    assert f"{name}-store" not in [b["Name"] for b in emulation.client("s3").list_buckets()["Buckets"]]
    emulation.sync()
    assert [h for h in emulation.hosts.values() if h.private_ip.startswith("10.76.")] == []
    assert not (cli.home / name).exists()
