"""A model larger than a rank holds, started and exported.

Start-up: every rank builds the model on the meta device, splits it, and allocates and
initialises only its own part (trainer/parallelize.py), with the values a whole model built in one
process has for the seed (trainer/model.py ``initial_value``). Real torchrun on gloo, 2 ranks
(tests/startup_memory.py).

Export: ``infractl export`` reads a sharded checkpoint of that model a layer at a time
(infractl/model/export.py), measured by tests/export_memory.py in its own process.

The model is sized so its whole fp32 copy (193 MiB) dwarfs what the same work costs without it
(the runtime's baseline: the data, the store, libtorch's pools), which a one-layer, 8-wide model
measures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_schemes import scheme_spec

from infractl import runstore
from infractl.config import CheckpointSpec, ModelSpec
from infractl.runstore import RunRecord
from infractl.store import open_store

# Every test starts ranks under torchrun.
pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300

#: 16 blocks of 512: 50.6 M parameters, 193 MiB in fp32; the largest parameter is 4 MiB.
LARGE = ModelSpec(layers=16, hidden=512, heads=8, seq_len=64)
TINY = ModelSpec(layers=1, hidden=8, heads=1, seq_len=8)
#: A rank's start-up may grow by at most this share of the whole model's bytes beyond the
#: baseline: each of 2 ranks holds half of it, and one whole parameter at a time is made.
HELD_SHARE = 0.60
#: An export may grow by at most this share of the whole model's bytes beyond the baseline: it
#: holds one layer (a block of 512 is 12 MiB) and DCP's read of it, not the model.
EXPORT_SHARE = 0.35


@dataclass(frozen=True)
class Started:
    reports: list[dict[str, Any]]  # each rank's (tests/startup_memory.py)
    store: str  # the run's store: a checkpoint of its one step when it trained


def startup(tmp_path: Path, parallel: Any, model: ModelSpec, *, train: bool = False) -> Started:
    """A 2-rank start-up of ``model`` (tests/startup_memory.py); with ``train``, the run then
    trains its one step and commits it, and its run record is written as the launcher would."""
    spec = scheme_spec(
        "ddp", parallel=parallel, model=model, batch_size=4, steps=1, checkpoint=CheckpointSpec(every=1, keep=2)
    )
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(spec.model_dump_json())
    store = tmp_path / "store"
    store.mkdir()
    out = tmp_path / "startup"
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
        str(REPO / "tests" / "startup_memory.py"),
        "--spec", str(spec_path), "--store", store.as_uri(), "--run-id", "tiny",
        "--workdir", str(tmp_path / "work"), "--out", str(out), *(["--train"] if train else []),
    ]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    if train:
        saved = open_store(store.as_uri())
        manifest = runstore.read_manifest(saved, "tiny", 1)
        assert manifest is not None
        record = RunRecord(
            run_id="tiny",
            cluster="local",
            dataset_version=manifest.extra["dataset_version"],
            spec=spec.model_dump(mode="json"),
        )
        runstore.write_run_record(saved, record)
    reports = [json.loads(out.with_name(f"{out.name}.rank{rank}.json").read_text()) for rank in (0, 1)]
    return Started(reports, store.as_uri())


def exported(tmp_path: Path, store: str) -> dict[str, int]:
    """tests/export_memory.py's report of exporting the run in ``store``."""
    out = tmp_path / "export"
    out.mkdir(parents=True)
    argv = [sys.executable, str(REPO / "tests" / "export_memory.py"), store, "tiny", str(out)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    report: dict[str, int] = json.loads(done.stdout.splitlines()[-1])
    return report


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Started:
    """The start-up (and the checkpoint) of a model of next to nothing."""
    return startup(tmp_path_factory.mktemp("baseline"), "fsdp", TINY, train=True)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Started:
    """The large model's start-up under fsdp, trained a step and checkpointed."""
    return startup(tmp_path_factory.mktemp("fsdp"), "fsdp", LARGE, train=True)


@pytest.mark.parametrize("parallel", ["fsdp", {"tp": 2}], ids=["fsdp", "tp2"])
def test_each_rank_allocates_only_its_part_with_a_whole_builds_values(
    parallel: Any, baseline: Started, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    started = request.getfixturevalue("sharded") if parallel == "fsdp" else startup(tmp_path, parallel, LARGE)
    runtime = max(r["peak"] - r["baseline"] for r in baseline.reports)
    for rank, report in enumerate(started.reports):
        # Every parameter, gathered whole, equals a whole model's built in one process.
        assert report["mismatched"] == [] and len(report["held"]) == 4 + 16 * 16, (rank, report["mismatched"])
        grown = report["peak"] - report["baseline"]
        assert grown < HELD_SHARE * report["model_bytes"] + runtime, (rank, grown, runtime, report["model_bytes"])


def test_export_reads_the_sharded_checkpoint_a_layer_at_a_time(
    baseline: Started, sharded: Started, tmp_path: Path
) -> None:
    tiny = exported(tmp_path / "tiny", baseline.store)
    large = exported(tmp_path / "large", sharded.store)
    model_bytes = sharded.reports[0]["model_bytes"]
    for fmt in ("safetensors", "torch"):
        runtime = tiny[fmt] - tiny["baseline"]
        grown = large[fmt] - large["baseline"]
        assert grown < EXPORT_SHARE * model_bytes + runtime, (fmt, grown, runtime, model_bytes)
    assert (tmp_path / "large" / "export" / "model.safetensors").stat().st_size > model_bytes
