"""Cluster commands: ``up``, ``keyscan``, ``teardown``, ``status``, ``gc``."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from infractl import cluster, proc, providers, runs
from infractl.cli._common import ClusterOpt, JsonOpt, YesOpt, confirm, output
from infractl.config import default_cluster, load_cluster
from infractl.errors import InfractlError, UsageError
from infractl.providers.contract import Plan
from infractl.statedir import ClusterState, known_clusters, resolve_cluster, write_private

__all__ = ["register"]


def up(
    cluster_opt: ClusterOpt = None,
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Print the Terraform variables, the resources that would be created and their hourly cost; change "
        "nothing and call no cloud API (no credentials needed).",
    ),
    json_mode: JsonOpt = False,
) -> None:
    """Provision the nodes (Terraform), configure them (Ansible) and pass the health gate."""
    out = output(json_mode)
    state, spec = resolve_cluster(cluster_opt)
    if spec is None:
        spec = state.spec() if state.was_started() else default_cluster()
    if dry_run:
        provider = providers.get(spec.provider)
        device = provider.device(spec, os.environ)
        plan = provider.dry_run(spec, state)
        lines = [*_dry_run_lines(spec.name, plan), cluster.device_line(device)]
        out.result(plan.to_dict() | {"device": asdict(device)}, Group(*(Text(line) for line in lines)))
        return
    store = cluster.preflight(state, spec)
    with state.lock("up"), cluster.interruptible(state):
        result = cluster.up(state, spec, store, out)
    for h in result.health:
        out.info(
            f"health: {h.get('node', '?')}: all_reduce over {h.get('world')} node(s), "
            f"bus bandwidth {h.get('busbw_gbps', 0):.3f} GB/s"
        )
    if result.changed:
        out.success(f"cluster {spec.name!r} is up: {len(result.nodes)} node(s), rendezvous {result.rendezvous}")
    else:
        out.success(f"cluster {spec.name!r} is up: no changes")
    out.result({**asdict(result), "changed": result.changed})


def _dry_run_lines(cluster_name: str, plan: Plan) -> list[str]:
    where = ", ".join(part for part in (plan.module, plan.region) if part)
    lines = [f"dry run of `infractl up` for cluster {cluster_name!r} (provider {plan.provider}"]
    lines[0] += f", {where}): " if where else "): "
    lines[0] += "nothing was created or changed"
    if plan.module is not None:
        lines.append("terraform variables:")
        lines += [f"  {name} = {json.dumps(value)}" for name, value in plan.variables.items()]
    lines.append(f"{len(plan.resources)} resource(s) would be created:")
    lines += [f"  {address}" for address in plan.resources]
    cost = plan.cost
    if cost is None:
        lines.append("cost: none" + (f" ({plan.cost_note})" if plan.cost_note else ""))
        return lines
    lines.append(f"hourly cost ({cost.currency}, {cost.basis}):")
    lines += [f"  {line.item}  {line.hourly:,.2f}/h" + (f" ({line.note})" if line.note else "") for line in cost.lines]
    lines.append(f"  total {cost.total:,.2f}/h" + (f" ({cost.note})" if cost.note else ""))
    return lines


def teardown(
    cluster_opt: ClusterOpt = None,
    yes: YesOpt = False,
    purge: bool = typer.Option(False, "--purge", help="Also delete this cluster's runs from the store."),
    json_mode: JsonOpt = False,
) -> None:
    """Stop every job, destroy the nodes, and verify nothing of the cluster is left. A cluster
    that is already down is success (exit 0), so a retried teardown succeeds."""
    out = output(json_mode)
    state, _ = resolve_cluster(cluster_opt, down_ok=True)
    if not state.was_started():
        out.success(f"nothing to tear down: cluster {state.name!r} is not up")
        out.result(asdict(cluster.TeardownResult(state.name, 0, 0, [], already_down=True)))
        return
    confirm(f"Destroy cluster {state.name!r}{' and purge its runs' if purge else ''}?", yes=yes)
    with state.lock("teardown"):
        result = cluster.teardown(state, out, purge=purge)
    kept = "" if purge else " (store kept; --purge deletes runs)"
    out.success(
        f"cluster {result.cluster!r} torn down: {result.nodes_removed} node(s) destroyed, "
        f"{result.processes_killed} process(es) stopped, nothing left{kept}"
    )
    out.result(asdict(result))


def gc(
    yes: bool = typer.Option(False, "--yes", "-y", help="Remove what was found (without it, gc only lists)."),
    account: str | None = typer.Option(
        None,
        "--account",
        metavar="CLUSTER.yaml",
        help="Also look in the cloud account and region this cluster.yaml names (aws: tagged resources of "
        "clusters with no Terraform state in its aws.state_bucket).",
    ),
    json_mode: JsonOpt = False,
) -> None:
    """Find what infractl made on this machine that no cluster owns any more (an interrupted `up`,
    a state directory deleted without `teardown`, an interrupted test run) and, with --yes, remove it.

    Lists: clusters whose `up` never finished (torn down as `teardown` would), processes carrying the
    marker of a cluster that is gone, netns namespaces, interfaces, container run roots and sshd processes,
    and the access roles' groups; with --account, what the cloud account holds of clusters whose state is
    gone. Exit 1 when something could not be removed.
    """
    from infractl import gc as garbage

    out = output(json_mode)
    found = garbage.find(load_cluster(Path(account)) if account is not None else None)
    lines = [f"cluster {s.name!r} at {s.dir}: its `up` never finished" for s in found.interrupted]
    lines += [f"{o.kind} {o.name}" for o in found.orphans]
    if not yes:
        said = "nothing to collect" if not lines else f"{len(lines)} to collect (`infractl gc --yes` removes them)"
        out.result(found.to_dict() | {"removed": False}, Text("\n".join([*lines, said])))
        return
    for line in lines:
        out.info(f"gc: {line}")
    done = garbage.collect(found, out)
    if done.failed:
        raise InfractlError(f"gc could not remove {len(done.failed)} thing(s): {'; '.join(done.failed)}")
    out.success(f"gc: {len(lines)} removed" if lines else "gc: nothing to collect")
    out.result(done.to_dict() | {"removed": True})


def _known(headline: str) -> tuple[dict[str, Any], RenderableType]:
    clusters = [c.to_dict() for c in known_clusters()]
    table = Table(title="clusters with state here")
    for col in ("cluster", "provider", "nodes", "state"):
        table.add_column(col)
    for c in clusters:
        table.add_row(
            c["name"],
            c["provider"] or "-",
            str(c["nodes"] if c["nodes"] is not None else "-"),
            "up" if c["up"] else "down",
        )
    human: RenderableType = Group(Text(headline), table) if clusters else Text(headline)
    return {"clusters": clusters}, human


def status(cluster_opt: ClusterOpt = None, json_mode: JsonOpt = False) -> None:
    """Show the cluster, its nodes, and every run with its state and last committed step.

    Without -c and with the built-in `local` cluster not up, list the clusters that have state
    here. With the store unreachable, show what the nodes' processes tell and mark the store so.
    """
    out = output(json_mode)
    state, _ = resolve_cluster(cluster_opt)
    if cluster_opt is None and not state.is_up():
        up_names = [c.name for c in known_clusters() if c.up]
        headline = (
            "no cluster is up"
            if not up_names
            else f"cluster 'local' is not up; up here: {', '.join(up_names)} (use -c NAME)"
        )
        data, human = _known(headline)
        out.result(data, human)
        return
    data = runs.status(state)
    store_status, rdzv, rows = data["store"], data["rendezvous"], data["runs"]
    reach = "" if store_status["reachable"] else f" UNREACHABLE ({store_status['error']})"
    header = Text(
        f"cluster {data['cluster']} · provider {data['provider']} · store {store_status['uri']}{reach}\n"
        f"rendezvous {rdzv['host']}:{rdzv['port']} {'running' if rdzv['running'] else 'DOWN'}"
        + (f"\ntrainer in image {data['image']}" if data["image"] else "")
    )
    parts: list[RenderableType] = [header, _nodes_table(data["nodes"])]
    if rows:
        parts.append(_runs_table(rows, store_reachable=store_status["reachable"]))
    parts += [Text(line) for line in _attention_lines(state, rows)]
    if not store_status["reachable"]:
        out.warn(
            f"the store is unreachable: runs show only what the nodes' processes tell ({store_status['error']}); "
            f"{_read(state, store_status['runbook'])}"
        )
    out.result(data, Group(*parts))


def _nodes_table(nodes: list[dict[str, Any]]) -> Table:
    table = Table(title="nodes")
    for col in ("node", "address", "processes/node", "live processes"):
        table.add_column(col)
    for n in nodes:
        live = "unreachable" if n["live_processes"] is None else str(n["live_processes"])
        table.add_row(n["name"], n["address"], str(n["processes"]), live)
    return table


def _attention_lines(state: ClusterState, rows: list[dict[str, Any]]) -> list[str]:
    """One line per run that needs a person: its condition, why, and where its runbook is."""
    return [
        f"run {r['run']} is {r['attention']['condition']} ({r['attention']['why']}): {_read(state, r['attention'])}"
        for r in rows
        if r["attention"]
    ]


def _read(state: ClusterState, where: dict[str, Any]) -> str:
    """Where to read a runbook.section(): its path, or how to get the bundle that has it."""
    if where["path"]:
        return f"see {where['path']}"
    anchor = f"#{where['section']}" if where["section"] else ""
    if where["runbook"] == "store-outage":  # the bundle is made from the store: it cannot be written now
        return f"see runbooks/store-outage.md of a handover bundle written before (`infractl bundle -c {state.name}`)"
    return f"write the handover with `infractl bundle -c {state.name}`, then see runbooks/{where['runbook']}.md{anchor}"


def _runs_table(rows: list[dict[str, Any]], *, store_reachable: bool) -> Table:
    title = "runs" if store_reachable else "runs (from processes; the store is unreachable)"
    table = Table(title=title)
    for col in ("run", "state", "attempts", "last committed", "last step", "loss", "world"):
        table.add_column(col)

    def dash(value: Any) -> str:
        return "-" if value is None else str(value)

    for r in rows:
        table.add_row(
            r["run"],
            r["state"],
            dash(r["attempts"]),
            f"{dash(r['last_committed_step'])}/{dash(r['steps'])}",
            dash(r["last_step"]),
            f"{r['loss']:.4f}" if isinstance(r["loss"], (int, float)) else "-",
            dash(r["world_size"]),
        )
    return table


def keyscan(cluster_opt: ClusterOpt = None, yes: YesOpt = False, json_mode: JsonOpt = False) -> None:
    """Pin the host keys of a cluster's hosts (provider ssh): print each key's fingerprint as the host
    offers it now, and write cluster.yaml's known_hosts only once the operator confirms them."""
    out = output(json_mode)
    state, spec = resolve_cluster(cluster_opt, down_ok=True)
    if spec is None:
        raise UsageError("give the cluster.yaml whose hosts to scan with -c", field="--cluster")
    scanned = providers.get(spec.provider).scan_host_keys(spec)
    if scanned is None:
        raise UsageError(
            f"provider {spec.provider} pins its nodes' host keys itself; nothing to scan", field="provider"
        )
    entries = [(host, line, _fingerprint(line)) for host, line in scanned.entries]
    for host, _, fingerprint in entries:
        out.info(f"{host}: {fingerprint}")
    confirm(f"Pin these {len(entries)} key(s) in {scanned.path}? Compare them with the hosts' own first", yes=yes)
    write_private(scanned.path, "".join(f"{line}\n" for _, line, _ in entries))
    out.success(f"{len(entries)} host key(s) pinned in {scanned.path}")
    out.result({"known_hosts": str(scanned.path), "keys": [{"host": h, "fingerprint": f} for h, _, f in entries]})


def _fingerprint(line: str) -> str:
    """``ssh-keygen -l``'s fingerprint of one known_hosts line: bits, SHA256 hash, key type."""
    done = proc.run(["ssh-keygen", "-l", "-f", "-"], input=line.split(" ", 1)[1] + "\n", timeout=30)
    if done.returncode != 0:
        raise InfractlError(f"ssh-keygen cannot read the key offered: {proc.last_line(done.stderr)}")
    bits, digest, *_, kind = done.stdout.split()
    return f"{kind.strip('()')} {digest} ({bits} bits)"


def register(app: typer.Typer) -> None:
    app.command()(up)
    app.command()(keyscan)
    app.command()(teardown)
    app.command()(status)
    app.command()(gc)
