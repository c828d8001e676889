"""Entry point on every node, started by torchrun::

    torchrun ... -m trainer.train --spec SPEC.json --store STORE_URI --run-id RUN_ID --workdir DIR

Exit codes: 0 when the run reached ``spec.steps`` (its last step committed), or when this
rank got SIGTERM (preemption) and the emergency checkpoint committed; ``PEER_PREEMPTED_EXIT``
(75) when another rank was preempted and this one saved with it: its agent restarts it to
continue without the preempted node; 2 for a bad spec or bad arguments (one line on stderr,
nothing written); anything else is a crash.

What each rank logs (every line carries ``rank=``): the runbooks send people to the failed
node's log, so each rank tells its own story there, and only what the whole job shares is left
to rank 0, so the other nodes' logs stay short.

- Every rank, at info, its lifecycle: ``rank_joined`` (rank, local rank, world size, attempt,
  restart count, node); ``resumed`` (step, ``source`` ``store`` or ``replica``, the saved world
  size and the reason that step was saved) or ``starting`` (step 0); per save
  ``checkpoint_staged`` (training goes on) and ``checkpoint_committed`` (step); last ``stopped``
  with ``reason=`` ``finished`` (step), ``preempted`` or ``peer_preempted`` (the committed step),
  ``refused`` or ``crashed`` (``error=`` the exception, at error level). Also per rank:
  ``preempted``, ``watchdog_stopped``, profiling's ``profile_*``. A rank killed outright (the
  watchdog's SIGKILL, a dead node) writes no ``stopped`` line: its log ends there, and the
  agent's lines follow.
- Rank 0 only, the job-wide events and anything per step: ``environment``, ``config_changed``,
  ``rng_not_restored``, ``watchdog_started``, ``checkpoint_started``, ``checkpoint_skipped``,
  ``checkpoint_failed``, ``checkpoint_invalid``, ``checkpoints_cleaned``, the replicas'
  ``replica_skipped``, ``replica_failed``, ``replica_incomplete``, ``replica_index_failed``,
  ``replica_invalid`` and ``replicas_off``, ``preemption_bound``, ``collective_timeout``,
  the metrics writer's lines and ``finished``. No rank logs every step.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import structlog
import torch
from torch.distributed.elastic.multiprocessing.errors import record

from infractl import no_collection_at_exit
from infractl.config import RunSpec, check_layout, load_run_json
from infractl.errors import UsageError
from infractl.log import get_logger, setup
from infractl.proc import NODE_ENV
from infractl.store import Store, open_store
from trainer import memprobe
from trainer.distributed import DistEnv, destroy_process_group, init_process_group
from trainer.engine import Preempted, Trainer
from trainer.errors import REFUSED_EXIT, RunRefused
from trainer.faults import Faults
from trainer.preemption import PEER_PREEMPTED_EXIT

__all__ = ["main", "warm_main"]

log = get_logger("trainer")

# prctl(2): the signal this process gets when its parent dies (0: none).
_PR_SET_PDEATHSIG = 1


def _run_id(value: str) -> str:
    if not value or "/" in value or value in (".", ".."):
        raise argparse.ArgumentTypeError(f"not a run id: {value!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.split("::")[0])
    parser.add_argument("--spec", type=Path, required=True, help="RunSpec as JSON (RunSpec.model_dump_json()).")
    parser.add_argument("--store", required=True, help="Store URI for checkpoints and metrics (file:///...).")
    parser.add_argument("--run-id", type=_run_id, required=True, help="Run id: the store prefix runs/<run-id>/.")
    parser.add_argument("--workdir", type=Path, required=True, help="This node's scratch directory.")
    parser.add_argument(
        "--measure-memory",
        type=_steps,
        metavar="STEPS",
        help="Instead of training: run STEPS steps and report the memory each component took (plan --measure).",
    )
    return parser


def _steps(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"not a positive step count: {value!r}")
    return int(value)


@record
def main(argv: Sequence[str] | None = None) -> int:
    no_collection_at_exit()
    args = _parser().parse_args(argv)
    env = DistEnv.from_environ()
    # Every rank logs at info; which events each rank logs is decided per event (module doc).
    setup(level=logging.INFO)
    structlog.contextvars.bind_contextvars(rank=env.rank)
    try:
        spec = load_run_json(args.spec)
        # Checked before joining the group, so a bad spec fails fast instead of in a collective,
        # and before touching the store, so it changes nothing. The launcher checked every world
        # size of the node range; this catches a layout started by hand on a world it cannot use.
        check_layout(spec, [(env.world_size, f"{env.world_size} rank(s)")], file=str(args.spec))
        faults = Faults.from_environ(os.environ)
        store = open_store(args.store, field="--store")
        # Bad credentials or an unreachable store: one clear line now, not a traceback mid-run.
        store.check()
    except UsageError as exc:
        # Every rank says it: torchrun stops the others as soon as the first one exits.
        log.error(exc.message)
        log.info("stopped", reason="refused")
        return REFUSED_EXIT

    device = init_process_group(env)
    log.info(
        "rank_joined",
        local_rank=env.local_rank,
        world_size=env.world_size,
        attempt=env.attempt,
        restart_count=env.restart_count,
        node=os.environ.get(NODE_ENV),
        device=str(device),
    )
    try:
        step = _train(
            spec,
            store=store,
            run_id=args.run_id,
            workdir=args.workdir,
            env=env,
            device=device,
            faults=faults,
            measure_steps=args.measure_memory,
        )
    except BaseException as exc:
        # Drop the frames' locals so the trainer can be freed before the group (see _train).
        traceback.clear_frames(exc.__traceback__)
        code = _stopped_by(exc)
        if code is None:
            raise
        return code
    else:
        log.info("stopped", reason="finished", step=step)
        return 0
    finally:
        gc.collect()
        destroy_process_group()


def _stopped_by(exc: BaseException) -> int | None:
    """Log why training ended with ``exc``; return the exit code, or None for a crash (re-raise)."""
    if isinstance(exc, Preempted):
        log.info("stopped", reason="preempted" if exc.signalled else "peer_preempted", step=exc.step)
        return 0 if exc.signalled else PEER_PREEMPTED_EXIT
    if isinstance(exc, RunRefused):
        log.error(str(exc))  # e.g. a corpus too short for one sample
        log.info("stopped", reason="refused")
        return REFUSED_EXIT
    # The traceback follows on stderr (torchrun's error file too); this line is the one to grep.
    first_line = (str(exc).strip().splitlines() or [""])[0][:300]
    log.error("stopped", reason="crashed", error=f"{type(exc).__name__}: {first_line}")
    return None


def _train(
    spec: RunSpec,
    *,
    store: Store,
    run_id: str,
    workdir: Path,
    env: DistEnv,
    device: torch.device,
    faults: Faults,
    measure_steps: int | None = None,
) -> int:
    # The Trainer lives only in this frame. DDP's reducer holds a reference to the gloo
    # group; if the reducer outlives destroy_process_group, the group's destructor runs
    # from it with the GIL held and joins gloo threads that may be waiting for the GIL:
    # a deadlock at exit. Freed first, the group is destroyed by destroy_process_group,
    # which releases the GIL. Returns the last step trained.
    if measure_steps is None:
        return Trainer(spec, store=store, run_id=run_id, workdir=workdir, env=env, device=device, faults=faults).train()
    baseline = memprobe.start()
    trainer = Trainer(spec, store=store, run_id=run_id, workdir=workdir, env=env, device=device, faults=faults)
    memprobe.measure(trainer, steps=measure_steps, store=store, run_id=run_id, baseline_rss=baseline)
    return measure_steps


def warm_main(*argv: str) -> None:
    """A warm worker: what torchrun runs in a process forked from the node's fork server, which
    imported this module already (``trainer.agent``; run.yaml ``restart.warm``). As ``python -m
    trainer.train ARGV``, exit codes included; a return is exit code 0 (torchrun waits for the
    return value of a worker it forked)."""
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # as python -u
    # torch asks the kernel to SIGINT a worker it forked when the worker's parent dies: that is the
    # fork server, which a SIGTERM to every process of the node (a machine shutting down) ends
    # before this rank could save its emergency checkpoint. The agent stops its workers itself.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 0)
    try:
        code = main(argv)
    except Exception:
        _crash()
    if code:
        _exit(code)


def _crash() -> NoReturn:
    """Report the exception being handled and end the process now."""
    traceback.print_exc()
    _exit(1)


def _exit(code: int) -> NoReturn:
    """End the process now, without the interpreter's exit: that joins DCP's save thread, which
    may be blocked in a collective with a hung or dead peer for the checkpoint group's timeout
    (30 minutes). The agent restarts this rank only once it has exited."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    try:
        code = main()
    except Exception:  # @record has reported it to torchrun; SystemExit (argparse) passes
        _crash()
    sys.exit(code)
