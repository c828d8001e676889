"""cluster.yaml: where training runs. The fields every provider shares are here; each provider
adds its own section (``aws:``, say) and rules with its ``ProviderConfig``, registered with the
provider (``infractl.providers.register_every``), so this module names none of them.

The model the loader validates against (``cluster_model()``) is built once from the registered
providers: ``provider`` accepts exactly their names, each section is an optional field, and the
default provider also names the built-in cluster.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from pydantic import Field, create_model, field_validator, model_validator

from infractl.config.loader import load
from infractl.config.spec import Name, Spec, field_error

__all__ = [
    "IMAGE_REFERENCE",
    "ClusterSpec",
    "ProviderConfig",
    "RuntimeSpec",
    "cluster_model",
    "default_cluster",
    "default_cluster_name",
    "load_cluster",
    "parse_cluster",
    "register_provider",
]

#: The package whose ``register_every()`` registers every installed provider (see
#: ``register_provider``). Imported by name the first time the table is needed, so this module
#: depends on no provider.
_PROVIDERS_PACKAGE = "infractl.providers"

_S = TypeVar("_S", bound=Spec)


#: A container image pinned by digest: ``[HOST[:PORT]/]PATH@sha256:<64 hex>`` (the distribution
#: spec's reference grammar, without a tag: a tag names whatever was pushed under it last). As
#: there, a first component is a host only with a dot or a port, or as ``localhost``.
IMAGE_REFERENCE = re.compile(
    r"^(?:(?P<host>localhost(?::[0-9]+)?"
    r"|[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)+(?::[0-9]+)?"
    r"|[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?:[0-9]+)/)?"
    r"(?P<path>[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
    r"@(?P<digest>sha256:[0-9a-f]{64})$"
)


class RuntimeSpec(Spec):
    """The pinned runtime every node must have; `up` refuses nodes that differ."""

    torch: str = Field("2.13.0", description="torch version every node must run (prefix match, e.g. 2.13.0).")
    image: str | None = Field(
        None,
        description=(
            "Trainer image pinned by digest, REPOSITORY@sha256:<64 hex> (a tag is refused): the trainer runs in it "
            "on providers with hosts (netns, aws); `infractl image build` prints one. Unused on `local`."
        ),
    )

    @field_validator("image")
    @classmethod
    def _pinned_by_digest(cls, value: str | None) -> str | None:
        if value is None or IMAGE_REFERENCE.match(value):
            return value
        if "@" not in value:
            raise ValueError(
                f"{value!r} is not pinned by digest: write REPOSITORY@sha256:<64 hex> "
                "(a tag names whatever was pushed under it last; `infractl image build` prints the digest)"
            )
        raise ValueError(f"{value!r} is not REPOSITORY@sha256:<64 lower-case hex> (no tag before the digest)")


@dataclass(frozen=True)
class ProviderConfig:
    """What a provider adds to cluster.yaml."""

    name: str
    """``provider:``'s value, and the name of the provider's own section."""
    help: str
    """One sentence on what a node is, for ``provider``'s description."""
    section: type[Spec] | None = None
    """The model of the ``<name>:`` section, if the provider has settings of its own."""
    section_help: str = ""
    required: str | None = None
    """When the section must be given: what it holds, for the message that says it is missing."""
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """Before validation: defaults that depend on the section (the raw mapping in, a mapping out)."""
    check: Callable[[ClusterSpec], None] | None = None
    """After validation: rules across fields; raises ``field_error``."""
    default: bool = False
    """The provider of a cluster.yaml that names none, and of the built-in cluster (named after it)."""


_REGISTRY: dict[str, ProviderConfig] = {}


def register_provider(config: ProviderConfig) -> None:
    """Add a provider to cluster.yaml (``register_every`` does, for each installed provider)."""
    _REGISTRY[config.name] = config
    cluster_model.cache_clear()


def _providers() -> dict[str, ProviderConfig]:
    """Every provider by name, the default one first."""
    importlib.import_module(_PROVIDERS_PACKAGE).register_every()
    return dict(sorted(_REGISTRY.items(), key=lambda item: not item[1].default))


class ClusterSpec(Spec):
    """cluster.yaml: where training runs."""

    name: str
    provider: str
    nodes: int = Field(2, ge=1, le=64, description="Number of training nodes (on aws: the node groups' sum).")
    processes_per_node: int = Field(
        1, ge=1, le=64, description="Training processes (ranks) per node. Default: 1 on local, one per GPU on aws."
    )
    store: str | None = Field(
        None,
        description=(
            "Object store URI for checkpoints and metrics (file:///abs/path, s3://bucket/prefix). "
            "Default on local and netns: .infractl/<name>/store; aws needs an s3:// store."
        ),
    )
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec, description="Pinned runtime checked on every node.")

    def settings(self, model: type[_S]) -> _S | None:
        """The provider's own section, if given (a provider reads only its own)."""
        value = getattr(self, self.provider, None)
        return value if isinstance(value, model) else None

    @model_validator(mode="before")
    @classmethod
    def _prepare(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        providers = _providers()
        name = data.get("provider", _default(providers).name)
        own = providers.get(name) if isinstance(name, str) else None
        return own.prepare(data) if own is not None and own.prepare is not None else data

    @model_validator(mode="after")
    def _provider_settings(self) -> ClusterSpec:
        providers = _providers()
        for other in providers.values():
            if other.section is not None and other.name != self.provider and getattr(self, other.name) is not None:
                raise field_error(other.name, f"is for provider: {other.name} (provider is {self.provider})")
        own = providers[self.provider]
        if own.required is not None and getattr(self, own.name) is None:
            raise field_error(own.name, f"is required with provider: {own.name} ({own.required})")
        if own.check is not None:
            own.check(self)
        return self


def _default(providers: dict[str, ProviderConfig]) -> ProviderConfig:
    return next(p for p in providers.values() if p.default)


@cache
def cluster_model() -> type[ClusterSpec]:
    """``ClusterSpec`` with every registered provider: what cluster.yaml and cluster records
    validate against, and what ``infractl schema`` describes."""
    providers = _providers()
    default = _default(providers)
    names: Any = Literal[tuple(providers)]  # the registered names, known at run time only
    described = " ".join(f"`{p.name}`: {p.help}" for p in providers.values())
    sections: dict[str, Any] = {
        p.name: (p.section | None, Field(None, description=p.section_help))
        for p in providers.values()
        if p.section is not None
    }
    model = create_model(
        "ClusterSpec",
        __base__=ClusterSpec,
        __module__=__name__,
        __doc__=ClusterSpec.__doc__,
        name=(Name, Field(default.name, description="Cluster name; state lives in .infractl/<name>/.")),
        provider=(names, Field(default.name, description=f"Infrastructure provider. {described}")),
        **sections,
    )
    return cast(type[ClusterSpec], model)


def parse_cluster(raw: dict[str, Any]) -> ClusterSpec:
    """A cluster spec from its JSON form (a cluster record's ``spec``); ValidationError if invalid."""
    return cluster_model().model_validate(raw)


def load_cluster(path: Path) -> ClusterSpec:
    return load(path, cluster_model(), "cluster")


def default_cluster() -> ClusterSpec:
    """The built-in cluster: the default provider's, 2 nodes x 1 process."""
    return cluster_model().model_validate({})


def default_cluster_name() -> str:
    """The built-in cluster's name (its provider's), with no spec validated: every command run
    without -c/--cluster asks it first."""
    return _default(_providers()).name
