"""cluster.yaml's ``aws:`` section (``AwsSpec``, its ``NodeGroup``s) with the rules across fields,
and infra/aws's variables for a cluster (``module_variables``) and tables (``instance_types``,
``prices``)."""

from __future__ import annotations

import functools
import ipaddress
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from infractl import infra
from infractl.config import ClusterSpec, ProviderConfig, Spec, field_error
from infractl.config.spec import node_folder
from infractl.errors import InfraError

__all__ = ["CONFIG", "AwsSpec", "NodeGroup", "aws_settings", "instance_types", "module_variables", "prices", "tls"]

_GROUP_NAME = r"^[a-z][a-z0-9]{0,15}$"
_AWS_ID = r"^{kind}-[0-9a-f]{{8,17}}$"


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
        return node_folder(value, "/opt/dlami/nvme/infractl")

    @field_validator("ssh_key", "provider_mirror")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).expanduser().is_absolute():
            raise ValueError(f"{value!r} must be an absolute path (or start with ~)")
        return value


def aws_settings(spec: ClusterSpec) -> AwsSpec:
    """The ``aws:`` section of an aws cluster's spec (the loader refuses an aws cluster without one)."""
    aws = spec.settings(AwsSpec)
    if aws is None:
        raise InfraError(f"cluster {spec.name!r} has no aws section: not an aws cluster")
    return aws


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
    plain = {} if tls(aws) else {"require_tls": False}
    return {
        "cluster_name": spec.name,
        "processes_per_node": spec.processes_per_node,
        "store_bucket": store.netloc,
        "store_prefix": store.path.strip("/"),
        **settings,
        **plain,
        **keys,
    }


def tls(aws: AwsSpec) -> bool:
    """Whether the store's bucket must refuse requests without TLS: not where ``aws.endpoint_url``
    is plain HTTP (a private or emulated AWS), whose requests it would then all refuse."""
    return not (aws.endpoint_url or "").startswith("http://")


@functools.cache
def _read_json(name: str) -> Any:
    """A table of infra/aws, read once per process (validation looks types up per node group);
    callers only read it."""
    return json.loads((infra.module_dir("aws") / name).read_text())


CONFIG = ProviderConfig(
    name="aws",
    help="GPU instances (infra/aws), configured by Ansible, training in the pinned container image.",
    section=AwsSpec,
    section_help="The `aws` provider's settings; only with provider: aws.",
    required="region, state_bucket, node_groups",
    prepare=_ranks_per_gpu,
    check=_check,
)
