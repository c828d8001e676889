"""``infractl plan``: the memory a run needs per device, and the fewest devices each way of
training it fits on, before anyone rents hardware."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from infractl import runstore
from infractl.cli._common import ClusterOpt, JsonOpt, LogFormatOpt, output
from infractl.config import RunSpec, load_run
from infractl.config.loader import rewrite, validate
from infractl.errors import ConfigError, UsageError
from infractl.log import LogFormat
from infractl.output import Output
from infractl.planning import accuracy, memory
from infractl.planning.devices import CATALOG, device, shared_cpu
from infractl.planning.plan import (
    Plan,
    accumulating,
    best_accumulating,
    format_bytes,
    plan,
    run_budget,
    way_label,
)
from infractl.statedir import resolve_cluster

__all__ = ["register"]


_MeasureOpt = Annotated[
    bool,
    typer.Option(
        "--measure",
        help="Run a few real steps on the cluster and print the memory each component took beside the prediction.",
    ),
]
_ApplyOpt = Annotated[
    bool,
    typer.Option(
        "--apply",
        help="Write the settings of the first way that fits the run's nodes.min nodes (parallel, "
        "activation_checkpointing, mixed_precision, and micro_batch where it must accumulate gradients) into "
        "RUN.yaml; its other lines and comments stay.",
    ),
]


def plan_command(
    run_file: Annotated[Path, typer.Argument(help="run.yaml to size.", metavar="RUN.yaml")],
    device_name: Annotated[
        str | None,
        typer.Option("--device", help=f"Device to size for: cpu (this machine), {', '.join(CATALOG)}. [default: cpu]"),
    ] = None,
    gpus_per_node: Annotated[
        int,
        typer.Option("--gpus-per-node", help="Devices (ranks) per node; on cpu they share its memory.", min=1, max=64),
    ] = 1,
    max_nodes: Annotated[int, typer.Option("--max-nodes", help="Most nodes to consider.", min=1, max=1024)] = 8,
    explain: Annotated[bool, typer.Option("--explain", help="Print every number with its formula and inputs.")] = False,
    measure_run: _MeasureOpt = False,
    steps: Annotated[
        int | None, typer.Option("--steps", help="Steps the --measure run takes [default: 3].", min=1, max=100)
    ] = None,
    apply: _ApplyOpt = False,
    cluster_opt: ClusterOpt = None,
    json_mode: JsonOpt = False,
    log_format: LogFormatOpt = "console",
) -> None:
    """Size RUN.yaml: bytes per device by component for ddp, zero1, zero2 and fsdp (with and without
    activation checkpointing, fp32 and bf16) and for tensor and pipeline parallel degrees, the
    fewest devices and nodes each fits on, and the way to train it with its run.yaml settings
    (--apply writes them into RUN.yaml). Exit 2 when it fits nowhere within --max-nodes. With
    --measure, check the prediction against a short real run of RUN.yaml on the cluster."""
    out = output(json_mode)
    spec = load_run(run_file)
    if measure_run:
        if apply:
            raise UsageError("only without --measure (measuring changes no setting)", field="--apply")
        if device_name is not None:
            raise UsageError("--measure measures the cluster's own devices; leave --device out", field="--device")
        _measure(spec, run_file, steps=steps or 3, cluster_opt=cluster_opt, log_format=log_format, out=out)
        return
    for given, name in ((steps, "--steps"), (cluster_opt, "--cluster")):
        if given is not None:
            raise UsageError("only with --measure (planning alone starts nothing)", field=name)
    name = device_name or "cpu"
    chosen = shared_cpu(gpus_per_node, os.environ) if name == "cpu" else device(name)
    result = plan(spec, chosen, devices_per_node=gpus_per_node, max_nodes=max_nodes)
    if result.recommended is None:
        _refuse_nowhere(result, spec)
    parts: list[RenderableType] = [_table(result)]
    if explain:
        parts.append(_explain(result, spec))
    parts.append(_advice(result))
    shown = result.to_dict() | {"peak_band": accuracy.PEAK_BAND.to_dict()}
    assert result.recommended is not None and shown["recommended"] is not None
    shown["recommended"]["peak_bound_bytes"] = accuracy.PEAK_BAND.bound(result.recommended.budget)
    if apply:
        shown["applied"], said = _apply(run_file, spec, result)
        parts.append(said)
    out.result(shown, Group(*parts))


def _refuse_nowhere(result: Plan, spec: RunSpec) -> NoReturn:
    """Refuse a run that fits on none of ``result``'s devices, naming the way that came closest."""
    closest = min((o for o in result.options if o.runnable), key=lambda o: o.shortfall)
    raise UsageError(
        f"run {spec.name!r} fits on no {result.device.name} within {result.max_nodes} node(s) of "
        f"{result.devices_per_node}: the closest, {closest.label} on {closest.tried} device(s) (the most that split "
        f"batch_size {spec.batch_size}), needs {format_bytes(closest.budget.total)} per device, "
        f"{format_bytes(closest.shortfall)} more than its {format_bytes(result.device.memory_bytes)}",
        field="--max-nodes",
    )


def _apply(run_file: Path, spec: RunSpec, result: Plan) -> tuple[dict[str, Any], Text]:
    """Write into ``run_file`` the settings of the first way, in the recommendation's order, with
    which `train`'s check passes: the run fits its smallest world (``nodes.min`` nodes of
    ``devices_per_node``: an elastic run keeps its global batch on fewer ranks, so each holds
    more), its passes sized as the trainer sizes them. Else the way whose passes are largest
    when it accumulates gradients there. Return that way and the settings that changed, and what
    to say. The smallest change that fits, where the recommendation is the fewest devices."""
    smallest = spec.nodes.min * result.devices_per_node
    ways = (o for o in result.options if o.parallel is not None and not o.accumulates)
    way = next((o for o in ways if _trains(spec, o.settings, run_file, result)), None)
    if way is None:
        # No way fits it with the trainer's passes: the way whose passes are largest on it, accumulating.
        way = best_accumulating(accumulating(spec, result.device, per_node=result.devices_per_node, most=smallest))
        way = way if way is not None and _trains(spec, way.settings, run_file, result) else None
    if way is None:
        raise UsageError(
            f"no way to train run {spec.name!r} fits its smallest world, nodes.min {spec.nodes.min} x "
            f"{result.devices_per_node} device(s) of {format_bytes(result.device.memory_bytes)}: raise nodes.min, or "
            "lower batch_size",
            field="--apply",
        )
    wanted = way.settings
    now = spec.model_dump(mode="json")
    proposed = validate(RunSpec, now | wanted, run_file).model_dump(mode="json")
    changed = {k: v for k, v in wanted.items() if proposed[k] != now[k]}
    fits = f"the first way that fits {spec.nodes.min} node(s) of {result.devices_per_node} (nodes.min): {way.label}"
    if not changed:
        return {"way": way.label, "changed": {}}, Text(f"{fits}; {run_file} trains that way already: nothing changed")
    rewrite(run_file, RunSpec, "run", changed)
    settings = ", ".join(f"{k}: {_flow(v)}" for k, v in changed.items())
    return {"way": way.label, "changed": changed}, Text(f"{fits}; {run_file} now says {settings}")


def _trains(spec: RunSpec, settings: dict[str, Any], run_file: Path, result: Plan) -> bool:
    """Whether ``spec`` with ``settings`` passes `train`'s check on ``result``'s devices: its
    layout runs on its smallest world, and fits it (``run_budget``, as the trainer sizes it)."""
    per_node = result.devices_per_node
    try:
        changed = validate(RunSpec, spec.model_dump(mode="json") | settings, run_file)
        budget = run_budget(
            changed,
            world_size=spec.nodes.min * per_node,
            max_world_size=spec.nodes.max * per_node,
            cuda=result.device.cuda,
        )
    except (ConfigError, ValueError):  # a layout the world or the model cannot take
        return False
    return budget.total <= result.device.memory_bytes


def _measure(
    spec: RunSpec, run_file: Path, *, steps: int, cluster_opt: str | None, log_format: LogFormat, out: Output
) -> None:
    from infractl.planning import probe  # the launcher and the cluster's modules: only --measure needs them

    state, _ = resolve_cluster(cluster_opt)
    out.info(f"measuring run {spec.name!r} on cluster {state.name!r}: {steps} step(s) on every node")
    result = probe.run_probe(state, spec, run_file, steps=steps, log_format=log_format)
    way = way_label(spec.parallel.label, checkpointing=spec.activation_checkpointing, precision=spec.mixed_precision)
    table = Table(
        title=f"{spec.name}: {way}; {result.world_size} rank(s) on {result.device}, "
        "per device (the largest of any rank)"
    )
    for col in ("component", "predicted", "measured", "error"):
        table.add_column(col, justify="left" if col == "component" else "right")
    for component in probe.COMPONENTS:
        table.add_row(
            component,
            format_bytes(result.predicted[component]),
            format_bytes(result.measured[component]),
            f"{result.error(component):+.1%}",
        )
    peak = (
        "peak: torch.cuda.max_memory_allocated; predicted: the total less the fragmentation margin and the CUDA reserve"
        if result.device == "cuda"
        else "peak: growth of the ranks' resident memory; predicted: the total less the fragmentation margin"
    )
    said = f"{peak}; kept in the store as {runstore.plan_measured_key(spec.name)}; {_band()}"
    out.result(result.to_dict(), Group(table, Text(said)))


def _band() -> str:
    """The peak's measured error band, in words (accuracy.PEAK_BAND)."""
    band = accuracy.PEAK_BAND
    return (
        f"the peaks of {band.runs} runs the planner was not tuned on measured {-band.low:.1%} below to "
        f"{band.high:.1%} above its prediction, the fragmentation margin aside (`{band.command}`: {band.measured_on})"
    )


def _table(result: Plan) -> Table:
    table = Table(
        title=f"{result.run}: {result.parameters:,} parameters; {result.device.name}, "
        f"{format_bytes(result.device.memory_bytes)} per device (--json or --explain: every component)",
        caption=f"per device: the step's peak, a bound: {_band()}",
    )
    columns = ("way to train", "parallel:", "fewest devices", "nodes", "per pass", "per device", "of which activations")
    for col in columns:
        table.add_column(col, justify="left" if col in ("way to train", "parallel:") else "right")
    for o in result.options:
        table.add_row(
            o.label,
            "not run" if o.parallel is None else _flow(o.parallel),
            str(o.devices) if o.devices else "-",
            str(o.nodes) if o.nodes else "-",
            str(o.micro_batch) + (f" ({o.accumulation} passes)" if o.accumulation > 1 else ""),
            format_bytes(o.budget.total),
            format_bytes(o.budget.activations),
        )
    return table


def _flow(value: bool | int | str | dict[str, int] | None) -> str:
    """``value`` as run.yaml would spell it inline: ``ddp``, ``{tp: 2}``, ``true``, ``4``, ``null``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | str):
        return str(value)
    return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"


def _advice(result: Plan) -> Text:
    rec = result.recommended
    assert rec is not None and rec.parallel is not None
    # parallel always; the other fields where they differ from run.yaml's defaults.
    fields = RunSpec.model_fields
    settings = [f"{k}: {_flow(v)}" for k, v in rec.settings.items() if k == "parallel" or v != fields[k].default]
    passes = f" in {rec.accumulation} passes of {rec.micro_batch} sequence(s) a step" if rec.accumulates else ""
    band = accuracy.PEAK_BAND
    return Text(
        f"recommended: {rec.label} on {rec.devices} device(s), {rec.nodes} node(s){passes}: at most "
        f"{format_bytes(band.bound(rec.budget))} per device of {format_bytes(result.device.memory_bytes)} "
        f"(measured peaks: {band.low:+.1%} to {band.high:+.1%} of the prediction); in run.yaml: "
        f"{', '.join(settings)}; asynchronous checkpoint staging needs "
        f"{format_bytes(result.staging_host_bytes(rec))} of host memory per node"
    )


def _explain(result: Plan, spec: RunSpec) -> Text:
    """The recommended way's every number, with its formula and inputs."""
    rec = result.recommended
    assert rec is not None and rec.devices is not None
    model, split = spec.model, rec.split
    dp = rec.devices // (split.tp * split.pp)
    where = f"N = {dp} device(s)"
    passes = f" ({rec.accumulation} passes a step)" if rec.accumulation > 1 else ""
    if split.meshed:
        where = f"{rec.devices} device(s), N = {dp} data-parallel x t = {split.tp} tensor x p = {split.pp} pipeline"
    lines = [
        f"{rec.label} on {where}: micro batch b = {rec.micro_batch}{passes}, s = {model.seq_len}, "
        f"h = {model.hidden}, a = {model.heads}, L = {model.layers}, V = {memory.VOCAB}",
        f"parameters Ψ = V·h + s·h + L·(12h² + 13h) + 2h = {result.parameters:,}",
    ]
    if split.meshed:
        stage = " (the first stage's, the largest)" if split.pp > 1 else ""
        lines.append(f"one rank's Ψᵣ{stage} = {memory.rank_parameters(model, tp=split.tp, pp=split.pp):,}")
    for term in memory.terms(
        model,
        scheme=rec.data_parallel,
        ranks=dp,
        micro_batch=rec.micro_batch,
        precision=rec.precision,
        checkpointing=rec.checkpointing,
        cuda=result.device.cuda,
        split=split,
    ):
        lines.append(f"  {term.component:<13} {term.what}: {term.formula} = {format_bytes(term.bytes)}")
    lines.append(f"  total {format_bytes(rec.budget.total)} per device")
    return Text("\n".join(lines))


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)
