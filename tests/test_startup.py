"""Start-up of a model larger than a rank holds: every rank builds the model on the meta device,
splits it, and allocates and initialises only its own part (trainer/parallelize.py), with the
values a whole model built in one process has for the seed (trainer/model.py ``initial_value``).

Real torchrun on gloo, 2 ranks (tests/startup_memory.py). The model is sized so its whole fp32
copy (193 MiB) dwarfs what a start-up costs without it (the runtime's baseline: the data, the
store, libtorch's pools), which the same start-up of a one-layer, 8-wide model measures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_schemes import scheme_spec

from infractl.config import ModelSpec

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300

#: 16 blocks of 512: 50.6 M parameters, 193 MiB in fp32; the largest parameter is 4 MiB.
LARGE = ModelSpec(layers=16, hidden=512, heads=8, seq_len=64)
TINY = ModelSpec(layers=1, hidden=8, heads=1, seq_len=8)
#: A rank's start-up may grow by at most this share of the whole model's bytes beyond the
#: baseline: each of 2 ranks holds half of it, and one whole parameter at a time is made.
HELD_SHARE = 0.60


def startup(tmp_path: Path, parallel: Any, model: ModelSpec) -> list[dict[str, Any]]:
    """Each rank's report (tests/startup_memory.py) of a 2-rank start-up of ``model``."""
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(scheme_spec("ddp", parallel=parallel, model=model, batch_size=4).model_dump_json())
    store = tmp_path / "store"
    store.mkdir()
    out = tmp_path / "startup"
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
        str(REPO / "tests" / "startup_memory.py"),
        "--spec", str(spec_path), "--store", store.as_uri(), "--run-id", "tiny",
        "--workdir", str(tmp_path / "work"), "--out", str(out),
    ]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(out.with_name(f"{out.name}.rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> int:
    """The most a rank's start-up grew with a model of next to nothing."""
    reports = startup(tmp_path_factory.mktemp("baseline"), "fsdp", TINY)
    return max(r["peak"] - r["baseline"] for r in reports)


@pytest.mark.parametrize("parallel", ["fsdp", {"tp": 2}], ids=["fsdp", "tp2"])
def test_each_rank_allocates_only_its_part_with_a_whole_builds_values(
    parallel: Any, baseline: int, tmp_path: Path
) -> None:
    reports = startup(tmp_path, parallel, LARGE)
    for rank, report in enumerate(reports):
        # Every parameter, gathered whole, equals a whole model's built in one process.
        assert report["mismatched"] == [] and len(report["held"]) == 4 + 16 * 16, (rank, report["mismatched"])
        grown = report["peak"] - report["baseline"]
        assert grown < HELD_SHARE * report["model_bytes"] + baseline, (rank, grown, baseline, report["model_bytes"])
