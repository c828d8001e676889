"""The ``aws`` provider against an emulated AWS (tests/awsemu.py): real Terraform and the real AWS
provider (from the machine's provider mirror) apply infra/aws to moto's server through the root
module infractl renders (state in the S3 backend with its lock file); the instances become SSH
hosts, reached through the controller with the host key pinned before they existed; destroy and
the tag sweep leave nothing. The module's EFA layouts are checked in a real plan's JSON."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from infractl import infra, proc
from infractl.config import ClusterSpec, load_cluster
from infractl.errors import InfraError
from infractl.node import Node
from infractl.providers.aws.provider import Aws
from infractl.providers.aws.ssh import ClusterKeys, wait_for_ssh
from infractl.providers.aws.sweep import CLUSTER_TAG, sweep
from infractl.statedir import ClusterIntent, ClusterState

from awsemu import NETWORK_RECORD, STATE_BUCKET, VPC_CIDR, EmulatedAws, cluster_config, remove_network
from conftest import BuiltImage, Cli, emulation_fixture, write

# One emulated VPC of this CIDR at a time on this machine, and tests/test_gc.py's `gc --yes` takes the
# `up`s these tests kill: the module's tests and gc's share one worker. (The whole-life test is
# tests/test_aws_e2e.py, on an emulation of its own.)
pytestmark = [pytest.mark.xdist_group("aws-emulated"), pytest.mark.usefixtures("aws_left_clean")]

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


emulation = emulation_fixture("awsemu", VPC_CIDR)


@pytest.fixture(scope="class")
def applied(
    emulation: EmulatedAws, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ClusterSpec, ClusterState, infra.ApplyResult, list[Node]]]:
    folder = tmp_path_factory.mktemp("emu")
    groups = {"main": {"instance_type": "c7i.4xlarge", "nodes": 2}}
    # The cluster creates the store's bucket (the class's last test destroys it, keeping the bucket).
    spec = load_cluster(cluster_yaml(folder, emulation.endpoint, emulation.image_id, groups))
    state = ClusterState(spec.name, folder / "state")
    provider = Aws()
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
    """Checks of one applied cluster, in order; the last destroys it, applies it again and destroys
    it for good (all before any other cluster of the emulation exists: two VPCs of one CIDR would
    give two hosts one address on the emulated link)."""

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
            Filters=[{"Name": f"tag:{CLUSTER_TAG}", "Values": [spec.name]}]
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
        [own] = [line.split()[2] for line in pinned.splitlines() if line.split()[0] == nodes[0].address]
        known_hosts.write_text(pinned.replace(own, other.with_suffix(".pub").read_text().split()[1]))
        try:
            refused = ssh(nodes[0], "true")
        finally:
            known_hosts.write_text(pinned)
        assert refused.returncode == 255 and "Host key verification failed" in refused.stderr
        # An instance that never answers is named, with what SSH said, once the wait is over.
        assert nodes[0].ssh is not None
        with pytest.raises(InfraError, match=r"1 instance\(s\) did not answer SSH within 1 s: ghost i-0 \(.+\)"):
            wait_for_ssh({"ghost i-0": (nodes[0].ssh, "10.77.0.250")}, timeout=1)

    def test_every_instance_serves_a_host_key_of_its_own_pinned_for_it_alone(
        self,
        emulation: EmulatedAws,
        applied: tuple[ClusterSpec, ClusterState, infra.ApplyResult, list[Node]],
    ) -> None:
        """User data's host key, the same on every instance, only bootstraps: once provisioned,
        each host serves a key of its own (as ssh-keyscan on the VPC's link sees it) and known_hosts
        pins that key alone for it, never the bootstrap key, so no host can pass for another. A
        second provisioning (the next `up`) finds it done. No file of the state directory that
        holds a private key is readable by anyone but its owner."""
        spec, state, result, nodes = applied
        controller = result.outputs["controller"]
        bootstrap = " ".join(ClusterKeys.of(spec, state).host_public().split()[:2])
        addresses = [controller["address"], *(node.address for node in nodes)]

        def served() -> dict[str, str]:
            keys = {}
            for address in addresses:
                argv = ["ssh-keyscan", "-t", "ed25519", "-T", "10", address]
                scanned = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
                [line] = [line for line in scanned.stdout.splitlines() if line and not line.startswith("#")]
                keys[address] = " ".join(line.split()[1:3])
            return keys

        def pinned() -> dict[str, list[str]]:
            pins: dict[str, list[str]] = {}
            for line in (state.dir / "ssh" / "known_hosts").read_text().splitlines():
                names, key = line.split(" ", 1)
                for name in names.split(","):
                    pins.setdefault(name, []).append(key)
            return pins

        keys = served()
        assert len(set(keys.values())) == 3 and bootstrap not in keys.values(), keys
        pins = pinned()
        assert {address: pins[address] for address in addresses} == {a: [key] for a, key in keys.items()}
        assert pins[controller["public_address"]] == [keys[controller["address"]]]
        assert bootstrap not in [key for keys_of in pins.values() for key in keys_of]
        for host in emulation.hosts.values():
            host_key = host.folder / "etc" / "ssh" / "ssh_host_ed25519_key"
            assert (
                host_key.stat().st_mode & 0o077 == 0
                and not host_key.with_name(f"{host_key.name}.infractl-new").exists()
            )

        before = (state.dir / "ssh" / "host_keys.json").read_text()
        again = Aws().provisioned(spec, state, result)
        assert [node.name for node in again] == ["main-0", "main-1"]
        assert (state.dir / "ssh" / "host_keys.json").read_text() == before and pinned() == pins and served() == keys

        for path in state.dir.rglob("*"):
            # Provider binaries under .terraform are large and hold no key: only files a key could be in.
            if path.is_file() and not path.is_symlink() and path.stat().st_size < 1 << 20:
                if b"PRIVATE KEY" in path.read_bytes():
                    assert path.stat().st_mode & 0o077 == 0, path

    def test_destroy_keeps_a_created_bucket_unless_purged_and_leaves_nothing_else(
        self,
        emulation: EmulatedAws,
        applied: tuple[ClusterSpec, ClusterState, infra.ApplyResult, list[Node]],
    ) -> None:
        """The cluster created its bucket: destroyed without purge, the bucket and its runs stay and
        nothing else does; applied again, the cluster takes the bucket back; destroyed with purge,
        every version goes first and then the bucket. The sweep and the emulation find nothing.
        Last in the class: the cluster is gone afterwards."""
        spec, state, _, _ = applied
        provider = Aws()
        assert spec.store is not None
        record = ClusterIntent(name=spec.name, spec=spec, store=spec.store)
        bucket = f"{spec.name}-store"
        s3 = emulation.client("s3")

        def destroyed(purge: bool) -> list[str]:
            said = provider.before_destroy(state, record, purge=purge)
            infra.destroy(state.terraform_dir)
            emulation.sync()
            leaks = sweep(spec.name, "us-east-1", endpoint_url=emulation.endpoint)
            assert leaks == [], (purge, leaks)
            return said

        # While the cluster is up the sweep sees every kind it looks for (and afterwards none of them).
        kinds = {leak.split()[0] for leak in sweep(spec.name, "us-east-1", endpoint_url=emulation.endpoint)}
        assert kinds >= {
            "instance",
            "nat-gateway",
            "elastic-ip",
            "launch-template",
            "key-pair",
            "security-group",
            "vpc",
        }
        assert kinds >= {"iam-role", "instance-profile"}
        s3.put_object(Bucket=bucket, Key="runs/r1/COMMITTED", Body=b"1")
        s3.put_object(Bucket=bucket, Key="runs/r1/COMMITTED", Body=b"2")  # a second version

        (said,) = destroyed(purge=False)
        assert said.startswith(f"store: bucket {bucket} kept")
        assert s3.get_object(Bucket=bucket, Key="runs/r1/COMMITTED")["Body"].read() == b"2"

        # The kept bucket is imported, not created again (which S3 would refuse), and so are its
        # lifecycle rules (made again, the provider would wait a minute for them to settle).
        root = provider.root_settings(spec, state)
        assert [(i["to"], i["id"]) for i in root.blocks["import"]] == [
            ("module.cluster.aws_s3_bucket.this[0]", bucket),
            ("module.cluster.aws_s3_bucket_lifecycle_configuration.this[0]", bucket),
        ]
        infra.apply(state.terraform_dir, infra.module_dir("aws"), provider.variables(spec, state), root=root)
        emulation.sync()
        assert len([h for h in emulation.hosts.values() if h.public_ip is None]) >= 1
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
    """``terraform plan`` of the root module infractl renders (``infra.plan``), with the real provider
    and fake credentials (moto answers the few calls a plan makes): the launch template's network
    interfaces, card by card, and the placement group only where there is EFA."""
    import boto3

    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=STATE_BUCKET)
    image = "ami-0123456789abcdef0"
    spec = load_cluster(
        cluster_yaml(tmp_path / "plan", s3_server, image, {"gpu": {"instance_type": instance_type, "nodes": 2}})
    )
    state = ClusterState(spec.name, tmp_path / "state")
    provider = Aws()
    planned = infra.plan(
        state.terraform_dir,
        infra.module_dir("aws"),
        provider.variables(spec, state),
        root=provider.root_settings(spec, state),
    )
    resources = {r["address"]: r for r in planned["planned_values"]["root_module"]["child_modules"][0]["resources"]}
    template = resources[f'module.cluster.aws_launch_template.node["{instance_type}"]']["values"]
    interfaces = [
        (i["network_card_index"], i["device_index"], i["interface_type"] or None)
        for i in template["network_interfaces"]
    ]
    assert interfaces == layout
    assert len([i for i in interfaces if i[2] in ("efa", "efa-only")]) == efa
    assert ("module.cluster.aws_placement_group.this[0]" in resources) == (efa > 0)


def _up_in_its_own_group(
    emulation: EmulatedAws, cpu_image: BuiltImage, cli: Cli, **aws_fields: Any
) -> tuple[str, subprocess.Popen[str]]:
    """Start ``infractl up`` of a 1-node cluster in a process group of its own (a terminal's: killing
    the group kills Ansible and every ssh with it); its name, and the process with its output."""
    groups = {"main": {"instance_type": "c7i.4xlarge", "nodes": 1}}
    pinned = f"infractl/trainer@{cpu_image.digest}"
    config = cluster_yaml(cli.cwd, emulation.endpoint, emulation.image_id, groups, runtime_image=pinned, **aws_fields)
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


def _ansible_changed_a_node(state_dir: Path) -> bool:
    """Whether a task of the cluster's Ansible run changed something on a node: Ansible is at work
    on it. ansible-runner's artifacts hold one event a file, written whole (renamed into place)."""
    for path in state_dir.glob("ansible/artifacts/*/job_events/*.json"):
        if path.name.endswith("-partial.json"):  # the callback's half of an event, written in place
            continue
        event = json.loads(path.read_text())
        if event.get("event") == "runner_on_ok" and event["event_data"].get("res", {}).get("changed"):
            return True
    return False


def _nothing_left(emulation: EmulatedAws, cli: Cli, name: str) -> None:
    assert sweep(name, "us-east-1", endpoint_url=emulation.endpoint) == []
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
    nothing of the cluster is left in the account. The store is a bucket of the operator's own,
    which teardown keeps (a bucket the cluster creates: the destroy test and test_aws_e2e.py; here
    it would add the AWS provider's wait for its lifecycle rules, about a minute, to the apply)."""
    cli = Cli(tmp_path_factory.mktemp("killed"))
    own = f"{cli.cwd.name}-store"
    s3 = emulation.client("s3")
    s3.create_bucket(Bucket=own)
    # What `up` asks of a bucket the cluster does not create (the endpoint is plain HTTP: no TLS policy).
    block = ("BlockPublicAcls", "IgnorePublicAcls", "BlockPublicPolicy", "RestrictPublicBuckets")
    s3.put_public_access_block(Bucket=own, PublicAccessBlockConfiguration=dict.fromkeys(block, True))
    s3.put_bucket_versioning(Bucket=own, VersioningConfiguration={"Status": "Enabled"})
    name, up = _up_in_its_own_group(emulation, cpu_image, cli, create_bucket=False)
    said = []
    assert up.stdout is not None
    for line in up.stdout:
        said.append(line)
        if line.startswith("ansible: configuring nodes"):
            break
    deadline = time.monotonic() + 300
    while not _ansible_changed_a_node(cli.home / name):
        assert up.poll() is None, f"`up` ended before Ansible changed anything on the instance: {said}"
        assert time.monotonic() < deadline, f"Ansible changed nothing on the instance within 300 s: {said}"
        time.sleep(0.2)
    os.killpg(up.pid, signal.SIGKILL)
    up.wait()
    assert "".join(said).count("rendezvous: ") == 1 and not (cli.home / name / "cluster.json").exists(), said

    assert "is not up" in cli("status", "-c", name, expect=2).stderr  # nothing to show, one line
    done = cli("teardown", "-c", name, "--yes", "--purge")
    assert "its `up` never finished" in done.stderr, done.stderr
    assert own in [b["Name"] for b in s3.list_buckets()["Buckets"]]  # the operator's: kept
    listed = s3.list_object_versions(Bucket=own)
    for kept in [*listed.get("Versions", []), *listed.get("DeleteMarkers", [])]:
        s3.delete_object(Bucket=own, Key=kept["Key"], VersionId=kept["VersionId"])
    s3.delete_bucket(Bucket=own)
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
        {"Name": f"tag:{CLUSTER_TAG}", "Values": [name]},
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


@pytest.mark.cluster
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
