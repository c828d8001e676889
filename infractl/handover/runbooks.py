"""The bundle's runbooks: ``runbooks/<name>.md`` of the repository (``string.Template`` text,
placeholders listed in ``runbooks/README.md``) rendered with this cluster's names, paths and
commands, one section per run.

A template is a cluster-wide head, a line ``<!-- per run -->``, the part rendered once for each
run of the bundle (in run order), and optionally a line ``<!-- after runs -->`` and a cluster-wide
tail. Commands in the templates' ``bash`` blocks run as written, from the runbook's own folder
(the bundle's ``runbooks/``, as Runme runs them): each block exports ``INFRACTL_HOME`` and names
the cluster, the run and its config as ``../configs/...``, so a test can execute them
(tests/test_runbooks.py). Nothing names the folder the bundle is written to, so a copied bundle
works where it lands. Deterministic: the same cluster, runs and state root give the same bytes,
wherever the bundle is written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from string import Template

from pydantic import ValidationError

from infractl import providers, templates
from infractl.config import RunSpec
from infractl.handover.reference import RUNBOOKS
from infractl.runstore import RunRecord, checkpoint_prefix
from infractl.statedir import ClusterRecord, ClusterState, home

__all__ = ["AFTER_RUNS", "PER_RUN", "render_runbooks", "runbook_dir", "section"]

#: The lines that end a template's cluster-wide head and (optionally) its per-run part.
PER_RUN = "<!-- per run -->"
AFTER_RUNS = "<!-- after runs -->"

_NO_RUNS = "No run of this cluster was in its store when the bundle was made: regenerate it after `infractl train`.\n"

#: Where the ``bash`` blocks run (``$run_from``): the state root and the store are absolute (they
#: live on the controller), the bundle's own files relative, so the bundle can be copied anywhere.
_RUN_FROM = (
    "Run the `bash` blocks below from the folder this runbook is in, the bundle's `runbooks/`, wherever\n"
    "the bundle was copied to: `cd` there before pasting one into a shell (Runme runs them there by\n"
    "default). They find the bundle's configs as `../configs/`, the state root and the store by their\n"
    "absolute paths."
)


def runbook_dir() -> Path:
    """``runbooks/`` as infractl ships it."""
    return templates.folder("runbooks")


def render_runbooks(cluster: ClusterRecord, records: list[RunRecord]) -> dict[str, bytes]:
    """``runbooks/<name>.md`` for every runbook, for ``cluster`` (its record) and the runs of ``records``."""
    common = _cluster_values(cluster)
    per_run_values = [_with_partials(common | values) for r in records if (values := _run_values(cluster, r))]
    files: dict[str, bytes] = {}
    for name in RUNBOOKS:
        head, _, rest = (runbook_dir() / f"{name}.md").read_text().partition(PER_RUN)
        per_run, _, tail = rest.partition(AFTER_RUNS)
        parts = [Template(head).substitute(common)]
        if per_run.strip():
            parts += [Template(per_run).substitute(values) for values in per_run_values] or [_NO_RUNS]
        parts.append(Template(tail).substitute(common))
        files[f"runbooks/{name}.md"] = ("\n\n".join(p.strip("\n") for p in parts if p.strip()) + "\n").encode()
    return files


def _with_partials(values: dict[str, str]) -> dict[str, str]:
    """``values`` and the shared command blocks (``runbooks/_<name>.sh`` as ``$<name>``) rendered with them."""
    partials = sorted(runbook_dir().glob("_*.sh"))
    return values | {p.stem[1:]: Template(p.read_text()).substitute(values).rstrip("\n") for p in partials}


def _cluster_values(cluster: ClusterRecord) -> dict[str, str]:
    store = cluster.store
    return {
        "cluster": cluster.name,
        "home": str(home()),
        "exports": str(home().parent / "exports"),
        "run_from": _RUN_FROM,
        "store": store,
        "nodes": " ".join(n.name for n in cluster.nodes),
        "node_count": str(len(cluster.nodes)),
        "per_node": str(cluster.spec.processes_per_node),
        "node_not_back": providers.get(cluster.spec.provider).lost_node(cluster.spec),
    }


def _run_values(cluster: ClusterRecord, record: RunRecord) -> dict[str, str] | None:
    """The run's placeholders; None for a record without a valid spec (written by another version)."""
    try:
        spec = RunSpec.model_validate(record.spec)
    except ValidationError:
        return None
    ckpt = checkpoint_prefix(record.run_id, 0).rsplit("/", 1)[0]
    per_node = cluster.spec.processes_per_node
    return {
        "run": record.run_id,
        "config": f"../configs/runs/{record.run_id}.yaml",
        "steps": str(spec.steps),
        "every": str(spec.checkpoint.every),
        "nodes_min": str(spec.nodes.min),
        "nodes_max": str(spec.nodes.max),
        "world": str(spec.nodes.max * per_node),
        "max_restarts": str(spec.max_restarts),
        "step_timeout": str(math.ceil(spec.watchdog.step_timeout_s)),
        "grace": f"{spec.preemption.grace_s:g}",
        "ckpt": ckpt,
        # What the run.yaml's `env:` passes from the shell: `train` and `rejoin` refuse without it,
        # so a block that runs them says first which is missing (nothing for a run that passes none).
        "require_env": "".join(
            f': "${{{name}:?run {record.run_id} passes {name} to its trainers (its run.yaml env:): set it}}"\n'
            for name in spec.env
        ),
        # The run's committed steps, oldest first, on one line (any store: `infractl status` reads them).
        "commits": (
            f"infractl status -c {cluster.name} --json | python3 -c 'import json, sys; print(*next("
            'r["committed_steps"] for r in json.load(sys.stdin)["runs"] if r["run"] == sys.argv[1]))'
            f"' {record.run_id}"
        ),
    }


def section(state: ClusterState, runbook: str, run: str | None) -> dict[str, str | None]:
    """Where to read ``runbook`` for ``run`` (None: the cluster-wide part): ``path`` is the runbook
    of the bundle ``infractl bundle`` last wrote, with the run's anchor, when that bundle has the
    run's section (else None: the bundle must be written or regenerated first)."""
    anchor = f"run-{run}" if run is not None else None  # GitHub's anchor of the heading "Run `RUN`"
    path: str | None = None
    try:
        out = Path(json.loads(state.bundle_record_path.read_text())["out"])
        text = (out / "runbooks" / f"{runbook}.md").read_text()
    except (OSError, ValueError, KeyError, TypeError):
        text = ""
    if text and (run is None or f"## Run `{run}`" in text):
        path = f"{out / 'runbooks' / runbook}.md" + (f"#{anchor}" if anchor else "")
    return {"runbook": runbook, "section": anchor, "path": path}
