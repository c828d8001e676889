"""A node's elastic agent: torchrun (``torch.distributed.run``, same arguments) whose restarts do
not wait for a worker that cannot answer.

When torch 2.13's agent restarts its workers (a peer failed, a node left or joined) it SIGTERMs
them and SIGKILLs them only after 30 s, hard-coded in ``LocalElasticAgent._stop_workers``. A
worker that answers SIGTERM uses that time to save an emergency checkpoint and exits (see
``trainer.preemption``); one stuck in a collective exits when the collective times out (half the
step timeout). A worker that is stopped (SIGSTOP, a frozen container, a debugger) can do neither:
it only holds its node out of the next rendezvous for the full 30 s, which is most of the restart
time after a hang. This agent SIGKILLs stopped workers at once, and every other worker keeps the
SIGTERM and its grace period.

    python -m trainer.agent [torchrun options] -m trainer.train [trainer options]

Nothing else of torchrun changes: preemption (SIGTERM to the agent) still forwards SIGTERM and
waits ``--shutdown-timeout``.
"""

from __future__ import annotations

import contextlib
import os
import signal

import psutil
from torch.distributed import run as torchrun
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.launcher import api as launcher_api

from infractl.log import get_logger

__all__ = ["StopStoppedWorkersAgent", "main"]

log = get_logger(__name__)


class StopStoppedWorkersAgent(LocalElasticAgent):
    """LocalElasticAgent whose restart SIGKILLs stopped workers before the usual shutdown."""

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        pids = self._pcontext.pids().values() if self._pcontext is not None else ()
        for pid in pids:
            if _stopped(pid):
                log.warning("worker %d is stopped and cannot answer SIGTERM: killing it", pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        super()._stop_workers(worker_group)


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def main() -> None:
    # torchrun builds its agent from this module attribute (torch.distributed.launcher.api.launch_agent).
    launcher_api.LocalElasticAgent = StopStoppedWorkersAgent  # type: ignore[attr-defined]
    torchrun.main()


if __name__ == "__main__":
    main()
