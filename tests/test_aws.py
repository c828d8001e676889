"""The ``aws`` provider through the CLI, offline: ``infractl up --dry-run`` renders infra/aws's
variables and prints the resources and the hourly cost without credentials or any AWS call;
cluster.yaml's ``aws:`` section is validated like the rest; ``teardown`` sweeps EC2 by the
cluster's tag on moto's standalone server and names every leftover."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from infractl import playbook
from infractl.config import load_cluster
from infractl.errors import ConfigError
from infractl.node import Node, SshLogin
from infractl.planning.devices import CATALOG, Device
from infractl.providers.aws.nodes import AwsNodes, engine_for
from infractl.providers.aws.pricing import planned_resources
from infractl.providers.aws.spec import module_variables
from infractl.providers.aws.sweep import CLUSTER_TAG, reap, sweep
from infractl.providers.contract import provider_named
from infractl.statedir import ClusterRecord, ClusterState, Endpoint
from infractl.store import S3Store, open_store

from conftest import REPO, Cli, new_bucket_name, one_line, s3_client, write

EXAMPLE = REPO / "examples" / "aws" / "cluster.yaml"
DIGEST = "sha256:" + "ab" * 32
CIDRS = ["203.0.113.7/32"]

# No credentials anywhere: a dry run must not need them (nor try the metadata service).
NO_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_EC2_METADATA_DISABLED": "true"}


def module_resources() -> set[str]:
    """``type.name`` of every resource block in infra/aws."""
    text = "\n".join(path.read_text() for path in sorted((REPO / "infra" / "aws").glob("*.tf")))
    return {f"{kind}.{name}" for kind, name in re.findall(r'^resource "([a-z0-9_]+)" "([a-z0-9_]+)"', text, re.M)}


def test_dry_run_prints_the_modules_resources_and_the_cost_without_credentials(cli: Cli) -> None:
    result = cli("up", "--dry-run", "-c", str(EXAMPLE), "--json", env=NO_CREDENTIALS)
    plan = json.loads(result.stdout)
    spec = load_cluster(EXAMPLE)
    assert plan["provider"] == "aws" and plan["region"] == "us-east-1"
    assert plan["variables"] == module_variables(spec, {})  # no key is made by a dry run
    assert plan["variables"]["processes_per_node"] == 8  # one rank per GPU of a p5.48xlarge
    assert plan["variables"]["store_bucket"] == "my-team-infractl" and plan["variables"]["store_prefix"] == "train-p5"
    keys = {
        "ssh_public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExampleExample k",
        "host_key": {"private": "", "public": ""},
    }
    assert plan["resources"] == planned_resources(plan["variables"] | keys)
    # Every planned address is a resource block of the module, and every node of every group is there.
    assert {re.sub(r"\[.*\]$", "", address) for address in plan["resources"]} <= module_resources()
    nodes = [a for a in plan["resources"] if a.startswith("aws_instance.node[")]
    assert nodes == ['aws_instance.node["core-0"]', 'aws_instance.node["core-1"]'] + [
        'aws_instance.node["elastic-0"]',
        'aws_instance.node["elastic-1"]',
    ]
    assert "aws_instance.controller" in plan["resources"] and "aws_s3_bucket.this[0]" in plan["resources"]
    cost = plan["cost"]
    assert cost["groups"]["elastic"]["market"] == "spot" and cost["groups"]["core"]["market"] == "on-demand"
    assert cost["total"] == pytest.approx(
        sum(g["hourly"] for g in cost["groups"].values())
        + cost["controller"]["hourly"]
        + cost["network"]
        + cost["storage"],
        abs=1e-3,
    )
    assert cost["total"] < cost["total_on_demand"]
    # The device `train` sizes runs against: a p5's H100, as `up` will record it.
    assert plan["device"]["name"] == "h100-80gb" and plan["device"]["cuda"] is True
    assert not cli.home.exists(), "a dry run leaves no state"

    human = cli("up", "--dry-run", "-c", str(EXAMPLE), env=NO_CREDENTIALS | {"COLUMNS": "300"}).stdout
    assert f"{len(plan['resources'])} resource(s) would be created:" in human
    assert f"total {cost['total']:,.2f}/h" in human and "nothing was created or changed" in human
    assert "devices: h100-80gb, 74.51 GiB per rank" in human


def test_dry_run_of_the_local_provider_lists_its_nodes(cli: Cli) -> None:
    plan = json.loads(cli("up", "--dry-run", "--json").stdout)
    assert plan["resources"] == ["terraform_data.node[0]", "terraform_data.node[1]"] and plan["cost"] is None
    assert plan["device"]["name"] == "cpu" and plan["device"]["cuda"] is False  # this machine, shared by its ranks
    assert not cli.home.exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"provider": "local"}, "aws: is for provider: aws (provider is local)"),
        ({"aws": None}, "aws: is required with provider: aws (region, state_bucket, node_groups)"),
        ({"nodes": 3}, "nodes: 3 differs from the 4 node(s) of aws.node_groups"),
        ({"store": None}, "store: provider aws needs an s3:// store (s3://bucket/prefix)"),
        ({"store": "s3://my-team-infractl"}, "store: provider aws needs the store under a prefix of its bucket"),
        ({"store": "s3://my-team-infractl/"}, "store: provider aws needs the store under a prefix of its bucket"),
        ({"runtime": {"image": "trainer:latest"}}, "runtime.image: 'trainer:latest' is not pinned by digest"),
        ({"runtime": {"image": None}}, "runtime.image: is required with provider aws (the trainer runs in"),
        (
            {"aws": {"region": "us-east-1", "state_bucket": "tf-state", "availability_zone": "us-east-1a",
                     "node_groups": {"core": {"instance_type": "p9.huge", "nodes": 4}}, "ssh_ingress_cidrs": CIDRS}},
            "aws.node_groups.core.instance_type: 'p9.huge' is not a training instance type",
        ),
        (
            {"aws": {"region": "us-east-1", "state_bucket": "tf-state", "ssh_ingress_cidrs": CIDRS,
                     "node_groups": {"core": {"instance_type": "p5.48xlarge", "nodes": 4}}}},
            "aws.availability_zone: is required when the cluster creates its subnet",
        ),
        (
            {"aws": {"region": "us-east-1", "state_bucket": "tf-state", "availability_zone": "us-east-1a",
                     "node_groups": {"a": {"instance_type": "g5.12xlarge", "nodes": 2},
                                     "b": {"instance_type": "p5.48xlarge", "nodes": 2}}, "ssh_ingress_cidrs": CIDRS}},
            "processes_per_node: is required when the node groups' instance types have different GPU counts",
        ),
    ],
)  # fmt: skip
def test_the_aws_section_is_validated_with_one_line_naming_the_field(
    cli: Cli, change: dict[str, object], message: str
) -> None:
    import yaml

    config = yaml.safe_load(EXAMPLE.read_text()) | {"runtime": {"image": f"registry.example/trainer@{DIGEST}"}}
    config |= change
    path = write(cli.cwd / "cluster.yaml", yaml.safe_dump(config))
    line = one_line(cli("up", "--dry-run", "-c", str(path), expect=2).stderr)
    assert line.startswith(f"error: {path}: {message}"), line


@pytest.mark.parametrize(
    "workdir",
    [
        "/",
        "/opt",
        "opt/infractl",
        "/opt/{{ lookup('pipe', 'id') }}",
        "/opt/a b",
        "/opt/$(id)",
        "/opt/../etc",
        "/opt/a;b",
    ],
)
def test_aws_workdir_is_a_plain_path_two_levels_deep(cli: Cli, workdir: str) -> None:
    """Root makes the work directory and sets its ACLs, and it reaches Ansible's variables and shell
    commands: one line naming the field, exit 2, before anything is made."""
    import yaml

    config = yaml.safe_load(EXAMPLE.read_text()) | {"runtime": {"image": f"registry.example/trainer@{DIGEST}"}}
    config["aws"]["workdir"] = workdir
    path = write(cli.cwd / "cluster.yaml", yaml.safe_dump(config))
    line = one_line(cli("up", "--dry-run", "-c", str(path), expect=2).stderr)
    assert line.startswith(f"error: {path}: aws.workdir: {workdir!r} must be an absolute path at least two"), line
    assert not cli.home.exists()


def test_up_refuses_an_existing_store_bucket_without_its_safety_settings(cli: Cli, s3_server: str) -> None:
    """A bucket the cluster does not create is checked before anything is made: public access
    blocked and versioning on (moto's endpoint is plain HTTP, so no TLS-only policy is asked for:
    the module turns require_tls off there too), each missing setting named with what sets it."""
    import yaml

    state_bucket, store_bucket = new_bucket_name(), new_bucket_name()
    s3 = s3_client(s3_server)
    s3.create_bucket(Bucket=state_bucket)
    s3.create_bucket(Bucket=store_bucket)
    config = yaml.safe_load(EXAMPLE.read_text())
    config["runtime"]["image"] = f"registry.example/trainer@{DIGEST}"
    config["store"] = f"s3://{store_bucket}/train-p5?endpoint_url={s3_server}"
    config["aws"] |= {"state_bucket": state_bucket, "endpoint_url": s3_server, "create_bucket": False}
    path = write(cli.cwd / "cluster.yaml", yaml.safe_dump(config))

    line = one_line(cli("up", "-c", str(path), expect=2).stderr)
    assert line == (
        f"error: store: bucket {store_bucket} is not safe for a cluster's store (the cluster does not create it): "
        f"set its public access block (aws s3api put-public-access-block --bucket {store_bucket} "
        "--public-access-block-configuration BlockPublicAcls=true,IgnorePublicAcls=true,BlockPublicPolicy=true,"
        f"RestrictPublicBuckets=true); versioning (aws s3api put-bucket-versioning --bucket {store_bucket} "
        "--versioning-configuration Status=Enabled)"
    ), line
    assert not cli.home.exists()

    settings = ("BlockPublicAcls", "IgnorePublicAcls", "BlockPublicPolicy", "RestrictPublicBuckets")
    s3.put_public_access_block(
        Bucket=store_bucket, PublicAccessBlockConfiguration={setting: True for setting in settings}
    )
    line = one_line(cli("up", "-c", str(path), expect=2).stderr)
    assert line.startswith(f"error: store: bucket {store_bucket} is not safe") and "; " not in line, line
    assert line.endswith("set versioning (aws s3api put-bucket-versioning --bucket "
                         f"{store_bucket} --versioning-configuration Status=Enabled)"), line  # fmt: skip

    s3.put_bucket_versioning(Bucket=store_bucket, VersioningConfiguration={"Status": "Enabled"})
    line = one_line(cli("up", "-c", str(path), expect=2).stderr)
    assert line.startswith(f"error: runtime.image: image {DIGEST} is not in this machine's image cache"), line


def test_a_tls_only_bucket_policy_is_what_the_store_check_asks_for(s3_server: str) -> None:
    """Where the endpoint has TLS, the bucket's policy must refuse requests without it, as the
    module's own DenyInsecureTransport does; any other policy is named as missing."""
    import json

    bucket = new_bucket_name()
    s3 = s3_client(s3_server)
    s3.create_bucket(Bucket=bucket)
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    settings = ("BlockPublicAcls", "IgnorePublicAcls", "BlockPublicPolicy", "RestrictPublicBuckets")
    s3.put_public_access_block(Bucket=bucket, PublicAccessBlockConfiguration={setting: True for setting in settings})
    store = open_store(f"s3://{bucket}/runs?endpoint_url={s3_server}", field="store")
    assert isinstance(store, S3Store)
    store.check_safeguards(tls=False)

    def statement(condition: dict[str, Any], resources: list[str]) -> dict[str, Any]:
        return {"Effect": "Deny", "Principal": "*", "Action": "s3:*", "Resource": resources, "Condition": condition}

    both = [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]
    for wrong in (
        None,  # no policy at all
        statement({"Bool": {"aws:SecureTransport": "true"}}, both),
        statement({"Bool": {"aws:SecureTransport": "false"}}, [f"arn:aws:s3:::{bucket}"]),  # the objects left out
    ):
        if wrong is not None:
            s3.put_bucket_policy(Bucket=bucket, Policy=json.dumps({"Version": "2012-10-17", "Statement": [wrong]}))
        with pytest.raises(ConfigError, match=r"set a bucket policy statement that denies s3:\* .*aws:SecureTransport"):
            store.check_safeguards(tls=True)
    right = statement({"Bool": {"aws:SecureTransport": "false"}}, both)
    s3.put_bucket_policy(Bucket=bucket, Policy=json.dumps({"Version": "2012-10-17", "Statement": [right]}))
    store.check_safeguards(tls=True)


def test_teardown_sweeps_ec2_by_the_clusters_tag_and_names_every_leftover(cli: Cli, s3_server: str) -> None:
    """An aws cluster whose Terraform applied nothing here (so destroy has nothing to do), with an
    instance, a volume, a NAT gateway and an Elastic IP carrying its tag and an IAM role under its
    path planted on moto: teardown names each and exits 1, keeping the cluster's state; once they
    are gone, teardown exits 0 and the state goes."""
    import boto3
    import yaml

    bucket = new_bucket_name()
    s3_client(s3_server).create_bucket(Bucket=bucket)
    config = yaml.safe_load(EXAMPLE.read_text()) | {"store": f"s3://{bucket}/train-p5?endpoint_url={s3_server}"}
    spec = load_cluster(write(cli.cwd / "cluster.yaml", yaml.safe_dump(config)))
    state = ClusterState(spec.name, cli.home / spec.name)
    assert spec.store is not None
    state.write(
        ClusterRecord(
            name=spec.name, spec=spec, store=spec.store, id=None, rendezvous=Endpoint("10.42.0.10", 29400), nodes=()
        )
    )
    ec2 = boto3.client("ec2", endpoint_url=s3_server, region_name="us-east-1")
    tags = [{"Key": CLUSTER_TAG, "Value": spec.name}]
    image = ec2.describe_images()["Images"][0]["ImageId"]
    instance = ec2.run_instances(
        ImageId=image, MinCount=1, MaxCount=1, TagSpecifications=[{"ResourceType": "instance", "Tags": tags}]
    )["Instances"][0]["InstanceId"]
    volume = ec2.create_volume(
        AvailabilityZone="us-east-1a", Size=10, TagSpecifications=[{"ResourceType": "volume", "Tags": tags}]
    )["VolumeId"]
    ec2.create_volume(AvailabilityZone="us-east-1a", Size=10)  # untagged: not the cluster's
    vpc = ec2.create_vpc(CidrBlock="10.99.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.99.0.0/24")["Subnet"]["SubnetId"]
    address = ec2.allocate_address(Domain="vpc", TagSpecifications=[{"ResourceType": "elastic-ip", "Tags": tags}])[
        "AllocationId"
    ]
    nat = ec2.create_nat_gateway(
        SubnetId=subnet, AllocationId=address, TagSpecifications=[{"ResourceType": "natgateway", "Tags": tags}]
    )["NatGateway"]["NatGatewayId"]
    role = boto3.client("iam", endpoint_url=s3_server, region_name="us-east-1").create_role(
        RoleName="infractl-node-leaked", Path=f"/infractl/{spec.name}/", AssumeRolePolicyDocument="{}"
    )["Role"]["RoleName"]

    endpoint = {"AWS_ENDPOINT_URL": s3_server}
    stderr = cli("teardown", "-c", spec.name, "--yes", expect=1, env=endpoint).stderr
    (line,) = [line for line in stderr.splitlines() if line.startswith("error: ")]
    for leak in (f"instance {instance} (running)", f"volume {volume}", f"nat-gateway {nat}", f"elastic-ip {address}"):
        assert leak in line, (leak, line)
    assert f"iam-role {role}" in line, line
    assert line.count("volume ") == 1 and f"vpc {vpc}" not in line, line  # untagged: not the cluster's
    assert state.is_up(), "a teardown that found leftovers keeps the cluster's state: run it again"

    ec2.terminate_instances(InstanceIds=[instance])
    ec2.delete_volume(VolumeId=volume)
    ec2.delete_nat_gateway(NatGatewayId=nat)
    ec2.release_address(AllocationId=address)
    boto3.client("iam", endpoint_url=s3_server, region_name="us-east-1").delete_role(RoleName=role)
    done = json.loads(cli("teardown", "-c", spec.name, "--yes", "--json", env=endpoint).stdout)
    assert done["cluster"] == spec.name and not state.dir.exists()


@pytest.mark.parametrize(
    ("change", "credentials", "message"),
    [
        ({}, NO_CREDENTIALS, "provider: provider aws: no AWS credentials (set AWS_PROFILE, or AWS_ACCESS_KEY_ID"),
        ({"state_bucket": "no-such-state"}, {}, "aws.state_bucket: the state bucket no-such-state does not exist"),
        ({"availability_zone": "us-east-1e"}, {}, "aws.availability_zone: m7i.large not offered in us-east-1e"),
        # The account passes; the pinned image is not in this machine's cache, which is checked next.
        ({}, {}, f"runtime.image: image {DIGEST} is not in this machine's image cache"),
    ],
)
def test_up_checks_the_account_before_anything_is_created(
    cli: Cli, s3_server: str, change: dict[str, object], credentials: dict[str, str], message: str
) -> None:
    """Against moto's server (``aws.endpoint_url``): each missing thing is one line naming it, exit 2, and
    nothing is made, not even the cluster's state directory; the image's check follows the account's."""
    import yaml

    state_bucket = new_bucket_name()
    s3_client(s3_server).create_bucket(Bucket=state_bucket)
    config = yaml.safe_load(EXAMPLE.read_text())
    config["runtime"]["image"] = f"registry.example/trainer@{DIGEST}"
    config["aws"] |= {"state_bucket": state_bucket, "endpoint_url": s3_server} | change
    path = write(cli.cwd / "cluster.yaml", yaml.safe_dump(config))

    stderr = cli("up", "-c", str(path), expect=2, env=credentials).stderr

    assert one_line(stderr).startswith(f"error: {message}"), stderr
    assert not cli.home.exists()


def test_reap_deletes_every_kind_the_sweep_finds_in_the_order_aws_lets_them_go(s3_server: str) -> None:
    """What an apply killed before Terraform saved its state leaves (made here with the cluster's
    tag and IAM path, as the module makes them, with the dependencies that block a careless
    delete: an instance in the VPC, a NAT gateway holding an Elastic IP, security groups naming
    each other, a role in an instance profile with a policy attached): ``reap`` deletes all of it,
    the sweep finds nothing, and another cluster's resources stay."""
    import boto3

    cluster, other = "reaped", "kept"
    ec2 = boto3.client("ec2", endpoint_url=s3_server, region_name="us-east-1")
    iam = boto3.client("iam", endpoint_url=s3_server, region_name="us-east-1")

    def tags(kind: str, name: str = cluster) -> list[dict[str, object]]:
        return [{"ResourceType": kind, "Tags": [{"Key": CLUSTER_TAG, "Value": name}]}]

    vpc = ec2.create_vpc(CidrBlock="10.98.0.0/16", TagSpecifications=tags("vpc"))["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.98.1.0/24")["Subnet"]["SubnetId"]
    gateway = ec2.create_internet_gateway()["InternetGateway"]["InternetGatewayId"]
    ec2.attach_internet_gateway(InternetGatewayId=gateway, VpcId=vpc)
    table = ec2.create_route_table(VpcId=vpc)["RouteTable"]["RouteTableId"]
    ec2.associate_route_table(RouteTableId=table, SubnetId=subnet)
    groups = [
        ec2.create_security_group(
            GroupName=f"g{i}", Description="x", VpcId=vpc, TagSpecifications=tags("security-group")
        )["GroupId"]
        for i in range(2)
    ]
    for group, peer in (groups, groups[::-1]):
        ec2.authorize_security_group_ingress(
            GroupId=group, IpPermissions=[{"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": peer}]}]
        )
    image = ec2.describe_images()["Images"][0]["ImageId"]
    ec2.run_instances(
        ImageId=image,
        MinCount=1,
        MaxCount=1,
        SubnetId=subnet,
        SecurityGroupIds=groups,
        TagSpecifications=tags("instance"),
    )
    address = ec2.allocate_address(Domain="vpc", TagSpecifications=tags("elastic-ip"))["AllocationId"]
    ec2.create_nat_gateway(SubnetId=subnet, AllocationId=address, TagSpecifications=tags("natgateway"))
    ec2.create_volume(AvailabilityZone="us-east-1a", Size=8, TagSpecifications=tags("volume"))
    kept = ec2.create_volume(AvailabilityZone="us-east-1a", Size=8, TagSpecifications=tags("volume", other))["VolumeId"]
    ec2.create_key_pair(KeyName=f"infractl-{cluster}-1", TagSpecifications=tags("key-pair"))
    ec2.create_launch_template(
        LaunchTemplateName=f"infractl-{cluster}-lt",
        LaunchTemplateData={"ImageId": image},
        TagSpecifications=tags("launch-template"),
    )
    path = f"/infractl/{cluster}/"
    document = json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:GetObject", "Resource": "*"}]}
    )
    role = iam.create_role(RoleName=f"{cluster}-node", Path=path, AssumeRolePolicyDocument="{}")["Role"]["RoleName"]
    policy = iam.create_policy(PolicyName=f"{cluster}-store", Path=path, PolicyDocument=document)["Policy"]["Arn"]
    iam.attach_role_policy(RoleName=role, PolicyArn=policy)
    iam.put_role_policy(RoleName=role, PolicyName="inline", PolicyDocument=document)
    iam.create_instance_profile(InstanceProfileName=f"{cluster}-node", Path=path)
    iam.add_role_to_instance_profile(InstanceProfileName=f"{cluster}-node", RoleName=role)
    assert len(sweep(cluster, "us-east-1", endpoint_url=s3_server)) >= 10

    deleted = reap(cluster, "us-east-1", endpoint_url=s3_server)

    kinds = {item.split()[0] for item in deleted}
    assert kinds >= {"instance", "nat-gateway", "elastic-ip", "volume", "key-pair", "launch-template"}, deleted
    assert kinds >= {"security-group", "vpc", "instance-profile", "iam-role", "iam-policy"}, deleted
    assert sweep(cluster, "us-east-1", endpoint_url=s3_server) == []
    assert ec2.describe_volumes(VolumeIds=[kept])["Volumes"], "another cluster's volume went too"


def test_up_runs_the_gpu_roles_on_the_gpu_instances_only(tmp_path: Path) -> None:
    """The inventory ``up`` writes for a g5 group and a c7i group puts each instance in its group
    with its type, and site.yml (what ``up`` runs) configures every node, then the gpu group
    again with playbooks/gpu.yml's roles: preflight, toolkit, the image with its GPUs, NCCL."""
    state = ClusterState("mixed", tmp_path / "mixed")
    login = SshLogin(user="ubuntu", identity_file=tmp_path / "id", known_hosts=tmp_path / "known", jump="root@1.2.3.4")
    nodes = [
        Node(name=name, address=f"10.77.1.{i + 4}", workdir=Path("/mnt/infractl"), processes=1, ssh=login)
        for i, name in enumerate(["gpu-0", "cpu-0"])
    ]
    control = AwsNodes(state, nodes, instance_types={"gpu-0": "g5.12xlarge", "cpu-0": "c7i.4xlarge"})
    inventory = playbook.inventory_of(state.dir, control)
    assert inventory["all"]["children"] == {"gpu": {"hosts": {"gpu-0": {}}}, "cpu": {"hosts": {"cpu-0": {}}}}
    hosts = inventory["all"]["hosts"]
    assert (hosts["gpu-0"]["node_instance_type"], hosts["gpu-0"]["ansible_become"]) == ("g5.12xlarge", True)
    assert hosts["gpu-0"]["container_runtime_cli"] == ["/usr/bin/docker"]  # Docker's daemon serves --gpus
    # Every container of the image on a GPU instance (the trainer's as the health gate's) gets the GPUs;
    # the EFA devices only on a type that has them.
    trainer = control.containers("gpu-0").run_prefix()
    assert hosts["gpu-0"]["container_runtime_run"] == trainer and "--gpus=all" in trainer
    assert (
        "--device=/dev/infiniband" not in trainer
        and "--device=/dev/infiniband" in engine_for("p5.48xlarge").run_prefix()
    )
    assert "--gpus=all" not in control.containers("cpu-0").run_prefix()
    path = write(tmp_path / "hosts.json", json.dumps(inventory))

    def listed(what: str) -> list[str]:
        done = subprocess.run(
            [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(path), what, "site.yml"],
            cwd=playbook.playbook_dir(),
            capture_output=True,
            text=True,
            check=True,
        )
        return [line.strip() for line in done.stdout.splitlines() if line.strip()]

    plays = listed("--list-hosts")
    first, second = plays.index("pattern: ['all']"), plays.index("pattern: ['gpu']")
    assert plays[first + 1] == "hosts (2):" and sorted(plays[first + 2 : first + 4]) == ["cpu-0", "gpu-0"]
    assert plays[second + 1 :] == ["hosts (1):", "gpu-0"]
    tasks = listed("--list-tasks")
    gpu_play = tasks[tasks.index(next(t for t in tasks if t.startswith("play #2 (gpu)"))) :]
    roles = {task.split(" : ")[0] for task in gpu_play if " : " in task}
    assert roles == {"gpu_preflight", "container_runtime", "trainer_image", "nccl_env", "nccl_health"}


def test_train_sizes_runs_against_the_smallest_device_of_the_node_groups(cli: Cli) -> None:
    import yaml

    example = yaml.safe_load(EXAMPLE.read_text())
    provider = provider_named("aws")

    def device(groups: dict[str, Any], **fields: Any) -> Device:
        config = example | {"nodes": sum(g["nodes"] for g in groups.values()), **fields}
        config["aws"] = example["aws"] | {"node_groups": groups}
        path = write(cli.cwd / "cluster.yaml", yaml.safe_dump(config))
        return provider.device(load_cluster(path), {})

    assert provider.device(load_cluster(EXAMPLE), {}) == CATALOG["h100-80gb"]
    p4d = {"instance_type": "p4d.24xlarge", "nodes": 1}
    assert device({"a": p4d, "b": {"instance_type": "p5.48xlarge", "nodes": 1}}) == CATALOG["a100-40gb"]
    assert device({"a": {"instance_type": "g5.12xlarge", "nodes": 2}}) == Device("NVIDIA A10G", 24 * 10**9, None, True)
    # A CPU type's memory is shared by its ranks.
    cpu = device({"a": {"instance_type": "c7i.4xlarge", "nodes": 2}}, processes_per_node=2)
    assert cpu == Device("cpu (c7i.4xlarge)", 16 << 30, None, False)
