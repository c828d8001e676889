"""``infractl drill``: inject a fault into a running job and measure its recovery."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from infractl import drill as drills
from infractl.cli._common import ClusterOpt, JsonOpt, output
from infractl.state import resolve_cluster

__all__ = ["register"]

app = typer.Typer(help="Fault drills against a running job (started with `infractl train ... --detach`).",
                  no_args_is_help=True)


@app.command("kill-node")
def kill_node(
    node: Annotated[Optional[str], typer.Option("--node", "-n", help="Node to kill. Default: the last node running the run.")] = None,
    run: Annotated[Optional[str], typer.Option("--run", "-r", help="Run to drill. Default: the run running on the cluster.")] = None,
    cluster_opt: ClusterOpt = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the run to recover and finish.", min=1)] = 600.0,
    json_mode: JsonOpt = False,
) -> None:
    """Kill every process of one node (agent and workers), then measure detection, restart, lost work and completion."""
    out = output(json_mode)
    state, _ = resolve_cluster(cluster_opt)
    result = drills.kill_node(state, node=node, run=run, timeout=timeout, progress=out.info)
    r = result.to_dict()
    summary = (
        f"drill {result.drill_id}: killed {result.node} of run {result.run_id!r} at step {result.step_at_fault} "
        f"(committed {result.last_committed_step}); detect {_s(result.detect_s)}, restart {_s(result.restart_s)}, "
        f"resumed from step {result.resumed_from_step} on world size {result.world_size_after}, "
        f"lost {result.lost_work_steps} step(s); final step {result.final_step}/{result.steps} "
        f"{'committed' if result.final_committed else 'not committed'}: {result.outcome}"
    )
    if json_mode:
        out.result(r)
    elif result.outcome == "recovered":
        out.success(summary)
    else:
        out.warn(summary)
    if result.outcome != "recovered":
        raise typer.Exit(1)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="drill")
