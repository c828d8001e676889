"""The handover bundle's ``access/``: each role's IAM policy, who holds which role, and a README
that explains the roles to the team that takes the cluster over."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from infractl import runstore
from infractl.access.roles import (
    NODE_DIRECTORIES,
    ROLES,
    group_name,
    load_members,
    members_path,
    membership,
    policy_name,
    rights,
)
from infractl.statedir import ClusterState
from infractl.store import open_store

__all__ = ["bundle_files"]


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


def bundle_files(state: ClusterState) -> dict[str, bytes]:
    """The bundle's ``access/``: ``<role>.iam.json`` (each role's IAM policy, scoped to the
    store's bucket and prefix), ``members.json`` (who holds which role) and ``README.md``.
    Paths relative to the bundle root; deterministic."""
    record = state.record()
    store = open_store(record.store, field="cluster.store")  # names only: nothing is reached
    files = {f"access/{r.role}.iam.json": _json(store.access_policy(r)) for r in rights(state)}
    files["access/members.json"] = _json(membership(state))
    files["access/README.md"] = _readme(state, record.store).encode()
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
        state=members_path(state),
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
entries, `x` enter); `logs/` has them as its default ACL too, so every log file written later
inherits them. No role writes anything on a node: `private/` (what root reads, sources or writes
through: the network environment, each run's spec, key and agent environment) and `work/` (the
trainer's files) are root's alone, with no ACL, and the work directory is closed to everyone
else (mode `u=rwx,o=`; the group bits show the ACL mask). On a node that is a host of its own
(netns, aws), a role user's processes reach no port of the cluster's addresses but SSH, and no
instance metadata (an iptables guard `infractl up` keeps; SECURITY.md in infractl's repository).

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
