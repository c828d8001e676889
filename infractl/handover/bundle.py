"""``infractl bundle``: the handover, generated from the live cluster, its runs, drills and
benchmarks, into ``handover/<cluster>/`` (or ``--out``).

The bundle is assembled in memory as {relative path: bytes}, written to a temporary directory
beside the destination and renamed into place: a failure half-way leaves the previous bundle as
it was. It is deterministic: nothing in it depends on when it was made (only the recorded run
times), so regenerating from unchanged inputs gives the same bytes.

``--out`` replaces its folder whole, so it must never be a folder of the user's: ``write`` replaces
only nothing, an empty folder or a bundle (the marker file ``.infractl-bundle`` at its root, whose
bytes never change), and never the state root, the current directory or a folder that holds
either. Readers of a bundle are not trusted (DESIGN.md, Roles and trust): every config is written
with its secrets redacted (redaction.py), and a bundle in which a private key or a token of the
operator's environment is left is not written.

    index.html, style.css   one static page that shows and links everything (opens from disk),
                            from the templates in the repository's bundle/ (page.py)
    topology.md, .svg       nodes, ranks, addresses, rendezvous, store, bottleneck, how to grow
    reference.md            every config field and CLI option, failure signatures
    configs/                cluster.yaml, run.yaml of each run, Terraform variables and outputs,
                            the Ansible inventory, the runtime pin, the newest environment
                            fingerprint; README.md: where fixes are made and in which order
    runbooks/               one per failure (reference.RUNBOOKS), commands for this cluster and its runs
    access/                 each role's IAM policy for the store, the membership, README.md (access.py)
    baseline/               per run: <run>.json, <run>-loss.png and <run>-memory.json (`plan
                            --measure`, when run); bench.json and its plots
    .infractl-bundle        the marker: this folder is a bundle, which the next `bundle --out` replaces
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infractl import providers, runs, runstore
from infractl.errors import UsageError
from infractl.handover import access_docs, baseline, page, redaction, runbooks, topology
from infractl.handover.reference import ClickCommand, render_reference
from infractl.runstore import RunRecord
from infractl.statedir import ClusterRecord, ClusterState, home
from infractl.store import Store, for_cluster

__all__ = ["MARKER", "Bundle", "assemble", "check_out", "write"]

#: The file at the root of every bundle ``write`` makes: a folder that holds it may be replaced.
MARKER = ".infractl-bundle"
# Its bytes never change (nothing of when or where), so the same inputs still give the same bytes.
_MARKER_TEXT = b"A handover bundle written by `infractl bundle`: the next `infractl bundle --out` here replaces it.\n"


@dataclass(frozen=True)
class Bundle:
    cluster: str
    runs: list[str]
    files: dict[str, bytes]  # relative path -> content


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


def _yaml(value: Any) -> bytes:
    return yaml.safe_dump(value, sort_keys=False, default_flow_style=False).encode()


def assemble(state: ClusterState, *, run: str | None, cli: ClickCommand) -> Bundle:
    """Every file of the bundle of ``state``'s cluster: all its runs, or only ``run``. No file
    depends on where the bundle is written: it can be copied anywhere. ``cli``: the root command
    of infractl's command line, for the reference."""
    cluster = state.record()
    store = for_cluster(state)
    records = sorted(runs.cluster_runs(state, store), key=lambda r: r.run_id)
    if run is not None:
        records = [r for r in records if r.run_id == run]
        if not records:
            raise UsageError(f"no run {run!r} of cluster {state.name!r} in its store", field="--run")
    bench = baseline.newest_bench(store, state.name)
    nodes = providers.control(state)
    interfaces = {name: nodes.network_env(name).get("GLOO_SOCKET_IFNAME") for name in nodes.nodes}
    files: dict[str, bytes] = {
        "topology.md": topology.topology_markdown(
            cluster, interfaces, bench[0] if bench else None, providers.of(state).topology(state)
        ).encode(),
        "topology.svg": topology.topology_svg(cluster, interfaces).encode(),
        "reference.md": render_reference(cli).encode(),
    }
    files |= _configs(state, cluster, store, records)
    files |= _baselines(store, records, bench)
    files |= runbooks.render_runbooks(cluster, records)
    files |= access_docs.bundle_files(state)
    files |= page.render(cluster.name, [r.run_id for r in records], files)
    redaction.refuse_secrets(files, os.environ)
    return Bundle(state.name, [r.run_id for r in records], files)


def _configs(state: ClusterState, cluster: ClusterRecord, store: Store, records: list[RunRecord]) -> dict[str, bytes]:
    # Every config goes through redaction.redact: a secret anywhere in them is written as "(redacted)".
    redact = redaction.redact
    files = {
        "configs/README.md": _CONFIGS_README.format(cluster=cluster.name).encode(),
        "configs/cluster.yaml": _yaml(redact(cluster.spec.model_dump(mode="json"))),
        "configs/runtime.json": _json(redact(cluster.spec.runtime.model_dump(mode="json"))),
    }
    terraform = state.terraform_dir
    if (terraform / "main.tf.json").is_file():
        root = json.loads((terraform / "main.tf.json").read_text())
        files["configs/terraform/main.tf.json"] = _json(redaction.root_module(root, terraform / "module"))
    if (terraform / "terraform.tfstate").is_file():
        outputs = json.loads((terraform / "terraform.tfstate").read_text()).get("outputs", {})
        files["configs/terraform/outputs.json"] = _json(redaction.outputs(outputs))
    inventory = state.dir / "ansible" / "inventory" / "hosts.json"
    if inventory.is_file():
        files["configs/ansible/hosts.json"] = _json(redact(json.loads(inventory.read_text())))
    exports = {r.run_id: made for r in records if (made := runstore.read_export_records(store, r.run_id))}
    if exports:
        files["configs/exports.json"] = _json(redact(exports))
    for record in records:
        if record.spec is not None:
            files[f"configs/runs/{record.run_id}.yaml"] = _yaml(redact(record.spec))
        step = runstore.latest_committed_step(store, record.run_id)
        manifest = runstore.read_manifest(store, record.run_id, step) if step is not None else None
        if manifest is not None and "environment" in manifest.extra:
            files[f"configs/runs/{record.run_id}.environment.json"] = _json(
                {"step": step, "environment": redact(manifest.extra["environment"])}
            )
    return files


def _baselines(
    store: Store, records: list[RunRecord], bench: tuple[dict[str, Any], dict[str, bytes]] | None
) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for record in records:
        metrics = runstore.read_metrics(store, record.run_id)
        files[f"baseline/{record.run_id}.json"] = _json(baseline.run_baseline(store, record, metrics))
        if store.exists(runstore.plan_measured_key(record.run_id)):
            files[f"baseline/{record.run_id}-memory.json"] = store.get_bytes(runstore.plan_measured_key(record.run_id))
        plot = baseline.loss_plot(record.run_id, metrics)
        if plot is not None:
            files[f"baseline/{record.run_id}-loss.png"] = plot
    if bench is not None:
        figures, plots = bench
        files["baseline/bench.json"] = _json(figures)
        files |= {f"baseline/bench-{name}": data for name, data in sorted(plots.items())}
    return files


def check_out(out: Path) -> Path:
    """``out`` resolved, when ``write`` may replace what is there: nothing, an empty folder or a
    bundle (its marker at the root). Refused (``UsageError`` naming ``--out``, nothing changed):
    anything else, and whatever is in it, the state root, the current directory, a folder inside
    the state root or one that holds either (a bundle is replaced whole: ``--out .`` or ``--out ~``
    would take the checkout's or the user's files, and the cluster's keys and state with them)."""
    try:
        where = out.resolve()
        state_root, cwd = home().resolve(), Path.cwd().resolve()
        exists, is_dir = where.exists(), where.is_dir()
        foreign = is_dir and any(where.iterdir()) and not _is_bundle(where)
    except (OSError, ValueError) as exc:  # a name too long, a folder that cannot be read
        raise UsageError(f"{out} cannot be written: {getattr(exc, 'strerror', None) or exc}", field="--out") from None
    if where.is_relative_to(state_root) or state_root.is_relative_to(where):
        raise UsageError(
            f"{out} is, holds or lies inside infractl's state root {state_root} (the clusters' keys and state): "
            "name a new or empty folder outside it",
            field="--out",
        )
    if cwd.is_relative_to(where):
        raise UsageError(
            f"{out} is the current directory or holds it, and a bundle replaces its folder whole: name a new or "
            "empty folder (the default is handover/<cluster>)",
            field="--out",
        )
    if exists and not is_dir:
        raise UsageError(f"{out} is a file, and a bundle replaces it whole: name a new or empty folder", field="--out")
    if foreign:
        raise UsageError(
            f"{out} holds files that are not a bundle infractl wrote (no {MARKER} in it), and a bundle replaces its "
            "folder whole: name a new or empty folder",
            field="--out",
        )
    return where


def _is_bundle(folder: Path) -> bool:
    marker = folder / MARKER
    return marker.is_file() and not marker.is_symlink() and marker.read_bytes() == _MARKER_TEXT


def write(bundle: Bundle, out: Path) -> None:
    """Write ``bundle`` to ``out`` all at once (``check_out`` first): a temporary directory beside
    it, renamed into place; the previous bundle is replaced only once the new one is whole."""
    out = check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for relative, content in sorted(bundle.files.items()):
            path = staging / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
        (staging / MARKER).write_bytes(_MARKER_TEXT)
        staging.chmod(0o755)
        if not out.exists():
            os.replace(staging, out)
            return
        # Set aside under a name of its own (a fixed name may be a folder of the user's), and
        # removed once the new bundle is in place.
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
        os.replace(out, old)
        try:
            os.replace(staging, out)
        except BaseException:
            os.replace(old, out)
            raise
        shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


_CONFIGS_README = """\
# Configuration of cluster `{cluster}`

Everything this cluster and its runs are is in these files. Fixes are made here, in the configs,
never in infractl's code: a change that needs code is a bug to report.

Change the environment in this order:

1. Edit the config: `cluster.yaml` (nodes, processes per node, runtime pin, store) or the run's
   `runs/<run>.yaml` (model, batch, scheme, checkpoint cadence, elastic range).
2. `infractl up -c cluster.yaml`: Terraform converges the nodes, Ansible reconfigures them.
3. The health gate runs as part of `up` (a cross-node all-reduce); nothing trains on a node that
   fails it.
4. Resume: `infractl train runs/<run>.yaml` continues from the last committed checkpoint.

`terraform/` holds the resolved Terraform variables (`main.tf.json`) and outputs, `ansible/` the
inventory Ansible ran with, `runtime.json` the runtime pin, and `runs/<run>.environment.json` the
environment fingerprint (versions, image, host) recorded in the run's newest committed checkpoint.
In every one of them a secret (a private key, a token, a password, a Terraform variable declared
sensitive) reads `(redacted)`: it stays in the cluster's state on the operator's machine.
`exports.json` (once a model was exported) names, per run, each file `infractl export` wrote: where
it is, its sha256, the step and format, and the exact command that made it (run it again to get
the same bytes).
"""
