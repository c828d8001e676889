"""The instances as the control plane reaches them (``AwsNodes``: over SSH through the controller,
infractl's node side in the cluster's image, no operator credential passed on), how each instance
type runs containers (``engine_for``), and what the apply learnt of the instances that the cluster
record does not hold (``Provisioned``, ``<state>/aws.json``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from infractl.errors import InfraError
from infractl.node import Node
from infractl.providers.aws.spec import instance_types
from infractl.providers.engines import DOCKER, ContainerEngine
from infractl.providers.remote import ImageNodes
from infractl.statedir import ClusterState, write_private
from trainer.preemption import SPOT_NOTICE_ENV

__all__ = ["REGISTRY_PORT", "AwsNodes", "Provisioned", "engine_for"]

#: An instance's metadata service (IMDS), as every instance reaches it.
_METADATA_URL = "http://169.254.169.254/latest"
#: The registry's port on the controller (the rendezvous endpoint's is ``aws.rendezvous_port``).
REGISTRY_PORT = 5000
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


@dataclass(frozen=True)
class Provisioned:
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
    def load(cls, state: ClusterState) -> Provisioned | None:
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

    @classmethod
    def of(cls, state: ClusterState) -> Provisioned:
        """What ``provisioned`` kept; ``InfraError`` before."""
        found = cls.load(state)
        if found is None:
            raise InfraError(f"cluster {state.name!r} has no provisioned instances (run `infractl up`)")
        return found


class AwsNodes(ImageNodes):
    """Instances, over SSH through the controller; an instance has no infractl of its own."""

    withheld = _CREDENTIAL_VARIABLES

    def __init__(self, state: ClusterState, nodes: Sequence[Node], *, instance_types: Mapping[str, str]) -> None:
        super().__init__(state, nodes)
        self._types = dict(instance_types)

    def containers(self, node: str) -> ContainerEngine:
        return engine_for(self._types[node])

    def agent_env(self, node: str) -> dict[str, str]:
        """Every instance's agent polls its metadata service for a spot interruption notice (on an
        on-demand instance there never is one) and takes it as the preemption it announces."""
        return {SPOT_NOTICE_ENV: _METADATA_URL}

    def ansible_host(self, node: str) -> dict[str, Any]:
        """A fresh instance has no work directory yet: the base role makes it."""
        return super().ansible_host(node) | {"base_create_workdir": True, "node_instance_type": self._types[node]}

    def host_group(self, node: str) -> str | None:
        """``gpu`` for an instance type with GPUs (playbooks/gpu.yml's hosts), else ``cpu``."""
        return "gpu" if instance_types()[self._types[node]]["gpus"] > 0 else "cpu"
