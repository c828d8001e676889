"""Recovery benchmark: N kill-node drills in a row on one 2-node run, then one drill of every
other kind, on the local provider or on netns (nodes in network namespaces, reached over SSH).

What a user would type, in a scratch directory: ``infractl up``, ``infractl train --detach`` of a
long run, then ``infractl drill kill-node --node node-1 --repeat N --no-wait`` (node-1 is
SIGKILLed, node-0 goes on alone from the last committed step, node-1 rejoins, the world is 2
again, and the next drill starts); then ``infractl drill KIND --node node-1 --no-wait`` for
kill-during-checkpoint, hang-node, preempt and store-outage (and on netns: partition, the link
down, and partition:drop, its packets dropped, each for 20 s), with ``infractl rejoin node-1``
after each that removed the node, each striking once the run trained ``SETTLE_STEPS`` steps on the
whole world; then ``infractl teardown``. Reports how many kill-node drills
recovered from the last committed step, the median and worst restart_s (fault -> first step
completed after resume), the median of each of its phases (detect, stop, rendezvous, startup,
load, first_step: infractl/drill/recovery.py), rejoin_s (rejoin -> first step on 2 nodes again),
and one line per other kind. Then the same kill-node series on a fresh cluster whose run.yaml
restarts cold (``COLD_RESTART``: a new Python per worker and the rendezvous timing before
trainer/rendezvous_patch.py's defaults) and no in-memory replicas (``replicate_every: 0``: a resume
from the store's commit), side by side, and the ratio of the two median restart_s. The default
series replicates every step; both runs are paced at ``PACE_S`` a step, as a real step is longer
than a replica's copy (this tiny model's is not).

With ``--chaos N``: a seeded series instead, ``infractl drill chaos --count N --seed S`` against
one deterministic 2-node run (random kinds, nodes (node-0 included) and moments, each fault
recovered from and the node back before the next), then the finished run compared with an
uninterrupted reference run of the same spec. Reports recovered/total, the median and worst
restart_s, the steps lost, the comparison, and one line per kind.

    python bench/recovery.py [--provider local|netns] [--drills 20] [--kinds KIND,...] [--json results.json]
    python bench/recovery.py [--provider local|netns] --chaos 50 [--seed 1] [--steps N] [--json results.json]

--kinds picks the other kinds (default: all of the provider's; ``none`` for the kill-node series
alone). The CI smoke tests run ``--drills 1 --kinds none`` and ``--chaos 1 --seed 0 --steps 300``
(seed 0 draws a store outage): every kind is a test of its own in tests/test_drill.py, and a
10-fault chaos series one in tests/test_netns.py. netns needs root (see docs/netns.md).

Not a test: it asserts nothing. The numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RUN = """\
name: recovery
model: {{layers: 2, hidden: 64, heads: 2, seq_len: 64}}
data: {{max_bytes: 200000}}
batch_size: 8
steps: 10000000
min_step_s: {pace}
checkpoint: {{every: 10, keep: 2, replicate_every: {replicate_every}}}
nodes: {{min: 1, max: 2}}
max_restarts: {budget}
watchdog: {{step_timeout_s: 20}}
"""
PACE_S = 0.1
# The side-by-side series: the restart before trainer/rendezvous_patch.py's defaults (a new Python per
# worker, a keep-alive every 2 s with 3 misses, a 3 s last call), and no replicas.
COLD_RESTART = "restart: {warm: false, keep_alive_s: 2, keep_alive_misses: 3, last_call_s: 3}\n"

CLUSTER = """\
name: recovery
provider: {provider}
nodes: 2
"""
# Every command after `up` names the benchmark's cluster.
_CLUSTER = ("-c", "recovery")

# The chaos series' run: deterministic (the comparison is bitwise where it can be), a step timeout
# of 8 s (a partition lasts twice that), a restart budget for every fault. It must outlast the
# series, and trains on between and during faults: about 330 steps per fault on this 2-core machine
# beside the test suite, 360 alone (a partition: about 800), so each fault is given 500.
CHAOS_RUN = """\
name: chaos
model: {{layers: 2, hidden: 64, heads: 2, seq_len: 64}}
data: {{max_bytes: 200000}}
batch_size: 8
steps: {steps}
checkpoint: {{every: 10, keep: 2}}
nodes: {{min: 1, max: 2}}
max_restarts: {budget}
deterministic: true
watchdog: {{step_timeout_s: 8}}
"""
CHAOS_STEPS_PER_FAULT = 500

OTHER_KINDS = ("kill-during-checkpoint", "hang-node", "preempt", "store-outage")
# Link cuts need links: netns only. KIND:LINK picks the partition's --kind.
LINK_KINDS = ("partition", "partition:drop")
PARTITION_S = 20


def _infractl(home: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "INFRACTL_HOME": str(home), "NO_COLOR": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "infractl", *args],
        cwd=home.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode not in (0, 1):  # 1: a drill did not recover; still a result to report
        raise SystemExit(f"infractl {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


@contextlib.contextmanager
def _training(provider: str, run_yaml: str) -> Iterator[Path]:
    """A fresh 2-node cluster of ``provider`` training ``run_yaml`` (its first checkpoint
    committed), torn down afterwards; yields the infractl home."""
    with tempfile.TemporaryDirectory(prefix="infractl-recovery-") as tmp:
        home = Path(tmp) / ".infractl"
        run = Path(tmp) / "run.yaml"
        run.write_text(run_yaml)
        cluster = Path(tmp) / "cluster.yaml"
        cluster.write_text(CLUSTER.format(provider=provider))
        _infractl(home, "up", "-c", str(cluster), timeout=600)
        try:
            _infractl(home, "train", str(run), *_CLUSTER, "--detach", timeout=300)
            _waited_for_first_commit(home, timeout=300)
            yield home
        finally:
            _infractl(home, "teardown", *_CLUSTER, "--yes", timeout=600)


def _waited_for_first_commit(home: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = json.loads(_infractl(home, "status", *_CLUSTER, "--json", timeout=60).stdout)
        if any((run.get("last_committed_step") or 0) >= 10 for run in status.get("runs", [])):
            return
        time.sleep(3)  # each look is a command of its own, about a second of CPU
    raise SystemExit(f"the run committed no checkpoint within {timeout:g}s")


#: Steps the run trains on the whole world before the next drill strikes: a restart's first steps
#: are not steady state (the collective timeout waits its maximum until it has seen 5 steps).
SETTLE_STEPS = 20


def _progress(home: Path) -> tuple[int | None, int | None]:
    """The run's world size and newest step, from `infractl status`."""
    status = json.loads(_infractl(home, "status", *_CLUSTER, "--json", timeout=60).stdout)
    run = next(iter(status.get("runs", [])), {})
    return run.get("world_size"), run.get("last_step")


def _whole_again(home: Path) -> None:
    """Rejoin node-1 if the last drill left the run without it; wait for ``SETTLE_STEPS`` steps
    on 2 nodes."""
    if _progress(home)[0] != 2:
        _infractl(home, "rejoin", "node-1", *_CLUSTER, timeout=60)
    deadline = time.monotonic() + 300
    first: int | None = None
    while time.monotonic() < deadline:
        world, step = _progress(home)
        if world == 2 and step is not None:
            first = step if first is None else first
            if step >= first + SETTLE_STEPS:
                return
        time.sleep(1)


def _other_kinds(home: Path, kinds: list[str], results: list[dict[str, Any]]) -> None:
    """One drill of each of ``kinds`` on the whole world, node-1 rejoining after any that removed
    it; each result is appended to ``results`` as soon as it is in."""
    for spec in kinds:
        _whole_again(home)
        kind, _, link = spec.partition(":")
        target = ["--seconds", "10"] if kind == "store-outage" else ["--node", "node-1"]
        if kind == "partition":
            target += ["--seconds", str(PARTITION_S), "--kind", link or "down"]
        drill = _infractl(home, "drill", kind, *target, *_CLUSTER, "--no-wait", "--json", timeout=900)
        results.append(json.loads(drill.stdout))


def _kill_node_series(home: Path, drills: int) -> dict[str, Any]:
    """``drill kill-node --repeat N`` (one drill: the plain drill, in the series' shape)."""
    repeat = ["--repeat", str(drills)] if drills > 1 else []
    out = json.loads(
        _infractl(
            home,
            "drill",
            "kill-node",
            "--node",
            "node-1",
            *repeat,
            *_CLUSTER,
            "--no-wait",
            "--json",
            timeout=drills * 600,
        ).stdout
    )
    if drills > 1:
        return out
    recovered = out["outcome"] == "recovered" and out["resumed_correctly"]
    return {
        "drills": 1,
        "succeeded": int(recovered),
        "median_restart_s": out["restart_s"],
        "worst_restart_s": out["restart_s"],
        "median_phases": out["phases"],
        "results": [out],
    }


def _summary(series: dict[str, Any], elapsed: float) -> dict[str, Any]:
    results = series["results"]
    rejoins = [r["rejoin_s"] for r in results if r.get("rejoin_s") is not None]
    detects = [r["detect_s"] for r in results if r.get("detect_s") is not None]
    lost = [r["lost_work_steps"] for r in results if r["lost_work_steps"] is not None] or [0]
    return {
        "drills": series["drills"],
        "succeeded": series["succeeded"],
        "resumed_from_last_committed": sum(1 for r in results if r["resumed_correctly"]),
        "resumed_from_replica": sum(1 for r in results if r.get("resumed_from") == "replica"),
        "median_restart_s": series["median_restart_s"],
        "worst_restart_s": series["worst_restart_s"],
        "median_detect_s": round(statistics.median(detects), 3) if detects else None,
        "median_phases": series["median_phases"],
        "median_rejoin_s": round(statistics.median(rejoins), 3) if rejoins else None,
        "median_lost_work_steps": statistics.median(lost),
        "worst_lost_work_steps": max(lost),
        "series_s": round(elapsed, 1),
        "restart_s": [r["restart_s"] for r in results],
    }


def measure(provider: str, drills: int, kinds: list[str]) -> dict[str, Any]:
    """The kill-node series and one drill of each other kind with the default restart, then the
    same series with ``COLD_RESTART`` on a fresh cluster."""
    # Every drill costs the surviving agent one restart; node-1 starts afresh at each rejoin.
    budget = drills + len(kinds) + 1
    with _training(provider, RUN.format(budget=budget, pace=PACE_S, replicate_every=1)) as home:
        started = time.monotonic()
        series = _kill_node_series(home, drills)
        elapsed = time.monotonic() - started
        others: list[dict[str, Any]] = []
        others_error = None
        try:
            _other_kinds(home, kinds, others)
        except SystemExit as exc:  # keep the figures so far if a later drill cannot run
            others_error = str(exc)
    with _training(provider, RUN.format(budget=budget, pace=PACE_S, replicate_every=0) + COLD_RESTART) as home:
        started = time.monotonic()
        cold = _summary(_kill_node_series(home, drills), time.monotonic() - started)
    fast = _summary(series, elapsed)
    return {
        "provider": provider,
        **fast,
        "cold": cold,
        "restart_ratio": round(cold["median_restart_s"] / fast["median_restart_s"], 2)
        if cold["median_restart_s"] and fast["median_restart_s"]
        else None,
        "other_kinds": [
            {
                k: r.get(k)
                for k in (
                    "drill",
                    "outcome",
                    "resumed_correctly",
                    "detect_s",
                    "restart_s",
                    "phases",
                    "resumed_from_step",
                    "resumed_from",
                    "lost_work_steps",
                    "world_size_after",
                    "emergency_checkpoint_step",
                    "emergency_checkpoint_s",
                    "rejoin_s",
                    "fault",
                )
            }
            for r in others
        ],
        "other_kinds_error": others_error,
    }


def measure_chaos(provider: str, count: int, seed: int, steps: int) -> dict[str, Any]:
    """``drill chaos --count COUNT --seed SEED`` against a fresh 2-node run of ``steps``, and its result."""
    with _training(provider, CHAOS_RUN.format(steps=steps, budget=min(100, count + 2))) as home:
        started = time.monotonic()
        series = json.loads(
            _infractl(
                home, "drill", "chaos", *_CLUSTER, "--count", str(count), "--seed", str(seed), "--min-gap", "1",
                "--json", timeout=count * 900 + 3600,
            ).stdout
        )  # fmt: skip
        elapsed = time.monotonic() - started
    results = series.pop("results")
    kinds: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        kinds.setdefault(r["drill"], []).append(r)
    return {
        "provider": provider,
        "steps": steps,
        "series_s": round(elapsed, 1),
        "nodes": {node: sum(1 for r in results if (r["node"] or "the store") == node) for node in
                  sorted({r["node"] or "the store" for r in results})},
        "per_kind": {
            kind: {
                "faults": len(rs),
                "recovered": sum(1 for r in rs if r["outcome"] == "recovered"),
                "median_restart_s": _median([r["restart_s"] for r in rs]),
                "median_rejoin_s": _median([r["rejoin_s"] for r in rs]),
            }
            for kind, rs in sorted(kinds.items())
        },
        **series,
    }  # fmt: skip


def _phase_line(phases: dict[str, float | None]) -> str:
    """``detect 0.26 | stop 0.01 | ...``: a restart's phases in order (infractl/drill/recovery.py)."""
    return " | ".join(f"{name} {seconds}" for name, seconds in phases.items()) or "none measured"


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def _print_chaos(report: dict[str, Any]) -> None:
    c = report["comparison"]
    print(f"provider:                     {report['provider']}")
    where = ", ".join(f"{node}: {n}" for node, n in report["nodes"].items())
    label = f"chaos series, seed {report['seed']}:"
    print(f"{label:<30}{report['recovered']}/{report['count']} faults recovered ({where})")
    print(f"restart_s median / worst:     {report['median_restart_s']} / {report['worst_restart_s']}")
    print(f"steps lost, all faults:       {report['lost_steps']}")
    if report["stopped"]:
        print(f"stopped:                      {report['stopped']}")
    if c is not None:
        weights = "bitwise" if c["weights_bitwise"] else f"relative difference {c['weights_rel_diff']:.1e}"
        print(
            f"against the reference run:    {'matches' if c['matches'] else 'DOES NOT MATCH'}: {c['bitwise_steps']} of "
            f"{c['steps']} steps bitwise (first step on another world size: {c['first_other_world_step']}), "
            f"largest loss difference {c['max_loss_rel_diff']:.1e}, final weights {weights}"
        )
    print(f"series wall time (s):         {report['series_s']} (run of {report['steps']} steps)")
    for kind, k in report["per_kind"].items():
        rejoin = f", rejoin_s median {k['median_rejoin_s']}" if k["median_rejoin_s"] is not None else ""
        print(f"{kind:<24} {k['recovered']}/{k['faults']} recovered, restart_s median {k['median_restart_s']}{rejoin}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--provider", choices=("local", "netns"), default="local", help="default local")
    parser.add_argument("--drills", type=int, default=20, help="kill-node drills in the series (default 20)")
    parser.add_argument(
        "--kinds",
        help=f"the other kinds, one drill each, comma-separated, or none (default {','.join(OTHER_KINDS)}, "
        f"and on netns {','.join(LINK_KINDS)})",
    )
    parser.add_argument("--chaos", type=int, metavar="N", help="a seeded chaos series of N faults instead")
    parser.add_argument("--seed", type=int, default=1, help="the chaos series' seed (default 1)")
    parser.add_argument(
        "--steps",
        type=int,
        help=f"the chaos run's steps (default {CHAOS_STEPS_PER_FAULT} per fault): it must outlast the series",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.drills < 1:
        parser.error("--drills: at least 1")
    if args.chaos is not None:
        if not 1 <= args.chaos <= 98:  # max_restarts is at most 100
            parser.error("--chaos: 1 to 98 faults")
        steps = args.steps or CHAOS_STEPS_PER_FAULT * args.chaos
        if steps < 20:
            parser.error("--steps: at least 20 (the first checkpoint is at step 10)")
        chaos = measure_chaos(args.provider, args.chaos, args.seed, steps)
        _print_chaos(chaos)
        if args.json:
            args.json.write_text(json.dumps(chaos, indent=1))
        return
    known = OTHER_KINDS + (LINK_KINDS if args.provider == "netns" else ())
    kinds = list(known) if args.kinds is None else [k.strip() for k in args.kinds.split(",") if k.strip()]
    kinds = [] if kinds == ["none"] else kinds
    unknown = sorted(set(kinds) - set(known))
    if unknown:
        parser.error(f"--kinds: unknown on {args.provider} {', '.join(unknown)} (known: {', '.join(known)}, or none)")
    report = measure(args.provider, args.drills, kinds)
    print(f"provider:                     {report['provider']}")
    for label, series in (("default restart", report), ("cold restart", report["cold"])):
        print(f"-- {label} --")
        print(
            f"kill-node drills recovered:   {series['succeeded']}/{series['drills']} "
            f"(resumed from the last committed step or a newer replica: {series['resumed_from_last_committed']}; "
            f"from a replica: {series['resumed_from_replica']})"
        )
        print(f"restart_s median / worst:     {series['median_restart_s']} / {series['worst_restart_s']}")
        print(f"detect_s median:              {series['median_detect_s']}")
        print("restart_s phases, median (s):  " + _phase_line(series["median_phases"]))
        print(f"rejoin_s median:              {series['median_rejoin_s']}")
        lost = f"{series['median_lost_work_steps']} / {series['worst_lost_work_steps']}"
        print(f"lost work, median / worst:    {lost} step(s)")
        print(f"series wall time (s):         {series['series_s']}")
    print(f"median restart_s, cold / default: {report['restart_ratio']}")
    for r in report["other_kinds"]:
        if r["drill"] == "store-outage":
            print(
                f"{r['drill']:<24} {r['outcome']}: store down {r['fault']['seconds']}s, first commit after the "
                f"fault at restart_s {r['restart_s']}"
            )
            continue
        extra = f", emergency checkpoint after {r['emergency_checkpoint_s']}s" if r["emergency_checkpoint_s"] else ""
        if r["rejoin_s"] is not None:
            extra += f", link {r['fault']['link']} {r['fault']['seconds']}s, whole again {r['rejoin_s']}s after it"
            extra += f" (rejoined by {r['fault'].get('rejoined_by')})"
        if "partial_step" in r["fault"]:
            extra += f", partial step {r['fault']['partial_step']} committed: {r['fault']['partial_step_committed']}"
        print(
            f"{r['drill']:<24} {r['outcome']}: detect_s {r['detect_s']}, restart_s {r['restart_s']}, "
            f"resumed from step {r['resumed_from_step']} (correct: {r['resumed_correctly']}), "
            f"lost {r['lost_work_steps']} step(s), world size after {r['world_size_after']}{extra}"
        )
        if r["phases"]:
            print(f"{'':<24} phases (s): {_phase_line(r['phases'])}")
    if report["other_kinds_error"]:
        print(f"other kinds stopped: {report['other_kinds_error']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
