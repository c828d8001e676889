"""The trainer's own errors. The node side has no CLI: ``trainer.train`` turns these into its exit
codes (see its docstring), not the CLI's error families."""

from __future__ import annotations

__all__ = ["REFUSED_EXIT", "TrainerError", "RunRefused"]

#: The exit code of a node's process (agent or worker) that refuses to start: a bad spec, bad
#: arguments, a drill's hook outside a rehearsal, or a run that cannot go on as specified; nothing
#: was written.
REFUSED_EXIT = 2


class TrainerError(Exception):
    """Base class of the trainer's errors."""


class RunRefused(TrainerError):
    """The run cannot go on as specified (a split shorter than one sample, data that changed
    under a run): every rank says so in one line and exits 2 before it writes anything."""
