"""Access roles: who may do what on a cluster, enforced on its nodes and in its store.

Rights attach to roles, never to people; nobody gets a right except through a role, and taking
someone out of a role takes every right it gave them at once. The roles are one table
(``ROLES``): what each may read, write and delete in the store (key patterns), and what it may do
in each directory of a node.

- On every node a role is a Unix group (``group_name``); its members are exactly the role's
  members, and the group's POSIX ACL entries on the node's work directory and its ``logs/``,
  ``env/``, ``staging/`` (default ACLs too, so new log files inherit them) are the role's rights
  there. The Ansible role ``playbooks/roles/access`` keeps both, on every ``infractl up`` and
  whenever membership changes.
- In the store, a ``file://`` store gets the same groups' ACLs on its directories; an ``s3://``
  store gets one IAM managed policy per role (``policy_name``), attached to exactly the role's
  members (IAM users of the same names). ``Store.apply_access`` does either.

Membership lives in the cluster's state, ``.infractl/<cluster>/access.json`` (mode 0600). It is
written only once the nodes and the store enforce it: a change that fails half-way is rolled
back on the nodes and in the store, and the file keeps the membership they enforced before.
``teardown`` ends every membership: it takes the rights back from the store and removes the
groups.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infractl import configure, proc, runstore
from infractl.errors import ConfigureError, InfractlError, StateError, UsageError
from infractl.infra import Node
from infractl.state import ClusterState, write_private
from infractl.store import RoleRights, Store, StoreError, UnknownUser, open_store

__all__ = [
    "ROLES",
    "ROLE_NAMES",
    "NODE_DIRECTORIES",
    "USER_PATTERN",
    "Role",
    "Change",
    "group_name",
    "policy_name",
    "rights",
    "load_members",
    "node_vars",
    "grant",
    "revoke",
    "membership",
    "bundle_files",
    "remove_from_store",
    "remove_groups",
]

#: A user name as both a Unix login and an IAM user can spell it.
USER_PATTERN = r"^[a-z_][a-z0-9_.-]{0,31}$"
#: The node directories the roles' ACLs cover, relative to the node's work directory (base role).
NODE_DIRECTORIES = (".", "logs", "env", "staging")


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
        read=("runs/*/run.json", "runs/*/metrics/*", "runs/*/tensorboard/*", "runs/*/drills/*"),
        nodes={".": "--x", "logs": "r-x"},
    ),
    Role(
        "operator",
        "launch, stop and resume training, measure it; read everything",
        ("train", "rejoin", "drill", "profile", "plan --measure", "bench", "export", "sample", "bundle"),
        read=("*",),
        write=("runs/*", "plan/*", "bench/*"),
        delete=("runs/*",),
        nodes={".": "rwx", "logs": "rwx", "env": "r-x", "staging": "r-x"},
    ),
    Role(
        "config-admin",
        "change configs and datasets; read everything",
        ("data prepare",),
        read=("*",),
        write=("datasets/*", "configs/*"),
        nodes={".": "r-x", "logs": "r-x", "env": "rwx", "staging": "rwx"},
    ),
    Role(
        "infra-admin",
        "bring the cluster up and tear it down, grant and revoke roles: everything",
        ("up", "teardown", "access"),
        read=("*",),
        write=("*",),
        delete=("*",),
        nodes={directory: "rwx" for directory in NODE_DIRECTORIES},
        grants_access=True,
    ),
)
ROLE_NAMES = tuple(r.name for r in ROLES)


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
            grants=policies if r.grants_access else (),
        )
        for r in ROLES
    ]


# -- membership -----------------------------------------------------------------------------------


def _members_path(state: ClusterState) -> Path:
    return state.dir / "access.json"


def load_members(state: ClusterState) -> dict[str, list[str]]:
    """Role -> its members, from the cluster's state (every role; none before the first grant)."""
    members: dict[str, list[str]] = {name: [] for name in ROLE_NAMES}
    path = _members_path(state)
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


def _save_members(state: ClusterState, members: Mapping[str, Sequence[str]]) -> None:
    data = {"members": {role: sorted(members.get(role, ())) for role in ROLE_NAMES}}
    write_private(_members_path(state), json.dumps(data, indent=1, sort_keys=True) + "\n")


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
    entries, each role's group with its permissions, and the same again as the default ACL."""
    perms = {r.name: r.nodes.get(directory, "---") for r in ROLES}
    entries = ["user::rwx", "group::---", "other::---", f"mask::{_union(list(perms.values()))}"]
    entries += [f"group:{group_name(state, role)}:{p}" for role, p in perms.items()]
    return entries + [f"default:{e}" for e in entries]


def node_vars(
    state: ClusterState, members: Mapping[str, Sequence[str]], *, require: Sequence[str] = ()
) -> dict[str, Any]:
    """The access role's variables (see playbooks/roles/access/meta/argument_specs.yml)."""
    return {
        "access_groups": {group_name(state, r.name): sorted(members.get(r.name, ())) for r in ROLES},
        "access_acls": [{"path": d, "acl": _node_acl(state, d)} for d in NODE_DIRECTORIES],
        "access_require_users": sorted(require),
    }


# -- grant and revoke -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """What a grant or revoke did."""

    cluster: str
    user: str
    role: str
    group: str
    policy: str
    changed: bool
    node_tasks_changed: int
    members: dict[str, list[str]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nodes(state: ClusterState) -> list[Node]:
    return [Node.from_record(n) for n in state.read()["nodes"]]


def _check(user: str, role: str) -> None:
    if role not in ROLE_NAMES:
        raise UsageError(f"unknown role {role!r} (roles: {', '.join(ROLE_NAMES)})", field="ROLE")
    if not re.fullmatch(USER_PATTERN, user):
        raise UsageError(
            f"{user!r} is not a user name (a login: lower-case letters, digits, '_', '.' and '-', "
            "starting with a letter or '_', at most 32)",
            field="USER",
        )


def grant(state: ClusterState, store: Store, user: str, role: str) -> Change:
    """Make ``user`` a member of ``role``: on every node (the user must have an account there)
    and in the store. Granting a role the user holds already applies the recorded membership
    again (repairing what was changed by hand) and changes nothing else."""
    _check(user, role)
    members = load_members(state)
    after = members | {role: sorted({*members[role], user})}
    tasks = _apply(state, store, before=members, after=after, require=[user])
    return _change(state, user, role, after, changed=after != members, tasks=tasks)


def revoke(state: ClusterState, store: Store, user: str, role: str) -> Change:
    """Take ``user`` out of ``role``: every right the role gave them goes at once, on the nodes
    (group membership) and in the store (ACLs through the group; the IAM policy detached)."""
    _check(user, role)
    members = load_members(state)
    if user not in members[role]:
        held = [r for r, users in members.items() if user in users]
        holds = f"holds {', '.join(held)}" if held else "holds no role"
        raise UsageError(
            f"{user!r} is not a member of role {role!r} on cluster {state.name!r} ({holds}; "
            "`infractl access list` shows every member)",
            field="USER",
        )
    after = members | {role: [u for u in members[role] if u != user]}
    tasks = _apply(state, store, before=members, after=after, require=[])
    return _change(state, user, role, after, changed=True, tasks=tasks)


def _change(
    state: ClusterState, user: str, role: str, members: dict[str, list[str]], *, changed: bool, tasks: int
) -> Change:
    return Change(state.name, user, role, group_name(state, role), policy_name(state, role), changed, tasks, members)


def _apply(
    state: ClusterState,
    store: Store,
    *,
    before: dict[str, list[str]],
    after: dict[str, list[str]],
    require: Sequence[str],
) -> int:
    """Enforce ``after`` on the nodes, then in the store, then record it; on a failure put the
    nodes (and the store, if it was reached) back to ``before`` and leave the record as it was."""
    nodes = _nodes(state)
    try:
        applied = configure.apply_access(state.dir, nodes, node_vars(state, after, require=require))
    except ConfigureError as exc:
        raise _rolled_back(exc, state, store, nodes, before, store_reached=False) from None
    if applied.missing_users:
        node, users = sorted(applied.missing_users.items())[0]
        raise UsageError(
            f"no user {users[0]!r} on {node} (accounts come from the nodes' OS or directory service; "
            "infractl does not create them); nothing was changed",
            field="USER",
        )
    try:
        store.apply_access(rights(state), after)
    except UnknownUser as exc:
        failed = _rolled_back(exc, state, store, nodes, before, store_reached=True)
        if failed is not exc:
            raise failed from None
        raise UsageError(f"{exc.message}; nothing was changed", field="USER") from None
    except StoreError as exc:
        raise _rolled_back(exc, state, store, nodes, before, store_reached=True) from None
    _save_members(state, after)
    return applied.changed


def _rolled_back(
    exc: InfractlError,
    state: ClusterState,
    store: Store,
    nodes: list[Node],
    before: dict[str, list[str]],
    *,
    store_reached: bool,
) -> InfractlError:
    """Put the nodes and the store back to ``before`` after ``exc``; return ``exc`` when that
    worked, else an error that says both."""
    try:
        configure.apply_access(state.dir, nodes, node_vars(state, before))
        if store_reached:
            store.apply_access(rights(state), before)
    except InfractlError as again:
        return InfractlError(
            f"{exc.message}; restoring the previous membership failed too ({again.message}): fix that and "
            "run `infractl up`, which applies the recorded membership to the nodes, then grant or revoke again"
        )
    return exc


# -- the handover bundle's access/ ----------------------------------------------------------------


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


def bundle_files(state: ClusterState) -> dict[str, bytes]:
    """The bundle's ``access/``: ``<role>.iam.json`` (each role's IAM policy, scoped to the
    store's bucket and prefix), ``members.json`` (who holds which role) and ``README.md``.
    Paths relative to the bundle root; deterministic."""
    record = state.read()
    store = open_store(record["store"], field="cluster.store")  # names only: nothing is reached
    files = {f"access/{r.role}.iam.json": _json(store.access_policy(r)) for r in rights(state)}
    files["access/members.json"] = _json(membership(state))
    files["access/README.md"] = _readme(state, record["store"]).encode()
    return files


def _patterns(patterns: Sequence[str]) -> str:
    return ", ".join(f"`{p}`" for p in patterns) or "nothing"


def _readme(state: ClusterState, store_uri: str) -> str:
    members = load_members(state)
    cluster = state.name
    roles = "\n".join(
        f"| {r.name} | {r.summary} | {', '.join(f'`{c}`' for c in r.commands)} | "
        f"{', '.join(f'`{u}`' for u in members[r.name]) or 'nobody'} |"
        for r in ROLES
    )
    store_rows = "\n".join(
        f"| {r.name} | {_patterns(r.read)} | {_patterns(r.write)} | {_patterns(r.delete)} | "
        f"`{policy_name(state, r.name)}` |"
        for r in ROLES
    )
    node_rows = "\n".join(
        f"| {r.name} | `{group_name(state, r.name)}` | "
        + " | ".join(f"`{r.nodes.get(d, '---')}`" for d in NODE_DIRECTORIES)
        + " |"
        for r in ROLES
    )
    return _README.format(
        cluster=cluster,
        store=store_uri,
        roles=roles,
        store_rows=store_rows,
        node_rows=node_rows,
        dirs=" | ".join(f"`{d}`" if d != "." else "work dir" for d in NODE_DIRECTORIES),
        rules="|".join("---" for _ in NODE_DIRECTORIES),
        prefixes=", ".join(f"`{p}/`" for p in runstore.PREFIXES),
        state=_members_path(state),
    )


_README = """# Access to cluster {cluster}

Rights belong to four roles, never to people: nobody gets a right except through a role, and
taking someone out of a role takes every right it gave them at once.

| role | may | commands | members |
|---|---|---|---|
{roles}

## In the store ({store})

Key patterns relative to the store's root; `*` matches any characters. Top-level prefixes:
{prefixes}. `<role>.iam.json` here is each role's IAM policy: on an `s3://` store infractl keeps
it as the managed policy named below and attaches it to the role's members (IAM users of the same
names). A store that is not in S3 gets the policies written for a bucket named `BUCKET`: what
the roles get once the store moves to S3.

| role | reads | writes | deletes | IAM policy |
|---|---|---|---|---|
{store_rows}

Operators delete under `runs/` because the trainers do (checkpoint retention keeps the newest
steps), as do `train --new` and `plan --measure` (its probe run); nothing else deletes but
`teardown --purge`, so only infra-admin may delete the rest: datasets, configs, benchmarks,
measurements, the whole prefix.

On a `file://` store the same matrix is POSIX ACLs for the roles' Unix groups (below) on the
store's directories, coarser in two ways: a role reads a top-level directory whole (viewers read
all of `runs/`, checkpoints included), and whoever may write a directory may also delete in it
(operators in `plan/` and `bench/`, config-admins in `datasets/` and `configs/`).

## On the nodes

Each role is a Unix group on every node; its members are the role's members. The group's ACL
entries on the node's directories are the role's rights there (`r` read, `w` create and delete
entries, `x` enter), set as default ACLs too, so every log file written later inherits them
(a file written mode 0600, such as `env/network.env`, stays its owner's). The work directory is
closed to everyone else (mode `u=rwx,o=`; the group bits show the ACL mask).

| role | Unix group | {dirs} |
|---|---|{rules}|
{node_rows}

A member's running login sessions keep the groups they started with: after a revoke, end the
user's sessions (or wait for them to log out) for the node side to take effect there too.

## Grant and revoke

```bash
infractl access grant USER ROLE -c {cluster}    # USER must have an account on every node (OS or directory service)
infractl access revoke USER ROLE -c {cluster}   # every right of that role, on the nodes and in the store, at once
infractl access list -c {cluster}               # who holds which role (--json for scripts)
```

Only infra-admins (root on the nodes) can run these. Membership lives in the cluster's state:

    {state}

(`members.json` here is a copy). `infractl up` applies it to the nodes again; `infractl teardown`
removes the groups and takes every right back from the store.
"""


# -- teardown ---------------------------------------------------------------------------------------


def remove_from_store(state: ClusterState, store: Store) -> bool:
    """Take every role's rights back from the store, if access was ever granted on this cluster
    (its membership file exists); return whether it was."""
    if not _members_path(state).is_file():
        return False
    store.remove_access(rights(state))
    return True


# groupdel waits for /etc/group's lock; another cluster configuring on this machine may hold it.
_GROUPDEL_ATTEMPTS = 10
_GROUPDEL_RETRY_S = 0.5


def remove_groups(state: ClusterState) -> None:
    """On the local provider (the nodes are this machine): take the roles' groups out of the
    state directory's ACL (up let members pass through it to the nodes), then delete the groups.
    Raises ``InfractlError`` if any group is left."""
    groups = [group_name(state, name) for name in ROLE_NAMES]
    present = [g for g in groups if proc.group_exists(g)]
    if present and state.dir.is_dir():
        entries = ",".join(f"group:{g}" for g in present)
        done = _run(["setfacl", "-x", entries, str(state.dir)])
        if done.returncode != 0:
            raise InfractlError(f"cannot remove the access groups from the ACL of {state.dir}: {done.stderr.strip()}")
    for group in present:
        for _attempt in range(_GROUPDEL_ATTEMPTS):
            if _run(["groupdel", group]).returncode == 0 or not proc.group_exists(group):
                break
            time.sleep(_GROUPDEL_RETRY_S)
    left = [g for g in groups if proc.group_exists(g)]
    if left:
        raise InfractlError(f"teardown left the access groups of cluster {state.name!r} behind: {', '.join(left)}")


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return proc.run(argv)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InfractlError(f"cannot run {argv[0]}: {exc}") from None
