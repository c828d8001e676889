"""``infractl train``: launch (or resume) a run on every node and follow it; ``infractl rejoin``,
``infractl stop`` and ``infractl rollback``."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from infractl import launcher, runs, runstore
from infractl.cli._common import (
    ClusterOpt,
    JsonOpt,
    LogFormatOpt,
    NodeArg,
    RunArg,
    RunOpt,
    YesOpt,
    confirm,
    output,
)
from infractl.config import RunSpec, load_run
from infractl.errors import StateError, StoreError, TrainingError, UsageError
from infractl.output import Output
from infractl.runstore import Attempt
from infractl.statedir import resolve_cluster
from infractl.store import for_cluster

__all__ = ["register"]


def train(
    run_file: Annotated[Path, typer.Argument(help="run.yaml describing the model, data, steps and nodes.")],
    cluster_opt: ClusterOpt = None,
    new: Annotated[
        bool, typer.Option("--new", help="Delete the run's checkpoints and metrics and start over from step 0.")
    ] = False,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Return once the agents are started.")] = False,
    yes: YesOpt = False,
    json_mode: JsonOpt = False,
    log_format: LogFormatOpt = "console",
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
            out.success(
                f"run {spec.name!r} already completed (committed step {plan.resume_from} of {spec.steps}); "
                "use --new to start over"
            )
            out.result({"run_id": spec.name, "outcome": "completed", "last_committed_step": plan.resume_from})
            return
        started = launcher.launch(state, spec, plan, log_format=log_format)
    where = f"resuming from committed step {started.resume_from}" if started.resume_from else "starting at step 0"
    out.info(f"run {spec.name!r} attempt {started.attempt} on {len(started.nodes)} node(s), {where}")
    if detach:
        out.success(
            f"run {spec.name!r} started in the background; follow it with `infractl status` and `infractl logs`"
        )
        out.result(
            {
                "run_id": spec.name,
                "attempt": started.attempt,
                "resume_from": started.resume_from,
                "agents": {n: a.pid for n, a in started.agents.items()},
            }
        )
        return
    try:
        attempt = _follow(started, spec, plan, out)
    except KeyboardInterrupt:
        out.info(f"stopped following; run {spec.name!r} continues (`infractl status`, `infractl logs`)")
        raise typer.Exit(130) from None
    out.success(f"run {spec.name!r} completed: final checkpoint committed at step {attempt.last_committed_step}")
    out.result({"run_id": spec.name, **asdict(attempt)})


# Seconds between looks at the agents and the store while following a run in the foreground.
_POLL_S = 1.0


def _follow(started: launcher.Launch, spec: RunSpec, plan: launcher.LaunchPlan, out: Output) -> Attempt:
    """Show the run's progress from the store until every agent exits; record how the attempt
    ended; ``TrainingError`` unless it completed. Through a store outage the trainers go on, and
    so does following them (one warning)."""
    exit_codes: dict[str, int] = {}
    store_down = False
    with out.step_progress(spec.steps, description=spec.name) as bar:
        bar.update(started.resume_from, loss=None, tokens_per_s=None, world_size=None)
        while len(exit_codes) < len(started.agents):
            time.sleep(_POLL_S)
            for name, agent in started.agents.items():
                if name not in exit_codes and (rc := agent.poll()) is not None:
                    exit_codes[name] = rc
            try:
                latest = runstore.latest_metrics(plan.store, spec.name)
            except StoreError as exc:
                if not store_down:
                    out.warn(f"cannot follow the run's progress: {exc.message}; training goes on")
                store_down = True
                continue
            if store_down:
                out.info("the store is reachable again")
                store_down = False
            if latest and latest.get("attempt") == started.attempt:
                bar.update(
                    latest["step"],
                    loss=latest.get("loss"),
                    tokens_per_s=latest.get("tokens_per_s"),
                    world_size=latest.get("world_size"),
                )
    attempt = launcher.finish(plan, spec, started, exit_codes)
    if attempt.outcome != "completed":
        failed = sorted(n for n, rc in exit_codes.items() if rc != 0) or sorted(exit_codes)
        raise TrainingError(
            f"run {spec.name!r} stopped at committed step {attempt.last_committed_step} of {spec.steps} "
            f"(agent exit codes {exit_codes}); see `infractl logs --run {spec.name} --node {failed[0]}`"
        )
    return attempt


def rejoin(
    node: NodeArg,
    run: RunOpt = None,
    cluster_opt: ClusterOpt = None,
    json_mode: JsonOpt = False,
    log_format: LogFormatOpt = "console",
) -> None:
    """Start NODE's agent again for a running run that lost it; the run grows back at the next rendezvous."""
    out = output(json_mode)
    state, _ = resolve_cluster(cluster_opt)
    with state.lock("rejoin"):
        joined = launcher.rejoin(state, node, run=run, log_format=log_format)
    out.success(
        f"node {joined.node!r} is joining run {joined.run_id!r} (attempt {joined.attempt}; "
        f"rejoin {joined.rejoins} of at most {joined.budget}); the run restarts its workers on the larger world"
    )
    out.result(
        {
            "run_id": joined.run_id,
            "node": joined.node,
            "attempt": joined.attempt,
            "pid": joined.pid,
            "rejoins": joined.rejoins,
            "budget": joined.budget,
        }
    )


def stop(
    run: RunOpt = None,
    no_save: Annotated[
        bool,
        typer.Option("--no-save", help="Kill every process of the run now: the step it is on is not saved."),
    ] = False,
    cluster_opt: ClusterOpt = None,
    json_mode: JsonOpt = False,
) -> None:
    """Stop a running run on every node: its workers save the step they are on (as on a preemption notice) and exit."""
    out = output(json_mode)
    state, _ = resolve_cluster(cluster_opt)
    with state.lock("stop"):
        stopped = launcher.stop(state, run=run, save=not no_save)
    forced = ""
    if no_save:
        forced = f"; its {stopped.killed} process(es) killed, nothing saved"
    elif stopped.killed:
        forced = f"; {stopped.killed} process(es) outlived the grace period and were killed"
    out.success(
        f"run {stopped.run_id!r} stopped on {', '.join(stopped.nodes)} at committed step "
        f"{stopped.last_committed_step}{forced}; `infractl train` of its run.yaml resumes it"
    )
    out.result(asdict(stopped))


def rollback(
    run: RunArg,
    to: Annotated[int, typer.Option("--to", help="The committed step the run goes back to.", min=0)],
    cluster_opt: ClusterOpt = None,
    yes: YesOpt = False,
    json_mode: JsonOpt = False,
) -> None:
    """Roll RUN back to an earlier committed step: every newer step is moved aside in the store, kept, not deleted."""
    out = output(json_mode)
    state, _ = resolve_cluster(cluster_opt)
    store = for_cluster(state)
    with state.lock("rollback"):
        if run in runs.running(state):
            raise StateError(f"run {run!r} is running: stop it first (`infractl stop --run {run}`)", field="RUN")
        committed = runstore.committed_steps(store, run)
        if to not in committed:
            listed = ", ".join(map(str, committed)) or "none"
            raise UsageError(f"step {to} is not a committed step of run {run!r} (committed: {listed})", field="--to")
        newer = [step for step in committed if step > to]
        confirm(f"Move step(s) {', '.join(map(str, newer)) or 'none'} of run {run!r} aside?", yes=yes)
        moved, aside = runstore.set_aside(store, run, to)
    out.success(
        f"run {run!r} rolled back to step {to}: step(s) {', '.join(map(str, moved)) or 'none'} moved to "
        f"{store.location(aside)}; `infractl train` of its run.yaml resumes it from step {to}"
    )
    out.result({"run_id": run, "to": to, "moved": moved, "aside": store.location(aside)})


def register(app: typer.Typer) -> None:
    app.command()(train)
    app.command()(rejoin)
    app.command()(stop)
    app.command()(rollback)
