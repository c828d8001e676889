"""`infractl plan` for published training configurations, beside what their authors report.

Each configuration below is a published run of a ~70B or ~7-8B decoder (MosaicML's llm-foundry
benchmark tables, torchtitan's end-of-2024 H100 benchmarks), with the facts its source states and
the sources' addresses next to them. For each, a run in our model family with the published layers,
hidden size, heads, sequence length and global batch, in bf16, is sized by the planner itself
(``infractl.planning.plan.plan`` on ``infractl.planning.devices.device``: what `infractl plan
RUN.yaml --device D --gpus-per-node 8 --max-nodes N` runs) and printed as a markdown table:

- published: the layout, micro-batch x gradient accumulation = global batch, precision,
  activation checkpointing and memory per device, as the source states them ("not stated"
  where it does not);
- `plan` recommends: the way to train it and the fewest devices it fits on (up to
  ``SEARCH_NODES`` nodes of the published node size), with its budget per device; and, where
  that is more devices than the authors used, what the same search finds on theirs;
- their layout, our budget: ``memory.budget`` (the sum `plan` adds up) for the published scheme,
  degrees and micro-batch, with activation checkpointing of every block as published (selective
  checkpointing, which the trainer does not have, as the range from every block to none).

The runs here leave run.yaml's ``micro_batch`` unset, as a team that has not chosen one would:
the planner sizes each rank's share of the global batch as one forward/backward pass, and
accumulates gradients (the largest passes that fit) only when no way fits a whole share, which
is what it finds on the published devices where they are fewer than its recommendation; "their
layout" sizes the published micro-batch. Our model family is the trainer's byte-level GPT
(vocabulary 256, LayerNorm, GELU MLP of 4h, multi-head attention, tied embeddings, learned
positions, fp32 weights and AdamW state under bf16 autocast); each configuration's ``differs``
says what the published model has instead.

    python bench/published_configs.py [--json out.json]

Instant: nothing is trained, no device is needed. docs/sizing.md's "Published configurations"
table is this script's output.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from infractl.config import ModelSpec, RunSpec  # noqa: E402
from infractl.planning import memory  # noqa: E402
from infractl.planning.devices import device  # noqa: E402
from infractl.planning.memory import Budget, ModelSplit  # noqa: E402
from infractl.planning.plan import Option, plan  # noqa: E402

GIB = 1 << 30
#: Most nodes the fewest-devices search considers (1,024 devices in nodes of 8).
SEARCH_NODES = 128

# Sources, pinned to the commit read. llm-foundry's tables and yamls, and MPT's defaults, which the
# benchmark's yamls keep: learned_pos_emb True, norm_type 'low_precision_layernorm', tie_word_embeddings
# True, attn_type 'multihead_attention', ffn_type 'mptmlp' with GELU (llmfoundry/models/layers/ffn.py).
LLM_FOUNDRY = "https://github.com/mosaicml/llm-foundry/blob/8c8dd48f72168c5d51e2f7b151595892a8fba43d"
LLM_FOUNDRY_BENCHMARKS = f"{LLM_FOUNDRY}/scripts/train/benchmarking/README.md"
LLM_FOUNDRY_YAMLS = f"{LLM_FOUNDRY}/scripts/train/yamls/pretrain"
MPT_CONFIG = f"{LLM_FOUNDRY}/llmfoundry/models/mpt/configuration_mpt.py"
# torchtitan's end-of-2024 H100 benchmarks (docs/performance.md then), and the code at the torchtitan
# commit they name (9dec370): the model configs and code (RMSNorm, SwiGLU, RoPE, an untied output
# layer, vocab_size "defined later by tokenizer"), the presets, and the FSDP mixed-precision defaults
# (mixed_precision_param "bfloat16", mixed_precision_reduce "float32", torchtitan/config_manager.py).
TORCHTITAN_BENCHMARKS = (
    "https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/"
    "benchmarks/llama3_h100_202412_torchtitan.md"
)
TORCHTITAN = "https://github.com/pytorch/torchtitan/blob/9dec370ad26b5f8e9a7333a0e36165018262644b"
TORCHTITAN_MODELS = f"{TORCHTITAN}/torchtitan/models/llama/__init__.py"
TORCHTITAN_MODEL = f"{TORCHTITAN}/torchtitan/models/llama/model.py"
TORCHTITAN_DEFAULTS = f"{TORCHTITAN}/torchtitan/config_manager.py"
#: Meta's announcement: "Llama 3 uses a tokenizer with a vocabulary of 128K tokens", "grouped
#: query attention (GQA) across both the 8B and 70B sizes", "sequences of 8,192 tokens".
META_LLAMA3 = "https://ai.meta.com/blog/meta-llama-3/"

#: Every block checkpointed, or torchtitan's selective checkpointing (some of a block's saves kept).
Checkpointing = Literal["full", "selective"]


@dataclass(frozen=True)
class Published:
    """One published training run: what its source states, and our run that approximates it."""

    name: str  # our run's name
    model: str  # the published model
    layers: int
    hidden: int
    heads: int
    seq_len: int
    batch_size: int  # global, samples per optimizer step
    published_device: str  # as the source names it
    device: str  # the catalog device we size on
    devices: int
    gpus_per_node: int
    layout: str  # as the source states it
    scheme: memory.Scheme  # the published layout in our schemes (data-parallel part)
    tp: int
    micro_batch: int  # per forward/backward pass and data-parallel rank
    accumulation: int | None  # None: not stated
    precision: str  # as the source states it
    checkpointing_stated: str  # as the source states it
    checkpointing: Checkpointing  # how our budget sizes it
    memory_gib: float | None  # reported memory per device; None: not stated
    parameters: int | None  # the published count; None: not stated
    facts: str  # the source's own words or table row
    sources: tuple[tuple[str, str], ...]  # (what it gives, address)
    differs: str  # the published model against our family


CONFIGS = (
    Published(
        name="mpt-70b",
        model="MPT-70B",
        # mpt-70b.yaml: d_model 8192, n_heads 64, n_layers 80, expansion_ratio 4, vocab_size 50368.
        layers=80,
        hidden=8192,
        heads=64,
        seq_len=2048,
        batch_size=2048,
        published_device="H100 80GB",
        device="h100-80gb",
        devices=64,
        gpus_per_node=8,
        layout="FSDP FULL_SHARD over 64",
        scheme="fsdp",
        tp=1,
        micro_batch=8,
        accumulation=4,
        precision="amp_bf16 (MP mode DEFAULT)",
        checkpointing_stated="True",
        checkpointing="full",
        memory_gib=None,
        parameters=64862437376,
        facts=(
            "H100 80GB BF16 table (Model, SeqLen (T), # GPUs, GPU, MFU, HFU, Model TFLOP, MicroBatchSize, "
            "GradAccum, GlobalBatchSize, ..., Precision, MP Mode, Sharding Strategy, Activation Checkpointing, "
            "Activation CPUOffload, NumParams): | 70b | 2048 | 64 | h100_80gb | 42.57 | 56.76 | 421 | 8 | 4 | 2048 "
            "| 32 | 66523 | 1039 | 4194304 | amp_bf16 | DEFAULT | FULL_SHARD | True | False | 64862437376 |"
        ),
        sources=(
            ("table", LLM_FOUNDRY_BENCHMARKS),
            ("model", f"{LLM_FOUNDRY_YAMLS}/mpt-70b.yaml"),
            ("defaults", MPT_CONFIG),
        ),
        differs="vocabulary 50,368 (GPT-NeoX tokenizer); otherwise our family (LayerNorm, GELU 4h, multi-head)",
    ),
    Published(
        name="llama-3-1-70b",
        model="Llama 3.1 70B",
        # llama3_configs["70B"]: dim 8192, n_layers 80, n_heads 64, n_kv_heads 8, ffn_dim_multiplier 1.3.
        layers=80,
        hidden=8192,
        heads=64,
        # Not stated in Table 4; the repository's 70B preset (train_configs/llama3_70b.toml): seq_len = 8192.
        seq_len=8192,
        batch_size=512,
        published_device="H100, 96 GB HBM2e",
        device="h100-80gb",
        devices=256,
        gpus_per_node=8,
        layout="FSDP 32 x TP 8, torch.compile, Float8",
        scheme="fsdp",
        tp=8,
        micro_batch=16,
        accumulation=None,
        precision="Float8 linears; FSDP params bf16 (torchtitan's default)",
        checkpointing_stated="full",
        checkpointing="full",
        memory_gib=71.9,
        parameters=None,
        facts=(
            "Table 4: 2D parallelism (FSDP + TP) + torch.compile + Float8. Llama 3.1 70B model. 256 GPUs "
            "(FSDP 32, TP 8). Local batch size 16, global batch size 512. Full activation checkpointing. "
            "| 2D | 829 | 71.9 |. Each host has 8 NVIDIA H100 GPUs; each H100 GPU is equipped with 96GB HBM2e."
        ),
        sources=(
            ("table", TORCHTITAN_BENCHMARKS),
            ("sizes", TORCHTITAN_MODELS),
            ("preset", f"{TORCHTITAN}/train_configs/llama3_70b.toml"),
            ("model", TORCHTITAN_MODEL),
            ("defaults", TORCHTITAN_DEFAULTS),
            ("Meta", META_LLAMA3),
        ),
        differs=(
            "grouped-query attention (8 KV heads), SwiGLU MLP, RMSNorm, RoPE, 128K vocabulary with an untied "
            "output layer, Float8 matmuls"
        ),
    ),
    Published(
        name="mpt-7b",
        model="MPT-7B",
        # mpt-7b.yaml: d_model 4096, n_heads 32, n_layers 32, expansion_ratio 4, vocab_size 50368.
        layers=32,
        hidden=4096,
        heads=32,
        seq_len=2048,
        batch_size=384,
        published_device="A100 40GB",
        device="a100-40gb",
        devices=8,
        gpus_per_node=8,
        layout="FSDP FULL_SHARD over 8",
        scheme="fsdp",
        tp=1,
        micro_batch=12,
        accumulation=4,
        precision="bf16 (MP mode PURE)",
        checkpointing_stated="True",
        checkpointing="full",
        memory_gib=None,
        parameters=6658859008,
        facts=(
            "A100 40GB with 1600 Gbps node-node interconnect (RoCE) table (the same columns): | 7b | 2048 | 8 "
            "| a100_40gb | 50.92 | 67.89 | 158 | 12 | 4 | 384 | 14 | 29436 | 3679 | 786432 | bf16 | PURE "
            "| FULL_SHARD | True | False | 6658859008 |"
        ),
        sources=(
            ("table", LLM_FOUNDRY_BENCHMARKS),
            ("model", f"{LLM_FOUNDRY_YAMLS}/mpt-7b.yaml"),
            ("defaults", MPT_CONFIG),
        ),
        differs="vocabulary 50,368 (GPT-NeoX tokenizer); otherwise our family (LayerNorm, GELU 4h, multi-head)",
    ),
    Published(
        name="llama-3-1-8b",
        model="Llama 3.1 8B",
        # llama3_configs["8B"]: dim 4096, n_layers 32, n_heads 32, n_kv_heads 8, ffn_dim_multiplier 1.3.
        layers=32,
        hidden=4096,
        heads=32,
        # Not stated in Table 1; the repository's 8B preset (train_configs/llama3_8b.toml): seq_len = 8192.
        seq_len=8192,
        batch_size=16,
        published_device="H100, 96 GB HBM2e",
        device="h100-80gb",
        devices=8,
        gpus_per_node=8,
        layout="FSDP over 8",
        scheme="fsdp",
        tp=1,
        micro_batch=2,
        accumulation=None,
        precision="FSDP params bf16 (torchtitan's default)",
        checkpointing_stated="selective",
        checkpointing="selective",
        memory_gib=82.4,
        parameters=None,
        facts=(
            "Table 1: 1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch size "
            "16. Selective activation checkpointing. | FSDP | 5,762 | 82.4 |"
        ),
        sources=(
            ("table", TORCHTITAN_BENCHMARKS),
            ("sizes", TORCHTITAN_MODELS),
            ("preset", f"{TORCHTITAN}/train_configs/llama3_8b.toml"),
            ("model", TORCHTITAN_MODEL),
            ("defaults", TORCHTITAN_DEFAULTS),
            ("Meta", META_LLAMA3),
        ),
        differs=(
            "grouped-query attention (8 KV heads), SwiGLU MLP, RMSNorm, RoPE, 128K vocabulary with an untied "
            "output layer"
        ),
    ),
)


def _spec(config: Published) -> RunSpec:
    model = ModelSpec(layers=config.layers, hidden=config.hidden, heads=config.heads, seq_len=config.seq_len)
    return RunSpec(name=config.name, model=model, batch_size=config.batch_size, mixed_precision="bf16")


def _option(option: Option) -> dict[str, Any]:
    return {
        "way": option.label,
        "parallel": option.parallel,
        "activation_checkpointing": option.checkpointing,
        "mixed_precision": option.precision,
        "devices": option.tried,
        "nodes": option.nodes,
        "micro_batch": option.micro_batch,
        "accumulation": option.accumulation,
        "fits": option.devices is not None,
        "budget": option.budget.to_dict(),
        "shortfall_bytes": option.shortfall,
    }


def _recommended(spec: RunSpec, config: Published, *, max_nodes: int) -> dict[str, Any]:
    """`plan`'s recommendation within ``max_nodes`` nodes; when nothing fits, the closest runnable
    way (what `infractl plan` names when it exits 2)."""
    result = plan(spec, device(config.device), devices_per_node=config.gpus_per_node, max_nodes=max_nodes)
    if result.recommended is not None:
        return _option(result.recommended)
    return _option(min((o for o in result.options if o.runnable), key=lambda o: o.shortfall))


def _their_layout(spec: RunSpec, config: Published) -> dict[str, Any]:
    """Our budget for the published layout and micro-batch; selective checkpointing as the range
    from full checkpointing (``budget``) to none (``budget_without_checkpointing``)."""

    def sized(checkpointing: bool) -> Budget:
        return memory.budget(
            spec.model,
            scheme=config.scheme,
            ranks=config.devices // config.tp,
            micro_batch=config.micro_batch,
            precision="bf16",
            checkpointing=checkpointing,
            cuda=device(config.device).cuda,
            split=ModelSplit(tp=config.tp),
        )

    found = {
        "scheme": config.scheme,
        "tp": config.tp,
        "data_parallel": config.devices // config.tp,
        "micro_batch": config.micro_batch,
        "budget": sized(True).to_dict(),
    }
    if config.checkpointing == "selective":
        found["budget_without_checkpointing"] = sized(False).to_dict()
    return found


def size(config: Published) -> dict[str, Any]:
    """One configuration: the published facts, `plan`'s recommendation and our budget for theirs."""
    spec = _spec(config)
    chosen = device(config.device)
    published = {k: v for k, v in asdict(config).items() if k not in ("name", "device", "gpus_per_node", "sources")}
    return {
        "run": config.name,
        "published": published,
        "sources": [{"what": what, "url": url} for what, url in config.sources],
        "parameters": memory.parameters(spec.model),
        "device": chosen.name,
        "device_memory_bytes": chosen.memory_bytes,
        "devices_per_node": config.gpus_per_node,
        "recommended": _recommended(spec, config, max_nodes=SEARCH_NODES),
        "on_published_devices": _recommended(spec, config, max_nodes=config.devices // config.gpus_per_node),
        "published_layout": _their_layout(spec, config),
    }


def _gib(n: int | float) -> str:
    return f"{n / GIB:.1f} GiB"


def _nodes(n: int) -> str:
    return f"{n} node" if n == 1 else f"{n} nodes"


def _published_cell(p: dict[str, Any]) -> str:
    accumulation = "not stated" if p["accumulation"] is None else str(p["accumulation"])
    memory_gib = "not stated" if p["memory_gib"] is None else f"{p['memory_gib']} GiB"
    return (
        f"{p['layout']}; micro-batch {p['micro_batch']}, accumulation {accumulation}, global {p['batch_size']}; "
        f"{p['precision']}; activation checkpointing {p['checkpointing_stated']}; memory per device {memory_gib}"
    )


def _plan_cell(r: dict[str, Any]) -> str:
    rec, theirs = r["recommended"], r["on_published_devices"]
    if not rec["fits"]:
        return f"fits on no {SEARCH_NODES} nodes: {rec['way']} needs {_gib(rec['budget']['total'])}"
    cell = (
        f"{rec['way']} on {rec['devices']} devices ({_nodes(rec['nodes'])}), micro-batch {rec['micro_batch']}: "
        f"{_gib(rec['budget']['total'])}"
    )
    if not theirs["fits"]:
        cell += (
            f"; on their {theirs['devices']}: micro-batch {theirs['micro_batch']}, {theirs['way']} needs "
            f"{_gib(theirs['budget']['total'])}, does not fit"
        )
    elif theirs["devices"] != rec["devices"]:
        cell += (
            f"; on their {theirs['devices']}: {theirs['way']}, {theirs['accumulation']} passes of micro-batch "
            f"{theirs['micro_batch']}: {_gib(theirs['budget']['total'])}"
        )
    return cell


def _their_layout_cell(r: dict[str, Any]) -> str:
    t = r["published_layout"]
    layout = f"{t['scheme']} over {t['data_parallel']}" + (f" x tp {t['tp']}" if t["tp"] > 1 else "")
    if "budget_without_checkpointing" in t:
        sized = (
            f"{_gib(t['budget']['total'])} (every block checkpointed) to "
            f"{_gib(t['budget_without_checkpointing']['total'])} (none)"
        )
    else:
        sized = _gib(t["budget"]["total"])
    return f"{layout}, micro-batch {t['micro_batch']}: {sized}"


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table docs/sizing.md shows."""
    lines = [
        "| model (ours: layers x hidden, heads, sequence; parameters) | device x devices | published "
        "| `plan` recommends (per-device budget) | their layout, our budget | source |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        p = r["published"]
        theirs = "not stated" if p["parameters"] is None else f"{p['parameters'] / 1e9:.2f} B"
        model = (
            f"{p['model']} ({p['layers']} x {p['hidden']}, {p['heads']} heads, {p['seq_len']}; "
            f"{r['parameters'] / 1e9:.2f} B, theirs {theirs})"
        )
        devices = (
            f"{p['published_device']} x {p['devices']} ({_nodes(p['devices'] // r['devices_per_node'])} of "
            f"{r['devices_per_node']}); sized as {r['device']} ({_gib(r['device_memory_bytes'])})"
        )
        source = ", ".join(f"[{s['what']}]({s['url']})" for s in r["sources"])
        lines.append(
            f"| {model} | {devices} | {_published_cell(p)} | {_plan_cell(r)} | {_their_layout_cell(r)} | {source} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    args = parser.parse_args()
    results = [size(config) for config in CONFIGS]
    print(table(results))
    print("\nWhat each source states, in its own words or table row:\n")
    for r in results:
        print(f"- {r['published']['model']}: {r['published']['facts']}")
    print(
        f"\nOurs: the trainer's byte-level GPT (vocabulary {memory.VOCAB}, LayerNorm, GELU MLP of 4h, multi-head "
        "attention, tied embeddings, learned positions; fp32 weights, gradients and AdamW state under bf16 "
        "autocast). What each published model has instead:\n"
    )
    for r in results:
        print(f"- {r['published']['model']}: {r['published']['differs']}.")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
