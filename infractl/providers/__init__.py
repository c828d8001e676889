"""Providers: where a cluster's nodes come from (cluster.yaml's ``provider``) and how the control
plane reaches them. One module per provider, each a ``base.Provider`` registered with its
cluster.yaml section (``base.register``), so ``up``, ``teardown``, the launcher, status and the
drills never branch on the provider themselves, and nothing outside this package names one.

- ``local.py``: nodes are work directories and process trees on this machine.
- ``netns.py``: nodes are network namespaces on this machine, each with its own address and sshd
  (infra/netns), reached over SSH.
- ``aws.py``: GPU instances (infra/aws), swept by the cluster's tag after destroy.

``base.py`` is the interface (``Provider``, ``NodeControl``, ``Watch``); ``remote.py`` is node
control over SSH, for providers whose nodes are other machines. Adding a provider is one module
here that implements ``Provider`` and calls ``register`` (plus its Terraform module in
``infra/<name>/`` and its tests); importing this package imports every module in it.
"""

from __future__ import annotations

import importlib
import pkgutil

from infractl.infra import Node
from infractl.providers.base import LINK_FAULTS, NodeControl, Provider, Watch, every_provider, provider_named
from infractl.state import ClusterState

__all__ = ["LINK_FAULTS", "NodeControl", "Provider", "Watch", "control", "every", "get", "of"]


def get(name: str) -> Provider:
    """The provider ``name`` (one of cluster.yaml's ``provider`` values)."""
    return provider_named(name)


def every() -> list[Provider]:
    """Every provider infractl has."""
    return every_provider()


def of(state: ClusterState) -> Provider:
    """The provider of a cluster that is up (``StateError`` otherwise)."""
    return get(str(state.read()["spec"]["provider"]))


def control(state: ClusterState) -> NodeControl:
    """How the control plane reaches the nodes of a cluster that is up."""
    record = state.read()
    return get(str(record["spec"]["provider"])).control(state, [Node.from_record(n) for n in record["nodes"]])


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
