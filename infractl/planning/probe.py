"""``infractl plan --measure``: a short real run of the run.yaml on the cluster whose ranks report
the memory each component took (trainer/memprobe.py), set beside the planner's prediction
(memory.budget) for the same layout: the ranks' data-parallel degree and micro-batch, as
they report them, and the run's tensor- and pipeline-parallel split.

The comparison is per device: for each component the largest report of any rank. The peak is
compared with the prediction less what the measurement cannot see: the fragmentation margin
(the probe measures tensors, not an allocator's slack) and, on CUDA, the reserve
(``max_memory_allocated`` does not count the CUDA context).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infractl import launcher, runstore
from infractl.config import RunSpec, derive_run
from infractl.errors import TrainingError
from infractl.log import LogFormat
from infractl.planning import plan
from infractl.statedir import ClusterState
from infractl.store import Store, for_cluster

__all__ = ["COMPONENTS", "Comparison", "compare", "read_reports", "run_probe"]

COMPONENTS = ("parameters", "gradients", "optimizer", "activations", "peak")


@dataclass(frozen=True)
class Comparison:
    run: str
    world_size: int
    device: str
    steps: int
    predicted: dict[str, int]  # component -> bytes per device
    measured: dict[str, int]  # component -> the largest of any rank
    reports: list[dict[str, Any]]  # every rank's report, as trainer/memprobe.py wrote it

    def error(self, component: str) -> float:
        """(measured - predicted) / predicted."""
        return (self.measured[component] - self.predicted[component]) / self.predicted[component]

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "world_size": self.world_size,
            "device": self.device,
            "steps": self.steps,
            "predicted": self.predicted,
            "measured": self.measured,
            "error": {c: round(self.error(c), 4) for c in COMPONENTS},
            "reports": self.reports,
        }


def run_probe(state: ClusterState, spec: RunSpec, run_file: Path, *, steps: int, log_format: LogFormat) -> Comparison:
    """Run ``steps`` probe steps of ``spec`` on the cluster, compare, keep the comparison in the
    store (``runstore.plan_measured_key``) and delete the probe run."""
    probe = derive_run(spec, run_file, suffix="-memory", steps=steps, eval={"every": 0}, profile={"steps": None})
    launcher.run_to_end(
        state,
        probe,
        run_file,
        command="plan --measure",
        log_format=log_format,
        trainer_args=["--measure-memory", str(steps)],
    )
    store = for_cluster(state)
    result = compare(spec, read_reports(store, probe.name), steps=steps)
    store.put_bytes(runstore.plan_measured_key(spec.name), json.dumps(result.to_dict(), indent=1).encode())
    store.delete_prefix(runstore.run_prefix(probe.name) + "/")
    return result


def compare(spec: RunSpec, reports: list[dict[str, Any]], *, steps: int) -> Comparison:
    """The ranks' ``reports`` of a probe run of ``spec`` beside the planner's prediction."""
    first = reports[0]
    world = int(first["world_size"])
    cuda = first["device"] == "cuda"
    budget = plan.spec_budget(spec, ranks=int(first["dp"]), micro_batch=int(first["micro_batch"]), cuda=cuda)
    unseen = budget.fragmentation + (budget.reserve if cuda else 0)
    predicted = {c: getattr(budget, c) for c in COMPONENTS[:-1]} | {"peak": budget.total - unseen}
    measured = {c: max(int(r[c]) for r in reports) for c in COMPONENTS}
    return Comparison(spec.name, world, str(first["device"]), steps, predicted, measured, reports)


def read_reports(store: Store, probe: str) -> list[dict[str, Any]]:
    """Every rank's report of probe run ``probe``; ``TrainingError`` naming its logs when a rank
    wrote none."""
    prefix = runstore.run_prefix(probe) + "/memory/"
    reports = [json.loads(store.get_bytes(o.key)) for o in store.list(prefix) if o.key.endswith(".json")]
    reports.sort(key=lambda r: int(r["rank"]))
    world = int(reports[0]["world_size"]) if reports else 0
    if not reports or len(reports) != world:
        raise TrainingError(
            f"the memory probe of run {probe!r} reported from {len(reports)} of {world or 'its'} rank(s); "
            f"see `infractl logs --run {probe}`"
        )
    return reports
