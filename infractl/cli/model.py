"""``infractl export`` and ``infractl sample``: the trained model as one file the team takes away,
and text from it, to see what the run learned. Both read the run's committed checkpoint from the
cluster's store (infractl/model/export.py); export records there what it wrote and how
(``runs/<run>/exports/``), so the handover bundle can name the file."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated, Literal

import typer

from infractl import runstore
from infractl.cli._common import ClusterOpt, JsonOpt, RunArg, finite_option, output
from infractl.errors import StoreError, UsageError
from infractl.statedir import resolve_cluster
from infractl.store import for_cluster

__all__ = ["register"]

# infractl.model.export is imported inside the commands: it loads torch (a second or more),
# which no other command should pay for. So its formats are spelled here too (a test holds them equal).
FormatName = Literal["safetensors", "torch"]

StepOpt = Annotated[
    int | None,
    typer.Option("--step", help="A committed step of the run. Default: the newest.", min=0, show_default=False),
]


def export(
    run: RunArg,
    out: Annotated[
        Path,
        typer.Option(
            "--out", "-o", help="File to write the weights to (in a directory that exists); FILE.json beside it."
        ),
    ],
    step: StepOpt = None,
    fmt: Annotated[
        FormatName, typer.Option("--format", help="safetensors, or torch (torch.save of the state dict).")
    ] = "safetensors",
    force: Annotated[bool, typer.Option("--force", help="Replace FILE and FILE.json if they exist.")] = False,
    cluster_opt: ClusterOpt = None,
    json_mode: JsonOpt = False,
) -> None:
    """Consolidate a committed checkpoint of RUN (any scheme, any world size) into one file of model
    weights, no optimizer state, and FILE.json: model shape, step, loss, dataset version, config hash, sha256."""
    from infractl.model import export as exporting

    out_ = output(json_mode)
    exporting.check_destination(out, force=force)  # before the store: a refusal costs nothing
    state, _ = resolve_cluster(cluster_opt)
    store = for_cluster(state)
    with exporting.consolidate(store, run, step=step) as consolidated:
        described = exporting.export(consolidated, out, fmt=fmt)
    # The store keeps where the file went and how it was made: the handover bundle names it.
    command = ["infractl", "export", run, "--step", str(consolidated.step), "--format", fmt]
    command += ["--out", str(out.absolute()), "-c", state.name]
    recorded = described | {"path": str(out.absolute()), "command": shlex.join(command)}
    try:
        store.put_bytes(
            runstore.export_record_key(run, consolidated.step, fmt),
            (json.dumps(recorded, indent=1, sort_keys=True) + "\n").encode(),
        )
    except StoreError as exc:
        out_.warn(f"exported, but not recorded in the store (the handover bundle will not name it): {exc.message}")
    loss = f"loss {consolidated.loss:.4f}" if consolidated.loss is not None else "loss not recorded"
    out_.success(
        f"exported step {consolidated.step} of run {run!r} ({described['scheme']} on {described['world_size']} "
        f"rank(s), {loss}) to {out}: {described['parameters']:,} parameters, {described['bytes']:,} bytes, "
        f"sha256 {described['sha256'][:12]}…; described in {exporting.description_path(out)}"
    )
    out_.result(described | {"path": str(out), "description": str(exporting.description_path(out))})


def sample(
    run: RunArg,
    prompt: Annotated[
        str, typer.Option("--prompt", "-p", help="Text to continue. Default: the start of a line.", show_default=False)
    ] = "",
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="Bytes to generate.", min=1, max=10_000)] = 200,
    temperature: Annotated[
        float,
        typer.Option(
            "--temperature",
            "-t",
            help="Above 1 more varied, below 1 more likely; 0 always takes the likeliest byte.",
            min=0,
            max=10,
            callback=finite_option,
        ),
    ] = 0.8,
    seed: Annotated[int, typer.Option("--seed", help="The same seed gives the same text.", min=0, max=2**63 - 1)] = 0,
    step: StepOpt = None,
    cluster_opt: ClusterOpt = None,
    json_mode: JsonOpt = False,
) -> None:
    """Generate text with RUN's model at a committed step (the weights `infractl export` writes) and print it."""
    from infractl.model import export as exporting
    from infractl.model.sample import generate

    out = output(json_mode)
    try:
        # Back to the bytes typed: argv that is not UTF-8 arrives as surrogate escapes.
        prompt_bytes = prompt.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError:
        raise UsageError("is not text that can be encoded as UTF-8", field="--prompt") from None
    state, _ = resolve_cluster(cluster_opt)
    with exporting.consolidate(for_cluster(state), run, step=step) as consolidated:
        model = consolidated.model()
    generated = generate(model, prompt_bytes, tokens=tokens, temperature=temperature, seed=seed)
    text = (prompt_bytes + generated).decode("utf-8", errors="replace")
    loss = f"loss {consolidated.loss:.4f}" if consolidated.loss is not None else "loss not recorded"
    out.info(
        f"run {run!r} at step {consolidated.step} ({loss}); {tokens} bytes at temperature {temperature}, seed {seed}:"
    )
    out.result(
        {
            "run": run,
            "step": consolidated.step,
            "loss": consolidated.loss,
            "prompt": prompt_bytes.decode("utf-8", errors="replace"),
            "text": text,
            "tokens": tokens,
            "temperature": temperature,
            "seed": seed,
        }
    )
    if out.json_mode:
        return
    # Raw, not rich text: rich would wrap the lines and expand the tabs; what the model wrote
    # is shown as it is, but for control characters (a terminal escape, say), shown escaped.
    out.raw("".join(c if c.isprintable() or c in "\n\t" else ascii(c)[1:-1] for c in text) + "\n")


def register(app: typer.Typer) -> None:
    app.command()(export)
    app.command()(sample)
