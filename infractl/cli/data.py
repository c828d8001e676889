"""``infractl data``: prepare versioned datasets."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from infractl import dataset
from infractl.cli._common import JsonOpt, finite_option, output

__all__ = ["register"]

data_app = typer.Typer(help="Prepare versioned, tokenized datasets.", no_args_is_help=True)


@data_app.command()
def prepare(
    sources: Annotated[
        list[Path],
        typer.Argument(help="Text files or directories (walked recursively).", metavar="SRC...", show_default=False),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="New, empty directory to write the dataset into.")],
    val_fraction: Annotated[
        float,
        typer.Option("--val-fraction", help="Share of documents held out for validation.", callback=finite_option),
    ] = 0.05,
    include: Annotated[str, typer.Option("--include", help="File-name pattern to take from directories.")] = "*",
    json_mode: JsonOpt = False,
) -> None:
    """Tokenize SOURCES (byte-level) into shards plus a manifest whose content hash is the dataset version."""
    out_ = output(json_mode)
    manifest = dataset.prepare(sources, out, val_fraction=val_fraction, include=include)
    table = Table(title=f"dataset {out} · version {manifest['version']}")
    for col in ("split", "bytes (tokens)", "shards"):
        table.add_column(col)
    for split, info in manifest["splits"].items():
        table.add_row(split, f"{info['bytes']:,}", str(len(info["shards"])))
    out_.result(manifest, table)
    out_.info(f"use it in run.yaml: data: {{source: prepared, path: {out.resolve()}}}")


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
