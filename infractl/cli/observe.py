"""Read-only commands: ``logs`` and ``metrics`` (they read the store and node logs, never the trainers)."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from infractl import cluster, runstore
from infractl.cli._common import ClusterOpt, JsonOpt, output
from infractl.errors import StateError, UsageError
from infractl.launcher import node_log
from infractl.state import resolve_cluster

__all__ = ["register"]


def logs(
    cluster_opt: ClusterOpt = None,
    node: Annotated[Optional[str], typer.Option("--node", "-n", help="Only this node (e.g. node-1).")] = None,
    run: Annotated[Optional[str], typer.Option("--run", "-r", help="Run name. Default: the most recently launched run.")] = None,
    tail: Annotated[int, typer.Option("--tail", help="Lines per node (0 = all).", min=0)] = 200,
) -> None:
    """Print the training logs of every node (or one) for a run."""
    out = output()
    state, _ = resolve_cluster(cluster_opt)
    record = state.read()
    nodes = record["nodes"]
    if node is not None:
        nodes = [n for n in nodes if n["name"] == node]
        if not nodes:
            names = ", ".join(n["name"] for n in record["nodes"])
            raise UsageError(f"--node: no node {node!r} in cluster {state.name!r} (nodes: {names})")
    if run is None:
        records = sorted(state.runs_dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
        if not records:
            raise StateError(f"no run has been launched on cluster {state.name!r}")
        run = records[-1].stem
    for n in nodes:
        path: Path = node_log(n, run)
        out.raw(f"==> {n['name']} · run {run} · {path}\n")
        if not path.is_file():
            out.raw("(no log yet)\n")
            continue
        with path.open(errors="replace") as f:
            lines = deque(f, maxlen=tail or None)
        out.raw("".join(lines))


def metrics(
    run: Annotated[str, typer.Argument(help="Run name.")],
    cluster_opt: ClusterOpt = None,
    json_mode: JsonOpt = False,
) -> None:
    """Per-step records of a run: loss, validation loss, step time, tokens/s, world size (--json: all fields)."""
    out = output(json_mode)
    state, _ = resolve_cluster(cluster_opt)
    store = cluster.store_for(state)
    records = runstore.read_metrics(store, run)
    if not records and runstore.read_run_record(store, run) is None:
        raise UsageError(f"RUN: no run named {run!r} in the store {store.uri}")
    table = Table(title=f"run {run}")
    for col in ("step", "loss", "val loss", "step time (s)", "tokens/s", "world", "attempt"):
        table.add_column(col, justify="right")
    for r in records:
        val = f"{r['val_loss']:.4f}" if "val_loss" in r else ""
        table.add_row(str(r["step"]), f"{r['loss']:.4f}", val, f"{r['step_time_s']:.3f}",
                      f"{r['tokens_per_s']:,.0f}", str(r.get("world_size", "-")), str(r.get("attempt", "-")))
    out.result(records, table)


def register(app: typer.Typer) -> None:
    app.command()(logs)
    app.command()(metrics)
