"""The ``local`` provider: a node is a work directory under the cluster's state directory
(``nodes/node-<i>``, made by infra/local's ``terraform_data``) plus the process tree infractl starts
in it. Nothing leaves this machine and nothing costs money."""

from __future__ import annotations

from typing import Any

from infractl.config import ClusterSpec, ProviderConfig, register_provider
from infractl.state import ClusterState

__all__ = ["variables", "dry_run", "leftovers", "preflight", "rendezvous_host"]

register_provider(ProviderConfig(name="local", help="nodes are process trees on this machine.", default=True))


def variables(spec: ClusterSpec, state: ClusterState) -> dict[str, object]:
    return {
        "cluster_name": spec.name,
        "nodes": spec.nodes,
        "processes_per_node": spec.processes_per_node,
        "state_dir": str(state.dir),
    }


def dry_run(spec: ClusterSpec, state: ClusterState) -> dict[str, Any]:
    """infra/local makes one ``terraform_data.node`` per node: that is the whole plan."""
    return {
        "provider": "local",
        "module": "infra/local",
        "region": None,
        "variables": variables(spec, state),
        "resources": [f"terraform_data.node[{index}]" for index in range(spec.nodes)],
        "cost": None,
    }


def leftovers(state: ClusterState, record: dict[str, Any]) -> list[str]:
    """Node directories ``terraform destroy`` left behind."""
    nodes_dir = state.dir / "nodes"
    return [f"node directory {p}" for p in sorted(nodes_dir.iterdir())] if nodes_dir.is_dir() else []


def preflight(spec: ClusterSpec, state: ClusterState) -> None:
    """Nothing to check beyond what ``up`` checks for every provider."""


def rendezvous_host(spec: ClusterSpec, state: ClusterState) -> str:
    """Every node is this machine: the endpoint listens on its loopback."""
    return "127.0.0.1"
