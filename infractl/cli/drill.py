"""``infractl drill KIND``: inject a fault into a running job and measure its recovery."""

from __future__ import annotations

from typing import Annotated, Any, Callable, Optional

import typer

from infractl import drill as drills
from infractl.cli._common import ClusterOpt, JsonOpt, finite_option, name_option, output
from infractl.output import Output
from infractl.state import resolve_cluster

__all__ = ["register"]

app = typer.Typer(help="Fault drills against a running job (started with `infractl train ... --detach`).",
                  no_args_is_help=True)

NodeOpt = Annotated[Optional[str], typer.Option(
    "--node", "-n", help="Node to fault. Default: the last node running the run.", callback=name_option)]
RunOpt = Annotated[Optional[str], typer.Option(
    "--run", "-r", help="Run to drill. Default: the run running on the cluster.", callback=name_option)]
TimeoutOpt = Annotated[float, typer.Option(
    "--timeout", help="Seconds to wait for each drill's recovery (and the run's end).", min=1, max=7 * 86400,
    callback=finite_option)]
WaitOpt = Annotated[bool, typer.Option(
    "--wait/--no-wait", help="Wait for the run to finish after the (last) drill recovered, or stop watching then.")]
RepeatOpt = Annotated[int, typer.Option(
    "--repeat", help="Run N drills in a row on the same run (a node the fault removed rejoins in between); "
                     "prints the success count and the median and worst restart_s.", min=1, max=100)]

_HELP = {
    "kill-node": "SIGKILL every process of one node (agent and workers).",
    "kill-during-checkpoint": "Wait until a checkpoint is uploading, then kill one node: the partial step must never be loaded.",
    "hang-node": "SIGSTOP one node's workers: the watchdog (watchdog.step_timeout_s) must turn the hang into a failure.",
    "preempt": "SIGTERM one node's agent: an emergency checkpoint must commit within preemption.grace_s.",
}


def _drill(kind: str, out: Output, json_mode: bool, cluster_opt: str | None, repeat: int, **kwargs: Any) -> None:
    state, _ = resolve_cluster(cluster_opt)
    if repeat == 1:
        result = drills.run_drill(state, kind, progress=out.info, **kwargs)
        ok = result.outcome == "recovered"
        if json_mode:
            out.result(result.to_dict())
        else:
            (out.success if ok else out.warn)(_line(result))
    else:
        series = drills.run_series(state, kind, repeat, progress=out.info, **kwargs)
        summary = series.summary()
        ok = summary["succeeded"] == repeat
        if json_mode:
            out.result(summary | {"results": [r.to_dict() for r in series.results]})
        else:
            for result in series.results:
                out.info(_line(result))
            (out.success if ok else out.warn)(
                f"{summary['succeeded']}/{repeat} {kind} drills recovered; restart_s median "
                f"{_s(summary['median_restart_s'])}, worst {_s(summary['worst_restart_s'])}")
    if not ok:
        raise typer.Exit(1)


def _line(r: drills.DrillResult) -> str:
    where = f" {r.node}" if r.node else ""
    resumed = (f"resumed from step {r.resumed_from_step} (last committed {r.expected_resume_step}) "
               f"on world size {r.world_size_after}, lost {r.lost_work_steps} step(s)")
    if r.drill == "store-outage":
        resumed = f"store down {r.fault.get('seconds')}s, first commit after it at {_s(r.restart_s)}"
    extra = ""
    if r.emergency_checkpoint_step is not None:
        extra = f"; emergency checkpoint of step {r.emergency_checkpoint_step} after {_s(r.emergency_checkpoint_s)}"
    if r.rejoin_s is not None:
        extra += f"; rejoined after {_s(r.rejoin_s)}"
    return (f"drill {r.drill_id}: {r.drill}{where} of run {r.run_id!r} at step {r.step_at_fault} "
            f"(committed {r.last_committed_step}); detect {_s(r.detect_s)}, restart {_s(r.restart_s)}, "
            f"{resumed}{extra}; final step {r.final_step}/{r.steps} "
            f"{'committed' if r.final_committed else 'not committed'}: {r.outcome}")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _node_command(kind: str) -> Callable[..., None]:
    def command(
        node: NodeOpt = None,
        run: RunOpt = None,
        cluster_opt: ClusterOpt = None,
        timeout: TimeoutOpt = 600.0,
        repeat: RepeatOpt = 1,
        wait: WaitOpt = True,
        json_mode: JsonOpt = False,
    ) -> None:
        _drill(kind, output(json_mode), json_mode, cluster_opt, repeat, node=node, run=run, timeout=timeout,
               wait_finish=wait)

    command.__doc__ = _HELP[kind] + " Then measure detection, restart, lost work and completion."
    return command


@app.command("store-outage")
def store_outage(
    seconds: Annotated[float, typer.Option(
        "--seconds", help="How long the store refuses every call.", min=1, max=86400, callback=finite_option)] = 10.0,
    run: RunOpt = None,
    cluster_opt: ClusterOpt = None,
    timeout: TimeoutOpt = 600.0,
    repeat: RepeatOpt = 1,
    wait: WaitOpt = True,
    json_mode: JsonOpt = False,
) -> None:
    """Make the store refuse every call for --seconds (a file:// store's directory moves away; an S3 endpoint
    on this machine is paused): training must go on and commit again once the store is back."""
    _drill("store-outage", output(json_mode), json_mode, cluster_opt, repeat, run=run, seconds=seconds,
           timeout=timeout, wait_finish=wait)


for _kind in _HELP:
    app.command(_kind)(_node_command(_kind))


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="drill")
