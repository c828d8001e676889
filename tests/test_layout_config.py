"""Invalid parallel layouts are refused with exit code 2 and one line naming the file and the
field, before anything is written: at every command that loads run.yaml (the layout against the
model), at `infractl train` on an up cluster (the layout against every world size of the node
range), and by the trainer itself (the layout against the world it was started on).

The model-level rules (infractl/config/run.py: ``ParallelSpec``, ``RunSpec._layout_fits_model``) go
through `infractl train` with no cluster up: the run file is loaded first, so these need none.
The world-size rules (``check_layout``) go through `infractl train` on one module-scoped
2-node x 1-process local cluster, and are unit-tested directly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_trainer import tiny_spec, torchrun

from infractl.config import ParallelSpec, RunSpec, check_layout, split_batch
from infractl.errors import ConfigError

from conftest import Cli, module_cluster, one_line, write

#: A small model every rule below is measured against: 4 heads, hidden 64, 4 layers.
MODEL = "model: {layers: 4, hidden: 64, heads: 4, seq_len: 32}\n"

# (id, run.yaml after `name:` and the model, the start of the message after `run.yaml: `)
INVALID = [
    (
        "unknown-shorthand",
        "parallel: zero3\n",
        "parallel: must be one of ddp, zero1, fsdp or a mapping of dp, dp_shard, tp, pp, pp_schedule, "
        "microbatches (got 'zero3')",
    ),
    ("dp-zero", "parallel: {dp: 0}\n", "parallel.dp: must be `auto` or a whole number from 1 to 4096 (got 0)"),
    ("dp-word", "parallel: {dp: x}\n", "parallel.dp: must be `auto` or a whole number from 1 to 4096 (got 'x')"),
    (
        "zero1-with-tp",
        "parallel: {dp_shard: zero1, tp: 2}\n",
        "parallel.dp_shard: zero1 needs tp: 1 and pp: 1; use fsdp to shard alongside tp or pp",
    ),
    (
        "zero1-with-pp",
        "parallel: {dp_shard: zero1, pp: 2}\n",
        "parallel.dp_shard: zero1 needs tp: 1 and pp: 1; use fsdp to shard alongside tp or pp",
    ),
    (
        "microbatches-below-pp",
        "parallel: {pp: 4, microbatches: 2}\n",
        "parallel.microbatches: 2 is fewer than the pipeline's 4 stage(s); a step needs at least one "
        "micro-batch per stage",
    ),
    (
        "tp-not-dividing-heads",
        "parallel: {tp: 8}\n",
        "parallel.tp: 8 must divide model.heads (4) and model.hidden (64): each tensor-parallel rank takes "
        "whole attention heads",
    ),
    (
        "pp-not-dividing-layers",
        "parallel: {pp: 3}\n",
        "parallel.pp: 3 stage(s) (1f1b) must split model.layers (4) evenly",
    ),
    (
        "interleaved-stages-not-dividing-layers",
        "parallel: {pp: 4, pp_schedule: interleaved-1f1b}\n",
        "parallel.pp: 8 stage(s) (interleaved-1f1b) must split model.layers (4) evenly",
    ),
    (
        "interleaved-without-a-pipeline",
        "parallel: {pp_schedule: interleaved-1f1b}\n",
        "parallel.pp_schedule: interleaved-1f1b needs pp of at least 2",
    ),
    (
        "unknown-pp-schedule",
        "parallel: {pp: 2, pp_schedule: zb}\n",
        "parallel.pp_schedule: Input should be 'gpipe', '1f1b' or 'interleaved-1f1b'",
    ),
    (
        "batch-below-fixed-dp",
        "batch_size: 2\nparallel: {dp: 4}\n",
        "batch_size: 2 is smaller than parallel.dp (4): a replica would idle",
    ),
    (
        "cpu-offload-without-fsdp",
        "cpu_offload: true\nparallel: {dp_shard: none, tp: 2}\n",
        "cpu_offload: needs parallel: fsdp (parallel is ddp x tp2); only FSDP shards can live on the CPU",
    ),
    ("unknown-field", "parallel: {tpp: 2}\n", "parallel.tpp: unknown field"),
]


@pytest.mark.parametrize(("body", "message"), [case[1:] for case in INVALID], ids=[case[0] for case in INVALID])
def test_invalid_layout_is_one_line_naming_the_field_and_nothing_is_written(cli: Cli, body: str, message: str) -> None:
    run = write(cli.cwd / "run.yaml", "name: r\n" + MODEL + body)
    result = cli("train", str(run), expect=2)
    assert one_line(result.stderr) == f"error: {run}: {message}"
    assert "Traceback" not in result.stdout
    assert not cli.home.exists()  # no cluster state, no lock, no store


def test_tp_not_dividing_seq_len_is_refused(cli: Cli) -> None:
    run = write(cli.cwd / "run.yaml", "name: r\nmodel: {hidden: 64, heads: 4, seq_len: 66}\nparallel: {tp: 4}\n")
    result = cli("train", str(run), expect=2)
    assert one_line(result.stderr) == (
        f"error: {run}: parallel.tp: 4 must divide model.seq_len (66): sequence parallel splits each sample's "
        "tokens over the tensor-parallel ranks"
    )
    assert not cli.home.exists()


def test_tp_not_dividing_hidden_alone_cannot_happen_the_model_refuses_it_first(cli: Cli) -> None:
    # tp must divide heads, and heads must divide hidden (ModelSpec), so a tp that divides heads
    # divides hidden too: a hidden size tp does not divide fails the model's own rule first.
    run = write(cli.cwd / "run.yaml", "name: r\nmodel: {hidden: 66, heads: 4}\nparallel: {tp: 4}\n")
    line = one_line(cli("train", str(run), expect=2).stderr)
    assert line == f"error: {run}: model: hidden (66) must be divisible by heads (4)"


def test_json_refusal_carries_the_field(cli: Cli) -> None:
    run = write(cli.cwd / "run.yaml", "name: r\n" + MODEL + "parallel: {tp: 8}\n")
    error = json.loads(cli("train", str(run), "--json", expect=2).stdout)["error"]
    assert (error["field"], error["exit_code"]) == ("parallel.tp", 2)
    assert error["message"].startswith(f"{run}: parallel.tp: 8 must divide model.heads (4)")


# --- the layout against the world sizes of a node range: `infractl train` on an up cluster -------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    with module_cluster(tmp_path_factory, "layout") as cli:
        yield cli


def _files(cli: Cli) -> dict[str, tuple[int, int]]:
    """Every file of the cluster's state and store, with its size and mtime; the lock (taken by
    any command) and the rendezvous server's log are left out."""
    return {
        str(p.relative_to(cli.home)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in cli.home.rglob("*")
        if p.is_file() and p.name not in ("lock", "rendezvous.log")
    }


# (id, run.yaml after `name:`, the field, the message after `run.yaml: <field>: `)
UNFIT = [
    (
        "tp-on-one-node",
        "parallel: {tp: 2}\nnodes: {min: 1, max: 2}\n",
        "parallel",
        "tp x pp = 2 rank(s) per model copy does not divide the world size 1 (1 node(s) x 1 process(es), "
        "in the range nodes.min to nodes.max)",
    ),
    (
        "fixed-dp-on-one-node",
        "parallel: {dp: 2}\nnodes: {min: 1, max: 2}\n",
        "parallel",
        "dp 2 x tp 1 x pp 1 = 2 rank(s), not the world size 1; use dp: auto to follow the world size "
        "(1 node(s) x 1 process(es), in the range nodes.min to nodes.max)",
    ),
    (
        "pipeline-batch-not-splitting",
        "batch_size: 6\nparallel: {pp: 2, microbatches: 4}\nnodes: {min: 2, max: 2}\n",
        "batch_size",
        "6 does not split into 1 data-parallel rank(s) x 4 pipeline micro-batches of equal size "
        "(2 node(s) x 1 process(es), in the range nodes.min to nodes.max); the pipeline needs equal micro-batches",
    ),
    (
        "batch-below-dp-on-two-nodes",
        "batch_size: 1\nnodes: {min: 1, max: 2}\n",
        "batch_size",
        "1 is smaller than the 2 data-parallel rank(s) of 2 node(s) x 1 process(es), in the range nodes.min "
        "to nodes.max: a rank would idle",
    ),
]


@pytest.mark.cluster
@pytest.mark.xdist_group("layout-cluster")
@pytest.mark.parametrize(("body", "field", "message"), [c[1:] for c in UNFIT], ids=[c[0] for c in UNFIT])
def test_a_node_range_the_layout_cannot_use_is_refused_at_train(
    cluster: Cli, body: str, field: str, message: str
) -> None:
    run = write(cluster.cwd / "run.yaml", "name: unfit\n" + MODEL + body)
    before = _files(cluster)
    result = cluster("train", str(run), expect=2)
    assert one_line(result.stderr) == f"error: {run}: {field}: {message}"
    assert "Traceback" not in result.stdout
    assert _files(cluster) == before
    assert not (cluster.home / "local" / "store" / "runs" / "unfit").exists()


# --- check_layout, ParallelSpec and split_batch (unit) ---------------------------------------


def _spec(parallel: Any, **fields: Any) -> RunSpec:
    return RunSpec.model_validate(
        {"name": "r", "model": {"layers": 4, "hidden": 64, "heads": 4}, **fields, "parallel": parallel}
    )


def _worlds(*sizes: int) -> list[tuple[int, str]]:
    return [(size, f"{size} rank(s)") for size in sizes]


@pytest.mark.parametrize(
    ("parallel", "fields", "worlds", "field", "message"),
    [
        (
            {"tp": 2},
            {},
            (2, 3),
            "parallel",
            "tp x pp = 2 rank(s) per model copy does not divide the world size 3 (3 rank(s))",
        ),
        (
            {"tp": 2, "pp": 2},
            {},
            (4, 6),
            "parallel",
            "tp x pp = 4 rank(s) per model copy does not divide the world size 6",
        ),
        ({"dp": 2}, {}, (2, 4), "parallel", "dp 2 x tp 1 x pp 1 = 2 rank(s), not the world size 4; use dp: auto"),
        ({"dp": 2, "tp": 2}, {}, (2,), "parallel", "dp 2 x tp 2 x pp 1 = 4 rank(s), not the world size 2"),
        (
            "ddp",
            {"batch_size": 3},
            (1, 2, 3, 4),
            "batch_size",
            "3 is smaller than the 4 data-parallel rank(s) of 4 rank(s): a rank would idle",
        ),
        (
            {"pp": 2, "microbatches": 4},
            {"batch_size": 6},
            (2,),
            "batch_size",
            "6 does not split into 1 data-parallel rank(s) x 4 pipeline micro-batches of equal size (2 rank(s))",
        ),
        (
            {"pp": 2},
            {"batch_size": 8},
            (2, 4, 6),
            "batch_size",
            "8 does not split into 3 data-parallel rank(s) x 2 pipeline micro-batches",
        ),
    ],
    ids=["tp-on-3", "tp-pp-on-6", "dp-on-4", "dp-tp-on-2", "batch-below-dp", "pipeline-on-2", "pipeline-on-6"],
)
def test_check_layout_names_the_field_and_the_world_it_cannot_use(
    parallel: Any, fields: dict[str, Any], worlds: tuple[int, ...], field: str, message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        check_layout(_spec(parallel, **fields), _worlds(*worlds), file="run.yaml")
    assert (refused.value.field, refused.value.exit_code) == (field, 2)
    assert str(refused.value).startswith(f"run.yaml: {field}: {message}")


def test_check_layout_accepts_every_world_a_layout_can_use() -> None:
    # Uneven splits are fine without a pipeline: 10 samples over 3 or 4 data-parallel ranks.
    check_layout(_spec("ddp", batch_size=10), _worlds(1, 2, 3, 4), file="run.yaml")
    check_layout(_spec({"dp_shard": "fsdp", "tp": 2}), _worlds(2, 4, 8), file="run.yaml")
    check_layout(_spec({"dp": 2, "tp": 2, "pp": 2}), _worlds(8), file="run.yaml")
    check_layout(_spec({"pp": 2, "microbatches": 4}, batch_size=16), _worlds(2, 4), file="run.yaml")


@pytest.mark.parametrize(
    ("parallel", "label"),
    [
        ("ddp", "ddp"),
        ("zero1", "zero1"),
        ("fsdp", "fsdp"),
        ({"dp": 4}, "ddp4"),
        ({"dp_shard": "fsdp", "tp": 2}, "fsdp x tp2"),
        ({"pp": 2}, "ddp x pp2 (1f1b, 2 micro-batches)"),
        (
            {"dp": 2, "tp": 2, "pp": 2, "pp_schedule": "gpipe", "microbatches": 8},
            "ddp2 x tp2 x pp2 (gpipe, 8 micro-batches)",
        ),
    ],
)
def test_label_names_the_layout(parallel: Any, label: str) -> None:
    assert ParallelSpec.model_validate(parallel).label == label


def test_dp_degree_is_what_tp_and_pp_leave_of_the_world() -> None:
    assert ParallelSpec().dp_degree(1) == 1
    assert ParallelSpec(tp=2).dp_degree(8) == 4
    assert ParallelSpec(tp=2, pp=2).dp_degree(8) == 2
    assert ParallelSpec(dp=2, tp=2).dp_degree(4) == 2
    with pytest.raises(ValueError, match=r"tp x pp = 4 rank\(s\) per model copy does not divide the world size 6"):
        ParallelSpec(tp=2, pp=2).dp_degree(6)
    with pytest.raises(ValueError, match=r"dp 2 x tp 2 x pp 1 = 4 rank\(s\), not the world size 8"):
        ParallelSpec(dp=2, tp=2).dp_degree(8)


def test_split_batch_is_as_even_as_can_be_and_keeps_every_sample() -> None:
    assert split_batch(16, 4) == [4, 4, 4, 4]
    assert split_batch(10, 4) == [3, 3, 2, 2]
    assert split_batch(7, 1) == [7]
    for batch_size in range(1, 40):
        for parts in range(1, batch_size + 1):
            shares = split_batch(batch_size, parts)
            assert len(shares) == parts and sum(shares) == batch_size and max(shares) - min(shares) <= 1
    with pytest.raises(ValueError, match="parts must be at least 1"):
        split_batch(8, 0)


# --- the trainer refuses a world its layout cannot use (real torchrun) -----------------------


@pytest.mark.cluster
def test_trainer_refuses_a_layout_that_does_not_fit_its_world(tmp_path: Path) -> None:
    run = torchrun(tmp_path, tiny_spec(parallel=ParallelSpec(tp=2)), nproc=1)
    # torchrun's agent exits 1 when a worker fails; it reports the worker's own exit code, 2.
    assert run.returncodes == [1], run.stderr[-4000:]
    assert "failed (exitcode: 2)" in run.stderr
    errors = [e["event"] for e in run.events if e["level"] == "error"]
    assert errors == [
        f"{tmp_path / 'spec-1.json'}: parallel: tp x pp = 2 rank(s) per model copy does not divide "
        "the world size 1 (1 rank(s))"
    ], run.stderr
    assert [e["reason"] for e in run.event("stopped")] == ["refused"]
    assert run.event("rank_joined") == []  # refused before joining the process group
    assert list((tmp_path / "store").iterdir()) == []  # no checkpoint, no metrics
    assert not (tmp_path / "node0").exists() or not any((tmp_path / "node0").rglob("*"))
