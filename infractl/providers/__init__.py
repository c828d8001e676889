"""Providers: where a cluster's nodes come from (cluster.yaml's ``provider``) and how the control
plane reaches them. Each provider is a ``contract.Provider`` registered with its cluster.yaml
section through an entry point (``register_every``), so ``up``, ``teardown``, the launcher,
status and the drills never branch on the provider themselves, and nothing outside this package
names one.

- ``local.py``: nodes are work directories and process trees on this machine.
- ``netns.py``: nodes are network namespaces on this machine, each with its own address and sshd
  (infra/netns), reached over SSH.
- ``ssh/``: the team's own machines, reached over SSH with pinned host keys (no Terraform module).
- ``aws/``: GPU instances (infra/aws), swept by the cluster's tag after destroy (its
  ``__init__`` lists its modules).

What every provider shares, one concern a module: ``contract.py`` (``Provider`` and the registry),
``nodecontrol.py`` (``NodeControl``, ``Watch``), ``servers.py`` (where the cluster's own servers
run), ``engines.py`` (how a node runs containers, and the trainer image's contract); ``remote.py``
is node control over SSH, for providers whose nodes are other machines. Adding a provider is a
module or package that implements ``Provider`` (with its cluster.yaml section as ``config``, and
a Terraform module or none) and names it under the ``infractl.providers`` entry point group, in
infractl's pyproject.toml or a package of its own; ``register_every`` loads every one, the first
time a provider or cluster.yaml's table of them is needed.
"""

from __future__ import annotations

import functools
import importlib.metadata

from infractl.errors import InfractlError
from infractl.providers.contract import Provider, every_provider, provider_named, register
from infractl.providers.nodecontrol import LINK_FAULTS, NodeControl, Watch
from infractl.statedir import ClusterState

__all__ = [
    "ENTRY_POINT_GROUP",
    "LINK_FAULTS",
    "NodeControl",
    "Provider",
    "Watch",
    "control",
    "every",
    "get",
    "of",
    "register_every",
]

#: The entry point group a provider registers in: ``<name> = "<module>:<Provider class>"``.
ENTRY_POINT_GROUP = "infractl.providers"


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
    return get(state.record().spec.provider)


def control(state: ClusterState) -> NodeControl:
    """How the control plane reaches the nodes of a cluster that is up."""
    record = state.record()
    return get(record.spec.provider).control(state, record.nodes)


@functools.cache
def register_every() -> None:
    """Register every installed provider: each entry point of the ``infractl.providers`` group
    names a ``Provider`` class by the provider's name (infractl's own in its pyproject.toml; a
    package outside this repository adds one the same way). Not on import: every command imports
    this package, and ``--help`` or a command refused at its options never needs a provider."""
    found: dict[str, str] = {}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {entry.name!r} of {entry.dist.name if entry.dist else 'an unknown package'}"
        if entry.name in found:
            raise InfractlError(f"provider {entry.name!r} is installed twice: by {found[entry.name]} and by {where}")
        found[entry.name] = where
        try:
            loaded = entry.load()
        except Exception as exc:  # a provider's own import error, whatever it is, names the provider
            raise InfractlError(f"provider {entry.name!r} ({where}) cannot be loaded: {exc}") from exc
        if not (isinstance(loaded, type) and issubclass(loaded, Provider)) or loaded.name != entry.name:
            raise InfractlError(
                f"provider {entry.name!r} ({where}) names {entry.value}, which is not a Provider class named "
                f"{entry.name!r}"
            )
        register(loaded())
    if not found:  # an install from before providers were entry points (an editable one not reinstalled)
        raise InfractlError(
            f"no provider is installed: infractl's {ENTRY_POINT_GROUP!r} entry points are missing; reinstall "
            "infractl (pip install -e . in a checkout, or scripts/bootstrap.sh)"
        )
