"""The infractl CLI: composes one module per noun and funnels every error into one line."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any, NoReturn

import typer
from typer._click import exceptions as click_errors

from infractl import __version__, no_collection_at_exit
from infractl.cli import (
    access,
    bench,
    bundle,
    cluster,
    data,
    drill,
    image,
    model,
    observe,
    plan,
    profile,
    reference,
    schema,
    train,
)
from infractl.cli._common import current_output, debug_requested, reset_output, set_debug
from infractl.errors import InfractlError
from infractl.output import Output

__all__ = ["app", "main"]

#: Exit code of an unexpected exception (a bug, not bad input or a failed job): sysexits' EX_SOFTWARE.
EXIT_INTERNAL = 70

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
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of an error.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    set_debug(debug)


# Every invocation imports every command module (Typer reads each command's signature for its
# help), so a module imports at its top what registering its commands needs; what only some of
# its commands need, they import themselves.
for module in (
    cluster,
    train,
    observe,
    plan,
    bench,
    profile,
    model,
    bundle,
    data,
    image,
    schema,
    reference,
    drill,
    access,
):
    module.register(app)


def _usage_field(exc: click_errors.UsageError) -> str | None:
    """The option or argument a command-line error is about, as the user typed it."""
    name = getattr(exc, "option_name", None)
    if name:
        return str(name)
    param: Any = getattr(exc, "param", None)
    if param is None:
        return None
    opts = [o for o in getattr(param, "opts", []) if o.startswith("-")]
    if opts:
        return str(max(opts, key=len))
    return str(getattr(param, "metavar", None) or param.name or "").upper() or None


def _exit_usage(out: Output, exc: click_errors.UsageError) -> NoReturn:
    """A command-line error from the parser as our one line: the message, then where help is."""
    if isinstance(exc, click_errors.NoArgsIsHelpError):
        # `infractl` or `infractl drill` alone: the help is the answer, on stdout.
        out.raw(exc.ctx.get_help() + "\n")
        sys.exit(exc.exit_code)
    message = exc.format_message().rstrip(".")
    if exc.ctx is not None:
        message += f" (see `{exc.ctx.command_path} --help`)"
    out.error(message, exit_code=exc.exit_code, field=_usage_field(exc))
    sys.exit(exc.exit_code)


def main() -> None:
    """Run the CLI. Every way out is one line on stderr (and one JSON object on stdout with
    ``--json``) and an exit code: 0 done, 1 failed while working, 2 refused (nothing changed),
    70 a bug in infractl, 130 interrupted. ``--debug`` re-raises with the traceback."""
    no_collection_at_exit()
    argv = sys.argv[1:]
    # Until a command made its Output (it parsed its options), guess --json from the words.
    parsing = Output(json_mode="--json" in (argv[: argv.index("--")] if "--" in argv else argv))
    reset_output()
    set_debug(False)
    try:
        rv = app(standalone_mode=False, prog_name="infractl")
    except InfractlError as exc:
        if debug_requested():
            raise
        out = current_output() or parsing
        out.error(exc.message, exit_code=exc.exit_code, field=exc.field, file=exc.file)
        sys.exit(exc.exit_code)
    except click_errors.UsageError as exc:
        # Never a traceback: the parser's own frames say nothing about the mistake.
        _exit_usage(current_output() or parsing, exc)
    except click_errors.ClickException as exc:
        (current_output() or parsing).error(exc.format_message(), exit_code=exc.exit_code)
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        (current_output() or parsing).error("aborted", exit_code=130)
        sys.exit(130)
    except BrokenPipeError:
        # The reader went away (`infractl logs | head`): not an error worth a line.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except Exception as exc:  # a bug: say so in one line instead of a traceback
        if debug_requested():
            raise
        (current_output() or parsing).error(
            f"internal error: {type(exc).__name__}: {exc} (a bug in infractl; "
            "rerun with --debug for the traceback and report it)",
            exit_code=EXIT_INTERNAL,
        )
        sys.exit(EXIT_INTERNAL)
    sys.exit(rv if isinstance(rv, int) else 0)
