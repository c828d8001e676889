"""The store interface and its errors (see the package docstring)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infractl.errors import StoreError

__all__ = ["ObjectInfo", "Store", "StoreKeyError", "StoreUnavailable"]


class StoreUnavailable(StoreError, OSError):
    """The store cannot be reached at all (not: a key is missing). Callers retry later."""


class StoreKeyError(StoreError, KeyError):
    """The key does not exist in the store."""

    def __init__(self, uri: str, key: str) -> None:
        super().__init__(uri, f"no object {key!r}")
        self.key = key

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.uri, self.key))


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

    @abstractmethod
    def outage(self) -> AbstractContextManager[dict[str, Any]]:
        """For the store-outage drill: a context manager inside which every call to the store
        fails as in a real outage, and after which the store is back as it was (whatever
        happened inside). It yields what was done, for the drill's record. Raises
        ``UsageError`` at once when this store cannot be taken down from here."""
