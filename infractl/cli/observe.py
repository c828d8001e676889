"""Read-only commands: ``logs`` and ``metrics`` (they read the store and node logs, never the trainers)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from infractl import providers, runs, runstore, workdir
from infractl.cli._common import ClusterOpt, JsonOpt, RunArg, RunOpt, name_option, output
from infractl.errors import InfractlError, StoreError, UsageError
from infractl.runstore import RunRecord
from infractl.statedir import resolve_cluster
from infractl.store import for_cluster

__all__ = ["register"]


def logs(
    cluster_opt: ClusterOpt = None,
    node: Annotated[
        str | None, typer.Option("--node", "-n", help="Only this node (e.g. node-1).", callback=name_option)
    ] = None,
    run: RunOpt = None,
    tail: Annotated[int, typer.Option("--tail", help="Lines per node (0 = all).", min=0, max=10**9)] = 200,
) -> None:
    """Print the run's attempts from the store, then the training logs of every node (or one).

    The logs live on the nodes: with the store unreachable they are still printed (name the run
    with --run), and the command then exits 1 naming the store.
    """
    out = output()
    state, _ = resolve_cluster(cluster_opt)
    nodes = state.record().nodes if node is None else (runs.node(state, node, field="--node"),)
    store = for_cluster(state)
    if run is None:
        run = runs.latest_run(state, store)
    store_error: StoreError | None = None
    try:
        record = runstore.read_run_record(store, run)
    except StoreError as exc:
        store_error, record = exc, None
    else:
        if record is None or record.cluster != state.name:
            raise UsageError(f"no run {run!r} has been launched on cluster {state.name!r}", field="--run")
        out.raw("".join(f"{line}\n" for line in _attempt_lines(record)))
    control = providers.control(state)
    for n in nodes:
        path = workdir.run_log(n.workdir, run)
        out.raw(f"==> {n.name} · run {run} · {path}\n")
        try:
            lines = control.tail(n.name, path, lines=tail)
        except InfractlError as exc:
            out.raw(f"(cannot read it: {exc.message})\n")
            continue
        out.raw("(no log yet)\n" if lines is None else "".join(lines))
    if store_error is not None:
        raise store_error


def _attempt_lines(record: RunRecord) -> list[str]:
    """One line per attempt of the run, from its record in the store."""
    lines = []
    for a in record.attempts:
        rejoins = f", {len(a.rejoins)} rejoin(s)" if a.rejoins else ""
        lines.append(
            f"run {record.run_id} attempt {a.attempt}: nodes {', '.join(a.nodes)}, "
            f"resumed from step {a.resume_from}{rejoins}: {a.outcome or 'running or stopped'}"
        )
    return lines


def metrics(
    run: RunArg,
    cluster_opt: ClusterOpt = None,
    json_mode: JsonOpt = False,
) -> None:
    """Per-step records of a run: loss, validation loss, step time, tokens/s, world size (--json: all fields)."""
    out = output(json_mode)
    state, _ = resolve_cluster(cluster_opt)
    store = for_cluster(state)
    records = runstore.read_metrics(store, run)
    if not records and runstore.read_run_record(store, run) is None:
        raise UsageError(f"no run named {run!r} in the store {store.uri}", field="RUN")
    table = Table(title=f"run {run}")
    for col in ("step", "loss", "val loss", "step time (s)", "tokens/s", "world", "attempt"):
        table.add_column(col, justify="right")
    for r in records:
        val = f"{r['val_loss']:.4f}" if "val_loss" in r else ""
        table.add_row(
            str(r["step"]),
            f"{r['loss']:.4f}",
            val,
            f"{r['step_time_s']:.3f}",
            f"{r['tokens_per_s']:,.0f}",
            str(r.get("world_size", "-")),
            str(r.get("attempt", "-")),
        )
    out.result(records, table)


def register(app: typer.Typer) -> None:
    app.command()(logs)
    app.command()(metrics)
