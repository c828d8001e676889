"""Providers: where a cluster's nodes come from (cluster.yaml's ``provider``). One module per
provider, each with the same three functions, so ``up``, ``teardown`` and ``up --dry-run`` never
branch on the provider themselves:

- ``variables(spec, state)``: the Terraform variables of ``infra/<provider>/`` for the cluster;
- ``dry_run(spec, state)``: what ``up`` would create (variables, resource addresses, hourly cost or
  None), computed offline and changing nothing;
- ``leftovers(state, record)``: after ``terraform destroy``, what of the cluster still exists (empty
  when teardown left nothing), one line each;
- ``preflight(spec, state)``: what this machine must offer before ``up`` changes anything (a
  ``UsageError`` or ``ConfigError`` naming the field otherwise);
- ``rendezvous_host(spec, state)``: the address the cluster's rendezvous endpoint listens on,
  reachable from every node.

``local.py``: nodes are work directories and process trees on this machine. ``netns.py``: nodes
are network namespaces on this machine, each with its own address and sshd (infra/netns).
``aws.py``: GPU instances (infra/aws), swept by the cluster's tag after destroy.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Protocol, cast

from infractl.config import ClusterSpec
from infractl.state import ClusterState

__all__ = ["Provider", "get"]


class Provider(Protocol):
    def variables(self, spec: ClusterSpec, state: ClusterState) -> dict[str, object]: ...

    def dry_run(self, spec: ClusterSpec, state: ClusterState) -> dict[str, Any]: ...

    def leftovers(self, state: ClusterState, record: dict[str, Any]) -> list[str]: ...

    def preflight(self, spec: ClusterSpec, state: ClusterState) -> None: ...

    def rendezvous_host(self, spec: ClusterSpec, state: ClusterState) -> str: ...


def get(name: str) -> Provider:
    """The module of provider ``name`` (one of ClusterSpec's ``provider`` values)."""
    return cast(Provider, importlib.import_module(f"{__name__}.{name}"))


# Every provider module registers its cluster.yaml section on import (config.register_provider).
for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
