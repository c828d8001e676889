"""A node's elastic agent: torchrun (``torch.distributed.run``, same arguments) whose restarts do
not wait for a worker that cannot answer.

When torch 2.13's agent restarts its workers (a peer failed, a node left or joined) it SIGTERMs
them and SIGKILLs them only after 30 s, hard-coded in ``LocalElasticAgent._stop_workers``. A
worker that answers SIGTERM uses that time to save an emergency checkpoint and exits (see
``trainer.preemption``); one stuck in a collective exits when the collective times out (see
``trainer.watchdog``). A worker that is stopped (SIGSTOP, a frozen container, a debugger) can do
neither: it only holds its node out of the next rendezvous for the full 30 s, which is most of the
restart time after a hang. This agent SIGKILLs stopped workers at once, and every worker once the
rendezvous dropped a peer of their round (``trainer.rendezvous_patch.peer_lost``: they wait on it in a
collective); otherwise workers keep the SIGTERM and its grace period.

    python -m trainer.agent [torchrun options] -m trainer.train [trainer options]

Its rendezvous restarts sooner than torch's (``trainer.rendezvous_patch``). Nothing else of torchrun
changes: preemption (SIGTERM to the agent) still forwards SIGTERM and waits ``--shutdown-timeout``.

With ``--start-method=forkserver`` (run.yaml ``restart.warm``, the default), the workers of ``-m
trainer.train`` are warm: the agent starts a fork server that imports the trainer (torch, DCP:
about 2 s on a CPU node) while the first rendezvous runs, and torchrun forks every worker of every
restart from it (``trainer.warm.main``, which runs ``trainer.train.warm_main`` with the same
arguments and exit codes; the agent itself never imports the trainer). torchrun applies
its start method only to workers it runs as functions; a module runs as a new Python each time.

The agent also holds its node's in-memory checkpoint replicas (``trainer.replica_server``): a server on
the node's ``--local-addr`` that outlives the workers' restarts and answers only requests signed
with the run's key (``$INFRACTL_RUN_KEY_FILE`` names its file; without one there are no replicas);
its workers find it in ``$INFRACTL_REPLICA_ADDR``.

On a node that may be reclaimed (a spot instance: its provider sets ``INFRACTL_SPOT_NOTICE_URL`` to
the instance metadata service), the agent also polls the spot interruption notice, which EC2 posts
two minutes before it takes the instance back, and answers one with that same SIGTERM to itself:
the workers save an emergency checkpoint, this node leaves, and the others go on without it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import psutil
from torch.distributed import run as torchrun
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
from torch.distributed.launcher import api as launcher_api

from infractl import no_collection_at_exit
from infractl.errors import UsageError
from infractl.log import get_logger
from infractl.proc import LAUNCH_LAST_CALL_KEY
from trainer import rendezvous_patch, replica_server, warm
from trainer.errors import REFUSED_EXIT
from trainer.faults import Faults
from trainer.preemption import SPOT_NOTICE_ENV

__all__ = ["StopStoppedWorkersAgent", "main"]

log = get_logger(__name__)

#: Seconds between two looks at the spot interruption notice (what AWS advises), and the most one may take.
_SPOT_POLL_S = 5.0
_METADATA_TIMEOUT_S = 2.0


class StopStoppedWorkersAgent(LocalElasticAgent):
    """LocalElasticAgent whose restart SIGKILLs stopped workers, and all of them once a peer of
    their round was dropped, before the usual shutdown, and whose shutdown lets warm workers that
    returned exit."""

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # A warm worker that returned (it saved and stopped on the SIGTERM that comes next) waits
        # for this event, set once torchrun read every worker's result, before it exits; a
        # shutdown reads none, and would wait out its timeout, then SIGKILL the worker.
        finished = getattr(self._pcontext, "_worker_finished_event", None)
        if finished is not None:
            finished.set()
        super()._shutdown(death_sig, timeout)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        pids = self._pcontext.pids().values() if self._pcontext is not None else ()
        # Workers waiting on a peer the rendezvous dropped sit in a collective, deaf to SIGTERM
        # until it times out, and cannot save without that peer (trainer.rendezvous_patch.peer_lost).
        waiting = bool(rendezvous_patch.peer_lost(worker_group.spec.rdzv_handler))
        for pid in pids:
            stopped = _stopped(pid)
            if waiting or stopped:
                reason = "it is stopped and cannot answer SIGTERM" if stopped else "a peer of its round is gone"
                log.warning("killing worker %d: %s", pid, reason)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        super()._stop_workers(worker_group)


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def spot_notice(metadata_url: str) -> str | None:
    """The instance's spot interruption notice (its JSON), or None while there is none or the
    metadata service does not answer. IMDSv2: a session token first."""
    try:
        token_request = urllib.request.Request(
            f"{metadata_url}/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"}
        )
        with urllib.request.urlopen(token_request, timeout=_METADATA_TIMEOUT_S) as answer:
            token = answer.read().decode()
        notice_request = urllib.request.Request(
            f"{metadata_url}/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": token}
        )
        with urllib.request.urlopen(notice_request, timeout=_METADATA_TIMEOUT_S) as answer:
            return str(answer.read().decode())
    except (urllib.error.URLError, OSError):  # 404: no notice yet; no answer: ask again later
        return None


def _watch_spot_notice(metadata_url: str) -> None:
    while (notice := spot_notice(metadata_url)) is None:
        time.sleep(_SPOT_POLL_S)
    log.warning("spot interruption notice %s: preempting this node", notice)
    os.kill(os.getpid(), signal.SIGTERM)


#: The module whose workers may be warm, and the function they then run.
_WORKER_MODULE = "trainer.train"
_torchrun_config = torchrun.config_from_args


def _warm_config(args: Any) -> tuple[Any, Callable[..., None] | str, list[str]]:
    """torchrun's launch config, with ``-m trainer.train`` run as warm workers when the start
    method is forkserver (see the module docstring)."""
    config, entrypoint, entry_args = _torchrun_config(args)
    if config.start_method != "forkserver" or not args.module or args.training_script != _WORKER_MODULE:
        return config, entrypoint, entry_args
    multiprocessing.set_forkserver_preload([_WORKER_MODULE])
    multiprocessing.forkserver.ensure_running()  # it imports the trainer while the rendezvous runs
    return config, warm.main, list(args.training_script_args)


def _options(argv: list[str]) -> tuple[str, float | None]:
    """From torchrun's arguments: ``--local-addr`` (the address this node's peers reach it at, else
    loopback) and the launch's last call in ``--rdzv-conf`` (see ``trainer.rendezvous_patch``)."""
    parsed, _ = torchrun.get_args_parser().parse_known_args(argv)
    launch_last_call = _parse_rendezvous_config(parsed.rdzv_conf).get(LAUNCH_LAST_CALL_KEY)
    return str(parsed.local_addr or "127.0.0.1"), None if launch_last_call is None else float(launch_last_call)


def main() -> None:
    no_collection_at_exit()
    # torchrun builds its agent from this module attribute (torch.distributed.launcher.api.launch_agent).
    launcher_api.LocalElasticAgent = StopStoppedWorkersAgent  # type: ignore[attr-defined]
    torchrun.config_from_args = _warm_config
    local_addr, launch_last_call = _options(sys.argv[1:])
    rendezvous_patch.install(launch_last_call)
    timer_file = os.environ.get("TORCHELASTIC_TIMER_FILE")  # trainer/watchdog.py's TIMER_FILE_ENV
    if timer_file:  # torchrun's timer server makes its pipe there, not the folder
        os.makedirs(os.path.dirname(timer_file), mode=0o700, exist_ok=True)
    try:
        faults = Faults.from_environ(os.environ)
    except UsageError as exc:
        log.error(exc.message)
        sys.exit(REFUSED_EXIT)
    # Before the workers (and the fork server they are forked from) copy this environment.
    server = replica_server.serve(local_addr, os.environ, corrupt_peer_copies=faults.corrupt_peer_replicas)
    if server is not None:
        os.environ[replica_server.REPLICA_ADDR_ENV] = server.address
    metadata_url = os.environ.get(SPOT_NOTICE_ENV)
    if metadata_url:
        threading.Thread(target=_watch_spot_notice, args=(metadata_url,), name="spot-notice", daemon=True).start()
    torchrun.main()


if __name__ == "__main__":
    main()
