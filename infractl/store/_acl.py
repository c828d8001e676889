"""POSIX ACLs for a store kept in a directory: each access role's rights become entries for the
role's Unix group on the store's root and top-level directories (``runs/``, ``datasets/``, ...),
set on everything already there and as default ACLs, so whatever is written later inherits them.
Used by ``FileStore``; ``setfacl`` comes from Debian's ``acl`` package.

Directories are coarser than key patterns: a role gets a top-level directory whole (read if any
of its read patterns lies under it, write if any write or delete pattern does), and on POSIX
whoever may create entries in a directory may also remove them. docs/access.md lists what that
means for each role.

What only the nodes write (``RoleRights.nodes_only``, the runs' checkpoints) cannot be carved out
of a directory a role writes: the role could make the run's ``ckpt/`` itself before the trainer
does, or rename the trainer's aside and put its own in its place, and the directories the trainer
makes later inherit the default ACL of the one above. So a top-level directory that holds such
keys is read-only for every role, its default ACL too, and so is the store's root (whoever writes
there can replace a top-level directory). Deleting there is the nodes' and the operator's who runs
infractl, on this machine.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

from infractl import proc
from infractl.errors import StoreError
from infractl.store.rights import RoleRights

__all__ = ["admit_user", "apply_acls", "remove_acls"]

# Seconds one setfacl may take: it walks the whole directory (every checkpoint shard).
_SETFACL_TIMEOUT_S = 600


def _covers(patterns: Sequence[str], top: str) -> bool:
    return any(p == "*" or p.split("/", 1)[0] == top for p in patterns)


def _tops(roles: Sequence[RoleRights]) -> list[str]:
    """The top-level directories the roles' patterns name."""
    patterns = {p for r in roles for p in (*r.read, *r.write, *r.delete, *r.nodes_only)}
    return sorted({p.split("/", 1)[0] for p in patterns} - {"*"})


def _directory_rights(roles: Sequence[RoleRights]) -> dict[str, dict[str, str]]:
    """Directory (``.`` for the root) -> role -> permissions (setfacl's letters; ``X``: search
    on directories only). The root is listed by every role that has any right in the store."""
    acl: dict[str, dict[str, str]] = {".": {}}
    for top in _tops(roles):
        acl[top] = {}
        for r in roles:
            writes = (_covers(r.write, top) or _covers(r.delete, top)) and not _covers(r.nodes_only, top)
            acl[top][r.role] = "rwX" if writes else "rX" if _covers(r.read, top) else "---"
    for r in roles:
        writes_root = "*" in r.write and not r.nodes_only
        acl["."][r.role] = "rwx" if writes_root else "rx" if (r.read or r.write or r.delete) else "---"
    return acl


def _setfacl(uri: str, args: list[str], path: Path) -> None:
    try:
        done = proc.run(["setfacl", *args, str(path)], timeout=_SETFACL_TIMEOUT_S)
    except FileNotFoundError:
        raise StoreError(uri, "setfacl not found: install Debian's `acl` package (apt-get install acl)") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StoreError(uri, f"cannot set the ACLs of {path}: {exc}") from None
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()] or [f"exit {done.returncode}"]
        raise StoreError(uri, f"cannot set the ACLs of {path}: {lines[-1]}")


def apply_acls(root: Path, uri: str, roles: Sequence[RoleRights]) -> None:
    """Give each role's group its rights on ``root`` and the top-level directories (made if
    missing), recursively and as the default for what is written later."""
    groups = {r.role: r.group for r in roles}
    for directory, perms in _directory_rights(roles).items():
        entries = [f"group:{groups[role]}:{p}" for role, p in perms.items()]
        if directory == ".":  # the root itself: listing it; what lies below is the tops'
            _setfacl(uri, ["-m", ",".join(entries)], root)
            continue
        (root / directory).mkdir(exist_ok=True)
        _setfacl(uri, ["-R", "-m", ",".join([*entries, *(f"default:{e}" for e in entries)])], root / directory)


def admit_user(root: Path, uri: str, uid: int, *, admitted: bool = True) -> None:
    """Give the user ``uid`` read and write on ``root`` and everything under it, as the default for
    what is written later too (``admitted=False``: take the entries back)."""
    if admitted:
        _setfacl(uri, ["-R", "-m", f"user:{uid}:rwX,default:user:{uid}:rwX"], root)
    elif root.is_dir():
        _setfacl(uri, ["-R", "-x", f"user:{uid},default:user:{uid}"], root)


def remove_acls(root: Path, uri: str, roles: Sequence[RoleRights]) -> None:
    """Take the roles' groups out of every ACL under ``root`` (while the groups still exist:
    setfacl names them)."""
    groups = [r.group for r in roles if proc.group_exists(r.group)]
    if not groups or not root.is_dir():
        return
    entries = [e for g in groups for e in (f"group:{g}", f"default:group:{g}")]
    _setfacl(uri, ["-R", "-x", ",".join(entries)], root)
