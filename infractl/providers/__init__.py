"""Providers: where a cluster's nodes come from (cluster.yaml's ``provider``). One module per
provider, each with the same three functions, so ``up``, ``teardown`` and ``up --dry-run`` never
branch on the provider themselves:

- ``variables(spec, state)``: the Terraform variables of ``infra/<provider>/`` for the cluster;
- ``dry_run(spec, state)``: what ``up`` would create (variables, resource addresses, hourly cost or
  None), computed offline and changing nothing;
- ``leftovers(state, record)``: after ``terraform destroy``, what of the cluster still exists (empty
  when teardown left nothing), one line each.

``local.py``: nodes are work directories and process trees on this machine. ``aws.py``: GPU
instances (infra/aws), swept by the cluster's tag after destroy.
"""

from __future__ import annotations

from typing import Any, Protocol

from infractl.config import ClusterSpec
from infractl.state import ClusterState

__all__ = ["Provider", "get"]


class Provider(Protocol):
    def variables(self, spec: ClusterSpec, state: ClusterState) -> dict[str, object]: ...

    def dry_run(self, spec: ClusterSpec, state: ClusterState) -> dict[str, Any]: ...

    def leftovers(self, state: ClusterState, record: dict[str, Any]) -> list[str]: ...


def get(name: str) -> Provider:
    """The module of provider ``name`` (one of ClusterSpec's ``provider`` values)."""
    from infractl.providers import aws, local

    modules: dict[str, Provider] = {"local": local, "aws": aws}  # mypy checks each module against Provider
    return modules[name]
