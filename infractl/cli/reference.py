"""``infractl reference``: the reference of every config field, command and failure signature as
one Markdown file. The repository commits it as docs/reference.md (tests/test_reference.py fails
when it is stale); the handover bundle's reference.md is the same text."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from infractl.cli._common import output
from infractl.errors import UsageError

__all__ = ["register"]


def reference(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", "-o", help="Markdown file to write (replaced).")] = Path(
        "docs/reference.md"
    ),
) -> None:
    """Write the reference: every cluster.yaml field (every provider's section included) and run.yaml
    field with its type, default and limits, every command and option, and the failure signatures."""
    from infractl.handover.reference import render_reference

    result = output()
    text = render_reference(ctx.find_root().command)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as exc:
        raise UsageError(f"cannot write the reference to {out}: {exc.strerror or exc}", field="--out") from None
    result.success(f"wrote {out}")


def register(app: typer.Typer) -> None:
    app.command()(reference)
