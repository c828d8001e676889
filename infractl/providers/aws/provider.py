"""The ``aws`` provider (``Aws``): infra/aws's root module (provider, state backend, the
controller's outputs), the nodes it provisioned, where the cluster's servers run (the
controller), and what ``teardown`` does around ``terraform destroy`` (the store's bucket, the
state lock, the sweep)."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from infractl import infra
from infractl.config import ClusterSpec
from infractl.infra import ApplyResult, RootSettings
from infractl.node import Node, SshLogin
from infractl.planning.devices import CATALOG, Device
from infractl.providers.aws.account import check_account
from infractl.providers.aws.buckets import empty_bucket, has_state, release_stale_lock, s3_answers, state_key
from infractl.providers.aws.nodes import REGISTRY_PORT, AwsNodes, Provisioned, engine_for
from infractl.providers.aws.pricing import DRY_RUN_KEYS, cost, planned_resources
from infractl.providers.aws.spec import CONFIG, AwsSpec, aws_settings, instance_types, module_variables
from infractl.providers.aws.ssh import ClusterKeys, HostKeys, ssh_hosts, wait_for_ssh
from infractl.providers.aws.sweep import CLUSTER_TAG, reap, reap_orphan, sweep, tagged_clusters
from infractl.providers.contract import Plan, Provider
from infractl.providers.nodecontrol import NodeControl
from infractl.providers.remote import SYSTEM_PYTHON, RemoteServers, SshNodes
from infractl.providers.servers import LocalServers, ServerHost
from infractl.statedir import ClusterIntent, ClusterState, Orphan

__all__ = ["Aws"]

_PROVIDER_SOURCE = "hashicorp/aws"
#: The provider versions infra/aws supports (its versions.tf says the same).
_PROVIDER_VERSIONS = ">= 5.100, < 7.0"
#: The AWS APIs Terraform calls for infra/aws (``aws.endpoint_url`` serves them all).
_SERVICES = ("ec2", "iam", "s3", "ssm", "sts")


class Aws(Provider):
    name = "aws"
    config = CONFIG
    serves_images = True

    def terraform_module(self) -> Path:
        """infra/aws: the instances, their network, roles and the store's bucket."""
        return infra.module_dir(self.name)

    def variables(self, spec: ClusterSpec, state: ClusterState) -> dict[str, object]:
        return module_variables(spec, ClusterKeys.of(spec, state).variables())

    def dry_run(self, spec: ClusterSpec, state: ClusterState) -> Plan:
        """What ``infractl up`` would do for ``spec``, computed offline: the module's variables, the
        resources it would create, and the hourly cost at prices.json's list prices."""
        variables = module_variables(spec, DRY_RUN_KEYS)
        return Plan(
            provider=self.name,
            module=f"infra/{self.name}",
            region=aws.region if (aws := spec.settings(AwsSpec)) else None,
            variables={name: value for name, value in variables.items() if name not in DRY_RUN_KEYS},
            resources=tuple(planned_resources(variables)),
            cost=cost(variables),
        )

    def device(self, spec: ClusterSpec, environ: Mapping[str, str]) -> Device:
        """The smallest device of the node groups' instance types: one GPU (instances.json's
        ``planner_device``, else its ``gpu_memory_gib`` GB), or on a CPU type the instance's memory
        shared by its ranks."""
        aws = spec.settings(AwsSpec)
        assert aws is not None
        table = instance_types()
        found = []
        for group in aws.node_groups.values():
            entry = table[group.instance_type]
            if entry["gpus"] == 0:
                memory = entry["memory_gib"] * (1 << 30) // spec.processes_per_node
                found.append(Device(f"cpu ({group.instance_type})", memory, None, False))
            elif entry["planner_device"] is not None:
                found.append(CATALOG[entry["planner_device"]])
            else:
                found.append(Device(entry["gpu_model"], entry["gpu_memory_gib"] * 10**9, None, True))
        return min(found, key=lambda d: d.memory_bytes)

    def root_settings(self, spec: ClusterSpec, state: ClusterState) -> RootSettings:
        """The root module around infra/aws: the provider (region, the cluster's tag on everything
        through default_tags, ``aws.endpoint_url`` for every service), the state in
        ``aws.state_bucket`` locked with an S3 lock file, the controller's and the network's
        outputs, and a CLI configuration installing the provider from ``aws.provider_mirror``."""
        aws = spec.settings(AwsSpec)
        assert aws is not None
        provider: dict[str, Any] = {
            "region": aws.region,
            "default_tags": [{"tags": {CLUSTER_TAG: spec.name, "infractl:managed-by": "infractl"}}],
        }
        backend: dict[str, Any] = {
            "bucket": aws.state_bucket,
            "key": state_key(spec.name),
            "region": aws.region,
            "use_lockfile": True,
            "encrypt": True,
        }
        if aws.endpoint_url is not None:
            provider |= {"endpoints": [dict.fromkeys(_SERVICES, aws.endpoint_url)], "s3_use_path_style": True}
            backend |= {"endpoints": dict.fromkeys(("s3", "sts", "iam"), aws.endpoint_url), "use_path_style": True}
        blocks: dict[str, Any] = {
            "terraform": {
                "required_providers": {"aws": {"source": _PROVIDER_SOURCE, "version": _PROVIDER_VERSIONS}},
                "backend": {"s3": backend},
            },
            "provider": {"aws": provider},
        }
        bucket = urlsplit(spec.store or "").netloc
        if aws.create_bucket and s3_answers("head_bucket", bucket, aws.region, aws.endpoint_url):
            # A bucket an earlier teardown kept (see before_destroy) is taken back, not created again;
            # for a bucket already in the state the import is a no-op. So are its lifecycle rules when
            # it has them: made again, the AWS provider waits about a minute for them to settle (it
            # reads them until three reads agree), where an import reads them once.
            taken = ["aws_s3_bucket"]
            if s3_answers("get_bucket_lifecycle_configuration", bucket, aws.region, aws.endpoint_url):
                taken.append("aws_s3_bucket_lifecycle_configuration")
            blocks["import"] = [{"to": f"module.cluster.{kind}.this[0]", "id": bucket} for kind in taken]
        cli_config = ""
        if aws.provider_mirror is not None:
            mirror = json.dumps(str(Path(aws.provider_mirror).expanduser()))
            source = json.dumps(f"registry.terraform.io/{_PROVIDER_SOURCE}")
            cli_config = (
                "provider_installation {\n"
                f"  filesystem_mirror {{\n    path    = {mirror}\n    include = [{source}]\n  }}\n"
                f"  direct {{\n    exclude = [{source}]\n  }}\n"
                "}\n"
            )
        return RootSettings(blocks=blocks, outputs=("controller", "network", "bucket"), cli_config=cli_config)

    def provisioned(self, spec: ClusterSpec, state: ClusterState, applied: ApplyResult | None) -> list[Node]:
        """The nodes, reached over SSH through the controller (the cluster's only public address)
        with the cluster's key. Every instance's host key is pinned in the cluster's known_hosts:
        user data's bootstrap key, until the instance has made a key of its own over the channel
        pinned to it, before anything else reaches the instance (``HostKeys``)."""
        aws = spec.settings(AwsSpec)
        assert aws is not None and applied is not None  # the provider has a module: up applied it
        keys = ClusterKeys.of(spec, state)
        controller, inventory = applied.outputs["controller"], applied.outputs["inventory"]
        instances = {"controller": controller["instance_id"]} | {i["name"]: i["instance_id"] for i in inventory}
        addresses = {controller["instance_id"]: [controller["public_address"], controller["address"]]}
        addresses |= {item["instance_id"]: [node.address] for node, item in zip(applied.nodes, inventory, strict=True)}
        host_keys = HostKeys(state, " ".join(keys.host_public().split()[:2]), addresses)
        jump = f"{controller['login_user']}@{controller['public_address']}"
        login = SshLogin(user=aws.login_user, identity_file=keys.login, known_hosts=host_keys.known_hosts, jump=jump)
        nodes = [replace(node, ssh=login) for node in applied.nodes]
        direct = replace(login, jump=None)
        reached = Node("controller", controller["public_address"], workdir=Path(aws.workdir), processes=0, ssh=direct)
        hosts = SshNodes(state, [reached, *nodes], python=SYSTEM_PYTHON)
        wait_for_ssh(ssh_hosts(hosts, instances, list(hosts.nodes)), timeout=aws.ssh_timeout_s)
        host_keys.own(hosts, instances, timeout=aws.ssh_timeout_s)
        Provisioned(
            controller=reached,
            private_address=controller["address"],
            instance_types={i["name"]: i["instance_type"] for i in inventory}
            | {"controller": aws.controller_instance_type},
            ports={"rendezvous": aws.rendezvous_port, "registry": REGISTRY_PORT},
        ).save(state)
        return nodes

    def preflight(self, spec: ClusterSpec, state: ClusterState) -> None:
        """The account's checks (``check_account``)."""
        check_account(spec)

    def topology(self, state: ClusterState) -> list[str]:
        """The region and zone, each node's instance type and market, and the controller."""
        spec = state.spec()
        aws = spec.settings(AwsSpec)
        provisioned = Provisioned.of(state)
        assert aws is not None
        nodes = ", ".join(
            f"{name} `{instance_type}`"
            for name, instance_type in provisioned.instance_types.items()
            if name != "controller"
        )
        spot = sorted(name for name, group in aws.node_groups.items() if group.spot)
        return [
            f"AWS region `{aws.region}`, zone `{aws.availability_zone or 'of subnet ' + str(aws.subnet_id)}`; "
            f"instances: {nodes}; spot node groups: {', '.join(spot) or 'none'} (every node's agent takes a spot "
            "interruption notice as a preemption).",
            f"Controller `{provisioned.instance_types['controller']}` (the only public address, the SSH jump host; "
            f"the rendezvous endpoint and the image registry run there): public "
            f"`{provisioned.controller.address}`, private `{provisioned.private_address}`.",
        ]

    def makes_store(self, spec: ClusterSpec) -> bool:
        """``aws.create_bucket``: the module creates the store's bucket."""
        aws = spec.settings(AwsSpec)
        return aws is not None and aws.create_bucket

    def rendezvous_host(self, spec: ClusterSpec, state: ClusterState) -> str:
        """The controller instance's private address: every node reaches it, and it trains nothing."""
        return Provisioned.of(state).private_address

    def image_registry_host(self, spec: ClusterSpec, state: ClusterState) -> str | None:
        """Beside the rendezvous endpoint, on the controller."""
        return self.rendezvous_host(spec, state)

    def servers(self, state: ClusterState) -> ServerHost:
        """On the controller, over SSH. Before it was provisioned (an ``up`` that stopped during its
        apply) none of the cluster's servers runs anywhere: this machine's servers, which are none."""
        provisioned = Provisioned.load(state)
        if provisioned is None:
            return LocalServers(state)
        engine = engine_for(provisioned.instance_types["controller"])
        return RemoteServers(state, provisioned.controller, engine=engine, ports=provisioned.ports)

    def before_destroy(self, state: ClusterState, record: ClusterIntent, *, purge: bool) -> list[str]:
        """A bucket the cluster created outlives it unless ``purge``: kept, it leaves Terraform's
        state (the next ``up`` of the cluster takes it back); purged, every version of every
        object goes first, so destroy can delete it."""
        settings = aws_settings(record.spec)
        said = release_stale_lock(settings, state.name)
        if not settings.create_bucket:
            return said
        bucket = urlsplit(record.store).netloc
        if not purge:
            infra.forget(state.terraform_dir, "module.cluster.aws_s3_bucket")
            return [*said, f"store: bucket {bucket} kept with the runs in it (`teardown --purge` deletes it)"]
        deleted = empty_bucket(bucket, settings.region, endpoint_url=settings.endpoint_url)
        return [*said, f"store: bucket {bucket} emptied ({deleted} object version(s) and delete marker(s)) for destroy"]

    def reap(self, state: ClusterState, record: ClusterIntent, *, purge: bool) -> list[str]:
        """Everything with the cluster's tag or IAM path (see ``reap``): after an interrupted
        ``up``, what Terraform made before it saved its state; with ``purge``, the bucket the
        cluster creates too (``before_destroy`` emptied it)."""
        settings = aws_settings(record.spec)
        deleted = reap(record.name, settings.region, endpoint_url=settings.endpoint_url)
        bucket = urlsplit(record.store).netloc
        if (
            purge
            and settings.create_bucket
            and s3_answers("head_bucket", bucket, settings.region, settings.endpoint_url)
        ):
            import boto3

            boto3.client("s3", region_name=settings.region, endpoint_url=settings.endpoint_url).delete_bucket(
                Bucket=bucket
            )
            deleted.append(f"bucket {bucket}")
        return deleted

    def leftovers(self, state: ClusterState, record: ClusterIntent) -> list[str]:
        """What EC2 still holds with the cluster's tag (see ``sweep``)."""
        settings = aws_settings(record.spec)
        return sweep(record.name, settings.region, endpoint_url=settings.endpoint_url)

    def account_orphans(self, spec: ClusterSpec) -> list[Orphan]:
        """In the account and region of ``spec``'s aws section: every cluster that holds tagged
        resources (or IAM roles under its path) with neither a Terraform state nor its lock in
        ``aws.state_bucket``. Its state is what says a cluster exists, for every controller that
        manages one (this machine's ledger knows this machine's clusters only), and an ``up``
        holds the lock from the start of its apply: a cluster being made now is never taken."""
        settings = spec.settings(AwsSpec)
        assert settings is not None
        found = []
        for name in sorted(tagged_clusters(settings)):
            if has_state(settings, name):
                continue
            held = sweep(name, settings.region, endpoint_url=settings.endpoint_url)
            if held:  # only terminated instances left: nothing costs money or blocks anything
                found.append(
                    Orphan(
                        "aws cluster",
                        f"{name} in {settings.region} (no Terraform state): {', '.join(held)}",
                        functools.partial(reap_orphan, name, settings),
                    )
                )
        return found

    def control(self, state: ClusterState, nodes: Sequence[Node]) -> NodeControl:
        provisioned = Provisioned.load(state)
        return AwsNodes(state, nodes, instance_types=provisioned.instance_types if provisioned else {})
