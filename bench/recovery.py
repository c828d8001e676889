"""Recovery benchmark: N kill-node drills in a row on one 2-node run, then one drill of every
other kind, on the local provider or on netns (nodes in network namespaces, reached over SSH).

What a user would type, in a scratch directory: ``infractl up``, ``infractl train --detach`` of a
long run, then ``infractl drill kill-node --node node-1 --repeat N --no-wait`` (node-1 is
SIGKILLed, node-0 goes on alone from the last committed step, node-1 rejoins, the world is 2
again, and the next drill starts); then ``infractl drill KIND --node node-1 --no-wait`` for
kill-during-checkpoint, hang-node, preempt and store-outage (and on netns: partition, the link
down, and partition:drop, its packets dropped, each for 20 s), with ``infractl rejoin node-1``
after each that removed the node; then ``infractl teardown``. Reports how many kill-node drills
recovered from the last committed step, the median and worst restart_s (fault -> first step
completed after resume) and rejoin_s (rejoin -> first step on 2 nodes again), and one line per
other kind.

    python bench/recovery.py [--provider local|netns] [--drills 20] [--kinds KIND,...] [--json results.json]

--kinds picks the other kinds (default: all of the provider's; ``none`` for the kill-node series
alone). The CI smoke test runs ``--drills 1 --kinds store-outage``: every kind is a test of
its own in tests/test_drill.py and tests/test_netns.py. netns needs root (see the README).

Not a test: it asserts nothing. The numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RUN = """\
name: recovery
model: {{layers: 2, hidden: 64, heads: 2, seq_len: 64}}
data: {{max_bytes: 200000}}
batch_size: 8
steps: 10000000
checkpoint: {{every: 10, keep: 2}}
nodes: {{min: 1, max: 2}}
max_restarts: {budget}
watchdog: {{step_timeout_s: 20}}
"""

CLUSTER = """\
name: recovery
provider: {provider}
nodes: 2
"""
# Every command after `up` names the benchmark's cluster.
_CLUSTER = ("-c", "recovery")

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


def _waited_for_first_commit(home: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = json.loads(_infractl(home, "status", *_CLUSTER, "--json", timeout=60).stdout)
        if any((run.get("last_committed_step") or 0) >= 10 for run in status.get("runs", [])):
            return
        time.sleep(1)
    raise SystemExit(f"the run committed no checkpoint within {timeout:g}s")


def _world_size(home: Path) -> int | None:
    status = json.loads(_infractl(home, "status", *_CLUSTER, "--json", timeout=60).stdout)
    return next((run.get("world_size") for run in status.get("runs", [])), None)


def _whole_again(home: Path) -> None:
    """Rejoin node-1 if the last drill left the run without it; wait for a step on 2 nodes."""
    if _world_size(home) == 2:
        return
    _infractl(home, "rejoin", "node-1", *_CLUSTER, timeout=60)
    deadline = time.monotonic() + 300
    while _world_size(home) != 2 and time.monotonic() < deadline:
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
        "results": [out],
    }


def measure(provider: str, drills: int, kinds: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="infractl-recovery-") as tmp:
        home = Path(tmp) / ".infractl"
        run = Path(tmp) / "run.yaml"
        # Every drill costs the surviving agent one restart; node-1 starts afresh at each rejoin.
        run.write_text(RUN.format(budget=drills + len(kinds) + 1))
        cluster = Path(tmp) / "cluster.yaml"
        cluster.write_text(CLUSTER.format(provider=provider))
        _infractl(home, "up", "-c", str(cluster), timeout=600)
        try:
            _infractl(home, "train", str(run), *_CLUSTER, "--detach", timeout=300)
            _waited_for_first_commit(home, timeout=300)
            started = time.monotonic()
            series = _kill_node_series(home, drills)
            elapsed = time.monotonic() - started
            others: list[dict[str, Any]] = []
            others_error = None
            try:
                _other_kinds(home, kinds, others)
            except SystemExit as exc:  # keep the figures so far if a later drill cannot run
                others_error = str(exc)
        finally:
            _infractl(home, "teardown", *_CLUSTER, "--yes", timeout=600)
    results = series["results"]
    rejoins = [r["rejoin_s"] for r in results if r.get("rejoin_s") is not None]
    detects = [r["detect_s"] for r in results if r.get("detect_s") is not None]
    return {
        "provider": provider,
        "drills": series["drills"],
        "succeeded": series["succeeded"],
        "resumed_from_last_committed": sum(1 for r in results if r["resumed_correctly"]),
        "median_restart_s": series["median_restart_s"],
        "worst_restart_s": series["worst_restart_s"],
        "median_detect_s": round(statistics.median(detects), 3) if detects else None,
        "median_rejoin_s": round(statistics.median(rejoins), 3) if rejoins else None,
        "median_lost_work_steps": statistics.median(
            [r["lost_work_steps"] for r in results if r["lost_work_steps"] is not None] or [0]
        ),
        "series_s": round(elapsed, 1),
        "restart_s": [r["restart_s"] for r in results],
        "other_kinds": [
            {
                k: r.get(k)
                for k in (
                    "drill",
                    "outcome",
                    "resumed_correctly",
                    "detect_s",
                    "restart_s",
                    "resumed_from_step",
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--provider", choices=("local", "netns"), default="local", help="default local")
    parser.add_argument("--drills", type=int, default=20, help="kill-node drills in the series (default 20)")
    parser.add_argument(
        "--kinds",
        help=f"the other kinds, one drill each, comma-separated, or none (default {','.join(OTHER_KINDS)}, "
        f"and on netns {','.join(LINK_KINDS)})",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.drills < 1:
        parser.error("--drills: at least 1")
    known = OTHER_KINDS + (LINK_KINDS if args.provider == "netns" else ())
    kinds = list(known) if args.kinds is None else [k.strip() for k in args.kinds.split(",") if k.strip()]
    kinds = [] if kinds == ["none"] else kinds
    unknown = sorted(set(kinds) - set(known))
    if unknown:
        parser.error(f"--kinds: unknown on {args.provider} {', '.join(unknown)} (known: {', '.join(known)}, or none)")
    report = measure(args.provider, args.drills, kinds)
    print(f"provider:                     {report['provider']}")
    print(
        f"kill-node drills recovered:   {report['succeeded']}/{report['drills']} "
        f"(resumed from the last committed step: {report['resumed_from_last_committed']})"
    )
    print(f"restart_s median / worst:     {report['median_restart_s']} / {report['worst_restart_s']}")
    print(f"detect_s median:              {report['median_detect_s']}")
    print(f"rejoin_s median:              {report['median_rejoin_s']}")
    print(f"lost work, median steps:      {report['median_lost_work_steps']}")
    print(f"series wall time (s):         {report['series_s']}")
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
    if report["other_kinds_error"]:
        print(f"other kinds stopped: {report['other_kinds_error']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
