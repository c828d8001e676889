"""``infractl access``: grant and revoke the access roles, and list who holds them
(infractl/access/: the roles, and how the nodes and the store enforce them)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from infractl import access
from infractl.cli._common import ClusterOpt, JsonOpt, output
from infractl.output import Output
from infractl.statedir import resolve_cluster
from infractl.store import for_cluster

__all__ = ["register"]

access_app = typer.Typer(
    help="Who may do what on the cluster: the roles viewer, operator, config-admin and infra-admin.",
    no_args_is_help=True,
)

UserArg = Annotated[
    str,
    typer.Argument(
        help="User name: an account on every node (and an IAM user of that name with an s3:// store).",
        metavar="USER",
        show_default=False,
    ),
]
RoleArg = Annotated[
    str,
    typer.Argument(help=f"Role: {', '.join(access.ROLE_NAMES)}.", metavar="ROLE", show_default=False),
]


def _report(out: Output, change: access.Change, done: str) -> None:
    if change.changed:
        out.success(done)
    else:
        out.success(
            f"{change.user} already holds {change.role} on cluster {change.cluster!r}; applied again "
            f"({change.node_tasks_changed} node task(s) changed)"
        )
    out.result(change.to_dict())


@access_app.command()
def grant(user: UserArg, role: RoleArg, cluster_opt: ClusterOpt = None, json_mode: JsonOpt = False) -> None:
    """Give USER the role ROLE: on every node (group membership, ACLs) and in the store (ACLs or IAM policy)."""
    out = output(json_mode)
    state, _ = resolve_cluster(cluster_opt)
    state.record()  # refuse a cluster that is not up before taking its lock
    with state.lock("access grant"):
        change = access.grant(state, for_cluster(state), user, role)
    _report(
        out,
        change,
        f"{user} holds {role} on cluster {change.cluster!r}: a member of group {change.group} on every node, "
        "with the role's rights in the store",
    )


@access_app.command()
def revoke(user: UserArg, role: RoleArg, cluster_opt: ClusterOpt = None, json_mode: JsonOpt = False) -> None:
    """Take ROLE from USER: every right it gave, on the nodes and in the store, at once."""
    out = output(json_mode)
    state, _ = resolve_cluster(cluster_opt)
    state.record()
    with state.lock("access revoke"):
        change = access.revoke(state, for_cluster(state), user, role)
    _report(
        out,
        change,
        f"{user} no longer holds {role} on cluster {change.cluster!r}: out of group {change.group} on every "
        "node, and the role's rights in the store are gone",
    )


@access_app.command("list")
def list_(cluster_opt: ClusterOpt = None, json_mode: JsonOpt = False) -> None:
    """Every role: what it may do, its Unix group and IAM policy, and its members."""
    out = output(json_mode)
    state, _ = resolve_cluster(cluster_opt)
    state.record()
    data = access.membership(state)
    table = Table(title=f"access to cluster {state.name}")
    for col in ("role", "may", "group", "members"):
        table.add_column(col)
    for name, role in data["roles"].items():
        table.add_row(name, role["summary"], role["group"], ", ".join(role["members"]) or "-")
    out.result(data, table)


def register(app: typer.Typer) -> None:
    app.add_typer(access_app, name="access")
