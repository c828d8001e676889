"""``infractl profile RUN --steps FIRST:LAST``: torch.profiler traces of steps of a running run, on
every rank, in the store; without ``--steps``, the run's traces and how to open them.

The command writes ``runs/<run>/profiles/request.json``; every rank reads it within
``trainer.profiling.POLL_S`` seconds and traces the steps itself (trainer/profiling.py), so the
window must begin far enough ahead of the run: after the newest step in the metrics, plus
``log_every`` (the metrics of the steps since then are not read back yet), plus the steps the run
takes in ``PICKUP_S`` seconds (the poll, and the store's and the metrics writer's lag). A run not
started yet traces steps from its run.yaml's ``profile.steps``.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from infractl import runs, runstore
from infractl.cli._common import ClusterOpt, JsonOpt, RunArg, finite_option, output
from infractl.config import RunSpec, parse_step_window
from infractl.errors import InfractlError, StateError, UsageError
from infractl.output import Output
from infractl.runstore import ProfileRequest, StepRecord
from infractl.statedir import ClusterState, resolve_cluster
from infractl.store import ObjectInfo, Store, for_cluster

__all__ = ["PICKUP_S", "register"]

#: Seconds within which every rank has a request: two polls (trainer.profiling.POLL_S = 2 s) and
#: the store's and metrics writer's lag (records reach the store up to 2 s after their log step).
PICKUP_S = 6.0
# Seconds between two looks at the store while waiting for the traces.
_WAIT_POLL_S = 1.0

StepsOpt = Annotated[
    str | None,
    typer.Option(
        "--steps",
        metavar="FIRST:LAST",
        help="Trace steps FIRST to LAST (both included, at most 50) on every rank of the running run. "
        "Without it: list the run's traces.",
        show_default=False,
    ),
]
TimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout",
        help="Seconds to wait for every rank's trace.",
        min=1,
        max=7 * 86400,
        callback=finite_option,
    ),
]


def profile(
    run: RunArg,
    steps: StepsOpt = None,
    cluster_opt: ClusterOpt = None,
    timeout: TimeoutOpt = 600.0,
    json_mode: JsonOpt = False,
) -> None:
    """Trace steps FIRST:LAST of a running run with torch.profiler on every rank, wait for the traces
    in the store and say how to open them (Perfetto, TensorBoard). Without --steps: the run's traces."""
    out = output(json_mode)
    window = None
    if steps is not None:
        try:
            window = parse_step_window(steps)
        except ValueError as exc:
            raise UsageError(str(exc), field="--steps") from None
    state, _ = resolve_cluster(cluster_opt)
    state.record()  # refused when the cluster is not up
    if window is None:
        store = for_cluster(state)
        every = runstore.profile_traces(store, run)
        if not every and runstore.read_run_record(store, run) is None:
            raise UsageError(f"no run named {run!r} in the store {store.uri}", field="RUN")
        _show(out, store, run, every)
        return
    store = _request(out, state, run, window)
    _show(out, store, run, {window: _wait(out, state, store, run, window, timeout)})


def _request(out: Output, state: ClusterState, run: str, window: tuple[int, int]) -> Store:
    """Check ``window`` against the running run and write the request; return the store."""
    if run not in runs.running(state):
        raise StateError(
            f"run {run!r} is not running on cluster {state.name!r}; `infractl profile --steps` traces a running "
            'run (for a run you are about to start, set `profile: {steps: "FIRST:LAST"}` in its run.yaml)',
            field="RUN",
        )
    store = for_cluster(state)
    spec = _spec(store, run)
    newest = runstore.latest_metrics(store, run)
    if newest is None:
        raise StateError(f"run {run!r} has recorded no step yet; ask again once `infractl metrics {run}` shows some")
    _check_window(spec, newest, window)
    steps = f"{window[0]}:{window[1]}"
    pending = runstore.read_profile_request(store, run)
    if pending is not None and (pending.first, pending.last) == window:
        out.info(f"run {run!r} was asked for steps {steps} already; waiting for its traces")
        return store
    if pending is not None and pending.last >= newest["step"]:
        raise StateError(
            f"run {run!r} still has a request for steps {pending.steps} (its newest step is {newest['step']}); "
            "one request at a time: ask again once that one is done",
            field="--steps",
        )
    runstore.write_profile_request(store, run, ProfileRequest(first=window[0], last=window[1], requested=time.time()))
    out.info(f"asked every rank of run {run!r} to trace steps {steps} (its newest step is {newest['step']})")
    return store


def _spec(store: Store, run: str) -> RunSpec:
    """The run's resolved spec, from its record in the store (the launcher writes it at launch)."""
    record = runstore.read_run_record(store, run)
    if record is None or record.spec is None:
        raise StateError(f"run {run!r} has no run record in the store {store.uri} yet; ask again in a few seconds")
    try:
        return RunSpec.model_validate(record.spec)
    except ValidationError as exc:  # written by another version of infractl
        raise StateError(
            f"run {run!r}: this infractl cannot read its spec in the store ({exc.errors()[0]['msg']})"
        ) from None


def _check_window(spec: RunSpec, newest: StepRecord, window: tuple[int, int]) -> None:
    """Refuse (``--steps``) a window after the run's end, too soon to be picked up in time, or
    overlapping the run.yaml's own."""
    first, last = window
    steps = f"{first}:{last}"
    if last > spec.steps:
        raise UsageError(f"{steps} ends after the run's last step ({spec.steps})", field="--steps")
    # step_time_s leaves out the work between steps, so this overestimates the steps per second: a safe lead.
    lead = spec.log_every + math.ceil(PICKUP_S / max(newest["step_time_s"], 1e-6))
    earliest = newest["step"] + lead
    if first < earliest:
        raise UsageError(
            f"{steps} starts too soon: the run's newest step in the store is {newest['step']}, and a request "
            f"reaches every rank {lead} steps later at most (log_every {spec.log_every}, plus {PICKUP_S:g} s at "
            f"{newest['step_time_s']:.3f} s per step); start at step {earliest} or later",
            field="--steps",
        )
    configured = spec.profile.window
    if configured is not None and first <= configured[1] and configured[0] <= last:
        raise UsageError(f"{steps} overlaps the run's profile.steps ({spec.profile.steps})", field="--steps")


def _wait(
    out: Output, state: ClusterState, store: Store, run: str, window: tuple[int, int], timeout: float
) -> dict[int, ObjectInfo]:
    """Every rank's trace of ``window``, once the run passed it and the trace of each rank of its
    current world is in the store."""
    deadline = time.monotonic() + timeout
    steps = f"{window[0]}:{window[1]}"
    with out.step_progress(window[1], description=f"run {run}: waiting for step {window[1]}") as progress:
        while True:
            newest = runstore.latest_metrics(store, run)
            traces = runstore.profile_traces(store, run).get(window, {})
            step = newest["step"] if newest else 0
            if newest is not None:
                progress.update(
                    min(step, window[1]),  # the run goes on past the window while the traces upload
                    loss=newest["loss"],
                    tokens_per_s=newest["tokens_per_s"],
                    world_size=newest["world_size"],
                )
            if newest is not None and step >= window[1] and set(range(newest["world_size"])) <= set(traces):
                return traces
            if run not in runs.running(state):
                if traces:
                    out.warn(f"run {run!r} stopped at step {step}; these are the traces it left")
                    return traces
                raise InfractlError(f"run {run!r} stopped at step {step} before any rank's trace of steps {steps}")
            if time.monotonic() > deadline:
                have = ", ".join(str(r) for r in sorted(traces)) or "none"
                raise InfractlError(
                    f"no trace of steps {steps} from every rank after {timeout:g} s (run {run!r} is at step {step}; "
                    f"traces of rank(s) {have} are in the store; see `infractl logs --run {run}`)"
                )
            time.sleep(_WAIT_POLL_S)


def _show(out: Output, store: Store, run: str, traces: dict[tuple[int, int], dict[int, ObjectInfo]]) -> None:
    """The traces with their locations, and how to open them."""
    folder = store.location(f"{runstore.run_prefix(run)}/profiles")
    result: dict[str, Any] = {
        "run_id": run,
        "profiles": folder,
        "windows": [
            {
                "steps": f"{first}:{last}",
                "traces": [
                    {"rank": rank, "location": store.location(info.key), "bytes": info.size}
                    for rank, info in sorted(by_rank.items())
                ],
            }
            for (first, last), by_rank in sorted(traces.items())
        ],
    }
    out.result(result)
    if out.json_mode:
        return
    if not traces:
        out.raw(f"run {run!r} has no profiler traces in the store yet\n")
        return
    lines = []
    for window in result["windows"]:
        lines.append(f"steps {window['steps']} ({len(window['traces'])} rank(s)):")
        lines += [f"  {t['location']}  ({t['bytes']:,} bytes)" for t in window["traces"]]
    on_disk = store.local_path(f"{runstore.run_prefix(run)}/profiles") is not None
    local = folder if on_disk else "./profiles"
    copy = "" if on_disk else f"copy {folder} to ./profiles (e.g. `aws s3 cp --recursive`), then "
    lines += [
        "Perfetto: open https://ui.perfetto.dev and load one rank's .pt.trace.json.gz (gzip is read as is);",
        f"TensorBoard: {copy}`pip install torch-tb-profiler` and `tensorboard --logdir {local}`",
        "  (PYTORCH_PROFILER tab: each FIRST-LAST folder is a run, each rank-<r> a worker).",
    ]
    # Raw lines, not rich text: a path must not be wrapped where the user copies it from.
    out.raw("".join(f"{line}\n" for line in lines))


def register(app: typer.Typer) -> None:
    app.command("profile")(profile)
