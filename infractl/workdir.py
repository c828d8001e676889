"""A node's work directory: what lives where in it, and who may read it (SECURITY.md).

    <workdir>/            root's; the access roles' groups may only pass through (no default ACL)
      logs/               the agents' logs, written by root: the roles read them, nobody else writes
      private/            what root reads, sources or writes through: root's alone
        network.env       the network role's variables (read as a list of known keys)
        runs/<run>/       spec.json, run.key (the run's replica key), agent.env (gone once read)
      work/               the trainer's own scratch (``--workdir``): checkpoint staging and
                          restores, profiles, TensorBoard files, the step watchdog's pipe

The playbooks name the same folders (``base_directories``, ``network_env_file``); the access
role's ACLs give the roles' groups what ``infractl.access.roles.ROLES`` says, and nothing under
``private/`` or ``work/``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DIRECTORIES", "LOGS", "PRIVATE", "WORK", "network_env", "run_log", "run_private", "timer_file"]

LOGS = "logs"
PRIVATE = "private"
WORK = "work"
#: The folders ``up`` makes in every node's work directory.
DIRECTORIES = (LOGS, PRIVATE, WORK)


def network_env(workdir: Path) -> Path:
    """The network role's variables for the node's agents."""
    return workdir / PRIVATE / "network.env"


def run_log(workdir: Path, run: str) -> Path:
    """The log of the run's agent and workers on the node."""
    return workdir / LOGS / f"{run}.log"


def run_private(workdir: Path, run: str) -> Path:
    """What the launcher hands a run's agent on the node: its spec, its key, its environment."""
    return workdir / PRIVATE / "runs" / run


def timer_file(workdir: Path, run: str) -> Path:
    """The named pipe of the run's step watchdog (the agent makes it; its workers write to it)."""
    return workdir / WORK / "runs" / run / "watchdog.fifo"
