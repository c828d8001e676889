"""What one access role may do in a store: the backends enforce it (POSIX ACLs, IAM policies)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RoleRights"]


@dataclass(frozen=True)
class RoleRights:
    """What one access role may do in a store, and the names its grant goes by (built from the
    role table in infractl/access/).

    Key patterns are relative to the store's root; ``*`` matches any characters, ``/`` included
    (IAM's rule): ``runs/*/metrics/*`` is every run's metrics, ``*`` the whole store."""

    role: str
    group: str
    """The Unix group whose members hold the role; a file:// store's ACLs name it."""
    policy: str
    """The IAM managed policy that carries the role; an s3:// store attaches it to the members."""
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    delete: tuple[str, ...] = ()
    nodes_only: tuple[str, ...] = ()
    """Key patterns that only the cluster's nodes write, whatever ``write`` says: the trainers'
    checkpoints, which torch unpickles on resume (whoever writes there runs code in the trainer)."""
    grants: tuple[str, ...] = ()
    """Policies this role may attach to users and detach from them (who runs `infractl access`)."""
