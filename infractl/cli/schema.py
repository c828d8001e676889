"""``infractl schema``: JSON Schemas of cluster.yaml and run.yaml for editors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from infractl.cli._common import output
from infractl.config import RunSpec, cluster_model
from infractl.errors import UsageError

__all__ = ["register", "write_schemas"]


def write_schemas(out_dir: Path) -> list[Path]:
    written = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, model in (("cluster", cluster_model()), ("run", RunSpec)):
            path = out_dir / f"{name}.schema.json"
            path.write_text(json.dumps(model.model_json_schema(), indent=2, sort_keys=True) + "\n")
            written.append(path)
    except OSError as exc:
        raise UsageError(f"cannot write the schemas into {out_dir}: {exc.strerror or exc}", field="--out") from None
    return written


def schema(
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Directory to write the schemas into.")] = Path(
        "schemas"
    ),
) -> None:
    """Write cluster.schema.json and run.schema.json (for yaml-language-server and other editors)."""
    out = output()
    for path in write_schemas(out_dir):
        out.success(f"wrote {path}")
    out.info("add to the first line of a YAML file: # yaml-language-server: $schema=<path to the schema>")


def register(app: typer.Typer) -> None:
    app.command()(schema)
