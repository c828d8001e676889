"""Providers: where a cluster's nodes come from (cluster.yaml's ``provider``) and how the control
plane reaches them. Each provider is a ``contract.Provider`` registered with its cluster.yaml
section (``contract.register``), so ``up``, ``teardown``, the launcher, status and the drills
never branch on the provider themselves, and nothing outside this package names one.

- ``local.py``: nodes are work directories and process trees on this machine.
- ``netns.py``: nodes are network namespaces on this machine, each with its own address and sshd
  (infra/netns), reached over SSH.
- ``aws/``: GPU instances (infra/aws), swept by the cluster's tag after destroy (its
  ``__init__`` lists its modules).

What every provider shares, one concern a module: ``contract.py`` (``Provider`` and the registry),
``nodecontrol.py`` (``NodeControl``, ``Watch``), ``servers.py`` (where the cluster's own servers
run), ``engines.py`` (how a node runs containers, and the trainer image's contract); ``remote.py``
is node control over SSH, for providers whose nodes are other machines. Adding a provider is a
module or package here that implements ``Provider`` and calls ``register`` (plus its Terraform
module in ``infra/<name>/`` and its tests); ``register_every`` imports every one, the first time a
provider or cluster.yaml's table of them is needed.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from infractl.infra import Node
from infractl.providers.contract import Provider, every_provider, provider_named
from infractl.providers.nodecontrol import LINK_FAULTS, NodeControl, Watch
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
    """Import every provider module (every module of a provider's package too): each provider
    registers itself and its cluster.yaml section. Not on import: every command imports this
    package, and ``--help`` or a command refused at its options never needs a provider."""
    for module in pkgutil.walk_packages(__path__, prefix=f"{__name__}."):
        importlib.import_module(module.name)
