"""The benchmarks cannot rot: each runs here as a smoke test. It must finish and report every
field; no timing is asserted (the figures are docs/'s, from the full runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from infractl.planning import accuracy
from infractl.planning.probe import COMPONENTS

from conftest import REPO

pytestmark = pytest.mark.xdist_group("bench")


def _bench(script: str, *args: str, out: Path, timeout: float) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, f"bench/{script}", *args, "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.mark.cluster
def test_trainer_benchmark_quick_reports_every_ratio(tmp_path: Path) -> None:
    # A model a tenth of --quick's: the test checks that every ratio is measured, not its value.
    tiny = ("--model", "2x32", "--seq-len", "32", "--batch-size", "8")
    results = _bench("trainer.py", "--quick", *tiny, out=tmp_path / "trainer.json", timeout=900)
    step = results["step_time"]
    for field in ("ours_step_s", "ours_every_step_s", "ours_no_replicas_step_s", "plain_step_s", "tokens_per_s"):
        assert step[field] > 0, step
    assert step["ours_replicated_step_s"] > 0 and step["replica_s"] >= 0 and step["replicated_every"] > 0
    for field in ("ratio", "ratio_every_step", "ratio_no_replicas", "ratio_replicas_at_default"):
        assert step[field] > 0, step
    assert step["log_every"] == 10 and step["steps_measured"] > 0 and step["replicate_every"] > 0
    for layout in ("tp", "pp"):  # the model split over the 2 ranks, against the trainer's ddp
        seconds = step[f"{layout}_step_s"]
        assert seconds > 0 and step[f"ratio_{layout}"] == seconds / step["ours_step_s"]
        assert len(step["runs"][layout]) == step["repeats"]
    assert results["checkpoint"]["async_blocked_s"] > 0 and results["checkpoint"]["ratio_sync_over_async"] > 0
    assert results["upload"]["ours_mib_s"] > 0 and results["upload"]["ratio"] > 0


@pytest.mark.cluster
def test_recovery_benchmark_a_kill_node_series(tmp_path: Path) -> None:
    # Every kind is drilled on its own in tests/test_drill.py, and all of them in a chaos series in
    # tests/test_netns.py.
    results = _bench("recovery.py", "--drills", "1", "--kinds", "none", out=tmp_path / "recovery.json", timeout=1500)
    assert results["drills"] == 1 and results["succeeded"] == 1, results
    assert results["median_restart_s"] > 0 and results["median_detect_s"] is not None
    assert results["other_kinds"] == [] and results["other_kinds_error"] is None, results
    cold = results["cold"]  # the same series restarting cold, side by side
    assert cold["drills"] == 1 and cold["succeeded"] == 1 and results["restart_ratio"] > 0, results


@pytest.mark.cluster
def test_recovery_benchmark_a_chaos_series(tmp_path: Path) -> None:
    # Seed 0 draws one store outage on local: the shortest series, with its comparison.
    results = _bench(
        "recovery.py", "--chaos", "1", "--seed", "0", "--steps", "300", out=tmp_path / "chaos.json", timeout=1500
    )
    assert (results["count"], results["recovered"], results["stopped"], results["passed"]) == (1, 1, None, True)
    assert results["per_kind"] == {"store-outage": results["per_kind"]["store-outage"]}
    comparison = results["comparison"]
    assert comparison["matches"] and comparison["steps"] == 300 and comparison["weights_bitwise"], comparison
    assert results["series_s"] > 0 and results["nodes"] == {"the store": 1}


@pytest.mark.cluster
def test_planner_against_its_peers_reports_every_field(tmp_path: Path) -> None:
    # A sweep of 4 tiny shapes the planner was not tuned on (seed 126: a pipeline, zero1 and fsdp in
    # bf16, tensor parallel in fp32 with activation checkpointing); tests/test_plan.py measures
    # every example through `plan --measure`.
    args = ("--sweep", "4", "--seed", "126", "--steps", "2")
    results = _bench("planner_vs_peers.py", *args, out=tmp_path / "peers.json", timeout=600)
    assert (results["seed"], results["steps"], len(results["shapes"])) == (126, 2, 4)
    for r in results["shapes"]:
        assert r["ranks"] == 2 and r["micro_batch"] > 0
        for field in ("ours_peak", "ours_model_states", "deepspeed", "accelerate", "measured_peak"):
            assert isinstance(r[field], int) and r[field] > 0, (field, r)
        # The same tensors, measured exactly (AdamW's step counters are the few bytes apart).
        assert r["measured_model_states"] == pytest.approx(r["ours_model_states"], rel=1e-3), r
        assert set(r["predicted"]) == set(r["measured"]) == set(COMPONENTS), r
        # The planner's promise: no run peaks more than accuracy.PEAK_PROMISE above the prediction.
        assert r["peak_error"] <= accuracy.PEAK_PROMISE, r
    band = results["peak_error"]
    assert band["above_promise"] == 0 and band["min"] <= band["median"] <= band["max"] <= accuracy.PEAK_PROMISE, band


def test_published_configurations_are_planned(tmp_path: Path) -> None:
    # docs/sizing.md's table: every published run gets a way to train it that fits the device.
    results = _bench("published_configs.py", out=tmp_path / "published.json", timeout=60)
    assert len(results) >= 2, results
    for r in results:
        recommended = r["recommended"]
        assert recommended["fits"] and recommended["parallel"], r
        assert 0 < recommended["budget"]["total"] <= r["device_memory_bytes"], r
        assert r["published_layout"]["budget"]["total"] > 0 and r["sources"], r
        # On the published devices too, accumulating gradients where one pass a step does not fit.
        theirs = r["on_published_devices"]
        assert theirs["fits"] and theirs["devices"] <= r["published"]["devices"], r
        assert theirs["accumulation"] == 1 or theirs["way"].endswith("+ gradient accumulation"), r
