"""Options and helpers shared by every command module (defined once, reused)."""

from __future__ import annotations

import math
import re
import sys
from typing import Annotated

import typer

from infractl.config import NAME_PATTERN
from infractl.errors import UsageError
from infractl.log import LogFormat
from infractl.output import Output

__all__ = [
    "ClusterOpt",
    "JsonOpt",
    "YesOpt",
    "RunArg",
    "RunOpt",
    "LogFormatOpt",
    "NodeArg",
    "name_option",
    "finite_option",
    "output",
    "current_output",
    "reset_output",
    "set_debug",
    "debug_requested",
    "confirm",
]


def name_option(value: str | None) -> str | None:
    """A run or node name as run.yaml and the inventory spell them: it becomes part of paths and
    store keys, so anything else (``../x``, a slash) is refused at the command line."""
    if value is not None and not re.fullmatch(NAME_PATTERN, value):
        raise typer.BadParameter("expected a name: 1-40 lower-case letters, digits and '-', not starting with '-'")
    return value


def finite_option(value: float | None) -> float | None:
    """A number of seconds or a fraction: ``nan`` and ``inf`` parse as floats but mean nothing
    (and ``nan`` slips past every range check), so they are refused at the command line."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


ClusterOpt = Annotated[
    str | None,
    typer.Option(
        "--cluster",
        "-c",
        help="cluster.yaml to use, or the name of a cluster that is up. Default: the built-in `local` cluster.",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]
RunArg = Annotated[str, typer.Argument(help="Run name.", metavar="RUN", callback=name_option)]
RunOpt = Annotated[
    str | None,
    typer.Option(
        "--run",
        "-r",
        callback=name_option,
        help="Run name. Default: the run running on the cluster (logs: else the run launched last).",
    ),
]
LogFormatOpt = Annotated[LogFormat, typer.Option("--log-format", help="Log lines: console or json.")]
NodeArg = Annotated[str, typer.Argument(help="Node name (e.g. node-1).", metavar="NODE", callback=name_option)]


_current: list[Output] = []


def output(json_mode: bool = False) -> Output:
    """The command's one Output; the error funnel reports through it too, so a command that
    parsed ``--json`` gets its error as JSON exactly when it would have got its result so."""
    out = Output(json_mode=json_mode)
    _current[:] = [out]
    return out


def current_output() -> Output | None:
    """The Output of the command running now, once it made one (None while parsing)."""
    return _current[0] if _current else None


def reset_output() -> None:
    """Forget the previous command's Output (the CLI may run more than once in a process)."""
    _current.clear()


_debug: list[bool] = [False]


def set_debug(on: bool) -> None:
    """``--debug``, as the root command parsed it."""
    _debug[0] = on


def debug_requested() -> bool:
    """Whether this command line asked for tracebacks (False until the root options parsed)."""
    return _debug[0]


def confirm(question: str, *, yes: bool, flag: str = "--yes") -> None:
    """Ask on a terminal; without one, require ``--yes`` (never destroy silently)."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(f"{question.rstrip('?')}: pass {flag} to confirm (no terminal to ask on)", field=flag)
    if not typer.confirm(question, default=False):
        raise UsageError("aborted; nothing was changed")
