"""`infractl plan`: the memory model against the real model, the search, and its refusals; and
`plan --measure` on one real 2-node local cluster (module-scoped): for four data-parallel
configurations and a tensor- and a pipeline-parallel one the prediction must match what the
ranks measured."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from infractl.config import ModelSpec, load_run
from infractl.errors import UsageError
from infractl.planning import memory
from infractl.planning.devices import Device
from infractl.planning.plan import refuse_unless_fits
from infractl.store import FileStore
from trainer.held import EmulatedDevice
from trainer.model import GPT, GPTConfig, token_loss
from trainer.parallelize import _TP_PLAN

from conftest import REPO, Cli, module_cluster, write

BIG = "name: big\nmodel: {layers: 96, hidden: 16384, heads: 128, seq_len: 2048}\nbatch_size: 64\n"


@pytest.mark.parametrize(
    ("layers", "hidden", "heads", "seq_len"), [(2, 64, 2, 64), (4, 256, 4, 128), (12, 768, 12, 1024)]
)
def test_parameter_count_is_the_models(layers: int, hidden: int, heads: int, seq_len: int) -> None:
    spec = ModelSpec(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len)
    with torch.device("meta"):
        real = sum(p.numel() for p in GPT(GPTConfig.from_spec(spec)).parameters())
    assert memory.parameters(spec) == real


def test_attention_keeps_one_bf16_copy_of_its_input_under_autocast() -> None:
    # What the planner counts: q, k and v share one bf16 copy of the norm's output (each casting
    # it again under autocast would keep three).
    attn = GPT(GPTConfig.from_spec(ModelSpec(layers=1, hidden=32, heads=2, seq_len=8))).blocks["0"].attn
    x = torch.randn(2, 8, 32)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attn(x)
    cast = x.bfloat16()
    copies = {
        t.untyped_storage().data_ptr()
        for t in saved
        if t.dtype == cast.dtype and t.numel() == cast.numel() and torch.equal(t.reshape(cast.shape), cast)
    }
    assert len(copies) == 1


def test_the_trainer_imports_pipelining_only_for_pipeline_runs() -> None:
    # torch.distributed.pipelining sets up libtorch's CPU runtime on import: imported before the
    # memory probe's baseline, `plan --measure` would not see that memory (trainer/parallelize.py).
    code = "import sys, trainer.train; assert 'torch.distributed.pipelining' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


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


@pytest.mark.parametrize("tp", [2, 4])
def test_a_tensor_parallel_ranks_parameters_are_the_models_split_by_the_trainers_plan(tp: int) -> None:
    spec = ModelSpec(layers=3, hidden=256, heads=4, seq_len=64)
    with torch.device("meta"):
        model = GPT(GPTConfig.from_spec(spec))
    per_rank = 0
    for name, p in model.named_parameters():
        _, _, rest = name.partition("blocks.")
        style = _TP_PLAN.get(rest.split(".", 1)[-1].rpartition(".")[0]) if rest else None
        weight = name.endswith("weight")
        split = isinstance(style, ColwiseParallel) or (isinstance(style, RowwiseParallel) and weight)
        per_rank += p.numel() // tp if split else p.numel()
    assert memory.rank_parameters(spec, tp=tp) == per_rank
    assert memory.rank_parameters(spec) == memory.parameters(spec)


@pytest.mark.parametrize("pp", [2, 4])
def test_a_pipeline_ranks_parameters_are_its_largest_stages(pp: int) -> None:
    spec = ModelSpec(layers=4, hidden=64, heads=2, seq_len=128)
    stages = []
    for index in range(pp):
        with torch.device("meta"):
            stages.append(sum(p.numel() for p in GPT(GPTConfig.from_spec(spec)).stage(index, pp).parameters()))
    assert memory.rank_parameters(spec, pp=pp) == stages[0] == max(stages)


def test_a_pipeline_holds_the_activations_of_the_micro_batches_in_flight() -> None:
    model = ModelSpec(layers=4, hidden=256, heads=4, seq_len=128)
    whole = memory.budget(model, scheme="ddp", ranks=1, micro_batch=16)
    # Two stages of two blocks, each holding both 8-sequence micro-batches: half the blocks'
    # activations of the whole batch, the head's all.
    staged = memory.budget(model, scheme="ddp", ranks=1, micro_batch=8, split=memory.ModelSplit(pp=2, held=2))
    head = next(t for t in memory.terms(model, scheme="ddp", ranks=1, micro_batch=16) if t.what.startswith("head"))
    assert staged.activations == (whole.activations - head.bytes) // 2 + head.bytes
    # No DDP buckets on one data-parallel rank: only the head's backward (the logits, the loss's two gradients).
    assert staged.temporary == (4 + 8) * 8 * 128 * memory.VOCAB
    assert memory.held_microbatches(2, 8, "gpipe") == 8 and memory.held_microbatches(2, 8, "1f1b") == 2


def test_plan_recommends_plain_data_parallel_when_it_fits(cli: Cli) -> None:
    result = cli("plan", str(REPO / "examples" / "quickstart.yaml"), "--json")
    plan = json.loads(result.stdout)
    assert plan["recommended"]["scheme"] == "ddp" and plan["recommended"]["devices"] == 1
    assert plan["recommended"]["parallel"] == "ddp" and plan["recommended"]["staging_host_bytes"] > 0
    options = {o["scheme"]: o for o in plan["options"]}
    assert {"ddp", "zero1", "zero2", "fsdp"} <= set(options)
    assert not options["zero2"]["runnable"] and options["zero2"]["parallel"] is None
    # quickstart: 2 layers, 2 heads; one rank per node: tensor parallel within a node has no room.
    assert options["pp=2"]["runnable"] and options["pp=2"]["parallel"] == {"pp": 2}
    assert options["pp=2"]["devices"] == 2 and not any(s.startswith("tp=") for s in options)
    explained = cli("plan", str(REPO / "examples" / "quickstart.yaml"), "--explain").stdout
    assert "parameters Ψ = V·h + s·h + L·(12h² + 13h) + 2h = 120,576" in explained
    assert "recommended: ddp on 1 device(s)" in explained and "in run.yaml: parallel: ddp;" in explained


def test_plan_shards_before_it_adds_devices(cli: Cli) -> None:
    run = write(cli.cwd / "run.yaml", "name: mid\nmodel: {layers: 48, hidden: 8192, heads: 64, seq_len: 2048}\n"
                                      "batch_size: 64\n")  # fmt: skip
    plan = json.loads(cli("plan", str(run), "--device", "h100-80gb", "--gpus-per-node", "8", "--json").stdout)
    rec = plan["recommended"]
    assert rec["scheme"] == "fsdp" and rec["devices"] > 1, rec
    assert rec["budget"]["total"] <= plan["device_memory_bytes"]


def test_a_run_no_way_fits_in_one_pass_is_recommended_gradient_accumulation(cli: Cli) -> None:
    # MPT-70B's shape and global batch on 64 H100s (their layout accumulates 4 passes of 8): one pass of
    # each rank's 32 sequences fits no way; fsdp with checkpointing and bf16 fits 2 passes of 16.
    run = write(cli.cwd / "mpt.yaml", "name: mpt\nmodel: {layers: 80, hidden: 8192, heads: 64, seq_len: 2048}\n"
                                      "batch_size: 2048\n")  # fmt: skip
    args = ["plan", str(run), "--device", "h100-80gb", "--gpus-per-node", "8", "--max-nodes", "8"]
    plan = json.loads(cli(*args, "--json").stdout)
    rec = plan["recommended"]
    assert (rec["scheme"], rec["devices"], rec["micro_batch"], rec["accumulation"]) == ("fsdp", 64, 16, 2), rec
    assert rec["activation_checkpointing"] and rec["mixed_precision"] == "bf16"
    assert rec["budget"]["total"] <= plan["device_memory_bytes"]
    whole = [o for o in plan["options"] if o["accumulation"] == 1]
    assert whole and all(o["devices"] is None for o in whole)
    advice = cli(*args).stdout
    assert (
        "fsdp + activation checkpointing + bf16 + gradient accumulation on 64 device(s), 8 node(s) in 2 passes"
        in advice
    )
    assert "mixed_precision: bf16, micro_batch: 16;" in advice
    # With run.yaml's own micro-batch (theirs), every way is sized with it: fsdp fits in one pass of 8 fewer devices.
    capped = write(cli.cwd / "capped.yaml", run.read_text() + "micro_batch: 8\n")
    rec = json.loads(cli(*args[:1], str(capped), *args[2:], "--json").stdout)["recommended"]
    assert rec["micro_batch"] == 8 and not rec["scheme"].endswith("accumulation") and rec["devices"] <= 64, rec


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
        (["--steps", "3"], "--steps: only with --measure"),
        (["--measure", "--device", "h200"], "--device: --measure measures the cluster's own devices"),
        (["--measure", "--steps", "0"], "Invalid value for '--steps'"),
        (["--measure", "--apply"], "--apply: only without --measure"),
    ],
)
def test_bad_plan_arguments_are_one_line(cli: Cli, args: list[str], message: str) -> None:
    result = cli("plan", str(REPO / "examples" / "quickstart.yaml"), *args, expect=2)
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


# A run whose activations outweigh the rest: at 2 devices of 68 MiB, plain ddp needs 81 MiB by the
# plan and activation checkpointing 64 MiB; the emulated device counts 72 MiB for ddp's forward.
SQUEEZED = """\
# the team's own notes stay
name: squeezed
model: {layers: 2, hidden: 64, heads: 2, seq_len: 128}
batch_size: 64
parallel:
  dp: 2
nodes: {min: 2, max: 2}
steps: 60 # trailing
"""
EMULATED_68_MIB = {"INFRACTL_DEVICE_MEMORY": str(68 << 20)}


def test_apply_writes_the_first_way_that_fits_the_smallest_world_and_keeps_the_rest_of_the_file(cli: Cli) -> None:
    run = write(cli.cwd / "squeezed.yaml", SQUEEZED)
    plan = ["plan", str(run), "--max-nodes", "2"]
    shown = json.loads(cli(*plan, "--json", env=EMULATED_68_MIB).stdout)
    assert shown["device"] == "cpu (emulated)" and shown["device_memory_bytes"] == 68 << 20
    assert [o["devices"] for o in shown["options"][:4]] == [None, None, None, None]  # no scheme alone fits
    applied = json.loads(cli(*plan, "--apply", "--json", env=EMULATED_68_MIB).stdout)["applied"]
    assert applied == {
        "way": "ddp + activation checkpointing",
        "changed": {"parallel": "ddp", "activation_checkpointing": True},
    }
    assert run.read_text() == (
        SQUEEZED.replace("parallel:\n  dp: 2\n", "parallel: ddp\n") + "activation_checkpointing: true\n"
    )
    again = json.loads(cli(*plan, "--apply", "--json", env=EMULATED_68_MIB).stdout)["applied"]
    assert again == {"way": "ddp + activation checkpointing", "changed": {}}
    # Nothing fits a smaller device: exit 2, the file as it was.
    before = run.read_text()
    refused = cli(*plan, "--apply", env={"INFRACTL_DEVICE_MEMORY": str(30 << 20)}, expect=2).stderr
    assert refused.startswith("error: --max-nodes: run 'squeezed' fits on no cpu (emulated) within 2 node(s)")
    assert run.read_text() == before
    # An elastic run may go on with one node, whose rank then takes the whole batch in two passes of the
    # 32 it takes on two nodes (as the trainer sizes them): checkpointed ddp fits that too.
    elastic = write(cli.cwd / "elastic.yaml", SQUEEZED.replace("{min: 2,", "{min: 1,"))
    applied = json.loads(cli("plan", str(elastic), "--max-nodes", "2", "--apply", "--json", env=EMULATED_68_MIB).stdout)
    assert applied["applied"] == {
        "way": "ddp + activation checkpointing",
        "changed": {"parallel": "ddp", "activation_checkpointing": True},
    }
    # A run of one node takes all 64 in one pass: no way fits that; checkpointed ddp fits passes of 32.
    alone = write(cli.cwd / "alone.yaml", SQUEEZED.replace("{min: 2, max: 2}", "{min: 1, max: 1}"))
    applied = json.loads(cli("plan", str(alone), "--max-nodes", "2", "--apply", "--json", env=EMULATED_68_MIB).stdout)
    assert applied["applied"] == {
        "way": "ddp + activation checkpointing + gradient accumulation",
        "changed": {"parallel": "ddp", "activation_checkpointing": True, "micro_batch": 32},
    }
    assert alone.read_text() == (
        SQUEEZED.replace("{min: 2, max: 2}", "{min: 1, max: 1}").replace("parallel:\n  dp: 2\n", "parallel: ddp\n")
        + "activation_checkpointing: true\nmicro_batch: 32\n"
    )
    # Weights that only fit sharded over two devices fit one in no pass however small: refused, the file as it was.
    weighty = "name: weighty\nmodel: {layers: 4, hidden: 512, heads: 8, seq_len: 64}\nbatch_size: 8\nnodes: {max: 2}\n"
    single = write(cli.cwd / "weighty.yaml", weighty)
    env = {"INFRACTL_DEVICE_MEMORY": str(180 << 20)}
    assert (
        json.loads(cli("plan", str(single), "--max-nodes", "2", "--json", env=env).stdout)["recommended"]["devices"]
        == 2
    )
    refused = cli("plan", str(single), "--max-nodes", "2", "--apply", env=env, expect=2).stderr
    assert refused.startswith("error: --apply: no way to train run 'weighty' fits its smallest world, nodes.min 1 x 1")
    assert single.read_text() == weighty
    refused = cli(*plan, env={"INFRACTL_DEVICE_MEMORY": "68MiB"}, expect=2).stderr
    assert refused.strip() == "error: $INFRACTL_DEVICE_MEMORY: must be a positive number of bytes, got '68MiB'"


def test_trains_check_sizes_the_passes_run_yaml_caps(tmp_path: Path) -> None:
    # The runs above: one node's 64 sequences in 2 passes of 32 fit 68 MiB, one pass does not.
    whole = load_run(
        write(tmp_path / "whole.yaml", SQUEEZED.replace("parallel:\n  dp: 2\n", "activation_checkpointing: true\n"))
    )
    device = Device("cpu (emulated)", 68 << 20, peak_bf16_flops=None, cuda=False)
    fits = functools.partial(refuse_unless_fits, device=device, processes=1, cluster="c", file="run.yaml")
    with pytest.raises(UsageError, match="does not fit the devices of cluster 'c'"):
        fits(whole, nodes=(1, 1))
    fits(whole.model_copy(update={"micro_batch": 32}), nodes=(1, 1))
    fits(whole, nodes=(1, 2))  # sized for two nodes, one node takes 2 passes of the same size


def test_the_emulated_device_raises_cudas_exception_part_way_through_the_forward() -> None:
    torch.manual_seed(0)
    spec = load_run(write(Path(tempfile.mkdtemp()) / "squeezed.yaml", SQUEEZED))
    model = GPT(GPTConfig(**spec.model.model_dump()))
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, memory.VOCAB, (32, spec.model.seq_len))
    planned = memory.budget(spec.model, scheme="ddp", ranks=2, micro_batch=32, precision="fp32", cuda=False)
    fits = EmulatedDevice(model, optimizer, capacity=80 << 20, reserve=planned.reserve)
    with fits.watching():
        token_loss(model(tokens), tokens).backward()
    # What it counted is the plan's: the runtime's reserve, parameters and gradients, and the activations.
    assert fits.resident == planned.reserve + planned.parameters + planned.gradients
    assert abs(fits.saved - planned.activations) < 0.02 * planned.activations
    optimizer.step()  # AdamW's state: held from the next step on
    squeezed = EmulatedDevice(model, optimizer, capacity=68 << 20, reserve=planned.reserve)
    with pytest.raises(torch.OutOfMemoryError, match="tried to allocate .* the device's capacity is 68.00 MiB"):
        with squeezed.watching():
            token_loss(model(tokens), tokens)
    assert squeezed.resident - fits.resident == pytest.approx(planned.optimizer, rel=1e-3)  # and its step counters
    assert 0 < squeezed.saved < fits.saved  # it stopped part-way through


# Sizes where the model's tensors outweigh the runtime's 30 MiB, so every component counts.
MEASURED = sorted((REPO / "examples" / "memory").glob("*.yaml"))
TOLERANCE = {"parameters": 0.10, "gradients": 0.10, "optimizer": 0.10, "activations": 0.20, "peak": 0.25}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    with module_cluster(tmp_path_factory, "plan") as cli:
        yield cli


def test_four_configurations_cover_every_scheme_precision_and_checkpointing() -> None:
    specs = [load_run(p) for p in MEASURED]
    assert len(specs) == 4 and [s.name for s in specs] == [p.stem for p in MEASURED]
    assert {s.parallel.label for s in specs} == {"ddp", "zero1", "fsdp"}
    assert {s.mixed_precision for s in specs} == {"fp32", "bf16"}
    assert {s.activation_checkpointing for s in specs} == {True, False}
    assert {(s.nodes.min, s.nodes.max) for s in specs} == {(2, 2)}


@pytest.mark.cluster
@pytest.mark.xdist_group("plan-measure")
@pytest.mark.parametrize("run", MEASURED, ids=[p.stem for p in MEASURED])
def test_plan_matches_what_two_ranks_measure(cluster: Cli, run: Path) -> None:
    name = run.stem  # each file's run name
    # Two steps: the second holds the steady state (AdamW's state is made in the first).
    result = json.loads(cluster("plan", str(run), "--measure", "--steps", "2", "--json").stdout)
    assert result["world_size"] == 2 and result["device"] == "cpu" and len(result["reports"]) == 2
    for component, tolerance in TOLERANCE.items():
        predicted, measured = result["predicted"][component], result["measured"][component]
        assert abs(measured - predicted) <= tolerance * predicted, (component, predicted, measured, result)
        assert result["error"][component] == pytest.approx((measured - predicted) / predicted, abs=1e-4)
    store = FileStore(cluster.home / "local" / "store")
    assert json.loads(store.get_bytes(f"plan/{name}/measured.json")) == result
    assert store.list(f"runs/{name}-memory/") == []  # the probe run is gone


def test_a_run_only_tensor_parallelism_fits_is_recommended_with_its_mapping(cli: Cli) -> None:
    # Batch 1 cannot be split over data-parallel ranks: only splitting each layer helps.
    run = write(cli.cwd / "wide.yaml", "name: wide\nmodel: {layers: 4, hidden: 16384, heads: 128, seq_len: 2048}\n"
                                       "batch_size: 1\n")  # fmt: skip
    args = ["plan", str(run), "--device", "l40s", "--gpus-per-node", "8", "--max-nodes", "1"]
    plan = json.loads(cli(*args, "--json").stdout)
    rec = plan["recommended"]
    assert (rec["scheme"], rec["parallel"], rec["devices"], rec["nodes"]) == ("tp=8", {"tp": 8}, 8, 1)
    assert rec["budget"]["total"] <= plan["device_memory_bytes"]
    options = {o["scheme"]: o for o in plan["options"]}
    assert all(o["devices"] is None for s, o in options.items() if s != "tp=8"), options
    assert options["tp=4"]["shortfall_bytes"] > 0 and "pp=2" not in options  # one sequence: no micro-batches
    advice = cli(*args).stdout
    assert "recommended: tp=8 on 8 device(s), 1 node(s)" in advice and "in run.yaml: parallel: {tp: 8};" in advice


def test_a_run_whose_depth_fits_only_in_stages_is_recommended_a_pipeline(cli: Cli) -> None:
    # Four 12288-wide layers on 40 GB devices, two a node: four stages over two nodes fit; tensor
    # parallel stays within a node, and two ranks' shares of every layer do not fit, nor does fsdp.
    run = write(cli.cwd / "deep.yaml", "name: deep\nmodel: {layers: 4, hidden: 12288, heads: 32, seq_len: 2048}\n"
                                       "batch_size: 4\n")  # fmt: skip
    args = ["plan", str(run), "--device", "a100-40gb", "--gpus-per-node", "2", "--max-nodes", "2"]
    plan = json.loads(cli(*args, "--json").stdout)
    rec = plan["recommended"]
    assert (rec["scheme"], rec["parallel"], rec["devices"], rec["nodes"]) == ("pp=4", {"pp": 4}, 4, 2)
    options = {o["scheme"]: o for o in plan["options"]}
    assert options["tp=2"]["devices"] is None and "tp=4" not in options
    assert all(options[s]["devices"] is None for s in ("ddp", "zero1", "fsdp"))
    explained = cli(*args, "--explain").stdout
    assert "pp=4 on 4 device(s), N = 1 data-parallel x t = 1 tensor x p = 4 pipeline: micro batch b = 1," in explained
    assert "one rank's Ψᵣ (the first stage's, the largest) = 1,840,410,624" in explained
    assert "4 micro-batches held" in explained and "in run.yaml: parallel: {pp: 4};" in explained


MESHED = {"tp2": "{tp: 2}", "pp2": "{pp: 2}"}


@pytest.mark.cluster
@pytest.mark.xdist_group("plan-measure")
@pytest.mark.parametrize("name", list(MESHED))
def test_plan_matches_what_two_tensor_or_pipeline_parallel_ranks_measure(cluster: Cli, name: str) -> None:
    # ddp-fp32's model, its one copy split over the two ranks.
    model = "{layers: 4, hidden: 256, heads: 4, seq_len: 128}"
    run = write(cluster.cwd / f"{name}.yaml", f"name: {name}\nmodel: {model}\nbatch_size: 16\n"
                                               f"parallel: {MESHED[name]}\nnodes: {{min: 2, max: 2}}\n")  # fmt: skip
    result = json.loads(cluster("plan", str(run), "--measure", "--steps", "2", "--json").stdout)
    assert [r["dp"] for r in result["reports"]] == [1, 1]
    for component, tolerance in TOLERANCE.items():
        predicted, measured = result["predicted"][component], result["measured"][component]
        assert abs(measured - predicted) <= tolerance * predicted, (component, predicted, measured, result)
    if name == "tp2":  # each rank holds half of every block
        assert result["predicted"]["parameters"] == 4 * memory.rank_parameters(load_run(run).model, tp=2)
    else:  # the first stage holds both embeddings, the last the final norm
        assert result["reports"][0]["parameters"] > result["reports"][1]["parameters"]
