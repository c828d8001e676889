"""The trainer's own errors. The node side has no CLI: ``trainer.train`` turns these into its exit
codes (see its docstring), not the CLI's error families."""

from __future__ import annotations

__all__ = ["TrainerError", "RunRefused"]


class TrainerError(Exception):
    """Base class of the trainer's errors."""


class RunRefused(TrainerError):
    """The run cannot go on as specified (a split shorter than one sample, data that changed
    under a run): every rank says so in one line and exits 2 before it writes anything."""
