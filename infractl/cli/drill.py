"""``infractl drill KIND``: inject a fault into a running job and measure its recovery."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer

from infractl import drill as drills
from infractl.cli._common import ClusterOpt, JsonOpt, RunOpt, finite_option, name_option, output
from infractl.output import Output
from infractl.providers import netns
from infractl.runstore import DrillRecord
from infractl.state import resolve_cluster

__all__ = ["register"]

app = typer.Typer(
    help="Fault drills against a running job (started with `infractl train ... --detach`).", no_args_is_help=True
)

NodeOpt = Annotated[
    str | None,
    typer.Option("--node", "-n", help="Node to fault. Default: the last node running the run.", callback=name_option),
]
TimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout",
        help="Seconds to wait for each drill's recovery (and the run's end).",
        min=1,
        max=7 * 86400,
        callback=finite_option,
    ),
]
SecondsOpt = Annotated[
    float, typer.Option("--seconds", help="How long the fault lasts.", min=1, max=86400, callback=finite_option)
]
WaitOpt = Annotated[
    bool,
    typer.Option(
        "--wait/--no-wait", help="Wait for the run to finish after the (last) drill recovered, or stop watching then."
    ),
]
LinkOpt = Annotated[
    netns.LinkFault,
    typer.Option(
        "--kind",
        help="down: the node's interface goes down; drop: its packets vanish silently; delay: netem adds --latency-ms.",
    ),
]
LatencyOpt = Annotated[
    int, typer.Option("--latency-ms", help="Latency --kind delay adds to the node's packets.", min=1, max=60_000)
]
RepeatOpt = Annotated[
    int,
    typer.Option(
        "--repeat",
        help="Run N drills in a row on the same run (a node the fault removed rejoins in between); "
        "prints the success count and the median and worst restart_s.",
        min=1,
        max=100,
    ),
]


def _drill(kind: str, out: Output, json_mode: bool, cluster_opt: str | None, repeat: int, **kwargs: Any) -> None:
    state, _ = resolve_cluster(cluster_opt)
    if repeat == 1:
        record = drills.run_drill(state, kind, progress=out.info, **kwargs)
        ok = record.outcome == "recovered"
        if json_mode:
            out.result(record.to_dict())
        else:
            (out.success if ok else out.warn)(_line(record))
    else:
        series = drills.run_series(state, kind, repeat, progress=out.info, **kwargs)
        summary = series.summary()
        ok = summary["succeeded"] == repeat
        if json_mode:
            out.result(summary | {"results": [r.to_dict() for r in series.results]})
        else:
            for record in series.results:
                out.info(_line(record))
            (out.success if ok else out.warn)(
                f"{summary['succeeded']}/{repeat} {kind} drills recovered; restart_s median "
                f"{_s(summary['median_restart_s'])}, worst {_s(summary['worst_restart_s'])}"
            )
    if not ok:
        raise typer.Exit(1)


def _line(r: DrillRecord) -> str:
    where = f" {r.node}" if r.node else ""
    extra = ""
    if r.emergency_checkpoint_step is not None:
        extra = f"; emergency checkpoint of step {r.emergency_checkpoint_step} after {_s(r.emergency_checkpoint_s)}"
    if r.rejoin_s is not None:
        extra += f"; rejoined after {_s(r.rejoin_s)}"
    return (
        f"drill {r.drill_id}: {r.drill}{where} of run {r.run_id!r} at step {r.step_at_fault} "
        f"(committed {r.last_committed_step}); detect {_s(r.detect_s)}, restart {_s(r.restart_s)}, "
        f"{drills.kind_named(r.drill).describe(r)}{extra}; final step {r.final_step}/{r.steps} "
        f"{'committed' if r.final_committed else 'not committed'}: {r.outcome}"
    )


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _node_command(kind: type[drills.Kind]) -> Callable[..., None]:
    def command(
        node: NodeOpt = None,
        run: RunOpt = None,
        cluster_opt: ClusterOpt = None,
        timeout: TimeoutOpt = 600.0,
        repeat: RepeatOpt = 1,
        wait: WaitOpt = True,
        json_mode: JsonOpt = False,
    ) -> None:
        _drill(
            kind.name,
            output(json_mode),
            json_mode,
            cluster_opt,
            repeat,
            node=node,
            run=run,
            timeout=timeout,
            wait_finish=wait,
        )

    command.__doc__ = kind.help + " Then measure detection, restart, lost work and completion."
    return command


def _timed_command(kind: type[drills.Kind]) -> Callable[..., None]:
    """A fault of the whole job, not of a node (the store), that lasts --seconds."""

    def command(
        seconds: SecondsOpt = 10.0,
        run: RunOpt = None,
        cluster_opt: ClusterOpt = None,
        timeout: TimeoutOpt = 600.0,
        repeat: RepeatOpt = 1,
        wait: WaitOpt = True,
        json_mode: JsonOpt = False,
    ) -> None:
        _drill(
            kind.name,
            output(json_mode),
            json_mode,
            cluster_opt,
            repeat,
            run=run,
            seconds=seconds,
            timeout=timeout,
            wait_finish=wait,
        )

    command.__doc__ = kind.help
    return command


def _link_command(kind: type[drills.Kind]) -> Callable[..., None]:
    """A fault of a node's network link that lasts --seconds."""

    def command(
        node: NodeOpt = None,
        seconds: SecondsOpt = 30.0,
        link: LinkOpt = "down",
        latency_ms: LatencyOpt = 500,
        run: RunOpt = None,
        cluster_opt: ClusterOpt = None,
        timeout: TimeoutOpt = 600.0,
        repeat: RepeatOpt = 1,
        wait: WaitOpt = True,
        json_mode: JsonOpt = False,
    ) -> None:
        _drill(
            kind.name,
            output(json_mode),
            json_mode,
            cluster_opt,
            repeat,
            node=node,
            run=run,
            seconds=seconds,
            timeout=timeout,
            wait_finish=wait,
            options={"link": link, "latency_ms": latency_ms},
        )

    command.__doc__ = kind.help + " Then measure detection, restart, rejoin, lost work and completion."
    return command


for _kind in drills.KINDS.values():
    if _kind.targets_node and _kind.timed:
        app.command(_kind.name)(_link_command(_kind))
    else:
        app.command(_kind.name)((_node_command if _kind.targets_node else _timed_command)(_kind))


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="drill")
