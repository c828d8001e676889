"""``infractl bench``: how a run scales over the cluster's nodes and where its step time goes,
measured through the normal launcher and written to the store as the baseline."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from infractl import runs, runstore
from infractl.cli._common import ClusterOpt, JsonOpt, output
from infractl.config import MAX_PROFILE_STEPS, load_run
from infractl.errors import StateError
from infractl.scaling import bench, report
from infractl.statedir import ClusterState, resolve_cluster
from infractl.store import for_cluster

__all__ = ["register"]


_ProfileOpt = Annotated[
    int,
    typer.Option(
        "--profile",
        help="At each count, trace this many more steps after the measured ones with torch.profiler on every "
        "rank (see `infractl profile`); they are left out of the figures.",
        min=0,
        max=MAX_PROFILE_STEPS,
    ),
]


def bench_command(
    run_file: Annotated[Path, typer.Argument(help="run.yaml whose model to measure.", metavar="RUN.yaml")],
    nodes: Annotated[
        str,
        typer.Option("--nodes", help="Node counts to measure, separated by commas (e.g. 1,2).", show_default=False),
    ],
    cluster_opt: ClusterOpt = None,
    steps: Annotated[
        int,
        typer.Option(
            "--steps",
            help=f"Steps per count; the first {bench.WARMUP_STEPS} are warm-up, left out of every figure.",
            min=bench.MIN_STEPS,
            max=10**6,
        ),
    ] = bench.DEFAULT_STEPS,
    strong: Annotated[
        bool, typer.Option("--strong", help="Keep the run.yaml's global batch at every count (strong scaling).")
    ] = False,
    profile: _ProfileOpt = 0,
    json_mode: JsonOpt = False,
) -> None:
    """Train RUN.yaml's model at each node count (weak scaling: the same per-rank batch, the
    run.yaml's batch_size split over nodes.max; --strong: the same global batch) and measure
    median step time, tokens/s, speedup, scaling efficiency, the step-time split and the ranks'
    CPU utilization. Writes bench/<id>/baseline.json and two PNG plots to the cluster's store."""
    out = output(json_mode)
    counts = bench.parse_counts(nodes)
    spec = load_run(run_file)
    state, _ = resolve_cluster(cluster_opt)
    cluster_nodes = state.record().nodes
    bench.check_counts(counts, cluster=state.name, cluster_nodes=len(cluster_nodes))
    planned = bench.plan_bench(
        spec,
        run_file,
        counts=counts,
        steps=steps,
        strong=strong,
        processes=cluster_nodes[0].processes,
        profile_steps=profile,
    )
    _check_idle(state)
    store = for_cluster(state)
    store.ping()  # an unreachable store fails here, before any count runs
    started, bench_id = time.time(), bench.new_bench_id()
    measured = bench.run_trials(state, planned, progress=out.info)
    baseline = bench.figures(planned, measured, cluster=state.name, bench_id=bench_id, started=started)
    keys = report.write_baseline(store, baseline)
    out.result(baseline | {"store": store.uri, "written": keys}, Group(*_tables(baseline), _notes(baseline)))
    out.success(
        f"baseline written to {store.uri}/{runstore.bench_prefix(bench_id)}/: baseline.json, throughput.png, split.png"
    )


def _check_idle(state: ClusterState) -> None:
    """A bench measures the cluster alone: a run training beside it would share its CPUs."""
    live = runs.running(state)
    if live:
        names = ", ".join(sorted(live))
        raise StateError(
            f"run(s) {names} running on cluster {state.name!r}; a bench needs the cluster idle "
            "(wait for them, or stop them)"
        )


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


#: The split's parts as the table heads them (the notes spell them out).
_HEADS = {
    "data_wait": "data",
    "compute": "compute",
    "exposed_comm": "comm",
    "optimizer": "optim",
    "checkpoint_blocking": "ckpt",
    "between_steps": "between",
}


def _table(title: str, heads: list[str]) -> Table:
    """A table of figures whose heads put one word on a line (it fits 80 columns)."""
    table = Table(title=title)
    for head in heads:
        table.add_column(head.replace(" ", "\n"), justify="right")
    return table


def _tables(baseline: dict[str, Any]) -> list[Table]:
    results = baseline["results"]
    gpu = any(r["gpu_utilization"] is not None for r in results)
    heads = ["nodes", "ranks", "global batch", "median step", "tokens/s", "speedup", "efficiency", "CPU util"]
    scaling = _table(f"{baseline['run']}: {baseline['scaling']} scaling", [*heads, "GPU util"] if gpu else heads)
    for r in results:
        row = [
            str(r["nodes"]),
            str(r["ranks"]),
            str(r["global_batch"]),
            f"{1000 * r['median_step_time_s']:.1f} ms",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['speedup']:.2f}x",
            _percent(r["efficiency"]),
            _percent(r["cpu_utilization"]),
        ]
        scaling.add_row(*row, *([_percent(r["gpu_utilization"])] if gpu else []))
    split = _table("where the wall time of a step goes", ["nodes", *_HEADS.values()])
    split.add_column("dominant idle cause")
    for r in results:
        shares = (_percent(r["shares"][part]) for part in _HEADS)
        split.add_row(str(r["nodes"]), *shares, bench.SHARES[r["dominant_idle_cause"]])
    return [scaling, split]


def _notes(baseline: dict[str, Any]) -> Text:
    largest, below = baseline["counts"][-1], baseline["efficiency_below_80_at"]
    efficiency = (
        f"efficiency drops below 80% at {below} nodes"
        if below is not None
        else f"efficiency stays at or above 80% up to {largest} nodes"
    )
    lines = [
        f"{efficiency}; the dominant idle cause at {largest} nodes: {bench.SHARES[baseline['dominant_idle_cause']]}",
        baseline["batch_rule"],
        f"{baseline['steps']} steps per count, the first {baseline['warmup_steps']} left out (warm-up); "
        "tokens/s = global batch x seq_len / median step time",
        "data: data wait; comm: exposed communication (gradient all-reduce and the log steps' loss read-back, "
        "waiting for the slowest rank included); optim: optimizer step; ckpt: checkpoint blocking; "
        "between: between steps (metrics to the store, evaluation)",
        f"comm is {baseline['exposed_comm_measure']}",
        "CPU util: CPU seconds of the ranks' processes per rank per wall second of the measured steps; "
        f"GPU util: {baseline['gpu_utilization_source']}",
    ]
    lines += [
        f"{r['nodes']} node(s): traces in {r['profile_traces']}/ (`infractl profile {r['run_id']}` lists them)"
        for r in baseline["results"]
        if r["profile_traces"]
    ]
    return Text("\n".join(lines))


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_command)
