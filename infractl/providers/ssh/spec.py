"""cluster.yaml's ``ssh:`` section (``SshSpec``): the team's hosts, how infractl logs in to them
(a user, a key, a jump host, the pinned host keys) and where the cluster's servers run, with the
rules across fields."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from infractl.config import ClusterSpec, ProviderConfig, Spec, field_error
from infractl.config.loader import CONFIG_DIR
from infractl.config.spec import Name, node_folder
from infractl.planning.devices import CATALOG

__all__ = ["CONFIG", "ControllerHost", "Host", "JumpHost", "SshSpec", "ssh_settings"]

# A login name as useradd takes it.
_USER = r"^[a-z_][a-z0-9_-]{0,31}$"
# A host name or an IPv4/IPv6 address: what ssh takes as a destination, and nothing a shell reads.
_ADDRESS = r"^[A-Za-z0-9][A-Za-z0-9.:-]{0,252}$"


def _config_path(value: str | None, info: ValidationInfo) -> str | None:
    """A file cluster.yaml names: ``~`` expanded, relative to cluster.yaml's folder (where the
    loader says it is), kept absolute: the cluster record is read from anywhere."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if not path.is_absolute():
        folder = (info.context or {}).get(CONFIG_DIR)
        if folder is None:
            raise ValueError(f"{value!r} must be an absolute path here")
        path = Path(folder) / path
    return str(path)


class _Login(Spec):
    """What may differ from host to host: the login, its port and key (default: the section's)."""

    user: str | None = Field(None, pattern=_USER, description="Login user (root, or one with password-less sudo).")
    port: int | None = Field(None, ge=1, le=65535, description="sshd's port.")
    key: str | None = Field(None, description="Private key file (OpenSSH) that logs in.")

    _key_path = field_validator("key")(_config_path)


class Host(_Login):
    """One of the team's machines that trains."""

    name: Name = Field(description="The node's name in infractl (status, logs, drills).")
    address: str = Field(pattern=_ADDRESS, description="Host name or IP address infractl and the other hosts reach.")
    gpus: int = Field(0, ge=0, le=64, description="GPUs the host must have (checked by `up`).")


class ControllerHost(_Login):
    """A host that trains nothing: the rendezvous endpoint and the image registry run there."""

    address: str = Field(pattern=_ADDRESS, description="Host name or IP address every host reaches.")
    rendezvous_port: int = Field(29400, ge=1024, le=65535, description="The rendezvous endpoint's port.")
    registry_port: int = Field(5000, ge=1024, le=65535, description="The image registry's port.")


class JumpHost(Spec):
    """The bastion infractl reaches the hosts through (``ssh -J``), with the section's key."""

    address: str = Field(pattern=_ADDRESS, description="The jump host's name or address.")
    user: str | None = Field(None, pattern=_USER, description="Login user on the jump host (default: ssh.user).")
    port: int = Field(22, ge=1, le=65535, description="Its sshd's port.")


class SshSpec(Spec):
    """The team's machines (`provider: ssh`): infractl logs in, configures them with the same roles as
    every provider, and at teardown removes only what it put there."""

    user: str = Field(pattern=_USER, description="Login user on every host (root, or one with password-less sudo).")
    key: str = Field(description="Private key file (OpenSSH) that logs in; relative to cluster.yaml's folder.")
    port: int = Field(22, ge=1, le=65535, description="sshd's port on every host.")
    known_hosts: str = Field(
        description=(
            "known_hosts file with every host's key (the jump host's and controller's too); relative to "
            "cluster.yaml's folder. infractl never trusts a key on first use: `infractl keyscan` writes it once "
            "the operator confirms each fingerprint."
        ),
    )
    jump: JumpHost | None = Field(None, description="A jump host in front of the hosts.")
    hosts: list[Host] = Field(min_length=1, max_length=64, description="The machines that train, one node each.")
    controller: Literal["local"] | ControllerHost = Field(
        description=(
            "Where the rendezvous endpoint and the image registry run, never on a training host: a host of its "
            "own, or `local` (this machine: the run then depends on it staying up and reachable from the hosts)."
        ),
    )
    device: str | None = Field(
        None,
        description=(
            "The accelerator each rank trains on, by the planner's catalog name (a100-80gb, h100-80gb, h200, b200, "
            "l40s): `train` refuses a run that does not fit it. Default: the hosts' CPUs, each host's memory taken "
            "to be this machine's, shared by its ranks."
        ),
    )
    workdir: str = Field(
        "/var/lib/infractl",
        description=(
            "Folder on each host that holds the cluster's work directory (<workdir>/<cluster name>), its image "
            "store among it; `teardown` removes the cluster's and this folder when it is left empty."
        ),
    )

    _key_path = field_validator("key", "known_hosts")(_config_path)

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, value: str) -> str:
        return node_folder(value, "/var/lib/infractl")

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str | None) -> str | None:
        if value is not None and value not in CATALOG:
            raise ValueError(f"{value!r} is not a device of the planner's catalog ({', '.join(CATALOG)})")
        return value

    @model_validator(mode="after")
    def _distinct(self) -> SshSpec:
        names = [host.name for host in self.hosts]
        if dupe := next((name for name in names if names.count(name) > 1), None):
            raise field_error("hosts", f"host name {dupe!r} appears twice")
        ends = [(host.address, host.port or self.port) for host in self.hosts]
        if isinstance(self.controller, ControllerHost):
            ends.append((self.controller.address, self.controller.port or self.port))
        if dupe_end := next((end for end in ends if ends.count(end) > 1), None):
            raise field_error("hosts", f"{dupe_end[0]} port {dupe_end[1]} is named twice (hosts and controller)")
        if self.controller == "local" and self.jump is not None:
            raise field_error(
                "controller",
                "`local` cannot serve hosts behind a jump host (they do not reach this machine): name a controller "
                "host among them",
            )
        return self


def _nodes_from_hosts(data: dict[str, Any]) -> dict[str, Any]:
    """``nodes`` defaults to the number of hosts."""
    ssh = data.get("ssh")
    hosts = ssh.get("hosts") if isinstance(ssh, dict) else None
    if "nodes" in data or not isinstance(hosts, list):
        return data
    return data | {"nodes": len(hosts)}


def _check(spec: ClusterSpec) -> None:
    ssh = spec.settings(SshSpec)
    assert ssh is not None  # the loader requires the section first
    if spec.nodes != len(ssh.hosts):
        raise field_error("nodes", f"{spec.nodes} differs from the {len(ssh.hosts)} host(s) of ssh.hosts")
    if spec.runtime.image is None:
        raise field_error(
            "runtime.image",
            "is required with provider ssh (the trainer runs in a container on the team's hosts, which have no "
            "infractl): REPOSITORY@sha256:<64 hex>",
        )
    if spec.store is None:
        raise field_error(
            "store",
            "provider ssh needs a store every host reaches: s3://bucket/prefix, or a file:// folder every host mounts "
            "at the same path",
        )
    for host in ssh.hosts:
        if _loopback(host.address):
            raise field_error("ssh.hosts", f"{host.name}: {host.address} is a loopback address, not a host's")


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"  # another host name


def ssh_settings(spec: ClusterSpec) -> SshSpec:
    ssh = spec.settings(SshSpec)
    assert ssh is not None, "not an ssh cluster"  # the loader refuses provider ssh without its section
    return ssh


CONFIG = ProviderConfig(
    name="ssh",
    help="the team's own machines, reached over SSH with pinned host keys; infractl creates none of them.",
    section=SshSpec,
    section_help="The `ssh` provider's settings; only with provider: ssh.",
    required="user, key, known_hosts, hosts, controller",
    prepare=_nodes_from_hosts,
    check=_check,
)
