"""The store interface (see the package docstring); its errors are ``errors.py``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infractl.store import _iam
from infractl.store.rights import RoleRights

__all__ = ["ObjectInfo", "Store"]


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


class Store(ABC):
    """Object-store semantics over any backend: whole-object puts and gets, prefix listing."""

    uri: str
    #: The config field the store came from, named in error messages (set by ``open_store``).
    field: str = "store"

    def location(self, key: str) -> str:
        """Where ``key`` is, as a path or URL a user can copy into another tool."""
        path = self.local_path(key)
        return str(path) if path is not None else f"{self.uri}/{key}"

    def local_path(self, key: str) -> Path | None:
        """``key``'s file on this machine, for a backend that keeps objects as files; else None."""
        return None

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None: ...

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist; return False if it already did."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def get_file(self, key: str, path: Path) -> None: ...

    @abstractmethod
    def copy(self, key: str, to: str) -> None:
        """Copy object ``key`` to ``to`` inside the store (server-side where the backend can);
        ``StoreKeyError`` if ``key`` does not exist."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object under ``prefix`` (recursively), sorted by key."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix``; return how many were deleted."""

    @abstractmethod
    def ping(self) -> None:
        """Reach the store without changing it; raise ``StoreUnavailable`` (or ``StoreError``)
        if it cannot be read. Commands that would act blind without the store call it first."""

    @abstractmethod
    def check(self, *, create_ok: bool = False) -> None:
        """Verify the store is reachable and writable; raise ``ConfigError`` (one line naming
        ``self.field`` and the reason) if it is not. Leaves nothing behind. ``create_ok``: a
        store that does not exist yet passes if ``ensure()`` could create it."""

    @abstractmethod
    def ensure(self) -> None:
        """Make the store exist where the backend can (a file store's directory; a bucket is
        provisioned, never made here), then ``check()`` it. Only ``infractl up`` calls this:
        nothing else may create a store, so a vanished one is an outage, not a new empty store."""

    def access_policy(self, rights: RoleRights) -> dict[str, Any]:
        """The IAM policy document that grants ``rights`` in this store. A store that is not in
        S3 gets the document for a bucket named ``BUCKET``: what the role gets once the store
        moves to S3 (replace the name, and add the prefix to each key)."""
        return _iam.policy_document(_iam.PLACEHOLDER_BUCKET, "", rights)

    @abstractmethod
    def apply_access(self, roles: Sequence[RoleRights], members: Mapping[str, Sequence[str]]) -> None:
        """Make the store enforce ``roles`` for exactly ``members`` (role -> user names); running
        it again with the same arguments changes nothing. Raises ``UnknownUser`` for a member the
        backend has no identity for, ``StoreError`` for anything else."""

    @abstractmethod
    def check_safeguards(self, *, tls: bool) -> None:
        """A store that a cluster keeps its checkpoints in but did not make: its own settings keep
        its objects private and recoverable (with ``tls``, refusing requests without TLS too);
        ``ConfigError`` naming ``self.field``, one line saying what to set, otherwise."""

    @abstractmethod
    def admit_trainer(self, uid: int, *, admitted: bool = True) -> None:
        """Let the trainer, running as the user ``uid`` on the nodes (the image's user, in its
        container), write the store, or take it back (``admitted=False``, the cluster's teardown).
        Only a backend whose objects are files the nodes share (``file://``) has a user to admit."""

    @abstractmethod
    def remove_access(self, roles: Sequence[RoleRights]) -> None:
        """Take back everything ``apply_access`` granted for ``roles`` (the cluster's teardown)."""

    @abstractmethod
    def outage(self) -> AbstractContextManager[dict[str, Any]]:
        """For the store-outage drill: a context manager inside which every call to the store
        fails as in a real outage, and after which the store is back as it was (whatever
        happened inside). It yields what was done, for the drill's record. Raises
        ``UsageError`` at once when this store cannot be taken down from here."""
