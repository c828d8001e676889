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

Rooms: ``roles`` (the table, names, rights and membership), ``grants`` (grant, revoke, and taking
everything back at teardown). The handover bundle's ``access/`` is written by
``infractl.handover.access_docs``.
"""

from __future__ import annotations

from infractl.access.grants import Change, grant, remove_from_store, remove_groups, revoke, stray_groups
from infractl.access.roles import (
    NODE_DIRECTORIES,
    ROLE_NAMES,
    ROLES,
    USER_PATTERN,
    Role,
    group_name,
    load_members,
    membership,
    node_vars,
    policy_name,
    rights,
)

__all__ = [
    "NODE_DIRECTORIES",
    "ROLES",
    "ROLE_NAMES",
    "USER_PATTERN",
    "Change",
    "Role",
    "grant",
    "group_name",
    "load_members",
    "membership",
    "node_vars",
    "policy_name",
    "remove_from_store",
    "remove_groups",
    "stray_groups",
    "revoke",
    "rights",
]
