"""trainer.rendezvous_patch: each change to torch's dynamic rendezvous, on its own shared state (the
restarts they shorten are measured by bench/recovery.py and exercised by tests/test_drill.py)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as torch_rendezvous

from trainer import rendezvous_patch

A, B, C = (torch_rendezvous._NodeDesc(f"10.0.0.{i}", 100 + i, 0) for i in (1, 2, 3))
SETTINGS = torch_rendezvous.RendezvousSettings(
    "run", 1, 3, torch_rendezvous.RendezvousTimeout(), timedelta(seconds=1), 3
)
Action = torch_rendezvous._Action


def state(*, round: int, complete: bool, participants: list[Any], alive: list[Any]) -> Any:
    shared = torch_rendezvous._RendezvousState()
    shared.round, shared.complete = round, complete
    shared.participants = dict.fromkeys(participants, 0)
    shared.last_heartbeats = dict.fromkeys(alive, datetime.now(UTC))
    shared.deadline = datetime.now(UTC) + timedelta(seconds=30)  # the last call, far off
    return shared


def join(node: Any, shared: Any) -> Any:
    return rendezvous_patch._JoinOp()(torch_rendezvous._RendezvousContext(node, shared, SETTINGS), float("inf"))


def test_a_keep_alive_is_due_half_an_interval_after_the_last() -> None:
    """A timer tick that comes a little early still sends one (torch's rule would skip it, and a
    live node's keep-alives would come two intervals apart)."""
    shared = state(round=0, complete=True, participants=[A], alive=[A])
    context = torch_rendezvous._RendezvousContext(A, shared, SETTINGS)
    shared.last_heartbeats[A] = datetime.now(UTC) - timedelta(seconds=0.9)
    assert rendezvous_patch._keep_alive_due(context) and not torch_rendezvous._should_keep_alive(context)
    shared.last_heartbeats[A] = datetime.now(UTC) - timedelta(seconds=0.2)
    assert not rendezvous_patch._keep_alive_due(context)
    del shared.last_heartbeats[A]  # dropped: nothing to keep alive
    assert not rendezvous_patch._keep_alive_due(context)


def test_a_wait_polls_at_most_every_quarter_second(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[object] = []
    monkeypatch.setattr(rendezvous_patch, "_torch_delay", slept.append)
    rendezvous_patch._delay(1)
    rendezvous_patch._delay(0.1)
    rendezvous_patch._delay((0, 0.3))  # torch's random start-up skew is left alone
    assert slept == [rendezvous_patch.POLL_S, 0.1, (0, 0.3)]


def test_a_restart_round_closes_once_every_live_node_joined() -> None:
    # The dead node was dropped; both survivors are in: no last call to wait out.
    assert join(B, state(round=1, complete=False, participants=[A, B], alive=[A, B])) == Action.MARK_RENDEZVOUS_COMPLETE
    # C is alive (it has keep-alives) and not in yet: the round waits for it.
    waiting = state(round=1, complete=False, participants=[A, B], alive=[A, B, C])
    assert join(B, waiting) in (Action.SYNC, Action.KEEP_ALIVE)


def test_a_launch_first_round_keeps_its_last_call() -> None:
    """At a launch the other nodes may not have sent a keep-alive yet: the first to join must
    not start the run alone."""
    assert join(A, state(round=0, complete=False, participants=[A], alive=[A])) in (Action.SYNC, Action.KEEP_ALIVE)


def test_a_launch_first_round_waits_the_launch_last_call_for_its_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A's last call ran out, but the launch's (longer) has not: B, whose agent started late, is
    still waited for; once the launch's runs out too, the run starts without it."""
    monkeypatch.setattr(rendezvous_patch, "_launch_last_call", SETTINGS.timeout.last_call * 2)
    ran_out = state(round=0, complete=False, participants=[A], alive=[A])
    ran_out.deadline = datetime.now(UTC) - timedelta(seconds=1)  # nodes.min joined one last call and 1 s ago
    assert join(A, ran_out) in (Action.SYNC, Action.KEEP_ALIVE)
    ran_out.deadline = datetime.now(UTC) - SETTINGS.timeout.last_call - timedelta(seconds=1)
    assert join(A, ran_out) == Action.MARK_RENDEZVOUS_COMPLETE
    # A restart's round is not held by it.
    restart = state(round=1, complete=False, participants=[A], alive=[A])
    restart.deadline = datetime.now(UTC) - timedelta(seconds=1)
    assert join(A, restart) == Action.MARK_RENDEZVOUS_COMPLETE


def test_a_finished_round_and_a_node_outside_it_are_torch_s() -> None:
    assert join(A, state(round=1, complete=True, participants=[A, B], alive=[A, B])) == Action.FINISH
    assert join(C, state(round=1, complete=True, participants=[A, B], alive=[A, B])) == Action.ADD_TO_WAIT_LIST


def test_a_node_the_rendezvous_dropped_counts_as_a_waiting_node() -> None:
    """A live node dropped for late keep-alives restarts its workers and joins again, instead of
    training on alone beside the round the others form without it."""

    def handler(node: Any, shared: Any) -> Any:
        holder = SimpleNamespace(state=shared, sync=lambda: None)
        return SimpleNamespace(_this_node=node, _state_holder=holder, _heartbeat_lock=threading.Lock())

    running = state(round=1, complete=True, participants=[A, B], alive=[A, B])
    assert rendezvous_patch._num_nodes_waiting(handler(A, running)) == 0
    running.wait_list = {C}
    assert rendezvous_patch._num_nodes_waiting(handler(A, running)) == 1
    dropped = state(round=2, complete=False, participants=[], alive=[])
    assert rendezvous_patch._num_nodes_waiting(handler(A, dropped)) == 1


def test_a_node_whose_round_lost_a_peer_restarts_its_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer whose keep-alives stopped (link down, power lost) is dropped from the round: the
    survivors restart at once instead of waiting out the collective timeout, and their agent
    learns which peer is gone (it then SIGKILLs the workers waiting on it)."""
    shared = state(round=1, complete=True, participants=[A, B, C], alive=[A, B, C])
    holder = SimpleNamespace(state=shared, sync=lambda: None)
    handler = SimpleNamespace(_this_node=A, _state_holder=holder, _heartbeat_lock=threading.Lock())
    monkeypatch.setattr(rendezvous_patch, "_torch_next_rendezvous", lambda handler: "info")
    assert rendezvous_patch._next_rendezvous(handler) == "info"
    assert rendezvous_patch._num_nodes_waiting(handler) == 0 and not rendezvous_patch.peer_lost(handler)
    del shared.participants[C]  # C's keep-alives expired: torch's sanitize removed it
    assert rendezvous_patch._num_nodes_waiting(handler) == 1 and rendezvous_patch.peer_lost(handler) == {C}
    shared.round, shared.participants = 2, dict.fromkeys([A, B], 0)  # the next round
    rendezvous_patch._next_rendezvous(handler)
    assert rendezvous_patch._num_nodes_waiting(handler) == 0 and not rendezvous_patch.peer_lost(handler)
    shared.round = 3  # a round this node has not joined is torch's to judge
    shared.participants = dict.fromkeys([A], 0)
    assert rendezvous_patch._num_nodes_waiting(handler) == 0


def test_a_node_drops_no_peer_until_it_synced_steadily_for_one_expiry(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a pause in this node's syncs (the rendezvous server stalled: every keep-alive aged
    alike) its peers' old keep-alives drop nobody; after one expiry of steady syncs, a node whose
    keep-alives stopped is dropped as torch drops it."""
    clock = [100.0]
    monkeypatch.setattr(rendezvous_patch.time, "monotonic", lambda: clock[0])
    shared = state(round=1, complete=True, participants=[A, B, C], alive=[A, B, C])
    stale = datetime.now(UTC) - timedelta(seconds=5)  # past the expiry: 1 s x 3
    shared.last_heartbeats[B] = shared.last_heartbeats[C] = stale
    holder = SimpleNamespace(_state=shared, _settings=SETTINGS, _dead_nodes=[])

    rendezvous_patch._sanitize(holder)  # the first sync after the stall
    assert set(shared.participants) == {A, B, C} and holder._dead_nodes == []
    for _ in range(3):  # steady: a sync a second, B's keep-alives resumed and C's did not
        clock[0] += 1
        shared.last_heartbeats[A] = shared.last_heartbeats[B] = datetime.now(UTC)
        rendezvous_patch._sanitize(holder)
    assert set(shared.participants) == {A, B} and holder._dead_nodes == [C]

    clock[0] += 2.5  # a pause longer than two intervals: judged again only after one expiry
    shared.last_heartbeats[B] = stale
    rendezvous_patch._sanitize(holder)
    assert set(shared.participants) == {A, B}


def test_install_patches_what_the_pinned_torch_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each name install() replaces is one torch 2.13 looks up when it runs (a torch that renamed
    one would leave its restart unchanged): restored after the test."""
    handler = torch_rendezvous.DynamicRendezvousHandler
    for name in ("_should_keep_alive", "_delay", "_RendezvousJoinOp"):
        monkeypatch.setattr(torch_rendezvous, name, getattr(torch_rendezvous, name))
    monkeypatch.setattr(handler, "num_nodes_waiting", handler.num_nodes_waiting)
    monkeypatch.setattr(handler, "next_rendezvous", handler.next_rendezvous)
    holder = torch_rendezvous._BackendRendezvousStateHolder
    monkeypatch.setattr(holder, "_sanitize", holder._sanitize)
    rendezvous_patch.install()
    assert torch_rendezvous._should_keep_alive is rendezvous_patch._keep_alive_due
    assert torch_rendezvous._delay is rendezvous_patch._delay  # type: ignore[attr-defined]
    assert torch_rendezvous._RendezvousJoinOp is rendezvous_patch._JoinOp
    assert handler.num_nodes_waiting is rendezvous_patch._num_nodes_waiting
    assert handler.next_rendezvous is rendezvous_patch._next_rendezvous  # type: ignore[comparison-overlap]
    assert holder._sanitize is rendezvous_patch._sanitize  # type: ignore[comparison-overlap]
