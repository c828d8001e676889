"""The planner against the published estimators and against a measurement, side by side.

For each run in examples/memory/ (ddp, zero1, fsdp; fp32 and bf16; with and without activation
checkpointing; 2 ranks), bytes per device as:

- ours: `infractl plan`'s peak (infractl/planning/memory.py, less the fragmentation margin the
  measurement cannot see), and its model states alone;
- DeepSpeed: the model-state formulas of its ZeRO papers and estimators (re-implemented from
  the documentation, not imported): no ZeRO 16Ψ, ZeRO-1 4Ψ + 12Ψ/N,
  ``estimate_zero2_model_states_mem_needs`` 4Ψ + 16Ψ/N, ``estimate_zero3_model_states_mem_needs``
  4·(largest layer) + 18Ψ/N. Model states only: no activations, buffers or runtime;
- accelerate: ``accelerate estimate-memory``'s "training using Adam", 4x the model's size in the
  run's dtype (1x weights, 1x gradients, 2x Adam), whatever the sharding;
- measured: the peak a real probe run recorded on each rank (trainer/memprobe.py, what
  `infractl plan --measure` prints), the largest rank's.

    python bench/planner_vs_peers.py [--steps 3] [--json results.json] [RUN.yaml ...]
    python bench/planner_vs_peers.py --sweep 24 --seed 1 [--steps 3] [--json results.json]

``--sweep N`` probes N shapes the planner was not tuned on instead, drawn from a generator seeded
by ``--seed`` (``sweep_specs``): depth, width, heads, sequence, micro-batch, layout (ddp, zero1,
fsdp, tensor parallel, pipeline), precision and activation checkpointing, each small enough to
probe in seconds. It prints the prediction beside the measurement for each shape, and the
distribution of the peak's error, (measured - predicted) / predicted: its least, median and
largest, the median of its size, and how many shapes peaked more than the planner promises above the
prediction (``accuracy.PEAK_PROMISE``).

Each probe is a standalone torchrun of 2 ranks with its own file store (about 10 s each on 2
cores), run as one node, in the layout `infractl plan --measure` gives it on two nodes of one
rank. RUN.yaml files replace examples/memory/ (the CI smoke test sweeps 4 tiny shapes;
`infractl plan --measure` of every example is a test in tests/test_plan.py). Not a test: it
asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.trainer import torchrun  # noqa: E402
from infractl.config import NodeRange, RunSpec, load_run  # noqa: E402
from infractl.planning import accuracy, memory  # noqa: E402
from infractl.planning.probe import compare, read_reports  # noqa: E402
from infractl.store import open_store  # noqa: E402

CONFIGS = sorted((REPO / "examples" / "memory").glob("*.yaml"))
MIB = 1 << 20
RANKS = 2


def deepspeed(spec: RunSpec, ranks: int) -> int:
    """DeepSpeed's model-state bytes per device for the run's scheme (see the module docstring)."""
    psi = memory.parameters(spec.model)
    if spec.parallel.scheme == "ddp":
        return 16 * psi
    if spec.parallel.scheme == "zero1":
        return 4 * psi + 12 * psi // ranks
    # fsdp shards like ZeRO-3; the largest layer is the tied embedding or a block's MLP matrix.
    h = spec.model.hidden
    largest = max(memory.VOCAB * h, 4 * h * h + 4 * h)
    return 4 * largest + 18 * psi // ranks


def accelerate(spec: RunSpec) -> int:
    """accelerate estimate-memory's "training using Adam": 4x the model in the run's dtype."""
    per_value = 2 if spec.mixed_precision == "bf16" else 4
    return 4 * per_value * memory.parameters(spec.model)


def sweep_specs(count: int, seed: int) -> list[RunSpec]:
    """``count`` runs of 2 ranks drawn from ``random.Random(seed)``: the same list for the same
    arguments. Layouts: ddp, zero1, fsdp (2 data-parallel ranks), tensor parallel over both
    ranks, 2 pipeline stages (1f1b, 2 micro-batches); 1 to 6 blocks (an even number for the
    pipeline), 1 to 8 heads of 8, 16 or 32 values (an even number for tensor parallel, which
    splits them), sequences of 16 to 256 tokens, 1 to 8 sequences a pass; fp32 or bf16; with or
    without activation checkpointing."""
    rng = random.Random(seed)
    specs = []
    for index in range(count):
        layout = rng.choice(("ddp", "zero1", "fsdp", "tp", "pp"))
        layers = 2 * rng.randint(1, 3) if layout == "pp" else rng.randint(1, 6)
        heads = 2 * rng.randint(1, 4) if layout == "tp" else rng.randint(1, 8)
        hidden = heads * rng.choice((8, 16, 32))
        seq_len = rng.choice((16, 32, 64, 96, 128, 192, 256))
        micro = rng.randint(1, 8)
        parallel: str | dict[str, int] = (
            {"tp": RANKS} if layout == "tp" else {"pp": RANKS} if layout == "pp" else layout
        )
        # A pass holds `micro` sequences: each data-parallel rank's share, or each of a pipeline's 2 micro-batches.
        batch = micro if layout == "tp" else micro * RANKS
        specs.append(
            RunSpec.model_validate(
                {
                    "name": f"sweep-{seed}-{index}",
                    "model": {"layers": layers, "hidden": hidden, "heads": heads, "seq_len": seq_len},
                    "batch_size": batch,
                    "parallel": parallel,
                    "mixed_precision": rng.choice(("fp32", "bf16")),
                    "activation_checkpointing": rng.random() < 0.5,
                    "nodes": {"min": RANKS, "max": RANKS},
                }
            )
        )
    return specs


def probe(spec: RunSpec, *, steps: int, tmp: Path) -> dict[str, Any]:
    """Run the memory probe of ``spec`` on 2 ranks; the comparison `plan --measure` prints."""
    run_dir = tmp / spec.name
    (run_dir / "store").mkdir(parents=True)
    spec_path = run_dir / "spec.json"
    # torchrun --standalone starts both ranks on one node, and the trainer sizes a pass for
    # nodes.max nodes of that node's ranks (trainer/mesh.py): a run of 2 nodes would be read as
    # 2 x 2 ranks, half the micro-batch in two passes. One node of nodes.max ranks is the layout
    # `plan --measure` runs on the local cluster's nodes.max nodes of one rank.
    ranks = spec.nodes.max
    one_node = spec.model_copy(update={"nodes": NodeRange(min=1, max=1)})
    spec_path.write_text(one_node.model_dump_json())
    store_uri = (run_dir / "store").as_uri()
    torchrun(
        ["-m", "trainer.train", "--spec", str(spec_path), "--store", store_uri, "--run-id", spec.name,
         "--workdir", str(run_dir / "work"), "--measure-memory", str(steps)],
        cwd=run_dir,
        world=ranks,
    )  # fmt: skip
    result = compare(spec, read_reports(open_store(store_uri), spec.name), steps=steps)
    return {
        "run": spec.name,
        "ranks": result.world_size,
        "micro_batch": int(result.reports[0]["micro_batch"]),
        "ours_peak": result.predicted["peak"],
        "ours_model_states": sum(result.predicted[c] for c in ("parameters", "gradients", "optimizer")),
        "deepspeed": deepspeed(spec, result.world_size),
        "accelerate": accelerate(spec),
        "measured_peak": result.measured["peak"],
        "measured_model_states": sum(result.measured[c] for c in ("parameters", "gradients", "optimizer")),
        "peak_error": round(result.error("peak"), 4),
        "predicted": result.predicted,
        "measured": result.measured,
    }


def _row(r: dict[str, Any]) -> str:
    def cell(key: str) -> str:
        error = (r[key] - r["measured_peak"]) / r["measured_peak"]
        return f"{r[key] / MIB:7.1f} ({error:+.0%})"

    return (
        f"| {r['run']:<13} | {cell('ours_peak'):>16} | {cell('deepspeed'):>16} | {cell('accelerate'):>16} "
        f"| {r['measured_peak'] / MIB:7.1f} |"
    )


def _shape(spec: RunSpec) -> dict[str, Any]:
    model = spec.model
    return {
        "layers": model.layers,
        "hidden": model.hidden,
        "heads": model.heads,
        "seq_len": model.seq_len,
        "batch_size": spec.batch_size,
        "parallel": spec.parallel.label,
        "mixed_precision": spec.mixed_precision,
        "activation_checkpointing": spec.activation_checkpointing,
    }


def distribution(errors: list[float]) -> dict[str, float | int]:
    """The peak's errors, (measured - predicted) / predicted, summed up."""
    return {
        "min": min(errors),
        "median": statistics.median(errors),
        "max": max(errors),
        "median_abs": statistics.median(abs(e) for e in errors),
        "above_promise": sum(e > accuracy.PEAK_PROMISE for e in errors),
    }


def _print_sweep(rows: list[dict[str, Any]], summary: dict[str, float | int]) -> None:
    print("Peak bytes per device, MiB: the planner's prediction and the probe's measurement.\n")
    print("| run         | layers x hidden (heads) | seq | batch | parallel | precision | AC  "
          "| predicted | measured | error  | activations error |")  # fmt: skip
    print("|-------------|---|---:|---:|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        act = (r["measured"]["activations"] - r["predicted"]["activations"]) / r["predicted"]["activations"]
        print(
            f"| {r['run']:<11} | {r['layers']} x {r['hidden']} ({r['heads']}) | {r['seq_len']} | {r['batch_size']} "
            f"| {r['parallel']} | {r['mixed_precision']} | {'yes' if r['activation_checkpointing'] else 'no'} "
            f"| {r['ours_peak'] / MIB:.1f} | {r['measured_peak'] / MIB:.1f} | {r['peak_error']:+.1%} | {act:+.1%} |"
        )
    print(
        f"\nPeak error over {len(rows)} shapes, (measured - predicted) / predicted: min {summary['min']:+.1%}, "
        f"median {summary['median']:+.1%}, max {summary['max']:+.1%}; median |error| {summary['median_abs']:.1%}; "
        f"{summary['above_promise']} shape(s) more than {accuracy.PEAK_PROMISE:.0%} above the prediction."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="Probe steps per configuration.")
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    parser.add_argument("--sweep", type=int, metavar="N", help="Probe N generated shapes instead of run files.")
    parser.add_argument("--seed", type=int, default=0, help="The sweep's seed (with --sweep).")
    parser.add_argument("runs", nargs="*", type=Path, help="Run files to probe (default: examples/memory/*.yaml).")
    args = parser.parse_args()
    if args.sweep is not None and args.runs:
        parser.error("--sweep generates its runs: give no RUN.yaml")
    with tempfile.TemporaryDirectory(prefix="planner-vs-peers-") as tmp:
        if args.sweep is not None:
            specs = sweep_specs(args.sweep, args.seed)
            rows = [probe(s, steps=args.steps, tmp=Path(tmp)) | _shape(s) for s in specs]
            summary = distribution([r["peak_error"] for r in rows])
            _print_sweep(rows, summary)
            if args.json:
                results = {"seed": args.seed, "steps": args.steps, "peak_error": summary, "shapes": rows}
                args.json.write_text(json.dumps(results, indent=1))
            return
        runs = [path.resolve() for path in args.runs] or CONFIGS
        # A run file may lie outside the checkout.
        results = [
            probe(load_run(p), steps=args.steps, tmp=Path(tmp)) | {"file": os.path.relpath(p, REPO)} for p in runs
        ]
    print("Peak bytes per device, MiB (error against the measured peak):\n")
    print("| run           |             ours |        DeepSpeed |       accelerate | measured |")
    print("|---------------|-----------------:|-----------------:|-----------------:|---------:|")
    for r in results:
        print(_row(r))
    print("\nModel states alone (weights, gradients, optimizer state), MiB: what the estimators cover.\n")
    print("| run           |  ours | DeepSpeed | accelerate | measured |")
    print("|---------------|------:|----------:|-----------:|---------:|")
    for r in results:
        print(
            f"| {r['run']:<13} | {r['ours_model_states'] / MIB:5.1f} | {r['deepspeed'] / MIB:9.1f} "
            f"| {r['accelerate'] / MIB:10.1f} | {r['measured_model_states'] / MIB:8.1f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
