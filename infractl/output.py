"""The one output object: rich on a terminal, plain lines when piped, JSON with ``--json``.

Commands report through ``Output`` and never branch on where output goes. Human text goes to
stderr (so stdout stays clean for ``--json`` and for piping), results to stdout.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console, RenderableType
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

__all__ = ["Output", "StepProgress"]


class StepProgress:
    """Training progress: a bar on a terminal, a plain line every few seconds otherwise."""

    def __init__(self, out: "Output", progress: Progress | None, task: Any, total: int) -> None:
        self._out = out
        self._progress = progress
        self._task = task
        self._total = total
        self._last_line = 0.0
        self._last_step = -1

    def update(self, step: int, *, loss: float | None, tokens_per_s: float | None, world_size: int | None) -> None:
        fields = {
            "loss": f"{loss:.4f}" if loss is not None else "-",
            "tps": f"{tokens_per_s:,.0f}" if tokens_per_s else "-",
            "world": world_size or "-",
        }
        if self._progress is not None:
            self._progress.update(self._task, completed=step, **fields)
        elif step != self._last_step and (time.monotonic() - self._last_line > 5 or step >= self._total):
            self._out.info(f"step {step}/{self._total} loss {fields['loss']} tokens/s {fields['tps']} world {fields['world']}")
            self._last_line = time.monotonic()
        self._last_step = step


class Output:
    def __init__(self, *, json_mode: bool = False) -> None:
        self.json_mode = json_mode
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)
        self.out = Console(highlight=False)

    def info(self, message: str) -> None:
        if not self.json_mode:
            self.err.print(message, markup=False)

    def success(self, message: str) -> None:
        if not self.json_mode:
            self.err.print(f"[green]✓[/green] {message}")

    def warn(self, message: str) -> None:
        self.err.print(f"[yellow]warning:[/yellow] {message}")

    def raw(self, text: str) -> None:
        """Write text to stdout exactly as given (log files, already formatted)."""
        sys.stdout.write(text)
        sys.stdout.flush()

    def result(self, data: Any, human: RenderableType | None = None) -> None:
        """Print a command's result: JSON on stdout with ``--json``, else the human form."""
        if self.json_mode:
            sys.stdout.write(json.dumps(data, indent=1, default=str) + "\n")
        elif human is not None:
            self.out.print(human)

    @contextmanager
    def step_progress(self, total: int, *, description: str) -> Iterator[StepProgress]:
        if self.json_mode or not self.err.is_terminal:
            yield StepProgress(self, None, None, total)
            return
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("step {task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("world {task.fields[world]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.err,
        )
        with progress:
            task = progress.add_task(description, total=total, loss="-", tps="-", world="-")
            yield StepProgress(self, progress, task, total)
