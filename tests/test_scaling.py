"""`infractl bench`: the scaling figures from made-up step records (unit), bad input refused in
one line before anything starts, and end to end on one real 2-node local cluster (Terraform,
Ansible, torchrun on gloo, module-scoped) that writes baseline.json and two PNGs to the store.
Timings are never asserted: only the fields, their types and the relations between them."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from infractl import proc, runstore
from infractl.config import RunSpec
from infractl.errors import ConfigError, UsageError
from infractl.runstore import StepRecord
from infractl.scaling import bench, plots
from infractl.scaling.bench import Bench, Measured, RankSampler
from infractl.store import FileStore

from conftest import REPO, Cli, module_cluster, write

QUICKSTART = REPO / "examples" / "quickstart.yaml"
# Enough measured steps (after the 5 of warm-up) for several samples of the ranks' CPU time.
STEPS = 40


def check_png(data: bytes) -> None:
    image = Image.open(io.BytesIO(data))
    image.load()  # decodes every pixel, or raises
    assert image.format == "PNG" and image.width >= 400 and image.height >= 300, image


# -- the figures from records (unit) ----------------------------------------------------------


def spec(**fields: Any) -> RunSpec:
    return RunSpec.model_validate({"name": "r", "batch_size": 8, "nodes": {"min": 1, "max": 2}} | fields)


def records(*, steps: int, scale: float, comm: bool = True) -> list[StepRecord]:
    """Steps of 8 ms (10 on the log steps: a 2 ms loss read-back) every 10 ms, scaled; a 20 ms
    checkpoint at step 20."""
    out = []
    for step in range(1, steps + 1):
        out.append(
            StepRecord(
                step=step,
                loss=1.0,
                step_time_s=(0.010 if step % 10 == 0 else 0.008) * scale,
                tokens_per_s=1.0,
                world_size=0,  # set by the caller
                attempt=1,
                restart_count=0,
                time=1000.0 + 0.010 * step * scale,
                data_s=0.001 * scale,
                forward_backward_s=0.006 * scale,
                optimizer_s=0.001 * scale,
                comm_s=0.002 * scale if comm else None,
                checkpoint_blocking_s=0.020 * scale if step == 20 else 0.0,
                peak_memory_bytes=1,
            )
        )
    return out


def measured(plan: Bench, *, comm: bool = True) -> list[Measured]:
    done = []
    for trial, scale in zip(plan.trials, (1.0, 1.6), strict=True):
        rs = [r | {"world_size": trial.ranks} for r in records(steps=20, scale=scale, comm=comm)]
        sampler = RankSampler()
        # One sample before the measured steps (left out), two inside: 0.04 CPU seconds per rank in 0.05 s.
        start = 1000.0 + 0.05 * scale
        sampler.cpu = [(start - 0.01, 0.0), (start + 0.01, 1.0), (start + 0.06, 1.0 + 0.04 * trial.ranks)]
        done.append(Measured(trial, rs, sampler))
    return done


def test_a_profiled_window_follows_the_measured_steps_and_stays_out_of_the_figures() -> None:
    plan = bench.plan_bench(spec(), Path("r.yaml"), counts=[1], steps=20, strong=False, processes=1, profile_steps=3)
    trial = plan.trials[0]
    assert trial.steps == 20 and trial.spec.steps == 23 and trial.spec.profile.window == (21, 23)
    rs = records(steps=23, scale=1.0)
    assert [r["step"] for r in trial.figured(rs)] == list(range(bench.WARMUP_STEPS + 1, 21))
    unprofiled = bench.plan_bench(spec(profile={"steps": "2:3"}), Path("r.yaml"), counts=[1], steps=20, strong=False,
                                  processes=1)  # fmt: skip
    assert unprofiled.trials[0].spec.profile.window is None  # the run.yaml's own window is not the bench's


def test_figures_split_the_wall_time_and_compare_counts() -> None:
    plan = bench.plan_bench(spec(), Path("r.yaml"), counts=[1, 2], steps=20, strong=False, processes=1)
    baseline = bench.figures(plan, measured(plan), cluster="c", bench_id="b", started=0.0)
    one, two = baseline["results"]
    # Steps 6-20: 10 ms of wall time each, of which 8.27 ms step time and 1.33 ms checkpoint.
    assert one["median_step_time_s"] == pytest.approx(0.008)
    assert one["global_batch"] == 4  # weak: batch_size 8 over nodes.max 2, 4 per rank
    assert one["tokens_per_s"] == pytest.approx(4 * 64 / 0.008)
    assert one["measured_steps"] == 15 and one["profile_traces"] is None
    expected = {
        "data_wait": 0.1,
        "compute": 0.4,  # forward/backward 6 ms less the 2 ms all-reduce window
        "exposed_comm": 0.2 + 0.004 / 15 / 0.01,  # the window and the log steps' read-back
        "optimizer": 0.1,
        "checkpoint_blocking": 0.02 / 15 / 0.01,
        "between_steps": 0.04,
    }
    for result in (one, two):
        assert result["shares"] == pytest.approx(expected)
        assert result["dominant_idle_cause"] == "exposed_comm"
    assert one["cpu_utilization"] == pytest.approx(0.8) and two["cpu_utilization"] == pytest.approx(0.8)
    assert one["gpu_utilization"] is None
    # 2 nodes: twice the tokens per step in 1.6 times the time.
    assert two["global_batch"] == 8 and two["per_rank_batch"] == 4
    assert two["speedup"] == pytest.approx(2 / 1.6) and two["efficiency"] == pytest.approx(1 / 1.6)
    assert baseline["efficiency_below_80_at"] == 2 and baseline["dominant_idle_cause"] == "exposed_comm"
    assert baseline["exposed_comm_measure"].startswith("exact")


def test_fsdp_has_no_exposed_communication_figure() -> None:
    plan = bench.plan_bench(spec(parallel="fsdp"), Path("r.yaml"), counts=[1, 2], steps=20, strong=False, processes=1)
    baseline = bench.figures(plan, measured(plan, comm=False), cluster="c", bench_id="b", started=0.0)
    for result in baseline["results"]:
        assert result["shares"]["exposed_comm"] is None
        assert result["shares"]["compute"] == pytest.approx(0.6 + 0.004 / 15 / 0.01)
        assert sum(v for v in result["shares"].values() if v is not None) == pytest.approx(1.0)
    assert baseline["exposed_comm_measure"].startswith("not measured")
    check_png(plots.split_png(baseline))  # the part not measured is left out of the bars
    check_png(plots.throughput_png(baseline))


def test_weak_scaling_keeps_the_per_rank_batch_of_nodes_max() -> None:
    plan = bench.plan_bench(spec(batch_size=12, nodes={"min": 1, "max": 3}), Path("r.yaml"), counts=[1, 2, 4],
                            steps=30, strong=False, processes=2)  # fmt: skip
    assert [(t.nodes, t.ranks, t.spec.batch_size, t.per_rank_batch) for t in plan.trials] == [
        (1, 2, 4, 2),
        (2, 4, 8, 2),
        (4, 8, 16, 2),
    ]
    for trial in plan.trials:
        assert trial.spec.name == f"r-bench-{trial.nodes}n" and trial.spec.steps == 30
        assert (trial.spec.nodes.min, trial.spec.nodes.max) == (trial.nodes, trial.nodes)
    assert "per-rank batch 2" in plan.batch_rule


def test_strong_scaling_keeps_the_global_batch() -> None:
    plan = bench.plan_bench(spec(batch_size=8), Path("r.yaml"), counts=[1, 2], steps=30, strong=True, processes=2)
    assert [(t.spec.batch_size, t.per_rank_batch) for t in plan.trials] == [(8, 4), (8, 2)]


def test_a_long_run_name_still_makes_valid_bench_names() -> None:
    plan = bench.plan_bench(spec(name="a" * 40), Path("r.yaml"), counts=[1, 16], steps=30, strong=False, processes=1)
    assert [t.spec.name for t in plan.trials] == ["a" * 31 + "-bench-1n", "a" * 30 + "-bench-16n"]


@pytest.mark.parametrize(
    ("batch_size", "strong", "message"),
    [
        (
            9,
            False,
            "9 does not split evenly over nodes.max x processes per node (2 x 1 = 2 ranks), where the per-rank "
            "batch is taken",
        ),
        (
            1,
            True,
            "1 is smaller than the 2 data-parallel rank(s) of 2 node(s) x 1 process(es), as --nodes asks: "
            "a rank would idle",
        ),
    ],
)
def test_a_batch_the_rule_cannot_split_names_batch_size(batch_size: int, strong: bool, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        bench.plan_bench(spec(batch_size=batch_size), Path("r.yaml"), counts=[1, 2], steps=30, strong=strong,
                         processes=1)  # fmt: skip
    assert refused.value.message == f"r.yaml: batch_size: {message}"


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ("", "expected node counts separated by commas (e.g. 1,2), got ''"),
        ("1,,2", "expected node counts separated by commas (e.g. 1,2), got '1,,2'"),
        ("x", "'x' is not a node count (a whole number)"),
        ("1.5", "'1.5' is not a node count (a whole number)"),
        ("0,1", "node counts must be at least 1, got 0"),
        ("-1", "node counts must be at least 1, got -1"),
        ("2,1,2", "'2,1,2' names a node count twice"),
    ],
)
def test_bad_node_counts_are_named(nodes: str, message: str) -> None:
    with pytest.raises(UsageError) as refused:
        bench.parse_counts(nodes)
    assert refused.value.message == f"--nodes: {message}"


def test_counts_are_sorted() -> None:
    assert bench.parse_counts(" 4, 1,2") == [1, 2, 4]


# -- bad input at the command line, no cluster needed -----------------------------------------


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("nodes", ["", "1,x", "0", "-1", "1,1"])
def test_bad_nodes_refused_before_anything(cli: Cli, nodes: str) -> None:
    result = cli("bench", str(QUICKSTART), "--nodes", nodes, expect=2)
    assert one_line(result.stderr).startswith("error: --nodes: ")
    assert not cli.home.exists()


def test_too_few_steps_refused(cli: Cli) -> None:
    result = cli("bench", str(QUICKSTART), "--nodes", "1", "--steps", "9", "--json", expect=2)
    assert json.loads(result.stdout)["error"]["field"] == "--steps"
    assert "greater than or equal to 10" in one_line(result.stderr)
    assert not cli.home.exists()


def test_bench_needs_a_cluster_that_is_up(cli: Cli) -> None:
    result = cli("bench", str(QUICKSTART), "--nodes", "1,2", expect=2)
    assert "cluster 'local' is not up" in one_line(result.stderr)
    assert not cli.home.exists()


# -- end to end on one 2-node local cluster ---------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    with module_cluster(tmp_path_factory, "scaling") as cli:
        yield cli


def store_of(cli: Cli) -> FileStore:
    return FileStore(cli.home / "local" / "store")


def bench_ids(store: FileStore) -> set[str]:
    return {o.key.split("/")[1] for o in store.list("bench/")}


def check_result(result: dict[str, Any], *, nodes: int, global_batch: int) -> None:
    assert result["nodes"] == nodes and result["ranks"] == nodes  # 1 process per node
    assert result["run_id"] == f"quickstart-bench-{nodes}n"
    assert result["global_batch"] == global_batch and result["per_rank_batch"] * nodes == global_batch
    assert result["steps"] == STEPS and result["measured_steps"] == STEPS - bench.WARMUP_STEPS
    assert result["restarts"] == 0
    assert result["median_step_time_s"] > 0
    assert result["tokens_per_s"] == pytest.approx(global_batch * 64 / result["median_step_time_s"])
    assert result["speedup"] > 0 and result["efficiency"] == pytest.approx(result["speedup"] / nodes)
    shares = result["shares"]
    assert list(shares) == list(bench.SHARES)
    assert all(isinstance(v, float) and 0 <= v <= 1 for v in shares.values()), shares
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["compute"] > 0 and shares["checkpoint_blocking"] > 0  # a save at step 20 and at the end
    assert result["seconds_per_step"]["total"] > 0
    assert result["dominant_idle_cause"] in bench.SHARES and result["dominant_idle_cause"] != "compute"
    assert result["dominant_idle_cause"] == max((k for k in shares if k != "compute"), key=lambda k: shares[k])
    assert isinstance(result["cpu_utilization"], float) and 0 < result["cpu_utilization"] < 16
    assert result["gpu_utilization"] is None  # no NVML here


@pytest.mark.cluster
@pytest.mark.xdist_group("scaling")
def test_bench_writes_the_baseline_and_both_plots(cluster: Cli) -> None:
    result = cluster("bench", str(QUICKSTART), "--nodes", "2,1", "--steps", str(STEPS), "--profile", "2")
    for words in (
        "quickstart: weak scaling",
        "traces in runs/quickstart-bench-2n/profiles/",
        "tokens/s",
        "efficiency",
        "dominant idle cause",
        "per-rank batch 8",
    ):
        assert words in result.stdout, result.stdout
    store = store_of(cluster)
    where = re.search(rf"baseline written to {re.escape(store.uri)}/bench/(\S+)/: ", result.stderr)
    assert where, result.stderr
    bench_id = where.group(1)
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{6}", bench_id)
    baseline = json.loads(store.get_bytes(f"bench/{bench_id}/baseline.json"))
    assert baseline["bench_id"] == bench_id
    assert baseline["run"] == "quickstart" and baseline["cluster"] == "local"
    assert baseline["model"] == {"layers": 2, "hidden": 64, "heads": 2, "seq_len": 64}
    assert baseline["parallel"] == "ddp" and baseline["scaling"] == "weak"
    assert "per-rank batch 8" in baseline["batch_rule"] and baseline["processes_per_node"] == 1
    assert baseline["counts"] == [1, 2] and baseline["steps"] == STEPS and baseline["warmup_steps"] == 5
    assert baseline["environment"]["torch"].startswith("2.") and baseline["environment"]["world_size"] == 1
    assert baseline["started"] <= baseline["finished"]
    assert baseline["exposed_comm_measure"].startswith("exact")
    assert baseline["gpu_utilization_source"].startswith("absent")
    one, two = baseline["results"]
    check_result(one, nodes=1, global_batch=8)
    check_result(two, nodes=2, global_batch=16)
    assert one["speedup"] == 1.0 and one["efficiency"] == 1.0
    assert baseline["efficiency_threshold"] == 0.8
    assert baseline["efficiency_below_80_at"] == (2 if two["efficiency"] < 0.8 else None)
    assert baseline["dominant_idle_cause"] == two["dominant_idle_cause"]
    assert baseline["plots"] == {
        "throughput": f"bench/{bench_id}/throughput.png",
        "split": f"bench/{bench_id}/split.png",
    }
    check_png(store.get_bytes(baseline["plots"]["throughput"]))
    check_png(store.get_bytes(baseline["plots"]["split"]))
    for nodes, result in ((1, one), (2, two)):
        # One trace per count, of the two steps after the measured ones.
        window = f"runs/quickstart-bench-{nodes}n/profiles/{STEPS + 1}-{STEPS + 2}"
        assert result["profile_traces"] == window
        assert {o.key for o in store.list(window + "/")} == {
            f"{window}/rank-{r}.pt.trace.json.gz" for r in range(nodes)
        }
    for nodes in (1, 2):
        record = runstore.read_run_record(store, f"quickstart-bench-{nodes}n")
        assert record is not None and record.last_attempt is not None
        assert record.last_attempt.outcome == "completed"
        assert record.last_attempt.nodes == [f"node-{i}" for i in range(nodes)]


@pytest.mark.cluster
@pytest.mark.xdist_group("scaling")
def test_bench_refuses_what_the_cluster_cannot_run(cluster: Cli) -> None:
    store = store_of(cluster)
    before = (bench_ids(store), runstore.list_runs(store))
    result = cluster("bench", str(QUICKSTART), "--nodes", "1,3", expect=2)
    assert one_line(result.stderr) == "error: --nodes: 3 exceeds the 2 node(s) of cluster 'local'"
    result = cluster("bench", str(QUICKSTART), "--nodes", "3", "--json", expect=2)
    assert json.loads(result.stdout)["error"] == {
        "message": "--nodes: 3 exceeds the 2 node(s) of cluster 'local'",
        "exit_code": 2,
        "field": "--nodes",
    }
    odd = write(cluster.cwd / "odd.yaml", QUICKSTART.read_text().replace("batch_size: 16", "batch_size: 9"))
    result = cluster("bench", str(odd), "--nodes", "1,2", expect=2)
    assert one_line(result.stderr) == (
        f"error: {odd}: batch_size: 9 does not split evenly over nodes.max x processes per node "
        "(2 x 1 = 2 ranks), where the per-rank batch is taken"
    )
    strong = write(cluster.cwd / "strong.yaml", QUICKSTART.read_text().replace("batch_size: 16", "batch_size: 1")
                   .replace("nodes: {min: 1, max: 2}", "nodes: {min: 1, max: 1}"))  # fmt: skip
    result = cluster("bench", str(strong), "--nodes", "1,2", "--strong", expect=2)
    assert one_line(result.stderr) == (
        f"error: {strong}: batch_size: 1 is smaller than the 2 data-parallel rank(s) of 2 node(s) x 1 "
        "process(es), as --nodes asks: a rank would idle"
    )
    assert (bench_ids(store), runstore.list_runs(store)) == before


@pytest.mark.cluster
@pytest.mark.xdist_group("scaling")
def test_bench_refuses_while_a_run_trains(cluster: Cli) -> None:
    cluster("train", str(REPO / "examples" / "elastic.yaml"), "--detach")
    try:
        result = cluster("bench", str(QUICKSTART), "--nodes", "1", expect=2)
        assert "run(s) elastic running on cluster 'local'; a bench needs the cluster idle" in one_line(result.stderr)
    finally:
        assert proc.kill_all(cluster.home / "local", run="elastic", timeout=30)[1] == []
