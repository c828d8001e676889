"""torch 2.13's dynamic rendezvous (torchrun's ``c10d`` backend), changed where it sets how long a
restart takes. ``install()`` patches it in the agent's process (``trainer.agent``), before torchrun
makes its handler; torch is pinned (constraints.txt) and tests/test_rendezvous.py checks each
change against the pinned version.

After a node dies, the survivors' agents leave the finished round and wait for the next; it opens
once the dead node, still a participant, is dropped for missing its keep-alives, and it closes
``last_call_timeout`` after ``nodes.min`` nodes joined. Seven changes:

- **Keep-alives every interval.** torch sends one only when the last is at least one interval
  old, from a timer of that same interval: a tick a little early skips its keep-alive, and a live
  node's keep-alives come two intervals apart. A dead node must then miss more intervals before it
  can be dropped safely. Here a tick sends one when the last is half an interval old.
- **Polls every 0.25 s, not every second,** while a node waits for a round to open or close.
- **A round after the first closes once every live node joined it,** without waiting out the
  last call: live nodes are those with keep-alives in the shared state (a dead node's expired and
  were dropped; a node still in the finished round has them), so nobody is left out. The first
  round of a launch keeps the last call: its nodes have not all sent a keep-alive yet.
- **A launch's first round waits longer for its nodes** (``launch_last_call`` in ``--rdzv-conf``,
  run.yaml ``restart.launch_wait_s``) than a restart's round waits for a live node that does not
  join (``last_call_timeout``, ``restart.last_call_s``): the agents of a launch start seconds
  apart on a loaded machine, and a node left out of the first round restarts the run to join it.
- **A node drops no peer right after it could not reach the shared state.** torch drops a node
  whose last keep-alive is older than ``keep_alive_interval x keep_alive_max_attempt`` by the
  syncing node's clock: when the rendezvous server stalls (a loaded machine), every keep-alive
  ages alike, and the first node to sync afterwards dropped all the others and trained alone.
  Here a node whose syncs paused for more than two intervals waits one expiry of steady syncs
  before it judges its peers' keep-alives again; they have resumed by then.
- **A node the rendezvous dropped while it was alive restarts its workers** (a membership change,
  as when a node waits to join): its keep-alives came too late (the machine stalled), and it would
  otherwise train on alone beside the round the others form without it.
- **A node whose round lost a peer restarts its workers at once** (``peer_lost``): a peer whose
  keep-alives stopped (its link is down, its host lost power) sends no TCP reset, and the workers
  waiting on it in a collective would otherwise wait out the collective timeout. Its agent
  SIGKILLs them (``trainer.agent``): they cannot answer SIGTERM inside a collective, and they
  cannot save without the peer. A membership change, as torch counts it: no restart is spent.
  A peer that left the round to restart its own workers (they failed) looks the same in the
  shared state, and is handled the same: the workers here could not finish a step without it.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import dynamic_rendezvous as torch_rendezvous
from torch.distributed.elastic.rendezvous import utils as torch_rendezvous_utils

from infractl.log import get_logger

__all__ = ["POLL_S", "install", "peer_lost"]

log = get_logger(__name__)

#: Seconds between two looks at the shared state while a node waits for a round (torch: 1).
POLL_S = 0.25
#: How long a launch's first round waits for its nodes (``infractl.proc.LAUNCH_LAST_CALL_KEY``),
#: set by install(); None keeps torch's last call for the first round too.
_launch_last_call: timedelta | None = None

_Action = torch_rendezvous._Action
_torch_delay = torch_rendezvous_utils._delay
_TorchJoinOp = torch_rendezvous._RendezvousJoinOp
_torch_num_nodes_waiting = torch_rendezvous.DynamicRendezvousHandler.num_nodes_waiting
_torch_next_rendezvous = torch_rendezvous.DynamicRendezvousHandler.next_rendezvous
_TorchStateHolder = torch_rendezvous._BackendRendezvousStateHolder
_torch_sanitize = _TorchStateHolder._sanitize


def _keep_alive_due(ctx: Any) -> bool:
    """Whether the node's last keep-alive is half an interval old (torch: a whole one)."""
    last = ctx.state.last_heartbeats.get(ctx.node)
    return last is not None and bool(last <= datetime.now(UTC) - ctx.settings.keep_alive_interval / 2)


def _delay(seconds: float | tuple[float, float]) -> None:
    """torch's delay, a poll of the shared state at most ``POLL_S`` long."""
    _torch_delay(seconds if isinstance(seconds, tuple) else min(seconds, POLL_S))


class _JoinOp(_TorchJoinOp):
    """torch's join, which closes a round after the first once every live node is in it, and the
    first round only once its nodes are in or the launch's last call ran out."""

    def __call__(self, ctx: Any, deadline: float) -> Any:
        action = _TorchJoinOp.__call__(self, ctx, deadline)
        state = ctx.state
        if (
            action == _Action.MARK_RENDEZVOUS_COMPLETE
            and state.round == 0
            and _launch_last_call is not None
            and len(state.participants) < ctx.settings.max_nodes
            and state.deadline is not None
            # torch set the deadline a last call after nodes.min joined
            and datetime.now(UTC) < state.deadline - ctx.settings.timeout.last_call + _launch_last_call
        ):
            return _Action.KEEP_ALIVE if _keep_alive_due(ctx) else _Action.SYNC
        if (
            action in (_Action.SYNC, _Action.KEEP_ALIVE)
            and state.round > 0
            and not state.complete
            and ctx.node in state.participants
            and len(state.participants) >= ctx.settings.min_nodes
            and set(state.last_heartbeats) <= set(state.participants)
        ):
            return _Action.MARK_RENDEZVOUS_COMPLETE
        return action


def _sanitize(holder: Any) -> None:
    """torch's removal of the nodes whose keep-alives expired, skipped until this node has synced
    steadily (no pause longer than two keep-alive intervals) for one expiry."""
    now = time.monotonic()
    settings = holder._settings
    expiry = (settings.keep_alive_interval * settings.keep_alive_max_attempt).total_seconds()
    last = getattr(holder, "_infractl_last_sanitized", None)
    if last is None or now - last > 2 * settings.keep_alive_interval.total_seconds():
        holder._infractl_steady_since = now
    holder._infractl_last_sanitized = now
    if now - holder._infractl_steady_since < expiry:
        holder._dead_nodes = []
        return
    _torch_sanitize(holder)


def _next_rendezvous(handler: Any) -> Any:
    """torch's join of the next round, which remembers the round and its participants."""
    info = _torch_next_rendezvous(handler)
    state = handler._state_holder.state
    handler._infractl_round = (state.round, frozenset(state.participants))
    handler._infractl_peer_lost = frozenset()
    return info


def peer_lost(handler: Any) -> frozenset[Any]:
    """The participants of this node's round that left it while its workers ran (dropped for
    stopped keep-alives, or gone to restart), as ``_num_nodes_waiting`` last found them; empty if
    none."""
    return frozenset(getattr(handler, "_infractl_peer_lost", frozenset()))


def _num_nodes_waiting(handler: Any) -> int:
    """torch's count of nodes waiting to join, at least 1 once the rendezvous dropped this node
    or a peer of its round."""
    waiting = int(_torch_num_nodes_waiting(handler))
    state = handler._state_holder.state
    if handler._this_node not in state.participants:
        log.warning(
            "the rendezvous dropped this node (its keep-alives came late): restarting its workers to join again"
        )
        return max(waiting, 1)
    joined = getattr(handler, "_infractl_round", None)
    if joined is not None and joined[0] == state.round:
        lost = joined[1] - set(state.participants)
        if lost:
            if not peer_lost(handler):
                log.warning(
                    "peer_lost",
                    nodes=sorted(f"{node.addr}:{node.pid}" for node in lost),
                    reason="they left this node's round: their keep-alives stopped, or they restart",
                    action="restarting this node's workers",
                )
            handler._infractl_peer_lost = frozenset(lost)
            return max(waiting, 1)
    return waiting


def install(launch_last_call_s: float | None = None) -> None:
    """Patch torch's dynamic rendezvous in this process (see the module docstring); a launch's
    first round waits ``launch_last_call_s`` for its nodes (None: torch's last call)."""
    global _launch_last_call
    _launch_last_call = None if launch_last_call_s is None else timedelta(seconds=launch_last_call_s)
    torch_rendezvous._should_keep_alive = _keep_alive_due
    torch_rendezvous._delay = _delay  # type: ignore[attr-defined]
    torch_rendezvous._RendezvousJoinOp = _JoinOp  # type: ignore[misc]
    _TorchStateHolder._sanitize = _sanitize  # type: ignore[method-assign,assignment]
    torch_rendezvous.DynamicRendezvousHandler.num_nodes_waiting = _num_nodes_waiting  # type: ignore[method-assign,assignment]
    torch_rendezvous.DynamicRendezvousHandler.next_rendezvous = _next_rendezvous  # type: ignore[method-assign,assignment]
