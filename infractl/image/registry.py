"""The cluster's own image registry, for providers whose nodes pull the trainer image over the
network from this machine (netns): Debian's ``docker-registry`` (the CNCF distribution registry)
serving ``<state>/registry/data`` over TLS on an address every node reaches.

The TLS certificate comes from a certificate authority the cluster generates at its first ``up``
(its certificate in ``<state>/registry/trust/``, the server's in ``tls/``); nodes trust that CA
alone, through their engine's certificate directory, so no node ever pulls with verification
turned off. ``up`` copies the pinned image
from this machine's build cache (``infractl image build``) into the registry by digest, once;
nodes then pull ``<registry>/<repository>@<digest>``. The registry process carries the cluster's
markers (node ``registry``), so ``teardown`` stops it with the rendezvous server.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infractl.config import IMAGE_REFERENCE
from infractl.errors import InfractlError
from infractl.image.build import locate, push

__all__ = ["REGISTRY_NODE", "Registry", "certificate_authority", "config", "node_reference", "publish"]

#: The marker node name of the registry process (``infractl.proc``).
REGISTRY_NODE = "registry"
#: How long the cluster's CA and server certificate are valid: longer than any training window.
_VALID_DAYS = 3650


@dataclass(frozen=True)
class Registry:
    """A cluster's registry as the nodes reach it."""

    host: str
    port: int
    ca: Path
    """The cluster CA's certificate (PEM), alone in its folder (a certificate directory for the
    engines): what nodes trust, and what ``publish`` checks the registry with."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def _directory(state_dir: Path) -> Path:
    return state_dir / "registry"


def _certificate(subject: str, issuer: str, key: Any, signer: Any, *, authority: bool, host: str | None = None) -> Any:
    """An X.509 certificate for ``key``'s public half, signed by ``signer``: the cluster's CA
    (``authority``) or the registry's server certificate for the IP address ``host``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
    )
    if authority:
        usage = dict.fromkeys(
            ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement"),
            False,
        )
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True).add_extension(
            x509.KeyUsage(**usage, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False),
            critical=True,
        )
    else:
        assert host is not None
        # Loopback too: where the registry's host is not on this machine's network, ``up`` pushes
        # through an SSH tunnel from this machine's loopback.
        addresses = [ipaddress.ip_address(address) for address in dict.fromkeys((host, "127.0.0.1"))]
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(address) for address in addresses]), critical=False
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    return builder.sign(signer, hashes.SHA256())


def certificate_authority(state_dir: Path, host: str) -> tuple[Path, Path, Path]:
    """The cluster CA's certificate and the registry's certificate and key for ``host`` (an IP
    address), made on first use and kept: a second ``up`` must not make nodes distrust the first."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    tls, trust = _directory(state_dir) / "tls", _directory(state_dir) / "trust"
    ca_cert, cert, key = trust / "ca.crt", tls / "registry.crt", tls / "registry.key"
    if ca_cert.is_file() and cert.is_file() and key.is_file():
        return ca_cert, cert, key
    tls.mkdir(mode=0o700, parents=True, exist_ok=True)
    trust.mkdir(mode=0o755, exist_ok=True)
    ca_name = f"infractl cluster CA {state_dir.name}"
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    authority = _certificate(ca_name, ca_name, ca_key, ca_key, authority=True)
    server = _certificate(f"infractl registry {host}", ca_name, server_key, ca_key, authority=False, host=host)
    key.touch(mode=0o600)
    key.write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    # Written last: its presence says the set is whole. The CA's key is not kept: nothing else is
    # ever signed with it.
    ca_cert.write_bytes(authority.public_bytes(serialization.Encoding.PEM))
    return ca_cert, cert, key


def config(folder: Path, host: str, port: int) -> str:
    """The registry's configuration, for a registry whose files are in ``folder`` on the host it
    runs on (``tls/`` with ``certificate_authority``'s certificate and key, ``data/`` the store),
    serving TLS on ``host:port``."""
    tls = folder / "tls"
    return (
        "version: 0.1\n"
        "log: {level: warn}\n"
        f"storage: {{filesystem: {{rootdirectory: {folder / 'data'}}}}}\n"
        f"http: {{addr: '{host}:{port}', tls: {{certificate: {tls / 'registry.crt'}, key: {tls / 'registry.key'}}}}}\n"
    )


def node_reference(registry: Registry, image: str) -> str:
    """What the nodes pull: ``image``'s repository path and digest at the cluster's registry (the
    host ``image`` names, if any, is where it was built for, not where nodes find it)."""
    match = IMAGE_REFERENCE.match(image)
    if match is None:
        raise InfractlError(f"runtime.image {image!r} is not REPOSITORY@sha256:<64 hex>")
    return f"{registry.address}/{match['path']}@{match['digest']}"


def _holds(registry: Registry, reference: str, via: str) -> bool:
    """Whether the registry (reached at ``via``) already serves the manifest ``reference`` names."""
    # Imported here: every CLI command imports this module, and only ``publish`` asks the registry.
    import ssl
    import urllib.error
    import urllib.request

    path, _, digest = reference.removeprefix(f"{registry.address}/").partition("@")
    request = urllib.request.Request(
        f"https://{via}/v2/{path}/manifests/{digest}",
        method="HEAD",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    context = ssl.create_default_context(cafile=str(registry.ca))
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as answer:
            return bool(answer.status == 200)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return False
        raise InfractlError(f"the cluster's registry at {registry.address} answered {exc.code} for {path}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise InfractlError(f"the cluster's registry at {registry.address} cannot be reached: {exc}") from None


def publish(
    registry: Registry, image: str, *, progress: Callable[[str], None], via: str | None = None
) -> tuple[str, bool]:
    """Make the pinned ``image`` available at the cluster's registry from this machine's build
    cache, reaching the registry at ``via`` (``host:port``; default: its own address); return the
    reference the nodes pull and whether it was copied now (False: it was there)."""
    reference = node_reference(registry, image)
    via = via or registry.address
    if _holds(registry, reference, via):
        return reference, False
    digest = reference.rpartition("@")[2]
    layout = locate(digest)
    if layout is None:
        raise InfractlError(
            f"image {digest} is not in this machine's build cache: build it with `infractl image build` "
            "(or pin the digest that build printed)"
        )
    destination = f"{via}/{reference.removeprefix(f'{registry.address}/')}"
    pushed = push(layout, destination, cert_dir=registry.ca.parent, progress=progress)
    if pushed != digest:
        raise InfractlError(f"the cluster's registry holds {pushed} after pushing {digest}")
    return reference, True
