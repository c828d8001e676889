"""Typed errors: every user-facing failure is one of these, printed as one line by the CLI."""

from __future__ import annotations

__all__ = [
    "InfractlError",
    "UsageError",
    "ConfigError",
    "StateError",
    "LockedError",
    "InfraError",
    "ConfigureError",
    "TrainingError",
]


class InfractlError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


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
