"""Cluster commands: ``up``, ``teardown``, ``status``."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from infractl import cluster, proc, runstore
from infractl.cli._common import ClusterOpt, JsonOpt, YesOpt, confirm, output
from infractl.config import RunSpec, default_cluster
from infractl.errors import StateError
from infractl.state import ClusterState, resolve_cluster

__all__ = ["register"]


def up(cluster_opt: ClusterOpt = None, json_mode: JsonOpt = False) -> None:
    """Provision the nodes (Terraform), configure them (Ansible) and pass the health gate."""
    out = output(json_mode)
    state, spec = resolve_cluster(cluster_opt)
    if spec is None:
        spec = state.spec() if state.is_up() else default_cluster()
    with state.lock("up"):
        result = cluster.up(state, spec, out)
    for h in result.health:
        out.info(f"health: {h.get('node', '?')}: all_reduce over {h.get('world')} node(s), "
                 f"bus bandwidth {h.get('busbw_gbps', 0):.3f} GB/s")
    if result.changed:
        out.success(f"cluster {spec.name!r} is up: {len(result.nodes)} node(s), rendezvous {result.rendezvous}")
    else:
        out.success(f"cluster {spec.name!r} is up: no changes")
    out.result({**asdict(result), "changed": result.changed})


def teardown(cluster_opt: ClusterOpt = None, yes: YesOpt = False,
             purge: bool = typer.Option(False, "--purge", help="Also delete this cluster's runs from the store."),
             json_mode: JsonOpt = False) -> None:
    """Stop every job, destroy the nodes, and verify nothing of the cluster is left."""
    out = output(json_mode)
    state, _ = resolve_cluster(cluster_opt)
    if not state.is_up():
        raise StateError(f"nothing to tear down: cluster {state.name!r} is not up")
    confirm(f"Destroy cluster {state.name!r}{' and purge its runs' if purge else ''}?", yes=yes)
    with state.lock("teardown"):
        result = cluster.teardown(state, out, purge=purge)
    kept = "" if purge else " (store kept; --purge deletes runs)"
    out.success(f"cluster {result.cluster!r} torn down: {result.nodes_removed} node(s) destroyed, "
                f"{result.processes_killed} process(es) stopped, nothing left{kept}")
    out.result(asdict(result))


def _run_rows(state: ClusterState) -> list[dict[str, Any]]:
    store = cluster.store_for(state)
    rows = []
    for run_id in runstore.list_runs(store):
        record = runstore.read_run_record(store, run_id) or {}
        if record.get("cluster") != state.name:
            continue
        steps = RunSpec.model_validate(record["spec"]).steps
        last = runstore.latest_committed_step(store, run_id)
        latest = runstore.latest_metrics(store, run_id) or {}
        attempts = record.get("attempts", [])
        if proc.find(state.dir, run=run_id):
            run_state = "running"
        elif (last or 0) >= steps:
            run_state = "completed"
        elif attempts and attempts[-1].get("outcome") == "failed":
            run_state = "failed"
        else:
            run_state = "stopped"
        rows.append({
            "run": run_id, "state": run_state, "attempts": len(attempts), "steps": steps,
            "last_committed_step": last, "last_step": latest.get("step"), "loss": latest.get("loss"),
            "world_size": latest.get("world_size"),
        })
    return rows


def status(cluster_opt: ClusterOpt = None, json_mode: JsonOpt = False) -> None:
    """Show the cluster, its nodes, and every run with its state and last committed step."""
    out = output(json_mode)
    state, _ = resolve_cluster(cluster_opt)
    record = state.read()
    rdzv = record["rendezvous"]
    nodes = [
        {**n, "live_processes": len(proc.find(state.dir, node=n["name"]))} for n in record["nodes"]
    ]
    data = {
        "cluster": record["name"],
        "provider": record["spec"]["provider"],
        "store": record["store"],
        "rendezvous": {**rdzv, "running": bool(proc.find(state.dir, node=cluster.RENDEZVOUS_NODE))},
        "nodes": nodes,
        "runs": _run_rows(state),
    }
    header = Text(
        f"cluster {data['cluster']} · provider {data['provider']} · store {data['store']}\n"
        f"rendezvous {rdzv['host']}:{rdzv['port']} {'running' if data['rendezvous']['running'] else 'DOWN'}"
    )
    table = Table(title="nodes")
    for col in ("node", "address", "processes/node", "live processes"):
        table.add_column(col)
    for n in nodes:
        table.add_row(n["name"], n["address"], str(n["processes"]), str(n["live_processes"]))
    runs = Table(title="runs")
    for col in ("run", "state", "attempts", "last committed", "last step", "loss", "world"):
        runs.add_column(col)
    for r in data["runs"]:
        runs.add_row(r["run"], r["state"], str(r["attempts"]),
                     f"{r['last_committed_step'] if r['last_committed_step'] is not None else '-'}/{r['steps']}",
                     str(r["last_step"] if r["last_step"] is not None else "-"),
                     f"{r['loss']:.4f}" if r["loss"] is not None else "-", str(r["world_size"] or "-"))
    out.result(data, Group(header, table, runs) if data["runs"] else Group(header, table))


def register(app: typer.Typer) -> None:
    app.command()(up)
    app.command()(teardown)
    app.command()(status)
