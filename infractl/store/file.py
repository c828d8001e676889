"""``file:///abs/path``: a directory used as an object store (the local provider's default)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from infractl.errors import ConfigError, StoreError
from infractl.store import _acl
from infractl.store.base import ObjectInfo, Store
from infractl.store.errors import StoreKeyError, StoreUnavailable
from infractl.store.rights import RoleRights

__all__ = ["FileStore"]


class FileStore(Store):
    """A directory used as an object store. The directory must exist: only ``ensure``
    (``infractl up``) makes it, so a vanished one is an outage, never a new empty store."""

    def __init__(self, root: Path, *, field: str = "store") -> None:
        self.root = root.resolve()
        self.uri = self.root.as_uri()
        self.field = field

    def __repr__(self) -> str:
        return f"FileStore({self.uri!r})"

    def local_path(self, key: str) -> Path:
        return self.root / key

    @contextlib.contextmanager
    def _io(self, action: str, key: str | None) -> Iterator[None]:
        """Turn the OS's errors into the store's (one line naming the store, the key and why)."""
        try:
            yield
        except StoreError:
            raise
        except OSError as e:
            what = f"{action} {key!r}" if key is not None else action
            raise StoreError(self.uri, f"cannot {what}: {e.strerror or e}") from e

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if path != self.root and self.root not in path.parents:
            raise ValueError(f"store key escapes the store root: {key!r}")
        return path

    def _unavailable(self) -> StoreUnavailable:
        return StoreUnavailable(self.uri, "its directory does not exist (removed or unmounted?)")

    def _root_exists(self) -> None:
        if not self.root.is_dir():
            raise self._unavailable()

    def _parent_of(self, key: str) -> Path:
        """The key's path, its parent directories created below the root (never the root)."""
        final = self._path(key)
        self._root_exists()
        parent = self.root
        for part in final.parent.relative_to(self.root).parts:
            parent = parent / part
            try:
                parent.mkdir(exist_ok=True)
            except FileNotFoundError:  # the root vanished meanwhile
                raise self._unavailable() from None
        return final

    @staticmethod
    def _create_tmp(directory: Path) -> tuple[int, Path]:
        """A new temporary file in ``directory``, open for writing. Mode 0660, not mkstemp's
        0600: the group bits are the ceiling of what a default ACL on the directory grants (the
        access roles' groups read objects through it); without an ACL the umask applies."""
        tmp = directory / f".tmp-{uuid.uuid4().hex}"
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o660), tmp

    def _write_tmp(self, key: str, data: bytes) -> tuple[Path, Path]:
        final = self._parent_of(key)
        fd, tmp = self._create_tmp(final.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp, final

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._io("write", key):
            tmp, final = self._write_tmp(key, data)
            os.replace(tmp, final)

    def put_file(self, key: str, path: Path) -> None:
        with self._io("write", key):
            final = self._parent_of(key)
            fd, tmp = self._create_tmp(final.parent)
            os.close(fd)
            shutil.copyfile(path, tmp)
            os.replace(tmp, final)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        with self._io("write", key):
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
        with self._io("read", key):
            try:
                return self._path(key).read_bytes()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                self._root_exists()
                raise StoreKeyError(self.uri, key) from None

    def get_file(self, key: str, path: Path) -> None:
        with self._io("read", key):
            src = self._path(key)
            if not src.is_file():
                self._root_exists()
                raise StoreKeyError(self.uri, key)
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, path)

    def copy(self, key: str, to: str) -> None:
        with self._io("copy", key):
            src = self._path(key)
            if not src.is_file():
                self._root_exists()
                raise StoreKeyError(self.uri, key)
            self.put_file(to, src)

    def exists(self, key: str) -> bool:
        with self._io("look up", key):
            if self._path(key).is_file():
                return True
            self._root_exists()
            return False

    def list(self, prefix: str) -> list[ObjectInfo]:
        with self._io("list", prefix):
            self._root_exists()
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
        with self._io("delete", prefix):
            self._root_exists()
            base = self._path(prefix)
            if base.is_file():
                base.unlink()
                return 1
            if not base.is_dir():
                return 0
            count = sum(len(files) for _d, _s, files in os.walk(base))
            shutil.rmtree(base, ignore_errors=True)
            return count

    def ping(self) -> None:
        with self._io("reach the store", None):
            self._root_exists()
            os.listdir(self.root)

    def ensure(self) -> None:
        """Create the store's directory if it is missing, then check it."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create {self.uri}: {e.strerror or e}", field=self.field) from None
        self.check()

    def check(self, *, create_ok: bool = False) -> None:
        """Prove a file can be written in the root directory; with ``create_ok``, a missing root
        passes if its nearest existing parent is a directory it could be made in."""
        if not self.root.is_dir():
            if not create_ok:
                raise ConfigError(f"store directory {self.root} does not exist", field=self.field)
            parent = next(p for p in self.root.parents if p.exists())
            if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
                reason = "not a directory" if not parent.is_dir() else "not writable"
                raise ConfigError(f"cannot create {self.uri}: {parent} is {reason}", field=self.field)
            return
        try:
            fd, probe = tempfile.mkstemp(dir=self.root, prefix=".tmp-probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            where = f" ({e.filename})" if e.filename and str(e.filename) != str(self.root) else ""
            raise ConfigError(f"cannot write to {self.uri}: {e.strerror or e}{where}", field=self.field) from None

    def apply_access(self, roles: Sequence[RoleRights], members: Mapping[str, Sequence[str]]) -> None:
        """POSIX ACLs naming each role's group on the store's directories (store/_acl.py). Who
        holds a role is the group's membership on this machine, which the nodes' access role
        keeps (the local provider's nodes are this machine), so ``members`` is not needed here."""
        with self._io("set access ACLs", None):
            self._root_exists()
            _acl.apply_acls(self.root, self.uri, roles)

    def remove_access(self, roles: Sequence[RoleRights]) -> None:
        with self._io("remove access ACLs", None):
            _acl.remove_acls(self.root, self.uri, roles)

    def check_safeguards(self, *, tls: bool) -> None:
        """Nothing to check: a folder on the nodes' filesystem has no settings of its own beside its
        modes and ACLs, which ``check`` and the access roles keep."""

    def admit_trainer(self, uid: int, *, admitted: bool = True) -> None:
        """An ACL entry for the user ``uid`` on everything in the store, and as the default for
        what is written later (the trainer writes checkpoints and metrics in folders the
        operator's infractl made, and reads what it wrote there)."""
        with self._io("set the trainer's ACL", None):
            self._root_exists()
            _acl.admit_user(self.root, self.uri, uid, admitted=admitted)

    @contextlib.contextmanager
    def outage(self) -> Iterator[dict[str, Any]]:
        """The directory is moved aside (as an unmounted volume vanishes) and moved back."""
        parked = self.root.with_name(f"{self.root.name}.outage-{uuid.uuid4().hex[:8]}")
        self.root.rename(parked)
        try:
            yield {"how": "directory moved away", "parked": str(parked)}
        finally:
            parked.rename(self.root)
