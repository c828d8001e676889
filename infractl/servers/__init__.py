"""The cluster's servers, outside every node's failure domain: the rendezvous endpoint (a c10d
TCPStore, ``tcpstore.py``) and the image registry, kept running on the provider's server host at
the ports the cluster record holds. ``up`` starts them; ``train`` keeps them (a server lost with its
machine comes back before the agents need it). Below the launcher and the lifecycle, above the
providers: it asks the provider for its ``ServerHost`` and nothing else."""

from __future__ import annotations

from infractl import providers
from infractl.image import registry
from infractl.providers.servers import ServerHost
from infractl.statedir import ClusterRecord, ClusterState

__all__ = ["RENDEZVOUS_NODE", "ensure_registry", "ensure_rendezvous", "keep_rendezvous", "rendezvous_running"]

RENDEZVOUS_NODE = "rendezvous"
# Debian's docker-registry package: the CNCF distribution registry.
_REGISTRY = "docker-registry"


def ensure_rendezvous(
    servers: ServerHost, host: str, previous: ClusterRecord | None, image: str | None
) -> tuple[int, bool]:
    """Keep the cluster's rendezvous server running on ``host`` at its recorded port (a new one for
    a new cluster), in ``image`` where the servers' host runs infractl from the cluster's image;
    return (port, started_now). ``train`` calls it too, so a server lost with its machine comes
    back before the agents need it."""
    port = previous.rendezvous.port if previous else servers.new_port(RENDEZVOUS_NODE, host)
    argv = [servers.python, "-m", "infractl.servers.tcpstore", "--host", host, "--port", str(port)]
    in_image = image if servers.runs_image else None
    return port, servers.keep(RENDEZVOUS_NODE, argv, host=host, port=port, image=in_image)


def keep_rendezvous(state: ClusterState, record: ClusterRecord) -> None:
    """``ensure_rendezvous`` for a cluster that is up (``record``: its state file)."""
    servers = providers.get(record.spec.provider).servers(state)
    ensure_rendezvous(servers, record.rendezvous.host, record, record.image)


def ensure_registry(
    state: ClusterState, servers: ServerHost, host: str, previous: ClusterRecord | None
) -> tuple[registry.Registry, bool]:
    """Keep the cluster's image registry running on ``host`` at its recorded port (a new one for a
    cluster that had none); return it and whether it was started now."""
    recorded = previous.registry if previous is not None else None
    port = recorded.port if recorded is not None else servers.new_port(registry.REGISTRY_NODE, host)
    ca, cert, key = registry.certificate_authority(state.dir, host)
    folder = servers.home / "registry"
    servers.put(folder / "tls" / cert.name, cert.read_text())
    servers.put(folder / "tls" / key.name, key.read_text())
    servers.put(folder / "config.yml", registry.config(folder, host, port))
    argv = [_REGISTRY, "serve", str(folder / "config.yml")]
    started = servers.keep(registry.REGISTRY_NODE, argv, host=host, port=port)
    return registry.Registry(host=host, port=port, ca=ca), started


def rendezvous_running(state: ClusterState) -> bool:
    """Whether the cluster's rendezvous server runs."""
    record = state.record()
    servers = providers.get(record.spec.provider).servers(state)
    return servers.running(RENDEZVOUS_NODE, host=record.rendezvous.host, port=record.rendezvous.port)
