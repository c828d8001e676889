"""``infractl drill chaos`` without a cluster: the series a seed draws, and the comparison of a run
with its uninterrupted reference (real runs of tests/test_schemes.py, one resumed on another world
size by real torchrun). The series against a running cluster: tests/test_netns.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_export import exported_run
from test_schemes import STEPS, scheme_spec, uncommit
from test_trainer import ok, torchrun

from infractl.config import RunSpec
from infractl.drill import KINDS
from infractl.drill.chaos import draw
from infractl.drill.compare import CROSS_WORLD_REL_TOL, compare_runs
from infractl.runstore import run_prefix
from infractl.store import Store

NODES = ["node-0", "node-1"]


def test_a_seed_draws_one_series_over_every_kind_node_and_moment() -> None:
    spec = RunSpec(name="r", watchdog={"step_timeout_s": 8})
    kinds = sorted(KINDS)
    series = draw(7, 60, kinds, NODES, min_gap=2.0, spec=spec)

    assert series == draw(7, 60, kinds, NODES, min_gap=2.0, spec=spec)
    assert series != draw(8, 60, kinds, NODES, min_gap=2.0, spec=spec)
    assert [f.index for f in series] == list(range(1, 61))
    assert {f.kind for f in series} == set(kinds)
    assert {f.node for f in series if f.kind != "store-outage"} == set(NODES)  # node-0 too
    assert all(2.0 <= f.delay_s <= 4.0 for f in series)
    for fault in series:
        if fault.kind == "partition":
            # Twice the step timeout: the run has noticed the cut before it ends.
            assert fault.seconds == 16.0 and fault.options["link"] in ("down", "drop"), fault
        elif fault.kind == "store-outage":
            assert fault.node is None and fault.seconds == 10.0 and fault.options == {}, fault
        else:
            assert fault.seconds is None and fault.options == {}, fault
    # Every fault draws the same numbers whatever its kind: fewer kinds, the same moments.
    fewer = draw(7, 60, ["kill-node"], NODES, min_gap=2.0, spec=spec)
    assert [f.delay_s for f in fewer] == [f.delay_s for f in series]


def _copy_run(store: Store, run_id: str, to: str) -> None:
    store.delete_prefix(run_prefix(to) + "/")
    for obj in store.list(run_prefix(run_id) + "/"):
        store.put_bytes(run_prefix(to) + obj.key[len(run_prefix(run_id)) :], store.get_bytes(obj.key))


def _nudge_loss(store: Store, run_id: str, step: int) -> None:
    """Move one step's recorded loss by one unit in the last place."""
    for obj in store.list(f"{run_prefix(run_id)}/metrics/"):
        lines = [json.loads(line) for line in store.get_bytes(obj.key).splitlines() if line.strip()]
        if any(r["step"] == step for r in lines):
            for r in lines:
                if r["step"] == step:
                    r["loss"] = math.nextafter(r["loss"], math.inf)
            store.put_bytes(obj.key, "".join(json.dumps(r) + "\n" for r in lines).encode())


@pytest.mark.cluster
def test_a_run_matches_its_reference_bitwise_on_one_world_size_and_within_tolerance_after_another(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    store = exported_run(tmp_path_factory, tmp_path, "ddp")  # run "tiny": 2 ranks, uninterrupted, with its run.json
    _copy_run(store, "tiny", "tiny-reference")

    same = compare_runs(store, "tiny", "tiny-reference")
    assert same.matches and same.weights_bitwise and same.max_loss_rel_diff == 0.0, same
    assert (same.steps, same.bitwise_steps, same.first_other_world_step, same.world_size) == (STEPS, STEPS, None, 2)

    # One bit of one step's loss is a mismatch while the world size never changed.
    _nudge_loss(store, "tiny-reference", 7)
    nudged = compare_runs(store, "tiny", "tiny-reference")
    assert not nudged.matches and nudged.mismatched_steps == [7], nudged
    _copy_run(store, "tiny", "tiny-reference")

    # The run loses a rank after step 4 and trains steps 5..12 on one: those are compared within the
    # tolerance, and the final weights too (not bitwise any more).
    uncommit(store, 8, 12)
    ok(torchrun(tmp_path, scheme_spec("ddp"), nproc=1, attempt=2))
    shrunk = compare_runs(store, "tiny", "tiny-reference")
    assert (shrunk.first_other_world_step, shrunk.bitwise_steps) == (5, 4), shrunk
    assert shrunk.matches and not shrunk.weights_bitwise, shrunk
    assert 0 < shrunk.max_loss_rel_diff <= CROSS_WORLD_REL_TOL and shrunk.weights_tolerance == CROSS_WORLD_REL_TOL
    assert 0 < shrunk.weights_rel_diff <= CROSS_WORLD_REL_TOL, shrunk
    # Reported so the tolerance can be reviewed against what is measured (pytest -rP).
    print(f"1 rank from step 5: loss {shrunk.max_loss_rel_diff:.1e}, weights {shrunk.weights_rel_diff:.1e}")
