"""Read-only commands: ``logs`` and ``metrics`` (they read the store and node logs, never the trainers)."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from infractl import cluster, runstore
from infractl.cli._common import ClusterOpt, JsonOpt, RunArg, name_option, output
from infractl.errors import StateError, StoreError, UsageError
from infractl.launcher import node_log
from infractl.state import resolve_cluster

__all__ = ["register"]


def logs(
    cluster_opt: ClusterOpt = None,
    node: Annotated[Optional[str], typer.Option(
        "--node", "-n", help="Only this node (e.g. node-1).", callback=name_option)] = None,
    run: Annotated[Optional[str], typer.Option(
        "--run", "-r", help="Run name. Default: the most recently launched run.", callback=name_option)] = None,
    tail: Annotated[int, typer.Option("--tail", help="Lines per node (0 = all).", min=0, max=10**9)] = 200,
) -> None:
    """Print the training logs of every node (or one) for a run, after the run's attempts from the store.

    The logs live on the nodes: with the store unreachable they are still printed, and the
    command then exits 1 naming the store.
    """
    out = output()
    state, _ = resolve_cluster(cluster_opt)
    record = state.read()
    nodes = record["nodes"]
    if node is not None:
        nodes = [n for n in nodes if n["name"] == node]
        if not nodes:
            names = ", ".join(n["name"] for n in record["nodes"])
            raise UsageError(f"no node {node!r} in cluster {state.name!r} (nodes: {names})", field="--node")
    if run is None:
        records = sorted(state.runs_dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
        if not records:
            raise StateError(f"no run has been launched on cluster {state.name!r}")
        run = records[-1].stem
    elif not any(node_log(n, run).is_file() for n in record["nodes"]) and not state.run_record_path(run).is_file():
        raise UsageError(f"no run {run!r} has been launched on cluster {state.name!r}", field="--run")
    store_error: StoreError | None = None
    try:
        run_record = runstore.read_run_record(cluster.store_for(state), run)
    except StoreError as exc:
        store_error, run_record = exc, None
    if run_record is not None:
        out.raw("".join(f"{line}\n" for line in _attempt_lines(run, run_record)))
    for n in nodes:
        path: Path = node_log(n, run)
        out.raw(f"==> {n['name']} · run {run} · {path}\n")
        if not path.is_file():
            out.raw("(no log yet)\n")
            continue
        with path.open(errors="replace") as f:
            lines = deque(f, maxlen=tail or None)
        out.raw("".join(lines))
    if store_error is not None:
        raise store_error


def _attempt_lines(run: str, record: dict[str, Any]) -> list[str]:
    """One line per attempt of the run, from its record in the store."""
    lines = []
    for a in record.get("attempts") or []:
        outcome = a.get("outcome") or "running or stopped"
        rejoins = f", {len(a['rejoins'])} rejoin(s)" if a.get("rejoins") else ""
        lines.append(f"run {run} attempt {a.get('attempt')}: nodes {', '.join(a.get('nodes') or [])}, "
                     f"resumed from step {a.get('resume_from', 0)}{rejoins}: {outcome}")
    return lines


def metrics(
    run: RunArg,
    cluster_opt: ClusterOpt = None,
    json_mode: JsonOpt = False,
) -> None:
    """Per-step records of a run: loss, validation loss, step time, tokens/s, world size (--json: all fields)."""
    out = output(json_mode)
    state, _ = resolve_cluster(cluster_opt)
    store = cluster.store_for(state)
    records = runstore.read_metrics(store, run)
    if not records and runstore.read_run_record(store, run) is None:
        raise UsageError(f"no run named {run!r} in the store {store.uri}", field="RUN")
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
