"""The contract every provider implements (``Provider``): how a cluster's nodes are made
(Terraform variables, preflight, what destroy may leave behind), where its servers run, and which
``NodeControl`` reaches its nodes; and the registry of providers by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from infractl.config import ClusterSpec, ProviderConfig, register_provider
from infractl.infra import ApplyResult, RootSettings
from infractl.node import Node
from infractl.planning.devices import Device, shared_cpu
from infractl.providers.nodecontrol import NodeControl
from infractl.providers.servers import LocalServers, ServerHost
from infractl.statedir import ClusterIntent, ClusterState, Orphan

__all__ = ["Cost", "CostLine", "KeyScan", "Plan", "Provider", "every_provider", "provider_named", "register"]


@dataclass(frozen=True)
class CostLine:
    """One priced item of a plan."""

    item: str
    """What is priced, in words (``core: 2 x p5.48xlarge on-demand``)."""
    hourly: float
    """Its price per hour, in the cost's currency."""
    note: str = ""
    """What else to know of its price (at another market, say), shown after it."""


@dataclass(frozen=True)
class Cost:
    """What a planned cluster costs per hour."""

    currency: str
    basis: str
    """Where the prices come from (``us-east-1 list prices checked 2026-01-05``)."""
    lines: tuple[CostLine, ...]
    total: float
    """Per hour, every line together."""
    note: str = ""
    """What else to know of the total, shown after it."""
    details: Mapping[str, Any] = field(default_factory=dict)
    """The provider's own breakdown, for ``--json`` only (its keys beside the others)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.details,
            "currency": self.currency,
            "basis": self.basis,
            "lines": [asdict(line) for line in self.lines],
            "total": self.total,
            "note": self.note,
        }


@dataclass(frozen=True)
class Plan:
    """What ``up`` would make for a cluster (``infractl up --dry-run``), computed offline."""

    provider: str
    module: str | None
    """The Terraform module ``up`` would apply (``infra/aws``); None for a provider without one."""
    region: str | None
    """Where the cluster would be (a cloud's region), where the provider has such a thing."""
    variables: Mapping[str, object]
    """The module's variables (none without a module)."""
    resources: tuple[str, ...]
    """What would be created: the module's resource addresses."""
    cost: Cost | None
    """What it would cost per hour; None when it costs nothing (``cost_note`` says why)."""
    cost_note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "module": self.module,
            "region": self.region,
            "variables": dict(self.variables),
            "resources": list(self.resources),
            "cost": self.cost.to_dict() if self.cost is not None else None,
            "cost_note": self.cost_note,
        }


@dataclass(frozen=True)
class KeyScan:
    """The host keys a cluster's hosts offer now (``infractl keyscan``), for the operator to confirm
    before they are pinned."""

    path: Path
    """The known_hosts file cluster.yaml names, where they are pinned once confirmed."""
    entries: tuple[tuple[str, str], ...]
    """(host name, known_hosts line) for every key offered."""


class Provider(ABC):
    """One kind of node. ``up``, ``teardown`` and ``up --dry-run`` call these and never branch on
    the provider themselves."""

    name: ClassVar[str]
    #: What the provider adds to cluster.yaml (its ``name``, its own section and rules).
    config: ClassVar[ProviderConfig]
    #: The nodes pull the pinned image from the cluster's own registry (``image_registry_host``).
    serves_images: ClassVar[bool] = False
    #: The nodes share this machine's user accounts: what ``up`` made there for the access roles
    #: (Unix groups) outlives ``terraform destroy`` and is removed by ``teardown``. (A real node's
    #: groups go with the machine.)
    shares_host_accounts: ClassVar[bool] = False

    def terraform_module(self) -> Path | None:
        """The Terraform module that makes the cluster's nodes (``up`` applies a copy of it in the
        state directory, ``teardown`` destroys what it made); None for a provider that makes no
        machines (the team's own, say): ``up`` and ``teardown`` then run no Terraform, and the
        nodes are what ``provisioned`` says without an apply."""
        return None

    def variables(self, spec: ClusterSpec, state: ClusterState) -> dict[str, object]:
        """The variables of the provider's Terraform module for the cluster (none without one)."""
        return {}

    @abstractmethod
    def dry_run(self, spec: ClusterSpec, state: ClusterState) -> Plan:
        """What ``up`` would create (variables, resource addresses, hourly cost or None), computed
        offline and changing nothing."""

    @abstractmethod
    def preflight(self, spec: ClusterSpec, state: ClusterState) -> None:
        """What this machine must offer before ``up`` changes anything (a ``UsageError`` or
        ``ConfigError`` naming the field otherwise)."""

    def root_settings(self, spec: ClusterSpec, state: ClusterState) -> RootSettings:
        """What the root module that calls the provider's module adds (provider and backend blocks,
        outputs, the Terraform CLI configuration): nothing where the module needs no provider."""
        return RootSettings()

    def device(self, spec: ClusterSpec, environ: Mapping[str, str]) -> Device:
        """The device each rank of the cluster trains on, as ``up`` provisions it (``train`` refuses
        a run that does not fit it). Here: nodes on this machine, whose ranks share its memory,
        or the emulated device ``$INFRACTL_DEVICE_MEMORY`` in ``environ`` sets."""
        return shared_cpu(spec.nodes * spec.processes_per_node, environ)

    def provisioned(self, spec: ClusterSpec, state: ClusterState, applied: ApplyResult | None) -> list[Node]:
        """The cluster's nodes as the control plane reaches them: those of the module's apply (its
        inventory, where it says all of that itself), or, without a Terraform module (``applied``
        is None), the machines the provider has for the cluster, which it must say here."""
        if applied is None:
            raise NotImplementedError(f"provider {self.name!r} has no Terraform module and does not say its nodes")
        return applied.nodes

    def topology(self, state: ClusterState) -> list[str]:
        """What the handover's topology says of a cluster that is up beyond its nodes (one line of
        Markdown each): where its hosts run, what they are. Nothing by default."""
        return []

    def notes(self, spec: ClusterSpec) -> list[str]:
        """What ``up`` tells the operator of the cluster besides its steps, one line each (a
        dependency they must know of). Nothing by default."""
        return []

    def lost_node(self, spec: ClusterSpec) -> str:
        """What the node-failure runbook tells a person to do about a node that does not come back
        (Markdown). Here: the provider makes nodes, so ``up`` makes it again."""
        return (
            f"`infractl up -c {spec.name}` makes a node that is gone again (the provider's module replaces "
            "what no longer exists), then `infractl rejoin NODE --run RUN` takes it back into the run; the run "
            "goes on on the surviving nodes meanwhile."
        )

    def makes_store(self, spec: ClusterSpec) -> bool:
        """Whether the module creates the cluster's store (so it cannot be checked before ``up``
        applies it)."""
        return False

    @abstractmethod
    def rendezvous_host(self, spec: ClusterSpec, state: ClusterState) -> str:
        """The address the cluster's rendezvous endpoint listens on, reachable from every node."""

    def image_registry_host(self, spec: ClusterSpec, state: ClusterState) -> str | None:
        """Where the cluster's own image registry listens (``infractl.image.registry``), reachable
        from every node (once provisioned); None where the nodes run no image (``local``)."""
        return None

    def servers(self, state: ClusterState) -> ServerHost:
        """Where the cluster's own servers run (the rendezvous endpoint, the image registry): this
        machine, unless the provider has a host of the cluster for them."""
        return LocalServers(state)

    def before_destroy(self, state: ClusterState, record: ClusterIntent, *, purge: bool) -> list[str]:
        """Just before ``terraform destroy`` (or its place, for a provider without a module), every
        process stopped and with ``purge`` every run deleted: make the state say what destroy may
        remove. Lines saying what was done."""
        return []

    def reap(self, state: ClusterState, record: ClusterIntent, *, purge: bool) -> list[str]:
        """After ``terraform destroy`` (or its place) of an ``up`` that was interrupted (its Terraform
        state may lack what it made last): delete what is still the cluster's by the provider's own marks
        (its tag), the store it made too with ``purge``. What was deleted, one item each; nothing
        where destroy leaves nothing unnamed."""
        return []

    @abstractmethod
    def leftovers(self, state: ClusterState, record: ClusterIntent) -> list[str]:
        """After ``terraform destroy`` (or its place) and after every node process was stopped: what
        of the cluster still exists, one line each (empty when nothing is left)."""

    @abstractmethod
    def control(self, state: ClusterState, nodes: Sequence[Node]) -> NodeControl:
        """How the control plane reaches ``nodes`` (the cluster's, as provisioned)."""

    def scan_host_keys(self, spec: ClusterSpec) -> KeyScan | None:
        """The keys the cluster's hosts offer now, for ``infractl keyscan`` to pin once the operator
        confirms them; None where the provider pins its nodes' keys itself (it makes the nodes)."""
        return None

    def orphans(self, owned: set[str]) -> list[Orphan]:
        """What the provider makes on this machine under a cluster's ``short_id`` and no started
        cluster (``owned``: their ids) owns: an interrupted test run's, a deleted state
        directory's. Nothing where it makes nothing outside the state directory."""
        return []

    def account_orphans(self, spec: ClusterSpec) -> list[Orphan]:
        """What the provider's account holds, where ``spec`` points (its account and region), of
        clusters whose state is gone from everywhere, not just from this machine. Nothing for a
        provider whose clusters live on this machine alone."""
        return []


_PROVIDERS: dict[str, Provider] = {}


def register(provider: Provider) -> None:
    """Make ``provider`` known, and its cluster.yaml section with it (``providers.register_every``
    registers each installed provider once)."""
    if provider.config.name != provider.name:
        raise ValueError(f"provider {provider.name!r} registers the config of {provider.config.name!r}")
    _PROVIDERS[provider.name] = provider
    register_provider(provider.config)


def provider_named(name: str) -> Provider:
    """The provider ``name`` (one of cluster.yaml's ``provider`` values)."""
    return _PROVIDERS[name]


def every_provider() -> list[Provider]:
    return list(_PROVIDERS.values())
