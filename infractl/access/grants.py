"""Granting and revoking roles, on every node and in the store at once (rolled back together
when either side fails), and taking every right back when the cluster is torn down."""

from __future__ import annotations

import functools
import grp
import re
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from infractl import playbook, proc, providers
from infractl.access.roles import (
    ROLE_NAMES,
    USER_PATTERN,
    group_name,
    load_members,
    members_path,
    node_vars,
    policy_name,
    rights,
    save_members,
)
from infractl.errors import ConfigureError, InfractlError, UsageError
from infractl.providers import NodeControl
from infractl.statedir import ClusterState, Orphan
from infractl.store import Store, StoreError, UnknownUser

__all__ = ["Change", "grant", "remove_from_store", "remove_groups", "revoke"]


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
    nodes (and the store, if it was reached) back to ``before`` and leave the record as it was.
    A store that cannot hold the roles' rights (an S3 store with no prefix: ``ConfigError``) is
    refused before anything changes."""
    for role in rights(state):
        store.access_policy(role)
    nodes = providers.control(state)
    try:
        applied = playbook.apply_access(state.dir, nodes, node_vars(state, after, require=require))
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
    save_members(state, after)
    return applied.changed


def _rolled_back(
    exc: InfractlError,
    state: ClusterState,
    store: Store,
    nodes: NodeControl,
    before: dict[str, list[str]],
    *,
    store_reached: bool,
) -> InfractlError:
    """Put the nodes and the store back to ``before`` after ``exc``; return ``exc`` when that
    worked, else an error that says both."""
    try:
        playbook.apply_access(state.dir, nodes, node_vars(state, before))
        if store_reached:
            store.apply_access(rights(state), before)
    except InfractlError as again:
        return InfractlError(
            f"{exc.message}; restoring the previous membership failed too ({again.message}): fix that and "
            "run `infractl up`, which applies the recorded membership to the nodes, then grant or revoke again"
        )
    return exc


# -- teardown ---------------------------------------------------------------------------------------


def remove_from_store(state: ClusterState, store: Store) -> bool:
    """Take every role's rights back from the store, if access was ever granted on this cluster
    (its membership file exists); return whether it was."""
    if not members_path(state).is_file():
        return False
    store.remove_access(rights(state))
    return True


# groupdel waits for /etc/group's lock; another cluster configuring on this machine may hold it.
_GROUPDEL_ATTEMPTS = 10
_GROUPDEL_RETRY_S = 0.5
# A role's group (roles.group_name): the cluster's name cut to 12 characters, its short_id, the role.
_GROUP = re.compile(rf".{{1,12}}-(?P<id>[0-9a-f]{{6}})-(?:{'|'.join(ROLE_NAMES)})")


def remove_groups(state: ClusterState) -> None:
    """Where the nodes' accounts are this machine's: take the roles' groups out of the
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
        _delete_group(group)
    left = [g for g in groups if proc.group_exists(g)]
    if left:
        raise InfractlError(f"teardown left the access groups of cluster {state.name!r} behind: {', '.join(left)}")


def stray_groups(owned: set[str]) -> list[Orphan]:
    """The roles' groups on this machine named after no started cluster (``owned``: their
    ``short_id``): a local cluster's whose state directory was deleted without ``teardown``."""
    return [
        Orphan("group", entry.gr_name, functools.partial(_delete_group, entry.gr_name))
        for entry in grp.getgrall()
        if (match := _GROUP.fullmatch(entry.gr_name)) and match["id"] not in owned
    ]


def _delete_group(group: str) -> None:
    for _attempt in range(_GROUPDEL_ATTEMPTS):
        if _run(["groupdel", group]).returncode == 0 or not proc.group_exists(group):
            return
        time.sleep(_GROUPDEL_RETRY_S)
    raise InfractlError(f"cannot delete group {group}")


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return proc.run(argv)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InfractlError(f"cannot run {argv[0]}: {exc}") from None
