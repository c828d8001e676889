"""Options and helpers shared by every command module (defined once, reused)."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from infractl.errors import UsageError
from infractl.output import Output

__all__ = ["ClusterOpt", "JsonOpt", "YesOpt", "output", "confirm"]

ClusterOpt = Annotated[
    Optional[str],
    typer.Option(
        "--cluster",
        "-c",
        help="cluster.yaml to use, or the name of a cluster that is up. Default: the built-in `local` cluster.",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]


def output(json_mode: bool = False) -> Output:
    return Output(json_mode=json_mode)


def confirm(question: str, *, yes: bool, flag: str = "--yes") -> None:
    """Ask on a terminal; without one, require ``--yes`` (never destroy silently)."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(f"{question.rstrip('?')}: pass {flag} to confirm (no terminal to ask on)")
    if not typer.confirm(question, default=False):
        raise UsageError("aborted; nothing was changed")
