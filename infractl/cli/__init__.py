"""The infractl CLI: composes one module per noun and funnels every error into one line."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from infractl import __version__
from infractl.cli import cluster, data, drill, observe, schema, train
from infractl.errors import InfractlError
from infractl.log import LogFormat, configure
from infractl.output import Output

__all__ = ["app", "main"]

app = typer.Typer(
    name="infractl",
    help="Provision nodes, configure them, and run fault-tolerant multi-node PyTorch training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,  # this CLI touches credentials
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"infractl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
    log_format: Annotated[LogFormat, typer.Option("--log-format", help="infractl's own log lines: console or json.")] = "console",
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    configure(log_format)


for module in (cluster, train, observe, data, schema, drill):
    module.register(app)


def main() -> None:
    debug = "--debug" in sys.argv[1:]
    out = Output()
    try:
        rv = app(standalone_mode=False)
    except InfractlError as exc:
        if debug:
            raise
        out.err.print(f"[red]error:[/red] {exc.message}", highlight=False)
        sys.exit(exc.exit_code)
    except typer.exceptions.TyperException as exc:
        # Typer's own usage errors (unknown command, bad option value) carry their formatting.
        show = getattr(exc, "show", None)
        if show is not None:
            show()
        else:
            out.err.print(f"[red]error:[/red] {exc.message}", highlight=False)
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        out.err.print("[red]aborted[/red]")
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)
