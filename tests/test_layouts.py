"""trainer/ model-parallel layouts (tensor parallel, pipeline parallel, FSDP x TP on 2 ranks, and
all three on 4): the same losses as one rank, bit-exact resumes in the same layout, and a
checkpoint that moves from layout to layout and to fewer data-parallel ranks.

Real torchrun on gloo. The single-rank reference run is made once per session (shared by the
xdist workers, as in test_schemes.py) and every layout is compared with it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock
from test_schemes import BF16_REL_TOL, RESHARD_REL_TOL, STEPS, attempt_losses, scheme_spec, uncommit
from test_trainer import ok, store_of, torchrun

from infractl.config import CheckpointSpec, ModelSpec, RunSpec

# Every test trains on 2 or 4 ranks under torchrun.
pytestmark = pytest.mark.cluster

#: Largest relative loss difference between a layout and the single-rank run over the first
#: steps. Each layout computes the same sums in another order (a TP row-wise all-reduce, a
#: pipeline's micro-batches): measured at most 1.3e-7 over 12 steps.
LAYOUT_REL_TOL = 1e-4

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tp": 2},
    "pp2-gpipe": {"pp": 2, "pp_schedule": "gpipe"},
    "pp2-1f1b": {"pp": 2, "pp_schedule": "1f1b", "microbatches": 4},
    "fsdp-tp2": {"dp_shard": "fsdp", "tp": 2},
}
#: The interleaved schedule (four stages, two per rank, each an FSDP root) with tensor parallel
#: on four ranks: every part of the layout code at once.
THREE_D = {"dp_shard": "fsdp", "tp": 2, "pp": 2, "pp_schedule": "interleaved-1f1b"}


def layout_spec(parallel: Any, **overrides: Any) -> RunSpec:
    # Checkpoints at 3, 6, 9, 12, all kept: the chain resumes from each of the first three.
    # Four blocks: two pipeline stages of two, or four interleaved stages of one.
    return scheme_spec(
        "ddp",
        parallel=parallel,
        model=ModelSpec(layers=4, hidden=32, heads=2, seq_len=32),
        checkpoint=CheckpointSpec(every=3, keep=4),
        **overrides,
    )


def single_rank_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The uninterrupted single-rank run's loss per step, made by whichever test needs it first."""
    base = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        base = base.parent
    root = base / "reference-single-rank"
    with FileLock(f"{root}.lock"):
        if not (root / "done").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            ok(torchrun(root, layout_spec("ddp"), nproc=1))
            (root / "done").touch()
    losses = attempt_losses(store_of(root), 1)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def assert_close(losses: dict[int, float], reference: dict[int, float], rel: float) -> None:
    assert losses
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=rel), (step, loss, reference[step])


def assert_trains_like_one_rank_and_resumes_bit_exact(
    tmp_path: Path, reference: dict[int, float], parallel: Any, ranks: int
) -> None:
    spec = layout_spec(parallel)
    first = ok(torchrun(tmp_path, spec, nproc=ranks))
    store = store_of(tmp_path)
    losses = attempt_losses(store, 1)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert_close(losses, reference, LAYOUT_REL_TOL)
    assert {e["world_size"] for e in first.event("rank_joined")} == {ranks}

    # Killed after step 6 committed: the same layout resumes there and repeats every bit.
    uncommit(store, 9, 12)
    resumed = ok(torchrun(tmp_path, spec, nproc=ranks, attempt=2))
    assert [e["step"] for e in resumed.event("resumed")] == [6]
    assert attempt_losses(store, 2) == {s: losses[s] for s in range(7, STEPS + 1)}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_rank_and_resumes_bit_exact(
    name: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    reference = single_rank_losses(tmp_path_factory)
    assert_trains_like_one_rank_and_resumes_bit_exact(tmp_path, reference, LAYOUTS[name], 2)


def test_three_dimensions_on_four_ranks_match_one_rank_and_resume_bit_exact(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    reference = single_rank_losses(tmp_path_factory)
    assert_trains_like_one_rank_and_resumes_bit_exact(tmp_path, reference, THREE_D, 4)


def test_tensor_parallel_composes_with_fsdp_activation_checkpointing_and_bf16(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    reference = single_rank_losses(tmp_path_factory)
    spec = layout_spec({"dp_shard": "fsdp", "tp": 2}, activation_checkpointing=True, mixed_precision="bf16")

    ok(torchrun(tmp_path, spec))

    assert_close(attempt_losses(store_of(tmp_path), 1), reference, BF16_REL_TOL)


def test_a_checkpoint_moves_from_fsdp_to_tp_to_pp_to_one_rank(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """fsdp x tp 2 on 4 ranks trains steps 1-3; the same layout on 2 ranks takes over from its
    checkpoint at step 3, as after losing a node (the mesh is rebuilt: dp shrinks from 2 to 1, tp
    stays 2); pp 2 takes over from step 6, and ddp on one rank from step 9: each continues the
    single-rank run's losses. Each run trains to the end; the checkpoints after the hand-over
    step are uncommitted, as if it had been stopped there."""
    reference = single_rank_losses(tmp_path_factory)
    store = store_of(tmp_path)
    fsdp_tp2 = {"dp_shard": "fsdp", "tp": 2}
    chain: list[tuple[Any, int, int]] = [  # (parallel, ranks, the step it resumes from)
        (fsdp_tp2, 4, 0),
        (fsdp_tp2, 2, 3),
        ({"pp": 2}, 2, 6),
        ("ddp", 1, 9),
    ]
    for attempt, (parallel, ranks, start) in enumerate(chain, start=1):
        uncommit(store, *range(start + 3, STEPS + 1, 3))
        run = ok(torchrun(tmp_path, layout_spec(parallel), nproc=ranks, attempt=attempt))
        if start:
            assert {e["step"] for e in run.event("resumed")} == {start}
        losses = attempt_losses(store, attempt)
        assert sorted(losses) == list(range(start + 1, STEPS + 1))
        assert_close(losses, reference, RESHARD_REL_TOL)
