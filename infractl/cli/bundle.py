"""``infractl bundle``: the handover of a cluster (see infractl/handover/bundle.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from infractl.cli._common import ClusterOpt, JsonOpt, RunOpt, output
from infractl.statedir import resolve_cluster, write_private

__all__ = ["register"]


def bundle_command(
    ctx: typer.Context,
    cluster_opt: ClusterOpt = None,
    run: RunOpt = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help=(
                "Directory to write (replaced whole): a new or empty one, or a bundle infractl wrote. "
                "Default: handover/<cluster>/."
            ),
        ),
    ] = None,
    json_mode: JsonOpt = False,
) -> None:
    """Write the cluster's handover: topology, configs, baseline metrics and plots, the reference of
    every field and option, and one index.html that links them. Written whole or not at all;
    regenerating from the same cluster and store gives the same bytes."""
    from infractl.handover import bundle

    result = output(json_mode)
    state, _ = resolve_cluster(cluster_opt)
    where = out if out is not None else Path("handover") / state.name
    bundle.check_out(where)  # before the bundle is made: a refused --out costs nothing
    made = bundle.assemble(state, run=run, cli=ctx.find_root().command)
    bundle.write(made, where)
    write_private(state.bundle_record_path, json.dumps({"out": str(where.resolve())}) + "\n")
    result.success(
        f"handover of cluster {state.name!r} written to {where}/ ({len(made.files)} files); open {where}/index.html"
    )
    result.result({"cluster": made.cluster, "runs": made.runs, "out": str(where), "files": sorted(made.files)})


def register(app: typer.Typer) -> None:
    app.command("bundle")(bundle_command)
