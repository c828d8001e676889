"""The one logger setup, shared by the CLI and the trainer (structlog; console or JSON lines)."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # structlog is imported where a logger is made: every CLI command imports this module
    import structlog

__all__ = ["LogFormat", "setup", "get_logger", "LOG_FORMAT_ENV"]

LogFormat = Literal["console", "json"]

#: Environment variable through which the CLI hands its log format to the trainers it launches.
LOG_FORMAT_ENV = "INFRACTL_LOG_FORMAT"


def setup(fmt: LogFormat | None = None, *, level: int = logging.INFO) -> None:
    """Route structlog to stderr as console lines or JSON lines (``fmt`` or $INFRACTL_LOG_FORMAT)."""
    import structlog

    fmt = fmt or os.environ.get(LOG_FORMAT_ENV, "console")  # type: ignore[assignment]
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # One write per line: ranks on a node share its log file, and print() writes the line and
        # its newline apart on an unbuffered stderr (PYTHONUNBUFFERED), interleaving two ranks' lines.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    import structlog

    return structlog.get_logger(name)  # type: ignore[no-any-return]
