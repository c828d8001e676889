"""The access roles and their names: the role table, each role's Unix group and IAM policy on a
cluster, its rights in the store and on the nodes, and the recorded membership."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infractl import workdir
from infractl.errors import StateError
from infractl.statedir import ClusterState, write_private
from infractl.store import RoleRights

__all__ = [
    "NODE_DIRECTORIES",
    "ROLES",
    "ROLE_NAMES",
    "USER_PATTERN",
    "Role",
    "group_name",
    "load_members",
    "members_path",
    "membership",
    "node_vars",
    "policy_name",
    "rights",
    "save_members",
]

#: A user name as both a Unix login and an IAM user can spell it.
USER_PATTERN = r"^[a-z_][a-z0-9_.-]{0,31}$"
#: The node directories the roles' ACLs cover, relative to the node's work directory (base role;
#: infractl/workdir.py says what each holds). Only ``logs`` lets a role read; nothing lets a role
#: write: a role may enter the work directory and read the logs, never touch what root reads,
#: sources or writes through (``private``) or the trainer's files (``work``).
NODE_DIRECTORIES = (".", workdir.LOGS, workdir.PRIVATE, workdir.WORK)
#: The directories whose ACL new files and folders inherit (default ACL): the logs written later.
_INHERITED = (workdir.LOGS,)


@dataclass(frozen=True)
class Role:
    """One access role: what it is for, its rights in the store (key patterns, ``*`` matching
    any characters as in IAM), and its permissions in each node directory (missing: none)."""

    name: str
    summary: str
    commands: tuple[str, ...]
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    delete: tuple[str, ...] = ()
    nodes: Mapping[str, str] = field(default_factory=dict)
    grants_access: bool = False


#: The role table. Deletes follow what the commands delete: the trainers' checkpoint retention,
#: `train --new` and `plan --measure`'s probe run delete under runs/, so operators may; nothing
#: else is deleted but by `teardown --purge`, so only infra-admin may delete anywhere else.
ROLES: tuple[Role, ...] = (
    Role(
        "viewer",
        "read metrics, logs and status; nothing else",
        ("status", "logs", "metrics"),
        read=("runs/*/run.json", "runs/*/metrics/*", "runs/*/tensorboard/*", "runs/*/drills/*", "runs/*/chaos/*"),
        nodes={".": "--x", workdir.LOGS: "r-x"},
    ),
    Role(
        "operator",
        "launch, stop and resume training, measure it; read everything",
        ("train", "rejoin", "drill", "profile", "plan --measure", "bench", "export", "sample", "bundle"),
        read=("*",),
        write=("runs/*", "plan/*", "bench/*"),
        delete=("runs/*",),
        nodes={".": "--x", workdir.LOGS: "r-x"},
    ),
    Role(
        "config-admin",
        "change configs and datasets; read everything",
        ("data prepare",),
        read=("*",),
        write=("datasets/*", "configs/*"),
        nodes={".": "--x", workdir.LOGS: "r-x"},
    ),
    Role(
        "infra-admin",
        "bring the cluster up and tear it down, grant and revoke roles: everything",
        ("up", "teardown", "access"),
        read=("*",),
        write=("*",),
        delete=("*",),
        nodes={".": "--x", workdir.LOGS: "r-x"},
        grants_access=True,
    ),
)
ROLE_NAMES = tuple(r.name for r in ROLES)
#: What no role writes, whatever its write patterns say: only the cluster's nodes write a run's
#: checkpoints, because torch unpickles a checkpoint's ``.metadata`` when the trainer resumes, so a
#: role that wrote there could run code in every rank. Deleting there stays as the table says.
_NODES_ONLY = ("runs/*/ckpt/*",)


# -- names ----------------------------------------------------------------------------------------


def _prefix(state: ClusterState) -> str:
    """``<cluster, 12 characters at most>-<6 hex>``: the hash is of the state directory, so two
    clusters of one name on one machine (the local provider) never share groups. With the
    longest role this stays within the 32 characters a group name may have."""
    return f"{state.name[:12].rstrip('-')}-{state.short_id}"


def group_name(state: ClusterState, role: str) -> str:
    """The Unix group of ``role`` on the cluster's nodes."""
    return f"{_prefix(state)}-{role}"


def policy_name(state: ClusterState, role: str) -> str:
    """The IAM managed policy of ``role`` (an s3:// store)."""
    return f"infractl-{group_name(state, role)}"


def rights(state: ClusterState) -> list[RoleRights]:
    """Every role's rights in the store, under the cluster's names."""
    policies = tuple(policy_name(state, r.name) for r in ROLES)
    return [
        RoleRights(
            role=r.name,
            group=group_name(state, r.name),
            policy=policy_name(state, r.name),
            read=r.read,
            write=r.write,
            delete=r.delete,
            nodes_only=_NODES_ONLY,
            grants=policies if r.grants_access else (),
        )
        for r in ROLES
    ]


# -- membership -----------------------------------------------------------------------------------


def members_path(state: ClusterState) -> Path:
    return state.dir / "access.json"


def load_members(state: ClusterState) -> dict[str, list[str]]:
    """Role -> its members, from the cluster's state (every role; none before the first grant)."""
    members: dict[str, list[str]] = {name: [] for name in ROLE_NAMES}
    path = members_path(state)
    if not path.is_file():
        return members
    try:
        saved = json.loads(path.read_text())["members"]
        for role in members:
            members[role] = sorted(str(u) for u in saved.get(role, []))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StateError(f"cannot read the access membership {path}: {type(exc).__name__}: {exc}") from None
    bad = [u for users in members.values() for u in users if not re.fullmatch(USER_PATTERN, u)]
    if bad:
        raise StateError(f"the access membership {path} names {bad[0]!r}, which is not a user name")
    return members


def save_members(state: ClusterState, members: Mapping[str, Sequence[str]]) -> None:
    data = {"members": {role: sorted(members.get(role, ())) for role in ROLE_NAMES}}
    write_private(members_path(state), json.dumps(data, indent=1, sort_keys=True) + "\n")


def membership(state: ClusterState) -> dict[str, Any]:
    """The cluster's roles with their group, IAM policy, rights and members (``access list``)."""
    members = load_members(state)
    return {
        "cluster": state.name,
        "roles": {
            r.name: {
                "summary": r.summary,
                "group": group_name(state, r.name),
                "policy": policy_name(state, r.name),
                "members": members[r.name],
            }
            for r in ROLES
        },
    }


# -- the nodes' side: the access role's variables ---------------------------------------------------


def _union(perms: Sequence[str]) -> str:
    return "".join(c if any(p[i] == c for p in perms) else "-" for i, c in enumerate("rwx"))


def _node_acl(state: ClusterState, directory: str) -> list[str]:
    """The whole ACL of one node directory as ``getfacl`` prints it: owner only for the base
    entries, each role's group with its permissions where it has any, and the same again as the
    default ACL where new files inherit it (``_INHERITED``); a directory no role may enter has
    the owner's entries alone (mode 0700, no default ACL)."""
    perms = {r.name: p for r in ROLES if (p := r.nodes.get(directory, "---")) != "---"}
    entries = ["user::rwx", "group::---", "other::---"]
    if perms:
        entries.append(f"mask::{_union(list(perms.values()))}")
        entries += [f"group:{group_name(state, role)}:{p}" for role, p in perms.items()]
    return entries + ([f"default:{e}" for e in entries] if directory in _INHERITED else [])


def node_vars(
    state: ClusterState, members: Mapping[str, Sequence[str]], *, require: Sequence[str] = ()
) -> dict[str, Any]:
    """The access role's variables (see playbooks/roles/access/meta/argument_specs.yml)."""
    return {
        "access_groups": {group_name(state, r.name): sorted(members.get(r.name, ())) for r in ROLES},
        "access_acls": [{"path": d, "acl": _node_acl(state, d)} for d in NODE_DIRECTORIES],
        "access_require_users": sorted(require),
    }
