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

Each probe is a standalone torchrun of 2 ranks with its own file store (about 10 s each on 2
cores). RUN.yaml files replace examples/memory/ (the CI smoke test probes one; `infractl plan
--measure` of every example is a test in tests/test_plan.py). Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.trainer import torchrun  # noqa: E402
from infractl.config import RunSpec, load_run  # noqa: E402
from infractl.planning import memory  # noqa: E402
from infractl.planning.probe import compare, read_reports  # noqa: E402
from infractl.store import open_store  # noqa: E402

CONFIGS = sorted((REPO / "examples" / "memory").glob("*.yaml"))
MIB = 1 << 20


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


def probe(spec: RunSpec, path: Path, *, steps: int, tmp: Path) -> dict[str, Any]:
    """Run the memory probe of ``spec`` on 2 ranks; the comparison `plan --measure` prints."""
    run_dir = tmp / spec.name
    (run_dir / "store").mkdir(parents=True)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(spec.model_dump_json())
    store_uri = (run_dir / "store").as_uri()
    torchrun(
        ["-m", "trainer.train", "--spec", str(spec_path), "--store", store_uri, "--run-id", spec.name,
         "--workdir", str(run_dir / "work"), "--measure-memory", str(steps)],
        cwd=run_dir,
        world=spec.nodes.max,
    )  # fmt: skip
    result = compare(spec, read_reports(open_store(store_uri), spec.name), steps=steps)
    ranks = result.world_size
    return {
        "run": spec.name,
        "file": os.path.relpath(path, REPO),  # a run file may lie outside the checkout
        "ranks": ranks,
        "ours_peak": result.predicted["peak"],
        "ours_model_states": sum(result.predicted[c] for c in ("parameters", "gradients", "optimizer")),
        "deepspeed": deepspeed(spec, ranks),
        "accelerate": accelerate(spec),
        "measured_peak": result.measured["peak"],
        "measured_model_states": sum(result.measured[c] for c in ("parameters", "gradients", "optimizer")),
    }


def _row(r: dict[str, Any]) -> str:
    def cell(key: str) -> str:
        error = (r[key] - r["measured_peak"]) / r["measured_peak"]
        return f"{r[key] / MIB:7.1f} ({error:+.0%})"

    return (
        f"| {r['run']:<13} | {cell('ours_peak'):>16} | {cell('deepspeed'):>16} | {cell('accelerate'):>16} "
        f"| {r['measured_peak'] / MIB:7.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="Probe steps per configuration.")
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    parser.add_argument("runs", nargs="*", type=Path, help="Run files to probe (default: examples/memory/*.yaml).")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="planner-vs-peers-") as tmp:
        runs = [path.resolve() for path in args.runs] or CONFIGS
        results = [probe(load_run(path), path, steps=args.steps, tmp=Path(tmp)) for path in runs]
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
