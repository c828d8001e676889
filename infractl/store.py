"""The one store API: checkpoints, metrics and run records go through ``Store``.

``file://`` is the backend today; ``s3://`` plugs in behind the same methods. Keys are
``/``-separated relative paths. Writes are atomic (a reader sees the whole object or none)
and ``put_if_absent`` is create-only, which is what the checkpoint commit marker relies on.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from infractl.errors import ConfigError

__all__ = ["ObjectInfo", "Store", "FileStore", "StoreKeyError", "open_store", "SUPPORTED_SCHEMES"]

SUPPORTED_SCHEMES = ("file",)


class StoreKeyError(KeyError):
    """The key does not exist in the store."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


class Store(ABC):
    """Object-store semantics over any backend: whole-object puts and gets, prefix listing."""

    uri: str

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


class FileStore(Store):
    """A directory used as an object store (the local provider's default)."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.uri = self.root.as_uri()

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if path != self.root and self.root not in path.parents:
            raise ValueError(f"store key escapes the store root: {key!r}")
        return path

    def _write_tmp(self, key: str, data: bytes) -> tuple[Path, Path]:
        final = self._path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return Path(tmp), final

    def put_bytes(self, key: str, data: bytes) -> None:
        tmp, final = self._write_tmp(key, data)
        os.replace(tmp, final)

    def put_file(self, key: str, path: Path) -> None:
        final = self._path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".tmp-")
        os.close(fd)
        shutil.copyfile(path, tmp)
        os.replace(tmp, final)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        tmp, final = self._write_tmp(key, data)
        try:
            # link() fails if the target exists: an atomic create-only publish.
            os.link(tmp, final)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            raise StoreKeyError(key) from None

    def get_file(self, key: str, path: Path) -> None:
        src = self._path(key)
        if not src.is_file():
            raise StoreKeyError(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, path)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = self._path(prefix) if prefix else self.root
        if base.is_file():
            return [ObjectInfo(prefix, base.stat().st_size)]
        if not base.is_dir():
            return []
        found = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith(".tmp-"):
                    continue
                full = Path(dirpath) / name
                try:
                    size = full.stat().st_size
                except FileNotFoundError:
                    continue
                found.append(ObjectInfo(full.relative_to(self.root).as_posix(), size))
        return sorted(found, key=lambda o: o.key)

    def delete_prefix(self, prefix: str) -> int:
        base = self._path(prefix)
        if base.is_file():
            base.unlink()
            return 1
        if not base.is_dir():
            return 0
        count = sum(len(files) for _d, _s, files in os.walk(base))
        shutil.rmtree(base, ignore_errors=True)
        return count


def open_store(uri: str, *, field: str = "store") -> Store:
    """Open the store named by ``uri``; ``field`` names the config field in error messages."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"{field}: file:// URIs must be absolute paths, got {uri!r}")
        return FileStore(Path(parsed.path))
    allowed = ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
    raise ConfigError(f"{field}: unsupported store URI {uri!r} (use {allowed})")
