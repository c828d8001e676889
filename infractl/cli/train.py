"""``infractl train``: launch (or resume) a run on every node."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from infractl import launcher, runstore
from infractl.cli._common import ClusterOpt, JsonOpt, NodeArg, YesOpt, confirm, name_option, output
from infractl.config import load_run
from infractl.log import LogFormat
from infractl.state import resolve_cluster

__all__ = ["register"]


def train(
    run_file: Annotated[Path, typer.Argument(help="run.yaml describing the model, data, steps and nodes.")],
    cluster_opt: ClusterOpt = None,
    new: Annotated[bool, typer.Option("--new", help="Delete the run's checkpoints and metrics and start over from step 0.")] = False,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Return once the agents are started.")] = False,
    yes: YesOpt = False,
    json_mode: JsonOpt = False,
    log_format: Annotated[LogFormat, typer.Option("--log-format", help="Trainer log lines: console or json.")] = "console",
) -> None:
    """Train RUN_FILE on every node; re-running the same run resumes from its last committed checkpoint."""
    out = output(json_mode)
    spec = load_run(run_file)
    state, _ = resolve_cluster(cluster_opt)
    with state.lock("train"):
        plan = launcher.prepare(state, spec, run_file, new=new)
        if plan.replaces:
            confirm(f"Delete the checkpoints and metrics of run {spec.name!r} and start over?", yes=yes)
            plan.store.delete_prefix(runstore.run_prefix(spec.name))
        if plan.complete:
            out.success(f"run {spec.name!r} already completed (committed step {plan.resume_from} of {spec.steps}); "
                        "use --new to start over")
            out.result({"run_id": spec.name, "outcome": "completed", "last_committed_step": plan.resume_from})
            return
        started = launcher.launch(state, spec, plan, log_format=log_format)
    where = f"resuming from committed step {started.resume_from}" if started.resume_from else "starting at step 0"
    out.info(f"run {spec.name!r} attempt {started.attempt} on {len(started.nodes)} node(s), {where}")
    if detach:
        out.success(f"run {spec.name!r} started in the background; follow it with `infractl status` and `infractl logs`")
        out.result({"run_id": spec.name, "attempt": started.attempt, "resume_from": started.resume_from,
                    "agents": {n: a.pid for n, a in started.agents.items()}})
        return
    try:
        attempt = launcher.watch(started, spec, plan, out)
    except KeyboardInterrupt:
        out.info(f"stopped following; run {spec.name!r} continues (`infractl status`, `infractl logs`)")
        raise typer.Exit(130) from None
    out.success(f"run {spec.name!r} completed: final checkpoint committed at step {attempt['last_committed_step']}")
    out.result({"run_id": spec.name, **attempt})


def rejoin(
    node: NodeArg,
    run: Annotated[Optional[str], typer.Option(
        "--run", "-r", help="Run to rejoin. Default: the run running on the cluster.", callback=name_option)] = None,
    cluster_opt: ClusterOpt = None,
    json_mode: JsonOpt = False,
    log_format: Annotated[LogFormat, typer.Option("--log-format", help="Trainer log lines: console or json.")] = "console",
) -> None:
    """Start NODE's agent again for a running run that lost it; the run grows back at the next rendezvous."""
    out = output(json_mode)
    state, _ = resolve_cluster(cluster_opt)
    with state.lock("rejoin"):
        joined = launcher.rejoin(state, node, run=run, log_format=log_format)
    out.success(f"node {joined.node!r} is joining run {joined.run_id!r} (attempt {joined.attempt}; "
                f"rejoin {joined.rejoins} of at most {joined.budget}); the run restarts its workers on the larger world")
    out.result({"run_id": joined.run_id, "node": joined.node, "attempt": joined.attempt, "pid": joined.pid,
                "rejoins": joined.rejoins, "budget": joined.budget})


def register(app: typer.Typer) -> None:
    app.command()(train)
    app.command()(rejoin)
