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
``infra/<name>/`` and its tests); ``register_every`` imports every module in it, the first time a
provider or cluster.yaml's table of them is needed.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from infractl.infra import Node
from infractl.providers.base import LINK_FAULTS, NodeControl, Provider, Watch, every_provider, provider_named
from infractl.statedir import ClusterState

__all__ = ["LINK_FAULTS", "NodeControl", "Provider", "Watch", "control", "every", "get", "of", "register_every"]


def get(name: str) -> Provider:
    """The provider ``name`` (one of cluster.yaml's ``provider`` values)."""
    register_every()
    return provider_named(name)


def every() -> list[Provider]:
    """Every provider infractl has."""
    register_every()
    return every_provider()


def of(state: ClusterState) -> Provider:
    """The provider of a cluster that is up (``StateError`` otherwise)."""
    return get(str(state.read()["spec"]["provider"]))


def control(state: ClusterState) -> NodeControl:
    """How the control plane reaches the nodes of a cluster that is up."""
    record = state.read()
    return get(str(record["spec"]["provider"])).control(state, [Node.from_record(n) for n in record["nodes"]])


@functools.cache
def register_every() -> None:
    """Import every provider module: each registers itself and its cluster.yaml section. Not on
    import: every command imports this package, and ``--help`` or a command refused at its options
    never needs a provider."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
