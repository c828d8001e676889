"""The drills' hooks: the faults the trainer injects into itself on purpose, read in this one place.

Each hook is an environment variable of a node's agent and workers. Only a rehearsal may carry
one: a run whose run.yaml says ``rehearsal: true`` (the launcher then sets ``INFRACTL_REHEARSAL=1``
for its agents and workers, and passes them the hooks its ``env:`` lists; ``infractl train``
refuses a hook in the ``env:`` of any other run), or a test that starts the trainer itself and
sets ``INFRACTL_REHEARSAL=1`` beside the hooks. A process that finds a hook set without it refuses
to start, in one line naming the variable (``UsageError``): a variable left in an operator's shell
or a node's environment never injects a fault into a real run.

``INFRACTL_CKPT_UPLOAD_DELAY_S`` (seconds, ``upload_delay_s``)
    Every save sleeps that long after its shards are uploaded, before the manifest is gathered
    and committed (``trainer.checkpoint``): a kill lands while a step's files are in the store
    and the step is not committed. Set by the kill-during-checkpoint drill's test
    (tests/test_drill.py), the checkpoint tests (tests/test_checkpoint.py: a job killed while
    uploading, what a save blocks) and the store outage tests (tests/test_faults.py).
``INFRACTL_CORRUPT_WEIGHTS_AT_STEP`` (a step, ``corrupt_weights_at_step``)
    Every weight is multiplied by ``CORRUPT_FACTOR`` on every rank right after that step's update
    (``trainer.engine``), as a bad update does (silent data corruption, a poisoned batch): the
    loss jumps from the next step on and the checkpoints after it hold the bad weights, which a
    rollback sets aside. Set by the rollback runbook's test (tests/test_runbooks.py).
``INFRACTL_REPLICA_CORRUPT=peer`` (``corrupt_peer_replicas``)
    The node's agent flips one byte of every replica copy it holds for another node, after
    checking it on receipt (``trainer.replica_server``), as memory corrupted at rest would: a
    restart must pass over that copy. Set by the corrupt replica drill's test
    (tests/test_drill.py).

An empty variable is an unset one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from infractl.errors import UsageError

__all__ = [
    "CORRUPT_FACTOR",
    "CORRUPT_WEIGHTS_ENV",
    "HOOKS",
    "REHEARSAL_ENV",
    "REPLICA_CORRUPT_ENV",
    "UPLOAD_DELAY_ENV",
    "Faults",
    "NO_FAULTS",
]

#: Set to ``1`` on a rehearsal's processes: the hooks below may be set there, and nowhere else.
REHEARSAL_ENV = "INFRACTL_REHEARSAL"
UPLOAD_DELAY_ENV = "INFRACTL_CKPT_UPLOAD_DELAY_S"
CORRUPT_WEIGHTS_ENV = "INFRACTL_CORRUPT_WEIGHTS_AT_STEP"
REPLICA_CORRUPT_ENV = "INFRACTL_REPLICA_CORRUPT"
#: Every hook (a run.yaml's ``env:`` may list these in a rehearsal only).
HOOKS = (UPLOAD_DELAY_ENV, CORRUPT_WEIGHTS_ENV, REPLICA_CORRUPT_ENV)
#: What the injected bad update multiplies every weight by.
CORRUPT_FACTOR = 8.0


@dataclass(frozen=True)
class Faults:
    """The faults this process injects (none by default): the module docstring says each one."""

    upload_delay_s: float = 0.0
    """Seconds each save sleeps between its upload and its commit (``INFRACTL_CKPT_UPLOAD_DELAY_S``)."""
    corrupt_weights_at_step: int | None = None
    """The step after whose update every weight goes bad (``INFRACTL_CORRUPT_WEIGHTS_AT_STEP``)."""
    corrupt_peer_replicas: bool = False
    """Whether the agent corrupts the replica copies it holds for other nodes (``INFRACTL_REPLICA_CORRUPT``)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Faults:
        """The hooks ``environ`` sets; ``UsageError`` naming the first one that is set outside a
        rehearsal, or set to a value it does not take."""
        hooks = {name: environ[name].strip() for name in HOOKS if environ.get(name, "").strip()}
        if hooks and environ.get(REHEARSAL_ENV) != "1":
            raise UsageError(
                "a fault-injection hook for drills and tests (trainer/faults.py) is set, and this run is not a "
                f"rehearsal ({REHEARSAL_ENV} is not 1): unset it, or give the run.yaml rehearsal: true",
                field=next(iter(hooks)),
            )
        return cls(
            upload_delay_s=_seconds(hooks.get(UPLOAD_DELAY_ENV)),
            corrupt_weights_at_step=_step(hooks.get(CORRUPT_WEIGHTS_ENV)),
            corrupt_peer_replicas=_peer(hooks.get(REPLICA_CORRUPT_ENV)),
        )


def _seconds(raw: str | None) -> float:
    if raw is None:
        return 0.0
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        raise UsageError(f"must be a number of seconds, at least 0, got {raw!r}", field=UPLOAD_DELAY_ENV)
    return seconds


def _step(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        step = int(raw)
    except ValueError:
        step = -1
    if step < 0:
        raise UsageError(f"must be a step number, got {raw!r}", field=CORRUPT_WEIGHTS_ENV)
    return step


def _peer(raw: str | None) -> bool:
    if raw is not None and raw != "peer":
        raise UsageError(f"must be 'peer', got {raw!r}", field=REPLICA_CORRUPT_ENV)
    return raw is not None


#: What every run but a rehearsal injects: nothing.
NO_FAULTS = Faults()
