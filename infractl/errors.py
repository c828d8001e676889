"""Typed errors: every user-facing failure is one of these, printed as one line by the CLI.

An error may name the ``file`` and the ``field`` (a config field path, a command-line option or
argument) it is about; its message then starts with them (``run.yaml: model.hidden: ...``) and
``--json`` reports them as their own keys.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "InfractlError",
    "UsageError",
    "ConfigError",
    "StateError",
    "LockedError",
    "InfraError",
    "ConfigureError",
    "TrainingError",
    "Interrupted",
    "StoreError",
]


class InfractlError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with."""

    exit_code = 1

    def __init__(self, message: str, *, field: str | None = None, file: str | None = None) -> None:
        where = ": ".join(part for part in (file, field) if part)
        full = f"{where}: {message}" if where else message
        super().__init__(full)
        self.message = full
        self.field = field
        self.file = file

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        """The ``{"error": ...}`` object ``--json`` prints for this error."""
        error: dict[str, Any] = {"message": self.message, "exit_code": self.exit_code}
        if self.field is not None:
            error["field"] = self.field
        if self.file is not None:
            error["file"] = self.file
        return {"error": error}


class Interrupted(InfractlError):
    """The command was interrupted (Ctrl-C, its terminal closed, SIGTERM) and stopped what it had
    started; the message says which command finishes or undoes the rest."""

    exit_code = 130


class UsageError(InfractlError):
    """Bad CLI use or bad input: nothing was changed."""

    exit_code = 2


class ConfigError(UsageError):
    """A config file is missing, unreadable or invalid."""


class StateError(UsageError):
    """The command does not fit the cluster's state (train before up, teardown of nothing)."""


class LockedError(UsageError):
    """Another infractl command holds the cluster's lock."""


class InfraError(InfractlError):
    """Terraform failed."""


class ConfigureError(InfractlError):
    """Ansible failed (including the runtime check and the health gate)."""


class TrainingError(InfractlError):
    """The training job failed."""


class StoreError(InfractlError):
    """The object store failed: ``store <uri>: <cause>``. Every backend raises this family (see
    ``infractl.store``), never its client library's own errors."""

    def __init__(self, uri: str, cause: str) -> None:
        super().__init__(f"store {uri}: {cause}")
        self.uri = uri
        self.cause = cause

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.uri, self.cause))
