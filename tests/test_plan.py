"""`infractl plan`: the memory model against the real model, the search, and its refusals."""

from __future__ import annotations

import json

import pytest
import torch

from infractl.config import ModelSpec
from infractl.planning import memory
from trainer.model import GPT, GPTConfig

from conftest import REPO, Cli, write

BIG = "name: big\nmodel: {layers: 96, hidden: 16384, heads: 128, seq_len: 2048}\nbatch_size: 64\n"


@pytest.mark.parametrize(
    ("layers", "hidden", "heads", "seq_len"), [(2, 64, 2, 64), (4, 256, 4, 128), (12, 768, 12, 1024)]
)
def test_parameter_count_is_the_models(layers: int, hidden: int, heads: int, seq_len: int) -> None:
    spec = ModelSpec(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len)
    with torch.device("meta"):
        real = sum(p.numel() for p in GPT(GPTConfig.from_spec(spec)).parameters())
    assert memory.parameters(spec) == real


def test_sharding_and_checkpointing_only_ever_lower_the_budget() -> None:
    model = ModelSpec(layers=8, hidden=512, heads=8, seq_len=512)
    totals = [memory.budget(model, scheme=s, ranks=4, micro_batch=4).total for s in memory.SCHEMES]
    assert totals[0] == totals[1] + memory.budget(model, scheme="zero1", ranks=4, micro_batch=4).optimizer * 3
    assert totals[1] > totals[2] > totals[3]
    plain = memory.budget(model, scheme="fsdp", ranks=4, micro_batch=4)
    checkpointed = memory.budget(model, scheme="fsdp", ranks=4, micro_batch=4, checkpointing=True)
    assert checkpointed.activations < plain.activations / 4 and checkpointed.model_states == plain.model_states
    bf16 = memory.budget(model, scheme="fsdp", ranks=4, micro_batch=4, precision="bf16")
    assert bf16.activations < plain.activations
    terms = memory.terms(model, scheme="fsdp", ranks=4, micro_batch=4)
    assert sum(t.bytes for t in terms) == plain.total


def test_plan_recommends_plain_data_parallel_when_it_fits(cli: Cli) -> None:
    result = cli("plan", str(REPO / "examples" / "quickstart.yaml"), "--json")
    plan = json.loads(result.stdout)
    assert plan["recommended"]["scheme"] == "ddp" and plan["recommended"]["devices"] == 1
    assert plan["recommended"]["staging_host_bytes"] > 0
    schemes = {o["scheme"] for o in plan["options"]}
    assert {"ddp", "zero1", "zero2", "fsdp"} <= schemes
    assert not next(o for o in plan["options"] if o["scheme"] == "zero2")["runnable"]
    explained = cli("plan", str(REPO / "examples" / "quickstart.yaml"), "--explain").stdout
    assert "parameters Ψ = V·h + s·h + L·(12h² + 13h) + 2h = 120,576" in explained
    assert "recommended: ddp on 1 device(s)" in explained


def test_plan_shards_before_it_adds_devices(cli: Cli) -> None:
    run = write(cli.cwd / "run.yaml", "name: mid\nmodel: {layers: 48, hidden: 8192, heads: 64, seq_len: 2048}\n"
                                      "batch_size: 64\n")  # fmt: skip
    plan = json.loads(cli("plan", str(run), "--device", "h100-80gb", "--gpus-per-node", "8", "--json").stdout)
    rec = plan["recommended"]
    assert rec["scheme"] == "fsdp" and rec["devices"] > 1, rec
    assert rec["budget"]["total"] <= plan["device_memory_bytes"]


def test_a_run_that_fits_nowhere_names_the_smallest_shortfall(cli: Cli) -> None:
    run = write(cli.cwd / "big.yaml", BIG)
    result = cli("plan", str(run), "--device", "h100-80gb", "--gpus-per-node", "8", "--max-nodes", "2", expect=2)
    line = result.stderr.strip()
    assert line.startswith("error: --max-nodes: run 'big' fits on no h100-80gb within 2 node(s) of 8: the closest, ")
    assert "more than its" in line and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "tpu-v9"], "--device: unknown device 'tpu-v9' (one of: cpu, a100-40gb"),
        (["--max-nodes", "0"], "Invalid value for '--max-nodes'"),
        (["--gpus-per-node", "-1"], "Invalid value for '--gpus-per-node'"),
    ],
)
def test_bad_plan_arguments_are_one_line(cli: Cli, args: list[str], message: str) -> None:
    result = cli("plan", str(REPO / "examples" / "quickstart.yaml"), *args, expect=2)
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
