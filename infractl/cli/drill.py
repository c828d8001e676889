"""``infractl drill KIND``: inject a fault into a running job and measure its recovery."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Annotated, Any, Literal

import typer

from infractl import drill as drills
from infractl import runstore
from infractl.cli._common import ClusterOpt, JsonOpt, RunOpt, finite_option, name_option, output
from infractl.output import Output
from infractl.runstore import ChaosRecord, DrillRecord
from infractl.statedir import resolve_cluster
from infractl.store import for_cluster

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
RepeatOpt = Annotated[
    int,
    typer.Option(
        "--repeat",
        help="Run N drills in a row on the same run (a node the fault removed rejoins in between); "
        "prints the success count, the median and worst restart_s and the median of each of its phases.",
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
                + (f"; median phases: {_phases(summary['median_phases'])}" if summary["median_phases"] else "")
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
        + (f", {r.outcome_note}" if r.outcome_note else "")
        + (f"\n  restart phases: {_phases(r.phases)}" if r.phases else "")
    )


def _phases(phases: dict[str, float | None]) -> str:
    return ", ".join(f"{name} {_s(seconds)}" for name, seconds in phases.items())


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _kind_option(option: drills.KindOption) -> Any:
    """The Typer annotation of a kind's own option."""
    if option.choices:
        return Annotated[Literal[option.choices], typer.Option(option.flag, help=option.help)]
    kind = int if isinstance(option.default, int) else str
    return Annotated[kind, typer.Option(option.flag, help=option.help, min=option.minimum, max=option.maximum)]


def _command(kind: type[drills.Kind]) -> Callable[..., None]:
    """The command of one kind: --node for a fault of a node, --seconds for a timed one, the
    kind's own options, then every drill's."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("node", keyword, default=None, annotation=NodeOpt)] if kind.targets_node else []
    if kind.timed:
        params.append(inspect.Parameter("seconds", keyword, default=kind.seconds, annotation=SecondsOpt))
    own = [option.name for option in kind.options]
    params += [inspect.Parameter(o.name, keyword, default=o.default, annotation=_kind_option(o)) for o in kind.options]
    params += [
        inspect.Parameter("run", keyword, default=None, annotation=RunOpt),
        inspect.Parameter("cluster_opt", keyword, default=None, annotation=ClusterOpt),
        inspect.Parameter("timeout", keyword, default=600.0, annotation=TimeoutOpt),
        inspect.Parameter("repeat", keyword, default=1, annotation=RepeatOpt),
        inspect.Parameter("wait", keyword, default=True, annotation=WaitOpt),
        inspect.Parameter("json_mode", keyword, default=False, annotation=JsonOpt),
    ]

    def command(**values: Any) -> None:
        json_mode, cluster_opt, repeat = values.pop("json_mode"), values.pop("cluster_opt"), values.pop("repeat")
        options = {name: values.pop(name) for name in own}
        wait = values.pop("wait")
        _drill(
            kind.name, output(json_mode), json_mode, cluster_opt, repeat, wait_finish=wait, options=options, **values
        )

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # what Typer reads
    measured = "detection, restart, " + ("rejoin, " if kind.rejoins else "") + "lost work and completion"
    command.__doc__ = kind.help + (f" Then measure {measured}." if kind.targets_node else "")
    return command


for _kind in drills.KINDS.values():
    app.command(_kind.name)(_command(_kind))


@app.command("chaos")
def chaos_command(
    count: Annotated[int, typer.Option("--count", help="Faults in the series.", min=1, max=1000)] = 10,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of the series: the same seed strikes the same series.", min=0)
    ] = 0,
    kinds: Annotated[
        list[str] | None,
        typer.Option(
            "--kinds", help="Kinds to draw from, comma-separated or repeated. Default: every kind the run can take."
        ),
    ] = None,
    min_gap: Annotated[
        float,
        typer.Option(
            "--min-gap",
            help="Least seconds between the run being whole again and the next fault (at most twice this).",
            min=0,
            max=3600,
            callback=finite_option,
        ),
    ] = 5.0,
    reference: Annotated[
        str | None,
        typer.Option(
            "--reference",
            callback=name_option,
            help="A finished uninterrupted run of the same spec (its pace, min_step_s, aside) to compare with. "
            "Default: <run>-reference, trained after the series without the pace unless the store has it.",
        ),
    ] = None,
    plan_only: Annotated[bool, typer.Option("--plan", help="Print the drawn series and strike nothing.")] = False,
    run: RunOpt = None,
    cluster_opt: ClusterOpt = None,
    timeout: TimeoutOpt = 600.0,
    json_mode: JsonOpt = False,
) -> None:
    """A seeded series of random faults (kind, node, moment) against a running run; each is
    recovered from before the next. Then the finished run's losses and weights are compared with
    an uninterrupted reference run: bitwise while the world size never changed, within 1e-5 after."""
    from infractl.drill import chaos

    out = output(json_mode)
    state, _ = resolve_cluster(cluster_opt)
    names = [k.strip() for value in kinds or [] for k in value.split(",") if k.strip()]
    plan = chaos.plan_chaos(
        state, count=count, seed=seed, kinds=names or None, min_gap=min_gap, run=run, reference=reference
    )
    if plan_only:
        faults = [dataclasses.asdict(f) for f in plan.faults]
        data = {"run": plan.run_id, "seed": seed, "kinds": plan.kinds, "nodes": plan.nodes, "plan": faults}
        out.result(data, "\n".join(f"{f.index:>3}  {f.describe()}" for f in plan.faults))
        return
    for fault in plan.faults:
        out.info(f"chaos seed {seed}, fault {fault.index}: {fault.describe()}")
    record = chaos.run_chaos(state, plan, timeout=timeout, progress=out.info)
    _report_chaos(out, record, runstore.read_drill_records(for_cluster(state), record.run_id))
    if not record.passed:
        raise typer.Exit(1)


def _report_chaos(out: Output, record: ChaosRecord, drills: list[DrillRecord]) -> None:
    """The series' result: its record and drills as JSON, else a line per drill and the summary."""
    by_id = {d.drill_id: d for d in drills}
    drilled = [by_id[i] for i in record.drill_ids if i in by_id]
    if out.json_mode:
        out.result(record.to_dict() | {"results": [d.to_dict() for d in drilled]})
        return
    for result in drilled:
        out.info(_line(result))
    (out.success if record.passed else out.warn)(_chaos_line(record))


def _chaos_line(r: ChaosRecord) -> str:
    line = (
        f"chaos {r.series_id} on run {r.run_id!r}: {r.recovered}/{r.count} faults recovered; restart_s median "
        f"{_s(r.median_restart_s)}, worst {_s(r.worst_restart_s)}; {r.lost_steps} step(s) lost"
    )
    if r.stopped is not None:
        return f"{line}; stopped: {r.stopped}"
    c = r.comparison or {}
    exact = f"{c['bitwise_steps']} of {c['steps']} steps bitwise"
    weights = "weights bitwise" if c["weights_bitwise"] else f"weights within {c['weights_rel_diff']:.1e}"
    verdict = "matches" if c["matches"] else "does NOT match"
    return (
        f"{line}; {verdict} reference run {c['reference']!r}: {exact}, largest loss difference "
        f"{c['max_loss_rel_diff']:.1e}, {weights}"
    )


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="drill")
