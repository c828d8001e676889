"""The one output object: rich on a terminal, plain lines when piped, JSON with ``--json``.

Commands report through ``Output`` and never branch on where output goes. Human text goes to
stderr (so stdout stays clean for ``--json`` and for piping), results to stdout.

Everything printed here is literal text: both consoles run with markup and emoji codes off, so a
path, URI or value that looks like ``[red]`` or ``:smile:`` prints as itself and can never break
the printer, and every message line is passed through ``printable`` (control characters, newlines
and escape sequences become visible escapes: one line, no terminal tricks). Styling is applied
to our own prefixes only, through ``Text`` spans.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console, RenderableType
from rich.text import Text

if TYPE_CHECKING:  # rich.progress is imported where a bar is drawn: every CLI command imports this module
    from rich.progress import Progress

__all__ = ["Output", "StepProgress", "printable"]

# A message line longer than this is cut: one line must stay readable (a 1 MiB config key, say).
_MAX_LINE = 2000


def printable(text: str, *, limit: int = _MAX_LINE) -> str:
    """``text`` as one printable line: every character that is not printable (newlines, tabs,
    escape sequences, NUL, lone surrogates) becomes its Python escape; longer than ``limit``
    characters, the middle is cut."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    if len(text) > limit:
        half = limit // 2
        text = f"{text[:half]}…({len(text) - 2 * half} characters cut)…{text[-half:]}"
    return text


def _console(*, stderr: bool) -> Console:
    return Console(stderr=stderr, highlight=False, markup=False, emoji=False, soft_wrap=stderr)


class StepProgress:
    """Training progress: a bar on a terminal, a plain line every few seconds otherwise."""

    def __init__(self, out: Output, progress: Progress | None, task: Any, total: int) -> None:
        self._out = out
        self._progress = progress
        self._task = task
        self._total = total
        self._last_line = 0.0
        self._last_step = -1

    def update(self, step: int, *, loss: float | None, tokens_per_s: float | None, world_size: int | None) -> None:
        shown_loss = f"{loss:.4f}" if loss is not None else "-"
        tps = f"{tokens_per_s:,.0f}" if tokens_per_s else "-"
        world = str(world_size or "-")
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=shown_loss, tps=tps, world=world)
        elif step != self._last_step and (time.monotonic() - self._last_line > 5 or step >= self._total):
            self._out.info(f"step {step}/{self._total} loss {shown_loss} tokens/s {tps} world {world}")
            self._last_line = time.monotonic()
        self._last_step = step


class Output:
    def __init__(self, *, json_mode: bool = False) -> None:
        self.json_mode = json_mode
        self.err = _console(stderr=True)
        self.out = _console(stderr=False)

    def _line(self, prefix: str, style: str, message: str) -> None:
        line = Text(prefix, style=style) if prefix else Text()
        line.append(printable(message))
        self.err.print(line)

    def info(self, message: str) -> None:
        if not self.json_mode:
            self._line("", "", message)

    def success(self, message: str) -> None:
        if not self.json_mode:
            self._line("✓ ", "green", message)

    def warn(self, message: str) -> None:
        self._line("warning: ", "yellow", message)

    def error(self, message: str, *, exit_code: int, field: str | None = None, file: str | None = None) -> None:
        """A refused or failed command: one line on stderr, and with ``--json`` one
        ``{"error": {...}}`` object on stdout so scripts never parse prose."""
        self._line("error: ", "red", message)
        if self.json_mode:
            error: dict[str, Any] = {"message": message, "exit_code": exit_code}
            error |= {k: v for k, v in (("field", field), ("file", file)) if v is not None}
            self.result({"error": error})

    def raw(self, text: str) -> None:
        """Write text to stdout exactly as given (log files, already formatted)."""
        sys.stdout.write(text)
        sys.stdout.flush()

    def result(self, data: Any, human: RenderableType | None = None) -> None:
        """Print a command's result: JSON on stdout with ``--json``, else the human form."""
        if self.json_mode:
            sys.stdout.write(json.dumps(data, indent=1, default=str) + "\n")
            sys.stdout.flush()
        elif human is not None:
            self.out.print(human)

    @contextmanager
    def step_progress(self, total: int, *, description: str) -> Iterator[StepProgress]:
        if self.json_mode or not self.err.is_terminal:
            yield StepProgress(self, None, None, total)
            return
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        progress = Progress(
            TextColumn("{task.description}", style="bold", markup=False),
            BarColumn(),
            TextColumn("step {task.completed}/{task.total}", markup=False),
            TextColumn("loss {task.fields[loss]}", markup=False),
            TextColumn("{task.fields[tps]} tok/s", markup=False),
            TextColumn("world {task.fields[world]}", markup=False),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.err,
        )
        with progress:
            task = progress.add_task(printable(description), total=total, loss="-", tps="-", world="-")
            yield StepProgress(self, progress, task, total)
