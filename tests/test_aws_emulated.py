"""The ``aws`` provider against an emulated AWS (tests/awsemu.py): real Terraform and the real AWS
provider (from the machine's provider mirror) apply infra/aws to moto's server through the root
module infractl renders (state in the S3 backend with its lock file); the instances become SSH
hosts, reached through the controller with the host key pinned before they existed; destroy and
the tag sweep leave nothing. The module's EFA layouts are checked in a real plan's JSON."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from infractl import infra, proc, providers, runstore
from infractl.config import ClusterSpec, load_cluster
from infractl.errors import InfractlError, InfraError
from infractl.infra import Node
from infractl.providers import aws
from infractl.state import ClusterState, started_clusters
from infractl.store import open_store

from awsemu import NETWORK_RECORD, STATE_BUCKET, VPC_CIDR, EmulatedAws, cluster_config, emulated_aws, remove_network
from conftest import REPO, BuiltImage, Cli, wait_for_commit, wait_for_world, write

# One emulated VPC at a time on this machine: the module's tests share one worker.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("aws-emulated")]

DIGEST = "sha256:" + "ab" * 32


def cluster_yaml(
    folder: Path,
    endpoint: str,
    ami: str,
    groups: dict[str, Any],
    *,
    runtime_image: str = f"registry.example/trainer@{DIGEST}",
    **aws_fields: Any,
) -> Path:
    """The emulation's cluster.yaml (``awsemu.cluster_config``) in ``folder``, named after it."""
    folder.mkdir(parents=True, exist_ok=True)
    config = cluster_config(folder.name, endpoint, ami, groups, image=runtime_image, **aws_fields)
    return write(folder / "cluster.yaml", yaml.safe_dump(config))


def ssh(node: Node, command: str) -> subprocess.CompletedProcess[str]:
    assert node.ssh is not None
    return subprocess.run(node.ssh.argv(node.address, command), capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def emulation(aws_test_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedAws]:
    with emulated_aws(tmp_path_factory.mktemp("awsemu"), VPC_CIDR) as emulated:
        emulated.client("s3").create_bucket(Bucket=STATE_BUCKET)
        yield emulated


@pytest.fixture(autouse=True)
def _nothing_left_for_the_next(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """What a test of the emulation leaves (a failed one) is removed after it and named as an error, so
    that one failure stays one: a cluster left in the VPC would give the next cluster's hosts its
    addresses, and gc on this worker (tests/test_gc.py) would try to tear down an `up` of it after
    its AWS has gone with the emulation."""
    yield
    if "emulation" not in request.fixturenames or "applied" in request.fixturenames:
        return  # the class's cluster is destroyed with its fixture
    emulation: EmulatedAws = request.getfixturevalue("emulation")
    left = []
    for state in started_clusters():
        if not state.dir.is_relative_to(tmp_path_factory.getbasetemp()):
            continue
        try:
            spec = state.read_intent().get("spec") or {}
        except (InfractlError, OSError, ValueError):
            spec = {}
        if (spec.get("aws") or {}).get("endpoint_url") != emulation.endpoint:
            continue
        left.append(f"cluster {state.dir}")
        done = Cli(state.dir.parent.parent)("teardown", "-c", state.name, "--purge", "--yes", expect=None, timeout=900)
        if done.returncode != 0:
            shutil.rmtree(state.dir, ignore_errors=True)
            state.unlist()
    mappings = emulation.client("resourcegroupstaggingapi").get_resources(TagFilters=[{"Key": aws.CLUSTER_TAG}])
    tagged = {
        tag["Value"] for m in mappings["ResourceTagMappingList"] for tag in m["Tags"] if tag["Key"] == aws.CLUSTER_TAG
    }
    for name in sorted(tagged):
        if removed := aws.reap(name, "us-east-1", endpoint_url=emulation.endpoint):
            left.append(f"cluster {name}'s {', '.join(removed)}")
    emulation.sync()
    assert not left, f"the test left these behind (now removed): {left}"


@pytest.fixture(scope="class")
def applied(
    emulation: EmulatedAws, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ClusterSpec, ClusterState, infra.ApplyResult, list[Node]]]:
    folder = tmp_path_factory.mktemp("emu")
    groups = {"main": {"instance_type": "c7i.4xlarge", "nodes": 2}}
    # The store's bucket exists already (the next test covers a cluster that creates its own).
    spec = load_cluster(cluster_yaml(folder, emulation.endpoint, emulation.image_id, groups, create_bucket=False))
    emulation.client("s3").create_bucket(Bucket=f"{spec.name}-store")
    state = ClusterState(spec.name, folder / "state")
    provider = aws.Aws()
    result = infra.apply(
        state.terraform_dir,
        infra.module_dir("aws"),
        provider.variables(spec, state),
        root=provider.root_settings(spec, state),
    )
    nodes = provider.provisioned(spec, state, result)  # waits until every instance answers SSH
    try:
        yield spec, state, result, nodes
    finally:
        infra.destroy(state.terraform_dir)


class TestOneApply:
    """Two checks of one applied cluster, destroyed once both ran (before any other cluster of the
    emulation exists: two VPCs of one CIDR would give two hosts one address on the emulated link)."""

    def test_the_module_applies_with_the_real_provider_and_its_state_lives_in_the_state_bucket(
        self, emulation: EmulatedAws, applied: tuple[ClusterSpec, ClusterState, infra.ApplyResult, list[Node]]
    ) -> None:
        spec, state, result, nodes = applied
        assert result.changed and [n.name for n in nodes] == ["main-0", "main-1"]
        assert all(n.address.startswith("10.77.0.") for n in nodes), [n.address for n in nodes]
        controller = result.outputs["controller"]
        assert controller["address"].startswith("10.77.16.") and controller["public_address"]
        listed = emulation.client("s3").list_objects_v2(Bucket=STATE_BUCKET, Prefix=f"infractl/{spec.name}/")
        assert [o["Key"] for o in listed.get("Contents", [])] == [f"infractl/{spec.name}/terraform.tfstate"]
        assert not (state.terraform_dir / "terraform.tfstate").exists(), "the state is remote, not on this machine"
        tagged = emulation.client("ec2").describe_instances(
            Filters=[{"Name": f"tag:{aws.CLUSTER_TAG}", "Values": [spec.name]}]
        )
        assert len([i for r in tagged["Reservations"] for i in r["Instances"]]) == 3

    def test_nodes_answer_ssh_through_the_controller_with_the_pinned_host_key(
        self,
        applied: tuple[ClusterSpec, ClusterState, infra.ApplyResult, list[Node]],
    ) -> None:
        _, state, result, nodes = applied
        controller = result.outputs["controller"]
        for node in nodes:
            done = ssh(node, "echo $SSH_CONNECTION")
            assert done.returncode == 0, done.stderr
            client, _, server, _ = done.stdout.split()
            # The node saw the controller's private address: the session came through the jump host.
            assert (client, server) == (controller["address"], node.address)
        # A host key other than the cluster's is refused (never trusted on first use).
        known_hosts = state.dir / "ssh" / "known_hosts"
        pinned = known_hosts.read_text()
        other = state.dir / "ssh" / "other"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
        known_hosts.write_text(pinned.replace(pinned.split()[2], other.with_suffix(".pub").read_text().split()[1]))
        try:
            refused = ssh(nodes[0], "true")
        finally:
            known_hosts.write_text(pinned)
        assert refused.returncode == 255 and "Host key verification failed" in refused.stderr
        # An instance that never answers is named, with what SSH said, once the wait is over.
        assert nodes[0].ssh is not None
        with pytest.raises(InfraError, match=r"1 instance\(s\) did not answer SSH within 1 s: ghost i-0 \(.+\)"):
            aws.wait_for_ssh({"ghost i-0": (nodes[0].ssh, "10.77.0.250")}, timeout=1)


def test_destroy_keeps_a_created_bucket_unless_purged_and_leaves_nothing_else(
    emulation: EmulatedAws, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A cluster that creates its bucket: destroyed without purge, the bucket and its runs stay and
    nothing else does; applied again, the cluster takes the bucket back; destroyed with purge,
    every version goes first and then the bucket. The sweep and the emulation find nothing."""
    folder = tmp_path_factory.mktemp("gone")
    groups = {"cpu": {"instance_type": "m7i.4xlarge", "nodes": 1}}
    spec = load_cluster(cluster_yaml(folder, emulation.endpoint, emulation.image_id, groups))
    state = ClusterState(spec.name, folder / "state")
    provider = aws.Aws()
    record = {"spec": spec.model_dump(mode="json"), "store": spec.store}
    bucket = f"{spec.name}-store"
    s3 = emulation.client("s3")

    def apply() -> None:
        root = provider.root_settings(spec, state)
        infra.apply(state.terraform_dir, infra.module_dir("aws"), provider.variables(spec, state), root=root)
        emulation.sync()
        assert len([h for h in emulation.hosts.values() if h.public_ip is None]) >= 1

    def destroyed(purge: bool) -> list[str]:
        said = provider.before_destroy(state, record, purge=purge)
        infra.destroy(state.terraform_dir)
        emulation.sync()
        leaks = aws.sweep(spec.name, "us-east-1", endpoint_url=emulation.endpoint)
        assert leaks == [], (purge, leaks)
        return said

    apply()
    # While the cluster is up the sweep sees every kind it looks for (and afterwards none of them).
    kinds = {leak.split()[0] for leak in aws.sweep(spec.name, "us-east-1", endpoint_url=emulation.endpoint)}
    assert kinds >= {"instance", "nat-gateway", "elastic-ip", "launch-template", "key-pair", "security-group", "vpc"}
    assert kinds >= {"iam-role", "instance-profile"}
    s3.put_object(Bucket=bucket, Key="runs/r1/COMMITTED", Body=b"1")
    s3.put_object(Bucket=bucket, Key="runs/r1/COMMITTED", Body=b"2")  # a second version

    (said,) = destroyed(purge=False)
    assert said.startswith(f"store: bucket {bucket} kept")
    assert s3.get_object(Bucket=bucket, Key="runs/r1/COMMITTED")["Body"].read() == b"2"

    apply()  # the kept bucket is imported, not created again (which S3 would refuse)
    (said,) = destroyed(purge=True)
    assert said == f"store: bucket {bucket} emptied (2 object version(s) and delete marker(s)) for destroy"
    assert bucket not in [b["Name"] for b in s3.list_buckets()["Buckets"]]


@pytest.mark.parametrize(
    ("instance_type", "efa", "layout"),
    [
        ("p5.48xlarge", 32, [(0, 0, None)] + [(0, 1, "efa-only")] + [(card, 0, "efa-only") for card in range(1, 32)]),
        ("p4d.24xlarge", 4, [(0, 0, "efa")] + [(card, 1, "efa") for card in range(1, 4)]),
        ("g5.12xlarge", 0, []),
    ],
)
def test_a_real_plan_renders_the_efa_interfaces_aws_documents(
    s3_server: str, tmp_path: Path, instance_type: str, efa: int, layout: list[tuple[int, int, str | None]]
) -> None:
    """``terraform plan`` with the real provider and fake credentials (moto answers the few calls a
    plan makes): the launch template's network interfaces, card by card, and the placement group
    only where there is EFA."""
    import boto3

    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=STATE_BUCKET)
    image = "ami-0123456789abcdef0"
    spec = load_cluster(
        cluster_yaml(tmp_path / "plan", s3_server, image, {"gpu": {"instance_type": instance_type, "nodes": 2}})
    )
    state = ClusterState(spec.name, tmp_path / "state")
    provider = aws.Aws()
    root = provider.root_settings(spec, state)
    folder = tmp_path / "root"
    shutil.copytree(infra.module_dir("aws"), folder / "module")
    variables = provider.variables(spec, state)
    call = {"module": {"cluster": {"source": "./module", **variables}}}
    write(folder / "main.tf.json", json.dumps(root.blocks | call))
    env = {
        **os.environ,
        "TF_CLI_CONFIG_FILE": str(write(tmp_path / "terraformrc", root.cli_config)),
        "CHECKPOINT_DISABLE": "1",
    }

    def terraform(*args: str) -> str:
        done = subprocess.run(["terraform", *args], cwd=folder, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    terraform("init", "-input=false")
    terraform("plan", "-input=false", "-out=tfplan")
    planned = json.loads(terraform("show", "-json", "tfplan"))
    resources = {r["address"]: r for r in planned["planned_values"]["root_module"]["child_modules"][0]["resources"]}
    template = resources[f'module.cluster.aws_launch_template.node["{instance_type}"]']["values"]
    interfaces = [
        (i["network_card_index"], i["device_index"], i["interface_type"] or None)
        for i in template["network_interfaces"]
    ]
    assert interfaces == layout
    assert len([i for i in interfaces if i[2] in ("efa", "efa-only")]) == efa
    assert ("module.cluster.aws_placement_group.this[0]" in resources) == (efa > 0)


DRILLED_RUN = """\
name: drilled
model: {layers: 2, hidden: 64, heads: 2, seq_len: 64}
data: {max_bytes: 200000}
batch_size: 8
steps: 400
checkpoint: {every: 10, keep: 2}
nodes: {min: 1, max: 2}
max_restarts: 3
watchdog: {step_timeout_s: 8}
"""


def _plant_leaks(emulation: EmulatedAws, cluster: str) -> list[str]:
    """Make what a crashed launcher leaves behind, outside Terraform, with the cluster's tag: an
    instance, a volume, a NAT gateway and an Elastic IP (in a VPC of their own). Their ids."""
    ec2 = emulation.client("ec2")

    def tags(kind: str) -> list[dict[str, Any]]:
        return [{"ResourceType": kind, "Tags": [{"Key": aws.CLUSTER_TAG, "Value": cluster}]}]

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


# long: one cluster's whole life on the emulated AWS, as the README walks it (bringing it up takes minutes).
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
    config = cluster_yaml(cli.cwd, emulation.endpoint, emulation.image_id, groups, runtime_image=pinned)
    name = cli.cwd.name
    up = cli("up", "-c", str(config), timeout=1200)
    record = json.loads((cli.home / name / "cluster.json").read_text())
    controller = record["rendezvous"]["host"]
    assert controller.startswith("10.77.16."), record["rendezvous"]  # the controller, in the public subnet
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
        # The nodes reached the bucket with the instance profile's credentials: none of this machine's went there.
        env_file = ssh(nodes[0], "cat /mnt/infractl/runs/quickstart/agent.env")
        assert env_file.returncode == 0 and "AWS_SECRET_ACCESS_KEY" not in env_file.stdout, env_file.stdout

        cli("train", str(write(cli.cwd / "drilled.yaml", DRILLED_RUN)), "-c", name, "--detach")
        wait_for_commit(store, "drilled", at_least=10, timeout=300)
        drill = json.loads(
            cli("drill", "kill-node", "-c", name, "--node", "main-1", "--no-wait", "--json", "--timeout", "400").stdout
        )
        assert drill["outcome"] == "recovered" and drill["resumed_correctly"], drill
        control = providers.control(ClusterState(name, cli.home / name))
        for node in nodes:  # recovered: its end would only repeat the quickstart's
            control.kill_node(node.name, "drilled")

        # A partition the instance makes itself (iptables; its SSH port spared, so the drill can
        # undo it): main-0 goes on alone, and main-1 comes back into the run once its link is.
        paced = "steps: 100000\nmin_step_s: 0.2"  # stopped below: paced, it spares the CPU meanwhile
        cut = DRILLED_RUN.replace("name: drilled", "name: cut").replace("steps: 400", paced)
        cli("train", str(write(cli.cwd / "cut.yaml", cut)), "-c", name, "--detach")
        wait_for_commit(store, "cut", at_least=10, timeout=300)
        refused = cli("drill", "partition", "-c", name, "--node", "main-1", "--kind", "down", expect=2).stderr
        assert "error: --kind: node 'main-1' cannot take a 'down' fault" in refused, refused
        partition = json.loads(
            cli(
                "drill", "partition", "-c", name, "--node", "main-1", "--kind", "drop", "--seconds", "45",
                "--no-wait", "--json", "--timeout", "400",
            ).stdout
        )  # fmt: skip
        assert partition["outcome"] == "recovered" and partition["survivors"] == ["main-0"], partition
        assert partition["world_size_after"] == 1 and partition["resumed_correctly"], partition
        assert partition["fault"]["rejoined_by"] in ("itself", "infractl rejoin"), partition
        assert "INFRACTL" not in ssh(nodes[1], "iptables -S").stdout
        for node in nodes:
            control.kill_node(node.name, "cut")

        # A spot interruption notice in one instance's metadata service: its agent takes it as the
        # preemption it announces (emergency checkpoint, the node leaves), and the run goes on.
        spotted = DRILLED_RUN.replace("name: drilled", "name: spotted").replace("keep: 2", "keep: 100")
        cli("train", str(write(cli.cwd / "spotted.yaml", spotted)), "-c", name, "--detach")
        wait_for_commit(store, "spotted", at_least=10, timeout=300)
        [reclaimed] = [h.instance_id for h in emulation.hosts.values() if h.private_ip == nodes[1].address]
        interrupted = time.time()
        emulation.interrupt(reclaimed)
        wait_for_world(store, "spotted", size=1, since=interrupted, timeout=600)
        log = ssh(nodes[1], "cat /mnt/infractl/logs/spotted.log").stdout
        assert "spot interruption notice" in log, log[-3000:]
        preempted = re.search(r"\bstopped\b.*reason=preempted.*step=(\d+)", log)
        assert preempted is not None, log[-3000:]
        assert runstore.read_manifest(store, "spotted", int(preempted[1])) is not None
        control.kill_node(nodes[0].name, "spotted")

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
    assert aws.sweep(name, "us-east-1", endpoint_url=emulation.endpoint) == []
    assert f"{name}-store" not in [b["Name"] for b in emulation.client("s3").list_buckets()["Buckets"]]
    emulation.sync()
    assert [h for h in emulation.hosts.values() if h.private_ip.startswith("10.77.")] == []
    assert not (cli.home / name).exists()


def _up_in_its_own_group(emulation: EmulatedAws, cpu_image: BuiltImage, cli: Cli) -> tuple[str, subprocess.Popen[str]]:
    """Start ``infractl up`` of a 1-node cluster in a process group of its own (a terminal's: killing
    the group kills Ansible and every ssh with it); its name, and the process with its output."""
    groups = {"main": {"instance_type": "c7i.4xlarge", "nodes": 1}}
    pinned = f"infractl/trainer@{cpu_image.digest}"
    config = cluster_yaml(cli.cwd, emulation.endpoint, emulation.image_id, groups, runtime_image=pinned)
    up = subprocess.Popen(
        [*cli.program, "up", "-c", str(config)],
        cwd=cli.cwd,
        env=cli.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return cli.cwd.name, up


def _nothing_left(emulation: EmulatedAws, cli: Cli, name: str) -> None:
    assert aws.sweep(name, "us-east-1", endpoint_url=emulation.endpoint) == []
    assert f"{name}-store" not in [b["Name"] for b in emulation.client("s3").list_buckets()["Buckets"]]
    emulation.sync()
    assert [h for h in emulation.hosts.values() if h.private_ip.startswith("10.77.")] == []
    assert not (cli.home / name).exists()


def test_an_up_killed_while_ansible_configures_is_torn_down_with_nothing_left(
    emulation: EmulatedAws, cpu_image: BuiltImage, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The operator's terminal dies while Ansible configures the instances (the whole process group
    goes, Ansible with it), so ``up`` never wrote the cluster record: ``teardown`` destroys what the
    Terraform state holds from what the ``up`` had begun, stops the servers on the controller, and
    nothing is left in the account."""
    cli = Cli(tmp_path_factory.mktemp("killed"))
    name, up = _up_in_its_own_group(emulation, cpu_image, cli)
    said = []
    assert up.stdout is not None
    for line in up.stdout:
        said.append(line)
        if line.startswith("ansible: configuring nodes"):
            break
    time.sleep(5)  # Ansible is at work on the instance
    os.killpg(up.pid, signal.SIGKILL)
    up.wait()
    assert "".join(said).count("rendezvous: ") == 1 and not (cli.home / name / "cluster.json").exists(), said

    assert "is not up" in cli("status", "-c", name, expect=2).stderr  # nothing to show, one line
    done = cli("teardown", "-c", name, "--yes", "--purge")
    assert "its `up` never finished" in done.stderr, done.stderr
    _nothing_left(emulation, cli, name)
    # ansible-runner ran ansible-playbook in a session of its own, which the kill did not reach: teardown stopped it.
    assert proc.find(cli.home / name) == []


def test_an_up_killed_during_its_apply_is_torn_down_with_nothing_left(
    emulation: EmulatedAws, cpu_image: BuiltImage, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The operator's terminal dies while Terraform applies (the first instance is running): the
    S3 backend holds Terraform's lock and at most the state it last saved. ``teardown`` releases the
    lock, destroys what the state holds, deletes what the state never held by the cluster's tag and
    IAM path, and nothing is left in the account."""
    cli = Cli(tmp_path_factory.mktemp("applying"))
    name, up = _up_in_its_own_group(emulation, cpu_image, cli)
    ec2 = emulation.client("ec2")
    tagged = [
        {"Name": f"tag:{aws.CLUSTER_TAG}", "Values": [name]},
        {"Name": "instance-state-name", "Values": ["running"]},
    ]
    deadline = time.monotonic() + 300
    while not ec2.describe_instances(Filters=tagged)["Reservations"]:
        assert up.poll() is None and time.monotonic() < deadline, "no instance came up during the apply"
        time.sleep(0.5)
    os.killpg(up.pid, signal.SIGKILL)
    up.wait()

    done = cli("teardown", "-c", name, "--yes", "--purge")
    assert "its `up` never finished" in done.stderr and "released the state lock" in done.stderr, done.stderr
    _nothing_left(emulation, cli, name)


def test_a_second_network_for_a_routed_vpc_is_refused_until_the_left_one_is_removed(tmp_path: Path) -> None:
    """A killed emulation's bridge keeps routing its VPC, and this machine's replies to a new
    emulation's hosts would leave through it (every host's connection to the endpoint timed out):
    a new emulation of that VPC is refused, naming the bridge, until ``remove_network`` (what the
    test session runs for ended sessions) removes it, its hosts' namespaces and all."""
    cidr = "10.78.0.0/24"
    left = EmulatedAws(tmp_path / "killed", cidr)
    left.folder.mkdir()
    left.open_network()
    host = f"{left.bridge}-0"
    subprocess.run(["ip", "netns", "add", host], check=True)
    subprocess.run(
        ["ip", "link", "add", f"{left.bridge}h0", "type", "veth", "peer", "name", "eth0", "netns", host], check=True
    )
    subprocess.run(["ip", "link", "set", f"{left.bridge}h0", "master", left.bridge], check=True)
    new = EmulatedAws(tmp_path / "new", cidr)
    new.folder.mkdir()
    with pytest.raises(RuntimeError, match=f"{cidr} is already routed on this machine \\(via {left.bridge}\\)"):
        new.open_network()
    remove_network(left.folder)
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert left.bridge not in links and host not in namespaces and not (left.folder / NETWORK_RECORD).exists()
    new.open_network()
    new.close_network()
    assert new.bridge not in subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
